-- Charts and timers (Store contract after `main` a3a8099): delegated children that report
-- to their parent's inbox, durable timers, and the sweep times timer status reports.
-- Existing databases migrate forward: the new column is NULL for existing rows.

-- For a child started by a chart delegation state: that state's path in the parent.
ALTER TABLE keel_instances ADD COLUMN invoked_by TEXT;

-- Broadcast: non-terminal instances of a machine in a namespace.
CREATE INDEX keel_instances_machine
    ON keel_instances (namespace, machine, id)
    WHERE status NOT IN ('done', 'failed', 'cancelled');

-- Armed timers. A row exists while its owning state is active and the timer has fires left.
CREATE TABLE keel_timers (
    id              INTEGER PRIMARY KEY AUTOINCREMENT, -- never reused: it is in dedup keys
    instance_id     INTEGER NOT NULL REFERENCES keel_instances (id),
    namespace       TEXT    NOT NULL,
    machine         TEXT    NOT NULL,
    machine_version INTEGER NOT NULL,
    spec            TEXT    NOT NULL,          -- JSON `TimerArm`
    next_fire_at    INTEGER NOT NULL,
    fire_count      INTEGER NOT NULL CHECK (fire_count >= 0),
    armed_at        INTEGER NOT NULL
);
-- The sweep picker: due timers in due order.
CREATE INDEX keel_timers_due ON keel_timers (next_fire_at, id);
CREATE INDEX keel_timers_instance ON keel_timers (instance_id, next_fire_at, id);
CREATE INDEX keel_timers_machine ON keel_timers (namespace, machine);

-- When a sweep last ran, per scope: namespace or '*', machine name or '*'.
CREATE TABLE keel_timer_sweeps (
    namespace TEXT    NOT NULL,
    machine   TEXT    NOT NULL,
    swept_at  INTEGER NOT NULL,
    PRIMARY KEY (namespace, machine)
);
