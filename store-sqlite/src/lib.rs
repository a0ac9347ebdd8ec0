//! Keel's embedded durable store: `keel_core::ports::Store` on SQLite (sqlx, bundled
//! SQLite — no server, no system library).
//!
//! ```no_run
//! # async fn demo() -> keel_core::StoreResult<()> {
//! use keel_store_sqlite::{SqliteConfig, SqliteStore};
//! use std::time::Duration;
//!
//! let store = SqliteStore::open_with(
//!     SqliteConfig::new("./keel-demo.db").busy_timeout(Duration::from_secs(2)),
//! )
//! .await?;
//! # let _ = store;
//! # Ok(())
//! # }
//! ```
//!
//! # Shape and what it means for concurrency
//!
//! SQLite allows **one writer at a time** per database file. The store therefore keeps
//! exactly one writer connection behind an async mutex, and every write operation (insert,
//! claim, commit batch, delivery, broadcast, timer sweep, heartbeat, reap, release, cancel,
//! dead-letter and queue calls) is one `BEGIN IMMEDIATE` transaction on it: the write lock
//! is taken up front, so a transaction never has to upgrade a read lock and fail half-way
//! with `SQLITE_BUSY`. Inspection calls (`instance_get`, `instance_lookup`, dead-letter and
//! queue lists, queue stats, timer status) use a small read pool and, thanks to WAL mode,
//! never wait for the writer. Two concurrent timer sweeps simply run one after the other;
//! the second finds the first's timers already advanced or gone.
//!
//! Consequences:
//! - Writes from one process are **serialized**; throughput comes from batching (one
//!   claim of 100 rows or one group commit of 100 results is one transaction), not from
//!   parallel writers. Many workers *in one process* sharing one `SqliteStore` is the
//!   intended deployment.
//! - Several processes may open the same file; they take turns on the write lock and wait
//!   up to [`SqliteConfig::busy_timeout`] for it, after which the call fails with
//!   `Unavailable` (retryable) naming the file. Claims stay correct across processes — a
//!   claim is one write transaction — but wake-ups do not cross process boundaries.
//! - Claims are fenced like on every backend: each claim adds one to the row's
//!   `fencing_token`, and a commit whose token is stale is rejected with `LeaseLost`
//!   without changing anything. Each commit of a batch runs inside its own savepoint, so
//!   one rejected item never affects the others.
//! - Notifications are in-process ([`keel_core::ports::Store::ready_wait`] resolves after
//!   inserts, commits, deliveries, broadcasts, timer fires, reaps, releases, cancels and
//!   dead-letter retries of *this* store value). Polling remains the correctness path.
//!   Timer hints ([`keel_core::ports::Store::timer_hint_wait`]) are in-process too: a
//!   timer armed by another process on the same file is fired by that process's sweeper
//!   on time, and by this one's at its next sweep (at the latest its cadence).
//!
//! # Semantics
//!
//! Every operation loads the rows it touches, runs the pure transitions of
//! [`keel_core::outcome`] and writes the results back, in the same order as the in-memory
//! reference store, and passes the same conformance suite under the same test names. The
//! decisions `MemoryStore` documents hold here too; in particular the unique-key guard
//! column is written by the store so that a row coming back into its key's scope while
//! another instance holds the key simply does not hold it (the first occupant keeps it),
//! and one partial unique index makes two holders impossible.
//!
//! JSON text that no reader accepts (written behind Keel's back) never stops a batch: a
//! context, result, payload or history entry that cannot be decoded reads as an
//! `instance::undecodable` marker naming the error, an instance write keeps the stored
//! text wherever it is given a marker, and a claim dead-letters such a row through
//! `plan::claim::undecodable` in the same transaction instead of handing it out.
//!
//! Durability: WAL with `synchronous = FULL`, so a committed step survives a process kill
//! and a power loss. Timestamps are stored as INTEGER milliseconds, JSON as TEXT.

mod error;
mod inbox;
mod ops;
mod rows;
mod schedules;
mod store;

pub use store::{SqliteConfig, SqliteStore};
