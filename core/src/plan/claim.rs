//! Claiming: which candidates a claim takes, and the row each becomes.
//!
//! A store offers candidates in claim order (priority, then `eligible_at`, then id). A
//! candidate is taken when it is runnable and due, passes the claim's namespace, queue
//! and machine filters, its queue is not paused, no other instance with its concurrency
//! key is executing (neither before the claim nor taken earlier in it), and no other
//! instance holds its unique key in the executing scope. At most `limit` are taken. A
//! taken row that holds a stored value no reader accepts (or whose inbox does) is not
//! handed out: it is suspended and dead-lettered alone ([`undecodable`]), and its
//! neighbours are claimed as usual.

use crate::instance::{Instance, Signal, undecodable_error};
use crate::outcome::{self, Applied};
use crate::ports::store::ClaimParams;
use crate::time::Timestamp;
use std::collections::HashSet;

/// What a store read about one candidate, beyond its row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CandidateRead {
    /// The candidate's queue is paused.
    pub queue_paused: bool,
    /// Another instance with the candidate's concurrency key is executing.
    pub key_executing: bool,
}

/// The decisions of one claim call, candidate by candidate.
#[derive(Debug)]
pub struct ClaimPlanner<'a> {
    params: &'a ClaimParams,
    /// Concurrency keys taken earlier in this claim.
    keys: HashSet<String>,
    taken: usize,
}

impl<'a> ClaimPlanner<'a> {
    /// A planner for one claim call.
    pub fn new(params: &'a ClaimParams) -> Self {
        ClaimPlanner { params, keys: HashSet::new(), taken: 0 }
    }

    /// Whether the claim has taken as many rows as it asked for.
    pub fn is_full(&self) -> bool {
        self.taken >= self.params.limit
    }

    /// The row `row` becomes when claimed, or `None` when it may not be claimed. The store
    /// then looks up who holds the returned row's unique guard (its unique key in the
    /// executing scope) and calls [`take`](Self::take).
    pub fn offer(&self, row: &Instance, read: CandidateRead) -> Option<Instance> {
        let p = self.params;
        let admitted = !self.is_full()
            && outcome::claimable(row, p.now)
            && (p.namespaces.is_empty() || p.namespaces.contains(&row.namespace))
            && (p.queues.is_empty() || p.queues.contains(&row.queue))
            && (p.machines.is_empty() || p.machines.contains(&row.machine))
            && !read.queue_paused
            && !read.key_executing
            && row.concurrency_key.as_ref().is_none_or(|k| !self.keys.contains(k));
        admitted.then(|| outcome::claim(row, &p.worker, p.lease, p.now))
    }

    /// Whether the offered row `next` is taken, given whether another instance holds its
    /// unique guard. A taken row counts towards the limit and holds its concurrency key
    /// for the rest of the claim; the store writes it.
    pub fn take(&mut self, next: &Instance, key_occupied: bool) -> bool {
        if key_occupied {
            return false;
        }
        if let Some(k) = &next.concurrency_key {
            self.keys.insert(k.clone());
        }
        self.taken += 1;
        true
    }
}

/// Why a taken row cannot be handed out: a stored value of the row or of the first inbox
/// signals it carries that no reader accepts.
pub fn damage(row: &Instance, inbox: &[Signal]) -> Option<String> {
    row.damage().or_else(|| {
        inbox.iter().find_map(|s| undecodable_error(&s.payload).map(|e| format!("inbox {e}")))
    })
}

/// The writes for a taken row that cannot be read: suspended, with its history and a dead
/// letter, so that it fails alone.
pub fn undecodable(row: &Instance, error: &str, now: Timestamp) -> Applied {
    outcome::undecodable_row(row, error, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{InstanceId, MachineRef, SignalId, Status, WorkerId};
    use crate::instance::NewInstance;
    use serde_json::json;
    use std::time::Duration;

    fn params(limit: usize) -> ClaimParams {
        ClaimParams {
            worker: WorkerId("w".into()),
            namespaces: vec![],
            queues: vec!["default".into()],
            machines: vec![],
            limit,
            lease: Duration::from_secs(30),
            now: Timestamp(100),
        }
    }

    fn row(id: i64, key: Option<&str>) -> Instance {
        let mut new = NewInstance::new(MachineRef::new("m", 1), "start");
        new.concurrency_key = key.map(String::from);
        Instance::from_new(InstanceId(id), &new, None, Timestamp(0))
    }

    #[test]
    fn one_row_per_concurrency_key_up_to_the_limit() {
        let p = params(2);
        let mut planner = ClaimPlanner::new(&p);
        let first = planner.offer(&row(1, Some("k")), CandidateRead::default()).unwrap();
        assert_eq!((first.status, first.fencing_token.0), (Status::Executing, 1));
        assert!(planner.take(&first, false));
        assert_eq!(planner.offer(&row(2, Some("k")), CandidateRead::default()), None);
        let other = planner.offer(&row(3, None), CandidateRead::default()).unwrap();
        assert!(!planner.take(&other, true), "an occupied unique key is skipped");
        let other = planner.offer(&row(4, None), CandidateRead::default()).unwrap();
        assert!(planner.take(&other, false));
        assert!(planner.is_full());
        assert_eq!(planner.offer(&row(5, None), CandidateRead::default()), None);
    }

    #[test]
    fn filters_pauses_executing_keys_and_due_time_refuse_a_candidate() {
        let p = params(5);
        let planner = ClaimPlanner::new(&p);
        let paused = CandidateRead { queue_paused: true, key_executing: false };
        let busy = CandidateRead { queue_paused: false, key_executing: true };
        assert_eq!(planner.offer(&row(1, None), paused), None);
        assert_eq!(planner.offer(&row(1, Some("k")), busy), None);
        let mut elsewhere = row(1, None);
        elsewhere.queue = "other".into();
        assert_eq!(planner.offer(&elsewhere, CandidateRead::default()), None);
        let mut later = row(1, None);
        later.eligible_at = Timestamp(101);
        assert_eq!(planner.offer(&later, CandidateRead::default()), None);
    }

    #[test]
    fn an_undecodable_inbox_payload_is_damage() {
        let signal = |payload| Signal {
            id: SignalId(1),
            target: InstanceId(1),
            name: "go".into(),
            payload,
            dedup_key: None,
            inserted_at: Timestamp(0),
        };
        assert_eq!(damage(&row(1, None), &[signal(json!({ "a": 1 }))]), None);
        let bad = crate::instance::undecodable("payload", "bad");
        assert_eq!(damage(&row(1, None), &[signal(bad)]).as_deref(), Some("inbox payload: bad"));
    }
}
