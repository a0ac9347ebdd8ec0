//! `keel health`: the configured alert thresholds checked against the store.
//!
//! Thresholds come from the configuration file's `alerts` sections (system level, then
//! per machine), resolved the way workers resolve queue settings. A machine without
//! thresholds is healthy whatever its counts.

use std::fmt;

use anyhow::Context as _;
use keel::Keel;
use keel_core::config::{AlertThresholds, KeelConfig};
use serde::Serialize;
use serde_json::json;

use crate::Cli;
use crate::commands::{self, StatusRow};
use crate::exit::Code;
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
    threshold: u64,
}

/// The configuration file `--config` names, or the defaults (no thresholds).
pub fn read_config(cli: &Cli) -> anyhow::Result<KeelConfig> {
    let Some(path) = &cli.config else {
        return Ok(KeelConfig::default());
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config: cannot read {}", path.display()))?;
    KeelConfig::from_toml_str(&text).with_context(|| format!("--config: {}", path.display()))
}

fn check(
    findings: &mut Vec<Finding>,
    machine: &str,
    name: &'static str,
    value: u64,
    warning: Option<u64>,
    critical: Option<u64>,
) {
    let crossed = |threshold: Option<u64>| threshold.filter(|t| value >= *t);
    let (level, threshold) = if let Some(t) = crossed(critical) {
        (Level::Critical, t)
    } else if let Some(t) = crossed(warning) {
        (Level::Warning, t)
    } else {
        return;
    };
    findings.push(Finding { level, machine: machine.to_owned(), check: name, value, threshold });
}

/// The findings for the rows under the thresholds each machine resolves to.
pub fn evaluate(config: &KeelConfig, rows: &[StatusRow]) -> anyhow::Result<Vec<Finding>> {
    let mut findings = Vec::new();
    for row in rows {
        let alerts: AlertThresholds = config
            .queue_for(&row.machine, None)
            .with_context(|| format!("--config: machine {}", row.machine))?
            .alerts;
        let pending = row.ready + row.scheduled;
        check(
            &mut findings,
            &row.machine,
            "pending",
            pending,
            alerts.pending_warning,
            alerts.pending_critical,
        );
        check(
            &mut findings,
            &row.machine,
            "dead_letters",
            row.dead_letters,
            alerts.dlq_warning,
            alerts.dlq_critical,
        );
    }
    Ok(findings)
}

/// Runs the probe.
pub async fn run(keel: &Keel, cli: &Cli) -> anyhow::Result<Report> {
    let config = read_config(cli)?;
    let rows = commands::status_rows(keel, &cli.namespace, None)
        .await
        .map_err(|error| Unreachable(format!("{error:#}")))?;
    let findings = evaluate(&config, &rows)?;
    let level = findings.iter().map(|f| f.level).max().unwrap_or(Level::Healthy);
    let mut t = table(&["level", "machine", "check", "value", "threshold"]);
    for f in &findings {
        t.add_row(vec![
            format!("{:?}", f.level).to_uppercase(),
            f.machine.clone(),
            f.check.to_owned(),
            f.value.to_string(),
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
