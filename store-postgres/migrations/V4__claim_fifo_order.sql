-- A fifo queue claims in eligible order alone (priorities ignored); this index serves that
-- order the way instances_pick serves the priority order.
CREATE INDEX instances_pick_fifo ON instances (eligible_at, id) WHERE status = 'runnable';
