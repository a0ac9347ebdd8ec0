//! `keel serve`: the HTTP face of a store — the event and instance API, `/metrics` in
//! Prometheus text and `/health` with the same thresholds as `keel health`.
//!
//! With a tokens file every request needs a bearer token scoped to namespaces (`auth`);
//! without one the server refuses any address that is not a loopback one and says so
//! when it starts. Either way, changes a browser sends for another site are refused, and
//! without tokens so is any request addressed to a name that is not a loopback one
//! (`site`).

mod api;
pub mod auth;
mod metrics;
mod ops;
pub mod registry;
mod schedules;
mod scope;
mod site;
pub mod ui;
mod worker;

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use keel::Keel;
use keel::prometheus::PrometheusHandle;
use keel_core::config::KeelConfig;
use serde_json::json;

use crate::Cli;
use crate::health::{self, Level};

/// Largest request body accepted; a larger one gets 413 before it is read.
pub const BODY_BYTES_MAX: usize = 1024 * 1024;

pub use worker::{POLL_INTERVAL_MAX, POLL_INTERVAL_MIN, POLLS_WAITING_MAX};

/// What every handler shares.
pub struct AppState {
    /// The store.
    pub keel: Keel,
    /// Alert thresholds for `/health`.
    pub config: KeelConfig,
    /// The namespace `/health` checks.
    pub namespace: String,
    /// The Prometheus recorder `/metrics` renders.
    pub metrics: PrometheusHandle,
    /// The bearer tokens, when a tokens file was given; `None` = no authentication.
    pub tokens: Option<Vec<auth::Grant>>,
    /// The charts events and starts are checked against; `None` = not checked.
    pub definitions: Option<crate::definitions::Definitions>,
    /// Remote workers' registry beats.
    pub beats: registry::Beats,
    /// The gauges `/metrics` samples from the store: a series the store stops reporting
    /// reads 0 on the next scrape and is dropped from the one after.
    pub gauges: keel::layers::scheduler::worker::SampledGauges,
    /// The places for long polls waiting at once, [`POLLS_WAITING_MAX`] by default; a
    /// long poll that finds none gets 429. Replace it to serve with another cap.
    pub polls_waiting: tokio::sync::Semaphore,
    /// The first pause between two claim rounds of a long poll, [`POLL_INTERVAL_MIN`] by
    /// default; it doubles after each pause without work.
    pub poll_interval_min: std::time::Duration,
    /// The longest pause between two claim rounds of a long poll, [`POLL_INTERVAL_MAX`]
    /// by default: how late a waiting poll finds a task whose store sent no ready hint.
    pub poll_interval_max: std::time::Duration,
    /// Set once the server shuts down, so waiting long polls answer at once and no poll
    /// hands out a task.
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// Whether polls may reap expired leases, after the store was unreachable.
    pub reap_gate: worker::ReapGate,
    /// The live workers' versions a start without a version picks from (read once a
    /// second at most).
    pub served: api::ServedVersions,
}

impl AppState {
    /// A state without tokens, checking health in `namespace` with no thresholds. Like
    /// `keel serve` without `--tokens`, its router answers only requests addressed to a
    /// loopback name, so serve it on a loopback address.
    pub fn open(keel: Keel, namespace: &str, metrics: PrometheusHandle) -> Self {
        AppState {
            keel,
            config: KeelConfig::default(),
            namespace: namespace.to_owned(),
            metrics,
            tokens: None,
            definitions: None,
            beats: registry::Beats::default(),
            gauges: keel::layers::scheduler::worker::SampledGauges::default(),
            polls_waiting: tokio::sync::Semaphore::new(POLLS_WAITING_MAX),
            poll_interval_min: POLL_INTERVAL_MIN,
            poll_interval_max: POLL_INTERVAL_MAX,
            stopping: tokio::sync::watch::Sender::new(false),
            reap_gate: worker::ReapGate::default(),
            served: api::ServedVersions::default(),
        }
    }

    /// Tells the handlers the server is shutting down: waiting long polls answer 204 at
    /// once instead of holding the shutdown for the rest of their `wait_ms`, and polls
    /// hand out no task (one claimed meanwhile is released without counting an attempt).
    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }
}

/// Serves `router(state)` on `listener` until `shutdown` resolves, then stops taking
/// connections, ends the waiting long polls ([`AppState::stop`]) and returns once the
/// requests in progress are answered.
pub async fn serve_until(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stopping = Arc::clone(&state);
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            stopping.stop();
        })
        .await
}

/// The router, on a shared state.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health_handler))
        .route("/metrics", get(metrics::handler))
        .route("/v1/cluster/info", get(cluster_info))
        .route("/v1/namespaces/{ns}/events", post(api::send_event))
        .route("/v1/namespaces/{ns}/instances", post(api::start_instance))
        .route("/v1/namespaces/{ns}/instances/{id}", get(api::get_instance))
        .route("/v1/namespaces/{ns}/instances/{id}/cancel", post(api::cancel_instance))
        .route("/v1/namespaces/{ns}/instances/{id}/history", get(ops::history))
        .route("/v1/namespaces/{ns}/machines/{machine}/keys/{key}", get(api::get_by_key))
        .route("/v1/namespaces/{ns}/status", get(ops::status))
        .route("/v1/namespaces/{ns}/activity", get(ops::activity))
        .route("/v1/namespaces/{ns}/machines/{machine}/instances", get(ops::list_instances))
        .route("/v1/workers", get(ops::workers))
        .route("/v1/namespaces/{ns}/queues/{queue}/pause", post(ops::pause))
        .route("/v1/namespaces/{ns}/queues/{queue}/resume", post(ops::resume))
        .route("/v1/namespaces/{ns}/schedules", get(schedules::list))
        .route("/v1/namespaces/{ns}/schedules/{name}/pause", post(schedules::pause))
        .route("/v1/namespaces/{ns}/schedules/{name}/resume", post(schedules::resume))
        .route("/v1/namespaces/{ns}/dead-letters", get(ops::dead_letters))
        .route("/v1/namespaces/{ns}/dead-letters/{id}", get(ops::dead_letter))
        .route("/v1/namespaces/{ns}/dead-letters/{id}/retry", post(ops::dead_letter_retry))
        .route("/v1/worker/tasks/poll", post(worker::poll))
        .route("/v1/worker/tasks/{id}/heartbeat", post(worker::heartbeat))
        .route("/v1/worker/tasks/{id}/complete", post(worker::complete))
        .route("/v1/worker/tasks/{id}/fail", post(worker::fail))
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), auth::check))
        .merge(ui::router(Arc::clone(&state)))
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), site::check))
        .layer(axum::middleware::from_fn(close_after_refused_body))
        .with_state(state)
}

/// An error answer to an HTTP/1 request that carried a body also closes the connection,
/// and says so (`Connection: close`). Refusals (a stray query, a change from another site,
/// a missing token, a body too large) are answered before the body is read, and a
/// connection whose request body had not all arrived by then cannot carry another
/// request; without the header a client that keeps connections open would send its next
/// request on one the server is closing and see it fail with no answer. Which error
/// answers left a body unread is not tracked, so every one closes: a client reconnects
/// after an error, which costs a connection, never a request.
async fn close_after_refused_body(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::http::{HeaderValue, Version, header};
    let headers = request.headers();
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers.get(header::CONTENT_LENGTH).is_some_and(|n| n.as_bytes() != b"0");
    let http1 = request.version() <= Version::HTTP_11;
    let mut response = next.run(request).await;
    let status = response.status();
    if has_body && http1 && (status.is_client_error() || status.is_server_error()) {
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Checks the flags and files, opens the store and runs the server until Ctrl-C or
/// SIGTERM.
pub async fn run(
    cli: &Cli,
    listen: SocketAddr,
    tokens: Option<&std::path::Path>,
    definitions: Option<&std::path::Path>,
    server_worker: bool,
) -> anyhow::Result<()> {
    let tokens = tokens.map(auth::load).transpose()?;
    let definitions = definitions.map(crate::definitions::Definitions::load).transpose()?;
    if tokens.is_none() && !listen.ip().is_loopback() {
        bail!(
            "--listen: {listen} is not a loopback address; without --tokens keel serve has no authentication, so it only listens on 127.0.0.1 or ::1 (give it a tokens file to listen elsewhere)"
        );
    }
    let config = health::read_config(cli)?;
    // Every level as remote steps and `/health` will resolve it, so a rule broken across
    // levels is a start-up error and not a 400 or a 503 on some later request.
    config.check_levels().context("--config")?;
    // Checked now, so a bad schedule is a start-up error rather than a 500 later.
    config.schedules().context("--config: [schedules]")?;
    // Starts and sends without a priority or queue of their own take the file's.
    let keel = crate::commands::connect(cli, false).await?.with_settings(config.clone());
    let metrics = keel::prometheus::install()?;
    let open = tokens.is_none();
    let state = Arc::new(AppState {
        config,
        tokens,
        definitions,
        ..AppState::open(keel, &cli.namespace, metrics)
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("--listen: cannot bind {listen}"))?;
    let bound = listener.local_addr()?;
    if open {
        // A closed stdout or stderr (`keel serve | head -1`) must not stop the server.
        let _ = writeln!(
            std::io::stderr(),
            "WARNING: no authentication (no --tokens): anyone who can reach {bound} can read and change every namespace; listening on loopback only"
        );
    }
    let _ = writeln!(std::io::stdout(), "listening on http://{bound}");
    let loaded = state.definitions.as_ref().map_or(0, |d| d.charts().len());
    let _ = writeln!(
        std::io::stderr(),
        "dashboard: http://{bound}/ui ({loaded} chart definition(s) loaded)"
    );
    for w in state.definitions.iter().flat_map(crate::definitions::Definitions::warnings) {
        crate::output::warn(&w);
    }
    let worker =
        server_worker.then(|| start_server_worker(&state.keel, &state.config)).transpose()?;
    let served = serve_until(listener, state, keel::shutdown_signal()).await;
    if let Some(worker) = worker {
        // It runs no steps, so its shutdown only stops its sweeps, schedules and pruner.
        worker.shutdown().await;
    }
    served.context("the HTTP server stopped")
}

/// The server worker: no machines, so it claims nothing, but it fires due timers and join
/// deadlines in every namespace, fires the file's schedules and applies the file's
/// retention (the `Keel` carries `file`). Without it, a deployment whose steps all run in
/// HTTP workers would have nothing that fires a timer.
fn start_server_worker(keel: &Keel, file: &KeelConfig) -> anyhow::Result<keel::WorkerHandle> {
    let config = keel::WorkerConfig {
        // The server samples the store's counts into its gauges on every scrape; a second
        // sampler would write the same gauges on its own schedule.
        stats_interval: None,
        // The polls reap, holding off after an outage for the leases they handed out; a
        // second reaper would not.
        reap_expired: false,
        ..keel::WorkerConfig::named("keel-serve")
    };
    let id = config.worker_id.0.clone();
    // The file's machines run elsewhere (in HTTP or in-process workers): their sections
    // are no misspellings.
    let named = file.machines.keys().chain(file.retention_machines());
    let builder = named.fold(keel.worker_with(config), |b, m| b.served_elsewhere(m.clone()));
    let handle = builder
        .spawn()
        .context("the server worker did not start (--no-worker serves without it)")?;
    let _ = writeln!(
        std::io::stderr(),
        "worker {id}: fires timers, join deadlines, schedules and retention; runs no steps (--no-worker turns it off)"
    );
    Ok(handle)
}

async fn health_handler(_: api::NoQuery, State(state): State<Arc<AppState>>) -> Response {
    match health::probe(&state.keel, &state.namespace, &state.config).await {
        Ok((_, findings)) => {
            let level = findings.iter().map(|f| f.level).max().unwrap_or(Level::Healthy);
            let code = if level == Level::Critical {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            let body =
                json!({ "status": level, "namespace": state.namespace, "findings": findings });
            (code, axum::Json(body)).into_response()
        }
        Err(error) => {
            let body = json!({ "status": "critical", "error": format!("{error:#}") });
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
        }
    }
}

async fn cluster_info(_: api::NoQuery, State(state): State<Arc<AppState>>) -> Response {
    let body = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "store": state.keel.describe(),
        "body_bytes_max": BODY_BYTES_MAX,
    });
    axum::Json(body).into_response()
}
