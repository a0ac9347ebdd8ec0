//! Time as data: a [`Timestamp`] is milliseconds since the Unix epoch, passed in by the
//! caller. Nothing in keel-core reads a clock; the `Clock` port does that outside the core.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// A point in time, in whole milliseconds since the Unix epoch (UTC).
///
/// Millisecond precision matches what every backend stores losslessly (PostgreSQL
/// `timestamptz` keeps microseconds, SQLite integers keep anything).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// Builds a timestamp from milliseconds since the epoch.
    pub const fn from_millis(ms: i64) -> Self {
        Timestamp(ms)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// `self + d`, saturating at the representable maximum instead of overflowing.
    #[must_use]
    pub fn plus(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(ms))
    }

    /// `self - d`, saturating.
    #[must_use]
    pub fn minus(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(ms))
    }

    /// The time from `earlier` to `self`, or zero when `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Timestamp(5).plus(Duration::from_millis(7)), Timestamp(12));
        assert_eq!(Timestamp(i64::MAX - 1).plus(Duration::from_secs(9)), Timestamp(i64::MAX));
        assert_eq!(Timestamp(5).since(Timestamp(9)), Duration::ZERO);
        assert_eq!(Timestamp(9).since(Timestamp(5)), Duration::from_millis(4));
    }
}
