-- Operator views: listing a machine's instances by page and counting what ended lately,
-- and the registry of workers seen by heartbeat.

-- `keel list`: a machine's instances newest first, any status.
CREATE INDEX keel_instances_list ON keel_instances (namespace, machine, id);

-- Throughput and turnaround: instances that ended, by the time they ended.
CREATE INDEX keel_instances_ended
    ON keel_instances (updated_at)
    WHERE status IN ('done', 'failed');

-- Workers seen by heartbeat. `machines` and `namespaces` are JSON arrays.
CREATE TABLE keel_workers (
    id           TEXT    PRIMARY KEY,
    name         TEXT    NOT NULL,
    machines     TEXT    NOT NULL,
    namespaces   TEXT    NOT NULL,
    started_at   INTEGER NOT NULL,
    last_seen_at INTEGER NOT NULL
);
CREATE INDEX keel_workers_seen ON keel_workers (last_seen_at);
