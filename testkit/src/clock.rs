//! [`VirtualClock`]: a `Clock` that only moves when a test moves it, so tests of leases,
//! retries and timers advance time instead of sleeping.

use keel_core::Timestamp;
use keel_core::ports::Clock;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// A shared, hand-moved clock. Clones are handles onto the same time.
///
/// ```
/// use keel_core::{Timestamp, ports::Clock};
/// use keel_testkit::VirtualClock;
/// use std::time::Duration;
///
/// let clock = VirtualClock::new(Timestamp::from_millis(1_000));
/// let handle = clock.clone();
/// handle.advance(Duration::from_secs(2));
/// assert_eq!(clock.now(), Timestamp::from_millis(3_000));
/// ```
#[derive(Debug, Clone)]
pub struct VirtualClock {
    now_ms: Arc<AtomicI64>,
}

impl VirtualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        VirtualClock { now_ms: Arc::new(AtomicI64::new(start.as_millis())) }
    }

    /// Moves the clock forward by `by` (saturating) and returns the new time.
    pub fn advance(&self, by: Duration) -> Timestamp {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let before = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| Some(t.saturating_add(ms)))
            .unwrap_or_else(|t| t);
        Timestamp::from_millis(before.saturating_add(ms))
    }

    /// Puts the clock at `at` (backwards too: tests of clock skew need that).
    pub fn set(&self, at: Timestamp) {
        self.now_ms.store(at.as_millis(), Ordering::SeqCst);
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now_ms.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_and_set_move_every_handle() {
        let clock = VirtualClock::new(Timestamp::from_millis(10));
        let other = clock.clone();
        assert_eq!(other.advance(Duration::from_millis(5)), Timestamp::from_millis(15));
        assert_eq!(clock.now(), Timestamp::from_millis(15));
        clock.set(Timestamp::from_millis(3));
        assert_eq!(other.now(), Timestamp::from_millis(3));
        other.set(Timestamp::from_millis(i64::MAX - 1));
        assert_eq!(clock.advance(Duration::from_secs(1)), Timestamp::from_millis(i64::MAX));
    }
}
