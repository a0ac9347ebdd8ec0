-- Operator views: listing a machine's instances by page and counting what ended lately,
-- and the registry of workers seen by heartbeat.

-- `keel list`: a machine's instances newest first, any status.
CREATE INDEX instances_list ON instances (namespace, machine, id);

-- Throughput and turnaround: instances that ended, by the time they ended.
CREATE INDEX instances_ended ON instances (updated_at) WHERE status IN ('done', 'failed');

-- Workers seen by heartbeat.
CREATE TABLE workers (
  id           text        PRIMARY KEY,
  name         text        NOT NULL,
  machines     jsonb       NOT NULL,
  namespaces   text[]      NOT NULL,
  started_at   timestamptz NOT NULL,
  last_seen_at timestamptz NOT NULL
);
CREATE INDEX workers_seen ON workers (last_seen_at);
