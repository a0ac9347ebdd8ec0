//! The order chart's diagrams are checked in next to its Mermaid file: `docs/order-chart.dot`
//! (Graphviz) and `docs/order-chart.svg` (drawn by keel-core itself). Rewrite them with
//! `KEEL_BLESS=1 cargo test`.

use std::collections::BTreeSet;
use std::path::PathBuf;

use keel_core::chart::Configuration;
use keel_examples::order::definition;

/// Compares `actual` with the golden file `docs/<name>`, rewriting it first under
/// `KEEL_BLESS=1`.
fn check_golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs").join(name);
    if std::env::var_os("KEEL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, actual).expect("write the golden file");
    }
    let golden = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("docs/{name} exists (run with KEEL_BLESS=1)"));
    assert_eq!(actual, golden, "docs/{name} changed; rerun with KEEL_BLESS=1 to accept it");
}

#[test]
fn dot_matches_the_golden_file() {
    check_golden("order-chart.dot", &definition().to_dot());
}

#[test]
fn svg_matches_the_golden_file() {
    check_golden("order-chart.svg", &definition().to_svg());
}

/// The paths of the state groups carrying class `active`, and of all state groups.
fn marked(svg: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut active, mut all) = (BTreeSet::new(), BTreeSet::new());
    for line in svg.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("<g class=\"state ") else { continue };
        let (classes, rest) = rest.split_once('"').expect("class attribute");
        let path = rest
            .strip_prefix(" data-state=\"")
            .and_then(|r| r.split_once('"'))
            .map(|(path, _)| path.to_owned())
            .expect("every state group names its state");
        if classes.split(' ').any(|c| c == "active") {
            active.insert(path.clone());
        }
        all.insert(path);
    }
    (active, all)
}

#[test]
fn highlighted_svg_marks_exactly_the_active_states() {
    let def = definition();
    let every_state: BTreeSet<String> = def.states().map(|s| s.path.clone()).collect();
    let cases: [&[&str]; 4] = [
        &[],
        &["cart"],
        &[
            "processing",
            "processing.inventory",
            "processing.inventory.reserved",
            "processing.payment",
            "processing.payment.charging",
        ],
        &["completed"],
    ];
    for paths in cases {
        let config = Configuration::from_paths(paths.iter().copied());
        assert_eq!(config.check(&def).is_ok(), !paths.is_empty(), "{paths:?} is a real position");
        let (active, all) = marked(&def.to_svg_highlighted(&config));
        let expected: BTreeSet<String> = paths.iter().map(|p| (*p).to_owned()).collect();
        assert_eq!(active, expected, "highlighting {paths:?}");
        assert_eq!(all, every_state, "every state is drawn once");
    }
    let (active, _) = marked(&def.to_svg());
    assert!(active.is_empty(), "the plain SVG highlights nothing");
}
