//! The inbox of a terminal instance: closed.
//!
//! A terminal instance (done, failed, cancelled) never runs another step, so nothing in
//! its inbox will ever be processed. Keeping those signals would let the inbox table grow
//! for ever, so the lifecycle is:
//! - the transaction that makes an instance terminal (its final step commit, a cancel, a
//!   cascading cancel) removes every signal still pending in its inbox and records them in
//!   **one** `INBOX_DRAINED` history entry: how many there were, and the oldest
//!   [`limits::INBOX_DRAIN_LISTED_MAX`] of them by id and name;
//! - a signal delivered to a terminal instance afterwards (by a client, an outbox emit, a
//!   child's notice to its parent) is reported as `TargetTerminal` and not stored at all;
//!   broadcasts and timers never reach terminal instances in the first place.
//!
//! Priorities in the inbox:
//! - an instance is claimed at [`claim_priority`]: the most urgent of the priority it was
//!   started with and the priorities of the signals pending in its inbox, so an urgent
//!   event sent to a parked low-priority instance is claimed ahead of bulk work under the
//!   `priority` strategy. A delivery raises the row's priority; a step commit sets it
//!   again from what the commit leaves unread, so it falls back once the urgent event is
//!   consumed;
//! - the order a step sees its inbox in is [`InboxOrder`]: arrival order unless the
//!   machine opts into `priority` ([`order`]).
//!
//! Every store executes these rules; this module decides them.

use crate::history::HistoryKind;
use crate::ids::Priority;
use crate::instance::{HistoryEntry, Instance, Signal};
use crate::limits;
use crate::names::name_enum;
use crate::{Outcome, SignalId};
use serde_json::json;

/// The priority an instance is claimed at: the most urgent of `base` (its own) and the
/// priorities of its pending signals (`None` = a signal without a priority of its own,
/// which changes nothing).
pub fn claim_priority(
    base: Priority,
    pending: impl IntoIterator<Item = Option<Priority>>,
) -> Priority {
    pending.into_iter().flatten().fold(base, Priority::min)
}

name_enum! {
    /// The order in which a machine's steps see the events pending in an inbox.
    #[derive(Default)]
    pub enum InboxOrder {
        /// Arrival order (the default): two events of one instance are never reordered.
        #[default]
        Arrival = "arrival",
        /// Most urgent priority first, arrival order within a priority; an event without a
        /// priority of its own counts at its instance's starting priority.
        Priority = "priority",
    }
}

/// Puts `inbox` (read in arrival order) in the order a step sees it under `order`; `base`
/// is the instance's starting priority, the rank of a signal that has none.
pub fn order(inbox: &mut [Signal], order: InboxOrder, base: Priority) {
    if order == InboxOrder::Priority {
        inbox.sort_by_key(|s| (s.priority.unwrap_or(base), s.id));
    }
}

/// The signal a step at `position` processes among `inbox` (the signals it sees, in its
/// machine's order, [`order`]): the first, except at a chart's start
/// ([`INIT_POSITION`](crate::chart::INIT_POSITION)) and at a region task
/// ([`REGION_POSITION`](crate::config::REGION_POSITION)), which process none. The step runs
/// under the file's section for that event (`[machines.<m>.events.<e>]`); a failed attempt
/// consumes nothing, so its retries keep the event's settings. `None`: the machine's
/// settings. A chart's `event_for` decides by this, and so does `keel serve` for its
/// remote workers' steps (a plain machine in process takes the first signal at every
/// step).
pub fn step_event<'a>(position: &str, inbox: &'a [Signal]) -> Option<&'a Signal> {
    let none = [crate::chart::INIT_POSITION, crate::config::REGION_POSITION];
    if none.contains(&position) { None } else { inbox.first() }
}

/// The history entry kind a drained inbox is recorded under.
pub const INBOX_DRAINED: &str = HistoryKind::InboxDrained.as_str();

/// The signals a successful step consumes: those it saw in `inbox` that match what the
/// instance awaited (`awaits`; every one for `*`) — none when the step parks again or the
/// instance awaited nothing. The in-process worker and remote workers both commit this.
pub fn consumed_by(outcome: &Outcome, awaits: Option<&str>, inbox: &[Signal]) -> Vec<SignalId> {
    match awaits {
        Some(awaits) if consumes(outcome, Some(awaits)) => inbox
            .iter()
            .filter(|s| awaits == crate::instance::ANY_SIGNAL || s.name == awaits)
            .map(|s| s.id)
            .collect(),
        _ => Vec::new(),
    }
}

/// Whether committing `outcome` consumes signals at all: the instance awaited one and the
/// step neither parks again nor asks to be retried (a retry keeps what it awaited, so the
/// next attempt processes the same signals). A remote worker must then say which signals
/// it was handed.
pub fn consumes(outcome: &Outcome, awaits: Option<&str>) -> bool {
    awaits.is_some() && !matches!(outcome, Outcome::Await { .. } | Outcome::Retry { .. })
}

/// Whether a delivery to `row` is stored: only a non-terminal instance's inbox is open.
pub fn accepts_signals(row: &Instance) -> bool {
    !row.status.is_terminal()
}

/// Whether committing `outcome` ends the instance, so the commit must drain its inbox. A
/// store that batches its reads asks this before it knows whether each item is accepted.
pub fn drains(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Done { .. } | Outcome::Stop { .. })
}

/// The signals still pending in an inbox (after the terminal step's own consumption), as
/// a store reads them: how many, and the oldest ones, at most
/// [`limits::INBOX_DRAIN_LISTED_MAX`], by id and name in arrival order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pending {
    /// Every pending signal, listed or not.
    pub count: u64,
    /// The oldest pending signals.
    pub oldest: Vec<(SignalId, String)>,
}

impl Pending {
    /// From every pending signal, in arrival order (a store that reads them all).
    pub fn of<'a>(signals: impl IntoIterator<Item = &'a Signal>) -> Self {
        let mut pending = Pending::default();
        for s in signals {
            pending.push(s.id, &s.name, 1);
        }
        pending
    }

    /// Counts `count` more pending signals, listing `(id, name)` while there is room.
    /// A store that counts in SQL passes each target's total once (with its first row)
    /// and zero for the rest of its listed rows.
    pub fn push(&mut self, id: SignalId, name: &str, count: u64) {
        self.count += count;
        if self.oldest.len() < limits::INBOX_DRAIN_LISTED_MAX {
            self.oldest.push((id, name.to_owned()));
        }
    }
}

/// The one history entry that records a drained inbox, or `None` when nothing was
/// pending (an empty inbox leaves no trace).
pub fn drained(pending: &Pending) -> Option<HistoryEntry> {
    if pending.count == 0 {
        return None;
    }
    let listed: Vec<_> =
        pending.oldest.iter().map(|(id, name)| json!({ "id": id, "name": name })).collect();
    Some(HistoryEntry::new(
        HistoryKind::InboxDrained,
        json!({ "count": pending.count, "signals": listed }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{InstanceId, MachineRef, Status};
    use crate::instance::NewInstance;
    use crate::time::Timestamp;

    fn signal(id: i64) -> Signal {
        Signal {
            id: SignalId(id),
            target: InstanceId(1),
            name: format!("e{id}"),
            payload: json!(null),
            dedup_key: None,
            priority: None,
            inserted_at: Timestamp(id),
        }
    }

    #[test]
    fn an_urgent_pending_signal_raises_the_claim_priority_and_order_is_opt_in() {
        use Priority::*;
        assert_eq!(claim_priority(Bulk, []), Bulk);
        assert_eq!(claim_priority(Bulk, [None, Some(Low), Some(High)]), High);
        assert_eq!(claim_priority(High, [Some(Bulk)]), High, "a signal never lowers it");
        let mut inbox: Vec<Signal> = (1..=4).map(signal).collect();
        inbox[1].priority = Some(Critical);
        inbox[2].priority = Some(Bulk);
        let ids = |inbox: &[Signal]| inbox.iter().map(|s| s.id.0).collect::<Vec<_>>();
        order(&mut inbox, InboxOrder::Arrival, Normal);
        assert_eq!(ids(&inbox), [1, 2, 3, 4], "arrival order is never changed");
        order(&mut inbox, InboxOrder::Priority, Normal);
        assert_eq!(ids(&inbox), [2, 1, 4, 3], "unset ranks at the base, arrival within a rank");
        assert_eq!(InboxOrder::default(), InboxOrder::Arrival);
        assert_eq!("priority".parse::<InboxOrder>().unwrap(), InboxOrder::Priority);
    }

    #[test]
    fn a_step_processes_the_first_signal_in_its_order_but_a_start_or_region_task_none() {
        let mut inbox: Vec<Signal> = (1..=3).map(signal).collect();
        inbox[2].priority = Some(Priority::Critical);
        assert_eq!(step_event("charge", &inbox).map(|s| s.id.0), Some(1));
        order(&mut inbox, InboxOrder::Priority, Priority::Normal);
        assert_eq!(step_event("charge", &inbox).map(|s| s.id.0), Some(3), "the machine's order");
        assert_eq!(step_event(crate::chart::INIT_POSITION, &inbox), None);
        assert_eq!(step_event(crate::config::REGION_POSITION, &inbox), None);
        assert_eq!(step_event("charge", &[]), None);
    }

    #[test]
    fn a_terminal_inbox_is_closed_and_a_terminal_outcome_drains() {
        let new = NewInstance::new(MachineRef::new("m", 1), "a");
        let mut row = Instance::from_new(InstanceId(1), &new, None, Timestamp(0));
        for (status, open) in [
            (Status::Runnable, true),
            (Status::Executing, true),
            (Status::AwaitingSignal, true),
            (Status::AwaitingChildren, true),
            (Status::Suspended, true),
            (Status::Done, false),
            (Status::Failed, false),
            (Status::Cancelled, false),
        ] {
            row.status = status;
            assert_eq!(accepts_signals(&row), open, "{status}");
        }
        assert!(drains(&Outcome::Done { result: json!(1), step: None }));
        assert!(drains(&Outcome::Stop { reason: "no".into() }));
        assert!(!drains(&Outcome::Suspend), "a suspended instance may still resume");
        assert!(!drains(&Outcome::Next { step: "b".into(), context: json!({}) }));
    }

    #[test]
    fn one_entry_counts_everything_and_lists_the_oldest_at_the_bound() {
        assert_eq!(drained(&Pending::default()), None, "an empty inbox records nothing");
        let few: Vec<Signal> = (1..=3).map(signal).collect();
        let entry = drained(&Pending::of(&few)).expect("entry");
        assert_eq!(entry.kind, INBOX_DRAINED);
        assert_eq!(
            entry.data,
            json!({ "count": 3, "signals": [
                { "id": 1, "name": "e1" }, { "id": 2, "name": "e2" }, { "id": 3, "name": "e3" }
            ] })
        );
        let total = limits::INBOX_DRAIN_LISTED_MAX as i64 + 5;
        let many: Vec<Signal> = (1..=total).map(signal).collect();
        let entry = drained(&Pending::of(&many)).expect("entry");
        assert_eq!(entry.data["count"], json!(total));
        let listed = entry.data["signals"].as_array().expect("list");
        assert_eq!(listed.len(), limits::INBOX_DRAIN_LISTED_MAX, "the list is bounded");
        assert_eq!(listed[0]["id"], json!(1), "oldest first");
        // A store that counts in SQL: the total once, then the listed rows.
        let mut counted = Pending::default();
        counted.push(SignalId(1), "e1", total as u64);
        for s in &many[1..limits::INBOX_DRAIN_LISTED_MAX] {
            counted.push(s.id, &s.name, 0);
        }
        assert_eq!(counted, Pending::of(&many));
    }
}
