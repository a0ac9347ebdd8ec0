//! The system clock: the one place Keel reads wall-clock time.

use keel_core::Timestamp;
use keel_core::ports::Clock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock time from the operating system.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        Timestamp::from_millis(i64::try_from(ms).unwrap_or(i64::MAX))
    }
}
