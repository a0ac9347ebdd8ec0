//! `prune`: pruning N ended instances (each with two history rows) on PostgreSQL while a
//! claimer keeps claiming ready instances, and the claim latency it sees: before pruning
//! (the baseline) and during it. The question it answers: does retention hold a lock that
//! stalls claims? The ended rows are bulk-loaded with SQL (the setup is not what is
//! measured); pruning runs the worker's `Pruner` with its default page size and pause.
//!
//! Claim latency on a shared machine also measures the machine (CPU, fsync), so the
//! scenario answers the lock question directly too: while pruning runs, a third session
//! samples `pg_locks` every [`LOCK_SAMPLE_EVERY`] for lock requests that are not granted
//! and reports the longest wait it saw (`waitstart` to the sample) among this run's own
//! sessions (the claimer's and the pruner's; other sessions on a shared server are not
//! counted).

use crate::report::{Report, quantile};
use crate::stores::{Factory, StoreKind};
use anyhow::{Result, bail};
use keel_core::ports::store::{ClaimParams, InsertParams, LeaseReleaseParams};
use keel_core::ports::{Clock, Store};
use keel_core::retention::RetentionConfig;
use keel_core::{MachineRef, NewInstance, WorkerId};
use keel_scheduler::SystemClock;
use keel_scheduler::prune::Pruner;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Ready instances the claimer cycles through (claimed, then released).
const READY: usize = 2_000;
/// How often the lock sampler looks at `pg_locks` while pruning runs.
const LOCK_SAMPLE_EVERY: Duration = Duration::from_millis(2);
/// How long the baseline claim loop runs before pruning starts.
const BASELINE: Duration = Duration::from_secs(5);

/// The scenario.
pub async fn prune(factory: &Factory, n: usize) -> Result<Report> {
    if factory.kind() != StoreKind::Postgres {
        bail!("prune: run it with --store postgres (the lock question is PostgreSQL's)");
    }
    let (store, scratch) = factory.postgres().await?;
    let result = run(&store, n).await;
    scratch.drop_schema().await;
    let (loaded_s, pruned, prune_s, base, during, waits) = result?;
    let row = |phase: &str, l: &[f64]| {
        let max = l.last().copied().unwrap_or(0.0);
        vec![
            json!(phase),
            json!(l.len()),
            json!(quantile(l, 0.5)),
            json!(quantile(l, 0.99)),
            json!(max),
        ]
    };
    let rows = vec![row("baseline (no pruning)", &base), row("during pruning", &during)];
    Ok(Report {
        name: "prune",
        title: format!("prune: {n} ended instances on PostgreSQL while claiming"),
        columns: vec!["phase", "claims", "claim p50 ms", "claim p99 ms", "claim max ms"],
        rows,
        notes: vec![
            format!("loaded {n} ended instances with 2 history rows each in {loaded_s:.1} s"),
            format!(
                "pruned {pruned} instances in {prune_s:.1} s ({:.0} instances/s)",
                pruned as f64 / prune_s.max(1e-9)
            ),
            "each claim takes up to 10 ready rows and releases them".into(),
            format!(
                "lock waits while pruning ({} samples of pg_locks): {}",
                waits.samples,
                if waits.waits == 0 {
                    "none seen".to_owned()
                } else {
                    format!(
                        "{} waiting lock requests seen, the longest {:.1} ms ({})",
                        waits.waits, waits.longest_ms, waits.longest
                    )
                }
            ),
        ],
    })
}

type Figures = (f64, u64, f64, Vec<f64>, Vec<f64>, LockWaits);

/// What the lock sampler saw.
#[derive(Debug, Default)]
struct LockWaits {
    /// Samples taken.
    samples: u64,
    /// Distinct waiting lock requests seen (by backend and wait start).
    waits: u64,
    /// The longest wait seen, in ms.
    longest_ms: f64,
    /// What waited longest: lock type, mode and the start of the waiting statement.
    longest: String,
}

/// Samples `pg_locks` until `stop` for lock requests not granted.
async fn sample_lock_waits(
    store: &keel_store_postgres::PgStore,
    stop: &AtomicBool,
) -> Result<LockWaits> {
    let client = store.client().await?;
    let app = crate::stores::application_name();
    let mut seen = std::collections::HashSet::new();
    let mut out = LockWaits::default();
    while !stop.load(Ordering::Relaxed) {
        let rows = client
            .query(
                "SELECT l.pid, l.waitstart::text, \
                   extract(epoch FROM clock_timestamp() - l.waitstart)::float8 * 1000, \
                   l.locktype || ' ' || l.mode || ': ' || left(a.query, 60) \
                 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE NOT l.granted AND l.waitstart IS NOT NULL AND a.application_name = $1",
                &[&app],
            )
            .await?;
        out.samples += 1;
        for row in rows {
            let (pid, start, ms, what): (i32, String, f64, String) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            if seen.insert((pid, start)) {
                out.waits += 1;
            }
            if ms > out.longest_ms {
                out.longest_ms = ms;
                out.longest = what;
            }
        }
        tokio::time::sleep(LOCK_SAMPLE_EVERY).await;
    }
    Ok(out)
}

async fn run(store: &Arc<keel_store_postgres::PgStore>, n: usize) -> Result<Figures> {
    let loaded = Instant::now();
    let client = store.client().await?;
    // Ended a day ago; ids from generate_series keep the load one statement per table.
    client
        .batch_execute(&format!(
            "INSERT INTO instances (namespace, machine, machine_version, queue, priority, base_priority, \
               status, position, context, eligible_at, created_at, updated_at) \
             SELECT 'default', 'ended', 1, 'default', 2, 2, 'done', 'end', '{{}}', \
               now() - interval '1 day', now() - interval '1 day', now() - interval '1 day' \
             FROM generate_series(1, {n}); \
             INSERT INTO history (instance_id, at, revision, attempt, kind, data) \
             SELECT id, updated_at, r, 0, 'STEP', '{{}}' FROM instances, generate_series(1, 2) r; \
             ANALYZE instances; ANALYZE history;"
        ))
        .await?;
    drop(client);
    let loaded_s = loaded.elapsed().as_secs_f64();
    let news = (0..READY).map(|_| NewInstance::new(MachineRef::new("ready", 1), "go")).collect();
    store.instance_insert(InsertParams { instances: news, now: SystemClock.now() }).await?;

    let base = claim_for(store, BASELINE, None).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let claimer = {
        let (store, stop) = (Arc::clone(store), Arc::clone(&stop));
        tokio::spawn(
            async move { claim_for(&store, Duration::from_secs(3_600), Some(&stop)).await },
        )
    };
    let pruner = Pruner {
        config: RetentionConfig {
            ended: Some(Duration::from_secs(3_600)),
            ..RetentionConfig::default()
        },
        namespaces: Vec::new(),
        dead_letters: Vec::new(),
        stats: Arc::default(),
        cursors: Arc::default(),
    };
    let sampler = {
        let (store, stop) = (Arc::clone(store), Arc::clone(&stop));
        tokio::spawn(async move { sample_lock_waits(&store, &stop).await })
    };
    let started = Instant::now();
    pruner.run_once(&**store, SystemClock.now()).await?;
    let prune_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let during = claimer.await??;
    let waits = sampler.await??;
    Ok((loaded_s, pruner.stats.counts().instances, prune_s, base, during, waits))
}

/// Claims (up to 10) and releases in a loop for `how_long` or until `stop`; returns each
/// claim's latency in ms, sorted.
async fn claim_for(
    store: &keel_store_postgres::PgStore,
    how_long: Duration,
    stop: Option<&AtomicBool>,
) -> Result<Vec<f64>> {
    let worker = WorkerId("bench-claimer".into());
    let mut latencies = Vec::new();
    let started = Instant::now();
    while started.elapsed() < how_long && !stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
        let params = ClaimParams {
            worker: worker.clone(),
            namespaces: Vec::new(),
            queues: Vec::new(),
            machines: vec![MachineRef::new("ready", 1)],
            policy: keel_core::plan::claim::ClaimPolicy::default(),
            limit: 10,
            lease: Duration::from_secs(30),
            now: SystemClock.now(),
        };
        let t = Instant::now();
        let claims = store.instance_claim(params).await?;
        latencies.push(t.elapsed().as_secs_f64() * 1_000.0);
        let leases = claims.iter().map(|c| (c.instance.id, c.token())).collect();
        store.lease_release(LeaseReleaseParams { leases, now: SystemClock.now() }).await?;
    }
    latencies.sort_by(f64::total_cmp);
    Ok(latencies)
}
