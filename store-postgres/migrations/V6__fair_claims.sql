-- Fair claims across concurrency keys. The pickers over rows in claim order hold only the
-- rows without a key, so a claim never walks one key's backlog to reach other work; keyed
-- rows are reached per key, through indexes led by queue and key, which a claim walks one
-- distinct key at a time (a skip scan) in a rotation that continues from the queue's
-- cursor.
DROP INDEX instances_pick;
CREATE INDEX instances_pick ON instances (priority, eligible_at, id)
  WHERE status = 'runnable' AND concurrency_key IS NULL;
DROP INDEX instances_pick_fifo;
CREATE INDEX instances_pick_fifo ON instances (eligible_at, id)
  WHERE status = 'runnable' AND concurrency_key IS NULL;
CREATE INDEX instances_fair ON instances (queue, concurrency_key, priority, eligible_at, id)
  WHERE status = 'runnable' AND concurrency_key IS NOT NULL;
CREATE INDEX instances_fair_fifo ON instances (queue, concurrency_key, eligible_at, id)
  WHERE status = 'runnable' AND concurrency_key IS NOT NULL;

-- The key a full claim of the queue served last; the next claim starts after it.
CREATE TABLE claim_cursors (
  queue      text PRIMARY KEY,
  after_key  text NOT NULL
);

-- Exact token accounting: the part of a thousandth of a token not yet added, and whether
-- the last claim was cut short by the tokens (rows were left waiting for them).
ALTER TABLE rate_buckets
  ADD COLUMN carry int8 NOT NULL DEFAULT 0,
  ADD COLUMN backlog boolean NOT NULL DEFAULT false;
