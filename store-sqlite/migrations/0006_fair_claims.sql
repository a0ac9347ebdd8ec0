-- Exact token accounting: the part of a thousandth of a token not yet added (so frequent
-- refills lose nothing to rounding), and whether the last claim was cut short by the
-- tokens (rows were left waiting, so what accrues until the next claim is theirs).
ALTER TABLE keel_rate_buckets ADD COLUMN carry INTEGER NOT NULL DEFAULT 0;
ALTER TABLE keel_rate_buckets ADD COLUMN backlog INTEGER NOT NULL DEFAULT 0;

-- Fair claims rotate over a queue's concurrency keys: the key a full claim served last,
-- after which the next claim of the queue starts.
CREATE TABLE keel_claim_cursors (
    queue      TEXT PRIMARY KEY,
    after_key  TEXT NOT NULL
);
