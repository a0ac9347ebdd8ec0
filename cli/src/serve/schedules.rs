//! The schedules of `keel serve --config`: listed per namespace with their pause state
//! (stored states win over the definition) and next fire times, and paused or resumed for
//! every worker. A name that the configuration does not define in the namespace is 404.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_core::ports::Store;
use keel_core::ports::store::SchedulePauseParams;
use keel_core::schedule::Schedule;
use serde_json::json;

use super::AppState;
use super::api::{ApiError, NoQuery};
use crate::commands::now;
use crate::schedules_cmd::{changed, infos, stored_states};

/// The configuration's schedules that act in `ns`.
fn in_namespace(state: &AppState, ns: &str) -> Result<Vec<Schedule>, ApiError> {
    let all = state.config.schedules().map_err(|e| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, None, format!("--config: {e}"))
    })?;
    Ok(all.into_iter().filter(|s| s.namespace() == ns).collect())
}

/// `GET /v1/namespaces/{ns}/schedules`.
pub async fn list(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
) -> Result<Response, ApiError> {
    let schedules = in_namespace(&state, &ns)?;
    let stored = stored_states(state.keel.store(), &schedules).await.map_err(|error| {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, None, format!("{error:#}"))
    })?;
    let listed = infos(&schedules, &stored, now());
    Ok(Json(json!({ "namespace": ns, "schedules": listed })).into_response())
}

async fn set(
    state: &AppState,
    ns: String,
    name: String,
    paused: bool,
) -> Result<Response, ApiError> {
    let schedules = in_namespace(state, &ns)?;
    let Some(schedule) = schedules.iter().find(|s| s.name() == name) else {
        return Err(ApiError::not_found(format!(
            "no schedule named {name:?} in namespace {ns:?}; the server knows the schedules of the keel.toml that `keel serve --config` names"
        )));
    };
    let at = now();
    let stored = state
        .keel
        .store()
        .schedule_pause(SchedulePauseParams { namespace: ns, name, paused, now: at })
        .await?;
    Ok(Json(changed(schedule, &stored, at).json).into_response())
}

/// `POST /v1/namespaces/{ns}/schedules/{name}/pause`.
pub async fn pause(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    set(&state, ns, name, true).await
}

/// `POST /v1/namespaces/{ns}/schedules/{name}/resume`.
pub async fn resume(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    set(&state, ns, name, false).await
}
