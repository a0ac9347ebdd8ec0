//! `instance_insert`: one statement for the whole batch. A batch in which some row has a
//! unique key runs `INSERT … ON CONFLICT (unique_guard) DO NOTHING` with ids drawn up
//! front, which also reads the occupant of every key that did not go in; a batch without
//! unique keys cannot conflict and runs a plain `INSERT … SELECT FROM unnest(…)` (no
//! conflict arbiter, no materialized input, no join back: less server time per row), and
//! one such row a plain `INSERT … VALUES`.
//! Used by `ScheduleChildren` commits too. A top-level insert is that one statement
//! in a transaction of its own, `BEGIN` and `COMMIT` pipelined with it, and the store's
//! wake-up sent once the commit has landed (see [`end_tx_notices`]), in the same round
//! trip: one round trip and one flush, for a single start as for a batch of ten thousand.
//! Notifying from inside the insert's own transaction would hold PostgreSQL's notify lock
//! through its flush, so concurrent starts could not share a flush: with 16 clients
//! starting one instance each, about half the starts per second.
//!
//! An occupant that committed after the statement's snapshot (a concurrent inserter of
//! the same key, which the conflict waited for) is not visible to it; those few keys are
//! looked up with one more statement.
//!
//! Rows go in sorted by unique key (batch order among equal keys, so the first item of a
//! batch wins): concurrent inserters of overlapping key sets then wait on each other in one
//! global order and cannot deadlock.

use super::{Notices, begin_hot, end_tx_notices};
use crate::error::{OpError, OpResult};
use crate::rows::{self, ts};
use deadpool_postgres::GenericClient;
use keel_core::instance::{Instance, NewInstance};
use keel_core::ports::store::{InsertOutcome, InsertParams};
use keel_core::{InstanceId, StoreError, Timestamp};
use std::collections::HashMap;

/// One instance to insert, with its parent when it is a child.
pub(crate) type Item<'a> = (&'a NewInstance, Option<InstanceId>);

/// The items of a top-level insert.
pub(crate) fn items(params: &InsertParams) -> Vec<Item<'_>> {
    params.instances.iter().map(|n| (n, None)).collect()
}

/// One statement in its own transaction: insert and read the occupants; then the wake-up.
/// `BEGIN` (see [`begin_hot`]: a small insert is not planned per call), the statement,
/// `COMMIT` and the wake-up go out together: one round trip and one flush. A batch with a
/// unique key sends its `COMMIT` once the occupants are known (a round trip more).
pub(crate) async fn run<C: GenericClient + Sync>(
    c: &C,
    items: &[Item<'_>],
    now: Timestamp,
    channel: &str,
) -> OpResult<Vec<InsertOutcome>> {
    // Prepared first, so that the pipeline below sends its messages in order (a statement
    // still being prepared would let the COMMIT overtake it). One plain row runs a
    // statement whose plan costs nothing to make, so its `BEGIN` need not fix the plan.
    let shape = Shape::of(items);
    let begin = async {
        if shape == Shape::One {
            c.batch_execute("BEGIN").await.map_err(OpError::from)
        } else {
            begin_hot(c, items.len()).await
        }
    };
    c.prepare_cached(shape.statement()).await?;
    let ready = Notices::ready(true);
    if shape == Shape::Keyed {
        // A key taken by an instance this statement could not see may need a second read
        // of its occupant, which can still fail; the COMMIT waits for it, so an insert
        // that reports an error has stored none of its rows (the caller rolls back).
        let (began, inserted) = tokio::join!(begin, insert_as(c, shape, items, now));
        began?;
        let inserted = inserted?;
        end_tx_notices(c, channel, &ready).await?;
        return Ok(inserted);
    }
    // A failed statement aborts the transaction, and the COMMIT then rolls it back.
    let (began, inserted, committed) =
        tokio::join!(begin, insert_as(c, shape, items, now), end_tx_notices(c, channel, &ready));
    began?;
    let inserted = inserted?;
    committed?;
    Ok(inserted)
}

/// The insert statement: per item in batch order, its id, whether it went in, and (when
/// it did not) its key's occupant.
const INSERT: &str = "WITH input AS MATERIALIZED ( \
      SELECT nextval('instances_id_seq') AS id, t.* \
      FROM unnest($1::text[], $2::text[], $3::int4[], $4::text[], $5::text[], $6::int2[], \
                  $7::text[], $8::text[], $9::jsonb[], $10::timestamptz[], $11::text[], \
                  $12::int8[], $14::text[], $15::bytea[], $16::text[]) WITH ORDINALITY \
        AS t(namespace, machine, machine_version, business_key, queue, priority, \
             concurrency_key, position, context, eligible_at, correlation_id, parent_id, \
             invoked_by, unique_key, unique_scope, ord) \
    ), ins AS ( \
      INSERT INTO instances (id, namespace, machine, machine_version, business_key, queue, \
        priority, concurrency_key, status, position, context, eligible_at, parent_id, \
        unique_key, unique_scope, correlation_id, created_at, updated_at, invoked_by, \
        base_priority) \
      SELECT id, namespace, machine, machine_version, business_key, queue, priority, \
        concurrency_key, 'runnable', position, context, eligible_at, parent_id, unique_key, \
        unique_scope::status[], correlation_id, $13, $13, invoked_by, priority \
      FROM input ORDER BY unique_key NULLS LAST, ord \
      ON CONFLICT (unique_guard) WHERE unique_guard IS NOT NULL DO NOTHING \
      RETURNING id \
    ) \
    SELECT input.id, ins.id IS NOT NULL, \
      CASE WHEN ins.id IS NULL THEN \
        (SELECT o.id FROM instances o WHERE o.unique_guard = input.unique_key) END \
    FROM input LEFT JOIN ins ON ins.id = input.id ORDER BY input.ord";

const OCCUPANTS: &str =
    "SELECT unique_guard, id FROM instances WHERE unique_guard = ANY($1::bytea[])";

/// Inserts `items` in the current transaction; per item, its new id or its key's occupant.
pub(crate) async fn insert_batch<C: GenericClient + Sync>(
    c: &C,
    items: &[Item<'_>],
    now: Timestamp,
) -> OpResult<Vec<InsertOutcome>> {
    insert_as(c, Shape::of(items), items, now).await
}

/// [`insert_batch`] with the batch's shape already known.
async fn insert_as<C: GenericClient + Sync>(
    c: &C,
    shape: Shape,
    items: &[Item<'_>],
    now: Timestamp,
) -> OpResult<Vec<InsertOutcome>> {
    match shape {
        _ if items.is_empty() => Ok(Vec::new()),
        Shape::One => Ok(vec![InsertOutcome::Inserted(insert_one(c, &items[0], now).await?)]),
        Shape::Plain => insert_plain(c, items, now).await,
        Shape::Keyed => insert_keyed(c, items, now).await,
    }
}

/// Inserts a batch in which some row has a unique key (see [`Shape::Keyed`]).
async fn insert_keyed<C: GenericClient + Sync>(
    c: &C,
    items: &[Item<'_>],
    now: Timestamp,
) -> OpResult<Vec<InsertOutcome>> {
    let rows = query_batch(c, Shape::Keyed, items, now).await?;
    let mut out = Vec::with_capacity(items.len());
    let mut missing = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let id = InstanceId(rows::col(r, 0)?);
        if rows::col::<bool>(r, 1)? {
            out.push(InsertOutcome::Inserted(id));
        } else if let Some(occupant) = rows::col::<Option<i64>>(r, 2)? {
            out.push(InsertOutcome::Existing(InstanceId(occupant)));
        } else {
            out.push(InsertOutcome::Existing(InstanceId(0)));
            missing.push(i);
        }
    }
    if !missing.is_empty() {
        let keys: Vec<&[u8]> = missing
            .iter()
            .filter_map(|i| items[*i].0.unique.as_ref().map(|u| u.key.as_slice()))
            .collect();
        let stmt = c.prepare_cached(OCCUPANTS).await?;
        let found: HashMap<Vec<u8>, i64> = c
            .query(&stmt, &[&keys])
            .await?
            .iter()
            .map(|r| Ok((rows::col::<Vec<u8>>(r, 0)?, rows::col::<i64>(r, 1)?)))
            .collect::<Result<_, StoreError>>()?;
        for i in missing {
            let key = items[i].0.unique.as_ref().map(|u| u.key.clone()).unwrap_or_default();
            let Some(id) = found.get(&key) else {
                return Err(StoreError::unavailable(format!(
                    "instances[{i}].unique.key: its occupant left its scope while this insert ran; retry the insert"
                ))
                .into());
            };
            out[i] = InsertOutcome::Existing(InstanceId(*id));
        }
    }
    Ok(out)
}

/// Runs the array statement of `shape` ([`Shape::Plain`] or [`Shape::Keyed`]) over
/// `items`; its answers as PostgreSQL gives them.
async fn query_batch<C: GenericClient + Sync>(
    c: &C,
    shape: Shape,
    items: &[Item<'_>],
    now: Timestamp,
) -> OpResult<Vec<tokio_postgres::Row>> {
    debug_assert!(shape != Shape::One, "one plain row binds values, not arrays");
    let cols = Cols::of(items, now);
    let params = if shape == Shape::Keyed { cols.params() } else { cols.plain_params() };
    let stmt = c.prepare_cached(shape.statement()).await?;
    Ok(c.query(&stmt, &params).await?)
}

/// Which statement a batch takes. A row without a unique key goes in whatever the store
/// holds (no other row can occupy its place), so a batch of such rows needs no conflict
/// check, no occupant read and no ids drawn ahead to match answers to rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    /// One row without a unique key: [`INSERT_ONE`].
    One,
    /// Several rows, none with a unique key: [`INSERT_PLAIN`].
    Plain,
    /// Some row has a unique key: [`INSERT`].
    Keyed,
}

impl Shape {
    fn of(items: &[Item<'_>]) -> Shape {
        match items {
            _ if items.iter().any(|(n, _)| n.unique.is_some()) => Shape::Keyed,
            [_] => Shape::One,
            _ => Shape::Plain,
        }
    }

    fn statement(self) -> &'static str {
        match self {
            Shape::One => INSERT_ONE,
            Shape::Plain => INSERT_PLAIN,
            Shape::Keyed => INSERT,
        }
    }
}

/// Rows without unique keys, in batch order: each takes the next id from the table's
/// sequence as it goes in, so the returned ids, sorted, are the batch's ids in order
/// (whatever order `RETURNING` gives them in).
const INSERT_PLAIN: &str = "INSERT INTO instances (namespace, machine, machine_version, \
      business_key, queue, priority, concurrency_key, status, position, context, eligible_at, \
      parent_id, correlation_id, created_at, updated_at, invoked_by, base_priority) \
    SELECT namespace, machine, machine_version, business_key, queue, priority, \
      concurrency_key, 'runnable', position, context, eligible_at, parent_id, correlation_id, \
      $13, $13, invoked_by, priority \
    FROM unnest($1::text[], $2::text[], $3::int4[], $4::text[], $5::text[], $6::int2[], \
                $7::text[], $8::text[], $9::jsonb[], $10::timestamptz[], $11::text[], \
                $12::int8[], $14::text[]) WITH ORDINALITY \
      AS t(namespace, machine, machine_version, business_key, queue, priority, \
           concurrency_key, position, context, eligible_at, correlation_id, parent_id, \
           invoked_by, ord) \
    ORDER BY ord \
    RETURNING id";

/// Inserts rows without unique keys (see [`Shape::Plain`]); their ids in batch order.
async fn insert_plain<C: GenericClient + Sync>(
    c: &C,
    items: &[Item<'_>],
    now: Timestamp,
) -> OpResult<Vec<InsertOutcome>> {
    let rows = query_batch(c, Shape::Plain, items, now).await?;
    let mut ids = rows.iter().map(|r| rows::col::<i64>(r, 0)).collect::<Result<Vec<_>, _>>()?;
    if ids.len() != items.len() {
        // Cannot happen (a plain insert takes every row or fails); were it to, the ids
        // could not be matched to the batch, so say so rather than guess.
        return Err(StoreError::unavailable(format!(
            "instances: PostgreSQL answered {} ids for a batch of {}; look the instances up \
             (by business key or correlation id) before starting them again",
            ids.len(),
            items.len()
        ))
        .into());
    }
    ids.sort_unstable();
    Ok(ids.into_iter().map(|id| InsertOutcome::Inserted(InstanceId(id))).collect())
}

/// One row without a unique key: a plain `INSERT … VALUES` (its id from the same sequence).
/// The commonest insert, a single start, skips the batch statement's arrays, conflict
/// check and join, which cost it more server time than writing its row.
const INSERT_ONE: &str = "INSERT INTO instances (namespace, machine, machine_version, \
      business_key, queue, priority, concurrency_key, status, position, context, eligible_at, \
      parent_id, correlation_id, created_at, updated_at, invoked_by, base_priority) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, 'runnable', $8, $9, $10, $11, $12, $13, $13, $14, $6) \
    RETURNING id";

/// Inserts one row without a unique key (see [`Shape::One`]); its id.
async fn insert_one<C: GenericClient + Sync>(
    c: &C,
    (n, parent): &Item<'_>,
    now: Timestamp,
) -> OpResult<InstanceId> {
    let row = Instance::from_new(InstanceId(0), n, *parent, now);
    let stmt = c.prepare_cached(INSERT_ONE).await?;
    let inserted = c
        .query_one(
            &stmt,
            &[
                &row.namespace,
                &row.machine.name,
                &row.machine.version,
                &row.business_key,
                &row.queue,
                &row.priority.level(),
                &row.concurrency_key,
                &row.position,
                &row.context,
                &ts(row.eligible_at),
                &row.parent.map(|p| p.0),
                &row.correlation_id,
                &ts(now),
                &row.invoked_by,
            ],
        )
        .await?;
    Ok(InstanceId(rows::col(&inserted, 0)?))
}

#[derive(Default)]
struct Cols {
    namespace: Vec<String>,
    machine: Vec<String>,
    version: Vec<i32>,
    business_key: Vec<Option<String>>,
    queue: Vec<String>,
    priority: Vec<i16>,
    concurrency_key: Vec<Option<String>>,
    position: Vec<String>,
    context: Vec<serde_json::Value>,
    unique_key: Vec<Option<Vec<u8>>>,
    unique_scope: Vec<String>,
    eligible_at: Vec<std::time::SystemTime>,
    correlation_id: Vec<Option<String>>,
    parent: Vec<Option<i64>>,
    invoked_by: Vec<Option<String>>,
    now: Option<std::time::SystemTime>,
}

impl Cols {
    /// A batch's rows as columns, inserted at `now`.
    fn of(items: &[Item<'_>], now: Timestamp) -> Cols {
        let mut cols = Cols { now: Some(ts(now)), ..Cols::default() };
        for (n, parent) in items {
            cols.push(n, *parent, now);
        }
        cols
    }

    fn push(&mut self, n: &NewInstance, parent: Option<InstanceId>, now: Timestamp) {
        // The pure row builder decides every default (eligible_at never before now).
        let row = Instance::from_new(InstanceId(0), n, parent, now);
        self.namespace.push(row.namespace);
        self.machine.push(row.machine.name);
        self.version.push(row.machine.version);
        self.business_key.push(row.business_key);
        self.queue.push(row.queue);
        self.priority.push(row.priority.level());
        self.concurrency_key.push(row.concurrency_key);
        self.position.push(row.position);
        self.context.push(row.context);
        let scope = row.unique.as_ref().map_or_else(Vec::new, |u| u.scope.to_vec());
        let names: Vec<&str> = scope.iter().map(|s| s.name()).collect();
        self.unique_scope.push(format!("{{{}}}", names.join(",")));
        self.unique_key.push(row.unique.map(|u| u.key));
        self.eligible_at.push(ts(row.eligible_at));
        self.correlation_id.push(row.correlation_id);
        self.parent.push(row.parent.map(|p| p.0));
        self.invoked_by.push(row.invoked_by);
    }

    /// The parameters of [`INSERT_PLAIN`], which are the first 14 of [`INSERT`].
    fn plain_params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        vec![
            &self.namespace,
            &self.machine,
            &self.version,
            &self.business_key,
            &self.queue,
            &self.priority,
            &self.concurrency_key,
            &self.position,
            &self.context,
            &self.eligible_at,
            &self.correlation_id,
            &self.parent,
            &self.now,
            &self.invoked_by,
        ]
    }

    /// The parameters of [`INSERT`]: those of [`INSERT_PLAIN`], then the unique keys and
    /// scopes.
    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        let mut params = self.plain_params();
        params.push(&self.unique_key);
        params.push(&self.unique_scope);
        params
    }
}
