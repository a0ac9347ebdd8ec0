//! The chart definitions `keel serve --charts DIR` draws: every `*.json` file in the
//! directory, in the JSON form `keel_core::chart::json` reads and writes.
//!
//! The server only draws these charts, it never runs them, so each guard a definition
//! names is bound to one that is never taken: the drawing needs the names, not the code.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context as _, bail};
use keel_core::chart::{ChartBuilder, ChartError, Configuration, Definition};

/// Most chart files one directory may hold.
const CHART_FILES_MAX: usize = 1000;

/// Chart definitions by machine name and version.
#[derive(Default)]
pub struct Charts {
    by_machine: BTreeMap<(String, i32), Definition>,
}

impl Charts {
    /// Reads every `*.json` file of `dir`; a file that is not a valid chart is an error
    /// naming the file and what is wrong, so the server does not start half-configured.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let entries = std::fs::read_dir(dir)
            .with_context(|| format!("--charts: cannot read the directory {}", dir.display()))?;
        let mut paths: Vec<_> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .take(CHART_FILES_MAX + 1)
            .collect();
        if paths.len() > CHART_FILES_MAX {
            bail!("--charts: {} holds more than {CHART_FILES_MAX} .json files", dir.display());
        }
        paths.sort();
        let mut by_machine = BTreeMap::new();
        for path in paths {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("--charts: cannot read {}", path.display()))?;
            let def = drawable(&text).with_context(|| format!("--charts: {}", path.display()))?;
            let version = i32::try_from(def.version()).unwrap_or(i32::MAX);
            by_machine.insert((def.name().to_owned(), version), def);
        }
        Ok(Charts { by_machine })
    }

    /// The definition of `machine` at `version`, if it was loaded.
    pub fn get(&self, machine: &str, version: i32) -> Option<&Definition> {
        self.by_machine.get(&(machine.to_owned(), version))
    }

    /// How many definitions were loaded.
    pub fn len(&self) -> usize {
        self.by_machine.len()
    }

    /// Whether none was loaded.
    pub fn is_empty(&self) -> bool {
        self.by_machine.is_empty()
    }
}

/// A definition from its JSON, with every guard it names bound to "never".
fn drawable(text: &str) -> anyhow::Result<Definition> {
    let first = ChartBuilder::from_json(text)?.build();
    let errors = match first {
        Ok(def) => return Ok(def),
        Err(errors) => errors,
    };
    let guards: Vec<String> = errors
        .errors
        .iter()
        .filter_map(|e| match e {
            ChartError::UnknownGuard { guard, .. } => Some(guard.clone()),
            _ => None,
        })
        .collect();
    if guards.len() < errors.errors.len() {
        bail!("{errors}");
    }
    let mut builder = ChartBuilder::from_json(text)?;
    for guard in guards {
        builder = builder.guard(guard, |_, _| false);
    }
    Ok(builder.build()?)
}

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
        let charts = Charts::load(dir.path()).unwrap();
        assert_eq!(charts.len(), 1);
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
        let error = format!("{:#}", Charts::load(dir.path()).err().expect("refused"));
        assert!(error.contains("--charts") && error.contains("broken.json"), "{error}");
    }
}
