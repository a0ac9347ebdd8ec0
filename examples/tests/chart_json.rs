//! The examples' charts in their JSON form: each survives builder → JSON → definition
//! unchanged, and the order chart's JSON is checked in as `docs/order-chart.json` (rewrite it
//! with `KEEL_BLESS=1 cargo test`), so the file shows the format on a real chart and loads.

use std::path::PathBuf;

use keel_core::chart::ChartBuilder;
use keel_examples::{charts, order};

#[test]
fn every_example_chart_round_trips_through_json() {
    let all = charts();
    assert!(!all.is_empty());
    for def in all {
        let text = def.to_json();
        let again = ChartBuilder::from_json(&text)
            .expect("a chart's own JSON loads")
            .guards_from(&def)
            .build()
            .expect("a chart's own JSON is valid");
        assert!(
            def.same_structure(&again),
            "`{}` changed in a JSON round trip:\n{text}",
            def.name()
        );
        assert_eq!(again.to_json(), text);
    }
}

#[test]
fn order_chart_json_matches_the_golden_file_and_loads() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/order-chart.json");
    let def = order::definition();
    let actual = def.to_json();
    if std::env::var_os("KEEL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &actual).expect("write the golden file");
    }
    let golden = std::fs::read_to_string(&path)
        .expect("docs/order-chart.json exists (run with KEEL_BLESS=1)");
    assert_eq!(actual, golden, "JSON output changed; rerun with KEEL_BLESS=1 to accept it");
    let loaded = ChartBuilder::from_json(&golden)
        .expect("the golden file loads")
        .guard("has_items", |_, _| true)
        .guard("can_retry", |_, _| true)
        .build()
        .expect("the golden file is a valid chart");
    assert!(def.same_structure(&loaded));
}
