//! `instance_prune`: one page of pruning in one transaction. The page's rows are read in
//! id order with what still refers to them, locked (`SKIP LOCKED`: a row another
//! transaction holds is left for the next pass rather than waited for, so pruning never
//! queues behind a commit); `plan::prune` decides; the chosen instances are deleted with
//! their history, inbox and timers, each table in one statement. Only terminal rows are
//! ever deleted, and claims only lock runnable rows, so a page never blocks a claim.

use super::{begin, end_tx};
use crate::error::OpResult;
use crate::rows::{self, from_ts};
use deadpool_postgres::GenericClient;
use keel_core::InstanceId;
use keel_core::plan;
use keel_core::plan::prune::PruneCandidate;
use keel_core::ports::store::{PrunePage, PruneParams};
use std::time::SystemTime;

const PAGE: &str = "SELECT i.id, i.namespace, i.machine, i.status::text, i.updated_at, \
      EXISTS (SELECT 1 FROM instances q WHERE q.id = i.parent_id \
              AND q.status NOT IN ('done', 'failed', 'cancelled')) AS parent_live, \
      EXISTS (SELECT 1 FROM instances c WHERE c.parent_id = i.id) AS has_children, \
      EXISTS (SELECT 1 FROM dead_letters d WHERE d.instance_id = i.id) AS has_dead \
    FROM instances i WHERE i.id > $1 ORDER BY i.id LIMIT $2 FOR UPDATE OF i SKIP LOCKED";

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
