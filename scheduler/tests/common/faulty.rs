//! A store wrapper for the worker's tests: it notes when each operation was called,
//! measures the commits and leases the worker has under way, and misbehaves on the calls
//! a test tells it to (failing, refusing or panicking on the next calls of an operation,
//! delaying commits and heartbeats, or the few behaviours [`Hooks`] name); everything
//! else goes to the store inside.

use async_trait::async_trait;
use keel_core::instance::{DeadLetter, Instance, SignalTarget};
use keel_core::ports::Store;
use keel_core::ports::store as s;
use keel_core::timers::TimerHint;
use keel_core::{DeadLetterId, InstanceId, StoreError, StoreResult, Timestamp};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What a [`Faulty`] store does on one call of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fail with `Unavailable`.
    Error,
    /// Refuse with `Invalid`, as a store refuses a request it will never take.
    Refuse,
    /// Panic, as a store decoder meeting a row it cannot read once did.
    Panic,
    /// Go through, so that a later call is the one that fails.
    Pass,
}

/// Behaviours of a [`Faulty`] store that depend on what a call asks for, or hold for
/// every call.
#[derive(Debug, Default, Clone)]
pub struct Hooks {
    /// `timers_retime` of these machines (by name) is refused as invalid.
    pub refuse_retime: Vec<String>,
    /// Every `step_commit` fails as unavailable.
    pub commits_unavailable: bool,
    /// `dead_letter_purge` answers a full batch after this pause, purging nothing.
    pub purge_full_after: Option<Duration>,
    /// The first this many rows `instance_claim` hands out name a machine (`foreign` v1)
    /// that no test worker runs; the rows in the store keep their own.
    pub foreign_claims: usize,
    /// `instance_claim` of these queues fails as unavailable.
    pub claims_unavailable_in: Vec<String>,
    /// `instance_claim_ids` fails as unavailable.
    pub claim_ids_unavailable: bool,
    /// `instance_ready_stale` answers after this pause, and a page it finds anything on
    /// comes back full (its first row over and over), as on a huge backlog.
    pub ready_stale_full_after: Option<Duration>,
}

/// The store wrapper. A reap is noted as `lease_reap_owner` when it names an owner (a
/// start-up reclaim), else `lease_reap`.
pub struct Faulty<S> {
    pub inner: S,
    pub hooks: Hooks,
    /// How long each `lease_extend` takes on top of the store's own time.
    pub extend_delay: Duration,
    /// How long each `step_commit` takes on top of the store's own time.
    pub commit_delay: Duration,
    /// How long each `step_commit` takes to return after the store committed it.
    pub settle_delay: Duration,
    /// `step_commit` calls under way now, and the most seen at once.
    pub commits: Mutex<(usize, usize)>,
    /// Leases handed out by `instance_claim` whose results have not committed yet, and
    /// the most seen at once.
    pub leases: Mutex<(usize, usize)>,
    /// The most steps one `instance_claim` handed out.
    pub largest_claim: Mutex<usize>,
    /// How many results each `step_commit` carried, in the order the calls came.
    pub groups: Mutex<Vec<usize>>,
    /// When each `step_commit` returned, in the order the calls returned.
    pub commit_ends: Mutex<Vec<Instant>>,
    /// The faults still due, per operation (see [`Faulty::failing`]).
    pub faults: Mutex<HashMap<&'static str, VecDeque<Fault>>>,
    /// When each operation was called (see [`Faulty::calls`]).
    pub calls: Mutex<HashMap<&'static str, Vec<Instant>>>,
    /// Rows handed out as `foreign` so far.
    pub foreign: AtomicUsize,
    /// While set, every call fails as unavailable (after it is noted): an outage.
    pub down: AtomicBool,
}

impl<S: Store> Faulty<S> {
    pub fn new(inner: S) -> Self {
        Faulty::hooked(inner, Hooks::default())
    }

    /// A store with `hooks`.
    pub fn hooked(inner: S, hooks: Hooks) -> Self {
        Faulty {
            inner,
            hooks,
            extend_delay: Duration::ZERO,
            commit_delay: Duration::ZERO,
            settle_delay: Duration::ZERO,
            commits: Mutex::default(),
            leases: Mutex::default(),
            largest_claim: Mutex::default(),
            groups: Mutex::default(),
            commit_ends: Mutex::default(),
            faults: Mutex::default(),
            calls: Mutex::default(),
            foreign: AtomicUsize::new(0),
            down: AtomicBool::new(false),
        }
    }

    /// The next calls of `op` do `faults`, in order; later calls go through.
    pub fn failing(self, op: &'static str, faults: &[Fault]) -> Self {
        self.faults.lock().unwrap().entry(op).or_default().extend(faults);
        self
    }

    /// How many times `op` was called.
    pub fn calls(&self, op: &str) -> usize {
        self.calls.lock().unwrap().get(op).map_or(0, Vec::len)
    }

    /// When each call of `op` came, in order.
    pub fn call_times(&self, op: &str) -> Vec<Instant> {
        self.calls.lock().unwrap().get(op).cloned().unwrap_or_default()
    }

    /// Notes the call, then does its fault, if one is due.
    fn gate(&self, op: &'static str) -> StoreResult<()> {
        // Read before the call is noted: a test that sees the call noted during an outage
        // knows the call failed, even if it ends the outage at once.
        let down = self.down.load(Ordering::SeqCst);
        self.calls.lock().unwrap().entry(op).or_default().push(Instant::now());
        if down {
            return Err(StoreError::unavailable(format!("injected outage: {op}")));
        }
        let fault = self.faults.lock().unwrap().get_mut(op).and_then(VecDeque::pop_front);
        match fault {
            None | Some(Fault::Pass) => Ok(()),
            Some(Fault::Error) => Err(StoreError::unavailable(format!("injected {op} failure"))),
            Some(Fault::Refuse) => Err(StoreError::invalid(format!("injected {op} refusal"))),
            Some(Fault::Panic) => panic!("injected {op} panic"),
        }
    }
}

#[async_trait]
impl<S: Store> Store for Faulty<S> {
    fn capabilities(&self) -> s::StoreCapabilities {
        self.inner.capabilities()
    }
    async fn instance_insert(&self, p: s::InsertParams) -> StoreResult<Vec<s::InsertOutcome>> {
        self.gate("instance_insert")?;
        self.inner.instance_insert(p).await
    }
    async fn instance_claim(&self, p: s::ClaimParams) -> StoreResult<Vec<s::Claim>> {
        self.gate("instance_claim")?;
        if p.queues.iter().any(|q| self.hooks.claims_unavailable_in.contains(q)) {
            return Err(StoreError::unavailable(format!(
                "injected instance_claim failure for {:?}",
                p.queues
            )));
        }
        let mut claims = self.inner.instance_claim(p).await?;
        {
            let mut leases = self.leases.lock().unwrap();
            leases.0 += claims.len();
            leases.1 = leases.1.max(leases.0);
            let mut largest = self.largest_claim.lock().unwrap();
            *largest = (*largest).max(claims.len());
        }
        for claim in &mut claims {
            if self.foreign.fetch_add(1, Ordering::SeqCst) < self.hooks.foreign_claims {
                claim.instance.machine = keel_core::MachineRef::new("foreign", 1);
            }
        }
        Ok(claims)
    }
    async fn instance_claim_ids(
        &self,
        ids: Vec<InstanceId>,
        p: s::ClaimParams,
    ) -> StoreResult<Vec<s::Claim>> {
        self.gate("instance_claim_ids")?;
        if self.hooks.claim_ids_unavailable {
            return Err(StoreError::unavailable("injected instance_claim_ids failure"));
        }
        self.inner.instance_claim_ids(ids, p).await
    }
    async fn instance_ready_stale(&self, p: s::ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        let Some(pause) = self.hooks.ready_stale_full_after else {
            return self.inner.instance_ready_stale(p).await;
        };
        self.calls.lock().unwrap().entry("instance_ready_stale").or_default().push(Instant::now());
        tokio::time::sleep(pause).await;
        // From the start each time: the page is the same rows again.
        let limit = p.limit;
        let mut rows =
            self.inner.instance_ready_stale(s::ReadyStaleParams { after: None, ..p }).await?;
        if let Some(first) = rows.first().cloned() {
            rows.resize(limit, first);
        }
        Ok(rows)
    }
    async fn step_commit(
        &self,
        p: s::CommitParams,
    ) -> StoreResult<Vec<StoreResult<s::CommitReceipt>>> {
        self.gate("step_commit")?;
        if self.hooks.commits_unavailable {
            return Err(StoreError::unavailable("injected step_commit failure"));
        }
        {
            let mut commits = self.commits.lock().unwrap();
            commits.0 += 1;
            commits.1 = commits.1.max(commits.0);
        }
        let items = p.commits.len();
        self.groups.lock().unwrap().push(items);
        tokio::time::sleep(self.commit_delay).await;
        let result = self.inner.step_commit(p).await;
        tokio::time::sleep(self.settle_delay).await;
        self.commit_ends.lock().unwrap().push(Instant::now());
        self.commits.lock().unwrap().0 -= 1;
        if result.is_ok() {
            let mut leases = self.leases.lock().unwrap();
            leases.0 = leases.0.saturating_sub(items);
        }
        result
    }
    async fn lease_extend(&self, p: s::LeaseExtendParams) -> StoreResult<Vec<bool>> {
        self.gate("lease_extend")?;
        tokio::time::sleep(self.extend_delay).await;
        self.inner.lease_extend(p).await
    }
    async fn lease_reap(&self, p: s::LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        self.gate(if p.owner.is_some() { "lease_reap_owner" } else { "lease_reap" })?;
        self.inner.lease_reap(p).await
    }
    async fn lease_release(&self, p: s::LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        self.gate("lease_release")?;
        let released = self.inner.lease_release(p).await?;
        let mut leases = self.leases.lock().unwrap();
        leases.0 = leases.0.saturating_sub(released.iter().filter(|r| **r).count());
        Ok(released)
    }
    async fn signal_deliver(
        &self,
        p: s::SignalDeliverParams,
    ) -> StoreResult<Vec<s::DeliveryOutcome>> {
        self.inner.signal_deliver(p).await
    }
    async fn signal_broadcast(
        &self,
        p: s::SignalBroadcastParams,
    ) -> StoreResult<s::BroadcastReport> {
        self.inner.signal_broadcast(p).await
    }
    async fn instance_cancel(&self, p: s::CancelParams) -> StoreResult<Vec<InstanceId>> {
        self.inner.instance_cancel(p).await
    }
    async fn instance_get(&self, id: InstanceId) -> StoreResult<s::InstanceDetail> {
        self.inner.instance_get(id).await
    }
    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        self.inner.instance_rows(ids).await
    }
    async fn instance_list(&self, p: s::InstanceListParams) -> StoreResult<Vec<Instance>> {
        self.inner.instance_list(p).await
    }
    async fn instance_lookup(&self, t: SignalTarget) -> StoreResult<Option<InstanceId>> {
        self.inner.instance_lookup(t).await
    }
    async fn dead_letter_list(&self, f: s::DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        self.inner.dead_letter_list(f).await
    }
    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        self.inner.dead_letter_get(id).await
    }
    async fn dead_letter_retry(&self, p: s::DeadLetterRetryParams) -> StoreResult<Vec<InstanceId>> {
        self.inner.dead_letter_retry(p).await
    }
    async fn dead_letter_skip(&self, p: s::DeadLetterSkipParams) -> StoreResult<InstanceId> {
        self.inner.dead_letter_skip(p).await
    }
    async fn dead_letter_purge(&self, p: s::DeadLetterPurgeParams) -> StoreResult<u64> {
        self.gate("dead_letter_purge")?;
        if let Some(pause) = self.hooks.purge_full_after {
            tokio::time::sleep(pause).await;
            return Ok(keel_core::limits::DEAD_LETTER_BATCH_MAX as u64);
        }
        self.inner.dead_letter_purge(p).await
    }
    async fn dead_letter_counts(
        &self,
        namespace: Option<String>,
    ) -> StoreResult<Vec<s::DeadLetterCount>> {
        self.inner.dead_letter_counts(namespace).await
    }
    async fn queue_pause(&self, p: s::QueuePauseParams) -> StoreResult<()> {
        self.inner.queue_pause(p).await
    }
    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<s::QueueState>> {
        self.inner.queue_list(namespace).await
    }
    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<s::QueueStats>> {
        self.gate("queue_stats")?;
        self.inner.queue_stats(namespace, now).await
    }
    async fn schedule_pause(&self, p: s::SchedulePauseParams) -> StoreResult<s::ScheduleState> {
        self.inner.schedule_pause(p).await
    }
    async fn schedule_states(&self, namespace: String) -> StoreResult<Vec<s::ScheduleState>> {
        self.inner.schedule_states(namespace).await
    }
    async fn schedule_fired(&self, p: s::ScheduleFiredParams) -> StoreResult<s::ScheduleState> {
        self.gate("schedule_fired")?;
        self.inner.schedule_fired(p).await
    }
    async fn timer_sweep(&self, p: s::TimerSweepParams) -> StoreResult<s::TimerSweepReport> {
        self.gate("timer_sweep")?;
        self.inner.timer_sweep(p).await
    }
    async fn timers_retime(&self, p: s::TimerRetimeParams) -> StoreResult<s::TimerRetimePage> {
        self.gate("timers_retime")?;
        if self.hooks.refuse_retime.contains(&p.machine.name) {
            return Err(StoreError::invalid(format!(
                "injected timers_retime refusal for {}",
                p.machine.name
            )));
        }
        self.inner.timers_retime(p).await
    }
    async fn timer_next_due(&self, p: s::TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        self.inner.timer_next_due(p).await
    }
    async fn instance_migrate(&self, p: s::MigrateParams) -> StoreResult<s::MigratePage> {
        self.inner.instance_migrate(p).await
    }
    async fn instance_activity(&self, p: s::ActivityParams) -> StoreResult<Vec<s::ActivityBucket>> {
        self.inner.instance_activity(p).await
    }
    async fn worker_heartbeat(&self, p: s::WorkerBeatParams) -> StoreResult<()> {
        self.gate("worker_heartbeat")?;
        self.inner.worker_heartbeat(p).await
    }
    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<s::WorkerRecord>> {
        self.inner.worker_list(seen_since).await
    }
    async fn instance_prune(&self, p: s::PruneParams) -> StoreResult<s::PrunePage> {
        self.gate("instance_prune")?;
        self.inner.instance_prune(p).await
    }
    async fn history_page(&self, p: s::HistoryPageParams) -> StoreResult<s::HistoryPage> {
        self.inner.history_page(p).await
    }
    async fn history_trim(&self, p: s::HistoryTrimParams) -> StoreResult<s::HistoryTrimPage> {
        self.gate("history_trim")?;
        self.inner.history_trim(p).await
    }
    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<s::TimerStatus>> {
        self.inner.timer_status(namespace, now).await
    }
    async fn ready_wait(&self) {
        self.inner.ready_wait().await;
    }
    async fn instance_change_wait(&self) {
        self.inner.instance_change_wait().await;
    }
    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        self.inner.timer_hint_wait(seen).await
    }
}
