-- The claim takes only the first runnable row of each concurrency key (in claim order), so
-- a batch is not shortened by rows it would have to drop; this index answers "is there an
-- earlier runnable row of this key" without touching rows of other keys.
CREATE INDEX instances_key_runnable ON instances (concurrency_key, priority, eligible_at, id)
  WHERE status = 'runnable' AND concurrency_key IS NOT NULL;
