//! Stored schedule states: a pause or resume is kept per (namespace, schedule) for every
//! worker to read, a repeat of the same change keeps its first time, a fired tick is
//! recorded as the latest one fired and never moves back, a resume that ends a stored
//! pause re-anchors a recorded tick ahead of its time (a repeated resume never does), names
//! are checked, a namespace holds a bounded number of
//! states, and forgetting the states of removed schedules frees their place.

use super::support::{at, expect_invalid_naming, expect_kind};
use keel_core::ErrorKind;
use keel_core::ports::Store;
use keel_core::ports::store::{
    ScheduleFiredParams, ScheduleForgetParams, SchedulePauseParams, ScheduleState,
};
use keel_core::schedule::{FIRED_AHEAD_SLACK_MS, SCHEDULE_NAME_MAX, SCHEDULE_STATES_MAX};

fn change(ns: &str, name: &str, paused: bool, t: i64) -> SchedulePauseParams {
    SchedulePauseParams { namespace: ns.into(), name: name.into(), paused, now: at(t) }
}

fn state(ns: &str, name: &str, paused: bool, t: i64) -> ScheduleState {
    ScheduleState {
        namespace: ns.into(),
        name: name.into(),
        paused,
        changed_at: Some(at(t)),
        fired_through: None,
    }
}

fn fired(ns: &str, name: &str, tick: i64) -> ScheduleFiredParams {
    ScheduleFiredParams { namespace: ns.into(), name: name.into(), tick: at(tick) }
}

/// A state that records only a fired tick: no pause was ever stored.
fn ticked(ns: &str, name: &str, tick: i64) -> ScheduleState {
    ScheduleState {
        namespace: ns.into(),
        name: name.into(),
        paused: false,
        changed_at: None,
        fired_through: Some(at(tick)),
    }
}

async fn states<S: Store>(s: &S, ns: &str) -> Vec<ScheduleState> {
    s.schedule_states(ns.into()).await.expect("schedule_states")
}

/// Pause, a repeated pause, resume and a repeated resume, across two namespaces; every
/// reader sees the same states, in name order.
pub async fn schedule_pause_is_stored_for_every_worker<S: Store>(s: &S) {
    assert_eq!(states(s, "sched-a").await, vec![], "nothing stored yet");
    let paused = s.schedule_pause(change("sched-a", "nightly", true, 100)).await.expect("pause");
    assert_eq!(paused, state("sched-a", "nightly", true, 100));
    // Pausing again changes nothing, its time included.
    let again = s.schedule_pause(change("sched-a", "nightly", true, 200)).await.expect("again");
    assert_eq!(again, state("sched-a", "nightly", true, 100), "a repeat keeps the first time");
    s.schedule_pause(change("sched-a", "hourly", false, 150)).await.expect("resume a new one");
    s.schedule_pause(change("sched-b", "nightly", false, 160)).await.expect("other namespace");
    assert_eq!(
        states(s, "sched-a").await,
        vec![state("sched-a", "hourly", false, 150), state("sched-a", "nightly", true, 100),]
    );
    // Resuming moves the time: ticks up to it are not fired later.
    let resumed = s.schedule_pause(change("sched-a", "nightly", false, 300)).await.expect("resume");
    assert_eq!(resumed, state("sched-a", "nightly", false, 300));
    let again = s.schedule_pause(change("sched-a", "nightly", false, 400)).await.expect("again");
    assert_eq!(again.changed_at, Some(at(300)), "a second resume does not move the bound");
    assert_eq!(states(s, "sched-a").await[1], state("sched-a", "nightly", false, 300));
    assert_eq!(states(s, "sched-b").await, vec![state("sched-b", "nightly", false, 160)]);
    assert_eq!(states(s, "sched-c").await, vec![]);
    // Bad names are refused before anything is written.
    let long = "x".repeat(SCHEDULE_NAME_MAX + 1);
    for (params, field) in [
        (change("", "nightly", true, 1), "namespace"),
        (change("sched-a", "", true, 1), "name"),
        (change("sched-a", &long, true, 1), "name"),
        (change("sched-a", "nul\0", true, 1), "name"),
    ] {
        expect_invalid_naming(s.schedule_pause(params.clone()).await, field, &params);
    }
    assert_eq!(states(s, "sched-a").await.len(), 2, "refused changes wrote nothing");
}

/// A namespace holds at most `SCHEDULE_STATES_MAX` states: one more schedule is refused,
/// the ones it holds still change, and other namespaces are not affected.
pub async fn schedule_states_are_bounded_per_namespace<S: Store>(s: &S) {
    for i in 0..SCHEDULE_STATES_MAX {
        let name = format!("s{i:04}");
        s.schedule_pause(change("sched-full", &name, true, 10)).await.expect("within the bound");
    }
    let held = states(s, "sched-full").await;
    assert_eq!(held.len(), SCHEDULE_STATES_MAX);
    assert_eq!(held[0].name, "s0000", "name order");
    expect_kind(
        s.schedule_pause(change("sched-full", "one-more", true, 20)).await,
        ErrorKind::Invalid,
        "a state beyond the bound",
    );
    let changed = s.schedule_pause(change("sched-full", "s0007", false, 30)).await;
    assert_eq!(changed.expect("a held state changes"), state("sched-full", "s0007", false, 30));
    s.schedule_pause(change("sched-other", "one-more", true, 20)).await.expect("other namespace");
    assert_eq!(states(s, "sched-full").await.len(), SCHEDULE_STATES_MAX);
    assert!(!states(s, "sched-full").await.iter().any(|st| st.name == "one-more"));
}

/// A fired tick is recorded as the latest one fired: an older or equal tick leaves it,
/// a newer one moves it forward. Recording leaves the stored pause alone and a pause
/// leaves the recorded tick; a row that only records ticks stores no pause, so a resume
/// of it is stored. Every reader sees it through `schedule_states`.
pub async fn schedule_fired_keeps_the_latest_tick_for_every_worker<S: Store>(s: &S) {
    let record = |p| async move { s.schedule_fired(p).await.expect("schedule_fired") };
    assert_eq!(record(fired("sched-f", "nightly", 100)).await, ticked("sched-f", "nightly", 100));
    assert_eq!(states(s, "sched-f").await, vec![ticked("sched-f", "nightly", 100)]);
    // An older or the same tick never moves it back.
    assert_eq!(record(fired("sched-f", "nightly", 50)).await, ticked("sched-f", "nightly", 100));
    assert_eq!(record(fired("sched-f", "nightly", 100)).await, ticked("sched-f", "nightly", 100));
    assert_eq!(states(s, "sched-f").await, vec![ticked("sched-f", "nightly", 100)]);
    assert_eq!(record(fired("sched-f", "nightly", 160)).await, ticked("sched-f", "nightly", 160));
    assert_eq!(states(s, "sched-f").await, vec![ticked("sched-f", "nightly", 160)]);

    // A pause keeps the recorded tick; a later record keeps the pause.
    let paused = s.schedule_pause(change("sched-f", "nightly", true, 200)).await.expect("pause");
    let both = |t: i64| ScheduleState {
        fired_through: Some(at(t)),
        ..state("sched-f", "nightly", true, 200)
    };
    assert_eq!(paused, both(160));
    assert_eq!(record(fired("sched-f", "nightly", 300)).await, both(300));
    assert_eq!(record(fired("sched-f", "nightly", 250)).await, both(300));

    // A resume of a schedule whose row only records ticks is stored (it was not resumed
    // before: nothing said so), and the tick is kept.
    record(fired("sched-f", "hourly", 10)).await;
    let resumed = s.schedule_pause(change("sched-f", "hourly", false, 20)).await.expect("resume");
    let hourly =
        ScheduleState { fired_through: Some(at(10)), ..state("sched-f", "hourly", false, 20) };
    assert_eq!(resumed, hourly);
    assert_eq!(states(s, "sched-f").await, vec![hourly, both(300)]);
    assert_eq!(states(s, "sched-g").await, vec![], "other namespaces hold nothing");

    // Bad names are refused before anything is written.
    let long = "x".repeat(SCHEDULE_NAME_MAX + 1);
    for (params, field) in [
        (fired("", "nightly", 1), "namespace"),
        (fired("sched-f", "", 1), "name"),
        (fired("sched-f", &long, 1), "name"),
    ] {
        expect_invalid_naming(s.schedule_fired(params.clone()).await, field, &params);
    }
    assert_eq!(states(s, "sched-f").await.len(), 2, "refused records wrote nothing");
}

/// Rows that record fired ticks count toward a namespace's `SCHEDULE_STATES_MAX` like
/// pauses: a record of one more schedule is refused, naming the bound and the fix, while
/// the schedules held still record their ticks.
pub async fn schedule_fired_rows_share_the_bound_of_a_namespace<S: Store>(s: &S) {
    for i in 0..SCHEDULE_STATES_MAX {
        let name = format!("s{i:04}");
        if i % 2 == 0 {
            s.schedule_fired(fired("sched-fired-full", &name, 10)).await.expect("within the bound");
        } else {
            let pause = change("sched-fired-full", &name, true, 10);
            s.schedule_pause(pause).await.expect("within the bound");
        }
    }
    assert_eq!(states(s, "sched-fired-full").await.len(), SCHEDULE_STATES_MAX);
    let err = s
        .schedule_fired(fired("sched-fired-full", "one-more", 20))
        .await
        .expect_err("a record beyond the bound is refused");
    assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
    assert!(
        err.message.starts_with("name:")
            && err.message.contains(&SCHEDULE_STATES_MAX.to_string())
            && err.message.contains("delete their rows"),
        "{err}"
    );
    expect_kind(
        s.schedule_pause(change("sched-fired-full", "one-more", true, 20)).await,
        ErrorKind::Invalid,
        "a pause beyond the bound",
    );
    // A paused schedule the namespace holds records its tick and stays paused.
    let held = s.schedule_fired(fired("sched-fired-full", "s0001", 30)).await.expect("held");
    assert_eq!((held.paused, held.fired_through), (true, Some(at(30))));
    s.schedule_fired(fired("sched-fired-other", "one-more", 20)).await.expect("other namespace");
    let full = states(s, "sched-fired-full").await;
    assert_eq!(full.len(), SCHEDULE_STATES_MAX);
    assert!(!full.iter().any(|st| st.name == "one-more"));
    assert_eq!(full[1].fired_through, Some(at(30)), "read back by every worker");
}

/// A resume that ends a stored pause re-anchors a recorded fired tick that lies ahead of
/// the resume time (a clock that ran ahead recorded it) at the resume time, so the
/// schedule fires from its next tick; a pause keeps it, a tick within the slack of
/// ordinary skew is kept, and a resume of a schedule not stored as paused (a repeat, or a
/// row that only records ticks) leaves it: its caller's clock may run behind the
/// workers' that recorded it.
pub async fn schedule_resume_re_anchors_a_fired_tick_ahead_of_it<S: Store>(s: &S) {
    let hour = 3_600_000;
    s.schedule_fired(fired("sched-ahead", "nightly", 10 * hour)).await.expect("record ahead");
    let paused = s.schedule_pause(change("sched-ahead", "nightly", true, hour)).await;
    let paused = paused.expect("pause");
    assert_eq!(paused.fired_through, Some(at(10 * hour)), "a pause keeps the recorded tick");
    let resumed = s.schedule_pause(change("sched-ahead", "nightly", false, 2 * hour)).await;
    let anchored = ScheduleState {
        fired_through: Some(at(2 * hour)),
        ..state("sched-ahead", "nightly", false, 2 * hour)
    };
    assert_eq!(resumed.expect("resume"), anchored);
    assert_eq!(states(s, "sched-ahead").await, vec![anchored.clone()], "read back as stored");
    // A repeated resume of the running schedule leaves a tick recorded since, however
    // far ahead of the caller's clock, and keeps the first resume's time.
    s.schedule_fired(fired("sched-ahead", "nightly", 20 * hour)).await.expect("fired since");
    let again = s.schedule_pause(change("sched-ahead", "nightly", false, 3 * hour)).await;
    let running = ScheduleState { fired_through: Some(at(20 * hour)), ..anchored };
    assert_eq!(again.expect("resume again"), running);
    assert_eq!(states(s, "sched-ahead").await, vec![running]);
    // A row that only records ticks is not stored as paused: its resume keeps the tick.
    s.schedule_fired(fired("sched-ahead", "ticking", 10 * hour)).await.expect("record");
    let ticking = s.schedule_pause(change("sched-ahead", "ticking", false, hour)).await;
    assert_eq!(ticking.expect("resume").fired_through, Some(at(10 * hour)));
    // Within the slack of skew between hosts, the recorded tick stays.
    let near = hour + FIRED_AHEAD_SLACK_MS;
    s.schedule_fired(fired("sched-ahead", "skewed", near)).await.expect("record");
    s.schedule_pause(change("sched-ahead", "skewed", true, hour - 10)).await.expect("pause");
    let kept = s.schedule_pause(change("sched-ahead", "skewed", false, hour)).await;
    assert_eq!(kept.expect("resume").fired_through, Some(at(near)));
}

/// Forgetting deletes the named states of a namespace (pause and recorded tick), passes
/// over names without one, leaves other namespaces alone, and frees their place in a
/// full namespace; too many names, or a bad one, are refused before anything is deleted.
pub async fn schedule_forget_deletes_states_and_frees_their_place<S: Store>(s: &S) {
    let forget = |ns: &str, names: &[&str]| ScheduleForgetParams {
        namespace: ns.into(),
        names: names.iter().map(|n| (*n).to_owned()).collect(),
    };
    for i in 0..SCHEDULE_STATES_MAX {
        let name = format!("s{i:04}");
        s.schedule_fired(fired("sched-forget", &name, 10)).await.expect("within the bound");
    }
    s.schedule_pause(change("sched-forget", "s0001", true, 20)).await.expect("pause a held one");
    s.schedule_fired(fired("sched-forget-other", "s0000", 10)).await.expect("other namespace");
    expect_kind(
        s.schedule_fired(fired("sched-forget", "renamed", 30)).await,
        ErrorKind::Invalid,
        "a full namespace",
    );
    let deleted = s
        .schedule_forget(forget("sched-forget", &["s0000", "s0001", "never-stored"]))
        .await
        .expect("forget");
    assert_eq!(deleted, 2, "a name without a state is passed over");
    let held = states(s, "sched-forget").await;
    assert_eq!(held.len(), SCHEDULE_STATES_MAX - 2);
    assert!(!held.iter().any(|st| st.name == "s0000" || st.name == "s0001"));
    assert_eq!(
        states(s, "sched-forget-other").await,
        vec![ticked("sched-forget-other", "s0000", 10)]
    );
    // Their place is free again: a new schedule records its ticks and stores a pause.
    let renamed = s.schedule_fired(fired("sched-forget", "renamed", 30)).await;
    assert_eq!(renamed.expect("room again"), ticked("sched-forget", "renamed", 30));
    s.schedule_pause(change("sched-forget", "added", true, 40)).await.expect("room for one more");
    expect_kind(
        s.schedule_pause(change("sched-forget", "one-more", true, 50)).await,
        ErrorKind::Invalid,
        "full again",
    );
    // Many names go at once; no names delete nothing.
    let names: Vec<String> = (2..500).map(|i| format!("s{i:04}")).collect();
    let deleted = s
        .schedule_forget(ScheduleForgetParams { namespace: "sched-forget".into(), names })
        .await
        .expect("forget many");
    assert_eq!(deleted, 498);
    assert_eq!(s.schedule_forget(forget("sched-forget", &[])).await.expect("forget none"), 0);
    assert_eq!(states(s, "sched-forget").await.len(), SCHEDULE_STATES_MAX - 498);
    // A forgotten schedule starts over: nothing stored for it.
    s.schedule_fired(fired("sched-forget-other", "s0000", 5)).await.expect("record");
    s.schedule_forget(forget("sched-forget-other", &["s0000"])).await.expect("forget");
    assert_eq!(states(s, "sched-forget-other").await, vec![]);
    // Refused before anything is deleted.
    let many: Vec<String> = (0..=SCHEDULE_STATES_MAX).map(|i| format!("s{i:04}")).collect();
    let too_many = ScheduleForgetParams { namespace: "sched-forget".into(), names: many };
    expect_invalid_naming(s.schedule_forget(too_many.clone()).await, "names", &too_many);
    let long = "x".repeat(SCHEDULE_NAME_MAX + 1);
    for (params, field) in [
        (forget("", &["s0002"]), "namespace"),
        (forget("sched-forget", &["s0002", ""]), "name"),
        (forget("sched-forget", &["s0002", &long]), "name"),
    ] {
        expect_invalid_naming(s.schedule_forget(params.clone()).await, field, &params);
    }
    let held = states(s, "sched-forget").await.len();
    assert_eq!(held, SCHEDULE_STATES_MAX - 498, "nothing deleted");
}
