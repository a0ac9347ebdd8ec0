//! Contracts for the children barrier: zero, one, many and failed
//! children, uniqueness among children, and exactly one decrement per child.

use super::support::{
    LEASE, assert_row, at, claim, claim_id, claim_params, commit, commit_ok, ctx, done,
    expect_kind, facts, get, insert, insert_one, new_in, reap, reference, row, step,
};
use keel_core::ids::StatusSet;
use keel_core::outcome::{ApplyFacts, Outcome};
use keel_core::ports::Store;
use keel_core::ports::store::{Claim, InsertOutcome, LeaseReleaseParams};
use keel_core::{ErrorKind, InstanceId, NewInstance, Status, StepCommit};
use serde_json::json;
use std::time::Duration;

fn schedule(children: Vec<NewInstance>) -> Outcome {
    Outcome::ScheduleChildren {
        next: "join".into(),
        children,
        context: ctx(1),
        join: keel_core::join::Join::default(),
    }
}

/// Inserts and claims a parent in `ns`, schedules `children` at `at(20)`; returns the
/// parent id and the per-child outcomes.
async fn parent_with<S: Store>(
    s: &S,
    ns: &str,
    children: Vec<NewInstance>,
) -> (InstanceId, Vec<InsertOutcome>) {
    let id = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let receipt = step(s, &claimed, schedule(children), at(20)).await;
    (id, receipt.children)
}

/// Claims child `id` (children run in queue `default`) and commits `outcome`.
async fn finish<S: Store>(
    s: &S,
    ns: &str,
    id: InstanceId,
    outcome: Outcome,
    now: keel_core::Timestamp,
) -> Claim {
    let mut params = claim_params(ns, 1, now);
    params.queues = vec!["default".into()];
    params.limit = 100;
    let claims = claim(s, params).await;
    let others = claims.iter().filter(|c| c.instance.id != id).map(|c| (c.instance.id, c.token()));
    let leases = others.collect();
    s.lease_release(LeaseReleaseParams { leases, now }).await.expect("release the other children");
    let c = claims.into_iter().find(|c| c.instance.id == id).expect("child claimable");
    step(s, &c, outcome, now).await;
    c
}

fn child_ids(outs: &[InsertOutcome]) -> Vec<InstanceId> {
    outs.iter().map(|o| o.id()).collect()
}

/// When uniqueness drops every child (or none is asked for), the barrier is already
/// satisfied: the parent is runnable at `next` at once.
pub async fn children_zero_inserted_runnable_at_once<S: Store>(s: &S) {
    let ns = "children_zero";
    let occupant = insert_one(
        s,
        new_in(ns).unique("child-x", StatusSet::LIVE).eligible_at(at(1_000_000)),
        at(0),
    )
    .await;
    let id = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let kids = vec![
        new_in(ns).unique("child-x", StatusSet::LIVE),
        new_in(ns).unique("child-x", StatusSet::LIVE),
    ];
    let c = StepCommit::new(id, claimed.token(), schedule(kids));
    let receipt = commit_ok(s, c.clone(), at(20)).await;
    assert_eq!(receipt.children, vec![InsertOutcome::Existing(occupant); 2]);
    let want =
        reference(&claimed.instance, &c, ApplyFacts { children_inserted: 0, ..facts(at(20)) });
    let got = row(s, id).await;
    assert_row(&got, &want.row, "schedule_children with zero inserted");
    assert_eq!(
        (got.status, got.position.as_str(), got.children_pending),
        (Status::Runnable, "join", 0)
    );
    assert_eq!(row(s, occupant).await.parent, None, "an existing occupant is not adopted");
    let none = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, none, at(30)).await;
    assert_eq!(step(s, &claimed, schedule(vec![]), at(40)).await.status, Status::Runnable);
}

/// One child: its terminal commit releases the parent, which then sees the child.
pub async fn children_one_child_releases_parent<S: Store>(s: &S) {
    let ns = "children_one";
    let (parent, outs) = parent_with(s, ns, vec![new_in(ns)]).await;
    let child = child_ids(&outs)[0];
    assert_eq!(row(s, parent).await.status, Status::AwaitingChildren);
    finish(s, ns, child, Outcome::Done { result: json!({ "sum": 3 }), step: None }, at(50)).await;
    let p = row(s, parent).await;
    assert_eq!((p.status, p.children_pending, p.eligible_at), (Status::Runnable, 0, at(50)));
    let claimed = claim_id(s, ns, parent, at(50)).await;
    assert_eq!(claimed.instance.position, "join");
    assert_eq!(claimed.children.len(), 1);
    let summary = &claimed.children[0];
    assert_eq!(
        (summary.id, summary.status, summary.result.clone()),
        (child, Status::Done, Some(json!({ "sum": 3 })))
    );
}

/// Many children: the parent waits for the last one, in any order of completion.
pub async fn children_many_release_on_last<S: Store>(s: &S) {
    let ns = "children_many";
    let (parent, outs) = parent_with(s, ns, vec![new_in(ns), new_in(ns), new_in(ns)]).await;
    let kids = child_ids(&outs);
    finish(s, ns, kids[2], done(), at(30)).await;
    finish(s, ns, kids[0], done(), at(40)).await;
    let p = row(s, parent).await;
    assert_eq!(
        (p.status, p.children_pending),
        (Status::AwaitingChildren, 1),
        "released before the last child"
    );
    finish(s, ns, kids[1], done(), at(50)).await;
    let claimed = claim_id(s, ns, parent, at(50)).await;
    assert_eq!(
        claimed.children.iter().map(|c| c.id).collect::<Vec<_>>(),
        kids,
        "children oldest first"
    );
    assert!(claimed.children.iter().all(|c| c.status == Status::Done));
}

/// A failed child still releases its slot; the parent sees the failure.
pub async fn children_failed_child_releases_slot<S: Store>(s: &S) {
    let ns = "children_failed";
    let (parent, outs) = parent_with(s, ns, vec![new_in(ns), new_in(ns)]).await;
    let kids = child_ids(&outs);
    finish(s, ns, kids[0], done(), at(30)).await;
    finish(s, ns, kids[1], Outcome::Stop { reason: "out of stock".into() }, at(40)).await;
    let claimed = claim_id(s, ns, parent, at(40)).await;
    let failed = &claimed.children[1];
    assert_eq!(
        (failed.status, failed.last_error.as_deref()),
        (Status::Failed, Some("out of stock"))
    );
}

/// The barrier counts each child exactly once, even when the child's step is re-run
/// after a lost lease and the old worker's terminal commit arrives late.
pub async fn children_decremented_once_when_child_reruns<S: Store>(s: &S) {
    let ns = "children_once";
    let (parent, outs) = parent_with(s, ns, vec![new_in(ns), new_in(ns)]).await;
    let kids = child_ids(&outs);
    let mut params = claim_params(ns, 1, at(30));
    params.queues = vec!["default".into()];
    let first = claim(s, params.clone()).await.remove(0);
    assert_eq!(first.instance.id, kids[0]);
    let expired = at(30).plus(LEASE).plus(Duration::from_millis(1));
    assert_eq!(reap(s, expired).await, vec![kids[0]]);
    params.now = expired;
    params.worker = keel_core::WorkerId("w2".into());
    params.limit = 10;
    let claims = claim(s, params).await;
    let leases = claims
        .iter()
        .filter(|c| c.instance.id != kids[0])
        .map(|c| (c.instance.id, c.token()))
        .collect();
    s.lease_release(LeaseReleaseParams { leases, now: expired })
        .await
        .expect("release the sibling");
    let rerun = claims
        .into_iter()
        .find(|c| c.instance.id == kids[0])
        .expect("the reaped child is claimable");
    assert_eq!(rerun.instance.attempt, 1, "a reaped step runs again with attempt + 1");
    expect_kind(
        commit(s, StepCommit::new(kids[0], first.token(), done()), expired).await,
        ErrorKind::LeaseLost,
        "old worker",
    );
    assert_eq!(
        row(s, parent).await.children_pending,
        2,
        "a rejected child commit counted on the barrier"
    );
    step(s, &rerun, done(), expired).await;
    assert_eq!(row(s, parent).await.children_pending, 1);
    expect_kind(
        commit(s, StepCommit::new(kids[0], rerun.token(), done()), expired).await,
        ErrorKind::LeaseLost,
        "second terminal commit",
    );
    let p = row(s, parent).await;
    assert_eq!(
        (p.status, p.children_pending),
        (Status::AwaitingChildren, 1),
        "one child counted twice"
    );
    finish(s, ns, kids[1], done(), expired).await;
    assert_eq!(row(s, parent).await.status, Status::Runnable);
}

/// Uniqueness applies to children per item (against existing rows and earlier children of
/// the same outcome); only new children count on the barrier; a child that finishes
/// frees its key.
pub async fn children_uniqueness_counts_only_new<S: Store>(s: &S) {
    let ns = "children_unique";
    let occupant =
        insert_one(s, new_in(ns).unique("k1", StatusSet::LIVE).eligible_at(at(1_000_000)), at(0))
            .await;
    let kids = vec![
        new_in(ns).unique("k1", StatusSet::LIVE),
        new_in(ns).unique("k2", StatusSet::LIVE),
        new_in(ns).unique("k2", StatusSet::LIVE),
        new_in(ns),
    ];
    let (parent, outs) = parent_with(s, ns, kids).await;
    assert_eq!(outs[0], InsertOutcome::Existing(occupant));
    let InsertOutcome::Inserted(k2) = outs[1] else { panic!("k2 should be new: {outs:?}") };
    assert_eq!(outs[2], InsertOutcome::Existing(k2), "duplicate within the children");
    assert!(matches!(outs[3], InsertOutcome::Inserted(_)));
    let d = get(s, parent).await;
    assert_eq!(d.instance.children_pending, 2);
    assert_eq!(d.children.iter().map(|c| c.id).collect::<Vec<_>>(), vec![k2, outs[3].id()]);
    finish(s, ns, k2, done(), at(30)).await;
    let again = insert(s, vec![new_in(ns).unique("k2", StatusSet::LIVE)], at(40)).await;
    assert!(matches!(again[0], InsertOutcome::Inserted(_)), "a done child kept its key: {again:?}");
}
