//! The macrostep: the W3C SCXML algorithm as an explicit, resumable state machine.
//!
//! One external event (or the initial entry) becomes a macrostep: select transitions
//! (innermost active state first, document order, guards on the current context), remove
//! conflicts, exit children-first, run transition actions, enter parents-first, raise
//! `done.state.*` events, then run eventless transitions and internal events until stable.
//!
//! The core never calls an action. [`Macrostep::poll`] hands out one
//! [`Next::RunAction`] at a time; the caller runs it (possibly async, with IO) and feeds the
//! result to [`Macrostep::handle_action_result`]. Transition selection is lazy, so guards see
//! every change the earlier actions made (SCXML's "current data model").
//!
//! ```
//! use keel_core::chart::{ActionResult, Configuration, Definition, Event, Limits, Macrostep, Next};
//! let def = Definition::builder("door", 1)
//!     .initial("closed")
//!     .state("closed", |s| s.on("OPEN", |t| t.target("open").action("log")))
//!     .leaf("open")
//!     .build()
//!     .unwrap();
//! let config = Configuration::from_paths(["closed"]);
//! let mut step = Macrostep::start(&def, &config, serde_json::json!({}), Event::new("OPEN"), Limits::default());
//! let result = loop {
//!     match step.poll() {
//!         Next::RunAction(request) => {
//!             assert_eq!(request.name, "log");
//!             step.handle_action_result(Ok(ActionResult::empty()));
//!         }
//!         Next::Done(result) => break result,
//!     }
//! };
//! assert!(result.configuration.contains("open"));
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::configuration::Configuration;
use super::context::{ActionResult, ChartContext};
use super::definition::{
    DONE_INVOKE, DONE_STATE, Definition, Event, FAIL_STATE, HistoryDepth, StateKind,
    TIMEOUT_INVOKE, TargetRef, Trigger,
};

/// The reserved context key under which a chart keeps what its history pseudo-states
/// recorded: an object from history path to the recorded state paths. It lives in the
/// context because the context is committed atomically with the configuration, so the
/// record survives a commit and a later claim by another worker, while the position stays
/// the plain set of active states that timers, diagrams and checks read. Charts without
/// history never get the key.
pub const HISTORY_CONTEXT_KEY: &str = "@history";

/// The timers entering `node` arms: one per timed transition, and its delegation's
/// `@timeout` deadline.
pub(crate) fn entry_timers(node: &super::definition::StateNode) -> Vec<TimerArm> {
    let mut arm = Vec::new();
    for t in &node.on {
        if let Some(spec) = &t.timer {
            arm.push(TimerArm {
                state: node.path.clone(),
                event: t.event.clone(),
                kind: spec.kind,
                interval: spec.timer.duration().unwrap_or_default(),
                max: spec.max,
                then: spec.then.clone(),
            });
        }
    }
    if let Some(timeout) = node.delegation.as_ref().and_then(|d| d.timeout) {
        arm.push(TimerArm {
            state: node.path.clone(),
            event: Event::timeout_invoke(&node.path).name,
            kind: TimerKind::After,
            interval: timeout.duration().unwrap_or_default(),
            max: None,
            then: None,
        });
    }
    arm
}

/// Actions named `@raise:<event>` are run by the core itself: they put `<event>` on the
/// internal queue at their place among the other actions (SCXML `<raise>`), so a chart can
/// raise events without binding an action in Rust.
pub const RAISE_ACTION_PREFIX: &str = "@raise:";
use super::parallel::RegionDispatch;
use super::timer::{TimerArm, TimerCancel, TimerKind};

/// Bounds on one macrostep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// How many microsteps may follow the external event (eventless transitions plus internal
    /// events processed) before [`MacrostepError::MaxTransitionDepthExceeded`]. Default 100.
    pub max_transition_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_transition_depth: 100 }
    }
}

/// Where an action comes from, which decides its place in the microstep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionPhase {
    /// An exit action of `state`.
    Exit,
    /// An action of a transition whose source is `state`.
    Transition,
    /// An entry action of `state`.
    Entry,
}

/// An action the caller must run now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRequest {
    /// The action's name in the definition.
    pub name: String,
    /// The event being processed (SCXML `_event`).
    pub event: Event,
    /// The state that owns the action (for transition actions: the source).
    pub state: String,
    /// Exit, transition or entry.
    pub phase: ActionPhase,
}

/// An action failed; the macrostep stops with [`MacrostepError::Action`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ActionError {
    /// What went wrong.
    pub message: String,
    /// Whether running the macrostep again may succeed (timeouts, connection errors, rate
    /// limits) or not (validation, business failure, auth). Defaults to `true`.
    #[serde(default = "retryable_default")]
    pub retryable: bool,
}

fn retryable_default() -> bool {
    true
}

impl From<String> for ActionError {
    fn from(message: String) -> Self {
        Self::new(message)
    }
}

impl From<&str> for ActionError {
    fn from(message: &str) -> Self {
        Self::new(message)
    }
}

impl From<serde_json::Error> for ActionError {
    fn from(e: serde_json::Error) -> Self {
        Self::new(e.to_string())
    }
}

impl ActionError {
    /// A retryable action error.
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), retryable: true }
    }

    /// An action error that retrying cannot fix (validation, business failure, auth).
    pub fn permanent(message: impl Into<String>) -> Self {
        Self { message: message.into(), retryable: false }
    }
}

/// Why a macrostep stopped without a result to commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MacrostepError {
    /// Eventless transitions or raised events did not settle within the bound.
    #[error(
        "MaxTransitionDepthExceeded: more than {limit} microsteps after one event (last from state `{state}` on `{event}`); fix: break the @always/raise loop or raise Limits::max_transition_depth"
    )]
    MaxTransitionDepthExceeded {
        /// The configured bound.
        limit: usize,
        /// The source states of the transitions the microstep over the bound would take
        /// (`, `-separated when there are several): the states that loop.
        state: String,
        /// The event that microstep processes (the one just taken off the queue for a
        /// raise loop; the last event processed for an `@always` loop).
        event: String,
    },
    /// An action returned an error; the caller decides whether to retry the macrostep.
    #[error("action `{action}` of state `{state}` failed: {message}")]
    Action {
        /// The action name.
        action: String,
        /// The owning state.
        state: String,
        /// The action's error message.
        message: String,
        /// Whether the action said a retry may succeed.
        retryable: bool,
    },
    /// The configuration given to [`Macrostep::start`] does not fit the definition. An
    /// instance runs on the version it was started on, so this means the definition was
    /// changed under that version.
    #[error(
        "the stored configuration does not fit definition `{definition}`: {reason}; the chart was changed under the same version, so it no longer fits the instances already running on it; fix: restore the states the change removed or moved, or restore this version as it was, publish the change as a new version and move the instances with `Migration::new(old, new)`"
    )]
    IllegalConfiguration {
        /// Definition name and version.
        definition: String,
        /// What is wrong.
        reason: String,
    },
    /// The context is not a JSON object (`null` counts as an empty object).
    #[error(
        "the context must be a JSON object, got `{found}`; fix: wrap the value in a struct or map"
    )]
    ContextNotObject {
        /// The JSON type found.
        found: String,
    },
}

impl MacrostepError {
    /// Whether running the same macrostep again may succeed: only retryable action errors.
    /// The other errors are deterministic (same definition, configuration, context and event
    /// give the same error), so retrying them only burns attempts.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Action { retryable: true, .. })
    }
}

/// One entry of the history a macrostep records, in the order things happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// An event was taken for processing (`internal`: raised or `done.state`).
    Event {
        /// Event name.
        name: String,
        /// Whether it came from the internal queue.
        internal: bool,
    },
    /// No transition was enabled for the event.
    Unhandled {
        /// Event name.
        name: String,
    },
    /// A transition was selected.
    Transition {
        /// Source state path.
        source: String,
        /// Event name (`None`: eventless `@always`).
        event: Option<String>,
        /// Target state path (`None`: targetless).
        target: Option<String>,
    },
    /// A state was exited.
    Exit {
        /// State path.
        state: String,
    },
    /// A state was entered.
    Enter {
        /// State path.
        state: String,
    },
    /// An action was run.
    Action {
        /// Action name.
        name: String,
        /// Owning state path.
        state: String,
    },
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Event { name, internal: false } => write!(f, "event {name}"),
            Self::Event { name, internal: true } => write!(f, "internal {name}"),
            Self::Unhandled { name } => write!(f, "unhandled {name}"),
            Self::Transition { source, event, target } => {
                write!(f, "transition {source}")?;
                if let Some(target) = target {
                    write!(f, " -> {target}")?;
                }
                write!(f, " on {}", event.as_deref().unwrap_or("@always"))
            }
            Self::Exit { state } => write!(f, "exit {state}"),
            Self::Enter { state } => write!(f, "enter {state}"),
            Self::Action { name, .. } => write!(f, "action {name}"),
        }
    }
}

/// A child machine the runtime must start because its delegation state became active.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildStart {
    /// The delegation state's path.
    pub state: String,
    /// The child machine's definition name.
    pub machine: String,
}

/// Everything one macrostep did. On error the configuration and context are the ones the
/// macrostep started from: commit nothing, the caller decides whether to retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MacrostepResult {
    /// The configuration after the macrostep.
    pub configuration: Configuration,
    /// The context after the macrostep.
    pub context: Value,
    /// Top-level context keys changed by actions, sorted.
    pub changed_keys: Vec<String>,
    /// The history, in order.
    pub records: Vec<Record>,
    /// Internal events (raised by actions or `done.state.*`), in the order they were queued.
    pub internal_events: Vec<Event>,
    /// The external event enabled no transition (the configuration is unchanged).
    pub unhandled: bool,
    /// Timers of states that became active.
    pub timers_to_arm: Vec<TimerArm>,
    /// Timers of states that are no longer active.
    pub timers_to_cancel: Vec<TimerCancel>,
    /// Child machines of delegation states that became active.
    pub children_to_start: Vec<ChildStart>,
    /// Delegation states (paths) that are no longer active: cancel their child machines.
    pub children_to_cancel: Vec<String>,
    /// A top-level final state is active: the instance is complete.
    pub is_final: bool,
    /// With [`Macrostep::dispatch_regions`]: regions of a newly entered parallel state whose
    /// entry actions were *not* run, for the runtime to run elsewhere. Only
    /// regions still at the states they entered when the macrostep ended are listed.
    #[serde(default)]
    pub regions_to_dispatch: Vec<RegionDispatch>,
    /// Why the macrostep stopped early, if it did.
    pub error: Option<MacrostepError>,
}

impl MacrostepResult {
    /// States exited, in order.
    pub fn exited(&self) -> Vec<&str> {
        self.records
            .iter()
            .filter_map(
                |r| {
                    if let Record::Exit { state } = r { Some(state.as_str()) } else { None }
                },
            )
            .collect()
    }

    /// States entered, in order.
    pub fn entered(&self) -> Vec<&str> {
        self.records
            .iter()
            .filter_map(
                |r| {
                    if let Record::Enter { state } = r { Some(state.as_str()) } else { None }
                },
            )
            .collect()
    }

    /// Actions run, in order.
    pub fn actions(&self) -> Vec<&str> {
        self.records
            .iter()
            .filter_map(|r| {
                if let Record::Action { name, .. } = r { Some(name.as_str()) } else { None }
            })
            .collect()
    }

    /// Transitions fired, in order, as history records.
    pub fn transitions(&self) -> Vec<&Record> {
        self.records.iter().filter(|r| matches!(r, Record::Transition { .. })).collect()
    }
}

/// What the caller must do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Run this action against [`Macrostep::context`] and call
    /// [`Macrostep::handle_action_result`]. Polling again before that returns the same request.
    RunAction(ActionRequest),
    /// The macrostep is over.
    Done(Box<MacrostepResult>),
}

#[derive(Debug)]
enum Op {
    Record(Record),
    Action(ActionRequest),
    Raise(Event),
}

/// One macrostep in progress. See the module docs for the driving loop.
#[derive(Debug)]
pub struct Macrostep<'d> {
    def: &'d Definition,
    limits: Limits,
    start_ids: BTreeSet<usize>,
    start_context: Value,
    config: BTreeSet<usize>,
    context: ChartContext,
    init_pending: bool,
    external: Option<Event>,
    current: Event,
    internal: VecDeque<Event>,
    ops: VecDeque<Op>,
    pending: Option<ActionRequest>,
    running: bool,
    depth: usize,
    records: Vec<Record>,
    internal_events: Vec<Event>,
    unhandled: bool,
    done: Option<Box<MacrostepResult>>,
    dispatch: bool,
    skip_entry: BTreeSet<usize>,
    dispatches: Vec<(usize, usize, Vec<usize>, Event)>,
    /// The transitions the last microstep that took any took (named by a depth error).
    last_sources: Vec<usize>,
    /// States that were inactive after some microstep of this macrostep: exited to another
    /// state, not re-entered by the same microstep. Their timers belong to a new entry.
    left: BTreeSet<usize>,
    /// Every state exited by some microstep of this macrostep, self-loops included.
    exited: BTreeSet<usize>,
    /// The external event this macrostep processes (`None` for the initial entry).
    trigger: Option<Event>,
    /// What each history pseudo-state (by index) recorded, loaded from the context.
    history: BTreeMap<usize, Vec<usize>>,
    history_changed: bool,
}

impl<'d> Macrostep<'d> {
    /// Processes one external `event` from a stored `configuration`.
    pub fn start(
        def: &'d Definition,
        configuration: &Configuration,
        context: Value,
        event: Event,
        limits: Limits,
    ) -> Self {
        let (context, context_error) = object_context(context);
        let mut step = Self::blank(def, context, limits);
        let checked = configuration.check(def).and_then(|()| configuration.to_ids(def));
        match checked {
            Ok(ids) => {
                step.running = !configuration.is_final(def);
                step.start_ids.clone_from(&ids);
                step.config = ids;
                step.trigger = Some(event.clone());
                step.external = Some(event);
            }
            Err(reason) => {
                let definition = format!("{} v{}", def.name, def.version);
                step.finish(Some(MacrostepError::IllegalConfiguration { definition, reason }));
                return step;
            }
        }
        if let Some(e) = context_error {
            step.finish(Some(e));
            return step;
        }
        if let Err(reason) = step.load_history() {
            let definition = format!("{} v{}", def.name, def.version);
            step.finish(Some(MacrostepError::IllegalConfiguration { definition, reason }));
        }
        step
    }

    /// Reads the recorded history from the reserved context key. A record naming a history
    /// or state this definition does not have is refused like a stale configuration.
    fn load_history(&mut self) -> Result<(), String> {
        let Some(value) = self.context.get(HISTORY_CONTEXT_KEY) else {
            return Ok(());
        };
        let Some(map) = value.as_object() else {
            return Err(format!("context key `{HISTORY_CONTEXT_KEY}` is not an object"));
        };
        for (path, states) in map {
            let h =
                self.def.histories.iter().position(|h| h.path == *path).ok_or_else(|| {
                    format!("unknown history `{path}` in `{HISTORY_CONTEXT_KEY}`")
                })?;
            let mut ids = Vec::new();
            for state in states.as_array().into_iter().flatten() {
                let id = state
                    .as_str()
                    .and_then(|p| self.def.by_path.get(p))
                    .ok_or_else(|| format!("history `{path}` records unknown state `{state}`"))?;
                ids.push(*id);
            }
            self.history.insert(h, ids);
        }
        Ok(())
    }

    /// Enters the initial states of a new instance (entry actions included) and settles.
    pub fn init(def: &'d Definition, context: Value, limits: Limits) -> Self {
        let (context, context_error) = object_context(context);
        let mut step = Self::blank(def, context, limits);
        match context_error {
            Some(e) => step.finish(Some(e)),
            None => step.init_pending = true,
        }
        step
    }

    fn blank(def: &'d Definition, context: Value, limits: Limits) -> Self {
        Self {
            def,
            limits,
            start_ids: BTreeSet::from([0]),
            context: ChartContext::new(context.clone()),
            start_context: context,
            config: BTreeSet::from([0]),
            init_pending: false,
            external: None,
            current: Event::new("@init"),
            internal: VecDeque::new(),
            ops: VecDeque::new(),
            pending: None,
            running: true,
            depth: 0,
            records: Vec::new(),
            internal_events: Vec::new(),
            unhandled: false,
            done: None,
            dispatch: false,
            skip_entry: BTreeSet::new(),
            dispatches: Vec::new(),
            last_sources: Vec::new(),
            left: BTreeSet::new(),
            exited: BTreeSet::new(),
            trigger: None,
            history: BTreeMap::new(),
            history_changed: false,
        }
    }

    /// Processes `events` as internal events (in order) from a stored `configuration`,
    /// without an external event: eventless transitions first, then each event as its own
    /// microstep. This is how the raised events of a dispatched region are applied.
    pub fn resume(
        def: &'d Definition,
        configuration: &Configuration,
        context: Value,
        events: Vec<Event>,
        limits: Limits,
    ) -> Self {
        let mut step = Self::start(def, configuration, context, Event::new("@resume"), limits);
        if step.done.is_none() {
            step.external = None;
            step.trigger = None;
            step.internal.extend(events);
        }
        step
    }

    /// Parallel dispatch: when this macrostep enters a parallel state of which
    /// at least two regions have entry actions, those regions' entry actions are not run
    /// here; they are reported in [`MacrostepResult::regions_to_dispatch`] instead. The
    /// states are entered (and their timers armed) as usual.
    #[must_use]
    pub fn dispatch_regions(mut self, on: bool) -> Self {
        self.dispatch = on;
        self
    }

    /// The context as it is now: give a copy to the action being run.
    pub fn context(&self) -> &ChartContext {
        &self.context
    }

    /// The next thing to do.
    pub fn poll(&mut self) -> Next {
        loop {
            if let Some(done) = &self.done {
                return Next::Done(done.clone());
            }
            if let Some(request) = &self.pending {
                return Next::RunAction(request.clone());
            }
            match self.ops.pop_front() {
                Some(Op::Record(r)) => self.records.push(r),
                Some(Op::Raise(e)) => {
                    self.internal_events.push(e.clone());
                    self.internal.push_back(e);
                }
                Some(Op::Action(request)) => {
                    self.records.push(Record::Action {
                        name: request.name.clone(),
                        state: request.state.clone(),
                    });
                    self.pending = Some(request.clone());
                    return Next::RunAction(request);
                }
                None => match self.next_microstep() {
                    Ok(true) => {}
                    Ok(false) => self.finish(None),
                    Err(e) => self.finish(Some(e)),
                },
            }
        }
    }

    /// Feeds the result of the action last returned by [`poll`](Self::poll). A result with no
    /// action pending is ignored.
    pub fn handle_action_result(&mut self, result: Result<ActionResult, ActionError>) {
        let Some(request) = self.pending.take() else {
            return;
        };
        match result {
            Ok(result) => {
                self.context.apply(&result);
                for e in result.raised {
                    self.internal_events.push(e.clone());
                    self.internal.push_back(e);
                }
            }
            Err(e) => {
                self.finish(Some(MacrostepError::Action {
                    action: request.name,
                    state: request.state,
                    message: e.message,
                    retryable: e.retryable,
                }));
            }
        }
    }

    /// Plans the next microstep; `Ok(false)` when the configuration is stable.
    fn next_microstep(&mut self) -> Result<bool, MacrostepError> {
        if self.init_pending {
            self.init_pending = false;
            let mut set = BTreeSet::new();
            self.add_descendants(0, &mut set);
            set.remove(&0);
            self.enter(&set);
            return Ok(true);
        }
        if !self.running {
            if let Some(e) = self.external.take() {
                self.unhandle(e);
            }
            return Ok(false);
        }
        if let Some(event) = self.external.take() {
            self.records.push(Record::Event { name: event.name.clone(), internal: false });
            self.current = event;
            let selected = self.select(true);
            if selected.is_empty() {
                let e = self.current.clone();
                self.unhandle(e);
            } else {
                self.microstep(&selected);
            }
            return Ok(true);
        }
        let selected = self.select(false);
        if !selected.is_empty() {
            self.count_depth(&selected)?;
            self.microstep(&selected);
            return Ok(true);
        }
        if let Some(event) = self.internal.pop_front() {
            // The event is taken off the queue before the count, so that the depth error
            // names it and the states that handle it.
            self.current = event;
            let selected = self.select(true);
            self.count_depth(&selected)?;
            self.records.push(Record::Event { name: self.current.name.clone(), internal: true });
            self.microstep(&selected);
            return Ok(true);
        }
        Ok(false)
    }

    fn unhandle(&mut self, event: Event) {
        self.unhandled = true;
        self.records.push(Record::Unhandled { name: event.name });
    }

    /// Counts one more microstep, about to take `selected` on the current event; over the
    /// bound, the error names the sources of `selected` (or, for an internal event nothing
    /// handles, those of the microstep before) and the current event.
    fn count_depth(&mut self, selected: &[usize]) -> Result<(), MacrostepError> {
        self.depth += 1;
        if self.depth > self.limits.max_transition_depth {
            let sources = if selected.is_empty() { &self.last_sources } else { selected };
            let mut states: Vec<&str> = Vec::new();
            for &t in sources {
                let path = self.def.path(self.def.transitions[t].source);
                if !states.contains(&path) {
                    states.push(path);
                }
            }
            return Err(MacrostepError::MaxTransitionDepthExceeded {
                limit: self.limits.max_transition_depth,
                state: states.join(", "),
                event: self.current.name.clone(),
            });
        }
        Ok(())
    }

    fn matches(&self, source: usize, trigger: &Trigger, with_event: bool) -> bool {
        let name = &self.current.name;
        let path = self.def.path(source);
        match trigger {
            Trigger::Always => !with_event,
            _ if !with_event => false,
            Trigger::Event(e) => e == name,
            Trigger::Done => {
                name.strip_prefix(DONE_STATE).or_else(|| name.strip_prefix(DONE_INVOKE))
                    == Some(path)
            }
            Trigger::Fail => {
                name.strip_prefix(FAIL_STATE).is_some_and(|failed| super::at_or_below(failed, path))
            }
            Trigger::Timeout => name.strip_prefix(TIMEOUT_INVOKE) == Some(path),
        }
    }

    /// SCXML `selectTransitions` / `selectEventlessTransitions`.
    ///
    /// A `fail.state.<path>` event is looked up from the failing state's own active
    /// leaves only (when it has any), so the innermost `@fail` on its ancestor chain wins:
    /// a leaf in a sibling region must not reach a parallel ancestor's `@fail` beside a
    /// handler the failing region has itself.
    fn select(&self, with_event: bool) -> Vec<usize> {
        let mut enabled: Vec<usize> = Vec::new();
        let atomic: Vec<usize> = self
            .config
            .iter()
            .copied()
            .filter(|&s| self.def.states[s].children.is_empty())
            .collect();
        let failing = with_event
            .then(|| self.current.name.strip_prefix(FAIL_STATE))
            .flatten()
            .map(|failed| {
                atomic
                    .iter()
                    .copied()
                    .filter(|&leaf| super::at_or_below(self.def.path(leaf), failed))
                    .collect::<Vec<_>>()
            })
            .filter(|below| !below.is_empty());
        for leaf in failing.unwrap_or(atomic) {
            let mut state = Some(leaf);
            'states: while let Some(s) = state {
                for &t in &self.def.states[s].transitions {
                    let tr = &self.def.transitions[t];
                    if self.matches(s, &tr.trigger, with_event)
                        && tr
                            .guards
                            .iter()
                            .all(|g| self.def.evaluate_guard(g, &self.context, &self.current))
                    {
                        if !enabled.contains(&t) {
                            enabled.push(t);
                        }
                        break 'states;
                    }
                }
                state = self.def.parent(s);
            }
        }
        self.remove_conflicts(enabled)
    }

    fn remove_conflicts(&self, enabled: Vec<usize>) -> Vec<usize> {
        let mut filtered: Vec<usize> = Vec::new();
        for t1 in enabled {
            let exit1 = self.exit_set(&[t1]);
            let mut preempted = false;
            let mut remove = Vec::new();
            for &t2 in &filtered {
                if !exit1.is_disjoint(&self.exit_set(&[t2])) {
                    if self.def.is_descendant(
                        self.def.transitions[t1].source,
                        self.def.transitions[t2].source,
                    ) {
                        remove.push(t2);
                    } else {
                        preempted = true;
                        break;
                    }
                }
            }
            if !preempted {
                filtered.retain(|t| !remove.contains(t));
                filtered.push(t1);
            }
        }
        filtered
    }

    fn exit_set(&self, transitions: &[usize]) -> BTreeSet<usize> {
        let mut set = BTreeSet::new();
        for &t in transitions {
            if let Some(domain) = self.domain(t) {
                set.extend(
                    self.config.iter().copied().filter(|&s| self.def.is_descendant(s, domain)),
                );
            }
        }
        set
    }

    /// SCXML `getTransitionDomain`.
    fn domain(&self, t: usize) -> Option<usize> {
        let tr = &self.def.transitions[t];
        let targets = self.effective_targets(t);
        if targets.is_empty() {
            return None;
        }
        if tr.internal
            && self.def.kind(tr.source) == StateKind::Compound
            && targets.iter().all(|&s| self.def.is_descendant(s, tr.source))
        {
            return Some(tr.source);
        }
        Some(self.lcca(tr.source, &targets))
    }

    /// SCXML `getEffectiveTargetStates`: the targets with each history pseudo-state replaced
    /// by what it recorded, or by its default when nothing is recorded.
    fn effective_targets(&self, t: usize) -> Vec<usize> {
        let mut out = Vec::new();
        for &target in &self.def.transitions[t].targets {
            let states = match target {
                TargetRef::State(s) => vec![s],
                TargetRef::History(h) => self
                    .history
                    .get(&h)
                    .cloned()
                    .unwrap_or_else(|| self.def.histories[h].default.clone()),
            };
            for s in states {
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
        out
    }

    /// SCXML `findLCCA`: the innermost compound proper ancestor of `a` that contains every
    /// state of `b` (the root always qualifies).
    fn lcca(&self, a: usize, b: &[usize]) -> usize {
        let mut anc = self.def.parent(a);
        while let Some(s) = anc {
            if (s == 0 || self.def.kind(s) == StateKind::Compound)
                && b.iter().all(|&x| self.def.is_descendant(x, s))
            {
                return s;
            }
            anc = self.def.parent(s);
        }
        0
    }

    /// Records, for every history pseudo-state of a state about to be exited, what the
    /// state holds now: its active children (shallow) or active atomic descendants (deep).
    fn record_history(&mut self, exits: &BTreeSet<usize>) {
        for (h, node) in self.def.histories.iter().enumerate() {
            if !exits.contains(&node.parent) {
                continue;
            }
            let recorded: Vec<usize> = self
                .config
                .iter()
                .copied()
                .filter(|&s| match node.depth {
                    HistoryDepth::Shallow => self.def.parent(s) == Some(node.parent),
                    HistoryDepth::Deep => {
                        self.def.states[s].children.is_empty()
                            && self.def.is_descendant(s, node.parent)
                    }
                })
                .collect();
            if self.history.get(&h) != Some(&recorded) {
                self.history.insert(h, recorded);
                self.history_changed = true;
            }
        }
    }

    fn microstep(&mut self, transitions: &[usize]) {
        if !transitions.is_empty() {
            self.last_sources.clear();
            self.last_sources.extend_from_slice(transitions);
        }
        for &t in transitions {
            let tr = &self.def.transitions[t];
            let event =
                if tr.trigger == Trigger::Always { None } else { Some(self.current.name.clone()) };
            self.ops.push_back(Op::Record(Record::Transition {
                source: self.def.path(tr.source).to_owned(),
                event,
                target: self.written_targets(t),
            }));
        }
        let exits = self.exit_set(transitions);
        // A planned dispatch whose parallel state this microstep exits is over: a re-entry
        // plans its own (otherwise both would go out and run the entry actions twice).
        // States of a region this microstep exits leave its dispatch: entered again, they
        // run their entry inline; the region's states that stay keep their dispatched
        // entry, so it still runs once, and a dispatch left with no entry action is over.
        let def = self.def;
        self.dispatches.retain_mut(|(p, _, entered, _)| {
            if exits.contains(p) {
                return false;
            }
            entered.retain(|x| !exits.contains(x));
            entered.iter().any(|&x| !def.states[x].entry.is_empty())
        });
        self.record_history(&exits);
        for &s in exits.iter().rev() {
            let node = &self.def.states[s];
            self.ops.push_back(Op::Record(Record::Exit { state: node.path.clone() }));
            for a in &node.exit {
                self.ops.push_back(self.action(a, s, ActionPhase::Exit));
            }
            self.config.remove(&s);
        }
        for &t in transitions {
            let tr = &self.def.transitions[t];
            for a in &tr.actions {
                self.ops.push_back(self.action(a, tr.source, ActionPhase::Transition));
            }
        }
        // Every target's descendants go in before any target's ancestors, so that an
        // ancestor parallel state fills with defaults only the regions no target covers.
        let mut set = BTreeSet::new();
        let targets: Vec<(Vec<usize>, Option<usize>)> =
            transitions.iter().map(|&t| (self.effective_targets(t), self.domain(t))).collect();
        for (states, _) in &targets {
            for &s in states {
                self.add_descendants(s, &mut set);
            }
        }
        for (states, domain) in &targets {
            for &s in states {
                self.add_ancestors(s, *domain, &mut set);
            }
        }
        self.enter(&set);
        // A state the same microstep exits and enters again (a self-transition) was never
        // left; one that stays out after the microstep was, even if a later microstep of
        // this macrostep comes back to it.
        for s in exits {
            if !self.config.contains(&s) {
                self.left.insert(s);
            }
            self.exited.insert(s);
        }
    }

    /// The targets of transition `t` as paths (history pseudo-states by their own path),
    /// space-separated when there are several.
    fn written_targets(&self, t: usize) -> Option<String> {
        let paths: Vec<&str> = self.def.transitions[t]
            .targets
            .iter()
            .map(|&target| match target {
                TargetRef::State(s) => self.def.path(s),
                TargetRef::History(h) => self.def.histories[h].path.as_str(),
            })
            .collect();
        (!paths.is_empty()).then(|| paths.join(" "))
    }

    fn action(&self, name: &str, state: usize, phase: ActionPhase) -> Op {
        if let Some(event) = name.strip_prefix(RAISE_ACTION_PREFIX) {
            return Op::Raise(Event::new(event));
        }
        Op::Action(ActionRequest {
            name: name.to_owned(),
            event: self.current.clone(),
            state: self.def.path(state).to_owned(),
            phase,
        })
    }

    /// SCXML `enterStates` (without history and donedata): parents first, `done.state.*`
    /// queued right after the final state's entry actions — for the final state's parent,
    /// then for each enclosing parallel state that is now complete (a parallel region
    /// finishing completes the parallel states above it, not only its own).
    fn enter(&mut self, set: &BTreeSet<usize>) {
        for &s in set {
            if s == 0 || !self.config.insert(s) {
                continue;
            }
            // A parallel state inside a region already planned for dispatch is that
            // region task's work (its regions' entry actions with it), not a dispatch of
            // its own: otherwise those entry actions would run twice.
            if self.dispatch
                && self.def.kind(s) == StateKind::Parallel
                && !self.skip_entry.contains(&s)
            {
                self.plan_dispatch(s, set);
            }
            let node = &self.def.states[s];
            self.ops.push_back(Op::Record(Record::Enter { state: node.path.clone() }));
            if !self.skip_entry.remove(&s) {
                for a in &node.entry {
                    self.ops.push_back(self.action(a, s, ActionPhase::Entry));
                }
            }
            if node.kind != StateKind::Final {
                continue;
            }
            let parent = node.parent.unwrap_or(0);
            if parent == 0 {
                self.running = false;
                continue;
            }
            self.ops.push_back(Op::Raise(Event::done_state(self.def.path(parent))));
            // A parallel ancestor whose regions are now all final is done too, and so on up
            // through parallel states used as regions of a parallel state: a nested
            // parallel region finishing last completes the outer one. The walk climbs the
            // ancestors, so it ends.
            let mut up = self.def.parent(parent);
            while let Some(p) = up
                && p != 0
                && self.def.kind(p) == StateKind::Parallel
                && self.in_final_state(p)
            {
                self.ops.push_back(Op::Raise(Event::done_state(self.def.path(p))));
                up = self.def.parent(p);
            }
        }
    }

    /// Marks the regions of parallel state `p` whose states in `set` have entry actions for
    /// dispatch, when there are at least two of them (one region gains nothing).
    ///
    /// A region task runs entry actions the macrostep skipped, and a region that moved on
    /// before the macrostep ended is not dispatched, so a region that may move on without
    /// an event keeps its entry actions inline: one entering a state with `@always` or a
    /// final state (which raises `done.state`). Nothing is dispatched when `p` or one of its
    /// ancestors has `@always` (the whole parallel state may be left at once).
    fn plan_dispatch(&mut self, p: usize, set: &BTreeSet<usize>) {
        if eventless_at_or_above(self.def, p) {
            return;
        }
        let regions: Vec<(usize, Vec<usize>)> = self.def.states[p]
            .children
            .iter()
            .map(|&r| {
                let entered: Vec<usize> = set
                    .iter()
                    .copied()
                    .filter(|&x| {
                        (x == r || self.def.is_descendant(x, r)) && !self.config.contains(&x)
                    })
                    .collect();
                (r, entered)
            })
            .filter(|(_, entered)| region_dispatches(self.def, entered))
            .collect();
        if regions.len() < 2 {
            return;
        }
        for (region, entered) in regions {
            self.skip_entry.extend(entered.iter().copied());
            self.dispatches.push((p, region, entered, self.current.clone()));
        }
    }

    /// The planned dispatches whose region is still exactly where it was entered.
    fn regions_to_dispatch(&self) -> Vec<RegionDispatch> {
        self.dispatches
            .iter()
            .filter(|(p, _, entered, _)| {
                self.config.contains(p) && entered.iter().all(|x| self.config.contains(x))
            })
            .map(|(p, r, entered, event)| RegionDispatch {
                parallel_state: self.def.path(*p).to_owned(),
                region: self.def.path(*r).to_owned(),
                entered: entered.iter().map(|&x| self.def.path(x).to_owned()).collect(),
                event: event.clone(),
            })
            .collect()
    }

    fn in_final_state(&self, s: usize) -> bool {
        let node = &self.def.states[s];
        match node.kind {
            StateKind::Compound => node
                .children
                .iter()
                .any(|&c| self.def.kind(c) == StateKind::Final && self.config.contains(&c)),
            StateKind::Parallel => node.children.iter().all(|&c| self.in_final_state(c)),
            _ => false,
        }
    }

    fn add_descendants(&self, s: usize, set: &mut BTreeSet<usize>) {
        add_descendants(self.def, s, set);
    }

    fn add_ancestors(&self, s: usize, upto: Option<usize>, set: &mut BTreeSet<usize>) {
        add_ancestors(self.def, s, upto, set);
    }

    fn finish(&mut self, error: Option<MacrostepError>) {
        self.pending = None;
        let result = if let Some(error) = error {
            let configuration = Configuration::from_ids(self.def, &self.start_ids);
            MacrostepResult {
                is_final: configuration.is_final(self.def),
                configuration,
                context: self.start_context.clone(),
                changed_keys: Vec::new(),
                records: std::mem::take(&mut self.records),
                internal_events: std::mem::take(&mut self.internal_events),
                unhandled: false,
                timers_to_arm: Vec::new(),
                timers_to_cancel: Vec::new(),
                children_to_start: Vec::new(),
                children_to_cancel: Vec::new(),
                regions_to_dispatch: Vec::new(),
                error: Some(error),
            }
        } else {
            if self.history_changed {
                let recorded: serde_json::Map<String, Value> = self
                    .history
                    .iter()
                    .map(|(&h, states)| {
                        let paths = states.iter().map(|&s| self.def.path(s)).collect::<Vec<_>>();
                        (self.def.histories[h].path.clone(), Value::from(paths))
                    })
                    .collect();
                self.context.set(HISTORY_CONTEXT_KEY, Value::Object(recorded));
            }
            let configuration = Configuration::from_ids(self.def, &self.config);
            let (timers_to_arm, timers_to_cancel, children_to_start, children_to_cancel) =
                self.effects();
            MacrostepResult {
                is_final: configuration.is_final(self.def),
                configuration,
                context: self.context.to_value(),
                changed_keys: self.context.changed_keys().map(str::to_owned).collect(),
                records: std::mem::take(&mut self.records),
                internal_events: std::mem::take(&mut self.internal_events),
                unhandled: self.unhandled,
                timers_to_arm,
                timers_to_cancel,
                children_to_start,
                children_to_cancel,
                regions_to_dispatch: self.regions_to_dispatch(),
                error: None,
            }
        };
        self.done = Some(Box::new(result));
    }

    /// Timers belong to state entries. A state active afterwards arms its timers when it was
    /// not active before, or when it was renewed: left for another state during the
    /// macrostep and come back (a transit state with `@always`: the deadline counts from
    /// this entry), or exited and entered again while processing the end of its own child
    /// machine or its own `@timeout` (a retry: the new child gets a fresh `@timeout`). A
    /// renewed state's timers, and those of its descendants entered again with it, are
    /// cancelled and armed again.
    /// Otherwise a state exited and re-entered by one transition (a self-loop) keeps its
    /// timers' original anchors, except a timer whose own fire (or, for an `every` timer,
    /// whose `then`) the macrostep processes: that timer is gone, so it is armed again from
    /// this entry, and an `after` transition that targets its own state is a polling loop.
    ///
    /// Child machines follow the net change of the configuration, with one exception: a
    /// delegation state exited and entered again while processing the end of its own child
    /// or its own `@timeout` starts a new child, its timers armed afresh (that child is
    /// over, so there is nothing to keep: `@fail → same state` and `@timeout → same state`
    /// are retries). The timed-out child, still running, is cancelled in the same commit
    /// (the stores cancel only children that existed before the commit, never the one it
    /// starts). Any other re-entered delegation state (a self-loop on another event, a
    /// transit state) keeps its running child.
    fn effects(&self) -> (Vec<TimerArm>, Vec<TimerCancel>, Vec<ChildStart>, Vec<String>) {
        let (mut arm, mut cancel, mut start, mut stop) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let reentered = |s: &usize| {
            self.start_ids.contains(s) && self.config.contains(s) && self.exited.contains(s)
        };
        // A retried delegation state: its child is over (ended, or out of time), so it
        // starts a new one; a timed-out child still runs and is cancelled.
        let timed_out = |s: &usize| reentered(s) && self.own_timeout(*s);
        let retried = |s: &usize| reentered(s) && (self.ends_child(*s) || self.own_timeout(*s));
        // Parents first (the arena is in document order): a renewed state's timer cancel
        // covers its descendants, so every descendant re-entered with it is renewed too.
        let mut renewals = BTreeSet::new();
        for &s in &self.start_ids {
            let renew = self.left.contains(&s)
                || retried(&s)
                || reentered(&s) && self.def.parent(s).is_some_and(|p| renewals.contains(&p));
            if renew {
                renewals.insert(s);
            }
        }
        let renewed = |s: &usize| renewals.contains(s);
        for &s in &self.config {
            let entered = !self.start_ids.contains(&s);
            let node = &self.def.states[s];
            if entered || renewed(&s) {
                arm.extend(entry_timers(node));
            } else if reentered(&s) {
                arm.extend(self.spent_timers(s));
            }
            if let Some(d) = &node.delegation
                && (entered || retried(&s))
            {
                start.push(ChildStart { state: node.path.clone(), machine: d.machine.clone() });
            }
        }
        for &s in &self.start_ids {
            let gone = !self.config.contains(&s);
            if !gone && !renewed(&s) {
                continue;
            }
            let node = &self.def.states[s];
            let timed = node.on.iter().any(|t| t.timer.is_some())
                || node.delegation.as_ref().is_some_and(|d| d.timeout.is_some());
            if timed {
                cancel.push(TimerCancel { state: node.path.clone() });
            }
            if (gone || timed_out(&s)) && node.delegation.is_some() {
                stop.push(node.path.clone());
            }
        }
        (arm, cancel, start, stop)
    }

    /// The timers of state `s` the external event used up: it is the fire of one of them
    /// (its payload names `s` as the owner, as every fire's does), and that timer is an
    /// `after` one (its fire deleted it), or it is the `then` of an `every` one (delivered
    /// once, after the last fire). An event of the same name sent by anyone else uses up
    /// nothing.
    fn spent_timers(&self, s: usize) -> Vec<TimerArm> {
        let node = &self.def.states[s];
        let Some(event) = &self.trigger else { return Vec::new() };
        if event.payload.get("state").and_then(Value::as_str) != Some(node.path.as_str()) {
            return Vec::new();
        }
        entry_timers(node)
            .into_iter()
            .filter(|t| {
                (t.kind == TimerKind::After && t.event == event.name)
                    || t.then.as_deref() == Some(event.name.as_str())
            })
            .collect()
    }

    /// Whether the external event is the fire of delegation state `s`'s own `@timeout`
    /// (its payload names `s`, as every fire's does).
    fn own_timeout(&self, s: usize) -> bool {
        let node = &self.def.states[s];
        let Some(event) = &self.trigger else { return false };
        node.delegation.as_ref().is_some_and(|d| d.timeout.is_some())
            && event.name == Event::timeout_invoke(&node.path).name
            && event.payload.get("state").and_then(Value::as_str) == Some(node.path.as_str())
    }

    /// Whether the external event reports the end of delegation state `s`'s child:
    /// `done.invoke.<s>`, or a `fail.state.<s>` naming a child (a failed region or a region
    /// timeout is reported under a parallel state's name too, without one).
    fn ends_child(&self, s: usize) -> bool {
        let node = &self.def.states[s];
        let Some(event) = &self.trigger else { return false };
        if node.delegation.is_none() {
            return false;
        }
        if event.name.strip_prefix(DONE_INVOKE) == Some(node.path.as_str()) {
            return true;
        }
        event.name.strip_prefix(FAIL_STATE) == Some(node.path.as_str())
            && event.payload.get("child").is_some()
    }
}

/// The context as an object (`null` becomes `{}`), or the error for any other JSON type.
fn object_context(context: Value) -> (Value, Option<MacrostepError>) {
    let found = match &context {
        Value::Null => return (Value::Object(serde_json::Map::new()), None),
        Value::Object(_) => return (context, None),
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
    };
    let error = MacrostepError::ContextNotObject { found: found.to_owned() };
    (context, Some(error))
}

/// Runs a macrostep to completion with a synchronous action runner: handy for tests and for
/// charts whose actions are pure. `run(request, context)` returns the action's result.
pub fn run_to_completion(
    mut step: Macrostep<'_>,
    mut run: impl FnMut(&ActionRequest, &ChartContext) -> Result<ActionResult, ActionError>,
) -> MacrostepResult {
    loop {
        match step.poll() {
            Next::RunAction(request) => {
                let result = run(&request, step.context());
                step.handle_action_result(result);
            }
            Next::Done(result) => return *result,
        }
    }
}

/// Whether `s` or one of its ancestors has `@always`: a parallel state there is never
/// dispatched, since the whole of it may be left at once.
pub(super) fn eventless_at_or_above(def: &Definition, s: usize) -> bool {
    std::iter::successors(Some(s), |&x| def.parent(x)).any(|x| !def.states[x].always.is_empty())
}

/// Whether a region whose newly entered states are `entered` is one a region task takes:
/// it has entry work, and it cannot move on by itself within the step (no state with
/// `@always`, no final state, which raises `done.state`).
pub(super) fn region_dispatches(def: &Definition, entered: &[usize]) -> bool {
    entered.iter().any(|&x| !def.states[x].entry.is_empty())
        && !entered
            .iter()
            .any(|&x| !def.states[x].always.is_empty() || def.kind(x) == StateKind::Final)
}

/// Adds `s` to `set` with what entering it enters below it: a compound state's initial
/// state, every region of a parallel state that `set` holds nothing of yet, and so on
/// down.
pub(super) fn add_descendants(def: &Definition, s: usize, set: &mut BTreeSet<usize>) {
    set.insert(s);
    let node = &def.states[s];
    match node.kind {
        StateKind::Compound => {
            if let Some(initial) = node.initial {
                add_descendants(def, initial, set);
            }
        }
        StateKind::Parallel => {
            for &child in &node.children {
                if !set.iter().any(|&x| def.is_descendant(x, child)) {
                    add_descendants(def, child, set);
                }
            }
        }
        _ => {}
    }
}

/// Adds the ancestors of `s` up to (not including) `upto` to `set`, with the regions of
/// each parallel ancestor that `set` holds nothing of yet ([`add_descendants`]).
pub(super) fn add_ancestors(
    def: &Definition,
    s: usize,
    upto: Option<usize>,
    set: &mut BTreeSet<usize>,
) {
    let mut anc = def.parent(s);
    while let Some(a) = anc {
        if Some(a) == upto {
            break;
        }
        set.insert(a);
        if def.kind(a) == StateKind::Parallel {
            for &child in &def.states[a].children {
                if !set.iter().any(|&x| x == child || def.is_descendant(x, child)) {
                    add_descendants(def, child, set);
                }
            }
        }
        anc = def.parent(a);
    }
}
