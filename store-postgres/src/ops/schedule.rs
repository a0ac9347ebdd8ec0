//! Stored schedule states (`Store::schedule_pause`, `Store::schedule_fired`,
//! `Store::schedule_states`, `Store::schedule_forget`). A change runs in one transaction under a lock per
//! namespace, so the count the core's `plan_pause` or `plan_fired` checks against its
//! bound, and the row it compares with, are exact.

use super::{begin, commit_tx};
use crate::error::OpResult;
use crate::rows::{col, from_ts, ts};
use deadpool_postgres::GenericClient;
use keel_core::StoreError;
use keel_core::ports::store::{
    ScheduleFiredParams, ScheduleForgetParams, SchedulePauseParams, ScheduleState,
};
use keel_core::schedule::{SCHEDULE_STATES_MAX, plan_fired, plan_pause};
use std::time::SystemTime;
use tokio_postgres::Row;

/// Stores a pause or resume and returns the state.
pub(crate) async fn pause<C: GenericClient + Sync>(
    c: &C,
    p: &SchedulePauseParams,
) -> OpResult<ScheduleState> {
    begin(c).await?;
    let (current, held) = current_and_held(c, &p.namespace, &p.name).await?;
    let Some(next) = plan_pause(current.as_ref(), held, p)? else {
        commit_tx(c).await?;
        return Ok(current.expect("an unchanged state is a stored one"));
    };
    // The fired tick is written as planned: kept, or re-anchored by a resume.
    let write = c
        .prepare_cached(
            "INSERT INTO schedule_states (namespace, name, paused, changed_at, fired_through) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (namespace, name) DO UPDATE SET \
             paused = excluded.paused, changed_at = excluded.changed_at, \
             fired_through = excluded.fired_through",
        )
        .await?;
    let (changed_at, fired_through) = (next.changed_at.map(ts), next.fired_through.map(ts));
    c.execute(&write, &[&next.namespace, &next.name, &next.paused, &changed_at, &fired_through])
        .await?;
    commit_tx(c).await?;
    Ok(next)
}

/// Deletes the named states of a namespace (under its lock, so a change planned against
/// the count waits for it) and returns how many went.
pub(crate) async fn forget<C: GenericClient + Sync>(
    c: &C,
    p: &ScheduleForgetParams,
) -> OpResult<u64> {
    begin(c).await?;
    lock_namespace(c, &p.namespace).await?;
    let delete = c
        .prepare_cached("DELETE FROM schedule_states WHERE namespace = $1 AND name = ANY($2)")
        .await?;
    let deleted = c.execute(&delete, &[&p.namespace, &p.names]).await?;
    commit_tx(c).await?;
    Ok(deleted)
}

/// Records a fired tick and returns the state.
pub(crate) async fn fired<C: GenericClient + Sync>(
    c: &C,
    p: &ScheduleFiredParams,
) -> OpResult<ScheduleState> {
    begin(c).await?;
    let (current, held) = current_and_held(c, &p.namespace, &p.name).await?;
    let Some(next) = plan_fired(current.as_ref(), held, p)? else {
        commit_tx(c).await?;
        return Ok(current.expect("an unchanged state is a stored one"));
    };
    // The pause is left as stored: only the fired tick changes on an existing row.
    let write = c
        .prepare_cached(
            "INSERT INTO schedule_states (namespace, name, paused, changed_at, fired_through) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (namespace, name) DO UPDATE SET \
             fired_through = excluded.fired_through",
        )
        .await?;
    let (changed_at, fired_through) = (next.changed_at.map(ts), next.fired_through.map(ts));
    c.execute(&write, &[&next.namespace, &next.name, &next.paused, &changed_at, &fired_through])
        .await?;
    commit_tx(c).await?;
    Ok(next)
}

/// Takes the namespace's lock (until the transaction ends), then reads the schedule's
/// stored state, if any, and how many states the namespace holds (counted up to
/// [`SCHEDULE_STATES_MAX`]).
async fn current_and_held<C: GenericClient + Sync>(
    c: &C,
    namespace: &str,
    name: &str,
) -> OpResult<(Option<ScheduleState>, usize)> {
    lock_namespace(c, namespace).await?;
    let read = c
        .prepare_cached(
            "SELECT namespace, name, paused, changed_at, fired_through FROM schedule_states \
             WHERE namespace = $1 AND name = $2",
        )
        .await?;
    let current = c.query_opt(&read, &[&namespace, &name]).await?.map(|r| state(&r)).transpose()?;
    let count = c
        .prepare_cached(
            "SELECT count(*) FROM (SELECT 1 FROM schedule_states WHERE namespace = $1 LIMIT $2) s",
        )
        .await?;
    let held: i64 = c.query_one(&count, &[&namespace, &(SCHEDULE_STATES_MAX as i64)]).await?.get(0);
    Ok((current, usize::try_from(held).unwrap_or(SCHEDULE_STATES_MAX)))
}

/// Takes the lock that serializes changes of a namespace's states (until the transaction
/// ends). Its key names the schema too: deployments in two schemas of one database share
/// the advisory lock space, and must not wait for each other's namespaces.
async fn lock_namespace<C: GenericClient + Sync>(c: &C, namespace: &str) -> OpResult<()> {
    let lock = c
        .prepare_cached(
            "SELECT pg_advisory_xact_lock(hashtextextended(\
             'keel schedule_states ' || current_schema() || ' ' || $1, 0))",
        )
        .await?;
    c.execute(&lock, &[&namespace]).await?;
    Ok(())
}

/// A namespace's states in name order, at most [`SCHEDULE_STATES_MAX`].
pub(crate) async fn states<C: GenericClient + Sync>(
    c: &C,
    namespace: &str,
) -> OpResult<Vec<ScheduleState>> {
    let stmt = c
        .prepare_cached(
            "SELECT namespace, name, paused, changed_at, fired_through FROM schedule_states \
             WHERE namespace = $1 ORDER BY name COLLATE \"C\" LIMIT $2",
        )
        .await?;
    let rows = c.query(&stmt, &[&namespace, &(SCHEDULE_STATES_MAX as i64)]).await?;
    Ok(rows.iter().map(state).collect::<Result<_, StoreError>>()?)
}

fn state(r: &Row) -> Result<ScheduleState, StoreError> {
    Ok(ScheduleState {
        namespace: col(r, 0)?,
        name: col(r, 1)?,
        paused: col(r, 2)?,
        changed_at: col::<Option<SystemTime>>(r, 3)?.map(from_ts),
        fired_through: col::<Option<SystemTime>>(r, 4)?.map(from_ts),
    })
}

#[cfg(test)]
mod tests {
    use super::{begin, lock_namespace};
    use crate::ops::plans::fresh_schema_or_skip;
    use std::time::Duration;

    /// Two deployments in two schemas of one database: a change to one's `default`
    /// namespace does not wait for the other's, while a second change in the same schema
    /// does.
    #[tokio::test]
    async fn a_namespace_lock_holds_up_its_own_schema_only() {
        let Some(a) = fresh_schema_or_skip().await else { return };
        let Some(b) = fresh_schema_or_skip().await else { return };
        let holder = a.client().await.expect("client");
        begin(&holder).await.expect("begin");
        lock_namespace(&holder, "default").await.expect("lock");

        let other = b.client().await.expect("client");
        begin(&other).await.expect("begin");
        let taken =
            tokio::time::timeout(Duration::from_secs(10), lock_namespace(&other, "default"));
        assert!(taken.await.is_ok(), "the other schema's `default` waited for this one's");
        other.batch_execute("ROLLBACK").await.expect("rollback");

        let same = a.client().await.expect("client");
        begin(&same).await.expect("begin");
        let waited =
            tokio::time::timeout(Duration::from_millis(300), lock_namespace(&same, "default"));
        assert!(waited.await.is_err(), "a second change in the same schema did not wait");
        holder.batch_execute("ROLLBACK").await.expect("rollback");
    }
}
