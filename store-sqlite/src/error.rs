//! Turning sqlx / SQLite errors into the portable [`StoreError`] kinds, always naming the
//! database file so an operator knows which file is locked or damaged.

use keel_core::StoreError;
use sqlx::migrate::MigrateError;

/// SQLite primary result codes we tell apart (`sqlite3.h`).
const SQLITE_BUSY: i64 = 5;
const SQLITE_LOCKED: i64 = 6;
const SQLITE_CORRUPT: i64 = 11;
const SQLITE_CANTOPEN: i64 = 14;
const SQLITE_CONSTRAINT: i64 = 19;
const SQLITE_NOTADB: i64 = 26;

/// The primary SQLite result code of a database error, if it is one.
fn primary_code(e: &sqlx::Error) -> Option<i64> {
    match e {
        sqlx::Error::Database(db) => {
            db.code().and_then(|c| c.parse::<i64>().ok()).map(|c| c & 0xff)
        }
        sqlx::Error::Migrate(m) => match m.as_ref() {
            MigrateError::Execute(inner) | MigrateError::ExecuteMigration(inner, _) => {
                primary_code(inner)
            }
            _ => None,
        },
        _ => None,
    }
}

/// Whether opening a file may have failed only because another process was opening it at
/// the same moment: the file was busy (switching a new file to write-ahead logging takes a
/// lock that does not wait), or a migration ran into one that process had just applied:
/// its statements failed (a table or column that exists now), or, for a migration whose
/// statements can run twice, recording it as applied found the other process's record.
pub(crate) fn raced_another_open(e: &sqlx::Error) -> bool {
    matches!(primary_code(e), Some(SQLITE_BUSY | SQLITE_LOCKED))
        || matches!(e, sqlx::Error::Migrate(m) if match m.as_ref() {
            MigrateError::ExecuteMigration(..) => true,
            MigrateError::Execute(inner) => primary_code(inner) == Some(SQLITE_CONSTRAINT),
            _ => false,
        })
}

/// Maps a driver error on the database at `file` to a portable error.
///
/// - busy / locked (another process holds the write lock past the busy timeout), IO errors
///   and pool exhaustion are `Unavailable`: retrying later may succeed;
/// - a damaged file or one that is not a SQLite database is `Invalid`: retrying will not
///   help, the message names the file and what to do;
/// - a constraint violation is `Conflict`.
pub(crate) fn map(file: &str, during: &str, e: &sqlx::Error) -> StoreError {
    match primary_code(e) {
        Some(SQLITE_BUSY | SQLITE_LOCKED) => StoreError::unavailable(format!(
            "sqlite database {file} is locked by another connection or process ({during}: {e}); \
             the busy timeout ran out — retry later, or stop the other process holding the file"
        )),
        Some(SQLITE_CORRUPT | SQLITE_NOTADB) => StoreError::invalid(format!(
            "sqlite database {file} is corrupt or not a SQLite database ({during}: {e}); \
             restore it from a backup or point Keel at another file"
        )),
        Some(SQLITE_CANTOPEN) => StoreError::unavailable(format!(
            "sqlite database {file} cannot be opened ({during}: {e}); check that the directory \
             exists and is writable"
        )),
        Some(SQLITE_CONSTRAINT) => {
            StoreError::conflict(format!("sqlite database {file}: {during}: {e}"))
        }
        _ => match e {
            sqlx::Error::Migrate(m) if matches!(m.as_ref(), MigrateError::ExecuteMigration(..)) => {
                StoreError::unavailable(format!(
                    "sqlite database {file}: a schema migration failed ({during}: {m}); open it \
                     again, and if it fails the same way, its schema was changed outside Keel"
                ))
            }
            sqlx::Error::Migrate(m) if !matches!(m.as_ref(), MigrateError::Execute(_)) => {
                StoreError::invalid(format!(
                    "sqlite database {file}: its schema cannot be migrated ({during}: {m}); \
                     was it written by a newer Keel?"
                ))
            }
            _ => StoreError::unavailable(format!("sqlite database {file}: {during}: {e}")),
        },
    }
}

/// A row whose stored value cannot be read back (hand-edited or damaged data).
pub(crate) fn corrupt(file: &str, what: &str, detail: impl std::fmt::Display) -> StoreError {
    StoreError::invalid(format!(
        "sqlite database {file}: stored {what} cannot be read ({detail}); the file was changed \
         outside Keel or is damaged"
    ))
}
