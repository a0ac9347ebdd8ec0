//! The timer sweep service (DESIGN §6, seed 002).
//!
//! Timers are rows in the store, armed and cancelled by the commits that enter and leave
//! states. A [`Sweeper`] fires the due ones: it asks the store to fire up to `batch`
//! due timers at a time (`Store::timer_sweep`: one transaction per batch, each fire
//! delivered into the instance's inbox under the dedup key `timer:{id}:{n}`), until a
//! batch comes back short or the per-sweep bound is reached. Two sweepers running at once,
//! or a sweep re-run after a crash, never deliver a fire twice — the store's dedup keys and
//! row locks see to that — so a deployment may run the sweeper on every worker or on
//! dedicated nodes.
//!
//! **Backpressure.** Before sweeping, the sweeper reads the ready backlog
//! (`Store::queue_stats`); above `backpressure_threshold` it skips the sweep and logs a
//! warning. Skipped timers are only late, never lost: they fire on the next sweep below
//! the threshold.
//!
//! **Cadence.** Each [`SweepGroup`] (a set of machine names, or all of them) has its own
//! cadence, from 100 ms up; the default group sweeps every machine once a minute. A
//! machine's timers fire no later than the shortest cadence of a group that covers it.

use keel_core::StoreResult;
use keel_core::limits;
use keel_core::ports::store::{TimerSweepParams, TimerSweepReport};
use keel_core::ports::{Clock, Store};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The shortest cadence a group may have.
pub const CADENCE_MIN: Duration = Duration::from_millis(100);

/// Machines swept together at one cadence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepGroup {
    /// Machine names (empty = every machine).
    pub machines: Vec<String>,
    /// How often.
    pub cadence: Duration,
}

/// How the sweeper runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepConfig {
    /// Only this namespace (`None` = all).
    pub namespace: Option<String>,
    /// Sweep groups; by default one group of every machine, once a minute.
    pub groups: Vec<SweepGroup>,
    /// Most timers one store call fires (default 100).
    pub batch: usize,
    /// Most batches one sweep runs before yielding to the next cadence tick (default 100).
    pub batches_per_sweep: usize,
    /// Skip a sweep while more than this many instances are ready to run (default 10 000).
    pub backpressure_threshold: u64,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            namespace: None,
            groups: vec![SweepGroup { machines: Vec::new(), cadence: Duration::from_secs(60) }],
            batch: 100,
            batches_per_sweep: 100,
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
        if self.batches_per_sweep == 0 {
            return Err("timers.batches_per_sweep: must be at least 1".to_owned());
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
        }
        Ok(())
    }
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepOutcome {
    /// The ready backlog was above the threshold; nothing was fired.
    Skipped {
        /// The ready backlog seen.
        backlog: u64,
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
}

impl<S: Store, C: Clock> Sweeper<S, C> {
    /// A sweeper; `config` must pass [`SweepConfig::validate`].
    pub fn new(store: Arc<S>, clock: C, config: SweepConfig) -> Result<Self, String> {
        config.validate()?;
        Ok(Sweeper { store, clock, config })
    }

    /// The configuration.
    pub fn config(&self) -> &SweepConfig {
        &self.config
    }

    /// One sweep of `machines` (empty = all) at the clock's current time.
    pub async fn sweep(&self, machines: &[String]) -> StoreResult<SweepOutcome> {
        let now = self.clock.now();
        let stats = self.store.queue_stats(self.config.namespace.clone(), now).await?;
        let backlog: u64 = stats.iter().map(|q| q.ready).sum();
        if backlog > self.config.backpressure_threshold {
            tracing::warn!(
                backlog,
                threshold = self.config.backpressure_threshold,
                "timer sweep skipped: the ready backlog is above the backpressure threshold; due timers fire on a later sweep"
            );
            return Ok(SweepOutcome::Skipped { backlog });
        }
        let mut total = TimerSweepReport::default();
        let mut batches = 0;
        while batches < self.config.batches_per_sweep {
            let params = TimerSweepParams {
                namespace: self.config.namespace.clone(),
                machines: machines.to_vec(),
                limit: self.config.batch,
                now,
            };
            let report = self.store.timer_sweep(params).await?;
            batches += 1;
            total.fired += report.fired;
            total.exhausted += report.exhausted;
            total.processed += report.processed;
            if report.processed < self.config.batch as u64 {
                break;
            }
        }
        if total.processed > 0 {
            tracing::debug!(
                fired = total.fired,
                exhausted = total.exhausted,
                batches,
                "timer sweep"
            );
        }
        Ok(SweepOutcome::Swept { report: total, batches })
    }

    /// One sweep of every group, in order.
    pub async fn sweep_all(&self) -> StoreResult<Vec<SweepOutcome>> {
        let mut out = Vec::with_capacity(self.config.groups.len());
        for g in &self.config.groups {
            out.push(self.sweep(&g.machines).await?);
        }
        Ok(out)
    }

    /// Runs every group at its cadence until `shutdown` turns true.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut next: Vec<tokio::time::Instant> =
            vec![tokio::time::Instant::now(); self.config.groups.len()];
        while !*shutdown.borrow() {
            let (i, at) = next
                .iter()
                .enumerate()
                .min_by_key(|(_, t)| **t)
                .map(|(i, t)| (i, *t))
                .expect("at least one group");
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                _ = shutdown.changed() => return,
            }
            let group = &self.config.groups[i];
            if let Err(e) = self.sweep(&group.machines).await {
                tracing::warn!(error = %e, "timer sweep failed; retrying at the next tick");
            }
            next[i] = tokio::time::Instant::now() + group.cadence;
        }
    }
}
