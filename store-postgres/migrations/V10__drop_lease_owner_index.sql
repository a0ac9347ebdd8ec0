-- Keel schema, version 10: the reaper finds a restarted worker's leases among the executing
-- rows by the lease index; a second index of executing rows by owner only cost every claim
-- one more index insert.
DROP INDEX instances_lease_owner;
