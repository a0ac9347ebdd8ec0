//! Delivering signals into inboxes: dedup, wake-up, closed and missing targets.
//!
//! The rules, per signal and in batch order:
//! - a target that does not exist gets nothing ([`DeliveryOutcome::TargetMissing`]);
//! - a terminal target's inbox is closed ([`crate::inbox::accepts_signals`]), so nothing is
//!   stored: the signal would never be processed;
//! - a dedup key already in the target's inbox, or used for the same target earlier in the
//!   batch, makes the signal a duplicate of the stored one;
//! - otherwise the signal is stored, and a target awaiting its name becomes runnable
//!   ([`crate::outcome::deliver`]). Later signals of the batch see the woken row;
//! - a stored signal more urgent than its target's claim priority raises it
//!   ([`crate::inbox::claim_priority`]).

use crate::error::StoreResult;
use crate::ids::{InstanceId, SignalId, Status};
use crate::inbox;
use crate::instance::{Instance, NewSignal, check_batch, position_in_state};
use crate::limits;
use crate::outcome;
use crate::ports::store::{BroadcastReport, DeliveryOutcome, SignalBroadcastParams};
use crate::time::Timestamp;
use serde_json::Value;
use std::collections::HashMap;

/// What a store read for a batch of deliveries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeliverRead {
    /// Per signal of the batch, in order: its target resolved to an existing instance, or
    /// `None` when there is no such instance.
    pub targets: Vec<Option<InstanceId>>,
    /// The rows of the resolved targets, by id (locked by a store that locks).
    pub rows: HashMap<InstanceId, Instance>,
    /// Signals already in the targets' inboxes under the batch's dedup keys.
    pub dedup: HashMap<(InstanceId, String), SignalId>,
}

/// A signal to store; its id is the store's to assign.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalInsert {
    /// The instance whose inbox gets it.
    pub target: InstanceId,
    /// Its name.
    pub name: String,
    /// Its payload.
    pub payload: Value,
    /// Its dedup key.
    pub dedup_key: Option<String>,
    /// Its priority, when the sender gave one.
    pub priority: Option<crate::ids::Priority>,
    /// Its arrival time.
    pub inserted_at: Timestamp,
}

/// A signal already stored, or one this plan stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalRef {
    /// A signal that was in the inbox before the batch.
    Stored(SignalId),
    /// The signal at this index of [`DeliverPlan::inserts`].
    Insert(usize),
}

/// What becomes of one signal of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliverItem {
    /// Stored as [`DeliverPlan::inserts`]`[insert]`; `woke` when it made the target runnable.
    Stored {
        /// Index into the inserts.
        insert: usize,
        /// The target.
        target: InstanceId,
        /// Whether the target was woken.
        woke: bool,
    },
    /// A duplicate of a signal with the same dedup key.
    Duplicate {
        /// The signal it duplicates.
        of: SignalRef,
        /// The target.
        target: InstanceId,
    },
    /// The target is terminal; nothing stored.
    TargetTerminal {
        /// The target.
        target: InstanceId,
        /// Its terminal status.
        status: Status,
    },
    /// No such instance; nothing stored.
    TargetMissing,
}

/// The writes of a batch of deliveries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeliverPlan {
    /// Per signal of the batch, in order.
    pub items: Vec<DeliverItem>,
    /// The signals to store, in the order their ids must increase.
    pub inserts: Vec<SignalInsert>,
    /// The targets the batch woke, each once, in its final state, in the order first woken.
    /// A delivery changes a row's status, eligibility, update time and claim priority,
    /// never its context or result: a store may leave those two columns unwritten.
    pub woken: Vec<Instance>,
    /// The targets the batch did not wake whose claim priority a signal raised, each
    /// once, in its final state (the store writes them like the woken rows; the context
    /// and result are as read here too).
    pub raised: Vec<Instance>,
}

impl DeliverPlan {
    /// The caller's result, given the ids the store assigned to [`DeliverPlan::inserts`]
    /// (one per insert, in order).
    ///
    /// # Panics
    /// When `ids` has fewer entries than the plan has inserts: the store did not write them all.
    pub fn outcomes(&self, ids: &[SignalId]) -> Vec<DeliveryOutcome> {
        assert!(ids.len() >= self.inserts.len(), "one id per inserted signal");
        let id_of = |r: SignalRef| match r {
            SignalRef::Stored(id) => id,
            SignalRef::Insert(i) => ids[i],
        };
        self.items
            .iter()
            .map(|item| match *item {
                DeliverItem::Stored { insert, target, woke } => {
                    DeliveryOutcome::Delivered { id: ids[insert], target, woke }
                }
                DeliverItem::Duplicate { of, target } => {
                    DeliveryOutcome::Duplicate { id: id_of(of), target }
                }
                DeliverItem::TargetTerminal { target, status } => {
                    DeliveryOutcome::TargetTerminal { target, status }
                }
                DeliverItem::TargetMissing => DeliveryOutcome::TargetMissing,
            })
            .collect()
    }

    /// Whether the batch woke any target (work became ready).
    pub fn woke(&self) -> bool {
        !self.woken.is_empty()
    }
}

/// Plans the delivery of `signals`, whose targets `read` resolved, at `now`.
///
/// # Panics
/// When `read.targets` does not have one entry per signal, or names a target whose row is
/// not in `read.rows`: the read set does not belong to this batch.
pub fn deliver(read: DeliverRead, signals: &[NewSignal], now: Timestamp) -> DeliverPlan {
    assert_eq!(read.targets.len(), signals.len(), "one resolved target per signal");
    let DeliverRead { targets, mut rows, dedup } = read;
    // Keys stored before the batch and keys the batch stores, so a repeated key inside the
    // batch is found without scanning the inserts.
    let mut keys: HashMap<(InstanceId, String), SignalRef> =
        dedup.into_iter().map(|(k, id)| (k, SignalRef::Stored(id))).collect();
    let mut plan = DeliverPlan::default();
    let mut woken: Vec<InstanceId> = Vec::new();
    let mut raised: Vec<InstanceId> = Vec::new();
    for (s, target) in signals.iter().zip(targets) {
        let Some(target) = target else {
            plan.items.push(DeliverItem::TargetMissing);
            continue;
        };
        let row = rows.get_mut(&target).expect("the read set holds every resolved target");
        if !inbox::accepts_signals(row) {
            plan.items.push(DeliverItem::TargetTerminal { target, status: row.status });
            continue;
        }
        if let Some(key) = &s.dedup_key {
            if let Some(of) = keys.get(&(target, key.clone())) {
                plan.items.push(DeliverItem::Duplicate { of: *of, target });
                continue;
            }
            keys.insert((target, key.clone()), SignalRef::Insert(plan.inserts.len()));
        }
        let insert = plan.inserts.len();
        plan.inserts.push(SignalInsert {
            target,
            name: s.name.clone(),
            payload: s.payload.clone(),
            dedup_key: s.dedup_key.clone(),
            priority: s.priority,
            inserted_at: now,
        });
        let urgent = inbox::claim_priority(row.priority, [s.priority]);
        if urgent != row.priority {
            row.priority = urgent;
            if !raised.contains(&target) {
                raised.push(target);
            }
        }
        let woke = outcome::deliver(row, &s.name, now);
        if woke {
            // A target wakes at most once: a woken row is runnable, so no later signal of
            // the batch wakes it again.
            woken.push(target);
        }
        plan.items.push(DeliverItem::Stored { insert, target, woke });
    }
    plan.woken = woken.iter().filter_map(|id| rows.remove(id)).collect();
    plan.raised = raised.iter().filter_map(|id| rows.remove(id)).collect();
    plan
}

/// The targets of a broadcast, in id order, among `candidates`: the instances of the
/// broadcast's machine in its namespace, as `(id, position, status)`, that a store read. A
/// target is non-terminal and, with `in_state`, in that state
/// ([`crate::instance::position_in_state`]). `Invalid` when more than
/// [`crate::limits::BROADCAST_MAX`] match: a broadcast delivers to all or to none.
pub fn broadcast_targets<'a>(
    p: &SignalBroadcastParams,
    candidates: impl IntoIterator<Item = (InstanceId, &'a str, Status)>,
) -> StoreResult<Vec<InstanceId>> {
    let mut targets: Vec<InstanceId> = candidates
        .into_iter()
        .filter(|(_, position, status)| {
            !status.is_terminal()
                && p.in_state.as_deref().is_none_or(|st| position_in_state(position, st))
        })
        .map(|(id, _, _)| id)
        .collect();
    check_batch("broadcast targets", targets.len(), limits::BROADCAST_MAX)?;
    targets.sort_unstable();
    Ok(targets)
}

/// What a broadcast did, from the outcomes of delivering its event to every target:
/// duplicates by dedup key are matched but not counted as delivered; a target that ended
/// before the event reached it is neither.
pub fn broadcast_report(outcomes: &[DeliveryOutcome]) -> BroadcastReport {
    let mut report = BroadcastReport::default();
    for o in outcomes {
        match o {
            DeliveryOutcome::Delivered { woke, .. } => {
                report.matched += 1;
                report.delivered += 1;
                report.woke += u64::from(*woke);
            }
            DeliveryOutcome::Duplicate { .. } => report.matched += 1,
            // A target that ended (or went) before the event reached it is not addressed.
            DeliveryOutcome::TargetTerminal { .. } | DeliveryOutcome::TargetMissing => {}
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::MachineRef;
    use crate::instance::NewInstance;

    const NOW: Timestamp = Timestamp(100);

    fn row(id: i64, status: Status, awaits: Option<&str>) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row = Instance::from_new(InstanceId(id), &new, None, Timestamp(0));
        row.status = status;
        row.awaits = awaits.map(str::to_owned);
        row
    }

    fn signal(target: i64, name: &str, key: Option<&str>) -> NewSignal {
        let s = NewSignal::new(InstanceId(target), name);
        match key {
            Some(k) => s.dedup_key(k),
            None => s,
        }
    }

    /// Plans `signals` against rows 1 (awaiting `go`), 2 (done) and 3 (runnable, with
    /// signal 7 stored under key `k`), row 9 missing, and returns the outcomes with the
    /// inserts numbered from 50, plus the ids of the woken rows.
    fn check(signals: &[NewSignal], expected: &[DeliveryOutcome], woken: &[i64]) {
        let rows = [
            row(1, Status::AwaitingSignal, Some("go")),
            row(2, Status::Done, None),
            row(3, Status::Runnable, None),
        ];
        let read = DeliverRead {
            targets: signals
                .iter()
                .map(|s| match s.target {
                    crate::SignalTarget::Id(id) if id.0 <= 3 => Some(id),
                    _ => None,
                })
                .collect(),
            rows: rows.into_iter().map(|r| (r.id, r)).collect(),
            dedup: HashMap::from([((InstanceId(3), "k".to_owned()), SignalId(7))]),
        };
        let plan = deliver(read, signals, NOW);
        let ids: Vec<SignalId> = (0..plan.inserts.len() as i64).map(|i| SignalId(50 + i)).collect();
        assert_eq!(plan.outcomes(&ids), expected);
        let got: Vec<i64> = plan.woken.iter().map(|r| r.id.0).collect();
        assert_eq!(got, woken);
        for r in &plan.woken {
            assert_eq!((r.status, r.eligible_at), (Status::Runnable, NOW));
        }
        assert!(plan.inserts.iter().all(|i| i.inserted_at == NOW));
    }

    /// Stores write a woken or raised row without its context and result, so a delivery
    /// must leave both exactly as read.
    #[test]
    fn woken_and_raised_rows_keep_their_context_and_result() {
        let mut asleep = row(1, Status::AwaitingSignal, Some("go"));
        let mut busy = row(2, Status::Runnable, None);
        for (r, n) in [(&mut asleep, 1), (&mut busy, 2)] {
            r.context = serde_json::json!({ "orders": [n, n + 1], "note": "x".repeat(64) });
            r.result = Some(serde_json::json!({ "partial": n }));
        }
        let read = DeliverRead {
            targets: vec![Some(InstanceId(1)), Some(InstanceId(2))],
            rows: [asleep.clone(), busy.clone()].into_iter().map(|r| (r.id, r)).collect(),
            dedup: HashMap::new(),
        };
        let urgent = crate::Priority::Critical;
        let signals =
            [signal(1, "go", None).priority(urgent), signal(2, "other", None).priority(urgent)];
        let plan = deliver(read, &signals, NOW);
        assert_eq!(plan.woken.len(), 1);
        assert_eq!(plan.raised.len(), 1);
        for (after, before) in [(&plan.woken[0], &asleep), (&plan.raised[0], &busy)] {
            assert_eq!(after.priority, urgent, "the signal raised the claim priority");
            assert_eq!(after.context, before.context);
            assert_eq!(after.result, before.result);
        }
    }

    fn delivered(id: i64, target: i64, woke: bool) -> DeliveryOutcome {
        DeliveryOutcome::Delivered { id: SignalId(id), target: InstanceId(target), woke }
    }

    fn duplicate(id: i64, target: i64) -> DeliveryOutcome {
        DeliveryOutcome::Duplicate { id: SignalId(id), target: InstanceId(target) }
    }

    #[test]
    fn a_broadcast_reaches_live_instances_in_the_state_and_counts_what_it_stored() {
        let p = |state: Option<&str>| SignalBroadcastParams {
            namespace: "ns".into(),
            machine: "m".into(),
            in_state: state.map(str::to_owned),
            name: "go".into(),
            payload: Value::Null,
            dedup_key: None,
            now: NOW,
        };
        let candidates = [
            (InstanceId(4), "b", Status::Runnable),
            (InstanceId(1), "a", Status::AwaitingSignal),
            (InstanceId(2), "a", Status::Done),
            (InstanceId(3), r#"["p.a","p.b"]"#, Status::Executing),
        ];
        let ids = |v: &[i64]| v.iter().map(|i| InstanceId(*i)).collect::<Vec<_>>();
        assert_eq!(broadcast_targets(&p(None), candidates).unwrap(), ids(&[1, 3, 4]));
        assert_eq!(broadcast_targets(&p(Some("a")), candidates).unwrap(), ids(&[1]));
        assert_eq!(broadcast_targets(&p(Some("p.b")), candidates).unwrap(), ids(&[3]));
        let many =
            (0..=limits::BROADCAST_MAX as i64).map(|i| (InstanceId(i), "a", Status::Runnable));
        let err = broadcast_targets(&p(None), many).unwrap_err();
        assert!(err.message.starts_with("broadcast targets"), "{}", err.message);
        let report = broadcast_report(&[
            delivered(1, 1, true),
            delivered(2, 3, false),
            duplicate(7, 4),
            DeliveryOutcome::TargetMissing,
        ]);
        assert_eq!(report, BroadcastReport { matched: 3, delivered: 2, woke: 1 });
    }

    #[test]
    fn an_awaited_signal_wakes_its_target_once() {
        check(
            &[signal(1, "go", None), signal(1, "go", None)],
            &[delivered(50, 1, true), delivered(51, 1, false)],
            &[1],
        );
    }

    #[test]
    fn another_name_waits_in_the_inbox() {
        check(&[signal(1, "other", None)], &[delivered(50, 1, false)], &[]);
    }

    #[test]
    fn a_terminal_or_missing_target_gets_nothing() {
        check(
            &[signal(2, "go", None), signal(9, "go", None)],
            &[
                DeliveryOutcome::TargetTerminal { target: InstanceId(2), status: Status::Done },
                DeliveryOutcome::TargetMissing,
            ],
            &[],
        );
    }

    #[test]
    fn a_dedup_key_in_the_inbox_or_earlier_in_the_batch_is_a_duplicate() {
        check(
            &[
                signal(3, "go", Some("k")),
                signal(3, "go", Some("j")),
                signal(3, "go", Some("j")),
                signal(1, "go", Some("j")),
            ],
            &[duplicate(7, 3), delivered(50, 3, false), duplicate(50, 3), delivered(51, 1, true)],
            &[1],
        );
    }
}
