//! The configuration file takes effect in the worker: an event's section overrides its
//! machine's per step, and a queue's global limit holds across several workers.
//!
//! Generic tests run on `MemoryStore` and on PostgreSQL (fresh schema per test, needs
//! `KEEL_TEST_DATABASE_URL`; failing under `KEEL_REQUIRE_BACKENDS=1` without it).

#![allow(clippy::unnecessary_wraps)]

#[macro_use]
mod common;

use async_trait::async_trait;
use common::TestStore;
use keel_core::config::KeelConfig;
use keel_core::instance::NewInstance;
use keel_core::ports::Clock;
use keel_core::{MachineRef, NewSignal, Outcome, Status, WorkerId};
use keel_scheduler::{StepContext, StepError, StepMachine, WorkerConfig};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

on_every_store!(
    an_events_section_overrides_its_machines_timeout_and_retry,
    a_global_limit_holds_across_three_workers,
    a_key_limit_of_three_holds_across_three_workers,
);

// Ten seconds of real time: run on PostgreSQL only, where the limit is shared.
mod rate {
    on_stores!(memory: [], postgres: [
        a_rate_limit_of_100_per_second_holds_across_three_workers,
        a_rate_limit_with_a_burst_of_one_holds_across_three_workers,
    ]);
    use super::{
        a_rate_limit_of_100_per_second_holds_across_three_workers,
        a_rate_limit_with_a_burst_of_one_holds_across_three_workers,
    };
}

fn machine() -> MachineRef {
    MachineRef::new("shop", 1)
}

/// Parks for a signal, then spends `work` on it.
struct Shop {
    work: Duration,
}

#[async_trait]
impl StepMachine for Shop {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if ctx.signals.is_empty() {
            return Ok(Outcome::Await { signal: "*".into(), context: json!({}), step: None });
        }
        tokio::time::sleep(self.work).await;
        Ok(Outcome::Done { result: json!("ok"), step: None })
    }
}

fn settings(toml: &str) -> KeelConfig {
    KeelConfig::from_toml_str(toml).unwrap_or_else(|e| panic!("{e}"))
}

async fn an_events_section_overrides_its_machines_timeout_and_retry<S: TestStore>() {
    let h = S::harness().await;
    let file = settings(
        r#"
        [machines.shop.queue]
        timeout = "10 seconds"
        [machines.shop.events.checkout.queue]
        timeout = "50 ms"
        [machines.shop.events.checkout.queue.retry]
        max_attempts = 1
        "#,
    );
    let config = h.config().with_settings(file).expect("every key applied");
    let worker = h.worker(config, Shop { work: Duration::from_millis(300) });
    let browse = h.start(NewInstance::new(machine(), "a")).await;
    let checkout = h.start(NewInstance::new(machine(), "a")).await;
    let parked = |r: &keel_core::Instance| r.status == Status::AwaitingSignal;
    h.wait(browse, "parked", parked).await;
    h.wait(checkout, "parked", parked).await;
    h.client.send(NewSignal::new(browse, "browse")).await.expect("send");
    h.client.send(NewSignal::new(checkout, "checkout")).await.expect("send");
    // The event's 50 ms timeout and single attempt apply to `checkout` only.
    let failed = h.wait(checkout, "suspended", |r| r.status == Status::Suspended).await;
    assert!(failed.errors[0].error.contains("timed out after 50 ms"), "{:?}", failed.errors);
    // `browse` has no section: the machine's 10 s timeout lets its 300 ms step finish.
    h.wait(browse, "done", |r| r.status == Status::Done).await;
    worker.shutdown().await;
}

/// Counts the steps running user code right now, and the most seen at once.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    max: AtomicUsize,
    done: AtomicUsize,
}

struct Capped(Arc<Gauge>);

#[async_trait]
impl StepMachine for Capped {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        let now = self.0.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.max.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(1)).await;
        self.0.now.fetch_sub(1, Ordering::SeqCst);
        self.0.done.fetch_add(1, Ordering::SeqCst);
        Ok(Outcome::Done { result: json!("ok"), step: None })
    }
}

/// Three workers with 10 slots each share a queue limited to 5 at once: user code never
/// runs more than 5 steps at once, and the store never shows more than 5 executing rows
/// (sampled every 2 ms over the whole run).
async fn a_global_limit_holds_across_three_workers<S: TestStore>() {
    const LIMIT: usize = 5;
    let steps: usize = if S::WORKERS > 1 { 5_000 } else { 500 };
    let h = S::harness().await;
    let file = settings("[queues.capped]\nglobal_concurrency = 5\nconcurrency = 10");
    let gauge = Arc::new(Gauge::default());
    let news: Vec<NewInstance> =
        (0..steps).map(|_| NewInstance::new(machine(), "a").queue("capped")).collect();
    h.client.start_many(news).await.expect("start");
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (store, stop, now) = (Arc::clone(&h.store), Arc::clone(&stop), h.clock.now());
        tokio::spawn(async move {
            let (mut max, mut samples) = (0u64, 0u64);
            while !stop.load(Ordering::SeqCst) {
                let stats = store.queue_stats(None, now).await.expect("stats");
                let executing: u64 =
                    stats.iter().filter(|q| q.queue == "capped").map(|q| q.executing).sum();
                max = max.max(executing);
                samples += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (max, samples)
        })
    };
    let started = std::time::Instant::now();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let config = WorkerConfig {
                worker_id: WorkerId(format!("capped-{i}")),
                queues: vec![("capped".into(), 1)],
                ..h.config()
            }
            .with_settings(file.clone())
            .expect("applied");
            assert_eq!(config.queues, vec![("capped".to_owned(), 10)], "slots from the file");
            h.worker(config, Capped(Arc::clone(&gauge)))
        })
        .collect();
    for _ in 0..6_000 {
        if gauge.done.load(Ordering::SeqCst) >= steps {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let (store_max, samples) = sampler.await.expect("sampler");
    for w in workers {
        w.shutdown().await;
    }
    let ran = gauge.done.load(Ordering::SeqCst);
    let user_max = gauge.max.load(Ordering::SeqCst);
    println!(
        "global limit {LIMIT}, 3 workers x 10 slots, {ran} steps in {elapsed:?} (measured under load): \
         max running at once {user_max}, max executing rows in the store {store_max} over {samples} samples"
    );
    assert_eq!(ran, steps, "every step ran");
    assert!(user_max <= LIMIT, "user code ran {user_max} steps at once over the limit {LIMIT}");
    assert!(store_max <= LIMIT as u64, "the store held {store_max} executing rows, limit {LIMIT}");
    assert!(user_max >= 2, "the workers never ran steps side by side: {user_max}");
}

/// Running steps per concurrency key, and the most seen at once for any key.
#[derive(Default)]
struct KeyGauge {
    now: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    max: AtomicUsize,
    done: AtomicUsize,
}

struct Keyed(Arc<KeyGauge>);

#[async_trait]
impl StepMachine for Keyed {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let key = ctx.context["key"].as_str().unwrap_or_default().to_owned();
        {
            let mut now = self.0.now.lock().expect("gauge");
            let n = now.entry(key.clone()).or_default();
            *n += 1;
            self.0.max.fetch_max(*n, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        *self.0.now.lock().expect("gauge").entry(key).or_default() -= 1;
        self.0.done.fetch_add(1, Ordering::SeqCst);
        Ok(Outcome::Done { result: json!("ok"), step: None })
    }
}

/// Three workers with 10 slots each run three keys with `key_concurrency = 3`: no key
/// ever runs more than 3 steps at once, and keys run side by side.
async fn a_key_limit_of_three_holds_across_three_workers<S: TestStore>() {
    const K: usize = 3;
    let per_key: usize = if S::WORKERS > 1 { 300 } else { 60 };
    let h = S::harness().await;
    let file = settings("[queues.keyed]\nkey_concurrency = 3\nconcurrency = 10");
    let gauge = Arc::new(KeyGauge::default());
    let news: Vec<NewInstance> = (0..per_key * 3)
        .map(|i| {
            let key = format!("tenant-{}", i % 3);
            NewInstance::new(machine(), "a")
                .queue("keyed")
                .concurrency_key(key.clone())
                .context(json!({ "key": key }))
        })
        .collect();
    h.client.start_many(news).await.expect("start");
    let started = std::time::Instant::now();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let config = WorkerConfig {
                worker_id: WorkerId(format!("keyed-{i}")),
                queues: vec![("keyed".into(), 1)],
                ..h.config()
            }
            .with_settings(file.clone())
            .expect("applied");
            h.worker(config, Keyed(Arc::clone(&gauge)))
        })
        .collect();
    for _ in 0..6_000 {
        if gauge.done.load(Ordering::SeqCst) >= per_key * 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    for w in workers {
        w.shutdown().await;
    }
    let ran = gauge.done.load(Ordering::SeqCst);
    let max = gauge.max.load(Ordering::SeqCst);
    println!(
        "key limit {K}, 3 keys, 3 workers x 10 slots, {ran} steps in {elapsed:?} (measured under load): \
         max running at once for one key {max}"
    );
    assert_eq!(ran, per_key * 3, "every step ran");
    assert!(max <= K, "a key ran {max} steps at once over its limit {K}");
    assert!(max >= 2, "no key ever ran two steps at once: {max}");
}

/// Records when each step started.
#[derive(Default)]
struct Starts(std::sync::Mutex<Vec<std::time::Instant>>);

struct Metered(Arc<Starts>);

#[async_trait]
impl StepMachine for Metered {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        self.0.0.lock().expect("starts").push(std::time::Instant::now());
        Ok(Outcome::Done { result: json!("ok"), step: None })
    }
}

/// Three workers share `rate_limit = 100 per second` (burst 10) on real time: over 10 s
/// from the first start, the starts stay within 5 % of 1 000.
async fn a_rate_limit_of_100_per_second_holds_across_three_workers<S: TestStore>() {
    rate_limit_holds::<S>(10).await;
}

/// The same with a burst of 1: a claim takes every token that accrued since the last one
/// while rows wait, so the rate holds however often the workers come.
async fn a_rate_limit_with_a_burst_of_one_holds_across_three_workers<S: TestStore>() {
    rate_limit_holds::<S>(1).await;
}

async fn rate_limit_holds<S: TestStore>(burst: u32) {
    const RATE: f64 = 100.0;
    const WINDOW: Duration = Duration::from_secs(10);
    let h = S::harness().await;
    let file = settings(&format!(
        "[queues.metered]\nconcurrency = 20\nrate_limit = {{ starts = 100, per = \"1 second\", burst = {burst} }}"
    ));
    // More ready rows than the window can start.
    let news: Vec<NewInstance> =
        (0..1_500).map(|_| NewInstance::new(machine(), "a").queue("metered")).collect();
    h.client.start_many(news).await.expect("start");
    let starts = Arc::new(Starts::default());
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let config = WorkerConfig {
                worker_id: WorkerId(format!("metered-{i}")),
                queues: vec![("metered".into(), 1)],
                ..h.config()
            }
            .with_settings(file.clone())
            .expect("applied");
            keel_scheduler::Worker::new(Arc::clone(&h.store), keel_scheduler::SystemClock, config)
                .register(Metered(Arc::clone(&starts)))
                .spawn()
        })
        .collect();
    tokio::time::sleep(WINDOW + Duration::from_millis(500)).await;
    for w in workers {
        w.shutdown().await;
    }
    let mut all = starts.0.lock().expect("starts").clone();
    all.sort();
    let first = *all.first().expect("some steps started");
    let in_window = all.iter().filter(|t| t.duration_since(first) < WINDOW).count();
    let expected = RATE * WINDOW.as_secs_f64();
    let off = (in_window as f64 - expected).abs() / expected;
    println!(
        "rate limit 100/s, burst {burst}, 3 workers, real time: {in_window} starts in the first {WINDOW:?} \
         ({:.1} % off 1 000; measured under load)",
        off * 100.0
    );
    assert!(off <= 0.05, "{in_window} starts in {WINDOW:?}, more than 5 % off {expected}");
}
