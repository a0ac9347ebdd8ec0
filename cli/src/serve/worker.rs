//! The worker protocol: a step machine served by a program in any language over HTTP.
//!
//! A worker polls for a task (a claim under a lease, with its fencing token), runs the
//! step, and completes it with an outcome or fails it with an error; it heartbeats to keep
//! a long step's lease. Every call after the poll names the token; once the lease has
//! been reaped and the instance claimed again, the old token gets 409 and its result is
//! dropped, exactly as a Rust worker's would be. A task's inbox is in its machine's order
//! (the file's `inbox_order`), and a step's settings are the file's for its machine and the
//! event it processes (`keel_core::inbox::step_event`,
//! `KeelConfig::file_step_config`), decided as an in-process worker decides them for a
//! machine that sets nothing in code. Failures go through the same retry and dead-letter
//! plan as in-process steps; a result the store refuses for good fails the step instead
//! (`keel_core::retry::refused_commit`), as it does in-process.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use axum::Extension;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel::{InstanceId, MachineRef, Outcome, StoreError};
use keel_core::config::{ConfigError, KeelConfig, QueueConfig};
use keel_core::ids::{FencingToken, WorkerId};
use keel_core::instance::{Instance, Signal};
use keel_core::plan::lease::ReapHold;
use keel_core::ports::Store;
use keel_core::ports::store::{
    Claim as Claimed, ClaimParams, CommitParams, CommitReceipt, LeaseExtendParams, LeaseReapParams,
    LeaseReleaseParams, WORKER_MACHINES_MAX,
};
use keel_core::retry::{
    self, AttemptsUsedUp, ErrorClass, FailureKind, RefusedCommit, attempts_used_up, failed_step,
};
use keel_core::{StepCommit, StepFailure};
use serde::Deserialize;
use serde_json::json;

use super::AppState;
use super::api::{ApiError, NoQuery, Path, body, read};
use super::auth::Grant;
use crate::commands::now;

/// Longest a poll waits for work.
pub const POLL_WAIT_MAX: Duration = Duration::from_secs(30);
/// Most long polls (`wait_ms` > 0) one server keeps waiting at once: the default size of
/// [`AppState::polls_waiting`]. A poll waiting with no work coming costs the store about
/// one claim round (a claim per polled queue) a second once its pause has grown (and at
/// most one per [`POLL_INTERVAL_MIN`] while ready hints keep coming), so the cap bounds
/// what waiting workers cost the store however many connect; a poll beyond it gets 429
/// with `Retry-After` before touching the store. Polls with `wait_ms` 0 never wait and take no
/// place.
pub const POLLS_WAITING_MAX: usize = 256;
/// The first pause between two claim rounds of one long poll, by default
/// ([`AppState::poll_interval_min`]); each pause without work doubles it, up to
/// [`POLL_INTERVAL_MAX`]. The pause is the correctness path: the store's ready hint
/// (`Store::ready_wait`) only ends one early. Also the least time a poll keeps before
/// its deadline for its last claim round.
pub const POLL_INTERVAL_MIN: Duration = Duration::from_millis(50);
/// The longest pause between two claim rounds of one long poll, by default
/// ([`AppState::poll_interval_max`]): the latency of a task whose store sent no ready
/// hint (or whose hint was lost).
pub const POLL_INTERVAL_MAX: Duration = Duration::from_secs(1);
/// What a poll refused for [`POLLS_WAITING_MAX`] is told to wait, in seconds.
const POLL_RETRY_AFTER_SECS: u64 = 1;
/// Shortest and longest lease a worker may ask for.
const LEASE_MIN: Duration = Duration::from_millis(100);
const LEASE_MAX: Duration = Duration::from_secs(3600);
/// The longest worker id a poll takes: the registry's name limit less ` (HTTP)`.
const WORKER_ID_BYTES_MAX: usize = keel_core::limits::NAME_BYTES_MAX - " (HTTP)".len();
/// Expired leases returned to runnable per poll.
const REAP_BATCH: usize = 100;
/// Most tasks one claim round fails, rather than hands out, because expired leases used
/// up their attempts; past it the round ends without a task.
const USED_UP_PER_ROUND: usize = 16;

/// `POST /v1/worker/tasks/poll`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollBody {
    worker: String,
    namespace: String,
    machines: Vec<MachineSpec>,
    #[serde(default = "default_lease")]
    lease_ms: u64,
    #[serde(default)]
    wait_ms: u64,
    /// The queues the worker serves; by default `default` and every queue the server's
    /// configuration names. Each is claimed with its own settings.
    #[serde(default)]
    queues: Option<Vec<String>>,
}

/// Most queues one poll names.
const POLL_QUEUES_MAX: usize = 64;

/// A machine (and version) a worker serves.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineSpec {
    name: String,
    version: i32,
}

fn default_lease() -> u64 {
    30_000
}

fn lease(lease_ms: u64) -> Result<Duration, ApiError> {
    let lease = Duration::from_millis(lease_ms);
    if lease < LEASE_MIN || lease > LEASE_MAX {
        return Err(ApiError::bad(
            "lease_ms",
            format!(
                "lease_ms: {lease_ms} is outside {}..={} ms",
                LEASE_MIN.as_millis(),
                LEASE_MAX.as_millis()
            ),
        ));
    }
    Ok(lease)
}

/// Claims one task, waiting up to `wait_ms` for one: 200 with the task, 204 without.
pub async fn poll(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: PollBody = body(&read(bytes)?)?;
    if grant.is_some_and(|Extension(g)| !g.sees(&b.namespace)) {
        return Err(ApiError::not_found(format!("no namespace {:?}", b.namespace)));
    }
    let lease = lease(b.lease_ms)?;
    if b.machines.is_empty() {
        return Err(ApiError::bad(
            "machines",
            "machines: name at least one {\"name\", \"version\"} the worker serves",
        ));
    }
    // What the worker registry takes, checked here so a poll it would refuse is a 400
    // and not a worker missing from `keel workers`.
    let named = |field: String, value: &str| {
        keel_core::instance::check_name(&field, value).map_err(|e| ApiError::bad(&field, e.message))
    };
    named("worker".to_owned(), &b.worker)?;
    if b.worker.len() > WORKER_ID_BYTES_MAX {
        return Err(ApiError::bad(
            "worker",
            format!(
                "worker: is {} bytes; the limit is {WORKER_ID_BYTES_MAX} (the registry names it `<worker> (HTTP)`)",
                b.worker.len()
            ),
        ));
    }
    named("namespace".to_owned(), &b.namespace)?;
    if b.machines.len() > WORKER_MACHINES_MAX {
        return Err(ApiError::bad(
            "machines",
            format!("machines: at most {WORKER_MACHINES_MAX} (got {})", b.machines.len()),
        ));
    }
    for (i, m) in b.machines.iter().enumerate() {
        named(format!("machines[{i}].name"), &m.name)?;
        if m.version < 1 {
            let field = format!("machines[{i}].version");
            return Err(ApiError::bad(
                &field,
                format!("{field}: {} is not a version; versions start at 1", m.version),
            ));
        }
    }
    let queues = if let Some(queues) = &b.queues {
        if queues.is_empty() || queues.len() > POLL_QUEUES_MAX {
            return Err(ApiError::bad(
                "queues",
                format!(
                    "queues: name 1 to {POLL_QUEUES_MAX} queues the worker serves, or leave it out for `default` and the queues the server's configuration names (got {})",
                    queues.len()
                ),
            ));
        }
        for (i, q) in queues.iter().enumerate() {
            named(format!("queues[{i}]"), q)?;
        }
        queues.clone()
    } else {
        let default = keel_core::ids::DEFAULT_QUEUE;
        let file = state.config.named_queues().into_iter().filter(|q| q != default);
        std::iter::once(default.to_owned()).chain(file).collect()
    };
    if b.wait_ms > POLL_WAIT_MAX.as_millis() as u64 {
        return Err(ApiError::bad(
            "wait_ms",
            format!("wait_ms: at most {} ms", POLL_WAIT_MAX.as_millis()),
        ));
    }
    // A place among the waiting polls, taken before the store is touched, so polls over
    // the cap cost it nothing.
    let _waiting = if b.wait_ms > 0 {
        match state.polls_waiting.try_acquire() {
            Ok(permit) => Some(permit),
            Err(_) => return Ok(too_many_waiting(b.wait_ms)),
        }
    } else {
        None
    };
    let store = state.keel.store();
    let declared: Vec<MachineRef> =
        b.machines.iter().map(|m| MachineRef::new(&m.name, m.version)).collect();
    state.beats.poll(store, &b.worker, &b.namespace, declared.clone(), lease).await;
    let claim = Claim { state: &state, body: &b, queues: &queues, machines: &declared, lease };
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_millis(b.wait_ms);
    let mut stopping = state.stopping.subscribe();
    let (pause_min, pause_max) = (state.poll_interval_min, state.poll_interval_max);
    let mut pause = pause_min;
    // Expired leases are reaped on the first round, on every round the timer starts, and
    // at least once per longest pause while hints keep the timer from ending; other
    // rounds a hint starts only claim, since a hint says nothing about leases.
    let mut reap = true;
    let mut reaped_at = started;
    // The longest claim round so far, and at least one first pause: the last round starts
    // that long before the deadline, so the poll answers by about `wait_ms` and a client
    // whose timeout is `wait_ms` does not drop a task claimed for it after it gave up.
    let mut round_cost = POLL_INTERVAL_MIN;
    loop {
        // No task goes out once the server is shutting down: its worker could not
        // complete it here, and the lease would expire and cost the task an attempt.
        if *stopping.borrow() {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        let round = tokio::time::Instant::now();
        reap |= round >= reaped_at + pause_max;
        if reap {
            reaped_at = round;
        }
        // Registered before the claim, so work made ready while the claim runs (and so
        // missed by it) ends the wait after it rather than the pause.
        let mut hint = if b.wait_ms > 0 { Hint::register(store).await } else { Hint::never() };
        let claimed = claim.round(reap).await?;
        round_cost = round_cost.max(round.elapsed());
        if let Some(claimed) = claimed {
            if *stopping.borrow() {
                // The shutdown began while the claim ran: give the task back as it was,
                // without counting an attempt, for a worker of another server.
                claim.give_back(&claimed).await?;
                return Ok(StatusCode::NO_CONTENT.into_response());
            }
            return Ok(Json(task(&state.config, &claimed)).into_response());
        }
        let last = deadline.checked_sub(round_cost).unwrap_or(started);
        if tokio::time::Instant::now() >= last {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        // Wait for the store's hint that work may be ready or for the pause to end,
        // whichever comes first; the pause grows while nothing comes, so an idle poll
        // costs the store less the longer it waits. A server shutting down answers 204
        // at once rather than holding the shutdown for the rest of `wait_ms`.
        let timer = (round + pause).min(last);
        let hinted = tokio::select! {
            () = hint.fired() => Some(true),
            () = tokio::time::sleep_until(timer) => Some(false),
            _ = stopping.wait_for(|stop| *stop) => None,
        };
        match hinted {
            None => return Ok(StatusCode::NO_CONTENT.into_response()),
            Some(true) => {
                // A hint wakes every waiting poll at once: spread their claims over the
                // first pause, and claim no sooner than one first pause after the last,
                // so a poll makes at most one round per first pause however many come.
                let jitter = pause_min.mul_f64(fastrand::f64());
                let at = (round + pause_min).max(tokio::time::Instant::now() + jitter);
                tokio::select! {
                    () = tokio::time::sleep_until(at.min(last)) => {}
                    _ = stopping.wait_for(|stop| *stop) => {}
                }
                reap = false;
            }
            Some(false) => {
                pause = (pause * 2).min(pause_max);
                reap = true;
            }
        }
    }
}

/// The store's ready hint for one wait. The store's future registers nothing until it is
/// first polled (its body has not run), so it is polled once when made: a notification
/// from then on ends the wait, even one sent while the claim before the wait runs.
struct Hint<'a> {
    /// `None` once the hint came while being registered (a permit the store had left).
    wait: Option<Pin<Box<dyn Future<Output = ()> + Send + 'a>>>,
}

impl<'a> Hint<'a> {
    async fn register(store: &'a keel::AnyStore) -> Hint<'a> {
        let mut wait = store.ready_wait();
        let came = std::future::poll_fn(|cx| Poll::Ready(wait.as_mut().poll(cx).is_ready())).await;
        Hint { wait: (!came).then_some(wait) }
    }

    /// A hint that never comes, for a poll that does not wait.
    fn never() -> Hint<'a> {
        Hint { wait: Some(Box::pin(std::future::pending::<()>())) }
    }

    /// Resolves when the hint comes (at once when it came while registering).
    async fn fired(&mut self) {
        if let Some(wait) = &mut self.wait {
            wait.as_mut().await;
        }
    }
}

/// 429 for a long poll beyond [`POLLS_WAITING_MAX`], with `Retry-After`.
fn too_many_waiting(wait_ms: u64) -> Response {
    let error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        Some("wait_ms"),
        format!(
            "wait_ms: {wait_ms} ms, but this server already holds as many waiting polls as it takes (by default {POLLS_WAITING_MAX}); poll again after Retry-After seconds, and run fewer polling workers per server (or spread them over more servers) or poll with a shorter wait_ms"
        ),
    );
    let mut response = error.into_response();
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(POLL_RETRY_AFTER_SECS));
    response
}

/// When the server's polls may reap expired leases: after the store was unreachable,
/// leases get a lease period from when it answers again to be renewed before any is
/// reaped (see [`ReapHold`]), the longest lease this server handed out.
#[derive(Debug, Default)]
pub struct ReapGate {
    state: std::sync::Mutex<(ReapHold, Duration)>,
}

impl ReapGate {
    fn with<T>(&self, f: impl FnOnce(&mut ReapHold, &mut Duration) -> T) -> T {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (hold, longest) = &mut *state;
        f(hold, longest)
    }

    /// A poll hands out leases of `lease`.
    fn handed_out(&self, lease: Duration) {
        self.with(|_, longest| *longest = (*longest).max(lease));
    }

    fn may_reap(&self, now: keel_core::Timestamp) -> bool {
        self.with(|hold, _| hold.may_reap(now))
    }

    fn unreachable(&self) {
        self.with(|hold, _| hold.unreachable());
    }

    fn answered(&self, now: keel_core::Timestamp) {
        self.with(|hold, longest| hold.answered(now, (*longest).max(LEASE_MIN)));
    }

    /// Learns from a store call's `result`: a retryable error says the store cannot be
    /// reached, anything else (a result or a refusal) that it answered.
    fn saw<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Err(error) if error.is_retryable() => self.unreachable(),
            _ => self.answered(now()),
        }
    }
}

/// A store call made for a worker, its answer told to the [`ReapGate`]: heartbeats and
/// results show whether the store can be reached as polls do, so after an outage every
/// worker that lived through it mid-step gets a lease period to renew its lease, even
/// when none of them polled.
async fn gated<T>(
    state: &AppState,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let result = call.await;
    state.reap_gate.saw(&result);
    result
}

/// What one poll claims with.
struct Claim<'a> {
    state: &'a AppState,
    body: &'a PollBody,
    queues: &'a [String],
    machines: &'a [MachineRef],
    lease: Duration,
}

impl Claim<'_> {
    /// One claim round: expired leases reaped when `reap`, then one task claimed, queue
    /// by queue.
    async fn round(&self, reap: bool) -> Result<Option<Claimed>, ApiError> {
        let store = self.state.keel.store();
        let gate = &self.state.reap_gate;
        gate.handed_out(self.lease);
        if reap && gate.may_reap(now()) {
            let params = LeaseReapParams { owner: None, limit: REAP_BATCH, now: now() };
            let reaped = gated(self.state, store.lease_reap(params)).await?;
            metrics::counter!("keel_leases_reaped_total").increment(reaped.len() as u64);
        }
        // Queue by queue, each under its own settings (claim order, global and per-key
        // limits, rates), as an in-process worker claims; from a random first queue, so
        // a busy one does not keep the others waiting.
        // A task whose attempts expired leases used up is failed here rather than handed
        // out, and the queue claimed from again, at most USED_UP_PER_ROUND times a round.
        let queues = self.queues;
        let first = fastrand::usize(..queues.len());
        let mut used_up = 0;
        for queue in queues.iter().cycle().skip(first).take(queues.len()) {
            while let Some(claimed) = self.claim_one(queue).await? {
                if !self.fail_used_up(&claimed).await? {
                    return Ok(Some(claimed));
                }
                used_up += 1;
                if used_up >= USED_UP_PER_ROUND {
                    return Ok(None);
                }
            }
        }
        Ok(None)
    }

    /// One task of `queue`, if one is ready.
    async fn claim_one(&self, queue: &str) -> Result<Option<Claimed>, ApiError> {
        let store = self.state.keel.store();
        let claim = store.instance_claim(ClaimParams {
            worker: WorkerId(self.body.worker.clone()),
            namespaces: vec![self.body.namespace.clone()],
            queues: vec![queue.to_owned()],
            machines: self.machines.to_vec(),
            limit: 1,
            lease: self.lease,
            now: now(),
            policy: self.state.config.claim_policy(queue),
        });
        let claims = gated(self.state, claim).await?;
        let mut claimed = claims.into_iter().next();
        if let Some(claimed) = &mut claimed {
            in_step_order(&self.state.config, &claimed.instance, &mut claimed.inbox);
        }
        Ok(claimed)
    }

    /// Whether `claimed`'s attempts were used up by expired leases (its step may be
    /// taking its worker down with it), as an in-process worker checks before it runs a
    /// step (`keel_core::retry::attempts_used_up`). If so it is not handed out but failed
    /// as a remote step's non-retryable failure is, through the step's retry and
    /// dead-letter settings: a dead letter naming the expired leases, by default. Should
    /// the store refuse that failure, its refusal's failure and the last-resort
    /// suspension, the instance fails: otherwise it would come back after every lease.
    async fn fail_used_up(&self, claimed: &Claimed) -> Result<bool, ApiError> {
        let row = &claimed.instance;
        let step = Step { state: self.state, row, token: claimed.token(), signals: &claimed.inbox };
        let config = match step.config() {
            Ok(config) => config,
            Err(error) => {
                self.give_back(claimed).await?;
                return Err(error);
            }
        };
        let Some(used_up) = attempts_used_up(&config.retry, row) else {
            return Ok(false);
        };
        let failed =
            Failed { kind: AttemptsUsedUp::KIND, error: used_up.message.clone(), draw: 0.0 };
        let commit = failed.commit(&config, row, claimed.token(), &claimed.inbox);
        let refused = match step.land(commit, true).await {
            // Stale: another worker took it meanwhile, and checks it again itself.
            Ok(_) | Err(NotLanded::Stale) => return Ok(true),
            Err(NotLanded::Unavailable(error)) => return Err(error.into()),
            Err(NotLanded::Refused(refused)) => refused,
        };
        let reason = format!(
            "{}; the store refused to record that ({refused}), so the instance is failed instead",
            used_up.message
        );
        let failure = StepFailure::of_step(reason.clone(), false, None, &claimed.inbox);
        let stop =
            StepCommit::new(row.id, claimed.token(), Outcome::Stop { reason }).failure(failure);
        match commit_counted(self.state, &row.machine.name, stop, true).await {
            Ok(_) => Ok(true),
            Err(error) => match retry::refused_commit(error.kind) {
                RefusedCommit::Discard => Ok(true),
                RefusedCommit::Retry => Err(error.into()),
                RefusedCommit::Fail(_) => {
                    // Nothing the store takes is left: the lease expires, and the task is
                    // checked again after it; the poll claims on meanwhile.
                    crate::output::warn(&format!(
                        "task {}: {refused}, and then failing the instance ({error}); it is checked again when its lease expires",
                        row.id
                    ));
                    Ok(true)
                }
            },
        }
    }

    /// Releases a claim no worker will get, counting no attempt: the task is runnable
    /// again at once, as it was before the claim.
    async fn give_back(&self, claim: &Claimed) -> Result<(), ApiError> {
        let leases = vec![(claim.instance.id, claim.token())];
        let release =
            self.state.keel.store().lease_release(LeaseReleaseParams { leases, now: now() });
        gated(self.state, release).await?;
        Ok(())
    }
}

/// The task a claim hands the worker, counted in the queue wait time. `timeout_ms` is
/// the step's `timeout` by the file, for the machine and the event the step processes,
/// as an in-process worker would stop the step after it: the server cannot stop a remote
/// step, so the worker is told (`null` if the file's levels for it do not resolve; the
/// result then fails with that error).
fn task(config: &KeelConfig, claim: &Claimed) -> serde_json::Value {
    let i = &claim.instance;
    let timeout = step_config(config, i, &claim.inbox).ok().map(|c| c.timeout.as_millis() as u64);
    let waited = now().since(i.eligible_at);
    metrics::histogram!("keel_queue_wait_time_seconds", "machine" => i.machine.name.clone())
        .record(waited.as_secs_f64());
    json!({
        "id": i.id.0,
        "token": claim.token().0,
        "machine": i.machine.name,
        "version": i.machine.version,
        "step": i.position,
        "context": i.context,
        "attempt": i.attempt,
        "awaits": i.awaits,
        "inbox": claim.inbox,
        "lease_expires_at": i.lease_expires_at,
        "timeout_ms": timeout,
    })
}

/// The worker and token every call after the poll names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatBody {
    worker: String,
    token: i64,
    /// Without it: the lease this worker's last poll here asked for (30 s when this
    /// server has not seen it poll), and never less than what is left of the lease it
    /// holds, so a heartbeat never shortens a lease.
    #[serde(default)]
    lease_ms: Option<u64>,
}

/// A task of a namespace the token does not see is "not found", like a missing one.
/// Returns the row when it had to be read (a token scoped to some namespaces).
async fn visible(
    state: &AppState,
    grant: Option<Extension<Grant>>,
    id: InstanceId,
) -> Result<Option<Instance>, ApiError> {
    let Some(Extension(grant)) = grant else {
        return Ok(None);
    };
    let rows = gated(state, state.keel.store().instance_rows(vec![id])).await?;
    match rows.into_iter().find(|row| row.id == id && grant.sees(&row.namespace)) {
        Some(row) => Ok(Some(row)),
        None => Err(no_task(id)),
    }
}

fn task_id(raw: &str) -> Result<InstanceId, ApiError> {
    raw.parse::<i64>().ok().filter(|n| *n > 0).map(InstanceId).ok_or_else(|| {
        ApiError::bad(
            "id",
            format!("id: {raw:?} is not a task id; use the \"id\" the poll returned"),
        )
    })
}

fn no_task(id: InstanceId) -> ApiError {
    ApiError::not_found(format!("no task {id}"))
}

fn stale(id: InstanceId) -> ApiError {
    ApiError::conflict(format!(
        "task {id}: the lease is no longer yours (it expired and the task was claimed again, or it was committed); drop this result and poll again"
    ))
}

/// The lease a heartbeat without `lease_ms` extends by: the one `worker`'s last poll here
/// asked for ([`default_lease`] when this server has not seen it poll, say it polled
/// another server behind the same balancer), and at least what is left of the lease the
/// task holds, so the heartbeat never brings its expiry closer; at most [`LEASE_MAX`].
/// `read` is the task's row when the caller has read it already.
async fn unnamed_lease(
    state: &AppState,
    id: InstanceId,
    worker: &str,
    read: Option<Instance>,
) -> Result<Duration, ApiError> {
    let asked = state.beats.lease(worker).unwrap_or_else(|| Duration::from_millis(default_lease()));
    let row = if read.is_some() {
        read
    } else {
        let rows = gated(state, state.keel.store().instance_rows(vec![id])).await?;
        rows.into_iter().find(|r| r.id == id)
    };
    let at = now();
    let left = row
        .and_then(|row| row.lease_expires_at)
        .map_or(Duration::ZERO, |expires| expires.since(at));
    Ok(asked.max(left).clamp(LEASE_MIN, LEASE_MAX))
}

/// Extends a task's lease: 200, 409 when the token is stale, or 404 when there is no such
/// task (as `complete` and `fail` answer).
pub async fn heartbeat(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    Path(id): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let id = task_id(&id)?;
    let seen = visible(&state, grant, id).await?;
    let b: HeartbeatBody = body(&read(bytes)?)?;
    let store = state.keel.store();
    let lease = match b.lease_ms {
        Some(ms) => lease(ms)?,
        None => unnamed_lease(&state, id, &b.worker, seen).await?,
    };
    // The lease may now run this long: after an outage, the gate's hold covers it.
    state.reap_gate.handed_out(lease);
    let extend = store.lease_extend(LeaseExtendParams {
        worker: WorkerId(b.worker.clone()),
        leases: vec![(id, FencingToken(b.token))],
        lease,
        now: now(),
    });
    let held = gated(&state, extend).await?;
    if held.first().copied().unwrap_or(false) {
        // A worker busy on a long step heartbeats but does not poll: it is alive.
        state.beats.lease_held(store, &b.worker).await;
        return Ok(
            Json(json!({ "id": id.0, "lease_ms": lease.as_millis() as u64 })).into_response()
        );
    }
    let rows = gated(&state, store.instance_rows(vec![id])).await?;
    if rows.iter().any(|row| row.id == id) { Err(stale(id)) } else { Err(no_task(id)) }
}

/// `POST …/complete`: the step's outcome, as the `Outcome` JSON (`{"type": "done", …}`),
/// and `seen`, the ids of the task's inbox signals the step was handed. A step that ends
/// a wait consumes the awaited signals among those only: one delivered while the step ran
/// stays pending for the next step, as it does for an in-process worker.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    worker: String,
    token: i64,
    outcome: Outcome,
    #[serde(default)]
    seen: Option<Vec<i64>>,
}

/// `POST …/fail`: the step's error, and `seen` as in [`CompleteBody`]: a dead letter
/// lists the signals the step was handed (a skip of it drops them), so one delivered
/// while the step ran is not among them. Without `seen`, the inbox as it stands is used.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailBody {
    worker: String,
    token: i64,
    error: String,
    #[serde(default = "retryable_by_default")]
    retryable: bool,
    #[serde(default)]
    seen: Option<Vec<i64>>,
}

/// The signals of `inbox` a task's `seen` names (at most a task's inbox of ids). The
/// instance detail lists the oldest `INBOX_LIST_MAX` pending signals; a task that ran
/// under priority order past them leaves those it saw beyond pending, handed again.
fn seen_in(inbox: &[keel::Signal], ids: &[i64]) -> Result<Vec<keel::Signal>, ApiError> {
    if ids.len() > keel_core::limits::CLAIM_INBOX_MAX {
        return Err(ApiError::bad(
            "seen",
            format!(
                "{} ids, but a task carries at most {} signals; send the ids of the task's `inbox`",
                ids.len(),
                keel_core::limits::CLAIM_INBOX_MAX
            ),
        ));
    }
    Ok(inbox.iter().filter(|s| ids.contains(&s.id.0)).cloned().collect())
}

/// A token starts children only where it may start instances itself: a child in a
/// namespace the token does not see is refused (403 naming the child), nothing committed.
fn children_within(grant: &Grant, outcome: &Outcome) -> Result<(), ApiError> {
    let Outcome::ScheduleChildren { children, .. } = outcome else {
        return Ok(());
    };
    match children.iter().position(|child| !grant.sees(&child.namespace)) {
        None => Ok(()),
        Some(i) => {
            let field = format!("outcome.children[{i}].namespace");
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                Some(&field),
                format!(
                    "{field}: this token may not start instances in namespace {:?}; start the child in a namespace the token lists (nothing was committed)",
                    children[i].namespace
                ),
            ))
        }
    }
}

fn retryable_by_default() -> bool {
    true
}

/// Commits a successful step: 200 with the new status; 409 for a stale token; 422 when
/// the store refused the result for good and the step was failed instead; 503 when the
/// store is unreachable; 500 when even the last-resort suspension was refused.
pub async fn complete(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    Path(id): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let id = task_id(&id)?;
    let scope = grant.as_ref().map(|Extension(g)| g.clone());
    visible(&state, grant, id).await?;
    let b: CompleteBody = body(&read(bytes)?)?;
    if let Some(grant) = &scope {
        children_within(grant, &b.outcome)?;
    }
    let detail = gated(&state, state.keel.get(id)).await?;
    let row = &detail.instance;
    if !holds(row, &b.worker, b.token) {
        return Err(stale(id));
    }
    let mut inbox = detail.inbox.clone();
    in_step_order(&state.config, row, &mut inbox);
    // As in-process: a step that does not park again consumes the signals it awaited,
    // among those it was handed.
    let consumes = keel_core::inbox::consumes(&b.outcome, row.awaits.as_deref());
    let seen: Vec<keel::Signal> = match &b.seen {
        Some(ids) => seen_in(&inbox, ids)?,
        None if consumes => {
            return Err(ApiError::bad(
                "seen",
                format!(
                    "instance {id} awaited `{}`, so completing it consumes the signals the step saw: send `\"seen\": [the ids of the task's inbox]` (nothing was committed)",
                    row.awaits.as_deref().unwrap_or_default()
                ),
            ));
        }
        None => Vec::new(),
    };
    let consume = keel_core::inbox::consumed_by(&b.outcome, row.awaits.as_deref(), &seen);
    let commit = StepCommit::new(id, FencingToken(b.token), b.outcome).consume(consume);
    // Should the store refuse the result, the step fails having seen what `fail` says.
    let signals = if b.seen.is_some() { seen } else { inbox };
    let step = Step { state: &state, row, token: FencingToken(b.token), signals: &signals };
    commit_one(&step, commit, false).await
}

/// Commits a failed step through the retry and dead-letter plan: 200, or 409, 422, 503
/// and 500 as for [`complete`].
pub async fn fail(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    Path(id): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let id = task_id(&id)?;
    visible(&state, grant, id).await?;
    let b: FailBody = body(&read(bytes)?)?;
    let detail = gated(&state, state.keel.get(id)).await?;
    let row = &detail.instance;
    if !holds(row, &b.worker, b.token) {
        return Err(stale(id));
    }
    let kind = if b.retryable { FailureKind::Action } else { FailureKind::NonRetryable };
    // The step ran under the settings of the event it processed: the first of `seen`, or
    // without `seen` the first of the inbox as it stands in its machine's order (a
    // failed attempt consumes nothing; a more urgent signal delivered since the poll
    // sorts first under priority order, so a worker that wants the exact event sends
    // `seen`). A remote step reports no single
    // event it was processing, so `skip` suspends too, and with dead letters disabled
    // the instance fails. Its retry delay is jittered as an in-process one is, so remote
    // steps failing together do not retry together.
    let mut inbox = detail.inbox.clone();
    in_step_order(&state.config, row, &mut inbox);
    let seen = match &b.seen {
        Some(ids) => seen_in(&inbox, ids)?,
        None => inbox,
    };
    let step = Step { state: &state, row, token: FencingToken(b.token), signals: &seen };
    let config = step.config()?;
    let failed = Failed { kind, error: b.error, draw: fastrand::f64() };
    let commit = failed.commit(&config, row, FencingToken(b.token), &seen);
    commit_one(&step, commit, true).await
}

/// Puts a task's inbox (read in arrival order) in the order its machine's steps see it,
/// as an in-process worker orders a claim's: the file's `[machines.<m>] inbox_order`, else
/// arrival order (a remote machine sets nothing in code).
fn in_step_order(config: &KeelConfig, row: &Instance, inbox: &mut [Signal]) {
    let order = config.inbox_order(&row.machine.name).unwrap_or_default();
    keel_core::inbox::order(inbox, order, row.base_priority);
}

/// The settings a step of `row` runs with, having been handed `signals` (in its machine's
/// order): the file's for its machine and the event the step processes, decided as an
/// in-process worker decides them for a machine that sets nothing in code.
fn step_config(
    config: &KeelConfig,
    row: &Instance,
    signals: &[Signal],
) -> Result<QueueConfig, ConfigError> {
    let event = keel_core::inbox::step_event(&row.position, signals).map(|s| s.name.as_str());
    config.file_step_config(&row.machine.name, &row.position, event)
}

/// A remote step whose result is being committed: its row, the token it holds, and the
/// signals it was handed (in its machine's order).
struct Step<'a> {
    state: &'a AppState,
    row: &'a Instance,
    token: FencingToken,
    signals: &'a [Signal],
}

/// A remote step's result that the store took.
enum Landed {
    /// As sent.
    Committed(CommitReceipt),
    /// Refused for good, and committed as a failure of the step instead, with the error
    /// the step failed with.
    FailedInstead(CommitReceipt, String),
}

/// A remote step's result that the store did not take.
enum NotLanded {
    /// The lease is no longer the worker's: the result is stale, drop it.
    Stale,
    /// The store could not be reached; the lease is still held.
    Unavailable(StoreError),
    /// The store refused the result, the step's failure and the last-resort suspension:
    /// each refusal, in one message. The lease is still held.
    Refused(String),
}

impl Step<'_> {
    /// The step's settings ([`step_config`]).
    fn config(&self) -> Result<QueueConfig, ApiError> {
        step_config(&self.state.config, self.row, self.signals)
            .map_err(|error| ApiError::bad("config", error.to_string()))
    }

    /// Commits `commit`, the step's result. One the store refuses for good
    /// (`keel_core::retry::refused_commit`) fails the step as an in-process worker fails
    /// it: a non-retryable failure with "the store refused the step's result: …", through
    /// the step's retry and dead-letter settings; should that be refused too, a
    /// last-resort suspension carrying only the error (`keel_core::retry::last_resort`).
    async fn land(&self, commit: StepCommit, failed: bool) -> Result<Landed, NotLanded> {
        let machine = &self.row.machine.name;
        let first = match commit_counted(self.state, machine, commit, failed).await {
            Ok(receipt) => return Ok(Landed::Committed(receipt)),
            Err(error) => refusal(error)?,
        };
        let id = self.row.id;
        crate::output::warn(&format!(
            "task {id}: the store refused the step's result; failing the step: {first}"
        ));
        let error = retry::refused_error(&first);
        // Every level resolved at start-up (`check_levels`), so this falls back to the
        // documented defaults only in theory.
        let config = self.config().unwrap_or_default();
        let failed =
            Failed { kind: FailureKind::of_refusal(first.kind), error, draw: fastrand::f64() };
        let error = failed.error.clone();
        let failure = failed.commit(&config, self.row, self.token, self.signals);
        let second = match commit_counted(self.state, machine, failure.clone(), true).await {
            Ok(receipt) => return Ok(Landed::FailedInstead(receipt, error)),
            Err(error) => refusal(error)?,
        };
        let error = retry::refused_twice_error(&first, &second);
        let last = retry::last_resort(&failure, &error);
        match commit_counted(self.state, machine, last, true).await {
            Ok(receipt) => Ok(Landed::FailedInstead(receipt, error)),
            Err(third) => {
                let third = refusal(third)?;
                Err(NotLanded::Refused(format!(
                    "{error}, and then the suspension recording it ({third})"
                )))
            }
        }
    }
}

/// A refusal that makes the step fail, or why the result did not land otherwise.
fn refusal(error: StoreError) -> Result<StoreError, NotLanded> {
    match retry::refused_commit(error.kind) {
        RefusedCommit::Discard => Err(NotLanded::Stale),
        RefusedCommit::Retry => Err(NotLanded::Unavailable(error)),
        RefusedCommit::Fail(_) => Ok(error),
    }
}

/// A remote step's failure: its kind (retryable or not), its error, and the random draw
/// its retry delay is jittered with.
struct Failed {
    kind: FailureKind,
    error: String,
    draw: f64,
}

impl Failed {
    /// The commit of this failure of `row`'s step under `config`'s retry and dead-letter
    /// plan (`keel_core::retry::failed_step`), having seen `seen`. A remote step reports
    /// no single event it was processing, so `skip` suspends too.
    fn commit(
        self,
        config: &QueueConfig,
        row: &Instance,
        token: FencingToken,
        seen: &[Signal],
    ) -> StepCommit {
        let step = failed_step(config, row, self.kind, None, &self.error, self.draw);
        let retryable = self.kind.class() == ErrorClass::Retryable;
        let mut failure = StepFailure::of_step(self.error, retryable, None, seen);
        failure.dead_letter = step.dead_letter;
        let mut commit = StepCommit::new(row.id, token, step.outcome);
        commit.failure = Some(failure);
        commit.history = step.history.into_iter().collect();
        commit
    }
}

/// Commits one remote step's result ([`Step::land`]) and counts it in the step metrics an
/// in-process worker records, so one dashboard shows the steps of both: 200 with the new
/// status; 422 with the status and the error when the store refused the result for good
/// and the step was failed instead; 409 when the lease is no longer the worker's; 503
/// when the store cannot be reached; 500 when the store refused even the step's failure
/// (nothing was committed; the lease expires).
async fn commit_one(
    step: &Step<'_>,
    commit: StepCommit,
    failed: bool,
) -> Result<Response, ApiError> {
    let id = commit.id;
    match step.land(commit, failed).await {
        Ok(Landed::Committed(receipt)) => {
            Ok(Json(json!({ "id": id.0, "status": receipt.status })).into_response())
        }
        Ok(Landed::FailedInstead(receipt, error)) => {
            let body = json!({ "id": id.0, "status": receipt.status, "error": error });
            Ok((StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response())
        }
        Err(NotLanded::Stale) => Err(stale(id)),
        Err(NotLanded::Unavailable(error)) => Err(error.into()),
        Err(NotLanded::Refused(refused)) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!(
                "task {id}: {refused}; nothing was committed: drop this result and poll again (the lease expires and the task is handed out again)"
            ),
        )),
    }
}

/// [`commit_one`]'s commit and metrics, with the store's answer for the one commit.
async fn commit_counted(
    state: &AppState,
    machine: &str,
    commit: StepCommit,
    failed: bool,
) -> Result<CommitReceipt, StoreError> {
    let retry = matches!(commit.outcome, Outcome::Retry { .. });
    let step_commit =
        state.keel.store().step_commit(CommitParams { commits: vec![commit], now: now() });
    let results = gated(state, step_commit).await?;
    let receipt = results.into_iter().next().unwrap_or_else(|| {
        Err(StoreError::unavailable("the store returned no result for the commit"))
    })?;
    let labels = [("machine", machine.to_owned())];
    metrics::counter!("keel_queue_completed_total", &labels).increment(1);
    if failed {
        metrics::counter!("keel_queue_failed_total", &labels).increment(1);
    }
    if retry {
        metrics::counter!("keel_queue_retried_total", &labels).increment(1);
    }
    Ok(receipt)
}

/// Whether `worker` still holds the lease of `token`; the store checks the token again
/// when it commits, so this only answers early and names the worker's mistake.
fn holds(row: &keel::Instance, worker: &str, token: i64) -> bool {
    row.fencing_token == FencingToken(token)
        && row.lease_owner.as_ref().is_some_and(|owner| owner.0 == worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store in a temporary directory (kept while the first value lives) holding one
    /// runnable task of `echo` v1.
    async fn echo_task() -> (tempfile::TempDir, keel::Keel, InstanceId) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("keel.db").display());
        let keel = keel::Keel::connect(&url).await.unwrap();
        let id = keel
            .start(keel::NewInstance::new(MachineRef::new("echo", 1), "run"))
            .await
            .unwrap()
            .id();
        (dir, keel, id)
    }

    /// A task claimed for a poll that cannot hand it out (the server began to shut down
    /// while the claim ran) goes back runnable at once with no attempt counted, and the
    /// next claim gets it as it was.
    #[tokio::test]
    async fn a_claim_given_back_counts_no_attempt() {
        let (_dir, keel, id) = echo_task().await;
        let state = AppState::open(keel.clone(), "default", keel::prometheus::install().unwrap());
        let body: PollBody = serde_json::from_str(
            r#"{"worker":"w1","namespace":"default","machines":[{"name":"echo","version":1}]}"#,
        )
        .unwrap();
        let machines = [MachineRef::new("echo", 1)];
        let queues = [keel_core::ids::DEFAULT_QUEUE.to_owned()];
        let claim = Claim {
            state: &state,
            body: &body,
            queues: &queues,
            machines: &machines,
            lease: Duration::from_secs(60),
        };
        let first = claim.round(false).await.unwrap().expect("the task is claimed");
        claim.give_back(&first).await.unwrap();
        let row = keel.get(id).await.unwrap().instance;
        assert_eq!(
            (row.status, row.attempt, row.lease_owner),
            (keel_core::ids::Status::Runnable, 0, None)
        );
        let again = claim.round(false).await.unwrap().expect("the task is claimable again");
        assert_eq!((again.instance.id, again.instance.attempt), (id, 0));
        assert!(again.token() > first.token(), "a new claim, with a new fencing token");
    }

    /// A worker busy on one long step heartbeats and does not poll: each heartbeat that
    /// holds its lease records it in the registry (with what its poll declared), so it
    /// is not shown stale while it works.
    #[tokio::test]
    async fn a_heartbeat_that_holds_its_lease_records_its_worker() {
        let (_dir, keel, id) = echo_task().await;
        let mut state =
            AppState::open(keel.clone(), "default", keel::prometheus::install().unwrap());
        state.beats = super::super::registry::Beats::every(Duration::ZERO);
        let state = Arc::new(state);
        let poll_body =
            r#"{"worker":"w1","namespace":"default","machines":[{"name":"echo","version":1}]}"#;
        let answer =
            poll(NoQuery, State(Arc::clone(&state)), None, Ok(Bytes::from(poll_body))).await;
        let body = axum::body::to_bytes(answer.unwrap().into_body(), 1 << 20).await.unwrap();
        let task: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(task["id"], json!(id.0), "{task}");
        // The registry keeps milliseconds: the heartbeat comes in a later one.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let since = now();
        let beat = format!(r#"{{"worker":"w1","token":{}}}"#, task["token"]);
        let path = Path(id.0.to_string());
        heartbeat(NoQuery, State(Arc::clone(&state)), None, path, Ok(Bytes::from(beat)))
            .await
            .unwrap();
        let workers = keel.store().worker_list(since).await.unwrap();
        let seen: Vec<_> =
            workers.iter().map(|w| (w.id.0.as_str(), &w.machines, &w.namespaces)).collect();
        assert_eq!(
            seen,
            [("w1", &vec![MachineRef::new("echo", 1)], &vec!["default".to_owned()])],
            "the heartbeat recorded the worker with its poll's machines"
        );
    }

    /// Runs one SQL statement on the SQLite file at `url`.
    async fn sqlite_exec(url: &str, sql: &str) {
        use sqlx::{ConnectOptions as _, Connection as _};
        let path = url.strip_prefix("sqlite://").expect("a SQLite URL");
        let mut conn =
            sqlx::sqlite::SqliteConnectOptions::new().filename(path).connect().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned())).execute(&mut conn).await.unwrap();
        conn.close().await.unwrap();
    }

    /// While every HTTP worker is mid-step no poll comes, so the server learns of a store
    /// outage from their heartbeats (and results): the first poll after the store is back
    /// leaves the leases that ran out meanwhile to be renewed, rather than reaping them
    /// and handing their steps out a second time.
    #[tokio::test]
    async fn a_heartbeat_that_met_an_outage_holds_the_next_polls_reap() {
        let (dir, keel, id) = echo_task().await;
        let url = format!("sqlite://{}", dir.path().join("keel.db").display());
        let state =
            Arc::new(AppState::open(keel.clone(), "default", keel::prometheus::install().unwrap()));
        let poll_as = |worker: &str| {
            let body = format!(
                r#"{{"worker":"{worker}","namespace":"default","machines":[{{"name":"echo","version":1}}],"lease_ms":150}}"#
            );
            poll(NoQuery, State(Arc::clone(&state)), None, Ok(Bytes::from(body)))
        };
        let answer = poll_as("w1").await.unwrap();
        let body = axum::body::to_bytes(answer.into_body(), 1 << 20).await.unwrap();
        let task: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(task["id"], json!(id.0), "{task}");
        let beat = format!(r#"{{"worker":"w1","token":{},"lease_ms":150}}"#, task["token"]);
        let heartbeat = || {
            let path = Path(id.0.to_string());
            let bytes = Ok(Bytes::from(beat.clone()));
            heartbeat(NoQuery, State(Arc::clone(&state)), None, path, bytes)
        };
        // The store fails every write of the task's row as an outage (a runtime error in
        // a trigger): the heartbeat gets 503, and the lease runs out meanwhile.
        sqlite_exec(
            &url,
            &format!(
                "CREATE TRIGGER outage BEFORE UPDATE ON keel_instances WHEN OLD.id = {} \
                 BEGIN SELECT abs(-9223372036854775807 - 1); END",
                id.0
            ),
        )
        .await;
        let error = heartbeat().await.expect_err("the store is out of reach");
        assert_eq!(error.into_response().status(), StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(250)).await;
        sqlite_exec(&url, "DROP TRIGGER outage").await;
        // Back: another worker's poll does not take the task whose lease ran out.
        let answer = poll_as("w2").await.unwrap();
        assert_eq!(answer.status(), StatusCode::NO_CONTENT, "the task was handed out twice");
        heartbeat().await.expect("the worker mid-step renews its lease");
        let row = keel.get(id).await.unwrap().instance;
        assert_eq!((row.attempt, row.lease_owner), (0, Some(WorkerId("w1".to_owned()))));
    }
}
