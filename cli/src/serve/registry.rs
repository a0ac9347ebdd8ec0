//! Remote workers in the worker registry: every poll counts as a sign of life, recorded at
//! most once per beat interval per worker, so `keel workers` lists HTTP workers next to
//! in-process ones.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use keel_core::Timestamp;
use keel_core::ids::{MachineRef, WorkerId};
use keel_core::ports::Store;
use keel_core::ports::store::{WORKER_BEAT_INTERVAL, WorkerBeatParams};

use crate::commands::now;

/// Most remote workers remembered between beats; past it the longest-silent is dropped
/// (it is then recorded again on its next poll, with a fresh start time).
const REMEMBERED_MAX: usize = 10_000;

/// When each remote worker was first seen and last recorded.
#[derive(Debug, Default)]
pub struct Beats {
    seen: Mutex<HashMap<String, (Timestamp, Instant)>>,
}

impl Beats {
    /// Whether `worker` is due a registry beat; if so, marks it recorded now and returns
    /// its start time.
    fn due(&self, worker: &str) -> Option<Timestamp> {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((started, last)) = seen.get_mut(worker) {
            if last.elapsed() < WORKER_BEAT_INTERVAL {
                return None;
            }
            *last = Instant::now();
            return Some(*started);
        }
        if seen.len() >= REMEMBERED_MAX
            && let Some(oldest) =
                seen.iter().min_by_key(|(_, (_, last))| *last).map(|(k, _)| k.clone())
        {
            seen.remove(&oldest);
        }
        let started = now();
        seen.insert(worker.to_owned(), (started, Instant::now()));
        Some(started)
    }

    /// Records a polling worker when it is due; a failure is logged, never returned.
    pub async fn poll<S: Store>(
        &self,
        store: &S,
        worker: &str,
        namespace: &str,
        machines: Vec<MachineRef>,
    ) {
        let Some(started) = self.due(worker) else { return };
        let mut machines = machines;
        machines.sort();
        machines.dedup();
        let params = WorkerBeatParams::at(
            WorkerId(worker.to_owned()),
            format!("{worker} (HTTP)"),
            machines,
            vec![namespace.to_owned()],
            started,
            now(),
        );
        if let Err(error) = store.worker_heartbeat(params).await {
            // `warn` ignores a closed stderr, so a supervisor that drops it cannot panic
            // the request.
            crate::output::warn(&format!(
                "could not record worker {worker:?} in the registry: {error}"
            ));
        }
    }
}
