//! The `Store` operations as functions of one open transaction.
//!
//! Each operation reads what its decision depends on, lets the core decide and writes the
//! result back: step commits through `keel_core::plan::commit` (this module reads what the
//! planner asks for, inserts the children it admits and performs the writes of its plan);
//! inserts, deliveries, broadcasts, leases, cancels, dead-letter actions and the timer sweep
//! through the other planners of `keel_core::plan`; claims through the pure transitions of
//! `outcome` and the inbox rules of `inbox`, in the same order as `MemoryStore`, so the two
//! cannot drift apart. The caller owns the
//! transaction: it begins it with `BEGIN IMMEDIATE`, and commits only when the operation
//! returns `Ok`.

use crate::error::corrupt;
use crate::inbox::{Ask as InboxAsk, Facts as InboxFacts};
use crate::rows::{Db, Guard, SignalInsert, Writes, dead_letter_cols, instance_cols, timer_cols};
use keel_core::instance::{NewDeadLetter, check_batch, unique_guard};
use keel_core::limits;
use keel_core::plan::claim::{self, CandidateRead, ClaimPlanner};
use keel_core::plan::commit::{self, ChildInsert, CommitPlanner, CommitRead, TimerPlan};
use keel_core::plan::history::TrimCandidate;
use keel_core::plan::parent::{FollowUp, FollowUps, NextFollowUp, ParentPlan, ParentRelease};
use keel_core::plan::prune::PruneCandidate;
use keel_core::plan::{
    self, RowWrite, cancel::CancelRead, deliver::DeliverRead, insert::InsertRead,
};
use keel_core::ports::store::{
    BroadcastReport, CancelParams, Claim, ClaimParams, CommitReceipt, DeadLetterPurgeParams,
    DeadLetterRetryParams, DeadLetterSelector, DeadLetterSkipParams, DeliveryOutcome,
    HistoryTrimPage, HistoryTrimParams, InsertOutcome, InsertParams, LeaseExtendParams,
    LeaseReapParams, LeaseReleaseParams, MigratePage, MigrateParams, PrunePage, PruneParams,
    ReadyStaleParams, SignalBroadcastParams, SignalDeliverParams, TimerNextDueParams,
    TimerRetimePage, TimerRetimeParams, TimerSweepParams, TimerSweepReport,
};
use keel_core::timers::TimerRow;
use keel_core::{
    DeadLetterId, ErrorKind, Instance, InstanceId, NewSignal, Status, StepCommit, StoreError,
    StoreResult, Timestamp,
};
use sqlx::Connection;
use sqlx::Row;
use std::collections::{HashMap, HashSet};

/// Every timer of an instance: what a commit that cancels timers reads (an instance holds
/// the timers its active states armed, each state at most `TIMERS_PER_STEP_MAX`).
pub(crate) const ALL_TIMERS: usize = i64::MAX as usize;

/// Fewest candidate rows one claim reads per page while it looks for claimable ones. A
/// page is the claim's limit otherwise: every row read is decoded and filtered, so a small
/// claim (one freed slot) must not pay for dozens of rows it will not take; a claim that
/// turns rows down reads the next page.
const CLAIM_PAGE_MIN: usize = 4;

// ----- inserts ---------------------------------------------------------------------------

/// Validates the whole batch first, so an invalid item writes nothing.
pub(crate) async fn insert(db: &mut Db<'_>, p: &InsertParams) -> StoreResult<Vec<InsertOutcome>> {
    p.validate()?;
    let mut read = InsertRead::default();
    for key in plan::insert::keys(&p.instances) {
        if let Some(id) = db.occupant(key, InstanceId(0)).await? {
            read.occupants.insert(key.to_vec(), id);
        }
    }
    let plan = plan::insert::insert(&p.instances, read);
    let mut ids = Vec::with_capacity(plan.inserts.len());
    for i in &plan.inserts {
        let row = Instance::from_new(InstanceId(0), &p.instances[*i], None, p.now);
        ids.push(db.instance_insert(&row).await?);
    }
    Ok(plan.outcomes(&ids))
}

/// The filters every claim page applies to table alias `$t`: the named ids (`$only`), the
/// claim's namespaces, queues and machines, pauses, the executing-concurrency-key rule,
/// rows waiting for a unique key a running row holds (a key scoped to `executing` but not
/// `runnable`, bits 1 and 0 of `unique_scope`: the planner would turn them down, and a page
/// of them would hide the rows behind) and the group.
macro_rules! claim_filters {
    ($only:literal, $t:literal) => {
        concat!(
            " AND ",
            $only,
            " AND (? = '[]' OR namespace IN (SELECT value FROM json_each(?))) \
               AND (? = '[]' OR queue IN (SELECT value FROM json_each(?))) \
               AND (? = '[]' OR EXISTS (SELECT 1 FROM jsonb_each(?) m \
                     WHERE json_extract(m.value, '$[0]') = ",
            $t,
            ".machine AND json_extract(m.value, '$[1]') = ",
            $t,
            ".machine_version)) \
               AND NOT EXISTS (SELECT 1 FROM keel_queues q WHERE q.namespace = ",
            $t,
            ".namespace AND q.queue = ",
            $t,
            ".queue AND q.paused <> 0) \
               AND (concurrency_key IS NULL OR ? > 1 OR NOT EXISTS (SELECT 1 FROM keel_instances e \
                     WHERE e.status = 'executing' AND e.concurrency_key = ",
            $t,
            ".concurrency_key)) \
               AND (",
            $t,
            ".unique_key IS NULL OR (",
            $t,
            ".unique_scope & 1) <> 0 OR (",
            $t,
            ".unique_scope & 2) = 0 \
                    OR NOT EXISTS (SELECT 1 FROM keel_instances g WHERE g.unique_guard = ",
            $t,
            ".unique_key)) \
               AND (? = 0 OR concurrency_key IS ?)"
        )
    };
}

/// The columns of a claim candidate: the row and its key's executing rows.
macro_rules! claim_cols {
    () => {
        concat!(
            instance_cols!(),
            ", CASE WHEN concurrency_key IS NULL THEN 0 ELSE \
               (SELECT count(*) FROM keel_instances e WHERE e.status = 'executing' \
                  AND e.concurrency_key = i.concurrency_key) END AS key_running"
        )
    };
}

/// The claim page statement in the plain priority order, which the claim index serves:
/// candidates past the keyset `(priority, eligible_at, id) > (?, ?, ?)` that pass the
/// filters, in claim order.
macro_rules! claim_sql {
    ($only:literal) => {
        concat!(
            "SELECT ",
            claim_cols!(),
            " FROM keel_instances i WHERE status = 'runnable' \
               AND (priority, eligible_at, id) > (?, ?, ?) AND eligible_at <= ?",
            claim_filters!($only, "i"),
            " ORDER BY priority, eligible_at, id LIMIT +?"
        )
    };
}

/// The claim page statement for one rank of a ranked order (`$level`: the rows of the
/// rank), in `(eligible_at, id)` order past `(?, ?)`: every rank is a range of an index
/// that keeps that order, so a page reads only the rows it returns, however many are
/// ready.
macro_rules! claim_level_sql {
    ($level:literal, $only:literal) => {
        concat!(
            "SELECT ",
            claim_cols!(),
            " FROM keel_instances i WHERE status = 'runnable' AND ",
            $level,
            " AND (eligible_at, id) > (?, ?) AND eligible_at <= ?",
            claim_filters!($only, "i"),
            " ORDER BY eligible_at, id LIMIT +?"
        )
    };
}

// ----- claims ----------------------------------------------------------------------------

/// The repair read (`plan::hints::needs_hint` in SQL, over the claim's filters): ready
/// rows unchanged and due for at least `ready_for`, in id order after the cursor. The rule
/// is applied again to the decoded rows, so the SQL can only narrow what the core decides.
pub(crate) async fn ready_stale(
    db: &mut Db<'_>,
    p: &ReadyStaleParams,
) -> StoreResult<Vec<Instance>> {
    p.validate()?;
    let namespaces = serde_json::to_string(&p.namespaces).unwrap_or_default();
    let queues = serde_json::to_string(&p.queues).unwrap_or_default();
    let machines: Vec<(&str, i32)> =
        p.machines.iter().map(|m| (m.name.as_str(), m.version)).collect();
    let machines = serde_json::to_string(&machines).unwrap_or_default();
    let rows = sqlx::query(concat!(
        "SELECT ",
        instance_cols!(),
        " FROM keel_instances i \
         WHERE status = 'runnable' AND eligible_at <= ? \
           AND max(updated_at, eligible_at) <= ? AND id > ? \
           AND (? = '[]' OR namespace IN (SELECT value FROM json_each(?))) \
           AND (? = '[]' OR queue IN (SELECT value FROM json_each(?))) \
           AND (? = '[]' OR EXISTS (SELECT 1 FROM jsonb_each(?) m \
                 WHERE json_extract(m.value, '$[0]') = i.machine \
                   AND json_extract(m.value, '$[1]') = i.machine_version)) \
           AND NOT EXISTS (SELECT 1 FROM keel_queues q WHERE q.namespace = i.namespace \
                 AND q.queue = i.queue AND q.paused <> 0) \
         ORDER BY id LIMIT +?"
    ))
    .bind(p.now.0)
    .bind(p.now.minus(p.ready_for).0)
    .bind(p.after.map_or(i64::MIN, |id| id.0))
    .bind(&namespaces)
    .bind(&namespaces)
    .bind(&queues)
    .bind(&queues)
    .bind(&machines)
    .bind(&machines)
    .bind(p.limit as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("reading ready instances for the repair pass"))?;
    let rows: Vec<Instance> = rows.iter().map(|r| db.instance_of(r)).collect::<StoreResult<_>>()?;
    Ok(rows.into_iter().filter(|r| keel_core::plan::hints::needs_hint(r, false, p)).collect())
}

/// The concurrency keys with due runnable rows in the claim's queues, in ascending order:
/// those after the first parameter up to and including the third (no upper end when
/// NULL), at most the sixth parameter of them. A skip scan: each key is one probe of the
/// runnable-keys index for the next key, which reads past a key's rows only where they
/// are not due yet or belong to another queue; so the scan's cost follows the keys it
/// returns, not the rows waiting under them.
pub(crate) const ROTATION_KEYS_SQL: &str = "WITH RECURSIVE k(key, n) AS ( \
       SELECT ?, 0 \
       UNION ALL \
       SELECT (SELECT i.concurrency_key FROM keel_instances i \
               WHERE i.status = 'runnable' AND i.concurrency_key IS NOT NULL \
                 AND i.concurrency_key > k.key AND i.eligible_at <= ? \
                 AND (? IS NULL OR i.concurrency_key <= ?) \
                 AND (? = '[]' OR i.queue IN (SELECT value FROM json_each(?))) \
               ORDER BY i.concurrency_key LIMIT 1), k.n + 1 \
       FROM k WHERE k.key IS NOT NULL AND k.n < ? \
     ) \
     SELECT key FROM k WHERE n > 0 AND key IS NOT NULL";

/// [`ROTATION_KEYS_SQL`]: the keys after `after` (every key when `None`) up to and
/// including `through` (no upper end when `None`), at most `max` of them.
async fn rotation_keys(
    db: &mut Db<'_>,
    now: Timestamp,
    queues: &str,
    (after, through): (Option<&str>, Option<&str>),
    max: usize,
) -> StoreResult<Vec<String>> {
    sqlx::query_scalar(ROTATION_KEYS_SQL)
        // Every stored key is non-empty, so all of them sort after ''.
        .bind(after.unwrap_or(""))
        .bind(now.0)
        .bind(through)
        .bind(through)
        .bind(queues)
        .bind(queues)
        .bind(max as i64)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("listing concurrency keys"))
}

/// Claims in priority, `eligible_at`, id order. The SQL picks candidates that pass the
/// filters, pauses and the executing-concurrency-key rule (so each candidate's read says
/// neither paused nor key executing); the core's claim planner decides each candidate,
/// including the rules that depend on rows claimed earlier in the same call (one row per
/// concurrency key, unique keys) and what happens to a row that cannot be read.
pub(crate) async fn claim(
    db: &mut Db<'_>,
    p: &ClaimParams,
    ids: Option<&[InstanceId]>,
) -> StoreResult<Vec<Claim>> {
    p.validate()?;
    if ids.is_some_and(<[InstanceId]>::is_empty) {
        return Ok(Vec::new());
    }
    // A claim of named instances (a queue hint's targets) narrows the candidates to them.
    let only = crate::rows::ids_json(ids.unwrap_or_default().iter().map(|i| i.0));
    let namespaces = serde_json::to_string(&p.namespaces).unwrap_or_default();
    let queues = serde_json::to_string(&p.queues).unwrap_or_default();
    let machines: Vec<(&str, i32)> =
        p.machines.iter().map(|m| (m.name.as_str(), m.version)).collect();
    let machines = serde_json::to_string(&machines).unwrap_or_default();
    let page = p.limit.max(CLAIM_PAGE_MIN);
    let mut after: (i64, i64, i64) = (i64::MIN, i64::MIN, i64::MIN);
    // A global limit names one queue (checked by `validate`); the claim runs in the
    // store's one write transaction, so this count cannot change under it.
    let queue_executing = match p.policy.global_limit {
        Some(_) => {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM keel_instances WHERE status = 'executing' \
                   AND queue IN (SELECT value FROM json_each(?))",
            )
            .bind(&queues)
            .fetch_one(&mut *db.conn)
            .await
            .map_err(db.err("counting a queue's executing rows"))?;
            u64::try_from(n).unwrap_or(0)
        }
        None => 0,
    };
    let mut taken = Vec::new();
    // The claimed rows' writes, gathered into one query per page of candidates.
    let mut writes = Writes::default();
    let mut planner = ClaimPlanner::new(p);
    // A rate limit names one queue (checked by `validate`): refill its bucket first.
    let bucket_queue = p.queues.first().cloned().unwrap_or_default();
    let refilled = if p.policy.rate.is_some() {
        let stored: Option<(i64, i64, i64, bool)> = sqlx::query_as(
            "SELECT millitokens, at, carry, backlog <> 0 FROM keel_rate_buckets WHERE queue = ?",
        )
        .bind(&bucket_queue)
        .fetch_optional(&mut *db.conn)
        .await
        .map_err(db.err("reading a queue's rate bucket"))?;
        planner.rate(stored.map(|(millitokens, at, carry, backlog)| claim::Bucket {
            millitokens,
            at: Timestamp(at),
            carry,
            backlog,
        }))
    } else {
        None
    };
    let fair = claim::is_fair(p, ids.is_some());
    let cursor_queue = claim::cursor_queue(p);
    let cursor: Option<String> = match cursor_queue {
        Some(queue) if fair => {
            sqlx::query_scalar("SELECT after_key FROM keel_claim_cursors WHERE queue = ?")
                .bind(queue)
                .fetch_optional(&mut *db.conn)
                .await
                .map_err(db.err("reading a queue's claim cursor"))?
        }
        _ => None,
    };
    let pick =
        Pick { p, only: &only, namespaces: &namespaces, queues: &queues, machines: &machines };
    if fair {
        // Fair order: the rows without a key (a page, in claim order) and, per key with
        // room, its first rows, over the first keys in rotation order with such rows (as
        // many as the claim can take).
        let cap = planner.cap();
        let mut candidates: Vec<(Instance, u32)> =
            pick.page(db, (i64::MIN, i64::MIN, i64::MIN), Group::Unkeyed, page).await?;
        // The keys in rotation order: those after the cursor, then from the first up to
        // and including it, at most `CLAIM_KEYS_SCAN_MAX` of them in all.
        let scan = limits::CLAIM_KEYS_SCAN_MAX;
        let mut keys = rotation_keys(db, p.now, &queues, (cursor.as_deref(), None), scan).await?;
        if let Some(at) = cursor.as_deref()
            && keys.len() < scan
        {
            let left = scan - keys.len();
            keys.extend(rotation_keys(db, p.now, &queues, (None, Some(at)), left).await?);
        }
        // Where the scan stops at its bound without filling the claim, the next claim
        // carries on after the last key it visited.
        let mut stopped = None;
        let mut rooms: HashMap<String, u32> = HashMap::new();
        for (visited, key) in keys.into_iter().enumerate() {
            if rooms.len() >= cap {
                break;
            }
            if visited + 1 == limits::CLAIM_KEYS_SCAN_MAX {
                stopped = Some(key.clone());
            }
            let running: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM keel_instances WHERE status = 'executing' AND concurrency_key = ?",
            )
            .bind(&key)
            .fetch_one(&mut *db.conn)
            .await
            .map_err(db.err("counting a key's executing rows"))?;
            let mut room = i64::from(p.policy.key_limit) - running;
            if room <= 0 {
                continue;
            }
            if p.policy.key_rate.is_some() {
                let stored: Option<(i64, i64, i64, bool)> = sqlx::query_as(
                    "SELECT millitokens, at, carry, backlog <> 0 FROM keel_key_rate_buckets \
                     WHERE queue = ? AND concurrency_key = ?",
                )
                .bind(&bucket_queue)
                .bind(&key)
                .fetch_optional(&mut *db.conn)
                .await
                .map_err(db.err("reading a key's rate bucket"))?;
                let stored = stored.map(|(millitokens, at, carry, backlog)| claim::Bucket {
                    millitokens,
                    at: Timestamp(at),
                    carry,
                    backlog,
                });
                let tokens = planner.key_rate(&key, stored).unwrap_or(usize::MAX);
                room = room.min(i64::try_from(tokens).unwrap_or(i64::MAX));
                if room <= 0 {
                    continue;
                }
            }
            let rows = pick
                .page(
                    db,
                    (i64::MIN, i64::MIN, i64::MIN),
                    Group::Key(&key),
                    usize::try_from(room).unwrap_or(0),
                )
                .await?;
            if !rows.is_empty() {
                rooms.insert(key, u32::try_from(room).unwrap_or(u32::MAX));
                candidates.extend(rows);
            }
        }
        // Claim order across the groups, as the core expects its candidates.
        candidates.sort_by_key(|(r, _)| p.policy.order_key(r, p.now));
        let running: HashMap<InstanceId, u32> =
            candidates.iter().map(|(r, n)| (r.id, *n)).collect();
        let room = |k: &str| rooms.get(k).copied().unwrap_or(0);
        let ordered = claim::fair_order(
            candidates.into_iter().map(|(r, _)| r).collect(),
            cursor.as_deref(),
            cap,
            room,
        );
        for row in ordered {
            if planner.is_full() {
                break;
            }
            let key_running = running.get(&row.id).copied().unwrap_or(0);
            let offered = offer(db, &mut planner, &row, queue_executing, key_running, &mut writes);
            if let Some(next) = offered.await? {
                taken.push(next);
            }
        }
        let after =
            claim::cursor_after(cursor.clone(), &taken, planner.is_full(), stopped.as_deref());
        if let Some(queue) = cursor_queue
            && after != cursor
            && let Some(key) = &after
        {
            sqlx::query(
                "INSERT INTO keel_claim_cursors (queue, after_key) VALUES (?, ?) \
                 ON CONFLICT (queue) DO UPDATE SET after_key = excluded.after_key",
            )
            .bind(queue)
            .bind(key)
            .execute(&mut *db.conn)
            .await
            .map_err(db.err("writing a queue's claim cursor"))?;
        }
    }
    while !fair && !planner.is_full() {
        db.write(std::mem::take(&mut writes)).await?;
        let candidates = pick.page(db, after, Group::Any, page).await?;
        let exhausted = candidates.len() < page;
        for (row, key_running) in candidates {
            after = (i64::from(p.policy.rank(&row, p.now)), row.eligible_at.0, row.id.0);
            if planner.is_full() {
                break;
            }
            let offered = offer(db, &mut planner, &row, queue_executing, key_running, &mut writes);
            if let Some(next) = offered.await? {
                taken.push(next);
            }
        }
        if exhausted {
            break;
        }
    }
    db.write(writes).await?;
    if let Some(refilled) = refilled {
        let left = planner.spent(refilled);
        sqlx::query(
            "INSERT INTO keel_rate_buckets (queue, millitokens, at, carry, backlog) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (queue) DO UPDATE SET \
               millitokens = excluded.millitokens, at = excluded.at, carry = excluded.carry, \
               backlog = excluded.backlog",
        )
        .bind(&bucket_queue)
        .bind(left.millitokens)
        .bind(left.at.0)
        .bind(left.carry)
        .bind(left.backlog)
        .execute(&mut *db.conn)
        .await
        .map_err(db.err("writing a queue's rate bucket"))?;
    }
    if p.policy.key_rate.is_some() {
        key_buckets_write(db, &bucket_queue, &planner.key_buckets_spent(), p.now).await?;
    }
    // Every claimed row's inbox and children, in one query each.
    let ids: Vec<InstanceId> = taken.iter().map(|r| r.id).collect();
    let mut inboxes = db.inboxes(&ids, limits::CLAIM_INBOX_MAX).await?;
    let mut children = db.children_of(&ids).await?;
    let mut claims = Vec::with_capacity(taken.len());
    for next in taken {
        let inbox = inboxes.remove(&next.id).unwrap_or_default();
        if let Some(error) = claim::damage(&next, &inbox) {
            let applied = claim::undecodable(&next, &error, p.now);
            for entry in &applied.history {
                db.record(&applied.row, next.attempt, entry, p.now).await?;
            }
            if let Some(letter) = &applied.dead_letter {
                db.dead_letter_insert(letter, p.now).await?;
            }
            db.instance_update(&next, &applied.row).await?;
            continue;
        }
        let children = children.remove(&next.id).unwrap_or_default();
        claims.push(Claim { inbox, children, instance: next });
    }
    Ok(claims)
}

/// Stores the per-key buckets of `queue` a claim spent, then deletes up to
/// `KEY_RATE_BUCKETS_PRUNE_MAX` of the queue's buckets that are full and whose key has no
/// ready row in the queue (a new bucket would start no more rows than they would).
async fn key_buckets_write(
    db: &mut Db<'_>,
    queue: &str,
    written: &[claim::KeyBucket],
    now: Timestamp,
) -> StoreResult<()> {
    for k in written {
        sqlx::query(
            "INSERT INTO keel_key_rate_buckets \
               (queue, concurrency_key, millitokens, at, carry, backlog, full_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (queue, concurrency_key) DO UPDATE SET \
               millitokens = excluded.millitokens, at = excluded.at, carry = excluded.carry, \
               backlog = excluded.backlog, full_at = excluded.full_at",
        )
        .bind(queue)
        .bind(&k.key)
        .bind(k.bucket.millitokens)
        .bind(k.bucket.at.0)
        .bind(k.bucket.carry)
        .bind(k.bucket.backlog)
        .bind(k.full_at.0)
        .execute(&mut *db.conn)
        .await
        .map_err(db.err("writing a key's rate bucket"))?;
    }
    sqlx::query(
        "DELETE FROM keel_key_rate_buckets WHERE rowid IN ( \
           SELECT b.rowid FROM keel_key_rate_buckets b \
           WHERE b.queue = ? AND b.full_at <= ? \
             AND NOT EXISTS (SELECT 1 FROM keel_instances i WHERE i.status = 'runnable' \
               AND i.queue = b.queue AND i.concurrency_key = b.concurrency_key) \
           LIMIT +?)",
    )
    .bind(queue)
    .bind(now.0)
    .bind(limits::KEY_RATE_BUCKETS_PRUNE_MAX as i64)
    .execute(&mut *db.conn)
    .await
    .map_err(db.err("deleting full rate buckets of idle keys"))?;
    Ok(())
}

/// Offers one candidate to the claim planner and, when taken, gathers its write into
/// `writes` (a row with a unique key is written at once, after what was gathered, since
/// its guard is decided against the rows as they stand).
async fn offer(
    db: &mut Db<'_>,
    planner: &mut ClaimPlanner<'_>,
    row: &Instance,
    queue_executing: u64,
    key_running: u32,
    writes: &mut Writes,
) -> StoreResult<Option<Instance>> {
    let read = CandidateRead { queue_executing, key_running, ..CandidateRead::default() };
    let Some(next) = planner.offer(row, read) else { return Ok(None) };
    if row.unique.is_none() && next.unique.is_none() {
        if !planner.take(&next, false) {
            return Ok(None);
        }
        writes.instance_update(row, &next, Guard::Untouched);
        return Ok(Some(next));
    }
    db.write(std::mem::take(writes)).await?;
    let occupied = match next.unique_guard() {
        Some(guard) => db.occupant(guard, next.id).await?.is_some(),
        None => false,
    };
    if !planner.take(&next, occupied) {
        return Ok(None);
    }
    db.instance_update(row, &next).await?;
    Ok(Some(next))
}

/// Which rows a candidate page holds.
#[derive(Clone, Copy)]
enum Group<'k> {
    /// Every row.
    Any,
    /// The rows without a concurrency key.
    Unkeyed,
    /// The rows of one concurrency key.
    Key(&'k str),
}

/// The claim's filters, bound into the candidate page statement.
struct Pick<'a> {
    p: &'a ClaimParams,
    only: &'a str,
    namespaces: &'a str,
    queues: &'a str,
    machines: &'a str,
}

impl Pick<'_> {
    /// Up to `page` candidates past the keyset `after`, in claim order, each with its key's
    /// executing rows, narrowed to `group`.
    async fn page(
        &self,
        db: &mut Db<'_>,
        after: (i64, i64, i64),
        group: Group<'_>,
        page: usize,
    ) -> StoreResult<Vec<(Instance, u32)>> {
        let p = self.p;
        if p.policy.is_plain_priority() {
            return self.level(db, Level::Plain(after.0), (after.1, after.2), group, page).await;
        }
        // A ranked order (fifo, or priority with a starvation bound) is read band by band,
        // each in `(eligible_at, id)` order, until the page is full: ranking rows in the
        // statement would sort every ready row for every page.
        let mut out = Vec::new();
        for band in p.policy.rank_bands(p.now) {
            let rank = i64::from(band.rank);
            if out.len() >= page || rank < after.0 {
                continue;
            }
            let from = if rank == after.0 { (after.1, after.2) } else { (i64::MIN, i64::MIN) };
            out.extend(self.level(db, Level::Band(band), from, group, page - out.len()).await?);
        }
        Ok(out)
    }

    /// Up to `page` candidates of one rank past `(eligible_at, id) > from` (with the
    /// priority in front for the plain order), in claim order.
    async fn level(
        &self,
        db: &mut Db<'_>,
        level: Level,
        from: (i64, i64),
        group: Group<'_>,
        page: usize,
    ) -> StoreResult<Vec<(Instance, u32)>> {
        let p = self.p;
        let shape = match level {
            Level::Plain(_) => PageShape::Plain,
            Level::Band(band) if band.priority.is_some() => PageShape::OnePriority,
            Level::Band(_) => PageShape::EveryPriority,
        };
        let query = sqlx::query(page_sql(shape, self.only != "[]"));
        let query = match level {
            Level::Plain(priority) => query.bind(priority),
            Level::Band(band) => match band.priority {
                Some(priority) => query.bind(i64::from(priority.level())),
                None => query,
            }
            .bind(band.at_or_before.map_or(i64::MAX, |t| t.0))
            .bind(band.after.map_or(i64::MIN, |t| t.0)),
        };
        let rows = query
            .bind(from.0)
            .bind(from.1)
            .bind(p.now.0)
            .bind(self.only)
            .bind(self.only)
            .bind(self.namespaces)
            .bind(self.namespaces)
            .bind(self.queues)
            .bind(self.queues)
            .bind(self.machines)
            .bind(self.machines)
            .bind(i64::from(p.policy.key_limit))
            .bind(i64::from(!matches!(group, Group::Any)))
            .bind(match group {
                Group::Key(k) => Some(k),
                Group::Any | Group::Unkeyed => None,
            })
            .bind(page as i64)
            .fetch_all(&mut *db.conn)
            .await
            .map_err(db.err("picking rows to claim"))?;
        rows.iter()
            .map(|r| {
                let running: i64 = r.try_get("key_running").unwrap_or(0);
                Ok((db.instance_of(r)?, u32::try_from(running).unwrap_or(u32::MAX)))
            })
            .collect()
    }
}

/// Which statement a claim page runs.
#[derive(Clone, Copy)]
enum PageShape {
    /// The plain priority order, along the claim index.
    Plain,
    /// A band of one priority: named as an equality, so the claim index serves it.
    OnePriority,
    /// A band of every priority, along the age index.
    EveryPriority,
}

/// The claim page statement of `shape`. A claim of `named` instances looks them up by id
/// (a plain conjunct the planner can use); any other claim walks an index in claim order,
/// where an `OR` that names the ids would have it test every ready row against the list.
fn page_sql(shape: PageShape, named: bool) -> &'static str {
    macro_rules! shapes {
        ($only:literal) => {
            match shape {
                PageShape::Plain => claim_sql!($only),
                PageShape::OnePriority => {
                    claim_level_sql!("priority = ? AND eligible_at <= ? AND eligible_at > ?", $only)
                }
                PageShape::EveryPriority => {
                    claim_level_sql!("eligible_at <= ? AND eligible_at > ?", $only)
                }
            }
        };
    }
    if named {
        shapes!("? IS NOT NULL AND id IN (SELECT value FROM json_each(?))")
    } else {
        shapes!("(? = '[]' OR id IN (SELECT value FROM json_each(?)))")
    }
}

/// Which rows of the claim order one claim page statement reads.
#[derive(Clone, Copy)]
enum Level {
    /// The plain priority order, past this priority (with `(eligible_at, id)`).
    Plain(i64),
    /// One band of a ranked order.
    Band(claim::RankBand),
}

// ----- commits ---------------------------------------------------------------------------

/// What a commit batch reads for all of its items at once: their rows, their inboxes and
/// which of them have timers (three statements, where reading item by item costs three
/// per item). An item's read stays valid while the items before it in the batch wrote
/// only their own rows; the first item that reaches beyond its own row (an emitted
/// signal, a child started, a parent released, children cancelled) ends the prefetch,
/// and every later item reads for itself, so each item still sees the effects of the
/// items before it. The timer set only ever over-approximates (arms are added to it; a
/// cancelled instance's timers may be gone), so skipping the timer work of an instance
/// outside it never skips work that has something to do.
pub(crate) struct CommitPrefetch {
    reads: HashMap<InstanceId, (Option<Instance>, InboxFacts)>,
    timed: std::collections::HashSet<InstanceId>,
    valid: bool,
}

impl CommitPrefetch {
    /// Reads the rows, inbox facts and timer owners of `commits`' instances.
    pub(crate) async fn read(db: &mut Db<'_>, commits: &[StepCommit]) -> StoreResult<Self> {
        let ids: Vec<InstanceId> = commits.iter().map(|c| c.id).collect();
        let mut rows: HashMap<InstanceId, Instance> =
            db.instances(&ids).await?.into_iter().map(|r| (r.id, r)).collect();
        let asks: Vec<InboxAsk<'_>> = commits.iter().map(InboxAsk::of).collect();
        let mut inboxes = db.inbox_facts(&asks).await?;
        let timed = db.timer_owners(&ids).await?;
        let mut reads = HashMap::with_capacity(ids.len());
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        for id in ids {
            if seen.insert(id) {
                reads.insert(id, (rows.remove(&id), inboxes.remove(&id).unwrap_or_default()));
            } else {
                // The same instance twice in one batch: the second reads after the first.
                reads.remove(&id);
            }
        }
        Ok(CommitPrefetch { reads, timed, valid: true })
    }

    /// No prefetch: every item reads for itself (a single commit outside a batch).
    pub(crate) fn none() -> Self {
        CommitPrefetch {
            reads: HashMap::new(),
            timed: std::collections::HashSet::new(),
            valid: false,
        }
    }

    fn take(&mut self, id: InstanceId) -> Option<(Option<Instance>, InboxFacts)> {
        if self.valid { self.reads.remove(&id) } else { None }
    }

    /// Whether `id` may have timers (always, once the prefetch has ended).
    fn may_have_timers(&self, id: InstanceId) -> bool {
        !self.valid || self.timed.contains(&id)
    }
}

/// Commits a batch of step results in the caller's transaction: one receipt per item, in
/// order. An `Unavailable` error means the database itself failed (busy, IO) and aborts
/// the whole batch, since the transaction may no longer be usable.
///
/// An item whose read was prefetched and whose plan writes only its own rows (no emits,
/// children, parent, unique key, dead letter, or timer cancels that need reading) is
/// planned without the database, and its writes are gathered with those of the items
/// like it into one query, which runs before the next item that needs the database and
/// at the end. Should that query fail, it is rolled back and its items commit one by one
/// like any other, so a failure still rejects only its own item.
pub(crate) async fn commit_batch(
    db: &mut Db<'_>,
    commits: &[StepCommit],
    now: Timestamp,
) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
    let mut pre = CommitPrefetch::read(db, commits).await?;
    let mut out = Vec::with_capacity(commits.len());
    let mut gathered = Gathered::default();
    for (i, c) in commits.iter().enumerate() {
        match plan_own_rows(c, now, &mut pre, &mut gathered.writes) {
            Some(Ok(receipt)) => {
                gathered.items.push(i);
                out.push(Ok(receipt));
            }
            Some(Err(refused)) => out.push(Err(refused)),
            None => {
                gathered.flush(db, commits, now, &mut out).await?;
                out.push(commit_or_abort(db, c, now, &mut pre).await?);
            }
        }
    }
    gathered.flush(db, commits, now, &mut out).await?;
    Ok(out)
}

/// Commits one item in its own savepoint: its receipt or its rejection, or an
/// `Unavailable` error that aborts the whole batch.
async fn commit_or_abort(
    db: &mut Db<'_>,
    c: &StepCommit,
    now: Timestamp,
    pre: &mut CommitPrefetch,
) -> StoreResult<StoreResult<CommitReceipt>> {
    match commit_item(db, c, now, pre).await {
        Err(e) if e.kind == ErrorKind::Unavailable => Err(e),
        item => Ok(item),
    }
}

/// Commit items planned but not yet written, and their gathered writes.
#[derive(Default)]
struct Gathered {
    writes: Writes,
    /// The items' indexes in the batch.
    items: Vec<usize>,
}

impl Gathered {
    /// Runs the gathered writes in a savepoint. If they fail for any reason but an
    /// unavailable database, rolls them back and commits their items one by one, each
    /// reading for itself, and puts those receipts in `out`.
    async fn flush(
        &mut self,
        db: &mut Db<'_>,
        commits: &[StepCommit],
        now: Timestamp,
        out: &mut [StoreResult<CommitReceipt>],
    ) -> StoreResult<()> {
        let items = std::mem::take(&mut self.items);
        let writes = std::mem::take(&mut self.writes).in_savepoint("keel_gathered");
        match db.write(writes).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind == ErrorKind::Unavailable => Err(e),
            Err(_) => {
                db.write(Writes::statement("ROLLBACK TO keel_gathered; RELEASE keel_gathered"))
                    .await?;
                for i in items {
                    let alone = &mut CommitPrefetch::none();
                    out[i] = commit_or_abort(db, &commits[i], now, alone).await?;
                }
                Ok(())
            }
        }
    }
}

/// Plans `c` from its prefetched read alone, when its plan writes only its own rows, and
/// gathers its writes into `w`; returns its receipt, or its refusal (which writes
/// nothing). `None` when the item needs the database: no read was prefetched for it, it
/// emits signals, it re-enters a concurrency key, it has a unique key, or its plan
/// reaches further than its own rows.
fn plan_own_rows(
    c: &StepCommit,
    now: Timestamp,
    pre: &mut CommitPrefetch,
    w: &mut Writes,
) -> Option<StoreResult<CommitReceipt>> {
    if !pre.valid || !c.emit.is_empty() {
        return None;
    }
    let (row, facts) = pre.reads.get(&c.id)?;
    let before = row.as_ref()?;
    let inbox = facts.read(c);
    if before.unique.is_some() || commit::reentering_key(before, c, inbox.signal_waiting).is_some()
    {
        return None;
    }
    let read = CommitRead {
        row: Some(before.clone()),
        emit_targets: Vec::new(),
        inbox,
        key_occupant: None,
    };
    let admitted = match CommitPlanner::new(now).admit(c, read) {
        Ok(admitted) => admitted,
        Err(refused) => {
            pre.reads.remove(&c.id);
            return Some(Err(refused));
        }
    };
    if !admitted.children.is_empty() {
        return None;
    }
    let plan = admitted.finish(c, &[]);
    let cancels_timers = matches!(&plan.timers, TimerPlan::Change { cancel, .. } if !cancel.is_empty())
        && pre.may_have_timers(c.id);
    if reaches_beyond_its_rows(&plan)
        || plan.dead_letter.is_some()
        || plan.row.unique.is_some()
        || cancels_timers
    {
        return None;
    }
    let (before, facts) = pre.reads.remove(&c.id)?;
    let before = before?;
    own_writes(w, &plan, Some(&before), !facts.any, now, pre, Guard::Untouched);
    Some(Ok(plan.receipt))
}

/// Whether a commit plan writes beyond the item's own rows: signals it emits, its parent
/// (barrier and notice), the children it cancels. (Children it starts show in what the
/// caller inserted.)
fn reaches_beyond_its_rows(plan: &commit::CommitPlan) -> bool {
    !plan.emits.is_empty()
        || plan.barrier_release.is_some()
        || plan.parent_notice.is_some()
        || !plan.children_cancel.is_none()
}

/// Gathers the writes of a commit plan that touch only the item's own rows: the signals it
/// consumed, its drained inbox, its history, its timers armed (or all dropped) and its
/// row's changed columns. `before` is the row as read (without one, the caller writes the
/// whole row); `guard` as [`Writes::instance_update`] takes it.
fn own_writes(
    w: &mut Writes,
    plan: &commit::CommitPlan,
    before: Option<&Instance>,
    inbox_empty: bool,
    now: Timestamp,
    pre: &mut CommitPrefetch,
    guard: Guard,
) {
    let row = &plan.row;
    for id in &plan.consume {
        w.signal_remove(row.id, *id);
    }
    // Nothing in this item adds to its own inbox before here, so an inbox read empty
    // has nothing to drain.
    if plan.drain_inbox && !inbox_empty {
        w.signals_drop(row.id);
    }
    for entry in &plan.history {
        w.record(row, plan.attempt, entry, now);
    }
    match &plan.timers {
        TimerPlan::Change { arm, .. } => {
            if !arm.is_empty() {
                pre.timed.insert(row.id);
            }
            for t in arm {
                w.timer_arm(t);
            }
        }
        TimerPlan::DropAll if pre.may_have_timers(row.id) => w.timers_drop(row.id),
        TimerPlan::DropAll => {}
    }
    if let Some(before) = before {
        w.instance_update(before, row, guard);
    }
}

/// Commits one step result inside its own savepoint: a rejection rolls back exactly this
/// item, and the caller carries on with the next. An `Unavailable` error means the
/// database itself failed (busy, IO); the caller aborts the whole batch on it, since the
/// transaction may no longer be usable.
pub(crate) async fn commit_item(
    db: &mut Db<'_>,
    c: &StepCommit,
    now: Timestamp,
    pre: &mut CommitPrefetch,
) -> StoreResult<CommitReceipt> {
    let file = db.file;
    let mut sp =
        db.conn.begin().await.map_err(|e| crate::error::map(file, "opening a savepoint", &e))?;
    let result = {
        let mut inner = Db { conn: &mut sp, file };
        commit_one(&mut inner, c, now, pre).await
    };
    match result {
        Ok(receipt) => {
            sp.commit().await.map_err(|e| crate::error::map(file, "releasing a savepoint", &e))?;
            Ok(receipt)
        }
        Err(e) => {
            sp.rollback()
                .await
                .map_err(|e| crate::error::map(file, "rolling back a savepoint", &e))?;
            Err(e)
        }
    }
}

/// Reads what the commit planner needs for one item, lets it decide, inserts the children
/// it admits and performs the writes of its plan, in the plan's order. A refusal writes
/// nothing; the savepoint undoes the writes if the database fails half way.
async fn commit_one(
    db: &mut Db<'_>,
    c: &StepCommit,
    now: Timestamp,
    pre: &mut CommitPrefetch,
) -> StoreResult<CommitReceipt> {
    let (row, facts) = if let Some(read) = pre.take(c.id) {
        read
    } else {
        let row = db.instance(c.id).await?;
        (row, db.inbox_facts(&[InboxAsk::of(c)]).await?.remove(&c.id).unwrap_or_default())
    };
    let before = row.clone();
    let inbox_empty = !facts.any;
    let inbox = facts.read(c);
    let mut emit_targets = Vec::with_capacity(c.emit.len());
    for signal in &c.emit {
        emit_targets.push(db.resolve(&signal.target).await?);
    }
    let key_occupant =
        match row.as_ref().and_then(|r| commit::reentering_key(r, c, inbox.signal_waiting)) {
            Some(key) => db.occupant(key, c.id).await?,
            None => None,
        };
    // Each item is read after the ones before it were written, so a planner per item sees
    // the batch's earlier effects through the database.
    let admitted =
        CommitPlanner::new(now).admit(c, CommitRead { row, emit_targets, inbox, key_occupant })?;
    let mut inserted = Vec::with_capacity(admitted.children.len());
    for child in &admitted.children {
        inserted.push(child_insert(db, child, now).await?);
    }
    let plan = admitted.finish(c, &inserted);
    if !inserted.is_empty() || reaches_beyond_its_rows(&plan) {
        // This item reaches beyond its own row: later items read for themselves.
        pre.valid = false;
    }
    let row = &plan.row;
    let mut receipt = plan.receipt.clone();
    if let Some(letter) = &plan.dead_letter {
        receipt.dead_letter = Some(db.dead_letter_insert(letter, now).await?);
    }
    if let TimerPlan::Change { cancel, .. } = &plan.timers
        && !cancel.is_empty()
        && pre.may_have_timers(row.id)
    {
        let timers = db.timers(row.id, ALL_TIMERS).await?;
        let cancelled: Vec<keel_core::TimerId> =
            timers.iter().filter(|t| plan.timers.cancels(&t.spec.state)).map(|t| t.id).collect();
        db.timers_remove(&cancelled).await?;
    }
    let guard = match &before {
        Some(before) if before.unique.is_some() || row.unique.is_some() => {
            Guard::Set(db.guard_for(row).await?)
        }
        _ => Guard::Untouched,
    };
    let mut w = Writes::default();
    own_writes(&mut w, &plan, before.as_ref(), inbox_empty, now, pre, guard);
    db.write(w).await?;
    if before.is_none() {
        db.instance_write(row).await?;
    }
    for (signal, target) in &plan.emits {
        deliver_to(db, *target, signal, now).await?;
    }
    if let Some(release) = &plan.barrier_release {
        let then = parent_release(db, release, now).await?;
        run_then(db, FollowUps::new(then), now).await?;
    }
    if !plan.children_cancel.is_none() {
        for child in db.delegated_children(row.id, &plan.children_cancel).await? {
            let Some(child) = db.instance(child).await? else { continue };
            if plan.children_cancel.covers(&child, row.id) {
                let p = plan.children_cancel.cancel_params(&child, now);
                cancel_with(db, &p, plan::cancel::left_delegation).await?;
            }
        }
    }
    Ok(receipt)
}

/// Inserts a child a commit starts, unless another instance occupies its unique key.
async fn child_insert(
    db: &mut Db<'_>,
    child: &ChildInsert,
    now: Timestamp,
) -> StoreResult<InsertOutcome> {
    let guard = unique_guard(child.spec.unique.as_ref(), Status::Runnable);
    let existing = match guard {
        Some(g) => db.occupant(g, InstanceId(0)).await?,
        None => None,
    };
    if let Some(id) = existing {
        return Ok(InsertOutcome::Existing(id));
    }
    let row = Instance::from_new(InstanceId(0), &child.spec, Some(child.parent), now);
    Ok(InsertOutcome::Inserted(db.instance_insert(&row).await?))
}

/// Executes a planned parent release: the parent's barrier counts the ended child against
/// its row as it stands now (`plan::parent::release`, which may wake it), then the
/// parent's notice is delivered. A parent that no longer exists is left alone. Returns
/// the cancels of the children the parent stopped waiting for, and then the notice, which
/// the caller runs in the same transaction: [`parents_release`] of this one release.
async fn parent_release(
    db: &mut Db<'_>,
    release: &ParentRelease,
    now: Timestamp,
) -> StoreResult<Vec<FollowUp>> {
    parents_release(db, std::slice::from_ref(release), now).await
}

/// Executes planned parent releases in order, each as [`parent_release`] describes, in a
/// bounded number of statements: every parent is read at once, each release
/// is planned against its parent's row as the releases before it left it, and the changed
/// parents are written together with their history. Returns what the releases left to do,
/// in release order.
async fn parents_release(
    db: &mut Db<'_>,
    releases: &[ParentRelease],
    now: Timestamp,
) -> StoreResult<Vec<FollowUp>> {
    let mut ids: Vec<InstanceId> = releases.iter().map(|r| r.parent).collect();
    ids.sort_unstable();
    ids.dedup();
    let read: HashMap<InstanceId, Instance> = if ids.is_empty() {
        HashMap::new()
    } else {
        db.instances(&ids).await?.into_iter().map(|r| (r.id, r)).collect()
    };
    let mut rows = read.clone();
    let mut changed: Vec<InstanceId> = Vec::new();
    let mut seen: HashSet<InstanceId> = HashSet::new();
    let mut then = Vec::new();
    let mut w = Writes::default();
    for release in releases {
        let mut cancels = Vec::new();
        if let Some(row) = rows.get(&release.parent) {
            let planned = plan::parent::release(row, release, now);
            if planned.changed {
                for entry in &planned.history {
                    w.record(&planned.row, planned.row.attempt, entry, now);
                }
                if seen.insert(release.parent) {
                    changed.push(release.parent);
                }
                cancels = planned.cancel;
                rows.insert(release.parent, planned.row);
            }
        }
        then.extend(release.follow_ups(cancels));
    }
    for id in changed {
        w = update_gathered(db, w, &read[&id], &rows[&id]).await?;
    }
    db.write(w).await?;
    Ok(then)
}

/// Runs what releases left to do ([`FollowUps`]: in order, depth first, cancels under the
/// cascade's bound, notices always delivered).
async fn run_then(db: &mut Db<'_>, mut run: FollowUps, now: Timestamp) -> StoreResult<()> {
    while let Some(step) = run.next_step() {
        match step {
            NextFollowUp::Notices(batch) => {
                let (signals, targets): (Vec<_>, Vec<_>) =
                    batch.into_iter().map(|(parent, signal)| (signal, Some(parent))).unzip();
                deliver(db, &signals, targets, now).await?;
            }
            NextFollowUp::Cancel(cancel) => {
                let (_, further) = cancel_one(db, &cancel, plan::cancel::cancel).await?;
                run.then(further);
            }
        }
    }
    Ok(())
}

/// Writes a parent plan's row and history; returns its cancels for the caller to run.
async fn parent_write(
    db: &mut Db<'_>,
    planned: ParentPlan,
    now: Timestamp,
) -> StoreResult<Vec<CancelParams>> {
    if !planned.changed {
        return Ok(Vec::new());
    }
    for entry in &planned.history {
        db.record(&planned.row, planned.row.attempt, entry, now).await?;
    }
    db.instance_write(&planned.row).await?;
    Ok(planned.cancel)
}

// ----- signals ---------------------------------------------------------------------------

async fn deliver_to(
    db: &mut Db<'_>,
    target: InstanceId,
    s: &NewSignal,
    now: Timestamp,
) -> StoreResult<DeliveryOutcome> {
    let mut out = deliver(db, std::slice::from_ref(s), vec![Some(target)], now).await?;
    Ok(out.remove(0))
}

/// Reads what `plan::deliver` needs for `signals` (with their resolved `targets`), plans
/// and writes the plan.
async fn deliver(
    db: &mut Db<'_>,
    signals: &[NewSignal],
    targets: Vec<Option<InstanceId>>,
    now: Timestamp,
) -> StoreResult<Vec<DeliveryOutcome>> {
    Ok(deliver_rows(db, signals, targets, now, HashMap::new()).await?.0)
}

/// Delivers `signals` (each to its target, `None` for a target that was not found), and
/// returns the outcomes with the targets' rows as the delivery left them. `known` holds
/// rows this transaction has already read and not changed since.
async fn deliver_rows(
    db: &mut Db<'_>,
    signals: &[NewSignal],
    targets: Vec<Option<InstanceId>>,
    now: Timestamp,
    known: HashMap<InstanceId, Instance>,
) -> StoreResult<(Vec<DeliveryOutcome>, HashMap<InstanceId, Instance>)> {
    let mut read = DeliverRead { rows: known, ..DeliverRead::default() };
    // Every other target's row in one statement; a target that does not exist is
    // `NotFound`.
    let mut wanted: Vec<InstanceId> =
        targets.iter().flatten().copied().filter(|id| !read.rows.contains_key(id)).collect();
    wanted.sort_unstable();
    wanted.dedup();
    if !wanted.is_empty() {
        read.rows.extend(db.instances(&wanted).await?.into_iter().map(|r| (r.id, r)));
    }
    let mut keyed: Vec<(InstanceId, &str)> = Vec::new();
    for (s, target) in signals.iter().zip(&targets) {
        let Some(target) = *target else { continue };
        if !read.rows.contains_key(&target) {
            // Missing: the one read that says so, in its words.
            db.instance_required(target).await?;
        }
        if let Some(key) = &s.dedup_key {
            keyed.push((target, key));
        }
    }
    // Every dedup key of the batch in one statement.
    read.dedup = db.dedups(&keyed).await?;
    read.targets = targets;
    let before = read.rows.clone();
    let plan = plan::deliver::deliver(read, signals, now);
    let inserts: Vec<SignalInsert<'_>> = plan
        .inserts
        .iter()
        .map(|i| SignalInsert {
            target: i.target,
            name: &i.name,
            payload: &i.payload,
            dedup_key: i.dedup_key.as_deref(),
            priority: i.priority,
            at: i.inserted_at,
        })
        .collect();
    let ids = db.signals_insert(&inserts).await?;
    // Rows with a unique key are written alone, their guard decided against the rows as
    // they stand; the others are gathered.
    let mut rows = before;
    let mut w = Writes::default();
    for row in plan.woken.iter().chain(&plan.raised) {
        match rows.get(&row.id) {
            Some(before) if before.unique.is_none() && row.unique.is_none() => {
                w.instance_update(before, row, Guard::Untouched);
            }
            Some(before) => {
                db.write(std::mem::take(&mut w)).await?;
                db.instance_update(before, row).await?;
            }
            None => {
                db.write(std::mem::take(&mut w)).await?;
                db.instance_write(row).await?;
            }
        }
        rows.insert(row.id, row.clone());
    }
    db.write(w).await?;
    Ok((plan.outcomes(&ids), rows))
}

/// Validates the whole batch first, so an invalid item writes nothing.
pub(crate) async fn signal_deliver(
    db: &mut Db<'_>,
    p: &SignalDeliverParams,
) -> StoreResult<Vec<DeliveryOutcome>> {
    p.validate()?;
    let mut targets = Vec::with_capacity(p.signals.len());
    for s in &p.signals {
        targets.push(db.resolve(&s.target).await?);
    }
    deliver(db, &p.signals, targets, p.now).await
}

/// The candidates of a broadcast, in id order: the machine's live instances in its
/// namespace, and with a state, those whose position holds it. The state filter runs in
/// the statement, so a broadcast to the instances in one state reads those and not every
/// live instance of the machine; it lets through every instance `position_in_state`
/// accepts (a position that is the state, or a JSON array of paths that holds it) and the
/// plan decides among them. Bound to `BROADCAST_MAX + 1` rows: that many is already too
/// many, so a broadcast that would be refused reads no more than that, and decodes none.
const BROADCAST_CANDIDATES: &str = "SELECT id, position, status FROM keel_instances \
     WHERE namespace = ? AND machine = ? \
       AND status NOT IN ('done', 'failed', 'cancelled') \
       AND (? IS NULL OR position = ? \
         OR CASE WHEN substr(position, 1, 1) = '[' AND json_valid(position) \
           THEN EXISTS (SELECT 1 FROM json_each(position) WHERE value = ?) ELSE 0 END) \
     ORDER BY id LIMIT +?";

/// One event to every target `plan::deliver::broadcast_targets` picks among the machine's
/// live instances; nothing when too many match. The candidates are read up to one past
/// `BROADCAST_MAX`, and more than `BROADCAST_MAX` of them is refused as the planner
/// refuses it (`broadcast targets`) before any is decoded: the writer is held for a
/// bounded read, however many instances the machine has.
pub(crate) async fn signal_broadcast(
    db: &mut Db<'_>,
    p: &SignalBroadcastParams,
) -> StoreResult<BroadcastReport> {
    p.validate()?;
    let cap = limits::BROADCAST_MAX + 1;
    let rows = sqlx::query(BROADCAST_CANDIDATES)
        .bind(&p.namespace)
        .bind(&p.machine)
        .bind(&p.in_state)
        .bind(&p.in_state)
        .bind(&p.in_state)
        .bind(cap as i64)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("selecting broadcast targets"))?;
    check_batch("broadcast targets", rows.len(), limits::BROADCAST_MAX)?;
    let mut candidates = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(|e| corrupt(db.file, "id", e))?;
        let position: String =
            r.try_get("position").map_err(|e| corrupt(db.file, "position", e))?;
        let status: String = r.try_get("status").map_err(|e| corrupt(db.file, "status", e))?;
        let status = status.parse::<Status>().map_err(|e| corrupt(db.file, "status", e))?;
        candidates.push((InstanceId(id), position, status));
    }
    let targets = plan::deliver::broadcast_targets(
        p,
        candidates.iter().map(|(id, position, status)| (*id, position.as_str(), *status)),
    )?;
    let signals: Vec<NewSignal> = targets.iter().map(|t| p.signal(*t)).collect();
    let outcomes = deliver(db, &signals, targets.into_iter().map(Some).collect(), p.now).await?;
    Ok(plan::deliver::broadcast_report(&outcomes))
}

// ----- timers ----------------------------------------------------------------------------

/// The earliest due time among the timers a sweep with these filters would fire (the
/// `keel_timers_due` index, read in due order until the first match).
pub(crate) async fn timer_next_due(
    db: &mut Db<'_>,
    p: &TimerNextDueParams,
) -> StoreResult<Option<Timestamp>> {
    let machines = serde_json::to_string(&p.machines).unwrap_or_default();
    let row = sqlx::query(
        "SELECT next_fire_at FROM keel_timers WHERE (? IS NULL OR namespace = ?) \
           AND (? = '[]' OR machine IN (SELECT value FROM json_each(?))) \
         ORDER BY next_fire_at LIMIT 1",
    )
    .bind(&p.namespace)
    .bind(&p.namespace)
    .bind(&machines)
    .bind(&machines)
    .fetch_optional(&mut *db.conn)
    .await
    .map_err(db.err("reading the earliest timer due time"))?;
    row.map(|r| {
        r.try_get::<i64, _>(0).map(Timestamp).map_err(|e| corrupt(db.file, "next_fire_at", e))
    })
    .transpose()
}

/// The timers a retime reads: those of the machine version (`t`) that a target (the JSON
/// array bound here, [`retime_targets`]) of the same state, event and kind gives another
/// interval. Which deployed entry is a timer's target is the core's
/// (`timers::retime_targets`), so this reads exactly the timers `timers::retime` moves and
/// leaves out the ones already moved; the plan still decides each move.
macro_rules! retime_may_move {
    () => {
        "EXISTS (SELECT 1 FROM json_each(?) d \
           WHERE d.value ->> '$.state' = t.spec ->> '$.state' \
             AND d.value ->> '$.event' = t.spec ->> '$.event' \
             AND d.value ->> '$.kind' = t.spec ->> '$.kind' \
             AND (d.value ->> '$.interval.secs' IS NOT t.spec ->> '$.interval.secs' \
               OR d.value ->> '$.interval.nanos' IS NOT t.spec ->> '$.interval.nanos'))"
    };
}

/// The deployed timers a retime's read binds (`timers::retime_targets` of
/// `TimerRetimeParams::timers`), as the JSON array `retime_may_move!` reads. Built once
/// per page and passed to both [`timers_retime_any`] and [`timers_retime`].
pub(crate) fn retime_targets(p: &TimerRetimeParams) -> StoreResult<String> {
    serde_json::to_string(&keel_core::timers::retime_targets(&p.timers))
        .map_err(|e| StoreError::invalid(format!("timers: {e}")))
}

/// Whether any timer of the machine version after the cursor may move under `targets`
/// ([`retime_targets`] of `p`, which the caller validated), asked on a read connection so
/// that a pass over timers moved already never takes the writer: when none may, the page
/// is empty and the last ([`timers_retime`] would read nothing). The question returns no
/// timer, but to answer it the database still scans every timer after the cursor, of
/// every machine (no index leads with the machine and its version).
pub(crate) async fn timers_retime_any(
    db: &mut Db<'_>,
    p: &TimerRetimeParams,
    targets: &str,
) -> StoreResult<bool> {
    sqlx::query_scalar(concat!(
        "SELECT EXISTS (SELECT 1 FROM keel_timers t WHERE machine = ? AND machine_version = ? \
           AND id > ? AND ",
        retime_may_move!(),
        ")"
    ))
    .bind(&p.machine.name)
    .bind(p.machine.version)
    .bind(p.after.map_or(0, |t| t.0))
    .bind(targets)
    .fetch_one(&mut *db.conn)
    .await
    .map_err(db.err("looking for timers to retime"))
}

/// One page of a retime: the machine version's timers after the cursor in id order that
/// may move, the core's plan, and per moved timer its write and history entry. Returns the
/// page and the earliest new due time.
///
/// `p` was validated by the caller, and `targets` is its [`retime_targets`]. The statement
/// returns only the timers `retime_may_move!` lets through — those the core's retime
/// targets give another duration —, so a pass over a version whose timers
/// were moved already returns and writes none (the database still scans every timer
/// after the cursor, of every machine, to find that out); the core's plan still decides
/// each move.
pub(crate) async fn timers_retime(
    db: &mut Db<'_>,
    p: &TimerRetimeParams,
    targets: &str,
) -> StoreResult<(TimerRetimePage, Option<Timestamp>)> {
    let rows = sqlx::query(concat!(
        "SELECT ",
        timer_cols!(),
        " FROM keel_timers t WHERE machine = ? AND machine_version = ? AND id > ? AND ",
        retime_may_move!(),
        " ORDER BY id LIMIT +?"
    ))
    .bind(&p.machine.name)
    .bind(p.machine.version)
    .bind(p.after.map_or(0, |t| t.0))
    .bind(targets)
    .bind(p.limit as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("reading timers to retime"))?;
    let read: Vec<TimerRow> = rows.iter().map(|r| db.timer_of(r)).collect::<StoreResult<_>>()?;
    let plan = plan::timer::retime(p, &read);
    let mut page = TimerRetimePage { retimed: Vec::new(), next: plan.next };
    let mut earliest: Option<Timestamp> = None;
    for r in &plan.retimed {
        let before = read.iter().find(|t| t.id == r.next.id).ok_or_else(|| {
            not_read(&format!(
                "retiming timer {} of machine {} version {}",
                r.next.id.0, p.machine.name, p.machine.version
            ))
        })?;
        if !db.timer_retime(before, &r.next).await? {
            continue;
        }
        let row = db.instance_required(r.next.instance).await?;
        db.record(&row, row.attempt, &r.history, p.now).await?;
        page.retimed.push(r.next.id);
        earliest = Some(earliest.map_or(r.next.next_fire_at, |e| e.min(r.next.next_fire_at)));
    }
    Ok((page, earliest))
}

/// The timers a sweep fires: due ones that pass its filters, in due order.
const SWEEP_PICK_SQL: &str = concat!(
    "SELECT ",
    timer_cols!(),
    " FROM keel_timers WHERE next_fire_at <= ? AND (? IS NULL OR namespace = ?) \
       AND (? = '[]' OR machine IN (SELECT value FROM json_each(?))) \
     ORDER BY next_fire_at, id LIMIT +?"
);

/// The paused queues, `(namespace, queue)`: a handful of rows, read once per sweep.
async fn paused_queues(db: &mut Db<'_>) -> StoreResult<Vec<(String, String)>> {
    sqlx::query_as("SELECT namespace, queue FROM keel_queues WHERE paused")
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("reading the paused queues"))
}

/// Fires due timers in (due time, id) order as the core's sweep plan says
/// (`plan::timer::sweep`); timers of missing or terminal instances are deleted silently,
/// and the repeating ticks of suspended instances and of instances in paused queues held.
/// Records the sweep time per (namespace or `*`, machine or `*`).
/// A timer sweep; with its report, whether it made an instance runnable (a delivered
/// fire, or an expired join deadline that wakes its parent and delivers nothing).
pub(crate) async fn timer_sweep(
    db: &mut Db<'_>,
    p: &TimerSweepParams,
) -> StoreResult<(TimerSweepReport, bool)> {
    p.validate()?;
    let machines = serde_json::to_string(&p.machines).unwrap_or_default();
    let rows = sqlx::query(SWEEP_PICK_SQL)
        .bind(p.now.0)
        .bind(&p.namespace)
        .bind(&p.namespace)
        .bind(&machines)
        .bind(&machines)
        .bind(p.limit as i64)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("picking due timers"))?;
    let due: Vec<TimerRow> = rows.iter().map(|r| db.timer_of(r)).collect::<StoreResult<_>>()?;
    let mut owners: Vec<InstanceId> = due.iter().map(|t| t.instance).collect();
    owners.sort_unstable();
    owners.dedup();
    let owned: HashMap<InstanceId, Instance> = if owners.is_empty() {
        HashMap::new()
    } else {
        db.instances(&owners).await?.into_iter().map(|r| (r.id, r)).collect()
    };
    let paused = if owners.is_empty() { Vec::new() } else { paused_queues(db).await? };
    let owner = |id: InstanceId| plan::timer::Owner::of(owned.get(&id), &paused);
    let plan = plan::timer::sweep(p, &due, owner);
    let (delivered, rows) = deliver_rows(db, &plan.signals, plan.targets(), p.now, owned).await?;
    let mut w = Writes::default();
    for (instance, entry) in &plan.history {
        if let Some(row) = rows.get(instance) {
            w.record(row, row.attempt, entry, p.now);
        } else {
            let row = db.instance_required(*instance).await?;
            w.record(&row, row.attempt, entry, p.now);
        }
    }
    for next in &plan.advance {
        w.timer_advance(next);
    }
    db.write(w).await?;
    db.timers_remove(&plan.delete).await?;
    let mut woke = false;
    for id in &plan.join_deadlines {
        let Some(row) = db.instance(*id).await? else { continue };
        // The rest of its children, and what their cancels ask for in turn, under one
        // bound as a join's wake in a commit.
        let planned = plan::parent::expire(&row, p.now);
        woke |= planned.changed;
        let cancels = parent_write(db, planned, p.now).await?;
        run_then(db, FollowUps::cancels(cancels), p.now).await?;
    }
    for (ns, machine) in plan::timer::swept_scopes(p) {
        sqlx::query(
            "INSERT INTO keel_timer_sweeps (namespace, machine, swept_at) VALUES (?, ?, ?) \
             ON CONFLICT (namespace, machine) DO UPDATE SET swept_at = excluded.swept_at",
        )
        .bind(&ns)
        .bind(&machine)
        .bind(p.now.0)
        .execute(&mut *db.conn)
        .await
        .map_err(db.err("recording a timer sweep"))?;
    }
    let report = plan.report(&delivered);
    let woke = woke || report.fired + report.exhausted > 0;
    Ok((report, woke))
}

// ----- leases ----------------------------------------------------------------------------

pub(crate) async fn lease_reap(
    db: &mut Db<'_>,
    p: &LeaseReapParams,
) -> StoreResult<Vec<InstanceId>> {
    p.validate()?;
    let owner = p.owner.as_ref().map(|w| w.0.clone());
    let rows = sqlx::query(concat!(
        "SELECT ",
        instance_cols!(),
        " FROM keel_instances \
         WHERE status = 'executing' \
           AND (CASE WHEN ? IS NULL THEN lease_expires_at < ? ELSE lease_owner = ? END) \
         ORDER BY lease_expires_at, id LIMIT +?"
    ))
    .bind(&owner)
    .bind(p.now.0)
    .bind(&owner)
    .bind(p.limit as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("picking expired leases"))?;
    let due: Vec<Instance> = rows.iter().map(|r| db.instance_of(r)).collect::<StoreResult<_>>()?;
    let mut reaped = Vec::with_capacity(due.len());
    for w in plan::lease::reap(p, due) {
        reaped.push(write_planned(db, &w, p.now).await?);
    }
    Ok(reaped)
}

/// Records a planned row change and writes the row; returns its id.
/// One page of a chart version migration: read the page's rows and their timers, let
/// `plan::migrate` decide, write the moves (row, history, the timers replaced).
pub(crate) async fn migrate(db: &mut Db<'_>, p: &MigrateParams) -> StoreResult<MigratePage> {
    p.validate()?;
    let rows = sqlx::query(concat!(
        "SELECT ",
        instance_cols!(),
        " FROM keel_instances \
         WHERE machine = ? AND machine_version = ? \
           AND status NOT IN ('done', 'failed', 'cancelled') \
           AND (? IS NULL OR namespace = ?) AND id > ? \
         ORDER BY id LIMIT +?"
    ))
    .bind(p.migration.machine())
    .bind(i64::from(p.migration.from_version()))
    .bind(&p.namespace)
    .bind(&p.namespace)
    .bind(p.after.map_or(i64::MIN, |a| a.0))
    .bind(p.limit as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("reading instances to migrate"))?;
    let mut read = Vec::with_capacity(rows.len());
    for r in &rows {
        let row = db.instance_of(r)?;
        let timers = db.timers(row.id, ALL_TIMERS).await?;
        read.push((row, timers));
    }
    let last = read.last().map(|(r, _)| r.id);
    let plan = plan::migrate::page(p, read);
    for (w, timers) in plan.rows.iter().zip(&plan.timers) {
        write_planned(db, w, p.now).await?;
        let mut writes = Writes::default();
        writes.timers_drop(w.row.id);
        for t in timers {
            writes.timer_arm(t);
        }
        db.write(writes).await?;
    }
    Ok(MigratePage { items: plan.items, last })
}

/// A prune page: the rows after a cursor, with what still refers to each (a live parent,
/// children, dead letters), every question answered along an index.
const PRUNE_PAGE_SQL: &str = "SELECT i.id, i.namespace, i.machine, i.status, i.updated_at, \
       EXISTS (SELECT 1 FROM keel_instances q WHERE q.id = i.parent_id \
               AND q.status NOT IN ('done', 'failed', 'cancelled')) AS parent_live, \
       EXISTS (SELECT 1 FROM keel_instances c WHERE c.parent_id = i.id) AS has_children, \
       EXISTS (SELECT 1 FROM keel_dead_letters d WHERE d.instance_id = i.id) AS has_dead \
     FROM keel_instances i WHERE i.id > ? ORDER BY i.id LIMIT +?";

/// One page of pruning: read the page's rows with what still refers to them, let
/// `plan::prune` decide, delete each chosen instance with its history, inbox and timers.
pub(crate) async fn prune(db: &mut Db<'_>, p: &PruneParams) -> StoreResult<PrunePage> {
    p.validate()?;
    let rows = sqlx::query(PRUNE_PAGE_SQL)
        .bind(p.after.map_or(i64::MIN, |a| a.0))
        .bind(p.limit as i64)
        .fetch_all(&mut *db.conn)
        .await
        .map_err(db.err("reading instances to prune"))?;
    let mut read = Vec::with_capacity(rows.len());
    for r in &rows {
        let status: String = r.try_get("status").map_err(db.err("reading a status"))?;
        read.push(PruneCandidate {
            id: InstanceId(r.try_get("id").map_err(db.err("reading an id"))?),
            namespace: r.try_get("namespace").map_err(db.err("reading a namespace"))?,
            machine: r.try_get("machine").map_err(db.err("reading a machine"))?,
            status: status.parse::<Status>().map_err(|e| corrupt(db.file, "status", e))?,
            updated_at: Timestamp(r.try_get("updated_at").map_err(db.err("reading a time"))?),
            parent_live: r.try_get("parent_live").map_err(db.err("reading a parent"))?,
            has_children: r.try_get("has_children").map_err(db.err("reading children"))?,
            has_dead_letters: r.try_get("has_dead").map_err(db.err("reading dead letters"))?,
        });
    }
    let mut page = PrunePage { last: read.last().map(|c| c.id), ..PrunePage::default() };
    for id in plan::prune::page(p, &read) {
        let history = sqlx::query("DELETE FROM keel_history WHERE instance_id = ?")
            .bind(id.0)
            .execute(&mut *db.conn)
            .await
            .map_err(db.err("pruning history"))?;
        let signals = sqlx::query("DELETE FROM keel_signals WHERE target_id = ?")
            .bind(id.0)
            .execute(&mut *db.conn)
            .await
            .map_err(db.err("pruning signals"))?;
        db.timers_drop(id).await?;
        sqlx::query("DELETE FROM keel_instances WHERE id = ?")
            .bind(id.0)
            .execute(&mut *db.conn)
            .await
            .map_err(db.err("pruning an instance"))?;
        page.instances += 1;
        page.history += history.rows_affected();
        page.signals += signals.rows_affected();
    }
    Ok(page)
}

async fn write_planned(db: &mut Db<'_>, w: &RowWrite, now: Timestamp) -> StoreResult<InstanceId> {
    for entry in &w.history {
        db.record(&w.row, w.attempt, entry, now).await?;
    }
    db.instance_write(&w.row).await?;
    Ok(w.row.id)
}

/// A heartbeat touches the lease only (the core has no transition for it).
pub(crate) async fn lease_extend(db: &mut Db<'_>, p: &LeaseExtendParams) -> StoreResult<Vec<bool>> {
    p.validate()?;
    let mut out = Vec::with_capacity(p.leases.len());
    for (id, token) in &p.leases {
        let done = sqlx::query(
            "UPDATE keel_instances SET lease_expires_at = ?, updated_at = ? \
             WHERE id = ? AND status = 'executing' AND fencing_token = ? AND lease_owner = ?",
        )
        .bind(p.now.plus(p.lease).0)
        .bind(p.now.0)
        .bind(id.0)
        .bind(token.0)
        .bind(&p.worker.0)
        .execute(&mut *db.conn)
        .await
        .map_err(db.err("extending a lease"))?;
        out.push(done.rows_affected() == 1);
    }
    Ok(out)
}

pub(crate) async fn lease_release(
    db: &mut Db<'_>,
    p: &LeaseReleaseParams,
) -> StoreResult<Vec<bool>> {
    p.validate()?;
    let ids: std::collections::BTreeSet<InstanceId> = p.leases.iter().map(|l| l.0).collect();
    let mut rows = Vec::with_capacity(ids.len());
    for id in ids {
        rows.extend(db.instance(id).await?);
    }
    let before: HashMap<InstanceId, Instance> = rows.iter().map(|r| (r.id, r.clone())).collect();
    let plan = plan::lease::release(p, rows);
    for row in &plan.rows {
        match before.get(&row.id) {
            Some(before) => db.instance_update(before, row).await?,
            None => db.instance_write(row).await?,
        }
    }
    Ok(plan.held)
}

// ----- cancel ----------------------------------------------------------------------------

/// Breadth first over descendants, bounded in depth and count like `MemoryStore`.
pub(crate) async fn cancel(db: &mut Db<'_>, p: &CancelParams) -> StoreResult<Vec<InstanceId>> {
    cancel_with(db, p, plan::cancel::cancel).await
}

/// Reads what a cancel needs, plans it with `planner` and writes the plan; then the
/// cancels its releases asked for (a parent that woke from a join and cancels the rest of
/// its children), each an ordinary cascading cancel, at most
/// [`limits::CANCEL_CASCADE_MAX`] of them.
async fn cancel_with(
    db: &mut Db<'_>,
    p: &CancelParams,
    planner: fn(&CancelParams, CancelRead) -> StoreResult<plan::cancel::CancelPlan>,
) -> StoreResult<Vec<InstanceId>> {
    let (cancelled, then) = cancel_one(db, p, planner).await?;
    run_then(db, FollowUps::new(then), p.now).await?;
    Ok(cancelled)
}

/// One cancel: its ids, and what its parents' releases left to do. A bounded number of
/// statements whatever the tree's size: the root, its live descendants (one recursive
/// statement, bounded like the walk of `MemoryStore`) and their inboxes are read at once;
/// the cancelled rows, their history, drained inboxes and deleted timers are written in
/// one query; the parents' releases read every parent at once and write them in one more.
async fn cancel_one(
    db: &mut Db<'_>,
    p: &CancelParams,
    planner: fn(&CancelParams, CancelRead) -> StoreResult<plan::cancel::CancelPlan>,
) -> StoreResult<(Vec<InstanceId>, Vec<FollowUp>)> {
    let mut read = CancelRead { root: db.instance(p.id).await?, ..CancelRead::default() };
    if p.cascade && read.root.as_ref().is_some_and(|r| !r.status.is_terminal()) {
        // The cascade touches at most CANCEL_CASCADE_MAX instances, the root included.
        let max = limits::CANCEL_CASCADE_MAX - 1;
        read.descendants = db.live_descendants(p.id, limits::CANCEL_CASCADE_DEPTH_MAX, max).await?;
    }
    let before: HashMap<InstanceId, Instance> = read
        .root
        .iter()
        .chain(read.descendants.iter().map(|(r, _)| r))
        .filter(|r| !r.status.is_terminal())
        .map(|r| (r.id, r.clone()))
        .collect();
    let asks: Vec<InboxAsk<'_>> = before.keys().map(|id| InboxAsk::ending(*id)).collect();
    let mut facts = db.inbox_facts(&asks).await?;
    for id in before.keys() {
        let pending = facts.remove(id).map(|f| f.pending().clone()).unwrap_or_default();
        read.pending.insert(*id, pending);
    }
    let plan = planner(p, read)?;
    let mut w = Writes::default();
    for planned in &plan.rows {
        for entry in &planned.history {
            w.record(&planned.row, planned.attempt, entry, p.now);
        }
        let row_before = before.get(&planned.row.id).ok_or_else(|| {
            not_read(&format!("cancelling instance {} under {}", planned.row.id.0, p.id.0))
        })?;
        w = update_gathered(db, w, row_before, &planned.row).await?;
        w.signals_drop(planned.row.id);
        w.timers_drop(planned.row.id);
    }
    db.write(w).await?;
    let more = parents_release(db, &plan.releases, p.now).await?;
    Ok((plan.cancelled(), more))
}

/// The error for a plan that names a row its read did not return: a bug between this
/// store and the core's planner, reported (the transaction rolls back) rather than a panic
/// under the writer.
fn not_read(doing: &str) -> StoreError {
    StoreError::invalid(format!(
        "{doing}: the plan names a row the store's read did not return, so nothing was \
         written; this is an internal error in Keel, please report it"
    ))
}

/// Adds the update of `before` to `after` to `w`; a row with a unique key has its guard
/// decided against the rows as they stand, so what `w` gathered runs first and the row is
/// written alone. Returns what to gather next into.
async fn update_gathered(
    db: &mut Db<'_>,
    mut w: Writes,
    before: &Instance,
    after: &Instance,
) -> StoreResult<Writes> {
    if before.unique.is_none() && after.unique.is_none() {
        w.instance_update(before, after, Guard::Untouched);
        return Ok(w);
    }
    db.write(w).await?;
    db.instance_update(before, after).await?;
    Ok(Writes::default())
}

// ----- dead letters ----------------------------------------------------------------------

/// A dead-letter selector as the three values its statements bind (each `NULL` when the
/// selector does not narrow by it): a letter's id, its namespace and machine.
fn selector_binds(
    selector: Option<&DeadLetterSelector>,
) -> (Option<i64>, Option<String>, Option<String>) {
    match selector {
        None => (None, None, None),
        Some(DeadLetterSelector::Id(id)) => (Some(id.0), None, None),
        Some(DeadLetterSelector::Machine { namespace, machine }) => {
            (None, Some(namespace.clone()), Some(machine.clone()))
        }
    }
}

/// The dead letters a selector names, oldest first, bounded; with `instance_status`, only
/// those whose instance is in it.
async fn letters(
    db: &mut Db<'_>,
    selector: Option<&DeadLetterSelector>,
    instance_status: Option<Status>,
) -> StoreResult<Vec<(DeadLetterId, NewDeadLetter, Timestamp)>> {
    let (id, ns, machine) = selector_binds(selector);
    let rows = sqlx::query(concat!(
        "SELECT ",
        dead_letter_cols!(),
        " FROM keel_dead_letters \
         WHERE (? IS NULL OR id = ?) AND (? IS NULL OR namespace = ?) \
           AND (? IS NULL OR machine = ?) \
           AND (? IS NULL OR EXISTS (SELECT 1 FROM keel_instances i \
                                     WHERE i.id = keel_dead_letters.instance_id AND i.status = ?)) \
         ORDER BY id LIMIT +?"
    ))
    .bind(id)
    .bind(id)
    .bind(&ns)
    .bind(&ns)
    .bind(&machine)
    .bind(&machine)
    .bind(instance_status.map(Status::name))
    .bind(instance_status.map(Status::name))
    .bind(limits::DEAD_LETTER_BATCH_MAX as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("selecting dead letters"))?;
    rows.iter().map(|r| db.dead_letter_of(r).map(|d| (d.id, d.letter, d.created_at))).collect()
}

pub(crate) async fn dead_letter_retry(
    db: &mut Db<'_>,
    p: &DeadLetterRetryParams,
) -> StoreResult<Vec<InstanceId>> {
    p.validate()?;
    let status = p.instance_status();
    let letters: Vec<(DeadLetterId, InstanceId)> = letters(db, Some(&p.selector), status)
        .await?
        .into_iter()
        .map(|(id, letter, _)| (id, letter.instance))
        .collect();
    let mut rows = Vec::with_capacity(letters.len());
    for (_, instance) in &letters {
        rows.extend(db.instance(*instance).await?);
    }
    let plan = plan::dead_letter::retry(p, &letters, rows)?;
    for w in &plan.rows {
        write_planned(db, w, p.now).await?;
    }
    for id in &plan.remove {
        db.dead_letter_remove(*id).await?;
    }
    Ok(plan.retried())
}

pub(crate) async fn dead_letter_skip(
    db: &mut Db<'_>,
    p: &DeadLetterSkipParams,
) -> StoreResult<InstanceId> {
    let letter = db.dead_letter(p.id).await?;
    let row = db.instance(letter.letter.instance).await?;
    let plan = plan::dead_letter::skip(p, &letter, row.as_ref())?;
    let id = plan.row.row.id;
    for signal in &plan.consume {
        db.signal_remove(id, *signal).await?;
    }
    write_planned(db, &plan.row, p.now).await?;
    db.dead_letter_remove(plan.remove).await?;
    Ok(id)
}

pub(crate) async fn dead_letter_purge(
    db: &mut Db<'_>,
    p: &DeadLetterPurgeParams,
) -> StoreResult<u64> {
    p.validate()?;
    let (id, ns, machine) = selector_binds(p.selector.as_ref());
    // The plan's conditions are in the read too, so the page holds only purgeable letters
    // (a page of kept ones would hide older purgeable letters behind it).
    let rows = sqlx::query(
        "SELECT d.id, d.created_at, i.status FROM keel_dead_letters d \
           LEFT JOIN keel_instances i ON i.id = d.instance_id \
         WHERE (? IS NULL OR d.id = ?) AND (? IS NULL OR d.namespace = ?) \
           AND (? IS NULL OR d.machine = ?) AND (? IS NULL OR d.created_at < ?) \
           AND (? = 0 OR i.status IS NULL OR i.status <> 'suspended') \
         ORDER BY d.id LIMIT +?",
    )
    .bind(id)
    .bind(id)
    .bind(&ns)
    .bind(&ns)
    .bind(&machine)
    .bind(&machine)
    .bind(p.older_than.map(|t| t.0))
    .bind(p.older_than.map(|t| t.0))
    .bind(p.keep_suspended)
    .bind(limits::DEAD_LETTER_BATCH_MAX as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("selecting dead letters to purge"))?;
    let mut letters = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(db.err("reading a dead letter id"))?;
        let at: i64 = r.try_get("created_at").map_err(db.err("reading a dead letter time"))?;
        let status: Option<String> = r.try_get("status").map_err(db.err("reading a status"))?;
        let status = match status {
            Some(s) => Some(s.parse::<Status>().map_err(|e| corrupt(db.file, "status", e))?),
            None => None,
        };
        letters.push((DeadLetterId(id), Timestamp(at), status));
    }
    let gone = plan::dead_letter::purge(p, letters);
    for id in &gone {
        db.dead_letter_remove(*id).await?;
    }
    Ok(gone.len() as u64)
}

// ----- queues ----------------------------------------------------------------------------

pub(crate) async fn queue_pause(
    db: &mut Db<'_>,
    p: &keel_core::ports::store::QueuePauseParams,
) -> StoreResult<()> {
    p.validate()?;
    // A pause records the queue; a resume changes a recorded one only and records none.
    let query = if p.paused {
        sqlx::query(
            "INSERT INTO keel_queues (namespace, queue, paused, updated_at) VALUES (?, ?, 1, ?) \
             ON CONFLICT (namespace, queue) DO UPDATE SET paused = 1, \
             updated_at = excluded.updated_at",
        )
        .bind(&p.namespace)
        .bind(&p.queue)
        .bind(p.now.0)
    } else {
        sqlx::query(
            "UPDATE keel_queues SET paused = 0, updated_at = ? WHERE namespace = ? AND queue = ?",
        )
        .bind(p.now.0)
        .bind(&p.namespace)
        .bind(&p.queue)
    };
    query.execute(&mut *db.conn).await.map_err(db.err("pausing a queue"))?;
    Ok(())
}

/// Done and failed instances per machine and bucket (`Store::instance_activity`).
pub(crate) async fn instance_activity(
    db: &mut Db<'_>,
    p: &keel_core::ports::store::ActivityParams,
) -> StoreResult<Vec<keel_core::ports::store::ActivityBucket>> {
    p.validate()?;
    let rows = sqlx::query(
        "SELECT namespace, machine, (updated_at - ?) / ? AS bucket, \
           SUM(status = 'done') AS completed, SUM(status = 'failed') AS failed, \
           SUM(MAX(updated_at - created_at, 0)) AS turnaround \
         FROM keel_instances \
         WHERE status IN ('done', 'failed') AND updated_at >= ? AND updated_at < ? \
           AND (? IS NULL OR namespace = ?) \
         GROUP BY namespace, machine, bucket ORDER BY namespace, machine, bucket",
    )
    .bind(p.since.0)
    .bind(p.bucket_ms())
    .bind(p.since.0)
    .bind(p.until.0)
    .bind(&p.namespace)
    .bind(&p.namespace)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("counting activity"))?;
    let file = db.file;
    let bad = |col: &'static str| move |e: sqlx::Error| corrupt(file, col, e);
    rows.iter()
        .map(|r| {
            Ok(keel_core::ports::store::ActivityBucket {
                namespace: r.try_get("namespace").map_err(bad("namespace"))?,
                machine: r.try_get("machine").map_err(bad("machine"))?,
                bucket: r.try_get("bucket").map_err(bad("bucket"))?,
                completed: r.try_get::<i64, _>("completed").map_err(bad("completed"))? as u64,
                failed: r.try_get::<i64, _>("failed").map_err(bad("failed"))? as u64,
                turnaround_ms_total: r.try_get::<i64, _>("turnaround").map_err(bad("turnaround"))?
                    as u64,
            })
        })
        .collect()
}

/// Records a heartbeat and forgets long-silent workers (`Store::worker_heartbeat`).
pub(crate) async fn worker_heartbeat(
    db: &mut Db<'_>,
    p: &keel_core::ports::store::WorkerBeatParams,
) -> StoreResult<()> {
    p.validate()?;
    sqlx::query("DELETE FROM keel_workers WHERE last_seen_at < ?")
        .bind(p.forget_before.0)
        .execute(&mut *db.conn)
        .await
        .map_err(db.err("forgetting silent workers"))?;
    sqlx::query(
        "INSERT INTO keel_workers (id, name, machines, namespaces, started_at, last_seen_at) \
         VALUES (?, ?, ?, ?, ?, ?) \
         ON CONFLICT (id) DO UPDATE SET name = excluded.name, machines = excluded.machines, \
           namespaces = excluded.namespaces, started_at = excluded.started_at, \
           last_seen_at = excluded.last_seen_at",
    )
    .bind(&p.id.0)
    .bind(&p.name)
    .bind(serde_json::to_string(&p.machines).unwrap_or_default())
    .bind(serde_json::to_string(&p.namespaces).unwrap_or_default())
    .bind(p.started_at.0)
    .bind(p.now.0)
    .execute(&mut *db.conn)
    .await
    .map_err(db.err("recording a worker heartbeat"))?;
    Ok(())
}

/// A JSON column of the worker registry, or a "damaged file" error naming it.
fn decode<T: serde::de::DeserializeOwned>(
    file: &str,
    col: &'static str,
    text: &str,
) -> StoreResult<T> {
    serde_json::from_str(text).map_err(|e| corrupt(file, col, e))
}

/// Workers seen since a time, most recent first (`Store::worker_list`).
pub(crate) async fn worker_list(
    db: &mut Db<'_>,
    seen_since: Timestamp,
) -> StoreResult<Vec<keel_core::ports::store::WorkerRecord>> {
    let rows = sqlx::query(
        "SELECT id, name, machines, namespaces, started_at, last_seen_at FROM keel_workers \
         WHERE last_seen_at >= ? ORDER BY last_seen_at DESC, id LIMIT +?",
    )
    .bind(seen_since.0)
    .bind(keel_core::ports::store::WORKER_LIST_MAX as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("listing workers"))?;
    let file = db.file;
    let bad = |col: &'static str| move |e: sqlx::Error| corrupt(file, col, e);
    rows.iter()
        .map(|r| {
            Ok(keel_core::ports::store::WorkerRecord {
                id: keel_core::ids::WorkerId(r.try_get("id").map_err(bad("id"))?),
                name: r.try_get("name").map_err(bad("name"))?,
                machines: decode(
                    file,
                    "machines",
                    r.try_get("machines").map_err(bad("machines"))?,
                )?,
                namespaces: decode(
                    file,
                    "namespaces",
                    r.try_get("namespaces").map_err(bad("namespaces"))?,
                )?,
                started_at: Timestamp(r.try_get("started_at").map_err(bad("started_at"))?),
                last_seen_at: Timestamp(r.try_get("last_seen_at").map_err(bad("last_seen_at"))?),
            })
        })
        .collect()
}

/// One page of trimming history: read the page's instances with how many entries each has
/// beyond its newest `keep` (counted up to the cap) and the newest of those, let
/// `plan::history::trim` decide, and delete the oldest entries it names.
pub(crate) async fn history_trim(
    db: &mut Db<'_>,
    p: &HistoryTrimParams,
) -> StoreResult<HistoryTrimPage> {
    p.validate()?;
    let rows = sqlx::query(
        "SELECT id, namespace, machine FROM keel_instances WHERE id > ? ORDER BY id LIMIT +?",
    )
    .bind(p.after.map_or(i64::MIN, |a| a.0))
    .bind(p.limit as i64)
    .fetch_all(&mut *db.conn)
    .await
    .map_err(db.err("reading instances to trim"))?;
    let mut read = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(db.err("reading an id"))?;
        let (excess, through): (i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), max(seq) FROM (SELECT seq FROM keel_history \
               WHERE instance_id = ? ORDER BY seq DESC LIMIT +? OFFSET ?)",
        )
        .bind(id)
        .bind(p.count_cap() as i64)
        .bind(p.keep as i64)
        .fetch_one(&mut *db.conn)
        .await
        .map_err(db.err("counting history to trim"))?;
        read.push(TrimCandidate {
            id: InstanceId(id),
            namespace: r.try_get("namespace").map_err(db.err("reading a namespace"))?,
            machine: r.try_get("machine").map_err(db.err("reading a machine"))?,
            excess: u64::try_from(excess).unwrap_or(0),
            through,
        });
    }
    let plan = plan::history::trim(p, &read);
    let mut page = HistoryTrimPage { last: plan.last, ..HistoryTrimPage::default() };
    for t in plan.trims {
        let done = sqlx::query(
            "DELETE FROM keel_history WHERE seq IN (SELECT seq FROM keel_history \
               WHERE instance_id = ? AND seq <= ? ORDER BY seq LIMIT +?)",
        )
        .bind(t.instance.0)
        .bind(t.through)
        .bind(i64::try_from(t.count).unwrap_or(i64::MAX))
        .execute(&mut *db.conn)
        .await
        .map_err(db.err("trimming history"))?;
        page.history += done.rows_affected();
        page.instances += u64::from(done.rows_affected() > 0);
    }
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::{BROADCAST_CANDIDATES, PRUNE_PAGE_SQL, PageShape, SWEEP_PICK_SQL, page_sql};
    use sqlx::{Connection, Row, SqliteConnection};

    /// A connection to a fresh in-memory database with the store's schema.
    async fn schema() -> SqliteConnection {
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.expect("open");
        crate::store::migrator().run(&mut conn).await.expect("migrate");
        conn
    }

    /// SQLite's plan for `sql`, one step per line.
    async fn plan(conn: &mut SqliteConnection, sql: &str) -> String {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
            .fetch_all(&mut *conn)
            .await
            .expect("explain");
        rows.iter().map(|r| r.get::<String, _>("detail")).collect::<Vec<_>>().join("\n")
    }

    /// The claim pages and the timer sweep's pick read their rows along an index in the
    /// order they return them, and stop at the page: none sorts what it reads, so a page
    /// costs what it returns however many rows are ready or due. Their limit is bound as
    /// an expression, so the plan does not depend on its value (nor does the statement
    /// need preparing again when it changes).
    #[tokio::test]
    async fn claim_pages_and_the_sweep_pick_walk_an_index_without_sorting() {
        let mut conn = schema().await;
        let cases = [
            (page_sql(PageShape::Plain, false), "keel_instances_claim"),
            (page_sql(PageShape::OnePriority, false), "keel_instances_claim"),
            (page_sql(PageShape::EveryPriority, false), "keel_instances_runnable_age"),
            (SWEEP_PICK_SQL, "keel_timers_due"),
        ];
        for (sql, index) in cases {
            let plan = plan(&mut conn, sql).await;
            let first = plan.lines().next().unwrap_or_default();
            assert!(
                first.contains(&format!("USING INDEX {index}")),
                "expected a walk of {index}, got:\n{plan}\nfor {sql}"
            );
            assert!(!plan.contains("TEMP B-TREE"), "the page sorts its rows:\n{plan}\nfor {sql}");
        }
    }

    /// A prune page asks of each row it reads whether a dead letter still holds it along
    /// the letters' instance index, and an instance's delete checks the letters' foreign
    /// key along it too: neither reads the whole dead-letter table under the writer.
    #[tokio::test]
    async fn a_prune_page_finds_each_rows_dead_letters_along_an_index() {
        let mut conn = schema().await;
        for sql in [PRUNE_PAGE_SQL, "SELECT 1 FROM keel_dead_letters WHERE instance_id = ?"] {
            let plan = plan(&mut conn, sql).await;
            assert!(
                !plan.lines().any(|l| l
                    .trim_start_matches(|c: char| !c.is_alphabetic())
                    .starts_with("SCAN")),
                "a statement reads a whole table:\n{plan}\nfor {sql}"
            );
            assert!(plan.contains("keel_dead_letters_instance"), "no walk of the index:\n{plan}");
        }
    }

    /// A claim reads each claimed instance's first signals and children along the index,
    /// stopping at the bound: a parent with a long inbox or many children costs a claim no
    /// more than one with a few (no statement reads a whole inbox to keep its first rows).
    #[tokio::test]
    async fn inbox_and_children_reads_stop_at_their_bound() {
        let mut conn = schema().await;
        let cases = [
            (crate::rows::INBOXES_SQL, "keel_signals_target"),
            (crate::rows::CHILDREN_OF_SQL, "keel_instances_parent"),
        ];
        for (sql, index) in cases {
            let plan = plan(&mut conn, sql).await;
            assert!(
                plan.contains(&format!("INDEX {index} (")),
                "expected a walk of {index}, got:\n{plan}\nfor {sql}"
            );
            assert!(
                plan.contains("CORRELATED LIST SUBQUERY"),
                "each instance's rows are not read on their own:\n{plan}\nfor {sql}"
            );
            assert!(!plan.contains("CO-ROUTINE"), "a subquery is materialised whole:\n{plan}");
        }
    }

    /// A fair claim lists its keys by probing the runnable-keys index once per key, in key
    /// order: no statement walks every keyed ready row or sorts the keys, so a claim's key
    /// scan costs the keys it visits (at most `CLAIM_KEYS_SCAN_MAX`), not the backlog.
    #[tokio::test]
    async fn the_key_scan_probes_the_runnable_keys_index_without_sorting() {
        let mut conn = schema().await;
        let plan = plan(&mut conn, super::ROTATION_KEYS_SQL).await;
        assert!(
            plan.contains("INDEX keel_instances_runnable_keys (concurrency_key>?)"),
            "expected a probe of keel_instances_runnable_keys past the last key, got:\n{plan}"
        );
        assert!(!plan.contains("TEMP B-TREE"), "the keys are sorted:\n{plan}");
    }

    /// A commit's inbox questions walk each instance's signals along the inbox index (the
    /// pending list stopping at its bound), never the whole signal table, and read
    /// payloads only to tell a timer's fire: a long inbox, or one of large payloads, costs
    /// a commit an index walk, not a decode of every signal in it.
    #[tokio::test]
    async fn inbox_questions_walk_each_instances_inbox_index() {
        let mut conn = schema().await;
        for sql in [crate::inbox::FACTS_SQL, crate::inbox::FIRES_SQL, crate::inbox::PENDING_SQL] {
            let plan = plan(&mut conn, sql).await;
            assert!(
                plan.contains("INDEX keel_signals_target (target_id=?"),
                "expected a walk of keel_signals_target, got:\n{plan}\nfor {sql}"
            );
            assert!(
                !plan.lines().any(|l| l.starts_with("SCAN s")),
                "a scan of every signal:\n{plan}"
            );
        }
        let plan = plan(&mut conn, crate::inbox::PENDING_SQL).await;
        assert!(plan.contains("LIST SUBQUERY"), "each inbox is not read on its own:\n{plan}");
    }

    /// A broadcast's candidate read stops at the bound it is given (`BROADCAST_MAX + 1` in
    /// the store), in id order, and counts only the instances its filters let through: a
    /// broadcast that is refused for matching too many reads no more than one past the
    /// limit, under the writer, however many live instances the machine has.
    #[tokio::test]
    async fn broadcast_candidates_stop_at_the_bound() {
        let mut conn = schema().await;
        // Instances 1..=8 of `order` in `ns`: odd ones in state `open` (as a chart's JSON
        // array of paths for 1 and 5), even ones in `closed`, and 3 done; then others
        // that never match.
        let rows = [
            (1, "ns", "order", r#"["open","open.idle"]"#, "awaiting_signal"),
            (2, "ns", "order", "closed", "runnable"),
            (3, "ns", "order", "open", "done"),
            (4, "ns", "order", "closed", "runnable"),
            (5, "ns", "order", r#"["open"]"#, "executing"),
            (6, "ns", "order", "closed", "runnable"),
            (7, "ns", "order", "open", "runnable"),
            (8, "ns", "order", "closed", "suspended"),
            (9, "ns", "invoice", "open", "runnable"),
            (10, "other", "order", "open", "runnable"),
        ];
        for (id, ns, machine, position, status) in rows {
            sqlx::query(
                "INSERT INTO keel_instances (id, namespace, machine, machine_version, queue, \
                   priority, status, position, context, attempt, errors, revision, \
                   eligible_at, fencing_token, created_at, updated_at) \
                 VALUES (?, ?, ?, 1, 'default', 2, ?, ?, '{}', 0, '[]', 0, 0, 0, 0, 0)",
            )
            .bind(id)
            .bind(ns)
            .bind(machine)
            .bind(status)
            .bind(position)
            .execute(&mut conn)
            .await
            .expect("insert an instance");
        }
        let read = async |conn: &mut SqliteConnection, state: Option<&str>, bound: i64| {
            sqlx::query(BROADCAST_CANDIDATES)
                .bind("ns")
                .bind("order")
                .bind(state)
                .bind(state)
                .bind(state)
                .bind(bound)
                .fetch_all(&mut *conn)
                .await
                .expect("read the candidates")
                .iter()
                .map(|r| r.get::<i64, _>("id"))
                .collect::<Vec<_>>()
        };
        assert_eq!(read(&mut conn, None, 100).await, [1, 2, 4, 5, 6, 7, 8], "every live one");
        assert_eq!(read(&mut conn, None, 3).await, [1, 2, 4], "stops at the bound");
        assert_eq!(read(&mut conn, Some("open"), 100).await, [1, 5, 7], "in the state");
        assert_eq!(read(&mut conn, Some("open"), 2).await, [1, 5], "in the state, bounded");
    }

    /// A broadcast that matches more than `BROADCAST_MAX` live instances is refused as the
    /// planner refuses it (`Invalid`, naming `broadcast targets`) and stores nothing. It
    /// reads one row past the bound and decodes none: an instance after that row whose
    /// position cannot be read (stored as a blob) plays no part in the answer.
    #[tokio::test]
    async fn a_broadcast_over_the_bound_is_refused_without_reading_past_it() {
        use keel_core::ports::store::SignalBroadcastParams;
        use keel_core::{ErrorKind, Timestamp, limits};
        let mut conn = schema().await;
        let matching = limits::BROADCAST_MAX as i64 + 1;
        sqlx::query(
            "INSERT INTO keel_instances (id, namespace, machine, machine_version, queue, \
               priority, status, position, context, attempt, errors, revision, eligible_at, \
               fencing_token, created_at, updated_at) \
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) \
             SELECT i, 'ns', 'order', 1, 'default', 2, 'runnable', 'start', '{}', 0, '[]', 0, \
               0, 0, 0, 0 FROM n",
        )
        .bind(matching)
        .execute(&mut conn)
        .await
        .expect("insert the instances");
        sqlx::query(
            "INSERT INTO keel_instances (id, namespace, machine, machine_version, queue, \
               priority, status, position, context, attempt, errors, revision, eligible_at, \
               fencing_token, created_at, updated_at) \
             VALUES (?, 'ns', 'order', 1, 'default', 2, 'runnable', X'00', '{}', 0, '[]', 0, \
               0, 0, 0, 0)",
        )
        .bind(matching + 1)
        .execute(&mut conn)
        .await
        .expect("insert an instance whose position cannot be read");
        let p = SignalBroadcastParams {
            namespace: "ns".into(),
            machine: "order".into(),
            in_state: None,
            name: "RECALL".into(),
            payload: serde_json::Value::Null,
            dedup_key: None,
            now: Timestamp(1),
        };
        let mut db = super::Db { conn: &mut conn, file: "broadcast.db" };
        let err = super::signal_broadcast(&mut db, &p).await.expect_err("over the bound");
        let over = format!(
            "broadcast targets: {matching} items is over the limit of {}",
            limits::BROADCAST_MAX
        );
        assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
        assert!(err.message.starts_with(&over), "expected \"{over}…\", got: {err}");
        let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM keel_signals")
            .fetch_one(&mut conn)
            .await
            .expect("count the signals");
        assert_eq!(stored, 0, "a refused broadcast stores nothing");
    }

    /// No statement of this crate binds its row limit as a bare parameter: SQLite plans
    /// with that value, so every new binding would throw the prepared statement away.
    #[test]
    fn no_statement_binds_a_bare_limit() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let sources: Vec<(String, String)> = std::fs::read_dir(&dir)
            .expect("read the source directory")
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
            .map(|path| {
                let text = std::fs::read_to_string(&path).expect("read a source file");
                (path.file_name().unwrap().to_string_lossy().into_owned(), text)
            })
            .collect();
        assert!(sources.iter().any(|(f, _)| f == "ops.rs"), "the scan reads {}", dir.display());
        let bare = ["LIMIT", " ?"].concat();
        for (file, text) in sources {
            for (n, line) in text.lines().enumerate() {
                assert!(
                    !line.contains(&bare),
                    "{file}:{}: bind the limit as `LIMIT +?` so the statement stays prepared",
                    n + 1
                );
            }
        }
    }
}
