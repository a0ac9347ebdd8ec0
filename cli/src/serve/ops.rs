//! The operator API: what `keel status`, `pause` / `resume` and `dlq` do, per namespace.
//! A dead letter of another namespace is 404, like a missing one.

use std::sync::Arc;

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use keel::DeadLetterRetry;
use keel_core::ids::DeadLetterId;
use keel_core::instance::DeadLetter;
use keel_core::ports::Store;
use serde_json::json;

use super::AppState;
use super::api::{ApiError, NoQuery, Path};
use crate::commands::{now, status_rows};

/// Most dead letters one list returns (each carries its event and its attempts' errors),
/// the same bound as `keel dlq list`.
const DEAD_LETTER_PAGE: usize = crate::commands::DLQ_LIST_MAX;

/// Per queue and machine counts, as `keel status --json`.
pub async fn status(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
) -> Result<Response, ApiError> {
    namespace(&ns)?;
    let rows = status_rows(&state.keel, &ns, None).await.map_err(unavailable)?;
    Ok(Json(json!({ "namespace": ns, "queues": rows })).into_response())
}

/// The URL's namespace, checked as the store checks names: one it could never hold (empty,
/// too long, a control character) is the client's mistake, 400 naming `namespace`.
fn namespace(ns: &str) -> Result<(), ApiError> {
    keel_core::instance::check_name("namespace", ns).map_err(ApiError::from)
}

/// A read's error: the store's own kind when it is a store error (`Invalid` is 400 naming
/// the field, as in [`report_error`]), else 503, the store being out of reach.
fn unavailable(error: anyhow::Error) -> ApiError {
    match error.downcast::<keel::StoreError>() {
        Ok(store) => ApiError::from(store),
        Err(error) => {
            ApiError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, None, format!("{error:#}"))
        }
    }
}

async fn set_paused(
    state: &AppState,
    ns: String,
    queue: String,
    paused: bool,
) -> Result<Response, ApiError> {
    // A resume of a queue that is not paused writes nothing (see `commands::set_paused`).
    let change = crate::commands::set_paused(&state.keel, &ns, &queue, paused).await?;
    Ok(Json(
        json!({ "namespace": ns, "queue": queue, "paused": paused, "changed": change.changed }),
    )
    .into_response())
}

/// Pauses a queue.
pub async fn pause(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path((ns, queue)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    set_paused(&state, ns, queue, true).await
}

/// Resumes a queue.
pub async fn resume(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path((ns, queue)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    set_paused(&state, ns, queue, false).await
}

/// `GET …/dead-letters?machine=&limit=&after=`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LetterQuery {
    machine: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
}

/// One page of the namespace's dead letters, oldest first, as `keel dlq list --json`:
/// `next` continues (as `after`) while a page is full.
pub async fn dead_letters(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let q: LetterQuery = super::api::query(query.as_deref())?;
    let limit = q.limit.unwrap_or(DEAD_LETTER_PAGE);
    // A letter carries its event and its attempts' errors, so one answer stays a page.
    if limit == 0 || limit > DEAD_LETTER_PAGE {
        return Err(ApiError::bad(
            "limit",
            format!(
                "limit: {limit} is out of range; give 1 to {DEAD_LETTER_PAGE} and page on with `after` (the answer's `next`)"
            ),
        ));
    }
    match crate::commands::dead_letter_page(&state.keel, &ns, q.machine, limit, q.after.as_deref())
        .await
    {
        Ok(report) => Ok(Json(report.json).into_response()),
        Err(error) => Err(report_error(error)),
    }
}

/// A command's error as the API's: a store error keeps its own status (503 when the
/// store is down); the rest is the query's fault and names its parameter.
fn report_error(error: anyhow::Error) -> ApiError {
    match error.downcast::<keel::StoreError>() {
        Ok(store) => ApiError::from(store),
        Err(error) => {
            let text = format!("{error:#}");
            let field = text.split(':').next().unwrap_or("query").trim_start_matches("--");
            ApiError::bad(field, text.replacen("--", "", 1))
        }
    }
}

fn dead_letter_id(raw: &str) -> Result<DeadLetterId, ApiError> {
    raw.strip_prefix("dl")
        .unwrap_or(raw)
        .parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .map(DeadLetterId)
        .ok_or_else(|| {
            ApiError::bad(
                "id",
                format!(
                    "id: {raw:?} is not a dead letter id; write a positive number such as 3 or dl3"
                ),
            )
        })
}

async fn letter_in(state: &AppState, ns: &str, raw: &str) -> Result<DeadLetter, ApiError> {
    let id = dead_letter_id(raw)?;
    let read = state.keel.store().dead_letter_get(id).await;
    super::scope::in_namespace(read, ns)?
        .ok_or_else(|| ApiError::not_found(format!("no dead letter {id} in namespace {ns:?}")))
}

/// One dead letter.
pub async fn dead_letter(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(letter_in(&state, &ns, &id).await?).into_response())
}

/// Retries one dead letter now.
pub async fn dead_letter_retry(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let letter = letter_in(&state, &ns, &id).await?;
    let retried = state.keel.dead_letter_retry(DeadLetterRetry::one(letter.id)).await?;
    let ids: Vec<i64> = retried.iter().map(|i| i.0).collect();
    Ok(Json(json!({ "retried": ids })).into_response())
}

/// The last hour per machine (completed / failed per minute for sparklines, turnaround,
/// throughput, ready work with no live worker), as in `keel status --json`'s `machines`.
pub async fn activity(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
) -> Result<Response, ApiError> {
    namespace(&ns)?;
    let machines =
        crate::operate::activity(&state.keel, &ns, None, now()).await.map_err(unavailable)?;
    Ok(Json(json!({
        "namespace": ns,
        "window_ms": crate::operate::ACTIVITY_WINDOW.as_millis() as u64,
        "bucket_ms": crate::operate::ACTIVITY_BUCKET.as_millis() as u64,
        "machines": machines,
    }))
    .into_response())
}

/// `GET …/machines/{machine}/instances?status=&state=&limit=&after=`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    status: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
}

/// One page of a machine's instances, as `keel list --json`.
pub async fn list_instances(
    State(state): State<Arc<AppState>>,
    Path((ns, machine)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let q: ListQuery = super::api::query(query.as_deref())?;
    let args = crate::ListArgs {
        machine,
        state: q.state,
        status: q.status,
        limit: q.limit.unwrap_or(50),
        after: q.after,
    };
    match crate::operate::list(&state.keel, &ns, args).await {
        Ok(report) => Ok(Json(report.json).into_response()),
        Err(error) => Err(report_error(error)),
    }
}

/// `GET …/instances/{id}/history?before=&limit=`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    before: Option<String>,
    limit: Option<usize>,
}

/// One page of an instance's history, newest first, as `keel history --json`: `next`
/// continues (as `before`) while older entries exist. An instance of another namespace is
/// 404.
pub async fn history(
    State(state): State<Arc<AppState>>,
    Path((ns, raw)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let q: HistoryQuery = super::api::query(query.as_deref())?;
    let id = super::api::parse_id(&raw)?;
    super::api::instance_in(&state, &ns, id).await?;
    let limit = q.limit.unwrap_or(crate::operate::HISTORY_PAGE_DEFAULT);
    match crate::operate::history(&state.keel, &ns, id, q.before.as_deref(), limit).await {
        Ok(report) => Ok(Json(report.json).into_response()),
        Err(error) => Err(report_error(error)),
    }
}

/// Workers seen by heartbeat, live and stale (every namespace: a token that sees them all).
pub async fn workers(_: NoQuery, State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let stale = keel_core::ports::store::WORKER_STALE_AFTER.as_secs();
    let report = crate::operate::workers_in(&state.keel, None, &format!("{stale}s"))
        .await
        .map_err(|error| {
            ApiError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, None, format!("{error:#}"))
        })?;
    Ok(Json(report.json).into_response())
}
