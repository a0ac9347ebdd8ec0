-- Schedule pauses stored for the fleet: one row per schedule that was ever paused or
-- resumed through the store. Every worker's schedule runner reads its namespace's rows
-- before it fires a tick; `changed_at` (ms) is when the state last changed, and after a
-- resume only ticks strictly after it fire.
CREATE TABLE keel_schedule_states (
    namespace   TEXT NOT NULL,
    name        TEXT NOT NULL,
    paused      INTEGER NOT NULL,
    changed_at  INTEGER NOT NULL,
    PRIMARY KEY (namespace, name)
) WITHOUT ROWID;
