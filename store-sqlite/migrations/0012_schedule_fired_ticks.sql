-- Each schedule's latest fired tick, recorded for every worker and every restart: a tick's
-- own keys do not last (a read broadcast frees its dedup key, a pruned instance its
-- uniqueness key), so without this a restart set to catch up fired the latest past tick
-- again. A row may now record only fired ticks, with no pause ever stored: `changed_at`
-- becomes nullable (NULL = no pause or resume stored), which SQLite only allows by
-- rebuilding the table. `fired_through` (ms) is the latest tick fired; no tick at or
-- before it fires again.
CREATE TABLE keel_schedule_states_new (
    namespace      TEXT NOT NULL,
    name           TEXT NOT NULL,
    paused         INTEGER NOT NULL,
    changed_at     INTEGER,
    fired_through  INTEGER,
    PRIMARY KEY (namespace, name)
) WITHOUT ROWID;
INSERT INTO keel_schedule_states_new (namespace, name, paused, changed_at)
    SELECT namespace, name, paused, changed_at FROM keel_schedule_states;
DROP TABLE keel_schedule_states;
ALTER TABLE keel_schedule_states_new RENAME TO keel_schedule_states;
