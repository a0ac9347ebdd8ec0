//! Mapping driver and pool errors onto the portable [`ErrorKind`]s.
//!
//! Connection failures, timeouts, cancellations, deadlocks and serialization failures are
//! `Unavailable` (retryable); a unique violation is `Conflict`; bad data is `Invalid`.
//! Anything else the server rejects is `Conflict`: retrying the same call will not help.

use keel_core::error::with_causes;
use keel_core::{ErrorKind, StoreError};
use tokio_postgres::error::SqlState;

/// Whether the error is a deadlock or serialization failure, which the store retries
/// internally before giving up.
pub(crate) fn is_transient(e: &tokio_postgres::Error) -> bool {
    matches!(e.code(), Some(c) if *c == SqlState::T_R_DEADLOCK_DETECTED
        || *c == SqlState::T_R_SERIALIZATION_FAILURE)
}

/// Whether the error is a unique violation on the named index.
pub(crate) fn is_unique_violation(e: &tokio_postgres::Error, index: &str) -> bool {
    e.as_db_error().is_some_and(|db| {
        *db.code() == SqlState::UNIQUE_VIOLATION && db.constraint() == Some(index)
    })
}

/// The portable kind of a driver error.
pub(crate) fn kind_of(e: &tokio_postgres::Error) -> ErrorKind {
    let Some(code) = e.code() else {
        return ErrorKind::Unavailable;
    };
    let c = code.code();
    if c.starts_with("08")
        || c.starts_with("53")
        || c.starts_with("57")
        || c.starts_with("40")
        || c == "55P03"
    {
        ErrorKind::Unavailable
    } else if c.starts_with("22") {
        ErrorKind::Invalid
    } else {
        ErrorKind::Conflict
    }
}

/// Converts a driver error, keeping the server's message.
pub(crate) fn pg(e: &tokio_postgres::Error) -> StoreError {
    let message = match e.as_db_error() {
        Some(db) => format!("postgres {}: {}", db.code().code(), db.message()),
        None => format!("postgres: {}", with_causes(e)),
    };
    StoreError::new(kind_of(e), message)
}

/// Converts a pool error (no connection could be had): always retryable.
pub(crate) fn pool(e: &deadpool_postgres::PoolError) -> StoreError {
    StoreError::unavailable(format!("postgres pool: {}", with_causes(e)))
}

/// An error inside an operation: a driver error (which may be retried when transient) or
/// an already portable one.
#[derive(Debug)]
pub(crate) enum OpError {
    /// From the driver.
    Pg(tokio_postgres::Error),
    /// Already portable.
    Store(StoreError),
}

/// Result of an internal operation.
pub(crate) type OpResult<T> = Result<T, OpError>;

impl OpError {
    /// Whether a retry of the whole transaction may succeed.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, OpError::Pg(e) if is_transient(e))
    }
}

impl From<tokio_postgres::Error> for OpError {
    fn from(e: tokio_postgres::Error) -> Self {
        OpError::Pg(e)
    }
}

impl From<StoreError> for OpError {
    fn from(e: StoreError) -> Self {
        OpError::Store(e)
    }
}

impl From<deadpool_postgres::PoolError> for OpError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        OpError::Store(pool(&e))
    }
}

impl From<OpError> for StoreError {
    fn from(e: OpError) -> Self {
        match e {
            OpError::Pg(e) => pg(&e),
            OpError::Store(e) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{PgConfig, PgStore};
    use keel_core::ErrorKind;

    #[tokio::test]
    async fn a_refused_connection_names_the_reason() {
        // Nothing listens on port 1 of the loopback.
        let Err(e) = PgStore::connect(PgConfig::new("postgres://keel@127.0.0.1:1/keel")).await
        else {
            panic!("nothing listens on port 1");
        };
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(e.message.contains("error connecting to server"), "{e}");
        assert!(e.message.contains("Connection refused"), "{e}");
    }
}
