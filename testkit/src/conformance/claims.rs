//! Contracts for claiming: order, eligibility, filters, paused queues, per-key
//! serialization, and never handing out a row that a live claim holds.

use super::support::{
    LEASE, at, claim, claim_params, done, ids, insert, insert_one, new_in, next, order, step,
    worker,
};
use keel_core::ports::Store;
use keel_core::ports::store::{QueuePauseParams, QueueState};
use keel_core::{MachineRef, NewInstance, Priority, Timestamp};
use std::collections::BTreeSet;
use std::time::Duration;

/// Claims come in priority order, then `eligible_at`, then id; `limit` is respected.
pub async fn claim_order_priority_then_eligible_at<S: Store>(s: &S) {
    let ns = "claim_order";
    let mk = |p: Priority, ms: i64| new_in(ns).priority(p).eligible_at(at(ms));
    let out = insert(
        s,
        vec![
            mk(Priority::Normal, 5),
            mk(Priority::High, 7),
            mk(Priority::Normal, 3),
            mk(Priority::Bulk, 0),
            mk(Priority::Critical, 9),
            mk(Priority::Normal, 5),
            mk(Priority::Normal, 5),
        ],
        at(0),
    )
    .await;
    let id = |i: usize| out[i].id();
    let first = claim(s, claim_params(ns, 2, at(100))).await;
    assert_eq!(ids(&first), vec![id(4), id(1)]);
    let rest = claim(s, claim_params(ns, 10, at(100))).await;
    assert_eq!(ids(&rest), vec![id(2), id(0), id(5), id(6), id(3)]);
    assert!(claim(s, claim_params(ns, 0, at(100))).await.is_empty());
}

/// A row whose `eligible_at` is in the future is not claimed until that time.
pub async fn claim_skips_future_eligible_at<S: Store>(s: &S) {
    let ns = "claim_future";
    let later = insert_one(s, new_in(ns).eligible_at(at(1_000)), at(0)).await;
    let early = insert_one(s, new_in(ns).priority(Priority::Bulk), at(0)).await;
    assert_eq!(ids(&claim(s, claim_params(ns, 10, at(999))).await), vec![early]);
    assert_eq!(ids(&claim(s, claim_params(ns, 10, at(1_000))).await), vec![later]);
}

/// Namespace, queue and `(machine, version)` filters each narrow the claim; empty lists
/// mean any.
pub async fn claim_filters_namespace_queue_machine<S: Store>(s: &S) {
    let (ns, other_ns) = ("claim_filters", "claim_filters_other");
    let base =
        |ns: &str, q: &str, m: MachineRef| NewInstance::new(m, "start").namespace(ns).queue(q);
    let out = insert(
        s,
        vec![
            base(ns, "q1", order()),
            base(ns, "q2", order()),
            base(ns, "q1", MachineRef::new("billing", 1)),
            base(ns, "q1", MachineRef::new("order", 2)),
            base(other_ns, "q1", order()),
        ],
        at(0),
    )
    .await;
    let id = |i: usize| out[i].id();
    let mut p = claim_params(ns, 10, at(10));
    p.queues = vec!["q2".into()];
    assert_eq!(ids(&claim(s, p).await), vec![id(1)], "queue filter");
    let mut p = claim_params(ns, 10, at(10));
    p.machines = vec![MachineRef::new("order", 2)];
    assert_eq!(ids(&claim(s, p).await), vec![id(3)], "machine version filter");
    let mut p = claim_params(ns, 10, at(10));
    p.machines = vec![MachineRef::new("billing", 1), MachineRef::new("billing", 2)];
    assert_eq!(ids(&claim(s, p).await), vec![id(2)], "machine name filter");
    assert_eq!(
        ids(&claim(s, claim_params(other_ns, 10, at(10))).await),
        vec![id(4)],
        "namespace filter"
    );
    let mut any = claim_params(ns, 10, at(10));
    any.namespaces.clear();
    assert_eq!(ids(&claim(s, any).await), vec![id(0)], "empty filters mean any");
}

/// A paused queue is not claimed from (in its namespace only) until it is resumed, and
/// `queue_list` shows its state.
pub async fn paused_queue_not_claimed_until_resumed<S: Store>(s: &S) {
    let (ns, other_ns) = ("queue_pause", "queue_pause_other");
    let held = insert_one(s, new_in(ns).queue("mail"), at(0)).await;
    let free = insert_one(s, new_in(ns).queue("bulk"), at(0)).await;
    let elsewhere = insert_one(s, new_in(other_ns).queue("mail"), at(0)).await;
    let pause = |paused: bool, now| pause(ns, "mail", paused, now);
    s.queue_pause(pause(true, at(1))).await.expect("pause");
    let state = |paused| queue_state(ns, "mail", paused);
    assert!(s.queue_list(ns.into()).await.expect("list").contains(&state(true)));
    assert_eq!(
        ids(&claim(s, claim_params(ns, 10, at(10))).await),
        vec![free],
        "a paused queue was claimed"
    );
    assert_eq!(
        ids(&claim(s, claim_params(other_ns, 10, at(10))).await),
        vec![elsewhere],
        "pause leaked across namespaces"
    );
    s.queue_pause(pause(false, at(20))).await.expect("resume");
    assert!(s.queue_list(ns.into()).await.expect("list").contains(&state(false)));
    assert_eq!(ids(&claim(s, claim_params(ns, 10, at(30))).await), vec![held]);
}

/// A pause (`paused`) or resume of `queue` in `ns` at `now`.
fn pause(ns: &str, queue: &str, paused: bool, now: Timestamp) -> QueuePauseParams {
    QueuePauseParams { namespace: ns.into(), queue: queue.into(), paused, now }
}

/// `queue` of `ns` as `queue_list` lists it.
fn queue_state(ns: &str, queue: &str, paused: bool) -> QueueState {
    QueueState { namespace: ns.into(), queue: queue.into(), paused }
}

/// `queue_list` lists exactly the queues of its namespace that have settings (a pause
/// recorded them), in name order: a queue that only holds instances, running or ended,
/// is not listed (it is not paused), a queue paused before any instance is in it is, a
/// resumed queue stays listed, running, and resuming a never-paused queue lists nothing.
pub async fn queue_list_lists_exactly_the_queues_with_settings<S: Store>(s: &S) {
    let (ns, other_ns) = ("queue_list", "queue_list_other");
    for queue in ["a", "b", "c"] {
        insert_one(s, new_in(ns).queue(queue), at(0)).await;
    }
    let ended = claim(s, claim_params(ns, 10, at(1))).await;
    for c in &ended {
        step(s, c, done(), at(2)).await;
    }
    insert_one(s, new_in(other_ns).queue("z"), at(0)).await;
    let list = async || s.queue_list(ns.into()).await.expect("list");
    let state = |queue: &str, paused| queue_state(ns, queue, paused);
    insert_one(s, new_in(ns).queue("b"), at(3)).await;
    assert_eq!(list().await, Vec::new(), "queues without settings are not listed");
    s.queue_pause(pause(other_ns, "z", true, at(4))).await.expect("pause elsewhere");
    s.queue_pause(pause(ns, "b", true, at(5))).await.expect("pause b");
    s.queue_pause(pause(ns, "empty", true, at(6))).await.expect("pause a queue with no instance");
    assert_eq!(list().await, [state("b", true), state("empty", true)]);
    s.queue_pause(pause(ns, "b", false, at(7))).await.expect("resume b");
    s.queue_pause(pause(ns, "a", false, at(8))).await.expect("resume a, never paused");
    assert_eq!(list().await, [state("b", false), state("empty", true)]);
}

/// Resuming records no settings: a resume of a queue that was never paused (one holding
/// instances, a misspelt name, one paused only in another namespace) leaves `queue_list`
/// without it and its instances claimable, while a pause then a resume, even twice, leaves
/// the one row, running, and the queue's instances claimable again.
pub async fn queue_resume_records_no_settings<S: Store>(s: &S) {
    let (ns, other_ns) = ("queue_resume", "queue_resume_other");
    let list = async || s.queue_list(ns.into()).await.expect("list");
    let state = |queue: &str, paused| queue_state(ns, queue, paused);
    let busy = insert_one(s, new_in(ns).queue("busy"), at(0)).await;
    s.queue_pause(pause(other_ns, "elsewhere", true, at(1))).await.expect("pause elsewhere");
    for queue in ["busy", "misspelt", "elsewhere"] {
        s.queue_pause(pause(ns, queue, false, at(2))).await.expect("resume, never paused");
    }
    assert_eq!(list().await, Vec::new(), "a resume recorded a queue that was never paused");
    assert_eq!(
        s.queue_list(other_ns.into()).await.expect("list"),
        [QueueState { namespace: other_ns.into(), queue: "elsewhere".into(), paused: true }],
        "a resume in one namespace touched another"
    );
    assert_eq!(ids(&claim(s, claim_params(ns, 10, at(3))).await), vec![busy]);
    let held = insert_one(s, new_in(ns).queue("mail"), at(4)).await;
    s.queue_pause(pause(ns, "mail", true, at(5))).await.expect("pause");
    assert!(claim(s, claim_params(ns, 10, at(6))).await.is_empty(), "a paused queue was claimed");
    s.queue_pause(pause(ns, "mail", false, at(7))).await.expect("resume");
    s.queue_pause(pause(ns, "mail", false, at(8))).await.expect("resume again");
    assert_eq!(list().await, [state("mail", false)]);
    assert_eq!(ids(&claim(s, claim_params(ns, 10, at(9))).await), vec![held]);
}

/// Rows sharing a `concurrency_key` run one at a time, in `eligible_at` order; other
/// keys run in parallel.
pub async fn concurrency_key_serializes<S: Store>(s: &S) {
    let ns = "concurrency_key";
    let mk = |key: &str, ms: i64| new_in(ns).concurrency_key(key).eligible_at(at(ms));
    let out =
        insert(s, vec![mk("acct-1", 1), mk("acct-1", 2), mk("acct-1", 3), mk("acct-2", 4)], at(0))
            .await;
    let id = |i: usize| out[i].id();
    let first = claim(s, claim_params(ns, 10, at(10))).await;
    assert_eq!(ids(&first), vec![id(0), id(3)], "at most one per key per claim");
    assert!(
        claim(s, claim_params(ns, 10, at(10))).await.is_empty(),
        "claimed a key that is executing"
    );
    step(s, &first[0], next("second", 1), at(20)).await;
    assert_eq!(
        ids(&claim(s, claim_params(ns, 10, at(20))).await),
        vec![id(1)],
        "next of the key in eligible_at order"
    );
}

/// A claim never returns a row that another live claim holds — not under concurrent
/// claims, and not after the lease ran out but before the reaper returned it.
pub async fn claim_never_returns_held_row<S: Store>(s: &S) {
    let ns = "claim_exclusive";
    let out = insert(s, (0..6).map(|_| new_in(ns)).collect(), at(0)).await;
    let mut p2 = claim_params(ns, 4, at(10));
    p2.worker = worker("w2");
    let (a, b) = tokio::join!(claim(s, claim_params(ns, 4, at(10))), claim(s, p2));
    let (a, b): (BTreeSet<_>, BTreeSet<_>) =
        (ids(&a).into_iter().collect(), ids(&b).into_iter().collect());
    assert!(a.is_disjoint(&b), "two live claims hold the same row: {a:?} {b:?}");
    let all: BTreeSet<_> = a.union(&b).copied().collect();
    assert_eq!(all, out.iter().map(|o| o.id()).collect::<BTreeSet<_>>());
    let mut p3 = claim_params(ns, 10, at(10).plus(LEASE).plus(Duration::from_secs(1)));
    p3.worker = worker("w3");
    assert!(claim(s, p3).await.is_empty(), "an expired but unreaped lease was claimed");
}

/// A claim by id (a queue hint's targets) takes exactly the named instances that are
/// ready, in claim order, and skips the rest: one already held, one that does not exist,
/// one filtered out by the claim's namespace. Ordinary claims still find the others.
pub async fn claim_by_ids_takes_only_the_named_ready_instances<S: Store>(s: &S) {
    let ns = "claim_ids";
    let mut made = Vec::new();
    for _ in 0..4 {
        made.push(super::support::insert_one(s, super::support::new_in(ns), at(0)).await);
    }
    let elsewhere =
        super::support::insert_one(s, super::support::new_in("claim_ids_other"), at(0)).await;
    let missing = keel_core::InstanceId(made[3].0 + 1_000_000);
    let named = vec![made[2], made[0], missing, elsewhere];
    let claims =
        s.instance_claim_ids(named.clone(), claim_params(ns, 10, at(5))).await.expect("claim ids");
    assert_eq!(ids(&claims), vec![made[0], made[2]], "only the named ready ones, in claim order");
    let again = s.instance_claim_ids(named, claim_params(ns, 10, at(6))).await.expect("claim ids");
    assert!(again.is_empty(), "a held instance is not claimed twice: {:?}", ids(&again));
    let rest = s.instance_claim(claim_params(ns, 10, at(7))).await.expect("claim");
    assert_eq!(ids(&rest), vec![made[1], made[3]]);
    let none = s.instance_claim_ids(Vec::new(), claim_params(ns, 10, at(8))).await.expect("empty");
    assert!(none.is_empty());
}

/// The repair read returns the instances that have been ready (runnable, due, in an
/// unpaused queue, within the filters) for at least `ready_for`, counted from their last
/// change or due time, in id order and in pages after a cursor. Executing, not yet due,
/// recently changed, paused and filtered-out rows are left out.
pub async fn ready_stale_returns_instances_ready_for_the_bound<S: Store>(s: &S) {
    use keel_core::ports::store::ReadyStaleParams;
    let ns = "ready_stale";
    let params = |after: Option<keel_core::InstanceId>, limit: usize, now: i64| ReadyStaleParams {
        namespaces: vec![ns.to_owned()],
        queues: Vec::new(),
        machines: Vec::new(),
        ready_for: Duration::from_millis(100),
        after,
        limit,
        now: at(now),
    };
    let read = async |p: ReadyStaleParams| -> Vec<keel_core::InstanceId> {
        let rows = s.instance_ready_stale(p).await.expect("instance_ready_stale");
        rows.iter().map(|r| r.id).collect()
    };
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns), at(0)).await;
    let later = insert_one(s, new_in(ns).eligible_at(at(500)), at(0)).await;
    let busy = insert_one(s, new_in(ns).priority(Priority::Critical), at(0)).await;
    let _elsewhere = insert_one(s, new_in("ready_stale_other"), at(0)).await;
    let _paused = insert_one(s, new_in(ns).queue("ready_stale_paused"), at(0)).await;
    let young = insert_one(s, new_in(ns), at(80)).await;
    s.queue_pause(pause(ns, "ready_stale_paused", true, at(0))).await.expect("pause");
    let held = claim(s, claim_params(ns, 1, at(5))).await;
    assert_eq!(ids(&held), vec![busy]);

    assert_eq!(read(params(None, 10, 150)).await, vec![a, b], "ready for 100 ms at 150");
    assert_eq!(read(params(None, 1, 150)).await, vec![a], "a page of one");
    assert_eq!(read(params(Some(a), 1, 150)).await, vec![b], "the next page");
    assert!(read(params(Some(b), 1, 150)).await.is_empty(), "past the last");

    // The busy instance commits a step at 140: ready again, but only since 140.
    step(s, &held[0], next("again", 1), at(140)).await;
    assert_eq!(read(params(None, 10, 200)).await, vec![a, b, young]);
    assert_eq!(read(params(None, 10, 240)).await, vec![a, b, busy, young]);
    // Due at 500: ready for 100 ms at 600.
    assert_eq!(read(params(None, 10, 599)).await, vec![a, b, busy, young]);
    assert_eq!(read(params(None, 10, 600)).await, vec![a, b, later, busy, young]);

    let over = params(None, keel_core::limits::READY_STALE_BATCH_MAX + 1, 600);
    super::support::expect_kind(
        s.instance_ready_stale(over).await,
        keel_core::ErrorKind::Invalid,
        "a page over READY_STALE_BATCH_MAX",
    );
}
