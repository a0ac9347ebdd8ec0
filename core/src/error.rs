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

/// An error's message followed by its causes' (`reading order 7: connection refused`),
/// each cause once: drivers and pools keep the reason something failed (a refused
/// connection, a wrong password, a value that cannot be decoded) in the error's source,
/// and some also repeat their cause in their own message. Follows at most 16 causes, so
/// a cyclic chain cannot hang the caller.
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    for _ in 0..16 {
        let Some(c) = cause else { break };
        let more = c.to_string();
        if !more.is_empty() && !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::with_causes;
    use std::fmt;

    /// An error with a message and an optional cause.
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn causes_follow_the_message_each_once() {
        let refused = Layer("connection refused", None);
        let connecting = Layer("error connecting to server", Some(Box::new(refused)));
        let pool = Layer("pool: error connecting to server", Some(Box::new(connecting)));
        assert_eq!(with_causes(&pool), "pool: error connecting to server: connection refused");
        assert_eq!(with_causes(&Layer("alone", None)), "alone");
    }
}
