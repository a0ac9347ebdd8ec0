//! The type-erased store: one concrete type for every backend, so the client, the worker
//! and user code name no store type and carry no generic parameter.

use async_trait::async_trait;
use keel_core::instance::DeadLetter;
use keel_core::ports::Store;
use keel_core::ports::store::{
    ActivityBucket, ActivityParams, BroadcastReport, CancelParams, Claim, ClaimParams,
    CommitParams, CommitReceipt, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSkipParams, DeliveryOutcome, HistoryPage, HistoryPageParams, HistoryTrimPage,
    HistoryTrimParams, InsertOutcome, InsertParams, InstanceDetail, InstanceListParams,
    LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, MigratePage, MigrateParams, PrunePage,
    PruneParams, QueuePauseParams, QueueState, QueueStats, ReadyStaleParams, SignalBroadcastParams,
    SignalDeliverParams, StoreCapabilities, TimerNextDueParams, TimerStatus, TimerSweepParams,
    TimerSweepReport, WorkerBeatParams, WorkerRecord,
};
use keel_core::timers::TimerHint;
use keel_core::{DeadLetterId, Instance, InstanceId, SignalTarget, StoreResult, Timestamp};
use std::sync::Arc;

/// Any [`Store`] behind one type. Cloning shares the store.
///
/// Every method forwards to the wrapped store, the provided ones (wake-ups, the
/// earliest due timer) included, so a backend's own overrides stay in effect.
#[derive(Clone)]
pub struct AnyStore(Arc<dyn Store>);

impl AnyStore {
    /// Wraps `store`.
    pub fn new(store: impl Store) -> Self {
        AnyStore(Arc::new(store))
    }

    /// Wraps a store that is already shared.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        AnyStore(store)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.0
    }
}

impl std::fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyStore").field("capabilities", &self.0.capabilities()).finish()
    }
}

#[async_trait]
impl Store for AnyStore {
    fn capabilities(&self) -> StoreCapabilities {
        self.0.capabilities()
    }

    async fn instance_insert(&self, params: InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        self.0.instance_insert(params).await
    }

    async fn instance_claim(&self, params: ClaimParams) -> StoreResult<Vec<Claim>> {
        self.0.instance_claim(params).await
    }

    async fn instance_claim_ids(
        &self,
        ids: Vec<InstanceId>,
        params: ClaimParams,
    ) -> StoreResult<Vec<Claim>> {
        self.0.instance_claim_ids(ids, params).await
    }

    async fn instance_ready_stale(&self, params: ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        self.0.instance_ready_stale(params).await
    }

    async fn step_commit(
        &self,
        params: CommitParams,
    ) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
        self.0.step_commit(params).await
    }

    async fn lease_extend(&self, params: LeaseExtendParams) -> StoreResult<Vec<bool>> {
        self.0.lease_extend(params).await
    }

    async fn lease_reap(&self, params: LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        self.0.lease_reap(params).await
    }

    async fn lease_release(&self, params: LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        self.0.lease_release(params).await
    }

    async fn signal_deliver(
        &self,
        params: SignalDeliverParams,
    ) -> StoreResult<Vec<DeliveryOutcome>> {
        self.0.signal_deliver(params).await
    }

    async fn signal_broadcast(
        &self,
        params: SignalBroadcastParams,
    ) -> StoreResult<BroadcastReport> {
        self.0.signal_broadcast(params).await
    }

    async fn instance_cancel(&self, params: CancelParams) -> StoreResult<Vec<InstanceId>> {
        self.0.instance_cancel(params).await
    }

    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        self.0.instance_get(id).await
    }

    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        self.0.instance_rows(ids).await
    }

    async fn instance_list(&self, params: InstanceListParams) -> StoreResult<Vec<Instance>> {
        self.0.instance_list(params).await
    }

    async fn instance_lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>> {
        self.0.instance_lookup(target).await
    }

    async fn dead_letter_list(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        self.0.dead_letter_list(filter).await
    }

    async fn dead_letter_counts(
        &self,
        namespace: Option<String>,
    ) -> StoreResult<Vec<keel_core::ports::store::DeadLetterCount>> {
        self.0.dead_letter_counts(namespace).await
    }

    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        self.0.dead_letter_get(id).await
    }

    async fn dead_letter_retry(
        &self,
        params: DeadLetterRetryParams,
    ) -> StoreResult<Vec<InstanceId>> {
        self.0.dead_letter_retry(params).await
    }

    async fn dead_letter_skip(&self, params: DeadLetterSkipParams) -> StoreResult<InstanceId> {
        self.0.dead_letter_skip(params).await
    }

    async fn dead_letter_purge(&self, params: DeadLetterPurgeParams) -> StoreResult<u64> {
        self.0.dead_letter_purge(params).await
    }

    async fn queue_pause(&self, params: QueuePauseParams) -> StoreResult<()> {
        self.0.queue_pause(params).await
    }

    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>> {
        self.0.queue_list(namespace).await
    }

    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>> {
        self.0.queue_stats(namespace, now).await
    }

    async fn timer_sweep(&self, params: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        self.0.timer_sweep(params).await
    }

    async fn timers_retime(
        &self,
        params: keel_core::ports::store::TimerRetimeParams,
    ) -> StoreResult<keel_core::ports::store::TimerRetimePage> {
        self.0.timers_retime(params).await
    }

    async fn timer_next_due(&self, params: TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        self.0.timer_next_due(params).await
    }

    async fn instance_migrate(&self, params: MigrateParams) -> StoreResult<MigratePage> {
        self.0.instance_migrate(params).await
    }

    async fn instance_prune(&self, params: PruneParams) -> StoreResult<PrunePage> {
        self.0.instance_prune(params).await
    }

    async fn history_page(&self, params: HistoryPageParams) -> StoreResult<HistoryPage> {
        self.0.history_page(params).await
    }

    async fn history_trim(&self, params: HistoryTrimParams) -> StoreResult<HistoryTrimPage> {
        self.0.history_trim(params).await
    }

    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        self.0.timer_status(namespace, now).await
    }

    async fn instance_activity(&self, params: ActivityParams) -> StoreResult<Vec<ActivityBucket>> {
        self.0.instance_activity(params).await
    }

    async fn worker_heartbeat(&self, params: WorkerBeatParams) -> StoreResult<()> {
        self.0.worker_heartbeat(params).await
    }

    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<WorkerRecord>> {
        self.0.worker_list(seen_since).await
    }

    async fn schedule_pause(
        &self,
        params: keel_core::ports::store::SchedulePauseParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        self.0.schedule_pause(params).await
    }

    async fn schedule_states(
        &self,
        namespace: String,
    ) -> StoreResult<Vec<keel_core::ports::store::ScheduleState>> {
        self.0.schedule_states(namespace).await
    }

    async fn schedule_fired(
        &self,
        params: keel_core::ports::store::ScheduleFiredParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        self.0.schedule_fired(params).await
    }

    async fn schedule_forget(
        &self,
        params: keel_core::ports::store::ScheduleForgetParams,
    ) -> StoreResult<u64> {
        self.0.schedule_forget(params).await
    }

    async fn ready_wait(&self) {
        self.0.ready_wait().await;
    }

    async fn instance_change_wait(&self) {
        self.0.instance_change_wait().await;
    }

    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        self.0.timer_hint_wait(seen).await
    }
}
