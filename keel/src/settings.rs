//! The configuration file (`keel.toml`) for workers: read from the path a program passes
//! (its `--config` flag, say) or else from `KEEL_CONFIG`, with the environment overrides
//! of [`ENV_OVERRIDES`](keel_core::config::ENV_OVERRIDES) applied on top. A key this
//! version parses but does not apply is refused here, at start-up, never ignored.

use crate::Error;
use keel_core::config::KeelConfig;
use std::path::{Path, PathBuf};

/// The variable naming the configuration file when no path is given.
pub const CONFIG_VAR: &str = "KEEL_CONFIG";

/// Loads the configuration file at `path`, or at `$KEEL_CONFIG` when `path` is `None`.
/// `Ok(None)`: neither names a file (the documented defaults apply, still with the
/// environment overrides when any is set).
pub fn load(path: Option<&Path>) -> Result<Option<KeelConfig>, Error> {
    let path: Option<PathBuf> =
        path.map(Path::to_path_buf).or_else(|| std::env::var_os(CONFIG_VAR).map(PathBuf::from));
    let text = match &path {
        Some(path) => std::fs::read_to_string(path).map_err(|e| Error::Config {
            file: path.display().to_string(),
            message: format!(
                "cannot read it: {e}; fix the path or unset {CONFIG_VAR} to run with the defaults"
            ),
        })?,
        None => String::new(),
    };
    let file = path.as_ref().map_or_else(|| "(defaults)".to_owned(), |p| p.display().to_string());
    let (config, overrides) = KeelConfig::load(&text, |var| std::env::var(var).ok())
        .map_err(|e| Error::Config { file, message: e.to_string() })?;
    Ok((path.is_some() || !overrides.is_empty()).then_some(config))
}

/// The "did you mean" rule and the unused-section report, kept in keel-core so the
/// worker (which logs the report when it starts) and the `keel` command (`config check`,
/// and the bulk commands given a machine the store holds nothing of) decide alike.
pub use keel_core::config::{UnusedSection, closest, unused_sections};
