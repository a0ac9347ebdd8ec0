//! What `MemoryStore` answers without writing: rows, an instance's detail, timer and
//! queue figures. These are reads of the collections, not decisions.

use super::{
    ActivityBucket, ActivityParams, BTreeMap, BTreeSet, Instance, InstanceDetail, InstanceId,
    InstanceListParams, QueueStats, State, Status, StoreError, StoreResult, TimerNextDueParams,
    TimerRow, TimerStatus, Timestamp, WorkerBeatParams, WorkerRecord, check_batch, limits,
};
use keel_core::ports::store::{
    ScheduleFiredParams, ScheduleForgetParams, SchedulePauseParams, ScheduleState,
};

impl State {
    pub(super) fn rows_of(&self, ids: &[InstanceId]) -> StoreResult<Vec<Instance>> {
        check_batch("ids", ids.len(), limits::ROWS_BATCH_MAX)?;
        let wanted: BTreeSet<InstanceId> = ids.iter().copied().collect();
        Ok(wanted.into_iter().filter_map(|id| self.rows.get(&id).cloned()).collect())
    }

    pub(super) fn list(&self, params: &InstanceListParams) -> StoreResult<Vec<Instance>> {
        params.validate()?;
        Ok(self
            .rows
            .values()
            .rev()
            .filter(|row| params.matches(row))
            .take(params.limit)
            .cloned()
            .collect())
    }

    pub(super) fn detail(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
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
            inbox: self.inbox_of(id).take(limits::INBOX_LIST_MAX).cloned().collect(),
            children: self.children_of(id),
            history: history[skip..].to_vec(),
            timers,
        })
    }

    pub(super) fn timer_next_due(&self, p: &TimerNextDueParams) -> Option<Timestamp> {
        self.timers
            .values()
            .filter(|t| {
                p.namespace.as_ref().is_none_or(|ns| &t.namespace == ns)
                    && (p.machines.is_empty() || p.machines.contains(&t.machine.name))
            })
            .map(|t| t.next_fire_at)
            .min()
    }

    pub(super) fn timer_status(&self, namespace: Option<&str>, now: Timestamp) -> Vec<TimerStatus> {
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

    pub(super) fn queue_stats(&self, namespace: Option<&str>, now: Timestamp) -> Vec<QueueStats> {
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

    pub(super) fn instance_activity(&self, p: &ActivityParams) -> StoreResult<Vec<ActivityBucket>> {
        p.validate()?;
        let mut out: BTreeMap<(String, String, i64), ActivityBucket> = BTreeMap::new();
        for r in self.rows.values().filter(|r| {
            matches!(r.status, Status::Done | Status::Failed)
                && p.namespace.as_deref().is_none_or(|ns| r.namespace == ns)
        }) {
            let Some(bucket) = p.bucket_of(r.updated_at) else { continue };
            let e = out
                .entry((r.namespace.clone(), r.machine.name.clone(), bucket))
                .or_insert_with(|| ActivityBucket {
                    namespace: r.namespace.clone(),
                    machine: r.machine.name.clone(),
                    bucket,
                    completed: 0,
                    failed: 0,
                    turnaround_ms_total: 0,
                });
            if r.status == Status::Done {
                e.completed += 1;
            } else {
                e.failed += 1;
            }
            e.turnaround_ms_total += u64::try_from(r.updated_at.0 - r.created_at.0).unwrap_or(0);
        }
        Ok(out.into_values().collect())
    }

    pub(super) fn worker_heartbeat(&mut self, p: &WorkerBeatParams) -> StoreResult<()> {
        p.validate()?;
        self.workers.retain(|_, w| w.last_seen_at >= p.forget_before);
        self.workers.insert(
            p.id.0.clone(),
            WorkerRecord {
                id: p.id.clone(),
                name: p.name.clone(),
                machines: p.machines.clone(),
                namespaces: p.namespaces.clone(),
                started_at: p.started_at,
                last_seen_at: p.now,
            },
        );
        Ok(())
    }

    pub(super) fn worker_list(&self, seen_since: Timestamp) -> Vec<WorkerRecord> {
        let mut list: Vec<WorkerRecord> =
            self.workers.values().filter(|w| w.last_seen_at >= seen_since).cloned().collect();
        list.sort_by(|a, b| b.last_seen_at.cmp(&a.last_seen_at).then_with(|| a.id.0.cmp(&b.id.0)));
        list.truncate(keel_core::ports::store::WORKER_LIST_MAX);
        list
    }

    pub(super) fn schedule_pause(&mut self, p: &SchedulePauseParams) -> StoreResult<ScheduleState> {
        p.validate()?;
        let key = (p.namespace.clone(), p.name.clone());
        let held = self.schedules_held(&p.namespace);
        let planned = keel_core::schedule::plan_pause(self.schedules.get(&key), held, p)?;
        Ok(self.schedule_write(key, planned))
    }

    pub(super) fn schedule_fired(&mut self, p: &ScheduleFiredParams) -> StoreResult<ScheduleState> {
        p.validate()?;
        let key = (p.namespace.clone(), p.name.clone());
        let held = self.schedules_held(&p.namespace);
        let planned = keel_core::schedule::plan_fired(self.schedules.get(&key), held, p)?;
        Ok(self.schedule_write(key, planned))
    }

    pub(super) fn schedule_forget(&mut self, p: &ScheduleForgetParams) -> StoreResult<u64> {
        p.validate()?;
        let mut deleted = 0;
        for name in &p.names {
            if self.schedules.remove(&(p.namespace.clone(), name.clone())).is_some() {
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    /// How many stored schedule states `namespace` holds.
    fn schedules_held(&self, namespace: &str) -> usize {
        self.schedules
            .range((namespace.to_owned(), String::new())..)
            .take_while(|((ns, _), _)| ns == namespace)
            .count()
    }

    /// Writes what a schedule planner decided; `None` keeps the stored state.
    fn schedule_write(
        &mut self,
        key: (String, String),
        planned: Option<ScheduleState>,
    ) -> ScheduleState {
        match planned {
            Some(state) => {
                self.schedules.insert(key, state.clone());
                state
            }
            None => self.schedules.get(&key).cloned().expect("an unchanged state is a stored one"),
        }
    }

    pub(super) fn schedule_states(&self, namespace: &str) -> Vec<ScheduleState> {
        self.schedules
            .range((namespace.to_owned(), String::new())..)
            .take_while(|((ns, _), _)| ns == namespace)
            .take(keel_core::schedule::SCHEDULE_STATES_MAX)
            .map(|(_, s)| s.clone())
            .collect()
    }
}
