//! The SQL side of the logical rows: column lists, decoding rows into the core's types,
//! and the few primitive reads and writes every operation is built from.
//!
//! Every function here runs on a connection that is already inside a transaction (or, for
//! the read-only helpers, on any connection); none of them commits.
//!
//! A row limit is bound as `LIMIT +?`, never as a bare parameter: SQLite plans with the
//! value bound to a bare limit parameter and so throws the prepared statement away and
//! prepares it again each time the limit is bound (about half a millisecond for a claim
//! page statement). Written as an expression, the limit is read when the statement runs,
//! and the statement stays prepared.

use crate::error::{corrupt, map};
use keel_core::instance::{
    AttemptError, ChildSummary, DeadLetter, HistoryEntry, HistoryRecord, NewDeadLetter, UniqueSpec,
    undecodable, undecodable_error,
};
use keel_core::limits;
use keel_core::plan::cancel::LeftDelegations;
use keel_core::timers::TimerRow;
use keel_core::{
    DeadLetterId, FencingToken, Instance, InstanceId, MachineRef, Priority, Revision, Signal,
    SignalId, SignalTarget, Status, StatusSet, StoreError, StoreResult, TimerId, Timestamp,
    WorkerId,
};
use serde_json::Value;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};
use std::collections::HashMap;
use std::fmt::Write as _;

/// The instance columns, in the order [`Db::instance_bind`] binds them (after `id`).
macro_rules! instance_cols {
    () => {
        "id, namespace, machine, machine_version, business_key, queue, priority, \
         concurrency_key, status, position, context, result, awaits, last_error, attempt, \
         errors, revision, eligible_at, lease_owner, lease_expires_at, fencing_token, \
         parent_id, children_pending, unique_key, unique_scope, correlation_id, created_at, \
         updated_at, unique_guard, invoked_by, base_priority"
    };
}
pub(crate) use instance_cols;

/// The signal columns.
macro_rules! signal_cols {
    () => {
        "id, target_id, name, payload, dedup_key, inserted_at, priority"
    };
}

/// The first signals of each of a JSON array of instances' inboxes (at most the second
/// parameter each), oldest first per instance: for each instance, a walk of the inbox
/// index that stops at the bound, so a long inbox costs no more than a short one.
pub(crate) const INBOXES_SQL: &str = concat!(
    "SELECT ",
    signal_cols!(),
    " FROM (SELECT value AS target FROM json_each(?)) t \
     JOIN keel_signals s ON s.id IN (SELECT x.id FROM keel_signals x WHERE x.target_id = t.target \
                                     ORDER BY x.id LIMIT +?) \
     ORDER BY s.target_id, s.id"
);

/// The first children of each of a JSON array of parents (at most the second parameter
/// each), oldest first per parent, each parent's read stopping at the bound.
pub(crate) const CHILDREN_OF_SQL: &str = concat!(
    "SELECT ",
    instance_cols!(),
    " FROM (SELECT value AS parent FROM json_each(?)) p \
     JOIN keel_instances c ON c.id IN (SELECT y.id FROM keel_instances y WHERE y.parent_id = p.parent \
                                       ORDER BY y.id LIMIT +?) \
     ORDER BY c.parent_id, c.id"
);

/// The dead-letter columns.
macro_rules! dead_letter_cols {
    () => {
        "id, instance_id, namespace, machine, machine_version, position, signals, event, \
         correlation_id, reason, attempts, errors, first_attempt_at, last_attempt_at, created_at"
    };
}
pub(crate) use dead_letter_cols;

/// The timer columns.
macro_rules! timer_cols {
    () => {
        "id, instance_id, namespace, machine, machine_version, spec, next_fire_at, fire_count, \
         armed_at"
    };
}
pub(crate) use timer_cols;

/// The bit mask of a status set: bit `i` is `Status::ALL[i]`.
pub(crate) fn scope_mask(set: StatusSet) -> i64 {
    Status::ALL
        .iter()
        .enumerate()
        .filter(|(_, s)| set.contains(**s))
        .fold(0, |m, (i, _)| m | 1 << i)
}

fn scope_of(mask: i64) -> StatusSet {
    let statuses: Vec<Status> = Status::ALL
        .iter()
        .enumerate()
        .filter(|(i, _)| mask >> i & 1 == 1)
        .map(|(_, s)| *s)
        .collect();
    StatusSet::of(&statuses)
}

/// A list of ids as the JSON array a `json_each(?)` parameter reads (integers only, so
/// serializing cannot fail).
pub(crate) fn ids_json(ids: impl IntoIterator<Item = i64>) -> String {
    serde_json::to_string(&ids.into_iter().collect::<Vec<i64>>()).unwrap_or_else(|_| "[]".into())
}

fn json_text(v: &Value) -> String {
    // Serializing a `Value` cannot fail: its map keys are strings.
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned())
}

/// The statement of [`Db::live_descendants`]: the walk (`d`), the kept ids cut in the
/// walk's order (`kept`), then the kept rows in full.
const LIVE_DESCENDANTS_SQL: &str = concat!(
    "WITH RECURSIVE d (id, depth, path) AS ( \
       SELECT id, 1, printf('%020d', id) FROM keel_instances WHERE parent_id = ? \
       UNION ALL \
       SELECT i.id, d.depth + 1, d.path || printf('%020d', i.id) \
       FROM d JOIN keel_instances i ON i.parent_id = d.id WHERE d.depth < ? \
     ), kept AS ( \
       SELECT d.id, d.depth, d.path FROM d JOIN keel_instances s ON s.id = d.id \
       WHERE s.status NOT IN ('done', 'failed', 'cancelled') \
       ORDER BY d.depth, d.path LIMIT +? \
     ) SELECT ",
    instance_cols!(),
    ", kept.depth AS depth FROM kept JOIN keel_instances USING (id) \
     ORDER BY kept.depth, kept.path"
);

/// A connection inside a transaction, and the file it belongs to (for error messages).
pub(crate) struct Db<'c> {
    /// The connection.
    pub conn: &'c mut SqliteConnection,
    /// The database file, as the user named it.
    pub file: &'c str,
}

impl Db<'_> {
    /// Maps a driver error, naming the file and what was being done.
    pub fn err(&self, during: &'static str) -> impl Fn(sqlx::Error) -> StoreError + '_ {
        move |e| map(self.file, during, &e)
    }

    fn get<'r, T>(&self, row: &'r SqliteRow, col: &str) -> StoreResult<T>
    where
        T: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
    {
        row.try_get(col).map_err(|e| corrupt(self.file, col, e))
    }

    fn json<T: serde::de::DeserializeOwned>(&self, col: &str, text: &str) -> StoreResult<T> {
        serde_json::from_str(text).map_err(|e| corrupt(self.file, col, e))
    }

    fn json_opt(&self, row: &SqliteRow, col: &str) -> StoreResult<Option<Value>> {
        let text: Option<String> = self.get(row, col)?;
        text.map(|t| self.json(col, &t)).transpose()
    }

    /// A JSON column decoded leniently: text no JSON reader accepts (nested too deep, say)
    /// becomes an `undecodable` marker naming the error, so the row can still be shown,
    /// cancelled or dead-lettered. [`Db::instance_write`] keeps the stored text where it
    /// finds a marker.
    fn json_lenient(col: &str, text: &str) -> Value {
        serde_json::from_str(text).unwrap_or_else(|e| undecodable(col, &e.to_string()))
    }

    // ----- decoding ---------------------------------------------------------------------

    /// Decodes an instance row selected with [`instance_cols`].
    pub fn instance_of(&self, row: &SqliteRow) -> StoreResult<Instance> {
        let status: String = self.get(row, "status")?;
        let status = status.parse::<Status>().map_err(|e| corrupt(self.file, "status", e))?;
        let priority: i64 = self.get(row, "priority")?;
        let priority = Priority::from_level(priority as i16)
            .ok_or_else(|| corrupt(self.file, "priority", priority))?;
        let base: i64 = self.get(row, "base_priority")?;
        let base_priority = Priority::from_level(base as i16)
            .ok_or_else(|| corrupt(self.file, "base_priority", base))?;
        let unique_key: Option<Vec<u8>> = self.get(row, "unique_key")?;
        let unique_scope: Option<i64> = self.get(row, "unique_scope")?;
        let context: String = self.get(row, "context")?;
        let errors: String = self.get(row, "errors")?;
        Ok(Instance {
            id: InstanceId(self.get(row, "id")?),
            namespace: self.get(row, "namespace")?,
            machine: MachineRef {
                name: self.get(row, "machine")?,
                version: self.get(row, "machine_version")?,
            },
            business_key: self.get(row, "business_key")?,
            queue: self.get(row, "queue")?,
            priority,
            base_priority,
            concurrency_key: self.get(row, "concurrency_key")?,
            status,
            position: self.get(row, "position")?,
            context: Self::json_lenient("context", &context),
            result: self
                .get::<Option<String>>(row, "result")?
                .map(|t| Self::json_lenient("result", &t)),
            awaits: self.get(row, "awaits")?,
            last_error: self.get(row, "last_error")?,
            attempt: self.get(row, "attempt")?,
            // Keel alone writes the errors list; if it cannot be read, showing none keeps
            // the row usable (the next write replaces it).
            errors: serde_json::from_str::<Vec<AttemptError>>(&errors).unwrap_or_default(),
            revision: Revision(self.get(row, "revision")?),
            eligible_at: Timestamp(self.get(row, "eligible_at")?),
            lease_owner: self.get::<Option<String>>(row, "lease_owner")?.map(WorkerId),
            lease_expires_at: self.get::<Option<i64>>(row, "lease_expires_at")?.map(Timestamp),
            fencing_token: FencingToken(self.get(row, "fencing_token")?),
            parent: self.get::<Option<i64>>(row, "parent_id")?.map(InstanceId),
            children_pending: self.get(row, "children_pending")?,
            unique: unique_key
                .map(|key| UniqueSpec { key, scope: scope_of(unique_scope.unwrap_or(0)) }),
            invoked_by: self.get(row, "invoked_by")?,
            correlation_id: self.get(row, "correlation_id")?,
            created_at: Timestamp(self.get(row, "created_at")?),
            updated_at: Timestamp(self.get(row, "updated_at")?),
        })
    }

    fn signal_of(&self, row: &SqliteRow) -> StoreResult<Signal> {
        let payload: String = self.get(row, "payload")?;
        Ok(Signal {
            id: SignalId(self.get(row, "id")?),
            target: InstanceId(self.get(row, "target_id")?),
            name: self.get(row, "name")?,
            payload: Self::json_lenient("payload", &payload),
            dedup_key: self.get(row, "dedup_key")?,
            priority: self
                .get::<Option<i64>>(row, "priority")?
                .map(|p| {
                    Priority::from_level(p as i16).ok_or_else(|| corrupt(self.file, "priority", p))
                })
                .transpose()?,
            inserted_at: Timestamp(self.get(row, "inserted_at")?),
        })
    }

    /// Decodes a dead letter selected with [`dead_letter_cols`].
    pub fn dead_letter_of(&self, row: &SqliteRow) -> StoreResult<DeadLetter> {
        let signals: String = self.get(row, "signals")?;
        let errors: String = self.get(row, "errors")?;
        Ok(DeadLetter {
            id: DeadLetterId(self.get(row, "id")?),
            created_at: Timestamp(self.get(row, "created_at")?),
            letter: NewDeadLetter {
                instance: InstanceId(self.get(row, "instance_id")?),
                namespace: self.get(row, "namespace")?,
                machine: MachineRef {
                    name: self.get(row, "machine")?,
                    version: self.get(row, "machine_version")?,
                },
                position: self.get(row, "position")?,
                signals: self.json("signals", &signals)?,
                event: self.json_opt(row, "event")?,
                correlation_id: self.get(row, "correlation_id")?,
                reason: self.get(row, "reason")?,
                attempts: self.get(row, "attempts")?,
                errors: self.json("errors", &errors)?,
                first_attempt_at: Timestamp(self.get(row, "first_attempt_at")?),
                last_attempt_at: Timestamp(self.get(row, "last_attempt_at")?),
            },
        })
    }

    /// Decodes a timer row selected with [`timer_cols`].
    pub fn timer_of(&self, row: &SqliteRow) -> StoreResult<TimerRow> {
        let spec: String = self.get(row, "spec")?;
        Ok(TimerRow {
            id: TimerId(self.get(row, "id")?),
            instance: InstanceId(self.get(row, "instance_id")?),
            namespace: self.get(row, "namespace")?,
            machine: MachineRef {
                name: self.get(row, "machine")?,
                version: self.get(row, "machine_version")?,
            },
            spec: self.json("spec", &spec)?,
            next_fire_at: Timestamp(self.get(row, "next_fire_at")?),
            fire_count: self.get(row, "fire_count")?,
            armed_at: Timestamp(self.get(row, "armed_at")?),
        })
    }

    // ----- instance reads ---------------------------------------------------------------

    /// The row of `id`, if it exists.
    pub async fn instance(&mut self, id: InstanceId) -> StoreResult<Option<Instance>> {
        let row =
            sqlx::query(concat!("SELECT ", instance_cols!(), " FROM keel_instances WHERE id = ?"))
                .bind(id.0)
                .fetch_optional(&mut *self.conn)
                .await
                .map_err(self.err("reading an instance"))?;
        row.map(|r| self.instance_of(&r)).transpose()
    }

    /// The rows of `ids` that exist, in id order (one statement; ids as a JSON array).
    pub async fn instances(&mut self, ids: &[InstanceId]) -> StoreResult<Vec<Instance>> {
        let ids = ids_json(ids.iter().map(|id| id.0));
        let rows = sqlx::query(concat!(
            "SELECT ",
            instance_cols!(),
            " FROM keel_instances WHERE id IN (SELECT value FROM json_each(?)) ORDER BY id"
        ))
        .bind(ids)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading instances"))?;
        rows.iter().map(|r| self.instance_of(r)).collect()
    }

    /// The row of `id`, or `NotFound`.
    pub async fn instance_required(&mut self, id: InstanceId) -> StoreResult<Instance> {
        self.instance(id)
            .await?
            .ok_or_else(|| StoreError::not_found(format!("instance {id} does not exist")))
    }

    /// Resolves a signal target to an existing instance.
    pub async fn resolve(&mut self, target: &SignalTarget) -> StoreResult<Option<InstanceId>> {
        let id: Option<i64> = match target {
            SignalTarget::Id(id) => {
                sqlx::query_scalar("SELECT id FROM keel_instances WHERE id = ?")
                    .bind(id.0)
                    .fetch_optional(&mut *self.conn)
                    .await
                    .map_err(self.err("resolving a signal target"))?
            }
            SignalTarget::Key { namespace, machine, key } => sqlx::query_scalar(
                "SELECT id FROM keel_instances WHERE namespace = ? AND machine = ? \
                 AND business_key = ? ORDER BY id DESC LIMIT 1",
            )
            .bind(namespace)
            .bind(machine)
            .bind(key)
            .fetch_optional(&mut *self.conn)
            .await
            .map_err(self.err("resolving a business key"))?,
            SignalTarget::Child { parent, state } => sqlx::query_scalar(
                "SELECT id FROM keel_instances WHERE parent_id = ? AND invoked_by = ? \
                 ORDER BY id DESC LIMIT 1",
            )
            .bind(parent.0)
            .bind(state)
            .fetch_optional(&mut *self.conn)
            .await
            .map_err(self.err("resolving a delegated child"))?,
        };
        Ok(id.map(InstanceId))
    }

    /// The instance holding the unique `guard`, other than `me`.
    pub async fn occupant(
        &mut self,
        guard: &[u8],
        me: InstanceId,
    ) -> StoreResult<Option<InstanceId>> {
        let id: Option<i64> =
            sqlx::query_scalar("SELECT id FROM keel_instances WHERE unique_guard = ? AND id <> ?")
                .bind(guard)
                .bind(me.0)
                .fetch_optional(&mut *self.conn)
                .await
                .map_err(self.err("checking a unique key"))?;
        Ok(id.map(InstanceId))
    }

    /// The oldest `limit` signals in the inbox of `id`, in arrival order.
    pub async fn inbox(&mut self, id: InstanceId, limit: usize) -> StoreResult<Vec<Signal>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            signal_cols!(),
            " FROM keel_signals WHERE target_id = ? ORDER BY id LIMIT +?"
        ))
        .bind(id.0)
        .bind(limit as i64)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading an inbox"))?;
        rows.iter().map(|r| self.signal_of(r)).collect()
    }

    /// Summaries of the children of `id`, oldest first, bounded.
    pub async fn children(&mut self, id: InstanceId) -> StoreResult<Vec<ChildSummary>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            instance_cols!(),
            " FROM keel_instances WHERE parent_id = ? ORDER BY id LIMIT +?"
        ))
        .bind(id.0)
        .bind(limits::CHILDREN_LIST_MAX as i64)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading children"))?;
        rows.iter().map(|r| self.instance_of(r).map(|c| ChildSummary::of(&c))).collect()
    }

    /// The inboxes of `ids` (each oldest first, at most `limit` signals), in one query.
    /// Each inbox is read by its index up to the bound, whatever its length.
    pub async fn inboxes(
        &mut self,
        ids: &[InstanceId],
        limit: usize,
    ) -> StoreResult<HashMap<InstanceId, Vec<Signal>>> {
        let mut out: HashMap<InstanceId, Vec<Signal>> = HashMap::new();
        if ids.is_empty() {
            return Ok(out);
        }
        let ids_json = ids_json(ids.iter().map(|i| i.0));
        let rows = sqlx::query(INBOXES_SQL)
            .bind(ids_json)
            .bind(limit as i64)
            .fetch_all(&mut *self.conn)
            .await
            .map_err(self.err("reading inboxes"))?;
        for r in &rows {
            let signal = self.signal_of(r)?;
            out.entry(signal.target).or_default().push(signal);
        }
        Ok(out)
    }

    /// Summaries of the children of each of `ids` (oldest first, bounded), in one query.
    pub async fn children_of(
        &mut self,
        ids: &[InstanceId],
    ) -> StoreResult<HashMap<InstanceId, Vec<ChildSummary>>> {
        let mut out: HashMap<InstanceId, Vec<ChildSummary>> = HashMap::new();
        if ids.is_empty() {
            return Ok(out);
        }
        let ids_json = ids_json(ids.iter().map(|i| i.0));
        let rows = sqlx::query(CHILDREN_OF_SQL)
            .bind(ids_json)
            .bind(limits::CHILDREN_LIST_MAX as i64)
            .fetch_all(&mut *self.conn)
            .await
            .map_err(self.err("reading children"))?;
        for r in &rows {
            let child = self.instance_of(r)?;
            if let Some(parent) = child.parent {
                out.entry(parent).or_default().push(ChildSummary::of(&child));
            }
        }
        Ok(out)
    }

    /// The live descendants of `id` for a cascading cancel, each with its depth below it
    /// (children are at depth 1), in one statement: breadth first, a parent's children in
    /// id order after those of the parents before it (the order of a walk that queues each
    /// level's children), down to `depth_max` levels and at most `max` rows. Ended
    /// descendants are walked through, so a live grandchild of an ended child is found,
    /// but not returned. The walk's key is each row's path of zero-padded ids from `id`,
    /// whose text order is that walk's order within a level.
    ///
    /// The order and the cut use only each descendant's id, depth, path and status (a
    /// sort that keeps at most `max` entries); only the kept rows are read in full. The
    /// walk itself is bounded by `depth_max` alone, like the walk it replaced over ended
    /// descendants: a limit on walked rows would count ended descendants too, so a tree
    /// with many ended children would lose live descendants that walk cancelled. A tree
    /// with more live descendants than `max` thus has the id and status of each read, but
    /// no more than `max` rows decoded.
    pub async fn live_descendants(
        &mut self,
        id: InstanceId,
        depth_max: usize,
        max: usize,
    ) -> StoreResult<Vec<(Instance, usize)>> {
        let rows = sqlx::query(LIVE_DESCENDANTS_SQL)
            .bind(id.0)
            .bind(depth_max as i64)
            .bind(max as i64)
            .fetch_all(&mut *self.conn)
            .await
            .map_err(self.err("reading descendants"))?;
        rows.iter()
            .map(|r| {
                let depth: i64 = self.get(r, "depth")?;
                Ok((self.instance_of(r)?, depth as usize))
            })
            .collect()
    }

    /// The live children of `id` started from a delegation state that `left` names (any
    /// delegation state for [`LeftDelegations::All`]), at most
    /// [`limits::CHILDREN_PER_STEP_MAX`], so the children of states the commit keeps do
    /// not use up the bound; the caller checks each with [`LeftDelegations::covers`].
    pub async fn delegated_children(
        &mut self,
        id: InstanceId,
        left: &LeftDelegations,
    ) -> StoreResult<Vec<InstanceId>> {
        let (states, started) = match left {
            LeftDelegations::None => return Ok(Vec::new()),
            LeftDelegations::All => (None, "[]".to_owned()),
            LeftDelegations::States { left, started } => (
                Some(serde_json::json!(left).to_string()),
                serde_json::json!(started.iter().map(|id| id.0).collect::<Vec<_>>()).to_string(),
            ),
        };
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM keel_instances WHERE parent_id = ?1 AND invoked_by IS NOT NULL \
               AND status NOT IN ('done', 'failed', 'cancelled') \
               AND (?2 IS NULL OR invoked_by IN (SELECT value FROM json_each(?2))) \
               AND id NOT IN (SELECT value FROM json_each(?4)) \
             ORDER BY id LIMIT +?3",
        )
        .bind(id.0)
        .bind(states)
        .bind(limits::CHILDREN_PER_STEP_MAX as i64)
        .bind(started)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading delegated children"))?;
        Ok(ids.into_iter().map(InstanceId).collect())
    }

    /// The newest [`limits::HISTORY_LIST_MAX`] history rows of `id`, oldest first.
    pub async fn history(&mut self, id: InstanceId) -> StoreResult<Vec<HistoryRecord>> {
        let rows = sqlx::query(
            "SELECT seq, instance_id, at, revision, attempt, kind, data FROM ( \
               SELECT * FROM keel_history WHERE instance_id = ? ORDER BY seq DESC LIMIT +? \
             ) ORDER BY seq",
        )
        .bind(id.0)
        .bind(limits::HISTORY_LIST_MAX as i64)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading history"))?;
        rows.iter().map(|r| self.history_record(r)).collect()
    }

    /// Up to `limit` history rows of `id` numbered below `before`, newest first.
    pub async fn history_before(
        &mut self,
        id: InstanceId,
        before: Option<i64>,
        limit: usize,
    ) -> StoreResult<Vec<HistoryRecord>> {
        let rows = sqlx::query(
            "SELECT seq, instance_id, at, revision, attempt, kind, data FROM keel_history \
             WHERE instance_id = ? AND seq < ? ORDER BY seq DESC LIMIT +?",
        )
        .bind(id.0)
        .bind(before.unwrap_or(i64::MAX))
        .bind(limit as i64)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading a page of history"))?;
        rows.iter().map(|r| self.history_record(r)).collect()
    }

    fn history_record(&self, r: &SqliteRow) -> StoreResult<HistoryRecord> {
        let data: String = self.get(r, "data")?;
        Ok(HistoryRecord {
            instance: InstanceId(self.get(r, "instance_id")?),
            seq: self.get(r, "seq")?,
            at: Timestamp(self.get(r, "at")?),
            revision: Revision(self.get(r, "revision")?),
            attempt: self.get(r, "attempt")?,
            entry: HistoryEntry {
                kind: self.get(r, "kind")?,
                data: Self::json_lenient("data", &data),
            },
        })
    }

    // ----- instance writes --------------------------------------------------------------

    /// The guard value to store for `row`: its key while in scope, unless another instance
    /// already holds that key (the first occupant keeps it, as in `MemoryStore`).
    pub async fn guard_for(&mut self, row: &Instance) -> StoreResult<Option<Vec<u8>>> {
        let Some(guard) = row.unique_guard() else { return Ok(None) };
        Ok(match self.occupant(guard, row.id).await? {
            Some(_) => None,
            None => Some(guard.to_vec()),
        })
    }

    /// Inserts a new row; the database assigns its id, which is returned.
    pub async fn instance_insert(&mut self, row: &Instance) -> StoreResult<InstanceId> {
        let guard = self.guard_for(row).await?;
        let q = sqlx::query(concat!(
            "INSERT INTO keel_instances (",
            instance_cols!(),
            ") VALUES (NULL, ",
            "?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?",
            ") RETURNING id"
        ));
        let json = (json_text(&row.context), row.result.as_ref().map(json_text));
        let id: i64 = bind_instance(q, row, json, guard)
            .fetch_one(&mut *self.conn)
            .await
            .map_err(self.err("inserting an instance"))?
            .try_get("id")
            .map_err(|e| corrupt(self.file, "id", e))?;
        Ok(InstanceId(id))
    }

    /// The context and result text to write for `row`: its values, except that a column
    /// read as an `undecodable` marker keeps the text stored now, so nothing stored is lost.
    async fn json_columns(&mut self, row: &Instance) -> StoreResult<(String, Option<String>)> {
        let context = json_text(&row.context);
        let result = row.result.as_ref().map(json_text);
        if row.damage().is_none() {
            return Ok((context, result));
        }
        let (stored_context, stored_result): (String, Option<String>) =
            sqlx::query_as("SELECT context, result FROM keel_instances WHERE id = ?")
                .bind(row.id.0)
                .fetch_one(&mut *self.conn)
                .await
                .map_err(self.err("reading stored JSON"))?;
        let keep_result = row.result.as_ref().and_then(undecodable_error).is_some();
        Ok((
            if undecodable_error(&row.context).is_some() { stored_context } else { context },
            if keep_result { stored_result } else { result },
        ))
    }

    /// Writes every column of an existing row.
    pub async fn instance_write(&mut self, row: &Instance) -> StoreResult<()> {
        let guard = self.guard_for(row).await?;
        let q = sqlx::query(
            "UPDATE keel_instances SET namespace = ?, machine = ?, machine_version = ?, \
             business_key = ?, queue = ?, priority = ?, concurrency_key = ?, status = ?, \
             position = ?, context = ?, result = ?, awaits = ?, last_error = ?, attempt = ?, \
             errors = ?, revision = ?, eligible_at = ?, lease_owner = ?, lease_expires_at = ?, \
             fencing_token = ?, parent_id = ?, children_pending = ?, unique_key = ?, \
             unique_scope = ?, correlation_id = ?, created_at = ?, updated_at = ?, \
             unique_guard = ?, invoked_by = ?, base_priority = ? WHERE id = ?",
        );
        let json = self.json_columns(row).await?;
        bind_instance(q, row, json, guard)
            .bind(row.id.0)
            .execute(&mut *self.conn)
            .await
            .map_err(self.err("writing an instance"))?;
        Ok(())
    }

    /// Writes the columns of `after` that differ from `before`, the row as this
    /// transaction read it, and nothing when none does (see [`Writes::instance_update`]).
    /// The unique-key guard of a row with a unique key is decided again on every write,
    /// as [`Db::instance_write`] does.
    pub async fn instance_update(
        &mut self,
        before: &Instance,
        after: &Instance,
    ) -> StoreResult<()> {
        let guard = if before.unique.is_some() || after.unique.is_some() {
            Guard::Set(self.guard_for(after).await?)
        } else {
            Guard::Untouched
        };
        let mut w = Writes::default();
        w.instance_update(before, after, guard);
        self.write(w).await
    }

    /// Stores `signals` in one statement and returns their ids, in the order given. The
    /// statement inserts the rows in array order under the write lock, and ids only grow
    /// (`AUTOINCREMENT`), so the ids sorted ascending are the rows' ids in that order.
    pub async fn signals_insert(
        &mut self,
        signals: &[SignalInsert<'_>],
    ) -> StoreResult<Vec<SignalId>> {
        if signals.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<Value> = signals
            .iter()
            .map(|s| {
                serde_json::json!([
                    s.target.0,
                    s.name,
                    json_text(s.payload),
                    s.dedup_key,
                    s.at.0,
                    s.priority.map(|p| i64::from(p.level()))
                ])
            })
            .collect();
        // An array of JSON values serializes without fail.
        let rows = serde_json::to_string(&rows).unwrap_or_else(|_| "[]".into());
        let mut ids: Vec<i64> = sqlx::query_scalar(
            "INSERT INTO keel_signals (target_id, name, payload, dedup_key, inserted_at, \
             priority) SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, \
               value ->> 5 FROM jsonb_each(?) RETURNING id",
        )
        .bind(rows)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("storing signals"))?;
        if ids.len() != signals.len() {
            return Err(corrupt(
                self.file,
                "signal ids",
                format!("{} signals stored, {} ids returned", signals.len(), ids.len()),
            ));
        }
        ids.sort_unstable();
        Ok(ids.into_iter().map(SignalId).collect())
    }

    /// Runs gathered writes in one query.
    pub async fn write(&mut self, w: Writes) -> StoreResult<()> {
        if w.count() == 0 {
            return Ok(());
        }
        let (sql, args, repeats, during) = w.finish();
        // Every value is bound; the text holds only the fixed statements pushed above.
        sqlx::query_with(sqlx::AssertSqlSafe(sql), args)
            .persistent(repeats)
            .execute(&mut *self.conn)
            .await
            .map_err(self.err(during))?;
        Ok(())
    }

    /// Appends a history row for `row` (its id and revision) in `attempt`.
    pub async fn record(
        &mut self,
        row: &Instance,
        attempt: i32,
        entry: &HistoryEntry,
        now: Timestamp,
    ) -> StoreResult<()> {
        let mut w = Writes::default();
        w.record(row, attempt, entry, now);
        self.write(w).await
    }

    // ----- timers -----------------------------------------------------------------------

    /// The timers of `id`, soonest first, at most `limit`.
    pub async fn timers(&mut self, id: InstanceId, limit: usize) -> StoreResult<Vec<TimerRow>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            timer_cols!(),
            " FROM keel_timers WHERE instance_id = ? ORDER BY next_fire_at, id LIMIT +?"
        ))
        .bind(id.0)
        .bind(limit as i64)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading timers"))?;
        rows.iter().map(|r| self.timer_of(r)).collect()
    }

    /// Moves one timer to a deployed duration, unless it changed since it was read (fired,
    /// or moved by another pass); says whether it moved.
    pub async fn timer_retime(&mut self, read: &TimerRow, next: &TimerRow) -> StoreResult<bool> {
        let spec = serde_json::to_string(&next.spec)
            .map_err(|e| StoreError::invalid(format!("timer spec: {e}")))?;
        let done = sqlx::query(
            "UPDATE keel_timers SET spec = ?, next_fire_at = ? \
             WHERE id = ? AND next_fire_at = ? AND fire_count = ?",
        )
        .bind(spec)
        .bind(next.next_fire_at.0)
        .bind(read.id.0)
        .bind(read.next_fire_at.0)
        .bind(read.fire_count)
        .execute(&mut *self.conn)
        .await
        .map_err(self.err("moving a timer"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Deletes the timers `ids` (one statement; none is a no-op).
    pub async fn timers_remove(&mut self, ids: &[TimerId]) -> StoreResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let ids = ids_json(ids.iter().map(|i| i.0));
        sqlx::query("DELETE FROM keel_timers WHERE id IN (SELECT value FROM json_each(?))")
            .bind(ids)
            .execute(&mut *self.conn)
            .await
            .map_err(self.err("deleting timers"))?;
        Ok(())
    }

    /// Which of `ids` have at least one timer (one statement).
    pub async fn timer_owners(
        &mut self,
        ids: &[InstanceId],
    ) -> StoreResult<std::collections::HashSet<InstanceId>> {
        let ids = ids_json(ids.iter().map(|i| i.0));
        let owners: Vec<i64> = sqlx::query_scalar(
            "SELECT DISTINCT instance_id FROM keel_timers \
             WHERE instance_id IN (SELECT value FROM json_each(?))",
        )
        .bind(ids)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("reading which instances have timers"))?;
        Ok(owners.into_iter().map(InstanceId).collect())
    }

    /// Deletes every timer of instance `id` (it became terminal).
    pub async fn timers_drop(&mut self, id: InstanceId) -> StoreResult<()> {
        let mut w = Writes::default();
        w.timers_drop(id);
        self.write(w).await
    }

    // ----- signals and dead letters -----------------------------------------------------

    /// The signals already stored under the given (target, dedup key) pairs, in one
    /// statement.
    pub async fn dedups(
        &mut self,
        pairs: &[(InstanceId, &str)],
    ) -> StoreResult<HashMap<(InstanceId, String), SignalId>> {
        if pairs.is_empty() {
            return Ok(HashMap::new());
        }
        let pairs: Vec<(i64, &str)> = pairs.iter().map(|(id, key)| (id.0, *key)).collect();
        // Pairs of integers and strings serialize without fail.
        let pairs = serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".into());
        let rows: Vec<(i64, String, i64)> = sqlx::query_as(
            "SELECT s.target_id, s.dedup_key, s.id FROM jsonb_each(?) j \
             CROSS JOIN keel_signals s \
             ON s.target_id = j.value ->> 0 AND s.dedup_key = j.value ->> 1",
        )
        .bind(pairs)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(self.err("checking dedup keys"))?;
        Ok(rows.into_iter().map(|(t, k, id)| ((InstanceId(t), k), SignalId(id))).collect())
    }

    /// Deletes signal `id` from the inbox of `target` (a no-op when it is not there).
    pub async fn signal_remove(&mut self, target: InstanceId, id: SignalId) -> StoreResult<()> {
        let mut w = Writes::default();
        w.signal_remove(target, id);
        self.write(w).await
    }

    /// Stores a dead letter.
    pub async fn dead_letter_insert(
        &mut self,
        letter: &NewDeadLetter,
        now: Timestamp,
    ) -> StoreResult<DeadLetterId> {
        let signals = serde_json::to_string(&letter.signals).unwrap_or_else(|_| "[]".to_owned());
        let errors = serde_json::to_string(&letter.errors).unwrap_or_else(|_| "[]".to_owned());
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO keel_dead_letters (instance_id, namespace, machine, machine_version, \
             position, signals, event, correlation_id, reason, attempts, errors, \
             first_attempt_at, last_attempt_at, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        )
        .bind(letter.instance.0)
        .bind(&letter.namespace)
        .bind(&letter.machine.name)
        .bind(letter.machine.version)
        .bind(&letter.position)
        .bind(signals)
        .bind(letter.event.as_ref().map(json_text))
        .bind(&letter.correlation_id)
        .bind(&letter.reason)
        .bind(letter.attempts)
        .bind(errors)
        .bind(letter.first_attempt_at.0)
        .bind(letter.last_attempt_at.0)
        .bind(now.0)
        .fetch_one(&mut *self.conn)
        .await
        .map_err(self.err("storing a dead letter"))?;
        Ok(DeadLetterId(id))
    }

    /// One dead letter, or `NotFound`.
    pub async fn dead_letter(&mut self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        let row = sqlx::query(concat!(
            "SELECT ",
            dead_letter_cols!(),
            " FROM keel_dead_letters WHERE id = ?"
        ))
        .bind(id.0)
        .fetch_optional(&mut *self.conn)
        .await
        .map_err(self.err("reading a dead letter"))?;
        match row {
            Some(r) => self.dead_letter_of(&r),
            None => Err(StoreError::not_found(format!("dead letter {id} does not exist"))),
        }
    }

    /// Deletes one dead letter.
    pub async fn dead_letter_remove(&mut self, id: DeadLetterId) -> StoreResult<()> {
        sqlx::query("DELETE FROM keel_dead_letters WHERE id = ?")
            .bind(id.0)
            .execute(&mut *self.conn)
            .await
            .map_err(self.err("removing a dead letter"))?;
        Ok(())
    }
}

type SqliteQuery<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>;

/// A signal to store, as [`Db::signals_insert`] takes it.
pub(crate) struct SignalInsert<'a> {
    pub target: InstanceId,
    pub name: &'a str,
    pub payload: &'a Value,
    pub dedup_key: Option<&'a str>,
    pub priority: Option<Priority>,
    pub at: Timestamp,
}

/// The unique-key guard an instance update writes.
pub(crate) enum Guard {
    /// Neither the row as read nor as written has a unique key: the column stays.
    Untouched,
    /// The guard decided for the row as written (`None` while another row holds the key).
    Set(Option<Vec<u8>>),
}

/// One value a gathered write binds.
enum Col {
    Int(i64),
    OptInt(Option<i64>),
    Text(String),
    OptText(Option<String>),
    Blob(Option<Vec<u8>>),
}

impl Col {
    /// The value in a JSON row, which `->>` reads back as the same integer, text or
    /// NULL. Blobs are never gathered into JSON rows.
    fn json(self) -> Value {
        match self {
            Col::Int(v) => Value::from(v),
            Col::OptInt(v) => v.map_or(Value::Null, Value::from),
            Col::Text(v) => Value::String(v),
            Col::OptText(v) => v.map_or(Value::Null, Value::String),
            Col::Blob(_) => Value::Null,
        }
    }
}

/// Writes whose results nothing reads, gathered into one query. The driver hands every
/// query to the connection's own thread and waits for its answer, a hand-off that costs
/// more than SQLite spends on a small write; a batch of statements in one query pays it
/// once. Rows of the same kind (history, consumed signals, timers, row updates that set
/// the same columns) go into one statement that reads them from a JSON array with
/// `jsonb_each`, so its text is the same whatever the batch's size and the driver keeps
/// it prepared: preparing an `UPDATE` of the instance table costs more than running it.
/// (`jsonb_each` hands each row to `->>` in SQLite's binary form; `json_each` would turn
/// it back into text for `->>` to parse again, once per row.)
/// What a JSON array cannot carry (blobs, a row updated twice, inserts whose ids are
/// returned) is a statement of its own, bound in the order its text names its values,
/// and runs after the gathered rows.
#[derive(Default)]
pub(crate) struct Writes {
    /// Statements of their own, and their values.
    sql: String,
    args: Vec<Col>,
    statements: usize,
    during: &'static str,
    /// Gathered rows: each statement's text, its rows and what it does.
    groups: Vec<(String, Vec<Value>, &'static str)>,
    /// Rows an update group holds, so a second update of one row runs after the first.
    updated: std::collections::HashSet<i64>,
    savepoint: Option<&'static str>,
}

impl Writes {
    /// One statement without values.
    pub fn statement(sql: &str) -> Writes {
        let mut w = Writes::default();
        w.push(sql, [], "writing");
        w
    }

    fn push(&mut self, sql: &str, values: impl IntoIterator<Item = Col>, during: &'static str) {
        if !self.sql.is_empty() {
            self.sql.push_str(";\n");
        }
        self.sql.push_str(sql);
        self.statements += 1;
        self.during = during;
        self.args.extend(values);
    }

    /// Adds `row` to the gathered statement `sql`, which reads its rows from `json_each(?)`.
    fn gather(&mut self, sql: &str, row: Value, during: &'static str) {
        match self.groups.iter_mut().find(|(text, _, _)| text == sql) {
            Some((_, rows, _)) => rows.push(row),
            None => self.groups.push((sql.to_owned(), vec![row], during)),
        }
    }

    /// How many statements the query runs.
    fn count(&self) -> usize {
        self.statements + self.groups.len()
    }

    /// The query's text, its values, whether its text repeats
    /// from batch to batch (so the driver may keep it prepared), and what it does.
    fn finish(self) -> (String, sqlx::sqlite::SqliteArguments, bool, &'static str) {
        use sqlx::Arguments as _;
        let count = self.count();
        let during = match (count, self.groups.first()) {
            (1, Some((_, _, during))) => during,
            (1, None) => self.during,
            _ => "writing a batch of changes",
        };
        let repeats = self.statements <= 1;
        let mut sql = String::new();
        let mut args = sqlx::sqlite::SqliteArguments::default();
        if let Some(name) = self.savepoint {
            let _ = writeln!(sql, "SAVEPOINT {name};");
        }
        for (i, (text, rows, _)) in self.groups.into_iter().enumerate() {
            if i > 0 {
                sql.push_str(";\n");
            }
            sql.push_str(&text);
            // An array of JSON values serializes without fail.
            let _ = args.add(serde_json::to_string(&rows).unwrap_or_else(|_| "[]".into()));
        }
        if !self.sql.is_empty() {
            if count > self.statements {
                sql.push_str(";\n");
            }
            sql.push_str(&self.sql);
        }
        for value in self.args {
            // Encoding integers, text and blobs for SQLite cannot fail.
            let _ = match value {
                Col::Int(v) => args.add(v),
                Col::OptInt(v) => args.add(v),
                Col::Text(v) => args.add(v),
                Col::OptText(v) => args.add(v),
                Col::Blob(v) => args.add(v),
            };
        }
        if let Some(name) = self.savepoint {
            let _ = write!(sql, ";\nRELEASE {name}");
        }
        (sql, args, repeats, during)
    }

    /// Wraps what was gathered in a savepoint named `name`, so that a failure half way can
    /// be rolled back to the state before the first statement.
    pub fn in_savepoint(mut self, name: &'static str) -> Writes {
        self.savepoint = Some(name);
        self
    }

    /// Appends a history row for `row` (its id and revision) in `attempt`.
    pub fn record(&mut self, row: &Instance, attempt: i32, entry: &HistoryEntry, now: Timestamp) {
        self.gather(
            "INSERT INTO keel_history (instance_id, at, revision, attempt, kind, data) \
             SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, \
               value ->> 5 FROM jsonb_each(?)",
            serde_json::json!([
                row.id.0,
                now.0,
                row.revision.0,
                attempt,
                entry.kind,
                json_text(&entry.data)
            ]),
            "appending history",
        );
    }

    /// Stores a new timer (the database assigns its id, which nothing reads here).
    pub fn timer_arm(&mut self, t: &TimerRow) {
        self.gather(
            "INSERT INTO keel_timers (instance_id, namespace, machine, machine_version, spec, \
             next_fire_at, fire_count, armed_at) SELECT value ->> 0, value ->> 1, \
               value ->> 2, value ->> 3, value ->> 4, value ->> 5, value ->> 6, value ->> 7 \
             FROM jsonb_each(?)",
            serde_json::json!([
                t.instance.0,
                t.namespace,
                t.machine.name,
                t.machine.version,
                serde_json::to_string(&t.spec).unwrap_or_else(|_| "null".to_owned()),
                t.next_fire_at.0,
                t.fire_count,
                t.armed_at.0
            ]),
            "arming a timer",
        );
    }

    /// Writes a timer's schedule after a fire.
    pub fn timer_advance(&mut self, t: &TimerRow) {
        self.gather(
            "UPDATE keel_timers SET next_fire_at = j.value ->> 1, fire_count = j.value ->> 2 \
             FROM jsonb_each(?) AS j WHERE keel_timers.id = j.value ->> 0",
            serde_json::json!([t.id.0, t.next_fire_at.0, t.fire_count]),
            "advancing a timer",
        );
    }

    /// Deletes every timer of `id`.
    pub fn timers_drop(&mut self, id: InstanceId) {
        self.gather(
            "DELETE FROM keel_timers WHERE instance_id IN (SELECT value FROM json_each(?))",
            Value::from(id.0),
            "deleting timers",
        );
    }

    /// Removes signal `id` from `target`'s inbox.
    pub fn signal_remove(&mut self, target: InstanceId, id: SignalId) {
        self.gather(
            "DELETE FROM keel_signals WHERE (id, target_id) IN \
               (SELECT value ->> 0, value ->> 1 FROM jsonb_each(?))",
            serde_json::json!([id.0, target.0]),
            "consuming a signal",
        );
    }

    /// Removes every signal in `target`'s inbox (the instance ended).
    pub fn signals_drop(&mut self, target: InstanceId) {
        self.gather(
            "DELETE FROM keel_signals WHERE target_id IN (SELECT value FROM json_each(?))",
            Value::from(target.0),
            "draining an inbox",
        );
    }

    /// Sets the columns of `after` that differ from `before`, the row as this transaction
    /// read it, and nothing when none does. SQLite rewrites an index entry only for the
    /// indexes whose columns an `UPDATE` sets, so a claim or a step commit that sets the
    /// five columns it changed costs about a third of a write of every column. A JSON
    /// column holding an `undecodable` marker is never written (the stored text stays, so
    /// nothing stored is lost). `guard` is the unique-key guard decided for `after`
    /// ([`Db::instance_update`] decides it); it is set when either row has a unique key,
    /// and untouched otherwise.
    pub fn instance_update(&mut self, before: &Instance, after: &Instance, guard: Guard) {
        debug_assert_eq!(before.id, after.id);
        debug_assert_eq!(
            matches!(guard, Guard::Set(_)),
            before.unique.is_some() || after.unique.is_some()
        );
        let mut set: Vec<(&'static str, Col)> = Vec::new();
        let mut put = |name: &'static str, changed: bool, value: &dyn Fn() -> Col| {
            if changed {
                set.push((name, value()));
            }
        };
        let (b, a) = (before, after);
        put("namespace", b.namespace != a.namespace, &|| Col::Text(a.namespace.clone()));
        put("machine", b.machine.name != a.machine.name, &|| Col::Text(a.machine.name.clone()));
        put("machine_version", b.machine.version != a.machine.version, &|| {
            Col::Int(i64::from(a.machine.version))
        });
        put("business_key", b.business_key != a.business_key, &|| {
            Col::OptText(a.business_key.clone())
        });
        put("queue", b.queue != a.queue, &|| Col::Text(a.queue.clone()));
        put("priority", b.priority != a.priority, &|| Col::Int(i64::from(a.priority.level())));
        put("base_priority", b.base_priority != a.base_priority, &|| {
            Col::Int(i64::from(a.base_priority.level()))
        });
        put("concurrency_key", b.concurrency_key != a.concurrency_key, &|| {
            Col::OptText(a.concurrency_key.clone())
        });
        put("status", b.status != a.status, &|| Col::Text(a.status.name().to_owned()));
        put("position", b.position != a.position, &|| Col::Text(a.position.clone()));
        put("context", b.context != a.context && undecodable_error(&a.context).is_none(), &|| {
            Col::Text(json_text(&a.context))
        });
        put(
            "result",
            b.result != a.result && a.result.as_ref().and_then(undecodable_error).is_none(),
            &|| Col::OptText(a.result.as_ref().map(json_text)),
        );
        put("awaits", b.awaits != a.awaits, &|| Col::OptText(a.awaits.clone()));
        put("last_error", b.last_error != a.last_error, &|| Col::OptText(a.last_error.clone()));
        put("attempt", b.attempt != a.attempt, &|| Col::Int(i64::from(a.attempt)));
        put("errors", b.errors != a.errors, &|| {
            Col::Text(serde_json::to_string(&a.errors).unwrap_or_else(|_| "[]".to_owned()))
        });
        put("revision", b.revision != a.revision, &|| Col::Int(a.revision.0));
        put("eligible_at", b.eligible_at != a.eligible_at, &|| Col::Int(a.eligible_at.0));
        put("lease_owner", b.lease_owner != a.lease_owner, &|| {
            Col::OptText(a.lease_owner.as_ref().map(|w| w.0.clone()))
        });
        put("lease_expires_at", b.lease_expires_at != a.lease_expires_at, &|| {
            Col::OptInt(a.lease_expires_at.map(|t| t.0))
        });
        put("fencing_token", b.fencing_token != a.fencing_token, &|| Col::Int(a.fencing_token.0));
        put("parent_id", b.parent != a.parent, &|| Col::OptInt(a.parent.map(|p| p.0)));
        put("children_pending", b.children_pending != a.children_pending, &|| {
            Col::Int(i64::from(a.children_pending))
        });
        put("unique_key", b.unique != a.unique, &|| {
            Col::Blob(a.unique.as_ref().map(|u| u.key.clone()))
        });
        put("unique_scope", b.unique != a.unique, &|| {
            Col::OptInt(a.unique.as_ref().map(|u| scope_mask(u.scope)))
        });
        put("invoked_by", b.invoked_by != a.invoked_by, &|| Col::OptText(a.invoked_by.clone()));
        put("correlation_id", b.correlation_id != a.correlation_id, &|| {
            Col::OptText(a.correlation_id.clone())
        });
        put("created_at", b.created_at != a.created_at, &|| Col::Int(a.created_at.0));
        put("updated_at", b.updated_at != a.updated_at, &|| Col::Int(a.updated_at.0));
        let gatherable = matches!(guard, Guard::Untouched) && !self.updated.contains(&a.id.0);
        if let Guard::Set(guard) = guard {
            set.push(("unique_guard", Col::Blob(guard)));
        }
        if set.is_empty() {
            return;
        }
        if gatherable && set.iter().all(|(_, v)| !matches!(v, Col::Blob(_))) {
            let mut sql = String::from("UPDATE keel_instances SET ");
            for (i, (name, _)) in set.iter().enumerate() {
                if i > 0 {
                    sql.push_str(", ");
                }
                let _ = write!(sql, "{name} = j.value ->> {}", i + 1);
            }
            sql.push_str(" FROM jsonb_each(?) AS j WHERE keel_instances.id = j.value ->> 0");
            let mut row = vec![Value::from(a.id.0)];
            row.extend(set.into_iter().map(|(_, v)| v.json()));
            self.updated.insert(a.id.0);
            self.gather(&sql, Value::Array(row), "writing an instance");
            return;
        }
        let mut sql = String::from("UPDATE keel_instances SET ");
        for (i, (name, _)) in set.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(name);
            sql.push_str(" = ?");
        }
        sql.push_str(" WHERE id = ?");
        let values = set.into_iter().map(|(_, v)| v).chain([Col::Int(a.id.0)]);
        self.push(&sql, values, "writing an instance");
    }
}

fn bind_instance<'q>(
    q: SqliteQuery<'q>,
    row: &Instance,
    (context, result): (String, Option<String>),
    guard: Option<Vec<u8>>,
) -> SqliteQuery<'q> {
    q.bind(row.namespace.clone())
        .bind(row.machine.name.clone())
        .bind(row.machine.version)
        .bind(row.business_key.clone())
        .bind(row.queue.clone())
        .bind(i64::from(row.priority.level()))
        .bind(row.concurrency_key.clone())
        .bind(row.status.name())
        .bind(row.position.clone())
        .bind(context)
        .bind(result)
        .bind(row.awaits.clone())
        .bind(row.last_error.clone())
        .bind(row.attempt)
        .bind(serde_json::to_string(&row.errors).unwrap_or_else(|_| "[]".to_owned()))
        .bind(row.revision.0)
        .bind(row.eligible_at.0)
        .bind(row.lease_owner.as_ref().map(|w| w.0.clone()))
        .bind(row.lease_expires_at.map(|t| t.0))
        .bind(row.fencing_token.0)
        .bind(row.parent.map(|p| p.0))
        .bind(row.children_pending)
        .bind(row.unique.as_ref().map(|u| u.key.clone()))
        .bind(row.unique.as_ref().map(|u| scope_mask(u.scope)))
        .bind(row.correlation_id.clone())
        .bind(row.created_at.0)
        .bind(row.updated_at.0)
        .bind(guard)
        .bind(row.invoked_by.clone())
        .bind(i64::from(row.base_priority.level()))
}

#[cfg(test)]
mod tests {
    use super::{Db, LIVE_DESCENDANTS_SQL};
    use keel_core::{Instance, InstanceId, MachineRef, NewInstance, Status, Timestamp};
    use sqlx::{Connection, Row, SqliteConnection};

    /// Inserts an instance under `parent` with `status`; returns its id.
    async fn add(db: &mut Db<'_>, parent: Option<InstanceId>, status: Status) -> InstanceId {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row = Instance::from_new(InstanceId(0), &new, parent, Timestamp(0));
        row.status = status;
        db.instance_insert(&row).await.expect("insert")
    }

    /// A cascade's read keeps the order of the breadth-first walk it replaced, which is not
    /// id order (a later parent's older child comes after an earlier parent's newer one),
    /// walks through an ended child to its live child, and cuts that order at `max` and
    /// at `depth_max`. Only the kept ids are read in full: the cut is made on the walk's
    /// keys before any full row is read.
    #[tokio::test]
    async fn live_descendants_keep_the_walk_order_and_cut_it_at_the_bounds() {
        // (depth_max, max) → the kept descendants with their depths, in order.
        type Case = (usize, usize, Vec<(InstanceId, usize)>);
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.expect("open");
        crate::store::migrator().run(&mut conn).await.expect("migrate");
        let mut db = Db { conn: &mut conn, file: ":memory:" };
        let live = Status::AwaitingChildren;
        let root = add(&mut db, None, live).await;
        let c1 = add(&mut db, Some(root), live).await;
        let c2 = add(&mut db, Some(root), live).await;
        let under_c2 = add(&mut db, Some(c2), Status::Runnable).await;
        let ended = add(&mut db, Some(c1), Status::Done).await;
        let under_c1 = add(&mut db, Some(c1), Status::Runnable).await;
        let under_ended = add(&mut db, Some(ended), Status::Runnable).await;
        assert!(under_c2 < under_c1, "the tree this test needs");

        let cases: [Case; 4] = [
            (32, 10, vec![(c1, 1), (c2, 1), (under_c1, 2), (under_c2, 2), (under_ended, 3)]),
            (32, 3, vec![(c1, 1), (c2, 1), (under_c1, 2)]),
            (2, 10, vec![(c1, 1), (c2, 1), (under_c1, 2), (under_c2, 2)]),
            (1, 1, vec![(c1, 1)]),
        ];
        for (depth_max, max, want) in cases {
            let got: Vec<(InstanceId, usize)> = db
                .live_descendants(root, depth_max, max)
                .await
                .expect("live_descendants")
                .into_iter()
                .map(|(row, depth)| (row.id, depth))
                .collect();
            assert_eq!(got, want, "depth_max {depth_max}, max {max}");
        }

        let plan: Vec<String> =
            sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {LIVE_DESCENDANTS_SQL}")))
                .fetch_all(&mut *db.conn)
                .await
                .expect("explain")
                .iter()
                .map(|r| r.get::<String, _>("detail"))
                .collect();
        assert!(
            plan.iter().any(|step| step == "SCAN kept"),
            "full rows are read for the kept ids only:\n{}",
            plan.join("\n")
        );
    }
}
