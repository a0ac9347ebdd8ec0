-- A signal may carry a priority; while it is pending, its instance is claimed at the most
-- urgent of its own priority and its pending signals'. `priority` stays the claim
-- priority (the column the claim orders by); `base_priority` keeps the priority the
-- instance was started with, to fall back to once the urgent signals are consumed.
ALTER TABLE keel_instances ADD COLUMN base_priority INTEGER NOT NULL DEFAULT 2
    CHECK (base_priority BETWEEN 0 AND 4);
UPDATE keel_instances SET base_priority = priority;
ALTER TABLE keel_signals ADD COLUMN priority INTEGER CHECK (priority BETWEEN 0 AND 4);
