//! Leases: the heartbeat, the reaper and the graceful release.
//!
//! A lease is "held" by `(id, token)` while the row is executing under that fencing token.
//! A heartbeat also needs the same owner; a release does not (the worker that releases
//! holds the token, which only its claim handed out).

use super::RowWrite;
use crate::ids::{FencingToken, InstanceId, Status};
use crate::instance::Instance;
use crate::outcome;
use crate::ports::store::{LeaseExtendParams, LeaseReapParams, LeaseReleaseParams};
use crate::time::Timestamp;
use std::collections::HashMap;
use std::time::Duration;

/// The writes of a heartbeat or a release: per requested lease whether it was still held,
/// and the rows to write (one per lease held, in request order).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LeasePlan {
    /// Per requested lease, in order.
    pub held: Vec<bool>,
    /// The rows to write.
    pub rows: Vec<Instance>,
}

/// Whether `row` is the live claim `token`.
pub fn held(row: &Instance, token: FencingToken) -> bool {
    row.status == Status::Executing && row.fencing_token == token
}

/// Applies `change` to each requested lease `accept` finds held, in order, each against the
/// row as earlier items left it (a lease named twice is held once).
fn plan_leases(
    leases: &[(InstanceId, FencingToken)],
    rows: impl IntoIterator<Item = Instance>,
    accept: impl Fn(&Instance, FencingToken) -> bool,
    change: impl Fn(&Instance) -> Instance,
) -> LeasePlan {
    let mut rows: HashMap<InstanceId, Instance> = rows.into_iter().map(|r| (r.id, r)).collect();
    let mut plan = LeasePlan::default();
    for (id, token) in leases {
        match rows.get_mut(id) {
            Some(row) if accept(row, *token) => {
                *row = change(row);
                plan.rows.push(row.clone());
                plan.held.push(true);
            }
            _ => plan.held.push(false),
        }
    }
    plan
}

/// A heartbeat: each lease still held by `p.worker` runs until `now + lease`. `rows` are the
/// rows of the named instances a store read (missing ones left out, each at most once).
pub fn extend(p: &LeaseExtendParams, rows: impl IntoIterator<Item = Instance>) -> LeasePlan {
    let accept =
        |row: &Instance, token| held(row, token) && row.lease_owner == Some(p.worker.clone());
    plan_leases(&p.leases, rows, accept, |row| {
        let mut next = row.clone();
        next.lease_expires_at = Some(p.now.plus(p.lease));
        next.updated_at = p.now;
        next
    })
}

/// A graceful release: each lease still held becomes runnable now without counting an
/// attempt ([`outcome::release`]).
pub fn release(p: &LeaseReleaseParams, rows: impl IntoIterator<Item = Instance>) -> LeasePlan {
    plan_leases(&p.leases, rows, held, |row| outcome::release(row, p.now))
}

/// The reaper: among `executing` (rows a store read, possibly more than qualify), the rows
/// whose lease expired — or, with `p.owner`, every row that owner holds, expired or not
/// (a restarted worker reclaiming what it held before a crash) — oldest lease first, at
/// most `p.limit`, back to runnable with attempt + 1 ([`outcome::reap`]), each recording
/// why.
pub fn reap(p: &LeaseReapParams, executing: impl IntoIterator<Item = Instance>) -> Vec<RowWrite> {
    let mut due: Vec<Instance> = executing
        .into_iter()
        .filter(|row| match &p.owner {
            Some(owner) => {
                row.status == Status::Executing && row.lease_owner.as_ref() == Some(owner)
            }
            None => outcome::lease_expired(row, p.now),
        })
        .collect();
    due.sort_by_key(|row| (row.lease_expires_at, row.id));
    due.truncate(p.limit);
    due.into_iter()
        .map(|row| RowWrite {
            row: outcome::reap(&row, p.now),
            attempt: row.attempt,
            history: vec![outcome::reap_history(&row)],
        })
        .collect()
}

/// When a reaper may return expired leases, given what it saw of the store.
///
/// While the store cannot be reached no worker can renew a lease or record a result, so
/// leases run out through no fault of their steps or of the workers holding them. Were
/// the first reap after the store came back to take them, every step under way during
/// an outage would count an attempt, and a step that lived through a few outages in a
/// row would look as if it kept killing its worker. So a reaper whose store call failed
/// as unavailable holds off: it reaps again only one lease period after the store next
/// answered it, which leaves every live worker time to renew its leases and give back
/// the results it could not commit. Only the leases of workers that did not come back
/// are then reaped.
///
/// ```
/// use keel_core::Timestamp;
/// use keel_core::plan::lease::ReapHold;
/// use std::time::Duration;
///
/// let lease = Duration::from_secs(30);
/// let mut hold = ReapHold::default();
/// assert!(hold.may_reap(Timestamp(0)));
/// hold.unreachable(); // a reap failed: the store is down
/// assert!(!hold.may_reap(Timestamp(60_000)));
/// assert!(hold.probing());
/// hold.answered(Timestamp(60_000), lease); // the store is back
/// assert!(!hold.may_reap(Timestamp(89_999)));
/// assert!(hold.may_reap(Timestamp(90_000)));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReapHold {
    state: HoldState,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum HoldState {
    /// The store answered the last call: reap as usual.
    #[default]
    Open,
    /// A call failed as unavailable, and none has been answered since.
    Down,
    /// The store answered again; leases get until then to be renewed.
    Until(Timestamp),
}

impl ReapHold {
    /// A store call failed as unavailable: no reaping until the store answers again and
    /// a lease period has passed.
    pub fn unreachable(&mut self) {
        self.state = HoldState::Down;
    }

    /// The store answered a call at `now` (with a result or a refusal): after an outage
    /// the hold ends one `lease` later.
    pub fn answered(&mut self, now: Timestamp, lease: Duration) {
        if self.state == HoldState::Down {
            self.state = HoldState::Until(now.plus(lease));
        }
    }

    /// Whether the store has not answered since it failed: the reaper asks it something
    /// that takes no lease (a worker registry beat) to learn when it is back.
    pub fn probing(&self) -> bool {
        self.state == HoldState::Down
    }

    /// Whether a reap may run at `now`.
    pub fn may_reap(&mut self, now: Timestamp) -> bool {
        match self.state {
            HoldState::Open => true,
            HoldState::Until(until) if now >= until => {
                self.state = HoldState::Open;
                true
            }
            HoldState::Down | HoldState::Until(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{MachineRef, WorkerId};
    use crate::instance::NewInstance;
    use crate::time::Timestamp;
    use std::time::Duration;

    const NOW: Timestamp = Timestamp(1_000);

    /// Row `id`, executing under token 1 for `owner` until `expires`.
    fn row(id: i64, owner: &str, expires: i64) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row = Instance::from_new(InstanceId(id), &new, None, Timestamp(0));
        row.status = Status::Executing;
        row.fencing_token = FencingToken(1);
        row.lease_owner = Some(WorkerId(owner.into()));
        row.lease_expires_at = Some(Timestamp(expires));
        row.attempt = 2;
        row
    }

    fn rows() -> [Instance; 3] {
        let mut done = row(3, "w", 2_000);
        done.status = Status::Done;
        [row(1, "w", 2_000), row(2, "v", 2_000), done]
    }

    fn lease(id: i64, token: i64) -> (InstanceId, FencingToken) {
        (InstanceId(id), FencingToken(token))
    }

    #[test]
    fn a_heartbeat_extends_only_leases_its_worker_still_holds() {
        let p = LeaseExtendParams {
            worker: WorkerId("w".into()),
            leases: vec![lease(1, 1), lease(1, 2), lease(2, 1), lease(3, 1), lease(9, 1)],
            lease: Duration::from_secs(30),
            now: NOW,
        };
        let plan = extend(&p, rows());
        assert_eq!(plan.held, [true, false, false, false, false]);
        assert_eq!(plan.rows.len(), 1);
        assert_eq!(plan.rows[0].lease_expires_at, Some(Timestamp(31_000)));
        assert_eq!(plan.rows[0].status, Status::Executing);
    }

    #[test]
    fn a_release_returns_each_held_lease_once_without_an_attempt() {
        let p =
            LeaseReleaseParams { leases: vec![lease(1, 1), lease(1, 1), lease(2, 1)], now: NOW };
        let plan = release(&p, rows());
        assert_eq!(plan.held, [true, false, true]);
        for r in &plan.rows {
            assert_eq!((r.status, r.attempt, r.lease_owner.as_ref()), (Status::Runnable, 2, None));
        }
    }

    #[test]
    fn the_reaper_takes_expired_leases_oldest_first_or_everything_an_owner_held() {
        let executing =
            || [row(1, "w", 900), row(2, "v", 500), row(4, "w", 5_000), row(5, "v", 800)];
        let ids = |writes: Vec<RowWrite>| writes.iter().map(|w| w.row.id.0).collect::<Vec<_>>();
        let p = |owner: Option<&str>, limit| LeaseReapParams {
            owner: owner.map(|o| WorkerId(o.into())),
            limit,
            now: NOW,
        };
        assert_eq!(ids(reap(&p(None, 10), executing())), [2, 5, 1]);
        assert_eq!(ids(reap(&p(None, 2), executing())), [2, 5]);
        assert_eq!(ids(reap(&p(Some("w"), 10), executing())), [1, 4]);
        let w = reap(&p(None, 1), executing()).remove(0);
        assert_eq!((w.row.status, w.row.attempt, w.attempt), (Status::Runnable, 3, 2));
        assert_eq!(w.history.len(), 1);
    }

    #[test]
    fn a_reaper_that_saw_the_store_down_waits_a_lease_after_it_answers_again() {
        let lease = Duration::from_secs(30);
        let mut hold = ReapHold::default();
        // Answers while open change nothing.
        hold.answered(NOW, lease);
        assert!(hold.may_reap(NOW) && !hold.probing());
        hold.unreachable();
        // Down: no reap however long it stays down, and more failures change nothing.
        assert!(!hold.may_reap(NOW.plus(Duration::from_secs(3_600))));
        hold.unreachable();
        assert!(hold.probing());
        hold.answered(Timestamp(5_000), lease);
        assert!(!hold.probing());
        // Later answers do not push the end of the hold back.
        hold.answered(Timestamp(20_000), lease);
        assert!(!hold.may_reap(Timestamp(34_999)));
        assert!(hold.may_reap(Timestamp(35_000)));
        // Open again: reaps go on, and a new failure holds again.
        assert!(hold.may_reap(Timestamp(35_001)));
        hold.unreachable();
        assert!(!hold.may_reap(Timestamp(36_000)));
    }
}
