-- One token bucket per rate-limited queue: tokens left (thousandths) and when they were
-- computed; a claim refills, spends and writes it back in its write transaction.
CREATE TABLE keel_rate_buckets (
    queue        TEXT PRIMARY KEY,
    millitokens  INTEGER NOT NULL,
    at           INTEGER NOT NULL
);
