//! Step machines (gen_durable style): a machine is a set of named async steps; each step
//! sees its instance's context, attempt, inbox and children, and returns an outcome.

use async_trait::async_trait;
use keel_core::SignalId;
use keel_core::chart::TimerArm;
use keel_core::config::{KeelConfig, QueueConfig};
use keel_core::instance::{ChildSummary, HistoryEntry, NewInstance, NewSignal, Signal};
use keel_core::retry::{ErrorClass, FailureKind, RetryPolicy};
use keel_core::{Instance, InstanceId, MachineRef, Outcome};
use serde_json::Value;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Everything a step can see. Built from the claim; read-only.
#[derive(Debug, Clone)]
pub struct StepContext {
    /// The instance.
    pub id: InstanceId,
    /// Its machine.
    pub machine: MachineRef,
    /// Its namespace.
    pub namespace: String,
    /// The queue it runs on.
    pub queue: String,
    /// The step to run.
    pub step: String,
    /// Attempts of this step so far (0 on the first run).
    pub attempt: i32,
    /// The context.
    pub context: Value,
    /// The signal it parked on, if it was woken by one.
    pub awaits: Option<String>,
    /// The inbox signals it may consume, oldest first.
    pub signals: Vec<Signal>,
    /// Its children (after a `ScheduleChildren` barrier released).
    pub children: Vec<ChildSummary>,
    /// Business key, if any.
    pub business_key: Option<String>,
    /// The parent's row as read just after the step was claimed (one batched read per
    /// claim), when the machine asked for it
    /// ([`StepMachine::wants_parent`]) and the instance has a parent. Read without any
    /// lock: it may be stale by the time the step commits (a pre-check, not a guard).
    pub parent: Option<Instance>,
    /// The retry policy the step runs under: that of what its machine sets for it in code
    /// ([`StepMachine::step_config`]), under the configuration file's levels for the
    /// machine and for the event the step processes ([`StepMachine::event_for`]), under
    /// what the machine sets over the file ([`StepMachine::step_config_over`]). An error
    /// handler ([`StepMachine::handle`]) that makes its own retry decision takes it from
    /// here, so the step's timeout and its tries come from one configuration.
    pub retry: RetryPolicy,
    /// What the step asked for besides its outcome; goes into the step's own commit.
    pub(crate) effects: Arc<Mutex<Effects>>,
}

/// Side effects a step requests; all of them ride the step's commit, and all of them are
/// dropped when the step fails.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    pub(crate) emit: Vec<NewSignal>,
    pub(crate) spawn: Vec<NewInstance>,
    pub(crate) history: Vec<HistoryEntry>,
    /// Overrides the default consumption rule.
    pub(crate) consume: Option<Vec<SignalId>>,
    /// The inbox signal the step is processing, for dead letters.
    pub(crate) processing: Option<Signal>,
    pub(crate) timers_cancel: Vec<String>,
    pub(crate) timers_arm: Vec<TimerArm>,
    pub(crate) children_cancel: Vec<String>,
}

impl StepContext {
    /// Emits an event to another instance. It is inserted into the target's inbox in the
    /// same commit as this step's outcome (transactional outbox): if the step's result is
    /// discarded (error, lost lease, crash) the event is never sent; if it commits, the
    /// event is there. An emit to a missing target rejects the commit, so the step re-runs.
    pub fn emit(&self, signal: NewSignal) {
        self.effects().emit.push(signal);
    }

    /// Starts a child instance in this step's commit, without waiting for it (its
    /// `parent` is this instance). With `invoked_by` set, its terminal commit reports
    /// back into this instance's inbox.
    pub fn spawn(&self, child: NewInstance) {
        self.effects().spawn.push(child);
    }

    /// A new child instance of `machine` starting at `position`, in this instance's
    /// namespace and queue and carrying its correlation: pass it to [`spawn`](Self::spawn)
    /// or a `ScheduleChildren` outcome. Override any of these on the returned value.
    pub fn child(&self, machine: MachineRef, position: impl Into<String>) -> NewInstance {
        NewInstance::new(machine, position)
            .namespace(&self.namespace)
            .queue(&self.queue)
            .correlation_id(self.id.0.to_string())
    }

    /// Arms a durable timer in this step's commit (due one interval after it).
    pub fn timer_arm(&self, timer: TimerArm) {
        self.effects().timers_arm.push(timer);
    }

    /// Cancels, in this step's commit, every timer owned by `state` or its descendants.
    pub fn timer_cancel(&self, state: &str) {
        self.effects().timers_cancel.push(state.to_owned());
    }

    /// Cancels, in this step's commit, the live child machines this instance started from
    /// its delegation state `state`, with their own descendants. A cancelled child's step
    /// that is still running cannot commit afterwards.
    pub fn cancel_children(&self, state: &str) {
        self.effects().children_cancel.push(state.to_owned());
    }

    /// Appends a history entry in this step's commit.
    pub fn record(&self, entry: HistoryEntry) {
        self.effects().history.push(entry);
    }

    /// Consumes exactly these inbox signals on success, instead of the default rule (the
    /// seen signals that match what the instance awaited).
    pub fn consume(&self, ids: Vec<SignalId>) {
        self.effects().consume = Some(ids);
    }

    /// Marks the inbox signal this step processes: a dead letter then names it, and the
    /// `skip` policy consumes it.
    pub fn processing(&self, signal: &Signal) {
        self.effects().processing = Some(signal.clone());
    }

    pub(crate) fn effects(&self) -> std::sync::MutexGuard<'_, Effects> {
        self.effects.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The context deserialized as `T`. A context that does not fit `T` is a
    /// non-retryable error (it will not fit on the next attempt either).
    pub fn context_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, StepError> {
        serde_json::from_value(self.context.clone()).map_err(|e| {
            StepError::fatal(format!(
                "the context of instance {} does not fit the machine's context type: {e}",
                self.id
            ))
        })
    }

    /// The payload of the inbox signal `signal` deserialized as `P`. A payload that does
    /// not fit `P` is a non-retryable error naming the event, the signal and this
    /// instance (it will not fit on the next attempt either), and the signal is marked as
    /// the one this step processes ([`processing`](Self::processing)): its dead letter
    /// holds the event, and the `skip` policy consumes it. Prefer this to
    /// [`Signal::payload_as`] with `?`, which makes the same error a retryable one.
    pub fn payload_as<P: serde::de::DeserializeOwned>(
        &self,
        signal: &Signal,
    ) -> Result<P, StepError> {
        signal.payload_as().map_err(|e| {
            self.processing(signal);
            StepError::fatal(format!(
                "the payload of event {:?} (signal {}) to instance {} does not fit the \
                 step's payload type: {e}",
                signal.name, signal.id, self.id
            ))
        })
    }

    /// The first inbox signal named `name`, if any.
    pub fn signal(&self, name: &str) -> Option<&Signal> {
        self.signals.iter().find(|s| s.name == name)
    }
}

/// A step failed. What happens next (retry, dead-letter, skip) is decided from its
/// [`kind`](Self::kind) and the retry policy by `keel_core::retry::decide`; the message is
/// for people and never inspected.
///
/// Any [`std::error::Error`] converts into a *retryable* `StepError`, so `?` works inside a
/// step; mark the failures that trying again cannot fix with [`StepError::fatal`],
/// [`StepError::non_retryable`] or [`NonRetryable::non_retryable`] on a `Result`:
///
/// ```
/// use keel_scheduler::machine::{NonRetryable, StepError};
///
/// fn read_config(path: &str) -> Result<String, StepError> {
///     // A missing file may appear later: retried with the machine's back-off.
///     let text = std::fs::read_to_string(path)?;
///     // A malformed number will stay malformed: no retry, straight to the dead letters.
///     let _port: u16 = text.trim().parse().non_retryable()?;
///     Ok(text)
/// }
/// assert!(read_config("/no/such/file").is_err());
/// ```
///
/// Because of that blanket conversion `StepError` itself does not implement
/// `std::error::Error` (the same trade-off `anyhow::Error` makes); it implements `Display`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepError {
    /// What went wrong.
    pub message: String,
    /// What kind of failure it was.
    pub kind: FailureKind,
}

impl StepError {
    /// A retryable error (timeouts, connection errors, rate limits).
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::of_kind(FailureKind::Action, message)
    }
    /// A non-retryable error (validation, business failure, auth).
    pub fn fatal(message: impl Into<String>) -> Self {
        Self::of_kind(FailureKind::NonRetryable, message)
    }
    /// The same error, marked non-retryable.
    pub fn non_retryable(self) -> Self {
        StepError { kind: FailureKind::NonRetryable, ..self }
    }
    /// An error of `kind` (the runtime's own failures: timeouts, panics, refused results).
    pub fn of_kind(kind: FailureKind, message: impl Into<String>) -> Self {
        StepError { message: message.into(), kind }
    }
    /// Whether trying again may help.
    pub fn class(&self) -> ErrorClass {
        self.kind.class()
    }
}

impl<E: std::error::Error> From<E> for StepError {
    fn from(error: E) -> Self {
        StepError::retryable(keel_core::error::with_causes(&error))
    }
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Marks the error of a `Result` as one trying again cannot fix.
pub trait NonRetryable<T> {
    /// `Err(e)` becomes a non-retryable [`StepError`] carrying `e`'s message.
    fn non_retryable(self) -> Result<T, StepError>;
}

impl<T, E: Into<StepError>> NonRetryable<T> for Result<T, E> {
    fn non_retryable(self) -> Result<T, StepError> {
        self.map_err(|e| e.into().non_retryable())
    }
}

/// A durable machine written as steps.
///
/// Effects inside a step must be idempotent: a crash before the step's commit re-runs the
/// whole step.
#[async_trait]
pub trait StepMachine: Send + Sync + 'static {
    /// The `(name, version)` this implementation runs.
    fn machine(&self) -> MachineRef;

    /// Runs one step.
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError>;

    /// Decides what a failed step leads to. `Ok(None)` (the default) applies the queue's
    /// retry policy; `Ok(Some(outcome))` commits that outcome; `Err` fails the instance.
    /// Events emitted and history recorded through `ctx` *during this call* ride the
    /// failure commit (what the failed step itself emitted is dropped).
    async fn handle(
        &self,
        error: &StepError,
        ctx: &StepContext,
    ) -> Result<Option<Outcome>, StepError> {
        let _ = (error, ctx);
        Ok(None)
    }

    /// The queue configuration (timeout, retry policy, dead letters) for this machine.
    /// Only those keys apply to a machine: a worker refuses to start with one that sets
    /// `concurrency`, `strategy`, `priority` or `alerts` away from the default
    /// ([`QueueConfig::not_applied_in_code`] says where each belongs).
    fn config(&self) -> QueueConfig {
        QueueConfig::default()
    }

    /// The order this machine's steps see pending events in ([`InboxOrder`]): arrival
    /// order by default; `priority` lets an urgent event overtake earlier ones. A file's
    /// `[machines.<name>] inbox_order` wins over this.
    ///
    /// [`InboxOrder`]: keel_core::inbox::InboxOrder
    fn inbox_order(&self) -> keel_core::inbox::InboxOrder {
        keel_core::inbox::InboxOrder::Arrival
    }

    /// The queue configuration for one step of this machine (timeout, retry policy), which
    /// the configuration file's levels then override; defaults to [`config`](Self::config).
    fn step_config(&self, step: &str) -> QueueConfig {
        let _ = step;
        self.config()
    }

    /// What this machine sets on one step over every level of the configuration file:
    /// `resolved` is the step's configuration ([`step_config`](Self::step_config)) with the
    /// file's levels applied, and the step runs with what this returns. Default: `resolved`
    /// unchanged. A chart's region tasks take `job_timeout`, `job_tries` and `job_backoff`
    /// of their `[parallel_dispatch]` here, so those win over the file's `[queue]` timeout
    /// and retry.
    fn step_config_over(&self, step: &str, resolved: QueueConfig) -> QueueConfig {
        let _ = step;
        resolved
    }

    /// The inbox signal a step at `step` processes, among `inbox` (the signals it sees, in
    /// the machine's order): the configuration file's section for that event
    /// (`[machines.<name>.events.<event>]`) applies to the step. `None`: the step
    /// processes no event and runs under the machine's settings. Default: the first
    /// signal, whatever the step's name (a failed attempt consumes nothing, so its
    /// retries keep the event's settings). A chart overrides it with
    /// [`keel_core::inbox::step_event`], which processes none at the chart's start
    /// (`@init`) or in a region task (`@region`).
    fn event_for<'a>(&self, step: &str, inbox: &'a [Signal]) -> Option<&'a Signal> {
        let _ = step;
        inbox.first()
    }

    /// Queues this machine starts work in besides the queue of the instance at hand (a
    /// chart's `ParallelConfig::queue` for its region tasks, its
    /// `ChartMachine::with_child_queue` queues for delegated children). A worker that
    /// registers the machine serves each of them, as it serves the queues a configuration
    /// file names, so that work does not wait in a queue no worker claims. Default: none.
    fn queues_started(&self) -> Vec<String> {
        Vec::new()
    }

    /// Takes what the configuration file says about this machine beyond its queue
    /// settings, once, when a worker that has a file registers it (the worker applies
    /// timeout, retry and dead-letter settings per step itself). Default: nothing; a chart
    /// takes `[parallel_dispatch]` and its own `[machines.<name>.parallel_dispatch]` here.
    fn apply_settings(&mut self, settings: &KeelConfig) {
        let _ = settings;
    }

    /// What this machine names but was not given, each as `kind `name``, e.g.
    /// ``action `notify` ``: a worker refuses to start with a machine while this is not
    /// empty ([`Worker::check`](crate::Worker::check), with [`cannot_run`]'s message).
    /// Default: nothing (a step machine's steps are its own code).
    fn unbound(&self) -> Vec<String> {
        Vec::new()
    }

    /// The timers this machine's instances follow when it is deployed
    /// (`Definition::followed_timers` for a chart): at start-up the worker moves timers
    /// already armed to these durations. Default: none.
    fn followed_timers(&self) -> Vec<keel_core::chart::TimerArm> {
        Vec::new()
    }

    /// What is likely a slip in this machine's definition, each as a line naming the
    /// machine (a chart's `Definition::warnings`: a state nothing leads to, a shadowed
    /// transition, a transition into a sibling region; and, with parallel dispatch on, a
    /// parallel state whose failed region tasks no `@fail` answers). A worker that registers the
    /// machine logs each once at `warn` level; they never stop it. Default: none.
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }

    /// Every event this machine's steps can process, when that is known up front (a
    /// chart's `Definition::event_alphabet`); the `keel` facade holds the configuration
    /// file's event sections against them. Default `None`: a step machine processes
    /// whatever its senders send.
    fn events(&self) -> Option<Vec<String>> {
        None
    }

    /// Machines this one starts as children (chart delegation states), each in the
    /// version its children run. The `keel` facade's `WorkerBuilder::spawn` checks that
    /// each is registered with it in that version, or declared as served by another
    /// worker: a child of a version nobody serves would never run, and its parent would
    /// wait for it for ever. Default: none.
    fn delegates(&self) -> Vec<MachineRef> {
        Vec::new()
    }

    /// Whether the worker should read the parent's row before running `step` (into
    /// [`StepContext::parent`]). Default `false`: it costs a read (one `instance_rows`
    /// call per claim, shared by every claimed step that wants its parent).
    fn wants_parent(&self, step: &str) -> bool {
        let _ = step;
        false
    }
}

/// Why a worker refuses `machine` (as `name vN`): what it names but was not given
/// (`missing`, each as ``action `notify` `` or ``delegated machine `payment` v1``), and how to
/// fix each kind.
pub fn cannot_run(machine: &str, missing: &[String]) -> String {
    let mut message =
        format!("machine {machine} cannot run on this worker; missing: {}.", missing.join(", "));
    if missing.iter().any(|m| m.starts_with("action ")) {
        message.push_str(" Fix: bind each action with `ChartMachine::action(name, …)`.");
    }
    if missing.iter().any(|m| m.starts_with("delegated machine ")) {
        message.push_str(
            " Fix: register each delegated machine on this worker, or declare it with \
             `WorkerBuilder::served_elsewhere(name)` when another worker runs it.",
        );
    }
    message
}
