//! Contracts for step commits: every row of the outcome table against
//! `keel_core::outcome::apply`, fencing, per-item acceptance and validation.

use super::support::{
    LEASE, assert_history_tail, assert_row, at, await_signal, claim, claim_id, claim_params,
    commit, commit_ok, ctx, done, expect_kind, failure, get, ids, insert, insert_one, new_in, next,
    reap, reference, row, send,
};
use keel_core::instance::NewSignal;
use keel_core::outcome::{ApplyFacts, Outcome};
use keel_core::ports::Store;
use keel_core::ports::store::{
    Claim, CommitParams, DeadLetterFilter, InsertOutcome, InstanceDetail, LeaseReleaseParams,
};
use keel_core::{ErrorKind, InstanceId, Status, StepCommit};
use serde_json::json;
use std::time::Duration;

/// Inserts and claims a fresh instance in `ns`, commits `build(claim)` at `at(20)` and
/// checks the stored row, the receipt and the history against the reference.
async fn check_outcome<S: Store>(
    s: &S,
    ns: &str,
    build: impl FnOnce(&Claim) -> StepCommit,
) -> (Claim, InstanceDetail) {
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let c = build(&claimed);
    let receipt = commit_ok(s, c.clone(), at(20)).await;
    let inserted =
        receipt.children.iter().filter(|r| matches!(r, InsertOutcome::Inserted(_))).count();
    let want = reference(
        &claimed.instance,
        &c,
        ApplyFacts { now: at(20), signal_waiting: false, children_inserted: inserted as i32 },
    );
    let detail = get(s, id).await;
    let what = format!("{} outcome", c.outcome.name());
    assert_row(&detail.instance, &want.row, &what);
    assert_eq!(receipt.id, id, "{what}: receipt id");
    assert_eq!(receipt.revision, want.row.revision, "{what}: receipt revision");
    assert_eq!(receipt.status, want.row.status, "{what}: receipt status");
    assert_history_tail(&detail, &want.history, claimed.instance.attempt, &what);
    assert!(
        detail
            .history
            .iter()
            .rev()
            .take(want.history.len())
            .all(|h| h.revision == want.row.revision),
        "{what}: history rows carry the revision after the commit"
    );
    (claimed, detail)
}

/// `Next`: new step and context, runnable now, attempt 0, revision + 1, lease cleared.
pub async fn outcome_next_matches_reference<S: Store>(s: &S) {
    let ns = "outcome_next";
    let (_, d) =
        check_outcome(s, ns, |c| StepCommit::new(c.instance.id, c.token(), next("second", 1)))
            .await;
    assert_eq!((d.instance.status, d.instance.position.as_str()), (Status::Runnable, "second"));
    let again = claim_id(s, ns, d.instance.id, at(20)).await;
    assert_eq!((again.instance.attempt, again.instance.context.clone()), (0, ctx(1)));
}

/// `Retry`: same step, attempt + 1, not claimable before `now + delay`.
pub async fn outcome_retry_matches_reference<S: Store>(s: &S) {
    let ns = "outcome_retry";
    let (_, d) = check_outcome(s, ns, |c| {
        StepCommit::new(
            c.instance.id,
            c.token(),
            Outcome::Retry { context: ctx(7), delay: Duration::from_secs(5) },
        )
        .failure(failure("flaky", false, vec![]))
    })
    .await;
    assert_eq!(d.instance.eligible_at, at(5_020));
    assert_eq!(d.instance.attempt, 1);
    assert!(claim(s, claim_params(ns, 10, at(5_019))).await.is_empty(), "claimed before its delay");
    let again = claim_id(s, ns, d.instance.id, at(5_020)).await;
    assert_eq!((again.instance.attempt, again.instance.position.as_str()), (1, "start"));
}

/// `Await` with an empty inbox parks the instance: not claimable until a signal comes.
pub async fn outcome_await_parks_matches_reference<S: Store>(s: &S) {
    let ns = "outcome_await";
    let (_, d) = check_outcome(s, ns, |c| {
        StepCommit::new(c.instance.id, c.token(), await_signal("paid", 2))
    })
    .await;
    assert_eq!(
        (d.instance.status, d.instance.awaits.as_deref()),
        (Status::AwaitingSignal, Some("paid"))
    );
    assert!(
        claim(s, claim_params(ns, 10, at(60_000))).await.is_empty(),
        "a parked instance was claimed"
    );
}

/// `ScheduleChildren`: children inserted with `parent` set, parent parked on the barrier.
pub async fn outcome_schedule_children_matches_reference<S: Store>(s: &S) {
    let ns = "outcome_children";
    let kids = vec![new_in(ns).context(json!({ "k": 1 })), new_in(ns).context(json!({ "k": 2 }))];
    let (_, d) = check_outcome(s, ns, |c| {
        let outcome = Outcome::ScheduleChildren {
            next: "join".into(),
            children: kids,
            context: ctx(3),
            join: keel_core::join::Join::default(),
        };
        StepCommit::new(c.instance.id, c.token(), outcome)
    })
    .await;
    assert_eq!((d.instance.status, d.instance.children_pending), (Status::AwaitingChildren, 2));
    assert_eq!(d.children.len(), 2, "both children listed under the parent");
    for child in &d.children {
        let child_row = row(s, child.id).await;
        assert_eq!(child_row.parent, Some(d.instance.id));
        assert_eq!(child_row.status, Status::Runnable);
    }
    let claimed = claim(s, claim_params(ns, 10, at(20))).await;
    assert_eq!(
        ids(&claimed),
        d.children.iter().map(|c| c.id).collect::<Vec<_>>(),
        "children are runnable, the parent is not"
    );
}

/// `Done`: terminal with the result; the context is not rewritten; with a step, the
/// position moves there.
pub async fn outcome_done_matches_reference<S: Store>(s: &S) {
    let (_, d) =
        check_outcome(s, "outcome_done", |c| StepCommit::new(c.instance.id, c.token(), done()))
            .await;
    assert_eq!(
        (d.instance.status, d.instance.result.clone()),
        (Status::Done, Some(json!({ "ok": true })))
    );
    assert_eq!(d.instance.context, ctx(0));
    // With a step, the instance finishes there: a chart's final configuration.
    let final_position = r#"["rejected"]"#;
    let (_, d) = check_outcome(s, "outcome_done_at", |c| {
        let outcome = Outcome::Done { result: json!(1), step: Some(final_position.into()) };
        StepCommit::new(c.instance.id, c.token(), outcome)
    })
    .await;
    assert_eq!((d.instance.status, d.instance.position.as_str()), (Status::Done, final_position));
}

/// `Stop`: terminal `failed` with `last_error`.
pub async fn outcome_stop_matches_reference<S: Store>(s: &S) {
    let (_, d) = check_outcome(s, "outcome_stop", |c| {
        StepCommit::new(c.instance.id, c.token(), Outcome::Stop { reason: "card declined".into() })
    })
    .await;
    assert_eq!(
        (d.instance.status, d.instance.last_error.as_deref()),
        (Status::Failed, Some("card declined"))
    );
}

/// `Suspend` (retries exhausted): suspended, not claimable, a dead letter stored.
pub async fn outcome_suspend_matches_reference<S: Store>(s: &S) {
    let ns = "outcome_suspend";
    let (claimed, d) = check_outcome(s, ns, |c| {
        StepCommit::new(c.instance.id, c.token(), Outcome::Suspend).failure(failure(
            "gave up",
            true,
            vec![],
        ))
    })
    .await;
    assert_eq!(
        (d.instance.status, d.instance.last_error.as_deref()),
        (Status::Suspended, Some("gave up"))
    );
    assert!(
        claim(s, claim_params(ns, 10, at(60_000))).await.is_empty(),
        "a suspended instance was claimed"
    );
    let letters = s
        .dead_letter_list(DeadLetterFilter {
            namespace: Some(ns.into()),
            ..DeadLetterFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].letter.instance, claimed.instance.id);
    assert_eq!(letters[0].created_at, at(20));
}

/// A commit with a stale fencing token is `LeaseLost` and changes nothing anywhere: not
/// the row, not its inbox, not its history, not the targets of its emits.
pub async fn stale_token_rejected_nothing_changed<S: Store>(s: &S) {
    let ns = "stale_token";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let other = insert_one(s, new_in(ns).eligible_at(at(1_000_000)), at(0)).await;
    let (sid, _) = send(s, id, "paid", at(1)).await;
    let old = claim_id(s, ns, id, at(10)).await;
    assert_eq!(reap(s, at(10).plus(LEASE).plus(Duration::from_millis(1))).await, vec![id]);
    let current = claim_id(s, ns, id, at(40_000)).await;
    assert!(current.token() > old.token(), "every claim gets a larger fencing token");
    let before = (get(s, id).await, get(s, other).await);
    let stale = StepCommit::new(id, old.token(), next("second", 9))
        .consume([sid])
        .emit(NewSignal::new(other, "hello"));
    expect_kind(commit(s, stale, at(40_001)).await, ErrorKind::LeaseLost, "stale commit");
    let stale_done = StepCommit::new(id, old.token(), done());
    expect_kind(commit(s, stale_done, at(40_002)).await, ErrorKind::LeaseLost, "stale done");
    assert_eq!(
        (get(s, id).await, get(s, other).await),
        before,
        "a rejected commit changed something"
    );
    let missing = StepCommit::new(InstanceId(i64::MAX), current.token(), done());
    expect_kind(
        commit(s, missing, at(40_002)).await,
        ErrorKind::NotFound,
        "commit to a missing instance",
    );
    let ok = commit_ok(
        s,
        StepCommit::new(id, current.token(), next("second", 1)).consume([sid]),
        at(40_003),
    )
    .await;
    assert_eq!(ok.status, Status::Runnable, "the live claim still commits");
}

/// In one batch each commit is accepted or rejected on its own.
pub async fn batch_commit_one_stale_others_succeed<S: Store>(s: &S) {
    let ns = "batch_commit";
    let outs = insert(s, vec![new_in(ns), new_in(ns), new_in(ns)], at(0)).await;
    let claims = claim(s, claim_params(ns, 10, at(10))).await;
    assert_eq!(ids(&claims), outs.iter().map(|o| o.id()).collect::<Vec<_>>());
    let released = s
        .lease_release(LeaseReleaseParams {
            leases: vec![(claims[1].instance.id, claims[1].token())],
            now: at(15),
        })
        .await
        .expect("release");
    assert_eq!(released, vec![true]);
    let before_stale = get(s, claims[1].instance.id).await;
    let commits = vec![
        StepCommit::new(claims[0].instance.id, claims[0].token(), next("second", 1)),
        StepCommit::new(claims[1].instance.id, claims[1].token(), next("second", 1)),
        StepCommit::new(claims[2].instance.id, claims[2].token(), done()),
    ];
    let results = s.step_commit(CommitParams { commits, now: at(20) }).await.expect("step_commit");
    assert_eq!(results.len(), 3);
    assert_eq!(results[0].as_ref().map(|r| r.status), Ok(Status::Runnable));
    assert_eq!(results[1].as_ref().map_err(|e| e.kind), Err(ErrorKind::LeaseLost));
    assert_eq!(results[2].as_ref().map(|r| r.status), Ok(Status::Done));
    assert_eq!(get(s, claims[1].instance.id).await, before_stale, "the rejected item changed");
    assert_eq!(row(s, claims[0].instance.id).await.position, "second");
    assert_eq!(row(s, claims[2].instance.id).await.status, Status::Done);
}

/// A group commit with one refused item of every kind between good items: each refused
/// item gets its own error (naming the field) and changes nothing, and every good item
/// commits — a store never fails the whole call, and never drops a neighbour, for one
/// bad result.
pub async fn batch_commit_refused_items_do_not_drop_their_neighbours<S: Store>(s: &S) {
    const MISSING: InstanceId = InstanceId(i64::MAX - 7);
    type Build = fn(StepCommit) -> StepCommit;
    let ns = "batch_refused";
    let huge = json!({ "blob": "x".repeat(keel_core::limits::PAYLOAD_BYTES_MAX) });
    #[rustfmt::skip]
    let refusals: [(&str, Outcome, Build, ErrorKind, &str); 5] = [
        ("context over the size limit", Outcome::Next { step: "x".into(), context: huge }, |c| c, ErrorKind::Invalid, "outcome.context"),
        ("context not an object", Outcome::Next { step: "x".into(), context: json!([1]) }, |c| c, ErrorKind::Invalid, "outcome.context"),
        ("empty step name", Outcome::Next { step: String::new(), context: ctx(1) }, |c| c, ErrorKind::Invalid, "outcome.step"),
        ("NUL in the context", Outcome::Next { step: "x".into(), context: json!({ "s": "a\u{0}b" }) }, |c| c, ErrorKind::Invalid, "outcome.context"),
        ("emit to a missing instance", done(), |c| c.emit(NewSignal::new(MISSING, "ping")), ErrorKind::NotFound, "emit[0].target"),
    ];
    let news = (0..=refusals.len() * 2).map(|_| new_in(ns)).collect();
    insert(s, news, at(0)).await;
    let claims = claim(s, claim_params(ns, 20, at(10))).await;
    assert_eq!(claims.len(), refusals.len() * 2 + 1);
    // Good, bad, good, bad, …, good.
    let mut commits = Vec::new();
    for (i, c) in claims.iter().enumerate() {
        let commit = StepCommit::new(c.instance.id, c.token(), next("second", 1));
        commits.push(match refusals.get(i / 2) {
            Some((_, outcome, build, _, _)) if i % 2 == 1 => {
                build(StepCommit::new(c.instance.id, c.token(), outcome.clone()))
            }
            _ => commit,
        });
    }
    let before: Vec<InstanceDetail> = {
        let mut v = Vec::new();
        for c in &claims {
            v.push(get(s, c.instance.id).await);
        }
        v
    };
    let results = s
        .step_commit(CommitParams { commits, now: at(20) })
        .await
        .expect("one refused item must not fail the whole call");
    assert_eq!(results.len(), claims.len(), "one result per item");
    for (i, result) in results.iter().enumerate() {
        let id = claims[i].instance.id;
        match refusals.get(i / 2) {
            Some((what, _, _, kind, field)) if i % 2 == 1 => {
                let err = result.as_ref().expect_err(what);
                assert_eq!(err.kind, *kind, "{what}: {}", err.message);
                assert!(
                    err.message.contains(field),
                    "{what}: the message names {field}: {}",
                    err.message
                );
                assert_eq!(get(s, id).await, before[i], "{what}: the refused item changed its row");
            }
            _ => {
                assert_eq!(
                    result.as_ref().map(|r| r.status),
                    Ok(Status::Runnable),
                    "item {i}, a good neighbour of refused items, commits"
                );
                assert_eq!(row(s, id).await.position, "second", "item {i}");
            }
        }
    }
}

/// An invalid outcome (context not an object) is rejected as `Invalid` with nothing of
/// that item written — no consumption, no emit — while the rest of the batch commits.
pub async fn invalid_outcome_rejected_without_partial_write<S: Store>(s: &S) {
    let ns = "invalid_outcome";
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns), at(0)).await;
    let target = insert_one(s, new_in(ns).eligible_at(at(1_000_000)), at(0)).await;
    let (sid, _) = send(s, a, "e", at(1)).await;
    let claims = claim(s, claim_params(ns, 2, at(10))).await;
    assert_eq!(ids(&claims), vec![a, b]);
    let before = (get(s, a).await, get(s, target).await);
    let bad = StepCommit::new(
        a,
        claims[0].token(),
        Outcome::Next { step: "x".into(), context: json!(5) },
    )
    .consume([sid])
    .emit(NewSignal::new(target, "ping"));
    let good = StepCommit::new(b, claims[1].token(), next("second", 1));
    let results = s
        .step_commit(CommitParams { commits: vec![bad, good], now: at(20) })
        .await
        .expect("step_commit");
    let err = results[0].as_ref().expect_err("a non-object context is rejected");
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.contains("context"), "the message names the field: {}", err.message);
    assert!(results[1].is_ok(), "the valid item commits");
    assert_eq!((get(s, a).await, get(s, target).await), before, "the invalid item wrote something");
    let empty_step = StepCommit::new(
        a,
        claims[0].token(),
        Outcome::Next { step: String::new(), context: ctx(1) },
    );
    expect_kind(commit(s, empty_step, at(21)).await, ErrorKind::Invalid, "empty step name");
    let fixed = StepCommit::new(a, claims[0].token(), next("second", 1)).consume([sid]);
    assert_eq!(
        commit_ok(s, fixed, at(22)).await.status,
        Status::Runnable,
        "the claim survives a rejected item"
    );
    assert!(get(s, a).await.inbox.is_empty());
}
