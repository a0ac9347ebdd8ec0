//! A store that notes when each operation was called and misbehaves on the few calls a
//! test tells it to; everything else goes to the store inside.

use async_trait::async_trait;
use keel_core::instance::{DeadLetter, Instance, SignalTarget};
use keel_core::ports::Store;
use keel_core::ports::store as s;
use keel_core::timers::TimerHint;
use keel_core::{DeadLetterId, InstanceId, StoreError, StoreResult, Timestamp};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What a [`Hooked`] store does besides passing calls on.
#[derive(Debug, Default, Clone)]
pub struct Hooks {
    /// `timers_retime` of these machines (by name) is refused as invalid.
    pub refuse_retime: Vec<String>,
    /// Every `step_commit` fails as unavailable.
    pub commits_unavailable: bool,
    /// How long each `step_commit` waits before the store inside commits it.
    pub commit_delay: Duration,
    /// `dead_letter_purge` answers a full batch after this pause, purging nothing.
    pub purge_full_after: Option<Duration>,
    /// The first this many rows `instance_claim` hands out name a machine (`foreign` v1)
    /// that no test worker runs; the rows in the store keep their own.
    pub foreign_claims: usize,
    /// `instance_claim` of these queues fails as unavailable.
    pub claims_unavailable_in: Vec<String>,
    /// `instance_claim_ids` fails as unavailable.
    pub claim_ids_unavailable: bool,
    /// The first this many `lease_release` calls fail as unavailable.
    pub releases_failing: usize,
}

/// A store wrapper that records the time of every call per operation and applies its
/// [`Hooks`].
pub struct Hooked<S> {
    pub inner: S,
    pub hooks: Hooks,
    calls: Mutex<HashMap<&'static str, Vec<Instant>>>,
    /// Rows handed out as `foreign` so far.
    foreign: AtomicUsize,
}

impl<S: Store> Hooked<S> {
    pub fn new(inner: S, hooks: Hooks) -> Self {
        Hooked { inner, hooks, calls: Mutex::default(), foreign: AtomicUsize::new(0) }
    }

    /// How many times `op` was called.
    pub fn calls(&self, op: &str) -> usize {
        self.calls.lock().unwrap().get(op).map_or(0, Vec::len)
    }

    /// When each call of `op` came, in order.
    pub fn call_times(&self, op: &str) -> Vec<Instant> {
        self.calls.lock().unwrap().get(op).cloned().unwrap_or_default()
    }

    fn note(&self, op: &'static str) {
        self.calls.lock().unwrap().entry(op).or_default().push(Instant::now());
    }
}

#[async_trait]
impl<S: Store> Store for Hooked<S> {
    fn capabilities(&self) -> s::StoreCapabilities {
        self.inner.capabilities()
    }
    async fn instance_insert(&self, p: s::InsertParams) -> StoreResult<Vec<s::InsertOutcome>> {
        self.note("instance_insert");
        self.inner.instance_insert(p).await
    }
    async fn instance_claim(&self, p: s::ClaimParams) -> StoreResult<Vec<s::Claim>> {
        self.note("instance_claim");
        if p.queues.iter().any(|q| self.hooks.claims_unavailable_in.contains(q)) {
            return Err(StoreError::unavailable(format!(
                "injected instance_claim failure for {:?}",
                p.queues
            )));
        }
        let mut claims = self.inner.instance_claim(p).await?;
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
        self.note("instance_claim_ids");
        if self.hooks.claim_ids_unavailable {
            return Err(StoreError::unavailable("injected instance_claim_ids failure"));
        }
        self.inner.instance_claim_ids(ids, p).await
    }
    async fn instance_ready_stale(&self, p: s::ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        self.inner.instance_ready_stale(p).await
    }
    async fn step_commit(
        &self,
        p: s::CommitParams,
    ) -> StoreResult<Vec<StoreResult<s::CommitReceipt>>> {
        self.note("step_commit");
        if self.hooks.commits_unavailable {
            return Err(StoreError::unavailable("injected step_commit failure"));
        }
        tokio::time::sleep(self.hooks.commit_delay).await;
        self.inner.step_commit(p).await
    }
    async fn lease_extend(&self, p: s::LeaseExtendParams) -> StoreResult<Vec<bool>> {
        self.note("lease_extend");
        self.inner.lease_extend(p).await
    }
    async fn lease_reap(&self, p: s::LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        self.note(if p.owner.is_some() { "lease_reap_owner" } else { "lease_reap" });
        self.inner.lease_reap(p).await
    }
    async fn lease_release(&self, p: s::LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        self.note("lease_release");
        if self.calls("lease_release") <= self.hooks.releases_failing {
            return Err(StoreError::unavailable("injected lease_release failure"));
        }
        self.inner.lease_release(p).await
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
        self.note("dead_letter_purge");
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
        self.inner.queue_stats(namespace, now).await
    }
    async fn schedule_pause(&self, p: s::SchedulePauseParams) -> StoreResult<s::ScheduleState> {
        self.inner.schedule_pause(p).await
    }
    async fn schedule_states(&self, namespace: String) -> StoreResult<Vec<s::ScheduleState>> {
        self.inner.schedule_states(namespace).await
    }
    async fn timer_sweep(&self, p: s::TimerSweepParams) -> StoreResult<s::TimerSweepReport> {
        self.inner.timer_sweep(p).await
    }
    async fn timers_retime(&self, p: s::TimerRetimeParams) -> StoreResult<s::TimerRetimePage> {
        self.note("timers_retime");
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
        self.inner.worker_heartbeat(p).await
    }
    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<s::WorkerRecord>> {
        self.inner.worker_list(seen_since).await
    }
    async fn instance_prune(&self, p: s::PruneParams) -> StoreResult<s::PrunePage> {
        self.inner.instance_prune(p).await
    }
    async fn history_page(&self, p: s::HistoryPageParams) -> StoreResult<s::HistoryPage> {
        self.inner.history_page(p).await
    }
    async fn history_trim(&self, p: s::HistoryTrimParams) -> StoreResult<s::HistoryTrimPage> {
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
