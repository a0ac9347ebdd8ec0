-- Schedule pauses stored for the fleet: one row per schedule that was ever paused or
-- resumed through the store. Every worker's schedule runner reads its namespace's rows
-- before it fires a tick; `changed_at` is when the state last changed, and after a
-- resume only ticks strictly after it fire.
CREATE TABLE schedule_states (
  namespace   text        NOT NULL,
  name        text        NOT NULL,
  paused      boolean     NOT NULL,
  changed_at  timestamptz NOT NULL,
  PRIMARY KEY (namespace, name)
);
