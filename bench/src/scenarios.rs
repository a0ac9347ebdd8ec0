//! The benchmark scenarios. Each is generic over the store and runs on a fresh one.

use crate::queues::QueueKind;
use crate::report::{Report, quantile};
use crate::stores::Factory;
use crate::with_store;
use anyhow::{Result, bail};
use async_trait::async_trait;
use indicatif::{ProgressBar, ProgressStyle};
use keel_core::HistoryKind;
use keel_core::chart::{Definition, TimerArm, TimerKind};
use keel_core::instance::{ANY_SIGNAL, NewInstance};
use keel_core::ports::queue::Hint;
use keel_core::ports::store::{ClaimParams, CommitParams, InsertParams, SignalDeliverParams};
use keel_core::ports::{Clock, Store};
use keel_core::{InstanceId, MachineRef, NewSignal, Outcome, StepCommit, WorkerId};
use keel_scheduler::{
    ChartMachine, HintConfig, StepContext, StepError, StepMachine, SweepConfig, Sweeper,
    SystemClock, Worker, WorkerConfig,
};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const INSERT_BATCH: usize = 5_000;
const DEADLINE: Duration = Duration::from_secs(600);

fn bar(len: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_message(what.to_owned());
    pb
}

async fn insert_all<S: Store>(store: &S, news: Vec<NewInstance>) -> Result<Vec<InstanceId>> {
    let mut ids = Vec::with_capacity(news.len());
    let now = SystemClock.now();
    for chunk in news.chunks(INSERT_BATCH) {
        let out = store.instance_insert(InsertParams { instances: chunk.to_vec(), now }).await?;
        ids.extend(out.iter().map(|o| o.id()));
    }
    Ok(ids)
}

/// A context of about `bytes` bytes (an empty object for 0): hex digits from a fixed
/// pseudo-random sequence, so that the store cannot compress it to nothing.
fn filler_context(bytes: usize) -> serde_json::Value {
    if bytes == 0 {
        return json!({});
    }
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let filler: String = (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b"0123456789abcdef"[(x & 15) as usize])
        })
        .collect();
    json!({ "filler": filler })
}

/// A machine whose only step finishes at once.
struct Noop;

#[async_trait]
impl StepMachine for Noop {
    fn machine(&self) -> MachineRef {
        MachineRef::new("noop", 1)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!(null), step: None })
    }
}

/// The CPU time this process has used, every thread's, user and system (Linux: read
/// from `/proc/self/stat` in ticks of 10 ms; `None` where it cannot be read).
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    // utime and stime are the 14th and 15th fields; the state (3rd) is the first here.
    let user: u64 = fields.nth(11)?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((user + system) * 10))
}

/// The workers' `claim_ahead` (`--claim-ahead-ms`).
static CLAIM_AHEAD: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// Sets the workers' `claim_ahead` for every scenario (once, from the command line).
pub fn set_claim_ahead(ahead: Duration) {
    let _ = CLAIM_AHEAD.set(ahead);
}

fn worker_config(concurrency: usize, notifications: bool) -> WorkerConfig {
    let defaults = WorkerConfig::default();
    WorkerConfig {
        queues: vec![("default".into(), concurrency)],
        // Claims and groups as large as the defaults allow: with more slots than that,
        // several groups are in flight at once, so claims overlap with commits instead of
        // alternating with them; below, a claim may take steps ahead of the free slots.
        claim_ahead: CLAIM_AHEAD.get().copied().unwrap_or(defaults.claim_ahead),
        poll_interval: Duration::from_millis(50),
        timers: None,
        stats_interval: None,
        notifications,
        ..defaults
    }
}

/// No-op step throughput at each of `concurrencies` (1, 10, 100, 500 by default). With a
/// queue, every inserted instance is announced by a hint (as a producer publishing on
/// insert would) and the worker runs without the store's notifications: hints, then
/// polling, wake it. The publishing is timed apart from the drain, which starts when the
/// worker does: a slow queue (the SQS emulator takes seconds per call once thousands of
/// hints wait) would otherwise turn the steps/s figure into the queue's publish rate.
pub async fn steps(
    factory: &Factory,
    n: usize,
    concurrencies: &[usize],
    queue: QueueKind,
    context_bytes: usize,
) -> Result<Report> {
    let context = filler_context(context_bytes);
    let mut rows = Vec::new();
    for &concurrency in concurrencies {
        if concurrency == 0 {
            bail!("steps: --concurrency 0 runs nothing; give 1 or more slots");
        }
        let hints = queue.fresh().await?;
        let (elapsed, committed, by_hint, received, publish, cpu) = with_store!(factory, |store| {
            let news = (0..n)
                .map(|_| {
                    NewInstance::new(MachineRef::new("noop", 1), "run").context(context.clone())
                })
                .collect();
            let ids = insert_all(&*store, news).await?;
            let pb = bar(n, &format!("steps, concurrency {concurrency}"));
            let publish_started = Instant::now();
            let mut builder = Worker::new(
                Arc::clone(&store),
                SystemClock,
                worker_config(concurrency, hints.is_none()),
            )
            .register(Noop);
            let mut hint_stats = None;
            if let Some(q) = &hints {
                let (with, stats) = builder.with_queue(Arc::clone(q), HintConfig::default());
                builder = with;
                hint_stats = Some(stats);
                for chunk in ids.chunks(keel_core::limits::HINT_BATCH_MAX) {
                    q.enqueue(chunk.iter().map(|id| Hint::new(*id, 1)).collect()).await?;
                }
            }
            let publish = publish_started.elapsed();
            let cpu_before = process_cpu();
            let started = Instant::now();
            let worker = builder.spawn();
            let stats = Arc::clone(worker.stats());
            while (stats.committed() as usize) < n && started.elapsed() < DEADLINE {
                pb.set_position(stats.committed());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let elapsed = started.elapsed();
            let cpu =
                process_cpu().zip(cpu_before).map(|(after, before)| after.saturating_sub(before));
            pb.finish_and_clear();
            worker.shutdown().await;
            let by_hint = hint_stats.as_ref().map_or(0, |h| h.claimed.load(Ordering::Relaxed));
            let received = hint_stats.map_or(0, |h| h.received.load(Ordering::Relaxed));
            (elapsed, stats.committed(), by_hint, received, publish, cpu)
        });
        if committed as usize != n {
            bail!("steps: only {committed} of {n} committed within {DEADLINE:?}");
        }
        let rate = n as f64 / elapsed.as_secs_f64();
        rows.push(vec![
            json!(concurrency),
            json!(n),
            json!(elapsed.as_secs_f64()),
            json!(rate),
            json!(queue.name()),
            json!(by_hint),
            json!(received),
            json!(publish.as_secs_f64()),
            json!(cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / n as f64)),
        ]);
    }
    let defaults = WorkerConfig::default();
    let carrying = if context_bytes == 0 {
        String::new()
    } else {
        format!(", each with a {context_bytes}-byte context it leaves unchanged")
    };
    Ok(Report {
        name: "steps",
        title: format!(
            "No-op step throughput: drain {n} instances{carrying} (claims of up to {}, group commits of up to {}: the defaults)",
            defaults.claim_batch, defaults.commit_batch
        ),
        columns: vec![
            "concurrency",
            "instances",
            "seconds",
            "steps/s",
            "queue",
            "claimed by hint",
            "hints received",
            "publish s",
            "process CPU µs/step",
        ],
        rows,
        notes: vec![
            "targets on PostgreSQL: ≥ 34 000 steps/s at the best concurrency, ≥ 20 000 at concurrency 100, ≥ 1 500 at concurrency 1; on SQLite: ≥ 5 000 at the best concurrency".into(),
            "with a queue, one hint per instance is published before the worker starts (publish s); seconds and steps/s time the worker's drain from its start".into(),
            "hints received but not claimed named instances the claim loop (polling, 50 ms) had already taken: the queue lagged behind the store".into(),
            "process CPU µs/step: this process's CPU time over the drain, per step: every thread, the worker and the store's client, and with SQLite or the memory store the store itself".into(),
        ],
    })
}

/// The 3-state chart: `idle` (entry `start`) → on `GO` → `working` (entry `work`, raises
/// `FINISH`) → `done` (final). One external signal per instance.
fn chart_machine(
    sent: Arc<Mutex<HashMap<InstanceId, Instant>>>,
    lat: Arc<Mutex<Vec<f64>>>,
) -> ChartMachine {
    let def = Definition::builder("bench_chart", 1)
        .initial("idle")
        .state("idle", |s| s.entry("start").on_to("GO", "working"))
        .state("working", |s| s.entry("work").on_to("FINISH", "done"))
        .final_state("done")
        .build()
        .expect("valid chart");
    ChartMachine::new(def).action("start", |_, _| async { Ok(()) }).action("work", move |ctx, _| {
        let (sent, lat) = (Arc::clone(&sent), Arc::clone(&lat));
        async move {
            if let Some(at) = sent.lock().expect("sent").get(&ctx.instance()) {
                lat.lock().expect("lat").push(at.elapsed().as_secs_f64() * 1000.0);
            }
            ctx.raise("FINISH");
            Ok(())
        }
    })
}

/// Waits (bounded) until the worker has committed `target` steps, moving the bar (if
/// any) to the commits made since the count it is given.
async fn committed(
    stats: &keel_scheduler::worker::WorkerStats,
    target: u64,
    pb: Option<(&ProgressBar, u64)>,
) -> bool {
    let started = Instant::now();
    while stats.committed() < target && started.elapsed() < DEADLINE {
        if let Some((pb, from)) = pb {
            pb.set_position(stats.committed().saturating_sub(from));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stats.committed() >= target
}

/// Chart throughput (initial macrosteps, then a burst of one signal per instance: two
/// transitions each), and signal → step-start latency on a paced sample, with the store's
/// notifications on and off; with a queue, through the queue instead: the client
/// announces each delivery, the worker receives the hints, its notifications are off and
/// its polling slowed to 1 s. With a queue, the initial hints are published before the
/// clock starts, and the paced sample runs on a fresh queue and worker: the hints of the
/// phases before, which the claim loop made stale wherever the queue lagged, would
/// otherwise stand in front of the paced ones (on the SQS emulator, for minutes).
pub async fn chart(factory: &Factory, n: usize, queue: QueueKind) -> Result<Report> {
    let sample = n.min(1_000);
    let mut rows = Vec::new();
    let modes: &[bool] = if queue == QueueKind::None { &[true, false] } else { &[false] };
    for &notifications in modes {
        let sent: Arc<Mutex<HashMap<InstanceId, Instant>>> = Arc::default();
        let lat: Arc<Mutex<Vec<f64>>> = Arc::default();
        let hints = queue.fresh().await?;
        let (init_rate, transition_rate, latencies, paced_by_hint) =
            with_store!(factory, |store| {
                let machine = chart_machine(Arc::clone(&sent), Arc::clone(&lat));
                let news: Vec<NewInstance> =
                    (0..n + sample).map(|_| machine.new_instance(json!({}))).collect();
                let mut config = worker_config(100, notifications);
                let ids = insert_all(&*store, news).await?;
                let (burst, paced) = ids.split_at(n);
                let mut client = keel_scheduler::Client::new(Arc::clone(&store), SystemClock);
                let mut builder = Worker::new(Arc::clone(&store), SystemClock, config.clone());
                if let Some(q) = &hints {
                    config.poll_interval = Duration::from_secs(1);
                    builder = Worker::new(Arc::clone(&store), SystemClock, config.clone())
                        .with_queue(Arc::clone(q), HintConfig::default())
                        .0;
                    client = client.with_queue(Arc::clone(q));
                    for chunk in ids.chunks(keel_core::limits::HINT_BATCH_MAX) {
                        q.enqueue(chunk.iter().map(|id| Hint::new(*id, 0)).collect()).await?;
                    }
                }
                let started = Instant::now();
                let worker = builder.register(machine).spawn();
                let stats = Arc::clone(worker.stats());
                let pb = bar(n + sample, &format!("chart init, notify {notifications}"));
                let ok = committed(&stats, (n + sample) as u64, Some((&pb, 0))).await;
                pb.finish_and_clear();
                if !ok {
                    bail!("chart: initial macrosteps did not finish");
                }
                let init_rate = (n + sample) as f64 / started.elapsed().as_secs_f64();

                // Burst: one GO per instance at once; each macrostep takes two transitions.
                // The count is read before the first signal goes out: the worker starts on
                // the burst while later chunks are still being delivered.
                let base = stats.committed();
                let burst_started = Instant::now();
                for chunk in burst.chunks(INSERT_BATCH) {
                    let signals = chunk.iter().map(|id| NewSignal::new(*id, "GO")).collect();
                    client.send_many(signals).await?;
                }
                let pb = bar(n, &format!("signal burst, notify {notifications}"));
                let ok = committed(&stats, base + n as u64, Some((&pb, base))).await;
                pb.finish_and_clear();
                if !ok {
                    bail!("chart: the burst did not finish");
                }
                let transition_rate = (2 * n) as f64 / burst_started.elapsed().as_secs_f64();

                // Latency: paced signals (one every 2 ms) to otherwise idle instances; with a
                // queue, through a fresh one to a fresh worker.
                let (worker, stats, client, target, paced_hints) = match queue.fresh().await? {
                    Some(q) => {
                        worker.shutdown().await;
                        let machine = chart_machine(Arc::clone(&sent), Arc::clone(&lat));
                        let (builder, paced_hints) =
                            Worker::new(Arc::clone(&store), SystemClock, config)
                                .with_queue(Arc::clone(&q), HintConfig::default());
                        let worker = builder.register(machine).spawn();
                        let stats = Arc::clone(worker.stats());
                        let client = keel_scheduler::Client::new(Arc::clone(&store), SystemClock)
                            .with_queue(q);
                        (worker, stats, client, sample as u64, Some(paced_hints))
                    }
                    None => (worker, stats, client, base + (n + sample) as u64, None),
                };
                let pb = bar(sample, &format!("paced signals, notify {notifications}"));
                for id in paced {
                    sent.lock().expect("sent").insert(*id, Instant::now());
                    client.send_many(vec![NewSignal::new(*id, "GO")]).await?;
                    pb.inc(1);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                pb.finish_and_clear();
                let ok = committed(&stats, target, None).await;
                worker.shutdown().await;
                if !ok {
                    bail!("chart: the paced signals were not all processed");
                }
                let mut l: Vec<f64> = lat.lock().expect("lat").clone();
                l.sort_by(f64::total_cmp);
                // The burst also went through `work`, but only paced instances were stamped.
                let by_hint = paced_hints.map(|h| h.claimed.load(Ordering::Relaxed));
                (init_rate, transition_rate, l, by_hint)
            });
        let wakeups = match (queue, notifications) {
            (QueueKind::None, true) => "notifications".to_owned(),
            (QueueKind::None, false) => "polling (50 ms)".to_owned(),
            (q, _) => format!("{} queue (poll 1 s)", q.name()),
        };
        rows.push(vec![
            json!(wakeups),
            json!(n),
            json!(init_rate),
            json!(transition_rate),
            json!(quantile(&latencies, 0.5)),
            json!(quantile(&latencies, 0.99)),
            json!(paced_by_hint),
        ]);
    }
    Ok(Report {
        name: "chart",
        title: format!(
            "3-state chart: {n} instances (initial macrostep, then a burst of one signal each), plus {sample} paced signals for latency"
        ),
        columns: vec![
            "wake-ups",
            "instances",
            "initial macrosteps/s",
            "transitions/s (burst)",
            "signal→step p50 ms",
            "signal→step p99 ms",
            "paced claimed by hint",
        ],
        rows,
        notes: vec![
            "targets on PostgreSQL: ≥ 20 000 transitions/s; signal → step p50 ≤ 2 ms, p99 ≤ 10 ms with notifications on".into(),
            "with a queue: initial hints are published before the clock starts; a burst signal's time includes the client publishing its hint; the paced sample goes through a fresh queue and worker, and a paced step not claimed by hint was found by the 1 s poll".into(),
        ],
    })
}

/// Parks as many fresh instances as `chunk` holds, each arming one `after` timer due at
/// `due` (for the first, probing chunk `due` is an hour away and only times the arming);
/// returns the ones it armed. The claim takes any ready instances, not necessarily the
/// chunk's own.
async fn arm_chunk<S: Store>(
    store: &S,
    chunk: &[InstanceId],
    due: keel_core::Timestamp,
) -> Result<Vec<InstanceId>> {
    let params = ClaimParams {
        worker: WorkerId("bench".into()),
        namespaces: vec![],
        queues: vec![],
        machines: vec![],
        limit: chunk.len(),
        lease: Duration::from_secs(60),
        now: SystemClock.now(),
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    };
    let claims = store.instance_claim(params).await?;
    // Any ready rows will do (every one is to be armed), but all of them: a short claim
    // would leave timers unarmed that the scenario counts on firing.
    if claims.len() != chunk.len() {
        bail!("timers: claimed {} of {} instances to arm", claims.len(), chunk.len());
    }
    let now = SystemClock.now();
    let commits = claims
        .iter()
        .map(|c| {
            let park = Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: None };
            let mut commit = StepCommit::new(c.instance.id, c.token(), park);
            let interval = due.since(now).max(Duration::from_millis(1));
            commit.timers_arm = vec![TimerArm {
                state: "wait".into(),
                event: "WAKE".into(),
                kind: TimerKind::After,
                interval,
                max: None,
                then: None,
            }];
            commit
        })
        .collect();
    store.step_commit(CommitParams { commits, now }).await?;
    Ok(claims.iter().map(|c| c.instance.id).collect())
}

/// The machine the timers bench parks: the step a timer wakes finishes at once.
struct Woken;

#[async_trait]
impl StepMachine for Woken {
    fn machine(&self) -> MachineRef {
        MachineRef::new("timed", 1)
    }

    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!(null), step: None })
    }
}

/// Timers whose history the `timers` scenario reads back for early fires.
const EARLY_SAMPLE: usize = 2_000;

/// Timer fires found in histories, and how many of them fired before they were due.
#[derive(Debug, Default, PartialEq)]
struct FireCheck {
    /// Histories read.
    read: usize,
    /// `TIMER_FIRED` records in them.
    fired: usize,
    /// Of those, the ones whose sweep time (`at`) is before the timer's due time (`due`).
    early: usize,
}

impl FireCheck {
    fn add(&mut self, history: &[keel_core::instance::HistoryRecord]) {
        self.read += 1;
        for h in history.iter().filter(|h| HistoryKind::TimerFired.is(&h.entry.kind)) {
            self.fired += 1;
            let (at, due) = (h.entry.data["at"].as_i64(), h.entry.data["due"].as_i64());
            if at.zip(due).is_none_or(|(at, due)| at < due) {
                // A record without both times counts as early: it cannot show otherwise.
                self.early += 1;
            }
        }
    }
}

/// `n` timers due at the same instant: time until the last fired and until a worker
/// committed every step they woke, lateness p50 / p99, and how many fires the store
/// recorded before their due time in a sample of the timers' histories.
pub async fn timers(factory: &Factory, n: usize) -> Result<Report> {
    let (total, ran, late, fires) = with_store!(factory, |store| {
        const PROBE: usize = 500;
        let news =
            (0..n + PROBE).map(|_| NewInstance::new(MachineRef::new("timed", 1), "wait")).collect();
        let all = insert_all(&*store, news).await?;
        let (ids, probe) = all.split_at(n);
        // Every timer must be due at one instant after all are armed: time the arming of
        // a probe chunk (timers an hour away, never counted), give the real ones half as
        // long again per chunk, plus two seconds.
        let probe_started = Instant::now();
        arm_chunk(&*store, probe, SystemClock.now().plus(Duration::from_secs(3600))).await?;
        let chunks: Vec<&[InstanceId]> = ids.chunks(PROBE).collect();
        let lead =
            probe_started.elapsed().mul_f64(chunks.len() as f64 * 1.5) + Duration::from_secs(2);
        let due = SystemClock.now().plus(lead);
        let pb = bar(ids.len(), "arming timers");
        let mut armed = Vec::with_capacity(n);
        for chunk in chunks {
            armed.extend(arm_chunk(&*store, chunk, due).await?);
            pb.inc(chunk.len() as u64);
        }
        pb.finish_and_clear();
        if SystemClock.now() > due {
            bail!("timers: arming took longer than the lead time; lower --timers");
        }
        // The default two batches in flight; five batches per call, so that lateness is
        // sampled every 5 000 timers.
        let config = SweepConfig {
            batch: 1_000,
            batches_per_sweep: 5,
            backpressure_threshold: u64::MAX,
            ..SweepConfig::default()
        };
        let sweeper =
            Sweeper::new(Arc::clone(&store), SystemClock, config).map_err(anyhow::Error::msg)?;
        // A worker runs the steps the timers wake (its own sweeper off: the loop below
        // sweeps, so firing and running are timed apart).
        let worker = Worker::new(Arc::clone(&store), SystemClock, worker_config(500, true))
            .register(Woken)
            .spawn();
        let stats = Arc::clone(worker.stats());
        tokio::time::sleep(due.since(SystemClock.now())).await;
        let pb = bar(n, "firing timers");
        let mut fired = 0usize;
        let mut lateness = Vec::with_capacity(n);
        let started = Instant::now();
        while fired < n && started.elapsed() < DEADLINE {
            match sweeper.sweep(&[]).await? {
                keel_timers::SweepOutcome::Swept { report, .. } => {
                    let late_ms = SystemClock.now().since(due).as_secs_f64() * 1000.0;
                    lateness.extend(std::iter::repeat_n(late_ms, report.fired as usize));
                    fired += report.fired as usize;
                    pb.inc(report.fired);
                    if report.fired == 0 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                keel_timers::SweepOutcome::Skipped { .. }
                | keel_timers::SweepOutcome::Overdue { .. } => {
                    unreachable!("no backpressure in the benchmark")
                }
            }
        }
        pb.finish_and_clear();
        let fired_in = started.elapsed();
        let ran = committed(&stats, n as u64, None).await;
        let ran_in = started.elapsed();
        worker.shutdown().await;
        if fired != n {
            bail!("timers: {fired} of {n} fired");
        }
        if !ran {
            bail!("timers: only {} of {n} woken steps committed", stats.committed());
        }
        lateness.sort_by(f64::total_cmp);
        // Lateness cannot show a timer fired before it was due (it is measured after each
        // sweep, and saturates at zero): read what the store recorded for each fire of a
        // sample spread over the whole run instead.
        let mut fires = FireCheck::default();
        for id in armed.iter().step_by(armed.len().div_ceil(EARLY_SAMPLE).max(1)) {
            fires.add(&store.instance_get(*id).await?.history);
        }
        if fires.fired < fires.read {
            bail!(
                "timers: {} TIMER_FIRED in the histories of {} fired timers",
                fires.fired,
                fires.read
            );
        }
        (fired_in, ran_in, lateness, fires)
    });
    Ok(Report {
        name: "timers",
        title: format!(
            "{n} timers due at the same instant, swept in batches of 1 000 (two at a time after a sweep's first)"
        ),
        columns: vec!["timers", "seconds until the last fired", "seconds until the last woken step committed", "lateness p50 ms", "lateness p99 ms", "fires checked", "early"],
        rows: vec![vec![json!(n), json!(total.as_secs_f64()), json!(ran.as_secs_f64()), json!(quantile(&late, 0.5)), json!(quantile(&late, 0.99)), json!(fires.fired), json!(fires.early)]],
        notes: vec![
            "targets: all fired and their steps committed within 2.5 s of due on PostgreSQL, within 5 s on SQLite; none early".into(),
            format!("early: of the fires recorded in the history of {} timers spread over the run (at most {EARLY_SAMPLE}), those whose sweep time is before the timer's due time", fires.read),
        ],
    })
}

/// A parallel state whose two regions' entry actions sleep 500 ms and 200 ms: time from
/// the event that enters it to `@done`, inline and dispatched.
fn parallel_machine(dispatch: bool) -> ChartMachine {
    let def = Definition::builder("bench_parallel", 1)
        .initial("idle")
        .state("idle", |s| s.on_to("GO", "work"))
        .parallel("work", |p| {
            p.state("a", |r| {
                r.initial("a1")
                    .state("a1", |s| s.entry("slow_500").on_to("A_DONE", "a2"))
                    .final_state("a2")
            })
            .state("b", |r| {
                r.initial("b1")
                    .state("b1", |s| s.entry("slow_200").on_to("B_DONE", "b2"))
                    .final_state("b2")
            })
            .on_done(|b| b.target("finished"))
        })
        .final_state("finished")
        .build()
        .expect("valid chart");
    let parallel = if dispatch {
        keel_core::config::ParallelConfig::enabled()
    } else {
        keel_core::config::ParallelConfig::default()
    };
    ChartMachine::new(def)
        .with_parallel(parallel)
        .action("slow_500", |ctx, _| async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            ctx.set("a", true);
            ctx.raise("A_DONE");
            Ok(())
        })
        .action("slow_200", |ctx, _| async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            ctx.set("b", true);
            ctx.raise("B_DONE");
            Ok(())
        })
}

/// Inline vs dispatched parallel regions.
pub async fn parallel(factory: &Factory, n: usize) -> Result<Report> {
    let mut medians = Vec::new();
    let mut rows = Vec::new();
    for dispatch in [false, true] {
        let mut times = with_store!(factory, |store| {
            let machine = parallel_machine(dispatch);
            let news: Vec<NewInstance> = (0..n).map(|_| machine.new_instance(json!({}))).collect();
            let ids = insert_all(&*store, news).await?;
            let worker =
                Worker::new(Arc::clone(&store), SystemClock, worker_config(4 * n + 10, true))
                    .register(machine)
                    .spawn();
            let stats = Arc::clone(worker.stats());
            if !committed(&stats, n as u64, None).await {
                bail!("parallel: instances did not start");
            }
            let signals = ids.iter().map(|id| NewSignal::new(*id, "GO")).collect();
            let sent = Instant::now();
            let sent_at = SystemClock.now();
            store.signal_deliver(SignalDeliverParams { signals, now: sent_at }).await?;
            // Wait cheaply (one aggregate query), then read when each finished from its
            // history: polling every instance would itself load the store.
            loop {
                let live: u64 = store
                    .queue_stats(None, SystemClock.now())
                    .await?
                    .iter()
                    .filter(|q| q.machine == "bench_parallel")
                    .map(|q| q.ready + q.scheduled + q.executing + q.waiting + q.suspended)
                    .sum();
                if live == 0 || sent.elapsed() > Duration::from_secs(60) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            worker.shutdown().await;
            let mut done = HashMap::new();
            for id in &ids {
                let d = store.instance_get(*id).await?;
                if let Some(h) =
                    d.history.iter().find(|h| h.entry.kind == HistoryKind::StepDone.as_str())
                {
                    done.insert(*id, h.at.since(sent_at).as_secs_f64() * 1000.0);
                }
            }
            if done.len() < n {
                bail!("parallel: {} of {n} finished", done.len());
            }
            done.into_values().collect::<Vec<f64>>()
        });
        times.sort_by(f64::total_cmp);
        let median = quantile(&times, 0.5);
        medians.push(median);
        rows.push(vec![
            json!(if dispatch { "dispatched" } else { "inline" }),
            json!(n),
            json!(median),
            json!(quantile(&times, 0.99)),
        ]);
    }
    let overhead = medians[1] - 500.0;
    Ok(Report {
        name: "parallel",
        title: format!(
            "Parallel state, regions sleeping 500 ms and 200 ms: event → @done, {n} instances at once"
        ),
        columns: vec!["mode", "instances", "p50 ms", "p99 ms"],
        rows,
        notes: vec![
            format!(
                "dispatch overhead over the slowest region (p50 − 500 ms): {overhead:.1} ms; target ≤ 50 ms with notifications on"
            ),
            format!("inline p50 {:.1} ms (≈ 700 ms expected)", medians[0]),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::FireCheck;
    use keel_core::instance::{HistoryEntry, HistoryRecord};
    use keel_core::{HistoryKind, InstanceId, Revision, Timestamp};
    use serde_json::{Value, json};

    fn record(kind: HistoryKind, data: Value) -> HistoryRecord {
        HistoryRecord {
            instance: InstanceId(1),
            seq: 1,
            at: Timestamp(0),
            revision: Revision(1),
            attempt: 1,
            entry: HistoryEntry::new(kind, data),
        }
    }

    #[test]
    fn a_fire_recorded_before_its_due_time_counts_as_early() {
        let mut check = FireCheck::default();
        check.add(&[
            record(HistoryKind::TimerFired, json!({ "due": 1_000, "at": 1_000 })),
            record(HistoryKind::TimerFired, json!({ "due": 1_000, "at": 1_250 })),
            record(HistoryKind::StepDone, json!({})),
        ]);
        check.add(&[record(HistoryKind::TimerFired, json!({ "due": 1_000, "at": 999 }))]);
        check.add(&[record(HistoryKind::TimerFired, json!({ "due": 1_000 }))]);
        check.add(&[]);
        assert_eq!(check, FireCheck { read: 4, fired: 4, early: 2 });
    }
}
