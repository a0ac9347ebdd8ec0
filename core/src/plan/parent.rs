//! What an instance's end does to its parent.
//!
//! When a child ends (it finished, failed or was cancelled), its parent's barrier counts it
//! as ended, and a chart parent that delegated to it hears of it through its inbox. A plan
//! that ends an instance carries this as a [`ParentRelease`]; the store executes it after
//! the child's own writes, with [`release`] applied to the parent's row as it stands at
//! that moment. The parent's row is not part of the plan because several children of one
//! parent may end in the same batch, and each must count once against the current row.

use crate::ids::InstanceId;
use crate::instance::{Instance, NewSignal};
use crate::outcome;
use crate::time::Timestamp;

/// The parent writes an ended child causes.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentRelease {
    /// The parent whose barrier counts the child as ended; it may no longer exist, and
    /// then nothing is written.
    pub parent: InstanceId,
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
    Some(ParentRelease { parent, notice: outcome::parent_notice(child) })
}

/// The parent's row after one ended child is counted: the barrier drops by one (never below
/// zero), and the last child makes a parent awaiting its children runnable now.
pub fn release(parent: &Instance, now: Timestamp) -> Instance {
    outcome::release_parent(parent, now)
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
        assert_eq!(release.parent, InstanceId(1));
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
        let once = release(&parent, Timestamp(7));
        assert_eq!((once.children_pending, once.status), (1, Status::AwaitingChildren));
        let twice = release(&once, Timestamp(8));
        assert_eq!((twice.children_pending, twice.status), (0, Status::Runnable));
        assert_eq!(twice.eligible_at, Timestamp(8));
        assert_eq!(release(&twice, Timestamp(9)).children_pending, 0, "never below zero");
    }
}
