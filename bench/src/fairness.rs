//! `fairness` (PostgreSQL only): one concurrency key with N ready rows, one of them
//! executing (so the key is at its limit), and another key with a single ready row. Every
//! claim must return the other key's row; the figure is how long such a claim takes, which
//! must not grow with the busy key's backlog. The busy key's rows are bulk-loaded with SQL
//! (the setup is not what is measured); each claim's row is released again, so every claim
//! sees the same data.

use crate::report::{Report, quantile};
use crate::stores::{Factory, StoreKind};
use anyhow::{Result, bail};
use keel_core::config::Strategy;
use keel_core::plan::claim::ClaimPolicy;
use keel_core::ports::store::{ClaimParams, InsertParams, LeaseReleaseParams};
use keel_core::ports::{Clock, Store};
use keel_core::{MachineRef, NewInstance, WorkerId};
use keel_scheduler::SystemClock;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long each policy's claim loop runs.
const RUN: Duration = Duration::from_secs(5);
/// Most claims per policy (a slow claim stops the loop by time first).
const CLAIMS_MAX: usize = 200;

/// The scenario.
pub async fn fairness(factory: &Factory, n: usize) -> Result<Report> {
    if factory.kind() != StoreKind::Postgres {
        bail!("fairness: run it with --store postgres (the claim statement is PostgreSQL's)");
    }
    let (store, scratch) = factory.postgres().await?;
    let result = run(&store, n).await;
    scratch.drop_schema().await;
    let (loaded_s, figures) = result?;
    let rows = figures
        .iter()
        .map(|(what, l)| {
            vec![
                json!(what),
                json!(l.len()),
                json!(quantile(l, 0.5)),
                json!(quantile(l, 0.99)),
                json!(l.last().copied().unwrap_or(0.0)),
            ]
        })
        .collect();
    Ok(Report {
        name: "fairness",
        title: format!(
            "fairness: claim with {n} ready rows on a busy key and 1 on another, PostgreSQL"
        ),
        columns: vec!["policy", "claims", "claim p50 ms", "claim p99 ms", "claim max ms"],
        rows,
        notes: vec![
            format!("loaded {n} ready rows on key A (one more executing) in {loaded_s:.1} s"),
            "every claim (limit 10) returned key B's row: alone under K = 1, with two of key A's rows under K = 3 (A has two free places); the claimed rows are then released".into(),
        ],
    })
}

type Figures = (f64, Vec<(&'static str, Vec<f64>)>);

async fn run(store: &Arc<keel_store_postgres::PgStore>, n: usize) -> Result<Figures> {
    let loaded = Instant::now();
    let client = store.client().await?;
    client
        .batch_execute(&format!(
            "INSERT INTO instances (namespace, machine, machine_version, queue, priority, base_priority, \
               status, position, context, concurrency_key, eligible_at, created_at, updated_at) \
             SELECT 'default', 'fair', 1, 'default', 2, 2, 'runnable', 'go', '{{}}', 'A', \
               now() - interval '1 hour' + g * interval '1 millisecond', now(), now() \
             FROM generate_series(1, {n}) g; \
             INSERT INTO instances (namespace, machine, machine_version, queue, priority, base_priority, \
               status, position, context, concurrency_key, eligible_at, created_at, updated_at, \
               lease_owner, lease_expires_at, fencing_token) \
             VALUES ('default', 'fair', 1, 'default', 2, 2, 'executing', 'go', '{{}}', 'A', \
               now() - interval '2 hours', now(), now(), 'elsewhere', now() + interval '1 day', 1); \
             ANALYZE instances;"
        ))
        .await?;
    drop(client);
    let loaded_s = loaded.elapsed().as_secs_f64();
    let b = NewInstance::new(MachineRef::new("fair", 1), "go").concurrency_key("B");
    let inserted =
        store.instance_insert(InsertParams { instances: vec![b], now: SystemClock.now() }).await?;
    let b_id = inserted[0].id();
    let mut figures = Vec::new();
    for (what, policy) in [
        ("default (priority, K = 1)", ClaimPolicy::default()),
        ("fifo, K = 1", ClaimPolicy::new(Strategy::Fifo)),
        ("fifo, K = 3", ClaimPolicy { key_limit: 3, ..ClaimPolicy::new(Strategy::Fifo) }),
    ] {
        let mut latencies = Vec::new();
        let started = Instant::now();
        while started.elapsed() < RUN && latencies.len() < CLAIMS_MAX {
            let params = ClaimParams {
                worker: WorkerId("bench-claimer".into()),
                namespaces: Vec::new(),
                queues: vec!["default".into()],
                machines: vec![MachineRef::new("fair", 1)],
                policy,
                limit: 10,
                lease: Duration::from_secs(30),
                now: SystemClock.now(),
            };
            let t = Instant::now();
            let claims = store.instance_claim(params).await?;
            latencies.push(t.elapsed().as_secs_f64() * 1_000.0);
            let got: Vec<_> = claims.iter().map(|c| c.instance.id).collect();
            // Under K = 3 the busy key has two free places: its next two rows come too.
            let b_claimed = got.contains(&b_id);
            let expected = if policy.key_limit == 1 { 1 } else { 3 };
            if !b_claimed || got.len() != expected {
                bail!(
                    "fairness ({what}): the claim returned {got:?}, expected key B's row {b_id} and {} of key A's",
                    expected - 1
                );
            }
            let leases = claims.iter().map(|c| (c.instance.id, c.token())).collect();
            store.lease_release(LeaseReleaseParams { leases, now: SystemClock.now() }).await?;
        }
        latencies.sort_by(f64::total_cmp);
        figures.push((what, latencies));
    }
    Ok((loaded_s, figures))
}
