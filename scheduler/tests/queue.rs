//! Workers with a queue of hints in the loop: hints drive the steps, and losing them,
//! duplicating them or losing the queue for a while loses nothing and runs nothing twice.
//! Each test runs on `MemoryQueue`, and on Redis when `KEEL_TEST_REDIS_URL` is set.

mod common;

use async_trait::async_trait;
use common::{Harness, TestStore};
use keel_core::instance::NewInstance;
use keel_core::ports::Queue;
use keel_core::ports::Store;
use keel_core::ports::queue::{Delivery, Hint, QueueCapabilities};
use keel_core::ports::store::InsertOutcome;
use keel_core::{InstanceId, MachineRef, Outcome, Status, StoreError, StoreResult};
use keel_scheduler::{
    HintConfig, HintStats, StepContext, StepError, StepMachine, Worker, WorkerConfig, WorkerLoop,
};
use keel_testkit::MemoryQueue;
use keel_testkit::memory::MemoryStore;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Steps per instance before `Done`.
const STEPS: i64 = 3;

/// Counts `n` up to `STEPS`, one step per commit, then finishes.
struct Counter;

#[async_trait]
impl StepMachine for Counter {
    fn machine(&self) -> MachineRef {
        MachineRef::new("counter", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let n = ctx.context["n"].as_i64().unwrap_or(0);
        if n < STEPS {
            Ok(Outcome::Next { step: "count".into(), context: json!({ "n": n + 1 }) })
        } else {
            Ok(Outcome::Done { result: json!({ "n": n }), step: None })
        }
    }
}

/// A queue in front of another that can publish every hint twice and can be "down".
struct Flaky<Q> {
    inner: Arc<Q>,
    twice: bool,
    down: AtomicBool,
}

impl<Q> Flaky<Q> {
    fn new(inner: Arc<Q>, twice: bool) -> Self {
        Flaky { inner, twice, down: AtomicBool::new(false) }
    }
    fn check(&self) -> StoreResult<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("queue down (test)"));
        }
        Ok(())
    }
}

#[async_trait]
impl<Q: Queue> Queue for Flaky<Q> {
    fn capabilities(&self) -> QueueCapabilities {
        self.inner.capabilities()
    }
    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
        self.check()?;
        if self.twice {
            // A second copy under another revision, so no backend collapses the pair.
            let copies =
                hints.iter().map(|h| Hint { revision: h.revision + 1_000_000, ..h.clone() });
            self.inner.enqueue(hints.iter().cloned().chain(copies).collect()).await
        } else {
            self.inner.enqueue(hints).await
        }
    }
    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>> {
        if self.check().is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.check()?;
        self.inner.receive(max, visibility, wait).await
    }
    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()> {
        self.check()?;
        self.inner.ack(receipts).await
    }
    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()> {
        self.inner.nack(receipt, delay).await
    }
    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()> {
        self.inner.extend(receipt, visibility).await
    }
}

/// A worker with `queue` whose polling is slow enough that hints carry the run.
fn config<S: Store>(h: &Harness<S>) -> WorkerConfig {
    WorkerConfig {
        notifications: false,
        poll_interval: Duration::from_millis(200),
        queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), 16)],
        ..h.config()
    }
}

async fn start_all<S: Store>(h: &Harness<S>, n: usize) -> Vec<InstanceId> {
    let mut ids = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
        let news = chunk
            .iter()
            .map(|_| {
                NewInstance::new(MachineRef::new("counter", 1), "count").context(json!({ "n": 0 }))
            })
            .collect();
        for outcome in h.client.start_many(news).await.expect("start") {
            let InsertOutcome::Inserted(id) = outcome else { panic!("{outcome:?}") };
            ids.push(id);
        }
    }
    ids
}

/// Waits (bounded) until every instance is done; checks each committed exactly its
/// steps and the worker committed nothing twice.
async fn finish<S: Store>(
    h: &Harness<S>,
    ids: &[InstanceId],
    committed: impl Fn() -> u64,
    limit: Duration,
) {
    let expected = ids.len() as u64 * (STEPS as u64 + 1);
    let started = tokio::time::Instant::now();
    while committed() < expected {
        assert!(
            started.elapsed() < limit,
            "only {} of {expected} steps after {limit:?}",
            committed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(committed(), expected, "a step was committed twice");
    for chunk in ids.chunks(1_000) {
        for row in h.store.instance_rows(chunk.to_vec()).await.expect("rows") {
            assert_eq!(row.status, Status::Done, "{}", row.id);
            assert_eq!(row.result, Some(json!({ "n": STEPS })), "{}", row.id);
        }
    }
}

/// Runs `n` instances through a worker with `queue`; `during` runs once a third of the
/// steps are committed. Returns the hint counters.
async fn run<S: TestStore, Q: Queue>(
    queue: Arc<Q>,
    n: usize,
    during: impl AsyncFnOnce(&Q),
) -> Arc<HintStats> {
    let h = S::harness().await;
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h))
        .register(Counter)
        .with_queue(
            Arc::clone(&queue) as Arc<dyn Queue>,
            HintConfig {
                visibility: Duration::from_secs(5),
                wait: Duration::from_millis(100),
                ..HintConfig::default()
            },
        );
    let worker = worker.spawn();
    let ids = start_all(&h, n).await;
    let stats = Arc::clone(worker.stats());
    let third = ids.len() as u64 * (STEPS as u64 + 1) / 3;
    let started = tokio::time::Instant::now();
    while stats.committed() < third {
        assert!(started.elapsed() < Duration::from_secs(60), "stuck at {}", stats.committed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    during(&queue).await;
    finish(&h, &ids, || stats.committed(), Duration::from_secs(120)).await;
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0);
    worker.shutdown().await;
    hints
}

fn claimed(stats: &HintStats) -> u64 {
    stats.claimed.load(Ordering::Relaxed)
}

/// Hints take part in the run: steps are claimed because of them. How many depends on
/// timing (the fill of free slots may claim a ready instance before its hint arrives; the
/// hint then finds nothing and is acked), so only their presence is checked here; the
/// bench reports the share.
async fn hints_carry_the_steps<S: TestStore, Q: Queue>(queue: Arc<Q>) {
    let stats = run::<S, _>(queue, 300, async |_| {}).await;
    assert!(claimed(&stats) > 0, "no step came by hint");
    assert!(stats.published.load(Ordering::Relaxed) > 0, "no hint was published");
}

/// Every hint published twice: the second claim of an instance finds nothing to claim.
async fn duplicate_hints_commit_nothing_twice<S: TestStore, Q: Queue>(queue: Arc<Q>) {
    let stats = run::<S, _>(Arc::new(Flaky::new(queue, true)), 300, async |_| {}).await;
    assert!(stats.received.load(Ordering::Relaxed) > claimed(&stats), "duplicates were received");
}

/// While the queue is down the worker keeps going on polling; once it is back, the hint
/// loop receives again.
async fn queue_down_falls_back_to_polling<S: TestStore, Q: Queue>(queue: Arc<Q>) {
    let flaky = Arc::new(Flaky::new(queue, false));
    let h = S::harness().await;
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h))
        .register(Counter)
        .with_queue(
            Arc::clone(&flaky) as Arc<dyn Queue>,
            HintConfig {
                visibility: Duration::from_secs(5),
                wait: Duration::from_millis(100),
                ..HintConfig::default()
            },
        );
    flaky.down.store(true, Ordering::SeqCst);
    let worker = worker.spawn();
    let stats = Arc::clone(worker.stats());
    let ids = start_all(&h, 100).await;
    finish(&h, &ids, || stats.committed(), Duration::from_secs(60)).await;
    assert_eq!(hints.received.load(Ordering::Relaxed), 0, "received while down");
    let health = worker.health();
    let error = health.get(WorkerLoop::Hints).and_then(|l| l.last_error.clone());
    assert!(error.is_some_and(|(_, e)| e.contains("queue down")), "{health:?}");

    flaky.down.store(false, Ordering::SeqCst);
    let later = start_all(&h, 1).await;
    flaky.enqueue(vec![Hint::new(later[0], 1)]).await.expect("enqueue");
    let started = tokio::time::Instant::now();
    while hints.received.load(Ordering::Relaxed) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "the hint loop did not resume");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let all: Vec<InstanceId> = ids.iter().chain(&later).copied().collect();
    finish(&h, &all, || stats.committed(), Duration::from_secs(60)).await;
    worker.shutdown().await;
}

mod memory {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_carry_the_steps() {
        super::hints_carry_the_steps::<MemoryStore, _>(Arc::new(MemoryQueue::new())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purging_the_queue_mid_run_loses_nothing() {
        run::<MemoryStore, _>(Arc::new(MemoryQueue::new()), 10_000, async |q: &MemoryQueue| {
            q.purge();
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        super::duplicate_hints_commit_nothing_twice::<MemoryStore, _>(Arc::new(MemoryQueue::new()))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_down_falls_back_to_polling() {
        super::queue_down_falls_back_to_polling::<MemoryStore, _>(Arc::new(MemoryQueue::new()))
            .await;
    }
}

mod redis {
    use super::*;
    use keel_queue_redis::RedisQueue;

    pub(super) async fn queue(test: &str) -> Option<Arc<RedisQueue>> {
        let q = keel_queue_redis::testing::fresh_queue().await;
        keel_testkit::conformance::queue::queue_or_skip(
            &format!("redis::{test}"),
            keel_queue_redis::testing::URL_VAR,
            q,
        )
        .map(Arc::new)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_carry_the_steps() {
        let Some(q) = queue("hints_carry_the_steps").await else { return };
        super::hints_carry_the_steps::<MemoryStore, _>(q).await;
    }

    /// What `FLUSHALL` does to a queue: every key gone, leased hints included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushing_the_queue_mid_run_loses_nothing() {
        let Some(q) = queue("flushing_the_queue_mid_run_loses_nothing").await else { return };
        run::<MemoryStore, _>(q, 10_000, async |q: &RedisQueue| q.purge().await.expect("purge"))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        let Some(q) = queue("duplicate_hints_commit_nothing_twice").await else { return };
        super::duplicate_hints_commit_nothing_twice::<MemoryStore, _>(q).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_down_falls_back_to_polling() {
        let Some(q) = queue("queue_down_falls_back_to_polling").await else { return };
        super::queue_down_falls_back_to_polling::<MemoryStore, _>(q).await;
    }
}

/// PostgreSQL with a Redis queue: its claim by id is the trait's default (an ordinary
/// claim per hint), and the same guarantees hold.
mod postgres_redis {
    use super::*;
    use keel_store_postgres::PgStore;

    async fn queue(test: &str) -> Option<Arc<keel_queue_redis::RedisQueue>> {
        if !common::postgres_available(test) {
            return None;
        }
        super::redis::queue(&format!("postgres_redis::{test}")).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_carry_the_steps() {
        let Some(q) = queue("hints_carry_the_steps").await else { return };
        super::hints_carry_the_steps::<PgStore, _>(q).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushing_the_queue_mid_run_loses_nothing() {
        let Some(q) = queue("flushing_the_queue_mid_run_loses_nothing").await else { return };
        run::<PgStore, _>(q, 10_000, async |q: &keel_queue_redis::RedisQueue| {
            q.purge().await.expect("purge");
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        let Some(q) = queue("duplicate_hints_commit_nothing_twice").await else { return };
        super::duplicate_hints_commit_nothing_twice::<PgStore, _>(q).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_down_falls_back_to_polling() {
        let Some(q) = queue("queue_down_falls_back_to_polling").await else { return };
        super::queue_down_falls_back_to_polling::<PgStore, _>(q).await;
    }
}
