//! Durable timers: a commit's cancel/arm/drop changes (one statement), the sweep (one
//! transaction per call, `FOR UPDATE SKIP LOCKED` so concurrent sweeps split the due
//! timers), the inspect listing, timer health and queue stats (one `GROUP BY` each).

use super::{begin, begin_hot, signal};
use crate::error::OpResult;
use crate::rows::{self, HistoryWrite, col, from_ts, ts};
use deadpool_postgres::GenericClient;

use keel_core::instance::Instance;
use keel_core::plan;
use keel_core::ports::store::{
    QueueStats, TimerNextDueParams, TimerRetimePage, TimerRetimeParams, TimerStatus,
    TimerSweepParams, TimerSweepReport,
};
use keel_core::timers::TimerRow;
use keel_core::{InstanceId, MachineRef, StoreError, TimerId, Timestamp, limits};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::SystemTime;
use tokio_postgres::Row;

/// A commit batch's timer changes in one statement: cancel the timers owned by the left
/// states (or their descendants), drop every timer of instances that became terminal, and
/// arm the new ones (never for a terminal instance). The deletes see the statement's
/// snapshot, so the freshly armed rows are untouched by them.
pub(crate) const CHANGE: &str = "WITH cancelled AS ( \
      DELETE FROM timers t USING unnest($1::int8[], $2::text[]) AS c(inst, state) \
      WHERE t.instance_id = c.inst \
        AND (t.state = c.state OR left(t.state, length(c.state) + 1) = c.state || '.') \
      RETURNING t.id \
    ), dropped AS ( \
      DELETE FROM timers t WHERE t.instance_id = ANY($3::int8[]) RETURNING t.id \
    ) \
    INSERT INTO timers (instance_id, namespace, machine, machine_version, state, spec, \
      next_fire_at, fire_count, armed_at) \
    SELECT a.inst, a.ns, a.machine, a.version, a.state, a.spec, a.due, 0, $11 \
    FROM unnest($4::int8[], $5::text[], $6::text[], $7::int4[], $8::text[], $9::jsonb[], \
      $10::timestamptz[]) WITH ORDINALITY AS a(inst, ns, machine, version, state, spec, due, ord) \
    ORDER BY a.ord";

/// The parameter arrays of [`CHANGE`].
#[derive(Default)]
pub(crate) struct TimerWrite {
    cancel_inst: Vec<i64>,
    cancel_state: Vec<String>,
    drop: Vec<i64>,
    inst: Vec<i64>,
    ns: Vec<String>,
    machine: Vec<String>,
    version: Vec<i32>,
    state: Vec<String>,
    spec: Vec<serde_json::Value>,
    due: Vec<SystemTime>,
    now: Option<SystemTime>,
    /// The earliest due time armed, for the sweepers' hint.
    earliest: Option<Timestamp>,
}

impl TimerWrite {
    /// A commit's changes for `row`: cancels, then the timers its plan arms.
    pub(crate) fn change(&mut self, row: &Instance, cancel: &[String], arm: &[TimerRow]) {
        for left in cancel {
            self.cancel_inst.push(row.id.0);
            self.cancel_state.push(left.clone());
        }
        for t in arm {
            self.inst.push(t.instance.0);
            self.ns.push(t.namespace.clone());
            self.machine.push(t.machine.name.clone());
            self.version.push(t.machine.version);
            self.state.push(t.spec.state.clone());
            self.spec.push(serde_json::to_value(&t.spec).unwrap_or_default());
            self.due.push(ts(t.next_fire_at));
            self.earliest = Some(self.earliest.map_or(t.next_fire_at, |e| e.min(t.next_fire_at)));
        }
    }

    /// The NOTIFY payload that tells sweepers this write armed timers (`None`: it armed
    /// none).
    pub(crate) fn hint(&self) -> Option<String> {
        self.earliest.map(hint_payload)
    }

    /// Every timer of `id` goes (the instance became terminal).
    pub(crate) fn drop_all(&mut self, id: InstanceId) {
        self.drop.push(id.0);
    }

    /// Whether there is nothing to write.
    pub(crate) fn is_empty(&self) -> bool {
        self.cancel_inst.is_empty() && self.drop.is_empty() && self.inst.is_empty()
    }

    /// The statement's parameters.
    pub(crate) fn params(
        &mut self,
        now: Timestamp,
    ) -> [&(dyn tokio_postgres::types::ToSql + Sync); 11] {
        self.now = Some(ts(now));
        [
            &self.cancel_inst,
            &self.cancel_state,
            &self.drop,
            &self.inst,
            &self.ns,
            &self.machine,
            &self.version,
            &self.state,
            &self.spec,
            &self.due,
            &self.now,
        ]
    }
}

/// Timer hints share the store's NOTIFY channel with the "work is ready" wake-ups; their
/// payload is this prefix and the earliest due time armed, in milliseconds.
const HINT_PREFIX: &str = "timer:";

/// The payload of a timer hint due at `due`.
pub(crate) fn hint_payload(due: Timestamp) -> String {
    format!("{HINT_PREFIX}{}", due.0)
}

/// What a notification on the store's channel says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Notice {
    /// Work may be ready (an empty payload, or anything that is not a timer hint).
    Ready,
    /// A commit armed timers, the earliest due then.
    Timer(Timestamp),
    /// A timer hint that does not parse: treated as lost hints.
    TimerUnreadable,
    /// Instances ended or were suspended: waiters for results re-read.
    Ended,
}

/// The payload of a "work is ready" wake-up.
pub(crate) const READY: &str = "";

/// The payload a transaction sends when it ended (or suspended) instances: callers waiting
/// for a result re-read them.
pub(crate) const ENDED: &str = "ended";

/// Reads a notification payload.
pub(crate) fn parse_notice(payload: &str) -> Notice {
    if payload == ENDED {
        return Notice::Ended;
    }
    match payload.strip_prefix(HINT_PREFIX) {
        None => Notice::Ready,
        Some(due) => {
            due.parse::<i64>().map_or(Notice::TimerUnreadable, |ms| Notice::Timer(Timestamp(ms)))
        }
    }
}

/// The statement that sends one notice inside the caller's transaction (delivered when
/// it commits, and never if it rolls back).
pub(crate) const HINT: &str = "SELECT pg_notify($1, $2)";

/// The earliest due time among the timers a sweep with these filters would fire: the
/// `timers_due` index in due order, stopping at the first match.
pub(crate) async fn next_due<C: GenericClient + Sync>(
    c: &C,
    p: &TimerNextDueParams,
) -> OpResult<Option<Timestamp>> {
    let stmt = c
        .prepare_cached(
            "SELECT t.next_fire_at FROM timers t \
             WHERE ($1::text IS NULL OR t.namespace = $1) \
               AND (cardinality($2::text[]) = 0 OR t.machine = ANY($2)) \
             ORDER BY t.next_fire_at, t.id LIMIT 1",
        )
        .await?;
    let found = c.query_opt(&stmt, &[&p.namespace, &p.machines]).await?;
    let Some(row) = found else { return Ok(None) };
    let due: SystemTime = row.try_get(0)?;
    Ok(Some(from_ts(due)))
}

/// Timer columns, in the order [`timer`] decodes them.
const TIMER_COLS: &str = "t.id, t.instance_id, t.namespace, t.machine, t.machine_version, \
    t.spec, t.next_fire_at, t.fire_count, t.armed_at";

pub(crate) fn timer(r: &Row) -> Result<TimerRow, StoreError> {
    let spec: serde_json::Value = col(r, 5)?;
    Ok(TimerRow {
        id: TimerId(col(r, 0)?),
        instance: InstanceId(col(r, 1)?),
        namespace: col(r, 2)?,
        machine: MachineRef { name: col(r, 3)?, version: col(r, 4)? },
        spec: serde_json::from_value(spec)
            .map_err(|e| StoreError::conflict(format!("stored timer spec: {e}")))?,
        next_fire_at: from_ts(col(r, 6)?),
        fire_count: col::<i32>(r, 7)? as u32,
        armed_at: from_ts(col(r, 8)?),
    })
}

/// Every timer of a set of instances (`$1`), by instance, soonest first.
pub(crate) fn of_instances_sql() -> String {
    format!(
        "SELECT {TIMER_COLS} FROM timers t WHERE t.instance_id = ANY($1::int8[]) \
         ORDER BY t.instance_id, t.next_fire_at, t.id"
    )
}

/// The inspect listing: an instance's timers, soonest first.
pub(crate) fn list_sql() -> String {
    format!(
        "SELECT {TIMER_COLS} FROM timers t WHERE t.instance_id = $1 \
         ORDER BY t.next_fire_at, t.id LIMIT {}",
        limits::TIMER_LIST_MAX
    )
}

/// Decodes [`list_sql`] rows.
pub(crate) fn list(found: &[Row]) -> Result<Vec<TimerRow>, StoreError> {
    found.iter().map(timer).collect()
}

/// The pick: due timers not held by another sweep, then each one's instance row, locked
/// also without waiting. A sweep never waits for a lock (a commit locks the instance before
/// its timers, the sweep the other way round), so it cannot deadlock with commits or other
/// sweeps; a timer whose instance is busy (`held` false, instance present) is left for the
/// next sweep and not counted. The instance columns start at column [`DUE_INSTANCE`].
pub(crate) static DUE: LazyLock<String> = LazyLock::new(due_sql);

/// Where the instance columns start in a [`DUE`] row.
const DUE_INSTANCE: usize = 11;

fn due_sql() -> String {
    let cols = rows::INSTANCE_COLS_I;
    format!(
        "WITH t AS MATERIALIZED ( \
           SELECT * FROM timers t WHERE t.next_fire_at <= $1 \
             AND ($2::text IS NULL OR t.namespace = $2) \
             AND (cardinality($3::text[]) = 0 OR t.machine = ANY($3)) \
           ORDER BY t.next_fire_at, t.id LIMIT $4 FOR UPDATE SKIP LOCKED \
         ) \
         SELECT {TIMER_COLS}, i.id IS NOT NULL, \
           i.id IS NULL AND EXISTS (SELECT 1 FROM instances x WHERE x.id = t.instance_id), \
           {cols} \
         FROM t LEFT JOIN LATERAL (SELECT * FROM instances WHERE id = t.instance_id \
           FOR NO KEY UPDATE SKIP LOCKED) i ON true \
         ORDER BY t.next_fire_at, t.id"
    )
}

/// A page of a machine version's timers after the cursor that may move, in id order,
/// locked (waiting for a sweep or commit holding one: the cursor must not pass a timer it
/// skipped). A timer may move when a target (`$5`, `timers::retime_targets` of
/// `TimerRetimeParams::timers`: which deployed entry each timer follows is the core's) of
/// the same state, event and kind gives it another interval: exactly the timers
/// `timers::retime` moves, leaving out the ones already moved. A second pass over a version
/// therefore returns and locks no timer, though the database still scans the timers
/// table to find that out (no index leads with the machine); the plan decides each move.
fn retime_read_sql() -> String {
    format!(
        "SELECT {TIMER_COLS} FROM timers t WHERE t.machine = $1 AND t.machine_version = $2 \
           AND t.id > $3 \
           AND EXISTS (SELECT 1 FROM jsonb_array_elements($5::jsonb) d(v) \
             WHERE d.v ->> 'state' = t.spec ->> 'state' \
               AND d.v ->> 'event' = t.spec ->> 'event' \
               AND d.v ->> 'kind' = t.spec ->> 'kind' \
               AND d.v -> 'interval' IS DISTINCT FROM t.spec -> 'interval') \
         ORDER BY t.id LIMIT $4 FOR UPDATE"
    )
}

/// The moved timers' new spec and due time; returns each moved timer's instance.
const RETIME: &str = "UPDATE timers t SET spec = u.spec, next_fire_at = u.due \
    FROM unnest($1::int8[], $2::jsonb[], $3::timestamptz[]) AS u(id, spec, due) \
    WHERE t.id = u.id RETURNING t.id";

/// One page of a retime in one transaction: lock the page, plan it with the core, write
/// the moved timers and their history, and hint the sweepers of the earliest new due time.
pub(crate) async fn retime<C: GenericClient + Sync>(
    c: &C,
    p: &TimerRetimeParams,
    channel: &str,
) -> OpResult<TimerRetimePage> {
    let read_stmt = c.prepare_cached(&retime_read_sql()).await?;
    let after = p.after.map_or(0, |t| t.0);
    let limit = p.limit as i64;
    let deployed = serde_json::to_value(keel_core::timers::retime_targets(&p.timers))
        .map_err(|e| StoreError::invalid(format!("timers: {e}")))?;
    let (began, found) = tokio::join!(begin(c), async {
        c.query(&read_stmt, &[&p.machine.name, &p.machine.version, &after, &limit, &deployed]).await
    });
    began?;
    let read: Vec<TimerRow> = found?.iter().map(timer).collect::<Result<_, StoreError>>()?;
    let plan = plan::timer::retime(p, &read);
    if plan.retimed.is_empty() {
        super::commit_tx(c).await?;
        return Ok(TimerRetimePage { retimed: Vec::new(), next: plan.next });
    }
    let ids: Vec<i64> = plan.retimed.iter().map(|r| r.next.id.0).collect();
    let specs: Vec<serde_json::Value> = plan
        .retimed
        .iter()
        .map(|r| serde_json::to_value(&r.next.spec))
        .collect::<Result<_, _>>()
        .map_err(|e| StoreError::invalid(format!("timer spec: {e}")))?;
    let dues: Vec<SystemTime> = plan.retimed.iter().map(|r| ts(r.next.next_fire_at)).collect();
    let instances: Vec<i64> = plan.retimed.iter().map(|r| r.next.instance.0).collect();
    let inst_stmt = c
        .prepare_cached(&format!(
            "SELECT {} FROM instances WHERE id = ANY($1::int8[])",
            rows::INSTANCE_COLS
        ))
        .await?;
    let upd = c.prepare_cached(RETIME).await?;
    let (updated, found) =
        tokio::join!(async { c.execute(&upd, &[&ids, &specs, &dues]).await }, async {
            c.query(&inst_stmt, &[&instances]).await
        });
    updated?;
    let mut held: HashMap<i64, Instance> = HashMap::new();
    for r in &found? {
        let row = rows::instance(r)?;
        held.insert(row.id.0, row);
    }
    let mut history = HistoryWrite::default();
    for r in &plan.retimed {
        if let Some(row) = held.get(&r.next.instance.0) {
            history.push(row, row.attempt, p.now, r.history.clone());
        }
    }
    let hist = c.prepare_cached(rows::WRITE_HISTORY).await?;
    let earliest = plan.retimed.iter().map(|r| r.next.next_fire_at).min().map(hint_payload);
    let notices = super::Notices { timer: earliest, ..super::Notices::default() };
    let (recorded, committed) = tokio::join!(
        async {
            if history.is_empty() { Ok(0) } else { c.execute(&hist, &history.params()).await }
        },
        super::end_tx_notices(c, channel, &notices)
    );
    recorded?;
    committed?;
    Ok(TimerRetimePage {
        retimed: plan.retimed.iter().map(|r| r.next.id).collect(),
        next: plan.next,
    })
}

const ADVANCE: &str = "UPDATE timers t SET fire_count = u.n, next_fire_at = u.due \
    FROM unnest($1::int8[], $2::int4[], $3::timestamptz[]) AS u(id, n, due) WHERE t.id = u.id";

const DELETE: &str = "DELETE FROM timers WHERE id = ANY($1::int8[])";

/// The paused queues, `(namespace, queue)`: a handful of rows, read once per sweep in the
/// pick's round trip, for the planner to hold the repeating ticks of their instances
/// (`plan::timer::Owner::of`).
const PAUSED: &str = "SELECT namespace, queue FROM queues WHERE paused";

/// A join deadline's parent as this transaction has left it (its lock taken at the pick).
static REREAD: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM instances WHERE id = $1", rows::INSTANCE_COLS));

/// Notes the sweep time of each swept scope. Every sweeper of a scope writes the same row,
/// so a row another sweep holds is left to it (`SKIP LOCKED`: that sweep notes about the
/// same time) instead of waiting for its commit; sweeps never queue behind one another
/// here. A scope swept for the first time gets its row. The insert is guarded by
/// `NOT EXISTS` as well as `ON CONFLICT`: the conflict check alone would wait for a sweep
/// whose transaction updated the row and has not committed yet.
const SWEPT: &str = "WITH scope AS (SELECT $1::text AS ns, m FROM unnest($2::text[]) AS m), \
    free AS ( \
      SELECT s.namespace, s.machine FROM timer_sweeps s \
      JOIN scope ON s.namespace = scope.ns AND s.machine = scope.m \
      FOR UPDATE OF s SKIP LOCKED \
    ), noted AS ( \
      UPDATE timer_sweeps s SET swept_at = $3 FROM free \
      WHERE s.namespace = free.namespace AND s.machine = free.machine \
    ) \
    INSERT INTO timer_sweeps (namespace, machine, swept_at) \
    SELECT scope.ns, scope.m, $3 FROM scope \
    WHERE NOT EXISTS (SELECT 1 FROM timer_sweeps s \
                      WHERE s.namespace = scope.ns AND s.machine = scope.m) \
    ON CONFLICT (namespace, machine) DO NOTHING";

/// One sweep transaction: pick the due timers with their instances (skipping other
/// sweeps' picks and busy instances; each instance locked and read once) and read the
/// paused queues in the same round trip, plan the firing
/// with the core's timer planner, deliver through the normal path with the rows already
/// held, record history, advance or delete the timers, note the sweep time, and notify
/// when an instance woke — the writes pipelined with the `COMMIT`. Three round trips; a sweep
/// that passes a join deadline writes the fires before it runs the deadlines' cancels, then
/// commits (a round trip more, besides the cancels' own).
pub(crate) async fn sweep<C: GenericClient + Sync>(
    c: &C,
    p: &TimerSweepParams,
    channel: &str,
) -> OpResult<TimerSweepReport> {
    let due = c.prepare_cached(&DUE).await?;
    let paused_stmt = c.prepare_cached(PAUSED).await?;
    let limit = p.limit as i64;
    let now_ts = ts(p.now);
    let (began, picked, paused) = tokio::join!(
        begin_hot(c, p.limit),
        async { c.query(&due, &[&now_ts, &p.namespace, &p.machines, &limit]).await },
        async { c.query(&paused_stmt, &[]).await }
    );
    began?;
    let found = picked?;
    let paused: Vec<(String, String)> =
        paused?.iter().map(|r| Ok((col(r, 0)?, col(r, 1)?))).collect::<Result<_, StoreError>>()?;
    let mut due = Vec::new();
    let mut held: HashMap<i64, Instance> = HashMap::new();
    for r in &found {
        // Busy instance: leave the timer for the next sweep.
        if col::<bool>(r, 10)? {
            continue;
        }
        due.push(timer(r)?);
        if col::<bool>(r, 9)? {
            let row = rows::instance_at(r, DUE_INSTANCE)?;
            held.insert(row.id.0, row);
        }
    }
    let owner = |id: InstanceId| plan::timer::Owner::of(held.get(&id.0), &paused);
    let plan = plan::timer::sweep(p, &due, owner);
    let adv_id: Vec<i64> = plan.advance.iter().map(|t| t.id.0).collect();
    let adv_n: Vec<i32> = plan.advance.iter().map(|t| t.fire_count as i32).collect();
    let adv_due: Vec<_> = plan.advance.iter().map(|t| ts(t.next_fire_at)).collect();
    let gone: Vec<i64> = plan.delete.iter().map(|id| id.0).collect();
    let mut history = HistoryWrite::default();
    for (instance, entry) in &plan.history {
        let row = &held[&instance.0];
        history.push(row, row.attempt, p.now, entry.clone());
    }
    let delivery = signal::plan_held(c, &plan.signals, &plan.targets(), &held, p.now).await?;
    let mut report = plan.report(&delivery.outcomes);
    // Every picked timer, those of busy instances too: a batch they fill is not short.
    report.picked = found.len() as u64;
    let (ns, machines): (Vec<String>, Vec<String>) =
        plan::timer::swept_scopes(p).into_iter().unzip();
    let ns = ns.into_iter().next().unwrap_or_else(|| "*".into());

    let adv = c.prepare_cached(ADVANCE).await?;
    let del = c.prepare_cached(DELETE).await?;
    let swept = c.prepare_cached(SWEPT).await?;
    let hist = c.prepare_cached(rows::WRITE_HISTORY).await?;
    let writes = async {
        let f_adv = async {
            if adv_id.is_empty() {
                Ok(0)
            } else {
                c.execute(&adv, &[&adv_id, &adv_n, &adv_due]).await
            }
        };
        let f_del = async { if gone.is_empty() { Ok(0) } else { c.execute(&del, &[&gone]).await } };
        let f_hist = async {
            if history.is_empty() { Ok(0) } else { c.execute(&hist, &history.params()).await }
        };
        let f_swept = async { c.execute(&swept, &[&ns, &machines, &now_ts]).await };
        let (advanced, deleted, recorded, noted) = tokio::join!(f_adv, f_del, f_hist, f_swept);
        advanced?;
        deleted?;
        recorded?;
        noted?;
        Ok::<_, tokio_postgres::Error>(())
    };
    if plan.join_deadlines.is_empty() {
        // The common sweep: every write pipelined with the COMMIT.
        let (written, finished) = tokio::join!(
            writes,
            signal::finish(c, &delivery, Some((channel, super::Notices::default())))
        );
        written?;
        finished?;
        return Ok(report);
    }
    // A passed join deadline wakes its parent (held locked above) and cancels the rest of
    // its children, in this transaction. The fires are written first, as the other stores
    // do: the delivery was planned from the rows read at the pick, so written after the
    // cancels it would put a child the deadline cancelled back as it was planned (woken,
    // with the fire in its inbox). Written before, the cancel reads the delivered row and
    // drains its inbox. (A fire never wakes or raises a parent waiting on its children.)
    // This costs one round trip more, only in a sweep that passes a deadline. Each parent
    // (locked at the pick, listed once) is read again before its deadline is planned once
    // an earlier deadline of the sweep has written: its cancels may have changed it (a
    // parent that is also a cancelled child of another), and a row as read at the pick
    // would be written back over that.
    let (written, delivered) = tokio::join!(writes, signal::finish(c, &delivery, None));
    written?;
    delivered?;
    let mut notices = super::Notices::ready(delivery.woke());
    // Until a deadline of this loop writes, every parent is as picked.
    let mut wrote = false;
    for id in &plan.join_deadlines {
        let Some(picked) = held.get(&id.0) else { continue };
        let reread;
        let row = if wrote {
            let stmt = c.prepare_cached(&REREAD).await?;
            let Some(found) = c.query_opt(&stmt, &[&id.0]).await? else { continue };
            reread = rows::instance(&found)?;
            &reread
        } else {
            picked
        };
        let planned = plan::parent::expire(row, p.now);
        wrote |= planned.changed;
        notices.ready |= planned.changed;
        let cancels = super::admin::write_parent_plan(c, planned, p.now).await?;
        let run = keel_core::plan::parent::FollowUps::cancels(cancels);
        super::admin::run_follow_ups(c, run, p.now, &mut notices).await?;
    }
    super::end_tx_notices(c, channel, &notices).await?;
    Ok(report)
}

/// Timer health per (namespace, machine), in name order.
pub(crate) async fn status<C: GenericClient + Sync>(
    c: &C,
    namespace: Option<&str>,
    now: Timestamp,
) -> OpResult<Vec<TimerStatus>> {
    let stmt = c
        .prepare_cached(
            "SELECT t.namespace, t.machine, count(*), min(t.next_fire_at), \
               count(*) FILTER (WHERE t.next_fire_at <= $2), \
               (SELECT max(s.swept_at) FROM timer_sweeps s \
                 WHERE s.namespace IN (t.namespace, '*') AND s.machine IN (t.machine, '*')) \
             FROM timers t WHERE $1::text IS NULL OR t.namespace = $1 \
             GROUP BY t.namespace, t.machine \
             ORDER BY t.namespace COLLATE \"C\", t.machine COLLATE \"C\"",
        )
        .await?;
    let found = c.query(&stmt, &[&namespace, &ts(now)]).await?;
    Ok(found
        .iter()
        .map(|r| {
            Ok(TimerStatus {
                namespace: col(r, 0)?,
                machine: col(r, 1)?,
                armed: col::<i64>(r, 2)? as u64,
                next_due: Some(from_ts(col(r, 3)?)),
                overdue: col::<i64>(r, 4)? as u64,
                last_sweep_at: col::<Option<SystemTime>>(r, 5)?.map(from_ts),
            })
        })
        .collect::<Result<_, StoreError>>()?)
}

/// Counts of non-terminal instances per (namespace, queue, machine), in name order.
pub(crate) async fn queue_stats<C: GenericClient + Sync>(
    c: &C,
    namespace: Option<&str>,
    now: Timestamp,
) -> OpResult<Vec<QueueStats>> {
    let stmt = c
        .prepare_cached(
            "SELECT namespace, queue, machine, \
               count(*) FILTER (WHERE status = 'runnable' AND eligible_at <= $2), \
               count(*) FILTER (WHERE status = 'runnable' AND eligible_at > $2), \
               count(*) FILTER (WHERE status = 'executing'), \
               count(*) FILTER (WHERE status IN ('awaiting_signal', 'awaiting_children')), \
               count(*) FILTER (WHERE status = 'suspended'), \
               min(eligible_at) FILTER (WHERE status = 'runnable' AND eligible_at <= $2) \
             FROM instances \
             WHERE status NOT IN ('done', 'failed', 'cancelled') \
               AND ($1::text IS NULL OR namespace = $1) \
             GROUP BY namespace, queue, machine \
             ORDER BY namespace COLLATE \"C\", queue COLLATE \"C\", machine COLLATE \"C\"",
        )
        .await?;
    let found = c.query(&stmt, &[&namespace, &ts(now)]).await?;
    Ok(found
        .iter()
        .map(|r| {
            Ok(QueueStats {
                namespace: col(r, 0)?,
                queue: col(r, 1)?,
                machine: col(r, 2)?,
                ready: col::<i64>(r, 3)? as u64,
                scheduled: col::<i64>(r, 4)? as u64,
                executing: col::<i64>(r, 5)? as u64,
                waiting: col::<i64>(r, 6)? as u64,
                suspended: col::<i64>(r, 7)? as u64,
                oldest_ready_at: col::<Option<SystemTime>>(r, 8)?.map(from_ts),
            })
        })
        .collect::<Result<_, StoreError>>()?)
}

#[cfg(test)]
mod tests {
    //! A retime reads only the timers that move: a second pass over a machine version
    //! whose timers were moved already returns no timer, as does a deployed list that
    //! names a timer twice with its current duration first, and a later deploy that
    //! changes a duration again moves them all again. A timer of a busy instance counts as
    //! picked.

    use super::super::plans::fresh_schema_or_skip;
    use keel_core::StepCommit;
    use keel_core::chart::{TimerArm, TimerKind};
    use keel_core::instance::ANY_SIGNAL;
    use keel_core::outcome::Outcome;
    use keel_core::ports::Store;
    use keel_core::ports::store::TimerSweepParams;
    use keel_testkit::conformance::support::{at, claim_id, commit_ok, ctx, insert_one, new_in};
    use std::time::Duration;

    fn sweep_at(ns: &str, limit: usize, now: keel_core::Timestamp) -> TimerSweepParams {
        TimerSweepParams { namespace: Some(ns.into()), machines: vec![], limit, now }
    }

    /// A timer whose instance a commit holds is left for the next sweep: not processed,
    /// but picked, so a batch it fills is reported full.
    #[tokio::test]
    async fn a_timer_of_a_busy_instance_counts_as_picked_not_processed() {
        let Some(s) = fresh_schema_or_skip().await else { return };
        let ns = "busy_timer";
        let mut ids = Vec::new();
        for n in 0..2 {
            let id = insert_one(&s, new_in(ns), at(n)).await;
            let claimed = claim_id(&s, ns, id, at(10)).await;
            let park = Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx(1), step: None };
            let mut c = StepCommit::new(id, claimed.token(), park);
            c.timers_arm = vec![TimerArm {
                state: "start".into(),
                event: "tick".into(),
                kind: TimerKind::After,
                interval: Duration::from_secs(1),
                max: None,
                then: None,
            }];
            commit_ok(&s, c, at(20)).await;
            ids.push(id);
        }
        // Another transaction holds the first instance, as a commit would.
        let holder = s.client().await.expect("a connection");
        holder.batch_execute("BEGIN").await.expect("begin");
        holder
            .execute("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE", &[&ids[0].0])
            .await
            .expect("lock");
        let report = s.timer_sweep(sweep_at(ns, 2, at(5_000))).await.expect("sweep");
        assert_eq!((report.processed, report.fired, report.picked), (1, 1, 2), "{report:?}");
        holder.batch_execute("ROLLBACK").await.expect("rollback");
        let report = s.timer_sweep(sweep_at(ns, 2, at(5_000))).await.expect("sweep");
        assert_eq!((report.processed, report.fired, report.picked), (1, 1, 1), "{report:?}");
    }

    #[tokio::test]
    async fn a_second_retime_pass_reads_nothing_and_a_new_duration_moves_every_timer_again() {
        let Some(s) = fresh_schema_or_skip().await else { return };
        keel_testkit::conformance::retime_reads_only_the_timers_that_move(&s).await;
    }
}
