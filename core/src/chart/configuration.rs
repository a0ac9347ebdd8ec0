//! The set of active states, as the runtime persists it.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::definition::{Definition, StateKind};

/// The active states of an instance: a sorted set of dotted state paths (every active state,
/// not only the leaves; the root is implicit). Serializes as a sorted JSON array, e.g.
/// `["processing", "processing.inventory", "processing.inventory.checking", …]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Configuration {
    active: BTreeSet<String>,
}

impl Configuration {
    /// No active state: the configuration of an instance that was never started.
    pub fn empty() -> Self {
        Self::default()
    }

    /// A configuration from paths (not checked; see [`check`](Self::check)).
    pub fn from_paths<I: IntoIterator<Item = S>, S: Into<String>>(paths: I) -> Self {
        Self { active: paths.into_iter().map(Into::into).collect() }
    }

    /// The configuration as an instance's position: the sorted JSON array of active paths,
    /// e.g. `["processing","processing.inventory"]`. The durable runtime stores this for
    /// a waiting instance and for a finished one alike.
    pub fn position(&self) -> String {
        Value::from(self.active.iter().map(String::as_str).collect::<Vec<_>>()).to_string()
    }

    /// Whether no state is active.
    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    /// Whether the state at `path` is active.
    pub fn contains(&self, path: &str) -> bool {
        self.active.contains(path)
    }

    /// Every active path, sorted.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.active.iter().map(String::as_str)
    }

    /// The active atomic and final states, in document order.
    pub fn leaves(&self, def: &Definition) -> Vec<String> {
        def.states()
            .filter(|s| s.children.is_empty() && self.active.contains(&s.path))
            .map(|s| s.path.clone())
            .collect()
    }

    /// Whether a top-level final state is active (the instance has completed).
    pub fn is_final(&self, def: &Definition) -> bool {
        def.states[0]
            .children
            .iter()
            .any(|&c| def.kind(c) == StateKind::Final && self.active.contains(def.path(c)))
    }

    /// Checks that the configuration is legal for `def`: every path exists, the ancestors of
    /// active states are active, exactly one child of each active compound state (and of the
    /// root) is active, and every region of an active parallel state is active.
    pub fn check(&self, def: &Definition) -> Result<(), String> {
        for path in &self.active {
            let Some(&id) = def.by_path.get(path) else {
                return Err(format!("unknown state `{path}`"));
            };
            if let Some(p) = def.parent(id).filter(|&p| p != 0)
                && !self.active.contains(def.path(p))
            {
                return Err(format!("`{path}` is active but its parent `{}` is not", def.path(p)));
            }
        }
        for (id, node) in def.states.iter().enumerate() {
            if id != 0 && !self.active.contains(&node.path) {
                continue;
            }
            let active =
                node.children.iter().filter(|&&c| self.active.contains(def.path(c))).count();
            match node.kind {
                StateKind::Compound if active != 1 => {
                    let name = if id == 0 { "(root)" } else { &node.path };
                    return Err(format!(
                        "compound `{name}` has {active} active children, expected exactly 1"
                    ));
                }
                StateKind::Parallel if active != node.children.len() => {
                    return Err(format!(
                        "parallel `{}` has {active} of {} regions active",
                        node.path,
                        node.children.len()
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The XState-style state value: a string for an atomic active child, an object for
    /// compound and parallel children, e.g. `{"processing": {"inventory": "checking", …}}`.
    pub fn state_value(&self, def: &Definition) -> Value {
        self.value_of(def, 0)
    }

    fn value_of(&self, def: &Definition, id: usize) -> Value {
        let node = &def.states[id];
        let active: Vec<usize> =
            node.children.iter().copied().filter(|&c| self.active.contains(def.path(c))).collect();
        if node.kind == StateKind::Compound
            && let [c] = active[..]
            && def.states[c].children.is_empty()
        {
            return Value::String(def.states[c].key.clone());
        }
        let map: Map<String, Value> = active
            .into_iter()
            .map(|c| (def.states[c].key.clone(), self.value_of(def, c)))
            .collect();
        Value::Object(map)
    }

    /// XState's `matches`: `"a"` or `"a.b"` is active, or every key of an object pattern is
    /// active and its value matches below it, e.g. `{"processing": {"payment": "charged"}}`.
    pub fn matches(&self, pattern: &Value) -> bool {
        self.matches_below("", pattern)
    }

    fn matches_below(&self, scope: &str, pattern: &Value) -> bool {
        let join = |k: &str| {
            if scope.is_empty() { k.to_owned() } else { format!("{scope}.{k}") }
        };
        match pattern {
            Value::String(s) => self.active.contains(&join(s)),
            Value::Object(map) => map.iter().all(|(k, v)| {
                let path = join(k);
                self.active.contains(&path) && self.matches_below(&path, v)
            }),
            _ => false,
        }
    }

    pub(crate) fn to_ids(&self, def: &Definition) -> Result<BTreeSet<usize>, String> {
        let mut ids = BTreeSet::from([0]);
        for path in &self.active {
            ids.insert(*def.by_path.get(path).ok_or_else(|| format!("unknown state `{path}`"))?);
        }
        Ok(ids)
    }

    pub(crate) fn from_ids(def: &Definition, ids: &BTreeSet<usize>) -> Self {
        Self { active: ids.iter().filter(|&&i| i != 0).map(|&i| def.path(i).to_owned()).collect() }
    }
}
