//! `signal_deliver` (and a commit's outbox): resolve targets, lock them (id order), look up
//! dedup keys already in the inbox, plan with the core's `plan::deliver`, then insert the
//! planned signals and write the woken targets. Because the target row is locked before the inbox is
//! read or written, a racing `Await` commit either sees the signal or is woken by it.

use super::{Notices, begin_hot, end_tx_notices};
use crate::error::OpResult;
use crate::rows::{self, ts};
use deadpool_postgres::GenericClient;
use keel_core::inbox::Pending;
use keel_core::instance::{Instance, NewSignal, SignalTarget, check_batch};
use keel_core::plan::{self, deliver::DeliverRead};
use keel_core::ports::store::{BroadcastReport, DeliveryOutcome, SignalBroadcastParams};
use keel_core::{InstanceId, SignalId, Timestamp, limits};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::SystemTime;

/// A transaction: plan, write, notify, commit.
pub(crate) async fn run<C: GenericClient + Sync>(
    c: &C,
    signals: &[NewSignal],
    now: Timestamp,
    channel: &str,
) -> OpResult<Vec<DeliveryOutcome>> {
    // BEGIN goes out ahead of the plan's first read, in the same round trip.
    let (began, plan) = tokio::join!(begin_hot(c, signals.len()), plan(c, signals, now));
    began?;
    let plan = plan?;
    finish(c, &plan, Some((channel, Notices::default()))).await?;
    Ok(plan.outcomes)
}

/// What a delivery will write.
pub(crate) struct Delivery {
    /// Per input signal.
    pub(crate) outcomes: Vec<DeliveryOutcome>,
    ids: Vec<i64>,
    targets: Vec<i64>,
    names: Vec<String>,
    payloads: Vec<serde_json::Value>,
    dedup: Vec<Option<String>>,
    at: Vec<SystemTime>,
    priority: Vec<Option<i16>>,
    woken: Vec<Instance>,
    raised: Vec<Instance>,
}

impl Delivery {
    /// Whether any target was woken (work became ready).
    pub(crate) fn woke(&self) -> bool {
        !self.woken.is_empty()
    }
}

const RESOLVE: &str = "SELECT CASE WHEN k.id IS NOT NULL \
      THEN (SELECT i.id FROM instances i WHERE i.id = k.id) \
      WHEN k.parent IS NOT NULL \
      THEN (SELECT i.id FROM instances i WHERE i.parent_id = k.parent \
            AND i.invoked_by = k.key ORDER BY i.id DESC LIMIT 1) \
      ELSE (SELECT i.id FROM instances i WHERE i.namespace = k.ns AND i.machine = k.machine \
            AND i.business_key = k.key ORDER BY i.id DESC LIMIT 1) END \
    FROM unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::int8[]) WITH ORDINALITY \
      AS k(id, ns, machine, key, parent, ord) \
    ORDER BY k.ord";

const EXISTING: &str = "SELECT s.target_id, s.dedup_key, s.id FROM signals s \
    JOIN unnest($1::int8[], $2::text[]) AS d(t, k) ON s.target_id = d.t AND s.dedup_key = d.k";

const ALLOC: &str = "SELECT nextval('signals_id_seq') FROM generate_series(1, $1::int8)";

const INSERT: &str = "INSERT INTO signals (id, target_id, name, payload, dedup_key, inserted_at, \
    priority) SELECT * FROM unnest($1::int8[], $2::int8[], $3::text[], $4::jsonb[], $5::text[], \
    $6::timestamptz[], $7::int2[])";

/// The signals pending in the inboxes of `$1` (leaving out the `($2, $3)` target and id
/// pairs a commit consumes): per target, the total and the oldest `$4` by id and name.
/// Read after the targets are locked, so no delivery slips in before their drain.
pub(crate) const PENDING: &str = "SELECT target_id, total, id, name FROM ( \
      SELECT s.target_id, s.id, s.name, count(*) OVER (PARTITION BY s.target_id) AS total, \
        row_number() OVER (PARTITION BY s.target_id ORDER BY s.id) AS n \
      FROM signals s WHERE s.target_id = ANY($1::int8[]) \
        AND NOT EXISTS (SELECT 1 FROM unnest($2::int8[], $3::int8[]) AS x(t, s) \
                        WHERE x.t = s.target_id AND x.s = s.id) \
    ) p WHERE n <= $4 ORDER BY target_id, id";

/// Removes `(target, id)` pairs from the inboxes, where a NULL id stands for every signal
/// of that target (an inbox drained because its instance ended): a batch's consumption
/// and drains in one statement.
pub(crate) const REMOVE: &str = "DELETE FROM signals s \
    USING unnest($1::int8[], $2::int8[]) AS c(t, id) \
    WHERE s.target_id = c.t AND (c.id IS NULL OR s.id = c.id)";

/// How many rows per target [`PENDING`] lists.
pub(crate) fn pending_listed() -> i64 {
    limits::INBOX_DRAIN_LISTED_MAX as i64
}

/// The rows of [`PENDING`], per target.
pub(crate) fn pending_of(rows: &[tokio_postgres::Row]) -> OpResult<HashMap<i64, Pending>> {
    let mut out: HashMap<i64, Pending> = HashMap::new();
    for r in rows {
        let target: i64 = r.try_get(0)?;
        let total: i64 = r.try_get(1)?;
        let (id, name): (i64, String) = (r.try_get(2)?, r.try_get(3)?);
        let first = !out.contains_key(&target);
        let count = if first { u64::try_from(total).unwrap_or(0) } else { 0 };
        out.entry(target).or_default().push(SignalId(id), &name, count);
    }
    Ok(out)
}

/// Resolves targets to existing instance ids (a business key to its newest instance);
/// `None` for a target that does not exist.
pub(crate) async fn resolve<C: GenericClient + Sync>(
    c: &C,
    targets: &[&SignalTarget],
) -> OpResult<Vec<Option<InstanceId>>> {
    if targets.is_empty() {
        return Ok(Vec::new());
    }
    let (mut id, mut ns, mut machine, mut key) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut parent: Vec<Option<i64>> = Vec::new();
    for t in targets {
        match t {
            SignalTarget::Id(i) => {
                id.push(Some(i.0));
                ns.push(None);
                machine.push(None);
                key.push(None);
                parent.push(None);
            }
            SignalTarget::Key { namespace, machine: m, key: k } => {
                id.push(None);
                ns.push(Some(namespace.as_str()));
                machine.push(Some(m.as_str()));
                key.push(Some(k.as_str()));
                parent.push(None);
            }
            SignalTarget::Child { parent: p, state } => {
                id.push(None);
                ns.push(None);
                machine.push(None);
                key.push(Some(state.as_str()));
                parent.push(Some(p.0));
            }
        }
    }
    let stmt = c.prepare_cached(RESOLVE).await?;
    let found = c.query(&stmt, &[&id, &ns, &machine, &key, &parent]).await?;
    Ok(found
        .iter()
        .map(|r| rows::col::<Option<i64>>(r, 0).map(|id| id.map(InstanceId)))
        .collect::<Result<_, _>>()?)
}

/// Resolves and locks the targets and plans the delivery (`plan::deliver`); nothing is
/// written yet. Signals addressed by id need no resolving: the lock reads those rows, and
/// a target it does not find is missing. So a delivery by id sends its reads in one round
/// trip (with the caller's `BEGIN`), and only keys and children cost a second.
pub(crate) async fn plan<C: GenericClient + Sync>(
    c: &C,
    signals: &[NewSignal],
    now: Timestamp,
) -> OpResult<Delivery> {
    let by_id: Option<Vec<Option<InstanceId>>> = signals
        .iter()
        .map(|s| match s.target {
            SignalTarget::Id(id) => Some(Some(id)),
            _ => None,
        })
        .collect();
    let targets = match by_id {
        Some(targets) => targets,
        None => resolve(c, &signals.iter().map(|s| &s.target).collect::<Vec<_>>()).await?,
    };
    plan_resolved(c, signals, &targets, now).await
}

/// [`plan`] with the targets already resolved.
pub(crate) async fn plan_resolved<C: GenericClient + Sync>(
    c: &C,
    signals: &[NewSignal],
    targets: &[Option<InstanceId>],
    now: Timestamp,
) -> OpResult<Delivery> {
    plan_with(c, signals, targets, None, now).await
}

/// [`plan_resolved`] for a caller that already holds the lock on every target and read
/// its row in this transaction (the timer sweep): the rows are not read again.
pub(crate) async fn plan_held<C: GenericClient + Sync>(
    c: &C,
    signals: &[NewSignal],
    targets: &[Option<InstanceId>],
    held: &HashMap<i64, Instance>,
    now: Timestamp,
) -> OpResult<Delivery> {
    plan_with(c, signals, targets, Some(held), now).await
}

async fn plan_with<C: GenericClient + Sync>(
    c: &C,
    signals: &[NewSignal],
    targets: &[Option<InstanceId>],
    held: Option<&HashMap<i64, Instance>>,
    now: Timestamp,
) -> OpResult<Delivery> {
    let mut ids: Vec<i64> = targets.iter().flatten().map(|t| t.0).collect();
    ids.sort_unstable();
    ids.dedup();
    let (mut dt, mut dk) = (Vec::new(), Vec::new());
    for (s, t) in signals.iter().zip(targets) {
        if let (Some(t), Some(k)) = (t, &s.dedup_key) {
            dt.push(t.0);
            dk.push(k.as_str());
        }
    }
    let n = signals.len() as i64;
    // Prepared first, so the pipelined queries go out in this order: the lock must come
    // before the inbox is read.
    let lock = c.prepare_cached(&rows::LOCK_INSTANCES).await?;
    let existing = c.prepare_cached(EXISTING).await?;
    let alloc = c.prepare_cached(ALLOC).await?;
    let (locked, found, fresh) = tokio::join!(
        async { if held.is_some() { Ok(Vec::new()) } else { c.query(&lock, &[&ids]).await } },
        // Without a dedup key in the batch there is nothing to find.
        async {
            if dt.is_empty() { Ok(Vec::new()) } else { c.query(&existing, &[&dt, &dk]).await }
        },
        async { c.query(&alloc, &[&n]).await },
    );
    let mut read = DeliverRead::default();
    for r in &locked? {
        let row = rows::instance(r)?;
        read.rows.insert(row.id, row);
    }
    if let Some(held) = held {
        for id in &ids {
            if let Some(row) = held.get(id) {
                read.rows.insert(row.id, row.clone());
            }
        }
    }
    // A target is what the lock found: an id never resolved (a delivery by id), or one
    // whose row went between resolving and locking (pruned by another transaction), is
    // missing.
    read.targets = targets.iter().map(|t| t.filter(|id| read.rows.contains_key(id))).collect();
    for r in &found? {
        let (target, key, id): (i64, String, i64) =
            (rows::col(r, 0)?, rows::col(r, 1)?, rows::col(r, 2)?);
        read.dedup.insert((InstanceId(target), key), SignalId(id));
    }
    let fresh: Vec<SignalId> = fresh?
        .iter()
        .map(|r| rows::col(r, 0).map(SignalId))
        .collect::<Result<_, keel_core::StoreError>>()?;
    let plan = plan::deliver::deliver(read, signals, now);
    let n = plan.inserts.len();
    Ok(Delivery {
        outcomes: plan.outcomes(&fresh),
        ids: fresh[..n].iter().map(|id| id.0).collect(),
        targets: plan.inserts.iter().map(|i| i.target.0).collect(),
        names: plan.inserts.iter().map(|i| i.name.clone()).collect(),
        payloads: plan.inserts.iter().map(|i| i.payload.clone()).collect(),
        dedup: plan.inserts.iter().map(|i| i.dedup_key.clone()).collect(),
        at: plan.inserts.iter().map(|i| ts(i.inserted_at)).collect(),
        priority: plan.inserts.iter().map(|i| i.priority.map(keel_core::Priority::level)).collect(),
        woken: plan.woken,
        raised: plan.raised,
    })
}

/// Writes a planned delivery; with `end = Some((channel, notices))`, also ends the
/// transaction and sends `notices`, with the ready one when a target woke — all
/// pipelined.
pub(crate) async fn finish<C: GenericClient + Sync>(
    c: &C,
    d: &Delivery,
    end: Option<(&str, Notices)>,
) -> OpResult<()> {
    let insert = c.prepare_cached(INSERT).await?;
    let write = c.prepare_cached(rows::WRITE_INSTANCES).await?;
    let mut w = rows::InstanceWrite::default();
    // A delivery never changes a context or result (the planner's promise), so the write
    // leaves both columns alone instead of sending them back.
    for r in d.woken.iter().chain(&d.raised) {
        w.push_unchanged(r);
    }
    let ins = async {
        if d.ids.is_empty() {
            return Ok(0);
        }
        c.execute(
            &insert,
            &[&d.ids, &d.targets, &d.names, &d.payloads, &d.dedup, &d.at, &d.priority],
        )
        .await
    };
    let wake = async {
        if w.is_empty() {
            return Ok(0);
        }
        c.execute(&write, &w.params()).await
    };
    let tail = async {
        if let Some((ch, mut notices)) = end {
            notices.ready |= d.woke();
            end_tx_notices(c, ch, &notices).await?;
        }
        Ok::<_, crate::error::OpError>(())
    };
    let (inserted, woken, tail) = tokio::join!(ins, wake, tail);
    inserted?;
    woken?;
    tail?;
    Ok(())
}

/// The broadcast, one statement: read the matching targets in the statement's snapshot (id
/// order, at most `BROADCAST_MAX + 1`: the executing ones through the lease index, the
/// others through the list index, which leaves executing rows out); only when no more than
/// `BROADCAST_MAX` matched, lock them in id order (a target that ended or left the state
/// meanwhile drops out; one that a claim took meanwhile stays in), insert the event for each
/// (the dedup rule per target), wake the targets awaiting it (`outcome::deliver`), and
/// notify once if any woke.
pub(crate) static BROADCAST: LazyLock<String> = LazyLock::new(|| {
    // The target filter over the table alias `t`.
    let targets = |t: &str| {
        let in_state = rows::in_state(&format!("{t}.position"), 3);
        format!("{t}.namespace = $1 AND {t}.machine = $2 AND ($3::text IS NULL OR {in_state})")
    };
    let (o, i) = (targets("o"), targets("i"));
    format!(
        "WITH seen AS MATERIALIZED ( \
           SELECT id FROM ( \
             (SELECT o.id FROM instances o WHERE {o} \
                AND o.status NOT IN ('done', 'failed', 'cancelled', 'executing') \
              ORDER BY o.id LIMIT $4) \
             UNION ALL \
             (SELECT id FROM (SELECT o.id FROM instances o \
                WHERE {o} AND o.status = 'executing' OFFSET 0) executing \
              ORDER BY id LIMIT $4) \
           ) matched ORDER BY id LIMIT $4 \
         ), n AS (SELECT count(*) AS n FROM seen), \
         t AS MATERIALIZED ( \
           SELECT i.id FROM instances i \
           WHERE i.id IN (SELECT id FROM seen) AND (SELECT n FROM n) < $4 \
             AND i.status NOT IN ('done', 'failed', 'cancelled') AND {i} \
           ORDER BY i.id FOR NO KEY UPDATE \
         ), ins AS ( \
           INSERT INTO signals (target_id, name, payload, dedup_key, inserted_at) \
           SELECT t.id, $5, $6, $7, $8 FROM t ORDER BY t.id \
           ON CONFLICT (target_id, dedup_key) DO NOTHING \
           RETURNING target_id \
         ), woke AS ( \
           UPDATE instances i SET status = 'runnable', eligible_at = $8, updated_at = $8 \
           FROM ins WHERE i.id = ins.target_id AND i.status = 'awaiting_signal' \
             AND (i.awaits = '*' OR i.awaits = $5) \
           RETURNING i.id \
         ) \
         SELECT (SELECT n FROM n), (SELECT count(*) FROM ins), (SELECT count(*) FROM woke), \
           (SELECT count(*) FROM t), \
           (SELECT count(*) FROM (SELECT pg_notify($9, '') FROM woke LIMIT 1) x)"
    )
});

/// One statement (autocommit).
pub(crate) async fn broadcast<C: GenericClient + Sync>(
    c: &C,
    p: &SignalBroadcastParams,
    channel: &str,
) -> OpResult<BroadcastReport> {
    let stmt = c.prepare_cached(&BROADCAST).await?;
    let cap = limits::BROADCAST_MAX as i64 + 1;
    let r = c
        .query_one(
            &stmt,
            &[
                &p.namespace,
                &p.machine,
                &p.in_state,
                &cap,
                &p.name,
                &p.payload,
                &p.dedup_key,
                &ts(p.now),
                &channel,
            ],
        )
        .await?;
    let matched: i64 = rows::col(&r, 0)?;
    if matched >= cap {
        check_batch("broadcast targets", matched as usize, limits::BROADCAST_MAX)?;
    }
    Ok(BroadcastReport {
        matched: rows::col::<i64>(&r, 3)? as u64,
        delivered: rows::col::<i64>(&r, 1)? as u64,
        woke: rows::col::<i64>(&r, 2)? as u64,
    })
}
