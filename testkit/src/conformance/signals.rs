//! Contracts for signals and the inbox: no lost wake-up in both orders, `*`, consuming
//! exactly what the step saw, dedup, missing targets, the outbox, and the
//! bounded inbox of a claim.

use super::support::{
    assert_row, at, await_signal, claim, claim_id, claim_params, commit, commit_ok, deliver,
    expect_kind, facts, get, insert_one, new_in, next, order, reference, row, send, step,
};
use keel_core::instance::{NewSignal, SignalTarget};
use keel_core::limits;
use keel_core::outcome::ApplyFacts;
use keel_core::ports::Store;
use keel_core::ports::store::DeliveryOutcome;
use keel_core::{ErrorKind, InstanceId, Status, StepCommit};
use serde_json::json;

/// A signal that arrives while the step runs (before it parks) is not lost: the `Await`
/// commits as runnable, and the next run sees the signal.
pub async fn await_signal_before_park_commits_runnable<S: Store>(s: &S) {
    let ns = "wake_before_park";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let (sid, woke) = send(s, id, "paid", at(15)).await;
    assert!(!woke, "an executing instance is not woken by delivery");
    let c = StepCommit::new(id, claimed.token(), await_signal("paid", 1));
    let receipt = commit_ok(s, c.clone(), at(20)).await;
    let want =
        reference(&claimed.instance, &c, ApplyFacts { signal_waiting: true, ..facts(at(20)) });
    assert_row(&row(s, id).await, &want.row, "await with the signal already in the inbox");
    assert_eq!(
        receipt.status,
        Status::Runnable,
        "lost wake-up: the await parked with its signal waiting"
    );
    let again = claim_id(s, ns, id, at(20)).await;
    assert_eq!(
        again.instance.awaits.as_deref(),
        Some("paid"),
        "the woken step sees what it awaited"
    );
    assert_eq!(again.inbox.iter().map(|x| x.id).collect::<Vec<_>>(), vec![sid]);
    commit_ok(s, StepCommit::new(id, again.token(), next("shipped", 2)).consume([sid]), at(30))
        .await;
    let after = get(s, id).await;
    assert!(
        after.inbox.is_empty() && after.instance.awaits.is_none(),
        "progress consumes and clears awaits"
    );
}

/// A parked instance is woken by a matching signal, not by another name, and keeps
/// `awaits` for the woken step to see.
pub async fn await_park_then_signal_wakes<S: Store>(s: &S) {
    let ns = "park_then_wake";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    step(s, &claimed, await_signal("paid", 1), at(20)).await;
    let (other, woke) = send(s, id, "shipped", at(25)).await;
    assert!(!woke, "a non-matching signal woke the instance");
    assert_eq!(row(s, id).await.status, Status::AwaitingSignal);
    let (paid, woke) = send(s, id, "paid", at(30)).await;
    assert!(woke, "the matching signal did not wake the instance");
    let woken = row(s, id).await;
    assert_eq!(
        (woken.status, woken.eligible_at, woken.awaits.as_deref()),
        (Status::Runnable, at(30), Some("paid"))
    );
    let again = claim_id(s, ns, id, at(30)).await;
    assert_eq!(
        again.inbox.iter().map(|x| x.id).collect::<Vec<_>>(),
        vec![other, paid],
        "inbox in arrival order"
    );
}

/// `*` awaits any signal, whether it arrives before or after the park.
pub async fn await_any_signal_wakes_on_any_name<S: Store>(s: &S) {
    let ns = "await_any";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    step(s, &claimed, await_signal("*", 1), at(20)).await;
    assert_eq!(row(s, id).await.status, Status::AwaitingSignal);
    let (first, woke) = send(s, id, "anything", at(30)).await;
    assert!(woke, "`*` was not woken by a signal");
    let again = claim_id(s, ns, id, at(30)).await;
    send(s, id, "early", at(35)).await;
    let receipt = commit_ok(
        s,
        StepCommit::new(id, again.token(), await_signal("*", 2)).consume([first]),
        at(40),
    )
    .await;
    assert_eq!(receipt.status, Status::Runnable, "`*` parked although a signal was waiting");
}

/// A step consumes exactly the signals it saw; one that arrived during the step, and one
/// in another instance's inbox, survive. `Await` looks at the inbox after consumption.
pub async fn consume_only_seen_signals<S: Store>(s: &S) {
    let ns = "consume_seen";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let stranger = insert_one(s, new_in(ns).eligible_at(at(1_000_000)), at(0)).await;
    let (a, _) = send(s, id, "a", at(5)).await;
    let (foreign, _) = send(s, stranger, "a", at(5)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    assert_eq!(claimed.inbox.iter().map(|x| x.id).collect::<Vec<_>>(), vec![a]);
    let (b, _) = send(s, id, "b", at(15)).await;
    commit_ok(
        s,
        StepCommit::new(id, claimed.token(), next("second", 1)).consume([a, foreign]),
        at(20),
    )
    .await;
    assert_eq!(
        get(s, id).await.inbox.iter().map(|x| x.id).collect::<Vec<_>>(),
        vec![b],
        "late signal lost or seen one kept"
    );
    assert_eq!(get(s, stranger).await.inbox.len(), 1, "another instance's signal was consumed");
    let again = claim_id(s, ns, id, at(20)).await;
    let receipt =
        commit_ok(s, StepCommit::new(id, again.token(), await_signal("b", 2)).consume([b]), at(30))
            .await;
    assert_eq!(receipt.status, Status::AwaitingSignal, "a consumed signal counted as waiting");
}

/// Dedup per `(target, dedup_key)`: across calls and within one batch; other targets and
/// other keys are independent.
pub async fn signal_dedup_across_calls_and_within_batch<S: Store>(s: &S) {
    let ns = "signal_dedup";
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns), at(0)).await;
    let sig =
        |t: InstanceId, k: &str| NewSignal::new(t, "paid").dedup_key(k).payload(json!({ "k": k }));
    let out = deliver(s, vec![sig(a, "k1"), sig(a, "k1"), sig(b, "k1")], at(1)).await;
    let DeliveryOutcome::Delivered { id: first, .. } = out[0] else {
        panic!("first delivery: {:?}", out[0])
    };
    assert_eq!(
        out[1],
        DeliveryOutcome::Duplicate { id: first, target: a },
        "duplicate within a batch"
    );
    assert!(
        matches!(out[2], DeliveryOutcome::Delivered { target, .. } if target == b),
        "dedup is per target"
    );
    let out = deliver(s, vec![sig(a, "k1"), sig(a, "k2")], at(2)).await;
    assert_eq!(
        out[0],
        DeliveryOutcome::Duplicate { id: first, target: a },
        "duplicate across calls"
    );
    assert!(matches!(out[1], DeliveryOutcome::Delivered { .. }), "another key is not a duplicate");
    let no_key =
        deliver(s, vec![NewSignal::new(a, "paid"), NewSignal::new(a, "paid")], at(3)).await;
    assert!(
        no_key.iter().all(|o| matches!(o, DeliveryOutcome::Delivered { .. })),
        "no key, no dedup"
    );
    assert_eq!(get(s, a).await.inbox.len(), 4);
}

/// Delivery to a missing instance (by id or business key) is reported and stores
/// nothing; the rest of the batch is delivered.
pub async fn signal_to_missing_target_reported<S: Store>(s: &S) {
    let ns = "signal_missing";
    let id = insert_one(s, new_in(ns).business_key("order-1"), at(0)).await;
    let key =
        |k: &str| SignalTarget::Key { namespace: ns.into(), machine: order().name, key: k.into() };
    let out = deliver(
        s,
        vec![
            NewSignal::new(InstanceId(i64::MAX), "paid"),
            NewSignal::new(key("order-404"), "paid"),
            NewSignal::new(key("order-1"), "paid"),
        ],
        at(1),
    )
    .await;
    assert_eq!(out[..2], [DeliveryOutcome::TargetMissing, DeliveryOutcome::TargetMissing]);
    assert!(
        matches!(out[2], DeliveryOutcome::Delivered { target, .. } if target == id),
        "by business key"
    );
    assert_eq!(get(s, id).await.inbox.len(), 1);
}

/// Emits travel in the step's own commit (outbox), by id and by business key, and wake
/// a target awaiting them.
pub async fn emit_outbox_delivered_in_same_commit<S: Store>(s: &S) {
    let ns = "emit_outbox";
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns).business_key("b-1"), at(0)).await;
    let c = insert_one(s, new_in(ns).eligible_at(at(1_000_000)), at(0)).await;
    let claims = claim(s, claim_params(ns, 2, at(10))).await;
    step(s, &claims[1], await_signal("ping", 1), at(15)).await;
    let by_key =
        SignalTarget::Key { namespace: ns.into(), machine: order().name, key: "b-1".into() };
    let commit_a = StepCommit::new(a, claims[0].token(), next("second", 1))
        .emit(NewSignal::new(by_key, "ping").payload(json!({ "from": a.0 })))
        .emit(NewSignal::new(c, "note"));
    commit_ok(s, commit_a, at(20)).await;
    let b_row = get(s, b).await;
    assert_eq!(b_row.instance.status, Status::Runnable, "the emit did not wake its target");
    assert_eq!(
        b_row.inbox.iter().map(|x| (x.name.as_str(), x.payload.clone())).collect::<Vec<_>>(),
        vec![("ping", json!({ "from": a.0 }))]
    );
    assert_eq!(get(s, c).await.inbox.len(), 1, "emit by id");
}

/// An emit to a missing target rejects the whole item (`NotFound`): nothing of it is
/// written, not even its other emits.
pub async fn emit_to_missing_target_rejects_item<S: Store>(s: &S) {
    let ns = "emit_missing";
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns).eligible_at(at(1_000_000)), at(0)).await;
    let (sid, _) = send(s, a, "go", at(1)).await;
    let claimed = claim_id(s, ns, a, at(10)).await;
    let before = (get(s, a).await, get(s, b).await);
    let bad = StepCommit::new(a, claimed.token(), next("second", 1))
        .consume([sid])
        .emit(NewSignal::new(b, "ping"))
        .emit(NewSignal::new(InstanceId(i64::MAX), "ping"));
    expect_kind(commit(s, bad, at(20)).await, ErrorKind::NotFound, "emit to a missing instance");
    assert_eq!((get(s, a).await, get(s, b).await), before, "a rejected item wrote something");
}

/// A claim hands the step at most `CLAIM_INBOX_MAX` signals, oldest first; the rest wait
/// for the next step.
pub async fn claim_inbox_bounded_in_arrival_order<S: Store>(s: &S) {
    let ns = "inbox_bound";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let total = limits::CLAIM_INBOX_MAX + 3;
    let signals = (0..total).map(|i| NewSignal::new(id, format!("e{i}"))).collect();
    deliver(s, signals, at(1)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let names: Vec<String> = claimed.inbox.iter().map(|x| x.name.clone()).collect();
    let want: Vec<String> = (0..limits::CLAIM_INBOX_MAX).map(|i| format!("e{i}")).collect();
    assert_eq!(names, want, "the claim's inbox is the oldest CLAIM_INBOX_MAX in arrival order");
    assert!(
        claimed.inbox.windows(2).all(|w| w[0].id < w[1].id),
        "signal ids increase in arrival order"
    );
    let seen = claimed.inbox.iter().map(|x| x.id);
    commit_ok(s, StepCommit::new(id, claimed.token(), next("second", 1)).consume(seen), at(20))
        .await;
    let again = claim_id(s, ns, id, at(20)).await;
    let rest: Vec<String> = again.inbox.iter().map(|x| x.name.clone()).collect();
    let want: Vec<String> = (limits::CLAIM_INBOX_MAX..total).map(|i| format!("e{i}")).collect();
    assert_eq!(rest, want);
}

/// Every `Delivered` outcome of a batch names the signal it stored: the id of the signal
/// with that name, in that target's inbox, whatever the batch mixes (targets in turn, a
/// duplicate in between).
pub async fn signal_ids_in_a_batch_name_the_signals_stored<S: Store>(s: &S) {
    let ns = "signal_ids";
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns), at(0)).await;
    let signals = vec![
        NewSignal::new(a, "one"),
        NewSignal::new(b, "two").dedup_key("k"),
        NewSignal::new(a, "three"),
        NewSignal::new(b, "four").dedup_key("k"),
        NewSignal::new(b, "five"),
        NewSignal::new(a, "six"),
    ];
    let names: Vec<String> = signals.iter().map(|s| s.name.clone()).collect();
    let out = deliver(s, signals, at(1)).await;
    assert_eq!(out.len(), names.len());
    let mut delivered = 0;
    for (outcome, name) in out.iter().zip(&names) {
        let DeliveryOutcome::Delivered { id, target, .. } = *outcome else { continue };
        delivered += 1;
        let inbox = get(s, target).await.inbox;
        let stored = inbox.iter().find(|sig| sig.id == id).expect("the id is in the inbox");
        assert_eq!(&stored.name, name, "outcome {outcome:?}");
    }
    assert_eq!(delivered, 5, "one duplicate: {out:?}");
}
