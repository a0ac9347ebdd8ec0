//! Operator paths: cancel (+ cascade), inspect, lookup, dead letters, queue pause/resume.
//! Each state change locks its rows, applies the pure transition and writes back.

use super::{Notices, begin, begin_snapshot, commit_tx, end_tx, end_tx_notices, signal, timer};
use crate::error::OpResult;
use crate::rows::{
    self, CHILD_COLS, DEAD_LETTER_COLS, HISTORY_COLS, HistoryWrite, INSTANCE_COLS, SIGNAL_COLS,
    lock_instances, release_parents, ts, write_history, write_instances,
};
use deadpool_postgres::GenericClient;
use keel_core::instance::{DeadLetter, Instance, SignalTarget, check_batch};
use keel_core::plan;
use keel_core::plan::parent::{FollowUp, FollowUps, NextFollowUp};
use keel_core::ports::store::{
    CancelParams, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSelector, DeadLetterSkipParams, InstanceDetail, InstanceListParams, QueuePauseParams,
    QueueState, ReadyStaleParams,
};
use keel_core::{DeadLetterId, InstanceId, Status, StoreError, StoreResult, limits};
use std::collections::HashMap;
use std::fmt::Write as _;

/// The live descendants of `$1` for a cascading cancel, each with its depth below it
/// (children at depth 1): breadth first, a parent's children in id order after those of
/// the parents before it (the walk the SQLite and memory stores make), down to `$2` levels
/// and at most `$3` rows. Ended descendants are walked through but not returned. The walk's
/// key is each row's path of ids from the root (an `int8[]`, whose order within a level is
/// that walk's order), so a cut at the bound keeps the same set in every store.
const DESCENDANTS: &str = "WITH RECURSIVE d(id, depth, path) AS ( \
      SELECT id, 1, ARRAY[id] FROM instances WHERE parent_id = $1 \
      UNION ALL \
      SELECT i.id, d.depth + 1, d.path || i.id FROM instances i JOIN d ON i.parent_id = d.id \
      WHERE d.depth < $2 \
    ) SELECT d.id, d.depth FROM d JOIN instances s ON s.id = d.id \
      WHERE s.status NOT IN ('done', 'failed', 'cancelled') ORDER BY d.depth, d.path LIMIT $3";

/// Most times a cascade reads its descendants again after locking the ones it found: a
/// descendant's step that committed while the cancel waited for its lock may have started
/// children the earlier read could not see. Each round locks the live descendants that
/// appeared; the cascade stops when a read finds none, or after this many rounds.
const DESCENDANT_ROUNDS_MAX: usize = 8;

/// Cancels an instance and, with `cascade`, its non-terminal descendants.
pub(crate) async fn cancel<C: GenericClient + Sync>(
    c: &C,
    p: &CancelParams,
    channel: &str,
) -> OpResult<Vec<InstanceId>> {
    begin(c).await?;
    let mut notices = Notices::default();
    let cancelled = cancel_locked(c, p, plan::cancel::cancel, &mut notices).await?;
    end_tx_notices(c, channel, &notices).await?;
    Ok(cancelled)
}

/// A cancel inside the caller's transaction, planned by `planner`: locks, reads, plans and
/// writes, and marks in `notices` what the caller's commit must announce (instances
/// ended; work made ready). What its parent releases leave to do (a parent woken from a
/// join cancels the rest of its children; a parent hears of a child's end) runs after it,
/// as [`run_follow_ups`] runs it.
pub(crate) async fn cancel_locked<C: GenericClient + Sync>(
    c: &C,
    p: &CancelParams,
    planner: fn(&CancelParams, plan::cancel::CancelRead) -> StoreResult<plan::cancel::CancelPlan>,
    notices: &mut Notices,
) -> OpResult<Vec<InstanceId>> {
    let (cancelled, more) = cancel_one(c, p, planner, notices).await?;
    run_follow_ups(c, FollowUps::new(more), p.now, notices).await?;
    Ok(cancelled)
}

/// Runs what parent releases left to do ([`FollowUps`]: in order and depth first, a
/// cancel's own follow-ups before the next item, cancels under the cascade's bound), the
/// order every store runs them in, so each parent's inbox fills in the same order
/// everywhere and the bound cuts the same cancels. Marks in `notices` what they ended and
/// woke.
pub(crate) async fn run_follow_ups<C: GenericClient + Sync>(
    c: &C,
    mut run: FollowUps,
    now: keel_core::Timestamp,
    notices: &mut Notices,
) -> OpResult<()> {
    while let Some(step) = run.next_step() {
        match step {
            NextFollowUp::Cancel(next) => {
                let (_, further) = cancel_one(c, &next, plan::cancel::cancel, notices).await?;
                run.then(further);
            }
            NextFollowUp::Notices(batch) => {
                let (signals, targets): (Vec<_>, Vec<_>) =
                    batch.into_iter().map(|(parent, signal)| (signal, Some(parent))).unzip();
                let delivery = signal::plan_resolved(c, &signals, &targets, now).await?;
                signal::finish(c, &delivery, None).await?;
                notices.ready |= delivery.woke();
            }
        }
    }
    Ok(())
}

/// The parents among `ids` that keep a join state in their context: their barriers are
/// counted by the planner (`plan::parent::release`), not by [`rows::RELEASE_PARENTS`].
pub(crate) const JOINED_PARENTS: &str =
    "SELECT id FROM instances WHERE id = ANY($1::int8[]) AND context ? '@join'";

/// Counts ended children on their parents: the plain barrier in one statement, the
/// parents with a join state through the planner. Returns what the releases leave to do,
/// in release order ([`plan::parent::ParentRelease::follow_ups`]).
pub(crate) async fn release_all<C: GenericClient + Sync>(
    c: &C,
    releases: &[plan::parent::ParentRelease],
    now: keel_core::Timestamp,
) -> OpResult<Vec<FollowUp>> {
    if releases.is_empty() {
        return Ok(Vec::new());
    }
    let parents: Vec<i64> = releases.iter().map(|r| r.parent.0).collect();
    let stmt = c.prepare_cached(JOINED_PARENTS).await?;
    let joined: std::collections::HashSet<i64> = c
        .query(&stmt, &[&parents])
        .await?
        .iter()
        .map(|r| rows::col(r, 0))
        .collect::<Result<_, StoreError>>()?;
    let plain: Vec<i64> = parents.iter().copied().filter(|p| !joined.contains(p)).collect();
    release_parents(c, &plain, now).await?;
    let with_join: Vec<plan::parent::ParentRelease> =
        releases.iter().filter(|r| joined.contains(&r.parent.0)).cloned().collect();
    // One answer per release with a join state, in their order.
    let (cancels, _) = release_joined(c, &with_join, now).await?;
    let mut cancels = cancels.into_iter();
    let mut out = Vec::new();
    for r in releases {
        let mine = if joined.contains(&r.parent.0) {
            cancels.next().unwrap_or_default()
        } else {
            Vec::new()
        };
        out.extend(r.follow_ups(mine));
    }
    Ok(out)
}

/// Counts ended children on parents that keep a join state: locks the parents (id
/// order), applies `plan::parent::release` per child in order, and writes the changed
/// rows and their history. Returns, per release in order, the cancels its woken parent
/// asks for, and whether a parent woke.
pub(crate) async fn release_joined<C: GenericClient + Sync>(
    c: &C,
    releases: &[plan::parent::ParentRelease],
    now: keel_core::Timestamp,
) -> OpResult<(Vec<Vec<CancelParams>>, bool)> {
    if releases.is_empty() {
        return Ok((Vec::new(), false));
    }
    let mut ids: Vec<i64> = releases.iter().map(|r| r.parent.0).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut rows: HashMap<i64, Instance> =
        lock_instances(c, &ids).await?.into_iter().map(|r| (r.id.0, r)).collect();
    let mut changed = Vec::new();
    let mut history = HistoryWrite::default();
    let mut cancels = Vec::with_capacity(releases.len());
    let mut woke = false;
    for r in releases {
        let Some(row) = rows.get(&r.parent.0) else {
            cancels.push(Vec::new());
            continue;
        };
        let planned = plan::parent::release(row, r, now);
        if !planned.changed {
            cancels.push(Vec::new());
            continue;
        }
        woke |= planned.row.status == Status::Runnable && row.status != Status::Runnable;
        for entry in planned.history {
            history.push(&planned.row, planned.row.attempt, now, entry);
        }
        cancels.push(planned.cancel);
        if !changed.contains(&r.parent.0) {
            changed.push(r.parent.0);
        }
        rows.insert(r.parent.0, planned.row);
    }
    let next: Vec<Instance> = changed.iter().map(|id| rows[id].clone()).collect();
    write_instances(c, &next).await?;
    write_history(c, &history).await?;
    Ok((cancels, woke))
}

/// Writes a parent plan of a passed join deadline (`plan::parent::expire`) for a row the
/// caller holds locked; returns its cancels.
pub(crate) async fn write_parent_plan<C: GenericClient + Sync>(
    c: &C,
    planned: plan::parent::ParentPlan,
    now: keel_core::Timestamp,
) -> OpResult<Vec<CancelParams>> {
    if !planned.changed {
        return Ok(Vec::new());
    }
    let mut history = HistoryWrite::default();
    for entry in planned.history {
        history.push(&planned.row, planned.row.attempt, now, entry);
    }
    write_instances(c, std::slice::from_ref(&planned.row)).await?;
    write_history(c, &history).await?;
    Ok(planned.cancel)
}

/// One cancel: its ids, and what its parent releases leave to do (the cancels a woken
/// parent asks for, and the notices of the ended children, in release order).
async fn cancel_one<C: GenericClient + Sync>(
    c: &C,
    p: &CancelParams,
    planner: fn(&CancelParams, plan::cancel::CancelRead) -> StoreResult<plan::cancel::CancelPlan>,
    notices: &mut Notices,
) -> OpResult<(Vec<InstanceId>, Vec<FollowUp>)> {
    // The root's parent, when it keeps a join state, is locked first (id order), as a
    // step commit does: the cancel's release counts on it, and a sibling's commit that
    // wakes it may cancel this root.
    let lock = c.prepare_cached(&rows::LOCK_WITH_JOINED_PARENTS).await?;
    let root = c
        .query(&lock, &[&vec![p.id.0]])
        .await?
        .iter()
        .map(rows::instance)
        .collect::<Result<Vec<Instance>, StoreError>>()?
        .into_iter()
        .find(|r| r.id == p.id);
    // Descendants and inboxes matter only when the root is still live.
    let live = root.as_ref().is_some_and(|r| !r.status.is_terminal());
    let mut read = plan::cancel::CancelRead { root, ..Default::default() };
    if live && p.cascade {
        let stmt = c.prepare_cached(DESCENDANTS).await?;
        // Prepared before the rounds, so each round's lock and read go out in that order.
        let lock = c.prepare_cached(&rows::LOCK_INSTANCES).await?;
        // The cascade touches at most CANCEL_CASCADE_MAX instances, the root included.
        let max = limits::CANCEL_CASCADE_MAX as i64 - 1;
        let depth = limits::CANCEL_CASCADE_DEPTH_MAX as i32;
        let args: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&p.id.0, &depth, &max];
        let decode = |found: Vec<tokio_postgres::Row>| {
            found
                .iter()
                .map(|r| Ok((rows::col(r, 0)?, rows::col(r, 1)?)))
                .collect::<Result<Vec<(i64, i32)>, StoreError>>()
        };
        let mut found = decode(c.query(&stmt, &args).await?)?;
        let mut locked: HashMap<i64, Instance> = HashMap::new();
        // Lock what the read found that is not locked yet, then read again (pipelined
        // behind the lock, so it runs once the locks are held): a step of a descendant
        // that committed while this waited for its lock may have started children the
        // read before could not see, and they must not stay live under a cancelled
        // parent. Rows locked stay as read (their writers wait for this transaction).
        // Once the rounds are used up while children kept coming, what the last read
        // found is locked and cancelled too, with no read after it.
        for round in 0..=DESCENDANT_ROUNDS_MAX {
            let mut fresh: Vec<i64> =
                found.iter().map(|f| f.0).filter(|id| !locked.contains_key(id)).collect();
            if fresh.is_empty() {
                break;
            }
            fresh.sort_unstable();
            if round == DESCENDANT_ROUNDS_MAX {
                locked.extend(lock_instances(c, &fresh).await?.into_iter().map(|r| (r.id.0, r)));
                break;
            }
            let (locks, again) = tokio::join!(async { c.query(&lock, &[&fresh]).await }, async {
                c.query(&stmt, &args).await
            });
            for r in &locks? {
                let r = rows::instance(r)?;
                locked.insert(r.id.0, r);
            }
            found = decode(again?)?;
        }
        read.descendants = found
            .iter()
            .filter_map(|(id, depth)| locked.remove(id).map(|r| (r, *depth as usize)))
            .collect();
    }
    // What each inbox held unread is read now: the rows are locked, so nothing arrives
    // before the drain.
    let candidates: Vec<i64> = read
        .root
        .iter()
        .filter(|_| live)
        .chain(read.descendants.iter().map(|(r, _)| r))
        .map(|r| r.id.0)
        .collect();
    let none: &[i64] = &[];
    let pending_stmt = c.prepare_cached(signal::PENDING).await?;
    let pending =
        c.query(&pending_stmt, &[&candidates, &none, &none, &signal::pending_listed()]).await?;
    read.pending =
        signal::pending_of(&pending)?.into_iter().map(|(id, p)| (InstanceId(id), p)).collect();
    let plan = planner(p, read)?;
    if plan.rows.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let cancelled: Vec<i64> = plan.rows.iter().map(|w| w.row.id.0).collect();
    let mut history = HistoryWrite::default();
    for w in &plan.rows {
        for entry in &w.history {
            history.push(&w.row, w.attempt, p.now, entry.clone());
        }
    }
    // The plan's releases run after every cancelled row is written, as the plan says: the
    // barrier counts go in one statement that applies the parent release rule in SQL; the
    // notices are left, with the cancels of woken parents, for the caller's run.
    let parents = !plan.releases.is_empty();
    let next: Vec<Instance> = plan.rows.into_iter().map(|w| w.row).collect();
    let drop_timers =
        c.prepare_cached("DELETE FROM timers WHERE instance_id = ANY($1::int8[])").await?;
    let drain = c.prepare_cached(signal::REMOVE).await?;
    let whole: Vec<Option<i64>> = vec![None; cancelled.len()];
    write_instances(c, &next).await?;
    write_history(c, &history).await?;
    c.execute(&drop_timers, &[&cancelled]).await?;
    c.execute(&drain, &[&cancelled, &whole]).await?;
    let more = release_all(c, &plan.releases, p.now).await?;
    // Announced after the caller's commit: waiters for these results re-read them, and
    // claimers look for the parents this woke.
    notices.ended = true;
    notices.ready |= parents;
    Ok((next.iter().map(|r| r.id).collect(), more))
}

/// An instance with its inbox, children, history and timers, read from one snapshot: a
/// `REPEATABLE READ, READ ONLY` transaction whose `BEGIN`, reads and `COMMIT` are
/// pipelined (one round trip once the statements are prepared).
pub(crate) async fn get<C: GenericClient + Sync>(
    c: &C,
    id: InstanceId,
) -> OpResult<InstanceDetail> {
    let row =
        c.prepare_cached(&format!("SELECT {INSTANCE_COLS} FROM instances WHERE id = $1")).await?;
    let inbox = c
        .prepare_cached(&format!(
            "SELECT {SIGNAL_COLS} FROM signals WHERE target_id = $1 ORDER BY id LIMIT {}",
            limits::INBOX_LIST_MAX
        ))
        .await?;
    let children = c
        .prepare_cached(&format!(
            "SELECT {CHILD_COLS} FROM instances WHERE parent_id = $1 ORDER BY id LIMIT {}",
            limits::CHILDREN_LIST_MAX
        ))
        .await?;
    let history = c
        .prepare_cached(&format!(
            "SELECT * FROM (SELECT {HISTORY_COLS} FROM history WHERE instance_id = $1 \
             ORDER BY seq DESC LIMIT {}) h ORDER BY seq",
            limits::HISTORY_LIST_MAX
        ))
        .await?;
    let timers = c.prepare_cached(&timer::list_sql()).await?;
    let (b, found, inbox_rows, child_rows, history_rows, timer_rows, committed) = tokio::join!(
        begin_snapshot(c),
        async { c.query_opt(&row, &[&id.0]).await },
        async { c.query(&inbox, &[&id.0]).await },
        async { c.query(&children, &[&id.0]).await },
        async { c.query(&history, &[&id.0]).await },
        async { c.query(&timers, &[&id.0]).await },
        commit_tx(c),
    );
    b?;
    let found = found?;
    committed?;
    let Some(r) = found else {
        return Err(StoreError::not_found(format!("instance {id} does not exist")).into());
    };
    Ok(InstanceDetail {
        instance: rows::instance(&r)?,
        inbox: inbox_rows?.iter().map(rows::signal).collect::<Result<_, _>>()?,
        children: child_rows?.iter().map(rows::child).collect::<Result<_, _>>()?,
        history: history_rows?.iter().map(rows::history).collect::<Result<_, _>>()?,
        timers: timer::list(&timer_rows?)?,
    })
}

/// The rows of `ids` that exist, in id order: one statement.
pub(crate) async fn rows_of<C: GenericClient + Sync>(
    c: &C,
    ids: &[InstanceId],
) -> OpResult<Vec<Instance>> {
    check_batch("ids", ids.len(), limits::ROWS_BATCH_MAX)?;
    let ids: Vec<i64> = ids.iter().map(|id| id.0).collect();
    let stmt = c
        .prepare_cached(&format!(
            "SELECT {INSTANCE_COLS} FROM instances WHERE id = ANY($1) ORDER BY id"
        ))
        .await?;
    let found = c.query(&stmt, &[&ids]).await?;
    Ok(found.iter().map(rows::instance).collect::<Result<_, _>>()?)
}

/// One page of a namespace's instances, newest first. Only the filters that are set go
/// into the statement, so the planner sees each shape as it is (a generic plan for
/// `$n IS NULL OR …` would scan). The state filter is the broadcast's: the step's name,
/// or an element of a chart's JSON array of active paths. The list index leaves executing
/// rows out (claims then write one index entry fewer), so a page without a status filter
/// is two reads merged by id: the list index for every other status, the lease index for
/// the executing rows (few: at most the workers' concurrency). A status filter names its
/// status as a literal, so the plan can use the index that holds it.
pub(crate) async fn list<C: GenericClient + Sync>(
    c: &C,
    p: &InstanceListParams,
) -> OpResult<Vec<Instance>> {
    let values = ListValues::of(p);
    let (sql, args) = list_statement(p, &values);
    let stmt = c.prepare_cached(&sql).await?;
    let found = c.query(&stmt, &args).await?;
    Ok(found.iter().map(rows::instance).collect::<Result<_, _>>()?)
}

/// The arguments of a page's statement that are not fields of its parameters as they are.
pub(crate) struct ListValues {
    before: Option<i64>,
    limit: i64,
}

impl ListValues {
    pub(crate) fn of(p: &InstanceListParams) -> Self {
        ListValues { before: p.before.map(|b| b.0), limit: p.limit as i64 }
    }
}

/// The statement of [`list`] and its arguments, each numbered as it is added.
pub(crate) fn list_statement<'a>(
    p: &'a InstanceListParams,
    values: &'a ListValues,
) -> (String, Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)>) {
    let mut args: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&p.namespace];
    let mut filters = String::from("namespace = $1");
    if let Some(machine) = &p.machine {
        args.push(machine);
        let _ = write!(filters, " AND machine = ${}", args.len());
    }
    if let Some(key) = &p.business_key {
        args.push(key);
        let _ = write!(filters, " AND business_key = ${}", args.len());
    }
    if let Some(before) = &values.before {
        args.push(before);
        let _ = write!(filters, " AND id < ${}", args.len());
    }
    if let Some(state) = &p.state {
        args.push(state);
        let _ = write!(filters, " AND {}", rows::in_state("position", args.len()));
    }
    args.push(&values.limit);
    let limit = args.len();
    let page = |status: &str| {
        format!(
            "SELECT {INSTANCE_COLS} FROM instances WHERE {filters} AND {status} \
             ORDER BY id DESC LIMIT ${limit}"
        )
    };
    // The executing rows are read whole and then sorted (`OFFSET 0` keeps the planner from
    // walking the primary key in id order to find them): they are few, and the lease index
    // holds exactly them.
    let executing = format!(
        "SELECT * FROM (SELECT {INSTANCE_COLS} FROM instances \
           WHERE {filters} AND status = 'executing' OFFSET 0) executing \
         ORDER BY id DESC LIMIT ${limit}"
    );
    let sql = match p.status {
        Some(Status::Executing) => executing,
        // `Status::name` is one of a fixed set of identifiers: safe as a literal.
        Some(status) => page(&format!("status = '{}'", status.name())),
        None => format!(
            "SELECT * FROM (({}) UNION ALL ({executing})) page ORDER BY id DESC LIMIT ${limit}",
            page("status <> 'executing'"),
        ),
    };
    (sql, args)
}

/// The repair read (`plan::hints::needs_hint` in SQL, over the claim's filters): ready
/// rows unchanged and due for at least `ready_for`, in id order after the cursor. The rule
/// is applied again to the decoded rows, so the SQL can only narrow what the core decides.
pub(crate) async fn ready_stale<C: GenericClient + Sync>(
    c: &C,
    p: &ReadyStaleParams,
) -> OpResult<Vec<Instance>> {
    p.validate()?;
    let sql = format!(
        "SELECT {INSTANCE_COLS} FROM instances i \
         WHERE i.status = 'runnable' AND i.eligible_at <= $1 \
           AND greatest(i.updated_at, i.eligible_at) <= $7 AND i.id > $8 AND {filters} \
         ORDER BY i.id LIMIT $6",
        filters = super::claim::filters("i"),
    );
    let stmt = c.prepare_cached(&sql).await?;
    let names: Vec<&str> = p.machines.iter().map(|m| m.name.as_str()).collect();
    let versions: Vec<i32> = p.machines.iter().map(|m| m.version).collect();
    let limit = p.limit as i64;
    let (now, cut) = (ts(p.now), ts(p.now.minus(p.ready_for)));
    let after = p.after.map_or(i64::MIN, |id| id.0);
    let found = c
        .query(&stmt, &[&now, &p.namespaces, &p.queues, &names, &versions, &limit, &cut, &after])
        .await?;
    let rows: Vec<Instance> = found.iter().map(rows::instance).collect::<Result<_, _>>()?;
    Ok(rows.into_iter().filter(|r| plan::hints::needs_hint(r, false, p)).collect())
}

/// Resolves a target to an instance id.
pub(crate) async fn lookup<C: GenericClient + Sync>(
    c: &C,
    target: &SignalTarget,
) -> OpResult<Option<InstanceId>> {
    match target {
        SignalTarget::Id(id) => {
            let stmt = c.prepare_cached("SELECT id FROM instances WHERE id = $1").await?;
            Ok(c.query_opt(&stmt, &[&id.0])
                .await?
                .map(|r| rows::col(&r, 0).map(InstanceId))
                .transpose()?)
        }
        SignalTarget::Key { .. } | SignalTarget::Child { .. } => {
            Ok(super::signal::resolve(c, &[target]).await?.into_iter().next().flatten())
        }
    }
}

/// One page of dead letters, oldest first. The cursor is a range on the id (unset = the
/// whole range), so a deep page starts with an index seek; the previous page (`before`)
/// reads downwards from its cursor and is turned back to oldest first.
pub(crate) async fn dead_letter_list<C: GenericClient + Sync>(
    c: &C,
    f: &DeadLetterFilter,
) -> OpResult<Vec<DeadLetter>> {
    let backwards = f.before.is_some();
    let stmt = c
        .prepare_cached(&format!(
            "SELECT {DEAD_LETTER_COLS} FROM dead_letters \
             WHERE ($1::text IS NULL OR namespace = $1) AND ($2::text IS NULL OR machine = $2) \
               AND id > $3 AND id < $4 \
             ORDER BY id {} LIMIT $5",
            if backwards { "DESC" } else { "ASC" }
        ))
        .await?;
    let after = f.after.map_or(0, |a| a.0);
    let before = f.before.map_or(i64::MAX, |b| b.0);
    let limit = f.page_size() as i64;
    let found = c.query(&stmt, &[&f.namespace, &f.machine, &after, &before, &limit]).await?;
    let mut page = found.iter().map(rows::dead_letter).collect::<Result<Vec<_>, _>>()?;
    if backwards {
        page.reverse();
    }
    Ok(page)
}

/// Dead letters per (namespace, machine), in name order: one grouped count on
/// `dead_letters_machine` (namespace, machine, id).
pub(crate) async fn dead_letter_counts<C: GenericClient + Sync>(
    c: &C,
    namespace: Option<&str>,
) -> OpResult<Vec<keel_core::ports::store::DeadLetterCount>> {
    let stmt = c
        .prepare_cached(
            "SELECT namespace, machine, count(*) FROM dead_letters \
             WHERE ($1::text IS NULL OR namespace = $1) \
             GROUP BY namespace, machine \
             ORDER BY namespace COLLATE \"C\", machine COLLATE \"C\"",
        )
        .await?;
    let found = c.query(&stmt, &[&namespace]).await?;
    Ok(found
        .iter()
        .map(|r| {
            Ok(keel_core::ports::store::DeadLetterCount {
                namespace: rows::col(r, 0)?,
                machine: rows::col(r, 1)?,
                count: rows::col::<i64>(r, 2)? as u64,
            })
        })
        .collect::<Result<_, StoreError>>()?)
}

/// One dead letter.
pub(crate) async fn dead_letter_get<C: GenericClient + Sync>(
    c: &C,
    id: DeadLetterId,
) -> OpResult<DeadLetter> {
    let stmt = c
        .prepare_cached(&format!("SELECT {DEAD_LETTER_COLS} FROM dead_letters WHERE id = $1"))
        .await?;
    match c.query_opt(&stmt, &[&id.0]).await? {
        Some(r) => Ok(rows::dead_letter(&r)?),
        None => Err(StoreError::not_found(format!("dead letter {id} does not exist")).into()),
    }
}

/// The dead letters a retry names: `(letter id, instance id)`, oldest first, locked.
async fn select_letters<C: GenericClient + Sync>(
    c: &C,
    p: &DeadLetterRetryParams,
) -> OpResult<Vec<(i64, i64)>> {
    let found = match &p.selector {
        DeadLetterSelector::Id(id) => {
            let stmt = c
                .prepare_cached("SELECT id, instance_id FROM dead_letters WHERE id = $1 FOR UPDATE")
                .await?;
            let r = c.query(&stmt, &[&id.0]).await?;
            if r.is_empty() {
                return Err(
                    StoreError::not_found(format!("dead letter {id} does not exist")).into()
                );
            }
            r
        }
        // Of the instance status the core names (the instance rows are locked and checked
        // again before anything is written).
        DeadLetterSelector::Machine { namespace, machine } => {
            let stmt = c
                .prepare_cached(
                    "SELECT d.id, d.instance_id FROM dead_letters d JOIN instances i ON i.id = d.instance_id \
                     WHERE d.namespace = $1 AND d.machine = $2 \
                       AND ($3::text IS NULL OR i.status = $3::text::status) \
                     ORDER BY d.id LIMIT $4 FOR UPDATE OF d",
                )
                .await?;
            let status = p.instance_status().map(Status::name);
            let limit = limits::DEAD_LETTER_BATCH_MAX as i64;
            c.query(&stmt, &[namespace, machine, &status, &limit]).await?
        }
    };
    Ok(found
        .iter()
        .map(|r| Ok((rows::col(r, 0)?, rows::col(r, 1)?)))
        .collect::<Result<_, StoreError>>()?)
}

async fn delete_letters<C: GenericClient + Sync>(c: &C, ids: &[i64]) -> OpResult<u64> {
    let stmt = c.prepare_cached("DELETE FROM dead_letters WHERE id = ANY($1)").await?;
    Ok(c.execute(&stmt, &[&ids]).await?)
}

/// Retries dead letters, oldest first, as `plan::dead_letter::retry` decides.
pub(crate) async fn dead_letter_retry<C: GenericClient + Sync>(
    c: &C,
    p: &DeadLetterRetryParams,
    channel: &str,
) -> OpResult<Vec<InstanceId>> {
    begin(c).await?;
    let letters: Vec<(DeadLetterId, InstanceId)> = select_letters(c, p)
        .await?
        .into_iter()
        .map(|(l, i)| (DeadLetterId(l), InstanceId(i)))
        .collect();
    let mut ids: Vec<i64> = letters.iter().map(|l| l.1.0).collect();
    ids.sort_unstable();
    ids.dedup();
    let plan = plan::dead_letter::retry(p, &letters, lock_instances(c, &ids).await?)?;
    let mut history = HistoryWrite::default();
    let mut next = Vec::with_capacity(plan.rows.len());
    for w in &plan.rows {
        for entry in &w.history {
            history.push(&w.row, w.attempt, p.now, entry.clone());
        }
        next.push(w.row.clone());
    }
    let gone: Vec<i64> = plan.remove.iter().map(|id| id.0).collect();
    write_instances(c, &next).await?;
    write_history(c, &history).await?;
    delete_letters(c, &gone).await?;
    end_tx(c, (!next.is_empty()).then_some(channel)).await?;
    Ok(plan.retried())
}

/// Skips a dead letter: consumes its signals and resumes the suspended instance now
/// (`plan::dead_letter::skip`).
pub(crate) async fn dead_letter_skip<C: GenericClient + Sync>(
    c: &C,
    p: &DeadLetterSkipParams,
    channel: &str,
) -> OpResult<InstanceId> {
    begin(c).await?;
    let letter = dead_letter_get(c, p.id).await?;
    let rows = lock_instances(c, &[letter.letter.instance.0]).await?;
    let plan = plan::dead_letter::skip(p, &letter, rows.first())?;
    let id = plan.row.row.id;
    let signals: Vec<i64> = plan.consume.iter().map(|s| s.0).collect();
    let stmt =
        c.prepare_cached("DELETE FROM signals WHERE target_id = $1 AND id = ANY($2)").await?;
    c.execute(&stmt, &[&id.0, &signals]).await?;
    let mut history = HistoryWrite::default();
    for entry in &plan.row.history {
        history.push(&plan.row.row, plan.row.attempt, p.now, entry.clone());
    }
    write_instances(c, std::slice::from_ref(&plan.row.row)).await?;
    write_history(c, &history).await?;
    delete_letters(c, &[plan.remove.0]).await?;
    end_tx(c, Some(channel)).await?;
    Ok(id)
}

/// Purges dead letters as `plan::dead_letter::purge` decides, in one transaction: the
/// letters the selector matches (their conditions also in the read, so a page holds only
/// purgeable ones) are locked with their instances' statuses, planned, and deleted.
pub(crate) async fn dead_letter_purge<C: GenericClient + Sync>(
    c: &C,
    p: &DeadLetterPurgeParams,
) -> OpResult<u64> {
    let older = p.older_than.map(ts);
    let (id, ns, machine): (Option<i64>, Option<&str>, Option<&str>) = match &p.selector {
        None => (None, None, None),
        Some(DeadLetterSelector::Id(id)) => (Some(id.0), None, None),
        Some(DeadLetterSelector::Machine { namespace, machine }) => {
            (None, Some(namespace.as_str()), Some(machine.as_str()))
        }
    };
    let limit = limits::DEAD_LETTER_BATCH_MAX as i64;
    begin(c).await?;
    let read = c
        .prepare_cached(
            "SELECT d.id, d.created_at, i.status::text FROM dead_letters d \
               LEFT JOIN instances i ON i.id = d.instance_id \
             WHERE ($1::int8 IS NULL OR d.id = $1) AND ($2::text IS NULL OR d.namespace = $2) \
               AND ($3::text IS NULL OR d.machine = $3) \
               AND ($4::timestamptz IS NULL OR d.created_at < $4) \
               AND (NOT $5::bool OR i.status IS DISTINCT FROM 'suspended') \
             ORDER BY d.id LIMIT $6 FOR UPDATE OF d",
        )
        .await?;
    let keep = p.keep_suspended;
    let mut letters = Vec::new();
    for r in c.query(&read, &[&id, &ns, &machine, &older, &keep, &limit]).await? {
        let status: Option<String> = rows::col(&r, 2)?;
        let status = status.as_deref().map(rows::status).transpose()?;
        letters.push((DeadLetterId(rows::col(&r, 0)?), rows::from_ts(rows::col(&r, 1)?), status));
    }
    let gone: Vec<i64> = plan::dead_letter::purge(p, letters).iter().map(|d| d.0).collect();
    let delete = c.prepare_cached("DELETE FROM dead_letters WHERE id = ANY($1::int8[])").await?;
    let n = c.execute(&delete, &[&gone]).await?;
    end_tx(c, None).await?;
    Ok(n)
}

/// Pauses or resumes a queue.
pub(crate) async fn queue_pause<C: GenericClient + Sync>(
    c: &C,
    p: &QueuePauseParams,
    channel: &str,
) -> OpResult<()> {
    begin(c).await?;
    // A pause records the queue; a resume changes a recorded one only and records none.
    let stmt = c
        .prepare_cached(if p.paused {
            "INSERT INTO queues (namespace, queue, paused, updated_at) VALUES ($1, $2, true, $3) \
             ON CONFLICT (namespace, queue) DO UPDATE SET paused = true, updated_at = $3"
        } else {
            "UPDATE queues SET paused = false, updated_at = $3 WHERE namespace = $1 AND queue = $2"
        })
        .await?;
    c.execute(&stmt, &[&p.namespace, &p.queue, &ts(p.now)]).await?;
    end_tx(c, (!p.paused).then_some(channel)).await?;
    Ok(())
}

/// Queues with settings in a namespace.
pub(crate) async fn queue_list<C: GenericClient + Sync>(
    c: &C,
    namespace: &str,
) -> OpResult<Vec<QueueState>> {
    let stmt = c
        .prepare_cached(
            "SELECT namespace, queue, paused FROM queues WHERE namespace = $1 ORDER BY queue",
        )
        .await?;
    Ok(c.query(&stmt, &[&namespace])
        .await?
        .iter()
        .map(|r| {
            Ok(QueueState {
                namespace: rows::col(r, 0)?,
                queue: rows::col(r, 1)?,
                paused: rows::col(r, 2)?,
            })
        })
        .collect::<Result<_, StoreError>>()?)
}
