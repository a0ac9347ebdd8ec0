//! Charts in the simulator: [`SimChart`] turns a chart definition and its (synchronous)
//! actions into a step function, doing with one claimed step what the durable chart
//! runtime does — the initial entry at `@init`, then one inbox event per step through
//! [`ChartStep`], its history, timer cancels and arms, and delegated child machines in the
//! same commit, parking on any signal until the chart reaches a final state.
//!
//! Parallel dispatch (region tasks) is not simulated: regions run inline, as they do with
//! dispatch off. An action error ends the instance as failed, because the simulator has no
//! retry policy to hand it to.

use keel_core::chart::step::{ChartStep, StepPlan};
use keel_core::chart::{ActionError, Configuration, Definition, Event, Limits, SharedContext};
use keel_core::config::ParallelConfig;
use keel_core::instance::ANY_SIGNAL;
use keel_core::{Instance, MachineRef, NewInstance, Outcome, Signal, StepCommit};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

/// The position of a chart instance that has not entered its initial states yet.
pub const CHART_INIT: &str = "@init";

type SyncAction = dyn Fn(&SharedContext, &Event) -> Result<(), ActionError>;

/// A chart definition and its actions, ready for [`super::Simulation::chart`].
pub struct SimChart {
    definition: Arc<Definition>,
    actions: HashMap<String, Box<SyncAction>>,
    limits: Limits,
    parallel: ParallelConfig,
    child_versions: HashMap<String, i32>,
}

impl SimChart {
    /// A chart without actions yet (parallel dispatch off).
    pub fn new(definition: impl Into<Arc<Definition>>) -> Self {
        SimChart {
            definition: definition.into(),
            actions: HashMap::new(),
            limits: Limits::default(),
            parallel: ParallelConfig::default(),
            child_versions: HashMap::new(),
        }
    }

    /// Registers an action; an `Err` ends the instance as failed.
    pub fn action(
        mut self,
        name: impl Into<String>,
        action: impl Fn(&SharedContext, &Event) -> Result<(), ActionError> + 'static,
    ) -> Self {
        self.actions.insert(name.into(), Box::new(action));
        self
    }

    /// Child machines started by delegation states run this version of `machine`
    /// (default 1), as with the durable runtime's `ChartMachine::with_child_version`.
    #[must_use]
    pub fn with_child_version(mut self, machine: &str, version: i32) -> Self {
        self.child_versions.insert(machine.to_owned(), version);
        self
    }

    /// The machine this chart runs as (definition name and version).
    pub fn machine(&self) -> MachineRef {
        MachineRef::new(
            self.definition.name(),
            i32::try_from(self.definition.version()).unwrap_or(i32::MAX),
        )
    }

    /// A new instance of the chart with this context, before its initial entry.
    pub fn new_instance(&self, context: Value) -> NewInstance {
        NewInstance::new(self.machine(), CHART_INIT).context(context)
    }

    fn drive(&self, mut step: ChartStep<'_>) -> Result<StepPlan, String> {
        while let Some(call) = step.poll() {
            let ctx = SharedContext::new(call.context);
            let result = match self.actions.get(&call.request.name) {
                Some(action) => action(&ctx, &call.request.event).map(|()| ctx.to_result()),
                None => Err(ActionError::permanent(format!(
                    "action {:?} is not registered; register it with SimChart::action",
                    call.request.name
                ))),
            };
            step.handle_action_result(result);
        }
        step.finish().map_err(|e| e.to_string())
    }

    /// One claimed step of a chart instance.
    pub fn step(&self, row: &Instance, inbox: &[Signal]) -> StepCommit {
        let def = &*self.definition;
        let stop =
            |reason: String| StepCommit::new(row.id, row.fencing_token, Outcome::Stop { reason });
        let (plan, consumed) = if row.position == CHART_INIT {
            let step = ChartStep::init(def, row.context.clone(), self.limits, &self.parallel);
            (self.drive(step), None)
        } else {
            let Some(signal) = inbox.first() else {
                let park = Outcome::Await {
                    signal: ANY_SIGNAL.into(),
                    context: row.context.clone(),
                    step: None,
                };
                return StepCommit::new(row.id, row.fencing_token, park);
            };
            let paths: Vec<String> = match serde_json::from_str(&row.position) {
                Ok(paths) => paths,
                Err(e) => {
                    return stop(format!(
                        "position {:?} is not a chart configuration: {e}",
                        row.position
                    ));
                }
            };
            let event = Event::with_payload(signal.name.clone(), signal.payload.clone());
            let step = ChartStep::event(
                def,
                &Configuration::from_paths(paths),
                row.context.clone(),
                event,
                self.limits,
                &self.parallel,
            );
            match step {
                Ok(step) => (self.drive(step), Some(signal.id)),
                Err(e) => return stop(format!("event `{}` does not decode: {e}", signal.name)),
            }
        };
        let plan = match plan {
            Ok(plan) => plan,
            Err(reason) => return stop(reason),
        };
        let position = plan.position();
        let outcome = if plan.is_final {
            Outcome::Done { result: plan.context.clone(), step: position }
        } else {
            Outcome::Await {
                signal: ANY_SIGNAL.into(),
                context: plan.stored_context(),
                step: position,
            }
        };
        let mut commit = StepCommit::new(row.id, row.fencing_token, outcome).consume(consumed);
        commit.history = plan.history;
        commit.timers_cancel = plan.timers_cancel;
        commit.timers_arm = plan.timers_arm;
        commit.children_cancel = plan.children_cancel;
        commit.spawn = plan
            .children
            .iter()
            .map(|child| {
                let version = self.child_versions.get(&child.machine).copied().unwrap_or(1);
                NewInstance::new(MachineRef::new(&child.machine, version), CHART_INIT)
                    .context(json!({ "parent": row.id, "state": child.state }))
                    .invoked_by(&child.state)
            })
            .collect();
        commit
    }
}
