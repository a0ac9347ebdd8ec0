//! Mapping driver and pool errors onto the portable [`ErrorKind`]s.
//!
//! Connection failures, timeouts, cancellations, deadlocks, serialization failures and
//! transient server states (read-only during a failover, system I/O errors, an aged-out
//! snapshot) are `Unavailable` (retryable); a unique violation is `Conflict`; bad data is
//! `Invalid`. Anything else the server rejects is `Conflict`: retrying the same call will
//! not help.

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
    match e.code() {
        Some(code) => kind_of_code(code.code()),
        // No SQLSTATE: the connection or the driver failed, not the statement.
        None => ErrorKind::Unavailable,
    }
}

/// The portable kind of an SQLSTATE. A state of the server rather than of the call is
/// `Unavailable`, so callers retry it:
/// - `08` connection exceptions, `53` insufficient resources, `57` operator intervention
///   (shutdown, cancel, crash recovery), `58` system errors (I/O; not `58P01` undefined
///   file or `58P02` duplicate file), `40` rollbacks
///   (deadlock, serialization failure) and `55P03` lock not available;
/// - `25006` read-only transaction: during a failover a connection reaches a standby or
///   a demoted primary, and a later call reaches the new primary;
/// - `72000` snapshot too old: the transaction's snapshot aged out (`old_snapshot_threshold`),
///   and a retry runs in a new transaction with a fresh snapshot.
///
/// `22` data exceptions are `Invalid`; anything else the server rejects is `Conflict`:
/// retrying the same call will not help.
pub(crate) fn kind_of_code(c: &str) -> ErrorKind {
    const UNAVAILABLE_CLASSES: [&str; 6] = ["08", "53", "57", "58", "40", "72"];
    const UNAVAILABLE_STATES: [&str; 2] = ["55P03", "25006"];
    // Of class 58, a file that is missing or already there stays so however often asked.
    const PERMANENT_STATES: [&str; 2] = ["58P01", "58P02"];
    if (UNAVAILABLE_CLASSES.iter().any(|class| c.starts_with(class))
        && !PERMANENT_STATES.contains(&c))
        || UNAVAILABLE_STATES.contains(&c)
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
    use super::kind_of_code;
    use crate::{PgConfig, PgStore};
    use keel_core::ErrorKind;
    use tokio_postgres::error::SqlState;

    #[test]
    fn transient_server_states_are_retryable_and_refusals_are_not() {
        let unavailable = [
            "08006", // connection failure
            "53300", // too many connections
            "57P01", // admin shutdown
            "57014", // query cancelled (statement timeout)
            "58000", // system error
            "58030", // I/O error
            "40001", // serialization failure
            "40P01", // deadlock
            "55P03", // lock not available
            "25006", // read-only transaction: a standby or a demoted primary
            "72000", // snapshot too old
        ];
        for code in unavailable {
            assert_eq!(kind_of_code(code), ErrorKind::Unavailable, "{code}");
        }
        let conflict = [
            "23505", // unique violation
            "23502", // not-null violation
            "25P02", // in failed transaction: the statement before it says why
            "25001", // active transaction
            "42P01", // undefined table
            "55000", // object not in prerequisite state
            "55006", // object in use
            "58P01", // undefined file
            "58P02", // duplicate file
        ];
        for code in conflict {
            assert_eq!(kind_of_code(code), ErrorKind::Conflict, "{code}");
        }
        assert_eq!(kind_of_code("22P02"), ErrorKind::Invalid);
    }

    /// A write that reaches a read-only server (as during a failover) is retryable.
    #[tokio::test]
    async fn a_write_on_a_read_only_server_is_retryable() {
        let Some(s) = crate::testing::fresh_schema().await else {
            let var = keel_testkit::conformance::REQUIRE_BACKENDS_VAR;
            assert!(std::env::var(var).as_deref() != Ok("1"), "{var}=1 but no database is set");
            return;
        };
        let c = s.client().await.expect("a connection");
        let refused = c
            .batch_execute("BEGIN READ ONLY; UPDATE instances SET priority = priority WHERE false")
            .await
            .expect_err("a read-only transaction refuses a write");
        let _ = c.batch_execute("ROLLBACK").await;
        assert_eq!(refused.code().map(SqlState::code), Some("25006"), "{refused}");
        let e = super::pg(&refused);
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    }

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
