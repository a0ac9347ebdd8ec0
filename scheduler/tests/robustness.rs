//! The worker under conditions a new user meets early: step results the store refuses,
//! heartbeats racing commits, and failing or panicking store calls in background loops.
//!
//! Every test runs twice, driven by a `VirtualClock`: `memory::*` on `MemoryStore`, and
//! `postgres::*` on PostgreSQL (a fresh schema per test) on a multi-threaded runtime. The
//! Postgres tests need `KEEL_TEST_DATABASE_URL`; without it they are skipped loudly, and
//! under `KEEL_REQUIRE_BACKENDS=1` they fail.

#![allow(clippy::items_after_statements, clippy::unnecessary_wraps)]

mod common;

use async_trait::async_trait;
use common::Harness;
use keel_core::instance::{DeadLetter, Instance, NewInstance, SignalTarget};
use keel_core::ports::Store;
use keel_core::ports::store::{
    BroadcastReport, CancelParams, Claim, ClaimParams, CommitParams, CommitReceipt,
    DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams, DeadLetterSkipParams,
    DeliveryOutcome, InsertOutcome, InsertParams, InstanceDetail, LeaseExtendParams,
    LeaseReapParams, LeaseReleaseParams, QueuePauseParams, QueueState, QueueStats,
    SignalBroadcastParams, SignalDeliverParams, StoreCapabilities, TimerStatus, TimerSweepParams,
    TimerSweepReport,
};
use keel_core::{
    DeadLetterId, InstanceId, MachineRef, NewSignal, Outcome, Status, StoreResult, Timestamp,
};
use keel_scheduler::{StepContext, StepError, StepMachine, WorkerConfig};
use keel_store_postgres::PgStore;
use keel_testkit::memory::MemoryStore;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Barrier;

/// A store the suite runs on.
trait TestStore: Store + Sized {
    /// A fresh, empty store.
    async fn fresh() -> Self;

    async fn harness() -> Harness<Self> {
        Harness::with_store(Self::fresh().await)
    }
}

impl TestStore for MemoryStore {
    async fn fresh() -> Self {
        MemoryStore::new()
    }
}

impl TestStore for PgStore {
    async fn fresh() -> Self {
        let store = keel_store_postgres::testing::fresh_schema_with(8).await;
        store.expect("checked by `postgres_available`")
    }
}

/// Whether `KEEL_TEST_DATABASE_URL` is set; if not, says so loudly, and fails under
/// `KEEL_REQUIRE_BACKENDS=1`.
fn postgres_available(test: &str) -> bool {
    if keel_store_postgres::testing::database_url().is_some() {
        return true;
    }
    assert!(
        std::env::var(keel_testkit::conformance::REQUIRE_BACKENDS_VAR).as_deref() != Ok("1"),
        "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run postgres::{test}"
    );
    keel_testkit::conformance::skip_notice(&format!(
        "SKIPPED postgres::{test}: set KEEL_TEST_DATABASE_URL to run it on PostgreSQL"
    ));
    false
}

/// Instantiates each generic test on the stores named: `memory` and `postgres`.
macro_rules! on_stores {
    (memory: [$($m:ident),* $(,)?], postgres: [$($p:ident),* $(,)?] $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $m() {
                    super::$m::<keel_testkit::memory::MemoryStore>().await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $p() {
                    if super::postgres_available(stringify!($p)) {
                        super::$p::<keel_store_postgres::PgStore>().await;
                    }
                }
            )*
        }
    };
}

on_stores!(
    memory: [
        a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish,
        a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish,
        an_empty_step_name_is_dead_lettered_and_its_neighbours_finish,
        an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish,
        many_short_steps_never_report_a_lost_lease_on_heartbeat,
    ],
    postgres: [
        a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish,
        a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish,
        an_empty_step_name_is_dead_lettered_and_its_neighbours_finish,
        an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish,
        a_nul_character_the_store_refuses_is_dead_lettered_and_its_neighbours_finish,
        many_short_steps_never_report_a_lost_lease_on_heartbeat,
    ],
);

fn machine() -> MachineRef {
    MachineRef::new("m", 1)
}

/// How a step's result is bad.
#[derive(Debug, Clone, Copy)]
enum Bad {
    HugeContext,
    NotAnObject,
    EmptyStep,
    Nul,
    EmitToMissing,
}

/// Good neighbours of the one bad step, claimed and committed in the same group.
const NEIGHBOURS: usize = 5;

/// A machine whose first steps all finish together (so their results share one group
/// commit); the instance with `{"bad": true}` returns a result the store must refuse.
struct Refusable {
    bad: Bad,
    together: Arc<Barrier>,
}

#[async_trait]
impl StepMachine for Refusable {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        self.together.wait().await;
        if ctx.context["bad"] != json!(true) {
            return Ok(Outcome::Done { result: json!({ "ok": true }) });
        }
        let next = |context: Value| Outcome::Next { step: "b".into(), context };
        Ok(match self.bad {
            Bad::HugeContext => {
                next(json!({ "blob": "x".repeat(keel_core::limits::PAYLOAD_BYTES_MAX) }))
            }
            Bad::NotAnObject => next(json!([1, 2, 3])),
            Bad::EmptyStep => Outcome::Next { step: String::new(), context: json!({}) },
            Bad::Nul => next(json!({ "note": "a\u{0}b" })),
            Bad::EmitToMissing => {
                ctx.emit(NewSignal::new(InstanceId(i64::MAX - 7), "hello"));
                Outcome::Done { result: json!({}) }
            }
        })
    }
}

/// One bad result among good ones: the bad instance is dead-lettered at once (suspended,
/// attempt 0, a non-retryable dead letter, the store's message in `last_error`), it is
/// not re-run, and every neighbour finishes.
async fn refused<S: TestStore>(bad: Bad, names: &[&str]) {
    let h = S::harness().await;
    let mut good = Vec::new();
    for n in 0..NEIGHBOURS {
        good.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    let id = h.start(NewInstance::new(machine(), "a").context(json!({ "bad": true }))).await;
    // A long commit interval: the group is flushed once every running step has finished.
    let config = WorkerConfig { commit_interval: Duration::from_secs(1), ..h.config() };
    let together = Arc::new(Barrier::new(NEIGHBOURS + 1));
    let worker = h.worker(config, Refusable { bad, together });

    let row = h.wait(id, "the dead letter", |r| r.status == Status::Suspended).await;
    let error = row.last_error.clone().unwrap_or_default();
    assert!(error.contains("the store refused the step's result"), "{bad:?}: {error}");
    assert!(names.iter().any(|n| error.contains(n)), "{bad:?}: names one of {names:?}: {error}");
    assert_eq!(row.attempt, 0, "{bad:?}: a refused result is not retried");
    for n in &good {
        h.wait(*n, "a neighbour finished", |r| r.status == Status::Done).await;
    }
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("dead letters");
    assert_eq!(letters.len(), 1, "{bad:?}");
    assert_eq!(letters[0].letter.instance, id);
    assert_eq!(letters[0].letter.reason, "non_retryable");

    // Long after any lease would have run out, nothing re-ran it.
    h.clock.advance(Duration::from_secs(120));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let row = h.client.get(id).await.expect("get").instance;
    assert_eq!((row.status, row.attempt), (Status::Suspended, 0), "{bad:?}");
    let stats = worker.shutdown().await;
    assert_eq!(stats.refused.load(Ordering::Relaxed), 1, "{bad:?}");
    assert_eq!(stats.committed(), NEIGHBOURS as u64 + 1, "{bad:?}");
}

async fn a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish<S: TestStore>() {
    refused::<S>(Bad::HugeContext, &["outcome.context"]).await;
}

async fn a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish<
    S: TestStore,
>() {
    refused::<S>(Bad::NotAnObject, &["outcome.context"]).await;
}

async fn an_empty_step_name_is_dead_lettered_and_its_neighbours_finish<S: TestStore>() {
    refused::<S>(Bad::EmptyStep, &["outcome.step"]).await;
}

async fn an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish<S: TestStore>() {
    refused::<S>(Bad::EmitToMissing, &["emit[0].target"]).await;
}

/// PostgreSQL cannot store a NUL character in text or JSON; whichever layer refuses it
/// (the input checks or the database), the result is a dead letter, not a loop.
async fn a_nul_character_the_store_refuses_is_dead_lettered_and_its_neighbours_finish<
    S: TestStore,
>() {
    refused::<S>(Bad::Nul, &["22P05", "22021", "NUL", "nul"]).await;
}

/// A store that counts calls per operation and delays heartbeats; everything else goes
/// to the store inside.
struct Faulty<S> {
    inner: S,
    extend_delay: Duration,
    calls: Mutex<HashMap<&'static str, u64>>,
}

impl<S: Store> Faulty<S> {
    fn new(inner: S) -> Self {
        Faulty { inner, extend_delay: Duration::ZERO, calls: Mutex::default() }
    }

    fn calls(&self, op: &str) -> u64 {
        self.calls.lock().unwrap().get(op).copied().unwrap_or(0)
    }

    /// Counts the call.
    fn gate(&self, op: &'static str) -> StoreResult<()> {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
        Ok(())
    }
}

#[async_trait]
impl<S: Store> Store for Faulty<S> {
    fn capabilities(&self) -> StoreCapabilities {
        self.inner.capabilities()
    }
    async fn instance_insert(&self, p: InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        self.inner.instance_insert(p).await
    }
    async fn instance_claim(&self, p: ClaimParams) -> StoreResult<Vec<Claim>> {
        self.gate("instance_claim")?;
        self.inner.instance_claim(p).await
    }
    async fn step_commit(&self, p: CommitParams) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
        self.gate("step_commit")?;
        self.inner.step_commit(p).await
    }
    async fn lease_extend(&self, p: LeaseExtendParams) -> StoreResult<Vec<bool>> {
        self.gate("lease_extend")?;
        tokio::time::sleep(self.extend_delay).await;
        self.inner.lease_extend(p).await
    }
    async fn lease_reap(&self, p: LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        self.gate("lease_reap")?;
        self.inner.lease_reap(p).await
    }
    async fn lease_release(&self, p: LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        self.inner.lease_release(p).await
    }
    async fn signal_deliver(&self, p: SignalDeliverParams) -> StoreResult<Vec<DeliveryOutcome>> {
        self.inner.signal_deliver(p).await
    }
    async fn signal_broadcast(&self, p: SignalBroadcastParams) -> StoreResult<BroadcastReport> {
        self.inner.signal_broadcast(p).await
    }
    async fn instance_cancel(&self, p: CancelParams) -> StoreResult<Vec<InstanceId>> {
        self.inner.instance_cancel(p).await
    }
    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        self.inner.instance_get(id).await
    }
    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        self.inner.instance_rows(ids).await
    }
    async fn instance_lookup(&self, t: SignalTarget) -> StoreResult<Option<InstanceId>> {
        self.inner.instance_lookup(t).await
    }
    async fn dead_letter_list(&self, f: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        self.inner.dead_letter_list(f).await
    }
    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        self.inner.dead_letter_get(id).await
    }
    async fn dead_letter_retry(&self, p: DeadLetterRetryParams) -> StoreResult<Vec<InstanceId>> {
        self.inner.dead_letter_retry(p).await
    }
    async fn dead_letter_skip(&self, p: DeadLetterSkipParams) -> StoreResult<InstanceId> {
        self.inner.dead_letter_skip(p).await
    }
    async fn dead_letter_purge(&self, p: DeadLetterPurgeParams) -> StoreResult<u64> {
        self.inner.dead_letter_purge(p).await
    }
    async fn queue_pause(&self, p: QueuePauseParams) -> StoreResult<()> {
        self.inner.queue_pause(p).await
    }
    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>> {
        self.inner.queue_list(namespace).await
    }
    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>> {
        self.gate("queue_stats")?;
        self.inner.queue_stats(namespace, now).await
    }
    async fn timer_sweep(&self, p: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        self.gate("timer_sweep")?;
        self.inner.timer_sweep(p).await
    }
    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        self.inner.timer_status(namespace, now).await
    }
    async fn ready_wait(&self) {
        self.inner.ready_wait().await;
    }
}

/// Three short steps each, finishing in a steady stream.
struct ShortSteps;

#[async_trait]
impl StepMachine for ShortSteps {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        Ok(match ctx.step.as_str() {
            "a" => Outcome::Next { step: "b".into(), context: ctx.context.clone() },
            "b" => Outcome::Next { step: "c".into(), context: ctx.context.clone() },
            _ => Outcome::Done { result: json!({ "ok": true }) },
        })
    }
}

/// Many short steps under a heartbeat that runs all the time and whose store call takes
/// a while: results committed while a heartbeat was under way gave their lease up on
/// purpose, and no lease is reported lost.
async fn many_short_steps_never_report_a_lost_lease_on_heartbeat<S: TestStore>() {
    const INSTANCES: usize = 100;
    let store = Faulty { extend_delay: Duration::from_millis(3), ..Faulty::new(S::fresh().await) };
    let h = Harness::with_store(store);
    let mut ids = Vec::new();
    for n in 0..INSTANCES {
        ids.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    let config = WorkerConfig {
        heartbeat: Duration::from_millis(1),
        commit_interval: Duration::from_millis(5),
        timers: None,
        ..h.config()
    };
    let worker = h.worker(config, ShortSteps);
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert!(h.store.calls("lease_extend") > 10, "the heartbeat ran while steps finished");
    assert_eq!(stats.committed(), 3 * INSTANCES as u64);
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0, "no commit lost its lease");
    assert_eq!(
        stats.lease_lost_on_heartbeat.load(Ordering::Relaxed),
        0,
        "no lease was lost, so none may be reported lost"
    );
}
