//! `TestMachine`: run a chart in memory with inline actions, and assert on it.
//!
//! No store, no queue, no clock: each `send` drives one [`Macrostep`](keel_core::chart::Macrostep) to completion, running
//! the registered actions (async closures are awaited on a private current-thread tokio
//! runtime, so call it from a plain `#[test]`, not from inside `#[tokio::test]`). Actions
//! that are not registered do nothing, so a definition can be explored before its actions
//! exist. Assertions panic with the configuration, context and history in the message.
//!
//! ```
//! use keel_core::chart::Definition;
//! use keel_testkit::chart::TestMachine;
//! let def = Definition::builder("order", 1)
//!     .initial("cart")
//!     .state("cart", |s| s.on("CHECKOUT", |t| t.target("paid").action("charge")))
//!     .final_state("paid")
//!     .build()
//!     .unwrap();
//! TestMachine::new(def)
//!     .with_context(serde_json::json!({"total": 10}))
//!     .action("charge", |ctx, _event| async move {
//!         let total: i64 = ctx.get_as("total").unwrap_or(0);
//!         ctx.set("charged", total);
//!         Ok(())
//!     })
//!     .send("CHECKOUT")
//!     .assert_state("paid")
//!     .assert_context("charged", 10)
//!     .assert_history(&["event CHECKOUT", "action charge", "enter paid"])
//!     .assert_final();
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use keel_core::chart::parallel::{
    ParallelBook, RegionReport, RegionRun, RegionTask, action_failure, check,
};
use keel_core::chart::step::{ChartStep, StepPlan};
use keel_core::chart::{
    ActionError, ChartContext, Configuration, Definition, Event, Limits, MacrostepError,
    MacrostepResult, Record, SharedContext, Timer, TimerArm,
};
use keel_core::config::ParallelConfig;
use keel_core::instance::HistoryEntry;
use keel_core::retry::FailureKind;
use keel_core::time::Timestamp;
use keel_core::timers::{TimerRow, fire, owned_by};
use keel_core::{InstanceId, MachineRef, TimerId};
use serde::Serialize;
use serde_json::Value;

/// The context handle an inline action receives: the core's [`SharedContext`], the same
/// handle the durable runtime gives actions.
pub type ActionContext = SharedContext;

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), ActionError>> + Send>>;
type ActionFn = Arc<dyn Fn(ActionContext, Event) -> BoxFuture + Send + Sync>;

/// What a [`check_invariant`](crate::prop::check_invariant) invariant sees after each step.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// The definition.
    pub definition: &'a Definition,
    /// The configuration after the step.
    pub configuration: &'a Configuration,
    /// The context after the step.
    pub context: &'a Value,
    /// The step's full result.
    pub result: &'a MacrostepResult,
    /// The event of the step (`None` for the initial entry).
    pub event: Option<&'a Event>,
}

/// A bound on timer fires per `advance_timers` call.
pub const MAX_TIMER_FIRES_PER_ADVANCE: usize = 10_000;

/// A bound on region tasks run after one step in dispatch mode: each region task
/// may enter parallel states that dispatch more.
pub const MAX_REGION_TASKS_PER_STEP: usize = 10_000;

/// The event name a region's report is processed under, in [`TestMachine`]'s history as in
/// the durable runtime's.
pub use keel_core::chart::step::REGION_REPORT_EVENT;

/// How far to move the virtual clock: a [`Timer`] or a [`Duration`].
#[derive(Debug, Clone, Copy)]
pub struct Advance(Duration);

impl From<Duration> for Advance {
    fn from(d: Duration) -> Self {
        Self(d)
    }
}

impl From<Timer> for Advance {
    fn from(t: Timer) -> Self {
        Self(
            t.duration()
                .unwrap_or_else(|| panic!("advance_timers({t}): the duration must be positive")),
        )
    }
}

/// The virtual clock's origin: `TestMachine` keeps its timers as the durable stores keep
/// them (rows due at a timestamp), counted from here.
const EPOCH: Timestamp = Timestamp(0);

/// A virtual time as a timestamp.
fn at(elapsed: Duration) -> Timestamp {
    EPOCH.plus(elapsed)
}

/// An in-memory chart instance for tests. See the module docs.
pub struct TestMachine {
    def: Arc<Definition>,
    actions: HashMap<String, ActionFn>,
    limits: Limits,
    context: Value,
    configuration: Configuration,
    results: Vec<(Option<Event>, MacrostepResult)>,
    timers: Vec<TimerRow>,
    next_timer_id: i64,
    now: Duration,
    fired: Vec<String>,
    runtime: Option<tokio::runtime::Runtime>,
    parallel: ParallelConfig,
    hold_regions: bool,
    book: ParallelBook,
    pending: std::collections::VecDeque<RegionTask>,
    recorded: Vec<HistoryEntry>,
}

impl std::fmt::Debug for TestMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestMachine")
            .field("definition", &self.def.name())
            .field("configuration", &self.configuration)
            .field("context", &self.context)
            .finish_non_exhaustive()
    }
}

impl TestMachine {
    /// A machine for `definition`, with an empty context. Nothing runs until the first
    /// `send` or assertion, so actions can be registered first.
    pub fn new(definition: impl Into<Arc<Definition>>) -> Self {
        Self {
            def: definition.into(),
            actions: HashMap::new(),
            limits: Limits::default(),
            context: Value::Object(serde_json::Map::new()),
            configuration: Configuration::empty(),
            results: Vec::new(),
            timers: Vec::new(),
            next_timer_id: 1,
            now: Duration::ZERO,
            fired: Vec::new(),
            runtime: None,
            parallel: ParallelConfig::default(),
            hold_regions: false,
            book: ParallelBook::default(),
            pending: std::collections::VecDeque::new(),
            recorded: Vec::new(),
        }
    }

    /// Parallel dispatch mode, with the durable runtime's semantics in
    /// memory: entering a parallel state with two or more regions that have entry actions
    /// leaves those actions to **region tasks**, which run (in document order, unless
    /// [`hold_regions`](Self::hold_regions)) right after the step on a snapshot of the
    /// context; their reports are applied one at a time with the double guard, merge,
    /// conflict, stall, done and fail records. A region action error fails the region at
    /// once (there are no retries in memory): `@fail` with `attempts: 1`.
    pub fn with_parallel_dispatch(mut self, on: bool) -> Self {
        self.parallel.enabled = on;
        self
    }

    /// The parallel dispatch settings, as the durable runtime takes them: `enabled`
    /// switches dispatch mode on (see
    /// [`with_parallel_dispatch`](Self::with_parallel_dispatch)), and a non-zero
    /// `region_timeout` arms the region timeout when a dispatch starts, a timer that
    /// [`advance_timers`](Self::advance_timers) fires like any other. The job settings
    /// (tries, backoff, queue) do not apply in memory.
    pub fn with_parallel(mut self, parallel: ParallelConfig) -> Self {
        self.parallel = parallel;
        self
    }

    /// Keeps dispatched region tasks pending until [`run_region`](Self::run_region) or
    /// [`fail_region`](Self::fail_region), to test orderings and races.
    pub fn hold_regions(mut self, hold: bool) -> Self {
        self.hold_regions = hold;
        self
    }

    /// The regions (paths) of the pending region tasks, in dispatch order.
    pub fn pending_regions(&mut self) -> Vec<String> {
        self.start();
        self.pending.iter().map(|t| t.key.region.clone()).collect()
    }

    /// Runs the pending task of `region` now (its lock-free pre-check first: a task whose
    /// work is no longer wanted does nothing). Panics when no task of `region` is pending.
    pub fn run_region(&mut self, region: &str) -> &mut Self {
        let task = self.take_region(region);
        self.run_task(&task);
        self
    }

    /// Makes the pending task of `region` fail for good with `error` (its report reaches
    /// the parent even if the pre-check would skip it, like a task that started and then
    /// ran out of tries). The parent's under-lock guard decides what the failure does: it
    /// fires `@fail` (with `PARALLEL_FAIL`) once per dispatch; a failure of a region that
    /// moved on since dispatch (an event advanced it) is discarded with
    /// `PARALLEL_REGION_GUARD_ABORT` (`region_already_advanced`), like a late success; and
    /// one for a visit that is over, a region whose result was applied, or a dispatch that
    /// already failed or timed out does nothing.
    pub fn fail_region(&mut self, region: &str, error: &str) -> &mut Self {
        let task = self.take_region(region);
        let report = RegionReport::Failed {
            key: task.key,
            error: error.to_owned(),
            exception: FailureKind::Action.exception().to_owned(),
            attempts: 1,
        };
        self.handle_report(&report);
        self
    }

    /// Delivers a region report to the machine as the runtime would (for replays).
    pub fn deliver_report(&mut self, report: &RegionReport) -> &mut Self {
        self.start();
        self.handle_report(report);
        self
    }

    fn take_region(&mut self, region: &str) -> RegionTask {
        self.start();
        let index = self.pending.iter().position(|t| t.key.region == region).unwrap_or_else(|| {
            panic!("no region task pending for `{region}`; pending: {:?}", self.pending_regions())
        });
        self.pending.remove(index).expect("index is in range")
    }

    fn run_pending(&mut self) {
        if self.hold_regions {
            return;
        }
        for _ in 0..MAX_REGION_TASKS_PER_STEP {
            let Some(task) = self.pending.pop_front() else {
                return;
            };
            self.run_task(&task);
        }
    }

    /// Runs the pending task of `region` *without* its pre-check and returns its report
    /// without applying it: deliver it later with [`deliver_report`](Self::deliver_report)
    /// to test what the parent's under-lock guard does with work that finished late.
    pub fn run_region_detached(&mut self, region: &str) -> RegionReport {
        let task = self.take_region(region);
        self.region_report(&task)
    }

    /// Pre-check, run the region's entry actions on the snapshot, apply the report.
    fn run_task(&mut self, task: &RegionTask) {
        if check(&self.configuration, &self.book, &task.key).is_err() {
            return;
        }
        let report = self.region_report(task);
        self.handle_report(&report);
    }

    fn region_report(&mut self, task: &RegionTask) -> RegionReport {
        let mut run = RegionRun::new(&self.def, task);
        while let Some(request) = run.poll().cloned() {
            let ctx = SharedContext::new(run.context().clone());
            let outcome = self.call(&request.name, ctx.clone(), request.event.clone());
            if let Err(e) = run.handle_action_result(outcome.map(|()| ctx.to_result())) {
                return RegionReport::Failed {
                    key: task.key.clone(),
                    error: action_failure(&request, &e),
                    exception: FailureKind::Action.exception().to_owned(),
                    attempts: 1,
                };
            }
        }
        run.report()
    }

    fn handle_report(&mut self, report: &RegionReport) {
        let payload = serde_json::to_value(report).expect("a region report serializes");
        let event = Event::with_payload(REGION_REPORT_EVENT, payload);
        let def = Arc::clone(&self.def);
        let step = ChartStep::event(
            &def,
            &self.configuration,
            self.stored_context(),
            event.clone(),
            self.limits,
            &self.parallel,
        )
        .expect("a serialized region report decodes");
        match self.drive(step) {
            Ok(plan) => self.apply(Some(event), plan),
            Err(e) => panic!("applying the report of `{}` failed: {e}", report.key().region),
        }
    }

    /// The context as the durable runtime stores it: with the parallel bookkeeping.
    fn stored_context(&self) -> Value {
        let mut context = self.context.clone();
        self.book.put(&mut context);
        context
    }

    /// Every history entry the durable runtime would have committed for this machine so
    /// far, in commit order (`MACROSTEP`, `EVENT_UNHANDLED`, `PARALLEL_*`).
    pub fn history_entries(&mut self) -> &[HistoryEntry] {
        self.start();
        &self.recorded
    }

    /// The data of every recorded history entry of `kind` (`PARALLEL_DONE`,
    /// `PARALLEL_CONTEXT_CONFLICT`, …), oldest first.
    pub fn recorded(&mut self, kind: &str) -> Vec<Value> {
        self.start();
        self.recorded.iter().filter(|e| e.kind == kind).map(|e| e.data.clone()).collect()
    }

    /// Asserts that internal event `kind` was recorded exactly `times` times.
    #[track_caller]
    pub fn assert_recorded(&mut self, kind: &str, times: usize) -> &mut Self {
        let found = self.recorded(kind);
        assert_eq!(
            found.len(),
            times,
            "internal event `{kind}` recorded {} times, expected {times}: {found:?}\n{}",
            found.len(),
            self.describe()
        );
        self
    }

    /// Asserts that the last `kind` internal event recorded has `data`.
    #[track_caller]
    pub fn assert_recorded_with(&mut self, kind: &str, data: impl Serialize) -> &mut Self {
        let data = serde_json::to_value(data).expect("expected data serializes");
        let found = self.recorded(kind);
        assert_eq!(found.last(), Some(&data), "internal event `{kind}`\n{}", self.describe());
        self
    }

    /// Sets the initial context from a typed value (it must serialize to a JSON object).
    pub fn with_context<C: Serialize>(mut self, context: C) -> Self {
        let context =
            ChartContext::from_serialize(&context).unwrap_or_else(|e| panic!("with_context: {e}"));
        self.context = context.to_value();
        self
    }

    /// Sets the macrostep limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Registers an async action under `name`.
    pub fn action<F, Fut>(mut self, name: impl Into<String>, action: F) -> Self
    where
        F: Fn(ActionContext, Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), ActionError>> + Send + 'static,
    {
        let action: ActionFn = Arc::new(move |ctx, event| Box::pin(action(ctx, event)));
        self.actions.insert(name.into(), action);
        self
    }

    /// Registers a synchronous action that cannot fail.
    pub fn action_sync<F>(self, name: impl Into<String>, action: F) -> Self
    where
        F: Fn(&ActionContext, &Event) + Send + Sync + 'static,
    {
        let action = Arc::new(action);
        self.action(name, move |ctx, event| {
            let action = Arc::clone(&action);
            async move {
                action(&ctx, &event);
                Ok(())
            }
        })
    }

    /// The definition.
    pub fn definition(&self) -> &Definition {
        &self.def
    }

    /// Runs the initial entry if it has not run yet.
    pub fn start(&mut self) -> &mut Self {
        if self.results.is_empty() {
            let def = Arc::clone(&self.def);
            let step = ChartStep::init(&def, self.stored_context(), self.limits, &self.parallel);
            match self.drive(step) {
                Ok(plan) => self.apply(None, plan),
                Err(e) => panic!("initial entry of `{}` failed: {e}", self.def.name()),
            }
            self.run_pending();
        }
        self
    }

    /// Sends an event and runs its macrostep; panics when the macrostep fails.
    pub fn send(&mut self, event: impl Into<Event>) -> &mut Self {
        let event = event.into();
        if let Err(e) = self.try_send(event.clone()) {
            panic!("send({}) failed: {e}\n{}", event.name, self.describe());
        }
        self
    }

    /// Sends an event with a JSON payload.
    pub fn send_with(&mut self, event: &str, payload: impl Serialize) -> &mut Self {
        let payload =
            serde_json::to_value(payload).unwrap_or_else(|e| panic!("send_with({event}): {e}"));
        self.send(Event::with_payload(event, payload))
    }

    /// Sends an event; a failed macrostep commits nothing and returns its error.
    pub fn try_send(
        &mut self,
        event: impl Into<Event>,
    ) -> Result<&MacrostepResult, MacrostepError> {
        self.start();
        let event = event.into();
        let def = Arc::clone(&self.def);
        let step = ChartStep::event(
            &def,
            &self.configuration,
            self.stored_context(),
            event.clone(),
            self.limits,
            &self.parallel,
        )
        .map_err(|e| MacrostepError::Action {
            action: String::new(),
            state: String::new(),
            message: format!("the region report in event `{}` does not decode: {e}", event.name),
            retryable: false,
        })?;
        let plan = self.drive(step)?;
        self.apply(Some(event), plan);
        self.run_pending();
        Ok(self.last())
    }

    /// Runs the actions the chart step asks for and returns its plan.
    fn drive(&mut self, mut step: ChartStep<'_>) -> Result<StepPlan, MacrostepError> {
        while let Some(call) = step.poll() {
            let ctx = SharedContext::new(call.context);
            let request = call.request;
            let outcome = self.call(&request.name, ctx.clone(), request.event.clone());
            step.handle_action_result(outcome.map(|()| ctx.to_result()));
        }
        step.finish()
    }

    /// Runs a registered action (an unregistered one does nothing).
    fn call(&mut self, name: &str, ctx: ActionContext, event: Event) -> Result<(), ActionError> {
        let runtime = self.runtime.get_or_insert_with(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread tokio runtime")
        });
        match self.actions.get(name) {
            Some(action) => runtime.block_on(action(ctx, event)),
            None => Ok(()),
        }
    }

    /// Commits a chart step's plan in memory, as a durable store commits it.
    fn apply(&mut self, event: Option<Event>, plan: StepPlan) {
        self.recorded.extend(plan.history);
        // The durable stores' rule: cancels apply before arms, and a cancelled state
        // takes its descendants' timers along.
        for owner in &plan.timers_cancel {
            self.timers.retain(|t| !owned_by(&t.spec.state, owner));
        }
        let machine =
            MachineRef::new(self.def.name(), i32::try_from(self.def.version()).unwrap_or(i32::MAX));
        for arm in plan.timers_arm {
            let id = TimerId(self.next_timer_id);
            self.next_timer_id += 1;
            let row = TimerRow::armed(id, InstanceId(0), "", &machine, arm, at(self.now));
            self.timers.push(row);
        }
        self.pending.extend(plan.region_tasks);
        self.book = plan.book;
        self.context = plan.context;
        if let Some(configuration) = plan.configuration {
            self.configuration = configuration;
        }
        if let Some(result) = plan.macrostep {
            self.results.push((event, result));
        }
    }

    /// The result of the last macrostep (the initial entry if nothing was sent).
    pub fn last(&mut self) -> &MacrostepResult {
        self.start();
        &self.results.last().expect("started").1
    }

    /// The current configuration.
    pub fn configuration(&mut self) -> &Configuration {
        self.start();
        &self.configuration
    }

    /// The configuration encoded as the durable runtime stores it in the instance's
    /// position (a sorted JSON array of active paths). A finished machine's position is its
    /// final configuration, as a finished durable instance's is.
    pub fn position(&mut self) -> String {
        self.start();
        self.configuration.position()
    }

    /// Asserts that [`position`](Self::position) is exactly `expected` (the active paths,
    /// in any order).
    #[track_caller]
    pub fn assert_position(&mut self, expected: &[&str]) -> &mut Self {
        let want = Configuration::from_paths(expected.iter().copied()).position();
        let got = self.position();
        assert_eq!(got, want, "position\n{}", self.describe());
        self
    }

    /// The current context.
    pub fn context(&mut self) -> &Value {
        self.start();
        &self.context
    }

    /// Every history record so far, in order, as text (see [`Record`]'s `Display`).
    pub fn history(&mut self) -> Vec<String> {
        self.start();
        self.results.iter().flat_map(|(_, r)| r.records.iter().map(Record::to_string)).collect()
    }

    /// The timers currently armed (as the runtime would hold them), in arming order.
    pub fn timers(&mut self) -> Vec<&TimerArm> {
        self.start();
        self.timers.iter().map(|t| &t.spec).collect()
    }

    /// Moves the virtual clock forward by `by`, firing every timer that falls due, in due
    /// order (ties in arming order), each as a normal `send`: `after` fires once per state
    /// entry, `every` fires each interval after the state entry (no back-fill), and
    /// after `max` fires the next due time sends `then` once and the timer stops (as the
    /// durable sweep does). Leaving a state cancels its timers.
    /// Panics when a fired event's macrostep fails, like `send`.
    pub fn advance_timers(&mut self, by: impl Into<Advance>) -> &mut Self {
        self.start();
        let until = self.now + by.into().0;
        // Each fire either removes a timer or moves it forward by a positive interval, and
        // the loop is bounded so a pathological chart cannot spin forever; going over the
        // bound panics rather than leave due timers unfired.
        for fires in 0.. {
            let next = self
                .timers
                .iter()
                .enumerate()
                .filter(|(_, t)| t.next_fire_at <= at(until))
                .min_by_key(|(i, t)| (t.next_fire_at, *i));
            let Some((index, due)) = next else {
                break;
            };
            assert!(
                fires < MAX_TIMER_FIRES_PER_ADVANCE,
                "advance_timers: more than {MAX_TIMER_FIRES_PER_ADVANCE} timer fires in one call \
                 (`{}` of state `{}` is still due); advance in smaller steps\n{}",
                due.spec.event,
                due.spec.state,
                self.describe()
            );
            let timer = self.timers.remove(index);
            let due = timer.next_fire_at;
            self.now = Duration::from_millis(u64::try_from(due.0 - EPOCH.0).unwrap_or(0));
            // The durable sweep's rule, from the core: what to deliver, and the timer
            // that remains (an `every` timer due again, or none).
            let fired = fire(&timer, due);
            if let Some(next) = fired.next {
                self.timers.insert(index, next);
            }
            // An exhausted timer without a `then` event has nothing to deliver. The event
            // carries the payload the durable sweep delivers (`timer`, `state`, `fire`).
            let signal = fired.signal;
            if !signal.name.is_empty() {
                self.fired.push(signal.name.clone());
                self.send(Event::with_payload(signal.name, signal.payload));
            }
        }
        self.now = until;
        self
    }

    /// Virtual time elapsed since the machine started.
    pub fn elapsed(&self) -> Duration {
        self.now
    }

    /// Asserts that timers delivered `event` exactly `n` times so far.
    #[track_caller]
    pub fn assert_timer_fire_count(&mut self, event: &str, n: usize) -> &mut Self {
        let count = self.fired.iter().filter(|e| *e == event).count();
        assert_eq!(
            count,
            n,
            "timer event `{event}` fired {count} times, expected {n}\n{}",
            self.describe()
        );
        self
    }

    /// Asserts that a timer delivered `event` at least once.
    #[track_caller]
    pub fn assert_timer_fired(&mut self, event: &str) -> &mut Self {
        assert!(
            self.fired.iter().any(|e| e == event),
            "expected timer event `{event}` to have fired; fired: {:?}\n{}",
            self.fired,
            self.describe()
        );
        self
    }

    /// The state after the last step, for invariants.
    pub fn snapshot(&mut self) -> Snapshot<'_> {
        self.start();
        let (event, result) = self.results.last().expect("started");
        Snapshot {
            definition: &self.def,
            configuration: &self.configuration,
            context: &self.context,
            result,
            event: event.as_ref(),
        }
    }

    fn describe(&self) -> String {
        let history: Vec<String> = self
            .results
            .iter()
            .flat_map(|(_, r)| r.records.iter().map(Record::to_string))
            .collect();
        format!(
            "  active: {:?}\n  context: {}\n  history:\n    {}",
            self.configuration.leaves(&self.def),
            self.context,
            history.join("\n    ")
        )
    }

    /// Asserts that the state at `path` is active (its ancestors then are too).
    #[track_caller]
    pub fn assert_state(&mut self, path: &str) -> &mut Self {
        self.start();
        assert!(
            self.configuration.contains(path),
            "expected state `{path}` to be active\n{}",
            self.describe()
        );
        self
    }

    /// Asserts an XState-style match: `"a.b"` or `json!({"a": {"r1": "x", "r2": "y"}})`.
    #[track_caller]
    pub fn assert_matches(&mut self, pattern: impl Into<Value>) -> &mut Self {
        self.start();
        let pattern = pattern.into();
        assert!(
            self.configuration.matches(&pattern),
            "expected the configuration to match {pattern}, state value is {}\n{}",
            self.configuration.state_value(&self.def),
            self.describe()
        );
        self
    }

    /// Asserts that context key `key` equals `expected` (serialized to JSON).
    #[track_caller]
    pub fn assert_context(&mut self, key: &str, expected: impl Serialize) -> &mut Self {
        self.start();
        let expected = serde_json::to_value(expected).expect("expected value serializes");
        let actual = self.context.get(key).cloned().unwrap_or(Value::Null);
        assert_eq!(actual, expected, "context key `{key}`\n{}", self.describe());
        self
    }

    /// Asserts that `expected` history records (as text, e.g. `"enter paid"`,
    /// `"action charge"`, `"transition cart -> paid on PAY"`) occur in this order; other
    /// records may come between them.
    #[track_caller]
    pub fn assert_history(&mut self, expected: &[&str]) -> &mut Self {
        let history = self.history();
        let mut rest = history.iter();
        for want in expected {
            assert!(
                rest.any(|r| r == want),
                "history record `{want}` missing or out of order\n{}",
                self.describe()
            );
        }
        self
    }

    /// Asserts that a top-level final state is active.
    #[track_caller]
    pub fn assert_final(&mut self) -> &mut Self {
        self.start();
        assert!(
            self.configuration.is_final(&self.def),
            "expected a final state\n{}",
            self.describe()
        );
        self
    }

    /// Asserts that the last event was not handled.
    #[track_caller]
    pub fn assert_unhandled(&mut self) -> &mut Self {
        let unhandled = self.last().unhandled;
        assert!(unhandled, "expected the last event to be unhandled\n{}", self.describe());
        self
    }

    /// Asserts that a timer for `event` is armed.
    #[track_caller]
    pub fn assert_has_timer(&mut self, event: &str) -> &mut Self {
        let armed = self.timers().iter().any(|t| t.event == event);
        assert!(
            armed,
            "expected a timer for `{event}`, armed: {:?}\n{}",
            self.timers,
            self.describe()
        );
        self
    }

    /// Asserts that no timer for `event` is armed.
    #[track_caller]
    pub fn assert_no_timer(&mut self, event: &str) -> &mut Self {
        let armed = self.timers().iter().any(|t| t.event == event);
        assert!(!armed, "expected no timer for `{event}`\n{}", self.describe());
        self
    }
}

#[cfg(test)]
mod tests {
    use keel_core::chart::{Definition, Limits, Timer};
    use serde_json::json;

    use super::TestMachine;

    fn def() -> Definition {
        Definition::builder("t", 1)
            .initial("a")
            .state("a", |s| {
                s.on("GO", |t| t.target("b").action("mark"))
                    .on("WAIT", |t| t.action("nothing").after(Timer::hours(1)))
            })
            .state("b", |s| s.always(|b| b.target("b").action("spin")).on_to("NEVER", "a"))
            .build()
            .unwrap()
    }

    fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
        let err = std::panic::catch_unwind(f).expect_err("should panic");
        err.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn assertion_failures_explain_themselves() {
        let msg = panic_message(|| {
            TestMachine::new(def()).assert_state("b");
        });
        assert!(msg.starts_with("expected state `b` to be active"), "{msg}");
        assert!(msg.contains("active: [\"a\"]") && msg.contains("enter a"), "{msg}");
        let msg = panic_message(|| {
            TestMachine::new(def()).assert_context("k", 1);
        });
        assert!(msg.contains("context key `k`"), "{msg}");
        let msg = panic_message(|| {
            TestMachine::new(def()).assert_history(&["enter b"]);
        });
        assert!(msg.contains("history record `enter b` missing or out of order"), "{msg}");
        let msg = panic_message(|| {
            TestMachine::new(def()).assert_final();
        });
        assert!(msg.starts_with("expected a final state"), "{msg}");
        let msg = panic_message(|| {
            TestMachine::new(def()).assert_matches(json!({"b": "x"}));
        });
        assert!(msg.contains("state value is \"a\""), "{msg}");
    }

    #[test]
    fn a_finished_machine_shows_which_final_state_it_reached() {
        let review = || {
            Definition::builder("review", 1)
                .initial("pending")
                .state("pending", |s| s.on_to("APPROVE", "approved").on_to("REJECT", "rejected"))
                .final_state("approved")
                .final_state("rejected")
                .build()
                .unwrap()
        };
        let mut approved = TestMachine::new(review());
        assert_eq!(approved.position(), r#"["pending"]"#);
        approved.send("APPROVE").assert_final().assert_position(&["approved"]);
        assert_eq!(approved.position(), r#"["approved"]"#);
        // A finished machine takes no more events, as a finished durable instance.
        approved.send("REJECT").assert_unhandled().assert_position(&["approved"]);
        TestMachine::new(review()).send("REJECT").assert_final().assert_position(&["rejected"]);
        let msg = panic_message(|| {
            TestMachine::new(review()).send("REJECT").assert_position(&["approved"]);
        });
        assert!(msg.contains("position") && msg.contains("rejected"), "{msg}");
    }

    #[test]
    fn send_panics_on_macrostep_error_and_try_send_returns_it() {
        let mut m = TestMachine::new(def()).with_limits(Limits { max_transition_depth: 5 });
        let err = m.try_send("GO").unwrap_err();
        assert!(err.to_string().starts_with("MaxTransitionDepthExceeded"), "{err}");
        m.assert_state("a").assert_has_timer("WAIT");
        let msg = panic_message(std::panic::AssertUnwindSafe(move || {
            m.send("GO");
        }));
        assert!(msg.starts_with("send(GO) failed: MaxTransitionDepthExceeded"), "{msg}");
    }

    /// A guard sees the fire's payload (`timer`, `state`, `fire`), as on the stores.
    #[test]
    fn a_timer_fire_carries_the_durable_payload() {
        let def = Definition::builder("t", 1)
            .guard("third", |_, event| event.payload["fire"] == json!(3))
            .initial("polling")
            .state("polling", |s| {
                s.on("POLL", |t| {
                    t.every(Timer::minutes(1)).branch(|b| b.guard("third").target("done"))
                })
            })
            .final_state("done")
            .build()
            .unwrap();
        let mut m = TestMachine::new(def);
        m.advance_timers(Timer::minutes(2)).assert_state("polling");
        m.advance_timers(Timer::minutes(1)).assert_state("done");
    }

    /// Over the bound, `advance_timers` panics naming the timer still due rather than
    /// leave it unfired.
    #[test]
    fn more_timer_fires_than_the_bound_in_one_advance_panic() {
        let def = Definition::builder("t", 1)
            .initial("ticking")
            .state("ticking", |s| s.on("TICK", |t| t.every(Timer::seconds(1))))
            .build()
            .unwrap();
        let msg = panic_message(std::panic::AssertUnwindSafe(|| {
            TestMachine::new(def).advance_timers(Timer::hours(3));
        }));
        assert!(msg.contains("more than 10000 timer fires"), "{msg}");
        assert!(msg.contains("`TICK` of state `ticking`"), "{msg}");
    }

    /// A deadline is renewed by a trip through a transit state (event → transit →
    /// `@always` back) and kept by a self-loop, as on the durable stores.
    #[test]
    fn a_transit_state_renews_an_after_deadline_and_a_self_loop_keeps_it() {
        let def = Definition::builder("t", 1)
            .initial("idle")
            .state("idle", |s| {
                s.on("LOGOUT", |t| t.target("closed").after(Timer::minutes(30)))
                    .on_to("ACTIVITY", "renewing")
                    .on_to("TOUCH", "idle")
            })
            .state("renewing", |s| s.always(|b| b.target("idle")))
            .final_state("closed")
            .build()
            .unwrap();
        let mut renewed = TestMachine::new(def.clone());
        renewed.advance_timers(Timer::minutes(20)).send("ACTIVITY").assert_state("idle");
        renewed.advance_timers(Timer::minutes(20)).assert_state("idle");
        renewed.assert_timer_fire_count("LOGOUT", 0);
        renewed.advance_timers(Timer::minutes(10)).assert_state("closed");
        renewed.assert_timer_fire_count("LOGOUT", 1);

        let mut kept = TestMachine::new(def);
        kept.advance_timers(Timer::minutes(20)).send("TOUCH").assert_state("idle");
        kept.advance_timers(Timer::minutes(10)).assert_state("closed");
        kept.assert_timer_fired("LOGOUT");
    }

    #[test]
    fn sync_actions_and_snapshots() {
        let def = Definition::builder("t", 1)
            .initial("a")
            .state("a", |s| s.on("GO", |t| t.target("b").action("mark")))
            .leaf("b")
            .build()
            .unwrap();
        let mut m = TestMachine::new(def)
            .action_sync("mark", |ctx, event| ctx.set("by", event.name.clone()));
        m.send("GO").assert_context("by", "GO").assert_no_timer("WAIT");
        let snap = m.snapshot();
        assert_eq!(snap.event.map(|e| e.name.as_str()), Some("GO"));
        assert_eq!(snap.result.changed_keys, ["by"]);
        assert_eq!(
            m.history(),
            ["enter a", "event GO", "transition a -> b on GO", "exit a", "action mark", "enter b"]
        );
    }
}
