//! Chart definitions as JSON: the serde types of the JSON form, [`Definition::to_json`] and
//! [`ChartBuilder::from_json`].
//!
//! The JSON form holds everything the builder can express; guards stay Rust functions and are
//! referenced by name, so loading JSON yields a [`ChartBuilder`] on which the caller registers
//! the guards and calls [`ChartBuilder::build`], which runs the same validation as a chart
//! written in Rust. Loading goes through the builder's own methods, so the two cannot drift.
//!
//! Order matters in a chart (document order decides transition selection, exit and entry
//! order), and JSON objects have no order, so states and transitions are arrays:
//!
//! ```json
//! { "name": "order", "version": 1, "initial": "cart",
//!   "states": [
//!     { "key": "cart",
//!       "on": [ { "event": "CHECKOUT", "guards": ["has_items"], "target": "paid" } ] },
//!     { "key": "paid", "type": "final" } ] }
//! ```
//!
//! The JSON Schema of this form is generated from these types and committed as
//! `docs/chart-definition.schema.json` (`cargo xtask json-schema` rewrites it); a chart may name
//! it in `$schema` for editor support.
//!
//! A transition with one branch writes it inline (`guards`, `actions`, `target`,
//! `internal`); more branches go in `branches`, tried in order after the inline one (as with
//! the builder's shorthand methods followed by `.branch(…)`). A state without `type` is atomic,
//! or compound when it has `states`.

use serde::{Deserialize, Serialize};

use super::definition::{
    Branch, BranchBuilder, ChartBuilder, Definition, HistoryDef, StateBuilder, StateKind,
};
use super::timer::{Timer, TimerKind};
use super::validate::ValidationErrors;
use crate::limits;

/// The JSON form of a chart definition: its name, version and tree of states. Actions and
/// guards are referenced by name and bound in Rust.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ChartJson {
    /// Optional reference to the JSON Schema, for editors; ignored when loading.
    #[serde(rename = "$schema", default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// The definition name instances are created with.
    pub name: String,
    /// The definition version; instances stay pinned to the version they started on.
    pub version: u32,
    /// The key of the initial top-level state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<String>,
    /// The top-level states, in document order.
    #[serde(default)]
    pub states: Vec<StateJson>,
}

/// One state and its subtree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct StateJson {
    /// The key within the parent (non-empty, without `.`); the state's id is the dotted path
    /// of keys from the top.
    pub key: String,
    /// `parallel` (children are regions, all active together) or `final`. Without it the
    /// state is `atomic`, or `compound` when it has `states`; writing `atomic` or `compound`
    /// explicitly is allowed and checked against `states`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<StateKind>,
    /// The key of the initial child (required for compound states).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<String>,
    /// Entry action names, run in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entry: Vec<String>,
    /// Exit action names, run in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exit: Vec<String>,
    /// Event transitions, in document order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on: Vec<TransitionJson>,
    /// Eventless branches, tried in order after every microstep.
    #[serde(rename = "@always", default, skip_serializing_if = "Vec::is_empty")]
    pub always: Vec<BranchJson>,
    /// Branches taken when the state is done (a final child reached, every region final, or
    /// the child machine finished); the first whose guards hold wins.
    #[serde(rename = "@done", default, skip_serializing_if = "Vec::is_empty")]
    pub done: Vec<BranchJson>,
    /// Branches taken when work owned by the state failed for good.
    #[serde(rename = "@fail", default, skip_serializing_if = "Vec::is_empty")]
    pub fail: Vec<BranchJson>,
    /// The child machine this state delegates to: entering the state starts it, leaving the
    /// state cancels it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<String>,
    /// The child machine's deadline; requires `@timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Timer>,
    /// History pseudo-states, targeted as `<this state's path>.<key>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<HistoryDef>,
    /// Branches taken when `timeout` passes before the child machine finished.
    #[serde(rename = "@timeout", default, skip_serializing_if = "Vec::is_empty")]
    pub on_timeout: Vec<BranchJson>,
    /// Child states (regions, for a parallel state), in document order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<StateJson>,
}

/// The transitions a state has for one event, with an optional timer that delivers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TransitionJson {
    /// The event name.
    pub event: String,
    /// Guards of the inline branch; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guards: Vec<String>,
    /// Actions of the inline branch, run in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<String>,
    /// Target of the inline branch: a sibling or ancestor's sibling key, `.child`, or a full
    /// dotted path; a history pseudo-state is named like a state, and one target per region
    /// of a parallel state may be given, separated by spaces. Without it the branch only runs
    /// its actions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The inline branch does not exit and re-enter the source for a descendant target.
    #[serde(default, skip_serializing_if = "is_false")]
    pub internal: bool,
    /// Further branches, tried in order after the inline one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub branches: Vec<BranchJson>,
    /// A one-shot timer: the event is delivered this long after the state was entered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Timer>,
    /// A recurring timer: the event is delivered at this interval while the state is active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<Timer>,
    /// With `every`: stop after this many fires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u32>,
    /// With `every` and `max`: the event sent once after the last fire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub then: Option<String>,
    /// With a timer: instances already waiting keep the duration they were armed with
    /// when a later deploy changes it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub keep_armed: bool,
}

/// One guarded alternative: if every guard holds, run the actions and go to the target.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BranchJson {
    /// Guard names, registered in Rust with `ChartBuilder::guard`; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guards: Vec<String>,
    /// Action names, run in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<String>,
    /// The target, written as for the inline branch (several separated by spaces); without it
    /// the branch only runs its actions (no exit, no entry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Do not exit and re-enter the source for a descendant target.
    #[serde(default, skip_serializing_if = "is_false")]
    pub internal: bool,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference.
fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a JSON chart could not be loaded. Every variant names the place: a line and column
/// for malformed JSON, the state path for everything else.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefinitionJsonError {
    /// The text is larger than [`limits::DEFINITION_JSON_BYTES_MAX`].
    #[error(
        "chart JSON is {bytes} bytes, more than the limit of {max} bytes; fix: split the chart into child machines"
    )]
    TooLarge {
        /// The size of the text.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Not JSON, or JSON whose shape does not match the schema (unknown field, wrong type,
    /// missing `name`…).
    #[error(
        "chart JSON at line {line}, column {column}: {message}; fix: follow the chart JSON schema"
    )]
    Malformed {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// What the parser expected.
        message: String,
    },
    /// A state whose fields contradict each other in a way the builder cannot express.
    #[error("state `{state}`: {problem}; fix: {fix}")]
    State {
        /// The state path (`(root)` for the top level).
        state: String,
        /// What is wrong.
        problem: String,
        /// How to fix it.
        fix: String,
    },
    /// The chart is well-formed JSON but not a valid chart (unknown target, missing initial…):
    /// what [`ChartBuilder::build`] reports, converted by `?` so that a loader can return one
    /// error type.
    #[error(transparent)]
    Invalid(#[from] ValidationErrors),
}

impl ChartJson {
    /// Every guard name the chart references, sorted: what a caller must register before
    /// [`ChartBuilder::build`] (tools that only draw or inspect a chart register
    /// placeholders under these names).
    pub fn guard_names(&self) -> std::collections::BTreeSet<String> {
        fn state(s: &StateJson, out: &mut std::collections::BTreeSet<String>) {
            for t in &s.on {
                out.extend(t.guards.iter().cloned());
                for b in &t.branches {
                    out.extend(b.guards.iter().cloned());
                }
            }
            for list in [&s.always, &s.done, &s.fail, &s.on_timeout] {
                for b in list {
                    out.extend(b.guards.iter().cloned());
                }
            }
            for child in &s.states {
                state(child, out);
            }
        }
        let mut out = std::collections::BTreeSet::new();
        for s in &self.states {
            state(s, &mut out);
        }
        out
    }
}

impl Definition {
    /// The JSON form of this definition; [`ChartBuilder::from_json`] of it, with the same
    /// guards registered, builds a definition with the same structure.
    pub fn to_chart_json(&self) -> ChartJson {
        let root = &self.states[0];
        ChartJson {
            schema: None,
            name: self.name.clone(),
            version: self.version,
            initial: root.initial.map(|i| self.states[i].key.clone()),
            states: root.children.iter().map(|&c| self.state_json(c)).collect(),
        }
    }

    /// The JSON form of this definition as pretty-printed text.
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(&self.to_chart_json())
            .expect("chart JSON holds only strings, numbers and arrays");
        text.push('\n');
        text
    }

    fn state_json(&self, s: usize) -> StateJson {
        let node = &self.states[s];
        let branches = |list: &[Branch]| list.iter().map(BranchJson::from).collect::<Vec<_>>();
        StateJson {
            key: node.key.clone(),
            kind: match node.kind {
                StateKind::Atomic | StateKind::Compound => None,
                kind @ (StateKind::Parallel | StateKind::Final) => Some(kind),
            },
            initial: node.initial.map(|i| self.states[i].key.clone()),
            entry: node.entry.clone(),
            exit: node.exit.clone(),
            on: node
                .on
                .iter()
                .map(|t| {
                    let mut json = match t.branches.as_slice() {
                        [only] => {
                            let b = BranchJson::from(only);
                            TransitionJson::inline(t.event.clone(), b)
                        }
                        many => TransitionJson {
                            branches: branches(many),
                            ..TransitionJson::inline(t.event.clone(), BranchJson::default())
                        },
                    };
                    if let Some(spec) = &t.timer {
                        match spec.kind {
                            TimerKind::After => json.after = Some(spec.timer),
                            TimerKind::Every => json.every = Some(spec.timer),
                        }
                        json.max = spec.max;
                        json.then.clone_from(&spec.then);
                        json.keep_armed = spec.keep_armed;
                    }
                    json
                })
                .collect(),
            always: branches(&node.always),
            done: branches(&node.on_done),
            fail: branches(&node.on_fail),
            machine: node.delegation.as_ref().map(|d| d.machine.clone()),
            timeout: node.delegation.as_ref().and_then(|d| d.timeout),
            on_timeout: branches(&node.on_timeout),
            history: node.history.clone(),
            states: node.children.iter().map(|&c| self.state_json(c)).collect(),
        }
    }

    /// Whether `other` is the same chart: same name, version, states, transitions (as
    /// written and as resolved), guard names and warnings. Guards are functions, so only
    /// their names are compared.
    pub fn same_structure(&self, other: &Definition) -> bool {
        self.name == other.name
            && self.version == other.version
            && self.states == other.states
            && self.transitions == other.transitions
            && self.guards.keys().eq(other.guards.keys())
            && self.by_path == other.by_path
            && self.histories == other.histories
            && self.warnings == other.warnings
    }
}

#[cfg(feature = "json-schema")]
impl ChartJson {
    /// The JSON Schema of the JSON form, generated from these types (a copy is committed
    /// as `docs/chart-definition.schema.json`).
    pub fn json_schema() -> serde_json::Value {
        let mut schema = schemars::schema_for!(ChartJson).to_value();
        if let Some(object) = schema.as_object_mut() {
            object.insert("title".to_owned(), "Keel chart definition".into());
        }
        schema
    }
}

impl TransitionJson {
    fn inline(event: String, b: BranchJson) -> Self {
        Self {
            event,
            guards: b.guards,
            actions: b.actions,
            target: b.target,
            internal: b.internal,
            branches: Vec::new(),
            after: None,
            every: None,
            max: None,
            then: None,
            keep_armed: false,
        }
    }
}

impl From<&Branch> for BranchJson {
    fn from(b: &Branch) -> Self {
        Self {
            guards: b.guards.clone(),
            actions: b.actions.clone(),
            target: b.target.clone(),
            internal: b.internal,
        }
    }
}

impl BranchJson {
    fn apply(&self, mut b: BranchBuilder) -> BranchBuilder {
        for guard in &self.guards {
            b = b.guard(guard);
        }
        for action in &self.actions {
            b = b.action(action);
        }
        if let Some(target) = &self.target {
            b = b.target(target);
        }
        if self.internal {
            b = b.internal();
        }
        b
    }
}

impl ChartBuilder {
    /// Reads a chart from its JSON form. Register the guards it names with
    /// [`guard`](Self::guard) (or [`guards_from`](Self::guards_from)), then
    /// [`build`](Self::build) validates it exactly like a chart written in Rust.
    ///
    /// ```
    /// use keel_core::chart::ChartBuilder;
    /// let json = r#"{ "name": "door", "version": 1, "initial": "closed", "states": [
    ///     { "key": "closed", "on": [ { "event": "OPEN", "guards": ["unlocked"], "target": "open" } ] },
    ///     { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] }"#;
    /// let def = ChartBuilder::from_json(json).unwrap().guard("unlocked", |_, _| true).build().unwrap();
    /// assert_eq!(def.event_alphabet(), ["CLOSE", "OPEN"]);
    /// ```
    pub fn from_json(text: &str) -> Result<ChartBuilder, DefinitionJsonError> {
        if text.len() > limits::DEFINITION_JSON_BYTES_MAX {
            return Err(DefinitionJsonError::TooLarge {
                bytes: text.len(),
                max: limits::DEFINITION_JSON_BYTES_MAX,
            });
        }
        // Parsing straight from the text (not through a `Value`) keeps the line and column
        // of shape errors. serde_json's recursion limit bounds how deeply states can nest.
        let chart: ChartJson =
            serde_json::from_str(text).map_err(|e| DefinitionJsonError::Malformed {
                line: e.line(),
                column: e.column(),
                message: strip_position(&e.to_string()),
            })?;
        Self::from_chart_json(&chart)
    }

    /// Builds from the parsed JSON form; see [`from_json`](Self::from_json).
    pub fn from_chart_json(chart: &ChartJson) -> Result<ChartBuilder, DefinitionJsonError> {
        let mut builder = ChartBuilder::new(chart.name.clone(), chart.version);
        if let Some(initial) = &chart.initial {
            builder = builder.initial(initial);
        }
        for state in &chart.states {
            builder.root = builder.root.child(state_builder(state, "")?);
        }
        Ok(builder)
    }

    /// Registers every guard `def` has, e.g. to load a new JSON version of a chart whose
    /// guards are already bound in Rust.
    pub fn guards_from(mut self, def: &Definition) -> Self {
        for (name, guard) in &def.guards {
            self.guards.insert(name.clone(), guard.clone());
        }
        self
    }
}

/// serde_json appends " at line L column C" to its messages; the error carries both already.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

/// The builder of `json` and its subtree; `parent_path` is the parent's path. It is made the
/// way the builder's `state`, `parallel` and `final_with` make a child, so a chart read from
/// JSON and one written in Rust go through identical steps.
fn state_builder(json: &StateJson, parent_path: &str) -> Result<StateBuilder, DefinitionJsonError> {
    let path = if parent_path.is_empty() {
        json.key.clone()
    } else {
        format!("{parent_path}.{}", json.key)
    };
    let state_error = |problem: &str, fix: &str| DefinitionJsonError::State {
        state: path.clone(),
        problem: problem.to_owned(),
        fix: fix.to_owned(),
    };
    match (json.kind, json.states.is_empty()) {
        (Some(StateKind::Atomic), false) => {
            return Err(state_error(
                "has `type: atomic` and child `states`",
                "drop `type` (a state with children is compound) or remove the children",
            ));
        }
        (Some(StateKind::Compound), true) => {
            return Err(state_error(
                "has `type: compound` but no child `states`",
                "add child states with an `initial`, or drop `type`",
            ));
        }
        _ => {}
    }
    match (json.timeout, json.on_timeout.is_empty()) {
        (Some(_), true) => {
            return Err(state_error(
                "has `timeout` but no `@timeout` branches",
                "add the `@timeout` branches to take when the deadline passes, or drop `timeout`",
            ));
        }
        (None, false) => {
            return Err(state_error(
                "has `@timeout` branches but no `timeout`",
                "add `timeout`, the child machine's deadline",
            ));
        }
        _ => {}
    }
    // A compound state starts atomic and becomes compound with its first child, as in the
    // builder.
    let kind = match json.kind {
        Some(kind @ (StateKind::Parallel | StateKind::Final)) => kind,
        _ => StateKind::Atomic,
    };
    let mut state = configure(StateBuilder::new(json.key.clone(), kind), json);
    for child in &json.states {
        state = state.child(state_builder(child, &path)?);
    }
    Ok(state)
}

/// Applies everything but the children, through the builder's public methods.
fn configure(mut s: StateBuilder, json: &StateJson) -> StateBuilder {
    if let Some(initial) = &json.initial {
        s = s.initial(initial);
    }
    for action in &json.entry {
        s = s.entry(action);
    }
    for action in &json.exit {
        s = s.exit(action);
    }
    for t in &json.on {
        s = s.on(t.event.clone(), |mut tb| {
            let inline =
                t.target.is_some() || !t.guards.is_empty() || !t.actions.is_empty() || t.internal;
            if inline {
                for guard in &t.guards {
                    tb = tb.guard(guard);
                }
                for action in &t.actions {
                    tb = tb.action(action);
                }
                if let Some(target) = &t.target {
                    tb = tb.target(target);
                }
                if t.internal {
                    tb = tb.internal();
                }
            }
            for b in &t.branches {
                tb = tb.branch(|bb| b.apply(bb));
            }
            if let Some(after) = t.after {
                tb = tb.after(after);
            }
            if let Some(every) = t.every {
                tb = tb.every(every);
            }
            if let Some(max) = t.max {
                tb = tb.max(max);
            }
            if let Some(then) = &t.then {
                tb = tb.then(then);
            }
            if t.keep_armed {
                tb = tb.keep_armed();
            }
            tb
        });
    }
    for b in &json.always {
        s = s.always(|bb| b.apply(bb));
    }
    for b in &json.done {
        s = s.on_done(|bb| b.apply(bb));
    }
    for b in &json.fail {
        s = s.on_fail(|bb| b.apply(bb));
    }
    if let Some(machine) = &json.machine {
        s = s.machine(machine);
    }
    for h in &json.history {
        s = s.history(h.key.clone(), h.depth, h.default.clone());
    }
    if let Some(timeout) = json.timeout {
        for b in &json.on_timeout {
            s = s.on_timeout(timeout, |bb| b.apply(bb));
        }
    }
    s
}

/// Panics unless `def` → JSON → builder (with `def`'s guards) → definition gives the same
/// structure. Test builds call it for every chart they build.
#[cfg(any(test, feature = "json-round-trip-check"))]
pub(crate) fn assert_round_trip(def: &Definition) {
    let text = def.to_json();
    let builder = ChartBuilder::from_json(&text)
        .unwrap_or_else(|e| {
            panic!("chart `{}` does not load from its own JSON: {e}\n{text}", def.name)
        })
        .guards_from(def);
    let again = super::validate::build_unchecked(builder).unwrap_or_else(|e| {
        panic!("chart `{}` does not rebuild from its own JSON: {e}\n{text}", def.name)
    });
    assert!(
        def.same_structure(&again),
        "chart `{}` changed in a JSON round trip\nbefore: {def:?} {:?}\nafter:  {again:?} {:?}\njson: {text}",
        def.name,
        def.states,
        again.states
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loads `json`, registering guard `g`, and returns the error text (or "ok").
    fn load(json: &str) -> String {
        match ChartBuilder::from_json(json) {
            Err(e) => e.to_string(),
            Ok(b) => match b.guard("g", |_, _| true).build() {
                Ok(_) => "ok".to_owned(),
                Err(e) => e.to_string(),
            },
        }
    }

    /// One loading case: the chart's `states` array and a piece of the expected error.
    fn check(states: &str, expected: &str) {
        let json = format!(r#"{{"name": "t", "version": 1, "initial": "a", "states": {states}}}"#);
        let got = load(&json);
        assert!(got.contains(expected), "{states}\n  expected: {expected}\n  got: {got}");
    }

    #[test]
    fn loading_errors_name_the_place_and_the_fix() {
        check(r#"[{"key": "a"}]"#, "ok");
        // Malformed JSON and shape errors carry the line and column.
        check(r#"[{"key": "a",}]"#, "line 1, column 68: trailing comma");
        check(r#"[{"key": "a", "tagret": "b"}]"#, "line 1, column 76: unknown field `tagret`");
        check(r#"[{"key": "a", "type": "history"}]"#, "unknown variant `history`");
        check(
            r#"[{"key": "a", "on": [{"event": "E", "after": {"amount": 1, "unit": "fortnights"}}]}]"#,
            "unknown variant `fortnights`",
        );
        // What the builder cannot express is refused with the state path.
        check(
            r#"[{"key": "a", "type": "atomic", "initial": "x", "states": [{"key": "x"}]}]"#,
            "state `a`: has `type: atomic` and child `states`; fix: drop `type`",
        );
        check(r#"[{"key": "a", "type": "compound"}]"#, "state `a`: has `type: compound` but no");
        check(
            r#"[{"key": "a", "initial": "b", "states": [{"key": "b", "machine": "m", "timeout": {"amount": 1, "unit": "hours"}}]}]"#,
            "state `a.b`: has `timeout` but no `@timeout` branches",
        );
        check(
            r#"[{"key": "a", "machine": "m", "@timeout": [{"target": "a"}]}]"#,
            "state `a`: has `@timeout` branches but no `timeout`; fix: add `timeout`",
        );
        // An `initial` that could never be used is refused, not ignored.
        check(
            r#"[{"key": "a", "initial": "x"}]"#,
            "state `a` names initial `x` but has no child states, so there is nothing to start in; fix: add the child states",
        );
        check(
            r#"[{"key": "a", "type": "final", "initial": "x"}]"#,
            "state `a` names initial `x` but has no child states",
        );
        check(
            r#"[{"key": "a", "type": "parallel", "initial": "r", "states": [
                {"key": "r", "initial": "x", "states": [{"key": "x"}]},
                {"key": "s", "initial": "y", "states": [{"key": "y"}]}]}]"#,
            "parallel state `a` names initial `r`, but a parallel state enters all of its regions at once; fix: drop `initial`",
        );
        // Everything else is the builder's own validation, naming the state path.
        check(
            r#"[{"key": "a", "initial": "b", "states": [{"key": "b", "on": [{"event": "E", "target": "nowhere"}]}]}]"#,
            "state `a.b`: transition on `E` targets unknown state `nowhere`",
        );
        check(
            r#"[{"key": "a", "on": [{"event": "E", "guards": ["unbound"], "target": "a"}]}]"#,
            "uses unknown guard `unbound`; fix: register it",
        );
        check(
            r#"[{"key": "a", "on": [{"event": "E", "max": 3}]}]"#,
            "transition on `E` has `max` but no `every` timer",
        );
        check(
            r#"[{"key": "a", "on": [{"event": "E", "after": {"amount": 1, "unit": "days"}, "every": {"amount": 1, "unit": "days"}}]}]"#,
            "has both `after` and `every`",
        );
        check(r#"[{"key": "a.b"}]"#, "state key `a.b` under `(root)` is invalid");
        check(r#"[{"key": "a", "type": "final", "@done": [{"target": "a"}]}]"#, "final state `a`");
        check(r#"[{"key": "a", "type": "parallel", "states": [{"key": "r"}]}]"#, "1 region(s)");
    }

    #[test]
    fn inline_and_listed_branches_follow_the_builder() {
        let json = r#"{"name": "t", "version": 1, "initial": "a", "states": [
            {"key": "a", "on": [{"event": "E", "guards": ["g"], "target": "b",
                                 "branches": [{"actions": ["x"], "target": "c"}]}]},
            {"key": "b"}, {"key": "c"}]}"#;
        let from_json = ChartBuilder::from_json(json).unwrap().guard("g", |_, _| true).build();
        let from_rust = Definition::builder("t", 1)
            .guard("g", |_, _| true)
            .initial("a")
            .state("a", |s| {
                s.on("E", |t| t.guard("g").target("b").branch(|b| b.action("x").target("c")))
            })
            .leaf("b")
            .leaf("c")
            .build();
        assert!(from_json.unwrap().same_structure(&from_rust.unwrap()));
    }

    #[test]
    fn text_at_the_size_bound_is_read_and_above_it_refused() {
        let chart = r#"{"name": "t", "version": 1, "initial": "a", "states": [{"key": "a"}]}"#;
        let padded = |len: usize| format!("{chart}{}", " ".repeat(len - chart.len()));
        assert!(ChartBuilder::from_json(&padded(limits::DEFINITION_JSON_BYTES_MAX)).is_ok());
        let e =
            ChartBuilder::from_json(&padded(limits::DEFINITION_JSON_BYTES_MAX + 1)).unwrap_err();
        assert!(matches!(e, DefinitionJsonError::TooLarge { .. }), "{e}");
    }

    #[test]
    fn nesting_deeper_than_the_parser_allows_is_an_error_not_a_crash() {
        let depth = 200;
        let mut states = String::from(r#"[{"key": "leaf"}]"#);
        for _ in 0..depth {
            states = format!(r#"[{{"key": "s", "initial": "s", "states": {states}}}]"#);
        }
        let got =
            load(&format!(r#"{{"name": "t", "version": 1, "initial": "s", "states": {states}}}"#));
        assert!(got.contains("recursion limit exceeded"), "{got}");
    }
}
