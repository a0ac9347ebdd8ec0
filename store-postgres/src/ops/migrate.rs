//! `instance_migrate`: one page of a chart version migration in one transaction. The page's
//! rows are locked in id order (waiting for a running commit, never skipping a row) and
//! read with their timers; `plan::migrate` decides; the moves are written in batches: the
//! rows, their history, and each moved instance's timers replaced (kept ones with their
//! due time and fire count). A timer hint goes out with the `COMMIT` when timers were
//! written, so a sweeper asleep until a later time wakes for them.

use super::{Notices, begin, end_tx_notices, timer};
use crate::error::OpResult;
use crate::rows::{self, HistoryWrite, ts};
use deadpool_postgres::GenericClient;
use keel_core::plan;
use keel_core::ports::store::{MigratePage, MigrateParams};
use keel_core::timers::TimerRow;
use std::collections::HashMap;
use std::sync::LazyLock;

static PAGE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM instances \
         WHERE machine = $1 AND machine_version = $2 \
           AND status NOT IN ('done', 'failed', 'cancelled') \
           AND ($3::text IS NULL OR namespace = $3) AND id > $4 \
         ORDER BY id LIMIT $5 FOR NO KEY UPDATE",
        rows::INSTANCE_COLS
    )
});

const VERSION: &str = "UPDATE instances SET machine_version = $2 WHERE id = ANY($1::int8[])";

const TIMERS_DROP: &str = "DELETE FROM timers WHERE instance_id = ANY($1::int8[])";

const TIMERS_PUT: &str = "INSERT INTO timers (instance_id, namespace, machine, \
    machine_version, state, spec, next_fire_at, fire_count, armed_at) \
    SELECT * FROM unnest($1::int8[], $2::text[], $3::text[], $4::int4[], $5::text[], \
      $6::jsonb[], $7::timestamptz[], $8::int4[], $9::timestamptz[])";

/// The transaction.
pub(crate) async fn run<C: GenericClient + Sync>(
    c: &C,
    p: &MigrateParams,
    channel: &str,
) -> OpResult<MigratePage> {
    let stmt = c.prepare_cached(&PAGE).await?;
    let version = p.migration.from_version() as i32;
    let after = p.after.map_or(i64::MIN, |a| a.0);
    let limit = p.limit as i64;
    let (b, found) = tokio::join!(begin(c), async {
        c.query(&stmt, &[&p.migration.machine(), &version, &p.namespace, &after, &limit]).await
    });
    b?;
    let found = found?;
    let mut read = Vec::with_capacity(found.len());
    for r in &found {
        read.push((rows::instance(r)?, Vec::new()));
    }
    let ids: Vec<i64> = read.iter().map(|(r, _)| r.id.0).collect();
    let mut timers: HashMap<i64, Vec<TimerRow>> = HashMap::new();
    if !ids.is_empty() {
        let stmt = c.prepare_cached(&timer::of_instances_sql()).await?;
        for r in &c.query(&stmt, &[&ids]).await? {
            let t = timer::timer(r)?;
            timers.entry(t.instance.0).or_default().push(t);
        }
    }
    for (row, list) in &mut read {
        *list = timers.remove(&row.id.0).unwrap_or_default();
    }
    let last = read.last().map(|(r, _)| r.id);
    let plan = plan::migrate::page(p, read);

    let mut history = HistoryWrite::default();
    let mut moved = Vec::with_capacity(plan.rows.len());
    for w in &plan.rows {
        for e in &w.history {
            history.push(&w.row, w.attempt, p.now, e.clone());
        }
        moved.push(w.row.clone());
    }
    let moved_ids: Vec<i64> = moved.iter().map(|r| r.id.0).collect();
    let put: Vec<&TimerRow> = plan.timers.iter().flatten().collect();
    rows::write_instances(c, &moved).await?;
    if !moved_ids.is_empty() {
        // The shared row writer leaves a row's machine alone; a migration changes its version.
        let stmt = c.prepare_cached(VERSION).await?;
        let to = p.migration.to_version() as i32;
        c.execute(&stmt, &[&moved_ids, &to]).await?;
    }
    rows::write_history(c, &history).await?;
    if !moved_ids.is_empty() {
        let stmt = c.prepare_cached(TIMERS_DROP).await?;
        c.execute(&stmt, &[&moved_ids]).await?;
    }
    let mut notices = Notices::default();
    if !put.is_empty() {
        let inst: Vec<i64> = put.iter().map(|t| t.instance.0).collect();
        let ns: Vec<&str> = put.iter().map(|t| t.namespace.as_str()).collect();
        let machine: Vec<&str> = put.iter().map(|t| t.machine.name.as_str()).collect();
        let version: Vec<i32> = put.iter().map(|t| t.machine.version).collect();
        let state: Vec<&str> = put.iter().map(|t| t.spec.state.as_str()).collect();
        let spec: Vec<serde_json::Value> =
            put.iter().map(|t| serde_json::to_value(&t.spec).unwrap_or_default()).collect();
        let due: Vec<_> = put.iter().map(|t| ts(t.next_fire_at)).collect();
        let count: Vec<i32> = put.iter().map(|t| t.fire_count as i32).collect();
        let armed: Vec<_> = put.iter().map(|t| ts(t.armed_at)).collect();
        let stmt = c.prepare_cached(TIMERS_PUT).await?;
        c.execute(&stmt, &[&inst, &ns, &machine, &version, &state, &spec, &due, &count, &armed])
            .await?;
        notices.timer = put.iter().map(|t| t.next_fire_at).min().map(timer::hint_payload);
    }
    end_tx_notices(c, channel, &notices).await?;
    Ok(MigratePage { items: plan.items, last })
}
