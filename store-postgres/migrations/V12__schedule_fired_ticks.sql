-- Keel schema, version 12: each schedule's latest fired tick, recorded for every worker
-- and every restart. A tick's own keys do not last (a read broadcast frees its dedup key,
-- a pruned instance its uniqueness key), so without this a restart set to catch up fired
-- the latest past tick again. A row may now record only fired ticks, with no pause ever
-- stored: `changed_at` is NULL then. No tick at or before `fired_through` fires again.
ALTER TABLE schedule_states
  ALTER COLUMN changed_at DROP NOT NULL,
  ADD COLUMN fired_through timestamptz;
