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
//! - `status` enum: the eight statuses an instance can have.
//! - `instances`: one row per instance. `context`/`result`/`errors` are `jsonb`; `revision`
//!   counts accepted commits; `fencing_token` grows on every claim; `unique_key bytea` +
//!   `unique_scope status[]` feed a `unique_guard` column (the key while the status is in
//!   scope, else NULL) under the partial unique index `instances_unique`, written by a
//!   trigger: on insert from the row alone, on update only while no other row holds the
//!   key (a row returned to its key's scope while another holds it runs without it).
//!   Partial hot indexes: `instances_pick` (runnable rows, claim order), `instances_lease`
//!   (executing rows by lease expiry, for the reaper, which also finds a restarted
//!   worker's leases there: V10 dropped the by-owner index that cost every claim one more
//!   index insert), `instances_concurrency`
//!   (unique on `concurrency_key` over executing rows), `instances_parent`,
//!   `instances_business_key`.
//! - `signals`: the inbox, `unique (target_id, dedup_key)`, ids in arrival order.
//! - `history`: append-only audit trail. `dead_letters`: every attempt's error.
//! - `queues`: per-queue settings (paused).
//! - V3: `instances.invoked_by` (a chart child's delegation state in its parent);
//!   `timers` (one row per armed timer: owning `state`, the `TimerArm` as `spec jsonb`,
//!   `next_fire_at`, `fire_count`), indexed `(next_fire_at, id)` for the sweep and
//!   `(instance_id, next_fire_at, id)` per instance; `timer_sweeps` (last sweep time per
//!   namespace-or-`*` × machine-or-`*`; a sweep skips the row while another sweep holds
//!   it, so sweepers never queue for it).
//!
//! # How the contracts are enforced
//!
//! - **Claim** is one statement (one round trip): a `FOR UPDATE SKIP LOCKED` picker over
//!   runnable rows in priority / `eligible_at` / id order (namespace, queue and
//!   `(machine, version)` filters; paused queues excluded through a hashed subplan), the
//!   `UPDATE` that flips them to executing with the next fencing token, and each row's inbox
//!   (oldest 64) and children as JSON.
//! - **Concurrency keys** are serialized by the database, never by a held connection or a
//!   session advisory lock: the picker skips keys that have an executing row and takes only
//!   the first runnable row of a key (same filters, claim order; index
//!   `instances_key_runnable`), so at most one per key per claim and batches stay full. The
//!   unique index `instances_concurrency` (executing rows only) makes a racing second
//!   claimer of the same key fail; the store re-runs that claim, whose fresh snapshot now
//!   sees the key busy.
//! - **Commit** (fencing): a batch locks its rows (`FOR NO KEY UPDATE`, id order, so batches
//!   cannot deadlock each other), reads each item's read set and lets the core's commit
//!   planner (`keel_core::plan::commit`) admit or refuse it (stale ⇒ `LeaseLost`, malformed
//!   ⇒ `Invalid`, unknown id or emit target ⇒ `NotFound`; a rejected item writes nothing,
//!   the others go on), and executes the plans: it writes all accepted rows with one `UPDATE … FROM unnest(…)`, deletes exactly the
//!   consumed signal ids (and, in the same statement, the whole inbox of every item that
//!   ended its instance), appends history, stores dead letters, and decrements each parent
//!   whose child became terminal (`greatest(n - k, 0)`, plus a `CHECK` that it never goes
//!   negative) — one transaction. A batch of no-op `Done` outcomes costs **two round
//!   trips**: `BEGIN` + lock (+ the `Await` inbox check), then update + history + barrier +
//!   `COMMIT` with the wake-up notice behind it, pipelined. `ScheduleChildren` adds one
//!   insert; outbox emits add the delivery path below.
//! - **Heartbeat**: one statement locks the named rows in id order (`FOR NO KEY UPDATE`)
//!   and extends those still executing under the worker and token named, so it cannot
//!   deadlock with a commit or another heartbeat; a deadlock with any other writer is
//!   retried like a transaction.
//! - **Terminal inboxes** (`keel_core::inbox`): round trip 1 of a commit also reads, after
//!   the lock, what the `Done` / `Stop` items leave unread in their inboxes — per target
//!   the count and the oldest few (one windowed `SELECT`) — for each drain's one history
//!   entry, so a drain adds no round trip; a cancel reads its cancelled instances' inboxes
//!   the same way and deletes them in one statement. Delivery to a terminal target stores
//!   nothing (`TargetTerminal`), and the broadcast only matches non-terminal rows.
//! - **Signals / no lost wake-up**: delivery locks the target rows (id order) before it
//!   reads or writes their inbox, and an `Await` commit reads the inbox only after it holds
//!   the row lock, so one of the two always sees the other. Dedup is `unique (target_id,
//!   dedup_key)` plus the batch's own keys.
//! - **Spawned children and parent notices**: a commit's `spawn` goes into the same
//!   insert as its `ScheduleChildren` children (per item: barrier children, then spawn),
//!   parent = the committing instance, no barrier. A child that becomes terminal (commit or
//!   cancel) carries a parent release in its plan (`plan::parent`): the parent's barrier is
//!   decremented by `RELEASE_PARENTS`, the same rule as `plan::parent::release` written in
//!   SQL so that one statement counts a whole batch (parents that keep a join state in
//!   their context, `@join`, are skipped there and counted by the planner instead: the
//!   commit locks them first, in id order with its own rows, then `release_joined` plans,
//!   writes and cancels the rest of a woken parent's children), and the plan's notice is delivered
//!   into the parent's inbox through the delivery path above (after the item's outbox
//!   emits, like the reference store).
//! - **Broadcast** is one statement: read the matching targets in the statement's snapshot
//!   (id order, at most `BROADCAST_MAX + 1`; `position = $s OR (left(position, 1) = '['
//!   AND position::jsonb ? $s)`), and only when at most `BROADCAST_MAX` matched lock them
//!   (one that ended or left the state meanwhile drops out), insert the event per target
//!   (`ON CONFLICT (target_id, dedup_key) DO NOTHING`), wake the awaiting ones, `pg_notify`
//!   if any woke.
//! - **Timers**: a commit cancels (`state = s OR state LIKE s || '.%'`), drops (terminal)
//!   and arms timers in one statement pipelined with the rest of the commit; a cancel drops
//!   the timers of every instance it cancels. A sweep is one transaction: one statement
//!   picks the due timers `FOR UPDATE SKIP LOCKED` (concurrent sweeps split them) and locks
//!   each one's instance `FOR NO KEY UPDATE SKIP LOCKED` — a sweep never waits for a lock,
//!   so it cannot deadlock with a commit (instance, then timers) or another sweep; a timer
//!   whose instance is busy is left for the next sweep (counted in `picked`, not in
//!   `processed`). Each
//!   picked timer goes through the pure `timers::fire`; the deliveries use the normal
//!   path, and history, timer advance/delete and the sweep record are batch writes
//!   pipelined with the `COMMIT`; a sweep that passes a join deadline sends those writes
//!   first and then runs the deadline's wake and cancels, so a cancel sees (and drains)
//!   what the sweep delivered to a child.
//! - **Uniqueness**: `INSERT … ON CONFLICT (unique_guard) DO NOTHING` with ids drawn up
//!   front, rows sorted by key (concurrent inserters wait in one order and cannot deadlock),
//!   then one lookup of the occupants; each caller learns its id or the occupant's.
//!   [`PgStore::instance_insert_tx`] does the same inside the caller's transaction.
//! - **Notifications**: a transaction that makes work ready (insert, a delivery or
//!   broadcast that wakes, a commit, sweep, reap, release, cancel, dead-letter retry/skip,
//!   queue resume) sends one `pg_notify` on `keel_<schema>_ready`, in a statement of its
//!   own pipelined behind its `COMMIT`, whose answer alone the caller waits for;
//!   [`PgStore::listen`] exposes it, and `Store::ready_wait` waits on one shared LISTEN
//!   connection per store (opened on the first wait, reopened after it drops; a wake-up
//!   with nobody waiting is kept for the next wait). Polling stays correct without it.
//!   A commit that arms timers also sends a timer hint on the same channel (payload
//!   `timer:<earliest due, ms>`, in the same notice behind the `COMMIT`), which the
//!   shared connection adds to the hint log behind `Store::timer_hint_wait`; opening or
//!   losing that connection logs a gap, so sweepers re-read `timer_next_due` (one index
//!   read in due order). [`PgStore::listen`] leaves timer hints out.
//! - **Limits** are keel-core's ([`keel_core::limits`]): payloads, contexts and results at
//!   most 1 MiB of JSON, names 256 bytes, batch sizes per operation; an over-limit or
//!   malformed input is `Invalid` and writes nothing.
//! - **Undecodable values** never panic and never fail a batch: every column is read with
//!   `try_get`; a JSON column no reader accepts (a value stored behind Keel's back) is shown
//!   as an `instance::undecodable` marker naming the error, and `WRITE_INSTANCES` keeps the
//!   stored value wherever it is given a marker. A claimed row whose context, result, inbox
//!   or children cannot be decoded is not handed out: a second transaction, fenced on the
//!   claim's token, applies `plan::claim::undecodable` (suspended, dead letter `undecodable`
//!   naming the error); if that write fails, the lease runs out and a later claim retries.
//! - **Timestamps** are `timestamptz`, converted from and to keel's millisecond
//!   [`keel_core::Timestamp`]; values beyond PostgreSQL's range are clamped (year ±200 000).
//!   Every operation binds the caller's `now`; SQL never reads the clock.
//! - **Errors**: connection loss, timeouts, cancellations, deadlocks, serialization
//!   failures, a lock not available, a shortage of server resources, system I/O errors
//!   (class 58, but for a missing or duplicate file), a write refused as read-only
//!   (25006: during a failover a connection reaches a standby or a demoted primary) and a
//!   snapshot too old (72000) are `Unavailable` (retryable); data exceptions (class 22) are `Invalid`; anything else
//!   the server refuses is `Conflict`. Deadlocks and serialization failures are first
//!   retried internally, up to [`TRANSACTION_RETRIES`] times, as is a claim that lost the
//!   race for a concurrency or unique key to another worker; one that loses it every time
//!   is `Unavailable` too (try the claim again). A migration step that fails on the
//!   connection or the server takes the kind of that error; a stored migration history that
//!   differs from this build's is `Conflict`, and a schema newer than this build is
//!   `Invalid`. A connection dropped inside a
//!   transaction (error or cancelled future) is detached from the pool, never reused.
//!
//! # Known leaks
//!
//! - A claim whose rows share a unique key scoped to `executing` (but not `runnable`) takes
//!   one of them (two claims racing for such rows: the loser's statement fails on the
//!   unique index and runs again, as for a concurrency key); a commit that would bring a
//!   key back into scope over another occupant is
//!   a per-item `Conflict`. Transitions outside commits (a reap, a release, a wake-up, a
//!   dead-letter retry) store the row without the key while another holds it, as SQLite
//!   and `MemoryStore` do; only two rows entering one key's scope at the same moment in
//!   two transactions still meet the index, and the later call fails with `Conflict` (a
//!   claim instead runs again, as above).
//! - `queue_list`, `queue_stats` and `timer_status` scan (operator paths, not indexed).
//! - A broadcast or list whose `in_state` filter meets a position that starts with `[` but
//!   is not JSON `jsonb` reads fails (`position::jsonb`). Starts and commits refuse such
//!   positions (`instance::check_position`), so only a row stored before that check can
//!   hold one.
//! - A sweep leaves a due timer whose instance is locked at that moment for the next
//!   sweep, so `processed < limit` does not prove that nothing is due; nor does `picked <
//!   limit` quite, as due timers another transaction holds (another sweep, a retime, a
//!   commit changing them) are not picked.
//! - Within one commit batch, an `Await` item checks its inbox before the batch's own
//!   outbox emits are delivered; an emit from an earlier item of the same batch then wakes
//!   the parked row right after (same final row, but its receipt and `STEP_AWAIT` entry
//!   say it parked, where the sequential reference store says it did not).
//! - Likewise, an emit to an instance whose terminal commit is in the same batch is
//!   delivered after that commit and so is not stored (`TargetTerminal`); the sequential
//!   reference store may store it first and then list it in the instance's drain entry.
//!   Either way the finished instance's inbox ends empty.

mod error;
mod migrate;
mod notify;
mod ops;
mod rows;
pub mod testing;
mod tls;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use keel_core::StoreError;
use keel_core::StoreResult;

pub use migrate::SCHEMA_VERSION;
pub use notify::PgListener;
pub use tls::SslMode;

/// How many times a transaction that hit a deadlock or serialization failure is re-run.
pub const TRANSACTION_RETRIES: u32 = 8;

/// Connection settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgConfig {
    /// A libpq-style URL or key/value string, e.g. `postgres://user@host:5432/db`.
    ///
    /// TLS follows libpq's `sslmode` (see [`SslMode`]): `disable`, `prefer` (the default:
    /// TLS when the server offers it, certificate not verified), `require` (TLS, not
    /// verified), `verify-ca` (chain checked) and `verify-full` (chain and host name). The
    /// roots are the PEM file `sslrootcert=<file>` names, else the system's.
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
    /// The connector of every connection: pooled, listening and migrating.
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    schema: String,
    channel: String,
    wake: std::sync::Arc<notify::WakeHub>,
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

/// TCP keepalives for every connection (pooled and listening) when the URL sets none:
/// first probe after 30 s idle, then every 10 s, the connection given up after 3 missed.
/// The driver's default (first probe after two hours) lets a connection that a NAT, a
/// load balancer or a failover dropped without a word look open for hours: the listening
/// connection would miss every wake-up meanwhile, and a pooled one would hang its next
/// query. A URL that sets any `keepalives*` parameter to other than the driver's default
/// keeps all three as it says.
fn keepalive_defaults(pg: &mut tokio_postgres::Config) {
    let untouched = pg.get_keepalives()
        && pg.get_keepalives_idle() == KEEPALIVE_DRIVER_IDLE
        && pg.get_keepalives_interval().is_none()
        && pg.get_keepalives_retries().is_none();
    if untouched {
        pg.keepalives_idle(std::time::Duration::from_secs(30))
            .keepalives_interval(std::time::Duration::from_secs(10))
            .keepalives_retries(3);
    }
}

/// The driver's own first-probe delay, which a URL without `keepalives_idle` gets.
const KEEPALIVE_DRIVER_IDLE: std::time::Duration = std::time::Duration::from_secs(2 * 60 * 60);

/// The longest channel name PostgreSQL accepts (`NAMEDATALEN - 1`): `LISTEN` cuts a longer
/// one short while `pg_notify` refuses it, so the two would never meet.
const CHANNEL_MAX: usize = 63;

/// The NOTIFY channel of a schema: `keel_<schema>_ready`, or, where that is longer than
/// PostgreSQL allows, the schema's first 35 characters and a hash of the whole name, so
/// two long schema names that share a prefix still get different channels. The hash is
/// FNV-1a, fixed here, so every worker build computes the same channel.
fn channel_for(schema: &str) -> String {
    let plain = format!("keel_{schema}_ready");
    if plain.len() <= CHANNEL_MAX {
        return plain;
    }
    let hash = schema.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    // The schema is ASCII (checked by `check_schema`), so any byte index is a boundary.
    format!("keel_{}_{hash:016x}_ready", &schema[..35])
}

impl PgStore {
    /// Builds a pool for `config` and checks that the server answers. Does not migrate.
    pub async fn connect(config: PgConfig) -> StoreResult<Self> {
        check_schema(&config.schema)?;
        if config.pool_size == 0 {
            return Err(StoreError::invalid("pool_size: must be at least 1"));
        }
        let (driver_url, tls) = tls::split(&config.url)?;
        let connector = tls.connector()?;
        let mut pg: tokio_postgres::Config = driver_url
            .parse()
            .map_err(|e| StoreError::invalid(format!("url: not a PostgreSQL URL: {e}")))?;
        // JIT off unless the URL's options say otherwise (they come after it): every
        // statement of the store is short, and a cost estimate over `jit_above_cost` (the
        // claim's sub-plans over a large table are estimated high though they never run)
        // spent about 200 ms compiling a claim that runs in under 1 ms. Keep any options
        // the URL carries; the schema comes last so it wins.
        let options = match pg.get_options() {
            Some(o) if !o.is_empty() => {
                format!("-c jit=off {o} -c search_path={}", config.schema)
            }
            _ => format!("-c jit=off -c search_path={}", config.schema),
        };
        pg.options(options);
        if pg.get_application_name().is_none() {
            pg.application_name("keel");
        }
        tls.apply(&mut pg);
        keepalive_defaults(&mut pg);
        let mgr = Manager::from_config(
            pg.clone(),
            connector.clone(),
            ManagerConfig { recycling_method: RecyclingMethod::Fast },
        );
        let pool = Pool::builder(mgr)
            .max_size(config.pool_size)
            .build()
            .map_err(|e| StoreError::invalid(format!("pool: {e}")))?;
        let store = PgStore {
            pool,
            pg,
            tls: connector,
            channel: channel_for(&config.schema),
            schema: config.schema,
            wake: std::sync::Arc::default(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn keepalives(url: &str) -> (bool, Duration, Option<Duration>, Option<u32>) {
        let mut pg: tokio_postgres::Config = url.parse().unwrap();
        keepalive_defaults(&mut pg);
        (
            pg.get_keepalives(),
            pg.get_keepalives_idle(),
            pg.get_keepalives_interval(),
            pg.get_keepalives_retries(),
        )
    }

    #[test]
    fn connections_probe_a_silent_peer_within_a_minute_unless_the_url_says_otherwise() {
        let s = Duration::from_secs;
        assert_eq!(keepalives("postgres://h/db"), (true, s(30), Some(s(10)), Some(3)));
        assert_eq!(keepalives("postgres://h/db?keepalives_idle=600"), (true, s(600), None, None));
        assert!(!keepalives("postgres://h/db?keepalives=0").0);
    }
}
