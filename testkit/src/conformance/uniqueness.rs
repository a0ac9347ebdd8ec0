//! Contracts for uniqueness: the key is occupied only while the status is
//! in scope, within a batch too, and frees when the occupant leaves its scope.

use super::support::{
    LEASE, at, await_signal, claim, claim_id, claim_params, commit, commit_ok, done, expect_kind,
    get, ids, insert, insert_one, new_in, next, step,
};
use keel_core::ids::StatusSet;
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, CommitParams, InsertOutcome, LeaseReapParams, LeaseReleaseParams,
};
use keel_core::{ErrorKind, Status, StepCommit};
use std::time::Duration;

/// A key conflicts while its occupant's status is in scope (runnable, executing) and not
/// once it is out of scope (awaiting a signal); empty scopes and absent keys never do.
pub async fn uniqueness_in_and_out_of_scope<S: Store>(s: &S) {
    let ns = "unique_scope";
    let scope = StatusSet::of(&[Status::Runnable, Status::Executing]);
    let a = insert_one(s, new_in(ns).unique("u", scope), at(0)).await;
    let dup = insert(s, vec![new_in(ns).unique("u", scope)], at(1)).await;
    assert_eq!(dup, vec![InsertOutcome::Existing(a)], "runnable occupant");
    let claimed = claim_id(s, ns, a, at(10)).await;
    let dup = insert(s, vec![new_in(ns).unique("u", scope)], at(11)).await;
    assert_eq!(dup, vec![InsertOutcome::Existing(a)], "executing occupant");
    step(s, &claimed, await_signal("never", 1), at(20)).await;
    let out = insert(s, vec![new_in(ns).unique("u", scope)], at(21)).await;
    assert!(
        matches!(out[0], InsertOutcome::Inserted(id) if id != a),
        "awaiting_signal is out of scope: {out:?}"
    );
    let free = insert(
        s,
        vec![new_in(ns).unique("e", StatusSet::EMPTY), new_in(ns).unique("e", StatusSet::EMPTY)],
        at(22),
    )
    .await;
    assert!(
        free.iter().all(|o| matches!(o, InsertOutcome::Inserted(_))),
        "an empty scope conflicted"
    );
}

/// Within one batch, a later item conflicts with an earlier one; ids increase in order.
pub async fn uniqueness_within_one_batch<S: Store>(s: &S) {
    let ns = "unique_batch";
    let live = StatusSet::LIVE;
    let out = insert(
        s,
        vec![
            new_in(ns).unique("k1", live),
            new_in(ns).unique("k1", live),
            new_in(ns).unique("k2", live),
            new_in(ns),
            new_in(ns),
        ],
        at(0),
    )
    .await;
    let InsertOutcome::Inserted(first) = out[0] else {
        panic!("first item should be new: {out:?}")
    };
    assert_eq!(out[1], InsertOutcome::Existing(first));
    let new_ids: Vec<_> = [0, 2, 3, 4].iter().map(|i| out[*i]).collect();
    assert!(new_ids.iter().all(|o| matches!(o, InsertOutcome::Inserted(_))), "{out:?}");
    assert!(
        new_ids.windows(2).all(|w| w[0].id() < w[1].id()),
        "ids increase in batch order: {out:?}"
    );
    assert!(first.0 >= 1, "ids start at 1");
}

/// When the occupant leaves its scope (done, cancelled) the key can be taken again.
pub async fn uniqueness_reinsert_after_key_leaves_scope<S: Store>(s: &S) {
    let ns = "unique_reinsert";
    let a = insert_one(s, new_in(ns).unique("once", StatusSet::LIVE), at(0)).await;
    let claimed = claim_id(s, ns, a, at(10)).await;
    step(s, &claimed, done(), at(20)).await;
    let b = insert(s, vec![new_in(ns).unique("once", StatusSet::LIVE)], at(21)).await;
    let InsertOutcome::Inserted(b) = b[0] else { panic!("a done occupant kept its key: {b:?}") };
    assert_eq!(
        insert(s, vec![new_in(ns).unique("once", StatusSet::LIVE)], at(22)).await,
        vec![InsertOutcome::Existing(b)]
    );
    let cancel = CancelParams {
        id: b,
        reason: "operator".into(),
        cascade: false,
        now: at(30),
        only_in: None,
    };
    s.instance_cancel(cancel).await.expect("cancel");
    let c = insert(s, vec![new_in(ns).unique("once", StatusSet::LIVE)], at(31)).await;
    assert!(
        matches!(c[0], InsertOutcome::Inserted(id) if id != b),
        "a cancelled occupant kept its key: {c:?}"
    );
    let ns = "unique_reinsert_all";
    let forever = insert_one(s, new_in(ns).unique("all", StatusSet::ALL), at(40)).await;
    let claimed = claim_id(s, ns, forever, at(50)).await;
    step(s, &claimed, done(), at(60)).await;
    assert_eq!(
        insert(s, vec![new_in(ns).unique("all", StatusSet::ALL)], at(61)).await,
        vec![InsertOutcome::Existing(forever)],
        "scope ALL never frees"
    );
}

/// A lease the reaper takes back, or a worker gives back, returns its instance to
/// runnable even when another instance took its key meanwhile (a scope that leaves out
/// `executing`): the instance that holds the key keeps it, the returned one runs without
/// it, and the other leases of the same call come back too.
pub async fn uniqueness_reap_and_release_into_a_held_key_keep_the_holder<S: Store>(s: &S) {
    let ns = "unique_reap";
    let scope = StatusSet::of(&[Status::Runnable]);
    let first = insert_one(s, new_in(ns).unique("r", scope), at(0)).await;
    let second = insert_one(s, new_in(ns).unique("g", scope), at(1)).await;
    let plain = insert_one(s, new_in(ns), at(2)).await;
    let claims = claim(s, claim_params(ns, 3, at(10))).await;
    assert_eq!(ids(&claims), vec![first, second, plain]);
    let mut holders = Vec::new();
    for key in ["r", "g"] {
        match insert(s, vec![new_in(ns).unique(key, scope)], at(11)).await[..] {
            [InsertOutcome::Inserted(id)] => holders.push(id),
            ref other => panic!("executing is out of scope, so `{key}` is free: {other:?}"),
        }
    }
    let leases = vec![(second, claims[1].token())];
    let released = s.lease_release(LeaseReleaseParams { leases, now: at(12) }).await;
    assert_eq!(released.expect("a release into a held key"), vec![true]);
    let expired = at(10).plus(LEASE).plus(Duration::from_millis(1));
    let reap = LeaseReapParams { owner: None, limit: 100, now: expired };
    let mut reaped = s.lease_reap(reap).await.expect("a reap into a held key");
    reaped.sort_unstable();
    let mut expected = vec![first, plain];
    expected.sort_unstable();
    assert_eq!(reaped, expected, "every expired lease comes back");
    for id in [first, second] {
        assert_eq!(get(s, id).await.instance.status, Status::Runnable, "{id} returned");
    }
    for (key, holder) in ["r", "g"].into_iter().zip(holders) {
        let again = insert(s, vec![new_in(ns).unique(key, scope)], expired).await;
        assert_eq!(again, vec![InsertOutcome::Existing(holder)], "the holder keeps `{key}`");
    }
}

/// A claim takes a key whose scope leaves out `executing` out of scope, so another instance
/// may take it meanwhile. A commit that would bring the key back while another instance
/// holds it is refused with `Conflict` and changes nothing; a commit landing out of scope
/// is accepted. Within one batch, the first item that brings a free key back takes it, and
/// a later item bringing the same key back is refused.
pub async fn uniqueness_commit_bringing_a_held_key_back_conflicts<S: Store>(s: &S) {
    let ns = "unique_commit";
    let scope = StatusSet::of(&[Status::Runnable]);
    let holder = insert_one(s, new_in(ns).unique("k", scope), at(0)).await;
    let claimed = claim_id(s, ns, holder, at(10)).await;
    let taker = insert(s, vec![new_in(ns).unique("k", scope)], at(11)).await;
    assert!(
        matches!(taker[0], InsertOutcome::Inserted(id) if id != holder),
        "executing is out of scope"
    );
    let before = get(s, holder).await;
    let back = StepCommit::new(holder, claimed.token(), next("second", 1));
    expect_kind(commit(s, back, at(20)).await, ErrorKind::Conflict, "key held by another");
    assert_eq!(get(s, holder).await, before, "the refused commit changed the instance");
    let out = commit_ok(s, StepCommit::new(holder, claimed.token(), done()), at(21)).await;
    assert_eq!(out.status, Status::Done, "a commit out of scope is accepted");

    let ns = "unique_commit_batch";
    let early = insert_one(s, new_in(ns).unique("j", scope), at(30)).await;
    let first = claim_id(s, ns, early, at(31)).await;
    let late = insert_one(s, new_in(ns).unique("j", scope), at(32)).await;
    let second = claim_id(s, ns, late, at(33)).await;
    let commits = vec![
        StepCommit::new(early, first.token(), next("second", 1)),
        StepCommit::new(late, second.token(), next("second", 1)),
    ];
    let results = s.step_commit(CommitParams { commits, now: at(40) }).await.expect("step_commit");
    assert_eq!(results[0].as_ref().map(|r| r.status), Ok(Status::Runnable));
    assert_eq!(results[1].as_ref().map_err(|e| e.kind), Err(ErrorKind::Conflict));
    assert_eq!(get(s, late).await.instance.status, Status::Executing, "the refused item changed");
}

/// A unique key scoped to `executing` works as a mutex: rows waiting for a running holder's
/// key are passed over, however many of them stand first in claim order, and a row behind
/// them is claimed.
pub async fn claim_passes_over_rows_whose_unique_key_a_running_row_holds<S: Store>(s: &S) {
    let ns = "unique_held_mutex";
    let running = StatusSet::of(&[Status::Executing]);
    let holder = insert_one(s, new_in(ns).unique("account-7", running), at(0)).await;
    claim_id(s, ns, holder, at(1)).await;
    for i in 0..12 {
        insert_one(s, new_in(ns).unique("account-7", running), at(2 + i)).await;
    }
    let free = insert_one(s, new_in(ns), at(20)).await;
    let claimed = claim(s, claim_params(ns, 1, at(30))).await;
    assert_eq!(ids(&claimed), vec![free], "the row behind the waiting ones was not claimed");
    assert!(
        claim(s, claim_params(ns, 10, at(31))).await.is_empty(),
        "a row waiting for a held key was claimed"
    );
}
