//! Contracts for what every store refuses at the door, the same way: JSON nested deeper
//! than any store can read back, NUL characters, the key reserved for undecodable-value
//! markers, and times and delays past their bounds. Each refusal is `Invalid`, names the
//! field, and writes nothing; a value at the bound is accepted and reads back unchanged.

use super::support::{
    at, claim, claim_id, claim_params, commit, ctx, deliver, expect_invalid, get, insert_one,
    new_in, row,
};
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::instance::{HistoryEntry, NewSignal, SignalTarget, UNDECODABLE};
use keel_core::limits;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{InsertParams, SignalBroadcastParams, SignalDeliverParams};
use keel_core::{NewInstance, StepCommit, Timestamp};
use serde_json::{Value, json};
use std::time::Duration;

/// `levels` arrays nested in one another (`[[…]]`).
fn nested(levels: usize) -> Value {
    let mut v = json!([]);
    for _ in 1..levels {
        v = Value::Array(vec![v]);
    }
    v
}

/// A context object whose whole nesting is `levels` deep.
fn deep_ctx(levels: usize) -> Value {
    json!({ "d": nested(levels - 1) })
}

async fn insert_invalid<S: Store>(s: &S, new: NewInstance, field: &str) {
    let params = InsertParams { instances: vec![new], now: at(1) };
    expect_invalid(s.instance_insert(params).await, field);
}

async fn deliver_invalid<S: Store>(s: &S, signal: NewSignal, field: &str) {
    let params = SignalDeliverParams { signals: vec![signal], now: at(2) };
    expect_invalid(s.signal_deliver(params).await, field);
}

async fn commit_invalid<S: Store>(s: &S, c: StepCommit, field: &str) {
    expect_invalid(commit(s, c, at(20)).await, field);
}

/// JSON nested deeper than [`limits::JSON_DEPTH_MAX`] is refused where callers hand it in
/// (an instance's context, a signal's payload); what a step commit carries (context,
/// result, emitted payload, history data, spawned child) may be nested up to
/// [`limits::JSON_DEPTH_STORED_MAX`], leaving the engine room to wrap callers' values, and
/// no deeper. At each bound the value is stored and read back whole, by the claim (inbox
/// included) and by an inspect.
pub async fn json_nested_too_deep_rejected_everywhere<S: Store>(s: &S) {
    let ns = "json_depth";
    let max = limits::JSON_DEPTH_MAX;
    insert_invalid(s, new_in(ns).context(deep_ctx(max + 1)), "instances[0].context").await;
    let id = insert_one(s, new_in(ns).context(deep_ctx(max)), at(0)).await;
    deliver_invalid(s, NewSignal::new(id, "deep").payload(nested(max + 1)), "signals[0].payload")
        .await;
    deliver(s, vec![NewSignal::new(id, "deep").payload(nested(max))], at(3)).await;

    let claimed = claim_id(s, ns, id, at(10)).await;
    assert_eq!(claimed.instance.context, deep_ctx(max), "the context at the bound reads back");
    assert_eq!(claimed.inbox.len(), 1);
    assert_eq!(claimed.inbox[0].payload, nested(max), "the payload at the bound reads back");

    let stored = limits::JSON_DEPTH_STORED_MAX;
    let token = claimed.token();
    let next = |context: Value| Outcome::Next { step: "b".into(), context };
    let too_deep = StepCommit::new(id, token, next(deep_ctx(stored + 1)));
    commit_invalid(s, too_deep, "outcome.context").await;
    let result =
        StepCommit::new(id, token, Outcome::Done { result: nested(stored + 1), step: None });
    commit_invalid(s, result, "outcome.result").await;
    let emit = StepCommit::new(id, token, next(ctx(1)))
        .emit(NewSignal::new(id, "e").payload(nested(stored + 1)));
    commit_invalid(s, emit, "emit[0].payload").await;
    let history = StepCommit::new(id, token, next(ctx(1)))
        .record(HistoryEntry::new("NOTE", nested(stored + 1)));
    commit_invalid(s, history, "history[0].data").await;
    let mut spawn = StepCommit::new(id, token, next(ctx(1)));
    spawn.spawn.push(new_in(ns).context(deep_ctx(stored + 1)));
    commit_invalid(s, spawn, "spawn[0].context").await;
    assert_eq!(row(s, id).await, claimed.instance, "a rejected commit changed the row");

    let deep_next = StepCommit::new(id, token, next(deep_ctx(stored)))
        .emit(NewSignal::new(id, "e").payload(nested(stored)));
    commit(s, deep_next, at(30)).await.expect("a commit at the stored bound is accepted");
    let again = claim_id(s, ns, id, at(40)).await;
    assert_eq!(again.instance.context, deep_ctx(stored), "the context reads back");
    let payloads: Vec<&Value> = again.inbox.iter().map(|sig| &sig.payload).collect();
    assert_eq!(payloads, [&nested(max), &nested(stored)], "the payloads read back");
    let done =
        StepCommit::new(id, again.token(), Outcome::Done { result: nested(stored), step: None });
    commit(s, done, at(50)).await.expect("a result at the stored bound is accepted");
    assert_eq!(row(s, id).await.result, Some(nested(stored)), "the result reads back");
}

/// A NUL character is refused in names, keys and JSON (strings and object keys) on every
/// store, naming the field; Keel's own records (a `Stop` reason, history data) are kept
/// with the NUL replaced.
pub async fn nul_characters_rejected_everywhere<S: Store>(s: &S) {
    let ns = "nul_chars";
    insert_invalid(s, new_in(ns).business_key("a\0b"), "instances[0].business_key").await;
    insert_invalid(s, new_in(ns).queue("q\0"), "instances[0].queue").await;
    insert_invalid(s, new_in(ns).context(json!({ "k": "a\0" })), "instances[0].context").await;
    insert_invalid(s, new_in(ns).context(json!({ "a\0": 1 })), "instances[0].context").await;
    let id = insert_one(s, new_in(ns).business_key("k1"), at(0)).await;

    deliver_invalid(s, NewSignal::new(id, "E\0"), "signals[0].name").await;
    deliver_invalid(s, NewSignal::new(id, "E").payload(json!("x\0")), "signals[0].payload").await;
    deliver_invalid(s, NewSignal::new(id, "E").dedup_key("d\0"), "signals[0].dedup_key").await;
    let by_key = SignalTarget::Key {
        namespace: ns.into(),
        machine: new_in(ns).machine.name,
        key: "k\0".into(),
    };
    deliver_invalid(s, NewSignal::new(by_key, "E"), "signals[0].target.key").await;
    let broadcast = |in_state: &str, payload: Value| SignalBroadcastParams {
        namespace: ns.into(),
        machine: new_in(ns).machine.name,
        in_state: Some(in_state.into()),
        name: "E".into(),
        payload,
        dedup_key: None,
        now: at(3),
    };
    let selector = s.signal_broadcast(broadcast("start\0", Value::Null)).await;
    expect_invalid(selector, "broadcast.in_state");
    let payload = s.signal_broadcast(broadcast("start", json!(["\0"]))).await;
    expect_invalid(payload, "broadcast.payload");
    assert!(get(s, id).await.inbox.is_empty(), "a rejected delivery stored something");

    let claimed = claim_id(s, ns, id, at(10)).await;
    let token = claimed.token();
    let step = StepCommit::new(id, token, Outcome::Next { step: "s\0".into(), context: ctx(1) });
    commit_invalid(s, step, "outcome.step").await;
    let context = json!({ "note": "\0" });
    let step = StepCommit::new(id, token, Outcome::Next { step: "s".into(), context });
    commit_invalid(s, step, "outcome.context").await;
    assert_eq!(row(s, id).await, claimed.instance, "a rejected commit changed the row");

    let stop = StepCommit::new(id, token, Outcome::Stop { reason: "bad\0reason".into() })
        .record(HistoryEntry::new("NOTE", json!({ "error\0": "x\0y" })));
    commit(s, stop, at(20)).await.expect("texts with NUL in a reason and history are kept");
    let detail = get(s, id).await;
    assert_eq!(detail.instance.last_error.as_deref(), Some("bad\u{fffd}reason"));
    let note = detail.history.iter().find(|h| h.entry.kind == "NOTE").expect("the note");
    assert_eq!(note.entry.data, json!({ "error\u{fffd}": "x\u{fffd}y" }), "NUL replaced");
}

/// A position that starts with `[` is a chart's JSON array of active states, and every
/// store reads it so when it filters by state: one that is not such an array is refused
/// where it comes in (a start, a step's next position), naming the field, so that no
/// stored row can break a state filter later. An array position is matched by each of
/// its states.
pub async fn a_position_opening_with_a_bracket_must_be_a_chart_configuration<S: Store>(s: &S) {
    let ns = "bracket_position";
    let at_position = |position: &str| NewInstance { position: position.into(), ..new_in(ns) };
    insert_invalid(s, at_position("[x"), "instances[0].position").await;
    insert_invalid(s, at_position("[1]"), "instances[0].position").await;
    // JSON can carry a NUL the text check cannot see; PostgreSQL's `jsonb` refuses it.
    insert_invalid(s, at_position(r#"["a\u0000b"]"#), "instances[0].position").await;
    let id = insert_one(s, new_in(ns).business_key("k1"), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let next = Outcome::Next { step: "[oops".into(), context: ctx(1) };
    commit_invalid(s, StepCommit::new(id, claimed.token(), next), "outcome.step").await;
    assert_eq!(row(s, id).await, claimed.instance, "a rejected commit changed the row");

    let chart = insert_one(s, at_position(r#"["open.idle","audit"]"#), at(1)).await;
    let reach = |state: &str| SignalBroadcastParams {
        namespace: ns.into(),
        machine: new_in(ns).machine.name,
        in_state: Some(state.into()),
        name: "E".into(),
        payload: Value::Null,
        dedup_key: None,
        now: at(30),
    };
    s.signal_broadcast(reach("audit")).await.expect("a broadcast by one of the chart's states");
    s.signal_broadcast(reach("[x")).await.expect("a broadcast to a state nobody is in");
    let names: Vec<String> =
        get(s, chart).await.inbox.iter().map(|signal| signal.name.clone()).collect();
    assert_eq!(names, ["E"], "the chart in `audit` got the broadcast once");
}

/// Text that JSON has to escape (quotes, backslashes, control characters, characters
/// outside the basic plane) and numbers at the edges of their types read back exactly as
/// they went in: a signal's name, payload and dedup key, delivered or emitted by a commit,
/// and history data. Stores that gather a batch's rows into one encoded parameter must
/// decode every value the way it was written.
pub async fn escaped_text_and_edge_numbers_read_back_unchanged<S: Store>(s: &S) {
    let ns = "escaped_text";
    let text = "a \"quoted\" \\ back\\slash\n\ttab \u{1} ünï 🦀 'single' {}[]";
    let value = json!({
        text: [text, i64::MAX, i64::MIN, u64::MAX, 0.1, -1.5e-7, null, true, { "": "" }],
        "plain": text,
    });
    let id = insert_one(s, new_in(ns), at(0)).await;
    let sent = NewSignal::new(id, text).payload(value.clone()).dedup_key(text);
    deliver(s, vec![sent], at(3)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    assert_eq!(claimed.inbox.len(), 1, "the delivered signal is in the inbox");
    let got = &claimed.inbox[0];
    assert_eq!(got.name, text, "a delivered signal's name reads back");
    assert_eq!(got.payload, value, "a delivered signal's payload reads back");
    assert_eq!(got.dedup_key.as_deref(), Some(text), "a dedup key reads back");

    let next = Outcome::Next { step: "b".into(), context: ctx(1) };
    let step = StepCommit::new(id, claimed.token(), next)
        .emit(NewSignal::new(id, text).payload(value.clone()))
        .record(HistoryEntry::new("NOTE", value.clone()));
    commit(s, step, at(20)).await.expect("the commit is accepted");
    let detail = get(s, id).await;
    let note = detail.history.iter().find(|h| h.entry.kind == "NOTE").expect("the note");
    assert_eq!(note.entry.data, value, "history data reads back");
    let again = claim_id(s, ns, id, at(30)).await;
    let inbox: Vec<(&str, &Value)> =
        again.inbox.iter().map(|sig| (sig.name.as_str(), &sig.payload)).collect();
    assert_eq!(inbox, [(text, &value), (text, &value)], "an emitted signal reads back");
}

/// The key that marks undecodable values is reserved: a context, payload or result that is
/// an object carrying it is refused.
pub async fn undecodable_marker_key_reserved<S: Store>(s: &S) {
    let ns = "marker_key";
    let marked = json!({ UNDECODABLE: { "column": "context", "error": "x" } });
    insert_invalid(s, new_in(ns).context(marked.clone()), "instances[0].context").await;
    let id = insert_one(s, new_in(ns), at(0)).await;
    deliver_invalid(s, NewSignal::new(id, "E").payload(marked.clone()), "signals[0].payload").await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let done = StepCommit::new(id, claimed.token(), Outcome::Done { result: marked, step: None });
    commit_invalid(s, done, "outcome.result").await;
    assert_eq!(row(s, id).await, claimed.instance, "a rejected commit changed the row");
}

/// Times and delays have bounds: a start time after [`limits::TIMESTAMP_MAX`], a `Retry`
/// delay over [`limits::RETRY_DELAY_MAX`], a timer interval over
/// [`limits::TIMER_INTERVAL_MAX`] and a timer `max` of zero are refused; the bounds
/// themselves are accepted and stored exactly.
pub async fn time_and_delay_bounds_enforced<S: Store>(s: &S) {
    let ns = "time_bounds";
    let never = new_in(ns).eligible_at(Timestamp(i64::MAX));
    insert_invalid(s, never, "instances[0].eligible_at").await;
    let late = insert_one(s, new_in(ns).eligible_at(limits::TIMESTAMP_MAX), at(0)).await;
    assert_eq!(row(s, late).await.eligible_at, limits::TIMESTAMP_MAX);

    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let token = claimed.token();
    let retry = |delay| Outcome::Retry { context: ctx(1), delay };
    commit_invalid(s, StepCommit::new(id, token, retry(Duration::MAX)), "outcome.delay").await;
    let over = limits::RETRY_DELAY_MAX + Duration::from_millis(1);
    commit_invalid(s, StepCommit::new(id, token, retry(over)), "outcome.delay").await;
    let arm = |interval, max| TimerArm {
        state: "a".into(),
        event: "TICK".into(),
        kind: TimerKind::Every,
        interval,
        max,
        then: None,
    };
    let long = limits::TIMER_INTERVAL_MAX + Duration::from_secs(1);
    let mut timer = StepCommit::new(id, token, Outcome::Next { step: "a".into(), context: ctx(1) });
    timer.timers_arm.push(arm(long, None));
    commit_invalid(s, timer.clone(), "timers_arm[0].interval").await;
    timer.timers_arm = vec![arm(Duration::from_secs(1), Some(0))];
    commit_invalid(s, timer, "timers_arm[0].max").await;
    assert_eq!(row(s, id).await, claimed.instance, "a rejected commit changed the row");

    let at_bound = StepCommit::new(id, token, retry(limits::RETRY_DELAY_MAX));
    commit(s, at_bound, at(20)).await.expect("a delay at the bound is accepted");
    assert_eq!(row(s, id).await.eligible_at, at(20).plus(limits::RETRY_DELAY_MAX));
    assert!(claim(s, claim_params(ns, 10, at(30))).await.is_empty(), "nothing is due yet");
}
