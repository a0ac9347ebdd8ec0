//! The timer sweep: what firing a batch of due timers delivers, records and leaves armed.
//!
//! Per due timer, soonest first: a timer whose instance is gone or terminal is deleted
//! without firing; a repeating tick of an instance that runs nothing until an operator
//! acts — suspended, or in a paused queue ([`Owner::Held`]) — is held
//! ([`timers::held_while_suspended`], [`timers::hold`]): nothing delivered or recorded, the
//! timer due again at its next tick; any other fires ([`timers::fire`]): its event is
//! delivered into the instance's inbox under the fire's dedup key (so a re-run sweep is
//! harmless), the fire is recorded in the instance's history, and the timer is advanced or
//! deleted. Only events actually stored count as fired (or, for an exhausted `every` +
//! `max` timer, exhausted).

use crate::history::HistoryKind;
use crate::ids::{InstanceId, Status, TimerId};
use crate::instance::{HistoryEntry, Instance, NewSignal};
use crate::ports::store::{DeliveryOutcome, TimerRetimeParams, TimerSweepParams, TimerSweepReport};
use crate::timers::{self, TimerRow};

/// One page of a retime: the timers read (id order, after the cursor, at most the limit)
/// that move, each with its history entry, and where the next page starts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RetimePlan {
    /// The moved timers, in id order.
    pub retimed: Vec<timers::Retimed>,
    /// The next page's cursor; `None` when the read was the last page.
    pub next: Option<TimerId>,
}

/// Plans one page of `p` over `read`, the machine version's timers after the cursor in
/// id order (at most `p.limit`).
pub fn retime(p: &TimerRetimeParams, read: &[TimerRow]) -> RetimePlan {
    let retimed = read
        .iter()
        .filter(|t| t.machine == p.machine)
        .filter_map(|t| timers::retime(t, &p.timers))
        .collect();
    let next = (read.len() >= p.limit).then(|| read.last().map(|t| t.id)).flatten();
    RetimePlan { retimed, next }
}

/// The writes of a sweep. The signals are delivered with [`super::deliver::deliver`]; the
/// report needs the outcomes of that delivery.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SweepPlan {
    /// Timers processed (fired or found stale).
    pub processed: u64,
    /// The events to deliver, each to its timer's instance, in timer order.
    pub signals: Vec<NewSignal>,
    /// Per signal, whether it is an exhausted timer's `then` event.
    exhausted: Vec<bool>,
    /// History to record, per instance, in timer order.
    pub history: Vec<(InstanceId, HistoryEntry)>,
    /// Timers to write back, advanced to their next fire.
    pub advance: Vec<TimerRow>,
    /// Timers to delete.
    pub delete: Vec<TimerId>,
    /// Instances whose join deadline timer fired, each once (in the order of its first
    /// such timer), however many of its deadline timers were due: a parent keeps the
    /// deadline timer of a barrier that settled early, so one of an earlier barrier and
    /// one of the open barrier may fall due together. The store applies
    /// [`super::parent::expire`] to each row as it stands at that point of the transaction
    /// (after the fires and the deadlines before it are written, not as read at the pick)
    /// and executes the resulting plan, in the same transaction. No event is delivered for
    /// them.
    pub join_deadlines: Vec<InstanceId>,
}

impl SweepPlan {
    /// The resolved targets of [`SweepPlan::signals`]: every timer's instance is live.
    pub fn targets(&self) -> Vec<Option<InstanceId>> {
        self.signals
            .iter()
            .map(|s| match s.target {
                crate::SignalTarget::Id(id) => Some(id),
                crate::SignalTarget::Key { .. } | crate::SignalTarget::Child { .. } => None,
            })
            .collect()
    }

    /// The sweep's report, given the outcome of delivering [`SweepPlan::signals`].
    /// Its `picked` is `processed`: a store that leaves picked timers for a later sweep
    /// (PostgreSQL, for a busy instance) adds them.
    pub fn report(&self, delivered: &[DeliveryOutcome]) -> TimerSweepReport {
        let mut report = TimerSweepReport {
            processed: self.processed,
            picked: self.processed,
            ..Default::default()
        };
        for (o, exhausted) in delivered.iter().zip(&self.exhausted) {
            if matches!(o, DeliveryOutcome::Delivered { .. }) {
                if *exhausted {
                    report.exhausted += 1;
                } else {
                    report.fired += 1;
                }
            }
        }
        report
    }
}

/// What a sweep knows of a due timer's instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// Missing or terminal: its timers are deleted without firing.
    Gone,
    /// Runs nothing until an operator acts — suspended (dead-lettered), or live in a
    /// paused queue: its repeating ticks are held ([`timers::held_while_suspended`]).
    Held,
    /// Any other: its timers fire.
    Live,
}

impl Owner {
    /// A due timer's instance as the store holds it (`None`: no such instance), given the
    /// `(namespace, queue)` pairs paused when the sweep read them (`Store::queue_pause`;
    /// a store reads them once per sweep, and there are few).
    pub fn of(row: Option<&Instance>, paused: &[(String, String)]) -> Owner {
        match row {
            None => Owner::Gone,
            Some(r) if r.status.is_terminal() => Owner::Gone,
            Some(r) if r.status == Status::Suspended => Owner::Held,
            Some(r) if paused.iter().any(|(ns, q)| *ns == r.namespace && *q == r.queue) => {
                Owner::Held
            }
            Some(_) => Owner::Live,
        }
    }
}

/// Plans firing `due`, the timers a store picked (due at `p.now`, in scope, soonest first,
/// at most `p.limit`); `owner` gives each timer's instance as the store holds it
/// ([`Owner::of`]).
pub fn sweep(
    p: &TimerSweepParams,
    due: &[TimerRow],
    owner: impl Fn(InstanceId) -> Owner,
) -> SweepPlan {
    let mut plan = SweepPlan::default();
    for timer in due.iter().take(p.limit) {
        plan.processed += 1;
        let owner = owner(timer.instance);
        if owner == Owner::Gone {
            plan.delete.push(timer.id);
            continue;
        }
        // Only repeating ticks are held, whichever way the instance is held. Its `after`
        // timer and an exhausted timer's `then` deliver once each: one signal waiting for
        // the retry or the resume. A join deadline (an `after` timer) is never held either:
        // for a suspended parent it changes nothing ([`super::parent::expire`] acts only on
        // a parent awaiting its children) and the timer goes; a parent awaiting its
        // children in a paused queue is settled at its deadline as if running — the barrier
        // closes with what has finished and, under `rest: cancel`, the children still
        // pending (whose own queues may be running) are cancelled, once, rather than run on
        // past the deadline for as long as the pause lasts. The woken parent runs its next
        // step when its queue is resumed.
        if owner == Owner::Held && timers::held_while_suspended(timer) {
            plan.advance.push(timers::hold(timer, p.now));
            continue;
        }
        if timer.spec.event == crate::join::DEADLINE_EVENT {
            // A join deadline wakes the parent rather than delivering an event; a parent
            // with two due deadline timers is woken (or found settled) once.
            if !plan.join_deadlines.contains(&timer.instance) {
                plan.join_deadlines.push(timer.instance);
            }
            plan.delete.push(timer.id);
            continue;
        }
        let fired = timers::fire(timer, p.now);
        if timers::delivers(&fired) {
            plan.exhausted.push(
                fired.next.is_none() && fired.history.kind == HistoryKind::TimerExhausted.as_str(),
            );
            plan.signals.push(fired.signal);
        }
        plan.history.push((timer.instance, fired.history));
        match fired.next {
            Some(next) => plan.advance.push(next),
            None => plan.delete.push(timer.id),
        }
    }
    plan
}

/// The `(namespace, machine)` scopes a sweep records its time under: its namespace or `*`,
/// and each of its machines, or `*` for all.
pub fn swept_scopes(p: &TimerSweepParams) -> Vec<(String, String)> {
    let ns = p.namespace.clone().unwrap_or_else(|| "*".into());
    if p.machines.is_empty() {
        vec![(ns, "*".into())]
    } else {
        p.machines.iter().map(|m| (ns.clone(), m.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::{TimerArm, TimerKind};
    use crate::ids::{MachineRef, SignalId};
    use crate::time::Timestamp;
    use std::time::Duration;

    const NOW: Timestamp = Timestamp(10_000);

    fn timer(id: i64, instance: i64, every: bool, max: Option<u32>, fires: u32) -> TimerRow {
        let arm = TimerArm {
            state: "s".into(),
            event: "tick".into(),
            interval: Duration::from_secs(1),
            kind: if every { TimerKind::Every } else { TimerKind::After },
            max,
            then: max.map(|_| "done".into()),
        };
        let mut t = TimerRow::armed(
            TimerId(id),
            InstanceId(instance),
            "ns",
            &MachineRef::new("m", 1),
            arm,
            Timestamp(0),
        );
        t.fire_count = fires;
        t
    }

    #[test]
    fn a_sweep_fires_live_timers_and_drops_stale_ones() {
        let p = TimerSweepParams { namespace: None, machines: vec![], limit: 10, now: NOW };
        let due = [
            timer(1, 1, false, None, 0),
            timer(2, 1, true, None, 3),
            timer(3, 2, false, None, 0),
            timer(4, 1, true, Some(2), 2),
        ];
        let plan = sweep(&p, &due, |i| owner(i, (i == InstanceId(1)).then_some(Status::Runnable)));
        assert_eq!(plan.processed, 4);
        assert_eq!(plan.delete, [TimerId(1), TimerId(3), TimerId(4)]);
        assert_eq!(plan.advance.len(), 1);
        assert_eq!(
            (plan.advance[0].fire_count, plan.advance[0].next_fire_at),
            (4, Timestamp(11_000))
        );
        let names: Vec<&str> = plan.signals.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["tick", "tick", "done"]);
        assert_eq!(plan.history.len(), 3);
        assert_eq!(plan.targets(), [Some(InstanceId(1)); 3]);
        let delivered = |id| DeliveryOutcome::Delivered {
            id: SignalId(id),
            target: InstanceId(1),
            woke: false,
        };
        let dup = DeliveryOutcome::Duplicate { id: SignalId(9), target: InstanceId(1) };
        let report = plan.report(&[delivered(1), dup, delivered(2)]);
        assert_eq!(report, TimerSweepReport { fired: 1, exhausted: 1, processed: 4, picked: 4 });
    }

    /// A suspended instance's repeating timer is held — nothing delivered or recorded, due
    /// again at its next tick, its count kept — while its `after` timer and an exhausted
    /// timer's `then` deliver once; a terminal instance's timers go.
    #[test]
    fn a_suspended_instance_gets_no_repeating_fires() {
        let p = TimerSweepParams { namespace: None, machines: vec![], limit: 10, now: NOW };
        let due = [
            timer(1, 1, true, None, 3),
            timer(2, 1, false, None, 0),
            timer(3, 1, true, Some(2), 2),
            timer(4, 2, true, None, 0),
            timer(5, 3, true, None, 0),
        ];
        let status = |i: InstanceId| match i.0 {
            1 => Some(Status::Suspended),
            2 => Some(Status::Done),
            _ => None,
        };
        let plan = sweep(&p, &due, |i| owner(i, status(i)));
        assert_eq!(plan.processed, 5);
        let names: Vec<&str> = plan.signals.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["tick", "done"], "the after timer and the then, once each");
        assert_eq!(plan.history.len(), 2, "a held tick records nothing");
        assert_eq!(plan.delete, [TimerId(2), TimerId(3), TimerId(4), TimerId(5)]);
        let held: Vec<(TimerId, u32, Timestamp)> =
            plan.advance.iter().map(|t| (t.id, t.fire_count, t.next_fire_at)).collect();
        assert_eq!(held, [(TimerId(1), 3, Timestamp(11_000))], "held: not due again at once");

        // The same timers of a runnable instance fire.
        let live = sweep(&p, &due, |i| owner(i, (i == InstanceId(1)).then_some(Status::Runnable)));
        assert_eq!(live.signals.len(), 3);
    }

    /// An instance row of `status`, in queue `q` of namespace `ns`.
    fn instance(id: InstanceId, status: Status, ns: &str, q: &str) -> Instance {
        use crate::instance::NewInstance;
        let new = NewInstance::new(MachineRef::new("m", 1), "s").namespace(ns).queue(q);
        let mut row = Instance::from_new(id, &new, None, NOW);
        row.status = status;
        row
    }

    /// What a sweep knows of instance `i` of status `status` (`None`: missing), in queue
    /// `q` of `ns`, no queue paused.
    fn owner(i: InstanceId, status: Option<Status>) -> Owner {
        Owner::of(status.map(|s| instance(i, s, "ns", "q")).as_ref(), &[])
    }

    /// An instance in a paused queue is held as a suspended one is, whatever its
    /// (non-terminal) status; the pause is per namespace and queue; a terminal or missing
    /// instance is gone either way.
    #[test]
    fn a_paused_queue_holds_its_instances() {
        let paused = [("ns".to_owned(), "mail".to_owned())];
        let of = |status, ns, q| Owner::of(Some(&instance(InstanceId(1), status, ns, q)), &paused);
        assert_eq!(of(Status::AwaitingSignal, "ns", "mail"), Owner::Held);
        assert_eq!(of(Status::Runnable, "ns", "mail"), Owner::Held);
        assert_eq!(of(Status::AwaitingChildren, "ns", "mail"), Owner::Held);
        assert_eq!(of(Status::Suspended, "ns", "bulk"), Owner::Held);
        assert_eq!(of(Status::AwaitingSignal, "ns", "bulk"), Owner::Live, "another queue");
        assert_eq!(of(Status::AwaitingSignal, "other", "mail"), Owner::Live, "another namespace");
        assert_eq!(of(Status::Done, "ns", "mail"), Owner::Gone);
        assert_eq!(Owner::of(None, &paused), Owner::Gone);

        // The same timers as for a suspended instance: held alike.
        let p = TimerSweepParams { namespace: None, machines: vec![], limit: 10, now: NOW };
        let due = [timer(1, 1, true, None, 3), timer(2, 1, false, None, 0), deadline(3, 1)];
        let plan = sweep(&p, &due, |_| of(Status::AwaitingChildren, "ns", "mail"));
        let names: Vec<&str> = plan.signals.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["tick"], "the after timer, once");
        assert_eq!(plan.history.len(), 1, "a held tick records nothing");
        assert_eq!(plan.join_deadlines, [InstanceId(1)], "a join deadline still fires");
        let held: Vec<(TimerId, u32, Timestamp)> =
            plan.advance.iter().map(|t| (t.id, t.fire_count, t.next_fire_at)).collect();
        assert_eq!(held, [(TimerId(1), 3, Timestamp(11_000))]);
    }

    /// A join deadline timer of `instance`.
    fn deadline(id: i64, instance: i64) -> TimerRow {
        let mut t = timer(id, instance, false, None, 0);
        t.spec.state = crate::join::DEADLINE_OWNER.into();
        t.spec.event = crate::join::DEADLINE_EVENT.into();
        t
    }

    /// Two due deadline timers of one parent (an earlier barrier's, never cancelled, and
    /// the open barrier's) wake it once: one join deadline, both timers deleted, no event.
    #[test]
    fn two_due_deadline_timers_of_one_parent_yield_one_join_deadline() {
        let p = TimerSweepParams { namespace: None, machines: vec![], limit: 10, now: NOW };
        let due = [deadline(1, 7), timer(2, 8, false, None, 0), deadline(3, 7), deadline(4, 8)];
        let plan = sweep(&p, &due, |i| owner(i, Some(Status::AwaitingChildren)));
        assert_eq!(plan.join_deadlines, [InstanceId(7), InstanceId(8)], "each parent once");
        assert_eq!(plan.delete, [TimerId(1), TimerId(2), TimerId(3), TimerId(4)]);
        let names: Vec<&str> = plan.signals.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["tick"], "a deadline delivers no event");
        assert_eq!(plan.processed, 4);
    }

    #[test]
    fn a_sweep_records_its_time_per_scope() {
        let p = |ns: Option<&str>, machines: &[&str]| TimerSweepParams {
            namespace: ns.map(str::to_owned),
            machines: machines.iter().map(|m| (*m).to_owned()).collect(),
            limit: 1,
            now: NOW,
        };
        let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(swept_scopes(&p(None, &[])), [pair("*", "*")]);
        assert_eq!(swept_scopes(&p(Some("a"), &["m", "n"])), [pair("a", "m"), pair("a", "n")]);
    }
}
