//! Build-time validation: turns a [`ChartBuilder`] into a [`Definition`] or a list of errors
//! that each name the state path and the fix.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::definition::{
    Branch, ChartBuilder, Definition, Delegation, HistoryNode, RawTimer, StateBuilder, StateKind,
    StateNode, TargetRef, Transition, TransitionDef, Trigger,
};
use super::timer::{Timer, TimerKind, TimerSpec};
use crate::limits;

/// A definition error. Every message names the state (by dotted path, `(root)` for the top
/// level) and says how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChartError {
    /// The version does not fit the stores' 32-bit signed version column.
    #[error(
        "(root): chart `{chart}` version {version} is more than 2147483647, the largest version a store holds; fix: number versions from 1 upwards"
    )]
    VersionTooLarge {
        /// The chart's name.
        chart: String,
        /// The version as written.
        version: u32,
    },
    /// A transition targets a state that does not exist.
    #[error(
        "state `{state}`: transition on `{trigger}` targets unknown state `{target}`; fix: use the key of a sibling or ancestor's sibling, `.child` for a child, or a full dotted path"
    )]
    UnknownTarget {
        /// Source state path.
        state: String,
        /// Event name or `@always` / `@done` / `@fail` / `@timeout`.
        trigger: String,
        /// The target as written.
        target: String,
    },
    /// A compound state has no `initial`.
    #[error(
        "compound state `{state}` has no initial state; fix: call `.initial(\"<child key>\")` on it"
    )]
    MissingInitial {
        /// State path.
        state: String,
    },
    /// `initial` names a state that is not a child.
    #[error(
        "state `{state}`: initial `{initial}` is not one of its children ({children}); fix: name a direct child"
    )]
    UnknownInitial {
        /// State path.
        state: String,
        /// The initial key as written.
        initial: String,
        /// The children's keys, comma separated.
        children: String,
    },
    /// `initial` on a state that has no child to start in: an atomic or final state.
    #[error(
        "state `{state}` names initial `{initial}` but has no child states, so there is nothing to start in; fix: add the child states (the state becomes compound), or drop `initial`"
    )]
    InitialWithoutChildren {
        /// State path.
        state: String,
        /// The initial key as written.
        initial: String,
    },
    /// `initial` on a parallel state, which enters every region.
    #[error(
        "parallel state `{state}` names initial `{initial}`, but a parallel state enters all of its regions at once; fix: drop `initial`"
    )]
    InitialOnParallel {
        /// State path.
        state: String,
        /// The initial key as written.
        initial: String,
    },
    /// `max` given without `every`.
    #[error(
        "state `{state}`: transition on `{event}` has `max` but no `every` timer; fix: add `.every(Timer::…)` or drop `max`"
    )]
    MaxWithoutEvery {
        /// State path.
        state: String,
        /// Event name.
        event: String,
    },
    /// `keep_armed` given without a timer.
    #[error(
        "state `{state}`: transition on `{event}` has `keep_armed` but no timer; fix: add `.after(Timer::…)` / `.every(Timer::…)` or drop `keep_armed`"
    )]
    KeepArmedWithoutTimer {
        /// State path.
        state: String,
        /// Event name.
        event: String,
    },
    /// `then` given without `max`.
    #[error(
        "state `{state}`: transition on `{event}` has `then` but no `max`; fix: add `.max(n)` so `then` knows when to fire"
    )]
    ThenWithoutMax {
        /// State path.
        state: String,
        /// Event name.
        event: String,
    },
    /// `then` names an event no state handles.
    #[error(
        "state `{state}`: transition on `{event}` has `then` event `{then}`, which no state has a transition for; fix: add `.on(\"{then}\", …)` where it should be handled or correct the name"
    )]
    ThenUnknownEvent {
        /// State path.
        state: String,
        /// Event name.
        event: String,
        /// The `then` event as written.
        then: String,
    },
    /// Both `after` and `every` on one transition.
    #[error(
        "state `{state}`: transition on `{event}` has both `after` and `every`; fix: keep one timer per event"
    )]
    ConflictingTimers {
        /// State path.
        state: String,
        /// Event name.
        event: String,
    },
    /// Two timed transitions on one event in one state: a fire is only the event (taken by
    /// whichever transition on it is enabled), and retimes and `keep_armed` find timers by
    /// their event, so a state has one timer per event.
    #[error(
        "state `{state}`: two transitions on `{event}` have timers, but a state has one timer per event: a fire is only the event, taken by whichever transition on it is enabled, and a deploy's new durations and `keep_armed` find timers by their event; fix: put both branches under one `on` with one timer, or use distinct events"
    )]
    DuplicateTimedEvent {
        /// State path.
        state: String,
        /// Event name.
        event: String,
    },
    /// A non-positive timer duration.
    #[error(
        "state `{state}`: timer on `{event}` is `{timer}`, which is not positive (InvalidTimerDefinition); fix: use a duration of at least 1 unit"
    )]
    InvalidTimerDefinition {
        /// State path.
        state: String,
        /// Event name (or `@timeout`).
        event: String,
        /// The timer as written.
        timer: String,
    },
    /// A timer longer than [`limits::TIMER_INTERVAL_MAX`] (or too long to compute at all).
    #[error(
        "state `{state}`: timer on `{event}` is `{timer}`, which is longer than the limit of {max_days} days (InvalidTimerDefinition); fix: use a shorter timer, or park on a signal"
    )]
    TimerTooLong {
        /// State path.
        state: String,
        /// Event name (or `@timeout`).
        event: String,
        /// The timer as written.
        timer: String,
        /// The limit, in days.
        max_days: u64,
    },
    /// `max(0)` on an `every` timer.
    #[error(
        "state `{state}`: transition on `{event}` has `max(0)`, so its timer would never fire; fix: use `.max(n)` with n >= 1, or drop `max`"
    )]
    MaxZero {
        /// State path.
        state: String,
        /// Event name.
        event: String,
    },
    /// Two states with the same path (siblings with the same key).
    #[error("duplicate state id `{state}`; fix: give sibling states distinct keys")]
    DuplicateStateId {
        /// The duplicated path.
        state: String,
    },
    /// A state key that is empty or contains a dot or a NUL character.
    #[error(
        "state key `{key}` under `{state}` is invalid; fix: use a non-empty key without `.` \
         or NUL characters"
    )]
    InvalidStateKey {
        /// Parent state path.
        state: String,
        /// The key as written.
        key: String,
    },
    /// A final state with outgoing transitions.
    #[error(
        "final state `{state}` has outgoing transitions; fix: remove them or make it a normal state"
    )]
    FinalWithTransitions {
        /// State path.
        state: String,
    },
    /// A final state with children.
    #[error(
        "final state `{state}` has child states; fix: make it a compound state with a final child"
    )]
    FinalWithChildren {
        /// State path.
        state: String,
    },
    /// A final state that delegates to a child machine (`machine`, its `@timeout`): the
    /// step that enters it ends the chart, so the child would start under a finished parent.
    #[error(
        "final state `{state}` delegates to a child machine; fix: delegate from a normal state and go to the final state on its `@done`"
    )]
    FinalWithMachine {
        /// State path.
        state: String,
    },
    /// A parallel state with fewer than two regions.
    #[error(
        "parallel state `{state}` has {regions} region(s); fix: give it at least two regions or make it a compound state"
    )]
    ParallelTooFewRegions {
        /// State path.
        state: String,
        /// The number of regions.
        regions: usize,
    },
    /// A final state directly under a parallel state, as one of its regions.
    #[error(
        "parallel state `{state}` has final state `{region}` as a region; fix: wrap it in a compound region with an initial state, so the region is done when it reaches its final child"
    )]
    FinalRegion {
        /// The parallel state's path.
        state: String,
        /// The final child's path.
        region: String,
    },
    /// A transition with several targets that cannot all be active at once: two of them are
    /// the same state or one contains the other, or they share a region.
    #[error(
        "state `{state}`: transition on `{trigger}` targets `{targets}`, which cannot all be active at once: {conflict}; fix: targets of one transition must lie in different regions of one parallel state, so name one state per region or keep a single target"
    )]
    ConflictingTargets {
        /// Source state path.
        state: String,
        /// Event name or `@always` / `@done` / `@fail` / `@timeout`.
        trigger: String,
        /// The targets as written, space separated.
        targets: String,
        /// Which two targets clash, and why.
        conflict: String,
    },
    /// A guard name with no registered guard.
    #[error(
        "state `{state}`: transition on `{trigger}` uses unknown guard `{guard}`; fix: register it with `ChartBuilder::guard(\"{guard}\", …)`"
    )]
    UnknownGuard {
        /// State path.
        state: String,
        /// Event name or `@always` / `@done` / `@fail` / `@timeout`.
        trigger: String,
        /// The guard name.
        guard: String,
    },
    /// `@timeout` on a state that does not delegate to a child machine.
    #[error(
        "state `{state}` has `@timeout` but no child machine; fix: add `.machine(\"<name>\")` or use an `after` timer"
    )]
    TimeoutWithoutMachine {
        /// State path.
        state: String,
    },
    /// A state with `@done` that nothing can ever make done: no child machine reports to
    /// it and no final state completes it.
    #[error(
        "state `{state}` has `@done`, which can never fire: {reason}; fix: give it a final child and a transition into it (every region of a parallel state needs one), or delegate it to a child machine with `.machine(\"<name>\")` (JSON: `\"machine\"`)"
    )]
    DoneNeverFires {
        /// State path.
        state: String,
        /// Why it is never done.
        reason: String,
    },
    /// An `on` event named like one of the triggers Keel generates (`@done`, `@fail`,
    /// `@timeout`, `@always`), which an `on` entry never receives. Other names starting
    /// with `@` are ordinary signal names.
    #[error(
        "state `{state}`: transition on `{event}` can never fire: `{event}` is one of Keel's own triggers (`@done`, `@always`, `@fail`, `@timeout`), which no `on` entry receives; fix: {fix}"
    )]
    ReservedEventName {
        /// State path.
        state: String,
        /// The event as written.
        event: String,
        /// The builder call (and JSON key) that means what was written.
        fix: String,
    },
    /// A history pseudo-state that cannot work as written.
    #[error("state `{state}`: history `{history}` {problem}; fix: {fix}")]
    InvalidHistory {
        /// The parent state's path.
        state: String,
        /// The history's key.
        history: String,
        /// What is wrong.
        problem: String,
        /// How to fix it.
        fix: String,
    },
}

/// A problem worth reporting that does not stop the build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ChartWarning {
    /// No transition or initial state can ever enter this state.
    #[error(
        "state `{state}` is unreachable: no initial state or transition leads to it; fix: add a transition targeting it or remove it"
    )]
    UnreachableState {
        /// State path.
        state: String,
    },
    /// A state has transitions (guarded or not) on a trigger after one without a guard on
    /// it: the unguarded one is always taken first, so the later ones can never run.
    #[error(
        "state `{state}`: {count} transition(s) on `{trigger}` come after one without a guard, which is always taken first, so they can never be taken; fix: move the unguarded transition last (as the fallback), give it a guard, or remove the transitions after it"
    )]
    ShadowedTransition {
        /// State path.
        state: String,
        /// Event name or `@always` / `@done` / `@fail` / `@timeout`.
        trigger: String,
        /// How many transitions on the trigger come after its first unguarded one.
        count: usize,
    },
    /// A transition from one region of a parallel state to a state in a sibling region:
    /// its domain is outside the parallel state, so it exits and re-enters all of it.
    #[error(
        "state `{state}`: transition on `{trigger}` targets `{target}` in another region of parallel state `{parallel}`, so it exits and re-enters all of `{parallel}`: every region restarts at its initial state, and the entry actions and timers of `{parallel}` run again; fix: to move only the region of `{target}`, raise an event one of its states handles, or target `{parallel}` itself if a restart is meant"
    )]
    CrossRegionTarget {
        /// Source state path.
        state: String,
        /// Event name or `@always` / `@done` / `@fail` / `@timeout`.
        trigger: String,
        /// The target's path.
        target: String,
        /// The parallel state both lie in.
        parallel: String,
    },
}

/// All errors found while building a definition, in document order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors {
    /// The errors.
    pub errors: Vec<ChartError>,
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "invalid chart definition ({} error(s)):", self.errors.len())?;
        for e in &self.errors {
            writeln!(f, "  - {e}")?;
        }
        Ok(())
    }
}

fn display(path: &str) -> String {
    if path.is_empty() { "(root)".to_owned() } else { path.to_owned() }
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() { key.to_owned() } else { format!("{parent}.{key}") }
}

struct Flat<'a> {
    states: Vec<StateNode>,
    builders: Vec<&'a StateBuilder>,
    by_path: BTreeMap<String, usize>,
    history_by_path: BTreeMap<String, usize>,
    histories: Vec<HistoryNode>,
    /// The history pseudo-states as written, in the order of `histories`.
    history_written: Vec<super::definition::HistoryDef>,
    errors: Vec<ChartError>,
}

/// Whether `key` may name a state: not empty, no `.` (it separates a path's keys) and no
/// NUL (a chart's position is the JSON array of its active paths, and PostgreSQL refuses
/// a NUL in JSON text).
fn valid_key(key: &str) -> bool {
    !key.is_empty() && !key.contains('.') && !key.contains('\0')
}

impl<'a> Flat<'a> {
    fn push(&mut self, b: &'a StateBuilder, parent: Option<usize>) -> usize {
        let path = match parent {
            Some(p) => join(&self.states[p].path, &b.key),
            None => String::new(),
        };
        if let Some(p) = parent
            && !valid_key(&b.key)
        {
            self.errors.push(ChartError::InvalidStateKey {
                state: display(&self.states[p].path),
                key: b.key.clone(),
            });
        }
        let id = self.states.len();
        if self.by_path.contains_key(&path) {
            self.errors.push(ChartError::DuplicateStateId { state: display(&path) });
        } else {
            self.by_path.insert(path.clone(), id);
        }
        self.states.push(StateNode {
            key: b.key.clone(),
            path,
            kind: b.kind,
            entry: b.entry.clone(),
            exit: b.exit.clone(),
            on: Vec::new(),
            always: b.always.clone(),
            on_done: b.on_done.clone(),
            on_fail: b.on_fail.clone(),
            on_timeout: b.on_timeout.clone(),
            delegation: b.machine.clone().map(|machine| Delegation { machine, timeout: b.timeout }),
            history: b.history.clone(),
            parent,
            children: Vec::new(),
            initial: None,
            transitions: Vec::new(),
        });
        self.builders.push(b);
        for child in &b.children {
            let c = self.push(child, Some(id));
            self.states[id].children.push(c);
        }
        for h in &b.history {
            let path = join(&self.states[id].path, &h.key);
            if !valid_key(&h.key) {
                self.errors.push(ChartError::InvalidStateKey {
                    state: display(&self.states[id].path),
                    key: h.key.clone(),
                });
            }
            if self.by_path.contains_key(&path) || self.history_by_path.contains_key(&path) {
                self.errors.push(ChartError::DuplicateStateId { state: display(&path) });
                continue;
            }
            self.history_by_path.insert(path.clone(), self.histories.len());
            self.history_written.push(h.clone());
            self.histories.push(HistoryNode {
                parent: id,
                path,
                depth: h.depth,
                default: Vec::new(),
            });
        }
        id
    }
}

pub(crate) fn build(builder: ChartBuilder) -> Result<Definition, ValidationErrors> {
    let def = build_unchecked(builder)?;
    // In keel-core's own tests, and in any test build that turns the feature on, every chart
    // that builds must survive a JSON round trip unchanged: that way each chart a test writes
    // in Rust also proves the JSON form complete.
    #[cfg(any(test, feature = "json-round-trip-check"))]
    super::json::assert_round_trip(&def);
    Ok(def)
}

/// Validates and builds without the round-trip check (which itself builds).
pub(crate) fn build_unchecked(builder: ChartBuilder) -> Result<Definition, ValidationErrors> {
    let mut flat = Flat {
        states: Vec::new(),
        builders: Vec::new(),
        by_path: BTreeMap::new(),
        history_by_path: BTreeMap::new(),
        histories: Vec::new(),
        history_written: Vec::new(),
        errors: Vec::new(),
    };
    flat.push(&builder.root, None);
    if i32::try_from(builder.version).is_err() {
        flat.errors.push(ChartError::VersionTooLarge {
            chart: builder.name.clone(),
            version: builder.version,
        });
    }
    let alphabet: BTreeSet<&str> =
        flat.builders.iter().flat_map(|b| b.on.iter().map(|(e, _, _)| e.as_str())).collect();
    let mut transitions = Vec::new();
    for id in 0..flat.states.len() {
        check_structure(&mut flat, id);
        let on = check_timers(&mut flat, id, &alphabet);
        flat.states[id].on = on;
        let ids = flatten_transitions(&mut flat, id, &builder, &mut transitions);
        flat.states[id].transitions = ids;
    }
    for h in 0..flat.histories.len() {
        check_history(&mut flat, h);
    }
    if !flat.errors.is_empty() {
        return Err(ValidationErrors { errors: flat.errors });
    }
    let mut def = Definition {
        name: builder.name,
        version: builder.version,
        states: flat.states,
        transitions,
        guards: builder.guards,
        by_path: flat.by_path,
        histories: flat.histories,
        warnings: Vec::new(),
    };
    def.warnings = unreachable(&def);
    def.warnings.extend(shadowed(&def));
    def.warnings.extend(cross_region(&def));
    Ok(def)
}

/// Transitions from one region of a parallel state into a sibling region, in document
/// order. The transition's domain is the nearest compound ancestor of both, which is
/// outside the parallel state, so the whole parallel state is exited and entered again.
fn cross_region(def: &Definition) -> Vec<ChartWarning> {
    let mut out = Vec::new();
    for t in &def.transitions {
        for &target in &t.targets {
            let (anchor, written) = match target {
                TargetRef::State(s) => (s, def.path(s).to_owned()),
                TargetRef::History(h) => (def.histories[h].parent, def.histories[h].path.clone()),
            };
            let src = t.source;
            if anchor == src || def.is_descendant(anchor, src) || def.is_descendant(src, anchor) {
                continue;
            }
            // The nearest state containing both (the root always does).
            let mut common = def.parent(src);
            while let Some(p) = common {
                if def.is_descendant(anchor, p) {
                    break;
                }
                common = def.parent(p);
            }
            if let Some(p) = common
                && def.kind(p) == StateKind::Parallel
            {
                out.push(ChartWarning::CrossRegionTarget {
                    state: display(def.path(src)),
                    trigger: trigger_label(&t.trigger),
                    target: written,
                    parallel: display(def.path(p)),
                });
            }
        }
    }
    out
}

/// Triggers of one state with transitions after the first unguarded one on them (which is
/// always taken, so the later ones, guarded or not, never are), in document order.
fn shadowed(def: &Definition) -> Vec<ChartWarning> {
    let mut out = Vec::new();
    for node in &def.states {
        // Per trigger, in order of its first unguarded transition: how many come after it.
        let mut counts: Vec<(&Trigger, usize)> = Vec::new();
        for &t in &node.transitions {
            let t = &def.transitions[t];
            match counts.iter_mut().find(|(trigger, _)| **trigger == t.trigger) {
                Some((_, n)) => *n += 1,
                None if t.guards.is_empty() => counts.push((&t.trigger, 0)),
                None => {}
            }
        }
        out.extend(counts.into_iter().filter(|(_, n)| *n > 0).map(|(trigger, count)| {
            ChartWarning::ShadowedTransition {
                state: display(&node.path),
                trigger: trigger_label(trigger),
                count,
            }
        }));
    }
    out
}

fn trigger_label(trigger: &Trigger) -> String {
    match trigger {
        Trigger::Event(e) => e.clone(),
        Trigger::Always => "@always".to_owned(),
        Trigger::Done => "@done".to_owned(),
        Trigger::Fail => "@fail".to_owned(),
        Trigger::Timeout => "@timeout".to_owned(),
    }
}

fn check_structure(flat: &mut Flat<'_>, id: usize) {
    let b = flat.builders[id];
    let path = display(&flat.states[id].path);
    match b.kind {
        StateKind::Compound => match &b.initial {
            None => flat.errors.push(ChartError::MissingInitial { state: path }),
            Some(initial) => {
                let found = flat.states[id]
                    .children
                    .iter()
                    .copied()
                    .find(|&c| flat.states[c].key == *initial);
                match found {
                    Some(c) => flat.states[id].initial = Some(c),
                    None => flat.errors.push(ChartError::UnknownInitial {
                        state: path,
                        initial: initial.clone(),
                        children: b
                            .children
                            .iter()
                            .map(|c| c.key.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    }),
                }
            }
        },
        StateKind::Parallel => {
            if let Some(initial) = &b.initial {
                flat.errors.push(ChartError::InitialOnParallel {
                    state: path.clone(),
                    initial: initial.clone(),
                });
            }
            if b.children.len() < 2 {
                flat.errors.push(ChartError::ParallelTooFewRegions {
                    state: path.clone(),
                    regions: b.children.len(),
                });
            }
            // A region must be able to be somewhere other than done: a final region would
            // be done on entry, so `done.state.<parallel>` would not wait for it.
            for i in 0..flat.states[id].children.len() {
                let c = flat.states[id].children[i];
                if flat.states[c].kind == StateKind::Final {
                    let region = display(&flat.states[c].path);
                    flat.errors.push(ChartError::FinalRegion { state: path.clone(), region });
                }
            }
        }
        StateKind::Final => {
            let has_transitions = !(b.on.is_empty()
                && b.always.is_empty()
                && b.on_done.is_empty()
                && b.on_fail.is_empty()
                && b.on_timeout.is_empty());
            if has_transitions {
                flat.errors.push(ChartError::FinalWithTransitions { state: path.clone() });
            }
            if b.machine.is_some() || b.timeout.is_some() {
                flat.errors.push(ChartError::FinalWithMachine { state: path.clone() });
            }
            if !b.children.is_empty() {
                flat.errors.push(ChartError::FinalWithChildren { state: path.clone() });
            }
            if let Some(initial) = &b.initial
                && b.children.is_empty()
            {
                flat.errors.push(ChartError::InitialWithoutChildren {
                    state: path,
                    initial: initial.clone(),
                });
            }
        }
        StateKind::Atomic => {
            if let Some(initial) = &b.initial {
                flat.errors.push(ChartError::InitialWithoutChildren {
                    state: path,
                    initial: initial.clone(),
                });
            }
        }
    }
    let b = flat.builders[id];
    if id != 0
        && !b.on_done.is_empty()
        && b.machine.is_none()
        && b.kind != StateKind::Final
        && let Some(reason) = never_done(flat, id)
    {
        flat.errors
            .push(ChartError::DoneNeverFires { state: display(&flat.states[id].path), reason });
    }
    for (event, _, _) in &b.on {
        // Only the four trigger names are Keel's: any other `@…` name is a signal name a
        // caller can send, and an `on` entry receives it.
        let fix = match event.as_str() {
            "@done" => "use `.on_done(…)` in Rust, or the state's `\"@done\"` key in JSON",
            "@always" => "use `.always(…)` in Rust, or the state's `\"@always\"` key in JSON",
            "@fail" => "use `.on_fail(…)` in Rust, or the state's `\"@fail\"` key in JSON",
            "@timeout" => "use `.on_timeout(…)` in Rust, or the state's `\"@timeout\"` key in JSON",
            _ => continue,
        };
        flat.errors.push(ChartError::ReservedEventName {
            state: display(&flat.states[id].path),
            event: event.clone(),
            fix: fix.to_owned(),
        });
    }
    if !b.on_timeout.is_empty() && b.machine.is_none() {
        flat.errors
            .push(ChartError::TimeoutWithoutMachine { state: display(&flat.states[id].path) });
    }
    if let Some(t) = b.timeout
        && let Some(e) = timer_error(&display(&flat.states[id].path), "@timeout", t)
    {
        flat.errors.push(e);
    }
}

/// Why state `id` (without a child machine) can never be done, if it cannot: an atomic
/// state is done only through a child machine, a compound state when it reaches a final
/// child, and a parallel state when every region has.
fn never_done(flat: &Flat<'_>, id: usize) -> Option<String> {
    let node = &flat.states[id];
    match node.kind {
        StateKind::Atomic => Some(
            "it is an atomic state without a child machine, so nothing ever completes it"
                .to_owned(),
        ),
        StateKind::Compound if !can_finish(flat, id) => Some("it has no final child".to_owned()),
        StateKind::Parallel => node.children.iter().find(|&&r| !can_finish(flat, r)).map(|&r| {
            format!(
                "its region `{}` can never reach a final state, so its regions are never all done",
                display(&flat.states[r].path)
            )
        }),
        _ => None,
    }
}

/// Whether state `s` can ever be complete as a region or compound state: a final state is,
/// a compound state with a final child can be, a parallel state when each region can be.
fn can_finish(flat: &Flat<'_>, s: usize) -> bool {
    let node = &flat.states[s];
    match node.kind {
        StateKind::Final => true,
        StateKind::Atomic => false,
        StateKind::Compound => {
            node.children.iter().any(|&c| flat.states[c].kind == StateKind::Final)
        }
        StateKind::Parallel => node.children.iter().all(|&r| can_finish(flat, r)),
    }
}

/// The error of a timer that is not positive or is longer than the limit, if any. An amount
/// so large that the duration overflows is "too long", not "not positive".
fn timer_error(state: &str, event: &str, t: Timer) -> Option<ChartError> {
    let (state, event, timer) = (state.to_owned(), event.to_owned(), t.to_string());
    if t.amount <= 0 {
        return Some(ChartError::InvalidTimerDefinition { state, event, timer });
    }
    match t.duration() {
        Some(d) if d <= limits::TIMER_INTERVAL_MAX => None,
        _ => Some(ChartError::TimerTooLong {
            state,
            event,
            timer,
            max_days: limits::TIMER_INTERVAL_MAX.as_secs() / 86_400,
        }),
    }
}

fn check_timers(flat: &mut Flat<'_>, id: usize, alphabet: &BTreeSet<&str>) -> Vec<TransitionDef> {
    let b = flat.builders[id];
    let state = display(&flat.states[id].path);
    let mut out = Vec::with_capacity(b.on.len());
    // One timer per event: a fire is only the event, and retimes and `keep_armed` find
    // timers by it.
    let mut timed: BTreeSet<&str> = BTreeSet::new();
    let mut doubled: BTreeSet<&str> = BTreeSet::new();
    for (event, branches, raw) in &b.on {
        let RawTimer { timer, both, max, then, keep_armed } = raw;
        let err = |e: fn(String, String) -> ChartError| e(state.clone(), event.clone());
        if timer.is_some() && !timed.insert(event.as_str()) && doubled.insert(event.as_str()) {
            flat.errors.push(err(|state, event| ChartError::DuplicateTimedEvent { state, event }));
        }
        if *both {
            flat.errors.push(err(|state, event| ChartError::ConflictingTimers { state, event }));
        }
        let every = matches!(timer, Some((TimerKind::Every, _)));
        if *keep_armed && timer.is_none() {
            flat.errors
                .push(err(|state, event| ChartError::KeepArmedWithoutTimer { state, event }));
        }
        if max.is_some() && !every {
            flat.errors.push(err(|state, event| ChartError::MaxWithoutEvery { state, event }));
        }
        if let Some(then) = then {
            if max.is_none() {
                flat.errors.push(err(|state, event| ChartError::ThenWithoutMax { state, event }));
            }
            if !alphabet.contains(then.as_str()) {
                flat.errors.push(ChartError::ThenUnknownEvent {
                    state: state.clone(),
                    event: event.clone(),
                    then: then.clone(),
                });
            }
        }
        if *max == Some(0) && every {
            flat.errors.push(err(|state, event| ChartError::MaxZero { state, event }));
        }
        if let Some((_, t)) = timer
            && let Some(e) = timer_error(&state, event, *t)
        {
            flat.errors.push(e);
        }
        out.push(TransitionDef {
            event: event.clone(),
            branches: branches.clone(),
            timer: timer.map(|(kind, timer)| TimerSpec {
                kind,
                timer,
                max: *max,
                then: then.clone(),
                keep_armed: *keep_armed,
            }),
        });
    }
    out
}

fn flatten_transitions(
    flat: &mut Flat<'_>,
    id: usize,
    builder: &ChartBuilder,
    out: &mut Vec<Transition>,
) -> Vec<usize> {
    let b = flat.builders[id];
    let mut groups: Vec<(Trigger, String, &Vec<Branch>)> = Vec::new();
    for (event, branches, _) in &b.on {
        groups.push((Trigger::Event(event.clone()), event.clone(), branches));
    }
    groups.push((Trigger::Always, "@always".to_owned(), &b.always));
    groups.push((Trigger::Done, "@done".to_owned(), &b.on_done));
    groups.push((Trigger::Fail, "@fail".to_owned(), &b.on_fail));
    groups.push((Trigger::Timeout, "@timeout".to_owned(), &b.on_timeout));
    let mut ids = Vec::new();
    for (trigger, label, branches) in groups {
        for branch in branches {
            let mut targets = Vec::new();
            for t in branch.target.iter().flat_map(|t| t.split_whitespace()) {
                match resolve_target(flat, flat.states[id].parent, Some(id), t) {
                    Some(found) => targets.push(found),
                    None => flat.errors.push(ChartError::UnknownTarget {
                        state: display(&flat.states[id].path),
                        trigger: label.clone(),
                        target: t.to_owned(),
                    }),
                }
            }
            let resolved_all =
                targets.len() == branch.target.iter().flat_map(|t| t.split_whitespace()).count();
            if resolved_all && let Some(conflict) = target_conflict(flat, &targets) {
                flat.errors.push(ChartError::ConflictingTargets {
                    state: display(&flat.states[id].path),
                    trigger: label.clone(),
                    targets: written_targets(branch.target.as_deref().unwrap_or_default()),
                    conflict,
                });
            }
            if branch.target.as_ref().is_some_and(|t| t.trim().is_empty()) {
                flat.errors.push(ChartError::UnknownTarget {
                    state: display(&flat.states[id].path),
                    trigger: label.clone(),
                    target: String::new(),
                });
            }
            for guard in &branch.guards {
                if !builder.guards.contains_key(guard) {
                    flat.errors.push(ChartError::UnknownGuard {
                        state: display(&flat.states[id].path),
                        trigger: label.clone(),
                        guard: guard.clone(),
                    });
                }
            }
            ids.push(out.len());
            out.push(Transition {
                source: id,
                trigger: trigger.clone(),
                guards: branch.guards.clone(),
                actions: branch.actions.clone(),
                targets,
                internal: branch.internal,
            });
        }
    }
    ids
}

/// Targets as written, with the whitespace between them normalised to one space.
fn written_targets(written: &str) -> String {
    written.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The state a target occupies in the legal-configuration check. A history pseudo-state
/// stands for its parent: what it restores may be any state inside the parent, so no other
/// target may lie inside that parent.
fn anchor(flat: &Flat<'_>, target: TargetRef) -> usize {
    match target {
        TargetRef::State(s) => s,
        TargetRef::History(h) => flat.histories[h].parent,
    }
}

fn target_path(flat: &Flat<'_>, target: TargetRef) -> String {
    match target {
        TargetRef::State(s) => display(&flat.states[s].path),
        TargetRef::History(h) => flat.histories[h].path.clone(),
    }
}

/// `true` when `a` is `s` or one of its ancestors.
fn is_at_or_above(flat: &Flat<'_>, a: usize, s: usize) -> bool {
    a == s || is_below(flat, s, a)
}

/// The nearest state that is an ancestor of both `a` and `b` (neither contains the other).
fn common_ancestor(flat: &Flat<'_>, a: usize, b: usize) -> usize {
    let mut cur = flat.states[a].parent;
    while let Some(p) = cur {
        if is_below(flat, b, p) {
            return p;
        }
        cur = flat.states[p].parent;
    }
    0
}

/// SCXML's rule for several targets: together they must form part of a legal configuration,
/// so no two may be the same state or one inside the other, and every two must meet at a
/// parallel state (each lying in a different region of it). Describes the first pair that
/// breaks the rule, in the order written; `None` when the targets are fine.
fn target_conflict(flat: &Flat<'_>, targets: &[TargetRef]) -> Option<String> {
    for (i, &x) in targets.iter().enumerate() {
        for &y in &targets[i + 1..] {
            let (px, py) = (target_path(flat, x), target_path(flat, y));
            let (ax, ay) = (anchor(flat, x), anchor(flat, y));
            if x == y {
                return Some(format!("`{px}` is named twice"));
            }
            if ax == ay {
                let both = display(&flat.states[ax].path);
                return Some(format!("`{px}` and `{py}` both enter `{both}`"));
            }
            let inside = |outer: TargetRef, inner: &str| match outer {
                TargetRef::State(_) => format!("`{}` contains `{inner}`", target_path(flat, outer)),
                TargetRef::History(h) => format!(
                    "history `{}` restores states inside `{}`, which contains `{inner}`",
                    flat.histories[h].path,
                    display(&flat.states[flat.histories[h].parent].path)
                ),
            };
            if is_at_or_above(flat, ax, ay) {
                return Some(inside(x, &py));
            }
            if is_at_or_above(flat, ay, ax) {
                return Some(inside(y, &px));
            }
            let lca = common_ancestor(flat, ax, ay);
            if flat.states[lca].kind != StateKind::Parallel {
                return Some(format!(
                    "`{px}` and `{py}` meet at `{}`, a compound state, which has one active child at a time",
                    display(&flat.states[lca].path)
                ));
            }
        }
    }
    None
}

/// Resolves one target as written: `.child` is a child of `source`; otherwise the nearest
/// enclosing scope (starting at `scope`, then its ancestors up to the root) that has a state
/// or history pseudo-state at that relative path wins, so a full dotted path always resolves
/// at the root.
fn resolve_target(
    flat: &Flat<'_>,
    scope: Option<usize>,
    source: Option<usize>,
    target: &str,
) -> Option<TargetRef> {
    let lookup = |path: String| {
        flat.by_path
            .get(&path)
            .map(|&s| TargetRef::State(s))
            .or_else(|| flat.history_by_path.get(&path).map(|&h| TargetRef::History(h)))
    };
    if let Some(child) = target.strip_prefix('.') {
        return source.and_then(|s| lookup(join(&flat.states[s].path, child)));
    }
    let mut scope = scope;
    while let Some(s) = scope {
        if let Some(found) = lookup(join(&flat.states[s].path, target)) {
            return Some(found);
        }
        scope = flat.states[s].parent;
    }
    None
}

/// Resolves a history's default target(s) in its parent's scope (children by key, `.child`
/// likewise) and checks that the history can work: its parent has children, and every
/// default is a state below the parent (a direct child for shallow history).
fn check_history(flat: &mut Flat<'_>, h: usize) {
    let parent = flat.histories[h].parent;
    let written = &flat.history_written[h];
    let (key, default, depth) = (written.key.clone(), written.default.clone(), written.depth);
    let error = |problem: String, fix: &str| ChartError::InvalidHistory {
        state: display(&flat.states[parent].path),
        history: key.clone(),
        problem,
        fix: fix.to_owned(),
    };
    if !matches!(flat.states[parent].kind, StateKind::Compound | StateKind::Parallel) || parent == 0
    {
        let e = error(
            "belongs to a state without children".to_owned(),
            "put the history inside a compound or parallel state, next to the children it remembers",
        );
        flat.errors.push(e);
        return;
    }
    let mut resolved = Vec::new();
    for t in default.split_whitespace() {
        match resolve_target(flat, Some(parent), Some(parent), t) {
            Some(TargetRef::State(s))
                if flat.states[s].parent == Some(parent)
                    || (depth == super::definition::HistoryDepth::Deep
                        && is_below(flat, s, parent)) =>
            {
                resolved.push(s);
            }
            _ => {
                let e = error(
                    format!("has default target `{t}`, which is not a state inside its parent"),
                    "name a child of the parent (any descendant for deep history) as the default",
                );
                flat.errors.push(e);
            }
        }
    }
    let all_resolved = resolved.len() == default.split_whitespace().count();
    let states: Vec<TargetRef> = resolved.iter().map(|&s| TargetRef::State(s)).collect();
    if all_resolved && let Some(conflict) = target_conflict(flat, &states) {
        let e = error(
            format!(
                "has default targets `{}`, which cannot all be active at once: {conflict}",
                written_targets(&default)
            ),
            "default targets must lie in different regions of one parallel state, so name one state per region or keep a single default",
        );
        flat.errors.push(e);
    }
    if resolved.is_empty() && !default.split_whitespace().any(|_| true) {
        let e = error(
            "has no default target".to_owned(),
            "give the state entered when nothing is recorded yet, e.g. the parent's initial child",
        );
        flat.errors.push(e);
    }
    flat.histories[h].default = resolved;
}

fn is_below(flat: &Flat<'_>, s: usize, of: usize) -> bool {
    let mut cur = flat.states[s].parent;
    while let Some(p) = cur {
        if p == of {
            return true;
        }
        cur = flat.states[p].parent;
    }
    false
}

/// States that no sequence of transitions can enter, in document order.
fn unreachable(def: &Definition) -> Vec<ChartWarning> {
    let mut reached = vec![false; def.states.len()];
    let mut work = vec![0];
    while let Some(s) = work.pop() {
        if reached[s] {
            continue;
        }
        // Entering `s` enters its ancestors and its default descendants.
        let mut stack = vec![s];
        let mut anc = def.parent(s);
        while let Some(a) = anc {
            stack.push(a);
            anc = def.parent(a);
        }
        while let Some(x) = stack.pop() {
            if reached[x] {
                continue;
            }
            reached[x] = true;
            let node = &def.states[x];
            match node.kind {
                StateKind::Compound => stack.extend(node.initial),
                StateKind::Parallel => stack.extend(node.children.iter().copied()),
                _ => {}
            }
            for &t in &node.transitions {
                for &target in &def.transitions[t].targets {
                    match target {
                        TargetRef::State(s) => work.push(s),
                        TargetRef::History(h) => {
                            // What a history restores was entered before; only its
                            // defaults are new ways in.
                            work.push(def.histories[h].parent);
                            work.extend(def.histories[h].default.iter().copied());
                        }
                    }
                }
            }
        }
    }
    (1..def.states.len())
        .filter(|&s| !reached[s])
        .map(|s| ChartWarning::UnreachableState { state: def.states[s].path.clone() })
        .collect()
}
