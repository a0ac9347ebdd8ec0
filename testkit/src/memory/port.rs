//! `MemoryStore`'s side of the `Store` port: each method takes the lock, runs the
//! operation on the state and wakes waiters. No decisions are made here.

use super::{
    ActivityBucket, ActivityParams, BroadcastReport, CancelParams, Claim, ClaimParams,
    CommitParams, CommitPlanner, CommitReceipt, DeadLetter, DeadLetterFilter, DeadLetterId,
    DeadLetterPurgeParams, DeadLetterRetryParams, DeadLetterSkipParams, DeliveryOutcome,
    HistoryPage, HistoryPageParams, HistoryTrimPage, HistoryTrimParams, InsertOutcome,
    InsertParams, Instance, InstanceDetail, InstanceId, InstanceListParams, LeaseExtendParams,
    LeaseReapParams, LeaseReleaseParams, MemoryStore, MigratePage, MigrateParams, PoisonError,
    PrunePage, PruneParams, QueuePauseParams, QueueState, QueueStats, ReadyStaleParams,
    SchedulePauseParams, ScheduleState, SignalBroadcastParams, SignalDeliverParams, SignalTarget,
    Store, StoreCapabilities, StoreResult, TimerHint, TimerNextDueParams, TimerRetimePage,
    TimerRetimeParams, TimerStatus, TimerSweepParams, TimerSweepReport, Timestamp,
    WorkerBeatParams, WorkerRecord, async_trait, commit,
};
use keel_core::ports::store::{ScheduleFiredParams, ScheduleForgetParams};

#[async_trait]
impl Store for MemoryStore {
    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities { notifications: true }
    }

    async fn instance_insert(&self, params: InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        let result = self.state().insert(&params);
        self.wake(result)
    }

    async fn instance_claim(&self, params: ClaimParams) -> StoreResult<Vec<Claim>> {
        self.state().claim(&params)
    }

    async fn instance_claim_ids(
        &self,
        ids: Vec<InstanceId>,
        params: ClaimParams,
    ) -> StoreResult<Vec<Claim>> {
        let only = ids.into_iter().collect();
        self.state().claim_among(&params, Some(&only))
    }

    async fn instance_ready_stale(&self, params: ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        self.state().ready_stale(&params)
    }

    async fn step_commit(
        &self,
        params: CommitParams,
    ) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
        params.validate()?;
        let receipts: Vec<StoreResult<CommitReceipt>> = {
            let mut state = self.state();
            let mut planner = CommitPlanner::new(params.now);
            params.commits.iter().map(|c| state.commit(&mut planner, c, params.now)).collect()
        };
        self.hint_timers(commit::armed_due(&params.commits, &receipts, params.now));
        self.wake(Ok(receipts))
    }

    async fn lease_extend(&self, params: LeaseExtendParams) -> StoreResult<Vec<bool>> {
        params.validate()?;
        Ok(self.state().lease_extend(&params))
    }

    async fn lease_reap(&self, params: LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        let result = self.state().lease_reap(&params);
        self.wake(result)
    }

    async fn instance_migrate(&self, params: MigrateParams) -> StoreResult<MigratePage> {
        params.validate()?;
        let page = self.state().migrate(&params);
        self.hint_timers(Some(params.now));
        self.wake(Ok(page))
    }

    async fn instance_prune(&self, params: PruneParams) -> StoreResult<PrunePage> {
        params.validate()?;
        let page = self.state().prune(&params);
        Ok(page)
    }

    async fn history_page(&self, params: HistoryPageParams) -> StoreResult<HistoryPage> {
        self.state().history_page(&params)
    }

    async fn history_trim(&self, params: HistoryTrimParams) -> StoreResult<HistoryTrimPage> {
        params.validate()?;
        Ok(self.state().history_trim(&params))
    }

    async fn lease_release(&self, params: LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        params.validate()?;
        let result = self.state().lease_release(&params);
        self.wake(Ok(result))
    }

    async fn signal_deliver(
        &self,
        params: SignalDeliverParams,
    ) -> StoreResult<Vec<DeliveryOutcome>> {
        let result = self.state().signal_deliver(&params);
        self.wake(result)
    }

    async fn signal_broadcast(
        &self,
        params: SignalBroadcastParams,
    ) -> StoreResult<BroadcastReport> {
        let result = self.state().signal_broadcast(&params);
        self.wake(result)
    }

    async fn instance_cancel(&self, params: CancelParams) -> StoreResult<Vec<InstanceId>> {
        let result = self.state().cancel(&params);
        self.wake(result)
    }

    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        self.state().detail(id)
    }

    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        self.state().rows_of(&ids)
    }

    async fn instance_list(&self, params: InstanceListParams) -> StoreResult<Vec<Instance>> {
        self.state().list(&params)
    }

    async fn instance_lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>> {
        Ok(self.state().resolve(&target))
    }

    async fn dead_letter_list(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        filter.validate()?;
        let limit = filter.page_size();
        let state = self.state();
        let matching = state.dead_letters.values().filter(|d| filter.matches(d));
        if filter.before.is_some() {
            // The page just below the cursor: the nearest `limit`, listed oldest first.
            let mut page: Vec<DeadLetter> = matching.rev().take(limit).cloned().collect();
            page.reverse();
            return Ok(page);
        }
        Ok(matching.take(limit).cloned().collect())
    }

    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter> {
        self.state().dead_letter(id).cloned()
    }

    async fn dead_letter_retry(
        &self,
        params: DeadLetterRetryParams,
    ) -> StoreResult<Vec<InstanceId>> {
        let result = self.state().dead_letter_retry(&params);
        self.wake(result)
    }

    async fn dead_letter_skip(&self, params: DeadLetterSkipParams) -> StoreResult<InstanceId> {
        let result = self.state().dead_letter_skip(&params);
        self.wake(result)
    }

    async fn dead_letter_purge(&self, params: DeadLetterPurgeParams) -> StoreResult<u64> {
        self.state().dead_letter_purge(&params)
    }

    async fn queue_pause(&self, params: QueuePauseParams) -> StoreResult<()> {
        params.validate()?;
        let mut state = self.state();
        if params.paused {
            state.queues.insert((params.namespace, params.queue), true);
        } else if let Some(paused) = state.queues.get_mut(&(params.namespace, params.queue)) {
            // A resume changes a recorded queue only; it records none.
            *paused = false;
        }
        drop(state);
        self.wake(Ok(()))
    }

    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>> {
        Ok(self.state().queue_stats(namespace.as_deref(), now))
    }

    async fn timer_sweep(&self, params: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        let result = self.state().timer_sweep(&params);
        self.wake(result)
    }

    async fn timers_retime(&self, params: TimerRetimeParams) -> StoreResult<TimerRetimePage> {
        let (page, earliest) = self.state().timers_retime(&params)?;
        // A moved timer may now be due before what the sweepers sleep until.
        self.hint_timers(earliest);
        Ok(page)
    }

    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        Ok(self.state().timer_status(namespace.as_deref(), now))
    }

    async fn instance_activity(&self, params: ActivityParams) -> StoreResult<Vec<ActivityBucket>> {
        self.state().instance_activity(&params)
    }

    async fn worker_heartbeat(&self, params: WorkerBeatParams) -> StoreResult<()> {
        self.state().worker_heartbeat(&params)
    }

    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<WorkerRecord>> {
        Ok(self.state().worker_list(seen_since))
    }

    async fn schedule_pause(&self, params: SchedulePauseParams) -> StoreResult<ScheduleState> {
        self.state().schedule_pause(&params)
    }

    async fn schedule_states(&self, namespace: String) -> StoreResult<Vec<ScheduleState>> {
        Ok(self.state().schedule_states(&namespace))
    }

    async fn schedule_fired(&self, params: ScheduleFiredParams) -> StoreResult<ScheduleState> {
        self.state().schedule_fired(&params)
    }

    async fn schedule_forget(&self, params: ScheduleForgetParams) -> StoreResult<u64> {
        self.state().schedule_forget(&params)
    }

    async fn ready_wait(&self) {
        self.ready.notified().await;
    }

    async fn instance_change_wait(&self) {
        self.changed.notified().await;
    }

    async fn timer_next_due(&self, params: TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        Ok(self.state().timer_next_due(&params))
    }

    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        loop {
            // Registered before the log is read, so a hint pushed in between still wakes us.
            let notified = self.hinted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let news = self.hints.lock().unwrap_or_else(PoisonError::into_inner).since(seen);
            if let Some(hint) = news {
                return hint;
            }
            notified.await;
        }
    }

    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>> {
        // The queues with settings only, in name order (the map's order).
        let state = self.state();
        Ok(state
            .queues
            .iter()
            .filter(|((ns, _), _)| *ns == namespace)
            .map(|((_, queue), paused)| QueueState {
                namespace: namespace.clone(),
                queue: queue.clone(),
                paused: *paused,
            })
            .collect())
    }
}
