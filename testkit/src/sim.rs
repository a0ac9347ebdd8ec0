//! A deterministic simulator for your own machines: N simulated workers share one store, and
//! a scheduler driven by a seed interleaves claims, step runs, commits, heartbeats, reaps,
//! timer sweeps, signal deliveries (duplicates included), worker crashes that lose their
//! in-flight work, clock jumps that expire leases, and clock skew between workers.
//!
//! After every event the simulator checks the engine's rules and your invariants:
//!
//! - a commit is accepted only from the latest claim of an instance (fencing);
//! - no step is committed twice (one accepted commit per instance and revision);
//! - a revision or fencing token never goes back, a terminal instance never changes;
//! - an executing row has a lease and no other row has one;
//! - nobody reaps a lease before it ran out (by the reaper's clock);
//! - at the end, with faults stopped and time moving on, every instance becomes terminal
//!   (nothing lost, nothing hung), and a terminal instance keeps no inbox rows or timers;
//! - each invariant you register, over every instance's row (status, position, context).
//!
//! Each step runs as the worker runs it: a commit that names no signals to consume consumes
//! the ones the step saw that match what the instance awaited (none when it parks again).
//! Unlike the worker's `StepContext::consume`, an empty list cannot mean "consume
//! nothing" here.
//!
//! One worker rule is left out: a step whose attempts keep ending with an expired lease
//! (`keel_core::retry::attempts_used_up`) is not run again but failed. The simulator's
//! clock jumps and crashes expire leases far more often than a healthy deployment does,
//! so here such a step is simply run again; test that rule against a worker.
//!
//! A failure (a panic in your step, signal or invariant function included) names the
//! seed, the violated rule and the shortest event trace the simulator
//! could shrink the run to. The same seed replays the same run exactly: set `SIM_SEED=<seed>`
//! and [`Simulation::check_seeds`] runs that seed alone and prints its trace.
//!
//! ```
//! use keel_core::{MachineRef, NewInstance, Outcome, StepCommit};
//! use keel_testkit::sim::Simulation;
//! use serde_json::json;
//!
//! let counter = MachineRef::new("counter", 1);
//! let sim = Simulation::new()
//!     .machine(counter.clone(), |row, _inbox| {
//!         let n = row.context["n"].as_i64().unwrap_or(0);
//!         let outcome = if n < 3 {
//!             Outcome::Next { step: "count".into(), context: json!({ "n": n + 1 }) }
//!         } else {
//!             Outcome::Done { result: json!({ "n": n }), step: None }
//!         };
//!         StepCommit::new(row.id, row.fencing_token, outcome)
//!     })
//!     .start(NewInstance::new(counter, "count"))
//!     .invariant("n stays at most 3", |row| {
//!         let n = row.context["n"].as_i64().unwrap_or(0);
//!         if n <= 3 { Ok(()) } else { Err(format!("n is {n}")) }
//!     });
//! let sweep = sim.check_seeds(0..20);
//! assert_eq!(sweep.seeds, 20);
//! ```

mod chart;

pub use chart::{CHART_INIT, SimChart};

use crate::MemoryStore;
use keel_core::limits;
use keel_core::ports::Store;
use keel_core::ports::store::{
    Claim, ClaimParams, CommitParams, DeliveryOutcome, InsertParams, LeaseExtendParams,
    LeaseReapParams, SignalDeliverParams, TimerSweepParams,
};
use keel_core::{
    ErrorKind, Instance, InstanceId, MachineRef, NewInstance, NewSignal, Revision, Signal, Status,
    StepCommit, Timestamp, WorkerId,
};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// A user's step function: the claimed row and the inbox signals its step sees, to the
/// commit of that step. Build the commit with `StepCommit::new(row.id, row.fencing_token, …)`.
pub type StepFn = dyn Fn(&Instance, &[Signal]) -> StepCommit;

/// Signals that may arrive for an instance as it stands now; the simulator delivers one of
/// them at random moments, sometimes twice (with the same dedup key).
pub type SignalFn = dyn Fn(&Instance) -> Vec<NewSignal>;

/// A user invariant over one instance's row: `Err` explains what is wrong.
pub type InvariantFn = dyn Fn(&Instance) -> Result<(), String>;

/// How long a simulated run is and how it is shaped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Fault and scheduling events per seed (before the final settling phase).
    pub events: usize,
    /// The lease a claim takes.
    pub lease: Duration,
    /// Most rows one claim takes.
    pub claim_batch: usize,
    /// The largest clock skew of one worker (either direction).
    pub skew_max: Duration,
    /// Rounds of the settling phase, where faults stop and every worker keeps working.
    pub settle_rounds: usize,
    /// Most replays spent shrinking a failing trace.
    pub shrink_replays: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 3,
            events: 200,
            lease: Duration::from_secs(30),
            claim_batch: 4,
            skew_max: Duration::from_secs(30),
            settle_rounds: 60,
            shrink_replays: 400,
        }
    }
}

/// One scheduling decision. Indexes wrap around the current lists, so any trace (a shrunk
/// one too) replays without panicking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Claim { worker: usize },
    Run { worker: usize, pick: usize },
    Commit { worker: usize },
    Heartbeat { worker: usize },
    Reap { worker: usize },
    Sweep { worker: usize },
    Deliver { target: usize, pick: usize, twice: bool },
    Crash { worker: usize, same_id: bool },
    Advance { ms: u64 },
    Skew { worker: usize, ms: i64 },
}

/// A rule the run broke: a stable kind (the shrinker keeps a trace only while the same kind
/// still fails) and the details.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Violation {
    kind: String,
    detail: String,
}

fn violation(kind: &str, detail: String) -> Violation {
    Violation { kind: kind.to_owned(), detail }
}

/// A failing seed: what broke and the shortest trace found that still breaks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimFailure {
    /// The seed; `SIM_SEED=<seed>` replays it.
    pub seed: u64,
    /// The rule that broke (`stale-commit`, `double-commit`, `hung`, `invariant:<name>`, …).
    pub kind: String,
    /// What exactly was wrong.
    pub detail: String,
    /// The shrunk trace, one line per event with what it did.
    pub trace: Vec<String>,
    /// Events in the seed's full run up to the failure, before shrinking.
    pub events_before_shrinking: usize,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulation failed: seed {} broke `{}`: {}",
            self.seed, self.kind, self.detail
        )?;
        writeln!(
            f,
            "shortest trace ({} events, shrunk from {}):",
            self.trace.len(),
            self.events_before_shrinking
        )?;
        for (i, line) in self.trace.iter().enumerate() {
            writeln!(f, "  {:>3}. {line}", i + 1)?;
        }
        write!(f, "replay this run exactly with SIM_SEED={} and the same test", self.seed)
    }
}

/// What one seed did, for reports and for checking that runs really exercised faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimReport {
    /// Step functions run (every handler execution, including lost ones).
    pub executions: u64,
    /// Step commits the store accepted.
    pub commits: u64,
    /// Commits the store refused because a newer claim superseded them.
    pub commits_refused: u64,
    /// Worker crashes that lost in-flight work.
    pub crashes: u64,
    /// Leases returned to runnable by a reaper or a restarted worker.
    pub reaped: u64,
    /// Signals delivered (duplicates by dedup key not counted).
    pub delivered: u64,
    /// Instances at the end, all terminal.
    pub instances: u64,
}

impl SimReport {
    fn add(&mut self, other: &SimReport) {
        self.executions += other.executions;
        self.commits += other.commits;
        self.commits_refused += other.commits_refused;
        self.crashes += other.crashes;
        self.reaped += other.reaped;
        self.delivered += other.delivered;
        self.instances += other.instances;
    }
}

/// The totals of a sweep over many seeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimSweep {
    /// Seeds run.
    pub seeds: u64,
    /// Their reports, summed.
    pub total: SimReport,
}

/// A simulation of user machines under faults; see the [module docs](self).
pub struct Simulation<S = MemoryStore> {
    config: SimConfig,
    make_store: Box<dyn Fn() -> S>,
    machines: Vec<(MachineRef, Box<StepFn>)>,
    starts: Vec<NewInstance>,
    signals: Option<Box<SignalFn>>,
    invariants: Vec<(String, Box<InvariantFn>)>,
}

impl Default for Simulation<MemoryStore> {
    fn default() -> Self {
        Self::new()
    }
}

impl Simulation<MemoryStore> {
    /// A simulation on a fresh [`MemoryStore`] per seed, with [`SimConfig::default`].
    pub fn new() -> Self {
        Simulation {
            config: SimConfig::default(),
            make_store: Box::new(MemoryStore::new),
            machines: Vec::new(),
            starts: Vec::new(),
            signals: None,
            invariants: Vec::new(),
        }
    }
}

impl<S: Store> Simulation<S> {
    /// Runs every seed on stores made by `make` instead: a store under test, or one with a
    /// deliberately broken rule to show that the simulator catches it.
    pub fn with_store<T: Store>(self, make: impl Fn() -> T + 'static) -> Simulation<T> {
        Simulation {
            config: self.config,
            make_store: Box::new(make),
            machines: self.machines,
            starts: self.starts,
            signals: self.signals,
            invariants: self.invariants,
        }
    }

    /// Replaces the run's shape.
    pub fn config(mut self, config: SimConfig) -> Self {
        self.config = config;
        self
    }

    /// Registers the step function of `machine` (name and version).
    pub fn machine(
        mut self,
        machine: MachineRef,
        step: impl Fn(&Instance, &[Signal]) -> StepCommit + 'static,
    ) -> Self {
        self.machines.push((machine, Box::new(step)));
        self
    }

    /// Registers a chart (see [`SimChart`]); start its instances with
    /// [`SimChart::new_instance`].
    pub fn chart(self, chart: SimChart) -> Self {
        let machine = chart.machine();
        self.machine(machine, move |row, inbox| chart.step(row, inbox))
    }

    /// Starts this instance at the beginning of every seed.
    pub fn start(mut self, instance: NewInstance) -> Self {
        self.starts.push(instance);
        self
    }

    /// Sets where signals come from (see [`SignalFn`]). The settling phase delivers them
    /// too, so an instance that waits for a signal this function offers can finish.
    pub fn signals(mut self, signals: impl Fn(&Instance) -> Vec<NewSignal> + 'static) -> Self {
        self.signals = Some(Box::new(signals));
        self
    }

    /// Adds an invariant checked on every instance after every event.
    pub fn invariant(
        mut self,
        name: impl Into<String>,
        check: impl Fn(&Instance) -> Result<(), String> + 'static,
    ) -> Self {
        self.invariants.push((name.into(), Box::new(check)));
        self
    }

    /// Runs one seed; on failure, shrinks the trace.
    pub fn run(&self, seed: u64) -> Result<SimReport, Box<SimFailure>> {
        let events = self.generate(seed);
        let (result, _) = self.replay(&events, false);
        let Err((at, first)) = result else {
            return result.map_err(|_| unreachable!("checked above"));
        };
        // Only the events up to the failure matter; then drop chunks while it still fails
        // the same way, halving the chunk size down to single events.
        let mut trace: Vec<Event> = events[..at.min(events.len())].to_vec();
        let before = trace.len();
        let mut replays = 0;
        let mut chunk = trace.len().div_ceil(2).max(1);
        while chunk >= 1 && replays < self.config.shrink_replays {
            let mut start = 0;
            while start < trace.len() && replays < self.config.shrink_replays {
                let end = (start + chunk).min(trace.len());
                let candidate: Vec<Event> =
                    trace[..start].iter().chain(&trace[end..]).copied().collect();
                replays += 1;
                match self.replay(&candidate, false).0 {
                    Err((at, v)) if v.kind == first.kind => {
                        trace = candidate[..at.min(candidate.len())].to_vec();
                    }
                    _ => start = end,
                }
            }
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
        let (result, lines) = self.replay(&trace, true);
        let last = match result {
            Err((_, v)) if v.kind == first.kind => v,
            _ => first,
        };
        Err(Box::new(SimFailure {
            seed,
            kind: last.kind,
            detail: last.detail,
            trace: lines,
            events_before_shrinking: before,
        }))
    }

    /// Runs every seed of `seeds` (or only `SIM_SEED` when that is set, printing its trace)
    /// and panics with the first failure's seed and shortest trace.
    pub fn check_seeds(&self, seeds: Range<u64>) -> SimSweep {
        let seeds: Vec<u64> = match std::env::var("SIM_SEED") {
            Ok(text) => {
                let seed = text.trim().parse::<u64>().unwrap_or_else(|_| {
                    panic!("SIM_SEED: `{text}` is not a seed; set it to a whole number such as SIM_SEED=42, or unset it to run the whole sweep")
                });
                let replayed = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    self.replay(&self.generate(seed), true)
                }));
                match replayed {
                    Ok((result, lines)) => {
                        println!("SIM_SEED={seed}: {} events", lines.len());
                        for (i, line) in lines.iter().enumerate() {
                            println!("  {:>3}. {line}", i + 1);
                        }
                        if let Err((_, v)) = result {
                            println!("  broke `{}`: {}", v.kind, v.detail);
                        }
                    }
                    Err(payload) => {
                        println!("SIM_SEED={seed}: panicked: {}", panic_message(&*payload));
                    }
                }
                vec![seed]
            }
            Err(_) => seeds.collect(),
        };
        let mut sweep = SimSweep::default();
        for seed in seeds {
            // A panic in user code (a step, the signal source, an invariant) fails the seed
            // too, named so that it can be replayed.
            let ran = std::panic::catch_unwind(AssertUnwindSafe(|| self.run(seed)));
            match ran {
                Ok(Ok(report)) => {
                    sweep.seeds += 1;
                    sweep.total.add(&report);
                }
                Ok(Err(failure)) => panic!("{failure}"),
                Err(payload) => panic!(
                    "simulation failed: seed {seed} panicked: {}\nreplay this run exactly with SIM_SEED={seed} and the same test",
                    panic_message(&*payload)
                ),
            }
        }
        sweep
    }

    /// The seed's scheduling decisions.
    fn generate(&self, seed: u64) -> Vec<Event> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let workers = self.config.workers.max(1);
        let lease_ms = self.config.lease.as_millis() as u64;
        let skew_ms = self.config.skew_max.as_millis() as i64;
        (0..self.config.events)
            .map(|_| {
                let worker = rng.usize(..workers);
                match rng.u32(..100) {
                    0..20 => Event::Claim { worker },
                    20..40 => Event::Run { worker, pick: rng.usize(..64) },
                    40..55 => Event::Commit { worker },
                    55..62 => Event::Heartbeat { worker },
                    62..68 => Event::Reap { worker },
                    68..72 => Event::Sweep { worker },
                    72..84 => Event::Deliver {
                        target: rng.usize(..1024),
                        pick: rng.usize(..64),
                        twice: rng.bool(),
                    },
                    84..89 => Event::Crash { worker, same_id: rng.bool() },
                    89..97 => Event::Advance { ms: rng.u64(..=lease_ms * 3 / 2) },
                    _ => Event::Skew {
                        worker,
                        ms: if rng.bool() { 0 } else { rng.i64(-skew_ms..=skew_ms) },
                    },
                }
            })
            .collect()
    }

    /// Runs `events` then the settling phase on a fresh store. On failure, returns the
    /// number of events that ran (the failing one included). With `describe`, also returns
    /// one line per event.
    fn replay(
        &self,
        events: &[Event],
        describe: bool,
    ) -> (Result<SimReport, (usize, Violation)>, Vec<String>) {
        let mut world = World::new(self, describe);
        if let Err(v) = world.begin() {
            return (Err((0, v)), world.lines);
        }
        for (i, event) in events.iter().enumerate() {
            if let Err(v) = world.apply(*event).and_then(|()| world.check()) {
                world.say(|| format!("!! broke `{}`", v.kind));
                return (Err((i + 1, v)), world.lines);
            }
        }
        let result = world.settle().map(|()| world.report).map_err(|v| (events.len(), v));
        if let Err((_, v)) = &result {
            world.say(|| format!("!! broke `{}`", v.kind));
        }
        (result, world.lines)
    }
}

/// How often a store future is polled before the simulator gives up on it.
const POLLS_MAX: usize = 64;

/// Polls a store future to completion without a runtime. The simulator's stores answer at
/// once (they never wait on IO), which is what makes a run deterministic.
fn now_or_never<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..POLLS_MAX {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
    }
    panic!("the simulated store waited on something; a simulation store must answer at once")
}

struct SimWorker {
    id: WorkerId,
    index: usize,
    generation: u32,
    skew_ms: i64,
    /// Claimed rows whose step has not run yet.
    claimed: Vec<Claim>,
    /// Run steps waiting for the next commit, with the revision they were claimed at.
    ran: Vec<(StepCommit, Revision)>,
}

impl SimWorker {
    fn leases(&self) -> Vec<(InstanceId, keel_core::FencingToken)> {
        self.claimed
            .iter()
            .map(|c| (c.instance.id, c.token()))
            .chain(self.ran.iter().map(|(c, _)| (c.id, c.token)))
            .collect()
    }
}

struct World<'a, S: Store> {
    sim: &'a Simulation<S>,
    store: S,
    now_ms: i64,
    workers: Vec<SimWorker>,
    ids: Vec<InstanceId>,
    rows: BTreeMap<InstanceId, Instance>,
    /// The latest token any claim got, per instance.
    latest_token: HashMap<InstanceId, i64>,
    /// Accepted commits per (instance, revision claimed at).
    committed: HashMap<(InstanceId, i64), u32>,
    report: SimReport,
    describe: bool,
    lines: Vec<String>,
}

const START_MS: i64 = 1_700_000_000_000;

impl<'a, S: Store> World<'a, S> {
    fn new(sim: &'a Simulation<S>, describe: bool) -> Self {
        let workers = (0..sim.config.workers.max(1))
            .map(|index| SimWorker {
                id: WorkerId(format!("w{index}")),
                index,
                generation: 0,
                skew_ms: 0,
                claimed: Vec::new(),
                ran: Vec::new(),
            })
            .collect();
        World {
            sim,
            store: (sim.make_store)(),
            now_ms: START_MS,
            workers,
            ids: Vec::new(),
            rows: BTreeMap::new(),
            latest_token: HashMap::new(),
            committed: HashMap::new(),
            report: SimReport::default(),
            describe,
            lines: Vec::new(),
        }
    }

    fn say(&mut self, line: impl FnOnce() -> String) {
        if self.describe {
            self.lines.push(line());
        }
    }

    fn now_of(&self, worker: usize) -> Timestamp {
        Timestamp::from_millis(self.now_ms + self.workers[worker].skew_ms)
    }

    fn begin(&mut self) -> Result<(), Violation> {
        for chunk in self.sim.starts.chunks(limits::INSERT_BATCH_MAX) {
            let params = InsertParams {
                instances: chunk.to_vec(),
                now: Timestamp::from_millis(self.now_ms),
            };
            let outcomes = now_or_never(self.store.instance_insert(params))
                .map_err(|e| violation("store-error", format!("insert: {e}")))?;
            for outcome in outcomes {
                if !self.ids.contains(&outcome.id()) {
                    self.ids.push(outcome.id());
                }
            }
        }
        self.check()
    }

    fn apply(&mut self, event: Event) -> Result<(), Violation> {
        let n = self.workers.len();
        match event {
            Event::Claim { worker } => self.claim(worker % n),
            Event::Run { worker, pick } => {
                self.run_step(worker % n, pick);
                Ok(())
            }
            Event::Commit { worker } => self.commit(worker % n),
            Event::Heartbeat { worker } => self.heartbeat(worker % n),
            Event::Reap { worker } => self.reap(worker % n),
            Event::Sweep { worker } => self.sweep(worker % n),
            Event::Deliver { target, pick, twice } => self.deliver(target, pick, twice),
            Event::Crash { worker, same_id } => self.crash(worker % n, same_id),
            Event::Advance { ms } => {
                self.now_ms += ms as i64;
                self.say(|| format!("clock +{ms} ms"));
                Ok(())
            }
            Event::Skew { worker, ms } => {
                let w = worker % n;
                self.workers[w].skew_ms = ms;
                let name = self.workers[w].id.0.clone();
                self.say(|| format!("{name}'s clock is now {ms:+} ms off"));
                Ok(())
            }
        }
    }

    fn machines(&self) -> Vec<MachineRef> {
        self.sim.machines.iter().map(|(m, _)| m.clone()).collect()
    }

    fn claim(&mut self, w: usize) -> Result<(), Violation> {
        let params = ClaimParams {
            worker: self.workers[w].id.clone(),
            namespaces: Vec::new(),
            queues: Vec::new(),
            machines: self.machines(),
            limit: self.sim.config.claim_batch.clamp(1, limits::CLAIM_BATCH_MAX),
            lease: self.sim.config.lease,
            now: self.now_of(w),
            policy: keel_core::plan::claim::ClaimPolicy::default(),
        };
        let claims = now_or_never(self.store.instance_claim(params))
            .map_err(|e| violation("store-error", format!("claim: {e}")))?;
        for claim in &claims {
            let id = claim.instance.id;
            if let Some(before) = self.rows.get(&id)
                && before.status != Status::Runnable
            {
                return Err(violation(
                    "claim-not-runnable",
                    format!(
                        "{} claimed instance {id}, which was {}",
                        self.workers[w].id, before.status
                    ),
                ));
            }
            let latest = self.latest_token.entry(id).or_insert(i64::MIN);
            if claim.token().0 <= *latest {
                return Err(violation(
                    "token-reused",
                    format!(
                        "instance {id} claimed with token {}, not above {}",
                        claim.token().0,
                        latest
                    ),
                ));
            }
            *latest = claim.token().0;
        }
        let name = self.workers[w].id.0.clone();
        let got: Vec<String> =
            claims.iter().map(|c| format!("{} token {}", c.instance.id, c.token().0)).collect();
        self.say(|| format!("{name} claims [{}]", got.join(", ")));
        self.workers[w].claimed.extend(claims);
        Ok(())
    }

    fn run_step(&mut self, w: usize, pick: usize) {
        let worker = &mut self.workers[w];
        if worker.claimed.is_empty() {
            let name = worker.id.0.clone();
            self.say(|| format!("{name} has no claimed step to run"));
            return;
        }
        let claim = worker.claimed.remove(pick % worker.claimed.len());
        let row = &claim.instance;
        let step = self
            .sim
            .machines
            .iter()
            .find(|(m, _)| *m == row.machine)
            .map(|(_, f)| f)
            .expect("claims name only registered machines");
        let mut commit = step(row, &claim.inbox);
        commit.id = row.id;
        commit.token = claim.token();
        // What the step saw and awaited, as the worker consumes it (see the module docs).
        if commit.consume.is_empty() {
            commit.consume =
                keel_core::inbox::consumed_by(&commit.outcome, row.awaits.as_deref(), &claim.inbox);
        }
        self.report.executions += 1;
        let line = format!(
            "{} runs {} at `{}` (revision {}, token {}) -> {}",
            worker.id.0,
            row.id,
            row.position,
            row.revision.0,
            claim.token().0,
            outcome_name(&commit)
        );
        worker.ran.push((commit, row.revision));
        self.say(|| line);
    }

    fn commit(&mut self, w: usize) -> Result<(), Violation> {
        let ran: Vec<(StepCommit, Revision)> = std::mem::take(&mut self.workers[w].ran);
        let name = self.workers[w].id.0.clone();
        if ran.is_empty() {
            self.say(|| format!("{name} has nothing to commit"));
            return Ok(());
        }
        let mut lines = Vec::new();
        let result = self.commit_batches(&name, &ran, &mut lines);
        self.say(|| format!("{name} commits: {}", lines.join(", ")));
        result
    }

    fn commit_batches(
        &mut self,
        name: &str,
        ran: &[(StepCommit, Revision)],
        lines: &mut Vec<String>,
    ) -> Result<(), Violation> {
        let w = self.workers.iter().position(|w| w.id.0 == name).unwrap_or(0);
        for batch in ran.chunks(limits::COMMIT_BATCH_MAX) {
            let params = CommitParams {
                commits: batch.iter().map(|(c, _)| c.clone()).collect(),
                now: self.now_of(w),
            };
            let results = now_or_never(self.store.step_commit(params))
                .map_err(|e| violation("store-error", format!("commit: {e}")))?;
            for ((commit, claimed_at), result) in batch.iter().zip(results) {
                match result {
                    Ok(receipt) => {
                        self.report.commits += 1;
                        lines.push(format!(
                            "{} accepted (now revision {})",
                            commit.id, receipt.revision.0
                        ));
                        let latest = self.latest_token.get(&commit.id).copied();
                        if latest != Some(commit.token.0) {
                            return Err(violation(
                                "stale-commit",
                                format!(
                                    "{name}'s commit of instance {} with token {} was accepted, but a later claim holds token {}",
                                    commit.id,
                                    commit.token.0,
                                    latest.unwrap_or_default()
                                ),
                            ));
                        }
                        let count = self.committed.entry((commit.id, claimed_at.0)).or_default();
                        *count += 1;
                        if *count > 1 {
                            return Err(violation(
                                "double-commit",
                                format!(
                                    "instance {}'s step at revision {} was committed {count} times",
                                    commit.id, claimed_at.0
                                ),
                            ));
                        }
                        if receipt.revision.0 != claimed_at.0 + 1 {
                            return Err(violation(
                                "revision-skip",
                                format!(
                                    "instance {} went from revision {} to {} in one commit",
                                    commit.id, claimed_at.0, receipt.revision.0
                                ),
                            ));
                        }
                        for outcome in receipt.children.iter().chain(&receipt.spawned) {
                            if !self.ids.contains(&outcome.id()) {
                                self.ids.push(outcome.id());
                            }
                        }
                    }
                    Err(e) if e.kind == ErrorKind::LeaseLost => {
                        self.report.commits_refused += 1;
                        lines.push(format!("{} refused: lease lost", commit.id));
                    }
                    Err(e) => {
                        return Err(violation(
                            "commit-error",
                            format!("{name}'s commit of instance {} failed: {e}", commit.id),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn heartbeat(&mut self, w: usize) -> Result<(), Violation> {
        let leases = self.workers[w].leases();
        let name = self.workers[w].id.0.clone();
        if leases.is_empty() {
            self.say(|| format!("{name} heartbeats nothing"));
            return Ok(());
        }
        for chunk in leases.chunks(limits::COMMIT_BATCH_MAX) {
            let params = LeaseExtendParams {
                worker: self.workers[w].id.clone(),
                leases: chunk.to_vec(),
                lease: self.sim.config.lease,
                now: self.now_of(w),
            };
            let held = now_or_never(self.store.lease_extend(params))
                .map_err(|e| violation("store-error", format!("heartbeat: {e}")))?;
            let kept = held.iter().filter(|h| **h).count();
            self.say(|| format!("{name} heartbeats {} leases, {kept} still held", chunk.len()));
        }
        Ok(())
    }

    fn reap(&mut self, w: usize) -> Result<(), Violation> {
        let now = self.now_of(w);
        let params = LeaseReapParams { owner: None, limit: limits::REAP_BATCH_MAX, now };
        let reaped = now_or_never(self.store.lease_reap(params))
            .map_err(|e| violation("store-error", format!("reap: {e}")))?;
        for id in &reaped {
            let expires = self.rows.get(id).and_then(|r| r.lease_expires_at);
            if expires.is_none_or(|at| at > now) {
                return Err(violation(
                    "early-reap",
                    format!(
                        "instance {id} was reaped at {} while its lease runs until {expires:?}",
                        now.as_millis()
                    ),
                ));
            }
        }
        self.report.reaped += reaped.len() as u64;
        let name = self.workers[w].id.0.clone();
        self.say(|| format!("{name} reaps expired leases: [{}]", list(&reaped)));
        Ok(())
    }

    fn sweep(&mut self, w: usize) -> Result<(), Violation> {
        let params = TimerSweepParams {
            namespace: None,
            machines: Vec::new(),
            limit: limits::TIMER_SWEEP_BATCH_MAX,
            now: self.now_of(w),
        };
        let report = now_or_never(self.store.timer_sweep(params))
            .map_err(|e| violation("store-error", format!("timer sweep: {e}")))?;
        let name = self.workers[w].id.0.clone();
        self.say(|| format!("{name} sweeps timers: {} fired", report.fired));
        Ok(())
    }

    fn deliver(&mut self, target: usize, pick: usize, twice: bool) -> Result<(), Violation> {
        let Some(source) = &self.sim.signals else { return Ok(()) };
        if self.ids.is_empty() {
            return Ok(());
        }
        let id = self.ids[target % self.ids.len()];
        let offered = self.rows.get(&id).map(source).unwrap_or_default();
        if offered.is_empty() {
            self.say(|| format!("no signal to offer {id}"));
            return Ok(());
        }
        let signal = offered[pick % offered.len()].clone();
        let copies = if twice { 2 } else { 1 };
        let params = SignalDeliverParams {
            signals: vec![signal.clone(); copies],
            now: Timestamp::from_millis(self.now_ms),
        };
        let outcomes = now_or_never(self.store.signal_deliver(params))
            .map_err(|e| violation("store-error", format!("deliver `{}`: {e}", signal.name)))?;
        let delivered =
            outcomes.iter().filter(|o| matches!(o, DeliveryOutcome::Delivered { .. })).count();
        self.report.delivered += delivered as u64;
        self.say(|| {
            let what: Vec<&str> = outcomes
                .iter()
                .map(|o| match o {
                    DeliveryOutcome::Delivered { woke: true, .. } => "delivered, woke it",
                    DeliveryOutcome::Delivered { .. } => "delivered",
                    DeliveryOutcome::Duplicate { .. } => "duplicate",
                    DeliveryOutcome::TargetTerminal { .. } => "inbox closed",
                    DeliveryOutcome::TargetMissing => "no such instance",
                })
                .collect();
            format!("deliver `{}` ×{copies} to {id}: {}", signal.name, what.join(", "))
        });
        Ok(())
    }

    fn crash(&mut self, w: usize, same_id: bool) -> Result<(), Violation> {
        self.report.crashes += 1;
        let worker = &mut self.workers[w];
        let lost = worker.claimed.len() + worker.ran.len();
        worker.claimed.clear();
        worker.ran.clear();
        worker.generation += 1;
        let old = worker.id.0.clone();
        if same_id {
            // A restarted worker with its old identity takes back what it held at once.
            let params = LeaseReapParams {
                owner: Some(worker.id.clone()),
                limit: limits::REAP_BATCH_MAX,
                now: Timestamp::from_millis(self.now_ms + worker.skew_ms),
            };
            let reclaimed = now_or_never(self.store.lease_reap(params))
                .map_err(|e| violation("store-error", format!("reclaim: {e}")))?;
            self.report.reaped += reclaimed.len() as u64;
            self.say(|| {
                format!(
                    "{old} crashes (losing {lost} steps) and restarts, reclaiming [{}]",
                    list(&reclaimed)
                )
            });
        } else {
            worker.id = WorkerId(format!("w{}.{}", worker.index, worker.generation));
            let new = worker.id.0.clone();
            self.say(|| format!("{old} crashes (losing {lost} steps); {new} takes its place"));
        }
        Ok(())
    }

    /// Reads every row and checks the engine's rules and the user's invariants.
    fn check(&mut self) -> Result<(), Violation> {
        let mut rows = Vec::with_capacity(self.ids.len());
        for chunk in self.ids.chunks(limits::CLAIM_BATCH_MAX) {
            rows.extend(
                now_or_never(self.store.instance_rows(chunk.to_vec()))
                    .map_err(|e| violation("store-error", format!("read rows: {e}")))?,
            );
        }
        for row in rows {
            let id = row.id;
            let leased = row.lease_owner.is_some() || row.lease_expires_at.is_some();
            if (row.status == Status::Executing) != leased {
                return Err(violation(
                    "lease-shape",
                    format!(
                        "instance {id} is {} with lease owner {:?} until {:?}",
                        row.status, row.lease_owner, row.lease_expires_at
                    ),
                ));
            }
            if row.children_pending < 0 {
                return Err(violation(
                    "barrier-negative",
                    format!("instance {id} waits on {} children", row.children_pending),
                ));
            }
            if let Some(before) = self.rows.get(&id) {
                if row.revision < before.revision || row.fencing_token < before.fencing_token {
                    return Err(violation(
                        "went-back",
                        format!(
                            "instance {id} went from revision {} token {} to revision {} token {}",
                            before.revision.0,
                            before.fencing_token.0,
                            row.revision.0,
                            row.fencing_token.0
                        ),
                    ));
                }
                if before.status.is_terminal()
                    && (row.status != before.status || row.revision != before.revision)
                {
                    return Err(violation(
                        "terminal-changed",
                        format!(
                            "instance {id} was {} and is now {} at revision {}",
                            before.status, row.status, row.revision.0
                        ),
                    ));
                }
            }
            for (name, invariant) in &self.sim.invariants {
                if let Err(why) = invariant(&row) {
                    return Err(violation(
                        &format!("invariant:{name}"),
                        format!("instance {id} ({} at `{}`): {why}", row.status, row.position),
                    ));
                }
            }
            self.rows.insert(id, row);
        }
        Ok(())
    }

    /// Faults stop, clocks agree, and every worker keeps claiming, running and committing
    /// while time moves on; every instance must end, and end clean.
    fn settle(&mut self) -> Result<(), Violation> {
        self.say(|| "-- settling: no more faults --".to_owned());
        for w in &mut self.workers {
            w.skew_ms = 0;
        }
        for round in 0..self.sim.config.settle_rounds {
            if self.rows.values().all(|r| r.status.is_terminal()) {
                break;
            }
            self.now_ms += self.sim.config.lease.as_millis() as i64 + 1;
            self.reap(0)?;
            self.sweep(0)?;
            self.check()?;
            let waiting: Vec<usize> = (0..self.ids.len())
                .filter(|i| {
                    self.rows.get(&self.ids[*i]).is_some_and(|r| r.status == Status::AwaitingSignal)
                })
                .collect();
            for target in waiting {
                self.deliver(target, round, false)?;
            }
            self.check()?;
            for w in 0..self.workers.len() {
                self.claim(w)?;
                while !self.workers[w].claimed.is_empty() {
                    self.run_step(w, 0);
                }
                self.commit(w)?;
                self.check()?;
            }
        }
        let unfinished: Vec<String> = self
            .rows
            .values()
            .filter(|r| !r.status.is_terminal())
            .map(|r| format!("{} {} at `{}`", r.id, r.status, r.position))
            .collect();
        if !unfinished.is_empty() {
            return Err(violation(
                "hung",
                format!(
                    "after {} settling rounds these instances never finished: {}",
                    self.sim.config.settle_rounds,
                    unfinished.join(", ")
                ),
            ));
        }
        for id in self.ids.clone() {
            let detail = now_or_never(self.store.instance_get(id))
                .map_err(|e| violation("store-error", format!("read instance {id}: {e}")))?;
            if !detail.inbox.is_empty() || !detail.timers.is_empty() {
                return Err(violation(
                    "terminal-leftovers",
                    format!(
                        "terminal instance {id} keeps {} inbox rows and {} timers",
                        detail.inbox.len(),
                        detail.timers.len()
                    ),
                ));
            }
        }
        self.report.instances = self.ids.len() as u64;
        Ok(())
    }
}

fn outcome_name(commit: &StepCommit) -> String {
    use keel_core::Outcome;
    match &commit.outcome {
        Outcome::Next { step, .. } => format!("next `{step}`"),
        Outcome::Retry { delay, .. } => format!("retry in {} ms", delay.as_millis()),
        Outcome::Await { signal, .. } => format!("await `{signal}`"),
        Outcome::ScheduleChildren { children, .. } => format!("{} children", children.len()),
        Outcome::Done { .. } => "done".to_owned(),
        Outcome::Stop { reason } => format!("stop: {reason}"),
        Outcome::Suspend => "suspend".to_owned(),
    }
}

/// The message a panic was given, when it was a string.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}

fn list(ids: &[InstanceId]) -> String {
    ids.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}
