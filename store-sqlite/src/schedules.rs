//! Stored schedule states (`Store::schedule_pause`, `Store::schedule_fired`,
//! `Store::schedule_states`, `Store::schedule_forget`): the store reads the current row and the namespace's count,
//! the core's `plan_pause` or `plan_fired` decides, and the store writes what it decided.
//! Writes run in the one writer's transaction, so the row and count it read are exact.

use crate::error::corrupt;
use crate::rows::Db;
use keel_core::ports::store::{
    ScheduleFiredParams, ScheduleForgetParams, SchedulePauseParams, ScheduleState,
};
use keel_core::schedule::{SCHEDULE_STATES_MAX, plan_fired, plan_pause};
use keel_core::{StoreResult, Timestamp};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

/// Stores a pause or resume (in the caller's write transaction, `p` checked by the
/// caller before it began) and returns the state.
pub(crate) async fn schedule_pause(
    db: &mut Db<'_>,
    p: &SchedulePauseParams,
) -> StoreResult<ScheduleState> {
    let (current, held) = current_and_held(db, &p.namespace, &p.name).await?;
    let Some(next) = plan_pause(current.as_ref(), held, p)? else {
        return Ok(current.expect("an unchanged state is a stored one"));
    };
    // The fired tick is written as planned: kept, or re-anchored by a resume.
    sqlx::query(
        "INSERT INTO keel_schedule_states (namespace, name, paused, changed_at, fired_through) \
         VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace, name) DO UPDATE SET \
         paused = excluded.paused, changed_at = excluded.changed_at, \
         fired_through = excluded.fired_through",
    )
    .bind(&next.namespace)
    .bind(&next.name)
    .bind(next.paused)
    .bind(next.changed_at.map(|t| t.0))
    .bind(next.fired_through.map(|t| t.0))
    .execute(&mut *db.conn)
    .await
    .map_err(db.err("storing a schedule state"))?;
    Ok(next)
}

/// Deletes the named states of a namespace (in the caller's write transaction, `p`
/// checked by the caller before it began) and returns how many went.
pub(crate) async fn schedule_forget(db: &mut Db<'_>, p: &ScheduleForgetParams) -> StoreResult<u64> {
    if p.names.is_empty() {
        return Ok(0);
    }
    // One statement for every name: at most SCHEDULE_STATES_MAX of them (checked by the caller),
    // passed as one JSON array, so no bound on bound variables applies.
    let names = serde_json::to_string(&p.names)
        .map_err(|e| keel_core::StoreError::invalid(format!("names: {e}")))?;
    let done = sqlx::query(
        "DELETE FROM keel_schedule_states WHERE namespace = ? \
         AND name IN (SELECT value FROM json_each(?))",
    )
    .bind(&p.namespace)
    .bind(names)
    .execute(&mut *db.conn)
    .await
    .map_err(db.err("forgetting a schedule state"))?;
    Ok(done.rows_affected())
}

/// Records a fired tick (in the caller's write transaction, `p` checked by the caller
/// before it began) and returns the state.
pub(crate) async fn schedule_fired(
    db: &mut Db<'_>,
    p: &ScheduleFiredParams,
) -> StoreResult<ScheduleState> {
    let (current, held) = current_and_held(db, &p.namespace, &p.name).await?;
    let Some(next) = plan_fired(current.as_ref(), held, p)? else {
        return Ok(current.expect("an unchanged state is a stored one"));
    };
    // The pause is left as stored: only the fired tick changes on an existing row.
    sqlx::query(
        "INSERT INTO keel_schedule_states (namespace, name, paused, changed_at, fired_through) \
         VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace, name) DO UPDATE SET \
         fired_through = excluded.fired_through",
    )
    .bind(&next.namespace)
    .bind(&next.name)
    .bind(next.paused)
    .bind(next.changed_at.map(|t| t.0))
    .bind(next.fired_through.map(|t| t.0))
    .execute(&mut *db.conn)
    .await
    .map_err(db.err("recording a fired schedule tick"))?;
    Ok(next)
}

/// The schedule's stored state, if any, and how many states its namespace holds (counted
/// up to [`SCHEDULE_STATES_MAX`]).
async fn current_and_held(
    db: &mut Db<'_>,
    namespace: &str,
    name: &str,
) -> StoreResult<(Option<ScheduleState>, usize)> {
    let current = sqlx::query(
        "SELECT namespace, name, paused, changed_at, fired_through FROM keel_schedule_states \
         WHERE namespace = ? AND name = ?",
    )
    .bind(namespace)
    .bind(name)
    .fetch_optional(&mut *db.conn)
    .await
    .map_err(db.err("reading a schedule state"))?
    .map(|r| state(db.file, &r))
    .transpose()?;
    let held: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM (SELECT 1 FROM keel_schedule_states WHERE namespace = ? LIMIT +?)",
    )
    .bind(namespace)
    .bind(SCHEDULE_STATES_MAX as i64)
    .fetch_one(&mut *db.conn)
    .await
    .map_err(db.err("counting schedule states"))?;
    Ok((current, usize::try_from(held).unwrap_or(SCHEDULE_STATES_MAX)))
}

/// A namespace's stored states in name order, at most [`SCHEDULE_STATES_MAX`].
pub(crate) async fn schedule_states(
    db: &mut Db<'_>,
    namespace: &str,
) -> StoreResult<Vec<ScheduleState>> {
    let rows = sqlx::query(
        "SELECT namespace, name, paused, changed_at, fired_through FROM keel_schedule_states \
         WHERE namespace = ? ORDER BY name LIMIT +?",
    )
    .bind(namespace)
    .bind(SCHEDULE_STATES_MAX as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("listing schedule states"))?;
    rows.iter().map(|r| state(db.file, r)).collect()
}

fn state(file: &str, r: &SqliteRow) -> StoreResult<ScheduleState> {
    let bad = |col: &'static str| move |e: sqlx::Error| corrupt(file, col, e);
    let at = |col: &'static str| -> StoreResult<Option<Timestamp>> {
        Ok(r.try_get::<Option<i64>, _>(col).map_err(bad(col))?.map(Timestamp))
    };
    Ok(ScheduleState {
        namespace: r.try_get("namespace").map_err(bad("namespace"))?,
        name: r.try_get("name").map_err(bad("name"))?,
        paused: r.try_get("paused").map_err(bad("paused"))?,
        changed_at: at("changed_at")?,
        fired_through: at("fired_through")?,
    })
}

#[cfg(test)]
mod tests {
    use crate::SqliteStore;
    use keel_core::Timestamp;
    use keel_core::ports::Store;
    use keel_core::ports::store::ScheduleFiredParams;
    use sqlx::migrate::Migrator;
    use sqlx::{Connection, SqliteConnection};

    /// A pause stored before fired ticks were recorded survives the table's rebuild, and
    /// its row then records ticks too.
    #[tokio::test]
    async fn a_pause_stored_before_fired_ticks_were_recorded_is_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("old.db");
        {
            let url = format!("sqlite://{}?mode=rwc", path.display());
            let mut old = SqliteConnection::connect(&url).await.expect("create the old file");
            let before: Vec<_> =
                crate::store::migrator().iter().filter(|m| m.version < 12).cloned().collect();
            Migrator::with_migrations(before).run(&mut old).await.expect("the schema before");
            sqlx::query(
                "INSERT INTO keel_schedule_states (namespace, name, paused, changed_at) \
                 VALUES ('default', 'nightly', 1, 42)",
            )
            .execute(&mut old)
            .await
            .expect("a stored pause");
            old.close().await.expect("close");
        }
        let store = SqliteStore::open(&path).await.expect("open migrates forward");
        let states = store.schedule_states("default".into()).await.expect("states");
        assert_eq!(states.len(), 1);
        let kept = &states[0];
        assert_eq!(
            (kept.paused, kept.changed_at, kept.fired_through),
            (true, Some(Timestamp(42)), None)
        );
        let fired = ScheduleFiredParams {
            namespace: "default".into(),
            name: "nightly".into(),
            tick: Timestamp(60_000),
        };
        let recorded = store.schedule_fired(fired).await.expect("record");
        assert_eq!(
            (recorded.paused, recorded.changed_at, recorded.fired_through),
            (true, Some(Timestamp(42)), Some(Timestamp(60_000)))
        );
    }
}
