//! `GET /metrics`: the store's counts sampled at scrape time, rendered as Prometheus text
//! together with whatever else the process recorded.
//!
//! Sampling on each scrape keeps the gauges exactly as fresh as the scraper asks for and
//! costs nothing between scrapes. The names match the ones a worker records, so a
//! dashboard works whether it scrapes `keel serve` or an embedded worker.
//!
//! The sampled gauges are recorded into a recorder of their own, made afresh for every
//! scrape, rather than into the process-wide one: that one keeps every series it was
//! ever given, so a machine, queue or namespace that left the store would be exported
//! for as long as the server runs. A series the store stops reporting reads 0 on the next
//! scrape (so a drained queue's graph ends at 0, not at its last count) and is gone from
//! the one after; counters and histograms stay with the process-wide recorder.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel::layers::scheduler::worker::{GaugeSample, record_queue_gauges};
use keel_core::ports::Store;
use metrics::{Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, SharedString, Unit};

use super::AppState;
use crate::commands::now;

/// Samples and renders.
pub async fn handler(_: super::api::NoQuery, State(state): State<Arc<AppState>>) -> Response {
    let sampled = match sample(&state).await {
        Ok(sample) => Snapshot::record(|| state.gauges.publish(sample)),
        Err(error) => {
            let text = format!("# the store could not be sampled: {error}\n");
            return (StatusCode::SERVICE_UNAVAILABLE, text).into_response();
        }
    };
    let mut text = sampled.render();
    // A family this scrape sampled is the store's, whatever else the process recorded
    // under its name (an embedded worker's sampler): one family, never two.
    text.push_str(&without_families(&state.metrics.render(), &sampled.names()));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn sample(state: &AppState) -> Result<GaugeSample, keel::StoreError> {
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
    Ok(sample)
}

/// One gauge series: its name and its labels in the order they were given.
type Series = (String, Vec<(String, String)>);

/// The gauges one scrape set, and nothing older: a recorder that takes gauges only.
#[derive(Debug, Default)]
struct Snapshot {
    values: Arc<Mutex<BTreeMap<Series, f64>>>,
}

impl Snapshot {
    /// The gauges `record` sets through the `metrics` macros, on this thread.
    fn record(record: impl FnOnce()) -> Snapshot {
        let snapshot = Snapshot::default();
        metrics::with_local_recorder(&snapshot, record);
        snapshot
    }

    fn values(&self) -> std::sync::MutexGuard<'_, BTreeMap<Series, f64>> {
        self.values.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn names(&self) -> BTreeSet<String> {
        self.values().keys().map(|(name, _)| name.clone()).collect()
    }

    /// Prometheus text, one `# TYPE` line per family.
    fn render(&self) -> String {
        let mut out = String::new();
        let mut family = None;
        for ((name, labels), value) in self.values().iter() {
            if family != Some(name) {
                let _ = writeln!(out, "# TYPE {name} gauge");
                family = Some(name);
            }
            out.push_str(name);
            if !labels.is_empty() {
                let pairs: Vec<String> =
                    labels.iter().map(|(k, v)| format!("{k}=\"{}\"", label_value(v))).collect();
                let _ = write!(out, "{{{}}}", pairs.join(","));
            }
            let _ = writeln!(out, " {}", number(*value));
        }
        out
    }
}

/// A label value escaped as the text format wants: backslash, double quote, newline.
fn label_value(text: &str) -> String {
    text.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

fn number(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        value.to_string()
    }
}

/// `text` without the lines (samples, `# HELP`, `# TYPE`) of the families in `names`.
fn without_families(text: &str, names: &BTreeSet<String>) -> String {
    let family = |line: &str| {
        let rest = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE "));
        let series = rest.unwrap_or(line);
        let end = series.find(['{', ' ']).unwrap_or(series.len());
        series[..end].to_owned()
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if names.contains(&family(line)) {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// One gauge of a [`Snapshot`].
struct Cell {
    series: Series,
    values: Arc<Mutex<BTreeMap<Series, f64>>>,
}

impl Cell {
    fn update(&self, change: impl FnOnce(&mut f64)) {
        let mut values = self.values.lock().unwrap_or_else(PoisonError::into_inner);
        change(values.entry(self.series.clone()).or_insert(0.0));
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        self.update(|v| *v += value);
    }
    fn decrement(&self, value: f64) {
        self.update(|v| *v -= value);
    }
    fn set(&self, value: f64) {
        self.update(|v| *v = value);
    }
}

impl metrics::Recorder for Snapshot {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    /// Counters are not a snapshot's: they go to the process-wide recorder's count.
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let labels = key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
        let series = (key.name().to_owned(), labels);
        Gauge::from_arc(Arc::new(Cell { series, values: Arc::clone(&self.values) }))
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_holds_only_what_its_scrape_set() {
        let gauges = keel::layers::scheduler::worker::SampledGauges::default();
        let mut first = GaugeSample::default();
        first.set("keel_queue_pending", &[("machine", "gone".to_owned())], 3.0);
        first.set("keel_queue_pending", &[("machine", "kept".to_owned())], 1.0);
        let text = Snapshot::record(|| gauges.publish(first)).render();
        assert!(text.contains("keel_queue_pending{machine=\"gone\"} 3\n"), "{text}");
        let mut second = GaugeSample::default();
        second.set("keel_queue_pending", &[("machine", "kept".to_owned())], 2.0);
        let text = Snapshot::record(|| gauges.publish(second)).render();
        assert!(text.contains("keel_queue_pending{machine=\"gone\"} 0\n"), "zeroed once: {text}");
        let mut third = GaugeSample::default();
        third.set("keel_queue_pending", &[("machine", "kept".to_owned())], 2.0);
        let text = Snapshot::record(|| gauges.publish(third)).render();
        assert_eq!(
            text,
            "# TYPE keel_queue_pending gauge\nkeel_queue_pending{machine=\"kept\"} 2\n"
        );
    }

    #[test]
    fn label_values_are_escaped_and_families_replaced() {
        let mut sample = GaugeSample::default();
        sample.set("keel_dead_letters", &[("namespace", "a\"b\\c\nd".to_owned())], 1.0);
        let gauges = keel::layers::scheduler::worker::SampledGauges::default();
        let text = Snapshot::record(|| gauges.publish(sample)).render();
        assert!(text.contains(r#"keel_dead_letters{namespace="a\"b\\c\nd"} 1"#), "{text}");
        let names = BTreeSet::from(["keel_dead_letters".to_owned()]);
        let other = "# TYPE keel_dead_letters gauge\nkeel_dead_letters{machine=\"x\"} 5\n# TYPE keel_dead_letters_total counter\nkeel_dead_letters_total 2\n";
        assert_eq!(
            without_families(other, &names),
            "# TYPE keel_dead_letters_total counter\nkeel_dead_letters_total 2\n"
        );
    }
}
