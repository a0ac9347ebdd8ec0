//! The worker: claim → run → group commit, with leases, heartbeats, a reaper, step
//! timeouts, the retry policy and graceful shutdown.
//!
//! One loop claims batches per queue while that queue has free slots; each claimed step
//! runs in its own task holding a slot. A queue of quick steps also claims a few steps
//! ahead (what its recent run times say will start within `claim_ahead`, at most its
//! spare leases), which wait in the worker for a slot, so a slot does not sit idle
//! through a claim round trip after every step. A finished step gives its running slot
//! back at once — the next claim overlaps its commit — and goes through a bounded channel to a
//! committer that gathers results into groups and commits up to `commits_in_flight`
//! groups at once, each on its own store connection: a group goes out when it is full,
//! when no group is committing or no step is running any more (a lightly loaded worker
//! commits a single step immediately), or after `commit_interval`. A heartbeat
//! task extends the leases of running steps; a reaper returns expired leases of dead
//! workers. Wake-ups come from the store's `ready_wait`, raced against a poll interval —
//! polling alone is correct.
//!
//! No background loop dies while the worker lives: a failed iteration is logged and
//! recorded in the worker's health, and the loop carries on after a bounded back-off; a
//! loop that panics (a store that cannot decode a row, say) is restarted after the same
//! back-off. Store calls whose panic would lose work — a group commit, the start-up
//! reclaim, a step's error handler — run in their own tasks, so their panic is an error
//! of that call only. [`WorkerHandle::health`] reports each loop.

use crate::health::{HealthBook, WorkerHealth, WorkerLoop};
use crate::machine::{StepContext, StepError, StepMachine};
use keel_core::config::{ConfigError, KeelConfig, QueueConfig};
use keel_core::instance::{Instance, check_name};
use keel_core::limits;
use keel_core::outcome::{Outcome, StepCommit, StepFailure};
use keel_core::plan::claim::ClaimPolicy;
use keel_core::plan::lease::ReapHold;
use keel_core::ports::store::{
    Claim, ClaimParams, CommitParams, CommitReceipt, LeaseExtendParams, LeaseReapParams,
    LeaseReleaseParams, WORKER_BEAT_INTERVAL, WorkerBeatParams,
};
use keel_core::ports::{Clock, Store};
use keel_core::retry::{self, ErrorClass, FailureKind, RefusedCommit};
use keel_core::{FencingToken, InstanceId, MachineRef, StoreError, StoreResult, WorkerId};
use keel_timers::{SweepConfig, Sweeper};
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

// Queue hints (publish after commit, claim by hint). A child module, so it reaches the
// worker's internals without widening their visibility.
#[path = "queue.rs"]
mod queue;
use crate::prune::{DeadLetterRetention, PruneCounts, PruneStats, Pruner};
use crate::schedules::Schedules;
use keel_core::retention::RetentionConfig;
pub(crate) use queue::Publisher;
pub use queue::{HintConfig, HintStats, PUBLISHES_MAX, QUEUE_CALL_TIMEOUT, RECEIVE_MARGIN};

// Armed timers follow the deployed definition (a one-shot pass at start-up).
#[path = "retime.rs"]
mod retime;

/// How a worker runs. Every field has a bound or a default that is one.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Lease owner name; a worker restarted with the same id reclaims its old leases at
    /// start-up instead of waiting for them to expire. The default, [`worker_id_for`] of
    /// the program's name, stays the same across restarts of one program on one host; two
    /// workers on one host that share a store must have different ids (see
    /// [`WorkerConfig::named`]), or each would take back the other's live leases when it
    /// starts.
    ///
    /// Within one process the worker keeps ids apart itself, per store (workers given one
    /// shared store, or made from one `Keel`): a worker with the default id whose id is
    /// already in use by a running worker on its store takes the lowest free
    /// `<host>/<program>/2`, `/3`, …, so a program that spawns its workers in the same
    /// order gets the same ids after a restart and still reclaims its own leases. A worker
    /// given any other id (`WorkerConfig::named`, or this field set) that a running worker
    /// on its store in this process already uses is refused at spawn. An id is in use from
    /// the worker's spawn until its task ends (shutdown, handle dropped and the background
    /// shutdown over, or the task ended by a panic or its runtime's end).
    pub worker_id: WorkerId,
    /// Namespaces to claim from (empty = any).
    pub namespaces: Vec<String>,
    /// Queues to claim from, each with its concurrency on this worker.
    pub queues: Vec<(String, usize)>,
    /// Most instances one claim statement returns (default 250). A claim takes the free
    /// slots of its queue up to this; at high concurrency, larger claims mean fewer
    /// claim statements per step.
    pub claim_batch: usize,
    /// How much work a queue claims beyond its free slots, counted in the recent run time
    /// of its steps: with quick steps, a claim also takes the steps that will start within
    /// this much time, and they wait in the worker for a running slot under their lease,
    /// so the queue's slots need not sit idle through a claim round trip after every
    /// step. Never more than the queue's spare leases (its concurrency, at least 32); a
    /// queue whose steps take longer than this is never claimed ahead, so other workers
    /// can take its waiting instances. `Duration::ZERO` claims only free slots.
    pub claim_ahead: Duration,
    /// Lease length; heartbeats extend it while a step runs.
    pub lease: Duration,
    /// Heartbeat period (well under `lease`).
    pub heartbeat: Duration,
    /// Longest wait between claims when idle and not woken.
    pub poll_interval: Duration,
    /// Reaper period.
    pub reap_interval: Duration,
    /// Return expired leases, of any worker, to runnable every `reap_interval` (default
    /// `true`). Off, the worker still records itself in the worker registry on that
    /// cadence; leave it off only where something else reaps (`keel serve`'s own worker
    /// does: the server's polls reap, holding off after an outage for the leases they
    /// handed out).
    pub reap_expired: bool,
    /// Most step results per group commit (default 250).
    pub commit_batch: usize,
    /// Longest a finished step waits for its group commit while other steps are still
    /// running (with none running, its group is committed at once).
    pub commit_interval: Duration,
    /// Most group commits in flight at once, each on its own store connection (1 to
    /// [`COMMITS_IN_FLIGHT_MAX`]). Finished steps gather into the next group while earlier
    /// groups commit.
    pub commits_in_flight: usize,
    /// How long shutdown waits for running steps before releasing their leases.
    pub shutdown_grace: Duration,
    /// Run the timer sweep service in this worker (`None` = off, e.g. when dedicated
    /// nodes run it).
    pub timers: Option<SweepConfig>,
    /// How often to sample `Store::queue_stats` into the pending / dead-letter gauges
    /// (`None` = never).
    pub stats_interval: Option<Duration>,
    /// Wake on the store's ready notifications (`Store::ready_wait`); `false` relies on
    /// polling alone (the correctness path, and what benchmarks compare against).
    pub notifications: bool,
    /// Retention this worker applies (`None` = no pruner). The default prunes dead letters
    /// after each registered machine's `dead_letter.retention` and keeps ended instances
    /// forever (set `ended` to prune them).
    pub retention: Option<RetentionConfig>,
    /// Schedules this worker fires (none by default). Every worker that serves a schedule
    /// fires each tick it sees; the tick's key keeps one.
    pub schedules: Schedules,
    /// The configuration file's settings (`keel.toml`), applied per queue (claim order,
    /// global limit) and per step (the machine's and the event's timeout, retry and
    /// `on_dead_letter` over what the machine set in code). `None`: the documented
    /// defaults. Set it with [`WorkerConfig::with_settings`].
    pub settings: Option<Arc<KeelConfig>>,
}

/// A queue's slots on one worker when neither the program nor the file sets them.
pub const DEFAULT_QUEUE_SLOTS: usize = 10;

/// The id of a worker given none: [`worker_id_for`] the program's name.
fn default_worker_id() -> WorkerId {
    worker_id_for(&program_name())
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            worker_id: default_worker_id(),
            namespaces: Vec::new(),
            queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), DEFAULT_QUEUE_SLOTS)],
            claim_batch: 250,
            claim_ahead: Duration::from_millis(5),
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            reap_interval: Duration::from_secs(5),
            reap_expired: true,
            commit_batch: 250,
            commit_interval: Duration::from_millis(2),
            commits_in_flight: 4,
            shutdown_grace: Duration::from_secs(10),
            timers: Some(SweepConfig::default()),
            stats_interval: Some(Duration::from_secs(15)),
            notifications: true,
            retention: Some(RetentionConfig::default()),
            schedules: Schedules::default(),
            settings: None,
        }
    }
}

impl WorkerConfig {
    /// Applies a configuration file: refuses a key this version does not apply, fires the
    /// file's `[schedules.<name>]` besides the program's (a file schedule replaces the
    /// program's of the same name and namespace; the worker's [`Schedules`] handle is a
    /// new one then, so take it from [`WorkerHandle::schedules`]), serves
    /// every queue the file names besides the worker's own ([`KeelConfig::named_queues`]:
    /// where the file starts instances, and each `[queues.<q>]` section), gives each queue
    /// the slots the file sets for it (`[queues.<q>] concurrency`, else `[queue]
    /// concurrency`, else the default 10), and keeps the file for the claim policy of
    /// each queue and the configuration of each step. A `[retention]` section replaces
    /// [`WorkerConfig::retention`] as a whole (and turns the pruner on), even one whose
    /// values are all the defaults; a key it leaves out takes its default, not the code's.
    pub fn with_settings(mut self, settings: KeelConfig) -> Result<Self, ConfigError> {
        settings.check_applied()?;
        if let Some(retention) = &settings.retention {
            retention.validate()?;
            self.retention = Some(retention.clone());
        }
        // The file starts instances in its queues; a worker that did not serve them would
        // leave those instances ready for ever.
        for queue in settings.named_queues() {
            if !self.queues.iter().any(|(q, _)| *q == queue) {
                self.queues.push((queue, DEFAULT_QUEUE_SLOTS));
            }
        }
        for (queue, slots) in &mut self.queues {
            if let Some(n) = settings.worker_slots(queue) {
                *slots = n as usize;
            }
        }
        // The file's schedules fire on this worker too, each replacing a schedule of the
        // program's with its name (the file wins, as for every other key).
        let from_file = settings.schedules()?;
        if !from_file.is_empty() {
            let mut all: Vec<_> = self
                .schedules
                .schedules()
                .iter()
                .filter(|s| {
                    from_file.iter().all(|f| f.name() != s.name() || f.namespace() != s.namespace())
                })
                .cloned()
                .collect();
            all.extend(from_file);
            self.schedules = Schedules::new(all);
        }
        self.settings = Some(Arc::new(settings));
        Ok(self)
    }

    /// The claim policy of `queue`: the file's, else the documented default (`fifo`, no
    /// limits).
    pub fn claim_policy(&self, queue: &str) -> ClaimPolicy {
        match &self.settings {
            Some(settings) => settings.claim_policy(queue),
            None => KeelConfig::default().claim_policy(queue),
        }
    }

    /// Whether hints may claim into `queue`. A queue with a queue-wide limit (a global
    /// limit, a rate or a per-key rate) is left to the claim loop, whose claim counts the
    /// limit one queue at a time: the hint loop takes no slot of it, a worker publishes no
    /// hint for its own step left runnable there, and the repair pass skips it.
    pub(crate) fn hints_claim_into(&self, queue: &str) -> bool {
        !self.claim_policy(queue).is_queue_wide()
    }

    /// The inbox order the settings file gives `machine`, if any.
    pub fn inbox_order(&self, machine: &str) -> Option<keel_core::inbox::InboxOrder> {
        self.settings.as_ref().and_then(|s| s.inbox_order(machine))
    }

    /// The configuration one step runs with: `base` (what the machine set in code for the
    /// step) under the file's levels for `machine` and `event`. The file is checked on
    /// each machine's own configuration when the worker starts; a step whose machine gives
    /// it another base ([`StepMachine::step_config`] for that step) on which the file's
    /// levels do not resolve — a file `max_delay` under the step's own `initial_delay` —
    /// runs with `base` alone. The worker counts each such step
    /// ([`WorkerStats::settings_unresolved`]) and warns once per machine, step and event,
    /// naming the error.
    pub fn step_config(
        &self,
        base: QueueConfig,
        machine: &str,
        event: Option<&str>,
    ) -> QueueConfig {
        self.resolve_step_config(&base, machine, event).unwrap_or(base)
    }

    /// [`step_config`](Self::step_config), with the error of a file that does not resolve
    /// on `base`.
    fn resolve_step_config(
        &self,
        base: &QueueConfig,
        machine: &str,
        event: Option<&str>,
    ) -> Result<QueueConfig, ConfigError> {
        match &self.settings {
            Some(settings) => settings.step_config(*base, machine, event),
            None => Ok(*base),
        }
    }

    /// Checks every field against its bound; the message names the field, what it must
    /// be and the default. [`Worker::spawn`] panics on what this refuses, and
    /// [`Worker::try_spawn`] returns it as an error. Names go through the stores' own
    /// name rule ([`check_name`]).
    pub fn validate(&self) -> Result<(), String> {
        let d = WorkerConfig::default();
        let name = |field: &str, value: &str| check_name(field, value).map_err(|e| e.message);
        name("worker_id", &self.worker_id.0).map_err(|e| {
            format!("{e}; WorkerConfig::named(\"billing\") gives one per program and host")
        })?;
        for (i, ns) in self.namespaces.iter().enumerate() {
            name(&format!("namespaces[{i}]"), ns)
                .map_err(|e| format!("{e}; leave the list empty to claim from any namespace"))?;
        }
        if self.queues.is_empty() {
            return Err(format!(
                "queues: give at least one queue and its concurrency, e.g. {:?}",
                d.queues
            ));
        }
        let limit = keel_core::config::QueueConfig::CONCURRENCY_LIMIT as usize;
        for (i, (queue, slots)) in self.queues.iter().enumerate() {
            name(&format!("queues[{i}]"), queue)?;
            if !(1..=limit).contains(slots) {
                return Err(format!(
                    "queues[{i}] ({queue}): concurrency must be 1 to {limit} (got {slots})"
                ));
            }
            if self.queues[..i].iter().any(|(q, _)| q == queue) {
                return Err(format!(
                    "queues[{i}]: queue {queue:?} is listed twice; give each queue once, \
                     with its concurrency"
                ));
            }
        }
        let counts = [
            ("claim_batch", self.claim_batch, limits::CLAIM_BATCH_MAX, d.claim_batch),
            ("commit_batch", self.commit_batch, limits::COMMIT_BATCH_MAX, d.commit_batch),
            (
                "commits_in_flight",
                self.commits_in_flight,
                COMMITS_IN_FLIGHT_MAX,
                d.commits_in_flight,
            ),
        ];
        for (field, value, max, default) in counts {
            if !(1..=max).contains(&value) {
                return Err(format!(
                    "{field}: must be 1 to {max} (got {value}); the default is {default}"
                ));
            }
        }
        let periods = [
            ("lease", self.lease, d.lease),
            ("heartbeat", self.heartbeat, d.heartbeat),
            ("poll_interval", self.poll_interval, d.poll_interval),
            ("reap_interval", self.reap_interval, d.reap_interval),
        ];
        for (field, value, default) in periods {
            if value.is_zero() {
                return Err(format!("{field}: must be more than zero; the default is {default:?}"));
            }
        }
        let spans = [
            ("claim_ahead", self.claim_ahead),
            ("lease", self.lease),
            ("heartbeat", self.heartbeat),
            ("poll_interval", self.poll_interval),
            ("reap_interval", self.reap_interval),
            ("commit_interval", self.commit_interval),
            ("shutdown_grace", self.shutdown_grace),
            ("stats_interval", self.stats_interval.unwrap_or_default()),
        ];
        for (field, value) in spans {
            if value > WORKER_PERIOD_MAX {
                return Err(format!(
                    "{field}: must be at most {} days (got {value:?}); a worker's periods are \
                     added to the clock, and a longer one means a lease or a wait that never ends",
                    WORKER_PERIOD_MAX.as_secs() / 86_400
                ));
            }
        }
        if self.stats_interval.is_some_and(|every| every.is_zero()) {
            return Err("stats_interval: must be more than zero; None turns it off".to_owned());
        }
        if self.heartbeat >= self.lease {
            return Err(format!(
                "heartbeat: must be shorter than lease, or leases run out between heartbeats \
                 (got heartbeat {:?}, lease {:?}); a third of the lease is usual",
                self.heartbeat, self.lease
            ));
        }
        Ok(())
    }

    /// The defaults, with the worker id [`worker_id_for`]`(name)`: give each worker
    /// process on one host its own `name` (for example `"billing"` and `"shipping"`), and
    /// keep it when the process restarts.
    /// Within one process, a second running worker of the same store with this name is
    /// refused at spawn (see [`WorkerConfig::worker_id`]).
    pub fn named(name: &str) -> Self {
        WorkerConfig { worker_id: worker_id_for(name), ..WorkerConfig::default() }
    }
}

/// The worker id `<host>/<name>`. It depends only on the host name and `name`, never on
/// the process id, so a worker restarted after a crash recognises the leases it held and
/// reclaims them at start-up rather than waiting out the lease.
pub fn worker_id_for(name: &str) -> WorkerId {
    WorkerId(format!("{}/{name}", host_name()))
}

/// The host name as the kernel reports it, or `localhost` where it cannot be read (the
/// standard library has no portable call for it).
fn host_name() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The running program's file name without extension (`order` for
/// `target/debug/examples/order`): the same for every restart of one deployment, and
/// different for two different programs on one host.
fn program_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|path| path.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "worker".to_owned())
}

/// Counters a worker keeps about itself.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Steps whose commit was accepted.
    pub committed: AtomicU64,
    /// Steps whose commit was rejected as `LeaseLost` (discarded).
    pub lease_lost: AtomicU64,
    /// Steps that failed (error, panic or timeout).
    pub failed_steps: AtomicU64,
    /// Running steps whose lease a heartbeat found taken (their results will be
    /// discarded). Steps whose commit was under way are not counted: committing gives
    /// the lease up.
    pub lease_lost_on_heartbeat: AtomicU64,
    /// Rows the reaper returned to runnable.
    pub reaped: AtomicU64,
    /// Leases the worker gave back and the store released: at shutdown, for claims with
    /// no slot to hold them, and for steps that ended without a result. A lease the store
    /// no longer counted as this worker's is not counted.
    pub released: AtomicU64,
    /// Step results the store refused (an invalid outcome, an emit to a missing
    /// instance, …); each was committed as a non-retryable step failure instead.
    pub refused: AtomicU64,
    /// Steps that ran with their machine's settings alone, because the configuration
    /// file's did not resolve on the settings the machine gives that step (see
    /// [`WorkerConfig::step_config`]; a warning names the error once per machine, step
    /// and event).
    pub settings_unresolved: AtomicU64,
}

impl WorkerStats {
    /// Accepted commits so far.
    pub fn committed(&self) -> u64 {
        self.committed.load(Ordering::Relaxed)
    }
}

/// A claimed step this worker holds the lease of, from its claim until its result's commit
/// went through (or its lease was released).
struct InFlight {
    token: FencingToken,
    task: JoinHandle<()>,
    /// Its result is being committed right now. Once the commit lands the lease is gone,
    /// so a heartbeat that finds it not held is no news; only running (or finished but
    /// not yet committing) steps can lose a lease that matters.
    committing: bool,
    /// Claimed ahead and not started yet: shutdown gives its lease back at once.
    waiting: bool,
    /// Its result is with the committer: the end of the shutdown grace leaves its lease
    /// alone, for the committer's last groups to commit.
    finished: bool,
    /// A heartbeat found its lease taken: counted once, and no longer extended.
    lost: bool,
}

struct Inner<S, C> {
    store: Arc<S>,
    clock: C,
    config: WorkerConfig,
    machines: HashMap<MachineRef, Arc<dyn StepMachine>>,
    in_flight: Mutex<HashMap<InstanceId, InFlight>>,
    /// Steps running user code now (claimed, not yet finished).
    running: AtomicUsize,
    /// Steps claimed ahead, waiting for a running slot.
    waiting: AtomicUsize,
    slot_freed: SlotFreed,
    stats: Arc<WorkerStats>,
    health: Arc<HealthBook>,
    /// Queue hints: the one hook of `queue.rs` into the worker's state.
    hints: Option<Arc<queue::HintLink>>,
    /// When it started, as the worker registry shows it.
    started_at: keel_core::Timestamp,
    /// The (machine, step, event) whose file settings did not resolve, warned about once
    /// each (at most [`UNRESOLVED_WARNED_MAX`]).
    unresolved: Mutex<BTreeSet<(String, String, Option<String>)>>,
    /// Leases of results the store could not take while it was unreachable, given back
    /// by the heartbeat once it answers (at most [`GIVE_BACK_MAX`]).
    give_back: Mutex<Vec<(InstanceId, FencingToken)>>,
    /// Per instance, the results given back in a row without one committing (at most
    /// [`GIVE_BACK_MAX`] instances; past it the counts start over).
    given_back: Mutex<HashMap<InstanceId, u32>>,
}

/// Most leases a worker keeps to give back after an outage; past it the oldest are left
/// to expire (each then counts an attempt its step did not fail).
const GIVE_BACK_MAX: usize = 100_000;

/// Most results of one instance given back in a row. A commit that fails as unavailable
/// every time while the store answers everything else (a statement that always times
/// out) is no outage: after this many its lease is left to expire, so the attempts count
/// and the retry policy ends the loop.
const GIVE_BACKS_IN_A_ROW_MAX: u32 = 3;

/// Most distinct (machine, step, event) a worker warns about for file settings that do not
/// resolve on a step's own settings; past it, such steps are only counted.
const UNRESOLVED_WARNED_MAX: usize = 1_000;

impl<S, C> Inner<S, C> {
    /// The configuration a step of `row` processing `event` runs with (see
    /// [`WorkerConfig::step_config`]): `base` alone when the file does not resolve on it,
    /// counted, and warned about once per machine, step and event.
    fn step_config(&self, base: &QueueConfig, row: &Instance, event: Option<&str>) -> QueueConfig {
        let machine = &row.machine.name;
        match self.config.resolve_step_config(base, machine, event) {
            Ok(config) => config,
            Err(error) => {
                self.stats.settings_unresolved.fetch_add(1, Ordering::Relaxed);
                let key = (machine.clone(), row.position.clone(), event.map(str::to_owned));
                let first = {
                    let mut warned = self.unresolved.lock().expect("unresolved lock");
                    warned.len() < UNRESOLVED_WARNED_MAX && warned.insert(key)
                };
                if first {
                    tracing::warn!(
                        machine = %machine,
                        step = %row.position,
                        event = event.unwrap_or(""),
                        error = %error,
                        "the configuration file's settings do not resolve on this step's own \
                         settings; its steps run with the machine's settings alone (said once \
                         per machine, step and event)"
                    );
                }
                *base
            }
        }
    }

    /// Steps that will hand in a result: running, or claimed ahead and waiting to run.
    fn busy(&self) -> usize {
        self.running.load(Ordering::SeqCst) + self.waiting.load(Ordering::SeqCst)
    }
}

impl<S, C: Clock> Inner<S, C> {
    /// Records a successful iteration of `which`.
    fn loop_ok(&self, which: WorkerLoop) {
        self.health.success(which, self.clock.now());
    }

    /// Keeps the lease of a result the store could not take, to give back once it
    /// answers again ([`give_back_leases`]); `false` when the instance's results were
    /// given back [`GIVE_BACKS_IN_A_ROW_MAX`] times in a row already, and its lease is
    /// left to expire.
    fn give_back(&self, id: InstanceId, token: FencingToken) -> bool {
        {
            let mut counts =
                self.given_back.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if counts.len() >= GIVE_BACK_MAX && !counts.contains_key(&id) {
                counts.clear();
            }
            let count = counts.entry(id).or_default();
            if *count >= GIVE_BACKS_IN_A_ROW_MAX {
                return false;
            }
            *count += 1;
        }
        let mut leases = self.give_back.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if leases.len() >= GIVE_BACK_MAX {
            leases.remove(0);
        }
        leases.push((id, token));
        true
    }

    /// A result of `id` committed: its give-backs in a row start over.
    fn committed(&self, id: InstanceId) {
        let mut counts = self.given_back.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !counts.is_empty() {
            counts.remove(&id);
        }
    }

    /// Records and logs a failed iteration of `which`; returns how long the loop waits
    /// at least before its next iteration.
    fn loop_failed(&self, which: WorkerLoop, error: &dyn std::fmt::Display) -> Duration {
        let pause = self.health.failure(which, self.clock.now(), error.to_string());
        tracing::error!(
            worker_loop = which.name(),
            error = %error,
            retry_in_ms = pause.as_millis() as u64,
            "background loop iteration failed; it carries on after a back-off"
        );
        pause
    }
}

/// A worker under construction: add machines, then [`Worker::spawn`].
pub struct Worker<S, C> {
    store: Arc<S>,
    /// The store as the rule that keeps worker ids apart in this process knows it.
    store_identity: StoreIdentity,
    clock: C,
    config: WorkerConfig,
    machines: HashMap<MachineRef, Arc<dyn StepMachine>>,
    hints: Option<Arc<queue::HintLink>>,
    /// The first machine registered more than once: the worker refuses to start (see
    /// [`Worker::check`]).
    registered_twice: Option<MachineRef>,
    /// The first machine registered that names what it was not given
    /// ([`StepMachine::unbound`]), with those names: the worker refuses to start.
    unbound: Option<(MachineRef, Vec<String>)>,
    /// The first machine registered whose configuration in code cannot be used
    /// ([`QueueConfig::problem_in_code`]: a field a machine's configuration does not
    /// apply, or a value out of bounds), with that reason: the worker refuses to start.
    config_problem: Option<(MachineRef, String)>,
}

impl<S: Store, C: Clock + Clone> Worker<S, C> {
    /// A worker over `store` with `config`.
    pub fn new(store: Arc<S>, clock: C, config: WorkerConfig) -> Self {
        let store_identity = StoreIdentity::of(&store);
        Worker {
            store,
            store_identity,
            clock,
            config,
            machines: HashMap::new(),
            hints: None,
            registered_twice: None,
            unbound: None,
            config_problem: None,
        }
    }

    /// Tells the worker that its store forwards to `shared`, a store other workers in this
    /// process may be given wrapped differently (each in an `Arc` of its own, say): workers
    /// whose stores are one `shared` allocation keep their ids apart
    /// ([`WorkerConfig::worker_id`]). Without it, a worker's store is the `Arc` given to
    /// [`Worker::new`].
    #[must_use]
    pub fn with_store_identity<T: ?Sized + Send + Sync + 'static>(
        mut self,
        shared: &Arc<T>,
    ) -> Self {
        self.store_identity = StoreIdentity::of(shared);
        self
    }

    /// Registers a machine; the worker claims only the `(name, version)` pairs it has, so
    /// a worker with no machine claims nothing (it still runs its schedules, timer sweeps,
    /// pruning and lease reaping).
    /// With a configuration file ([`WorkerConfig::with_settings`]) the machine first takes
    /// the file's settings for it ([`StepMachine::apply_settings`]). A `(name, version)`
    /// registered twice keeps the first machine, and the worker refuses to start
    /// ([`check`](Self::check) names it): which of two machines runs the steps of one
    /// version must not depend on the order of the calls. A machine that names what it
    /// was not given ([`StepMachine::unbound`]: a chart's action without code) makes the
    /// worker refuse to start too, naming each missing piece, rather than fail every
    /// instance that reaches it; so does a machine whose [`StepMachine::config`] sets
    /// `concurrency`, `strategy`, `priority` or `alerts`, which a machine's configuration
    /// does not apply ([`QueueConfig::not_applied_in_code`] names where each belongs), or
    /// a value out of its bounds ([`QueueConfig::problem_in_code`]).
    ///
    /// The worker serves every queue the machine starts work in
    /// ([`StepMachine::queues_started`]: a chart's region task queue and delegated
    /// children's queues) that its configuration does not list yet, with the file's slots
    /// for it or [`DEFAULT_QUEUE_SLOTS`], as it serves the queues a file names
    /// ([`WorkerConfig::with_settings`]); otherwise that work would wait where no worker
    /// claims. It claims only the machines it registers there too.
    #[must_use]
    pub fn register(mut self, mut machine: impl StepMachine) -> Self {
        if let Some(settings) = &self.config.settings {
            machine.apply_settings(settings);
        }
        let started = catch_panic(|| machine.queues_started()).unwrap_or_default();
        for queue in started {
            if self.config.queues.iter().any(|(q, _)| *q == queue) {
                continue;
            }
            let slots = self.config.settings.as_ref().and_then(|s| s.worker_slots(&queue));
            let slots = slots.map_or(DEFAULT_QUEUE_SLOTS, |n| n as usize);
            tracing::info!(
                machine = %machine.machine().name,
                queue = %queue,
                slots,
                "serving a queue this machine starts work in (region tasks or delegated \
                 children); list it in WorkerConfig::queues to choose its slots"
            );
            self.config.queues.push((queue, slots));
        }
        let m = machine.machine();
        for warning in catch_panic(|| machine.warnings()).unwrap_or_default() {
            tracing::warn!(machine = %m.name, version = m.version, "{warning}");
        }
        if self.unbound.is_none() {
            let missing = machine.unbound();
            if !missing.is_empty() {
                self.unbound = Some((machine.machine(), missing));
            }
        }
        // Checked with or without a configuration file: without one, a step runs with
        // exactly what its machine set in code.
        if self.config_problem.is_none()
            && let Some(problem) = machine.config().problem_in_code()
        {
            self.config_problem = Some((machine.machine(), problem));
        }
        match self.machines.entry(machine.machine()) {
            Entry::Occupied(taken) => {
                self.registered_twice.get_or_insert_with(|| taken.key().clone());
            }
            Entry::Vacant(free) => {
                free.insert(Arc::new(machine));
            }
        }
        self
    }

    /// Checks that the configuration file resolves for every registered machine and for
    /// each of its events the file names, on top of what the machine set in code.
    pub fn check_settings(&self) -> Result<(), ConfigError> {
        let Some(settings) = &self.config.settings else { return Ok(()) };
        settings.check_applied()?;
        for (name, machine) in &self.machines {
            let base = machine.config();
            settings.step_config(base, &name.name, None)?;
            if let Some(section) = settings.machines.get(&name.name) {
                for event in section.events.keys() {
                    settings.step_config(base, &name.name, Some(event))?;
                }
            }
        }
        Ok(())
    }

    /// What the machine `machine` registered here names but was not given
    /// ([`StepMachine::unbound`]), when it is the first such machine registered; the
    /// message [`check`](Self::check) refuses it with is [`cannot_run`](crate::machine::cannot_run)'s.
    pub fn unbound(&self, machine: &MachineRef) -> Option<&[String]> {
        self.unbound.as_ref().filter(|(m, _)| m == machine).map(|(_, missing)| missing.as_slice())
    }

    /// Why `machine`'s configuration in code cannot be used
    /// ([`QueueConfig::problem_in_code`]), when it is the first machine registered here
    /// with such a configuration, which [`check`](Self::check) refuses.
    pub fn config_problem(&self, machine: &MachineRef) -> Option<&str> {
        self.config_problem.as_ref().filter(|(m, _)| m == machine).map(|(_, p)| p.as_str())
    }

    /// The first (name, version) registered here twice, which [`check`](Self::check)
    /// refuses.
    pub fn registered_twice(&self) -> Option<&MachineRef> {
        self.registered_twice.as_ref()
    }

    /// Everything [`spawn`](Self::spawn) checks before it starts anything: each machine
    /// registered once, every name its machines use bound ([`StepMachine::unbound`]), no
    /// machine configuration in code setting a field it does not apply
    /// ([`QueueConfig::not_applied_in_code`]), every machine's configuration in code
    /// within its bounds ([`QueueConfig::validate`]: a timeout over zero, a retry policy
    /// within its bounds, …), the worker's own bounds ([`WorkerConfig::validate`]), its timer
    /// sweep ([`SweepConfig::validate`]), the configuration file for every registered
    /// machine ([`Self::check_settings`]), its schedules and its retention. The message
    /// names the setting and the fix.
    pub fn check(&self) -> Result<(), String> {
        if let Some(machine) = &self.registered_twice {
            return Err(format!(
                "machine {} v{} is registered twice on this worker; register each \
                 (name, version) once, or give the second machine a version of its own",
                machine.name, machine.version
            ));
        }
        if let Some((machine, missing)) = &self.unbound {
            let name = format!("{} v{}", machine.name, machine.version);
            return Err(crate::machine::cannot_run(&name, missing));
        }
        if let Some((m, problem)) = &self.config_problem {
            return Err(format!("machine {} v{}: {problem}", m.name, m.version));
        }
        self.config.validate().map_err(|e| format!("invalid worker configuration: {e}"))?;
        if let Some(timers) = &self.config.timers {
            timers.validate().map_err(|e| format!("invalid worker timer configuration: {e}"))?;
        }
        self.check_settings().map_err(|e| format!("invalid configuration: {e}"))?;
        keel_core::schedule::check_schedules(self.config.schedules.schedules())
            .map_err(|e| format!("invalid worker schedules: {e}"))?;
        if let Some(retention) = &self.config.retention {
            retention.validate().map_err(|e| format!("invalid worker retention: {e}"))?;
        }
        Ok(())
    }

    /// Starts the worker's tasks on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// When [`check`](Self::check) finds the configuration unusable (a zero lease, a
    /// heartbeat not under the lease, an invalid timer sweep, schedule or retention, …).
    pub fn spawn(self) -> WorkerHandle {
        self.try_spawn().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`spawn`](Self::spawn), returning what [`check`](Self::check) refuses instead of
    /// panicking on it.
    pub fn try_spawn(mut self) -> Result<WorkerHandle, String> {
        self.check()?;
        let default = self.config.worker_id == default_worker_id();
        let live = LiveId::take(&self.store_identity, &self.config.worker_id, default)?;
        if live.id != self.config.worker_id.0 {
            tracing::info!(
                worker = %live.id,
                taken = %self.config.worker_id.0,
                "another worker on this store in this process runs under the default id; \
                 this one takes the next free number (the same one after a restart when the \
                 program spawns its workers in the same order)"
            );
            self.config.worker_id = WorkerId(live.id.clone());
        }
        if let Some(sweep) = &self.config.timers {
            sweep.warn_uncovered(self.machines.keys().map(|m| m.name.as_str()));
        }
        if self.machines.is_empty() {
            tracing::info!(
                worker = %self.config.worker_id.0,
                "this worker registers no machine, so it claims nothing; it runs its \
                 schedules, timer sweeps, pruning and lease reaping only"
            );
        }
        let schedules = self.config.schedules.clone();
        let pruned = Arc::new(PruneStats::default());
        let pruner = self.config.retention.clone().map(|config| {
            // A worker that claims from every namespace purges in every namespace.
            let namespaces: Vec<Option<String>> = if self.config.namespaces.is_empty() {
                vec![None]
            } else {
                self.config.namespaces.iter().cloned().map(Some).collect()
            };
            // Each registered machine's retention; then machines this worker does not run
            // but its file names with a dead-letter retention (served by HTTP workers, say,
            // which prune nothing), under that retention. Machines neither registered nor
            // named keep their letters: this worker's defaults are not their policy.
            let mut keeps: Vec<(String, Duration)> = self
                .machines
                .iter()
                .map(|(machine, m)| {
                    let config = self.config.step_config(m.config(), &machine.name, None);
                    (machine.name.clone(), config.dead_letter.retention)
                })
                .collect();
            let registered: BTreeSet<&str> =
                self.machines.keys().map(|m| m.name.as_str()).collect();
            let named = self
                .config
                .settings
                .as_deref()
                .map(|s| crate::prune::named_dead_letter_retentions(s, &registered))
                .unwrap_or_default();
            if !named.is_empty() {
                let names: Vec<&str> = named.iter().map(|(m, _)| m.as_str()).collect();
                tracing::info!(
                    worker = %self.config.worker_id.0,
                    machines = ?names,
                    "this worker also purges the dead letters of these machines, which it does \
                     not register, under the dead-letter retention its configuration file sets \
                     for each"
                );
            }
            keeps.extend(named);
            let mut dead_letters = Vec::new();
            for (machine, keep) in keeps {
                for namespace in &namespaces {
                    dead_letters.push(DeadLetterRetention {
                        namespace: namespace.clone(),
                        machine: machine.clone(),
                        keep,
                    });
                }
            }
            dead_letters
                .sort_by(|a, b| (&a.namespace, &a.machine).cmp(&(&b.namespace, &b.machine)));
            dead_letters.dedup_by(|a, b| a.namespace == b.namespace && a.machine == b.machine);
            Pruner {
                config,
                namespaces: self.config.namespaces.clone(),
                dead_letters,
                stats: Arc::clone(&pruned),
                cursors: Arc::default(),
            }
        });
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let stats = Arc::new(WorkerStats::default());
        let health = Arc::new(HealthBook::default());
        let started_at = self.clock.now();
        let inner = Arc::new(Inner {
            started_at,
            store: self.store,
            clock: self.clock,
            config: self.config,
            machines: self.machines,
            in_flight: Mutex::new(HashMap::new()),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            slot_freed: SlotFreed::default(),
            stats: Arc::clone(&stats),
            health: Arc::clone(&health),
            hints: self.hints,
            unresolved: Mutex::default(),
            give_back: Mutex::default(),
            given_back: Mutex::default(),
        });
        let join = tokio::spawn(run(inner, shutdown_rx, pruner, live));
        Ok(WorkerHandle { shutdown: shutdown_tx, join, stats, health, schedules, pruned })
    }
}

/// A running worker.
///
/// Dropping the handle stops the worker as [`shutdown`](Self::shutdown) would — it stops
/// claiming, gives running steps the grace period, releases the leases of the rest and
/// flushes its commits — but in the background, with nobody waiting for it to end. Keep
/// the handle for as long as the worker should run, and call `shutdown` to wait for the
/// end and read the final counters.
#[must_use = "dropping a WorkerHandle stops the worker; keep it while the worker should run"]
pub struct WorkerHandle {
    shutdown: watch::Sender<bool>,
    join: JoinHandle<()>,
    stats: Arc<WorkerStats>,
    health: Arc<HealthBook>,
    schedules: Schedules,
    pruned: Arc<PruneStats>,
}

impl WorkerHandle {
    /// What the worker's pruner removed so far.
    pub fn pruned(&self) -> PruneCounts {
        self.pruned.counts()
    }

    /// The worker's schedules: pause, resume, list with next fire times, counts.
    pub fn schedules(&self) -> &Schedules {
        &self.schedules
    }

    /// The worker's counters.
    pub fn stats(&self) -> &Arc<WorkerStats> {
        &self.stats
    }

    /// Each background loop's health: whether it runs, when it last succeeded, its last
    /// error and how often it was restarted after a panic.
    pub fn health(&self) -> WorkerHealth {
        self.health.snapshot()
    }

    /// Graceful shutdown: stop claiming, let running steps finish within the grace period,
    /// release the leases of the rest, flush pending commits. Returns the final counters.
    pub async fn shutdown(self) -> Arc<WorkerStats> {
        let _ = self.shutdown.send(true);
        if let Err(e) = self.join.await {
            tracing::error!(error = %e, "worker task ended abnormally");
        }
        self.stats
    }
}

/// A finished step on its way to the committer, holding its lease slot until committed
/// (its running slot was given back when the step finished).
struct Finished {
    commit: StepCommit,
    machine: String,
    failed: bool,
    /// What the step ran with, kept to turn a result the store refuses into a failure.
    origin: Origin,
    /// Its queue is one hints never claim into ([`Pace::unhinted`]).
    unhinted: bool,
    _permit: OwnedSemaphorePermit,
}

/// The claim, context, machine and settings a step ran with.
struct Origin {
    claim: Claim,
    ctx: StepContext,
    machine: Arc<dyn StepMachine>,
    config: QueueConfig,
}

/// Most group commits one worker keeps in flight ([`WorkerConfig::commits_in_flight`]).
pub const COMMITS_IN_FLIGHT_MAX: usize = 32;

/// The longest of a worker's periods (lease, heartbeat, intervals, grace): a year.
/// Every one is added to the clock, and `Duration::MAX` would overflow it.
pub const WORKER_PERIOD_MAX: Duration = Duration::from_secs(366 * 86_400);

/// How many times a group commit is tried while the store is unavailable.
const COMMIT_TRIES: u32 = 5;
/// Longest a worker's sweeper waits for the start-up retime before its first sweep: a
/// retime the store holds up must not keep the worker's timers from firing.
const RETIME_WAIT_MAX: Duration = Duration::from_secs(60);

/// How many times a starting worker tries to take back its own old leases before it
/// leaves them to expire.
const RECLAIM_TRIES: u32 = 5;

/// Most pages of its own old leases a starting worker takes back (each up to
/// [`limits::REAP_BATCH_MAX`] leases, a million in all).
const RECLAIM_PAGES_MAX: usize = 100;

async fn run<S: Store, C: Clock + Clone>(
    inner: Arc<Inner<S, C>>,
    handle: watch::Receiver<bool>,
    pruner: Option<Pruner>,
    // Frees the worker's id when this task ends, however it ends.
    _live: LiveId,
) {
    // The loops stop on a signal of the worker's own, turned on by `shutdown()` or by the
    // handle's channel closing (the handle was dropped). Its sender lives as long as this
    // task, so no loop ever sees a closed channel, which would wake it at once, for ever.
    let (stop, shutdown) = watch::channel(false);
    let stop = Arc::new(stop);
    let relay = tokio::spawn({
        let (stop, mut handle) = (Arc::clone(&stop), handle);
        async move {
            let _ = handle.wait_for(|stopping| *stopping).await;
            stop.send_replace(true);
        }
    });
    // The heartbeat keeps the leases of running steps alive through the shutdown grace
    // and the last commits, so it has its own signal, given once those are over.
    let (beat_stop, beat) = watch::channel(false);

    // A restarted worker first takes back what it held before it crashed, before it
    // claims anything new under the same id.
    reclaim_own_leases(&inner).await;
    // The sweeper's first sweep waits for the start-up retime: after a deploy that
    // lengthens a timer, a sweep before it would fire timers due only under the old
    // duration. The gate opens when the retime ends, whether it moved everything or gave
    // up (it is bounded), and also if it panicked or was aborted (the sender is dropped),
    // so a failed retime never keeps timers from firing. It stays open: a restarted
    // sweeper passes at once.
    let (retimed, retime_gate) = watch::channel(false);
    let retiming = tokio::spawn({
        let inner = Arc::clone(&inner);
        async move {
            retime::retime_all(inner).await;
            retimed.send_replace(true);
        }
    });

    // Room for every result that can exist at once: each holds one of its queue's lease
    // slots until its group commit lands, so a step never waits to hand its result in.
    // Sized by concurrency alone, a worker of concurrency 1 could hand in only two results
    // while its commit lanes were busy: each lane that came free then took a group of
    // three, and a run of small groups, one flush each, kept the lanes busy for good.
    let queues: Arc<Vec<QueueSlots>> = Arc::new(
        inner
            .config
            .queues
            .iter()
            .map(|(q, n)| QueueSlots::new(q, *n, !inner.config.hints_claim_into(q)))
            .collect(),
    );
    let held = queues
        .iter()
        .map(|slots| QueueSlots::held_max(slots.concurrency))
        .fold(0, usize::saturating_add)
        .clamp(1, Semaphore::MAX_PERMITS);
    let (tx, rx) = mpsc::channel::<Finished>(held);
    // The receiver outlives a committer that panicked, so its restart finds the results
    // still queued.
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let committer = {
        let inner_ = Arc::clone(&inner);
        // The committer ends only when every sender is gone, so it drains at shutdown.
        tokio::spawn(supervise(Arc::clone(&inner), WorkerLoop::Committer, None, move || {
            commit_loop(Arc::clone(&inner_), Arc::clone(&rx))
        }))
    };
    let heartbeat = spawn_loop(&inner, WorkerLoop::Heartbeat, &beat, heartbeat_loop);
    let reaper = spawn_loop(&inner, WorkerLoop::Reaper, &shutdown, reap_loop);
    let sweeper = inner.config.timers.clone().map(|config| {
        spawn_loop(&inner, WorkerLoop::Sweeper, &shutdown, move |inner, mut stop| {
            let sweeper =
                Sweeper::new(Arc::clone(&inner.store), inner.clock.clone(), config.clone())
                    .expect("validated by Worker::spawn");
            let mut gate = retime_gate.clone();
            async move {
                let opened = tokio::time::timeout(RETIME_WAIT_MAX, gate.wait_for(|done| *done));
                tokio::select! {
                    // Done, or the sender is gone (the retime panicked or was aborted); or
                    // still running: a retime held up by the store (a lock wait, a stalled
                    // connection) must not keep this worker's timers from firing.
                    opened = opened => if opened.is_err() {
                        tracing::warn!(
                            waited_s = RETIME_WAIT_MAX.as_secs(),
                            "the start-up retime has not ended; sweeping timers without \
                             waiting for it (a timer whose duration the deploy changed may \
                             fire under the old one until it ends)"
                        );
                    },
                    _ = stop.wait_for(|stopping| *stopping) => return,
                }
                sweeper.run(stop).await;
            }
        })
    });
    let scheduler = (!inner.config.schedules.schedules().is_empty()).then(|| {
        spawn_loop(&inner, WorkerLoop::Schedules, &shutdown, |inner, stop| {
            let schedules = inner.config.schedules.clone();
            schedules.run(Arc::clone(&inner.store), inner.clock.clone(), stop)
        })
    });
    let pruner = pruner.map(|pruner| {
        spawn_loop(&inner, WorkerLoop::Pruner, &shutdown, move |inner, stop| {
            pruner.clone().run(Arc::clone(&inner.store), inner.clock.clone(), stop)
        })
    });
    let sampler = inner.config.stats_interval.map(|every| {
        spawn_loop(&inner, WorkerLoop::Stats, &shutdown, move |inner, stop| {
            stats_loop(inner, every, stop)
        })
    });

    // Queue hook: the hint loop, when the worker has a queue and a machine to claim
    // for (a hint claim naming no machine would take any machine's work).
    let hint_loop = if inner.machines.is_empty() {
        None
    } else {
        queue::spawn_hint_loop(&inner, &shutdown, &queues, &tx)
    };
    let repair_loop = queue::spawn_repair_loop(&inner, &shutdown);
    {
        let (inner_, stop) = (Arc::clone(&inner), shutdown.clone());
        let tx = tx.clone();
        supervise(Arc::clone(&inner), WorkerLoop::Claim, Some(shutdown.clone()), move || {
            claim_loop(Arc::clone(&inner_), Arc::clone(&queues), tx.clone(), stop.clone())
        })
        .await;
    }

    // The hint loop stops with shutdown too; it must not start steps once draining began.
    if let Some(hints) = hint_loop {
        let _ = hints.await;
    }
    retiming.abort();
    drain(&inner).await;
    drop(tx);
    let _ = committer.await;
    // Results the store could not take: their leases go back now, if it answers.
    let left = std::mem::take(
        &mut *inner.give_back.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    for chunk in left.chunks(limits::COMMIT_BATCH_MAX) {
        release(&inner, chunk.to_vec()).await;
    }
    beat_stop.send_replace(true);
    let _ = heartbeat.await;
    let _ = reaper.await;
    for task in [sweeper, scheduler, pruner, sampler, repair_loop].into_iter().flatten() {
        let _ = task.await;
    }
    // Ended already: shutdown began through it.
    let _ = relay.await;
}

/// Runs a background loop in its own task and restarts it, after a bounded back-off,
/// whenever it panics (a store decoder that panics on a bad row, say), so no loop dies
/// while the worker lives. The loop returns normally only at shutdown. With `shutdown`,
/// a pending restart is dropped once shutdown began; without, the loop is restarted
/// until it returns (the committer, which must drain).
/// Spawns a background loop that ends with `shutdown`, under [`supervise`]: `start` gets
/// the worker and a fresh shutdown receiver on every (re)start.
fn spawn_loop<S: Store, C: Clock, F, Fut>(
    inner: &Arc<Inner<S, C>>,
    which: WorkerLoop,
    shutdown: &watch::Receiver<bool>,
    start: F,
) -> JoinHandle<()>
where
    F: Fn(Arc<Inner<S, C>>, watch::Receiver<bool>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (worker, stop) = (Arc::clone(inner), shutdown.clone());
    tokio::spawn(supervise(Arc::clone(inner), which, Some(shutdown.clone()), move || {
        start(Arc::clone(&worker), stop.clone())
    }))
}

async fn supervise<S: Store, C: Clock, F, Fut>(
    inner: Arc<Inner<S, C>>,
    which: WorkerLoop,
    mut shutdown: Option<watch::Receiver<bool>>,
    start: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        inner.health.started(which);
        let panic = match tokio::spawn(start()).await {
            Ok(()) => break,
            Err(join) if join.is_panic() => panic_message(join),
            Err(join) => join.to_string(),
        };
        let pause = inner.health.panicked(which, inner.clock.now(), &panic);
        tracing::error!(
            worker_loop = which.name(),
            panic = %panic,
            restart_in_ms = pause.as_millis() as u64,
            "background loop panicked; restarting it"
        );
        match &mut shutdown {
            Some(stop) => {
                if *stop.borrow() {
                    break;
                }
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = stop.changed() => break,
                }
            }
            None => tokio::time::sleep(pause).await,
        }
    }
    inner.health.stopped(which);
}

/// A store as the id rule knows it: the address of the shared allocation, and a handle
/// that keeps it alive (so no other store takes the address while an id names it).
#[derive(Clone)]
struct StoreIdentity {
    address: usize,
    _alive: Arc<dyn Send + Sync>,
}

impl StoreIdentity {
    fn of<T: ?Sized + Send + Sync + 'static>(store: &Arc<T>) -> Self {
        StoreIdentity {
            address: Arc::as_ptr(store).cast::<()>() as usize,
            _alive: Arc::new(Arc::clone(store)),
        }
    }
}

/// The worker ids in use in this process, each with the address of its store.
static LIVE_IDS: Mutex<BTreeSet<(usize, String)>> = Mutex::new(BTreeSet::new());

fn live_ids() -> std::sync::MutexGuard<'static, BTreeSet<(usize, String)>> {
    LIVE_IDS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A worker id in use on one store in this process, until this is dropped (with the
/// worker's task).
struct LiveId {
    store: StoreIdentity,
    id: String,
}

impl LiveId {
    /// Takes `id` on `store`. A `default` id in use takes the lowest free `<id>/<n>`
    /// (from 2); any other id in use is refused, naming it.
    fn take(store: &StoreIdentity, id: &WorkerId, default: bool) -> Result<LiveId, String> {
        let mut live = live_ids();
        let taken = |live: &BTreeSet<(usize, String)>, id: &str| {
            live.contains(&(store.address, id.to_owned()))
        };
        let id = if !taken(&live, &id.0) {
            id.0.clone()
        } else if default {
            // Some number is free: the set is finite.
            let mut n = 2u64;
            loop {
                let candidate = format!("{}/{n}", id.0);
                if !taken(&live, &candidate) {
                    break candidate;
                }
                n += 1;
            }
        } else {
            return Err(format!(
                "worker id `{}` is in use by another running worker on this store in this \
                 process; each would take back the other's live leases when it starts. Give \
                 each worker its own id (WorkerConfig::named(\"...\")), leave the id at its \
                 default (this process numbers those), or shut the other worker down first",
                id.0
            ));
        };
        if id.len() > keel_core::limits::NAME_BYTES_MAX {
            return Err(format!(
                "worker id `{id}`: numbered because another running worker on this store uses \
                 the default id, it is over {} bytes; give each worker a shorter id \
                 (WorkerConfig::named(\"...\"))",
                keel_core::limits::NAME_BYTES_MAX
            ));
        }
        live.insert((store.address, id.clone()));
        Ok(LiveId { store: store.clone(), id })
    }
}

impl Drop for LiveId {
    fn drop(&mut self) {
        live_ids().remove(&(self.store.address, std::mem::take(&mut self.id)));
    }
}

/// Takes back every lease this worker id still holds (a restart after a crash), a page at
/// a time while pages come back full (at most [`RECLAIM_PAGES_MAX`] pages), trying a
/// bounded number of times; a store call that panics counts as a failed try.
async fn reclaim_own_leases<S: Store, C: Clock>(inner: &Arc<Inner<S, C>>) {
    for _ in 0..RECLAIM_TRIES {
        let task = {
            let inner = Arc::clone(inner);
            tokio::spawn(async move {
                let owner = inner.config.worker_id.clone();
                for _ in 0..RECLAIM_PAGES_MAX {
                    if reap(&inner, Some(owner.clone())).await? < limits::REAP_BATCH_MAX {
                        return Ok(true);
                    }
                }
                Ok::<_, StoreError>(false)
            })
        };
        let error = match task.await {
            Ok(Ok(true)) => return,
            Ok(Ok(false)) => {
                tracing::warn!(
                    pages = RECLAIM_PAGES_MAX,
                    "this worker's old leases fill more pages than a start-up takes back; \
                     the rest return when they expire"
                );
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(join) => format!("panicked: {}", panic_message(join)),
        };
        tokio::time::sleep(inner.loop_failed(WorkerLoop::Reaper, &error)).await;
    }
    tracing::error!(
        "could not take back this worker's old leases at start-up; they return when they expire"
    );
}

/// The fewest leases a queue may hold beyond its concurrency, whatever the concurrency:
/// finished steps waiting for their group commits and quick steps claimed ahead share
/// them. At concurrency 1, one step waiting for its commit would otherwise stop the next
/// claim until that commit's flush returns, and a claim could take only a few quick steps
/// ahead (each claim round trip and flush then carried only a few steps).
const HELD_SPARE_MIN: usize = 32;

/// The most free slots a busy queue waits for before it claims. By about 50 rows a
/// claim's fixed costs (a round trip, planning, a WAL flush) are a small part of it;
/// waiting for more — half of a large batch — lets the running slots drain while the
/// claimer waits (at concurrency 100 with batches of 250, a quarter fewer steps per
/// second). Large batches still pay off: whatever is free when the claim goes out, up to
/// the batch, comes back in one statement.
const CLAIM_WAIT_MAX: usize = 50;

/// Wake-ups for the two loops that fill freed slots: the claim loop and the hint loop.
/// Each has its own `Notify`, so a freed slot wakes both (or is kept for the next wait of
/// each): with one `Notify` between them, the wake-up of the last slots to free could go
/// to the hint loop alone, and the claim loop slept until its next poll with every slot
/// free and work ready.
#[derive(Default)]
struct SlotFreed {
    claims: Notify,
    hints: Notify,
    /// A slot of a queue hints never claim into was given back: the claim loop alone
    /// refills it, so it is woken for it even while hints flow for the other queues.
    unhinted: Notify,
}

impl SlotFreed {
    /// Slots were given back; `unhinted`: some of a queue hints do not claim into.
    fn notify(&self, unhinted: bool) {
        self.claims.notify_one();
        self.hints.notify_one();
        if unhinted {
            self.unhinted.notify_one();
        }
    }
}

/// A queue's slots on this worker. `running` bounds the steps running user code at once
/// (the queue's configured concurrency); `held` bounds the leases held, by running steps,
/// by steps claimed ahead and waiting to run, and by finished ones waiting for their group
/// commit (the concurrency plus as many again, at least [`HELD_SPARE_MIN`] more). A step
/// gives its running slot back as soon as it finishes, so the next claim overlaps its
/// commit; it keeps its lease slot until the commit lands.
struct QueueSlots {
    name: String,
    concurrency: usize,
    held: Arc<Semaphore>,
    pace: Arc<Pace>,
}

/// A queue's running slots, the steps claimed ahead that wait for one, and how long the
/// queue's steps have run lately.
struct Pace {
    running: Arc<Semaphore>,
    waiting: AtomicUsize,
    /// Hints never claim into this queue (a queue-wide limit): only the claim loop
    /// refills its freed slots.
    unhinted: bool,
    /// A moving average of the queue's recent step run times, in microseconds;
    /// `u64::MAX` until a step ran.
    step_micros: AtomicU64,
}

impl Pace {
    /// Folds one step's run time into the average (each new run weighs an eighth).
    fn record(&self, ran: Duration) {
        let ran = u64::try_from(ran.as_micros()).unwrap_or(u64::MAX - 1).min(u64::MAX - 1);
        let old = self.step_micros.load(Ordering::Relaxed);
        let new = if old == u64::MAX { ran } else { old - old / 8 + ran / 8 };
        self.step_micros.store(new, Ordering::Relaxed);
    }
}

impl QueueSlots {
    /// `unhinted`: hints never claim into the queue ([`WorkerConfig::hints_claim_into`]).
    fn new(name: &str, concurrency: usize, unhinted: bool) -> Self {
        QueueSlots {
            name: name.to_owned(),
            concurrency,
            held: Arc::new(Semaphore::new(Self::held_max(concurrency))),
            pace: Arc::new(Pace {
                running: Arc::new(Semaphore::new(concurrency)),
                waiting: AtomicUsize::new(0),
                unhinted,
                step_micros: AtomicU64::new(u64::MAX),
            }),
        }
    }

    /// The leases a queue may hold beyond its concurrency.
    fn spare(concurrency: usize) -> usize {
        concurrency.max(HELD_SPARE_MIN)
    }

    /// The leases this queue holds now: steps running, waiting to run, or waiting for
    /// their group commit.
    fn held_now(&self) -> usize {
        Self::held_max(self.concurrency).saturating_sub(self.held.available_permits())
    }

    /// The most leases a queue holds at once: its concurrency and its spare leases.
    fn held_max(concurrency: usize) -> usize {
        concurrency.saturating_add(Self::spare(concurrency))
    }

    /// How many more steps this queue can start now.
    fn free(&self) -> usize {
        self.pace.running.available_permits().min(self.held.available_permits())
    }

    /// How many steps this queue may claim beyond its concurrency: as many as its recent
    /// run times say will start within `budget`, at most its spare leases, none until a
    /// step has run (a queue of slow steps is never claimed ahead).
    fn ahead(&self, budget: Duration) -> usize {
        let micros = self.pace.step_micros.load(Ordering::Relaxed);
        if micros == u64::MAX || budget.is_zero() {
            return 0;
        }
        let budget = u64::try_from(budget.as_micros()).unwrap_or(u64::MAX);
        let n = usize::try_from(budget / micros.max(1)).unwrap_or(usize::MAX);
        n.min(Self::spare(self.concurrency))
    }

    /// How many steps a claim of this queue may take now: its free running slots plus what
    /// it may claim ahead, less the steps already waiting, within the free lease slots.
    fn claimable(&self, ahead_budget: Duration) -> usize {
        let running = self.concurrency.saturating_sub(self.pace.running.available_permits());
        let taken = running + self.pace.waiting.load(Ordering::SeqCst);
        (self.concurrency + self.ahead(ahead_budget))
            .saturating_sub(taken)
            .min(self.held.available_permits())
    }

    /// The fewest free slots worth a claim while steps are still running: half a batch
    /// (of the slots and what may be claimed ahead), at most [`CLAIM_WAIT_MAX`]. Claiming
    /// every slot the moment it frees would cost a claim round trip and a commit flush per
    /// step or two; waiting for half a batch keeps claims batched and still overlaps them
    /// with the running steps and the commits in flight. The claim then takes every free
    /// slot, up to the batch.
    fn worth_claiming(&self, claim_batch: usize, ahead_budget: Duration) -> usize {
        ((self.concurrency + self.ahead(ahead_budget)).min(claim_batch) / 2)
            .clamp(1, CLAIM_WAIT_MAX)
    }

    /// A lease slot and a running slot for one claimed step, if both are free; with
    /// `ahead`, a lease slot alone when no running slot is, the step then waiting for one.
    fn take<S, C>(
        &self,
        inner: &Arc<Inner<S, C>>,
        ahead: bool,
    ) -> Option<(RunSlot<S, C>, OwnedSemaphorePermit)> {
        let held = Arc::clone(&self.held).try_acquire_owned().ok()?;
        match Arc::clone(&self.pace.running).try_acquire_owned() {
            Ok(running) => {
                let running = Running::new(inner, &self.pace, running);
                Some((RunSlot::Taken(running), held))
            }
            Err(_) if ahead => {
                self.pace.waiting.fetch_add(1, Ordering::SeqCst);
                inner.waiting.fetch_add(1, Ordering::SeqCst);
                let waiting = Ahead { inner: Arc::clone(inner), pace: Arc::clone(&self.pace) };
                Some((RunSlot::Ahead(waiting), held))
            }
            Err(_) => None,
        }
    }
}

/// A claimed step's running slot: taken at the claim, or waited for.
enum RunSlot<S, C> {
    Taken(Running<S, C>),
    Ahead(Ahead<S, C>),
}

impl<S, C> RunSlot<S, C> {
    fn waiting(&self) -> bool {
        matches!(self, RunSlot::Ahead(_))
    }
}

/// A step claimed ahead, waiting for one of its queue's running slots. Dropping it
/// (started, or aborted by shutdown) takes it out of the waiting counts.
struct Ahead<S, C> {
    inner: Arc<Inner<S, C>>,
    pace: Arc<Pace>,
}

impl<S, C> Ahead<S, C> {
    /// Waits for a running slot (the queue's waiting steps get them in claim order).
    async fn start(self) -> Running<S, C> {
        let permit = Arc::clone(&self.pace.running)
            .acquire_owned()
            .await
            .expect("the running slots are never closed");
        // Counted as running before it stops counting as waiting, so the worker never
        // looks idle in between.
        Running::new(&self.inner, &self.pace, permit)
    }
}

impl<S, C> Drop for Ahead<S, C> {
    fn drop(&mut self) {
        self.pace.waiting.fetch_sub(1, Ordering::SeqCst);
        self.inner.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A step running user code. Dropping it — when the step finished, or when its task was
/// aborted — gives the running slot back and wakes the claimer.
struct Running<S, C> {
    inner: Arc<Inner<S, C>>,
    pace: Arc<Pace>,
    permit: Option<OwnedSemaphorePermit>,
}

impl<S, C> Running<S, C> {
    fn new(inner: &Arc<Inner<S, C>>, pace: &Arc<Pace>, permit: OwnedSemaphorePermit) -> Self {
        inner.running.fetch_add(1, Ordering::SeqCst);
        Running { inner: Arc::clone(inner), pace: Arc::clone(pace), permit: Some(permit) }
    }
}

impl<S, C> Drop for Running<S, C> {
    fn drop(&mut self) {
        // The slot goes back before the claimer is woken: woken first, it could look at
        // the semaphore, find no free slot and go back to sleep until the next poll.
        drop(self.permit.take());
        self.inner.running.fetch_sub(1, Ordering::SeqCst);
        self.inner.slot_freed.notify(self.pace.unhinted);
    }
}

/// Claims batches per queue while the queue has free slots, and starts each claimed step.
async fn claim_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    queues: Arc<Vec<QueueSlots>>,
    tx: mpsc::Sender<Finished>,
    mut shutdown: watch::Receiver<bool>,
) {
    let machines: Vec<MachineRef> = inner.machines.keys().cloned().collect();
    if machines.is_empty() {
        // A claim naming no machine takes any machine's work: a worker that registers
        // none claims nothing, and only runs its other loops until shutdown.
        inner.loop_ok(WorkerLoop::Claim);
        let _ = shutdown.wait_for(|stopping| *stopping).await;
        return;
    }
    // Each queue backs off on its own: one queue whose claims fail waits out its back-off
    // while the others keep their pace.
    let mut backoffs: Vec<QueueBackoff> = queues.iter().map(|_| QueueBackoff::default()).collect();
    // Woken for a queue hints never claim into while hints flow: only such queues are
    // this round's (the others' freed slots are the hints' while they flow).
    let mut only_unhinted = false;
    while !*shutdown.borrow() {
        let mut claimed = 0;
        let mut full = true;
        for (slots, backoff) in queues.iter().zip(&mut backoffs) {
            if only_unhinted && !slots.pace.unhinted {
                continue;
            }
            let queue = &slots.name;
            match backoff.retry_at {
                Some(at) if Instant::now() < at => continue,
                Some(_) => backoff.retry_at = None,
                None => {}
            }
            let free = slots
                .claimable(inner.config.claim_ahead)
                .min(inner.config.claim_batch)
                .min(limits::CLAIM_BATCH_MAX);
            // Leases that come back soon — steps running, waiting to run, or waiting for
            // their group commit — are worth waiting for until half a batch is free:
            // claiming each group commit's few returned slots the moment it lands would
            // split the queue's claims into ever smaller ones.
            let busy = inner.busy() > 0 || slots.held_now() > 0;
            if free == 0
                || (busy
                    && free
                        < slots.worth_claiming(inner.config.claim_batch, inner.config.claim_ahead))
            {
                continue;
            }
            full = false;
            let params = ClaimParams {
                worker: inner.config.worker_id.clone(),
                namespaces: inner.config.namespaces.clone(),
                queues: vec![queue.clone()],
                machines: machines.clone(),
                limit: free,
                lease: inner.config.lease,
                now: inner.clock.now(),
                policy: inner.config.claim_policy(queue),
            };
            let claims = match inner.store.instance_claim(params).await {
                Ok(c) => {
                    *backoff = QueueBackoff::default();
                    c
                }
                Err(e) => {
                    backoff.failed(&inner, queue, &e);
                    Vec::new()
                }
            };
            claimed += claims.len();
            launch(&inner, std::slice::from_ref(slots), &tx, claims, true).await;
        }
        // Healthy once no queue's last claim failed.
        if backoffs.iter().all(|b| b.failures == 0) {
            inner.loop_ok(WorkerLoop::Claim);
        }
        let retry_at = backoffs.iter().filter_map(|b| b.retry_at).min();
        only_unhinted = false;
        if claimed == 0 || full {
            let retry_at = retry_at.map(tokio::time::Instant::from_std);
            let for_unhinted = tokio::select! {
                () = inner.store.ready_wait(), if inner.config.notifications => false,
                () = tokio::time::sleep(inner.config.poll_interval) => false,
                // A queue backing off comes back when its back-off ends.
                () = tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now)), if retry_at.is_some() => false,
                // Queue hook: while hints bring work, freed slots are theirs and polling
                // repairs; when they stop, the slots are this loop's again at once.
                () = inner.slot_freed.claims.notified(), if full && !queue::hints_flowing(&inner) => false,
                () = queue::hints_stopped(&inner), if full && queue::hints_flowing(&inner) => false,
                // A queue hints never claim into (a queue-wide limit) is this loop's alone,
                // hints flowing for the other queues or not, and a worker with a queue
                // polls slowly: a step of it that ends or commits (its next step ready
                // now) wakes this loop, full or not.
                () = inner.slot_freed.unhinted.notified(), if inner.hints.is_some() => true,
                _ = shutdown.changed() => false,
            };
            only_unhinted = for_unhinted && queue::hints_flowing(&inner);
        }
    }
}

/// One queue's back-off in the claim loop.
#[derive(Default)]
struct QueueBackoff {
    /// Its claims failed this many times in a row.
    failures: u32,
    /// Not claimed from before then.
    retry_at: Option<Instant>,
}

impl QueueBackoff {
    /// A claim of `queue` failed: it is recorded in the claim loop's health and logged,
    /// and the queue waits out its own back-off (at least the poll interval) before it is
    /// claimed from again.
    fn failed<S, C: Clock>(&mut self, inner: &Inner<S, C>, queue: &str, error: &StoreError) {
        self.failures = self.failures.saturating_add(1);
        let pause = crate::health::backoff(self.failures).max(inner.config.poll_interval);
        let message = format!("claim from queue {queue}: {error}");
        inner.health.failure(WorkerLoop::Claim, inner.clock.now(), message);
        tracing::error!(
            worker_loop = WorkerLoop::Claim.name(),
            queue,
            error = %error,
            retry_in_ms = pause.as_millis() as u64,
            "claiming from a queue failed; it is tried again after a back-off, while the \
             other queues keep their pace"
        );
        self.retry_at = Some(Instant::now() + pause);
    }
}

/// Samples the store's counts into gauges: pending (ready), scheduled, executing, waiting
/// and suspended (the dead-letter queue size) per queue and machine.
async fn stats_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let gauges = SampledGauges::default();
    while !*shutdown.borrow() {
        let pause = match inner.store.queue_stats(None, inner.clock.now()).await {
            Ok(stats) => {
                let mut sample = GaugeSample::default();
                for q in &stats {
                    record_queue_gauges(&mut sample, q);
                }
                gauges.publish(sample);
                inner.loop_ok(WorkerLoop::Stats);
                every
            }
            Err(e) => inner.loop_failed(WorkerLoop::Stats, &e).max(every),
        };
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// Records one queue's counts in the `keel_queue_*` gauges (labelled by namespace, queue
/// and machine): pending (ready), scheduled, processing (executing), waiting, and the
/// dead-letter queue size (suspended). The worker's sampler and `keel serve`'s `/metrics`
/// both record through this one function, so the two never disagree on names or meaning.
pub fn record_queue_gauges(sample: &mut GaugeSample, q: &keel_core::ports::store::QueueStats) {
    let labels = [
        ("namespace", q.namespace.clone()),
        ("queue", q.queue.clone()),
        ("machine", q.machine.clone()),
    ];
    sample.set("keel_queue_pending", &labels, q.ready as f64);
    sample.set("keel_queue_scheduled", &labels, q.scheduled as f64);
    sample.set("keel_queue_processing", &labels, q.executing as f64);
    sample.set("keel_queue_waiting", &labels, q.waiting as f64);
    sample.set("keel_queue_dlq_size", &labels, q.suspended as f64);
}

/// One gauge series: its name and labels.
type Series = (&'static str, Vec<(&'static str, String)>);

/// The gauge values one sample of the store read, to hand to [`SampledGauges::publish`].
#[derive(Debug, Default)]
pub struct GaugeSample {
    values: BTreeMap<Series, f64>,
}

impl GaugeSample {
    /// Sets `name{labels}` to `value` in this sample.
    pub fn set(&mut self, name: &'static str, labels: &[(&'static str, String)], value: f64) {
        self.values.insert((name, labels.to_vec()), value);
    }
}

/// Gauges sampled from the store. The store reports only the groups that hold something,
/// so a queue drained to nothing, or a dead-letter list purged, is simply absent from the
/// next sample; a series an earlier sample set and this one did not see is set to 0, so
/// it reads what the store holds instead of its last count for ever.
#[derive(Debug, Default)]
pub struct SampledGauges {
    last: Mutex<BTreeSet<Series>>,
}

impl SampledGauges {
    /// Records `sample`, and 0 for every series the previous sample set that it lacks.
    pub fn publish(&self, sample: GaugeSample) {
        let mut last = self.last.lock().expect("sampled gauges lock");
        for (name, labels) in last.iter().filter(|series| !sample.values.contains_key(*series)) {
            metrics::gauge!(*name, labels).set(0.0);
        }
        *last = sample.values.keys().cloned().collect();
        for ((name, labels), value) in sample.values {
            metrics::gauge!(name, &labels).set(value);
        }
    }
}

/// Shutdown: wait (bounded) for running steps, then release the leases of the steps
/// still running or waiting to run. Results already with the committer keep their leases
/// (the heartbeat goes on until the committer drained): the grace period is there for
/// them to commit.
async fn drain<S: Store, C: Clock>(inner: &Arc<Inner<S, C>>) {
    // Steps claimed ahead that have not started give their leases back at once, without
    // counting an attempt.
    let waiting = stop_in_flight(inner, |f| f.waiting);
    if !waiting.is_empty() {
        release(inner, waiting).await;
    }
    let deadline = Instant::now() + inner.config.shutdown_grace;
    while Instant::now() < deadline && !inner.in_flight.lock().expect("in_flight lock").is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rest = stop_in_flight(inner, |f| !f.finished);
    if !rest.is_empty() {
        release(inner, rest).await;
    }
}

/// Takes the in-flight steps that `which` picks out of the worker, aborting their tasks;
/// returns their leases, for release.
fn stop_in_flight<S, C>(
    inner: &Inner<S, C>,
    which: impl Fn(&InFlight) -> bool,
) -> Vec<(InstanceId, FencingToken)> {
    let mut in_flight = inner.in_flight.lock().expect("in_flight lock");
    in_flight
        .extract_if(|_, f| which(f))
        .map(|(id, f)| {
            f.task.abort();
            (id, f.token)
        })
        .collect()
}

/// The in-flight entry of one claim: the instance's entry if it still holds that claim's
/// token. An instance whose commit landed may already be claimed again, under a newer
/// token, before the older claim's group settled; that entry is not the older claim's.
fn claim_entry(
    in_flight: &mut HashMap<InstanceId, InFlight>,
    id: InstanceId,
    token: FencingToken,
) -> Option<&mut InFlight> {
    in_flight.get_mut(&id).filter(|e| e.token == token)
}

/// Takes out the in-flight entry of exactly this claim; whether there was one. A newer
/// claim of the instance (its next step, claimed before this one settled) keeps its own.
fn remove_claim_entry(
    in_flight: &mut HashMap<InstanceId, InFlight>,
    id: InstanceId,
    token: FencingToken,
) -> bool {
    match in_flight.entry(id) {
        Entry::Occupied(entry) if entry.get().token == token => {
            entry.remove();
            true
        }
        _ => false,
    }
}

/// Tries a release makes while the store answers with a retryable error.
const RELEASE_TRIES: u32 = 3;

/// Gives `leases` back; counts those the store released (a lease another worker took in
/// the meantime is not this worker's to give back). A store that fails for a moment is
/// asked again a bounded number of times: a lease not given back waits for its expiry,
/// and its step then counts an attempt it never made. The leases go in calls of at most
/// [`limits::COMMIT_BATCH_MAX`], the most one release takes (shutdown may give back more).
async fn release<S: Store, C: Clock>(inner: &Inner<S, C>, leases: Vec<(InstanceId, FencingToken)>) {
    for chunk in leases.chunks(limits::COMMIT_BATCH_MAX) {
        release_batch(inner, chunk).await;
    }
}

/// [`release`] of at most [`limits::COMMIT_BATCH_MAX`] leases in one call.
async fn release_batch<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    leases: &[(InstanceId, FencingToken)],
) {
    for attempt in 1..=RELEASE_TRIES {
        let params = LeaseReleaseParams { leases: leases.to_vec(), now: inner.clock.now() };
        match inner.store.lease_release(params).await {
            Ok(released) => {
                let n = released.into_iter().filter(|held| *held).count() as u64;
                inner.stats.released.fetch_add(n, Ordering::Relaxed);
                return;
            }
            Err(e) if e.is_retryable() && attempt < RELEASE_TRIES => {
                tracing::warn!(error = %e, attempt, "releasing leases failed; trying again");
                tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "releasing leases failed; the reaper will return them");
                return;
            }
        }
    }
}

fn context_of(claim: &Claim, retry: retry::RetryPolicy) -> StepContext {
    let row = &claim.instance;
    StepContext {
        id: row.id,
        machine: row.machine.clone(),
        namespace: row.namespace.clone(),
        queue: row.queue.clone(),
        step: row.position.clone(),
        attempt: row.attempt,
        context: row.context.clone(),
        awaits: row.awaits.clone(),
        signals: claim.inbox.clone(),
        children: claim.children.clone(),
        business_key: row.business_key.clone(),
        parent: None,
        retry,
        effects: Arc::default(),
    }
}

/// Starts claimed steps, each holding a lease slot of its queue and either a running slot
/// or, with `ahead`, a place in line for one; a claim with no slot to hold it is released
/// at once. Each step is registered in flight before its task is spawned, so the heartbeat
/// sees the lease at once.
async fn launch<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    queues: &[QueueSlots],
    tx: &mpsc::Sender<Finished>,
    claims: Vec<Claim>,
    ahead: bool,
) {
    let parents = parents_of(inner, &claims).await;
    for claim in claims {
        let slots = queues.iter().find(|s| s.name == claim.instance.queue);
        let Some((slot, permit)) = slots.and_then(|s| s.take(inner, ahead)) else {
            release(inner, vec![(claim.instance.id, claim.token())]).await;
            continue;
        };
        let id = claim.instance.id;
        let token = claim.token();
        let parent = claim.instance.parent.and_then(|p| parents.get(&p).cloned());
        let waiting = slot.waiting();
        let mut in_flight = inner.in_flight.lock().expect("in_flight lock");
        let task =
            tokio::spawn(run_step(Arc::clone(inner), claim, parent, (slot, permit), tx.clone()));
        in_flight.insert(
            id,
            InFlight { token, task, committing: false, waiting, finished: false, lost: false },
        );
    }
}

/// The parents of the claimed steps whose machine asks for one
/// ([`StepMachine::wants_parent`]), read in one `instance_rows` call per claim rather than
/// one read per step. A failed read leaves them out: those steps run without the
/// lock-free pre-check, which only ever saves work.
async fn parents_of<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    claims: &[Claim],
) -> HashMap<InstanceId, Instance> {
    let ids: BTreeSet<InstanceId> = claims
        .iter()
        .filter_map(|c| {
            let row = &c.instance;
            let parent = row.parent?;
            inner.machines.get(&row.machine)?.wants_parent(&row.position).then_some(parent)
        })
        .collect();
    if ids.is_empty() {
        return HashMap::new();
    }
    match inner.store.instance_rows(ids.into_iter().collect()).await {
        Ok(rows) => rows.into_iter().map(|r| (r.id, r)).collect(),
        Err(e) => {
            tracing::debug!(error = %e, "reading the claimed steps' parents failed");
            HashMap::new()
        }
    }
}

/// One claimed step: waits for a running slot if claimed ahead, runs the step and hands
/// its result to the committer.
///
/// Every claimed step is spawned as a task of this future, and spawning copies the task
/// whole, so its size is paid per step: it is an `async` block rather than an `async fn`
/// (which keeps its arguments in its state a second time), and the rare paths box their
/// state (7.1 KB before, 2.9 KB now).
#[allow(clippy::manual_async_fn, reason = "an async fn's state holds its arguments twice")]
fn run_step<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    mut claim: Claim,
    parent: Option<Instance>,
    (slot, permit): (RunSlot<S, C>, OwnedSemaphorePermit),
    tx: mpsc::Sender<Finished>,
) -> impl Future<Output = ()> + Send + 'static {
    async move {
        // Until its result is handed over, a step that ends (an early return, a panic)
        // takes its own entry out and gives its lease back, so the heartbeat never keeps
        // alive the lease of a step that will not hand in a result.
        let mut unfinished = Unfinished::new(&inner, &claim);
        let running = match slot {
            RunSlot::Taken(running) => running,
            RunSlot::Ahead(waiting) => {
                let running = waiting.start().await;
                let mut in_flight = inner.in_flight.lock().expect("in_flight lock");
                match claim_entry(&mut in_flight, claim.instance.id, claim.token()) {
                    Some(entry) => entry.waiting = false,
                    // Shutdown gave its lease back while it waited.
                    _ => return,
                }
                running
            }
        };
        let row = &claim.instance;
        let span = step_span(row);
        let Some(machine) = inner.machines.get(&row.machine).cloned() else {
            tracing::error!(parent: &span, "claimed a machine this worker does not run; releasing");
            return;
        };
        let wait = inner.clock.now().since(row.eligible_at);
        metrics::histogram!("keel_queue_wait_time_seconds", "machine" => row.machine.name.clone())
            .record(wait.as_secs_f64());
        let started = Instant::now();
        // The machine's own settings for the step: its inbox order and its step
        // configuration. They are user code; one that panics fails the step as a panicking
        // step does.
        let settings = step_settings(&inner.config, machine.as_ref(), row);
        // The step sees its inbox in the machine's order (the file's, else the code's).
        let order = settings.as_ref().map_or(keel_core::inbox::InboxOrder::Arrival, |s| s.0);
        let base = row.base_priority;
        keel_core::inbox::order(&mut claim.inbox, order, base);
        let row = &claim.instance;
        // A machine whose settings panicked runs under its own configuration (or the
        // defaults, should that panic too), and the step fails as a panicking one.
        let resolved =
            settings.and_then(|(_, base)| step_config(&inner, machine.as_ref(), &claim, &base));
        let (config, panicked) = match resolved {
            Ok(config) => (config, None),
            Err(panic) => {
                let base = catch_panic(|| machine.config()).unwrap_or_default();
                (inner.step_config(&base, row, None), Some(panic))
            }
        };
        let mut ctx = context_of(&claim, config.retry);
        ctx.parent = parent;
        // A step whose attempts expired leases used up (it may be taking its worker down
        // with it) is not run again: it fails through the machine's error handling.
        let used_up = retry::attempts_used_up(&config.retry, row);
        let result = match (panicked, used_up) {
            (_, Some(used_up)) => {
                tracing::error!(parent: &span, leases_expired = used_up.leases_expired, "{}", used_up.message);
                Err(StepError::of_kind(retry::AttemptsUsedUp::KIND, used_up.message))
            }
            (None, None) => guarded(Arc::clone(&machine), ctx.clone(), config.timeout, &span).await,
            (Some(panic), None) => {
                let message = format!("the machine's settings for this step panicked: {panic}");
                tracing::error!(parent: &span, "{message}");
                Err(StepError::of_kind(FailureKind::Panic, message))
            }
        };
        let elapsed = started.elapsed();
        running.pace.record(elapsed);
        metrics::histogram!("keel_queue_processing_time_seconds", "machine" => row.machine.name.clone())
            .record(elapsed.as_secs_f64());

        let (commit, failed) = match result {
            Ok(outcome) => {
                let mut commit = success_commit(&claim, outcome);
                let mut effects = ctx.effects();
                commit.emit = std::mem::take(&mut effects.emit);
                commit.spawn = std::mem::take(&mut effects.spawn);
                commit.history = std::mem::take(&mut effects.history);
                commit.timers_arm = std::mem::take(&mut effects.timers_arm);
                commit.timers_cancel = std::mem::take(&mut effects.timers_cancel);
                commit.children_cancel = std::mem::take(&mut effects.children_cancel);
                if let Some(consume) = effects.consume.take() {
                    commit.consume = consume;
                }
                drop(effects);
                (commit, false)
            }
            Err(error) => {
                tracing::warn!(parent: &span, error = %error, "step failed");
                let origin = Origin {
                    claim: claim.clone(),
                    ctx: ctx.clone(),
                    machine: Arc::clone(&machine),
                    config,
                };
                // Boxed, the origin with it: the failure path is rare, and unboxed its state
                // would be part of every step's task (see above).
                (Box::pin(async move { guarded_failure(&origin, error).await }).await, true)
            }
        };
        // The step is done running: its slot goes to the next claim while this result waits
        // for its group commit.
        let unhinted = running.pace.unhinted;
        drop(running);
        let machine_name = row.machine.name.clone();
        // Room in the committer's channel first, then the result: a `send` future would hold
        // the whole result across its wait, in every step's task.
        let Ok(room) = tx.reserve().await else {
            tracing::warn!(parent: &span, "committer stopped; releasing the lease for the step to re-run");
            return;
        };
        // Marked under the lock, so the end of the shutdown grace either took the step or
        // leaves its lease to the committer. A result whose entry is gone (its lease given
        // back, or taken and the instance claimed again) still goes in: the store refuses
        // it, and it counts as a lost lease.
        if let Some(entry) = claim_entry(
            &mut inner.in_flight.lock().expect("in_flight lock"),
            claim.instance.id,
            claim.token(),
        ) {
            entry.finished = true;
        }
        let origin = Origin { claim, ctx, machine, config };
        room.send(Finished {
            commit,
            machine: machine_name,
            failed,
            origin,
            unhinted,
            _permit: permit,
        });
        unfinished.handed_over();
    }
}

/// A claimed step that has not handed its result to the committer yet. Dropped before
/// [`handed_over`](Self::handed_over) — the step's task returned early or panicked — it
/// takes the step's in-flight entry out (its own claim's only: a newer claim of the
/// instance keeps its entry) and gives the lease back, so the step runs again soon rather
/// than after the worker stops. An entry already gone (shutdown took it, and releases
/// its lease itself) is left alone.
struct Unfinished<S: Store, C: Clock> {
    inner: Arc<Inner<S, C>>,
    id: InstanceId,
    token: FencingToken,
    armed: bool,
}

impl<S: Store, C: Clock> Unfinished<S, C> {
    fn new(inner: &Arc<Inner<S, C>>, claim: &Claim) -> Self {
        Unfinished {
            inner: Arc::clone(inner),
            id: claim.instance.id,
            token: claim.token(),
            armed: true,
        }
    }

    /// The result is with the committer, which settles the lease from here on.
    fn handed_over(&mut self) {
        self.armed = false;
    }
}

impl<S: Store, C: Clock> Drop for Unfinished<S, C> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let removed = remove_claim_entry(
            &mut self.inner.in_flight.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            self.id,
            self.token,
        );
        if !removed {
            return;
        }
        if std::thread::panicking() {
            tracing::error!(instance = %self.id, "a step's task panicked before handing in its result; releasing its lease");
        } else {
            tracing::warn!(instance = %self.id, "a step ended without handing in its result; releasing its lease");
        }
        // Without a runtime (it is shutting down) the lease expires instead.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (inner, lease) = (Arc::clone(&self.inner), (self.id, self.token));
            runtime.spawn(async move { release(&inner, vec![lease]).await });
        }
    }
}

/// A step's inbox order (the file's, else the machine's) and the configuration the
/// machine gives the step, or the message of the panic of the machine's code that says
/// them.
fn step_settings(
    config: &WorkerConfig,
    machine: &dyn StepMachine,
    row: &Instance,
) -> Result<(keel_core::inbox::InboxOrder, QueueConfig), String> {
    catch_panic(|| {
        let order = config.inbox_order(&row.machine.name).unwrap_or_else(|| machine.inbox_order());
        (order, machine.step_config(&row.position))
    })
}

/// The configuration a claimed step runs with: `base` (what its machine sets for the step
/// in code) under the file's levels for the machine and for the event the machine says
/// the step processes ([`StepMachine::event_for`]; none for a chart's start), then what
/// the machine sets over the file ([`StepMachine::step_config_over`]). `Err` is the
/// message of the panic of the machine's code that says them.
fn step_config<S, C>(
    inner: &Inner<S, C>,
    machine: &dyn StepMachine,
    claim: &Claim,
    base: &QueueConfig,
) -> Result<QueueConfig, String> {
    let row = &claim.instance;
    let event = catch_panic(|| {
        let event = machine.event_for(&row.position, &claim.inbox);
        event.map(|s| s.name.clone())
    })?;
    let resolved = inner.step_config(base, row, event.as_deref());
    catch_panic(|| machine.step_config_over(&row.position, resolved))
}

/// Runs `f`, returning the message of its panic instead of unwinding.
fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .map_err(|payload| payload_message(payload.as_ref()))
}

/// The span a step runs in, and its error handler: what either logs names the instance,
/// machine, step and attempt it came from.
fn step_span(row: &Instance) -> tracing::Span {
    tracing::info_span!("step", instance = %row.id, machine = %row.machine, step = %row.position, attempt = row.attempt)
}

/// Runs the step in its own task, so a panic becomes an error and a timeout cancels it
/// (a step that blocks its thread cannot be: see [`in_step_task`]). The task is spawned
/// at once, the context moving into it, so the future returned holds only the task's
/// handle and the timer, and adds little to the step's own task.
fn guarded(
    machine: Arc<dyn StepMachine>,
    ctx: StepContext,
    timeout: Duration,
    span: &tracing::Span,
) -> impl Future<Output = Result<Outcome, StepError>> + Send {
    let step = in_step_task(async move { machine.step(&ctx).await }, span.clone(), timeout);
    async move {
        step.await.unwrap_or_else(|stopped| {
            let kind = match stopped {
                Stopped::Panicked(_) => FailureKind::Panic,
                Stopped::TimedOut => FailureKind::Timeout,
            };
            Err(StepError::of_kind(kind, stopped.describe("step", timeout)))
        })
    }
}

/// Why a task waited for under a time bound gave no output.
enum Stopped {
    /// It panicked, with this message.
    Panicked(String),
    /// It ran out of time and was aborted.
    TimedOut,
}

impl Stopped {
    /// What happened to `what` (the step, its error handler), in words.
    fn describe(&self, what: &str, timeout: Duration) -> String {
        match self {
            Stopped::Panicked(panic) => format!("{what} panicked: {panic}"),
            Stopped::TimedOut => format!("{what} timed out after {} ms", timeout.as_millis()),
        }
    }
}

/// Spawns `work` at once as a task of its own inside the step's `span` (so what it logs
/// names the instance), and returns its output waited for at most `timeout`: a task that
/// runs out of time is aborted, one that panics gives the panic's message. Dropping the
/// returned future (the step's own task aborted at the end of the shutdown grace) aborts
/// the task too. Aborting stops a task only where it awaits: a step that blocks its
/// thread (a long computation, a blocking call) keeps running, and keeps its thread,
/// until it returns, after its timeout and after its lease was given back. Steps must
/// not block their thread; blocking work belongs in `tokio::task::spawn_blocking`.
fn in_step_task<F>(
    work: F,
    span: tracing::Span,
    timeout: Duration,
) -> impl Future<Output = Result<F::Output, Stopped>> + Send
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let task = AbortOnDrop(tokio::spawn(work.instrument(span)));
    async move {
        // On time out the timer drops the task's handle, which aborts it.
        match tokio::time::timeout(timeout, task).await {
            Ok(Ok(output)) => Ok(output),
            Ok(Err(join)) => Err(Stopped::Panicked(panic_message(join))),
            Err(_) => Err(Stopped::TimedOut),
        }
    }
}

/// A task's handle that aborts the task when dropped. A plain [`JoinHandle`] dropped
/// leaves its task running on its own.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        // Nothing happens to a task that already ended.
        self.0.abort();
    }
}

fn panic_message(join: tokio::task::JoinError) -> String {
    match join.try_into_panic() {
        Ok(payload) => payload_message(payload.as_ref()),
        Err(e) => e.to_string(),
    }
}

/// The message a panic was given, when it was a string.
fn payload_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}

/// A successful step consumes the signals it saw that match what it awaited (all of
/// them for `*`), unless it parks again.
fn success_commit(claim: &Claim, outcome: Outcome) -> StepCommit {
    let row = &claim.instance;
    let consume = keel_core::inbox::consumed_by(&outcome, row.awaits.as_deref(), &claim.inbox);
    StepCommit::new(row.id, claim.token(), outcome).consume(consume)
}

async fn failure_commit(
    claim: &Claim,
    ctx: &StepContext,
    machine: &dyn StepMachine,
    config: &QueueConfig,
    error: StepError,
) -> StepCommit {
    let row = &claim.instance;
    let retryable = error.class() == ErrorClass::Retryable;
    let processing = ctx.effects().processing.take();
    let mut failure =
        StepFailure::of_step(error.message.clone(), retryable, processing.as_ref(), &claim.inbox);
    let mut consume = Vec::new();
    // The failed step's own effects are dropped; the handler's ride the failure commit.
    {
        let mut effects = ctx.effects();
        effects.emit.clear();
        effects.history.clear();
    }
    let outcome = match machine.handle(&error, ctx).await {
        Ok(Some(outcome)) => outcome,
        Ok(None) => {
            let step = retry::failed_step(
                config,
                row,
                error.kind,
                processing.as_ref(),
                &error.message,
                fastrand::f64(),
            );
            failure.dead_letter = step.dead_letter;
            consume.extend(step.consume);
            if let Some(entry) = step.history {
                ctx.record(entry);
            }
            step.outcome
        }
        Err(handler_error) => Outcome::Stop {
            reason: format!("error handler failed: {handler_error} (while handling: {error})"),
        },
    };
    let mut commit =
        StepCommit::new(row.id, claim.token(), outcome).consume(consume).failure(failure);
    let mut effects = ctx.effects();
    commit.emit = std::mem::take(&mut effects.emit);
    commit.history = std::mem::take(&mut effects.history);
    commit
}

async fn commit_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Finished>>>,
) {
    let mut rx = rx.lock().await;
    let batch_max = inner.config.commit_batch.clamp(1, limits::COMMIT_BATCH_MAX);
    let lanes_max = inner.config.commits_in_flight.clamp(1, COMMITS_IN_FLIGHT_MAX);
    let lanes = Arc::new(Semaphore::new(lanes_max));
    let mut buffer: Vec<Finished> = Vec::with_capacity(batch_max);
    // The oldest buffered result waits at most `commit_interval` for its group.
    let mut deadline = tokio::time::Instant::now();
    loop {
        let msg = if buffer.is_empty() {
            let m = rx.recv().await;
            deadline = tokio::time::Instant::now() + inner.config.commit_interval;
            m
        } else if let Ok(m) = tokio::time::timeout_at(deadline, rx.recv()).await {
            m
        } else {
            dispatch(&inner, &lanes, &mut rx, &mut buffer, batch_max).await;
            continue;
        };
        let Some(f) = msg else {
            dispatch(&inner, &lanes, &mut rx, &mut buffer, batch_max).await;
            // Every group in flight has landed once all the lanes are free again.
            let _ = lanes.acquire_many(lanes_max as u32).await;
            return;
        };
        buffer.push(f);
        // Take whatever else is already waiting, up to the batch bound.
        top_up(&mut rx, &mut buffer, batch_max);
        // Commit at once when the group is full, when no group is committing (nothing to
        // batch behind: a lightly loaded worker never waits out the interval), or when no
        // step is running or waiting to run (no more results can join this group soon).
        let idle = lanes.available_permits() == lanes_max;
        let busy = inner.busy();
        if idle && busy > 0 && buffer.len() < batch_max {
            // Steps that finished together are still handing in their results: let them
            // run once, so the group takes them rather than going out with the first.
            tokio::task::yield_now().await;
            top_up(&mut rx, &mut buffer, batch_max);
        }
        if buffer.len() >= batch_max || idle || busy == 0 {
            dispatch(&inner, &lanes, &mut rx, &mut buffer, batch_max).await;
        }
    }
}

/// Moves the results already waiting into `buffer`, up to `batch_max`.
fn top_up(rx: &mut mpsc::Receiver<Finished>, buffer: &mut Vec<Finished>, batch_max: usize) {
    while buffer.len() < batch_max {
        match rx.try_recv() {
            Ok(f) => buffer.push(f),
            Err(_) => break,
        }
    }
}

/// Sends the buffered group to a commit lane of its own, waiting for a free lane first
/// (at most [`WorkerConfig::commits_in_flight`] groups commit at once); results that
/// finish while it waits join the group. The group commits in its own task, so a panic
/// there fails that group only (its leases expire and the steps re-run).
async fn dispatch<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    lanes: &Arc<Semaphore>,
    rx: &mut mpsc::Receiver<Finished>,
    buffer: &mut Vec<Finished>,
    batch_max: usize,
) {
    if buffer.is_empty() {
        return;
    }
    let lane = Arc::clone(lanes).acquire_owned().await.expect("the lanes are never closed");
    top_up(rx, buffer, batch_max);
    let batch = std::mem::replace(buffer, Vec::with_capacity(batch_max));
    let inner = Arc::clone(inner);
    tokio::spawn(async move {
        let group = tokio::spawn({
            let inner = Arc::clone(&inner);
            async move { flush(&inner, batch).await }
        });
        if let Err(join) = group.await {
            let panic = panic_message(join);
            inner.loop_failed(WorkerLoop::Committer, &format!("a group commit panicked: {panic}"));
        }
        drop(lane);
    });
}

/// Commits a group of step results. A result the store refuses becomes a non-retryable
/// failure of its step, committed in a second round (see [`commit_refused`]); results that
/// cannot be committed at all are dropped and their steps re-run (at-least-once): when
/// the store stayed unavailable their leases are given back once it answers again
/// (counting no attempt), and a result lost with a panicking store call leaves its lease
/// to expire.
async fn flush<S: Store, C: Clock>(inner: &Inner<S, C>, batch: Vec<Finished>) {
    if batch.is_empty() {
        return;
    }
    let settled = Settled { inner, batch };
    let batch = &settled.batch;
    {
        let mut in_flight = inner.in_flight.lock().expect("in_flight lock");
        for f in batch {
            if let Some(entry) = claim_entry(&mut in_flight, f.commit.id, f.origin.claim.token()) {
                entry.committing = true;
            }
        }
    }
    let commits: Vec<StepCommit> = batch.iter().map(|f| f.commit.clone()).collect();
    let results = commit_group(inner, commits).await;
    // Queue hook: hints for what this commit left ready.
    queue::publish_committed(inner, batch, &results);
    let mut refused = Vec::new();
    for (f, result) in batch.iter().zip(results) {
        if let Some(error) = settle(inner, f, result, f.failed) {
            refused.push((f, error));
        }
    }
    if !refused.is_empty() {
        commit_refused(inner, refused).await;
    }
    // `settled` drops here: the steps leave the running set and free their slots.
}

/// A group of results being committed. Dropping it — after the commit, or while the
/// committer unwinds from a panic — takes the steps out of the running set and frees
/// their slots, so a group that is lost never has its leases kept alive by the heartbeat:
/// they are given back (the store was unreachable) or expire (anything else), and the
/// steps re-run.
struct Settled<'a, S, C> {
    inner: &'a Inner<S, C>,
    batch: Vec<Finished>,
}

impl<S, C> Drop for Settled<'_, S, C> {
    fn drop(&mut self) {
        {
            let mut in_flight =
                self.inner.in_flight.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // Only this claim's entry: once the group landed, the instance may have been
            // claimed again (its next step) before the group settled, and that claim's
            // entry must stay, or its step would never start and its lease never extend.
            for f in &self.batch {
                remove_claim_entry(&mut in_flight, f.commit.id, f.origin.claim.token());
            }
        }
        let unhinted = self.batch.iter().any(|f| f.unhinted);
        self.batch.clear(); // frees the slots
        self.inner.slot_freed.notify(unhinted);
    }
}

/// Counts and logs what happened to one result; returns the store's error when the
/// result was refused in a way that makes it a step failure.
fn settle<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    f: &Finished,
    result: Option<StoreResult<CommitReceipt>>,
    failed: bool,
) -> Option<StoreError> {
    let labels = [("machine", f.machine.clone())];
    match result {
        Some(Ok(_)) => {
            inner.committed(f.commit.id);
            inner.stats.committed.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("keel_queue_completed_total", &labels).increment(1);
            if failed {
                inner.stats.failed_steps.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("keel_queue_failed_total", &labels).increment(1);
            }
            if matches!(f.commit.outcome, Outcome::Retry { .. }) {
                metrics::counter!("keel_queue_retried_total", &labels).increment(1);
            }
            None
        }
        Some(Err(e)) => match retry::refused_commit(e.kind) {
            RefusedCommit::Discard => {
                inner.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(instance = %f.commit.id, "lease lost before commit; result discarded");
                None
            }
            RefusedCommit::Retry => {
                // The worker lives: the step's lease is given back, not left to expire,
                // so the step runs again without counting an attempt it did not fail
                // (the committer has said why, once for the group).
                if inner.give_back(f.commit.id, f.origin.claim.token()) {
                    tracing::debug!(instance = %f.commit.id, error = %e, "commit failed; the lease is given back once the store answers, and the step re-run");
                } else {
                    tracing::warn!(instance = %f.commit.id, error = %e, "commit failed as unavailable {GIVE_BACKS_IN_A_ROW_MAX} times in a row while the store answered; the lease is left to expire and the attempt counts");
                }
                None
            }
            RefusedCommit::Fail(_) => Some(e),
        },
        None => None,
    }
}

/// Turns results the store refused into failures of their steps and commits those: the
/// machine's error handling decides, with a non-retryable error carrying the store's
/// message, so the instance is dead-lettered by default (or whatever `handle` and
/// `on_dead_letter` say). Should the store refuse that failure commit too, a last one
/// suspends the instance with nothing but the error; if even that is refused, the result
/// is dropped and the lease expires.
async fn commit_refused<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    refused: Vec<(&Finished, StoreError)>,
) {
    let mut failures = Vec::with_capacity(refused.len());
    for (f, e) in &refused {
        tracing::error!(instance = %f.commit.id, error = %e, "the store refused the step's result; failing the step");
        let error = StepError::of_kind(FailureKind::of_refusal(e.kind), retry::refused_error(e));
        failures.push(guarded_failure(&f.origin, error).await);
    }
    let results = commit_group(inner, failures.clone()).await;
    let mut last = Vec::new();
    for ((f, first), (commit, result)) in refused.iter().zip(failures.into_iter().zip(results)) {
        if result.as_ref().is_some_and(Result::is_ok) {
            inner.stats.refused.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(second) = settle(inner, f, result, true) {
            last.push((
                f,
                retry::last_resort(&commit, &retry::refused_twice_error(first, &second)),
            ));
        }
    }
    if last.is_empty() {
        return;
    }
    let commits: Vec<StepCommit> = last.iter().map(|(_, c)| c.clone()).collect();
    for ((f, _), result) in last.iter().zip(commit_group(inner, commits).await) {
        if result.as_ref().is_some_and(Result::is_ok) {
            inner.stats.refused.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(e) = settle(inner, f, result, true) {
            tracing::error!(instance = %f.commit.id, error = %e, "the store refused even the suspension of a failed step; the lease will expire and the step re-run");
        }
    }
}

/// The failure commit of a step, from the machine's error handling. The handler runs in
/// its own task under the step's timeout, so a panicking or hanging handler cannot stop
/// the step's task or the committer (which would leave the lease held for ever); like a
/// handler that returns an error, it makes the instance fail. It runs in the step's span,
/// so what it logs names the instance.
async fn guarded_failure(origin: &Origin, error: StepError) -> StepCommit {
    let message = error.message.clone();
    let (claim, ctx) = (origin.claim.clone(), origin.ctx.clone());
    let (machine, config) = (Arc::clone(&origin.machine), origin.config);
    let timeout = config.timeout;
    let span = step_span(&claim.instance);
    let handled = in_step_task(
        async move { failure_commit(&claim, &ctx, machine.as_ref(), &config, error).await },
        span.clone(),
        timeout,
    );
    match handled.await {
        Ok(commit) => commit,
        Err(stopped) => {
            let why = stopped.describe("the error handler", timeout);
            // In the step's span: the line names the instance, machine, step and attempt.
            tracing::error!(parent: &span, "{why}");
            // As when the handler returns an error: the instance fails.
            let claim = &origin.claim;
            let failure = StepFailure::of_step(message.clone(), false, None, &claim.inbox);
            let reason = format!("error handler failed: {why} (while handling: {message})");
            StepCommit::new(claim.instance.id, claim.token(), Outcome::Stop { reason })
                .failure(failure)
        }
    }
}

/// One `step_commit` of `commits`, with a result per item (`None`: unknown, the store
/// stayed unavailable). When the store refuses the whole call rather than single items,
/// the items are committed one by one, so one bad result cannot sink its neighbours.
async fn commit_group<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    commits: Vec<StepCommit>,
) -> Vec<Option<StoreResult<CommitReceipt>>> {
    let n = commits.len();
    match commit_call(inner, &commits).await {
        Ok(receipts) if receipts.len() == n => receipts.into_iter().map(Some).collect(),
        Ok(receipts) => {
            tracing::error!(
                sent = n,
                got = receipts.len(),
                "the store answered a group commit with the wrong number of results"
            );
            vec![None; n]
        }
        Err(CallFailed::Panicked) => vec![None; n],
        // Each item ends as the store left it: unreachable (its lease is given back once
        // the store answers), or refused with the call.
        Err(CallFailed::Unavailable(e)) => vec![Some(Err(e)); n],
        Err(CallFailed::Refused(e)) if n == 1 => vec![Some(Err(e))],
        Err(CallFailed::Refused(e)) => {
            tracing::warn!(error = %e, items = n, "the store refused a whole group commit; committing its items one by one");
            let mut out = Vec::with_capacity(n);
            for commit in commits {
                out.push(match commit_call(inner, std::slice::from_ref(&commit)).await {
                    Ok(mut receipts) if receipts.len() == 1 => receipts.pop(),
                    Ok(_) | Err(CallFailed::Panicked) => None,
                    Err(CallFailed::Unavailable(e) | CallFailed::Refused(e)) => Some(Err(e)),
                });
            }
            out
        }
    }
}

/// How one `step_commit` call failed.
enum CallFailed {
    /// The store stayed unavailable through every try; the last error.
    Unavailable(StoreError),
    /// The store panicked: whether it committed is unknown.
    Panicked,
    /// The store refused the call as a whole.
    Refused(StoreError),
}

/// One `step_commit` call, tried up to [`COMMIT_TRIES`] times while the store is
/// unavailable.
async fn commit_call<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    commits: &[StepCommit],
) -> Result<Vec<StoreResult<CommitReceipt>>, CallFailed> {
    let mut unavailable = None;
    for attempt in 0..COMMIT_TRIES {
        let params = CommitParams { commits: commits.to_vec(), now: inner.clock.now() };
        // In its own task, so a store that panics (on a row it cannot decode, say) fails
        // this call, not the committer.
        let store = Arc::clone(&inner.store);
        match tokio::spawn(async move { store.step_commit(params).await }).await {
            Ok(Ok(receipts)) => {
                inner.loop_ok(WorkerLoop::Committer);
                return Ok(receipts);
            }
            Ok(Err(e)) if e.is_retryable() => {
                // No pause after the last try: the lane is not held for nothing.
                if attempt + 1 < COMMIT_TRIES {
                    tracing::warn!(error = %e, attempt, "group commit failed; retrying");
                    tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
                } else {
                    tracing::warn!(error = %e, attempt, "group commit failed");
                }
                unavailable = Some(e);
            }
            Ok(Err(e)) => {
                // The store answered: the committer works, the group was refused.
                inner.loop_ok(WorkerLoop::Committer);
                return Err(CallFailed::Refused(e));
            }
            Err(join) => {
                let panic = panic_message(join);
                inner.loop_failed(WorkerLoop::Committer, &format!("step_commit panicked: {panic}"));
                return Err(CallFailed::Panicked);
            }
        }
    }
    inner.loop_failed(
        WorkerLoop::Committer,
        &format!("group commit still failing after {COMMIT_TRIES} tries; its leases are given back once the store answers again, and the steps re-run"),
    );
    Err(CallFailed::Unavailable(
        unavailable.unwrap_or_else(|| StoreError::unavailable("group commit not tried")),
    ))
}

async fn heartbeat_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut pause = inner.config.heartbeat;
    loop {
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = shutdown.changed() => return,
        }
        let leases: Vec<(InstanceId, FencingToken)> = inner
            .in_flight
            .lock()
            .expect("in_flight lock")
            .iter()
            .filter(|(_, f)| !f.lost)
            .map(|(id, f)| (*id, f.token))
            .collect();
        let mut failure = None;
        for chunk in leases.chunks(limits::COMMIT_BATCH_MAX) {
            if let Err(e) = heartbeat(&inner, chunk).await {
                failure = Some(e);
            }
        }
        // After the running steps' leases, which are the ones running out.
        if let Err(e) = give_back_leases(&inner).await {
            failure = Some(e);
        }
        pause = match failure {
            None => {
                inner.loop_ok(WorkerLoop::Heartbeat);
                inner.config.heartbeat
            }
            // After a failure the leases are running out: try again after the back-off
            // if that is sooner than the period, never in a tight loop.
            Some(e) => inner.loop_failed(WorkerLoop::Heartbeat, &e).min(inner.config.heartbeat),
        };
    }
}

/// Extends one bounded set of leases, and reports the ones lost. A step whose commit
/// started (or went through) since the set was read has given its lease up on purpose,
/// so only a step still running, or finished but not yet committing, under the same
/// token counts as a lost lease.
async fn heartbeat<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    leases: &[(InstanceId, FencingToken)],
) -> StoreResult<()> {
    let params = LeaseExtendParams {
        worker: inner.config.worker_id.clone(),
        leases: leases.to_vec(),
        lease: inner.config.lease,
        now: inner.clock.now(),
    };
    let held = inner.store.lease_extend(params).await?;
    let lost: Vec<InstanceId> = {
        let mut in_flight = inner.in_flight.lock().expect("in_flight lock");
        let mut lost = Vec::new();
        for (&(id, token), ok) in leases.iter().zip(held) {
            // Marked, so the step is counted once and its lease is not sent again.
            if let Some(entry) = claim_entry(&mut in_flight, id, token)
                && !ok
                && !entry.committing
                && !entry.lost
            {
                entry.lost = true;
                lost.push(id);
            }
        }
        lost
    };
    for id in lost {
        inner.stats.lease_lost_on_heartbeat.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(instance = %id, "heartbeat: lease no longer held; its commit will be rejected");
    }
    Ok(())
}

/// Gives back the leases of results the store could not take while it was unreachable,
/// a bounded page at a time: each step runs again at once, counting no attempt, rather
/// than waiting for its lease to expire and counting one it did not fail. Leases the
/// store no longer counts as this worker's (the result landed after all, or a reaper took
/// the lease) are skipped by the store. While the store is unavailable the leases not
/// given back are kept for the next try; a page it refuses is left to expire.
async fn give_back_leases<S: Store, C: Clock>(inner: &Inner<S, C>) -> StoreResult<()> {
    let take = || {
        let mut leases = inner.give_back.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut *leases)
    };
    let pending = take();
    let mut chunks = pending.chunks(limits::COMMIT_BATCH_MAX);
    while let Some(chunk) = chunks.next() {
        let params = LeaseReleaseParams { leases: chunk.to_vec(), now: inner.clock.now() };
        match inner.store.lease_release(params).await {
            Ok(released) => {
                let n = released.into_iter().filter(|held| *held).count();
                inner.stats.released.fetch_add(n as u64, Ordering::Relaxed);
                if n > 0 {
                    tracing::info!(
                        count = n,
                        "gave back the leases of results the store could not take; their steps run again"
                    );
                }
            }
            // The store is still out of reach: keep the rest for the next try.
            Err(e) if e.is_retryable() => {
                let mut leases =
                    inner.give_back.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let rest = chunk.iter().chain(chunks.by_ref().flatten()).copied();
                let kept: Vec<_> = rest.chain(leases.drain(..)).collect();
                let over = kept.len().saturating_sub(GIVE_BACK_MAX);
                leases.extend(kept.into_iter().skip(over));
                return Err(e);
            }
            // Refused: it would be refused every time, so this page is left to expire.
            Err(e) => {
                tracing::warn!(error = %e, leases = chunk.len(), "the store refused to take back leases; they expire instead");
            }
        }
    }
    Ok(())
}

async fn reap_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut pause = inner.config.reap_interval;
    let mut last_beat: Option<Instant> = None;
    // After the store was unreachable, leases get a lease period to be renewed before
    // any is reaped (see `ReapHold`).
    let mut hold = ReapHold::default();
    loop {
        // The registry beat rides on the reaper's cadence, at most once per interval.
        if last_beat.is_none_or(|at| at.elapsed() >= WORKER_BEAT_INTERVAL) {
            last_beat = Some(Instant::now());
            let _ = beat(&inner).await;
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = shutdown.changed() => return,
        }
        if !inner.config.reap_expired {
            continue;
        }
        if hold.probing() {
            // Down: a beat (which takes no lease) tells when the store is back.
            last_beat = Some(Instant::now());
            if answers(&beat(&inner).await) {
                hold.answered(inner.clock.now(), inner.config.lease);
                // The reaper works; it only holds off.
                inner.loop_ok(WorkerLoop::Reaper);
            }
            continue;
        }
        if !hold.may_reap(inner.clock.now()) {
            continue;
        }
        pause = match reap(&inner, None).await {
            Ok(_) => {
                inner.loop_ok(WorkerLoop::Reaper);
                inner.config.reap_interval
            }
            Err(e) => {
                // The store out of reach, or only the reap failing? A store that answers
                // the beat is up: the reap failed on its own, and no hold starts.
                if e.is_retryable() && !answers(&beat(&inner).await) {
                    hold.unreachable();
                }
                inner.loop_failed(WorkerLoop::Reaper, &e).max(inner.config.reap_interval)
            }
        };
    }
}

/// Whether the store answered a call (with a result or a refusal), rather than being
/// out of reach.
fn answers<T>(result: &StoreResult<T>) -> bool {
    !matches!(result, Err(e) if e.is_retryable())
}

/// Records this worker in the store's worker registry (what `keel workers` lists). A
/// failure is logged and never stops the worker: the registry is for people.
async fn beat<S: Store, C: Clock>(inner: &Inner<S, C>) -> StoreResult<()> {
    let mut machines: Vec<MachineRef> = inner.machines.keys().cloned().collect();
    machines.sort();
    let params = WorkerBeatParams::at(
        inner.config.worker_id.clone(),
        format!("{} (pid {})", program_name(), std::process::id()),
        machines,
        inner.config.namespaces.clone(),
        inner.started_at,
        inner.clock.now(),
    );
    let beat = inner.store.worker_heartbeat(params).await;
    if let Err(e) = &beat {
        tracing::warn!(error = %e, "could not record this worker in the worker registry");
    }
    beat
}

/// One page of leases returned to runnable (expired ones, or all of `owner`'s); returns
/// how many.
async fn reap<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    owner: Option<WorkerId>,
) -> StoreResult<usize> {
    let params = LeaseReapParams { owner, limit: limits::REAP_BATCH_MAX, now: inner.clock.now() };
    let ids = inner.store.lease_reap(params).await?;
    if !ids.is_empty() {
        inner.stats.reaped.fetch_add(ids.len() as u64, Ordering::Relaxed);
        metrics::counter!("keel_leases_reaped_total").increment(ids.len() as u64);
        tracing::info!(count = ids.len(), "returned expired leases to runnable");
    }
    Ok(ids.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue of `concurrency` slots whose steps ran for `micros` each, all slots free.
    fn quick_queue(concurrency: usize, micros: u64) -> QueueSlots {
        let slots = QueueSlots::new("q", concurrency, false);
        slots.pace.step_micros.store(micros, Ordering::Relaxed);
        slots
    }

    #[test]
    fn a_busy_queue_claims_once_half_a_batch_or_fifty_slots_are_free() {
        let ahead = Duration::from_millis(5);
        // Concurrency 1, quick steps: 1 running and 32 ahead, half of them.
        assert_eq!(quick_queue(1, 10).worth_claiming(250, ahead), 16);
        // Concurrency 10: 10 running and 32 ahead, half of them.
        assert_eq!(quick_queue(10, 10).worth_claiming(250, ahead), 21);
        // Half of a small batch.
        assert_eq!(quick_queue(500, 10).worth_claiming(40, ahead), 20);
        // Large queues and batches wait for 50 free slots at most.
        assert_eq!(quick_queue(100, 10).worth_claiming(250, ahead), CLAIM_WAIT_MAX);
        assert_eq!(quick_queue(500, 10).worth_claiming(250, ahead), CLAIM_WAIT_MAX);
        // A queue whose steps have not run yet claims nothing ahead.
        let fresh = QueueSlots::new("q", 1, false);
        assert_eq!(fresh.worth_claiming(250, ahead), 1);
    }

    #[tokio::test]
    async fn a_freed_slot_wakes_the_claim_loop_and_the_hint_loop_both() {
        let freed = SlotFreed::default();
        // Both loops asleep when the last slots come back: one wake-up reaches each.
        let claims = freed.claims.notified();
        let hints = freed.hints.notified();
        tokio::pin!(claims, hints);
        claims.as_mut().enable();
        hints.as_mut().enable();
        freed.notify(false);
        let within = Duration::from_secs(1);
        tokio::time::timeout(within, hints).await.expect("the hint loop is woken");
        tokio::time::timeout(within, claims).await.expect("the claim loop is woken too");
        // Neither asleep: each finds the wake-up at its next wait.
        freed.notify(false);
        tokio::time::timeout(within, freed.hints.notified()).await.expect("kept for hints");
        tokio::time::timeout(within, freed.claims.notified()).await.expect("kept for claims");
        // Only a slot of a queue hints never claim into wakes the claim loop's third wait.
        let short = Duration::from_millis(20);
        assert!(tokio::time::timeout(short, freed.unhinted.notified()).await.is_err());
        freed.notify(true);
        tokio::time::timeout(within, freed.unhinted.notified()).await.expect("unhinted woken");
    }

    #[test]
    fn a_claim_takes_every_free_slot_and_what_may_start_soon() {
        let ahead = Duration::from_millis(5);
        // 500 free slots and as many spare leases: quick steps fill both.
        assert_eq!(quick_queue(500, 10).claimable(ahead), 1_000);
        // Steps of 1 ms: five may start within the 5 ms budget.
        assert_eq!(quick_queue(500, 1_000).claimable(ahead), 505);
    }
}
