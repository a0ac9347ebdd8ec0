//! `keel config show`: the effective configuration of a machine (and optionally one of its
//! events and the queue it runs on), each key with its value and where it came from —
//! Keel's default, the file's `[queue]`, machine, event or `[queues.<q>]` section, or an
//! environment override. It needs no store: it reads the file `--config` (or
//! `KEEL_CONFIG`) names and the environment, and refuses what a worker would refuse at
//! start-up.

use anyhow::Context as _;
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
}

/// Reads the file `--config` names (none: the defaults) and applies the environment
/// overrides, refusing a key that would not be applied.
pub fn load(cli: &Cli) -> anyhow::Result<(KeelConfig, Vec<Effective>)> {
    let (text, name) = match &cli.config {
        Some(path) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("--config: cannot read {}", path.display()))?,
            path.display().to_string(),
        ),
        None => (String::new(), "(no file: defaults)".to_owned()),
    };
    KeelConfig::load(&text, |var| std::env::var(var).ok())
        .with_context(|| format!("configuration {name}"))
}

/// Runs a `keel config` command.
pub fn run(cli: &Cli, command: &ConfigCommand) -> anyhow::Result<Report> {
    let ConfigCommand::Show { machine, event, queue } = command;
    let (config, env) = load(cli)?;
    // Without --queue, the queue the machine's instances start in, as `keel start` picks it.
    let queue = match queue {
        Some(queue) => queue.clone(),
        None => config
            .layered(machine, None)
            .name
            .unwrap_or_else(|| keel_core::ids::DEFAULT_QUEUE.to_owned()),
    };
    let queue = queue.as_str();
    let lines = config
        .explain(machine, event.as_deref(), queue, None)
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
    let sections = config.machines.get(machine.as_str());
    let mut missing = Vec::new();
    if cli.config.is_some() && sections.is_none() {
        missing.push(format!("[machines.{machine}]"));
    }
    if let Some(event) = event
        && cli.config.is_some()
        && !sections.is_some_and(|m| m.events.contains_key(event.as_str()))
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
