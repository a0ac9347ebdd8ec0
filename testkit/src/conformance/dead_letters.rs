//! Contracts for retries and the dead-letter queue: exhaustion, retry by
//! id and by machine, skip, purge.

use super::support::{
    assert_history_tail, assert_row, at, claim, claim_id, claim_params, commit_ok, expect_kind,
    facts, failure, get, insert, insert_one, new_in, reference, row, send, suspend,
};
use keel_core::instance::HistoryEntry;
use keel_core::limits;
use keel_core::outcome::{self, Outcome, StepFailure};
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, CommitParams, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSelector, DeadLetterSkipParams,
};
use keel_core::{
    DeadLetterId, ErrorKind, InstanceId, MachineRef, NewInstance, Status, StepCommit, Timestamp,
};
use serde_json::json;
use std::time::Duration;

fn retry_params(
    selector: DeadLetterSelector,
    delay: Duration,
    now: Timestamp,
) -> DeadLetterRetryParams {
    DeadLetterRetryParams { selector, delay, now }
}

/// Inserts an instance of `machine` in `ns` and suspends it at `now`.
async fn suspended<S: Store>(
    s: &S,
    ns: &str,
    machine: &str,
    now: Timestamp,
) -> (InstanceId, DeadLetterId) {
    let id =
        insert_one(s, NewInstance::new(MachineRef::new(machine, 1), "start").namespace(ns), now)
            .await;
    let claimed = claim_id(s, ns, id, now).await;
    (id, suspend(s, &claimed, "boom", vec![], now).await)
}

/// Retries exhausted: `Retry` with backoff twice, then `Suspend`; the dead letter holds
/// every attempt's error; retrying it makes the instance runnable with attempt 0.
pub async fn retry_exhaustion_dead_letter_then_retry<S: Store>(s: &S) {
    let ns = "retry_exhaustion";
    let id = insert_one(s, new_in(ns).correlation_id("corr-1"), at(0)).await;
    let (sid, _) = send(s, id, "charge", at(1)).await;
    let mut now = at(10);
    for attempt in 0..2 {
        let c = claim_id(s, ns, id, now).await;
        assert_eq!(c.instance.attempt, attempt);
        let retry =
            Outcome::Retry { context: c.instance.context.clone(), delay: Duration::from_secs(1) };
        let fail = failure(&format!("boom {attempt}"), false, vec![sid]);
        commit_ok(s, StepCommit::new(id, c.token(), retry).failure(fail), now).await;
        now = now.plus(Duration::from_secs(1));
    }
    let last = claim_id(s, ns, id, now).await;
    assert_eq!(last.instance.attempt, 2);
    let fail = StepFailure {
        event: Some(json!({ "name": "charge" })),
        ..failure("boom 2", true, vec![sid])
    };
    let c = StepCommit::new(id, last.token(), Outcome::Suspend).failure(fail);
    let receipt = commit_ok(s, c.clone(), now).await;
    let want = reference(&last.instance, &c, facts(now));
    assert_row(&row(s, id).await, &want.row, "suspended row");
    let dl = receipt.dead_letter.expect("a dead letter id in the receipt");
    let letter = s.dead_letter_get(dl).await.expect("dead_letter_get");
    assert_eq!(
        letter.letter,
        want.dead_letter.expect("reference dead letter"),
        "dead letter content"
    );
    let errors: Vec<(i32, &str)> =
        letter.letter.errors.iter().map(|e| (e.attempt, e.error.as_str())).collect();
    assert_eq!(errors, vec![(0, "boom 0"), (1, "boom 1"), (2, "boom 2")]);
    assert_eq!((letter.letter.attempts, letter.letter.reason.as_str()), (3, "exhausted"));
    assert_eq!(letter.letter.correlation_id.as_deref(), Some("corr-1"));
    let listed = s
        .dead_letter_list(DeadLetterFilter {
            namespace: Some(ns.into()),
            ..DeadLetterFilter::default()
        })
        .await;
    assert_eq!(listed.expect("list").iter().map(|d| d.id).collect::<Vec<_>>(), vec![dl]);
    assert!(
        claim(s, claim_params(ns, 10, now.plus(Duration::from_hours(1)))).await.is_empty(),
        "a suspended row was claimed"
    );

    let later = now.plus(Duration::from_secs(10));
    let before = row(s, id).await;
    let retried = s
        .dead_letter_retry(retry_params(DeadLetterSelector::Id(dl), Duration::from_secs(5), later))
        .await;
    assert_eq!(retried.expect("retry"), vec![id]);
    let d = get(s, id).await;
    let expected = outcome::dead_letter_retry(&before, later.plus(Duration::from_secs(5)), later)
        .expect("reference retry");
    assert_row(&d.instance, &expected, "retried row");
    assert_eq!(d.history.last().map(|h| h.entry.kind.as_str()), Some("DEAD_LETTER_RETRIED"));
    expect_kind(s.dead_letter_get(dl).await, ErrorKind::NotFound, "a retried letter is removed");
    expect_kind(
        s.dead_letter_retry(retry_params(DeadLetterSelector::Id(dl), Duration::ZERO, later)).await,
        ErrorKind::NotFound,
        "retry twice",
    );
    assert!(
        claim(s, claim_params(ns, 10, later.plus(Duration::from_millis(4_999)))).await.is_empty(),
        "retried before its delay"
    );
    let again = claim_id(s, ns, id, later.plus(Duration::from_secs(5))).await;
    assert_eq!((again.instance.attempt, again.instance.errors.len()), (0, 0));
}

/// Retry by machine retries that machine's letters in that namespace and nothing else.
pub async fn dead_letter_retry_by_machine<S: Store>(s: &S) {
    let ns = "dlq_by_machine";
    let (b1, _) = suspended(s, ns, "billing", at(10)).await;
    let (b2, _) = suspended(s, ns, "billing", at(20)).await;
    let (o1, o1_letter) = suspended(s, ns, "order", at(30)).await;
    let (elsewhere, _) = suspended(s, "dlq_by_machine_other", "billing", at(40)).await;
    let selector = DeadLetterSelector::Machine { namespace: ns.into(), machine: "billing".into() };
    let mut retried =
        s.dead_letter_retry(retry_params(selector, Duration::ZERO, at(50))).await.expect("retry");
    retried.sort();
    assert_eq!(retried, vec![b1, b2]);
    for id in [b1, b2] {
        assert_eq!(row(s, id).await.status, Status::Runnable);
    }
    assert_eq!(row(s, o1).await.status, Status::Suspended, "another machine was retried");
    assert_eq!(row(s, elsewhere).await.status, Status::Suspended, "another namespace was retried");
    let left = s
        .dead_letter_list(DeadLetterFilter {
            namespace: Some(ns.into()),
            ..DeadLetterFilter::default()
        })
        .await;
    assert_eq!(left.expect("list").iter().map(|d| d.id).collect::<Vec<_>>(), vec![o1_letter]);
}

/// Machine-wide operations reach past a full batch of letters they do not act on. A
/// retry reaches a retryable letter behind letters whose instances moved on (here recorded
/// under `on_dead_letter = skip`: the step failed, the instance finished), which stay for
/// the operator; a purge by age reaches an old letter behind newer ones (letters carry the
/// time their worker committed them, which need not grow with their ids).
pub async fn dead_letter_machine_operations_reach_past_a_full_batch<S: Store>(s: &S) {
    let ns = "dlq_past_a_batch";
    let batch = limits::COMMIT_BATCH_MAX.min(limits::CLAIM_BATCH_MAX);
    let mut recorded = 0;
    while recorded < limits::DEAD_LETTER_BATCH_MAX {
        let n = batch.min(limits::DEAD_LETTER_BATCH_MAX - recorded);
        let news = (0..n).map(|_| NewInstance::new(MachineRef::new("billing", 1), "start"));
        insert(s, news.map(|new| new.namespace(ns)).collect(), at(1_000)).await;
        let claims = claim(s, claim_params(ns, n, at(1_001))).await;
        assert_eq!(claims.len(), n, "claimed the batch just inserted");
        let commits = claims
            .iter()
            .map(|c| {
                let done = Outcome::Done { result: json!(null), step: None };
                StepCommit::new(c.instance.id, c.token(), done).failure(failure(
                    "bad",
                    true,
                    vec![],
                ))
            })
            .collect();
        let receipts =
            s.step_commit(CommitParams { commits, now: at(1_002) }).await.expect("step_commit");
        for r in receipts {
            assert!(r.expect("commit accepted").dead_letter.is_some(), "a letter was recorded");
        }
        recorded += n;
    }
    let billing = DeadLetterSelector::Machine { namespace: ns.into(), machine: "billing".into() };

    let (stuck, letter) = suspended(s, ns, "billing", at(1_010)).await;
    let retried = s
        .dead_letter_retry(retry_params(billing.clone(), Duration::ZERO, at(1_020)))
        .await
        .expect("retry");
    assert_eq!(retried, vec![stuck], "the retryable letter behind the records was retried");
    assert_eq!(row(s, stuck).await.status, Status::Runnable);
    expect_kind(s.dead_letter_get(letter).await, ErrorKind::NotFound, "the retried letter goes");

    let (_, old) = suspended(s, ns, "billing", at(5)).await;
    let purged = s
        .dead_letter_purge(DeadLetterPurgeParams {
            selector: Some(billing),
            older_than: Some(at(500)),
            keep_suspended: false,
        })
        .await
        .expect("purge");
    assert_eq!(purged, 1, "the one letter older than the bound was purged");
    expect_kind(s.dead_letter_get(old).await, ErrorKind::NotFound, "the old letter goes");
    let first = s
        .dead_letter_list(DeadLetterFilter {
            namespace: Some(ns.into()),
            limit: 1,
            ..DeadLetterFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(first.len(), 1, "the records of instances that moved on are kept");
}

/// Skip consumes the signals the failed step was processing, keeps later ones, and
/// resumes the instance with attempt 0. A letter whose instance is no longer suspended
/// cannot be retried (`Conflict`).
pub async fn dead_letter_skip_consumes_signals<S: Store>(s: &S) {
    let ns = "dlq_skip";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let (e1, _) = send(s, id, "e1", at(1)).await;
    let (e2, _) = send(s, id, "e2", at(2)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let dl = suspend(s, &claimed, "bad event", vec![e1], at(20)).await;
    let skipped =
        s.dead_letter_skip(DeadLetterSkipParams { id: dl, now: at(30) }).await.expect("skip");
    assert_eq!(skipped, id);
    let d = get(s, id).await;
    assert_eq!(
        d.inbox.iter().map(|x| x.id).collect::<Vec<_>>(),
        vec![e2],
        "skip consumes exactly the letter's signals"
    );
    assert_eq!((d.instance.status, d.instance.attempt), (Status::Runnable, 0));
    let entry =
        HistoryEntry::new("DEAD_LETTER_SKIPPED", json!({ "dead_letter": dl, "signals": [e1] }));
    assert_history_tail(&d, &[entry], 0, "skip");
    expect_kind(s.dead_letter_get(dl).await, ErrorKind::NotFound, "a skipped letter is removed");
    expect_kind(
        s.dead_letter_skip(DeadLetterSkipParams { id: dl, now: at(31) }).await,
        ErrorKind::NotFound,
        "skip twice",
    );

    let (gone, letter) = suspended(s, "dlq_skip_cancelled", "order", at(40)).await;
    s.instance_cancel(CancelParams {
        id: gone,
        reason: "operator".into(),
        cascade: false,
        now: at(41),
        only_in: None,
    })
    .await
    .expect("cancel");
    expect_kind(
        s.dead_letter_retry(retry_params(DeadLetterSelector::Id(letter), Duration::ZERO, at(42)))
            .await,
        ErrorKind::Conflict,
        "retry of a cancelled instance",
    );
    assert_eq!(row(s, gone).await.status, Status::Cancelled);
}

/// A purge that keeps suspended instances (what retention runs) leaves each letter whose
/// instance is still suspended, since it is how that instance is retried, and purges the
/// letters whose instance was cancelled, finished or is gone, also behind a full batch of
/// kept letters; an operator's purge takes them all.
pub async fn a_purge_keeping_suspended_instances_leaves_the_letters_they_are_retried_by<
    S: Store,
>(
    s: &S,
) {
    let ns = "dlq_purge_keeps_suspended";
    let batch = limits::COMMIT_BATCH_MAX.min(limits::CLAIM_BATCH_MAX);
    let mut kept = 0;
    while kept < limits::DEAD_LETTER_BATCH_MAX {
        let n = batch.min(limits::DEAD_LETTER_BATCH_MAX - kept);
        let news = (0..n).map(|_| NewInstance::new(MachineRef::new("billing", 1), "start"));
        insert(s, news.map(|new| new.namespace(ns)).collect(), at(10)).await;
        let claims = claim(s, claim_params(ns, n, at(11))).await;
        assert_eq!(claims.len(), n, "claimed the batch just inserted");
        let commits = claims
            .iter()
            .map(|c| {
                StepCommit::new(c.instance.id, c.token(), Outcome::Suspend).failure(failure(
                    "bad",
                    true,
                    vec![],
                ))
            })
            .collect();
        let receipts =
            s.step_commit(CommitParams { commits, now: at(12) }).await.expect("step_commit");
        for r in receipts {
            assert!(r.expect("commit accepted").dead_letter.is_some(), "a letter was recorded");
        }
        kept += n;
    }
    let (stuck, stuck_letter) = suspended(s, ns, "billing", at(20)).await;
    let (given_up, given_up_letter) = suspended(s, ns, "billing", at(20)).await;
    s.instance_cancel(CancelParams {
        id: given_up,
        reason: "gave up".into(),
        cascade: false,
        now: at(30),
        only_in: None,
    })
    .await
    .expect("cancel");
    let billing = DeadLetterSelector::Machine { namespace: ns.into(), machine: "billing".into() };
    let retention = DeadLetterPurgeParams {
        selector: Some(billing.clone()),
        older_than: Some(at(500)),
        keep_suspended: true,
    };
    assert_eq!(
        s.dead_letter_purge(retention.clone()).await.expect("purge"),
        1,
        "only the cancelled instance's letter goes, behind a full batch of kept ones"
    );
    expect_kind(s.dead_letter_get(given_up_letter).await, ErrorKind::NotFound, "it went");
    assert_eq!(s.dead_letter_get(stuck_letter).await.expect("kept").letter.instance, stuck);
    assert_eq!(s.dead_letter_purge(retention).await.expect("purge"), 0, "nothing more to take");
    let by_hand = |id| DeadLetterPurgeParams {
        selector: Some(DeadLetterSelector::Id(id)),
        older_than: None,
        keep_suspended: false,
    };
    assert_eq!(s.dead_letter_purge(by_hand(stuck_letter)).await.expect("purge"), 1);
    assert_eq!(row(s, stuck).await.status, Status::Suspended, "a purge leaves instances alone");
}

/// Purge removes letters older than the cutoff (by selector too) and leaves instances
/// alone.
pub async fn dead_letter_purge_older_than<S: Store>(s: &S) {
    let ns = "dlq_purge";
    let (i1, _) = suspended(s, ns, "billing", at(10)).await;
    let (_, l2) = suspended(s, ns, "billing", at(20)).await;
    let (_, l3) = suspended(s, ns, "order", at(30)).await;
    let purge = |selector, older_than| DeadLetterPurgeParams {
        selector,
        older_than,
        keep_suspended: false,
    };
    assert_eq!(
        s.dead_letter_purge(purge(None, Some(at(20)))).await.expect("purge"),
        1,
        "only strictly older letters"
    );
    let list = || {
        s.dead_letter_list(DeadLetterFilter {
            namespace: Some(ns.into()),
            ..DeadLetterFilter::default()
        })
    };
    assert_eq!(list().await.expect("list").iter().map(|d| d.id).collect::<Vec<_>>(), vec![l2, l3]);
    assert_eq!(row(s, i1).await.status, Status::Suspended, "purge touched an instance");
    let by_machine = DeadLetterSelector::Machine { namespace: ns.into(), machine: "order".into() };
    assert_eq!(s.dead_letter_purge(purge(Some(by_machine), None)).await.expect("purge"), 1);
    assert_eq!(
        s.dead_letter_purge(purge(Some(DeadLetterSelector::Id(l2)), Some(at(20))))
            .await
            .expect("purge"),
        0,
        "not older than the cutoff"
    );
    assert_eq!(
        s.dead_letter_purge(purge(Some(DeadLetterSelector::Id(l2)), None)).await.expect("purge"),
        1
    );
    assert!(list().await.expect("list").is_empty());
}
