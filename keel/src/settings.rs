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

/// Names longer than this (in characters) are never compared by [`closest`]: no machine
/// or queue name is that long, and the comparison's cost grows with the product of the
/// two lengths.
pub const NAME_COMPARE_MAX: usize = 128;

/// The name in `known` that `name` is most likely a misspelling of, if any: the one at
/// the smallest edit distance (insertions, deletions and substitutions of characters,
/// case ignored), when that distance is at most a third of `name`'s length (and at least
/// 1), ties broken by the name that sorts first. `name` itself is never suggested.
///
/// This is the one "did you mean" rule of Keel's tools: a worker warning about a
/// configuration section for a machine it does not register, and the `keel` command
/// refusing a machine name the store does not know, both use it.
///
/// ```
/// use keel::settings::closest;
/// assert_eq!(closest("ordr", ["order", "payment"]), Some("order"));
/// assert_eq!(closest("Order", ["order"]), Some("order"));
/// assert_eq!(closest("shipping", ["order", "payment"]), None);
/// ```
pub fn closest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let wanted: Vec<char> = name.to_lowercase().chars().collect();
    if wanted.is_empty() || wanted.len() > NAME_COMPARE_MAX {
        return None;
    }
    let within = (wanted.len() / 3).max(1);
    let mut best: Option<(usize, &'a str)> = None;
    for candidate in known {
        if candidate == name || candidate.chars().count() > NAME_COMPARE_MAX {
            continue;
        }
        let other: Vec<char> = candidate.to_lowercase().chars().collect();
        let distance = edit_distance(&wanted, &other);
        let better = best.is_none_or(|(d, b)| (distance, candidate) < (d, b));
        if distance <= within && better {
            best = Some((distance, candidate));
        }
    }
    best.map(|(_, name)| name)
}

/// Levenshtein distance over characters, one row at a time.
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// A section of the configuration file that names a machine or queue no registered
/// machine uses, so none of its keys takes effect on this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnusedSection {
    /// The section as written in the file: `[machines.ordr]`, `[queues.paymnts]`.
    pub section: String,
    /// The name it is most likely a misspelling of ([`closest`]), if any.
    pub closest: Option<String>,
}

impl UnusedSection {
    /// A likely misspelling ([`closest`] found a name): worth a warning. Without one, the
    /// section most likely belongs to another program sharing the file.
    pub fn is_likely_typo(&self) -> bool {
        self.closest.is_some()
    }
}

/// The sections of `config` that the `machines` (registered, or declared served by
/// another worker) leave unused:
///
/// - every `[machines.<m>]` whose `m` is not one of them;
/// - every `[queues.<q>]` whose `q` is neither the default queue nor a queue those
///   machines start in or dispatch regions to by the file (`name`, `parallel_dispatch`
///   `queue`, at the system or the machine's level), when `q` is a likely misspelling of
///   one of those queues. A queue with no close name is left out: a program may start
///   instances in a queue it names in code, which the file cannot show.
///
/// A file shared by workers serving different machines names machines a given worker
/// does not register, so this is a report (a worker logs it), never a refusal; a section
/// with a [`closest`] name is the case worth a warning.
pub fn unused_sections(config: &KeelConfig, machines: &[&str]) -> Vec<UnusedSection> {
    let mut unused = Vec::new();
    for name in config.machines.keys() {
        if !machines.contains(&name.as_str()) {
            unused.push(UnusedSection {
                section: format!("[machines.{name}]"),
                closest: closest(name, machines.iter().copied()).map(str::to_owned),
            });
        }
    }
    let mut used = std::collections::BTreeSet::from([keel_core::ids::DEFAULT_QUEUE.to_owned()]);
    used.extend(config.queue.name.clone());
    used.extend(config.parallel_dispatch.queue.clone());
    for machine in machines {
        used.extend(config.layered(machine, None).name);
        used.extend(config.parallel_for(machine).queue);
    }
    for queue in config.queues.keys().filter(|q| !used.contains(*q)) {
        if let Some(near) = closest(queue, used.iter().map(String::as_str)) {
            unused.push(UnusedSection {
                section: format!("[queues.{queue}]"),
                closest: Some(near.to_owned()),
            });
        }
    }
    unused
}
