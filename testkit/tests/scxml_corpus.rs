//! Runs every SCXML document under `tests/scxml/` through [`TestMachine`] and compares,
//! after the initial entry and after each event, the active leaves and what the step did.
//!
//! Each document carries its expectation in a comment that starts with `expect`, one line
//! per step: `EVENT | leaves | exit … | enter … | actions … | raised …`, where the first
//! line's event is `@init`, leaves and lists are comma separated, and the optional parts are
//! compared exactly when present (an absent `exit` means nothing was exited, and so on).
//! The documents name two guards (`no`, never true, and `flag`, true once the `set_flag`
//! action ran), and every other action is a no-op whose run is recorded.

use std::path::Path;

use keel_core::chart::{ChartBuilder, MacrostepResult};
use keel_testkit::TestMachine;

struct Step {
    event: String,
    leaves: String,
    parts: Vec<(String, String)>,
}

fn expectations(text: &str, file: &str) -> Vec<Step> {
    let start = text.find("<!-- expect").unwrap_or_else(|| panic!("{file}: no expect comment"));
    let body = &text[start + "<!-- expect".len()..];
    let body = &body[..body.find("-->").unwrap_or_else(|| panic!("{file}: unclosed comment"))];
    body.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|line| {
            let mut cells = line.split('|').map(str::trim);
            let event = cells.next().unwrap_or_default().to_owned();
            let leaves = cells.next().unwrap_or_else(|| panic!("{file}: `{line}` has no leaves"));
            let parts = cells
                .map(|cell| {
                    let (label, list) =
                        cell.split_once(' ').unwrap_or_else(|| panic!("{file}: bad cell `{cell}`"));
                    (label.to_owned(), list.trim().to_owned())
                })
                .collect();
            Step { event, leaves: leaves.to_owned(), parts }
        })
        .collect()
}

/// What a step did, in the expectation's format (only non-empty parts).
fn observed(result: &MacrostepResult) -> Vec<(String, String)> {
    let raised: Vec<&str> = result.internal_events.iter().map(|e| e.name.as_str()).collect();
    [
        ("exit", result.exited()),
        ("enter", result.entered()),
        ("actions", result.actions()),
        ("raised", raised),
    ]
    .into_iter()
    .filter(|(_, items)| !items.is_empty())
    .map(|(label, items)| (label.to_owned(), items.join(",")))
    .collect()
}

fn run_document(path: &Path) -> usize {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{file}: {e}"));
    let def = ChartBuilder::from_scxml(&text, 1)
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .guard("no", |_, _| false)
        .guard("flag", |ctx, _| ctx.get("flag") == Some(&serde_json::Value::Bool(true)))
        .build()
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    let mut machine = TestMachine::new(def).action_sync("set_flag", |ctx, _| ctx.set("flag", true));
    let steps = expectations(&text, &file);
    assert_eq!(steps.first().map(|s| s.event.as_str()), Some("@init"), "{file}");
    for (i, step) in steps.iter().enumerate() {
        if i == 0 {
            machine.start();
        } else {
            machine.send(step.event.as_str());
        }
        let def = machine.definition().clone();
        let leaves = machine.configuration().leaves(&def).join(",");
        let result = machine.last();
        assert_eq!(result.error, None, "{file}, step {}", step.event);
        let got = (leaves, observed(result));
        let want = (step.leaves.clone(), step.parts.clone());
        assert_eq!(got, want, "{file}, step {} (line {} of the expectation)", step.event, i + 1);
    }
    steps.len()
}

#[test]
fn every_scxml_document_runs_to_its_expected_configurations() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scxml");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "scxml"))
        .collect();
    paths.sort();
    // The corpus covers entry/exit order, document order, preemption, eventless fixpoints,
    // internal and external transitions, done events, both kinds of history and
    // multi-target transitions; losing a file must fail here, not shrink the test.
    assert_eq!(paths.len(), 10, "{paths:?}");
    let steps: usize = paths.iter().map(|p| run_document(p)).sum();
    assert!(steps >= 40, "only {steps} steps checked");
}
