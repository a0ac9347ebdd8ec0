//! Remote workers in the worker registry: every poll, and every heartbeat that holds its
//! lease, counts as a sign of life, recorded at most once per beat interval per worker, so
//! `keel workers` lists HTTP workers next to in-process ones, and a worker busy on one
//! long step (heartbeating, not polling) stays live there.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use keel_core::Timestamp;
use keel_core::ids::{MachineRef, WorkerId};
use keel_core::ports::Store;
use keel_core::ports::store::{WORKER_BEAT_INTERVAL, WorkerBeatParams};

use crate::commands::now;

/// Most remote workers remembered between beats; past it the longest-silent is dropped
/// (it is then recorded again on its next poll, with a fresh start time).
const REMEMBERED_MAX: usize = 10_000;

/// What the registry records of one remote worker.
#[derive(Debug)]
struct Seen {
    /// When it was first seen.
    started: Timestamp,
    /// When it was last recorded in the registry.
    recorded: Instant,
    /// The namespace and machines its last poll declared, which a heartbeat records again.
    namespace: String,
    machines: Vec<MachineRef>,
    /// The lease its last poll asked for, which a heartbeat without one extends by.
    lease: Duration,
}

/// When each remote worker was first seen and last recorded, and what it last declared.
#[derive(Debug)]
pub struct Beats {
    seen: Mutex<HashMap<String, Seen>>,
    /// The least time between two registry beats of one worker.
    interval: Duration,
}

impl Default for Beats {
    fn default() -> Self {
        Self::every(WORKER_BEAT_INTERVAL)
    }
}

impl Beats {
    /// Records each worker at most once per `interval` ([`WORKER_BEAT_INTERVAL`] by
    /// default; it must stay well under `WORKER_STALE_AFTER`).
    pub fn every(interval: Duration) -> Self {
        Beats { seen: Mutex::new(HashMap::new()), interval }
    }

    /// Remembers what a polling `worker` declared; when it is due a registry beat, marks
    /// it recorded now and returns the beat's parameters.
    fn polled(
        &self,
        worker: &str,
        namespace: &str,
        machines: Vec<MachineRef>,
        lease: Duration,
    ) -> Option<WorkerBeatParams> {
        let mut machines = machines;
        machines.sort();
        machines.dedup();
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(record) = seen.get_mut(worker) {
            namespace.clone_into(&mut record.namespace);
            record.machines = machines;
            record.lease = lease;
            return self.due(worker, record);
        }
        if seen.len() >= REMEMBERED_MAX
            && let Some(oldest) =
                seen.iter().min_by_key(|(_, s)| s.recorded).map(|(k, _)| k.clone())
        {
            seen.remove(&oldest);
        }
        let record = Seen {
            started: now(),
            recorded: Instant::now(),
            namespace: namespace.to_owned(),
            machines,
            lease,
        };
        let params = beat(worker, &record);
        seen.insert(worker.to_owned(), record);
        Some(params)
    }

    /// When `worker` (seen polling before) is due a registry beat, marks it recorded now
    /// and returns the beat's parameters, with what its last poll declared.
    fn held(&self, worker: &str) -> Option<WorkerBeatParams> {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let record = seen.get_mut(worker)?;
        self.due(worker, record)
    }

    fn due(&self, worker: &str, record: &mut Seen) -> Option<WorkerBeatParams> {
        if record.recorded.elapsed() < self.interval {
            return None;
        }
        record.recorded = Instant::now();
        Some(beat(worker, record))
    }

    /// The lease `worker`'s last poll asked for, when this server remembers it polling.
    pub fn lease(&self, worker: &str) -> Option<Duration> {
        let seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.get(worker).map(|record| record.lease)
    }

    /// Records a polling worker when it is due, and the lease it asked for; a failure is
    /// logged, never returned.
    pub async fn poll<S: Store>(
        &self,
        store: &S,
        worker: &str,
        namespace: &str,
        machines: Vec<MachineRef>,
        lease: Duration,
    ) {
        if let Some(params) = self.polled(worker, namespace, machines, lease) {
            record(store, worker, params).await;
        }
    }

    /// Records a worker whose heartbeat held its lease when it is due, with the namespace
    /// and machines of its last poll: a worker busy on one long step polls no more than
    /// once per step, yet is alive. A worker this server has not seen polling (it polled
    /// another server) is left to the server it polls. A failure is logged, never
    /// returned.
    pub async fn lease_held<S: Store>(&self, store: &S, worker: &str) {
        if let Some(params) = self.held(worker) {
            record(store, worker, params).await;
        }
    }
}

/// The registry beat of `worker` at `now`.
fn beat(worker: &str, record: &Seen) -> WorkerBeatParams {
    WorkerBeatParams::at(
        WorkerId(worker.to_owned()),
        format!("{worker} (HTTP)"),
        record.machines.clone(),
        vec![record.namespace.clone()],
        record.started,
        now(),
    )
}

async fn record<S: Store>(store: &S, worker: &str, params: WorkerBeatParams) {
    if let Err(error) = store.worker_heartbeat(params).await {
        // `warn` ignores a closed stderr, so a supervisor that drops it cannot panic the
        // request.
        crate::output::warn(&format!(
            "could not record worker {worker:?} in the registry: {error}"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[test]
    fn a_heartbeat_beats_with_the_last_poll_declaration_once_per_interval() {
        let beats = Beats::every(Duration::from_secs(3600));
        assert!(beats.held("w").is_none(), "a worker never seen polling is not recorded");
        let first =
            beats.polled("w", "a", vec![MachineRef::new("m", 1)], LEASE).expect("first beat");
        assert_eq!((first.machines.len(), first.namespaces), (1, vec!["a".to_owned()]));
        assert!(beats.held("w").is_none(), "not due within the interval");
        assert!(beats.polled("w", "b", vec![MachineRef::new("n", 2)], LEASE).is_none());

        let beats = Beats::every(Duration::ZERO);
        let first =
            beats.polled("w", "a", vec![MachineRef::new("m", 1)], LEASE).expect("first beat");
        beats.polled("w", "b", vec![MachineRef::new("n", 2), MachineRef::new("n", 2)], LEASE);
        let held = beats.held("w").expect("due");
        assert_eq!(held.machines, vec![MachineRef::new("n", 2)], "the last poll's machines");
        assert_eq!(held.namespaces, vec!["b".to_owned()]);
        assert_eq!(held.started_at, first.started_at, "the same worker, started once");
    }
}
