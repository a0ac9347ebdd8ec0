//! Drawing the charts `keel serve --definitions PATH` loaded, with an instance's active
//! states highlighted. The server never runs them (their guards are bound to ones never
//! taken): the drawing needs the names, not the code.

use keel_core::chart::{Configuration, Definition};

/// The SVG of `def` with an instance's position highlighted: a chart's position is the
/// JSON array of its active paths; anything else (`@init`, a step name) highlights nothing.
pub fn svg(def: &Definition, position: &str) -> String {
    let paths: Vec<String> = serde_json::from_str(position).unwrap_or_default();
    def.to_svg_highlighted(&Configuration::from_paths(paths))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOOR: &str = r#"{ "name": "door", "version": 2, "initial": "closed", "states": [
        { "key": "closed", "on": [ { "event": "OPEN", "guards": ["unlocked"], "target": "open" } ] },
        { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] }"#;

    #[test]
    fn charts_with_guards_load_and_draw_the_active_state() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("door.json"), DOOR).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a chart").unwrap();
        let charts = crate::definitions::Definitions::load(dir.path()).unwrap();
        assert_eq!(charts.charts().len(), 1);
        assert!(charts.get("door", 1).is_none(), "versions are told apart");
        let def = charts.get("door", 2).expect("door v2");
        let drawn = svg(def, r#"["open"]"#);
        assert!(drawn.contains(r#"class="state atomic active" data-state="open""#), "{drawn}");
        assert!(!drawn.contains(r#"active" data-state="closed""#), "{drawn}");
        assert!(!svg(def, "@init").contains(" active\""), "nothing active before the start");
    }

    #[test]
    fn a_bad_chart_file_names_the_file_and_the_fault() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("broken.json"), r#"{ "name": "x" }"#).unwrap();
        let loaded = crate::definitions::Definitions::load(dir.path());
        let error = format!("{:#}", loaded.expect_err("refused"));
        assert!(error.contains("--definitions") && error.contains("broken.json"), "{error}");
    }
}
