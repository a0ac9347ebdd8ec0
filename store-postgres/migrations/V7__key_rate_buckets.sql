-- One token bucket per concurrency key of a queue with a per-key rate limit, written by
-- the claims of the queue under its claim lock. Besides the bucket (tokens left in
-- thousandths, when they were computed, the part of a thousandth not yet added, and whether
-- the key's last claim was cut short by its tokens), each row holds the times, in epoch
-- milliseconds, at which the bucket holds 1, 2, … whole tokens, so the claim statement
-- counts a key's tokens by comparing times, and when it is full again: a full bucket
-- whose key has no ready row is deleted.
CREATE TABLE key_rate_buckets (
  queue            text NOT NULL,
  concurrency_key  text NOT NULL,
  millitokens      int8 NOT NULL,
  at_ms            int8 NOT NULL,
  carry            int8 NOT NULL,
  backlog          boolean NOT NULL,
  token_times      int8[] NOT NULL,
  full_at_ms       int8 NOT NULL,
  PRIMARY KEY (queue, concurrency_key)
);
CREATE INDEX key_rate_buckets_full ON key_rate_buckets (queue, full_at_ms);
