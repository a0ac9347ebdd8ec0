//! Contracts for leases: expiry and the reaper, owner reclaim, graceful release, and
//! heartbeats under fencing.

use super::support::{
    LEASE, assert_history_tail, assert_row, at, claim, claim_id, claim_params, expect_invalid, get,
    insert, insert_one, new_in, reap, row, worker,
};
use keel_core::Status;
use keel_core::outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{LeaseExtendParams, LeaseReapParams, LeaseReleaseParams};
use std::time::Duration;

/// An expired lease is reaped: runnable now, attempt + 1, `LEASE_EXPIRED` in history,
/// and the next claim gets a larger token.
pub async fn lease_expiry_reap_increments_attempt<S: Store>(s: &S) {
    let ns = "lease_expiry";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    assert_eq!(claimed.instance.lease_expires_at, Some(at(10).plus(LEASE)));
    let now = at(10).plus(LEASE).plus(Duration::from_millis(1));
    assert_eq!(reap(s, now).await, vec![id]);
    let d = get(s, id).await;
    assert_row(&d.instance, &outcome::reap(&claimed.instance, now), "reaped row");
    assert_eq!((d.instance.status, d.instance.attempt), (Status::Runnable, 1));
    assert_history_tail(&d, &[outcome::reap_history(&claimed.instance)], 0, "reap");
    assert!(reap(s, now).await.is_empty(), "a row was reaped twice");
    let again = claim_id(s, ns, id, now).await;
    assert!(again.token() > claimed.token());
    assert_eq!(again.instance.attempt, 1);
}

/// A lease that has not run out (up to and including its expiry instant) is not reaped.
pub async fn reap_unexpired_lease_does_nothing<S: Store>(s: &S) {
    let ns = "reap_unexpired";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let before = get(s, id).await;
    assert!(reap(s, at(20)).await.is_empty());
    assert!(reap(s, at(10).plus(LEASE)).await.is_empty(), "reaped at the expiry instant");
    assert_eq!(get(s, id).await, before, "an unexpired reap changed the instance");
    assert_eq!(row(s, id).await.fencing_token, claimed.token());
}

/// A restarted worker reclaims every row it held, expired or not, and only those.
pub async fn reap_owner_reclaims_its_rows<S: Store>(s: &S) {
    let ns = "reap_owner";
    let outs = insert(s, vec![new_in(ns), new_in(ns), new_in(ns)], at(0)).await;
    let mine = claim(s, claim_params(ns, 2, at(10))).await;
    let mut theirs = claim_params(ns, 10, at(10));
    theirs.worker = worker("w2");
    let theirs = claim(s, theirs).await;
    assert_eq!(theirs.len(), 1);
    let params = LeaseReapParams { owner: Some(worker("w1")), limit: 100, now: at(20) };
    let mut reclaimed = s.lease_reap(params).await.expect("lease_reap");
    reclaimed.sort();
    assert_eq!(reclaimed, vec![outs[0].id(), outs[1].id()]);
    for c in &mine {
        let r = row(s, c.instance.id).await;
        assert_eq!((r.status, r.attempt, r.lease_owner.clone()), (Status::Runnable, 1, None));
    }
    assert_eq!(
        row(s, theirs[0].instance.id).await.status,
        Status::Executing,
        "another worker's row was reclaimed"
    );
}

/// A graceful release returns the row without counting an attempt; a second release, or
/// one with a stale token, reports `false`.
pub async fn release_keeps_attempt<S: Store>(s: &S) {
    let ns = "release_keeps";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let first = claim_id(s, ns, id, at(10)).await;
    reap(s, at(10).plus(LEASE).plus(Duration::from_millis(1))).await;
    let claimed = claim_id(s, ns, id, at(40_000)).await;
    assert_eq!(claimed.instance.attempt, 1);
    let leases = vec![(id, first.token()), (id, claimed.token())];
    let held =
        s.lease_release(LeaseReleaseParams { leases, now: at(40_010) }).await.expect("release");
    assert_eq!(held, vec![false, true]);
    assert_row(&row(s, id).await, &outcome::release(&claimed.instance, at(40_010)), "released row");
    let again = s
        .lease_release(LeaseReleaseParams { leases: vec![(id, claimed.token())], now: at(40_020) })
        .await;
    assert_eq!(again.expect("release"), vec![false]);
    assert_eq!(
        claim_id(s, ns, id, at(40_020)).await.instance.attempt,
        1,
        "release counted an attempt"
    );
}

/// A heartbeat extends a held lease so the reaper leaves it alone; it refuses another
/// worker and a stale token, without touching the live claim.
pub async fn heartbeat_extends_and_refuses_stale<S: Store>(s: &S) {
    let ns = "heartbeat";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let extend = |who: &str, token, now| LeaseExtendParams {
        worker: worker(who),
        leases: vec![(id, token)],
        lease: LEASE,
        now,
    };
    assert_eq!(
        s.lease_extend(extend("w1", claimed.token(), at(20_000))).await.expect("extend"),
        vec![true]
    );
    assert_eq!(row(s, id).await.lease_expires_at, Some(at(20_000).plus(LEASE)));
    assert!(reap(s, at(40_000)).await.is_empty(), "an extended lease was reaped");
    assert_eq!(
        s.lease_extend(extend("w2", claimed.token(), at(21_000))).await.expect("extend"),
        vec![false],
        "another worker extended"
    );
    assert!(reap(s, at(50_001)).await.contains(&id));
    let mut p = claim_params(ns, 1, at(50_001));
    p.worker = worker("w2");
    let current = claim(s, p).await.remove(0);
    let before = row(s, id).await;
    assert_eq!(
        s.lease_extend(extend("w1", claimed.token(), at(50_002))).await.expect("extend"),
        vec![false],
        "a stale token extended"
    );
    assert_eq!(row(s, id).await, before);
    assert_eq!(
        s.lease_extend(extend("w2", current.token(), at(50_003))).await.expect("extend"),
        vec![true]
    );
}

/// A heartbeat that names the same lease (instance and token) twice is refused as
/// `Invalid`, naming `leases` and the instance, and extends nothing. One that names an
/// instance under a stale token and under its live one (a worker that still keeps an
/// old claim of it) answers each lease as it stands: the live one held, the stale one not.
pub async fn heartbeat_naming_a_lease_twice_is_refused_naming_the_field<S: Store>(s: &S) {
    let ns = "heartbeat_twice";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let stale = claim_id(s, ns, id, at(10)).await.token();
    let released = LeaseReleaseParams { leases: vec![(id, stale)], now: at(20) };
    assert_eq!(s.lease_release(released).await.expect("release"), vec![true]);
    let live = claim_id(s, ns, id, at(30)).await.token();
    let extend =
        |leases: Vec<_>, now| LeaseExtendParams { worker: worker("w1"), leases, lease: LEASE, now };
    let before = row(s, id).await;
    let refused = s.lease_extend(extend(vec![(id, live), (id, live)], at(1_000))).await;
    expect_invalid(refused.clone(), "leases");
    let message = refused.expect_err("refused").message;
    assert!(message.contains(&format!("instance {id}")), "names the instance: {message}");
    assert_eq!(row(s, id).await, before, "a refused heartbeat extends nothing");
    let both = s.lease_extend(extend(vec![(id, stale), (id, live)], at(2_000))).await;
    assert_eq!(both.expect("stale, then live"), [false, true]);
    let both = s.lease_extend(extend(vec![(id, live), (id, stale)], at(3_000))).await;
    assert_eq!(both.expect("live, then stale"), [true, false]);
    assert_eq!(row(s, id).await.lease_expires_at, Some(at(3_000).plus(LEASE)));
}
