//! Timer specifications on transitions.
//!
//! A timer is data: the core only records which timers a state owns, so the runtime can arm
//! them in the commit that enters the state and delete them in the commit that leaves it.
//! Nothing here reads a clock.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The unit a [`Timer`] was written in; kept so error messages and diagrams show what the user
/// wrote ("7 days", not "604800 s").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum TimerUnit {
    /// Seconds.
    Seconds,
    /// Minutes.
    Minutes,
    /// Hours.
    Hours,
    /// Days (24 hours; no calendar arithmetic).
    Days,
    /// Weeks (7 days).
    Weeks,
}

impl TimerUnit {
    fn seconds(self) -> u64 {
        match self {
            Self::Seconds => 1,
            Self::Minutes => 60,
            Self::Hours => 3_600,
            Self::Days => 86_400,
            Self::Weeks => 604_800,
        }
    }

    fn name(self, amount: i64) -> &'static str {
        let one = amount == 1;
        match (self, one) {
            (Self::Seconds, true) => "second",
            (Self::Seconds, false) => "seconds",
            (Self::Minutes, true) => "minute",
            (Self::Minutes, false) => "minutes",
            (Self::Hours, true) => "hour",
            (Self::Hours, false) => "hours",
            (Self::Days, true) => "day",
            (Self::Days, false) => "days",
            (Self::Weeks, true) => "week",
            (Self::Weeks, false) => "weeks",
        }
    }
}

/// A timer duration as written in a definition, e.g. `Timer::days(7)`.
///
/// Construction never fails, so that definitions read as plainly as the durations they
/// name; [`ChartBuilder::build`](super::ChartBuilder::build) reports a non-positive amount
/// as [`ChartError::InvalidTimerDefinition`](super::ChartError::InvalidTimerDefinition) and
/// one longer than [`limits::TIMER_INTERVAL_MAX`](crate::limits::TIMER_INTERVAL_MAX) (or too
/// large to compute) as [`ChartError::TimerTooLong`](super::ChartError::TimerTooLong), each
/// naming the state and event.
///
/// ```
/// use keel_core::chart::Timer;
/// assert_eq!(Timer::minutes(5).duration(), Some(std::time::Duration::from_secs(300)));
/// assert_eq!(Timer::seconds(0).duration(), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct Timer {
    /// The amount as written (may be non-positive in an invalid definition).
    pub amount: i64,
    /// The unit as written.
    pub unit: TimerUnit,
}

impl Timer {
    /// `n` seconds.
    pub fn seconds(n: i64) -> Self {
        Self { amount: n, unit: TimerUnit::Seconds }
    }
    /// `n` minutes.
    pub fn minutes(n: i64) -> Self {
        Self { amount: n, unit: TimerUnit::Minutes }
    }
    /// `n` hours.
    pub fn hours(n: i64) -> Self {
        Self { amount: n, unit: TimerUnit::Hours }
    }
    /// `n` days of 24 hours.
    pub fn days(n: i64) -> Self {
        Self { amount: n, unit: TimerUnit::Days }
    }
    /// `n` weeks of 7 days.
    pub fn weeks(n: i64) -> Self {
        Self { amount: n, unit: TimerUnit::Weeks }
    }

    /// The duration, or `None` when the amount is not positive (or overflows).
    pub fn duration(self) -> Option<Duration> {
        let amount = u64::try_from(self.amount).ok().filter(|a| *a > 0)?;
        amount.checked_mul(self.unit.seconds()).map(Duration::from_secs)
    }
}

impl fmt::Display for Timer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.amount, self.unit.name(self.amount))
    }
}

/// Whether a timer fires once per state entry or repeatedly while the state stays active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimerKind {
    /// One-shot: fires once, `interval` after the state was entered.
    After,
    /// Recurring: fires every `interval` (on the ticks of the state entry) while the state is
    /// active.
    Every,
}

/// A timer attached to a transition: when it fires, the runtime delivers `event` to the
/// instance through the normal inbox.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TimerSpec {
    /// One-shot or recurring.
    pub kind: TimerKind,
    /// The timer as written.
    pub timer: Timer,
    /// For `every`: stop after this many fires.
    pub max: Option<u32>,
    /// For `every` + `max`: the event sent exactly once after the last fire.
    pub then: Option<String>,
    /// Instances already waiting keep the duration their timer was armed with when a
    /// deploy changes it (by default they follow the deployed definition).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_armed: bool,
}

impl fmt::Display for TimerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            TimerKind::After => write!(f, "after {}", self.timer)?,
            TimerKind::Every => write!(f, "every {}", self.timer)?,
        }
        if let Some(max) = self.max {
            write!(f, ", max {max}")?;
        }
        if let Some(then) = &self.then {
            write!(f, ", then {then}")?;
        }
        if self.keep_armed {
            write!(f, ", keeps its armed duration")?;
        }
        Ok(())
    }
}

/// A timer the runtime must arm because the macrostep entered its state: the state was not
/// active before, or it was left for another state and entered again within the macrostep.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerArm {
    /// Path of the state that owns the timer; leaving it cancels the timer.
    pub state: String,
    /// Event delivered when the timer fires.
    pub event: String,
    /// One-shot or recurring.
    pub kind: TimerKind,
    /// Delay of the first fire and, for `every`, the interval between fires.
    pub interval: Duration,
    /// For `every`: the maximum number of fires.
    pub max: Option<u32>,
    /// For `every` + `max`: the event sent once after the last fire.
    pub then: Option<String>,
}

/// Timers the runtime must delete because their state is no longer active.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerCancel {
    /// Path of the state that was left; every timer it owns is cancelled.
    pub state: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_display() {
        assert_eq!(Timer::weeks(2).duration(), Some(Duration::from_hours(336)));
        assert_eq!(Timer::hours(-1).duration(), None);
        assert_eq!(Timer::days(i64::MAX).duration(), None);
        assert_eq!(Timer::days(1).to_string(), "1 day");
        assert_eq!(Timer::days(7).to_string(), "7 days");
    }
}
