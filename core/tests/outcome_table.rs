//! The outcome table as data: each row is an instance, an outcome and the
//! commit-time facts, and the fields of the row that the reference transition produces.

use keel_core::ids::{FencingToken, InstanceId, MachineRef, Revision, SignalId, Status, WorkerId};
use keel_core::inbox;
use keel_core::instance::{AttemptError, Instance, NewInstance};
use keel_core::outcome::{self, ApplyFacts, Outcome, StepCommit, StepFailure};
use keel_core::time::Timestamp;
use serde_json::{Value, json};
use std::time::Duration;

const NOW: Timestamp = Timestamp(1_000_000);

/// One table row: name, row before, outcome, failure, (signal waiting, children inserted), expected.
type Case = (&'static str, Instance, Outcome, Option<StepFailure>, (bool, i32), Row);

/// The fields of a row that an outcome may change.
#[derive(Debug, PartialEq)]
struct Row {
    status: Status,
    position: &'static str,
    attempt: i32,
    eligible_at: i64,
    awaits: Option<&'static str>,
    children_pending: i32,
    context: Value,
    result: Option<Value>,
    last_error: Option<&'static str>,
    errors: usize,
    history: Vec<String>,
    dead_letter: bool,
}

fn executing(attempt: i32, errors: usize) -> Instance {
    let new = NewInstance::new(MachineRef::new("m", 1), "a").context(json!({"n": 0}));
    let mut row = Instance::from_new(InstanceId(7), &new, None, Timestamp(0));
    row = outcome::claim(&row, &WorkerId("w".into()), Duration::from_secs(30), Timestamp(500));
    row.attempt = attempt;
    row.awaits = Some("old".into());
    row.errors = (0..errors)
        .map(|i| AttemptError {
            attempt: i as i32,
            error: format!("e{i}"),
            at: Timestamp(i as i64),
        })
        .collect();
    row
}

fn failure(dead_letter: bool, retryable: bool) -> StepFailure {
    StepFailure {
        error: "boom".into(),
        retryable,
        dead_letter,
        signals: vec![SignalId(3)],
        event: Some(json!({"name": "PAY"})),
    }
}

fn check(
    row: &Instance,
    outcome: Outcome,
    failure: Option<StepFailure>,
    facts: (bool, i32),
    expected: &Row,
) {
    let mut commit = StepCommit::new(row.id, row.fencing_token, outcome);
    commit.failure = failure;
    outcome::validate_commit(row, &commit).expect("valid commit");
    let facts = ApplyFacts { now: NOW, signal_waiting: facts.0, children_inserted: facts.1 };
    let applied = outcome::apply(row, &commit, facts);
    // Stores decide which inboxes to read for a drain before they apply anything.
    assert_eq!(inbox::drains(&commit.outcome), applied.became_terminal(), "inbox::drains");
    let got = &applied.row;
    let actual = Row {
        status: got.status,
        position: expected.position,
        attempt: got.attempt,
        eligible_at: got.eligible_at.0,
        awaits: expected.awaits,
        children_pending: got.children_pending,
        context: got.context.clone(),
        result: got.result.clone(),
        last_error: expected.last_error,
        errors: got.errors.len(),
        history: applied.history.iter().map(|h| h.kind.clone()).collect(),
        dead_letter: applied.dead_letter.is_some(),
    };
    assert_eq!(got.position, expected.position, "position");
    assert_eq!(got.awaits.as_deref(), expected.awaits, "awaits");
    assert_eq!(got.last_error.as_deref(), expected.last_error, "last_error");
    assert_eq!(&actual, expected);
    // Every accepted commit: one more revision, the lease gone, the token unchanged.
    assert_eq!(got.revision, Revision(row.revision.0 + 1));
    assert_eq!((got.lease_owner.clone(), got.lease_expires_at), (None, None));
    assert_eq!(got.fencing_token, row.fencing_token);
    assert_eq!(got.updated_at, NOW);
}

fn hist(kinds: &[&str]) -> Vec<String> {
    kinds.iter().map(|k| (*k).to_owned()).collect()
}

fn ctx(n: i64) -> Value {
    json!({ "n": n })
}

#[test]
fn outcome_table() {
    let base = |status, position, attempt, eligible_at| Row {
        status,
        position,
        attempt,
        eligible_at,
        awaits: None,
        children_pending: 0,
        context: ctx(1),
        result: None,
        last_error: None,
        errors: 0,
        history: vec![],
        dead_letter: false,
    };
    let next = Outcome::Next { step: "b".into(), context: ctx(1) };
    let cases: Vec<Case> = vec![
        (
            "next: move, runnable now, attempt reset",
            executing(2, 2),
            next.clone(),
            None,
            (false, 0),
            Row { history: hist(&["STEP_NEXT"]), ..base(Status::Runnable, "b", 0, NOW.0) },
        ),
        (
            "retry: same step, attempt + 1, eligible after delay, what it awaited kept",
            executing(1, 0),
            Outcome::Retry { context: ctx(1), delay: Duration::from_secs(4) },
            None,
            (false, 0),
            Row {
                awaits: Some("old"),
                history: hist(&["STEP_RETRY"]),
                ..base(Status::Runnable, "a", 2, NOW.0 + 4000)
            },
        ),
        (
            "retry after an error keeps the error of the attempt",
            executing(1, 1),
            Outcome::Retry { context: ctx(1), delay: Duration::from_secs(2) },
            Some(failure(false, true)),
            (false, 0),
            Row {
                errors: 2,
                awaits: Some("old"),
                history: hist(&["STEP_RETRY"]),
                ..base(Status::Runnable, "a", 2, NOW.0 + 2000)
            },
        ),
        (
            "await with nothing waiting: park",
            executing(0, 0),
            Outcome::Await { signal: "PAID".into(), context: ctx(1), step: None },
            None,
            (false, 0),
            Row {
                awaits: Some("PAID"),
                history: hist(&["STEP_AWAIT"]),
                ..base(Status::AwaitingSignal, "a", 0, NOW.0)
            },
        ),
        (
            "await with a matching signal already in the inbox: runnable (no lost wake-up)",
            executing(0, 0),
            Outcome::Await { signal: "PAID".into(), context: ctx(1), step: None },
            None,
            (true, 0),
            Row {
                awaits: Some("PAID"),
                history: hist(&["STEP_AWAIT"]),
                ..base(Status::Runnable, "a", 0, NOW.0)
            },
        ),
        (
            "await with a step: move there and park (a chart between events)",
            executing(1, 1),
            Outcome::Await { signal: "*".into(), context: ctx(1), step: Some("b".into()) },
            None,
            (false, 0),
            Row {
                awaits: Some("*"),
                history: hist(&["STEP_AWAIT"]),
                ..base(Status::AwaitingSignal, "b", 0, NOW.0)
            },
        ),
        (
            "schedule children: park on the barrier at the next step",
            executing(1, 0),
            Outcome::ScheduleChildren {
                next: "join".into(),
                children: vec![NewInstance::new(MachineRef::new("c", 1), "start")],
                context: ctx(1),
                join: keel_core::join::Join::default(),
            },
            None,
            (false, 3),
            Row {
                children_pending: 3,
                history: hist(&["STEP_SCHEDULE_CHILDREN"]),
                ..base(Status::AwaitingChildren, "join", 0, NOW.0)
            },
        ),
        (
            "schedule children with zero inserted: runnable at the next step at once",
            executing(0, 0),
            Outcome::ScheduleChildren {
                next: "join".into(),
                children: vec![],
                context: ctx(1),
                join: keel_core::join::Join::default(),
            },
            None,
            (false, 0),
            Row {
                history: hist(&["STEP_SCHEDULE_CHILDREN"]),
                ..base(Status::Runnable, "join", 0, NOW.0)
            },
        ),
        (
            "done: terminal, result stored, context untouched",
            executing(0, 0),
            Outcome::Done { result: json!({"ok": true}), step: None },
            None,
            (false, 0),
            Row {
                context: ctx(0),
                result: Some(json!({"ok": true})),
                history: hist(&["STEP_DONE"]),
                ..base(Status::Done, "a", 0, 0)
            },
        ),
        (
            "done with a step: finish there (a chart at its final configuration)",
            executing(1, 1),
            Outcome::Done { result: json!({"ok": true}), step: Some("[\"rejected\"]".into()) },
            None,
            (false, 0),
            Row {
                context: ctx(0),
                result: Some(json!({"ok": true})),
                history: hist(&["STEP_DONE"]),
                ..base(Status::Done, "[\"rejected\"]", 1, 0)
            },
        ),
        (
            "stop: terminal failed with the reason",
            executing(0, 0),
            Outcome::Stop { reason: "card declined".into() },
            None,
            (false, 0),
            Row {
                context: ctx(0),
                last_error: Some("card declined"),
                history: hist(&["STEP_STOP"]),
                ..base(Status::Failed, "a", 0, 0)
            },
        ),
        (
            "suspend at exhaustion: suspended, dead letter with every attempt's error",
            executing(2, 2),
            Outcome::Suspend,
            Some(failure(true, true)),
            (false, 0),
            Row {
                context: ctx(0),
                last_error: Some("boom"),
                errors: 3,
                awaits: Some("old"),
                history: hist(&["STEP_SUSPENDED", "DEAD_LETTERED"]),
                dead_letter: true,
                ..base(Status::Suspended, "a", 2, 0)
            },
        ),
        (
            "skip mode: progress and still dead-letter the failed event",
            executing(2, 2),
            next,
            Some(failure(true, false)),
            (false, 0),
            Row {
                history: hist(&["STEP_NEXT", "DEAD_LETTERED"]),
                dead_letter: true,
                ..base(Status::Runnable, "b", 0, NOW.0)
            },
        ),
    ];
    for (name, row, outcome, failure, facts, expected) in cases {
        eprintln!("case: {name}");
        check(&row, outcome, failure, facts, &expected);
    }
}

#[test]
fn dead_letter_carries_everything_needed_to_replay() {
    let row = executing(2, 2);
    let mut commit = StepCommit::new(row.id, row.fencing_token, Outcome::Suspend);
    commit.failure = Some(failure(true, true));
    let facts = ApplyFacts { now: NOW, signal_waiting: false, children_inserted: 0 };
    let letter = outcome::apply(&row, &commit, facts).dead_letter.expect("dead letter");
    assert_eq!(letter.instance, row.id);
    assert_eq!(letter.reason, "exhausted");
    assert_eq!(letter.attempts, 3);
    assert_eq!(letter.signals, vec![SignalId(3)]);
    assert_eq!(letter.event, Some(json!({"name": "PAY"})));
    assert_eq!(
        letter.errors.iter().map(|e| e.error.as_str()).collect::<Vec<_>>(),
        ["e0", "e1", "boom"]
    );
    assert_eq!((letter.first_attempt_at, letter.last_attempt_at), (Timestamp(0), NOW));

    commit.failure = Some(failure(true, false));
    let letter = outcome::apply(&row, &commit, facts).dead_letter.expect("dead letter");
    assert_eq!(letter.reason, "non_retryable");
}

#[test]
fn fencing_and_shape_are_checked_before_anything_changes() {
    let row = executing(0, 0);
    let stale = StepCommit::new(
        row.id,
        FencingToken(row.fencing_token.0 - 1),
        Outcome::Done { result: json!(1), step: None },
    );
    let err = outcome::validate_commit(&row, &stale).unwrap_err();
    assert_eq!(err.kind, keel_core::ErrorKind::LeaseLost);

    let bad = StepCommit::new(
        row.id,
        row.fencing_token,
        Outcome::Next { step: "b".into(), context: json!([1]) },
    );
    let err = outcome::validate_commit(&row, &bad).unwrap_err();
    assert_eq!(err.kind, keel_core::ErrorKind::Invalid);
    assert!(err.message.contains("outcome.context: must be a JSON object"), "{}", err.message);

    let nameless = StepCommit::new(
        row.id,
        row.fencing_token,
        Outcome::Done { result: json!(1), step: Some(String::new()) },
    );
    let err = outcome::validate_commit(&row, &nameless).unwrap_err();
    assert_eq!(err.kind, keel_core::ErrorKind::Invalid);
    assert!(err.message.contains("outcome.step"), "{}", err.message);

    let suspend = StepCommit::new(row.id, row.fencing_token, Outcome::Suspend);
    let err = outcome::validate_commit(&row, &suspend).unwrap_err();
    assert!(err.message.contains("Suspend needs a failure"), "{}", err.message);

    let mut not_executing = row.clone();
    not_executing.status = Status::Runnable;
    let done =
        StepCommit::new(row.id, row.fencing_token, Outcome::Done { result: json!(1), step: None });
    assert_eq!(
        outcome::validate_commit(&not_executing, &done).unwrap_err().kind,
        keel_core::ErrorKind::LeaseLost
    );
}

/// Row transitions outside commits: (name, before, after).
#[test]
fn lifecycle_table() {
    let worker = WorkerId("w".into());
    let claimed = executing(1, 0);
    let t = claimed.fencing_token.0;

    let reaped = outcome::reap(&claimed, NOW);
    assert_eq!(
        (reaped.status, reaped.attempt, reaped.eligible_at, reaped.lease_owner.clone()),
        (Status::Runnable, 2, NOW, None)
    );

    let released = outcome::release(&claimed, NOW);
    assert_eq!((released.status, released.attempt), (Status::Runnable, 1));

    let reclaimed = outcome::claim(&reaped, &worker, Duration::from_secs(10), NOW);
    assert_eq!(reclaimed.fencing_token, FencingToken(t + 1), "every claim bumps the token");
    assert_eq!(reclaimed.lease_expires_at, Some(NOW.plus(Duration::from_secs(10))));
    assert!(!outcome::lease_expired(&reclaimed, NOW.plus(Duration::from_secs(10))));
    assert!(outcome::lease_expired(&reclaimed, NOW.plus(Duration::from_millis(10_001))));

    let mut parked = claimed.clone();
    parked.status = Status::AwaitingSignal;
    parked.awaits = Some("PAID".into());
    let mut other = parked.clone();
    assert!(!outcome::deliver(&mut other, "OTHER", NOW), "other names leave it parked");
    assert_eq!(other, parked, "a signal that does not wake changes nothing");
    let mut woke = parked.clone();
    assert!(outcome::deliver(&mut woke, "PAID", NOW), "wakes");
    assert_eq!((woke.status, woke.awaits.as_deref()), (Status::Runnable, Some("PAID")));
    parked.awaits = Some("*".into());
    assert!(outcome::deliver(&mut parked, "ANYTHING", NOW), "* wakes on any signal");

    let mut parent = claimed.clone();
    parent.status = Status::AwaitingChildren;
    parent.children_pending = 2;
    let one = outcome::release_parent(&parent, NOW);
    assert_eq!((one.status, one.children_pending), (Status::AwaitingChildren, 1));
    let two = outcome::release_parent(&one, NOW);
    assert_eq!((two.status, two.children_pending), (Status::Runnable, 0));
    let three = outcome::release_parent(&two, NOW);
    assert_eq!((three.status, three.children_pending), (Status::Runnable, 0), "never negative");

    let cancelled = outcome::cancel(&claimed, "operator", NOW).expect("cancels");
    assert_eq!(
        (cancelled.status, cancelled.last_error.as_deref()),
        (Status::Cancelled, Some("operator"))
    );
    assert!(outcome::cancel(&cancelled, "again", NOW).is_none(), "terminal rows stay as they are");

    let mut suspended = claimed.clone();
    suspended.status = Status::Suspended;
    suspended.attempt = 3;
    let retried =
        outcome::dead_letter_retry(&suspended, NOW.plus(Duration::from_mins(1)), NOW).unwrap();
    assert_eq!(
        (retried.status, retried.attempt, retried.eligible_at),
        (Status::Runnable, 0, NOW.plus(Duration::from_mins(1)))
    );
    assert!(outcome::dead_letter_retry(&claimed, NOW, NOW).is_err());
}

#[test]
fn an_undecodable_row_fails_alone_into_the_dead_letter_queue() {
    let mut row = executing(2, 1);
    // Two failed attempts before this claim: the dead letter counts them and this one.
    row.errors = (0..2)
        .map(|attempt| keel_core::instance::AttemptError { attempt, error: "boom".into(), at: NOW })
        .collect();
    row.context = keel_core::instance::undecodable("context", "recursion limit exceeded");
    let damage = row.damage().expect("the marker is seen as damage");
    assert_eq!(damage, "context: recursion limit exceeded");
    let applied = outcome::undecodable_row(&row, &damage, NOW);
    let next = &applied.row;
    assert_eq!(
        (next.status, next.lease_owner.as_ref(), next.revision),
        (Status::Suspended, None, Revision(row.revision.0 + 1))
    );
    let error = "stored value cannot be read back: context: recursion limit exceeded";
    assert_eq!(next.last_error.as_deref(), Some(error));
    assert_eq!(next.context, row.context, "the stored value is not replaced");
    assert_eq!(hist(&["ROW_UNDECODABLE", "DEAD_LETTERED"]), {
        applied.history.iter().map(|h| h.kind.clone()).collect::<Vec<_>>()
    });
    let letter = applied.dead_letter.expect("a dead letter");
    assert_eq!(
        (letter.reason.as_str(), letter.attempts, letter.errors.last().map(|e| e.error.as_str())),
        (outcome::UNDECODABLE_REASON, 3, Some(error))
    );
    assert!(executing(0, 0).damage().is_none(), "a whole row has no damage");
}

#[test]
fn json_checks_bound_depth_and_refuse_nul() {
    use keel_core::instance::{check_json, check_name, clip_error};
    use keel_core::limits::JSON_DEPTH_MAX;
    let nested = |levels: usize| {
        let mut v = json!([]);
        for _ in 1..levels {
            v = Value::Array(vec![v]);
        }
        v
    };
    assert!(check_json("p", &nested(JSON_DEPTH_MAX)).is_ok());
    let err = check_json("p", &nested(JSON_DEPTH_MAX + 1)).unwrap_err();
    assert!(err.message.starts_with("p: JSON is nested deeper than 64 levels"), "{err}");
    // Far deeper than any call stack could recurse through: the check walks iteratively.
    let hostile = nested(100_000);
    assert!(check_json("p", &hostile).is_err());
    // Dropping a value recurses as deep as it is nested, which this one is too deep for.
    std::mem::forget(hostile);
    assert!(check_json("p", &json!({ "k": "a\u{0}b" })).unwrap_err().message.contains("NUL"));
    assert!(check_json("p", &json!({ "a\u{0}": 1 })).unwrap_err().message.contains("object key"));
    assert!(
        check_name("queue", "q\u{0}").unwrap_err().message.starts_with("queue: contains a NUL")
    );
    assert_eq!(clip_error("a\u{0}b"), "a\u{fffd}b");
}
