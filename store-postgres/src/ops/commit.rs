//! `step_commit`: a batch of step results in one transaction.
//!
//! Round trip 1 (pipelined): `BEGIN`, lock the batch's rows (id order, `FOR NO KEY
//! UPDATE`), and — for `Await` items — whether a matching signal outside the consumed set is
//! in the inbox (read after the lock, so no delivery can slip between). Then each item is
//! checked with the pure `validate_commit` (stale ⇒ `LeaseLost`, nothing written for it) and
//! applied with the pure `apply`. `ScheduleChildren` children go in with one insert. The
//! last round trip writes every accepted row (`UPDATE … FROM unnest`), deletes exactly the
//! consumed signals — and the whole inbox of every item that ended its instance, whose
//! unread signals round trip 1 also read (count and oldest few, for the one history entry
//! of the drain) — appends history, stores dead letters, decrements parents' barriers
//! for children that became terminal, notifies once and commits. Outbox emits, when there
//! are any, run the delivery path before that last round trip.

use super::{begin, end_tx, insert, signal, timer};
use crate::error::OpResult;
use crate::rows::{self, HistoryWrite, InstanceWrite, ts};
use deadpool_postgres::GenericClient;
use keel_core::inbox;
use keel_core::instance::{Instance, NewDeadLetter, NewInstance, NewSignal, SignalTarget};
use keel_core::outcome::{self, ApplyFacts, Outcome, StepCommit};
use keel_core::ports::store::{CommitReceipt, InsertOutcome};
use keel_core::{DeadLetterId, InstanceId, Status, StoreError, StoreResult, Timestamp};
use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

const AWAIT_CHECK: &str = "SELECT a.id FROM unnest($1::int8[], $2::text[]) AS a(id, name) \
    WHERE EXISTS (SELECT 1 FROM signals s WHERE s.target_id = a.id \
      AND (a.name = '*' OR s.name = a.name) \
      AND NOT EXISTS (SELECT 1 FROM unnest($3::int8[], $4::int8[]) AS x(t, s) \
                      WHERE x.t = s.target_id AND x.s = s.id))";

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

/// One accepted item on its way to the database.
struct Accepted {
    index: usize,
    before: Instance,
    children: Vec<InsertOutcome>,
    /// Per `spawn` item, new or existing id.
    spawned: Vec<InsertOutcome>,
    /// The unique key this commit would bring back into scope, if any.
    key: Option<Vec<u8>>,
}

/// The unique key a commit would bring back into scope: the row's key when its scope
/// leaves out `executing` but includes a status the outcome may land in (for
/// `ScheduleChildren`, either of the two it may land in).
fn reentering_key(row: &Instance, s: &StepCommit, waiting: bool) -> Option<Vec<u8>> {
    let unique = row.unique.as_ref()?;
    if unique.scope.contains(Status::Executing) {
        return None;
    }
    let statuses: Vec<Status> = [0, 1]
        .iter()
        .map(|n| {
            let facts =
                ApplyFacts { now: row.updated_at, signal_waiting: waiting, children_inserted: *n };
            outcome::apply(row, s, facts).row.status
        })
        .collect();
    statuses.iter().any(|st| unique.scope.contains(*st)).then(|| unique.key.clone())
}

/// Rejects (`Conflict`) accepted items whose unique key would come back into scope while
/// another instance — or an earlier item of this batch — occupies it.
async fn reject_occupied_keys<C: GenericClient + Sync>(
    c: &C,
    accepted: &mut Vec<Accepted>,
    results: &mut [Option<StoreResult<CommitReceipt>>],
) -> OpResult<()> {
    let keys: Vec<&[u8]> = accepted.iter().filter_map(|a| a.key.as_deref()).collect();
    if keys.is_empty() {
        return Ok(());
    }
    let stmt = c
        .prepare_cached(
            "SELECT unique_guard, id FROM instances WHERE unique_guard = ANY($1::bytea[])",
        )
        .await?;
    let mut occupied: HashMap<Vec<u8>, i64> = c
        .query(&stmt, &[&keys])
        .await?
        .iter()
        .map(|r| Ok((rows::col(r, 0)?, rows::col(r, 1)?)))
        .collect::<Result<_, StoreError>>()?;
    accepted.retain(|a| {
        let Some(key) = &a.key else { return true };
        match occupied.get(key) {
            Some(other) if *other != a.before.id.0 => {
                results[a.index] = Some(Err(StoreError::conflict(format!(
                    "instance {}: its unique key would be back in scope, but instance {other} occupies it",
                    a.before.id
                ))));
                false
            }
            _ => {
                occupied.insert(key.clone(), a.before.id.0);
                true
            }
        }
    });
    Ok(())
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
    for s in commits {
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
    let lock = c.prepare_cached(&rows::LOCK_INSTANCES).await?;
    let check = c.prepare_cached(AWAIT_CHECK).await?;
    let waiting = async {
        if await_ids.is_empty() {
            return Ok(Vec::new());
        }
        c.query(&check, &[&await_ids, &await_names, &ct, &cs]).await
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
    let emit_targets: Vec<&SignalTarget> =
        commits.iter().flat_map(|s| s.emit.iter().map(|e| &e.target)).collect();
    let (b, locked, waiting, pending, resolved) = tokio::join!(
        begin(c),
        async { c.query(&lock, &[&ids]).await },
        waiting,
        pending,
        signal::resolve(c, &emit_targets)
    );
    b?;
    let pending = signal::pending_of(&pending?)?;
    let mut current: HashMap<i64, Instance> = HashMap::new();
    for r in &locked? {
        let row = rows::instance(r)?;
        current.insert(row.id.0, row);
    }
    let waiting: HashSet<i64> =
        waiting?.iter().map(|r| rows::col(r, 0)).collect::<Result<_, StoreError>>()?;
    let resolved = resolved?;
    let mut emit_at = Vec::with_capacity(commits.len());
    let mut n = 0;
    for s in commits {
        emit_at.push(n);
        n += s.emit.len();
    }

    // Fence and shape, in batch order; an accepted item leaves its row non-executing, so a
    // second item for the same instance is stale.
    let mut results: Vec<Option<StoreResult<CommitReceipt>>> = vec![None; commits.len()];
    let mut accepted: Vec<Accepted> = Vec::new();
    for (i, s) in commits.iter().enumerate() {
        let Some(row) = current.get_mut(&s.id.0) else {
            results[i] = Some(Err(StoreError::not_found(format!(
                "instance {} does not exist; nothing was committed for it",
                s.id
            ))));
            continue;
        };
        if let Err(e) = outcome::validate_commit(row, s) {
            results[i] = Some(Err(e));
            continue;
        }
        let targets = &resolved[emit_at[i]..emit_at[i] + s.emit.len()];
        if let Some(j) = targets.iter().position(Option::is_none) {
            results[i] = Some(Err(StoreError::not_found(format!(
                "emit[{j}].target: no instance {:?}; the step result was rejected, nothing was committed",
                s.emit[j].target
            ))));
            continue;
        }
        let key = reentering_key(row, s, waiting.contains(&s.id.0));
        accepted.push(Accepted {
            index: i,
            before: row.clone(),
            children: Vec::new(),
            spawned: Vec::new(),
            key,
        });
        row.status = Status::Runnable;
    }
    reject_occupied_keys(c, &mut accepted, &mut results).await?;

    // Children of every accepted ScheduleChildren item and every item's `spawn` (children
    // without a barrier), in one insert: per item, its barrier children then its spawn.
    let mut kids: Vec<insert::Item<'_>> = Vec::new();
    let mut spans = Vec::new();
    for a in &accepted {
        let s = &commits[a.index];
        let start = kids.len();
        let mut barrier = 0;
        if let Outcome::ScheduleChildren { children, .. } = &s.outcome {
            barrier = children.len();
            kids.extend(children.iter().map(|n: &NewInstance| (n, Some(a.before.id))));
        }
        kids.extend(s.spawn.iter().map(|n: &NewInstance| (n, Some(a.before.id))));
        spans.push((a.index, start, barrier, s.spawn.len()));
    }
    let spawned = !kids.is_empty() && {
        let out = insert::insert_batch(c, &kids, now).await?;
        for (index, start, barrier, spawn) in spans {
            if let Some(a) = accepted.iter_mut().find(|a| a.index == index) {
                a.children = out[start..start + barrier].to_vec();
                a.spawned = out[start + barrier..start + barrier + spawn].to_vec();
            }
        }
        out.iter().any(|o| matches!(o, InsertOutcome::Inserted(_)))
    };

    // Apply.
    let mut writes = InstanceWrite::default();
    let mut history = HistoryWrite::default();
    let mut letters = LetterWrite::default();
    let (mut consume_t, mut consume_s): (Vec<i64>, Vec<Option<i64>>) = (Vec::new(), Vec::new());
    let mut parents = Vec::new();
    let mut emits: Vec<NewSignal> = Vec::new();
    let mut emit_targets_ok: Vec<Option<InstanceId>> = Vec::new();
    let mut timers = timer::TimerWrite::default();
    let mut ready = spawned;
    for a in &accepted {
        let s = &commits[a.index];
        let inserted =
            a.children.iter().filter(|o| matches!(o, InsertOutcome::Inserted(_))).count();
        let facts = ApplyFacts {
            now,
            signal_waiting: waiting.contains(&s.id.0),
            children_inserted: inserted as i32,
        };
        let applied = outcome::apply(&a.before, s, facts);
        let row = &applied.row;
        writes.push(row);
        for e in applied.history.iter().cloned() {
            history.push(row, a.before.attempt, now, e);
        }
        if let Some(l) = &applied.dead_letter {
            letters.push(l);
        }
        let terminal = applied.became_terminal();
        if terminal {
            // The whole inbox goes (a NULL id), the consumed signals with it.
            consume_t.push(s.id.0);
            consume_s.push(None);
            let unread = pending.get(&s.id.0).cloned().unwrap_or_default();
            if let Some(e) = inbox::drained(&unread) {
                history.push(row, a.before.attempt, now, e);
            }
        } else {
            for sig in &s.consume {
                consume_t.push(s.id.0);
                consume_s.push(Some(sig.0));
            }
        }
        timers.change(row, &s.timers_cancel, &s.timers_arm, now);
        if terminal {
            timers.drop_all(row.id);
        }
        if terminal && let Some(p) = row.parent {
            parents.push(p.0);
            ready = true;
        }
        ready |= row.status == Status::Runnable && row.eligible_at <= now;
        emits.extend(s.emit.iter().cloned());
        emit_targets_ok
            .extend_from_slice(&resolved[emit_at[a.index]..emit_at[a.index] + s.emit.len()]);
        // A chart parent hears of its child's end through its inbox, after the outbox.
        if terminal && let Some(notice) = outcome::parent_notice(row) {
            emit_targets_ok.push(row.parent);
            emits.push(notice);
        }
        results[a.index] = Some(Ok(CommitReceipt {
            id: row.id,
            revision: row.revision,
            status: row.status,
            children: a.children.clone(),
            spawned: a.spawned.clone(),
            dead_letter: None,
        }));
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
    let hint_stmt = c.prepare_cached(timer::HINT).await?;
    let timers_empty = timers.is_empty();
    let timer_hint = timers.hint();
    let timer_params = timers.params(now);
    // The hint is sent with the timer write, ahead of the COMMIT in the pipeline.
    let f_timers = async {
        if timers_empty {
            return Ok(0);
        }
        let (written, hinted) = tokio::join!(
            c.execute(&timer_stmt, &timer_params),
            timer::hint_send(c, &hint_stmt, channel, timer_hint.as_deref())
        );
        hinted?;
        written
    };
    let delivered = !emits.is_empty();
    let tail = async {
        if delivered {
            return Ok(None);
        }
        end_tx(c, ready.then_some(channel)).await?;
        Ok::<_, crate::error::OpError>(Some(()))
    };
    let (written, hist_done, consumed, letter_rows, released, timed, tail) =
        tokio::join!(f_write, f_hist, f_consume, f_letters, f_release, f_timers, tail);
    written?;
    timed?;
    hist_done?;
    consumed?;
    released?;
    let letter_ids: HashMap<i64, i64> = letter_rows?
        .iter()
        .map(|row| Ok((rows::col(row, 0)?, rows::col(row, 1)?)))
        .collect::<Result<_, StoreError>>()?;
    tail?;
    if delivered {
        let plan = signal::plan_resolved(c, &emits, &emit_targets_ok, now).await?;
        signal::finish(c, &plan, Some((channel, ready))).await?;
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
