//! `keel config show`: the effective configuration of a machine (and optionally one of its
//! events and the queue it runs on), each key with its value and where it came from —
//! Keel's default, the file's `[queue]`, machine, event or `[queues.<q>]` section, or an
//! environment override. It needs no store: it reads the file `--config` (or
//! `KEEL_CONFIG`) names and the environment, and refuses what a worker would refuse at
//! start-up.
//!
//! `keel config check`: the file as a worker reads it (every level resolved), then its
//! `[machines.<m>]`, `[retention.machines.<m>]` and `[queues.<q>]` sections against the
//! machines and queues the store knows in the namespace, with the rule a worker warns by
//! (`keel_core::config::unused_sections`). A file that loads exits 0: a section that
//! looks like a misspelling is a warning, because the store cannot know a machine or
//! queue that is not deployed yet (`order2` next to `order`, `tier1` next to `tier2`), and
//! failing a correct file would stop the deploy that brings it. With `--definitions`, the
//! `[machines.<m>.events.<e>]` sections of each chart the file defines are held against
//! the events of its versions there too (`keel_core::config::unused_event_sections`).

use anyhow::{Context as _, bail};
use clap::Subcommand;
use keel_core::config::{Effective, KeelConfig};
use serde_json::json;
use std::fmt::Write as _;

use crate::Cli;
use crate::output::{Report, table};

/// `keel config …`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the effective configuration of a machine, with where each value came from.
    Show {
        /// The machine.
        #[arg(long)]
        machine: String,
        /// One event of the machine: its section overrides the machine's.
        #[arg(long)]
        event: Option<String>,
        /// The queue whose claim order and limits to show (default: the machine's own,
        /// its `name` in the file, else `default`).
        #[arg(long)]
        queue: Option<String>,
    },
    /// Check the file as a worker reads it (exit 1 when it does not load), then its
    /// machine and queue sections against the names the store knows in the namespace:
    /// a section that looks like a misspelling of a known name is a warning (exit 0).
    Check {
        /// Chart definitions (JSON: one chart or an array, or a directory of such files):
        /// each chart's `[machines.<m>.events.<e>]` sections are held against the events
        /// of its versions there, and one naming none of them is reported.
        #[arg(long, env = "KEEL_DEFINITIONS")]
        definitions: Option<std::path::PathBuf>,
    },
}

/// Reads the file `--config` names (none: the defaults) and applies the environment
/// overrides, refusing a key that would not be applied.
pub fn load(cli: &Cli) -> anyhow::Result<(KeelConfig, Vec<Effective>)> {
    let (text, name) = match &cli.config {
        Some(path) => (
            std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!(
                    "--config: cannot read {}: {e}; fix the path given by --config or KEEL_CONFIG",
                    path.display()
                )
            })?,
            path.display().to_string(),
        ),
        None => (String::new(), "(no file: defaults)".to_owned()),
    };
    KeelConfig::load(&text, |var| std::env::var(var).ok())
        .with_context(|| format!("configuration {name}"))
}

/// Runs a `keel config` command.
pub async fn run(cli: &Cli, command: &ConfigCommand) -> anyhow::Result<Report> {
    match command {
        ConfigCommand::Show { machine, event, queue } => {
            show(cli, machine, event.as_deref(), queue.as_deref())
        }
        ConfigCommand::Check { definitions } => check(cli, definitions.as_deref()).await,
    }
}

/// Machine sections `keel config check` looks up one by one (an indexed read of at most
/// one instance each) when the grouped reads did not name them; the rest are held
/// against those reads alone.
pub const SECTIONS_PROBED_MAX: usize = 100;

/// `keel config check`. The file is read and resolved before the store is opened, so a
/// broken file is reported whether or not the store answers (exit 1); a store that
/// cannot be reached then fails too, saying the file is valid. Sections are then held
/// against the names the store knows: a likely
/// misspelling is a warning, a machine the store has not seen that resembles none a note.
async fn check(cli: &Cli, definitions: Option<&std::path::Path>) -> anyhow::Result<Report> {
    let Some(path) = &cli.config else {
        bail!("--config: name the file to check (or set KEEL_CONFIG)");
    };
    let file = path.display().to_string();
    let (config, _) = load(cli)?;
    config.check_levels().with_context(|| format!("configuration {file}"))?;
    let charts = match definitions {
        Some(path) => crate::definitions::Definitions::load(path)?,
        None => crate::definitions::Definitions::default(),
    };
    let unused_events = unused_event_sections(&config, &charts);
    let keel = crate::commands::connect(cli, false).await.with_context(|| {
        format!(
            "{file} is valid, but its sections could not be held against the store's \
             machines and queues"
        )
    })?;
    let ns = cli.namespace.as_str();
    let mut known = crate::operate::known_names(&keel, ns).await?;
    // A machine whose instances all ended long ago is in none of the grouped reads (the
    // machines a `[retention.machines.<m>]` keeps are often such).
    let named: std::collections::BTreeSet<&String> =
        config.machines.keys().chain(config.retention_machines()).collect();
    let unseen = named.into_iter().filter(|m| !known.machines.contains(*m));
    for machine in unseen.take(SECTIONS_PROBED_MAX).cloned().collect::<Vec<_>>() {
        if crate::operate::has_instances(&keel, ns, &machine).await? {
            known.machines.insert(machine);
        }
    }
    let machines: Vec<&str> = known.machines.iter().map(String::as_str).collect();
    let queues: Vec<&str> = known.queues.iter().map(String::as_str).collect();
    let mut unused = keel::settings::unused_sections(&config, &machines, &queues);
    let typos = unused.iter().chain(&unused_events).filter(|u| u.is_likely_typo()).count();
    let mut human = format!(
        "{file}: valid ({} machine section(s), {} queue section(s)).",
        config.machines.len(),
        config.queues.len()
    );
    for section in &unused {
        let _ = match &section.closest {
            // The store knows a queue only while it holds unfinished instances or has
            // settings (a pause): one whose instances have all ended is not in use here.
            Some(near) if section.section.starts_with("[queues.") => write!(
                human,
                "\nWarning: {}: names no queue with unfinished instances or settings in namespace {ns:?}; did you mean `{near}`? Fix it if it is misspelt; a queue not deployed yet, or whose instances have all ended, is fine.",
                section.section
            ),
            Some(near) => write!(
                human,
                "\nWarning: {}: names nothing the store knows in namespace {ns:?}; did you mean `{near}`? Fix it if it is misspelt; a machine or queue not deployed yet is fine.",
                section.section
            ),
            None => write!(
                human,
                "\nNote: {}: no machine of that name in namespace {ns:?} yet (served in another namespace, not started yet, or misspelt).",
                section.section
            ),
        };
    }
    for section in &unused_events {
        let _ = match &section.closest {
            Some(near) => write!(
                human,
                "\nWarning: {}: names no event of that chart in the definitions, so it never takes effect; did you mean `{near}`? Fix it if it is misspelt.",
                section.section
            ),
            None => write!(
                human,
                "\nNote: {}: names no event of that chart in the definitions (an event of a version not given, or misspelt).",
                section.section
            ),
        };
    }
    unused.extend(unused_events);
    let json = json!({
        "file": file,
        "namespace": ns,
        "valid": true,
        "unused": unused.iter().map(|u| json!({
            "section": u.section, "did_you_mean": u.closest,
        })).collect::<Vec<_>>(),
        "likely_typos": typos,
    });
    Ok(Report::ok(json, human))
}

/// The event sections of `config` that name no event of their chart in `charts`, the
/// events of every version of a chart taken together; machines `charts` does not define
/// are not checked (a step machine's events are not known up front).
fn unused_event_sections(
    config: &KeelConfig,
    charts: &crate::definitions::Definitions,
) -> Vec<keel::settings::UnusedSection> {
    let mut events: std::collections::BTreeMap<&str, Vec<String>> =
        std::collections::BTreeMap::new();
    for chart in charts.charts() {
        events.entry(chart.name()).or_default().extend(chart.event_alphabet());
    }
    events
        .into_iter()
        .flat_map(|(machine, names)| {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            keel::settings::unused_event_sections(config, machine, &names)
        })
        .collect()
}

/// `keel config show`.
fn show(
    cli: &Cli,
    machine: &str,
    event: Option<&str>,
    queue: Option<&str>,
) -> anyhow::Result<Report> {
    let (config, env) = load(cli)?;
    // Without --queue, the queue the machine's instances start in, as `keel start` picks it.
    let queue = match queue {
        Some(queue) => queue.to_owned(),
        None => config
            .layered(machine, None)
            .name
            .unwrap_or_else(|| keel_core::ids::DEFAULT_QUEUE.to_owned()),
    };
    let queue = queue.as_str();
    let lines = config
        .explain(machine, event, queue, None)
        .with_context(|| format!("machine {machine}"))?;
    let mut t = table(&["key", "value", "source"]);
    for line in &lines {
        t.add_row([line.key.as_str(), line.value.as_str(), &line.source.to_string()]);
    }
    let what = match event {
        Some(event) => format!("machine {machine}, event {event}, queue {queue}"),
        None => format!("machine {machine}, queue {queue}"),
    };
    let mut human = format!("Effective configuration of {what}:\n{t}");
    if !env.is_empty() {
        let vars: Vec<String> = env.iter().map(|e| e.source.to_string()).collect();
        human += &["\nEnvironment overrides applied: ", &vars.join(", "), "."].concat();
    }
    // A machine (or event) without a section of its own is legal, and so is a typo: say
    // which one this is when a file was read.
    let sections = config.machines.get(machine);
    let mut missing = Vec::new();
    if cli.config.is_some() && sections.is_none() {
        missing.push(format!("[machines.{machine}]"));
    }
    if let Some(event) = event
        && cli.config.is_some()
        && !sections.is_some_and(|m| m.events.contains_key(event))
    {
        missing.push(format!("[machines.{machine}.events.{event}]"));
    }
    if !missing.is_empty() {
        let _ = write!(
            human,
            "\nNote: the file has no {} section; the values come from the levels above (check the name).",
            missing.join(" or ")
        );
    }
    let json = json!({
        "machine": machine,
        "sections_missing": missing,
        "event": event,
        "queue": queue,
        "values": lines.iter().map(|l| json!({
            "key": l.key, "value": l.value, "source": l.source.to_string(),
        })).collect::<Vec<_>>(),
    });
    Ok(Report::ok(json, human))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = r#"{ "name": "order", "version": 1, "initial": "cart", "states": [
        { "key": "cart", "on": [ { "event": "checkout", "target": "paid" } ] },
        { "key": "paid" } ] }"#;

    #[test]
    fn an_event_section_naming_no_event_of_a_given_chart_is_reported() {
        let config = KeelConfig::from_toml_str(
            "[machines.order.events.chekout.queue]\nretry = { max_attempts = 10 }\n\
             [machines.order.events.checkout.queue]\ntimeout = \"5s\"\n\
             [machines.mail.events.sendd.queue]\ntimeout = \"5s\"\n",
        )
        .expect("a valid file");
        let charts = crate::definitions::Definitions::parse(ORDER).expect("a chart");
        let unused = unused_event_sections(&config, &charts);
        assert_eq!(unused.len(), 1, "{unused:?}");
        assert_eq!(unused[0].section, "[machines.order.events.chekout]");
        assert_eq!(unused[0].closest.as_deref(), Some("checkout"));
        // No definitions: no chart's events are known, nothing is reported.
        let none = crate::definitions::Definitions::default();
        assert!(unused_event_sections(&config, &none).is_empty());
    }
}
