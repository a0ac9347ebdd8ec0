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
use keel_core::chart::{ActionError, Definition};
use keel_core::config::KeelConfig;
use keel_core::history::HistoryKind;
use keel_core::instance::HistoryRecord;
use keel_core::instance::NewInstance;
use keel_core::ports::Clock;
use keel_core::ports::Store;
use keel_core::ports::store::DeadLetterFilter;
use keel_core::{InstanceId, MachineRef, NewSignal, Outcome, Status, WorkerId};
use keel_scheduler::{ChartMachine, StepContext, StepError, StepMachine, WorkerConfig};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

on_every_store!(
    an_events_section_overrides_its_machines_timeout_and_retry,
    dead_letters_disabled_at_system_machine_or_event_level_drop_a_charts_failed_event,
    dead_letters_enabled_true_under_a_disabled_system_level_still_dead_letters,
    a_step_machine_with_dead_letters_disabled_fails_instead_of_suspending,
    a_global_limit_holds_across_three_workers,
    a_key_limit_of_three_holds_across_three_workers,
    priority_and_queue_from_the_file_fill_what_starts_and_sends_leave_unset,
    inbox_order_priority_takes_the_urgent_event_first,
    a_charts_start_runs_under_its_machines_settings_not_a_waiting_events,
    an_events_retry_policy_holds_for_every_attempt_of_its_step,
    a_signal_whose_step_succeeded_on_a_retry_is_consumed_once,
);

/// Held by every test of this binary that measures a rate on real time, so they run one
/// at a time: two of them at once would share the machine and measure each other.
static RATES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// Seconds of real time: run on PostgreSQL only, where the limit is shared, one at a time
// (`RATES`).
mod rate {
    on_stores!(memory: [], postgres: [
        a_rate_limit_of_100_per_second_holds_across_three_workers,
        a_rate_limit_with_a_burst_of_one_holds_across_three_workers,
        a_key_rate_limit_holds_per_key_across_three_workers,
    ]);
    use super::{
        a_key_rate_limit_holds_per_key_across_three_workers,
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
    let _serial = RATES.lock().await;
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

/// Records when each step of each concurrency key (its context's `key`) started.
#[derive(Default)]
struct KeyStarts(std::sync::Mutex<Vec<(String, std::time::Instant)>>);

struct KeyMetered(Arc<KeyStarts>);

#[async_trait]
impl StepMachine for KeyMetered {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let key = ctx.context["key"].as_str().unwrap_or_default().to_owned();
        self.0.0.lock().expect("starts").push((key, std::time::Instant::now()));
        Ok(Outcome::Done { result: json!("ok"), step: None })
    }
}

/// Three workers share `key_rate_limit = 20 per second` (burst 20) from `keel.toml` on
/// real time, for about 4 s, with more rows ready than that allows: each of two keys,
/// running side by side, starts its burst at once and then 20 per second, within 5 %.
/// Measured from a key's first start to its last, not against the run's end, where a
/// worker between polls when the run stops would count as the limit's error.
async fn a_key_rate_limit_holds_per_key_across_three_workers<S: TestStore>() {
    const RUN: Duration = Duration::from_secs(4);
    let _serial = RATES.lock().await;
    let h = S::harness().await;
    let file = settings(
        "[queues.tenants]\nconcurrency = 10\nkey_concurrency = 50\n\
         key_rate_limit = { starts = 20, per = \"1 second\" }",
    );
    let news: Vec<NewInstance> = (0..300)
        .map(|i| {
            let key = format!("rated-{}", i % 2);
            NewInstance::new(machine(), "a")
                .queue("tenants")
                .concurrency_key(key.clone())
                .context(json!({ "key": key }))
        })
        .collect();
    h.client.start_many(news).await.expect("start");
    let starts = Arc::new(KeyStarts::default());
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let config = WorkerConfig {
                worker_id: WorkerId(format!("tenants-{i}")),
                queues: vec![("tenants".into(), 1)],
                ..h.config()
            }
            .with_settings(file.clone())
            .expect("applied");
            keel_scheduler::Worker::new(Arc::clone(&h.store), keel_scheduler::SystemClock, config)
                .register(KeyMetered(Arc::clone(&starts)))
                .spawn()
        })
        .collect();
    tokio::time::sleep(RUN).await;
    for w in workers {
        w.shutdown().await;
    }
    let all = starts.0.lock().expect("starts").clone();
    for key in ["rated-0", "rated-1"] {
        let mut times: Vec<_> = all.iter().filter(|(k, _)| k == key).map(|(_, t)| *t).collect();
        times.sort();
        let (first, last) = (*times.first().expect("the key started"), *times.last().expect("one"));
        let span = last.duration_since(first).as_secs_f64();
        assert!(span >= 3.0, "{key}: its starts spread over only {span:.2} s");
        // The burst at once, then 20 per second.
        let expected = 20.0 + 20.0 * span;
        let got = times.len() as f64;
        let off = (got - expected).abs() / expected;
        println!(
            "key rate limit 20/s, burst 20, 3 workers, real time: {key} started {got} in \
             {span:.2} s ({:.1} % off {expected:.1}; measured under load)",
            off * 100.0
        );
        assert!(off <= 0.05, "{key}: {got} starts in {span:.2} s, more than 5 % off {expected:.1}");
    }
}

/// A ledger chart: `post` and `audit` run the `post` action, which appends the payload's
/// `entry` to the context's `posted` list, or fails when the payload says `bad` (for
/// good: a non-retryable error, or a retryable one when it says `flaky`); `close`
/// finishes it.
fn ledger() -> ChartMachine {
    let definition = Definition::builder("ledger", 1)
        .initial("open")
        .state("open", |s| {
            s.on("post", |t| t.action("post"))
                .on("audit", |t| t.action("post"))
                .on_to("close", "closed")
        })
        .final_state("closed")
        .build()
        .expect("valid chart");
    ChartMachine::new(definition).action("post", |ctx, event| async move {
        if event.payload["bad"] == json!(true) {
            return Err(ActionError::permanent("the ledger refused the entry"));
        }
        if event.payload["flaky"] == json!(true) {
            return Err(ActionError::new("the ledger is unreachable"));
        }
        let mut posted: Vec<serde_json::Value> = ctx.get_as("posted").unwrap_or_default();
        posted.push(event.payload["entry"].clone());
        ctx.set("posted", posted);
        Ok(())
    })
}

async fn history_of<S: Store>(h: &common::Harness<S>, id: InstanceId) -> Vec<HistoryRecord> {
    h.client.get(id).await.expect("get").history
}

fn discards(history: &[HistoryRecord]) -> Vec<&serde_json::Value> {
    history
        .iter()
        .filter(|r| HistoryKind::FailureDiscarded.is(&r.entry.kind))
        .map(|r| &r.entry.data)
        .collect()
}

/// `dead_letter.enabled = false` at the system level, the chart's machine section or the
/// failing event's section: the failed event is dropped (no dead letter, never
/// suspended), history records it with its error and attempts, and the chart processes
/// its next events.
async fn dead_letters_disabled_at_system_machine_or_event_level_drop_a_charts_failed_event<
    S: TestStore,
>() {
    let levels = [
        "[queue.dead_letter]\nenabled = false",
        "[machines.ledger.queue.dead_letter]\nenabled = false",
        "[machines.ledger.events.post.queue.dead_letter]\nenabled = false",
    ];
    for level in levels {
        let h = S::harness().await;
        // Two attempts, no back-off: the flaky event is dropped after its retries ran out.
        let file = settings(&format!(
            "[queue.retry]\nmax_attempts = 2\ninitial_delay = \"0 seconds\"\n{level}"
        ));
        let worker = h.worker(h.config().with_settings(file).expect("applied"), ledger());
        let id = h.start(ledger().new_instance(json!({}))).await;
        h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
        let events = [
            NewSignal::new(id, "post").payload(json!({ "entry": 1 })),
            NewSignal::new(id, "post").payload(json!({ "entry": 2, "bad": true })),
            NewSignal::new(id, "post").payload(json!({ "entry": 3, "flaky": true })),
            NewSignal::new(id, "post").payload(json!({ "entry": 4 })),
            NewSignal::new(id, "close"),
        ];
        h.client.send_many(events.to_vec()).await.expect("send");
        let row = h.wait(id, "closed", |r| r.status.is_terminal()).await;
        assert_eq!(row.status, Status::Done, "{level}: {:?}", row.last_error);
        assert_eq!(
            row.result.as_ref().map(|r| r["posted"].clone()),
            Some(json!([1, 4])),
            "{level}"
        );
        let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("list");
        assert!(letters.is_empty(), "{level}: no dead letter is written: {letters:?}");
        let history = history_of(&h, id).await;
        assert!(
            !history.iter().any(|r| HistoryKind::StepSuspended.is(&r.entry.kind)
                || HistoryKind::DeadLettered.is(&r.entry.kind)),
            "{level}: never suspended nor dead-lettered"
        );
        let dropped = discards(&history);
        assert_eq!(dropped.len(), 2, "{level}: {dropped:?}");
        assert_eq!(
            (&dropped[0]["reason"], &dropped[0]["attempts"]),
            (&json!("non_retryable"), &json!(1)),
            "{level}"
        );
        let error = dropped[0]["error"].as_str().unwrap_or_default();
        assert!(error.ends_with("the ledger refused the entry"), "{level}: {error}");
        assert_eq!(dropped[0]["event"]["name"], "post");
        assert_eq!(dropped[0]["event"]["payload"]["entry"], 2);
        assert_eq!(dropped[0]["outcome"], "event_dropped");
        assert_eq!(
            (&dropped[1]["reason"], &dropped[1]["attempts"]),
            (&json!("exhausted"), &json!(2)),
            "{level}"
        );
        let error = dropped[1]["error"].as_str().unwrap_or_default();
        assert!(error.ends_with("the ledger is unreachable"), "{level}: {error}");
        assert_eq!(dropped[1]["event"]["payload"]["entry"], 3);
        worker.shutdown().await;
    }
}

/// The most specific level wins in both directions: the system level disables dead
/// letters, the machine turns them back on and one event of it turns them off again. The
/// machine's failed `audit` is dead-lettered and suspends the instance as usual; its
/// failed `post` (the event's section) is dropped.
async fn dead_letters_enabled_true_under_a_disabled_system_level_still_dead_letters<
    S: TestStore,
>() {
    let h = S::harness().await;
    let file = settings(
        "[queue.dead_letter]\nenabled = false\n\
         [machines.ledger.queue.dead_letter]\nenabled = true\n\
         [machines.ledger.events.post.queue.dead_letter]\nenabled = false",
    );
    let worker = h.worker(h.config().with_settings(file).expect("applied"), ledger());
    let id = h.start(ledger().new_instance(json!({}))).await;
    h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
    let events = [
        NewSignal::new(id, "post").payload(json!({ "entry": 1, "bad": true })),
        NewSignal::new(id, "post").payload(json!({ "entry": 2 })),
        NewSignal::new(id, "audit").payload(json!({ "entry": 3, "bad": true })),
        NewSignal::new(id, "close"),
    ];
    h.client.send_many(events.to_vec()).await.expect("send");
    let row = h.wait(id, "suspended", |r| r.status == Status::Suspended).await;
    assert_eq!(row.context["posted"], json!([2]), "the bad post was dropped, the good one ran");
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("list");
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0].letter;
    assert_eq!((letter.instance, letter.reason.as_str()), (id, "non_retryable"));
    assert_eq!(letter.event.as_ref().map(|e| e["name"].clone()), Some(json!("audit")));
    let history = history_of(&h, id).await;
    let dropped = discards(&history);
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    assert_eq!(dropped[0]["event"]["payload"]["entry"], 1);
    let inbox: Vec<String> =
        h.client.get(id).await.expect("get").inbox.iter().map(|s| s.name.clone()).collect();
    assert_eq!(inbox, ["audit", "close"], "the suspended instance keeps its later events in order");
    worker.shutdown().await;
}

/// Fails its only step for good.
struct Charge;

#[async_trait]
impl StepMachine for Charge {
    fn machine(&self) -> MachineRef {
        MachineRef::new("charge", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Err(StepError::fatal("card number invalid"))
    }
}

/// A step machine has no event to drop: with dead letters disabled for it (its machine
/// section), the failed step is discarded and the instance fails, with the step's error
/// and the discard in history; a second machine under the system default still
/// dead-letters and suspends.
async fn a_step_machine_with_dead_letters_disabled_fails_instead_of_suspending<S: TestStore>() {
    let h = S::harness().await;
    let file = settings("[machines.charge.queue.dead_letter]\nenabled = false");
    let config = h.config().with_settings(file).expect("applied");
    let worker = keel_scheduler::Worker::new(Arc::clone(&h.store), h.clock.clone(), config);
    let worker = h.hinted(worker.register(Charge).register(Refund)).spawn();
    let charge = h.start(NewInstance::new(MachineRef::new("charge", 1), "charge")).await;
    let refund = h.start(NewInstance::new(MachineRef::new("refund", 1), "refund")).await;
    let row = h.wait(charge, "failed", |r| r.status.is_terminal()).await;
    assert_eq!(row.status, Status::Failed);
    let reason = row.last_error.clone().unwrap_or_default();
    assert!(reason.starts_with("card number invalid"), "{reason}");
    assert!(reason.contains("dead letters are disabled"), "{reason}");
    let history = history_of(&h, charge).await;
    let dropped = discards(&history);
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    assert_eq!(
        (&dropped[0]["step"], &dropped[0]["attempts"], &dropped[0]["outcome"]),
        (&json!("charge"), &json!(1), &json!("instance_failed"))
    );
    assert_eq!(dropped[0]["error"], "card number invalid");
    h.wait(refund, "suspended", |r| r.status == Status::Suspended).await;
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("list");
    let owners: Vec<InstanceId> = letters.iter().map(|l| l.letter.instance).collect();
    assert_eq!(owners, [refund], "only the machine with dead letters on wrote one");
    worker.shutdown().await;
}

/// Fails its only step for good, under the system default (dead letters on).
struct Refund;

#[async_trait]
impl StepMachine for Refund {
    fn machine(&self) -> MachineRef {
        MachineRef::new("refund", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Err(StepError::fatal("refund window closed"))
    }
}

/// `priority` and `name` at the system and machine levels set what an instance starts
/// with, `priority` at an event's level what that event carries when sent — each only
/// where the caller gave none — through a client with the settings. An urgent event
/// raises its instance's claim priority while it is pending.
async fn priority_and_queue_from_the_file_fill_what_starts_and_sends_leave_unset<S: TestStore>() {
    use keel_core::Priority;
    let h = S::harness().await;
    let (file, _) = KeelConfig::load(
        "[queue]\nname = \"bulk\"\n\
         [machines.shop.queue]\npriority = \"low\"\n\
         [machines.shop.events.cancel.queue]\npriority = \"critical\"\n\
         [machines.other.queue]\nname = \"other\"",
        |_| None,
    )
    .expect("priority and name are applied");
    let client = h.client.clone().with_settings(file);
    let start = |new: NewInstance| {
        let client = client.clone();
        async move { client.start(new).await.expect("start").id() }
    };
    let plain = start(NewInstance::new(machine(), "a").business_key("k1")).await;
    let chosen =
        start(NewInstance::new(machine(), "a").priority(Priority::Normal).queue("default")).await;
    let other = start(NewInstance::new(MachineRef::new("other", 1), "a")).await;
    let row = |id| {
        let client = client.clone();
        async move { client.get(id).await.expect("get") }
    };
    let r = row(plain).await.instance;
    assert_eq!(
        (r.priority, r.base_priority, r.queue.as_str()),
        (Priority::Low, Priority::Low, "bulk")
    );
    let r = row(chosen).await.instance;
    assert_eq!(
        (r.priority, r.queue.as_str()),
        (Priority::Normal, "default"),
        "the caller's choice"
    );
    let r = row(other).await.instance;
    assert_eq!((r.priority, r.queue.as_str()), (Priority::Normal, "other"));
    // By id and by business key: `cancel` carries its section's priority, `pay` none, and
    // an explicit priority is kept.
    client.send(NewSignal::new(plain, "pay")).await.expect("send");
    client.send(NewSignal::new(chosen, "cancel").priority(Priority::High)).await.expect("send");
    let by_key = keel_core::SignalTarget::Key {
        namespace: "default".into(),
        machine: "shop".into(),
        key: "k1".into(),
    };
    client.send(NewSignal::new(by_key, "cancel")).await.expect("send");
    let detail = row(plain).await;
    let inbox: Vec<_> = detail.inbox.iter().map(|s| (s.name.as_str(), s.priority)).collect();
    assert_eq!(inbox, vec![("pay", None), ("cancel", Some(Priority::Critical))]);
    assert_eq!(detail.instance.priority, Priority::Critical, "the urgent event raised it");
    assert_eq!(row(chosen).await.inbox[0].priority, Some(Priority::High));
    // Without settings nothing is filled.
    let bare = h.start(NewInstance::new(machine(), "a")).await;
    h.client.send(NewSignal::new(bare, "cancel")).await.expect("send");
    let detail = row(bare).await;
    assert_eq!((detail.instance.priority, detail.inbox[0].priority), (Priority::Normal, None));
}

/// With `inbox_order = "priority"` (from the file or in code) a chart takes its most
/// urgent pending event first; by default it keeps arrival order.
async fn inbox_order_priority_takes_the_urgent_event_first<S: TestStore>() {
    use keel_core::Priority;
    use keel_core::inbox::InboxOrder;
    let variants: [(&str, Option<&str>, InboxOrder, serde_json::Value); 3] = [
        ("default", None, InboxOrder::Arrival, json!([1, 2, 3])),
        (
            "file",
            Some("[machines.ledger]\ninbox_order = \"priority\""),
            InboxOrder::Arrival,
            json!([3, 1, 2]),
        ),
        ("code", None, InboxOrder::Priority, json!([3, 1, 2])),
    ];
    for (what, file, code, expected) in variants {
        let h = S::harness().await;
        let config = match file {
            Some(file) => h.config().with_settings(settings(file)).expect("applied"),
            None => h.config(),
        };
        let worker = h.worker(config, ledger().with_inbox_order(code));
        let id = h.start(ledger().new_instance(json!({}))).await;
        h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
        let post = |n: i64| NewSignal::new(id, "post").payload(json!({ "entry": n }));
        // One batch: the step that wakes sees all three.
        h.client
            .send_many(vec![
                post(1),
                post(2).priority(Priority::Low),
                post(3).priority(Priority::High),
            ])
            .await
            .expect("send");
        let posted = |r: &keel_core::Instance| r.context["posted"].as_array().map_or(0, Vec::len);
        h.wait(id, "three posted", |r| posted(r) == 3 && r.status == Status::AwaitingSignal).await;
        h.client.send(NewSignal::new(id, "close")).await.expect("send");
        let row = h.wait(id, "closed", |r| r.status.is_terminal()).await;
        assert_eq!(row.result.map(|r| r["posted"].clone()), Some(expected), "{what}");
        worker.shutdown().await;
    }
}

/// A chart's first step enters its initial states and processes no event, so it runs
/// under the machine's settings even when an event with a section of its own is already
/// waiting: `go`'s 50 ms timeout and single attempt do not cut the 200 ms entry action
/// short, and `go` is then processed under them.
async fn a_charts_start_runs_under_its_machines_settings_not_a_waiting_events<S: TestStore>() {
    let h = S::harness().await;
    let file = settings(
        r#"
        [machines.opening.queue]
        timeout = "10 seconds"
        [machines.opening.events.go.queue]
        timeout = "50 ms"
        [machines.opening.events.go.queue.retry]
        max_attempts = 1
        "#,
    );
    let definition = Definition::builder("opening", 1)
        .initial("warming")
        .state("warming", |s| s.entry("warm_up").on_to("go", "open"))
        .final_state("open")
        .build()
        .expect("valid chart");
    let chart = ChartMachine::new(definition).action("warm_up", |ctx, _| async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        ctx.set("warm", true);
        Ok(())
    });
    let id = h.start(chart.new_instance(json!({}))).await;
    // Sent before the first step runs: the start's claim sees it in the inbox.
    h.client.send(NewSignal::new(id, "go")).await.expect("send");
    let worker = h.worker(h.config().with_settings(file).expect("applied"), chart);
    let row = h.wait(id, "open", |r| r.status.is_terminal() || r.status == Status::Suspended).await;
    assert_eq!(row.status, Status::Done, "{:?}", row.errors);
    assert_eq!(row.result, Some(json!({ "warm": true })));
    worker.shutdown().await;
}

/// Parks for `checkout`, then fails its first `failures` attempts at it; with
/// `park_again` it then moves to step `b`, which counts the signals it still sees in
/// `seen_later` and parks for the next `checkout`, instead of finishing.
struct FlakyCheckout {
    failures: usize,
    runs: Arc<AtomicUsize>,
    park_again: bool,
    seen_later: Arc<AtomicUsize>,
}

#[async_trait]
impl StepMachine for FlakyCheckout {
    fn machine(&self) -> MachineRef {
        MachineRef::new("flaky", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let park = Outcome::Await { signal: "checkout".into(), context: json!({}), step: None };
        if ctx.step == "b" {
            self.seen_later.fetch_add(ctx.signals.len(), Ordering::SeqCst);
            return Ok(park);
        }
        if ctx.signals.is_empty() {
            return Ok(park);
        }
        if self.runs.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err(StepError::retryable("the payment provider is busy"));
        }
        if self.park_again {
            return Ok(Outcome::Next { step: "b".into(), context: json!({}) });
        }
        Ok(Outcome::Done { result: json!("paid"), step: None })
    }
}

/// A failed attempt consumes nothing, so every retry of the step still processes the
/// event, under the event's section: `checkout`'s four attempts hold on the retries too,
/// not the machine's single one.
async fn an_events_retry_policy_holds_for_every_attempt_of_its_step<S: TestStore>() {
    let h = S::harness().await;
    let file = settings(
        r#"
        [machines.flaky.queue.retry]
        max_attempts = 1
        [machines.flaky.events.checkout.queue.retry]
        max_attempts = 4
        initial_delay = "0 seconds"
        "#,
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let flaky = FlakyCheckout {
        failures: 2,
        runs: Arc::clone(&runs),
        park_again: false,
        seen_later: Arc::default(),
    };
    let worker = h.worker(h.config().with_settings(file).expect("applied"), flaky);
    let id = h.start(NewInstance::new(MachineRef::new("flaky", 1), "a")).await;
    h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
    h.client.send(NewSignal::new(id, "checkout")).await.expect("send");
    let row = h.wait(id, "paid", |r| r.status.is_terminal() || r.status == Status::Suspended).await;
    worker.shutdown().await;
    assert_eq!(row.status, Status::Done, "{:?}", row.errors);
    assert_eq!(runs.load(Ordering::SeqCst), 3, "two failed attempts, then the payment");
}

/// The attempt that succeeds after failed ones consumes the signal they all saw: the next
/// step does not see it again (the payment is taken once).
async fn a_signal_whose_step_succeeded_on_a_retry_is_consumed_once<S: TestStore>() {
    let h = S::harness().await;
    let file =
        settings("[machines.flaky.queue.retry]\nmax_attempts = 3\ninitial_delay = \"0 seconds\"\n");
    let (runs, seen_later) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let flaky = FlakyCheckout {
        failures: 1,
        runs: Arc::clone(&runs),
        park_again: true,
        seen_later: Arc::clone(&seen_later),
    };
    let worker = h.worker(h.config().with_settings(file).expect("applied"), flaky);
    let id = h.start(NewInstance::new(MachineRef::new("flaky", 1), "a")).await;
    let parked = |r: &keel_core::Instance| r.status == Status::AwaitingSignal;
    h.wait(id, "parked", parked).await;
    h.client.send(NewSignal::new(id, "checkout")).await.expect("send");
    h.wait(id, "parked at b", |r| r.position == "b" && r.status == Status::AwaitingSignal).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let detail = h.client.get(id).await.expect("get");
    worker.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one failed attempt, one payment");
    assert_eq!(seen_later.load(Ordering::SeqCst), 0, "step b saw the consumed checkout");
    assert!(detail.inbox.is_empty(), "checkout was consumed: {:?}", detail.inbox);
    assert_eq!(detail.instance.status, Status::AwaitingSignal);
}
