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
/// `Ok(None)`: no file named and no `KEEL_*` override ([`ENV_OVERRIDES`]) set; with
/// overrides and no file, `Some` of the defaults with them applied.
///
/// [`ENV_OVERRIDES`]: keel_core::config::ENV_OVERRIDES
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
pub use keel_core::config::{UnusedSection, closest, unused_event_sections, unused_sections};

/// At most this many differences are named in an error.
const DIFFERENCES_NAMED_MAX: usize = 8;

/// Where `a` and `b` differ, as the sections a user would look at (`[queue]`,
/// `[machines.order]`, ...) and the environment variables that override a key in only one
/// of them; at most [`DIFFERENCES_NAMED_MAX`], then `...`.
pub(crate) fn differences(a: &KeelConfig, b: &KeelConfig) -> Vec<String> {
    fn keyed<V: PartialEq>(
        out: &mut Vec<String>,
        table: &str,
        a: &std::collections::BTreeMap<String, V>,
        b: &std::collections::BTreeMap<String, V>,
    ) {
        let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        out.extend(names.into_iter().filter(|n| a.get(*n) != b.get(*n)).map(|n| {
            if n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                format!("[{table}.{n}]")
            } else {
                format!("[{table}.{n:?}]")
            }
        }));
    }
    // Every field named, so a section added to the file does not compile until it is
    // compared here too.
    let KeelConfig {
        queue: _,
        machines: _,
        parallel_dispatch: _,
        schedules: _,
        retention: _,
        queues: _,
        env_overrides: _,
    } = a;
    let mut out = Vec::new();
    if a.queue != b.queue {
        out.push("[queue]".to_owned());
    }
    if a.parallel_dispatch != b.parallel_dispatch {
        out.push("[parallel_dispatch]".to_owned());
    }
    if a.retention != b.retention {
        out.push("[retention]".to_owned());
    }
    keyed(&mut out, "machines", &a.machines, &b.machines);
    keyed(&mut out, "schedules", &a.schedules, &b.schedules);
    keyed(&mut out, "queues", &a.queues, &b.queues);
    let vars: std::collections::BTreeSet<&String> =
        a.env_overrides.values().chain(b.env_overrides.values()).collect();
    out.extend(
        vars.into_iter()
            .filter(|v| {
                a.env_overrides.values().any(|x| x == *v)
                    != b.env_overrides.values().any(|x| x == *v)
            })
            .map(|v| format!("${v} (set for one of them only)")),
    );
    if out.len() > DIFFERENCES_NAMED_MAX {
        out.truncate(DIFFERENCES_NAMED_MAX);
        out.push("...".to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(source: &str, timeout: Option<&str>) -> KeelConfig {
        let env = |var: &str| (var == "KEEL_QUEUE_TIMEOUT").then(|| timeout.map(str::to_owned))?;
        KeelConfig::load(source, env).expect("loads").0
    }

    #[test]
    fn differences_name_the_sections_and_the_variables_that_differ() {
        let file =
            "[machines.order.queue]\nname = \"orders\"\n[queues.orders]\nstrategy = \"fifo\"\n";
        let same = loaded(file, None);
        assert_eq!(differences(&same, &loaded(file, None)), Vec::<String>::new());

        let other =
            "[machines.order.queue]\nname = \"mail\"\n[queues.orders]\nstrategy = \"fifo\"\n";
        assert_eq!(differences(&same, &loaded(other, None)), ["[machines.order]"]);

        // The same file read where the environment overrides a key: the override is named.
        assert_eq!(
            differences(&same, &loaded(file, Some("45s"))),
            ["[queue]", "$KEEL_QUEUE_TIMEOUT (set for one of them only)"]
        );

        // A `[retention]` section of defaults is not the same as none: it replaces the
        // retention set in code.
        let retention = loaded("[retention]\ninterval = \"1 minute\"\n", None);
        assert_eq!(differences(&retention, &loaded("", None)), ["[retention]"]);

        let many = (0..12)
            .map(|i| format!("[machines.m{i:02}.queue]\nname = \"q\"\n"))
            .collect::<Vec<_>>()
            .concat();
        let named = differences(&same, &loaded(&many, None));
        assert_eq!(named.len(), DIFFERENCES_NAMED_MAX + 1, "bounded: {named:?}");
        assert_eq!(named.last().map(String::as_str), Some("..."));
    }
}
