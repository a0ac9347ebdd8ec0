//! Parallel dispatch of region entry actions:
//! the configuration, and the durable shape of region tasks, reports and the region
//! timeout. The semantics (guard, merge, stall, done, fail, timeout) are pure and live in
//! [`keel_core::chart::parallel`], and the chart step that applies them to an instance
//! (dispatch, reports, the region timeout) in [`keel_core::chart::step`]; the scheduler's
//! `ChartMachine` and the in-memory `TestMachine` both drive that step.
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
//! # No database-lock settings: leases order the results
//!
//! Region results are never serialized with a database lock, so there is no lock wait
//! or stale-lock lifetime to set. Results are events in the
//! parent's inbox, applied one at a time by whichever worker holds the parent's **lease**;
//! nobody waits on a lock, and a crashed holder's lease expires after
//! `WorkerConfig::lease`, when the reaper hands the row to another worker; fencing tokens
//! reject a stale holder's late commit.

use keel_core::InstanceId;
use keel_core::chart::parallel::{RegionReport, RegionTask};
use keel_core::retry::FailureKind;
use serde::{Deserialize, Serialize};

pub use keel_core::chart::parallel;
/// The settings (system → machine inheritance lives with the rest of the configuration
/// in `keel_core::config`: `[parallel_dispatch]`, `[machines.<name>.parallel_dispatch]`).
pub use keel_core::config::ParallelConfig;

/// The position of a region task instance (defined with the configuration in the core, which
/// decides which event a step processes and which settings a region task runs with).
pub use keel_core::config::REGION_POSITION;

/// The report event, its payload type and the region-timeout timer live with the chart
/// step in the core, which both produces and consumes them.
pub use keel_core::chart::step::{
    REGION_REPORT_EVENT, TIMEOUT_EVENT_PREFIX, timeout_event, timeout_owner, timeout_state,
    timeout_timer,
};

/// The context of a region task instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionTaskContext {
    /// The chart instance that dispatched it (where the report goes).
    pub parent: InstanceId,
    /// The work.
    pub task: RegionTask,
}

/// The `exception` of a failed region: the kind of its last error (`Timeout`, `Panic`,
/// else `ActionError`).
pub fn exception_of(kind: FailureKind) -> &'static str {
    kind.exception()
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

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::chart::TimerKind;

    #[test]
    fn the_region_timeout_is_one_after_timer_owned_by_a_name_no_state_has() {
        assert!(timeout_timer(&ParallelConfig::enabled(), "p").is_none(), "0 = off");
        let config = ParallelConfig {
            region_timeout: std::time::Duration::from_secs(120),
            ..ParallelConfig::enabled()
        };
        let timer = timeout_timer(&config, "order.processing").expect("armed");
        assert_eq!(timer.state, "@timeout:order.processing");
        assert_eq!(timer.event, "parallel.timeout.order.processing");
        assert_eq!(timeout_state(&timer.event), Some("order.processing"));
        assert_eq!(timer.kind, TimerKind::After);
    }

    #[test]
    fn exceptions_are_named_after_the_error_kind() {
        assert_eq!(exception_of(FailureKind::Timeout), "Timeout");
        assert_eq!(exception_of(FailureKind::Panic), "Panic");
        assert_eq!(exception_of(FailureKind::Action), "ActionError");
        assert_eq!(exception_of(FailureKind::NonRetryable), "ActionError");
    }
}
