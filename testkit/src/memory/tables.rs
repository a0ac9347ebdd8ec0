//! `MemoryStore`'s collections: writing a row keeps every index in step with it (status
//! and claim order, unique keys, concurrency keys, children), and the inbox, history and
//! parent-release and timer writes a plan asks for. Bookkeeping only; the plans decide.

use super::{
    BTreeMap, CancelParams, ChildSummary, HistoryEntry, HistoryRecord, Instance, InstanceId,
    Signal, SignalId, SignalTarget, State, Status, TimerId, TimerRow, Timestamp, limits, plan,
};
use keel_core::plan::commit::TimerPlan;
use keel_core::plan::parent::{FollowUp, ParentPlan, ParentRelease};

impl State {
    /// Writes a row and keeps every index in step with its new status.
    pub(super) fn write(&mut self, row: Instance) {
        if let Some(old) = self.rows.remove(&row.id) {
            self.unindex(&old);
        }
        self.index(&row);
        self.rows.insert(row.id, row);
    }

    pub(super) fn unindex(&mut self, row: &Instance) {
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

    pub(super) fn index(&mut self, row: &Instance) {
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
    pub(super) fn occupant(&self, guard: &[u8], me: InstanceId) -> Option<InstanceId> {
        self.guards.get(guard).copied().filter(|id| *id != me)
    }

    /// Inserts a new row (id already reserved by the caller).
    pub(super) fn insert_row(&mut self, row: Instance) {
        self.last_instance = self.last_instance.max(row.id.0);
        if let Some(parent) = row.parent {
            self.children.entry(parent).or_default().push(row.id);
        }
        if let Some(key) = &row.business_key {
            let k = (row.namespace.clone(), row.machine.name.clone(), key.clone());
            self.business_keys.entry(k).or_default().insert(row.id);
        }
        self.write(row);
    }

    pub(super) fn resolve(&self, target: &SignalTarget) -> Option<InstanceId> {
        match target {
            SignalTarget::Id(id) => self.rows.contains_key(id).then_some(*id),
            SignalTarget::Key { namespace, machine, key } => {
                // The newest instance with the key that still exists.
                let k = (namespace.clone(), machine.clone(), key.clone());
                self.business_keys.get(&k).and_then(|ids| ids.last()).copied()
            }
            SignalTarget::Child { parent, state } => self
                .children
                .get(parent)
                .into_iter()
                .flatten()
                .filter(|c| self.rows[c].invoked_by.as_deref() == Some(state.as_str()))
                .max()
                .copied(),
        }
    }

    pub(super) fn record(
        &mut self,
        row: &Instance,
        attempt: i32,
        entry: HistoryEntry,
        now: Timestamp,
    ) {
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

    pub(super) fn inbox_of(&self, id: InstanceId) -> impl Iterator<Item = &Signal> {
        self.inbox.get(&id).into_iter().flat_map(BTreeMap::values)
    }

    pub(super) fn children_of(&self, id: InstanceId) -> Vec<ChildSummary> {
        self.children
            .get(&id)
            .into_iter()
            .flatten()
            .take(limits::CHILDREN_LIST_MAX)
            .filter_map(|c| self.rows.get(c).map(ChildSummary::of))
            .collect()
    }

    pub(super) fn remove_signal(&mut self, target: InstanceId, id: SignalId) {
        if let Some(signal) = self.inbox.get_mut(&target).and_then(|b| b.remove(&id))
            && let Some(key) = signal.dedup_key
        {
            self.dedup.remove(&(target, key));
        }
    }

    /// Empties an inbox (its instance ended; the plan recorded what it held).
    pub(super) fn inbox_drop(&mut self, id: InstanceId) {
        for signal in self.inbox.remove(&id).into_iter().flat_map(BTreeMap::into_values) {
            if let Some(key) = signal.dedup_key {
                self.dedup.remove(&(id, key));
            }
        }
    }

    /// Executes a planned parent release: the parent's barrier counts the ended child
    /// against its row as it stands now (`plan::parent::release`, which may wake it and
    /// stop waiting for the rest of its barrier). A parent that no longer exists is left
    /// alone. Returns what is left to do, for `run_then`: the cancels of the children the
    /// parent stopped waiting for, then the parent's notice (so the reports of the
    /// cancelled children reach its inbox first).
    pub(super) fn parent_release(
        &mut self,
        release: &ParentRelease,
        now: Timestamp,
    ) -> Vec<FollowUp> {
        let Some(row) = self.rows.get(&release.parent) else { return Vec::new() };
        let planned = plan::parent::release(row, release, now);
        let cancels = self.parent_apply(planned, now);
        release.follow_ups(cancels).collect()
    }

    /// Writes a parent plan: the row and its history. Returns the cancels of the children
    /// it stopped waiting for, for the caller to run (`run_then`).
    pub(super) fn parent_apply(
        &mut self,
        planned: ParentPlan,
        now: Timestamp,
    ) -> Vec<CancelParams> {
        if !planned.changed {
            return Vec::new();
        }
        for entry in planned.history {
            self.record(&planned.row, planned.row.attempt, entry, now);
        }
        self.write(planned.row);
        planned.cancel
    }

    /// Applies a commit's timer changes: cancels first (the timers the plan says it
    /// cancels), then arms.
    pub(super) fn timers_change(&mut self, row: &Instance, plan: &TimerPlan, arm: Vec<TimerRow>) {
        if matches!(plan, TimerPlan::Change { cancel, .. } if !cancel.is_empty()) {
            let mine: Vec<TimerId> =
                self.timers_of.get(&row.id).into_iter().flatten().copied().collect();
            for id in mine {
                if plan.cancels(&self.timers[&id].spec.state) {
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
    /// Deletes an instance and everything kept for it (index entries, inbox, dedup keys,
    /// history, timers); returns the history and inbox rows removed.
    pub(super) fn remove_instance(&mut self, id: InstanceId) -> (u64, u64) {
        let Some(row) = self.rows.remove(&id) else { return (0, 0) };
        self.unindex(&row);
        if let Some(parent) = row.parent
            && let Some(children) = self.children.get_mut(&parent)
        {
            children.retain(|c| *c != id);
            if children.is_empty() {
                self.children.remove(&parent);
            }
        }
        if let Some(key) = &row.business_key {
            let k = (row.namespace.clone(), row.machine.name.clone(), key.clone());
            if let Some(ids) = self.business_keys.get_mut(&k) {
                ids.remove(&id);
                if ids.is_empty() {
                    self.business_keys.remove(&k);
                }
            }
        }
        let signals = self.inbox.remove(&id).map_or(0, |inbox| inbox.len() as u64);
        self.dedup.retain(|(target, _), _| *target != id);
        let history = self.history.remove(&id).map_or(0, |h| h.len() as u64);
        self.timers_drop(id);
        (history, signals)
    }

    pub(super) fn timers_drop(&mut self, id: InstanceId) {
        for timer in self.timers_of.remove(&id).unwrap_or_default() {
            self.timers.remove(&timer);
        }
    }

    pub(super) fn timer_remove(&mut self, id: TimerId) {
        if let Some(t) = self.timers.remove(&id)
            && let Some(set) = self.timers_of.get_mut(&t.instance)
        {
            set.remove(&id);
        }
    }
}
