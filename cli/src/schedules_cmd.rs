//! `keel schedules`: the schedules of the configuration file with their pause state and
//! next fire times; `keel schedules pause|resume NAME` for every worker.
//!
//! Schedules are defined in code and in `keel.toml`; these commands read the file that
//! `--config` (or `KEEL_CONFIG`) names, so a name that no schedule has is refused before
//! anything is stored. Pause and resume are stored in the database (`Store::schedule_pause`)
//! under the schedule's namespace; every worker's runner reads them before it fires a
//! tick. The listing reads the stored states when the store is reachable and says so when
//! it is not; its next fire time is the one the runners' rule lets through (after a
//! recorded fired tick too), and it names stored states left over by schedules the file no
//! longer defines, which `keel schedules forget` deletes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{anyhow, bail};
use keel::json;
use keel_core::Timestamp;
use keel_core::ports::Store;
use keel_core::ports::store::{ScheduleForgetParams, SchedulePauseParams, ScheduleState};
use keel_core::schedule::{Pause, Schedule, ScheduleInfo, plan_forget};

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
        Some(SchedulesCommand::Forget { names }) => forget(cli, path, &schedules, names).await,
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
            let state = stored.get(&key);
            s.info(now, Pause::resolve(s.is_paused(), state), state.and_then(|st| st.fired_through))
        })
        .collect()
}

/// The stored states, in the namespaces `schedules` act in, of schedules that `schedules`
/// does not define (removed or renamed), as `(namespace, name)` in order.
pub fn leftovers(
    schedules: &[Schedule],
    stored: &BTreeMap<(String, String), ScheduleState>,
) -> Vec<(String, String)> {
    let namespaces: BTreeSet<&str> = schedules.iter().map(Schedule::namespace).collect();
    let states: Vec<ScheduleState> = stored.values().cloned().collect();
    namespaces
        .into_iter()
        .flat_map(|ns| {
            plan_forget(ns, &states, schedules).into_iter().map(move |name| (ns.to_owned(), name))
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
    let leftover = leftovers(schedules, stored);
    let (store, store_error) = match &source {
        Ok(describe) => (Some(describe.clone()), None),
        Err(why) => (None, Some(why.clone())),
    };
    let leftover_json: Vec<_> =
        leftover.iter().map(|(ns, name)| json!({ "namespace": ns, "name": name })).collect();
    let body = json!({
        "schedules": infos,
        "leftover": leftover_json,
        "store": store,
        "store_error": store_error,
    });
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
    let mut notes: Vec<String> = Vec::new();
    for i in infos.iter().filter(|i| i.fired_ahead) {
        let through = i.fired_through.map_or_else(String::new, |at| time(at.as_millis()));
        notes.push(format!(
            "\n{} is recorded as fired through {through}, ahead of this clock: no tick fires \
             before then (a clock ran ahead); `keel schedules resume {}` re-anchors it.",
            i.name, i.name
        ));
    }
    if !leftover.is_empty() {
        let names: Vec<String> =
            leftover.iter().map(|(ns, name)| format!("{name} ({ns})")).collect();
        notes.push(format!(
            "\nStored states of schedules this file does not define: {}. They count toward \
             their namespace's limit of {} stored states; `keel schedules forget` deletes them.",
            names.join(", "),
            keel_core::schedule::SCHEDULE_STATES_MAX
        ));
    }
    let note = match source {
        Ok(describe) => format!("Pause states read from the store ({describe}).{}", notes.concat()),
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

/// Deletes the stored states of schedules the file no longer defines: `names` of them, or
/// every one when `names` is empty. A name the file defines is refused (its state is in
/// use), and so is one with no stored state.
async fn forget(
    cli: &Cli,
    config: &Path,
    schedules: &[Schedule],
    names: &[String],
) -> anyhow::Result<Report> {
    let keel = connect(cli, false).await?;
    let stored = stored_states(keel.store(), schedules).await?;
    let chosen = choose_leftovers(schedules, &leftovers(schedules, &stored), names)
        .map_err(|e| anyhow!("{e} ({})", config.display()))?;
    let mut by_namespace: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (ns, name) in &chosen {
        by_namespace.entry(ns.clone()).or_default().push(name.clone());
    }
    let mut deleted = 0;
    // One call per namespace the file's schedules act in (at most SCHEDULES_MAX), each
    // with at most SCHEDULE_STATES_MAX names (what one read of the namespace returns).
    for (namespace, names) in by_namespace {
        deleted += keel.store().schedule_forget(ScheduleForgetParams { namespace, names }).await?;
    }
    let listed: Vec<_> =
        chosen.iter().map(|(ns, name)| json!({ "namespace": ns, "name": name })).collect();
    let human = if chosen.is_empty() {
        "No stored states of schedules this file does not define: nothing to forget.".to_owned()
    } else {
        let names: Vec<String> = chosen.iter().map(|(ns, name)| format!("{name} ({ns})")).collect();
        format!(
            "Forgot {deleted} stored schedule state(s): {}. Their pauses and recorded ticks are \
             gone; a schedule of one of these names added later starts with nothing stored.",
            names.join(", ")
        )
    };
    Ok(Report::ok(json!({ "forgotten": listed, "deleted": deleted }), human))
}

/// Which leftover states `forget` deletes: all of them when `names` is empty, else the
/// named ones; a name the file defines, or one that is not left over, is an error.
pub fn choose_leftovers(
    schedules: &[Schedule],
    leftover: &[(String, String)],
    names: &[String],
) -> Result<Vec<(String, String)>, String> {
    if names.is_empty() {
        return Ok(leftover.to_vec());
    }
    let mut chosen = Vec::new();
    for name in names {
        if schedules.iter().any(|s| s.name() == name) {
            return Err(format!(
                "{name:?} is a schedule of the file and its stored state is in use; remove its \
                 [schedules.{name}] section (and stop the workers serving it) before forgetting it"
            ));
        }
        let found: Vec<_> = leftover.iter().filter(|(_, n)| n == name).cloned().collect();
        if found.is_empty() {
            let all: Vec<&str> = leftover.iter().map(|(_, n)| n.as_str()).collect();
            return Err(if all.is_empty() {
                format!("no stored state named {name:?} is left over: there are none")
            } else {
                format!(
                    "no stored state named {name:?} is left over; those left over are: {}",
                    all.join(", ")
                )
            });
        }
        chosen.extend(found);
    }
    chosen.sort();
    chosen.dedup();
    Ok(chosen)
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
    let info = schedule.info(now, Pause::resolve(false, Some(state)), state.fired_through);
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
    fn the_listing_shows_the_tick_that_fires_and_the_states_left_over() {
        let config = KeelConfig::from_toml_str(
            "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n",
        )
        .unwrap();
        let schedules = config.schedules().unwrap();
        let t0 = 1_767_225_600_000_i64; // 2026-01-01T00:00:00Z
        let day = 86_400_000;
        let state = |name: &str, fired_through| {
            (
                ("default".to_owned(), name.to_owned()),
                ScheduleState {
                    namespace: "default".into(),
                    name: name.into(),
                    paused: false,
                    changed_at: None,
                    fired_through: Some(Timestamp::from_millis(fired_through)),
                },
            )
        };
        // Recorded two days ahead (a clock that ran ahead): tonight's and tomorrow's ticks
        // do not fire, so the next fire is the one after the recorded tick.
        let stored: BTreeMap<_, _> = [
            state("nightly", t0 + 2 * day + 7_200_000),
            state("renamed-away", t0),
            state("old", t0),
        ]
        .into_iter()
        .collect();
        let report =
            list(&schedules, &stored, Ok("sqlite://k.db".into()), Timestamp::from_millis(t0));
        let nightly = &report.json["schedules"][0];
        assert_eq!(nightly["next_fire"], json!(t0 + 3 * day + 7_200_000), "{nightly}");
        assert_eq!(nightly["fired_ahead"], json!(true));
        assert!(report.human.contains("keel schedules resume nightly"), "{}", report.human);
        assert_eq!(
            report.json["leftover"],
            json!([{ "namespace": "default", "name": "old" }, { "namespace": "default", "name": "renamed-away" }])
        );
        assert!(report.human.contains("old (default), renamed-away (default)"), "{}", report.human);
        assert!(report.human.contains("keel schedules forget"), "{}", report.human);

        // `forget` takes every leftover, or the named ones; a defined or unknown name is refused.
        let leftover = leftovers(&schedules, &stored);
        assert_eq!(choose_leftovers(&schedules, &leftover, &[]).unwrap(), leftover);
        let one = choose_leftovers(&schedules, &leftover, &["old".into()]).unwrap();
        assert_eq!(one, [("default".to_owned(), "old".to_owned())]);
        let err = choose_leftovers(&schedules, &leftover, &["nightly".into()]).unwrap_err();
        assert!(err.contains("in use") && err.contains("[schedules.nightly]"), "{err}");
        let err = choose_leftovers(&schedules, &leftover, &["nope".into()]).unwrap_err();
        assert!(err.contains("those left over are: old, renamed-away"), "{err}");
    }

    /// `keel schedules forget` deletes the named leftover state, then every other one,
    /// and never the state of a schedule the file defines.
    #[tokio::test]
    async fn forget_deletes_the_states_the_file_no_longer_defines() {
        use clap::Parser as _;
        use keel_core::ports::store::ScheduleFiredParams;
        let dir = tempfile::tempdir().unwrap();
        let toml = dir.path().join("keel.toml");
        std::fs::write(
            &toml,
            "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n",
        )
        .unwrap();
        let url = format!("sqlite://{}", dir.path().join("keel.db").display());
        let options = keel::ConnectOptions::default().migrate(true).create(true);
        let keel = keel::Keel::connect_with(&url, options).await.unwrap();
        for name in ["nightly", "old", "gone"] {
            let tick = Timestamp::from_millis(60_000);
            let params =
                ScheduleFiredParams { namespace: "default".into(), name: name.into(), tick };
            keel.store().schedule_fired(params).await.unwrap();
        }
        let cli = Cli::try_parse_from([
            "keel",
            "--database-url",
            &url,
            "--config",
            toml.to_str().unwrap(),
            "schedules",
        ])
        .unwrap();
        let names = || async {
            let states = keel.store().schedule_states("default".into()).await.unwrap();
            states.into_iter().map(|s| s.name).collect::<Vec<_>>()
        };
        let forget = |names: &[&str]| SchedulesCommand::Forget {
            names: names.iter().map(|n| (*n).to_owned()).collect(),
        };
        let report = run(&cli, Some(&forget(&["old"]))).await.unwrap();
        assert_eq!(report.json["deleted"], json!(1), "{}", report.human);
        assert_eq!(names().await, ["gone", "nightly"]);
        let err = run(&cli, Some(&forget(&["nightly"]))).await.unwrap_err().to_string();
        assert!(err.contains("in use"), "{err}");
        let report = run(&cli, Some(&forget(&[]))).await.unwrap();
        assert_eq!(report.json["forgotten"], json!([{ "namespace": "default", "name": "gone" }]));
        assert_eq!(names().await, ["nightly"], "the defined schedule keeps its state");
        let report = run(&cli, Some(&forget(&[]))).await.unwrap();
        assert!(report.human.contains("nothing to forget"), "{}", report.human);
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
