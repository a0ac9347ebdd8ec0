//! The kinds of history entry the engine itself records.
//!
//! History is an append-only audit trail; each entry has a kind and data. Steps may record
//! entries of their own kinds (any valid name), so a stored kind stays a string; the kinds
//! the engine writes are listed here once, so that every store, runtime and test names them
//! the same way.

use std::fmt;

/// A history kind the engine records, stored as its [`as_str`](HistoryKind::as_str) name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HistoryKind {
    /// A `Next` outcome moved the instance to another step.
    StepNext,
    /// A `Retry` outcome scheduled the same step again.
    StepRetry,
    /// An `Await` outcome parked the instance on a signal (or found one waiting).
    StepAwait,
    /// A `ScheduleChildren` outcome started children behind a barrier.
    StepScheduleChildren,
    /// A `Done` outcome finished the instance.
    StepDone,
    /// A `Stop` outcome failed the instance.
    StepStop,
    /// Retries ran out: the instance is suspended until an operator acts.
    StepSuspended,
    /// A dead letter was stored for the failing step.
    DeadLettered,
    /// A claimed row held a stored value no JSON reader accepts.
    RowUndecodable,
    /// The reaper returned a row whose worker's lease ran out.
    LeaseExpired,
    /// An instance ended with signals still in its inbox; they were removed.
    InboxDrained,
    /// A timer fired its event.
    TimerFired,
    /// A repeating timer reached its last fire.
    TimerExhausted,
    /// A deploy changed an armed timer's duration; its due time moved.
    TimerRetimed,
    /// A timer's fire still unread when its state was left was taken out of the inbox.
    TimerWithdrawn,
    /// A child's notice of its end, still unread when the delegation state that started
    /// the child was left, was taken out of the inbox.
    ChildNoticeWithdrawn,
    /// The instance was cancelled (directly or by a cascade).
    Cancelled,
    /// An operator retried the instance's dead letter.
    DeadLetterRetried,
    /// An operator skipped the instance's dead letter.
    DeadLetterSkipped,
    /// A chart instance processed an event (or its start).
    Macrostep,
    /// A chart instance received an event no transition handles.
    EventUnhandled,
    /// A region of a parallel state was entered.
    ParallelRegionEnter,
    /// A region of a parallel state was aborted by a guard.
    ParallelRegionGuardAbort,
    /// Regions of a parallel state wrote the same context key differently.
    ParallelContextConflict,
    /// A region of a parallel state can make no progress.
    ParallelRegionStalled,
    /// A region of a parallel state ran out of time.
    ParallelRegionTimeout,
    /// Every region of a parallel state finished.
    ParallelDone,
    /// A parallel state failed.
    ParallelFail,
    /// A parallel state dispatched its regions as tasks.
    ParallelDispatch,
    /// An operator moved the instance to another version of its chart.
    Migrated,
    /// A step failed for good while dead letters were disabled for it: the failing event
    /// was dropped (or the instance failed) and no dead letter was written.
    FailureDiscarded,
    /// A parent woke from a join before (or as) its last child ended: a quorum reached or
    /// out of reach, or a deadline passed.
    JoinWoke,
}

impl HistoryKind {
    /// Every kind, in declaration order.
    pub const ALL: [HistoryKind; 32] = [
        HistoryKind::StepNext,
        HistoryKind::StepRetry,
        HistoryKind::StepAwait,
        HistoryKind::StepScheduleChildren,
        HistoryKind::StepDone,
        HistoryKind::StepStop,
        HistoryKind::StepSuspended,
        HistoryKind::DeadLettered,
        HistoryKind::RowUndecodable,
        HistoryKind::LeaseExpired,
        HistoryKind::InboxDrained,
        HistoryKind::TimerFired,
        HistoryKind::TimerExhausted,
        HistoryKind::TimerRetimed,
        HistoryKind::TimerWithdrawn,
        HistoryKind::ChildNoticeWithdrawn,
        HistoryKind::Cancelled,
        HistoryKind::DeadLetterRetried,
        HistoryKind::DeadLetterSkipped,
        HistoryKind::Macrostep,
        HistoryKind::EventUnhandled,
        HistoryKind::ParallelRegionEnter,
        HistoryKind::ParallelRegionGuardAbort,
        HistoryKind::ParallelContextConflict,
        HistoryKind::ParallelRegionStalled,
        HistoryKind::ParallelRegionTimeout,
        HistoryKind::ParallelDone,
        HistoryKind::ParallelFail,
        HistoryKind::ParallelDispatch,
        HistoryKind::Migrated,
        HistoryKind::FailureDiscarded,
        HistoryKind::JoinWoke,
    ];

    /// The stored name. These strings are what existing databases hold, so they never
    /// change.
    pub const fn as_str(self) -> &'static str {
        match self {
            HistoryKind::StepNext => "STEP_NEXT",
            HistoryKind::StepRetry => "STEP_RETRY",
            HistoryKind::StepAwait => "STEP_AWAIT",
            HistoryKind::StepScheduleChildren => "STEP_SCHEDULE_CHILDREN",
            HistoryKind::StepDone => "STEP_DONE",
            HistoryKind::StepStop => "STEP_STOP",
            HistoryKind::StepSuspended => "STEP_SUSPENDED",
            HistoryKind::DeadLettered => "DEAD_LETTERED",
            HistoryKind::RowUndecodable => "ROW_UNDECODABLE",
            HistoryKind::LeaseExpired => "LEASE_EXPIRED",
            HistoryKind::InboxDrained => "INBOX_DRAINED",
            HistoryKind::TimerFired => "TIMER_FIRED",
            HistoryKind::TimerExhausted => "TIMER_EXHAUSTED",
            HistoryKind::TimerRetimed => "TIMER_RETIMED",
            HistoryKind::TimerWithdrawn => "TIMER_WITHDRAWN",
            HistoryKind::ChildNoticeWithdrawn => "CHILD_NOTICE_WITHDRAWN",
            HistoryKind::Cancelled => "CANCELLED",
            HistoryKind::DeadLetterRetried => "DEAD_LETTER_RETRIED",
            HistoryKind::DeadLetterSkipped => "DEAD_LETTER_SKIPPED",
            HistoryKind::Macrostep => "MACROSTEP",
            HistoryKind::EventUnhandled => "EVENT_UNHANDLED",
            HistoryKind::ParallelRegionEnter => "PARALLEL_REGION_ENTER",
            HistoryKind::ParallelRegionGuardAbort => "PARALLEL_REGION_GUARD_ABORT",
            HistoryKind::ParallelContextConflict => "PARALLEL_CONTEXT_CONFLICT",
            HistoryKind::ParallelRegionStalled => "PARALLEL_REGION_STALLED",
            HistoryKind::ParallelRegionTimeout => "PARALLEL_REGION_TIMEOUT",
            HistoryKind::ParallelDone => "PARALLEL_DONE",
            HistoryKind::ParallelFail => "PARALLEL_FAIL",
            HistoryKind::ParallelDispatch => "PARALLEL_DISPATCH",
            HistoryKind::Migrated => "MIGRATED",
            HistoryKind::FailureDiscarded => "FAILURE_DISCARDED",
            HistoryKind::JoinWoke => "JOIN_WOKE",
        }
    }

    /// The engine kind stored as `name`, or `None` for a step's own kind.
    pub fn parse(name: &str) -> Option<Self> {
        HistoryKind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Whether `name` is this kind's stored name.
    pub fn is(self, name: &str) -> bool {
        self.as_str() == name
    }
}

impl fmt::Display for HistoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<HistoryKind> for String {
    fn from(kind: HistoryKind) -> Self {
        kind.as_str().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::parallel;
    use std::collections::HashSet;

    #[test]
    fn every_kind_has_its_own_stored_name_and_parses_back() {
        let names: HashSet<&str> = HistoryKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), HistoryKind::ALL.len());
        for kind in HistoryKind::ALL {
            assert_eq!(HistoryKind::parse(kind.as_str()), Some(kind));
            assert!(kind.is(&kind.to_string()));
        }
        assert_eq!(HistoryKind::parse("NOTE"), None);
    }

    #[test]
    fn the_parallel_kinds_match_the_names_the_chart_records() {
        let pairs = [
            (HistoryKind::ParallelRegionEnter, parallel::PARALLEL_REGION_ENTER),
            (HistoryKind::ParallelRegionGuardAbort, parallel::PARALLEL_REGION_GUARD_ABORT),
            (HistoryKind::ParallelContextConflict, parallel::PARALLEL_CONTEXT_CONFLICT),
            (HistoryKind::ParallelRegionStalled, parallel::PARALLEL_REGION_STALLED),
            (HistoryKind::ParallelRegionTimeout, parallel::PARALLEL_REGION_TIMEOUT),
            (HistoryKind::ParallelDone, parallel::PARALLEL_DONE),
            (HistoryKind::ParallelFail, parallel::PARALLEL_FAIL),
            (HistoryKind::ParallelDispatch, parallel::PARALLEL_DISPATCH),
        ];
        for (kind, name) in pairs {
            assert_eq!(kind.as_str(), name);
        }
    }
}
