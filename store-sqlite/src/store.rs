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
use keel_core::plan::commit;
use keel_core::ports::Store;
use keel_core::ports::store::{
    ActivityBucket, ActivityParams, BroadcastReport, CancelParams, Claim, ClaimParams,
    CommitParams, CommitReceipt, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSkipParams, DeliveryOutcome, InsertOutcome, InsertParams, InstanceDetail,
    InstanceListParams, LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, MigratePage,
    MigrateParams, PrunePage, PruneParams, QueuePauseParams, QueueState, QueueStats,
    ReadyStaleParams, SignalBroadcastParams, SignalDeliverParams, StoreCapabilities,
    TimerNextDueParams, TimerRetimePage, TimerRetimeParams, TimerStatus, TimerSweepParams,
    TimerSweepReport, WorkerBeatParams, WorkerRecord,
};
use keel_core::timers::{TimerHint, TimerHints};
use keel_core::{
    DeadLetterId, ErrorKind, InstanceId, SignalTarget, Status, StoreResult, Timestamp,
};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteRow;
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
fn migrator() -> Migrator {
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
        migration(7, "fair claims", include_str!("../migrations/0007_fair_claims.sql")),
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
            Err(e) => {
                tx.rollback().await.map_err(|e| map(file, "rolling back", &e))?;
                Err(e)
            }
        }
    }};
}

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
            .foreign_keys(true);
        let mut writer = SqliteConnection::connect_with(&options)
            .await
            .map_err(|e| map(&file, "opening", &e))?;
        migrator()
            .run(&mut writer)
            .await
            .map_err(|e| map(&file, "migrating", &sqlx::Error::Migrate(Box::new(e))))?;
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
        let out = write_tx!(self, |db| async {
            let mut out = Vec::with_capacity(params.commits.len());
            for c in &params.commits {
                match ops::commit_item(db, c, params.now).await {
                    Err(e) if e.kind == ErrorKind::Unavailable => return Err(e),
                    item => out.push(item),
                }
            }
            StoreResult::Ok(out)
        })?;
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
            inbox: db.inbox(id, ops::WHOLE_INBOX).await?,
            children: db.children(id).await?,
            history: db.history(id).await?,
            timers: db.timers(id, limits::TIMER_LIST_MAX).await?,
            instance,
        };
        // One snapshot for the row and its inbox, children and history; nothing to keep.
        tx.rollback().await.map_err(|e| map(file, "ending a read", &e))?;
        Ok(detail)
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
        // One statement for every filter: an unset filter is a NULL that lets every row pass.
        let rows = sqlx::query(concat!(
            "SELECT ",
            instance_cols!(),
            " FROM keel_instances \
             WHERE namespace = ? AND (? IS NULL OR machine = ?) AND (? IS NULL OR status = ?) \
               AND (? IS NULL OR business_key = ?) AND (? IS NULL OR id < ?) \
               AND (? IS NULL OR position = ? OR (substr(position, 1, 1) = '[' \
                    AND json_valid(position) \
                    AND EXISTS (SELECT 1 FROM json_each(position) WHERE value = ?))) \
             ORDER BY id DESC LIMIT ?"
        ))
        .bind(&params.namespace)
        .bind(&params.machine)
        .bind(&params.machine)
        .bind(params.status.map(Status::name))
        .bind(params.status.map(Status::name))
        .bind(&params.business_key)
        .bind(&params.business_key)
        .bind(params.before.map(|b| b.0))
        .bind(params.before.map(|b| b.0))
        .bind(&params.state)
        .bind(&params.state)
        .bind(&params.state)
        .bind(params.limit as i64)
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
        let limit = match filter.limit {
            0 => limits::DEAD_LETTER_BATCH_MAX,
            n => n.min(limits::DEAD_LETTER_BATCH_MAX),
        };
        let mut conn = self.reader().await?;
        let db = Db { conn: &mut conn, file: &self.file };
        let rows = sqlx::query(concat!(
            "SELECT ",
            dead_letter_cols!(),
            " FROM keel_dead_letters \
             WHERE (? IS NULL OR namespace = ?) AND (? IS NULL OR machine = ?) \
             ORDER BY id LIMIT ?"
        ))
        .bind(&filter.namespace)
        .bind(&filter.namespace)
        .bind(&filter.machine)
        .bind(&filter.machine)
        .bind(limit as i64)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("listing dead letters"))?;
        rows.iter().map(|r| db.dead_letter_of(r)).collect()
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
        let rows = sqlx::query(
            "SELECT queue, MAX(paused) AS paused FROM ( \
               SELECT DISTINCT queue, 0 AS paused FROM keel_instances WHERE namespace = ? \
               UNION ALL SELECT queue, paused FROM keel_queues WHERE namespace = ? \
             ) GROUP BY queue ORDER BY queue",
        )
        .bind(&namespace)
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
        let rows = sqlx::query(
            "SELECT namespace, queue, machine, \
               SUM(status = 'runnable' AND eligible_at <= ?) AS ready, \
               SUM(status = 'runnable' AND eligible_at > ?) AS scheduled, \
               SUM(status = 'executing') AS executing, \
               SUM(status IN ('awaiting_signal', 'awaiting_children')) AS waiting, \
               SUM(status = 'suspended') AS suspended, \
               MIN(CASE WHEN status = 'runnable' AND eligible_at <= ? THEN eligible_at END) \
                 AS oldest_ready_at \
             FROM keel_instances \
             WHERE status NOT IN ('done', 'failed', 'cancelled') \
               AND (? IS NULL OR namespace = ?) \
             GROUP BY namespace, queue, machine ORDER BY namespace, queue, machine",
        )
        .bind(now.0)
        .bind(now.0)
        .bind(now.0)
        .bind(&namespace)
        .bind(&namespace)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("counting queues"))?;
        let get = |r: &SqliteRow, col: &str| -> StoreResult<i64> {
            r.try_get(col).map_err(|e| crate::error::corrupt(&self.file, col, e))
        };
        let text = |r: &SqliteRow, col: &str| -> StoreResult<String> {
            r.try_get(col).map_err(|e| crate::error::corrupt(&self.file, col, e))
        };
        rows.iter()
            .map(|r| {
                let oldest: Option<i64> = r
                    .try_get("oldest_ready_at")
                    .map_err(|e| crate::error::corrupt(&self.file, "oldest_ready_at", e))?;
                Ok(QueueStats {
                    namespace: text(r, "namespace")?,
                    queue: text(r, "queue")?,
                    machine: text(r, "machine")?,
                    ready: get(r, "ready")? as u64,
                    scheduled: get(r, "scheduled")? as u64,
                    executing: get(r, "executing")? as u64,
                    waiting: get(r, "waiting")? as u64,
                    suspended: get(r, "suspended")? as u64,
                    oldest_ready_at: oldest.map(Timestamp),
                })
            })
            .collect()
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

    async fn timer_sweep(&self, params: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        let out = write_tx!(self, |db| ops::timer_sweep(db, &params))?;
        if out.fired + out.exhausted > 0 {
            self.wake();
        }
        Ok(out)
    }

    async fn timers_retime(&self, params: TimerRetimeParams) -> StoreResult<TimerRetimePage> {
        let (page, earliest) = write_tx!(self, |db| ops::timers_retime(db, &params))?;
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
