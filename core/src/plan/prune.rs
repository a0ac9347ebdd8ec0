//! `instance_prune`: which instances of a page are deleted, with their history, inbox and
//! timers.
//!
//! The read set is the page's rows in id order, each with whether its parent is still
//! live, whether it still has children and whether dead letters still name it. An
//! instance is prunable when it is terminal, its last change is before the cutoff, it is
//! in the page's scope (namespace, machines, exceptions), and nothing still refers to it:
//!
//! - not the child of a live parent: a parent reads its children's results when it wakes,
//!   so a child stays until its parent ended too (or is gone);
//! - no children left: a parent goes in a pass after its children (they have larger ids,
//!   so they come later in a pass), and never leaves a child pointing at nothing;
//! - no dead letters: they are kept for their own retention and name their instance.

use crate::ids::{InstanceId, Status};
use crate::ports::store::PruneParams;
use crate::time::Timestamp;

/// What the planner needs of one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneCandidate {
    /// The row's id.
    pub id: InstanceId,
    /// Its namespace.
    pub namespace: String,
    /// Its machine name.
    pub machine: String,
    /// Its status.
    pub status: Status,
    /// Its last change (for a terminal row: when it ended).
    pub updated_at: Timestamp,
    /// It has a parent that exists and is not terminal.
    pub parent_live: bool,
    /// Some of its children still exist.
    pub has_children: bool,
    /// Some dead letters still name it.
    pub has_dead_letters: bool,
}

/// The ids of `read` to delete, in id order.
pub fn page(p: &PruneParams, read: &[PruneCandidate]) -> Vec<InstanceId> {
    read.iter().filter(|c| prunable(p, c)).map(|c| c.id).collect()
}

/// The rule for one row.
pub fn prunable(p: &PruneParams, c: &PruneCandidate) -> bool {
    c.status.is_terminal()
        && c.updated_at < p.ended_before
        && !c.parent_live
        && !c.has_children
        && !c.has_dead_letters
        && p.namespace.as_ref().is_none_or(|ns| *ns == c.namespace)
        && (p.machines.is_empty() || p.machines.contains(&c.machine))
        && !p.except.contains(&c.machine)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PruneParams {
        PruneParams {
            namespace: Some("ns".into()),
            machines: Vec::new(),
            except: vec!["kept".into()],
            ended_before: Timestamp::from_millis(1_000),
            after: None,
            limit: 100,
        }
    }

    /// Refers: a live parent (`p`), children left (`c`), dead letters (`d`).
    fn refs(c: &mut PruneCandidate, refs: &str) {
        c.parent_live = refs.contains('p');
        c.has_children = refs.contains('c');
        c.has_dead_letters = refs.contains('d');
    }

    /// One row: (status, updated_at, what refers to it, namespace, machine) → prunable.
    fn check(status: Status, at: i64, referred: &str, ns: &str, machine: &str, expected: bool) {
        let mut c = PruneCandidate {
            id: InstanceId(1),
            namespace: ns.into(),
            machine: machine.into(),
            status,
            updated_at: Timestamp::from_millis(at),
            parent_live: false,
            has_children: false,
            has_dead_letters: false,
        };
        refs(&mut c, referred);
        assert_eq!(prunable(&params(), &c), expected, "{c:?}");
    }

    #[test]
    fn what_is_prunable() {
        use Status::{AwaitingSignal, Cancelled, Done, Failed, Runnable, Suspended};
        check(Done, 999, "", "ns", "m", true);
        check(Failed, 0, "", "ns", "m", true);
        check(Cancelled, 999, "", "ns", "m", true);
        // Ended at or after the cutoff: kept.
        check(Done, 1_000, "", "ns", "m", false);
        // Not terminal, however old: kept.
        check(Runnable, 0, "", "ns", "m", false);
        check(AwaitingSignal, 0, "", "ns", "m", false);
        check(Suspended, 0, "", "ns", "m", false);
        // Still referred to: a live parent may read it, its children point at it, or its
        // dead letters name it.
        check(Done, 0, "p", "ns", "m", false);
        check(Done, 0, "c", "ns", "m", false);
        check(Cancelled, 0, "d", "ns", "m", false);
        // Out of scope: another namespace, or a machine with a retention of its own.
        check(Done, 0, "", "other", "m", false);
        check(Done, 0, "", "ns", "kept", false);
    }

    #[test]
    fn a_machine_list_narrows_the_scope() {
        let p = PruneParams { machines: vec!["a".into()], ..params() };
        let row = |id, machine: &str| PruneCandidate {
            id: InstanceId(id),
            namespace: "ns".into(),
            machine: machine.into(),
            status: Status::Done,
            updated_at: Timestamp::from_millis(0),
            parent_live: false,
            has_children: false,
            has_dead_letters: false,
        };
        assert_eq!(
            page(&p, &[row(1, "a"), row(2, "b"), row(3, "a")]),
            [InstanceId(1), InstanceId(3)]
        );
    }
}
