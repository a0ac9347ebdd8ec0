//! Moving waiting instances from one version of a chart to another.
//!
//! Instances are pinned to the version they started on; nothing moves them implicitly. A
//! [`Migration`] says how the states of version `from` map to those of version `to`: an
//! explicit map of old state paths to new ones, where a mapped state carries its
//! descendants along (`"a" → "x"` moves `a.b` to `x.b`), and every state that is not
//! mapped keeps its path if version `to` has it. It may also transform the context.
//!
//! [`Migration::plan`] decides the move of one instance, from its row and its armed timers:
//! the new configuration — the mapped states, completed the way entering them would
//! (their new ancestors, the initial states below a mapped compound state, the regions a
//! parallel state gained; those states' timers are armed, their entry actions do not run),
//! which must be legal in `to`, and must enter no delegation state whose child was not
//! already running (a move starts no child machine) and no final state the instance was not
//! already in (a move raises no `done` event): the instance would wait there for good — the
//! context, the recorded history
//! states (remapped, or dropped where `to` has no counterpart or the map moves them out of
//! the history's parent), and the timers — one whose
//! owning state and event still exist in the new configuration keeps its due time, one
//! whose state or event is gone is dropped, and a timer of the new configuration with no
//! old counterpart is armed from now — unless its state stays active and the old version
//! had a timer on that event there that fires without leaving the state (a one-shot timer
//! of a targetless transition, a recurring one with a `max`): that timer has fired (or
//! used up its `max`), and stays spent. Anything it cannot map is a refusal that names the
//! old state, so a dry run can show it and an apply leaves the instance untouched.

use crate::chart::algorithm::{HISTORY_CONTEXT_KEY, add_ancestors, add_descendants, entry_timers};
use crate::chart::at_or_below;
use crate::chart::parallel::{ParallelBook, RegionStatus};
use crate::chart::step::timeout_owner;
use crate::chart::{
    Configuration, Definition, HistoryDepth, INIT_POSITION, StateKind, TimerArm, TimerKind,
};
use crate::history::HistoryKind;
use crate::instance::{HistoryEntry, Instance};
use crate::timers::TimerRow;
use crate::{Status, TimerId, Timestamp};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

/// A context transform: the old context in, the new one out, or why it cannot be moved.
pub type ContextTransform = Arc<dyn Fn(&Value) -> Result<Value, String> + Send + Sync>;

/// How instances of one chart move from version `from` to version `to`.
#[derive(Clone)]
pub struct Migration {
    from: Arc<Definition>,
    to: Arc<Definition>,
    states: BTreeMap<String, String>,
    context: Option<ContextTransform>,
}

impl fmt::Debug for Migration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Migration")
            .field("machine", &self.from.name())
            .field("from", &self.from.version())
            .field("to", &self.to.version())
            .field("states", &self.states)
            .field("context", &self.context.is_some())
            .finish()
    }
}

/// A migration that cannot be built: the message names the argument and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MigrationError(pub String);

/// Why one instance cannot be moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// An active state has no counterpart in the new version: map it.
    Unmapped {
        /// The old state path.
        state: String,
    },
    /// The mapped states do not form a legal configuration of the new version.
    Illegal {
        /// The mapped configuration.
        configuration: Vec<String>,
        /// What is wrong with it.
        reason: String,
    },
    /// The move would put the instance in a final state of the new version that was not
    /// already active, and final, before the move: a move raises no `done` event, so the
    /// instance would wait there for good (no result, no `done` for a parent).
    Final {
        /// The old state whose move lands in (or, by completing the configuration, enters)
        /// the final state.
        state: String,
        /// The new version's final state it would land in.
        target: String,
    },
    /// The context transform refused the instance's context.
    Context(String),
    /// A child machine was started from a delegation state whose path the move changes:
    /// the child would report to, and be cancelled with, a state the instance no longer has.
    Delegating {
        /// The delegation state's old path.
        state: String,
    },
    /// A parallel state has region tasks outstanding (they run, and report, on the old
    /// version), or dispatched under paths the move changes (their reports and its region
    /// timeout would name states the instance no longer has).
    Dispatched {
        /// The parallel state's old path.
        state: String,
    },
    /// The stored position is no chart configuration (a parallel region task, which runs
    /// on the version that dispatched it); the row is left where it is.
    NotAChart {
        /// The stored position.
        position: String,
    },
    /// The instance is running a step now; a later pass moves it.
    Busy,
    /// The instance is not of the version being migrated (it moved or finished meanwhile).
    Stale,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Unmapped { state } => write!(
                f,
                "state `{state}` has no counterpart in the new version; map it with `Migration::map(\"{state}\", …)`"
            ),
            Refusal::Illegal { configuration, reason } => write!(
                f,
                "the mapped states {configuration:?} are not a legal configuration of the new version: {reason}"
            ),
            Refusal::Final { state, target } => write!(
                f,
                "state `{state}` would move to `{target}`, a final state of the new version; a move raises no `done` event for it, so the waiting instance would never finish or leave; map `{state}` to a non-final state with `Migration::map(\"{state}\", …)`, or cancel these instances (`keel cancel <id>`) instead of moving them"
            ),
            Refusal::Context(why) => write!(f, "the context transform refused: {why}"),
            Refusal::Delegating { state } => write!(
                f,
                "delegation state `{state}` started a child machine under its path, which this move changes; keep its path in the new version, or move the instance once it has left `{state}`"
            ),
            Refusal::Dispatched { state } => write!(
                f,
                "parallel state `{state}` dispatched region tasks that are outstanding or run under paths this move changes; move the instance once they have reported, keeping the paths of `{state}` and its regions (or once it has left `{state}`)"
            ),
            Refusal::NotAChart { position } => write!(
                f,
                "position `{position}` is not a chart configuration (a parallel region task runs on the version that dispatched it); the row is left where it is"
            ),
            Refusal::Busy => f.write_str("a step is running; a later pass moves the instance"),
            Refusal::Stale => {
                f.write_str("the instance is no longer a waiting instance of the old version")
            }
        }
    }
}

/// The move of one instance, as [`Migration::plan`] decided it.
#[derive(Debug, Clone, PartialEq)]
pub struct Move {
    /// The row after the move (new version, position, context and revision).
    pub row: Instance,
    /// The history entry the move records.
    pub history: HistoryEntry,
    /// The old configuration.
    pub old: Configuration,
    /// The new configuration.
    pub new: Configuration,
    /// The states the move entered to complete the new configuration (new ancestors of a
    /// mapped state, the initial states below a mapped compound state, the regions a
    /// parallel state gained), in document order. Their timers are armed; their entry
    /// actions do not run. The `MIGRATED` history entry lists them under
    /// `entered_without_entry_actions`.
    pub entered: Vec<String>,
    /// The instance's timers after the move, replacing all it had: the kept ones (same id,
    /// due time and fire count, under their possibly renamed state) and the newly armed
    /// ones (id 0: the store assigns it).
    pub timers: Vec<TimerRow>,
    /// How many timers kept their due time.
    pub kept: usize,
    /// How many timers were dropped (their state or event is gone).
    pub dropped: usize,
    /// How many timers were armed from now (the new configuration has them, the old did
    /// not).
    pub armed: usize,
}

impl Migration {
    /// A migration from `from` to `to`, two versions of one chart, mapping every state to
    /// the state of the same path until [`map`](Self::map) says otherwise.
    ///
    /// # Errors
    ///
    /// When the definitions are of different charts or the same version.
    pub fn new(from: Definition, to: Definition) -> Result<Self, MigrationError> {
        if from.name() != to.name() {
            return Err(MigrationError(format!(
                "to: chart `{}` is not a version of chart `{}`; migrate between versions of one chart",
                to.name(),
                from.name()
            )));
        }
        if from.version() == to.version() {
            return Err(MigrationError(format!(
                "to: both definitions are version {}; give the new definition a new version",
                to.version()
            )));
        }
        Ok(Migration {
            from: Arc::new(from),
            to: Arc::new(to),
            states: BTreeMap::new(),
            context: None,
        })
    }

    /// Maps the old state `old` (and its descendants) to the new state `new`.
    ///
    /// # Errors
    ///
    /// When `old` is not a state of the old version or `new` not one of the new version.
    pub fn map(mut self, old: &str, new: &str) -> Result<Self, MigrationError> {
        if self.from.state(old).is_none_or(|_| old.is_empty()) {
            return Err(MigrationError(format!(
                "map: `{old}` is not a state of {} v{}",
                self.from.name(),
                self.from.version()
            )));
        }
        if self.to.state(new).is_none_or(|_| new.is_empty()) {
            return Err(MigrationError(format!(
                "map: `{new}` is not a state of {} v{}",
                self.to.name(),
                self.to.version()
            )));
        }
        self.states.insert(old.to_owned(), new.to_owned());
        Ok(self)
    }

    /// Transforms each instance's context on the way (the `@history` record is remapped
    /// by the migration itself, after the transform).
    #[must_use]
    pub fn context(mut self, transform: ContextTransform) -> Self {
        self.context = Some(transform);
        self
    }

    /// The chart's name.
    pub fn machine(&self) -> &str {
        self.from.name()
    }

    /// The version instances move from.
    pub fn from_version(&self) -> u32 {
        self.from.version()
    }

    /// The version instances move to.
    pub fn to_version(&self) -> u32 {
        self.to.version()
    }

    /// The new path of the old state `path`: its longest mapped ancestor-or-self carries
    /// it, else it keeps its path; `None` when the new version has no such state.
    fn map_path(&self, path: &str) -> Option<String> {
        let mut prefix = path;
        let mapped = loop {
            if let Some(new) = self.states.get(prefix) {
                break format!("{new}{}", &path[prefix.len()..]);
            }
            match prefix.rfind('.') {
                Some(dot) => prefix = &prefix[..dot],
                None => break path.to_owned(),
            }
        };
        self.to.state(&mapped).is_some().then_some(mapped)
    }

    /// The timers the states of `config` arm in the new version, as a state entry would.
    fn timers_of(&self, config: &Configuration) -> Vec<TimerArm> {
        config.paths().filter_map(|path| self.to.state(path)).flat_map(entry_timers).collect()
    }

    /// The recorded history states, remapped; an entry whose pseudo-state or recorded
    /// states the new version lacks is dropped (its history state then takes its default),
    /// and so is one whose states the map moved out of the history's parent (for shallow
    /// history, out of its direct children): restoring it would enter a state the history
    /// does not own.
    fn remap_history(&self, recorded: &Value) -> Option<Value> {
        let Value::Object(entries) = recorded else { return None };
        let mut out = Map::new();
        for (key, states) in entries {
            let (parent, name) = key.rsplit_once('.').unwrap_or(("", key.as_str()));
            let new_parent =
                if parent.is_empty() { Some(String::new()) } else { self.map_path(parent) };
            let Some(new_parent) = new_parent else { continue };
            let depth = self
                .to
                .state(&new_parent)
                .and_then(|n| n.history.iter().find(|h| h.key == name))
                .map(|h| h.depth);
            let Some(depth) = depth else { continue };
            let inside = |s: &str| match depth {
                HistoryDepth::Shallow => {
                    s.rsplit_once('.').map_or("", |(p, _)| p) == new_parent.as_str()
                }
                HistoryDepth::Deep => {
                    s != new_parent && (new_parent.is_empty() || at_or_below(s, &new_parent))
                }
            };
            let mapped: Option<Vec<Value>> = states.as_array().and_then(|list| {
                list.iter()
                    .map(|s| {
                        s.as_str()
                            .and_then(|s| self.map_path(s))
                            .filter(|s| inside(s))
                            .map(Value::String)
                    })
                    .collect()
            });
            if let Some(mapped) = mapped {
                let new_key = if new_parent.is_empty() {
                    name.to_owned()
                } else {
                    format!("{new_parent}.{name}")
                };
                out.insert(new_key, Value::Array(mapped));
            }
        }
        (!out.is_empty()).then_some(Value::Object(out))
    }

    /// Decides the move of `row` (a waiting instance of the old version) with its armed
    /// `timers`, at `now`.
    ///
    /// # Errors
    ///
    /// A [`Refusal`] naming what stops the move; nothing is written for it.
    pub fn plan(
        &self,
        row: &Instance,
        timers: &[TimerRow],
        now: Timestamp,
    ) -> Result<Move, Refusal> {
        if row.machine.name != self.from.name()
            || row.machine.version != self.from.version() as i32
            || row.status.is_terminal()
        {
            return Err(Refusal::Stale);
        }
        if row.status == Status::Executing {
            return Err(Refusal::Busy);
        }
        if row.position == INIT_POSITION {
            return self.unstarted(row, timers, now);
        }
        let old: Configuration = serde_json::from_str(&row.position)
            .map_err(|_| Refusal::NotAChart { position: row.position.clone() })?;
        let mut paths = Vec::new();
        for path in old.paths() {
            match self.map_path(path) {
                Some(new) => paths.push(new),
                None => return Err(Refusal::Unmapped { state: path.to_owned() }),
            }
        }
        let (new, entered) = self.complete(&paths);
        new.check(&self.to).map_err(|reason| Refusal::Illegal {
            configuration: new.paths().map(str::to_owned).collect(),
            reason,
        })?;
        // What was started under an old path must find that path after the move: a
        // delegated child reports to (and is cancelled with) its state, and a region task
        // reports to its parallel state and the regions it entered.
        for path in old.paths() {
            let delegating = self.from.state(path).is_some_and(|n| n.delegation.is_some());
            if delegating && self.map_path(path).as_deref() != Some(path) {
                return Err(Refusal::Delegating { state: path.to_owned() });
            }
        }
        // A move starts no child machine: a delegation state of the new configuration
        // waits for good unless its child was started before the move, that is the same
        // state was active, and delegating, in the old version.
        let started =
            |p: &str| old.contains(p) && self.from.state(p).is_some_and(|n| n.delegation.is_some());
        if let Some((path, machine)) = new.paths().find_map(|p| {
            let d = self.to.state(p)?.delegation.as_ref()?;
            (!started(p)).then(|| (p.to_owned(), d.machine.clone()))
        }) {
            return Err(Refusal::Illegal {
                configuration: new.paths().map(str::to_owned).collect(),
                reason: format!(
                    "the move enters delegation state `{path}`, which delegates in the new version but had no child machine running before the move, and a move starts no child machine (`{machine}`); map the instance onto a state that does not delegate, or move it once it has left this part of the chart"
                ),
            });
        }
        // A move raises no `done.state` event: a final state it puts the instance in (a
        // compound's final child, a region's last final state) never completes its parent.
        // Only a final state that was already active, and final, before the move may stay.
        let was_final = |p: &str| {
            old.paths().any(|q| {
                self.from.state(q).is_some_and(|n| n.kind == StateKind::Final)
                    && self.map_path(q).as_deref() == Some(p)
            })
        };
        if let Some(target) = new
            .paths()
            .find(|p| self.to.state(p).is_some_and(|n| n.kind == StateKind::Final) && !was_final(p))
        {
            // The old state whose move reaches it: the one mapped onto it or onto its
            // nearest ancestor.
            let state = old
                .paths()
                .filter_map(|q| Some((q, self.map_path(q)?)))
                .filter(|(_, to)| at_or_below(target, to))
                .max_by_key(|(_, to)| to.len())
                .map(|(q, _)| q.to_owned())
                .unwrap_or_default();
            return Err(Refusal::Final { state, target: target.to_owned() });
        }

        let mut book_of = row.context.clone();
        let book = ParallelBook::take(&mut book_of);
        for (state, record) in &book.active {
            let moved = |p: &str| self.map_path(p).as_deref() != Some(p);
            let outstanding = record.regions.values().any(|r| *r == RegionStatus::Pending);
            if outstanding || moved(state) || record.regions.keys().any(|r| moved(r)) {
                return Err(Refusal::Dispatched { state: state.clone() });
            }
        }
        let mut context = match &self.context {
            Some(transform) => transform(&row.context).map_err(Refusal::Context)?,
            None => row.context.clone(),
        };
        if let Value::Object(fields) = &mut context
            && let Some(recorded) = fields.remove(HISTORY_CONTEXT_KEY)
            && let Some(remapped) = self.remap_history(&recorded)
        {
            fields.insert(HISTORY_CONTEXT_KEY.to_owned(), remapped);
        }

        let machine = crate::MachineRef::new(self.to.name(), self.to.version() as i32);
        let wanted = self.timers_of(&new);
        let mut kept = Vec::new();
        let mut dropped = 0;
        let mut taken = vec![false; wanted.len()];
        for t in timers {
            // A dispatch's region timeout stays with its parallel state, whose path (checked
            // above) the move keeps.
            let timeout = book.active.keys().any(|p| t.spec.state == timeout_owner(p));
            if timeout {
                kept.push(TimerRow { machine: machine.clone(), ..t.clone() });
                continue;
            }
            let target = self.map_path(&t.spec.state);
            let found = wanted.iter().enumerate().find(|(i, w)| {
                !taken[*i] && Some(&w.state) == target.as_ref() && w.event == t.spec.event
            });
            match found {
                Some((i, w)) => {
                    taken[i] = true;
                    kept.push(TimerRow { spec: w.clone(), machine: machine.clone(), ..t.clone() });
                }
                None => dropped += 1,
            }
        }
        // A timer of a state that stays active, with no row left, whose old state had a
        // timer on that event that can fire without leaving the state (a one-shot one with
        // a targetless branch, or a recurring one with a `max`), has fired (or used up its
        // `max`): arming it again would fire it twice. A missing row of a timer whose firing
        // leaves the state means it was never armed, and it is armed.
        let fired_in_place = |t: &crate::chart::TransitionDef| {
            t.timer.as_ref().is_some_and(|spec| match spec.kind {
                TimerKind::After => t.branches.iter().any(|b| b.target.is_none()),
                TimerKind::Every => spec.max.is_some(),
            })
        };
        let spent = |w: &TimerArm| {
            !entered.contains(&w.state)
                && old.paths().any(|q| {
                    self.map_path(q).as_deref() == Some(w.state.as_str())
                        && self.from.state(q).is_some_and(|n| {
                            n.on.iter().any(|t| t.event == w.event && fired_in_place(t))
                        })
                })
        };
        let (kept_n, mut all) = (kept.len(), kept);
        let mut armed = 0;
        for (spec, taken) in wanted.into_iter().zip(taken) {
            if !taken && !spent(&spec) {
                armed += 1;
                all.push(TimerRow::armed(TimerId(0), row.id, &row.namespace, &machine, spec, now));
            }
        }

        let mut moved = row.clone();
        moved.position = new.position();
        let (row, mut history) =
            self.moved(moved, context, now, (&old, &new), (kept_n, dropped, armed));
        if !entered.is_empty() {
            history.data["entered_without_entry_actions"] = json!(entered);
        }
        Ok(Move { row, history, old, new, entered, timers: all, kept: kept_n, dropped, armed })
    }

    /// The mapped `paths` (states of the new version) completed the way entering them
    /// would complete them: every ancestor of a mapped state, the initial child of an
    /// active compound state with no active child (and so on down), and every region of an
    /// active parallel state. Returns the configuration and the states it added, in
    /// document order: they count as entered, without their entry actions.
    fn complete(&self, paths: &[String]) -> (Configuration, Vec<String>) {
        let def = &*self.to;
        let given: BTreeSet<usize> =
            paths.iter().filter_map(|path| def.by_path.get(path).copied()).collect();
        // Entered the way a transition enters its targets: each deepest given state with
        // what entering it enters below it, then the ancestors of each with the regions of
        // parallel ancestors that hold nothing yet. Every given leaf is in the set before
        // any ancestor is added, so a region a given state already covers is not entered
        // by its initial state too.
        let leaves: Vec<usize> = given
            .iter()
            .copied()
            .filter(|&s| !given.iter().any(|&d| d != s && def.is_descendant(d, s)))
            .collect();
        let mut active = BTreeSet::from([0]);
        for &s in &leaves {
            add_descendants(def, s, &mut active);
        }
        for &s in &leaves {
            add_ancestors(def, s, None, &mut active);
        }
        let entered = active
            .iter()
            .filter(|&&s| s != 0 && !given.contains(&s))
            .map(|&s| def.path(s).to_owned())
            .collect();
        (Configuration::from_ids(def, &active), entered)
    }

    /// The move of an instance that has not entered the chart yet: it moves as it is and
    /// enters the new version's initial states when it first runs. It has no timers to
    /// keep.
    fn unstarted(
        &self,
        row: &Instance,
        timers: &[TimerRow],
        now: Timestamp,
    ) -> Result<Move, Refusal> {
        let context = match &self.context {
            Some(transform) => transform(&row.context).map_err(Refusal::Context)?,
            None => row.context.clone(),
        };
        let none = Configuration::from_paths(Vec::<String>::new());
        let dropped = timers.len();
        let (row, history) = self.moved(row.clone(), context, now, (&none, &none), (0, dropped, 0));
        Ok(Move {
            row,
            history,
            old: none.clone(),
            new: none,
            entered: Vec::new(),
            timers: Vec::new(),
            kept: 0,
            dropped,
            armed: 0,
        })
    }

    /// `row` on the new version with `context`, its revision bumped, and the `MIGRATED`
    /// entry recording the configurations and the timer counts (kept, dropped, armed).
    fn moved(
        &self,
        mut row: Instance,
        context: Value,
        now: Timestamp,
        (old, new): (&Configuration, &Configuration),
        (kept, dropped, armed): (usize, usize, usize),
    ) -> (Instance, HistoryEntry) {
        row.machine = crate::MachineRef::new(self.to.name(), self.to.version() as i32);
        row.context = context;
        row.revision = crate::Revision(row.revision.0 + 1);
        row.updated_at = now;
        let history = HistoryEntry::new(
            HistoryKind::Migrated.as_str(),
            json!({
                "from": self.from.version(),
                "to": self.to.version(),
                "old": old.paths().collect::<Vec<_>>(),
                "new": new.paths().collect::<Vec<_>>(),
                "timers": { "kept": kept, "dropped": dropped, "armed": armed },
            }),
        );
        (row, history)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::HistoryDepth;
    use crate::instance::NewInstance;
    use crate::{InstanceId, MachineRef};

    /// `p` (with a shallow history `h` over `a` / `b`) and `out`; version 2 renames `p` to
    /// `q` and `b` to `c`, and `extra` replaces `out`.
    fn versions() -> (Definition, Definition) {
        let chart = |v: u32, p: &'static str, b: &'static str, out: &'static str| {
            Definition::builder("m", v)
                .initial(p)
                .state(p, move |s| {
                    s.initial("a")
                        .history("h", HistoryDepth::Shallow, "a")
                        .on_to("LEAVE", out)
                        .state("a", move |s| s.on_to("NEXT", b))
                        .leaf(b)
                })
                .state(out, move |s| s.on_to("BACK", format!("{p}.h")))
                .build()
                .expect("valid")
        };
        (chart(1, "p", "b", "out"), chart(2, "q", "c", "extra"))
    }

    fn waiting(position: &str, context: Value) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), position).context(context);
        let mut row = Instance::from_new(InstanceId(7), &new, None, Timestamp(0));
        row.status = Status::AwaitingSignal;
        row
    }

    #[test]
    fn recorded_history_follows_the_map_and_the_context_transform_runs_first() {
        let (v1, v2) = versions();
        let m = Migration::new(v1, v2)
            .and_then(|m| m.map("p", "q"))
            .and_then(|m| m.map("p.b", "q.c"))
            .and_then(|m| m.map("out", "extra"))
            .expect("valid")
            .context(Arc::new(|c: &Value| {
                let mut c = c.clone();
                c["v2"] = json!(true);
                Ok(c)
            }));
        let row = waiting(r#"["out"]"#, json!({ "@history": { "p.h": ["p.b"] }, "n": 1 }));
        let moved = m.plan(&row, &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.row.position, r#"["extra"]"#);
        assert_eq!(
            moved.row.context,
            json!({ "@history": { "q.h": ["q.c"] }, "n": 1, "v2": true })
        );
        assert_eq!((moved.row.machine.version, moved.row.revision.0), (2, row.revision.0 + 1));
    }

    /// Version 1 delegates `paying` to a child machine and runs parallel `p`; version 2
    /// renames `paying` (to `charging`) or keeps it, and keeps or renames `p`.
    fn delegating(v: u32, paying: &str, p: &str) -> Definition {
        Definition::builder("m", v)
            .initial("idle")
            .state("idle", |s| s.on_to("PAY", paying).on_to("BOTH", p))
            .state(paying, |s| s.machine("payment").on_done(|b| b.target("idle")))
            .parallel(p, |s| {
                s.state("r1", |r| r.initial("a").leaf("a"))
                    .state("r2", |r| r.initial("b").leaf("b"))
            })
            .build()
            .expect("valid")
    }

    #[test]
    fn a_move_that_renames_a_state_with_work_started_under_its_path_is_refused() {
        let v1 = delegating(1, "paying", "p");
        let renamed = Migration::new(v1.clone(), delegating(2, "charging", "q"))
            .and_then(|m| m.map("paying", "charging"))
            .and_then(|m| m.map("p", "q"))
            .expect("valid");
        let refusal = renamed.plan(&waiting(r#"["paying"]"#, json!({})), &[], Timestamp(5));
        assert_eq!(refusal, Err(Refusal::Delegating { state: "paying".into() }));
        assert!(refusal.unwrap_err().to_string().contains("keep its path"));

        let record = crate::chart::parallel::DispatchRecord {
            dispatch: 1,
            regions: [("p.r1".to_owned(), RegionStatus::Pending)].into(),
            failed: false,
            timed_out: false,
        };
        let book = ParallelBook { last_dispatch: 1, active: [("p".to_owned(), record)].into() };
        let mut context = json!({});
        book.put(&mut context);
        let in_p = waiting(r#"["p","p.r1","p.r1.a","p.r2","p.r2.b"]"#, context);
        let refusal = renamed.plan(&in_p, &[], Timestamp(5));
        assert_eq!(refusal, Err(Refusal::Dispatched { state: "p".into() }));

        // Paths kept: refused while a region task is outstanding; once every region has
        // reported, the move goes on, the region timeout with it.
        let kept = Migration::new(v1, delegating(2, "paying", "p")).expect("valid");
        assert!(kept.plan(&waiting(r#"["paying"]"#, json!({})), &[], Timestamp(5)).is_ok());
        let refusal = kept.plan(&in_p, &[], Timestamp(5));
        assert_eq!(refusal, Err(Refusal::Dispatched { state: "p".into() }));
        let mut reported = book.clone();
        reported
            .active
            .get_mut("p")
            .expect("p")
            .regions
            .insert("p.r1".into(), RegionStatus::Applied);
        let mut context = json!({});
        reported.put(&mut context);
        let in_p = waiting(r#"["p","p.r1","p.r1.a","p.r2","p.r2.b"]"#, context);
        let spec = crate::chart::step::timeout_timer(
            &crate::config::ParallelConfig {
                region_timeout: std::time::Duration::from_secs(60),
                ..crate::config::ParallelConfig::default()
            },
            "p",
        )
        .expect("a region timeout");
        let timer = TimerRow::armed(
            TimerId(3),
            in_p.id,
            "default",
            &MachineRef::new("m", 1),
            spec,
            Timestamp(1),
        );
        let moved = kept.plan(&in_p, std::slice::from_ref(&timer), Timestamp(5)).expect("moves");
        assert_eq!((moved.kept, moved.dropped), (1, 0));
        assert_eq!(moved.timers[0].id, TimerId(3));
        assert_eq!(moved.timers[0].machine.version, 2);
    }

    #[test]
    fn an_instance_not_started_yet_moves_as_it_is_and_a_region_task_stays() {
        let (v1, v2) = versions();
        let m = Migration::new(v1, v2).expect("valid").context(Arc::new(|c: &Value| {
            let mut c = c.clone();
            c["v2"] = json!(true);
            Ok(c)
        }));
        let queued = waiting(INIT_POSITION, json!({ "n": 1 }));
        let moved = m.plan(&queued, &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.row.position, INIT_POSITION, "it enters version 2 when it first runs");
        assert_eq!((moved.row.machine.version, moved.row.context["v2"].clone()), (2, json!(true)));
        assert_eq!(moved.history.data["old"], json!([]));

        let task = waiting("@region", json!({}));
        let refusal = m.plan(&task, &[], Timestamp(5)).unwrap_err();
        assert_eq!(refusal, Refusal::NotAChart { position: "@region".into() });
        assert!(!refusal.to_string().contains("map"), "no impossible fix: {refusal}");
    }

    /// A waiting instance moved into a final state would wait there for good: no result,
    /// no `done` for a parent. The move is refused, naming the state and both fixes, and
    /// the dry run lists the refusal (its reason is this message).
    #[test]
    fn a_move_into_a_final_state_is_refused_naming_the_state_and_the_fix() {
        let v1 = Definition::builder("m", 1)
            .initial("open")
            .state("open", |s| s.on_to("HOLD", "on_hold").on_to("CANCEL", "cancelled"))
            .state("on_hold", |s| s.on_to("RESUME", "open"))
            .final_state("cancelled")
            .build()
            .expect("valid");
        let v2 = Definition::builder("m", 2)
            .initial("open")
            .state("open", |s| s.on_to("CANCEL", "cancelled"))
            .final_state("cancelled")
            .build()
            .expect("valid");
        let m = Migration::new(v1, v2).and_then(|m| m.map("on_hold", "cancelled")).expect("valid");
        let refusal = m.plan(&waiting(r#"["on_hold"]"#, json!({})), &[], Timestamp(5));
        let expected = Refusal::Final { state: "on_hold".into(), target: "cancelled".into() };
        assert_eq!(refusal, Err(expected.clone()));
        let message = expected.to_string();
        assert!(
            message.contains("map `on_hold` to a non-final state")
                && message.contains("keel cancel"),
            "{message}"
        );
        // The other instances still move.
        let moved = m.plan(&waiting(r#"["open"]"#, json!({})), &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.row.position, r#"["open"]"#);
    }

    /// A shallow history remembers a direct child of its parent: a record the map moves
    /// outside that parent is dropped (the history takes its default), so `BACK → q.h`
    /// cannot land in a top-level state.
    #[test]
    fn a_history_record_mapped_outside_its_parent_is_dropped() {
        let (v1, v2) = versions();
        let m = Migration::new(v1, v2)
            .and_then(|m| m.map("p", "q"))
            .and_then(|m| m.map("p.b", "extra"))
            .and_then(|m| m.map("out", "extra"))
            .expect("valid");
        let row = waiting(r#"["out"]"#, json!({ "@history": { "p.h": ["p.b"] }, "n": 1 }));
        let moved = m.plan(&row, &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.row.context, json!({ "n": 1 }), "the record is dropped");
        // A record that stays inside its parent is kept.
        let row = waiting(r#"["out"]"#, json!({ "@history": { "p.h": ["p.a"] } }));
        let moved = m.plan(&row, &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.row.context, json!({ "@history": { "q.h": ["q.a"] } }));
    }

    /// A move completes the configuration the way entering it would: grouping states
    /// under a new parent enters the parent, a leaf mapped onto a compound state enters its
    /// initial child, a parallel state that gained a region enters it. The entered states'
    /// timers are armed; their entry actions do not run, and the history entry says so.
    #[test]
    fn a_move_enters_what_the_mapped_states_need_without_entry_actions() {
        let v1 = Definition::builder("m", 1)
            .initial("cart")
            .state("cart", |s| s.on_to("PAY", "payment"))
            .state("payment", |s| s.on_to("PAID", "paid"))
            .final_state("paid")
            .build()
            .expect("valid");
        let v2 = Definition::builder("m", 2)
            .initial("checkout")
            .state("checkout", |s| {
                s.initial("cart")
                    .entry("greet")
                    .on("REMIND", |t| t.action("remind").after(crate::chart::Timer::hours(1)))
                    .state("cart", |s| s.on_to("PAY", "payment"))
                    .state("payment", |s| s.on_to("PAID", "paid"))
            })
            .final_state("paid")
            .build()
            .expect("valid");
        let grouped = Migration::new(v1, v2)
            .and_then(|m| m.map("payment", "checkout.payment"))
            .expect("valid");
        let moved = grouped.plan(&waiting(r#"["payment"]"#, json!({})), &[], Timestamp(5));
        let moved = moved.expect("moves into the new parent");
        assert_eq!(moved.row.position, r#"["checkout","checkout.payment"]"#);
        assert_eq!(moved.entered, ["checkout"]);
        assert_eq!(moved.history.data["entered_without_entry_actions"], json!(["checkout"]));
        assert_eq!(moved.armed, 1, "the entered state's timer is armed");
        assert_eq!(
            (moved.timers[0].spec.state.as_str(), moved.timers[0].spec.event.as_str()),
            ("checkout", "REMIND")
        );

        // A leaf onto a compound state: its initial child is entered.
        let (v1, v2) = versions();
        let m = Migration::new(v1, v2).and_then(|m| m.map("out", "q")).expect("valid");
        let moved = m.plan(&waiting(r#"["out"]"#, json!({})), &[], Timestamp(5)).expect("moves");
        assert_eq!(
            (moved.new.paths().collect::<Vec<_>>(), moved.entered),
            (vec!["q", "q.a"], vec!["q.a".to_owned()])
        );

        // A parallel state that gained a region: the region enters at its initial state.
        let regions = |v: u32, third: bool| {
            Definition::builder("m", v)
                .initial("p")
                .parallel("p", move |p| {
                    let p = p
                        .state("r1", |r| r.initial("a").leaf("a"))
                        .state("r2", |r| r.initial("b").leaf("b"));
                    if third { p.state("r3", |r| r.initial("x").leaf("x")) } else { p }
                })
                .build()
                .expect("valid")
        };
        let m = Migration::new(regions(1, false), regions(2, true)).expect("valid");
        let row = waiting(r#"["p","p.r1","p.r1.a","p.r2","p.r2.b"]"#, json!({}));
        let moved = m.plan(&row, &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.entered, ["p.r3", "p.r3.x"]);
        assert!(moved.new.check(&regions(2, true)).is_ok());
    }

    /// A move starts no child machine, so it never enters a delegation state on its own.
    #[test]
    fn a_move_that_would_enter_a_delegation_state_is_refused() {
        let v1 = Definition::builder("m", 1).initial("a").leaf("a").build().expect("valid");
        let v2 = Definition::builder("m", 2)
            .initial("g")
            .state("g", |s| {
                s.initial("paying")
                    .state("paying", |s| s.machine("payment").on_done(|b| b.target("a")))
                    .leaf("a")
            })
            .build()
            .expect("valid");
        let m = Migration::new(v1, v2).and_then(|m| m.map("a", "g")).expect("valid");
        let Err(Refusal::Illegal { reason, .. }) =
            m.plan(&waiting(r#"["a"]"#, json!({})), &[], Timestamp(5))
        else {
            panic!("expected a refusal");
        };
        assert!(reason.contains("enters delegation state `g.paying`"), "{reason}");
    }

    /// A state that delegates in the new version but not in the old one has no child
    /// machine running: moving onto it, even unmapped under its own path, is refused, while
    /// a state that was already delegating keeps its child and moves.
    #[test]
    fn a_move_onto_a_state_that_gained_a_delegation_is_refused() {
        let v1 = Definition::builder("m", 1)
            .initial("a")
            .state("a", |s| s.on_to("GO", "z"))
            .final_state("z")
            .build()
            .expect("valid");
        let v2 = Definition::builder("m", 2)
            .initial("a")
            .state("a", |s| s.machine("job").on_done(|b| b.target("z")))
            .final_state("z")
            .build()
            .expect("valid");
        let m = Migration::new(v1, v2).expect("valid");
        let Err(Refusal::Illegal { configuration, reason }) =
            m.plan(&waiting(r#"["a"]"#, json!({})), &[], Timestamp(5))
        else {
            panic!("expected a refusal");
        };
        assert_eq!(configuration, ["a"]);
        assert!(
            reason.contains("enters delegation state `a`")
                && reason.contains("(`job`)")
                && reason.contains("map the instance onto a state that does not delegate"),
            "{reason}"
        );
        let kept = Migration::new(delegating(1, "paying", "p"), delegating(2, "paying", "p"))
            .expect("valid");
        let moved = kept.plan(&waiting(r#"["paying"]"#, json!({})), &[], Timestamp(5));
        assert_eq!(moved.expect("its child keeps running").row.position, r#"["paying"]"#);
    }

    /// `p` runs regions `r1` (a → done1) and `r2` (b → done2) and leaves for `end` on
    /// `@done`.
    fn regions_to_finish(v: u32) -> Definition {
        Definition::builder("m", v)
            .initial("p")
            .parallel("p", |p| {
                p.state("r1", |r| {
                    r.initial("a").state("a", |s| s.on_to("A", "done1")).final_state("done1")
                })
                .state("r2", |r| {
                    r.initial("b").state("b", |s| s.on_to("B", "done2")).final_state("done2")
                })
                .on_done(|b| b.target("end"))
            })
            .final_state("end")
            .build()
            .expect("valid")
    }

    /// A move raises no `done` event, so moving a region onto its final state (which would
    /// complete `p`) would leave the instance waiting for ever: refused like a move into a
    /// top-level final state. A region already in its final state moves as it is.
    #[test]
    fn a_move_onto_a_nested_final_state_is_refused() {
        let m = Migration::new(regions_to_finish(1), regions_to_finish(2))
            .and_then(|m| m.map("p.r2.b", "p.r2.done2"))
            .expect("valid");
        let row = waiting(r#"["p","p.r1","p.r1.done1","p.r2","p.r2.b"]"#, json!({}));
        let refusal = m.plan(&row, &[], Timestamp(5));
        let expected = Refusal::Final { state: "p.r2.b".into(), target: "p.r2.done2".into() };
        assert_eq!(refusal, Err(expected));

        let unmapped = Migration::new(regions_to_finish(1), regions_to_finish(2)).expect("valid");
        let moved = unmapped.plan(&row, &[], Timestamp(5)).expect("moves");
        assert_eq!(moved.row.position, row.position);
    }

    /// A state that stays active keeps its live timers. One that fires without leaving it
    /// and has no row left (a targetless one-shot timer, a recurring one past its `max`)
    /// already fired, and is not armed again; one whose firing leaves the state was never
    /// armed, and is; so is a timer the new version added.
    #[test]
    fn a_move_does_not_rearm_a_timer_that_already_fired() {
        use crate::chart::Timer;
        let chart = |v: u32, nudge: bool| {
            Definition::builder("m", v)
                .initial("a")
                .state("a", move |s| {
                    let s = s
                        .on("REMIND", |t| t.action("remind").after(Timer::hours(1)))
                        .on("PING", |t| t.action("ping").every(Timer::minutes(5)).max(3))
                        .on("ESCALATE", |t| t.target("b").after(Timer::hours(3)));
                    if nudge {
                        s.on("NUDGE", |t| t.action("nudge").after(Timer::hours(2)))
                    } else {
                        s
                    }
                })
                .leaf("b")
                .build()
                .expect("valid")
        };
        let m = Migration::new(chart(1, false), chart(2, true)).expect("valid");
        let moved = m.plan(&waiting(r#"["a"]"#, json!({})), &[], Timestamp(5)).expect("moves");
        let events: Vec<_> = moved.timers.iter().map(|t| t.spec.event.as_str()).collect();
        assert_eq!(events, ["ESCALATE", "NUDGE"], "REMIND and PING fired before the move");
        assert_eq!((moved.kept, moved.armed), (0, 2));
    }

    #[test]
    fn what_cannot_be_mapped_is_refused_by_name() {
        let (v1, v2) = versions();
        let renames_only_p = Migration::new(v1.clone(), v2.clone()).and_then(|m| m.map("p", "q"));
        let m = renames_only_p.expect("valid");
        // `p.b` is carried to `q.b`, which version 2 does not have.
        let refusal = m.plan(&waiting(r#"["p","p.b"]"#, json!({})), &[], Timestamp(5));
        assert_eq!(refusal, Err(Refusal::Unmapped { state: "p.b".into() }));
        // A state mapped out of its compound parent, next to it, is no configuration: the
        // parent (entered at its initial child) and the state are both active at the top.
        let m = Migration::new(v1.clone(), v2.clone())
            .and_then(|m| m.map("p", "q"))
            .and_then(|m| m.map("p.a", "extra"))
            .expect("valid");
        let Err(Refusal::Illegal { configuration, reason }) =
            m.plan(&waiting(r#"["p","p.a"]"#, json!({})), &[], Timestamp(5))
        else {
            panic!("expected an illegal configuration");
        };
        assert_eq!(configuration, ["extra", "q", "q.a"]);
        assert!(reason.contains("compound `(root)` has 2 active children"), "{reason}");
        assert!(Migration::new(v1.clone(), v1.clone()).is_err(), "same version");
        let err = Migration::new(v1, v2).and_then(|m| m.map("nowhere", "q")).unwrap_err();
        assert!(err.to_string().contains("`nowhere` is not a state of m v1"), "{err}");
    }
}
