//! A definitions file: the charts an operator tool knows, in their JSON form.
//!
//! The file holds one chart object or an array of them (the form `ChartBuilder::from_json`
//! reads). Guards are Rust functions the file can only name; the tools that read a file
//! here draw, validate events against, or migrate between charts and never take a
//! transition, so every named guard is bound to a placeholder that refuses.

use std::path::Path;

use anyhow::{Context as _, anyhow, bail};
use keel::Definition;
use keel_core::chart::{ChartBuilder, ChartJson};

/// Largest definitions file read (a chart is bounded by the core's own JSON limit; this
/// allows a few hundred charts).
pub const FILE_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// Most `*.json` files a definitions directory may hold.
pub const DIR_FILES_MAX: usize = 1_000;

/// The charts of one file.
#[derive(Debug, Clone, Default)]
pub struct Definitions {
    charts: Vec<Definition>,
}

impl Definitions {
    /// Reads and validates a file; the error names the file, the chart and the fix.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        if path.is_dir() {
            return Self::load_dir(path);
        }
        Self::load_file(path)
    }

    /// Reads and validates one file (never a directory).
    fn load_file(path: &Path) -> anyhow::Result<Self> {
        let field = "--definitions";
        let size = std::fs::metadata(path)
            .with_context(|| format!("{field}: cannot read {}", path.display()))?
            .len();
        if size > FILE_BYTES_MAX {
            bail!(
                "{field}: {} is {size} bytes, more than {FILE_BYTES_MAX}; split it into several files",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{field}: cannot read {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("{field}: {}", path.display()))
    }

    /// Every `*.json` regular file of `dir` (at most [`DIR_FILES_MAX`]), each one chart or
    /// an array of them; a name and version defined twice is an error. Only this one level
    /// is read: a sub-directory named `*.json`, or a symbolic link to one (`loop.json ->
    /// .`), is skipped, so nothing recurses. A link to a regular file counts as that file
    /// (mounted configuration volumes are links).
    fn load_dir(dir: &Path) -> anyhow::Result<Self> {
        let entries = std::fs::read_dir(dir).with_context(|| {
            format!("--definitions: cannot read the directory {}", dir.display())
        })?;
        let mut paths: Vec<_> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
            .take(DIR_FILES_MAX + 1)
            .collect();
        if paths.len() > DIR_FILES_MAX {
            bail!("--definitions: {} holds more than {DIR_FILES_MAX} .json files", dir.display());
        }
        paths.sort();
        let mut all = Definitions::default();
        for path in paths {
            for def in Self::load_file(&path)?.charts {
                if all.get(def.name(), def.version()).is_some() {
                    bail!(
                        "--definitions: {}: {} v{} is defined twice in {}; keep one definition per name and version",
                        path.display(),
                        def.name(),
                        def.version(),
                        dir.display()
                    );
                }
                all.charts.push(def);
            }
        }
        Ok(all)
    }

    /// Every loaded definition.
    pub fn charts(&self) -> &[Definition] {
        &self.charts
    }

    /// Parses the text of a definitions file.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| anyhow!("not JSON ({e}); write one chart object or an array of them"))?;
        let items = match value {
            serde_json::Value::Array(items) => items,
            object @ serde_json::Value::Object(_) => vec![object],
            _ => bail!("write one chart object or an array of them"),
        };
        let mut charts: Vec<Definition> = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            let chart: ChartJson = serde_json::from_value(item)
                .map_err(|e| anyhow!("chart [{i}]: {e}; follow the chart JSON schema"))?;
            let mut builder = ChartBuilder::from_chart_json(&chart)
                .map_err(|e| anyhow!("chart [{i}] ({} v{}): {e}", chart.name, chart.version))?;
            for guard in chart.guard_names() {
                builder = builder.guard(guard, |_, _| false);
            }
            let def = builder
                .build()
                .map_err(|e| anyhow!("chart [{i}] ({} v{}): {e}", chart.name, chart.version))?;
            if charts.iter().any(|c| c.name() == def.name() && c.version() == def.version()) {
                bail!(
                    "chart [{i}]: {} v{} appears twice; keep one definition per name and version",
                    def.name(),
                    def.version()
                );
            }
            charts.push(def);
        }
        Ok(Definitions { charts })
    }

    /// What building the charts found that is allowed but likely a mistake (a state
    /// nothing enters, a transition that can never be taken), each naming its chart:
    /// `door v1: state ...`. A worker logs the same for the charts it registers.
    pub fn warnings(&self) -> Vec<String> {
        self.charts
            .iter()
            .flat_map(|c| {
                c.warnings().iter().map(move |w| format!("{} v{}: {w}", c.name(), c.version()))
            })
            .collect()
    }

    /// Whether the file names any version of `machine`.
    pub fn has_machine(&self, machine: &str) -> bool {
        self.charts.iter().any(|c| c.name() == machine)
    }

    /// The versions of `machine` the file holds, ascending.
    pub fn versions(&self, machine: &str) -> Vec<u32> {
        let mut v: Vec<u32> =
            self.charts.iter().filter(|c| c.name() == machine).map(Definition::version).collect();
        v.sort_unstable();
        v
    }

    /// One chart by name and version.
    pub fn get(&self, machine: &str, version: u32) -> Option<&Definition> {
        self.charts.iter().find(|c| c.name() == machine && c.version() == version)
    }

    /// One chart by name and version, or the newest version when `version` is `None`;
    /// the error lists what the file holds and names the machine, or the flag that gave
    /// the version (`version_flag`: `--version`, `--from`, `--to`).
    pub fn find(
        &self,
        machine: &str,
        version: Option<u32>,
        version_flag: &str,
    ) -> anyhow::Result<&Definition> {
        let versions = self.versions(machine);
        if versions.is_empty() {
            let names: std::collections::BTreeSet<&str> =
                self.charts.iter().map(Definition::name).collect();
            bail!(
                "machine: {machine:?} is not in the definitions file (it holds: {})",
                names.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
        let version = version.unwrap_or(versions[versions.len() - 1]);
        self.get(machine, version).ok_or_else(|| {
            anyhow!(
                "{version_flag}: {machine} has no version {version} in the definitions file (it holds {versions:?})"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOOR: &str = r#"{ "name": "door", "version": 1, "initial": "closed", "states": [
        { "key": "closed", "on": [ { "event": "OPEN", "guards": ["unlocked"], "target": "open" } ] },
        { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] }"#;

    #[test]
    fn one_chart_or_an_array_loads_with_placeholder_guards() {
        let one = Definitions::parse(DOOR).expect("one chart");
        assert_eq!(one.versions("door"), [1]);
        let two = DOOR.replace("\"version\": 1", "\"version\": 2");
        let many = Definitions::parse(&format!("[{DOOR}, {two}]")).expect("array");
        assert_eq!(many.find("door", None, "--version").expect("newest").version(), 2);
        assert_eq!(
            many.find("door", Some(1), "--version").expect("v1").event_alphabet(),
            ["CLOSE", "OPEN"]
        );
    }

    #[test]
    fn warnings_name_their_chart() {
        assert_eq!(Definitions::parse(DOOR).expect("door").warnings(), Vec::<String>::new());
        let stray = DOOR.replace(r#"{ "key": "open","#, r#"{ "key": "lost" }, { "key": "open","#);
        let warnings = Definitions::parse(&stray).expect("a chart with a stray state").warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("door v1: state `lost` is unreachable"), "{warnings:?}");
    }

    #[test]
    fn bad_files_name_the_chart_and_the_fix() {
        let e = Definitions::parse("[1]").unwrap_err().to_string();
        assert!(e.starts_with("chart [0]:"), "{e}");
        let e = Definitions::parse(&format!("[{DOOR}, {DOOR}]")).unwrap_err().to_string();
        assert!(e.contains("door v1 appears twice"), "{e}");
        let e = Definitions::parse(DOOR)
            .unwrap()
            .find("gate", None, "--version")
            .unwrap_err()
            .to_string();
        assert!(e.contains("machine: \"gate\" is not in the definitions file"), "{e}");
        let e = Definitions::parse(DOOR)
            .unwrap()
            .find("door", Some(9), "--version")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--version: door has no version 9"), "{e}");
        let e = Definitions::parse("{").unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }
}
