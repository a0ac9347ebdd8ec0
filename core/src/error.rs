//! The one error type every port returns. Its [`ErrorKind`]s mean the same on every
//! backend, so the scheduler decides what to retry without knowing the driver.

use std::fmt;

/// What went wrong, in terms that mean the same on every backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The instance, signal or dead letter does not exist.
    NotFound,
    /// The operation conflicts with the current state (e.g. a terminal instance, a
    /// dead letter that was already retried). Retrying the same call will not help.
    Conflict,
    /// The commit named a fencing token that is no longer the instance's: another worker
    /// claimed it after this lease expired. Nothing was changed.
    LeaseLost,
    /// The backend could not be reached or timed out. Retryable.
    Unavailable,
    /// The input is malformed or over a limit. The message names the field and the fix.
    Invalid,
}

impl ErrorKind {
    /// The stable lowercase name of the kind.
    pub const fn name(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::LeaseLost => "lease_lost",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Invalid => "invalid",
        }
    }
}

/// An error from a `Store` or `Queue` backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError {
    /// The portable kind.
    pub kind: ErrorKind,
    /// A human message: what failed, which field, and how to fix it.
    pub message: String,
}

impl StoreError {
    /// Builds an error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        StoreError { kind, message: message.into() }
    }
    /// `NotFound`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }
    /// `Conflict`.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }
    /// `LeaseLost`.
    pub fn lease_lost(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::LeaseLost, message)
    }
    /// `Unavailable` (retryable).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }
    /// `Invalid`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, message)
    }
    /// Whether the same call may succeed later (only `Unavailable`).
    pub const fn is_retryable(&self) -> bool {
        matches!(self.kind, ErrorKind::Unavailable)
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for StoreError {}

/// Result alias for port calls.
pub type StoreResult<T> = Result<T, StoreError>;
