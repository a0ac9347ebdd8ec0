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
    // The schema is dropped whether the measurement succeeded or not.
    let measured = measure(&keel, events, steps).await;
    if let Some(scratch) = scratch {
        scratch.drop_schema().await;
    }
    let (events_elapsed, steps_elapsed) = measured?;
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

/// Serves the router on a loopback port and times the events, then the steps.
async fn measure(keel: &Keel, events: usize, steps: usize) -> Result<(Duration, Duration)> {
    let metrics = recorder()?;
    let state = keel_cli::serve::AppState::open(keel.clone(), "default", metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server =
        tokio::spawn(axum::serve(listener, keel_cli::serve::router(Arc::new(state))).into_future());
    let measured = drive(keel, &base, events, steps).await;
    server.abort();
    measured
}

async fn drive(
    keel: &Keel,
    base: &str,
    events: usize,
    steps: usize,
) -> Result<(Duration, Duration)> {
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
            let mut resp = agent.post(&url).send_json(&body)?;
            if resp.status().as_u16() != 202 {
                bail!("events: {}", refused("POST …/events", &mut resp));
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
    let base2 = base.to_owned();
    let steps_elapsed =
        tokio::task::spawn_blocking(move || run_workers(steps, &done, &poll_url, &base2)).await??;
    Ok((events_elapsed, steps_elapsed))
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

/// `CLIENTS` HTTP workers polling and completing until `total` steps are done; the time
/// until the last step completed (not until every worker's last empty poll returned).
fn run_workers(
    total: usize,
    done: &Arc<AtomicUsize>,
    poll_url: &str,
    base: &str,
) -> Result<Duration> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    let last_done: Arc<OnceLock<Duration>> = Arc::new(OnceLock::new());
    let handles: Vec<_> = (0..CLIENTS)
        .map(|w| {
            let (done, poll_url, base) = (Arc::clone(done), poll_url.to_owned(), base.to_owned());
            let last_done = Arc::clone(&last_done);
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
                    match resp.status().as_u16() {
                        200 => {}
                        204 => continue,
                        _ => bail!("http workers: {}", refused("poll", &mut resp)),
                    }
                    let task: serde_json::Value = resp.body_mut().read_json()?;
                    let body = json!({ "worker": worker, "token": task["token"],
                        "outcome": { "type": "done", "result": {} } });
                    let url = format!("{base}/v1/worker/tasks/{}/complete", task["id"]);
                    let mut answer = agent.post(&url).send_json(&body)?;
                    if answer.status().as_u16() != 200 {
                        let call = format!("complete of task {}", task["id"]);
                        bail!("http workers: {}", refused(&call, &mut answer));
                    }
                    if done.fetch_add(1, Ordering::Relaxed) + 1 >= total {
                        let _ = last_done.set(started.elapsed());
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a worker thread panicked"))??;
    }
    Ok(last_done.get().copied().unwrap_or_else(|| started.elapsed()))
}

/// A call the server refused, with its status and the body the server sent, so a broken
/// server shows at once rather than as a slow rate or a timeout.
fn refused(call: &str, resp: &mut ureq::http::Response<ureq::Body>) -> String {
    let status = resp.status();
    let body = resp.body_mut().read_to_string().unwrap_or_else(|e| format!("(unreadable: {e})"));
    format!("{call} answered {status}: {body}")
}

#[cfg(test)]
mod tests {
    use super::run_workers;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    /// A server that answers every request with `status` and `body`.
    fn answering(status: &'static str, body: &'static str) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                    if let Some((name, value)) = line.split_once(':')
                        && name.eq_ignore_ascii_case("content-length")
                    {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut request = vec![0; length];
                let _ = reader.read_exact(&mut request);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        base
    }

    /// A server refusing the polls stops the workers at once with its status and body,
    /// rather than after the 600 s bound.
    #[test]
    fn a_refused_poll_stops_the_workers_with_the_status_and_body() {
        // A JSON body, as `keel serve` sends with an error (read as a task, it used to
        // send the workers to `/tasks/null/complete` until the bound).
        let base = answering("500 Internal Server Error", r#"{"error":"the store is gone"}"#);
        let poll = format!("{base}/v1/worker/tasks/poll");
        let error = run_workers(1, &Arc::new(AtomicUsize::new(0)), &poll, &base).unwrap_err();
        assert_eq!(
            error.to_string(),
            r#"http workers: poll answered 500 Internal Server Error: {"error":"the store is gone"}"#
        );
    }
}
