//! Helpers shared by the store contracts: fixed times, short builders, and assertions
//! that say which field differs. Nothing here reads the system clock.

use keel_core::instance::{HistoryEntry, NewSignal};
use keel_core::outcome::{self, Applied, ApplyFacts, Outcome, StepFailure};
use keel_core::ports::Store;
use keel_core::ports::store::{
    Claim, ClaimParams, CommitParams, CommitReceipt, DeliveryOutcome, InsertOutcome, InsertParams,
    InstanceDetail, LeaseReapParams, SignalDeliverParams,
};
use keel_core::{
    ErrorKind, FencingToken, Instance, InstanceId, MachineRef, NewInstance, SignalId, StepCommit,
    StoreResult, Timestamp, WorkerId,
};
use serde_json::{Value, json};
use std::time::Duration;

/// The suite's epoch: every contract runs at fixed times after it.
pub const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);
/// The lease every helper claim takes.
pub const LEASE: Duration = Duration::from_secs(30);

/// `T0 + ms`.
pub fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(T0.as_millis() + ms)
}

/// A worker id.
pub fn worker(name: &str) -> WorkerId {
    WorkerId(name.to_owned())
}

/// The machine most contracts run: `order@v1`.
pub fn order() -> MachineRef {
    MachineRef::new("order", 1)
}

/// A new `order@v1` instance at step `start` in namespace `ns`, context `{"n": 0}`.
pub fn new_in(ns: &str) -> NewInstance {
    NewInstance::new(order(), "start").namespace(ns).context(json!({ "n": 0 }))
}

/// A context object `{"n": n}`.
pub fn ctx(n: i64) -> Value {
    json!({ "n": n })
}

/// `Next` to `step` with context `{"n": n}`.
pub fn next(step: &str, n: i64) -> Outcome {
    Outcome::Next { step: step.to_owned(), context: ctx(n) }
}

/// `Await` of `signal` with context `{"n": n}`.
pub fn await_signal(signal: &str, n: i64) -> Outcome {
    Outcome::Await { signal: signal.to_owned(), context: ctx(n), step: None }
}

/// `Done` with result `{"ok": true}`.
pub fn done() -> Outcome {
    Outcome::Done { result: json!({ "ok": true }), step: None }
}

/// A failure record of a step.
pub fn failure(error: &str, dead_letter: bool, signals: Vec<SignalId>) -> StepFailure {
    StepFailure { error: error.to_owned(), retryable: true, dead_letter, signals, event: None }
}

/// Inserts a batch and expects success.
pub async fn insert<S: Store>(
    s: &S,
    instances: Vec<NewInstance>,
    now: Timestamp,
) -> Vec<InsertOutcome> {
    s.instance_insert(InsertParams { instances, now }).await.expect("instance_insert")
}

/// Inserts one instance and expects it to be new.
pub async fn insert_one<S: Store>(s: &S, new: NewInstance, now: Timestamp) -> InstanceId {
    match insert(s, vec![new], now).await.as_slice() {
        [InsertOutcome::Inserted(id)] => *id,
        other => panic!("expected one new instance, got {other:?}"),
    }
}

/// Claim parameters: worker `w1`, namespace `ns`, any queue and machine.
pub fn claim_params(ns: &str, limit: usize, now: Timestamp) -> ClaimParams {
    ClaimParams {
        worker: worker("w1"),
        namespaces: vec![ns.to_owned()],
        queues: Vec::new(),
        machines: Vec::new(),
        limit,
        lease: LEASE,
        now,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    }
}

/// Claims with `params` and expects success.
pub async fn claim<S: Store>(s: &S, params: ClaimParams) -> Vec<Claim> {
    s.instance_claim(params).await.expect("instance_claim")
}

/// Ids of claims, in order.
pub fn ids(claims: &[Claim]) -> Vec<InstanceId> {
    claims.iter().map(|c| c.instance.id).collect()
}

/// Claims one row in `ns` as `w1` and expects it to be `id`.
pub async fn claim_id<S: Store>(s: &S, ns: &str, id: InstanceId, now: Timestamp) -> Claim {
    let mut claims = claim(s, claim_params(ns, 1, now)).await;
    assert_eq!(ids(&claims), vec![id], "expected to claim instance {id} at {now}");
    claims.remove(0)
}

/// Commits one step result; the outer call must succeed.
pub async fn commit<S: Store>(s: &S, c: StepCommit, now: Timestamp) -> StoreResult<CommitReceipt> {
    let mut results =
        s.step_commit(CommitParams { commits: vec![c], now }).await.expect("step_commit");
    assert_eq!(results.len(), 1, "one receipt per commit");
    results.remove(0)
}

/// Commits one step result and expects it to be accepted.
pub async fn commit_ok<S: Store>(s: &S, c: StepCommit, now: Timestamp) -> CommitReceipt {
    commit(s, c, now).await.expect("commit accepted")
}

/// Commits `outcome` for `claim` (nothing consumed) and expects acceptance.
pub async fn step<S: Store>(
    s: &S,
    claim: &Claim,
    outcome: Outcome,
    now: Timestamp,
) -> CommitReceipt {
    commit_ok(s, StepCommit::new(claim.instance.id, claim.token(), outcome), now).await
}

/// Expects an error of `kind`.
pub fn expect_kind<T: std::fmt::Debug>(result: StoreResult<T>, kind: ErrorKind, what: &str) {
    match result {
        Err(e) => assert_eq!(e.kind, kind, "{what}: wrong error kind ({e})"),
        Ok(v) => panic!("{what}: expected {kind:?}, got Ok({v:?})"),
    }
}

/// Expects `result` to be refused as `Invalid` with a message that names `field`
/// somewhere (a nested field may be named with its path, `instances[0].context`).
pub fn expect_invalid<T: std::fmt::Debug>(result: StoreResult<T>, field: &str) {
    match result {
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::Invalid, "{field}: wrong error kind ({e})");
            assert!(e.message.contains(field), "the message names {field}: {}", e.message);
        }
        Ok(v) => panic!("{field}: expected Invalid, got Ok({v:?})"),
    }
}

/// Expects `result` to be refused as `Invalid` with a message that starts by naming
/// `field` (`"{field}: …"`); `what` says what was asked, for the failure message.
pub fn expect_invalid_naming<T: std::fmt::Debug>(
    result: StoreResult<T>,
    field: &str,
    what: &impl std::fmt::Debug,
) {
    match result {
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::Invalid, "{what:?}: {e}");
            assert!(
                e.message.starts_with(&format!("{field}:")),
                "{what:?}: {e} does not name {field}"
            );
        }
        Ok(v) => panic!("{what:?} was accepted: {v:?}"),
    }
}

/// An instance with inbox, children and history.
pub async fn get<S: Store>(s: &S, id: InstanceId) -> InstanceDetail {
    s.instance_get(id).await.expect("instance_get")
}

/// The row of an instance.
pub async fn row<S: Store>(s: &S, id: InstanceId) -> Instance {
    get(s, id).await.instance
}

/// Delivers signals and expects the call to succeed.
pub async fn deliver<S: Store>(
    s: &S,
    signals: Vec<NewSignal>,
    now: Timestamp,
) -> Vec<DeliveryOutcome> {
    s.signal_deliver(SignalDeliverParams { signals, now }).await.expect("signal_deliver")
}

/// Delivers one signal named `name` to `id` and expects it stored; returns its id and
/// whether it woke the target.
pub async fn send<S: Store>(s: &S, id: InstanceId, name: &str, now: Timestamp) -> (SignalId, bool) {
    match deliver(s, vec![NewSignal::new(id, name)], now).await.as_slice() {
        [DeliveryOutcome::Delivered { id: sid, target, woke }] => {
            assert_eq!(*target, id, "delivered to the addressed instance");
            (*sid, *woke)
        }
        other => panic!("expected a delivery to {id}, got {other:?}"),
    }
}

/// Reaps expired leases (no owner) at `now`.
pub async fn reap<S: Store>(s: &S, now: Timestamp) -> Vec<InstanceId> {
    s.lease_reap(LeaseReapParams { owner: None, limit: 100, now }).await.expect("lease_reap")
}

/// The reference result of committing `c` to `before`.
pub fn reference(before: &Instance, c: &StepCommit, facts: ApplyFacts) -> Applied {
    outcome::validate_commit(before, c).expect("the reference accepts the commit");
    outcome::apply(before, c, facts)
}

/// Facts with nothing waiting and no children.
pub fn facts(now: Timestamp) -> ApplyFacts {
    ApplyFacts { now, signal_waiting: false, children_inserted: 0 }
}

/// Asserts two rows are equal field by field, naming every field that differs.
pub fn assert_row(got: &Instance, want: &Instance, what: &str) {
    let got_v = serde_json::to_value(got).expect("row serializes");
    let want_v = serde_json::to_value(want).expect("row serializes");
    let (Value::Object(g), Value::Object(w)) = (&got_v, &want_v) else {
        panic!("rows serialize as objects")
    };
    let diffs: Vec<String> = w
        .iter()
        .filter(|(k, v)| g.get(*k) != Some(*v))
        .map(|(k, v)| format!("  {k}: got {}, want {v}", g.get(k).unwrap_or(&Value::Null)))
        .collect();
    assert!(diffs.is_empty(), "{what}: row differs from the reference:\n{}", diffs.join("\n"));
}

/// Asserts the newest history of `detail` ends with `want`, recorded at `revision` in
/// `attempt`.
pub fn assert_history_tail(
    detail: &InstanceDetail,
    want: &[HistoryEntry],
    attempt: i32,
    what: &str,
) {
    let h = &detail.history;
    assert!(h.len() >= want.len(), "{what}: history too short: {h:?}");
    let tail = &h[h.len() - want.len()..];
    let got: Vec<&HistoryEntry> = tail.iter().map(|r| &r.entry).collect();
    let want_refs: Vec<&HistoryEntry> = want.iter().collect();
    assert_eq!(got, want_refs, "{what}: history entries");
    for r in tail {
        assert_eq!(r.instance, detail.instance.id, "{what}: history instance");
        assert_eq!(r.attempt, attempt, "{what}: history attempt");
    }
    assert!(h.windows(2).all(|w| w[0].seq < w[1].seq), "{what}: history seq increases");
}

/// Takes a claimed row to `suspended` with a dead letter; returns the letter's id.
pub async fn suspend<S: Store>(
    s: &S,
    claim: &Claim,
    error: &str,
    signals: Vec<SignalId>,
    now: Timestamp,
) -> keel_core::DeadLetterId {
    let c = StepCommit::new(claim.instance.id, claim.token(), Outcome::Suspend)
        .failure(failure(error, true, signals));
    commit_ok(s, c, now).await.dead_letter.expect("a Suspend commit produces a dead letter")
}

/// A token nobody holds.
pub const NO_TOKEN: FencingToken = FencingToken(i64::MAX);
