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
use crate::limits;
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

/// One thing a parent's release leaves for the store to do, in the transaction that ended
/// the child, after the parent's row is written.
#[derive(Debug, Clone, PartialEq)]
pub enum FollowUp {
    /// Cancel a child the parent stopped waiting for, with its descendants
    /// ([`super::cancel::cancel`]).
    Cancel(CancelParams),
    /// Deliver the ended child's notice to its parent's inbox, through the ordinary
    /// delivery rules; dropped when the parent no longer exists.
    Notice {
        /// The parent.
        parent: InstanceId,
        /// The notice.
        signal: NewSignal,
    },
}

impl ParentRelease {
    /// What this release leaves to do once its parent's plan is written, in order: cancel
    /// the children `cancels` names (the ones the parent stopped waiting for, empty when
    /// the parent did not wake or is gone), then deliver the ended child's notice, so the
    /// reports of the cancelled children reach the parent's inbox before it.
    pub fn follow_ups(&self, cancels: Vec<CancelParams>) -> impl Iterator<Item = FollowUp> {
        let notice =
            self.notice.clone().map(|signal| FollowUp::Notice { parent: self.parent, signal });
        cancels.into_iter().map(FollowUp::Cancel).chain(notice)
    }
}

/// The next step of a [`FollowUps`] run.
#[derive(Debug, Clone, PartialEq)]
pub enum NextFollowUp {
    /// Cancel this instance; hand what its releases leave to do to [`FollowUps::then`]
    /// before asking for the next step.
    Cancel(CancelParams),
    /// Deliver these notices, each to its parent, as one batch (at most
    /// [`limits::DELIVER_BATCH_MAX`]): a batch delivers as if its notices were delivered
    /// one after another.
    Notices(Vec<(InstanceId, NewSignal)>),
}

/// What the releases of one transaction leave to do, run in order and depth first: what a
/// cancel's own releases leave to do runs before the next item, so every store cancels the
/// same children and fills each parent's inbox in the same order. At most
/// [`limits::CANCEL_CASCADE_MAX`] cancels run; the ones past the bound are dropped (and
/// [`FollowUps::cut`] says so), while notices are always delivered. The run is bounded: a
/// cancel's follow-ups come only from a cancel that ran.
#[derive(Debug, Default)]
pub struct FollowUps {
    /// The items left, the next one on top.
    stack: Vec<FollowUp>,
    /// Cancels handed out so far.
    cancels: usize,
    /// Whether a cancel was dropped at the bound.
    cut: bool,
}

impl FollowUps {
    /// A run of `items`, in their order.
    pub fn new(items: impl IntoIterator<Item = FollowUp>) -> Self {
        let mut run = Self::default();
        run.then(items);
        run
    }

    /// A run of `cancels` alone (the children a join's deadline stopped waiting for).
    pub fn cancels(cancels: Vec<CancelParams>) -> Self {
        Self::new(cancels.into_iter().map(FollowUp::Cancel))
    }

    /// Puts `items` (what the cancel just handed out left to do) before the rest.
    pub fn then(&mut self, items: impl IntoIterator<Item = FollowUp>) {
        let items: Vec<FollowUp> = items.into_iter().collect();
        self.stack.extend(items.into_iter().rev());
    }

    /// The next step, `None` once the run is over.
    pub fn next_step(&mut self) -> Option<NextFollowUp> {
        loop {
            match self.stack.pop()? {
                FollowUp::Cancel(cancel) => {
                    if self.cancels >= limits::CANCEL_CASCADE_MAX {
                        self.cut = true;
                        continue;
                    }
                    self.cancels += 1;
                    return Some(NextFollowUp::Cancel(cancel));
                }
                FollowUp::Notice { parent, signal } => {
                    let mut batch = vec![(parent, signal)];
                    while batch.len() < limits::DELIVER_BATCH_MAX
                        && matches!(self.stack.last(), Some(FollowUp::Notice { .. }))
                    {
                        let Some(FollowUp::Notice { parent, signal }) = self.stack.pop() else {
                            break;
                        };
                        batch.push((parent, signal));
                    }
                    return Some(NextFollowUp::Notices(batch));
                }
            }
        }
    }

    /// Whether a cancel was dropped at [`limits::CANCEL_CASCADE_MAX`].
    pub fn cut(&self) -> bool {
        self.cut
    }
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

    fn cancel_of(id: i64) -> CancelParams {
        CancelParams {
            id: InstanceId(id),
            reason: "stopped waiting".into(),
            cascade: true,
            now: Timestamp(0),
            only_in: None,
        }
    }

    fn notice_to(parent: i64, name: &str) -> FollowUp {
        FollowUp::Notice {
            parent: InstanceId(parent),
            signal: NewSignal::new(InstanceId(parent), name),
        }
    }

    /// Runs `run`, answering each cancel with what `further` says it leaves to do; returns
    /// the steps as text, in order.
    fn steps(mut run: FollowUps, further: impl Fn(i64) -> Vec<FollowUp>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(step) = run.next_step() {
            match step {
                NextFollowUp::Cancel(c) => {
                    out.push(format!("cancel {}", c.id.0));
                    run.then(further(c.id.0));
                }
                NextFollowUp::Notices(batch) => {
                    let names: Vec<&str> = batch.iter().map(|(_, s)| s.name.as_str()).collect();
                    out.push(format!("notices {}", names.join(",")));
                }
            }
        }
        out
    }

    #[test]
    fn a_release_cancels_the_rest_before_its_notice_reaches_the_parent() {
        let mut delegated = row(3, Some(1), Status::Done);
        delegated.invoked_by = Some("work".into());
        let release = ended(&delegated).expect("a release");
        let items: Vec<FollowUp> = release.follow_ups(vec![cancel_of(4), cancel_of(5)]).collect();
        assert!(
            matches!(&items[..], [FollowUp::Cancel(a), FollowUp::Cancel(b), FollowUp::Notice { parent, .. }]
            if a.id == InstanceId(4) && b.id == InstanceId(5) && *parent == InstanceId(1))
        );
        let quiet = end(6, Status::Failed);
        assert_eq!(quiet.follow_ups(Vec::new()).count(), 0, "no cancels and no notice: nothing");
    }

    #[test]
    fn follow_ups_run_depth_first_and_batch_runs_of_notices() {
        let run = FollowUps::new([
            FollowUp::Cancel(cancel_of(10)),
            notice_to(1, "a"),
            FollowUp::Cancel(cancel_of(20)),
            notice_to(1, "b"),
        ]);
        // Cancelling 10 wakes its own parent, which cancels 11 and hears of 10's end.
        let further = |id: i64| match id {
            10 => vec![FollowUp::Cancel(cancel_of(11)), notice_to(10, "c")],
            _ => Vec::new(),
        };
        assert_eq!(
            steps(run, further),
            ["cancel 10", "cancel 11", "notices c,a", "cancel 20", "notices b"],
            "a cancel's follow-ups run before the next item; adjacent notices go as one batch"
        );
    }

    #[test]
    fn cancels_past_the_bound_are_dropped_and_said_while_notices_still_arrive() {
        let max = limits::CANCEL_CASCADE_MAX;
        let mut items: Vec<FollowUp> =
            (0..max as i64 + 2).map(|i| FollowUp::Cancel(cancel_of(i))).collect();
        items.push(notice_to(1, "last"));
        let mut run = FollowUps::new(items);
        let (mut cancels, mut notices) = (0, 0);
        while let Some(step) = run.next_step() {
            match step {
                NextFollowUp::Cancel(_) => cancels += 1,
                NextFollowUp::Notices(batch) => notices += batch.len(),
            }
        }
        assert_eq!((cancels, notices, run.cut()), (max, 1, true));
        let mut within = FollowUps::cancels(vec![cancel_of(1)]);
        while within.next_step().is_some() {}
        assert!(!within.cut(), "a run within the bound is not cut");
    }
}
