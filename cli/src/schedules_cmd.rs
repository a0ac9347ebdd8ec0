//! `keel schedules`: the schedules of the configuration file with their pause state and
//! next fire times; `keel schedules pause|resume NAME` for every worker.
//!
//! Schedules are defined in code and in `keel.toml`; these commands read the file that
//! `--config` (or `KEEL_CONFIG`) names, so a name that no schedule has is refused before
//! anything is stored. Pause and resume are stored in the database (`Store::schedule_pause`)
//! under the schedule's namespace; every worker's runner reads them before it fires a
//! tick. The listing reads the stored states when the store is reachable and says so when
//! it is not; its next fire time is the one the runners' rule lets through (after a
//! recorded fired tick too), and it names stored states no schedule of the file defines,
//! which `keel schedules forget NAME…` (or `--all`) deletes when no other deploy's file
//! defines them either. A resume that re-anchors a recorded fired tick says so, from what
//! to what.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{anyhow, bail};
use keel::json;
use keel_core::Timestamp;
use keel_core::ports::Store;
use keel_core::ports::store::{ScheduleForgetParams, SchedulePauseParams, ScheduleState};
use keel_core::schedule::{
    FORGET_QUIET_MS, Pause, Schedule, ScheduleInfo, plan_forget, re_anchored, recently_used,
};

use crate::commands::{connect, now};
use crate::output::{Report, first_of, table, time};
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
        Some(SchedulesCommand::Forget { names, all, force }) => {
            let pick = Pick { names, all: *all, force: *force };
            forget(cli, path, &schedules, pick).await
        }
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

/// The stored state of the schedule `name` in `namespace`, if any (one bounded read of
/// the namespace).
async fn state_of<S: Store + ?Sized>(
    store: &S,
    namespace: &str,
    name: &str,
) -> keel_core::StoreResult<Option<ScheduleState>> {
    let states = store.schedule_states(namespace.to_owned()).await?;
    Ok(states.into_iter().find(|s| s.name == name))
}

/// `(namespace, name)` pairs as `name (namespace)`, at most
/// [`SHOWN_MAX`](crate::output::SHOWN_MAX) of them, then how many more there are.
fn named(pairs: &[(String, String)]) -> String {
    let texts = pairs.iter().map(|(ns, name)| format!("{name} ({ns})"));
    first_of(texts, |n| format!("and {n} more (`keel schedules --json` lists them all)")).join(", ")
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
        // Only a resume that ends a stored pause re-anchors the recorded tick.
        let fix = if i.paused && i.changed_at.is_some() {
            format!("`keel schedules resume {}` re-anchors it", i.name)
        } else {
            format!(
                "`keel schedules pause {0}` then `keel schedules resume {0}` re-anchors it",
                i.name
            )
        };
        notes.push(format!(
            "\n{} is recorded as fired through {through}, ahead of this clock: no tick fires \
             before then. If a clock ran ahead, {fix} at the resume time (ticks between the \
             resume and {through} may fire again).",
            i.name
        ));
    }
    if !leftover.is_empty() {
        notes.push(format!(
            "\nStored states that no schedule of this file defines: {}. They count toward their \
             namespace's limit of {} stored states. Another deploy's keel.toml in the same \
             namespace may still define them: forget them only if no other deploy's file \
             defines them (`keel schedules forget NAME…`, or `--all`).",
            named(&leftover),
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
    Ok(set_paused(keel.store(), schedule, paused).await?)
}

/// Stores a pause or resume of `schedule` for every worker and reports it ([`changed`]).
pub async fn set_paused<S: Store + ?Sized>(
    store: &S,
    schedule: &Schedule,
    paused: bool,
) -> keel_core::StoreResult<Report> {
    // Read first, so the report can say what a resume's re-anchor moved the tick from.
    let before = state_of(store, schedule.namespace(), schedule.name()).await?;
    let at = now();
    let state = store
        .schedule_pause(SchedulePauseParams {
            namespace: schedule.namespace().to_owned(),
            name: schedule.name().to_owned(),
            paused,
            now: at,
        })
        .await?;
    Ok(changed(schedule, before.as_ref(), &state, at))
}

/// What `keel schedules forget` was asked to delete.
#[derive(Debug, Clone, Copy)]
pub struct Pick<'a> {
    /// `NAME` or `NAMESPACE/NAME` of leftover states.
    pub names: &'a [String],
    /// Every leftover state.
    pub all: bool,
    /// Also states used within [`FORGET_QUIET_MS`].
    pub force: bool,
}

/// Deletes stored states that no schedule of the file defines: the named ones, or every
/// one with `--all`. Refused before anything is deleted: neither names nor `--all`, a
/// name that is not left over (or is left over in several namespaces), and, without
/// `--force`, a state used within [`FORGET_QUIET_MS`].
async fn forget(
    cli: &Cli,
    config: &Path,
    schedules: &[Schedule],
    pick: Pick<'_>,
) -> anyhow::Result<Report> {
    let keel = connect(cli, false).await?;
    let stored = stored_states(keel.store(), schedules).await?;
    let chosen = choose_leftovers(schedules, &leftovers(schedules, &stored), pick)
        .and_then(|chosen| check_quiet(&stored, &chosen, pick.force, now()).map(|()| chosen))
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
        "No stored state is left over (each is of a schedule this file defines): nothing to \
         forget."
            .to_owned()
    } else {
        format!(
            "Forgot {deleted} stored schedule state(s): {}. Their pauses and recorded ticks are \
             gone; a schedule of one of these names added later starts with nothing stored.",
            named(&chosen)
        )
    };
    Ok(Report::ok(json!({ "forgotten": listed, "deleted": deleted }), human))
}

/// Which leftover states `forget` deletes: every one with `all`, else the named ones. A
/// name is `NAME` (the leftover of that name, when only one namespace holds it) or
/// `NAMESPACE/NAME`. Neither names nor `all`, a name that is not left over, one left over
/// in several namespaces, and one the file defines in that namespace are errors.
pub fn choose_leftovers(
    schedules: &[Schedule],
    leftover: &[(String, String)],
    pick: Pick<'_>,
) -> Result<Vec<(String, String)>, String> {
    if pick.all {
        return Ok(leftover.to_vec());
    }
    let there_are = || {
        if leftover.is_empty() {
            "none is left over".to_owned()
        } else {
            format!("left over: {}", named(leftover))
        }
    };
    if pick.names.is_empty() {
        return Err(format!(
            "forget: name the leftover states to delete (`keel schedules forget NAME…`, or \
             NAMESPACE/NAME), or pass --all to delete every one; {}. Forget one only if no \
             other deploy's keel.toml in its namespace defines it",
            there_are()
        ));
    }
    let mut chosen = Vec::new();
    for arg in pick.names {
        let is = |ns: &str, name: &str| arg == name || *arg == format!("{ns}/{name}");
        let found: Vec<_> = leftover.iter().filter(|(ns, n)| is(ns, n)).cloned().collect();
        match found.len() {
            1 => chosen.extend(found),
            0 => {
                if let Some(s) = schedules.iter().find(|s| is(s.namespace(), s.name())) {
                    return Err(format!(
                        "{arg:?}: this file defines schedule {} in namespace {}, so its stored \
                         state there is in use; remove its [schedules.{}] section (and stop \
                         the workers serving it) before forgetting it",
                        s.name(),
                        s.namespace(),
                        s.name()
                    ));
                }
                return Err(format!("{arg:?}: no such stored state is left over; {}", there_are()));
            }
            _ => {
                let choices: Vec<String> =
                    found.iter().map(|(ns, name)| format!("{ns}/{name}")).collect();
                return Err(format!(
                    "{arg:?} is left over in several namespaces; name one as NAMESPACE/NAME: {}",
                    choices.join(", ")
                ));
            }
        }
    }
    chosen.sort();
    chosen.dedup();
    Ok(chosen)
}

/// Refuses, unless `force`, to forget a chosen state used within [`FORGET_QUIET_MS`]
/// before `now` ([`recently_used`]): some worker still serves it, and forgetting it would
/// drop its pause (it fires again) and its recorded tick.
pub fn check_quiet(
    stored: &BTreeMap<(String, String), ScheduleState>,
    chosen: &[(String, String)],
    force: bool,
    now: Timestamp,
) -> Result<(), String> {
    if force {
        return Ok(());
    }
    let recent: Vec<String> = chosen
        .iter()
        .filter_map(|key| {
            let (field, at) = recently_used(stored.get(key)?, now)?;
            Some(format!("{} ({}): {field} {}", key.1, key.0, time(at.as_millis())))
        })
        .collect();
    if recent.is_empty() {
        return Ok(());
    }
    let hours = FORGET_QUIET_MS / 3_600_000;
    let shown = first_of(recent.into_iter(), |n| format!("and {n} more"));
    Err(format!(
        "refusing to forget states used within the last {hours} hours, which some worker (of \
         another deploy, or one not yet stopped) may still serve: {}. Forgetting one drops its \
         pause (it fires again) and its recorded tick. Stop the workers that serve it and wait \
         {hours} hours, or pass --force to delete it anyway; nothing was deleted",
        shown.join("; ")
    ))
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

/// What a pause or resume reports: the stored state, when running the next fire, and when
/// the resume re-anchored the recorded fired tick ([`re_anchored`], from the state
/// `before` it) from what to what.
pub fn changed(
    schedule: &Schedule,
    before: Option<&ScheduleState>,
    state: &ScheduleState,
    now: Timestamp,
) -> Report {
    let info = schedule.info(now, Pause::resolve(false, Some(state)), state.fired_through);
    let moved = re_anchored(before, state);
    let since = state.changed_at.map_or_else(|| "-".to_owned(), |at| time(at.as_millis()));
    let human = if state.paused {
        format!(
            "Schedule {} (namespace {}) is paused for every worker since {since}; ticks passed while paused are never fired.",
            state.name, state.namespace
        )
    } else {
        let next = info.next_fire.map_or_else(|| "never".to_owned(), |at| time(at.as_millis()));
        let moved = moved.map_or_else(String::new, |(from, to)| {
            format!(
                " Recorded fired tick moved from {} to {} (it lay ahead of this clock); ticks \
                 between may fire again.",
                time(from.as_millis()),
                time(to.as_millis())
            )
        });
        format!(
            "Schedule {} (namespace {}) is running for every worker since {since}; next fire {next}.{moved}",
            state.name, state.namespace
        )
    };
    let re_anchored = moved.map(|(from, to)| json!({ "from": from, "to": to }));
    Report::ok(json!({ "schedule": info, "state": state, "re_anchored": re_anchored }), human)
}

/// Set-up shared by the tests of `keel schedules` and of the server's schedules.
#[cfg(test)]
pub(crate) mod test_support {
    use std::path::PathBuf;

    use keel_core::Timestamp;
    use keel_core::ports::store::ScheduleFiredParams;
    use tempfile::TempDir;

    use crate::commands::now;

    /// A configuration with one schedule, `nightly` (namespace default).
    pub(crate) const NIGHTLY_TOML: &str =
        "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n";

    /// A temporary directory holding [`NIGHTLY_TOML`] as `keel.toml` and a migrated SQLite
    /// store: the directory (removed on drop), the file's path, the store's URL and a Keel
    /// on it.
    pub(crate) async fn nightly_store() -> (TempDir, PathBuf, String, keel::Keel) {
        let dir = tempfile::tempdir().unwrap();
        let toml = dir.path().join("keel.toml");
        std::fs::write(&toml, NIGHTLY_TOML).unwrap();
        let url = format!("sqlite://{}", dir.path().join("keel.db").display());
        let options = keel::ConnectOptions::default().migrate(true).create(true);
        let keel = keel::Keel::connect_with(&url, options).await.unwrap();
        (dir, toml, url, keel)
    }

    /// Two days ahead of this clock.
    pub(crate) fn ahead() -> Timestamp {
        Timestamp::from_millis(now().as_millis() + 2 * 86_400_000)
    }

    /// `nightly` (namespace default) recorded as fired through `tick`.
    pub(crate) fn fired(tick: Timestamp) -> ScheduleFiredParams {
        ScheduleFiredParams { namespace: "default".into(), name: "nightly".into(), tick }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{ahead, fired, nightly_store};
    use super::*;
    use keel_core::config::KeelConfig;

    /// A file with one schedule, `nightly`, at 02:00 UTC.
    fn nightly() -> KeelConfig {
        KeelConfig::from_toml_str(
            "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n",
        )
        .unwrap()
    }

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
        let schedules = nightly().schedules().unwrap();
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
        assert!(report.human.contains("keel schedules forget NAME…"), "{}", report.human);
        assert!(
            report.human.contains("forget them only if no other deploy's file defines them"),
            "{}",
            report.human
        );
        // Running (not stored as paused): only a pause, then a resume, re-anchors it.
        assert!(
            report.human.contains(
                "`keel schedules pause nightly` then `keel schedules resume nightly` re-anchors it"
            ),
            "{}",
            report.human
        );

        // `forget` takes every leftover with --all, or the named ones; a defined or unknown
        // name is refused.
        let leftover = leftovers(&schedules, &stored);
        assert_eq!(choose_leftovers(&schedules, &leftover, pick(&[], true)).unwrap(), leftover);
        let one = choose_leftovers(&schedules, &leftover, pick(&["old".into()], false)).unwrap();
        assert_eq!(one, [("default".to_owned(), "old".to_owned())]);
        let err =
            choose_leftovers(&schedules, &leftover, pick(&["nightly".into()], false)).unwrap_err();
        assert!(err.contains("in use") && err.contains("[schedules.nightly]"), "{err}");
        assert!(err.contains("in namespace default"), "{err}");
        let err =
            choose_leftovers(&schedules, &leftover, pick(&["nope".into()], false)).unwrap_err();
        assert!(err.contains("left over: old (default), renamed-away (default)"), "{err}");
    }

    fn pick(names: &[String], all: bool) -> Pick<'_> {
        Pick { names, all, force: false }
    }

    fn leftover_pairs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(ns, name)| ((*ns).to_owned(), (*name).to_owned())).collect()
    }

    /// Without names or --all, `forget` deletes nothing: it names both and lists (a
    /// bounded number of) the leftovers.
    #[test]
    fn forget_without_names_or_all_is_refused_listing_the_leftovers() {
        let schedules = nightly().schedules().unwrap();
        let leftover = leftover_pairs(&[("default", "billing"), ("default", "old")]);
        let none = Pick { names: &[], all: false, force: false };
        let err = choose_leftovers(&schedules, &leftover, none).unwrap_err();
        assert!(err.contains("keel schedules forget NAME…") && err.contains("--all"), "{err}");
        assert!(err.contains("left over: billing (default), old (default)"), "{err}");
        assert!(err.contains("no other deploy's keel.toml"), "{err}");
        let err = choose_leftovers(&schedules, &[], none).unwrap_err();
        assert!(err.contains("none is left over"), "{err}");
        // A long list is cut, counting the rest.
        let many: Vec<(String, String)> =
            (0..25).map(|i| ("default".to_owned(), format!("s{i:02}"))).collect();
        let err = choose_leftovers(&schedules, &many, none).unwrap_err();
        assert!(err.contains("s19 (default), and 5 more"), "{err}");
        assert!(!err.contains("s20"), "{err}");
    }

    /// A leftover whose name the file defines in another namespace is forgotten by name;
    /// a name left over in several namespaces is picked as NAMESPACE/NAME.
    #[test]
    fn forget_picks_leftovers_by_namespace() {
        let config = KeelConfig::from_toml_str(
            "[schedules.nightly]\ncron = \"0 2 * * *\"\n\
             start = { machine = \"report\", namespace = \"ops\" }\n\n\
             [schedules.hourly]\ncron = \"0 * * * *\"\nstart = { machine = \"report\" }\n",
        )
        .unwrap();
        let schedules = config.schedules().unwrap();
        let stored: BTreeMap<_, _> = [("default", "nightly"), ("default", "x"), ("ops", "x")]
            .into_iter()
            .map(|(ns, name)| {
                let state = ScheduleState {
                    namespace: ns.into(),
                    name: name.into(),
                    paused: false,
                    changed_at: None,
                    fired_through: None,
                };
                ((ns.to_owned(), name.to_owned()), state)
            })
            .collect();
        let leftover = leftovers(&schedules, &stored);
        assert_eq!(
            leftover,
            leftover_pairs(&[("default", "nightly"), ("default", "x"), ("ops", "x")])
        );
        let pick = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
            choose_leftovers(
                &schedules,
                &leftover,
                Pick { names: &names, all: false, force: false },
            )
        };
        // nightly is defined in ops only: its state in default is a leftover.
        assert_eq!(pick(&["nightly"]).unwrap(), leftover_pairs(&[("default", "nightly")]));
        assert_eq!(pick(&["default/nightly"]).unwrap(), leftover_pairs(&[("default", "nightly")]));
        let err = pick(&["ops/nightly"]).unwrap_err();
        assert!(err.contains("defines schedule nightly in namespace ops"), "{err}");
        let err = pick(&["x"]).unwrap_err();
        assert!(err.contains("several namespaces") && err.contains("default/x, ops/x"), "{err}");
        assert_eq!(pick(&["ops/x"]).unwrap(), leftover_pairs(&[("ops", "x")]));
        assert_eq!(
            pick(&["ops/x", "default/x", "x/x"]).unwrap_err(),
            "\"x/x\": no such stored state is left over; left over: nightly (default), x \
             (default), x (ops)"
        );
    }

    /// A state used within the last day is refused, naming the field, unless forced.
    #[test]
    fn forget_refuses_a_state_used_within_a_day_unless_forced() {
        let now = Timestamp::from_millis(1_767_225_600_000);
        let day = FORGET_QUIET_MS;
        let state = |name: &str, changed_at: Option<i64>, fired_through: Option<i64>| {
            let state = ScheduleState {
                namespace: "default".into(),
                name: name.into(),
                paused: changed_at.is_some(),
                changed_at: changed_at.map(|ago| Timestamp::from_millis(now.as_millis() - ago)),
                fired_through: fired_through
                    .map(|ago| Timestamp::from_millis(now.as_millis() - ago)),
            };
            (("default".to_owned(), name.to_owned()), state)
        };
        let stored: BTreeMap<_, _> = [
            state("quiet", Some(2 * day), Some(day)),
            state("ticking", None, Some(60_000)),
            state("paused", Some(3_600_000), Some(3 * day)),
        ]
        .into_iter()
        .collect();
        let chosen = leftover_pairs(&[("default", "quiet")]);
        assert_eq!(check_quiet(&stored, &chosen, false, now), Ok(()));
        let chosen =
            leftover_pairs(&[("default", "paused"), ("default", "quiet"), ("default", "ticking")]);
        let err = check_quiet(&stored, &chosen, false, now).unwrap_err();
        assert!(err.contains("paused (default): changed_at 2025-12-31 23:00:00.000Z"), "{err}");
        assert!(err.contains("ticking (default): fired_through 2025-12-31 23:59:00.000Z"), "{err}");
        assert!(!err.contains("quiet"), "{err}");
        assert!(err.contains("within the last 24 hours") && err.contains("--force"), "{err}");
        assert_eq!(check_quiet(&stored, &chosen, true, now), Ok(()));
    }

    /// `keel schedules forget` deletes the named leftover state, then every other one,
    /// and never the state of a schedule the file defines.
    #[tokio::test]
    async fn forget_deletes_the_states_the_file_no_longer_defines() {
        use clap::Parser as _;
        use keel_core::ports::store::ScheduleFiredParams;
        let (_dir, toml, url, keel) = nightly_store().await;
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
        let forget = |names: &[&str], all, force| SchedulesCommand::Forget {
            names: names.iter().map(|n| (*n).to_owned()).collect(),
            all,
            force,
        };
        let report = run(&cli, Some(&forget(&["old"], false, false))).await.unwrap();
        assert_eq!(report.json["deleted"], json!(1), "{}", report.human);
        assert_eq!(names().await, ["gone", "nightly"]);
        let err = run(&cli, Some(&forget(&["nightly"], false, false))).await.unwrap_err();
        assert!(err.to_string().contains("in use"), "{err}");
        let err = run(&cli, Some(&forget(&[], false, false))).await.unwrap_err().to_string();
        assert!(err.contains("--all") && err.contains("left over: gone (default)"), "{err}");
        assert_eq!(names().await, ["gone", "nightly"], "nothing deleted");
        // A state a worker recorded a tick in just now is refused, unless forced.
        let recent =
            ScheduleFiredParams { namespace: "default".into(), name: "fresh".into(), tick: now() };
        keel.store().schedule_fired(recent).await.unwrap();
        let err = run(&cli, Some(&forget(&[], true, false))).await.unwrap_err().to_string();
        assert!(err.contains("fresh (default): fired_through") && err.contains("--force"), "{err}");
        assert_eq!(names().await, ["fresh", "gone", "nightly"], "nothing deleted");
        let report = run(&cli, Some(&forget(&[], true, true))).await.unwrap();
        assert_eq!(
            report.json["forgotten"],
            json!([{ "namespace": "default", "name": "fresh" }, { "namespace": "default", "name": "gone" }])
        );
        assert_eq!(names().await, ["nightly"], "the defined schedule keeps its state");
        let report = run(&cli, Some(&forget(&[], true, false))).await.unwrap();
        assert!(report.human.contains("nothing to forget"), "{}", report.human);
    }

    /// A resume that ends a stored pause and re-anchors a tick recorded ahead says from
    /// what to what; a repeated resume changes nothing and says nothing of it.
    #[tokio::test]
    async fn a_resume_says_when_it_moved_the_recorded_tick() {
        use clap::Parser as _;
        let (_dir, toml, url, keel) = nightly_store().await;
        let tick = ahead();
        keel.store().schedule_fired(fired(tick)).await.unwrap();
        let cli = |command: &str| {
            Cli::try_parse_from([
                "keel",
                "--database-url",
                &url,
                "--config",
                toml.to_str().unwrap(),
                "schedules",
                command,
                "nightly",
            ])
            .unwrap()
        };
        let resume = SchedulesCommand::Resume { name: "nightly".into() };
        let pause = SchedulesCommand::Pause { name: "nightly".into() };
        let report = run(&cli("pause"), Some(&pause)).await.unwrap();
        assert_eq!(report.json["re_anchored"], json!(null), "{}", report.human);
        let report = run(&cli("resume"), Some(&resume)).await.unwrap();
        let resumed_at = report.json["state"]["changed_at"].clone();
        assert_eq!(
            report.json["re_anchored"],
            json!({ "from": tick.as_millis(), "to": resumed_at }),
            "{}",
            report.human
        );
        let to = time(resumed_at.as_i64().unwrap());
        let moved = format!(
            "Recorded fired tick moved from {} to {to} (it lay ahead of this clock); ticks \
             between may fire again.",
            time(tick.as_millis())
        );
        assert!(report.human.contains(&moved), "{}", report.human);
        // A worker records a tick ahead again; resuming the running schedule leaves it.
        let again = ahead();
        keel.store().schedule_fired(fired(again)).await.unwrap();
        let report = run(&cli("resume"), Some(&resume)).await.unwrap();
        assert_eq!(report.json["re_anchored"], json!(null), "{}", report.human);
        assert_eq!(report.json["state"]["fired_through"], json!(again.as_millis()));
        assert_eq!(report.json["state"]["changed_at"], resumed_at, "the first resume's time");
        assert!(!report.human.contains("moved"), "{}", report.human);
    }

    #[test]
    fn an_unknown_name_lists_the_names_there_are() {
        let err = find(&nightly().schedules().unwrap(), "nigthly").unwrap_err();
        assert_eq!(err, "no schedule named \"nigthly\"; the schedules are: nightly");
        let err = find(&[], "x").unwrap_err();
        assert!(err.contains("no [schedules.<name>] section"), "{err}");
    }
}
