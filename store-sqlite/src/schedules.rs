//! Stored schedule states (`Store::schedule_pause`, `Store::schedule_states`): the store
//! reads the current row and the namespace's count, the core's `plan_pause` decides, and
//! the store writes what it decided.

use crate::error::corrupt;
use crate::rows::Db;
use keel_core::ports::store::{SchedulePauseParams, ScheduleState};
use keel_core::schedule::{SCHEDULE_STATES_MAX, plan_pause};
use keel_core::{StoreResult, Timestamp};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

/// Stores a pause or resume (in the caller's write transaction) and returns the state.
pub(crate) async fn schedule_pause(
    db: &mut Db<'_>,
    p: &SchedulePauseParams,
) -> StoreResult<ScheduleState> {
    p.validate()?;
    let current = sqlx::query(
        "SELECT namespace, name, paused, changed_at FROM keel_schedule_states \
         WHERE namespace = ? AND name = ?",
    )
    .bind(&p.namespace)
    .bind(&p.name)
    .fetch_optional(&mut *db.conn)
    .await
    .map_err(db.err("reading a schedule state"))?
    .map(|r| state(db.file, &r))
    .transpose()?;
    let held: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM (SELECT 1 FROM keel_schedule_states WHERE namespace = ? LIMIT +?)",
    )
    .bind(&p.namespace)
    .bind(SCHEDULE_STATES_MAX as i64)
    .fetch_one(&mut *db.conn)
    .await
    .map_err(db.err("counting schedule states"))?;
    let held = usize::try_from(held).unwrap_or(SCHEDULE_STATES_MAX);
    let Some(next) = plan_pause(current.as_ref(), held, p)? else {
        return Ok(current.expect("an unchanged state is a stored one"));
    };
    sqlx::query(
        "INSERT INTO keel_schedule_states (namespace, name, paused, changed_at) \
         VALUES (?, ?, ?, ?) ON CONFLICT (namespace, name) DO UPDATE SET \
         paused = excluded.paused, changed_at = excluded.changed_at",
    )
    .bind(&next.namespace)
    .bind(&next.name)
    .bind(next.paused)
    .bind(next.changed_at.0)
    .execute(&mut *db.conn)
    .await
    .map_err(db.err("storing a schedule state"))?;
    Ok(next)
}

/// A namespace's stored states in name order, at most [`SCHEDULE_STATES_MAX`].
pub(crate) async fn schedule_states(
    db: &mut Db<'_>,
    namespace: &str,
) -> StoreResult<Vec<ScheduleState>> {
    let rows = sqlx::query(
        "SELECT namespace, name, paused, changed_at FROM keel_schedule_states \
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
    Ok(ScheduleState {
        namespace: r.try_get("namespace").map_err(bad("namespace"))?,
        name: r.try_get("name").map_err(bad("name"))?,
        paused: r.try_get("paused").map_err(bad("paused"))?,
        changed_at: Timestamp(r.try_get("changed_at").map_err(bad("changed_at"))?),
    })
}
