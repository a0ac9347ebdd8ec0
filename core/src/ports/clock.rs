//! The clock port. The core never reads time; the scheduler asks a [`Clock`], and tests
//! hand it a virtual one that they move by hand.

use crate::time::Timestamp;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}
