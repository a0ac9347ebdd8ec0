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

/// The page: every row in id order, so the next page starts after its last id even when
/// none of it could be taken; the ended ones locked (a live row is never deleted, so it is
/// read without a lock and its commits never wait for a prune). An ended row another
/// transaction holds, or one deleted since the page was read, comes back with only its
/// id, and is left for the next pass.
pub(crate) const PAGE: &str = "WITH page AS MATERIALIZED ( \
      SELECT id, status IN ('done', 'failed', 'cancelled') AS ended FROM instances \
      WHERE id > $1 ORDER BY id LIMIT $2 \
    ), held AS MATERIALIZED ( \
      SELECT i.id FROM instances i JOIN page p ON p.id = i.id \
      WHERE p.ended FOR UPDATE OF i SKIP LOCKED \
    ) \
    SELECT p.id, i.namespace, i.machine, i.status::text, i.updated_at, \
      EXISTS (SELECT 1 FROM instances q WHERE q.id = i.parent_id \
              AND q.status NOT IN ('done', 'failed', 'cancelled')) AS parent_live, \
      EXISTS (SELECT 1 FROM instances c WHERE c.parent_id = i.id) AS has_children, \
      EXISTS (SELECT 1 FROM dead_letters d WHERE d.instance_id = i.id) AS has_dead \
    FROM page p LEFT JOIN held h ON h.id = p.id \
    LEFT JOIN instances i ON i.id = p.id AND (NOT p.ended OR h.id IS NOT NULL) \
    ORDER BY p.id";

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
    let found = found?;
    let mut read = Vec::with_capacity(found.len());
    for r in &found {
        // Held by another transaction or deleted since: nothing to decide on this pass.
        let Some(namespace) = r.try_get::<_, Option<String>>(1)? else { continue };
        let updated_at: SystemTime = r.try_get(4)?;
        read.push(PruneCandidate {
            id: InstanceId(r.try_get(0)?),
            namespace,
            machine: r.try_get(2)?,
            status: rows::status(r.try_get(3)?)?,
            updated_at: from_ts(updated_at),
            parent_live: r.try_get(5)?,
            has_children: r.try_get(6)?,
            has_dead_letters: r.try_get(7)?,
        });
    }
    let last = found.last().map(|r| r.try_get(0)).transpose()?.map(InstanceId);
    let mut page = PrunePage { last, ..PrunePage::default() };
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
    use keel_core::ports::store::{InsertParams, PruneParams};
    use keel_core::{InstanceId, MachineRef, NewInstance, Timestamp};

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

    /// A page whose ended rows are all held by other transactions still moves the pass on
    /// past them: the rows after it are pruned in the same pass, not left for a pass that
    /// starts again from the lowest id.
    #[tokio::test]
    async fn a_page_of_held_rows_moves_the_pass_on() {
        let Some(store) = super::super::plans::fresh_schema_or_skip().await else { return };
        let new = || NewInstance::new(MachineRef::new("m", 1), "start");
        let ids: Vec<i64> = store
            .instance_insert(InsertParams {
                instances: vec![new(), new(), new()],
                now: Timestamp(0),
            })
            .await
            .expect("insert")
            .iter()
            .map(|o| o.id().0)
            .collect();
        let setup = store.client().await.expect("a connection");
        setup
            .batch_execute("UPDATE instances SET status = 'cancelled'")
            .await
            .expect("end them all");
        let holder = store.client().await.expect("a second connection");
        holder.batch_execute("BEGIN").await.expect("begin");
        holder
            .batch_execute(&format!(
                "SELECT id FROM instances WHERE id IN ({}, {}) FOR UPDATE",
                ids[0], ids[1]
            ))
            .await
            .expect("hold the first two");
        let params = |after: Option<i64>| PruneParams {
            namespace: None,
            machines: Vec::new(),
            except: Vec::new(),
            ended_before: Timestamp::from_millis(i64::MAX / 2),
            after: after.map(InstanceId),
            limit: 2,
        };
        let first = store.instance_prune(params(None)).await.expect("first page");
        assert_eq!(
            (first.instances, first.last),
            (0, Some(InstanceId(ids[1]))),
            "the held page is passed over, not taken for the end of the table"
        );
        let second = store.instance_prune(params(first.last.map(|l| l.0))).await.expect("page");
        assert_eq!(second.instances, 1, "the row after the held ones is pruned in this pass");
        holder.batch_execute("ROLLBACK").await.expect("rollback");
        let again = store.instance_prune(params(None)).await.expect("a new pass");
        assert_eq!(again.instances, 2, "the rows once held are pruned by the next pass");
    }
}
