//! The committed JSON Schema of chart definitions, generated from keel-core's JSON types so
//! it cannot describe a format the loader does not read.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use keel_core::chart::ChartJson;

/// Where the schema is committed, relative to the workspace root.
const SCHEMA_PATH: &str = "docs/chart-definition.schema.json";

fn path(root: &Path) -> PathBuf {
    root.join(SCHEMA_PATH)
}

/// The schema text as it should be committed.
pub fn render() -> String {
    let mut text = serde_json::to_string_pretty(&ChartJson::json_schema())
        .expect("a JSON Schema is plain JSON");
    text.push('\n');
    text
}

/// Rewrites the committed schema.
pub fn write(root: &Path) -> Result<()> {
    let path = path(root);
    std::fs::write(&path, render()).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_chart_schema_is_current() {
        let root = crate::project_root();
        let committed = std::fs::read_to_string(path(&root)).unwrap_or_default();
        assert!(
            committed == render(),
            "{SCHEMA_PATH} is stale: the chart JSON types changed; regenerate it with `cargo xtask json-schema`"
        );
    }
}
