//! Starting instances and holding them: single start latency, bulk start rate, and the
//! worker's memory with many instances parked on a signal.

use crate::report::{Report, quantile};
use crate::stores::{Factory, StoreKind};
use crate::with_store;
use anyhow::{Result, bail};
use async_trait::async_trait;
use keel_core::instance::{ANY_SIGNAL, NewInstance};
use keel_core::{MachineRef, Outcome};
use keel_scheduler::{Client, StepContext, StepError, StepMachine, SystemClock, Worker};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Single starts timed one by one (after a short warm-up).
const SINGLE: usize = 1_000;
/// Callers starting instances one at a time, all at once, for the concurrent rate.
const CONCURRENT_STARTERS: usize = 16;
/// Starts made by the concurrent callers together: [`SINGLE`] shared out evenly (992).
const CONCURRENT_STARTS: usize = SINGLE / CONCURRENT_STARTERS * CONCURRENT_STARTERS;
/// Instances per `start_many` call in the bulk run.
const BULK_CHUNK: usize = 1_000;
/// Instances the worker parks for the memory figure.
const PARKED: usize = 10_000;

/// A machine whose first step parks the instance until any signal.
struct Park;

#[async_trait]
impl StepMachine for Park {
    fn machine(&self) -> MachineRef {
        MachineRef::new("parked", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx.context.clone(), step: None })
    }
}

/// The resident set size of this process, in MiB (Linux; 0 where it cannot be read).
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The floor a single start is judged against on PostgreSQL: one `INSERT` of one row and
/// its commit, `BEGIN`, the insert and `COMMIT` sent together on one pooled connection of
/// the same driver (one round trip and one WAL flush, as a start is), [`SINGLE`] times
/// after a short warm-up, in a fresh schema. Its p50.
async fn insert_commit_floor(factory: &Factory) -> Result<f64> {
    let (store, scratch) = factory.postgres().await?;
    let measured = async {
        let c = store.client().await?;
        c.batch_execute(
            "CREATE TABLE floor_probe (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             at timestamptz NOT NULL, body jsonb NOT NULL)",
        )
        .await?;
        let insert =
            c.prepare("INSERT INTO floor_probe (at, body) VALUES (now(), '{}'::jsonb)").await?;
        let mut times = Vec::with_capacity(SINGLE);
        for i in 0..50 + SINGLE {
            let started = Instant::now();
            let (began, inserted, committed) = tokio::join!(
                c.batch_execute("BEGIN"),
                c.execute(&insert, &[]),
                c.batch_execute("COMMIT")
            );
            began?;
            inserted?;
            committed?;
            if i >= 50 {
                times.push(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
        times.sort_by(f64::total_cmp);
        anyhow::Ok(quantile(&times, 0.5))
    }
    .await;
    scratch.drop_schema().await;
    measured
}

/// Single start p50 / p99, bulk start rate over `n` instances, and RSS with
/// [`PARKED`] instances parked by a worker; on PostgreSQL, also the one-`INSERT`-commit
/// floor on the same server. `after_others`: scenarios ran before it in this process,
/// whose freed memory the allocator may still hold, so the RSS rows say so.
pub async fn start(factory: &Factory, n: usize, after_others: bool) -> Result<Report> {
    let mut rows = Vec::new();
    let (single, concurrent, bulk, parked) = with_store!(factory, |store| {
        let client = Client::new(Arc::clone(&store), SystemClock);
        let machine = MachineRef::new("started", 1);
        for _ in 0..50 {
            client.start(NewInstance::new(machine.clone(), "run")).await?;
        }
        let mut single = Vec::with_capacity(SINGLE);
        for _ in 0..SINGLE {
            let started = Instant::now();
            client.start(NewInstance::new(machine.clone(), "run")).await?;
            single.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        single.sort_by(f64::total_cmp);

        // Single starts from CONCURRENT_STARTERS callers at once, as a web server's
        // requests would make them.
        let client = Arc::new(client);
        let started = Instant::now();
        let mut starters = tokio::task::JoinSet::new();
        for _ in 0..CONCURRENT_STARTERS {
            let client = Arc::clone(&client);
            let machine = machine.clone();
            starters.spawn(async move {
                for _ in 0..CONCURRENT_STARTS / CONCURRENT_STARTERS {
                    client.start(NewInstance::new(machine.clone(), "run")).await?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(done) = starters.join_next().await {
            done??;
        }
        let concurrent = CONCURRENT_STARTS as f64 / started.elapsed().as_secs_f64();

        let started = Instant::now();
        let mut inserted = 0;
        while inserted < n {
            let chunk = BULK_CHUNK.min(n - inserted);
            let news = (0..chunk).map(|_| NewInstance::new(machine.clone(), "run")).collect();
            inserted += client.start_many(news).await?.len();
        }
        let bulk = n as f64 / started.elapsed().as_secs_f64();

        let before = rss_mib();
        let news = (0..PARKED).map(|_| NewInstance::new(MachineRef::new("parked", 1), "wait"));
        for chunk in news.collect::<Vec<_>>().chunks(BULK_CHUNK) {
            client.start_many(chunk.to_vec()).await?;
        }
        let config = keel_scheduler::WorkerConfig {
            queues: vec![("default".into(), 100)],
            timers: None,
            stats_interval: None,
            poll_interval: Duration::from_millis(50),
            ..keel_scheduler::WorkerConfig::default()
        };
        let worker = Worker::new(Arc::clone(&store), SystemClock, config).register(Park).spawn();
        let stats = Arc::clone(worker.stats());
        let waited = Instant::now();
        while (stats.committed() as usize) < PARKED && waited.elapsed() < Duration::from_secs(300) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let parked = stats.committed() as usize;
        let rss = rss_mib();
        worker.shutdown().await;
        if parked < PARKED {
            bail!("start: only {parked} of {PARKED} instances parked");
        }
        (single, concurrent, bulk, (before, rss))
    });
    rows.push(vec![json!("single start p50"), json!(quantile(&single, 0.5)), json!("ms")]);
    rows.push(vec![json!("single start p99"), json!(quantile(&single, 0.99)), json!("ms")]);
    if factory.kind() == StoreKind::Postgres {
        rows.push(vec![
            json!("floor: one INSERT commit, pipelined, p50"),
            json!(insert_commit_floor(factory).await?),
            json!("ms"),
        ]);
    }
    rows.push(vec![
        json!(format!("single starts, {CONCURRENT_STARTERS} callers at once")),
        json!(concurrent),
        json!("instances/s"),
    ]);
    rows.push(vec![
        json!(format!("bulk start ({BULK_CHUNK} per call)")),
        json!(bulk),
        json!("instances/s"),
    ]);
    rows.push(vec![json!("process RSS before parking"), json!(parked.0), json!("MiB")]);
    rows.push(vec![
        json!(format!("process RSS, worker with {PARKED} parked")),
        json!(parked.1),
        json!("MiB"),
    ]);
    let mut notes = vec![
        "targets on PostgreSQL: single start p50 ≤ 0.4 ms on a quiet machine (about the floor: one INSERT and its commit in one round trip), bulk ≥ 50 000 instances/s".to_owned(),
    ];
    if after_others {
        notes.push("the RSS rows include memory the scenarios run before this one left with the allocator; run `keel-bench start` alone, or first, for the worker's own figures".to_owned());
    }
    Ok(Report {
        name: "start",
        title: format!(
            "Starting instances: {SINGLE} single starts one after another, {CONCURRENT_STARTS} more from {CONCURRENT_STARTERS} callers at once, {n} in bulk, then {PARKED} parked by a worker"
        ),
        columns: vec!["measure", "value", "unit"],
        rows,
        notes,
    })
}
