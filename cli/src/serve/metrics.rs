//! `GET /metrics`: the store's counts sampled at scrape time, rendered as Prometheus text
//! together with whatever else the process recorded.
//!
//! Sampling on each scrape keeps the gauges exactly as fresh as the scraper asks for and
//! costs nothing between scrapes. The names match the ones a worker records, so a
//! dashboard works whether it scrapes `keel serve` or an embedded worker.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel::layers::scheduler::worker::{GaugeSample, record_queue_gauges};
use keel_core::ports::Store;

use super::AppState;
use crate::commands::now;

/// Samples and renders.
pub async fn handler(_: super::api::NoQuery, State(state): State<Arc<AppState>>) -> Response {
    if let Err(error) = sample(&state).await {
        let text = format!("# the store could not be sampled: {error}\n");
        return (StatusCode::SERVICE_UNAVAILABLE, text).into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

async fn sample(state: &AppState) -> Result<(), keel::StoreError> {
    let now = now();
    let store = state.keel.store();
    let stats = store.queue_stats(None, now).await?;
    let mut sample = GaugeSample::default();
    // Per machine, whether any of its queues holds leases: the expired ones are counted
    // once per machine, and only where some are held.
    let mut held: BTreeMap<(String, String), bool> = BTreeMap::new();
    for q in &stats {
        record_queue_gauges(&mut sample, q);
        let labels = [
            ("namespace", q.namespace.clone()),
            ("queue", q.queue.clone()),
            ("machine", q.machine.clone()),
        ];
        let age = q.oldest_ready_at.map_or(0.0, |at| (now.0 - at.0).max(0) as f64 / 1000.0);
        sample.set("keel_queue_oldest_ready_seconds", &labels, age);
        sample.set("keel_leases_held", &labels, q.executing as f64);
        *held.entry((q.namespace.clone(), q.machine.clone())).or_default() |= q.executing > 0;
    }
    for ((namespace, machine), any) in held {
        let n = if any {
            crate::operate::stuck_leases(&state.keel, &namespace, &machine, now)
                .await
                .map_err(|e| keel::StoreError::unavailable(format!("{e:#}")))?
        } else {
            0
        };
        sample.set(
            "keel_leases_expired",
            &[("namespace", namespace), ("machine", machine)],
            n as f64,
        );
    }
    for c in store.dead_letter_counts(None).await? {
        let labels = [("namespace", c.namespace), ("machine", c.machine)];
        sample.set("keel_dead_letters", &labels, c.count as f64);
    }
    for t in store.timer_status(None, now).await? {
        let labels = [("namespace", t.namespace.clone()), ("machine", t.machine.clone())];
        sample.set("keel_timers_armed", &labels, t.armed as f64);
        sample.set("keel_timers_overdue", &labels, t.overdue as f64);
        let lateness =
            t.next_due.filter(|due| *due <= now).map_or(0.0, |due| (now.0 - due.0) as f64 / 1000.0);
        sample.set("keel_timers_sweep_lateness_seconds", &labels, lateness);
        if let Some(at) = t.last_sweep_at {
            let lag = (now.0 - at.0).max(0) as f64 / 1000.0;
            sample.set("keel_timers_since_last_sweep_seconds", &labels, lag);
        }
    }
    state.gauges.publish(sample);
    Ok(())
}
