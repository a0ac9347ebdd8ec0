//! The operator API: what `keel status`, `pause` / `resume` and `dlq` do, per namespace.
//! A dead letter of another namespace is 404, like a missing one.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use keel::{DeadLetterFilter, DeadLetterRetry};
use keel_core::ids::DeadLetterId;
use keel_core::instance::DeadLetter;
use keel_core::ports::Store;
use keel_core::ports::store::QueuePauseParams;
use serde_json::json;

use super::AppState;
use super::api::ApiError;
use crate::commands::{now, status_rows};

/// Most dead letters one list returns.
const DEAD_LETTER_PAGE: usize = 1000;

/// Per queue and machine counts, as `keel status --json`.
pub async fn status(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
) -> Result<Response, ApiError> {
    let rows = status_rows(&state.keel, &ns, None).await.map_err(|error| {
        ApiError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, None, format!("{error:#}"))
    })?;
    Ok(Json(json!({ "namespace": ns, "queues": rows })).into_response())
}

async fn set_paused(
    state: &AppState,
    ns: String,
    queue: String,
    paused: bool,
) -> Result<Response, ApiError> {
    state
        .keel
        .store()
        .queue_pause(QueuePauseParams {
            namespace: ns.clone(),
            queue: queue.clone(),
            paused,
            now: now(),
        })
        .await?;
    Ok(Json(json!({ "namespace": ns, "queue": queue, "paused": paused })).into_response())
}

/// Pauses a queue.
pub async fn pause(
    State(state): State<Arc<AppState>>,
    Path((ns, queue)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    set_paused(&state, ns, queue, true).await
}

/// Resumes a queue.
pub async fn resume(
    State(state): State<Arc<AppState>>,
    Path((ns, queue)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    set_paused(&state, ns, queue, false).await
}

/// The namespace's dead letters, oldest first.
pub async fn dead_letters(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
) -> Result<Response, ApiError> {
    let filter =
        DeadLetterFilter { namespace: Some(ns.clone()), machine: None, limit: DEAD_LETTER_PAGE };
    let letters = state.keel.dead_letters(filter).await?;
    Ok(Json(json!({ "namespace": ns, "dead_letters": letters })).into_response())
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
    match state.keel.store().dead_letter_get(id).await {
        Ok(letter) if letter.letter.namespace == ns => Ok(letter),
        Ok(_) | Err(_) => {
            Err(ApiError::not_found(format!("no dead letter {id} in namespace {ns:?}")))
        }
    }
}

/// One dead letter.
pub async fn dead_letter(
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(letter_in(&state, &ns, &id).await?).into_response())
}

/// Retries one dead letter now.
pub async fn dead_letter_retry(
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let letter = letter_in(&state, &ns, &id).await?;
    let retried = state.keel.dead_letter_retry(DeadLetterRetry::one(letter.id)).await?;
    let ids: Vec<i64> = retried.iter().map(|i| i.0).collect();
    Ok(Json(json!({ "retried": ids })).into_response())
}
