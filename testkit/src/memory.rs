//! [`MemoryStore`]: the in-memory implementation of the `Store` port.
//!
//! Every store operation is planned in [`keel_core::plan`]: a step commit by
//! [`keel_core::plan::commit`] (this file reads what the planner asks for, inserts the
//! children it admits and performs the writes of its plan), and inserts, deliveries,
//! broadcasts, leases, cancels, dead-letter actions and the timer sweep by the other
//! planners. Claims go through the pure transitions of [`keel_core::outcome`] and the inbox
//! rules of [`keel_core::inbox`]. What is left here is the collections, the indexes and the
//! order in which writes run inside one "transaction" (one lock hold), so it must stay
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
use keel_core::plan::{
    self, RowWrite, cancel::CancelRead, deliver::DeliverRead, insert::InsertRead,
};
use keel_core::ports::Store;
use keel_core::ports::store::{
    BroadcastReport, CancelParams, Claim, ClaimParams, CommitParams, CommitReceipt,
    DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams, DeadLetterSelector,
    DeadLetterSkipParams, DeliveryOutcome, InsertOutcome, InsertParams, InstanceDetail,
    LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, QueuePauseParams, QueueState,
    QueueStats, SignalBroadcastParams, SignalDeliverParams, StoreCapabilities, TimerNextDueParams,
    TimerStatus, TimerSweepParams, TimerSweepReport,
};
use keel_core::timers::{TimerHint, TimerHints, TimerRow, owned_by};
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
    /// `(namespace, machine name, business key)` → newest instance.
    business_keys: HashMap<(String, String, String), InstanceId>,
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
}

impl State {
    // ----- rows and their indexes -------------------------------------------------------

    /// Writes a row and keeps every index in step with its new status.
    fn write(&mut self, row: Instance) {
        if let Some(old) = self.rows.remove(&row.id) {
            self.unindex(&old);
        }
        self.index(&row);
        self.rows.insert(row.id, row);
    }

    fn unindex(&mut self, row: &Instance) {
        match row.status {
            Status::Runnable => {
                self.runnable.remove(&(row.priority, row.eligible_at, row.id));
            }
            Status::Executing => {
                self.executing.remove(&row.id);
                if let Some(key) = &row.concurrency_key
                    && let Some(n) = self.executing_keys.get_mut(key)
                {
                    *n -= 1;
                    if *n == 0 {
                        self.executing_keys.remove(key);
                    }
                }
            }
            _ => {}
        }
        if let Some(guard) = row.unique_guard()
            && self.guards.get(guard) == Some(&row.id)
        {
            self.guards.remove(guard);
        }
    }

    fn index(&mut self, row: &Instance) {
        match row.status {
            Status::Runnable => {
                self.runnable.insert((row.priority, row.eligible_at, row.id));
            }
            Status::Executing => {
                self.executing.insert(row.id);
                if let Some(key) = &row.concurrency_key {
                    *self.executing_keys.entry(key.clone()).or_default() += 1;
                }
            }
            _ => {}
        }
        if let Some(guard) = row.unique_guard() {
            self.guards.entry(guard.to_vec()).or_insert(row.id);
        }
    }

    /// The occupant of `guard` other than `me`, if any.
    fn occupant(&self, guard: &[u8], me: InstanceId) -> Option<InstanceId> {
        self.guards.get(guard).copied().filter(|id| *id != me)
    }

    /// Inserts a new row (id already reserved by the caller).
    fn insert_row(&mut self, row: Instance) {
        self.last_instance = self.last_instance.max(row.id.0);
        if let Some(parent) = row.parent {
            self.children.entry(parent).or_default().push(row.id);
        }
        if let Some(key) = &row.business_key {
            let k = (row.namespace.clone(), row.machine.name.clone(), key.clone());
            self.business_keys.insert(k, row.id);
        }
        self.write(row);
    }

    fn resolve(&self, target: &SignalTarget) -> Option<InstanceId> {
        match target {
            SignalTarget::Id(id) => self.rows.contains_key(id).then_some(*id),
            SignalTarget::Key { namespace, machine, key } => {
                self.business_keys.get(&(namespace.clone(), machine.clone(), key.clone())).copied()
            }
        }
    }

    fn record(&mut self, row: &Instance, attempt: i32, entry: HistoryEntry, now: Timestamp) {
        self.last_history += 1;
        let record = HistoryRecord {
            instance: row.id,
            seq: self.last_history,
            at: now,
            revision: row.revision,
            attempt,
            entry,
        };
        self.history.entry(row.id).or_default().push(record);
    }

    fn inbox_of(&self, id: InstanceId) -> impl Iterator<Item = &Signal> {
        self.inbox.get(&id).into_iter().flat_map(BTreeMap::values)
    }

    fn children_of(&self, id: InstanceId) -> Vec<ChildSummary> {
        self.children
            .get(&id)
            .into_iter()
            .flatten()
            .take(limits::CHILDREN_LIST_MAX)
            .filter_map(|c| self.rows.get(c).map(ChildSummary::of))
            .collect()
    }

    fn remove_signal(&mut self, target: InstanceId, id: SignalId) {
        if let Some(signal) = self.inbox.get_mut(&target).and_then(|b| b.remove(&id))
            && let Some(key) = signal.dedup_key
        {
            self.dedup.remove(&(target, key));
        }
    }

    /// Empties an inbox (its instance ended; the plan recorded what it held).
    fn inbox_drop(&mut self, id: InstanceId) {
        for signal in self.inbox.remove(&id).into_iter().flat_map(BTreeMap::into_values) {
            if let Some(key) = signal.dedup_key {
                self.dedup.remove(&(id, key));
            }
        }
    }

    /// Executes a planned parent release: the parent's barrier counts the ended child
    /// against its row as it stands now, then the parent's notice is delivered. A parent
    /// that no longer exists is left alone.
    fn parent_release(&mut self, parent: InstanceId, notice: Option<&NewSignal>, now: Timestamp) {
        let Some(row) = self.rows.get(&parent) else { return };
        let next = plan::parent::release(row, now);
        self.write(next);
        if let Some(notice) = notice {
            self.deliver_to(parent, notice, now);
        }
    }

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
        p.validate()?;
        let candidates: Vec<InstanceId> = self
            .runnable
            .iter()
            .filter(|(_, eligible_at, _)| *eligible_at <= p.now)
            .map(|(_, _, id)| *id)
            .collect();
        let mut claims = Vec::new();
        let mut planner = ClaimPlanner::new(p);
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
                    .is_some_and(|k| self.executing_keys.contains_key(k)),
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
        Ok(claims)
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
        Ok(self.execute(admitted.finish(c, &inserted), now))
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
    fn execute(&mut self, plan: CommitPlan, now: Timestamp) -> CommitReceipt {
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
            mut receipt,
        } = plan;
        for id in consume {
            self.remove_signal(row.id, id);
        }
        if drain_inbox {
            self.inbox_clear(row.id);
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
        match timers {
            TimerPlan::Change { cancel, arm } => self.timers_change(&row, &cancel, arm),
            TimerPlan::DropAll => self.timers_drop(row.id),
        }
        self.write(row);
        for (signal, target) in emits {
            self.deliver_to(target, &signal, now);
        }
        if let Some(parent) = barrier_release {
            self.parent_release(parent, parent_notice.as_ref(), now);
        }
        receipt
    }

    /// Removes every signal in an inbox, with its dedup entries.
    fn inbox_clear(&mut self, id: InstanceId) {
        for signal in self.inbox.remove(&id).into_iter().flat_map(BTreeMap::into_values) {
            if let Some(key) = signal.dedup_key {
                self.dedup.remove(&(id, key));
            }
        }
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
                inserted_at: insert.inserted_at,
            };
            if let Some(key) = &signal.dedup_key {
                self.dedup.insert((signal.target, key.clone()), id);
            }
            self.inbox.entry(signal.target).or_default().insert(id, signal);
            ids.push(id);
        }
        let outcomes = plan.outcomes(&ids);
        for row in plan.woken {
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

    // ----- cancel -----------------------------------------------------------------------

    fn cancel(&mut self, p: &CancelParams) -> StoreResult<Vec<InstanceId>> {
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
        let plan = plan::cancel::cancel(p, read)?;
        let cancelled = plan.cancelled();
        for w in plan.rows {
            let id = w.row.id;
            self.write_planned(w, p.now);
            self.inbox_drop(id);
            self.timers_drop(id);
        }
        for r in &plan.releases {
            self.parent_release(r.parent, r.notice.as_ref(), p.now);
        }
        Ok(cancelled)
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
        let letters: Vec<(DeadLetterId, InstanceId)> = self
            .letters(Some(&p.selector))
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
        let letters = self.letters(p.selector.as_ref()).map(|d| (d.id, d.created_at));
        let gone = plan::dead_letter::purge(p, letters);
        for id in &gone {
            self.dead_letters.remove(id);
        }
        Ok(gone.len() as u64)
    }

    // ----- inspection -------------------------------------------------------------------

    fn rows_of(&self, ids: &[InstanceId]) -> StoreResult<Vec<Instance>> {
        check_batch("ids", ids.len(), limits::ROWS_BATCH_MAX)?;
        let wanted: BTreeSet<InstanceId> = ids.iter().copied().collect();
        Ok(wanted.into_iter().filter_map(|id| self.rows.get(&id).cloned()).collect())
    }

    fn detail(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        let row = self
            .rows
            .get(&id)
            .ok_or_else(|| StoreError::not_found(format!("instance {id} does not exist")))?;
        let history = self.history.get(&id).map_or(&[][..], Vec::as_slice);
        let skip = history.len().saturating_sub(limits::HISTORY_LIST_MAX);
        let mut timers: Vec<TimerRow> =
            self.timers_of.get(&id).into_iter().flatten().map(|t| self.timers[t].clone()).collect();
        timers.sort_by_key(|t| (t.next_fire_at, t.id));
        timers.truncate(limits::TIMER_LIST_MAX);
        Ok(InstanceDetail {
            instance: row.clone(),
            inbox: self.inbox_of(id).cloned().collect(),
            children: self.children_of(id),
            history: history[skip..].to_vec(),
            timers,
        })
    }

    // ----- timers -----------------------------------------------------------------------

    /// Applies a commit's timer changes: cancels first, then arms.
    fn timers_change(&mut self, row: &Instance, cancel: &[String], arm: Vec<TimerRow>) {
        if !cancel.is_empty() {
            let mine: Vec<TimerId> =
                self.timers_of.get(&row.id).into_iter().flatten().copied().collect();
            for id in mine {
                if cancel.iter().any(|left| owned_by(&self.timers[&id].spec.state, left)) {
                    self.timer_remove(id);
                }
            }
        }
        for mut timer in arm {
            self.last_timer += 1;
            timer.id = TimerId(self.last_timer);
            self.timers_of.entry(row.id).or_default().insert(timer.id);
            self.timers.insert(timer.id, timer);
        }
    }

    /// A terminal instance has no timers.
    fn timers_drop(&mut self, id: InstanceId) {
        for timer in self.timers_of.remove(&id).unwrap_or_default() {
            self.timers.remove(&timer);
        }
    }

    fn timer_remove(&mut self, id: TimerId) {
        if let Some(t) = self.timers.remove(&id)
            && let Some(set) = self.timers_of.get_mut(&t.instance)
        {
            set.remove(&id);
        }
    }

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
        let live = |id| self.rows.get(&id).is_some_and(|r| !r.status.is_terminal());
        let plan = plan::timer::sweep(p, &due, live);
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
        for scope in plan::timer::swept_scopes(p) {
            self.sweeps.insert(scope, p.now);
        }
        let report = plan.report(&delivered);
        Ok(report)
    }

    fn timer_next_due(&self, p: &TimerNextDueParams) -> Option<Timestamp> {
        self.timers
            .values()
            .filter(|t| {
                p.namespace.as_ref().is_none_or(|ns| &t.namespace == ns)
                    && (p.machines.is_empty() || p.machines.contains(&t.machine.name))
            })
            .map(|t| t.next_fire_at)
            .min()
    }

    fn timer_status(&self, namespace: Option<&str>, now: Timestamp) -> Vec<TimerStatus> {
        let mut out: BTreeMap<(String, String), TimerStatus> = BTreeMap::new();
        for t in self.timers.values().filter(|t| namespace.is_none_or(|ns| t.namespace == ns)) {
            let e = out.entry((t.namespace.clone(), t.machine.name.clone())).or_insert_with(|| {
                TimerStatus {
                    namespace: t.namespace.clone(),
                    machine: t.machine.name.clone(),
                    armed: 0,
                    next_due: None,
                    overdue: 0,
                    last_sweep_at: None,
                }
            });
            e.armed += 1;
            e.next_due = Some(e.next_due.map_or(t.next_fire_at, |d| d.min(t.next_fire_at)));
            e.overdue += u64::from(t.next_fire_at <= now);
        }
        for e in out.values_mut() {
            let keys = [
                (e.namespace.clone(), e.machine.clone()),
                (e.namespace.clone(), "*".to_owned()),
                ("*".to_owned(), e.machine.clone()),
                ("*".to_owned(), "*".to_owned()),
            ];
            e.last_sweep_at = keys.iter().filter_map(|k| self.sweeps.get(k)).max().copied();
        }
        out.into_values().collect()
    }

    fn queue_stats(&self, namespace: Option<&str>, now: Timestamp) -> Vec<QueueStats> {
        let mut out: BTreeMap<(String, String, String), QueueStats> = BTreeMap::new();
        for r in self
            .rows
            .values()
            .filter(|r| !r.status.is_terminal() && namespace.is_none_or(|ns| r.namespace == ns))
        {
            let e = out
                .entry((r.namespace.clone(), r.queue.clone(), r.machine.name.clone()))
                .or_insert_with(|| QueueStats {
                    namespace: r.namespace.clone(),
                    queue: r.queue.clone(),
                    machine: r.machine.name.clone(),
                    ..QueueStats::default()
                });
            match r.status {
                Status::Runnable if r.eligible_at <= now => {
                    e.ready += 1;
                    e.oldest_ready_at =
                        Some(e.oldest_ready_at.map_or(r.eligible_at, |t| t.min(r.eligible_at)));
                }
                Status::Runnable => e.scheduled += 1,
                Status::Executing => e.executing += 1,
                Status::AwaitingSignal | Status::AwaitingChildren => e.waiting += 1,
                Status::Suspended => e.suspended += 1,
                Status::Done | Status::Failed | Status::Cancelled => {}
            }
        }
        out.into_values().collect()
    }
}

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

    async fn instance_lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>> {
        Ok(self.state().resolve(&target))
    }

    async fn dead_letter_list(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        let limit = match filter.limit {
            0 => limits::DEAD_LETTER_BATCH_MAX,
            n => n.min(limits::DEAD_LETTER_BATCH_MAX),
        };
        let state = self.state();
        Ok(state
            .dead_letters
            .values()
            .filter(|d| filter.namespace.as_ref().is_none_or(|ns| d.letter.namespace == *ns))
            .filter(|d| filter.machine.as_ref().is_none_or(|m| d.letter.machine.name == *m))
            .take(limit)
            .cloned()
            .collect())
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
        self.state().queues.insert((params.namespace, params.queue), params.paused);
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

    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        Ok(self.state().timer_status(namespace.as_deref(), now))
    }

    async fn ready_wait(&self) {
        self.ready.notified().await;
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
        let state = self.state();
        let mut queues: BTreeMap<String, bool> = state
            .rows
            .values()
            .filter(|row| row.namespace == namespace)
            .map(|row| (row.queue.clone(), false))
            .collect();
        for ((ns, queue), paused) in &state.queues {
            if *ns == namespace {
                queues.insert(queue.clone(), *paused);
            }
        }
        Ok(queues
            .into_iter()
            .map(|(queue, paused)| QueueState { namespace: namespace.clone(), queue, paused })
            .collect())
    }
}
