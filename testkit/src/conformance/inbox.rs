//! Contracts for the inbox of a terminal instance: the commit (or cancel) that ends an
//! instance drains its inbox into one bounded history entry, and nothing delivered to a
//! terminal instance afterwards — by a client, an outbox emit, a child's notice or a
//! broadcast — is stored.

use super::support::{
    assert_history_tail, at, claim, claim_id, claim_params, commit_ok, deliver, done, facts, get,
    insert_one, new_in, next, reference, send, step,
};
use keel_core::inbox::{self, INBOX_DRAINED, Pending};
use keel_core::instance::{ANY_SIGNAL, HistoryEntry, NewSignal};
use keel_core::limits;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, DeliveryOutcome, InstanceDetail, SignalBroadcastParams,
};
use keel_core::{InstanceId, SignalId, Status, StepCommit, Timestamp};
use serde_json::json;

/// The drain entry the reference records for these pending signals, oldest first.
fn drained(count: u64, oldest: &[(SignalId, &str)]) -> HistoryEntry {
    let pending = Pending {
        count,
        oldest: oldest.iter().map(|(id, name)| (*id, (*name).to_owned())).collect(),
    };
    inbox::drained(&pending).expect("something was pending")
}

fn drain_entries(d: &InstanceDetail) -> usize {
    d.history.iter().filter(|r| r.entry.kind == INBOX_DRAINED).count()
}

fn cancel(id: InstanceId, cascade: bool, now: Timestamp) -> CancelParams {
    CancelParams { id, reason: "operator".into(), cascade, now, only_in: None }
}

/// The commit that ends an instance (`Done`, `Stop`) removes every signal still in its
/// inbox — seen and left, or arrived during the step — and records them in one
/// `INBOX_DRAINED` entry after the outcome's own: the count, and the oldest
/// `INBOX_DRAIN_LISTED_MAX` by id and name. An empty inbox records nothing.
pub async fn terminal_commit_drains_inbox_into_one_history_entry<S: Store>(s: &S) {
    let ns = "drain_commit";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let (seen, _) = send(s, id, "a", at(1)).await;
    let keyed = deliver(s, vec![NewSignal::new(id, "b").dedup_key("k")], at(2)).await;
    let DeliveryOutcome::Delivered { id: left, .. } = keyed[0] else {
        panic!("expected a delivery, got {:?}", keyed[0])
    };
    let claimed = claim_id(s, ns, id, at(10)).await;
    let (late, _) = send(s, id, "c", at(15)).await;
    let commit = StepCommit::new(id, claimed.token(), done()).consume([seen]);
    commit_ok(s, commit.clone(), at(20)).await;
    let detail = get(s, id).await;
    assert!(detail.inbox.is_empty(), "a finished instance kept signals: {:?}", detail.inbox);
    let mut want = reference(&claimed.instance, &commit, facts(at(20))).history;
    want.push(drained(2, &[(left, "b"), (late, "c")]));
    assert_history_tail(&detail, &want, claimed.instance.attempt, "done with unread signals");
    assert_eq!(drain_entries(&detail), 1, "one entry per drain");

    // More than the list holds: every one counted and removed, the oldest listed.
    let failed = insert_one(s, new_in(ns), at(30)).await;
    let total = limits::INBOX_DRAIN_LISTED_MAX + 3;
    let names: Vec<String> = (0..total).map(|i| format!("e{i}")).collect();
    let out = deliver(s, names.iter().map(|n| NewSignal::new(failed, n)).collect(), at(31)).await;
    let sent: Vec<SignalId> = out
        .iter()
        .map(|o| match o {
            DeliveryOutcome::Delivered { id, .. } => *id,
            other => panic!("expected a delivery, got {other:?}"),
        })
        .collect();
    let claimed = claim_id(s, ns, failed, at(40)).await;
    step(s, &claimed, Outcome::Stop { reason: "card declined".into() }, at(50)).await;
    let detail = get(s, failed).await;
    assert!(detail.inbox.is_empty(), "a failed instance kept signals");
    let oldest: Vec<(SignalId, &str)> = sent
        .iter()
        .zip(&names)
        .take(limits::INBOX_DRAIN_LISTED_MAX)
        .map(|(id, n)| (*id, n.as_str()))
        .collect();
    let entry = &detail.history.last().expect("history").entry;
    assert_eq!(entry, &drained(total as u64, &oldest), "the entry is bounded and counts all");

    // Nothing pending: nothing recorded.
    let quiet = insert_one(s, new_in(ns), at(60)).await;
    let claimed = claim_id(s, ns, quiet, at(70)).await;
    step(s, &claimed, done(), at(80)).await;
    assert_eq!(drain_entries(&get(s, quiet).await), 0, "an empty inbox leaves no entry");
}

/// Cancel drains the inbox of every instance it ends, the cascade's included, each into
/// one entry after its `CANCELLED`; an already terminal instance is left alone.
pub async fn cancel_drains_every_cancelled_inbox<S: Store>(s: &S) {
    let ns = "drain_cancel";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut park = StepCommit::new(
        parent,
        claimed.token(),
        Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: None },
    );
    park.spawn = vec![new_in(ns).eligible_at(at(1_000_000))];
    let kid = commit_ok(s, park, at(20)).await.spawned[0].id();
    let (first, _) = send(s, parent, "x", at(30)).await;
    let (second, _) = send(s, parent, "y", at(31)).await;
    let (theirs, _) = send(s, kid, "z", at(32)).await;
    let quiet = insert_one(s, new_in(ns).eligible_at(at(1_000_000)), at(33)).await;
    let out = s.instance_cancel(cancel(parent, true, at(40))).await.expect("cancel");
    assert_eq!(out, vec![parent, kid]);
    for (id, entry) in
        [(parent, drained(2, &[(first, "x"), (second, "y")])), (kid, drained(1, &[(theirs, "z")]))]
    {
        let detail = get(s, id).await;
        assert!(detail.inbox.is_empty(), "cancelled instance {id} kept signals");
        let kinds: Vec<&str> =
            detail.history.iter().rev().take(2).rev().map(|r| r.entry.kind.as_str()).collect();
        assert_eq!(kinds, ["CANCELLED", INBOX_DRAINED], "instance {id}");
        assert_eq!(detail.history.last().map(|r| &r.entry), Some(&entry), "instance {id}");
        assert_eq!(drain_entries(&detail), 1);
    }
    s.instance_cancel(cancel(quiet, false, at(50))).await.expect("cancel");
    assert_eq!(drain_entries(&get(s, quiet).await), 0, "an empty inbox leaves no entry");
    let before = get(s, parent).await;
    assert!(s.instance_cancel(cancel(parent, true, at(60))).await.expect("cancel").is_empty());
    assert_eq!(get(s, parent).await, before, "cancelling a terminal instance changed it");
}

/// A signal delivered to a terminal instance — by a client, with or without a dedup key,
/// or by another instance's outbox — is reported as `TargetTerminal` and not stored: the
/// instance, its inbox and its history stay as they were.
pub async fn signal_to_terminal_target_reported_not_stored<S: Store>(s: &S) {
    let ns = "signal_terminal";
    let finished = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, finished, at(10)).await;
    step(s, &claimed, done(), at(20)).await;
    let failed = insert_one(s, new_in(ns), at(21)).await;
    let claimed = claim_id(s, ns, failed, at(22)).await;
    step(s, &claimed, Outcome::Stop { reason: "no".into() }, at(23)).await;
    let before = (get(s, finished).await, get(s, failed).await);
    let out = deliver(
        s,
        vec![
            NewSignal::new(finished, "late").payload(json!(1)),
            NewSignal::new(finished, "late").dedup_key("k"),
            NewSignal::new(failed, "late"),
        ],
        at(30),
    )
    .await;
    assert_eq!(
        out,
        [
            DeliveryOutcome::TargetTerminal { target: finished, status: Status::Done },
            DeliveryOutcome::TargetTerminal { target: finished, status: Status::Done },
            DeliveryOutcome::TargetTerminal { target: failed, status: Status::Failed },
        ]
    );
    let sender = insert_one(s, new_in(ns), at(31)).await;
    let claimed = claim_id(s, ns, sender, at(32)).await;
    let emit = StepCommit::new(sender, claimed.token(), next("second", 1))
        .emit(NewSignal::new(finished, "ping"))
        .emit(NewSignal::new(failed, "ping").dedup_key("k"));
    commit_ok(s, emit, at(40)).await;
    assert_eq!(
        (get(s, finished).await, get(s, failed).await),
        before,
        "a delivery changed a terminal instance"
    );
}

/// A child's end notice to a parent that already ended (cancelled alone, or together with
/// it by a cascade) stores nothing, and neither does a broadcast over terminal instances.
pub async fn notices_and_broadcasts_to_terminal_instances_store_nothing<S: Store>(s: &S) {
    let ns = "terminal_notice";
    let family = |now: i64| async move {
        let parent = insert_one(s, new_in(ns), at(now)).await;
        let claimed = claim(s, claim_params(ns, 1, at(now + 1))).await.remove(0);
        assert_eq!(claimed.instance.id, parent, "claimed the new parent");
        let mut c = StepCommit::new(
            parent,
            claimed.token(),
            Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: None },
        );
        c.spawn = vec![new_in(ns).invoked_by("waiting").eligible_at(at(1_000_000))];
        (parent, commit_ok(s, c, at(now + 2)).await.spawned[0].id())
    };
    // Cancelled alone: the child runs on and finishes later.
    let (parent, kid) = family(0).await;
    s.instance_cancel(cancel(parent, false, at(10))).await.expect("cancel");
    let before = get(s, parent).await;
    let claimed = claim_id(s, ns, kid, at(2_000_000)).await;
    step(s, &claimed, done(), at(2_000_010)).await;
    let after = get(s, parent).await;
    assert!(after.inbox.is_empty(), "a notice was stored in a cancelled parent's inbox");
    assert_eq!(after.history, before.history, "a notice to a cancelled parent was recorded");

    // Cancelled together: the child's notice reaches a parent that is already cancelled.
    let (parent, kid) = family(3_000_000).await;
    let out = s.instance_cancel(cancel(parent, true, at(3_000_010))).await.expect("cancel");
    assert_eq!(out, vec![parent, kid]);
    let d = get(s, parent).await;
    assert!(d.inbox.is_empty(), "a cascade stored a notice in a cancelled parent's inbox");
    assert_eq!(drain_entries(&d), 0, "the parent's inbox was empty when it was cancelled");

    // Every instance of the namespace is terminal now: a broadcast reaches none.
    let params = SignalBroadcastParams {
        namespace: ns.into(),
        machine: "order".into(),
        in_state: None,
        name: "PRICE_CHANGED".into(),
        payload: json!({}),
        dedup_key: None,
        now: at(3_000_020),
    };
    let report = s.signal_broadcast(params).await.expect("broadcast");
    assert_eq!((report.delivered, report.woke), (0, 0));
    assert!(get(s, kid).await.inbox.is_empty(), "a broadcast stored a signal for a terminal child");
}
