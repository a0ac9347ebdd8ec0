//! The `Store` operations. Each lives in its own module as a function over a pooled
//! connection; this module holds the transaction guard, the retry loop and the trait impl.

mod admin;
mod claim;
mod commit;
mod history;
mod insert;
mod lease;
mod migrate;
mod operate;
mod prune;
mod schedule;
mod signal;
mod timer;

#[cfg(test)]
mod notices;
#[cfg(test)]
mod plans;

pub(crate) use timer::{Notice, parse_notice};

use crate::PgStore;
use crate::TRANSACTION_RETRIES;
use crate::error::{OpError, OpResult};
use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use keel_core::instance::{DeadLetter, Instance, SignalTarget};
use keel_core::ports::store::{
    ActivityBucket, ActivityParams, BroadcastReport, CancelParams, Claim, ClaimParams,
    CommitParams, CommitReceipt, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSkipParams, DeliveryOutcome, HistoryPage, HistoryPageParams, HistoryTrimPage,
    HistoryTrimParams, InsertOutcome, InsertParams, InstanceDetail, InstanceListParams,
    LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, MigratePage, MigrateParams, PrunePage,
    PruneParams, QueuePauseParams, QueueState, QueueStats, ReadyStaleParams, SignalBroadcastParams,
    SignalDeliverParams, Store, StoreCapabilities, TimerNextDueParams, TimerRetimePage,
    TimerRetimeParams, TimerStatus, TimerSweepParams, TimerSweepReport, WorkerBeatParams,
    WorkerRecord,
};
use keel_core::timers::TimerHint;
use keel_core::{DeadLetterId, InstanceId, StoreError, StoreResult, Timestamp};
use std::pin::Pin;
use std::task::Poll;

/// A pooled connection that may be inside a transaction. Dropped mid-transaction (an
/// error path or a cancelled future), it is detached from the pool and closed, so the
/// server rolls the transaction back and no later user inherits it.
pub(crate) struct Conn {
    client: Option<deadpool_postgres::Client>,
    in_tx: bool,
}

impl Conn {
    /// The connection.
    pub(crate) fn client(&self) -> &deadpool_postgres::Client {
        self.client.as_ref().expect("connection present until drop")
    }

    async fn rollback(&mut self) {
        if self.in_tx && self.client().batch_execute("ROLLBACK").await.is_ok() {
            self.in_tx = false;
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.in_tx
            && let Some(c) = self.client.take()
        {
            drop(deadpool_postgres::Object::take(c));
        }
    }
}

/// Runs `$body` (an expression using the connection `$c` that BEGINs and COMMITs itself)
/// and re-runs it on a deadlock or serialization failure.
macro_rules! in_tx {
    ($store:expr, |$c:ident| $body:expr) => {{
        let mut tries = 0u32;
        loop {
            let mut conn = $store.conn().await?;
            let result = {
                let $c = conn.client();
                $body.await
            };
            match result {
                Ok(v) => {
                    conn.in_tx = false;
                    break Ok::<_, StoreError>(v);
                }
                Err(e) => {
                    conn.rollback().await;
                    if e.is_transient() && tries < TRANSACTION_RETRIES {
                        tries += 1;
                        continue;
                    }
                    break Err(StoreError::from(e));
                }
            }
        }
    }};
}

impl PgStore {
    /// A claim, of any ready instances or (with `ids`) of the named ones only.
    async fn claim(&self, params: ClaimParams, ids: Option<&[i64]>) -> StoreResult<Vec<Claim>> {
        match ids {
            Some(_) => params.validate_by_ids()?,
            None => params.validate()?,
        }
        let mut tries = 0u32;
        loop {
            // A queue with a global limit or a rate limit (of the queue or per key) is
            // claimed in a short transaction under its claim lock; every other claim is
            // one autocommit statement.
            let limited = params.policy.is_queue_wide();
            let mut conn = self.conn().await?;
            conn.in_tx = false;
            let result = if limited {
                conn.in_tx = true;
                let c = conn.client();
                let run = async {
                    begin(c).await?;
                    claim::lock_queue(c, &params).await?;
                    let claimed = match claim::rate_room(c, &params).await? {
                        None => claim::run(c, &params, ids).await?,
                        Some((refilled, room)) => {
                            let narrowed = ClaimParams { limit: room, ..params.clone() };
                            let claimed = claim::run(c, &narrowed, ids).await?;
                            let taken = claimed.claims.len() + claimed.undecodable.len();
                            claim::rate_spent(c, &params, refilled, taken).await?;
                            claimed
                        }
                    };
                    // Per-key buckets: what each key took, written back under the lock.
                    let mut per_key = std::collections::BTreeMap::<String, usize>::new();
                    let rows = claimed.claims.iter().map(|c| &c.instance);
                    for row in rows.chain(claimed.undecodable.iter().map(|(r, _)| r)) {
                        if let Some(key) = &row.concurrency_key {
                            *per_key.entry(key.clone()).or_default() += 1;
                        }
                    }
                    claim::key_rate_spent(c, &params, &per_key).await?;
                    commit_tx(c).await?;
                    Ok::<_, OpError>(claimed)
                };
                let result = run.await;
                match &result {
                    Ok(_) => conn.in_tx = false,
                    Err(_) => conn.rollback().await,
                }
                result
            } else {
                claim::run(conn.client(), &params, ids).await
            };
            match result {
                Err(e)
                    if (claim::is_key_race(&e) || e.is_transient())
                        && tries < TRANSACTION_RETRIES =>
                {
                    tries += 1;
                }
                // Losing the race for a key every time is still a race, not a refusal of
                // this claim: a later claim finds the winners' rows leased and takes others.
                Err(e) if claim::is_key_race(&e) => return Err(lost_key_race(tries + 1, e)),
                Err(e) => return Err(StoreError::from(e)),
                Ok(claimed) => {
                    drop(conn);
                    if !claimed.undecodable.is_empty() {
                        // If this fails, the rows keep their lease, the reaper returns them
                        // and a later claim tries again; the good claims are handed out
                        // either way, so an error here must not fail the whole call.
                        let bad = &claimed.undecodable;
                        let _ = in_tx!(self, |c| claim::poison(c, bad, params.now));
                    }
                    return Ok(claimed.claims);
                }
            }
        }
    }

    pub(crate) async fn conn(&self) -> Result<Conn, StoreError> {
        let client = self.client().await?;
        Ok(Conn { client: Some(client), in_tx: true })
    }

    /// Inserts instances inside the caller's transaction (transactional enqueue: the
    /// instances exist if and only if the caller's transaction commits). Same contract as
    /// [`Store::instance_insert`]; a competing inserter's uncommitted row makes this wait
    /// for it. At `REPEATABLE READ` a conflict with a row committed after the snapshot is a
    /// serialization failure (`Unavailable`): retry the transaction.
    pub async fn instance_insert_tx<C: GenericClient + Sync>(
        &self,
        tx: &C,
        params: InsertParams,
    ) -> StoreResult<Vec<InsertOutcome>> {
        params.validate()?;
        let out = insert::insert_batch(tx, &insert::items(&params), params.now).await?;
        notify(tx, &self.channel).await?;
        Ok(out)
    }
}

/// A claim that lost the race for a key on each of its `attempts`. Still a race, not a
/// refusal of this claim: a later claim finds the winners' rows leased and takes others,
/// so the error is retryable.
fn lost_key_race(attempts: u32, last: OpError) -> StoreError {
    let last = StoreError::from(last);
    StoreError::unavailable(format!(
        "claim lost the race for a concurrency or uniqueness key {attempts} times in a row \
         (another worker took the same key each time; last: {}); retry the claim",
        last.message
    ))
}

/// Sends the store's one wake-up for this transaction.
pub(crate) async fn notify<C: GenericClient + Sync>(c: &C, channel: &str) -> OpResult<()> {
    let stmt = c.prepare_cached(timer::HINT).await?;
    c.execute(&stmt, &[&channel, &timer::READY]).await?;
    Ok(())
}

/// Ends the transaction: with a channel, commits and then sends the "work is ready"
/// wake-up (see [`end_tx_notices`]).
pub(crate) async fn end_tx<C: GenericClient + Sync>(c: &C, channel: Option<&str>) -> OpResult<()> {
    match channel {
        None => commit_tx(c).await,
        Some(channel) => end_tx_notices(c, channel, &Notices::ready(true)).await,
    }
}

/// The wake-ups a transaction sends once it has committed.
#[derive(Debug, Default)]
pub(crate) struct Notices {
    /// Work may be ready: idle workers claim.
    pub(crate) ready: bool,
    /// Instances ended or were suspended: callers waiting for results re-read them.
    pub(crate) ended: bool,
    /// Timers were armed, the earliest due then: sweepers re-plan their next pass.
    pub(crate) timer: Option<String>,
}

impl Notices {
    pub(crate) fn ready(ready: bool) -> Self {
        Notices { ready, ..Notices::default() }
    }

    fn payloads(&self) -> Vec<&str> {
        let mut out = Vec::with_capacity(3);
        if self.ready {
            out.push(timer::READY);
        }
        if self.ended {
            out.push(timer::ENDED);
        }
        if let Some(hint) = &self.timer {
            out.push(hint.as_str());
        }
        out
    }
}

/// Commits, then sends `notices` on `channel` in a short transaction of their own that
/// does not wait for its WAL flush, pipelined behind the `COMMIT`. Returns once the
/// `COMMIT` has answered: the notice's own answer is not waited for (the server runs it
/// after the commit all the same, and the next user of the connection reads past its
/// answer), so a caller pays one round trip to its commit and nothing after it.
///
/// Why not `pg_notify` inside the transaction: PostgreSQL serializes every committing
/// transaction that has notified, holding that lock from before its commit record until
/// its flush returns, so commits that each end an instance could not share a flush. Sent
/// after the commit, a notice costs a few microseconds of that lock and no flush wait. A
/// listener never hears of work before it is committed, since the server runs the notice
/// after the `COMMIT`; a transaction that failed and rolled back still sends its notice,
/// which costs a listener one empty claim. A process that dies between the two loses the
/// wake-up, which polling repairs as it repairs any lost notice. A notice that fails to send after the commit
/// landed is logged when its answer is already in, never reported as the commit's failure
/// (the caller would re-run a transaction that took effect); one that fails later shows
/// only in the server's log, and polling finds the work.
pub(crate) async fn end_tx_notices<C: GenericClient + Sync>(
    c: &C,
    channel: &str,
    notices: &Notices,
) -> OpResult<()> {
    let payloads = notices.payloads();
    if payloads.is_empty() {
        return commit_tx(c).await;
    }
    let notify = notify_sql(channel, &payloads);
    let mut sent = std::pin::pin!(c.batch_execute(&notify));
    // Polled once, behind the COMMIT: that sends the notice. Its answer is not waited for.
    let (committed, mut answer) = tokio::join!(commit_tx(c), poll_once(sent.as_mut()));
    committed?;
    if answer.is_pending() {
        answer = poll_once(sent).await;
    }
    if let Poll::Ready(Err(e)) = answer {
        let e = StoreError::from(OpError::from(e));
        tracing::warn!(error = %e, "wake-up notices after a commit were not sent; polling finds the work");
    }
    Ok(())
}

/// Polls `f` once: its output if it is ready, else `Pending` (and `f` stays pending).
async fn poll_once<F: Future + ?Sized>(mut f: Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

/// The wake-up transaction as one statement in a transaction of its own: `pg_notify` once
/// per payload, committed without waiting for its flush (`set_config(…, true)` lasts until
/// that commit). One statement, not `BEGIN; …; COMMIT` in one message: a notice that
/// fails (the server's notification queue full, say) then rolls its own transaction back,
/// where an explicit block would leave the pooled connection inside an aborted
/// transaction and fail whatever ran on it next. The channel is made of lowercase
/// letters, digits and `_` (the store checks its schema name) and the payloads are the
/// store's own (`ended`, `timer:<ms>`, empty); quotes are doubled all the same.
fn notify_sql(channel: &str, payloads: &[&str]) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let calls: Vec<String> =
        payloads.iter().map(|p| format!("pg_notify({}, {})", quote(channel), quote(p))).collect();
    format!("SELECT set_config('synchronous_commit', 'off', true), {}", calls.join(", "))
}

/// `BEGIN` as a pipelined future.
pub(crate) async fn begin<C: GenericClient + Sync>(c: &C) -> OpResult<()> {
    c.batch_execute("BEGIN").await.map_err(OpError::from)
}

/// `BEGIN` of a read-only transaction that reads one snapshot (`REPEATABLE READ`), as a
/// pipelined future: several reads that must agree with each other.
pub(crate) async fn begin_snapshot<C: GenericClient + Sync>(c: &C) -> OpResult<()> {
    c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY").await.map_err(OpError::from)
}

/// Largest batch (rows a transaction's statements take as arrays) that runs its
/// statements' generic plans (see [`begin_hot`]). A generic plan cannot see an array's
/// length and assumes about a hundred elements; up to that it plans no worse than a
/// custom plan, beyond it a custom plan that knows the length wins (an insert of 1 000
/// instances on the generic plan went from about 82 000 to 61 000 instances/s).
pub(crate) const GENERIC_PLAN_ROWS_MAX: usize = 100;

/// `BEGIN` of a hot-path transaction (a step commit, a delivery, a sweep, a top-level
/// insert) over `rows` rows.
///
/// Up to [`GENERIC_PLAN_ROWS_MAX`] rows, its prepared statements run their cached generic
/// plans instead of being planned again on every call. Why: PostgreSQL plans a prepared
/// statement per call (a custom plan for the call's values) unless it judges the generic
/// plan no more expensive, and for statements over arrays of ids it keeps choosing custom
/// plans: planning the commit's row lock, its write and its signal reads cost more than
/// executing them (about 0.4 ms of server CPU per single-step commit). The hot-path
/// statements select by primary key or by the arrays they are given, so one plan serves
/// every small batch.
///
/// At any size, sequential scans are off. The hot path reads and writes rows by key, but
/// a plan made while `signals` or `timers` is nearly empty (a new deployment, a quiet
/// hour) prefers scanning the whole table, and a connection keeps its generic plan for
/// its whole life: after a burst of 50 000 timer fires every commit that drained an inbox
/// scanned 50 000 signals (2.7 ms instead of 0.1 ms), and a 1 000-timer sweep hashed the
/// whole instance table to learn which of its instances exist.
pub(crate) async fn begin_hot<C: GenericClient + Sync>(c: &C, rows: usize) -> OpResult<()> {
    let sql = if rows > GENERIC_PLAN_ROWS_MAX {
        "BEGIN; SET LOCAL enable_seqscan = off"
    } else {
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL plan_cache_mode = force_generic_plan"
    };
    c.batch_execute(sql).await.map_err(OpError::from)
}

/// `COMMIT` as a pipelined future.
pub(crate) async fn commit_tx<C: GenericClient + Sync>(c: &C) -> OpResult<()> {
    c.batch_execute("COMMIT").await.map_err(OpError::from)
}

#[async_trait]
impl Store for PgStore {
    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities { notifications: true }
    }

    async fn instance_insert(&self, params: InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        params.validate()?;
        let items = insert::items(&params);
        in_tx!(self, |c| insert::run(c, &items, params.now, &self.channel))
    }

    async fn instance_claim(&self, params: ClaimParams) -> StoreResult<Vec<Claim>> {
        self.claim(params, None).await
    }

    async fn instance_claim_ids(
        &self,
        ids: Vec<InstanceId>,
        params: ClaimParams,
    ) -> StoreResult<Vec<Claim>> {
        let ids: Vec<i64> = ids.iter().map(|id| id.0).collect();
        self.claim(params, Some(&ids)).await
    }

    async fn instance_ready_stale(&self, params: ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        let conn = self.client().await?;
        admin::ready_stale(&conn, &params).await.map_err(StoreError::from)
    }

    async fn step_commit(
        &self,
        params: CommitParams,
    ) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
        params.validate()?;
        in_tx!(self, |c| commit::run(c, &params.commits, params.now, &self.channel))
    }

    async fn lease_extend(&self, params: LeaseExtendParams) -> StoreResult<Vec<bool>> {
        params.validate()?;
        // Rows are locked in id order, so a deadlock needs a writer that does not; retry
        // it like every other write rather than failing the heartbeat.
        let mut tries = 0u32;
        loop {
            let conn = self.client().await?;
            match lease::extend(&conn, &params).await {
                Err(e) if e.is_transient() && tries < TRANSACTION_RETRIES => tries += 1,
                other => return other.map_err(StoreError::from),
            }
        }
    }

    async fn lease_reap(&self, params: LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        params.validate()?;
        in_tx!(self, |c| lease::reap(c, &params, &self.channel))
    }

    async fn instance_migrate(&self, params: MigrateParams) -> StoreResult<MigratePage> {
        params.validate()?;
        in_tx!(self, |c| migrate::run(c, &params, &self.channel))
    }

    async fn instance_prune(&self, params: PruneParams) -> StoreResult<PrunePage> {
        params.validate()?;
        in_tx!(self, |c| prune::run(c, &params))
    }

    async fn instance_change_wait(&self) {
        self.wait_changed().await;
    }

    async fn lease_release(&self, params: LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        params.validate()?;
        in_tx!(self, |c| lease::release(c, &params, &self.channel))
    }

    async fn signal_deliver(
        &self,
        params: SignalDeliverParams,
    ) -> StoreResult<Vec<DeliveryOutcome>> {
        params.validate()?;
        in_tx!(self, |c| signal::run(c, &params.signals, params.now, &self.channel))
    }

    async fn signal_broadcast(
        &self,
        params: SignalBroadcastParams,
    ) -> StoreResult<BroadcastReport> {
        params.validate()?;
        in_tx!(self, |c| signal::broadcast(c, &params, &self.channel))
    }

    async fn instance_cancel(&self, params: CancelParams) -> StoreResult<Vec<InstanceId>> {
        in_tx!(self, |c| admin::cancel(c, &params, &self.channel))
    }

    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        in_tx!(self, |c| admin::get(c, id))
    }

    async fn history_page(&self, params: HistoryPageParams) -> StoreResult<HistoryPage> {
        params.validate()?;
        in_tx!(self, |c| history::page(c, &params))
    }

    async fn history_trim(&self, params: HistoryTrimParams) -> StoreResult<HistoryTrimPage> {
        params.validate()?;
        in_tx!(self, |c| history::trim(c, &params))
    }

    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        let conn = self.client().await?;
        admin::rows_of(&conn, &ids).await.map_err(StoreError::from)
    }

    async fn instance_list(&self, params: InstanceListParams) -> StoreResult<Vec<Instance>> {
        params.validate()?;
        let conn = self.client().await?;
        admin::list(&conn, &params).await.map_err(StoreError::from)
    }

    async fn instance_lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>> {
        let conn = self.client().await?;
        admin::lookup(&conn, &target).await.map_err(StoreError::from)
    }

    async fn dead_letter_list(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        filter.validate()?;
        let conn = self.client().await?;
        admin::dead_letter_list(&conn, &filter).await.map_err(StoreError::from)
    }

    async fn dead_letter_counts(
        &self,
        namespace: Option<String>,
    ) -> StoreResult<Vec<keel_core::ports::store::DeadLetterCount>> {
        if let Some(ns) = &namespace {
            keel_core::instance::check_name("namespace", ns)?;
        }
        let conn = self.client().await?;
        admin::dead_letter_counts(&conn, namespace.as_deref()).await.map_err(StoreError::from)
    }

    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        let conn = self.client().await?;
        admin::dead_letter_get(&conn, id).await.map_err(StoreError::from)
    }

    async fn dead_letter_retry(
        &self,
        params: DeadLetterRetryParams,
    ) -> StoreResult<Vec<InstanceId>> {
        params.validate()?;
        in_tx!(self, |c| admin::dead_letter_retry(c, &params, &self.channel))
    }

    async fn dead_letter_skip(&self, params: DeadLetterSkipParams) -> StoreResult<InstanceId> {
        in_tx!(self, |c| admin::dead_letter_skip(c, &params, &self.channel))
    }

    async fn dead_letter_purge(&self, params: DeadLetterPurgeParams) -> StoreResult<u64> {
        params.validate()?;
        in_tx!(self, |c| admin::dead_letter_purge(c, &params))
    }

    async fn queue_pause(&self, params: QueuePauseParams) -> StoreResult<()> {
        params.validate()?;
        in_tx!(self, |c| admin::queue_pause(c, &params, &self.channel))
    }

    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>> {
        let conn = self.client().await?;
        admin::queue_list(&conn, &namespace).await.map_err(StoreError::from)
    }

    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>> {
        let conn = self.client().await?;
        timer::queue_stats(&conn, namespace.as_deref(), now).await.map_err(StoreError::from)
    }

    async fn instance_activity(&self, params: ActivityParams) -> StoreResult<Vec<ActivityBucket>> {
        params.validate()?;
        let conn = self.client().await?;
        operate::activity(&conn, &params).await.map_err(StoreError::from)
    }

    async fn worker_heartbeat(&self, params: WorkerBeatParams) -> StoreResult<()> {
        params.validate()?;
        let conn = self.client().await?;
        operate::heartbeat(&conn, &params).await.map_err(StoreError::from)
    }

    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<WorkerRecord>> {
        let conn = self.client().await?;
        operate::workers(&conn, seen_since).await.map_err(StoreError::from)
    }

    async fn schedule_pause(
        &self,
        params: keel_core::ports::store::SchedulePauseParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        params.validate()?;
        in_tx!(self, |c| schedule::pause(c, &params))
    }

    async fn schedule_states(
        &self,
        namespace: String,
    ) -> StoreResult<Vec<keel_core::ports::store::ScheduleState>> {
        let conn = self.client().await?;
        schedule::states(&conn, &namespace).await.map_err(StoreError::from)
    }

    async fn schedule_fired(
        &self,
        params: keel_core::ports::store::ScheduleFiredParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        params.validate()?;
        in_tx!(self, |c| schedule::fired(c, &params))
    }

    async fn schedule_forget(
        &self,
        params: keel_core::ports::store::ScheduleForgetParams,
    ) -> StoreResult<u64> {
        params.validate()?;
        in_tx!(self, |c| schedule::forget(c, &params))
    }

    async fn timer_sweep(&self, params: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        params.validate()?;
        in_tx!(self, |c| timer::sweep(c, &params, &self.channel))
    }

    async fn timers_retime(&self, params: TimerRetimeParams) -> StoreResult<TimerRetimePage> {
        params.validate()?;
        in_tx!(self, |c| timer::retime(c, &params, &self.channel))
    }

    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        let conn = self.client().await?;
        timer::status(&conn, namespace.as_deref(), now).await.map_err(StoreError::from)
    }

    async fn ready_wait(&self) {
        self.wait_ready().await;
    }

    async fn timer_next_due(&self, params: TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        let conn = self.client().await?;
        timer::next_due(&conn, &params).await.map_err(StoreError::from)
    }

    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        self.wait_timer_hint(seen).await
    }
}

#[cfg(test)]
mod tests {
    use super::{claim, lost_key_race};
    use crate::error::OpError;
    use keel_core::ErrorKind;

    /// A claim that keeps losing the race for a key gives up with a retryable error that
    /// says so, not with the unique violation's `Conflict`.
    #[tokio::test]
    async fn a_claim_that_keeps_losing_a_key_race_is_retryable() {
        let Some(s) = crate::testing::fresh_schema().await else {
            let var = keel_testkit::conformance::REQUIRE_BACKENDS_VAR;
            assert!(std::env::var(var).as_deref() != Ok("1"), "{var}=1 but no database is set");
            return;
        };
        let c = s.client().await.expect("a connection");
        // The same failure a lost race meets: a unique violation on an index of that name
        // (here on a session's own table, so the store's tables are left alone).
        let race = c
            .batch_execute(
                "CREATE TEMP TABLE race (k int); \
                 CREATE UNIQUE INDEX instances_concurrency ON race (k); \
                 INSERT INTO race VALUES (1), (1)",
            )
            .await
            .expect_err("a duplicate key is refused");
        let race = OpError::Pg(race);
        assert!(claim::is_key_race(&race), "{race:?}");
        let attempts = crate::TRANSACTION_RETRIES + 1;
        let e = lost_key_race(attempts, race);
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(e.message.contains("lost the race"), "{e}");
        assert!(e.message.contains(&format!("{attempts} times")), "{e}");
        assert!(e.message.contains("retry"), "{e}");
    }
}
