//! An instance's history read a page at a time, and trimmed to its newest entries.
//!
//! **Paging.** A page is the entries below a cursor, newest first. A store reads one entry
//! more than the page ([`HistoryPageParams::read_limit`]); [`page`] keeps `limit` of them
//! and, when the extra one exists, gives the last kept entry's sequence number as the
//! cursor to the next, older page. So a caller never gets an empty last page, and a page
//! that ends exactly at the oldest entry says so.
//!
//! **Trimming.** A retention that keeps `keep` entries per instance deletes the others,
//! oldest first. The read set is a page of instances in id order, each with how many of
//! its entries lie beyond the newest `keep` (counted up to
//! [`HistoryTrimParams::count_cap`]) and the sequence number of the newest of those. The
//! page's deletions are bounded by its `limit`: instances are trimmed in id order until
//! the budget runs out, and the instance it ran out in is where the next page starts.
//!
//! A store deletes "the oldest `count` entries numbered at most `through`", never "all
//! but the newest `keep`": entries appended meanwhile are newer, so they never move the
//! bound, and two trimmers running the same plan delete the same rows once.

use crate::ids::InstanceId;
use crate::instance::HistoryRecord;
use crate::ports::store::{HistoryPage, HistoryPageParams, HistoryTrimParams};

/// The page of `read` (the entries below the cursor, newest first, at most
/// [`HistoryPageParams::read_limit`] of them) and the cursor to the next page.
pub fn page(p: &HistoryPageParams, mut read: Vec<HistoryRecord>) -> HistoryPage {
    let more = read.len() > p.limit;
    read.truncate(p.limit);
    let next = if more { read.last().map(|r| r.seq) } else { None };
    HistoryPage { entries: read, next }
}

/// What the trim planner needs of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrimCandidate {
    /// The instance.
    pub id: InstanceId,
    /// Its namespace.
    pub namespace: String,
    /// Its machine name.
    pub machine: String,
    /// How many of its entries are older than its newest `keep`, counted up to
    /// [`HistoryTrimParams::count_cap`].
    pub excess: u64,
    /// The sequence number of the newest of those (`None` when there are none).
    pub through: Option<i64>,
}

/// Delete the oldest `count` entries of `instance` numbered at most `through`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trim {
    /// The instance.
    pub instance: InstanceId,
    /// The newest entry that may go.
    pub through: i64,
    /// How many go, oldest first.
    pub count: u64,
}

/// A trim page's decision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrimPlan {
    /// The deletions, in id order; their counts add up to at most the page's `limit`.
    pub trims: Vec<Trim>,
    /// The next page's `after` (`None` when the page read nothing).
    pub last: Option<InstanceId>,
}

/// Whether an instance is in the page's scope (namespace, machines, exceptions).
pub fn in_scope(p: &HistoryTrimParams, namespace: &str, machine: &str) -> bool {
    p.namespace.as_deref().is_none_or(|ns| ns == namespace)
        && (p.machines.is_empty() || p.machines.iter().any(|m| m == machine))
        && !p.except.iter().any(|m| m == machine)
}

/// The deletions of one page of `read` (its instances in id order).
pub fn trim(p: &HistoryTrimParams, read: &[TrimCandidate]) -> TrimPlan {
    let mut plan = TrimPlan { trims: Vec::new(), last: read.last().map(|c| c.id) };
    let mut budget = p.limit as u64;
    for c in read {
        let Some(through) = c.through else { continue };
        if c.excess == 0 || !in_scope(p, &c.namespace, &c.machine) {
            continue;
        }
        let count = c.excess.min(budget);
        if count > 0 {
            plan.trims.push(Trim { instance: c.id, through, count });
            budget -= count;
        }
        if count < c.excess {
            // The budget ran out inside this instance: the next page starts with it again.
            plan.last = Some(InstanceId(c.id.0.saturating_sub(1)));
            break;
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Revision;
    use crate::instance::HistoryEntry;
    use crate::time::Timestamp;

    fn record(seq: i64) -> HistoryRecord {
        HistoryRecord {
            instance: InstanceId(1),
            seq,
            at: Timestamp::from_millis(seq),
            revision: Revision(seq),
            attempt: 1,
            entry: HistoryEntry::new("STEP_NEXT", serde_json::json!({})),
        }
    }

    #[test]
    fn a_page_gives_a_cursor_only_when_older_entries_exist() {
        let p = HistoryPageParams { instance: InstanceId(1), before: None, limit: 2 };
        assert_eq!(p.read_limit(), 3);
        let full = page(&p, vec![record(9), record(7), record(4)]);
        assert_eq!(full.entries.iter().map(|r| r.seq).collect::<Vec<_>>(), [9, 7]);
        assert_eq!(full.next, Some(7), "the last kept entry is the cursor");
        let exact = page(&p, vec![record(9), record(7)]);
        assert_eq!((exact.entries.len(), exact.next), (2, None), "nothing older: no cursor");
        assert_eq!(page(&p, Vec::new()), HistoryPage { entries: Vec::new(), next: None });
    }

    #[test]
    fn page_bounds_are_checked() {
        let p = |before, limit| HistoryPageParams { instance: InstanceId(1), before, limit };
        assert!(p(None, 1).validate().is_ok());
        assert!(p(Some(5), crate::limits::HISTORY_PAGE_MAX).validate().is_ok());
        let err = p(None, crate::limits::HISTORY_PAGE_MAX + 1).validate().unwrap_err();
        assert!(err.message.starts_with("limit: 1001 is out of range; give 1 to 1000"), "{err}");
        assert!(p(None, 0).validate().unwrap_err().message.starts_with("limit:"));
        assert!(p(Some(0), 5).validate().unwrap_err().message.starts_with("before:"));
    }

    fn params(limit: usize) -> HistoryTrimParams {
        HistoryTrimParams {
            namespace: Some("ns".into()),
            machines: Vec::new(),
            except: vec!["kept".into()],
            keep: 3,
            after: None,
            limit,
        }
    }

    fn candidate(id: i64, machine: &str, excess: u64) -> TrimCandidate {
        TrimCandidate {
            id: InstanceId(id),
            namespace: "ns".into(),
            machine: machine.into(),
            excess,
            through: (excess > 0).then_some(id * 100),
        }
    }

    #[test]
    fn trims_in_id_order_within_the_budget() {
        let read = [candidate(1, "m", 2), candidate(2, "m", 0), candidate(3, "m", 3)];
        let plan = trim(&params(10), &read);
        assert_eq!(
            plan.trims,
            [
                Trim { instance: InstanceId(1), through: 100, count: 2 },
                Trim { instance: InstanceId(3), through: 300, count: 3 },
            ]
        );
        assert_eq!(plan.last, Some(InstanceId(3)), "the whole page was handled");
    }

    #[test]
    fn a_budget_spent_inside_an_instance_starts_the_next_page_with_it() {
        let read = [candidate(4, "m", 3), candidate(7, "m", 5), candidate(9, "m", 1)];
        let plan = trim(&params(5), &read);
        assert_eq!(
            plan.trims,
            [
                Trim { instance: InstanceId(4), through: 400, count: 3 },
                Trim { instance: InstanceId(7), through: 700, count: 2 },
            ]
        );
        assert_eq!(plan.last, Some(InstanceId(6)), "instance 7 is read again");
        // An instance with more than a whole page to lose: one page's worth, then again.
        let plan = trim(&params(2), &[candidate(5, "m", 3)]);
        assert_eq!(plan.trims, [Trim { instance: InstanceId(5), through: 500, count: 2 }]);
        assert_eq!(plan.last, Some(InstanceId(4)));
        // Budget exactly spent on an instance's whole excess: the page is complete.
        let plan = trim(&params(3), &[candidate(5, "m", 3), candidate(6, "m", 0)]);
        assert_eq!(plan.last, Some(InstanceId(6)));
    }

    #[test]
    fn out_of_scope_instances_are_left_whole() {
        let mut other_ns = candidate(2, "m", 4);
        other_ns.namespace = "other".into();
        let read = [candidate(1, "kept", 4), other_ns, candidate(3, "m", 1)];
        let plan = trim(&params(10), &read);
        assert_eq!(plan.trims, [Trim { instance: InstanceId(3), through: 300, count: 1 }]);
        let only_a = HistoryTrimParams { machines: vec!["a".into()], ..params(10) };
        let plan = trim(&only_a, &[candidate(1, "a", 1), candidate(2, "b", 1)]);
        assert_eq!(plan.trims.len(), 1);
        assert_eq!(trim(&params(10), &[]), TrimPlan::default());
    }

    #[test]
    fn trim_bounds_are_checked() {
        assert!(params(1).validate().is_ok());
        for (p, field) in [
            (params(0), "trim.limit"),
            (params(crate::limits::PRUNE_BATCH_MAX + 1), "trim.limit"),
            (HistoryTrimParams { keep: 0, ..params(5) }, "trim.keep"),
            (
                HistoryTrimParams { keep: crate::limits::HISTORY_KEEP_MAX + 1, ..params(5) },
                "trim.keep",
            ),
        ] {
            let err = p.validate().unwrap_err();
            assert!(err.message.starts_with(field), "{err}");
        }
    }
}
