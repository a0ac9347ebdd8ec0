//! `ui`: how long the dashboard's pages take to answer with many instances in the store —
//! `keel serve`'s router in-process on a loopback port, one browser-like client asking
//! for each page in turn (the overview, its live fragment, instance lists first, deep and
//! filtered, an instance page, the dead letters first and deep), p50 / p95 / max over the
//! repeats. [`DEAD_LETTERS`] of the instances are dead-lettered first, so the overview
//! counts real dead letters and their list has pages to turn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use keel::{Keel, MachineRef, NewInstance};
use serde_json::json;

use crate::report::{Report, quantile};
use crate::stores::{Factory, StoreKind};

/// Instances per start batch.
const START_BATCH: usize = 1000;
/// Timed requests per page (after one untimed). With 20, p95 is the second slowest: a
/// p99 would be the slowest, the same figure as the max.
const REPEATS: usize = 20;
/// The machines the instances are spread over, each with its own queue.
const MACHINES: [&str; 4] = ["order", "invoice", "shipment", "refund"];
/// Instances taken to a dead letter (suspended) before the pages are timed.
const DEAD_LETTERS: usize = 2_000;
/// Instances claimed and dead-lettered per round.
const DEAD_LETTER_BATCH: usize = 500;

/// Claims `count` ready instances and commits each as a permanent failure: a suspended
/// instance with its dead letter, as a worker records one. Returns the dead letters' ids.
async fn dead_letter(keel: &Keel, count: usize) -> Result<Vec<i64>> {
    use keel_core::outcome::{Outcome, StepFailure};
    use keel_core::ports::Clock;
    use keel_core::ports::Store;
    use keel_core::ports::store::{ClaimParams, CommitParams};
    use keel_core::{StepCommit, WorkerId};
    use keel_scheduler::SystemClock;
    let store = keel.store();
    let mut ids = Vec::with_capacity(count);
    while ids.len() < count {
        let params = ClaimParams {
            worker: WorkerId("bench-ui".into()),
            namespaces: vec!["default".into()],
            queues: Vec::new(),
            machines: Vec::new(),
            policy: keel_core::plan::claim::ClaimPolicy::default(),
            limit: DEAD_LETTER_BATCH.min(count - ids.len()),
            lease: Duration::from_secs(300),
            now: SystemClock.now(),
        };
        let claims = store.instance_claim(params).await?;
        if claims.is_empty() {
            bail!("no ready instance left to dead-letter after {}", ids.len());
        }
        let commits = claims
            .iter()
            .map(|c| {
                let failure = StepFailure {
                    error: "the payment provider said no".into(),
                    retryable: false,
                    dead_letter: true,
                    signals: Vec::new(),
                    event: None,
                };
                StepCommit::new(c.instance.id, c.token(), Outcome::Suspend).failure(failure)
            })
            .collect();
        let receipts = store.step_commit(CommitParams { commits, now: SystemClock.now() }).await?;
        for receipt in receipts {
            ids.extend(receipt?.dead_letter.map(|d| d.0));
        }
    }
    Ok(ids)
}

/// Fills a fresh store with `instances` instances and times every page.
pub async fn ui(factory: &Factory, instances: usize) -> Result<Report> {
    let (keel, scratch, pg) = match factory.kind() {
        StoreKind::Memory => (Keel::from_store(keel_testkit::MemoryStore::new()), None, None),
        StoreKind::Sqlite => {
            (Keel::from_store(keel_store_sqlite::SqliteStore::temporary().await?), None, None)
        }
        StoreKind::Postgres => {
            let (store, scratch) = factory.postgres().await?;
            (Keel::from_store((*store).clone()), Some(scratch), Some(store))
        }
    };
    // The schema is dropped whether the measurement succeeded or not.
    let measured = measure(&keel, pg.as_deref(), instances).await;
    if let Some(scratch) = scratch {
        scratch.drop_schema().await;
    }
    let (timings, letters, fill_secs) = measured?;
    let rows = timings
        .iter()
        .map(|(name, ms)| {
            vec![
                json!(name),
                json!(quantile(ms, 0.5)),
                json!(quantile(ms, 0.95)),
                json!(ms.last().copied().unwrap_or_default()),
            ]
        })
        .collect();
    Ok(Report {
        name: "ui",
        title: format!(
            "dashboard pages with {instances} instances, {letters} of them dead-lettered ({fill_secs:.1} s to fill), {REPEATS} timed requests each after one untimed"
        ),
        columns: vec!["page", "p50 ms", "p95 ms", "max ms"],
        rows,
        notes: vec![
            "one client, server in-process on loopback; the time includes rendering the HTML"
                .into(),
            "PostgreSQL: the table is analyzed after the bulk fill, as autovacuum would".into(),
        ],
    })
}

/// Fills the store, serves the router on a loopback port and times every page: the
/// timings per page, the dead letters made and the seconds the fill took.
async fn measure(
    keel: &Keel,
    pg: Option<&keel_store_postgres::PgStore>,
    instances: usize,
) -> Result<(Vec<(String, Vec<f64>)>, usize, f64)> {
    let filled = Instant::now();
    let mut n = 0;
    while n < instances {
        let batch = (instances - n).min(START_BATCH);
        let news = (n..n + batch)
            .map(|i| {
                let machine = MACHINES[i % MACHINES.len()];
                let at = if i % 3 == 0 { "@init" } else { "work" };
                NewInstance::new(MachineRef::new(machine, 1), at)
                    .queue(machine)
                    .business_key(format!("key-{i}"))
                    .context(json!({ "i": i }))
            })
            .collect();
        keel.start_many(news).await?;
        n += batch;
    }
    let letters = dead_letter(keel, DEAD_LETTERS.min(instances / 2)).await?;
    let fill_secs = filled.elapsed().as_secs_f64();
    // A database that has held its rows for a while has planner statistics (autovacuum
    // analyzes after bulk changes); the freshly filled table gets them now, so the figures
    // are for that steady state rather than for the minute after a bulk load.
    if let Some(store) = pg {
        store.client().await?.batch_execute("ANALYZE instances; ANALYZE dead_letters").await?;
    }
    let metrics = crate::http::recorder()?;
    let state = keel_cli::serve::AppState::open(keel.clone(), "default", metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server =
        tokio::spawn(axum::serve(listener, keel_cli::serve::router(Arc::new(state))).into_future());
    let middle = instances as i64 / 2;
    let pages: Vec<(&str, String)> = vec![
        ("overview", "/ui/ns/default".into()),
        ("overview live fragment", "/ui/ns/default/fragments/overview".into()),
        ("instances, first page", "/ui/ns/default/instances".into()),
        ("instances, a page in the middle", format!("/ui/ns/default/instances?before={middle}")),
        ("instances of one machine", "/ui/ns/default/instances?machine=invoice".into()),
        ("instances by status", "/ui/ns/default/instances?status=runnable".into()),
        ("instances by state", "/ui/ns/default/instances?state=work".into()),
        ("instance by business key", format!("/ui/ns/default/instances?key=key-{}", instances / 3)),
        ("instance page", format!("/ui/ns/default/instances/{middle}")),
        ("dead letters, first page", "/ui/ns/default/dead-letters".into()),
        (
            "dead letters, a page in the middle",
            format!(
                "/ui/ns/default/dead-letters?after={}",
                letters.get(letters.len() / 2).copied().unwrap_or(0)
            ),
        ),
        ("dead letters of one machine", "/ui/ns/default/dead-letters?machine=refund".into()),
    ];
    let timings = tokio::task::spawn_blocking(move || -> Result<Vec<(String, Vec<f64>)>> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let mut out = Vec::new();
        for (name, path) in pages {
            let mut ms = Vec::with_capacity(REPEATS);
            // One request first, checked but not timed: the first answer of a page pays
            // for caches the later ones find warm.
            for repeat in 0..=REPEATS {
                let started = Instant::now();
                let mut resp = agent.get(&format!("{base}{path}")).call()?;
                let body = resp.body_mut().read_to_string()?;
                let elapsed = started.elapsed().as_secs_f64() * 1000.0;
                if resp.status().as_u16() != 200 || body.len() < 100 {
                    bail!("{name}: {path} answered {} ({} bytes)", resp.status(), body.len());
                }
                if repeat > 0 {
                    ms.push(elapsed);
                }
            }
            ms.sort_by(f64::total_cmp);
            out.push((name.to_owned(), ms));
        }
        Ok(out)
    })
    .await;
    server.abort();
    Ok((timings??, letters.len(), fill_secs))
}
