//! `instance_prune`: one page of pruning in one transaction. The page's rows are read in
//! id order with what still refers to them; the ended ones are locked (`SKIP LOCKED`: a
//! row another transaction holds is left for the next pass rather than waited for, so
//! pruning never queues behind a commit); `plan::prune` decides; the chosen instances are
//! deleted with their history, inbox and timers, each table in one statement. Only ended
//! rows are locked or deleted, so a page never blocks a claim, a commit or a delivery.

use super::{begin, end_tx};
use crate::error::OpResult;
use crate::rows::{self, from_ts};
use deadpool_postgres::GenericClient;
use keel_core::InstanceId;
use keel_core::plan;
use keel_core::plan::prune::PruneCandidate;
use keel_core::ports::store::{PrunePage, PruneParams};
use std::time::SystemTime;

/// The page: its rows in id order; the ended ones locked (a live row is never deleted, so
/// it is read without a lock and its commits never wait for a prune), an ended row another
/// transaction holds left out.
pub(crate) const PAGE: &str = "WITH page AS MATERIALIZED ( \
      SELECT id, status IN ('done', 'failed', 'cancelled') AS ended FROM instances \
      WHERE id > $1 ORDER BY id LIMIT $2 \
    ), held AS ( \
      SELECT i.id FROM instances i JOIN page p ON p.id = i.id \
      WHERE p.ended FOR UPDATE OF i SKIP LOCKED \
    ) \
    SELECT i.id, i.namespace, i.machine, i.status::text, i.updated_at, \
      EXISTS (SELECT 1 FROM instances q WHERE q.id = i.parent_id \
              AND q.status NOT IN ('done', 'failed', 'cancelled')) AS parent_live, \
      EXISTS (SELECT 1 FROM instances c WHERE c.parent_id = i.id) AS has_children, \
      EXISTS (SELECT 1 FROM dead_letters d WHERE d.instance_id = i.id) AS has_dead \
    FROM page p JOIN instances i ON i.id = p.id \
    WHERE NOT p.ended OR p.id IN (SELECT id FROM held) ORDER BY i.id";

const HISTORY: &str = "DELETE FROM history WHERE instance_id = ANY($1::int8[])";
const SIGNALS: &str = "DELETE FROM signals WHERE target_id = ANY($1::int8[])";
const TIMERS: &str = "DELETE FROM timers WHERE instance_id = ANY($1::int8[])";
const INSTANCES: &str = "DELETE FROM instances WHERE id = ANY($1::int8[]) \
    AND status IN ('done', 'failed', 'cancelled')";

/// The transaction.
pub(crate) async fn run<C: GenericClient + Sync>(c: &C, p: &PruneParams) -> OpResult<PrunePage> {
    let stmt = c.prepare_cached(PAGE).await?;
    let after = p.after.map_or(i64::MIN, |a| a.0);
    let limit = p.limit as i64;
    let (b, found) = tokio::join!(begin(c), async { c.query(&stmt, &[&after, &limit]).await });
    b?;
    let mut read = Vec::new();
    for r in &found? {
        let updated_at: SystemTime = r.try_get(4)?;
        read.push(PruneCandidate {
            id: InstanceId(r.try_get(0)?),
            namespace: r.try_get(1)?,
            machine: r.try_get(2)?,
            status: rows::status(r.try_get(3)?)?,
            updated_at: from_ts(updated_at),
            parent_live: r.try_get(5)?,
            has_children: r.try_get(6)?,
            has_dead_letters: r.try_get(7)?,
        });
    }
    let mut page = PrunePage { last: read.last().map(|c| c.id), ..PrunePage::default() };
    let ids: Vec<i64> = plan::prune::page(p, &read).into_iter().map(|id| id.0).collect();
    if !ids.is_empty() {
        let (history, signals, timers, instances) = tokio::join!(
            c.prepare_cached(HISTORY),
            c.prepare_cached(SIGNALS),
            c.prepare_cached(TIMERS),
            c.prepare_cached(INSTANCES)
        );
        page.history = c.execute(&history?, &[&ids]).await?;
        page.signals = c.execute(&signals?, &[&ids]).await?;
        c.execute(&timers?, &[&ids]).await?;
        page.instances = c.execute(&instances?, &[&ids]).await?;
    }
    end_tx(c, None).await?;
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::PAGE;
    use keel_core::ports::Store;
    use keel_core::ports::store::InsertParams;
    use keel_core::{MachineRef, NewInstance, Timestamp};

    /// A prune page locks the ended rows it may delete and no live row: a commit or
    /// delivery on a live instance in the page's id range goes on while the page runs.
    #[tokio::test]
    async fn a_prune_page_locks_only_ended_rows() {
        let Some(store) = super::super::plans::fresh_schema_or_skip().await else { return };
        let new = || NewInstance::new(MachineRef::new("m", 1), "start");
        let ids: Vec<i64> = store
            .instance_insert(InsertParams { instances: vec![new(), new()], now: Timestamp(0) })
            .await
            .expect("insert")
            .iter()
            .map(|o| o.id().0)
            .collect();
        let (live, ended) = (ids[0], ids[1]);
        let page = store.client().await.expect("a connection");
        page.batch_execute(&format!(
            "UPDATE instances SET status = 'cancelled' WHERE id = {ended}"
        ))
        .await
        .expect("end one");
        page.batch_execute("BEGIN").await.expect("begin");
        let read: Vec<i64> = page
            .query(PAGE, &[&i64::MIN, &10_i64])
            .await
            .expect("page")
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(read, [live, ended], "the page reads live rows too, for its cursor");
        let other = store.client().await.expect("a second connection");
        let lock =
            |id: i64| format!("SELECT id FROM instances WHERE id = {id} FOR NO KEY UPDATE NOWAIT");
        other.batch_execute(&lock(live)).await.expect("a live row is not held by the page");
        let held = other.batch_execute(&lock(ended)).await.expect_err("the ended row is held");
        assert_eq!(
            held.code(),
            Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
            "{held:?}"
        );
        page.batch_execute("ROLLBACK").await.expect("rollback");
    }
}
