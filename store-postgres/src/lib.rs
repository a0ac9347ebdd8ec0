//! Keel's PostgreSQL store: the durable source of truth on tokio-postgres and
//! deadpool-postgres, batch-first, holding every `Store` contract of keel-core.
//!
//! # Using it
//!
//! ```no_run
//! # async fn demo() -> keel_core::StoreResult<()> {
//! use keel_store_postgres::{PgConfig, PgStore};
//! let store = PgStore::connect(PgConfig::new("postgres://postgres@127.0.0.1/keel")).await?;
//! store.migrate().await?;
//! let mut wake = store.listen().await?; // optional: `wake.recv()` resolves when work is ready
//! # let _ = &mut wake;
//! # Ok(()) }
//! ```
//!
//! # Schema (migrations under `store-postgres/migrations/`)
//!
//! Every object lives in the configured schema (default `keel`; each pooled connection sets
//! its `search_path`), so deployments and tests can share a database.
//!
//! - `status` enum: the eight statuses of DESIGN §3.1.
//! - `instances`: one row per instance. `context`/`result`/`errors` are `jsonb`; `revision`
//!   counts accepted commits; `fencing_token` grows on every claim; `unique_key bytea` +
//!   `unique_scope status[]` feed a generated `unique_guard` column (the key while the status
//!   is in scope, else NULL) under the partial unique index `instances_unique`.
//!   Partial hot indexes: `instances_pick` (runnable rows, claim order), `instances_lease`
//!   and `instances_lease_owner` (executing rows, for the reaper), `instances_concurrency`
//!   (unique on `concurrency_key` over executing rows), `instances_parent`,
//!   `instances_business_key`.
//! - `signals`: the inbox, `unique (target_id, dedup_key)`, ids in arrival order.
//! - `history`: append-only audit trail. `dead_letters`: every attempt's error.
//! - `queues`: per-queue settings (paused).
//!
//! # How the contracts are enforced
//!
//! - **Claim** is one statement: a `FOR UPDATE SKIP LOCKED` picker over runnable rows (filters,
//!   paused queues and busy concurrency keys excluded, priority / `eligible_at` / id order),
//!   a window that keeps the first row per concurrency key, and the `UPDATE` that flips them
//!   to executing with the next fencing token — returning each row with its inbox and
//!   children as JSON, so a claim is one round trip.
//! - **Concurrency keys** are serialized by the database, not by a held connection: the
//!   picker skips keys that have an executing row, and the unique index
//!   `instances_concurrency` makes a racing second claim of the same key fail; the store
//!   then re-runs the claim (whose fresh snapshot now sees the key busy).
//! - **Fencing**: a commit locks its rows (`FOR NO KEY UPDATE`, id order), checks each item
//!   against the pure `validate_commit`, computes the new row with the pure `apply`, and
//!   writes every accepted row back in one `UPDATE … FROM unnest(…)`. A stale item is
//!   reported `LeaseLost` and writes nothing; the others proceed. A batch of no-op `Done`
//!   outcomes costs two round trips: `BEGIN` + lock, then update + history + barrier +
//!   `COMMIT`, pipelined.
//! - **No lost wake-up**: delivery locks the target row before inserting the signal, and an
//!   `Await` commit checks the inbox only after it holds the row lock, so one of the two
//!   always sees the other.
//! - **Uniqueness**: `INSERT … ON CONFLICT (unique_guard) DO NOTHING` with pre-allocated ids,
//!   then one lookup of the occupants; each caller learns its id or the occupant's.
//! - **Notifications**: a transaction that makes work ready sends one `pg_notify` on the
//!   channel `keel_<schema>_ready`; [`PgStore::listen`] exposes it. Polling stays correct
//!   without it.
//! - **Timestamps** are `timestamptz`, converted from and to keel's millisecond
//!   [`keel_core::Timestamp`]; values beyond PostgreSQL's range are clamped (year ±200 000).
//!   Every operation binds the caller's `now`; SQL never reads the clock.
//! - **Transient errors** (deadlock, serialization failure) re-run the whole transaction, up
//!   to [`TRANSACTION_RETRIES`] times, then surface as `Unavailable`.

mod error;
mod migrate;
mod notify;
mod ops;
mod rows;
pub mod testing;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use keel_core::StoreError;
use keel_core::StoreResult;

pub use migrate::SCHEMA_VERSION;
pub use notify::PgListener;

/// How many times a transaction that hit a deadlock or serialization failure is re-run.
pub const TRANSACTION_RETRIES: u32 = 8;

/// Connection settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgConfig {
    /// A libpq-style URL or key/value string, e.g. `postgres://user@host:5432/db`.
    pub url: String,
    /// The schema every object lives in (lowercase letters, digits and `_`; default `keel`).
    pub schema: String,
    /// Most pooled connections (default 16).
    pub pool_size: usize,
}

impl PgConfig {
    /// Settings for `url` with the default schema and pool size.
    pub fn new(url: impl Into<String>) -> Self {
        PgConfig { url: url.into(), schema: "keel".to_owned(), pool_size: 16 }
    }
    /// Sets the schema.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }
    /// Sets the pool size.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }
}

/// The PostgreSQL [`keel_core::ports::Store`].
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    pg: tokio_postgres::Config,
    schema: String,
    channel: String,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").field("schema", &self.schema).finish_non_exhaustive()
    }
}

fn check_schema(schema: &str) -> StoreResult<()> {
    let ok = !schema.is_empty()
        && schema.len() <= 63
        && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && schema.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(StoreError::invalid(format!(
            "schema: {schema:?} is not a plain identifier; use 1 to 63 lowercase letters, digits or '_', not starting with a digit"
        )))
    }
}

impl PgStore {
    /// Builds a pool for `config` and checks that the server answers. Does not migrate.
    pub async fn connect(config: PgConfig) -> StoreResult<Self> {
        check_schema(&config.schema)?;
        if config.pool_size == 0 {
            return Err(StoreError::invalid("pool_size: must be at least 1"));
        }
        let mut pg: tokio_postgres::Config = config
            .url
            .parse()
            .map_err(|e| StoreError::invalid(format!("url: not a PostgreSQL URL: {e}")))?;
        // Keep any options the URL carries; the schema comes last so it wins.
        let options = match pg.get_options() {
            Some(o) if !o.is_empty() => format!("{o} -c search_path={}", config.schema),
            _ => format!("-c search_path={}", config.schema),
        };
        pg.options(options);
        if pg.get_application_name().is_none() {
            pg.application_name("keel");
        }
        let mgr = Manager::from_config(
            pg.clone(),
            tokio_postgres::NoTls,
            ManagerConfig { recycling_method: RecyclingMethod::Fast },
        );
        let pool = Pool::builder(mgr)
            .max_size(config.pool_size)
            .build()
            .map_err(|e| StoreError::invalid(format!("pool: {e}")))?;
        let store = PgStore {
            pool,
            pg,
            channel: format!("keel_{}_ready", config.schema),
            schema: config.schema,
        };
        drop(store.client().await?);
        Ok(store)
    }

    /// The schema this store uses.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The NOTIFY channel this store signals ready work on.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// A pooled connection (its `search_path` is the store's schema), for callers that want
    /// to enqueue in their own transaction (see [`PgStore::instance_insert_tx`]).
    pub async fn client(&self) -> StoreResult<deadpool_postgres::Client> {
        self.pool.get().await.map_err(|e| error::pool(&e))
    }
}
