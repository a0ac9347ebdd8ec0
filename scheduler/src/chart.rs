//! Charts on the engine: a [`ChartMachine`] runs a statechart definition durably. Each
//! step takes the oldest event in the instance's inbox and drives the core's sans-IO
//! chart step ([`keel_core::chart::step::ChartStep`]) with it, running the actions it asks
//! for — async, with IO — and commits the step's plan (the new configuration, context,
//! the consumed event, history, timers, emitted events, started child machines and region
//! tasks) in one commit. Then it parks until the next event. The in-memory `TestMachine`
//! drives the same step, so both record the same history for the same events.
//!
//! A new chart instance starts at the position [`INIT`]; its first step enters the
//! initial states (running their entry actions). The configuration is stored as the
//! instance's position: the JSON array of active state paths. A finished instance keeps
//! its final configuration there, so `["approved"]` and `["rejected"]` tell two final
//! states apart.

use crate::machine::{StepContext, StepError, StepMachine};
use async_trait::async_trait;
use keel_core::chart::parallel::{
    ParallelBook, RegionReport, RegionRun, Skip, action_failure, check, unhandled_region_failures,
};
use keel_core::chart::step::{ChartStep, MACROSTEP, StepPlan};
use keel_core::chart::{
    ActionError, ActionRequest, ActionResult, ChartContext, Configuration, Definition, Event,
    Limits, SharedContext,
};
use keel_core::config::QueueConfig;
use keel_core::instance::{ANY_SIGNAL, NewInstance, NewSignal, Signal, SignalTarget};
use keel_core::ports::store::InstanceDetail;
use keel_core::retry::{self, FailureKind, RetryDecision};
use keel_core::{Instance, InstanceId, MachineRef, Outcome};
use keel_parallel::{ParallelConfig, REGION_POSITION, REGION_REPORT_EVENT, RegionTaskContext};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// The position of a chart instance that has not entered its initial states yet.
pub const INIT: &str = keel_core::chart::INIT_POSITION;

/// The context an action sees: read and change the instance's JSON context, raise events
/// for this instance, and emit events to other instances (delivered with the step's
/// commit). Cheap to clone; clones share state.
#[derive(Clone)]
pub struct ActionContext {
    context: SharedContext,
    step: StepContext,
}

/// The context methods (`get`, `get_as`, `set`, `set_from`, `remove`, `raise`) are the
/// core's [`SharedContext`]'s.
impl std::ops::Deref for ActionContext {
    type Target = SharedContext;
    fn deref(&self) -> &SharedContext {
        &self.context
    }
}

impl ActionContext {
    fn new(context: ChartContext, step: StepContext) -> Self {
        ActionContext { context: SharedContext::new(context), step }
    }

    /// The instance this action runs for.
    pub fn instance(&self) -> InstanceId {
        self.step.id
    }

    /// The attempt of this step (0 on the first run).
    pub fn attempt(&self) -> i32 {
        self.step.attempt
    }

    /// Emits an event to another instance, inserted in the same commit as this step.
    pub fn emit(&self, signal: NewSignal) {
        self.step.emit(signal);
    }

    /// Sends an event to the child machine this instance's delegation state `state`
    /// started (in an earlier step), in the same commit as this step. Without such a
    /// child the commit is refused like any emit to a missing target, and the step is
    /// retried under its policy.
    pub fn send_to_child(&self, state: &str, event: &str, payload: Value) {
        let target = SignalTarget::Child { parent: self.step.id, state: state.to_owned() };
        self.step.emit(NewSignal::new(target, event).payload(payload));
    }

    fn into_result(self) -> ActionResult {
        self.context.to_result()
    }
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), ActionError>> + Send>>;
type ActionFn = Arc<dyn Fn(ActionContext, Event) -> BoxFuture + Send + Sync>;

/// A statechart definition with its actions, runnable by a [`Worker`](crate::Worker).
/// Cloning is cheap (the definition and actions are shared), so one machine can be
/// registered with several workers in a process.
#[derive(Clone)]
pub struct ChartMachine {
    definition: Arc<Definition>,
    actions: HashMap<String, ActionFn>,
    config: QueueConfig,
    limits: Limits,
    child_versions: HashMap<String, i32>,
    child_queues: HashMap<String, String>,
    parallel: ParallelConfig,
    inbox_order: keel_core::inbox::InboxOrder,
}

impl ChartMachine {
    /// A machine for `definition`. Register every action the definition names with
    /// [`ChartMachine::action`]; [`ChartMachine::missing_actions`] lists any you forgot.
    pub fn new(definition: Definition) -> Self {
        ChartMachine {
            definition: Arc::new(definition),
            actions: HashMap::new(),
            config: QueueConfig::default(),
            limits: Limits::default(),
            child_versions: HashMap::new(),
            child_queues: HashMap::new(),
            parallel: ParallelConfig::default(),
            inbox_order: keel_core::inbox::InboxOrder::Arrival,
        }
    }

    /// The order the chart takes its pending events in: arrival order (the default: two
    /// events of one instance are never reordered) or `InboxOrder::Priority` (the most
    /// urgent event first, arrival order within a priority).
    #[must_use]
    pub fn with_inbox_order(mut self, order: keel_core::inbox::InboxOrder) -> Self {
        self.inbox_order = order;
        self
    }

    /// Registers an async action by name.
    #[must_use]
    pub fn action<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn(ActionContext, Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), ActionError>> + Send + 'static,
    {
        let f: ActionFn = Arc::new(move |ctx, event| Box::pin(f(ctx, event)));
        self.actions.insert(name.to_owned(), f);
        self
    }

    /// Sets the queue configuration (timeout, retry policy, dead letters,
    /// `on_dead_letter`). A worker refuses to start with a machine whose configuration
    /// sets `concurrency`, `strategy`, `priority` or `alerts`, which belong elsewhere
    /// (`QueueConfig::not_applied_in_code` says where).
    #[must_use]
    pub fn with_config(mut self, config: QueueConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets the macrostep limits.
    #[must_use]
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Parallel dispatch settings: with `enabled`, entering a parallel state
    /// whose regions (two or more) have entry actions commits the state and starts one
    /// region task per region (a child instance of this machine at
    /// [`REGION_POSITION`]) instead of running the actions
    /// inline. Register this machine on every worker that should run region tasks; a
    /// worker that registers it serves `parallel.queue` (when set) besides its own queues.
    #[must_use]
    pub fn with_parallel(mut self, parallel: ParallelConfig) -> Self {
        self.parallel = parallel;
        self
    }

    /// Child machines started by delegation states run this version of `machine`
    /// (default 1). A `machine` no delegation state of the chart starts (a misspelt name)
    /// makes the chart unrunnable: [`StepMachine::unbound`] names it, with the delegated
    /// machine it most likely means, and a worker refuses to register the chart.
    #[must_use]
    pub fn with_child_version(mut self, machine: &str, version: i32) -> Self {
        self.child_versions.insert(machine.to_owned(), version);
        self
    }

    /// Child machines started by delegation states run on `queue` instead of this
    /// instance's queue (children inherit their parent's namespace and queue otherwise). A
    /// worker that registers this machine serves `queue` too; it runs there only the
    /// machines it registers. A `machine` no delegation state of the chart starts is
    /// refused as for [`with_child_version`](Self::with_child_version).
    #[must_use]
    pub fn with_child_queue(mut self, machine: &str, queue: &str) -> Self {
        self.child_queues.insert(machine.to_owned(), queue.to_owned());
        self
    }

    /// Action names the definition uses that have no registered implementation.
    pub fn missing_actions(&self) -> Vec<String> {
        let mut missing: Vec<String> = self
            .definition
            .action_names()
            .into_iter()
            .filter(|a| !self.actions.contains_key(a))
            .collect();
        missing.sort();
        missing
    }

    /// The machines the definition's delegation states start, sorted and deduplicated.
    pub fn delegated_machines(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .definition
            .states()
            .filter_map(|s| s.delegation.as_ref().map(|d| d.machine.clone()))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The machines the definition's delegation states start, each with the version its
    /// children run ([`with_child_version`](Self::with_child_version), else 1), sorted by
    /// name. A worker checks these against the machines it serves: a child of a version
    /// nobody serves would never run, and its parent would wait for it forever.
    pub fn delegated_refs(&self) -> Vec<MachineRef> {
        self.delegated_machines()
            .into_iter()
            .map(|name| {
                let version = self.child_version(&name);
                MachineRef::new(name, version)
            })
            .collect()
    }

    /// The version children of `machine` run.
    fn child_version(&self, machine: &str) -> i32 {
        self.child_versions.get(machine).copied().unwrap_or(1)
    }

    /// Names given to [`with_child_version`](Self::with_child_version) or
    /// [`with_child_queue`](Self::with_child_queue) that no delegation state starts, each
    /// as a piece [`StepMachine::unbound`] reports.
    fn undelegated_settings(&self) -> Vec<String> {
        let delegated = self.delegated_machines();
        let mut unknown: Vec<(&str, &str)> = self
            .child_versions
            .keys()
            .map(|m| (m.as_str(), "with_child_version"))
            .chain(self.child_queues.keys().map(|m| (m.as_str(), "with_child_queue")))
            .filter(|(m, _)| !delegated.iter().any(|d| d == m))
            .collect();
        unknown.sort_unstable();
        unknown
            .into_iter()
            .map(|(machine, call)| {
                let near =
                    keel_core::config::closest(machine, delegated.iter().map(String::as_str))
                        .map_or_else(String::new, |near| format!("did you mean `{near}`? "));
                let delegates = if delegated.is_empty() {
                    "it delegates to none".to_owned()
                } else {
                    let names: Vec<String> = delegated.iter().map(|d| format!("`{d}`")).collect();
                    format!("it delegates to {}", names.join(", "))
                };
                format!(
                    "a delegation state starting `{machine}`, which `{call}` names ({delegates}; \
                     {near}fix the name or remove the call)"
                )
            })
            .collect()
    }

    /// A new instance of this machine whose context is `context` serialized. The context
    /// must serialize as a JSON object (a struct or a map).
    pub fn new_instance_of<T: serde::Serialize>(
        &self,
        context: &T,
    ) -> Result<NewInstance, serde_json::Error> {
        Ok(self.new_instance(serde_json::to_value(context)?))
    }

    /// The definition.
    pub fn definition(&self) -> &Definition {
        &self.definition
    }

    /// A new instance of this machine with `context`, ready to enter its initial states.
    pub fn new_instance(&self, context: Value) -> NewInstance {
        NewInstance::new(self.machine_ref(), INIT).context(context)
    }

    fn machine_ref(&self) -> MachineRef {
        MachineRef::new(
            self.definition.name(),
            i32::try_from(self.definition.version()).unwrap_or(i32::MAX),
        )
    }

    async fn call(
        &self,
        request: &ActionRequest,
        actx: ActionContext,
    ) -> Result<ActionResult, ActionError> {
        match self.actions.get(&request.name) {
            Some(f) => f(actx.clone(), request.event.clone()).await.map(|()| actx.into_result()),
            None => Err(ActionError::permanent(format!(
                "action {:?} is not registered on machine {}; register it with ChartMachine::action",
                request.name,
                self.definition.name()
            ))),
        }
    }

    /// Runs the actions the chart step asks for, one at a time, and returns its plan.
    async fn run(&self, mut step: ChartStep<'_>, ctx: &StepContext) -> Result<StepPlan, StepError> {
        while let Some(call) = step.poll() {
            let actx = ActionContext::new(call.context, ctx.clone());
            let result = self.call(&call.request, actx).await;
            step.handle_action_result(result);
        }
        step.finish().map_err(|error| {
            let kind =
                if error.is_retryable() { FailureKind::Action } else { FailureKind::NonRetryable };
            StepError::of_kind(kind, error.to_string())
        })
    }

    /// A region task: pre-check against the parent without a lock, run the
    /// region's entry actions on the snapshot, report the diff and raised events to the
    /// parent in this task's terminal commit.
    async fn region_step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let task: RegionTaskContext = serde_json::from_value(ctx.context.clone())
            .map_err(|e| StepError::fatal(format!("region task context does not decode: {e}")))?;
        if let Some(skip) = ctx.parent.as_ref().and_then(|p| precheck(p, &task)) {
            // Nothing to do and nobody to tell: the parent is not touched at all.
            return Ok(Outcome::Done { result: json!({ "skipped": skip }), step: None });
        }
        let mut run = RegionRun::new(&self.definition, &task.task);
        while let Some(request) = run.poll().cloned() {
            let actx = ActionContext::new(run.context().clone(), ctx.clone());
            let result = self.call(&request, actx).await;
            run.handle_action_result(result).map_err(|e| {
                let message = action_failure(&request, &e);
                if e.retryable { StepError::retryable(message) } else { StepError::fatal(message) }
            })?;
        }
        let report = run.report();
        Self::report(ctx, &task, &report)?;
        Ok(Outcome::Done {
            result: json!({ "region_id": task.task.key.region, "reported": true }),
            step: None,
        })
    }

    /// Emits a region's report to its parent, in the task's own terminal commit.
    fn report(
        ctx: &StepContext,
        task: &RegionTaskContext,
        report: &RegionReport,
    ) -> Result<(), StepError> {
        let payload = serde_json::to_value(report)
            .map_err(|e| StepError::fatal(format!("region report does not serialize: {e}")))?;
        ctx.emit(
            NewSignal::new(task.parent, REGION_REPORT_EVENT)
                .payload(payload)
                .dedup_key(keel_parallel::report_dedup_key(ctx.id)),
        );
        Ok(())
    }

    /// Commits a chart step's plan: history, timers, children, region tasks, and the
    /// outcome.
    fn commit(&self, ctx: &StepContext, plan: StepPlan) -> Result<Outcome, StepError> {
        for entry in &plan.history {
            ctx.record(entry.clone());
        }
        for owner in &plan.timers_cancel {
            ctx.timer_cancel(owner);
        }
        for arm in &plan.timers_arm {
            ctx.timer_arm(arm.clone());
        }
        for state in &plan.children_cancel {
            ctx.cancel_children(state);
        }
        for child in &plan.children {
            let version = self.child_version(&child.machine);
            let spawn = ctx
                .child(MachineRef::new(&child.machine, version), INIT)
                .context(json!({ "parent": ctx.id, "state": child.state }))
                .invoked_by(&child.state);
            let spawn = match self.child_queues.get(&child.machine) {
                Some(queue) => spawn.queue(queue),
                None => spawn,
            };
            ctx.spawn(spawn);
        }
        for task in &plan.region_tasks {
            let context =
                serde_json::to_value(RegionTaskContext { parent: ctx.id, task: task.clone() })
                    .map_err(|e| {
                        StepError::fatal(format!("region task does not serialize: {e}"))
                    })?;
            let mut spawn = ctx.child(self.machine_ref(), REGION_POSITION).context(context);
            if let Some(queue) = &self.parallel.queue {
                spawn = spawn.queue(queue);
            }
            ctx.spawn(spawn);
        }
        // A finished instance keeps its final configuration as its position, so which
        // final state it reached is visible without reading its history.
        let position = plan.position();
        if plan.is_final {
            return Ok(Outcome::Done { result: plan.context, step: position });
        }
        Ok(Outcome::Await {
            signal: ANY_SIGNAL.into(),
            context: plan.stored_context(),
            step: position,
        })
    }
}

#[async_trait]
impl StepMachine for ChartMachine {
    fn machine(&self) -> MachineRef {
        self.machine_ref()
    }

    fn apply_settings(&mut self, settings: &keel_core::config::KeelConfig) {
        let name = self.machine_ref().name;
        self.parallel = settings.parallel_over(self.parallel.clone(), &name);
    }

    fn unbound(&self) -> Vec<String> {
        let actions = self.missing_actions().into_iter().map(|a| format!("action `{a}`"));
        actions.chain(self.undelegated_settings()).collect()
    }

    fn followed_timers(&self) -> Vec<keel_core::chart::TimerArm> {
        self.definition.followed_timers()
    }

    fn delegates(&self) -> Vec<MachineRef> {
        self.delegated_refs()
    }

    fn events(&self) -> Option<Vec<String>> {
        Some(self.definition.event_alphabet())
    }

    /// The definition's warnings and, with parallel dispatch on (in code or by the
    /// settings the worker applied first), one for each parallel state whose region
    /// failures no `@fail` answers: such an instance would stay in the state silently.
    fn warnings(&self) -> Vec<String> {
        let (name, version) = (self.definition.name(), self.definition.version());
        let definition = self.definition.warnings().iter().map(ToString::to_string);
        let unanswered = if self.parallel.enabled {
            unhandled_region_failures(&self.definition)
        } else {
            Vec::new()
        };
        let unanswered = unanswered.into_iter().map(unanswered_failure);
        definition.chain(unanswered).map(|w| format!("chart {name} v{version}: {w}")).collect()
    }

    fn config(&self) -> QueueConfig {
        self.config
    }

    fn inbox_order(&self) -> keel_core::inbox::InboxOrder {
        self.inbox_order
    }

    /// A region task runs with its `[parallel_dispatch]` job settings over the
    /// configuration file's queue levels: `job_timeout`, `job_tries` and `job_backoff` are
    /// the region tasks' own.
    fn step_config_over(&self, step: &str, resolved: QueueConfig) -> QueueConfig {
        self.parallel.over_step(step, resolved)
    }

    /// The start (`@init`) enters the initial states and a region task runs its region's
    /// entry actions: neither processes an event. Any other step processes the first
    /// signal in the chart's inbox order ([`keel_core::inbox::step_event`], as `keel
    /// serve` decides for remote steps).
    fn event_for<'a>(&self, step: &str, inbox: &'a [Signal]) -> Option<&'a Signal> {
        keel_core::inbox::step_event(step, inbox)
    }

    /// The queue region tasks are sent to (when dispatch is on) and the queues delegated
    /// children are sent to.
    fn queues_started(&self) -> Vec<String> {
        let delegated = self.delegated_machines();
        let regions = self.parallel.queue.iter().filter(|_| self.parallel.enabled);
        let children = self
            .child_queues
            .iter()
            .filter(|(machine, _)| delegated.contains(machine))
            .map(|(_, queue)| queue);
        let mut queues: Vec<String> = regions.chain(children).cloned().collect();
        queues.sort();
        queues.dedup();
        queues
    }

    fn wants_parent(&self, step: &str) -> bool {
        step == REGION_POSITION
    }

    async fn handle(
        &self,
        error: &StepError,
        ctx: &StepContext,
    ) -> Result<Option<Outcome>, StepError> {
        if ctx.step != REGION_POSITION {
            return Ok(None);
        }
        // The policy the worker ran the task under (the job settings over the file's), so
        // the timeout and the tries come from one place.
        let attempt = u32::try_from(ctx.attempt).unwrap_or(0);
        let decision = retry::decide(&ctx.retry, attempt, error.kind, fastrand::f64());
        if let RetryDecision::Retry { delay } = decision {
            return Ok(Some(Outcome::Retry { context: ctx.context.clone(), delay }));
        }
        let attempts = attempt + 1;
        // Out of tries: tell the parent (its `@fail`), and fail the task itself.
        let Ok(task) = serde_json::from_value::<RegionTaskContext>(ctx.context.clone()) else {
            return Ok(None);
        };
        let report = RegionReport::Failed {
            key: task.task.key.clone(),
            error: error.message.clone(),
            exception: keel_parallel::exception_of(error.kind).to_owned(),
            attempts,
        };
        Self::report(ctx, &task, &report)?;
        Ok(Some(Outcome::Stop { reason: error.message.clone() }))
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if ctx.step == REGION_POSITION {
            return self.region_step(ctx).await;
        }
        let def = &*self.definition;
        if ctx.step == INIT {
            ctx.consume(Vec::new());
            let step = ChartStep::init(def, ctx.context.clone(), self.limits, &self.parallel);
            let plan = self.run(step, ctx).await?;
            return self.commit(ctx, plan);
        }
        let Some(signal) = ctx.signals.first() else {
            // Woken with an empty inbox (a re-run after its event was consumed): park.
            ctx.consume(Vec::new());
            return Ok(Outcome::Await {
                signal: ANY_SIGNAL.into(),
                context: ctx.context.clone(),
                step: None,
            });
        };
        ctx.processing(signal);
        ctx.consume(vec![signal.id]);
        let paths: Vec<String> = serde_json::from_str(&ctx.step).map_err(|e| {
            StepError::fatal(format!("position {:?} is not a chart configuration: {e}", ctx.step))
        })?;
        let configuration = Configuration::from_paths(paths);
        let event = Event::with_payload(signal.name.clone(), signal.payload.clone());
        let step = ChartStep::event(
            def,
            &configuration,
            ctx.context.clone(),
            event,
            self.limits,
            &self.parallel,
        )
        .map_err(|e| StepError::fatal(format!("region report does not decode: {e}")))?;
        let plan = self.run(step, ctx).await?;
        self.commit(ctx, plan)
    }
}

/// The warning for parallel state `state`, dispatched with no `@fail` on it or an ancestor.
fn unanswered_failure(state: &str) -> String {
    format!(
        "parallel state `{state}` runs its regions as region tasks, but neither it nor an ancestor has `@fail`: a region task that runs out of tries raises `fail.state.{state}`, which nothing handles, so the instance stays in `{state}` with only `PARALLEL_FAIL` in its history to say why; fix: add `@fail` on `{state}` (`.on_fail(|b| b.target(\"…\"))`, JSON `\"@fail\"`)"
    )
}

/// The region task's lock-free pre-check against the parent's row: `Some(reason)` when
/// its work is no longer wanted.
fn precheck(parent: &Instance, task: &RegionTaskContext) -> Option<&'static str> {
    if parent.status.is_terminal() {
        return Some(Skip::MachineLeftParallelState.reason());
    }
    let paths: Vec<String> = serde_json::from_str(&parent.position).ok()?;
    let mut context = parent.context.clone();
    let book = ParallelBook::take(&mut context);
    check(&Configuration::from_paths(paths), &book, &task.task.key).err().map(Skip::reason)
}

/// Whether the latest committed macrostep of an instance dispatched region tasks (the
/// `dispatched` flag): `true` means regions are running on workers and the client
/// may answer "accepted" instead of waiting; `false` for inline entry or no parallel state.
pub fn dispatched(detail: &InstanceDetail) -> bool {
    detail
        .history
        .iter()
        .rev()
        .find(|r| r.entry.kind == MACROSTEP)
        .is_some_and(|r| r.entry.data["dispatched"] == json!(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parallel state with entry work in both regions and no `@fail` anywhere above.
    fn hanging() -> Definition {
        Definition::builder("hangs", 2)
            .initial("p")
            .parallel("p", |p| {
                p.state("a", |r| r.initial("x").state("x", |s| s.entry("ax")))
                    .state("b", |r| r.initial("y").state("y", |s| s.entry("by")))
            })
            .build()
            .expect("valid chart")
    }

    #[test]
    fn with_dispatch_on_a_parallel_state_no_fail_answers_is_warned_of() {
        let inline = ChartMachine::new(hanging());
        assert!(inline.warnings().is_empty(), "inline entry has no region task to fail");
        let dispatched = ChartMachine::new(hanging()).with_parallel(ParallelConfig::enabled());
        let warnings = dispatched.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("chart hangs v2: parallel state `p` runs its regions as region tasks, but neither it nor an ancestor has `@fail`"),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("fix: add `@fail` on `p` (`.on_fail("), "{warnings:?}");
    }
}
