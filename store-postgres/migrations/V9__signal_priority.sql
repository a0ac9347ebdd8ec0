-- A signal may carry a priority; while it is pending, its instance is claimed at the most
-- urgent of its own priority and its pending signals'. `priority` stays the claim
-- priority (the column the claim indexes order by); `base_priority` keeps the priority the
-- instance was started with, to fall back to once the urgent signals are consumed.
ALTER TABLE instances ADD COLUMN base_priority smallint;
UPDATE instances SET base_priority = priority;
ALTER TABLE instances ALTER COLUMN base_priority SET NOT NULL;
ALTER TABLE signals ADD COLUMN priority smallint;
