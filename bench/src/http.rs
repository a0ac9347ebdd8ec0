//! `http`: `keel serve`'s router on a loopback port, driven by 16 keep-alive HTTP clients —
//! events accepted per second through `POST …/events`, and worker-protocol steps per
//! second (poll + complete) with 16 concurrent HTTP workers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use keel::prometheus::PrometheusHandle;
use keel::{Keel, MachineRef, NewInstance};
use serde_json::json;

use crate::report::Report;
use crate::stores::{Factory, StoreKind};

/// Concurrent HTTP clients (and workers).
const CLIENTS: usize = 16;
/// Instances the events are spread over.
const TARGETS: usize = 256;
/// Instances started per batch before the worker-protocol run.
const START_BATCH: usize = 500;

/// The process's one Prometheus recorder, for the scenarios that serve `keel serve`'s
/// router (`http`, `ui`): the metrics facade takes one recorder per process, so the first
/// of them installs it and the next shares it. Scenarios run one after another.
pub fn recorder() -> Result<PrometheusHandle> {
    static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(handle) = RECORDER.get() {
        return Ok(handle.clone());
    }
    let handle = keel::prometheus::install()?;
    Ok(RECORDER.get_or_init(|| handle).clone())
}

/// Runs both measurements on a fresh store of the factory's kind.
pub async fn http(factory: &Factory, events: usize, steps: usize) -> Result<Report> {
    let (keel, scratch) = match factory.kind() {
        StoreKind::Memory => (Keel::from_store(keel_testkit::MemoryStore::new()), None),
        StoreKind::Sqlite => {
            (Keel::from_store(keel_store_sqlite::SqliteStore::temporary().await?), None)
        }
        StoreKind::Postgres => {
            let (store, scratch) = factory.postgres().await?;
            (Keel::from_store((*store).clone()), Some(scratch))
        }
    };
    let metrics = recorder()?;
    let state = keel_cli::serve::AppState::open(keel.clone(), "default", metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server =
        tokio::spawn(axum::serve(listener, keel_cli::serve::router(Arc::new(state))).into_future());

    let mut targets = Vec::with_capacity(TARGETS);
    for _ in 0..TARGETS {
        let new = NewInstance::new(MachineRef::new("bench_events", 1), "@init");
        targets.push(keel.start(new).await?.id().0);
    }
    let url = format!("{base}/v1/namespaces/default/events");
    let events_elapsed = tokio::task::spawn_blocking(move || {
        run_clients(events, move |agent, i| {
            let body =
                json!({ "instance": targets[i % TARGETS], "event": "TICK", "payload": { "i": i } });
            let resp = agent.post(&url).send_json(&body)?;
            if resp.status().as_u16() != 202 {
                bail!("events: status {}", resp.status());
            }
            Ok(())
        })
    })
    .await??;

    let mut left = steps;
    while left > 0 {
        let batch = left.min(START_BATCH);
        let news = (0..batch)
            .map(|_| NewInstance::new(MachineRef::new("bench_http", 1), "work"))
            .collect();
        keel.start_many(news).await?;
        left -= batch;
    }
    let done = Arc::new(AtomicUsize::new(0));
    let poll_url = format!("{base}/v1/worker/tasks/poll");
    let base2 = base.clone();
    let steps_elapsed =
        tokio::task::spawn_blocking(move || run_workers(steps, &done, &poll_url, &base2)).await??;
    server.abort();
    if let Some(scratch) = scratch {
        scratch.drop_schema().await;
    }
    let events_rate = events as f64 / events_elapsed.as_secs_f64();
    let steps_rate = steps as f64 / steps_elapsed.as_secs_f64();
    Ok(Report {
        name: "http",
        title: format!("keel serve over loopback HTTP/1.1 keep-alive, {CLIENTS} clients"),
        columns: vec!["measure", "count", "seconds", "per second"],
        rows: vec![
            vec![json!("POST …/events accepted (202)"), json!(events), json!(events_elapsed.as_secs_f64()), json!(events_rate)],
            vec![json!("worker protocol steps (poll + complete)"), json!(steps), json!(steps_elapsed.as_secs_f64()), json!(steps_rate)],
        ],
        notes: vec![
            "clients and server share the machine's cores; compare with `steps` for the in-process figure".into(),
        ],
    })
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// `total` calls of `call` spread over `CLIENTS` threads, each with its own keep-alive agent.
fn run_clients<F>(total: usize, call: F) -> Result<Duration>
where
    F: Fn(&ureq::Agent, usize) -> Result<()> + Send + Sync + 'static,
{
    let call = Arc::new(call);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let handles: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (call, next) = (Arc::clone(&call), Arc::clone(&next));
            std::thread::spawn(move || -> Result<()> {
                let agent = agent();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok(());
                    }
                    call(&agent, i)?;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
    }
    Ok(started.elapsed())
}

/// `CLIENTS` HTTP workers polling and completing until `total` steps are done.
fn run_workers(
    total: usize,
    done: &Arc<AtomicUsize>,
    poll_url: &str,
    base: &str,
) -> Result<Duration> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    let handles: Vec<_> = (0..CLIENTS)
        .map(|w| {
            let (done, poll_url, base) = (Arc::clone(done), poll_url.to_owned(), base.to_owned());
            std::thread::spawn(move || -> Result<()> {
                let agent = agent();
                let worker = format!("bench-{w}");
                let poll = json!({ "worker": worker, "namespace": "default",
                    "machines": [{ "name": "bench_http", "version": 1 }], "wait_ms": 100 });
                while done.load(Ordering::Relaxed) < total {
                    if Instant::now() > deadline {
                        bail!("http workers: not done within 600 s");
                    }
                    let mut resp = agent.post(&poll_url).send_json(&poll)?;
                    if resp.status().as_u16() == 204 {
                        continue;
                    }
                    let task: serde_json::Value = resp.body_mut().read_json()?;
                    let body = json!({ "worker": worker, "token": task["token"],
                        "outcome": { "type": "done", "result": {} } });
                    let url = format!("{base}/v1/worker/tasks/{}/complete", task["id"]);
                    let answer = agent.post(&url).send_json(&body)?;
                    if answer.status().as_u16() == 200 {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a worker thread panicked"))??;
    }
    Ok(started.elapsed())
}
