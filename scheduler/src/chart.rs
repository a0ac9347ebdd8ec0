//! Charts on the engine: a [`ChartMachine`] runs a statechart definition durably. Each
//! step takes the oldest event in the instance's inbox and processes it as one macrostep
//! (the core's sans-IO algorithm), running the actions it asks for — async, with IO —
//! and commits the new configuration, context, the consumed event, history, emitted
//! events and started child machines in one commit. Then it parks until the next event.
//!
//! A new chart instance starts at the position [`INIT`]; its first step enters the
//! initial states (running their entry actions). The configuration is stored as the
//! instance's position: the JSON array of active state paths.

use crate::machine::{StepContext, StepError, StepMachine};
use async_trait::async_trait;
use keel_core::chart::{
    ActionError, ActionResult, ChartContext, Configuration, Definition, Event, Limits, Macrostep,
    MacrostepResult, Next,
};
use keel_core::config::QueueConfig;
use keel_core::instance::{ANY_SIGNAL, HistoryEntry, NewInstance, NewSignal};
use keel_core::{InstanceId, MachineRef, Outcome};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The position of a chart instance that has not entered its initial states yet.
pub const INIT: &str = "@init";

/// The context an action sees: read and change the instance's JSON context, raise events
/// for this instance, and emit events to other instances (delivered with the step's
/// commit). Cheap to clone; clones share state.
#[derive(Clone)]
pub struct ActionContext {
    context: Arc<Mutex<ChartContext>>,
    step: StepContext,
}

impl ActionContext {
    fn new(context: ChartContext, step: StepContext) -> Self {
        ActionContext { context: Arc::new(Mutex::new(context)), step }
    }

    fn lock(&self) -> MutexGuard<'_, ChartContext> {
        self.context.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The instance this action runs for.
    pub fn instance(&self) -> InstanceId {
        self.step.id
    }

    /// The attempt of this step (0 on the first run).
    pub fn attempt(&self) -> i32 {
        self.step.attempt
    }

    /// A context value.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.lock().get(key).cloned()
    }

    /// A context value, deserialized.
    pub fn get_as<T: DeserializeOwned>(&self, key: &str) -> Option<T> {
        self.lock().get_as(key)
    }

    /// Sets a context value.
    pub fn set(&self, key: impl Into<String>, value: impl Into<Value>) {
        self.lock().set(key, value);
    }

    /// Sets a context value from any serializable value.
    pub fn set_from<T: Serialize>(
        &self,
        key: impl Into<String>,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        self.lock().set_from(key, value)
    }

    /// Removes a context value.
    pub fn remove(&self, key: &str) -> Option<Value> {
        self.lock().remove(key)
    }

    /// Raises an event for this instance, processed within the same macrostep.
    pub fn raise(&self, event: impl Into<Event>) {
        self.lock().raise(event);
    }

    /// Emits an event to another instance, inserted in the same commit as this step.
    pub fn emit(&self, signal: NewSignal) {
        self.step.emit(signal);
    }

    fn into_result(self) -> ActionResult {
        self.lock().clone().into_result()
    }
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), ActionError>> + Send>>;
type ActionFn = Arc<dyn Fn(ActionContext, Event) -> BoxFuture + Send + Sync>;

/// A statechart definition with its actions, runnable by a [`Worker`](crate::Worker).
pub struct ChartMachine {
    definition: Arc<Definition>,
    actions: HashMap<String, ActionFn>,
    config: QueueConfig,
    limits: Limits,
    child_versions: HashMap<String, i32>,
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
        }
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

    /// Sets the queue configuration (timeout, retry policy, `on_dead_letter`).
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

    /// Child machines started by delegation states run this version of `machine`
    /// (default 1).
    #[must_use]
    pub fn with_child_version(mut self, machine: &str, version: i32) -> Self {
        self.child_versions.insert(machine.to_owned(), version);
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

    async fn run(&self, mut step: Macrostep<'_>, ctx: &StepContext) -> MacrostepResult {
        loop {
            match step.poll() {
                Next::RunAction(request) => {
                    let actx = ActionContext::new(step.context().clone(), ctx.clone());
                    let result = match self.actions.get(&request.name) {
                        Some(f) => f(actx.clone(), request.event.clone())
                            .await
                            .map(|()| actx.into_result()),
                        None => Err(ActionError::permanent(format!(
                            "action {:?} is not registered on machine {}; register it with ChartMachine::action",
                            request.name,
                            self.definition.name()
                        ))),
                    };
                    step.handle_action_result(result);
                }
                Next::Done(result) => return *result,
            }
        }
    }

    fn commit_effects(&self, ctx: &StepContext, event: Option<&Event>, result: &MacrostepResult) {
        let records: Vec<String> = result.records.iter().map(ToString::to_string).collect();
        ctx.record(HistoryEntry::new(
            "MACROSTEP",
            json!({ "event": event.map(|e| &e.name), "records": records, "configuration": result.configuration }),
        ));
        if result.unhandled
            && let Some(e) = event
        {
            ctx.record(HistoryEntry::new(
                "EVENT_UNHANDLED",
                json!({ "event": e.name, "payload": e.payload }),
            ));
        }
        for child in &result.children_to_start {
            let version = self.child_versions.get(&child.machine).copied().unwrap_or(1);
            let spawn = NewInstance::new(MachineRef::new(&child.machine, version), INIT)
                .context(json!({ "parent": ctx.id, "state": child.state }))
                .invoked_by(&child.state)
                .correlation_id(format!("{}", ctx.id.0));
            ctx.spawn(spawn);
        }
    }
}

#[async_trait]
impl StepMachine for ChartMachine {
    fn machine(&self) -> MachineRef {
        self.machine_ref()
    }

    fn config(&self) -> QueueConfig {
        self.config
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let def = &*self.definition;
        let (step, event) = if ctx.step == INIT {
            ctx.consume(Vec::new());
            (Macrostep::init(def, ctx.context.clone(), self.limits), None)
        } else {
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
                StepError::fatal(format!(
                    "position {:?} is not a chart configuration: {e}",
                    ctx.step
                ))
            })?;
            let configuration = Configuration::from_paths(paths);
            let event = Event::with_payload(signal.name.clone(), signal.payload.clone());
            (
                Macrostep::start(
                    def,
                    &configuration,
                    ctx.context.clone(),
                    event.clone(),
                    self.limits,
                ),
                Some(event),
            )
        };
        let result = self.run(step, ctx).await;
        if let Some(error) = &result.error {
            return Err(if error.is_retryable() {
                StepError::retryable(error.to_string())
            } else {
                StepError::fatal(error.to_string())
            });
        }
        self.commit_effects(ctx, event.as_ref(), &result);
        if result.is_final {
            return Ok(Outcome::Done { result: result.context });
        }
        let position = serde_json::to_string(&result.configuration)
            .map_err(|e| StepError::fatal(format!("configuration does not serialize: {e}")))?;
        Ok(Outcome::Await {
            signal: ANY_SIGNAL.into(),
            context: result.context,
            step: Some(position),
        })
    }
}
