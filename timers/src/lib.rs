//! The timer sweep service.
//!
//! Timers are rows in the store, armed and cancelled by the commits that enter and leave
//! states. A [`Sweeper`] fires the due ones: it asks the store to fire up to `batch`
//! due timers at a time (`Store::timer_sweep`: one transaction per batch, each fire
//! delivered into the instance's inbox under the dedup key `timer:{id}:{n}`), until a
//! batch comes back short or the per-sweep bound is reached. After a sweep's first batch
//! the next ones run `batches_in_flight` at a time, so a burst of due timers is fired in
//! parallel transactions that pick disjoint timers. Two sweepers running at once,
//! or a sweep re-run after a crash, never deliver a fire twice — the store's dedup keys and
//! row locks see to that — so a deployment may run the sweeper on every worker or on
//! dedicated nodes.
//!
//! **Backpressure.** Before sweeping, the sweeper reads the ready backlog of the machines
//! the sweep covers (`Store::queue_stats`, filtered to the group's machines: another
//! machine's backlog never holds a group back); above `backpressure_threshold` it skips
//! the sweep and logs a warning. Skipping only delays: once the group's earliest due timer
//! is overdue by more than the group's cadence, a sweep fires one batch anyway (soonest due
//! first; [`keel_core::timers::backpressure`] decides), so a backlog that never drains —
//! runnable instances in a queue no worker serves, a machine taken out of service — delays
//! timers (by about a cadence while fewer fall due than one batch a recheck fires), never
//! stops them. Ready rows in a paused queue do not
//! count: no worker claims them until the queue is resumed, so they would hold back every
//! timer for as long as the pause lasts. Only a count above the threshold is checked for
//! paused queues (`Store::queue_list`, one read per namespace with ready rows, at most
//! [`PAUSED_QUEUE_READS_MAX`] namespaces, largest backlog first), and only a count above
//! the threshold reads the group's earliest due time.
//!
//! **When it sweeps.** Each [`SweepGroup`] (a set of machine names, or all of them) sleeps
//! until the earliest due time of its timers (`Store::timer_next_due`, read after each
//! sweep) and is woken early when a commit arms an earlier timer (`Store::timer_hint_wait`:
//! in-process for the memory and SQLite stores, a NOTIFY on PostgreSQL). Its cadence is the
//! correctness fallback: a group sweeps at least that often even if every hint is lost.
//! Two sweeps of one group are at least [`SWEEP_GAP`] apart, so timers falling due in a
//! steady stream are fired in batches rather than one sweep each (and reuse a ready-backlog
//! reading up to [`BACKLOG_MAX_AGE`] old); after a sweep skipped for backpressure the
//! group counts the backlog again [`BACKPRESSURE_RECHECK`] later (or at its cadence, if
//! that is sooner), so its due timers fire about a second after the backlog has drained.
//!
//! **Precision.** With [`SweepConfig::default`] a due timer is fired within [`SWEEP_GAP`]
//! plus one sweep's duration of its due time — well within a second — and never before it
//! by the sweeping worker's clock. The due time comes from the clock of the process that
//! armed the timer, so clock skew between hosts shifts fires by that skew (earlier or
//! later); run NTP on every worker host. It fires later only while the ready backlog is
//! above the backpressure threshold (then within about [`BACKPRESSURE_RECHECK`] of the
//! backlog falling below it, and while it stays above, one batch of the group's most
//! overdue timers about every [`BACKPRESSURE_RECHECK`] once they are a cadence late), or
//! when no sweeper heard of it (hints lost, or armed by another process on the same SQLite
//! file), and then at the latest one cadence (a minute by default) after it fell due.
//! Sleeping is measured against the injected clock, re-read at least every
//! [`CLOCK_CHECK`] without touching the store, so a clock that jumps (or a virtual clock a
//! test moves) is noticed promptly.

use keel_core::limits;
use keel_core::ports::store::{TimerNextDueParams, TimerSweepParams, TimerSweepReport};
use keel_core::ports::{Clock, Store};
use keel_core::timers::{self, Backpressure};
use keel_core::{StoreResult, Timestamp};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The most batches of one sweep that may run at once ([`SweepConfig::batches_in_flight`]).
pub const BATCHES_IN_FLIGHT_MAX: usize = 16;

/// The most batches one sweep may run ([`SweepConfig::batches_per_sweep`]): a million
/// timers at the default batch of 100. A sweep holds its group, the other groups and the
/// sweeper's shutdown until it ends, so it must end; what is left fires in the next sweep,
/// [`SWEEP_GAP`] later.
pub const BATCHES_PER_SWEEP_MAX: usize = 10_000;

/// The shortest cadence a group may have.
pub const CADENCE_MIN: Duration = Duration::from_millis(100);

/// The longest cadence a group may have: the fallback must still come round.
pub const CADENCE_MAX: Duration = Duration::from_secs(24 * 3_600);

/// The shortest pause between two sweeps of one group: what a due timer may wait at most
/// beyond its due time when the group swept just before.
pub const SWEEP_GAP: Duration = Duration::from_millis(100);

/// The longest a sleeping sweeper goes without re-reading its clock (no store access).
pub const CLOCK_CHECK: Duration = Duration::from_millis(250);

/// How long a group waits before trying again after a store call failed.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How soon a group whose sweep was skipped for backpressure counts the ready backlog
/// again: once a second at most while the store is overloaded, and its due timers no more
/// than about this late once the backlog has drained.
pub const BACKPRESSURE_RECHECK: Duration = Duration::from_secs(1);

/// How old a ready-backlog reading a sweep may reuse. Reading the backlog counts the
/// instance table (tens of milliseconds with tens of thousands of live instances), and
/// sweeps that follow each other closely (timers falling due in a steady stream, a burst
/// swept batch after batch) need not count it each time; backpressure is a heuristic that
/// a one-second-old count serves as well. A reading above the threshold is never reused:
/// the sweep after a skipped one counts again.
pub const BACKLOG_MAX_AGE: Duration = Duration::from_secs(1);

/// The most namespaces whose paused queues one backlog count reads (`Store::queue_list`,
/// one call each, the namespaces with the most ready rows first). Ready rows of further
/// namespaces count in full, paused or not: with more namespaces than this holding ready
/// rows, a paused queue in one of the smaller ones can still hold sweeps back.
pub const PAUSED_QUEUE_READS_MAX: usize = 100;

/// The most machine sets, beyond its configured groups, whose backlog readings a sweeper
/// keeps ([`Sweeper::sweep`] may be called with other sets). Past it the readings are
/// dropped and counted afresh.
pub const BACKLOG_READINGS_MAX: usize = 64;

/// Machines swept together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepGroup {
    /// Machine names (empty = every machine).
    pub machines: Vec<String>,
    /// The longest the group goes without a sweep. Due timers do not wait for it (the
    /// group wakes at their due time); it is the fallback when wake-ups are lost.
    pub cadence: Duration,
}

/// How the sweeper runs.
///
/// The default — one group of every machine, a one-minute fallback cadence — fires a due
/// timer within about [`SWEEP_GAP`] (100 ms) plus one sweep's duration of its due time
/// (see the crate docs for the precision and its exceptions); a shorter cadence only
/// shortens the wait when wake-ups are lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepConfig {
    /// Only this namespace (`None` = all).
    pub namespace: Option<String>,
    /// Sweep groups; by default one group of every machine, with a one-minute fallback
    /// cadence.
    pub groups: Vec<SweepGroup>,
    /// Most timers one store call fires (default 100).
    pub batch: usize,
    /// Most batches one sweep runs before the group pauses for [`SWEEP_GAP`] (default 100,
    /// at most [`BATCHES_PER_SWEEP_MAX`]).
    pub batches_per_sweep: usize,
    /// Most batches of one sweep running at once (default 2, at most
    /// [`BATCHES_IN_FLIGHT_MAX`]). A sweep runs its first batch alone; while batches come
    /// back full, the next ones run this many at a time, each its own store call (on
    /// PostgreSQL its own connection and transaction; the batches pick disjoint timers).
    /// A burst of due timers is then fired sooner, at the cost of that many connections
    /// busy at once; a store with one writer (SQLite, memory) runs them one after another.
    pub batches_in_flight: usize,
    /// Skip a group's sweep while more than this many instances of its machines are ready
    /// to run (default 10 000), until its earliest due timer is overdue by more than its
    /// cadence: then one batch fires per sweep. Instances in a paused queue do not count:
    /// they cannot run until it is resumed.
    pub backpressure_threshold: u64,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            namespace: None,
            groups: vec![SweepGroup { machines: Vec::new(), cadence: Duration::from_secs(60) }],
            batch: 100,
            batches_per_sweep: 100,
            batches_in_flight: 2,
            backpressure_threshold: 10_000,
        }
    }
}

impl SweepConfig {
    /// Checks the bounds; the message names the field and the fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.batch == 0 || self.batch > limits::TIMER_SWEEP_BATCH_MAX {
            return Err(format!(
                "timers.batch: must be 1 to {} (got {})",
                limits::TIMER_SWEEP_BATCH_MAX,
                self.batch
            ));
        }
        if self.batches_per_sweep == 0 || self.batches_per_sweep > BATCHES_PER_SWEEP_MAX {
            return Err(format!(
                "timers.batches_per_sweep: must be 1 to {BATCHES_PER_SWEEP_MAX} (got {})",
                self.batches_per_sweep
            ));
        }
        if self.batches_in_flight == 0 || self.batches_in_flight > BATCHES_IN_FLIGHT_MAX {
            return Err(format!(
                "timers.batches_in_flight: must be 1 to {BATCHES_IN_FLIGHT_MAX} (got {})",
                self.batches_in_flight
            ));
        }
        if self.groups.is_empty() {
            return Err(
                "timers.groups: give at least one group (machines = [] covers every machine)"
                    .to_owned(),
            );
        }
        for (i, g) in self.groups.iter().enumerate() {
            if g.cadence < CADENCE_MIN {
                return Err(format!(
                    "timers.groups[{i}].cadence: {} ms is below the minimum of {} ms",
                    g.cadence.as_millis(),
                    CADENCE_MIN.as_millis()
                ));
            }
            if g.cadence > CADENCE_MAX {
                return Err(format!(
                    "timers.groups[{i}].cadence: {} s is above the maximum of {} s; due timers do not wait for the cadence, so a shorter one costs little",
                    g.cadence.as_secs(),
                    CADENCE_MAX.as_secs()
                ));
            }
        }
        Ok(())
    }

    /// The machines of `registered` whose timers no group sweeps: each named by no group,
    /// when no group is a catch-all (no machine list). Sorted, each once.
    pub fn uncovered<'a>(&self, registered: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        if self.groups.iter().any(|g| g.machines.is_empty()) {
            return Vec::new();
        }
        let swept: BTreeSet<&str> =
            self.groups.iter().flat_map(|g| g.machines.iter().map(String::as_str)).collect();
        let missed: BTreeSet<&str> =
            registered.into_iter().filter(|m| !swept.contains(m)).collect();
        missed.into_iter().map(str::to_owned).collect()
    }

    /// Logs a warning for each machine [`uncovered`](Self::uncovered) leaves out, and
    /// returns them. A worker calls it once when it starts its sweeper, with the machines
    /// it registered. Not an error: a sweeper elsewhere (a dedicated sweep node) may cover
    /// them.
    pub fn warn_uncovered<'a>(&self, registered: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let missed = self.uncovered(registered);
        for machine in &missed {
            tracing::warn!(
                machine = %machine,
                "timers of machine {machine:?} are not swept by this worker: no timer sweep \
                 group names it; if it arms timers or join deadlines, add it to a group's \
                 machines, or add a group without a machine list, unless a sweeper elsewhere \
                 covers it"
            );
        }
        missed
    }
}

/// Whether the sweep stops after this batch: fewer timers than `batch` picked (a timer
/// left for a later sweep because a commit held its instance counts as picked though not
/// processed; a store that reports no `picked` is judged by `processed`), or none of them
/// processed (every one held: the next batch would pick the same timers again).
fn came_back_short(report: &TimerSweepReport, batch: usize) -> bool {
    report.processed == 0 || report.picked.max(report.processed) < batch as u64
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepOutcome {
    /// The ready backlog was above the threshold; nothing was fired.
    Skipped {
        /// The ready backlog seen (of the sweep's machines, outside paused queues).
        backlog: u64,
    },
    /// The ready backlog was above the threshold, but the earliest due timer was overdue
    /// by more than the group's cadence: one batch, soonest due first, was fired anyway.
    Overdue {
        /// The ready backlog seen (of the sweep's machines, outside paused queues).
        backlog: u64,
        /// What the batch fired.
        report: TimerSweepReport,
    },
    /// Fired what was due (up to the per-sweep bound).
    Swept {
        /// Totals over the sweep's batches.
        report: TimerSweepReport,
        /// Store calls made.
        batches: usize,
    },
}

/// Fires due timers from a store.
pub struct Sweeper<S, C> {
    store: Arc<S>,
    clock: C,
    config: SweepConfig,
    /// Per machine set swept (sorted; empty = every machine), what backpressure knows.
    pressure: Mutex<HashMap<Vec<String>, Pressure>>,
}

/// What backpressure knows of one machine set.
#[derive(Debug, Clone, Copy, Default)]
struct Pressure {
    /// The last ready-backlog reading that let a sweep run, and when it was taken.
    reading: Option<(Instant, u64)>,
    /// The last sweep was held back (skipped, or one batch only): a run of such sweeps
    /// logs its warning once, and the sweep that ends it says so.
    held: bool,
}

impl<S: Store, C: Clock> Sweeper<S, C> {
    /// A sweeper; `config` must pass [`SweepConfig::validate`].
    pub fn new(store: Arc<S>, clock: C, config: SweepConfig) -> Result<Self, String> {
        config.validate()?;
        Ok(Sweeper { store, clock, config, pressure: Mutex::new(HashMap::new()) })
    }

    /// The configuration.
    pub fn config(&self) -> &SweepConfig {
        &self.config
    }

    /// One sweep of `machines` (empty = all) at the clock's current time. The ready
    /// backlog of those machines is counted first, unless a reading younger than
    /// [`BACKLOG_MAX_AGE`] let their previous sweep run. Above the threshold, the sweep is
    /// skipped, or fires one batch when their earliest due timer is overdue by more than
    /// the cadence of the group of exactly these machines (the shortest configured cadence
    /// when no group has them).
    pub async fn sweep(&self, machines: &[String]) -> StoreResult<SweepOutcome> {
        let now = self.clock.now();
        let mut key = machines.to_vec();
        key.sort();
        key.dedup();
        let backlog = self.backlog(&key, now).await?;
        let threshold = self.config.backpressure_threshold;
        let overdue = if backlog > threshold {
            self.next_due(machines).await?.and_then(|due| timers::overdue_by(due, now))
        } else {
            None
        };
        let decision = timers::backpressure(backlog, threshold, overdue, self.cadence_of(&key));
        let was_held = self
            .pressure(&key, |p| std::mem::replace(&mut p.held, decision != Backpressure::Sweep));
        match decision {
            Backpressure::Skip => {
                if was_held {
                    tracing::debug!(backlog, threshold, "timer sweep skipped again");
                } else {
                    tracing::warn!(
                        backlog,
                        threshold,
                        ?machines,
                        "timer sweep skipped: the ready backlog is above the backpressure threshold; due timers fire on a later sweep, at the latest one batch at a time once they are a cadence late"
                    );
                }
                Ok(SweepOutcome::Skipped { backlog })
            }
            Backpressure::OneBatch => {
                let late_ms =
                    overdue.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                if was_held {
                    tracing::debug!(
                        backlog,
                        threshold,
                        late_ms,
                        "timer sweep held back again: one batch of overdue timers"
                    );
                } else {
                    tracing::warn!(
                        backlog,
                        threshold,
                        late_ms,
                        ?machines,
                        "timer sweep held back: the ready backlog is above the backpressure threshold, but timers are overdue by more than the cadence; firing one batch per sweep"
                    );
                }
                let (report, _) = self.fire(machines, now, 1).await?;
                Ok(SweepOutcome::Overdue { backlog, report })
            }
            Backpressure::Sweep => {
                if was_held {
                    tracing::info!(
                        backlog,
                        threshold,
                        ?machines,
                        "timer sweeps resumed: the ready backlog is below the backpressure threshold"
                    );
                }
                let (report, batches) =
                    self.fire(machines, now, self.config.batches_per_sweep).await?;
                Ok(SweepOutcome::Swept { report, batches })
            }
        }
    }

    /// The cadence of the group of exactly `machines` (sorted, deduplicated), else the
    /// shortest configured one.
    fn cadence_of(&self, machines: &[String]) -> Duration {
        let same = |g: &&SweepGroup| {
            let mut m = g.machines.clone();
            m.sort();
            m.dedup();
            m == machines
        };
        let groups = &self.config.groups;
        groups
            .iter()
            .find(same)
            .or_else(|| groups.iter().min_by_key(|g| g.cadence))
            .map_or(SweepConfig::default().groups[0].cadence, |g| g.cadence)
    }

    /// Runs `f` on what backpressure knows of the machine set `key`.
    fn pressure<T>(&self, key: &[String], f: impl FnOnce(&mut Pressure) -> T) -> T {
        let mut all = self.pressure.lock().expect("backpressure lock");
        if all.len() >= self.config.groups.len() + BACKLOG_READINGS_MAX && !all.contains_key(key) {
            all.clear();
        }
        f(all.entry(key.to_vec()).or_default())
    }

    /// The ready backlog of the machine set `key` that backpressure compares with its
    /// threshold: a recent reading at or below the threshold, else a fresh count.
    async fn backlog(&self, key: &[String], now: Timestamp) -> StoreResult<u64> {
        let recent = self.pressure(key, |p| p.reading);
        if let Some((read_at, n)) = recent
            && read_at.elapsed() < BACKLOG_MAX_AGE
        {
            return Ok(n);
        }
        let n = self.count_backlog(key, now).await?;
        let keep = (n <= self.config.backpressure_threshold).then(|| (Instant::now(), n));
        self.pressure(key, |p| p.reading = keep);
        Ok(n)
    }

    /// Counts the ready rows of `machines` (empty = every machine) that workers can claim:
    /// every such ready row, less those in paused queues. Paused queues are looked up only
    /// when the whole count is above the threshold, in at most [`PAUSED_QUEUE_READS_MAX`]
    /// namespaces.
    async fn count_backlog(&self, machines: &[String], now: Timestamp) -> StoreResult<u64> {
        let mut stats = self.store.queue_stats(self.config.namespace.clone(), now).await?;
        if !machines.is_empty() {
            stats.retain(|q| machines.contains(&q.machine));
        }
        let mut n: u64 = stats.iter().map(|q| q.ready).sum();
        if n <= self.config.backpressure_threshold {
            return Ok(n);
        }
        let mut per_namespace: BTreeMap<&str, u64> = BTreeMap::new();
        for q in stats.iter().filter(|q| q.ready > 0) {
            *per_namespace.entry(&q.namespace).or_default() += q.ready;
        }
        let mut namespaces: Vec<(&str, u64)> = per_namespace.into_iter().collect();
        namespaces.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        for (namespace, _) in namespaces.into_iter().take(PAUSED_QUEUE_READS_MAX) {
            let queues = self.store.queue_list(namespace.to_owned()).await?;
            let paused: BTreeSet<&str> =
                queues.iter().filter(|q| q.paused).map(|q| q.queue.as_str()).collect();
            if paused.is_empty() {
                continue;
            }
            let stuck: u64 = stats
                .iter()
                .filter(|q| q.namespace == namespace && paused.contains(q.queue.as_str()))
                .map(|q| q.ready)
                .sum();
            n = n.saturating_sub(stuck);
        }
        Ok(n)
    }

    /// Fires what is due of `machines` at `now` in at most `batches_max` store calls;
    /// returns the totals and the calls made.
    async fn fire(
        &self,
        machines: &[String],
        now: Timestamp,
        batches_max: usize,
    ) -> StoreResult<(TimerSweepReport, usize)> {
        // Counted per call as it returns: a later call's failure leaves the fires of the
        // calls that committed counted.
        let fired_total = metrics::counter!("keel_timers_fired_total");
        let mut total = TimerSweepReport::default();
        let mut batches = 0;
        // The first batch alone (most sweeps find less than one batch due), then waves.
        let mut wave = 1;
        while batches < batches_max {
            let n = wave.min(batches_max - batches);
            let params = TimerSweepParams {
                namespace: self.config.namespace.clone(),
                machines: machines.to_vec(),
                limit: self.config.batch,
                now,
            };
            let mut calls = tokio::task::JoinSet::new();
            for _ in 0..n {
                let (store, params) = (Arc::clone(&self.store), params.clone());
                calls.spawn(async move { store.timer_sweep(params).await });
            }
            // Every call of the wave finishes (none is dropped mid-transaction) before an
            // error is returned; a panic in one goes on as a panic of the sweep.
            let (mut short, mut failed) = (false, None);
            while let Some(joined) = calls.join_next().await {
                match joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())) {
                    Ok(report) => {
                        fired_total.increment(report.fired);
                        total.fired += report.fired;
                        total.exhausted += report.exhausted;
                        total.processed += report.processed;
                        total.picked += report.picked;
                        short |= came_back_short(&report, self.config.batch);
                    }
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
            batches += n;
            if let Some(e) = failed {
                return Err(e);
            }
            if short {
                break;
            }
            wave = self.config.batches_in_flight;
        }
        if total.processed > 0 {
            tracing::debug!(
                fired = total.fired,
                exhausted = total.exhausted,
                batches,
                "timer sweep"
            );
        }
        Ok((total, batches))
    }

    /// One sweep of every group, in order.
    pub async fn sweep_all(&self) -> StoreResult<Vec<SweepOutcome>> {
        let mut out = Vec::with_capacity(self.config.groups.len());
        for g in &self.config.groups {
            out.push(self.sweep(&g.machines).await?);
        }
        Ok(out)
    }

    /// The earliest due time of the timers `machines` (empty = all) covers.
    pub async fn next_due(&self, machines: &[String]) -> StoreResult<Option<Timestamp>> {
        let params = TimerNextDueParams {
            namespace: self.config.namespace.clone(),
            machines: machines.to_vec(),
        };
        self.store.timer_next_due(params).await
    }

    /// Runs until `shutdown` turns true: each group sweeps at once, then whenever its
    /// earliest timer falls due (at least [`SWEEP_GAP`] after its last sweep), and at the
    /// latest one cadence after its last sweep. Groups sweep one at a time; when several
    /// are due at once, the one that swept longest ago goes first, so a group whose sweeps
    /// run long does not hold the others back. Store errors are logged and retried after
    /// [`RETRY_AFTER`]; they never end the loop.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut plans = vec![GroupPlan::default(); self.config.groups.len()];
        let mut cursor = 0;
        let mut hints = self.store.timer_hint_wait(cursor);
        while !*shutdown.borrow() {
            let (now, now_ts) = (Instant::now(), self.clock.now());
            let (i, at) = next_sweep(&plans, &self.config.groups, now, now_ts);
            if at <= now {
                self.sweep_group(i, &mut plans[i]).await;
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep_until(at.min(now + CLOCK_CHECK)) => {}
                hint = &mut hints => {
                    cursor = hint.cursor;
                    hints = self.store.timer_hint_wait(cursor);
                    match hint.due {
                        Some(due) => plans.iter_mut().for_each(|p| p.hear(due)),
                        None => self.reread(&mut plans).await,
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Sweeps group `i` and learns its next due time.
    async fn sweep_group(&self, i: usize, plan: &mut GroupPlan) {
        let machines = &self.config.groups[i].machines;
        plan.last = Some(Instant::now());
        plan.skipped = false;
        match self.sweep(machines).await {
            // Held back: count the backlog again shortly, whatever is due.
            Ok(SweepOutcome::Skipped { .. } | SweepOutcome::Overdue { .. }) => {
                plan.skipped = true;
                plan.due = None;
            }
            Ok(SweepOutcome::Swept { .. }) => plan.due = self.due_or_retry(machines).await,
            Err(e) => {
                tracing::warn!(error = %e, "timer sweep failed; retrying shortly");
                plan.due = Some(self.clock.now().plus(RETRY_AFTER));
            }
        }
    }

    /// After lost hints: every group reads its earliest due time again.
    async fn reread(&self, plans: &mut [GroupPlan]) {
        for (plan, group) in plans.iter_mut().zip(&self.config.groups) {
            if plan.last.is_some() {
                plan.due = self.due_or_retry(&group.machines).await;
            }
        }
    }

    async fn due_or_retry(&self, machines: &[String]) -> Option<Timestamp> {
        match self.next_due(machines).await {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "reading the next timer due time failed; retrying shortly");
                Some(self.clock.now().plus(RETRY_AFTER))
            }
        }
    }
}

/// Which group sweeps next, and when: the group whose sweep comes soonest. Groups whose
/// sweep is already due all count as due now, and among them the one that swept longest
/// ago (or never) goes first, so while one group's sweeps take longer than [`SWEEP_GAP`],
/// the overdue groups take turns rather than the first of them sweeping every time.
fn next_sweep(
    plans: &[GroupPlan],
    groups: &[SweepGroup],
    now: Instant,
    now_ts: Timestamp,
) -> (usize, Instant) {
    plans
        .iter()
        .zip(groups)
        .map(|(p, g)| (p.sweep_at(g.cadence, now, now_ts), p.last))
        .enumerate()
        // `None` (never swept) orders before any instant; equal keys keep the lower index.
        .min_by_key(|(_, (at, last))| ((*at).max(now), *last))
        .map(|(i, (at, _))| (i, at))
        .expect("at least one group")
}

/// What one group knows about its next sweep.
#[derive(Debug, Clone, Copy, Default)]
struct GroupPlan {
    /// When it last swept (`None`: never; it sweeps at once).
    last: Option<Instant>,
    /// The earliest due time of its timers as far as it knows (`None`: none known).
    due: Option<Timestamp>,
    /// Its last sweep was held back for backpressure (skipped, or one batch only): it
    /// counts the backlog again after [`BACKPRESSURE_RECHECK`] (or its cadence, if
    /// sooner), whatever is due.
    skipped: bool,
}

impl GroupPlan {
    /// When the group sweeps next, given the time on both clocks now: at its earliest due
    /// time (measured on the injected clock) but not within [`SWEEP_GAP`] of its last
    /// sweep, and no later than one cadence after it; after a skipped sweep,
    /// [`BACKPRESSURE_RECHECK`] after it.
    fn sweep_at(&self, cadence: Duration, now: Instant, now_ts: Timestamp) -> Instant {
        let Some(last) = self.last else { return now };
        let fallback = last + cadence;
        if self.skipped {
            return fallback.min(last + BACKPRESSURE_RECHECK);
        }
        match self.due {
            Some(due) => {
                // Never further than the cadence: the fallback comes first anyway.
                let ms = u64::try_from(due.0.saturating_sub(now_ts.0)).unwrap_or(0);
                let wait = Duration::from_millis(ms).min(cadence);
                (now + wait).max(last + SWEEP_GAP).min(fallback)
            }
            _ => fallback,
        }
    }

    /// A commit armed a timer due at `due`.
    fn hear(&mut self, due: Timestamp) {
        self.due = Some(self.due.map_or(due, |d| d.min(due)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (case, plan, cadence) → when the group sweeps next, in ms after `now`; the plan's
    /// last sweep is `last_ago` ms before `now`, and the injected clock reads 10 000.
    #[test]
    fn sweep_at_table() {
        let now = Instant::now();
        let minute = Duration::from_secs(60);
        let plan = |last_ago: Option<u64>, due: Option<i64>, skipped: bool| GroupPlan {
            last: last_ago.map(|ms| now - Duration::from_millis(ms)),
            due: due.map(Timestamp),
            skipped,
        };
        let cases = [
            ("never swept: at once", plan(None, None, false), minute, 0),
            ("nothing due: the cadence", plan(Some(1_000), None, false), minute, 59_000),
            ("due later: at the due time", plan(Some(1_000), Some(10_300), false), minute, 300),
            ("overdue: at once", plan(Some(1_000), Some(9_000), false), minute, 0),
            (
                "overdue right after a sweep: the gap",
                plan(Some(40), Some(9_000), false),
                minute,
                60,
            ),
            (
                "due past the cadence: the cadence",
                plan(Some(0), Some(99_000), false),
                minute,
                60_000,
            ),
            ("skipped: the recheck", plan(Some(200), Some(10_300), true), minute, 800),
            ("skipped, nothing due: the recheck", plan(Some(200), None, true), minute, 800),
            (
                "skipped, a cadence below the recheck: the cadence",
                plan(Some(200), None, true),
                Duration::from_millis(500),
                300,
            ),
            ("far future due: no overflow", plan(Some(0), Some(i64::MAX), false), minute, 60_000),
            ("far past due: no overflow", plan(Some(500), Some(i64::MIN), false), minute, 0),
        ];
        for (case, plan, cadence, want) in cases {
            let at = plan.sweep_at(cadence, now, Timestamp(10_000));
            assert_eq!(at.duration_since(now).as_millis(), want, "{case}");
        }
    }

    /// A batch is short when fewer timers than the batch were picked: timers left for a
    /// busy instance fill it as much as processed ones (a store that reports no `picked`
    /// is judged by `processed`).
    #[test]
    fn a_batch_is_short_by_the_timers_picked() {
        let report =
            |processed, picked| TimerSweepReport { processed, picked, ..Default::default() };
        let cases = [
            ("all processed", report(10, 10), false),
            ("two busy instances", report(8, 10), false),
            ("every instance busy", report(0, 10), true),
            ("fewer due", report(7, 7), true),
            ("no picked reported, full", report(10, 0), false),
            ("no picked reported, short", report(3, 0), true),
        ];
        for (case, r, short) in cases {
            assert_eq!(came_back_short(&r, 10), short, "{case}");
        }
    }

    /// A machine is uncovered only when no group names it and no group is a catch-all.
    #[test]
    fn machines_in_no_group_are_uncovered() {
        let group = |machines: &[&str]| SweepGroup {
            machines: machines.iter().map(|m| (*m).to_owned()).collect(),
            cadence: Duration::from_secs(60),
        };
        let config = |groups| SweepConfig { groups, ..SweepConfig::default() };
        let registered = ["order", "invoice", "mail", "order"];
        assert!(SweepConfig::default().uncovered(registered).is_empty(), "the default");
        let named = config(vec![group(&["order"]), group(&["invoice"])]);
        assert_eq!(named.uncovered(registered), ["mail"]);
        let catch_all = config(vec![group(&["order"]), group(&[])]);
        assert!(catch_all.uncovered(registered).is_empty(), "a group without a list");
        let none = config(vec![group(&["other"])]);
        assert_eq!(none.uncovered(registered), ["invoice", "mail", "order"], "sorted, once");
    }

    /// Two groups with timers overdue, each sweep taking longer than [`SWEEP_GAP`]: both
    /// are due again whenever a sweep ends, and they take turns, the one that swept
    /// longest ago first (a never-swept group before any other).
    #[test]
    fn overdue_groups_take_turns() {
        let minute = Duration::from_secs(60);
        let groups = vec![
            SweepGroup { machines: vec!["a".to_owned()], cadence: minute },
            SweepGroup { machines: vec!["b".to_owned()], cadence: minute },
        ];
        let now_ts = Timestamp(10_000);
        let overdue = GroupPlan { due: Some(Timestamp(9_000)), ..GroupPlan::default() };
        let mut plans = vec![overdue; 2];
        let mut now = Instant::now();
        let mut order = Vec::new();
        for _ in 0..6 {
            let (i, at) = next_sweep(&plans, &groups, now, now_ts);
            assert!(at <= now, "an overdue group sweeps at once");
            order.push(i);
            plans[i].last = Some(now);
            now += SWEEP_GAP * 3;
        }
        assert_eq!(order, [0, 1, 0, 1, 0, 1]);

        // A group past its cadence fallback is no more urgent than one with a due timer:
        // the one swept longest ago still goes first.
        let mut plans = vec![overdue; 2];
        plans[0].last = Some(now - minute * 3);
        plans[1] = GroupPlan { last: Some(now - minute * 2), ..GroupPlan::default() };
        assert_eq!(next_sweep(&plans, &groups, now, now_ts).0, 0, "swept 3 minutes ago");
        plans[0].last = Some(now - Duration::from_secs(1));
        assert_eq!(next_sweep(&plans, &groups, now, now_ts).0, 1, "swept 2 minutes ago");

        // Nothing due: the soonest sweep comes first, whatever the last sweeps.
        let plan = |due, ago| GroupPlan {
            due: Some(Timestamp(due)),
            last: Some(now - Duration::from_millis(ago)),
            skipped: false,
        };
        let plans = [plan(10_500, 10_000), plan(10_200, 200)];
        assert_eq!(next_sweep(&plans, &groups, now, now_ts), (1, now + Duration::from_millis(200)));
    }

    #[test]
    fn hearing_keeps_the_earliest() {
        let mut p = GroupPlan { due: Some(Timestamp(50)), ..GroupPlan::default() };
        p.hear(Timestamp(70));
        assert_eq!(p.due, Some(Timestamp(50)));
        p.hear(Timestamp(20));
        assert_eq!(p.due, Some(Timestamp(20)));
    }
}
