-- A fair claim lists the concurrency keys that have ready rows before it picks a page per
-- key. Without this index that list walks every runnable row (keyed or not) on every
-- claim, which made a claim's cost grow with the backlog; with it the walk covers the
-- keyed runnable rows only, and a queue without keys costs nothing.
CREATE INDEX keel_instances_runnable_keys
    ON keel_instances (concurrency_key, eligible_at)
    WHERE status = 'runnable' AND concurrency_key IS NOT NULL;
