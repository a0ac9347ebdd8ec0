//! `keel health`: the configured alert thresholds checked against the store.
//!
//! Thresholds come from the configuration file's `alerts` sections (system level, then
//! per machine), resolved the way workers resolve queue settings. A machine without
//! thresholds is healthy whatever its counts.

use std::fmt;

use anyhow::{Context as _, bail};
use keel::Keel;
use keel_core::config::{AlertThresholds, KeelConfig};
use serde::Serialize;
use serde_json::json;

use crate::Cli;
use crate::commands::{self, StatusRow};
use crate::exit::Code;
use crate::operate::{Counted, MachineActivity};
use crate::output::{Report, table};

/// The store could not be reached: a health probe reports it as critical.
#[derive(Debug)]
pub struct Unreachable(pub String);

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "critical: the store cannot be reached: {}", self.0)
    }
}

impl std::error::Error for Unreachable {}

/// Opens the store for a probe; failing to is itself critical.
pub async fn connect(cli: &Cli) -> anyhow::Result<Keel> {
    commands::connect(cli, false).await.map_err(|error| Unreachable(format!("{error:#}")).into())
}

/// How bad one finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Within every threshold.
    Healthy,
    /// Over a warning threshold.
    Warning,
    /// Over a critical threshold.
    Critical,
}

/// One threshold crossed.
#[derive(Debug, Serialize)]
pub struct Finding {
    /// How bad.
    pub level: Level,
    machine: String,
    check: &'static str,
    value: u64,
    /// False when `value` is a lower bound: the count stopped at its page bound.
    complete: bool,
    threshold: u64,
}

impl Finding {
    /// The value with whether it was counted whole; its text says "at least" when not.
    pub fn value(&self) -> Counted {
        Counted { count: self.value, complete: self.complete }
    }
}

/// The configuration file `--config` names (or the defaults), with the `KEEL_QUEUE_*`
/// environment overrides a worker applies, refusing keys this version does not apply:
/// the configuration a worker of the same deployment runs with.
pub fn read_config(cli: &Cli) -> anyhow::Result<KeelConfig> {
    crate::config_cmd::load(cli).map(|(config, _)| config)
}

fn check(
    findings: &mut Vec<Finding>,
    machine: &str,
    name: &'static str,
    value: Counted,
    warning: Option<u64>,
    critical: Option<u64>,
) {
    let Counted { count: value, complete } = value;
    let crossed = |threshold: Option<u64>| threshold.filter(|t| value >= *t);
    let (level, threshold) = if let Some(t) = crossed(critical) {
        (Level::Critical, t)
    } else if let Some(t) = crossed(warning) {
        (Level::Warning, t)
    } else {
        return;
    };
    findings.push(Finding {
        level,
        machine: machine.to_owned(),
        check: name,
        value,
        complete,
        threshold,
    });
}

fn alerts_for(config: &KeelConfig, machine: &str) -> anyhow::Result<AlertThresholds> {
    Ok(config
        .queue_for(machine, None)
        .with_context(|| format!("--config: machine {machine}"))?
        .alerts)
}

fn millis(d: Option<std::time::Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The findings for the rows and the last hour's activity under the thresholds each
/// machine resolves to. The oldest ready age is checked per queue and machine; pending
/// (ready plus scheduled) and dead letters per machine, summed over its queues.
/// Processing time is the mean turnaround of the instances that ended in the last hour;
/// a machine with none has no processing-time finding.
pub fn evaluate(
    config: &KeelConfig,
    rows: &[StatusRow],
    activity: &[MachineActivity],
) -> anyhow::Result<Vec<Finding>> {
    let mut findings = Vec::new();
    for a in activity {
        let alerts = alerts_for(config, &a.machine)?;
        if let Some(ms) = a.avg_processing_ms {
            check(
                &mut findings,
                &a.machine,
                "processing_time_ms",
                Counted::exact(ms),
                millis(alerts.processing_time_warning),
                millis(alerts.processing_time_critical),
            );
        }
        check(
            &mut findings,
            &a.machine,
            "stuck_leases",
            a.stuck_leases_counted(),
            alerts.stuck_leases_warning,
            alerts.stuck_leases_critical,
        );
    }
    for row in rows {
        let alerts = alerts_for(config, &row.machine)?;
        if let Some(age) = row.oldest_ready_age_ms {
            check(
                &mut findings,
                &row.machine,
                "oldest_ready_age_ms",
                Counted::exact(u64::try_from(age).unwrap_or(0)),
                millis(alerts.oldest_ready_age_warning),
                millis(alerts.oldest_ready_age_critical),
            );
        }
    }
    // Pending work and dead letters are held against thresholds set per machine, so they
    // are summed over the machine's queues (an instance's queue is chosen per start): one
    // check of each per machine.
    let mut sums: std::collections::BTreeMap<&str, (u64, u64)> = std::collections::BTreeMap::new();
    for row in rows {
        let (pending, dead) = sums.entry(row.machine.as_str()).or_default();
        *pending += row.ready + row.scheduled;
        *dead += row.dead_letters;
    }
    for (machine, (pending, dead)) in sums {
        let alerts = alerts_for(config, machine)?;
        check(
            &mut findings,
            machine,
            "pending",
            Counted::exact(pending),
            alerts.pending_warning,
            alerts.pending_critical,
        );
        check(
            &mut findings,
            machine,
            "dead_letters",
            Counted::exact(dead),
            alerts.dlq_warning,
            alerts.dlq_critical,
        );
    }
    Ok(findings)
}

/// Reads the store and evaluates the thresholds: what `keel health` and `GET /health`
/// share. A store that cannot be read is [`Unreachable`].
pub async fn probe(
    keel: &Keel,
    ns: &str,
    config: &KeelConfig,
) -> anyhow::Result<(Vec<StatusRow>, Vec<Finding>)> {
    let now = commands::now();
    let (rows, activity) = commands::status_and_activity(keel, ns, None, now)
        .await
        .map_err(|error| Unreachable(format!("{error:#}")))?;
    let findings = evaluate(config, &rows, &activity)?;
    Ok((rows, findings))
}

/// Whether `config` sets any threshold `health` checks: at the system level
/// (`[queue.alerts]`) or a machine's (`[machines.<name>.queue.alerts]`).
pub fn has_thresholds(config: &KeelConfig) -> bool {
    let set =
        |alerts: &Option<AlertThresholds>| alerts.is_some_and(|a| a != AlertThresholds::default());
    set(&config.queue.alerts) || config.machines.values().any(|m| set(&m.queue.alerts))
}

/// The configuration `keel health` holds the store against: [`read_config`], refused
/// (exit 1, naming `--config` and what to add) when it sets no threshold, since with
/// nothing to hold the counts against the probe would report healthy. Read before the
/// store is opened, so a broken or empty file is reported even when the store is down.
pub fn thresholds(cli: &Cli) -> anyhow::Result<KeelConfig> {
    let config = read_config(cli)?;
    if !has_thresholds(&config) {
        let file = match &cli.config {
            None => "no --config file (or KEEL_CONFIG) is named".to_owned(),
            Some(path) => format!(
                "{} has no [queue.alerts] or [machines.<name>.queue.alerts] threshold",
                path.display()
            ),
        };
        bail!(
            "--config: no alert thresholds configured ({file}); name a keel.toml with thresholds such as [queue.alerts] dlq_warning = 10, pending_critical = 10000"
        );
    }
    Ok(config)
}

/// Runs the probe with the [`thresholds`] of `config`.
pub async fn run(keel: &Keel, cli: &Cli, config: &KeelConfig) -> anyhow::Result<Report> {
    let (rows, findings) = probe(keel, &cli.namespace, config).await?;
    let level = findings.iter().map(|f| f.level).max().unwrap_or(Level::Healthy);
    let mut t = table(&["level", "machine", "check", "value", "threshold"]);
    for f in &findings {
        t.add_row(vec![
            format!("{:?}", f.level).to_uppercase(),
            f.machine.clone(),
            f.check.to_owned(),
            f.value().text(),
            f.threshold.to_string(),
        ]);
    }
    let human = match level {
        Level::Healthy => {
            format!("HEALTHY: {} queue/machine pair(s) within thresholds.", rows.len())
        }
        Level::Warning => format!("WARNING\n{t}"),
        Level::Critical => format!("CRITICAL\n{t}"),
    };
    let code = match level {
        Level::Healthy => Code::Ok,
        Level::Warning => Code::Failure,
        Level::Critical => Code::Critical,
    };
    let json = json!({ "status": level, "namespace": cli.namespace, "findings": findings });
    Ok(Report { json, human, code })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(queue: &str, machine: &str, ready: u64, scheduled: u64, oldest: i64) -> StatusRow {
        StatusRow {
            namespace: "default".into(),
            queue: queue.into(),
            machine: machine.into(),
            ready,
            scheduled,
            executing: 0,
            waiting: 0,
            suspended: 0,
            dead_letters: 0,
            oldest_ready_age_ms: Some(oldest),
            paused: false,
        }
    }

    /// A machine's instances spread over two queues cross its pending threshold together,
    /// while the oldest ready age stays a per-queue check.
    #[test]
    fn pending_is_summed_over_a_machines_queues() {
        let config = KeelConfig::from_toml_str(
            "[queue.alerts]\npending_critical = 10000\noldest_ready_age_warning = \"1m\"\n",
        )
        .unwrap();
        let rows = [
            row("default", "order", 5_000, 1_000, 1_000),
            row("bulk", "order", 6_000, 0, 120_000),
            row("default", "mail", 9_999, 0, 0),
        ];
        let findings = evaluate(&config, &rows, &[]).unwrap();
        let seen: Vec<(&str, &str, u64, Level)> =
            findings.iter().map(|f| (f.machine.as_str(), f.check, f.value, f.level)).collect();
        assert_eq!(
            seen,
            [
                ("order", "oldest_ready_age_ms", 120_000, Level::Warning),
                ("order", "pending", 12_000, Level::Critical),
            ]
        );
    }
}
