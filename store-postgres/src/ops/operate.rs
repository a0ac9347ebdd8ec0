//! Operator reads and the worker registry: a machine's instances by page, what ended in a
//! window, and workers seen by heartbeat.

use crate::error::OpResult;
use crate::rows::{col, from_ts, ts};
use deadpool_postgres::GenericClient;
use keel_core::ids::{MachineRef, WorkerId};
use keel_core::ports::store::{
    ActivityBucket, ActivityParams, WORKER_LIST_MAX, WorkerBeatParams, WorkerRecord,
};
use keel_core::{StoreError, Timestamp};

/// Done and failed instances per machine and bucket.
pub(crate) async fn activity<C: GenericClient + Sync>(
    c: &C,
    p: &ActivityParams,
) -> OpResult<Vec<ActivityBucket>> {
    let stmt = c
        .prepare_cached(
            "SELECT namespace, machine, \
               floor(extract(epoch FROM updated_at - $1)::float8 * 1000 / $2::float8)::bigint AS bucket, \
               count(*) FILTER (WHERE status = 'done'), \
               count(*) FILTER (WHERE status = 'failed'), \
               coalesce(sum(greatest(extract(epoch FROM updated_at - created_at) * 1000, 0)), 0)::bigint \
             FROM instances \
             WHERE status IN ('done', 'failed') AND updated_at >= $1 AND updated_at < $3 \
               AND ($4::text IS NULL OR namespace = $4) \
             GROUP BY namespace, machine, bucket \
             ORDER BY namespace COLLATE \"C\", machine COLLATE \"C\", bucket",
        )
        .await?;
    let width = p.bucket_ms() as f64;
    let found = c.query(&stmt, &[&ts(p.since), &width, &ts(p.until), &p.namespace]).await?;
    Ok(found
        .iter()
        .map(|r| {
            Ok(ActivityBucket {
                namespace: col(r, 0)?,
                machine: col(r, 1)?,
                bucket: col(r, 2)?,
                completed: col::<i64>(r, 3)? as u64,
                failed: col::<i64>(r, 4)? as u64,
                turnaround_ms_total: col::<i64>(r, 5)? as u64,
            })
        })
        .collect::<Result<_, StoreError>>()?)
}

/// Records a heartbeat and forgets long-silent workers (one statement each, autocommit:
/// a heartbeat is idempotent).
pub(crate) async fn heartbeat<C: GenericClient + Sync>(
    c: &C,
    p: &WorkerBeatParams,
) -> OpResult<()> {
    let forget = c.prepare_cached("DELETE FROM workers WHERE last_seen_at < $1").await?;
    c.execute(&forget, &[&ts(p.forget_before)]).await?;
    let upsert = c
        .prepare_cached(
            "INSERT INTO workers (id, name, machines, namespaces, started_at, last_seen_at) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (id) DO UPDATE SET name = excluded.name, machines = excluded.machines, \
               namespaces = excluded.namespaces, started_at = excluded.started_at, \
               last_seen_at = excluded.last_seen_at",
        )
        .await?;
    let machines = serde_json::to_value(&p.machines).unwrap_or_default();
    c.execute(
        &upsert,
        &[&p.id.0, &p.name, &machines, &p.namespaces, &ts(p.started_at), &ts(p.now)],
    )
    .await?;
    Ok(())
}

/// Workers seen since a time, most recent first.
pub(crate) async fn workers<C: GenericClient + Sync>(
    c: &C,
    seen_since: Timestamp,
) -> OpResult<Vec<WorkerRecord>> {
    let stmt = c
        .prepare_cached(
            "SELECT id, name, machines, namespaces, started_at, last_seen_at FROM workers \
             WHERE last_seen_at >= $1 ORDER BY last_seen_at DESC, id COLLATE \"C\" LIMIT $2",
        )
        .await?;
    let found = c.query(&stmt, &[&ts(seen_since), &(WORKER_LIST_MAX as i64)]).await?;
    Ok(found
        .iter()
        .map(|r| {
            let machines: serde_json::Value = col(r, 2)?;
            let machines: Vec<MachineRef> = serde_json::from_value(machines).map_err(|e| {
                StoreError::conflict(format!("stored row: column machines cannot be decoded: {e}"))
            })?;
            Ok(WorkerRecord {
                id: WorkerId(col(r, 0)?),
                name: col(r, 1)?,
                machines,
                namespaces: col(r, 3)?,
                started_at: from_ts(col(r, 4)?),
                last_seen_at: from_ts(col(r, 5)?),
            })
        })
        .collect::<Result<_, StoreError>>()?)
}
