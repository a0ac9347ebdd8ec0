//! `history_page` and `history_trim`. A page is one indexed read of `(instance_id, seq)`
//! below the cursor, next to a read of the instance's row. A trim page is one short
//! transaction: the page's instances in id order, each with how many of its entries lie
//! beyond its newest `keep` (counted up to the cap, so a visit reads at most `keep` + cap
//! index entries) and the newest of those; `plan::history::trim` decides; one statement
//! deletes the oldest entries it names. Nothing is locked but the deleted history rows:
//! commits only append newer entries, which the bound `seq <= through` never reaches.

use super::{begin, begin_snapshot, commit_tx, end_tx};
use crate::error::OpResult;
use crate::rows::{self, HISTORY_COLS};
use deadpool_postgres::GenericClient;
use keel_core::plan;
use keel_core::plan::history::TrimCandidate;
use keel_core::ports::store::{HistoryPage, HistoryPageParams, HistoryTrimPage, HistoryTrimParams};
use keel_core::{InstanceId, StoreError};
use std::collections::BTreeSet;

const EXISTS: &str = "SELECT 1 FROM instances WHERE id = $1";

const TRIM_READ: &str = "SELECT i.id, i.namespace, i.machine, t.excess, t.through \
    FROM (SELECT id, namespace, machine FROM instances WHERE id > $1 ORDER BY id LIMIT $2) i \
    CROSS JOIN LATERAL ( \
      SELECT count(*) AS excess, max(h.seq) AS through FROM ( \
        SELECT seq FROM history WHERE instance_id = i.id ORDER BY seq DESC OFFSET $3 LIMIT $4 \
      ) h \
    ) t ORDER BY i.id";

const TRIM_DELETE: &str = "DELETE FROM history WHERE seq IN ( \
      SELECT h.seq FROM unnest($1::int8[], $2::int8[], $3::int8[]) AS t(instance_id, through, n) \
      CROSS JOIN LATERAL ( \
        SELECT seq FROM history WHERE instance_id = t.instance_id AND seq <= t.through \
        ORDER BY seq LIMIT t.n \
      ) h \
    ) RETURNING instance_id";

/// One page of an instance's history, newest first.
pub(crate) async fn page<C: GenericClient + Sync>(
    c: &C,
    p: &HistoryPageParams,
) -> OpResult<HistoryPage> {
    let exists = c.prepare_cached(EXISTS).await?;
    let entries = c
        .prepare_cached(&format!(
            "SELECT {HISTORY_COLS} FROM history WHERE instance_id = $1 AND seq < $2 \
             ORDER BY seq DESC LIMIT $3"
        ))
        .await?;
    let before = p.before.unwrap_or(i64::MAX);
    let limit = p.read_limit() as i64;
    // One snapshot for both reads (pipelined with their `BEGIN` and `COMMIT`), so a page
    // is never empty because its instance was inserted between them, nor read from an
    // instance the check saw gone.
    let (b, found, read, committed) = tokio::join!(
        begin_snapshot(c),
        async { c.query_opt(&exists, &[&p.instance.0]).await },
        async { c.query(&entries, &[&p.instance.0, &before, &limit]).await },
        commit_tx(c),
    );
    b?;
    let (found, read) = (found?, read?);
    committed?;
    if found.is_none() {
        return Err(StoreError::not_found(format!("instance {} does not exist", p.instance)).into());
    }
    let read = read.iter().map(rows::history).collect::<Result<Vec<_>, _>>()?;
    Ok(plan::history::page(p, read))
}

/// One trim page, in its own transaction.
pub(crate) async fn trim<C: GenericClient + Sync>(
    c: &C,
    p: &HistoryTrimParams,
) -> OpResult<HistoryTrimPage> {
    let stmt = c.prepare_cached(TRIM_READ).await?;
    let after = p.after.map_or(i64::MIN, |a| a.0);
    let (limit, keep, cap) = (p.limit as i64, p.keep as i64, p.count_cap() as i64);
    let (b, found) =
        tokio::join!(begin(c), async { c.query(&stmt, &[&after, &limit, &keep, &cap]).await });
    b?;
    let mut read = Vec::new();
    for r in &found? {
        let excess: i64 = r.try_get(3)?;
        read.push(TrimCandidate {
            id: InstanceId(r.try_get(0)?),
            namespace: r.try_get(1)?,
            machine: r.try_get(2)?,
            excess: u64::try_from(excess).unwrap_or(0),
            through: r.try_get(4)?,
        });
    }
    let plan = plan::history::trim(p, &read);
    let mut page = HistoryTrimPage { last: plan.last, ..HistoryTrimPage::default() };
    if !plan.trims.is_empty() {
        let ids: Vec<i64> = plan.trims.iter().map(|t| t.instance.0).collect();
        let through: Vec<i64> = plan.trims.iter().map(|t| t.through).collect();
        let counts: Vec<i64> =
            plan.trims.iter().map(|t| i64::try_from(t.count).unwrap_or(i64::MAX)).collect();
        let delete = c.prepare_cached(TRIM_DELETE).await?;
        let deleted = c.query(&delete, &[&ids, &through, &counts]).await?;
        let mut touched = BTreeSet::new();
        for r in &deleted {
            touched.insert(r.try_get::<_, i64>(0)?);
        }
        page.history = deleted.len() as u64;
        page.instances = touched.len() as u64;
    }
    end_tx(c, None).await?;
    Ok(page)
}
