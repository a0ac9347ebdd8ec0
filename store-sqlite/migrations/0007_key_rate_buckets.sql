-- One token bucket per concurrency key of a queue with a per-key rate limit: tokens left
-- (thousandths), when they were computed, the part of a thousandth not yet added, and
-- whether the key's last claim was cut short by its tokens. `full_at` is when the bucket
-- holds a new bucket's tokens again: a full bucket whose key has no ready row is deleted.
CREATE TABLE keel_key_rate_buckets (
    queue           TEXT NOT NULL,
    concurrency_key TEXT NOT NULL,
    millitokens     INTEGER NOT NULL,
    at              INTEGER NOT NULL,
    carry           INTEGER NOT NULL,
    backlog         INTEGER NOT NULL,
    full_at         INTEGER NOT NULL,
    PRIMARY KEY (queue, concurrency_key)
);
CREATE INDEX keel_key_rate_buckets_full ON keel_key_rate_buckets (queue, full_at);
