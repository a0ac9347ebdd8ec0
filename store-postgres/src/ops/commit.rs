//! `step_commit`: a batch of step results in one transaction.
//!
//! The store reads, the core decides, the store writes. Round trip 1 (pipelined):
//! `BEGIN`, lock the batch's rows (id order, `FOR NO KEY UPDATE`), and, read after the lock
//! so no delivery can slip in between, the inbox facts of every item (for `Await`, whether
//! a matching signal outside the consumed set is waiting; for an item that cancels timers
//! or leaves a delegation state, its unread timer fires and child notices, which the core
//! withdraws when their state is left; for an item that would end its instance, the
//! count and oldest few of its unread signals) and the emit targets. When
//! an item could bring a unique key back into scope, one more statement reads who holds
//! those keys. The commit planner (`keel_core::plan::commit`) then admits or refuses each
//! item in batch order; the children of every admitted item go in with one insert; and
//! the planner's plans are gathered into batched `unnest` writes. The last round trip
//! writes every row, deletes the consumed signals (the whole inbox of an instance that
//! ended), appends history, stores dead letters, releases parents' barriers, changes
//! timers and commits, then sends its wake-ups. Outbox emits and parent notices, when there are
//! any, run the delivery path before that last round trip.

use super::{Notices, admin, begin_hot, end_tx_notices, insert, signal, timer};
use crate::error::OpResult;
use crate::rows::{self, HistoryWrite, InstanceWrite, ts};
use deadpool_postgres::GenericClient;
use keel_core::inbox;
use keel_core::instance::{Instance, NewDeadLetter, NewSignal, SignalTarget};
use keel_core::outcome::{Outcome, StepCommit};
use keel_core::plan::cancel::LeftDelegations;
use keel_core::plan::commit::{self, CommitPlanner, CommitRead, InboxRead, TimerPlan, UnreadFire};
use keel_core::plan::parent::FollowUps;
use keel_core::ports::store::{CommitReceipt, InsertOutcome};
use keel_core::{
    DeadLetterId, InstanceId, Priority, SignalId, Status, StoreError, StoreResult, Timestamp,
};
use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

/// Whether signal `s` is a fire a commit may withdraw (what `UnreadFire::read` accepts): a
/// timer's fire, whose dedup key has the fire prefix and whose payload names the state
/// that owned the timer, or a child's notice, whose dedup key is `child:<id>:terminal` and
/// whose name is `done.invoke.<state>` or `fail.state.<state>`.
macro_rules! is_fire {
    () => {
        "coalesce((s.dedup_key LIKE 'timer:%' AND jsonb_typeof(s.payload->'state') = 'string') \
           OR (s.dedup_key LIKE 'child:%:terminal' \
               AND (s.name LIKE 'done.invoke.%' OR s.name LIKE 'fail.state.%')), false)"
    };
}

/// Per `Await` item, whether a signal it awaits is unread; for the items in `$5` (those
/// that may withdraw fires) timer fires and child notices are left out, [`FIRES`] reads
/// them instead.
const AWAIT_CHECK: &str = concat!(
    "SELECT a.id FROM unnest($1::int8[], $2::text[]) AS a(id, name) \
    WHERE EXISTS (SELECT 1 FROM signals s WHERE s.target_id = a.id \
      AND (a.name = '*' OR s.name = a.name) \
      AND NOT (a.id = ANY($5::int8[]) AND ",
    is_fire!(),
    ") \
      AND NOT EXISTS (SELECT 1 FROM unnest($3::int8[], $4::int8[]) AS x(t, s) \
                      WHERE x.t = s.target_id AND x.s = s.id))"
);

/// The unread timer fires and child notices of the items that may withdraw them, oldest
/// first.
pub(crate) const FIRES: &str = concat!(
    "SELECT s.target_id, s.id, s.name, \
       CASE WHEN s.dedup_key LIKE 'timer:%' THEN s.payload->>'state' END, s.dedup_key \
     FROM signals s \
    WHERE s.target_id = ANY($1::int8[]) AND ",
    is_fire!(),
    " AND NOT EXISTS (SELECT 1 FROM unnest($2::int8[], $3::int8[]) AS x(t, s) \
                  WHERE x.t = s.target_id AND x.s = s.id) \
    ORDER BY s.target_id, s.id"
);

/// Per committed instance whose claim priority a signal raised (`priority` differs from
/// `base_priority`), the most urgent priority among the signals the commit leaves unread.
/// Where the two are equal no pending signal is more urgent than the base, so the commit
/// keeps the base without asking.
pub(crate) const PENDING_PRIORITY: &str = "SELECT s.target_id, min(s.priority) FROM signals s \
    JOIN instances i ON i.id = s.target_id AND i.priority <> i.base_priority \
    WHERE s.target_id = ANY($1::int8[]) AND s.priority IS NOT NULL \
      AND NOT EXISTS (SELECT 1 FROM unnest($2::int8[], $3::int8[]) AS x(t, s) \
                      WHERE x.t = s.target_id AND x.s = s.id) \
    GROUP BY s.target_id";

const DEAD_LETTERS: &str = "INSERT INTO dead_letters (instance_id, namespace, machine, \
    machine_version, position, signals, event, correlation_id, reason, attempts, errors, \
    first_attempt_at, last_attempt_at, created_at) \
    SELECT d.instance_id, d.namespace, d.machine, d.machine_version, d.position, \
      ARRAY(SELECT jsonb_array_elements_text(d.signals)::int8), d.event, d.correlation_id, \
      d.reason, d.attempts, d.errors, d.first_attempt_at, d.last_attempt_at, $14 \
    FROM unnest($1::int8[], $2::text[], $3::text[], $4::int4[], $5::text[], $6::jsonb[], \
      $7::jsonb[], $8::text[], $9::text[], $10::int4[], $11::jsonb[], $12::timestamptz[], \
      $13::timestamptz[]) AS d(instance_id, namespace, machine, machine_version, position, \
      signals, event, correlation_id, reason, attempts, errors, first_attempt_at, \
      last_attempt_at) \
    RETURNING instance_id, id";

/// The live children that the given parents (`$1`) started from a delegation state they
/// leave: every delegation state where `$2` is true (the parent fails), else the states
/// the `($3, $4)` parent and state pairs name (`LeftDelegations::covers`, in SQL). At
/// most `$5` per parent, so one parent's children cannot use up another's bound, and the
/// children of states a parent keeps use up none of it. Never one of `$6`, the children
/// the same commits start. In id order.
pub(crate) const DELEGATED: &str = "SELECT c.id FROM unnest($1::int8[], $2::bool[]) AS p(id, every) \
    CROSS JOIN LATERAL ( \
      SELECT i.id FROM instances i WHERE i.parent_id = p.id AND i.invoked_by IS NOT NULL \
        AND i.status NOT IN ('done', 'failed', 'cancelled') \
        AND (p.every OR i.invoked_by IN ( \
          SELECT l.state FROM unnest($3::int8[], $4::text[]) AS l(parent, state) \
          WHERE l.parent = p.id)) \
        AND i.id <> ALL($6::int8[]) \
      ORDER BY i.id LIMIT $5 \
    ) c ORDER BY c.id";

/// The ids [`DELEGATED`] finds for `leaving`, at most `max` per parent.
pub(crate) async fn delegated<C: GenericClient + Sync>(
    c: &C,
    leaving: &[(InstanceId, LeftDelegations)],
    max: i64,
) -> OpResult<Vec<i64>> {
    let (mut parents, mut every) = (Vec::new(), Vec::new());
    let (mut left_parent, mut left_state) = (Vec::new(), Vec::new());
    let mut spared: Vec<i64> = Vec::new();
    for (id, left) in leaving {
        match left {
            LeftDelegations::None => continue,
            LeftDelegations::All => every.push(true),
            LeftDelegations::States { left, started } => {
                every.push(false);
                for state in left {
                    left_parent.push(id.0);
                    left_state.push(state.as_str());
                }
                spared.extend(started.iter().map(|c| c.0));
            }
        }
        parents.push(id.0);
    }
    if parents.is_empty() {
        return Ok(Vec::new());
    }
    let stmt = c.prepare_cached(DELEGATED).await?;
    let found =
        c.query(&stmt, &[&parents, &every, &left_parent, &left_state, &max, &spared]).await?;
    let mut ids: Vec<i64> =
        found.iter().map(|r| rows::col(r, 0)).collect::<Result<_, StoreError>>()?;
    // A parent named twice in a batch would list its children twice.
    ids.dedup();
    Ok(ids)
}

/// Who holds each of `keys` now, read after the lock (one statement).
async fn occupants<C: GenericClient + Sync>(
    c: &C,
    keys: &[&[u8]],
) -> OpResult<HashMap<Vec<u8>, InstanceId>> {
    if keys.is_empty() {
        return Ok(HashMap::new());
    }
    let stmt = c
        .prepare_cached(
            "SELECT unique_guard, id FROM instances WHERE unique_guard = ANY($1::bytea[])",
        )
        .await?;
    Ok(c.query(&stmt, &[&keys])
        .await?
        .iter()
        .map(|r| Ok((rows::col(r, 0)?, InstanceId(rows::col(r, 1)?))))
        .collect::<Result<_, StoreError>>()?)
}

/// The transaction.
pub(crate) async fn run<C: GenericClient + Sync>(
    c: &C,
    commits: &[StepCommit],
    now: Timestamp,
    channel: &str,
) -> OpResult<Vec<StoreResult<CommitReceipt>>> {
    let mut ids: Vec<i64> = commits.iter().map(|s| s.id.0).collect();
    ids.sort_unstable();
    ids.dedup();
    let (mut await_ids, mut await_names) = (Vec::new(), Vec::new());
    let (mut ct, mut cs) = (Vec::new(), Vec::new());
    let mut drain_ids: Vec<i64> = Vec::new();
    let mut fire_ids: Vec<i64> = Vec::new();
    for s in commits {
        if commit::withdraws_fires(s) {
            fire_ids.push(s.id.0);
        }
        if let Outcome::Await { signal, .. } = &s.outcome {
            await_ids.push(s.id.0);
            await_names.push(signal.as_str());
        }
        if inbox::drains(&s.outcome) {
            drain_ids.push(s.id.0);
        }
        for sig in &s.consume {
            ct.push(s.id.0);
            cs.push(sig.0);
        }
    }
    let lock = c.prepare_cached(&rows::LOCK_WITH_JOINED_PARENTS).await?;
    let check = c.prepare_cached(AWAIT_CHECK).await?;
    let waiting = async {
        if await_ids.is_empty() {
            return Ok(Vec::new());
        }
        c.query(&check, &[&await_ids, &await_names, &ct, &cs, &fire_ids]).await
    };
    let fires_stmt = c.prepare_cached(FIRES).await?;
    let fires = async {
        if fire_ids.is_empty() {
            return Ok(Vec::new());
        }
        c.query(&fires_stmt, &[&fire_ids, &ct, &cs]).await
    };
    // What items that end their instance leave unread in its inbox, for the drain's
    // history entry; read after the lock, like the await check.
    let pending_stmt = c.prepare_cached(signal::PENDING).await?;
    let listed = signal::pending_listed();
    let pending = async {
        if drain_ids.is_empty() {
            return Ok(Vec::new());
        }
        c.query(&pending_stmt, &[&drain_ids, &ct, &cs, &listed]).await
    };
    let urgent_stmt = c.prepare_cached(PENDING_PRIORITY).await?;
    let urgent = async { c.query(&urgent_stmt, &[&ids, &ct, &cs]).await };
    let emit_targets: Vec<&SignalTarget> =
        commits.iter().flat_map(|s| s.emit.iter().map(|e| &e.target)).collect();
    let (b, locked, waiting, fires, pending, urgent, resolved) = tokio::join!(
        begin_hot(c, commits.len()),
        async { c.query(&lock, &[&ids]).await },
        waiting,
        fires,
        pending,
        urgent,
        signal::resolve(c, &emit_targets)
    );
    // Results are read in the order the statements went out: once one fails (a deadlock on
    // the lock, say) every later one only reports 25P02 "transaction is aborted", and that
    // would hide the retryable cause behind a refusal.
    b?;
    let locked = locked?;
    let waiting = waiting?;
    let fires = fires?;
    let pending = pending?;
    let urgent = urgent?;
    let resolved = resolved?;
    let urgent: HashMap<i64, Priority> = urgent
        .iter()
        .filter_map(|r| {
            let level: Option<i16> = r.try_get(1).ok()?;
            Some((r.try_get(0).ok()?, Priority::from_level(level?)?))
        })
        .collect();
    let pending = signal::pending_of(&pending)?;
    let mut current: HashMap<i64, Instance> = HashMap::new();
    for r in &locked {
        let row = rows::instance(r)?;
        current.insert(row.id.0, row);
    }
    // The locked parents that keep a join state: a child's end is counted on them by the
    // planner rather than by `RELEASE_PARENTS`.
    let joined: HashSet<i64> = current
        .values()
        .filter(|r| r.context.get(keel_core::join::JOIN_KEY).is_some())
        .map(|r| r.id.0)
        .collect();
    let waiting: HashSet<i64> =
        waiting.iter().map(|r| rows::col(r, 0)).collect::<Result<_, StoreError>>()?;
    let mut unread_fires: HashMap<i64, Vec<UnreadFire>> = HashMap::new();
    for r in &fires {
        let name: String = rows::col(r, 2)?;
        let key: Option<String> = rows::col(r, 4)?;
        // The statement selects what `UnreadFire::read` accepts: every row reads.
        let Some(fire) =
            UnreadFire::read(SignalId(rows::col(r, 1)?), &name, key.as_deref(), rows::col(r, 3)?)
        else {
            continue;
        };
        unread_fires.entry(rows::col(r, 0)?).or_default().push(fire);
    }
    // Each item's inbox facts, its unread timer fires counted in.
    let inboxes: Vec<InboxRead> = commits
        .iter()
        .map(|s| {
            InboxRead {
                signal_waiting: waiting.contains(&s.id.0),
                pending: pending.get(&s.id.0).cloned().unwrap_or_default(),
                pending_priority: urgent.get(&s.id.0).copied(),
                withdrawn: Vec::new(),
            }
            .with_fires(s, unread_fires.get(&s.id.0).cloned().unwrap_or_default())
        })
        .collect();

    // The read set of every item: its row, inbox facts and emit targets from round trip 1,
    // and the occupants of the unique keys items could bring back into scope.
    let mut emit_at = Vec::with_capacity(commits.len());
    let mut n = 0;
    for s in commits {
        emit_at.push(n);
        n += s.emit.len();
    }
    let keys: Vec<&[u8]> = commits
        .iter()
        .zip(&inboxes)
        .filter_map(|(s, inbox)| {
            let row = current.get(&s.id.0)?;
            commit::reentering_key(row, s, inbox.signal_waiting)
        })
        .collect();
    let occupied = occupants(c, &keys).await?;

    // Plan in batch order; the planner remembers what earlier items changed.
    let mut planner = CommitPlanner::new(now);
    let mut results: Vec<Option<StoreResult<CommitReceipt>>> = vec![None; commits.len()];
    let mut admitted = Vec::new();
    for (i, (s, inbox)) in commits.iter().zip(inboxes).enumerate() {
        let row = current.get(&s.id.0).cloned();
        let key_occupant = row
            .as_ref()
            .and_then(|r| commit::reentering_key(r, s, inbox.signal_waiting))
            .and_then(|key| occupied.get(key).copied());
        let read = CommitRead {
            row,
            emit_targets: resolved[emit_at[i]..emit_at[i] + s.emit.len()].to_vec(),
            inbox,
            key_occupant,
        };
        match planner.admit(s, read) {
            Ok(a) => admitted.push((i, a)),
            Err(e) => results[i] = Some(Err(e)),
        }
    }

    // Every admitted item's children in one insert, in batch order.
    let kids: Vec<insert::Item<'_>> = admitted
        .iter()
        .flat_map(|(_, a)| a.children.iter().map(|k| (&k.spec, Some(k.parent))))
        .collect();
    let inserted =
        if kids.is_empty() { Vec::new() } else { insert::insert_batch(c, &kids, now).await? };
    let mut ready = inserted.iter().any(|o| matches!(o, InsertOutcome::Inserted(_)));

    // Gather every plan's writes into the batched statements.
    let mut writes = InstanceWrite::default();
    let mut history = HistoryWrite::default();
    let mut letters = LetterWrite::default();
    let (mut consume_t, mut consume_s): (Vec<i64>, Vec<Option<i64>>) = (Vec::new(), Vec::new());
    let mut parents = Vec::new();
    let mut emits: Vec<NewSignal> = Vec::new();
    let mut emit_targets_ok: Vec<Option<InstanceId>> = Vec::new();
    // Which of `emits` are an ended child's notice to its parent (the others are outbox
    // signals): a commit with joins delivers the two apart, around its releases.
    let mut is_notice: Vec<bool> = Vec::new();
    let mut timers = timer::TimerWrite::default();
    let mut ended = false;
    let mut leaving: Vec<(InstanceId, LeftDelegations)> = Vec::new();
    let mut join_releases = Vec::new();
    let mut start = 0;
    for (i, a) in admitted {
        let s = &commits[i];
        let end = start + a.children.len();
        let plan = a.finish(s, &inserted[start..end]);
        start = end;
        let row = &plan.row;
        writes.push_over(row, current.get(&row.id.0).map(|r| (&r.context, r.result.as_ref())));
        for e in plan.history.iter().cloned() {
            history.push(row, plan.attempt, now, e);
        }
        if let Some(l) = &plan.dead_letter {
            letters.push(l);
        }
        if plan.drain_inbox {
            // The whole inbox goes (a NULL id), the consumed signals with it.
            consume_t.push(s.id.0);
            consume_s.push(None);
        } else {
            for sig in &plan.consume {
                consume_t.push(s.id.0);
                consume_s.push(Some(sig.0));
            }
        }
        match &plan.timers {
            TimerPlan::Change { cancel, arm } => timers.change(row, cancel, arm),
            TimerPlan::DropAll => timers.drop_all(row.id),
        }
        if let Some(release) = &plan.barrier_release {
            if joined.contains(&release.parent.0) {
                join_releases.push(release.clone());
            } else {
                parents.push(release.parent.0);
            }
            ready = true;
        }
        ready |= row.status == Status::Runnable && row.eligible_at <= now;
        ended |= row.status.is_terminal() || row.status == Status::Suspended;
        for (signal, target) in &plan.emits {
            emits.push(signal.clone());
            emit_targets_ok.push(Some(*target));
            is_notice.push(false);
        }
        if let Some(notice) = &plan.parent_notice
            && let SignalTarget::Id(parent) = notice.target
        {
            emits.push(notice.clone());
            emit_targets_ok.push(Some(parent));
            is_notice.push(true);
        }
        if !plan.children_cancel.is_none() {
            leaving.push((row.id, plan.children_cancel.clone()));
        }
        results[i] = Some(Ok(plan.receipt));
    }

    let write = c.prepare_cached(rows::WRITE_INSTANCES).await?;
    let hist = c.prepare_cached(rows::WRITE_HISTORY).await?;
    let cons = c.prepare_cached(signal::REMOVE).await?;
    let dl = c.prepare_cached(DEAD_LETTERS).await?;
    let rel = c.prepare_cached(rows::RELEASE_PARENTS).await?;
    let now_ts = ts(now);
    let f_write =
        async { if writes.is_empty() { Ok(0) } else { c.execute(&write, &writes.params()).await } };
    let f_hist = async {
        if history.is_empty() { Ok(0) } else { c.execute(&hist, &history.params()).await }
    };
    let f_consume = async {
        if consume_t.is_empty() { Ok(0) } else { c.execute(&cons, &[&consume_t, &consume_s]).await }
    };
    let f_letters = async {
        if letters.is_empty() {
            Ok(Vec::new())
        } else {
            let mut p = letters.params();
            p.push(&now_ts);
            c.query(&dl, &p).await
        }
    };
    let f_release = async {
        if parents.is_empty() { Ok(0) } else { c.execute(&rel, &[&parents, &now_ts]).await }
    };
    let timer_stmt = c.prepare_cached(timer::CHANGE).await?;
    let timers_empty = timers.is_empty();
    let timer_hint = timers.hint();
    let timer_params = timers.params(now);
    let f_timers = async {
        if timers_empty {
            Ok::<u64, tokio_postgres::Error>(0)
        } else {
            c.execute(&timer_stmt, &timer_params).await
        }
    };
    // Sent once the commit has landed: sweepers re-plan for the timers armed, and callers
    // waiting for these instances' results re-read them.
    let mut notices = Notices { ready, ended, timer: timer_hint };
    let delivered = !emits.is_empty();
    // Children cancelled for a left delegation state go after every other write, so the
    // transaction stays open for them.
    let deferred = delivered || !leaving.is_empty() || !join_releases.is_empty();
    let tail = async {
        if deferred {
            return Ok(None);
        }
        end_tx_notices(c, channel, &notices).await?;
        Ok::<_, crate::error::OpError>(Some(()))
    };
    let (written, hist_done, consumed, letter_rows, released, timed, tail) =
        tokio::join!(f_write, f_hist, f_consume, f_letters, f_release, f_timers, tail);
    // In the order the statements went out (see the first round trip).
    written?;
    hist_done?;
    consumed?;
    let letter_rows = letter_rows?;
    released?;
    timed?;
    tail?;
    let letter_ids: HashMap<i64, i64> = letter_rows
        .iter()
        .map(|row| Ok((rows::col(row, 0)?, rows::col(row, 1)?)))
        .collect::<Result<_, StoreError>>()?;
    if leaving.is_empty() && join_releases.is_empty() {
        if delivered {
            let plan = signal::plan_resolved(c, &emits, &emit_targets_ok, now).await?;
            signal::finish(c, &plan, Some((channel, notices))).await?;
        }
    } else {
        // In the order every store runs a commit item in: its outbox signals; then what its
        // barrier release leaves (the children a woken parent stops waiting for, cancelled
        // under one bound per release, then the ended child's notice to its parent); then
        // the delegated children it left, cancelled. (Across the items of one batch, every
        // item's outbox goes before the first release.)
        let mut outbox = (Vec::new(), Vec::new());
        let mut to_parents = (Vec::new(), Vec::new());
        for ((signal, target), notice) in emits.into_iter().zip(emit_targets_ok).zip(is_notice) {
            let side = if notice { &mut to_parents } else { &mut outbox };
            side.0.push(signal);
            side.1.push(target);
        }
        deliver_within(c, &outbox.0, &outbox.1, now, &mut notices).await?;
        let (cancels, _) = admin::release_joined(c, &join_releases, now).await?;
        for cancels in cancels {
            admin::run_follow_ups(c, FollowUps::cancels(cancels), now, &mut notices).await?;
        }
        deliver_within(c, &to_parents.0, &to_parents.1, now, &mut notices).await?;
        cancel_left(c, &leaving, now, &mut notices).await?;
        end_tx_notices(c, channel, &notices).await?;
    }
    Ok(results
        .into_iter()
        .map(|r| {
            let mut r = r.expect("every item decided");
            if let Ok(receipt) = &mut r {
                receipt.dead_letter = letter_ids.get(&receipt.id.0).map(|id| DeadLetterId(*id));
            }
            r
        })
        .collect())
}

/// Cancels, in the commit's transaction, the live children each committing instance
/// started from a delegation state it left, with their descendants; marks in `notices`
/// what that ended and woke.
async fn cancel_left<C: GenericClient + Sync>(
    c: &C,
    leaving: &[(InstanceId, LeftDelegations)],
    now: Timestamp,
    notices: &mut Notices,
) -> OpResult<()> {
    let max = keel_core::limits::CHILDREN_PER_STEP_MAX as i64;
    let ids = delegated(c, leaving, max).await?;
    for child in rows::lock_instances(c, &ids).await? {
        let Some((parent, left)) = leaving.iter().find(|(id, _)| Some(*id) == child.parent) else {
            continue;
        };
        if !left.covers(&child, *parent) {
            continue;
        }
        let p = left.cancel_params(&child, now);
        admin::cancel_locked(c, &p, keel_core::plan::cancel::left_delegation, notices).await?;
    }
    Ok(())
}

/// Delivers `signals` (each to its resolved target) as one batch inside the caller's
/// transaction, marking in `notices` whether it woke anything.
async fn deliver_within<C: GenericClient + Sync>(
    c: &C,
    signals: &[NewSignal],
    targets: &[Option<InstanceId>],
    now: Timestamp,
    notices: &mut Notices,
) -> OpResult<()> {
    if signals.is_empty() {
        return Ok(());
    }
    let plan = signal::plan_resolved(c, signals, targets, now).await?;
    signal::finish(c, &plan, None).await?;
    notices.ready |= plan.woke();
    Ok(())
}

/// Inserts dead letters in one statement (outside a step commit: an undecodable row).
pub(crate) async fn write_dead_letters<C: GenericClient + Sync>(
    c: &C,
    letters: &[NewDeadLetter],
    now: Timestamp,
) -> OpResult<()> {
    if letters.is_empty() {
        return Ok(());
    }
    let mut w = LetterWrite::default();
    for l in letters {
        w.push(l);
    }
    let now_ts = ts(now);
    let mut p = w.params();
    p.push(&now_ts);
    let stmt = c.prepare_cached(DEAD_LETTERS).await?;
    c.query(&stmt, &p).await?;
    Ok(())
}

/// The parameter arrays of the dead-letter insert.
#[derive(Default)]
struct LetterWrite {
    instance: Vec<i64>,
    namespace: Vec<String>,
    machine: Vec<String>,
    version: Vec<i32>,
    position: Vec<String>,
    signals: Vec<serde_json::Value>,
    event: Vec<Option<serde_json::Value>>,
    correlation_id: Vec<Option<String>>,
    reason: Vec<String>,
    attempts: Vec<i32>,
    errors: Vec<serde_json::Value>,
    first: Vec<SystemTime>,
    last: Vec<SystemTime>,
}

impl LetterWrite {
    fn push(&mut self, l: &NewDeadLetter) {
        self.instance.push(l.instance.0);
        self.namespace.push(l.namespace.clone());
        self.machine.push(l.machine.name.clone());
        self.version.push(l.machine.version);
        self.position.push(l.position.clone());
        self.signals.push(serde_json::json!(l.signals.iter().map(|s| s.0).collect::<Vec<_>>()));
        self.event.push(l.event.clone());
        self.correlation_id.push(l.correlation_id.clone());
        self.reason.push(l.reason.clone());
        self.attempts.push(l.attempts);
        self.errors.push(serde_json::to_value(&l.errors).unwrap_or_default());
        self.first.push(ts(l.first_attempt_at));
        self.last.push(ts(l.last_attempt_at));
    }

    fn is_empty(&self) -> bool {
        self.instance.is_empty()
    }

    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        vec![
            &self.instance,
            &self.namespace,
            &self.machine,
            &self.version,
            &self.position,
            &self.signals,
            &self.event,
            &self.correlation_id,
            &self.reason,
            &self.attempts,
            &self.errors,
            &self.first,
            &self.last,
        ]
    }
}

#[cfg(test)]
mod tests {
    /// The SQL that recognises a timer's fire uses the core's fire key prefix, so the two
    /// cannot drift apart.
    #[test]
    fn the_fire_test_in_sql_uses_the_cores_prefix() {
        let prefix = keel_core::timers::FIRE_KEY_PREFIX;
        assert!(is_fire!().contains(&format!("LIKE '{prefix}%'")), "{}", is_fire!());
    }

    /// The delegated children a commit batch looks at are bounded per parent, and only
    /// children of the states a parent leaves count toward its bound: neither a parent
    /// listed first nor the children of a state it keeps crowd out the ones to cancel.
    #[tokio::test]
    async fn delegated_children_are_bounded_per_parent_and_only_for_the_states_left() {
        use keel_core::InstanceId;
        use keel_core::plan::cancel::LeftDelegations;
        use keel_testkit::conformance::support::{at, insert_one, new_in};
        let Some(s) = super::super::plans::fresh_schema_or_skip().await else { return };
        let ns = "delegated";
        let a = insert_one(&s, new_in(ns), at(0)).await;
        let b = insert_one(&s, new_in(ns), at(0)).await;
        let mut children = Vec::new();
        // Lowest ids first: the children of a state `a` keeps, then those of the state it
        // leaves, then `b`'s.
        for (parent, state) in [
            (a, "kept"),
            (a, "kept"),
            (a, "kept"),
            (a, "left"),
            (a, "left"),
            (a, "left"),
            (b, "other"),
            (b, "other"),
            (b, "other"),
        ] {
            children.push((parent, insert_one(&s, new_in(ns).invoked_by(state), at(0)).await));
        }
        let c = s.client().await.expect("a connection");
        for (parent, child) in &children {
            c.execute("UPDATE instances SET parent_id = $1 WHERE id = $2", &[&parent.0, &child.0])
                .await
                .expect("adopt");
        }
        let leaving = [
            // The commit itself started `a`'s first child of "left" (a retry): spared.
            (a, LeftDelegations::of(&["left".into()], false).sparing([children[3].1])),
            (b, LeftDelegations::All),
            (InstanceId(a.0 + 1_000_000), LeftDelegations::None),
        ];
        let found = super::delegated(&c, &leaving, 2).await.expect("lookup");
        let want: Vec<i64> = [children[4].1, children[5].1, children[6].1, children[7].1]
            .iter()
            .map(|id| id.0)
            .collect();
        assert_eq!(found, want, "two per parent, of the states left, none the commit started");
    }
}
