//! Shared harness for the scheduler's tests: a store (`MemoryStore` unless a test brings
//! another), a `VirtualClock`, a client, and bounded waits.
//!
//! With `KEEL_TEST_WORKER_QUEUE=redis` (and `KEEL_TEST_REDIS_URL`), every harness has a
//! Redis queue of its own in the loop: the client announces starts and sends on it, the
//! workers the harness starts receive hints from it and run its repair pass, and their
//! store notifications are off and polling slowed to 100 ms, so that wake-ups go through
//! the queue. The same tests then check the same outcomes: a parametrised run of the
//! suites that exercise wake-ups, not a copy of them.

#![allow(dead_code, unused_macros, clippy::unused_self)]

pub mod faulty;
pub mod logged;

use async_trait::async_trait;
use keel_core::StoreResult;
use keel_core::instance::NewInstance;
use keel_core::ports::Queue;
use keel_core::ports::Store;
use keel_core::ports::queue::{Delivery, Hint, QueueCapabilities};
use keel_core::{Instance, InstanceId, Status, Timestamp, WorkerId};
use keel_queue_redis::{RedisQueue, RedisQueueConfig};
use keel_scheduler::{Client, HintConfig, StepMachine, Worker, WorkerConfig, WorkerHandle};
use keel_testkit::clock::VirtualClock;
use keel_testkit::memory::MemoryStore;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::OnceCell;

pub const T0: Timestamp = Timestamp(1_700_000_000_000);

pub struct Harness<S: Store = MemoryStore> {
    pub store: Arc<S>,
    pub clock: VirtualClock,
    pub client: Client<S, VirtualClock>,
    /// The queue in the loop (`KEEL_TEST_WORKER_QUEUE`), if any.
    pub queue: Option<Arc<dyn Queue>>,
}

/// The variable that puts a queue in the loop of every harness (`redis`).
pub const WORKER_QUEUE_VAR: &str = "KEEL_TEST_WORKER_QUEUE";

/// The queue `KEEL_TEST_WORKER_QUEUE` asks for, fresh; `None` when unset. An unknown
/// value or a missing `KEEL_TEST_REDIS_URL` is an error, not a skip.
fn queue_in_the_loop() -> Option<Arc<dyn Queue>> {
    let kind = std::env::var(WORKER_QUEUE_VAR).ok().filter(|v| !v.is_empty())?;
    assert_eq!(kind, "redis", "{WORKER_QUEUE_VAR}={kind}: the only queue it takes is `redis`");
    let url = std::env::var(keel_queue_redis::testing::URL_VAR).unwrap_or_else(|_| {
        panic!("{WORKER_QUEUE_VAR}=redis needs {}", keel_queue_redis::testing::URL_VAR)
    });
    let name = format!("harness-{:016x}", fastrand::u64(..));
    let queue = LazyQueue {
        config: RedisQueueConfig::new(url, name),
        queue: OnceCell::new(),
        published: AtomicU64::new(0),
        received: AtomicU64::new(0),
    };
    Some(Arc::new(queue))
}

/// A Redis queue that connects on first use, so a harness can be built outside a runtime.
struct LazyQueue {
    config: RedisQueueConfig,
    queue: OnceCell<RedisQueue>,
    /// Hints published and received, reported when it is dropped (with `--nocapture`).
    published: AtomicU64,
    received: AtomicU64,
}

impl Drop for LazyQueue {
    fn drop(&mut self) {
        eprintln!(
            "queue in the loop ({}): {} hints published, {} received",
            self.config.name,
            self.published.load(Ordering::Relaxed),
            self.received.load(Ordering::Relaxed)
        );
    }
}

impl LazyQueue {
    async fn get(&self) -> StoreResult<&RedisQueue> {
        self.queue.get_or_try_init(|| RedisQueue::connect(self.config.clone())).await
    }
}

#[async_trait]
impl Queue for LazyQueue {
    fn capabilities(&self) -> QueueCapabilities {
        RedisQueue::CAPABILITIES
    }
    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
        let n = hints.len() as u64;
        self.get().await?.enqueue(hints).await?;
        self.published.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>> {
        let got = self.get().await?.receive(max, visibility, wait).await?;
        self.received.fetch_add(got.len() as u64, Ordering::Relaxed);
        Ok(got)
    }
    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()> {
        self.get().await?.ack(receipts).await
    }
    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()> {
        self.get().await?.nack(receipt, delay).await
    }
    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()> {
        self.get().await?.extend(receipt, visibility).await
    }
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
        let queue = queue_in_the_loop();
        let mut client = Client::new(Arc::clone(&store), clock.clone());
        if let Some(q) = &queue {
            client = client.with_queue(Arc::clone(q));
        }
        Harness { store, clock, client, queue }
    }

    pub fn config(&self) -> WorkerConfig {
        let config = WorkerConfig {
            worker_id: WorkerId("test-worker".into()),
            poll_interval: Duration::from_millis(5),
            reap_interval: Duration::from_millis(10),
            heartbeat: Duration::from_millis(10),
            shutdown_grace: Duration::from_millis(200),
            ..WorkerConfig::default()
        };
        match self.queue {
            Some(_) => WorkerConfig {
                notifications: false,
                poll_interval: Duration::from_millis(100),
                ..config
            },
            None => config,
        }
    }

    /// `worker` with the harness's queue in the loop, if it has one.
    pub fn hinted(&self, worker: Worker<S, VirtualClock>) -> Worker<S, VirtualClock> {
        match &self.queue {
            Some(q) => {
                let config = HintConfig {
                    wait: Duration::from_millis(100),
                    repair_after: Some(Duration::from_secs(1)),
                    ..HintConfig::default()
                };
                worker.with_queue(Arc::clone(q), config).0
            }
            None => worker,
        }
    }

    pub fn worker(&self, config: WorkerConfig, machine: impl StepMachine) -> WorkerHandle {
        let worker = Worker::new(Arc::clone(&self.store), self.clock.clone(), config);
        self.hinted(worker.register(machine)).spawn()
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

/// Whether a row rests (is not running a step) with `state` among its active states.
pub fn in_state(state: &'static str) -> impl Fn(&Instance) -> bool {
    move |r| {
        r.status != Status::Executing
            && serde_json::from_str::<Vec<String>>(&r.position)
                .is_ok_and(|p| p.iter().any(|s| s == state))
    }
}

/// Polls `cond` every 5 ms for at most 5 s of real time; panics naming `what` if it
/// never holds.
pub async fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..1_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
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
