-- Queue counts (`keel status`, the dashboard's overview, `/metrics`) read this index alone:
-- unfinished rows grouped by namespace, queue, machine and status, with the eligible time
-- that splits ready from scheduled. Without it the counts visit every unfinished row of
-- the table; with it they count index entries and answer "how many are scheduled" and
-- "the oldest ready" with a seek per queue and machine.
CREATE INDEX keel_instances_stats
    ON keel_instances (namespace, queue, machine, status, eligible_at)
    WHERE status NOT IN ('done', 'failed', 'cancelled');
