//! `keel schedules`: the schedules of the configuration file with their next fire times.
//!
//! Schedules are defined in code and in `keel.toml`; this command reads the file that
//! `--config` (or `KEEL_CONFIG`) names, so it needs no store. Pause and resume act on a
//! running worker (its `Schedules` handle), not through the store.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::bail;
use keel::json;
use keel_core::Timestamp;

use crate::Cli;
use crate::output::{Report, table, time};

/// Lists the configured schedules at the current time.
pub fn run(cli: &Cli) -> anyhow::Result<Report> {
    if cli.config.is_none() {
        bail!(
            "--config: name the keel.toml whose [schedules.<name>] sections to list (or set KEEL_CONFIG)"
        );
    }
    let config = crate::health::read_config(cli)?;
    let schedules = config.schedules()?;
    let millis = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let now = Timestamp::from_millis(i64::try_from(millis).unwrap_or(i64::MAX));
    Ok(list(&schedules, now))
}

/// The report for `schedules` at `now`.
pub fn list(schedules: &[keel::Schedule], now: Timestamp) -> Report {
    let infos: Vec<_> = schedules.iter().map(|s| s.info(now, s.is_paused())).collect();
    if infos.is_empty() {
        return Report::ok(json!({ "schedules": [] }), "No schedules in the configuration.");
    }
    let mut t = table(&["schedule", "cron", "time zone", "action", "missed", "next fire (UTC)"]);
    for i in &infos {
        let next = match (i.paused, i.next_fire) {
            (true, _) => "paused".to_owned(),
            (false, Some(at)) => time(at.as_millis()),
            (false, None) => "never".to_owned(),
        };
        t.add_row([
            i.name.clone(),
            i.cron.clone(),
            i.time_zone.clone(),
            i.action.clone(),
            i.missed.to_string(),
            next,
        ]);
    }
    Report::ok(json!({ "schedules": infos }), t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::config::KeelConfig;

    #[test]
    fn lists_each_schedule_with_its_next_fire_time() {
        let config = KeelConfig::from_toml_str(
            r#"
            [schedules.nightly]
            cron = "0 2 * * *"
            time_zone = "Europe/Paris"
            start = { machine = "report" }

            [schedules.quiet]
            cron = "* * * * *"
            paused = true
            broadcast = { machine = "sub", event = "renew" }
            "#,
        )
        .unwrap();
        // 2026-01-01T00:00:00Z: 02:00 in Paris is 01:00 UTC.
        let report = list(&config.schedules().unwrap(), Timestamp::from_millis(1_767_225_600_000));
        assert_eq!(report.json["schedules"][0]["next_fire"], json!(1_767_229_200_000_i64));
        assert_eq!(report.json["schedules"][1]["next_fire"], json!(null));
        assert!(report.human.contains("2026-01-01 01:00:00.000Z"), "{}", report.human);
        assert!(report.human.contains("paused"), "{}", report.human);
        assert!(report.human.contains("broadcast renew to sub"), "{}", report.human);
    }
}
