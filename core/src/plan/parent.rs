//! What an instance's end does to its parent.
//!
//! When a child ends (it finished, failed or was cancelled), its parent's barrier counts it
//! as ended, and a chart parent that delegated to it hears of it through its inbox. A plan
//! that ends an instance carries this as a [`ParentRelease`]; the store executes it after
//! the child's own writes, with [`release`] applied to the parent's row as it stands at
//! that moment. The parent's row is not part of the plan because several children of one
//! parent may end in the same batch, and each must count once against the current row.

use crate::history::HistoryKind;
use crate::ids::{InstanceId, Status};
use crate::instance::{HistoryEntry, Instance, NewSignal};
use crate::join::{JoinRest, JoinState, JoinWoke};
use crate::outcome;
use crate::ports::store::CancelParams;
use crate::time::Timestamp;
use serde_json::json;

/// The parent writes an ended child causes.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentRelease {
    /// The parent whose barrier counts the child as ended; it may no longer exist, and
    /// then nothing is written.
    pub parent: InstanceId,
    /// The child that ended.
    pub child: InstanceId,
    /// Whether it succeeded (`done`), which is what a quorum counts.
    pub succeeded: bool,
    /// The event the parent hears of the child's end through its inbox, delivered after
    /// the barrier release through the ordinary delivery rules; dropped when the parent no
    /// longer exists.
    pub notice: Option<NewSignal>,
}

/// What `child`'s end tells its parent: `None` while the child is live or when it has no
/// parent.
pub fn ended(child: &Instance) -> Option<ParentRelease> {
    if !child.status.is_terminal() {
        return None;
    }
    let parent = child.parent?;
    Some(ParentRelease {
        parent,
        child: child.id,
        succeeded: child.status == Status::Done,
        notice: outcome::parent_notice(child),
    })
}

/// The writes one counted child (or a passed deadline) causes on its parent: the parent's
/// row, the history it records, and the children the store cancels (each with its
/// descendants, [`super::cancel::cancel`]) in the same transaction, after writing the row.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentPlan {
    /// The parent's row after the change (unchanged when `changed` is false).
    pub row: Instance,
    /// Whether the row changed at all (a child that does not count changes nothing).
    pub changed: bool,
    /// History to append to the parent, in order.
    pub history: Vec<HistoryEntry>,
    /// Cancels of the barrier's children still running when the parent woke early under a
    /// join that cancels the rest; a child that ended meanwhile is left as it is.
    pub cancel: Vec<CancelParams>,
}

/// The parent's row after one ended child is counted.
///
/// Without a join state (the default all-join): the barrier drops by one (never below
/// zero), and the last child makes a parent awaiting its children runnable now.
///
/// With one ([`crate::join`]): only a child still pending on the open barrier counts,
/// once; when the counts settle ([`JoinState::settled`]: the quorum reached, the quorum
/// out of reach, or every child ended) a parent awaiting its children wakes — exactly once,
/// since the barrier closes — and, under [`JoinRest::Cancel`], the children still pending
/// are cancelled. Any other child (one of an earlier barrier, one left running, one
/// started outside the barrier) changes nothing.
pub fn release(parent: &Instance, child: &ParentRelease, now: Timestamp) -> ParentPlan {
    let Some(mut join) = JoinState::of(&parent.context) else {
        return ParentPlan {
            row: outcome::release_parent(parent, now),
            changed: true,
            history: Vec::new(),
            cancel: Vec::new(),
        };
    };
    let Some(at) = join.pending.iter().position(|id| *id == child.child) else {
        return unchanged(parent);
    };
    if !join.open() {
        return unchanged(parent);
    }
    join.pending.remove(at);
    join.ended += 1;
    join.succeeded += u32::from(child.succeeded);
    let mut row = parent.clone();
    row.children_pending = (parent.children_pending - 1).max(0);
    row.updated_at = now;
    let settled = join.settled().filter(|_| parent.status == Status::AwaitingChildren);
    if let Some(why) = settled {
        return wake(row, join, why, now);
    }
    join.store(&mut row.context);
    ParentPlan { row, changed: true, history: Vec::new(), cancel: Vec::new() }
}

/// The parent's row when its join's deadline timer fires at `now`: a parent still awaiting
/// an open barrier whose deadline has passed wakes with whatever has finished, and under
/// [`JoinRest::Cancel`] the children still pending are cancelled. A deadline of an earlier
/// barrier, a barrier already settled, or a parent no longer waiting changes nothing, so
/// the timer fires its effect at most once however many sweeps see it.
pub fn expire(parent: &Instance, now: Timestamp) -> ParentPlan {
    let Some(join) = JoinState::of(&parent.context) else { return unchanged(parent) };
    let due = join.deadline.is_some_and(|deadline| deadline <= now);
    if !join.open() || !due || parent.status != Status::AwaitingChildren {
        return unchanged(parent);
    }
    let mut row = parent.clone();
    row.updated_at = now;
    wake(row, join, JoinWoke::Deadline, now)
}

fn unchanged(parent: &Instance) -> ParentPlan {
    ParentPlan { row: parent.clone(), changed: false, history: Vec::new(), cancel: Vec::new() }
}

/// Wakes `row` from its barrier: runnable now, the barrier closed with why, the children
/// still pending cancelled or left running.
fn wake(mut row: Instance, mut join: JoinState, why: JoinWoke, now: Timestamp) -> ParentPlan {
    let rest = std::mem::take(&mut join.pending);
    join.woke = Some(why);
    join.unfinished = u32::try_from(rest.len()).unwrap_or(u32::MAX);
    row.status = Status::Runnable;
    row.eligible_at = now;
    row.children_pending = 0;
    join.store(&mut row.context);
    let history = vec![HistoryEntry::new(
        HistoryKind::JoinWoke,
        json!({
            "woke": why,
            "succeeded": join.succeeded,
            "ended": join.ended,
            "unfinished": join.unfinished,
            "rest": if rest.is_empty() { None } else { Some(join.rest) },
        }),
    )];
    let cancel = match join.rest {
        JoinRest::Cancel => rest
            .into_iter()
            .map(|id| CancelParams {
                id,
                reason: format!(
                    "its parent {} stopped waiting for it (join: {})",
                    row.id,
                    match why {
                        JoinWoke::Quorum => "quorum reached",
                        JoinWoke::Unreachable => "quorum out of reach",
                        JoinWoke::Deadline => "deadline passed",
                        JoinWoke::All => "all ended",
                    }
                ),
                cascade: true,
                now,
                only_in: None,
            })
            .collect(),
        JoinRest::Leave => Vec::new(),
    };
    ParentPlan { row, changed: true, history, cancel }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{MachineRef, Status};
    use crate::instance::NewInstance;

    fn row(id: i64, parent: Option<i64>, status: Status) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row =
            Instance::from_new(InstanceId(id), &new, parent.map(InstanceId), Timestamp(0));
        row.status = status;
        row
    }

    #[test]
    fn only_an_ended_child_with_a_parent_releases_it() {
        assert_eq!(ended(&row(2, Some(1), Status::Runnable)), None);
        assert_eq!(ended(&row(2, None, Status::Done)), None);
        let release = ended(&row(2, Some(1), Status::Cancelled)).expect("a release");
        assert_eq!(
            (release.parent, release.child, release.succeeded),
            (InstanceId(1), InstanceId(2), false)
        );
        assert_eq!(release.notice, None, "a child no chart state delegated to sends no notice");
        let mut delegated = row(3, Some(1), Status::Done);
        delegated.invoked_by = Some("work".into());
        let notice = ended(&delegated).and_then(|r| r.notice).expect("a notice");
        assert_eq!(notice.dedup_key.as_deref(), Some("child:3:terminal"));
    }

    #[test]
    fn the_last_child_makes_an_awaiting_parent_runnable() {
        let mut parent = row(1, None, Status::AwaitingChildren);
        parent.children_pending = 2;
        let child = ended(&row(2, Some(1), Status::Done)).expect("a release");
        let once = release(&parent, &child, Timestamp(7)).row;
        assert_eq!((once.children_pending, once.status), (1, Status::AwaitingChildren));
        let twice = release(&once, &child, Timestamp(8)).row;
        assert_eq!((twice.children_pending, twice.status), (0, Status::Runnable));
        assert_eq!(twice.eligible_at, Timestamp(8));
        assert_eq!(
            release(&twice, &child, Timestamp(9)).row.children_pending,
            0,
            "never below zero"
        );
    }

    /// A parent with a quorum join over `n` children with ids 2..=n+1.
    fn quorum_parent(join: &crate::join::Join, n: i64) -> Instance {
        let mut parent = row(1, None, Status::AwaitingChildren);
        parent.children_pending = i32::try_from(n).unwrap();
        JoinState::start(join, (2..2 + n).map(InstanceId).collect(), Timestamp(0))
            .store(&mut parent.context);
        parent
    }

    fn end(id: i64, status: Status) -> ParentRelease {
        ended(&row(id, Some(1), status)).expect("a release")
    }

    #[test]
    fn a_quorum_of_three_of_five_wakes_once_at_the_third_success_and_cancels_the_rest() {
        use crate::join::Join;
        let mut parent = quorum_parent(&Join::quorum(3), 5);
        let mut wakes = 0;
        let mut cancelled = Vec::new();
        let ends = [
            (2, Status::Done),
            (3, Status::Failed),
            (4, Status::Done),
            (5, Status::Done),
            (6, Status::Done),
            (4, Status::Done),
        ];
        for (i, (id, status)) in ends.into_iter().enumerate() {
            let before = parent.status;
            let plan = release(&parent, &end(id, status), Timestamp(10 + i as i64));
            if plan.row.status == Status::Runnable && before == Status::AwaitingChildren {
                wakes += 1;
                assert_eq!(id, 5, "the third success wakes it");
                cancelled = plan.cancel.iter().map(|c| c.id).collect();
                assert_eq!(plan.history[0].data["woke"], "quorum");
            }
            parent = plan.row;
        }
        assert_eq!(wakes, 1);
        assert_eq!(cancelled, [InstanceId(6)], "only the child still pending");
        let state = JoinState::of(&parent.context).unwrap();
        assert_eq!(
            (state.succeeded, state.ended, state.unfinished),
            (3, 4, 1),
            "later ends change nothing"
        );
        assert_eq!(parent.children_pending, 0);
    }

    #[test]
    fn a_quorum_out_of_reach_wakes_the_parent_and_children_outside_the_barrier_never_count() {
        use crate::join::Join;
        let parent = quorum_parent(&Join::quorum(2).leave_running(), 3);
        let outsider = release(&parent, &end(9, Status::Done), Timestamp(5));
        assert!(!outsider.changed, "a child outside the barrier");
        let one = release(&parent, &end(2, Status::Failed), Timestamp(6)).row;
        assert_eq!(one.status, Status::AwaitingChildren);
        let two = release(&one, &end(3, Status::Cancelled), Timestamp(7));
        assert_eq!(two.row.status, Status::Runnable, "0 successes + 1 live < 2");
        assert!(two.cancel.is_empty(), "left running");
        assert_eq!(two.history[0].data["woke"], "unreachable");
    }

    #[test]
    fn a_deadline_wakes_an_open_barrier_once_and_only_when_due() {
        use crate::join::Join;
        use std::time::Duration;
        let parent = quorum_parent(&Join::all().within(Duration::from_secs(10)), 2);
        assert!(!expire(&parent, Timestamp(9_999)).changed, "not due yet");
        let done = release(&parent, &end(2, Status::Done), Timestamp(100)).row;
        let woke = expire(&done, Timestamp(10_000));
        assert_eq!(woke.row.status, Status::Runnable);
        assert_eq!(woke.cancel.iter().map(|c| c.id).collect::<Vec<_>>(), [InstanceId(3)]);
        assert_eq!(woke.history[0].data["woke"], "deadline");
        assert!(!expire(&woke.row, Timestamp(10_001)).changed, "a second fire does nothing");
        let after = release(&woke.row, &end(3, Status::Cancelled), Timestamp(10_002));
        assert!(!after.changed, "the cancelled rest does not count");
        assert!(!expire(&row(1, None, Status::AwaitingChildren), Timestamp(1)).changed);
    }
}
