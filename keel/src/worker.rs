//! Workers from a [`Keel`](crate::Keel): machines are checked when they are registered,
//! and [`WorkerBuilder::run`] stops gracefully on Ctrl-C or SIGTERM.

use crate::settings::{self, UnusedSection};
use crate::store::AnyStore;
use crate::{AnyClock, Error};
use keel_core::config::KeelConfig;
use keel_core::ids::MachineRef;
use keel_core::ports::Queue;
use keel_core::schedule::ScheduleAction;
use keel_scheduler::worker::WorkerStats;
use keel_scheduler::{HintConfig, HintStats, StepMachine, Worker, WorkerConfig, WorkerHandle};
use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

/// A machine a worker cannot run as given: every name it uses but was not given. Its
/// `Debug` output is its message, for `main` functions that return errors.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistrationError {
    /// The machine, as `name vN`.
    pub machine: String,
    /// Each missing piece, as ``action `notify` ``, ``delegated machine `payment` v1`` or
    /// ``a delegation state starting `paymnet`, which `with_child_version` names (…)``.
    pub missing: Vec<String>,
}

impl fmt::Display for RegistrationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&keel_scheduler::machine::cannot_run(&self.machine, &self.missing))
    }
}

impl fmt::Debug for RegistrationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for RegistrationError {}

/// A worker being put together: register machines, then [`spawn`](Self::spawn) it or
/// [`run`](Self::run) it until the process is asked to stop.
pub struct WorkerBuilder {
    worker: Worker<AnyStore, AnyClock>,
    /// The queue link's counters, when the worker has a queue.
    hint_stats: Option<Arc<HintStats>>,
    /// Registered machines: name, version and the machines they delegate to, each in the
    /// version its children run.
    machines: Vec<(String, i32, Vec<MachineRef>)>,
    /// The events of each registered machine, by name, in registration order: a chart's
    /// ([`Definition::event_alphabet`](keel_core::chart::Definition::event_alphabet)), or
    /// `None` for a step machine, whose events are whatever its senders send.
    events: Vec<(String, Option<Vec<String>>)>,
    elsewhere: BTreeSet<String>,
    /// Why this worker must not start, found while it was made (a configuration file it
    /// cannot apply); [`spawn`](Self::spawn) returns it.
    refused: Option<Error>,
    /// The configuration file the worker applies, if any: its sections are checked
    /// against the registered machines when the worker starts.
    settings: Option<Arc<KeelConfig>>,
    /// The queues the program gave the worker to claim from, before the file added its
    /// own: a `[queues.<q>]` section for one of them is in use.
    own_queues: Vec<String>,
    /// The schedules this worker fires that start instances: name and what they start.
    schedule_starts: Vec<(String, MachineRef)>,
}

impl WorkerBuilder {
    /// A worker with `config`; `own_queues` are the queues its program gave it to claim
    /// from, before a configuration file was applied to `config` (the file adds every
    /// queue it names).
    pub(crate) fn new(
        store: AnyStore,
        clock: AnyClock,
        config: WorkerConfig,
        own_queues: Vec<String>,
    ) -> Self {
        let settings = config.settings.clone();
        let schedule_starts = config
            .schedules
            .schedules()
            .iter()
            .filter_map(|s| match s.action() {
                ScheduleAction::Start(new) => Some((s.name().to_owned(), new.machine.clone())),
                ScheduleAction::Broadcast(_) => None,
            })
            .collect();
        // Each worker wraps the store anew; workers of one `Keel` (or of clones of one
        // store) share what it wraps, which keeps their ids apart.
        let shared = Arc::clone(store.inner());
        WorkerBuilder {
            worker: Worker::new(Arc::new(store), clock, config).with_store_identity(&shared),
            hint_stats: None,
            machines: Vec::new(),
            events: Vec::new(),
            elsewhere: BTreeSet::new(),
            refused: None,
            settings,
            own_queues,
            schedule_starts,
        }
    }

    /// This worker with `error` for [`spawn`](Self::spawn) to return.
    pub(crate) fn refuse(mut self, error: Error) -> Self {
        self.refused = Some(error);
        self
    }

    /// Registers a machine. A chart whose definition names actions that were not bound is
    /// refused here, with every missing name in the error, instead of failing its instances
    /// later; so is a machine whose configuration in code ([`StepMachine::config`]) is out
    /// of its bounds (a zero timeout, a retry policy out of range, …) or sets a field a
    /// machine's configuration does not apply (`concurrency`, `strategy`, `priority`,
    /// `alerts`), naming the field and the fix. The machine's definition warnings
    /// ([`StepMachine::warnings`]: a chart's unreachable state, shadowed transition,
    /// transition into a sibling region, a dispatched parallel state no `@fail` answers)
    /// are logged here, once each, at `warn` level with
    /// the machine and its version; they never stop the worker. A `(name, version)`
    /// registered here already is refused too: which of two machines runs the steps of one
    /// version must not depend on the order of the calls.
    pub fn register(mut self, machine: impl StepMachine) -> Result<Self, RegistrationError> {
        let name = machine.machine();
        let delegates = machine.delegates();
        let events = machine.events();
        // The worker serves the queues the machine starts work in: they are in use, so a
        // file section for one is no misspelling.
        // Read as the runtime's worker reads it: a machine that panics here serves nothing
        // more, and is not refused for it.
        let started =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| machine.queues_started()))
                .unwrap_or_default();
        for queue in started {
            if !self.own_queues.contains(&queue) {
                self.own_queues.push(queue);
            }
        }
        self.worker = self.worker.register(machine);
        // The runtime's worker keeps the rules (it refuses to start with such a machine);
        // here they are said at once, for this machine.
        if self.worker.registered_twice() == Some(&name) {
            return Err(RegistrationError {
                machine: format!("{} v{}", name.name, name.version),
                missing: vec![format!(
                    "a (name, version) of its own (`{}` v{} is registered on this worker \
                     already; register each (name, version) once, or give the second machine \
                     a version of its own)",
                    name.name, name.version
                )],
            });
        }
        if let Some(missing) = self.worker.unbound(&name) {
            return Err(RegistrationError {
                machine: format!("{} v{}", name.name, name.version),
                missing: missing.to_vec(),
            });
        }
        if let Some(problem) = self.worker.config_problem(&name) {
            return Err(RegistrationError {
                machine: format!("{} v{}", name.name, name.version),
                missing: vec![problem.to_owned()],
            });
        }
        self.machines.push((name.name.clone(), name.version, delegates));
        self.events.push((name.name.clone(), events));
        // The configuration file's levels for this machine must resolve over what it set
        // in code (a relational rule such as `initial_delay <= max_delay` can span both).
        if let Err(e) = self.worker.check_settings() {
            return Err(RegistrationError {
                machine: format!("{} v{}", name.name, name.version),
                missing: vec![format!("a usable configuration ({e})")],
            });
        }
        Ok(self)
    }

    /// Gives this worker a queue of ready-work hints (see [`crate::queue`]), in place of
    /// the one its [`Keel`](crate::Keel) was given, if any. A bad `config` is an error
    /// naming the field.
    pub fn with_queue(self, queue: Arc<dyn Queue>, config: HintConfig) -> Result<Self, Error> {
        check_hints(&config, queue.as_ref())?;
        Ok(self.hints_from(queue, config))
    }

    /// [`with_queue`](Self::with_queue) for a `config` already checked.
    pub(crate) fn hints_from(mut self, queue: Arc<dyn Queue>, config: HintConfig) -> Self {
        let (worker, stats) = self.worker.with_queue(queue, config);
        self.worker = worker;
        self.hint_stats = Some(stats);
        self
    }

    /// The queue link's counters (hints published, received, claimed, repaired), when the
    /// worker has a queue; they keep counting after [`spawn`](Self::spawn).
    pub fn hint_stats(&self) -> Option<Arc<HintStats>> {
        self.hint_stats.clone()
    }

    /// Declares that `machine` (a chart's delegated child machine) is served by another
    /// worker, so this one may start without it: every version of it, since this worker
    /// cannot know which versions the other serves.
    pub fn served_elsewhere(mut self, machine: impl Into<String>) -> Self {
        self.elsewhere.insert(machine.into());
        self
    }

    /// Checks that every delegated machine is registered here, in the version its
    /// children run, or served elsewhere.
    fn check(&self) -> Result<(), RegistrationError> {
        for (machine, version, delegates) in &self.machines {
            let missing: Vec<String> = delegates
                .iter()
                .filter(|d| !self.elsewhere.contains(&d.name))
                .filter_map(|d| self.unserved(machine, &d.name, d.version))
                .collect();
            if !missing.is_empty() {
                return Err(RegistrationError {
                    machine: format!("{machine} v{version}"),
                    missing,
                });
            }
        }
        Ok(())
    }

    /// What is missing for `chart`'s children of `delegated` `version` to run here, as a
    /// piece of a [`RegistrationError`]; `None` when this worker serves them.
    fn unserved(&self, chart: &str, delegated: &str, version: i32) -> Option<String> {
        let here: Vec<i32> =
            self.machines.iter().filter(|(m, _, _)| m == delegated).map(|(_, v, _)| *v).collect();
        if here.contains(&version) {
            return None;
        }
        if here.is_empty() {
            return Some(format!("delegated machine `{delegated}` v{version}"));
        }
        let registered = here.iter().map(|v| format!("v{v}")).collect::<Vec<_>>().join(", ");
        let newest = here.iter().max().copied().unwrap_or(version);
        Some(format!(
            "delegated machine `{delegated}` v{version} (chart `{chart}` starts its children \
             as v{version}, but this worker registers `{delegated}` {registered} only, so they \
             would never run and the parent would wait for them forever; if v{newest} is \
             meant, give the chart `.with_child_version(\"{delegated}\", {newest})`, else \
             register `{delegated}` v{version} too)"
        ))
    }

    /// Starts the worker's tasks on the current tokio runtime; stop it with
    /// [`WorkerHandle::shutdown`]. Refuses, before anything runs, a delegated machine
    /// nobody serves, or serves in another version than the chart's children run
    /// ([`ChartMachine::with_child_version`](keel_scheduler::ChartMachine::with_child_version),
    /// else 1) ([`Error::Registration`]), and a [`WorkerConfig`] out of its bounds
    /// (a zero lease, a heartbeat not under the lease, an invalid timer sweep, schedule or
    /// retention: [`Error::Settings`], naming the field), and a configuration file given
    /// to [`Keel::with_settings`](crate::Keel::with_settings) that the worker cannot apply
    /// ([`Error::Config`]). A worker id that a running worker on the same store in this
    /// process already uses is refused too ([`Error::Settings`], naming the id), unless it
    /// is the default id, which is numbered instead (see
    /// [`WorkerConfig::worker_id`](keel_scheduler::WorkerConfig::worker_id)).
    ///
    /// A section of the configuration file that no machine of this worker uses (see
    /// [`unused_sections`](Self::unused_sections)) is logged when the worker starts: a
    /// warning naming the section and the name it is most likely a misspelling of, or,
    /// for sections of machines this worker neither registers nor resembles, one
    /// information line (a file shared by workers of different machines has those).
    pub fn spawn(mut self) -> Result<WorkerHandle, Error> {
        if let Some(error) = self.refused.take() {
            return Err(error);
        }
        self.check()?;
        let unused = self.unused_machine_sections();
        let unused_events = self.unused_event_sections();
        let versions = self.schedule_versions();
        let handle = self.worker.try_spawn().map_err(Error::Settings)?;
        log_unused(
            &unused,
            "machine or queue of this worker",
            "machines this worker does not register (served by other workers, or misspelt)",
        );
        log_unused(
            &unused_events,
            "event of that chart on this worker, so it never takes effect",
            "events the charts of this worker do not have (events of other versions, or \
             misspelt)",
        );
        for warning in &versions {
            tracing::warn!("{warning}");
        }
        Ok(handle)
    }

    /// The schedules this worker fires that start a version of one of its machines it
    /// does not register (a schedule left on `version = 1`, the default, after the
    /// machine moved to version 2, say): each as a message naming the schedule, both
    /// versions and the fix, logged as a warning at start-up. Not an error: while a
    /// version rolls out, other workers may still serve the older one. A schedule that
    /// starts a machine this worker does not register at all is not reported (a node that
    /// only fires schedules has none).
    pub fn schedule_versions(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (schedule, start) in &self.schedule_starts {
            let here: Vec<i32> = self
                .machines
                .iter()
                .filter(|(m, _, _)| *m == start.name)
                .map(|(_, v, _)| *v)
                .collect();
            if here.is_empty() || here.contains(&start.version) {
                continue;
            }
            let registered = here.iter().map(|v| format!("v{v}")).collect::<Vec<_>>().join(", ");
            let newest = here.iter().max().copied().unwrap_or(start.version);
            out.push(format!(
                "schedule `{schedule}` starts `{}` v{}, but this worker registers `{}` \
                 {registered} only; its instances wait for a worker that registers v{}. If \
                 v{newest} is meant, set `version = {newest}` in the schedule's start",
                start.name, start.version, start.name, start.version
            ));
        }
        out
    }

    /// The sections of the configuration file this worker applies that name a machine it
    /// neither registers nor declares [`served_elsewhere`](Self::served_elsewhere), or a
    /// queue that is a likely misspelling of one in use: one its machines start in or
    /// dispatch regions to by the file, or one the program gave the worker to claim from
    /// ([`settings::unused_sections`]); then the `[machines.<m>.events.<e>]` sections of
    /// the charts it registers that name an event the chart does not have
    /// ([`settings::unused_event_sections`]). Empty without a file.
    pub fn unused_sections(&self) -> Vec<UnusedSection> {
        let mut unused = self.unused_machine_sections();
        unused.extend(self.unused_event_sections());
        unused
    }

    /// The machine, retention and queue sections of [`unused_sections`](Self::unused_sections).
    fn unused_machine_sections(&self) -> Vec<UnusedSection> {
        let Some(settings) = &self.settings else { return Vec::new() };
        let mut names: Vec<&str> = self.machines.iter().map(|(m, _, _)| m.as_str()).collect();
        names.extend(self.elsewhere.iter().map(String::as_str));
        names.sort_unstable();
        names.dedup();
        let queues: Vec<&str> = self.own_queues.iter().map(String::as_str).collect();
        settings::unused_sections(settings, &names, &queues)
    }

    /// The event sections of [`unused_sections`](Self::unused_sections): for each machine
    /// whose every registered version is a chart, and that no other worker serves (its
    /// versions there may have other events), the sections naming none of the events of
    /// those versions. A step machine's events are not known, so its sections are not held
    /// against anything.
    fn unused_event_sections(&self) -> Vec<UnusedSection> {
        let Some(settings) = &self.settings else { return Vec::new() };
        let mut by_machine: std::collections::BTreeMap<&str, Option<BTreeSet<&str>>> =
            std::collections::BTreeMap::new();
        for (machine, events) in &self.events {
            let known = by_machine.entry(machine.as_str()).or_insert_with(|| Some(BTreeSet::new()));
            match (known.as_mut(), events) {
                (Some(known), Some(events)) => known.extend(events.iter().map(String::as_str)),
                _ => *known = None,
            }
        }
        by_machine
            .into_iter()
            .filter(|(machine, _)| !self.elsewhere.contains(*machine))
            .filter_map(|(machine, events)| Some((machine, events?)))
            .flat_map(|(machine, events)| {
                let events: Vec<&str> = events.into_iter().collect();
                settings::unused_event_sections(settings, machine, &events)
            })
            .collect()
    }

    /// Runs the worker until the process gets Ctrl-C (SIGINT) or SIGTERM, then shuts it
    /// down gracefully: no new claims, running steps get the configured grace period
    /// to finish and commit, the leases of the rest are released so another worker (or
    /// this one, restarted) takes them at once. A second Ctrl-C or SIGTERM during that
    /// wait returns at once, with the counters so far: the process can then end without
    /// waiting, and the steps still running are left to their leases, which expire and
    /// are run again elsewhere (as after a crash).
    pub async fn run(self) -> Result<Arc<WorkerStats>, Error> {
        let handle = self.spawn()?;
        crate::shutdown_signal().await;
        tracing::info!(
            "stop requested; shutting the worker down (a second stop request ends the wait)"
        );
        let stats = Arc::clone(handle.stats());
        tokio::select! {
            stats = handle.shutdown() => Ok(stats),
            () = crate::shutdown_signal() => {
                tracing::warn!(
                    "second stop request; no longer waiting for running steps (their leases \
                     expire and they run again)"
                );
                Ok(stats)
            }
        }
    }
}

/// Logs what [`WorkerBuilder::unused_sections`] found: each likely misspelling as a
/// warning of its own (the section "names no {`names`}"), the other sections together as
/// one information line ("configuration sections for {`others`}").
fn log_unused(unused: &[UnusedSection], names: &str, others: &str) {
    let mut rest = Vec::new();
    for section in unused {
        match &section.closest {
            Some(near) => tracing::warn!(
                section = %section.section,
                closest = %near,
                "configuration section {} names no {names}; did you mean `{near}`? If it is \
                 misspelt, fix the name in the file",
                section.section
            ),
            None => rest.push(section.section.as_str()),
        }
    }
    if !rest.is_empty() {
        tracing::info!(
            sections = %rest.join(", "),
            "configuration sections for {others}: {}",
            rest.join(", ")
        );
    }
}

/// `config`'s bounds, as the error [`crate::Keel::with_queue`] and
/// [`WorkerBuilder::with_queue`] return.
pub(crate) fn check_hints(config: &HintConfig, queue: &dyn Queue) -> Result<(), Error> {
    config.validate_for(queue).map_err(|e| Error::Settings(format!("invalid HintConfig: {e}")))
}
