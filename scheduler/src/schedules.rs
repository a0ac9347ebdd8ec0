//! The schedule runner: the background loop of a worker that fires its schedules' ticks.
//!
//! Each poll asks the core's rule ([`Schedule::poll`]) which tick, if any, is due for each
//! schedule, then starts the tick's instance (keyed by the tick, so a second worker's
//! insert of the same tick finds it taken) or broadcasts its event (with the tick as dedup
//! key). Every worker that serves a schedule fires each tick it sees; the store keeps one.
//! Right after a tick's start or broadcast succeeded, the runner records it in the
//! schedule's stored state (`Store::schedule_fired`), which every runner reads before it
//! fires: a restart set to catch up, or another worker, then never fires that tick again,
//! even once its broadcast was read or its instance pruned (which frees the tick's key).
//! A runner fires a tick only on states read after its previous fire: a poll that fires
//! several schedules reads a schedule's namespace again before firing it when an earlier
//! fire of the poll came after the read (that fire, a broadcast to many instances say,
//! may take seconds, and another worker may fire and record the later tick meanwhile).
//! So the window in which two workers both fire a tick is one worker's read to the
//! other's record of the tick: about one store call (as long as a large broadcast's).
//! A tick whose store call failed is tried again at the next poll, under the same key,
//! unless a later tick fell due meanwhile: then the later one fires instead, as a runner
//! always fires only the latest tick due (ticks it missed are not made up one by one).
//!
//! A pause or resume stored for the fleet (`Store::schedule_pause`, what `keel schedules
//! pause` and the HTTP API call) reaches every worker: before a poll fires any tick, the
//! runner reads the stored states of its schedules' namespaces (and a namespace again
//! before a later tick of the same poll, as above), and a stored state wins
//! over `paused` in the definition and over this worker's handle ([`Pause::resolve`]).
//! [`Schedules::pause`] and [`Schedules::resume`] act on this worker only, for a schedule
//! with nothing stored.

use keel_core::ports::store::{
    InsertOutcome, InsertParams, ScheduleFiredParams, ScheduleState, SignalBroadcastParams,
};
use keel_core::ports::{Clock, Store};
use keel_core::schedule::{Pause, Schedule, ScheduleAction, ScheduleInfo, TickPlan};
use keel_core::{StoreResult, Timestamp};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The longest a runner sleeps without re-reading its clock (so a virtual clock moved by
/// a test, or a wall clock that jumped, is noticed within this).
pub const CLOCK_CHECK: Duration = Duration::from_millis(250);

/// How long a runner waits before trying a tick again after a store call failed.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How stale the stored pause states a runner last read may get while no tick is due
/// (they are read again before every poll that may fire a tick, and a namespace's again
/// before each tick that follows another fire of the poll); what its handle lists.
pub const STATES_REFRESH: Duration = Duration::from_secs(5);

/// A worker's schedules and their run-time state: pause flags, what each runner fired,
/// and the listing with next fire times. Cheap to clone (a handle).
#[derive(Debug, Clone, Default)]
pub struct Schedules {
    inner: Arc<Book>,
}

#[derive(Debug, Default)]
struct Book {
    schedules: Vec<Schedule>,
    paused: Mutex<BTreeMap<String, bool>>,
    /// The stored states last read, by `(namespace, name)`.
    stored: Mutex<BTreeMap<(String, String), ScheduleState>>,
    passed: Mutex<Option<Timestamp>>,
    fired: AtomicU64,
    already_fired: AtomicU64,
    failed: AtomicU64,
}

/// What a runner did so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScheduleCounts {
    /// Ticks this runner fired first (an instance started, or a broadcast that delivered
    /// or found no instance to address).
    pub fired: u64,
    /// Ticks another worker had fired already (the key was taken).
    pub already_fired: u64,
    /// Store calls that failed, reads of the stored pause states included (each tick is
    /// tried again at the next poll), and records of fired ticks (not retried: see
    /// [`Schedules::run`]).
    pub failed: u64,
}

/// A schedule name this worker does not serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownSchedule(pub String);

impl std::fmt::Display for UnknownSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no schedule named {:?} on this worker; `list()` shows the names it serves",
            self.0
        )
    }
}

impl std::error::Error for UnknownSchedule {}

impl Schedules {
    /// A handle over `schedules` (checked by
    /// [`check_schedules`](keel_core::schedule::check_schedules) when the worker starts).
    pub fn new(schedules: Vec<Schedule>) -> Self {
        let paused = schedules.iter().map(|s| (s.name().to_owned(), s.is_paused())).collect();
        Schedules {
            inner: Arc::new(Book { schedules, paused: Mutex::new(paused), ..Book::default() }),
        }
    }

    /// The schedules served.
    pub fn schedules(&self) -> &[Schedule] {
        &self.inner.schedules
    }

    /// Stops firing `name` on this worker; ticks passed while paused are not fired later.
    /// A state stored for the fleet, once set, wins over this.
    ///
    /// # Errors
    ///
    /// [`UnknownSchedule`] when this worker has no such schedule.
    pub fn pause(&self, name: &str) -> Result<(), UnknownSchedule> {
        self.set_paused(name, true)
    }

    /// Fires `name` again from its next tick (on this worker; a state stored for the fleet,
    /// once set, wins over this).
    ///
    /// # Errors
    ///
    /// [`UnknownSchedule`] when this worker has no such schedule.
    pub fn resume(&self, name: &str) -> Result<(), UnknownSchedule> {
        self.set_paused(name, false)
    }

    /// Every schedule with its pause state and recorded fired tick (the stored ones as
    /// this runner last read them, at most [`STATES_REFRESH`] old while it runs) and the
    /// next tick that fires after `now` (the bound [`Schedule::poll`] applies), in
    /// definition order.
    pub fn list(&self, now: Timestamp) -> Vec<ScheduleInfo> {
        let paused = self.paused_now();
        let stored = self.inner.stored.lock().expect("schedule book lock").clone();
        self.inner
            .schedules
            .iter()
            .map(|s| {
                let state = stored_of(s, &stored);
                let fired_through = state.and_then(|st| st.fired_through);
                s.info(now, pause_of(s, &paused, state), fired_through)
            })
            .collect()
    }

    /// What the runner did so far.
    pub fn counts(&self) -> ScheduleCounts {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ScheduleCounts {
            fired: load(&self.inner.fired),
            already_fired: load(&self.inner.already_fired),
            failed: load(&self.inner.failed),
        }
    }

    /// The clock reading of the runner's latest poll that handled every schedule (`None`
    /// before its first poll): a test moves a virtual clock, then waits for this to reach
    /// it. It follows the clock back when the clock steps back; what each schedule passed
    /// does not.
    pub fn passed(&self) -> Option<Timestamp> {
        *self.inner.passed.lock().expect("schedule book lock")
    }

    fn set_paused(&self, name: &str, paused: bool) -> Result<(), UnknownSchedule> {
        let mut book = self.inner.paused.lock().expect("schedule book lock");
        match book.get_mut(name) {
            Some(flag) => {
                *flag = paused;
                tracing::info!(schedule = name, paused, "schedule pause state changed");
                Ok(())
            }
            None => Err(UnknownSchedule(name.to_owned())),
        }
    }

    fn paused_now(&self) -> BTreeMap<String, bool> {
        self.inner.paused.lock().expect("schedule book lock").clone()
    }

    /// Runs the schedules until `shutdown` turns true. Each poll handles every schedule
    /// once (at most one tick each), then sleeps until the earliest next tick, re-reading
    /// the clock at least every [`CLOCK_CHECK`]. A poll that may fire a tick first reads
    /// the stored states (pauses and fired ticks); when that read fails, no tick fires and
    /// the poll is tried again after [`RETRY_AFTER`]. After a poll fired a tick, it reads
    /// the namespace of the next schedule with a tick due again before firing it (at most
    /// one read per schedule and poll), so a tick another worker fired, or a pause stored,
    /// while this one fired the earlier tick is seen; when that read fails, the rest of
    /// the poll fires nothing and is tried again after [`RETRY_AFTER`]. A fired tick is
    /// then recorded in the stored state; a record that fails is logged and counted, not
    /// retried: this runner already passed the tick, and its next fired tick records past
    /// it.
    pub async fn run<S: Store + ?Sized, C: Clock>(
        self,
        store: Arc<S>,
        clock: C,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut passed: Vec<Option<Timestamp>> = vec![None; self.inner.schedules.len()];
        let mut read_at: Option<Timestamp> = None;
        // Which schedules' stored fired tick was last seen ahead of the clock (warned once
        // until it no longer is).
        let mut ahead: Vec<bool> = vec![false; self.inner.schedules.len()];
        while !*shutdown.borrow() {
            let now = clock.now();
            let paused = self.paused_now();
            // Whatever the pause states say, a schedule with no tick due fires nothing:
            // the stored states are read only when one is (or they are getting stale).
            let due = self
                .inner
                .schedules
                .iter()
                .zip(&passed)
                .any(|(s, passed)| s.poll(*passed, now, Pause::RUNNING, None).fire.is_some());
            let stale = read_at.is_none_or(|at| {
                now.as_millis() - at.as_millis() >= STATES_REFRESH.as_millis() as i64
            });
            let read_ok = if due || stale {
                let ok = self.read_states(&*store).await;
                if ok {
                    read_at = Some(now);
                }
                ok
            } else {
                true
            };
            let mut stored = self.inner.stored.lock().expect("schedule book lock").clone();
            // The namespaces whose states were read since this poll's latest fire: a fire
            // takes a store call (a broadcast to many instances may take seconds), during
            // which another worker may fire and record a later schedule's tick, or a pause
            // may be stored, so a tick fires only on states read after the previous fire.
            let mut fresh: BTreeSet<&str> = if due || stale {
                self.inner.schedules.iter().map(Schedule::namespace).collect()
            } else {
                BTreeSet::new()
            };
            let mut read_ok = read_ok;
            let mut wake: Option<Timestamp> = None;
            let mut all_handled = true;
            for ((schedule, passed), ahead) in
                self.inner.schedules.iter().zip(passed.iter_mut()).zip(ahead.iter_mut())
            {
                let may_fire = schedule.poll(*passed, now, Pause::RUNNING, None).fire.is_some();
                let mut plan = plan_of(schedule, *passed, now, &paused, &stored);
                if plan.fire.is_some() && read_ok && !fresh.contains(schedule.namespace()) {
                    let ns = schedule.namespace();
                    match self.read_namespace(&*store, ns).await {
                        Some(states) => {
                            replace_namespace(&mut stored, ns, states.clone());
                            let mut book = self.inner.stored.lock().expect("schedule book lock");
                            replace_namespace(&mut book, ns, states);
                            fresh.insert(ns);
                            plan = plan_of(schedule, *passed, now, &paused, &stored);
                        }
                        // The rest of this poll fires nothing: it is tried again after
                        // RETRY_AFTER, as after a failed read at its start.
                        None => read_ok = false,
                    }
                }
                warn_if_ahead(schedule, fired_through_of(schedule, &stored), now, ahead);
                let handled = match plan.fire {
                    // Without a fresh read a stored pause may be missed: fire nothing yet.
                    _ if may_fire && !read_ok => false,
                    Some(tick) => {
                        let handled = self.fire(&*store, schedule, tick, now).await;
                        fresh.clear();
                        handled
                    }
                    None => true,
                };
                if handled {
                    *passed = Some(plan.passed);
                    wake = match (wake, plan.next) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                } else {
                    all_handled = false;
                }
            }
            if all_handled {
                *self.inner.passed.lock().expect("schedule book lock") = Some(now);
            }
            let mut sleep = wake.map_or(CLOCK_CHECK, |at| {
                Duration::from_millis(u64::try_from(at.as_millis() - now.as_millis()).unwrap_or(0))
            });
            sleep = sleep.min(CLOCK_CHECK);
            if !all_handled {
                sleep = RETRY_AFTER;
            }
            tokio::select! {
                () = tokio::time::sleep(sleep) => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Reads the stored pause states of every namespace the schedules act in (at most
    /// [`keel_core::schedule::SCHEDULES_MAX`] namespaces, one read each); `false` when a
    /// read failed (the previous states are kept for the listing).
    async fn read_states<S: Store + ?Sized>(&self, store: &S) -> bool {
        let namespaces: BTreeSet<&str> =
            self.inner.schedules.iter().map(Schedule::namespace).collect();
        let mut stored = BTreeMap::new();
        for ns in namespaces {
            let Some(states) = self.read_namespace(store, ns).await else {
                return false;
            };
            replace_namespace(&mut stored, ns, states);
        }
        *self.inner.stored.lock().expect("schedule book lock") = stored;
        true
    }

    /// Reads the stored states of namespace `ns`; `None` (logged and counted) when the
    /// read failed.
    async fn read_namespace<S: Store + ?Sized>(
        &self,
        store: &S,
        ns: &str,
    ) -> Option<Vec<ScheduleState>> {
        match store.schedule_states(ns.to_owned()).await {
            Ok(states) => Some(states),
            Err(e) => {
                self.inner.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    namespace = ns,
                    error = %e,
                    "reading the stored schedule states failed; no tick fires until they are read"
                );
                None
            }
        }
    }

    /// Fires one tick; `true` when it is done (by this worker or another) or refused for
    /// good, `false` when the store was unavailable and the tick must be tried again.
    async fn fire<S: Store + ?Sized>(
        &self,
        store: &S,
        schedule: &Schedule,
        tick: Timestamp,
        now: Timestamp,
    ) -> bool {
        match fire_tick(store, schedule, tick, now).await {
            Ok(first) => {
                let counter = if first { &self.inner.fired } else { &self.inner.already_fired };
                counter.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("keel_schedule_ticks_total", "schedule" => schedule.name().to_owned(), "first" => first.to_string())
                    .increment(1);
                tracing::debug!(schedule = schedule.name(), tick = %tick, first, "schedule tick");
                // Recorded whoever fired it first: a worker that fired it and stopped
                // before recording leaves it to the others. A crash of this process right
                // here leaves the tick unrecorded, so a restart that catches up may fire it
                // once more (a starting tick is still kept once by its instance's key while
                // the instance exists).
                self.record(store, schedule, tick).await;
                true
            }
            // A refusal will not change on a retry: the tick is dropped, said loudly, and
            // the runner goes on with its other schedules at their own times.
            Err(e) if !e.is_retryable() => {
                self.inner.failed.fetch_add(1, Ordering::Relaxed);
                let fix = match schedule.action() {
                    ScheduleAction::Broadcast(_) => {
                        "a broadcast over the store's limit: narrow it with `state`, or start one instance that fans out"
                    }
                    ScheduleAction::Start(_) => {
                        "the store's error names what it refused in the instance the schedule starts: fix `start` in the schedule"
                    }
                };
                tracing::error!(
                    schedule = schedule.name(),
                    tick = %tick,
                    error = %e,
                    "the store refused this tick of schedules.{}; it is dropped ({fix})",
                    schedule.name()
                );
                true
            }
            Err(e) => {
                self.inner.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    schedule = schedule.name(),
                    tick = %tick,
                    error = %e,
                    "schedule tick failed; it is tried again under the same key"
                );
                false
            }
        }
    }

    /// Records `tick` as fired in the schedule's stored state. A failure is logged and
    /// counted; the tick stays passed for this runner.
    async fn record<S: Store + ?Sized>(&self, store: &S, schedule: &Schedule, tick: Timestamp) {
        let params = ScheduleFiredParams {
            namespace: schedule.namespace().to_owned(),
            name: schedule.name().to_owned(),
            tick,
        };
        let Err(e) = store.schedule_fired(params).await else {
            return;
        };
        self.inner.failed.fetch_add(1, Ordering::Relaxed);
        if e.is_retryable() {
            tracing::warn!(
                schedule = schedule.name(),
                tick = %tick,
                error = %e,
                "recording a fired tick of schedules.{} failed; a restart that catches up may fire it once more",
                schedule.name()
            );
        } else {
            tracing::error!(
                schedule = schedule.name(),
                tick = %tick,
                error = %e,
                "the store refused to record a fired tick of schedules.{}; until it is recorded a restart that catches up may fire its latest tick again",
                schedule.name()
            );
        }
    }
}

/// Warns, once until it is no longer so (`warned` remembers), when the stored fired tick
/// of `schedule` lies ahead of `now` ([`keel_core::schedule::fired_ahead`]): a clock that
/// ran ahead recorded it, and no worker fires the schedule's ticks up to it until real
/// time gets there, or until a resume re-anchors it.
fn warn_if_ahead(
    schedule: &Schedule,
    fired_through: Option<Timestamp>,
    now: Timestamp,
    warned: &mut bool,
) {
    let Some(tick) = keel_core::schedule::fired_ahead(fired_through, now) else {
        *warned = false;
        return;
    };
    if std::mem::replace(warned, true) {
        return;
    }
    tracing::warn!(
        schedule = schedule.name(),
        namespace = schedule.namespace(),
        fired_through = %tick,
        now = %now,
        "schedules.{} is recorded as fired through {tick}, ahead of this worker's clock ({now}); no worker fires its ticks up to then. If a clock ran ahead, re-anchor it: `keel schedules pause {}` then `keel schedules resume {}` (a resume re-anchors only when it ends a pause) fires from the next tick after the resume (or set fired_through to NULL on the row of namespace {:?}, name {:?} in the table schedule_states, keel_schedule_states in SQLite)",
        schedule.name(),
        schedule.name(),
        schedule.name(),
        schedule.namespace(),
        schedule.name()
    );
}

/// What `schedule` does at `now` after `passed`, by the pause and fired tick `stored`
/// holds for it.
fn plan_of(
    schedule: &Schedule,
    passed: Option<Timestamp>,
    now: Timestamp,
    paused: &BTreeMap<String, bool>,
    stored: &BTreeMap<(String, String), ScheduleState>,
) -> TickPlan {
    let state = stored_of(schedule, stored);
    schedule.poll(
        passed,
        now,
        pause_of(schedule, paused, state),
        state.and_then(|s| s.fired_through),
    )
}

/// The tick `stored` records as fired for `schedule`.
fn fired_through_of(
    schedule: &Schedule,
    stored: &BTreeMap<(String, String), ScheduleState>,
) -> Option<Timestamp> {
    stored_of(schedule, stored).and_then(|s| s.fired_through)
}

/// Puts `states`, just read for namespace `ns`, in place of what `stored` held for it.
fn replace_namespace(
    stored: &mut BTreeMap<(String, String), ScheduleState>,
    ns: &str,
    states: Vec<ScheduleState>,
) {
    stored.retain(|(namespace, _), _| namespace != ns);
    for s in states {
        stored.insert((s.namespace.clone(), s.name.clone()), s);
    }
}

/// The stored state of `schedule` in `stored`, if the store holds one.
fn stored_of<'a>(
    schedule: &Schedule,
    stored: &'a BTreeMap<(String, String), ScheduleState>,
) -> Option<&'a ScheduleState> {
    stored.get(&(schedule.namespace().to_owned(), schedule.name().to_owned()))
}

/// The pause a runner applies to `schedule`: its stored state (`stored`, from
/// [`stored_of`]) once set, else this worker's own flag.
fn pause_of(
    schedule: &Schedule,
    local: &BTreeMap<String, bool>,
    stored: Option<&ScheduleState>,
) -> Pause {
    Pause::resolve(local.get(schedule.name()).copied().unwrap_or(false), stored)
}

/// Performs one tick's action; `Ok(true)` when this call did it, `Ok(false)` when the
/// tick's key was already taken.
async fn fire_tick<S: Store + ?Sized>(
    store: &S,
    schedule: &Schedule,
    tick: Timestamp,
    now: Timestamp,
) -> StoreResult<bool> {
    match schedule.action() {
        ScheduleAction::Start(_) => {
            let new = schedule.instance_for(tick).expect("a starting schedule");
            let outcome = store.instance_insert(InsertParams { instances: vec![new], now }).await?;
            Ok(matches!(outcome.first(), Some(InsertOutcome::Inserted(_))))
        }
        ScheduleAction::Broadcast(b) => {
            let report = store
                .signal_broadcast(SignalBroadcastParams {
                    namespace: b.namespace.clone(),
                    machine: b.machine.clone(),
                    in_state: b.in_state.clone(),
                    name: b.event.clone(),
                    payload: b.payload.clone(),
                    dedup_key: Some(schedule.tick_key(tick)),
                    now,
                })
                .await?;
            // A broadcast that found no instance to address did the tick all the same:
            // nobody fired it before.
            Ok(report.delivered > 0 || report.matched == 0)
        }
    }
}
