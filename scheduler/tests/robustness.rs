//! The worker under conditions a new user meets early: step results the store refuses,
//! heartbeats racing commits, and failing or panicking store calls in background loops.
//!
//! Every test runs twice, driven by a `VirtualClock`: `memory::*` on `MemoryStore`, and
//! `postgres::*` on PostgreSQL (a fresh schema per test) on a multi-threaded runtime. The
//! Postgres tests need `KEEL_TEST_DATABASE_URL`; without it they are skipped loudly, and
//! under `KEEL_REQUIRE_BACKENDS=1` they fail.

#![allow(clippy::items_after_statements)]

mod common;

use async_trait::async_trait;
use common::Harness;
use keel_core::instance::NewInstance;
use keel_core::ports::Store;
use keel_core::ports::store::DeadLetterFilter;
use keel_core::{InstanceId, MachineRef, NewSignal, Outcome, Status};
use keel_scheduler::{StepContext, StepError, StepMachine, WorkerConfig};
use keel_store_postgres::PgStore;
use keel_testkit::memory::MemoryStore;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::Barrier;

/// A store the suite runs on.
trait TestStore: Store + Sized {
    async fn harness() -> Harness<Self>;
}

impl TestStore for MemoryStore {
    async fn harness() -> Harness<Self> {
        Harness::new()
    }
}

impl TestStore for PgStore {
    async fn harness() -> Harness<Self> {
        let store = keel_store_postgres::testing::fresh_schema_with(8).await;
        Harness::with_store(store.expect("checked by `postgres_available`"))
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
    ],
    postgres: [
        a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish,
        a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish,
        an_empty_step_name_is_dead_lettered_and_its_neighbours_finish,
        an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish,
        a_nul_character_the_store_refuses_is_dead_lettered_and_its_neighbours_finish,
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
