-- A fifo queue claims in eligible order alone (priorities ignored); this index serves that
-- order the way instances_pick serves the priority order.
CREATE INDEX instances_pick_fifo ON instances (eligible_at, id) WHERE status = 'runnable';

-- Up to K executing rows per concurrency key: each executing row of a key holds one of
-- the key's slots 0..K-1, and the unique index makes two claimers racing for the same slot
-- fail (the loser re-runs its claim). With K = 1 every claim takes slot 0: one at a time.
ALTER TABLE instances ADD COLUMN key_slot int2 NOT NULL DEFAULT 0;
DROP INDEX instances_concurrency;
CREATE UNIQUE INDEX instances_concurrency ON instances (concurrency_key, key_slot)
  WHERE status = 'executing' AND concurrency_key IS NOT NULL;

-- One token bucket per rate-limited queue: tokens left (thousandths) and when they were
-- computed; a rate-limited claim refills, spends and writes it under the queue's claim lock.
CREATE TABLE rate_buckets (
  queue        text        PRIMARY KEY,
  millitokens  int8        NOT NULL,
  at           timestamptz NOT NULL
);
