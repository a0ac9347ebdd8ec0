//! Hints for a queue of ready work: which instances to announce after an insert, a
//! delivery or a step commit, and which ones the repair pass announces again.
//!
//! A hint says "go and look at instance 42"; the store stays the truth. So a hint may be
//! spurious (the instance turned out not to be ready: a parent still waiting on another
//! child, a target whose inbox got an event it does not await), which costs one claim by
//! id that takes nothing; but work that became ready should not go unannounced. What a
//! publisher knows decides what it announces:
//! - after an insert: every new instance, delayed until its `eligible_at`;
//! - after a delivery: every target the delivery woke;
//! - after a step commit: the instance itself when it stays runnable (delayed by a retry's
//!   back-off), the children and spawned instances it inserted, the targets of the events
//!   it emitted by id (a target named by business key is left to the repair pass), and its
//!   parent when it ended (the parent's barrier may have opened).
//!
//! A hint can still be lost (a crash between commit and publish, a flushed or purged
//! queue, a delay longer than the queue keeps), and the store cannot know whether one is
//! on its way. What it does know is how long an instance has been ready: since its last
//! change (`updated_at`) or since it became due (`eligible_at`), whichever is later. An
//! instance ready for longer than a bound has either lost its hint or is waiting behind a
//! backlog; publishing it again is right in the first case and harmless in the second (a
//! queue that deduplicates keeps one hint per instance and revision, and a duplicate
//! claims nothing). Stores select those rows by [`needs_hint`]
//! ([`crate::ports::Store::instance_ready_stale`]); the repair pass publishes
//! [`repair_hint`] for each.
//!
//! A hint about an instance whose revision the publisher does not know (a woken target, a
//! parent) carries revision 0.

use crate::instance::{Instance, NewInstance, SignalTarget};
use crate::outcome::{self, Outcome, StepCommit};
use crate::ports::queue::Hint;
use crate::ports::store::{CommitReceipt, DeliveryOutcome, InsertOutcome, ReadyStaleParams};
use crate::time::Timestamp;
use std::time::Duration;

/// The hints for the instances an insert created: each new one (not the occupants of
/// unique keys), delayed until its `eligible_at`, with its priority and concurrency key.
pub fn after_insert(news: &[NewInstance], outcomes: &[InsertOutcome], now: Timestamp) -> Vec<Hint> {
    let protos: Vec<Hint> = news.iter().map(|n| for_new(n, now)).collect();
    inserted(protos, outcomes)
}

/// The hint for a new instance inserted at `now`, before its id is known (a caller that
/// hands `new` to the store keeps this, then calls [`inserted`]).
pub fn for_new(new: &NewInstance, now: Timestamp) -> Hint {
    let delay = new.eligible_at.map_or(Duration::ZERO, |at| at.since(now));
    let mut hint = Hint::new(crate::ids::InstanceId(0), 0).delay(delay).priority(new.priority);
    hint.group.clone_from(&new.concurrency_key);
    hint
}

/// The hints of [`for_new`] for the items an insert created, with their ids.
pub fn inserted(protos: Vec<Hint>, outcomes: &[InsertOutcome]) -> Vec<Hint> {
    protos
        .into_iter()
        .zip(outcomes)
        .filter_map(|(hint, outcome)| match outcome {
            InsertOutcome::Inserted(id) => Some(Hint { instance: *id, ..hint }),
            InsertOutcome::Existing(_) => None,
        })
        .collect()
}

/// The hints for a delivery: each target it woke, once.
pub fn after_delivery(outcomes: &[DeliveryOutcome]) -> Vec<Hint> {
    let mut woken: Vec<_> = outcomes
        .iter()
        .filter_map(|o| match o {
            DeliveryOutcome::Delivered { target, woke: true, .. } => Some(*target),
            _ => None,
        })
        .collect();
    woken.sort_unstable();
    woken.dedup();
    woken.into_iter().map(|id| Hint::new(id, 0)).collect()
}

/// The hints for an accepted step commit of `row` (the claimed row): see the module doc.
pub fn after_commit(row: &Instance, commit: &StepCommit, receipt: &CommitReceipt) -> Vec<Hint> {
    let mut hints = Vec::new();
    if receipt.status == crate::ids::Status::Runnable {
        let delay = match &commit.outcome {
            Outcome::Retry { delay, .. } => *delay,
            _ => Duration::ZERO,
        };
        let mut hint =
            Hint::new(receipt.id, receipt.revision.0 as u64).delay(delay).priority(row.priority);
        hint.group.clone_from(&row.concurrency_key);
        hints.push(hint);
    }
    for child in receipt.children.iter().chain(&receipt.spawned) {
        if let InsertOutcome::Inserted(id) = child {
            hints.push(Hint::new(*id, 0));
        }
    }
    let mut targets: Vec<_> = commit
        .emit
        .iter()
        .filter_map(|s| match s.target {
            SignalTarget::Id(id) if id != receipt.id => Some(id),
            _ => None,
        })
        .collect();
    if receipt.status.is_terminal() {
        targets.extend(row.parent);
    }
    targets.sort_unstable();
    targets.dedup();
    hints.extend(targets.into_iter().map(|id| Hint::new(id, 0)));
    hints
}

/// The hints a queue that keeps delays up to `delay_max` can carry: a longer delay is left
/// to the store (the instance is found when due, by polling or the repair pass), never
/// shortened.
pub fn publishable(hints: Vec<Hint>, delay_max: Option<Duration>) -> Vec<Hint> {
    hints.into_iter().filter(|h| delay_max.is_none_or(|most| h.delay <= most)).collect()
}

/// Since when `row` has been ready, if it is ready at `now`: the later of its last change
/// and its due time.
pub fn ready_since(row: &Instance, now: Timestamp) -> Option<Timestamp> {
    outcome::claimable(row, now).then(|| row.updated_at.max(row.eligible_at))
}

/// Whether the repair pass publishes a hint for `row`: it is ready (runnable and due), its
/// queue is not paused, it passes `params`' filters and comes after its cursor, and it has
/// been ready for at least `params.ready_for`.
pub fn needs_hint(row: &Instance, queue_paused: bool, params: &ReadyStaleParams) -> bool {
    let p = params;
    let stale = ready_since(row, p.now).is_some_and(|since| since <= p.now.minus(p.ready_for));
    stale
        && !queue_paused
        && p.after.is_none_or(|after| row.id > after)
        && (p.namespaces.is_empty() || p.namespaces.contains(&row.namespace))
        && (p.queues.is_empty() || p.queues.contains(&row.queue))
        && (p.machines.is_empty() || p.machines.contains(&row.machine))
}

/// How many times the repair announcements of a waiting instance double their spacing
/// before they repeat at a fixed period: announced at 1, 2, 4 and 8 bounds of readiness,
/// then every 8 bounds.
pub const REPAIR_DOUBLINGS: u32 = 3;

/// Whether the repair pass announces again an instance that has been ready for `age`,
/// given the repair `bound` and how long ago the pass last looked at it (`None`: never).
///
/// An instance waiting behind a backlog is as stale as one whose hint was lost, and a
/// queue that does not deduplicate would take every announcement of a waiting backlog
/// again on every pass. So announcements thin out with age: at `bound`, 2, 4 and 8
/// bounds, then every 8 bounds ([`REPAIR_DOUBLINGS`]); each pass announces the
/// instances that crossed one of those marks since it last looked. A lost hint's work is
/// so announced again within 8 bounds at most (within 2 bounds while it is young), and a
/// waiting instance is announced a handful of times plus once per 8 bounds it waits.
pub fn repair_due(age: Duration, bound: Duration, since_last_look: Option<Duration>) -> bool {
    let Some(gap) = since_last_look else { return age >= bound };
    let (age, bound, gap) = (age.as_millis(), bound.as_millis().max(1), gap.as_millis());
    // The age at the last look; `None` when the instance was not ready then.
    let looked = age.checked_sub(gap).filter(|_| gap < age);
    let crossed = |mark: u128| mark <= age && looked.is_none_or(|at| at < mark);
    if (0..=REPAIR_DOUBLINGS).any(|k| crossed(bound << k)) {
        return true;
    }
    let period = bound << REPAIR_DOUBLINGS;
    let before = looked.map(|at| at / period);
    age / period >= 1 && before.is_none_or(|b| age / period > b)
}

/// The hint the repair pass publishes for a ready `row`: its revision (a queue that still
/// holds the same hint keeps one), priority and concurrency key as ordering group, no
/// delay (it is due).
pub fn repair_hint(row: &Instance) -> Hint {
    let mut hint = Hint::new(row.id, row.revision.0 as u64).priority(row.priority);
    hint.group.clone_from(&row.concurrency_key);
    hint
}

/// Times a hint whose instance is ready but went unclaimed is handed back to the queue
/// before its receiver drops it (polling and the repair pass still find the work).
pub const HAND_BACK_MAX: u32 = 20;

/// Longest a handed-back hint waits before it is visible again.
const HAND_BACK_DELAY_MAX: Duration = Duration::from_secs(1);

/// What the receiver of a hint does with it when its claim by id did not take the
/// instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unclaimed {
    /// Ack it: the instance is gone or not ready (the hint was stale or a duplicate), or
    /// it was handed back [`HAND_BACK_MAX`] times already.
    Drop,
    /// Hand it back, visible again after this delay: the instance is ready, so another
    /// worker may take it — one serving its machine, namespace or queue, or one with a
    /// free slot or a free turn of its concurrency key.
    HandBack(Duration),
}

/// The fate of a hint its receiver's claim did not take: `row` is the instance as read
/// after the claim (`None` when it is gone), `receive_count` the delivery's. A ready
/// instance's hint goes back with a delay that doubles from 20 ms with each receive (at
/// most 1 s), so workers that cannot take it pass it on without spinning, and a hint no
/// worker takes by id ends after [`HAND_BACK_MAX`] receives.
pub fn unclaimed(row: Option<&Instance>, receive_count: u32, now: Timestamp) -> Unclaimed {
    match row {
        Some(row) if outcome::claimable(row, now) && receive_count <= HAND_BACK_MAX => {
            let doublings = receive_count.saturating_sub(1).min(10);
            let delay = (Duration::from_millis(20) * (1 << doublings)).min(HAND_BACK_DELAY_MAX);
            Unclaimed::HandBack(delay)
        }
        _ => Unclaimed::Drop,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unclaimed_ready_hint_goes_back_a_bounded_number_of_times() {
        let now = Timestamp(1_000);
        let ready = row(1, Status::Runnable, 0, 0);
        let ms = Duration::from_millis;
        assert_eq!(unclaimed(Some(&ready), 1, now), Unclaimed::HandBack(ms(20)));
        assert_eq!(unclaimed(Some(&ready), 2, now), Unclaimed::HandBack(ms(40)));
        assert_eq!(unclaimed(Some(&ready), 7, now), Unclaimed::HandBack(ms(1_000)));
        assert_eq!(unclaimed(Some(&ready), HAND_BACK_MAX, now), Unclaimed::HandBack(ms(1_000)));
        assert_eq!(unclaimed(Some(&ready), HAND_BACK_MAX + 1, now), Unclaimed::Drop);
        assert_eq!(unclaimed(Some(&ready), u32::MAX, now), Unclaimed::Drop);
        // Gone, executing elsewhere, parked or not due yet: the hint was stale.
        assert_eq!(unclaimed(None, 1, now), Unclaimed::Drop);
        for stale in [
            row(1, Status::Executing, 0, 0),
            row(1, Status::AwaitingSignal, 0, 0),
            row(1, Status::Done, 0, 0),
            row(1, Status::Runnable, 0, 2_000),
        ] {
            assert_eq!(unclaimed(Some(&stale), 1, now), Unclaimed::Drop, "{stale:?}");
        }
    }
    use crate::ids::{InstanceId, MachineRef, Status};
    use crate::instance::NewInstance;
    use std::time::Duration;

    fn params(after: Option<i64>) -> ReadyStaleParams {
        ReadyStaleParams {
            namespaces: vec![],
            queues: vec!["default".into()],
            machines: vec![],
            ready_for: Duration::from_millis(100),
            after: after.map(InstanceId),
            limit: 10,
            now: Timestamp(1_000),
        }
    }

    /// A row inserted at `updated` and due at `eligible`, with `status`.
    fn row(id: i64, status: Status, updated: i64, eligible: i64) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row = Instance::from_new(InstanceId(id), &new, None, Timestamp(updated));
        row.status = status;
        row.updated_at = Timestamp(updated);
        row.eligible_at = Timestamp(eligible);
        row
    }

    fn check(row: &Instance, paused: bool, after: Option<i64>, expected: bool) {
        assert_eq!(needs_hint(row, paused, &params(after)), expected, "{row:?}");
    }

    #[test]
    fn ready_for_the_bound_since_the_later_of_change_and_due_time() {
        check(&row(1, Status::Runnable, 900, 0), false, None, true);
        check(&row(1, Status::Runnable, 901, 0), false, None, false);
        check(&row(1, Status::Runnable, 0, 900), false, None, true);
        check(&row(1, Status::Runnable, 0, 950), false, None, false);
        check(&row(1, Status::Runnable, 0, 1_001), false, None, false);
    }

    #[test]
    fn only_ready_rows_in_scope_after_the_cursor() {
        check(&row(1, Status::Executing, 0, 0), false, None, false);
        check(&row(1, Status::AwaitingSignal, 0, 0), false, None, false);
        check(&row(1, Status::Done, 0, 0), false, None, false);
        check(&row(1, Status::Runnable, 0, 0), true, None, false);
        check(&row(5, Status::Runnable, 0, 0), false, Some(5), false);
        check(&row(6, Status::Runnable, 0, 0), false, Some(5), true);
        let mut elsewhere = row(1, Status::Runnable, 0, 0);
        elsewhere.queue = "other".into();
        check(&elsewhere, false, None, false);
    }

    #[test]
    fn repair_announcements_thin_out_with_age() {
        let s = Duration::from_secs;
        let due = |age: u64, gap: Option<u64>| repair_due(s(age), s(10), gap.map(s));
        assert!(!due(9, None) && due(10, None), "first look: every stale instance");
        assert!(due(10, Some(1)) && !due(11, Some(1)), "the mark at one bound");
        assert!(due(20, Some(1)) && !due(21, Some(1)) && !due(39, Some(1)) && due(40, Some(1)));
        assert!(due(80, Some(1)) && !due(81, Some(1)) && !due(159, Some(1)) && due(160, Some(1)));
        assert!(due(240, Some(5)) && due(244, Some(5)) && !due(245, Some(5)));
        assert!(due(35, Some(20)), "a long gap still catches the mark it spans");
        assert!(due(5_000, Some(6_000)), "a gap longer than the age: every mark it spans");
        assert!(!due(9, Some(6_000)), "never before one bound");
        // Per instance, the announcements over its waiting time with one look a second.
        let count = |wait: u64| (1..=wait).filter(|age| due(*age, Some(1))).count();
        assert_eq!(count(80), 4);
        assert_eq!(count(800), 4 + 9);
    }

    #[test]
    fn the_hint_names_the_revision_priority_and_group() {
        let mut r = row(7, Status::Runnable, 0, 0);
        r.revision.0 = 3;
        r.concurrency_key = Some("k".into());
        let h = repair_hint(&r);
        assert_eq!((h.instance, h.revision, h.group.as_deref()), (InstanceId(7), 3, Some("k")));
        assert_eq!(h.delay, Duration::ZERO);
    }
}
