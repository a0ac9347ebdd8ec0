//! The repair pass of a hint queue: which instances need a hint again, and what that hint
//! says.
//!
//! A hint can be lost (a crash between commit and publish, a flushed or purged queue, a
//! delivery that nobody announced), and the store cannot know whether one is on its way.
//! What it does know is how long an instance has been ready: since its last change
//! (`updated_at`) or since it became due (`eligible_at`), whichever is later. An instance
//! ready for longer than a bound has either lost its hint or is waiting behind a backlog;
//! publishing it again is right in the first case and harmless in the second (a queue that
//! deduplicates keeps one hint per instance and revision, and a duplicate claims nothing).
//! Stores select the rows by this rule ([`crate::ports::Store::instance_ready_stale`]);
//! the repair pass turns each into [`hint`].

use crate::instance::Instance;
use crate::outcome;
use crate::ports::queue::Hint;
use crate::ports::store::ReadyStaleParams;
use crate::time::Timestamp;

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

/// The hint the repair pass publishes for a ready `row`: its revision (a queue that still
/// holds the same hint keeps one), priority and concurrency key as ordering group, no
/// delay (it is due).
pub fn hint(row: &Instance) -> Hint {
    let mut hint = Hint::new(row.id, row.revision.0 as u64).priority(row.priority);
    hint.group.clone_from(&row.concurrency_key);
    hint
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn the_hint_names_the_revision_priority_and_group() {
        let mut r = row(7, Status::Runnable, 0, 0);
        r.revision.0 = 3;
        r.concurrency_key = Some("k".into());
        let h = hint(&r);
        assert_eq!((h.instance, h.revision, h.group.as_deref()), (InstanceId(7), 3, Some("k")));
        assert_eq!(h.delay, Duration::ZERO);
    }
}
