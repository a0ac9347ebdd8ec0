//! One chart step, sans IO: what a chart instance does with one event (or with its initial
//! entry), from the stored configuration and context to a [`StepPlan`] a runtime commits.
//!
//! Every runtime that runs charts — the durable worker and the in-memory `TestMachine` —
//! drives this one type, so they record the same history for the same events. The shape is
//! the macrostep's: [`ChartStep::poll`] hands out the actions to run, one at a time, the
//! runtime runs each (async, with IO) and hands the result back with
//! [`ChartStep::handle_action_result`]; when `poll` returns `None`, [`ChartStep::finish`]
//! gives the plan: the new position and context, the history entries in commit order, the
//! timers to cancel and arm, the child machines and region tasks to start.
//!
//! Three kinds of event reach a chart:
//!
//! - a region's report ([`REGION_REPORT_EVENT`], the payload a [`RegionReport`]): guarded,
//!   merged and its raised events (or `@fail`) run as a macrostep;
//! - a region timeout (`parallel.timeout.<path>`, see [`timeout_event`]): the parallel
//!   state's stalled regions fail with `PARALLEL_REGION_TIMEOUT`;
//! - any other event: one macrostep.
//!
//! ```
//! use keel_core::chart::step::ChartStep;
//! use keel_core::chart::{Definition, Limits};
//! use keel_core::config::ParallelConfig;
//! let def = Definition::builder("t", 1)
//!     .initial("a")
//!     .state("a", |s| s.on_to("GO", "b"))
//!     .final_state("b")
//!     .build()
//!     .unwrap();
//! let parallel = ParallelConfig::default();
//! let mut step = ChartStep::init(&def, serde_json::json!({}), Limits::default(), &parallel);
//! assert!(step.poll().is_none(), "no actions to run");
//! let plan = step.finish().unwrap();
//! assert_eq!(plan.position(), Some(r#"["a"]"#.to_owned()));
//! assert_eq!(plan.history[0].kind, "MACROSTEP");
//! ```

use serde_json::{Value, json};

use super::algorithm::{
    ActionError, ActionRequest, ChildStart, Limits, Macrostep, MacrostepError, MacrostepResult,
    Next,
};
use super::configuration::Configuration;
use super::context::{ActionResult, ChartContext};
use super::definition::{Definition, Event};
use super::parallel::{
    Followup, PARALLEL_DISPATCH, ParallelBook, RegionReport, RegionTask, ReportPlan, apply_report,
    done_records, finish_report, timeout,
};
use super::timer::{TimerArm, TimerKind};
use crate::config::ParallelConfig;
use crate::instance::HistoryEntry;

/// History kind: one macrostep committed (the event, its records, the configuration after
/// it, and whether it dispatched region tasks).
pub const MACROSTEP: &str = "MACROSTEP";
/// History kind: an event sent to the instance matched no transition.
pub const EVENT_UNHANDLED: &str = "EVENT_UNHANDLED";
/// The event a region task sends its parent; the payload is a [`RegionReport`].
pub const REGION_REPORT_EVENT: &str = "parallel.region";
/// The prefix of region-timeout events: `parallel.timeout.<parallel state path>`.
pub const TIMEOUT_EVENT_PREFIX: &str = "parallel.timeout.";

/// The region-timeout timer of `parallel_state`, if `config.region_timeout` is on.
pub fn timeout_timer(config: &ParallelConfig, parallel_state: &str) -> Option<TimerArm> {
    (!config.region_timeout.is_zero()).then(|| TimerArm {
        state: timeout_owner(parallel_state),
        event: timeout_event(parallel_state),
        kind: TimerKind::After,
        interval: config.region_timeout,
        max: None,
        then: None,
    })
}

/// The timer owner of `parallel_state`'s region timeout: a name no state has, so that
/// cancelling it never touches the timers of the parallel state's own descendants.
pub fn timeout_owner(parallel_state: &str) -> String {
    format!("@timeout:{parallel_state}")
}

/// The region-timeout event of `parallel_state`.
pub fn timeout_event(parallel_state: &str) -> String {
    format!("{TIMEOUT_EVENT_PREFIX}{parallel_state}")
}

/// The parallel state a region-timeout event is about, if `event` is one.
pub fn timeout_state(event: &str) -> Option<&str> {
    event.strip_prefix(TIMEOUT_EVENT_PREFIX)
}

/// An action the runtime must run now: the request, and the context it runs on.
#[derive(Debug, Clone)]
pub struct ActionCall {
    /// Which action, for which state and event.
    pub request: ActionRequest,
    /// The context as every earlier action of the step left it.
    pub context: ChartContext,
}

/// What one chart step commits. Apply the timer cancels before the arms (a re-entered
/// parallel state's region timeout is cancelled and armed again in the same step).
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// The configuration after the step; `None` when the instance stays where it is (a
    /// region report or timeout that changed nothing but was consumed).
    pub configuration: Option<Configuration>,
    /// The context after the step, without the parallel book.
    pub context: Value,
    /// The parallel bookkeeping after the step.
    pub book: ParallelBook,
    /// Whether a top-level final state is active: the instance is finished.
    pub is_final: bool,
    /// The history entries, in the order they are committed.
    pub history: Vec<HistoryEntry>,
    /// Timer owners (state paths) whose timers, and their descendants', are cancelled.
    pub timers_cancel: Vec<String>,
    /// Timers armed by the step.
    pub timers_arm: Vec<TimerArm>,
    /// Child machines started by delegation states.
    pub children: Vec<ChildStart>,
    /// Delegation states left: their live child machines are cancelled in the commit.
    pub children_cancel: Vec<String>,
    /// Region tasks to start (parallel dispatch).
    pub region_tasks: Vec<RegionTask>,
    /// The macrostep that ran, if one did.
    pub macrostep: Option<MacrostepResult>,
}

impl StepPlan {
    /// The context as stored on the instance: the context with the book under its
    /// reserved key.
    pub fn stored_context(&self) -> Value {
        let mut context = self.context.clone();
        self.book.put(&mut context);
        context
    }

    /// The new position (the configuration as the instance stores it), `None` when the
    /// instance stays where it is.
    pub fn position(&self) -> Option<String> {
        self.configuration.as_ref().map(Configuration::position)
    }

    fn park(context: Value, book: ParallelBook, history: Vec<HistoryEntry>) -> Self {
        Self {
            configuration: None,
            context,
            book,
            is_final: false,
            history,
            timers_cancel: Vec::new(),
            timers_arm: Vec::new(),
            children: Vec::new(),
            children_cancel: Vec::new(),
            region_tasks: Vec::new(),
            macrostep: None,
        }
    }
}

/// The parallel settings a step needs.
#[derive(Debug, Clone)]
struct Dispatch {
    enabled: bool,
    config: ParallelConfig,
}

/// Entries recorded around the macrostep of a step.
#[derive(Debug, Default)]
struct Around {
    before: Vec<HistoryEntry>,
    /// The applied report's follow-up (`PARALLEL_REGION_ENTER`, stalls).
    followup: Option<Followup>,
    /// The event was generated by the runtime (a region's report or timeout), so it is
    /// never "unhandled".
    internal: bool,
}

#[derive(Debug)]
enum Stage<'d> {
    Running { step: Box<Macrostep<'d>>, around: Around },
    Finished(Box<Result<StepPlan, MacrostepError>>),
}

/// One chart step in progress. See the module docs.
#[derive(Debug)]
pub struct ChartStep<'d> {
    event: Option<Event>,
    book: ParallelBook,
    dispatch: Dispatch,
    stage: Stage<'d>,
}

impl<'d> ChartStep<'d> {
    /// The initial entry of a new instance, from its stored `context`.
    pub fn init(
        def: &'d Definition,
        mut context: Value,
        limits: Limits,
        parallel: &ParallelConfig,
    ) -> Self {
        let book = ParallelBook::take(&mut context);
        let step = Macrostep::init(def, context, limits).dispatch_regions(parallel.enabled);
        Self::running(None, book, parallel, step, Around::default())
    }

    /// The step for `event` at `configuration`, from the stored `context`. Fails when the
    /// event is a region report whose payload does not decode.
    pub fn event(
        def: &'d Definition,
        configuration: &Configuration,
        mut context: Value,
        event: Event,
        limits: Limits,
        parallel: &ParallelConfig,
    ) -> Result<Self, serde_json::Error> {
        let mut book = ParallelBook::take(&mut context);
        if event.name == REGION_REPORT_EVENT {
            let report: RegionReport = serde_json::from_value(event.payload.clone())?;
            let plan = apply_report(def, configuration, &context, &mut book, &report, limits);
            return Ok(match plan {
                ReportPlan::Noop => Self::parked(event, book, parallel, context, Vec::new()),
                ReportPlan::Abort(entry) => {
                    Self::parked(event, book, parallel, context, vec![entry])
                }
                ReportPlan::Run { records, step, followup } => {
                    let around =
                        Around { before: records, followup: Some(followup), internal: true };
                    let step = step.dispatch_regions(parallel.enabled);
                    Self::running(Some(event), book, parallel, step, around)
                }
            });
        }
        if let Some(state) = timeout_state(&event.name) {
            let seconds = parallel.region_timeout.as_secs();
            let due = timeout(def, configuration, &context, &mut book, state, seconds, limits);
            return Ok(match due {
                None => Self::parked(event, book, parallel, context, Vec::new()),
                Some((entry, step)) => {
                    let around = Around { before: vec![entry], followup: None, internal: true };
                    let step = step.dispatch_regions(parallel.enabled);
                    Self::running(Some(event), book, parallel, step, around)
                }
            });
        }
        let step = Macrostep::start(def, configuration, context, event.clone(), limits)
            .dispatch_regions(parallel.enabled);
        Ok(Self::running(Some(event), book, parallel, step, Around::default()))
    }

    fn running(
        event: Option<Event>,
        book: ParallelBook,
        parallel: &ParallelConfig,
        step: Macrostep<'d>,
        around: Around,
    ) -> Self {
        Self {
            event,
            book,
            dispatch: Dispatch { enabled: parallel.enabled, config: parallel.clone() },
            stage: Stage::Running { step: Box::new(step), around },
        }
    }

    fn parked(
        event: Event,
        book: ParallelBook,
        parallel: &ParallelConfig,
        context: Value,
        history: Vec<HistoryEntry>,
    ) -> Self {
        let plan = StepPlan::park(context, book.clone(), history);
        Self {
            event: Some(event),
            book,
            dispatch: Dispatch { enabled: parallel.enabled, config: parallel.clone() },
            stage: Stage::Finished(Box::new(Ok(plan))),
        }
    }

    /// The next action to run, or `None` when the step is done (then call
    /// [`finish`](Self::finish)).
    pub fn poll(&mut self) -> Option<ActionCall> {
        let Stage::Running { step, around } = &mut self.stage else {
            return None;
        };
        match step.poll() {
            Next::RunAction(request) => {
                Some(ActionCall { request, context: step.context().clone() })
            }
            Next::Done(result) => {
                let around = std::mem::take(around);
                let plan = self.settle(*result, around);
                self.stage = Stage::Finished(Box::new(plan));
                None
            }
        }
    }

    /// Hands back the result of the action [`poll`](Self::poll) asked for.
    pub fn handle_action_result(&mut self, result: Result<ActionResult, ActionError>) {
        if let Stage::Running { step, .. } = &mut self.stage {
            step.handle_action_result(result);
        }
    }

    /// The step's plan, or the error that failed its macrostep (commit nothing then).
    /// Called before [`poll`](Self::poll) returned `None`, the step has not run every
    /// action, so it fails (non-retryable) rather than commit half a macrostep.
    pub fn finish(self) -> Result<StepPlan, MacrostepError> {
        match self.stage {
            Stage::Finished(plan) => *plan,
            Stage::Running { .. } => Err(MacrostepError::Action {
                action: String::new(),
                state: String::new(),
                message: "the chart step was finished before poll() returned None; run every action it asks for first".to_owned(),
                retryable: false,
            }),
        }
    }

    /// Turns a finished macrostep into the plan: history in commit order, timers, children
    /// and region tasks.
    fn settle(
        &mut self,
        result: MacrostepResult,
        around: Around,
    ) -> Result<StepPlan, MacrostepError> {
        if let Some(error) = &result.error {
            return Err(error.clone());
        }
        let mut book = std::mem::take(&mut self.book);
        let mut history = around.before;
        let mut after =
            around.followup.map(|f| finish_report(&f, &result.configuration)).unwrap_or_default();
        after.extend(done_records(&book, &result.internal_events));
        let mut timers_cancel = Vec::new();
        // A parallel state exited in the step loses its visit's dispatch and region timeout,
        // even when the step entered it again.
        for gone in book.prune(&result.configuration, &result.exited()) {
            if !self.dispatch.config.region_timeout.is_zero() {
                timers_cancel.push(timeout_owner(&gone));
            }
        }
        let dispatched =
            self.dispatch.enabled && !result.is_final && !result.regions_to_dispatch.is_empty();
        let records: Vec<String> = result.records.iter().map(ToString::to_string).collect();
        history.push(HistoryEntry::new(
            MACROSTEP,
            json!({
                "event": self.event.as_ref().map(|e| &e.name),
                "records": records,
                "configuration": result.configuration,
                "dispatched": dispatched,
            }),
        ));
        if result.unhandled
            && !around.internal
            && let Some(e) = &self.event
        {
            history.push(HistoryEntry::new(
                EVENT_UNHANDLED,
                json!({ "event": e.name, "payload": e.payload }),
            ));
        }
        timers_cancel.extend(result.timers_to_cancel.iter().map(|c| c.state.clone()));
        let mut timers_arm = result.timers_to_arm.clone();
        let mut region_tasks = Vec::new();
        if dispatched {
            region_tasks = book.dispatch(&result.regions_to_dispatch, &result.context);
            for (state, dispatch, regions) in by_parallel_state(&region_tasks) {
                history.push(HistoryEntry::new(
                    PARALLEL_DISPATCH,
                    json!({ "parallel_state_id": state, "dispatch": dispatch, "regions": regions }),
                ));
                if let Some(timer) = timeout_timer(&self.dispatch.config, &state) {
                    // A re-entered state's previous timer goes (cancels apply before arms).
                    if !timers_cancel.contains(&timer.state) {
                        timers_cancel.push(timer.state.clone());
                    }
                    timers_arm.push(timer);
                }
            }
        }
        history.extend(after);
        Ok(StepPlan {
            configuration: Some(result.configuration.clone()),
            context: result.context.clone(),
            book,
            is_final: result.is_final,
            history,
            timers_cancel,
            timers_arm,
            children: result.children_to_start.clone(),
            children_cancel: result.children_to_cancel.clone(),
            region_tasks,
            macrostep: Some(result),
        })
    }
}

/// One `PARALLEL_DISPATCH` entry and one region timeout per parallel state entered: the
/// tasks grouped by parallel state, in dispatch order.
fn by_parallel_state(tasks: &[RegionTask]) -> Vec<(String, u64, Vec<String>)> {
    let mut by_state: Vec<(String, u64, Vec<String>)> = Vec::new();
    for task in tasks {
        let key = &task.key;
        match by_state.iter_mut().find(|(state, ..)| *state == key.parallel_state) {
            Some((.., regions)) => regions.push(key.region.clone()),
            None => {
                by_state.push((key.parallel_state.clone(), key.dispatch, vec![key.region.clone()]));
            }
        }
    }
    by_state
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::ActionPhase;
    use std::time::Duration;

    /// Two regions with entry actions under `p`, left by `LEAVE`.
    fn def() -> Definition {
        Definition::builder("t", 1)
            .initial("p")
            .parallel("p", |p| {
                p.state("r1", |r| r.initial("a").state("a", |s| s.entry("one")))
                    .state("r2", |r| r.initial("b").state("b", |s| s.entry("two")))
                    .on_to("LEAVE", "out")
            })
            .leaf("out")
            .build()
            .unwrap()
    }

    fn timed() -> ParallelConfig {
        ParallelConfig { region_timeout: Duration::from_secs(60), ..ParallelConfig::enabled() }
    }

    /// Runs a step to its plan, answering every action with an unchanged context.
    fn run(mut step: ChartStep<'_>) -> (Vec<String>, Result<StepPlan, MacrostepError>) {
        let mut ran = Vec::new();
        while let Some(call) = step.poll() {
            ran.push(call.request.name.clone());
            step.handle_action_result(Ok(call.context.into_result()));
        }
        (ran, step.finish())
    }

    fn kinds(plan: &StepPlan) -> Vec<&str> {
        plan.history.iter().map(|e| e.kind.as_str()).collect()
    }

    #[test]
    fn entering_a_parallel_state_in_dispatch_mode_plans_region_tasks_and_one_timeout() {
        let def = def();
        let (ran, plan) = run(ChartStep::init(&def, json!({}), Limits::default(), &timed()));
        let plan = plan.unwrap();
        assert!(ran.is_empty(), "region entry actions are left to region tasks: {ran:?}");
        assert_eq!(kinds(&plan), [MACROSTEP, PARALLEL_DISPATCH]);
        assert_eq!(plan.history[0].data["dispatched"], json!(true));
        assert_eq!(
            plan.history[1].data,
            json!({ "parallel_state_id": "p", "dispatch": 1, "regions": ["p.r1", "p.r2"] })
        );
        let regions: Vec<&str> = plan.region_tasks.iter().map(|t| t.key.region.as_str()).collect();
        assert_eq!(regions, ["p.r1", "p.r2"]);
        assert_eq!(plan.timers_cancel, ["@timeout:p"], "a re-entered state's timer goes first");
        assert_eq!(plan.timers_arm, [timeout_timer(&timed(), "p").unwrap()]);
        assert!(plan.stored_context()[super::super::parallel::BOOK_KEY].is_object());
        assert_eq!(plan.position().as_deref(), Some(r#"["p","p.r1","p.r1.a","p.r2","p.r2.b"]"#));
    }

    #[test]
    fn without_dispatch_the_entry_actions_run_in_the_step() {
        let def = def();
        let parallel = ParallelConfig::default();
        let (ran, plan) = run(ChartStep::init(&def, json!({}), Limits::default(), &parallel));
        let plan = plan.unwrap();
        assert_eq!(ran, ["one", "two"]);
        assert_eq!(kinds(&plan), [MACROSTEP]);
        assert_eq!(plan.history[0].data["dispatched"], json!(false));
        assert!(plan.region_tasks.is_empty() && plan.timers_arm.is_empty());
    }

    #[test]
    fn leaving_a_dispatched_state_cancels_its_region_timeout() {
        let def = def();
        let (_, entered) = run(ChartStep::init(&def, json!({}), Limits::default(), &timed()));
        let entered = entered.unwrap();
        let configuration = entered.configuration.clone().unwrap();
        let step = ChartStep::event(
            &def,
            &configuration,
            entered.stored_context(),
            Event::new("LEAVE"),
            Limits::default(),
            &timed(),
        )
        .unwrap();
        let plan = run(step).1.unwrap();
        assert!(plan.timers_cancel.contains(&"@timeout:p".to_owned()), "{:?}", plan.timers_cancel);
        assert_eq!(plan.position().as_deref(), Some(r#"["out"]"#));
        assert!(plan.book.active.is_empty(), "the dispatch is forgotten: {:?}", plan.book);
        assert_eq!(plan.book.last_dispatch, 1, "dispatch numbers are never reused");
    }

    /// A parallel state exited and entered again by one step, which dispatches nothing the
    /// second time, forgets its first visit: that visit's region reports are stale and its
    /// region timeout is cancelled.
    #[test]
    fn a_parallel_state_reentered_without_dispatch_forgets_the_old_dispatch() {
        let def = Definition::builder("t", 1)
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p"))
            .parallel("p", |p| {
                p.state("a", |r| {
                    r.initial("x")
                        .state("x", |s| s.entry("ax"))
                        .state("retry", |s| s.always(|b| b.target("x")))
                })
                .state("b", |r| r.initial("x").state("x", |s| s.entry("bx")))
                .on_to("RESET", "p.a.retry")
            })
            .build()
            .unwrap();
        let at = |plan: &StepPlan, event: &str| {
            let configuration = plan.configuration.clone().unwrap();
            let context = plan.stored_context();
            ChartStep::event(
                &def,
                &configuration,
                context,
                Event::new(event),
                Limits::default(),
                &timed(),
            )
            .unwrap()
        };
        let (_, idle) = run(ChartStep::init(&def, json!({}), Limits::default(), &timed()));
        let idle = idle.unwrap();
        let (ran, entered) = run(at(&idle, "GO"));
        let entered = entered.unwrap();
        assert!(ran.is_empty(), "{ran:?}");
        assert_eq!(entered.region_tasks.len(), 2);
        let (ran, reset) = run(at(&entered, "RESET"));
        let reset = reset.unwrap();
        assert_eq!(ran, ["bx", "ax"], "nothing dispatched the second time");
        assert!(reset.region_tasks.is_empty());
        assert!(reset.book.active.is_empty(), "the first visit is forgotten: {:?}", reset.book);
        assert_eq!(reset.timers_cancel, ["@timeout:p"]);
        assert!(reset.timers_arm.is_empty());
        let configuration = reset.configuration.clone().unwrap();
        for task in &entered.region_tasks {
            assert_eq!(
                super::super::parallel::check(&configuration, &reset.book, &task.key),
                Err(super::super::parallel::Skip::MachineLeftParallelState)
            );
        }
    }

    #[test]
    fn runtime_events_with_nothing_to_do_park_and_bad_reports_are_refused() {
        let def = def();
        let configuration = Configuration::from_paths(["out"]);
        let at = |event: Event| {
            ChartStep::event(&def, &configuration, json!({}), event, Limits::default(), &timed())
        };
        // A region timeout for a state with no active dispatch: consumed, nothing else.
        let plan = run(at(Event::new(timeout_event("p"))).unwrap()).1.unwrap();
        assert_eq!(plan.configuration, None);
        assert!(plan.history.is_empty() && plan.macrostep.is_none());
        // A report payload that is not a report is an error, not a guess.
        assert!(at(Event::with_payload(REGION_REPORT_EVENT, json!({ "nope": 1 }))).is_err());
        // An event the chart does not handle is recorded as such.
        let plan = run(at(Event::with_payload("BOGUS", json!({ "x": 1 }))).unwrap()).1.unwrap();
        assert_eq!(kinds(&plan), [MACROSTEP, EVENT_UNHANDLED]);
        assert_eq!(plan.history[1].data, json!({ "event": "BOGUS", "payload": { "x": 1 } }));
    }

    #[test]
    fn finishing_before_every_action_ran_fails_instead_of_committing_half_a_step() {
        let def = def();
        let parallel = ParallelConfig::default();
        let mut step = ChartStep::init(&def, json!({}), Limits::default(), &parallel);
        let call = step.poll().expect("an entry action");
        assert_eq!(call.request.phase, ActionPhase::Entry);
        let error = step.finish().unwrap_err();
        assert!(!error.is_retryable());
        assert!(error.to_string().contains("run every action"), "{error}");
        // A failed action fails the step: the runtime commits nothing.
        let mut step = ChartStep::init(&def, json!({}), Limits::default(), &parallel);
        step.poll().expect("an entry action");
        step.handle_action_result(Err(ActionError::new("down")));
        let (_, result) = run(step);
        assert!(result.unwrap_err().is_retryable());
    }
}
