//! [`SqliteStore`]: opening the database, the one-writer / many-readers shape, and the
//! `Store` trait implementation that runs each operation of [`crate::ops`] in one
//! `BEGIN IMMEDIATE` transaction.

use crate::error::map;
use crate::ops;
use crate::rows::{Db, dead_letter_cols, instance_cols};
use async_trait::async_trait;
use keel_core::instance::check_batch;
use keel_core::instance::{DeadLetter, Instance};
use keel_core::limits;
use keel_core::plan::{self, commit};
use keel_core::ports::Store;
use keel_core::ports::store::{
    ActivityBucket, ActivityParams, BroadcastReport, CancelParams, Claim, ClaimParams,
    CommitParams, CommitReceipt, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSkipParams, DeliveryOutcome, HistoryPage, HistoryPageParams, HistoryTrimPage,
    HistoryTrimParams, InsertOutcome, InsertParams, InstanceDetail, InstanceListParams,
    LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, MigratePage, MigrateParams, PrunePage,
    PruneParams, QueuePauseParams, QueueState, QueueStats, ReadyStaleParams, SignalBroadcastParams,
    SignalDeliverParams, StoreCapabilities, TimerNextDueParams, TimerRetimePage, TimerRetimeParams,
    TimerStatus, TimerSweepParams, TimerSweepReport, WorkerBeatParams, WorkerRecord,
};
use keel_core::timers::{TimerHint, TimerHints};
use keel_core::{DeadLetterId, InstanceId, SignalTarget, Status, StoreResult, Timestamp};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Row, SqlSafeStr, Sqlite, SqliteConnection};
use std::borrow::Cow;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, MutexGuard, Notify};

/// How to open a SQLite store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteConfig {
    /// The database file; created (with its schema) when missing.
    pub path: PathBuf,
    /// How long a statement waits for another connection or process to release the
    /// database lock before the call fails with `Unavailable`.
    pub busy_timeout: Duration,
    /// Connections in the read pool (inspection calls); writes always use the one writer.
    pub read_connections: u32,
}

impl SqliteConfig {
    /// The default busy timeout: long enough to ride out another writer's transaction.
    pub const BUSY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
    /// The default size of the read pool.
    pub const READ_CONNECTIONS_DEFAULT: u32 = 4;

    /// The defaults for a database at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SqliteConfig {
            path: path.into(),
            busy_timeout: Self::BUSY_TIMEOUT_DEFAULT,
            read_connections: Self::READ_CONNECTIONS_DEFAULT,
        }
    }

    /// Sets the busy timeout.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }
}

/// The schema, embedded at compile time (no migrations directory is needed at run time).
pub(crate) fn migrator() -> Migrator {
    let migration = |version, description: &'static str, sql: &'static str| {
        Migration::new(
            version,
            Cow::Borrowed(description),
            MigrationType::Simple,
            sql.into_sql_str(),
            false,
        )
    };
    Migrator::with_migrations(vec![
        migration(1, "schema", include_str!("../migrations/0001_schema.sql")),
        migration(2, "charts timers", include_str!("../migrations/0002_charts_timers.sql")),
        migration(3, "operations", include_str!("../migrations/0003_operations.sql")),
        migration(4, "rate buckets", include_str!("../migrations/0004_rate_buckets.sql")),
        migration(5, "operator reads", include_str!("../migrations/0005_operator_reads.sql")),
        migration(6, "fair claims", include_str!("../migrations/0006_fair_claims.sql")),
        migration(7, "key rate buckets", include_str!("../migrations/0007_key_rate_buckets.sql")),
        migration(8, "schedule states", include_str!("../migrations/0008_schedule_states.sql")),
        migration(9, "signal priority", include_str!("../migrations/0009_signal_priority.sql")),
        migration(10, "runnable keys", include_str!("../migrations/0010_runnable_keys.sql")),
        migration(11, "runnable age", include_str!("../migrations/0011_runnable_age.sql")),
        migration(
            12,
            "schedule fired ticks",
            include_str!("../migrations/0012_schedule_fired_ticks.sql"),
        ),
        migration(
            13,
            "dead letters by instance",
            include_str!("../migrations/0013_dead_letters_by_instance.sql"),
        ),
    ])
}

/// Deletes a temporary database (and its WAL files) when the store that owns it is dropped.
#[derive(Debug)]
struct TempFiles(PathBuf);

impl Drop for TempFiles {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut name = self.0.clone().into_os_string();
            name.push(suffix);
            // Best effort: a leftover temp file is harmless.
            let _ = std::fs::remove_file(PathBuf::from(name));
        }
    }
}

/// `Store` on SQLite: one database file, one writer connection, a read pool.
///
/// ```no_run
/// # async fn demo() -> keel_core::StoreResult<()> {
/// use keel_store_sqlite::SqliteStore;
/// let store = SqliteStore::open("keel-demo.db").await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct SqliteStore {
    /// The one connection that writes; every write is one `BEGIN IMMEDIATE` transaction
    /// under this lock.
    writer: Mutex<SqliteConnection>,
    /// Readers for inspection calls; `None` for an in-memory database, which only the
    /// writer connection can see.
    readers: Option<SqlitePool>,
    /// The file, as shown in error messages.
    file: String,
    /// Fired after writes that may have made work ready.
    ready: Notify,
    /// Timer hints for `timer_hint_wait` (in-process only, like `ready`), and the wake-up of
    /// their readers.
    hints: std::sync::Mutex<TimerHints>,
    hinted: Notify,
    /// Wake-ups for `instance_change_wait`: every write may change a status.
    changed: Notify,
    /// Declared last so the connections close before the files go.
    temp: Option<TempFiles>,
}

/// A connection for reading: from the pool, or the writer's for an in-memory database.
enum ReadConn<'a> {
    Pooled(PoolConnection<Sqlite>),
    Writer(MutexGuard<'a, SqliteConnection>),
}

impl Deref for ReadConn<'_> {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        match self {
            ReadConn::Pooled(c) => c,
            ReadConn::Writer(c) => c,
        }
    }
}

impl DerefMut for ReadConn<'_> {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        match self {
            ReadConn::Pooled(c) => c,
            ReadConn::Writer(c) => c,
        }
    }
}

/// Runs `$body` (an expression using `$db: &mut Db`) in one `BEGIN IMMEDIATE`
/// transaction on the writer; commits on `Ok`, rolls back on `Err`.
macro_rules! write_tx {
    ($self:ident, |$db:ident| $body:expr) => {{
        let file = $self.file.as_str();
        let mut conn = $self.writer.lock().await;
        let mut tx = conn
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map(file, "starting a write transaction", &e))?;
        let result = {
            let mut db = Db { conn: &mut tx, file };
            let $db = &mut db;
            $body.await
        };
        match result {
            Ok(value) => {
                tx.commit().await.map_err(|e| map(file, "committing", &e))?;
                Ok(value)
            }
            // The body's error is the one to report: a rollback that fails too (SQLite
            // already rolled back on its own after a full disk or an IO error) only adds to
            // it.
            Err(mut e) => {
                if let Err(r) = tx.rollback().await {
                    let r = map(file, "rolling back", &r);
                    e.message = format!("{}; then {}", e.message, r.message);
                }
                Err(e)
            }
        }
    }};
}

/// Tries one open makes of a file that other processes are opening at the same moment.
const OPEN_TRIES: u32 = 5;

/// Connects the writer of a file other processes may open at the same moment, and brings
/// its schema up to date. Two things race there: switching a new file to write-ahead
/// logging takes a lock that does not wait for the busy timeout, and the migrator reads
/// which migrations are applied before it runs the rest, each in its own transaction,
/// holding no lock across them, so a migration another process applies in between fails
/// here (its table or column exists). Trying again finds the file switched and the
/// migration applied; only these failures are tried again, a bounded number of times, and
/// a schema newer than this build or changed outside Keel is refused at once.
async fn open_writer(options: &SqliteConnectOptions, file: &str) -> StoreResult<SqliteConnection> {
    let mut tries = 1;
    loop {
        let (e, during) = match SqliteConnection::connect_with(options).await {
            Err(e) => (e, "opening"),
            Ok(mut writer) => match migrator().run(&mut writer).await {
                Ok(()) => return Ok(writer),
                Err(e) => (sqlx::Error::Migrate(Box::new(e)), "migrating"),
            },
        };
        if tries >= OPEN_TRIES || !crate::error::raced_another_open(&e) {
            return Err(map(file, during, &e));
        }
        tokio::time::sleep(Duration::from_millis(50 * u64::from(tries))).await;
        tries += 1;
    }
}

/// Rows the driver may buffer per statement: more than the pages the store reads in
/// ordinary use (claims and commit batches of at most a thousand rows, sweeps of a
/// thousand timers by default). A larger page still works; it only waits for the buffer.
const ROW_BUFFER: usize = 1_024;

impl SqliteStore {
    /// Opens (creating when missing) the database at `path` with default settings.
    pub async fn open(path: impl AsRef<Path>) -> StoreResult<Self> {
        Self::open_with(SqliteConfig::new(path.as_ref())).await
    }

    /// Opens (creating when missing) a database as `config` says, and brings its schema
    /// up to date. A file that is not a SQLite database, or is damaged, is `Invalid`; a
    /// file another process keeps locked past the busy timeout is `Unavailable`. Both
    /// messages name the file.
    pub async fn open_with(config: SqliteConfig) -> StoreResult<Self> {
        let file = config.path.display().to_string();
        let options = SqliteConnectOptions::new()
            .filename(&config.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(config.busy_timeout)
            .foreign_keys(true)
            // A statement that writes many rows inside a transaction keeps the pages it
            // changes in a statement journal, so that it alone can be undone if it fails
            // halfway. Past 64 KiB that journal spills to a temporary file, as it does for
            // the larger batches the store gathers into one statement; held in memory it
            // costs no system calls. It never outlives its statement.
            .pragma("temp_store", "memory")
            // The driver hands rows over one message at a time through a bounded buffer; a
            // claim or sweep page larger than the buffer would park the driver thread,
            // write lock held, until this task gets a core back to drain it. A buffer
            // that holds the largest page lets the statement finish in one go.
            .row_buffer_size(ROW_BUFFER);
        let writer = open_writer(&options, &file).await?;
        let readers = SqlitePoolOptions::new()
            .max_connections(config.read_connections.max(1))
            .connect_with(options.create_if_missing(false))
            .await
            .map_err(|e| map(&file, "opening the read pool", &e))?;
        Ok(SqliteStore {
            writer: Mutex::new(writer),
            readers: Some(readers),
            file,
            ready: Notify::new(),
            hints: std::sync::Mutex::default(),
            hinted: Notify::new(),
            changed: Notify::new(),
            temp: None,
        })
    }

    /// A private in-memory database: fresh and empty, gone when the store is dropped.
    /// Everything (reads included) goes through one connection. For tests.
    pub async fn memory() -> StoreResult<Self> {
        let file = ":memory:".to_owned();
        let options = SqliteConnectOptions::new().in_memory(true).foreign_keys(true);
        let mut writer = SqliteConnection::connect_with(&options)
            .await
            .map_err(|e| map(&file, "opening", &e))?;
        migrator()
            .run(&mut writer)
            .await
            .map_err(|e| map(&file, "migrating", &sqlx::Error::Migrate(Box::new(e))))?;
        Ok(SqliteStore {
            writer: Mutex::new(writer),
            readers: None,
            file,
            ready: Notify::new(),
            hints: std::sync::Mutex::default(),
            hinted: Notify::new(),
            changed: Notify::new(),
            temp: None,
        })
    }

    /// A fresh database in a new file under the system temp directory, deleted when the
    /// store is dropped: the real file, WAL and read-pool path, for tests and demos.
    pub async fn temporary() -> StoreResult<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!("keel-sqlite-{}-{n}-{nanos}.db", std::process::id()));
        let temp = TempFiles(path.clone());
        let mut store = Self::open(&path).await?;
        store.temp = Some(temp);
        Ok(store)
    }

    /// The database file this store writes (`:memory:` for an in-memory one).
    pub fn file(&self) -> &str {
        &self.file
    }

    async fn reader(&self) -> StoreResult<ReadConn<'_>> {
        match &self.readers {
            Some(pool) => pool
                .acquire()
                .await
                .map(ReadConn::Pooled)
                .map_err(|e| map(&self.file, "acquiring a read connection", &e)),
            None => Ok(ReadConn::Writer(self.writer.lock().await)),
        }
    }

    /// Wakes everyone in `ready_wait`.
    fn wake(&self) {
        self.ready.notify_waiters();
        // And a permit for a worker about to wait (between its empty claim and its wait),
        // so the wake-up is not lost until its next poll.
        self.ready.notify_one();
        self.changed.notify_waiters();
    }

    /// Tells this process's sweepers that a commit armed timers, the earliest due at `due`.
    fn hint_timers(&self, due: Option<Timestamp>) {
        if let Some(due) = due {
            self.hints.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(due);
            self.hinted.notify_waiters();
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities { notifications: true }
    }

    async fn instance_insert(&self, params: InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        let out = write_tx!(self, |db| ops::insert(db, &params))?;
        if out.iter().any(|o| matches!(o, InsertOutcome::Inserted(_))) {
            self.wake();
        }
        Ok(out)
    }

    async fn instance_claim(&self, params: ClaimParams) -> StoreResult<Vec<Claim>> {
        write_tx!(self, |db| ops::claim(db, &params, None))
    }

    async fn instance_claim_ids(
        &self,
        ids: Vec<InstanceId>,
        params: ClaimParams,
    ) -> StoreResult<Vec<Claim>> {
        params.validate_by_ids()?;
        write_tx!(self, |db| ops::claim(db, &params, Some(&ids)))
    }

    async fn instance_ready_stale(&self, params: ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        let mut conn = self.reader().await?;
        ops::ready_stale(&mut Db { conn: &mut conn, file: &self.file }, &params).await
    }

    async fn step_commit(
        &self,
        params: CommitParams,
    ) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
        params.validate()?;
        let out = write_tx!(self, |db| ops::commit_batch(db, &params.commits, params.now))?;
        if out.iter().any(Result::is_ok) {
            self.wake();
        }
        self.hint_timers(commit::armed_due(&params.commits, &out, params.now));
        Ok(out)
    }

    async fn lease_extend(&self, params: LeaseExtendParams) -> StoreResult<Vec<bool>> {
        write_tx!(self, |db| ops::lease_extend(db, &params))
    }

    async fn lease_reap(&self, params: LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        let out = write_tx!(self, |db| ops::lease_reap(db, &params))?;
        if !out.is_empty() {
            self.wake();
        }
        Ok(out)
    }

    async fn instance_migrate(&self, params: MigrateParams) -> StoreResult<MigratePage> {
        let page = write_tx!(self, |db| ops::migrate(db, &params))?;
        self.hint_timers(Some(params.now));
        self.wake();
        Ok(page)
    }

    async fn instance_prune(&self, params: PruneParams) -> StoreResult<PrunePage> {
        write_tx!(self, |db| ops::prune(db, &params))
    }

    async fn lease_release(&self, params: LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        let out = write_tx!(self, |db| ops::lease_release(db, &params))?;
        if out.iter().any(|b| *b) {
            self.wake();
        }
        Ok(out)
    }

    async fn signal_deliver(
        &self,
        params: SignalDeliverParams,
    ) -> StoreResult<Vec<DeliveryOutcome>> {
        let out = write_tx!(self, |db| ops::signal_deliver(db, &params))?;
        if out.iter().any(|o| matches!(o, DeliveryOutcome::Delivered { .. })) {
            self.wake();
        }
        Ok(out)
    }

    async fn signal_broadcast(
        &self,
        params: SignalBroadcastParams,
    ) -> StoreResult<BroadcastReport> {
        let out = write_tx!(self, |db| ops::signal_broadcast(db, &params))?;
        if out.delivered > 0 {
            self.wake();
        }
        Ok(out)
    }

    async fn instance_cancel(&self, params: CancelParams) -> StoreResult<Vec<InstanceId>> {
        let out = write_tx!(self, |db| ops::cancel(db, &params))?;
        if !out.is_empty() {
            self.wake();
        }
        Ok(out)
    }

    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        let mut conn = self.reader().await?;
        let file = self.file.as_str();
        let mut tx = conn.begin().await.map_err(|e| map(file, "starting a read", &e))?;
        let mut db = Db { conn: &mut tx, file };
        let instance = db.instance_required(id).await?;
        let detail = InstanceDetail {
            inbox: db.inbox(id, limits::INBOX_LIST_MAX).await?,
            children: db.children(id).await?,
            history: db.history(id).await?,
            timers: db.timers(id, limits::TIMER_LIST_MAX).await?,
            instance,
        };
        // One snapshot for the row and its inbox, children and history; nothing to keep.
        tx.rollback().await.map_err(|e| map(file, "ending a read", &e))?;
        Ok(detail)
    }

    async fn history_page(&self, params: HistoryPageParams) -> StoreResult<HistoryPage> {
        params.validate()?;
        let mut conn = self.reader().await?;
        let file = self.file.as_str();
        let mut tx = conn.begin().await.map_err(|e| map(file, "starting a read", &e))?;
        let mut db = Db { conn: &mut tx, file };
        db.instance_required(params.instance).await?;
        let read = db.history_before(params.instance, params.before, params.read_limit()).await?;
        tx.rollback().await.map_err(|e| map(file, "ending a read", &e))?;
        Ok(plan::history::page(&params, read))
    }

    async fn history_trim(&self, params: HistoryTrimParams) -> StoreResult<HistoryTrimPage> {
        write_tx!(self, |db| ops::history_trim(db, &params))
    }

    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        check_batch("ids", ids.len(), limits::ROWS_BATCH_MAX)?;
        let mut conn = self.reader().await?;
        Db { conn: &mut conn, file: self.file.as_str() }.instances(&ids).await
    }

    async fn instance_list(&self, params: InstanceListParams) -> StoreResult<Vec<Instance>> {
        params.validate()?;
        let mut conn = self.reader().await?;
        let db = Db { conn: &mut conn, file: &self.file };
        // Only the filters that are set are written out, each with its own number, so
        // SQLite can seek on them: written as `? IS NULL OR machine = ?` a machine filter
        // could not use `keel_instances_list`, and a machine's page read every instance
        // of the namespace and sorted them. With a machine the page walks
        // `(namespace, machine, id)`, with a business key `(namespace, business_key, id)`,
        // otherwise `(namespace, id)`: newest first, no sort, stopping after `limit` rows.
        let mut scope = String::new();
        if params.machine.is_some() {
            scope.push_str(" AND machine = ?3");
        }
        if params.status.is_some() {
            scope.push_str(" AND status = ?4");
        }
        if params.business_key.is_some() {
            scope.push_str(" AND business_key = ?5");
        }
        if params.before.is_some() {
            scope.push_str(" AND id < ?6");
        }
        if params.state.is_some() {
            scope.push_str(
                " AND (position = ?7 OR (substr(position, 1, 1) = '[' AND json_valid(position) \
                   AND EXISTS (SELECT 1 FROM json_each(position) WHERE value = ?7)))",
            );
        }
        let sql = format!(
            "SELECT {} FROM keel_instances WHERE namespace = ?1{scope} ORDER BY id DESC LIMIT +?2",
            instance_cols!()
        );
        // The text varies only by the fixed fragments above; every value is bound whether
        // the text uses its `?N` or not, and an unused one is never read.
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&params.namespace)
            .bind(params.limit as i64)
            .bind(&params.machine)
            .bind(params.status.map(Status::name))
            .bind(&params.business_key)
            .bind(params.before.map(|b| b.0))
            .bind(&params.state)
            .fetch_all(&mut *db.conn)
            .await
            .map_err(db.err("listing instances"))?;
        rows.iter().map(|r| db.instance_of(r)).collect()
    }

    async fn instance_lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>> {
        let mut conn = self.reader().await?;
        Db { conn: &mut conn, file: &self.file }.resolve(&target).await
    }

    async fn dead_letter_list(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        filter.validate()?;
        let mut conn = self.reader().await?;
        let db = Db { conn: &mut conn, file: &self.file };
        // The cursor is a range on the id (`id > ?` / `id < ?`, unset = the whole range),
        // so a deep page seeks rather than skipping rows; the filters that are set are
        // written out (not `? IS NULL OR …`) so a namespace seeks in
        // `keel_dead_letters_namespace` and a namespace and machine in
        // `keel_dead_letters_machine`, both in id order. The previous page reads
        // downwards from its cursor and is turned back to oldest first below.
        let backwards = filter.before.is_some();
        let mut scope = String::new();
        if filter.namespace.is_some() {
            scope.push_str(" AND namespace = ?4");
        }
        if filter.machine.is_some() {
            scope.push_str(" AND machine = ?5");
        }
        let sql = format!(
            "SELECT {} FROM keel_dead_letters WHERE id > ?1 AND id < ?2{scope} \
             ORDER BY id {} LIMIT +?3",
            dead_letter_cols!(),
            if backwards { "DESC" } else { "ASC" },
        );
        // The text varies only by fixed fragments chosen above. Every value is bound
        // whether the text uses its `?N` or not; an unused one is never read.
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(filter.after.map_or(0, |a| a.0))
            .bind(filter.before.map_or(i64::MAX, |b| b.0))
            .bind(filter.page_size() as i64)
            .bind(&filter.namespace)
            .bind(&filter.machine)
            .fetch_all(&mut *db.conn)
            .await
            .map_err(db.err("listing dead letters"))?;
        let mut page =
            rows.iter().map(|r| db.dead_letter_of(r)).collect::<StoreResult<Vec<_>>>()?;
        if backwards {
            page.reverse();
        }
        Ok(page)
    }

    async fn dead_letter_counts(
        &self,
        namespace: Option<String>,
    ) -> StoreResult<Vec<keel_core::ports::store::DeadLetterCount>> {
        if let Some(ns) = &namespace {
            keel_core::instance::check_name("namespace", ns)?;
        }
        let mut conn = self.reader().await?;
        let db = Db { conn: &mut conn, file: &self.file };
        // Counted on `keel_dead_letters_machine` (namespace, machine, id) alone.
        let scope = if namespace.is_some() { "WHERE namespace = ?1" } else { "" };
        let sql = format!(
            "SELECT namespace, machine, count(*) AS n FROM keel_dead_letters {scope} \
             GROUP BY namespace, machine ORDER BY namespace, machine"
        );
        // The text varies only by the fixed fragment above; the namespace is bound.
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&namespace)
            .fetch_all(&mut *db.conn)
            .await
            .map_err(db.err("counting dead letters"))?;
        let corrupt =
            |col: &'static str| move |e: sqlx::Error| crate::error::corrupt(&self.file, col, e);
        rows.iter()
            .map(|r| {
                Ok(keel_core::ports::store::DeadLetterCount {
                    namespace: r.try_get("namespace").map_err(corrupt("namespace"))?,
                    machine: r.try_get("machine").map_err(corrupt("machine"))?,
                    count: r.try_get::<i64, _>("n").map_err(corrupt("n"))? as u64,
                })
            })
            .collect()
    }

    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        let mut conn = self.reader().await?;
        Db { conn: &mut conn, file: &self.file }.dead_letter(id).await
    }

    async fn dead_letter_retry(
        &self,
        params: DeadLetterRetryParams,
    ) -> StoreResult<Vec<InstanceId>> {
        let out = write_tx!(self, |db| ops::dead_letter_retry(db, &params))?;
        if !out.is_empty() {
            self.wake();
        }
        Ok(out)
    }

    async fn dead_letter_skip(&self, params: DeadLetterSkipParams) -> StoreResult<InstanceId> {
        let out = write_tx!(self, |db| ops::dead_letter_skip(db, &params))?;
        self.wake();
        Ok(out)
    }

    async fn dead_letter_purge(&self, params: DeadLetterPurgeParams) -> StoreResult<u64> {
        write_tx!(self, |db| ops::dead_letter_purge(db, &params))
    }

    async fn queue_pause(&self, params: QueuePauseParams) -> StoreResult<()> {
        write_tx!(self, |db| ops::queue_pause(db, &params))?;
        if !params.paused {
            self.wake();
        }
        Ok(())
    }

    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>> {
        let mut conn = self.reader().await?;
        // The queues with settings only (a pause recorded them), as the port
        // says; a queue without a row is not paused. The instances are not read.
        let rows =
            sqlx::query("SELECT queue, paused FROM keel_queues WHERE namespace = ? ORDER BY queue")
                .bind(&namespace)
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| map(&self.file, "listing queues", &e))?;
        rows.iter()
            .map(|r| {
                let queue: String = r
                    .try_get("queue")
                    .map_err(|e| crate::error::corrupt(&self.file, "queue", e))?;
                let paused: i64 = r
                    .try_get("paused")
                    .map_err(|e| crate::error::corrupt(&self.file, "paused", e))?;
                Ok(QueueState { namespace: namespace.clone(), queue, paused: paused != 0 })
            })
            .collect()
    }

    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>> {
        let mut conn = self.reader().await?;
        let db = Db { conn: &mut conn, file: &self.file };
        // Counted from the covering index `keel_instances_stats` alone: one count per
        // (namespace, queue, machine, status) group, then for each runnable group two
        // seeks on its eligible times (how many lie after `now`; the earliest not after
        // it). Summing expressions over every row instead costs a full pass of row reads.
        // The namespace is a separate statement, not `? IS NULL OR`, so the scan seeks to
        // it rather than reading every namespace.
        let scope = if namespace.is_some() { "AND namespace = ?2" } else { "" };
        let sql = format!(
            "SELECT g.namespace, g.queue, g.machine, g.status, g.n, \
               CASE WHEN g.status = 'runnable' THEN \
                 (SELECT count(*) FROM keel_instances s WHERE s.namespace = g.namespace \
                    AND s.queue = g.queue AND s.machine = g.machine AND s.status = 'runnable' \
                    AND s.eligible_at > ?1 AND s.status NOT IN ('done', 'failed', 'cancelled')) \
               END AS scheduled, \
               CASE WHEN g.status = 'runnable' THEN \
                 (SELECT min(s.eligible_at) FROM keel_instances s WHERE s.namespace = g.namespace \
                    AND s.queue = g.queue AND s.machine = g.machine AND s.status = 'runnable' \
                    AND s.eligible_at <= ?1 AND s.status NOT IN ('done', 'failed', 'cancelled')) \
               END AS oldest_ready_at \
             FROM (SELECT namespace, queue, machine, status, count(*) AS n FROM keel_instances \
                   WHERE status NOT IN ('done', 'failed', 'cancelled') {scope} \
                   GROUP BY namespace, queue, machine, status) g \
             ORDER BY g.namespace, g.queue, g.machine, g.status"
        );
        // The text varies only by the fixed fragment above; every value is bound.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now.0);
        if let Some(ns) = &namespace {
            query = query.bind(ns);
        }
        let rows = query.fetch_all(&mut *db.conn).await.map_err(db.err("counting queues"))?;
        let corrupt =
            |col: &'static str| move |e: sqlx::Error| crate::error::corrupt(&self.file, col, e);
        let mut out: Vec<QueueStats> = Vec::new();
        for r in &rows {
            let namespace: String = r.try_get("namespace").map_err(corrupt("namespace"))?;
            let queue: String = r.try_get("queue").map_err(corrupt("queue"))?;
            let machine: String = r.try_get("machine").map_err(corrupt("machine"))?;
            let status: String = r.try_get("status").map_err(corrupt("status"))?;
            let n = r.try_get::<i64, _>("n").map_err(corrupt("n"))? as u64;
            let scheduled =
                r.try_get::<Option<i64>, _>("scheduled").map_err(corrupt("scheduled"))?;
            let oldest = r
                .try_get::<Option<i64>, _>("oldest_ready_at")
                .map_err(corrupt("oldest_ready_at"))?;
            let same = out.last().is_some_and(|s: &QueueStats| {
                s.namespace == namespace && s.queue == queue && s.machine == machine
            });
            if !same {
                out.push(QueueStats { namespace, queue, machine, ..QueueStats::default() });
            }
            let Some(stats) = out.last_mut() else { continue };
            match status.as_str() {
                "runnable" => {
                    let later = scheduled.unwrap_or(0) as u64;
                    stats.scheduled = later;
                    stats.ready = n.saturating_sub(later);
                    stats.oldest_ready_at = oldest.map(Timestamp);
                }
                "executing" => stats.executing = n,
                "awaiting_signal" | "awaiting_children" => stats.waiting += n,
                "suspended" => stats.suspended = n,
                other => {
                    return Err(crate::error::corrupt(
                        &self.file,
                        "status",
                        format!("{other:?} is not an unfinished status"),
                    ));
                }
            }
        }
        Ok(out)
    }

    async fn instance_activity(&self, params: ActivityParams) -> StoreResult<Vec<ActivityBucket>> {
        let mut conn = self.reader().await?;
        ops::instance_activity(&mut Db { conn: &mut conn, file: &self.file }, &params).await
    }

    async fn worker_heartbeat(&self, params: WorkerBeatParams) -> StoreResult<()> {
        params.validate()?;
        write_tx!(self, |db| ops::worker_heartbeat(db, &params))
    }

    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<WorkerRecord>> {
        let mut conn = self.reader().await?;
        ops::worker_list(&mut Db { conn: &mut conn, file: &self.file }, seen_since).await
    }

    async fn schedule_pause(
        &self,
        params: keel_core::ports::store::SchedulePauseParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        params.validate()?;
        write_tx!(self, |db| crate::schedules::schedule_pause(db, &params))
    }

    async fn schedule_states(
        &self,
        namespace: String,
    ) -> StoreResult<Vec<keel_core::ports::store::ScheduleState>> {
        let mut conn = self.reader().await?;
        crate::schedules::schedule_states(&mut Db { conn: &mut conn, file: &self.file }, &namespace)
            .await
    }

    async fn schedule_fired(
        &self,
        params: keel_core::ports::store::ScheduleFiredParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        params.validate()?;
        write_tx!(self, |db| crate::schedules::schedule_fired(db, &params))
    }

    async fn schedule_forget(
        &self,
        params: keel_core::ports::store::ScheduleForgetParams,
    ) -> StoreResult<u64> {
        params.validate()?;
        write_tx!(self, |db| crate::schedules::schedule_forget(db, &params))
    }

    async fn timer_sweep(&self, params: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        // Not only a delivered fire makes an instance runnable: an expired join deadline
        // delivers nothing and wakes its parent.
        let (out, woke) = write_tx!(self, |db| ops::timer_sweep(db, &params))?;
        if woke {
            self.wake();
        }
        Ok(out)
    }

    async fn timers_retime(&self, params: TimerRetimeParams) -> StoreResult<TimerRetimePage> {
        // Every start of every worker passes over each machine version's timers, which
        // were moved already after the first: that finds nothing on a read connection and
        // leaves the writer alone.
        params.validate()?;
        let targets = ops::retime_targets(&params)?;
        {
            let mut conn = self.reader().await?;
            let mut db = Db { conn: &mut conn, file: self.file.as_str() };
            if !ops::timers_retime_any(&mut db, &params, &targets).await? {
                // Nothing read is the last page: a page has a next cursor only when it
                // read a full page of timers.
                return Ok(TimerRetimePage { retimed: Vec::new(), next: None });
            }
        }
        let (page, earliest) = write_tx!(self, |db| ops::timers_retime(db, &params, &targets))?;
        self.hint_timers(earliest);
        Ok(page)
    }

    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        let mut conn = self.reader().await?;
        let db = Db { conn: &mut conn, file: &self.file };
        let rows = sqlx::query(
            "SELECT t.namespace, t.machine, t.armed, t.next_due, t.overdue, \
               (SELECT MAX(s.swept_at) FROM keel_timer_sweeps s \
                 WHERE s.namespace IN (t.namespace, '*') AND s.machine IN (t.machine, '*')) \
                 AS last_sweep_at \
             FROM (SELECT namespace, machine, COUNT(*) AS armed, MIN(next_fire_at) AS next_due, \
                     SUM(next_fire_at <= ?) AS overdue \
                   FROM keel_timers WHERE (? IS NULL OR namespace = ?) \
                   GROUP BY namespace, machine) t \
             ORDER BY t.namespace, t.machine",
        )
        .bind(now.0)
        .bind(&namespace)
        .bind(&namespace)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("reading timer status"))?;
        let corrupt =
            |col: &'static str| move |e: sqlx::Error| crate::error::corrupt(&self.file, col, e);
        rows.iter()
            .map(|r| {
                Ok(TimerStatus {
                    namespace: r.try_get("namespace").map_err(corrupt("namespace"))?,
                    machine: r.try_get("machine").map_err(corrupt("machine"))?,
                    armed: r.try_get::<i64, _>("armed").map_err(corrupt("armed"))? as u64,
                    next_due: r
                        .try_get::<Option<i64>, _>("next_due")
                        .map_err(corrupt("next_due"))?
                        .map(Timestamp),
                    overdue: r.try_get::<i64, _>("overdue").map_err(corrupt("overdue"))? as u64,
                    last_sweep_at: r
                        .try_get::<Option<i64>, _>("last_sweep_at")
                        .map_err(corrupt("last_sweep_at"))?
                        .map(Timestamp),
                })
            })
            .collect()
    }

    async fn ready_wait(&self) {
        self.ready.notified().await;
    }

    async fn instance_change_wait(&self) {
        self.changed.notified().await;
    }

    async fn timer_next_due(&self, params: TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        let mut conn = self.reader().await?;
        let mut db = Db { conn: &mut conn, file: &self.file };
        ops::timer_next_due(&mut db, &params).await
    }

    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        loop {
            // Registered before the log is read, so a hint pushed in between still wakes us.
            let notified = self.hinted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let news =
                self.hints.lock().unwrap_or_else(std::sync::PoisonError::into_inner).since(seen);
            if let Some(hint) = news {
                return hint;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::migrator;

    /// Every file under `migrations/` is applied, in the order its number gives, with the SQL
    /// the file holds: the store lists its migrations by hand, and a file left off the list
    /// would never reach a user's database.
    #[test]
    fn the_migrator_lists_every_migration_file() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files: Vec<(i64, String, String)> = std::fs::read_dir(&dir)
            .expect("read the migrations directory")
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
            .map(|path| {
                let name = path.file_stem().unwrap().to_string_lossy().into_owned();
                let (number, rest) = name.split_once('_').expect("files are named NNNN_name.sql");
                let version = number.parse().expect("a file name starts with its version");
                let sql = std::fs::read_to_string(&path).expect("read a migration file");
                (version, rest.replace('_', " "), sql)
            })
            .collect();
        files.sort();
        let listed: Vec<(i64, String, String)> = migrator()
            .iter()
            .map(|m| (m.version, m.description.to_string(), m.sql.as_str().to_owned()))
            .collect();
        let names = |v: &[(i64, String, String)]| {
            v.iter().map(|(n, d, _)| format!("{n:04} {d}")).collect::<Vec<_>>()
        };
        assert_eq!(
            names(&listed),
            names(&files),
            "migrator() and the files under {} differ",
            dir.display()
        );
        assert!(listed == files, "a listed migration embeds SQL other than its file's");
    }
}
