//! The context API actions use: a JSON object with change tracking and raised events.
//!
//! The engine keeps the context as JSON so it can persist it and diff it; users get typed
//! access through serde (`get_as`, `set_from`). An action works on its own [`ChartContext`]
//! (a copy of the macrostep's context) and hands back an [`ActionResult`] holding only the
//! keys it changed and the events it raised, which is what the macrostep applies.

use std::collections::BTreeSet;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::Event;

/// What an action produced: the top-level keys it changed (`None` = removed) and the events it
/// raised, in order. Feed it to
/// [`Macrostep::handle_action_result`](super::Macrostep::handle_action_result).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, Serialize)]
pub struct ActionResult {
    /// Changed top-level keys with their new value; `None` means the key was removed.
    pub changes: Vec<(String, Option<Value>)>,
    /// Events raised by the action, processed (in order) before the next external event.
    pub raised: Vec<Event>,
}

impl ActionResult {
    /// An action that changed nothing and raised nothing.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Adds one raised event.
    pub fn raise(mut self, event: impl Into<Event>) -> Self {
        self.raised.push(event.into());
        self
    }

    /// Adds one changed key.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.changes.push((key.into(), Some(value.into())));
        self
    }
}

/// A JSON-object context with change tracking, given to actions (and, read-only, to guards).
///
/// ```
/// use keel_core::chart::ChartContext;
/// let mut ctx = ChartContext::new(serde_json::json!({"total": 10}));
/// ctx.set("paid", true);
/// assert_eq!(ctx.get_as::<i64>("total"), Some(10));
/// assert_eq!(ctx.changed_keys().collect::<Vec<_>>(), ["paid"]);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChartContext {
    data: Map<String, Value>,
    changed: BTreeSet<String>,
    raised: Vec<Event>,
}

impl ChartContext {
    /// Wraps a JSON value; anything but an object becomes an empty object (a chart context is
    /// always a key/value map so that changes can be tracked per key).
    pub fn new(value: Value) -> Self {
        let data = match value {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        Self { data, changed: BTreeSet::new(), raised: Vec::new() }
    }

    /// Serializes a typed context. Fails when `C` does not serialize to a JSON object.
    pub fn from_serialize<C: Serialize>(context: &C) -> Result<Self, serde_json::Error> {
        match serde_json::to_value(context)? {
            Value::Object(map) => Ok(Self { data: map, ..Self::default() }),
            other => Err(serde::ser::Error::custom(format!(
                "a chart context must serialize to a JSON object, got `{other}`; wrap it in a struct"
            ))),
        }
    }

    /// The value of a top-level key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.data.get(key)
    }

    /// The value of a top-level key deserialized as `T`; `None` when absent or of another shape.
    pub fn get_as<T: DeserializeOwned>(&self, key: &str) -> Option<T> {
        self.data.get(key).and_then(|v| T::deserialize(v).ok())
    }

    /// The whole context deserialized as `C`.
    pub fn to_typed<C: DeserializeOwned>(&self) -> Result<C, serde_json::Error> {
        C::deserialize(&Value::Object(self.data.clone()))
    }

    /// Sets a top-level key and marks it changed.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        let key = key.into();
        self.data.insert(key.clone(), value.into());
        self.changed.insert(key);
    }

    /// Sets a top-level key from any serializable value and marks it changed.
    pub fn set_from<T: Serialize>(
        &mut self,
        key: impl Into<String>,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        let value = serde_json::to_value(value)?;
        self.set(key, value);
        Ok(())
    }

    /// Removes a top-level key (marking it changed when it existed) and returns its value.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let old = self.data.remove(key);
        if old.is_some() {
            self.changed.insert(key.to_owned());
        }
        old
    }

    /// Raises an internal event: it is processed after the current microstep and before the
    /// next external event.
    pub fn raise(&mut self, event: impl Into<Event>) {
        self.raised.push(event.into());
    }

    /// Top-level keys changed since this context was created, sorted.
    pub fn changed_keys(&self) -> impl Iterator<Item = &str> {
        self.changed.iter().map(String::as_str)
    }

    /// Events raised so far, in order.
    pub fn raised(&self) -> &[Event] {
        &self.raised
    }

    /// The context as a JSON object.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.data
    }

    /// The context as a JSON value (a copy).
    pub fn to_value(&self) -> Value {
        Value::Object(self.data.clone())
    }

    /// The changes and raised events, ready for the macrostep.
    pub fn into_result(self) -> ActionResult {
        let changes = self.changed.into_iter().map(|k| {
            let v = self.data.get(&k).cloned();
            (k, v)
        });
        ActionResult { changes: changes.collect(), raised: self.raised }
    }

    /// Applies an action's changes (not its raised events) and tracks the keys as changed.
    pub fn apply(&mut self, result: &ActionResult) {
        for (key, value) in &result.changes {
            if let Some(v) = value {
                self.set(key.clone(), v.clone());
            } else {
                self.data.remove(key);
                self.changed.insert(key.clone());
            }
        }
    }
}

/// A [`ChartContext`] shared between an action and the code that runs it: what an async
/// action receives (clone it freely; the lock is only held inside each method, never
/// across an `.await`). The runtime and `TestMachine` both hand actions this handle.
#[derive(Debug, Clone, Default)]
pub struct SharedContext {
    inner: std::sync::Arc<std::sync::Mutex<ChartContext>>,
}

impl SharedContext {
    /// Wraps a context.
    pub fn new(context: ChartContext) -> Self {
        Self { inner: std::sync::Arc::new(std::sync::Mutex::new(context)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ChartContext> {
        // A panicking action poisons the lock; the data is still the best we have.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A copy of the value of a top-level key.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.lock().get(key).cloned()
    }

    /// The value of a top-level key deserialized as `T`.
    pub fn get_as<T: DeserializeOwned>(&self, key: &str) -> Option<T> {
        self.lock().get_as(key)
    }

    /// Sets a top-level key.
    pub fn set(&self, key: impl Into<String>, value: impl Into<Value>) {
        self.lock().set(key, value);
    }

    /// Sets a top-level key from any serializable value.
    pub fn set_from<T: Serialize>(
        &self,
        key: impl Into<String>,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        self.lock().set_from(key, value)
    }

    /// Removes a top-level key.
    pub fn remove(&self, key: &str) -> Option<Value> {
        self.lock().remove(key)
    }

    /// Raises an internal event, processed within the same macrostep.
    pub fn raise(&self, event: impl Into<Event>) {
        self.lock().raise(event);
    }

    /// What the action did: the changes and raised events, for `handle_action_result`.
    pub fn to_result(&self) -> ActionResult {
        self.lock().clone().into_result()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn tracks_changes_and_raises() {
        let mut ctx = ChartContext::new(json!({"a": 1, "b": 2}));
        ctx.set("c", 3);
        assert_eq!(ctx.remove("a"), Some(json!(1)));
        assert_eq!(ctx.remove("zzz"), None);
        ctx.raise("DONE");
        ctx.set_from("d", &vec![1, 2]).unwrap();
        let result = ctx.clone().into_result();
        assert_eq!(
            result.changes,
            vec![
                ("a".to_owned(), None),
                ("c".to_owned(), Some(json!(3))),
                ("d".to_owned(), Some(json!([1, 2]))),
            ]
        );
        assert_eq!(result.raised, vec![Event::new("DONE")]);
        let mut other = ChartContext::new(json!({"a": 1, "b": 2}));
        other.apply(&result);
        assert_eq!(other.to_value(), ctx.to_value());
        assert_eq!(other.get_as::<Vec<i32>>("d"), Some(vec![1, 2]));
    }

    #[test]
    fn typed_context_must_be_an_object() {
        #[derive(Serialize)]
        struct Order {
            total: u32,
        }
        assert_eq!(
            ChartContext::from_serialize(&Order { total: 3 }).unwrap().get_as::<u32>("total"),
            Some(3)
        );
        let err = ChartContext::from_serialize(&5).unwrap_err().to_string();
        assert!(err.contains("JSON object"), "{err}");
    }
}
