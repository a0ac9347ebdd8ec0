//! Cancelling an instance and, with `cascade`, its live descendants.
//!
//! A terminal instance is left as it is, and so is one outside the statuses the cancel
//! was limited to ([`CancelParams::only_in`]). Otherwise it is cancelled ([`outcome::cancel`]),
//! then, with `cascade`, its descendants breadth first, at most
//! [`limits::CANCEL_CASCADE_DEPTH_MAX`] levels below it, skipping terminal ones, and at
//! most [`limits::CANCEL_CASCADE_MAX`] instances in all. Each cancelled instance records
//! why (and, for a descendant, which cancel reached it), its inbox closes and is drained
//! (what it held unread is recorded, [`inbox::drained`]), its timers go, and it counts as
//! a terminal child on its parent.

use super::RowWrite;
use super::parent::{self, ParentRelease};
use crate::error::{StoreError, StoreResult};
use crate::history::HistoryKind;
use crate::ids::InstanceId;
use crate::inbox::{self, Pending};
use crate::instance::{HistoryEntry, Instance};
use crate::limits;
use crate::outcome;
use crate::ports::store::CancelParams;
use crate::time::Timestamp;
use serde_json::json;
use std::collections::{HashMap, HashSet};

/// What a store read for a cancel.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CancelRead {
    /// The instance named by the cancel (`None` when it does not exist).
    pub root: Option<Instance>,
    /// With `cascade`: its descendants breadth first, each with its depth below the root
    /// (children are at depth 1), at least down to [`limits::CANCEL_CASCADE_DEPTH_MAX`].
    pub descendants: Vec<(Instance, usize)>,
    /// The pending inbox signals of the instances that may be cancelled (absent = empty).
    pub pending: HashMap<InstanceId, Pending>,
}

/// The writes of a cancel. First, for each row in cancel order: write it with its history,
/// empty its inbox and delete its timers. Then, for each release in order: count the ended
/// child on its parent ([`parent::release`]) and deliver the parent's notice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CancelPlan {
    /// The cancelled rows.
    pub rows: Vec<RowWrite>,
    /// What each cancelled row that has a parent tells it, in cancel order. Every cancelled
    /// child counts on its parent's barrier, even when that parent is cancelled too.
    pub releases: Vec<ParentRelease>,
}

/// Whether a cascading cancel that cancelled `cancelled` instances (the root included) may
/// have stopped at [`limits::CANCEL_CASCADE_MAX`] with live descendants left: a store
/// returns only the ids, so a cascade that cancelled exactly the bound is taken as cut (it
/// may have been all there was). A cut at [`limits::CANCEL_CASCADE_DEPTH_MAX`] levels is
/// not seen this way.
pub fn may_be_cut(cancelled: usize) -> bool {
    cancelled >= limits::CANCEL_CASCADE_MAX
}

impl CancelPlan {
    /// The ids cancelled: the caller's result.
    pub fn cancelled(&self) -> Vec<InstanceId> {
        self.rows.iter().map(|w| w.row.id).collect()
    }
}

/// Plans `p`. `NotFound` when the named instance does not exist.
pub fn cancel(p: &CancelParams, read: CancelRead) -> StoreResult<CancelPlan> {
    let root = read
        .root
        .ok_or_else(|| StoreError::not_found(format!("instance {} does not exist", p.id)))?;
    let mut plan = CancelPlan::default();
    if root.status.is_terminal() || p.only_in.is_some_and(|set| !set.contains(root.status)) {
        return Ok(plan);
    }
    let descendants = read
        .descendants
        .into_iter()
        .filter(|(_, depth)| p.cascade && *depth <= limits::CANCEL_CASCADE_DEPTH_MAX)
        .map(|(row, _)| row);
    let mut seen = HashSet::new();
    for row in std::iter::once(root).chain(descendants) {
        if plan.rows.len() >= limits::CANCEL_CASCADE_MAX {
            break;
        }
        if !seen.insert(row.id) {
            continue;
        }
        let Some(next) = outcome::cancel(&row, &p.reason, p.now) else { continue };
        let cascade_from = (row.id != p.id).then_some(p.id);
        let mut history = vec![HistoryEntry::new(
            HistoryKind::Cancelled,
            json!({ "reason": next.last_error, "cascade_from": cascade_from }),
        )];
        history.extend(read.pending.get(&row.id).and_then(inbox::drained));
        plan.releases.extend(parent::ended(&next));
        plan.rows.push(RowWrite { row: next, attempt: row.attempt, history });
    }
    Ok(plan)
}

/// The delegated children a step commit cancels: child machines exist for their
/// delegation state, so they go when the parent leaves that state or fails. (A chart that
/// finishes has left every delegation state; a step machine that finishes and started
/// children itself lets them run.)
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LeftDelegations {
    /// None.
    #[default]
    None,
    /// The live children started from one of the delegation states in `left`, which the
    /// commit leaves, except those in `started`: the children the commit itself starts (a
    /// state retried after its `@timeout` cancels its old child and starts a new one).
    States {
        /// The delegation states left.
        left: Vec<String>,
        /// The children this commit inserts, which it never cancels.
        started: Vec<InstanceId>,
    },
    /// Every live delegated child: the commit fails the instance.
    All,
}

impl LeftDelegations {
    /// What a commit that leaves `states` cancels; everything delegated when it `fails`
    /// the instance.
    pub fn of(states: &[String], fails: bool) -> Self {
        match (fails, states.is_empty()) {
            (true, _) => LeftDelegations::All,
            (false, true) => LeftDelegations::None,
            (false, false) => {
                LeftDelegations::States { left: states.to_vec(), started: Vec::new() }
            }
        }
    }

    /// This, sparing `started`: the children the same commit inserts.
    pub fn sparing(self, started: impl IntoIterator<Item = InstanceId>) -> Self {
        match self {
            LeftDelegations::States { left, .. } => {
                LeftDelegations::States { left, started: started.into_iter().collect() }
            }
            other => other,
        }
    }

    /// Whether there is nothing to cancel.
    pub fn is_none(&self) -> bool {
        *self == LeftDelegations::None
    }

    /// Whether `child` is a live child machine of `parent` that this cancels.
    pub fn covers(&self, child: &Instance, parent: InstanceId) -> bool {
        let Some(state) = child.invoked_by.as_deref() else { return false };
        if child.parent != Some(parent) || child.status.is_terminal() {
            return false;
        }
        match self {
            LeftDelegations::None => false,
            LeftDelegations::States { left, started } => {
                left.iter().any(|l| l == state) && !started.contains(&child.id)
            }
            LeftDelegations::All => true,
        }
    }

    /// The cancel of `child` (one this covers), with its descendants.
    pub fn cancel_params(&self, child: &Instance, now: Timestamp) -> CancelParams {
        let state = child.invoked_by.as_deref().unwrap_or_default();
        let reason = match self {
            LeftDelegations::All => {
                format!("its parent failed while in the delegation state `{state}`")
            }
            _ => format!(
                "its parent exited the delegation state `{state}` (left it, or retried it on a timeout)"
            ),
        };
        CancelParams { id: child.id, reason, cascade: true, now, only_in: None }
    }
}

/// Plans a [`LeftDelegations::cancel_params`] cancel: as [`cancel`], except that the parent hears nothing
/// of it through its inbox, since it has left the state the notice would be for. Its
/// barrier still counts the child as ended.
pub fn left_delegation(p: &CancelParams, read: CancelRead) -> StoreResult<CancelPlan> {
    let parent = read.root.as_ref().and_then(|r| r.parent);
    let mut plan = cancel(p, read)?;
    for release in &mut plan.releases {
        if Some(release.parent) == parent {
            release.notice = None;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{MachineRef, SignalId, Status};
    use crate::instance::NewInstance;

    fn row(id: i64, status: Status) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row = Instance::from_new(InstanceId(id), &new, None, Timestamp(0));
        row.status = status;
        row.attempt = 1;
        row
    }

    fn params(cascade: bool) -> CancelParams {
        CancelParams {
            id: InstanceId(1),
            reason: "stop".into(),
            cascade,
            now: Timestamp(5),
            only_in: None,
        }
    }

    fn read(root: Status) -> CancelRead {
        let mut pending = Pending::default();
        pending.push(SignalId(3), "go", 1);
        CancelRead {
            root: Some(row(1, root)),
            descendants: vec![
                (row(2, Status::AwaitingSignal), 1),
                (row(3, Status::Done), 1),
                (row(4, Status::Runnable), limits::CANCEL_CASCADE_DEPTH_MAX),
                (row(5, Status::Runnable), limits::CANCEL_CASCADE_DEPTH_MAX + 1),
            ],
            pending: HashMap::from([(InstanceId(2), pending)]),
        }
    }

    #[test]
    fn a_cascade_cancels_live_descendants_within_the_depth_bound() {
        let plan = cancel(&params(true), read(Status::Runnable)).unwrap();
        assert_eq!(plan.cancelled(), [InstanceId(1), InstanceId(2), InstanceId(4)]);
        let kinds = |w: &RowWrite| w.history.iter().map(|h| h.kind.clone()).collect::<Vec<_>>();
        assert_eq!(kinds(&plan.rows[0]), ["CANCELLED"]);
        assert_eq!(kinds(&plan.rows[1]), ["CANCELLED", inbox::INBOX_DRAINED]);
        assert_eq!(plan.rows[1].history[0].data["cascade_from"], json!(1));
        assert!(plan.rows.iter().all(|w| w.row.status == Status::Cancelled));
    }

    #[test]
    fn every_cancelled_row_with_a_parent_releases_it_in_cancel_order() {
        let mut read = read(Status::Runnable);
        read.root.as_mut().unwrap().parent = Some(InstanceId(9));
        for (row, _) in &mut read.descendants {
            row.parent = Some(InstanceId(1));
        }
        read.descendants[0].0.invoked_by = Some("work".into());
        let plan = cancel(&params(true), read).unwrap();
        let parents: Vec<_> = plan.releases.iter().map(|r| r.parent).collect();
        assert_eq!(parents, [InstanceId(9), InstanceId(1), InstanceId(1)]);
        let notices: Vec<_> = plan.releases.iter().map(|r| r.notice.is_some()).collect();
        assert_eq!(notices, [false, true, false], "only the delegated child notifies");
    }

    #[test]
    fn without_cascade_or_on_a_terminal_root_less_is_cancelled() {
        assert_eq!(
            cancel(&params(false), read(Status::Runnable)).unwrap().cancelled(),
            [InstanceId(1)]
        );
        assert!(cancel(&params(true), read(Status::Failed)).unwrap().rows.is_empty());
        let missing = CancelRead::default();
        assert_eq!(cancel(&params(true), missing).unwrap_err().kind, crate::ErrorKind::NotFound);
    }

    #[test]
    fn leaving_a_delegation_state_cancels_the_child_without_telling_the_parent() {
        let mut read = read(Status::Executing);
        let child = read.root.as_mut().unwrap();
        child.parent = Some(InstanceId(9));
        child.invoked_by = Some("pay".into());
        let grandchild = &mut read.descendants[0].0;
        grandchild.parent = Some(InstanceId(1));
        grandchild.invoked_by = Some("charge".into());
        let left = LeftDelegations::of(&["pay".to_owned()], false);
        let p = left.cancel_params(read.root.as_ref().unwrap(), Timestamp(5));
        assert!(p.cascade && p.reason.contains("`pay`"), "{}", p.reason);
        let plan = left_delegation(&p, read).unwrap();
        assert_eq!(plan.cancelled(), [InstanceId(1), InstanceId(2), InstanceId(4)]);
        assert_eq!(plan.releases[0].parent, InstanceId(9), "the barrier still counts it");
        assert_eq!(plan.releases[0].notice, None, "the parent left the state");
        assert!(plan.releases[1].notice.is_some(), "the child's own child still reports");
    }

    #[test]
    fn only_live_children_started_from_a_left_state_are_cancelled() {
        let left = LeftDelegations::of(&["pay".to_owned()], false);
        let mut child = row(2, Status::Executing);
        child.parent = Some(InstanceId(1));
        assert!(!left.covers(&child, InstanceId(1)), "not a delegated child");
        assert!(!LeftDelegations::All.covers(&child, InstanceId(1)), "not a delegated child");
        child.invoked_by = Some("pay".into());
        assert!(left.covers(&child, InstanceId(1)));
        assert!(!left.covers(&child, InstanceId(7)), "another parent's child");
        let ship = LeftDelegations::of(&["ship".to_owned()], false);
        assert!(!ship.covers(&child, InstanceId(1)));
        let failed = LeftDelegations::of(&[], true);
        assert!(failed.covers(&child, InstanceId(1)), "a parent that fails takes them all");
        assert!(failed.cancel_params(&child, Timestamp(1)).reason.contains("failed"));
        assert!(LeftDelegations::of(&[], false).is_none());
        let retried = LeftDelegations::of(&["pay".to_owned()], false).sparing([InstanceId(2)]);
        assert!(!retried.covers(&child, InstanceId(1)), "started by the same commit");
        child.status = Status::Done;
        assert!(!left.covers(&child, InstanceId(1)), "already ended");
    }
}
