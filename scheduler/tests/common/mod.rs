//! Shared harness for the scheduler's tests: a store (`MemoryStore` unless a test brings
//! another), a `VirtualClock`, a client, and bounded waits.

#![allow(dead_code, unused_macros, clippy::unused_self)]

use keel_core::instance::NewInstance;
use keel_core::ports::Store;
use keel_core::{Instance, InstanceId, Status, Timestamp, WorkerId};
use keel_scheduler::{Client, StepMachine, Worker, WorkerConfig, WorkerHandle};
use keel_testkit::clock::VirtualClock;
use keel_testkit::memory::MemoryStore;
use std::sync::Arc;
use std::time::Duration;

pub const T0: Timestamp = Timestamp(1_700_000_000_000);

pub struct Harness<S: Store = MemoryStore> {
    pub store: Arc<S>,
    pub clock: VirtualClock,
    pub client: Client<S, VirtualClock>,
}

impl Harness<MemoryStore> {
    pub fn new() -> Self {
        Harness::with_store(MemoryStore::new())
    }
}

impl<S: Store> Harness<S> {
    /// A harness over `store` (stores take `now` from the caller, so the virtual clock
    /// drives any backend).
    pub fn with_store(store: S) -> Self {
        let store = Arc::new(store);
        let clock = VirtualClock::new(T0);
        let client = Client::new(Arc::clone(&store), clock.clone());
        Harness { store, clock, client }
    }

    pub fn config(&self) -> WorkerConfig {
        WorkerConfig {
            worker_id: WorkerId("test-worker".into()),
            poll_interval: Duration::from_millis(5),
            reap_interval: Duration::from_millis(10),
            heartbeat: Duration::from_millis(10),
            shutdown_grace: Duration::from_millis(200),
            ..WorkerConfig::default()
        }
    }

    pub fn worker(&self, config: WorkerConfig, machine: impl StepMachine) -> WorkerHandle {
        Worker::new(Arc::clone(&self.store), self.clock.clone(), config).register(machine).spawn()
    }

    pub async fn start(&self, new: NewInstance) -> InstanceId {
        self.client.start(new).await.expect("start").id()
    }

    pub async fn status(&self, id: InstanceId) -> Status {
        self.client.get(id).await.expect("get").instance.status
    }

    /// Polls until `cond` holds for the instance (at most 5 s of real time).
    pub async fn wait(
        &self,
        id: InstanceId,
        what: &str,
        cond: impl Fn(&Instance) -> bool,
    ) -> Instance {
        for _ in 0..1_000 {
            let row = self.client.get(id).await.expect("get").instance;
            if cond(&row) {
                return row;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let row = self.client.get(id).await.expect("get").instance;
        panic!(
            "timed out waiting for {what}; instance is {:?} at {:?} attempt {}",
            row.status, row.position, row.attempt
        );
    }
}

/// A store the generic tests run on, and how many workers share it in tests that race
/// several (`MemoryStore` is exercised with one; PostgreSQL with two).
pub trait TestStore: Store + Sized {
    /// Workers a multi-worker test starts.
    const WORKERS: usize;

    /// A fresh, empty store.
    async fn fresh() -> Self;

    /// A harness over a fresh store.
    async fn harness() -> Harness<Self> {
        Harness::with_store(Self::fresh().await)
    }
}

impl TestStore for MemoryStore {
    const WORKERS: usize = 1;
    async fn fresh() -> Self {
        MemoryStore::new()
    }
}

impl TestStore for keel_store_postgres::PgStore {
    const WORKERS: usize = 2;
    async fn fresh() -> Self {
        // Two workers (claim, commit, heartbeat, reaper each), the client and a sweeper.
        let store = keel_store_postgres::testing::fresh_schema_with(12).await;
        store.expect("checked by `postgres_available`")
    }
}

/// Whether `KEEL_TEST_DATABASE_URL` is set; if not, says so loudly, and fails under
/// `KEEL_REQUIRE_BACKENDS=1`.
pub fn postgres_available(test: &str) -> bool {
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

/// Instantiates each generic test on the stores named: `memory` (`MemoryStore`) and
/// `postgres` (a fresh schema per test, on a multi-threaded runtime).
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
                    if crate::common::postgres_available(stringify!($p)) {
                        super::$p::<keel_store_postgres::PgStore>().await;
                    }
                }
            )*
        }
    };
}

/// Instantiates each generic test on every store.
macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        on_stores!(memory: [$($name),*], postgres: [$($name),*]);
    };
}
