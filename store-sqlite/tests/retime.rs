//! Moving armed timers to a deployed definition's durations reads only the timers that
//! move: a second pass over a machine version whose timers were moved already returns no
//! timer (one empty page), whatever their number, as does a deployed list that names a
//! timer twice with its current duration first; a later deploy that changes a duration
//! again moves them all again.

use keel_core::chart::{TimerArm, TimerKind};
use keel_core::instance::ANY_SIGNAL;
use keel_core::ports::Store;
use keel_core::ports::store::{TimerRetimePage, TimerRetimeParams};
use keel_core::{MachineRef, NewInstance, Outcome, StepCommit, TimerId};
use keel_store_sqlite::SqliteStore;
use keel_testkit::conformance::support::{at, claim_id, commit_ok, get, insert_one};
use serde_json::json;
use std::time::Duration;

const NS: &str = "retime";
const DAY: Duration = Duration::from_secs(86_400);

fn expire(interval: Duration) -> TimerArm {
    TimerArm {
        state: "awaiting".into(),
        event: "EXPIRE".into(),
        kind: TimerKind::After,
        interval,
        max: None,
        then: None,
    }
}

fn remind() -> TimerArm {
    TimerArm {
        event: "REMIND".into(),
        kind: TimerKind::Every,
        ..expire(Duration::from_secs(3_600))
    }
}

fn params(timers: Vec<TimerArm>, after: Option<TimerId>) -> TimerRetimeParams {
    TimerRetimeParams {
        machine: MachineRef::new("retimed", 1),
        timers,
        after,
        limit: 2,
        now: at(1_000),
    }
}

/// One pass with the deployed deadline `deadline`, page by page; returns every page.
async fn pass(s: &SqliteStore, deadline: Duration) -> Vec<TimerRetimePage> {
    pass_with(s, vec![expire(deadline), remind()]).await
}

/// One pass with the deployed timers `timers`, page by page (at most 20 pages); returns
/// every page.
async fn pass_with(s: &SqliteStore, timers: Vec<TimerArm>) -> Vec<TimerRetimePage> {
    let mut pages = Vec::new();
    let mut after = None;
    for _ in 0..20 {
        let page = s.timers_retime(params(timers.clone(), after)).await.expect("timers_retime");
        after = page.next;
        pages.push(page);
        if after.is_none() {
            return pages;
        }
    }
    panic!("the pass did not end within 20 pages: {pages:?}");
}

fn moved(pages: &[TimerRetimePage]) -> usize {
    pages.iter().map(|p| p.retimed.len()).sum()
}

#[tokio::test]
async fn a_second_retime_pass_reads_nothing_and_a_new_duration_moves_every_timer_again() {
    let s = SqliteStore::temporary().await.expect("store");
    let mut ids = Vec::new();
    for _ in 0..6 {
        let id = insert_one(
            &s,
            NewInstance::new(MachineRef::new("retimed", 1), "start").namespace(NS),
            at(0),
        )
        .await;
        let claimed = claim_id(&s, NS, id, at(5)).await;
        let park = Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: None };
        let mut c = StepCommit::new(id, claimed.token(), park);
        c.timers_arm = vec![expire(DAY * 7), remind()];
        commit_ok(&s, c, at(10)).await;
        ids.push(id);
    }

    let first = pass(&s, DAY).await;
    assert_eq!(moved(&first), 6, "every deadline moved, no reminder: {first:?}");

    let second = pass(&s, DAY).await;
    assert_eq!(second.len(), 1, "the first page of a second pass is its last: {second:?}");
    assert!(second[0].retimed.is_empty(), "nothing moved again: {second:?}");
    for id in &ids {
        let history = get(&s, *id).await.history;
        let retimed = history.iter().filter(|h| h.entry.kind == "TIMER_RETIMED").count();
        assert_eq!(retimed, 1, "instance {id} recorded one move");
    }

    // A deployed list naming the deadline twice: the first entry counts, and it is the
    // duration the deadlines have, so none may move and the pass is one empty page.
    let twice = pass_with(&s, vec![expire(DAY), expire(DAY * 3), remind()]).await;
    assert_eq!(twice.len(), 1, "a duplicate that the first entry hides reads nothing: {twice:?}");
    assert!(twice[0].retimed.is_empty(), "nothing moved: {twice:?}");

    let third = pass(&s, DAY * 2).await;
    assert_eq!(moved(&third), 6, "a new deployed duration moves every deadline: {third:?}");
    let timers = get(&s, ids[0]).await.timers;
    let deadline = timers.iter().find(|t| t.spec.event == "EXPIRE").expect("the deadline");
    assert_eq!(deadline.spec.interval, DAY * 2);
}
