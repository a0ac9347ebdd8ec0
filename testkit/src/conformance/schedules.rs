//! Stored schedule states: a pause or resume is kept per (namespace, schedule) for every
//! worker to read, a repeat of the same change keeps its first time, names are checked,
//! and a namespace holds a bounded number of states.

use super::support::{at, expect_kind};
use keel_core::ErrorKind;
use keel_core::ports::Store;
use keel_core::ports::store::{SchedulePauseParams, ScheduleState};
use keel_core::schedule::{SCHEDULE_NAME_MAX, SCHEDULE_STATES_MAX};

fn change(ns: &str, name: &str, paused: bool, t: i64) -> SchedulePauseParams {
    SchedulePauseParams { namespace: ns.into(), name: name.into(), paused, now: at(t) }
}

fn state(ns: &str, name: &str, paused: bool, t: i64) -> ScheduleState {
    ScheduleState { namespace: ns.into(), name: name.into(), paused, changed_at: at(t) }
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
    assert_eq!(again.changed_at, at(300), "a second resume does not move the bound");
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
        match s.schedule_pause(params.clone()).await {
            Err(e) => {
                assert_eq!(e.kind, ErrorKind::Invalid, "{params:?}: {e}");
                assert!(e.message.starts_with(field), "{params:?}: {e} does not name {field}");
            }
            Ok(v) => panic!("{params:?} was accepted: {v:?}"),
        }
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
