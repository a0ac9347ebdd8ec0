//! Conversions between keel-core values and SQL rows: timestamps, statuses, the instance
//! row, signals, children summaries, history and dead letters; plus the batch writers that
//! every operation shares (one `UPDATE … FROM unnest(…)` for any number of rows).

use crate::error::OpResult;
use deadpool_postgres::GenericClient;
use keel_core::error::with_causes;
use keel_core::instance::HistoryEntry;
use keel_core::instance::{
    AttemptError, ChildSummary, DeadLetter, HistoryRecord, Instance, NewDeadLetter, Signal,
    UniqueSpec, undecodable, undecodable_error,
};
use keel_core::{
    DeadLetterId, FencingToken, InstanceId, MachineRef, Priority, Revision, SignalId, Status,
    StatusSet, StoreError, Timestamp, WorkerId,
};
use serde_json::Value;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_postgres::Row;
use tokio_postgres::types::FromSql;

/// Latest instant stored losslessly (about year 255 000; PostgreSQL's own limit is 294 276).
const TS_MAX_MS: i64 = 8_000_000_000_000_000;
/// Earliest instant stored (PostgreSQL's limit is 4713 BC).
const TS_MIN_MS: i64 = -200_000_000_000_000;

/// A [`Timestamp`] as a `timestamptz` parameter (clamped to the range PostgreSQL stores).
pub(crate) fn ts(t: Timestamp) -> SystemTime {
    let ms = t.0.clamp(TS_MIN_MS, TS_MAX_MS);
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms as u64)
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

/// A `timestamptz` column as a [`Timestamp`].
pub(crate) fn from_ts(s: SystemTime) -> Timestamp {
    match s.duration_since(UNIX_EPOCH) {
        Ok(d) => Timestamp(d.as_millis() as i64),
        Err(e) => Timestamp(-(e.duration().as_millis() as i64)),
    }
}

/// An optional timestamp column.
pub(crate) fn from_ts_opt(s: Option<SystemTime>) -> Option<Timestamp> {
    s.map(from_ts)
}

/// A status column selected as text.
pub(crate) fn status(s: &str) -> Result<Status, StoreError> {
    s.parse::<Status>().map_err(|e| StoreError::conflict(format!("stored row: {e}")))
}

/// One column, decoded with a check: a value the driver cannot decode is an error naming
/// the column, never a panic (a panic would kill the worker loop that read it).
pub(crate) fn col<'a, T: FromSql<'a>>(r: &'a Row, i: usize) -> Result<T, StoreError> {
    r.try_get(i).map_err(|e| {
        let name = r.columns().get(i).map_or("?", |c| c.name());
        StoreError::conflict(format!(
            "stored row: column {name} cannot be decoded: {}",
            with_causes(&e)
        ))
    })
}

/// A JSON column, decoded leniently: a value no JSON reader accepts (nested too deep, say)
/// becomes an `undecodable` marker naming the error, so the row can still be shown,
/// cancelled or dead-lettered. Writers keep the stored value where they find a marker.
pub(crate) fn json_col(r: &Row, i: usize, column: &str) -> Value {
    r.try_get(i).unwrap_or_else(|e| undecodable(column, &with_causes(&e)))
}

/// [`json_col`] for a nullable column.
pub(crate) fn json_col_opt(r: &Row, i: usize, column: &str) -> Option<Value> {
    r.try_get(i).unwrap_or_else(|e| Some(undecodable(column, &with_causes(&e))))
}

/// Whether the instance whose position is the column `position` is in the state given by
/// parameter `$param`: its step's name, or a path in a chart's JSON array of active states
/// (`keel_core::instance::position_in_state`, in SQL).
pub(crate) fn in_state(position: &str, param: usize) -> String {
    format!(
        "({position} = ${param} OR (left({position}, 1) = '[' AND {position}::jsonb ? ${param}))"
    )
}

/// Every instance column, in the order [`instance`] decodes them.
pub(crate) const INSTANCE_COLS: &str = "id, namespace, machine, machine_version, business_key, \
    queue, priority, concurrency_key, status::text, position, context, result, awaits, \
    last_error, attempt, errors, revision, eligible_at, lease_owner, lease_expires_at, \
    fencing_token, parent_id, children_pending, unique_key, unique_scope::text[], \
    correlation_id, created_at, updated_at, invoked_by, base_priority";

/// [`INSTANCE_COLS`] qualified with the alias `i`.
pub(crate) const INSTANCE_COLS_I: &str = "i.id, i.namespace, i.machine, i.machine_version, \
    i.business_key, i.queue, i.priority, i.concurrency_key, i.status::text, i.position, \
    i.context, i.result, i.awaits, i.last_error, i.attempt, i.errors, i.revision, \
    i.eligible_at, i.lease_owner, i.lease_expires_at, i.fencing_token, i.parent_id, \
    i.children_pending, i.unique_key, i.unique_scope::text[], i.correlation_id, \
    i.created_at, i.updated_at, i.invoked_by, i.base_priority";

/// Decodes a row selected with [`INSTANCE_COLS`] (starting at column 0). The context and
/// result decode leniently ([`json_col`]); a damaged `errors` list reads as empty.
pub(crate) fn instance(r: &Row) -> Result<Instance, StoreError> {
    instance_at(r, 0)
}

/// Decodes the [`INSTANCE_COLS`] of a row that selects them from column `base` on.
pub(crate) fn instance_at(r: &Row, base: usize) -> Result<Instance, StoreError> {
    let scope: Vec<String> = col(r, base + 24)?;
    let scope = scope.iter().map(|s| status(s)).collect::<Result<Vec<_>, _>>()?;
    let unique_key: Option<Vec<u8>> = col(r, base + 23)?;
    // Keel alone writes the errors list; if it cannot be read, showing none keeps the row
    // usable (the next write replaces it).
    let errors: Vec<AttemptError> = r
        .try_get::<_, Value>(base + 15)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default();
    let priority: i16 = col(r, base + 6)?;
    let base_priority: i16 = col(r, base + 29)?;
    Ok(Instance {
        id: InstanceId(col(r, base)?),
        namespace: col(r, base + 1)?,
        machine: MachineRef { name: col(r, base + 2)?, version: col(r, base + 3)? },
        business_key: col(r, base + 4)?,
        queue: col(r, base + 5)?,
        priority: Priority::from_level(priority).unwrap_or_default(),
        base_priority: Priority::from_level(base_priority).unwrap_or_default(),
        concurrency_key: col(r, base + 7)?,
        status: status(col(r, base + 8)?)?,
        position: col(r, base + 9)?,
        context: json_col(r, base + 10, "context"),
        result: json_col_opt(r, base + 11, "result"),
        awaits: col(r, base + 12)?,
        last_error: col(r, base + 13)?,
        attempt: col(r, base + 14)?,
        errors,
        revision: Revision(col(r, base + 16)?),
        eligible_at: from_ts(col(r, base + 17)?),
        lease_owner: col::<Option<String>>(r, base + 18)?.map(WorkerId),
        lease_expires_at: from_ts_opt(col(r, base + 19)?),
        fencing_token: FencingToken(col(r, base + 20)?),
        parent: col::<Option<i64>>(r, base + 21)?.map(InstanceId),
        children_pending: col(r, base + 22)?,
        unique: unique_key.map(|key| UniqueSpec { key, scope: StatusSet::of(&scope) }),
        correlation_id: col(r, base + 25)?,
        created_at: from_ts(col(r, base + 26)?),
        updated_at: from_ts(col(r, base + 27)?),
        invoked_by: col(r, base + 28)?,
    })
}

/// Signal columns, in the order [`signal`] decodes them.
pub(crate) const SIGNAL_COLS: &str =
    "id, target_id, name, payload, dedup_key, inserted_at, priority";

/// Decodes a row selected with [`SIGNAL_COLS`] (the payload leniently).
pub(crate) fn signal(r: &Row) -> Result<Signal, StoreError> {
    Ok(Signal {
        id: SignalId(col(r, 0)?),
        target: InstanceId(col(r, 1)?),
        name: col(r, 2)?,
        payload: json_col(r, 3, "payload"),
        dedup_key: col(r, 4)?,
        inserted_at: from_ts(col(r, 5)?),
        priority: col::<Option<i16>>(r, 6)?.and_then(Priority::from_level),
    })
}

/// Children-summary columns, in the order [`child`] decodes them.
pub(crate) const CHILD_COLS: &str =
    "id, machine, machine_version, status::text, position, context, result, last_error";

/// Decodes a row selected with [`CHILD_COLS`] (context and result leniently).
pub(crate) fn child(r: &Row) -> Result<ChildSummary, StoreError> {
    Ok(ChildSummary {
        id: InstanceId(col(r, 0)?),
        machine: MachineRef { name: col(r, 1)?, version: col(r, 2)? },
        status: status(col(r, 3)?)?,
        position: col(r, 4)?,
        context: json_col(r, 5, "context"),
        result: json_col_opt(r, 6, "result"),
        last_error: col(r, 7)?,
    })
}

/// History columns, in the order [`history`] decodes them.
pub(crate) const HISTORY_COLS: &str = "instance_id, seq, at, revision, attempt, kind, data";

/// Decodes a row selected with [`HISTORY_COLS`] (the data leniently).
pub(crate) fn history(r: &Row) -> Result<HistoryRecord, StoreError> {
    Ok(HistoryRecord {
        instance: InstanceId(col(r, 0)?),
        seq: col(r, 1)?,
        at: from_ts(col(r, 2)?),
        revision: Revision(col(r, 3)?),
        attempt: col(r, 4)?,
        entry: HistoryEntry { kind: col(r, 5)?, data: json_col(r, 6, "data") },
    })
}

/// Dead-letter columns, in the order [`dead_letter`] decodes them.
pub(crate) const DEAD_LETTER_COLS: &str = "id, created_at, instance_id, namespace, machine, \
    machine_version, position, signals, event, correlation_id, reason, attempts, errors, \
    first_attempt_at, last_attempt_at";

/// Decodes a row selected with [`DEAD_LETTER_COLS`] (the event leniently).
pub(crate) fn dead_letter(r: &Row) -> Result<DeadLetter, StoreError> {
    let signals: Vec<i64> = col(r, 7)?;
    let errors: Value = col(r, 12)?;
    Ok(DeadLetter {
        id: DeadLetterId(col(r, 0)?),
        created_at: from_ts(col(r, 1)?),
        letter: NewDeadLetter {
            instance: InstanceId(col(r, 2)?),
            namespace: col(r, 3)?,
            machine: MachineRef { name: col(r, 4)?, version: col(r, 5)? },
            position: col(r, 6)?,
            signals: signals.into_iter().map(SignalId).collect(),
            event: json_col_opt(r, 8, "event"),
            correlation_id: col(r, 9)?,
            reason: col(r, 10)?,
            attempts: col(r, 11)?,
            errors: serde_json::from_value(errors)
                .map_err(|e| StoreError::conflict(format!("stored dead letter errors: {e}")))?,
            first_attempt_at: from_ts(col(r, 13)?),
            last_attempt_at: from_ts(col(r, 14)?),
        },
    })
}

/// The statement [`lock_instances`] runs.
pub(crate) static LOCK_INSTANCES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {INSTANCE_COLS} FROM instances WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE"
    )
});

/// Locks the given rows (a commit's batch, a cancel's root) and, before them, the parents
/// of those rows that keep a join state, all in id order (a parent's id is below its
/// children's). Siblings of a join
/// thus serialize on their parent before they hold their own rows, so the commit that
/// wakes the parent can lock and cancel the siblings still running without a deadlock.
/// Only a parent's own commits set its join state, and it stays once set. The ids are
/// gathered first (one small sub-select on the primary key), so the lock itself stays the
/// primary-key lookup the plain statement was.
pub(crate) static LOCK_WITH_JOINED_PARENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {INSTANCE_COLS} FROM instances WHERE id = ANY(ARRAY( \
           SELECT unnest($1::int8[]) \
           UNION SELECT p.id FROM instances i JOIN instances p ON p.id = i.parent_id \
             WHERE i.id = ANY($1::int8[]) AND p.context ? '@join')) \
         ORDER BY id FOR NO KEY UPDATE"
    )
});

/// Locks rows by id (in id order, so concurrent batches cannot deadlock on each other)
/// and returns them.
pub(crate) async fn lock_instances<C: GenericClient + Sync>(
    c: &C,
    ids: &[i64],
) -> OpResult<Vec<Instance>> {
    let stmt = c.prepare_cached(&LOCK_INSTANCES).await?;
    let rows = c.query(&stmt, &[&ids]).await?;
    Ok(rows.iter().map(instance).collect::<Result<_, _>>()?)
}

/// The statement [`write_instances`] runs.
pub(crate) const WRITE_INSTANCES: &str = "UPDATE instances i SET status = u.status::status, \
    position = u.position, \
    context = CASE WHEN u.keep_context THEN i.context ELSE u.context END, \
    result = CASE WHEN u.keep_result THEN i.result ELSE u.result END, awaits = u.awaits, \
    last_error = u.last_error, attempt = u.attempt, errors = u.errors, revision = u.revision, \
    eligible_at = u.eligible_at, lease_owner = u.lease_owner, \
    lease_expires_at = u.lease_expires_at, fencing_token = u.fencing_token, \
    children_pending = u.children_pending, updated_at = u.updated_at, priority = u.priority \
    FROM unnest($1::int8[], $2::text[], $3::text[], $4::jsonb[], $5::jsonb[], $6::text[], \
    $7::text[], $8::int4[], $9::jsonb[], $10::int8[], $11::timestamptz[], $12::text[], \
    $13::timestamptz[], $14::int8[], $15::int4[], $16::timestamptz[], $17::bool[], $18::bool[], \
    $19::int2[]) \
    AS u(id, status, position, context, result, awaits, last_error, attempt, errors, \
    revision, eligible_at, lease_owner, lease_expires_at, fencing_token, children_pending, \
    updated_at, keep_context, keep_result, priority) WHERE i.id = u.id";

/// The parameter arrays of [`WRITE_INSTANCES`] for a set of rows.
#[derive(Default)]
pub(crate) struct InstanceWrite {
    id: Vec<i64>,
    status: Vec<&'static str>,
    position: Vec<String>,
    context: Vec<Value>,
    result: Vec<Option<Value>>,
    awaits: Vec<Option<String>>,
    last_error: Vec<Option<String>>,
    attempt: Vec<i32>,
    errors: Vec<Value>,
    revision: Vec<i64>,
    eligible_at: Vec<SystemTime>,
    lease_owner: Vec<Option<String>>,
    lease_expires_at: Vec<Option<SystemTime>>,
    fencing_token: Vec<i64>,
    children_pending: Vec<i32>,
    updated_at: Vec<SystemTime>,
    keep_context: Vec<bool>,
    keep_result: Vec<bool>,
    priority: Vec<i16>,
}

impl InstanceWrite {
    /// Adds a row (every mutable column is written back, except a context or result that
    /// was read as an `undecodable` marker: the stored value stays as it is).
    pub(crate) fn push(&mut self, row: &Instance) {
        self.push_over(row, None);
    }

    /// Adds a row planned from a stored one, whose context and result `stored` gives as
    /// this transaction read them under its lock: a context or result equal to the stored
    /// one is not sent, and the statement keeps the stored value. Most steps leave the
    /// context as it was, and a large one then costs neither encoding, nor the server's
    /// parsing, nor a second stored copy.
    pub(crate) fn push_over(&mut self, row: &Instance, stored: Option<(&Value, Option<&Value>)>) {
        let keep_context = stored.is_some_and(|(context, _)| *context == row.context)
            || undecodable_error(&row.context).is_some();
        let keep_result = stored.is_some_and(|(_, result)| result == row.result.as_ref())
            || row.result.as_ref().and_then(undecodable_error).is_some();
        self.push_keeping(row, keep_context, keep_result);
    }

    /// Adds a row whose context and result are the stored ones (a delivery's wake-up):
    /// neither is sent, and the statement keeps the stored values.
    pub(crate) fn push_unchanged(&mut self, row: &Instance) {
        self.push_keeping(row, true, true);
    }

    fn push_keeping(&mut self, row: &Instance, keep_context: bool, keep_result: bool) {
        self.keep_context.push(keep_context);
        self.keep_result.push(keep_result);
        self.id.push(row.id.0);
        self.status.push(row.status.name());
        self.position.push(row.position.clone());
        self.context.push(if keep_context { Value::Null } else { row.context.clone() });
        self.result.push(if keep_result { None } else { row.result.clone() });
        self.awaits.push(row.awaits.clone());
        self.last_error.push(row.last_error.clone());
        self.attempt.push(row.attempt);
        self.errors.push(serde_json::to_value(&row.errors).unwrap_or(Value::Array(Vec::new())));
        self.revision.push(row.revision.0);
        self.eligible_at.push(ts(row.eligible_at));
        self.lease_owner.push(row.lease_owner.as_ref().map(|w| w.0.clone()));
        self.lease_expires_at.push(row.lease_expires_at.map(ts));
        self.fencing_token.push(row.fencing_token.0);
        self.children_pending.push(row.children_pending);
        self.updated_at.push(ts(row.updated_at));
        self.priority.push(row.priority.level());
    }

    /// Whether no row was added.
    pub(crate) fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    /// The statement's parameters.
    pub(crate) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 19] {
        [
            &self.id,
            &self.status,
            &self.position,
            &self.context,
            &self.result,
            &self.awaits,
            &self.last_error,
            &self.attempt,
            &self.errors,
            &self.revision,
            &self.eligible_at,
            &self.lease_owner,
            &self.lease_expires_at,
            &self.fencing_token,
            &self.children_pending,
            &self.updated_at,
            &self.keep_context,
            &self.keep_result,
            &self.priority,
        ]
    }
}

/// Writes rows back in one statement.
pub(crate) async fn write_instances<C: GenericClient + Sync>(
    c: &C,
    rows: &[Instance],
) -> OpResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut w = InstanceWrite::default();
    for r in rows {
        w.push(r);
    }
    let stmt = c.prepare_cached(WRITE_INSTANCES).await?;
    c.execute(&stmt, &w.params()).await?;
    Ok(())
}

/// The statement [`HistoryWrite`] feeds.
pub(crate) const WRITE_HISTORY: &str = "INSERT INTO history (instance_id, at, revision, attempt, kind, data) \
    SELECT instance_id, at, revision, attempt, kind, data FROM unnest($1::int8[], $2::timestamptz[], $3::int8[], $4::int4[], $5::text[], $6::jsonb[]) \
    WITH ORDINALITY AS h(instance_id, at, revision, attempt, kind, data, ord) ORDER BY ord";

/// The parameter arrays of [`WRITE_HISTORY`].
#[derive(Default)]
pub(crate) struct HistoryWrite {
    instance: Vec<i64>,
    at: Vec<SystemTime>,
    revision: Vec<i64>,
    attempt: Vec<i32>,
    kind: Vec<String>,
    data: Vec<Value>,
}

impl HistoryWrite {
    /// Adds an entry for `row` (its revision after the change), recorded in `attempt`.
    pub(crate) fn push(&mut self, row: &Instance, attempt: i32, at: Timestamp, e: HistoryEntry) {
        self.instance.push(row.id.0);
        self.at.push(ts(at));
        self.revision.push(row.revision.0);
        self.attempt.push(attempt);
        self.kind.push(e.kind);
        self.data.push(e.data);
    }

    /// Whether no entry was added.
    pub(crate) fn is_empty(&self) -> bool {
        self.instance.is_empty()
    }

    /// The statement's parameters.
    pub(crate) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 6] {
        [&self.instance, &self.at, &self.revision, &self.attempt, &self.kind, &self.data]
    }
}

/// Appends history in one statement.
pub(crate) async fn write_history<C: GenericClient + Sync>(
    c: &C,
    h: &HistoryWrite,
) -> OpResult<()> {
    if h.is_empty() {
        return Ok(());
    }
    let stmt = c.prepare_cached(WRITE_HISTORY).await?;
    c.execute(&stmt, &h.params()).await?;
    Ok(())
}

/// Decrements parents' barriers for children that became terminal (`plan::parent::release`
/// applied once per child, in SQL): never below zero; the last one makes an awaiting parent runnable.
/// Parents that keep a join state in their context are left to the planner
/// (`ops::admin::release_joined`).
pub(crate) const RELEASE_PARENTS: &str = "UPDATE instances p SET \
    children_pending = greatest(p.children_pending - d.n, 0), \
    status = CASE WHEN p.children_pending - d.n <= 0 AND p.status = 'awaiting_children' \
                  THEN 'runnable'::status ELSE p.status END, \
    eligible_at = CASE WHEN p.children_pending - d.n <= 0 AND p.status = 'awaiting_children' \
                  THEN $2 ELSE p.eligible_at END, \
    updated_at = $2 \
    FROM (SELECT parent, count(*)::int AS n FROM unnest($1::int8[]) AS t(parent) GROUP BY parent) d \
    WHERE p.id = d.parent AND NOT (p.context ? '@join')";

/// Runs [`RELEASE_PARENTS`] for the given parents (one entry per terminal child).
pub(crate) async fn release_parents<C: GenericClient + Sync>(
    c: &C,
    parents: &[i64],
    now: Timestamp,
) -> OpResult<()> {
    if parents.is_empty() {
        return Ok(());
    }
    let stmt = c.prepare_cached(RELEASE_PARENTS).await?;
    c.execute(&stmt, &[&parents, &ts(now)]).await?;
    Ok(())
}
