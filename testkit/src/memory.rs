//! [`MemoryStore`]: the in-memory implementation of the `Store` port.
//!
//! Every store operation is planned in [`keel_core::plan`]: a step commit by
//! [`keel_core::plan::commit`] (this file reads what the planner asks for, inserts the
//! children it admits and performs the writes of its plan), and inserts, deliveries,
//! broadcasts, leases, cancels, dead-letter actions and the timer sweep by the other
//! planners, and claims by [`keel_core::plan::claim`]. What is left here is the
//! collections, the indexes (`tables`), the reads (`read`), the port's locking (`port`) and
//! the order in which writes run inside one "transaction" (one lock hold), so it must stay
//! boring and obviously right.
//!
//! Decisions the trait leaves open, made here and held to by the suite:
//! - A claim skips a row whose unique key would come back into scope while another
//!   instance occupies it (the commit planner refuses such a commit with `Conflict`).
//!   Transitions the store drives on its own (reap, release, delivery, barrier release,
//!   dead-letter retry) never fail: with a scope that is not closed under them the first
//!   occupant keeps the key.
//! - A heartbeat succeeds while the row is still executing under the same token and owner,
//!   even if the lease time has passed but nobody reaped it yet (`plan::lease::extend`).

use async_trait::async_trait;
use keel_core::TimerId;
use keel_core::inbox;
use keel_core::instance::{
    ChildSummary, DeadLetter, HistoryEntry, HistoryRecord, check_batch, unique_guard,
};
use keel_core::limits;
use keel_core::plan::claim::{CandidateRead, ClaimPlanner};
use keel_core::plan::commit::{
    self, ChildInsert, CommitPlan, CommitPlanner, CommitRead, InboxRead, TimerPlan,
};
use keel_core::plan::history::TrimCandidate;
use keel_core::plan::parent::{FollowUp, FollowUps, NextFollowUp};
use keel_core::plan::prune::PruneCandidate;
use keel_core::plan::{
    self, RowWrite, cancel::CancelRead, deliver::DeliverRead, insert::InsertRead,
};
use keel_core::ports::Store;
use keel_core::ports::store::{
    ActivityBucket, ActivityParams, BroadcastReport, CancelParams, Claim, ClaimParams,
    CommitParams, CommitReceipt, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSelector, DeadLetterSkipParams, DeliveryOutcome, HistoryPage, HistoryPageParams,
    HistoryTrimPage, HistoryTrimParams, InsertOutcome, InsertParams, InstanceDetail,
    InstanceListParams, LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, MigratePage,
    MigrateParams, PrunePage, PruneParams, QueuePauseParams, QueueState, QueueStats,
    ReadyStaleParams, SchedulePauseParams, ScheduleState, SignalBroadcastParams,
    SignalDeliverParams, StoreCapabilities, TimerNextDueParams, TimerRetimePage, TimerRetimeParams,
    TimerStatus, TimerSweepParams, TimerSweepReport, WorkerBeatParams, WorkerRecord,
};
use keel_core::timers::{TimerHint, TimerHints, TimerRow};
use keel_core::{
    DeadLetterId, Instance, InstanceId, NewSignal, Priority, Signal, SignalId, SignalTarget,
    Status, StepCommit, StoreError, StoreResult, Timestamp,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The in-memory reference `Store`. Cheap to create; one per test.
///
/// ```
/// use keel_testkit::MemoryStore;
/// let store = MemoryStore::new();
/// # let _ = store;
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
    /// In-process "work may be ready" wake-ups for `ready_wait`.
    ready: tokio::sync::Notify,
    /// Timer hints for `timer_hint_wait`, and the wake-up of their readers.
    hints: Mutex<TimerHints>,
    hinted: tokio::sync::Notify,
    /// Wake-ups for `instance_change_wait` (every write may change a status).
    changed: tokio::sync::Notify,
}

impl MemoryStore {
    /// An empty store. Ids of instances, signals and dead letters start at 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// The lock is never held across an await, so a poisoned lock only means a test
    /// panicked while holding it; the data is still consistent enough to inspect.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes workers waiting in `ready_wait` (every current waiter, plus a stored permit
    /// for one that is about to wait, so a wake-up between its claim and its wait is not
    /// lost).
    fn wake<T>(&self, result: T) -> T {
        self.ready.notify_waiters();
        self.ready.notify_one();
        self.changed.notify_waiters();
        result
    }

    /// Tells the sweepers that a commit armed timers, the earliest due at `due`.
    fn hint_timers(&self, due: Option<Timestamp>) {
        if let Some(due) = due {
            self.hints.lock().unwrap_or_else(PoisonError::into_inner).push(due);
            self.hinted.notify_waiters();
        }
    }
}

/// Everything the store holds, plus the indexes a database would keep.
#[derive(Debug, Default)]
struct State {
    last_instance: i64,
    last_signal: i64,
    last_dead_letter: i64,
    last_history: i64,
    rows: BTreeMap<InstanceId, Instance>,
    /// Runnable rows in claim order.
    runnable: BTreeSet<(Priority, Timestamp, InstanceId)>,
    executing: BTreeSet<InstanceId>,
    /// Executing rows per concurrency key.
    executing_keys: HashMap<String, usize>,
    /// The unique guard index: key → the instance occupying it.
    guards: HashMap<Vec<u8>, InstanceId>,
    /// Rate-limit buckets by queue.
    buckets: HashMap<String, keel_core::plan::claim::Bucket>,
    /// Per-key rate-limit buckets by (queue, concurrency key).
    key_buckets: BTreeMap<(String, String), keel_core::plan::claim::Bucket>,
    /// Fair-claim rotation cursors by queue: the concurrency key served last.
    cursors: HashMap<String, String>,
    /// `(namespace, machine name, business key)` → the instances carrying it (the newest
    /// answers a lookup).
    business_keys: HashMap<(String, String, String), BTreeSet<InstanceId>>,
    children: HashMap<InstanceId, Vec<InstanceId>>,
    inbox: HashMap<InstanceId, BTreeMap<SignalId, Signal>>,
    dedup: HashMap<(InstanceId, String), SignalId>,
    history: HashMap<InstanceId, Vec<HistoryRecord>>,
    dead_letters: BTreeMap<DeadLetterId, DeadLetter>,
    /// `(namespace, queue)` → paused.
    queues: BTreeMap<(String, String), bool>,
    last_timer: i64,
    timers: BTreeMap<TimerId, TimerRow>,
    /// Timers per instance (an index, so commits do not scan every timer).
    timers_of: HashMap<InstanceId, BTreeSet<TimerId>>,
    /// `(namespace or "*", machine or "*")` → last sweep time.
    sweeps: HashMap<(String, String), Timestamp>,
    /// The worker registry: id → last heartbeat.
    workers: BTreeMap<String, WorkerRecord>,
    /// Stored schedule states (pauses, fired ticks) by `(namespace, name)`.
    schedules: BTreeMap<(String, String), ScheduleState>,
}

impl State {
    // ----- inserts ----------------------------------------------------------------------

    fn insert(&mut self, params: &InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        params.validate()?;
        let mut read = InsertRead::default();
        for key in plan::insert::keys(&params.instances) {
            if let Some(id) = self.guards.get(key) {
                read.occupants.insert(key.to_vec(), *id);
            }
        }
        let plan = plan::insert::insert(&params.instances, read);
        let mut ids = Vec::with_capacity(plan.inserts.len());
        for i in &plan.inserts {
            let id = InstanceId(self.last_instance + 1);
            self.insert_row(Instance::from_new(id, &params.instances[*i], None, params.now));
            ids.push(id);
        }
        Ok(plan.outcomes(&ids))
    }

    // ----- claims -----------------------------------------------------------------------

    fn claim(&mut self, p: &ClaimParams) -> StoreResult<Vec<Claim>> {
        self.claim_among(p, None)
    }

    /// A claim restricted to `only` when given (a claim by id), in claim order.
    /// The rows the repair rule selects (`plan::hints::needs_hint`), in id order.
    pub(crate) fn ready_stale(&self, p: &ReadyStaleParams) -> StoreResult<Vec<Instance>> {
        p.validate()?;
        let mut ids: Vec<InstanceId> = self
            .runnable
            .iter()
            .map(|(_, _, id)| *id)
            .filter(|id| {
                let row = &self.rows[id];
                let paused = self
                    .queues
                    .get(&(row.namespace.clone(), row.queue.clone()))
                    .copied()
                    .unwrap_or(false);
                keel_core::plan::hints::needs_hint(row, paused, p)
            })
            .collect();
        ids.sort_unstable();
        ids.truncate(p.limit);
        Ok(ids.into_iter().map(|id| self.rows[&id].clone()).collect())
    }

    pub(crate) fn claim_among(
        &mut self,
        p: &ClaimParams,
        only: Option<&std::collections::BTreeSet<InstanceId>>,
    ) -> StoreResult<Vec<Claim>> {
        match only {
            Some(_) => p.validate_by_ids()?,
            None => p.validate()?,
        }
        let mut candidates: Vec<InstanceId> = self
            .runnable
            .iter()
            .filter(|(_, eligible_at, id)| {
                *eligible_at <= p.now && only.is_none_or(|ids| ids.contains(id))
            })
            .map(|(_, _, id)| *id)
            .collect();
        // The index is in priority order; any other policy ranks the candidates itself.
        if !p.policy.is_plain_priority() {
            candidates.sort_by_key(|id| p.policy.order_key(&self.rows[id], p.now));
        }
        // Every claim but one of named instances takes them in fair order across keys.
        let fair = keel_core::plan::claim::is_fair(p, only.is_some());
        let cursor_queue = keel_core::plan::claim::cursor_queue(p).map(str::to_owned);
        let cursor = cursor_queue.as_ref().and_then(|q| self.cursors.get(q)).cloned();
        let mut planner = ClaimPlanner::new(p);
        // A rate limit names one queue (checked by `validate`).
        let bucket_queue = p.queues.first().cloned().unwrap_or_default();
        let refilled = planner.rate(self.buckets.get(&bucket_queue).copied());
        if fair {
            // Only rows the claim could take count towards their key's rounds.
            let rows = candidates
                .iter()
                .map(|id| &self.rows[id])
                .filter(|r| {
                    keel_core::plan::claim::matches(p, r)
                        && !self
                            .queues
                            .get(&(r.namespace.clone(), r.queue.clone()))
                            .copied()
                            .unwrap_or(false)
                })
                .cloned()
                .collect::<Vec<Instance>>();
            // Under a per-key rate limit, each key's bucket (a key without one has a full
            // one); only the keys of rows the claim could take are read.
            if p.policy.key_rate.is_some() {
                let keys: BTreeSet<&str> =
                    rows.iter().filter_map(|r| r.concurrency_key.as_deref()).collect();
                for key in keys {
                    let stored =
                        self.key_buckets.get(&(bucket_queue.clone(), key.to_owned())).copied();
                    planner.key_rate(key, stored);
                }
            }
            // As many keys as the claim can take: its limit, lowered by the rate limit.
            let cap = planner.cap();
            let room = |k: &str| {
                let running = u32::try_from(self.executing_keys.get(k).copied().unwrap_or(0))
                    .unwrap_or(u32::MAX);
                let room = p.policy.key_limit.saturating_sub(running);
                planner
                    .key_rate_room(k)
                    .map_or(room, |tokens| room.min(u32::try_from(tokens).unwrap_or(u32::MAX)))
            };
            candidates = keel_core::plan::claim::fair_order(rows, cursor.as_deref(), cap, room)
                .into_iter()
                .map(|r| r.id)
                .collect();
        }
        // A global limit names one queue (checked by `validate`): count its executing rows.
        let queue_executing = match p.policy.global_limit {
            Some(_) => self
                .rows
                .values()
                .filter(|r| r.status == keel_core::Status::Executing && p.queues.contains(&r.queue))
                .count() as u64,
            None => 0,
        };
        let mut claims = Vec::new();
        // Executing rows per key as they were before this claim: the planner counts the
        // rows it takes itself, so the rows this claim writes must not count twice.
        let executing_keys = self.executing_keys.clone();
        for id in candidates {
            if planner.is_full() {
                break;
            }
            let row = &self.rows[&id];
            let read = CandidateRead {
                queue_paused: self
                    .queues
                    .get(&(row.namespace.clone(), row.queue.clone()))
                    .copied()
                    .unwrap_or(false),
                key_executing: row
                    .concurrency_key
                    .as_ref()
                    .is_some_and(|k| executing_keys.contains_key(k)),
                key_running: row
                    .concurrency_key
                    .as_ref()
                    .and_then(|k| executing_keys.get(k))
                    .map_or(0, |n| u32::try_from(*n).unwrap_or(u32::MAX)),
                queue_executing,
            };
            let Some(next) = planner.offer(row, read) else { continue };
            let occupied = next.unique_guard().is_some_and(|g| self.occupant(g, id).is_some());
            if !planner.take(&next, occupied) {
                continue;
            }
            self.write(next.clone());
            claims.push(Claim {
                inbox: self.inbox_of(id).take(limits::CLAIM_INBOX_MAX).cloned().collect(),
                children: self.children_of(id),
                instance: next,
            });
        }
        if let Some(queue) = cursor_queue.filter(|_| fair) {
            let taken: Vec<Instance> = claims.iter().map(|c| c.instance.clone()).collect();
            match keel_core::plan::claim::cursor_after(cursor, &taken, planner.is_full(), None) {
                Some(key) => self.cursors.insert(queue, key),
                None => self.cursors.remove(&queue),
            };
        }
        if let Some(refilled) = refilled {
            self.buckets.insert(bucket_queue.clone(), planner.spent(refilled));
        }
        if let Some(rate) = p.policy.key_rate {
            let written = planner.key_buckets_spent();
            for k in &written {
                self.key_buckets.insert((bucket_queue.clone(), k.key.clone()), k.bucket);
            }
            self.prune_key_buckets(&bucket_queue, rate, p.now);
        }
        Ok(claims)
    }

    /// Deletes up to [`limits::KEY_RATE_BUCKETS_PRUNE_MAX`] per-key buckets of `queue`
    /// that are full at `now` and whose key has no ready row in the queue: a new bucket
    /// would start no more rows than they would.
    fn prune_key_buckets(
        &mut self,
        queue: &str,
        rate: keel_core::plan::claim::RateLimit,
        now: Timestamp,
    ) {
        let waiting: std::collections::HashSet<&str> = self
            .runnable
            .iter()
            .map(|(_, _, id)| &self.rows[id])
            .filter(|r| r.queue == queue)
            .filter_map(|r| r.concurrency_key.as_deref())
            .collect();
        let idle: Vec<(String, String)> = self
            .key_buckets
            .iter()
            .filter(|((q, k), b)| {
                q == queue && !waiting.contains(k.as_str()) && rate.is_full(**b, now)
            })
            .map(|(qk, _)| qk.clone())
            .take(limits::KEY_RATE_BUCKETS_PRUNE_MAX)
            .collect();
        for qk in idle {
            self.key_buckets.remove(&qk);
        }
    }

    // ----- commits ----------------------------------------------------------------------

    /// Commits one item of a batch: reads what the planner needs, lets it decide, inserts
    /// the children it admits and executes its plan, all under the same lock hold.
    fn commit(
        &mut self,
        planner: &mut CommitPlanner,
        c: &StepCommit,
        now: Timestamp,
    ) -> StoreResult<CommitReceipt> {
        let row = self.rows.get(&c.id).cloned();
        let inbox = InboxRead::of(self.inbox_of(c.id), c);
        let key_occupant = row
            .as_ref()
            .and_then(|row| commit::reentering_key(row, c, inbox.signal_waiting))
            .and_then(|key| self.occupant(key, c.id));
        let read = CommitRead {
            row,
            emit_targets: c.emit.iter().map(|s| self.resolve(&s.target)).collect(),
            inbox,
            key_occupant,
        };
        let admitted = planner.admit(c, read)?;
        let inserted: Vec<InsertOutcome> =
            admitted.children.iter().map(|child| self.child_insert(child, now)).collect();
        self.execute(admitted.finish(c, &inserted), now)
    }

    /// Inserts a child a commit starts, unless another instance occupies its unique key.
    fn child_insert(&mut self, child: &ChildInsert, now: Timestamp) -> InsertOutcome {
        let guard = unique_guard(child.spec.unique.as_ref(), Status::Runnable);
        if let Some(existing) = guard.and_then(|g| self.guards.get(g)) {
            return InsertOutcome::Existing(*existing);
        }
        let id = InstanceId(self.last_instance + 1);
        self.insert_row(Instance::from_new(id, &child.spec, Some(child.parent), now));
        InsertOutcome::Inserted(id)
    }

    /// Performs the writes of a planned commit, in the plan's order.
    fn execute(&mut self, plan: CommitPlan, now: Timestamp) -> StoreResult<CommitReceipt> {
        let CommitPlan {
            row,
            attempt,
            consume,
            drain_inbox,
            history,
            dead_letter,
            timers,
            emits,
            barrier_release,
            parent_notice,
            children_cancel,
            mut receipt,
        } = plan;
        let id = row.id;
        for id in consume {
            self.remove_signal(row.id, id);
        }
        if drain_inbox {
            self.inbox_drop(row.id);
        }
        for entry in history {
            self.record(&row, attempt, entry, now);
        }
        receipt.dead_letter = dead_letter.map(|letter| {
            self.last_dead_letter += 1;
            let id = DeadLetterId(self.last_dead_letter);
            self.dead_letters.insert(id, DeadLetter { id, created_at: now, letter });
            id
        });
        match &timers {
            TimerPlan::Change { arm, .. } => self.timers_change(&row, &timers, arm.clone()),
            TimerPlan::DropAll => self.timers_drop(row.id),
        }
        self.write(row);
        for (signal, target) in emits {
            self.deliver_to(target, &signal, now);
        }
        if let Some(release) = barrier_release {
            // The release carries the notice the plan also names separately.
            debug_assert_eq!(release.notice, parent_notice);
            let then = self.parent_release(&release, now);
            self.run_then(FollowUps::new(then), now);
        }
        if !children_cancel.is_none() {
            let left: Vec<keel_core::ports::store::CancelParams> = self
                .children
                .get(&id)
                .into_iter()
                .flatten()
                .map(|child| &self.rows[child])
                .filter(|child| children_cancel.covers(child, id))
                .map(|child| children_cancel.cancel_params(child, now))
                .collect();
            for p in left {
                self.cancel_with(&p, plan::cancel::left_delegation)?;
            }
        }
        Ok(receipt)
    }

    // ----- signals ----------------------------------------------------------------------

    fn deliver_to(&mut self, target: InstanceId, s: &NewSignal, now: Timestamp) -> DeliveryOutcome {
        self.deliver(std::slice::from_ref(s), vec![Some(target)], now).remove(0)
    }

    /// Reads what `plan::deliver` needs for `signals` (with their resolved `targets`),
    /// plans and writes the plan.
    fn deliver(
        &mut self,
        signals: &[NewSignal],
        targets: Vec<Option<InstanceId>>,
        now: Timestamp,
    ) -> Vec<DeliveryOutcome> {
        let mut read = DeliverRead::default();
        for (s, target) in signals.iter().zip(&targets) {
            let Some(target) = *target else { continue };
            read.rows.insert(target, self.rows[&target].clone());
            if let Some(key) = &s.dedup_key
                && let Some(id) = self.dedup.get(&(target, key.clone()))
            {
                read.dedup.insert((target, key.clone()), *id);
            }
        }
        read.targets = targets;
        let plan = plan::deliver::deliver(read, signals, now);
        let mut ids = Vec::with_capacity(plan.inserts.len());
        for insert in &plan.inserts {
            self.last_signal += 1;
            let id = SignalId(self.last_signal);
            let signal = Signal {
                id,
                target: insert.target,
                name: insert.name.clone(),
                payload: insert.payload.clone(),
                dedup_key: insert.dedup_key.clone(),
                priority: insert.priority,
                inserted_at: insert.inserted_at,
            };
            if let Some(key) = &signal.dedup_key {
                self.dedup.insert((signal.target, key.clone()), id);
            }
            self.inbox.entry(signal.target).or_default().insert(id, signal);
            ids.push(id);
        }
        let outcomes = plan.outcomes(&ids);
        for row in plan.woken.into_iter().chain(plan.raised) {
            self.write(row);
        }
        outcomes
    }

    fn signal_deliver(&mut self, p: &SignalDeliverParams) -> StoreResult<Vec<DeliveryOutcome>> {
        p.validate()?;
        let targets = p.signals.iter().map(|s| self.resolve(&s.target)).collect();
        Ok(self.deliver(&p.signals, targets, p.now))
    }

    fn signal_broadcast(&mut self, p: &SignalBroadcastParams) -> StoreResult<BroadcastReport> {
        p.validate()?;
        let candidates = self
            .rows
            .values()
            .filter(|r| r.namespace == p.namespace && r.machine.name == p.machine)
            .map(|r| (r.id, r.position.as_str(), r.status));
        let targets = plan::deliver::broadcast_targets(p, candidates)?;
        let signals: Vec<NewSignal> = targets.iter().map(|t| p.signal(*t)).collect();
        let outcomes = self.deliver(&signals, targets.into_iter().map(Some).collect(), p.now);
        Ok(plan::deliver::broadcast_report(&outcomes))
    }

    // ----- leases -----------------------------------------------------------------------

    fn lease_reap(&mut self, p: &LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        p.validate()?;
        let executing = self.executing.iter().map(|id| self.rows[id].clone()).collect::<Vec<_>>();
        let writes = plan::lease::reap(p, executing);
        Ok(writes.into_iter().map(|w| self.write_planned(w, p.now)).collect())
    }

    /// Records a planned row change and writes the row; returns its id.
    fn write_planned(&mut self, w: RowWrite, now: Timestamp) -> InstanceId {
        for entry in w.history {
            self.record(&w.row, w.attempt, entry, now);
        }
        let id = w.row.id;
        self.write(w.row);
        id
    }

    /// The rows of the named leases, for a lease planner.
    fn lease_rows(&self, leases: &[(InstanceId, keel_core::FencingToken)]) -> Vec<Instance> {
        let ids: BTreeSet<InstanceId> = leases.iter().map(|(id, _)| *id).collect();
        ids.into_iter().filter_map(|id| self.rows.get(&id).cloned()).collect()
    }

    fn lease_extend(&mut self, p: &LeaseExtendParams) -> Vec<bool> {
        let plan = plan::lease::extend(p, self.lease_rows(&p.leases));
        plan.rows.into_iter().for_each(|row| self.write(row));
        plan.held
    }

    fn lease_release(&mut self, p: &LeaseReleaseParams) -> Vec<bool> {
        let plan = plan::lease::release(p, self.lease_rows(&p.leases));
        plan.rows.into_iter().for_each(|row| self.write(row));
        plan.held
    }

    // ----- version migration ------------------------------------------------------------

    fn migrate(&mut self, p: &MigrateParams) -> MigratePage {
        let (name, version) = (p.migration.machine(), p.migration.from_version() as i32);
        let start = p.after.map_or(InstanceId(i64::MIN), |a| InstanceId(a.0.saturating_add(1)));
        let read: Vec<(Instance, Vec<TimerRow>)> = self
            .rows
            .range(start..)
            .map(|(_, r)| r)
            .filter(|r| {
                r.machine.name == name
                    && r.machine.version == version
                    && !r.status.is_terminal()
                    && p.namespace.as_ref().is_none_or(|ns| *ns == r.namespace)
            })
            .take(p.limit)
            .map(|r| {
                let timers = self.timers_of.get(&r.id).into_iter().flatten();
                (r.clone(), timers.map(|t| self.timers[t].clone()).collect())
            })
            .collect();
        let last = read.last().map(|(r, _)| r.id);
        let plan = plan::migrate::page(p, read);
        for (w, timers) in plan.rows.into_iter().zip(plan.timers) {
            let id = w.row.id;
            let row = w.row.clone();
            self.write_planned(w, p.now);
            self.timers_drop(id);
            self.timers_change(
                &row,
                &TimerPlan::Change { cancel: Vec::new(), arm: Vec::new() },
                timers,
            );
        }
        MigratePage { items: plan.items, last }
    }

    // ----- pruning ----------------------------------------------------------------------

    fn prune(&mut self, p: &PruneParams) -> PrunePage {
        let start = p.after.map_or(InstanceId(i64::MIN), |a| InstanceId(a.0.saturating_add(1)));
        let read: Vec<PruneCandidate> = self
            .rows
            .range(start..)
            .take(p.limit)
            .map(|(_, r)| PruneCandidate {
                id: r.id,
                namespace: r.namespace.clone(),
                machine: r.machine.name.clone(),
                status: r.status,
                updated_at: r.updated_at,
                parent_live: r
                    .parent
                    .and_then(|parent| self.rows.get(&parent))
                    .is_some_and(|parent| !parent.status.is_terminal()),
                has_children: self.children.get(&r.id).is_some_and(|c| !c.is_empty()),
                has_dead_letters: self.dead_letters.values().any(|d| d.letter.instance == r.id),
            })
            .collect();
        let mut page = PrunePage { last: read.last().map(|c| c.id), ..PrunePage::default() };
        for id in plan::prune::page(p, &read) {
            let (history, signals) = self.remove_instance(id);
            page.instances += 1;
            page.history += history;
            page.signals += signals;
        }
        page
    }

    // ----- history ----------------------------------------------------------------------

    fn history_page(&self, p: &HistoryPageParams) -> StoreResult<HistoryPage> {
        p.validate()?;
        if !self.rows.contains_key(&p.instance) {
            return Err(StoreError::not_found(format!("instance {} does not exist", p.instance)));
        }
        let history = self.history.get(&p.instance).map_or(&[][..], Vec::as_slice);
        let before = p.before.unwrap_or(i64::MAX);
        let read = history.iter().rev().filter(|r| r.seq < before).take(p.read_limit());
        Ok(plan::history::page(p, read.cloned().collect()))
    }

    fn history_trim(&mut self, p: &HistoryTrimParams) -> HistoryTrimPage {
        let start = p.after.map_or(InstanceId(i64::MIN), |a| InstanceId(a.0.saturating_add(1)));
        let read: Vec<TrimCandidate> = self
            .rows
            .range(start..)
            .take(p.limit)
            .map(|(_, r)| {
                let history = self.history.get(&r.id).map_or(&[][..], Vec::as_slice);
                let beyond = history.iter().rev().skip(p.keep).take(p.count_cap());
                TrimCandidate {
                    id: r.id,
                    namespace: r.namespace.clone(),
                    machine: r.machine.name.clone(),
                    excess: beyond.clone().count() as u64,
                    through: beyond.map(|h| h.seq).max(),
                }
            })
            .collect();
        let plan = plan::history::trim(p, &read);
        let mut page = HistoryTrimPage { last: plan.last, ..HistoryTrimPage::default() };
        for t in plan.trims {
            let Some(history) = self.history.get_mut(&t.instance) else { continue };
            // Entries are in sequence order: the oldest `count` numbered at most `through`.
            let n = history.iter().take_while(|h| h.seq <= t.through).count();
            let n = n.min(usize::try_from(t.count).unwrap_or(usize::MAX));
            history.drain(..n);
            page.history += n as u64;
            page.instances += u64::from(n > 0);
        }
        page
    }

    // ----- cancel -----------------------------------------------------------------------

    fn cancel(&mut self, p: &CancelParams) -> StoreResult<Vec<InstanceId>> {
        self.cancel_with(p, plan::cancel::cancel)
    }

    /// Reads what a cancel needs, plans it with `planner` and writes the plan; then the
    /// cancels its releases asked for (a parent that woke from a join and cancels the rest
    /// of its children), as [`State::run_then`] runs them.
    fn cancel_with(
        &mut self,
        p: &CancelParams,
        planner: fn(&CancelParams, CancelRead) -> StoreResult<plan::cancel::CancelPlan>,
    ) -> StoreResult<Vec<InstanceId>> {
        let (cancelled, then) = self.cancel_one(p, planner)?;
        self.run_then(FollowUps::new(then), p.now);
        Ok(cancelled)
    }

    /// One cancel: reads what it needs, plans it with `planner`, writes the plan and its
    /// parents' releases. Returns its ids and what the releases left to do.
    fn cancel_one(
        &mut self,
        p: &CancelParams,
        planner: fn(&CancelParams, CancelRead) -> StoreResult<plan::cancel::CancelPlan>,
    ) -> StoreResult<(Vec<InstanceId>, Vec<FollowUp>)> {
        let mut read = CancelRead { root: self.rows.get(&p.id).cloned(), ..CancelRead::default() };
        if p.cascade {
            // Breadth first down to the depth bound, so the read stays bounded too.
            let mut queue: VecDeque<(InstanceId, usize)> = VecDeque::from([(p.id, 0)]);
            while let Some((id, depth)) = queue.pop_front() {
                if depth >= limits::CANCEL_CASCADE_DEPTH_MAX {
                    continue;
                }
                for child in self.children.get(&id).into_iter().flatten() {
                    read.descendants.push((self.rows[child].clone(), depth + 1));
                    queue.push_back((*child, depth + 1));
                }
            }
        }
        let ids = read.root.iter().chain(read.descendants.iter().map(|(r, _)| r)).map(|r| r.id);
        read.pending = ids.map(|id| (id, inbox::Pending::of(self.inbox_of(id)))).collect();
        let plan = planner(p, read)?;
        let cancelled = plan.cancelled();
        for w in plan.rows {
            let id = w.row.id;
            self.write_planned(w, p.now);
            self.inbox_drop(id);
            self.timers_drop(id);
        }
        let mut then = Vec::new();
        for r in &plan.releases {
            then.extend(self.parent_release(r, p.now));
        }
        Ok((cancelled, then))
    }

    /// Runs what parent releases left to do ([`FollowUps`]: in order, depth first, cancels
    /// under the cascade's bound, notices always delivered).
    fn run_then(&mut self, mut run: FollowUps, now: Timestamp) {
        while let Some(step) = run.next_step() {
            match step {
                NextFollowUp::Notices(batch) => {
                    for (parent, signal) in batch {
                        if self.rows.contains_key(&parent) {
                            self.deliver_to(parent, &signal, now);
                        }
                    }
                }
                NextFollowUp::Cancel(cancel) => {
                    // A child that is gone has nothing left to cancel.
                    if let Ok((_, further)) = self.cancel_one(&cancel, plan::cancel::cancel) {
                        run.then(further);
                    }
                }
            }
        }
    }

    // ----- dead letters -----------------------------------------------------------------

    /// The dead letters `selector` names (`None` = all), oldest first.
    fn letters(&self, selector: Option<&DeadLetterSelector>) -> impl Iterator<Item = &DeadLetter> {
        self.dead_letters.values().filter(move |d| match selector {
            None => true,
            Some(DeadLetterSelector::Id(id)) => d.id == *id,
            Some(DeadLetterSelector::Machine { namespace, machine }) => {
                d.letter.namespace == *namespace && d.letter.machine.name == *machine
            }
        })
    }

    fn dead_letter(&self, id: DeadLetterId) -> StoreResult<&DeadLetter> {
        self.dead_letters
            .get(&id)
            .ok_or_else(|| StoreError::not_found(format!("dead letter {id} does not exist")))
    }

    fn dead_letter_retry(&mut self, p: &DeadLetterRetryParams) -> StoreResult<Vec<InstanceId>> {
        p.validate()?;
        let status = p.instance_status();
        let retryable = |d: &&DeadLetter| {
            status
                .is_none_or(|st| self.rows.get(&d.letter.instance).is_some_and(|r| r.status == st))
        };
        let letters: Vec<(DeadLetterId, InstanceId)> = self
            .letters(Some(&p.selector))
            .filter(retryable)
            .take(limits::DEAD_LETTER_BATCH_MAX)
            .map(|d| (d.id, d.letter.instance))
            .collect();
        let rows: Vec<Instance> =
            letters.iter().filter_map(|(_, i)| self.rows.get(i).cloned()).collect();
        let plan = plan::dead_letter::retry(p, &letters, rows)?;
        let retried = plan.retried();
        for w in plan.rows {
            self.write_planned(w, p.now);
        }
        for id in plan.remove {
            self.dead_letters.remove(&id);
        }
        Ok(retried)
    }

    fn dead_letter_skip(&mut self, p: &DeadLetterSkipParams) -> StoreResult<InstanceId> {
        let letter = self.dead_letter(p.id)?;
        let plan = plan::dead_letter::skip(p, letter, self.rows.get(&letter.letter.instance))?;
        let id = plan.row.row.id;
        for signal in &plan.consume {
            self.remove_signal(id, *signal);
        }
        self.write_planned(plan.row, p.now);
        self.dead_letters.remove(&plan.remove);
        Ok(id)
    }

    fn dead_letter_purge(&mut self, p: &DeadLetterPurgeParams) -> StoreResult<u64> {
        p.validate()?;
        let letters = self
            .letters(p.selector.as_ref())
            .map(|d| (d.id, d.created_at, self.rows.get(&d.letter.instance).map(|r| r.status)));
        let gone = plan::dead_letter::purge(p, letters);
        for id in &gone {
            self.dead_letters.remove(id);
        }
        Ok(gone.len() as u64)
    }

    // ----- timers -----------------------------------------------------------------------

    fn timer_sweep(&mut self, p: &TimerSweepParams) -> StoreResult<TimerSweepReport> {
        p.validate()?;
        let in_scope = |t: &TimerRow| {
            p.namespace.as_ref().is_none_or(|ns| &t.namespace == ns)
                && (p.machines.is_empty() || p.machines.contains(&t.machine.name))
        };
        let mut due: Vec<TimerRow> = self
            .timers
            .values()
            .filter(|t| t.next_fire_at <= p.now && in_scope(t))
            .cloned()
            .collect();
        due.sort_by_key(|t| (t.next_fire_at, t.id));
        due.truncate(p.limit);
        let paused: Vec<(String, String)> =
            self.queues.iter().filter(|(_, paused)| **paused).map(|(q, _)| q.clone()).collect();
        let owner = |id| plan::timer::Owner::of(self.rows.get(&id), &paused);
        let plan = plan::timer::sweep(p, &due, owner);
        let delivered = self.deliver(&plan.signals, plan.targets(), p.now);
        for (instance, entry) in &plan.history {
            let row = self.rows[instance].clone();
            self.record(&row, row.attempt, entry.clone(), p.now);
        }
        for next in &plan.advance {
            self.timers.insert(next.id, next.clone());
        }
        for id in &plan.delete {
            self.timer_remove(*id);
        }
        for id in &plan.join_deadlines {
            if let Some(row) = self.rows.get(id) {
                let planned = plan::parent::expire(row, p.now);
                let cancels = self.parent_apply(planned, p.now);
                self.run_then(FollowUps::cancels(cancels), p.now);
            }
        }
        for scope in plan::timer::swept_scopes(p) {
            self.sweeps.insert(scope, p.now);
        }
        let report = plan.report(&delivered);
        Ok(report)
    }

    /// One page of a retime, and the earliest new due time (for the sweepers' hint).
    fn timers_retime(
        &mut self,
        p: &TimerRetimeParams,
    ) -> StoreResult<(TimerRetimePage, Option<Timestamp>)> {
        p.validate()?;
        let read: Vec<TimerRow> = self
            .timers
            .values()
            .filter(|t| t.machine == p.machine && p.after.is_none_or(|after| t.id > after))
            .take(p.limit)
            .cloned()
            .collect();
        let plan = plan::timer::retime(p, &read);
        let earliest = plan.retimed.iter().map(|r| r.next.next_fire_at).min();
        let mut retimed = Vec::with_capacity(plan.retimed.len());
        for r in plan.retimed {
            let row = self.rows[&r.next.instance].clone();
            self.record(&row, row.attempt, r.history, p.now);
            retimed.push(r.next.id);
            self.timers.insert(r.next.id, r.next);
        }
        Ok((TimerRetimePage { retimed, next: plan.next }, earliest))
    }
}

mod port;
mod read;
mod tables;
