//! Workers with a queue of hints in the loop: hints drive the steps, and losing them,
//! duplicating them or losing the queue for a while loses nothing and runs nothing twice.
//! Each test runs on `MemoryQueue`, on Redis when `KEEL_TEST_REDIS_URL` is set, and some on
//! the SQS emulator when `KEEL_TEST_SQS_ENDPOINT` is set.

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
    Client, HintConfig, HintStats, StepContext, StepError, StepMachine, Worker, WorkerConfig,
    WorkerLoop,
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

/// Counts like `Counter` (machine `plodder`), its first step taking 100 ms: long enough
/// for the hints of another queue to be flowing by the time it ends.
struct Plodder;

#[async_trait]
impl StepMachine for Plodder {
    fn machine(&self) -> MachineRef {
        MachineRef::new("plodder", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if ctx.context["n"].as_i64() == Some(0) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Counter.step(ctx).await
    }
}

/// Sleeps a minute a step: holds its slot for the whole of a test.
struct Sleeper;

#[async_trait]
impl StepMachine for Sleeper {
    fn machine(&self) -> MachineRef {
        MachineRef::new("sleeper", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

/// Steps forever, a few milliseconds a step: keeps the hints of its queue flowing.
struct Spinner;

#[async_trait]
impl StepMachine for Spinner {
    fn machine(&self) -> MachineRef {
        MachineRef::new("spinner", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(Duration::from_millis(3)).await;
        Ok(Outcome::Next { step: "spin".into(), context: json!({}) })
    }
}

/// A queue in front of another that can publish every hint twice, can be "down" and can
/// hang (no call of it ever returns); it counts receives, nacks and the publishes under
/// way at once, takes `delay` to publish (a slow queue server) and keeps a lease at most
/// `visibility_max` (the inner queue's bound when `None`).
struct Flaky<Q> {
    inner: Arc<Q>,
    twice: bool,
    down: AtomicBool,
    hang: AtomicBool,
    delay: Duration,
    visibility_max: Option<Duration>,
    receives: std::sync::atomic::AtomicU64,
    /// How many of the next receives fail (an outage of that many calls).
    failing_receives: std::sync::atomic::AtomicU64,
    nacks: std::sync::atomic::AtomicU64,
    /// Publishes under way now, and the most there ever were at once.
    publishing: Arc<std::sync::atomic::AtomicU64>,
    publishing_max: std::sync::atomic::AtomicU64,
}

/// Counts one publish under way until dropped (when it ends or its caller gives up).
struct Publishing(Arc<std::sync::atomic::AtomicU64>);

impl Drop for Publishing {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<Q> Flaky<Q> {
    fn new(inner: Arc<Q>, twice: bool) -> Self {
        Flaky {
            inner,
            twice,
            down: AtomicBool::new(false),
            hang: AtomicBool::new(false),
            delay: Duration::ZERO,
            visibility_max: None,
            receives: std::sync::atomic::AtomicU64::new(0),
            failing_receives: std::sync::atomic::AtomicU64::new(0),
            nacks: std::sync::atomic::AtomicU64::new(0),
            publishing: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            publishing_max: std::sync::atomic::AtomicU64::new(0),
        }
    }
    /// Never returns while the queue hangs.
    async fn hang_while_hanging(&self) {
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
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
        let inner = self.inner.capabilities();
        QueueCapabilities { visibility_max: self.visibility_max.or(inner.visibility_max), ..inner }
    }
    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
        let now = self.publishing.fetch_add(1, Ordering::SeqCst) + 1;
        let _publishing = Publishing(Arc::clone(&self.publishing));
        self.publishing_max.fetch_max(now, Ordering::SeqCst);
        self.hang_while_hanging().await;
        tokio::time::sleep(self.delay).await;
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
        let failing = self
            .failing_receives
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(StoreError::unavailable("receive failed once (test)"));
        }
        self.receives.fetch_add(1, Ordering::Relaxed);
        self.hang_while_hanging().await;
        self.inner.receive(max, visibility, wait).await
    }
    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()> {
        self.hang_while_hanging().await;
        self.check()?;
        self.inner.ack(receipts).await
    }
    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()> {
        self.nacks.fetch_add(1, Ordering::Relaxed);
        self.hang_while_hanging().await;
        self.inner.nack(receipt, delay).await
    }
    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()> {
        self.inner.extend(receipt, visibility).await
    }
}

/// How a test run's worker is set up.
#[derive(Debug, Clone, Copy)]
struct Setup {
    /// Instances to run.
    n: usize,
    /// The claim loop's polling: short where polling is the fallback under test, long
    /// where the queue and its repair pass must carry the run alone.
    poll_interval: Duration,
    /// The repair bound.
    repair_after: Option<Duration>,
    /// How long the run may take.
    limit: Duration,
    /// How long one receive waits for a hint.
    wait: Duration,
}

impl Setup {
    /// Hints carry the run; polling is slow but there.
    fn hinted(n: usize) -> Self {
        Setup {
            n,
            poll_interval: Duration::from_millis(200),
            repair_after: Some(Duration::from_secs(1)),
            limit: Duration::from_secs(120),
            wait: Duration::from_millis(100),
        }
    }

    /// Only the queue and its repair pass can finish the run in time: the claim loop polls
    /// once at start and then after 10 minutes.
    fn no_polling(n: usize) -> Self {
        Setup { poll_interval: Duration::from_secs(600), ..Setup::hinted(n) }
    }

    /// For the SQS emulator: a long poll (whole seconds on SQS) waits out its second when
    /// fewer hints than asked for are there, so the run is slower.
    fn emulated(self) -> Self {
        Setup { wait: Duration::from_secs(1), limit: Duration::from_secs(600), ..self }
    }
}

/// A worker whose polling is `setup`'s.
fn config<S: Store>(h: &Harness<S>, setup: Setup) -> WorkerConfig {
    WorkerConfig {
        notifications: false,
        poll_interval: setup.poll_interval,
        queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), 16)],
        ..h.config()
    }
}

fn hint_config(setup: Setup) -> HintConfig {
    HintConfig {
        visibility: Duration::from_secs(5),
        wait: setup.wait,
        repair_after: setup.repair_after,
    }
}

/// Moves the harness's virtual clock with real time (the repair bound is measured on the
/// worker's clock), until dropped.
struct Ticking(tokio::task::JoinHandle<()>);

impl Ticking {
    fn start(clock: &keel_testkit::clock::VirtualClock) -> Self {
        let clock = clock.clone();
        Ticking(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                clock.advance(Duration::from_millis(10));
            }
        }))
    }
}

impl Drop for Ticking {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn start_all<S: Store, C: keel_core::ports::Clock>(
    client: &Client<S, C>,
    n: usize,
) -> Vec<InstanceId> {
    let mut ids = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
        let news = chunk
            .iter()
            .map(|_| {
                NewInstance::new(MachineRef::new("counter", 1), "count").context(json!({ "n": 0 }))
            })
            .collect();
        ids.extend(inserted(client, news).await);
    }
    ids
}

/// `n` new instances of `machine` v1 at step `count` in `queue`, context `{"n": 0}`.
fn counts(machine: &str, queue: &str, n: usize) -> Vec<NewInstance> {
    (0..n)
        .map(|_| {
            NewInstance::new(MachineRef::new(machine, 1), "count")
                .queue(queue)
                .context(json!({ "n": 0 }))
        })
        .collect()
}

/// Starts `news` in one batch; the ids, each newly inserted.
async fn inserted<S: Store, C: keel_core::ports::Clock>(
    client: &Client<S, C>,
    news: Vec<NewInstance>,
) -> Vec<InstanceId> {
    let outcomes = client.start_many(news).await.expect("start");
    outcomes
        .into_iter()
        .map(|outcome| {
            let InsertOutcome::Inserted(id) = outcome else { panic!("{outcome:?}") };
            id
        })
        .collect()
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
            // One revision per step: no step was applied twice.
            assert_eq!(row.revision.0, STEPS + 1, "{}", row.id);
        }
    }
}

/// Runs `setup.n` instances through a worker with `queue`, started by a client that
/// announces them on it; `during` runs once a third of the steps are committed. Returns
/// the hint counters and how long the run took after `during`.
async fn run<S: TestStore, Q: Queue>(
    queue: Arc<Q>,
    setup: Setup,
    during: impl AsyncFnOnce(&Q),
) -> (Arc<HintStats>, Duration) {
    let h = S::harness().await;
    let _ticking = Ticking::start(&h.clock);
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
        .register(Counter)
        .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
    let worker = worker.spawn();
    // The instances are started once the claim loop's first pass found nothing, so with
    // polling all but off it sleeps through the run and the hints alone hand out work.
    claim_loops_ran(&[&worker]).await;
    let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
    let ids = start_all(&client, setup.n).await;
    let stats = Arc::clone(worker.stats());
    let third = ids.len() as u64 * (STEPS as u64 + 1) / 3;
    let started = tokio::time::Instant::now();
    while stats.committed() < third {
        assert!(started.elapsed() < setup.limit, "stuck at {}", stats.committed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    during(&queue).await;
    let after = tokio::time::Instant::now();
    finish(&h, &ids, || stats.committed(), setup.limit).await;
    let took = after.elapsed();
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0);
    worker.shutdown().await;
    (hints, took)
}

/// Waits (bounded) until each worker's claim loop has made its first pass.
async fn claim_loops_ran(workers: &[&keel_scheduler::WorkerHandle]) {
    let started = tokio::time::Instant::now();
    for w in workers {
        while w.health().get(WorkerLoop::Claim).and_then(|l| l.last_success).is_none() {
            assert!(started.elapsed() < Duration::from_secs(10), "a claim loop never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn claimed(stats: &HintStats) -> u64 {
    stats.claimed.load(Ordering::Relaxed)
}

/// Hints carry the run: with polling all but off (the claim loop's one pass came before
/// the first instance), every step is claimed because of a hint.
async fn hints_carry_the_steps<S: TestStore, Q: Queue>(queue: Arc<Q>, setup: Setup) {
    let (stats, _) = run::<S, _>(queue, setup, async |_| {}).await;
    let steps = setup.n as u64 * (STEPS as u64 + 1);
    assert_eq!(claimed(&stats), steps, "steps claimed by hint");
    assert!(stats.published.load(Ordering::Relaxed) > 0, "no hint was published");
}

/// Hints that bring no work leave the freed slots to the claim loop. The backlog is
/// started by a producer without the queue, and the queue holds only hints that name no
/// ready instance (as when a slow queue delivers hints for work that polling already
/// did); with polling all but off and no repair pass, only the claim loop's refill of
/// freed slots can finish the run. A worker that kept leaving its slots to such hints
/// would sit idle until its next poll, ten minutes away. (Not run on the SQS emulator:
/// there the claim loop fills every slot before the first receive answers, so the hint
/// loop never gets to hand anything back and the test would prove nothing.)
async fn hints_that_bring_nothing_leave_slots_to_claims<S: TestStore, Q: Queue>(
    queue: Arc<Q>,
    setup: Setup,
) {
    let setup = Setup { repair_after: None, ..setup };
    let h = S::harness().await;
    let _ticking = Ticking::start(&h.clock);
    let stale: Vec<Hint> = (0..100).map(|i| Hint::new(InstanceId(1_000_000_000 + i), 1)).collect();
    queue.enqueue(stale).await.expect("enqueue stale hints");
    let ids = start_all(&h.client, setup.n).await;
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
        .register(Counter)
        .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
    let worker = worker.spawn();
    let stats = Arc::clone(worker.stats());
    finish(&h, &ids, || stats.committed(), setup.limit).await;
    assert!(hints.received.load(Ordering::Relaxed) > 0, "the hint loop received nothing");
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0);
    worker.shutdown().await;
}

/// Every hint lost mid-run (`lose`: a purge, a `FLUSHALL`) and polling all but off: the
/// repair pass announces the stranded instances again and the run ends, every instance
/// done once, within the repair bound of the loss plus the work itself.
async fn losing_every_hint_mid_run_loses_nothing<S: TestStore, Q: Queue>(
    queue: Arc<Q>,
    setup: Setup,
    lose: impl AsyncFnOnce(&Q),
) {
    losing_hints_mid_run::<S, Q>(queue, setup, true, lose).await;
}

/// [`losing_every_hint_mid_run_loses_nothing`], where `repair_seen` says whether the
/// repair pass must have published: the SQS emulator's `PurgeQueue` was seen to leave a
/// run nothing to repair, so there only the outcome is checked.
async fn losing_hints_mid_run<S: TestStore, Q: Queue>(
    queue: Arc<Q>,
    setup: Setup,
    repair_seen: bool,
    lose: impl AsyncFnOnce(&Q),
) {
    let n = setup.n;
    let (stats, took) = run::<S, _>(queue, setup, lose).await;
    let repaired = stats.repaired.load(Ordering::Relaxed);
    assert!(!repair_seen || repaired > 0, "the repair pass published nothing after the loss");
    eprintln!(
        "{n} instances: done {took:?} after the loss; {repaired} hints repaired, {} claimed by hint",
        claimed(&stats)
    );
}

/// Every hint published twice: the second claim of an instance finds nothing to claim.
async fn duplicate_hints_commit_nothing_twice<S: TestStore, Q: Queue>(queue: Arc<Q>, setup: Setup) {
    let flaky = Arc::new(Flaky::new(queue, true));
    let (stats, _) = run::<S, _>(flaky, setup, async |_| {}).await;
    assert!(stats.received.load(Ordering::Relaxed) > claimed(&stats), "duplicates were received");
}

/// While the queue is down the worker keeps going on polling; once it is back, the hint
/// loop receives again.
async fn queue_down_falls_back_to_polling<S: TestStore, Q: Queue>(queue: Arc<Q>) {
    let flaky = Arc::new(Flaky::new(queue, false));
    let h = S::harness().await;
    let setup = Setup::hinted(100);
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
        .register(Counter)
        .with_queue(Arc::clone(&flaky) as Arc<dyn Queue>, hint_config(setup));
    flaky.down.store(true, Ordering::SeqCst);
    let worker = worker.spawn();
    let stats = Arc::clone(worker.stats());
    let ids = start_all(&h.client, 100).await;
    finish(&h, &ids, || stats.committed(), Duration::from_secs(60)).await;
    assert_eq!(hints.received.load(Ordering::Relaxed), 0, "received while down");
    let health = worker.health();
    let error = health.get(WorkerLoop::Hints).and_then(|l| l.last_error.clone());
    assert!(error.is_some_and(|(_, e)| e.contains("queue down")), "{health:?}");

    flaky.down.store(false, Ordering::SeqCst);
    let later = start_all(&h.client, 1).await;
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

/// See `redis::server_down_for_30_s_falls_back_to_polling_then_resumes`.
async fn server_down_then_back<S: TestStore>(
    mut server: keel_queue_redis::testing::PrivateServer,
    queue: Arc<keel_queue_redis::RedisQueue>,
) {
    const DOWN: Duration = Duration::from_secs(30);
    let h = S::harness().await;
    let _ticking = Ticking::start(&h.clock);
    let setup = Setup::hinted(300);
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
        .register(Counter)
        .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
    let worker = worker.spawn();
    let stats = Arc::clone(worker.stats());
    let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);

    let before = start_all(&client, 300).await;
    finish(&h, &before, || stats.committed(), setup.limit).await;
    assert!(claimed(&hints) > 0, "no step came by hint before the server went down");

    server.shutdown();
    let down = tokio::time::Instant::now();
    let during = start_all(&client, 300).await;
    let all: Vec<InstanceId> = before.iter().chain(&during).copied().collect();
    let received = hints.received.load(Ordering::Relaxed);
    finish(&h, &all, || stats.committed(), DOWN).await;
    let polled = down.elapsed();
    assert_eq!(hints.received.load(Ordering::Relaxed), received, "received while down");
    let health = worker.health();
    assert!(
        health.get(WorkerLoop::Hints).and_then(|l| l.last_error.clone()).is_some(),
        "the hint loop did not notice: {health:?}"
    );
    tokio::time::sleep(DOWN.saturating_sub(down.elapsed())).await;

    server.restart();
    let back = tokio::time::Instant::now();
    let claimed_before = claimed(&hints);
    // One announced instance at a time until one is claimed by its hint: the hint loop
    // reconnected (after at most its back-off) and receives again.
    let mut probes = Vec::new();
    while claimed(&hints) == claimed_before {
        assert!(back.elapsed() < Duration::from_secs(20), "the hint loop did not resume");
        probes.extend(start_all(&client, 1).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let resumed = back.elapsed();
    let after = start_all(&client, 300).await;
    let all: Vec<InstanceId> = all.iter().chain(&probes).chain(&after).copied().collect();
    finish(&h, &all, || stats.committed(), setup.limit).await;
    eprintln!(
        "server down {DOWN:?}: 300 instances done on polling in {polled:?}; hints claimed \
         again {resumed:?} after it returned; {} steps by hint since",
        claimed(&hints) - claimed_before
    );
    worker.shutdown().await;
}

/// See `redis::a_worker_started_while_redis_is_down_polls_then_takes_hints`: `server` is
/// down and `queue` was made lazily on it.
async fn started_while_the_server_is_down<S: TestStore>(
    mut server: keel_queue_redis::testing::PrivateServer,
    queue: Arc<keel_queue_redis::RedisQueue>,
) {
    let h = S::harness().await;
    let _ticking = Ticking::start(&h.clock);
    let setup = Setup::hinted(100);
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
        .register(Counter)
        .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
    let worker = worker.spawn();
    let stats = Arc::clone(worker.stats());
    let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
    let during = start_all(&client, 100).await;
    finish(&h, &during, || stats.committed(), Duration::from_secs(30)).await;
    assert_eq!(hints.received.load(Ordering::Relaxed), 0, "received while down");

    server.restart();
    let back = tokio::time::Instant::now();
    // One announced instance at a time until one is claimed by its hint: the queue
    // connected and the hint loop receives.
    let mut probes = Vec::new();
    while claimed(&hints) == 0 {
        assert!(back.elapsed() < Duration::from_secs(20), "hints never flowed");
        probes.extend(start_all(&client, 1).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all: Vec<InstanceId> = during.iter().chain(&probes).copied().collect();
    finish(&h, &all, || stats.committed(), setup.limit).await;
    worker.shutdown().await;
}

/// A machine the counting worker does not serve.
struct Elsewhere;

#[async_trait]
impl StepMachine for Elsewhere {
    fn machine(&self) -> MachineRef {
        MachineRef::new("elsewhere", 1)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

/// Workers of different machines share one queue, as a deployment's processes do, with
/// polling all but off and no repair pass: a hint the worker that received it cannot claim
/// (another worker's machine) goes back to the queue for the others instead of being
/// dropped, so every step is still carried by hints.
async fn hints_for_another_workers_machine_go_back<S: TestStore, Q: Queue>(
    queue: Arc<Q>,
    setup: Setup,
) {
    let setup = Setup { repair_after: None, ..setup };
    let h = S::harness().await;
    let _ticking = Ticking::start(&h.clock);
    let named = |id: &str| WorkerConfig {
        worker_id: keel_core::ids::WorkerId(id.to_owned()),
        ..config(&h, setup)
    };
    let (counting, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), named("counting"))
        .register(Counter)
        .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
    let (other, other_hints) =
        Worker::new(Arc::clone(&h.store), h.clock.clone(), named("elsewhere"))
            .register(Elsewhere)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
    let (counting, other) = (counting.spawn(), other.spawn());
    claim_loops_ran(&[&counting, &other]).await;
    let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
    let ids = start_all(&client, setup.n).await;
    let stats = Arc::clone(counting.stats());
    finish(&h, &ids, || stats.committed(), setup.limit).await;
    let steps = setup.n as u64 * (STEPS as u64 + 1);
    assert_eq!(claimed(&hints), steps, "steps claimed by hint");
    assert_eq!(claimed(&other_hints), 0);
    counting.shutdown().await;
    other.shutdown().await;
}

/// A `Flaky` in front of a fresh `MemoryQueue`, neither doubling nor down.
fn probe() -> Flaky<MemoryQueue> {
    Flaky::new(Arc::new(MemoryQueue::new()), false)
}

/// A queue with a queue-wide limit leaves its claims to the claim loop, so a worker
/// whose every queue has one takes no hints at all: it must not receive them only to
/// hand them back, round after round, while its slots stand free, nor announce its own
/// steps there. The client still announces the five starts, which no worker takes: what
/// keeps them is the queue's business (a Redis queue holds at most its capacity).
async fn a_worker_whose_queues_are_all_limited_leaves_hints_alone<Q: Queue>(queue: &Arc<Flaky<Q>>) {
    let h = MemoryStore::harness().await;
    let _ticking = Ticking::start(&h.clock);
    let setup = Setup::hinted(5);
    let settings = keel_core::config::KeelConfig::from_toml_str(
        "[queues.default]\nglobal_concurrency = 100\n",
    )
    .unwrap();
    let config = config(&h, setup).with_settings(settings).unwrap();
    let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(Counter)
        .with_queue(Arc::clone(queue) as Arc<dyn Queue>, hint_config(setup));
    let worker = worker.spawn();
    let client = h.client.clone().with_queue(Arc::clone(queue) as Arc<dyn Queue>);
    let ids = start_all(&client, setup.n).await;
    let stats = Arc::clone(worker.stats());
    finish(&h, &ids, || stats.committed(), setup.limit).await;
    // A worker that took the starts' hints would be receiving and handing them back all
    // the while.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (receives, nacks) =
        (queue.receives.load(Ordering::Relaxed), queue.nacks.load(Ordering::Relaxed));
    assert_eq!((receives, nacks), (0, 0), "hints received and handed back");
    assert_eq!(hints.published.load(Ordering::Relaxed), 0, "hints published");
    worker.shutdown().await;
}

mod memory {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_for_another_workers_machine_go_back() {
        super::hints_for_another_workers_machine_go_back::<MemoryStore, _>(
            Arc::new(MemoryQueue::new()),
            Setup { limit: Duration::from_secs(60), ..Setup::no_polling(50) },
        )
        .await;
    }

    /// A visibility longer than the queue keeps a lease is refused up front, naming the
    /// field and the queue's bound, instead of failing every receive later.
    #[test]
    fn a_visibility_the_queue_cannot_keep_is_refused() {
        let hour = Duration::from_secs(3600);
        let queue = Flaky { visibility_max: Some(hour), ..probe() };
        let long = HintConfig { visibility: 2 * hour, ..HintConfig::default() };
        let error = long.validate_for(&queue).unwrap_err();
        assert!(error.starts_with("visibility: 7200s is longer than this queue keeps"), "{error}");
        HintConfig { visibility: hour, ..HintConfig::default() }.validate_for(&queue).unwrap();
    }

    /// A start is stored once the store says so; a queue that hangs delays only the
    /// announcement, which still goes out, not the caller.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hanging_queue_does_not_hold_up_starts() {
        let h = MemoryStore::harness().await;
        let queue = Arc::new(Flaky { delay: Duration::from_secs(3), ..probe() });
        let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
        let began = tokio::time::Instant::now();
        let ids = start_all(&client, 1).await;
        assert!(
            began.elapsed() < Duration::from_secs(2),
            "the start waited {:?} for the queue",
            began.elapsed()
        );
        let hinted = loop {
            let got = queue.inner.receive(1, Duration::from_secs(5), Duration::ZERO).await.unwrap();
            if let Some(d) = got.first() {
                break d.hint.instance;
            }
            assert!(began.elapsed() < Duration::from_secs(20), "the hint never arrived");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(hinted, ids[0]);
    }

    /// While the store refuses claims by id, the hint loop backs off and says so in its
    /// health, rather than taking hint after hint off the queue to fail each claim.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_refusing_claims_by_hint_makes_the_hint_loop_back_off() {
        use common::faulty::{Faulty, Hooks};
        // Claims of every kind fail: the one slot stays free for the hint loop.
        let hooks = Hooks {
            claim_ids_unavailable: true,
            claims_unavailable_in: vec![keel_core::ids::DEFAULT_QUEUE.to_owned()],
            ..Hooks::default()
        };
        let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
        let queue = Arc::new(probe());
        let setup = Setup { poll_interval: Duration::from_millis(100), ..Setup::hinted(50) };
        let config = WorkerConfig {
            queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), 1)],
            ..config(&h, setup)
        };
        let (worker, _) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
            .register(Counter)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
        let worker = worker.spawn();
        let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
        start_all(&client, setup.n).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        // One hint per receive (one slot): without a back-off, all fifty would be tried.
        let tries = h.store.calls("instance_claim_ids");
        assert!((1..=8).contains(&tries), "{tries} claims by hint in 500 ms");
        let hints = worker.health().get(WorkerLoop::Hints).cloned().expect("hint loop");
        let (_, error) =
            hints.last_error.clone().expect("the failed claims are in the hint loop's health");
        assert!(error.contains("claim by hint"), "{error}");
        assert!(hints.consecutive_failures > 0, "{hints:?}");
        worker.shutdown().await;
    }

    /// One failed receive (a queue server's blip) does not switch the hints off for the
    /// poll interval: the hint loop tries again after a short back-off, so an instance
    /// announced after the blip runs by its hints while polling is ten minutes away.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_failed_receive_does_not_stop_the_hints_for_a_poll_interval() {
        let h = MemoryStore::harness().await;
        let _ticking = Ticking::start(&h.clock);
        let queue = Arc::new(probe());
        queue.failing_receives.store(1, Ordering::SeqCst);
        let setup = Setup { repair_after: None, ..Setup::no_polling(1) };
        let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
            .register(Counter)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
        let worker = worker.spawn();
        claim_loops_ran(&[&worker]).await;
        let began = tokio::time::Instant::now();
        while worker.health().get(WorkerLoop::Hints).and_then(|l| l.last_error.clone()).is_none() {
            assert!(began.elapsed() < Duration::from_secs(10), "the receive never failed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
        let ids = start_all(&client, 1).await;
        let stats = Arc::clone(worker.stats());
        finish(&h, &ids, || stats.committed(), Duration::from_secs(5)).await;
        assert_eq!(claimed(&hints), STEPS as u64 + 1, "every step came by hint");
        worker.shutdown().await;
    }

    /// A claim by hint takes no more rows of a queue than that queue has free slots, even
    /// when the worker's other queues have many: a burst of 40 hints for a queue of 2
    /// slots, next to a queue of 50, starts 2 and leaves the rest to later hints, rather
    /// than claiming 40 and giving 38 leases back one store call at a time. The run ends
    /// with polling ten minutes away.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_by_hint_takes_no_more_of_a_queue_than_its_free_slots() {
        let h = MemoryStore::harness().await;
        let _ticking = Ticking::start(&h.clock);
        let queue = Arc::new(MemoryQueue::new());
        let setup = Setup { limit: Duration::from_secs(60), ..Setup::no_polling(40) };
        let config = WorkerConfig {
            queues: vec![("a".to_owned(), 2), ("b".to_owned(), 50)],
            ..config(&h, setup)
        };
        let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
            .register(Counter)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
        let worker = worker.spawn();
        claim_loops_ran(&[&worker]).await;
        let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
        let news = counts("counter", "a", setup.n);
        let ids = inserted(&client, news).await;
        let stats = Arc::clone(worker.stats());
        finish(&h, &ids, || stats.committed(), setup.limit).await;
        assert_eq!(
            stats.released.load(Ordering::Relaxed),
            0,
            "rows claimed by hint beyond their queue's free slots were given back"
        );
        assert!(claimed(&hints) > 0, "no step came by hint");
        worker.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_whose_queues_are_all_limited_leaves_hints_alone() {
        let queue = Arc::new(probe());
        super::a_worker_whose_queues_are_all_limited_leaves_hints_alone(&queue).await;
        assert_eq!(queue.inner.len(), 5, "a memory queue keeps what no worker takes");
    }

    /// A shutdown during a repair pass over a huge backlog (every page full, each taking
    /// 100 ms: a whole pass of a hundred pages would take ten seconds) waits for the page
    /// under way, not for the pass, and reads no page after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_stops_a_long_repair_pass_between_pages() {
        use common::faulty::{Faulty, Hooks};
        let hooks =
            Hooks { ready_stale_full_after: Some(Duration::from_millis(100)), ..Hooks::default() };
        let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
        let queue = Arc::new(MemoryQueue::new());
        let setup = Setup { repair_after: Some(Duration::from_millis(200)), ..Setup::hinted(2) };
        // One slot: the first instance holds it, the second stays ready for the repair
        // pass to find.
        let config = WorkerConfig {
            queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), 1)],
            shutdown_grace: Duration::from_millis(50),
            ..config(&h, setup)
        };
        let (worker, _) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
            .register(Sleeper)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
        let worker = worker.spawn();
        for _ in 0..setup.n {
            h.start(NewInstance::new(MachineRef::new("sleeper", 1), "sleep")).await;
        }
        // Both have been ready for far longer than the repair bound.
        h.clock.advance(Duration::from_secs(60));
        let began = tokio::time::Instant::now();
        while h.store.calls("instance_ready_stale") < 3 {
            assert!(began.elapsed() < Duration::from_secs(10), "no repair pass under way");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stats = tokio::time::timeout(Duration::from_secs(3), worker.shutdown()).await;
        assert!(stats.is_ok(), "shutdown waited for the whole repair pass");
        let read = h.store.calls("instance_ready_stale");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(h.store.calls("instance_ready_stale"), read, "the pass went on after shutdown");
    }

    /// A worker serving a queue hints feed (`a`) and a queue with a queue-wide limit (`b`,
    /// which hints never claim into) refills `b` the moment one of its slots frees, while
    /// hints flow for `a` the whole time: `b`'s steps run one after the other at step
    /// speed, not one per poll interval (ten minutes here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_limited_queue_next_to_a_hinted_one_refills_while_hints_flow() {
        let h = MemoryStore::harness().await;
        let _ticking = Ticking::start(&h.clock);
        let queue = Arc::new(MemoryQueue::new());
        let setup = Setup::no_polling(10);
        let settings =
            keel_core::config::KeelConfig::from_toml_str("[queues.b]\nglobal_concurrency = 100\n")
                .unwrap();
        let config = WorkerConfig {
            queues: vec![("a".to_owned(), 2), ("b".to_owned(), 1)],
            ..config(&h, setup)
        }
        .with_settings(settings)
        .unwrap();
        // Started before the worker, by a client without the queue: the claim loop's first
        // pass takes them; only `a`'s steps are hinted after that, and they flow by the
        // time the first of `b`'s (100 ms) ends.
        let plain = Client::new(Arc::clone(&h.store), h.clock.clone());
        for _ in 0..8 {
            let spin = NewInstance::new(MachineRef::new("spinner", 1), "spin").queue("a");
            plain.start(spin).await.expect("start");
        }
        let news = counts("plodder", "b", setup.n);
        let ids = inserted(&plain, news).await;
        let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
            .register(Plodder)
            .register(Spinner)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
        let worker = worker.spawn();
        let done = |rows: &[keel_core::instance::Instance]| {
            rows.iter().filter(|r| r.status == Status::Done).count()
        };
        let began = tokio::time::Instant::now();
        loop {
            let rows = h.store.instance_rows(ids.clone()).await.expect("rows");
            if done(&rows) == ids.len() {
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(20),
                "{} of {} instances of the limited queue done after 20 s (hints claimed {})",
                done(&rows),
                ids.len(),
                claimed(&hints)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(claimed(&hints) > 0, "hints never flowed for queue a");
        worker.shutdown().await;
    }

    /// A queue that never answers stops neither the hint loop nor the worker: a receive
    /// gives up after its wait and a margin (and the loop tries again once the queue is
    /// back), and the publishes after commits and starts that wait on it are bounded in
    /// number; the hints beyond are dropped and counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hanging_queue_stops_neither_the_hint_loop_nor_piles_up_publishes() {
        let h = MemoryStore::harness().await;
        let _ticking = Ticking::start(&h.clock);
        let queue = Arc::new(probe());
        queue.hang.store(true, Ordering::SeqCst);
        let setup = Setup { poll_interval: Duration::from_millis(50), ..Setup::hinted(300) };
        let (worker, hints) = Worker::new(Arc::clone(&h.store), h.clock.clone(), config(&h, setup))
            .register(Counter)
            .with_queue(Arc::clone(&queue) as Arc<dyn Queue>, hint_config(setup));
        let worker = worker.spawn();
        let stats = Arc::clone(worker.stats());
        let ids = start_all(&h.client, setup.n).await;
        finish(&h, &ids, || stats.committed(), Duration::from_secs(60)).await;
        // Whether the worker's own cap drops hints here depends on how many group commits
        // its 300 steps make within one call's timeout (fewer, larger ones on a loaded
        // machine); the bound on what waits at once is checked below, and the client's
        // drops, which do not depend on batching, next.

        // A client announcing on the same hanging queue holds at most its own bound of
        // publishes too.
        let client = h.client.clone().with_queue(Arc::clone(&queue) as Arc<dyn Queue>);
        for _ in 0..keel_scheduler::worker::PUBLISHES_MAX + 5 {
            start_all(&client, 1).await;
        }
        assert!(client.hints_dropped() >= 5, "{} hints dropped", client.hints_dropped());
        // The worker's bound, the client's, and the one publish of a repair pass.
        let most = queue.publishing_max.load(Ordering::SeqCst);
        assert!(
            most <= 2 * keel_scheduler::worker::PUBLISHES_MAX as u64 + 1,
            "{most} publishes waited on the queue at once"
        );

        // The hung receive was given up on and reported.
        let began = tokio::time::Instant::now();
        let error = loop {
            let health = worker.health();
            if let Some((_, e)) = health.get(WorkerLoop::Hints).and_then(|l| l.last_error.clone()) {
                break e;
            }
            assert!(began.elapsed() < Duration::from_secs(30), "the hint loop never gave up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            error.starts_with("receive hints:")
                && error.contains("queue receive: no answer within"),
            "{error}"
        );

        // Once the queue answers again, the same loop receives. A receive it began while
        // the queue still hung gives up only after its margin, and the claim loop (polling
        // every 50 ms meanwhile) may take an announced instance first, so one announced
        // instance at a time until one is claimed by its hint.
        queue.hang.store(false, Ordering::SeqCst);
        let began = tokio::time::Instant::now();
        while hints.claimed.load(Ordering::Relaxed) == 0 {
            assert!(began.elapsed() < Duration::from_secs(30), "the hint loop did not resume");
            let later = start_all(&h.client, 1).await;
            queue.inner.enqueue(vec![Hint::new(later[0], 1)]).await.expect("enqueue");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        worker.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_carry_the_steps() {
        super::hints_carry_the_steps::<MemoryStore, _>(
            Arc::new(MemoryQueue::new()),
            Setup::no_polling(300),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purging_the_queue_mid_run_loses_nothing() {
        let queue = Arc::new(MemoryQueue::new());
        losing_every_hint_mid_run_loses_nothing::<MemoryStore, _>(
            queue,
            Setup::no_polling(10_000),
            async |q| {
                q.purge();
            },
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        super::duplicate_hints_commit_nothing_twice::<MemoryStore, _>(
            Arc::new(MemoryQueue::new()),
            Setup::no_polling(300),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_down_falls_back_to_polling() {
        super::queue_down_falls_back_to_polling::<MemoryStore, _>(Arc::new(MemoryQueue::new()))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_that_bring_nothing_leave_slots_to_claims() {
        super::hints_that_bring_nothing_leave_slots_to_claims::<MemoryStore, _>(
            Arc::new(MemoryQueue::new()),
            Setup { limit: Duration::from_secs(60), ..Setup::no_polling(300) },
        )
        .await;
    }
}

mod redis {
    use super::*;
    use keel_queue_redis::testing::PrivateServer;
    use keel_queue_redis::{RedisQueue, RedisQueueConfig};

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
        super::hints_carry_the_steps::<MemoryStore, _>(q, Setup::no_polling(300)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_for_another_workers_machine_go_back() {
        let Some(q) = queue("hints_for_another_workers_machine_go_back").await else { return };
        super::hints_for_another_workers_machine_go_back::<MemoryStore, _>(
            q,
            Setup { limit: Duration::from_secs(60), ..Setup::no_polling(50) },
        )
        .await;
    }

    /// Hints that no worker receives (their queue's claims are the claim loop's) do not
    /// pile up in Redis: the queue keeps at most its capacity, dropping (and counting) the
    /// ones waiting longest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_whose_queues_are_all_limited_leaves_hints_alone() {
        let q = match std::env::var(keel_queue_redis::testing::URL_VAR) {
            Ok(url) => {
                let name = format!("test-{:016x}", fastrand::u64(..));
                let config = RedisQueueConfig::new(url, name).capacity(3);
                Some(RedisQueue::connect(config).await.expect("redis"))
            }
            Err(_) => None,
        };
        let Some(q) = keel_testkit::conformance::queue::queue_or_skip(
            "redis::a_worker_whose_queues_are_all_limited_leaves_hints_alone",
            keel_queue_redis::testing::URL_VAR,
            q,
        ) else {
            return;
        };
        let queue = Arc::new(Flaky::new(Arc::new(q), false));
        super::a_worker_whose_queues_are_all_limited_leaves_hints_alone(&queue).await;
        // A publish trims only hints visible before its own millisecond: the five starts'
        // hints may have come in one millisecond and still be five. The next publish,
        // half a second later, brings the queue back to its capacity whatever they did,
        // keeping the hint it adds.
        let late = Hint::new(InstanceId(9_000_000_000), 0);
        queue.inner.enqueue(vec![late.clone()]).await.expect("publish");
        assert_eq!(queue.inner.len().await.unwrap(), 3, "the queue holds its capacity");
        assert_eq!(queue.inner.dropped(), 3, "the three oldest hints were dropped");
        let left: Vec<Hint> = queue
            .inner
            .receive(3, Duration::from_secs(30), Duration::ZERO)
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.hint)
            .collect();
        assert!(left.contains(&late), "the hint just published stays: {left:?}");
    }

    /// A queue on a private server of the test's own (it flushes or stops it), when Redis
    /// tests are on at all (`KEEL_TEST_REDIS_URL`).
    pub(super) async fn private(test: &str) -> Option<(PrivateServer, Arc<RedisQueue>)> {
        let on = std::env::var(keel_queue_redis::testing::URL_VAR).is_ok();
        let server = on.then(PrivateServer::start);
        let q = match &server {
            Some(server) => {
                let config = RedisQueueConfig::new(server.url(), "private");
                Some(RedisQueue::connect(config).await.expect("private redis"))
            }
            None => None,
        };
        let q = keel_testkit::conformance::queue::queue_or_skip(
            &format!("redis::{test}"),
            keel_queue_redis::testing::URL_VAR,
            q,
        )?;
        Some((server.expect("started"), Arc::new(q)))
    }

    /// `FLUSHALL` on the queue's server in the middle of a 10 000-instance run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushall_mid_run_loses_nothing() {
        let Some((server, q)) = private("flushall_mid_run_loses_nothing").await else { return };
        losing_every_hint_mid_run_loses_nothing::<MemoryStore, _>(
            q,
            Setup::no_polling(10_000),
            async |_| {
                server.flushall();
            },
        )
        .await;
    }

    /// The queue's server stopped for 30 s mid-run (`SHUTDOWN NOSAVE`) and started again
    /// empty: the worker keeps going on polling meanwhile (and clients keep starting work),
    /// then receives hints again; nothing is lost or done twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_down_for_30_s_falls_back_to_polling_then_resumes() {
        let Some((server, q)) = private("server_down_for_30_s").await else { return };
        super::server_down_then_back::<MemoryStore>(server, q).await;
    }

    /// A worker whose process starts while Redis is down, on a queue made with
    /// `connect_lazy`, runs its steps by polling, and by hints once the server is up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_started_while_redis_is_down_polls_then_takes_hints() {
        let on = std::env::var(keel_queue_redis::testing::URL_VAR).is_ok();
        let Some(mut server) = keel_testkit::conformance::queue::queue_or_skip(
            "redis::a_worker_started_while_redis_is_down",
            keel_queue_redis::testing::URL_VAR,
            on.then(PrivateServer::start),
        ) else {
            return;
        };
        server.shutdown();
        let queue = RedisQueue::connect_lazy(RedisQueueConfig::new(server.url(), "lazy"))
            .await
            .expect("a lazy queue is made while its server is down");
        super::started_while_the_server_is_down::<MemoryStore>(server, Arc::new(queue)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        let Some(q) = queue("duplicate_hints_commit_nothing_twice").await else { return };
        super::duplicate_hints_commit_nothing_twice::<MemoryStore, _>(q, Setup::no_polling(300))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_down_falls_back_to_polling() {
        let Some(q) = queue("queue_down_falls_back_to_polling").await else { return };
        super::queue_down_falls_back_to_polling::<MemoryStore, _>(q).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_that_bring_nothing_leave_slots_to_claims() {
        let Some(q) = queue("hints_that_bring_nothing_leave_slots_to_claims").await else {
            return;
        };
        let setup = Setup { limit: Duration::from_secs(60), ..Setup::no_polling(300) };
        super::hints_that_bring_nothing_leave_slots_to_claims::<MemoryStore, _>(q, setup).await;
    }
}

/// SQS (the emulator) as the queue: purged mid-run, and every hint twice.
mod sqs {
    use super::*;
    use keel_queue_sqs::SqsQueue;

    pub(super) async fn queue(test: &str) -> Option<Arc<SqsQueue>> {
        let q = keel_queue_sqs::testing::fresh_queue().await;
        keel_testkit::conformance::queue::queue_or_skip(
            &format!("sqs::{test}"),
            keel_queue_sqs::testing::ENDPOINT_VAR,
            q,
        )
        .map(Arc::new)
    }

    /// `PurgeQueue` in the middle of the run. The runs on the emulator are small: its calls
    /// scan every message the queue holds, so time grows with the square of the run (300
    /// instances took 400 s of the 600 s limit on a slower machine, 100 take a tenth).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purging_the_queue_mid_run_loses_nothing() {
        let Some(q) = queue("purging_the_queue_mid_run_loses_nothing").await else { return };
        let setup = Setup::no_polling(100).emulated();
        losing_hints_mid_run::<MemoryStore, _>(q, setup, false, async |q| {
            q.purge().await.expect("purge");
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        let Some(q) = queue("duplicate_hints_commit_nothing_twice").await else { return };
        let setup = Setup::no_polling(40).emulated();
        super::duplicate_hints_commit_nothing_twice::<MemoryStore, _>(q, setup).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_carry_the_steps() {
        let Some(q) = queue("hints_carry_the_steps").await else { return };
        super::hints_carry_the_steps::<MemoryStore, _>(q, Setup::no_polling(40).emulated()).await;
    }
}

/// PostgreSQL with an SQS queue, as the `steps` and `chart` benchmarks run them: every
/// step comes by hint when polling cannot race the hints.
mod postgres_sqs {
    use super::*;
    use keel_store_postgres::PgStore;

    async fn queue(test: &str) -> Option<Arc<keel_queue_sqs::SqsQueue>> {
        if !common::postgres_available(test) {
            return None;
        }
        super::sqs::queue(&format!("postgres_sqs::{test}")).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_carry_the_steps() {
        let Some(q) = queue("hints_carry_the_steps").await else { return };
        super::hints_carry_the_steps::<PgStore, _>(q, Setup::no_polling(40).emulated()).await;
    }
}

/// PostgreSQL with a Redis queue: the same guarantees hold with PostgreSQL's claim by id.
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
        super::hints_carry_the_steps::<PgStore, _>(q, Setup::no_polling(300)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushall_mid_run_loses_nothing() {
        if !common::postgres_available("flushall_mid_run_loses_nothing") {
            return;
        }
        let Some((server, q)) = super::redis::private("postgres_redis::flushall_mid_run").await
        else {
            return;
        };
        losing_every_hint_mid_run_loses_nothing::<PgStore, _>(
            q,
            Setup::no_polling(10_000),
            async |_| {
                server.flushall();
            },
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_down_for_30_s_falls_back_to_polling_then_resumes() {
        if !common::postgres_available("server_down_for_30_s") {
            return;
        }
        let Some((server, q)) = super::redis::private("postgres_redis::server_down").await else {
            return;
        };
        super::server_down_then_back::<PgStore>(server, q).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_hints_commit_nothing_twice() {
        let Some(q) = queue("duplicate_hints_commit_nothing_twice").await else { return };
        super::duplicate_hints_commit_nothing_twice::<PgStore, _>(q, Setup::no_polling(300)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_down_falls_back_to_polling() {
        let Some(q) = queue("queue_down_falls_back_to_polling").await else { return };
        super::queue_down_falls_back_to_polling::<PgStore, _>(q).await;
    }
}
