-- Ready rows in age order: a claim under fifo, and the starving rows of a claim under
-- priority with a starvation bound, read the oldest ready rows first. Without this index
-- such a claim ranked and sorted every ready row for every page it read.
CREATE INDEX keel_instances_runnable_age
    ON keel_instances (eligible_at, id) WHERE status = 'runnable';
