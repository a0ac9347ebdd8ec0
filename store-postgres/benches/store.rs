//! Store micro-benchmark (not a test): claim + commit throughput of no-op `Done` steps at
//! batch sizes 1, 10 and 100 against a real PostgreSQL.
//!
//! Run: `KEEL_BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!       cargo bench -p keel-store-postgres --bench store`
//! (falls back to `KEEL_TEST_DATABASE_URL`). Prints a table and writes
//! `target/bench/store.json`. Each run uses its own schema and drops it afterwards.
//! `KEEL_BENCH_QUICK=1` runs only batch 100 with one worker; `KEEL_BENCH_VERBOSE=1` prints
//! the time spent claiming and committing per worker.

use keel_core::instance::NewInstance;
use keel_core::outcome::{Outcome, StepCommit};
use keel_core::ports::Store;
use keel_core::ports::store::{ClaimParams, CommitParams, InsertParams};
use keel_core::{MachineRef, Timestamp, WorkerId};
use keel_store_postgres::{PgConfig, PgStore};
use serde_json::json;
use std::time::{Duration, Instant};

/// Round trips per claim + commit cycle, by construction: the claim is one statement; the
/// commit pipelines `BEGIN` + lock, then update + history + `COMMIT`.
const ROUND_TRIPS_PER_BATCH: u32 = 3;

struct Row {
    batch: usize,
    workers: usize,
    rows: usize,
    secs: f64,
}

async fn run(store: &PgStore, batch: usize, workers: usize, rows: usize) -> Row {
    let now = Timestamp(1_700_000_000_000);
    let news: Vec<NewInstance> =
        (0..rows).map(|_| NewInstance::new(MachineRef::new("bench", 1), "step")).collect();
    for chunk in news.chunks(5_000) {
        store.instance_insert(InsertParams { instances: chunk.to_vec(), now }).await.unwrap();
    }
    // Steady-state planner statistics, as autovacuum would have them in production.
    store.client().await.unwrap().batch_execute("ANALYZE instances").await.unwrap();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0usize;
            let (mut tc, mut tk) = (Duration::ZERO, Duration::ZERO);
            loop {
                let t = Instant::now();
                let claims = store
                    .instance_claim(ClaimParams {
                        worker: WorkerId(format!("bench-{w}")),
                        namespaces: vec![],
                        queues: vec![],
                        machines: vec![],
                        limit: batch,
                        lease: Duration::from_mins(1),
                        now,
                        policy: keel_core::plan::claim::ClaimPolicy::default(),
                    })
                    .await
                    .unwrap();
                tc += t.elapsed();
                if claims.is_empty() {
                    if std::env::var("KEEL_BENCH_VERBOSE").is_ok() {
                        eprintln!("batch {batch} worker {w}: claim {tc:?}, commit {tk:?}");
                    }
                    break done;
                }
                let t = Instant::now();
                let commits = claims
                    .iter()
                    .map(|c| {
                        StepCommit::new(
                            c.instance.id,
                            c.token(),
                            Outcome::Done { result: json!(null), step: None },
                        )
                    })
                    .collect();
                for r in store.step_commit(CommitParams { commits, now }).await.unwrap() {
                    r.unwrap();
                    done += 1;
                }
                tk += t.elapsed();
            }
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, rows);
    Row { batch, workers, rows, secs: start.elapsed().as_secs_f64() }
}

#[tokio::main]
async fn main() {
    let Some(url) = std::env::var("KEEL_BENCH_DATABASE_URL")
        .or_else(|_| std::env::var("KEEL_TEST_DATABASE_URL"))
        .ok()
        .filter(|u| !u.is_empty())
    else {
        eprintln!("SKIPPED: set KEEL_BENCH_DATABASE_URL (or KEEL_TEST_DATABASE_URL)");
        return;
    };
    let schema = format!("keel_bench_{}", std::process::id());
    let store = PgStore::connect(PgConfig::new(url).schema(schema.clone()).pool_size(8))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let mut results = Vec::new();
    let cases: &[(usize, usize, usize)] = if std::env::var("KEEL_BENCH_QUICK").is_ok() {
        &[(100, 1, 20_000)]
    } else {
        &[(1, 1, 2_000), (10, 1, 10_000), (100, 1, 40_000), (100, 2, 40_000), (100, 4, 40_000)]
    };
    for &(batch, workers, rows) in cases {
        results.push(run(&store, batch, workers, rows).await);
    }
    println!(
        "{:>6} {:>8} {:>8} {:>9} {:>12} {:>16}",
        "batch", "workers", "rows", "secs", "rows/s", "round trips/batch"
    );
    let mut json_rows = Vec::new();
    for r in &results {
        let rate = r.rows as f64 / r.secs;
        println!(
            "{:>6} {:>8} {:>8} {:>9.3} {:>12.0} {:>16}",
            r.batch, r.workers, r.rows, r.secs, rate, ROUND_TRIPS_PER_BATCH
        );
        json_rows.push(json!({
            "batch": r.batch, "workers": r.workers, "rows": r.rows, "secs": r.secs,
            "rows_per_sec": rate, "round_trips_per_batch": ROUND_TRIPS_PER_BATCH,
        }));
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir).unwrap();
    let out = json!({ "bench": "store", "outcome": "done (no-op)", "results": json_rows });
    std::fs::write(dir.join("store.json"), serde_json::to_string_pretty(&out).unwrap()).unwrap();
    let c = store.client().await.unwrap();
    c.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE")).await.unwrap();
    println!("wrote target/bench/store.json");
}
