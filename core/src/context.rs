//! Context diff and merge for parallel regions.
//!
//! A dispatched region runs against a snapshot of the context, then reports only what it
//! changed: a [`ContextDiff`] over the top-level keys. The parent applies that diff to its
//! *fresh* context, last writer wins, and reports the keys a sibling region had already
//! changed since dispatch (fresh value ≠ baseline value) so the overwrite shows up in
//! history as `PARALLEL_CONTEXT_CONFLICT`. Conflict detection is observational: it never
//! blocks the merge.
//!
//! ```
//! use serde_json::json;
//! use keel_core::context::{diff, merge};
//!
//! let baseline = json!({"total": 0});
//! let region = diff(&baseline, &json!({"total": 0, "paid": true})).unwrap();
//! let merged = merge(&json!({"total": 5}), &region, &baseline).unwrap();
//! assert_eq!(merged.context, json!({"total": 5, "paid": true}));
//! assert!(merged.conflicted_keys.is_empty());
//! ```

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// What a region changed in the context, by top-level key.
///
/// The three parts are disjoint: a key is changed, added or removed, never two of these.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextDiff {
    /// Keys present before and after, with the new value.
    pub changed: BTreeMap<String, Value>,
    /// Keys absent before and present after, with their value.
    pub added: BTreeMap<String, Value>,
    /// Keys present before and absent after.
    pub removed: BTreeSet<String>,
}

impl ContextDiff {
    /// True when the region changed nothing.
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.added.is_empty() && self.removed.is_empty()
    }

    /// Every key the diff touches, in sorted order.
    pub fn keys(&self) -> BTreeSet<&str> {
        self.changed
            .keys()
            .chain(self.added.keys())
            .chain(self.removed.iter())
            .map(String::as_str)
            .collect()
    }
}

/// The context after a merge, and the keys whose overwrite should be recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeResult {
    /// The fresh context with the diff applied (always a JSON object).
    pub context: Value,
    /// Keys in the diff that a sibling had already changed since the baseline, sorted.
    pub conflicted_keys: Vec<String>,
}

/// An argument that is not a JSON object; contexts are always objects at the top level.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid context: argument `{argument}` must be a JSON object, got {found}")]
pub struct ContextError {
    /// Which argument was wrong (`before`, `after`, `fresh`, `baseline`).
    pub argument: &'static str,
    /// The JSON type that was given instead.
    pub found: &'static str,
}

/// Computes what changed between two contexts at the level of top-level keys.
///
/// A key whose value changed anywhere inside it counts as changed as a whole: regions are
/// meant to own whole keys, so a finer diff would only hide conflicts.
pub fn diff(before: &Value, after: &Value) -> Result<ContextDiff, ContextError> {
    let before = as_object(before, "before")?;
    let after = as_object(after, "after")?;
    let mut result = ContextDiff::default();
    for (key, value) in after {
        match before.get(key) {
            None => {
                result.added.insert(key.clone(), value.clone());
            }
            Some(old) if old != value => {
                result.changed.insert(key.clone(), value.clone());
            }
            Some(_) => {}
        }
    }
    result.removed = before.keys().filter(|key| !after.contains_key(*key)).cloned().collect();
    Ok(result)
}

/// Applies `diff` to `fresh`, last writer wins, and reports the keys in the diff whose
/// value in `fresh` differs from their value in `baseline` (the context at dispatch): a
/// sibling changed, added or removed them in the meantime.
pub fn merge(
    fresh: &Value,
    diff: &ContextDiff,
    baseline: &Value,
) -> Result<MergeResult, ContextError> {
    let fresh = as_object(fresh, "fresh")?;
    let baseline = as_object(baseline, "baseline")?;
    let conflicted_keys = diff
        .keys()
        .into_iter()
        .filter(|key| fresh.get(*key) != baseline.get(*key))
        .map(str::to_owned)
        .collect();
    let mut context = fresh.clone();
    for (key, value) in diff.changed.iter().chain(&diff.added) {
        context.insert(key.clone(), value.clone());
    }
    for key in &diff.removed {
        context.remove(key);
    }
    Ok(MergeResult { context: Value::Object(context), conflicted_keys })
}

fn as_object<'a>(
    value: &'a Value,
    argument: &'static str,
) -> Result<&'a Map<String, Value>, ContextError> {
    value.as_object().ok_or(ContextError { argument, found: json_type(value) })
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn diff_of(changed: Value, added: Value, removed: &[&str]) -> ContextDiff {
        let map = |value: Value| match value {
            Value::Object(map) => map.into_iter().collect(),
            _ => unreachable!("test tables use objects"),
        };
        ContextDiff {
            changed: map(changed),
            added: map(added),
            removed: removed.iter().map(|key| (*key).to_owned()).collect(),
        }
    }

    /// One diff case: before, after, expected diff.
    fn check_diff(before: &Value, after: &Value, expected: &ContextDiff) {
        assert_eq!(&diff(before, after).unwrap(), expected, "diff({before}, {after})");
    }

    #[test]
    fn diffs_top_level_keys() {
        let cases = [
            (json!({}), json!({}), diff_of(json!({}), json!({}), &[])),
            (json!({"a": 1}), json!({"a": 1}), diff_of(json!({}), json!({}), &[])),
            (json!({"a": 1}), json!({"a": 2}), diff_of(json!({"a": 2}), json!({}), &[])),
            (json!({}), json!({"a": null}), diff_of(json!({}), json!({"a": null}), &[])),
            (json!({"a": 1}), json!({}), diff_of(json!({}), json!({}), &["a"])),
            (
                json!({"a": {"x": 1, "y": 2}}),
                json!({"a": {"x": 1, "y": 3}}),
                diff_of(json!({"a": {"x": 1, "y": 3}}), json!({}), &[]),
            ),
            (
                json!({"keep": 0, "change": 1, "drop": 2}),
                json!({"keep": 0, "change": "one", "new": [1]}),
                diff_of(json!({"change": "one"}), json!({"new": [1]}), &["drop"]),
            ),
        ];
        for (before, after, expected) in &cases {
            check_diff(before, after, expected);
        }
    }

    /// One merge case: fresh state, the region's diff, the baseline at dispatch, and the
    /// expected context and conflicted keys.
    fn check(fresh: &Value, diff: &ContextDiff, baseline: &Value, expected: (Value, &[&str])) {
        let result = merge(fresh, diff, baseline).unwrap();
        let (context, conflicts) = expected;
        assert_eq!(result.context, context, "context of merge({fresh}, {diff:?}, {baseline})");
        assert_eq!(
            result.conflicted_keys, conflicts,
            "conflicts of merge({fresh}, {diff:?}, {baseline})"
        );
    }

    /// Fresh state, the region's diff, the baseline, and (expected context, conflicts).
    type MergeCase<'a> = (Value, ContextDiff, Value, (Value, &'a [&'a str]));

    #[test]
    fn merges_last_writer_wins_and_reports_conflicts() {
        let none: &[&str] = &[];
        let cases: Vec<MergeCase> = vec![
            // Nothing changed anywhere.
            (json!({"a": 1}), ContextDiff::default(), json!({"a": 1}), (json!({"a": 1}), none)),
            // Disjoint keys: the sibling's write and ours both survive.
            (
                json!({"inventory": "ok", "payment": null}),
                diff_of(json!({"payment": "paid"}), json!({}), &[]),
                json!({"inventory": null, "payment": null}),
                (json!({"inventory": "ok", "payment": "paid"}), none),
            ),
            // Same key changed by a sibling: ours wins, the key is reported.
            (
                json!({"total": 10}),
                diff_of(json!({"total": 20}), json!({}), &[]),
                json!({"total": 0}),
                (json!({"total": 20}), &["total"]),
            ),
            // A sibling wrote the same value we write: still an overwrite of its change.
            (
                json!({"total": 20}),
                diff_of(json!({"total": 20}), json!({}), &[]),
                json!({"total": 0}),
                (json!({"total": 20}), &["total"]),
            ),
            // Both added the same key.
            (
                json!({"note": "sibling"}),
                diff_of(json!({}), json!({"note": "ours"}), &[]),
                json!({}),
                (json!({"note": "ours"}), &["note"]),
            ),
            // We remove a key a sibling changed: the removal wins and is reported.
            (
                json!({"tmp": 2, "x": 1}),
                diff_of(json!({}), json!({}), &["tmp"]),
                json!({"tmp": 1, "x": 1}),
                (json!({"x": 1}), &["tmp"]),
            ),
            // A sibling removed a key we change: our value comes back, and is reported.
            (
                json!({}),
                diff_of(json!({"tmp": 3}), json!({}), &[]),
                json!({"tmp": 1}),
                (json!({"tmp": 3}), &["tmp"]),
            ),
            // Removing a key that is already gone, unchanged since baseline elsewhere.
            (
                json!({"a": 1}),
                diff_of(json!({}), json!({}), &["gone"]),
                json!({"a": 1}),
                (json!({"a": 1}), none),
            ),
            // Sibling changes to keys outside our diff are not conflicts; reported keys sort.
            (
                json!({"a": 9, "b": 9, "c": 9, "d": 9}),
                diff_of(json!({"c": 1, "a": 1}), json!({}), &[]),
                json!({"a": 0, "b": 0, "c": 0, "d": 0}),
                (json!({"a": 1, "b": 9, "c": 1, "d": 9}), &["a", "c"]),
            ),
        ];
        for (fresh, diff, baseline, expected) in cases {
            check(&fresh, &diff, &baseline, expected);
        }
    }

    #[test]
    fn rejects_non_objects_naming_the_argument() {
        let object = json!({});
        let cases: &[(&str, Result<(), &str>)] = &[
            (
                "before",
                Err("invalid context: argument `before` must be a JSON object, got an array"),
            ),
            ("after", Err("invalid context: argument `after` must be a JSON object, got null")),
            ("fresh", Err("invalid context: argument `fresh` must be a JSON object, got a string")),
            (
                "baseline",
                Err("invalid context: argument `baseline` must be a JSON object, got a number"),
            ),
        ];
        for (argument, expected) in cases {
            let actual = match *argument {
                "before" => diff(&json!([]), &object).map(drop),
                "after" => diff(&object, &Value::Null).map(drop),
                "fresh" => merge(&json!("x"), &ContextDiff::default(), &object).map(drop),
                _ => merge(&object, &ContextDiff::default(), &json!(1)).map(drop),
            };
            assert_eq!(
                actual.map_err(|e| e.to_string()),
                expected.map_err(str::to_owned),
                "{argument}"
            );
        }
    }

    #[test]
    fn applying_a_diff_to_its_own_before_gives_its_after() {
        let before = json!({"keep": 0, "change": 1, "drop": 2});
        let after = json!({"keep": 0, "change": "one", "new": [1]});
        let region = diff(&before, &after).unwrap();
        let merged = merge(&before, &region, &before).unwrap();
        assert_eq!(merged.context, after);
        assert!(merged.conflicted_keys.is_empty());
        assert_eq!(region.keys().into_iter().collect::<Vec<_>>(), ["change", "drop", "new"]);
        assert!(!region.is_empty());
    }
}
