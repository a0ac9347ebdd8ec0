//! Leases: heartbeat (one `UPDATE … FROM unnest`), the reaper and graceful release (lock,
//! plan with the core's `plan::lease`, write back).

use super::{begin, end_tx};
use crate::error::OpResult;
use crate::rows::{self, HistoryWrite, lock_instances, ts, write_history, write_instances};
use deadpool_postgres::GenericClient;
use keel_core::InstanceId;
use keel_core::plan;
use keel_core::ports::store::{LeaseExtendParams, LeaseReapParams, LeaseReleaseParams};

/// The heartbeat. Rows are locked in id order first (the order every other write locks
/// instances in), so two heartbeats naming overlapping rows in different orders, or a
/// heartbeat and a group commit, wait for each other instead of deadlocking; the update
/// then touches only rows this statement already holds. `held` keeps the ordinal of the
/// lease that matched the row's token: a lease is named at most once
/// (`LeaseExtendParams::validate`), so at most one matches a row, and an instance named
/// under a stale token too answers `false` for that one.
const EXTEND: &str = "WITH l AS MATERIALIZED ( \
      SELECT * FROM unnest($1::int8[], $2::int8[]) WITH ORDINALITY AS l(id, token, ord)), \
    held AS MATERIALIZED ( \
      SELECT i.id, l.ord FROM instances i JOIN l ON l.id = i.id \
      WHERE i.fencing_token = l.token AND i.status = 'executing' AND i.lease_owner = $4 \
      ORDER BY i.id FOR NO KEY UPDATE OF i) \
    UPDATE instances i SET lease_expires_at = $3, updated_at = $5 \
    FROM held \
    WHERE i.id = held.id \
    RETURNING held.ord";

/// Extends the leases still held by `worker` under the named tokens (one statement; the
/// caller retries it on a deadlock).
pub(crate) async fn extend<C: GenericClient + Sync>(
    c: &C,
    p: &LeaseExtendParams,
) -> OpResult<Vec<bool>> {
    if p.leases.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = p.leases.iter().map(|l| l.0.0).collect();
    let tokens: Vec<i64> = p.leases.iter().map(|l| l.1.0).collect();
    let stmt = c.prepare_cached(EXTEND).await?;
    let rows =
        c.query(&stmt, &[&ids, &tokens, &ts(p.now.plus(p.lease)), &p.worker.0, &ts(p.now)]).await?;
    let mut out = vec![false; p.leases.len()];
    for r in rows {
        let ordinal: i64 = rows::col(&r, 0)?;
        if let Some(slot) = usize::try_from(ordinal - 1).ok().and_then(|i| out.get_mut(i)) {
            *slot = true;
        }
    }
    Ok(out)
}

fn reap_sql() -> String {
    format!(
        "SELECT {} FROM instances WHERE status = 'executing' \
           AND (($1::text IS NULL AND lease_expires_at < $2) OR lease_owner = $1) \
         ORDER BY lease_expires_at, id LIMIT $3 FOR NO KEY UPDATE SKIP LOCKED",
        rows::INSTANCE_COLS
    )
}

/// Returns expired (or the restarted owner's) leases to runnable, attempt + 1.
pub(crate) async fn reap<C: GenericClient + Sync>(
    c: &C,
    p: &LeaseReapParams,
    channel: &str,
) -> OpResult<Vec<InstanceId>> {
    begin(c).await?;
    let stmt = c.prepare_cached(&reap_sql()).await?;
    let owner = p.owner.as_ref().map(|w| w.0.as_str());
    let found = c.query(&stmt, &[&owner, &ts(p.now), &(p.limit as i64)]).await?;
    let due = found.iter().map(rows::instance).collect::<Result<Vec<_>, _>>()?;
    let mut next = Vec::with_capacity(due.len());
    let mut history = HistoryWrite::default();
    for w in plan::lease::reap(p, due) {
        for entry in w.history {
            history.push(&w.row, w.attempt, p.now, entry);
        }
        next.push(w.row);
    }
    write_instances(c, &next).await?;
    write_history(c, &history).await?;
    end_tx(c, (!next.is_empty()).then_some(channel)).await?;
    Ok(next.iter().map(|r| r.id).collect())
}

/// Releases the named leases (if still held) without counting an attempt.
pub(crate) async fn release<C: GenericClient + Sync>(
    c: &C,
    p: &LeaseReleaseParams,
    channel: &str,
) -> OpResult<Vec<bool>> {
    begin(c).await?;
    let ids: Vec<i64> = p.leases.iter().map(|l| l.0.0).collect();
    let plan = plan::lease::release(p, lock_instances(c, &ids).await?);
    let (out, next) = (plan.held, plan.rows);
    write_instances(c, &next).await?;
    end_tx(c, (!next.is_empty()).then_some(channel)).await?;
    Ok(out)
}
