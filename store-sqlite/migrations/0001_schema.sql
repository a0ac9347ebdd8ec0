-- Keel's logical schema on SQLite: the same tables and rules as the Postgres store.
-- Timestamps are INTEGER milliseconds since the Unix epoch; JSON is stored as TEXT.

CREATE TABLE keel_instances (
    id               INTEGER PRIMARY KEY AUTOINCREMENT, -- never reused, so ids only grow
    namespace        TEXT    NOT NULL,
    machine          TEXT    NOT NULL,
    machine_version  INTEGER NOT NULL,
    business_key     TEXT,
    queue            TEXT    NOT NULL,
    priority         INTEGER NOT NULL CHECK (priority BETWEEN 0 AND 4),
    concurrency_key  TEXT,
    status           TEXT    NOT NULL CHECK (status IN ('runnable', 'executing',
                         'awaiting_signal', 'awaiting_children', 'suspended', 'done',
                         'failed', 'cancelled')),
    position         TEXT    NOT NULL,
    context          TEXT    NOT NULL,          -- JSON object
    result           TEXT,                      -- JSON, when done
    awaits           TEXT,
    last_error       TEXT,
    attempt          INTEGER NOT NULL,
    errors           TEXT    NOT NULL,          -- JSON array of attempt errors
    revision         INTEGER NOT NULL,
    eligible_at      INTEGER NOT NULL,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    fencing_token    INTEGER NOT NULL,
    parent_id        INTEGER REFERENCES keel_instances (id),
    children_pending INTEGER NOT NULL DEFAULT 0 CHECK (children_pending >= 0),
    unique_key       BLOB,                      -- the user's key, verbatim
    unique_scope     INTEGER,                   -- bit i set = Status::ALL[i] occupies the key
    -- The key while the status is in scope and nobody else holds it, else NULL. Written by
    -- the store on every row change (not GENERATED): transitions the store drives itself
    -- (reap, release, delivery, barrier release) must never fail, so a row coming back
    -- into scope while another occupies its key simply does not hold it.
    unique_guard     BLOB,
    correlation_id   TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL
);

-- One occupant per unique key.
CREATE UNIQUE INDEX keel_instances_unique_guard
    ON keel_instances (unique_guard) WHERE unique_guard IS NOT NULL;

-- The claim picker: runnable rows in claim order.
CREATE INDEX keel_instances_claim
    ON keel_instances (priority, eligible_at, id) WHERE status = 'runnable';

-- The reaper and the concurrency-key check: executing rows.
CREATE INDEX keel_instances_executing
    ON keel_instances (lease_expires_at, id) WHERE status = 'executing';
CREATE INDEX keel_instances_executing_key
    ON keel_instances (concurrency_key) WHERE status = 'executing';

-- Addressing by business key: the newest instance with the key.
CREATE INDEX keel_instances_business_key
    ON keel_instances (namespace, machine, business_key, id) WHERE business_key IS NOT NULL;

CREATE INDEX keel_instances_parent ON keel_instances (parent_id, id) WHERE parent_id IS NOT NULL;

-- The inbox. Ids increase in arrival order.
CREATE TABLE keel_signals (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    target_id   INTEGER NOT NULL REFERENCES keel_instances (id),
    name        TEXT    NOT NULL,
    payload     TEXT    NOT NULL,               -- JSON
    dedup_key   TEXT,
    inserted_at INTEGER NOT NULL,
    UNIQUE (target_id, dedup_key)               -- NULL keys never collide
);
CREATE INDEX keel_signals_target ON keel_signals (target_id, id);

-- Append-only audit trail.
CREATE TABLE keel_history (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    instance_id INTEGER NOT NULL REFERENCES keel_instances (id),
    at          INTEGER NOT NULL,
    revision    INTEGER NOT NULL,
    attempt     INTEGER NOT NULL,
    kind        TEXT    NOT NULL,
    data        TEXT    NOT NULL                -- JSON
);
CREATE INDEX keel_history_instance ON keel_history (instance_id, seq);

CREATE TABLE keel_dead_letters (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    instance_id      INTEGER NOT NULL REFERENCES keel_instances (id),
    namespace        TEXT    NOT NULL,
    machine          TEXT    NOT NULL,
    machine_version  INTEGER NOT NULL,
    position         TEXT    NOT NULL,
    signals          TEXT    NOT NULL,          -- JSON array of signal ids
    event            TEXT,                      -- JSON
    correlation_id   TEXT,
    reason           TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    errors           TEXT    NOT NULL,          -- JSON array of attempt errors
    first_attempt_at INTEGER NOT NULL,
    last_attempt_at  INTEGER NOT NULL,
    created_at       INTEGER NOT NULL
);
CREATE INDEX keel_dead_letters_machine ON keel_dead_letters (namespace, machine, id);

-- Queue settings (pause / resume).
CREATE TABLE keel_queues (
    namespace  TEXT    NOT NULL,
    queue      TEXT    NOT NULL,
    paused     INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (namespace, queue)
);
