//! `keel schedules`: the schedules of the configuration file with their pause state and
//! next fire times; `keel schedules pause|resume NAME` for every worker.
//!
//! Schedules are defined in code and in `keel.toml`; these commands read the file that
//! `--config` (or `KEEL_CONFIG`) names, so a name that no schedule has is refused before
//! anything is stored. Pause and resume are stored in the database (`Store::schedule_pause`)
//! under the schedule's namespace; every worker's runner reads them before it fires a
//! tick. The listing reads the stored states when the store is reachable and says so when
//! it is not.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{anyhow, bail};
use keel::json;
use keel_core::Timestamp;
use keel_core::ports::Store;
use keel_core::ports::store::{SchedulePauseParams, ScheduleState};
use keel_core::schedule::{Pause, Schedule, ScheduleInfo};

use crate::commands::{connect, now};
use crate::output::{Report, table, time};
use crate::{Cli, SchedulesCommand};

/// Lists the configured schedules, or pauses / resumes one.
pub async fn run(cli: &Cli, command: Option<&SchedulesCommand>) -> anyhow::Result<Report> {
    let Some(path) = cli.config.as_deref() else {
        bail!(
            "--config: name the keel.toml whose [schedules.<name>] sections to use (or set KEEL_CONFIG)"
        );
    };
    let schedules = crate::health::read_config(cli)?.schedules()?;
    match command {
        None => {
            // Opening refuses a SQLite file that does not exist (it is not created just to
            // list) and reads the URL the way every command does (`?mode=…` included).
            let (stored, source) = match connect(cli, false).await {
                Err(e) => (BTreeMap::new(), Err(format!("{e:#}"))),
                Ok(keel) => match stored_states(keel.store(), &schedules).await {
                    Ok(stored) => (stored, Ok(keel.describe().to_owned())),
                    Err(e) => (BTreeMap::new(), Err(format!("{e:#}"))),
                },
            };
            Ok(list(&schedules, &stored, source, now()))
        }
        Some(SchedulesCommand::Pause { name }) => set(cli, path, &schedules, name, true).await,
        Some(SchedulesCommand::Resume { name }) => set(cli, path, &schedules, name, false).await,
    }
}

/// The stored states of the namespaces `schedules` act in (one read per namespace).
pub async fn stored_states<S: Store + ?Sized>(
    store: &S,
    schedules: &[Schedule],
) -> anyhow::Result<BTreeMap<(String, String), ScheduleState>> {
    let namespaces: BTreeSet<&str> = schedules.iter().map(Schedule::namespace).collect();
    let mut stored = BTreeMap::new();
    for ns in namespaces {
        for s in store.schedule_states(ns.to_owned()).await? {
            stored.insert((s.namespace.clone(), s.name.clone()), s);
        }
    }
    Ok(stored)
}

/// Each schedule as listed at `now`: the stored state wins over the definition's `paused`.
pub fn infos(
    schedules: &[Schedule],
    stored: &BTreeMap<(String, String), ScheduleState>,
    now: Timestamp,
) -> Vec<ScheduleInfo> {
    schedules
        .iter()
        .map(|s| {
            let key = (s.namespace().to_owned(), s.name().to_owned());
            s.info(now, Pause::resolve(s.is_paused(), stored.get(&key)))
        })
        .collect()
}

/// The report for `schedules` at `now`; `source` describes the store the states came
/// from, or why it could not be read.
pub fn list(
    schedules: &[Schedule],
    stored: &BTreeMap<(String, String), ScheduleState>,
    source: Result<String, String>,
    now: Timestamp,
) -> Report {
    let infos = infos(schedules, stored, now);
    let (store, store_error) = match &source {
        Ok(describe) => (Some(describe.clone()), None),
        Err(why) => (None, Some(why.clone())),
    };
    let body = json!({ "schedules": infos, "store": store, "store_error": store_error });
    if infos.is_empty() {
        return Report::ok(body, "No schedules in the configuration.");
    }
    let mut t = table(&[
        "schedule",
        "namespace",
        "cron",
        "time zone",
        "action",
        "missed",
        "state",
        "next fire (UTC)",
    ]);
    for i in &infos {
        let state = match (i.paused, i.changed_at) {
            (true, Some(at)) => format!("paused since {}", time(at.as_millis())),
            (true, None) => "paused (keel.toml)".to_owned(),
            (false, Some(at)) => format!("resumed {}", time(at.as_millis())),
            (false, None) => "running".to_owned(),
        };
        let next = match (i.paused, i.next_fire) {
            (true, _) => "-".to_owned(),
            (false, Some(at)) => time(at.as_millis()),
            (false, None) => "never".to_owned(),
        };
        t.add_row([
            i.name.clone(),
            i.namespace.clone(),
            i.cron.clone(),
            i.time_zone.clone(),
            i.action.clone(),
            i.missed.to_string(),
            state,
            next,
        ]);
    }
    let note = match source {
        Ok(describe) => format!("Pause states read from the store ({describe})."),
        Err(why) => format!(
            "Pause states from the configuration only: the store was not read ({why}); \
             a pause stored for the fleet is not shown."
        ),
    };
    Report::ok(body, format!("{t}\n{note}"))
}

/// Stores a pause or resume of the schedule `name` of the configuration for every worker.
async fn set(
    cli: &Cli,
    config: &Path,
    schedules: &[Schedule],
    name: &str,
    paused: bool,
) -> anyhow::Result<Report> {
    let schedule = find(schedules, name).map_err(|e| anyhow!("{e} in {}", config.display()))?;
    let keel = connect(cli, false).await?;
    let at = now();
    let state = keel
        .store()
        .schedule_pause(SchedulePauseParams {
            namespace: schedule.namespace().to_owned(),
            name: name.to_owned(),
            paused,
            now: at,
        })
        .await?;
    Ok(changed(schedule, &state, at))
}

/// The schedule named `name`, or an error listing the names there are.
pub fn find<'a>(schedules: &'a [Schedule], name: &str) -> Result<&'a Schedule, String> {
    schedules.iter().find(|s| s.name() == name).ok_or_else(|| {
        let names: Vec<&str> = schedules.iter().map(Schedule::name).collect();
        if names.is_empty() {
            format!("no schedule named {name:?}: no [schedules.<name>] section is defined")
        } else {
            format!("no schedule named {name:?}; the schedules are: {}", names.join(", "))
        }
    })
}

/// What a pause or resume reports: the stored state and, when running, the next fire.
pub fn changed(schedule: &Schedule, state: &ScheduleState, now: Timestamp) -> Report {
    let info = schedule.info(now, Pause::resolve(false, Some(state)));
    let since = state.changed_at.map_or_else(|| "-".to_owned(), |at| time(at.as_millis()));
    let human = if state.paused {
        format!(
            "Schedule {} (namespace {}) is paused for every worker since {since}; ticks passed while paused are never fired.",
            state.name, state.namespace
        )
    } else {
        let next = info.next_fire.map_or_else(|| "never".to_owned(), |at| time(at.as_millis()));
        format!(
            "Schedule {} (namespace {}) is running for every worker since {since}; next fire {next}.",
            state.name, state.namespace
        )
    };
    Report::ok(json!({ "schedule": info, "state": state }), human)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::config::KeelConfig;

    #[test]
    fn lists_each_schedule_with_its_state_and_next_fire_time() {
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

            [schedules.hourly]
            cron = "0 * * * *"
            start = { machine = "report", namespace = "ops" }
            "#,
        )
        .unwrap();
        let schedules = config.schedules().unwrap();
        // 2026-01-01T00:00:00Z: 02:00 in Paris is 01:00 UTC.
        let t0 = 1_767_225_600_000;
        let report = list(
            &schedules,
            &BTreeMap::new(),
            Err("no database file".into()),
            Timestamp::from_millis(t0),
        );
        let named = |report: &Report, name: &str| {
            let all = report.json["schedules"].as_array().unwrap().clone();
            all.into_iter().find(|s| s["name"] == name).unwrap()
        };
        assert_eq!(named(&report, "nightly")["next_fire"], json!(1_767_229_200_000_i64));
        assert_eq!(named(&report, "quiet")["next_fire"], json!(null));
        assert_eq!(report.json["store_error"], json!("no database file"));
        assert!(report.human.contains("2026-01-01 01:00:00.000Z"), "{}", report.human);
        assert!(report.human.contains("paused (keel.toml)"), "{}", report.human);
        assert!(report.human.contains("broadcast renew to sub"), "{}", report.human);
        assert!(report.human.contains("not read (no database file)"), "{}", report.human);

        // Stored states win: the quiet one resumed, the hourly one (namespace ops) paused.
        let state = |ns: &str, name: &str, paused, at| {
            (
                (ns.to_owned(), name.to_owned()),
                ScheduleState {
                    namespace: ns.into(),
                    name: name.into(),
                    paused,
                    changed_at: Some(Timestamp::from_millis(at)),
                    fired_through: None,
                },
            )
        };
        let stored: BTreeMap<_, _> = [
            state("default", "quiet", false, t0 + 90_000),
            state("ops", "hourly", true, t0 - 1),
            state("default", "hourly", false, t0),
        ]
        .into_iter()
        .collect();
        let report =
            list(&schedules, &stored, Ok("sqlite://k.db".into()), Timestamp::from_millis(t0));
        let quiet = &named(&report, "quiet");
        assert_eq!(quiet["paused"], json!(false));
        assert_eq!(quiet["next_fire"], json!(t0 + 120_000), "after the resume time");
        let hourly = &named(&report, "hourly");
        assert_eq!((&hourly["paused"], &hourly["namespace"]), (&json!(true), &json!("ops")));
        assert!(report.human.contains("paused since 2025-12-31 23:59:59.999Z"), "{}", report.human);
        assert!(report.human.contains("read from the store (sqlite://k.db)"), "{}", report.human);
    }

    #[test]
    fn an_unknown_name_lists_the_names_there_are() {
        let config = KeelConfig::from_toml_str(
            "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n",
        )
        .unwrap();
        let err = find(&config.schedules().unwrap(), "nigthly").unwrap_err();
        assert_eq!(err, "no schedule named \"nigthly\"; the schedules are: nightly");
        let err = find(&[], "x").unwrap_err();
        assert!(err.contains("no [schedules.<name>] section"), "{err}");
    }
}
