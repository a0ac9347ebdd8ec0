//! Parallel dispatch of region entry actions (DESIGN §4.4; seed 000 "Parallel Dispatch"):
//! the configuration, and the durable shape of region tasks, reports and the region
//! timeout. The semantics (guard, merge, stall, done, fail, timeout) are pure and live in
//! [`keel_core::chart::parallel`]; the scheduler's `ChartMachine` runs them on a store.
//!
//! # How a dispatch is stored
//!
//! - A **region task** is a child instance of the chart's own machine at position
//!   [`REGION_POSITION`], whose context is a [`RegionTaskContext`] (the parent's id and the
//!   [`RegionTask`]: which region, which dispatch, the context snapshot). It runs under the
//!   worker's normal lease, with [`ParallelConfig::job_config`] as its queue settings.
//! - It reports by emitting [`REGION_REPORT_EVENT`] (a [`RegionReport`]) into the parent's
//!   inbox in its own terminal commit (transactional outbox, deduplicated per task), so a
//!   task whose pre-check finds nothing to do finishes without touching the parent.
//! - The region timeout is one durable timer per dispatch, owned by
//!   [`timeout_owner`]`(path)` and firing [`timeout_event`]`(path)`; it is cancelled when
//!   the parallel state is left.
//!
//! # Seed lock settings and Keel leases
//!
//! The seed serializes region results with a database lock (`lock_timeout` 30 s to wait,
//! `lock_ttl` 60 s before a stale lock is cleaned up). Keel needs neither: results are
//! events in the parent's inbox, applied one at a time by whichever worker holds the
//! parent's **lease**; nobody waits on a lock (so no `lock_timeout`), and a crashed holder's
//! lease expires after `WorkerConfig::lease` and the reaper hands the row to another worker
//! (the `lock_ttl`); fencing tokens reject a stale holder's late commit.

use std::time::Duration;

use keel_core::InstanceId;
use keel_core::chart::parallel::{RegionReport, RegionTask};
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::config::QueueConfig;
use keel_core::retry::{Backoff, Jitter, RetryPolicy};
use serde::{Deserialize, Serialize};

pub use keel_core::chart::parallel;

/// The position of a region task instance.
pub const REGION_POSITION: &str = "@region";
/// The event a region task emits to its parent; the payload is a [`RegionReport`].
pub const REGION_REPORT_EVENT: &str = "parallel.region";
/// The prefix of region-timeout events: `parallel.timeout.<parallel state path>`.
pub const TIMEOUT_EVENT_PREFIX: &str = "parallel.timeout.";

/// Parallel dispatch settings of a machine (seed 000 "Configuration", same names and
/// defaults; durations in seconds in TOML/JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Master switch (default off: region entry actions run inline).
    pub enabled: bool,
    /// The queue region tasks run on (`None` = the parent's queue).
    pub queue: Option<String>,
    /// Timeout of one region task attempt (default 300 s).
    #[serde(with = "seconds")]
    pub job_timeout: Duration,
    /// Attempts of a region task before it fails the parallel state (default 3).
    pub job_tries: u32,
    /// Delay between attempts (default 30 s).
    #[serde(with = "seconds")]
    pub job_backoff: Duration,
    /// How long a dispatched parallel state may stay unfinished before `@fail`
    /// (default 0 = off).
    #[serde(with = "seconds")]
    pub region_timeout: Duration,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            queue: None,
            job_timeout: Duration::from_secs(300),
            job_tries: 3,
            job_backoff: Duration::from_secs(30),
            region_timeout: Duration::ZERO,
        }
    }
}

impl ParallelConfig {
    /// Dispatch on, with the other settings at their defaults.
    pub fn enabled() -> Self {
        Self { enabled: true, ..Self::default() }
    }

    /// The queue settings of region tasks: `job_timeout` per attempt, `job_tries` attempts
    /// `job_backoff` apart, everything else from `base` (the parent machine's settings).
    pub fn job_config(&self, base: QueueConfig) -> QueueConfig {
        QueueConfig {
            timeout: self.job_timeout,
            retry: RetryPolicy {
                max_attempts: self.job_tries.max(1),
                backoff: Backoff::Linear,
                initial_delay: self.job_backoff,
                max_delay: self.job_backoff,
                jitter: Jitter::None,
            },
            ..base
        }
    }

    /// The region-timeout timer for `parallel_state`, if the timeout is on.
    pub fn timeout_timer(&self, parallel_state: &str) -> Option<TimerArm> {
        (!self.region_timeout.is_zero()).then(|| TimerArm {
            state: timeout_owner(parallel_state),
            event: timeout_event(parallel_state),
            kind: TimerKind::After,
            interval: self.region_timeout,
            max: None,
            then: None,
        })
    }
}

/// The timer owner of `parallel_state`'s region timeout: a name no state has, so that
/// cancelling it never touches the timers of the parallel state's own descendants.
pub fn timeout_owner(parallel_state: &str) -> String {
    format!("@timeout:{parallel_state}")
}

/// The region-timeout event of `parallel_state`.
pub fn timeout_event(parallel_state: &str) -> String {
    format!("{TIMEOUT_EVENT_PREFIX}{parallel_state}")
}

/// The parallel state a region-timeout event is about, if `event` is one.
pub fn timeout_state(event: &str) -> Option<&str> {
    event.strip_prefix(TIMEOUT_EVENT_PREFIX)
}

/// The context of a region task instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionTaskContext {
    /// The chart instance that dispatched it (where the report goes).
    pub parent: InstanceId,
    /// The work.
    pub task: RegionTask,
}

/// The `exception` of a failed region: the kind of the last error, from the worker's
/// message shapes (`step timed out…`, `step panicked…`), else `ActionError`.
pub fn exception_of(message: &str) -> &'static str {
    if message.starts_with("step timed out") {
        "Timeout"
    } else if message.starts_with("step panicked") {
        "Panic"
    } else {
        "ActionError"
    }
}

/// The dedup key of a task's report: one report per task instance, however often the
/// terminal commit is retried.
pub fn report_dedup_key(task: InstanceId) -> String {
    format!("region:{}:report", task.0)
}

/// Decodes a report event's payload.
pub fn decode_report(payload: &serde_json::Value) -> Result<RegionReport, serde_json::Error> {
    RegionReport::deserialize(payload)
}

mod seconds {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_secs(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_seed() {
        let c = ParallelConfig::default();
        assert!(!c.enabled);
        assert_eq!(c.queue, None);
        assert_eq!(c.job_timeout, Duration::from_secs(300));
        assert_eq!(c.job_tries, 3);
        assert_eq!(c.job_backoff, Duration::from_secs(30));
        assert!(c.region_timeout.is_zero());
        assert!(c.timeout_timer("p").is_none());
    }

    #[test]
    fn config_reads_seconds_and_rejects_unknown_fields() {
        let c: ParallelConfig =
            serde_json::from_value(serde_json::json!({"enabled": true, "region_timeout": 120}))
                .unwrap();
        assert_eq!(c.region_timeout, Duration::from_secs(120));
        assert_eq!(c.timeout_timer("p").map(|t| t.event), Some("parallel.timeout.p".to_owned()));
        assert!(
            serde_json::from_value::<ParallelConfig>(serde_json::json!({"lock_ttl": 1})).is_err()
        );
    }

    #[test]
    fn job_config_maps_tries_backoff_and_timeout() {
        let q = ParallelConfig::enabled().job_config(QueueConfig::default());
        assert_eq!(q.timeout, Duration::from_secs(300));
        assert_eq!(q.retry.max_attempts, 3);
        assert_eq!(q.retry.delay_for(0, 0.5), Duration::from_secs(30));
        assert_eq!(q.retry.delay_for(1, 0.5), Duration::from_secs(30));
    }

    #[test]
    fn exceptions_are_named_after_the_error_kind() {
        assert_eq!(exception_of("step timed out after 5 ms"), "Timeout");
        assert_eq!(exception_of("step panicked: boom"), "Panic");
        assert_eq!(exception_of("inventory API down"), "ActionError");
    }
}
