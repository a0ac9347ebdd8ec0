//! The health of a worker's background loops: when each last succeeded, its last error,
//! and how often it was restarted after a panic.
//!
//! Every background loop of a worker (claim, committer, heartbeat, reaper, stats sampler,
//! timer sweeper) survives its own failures: a failed iteration is logged and the loop
//! goes on after a bounded back-off, and a loop that panics is restarted after the same
//! back-off. This module holds the record each loop keeps, which
//! [`WorkerHandle::health`](crate::WorkerHandle::health) returns, and the back-off rule.

use keel_core::Timestamp;
use keel_core::retry::{Backoff, Jitter, RetryPolicy};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// A worker's background loops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerLoop {
    /// Claims ready instances and starts their steps.
    Claim,
    /// Group-commits finished steps.
    Committer,
    /// Extends the leases of running steps.
    Heartbeat,
    /// Returns expired leases (and, at start-up, the worker's own old ones).
    Reaper,
    /// Samples queue counts into gauges.
    Stats,
    /// Fires due timers. Its sweeps report their own errors in the log; here it reports
    /// only that it runs and when it was restarted.
    Sweeper,
    /// Receives queue hints and claims their instances (only with a queue).
    Hints,
    /// Fires the worker's schedules (only with schedules).
    Schedules,
    /// Applies retention (only with a retention configuration).
    Pruner,
    /// Publishes hints again for instances ready too long (only with a queue and a
    /// repair bound).
    Repair,
}

impl WorkerLoop {
    /// The loop's name in logs.
    pub const fn name(self) -> &'static str {
        match self {
            WorkerLoop::Claim => "claim",
            WorkerLoop::Committer => "committer",
            WorkerLoop::Heartbeat => "heartbeat",
            WorkerLoop::Reaper => "reaper",
            WorkerLoop::Stats => "stats",
            WorkerLoop::Sweeper => "sweeper",
            WorkerLoop::Hints => "hints",
            WorkerLoop::Schedules => "schedules",
            WorkerLoop::Pruner => "pruner",
            WorkerLoop::Repair => "repair",
        }
    }
}

/// One loop's record.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoopHealth {
    /// Whether the loop runs (it stops only at shutdown).
    pub running: bool,
    /// When an iteration last succeeded (the worker's clock).
    pub last_success: Option<Timestamp>,
    /// When the last iteration failed (or the loop panicked), and why.
    pub last_error: Option<(Timestamp, String)>,
    /// Iterations failed in a row since the last success; drives the back-off.
    pub consecutive_failures: u32,
    /// Times the loop panicked and was restarted.
    pub restarts: u64,
}

/// Every loop a worker runs, by loop.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkerHealth {
    /// The loops this worker started (the sweeper and the stats sampler only when
    /// configured).
    pub loops: BTreeMap<WorkerLoop, LoopHealth>,
}

impl WorkerHealth {
    /// One loop's record, if the worker runs it.
    pub fn get(&self, which: WorkerLoop) -> Option<&LoopHealth> {
        self.loops.get(&which)
    }
}

/// The back-off after failures of a background loop: 50 ms, doubling with every failure
/// in a row, at most [`LOOP_BACKOFF_MAX`], each wait drawn between half and all of that
/// (workers that lost the same server do not all come back at the same instant). A loop
/// never waits less than its own period.
const LOOP_BACKOFF: RetryPolicy = RetryPolicy {
    max_attempts: RetryPolicy::MAX_ATTEMPTS_LIMIT,
    backoff: Backoff::Exponential,
    initial_delay: Duration::from_millis(50),
    max_delay: LOOP_BACKOFF_MAX,
    jitter: Jitter::Equal,
};

/// The longest a background loop waits after failures before it tries again.
pub const LOOP_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The wait after `failures` (at least 1) failed tries in a row of one thing a loop does:
/// the loop's back-off, for a part of a loop that backs off on its own (one queue of the
/// claim loop).
pub(crate) fn backoff(failures: u32) -> Duration {
    LOOP_BACKOFF.delay_for(failures.max(1) - 1, fastrand::f64())
}

/// The shared record the loops write and the handle reads.
#[derive(Debug, Default)]
pub(crate) struct HealthBook {
    loops: Mutex<BTreeMap<WorkerLoop, LoopHealth>>,
}

impl HealthBook {
    fn with<T>(&self, which: WorkerLoop, f: impl FnOnce(&mut LoopHealth) -> T) -> T {
        let mut loops = self.loops.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(loops.entry(which).or_default())
    }

    /// The loop started (or was restarted).
    pub(crate) fn started(&self, which: WorkerLoop) {
        self.with(which, |h| h.running = true);
    }

    /// The loop ended for good (shutdown).
    pub(crate) fn stopped(&self, which: WorkerLoop) {
        self.with(which, |h| h.running = false);
    }

    /// An iteration succeeded.
    pub(crate) fn success(&self, which: WorkerLoop, now: Timestamp) {
        self.with(which, |h| {
            h.last_success = Some(now);
            h.consecutive_failures = 0;
        });
    }

    /// An iteration failed; returns how long the loop waits at least before the next.
    pub(crate) fn failure(&self, which: WorkerLoop, now: Timestamp, error: String) -> Duration {
        self.with(which, |h| {
            h.last_error = Some((now, error));
            h.consecutive_failures = h.consecutive_failures.saturating_add(1);
            backoff(h.consecutive_failures)
        })
    }

    /// The loop panicked; returns how long to wait before restarting it.
    pub(crate) fn panicked(&self, which: WorkerLoop, now: Timestamp, panic: &str) -> Duration {
        self.with(which, |h| h.restarts += 1);
        self.failure(which, now, format!("panicked: {panic}"))
    }

    /// A copy of every record.
    pub(crate) fn snapshot(&self) -> WorkerHealth {
        let loops = self.loops.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        WorkerHealth { loops: loops.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_with_failures_in_a_row_up_to_its_bound_and_resets_on_success() {
        let book = HealthBook::default();
        let at = Timestamp(1);
        let waits: Vec<Duration> =
            (0..10).map(|n| book.failure(WorkerLoop::Claim, at, format!("e{n}"))).collect();
        let ms = Duration::from_millis;
        let bases = [50, 100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000].map(ms);
        for (wait, base) in waits.iter().zip(bases) {
            assert!(base / 2 <= *wait && *wait <= base, "{wait:?} outside {base:?}/2..={base:?}");
        }
        book.success(WorkerLoop::Claim, Timestamp(2));
        let again = book.failure(WorkerLoop::Claim, at, "again".into());
        assert!(ms(25) <= again && again <= ms(50), "{again:?}");
        let health = book.snapshot();
        let claim = health.get(WorkerLoop::Claim).expect("recorded");
        assert_eq!(claim.last_success, Some(Timestamp(2)));
        assert_eq!(claim.last_error, Some((at, "again".to_owned())));
        assert_eq!(claim.consecutive_failures, 1);
    }
}
