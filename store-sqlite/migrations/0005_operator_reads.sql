-- What the operator views read (`keel status`, `keel list`, the dashboard), each from an
-- index rather than the table.

-- Queue counts read this index alone: unfinished rows grouped by namespace, queue,
-- machine and status, with the eligible time that splits ready from scheduled. Without it
-- the counts visit every unfinished row of the table; with it they count index entries
-- and answer "how many are scheduled" and "the oldest ready" with a seek per queue and
-- machine.
CREATE INDEX keel_instances_stats
    ON keel_instances (namespace, queue, machine, status, eligible_at)
    WHERE status NOT IN ('done', 'failed', 'cancelled');

-- A namespace's instances newest first, with no machine named: the list walks this index
-- backwards and stops after a page instead of sorting the namespace. Namespace and id
-- never change, so rows are written here once, at insert.
CREATE INDEX keel_instances_namespace ON keel_instances (namespace, id);

-- An instance found by business key without naming its machine (the dashboard's key
-- filter). The key never changes after insert either.
CREATE INDEX keel_instances_key_any_machine
    ON keel_instances (namespace, business_key, id) WHERE business_key IS NOT NULL;

-- A namespace's dead letters a page at a time by id: the page seeks to its cursor here and
-- reads its rows in order, instead of sorting every letter of the namespace per page.
CREATE INDEX keel_dead_letters_namespace ON keel_dead_letters (namespace, id);
