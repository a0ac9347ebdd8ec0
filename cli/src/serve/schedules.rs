//! The schedules of `keel serve --config`: listed per namespace with their pause state
//! (stored states win over the definition) and next fire times, and paused or resumed for
//! every worker. A name that the configuration does not define in the namespace is 404.
//! A resume's answer says when it re-anchored the recorded fired tick (`re_anchored`:
//! from, to), as `keel schedules resume` does.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_core::schedule::Schedule;
use serde_json::json;

use super::AppState;
use super::api::{ApiError, NoQuery, Path};
use crate::commands::now;
use crate::schedules_cmd::{infos, set_paused, stored_states};

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
    Ok(Json(set_paused(state.keel.store(), schedule, paused).await?.json).into_response())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules_cmd::test_support::{NIGHTLY_TOML, ahead, fired, nightly_store};
    use keel_core::config::KeelConfig;
    use keel_core::ports::Store as _;

    async fn answer(response: Response) -> serde_json::Value {
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    /// The HTTP resume says when it re-anchored the recorded fired tick, from what to
    /// what; a repeated resume leaves a tick recorded since alone.
    #[tokio::test]
    async fn a_resume_answers_when_it_moved_the_recorded_tick() {
        let (_dir, _, _, keel) = nightly_store().await;
        let config = KeelConfig::from_toml_str(NIGHTLY_TOML).unwrap();
        let metrics = keel::prometheus::install().unwrap();
        let state = AppState { config, ..AppState::open(keel, "default", metrics) };
        let tick = ahead();
        state.keel.store().schedule_fired(fired(tick)).await.unwrap();
        let call = |paused| set(&state, "default".into(), "nightly".into(), paused);
        let paused = answer(call(true).await.unwrap()).await;
        assert_eq!(paused["re_anchored"], json!(null), "{paused}");
        let resumed = answer(call(false).await.unwrap()).await;
        let at = resumed["state"]["changed_at"].clone();
        assert_eq!(resumed["re_anchored"], json!({ "from": tick.as_millis(), "to": at }));
        assert_eq!(resumed["state"]["fired_through"], at, "{resumed}");
        let again = ahead();
        state.keel.store().schedule_fired(fired(again)).await.unwrap();
        let repeat = answer(call(false).await.unwrap()).await;
        assert_eq!(repeat["re_anchored"], json!(null), "{repeat}");
        assert_eq!(repeat["state"]["fired_through"], json!(again.as_millis()), "{repeat}");
    }
}
