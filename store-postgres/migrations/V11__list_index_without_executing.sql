-- Keel schema, version 11: the list index leaves executing rows out. Every claim writes a
-- new version of each row it takes; with the list index covering every status, that
-- version went into three indexes (primary key, list, lease), and now into two. Executing
-- rows are few (at most the workers' concurrency, plus leases not yet reaped), and the
-- lease index holds exactly them, so a listing or broadcast reads them from there.
DROP INDEX instances_list;
CREATE INDEX instances_list ON instances (namespace, machine, id) WHERE status <> 'executing';
