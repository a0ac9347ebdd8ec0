//! Timer contracts: armed and cancelled by commits, fired by sweeps
//! exactly once per fire, `every` on the grid of its state entry without back-fill, `max` +
//! `then` delivered once, the status and stats a sweep service relies on, and what a
//! sweeper sleeps on: the earliest due time and the hints of commits that arm timers.

use super::support::{at, claim_id, commit_ok, ctx, get, insert_one, new_in, row};
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::instance::ANY_SIGNAL;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{TimerNextDueParams, TimerSweepParams, TimerSweepReport};
use keel_core::timers::TimerHint;
use keel_core::{InstanceId, Status, StepCommit, Timestamp};
use serde_json::json;
use std::time::Duration;

fn arm(
    state: &str,
    event: &str,
    kind: TimerKind,
    secs: u64,
    max: Option<u32>,
    then: Option<&str>,
) -> TimerArm {
    TimerArm {
        state: state.into(),
        event: event.into(),
        kind,
        interval: Duration::from_secs(secs),
        max,
        then: then.map(str::to_owned),
    }
}

fn park() -> Outcome {
    Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx(1), step: None }
}

/// Inserts an instance in `ns`, and at `at(10)` commits a park that arms `timers`.
async fn armed<S: Store>(s: &S, ns: &str, timers: Vec<TimerArm>) -> InstanceId {
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(5)).await;
    let mut c = StepCommit::new(id, claimed.token(), park());
    c.timers_arm = timers;
    commit_ok(s, c, at(10)).await;
    id
}

async fn sweep<S: Store>(s: &S, ns: &str, now: Timestamp) -> TimerSweepReport {
    let params =
        TimerSweepParams { namespace: Some(ns.into()), machines: vec![], limit: 1_000, now };
    s.timer_sweep(params).await.expect("timer_sweep")
}

async fn inbox_names<S: Store>(s: &S, id: InstanceId) -> Vec<String> {
    get(s, id).await.inbox.iter().map(|s| s.name.clone()).collect()
}

/// Commits a park for a woken instance, consuming its inbox, with timer changes.
async fn settle<S: Store>(s: &S, ns: &str, id: InstanceId, now: Timestamp, cancel: Vec<String>) {
    let claimed = claim_id(s, ns, id, now).await;
    let mut c =
        StepCommit::new(id, claimed.token(), park()).consume(claimed.inbox.iter().map(|s| s.id));
    c.timers_cancel = cancel;
    commit_ok(s, c, now).await;
}

/// `after`: nothing before the deadline; one delivery at it (dedup key, history, wake-up);
/// a second sweep delivers nothing.
pub async fn timer_after_fires_once<S: Store>(s: &S) {
    let ns = "timer_after";
    let id = armed(
        s,
        ns,
        vec![arm("awaiting_payment", "ORDER_EXPIRED", TimerKind::After, 60, None, None)],
    )
    .await;
    let d = get(s, id).await;
    assert_eq!(d.timers.len(), 1);
    let timer = d.timers[0].id;
    assert_eq!(
        d.timers[0].next_fire_at,
        at(10).plus(Duration::from_secs(60)),
        "due one interval after the commit"
    );
    assert_eq!(sweep(s, ns, at(59_000)).await, TimerSweepReport::default(), "not due yet");
    let report = sweep(s, ns, at(70_000)).await;
    assert_eq!((report.fired, report.processed), (1, 1));
    let d = get(s, id).await;
    assert_eq!(d.inbox.len(), 1);
    assert_eq!(d.inbox[0].name, "ORDER_EXPIRED");
    assert_eq!(d.inbox[0].dedup_key, Some(format!("timer:{}:1", timer.0)));
    assert!(d.timers.is_empty(), "an after timer is gone once fired");
    assert_eq!(d.instance.status, Status::Runnable, "the fire woke the instance");
    assert!(d.history.iter().any(|h| h.entry.kind == "TIMER_FIRED"));
    assert_eq!(sweep(s, ns, at(80_000)).await.processed, 0, "a second sweep finds nothing");
    assert_eq!(inbox_names(s, id).await, ["ORDER_EXPIRED"]);
}

/// Leaving the state deletes its timers (and its descendants'): a sweep at the deadline
/// changes nothing.
pub async fn timer_cancelled_when_state_left<S: Store>(s: &S) {
    let ns = "timer_cancel";
    let timers = vec![
        arm("awaiting_payment", "ORDER_EXPIRED", TimerKind::After, 60, None, None),
        arm("processing.payment", "RETRY", TimerKind::Every, 30, None, None),
        arm("shipping", "NUDGE", TimerKind::After, 60, None, None),
    ];
    let id = armed(s, ns, timers).await;
    // Wake it so it can commit again, then leave two of the three states.
    super::support::send(s, id, "PAY", at(20)).await;
    settle(s, ns, id, at(30), vec!["awaiting_payment".into(), "processing".into()]).await;
    let left: Vec<String> = get(s, id).await.timers.iter().map(|t| t.spec.state.clone()).collect();
    assert_eq!(left, ["shipping"]);
    let report = sweep(s, ns, at(60_010)).await;
    assert_eq!(report.fired, 1);
    assert_eq!(inbox_names(s, id).await, ["NUDGE"]);
}

/// `every`: the ticks stay on the grid of the state entry (a late sweep does not push the
/// next tick later); an immediate re-sweep does not fire; a late sweep does not back-fill
/// missed intervals.
pub async fn timer_every_ticks_on_the_grid_of_its_state_entry<S: Store>(s: &S) {
    let ns = "timer_every";
    let id = armed(s, ns, vec![arm("polling", "POLL", TimerKind::Every, 10, None, None)]).await;
    assert_eq!(sweep(s, ns, at(12_000)).await.fired, 1, "first fire at entry + 10 s");
    assert_eq!(sweep(s, ns, at(12_001)).await.fired, 0, "an immediate re-sweep does not fire");
    let next = get(s, id).await.timers[0].next_fire_at;
    assert_eq!(next, at(20_010), "entry + 20 s, not the late sweep + 10 s");
    assert_eq!(sweep(s, ns, at(95_000)).await.fired, 1, "one fire for many missed intervals");
    let t = &get(s, id).await.timers[0];
    assert_eq!((t.fire_count, t.next_fire_at), (2, at(100_010)), "the first tick after 95 s");
    assert_eq!(inbox_names(s, id).await, ["POLL", "POLL"]);
}

/// `every` + `max 3` + `then`: sweeps 1–3 deliver the event, sweep 4 delivers `then`
/// exactly once (`TIMER_EXHAUSTED`), sweep 5 finds nothing.
pub async fn timer_every_max_then_once<S: Store>(s: &S) {
    let ns = "timer_max";
    let id = armed(
        s,
        ns,
        vec![arm(
            "charging",
            "RETRY_PAYMENT",
            TimerKind::Every,
            10,
            Some(3),
            Some("PAYMENT_FAILED"),
        )],
    )
    .await;
    for (n, t) in [(1, 10_010), (2, 20_010), (3, 30_010)] {
        let r = sweep(s, ns, at(t)).await;
        assert_eq!((r.fired, r.exhausted), (1, 0), "sweep {n}");
    }
    let r = sweep(s, ns, at(40_010)).await;
    assert_eq!((r.fired, r.exhausted), (0, 1), "sweep 4 delivers then");
    assert_eq!(sweep(s, ns, at(50_010)).await.processed, 0, "sweep 5 is a no-op");
    assert_eq!(
        inbox_names(s, id).await,
        ["RETRY_PAYMENT", "RETRY_PAYMENT", "RETRY_PAYMENT", "PAYMENT_FAILED"]
    );
    let d = get(s, id).await;
    assert!(d.timers.is_empty());
    assert_eq!(d.history.iter().filter(|h| h.entry.kind == "TIMER_EXHAUSTED").count(), 1);
}

/// Two sweeps at once over many due timers deliver each fire exactly once.
pub async fn timer_concurrent_sweeps_deliver_once<S: Store>(s: &S) {
    let ns = "timer_race";
    let mut ids = Vec::new();
    for _ in 0..40 {
        ids.push(armed(s, ns, vec![arm("waiting", "WAKE", TimerKind::After, 1, None, None)]).await);
    }
    let params = || TimerSweepParams {
        namespace: Some(ns.into()),
        machines: vec![],
        limit: 15,
        now: at(5_000),
    };
    let mut total = 0;
    for _ in 0..4 {
        let (a, b) = tokio::join!(s.timer_sweep(params()), s.timer_sweep(params()));
        total += a.expect("sweep a").fired + b.expect("sweep b").fired;
    }
    assert_eq!(total, 40, "every timer fired once across both sweepers");
    for id in ids {
        assert_eq!(inbox_names(s, id).await, ["WAKE"], "instance {id}");
    }
}

/// A commit that cancels a state's timers and arms them again (a state left for a transit
/// state and entered again within one step) renews them: the old timers are gone, the new
/// ones count from this commit, and only the renewed deadline fires.
pub async fn timer_cancel_and_arm_in_one_commit_renews<S: Store>(s: &S) {
    let ns = "timer_renew";
    let deadline = || arm("idle", "LOGOUT", TimerKind::After, 30, None, None);
    let nested = || arm("idle.typing", "NUDGE", TimerKind::After, 40, None, None);
    let id = armed(s, ns, vec![deadline(), nested()]).await;
    super::support::send(s, id, "ACTIVITY", at(20_000)).await;
    let claimed = claim_id(s, ns, id, at(20_000)).await;
    let mut c =
        StepCommit::new(id, claimed.token(), park()).consume(claimed.inbox.iter().map(|s| s.id));
    c.timers_cancel = vec!["idle".into()];
    c.timers_arm = vec![deadline()];
    commit_ok(s, c, at(20_000)).await;
    let timers: Vec<(String, Timestamp)> =
        get(s, id).await.timers.iter().map(|t| (t.spec.event.clone(), t.next_fire_at)).collect();
    assert_eq!(
        timers,
        [("LOGOUT".to_owned(), at(50_000))],
        "renewed from the commit; the descendant's timer went with its ancestor"
    );
    assert_eq!(sweep(s, ns, at(45_000)).await.processed, 0, "the old deadline is gone");
    assert_eq!(sweep(s, ns, at(50_000)).await.fired, 1);
    assert_eq!(inbox_names(s, id).await, ["LOGOUT"]);
}

/// A timer's fire still unread when a commit leaves its state is stale: the commit takes
/// it out of the inbox (`TIMER_WITHDRAWN`), even when it enters the state again, and it
/// does not wake the instance. Fires of states the commit does not leave stay. Here the
/// fires land while the step that leaves the state is running.
pub async fn timer_fire_unread_when_its_state_is_left_is_withdrawn<S: Store>(s: &S) {
    let ns = "timer_withdrawn";
    let deadline = || arm("idle", "LOGOUT", TimerKind::After, 30, None, None);
    let nudge = || arm("side", "NUDGE", TimerKind::After, 30, None, None);
    let alone = armed(s, ns, vec![deadline()]).await;
    let beside = armed(s, ns, vec![deadline(), nudge()]).await;
    for id in [alone, beside] {
        super::support::send(s, id, "ACTIVITY", at(20_000)).await;
    }
    let claimed =
        [claim_id(s, ns, alone, at(20_000)).await, claim_id(s, ns, beside, at(20_000)).await];
    assert_eq!(sweep(s, ns, at(40_000)).await.fired, 3, "the fires land while the steps run");
    for (claimed, id) in claimed.iter().zip([alone, beside]) {
        assert_eq!(claimed.inbox.len(), 1, "the step read ACTIVITY only");
        let mut c = StepCommit::new(id, claimed.token(), park())
            .consume(claimed.inbox.iter().map(|s| s.id));
        c.timers_cancel = vec!["idle".into()];
        c.timers_arm = vec![deadline()];
        commit_ok(s, c, at(40_000)).await;
    }
    let d = get(s, alone).await;
    assert!(d.inbox.is_empty(), "the stale LOGOUT is gone: {:?}", d.inbox);
    assert_eq!(d.instance.status, Status::AwaitingSignal, "a withdrawn fire wakes nothing");
    let withdrawn: Vec<_> =
        d.history.iter().filter(|h| h.entry.kind == "TIMER_WITHDRAWN").collect();
    assert_eq!(withdrawn.len(), 1);
    assert_eq!(withdrawn[0].entry.data["event"], json!("LOGOUT"));
    assert_eq!(withdrawn[0].entry.data["state"], json!("idle"));
    let due: Vec<Timestamp> = d.timers.iter().map(|t| t.next_fire_at).collect();
    assert_eq!(due, [at(70_000)], "the renewed deadline counts from the commit");

    assert_eq!(inbox_names(s, beside).await, ["NUDGE"], "a fire of a state not left stays");
    assert_eq!(get(s, beside).await.instance.status, Status::Runnable, "and wakes the instance");
}

/// The earliest due time in scope: overdue timers count, the namespace and machine
/// filters apply, and it moves on as sweeps fire and commits cancel.
pub async fn timer_next_due_is_the_earliest_in_scope<S: Store>(s: &S) {
    let ns = "timer_next_due";
    let next_due = |namespace: Option<&str>, machines: &[&str]| TimerNextDueParams {
        namespace: namespace.map(str::to_owned),
        machines: machines.iter().map(|m| (*m).to_owned()).collect(),
    };
    let due = |p: TimerNextDueParams| async move { s.timer_next_due(p).await.expect("next due") };
    assert_eq!(due(next_due(Some(ns), &[])).await, None, "no timers, no due time");
    let id = armed(
        s,
        ns,
        vec![
            arm("a", "LATE", TimerKind::After, 50, None, None),
            arm("a", "SOON", TimerKind::Every, 20, None, None),
        ],
    )
    .await;
    let other = "timer_next_due_other";
    armed(s, other, vec![arm("a", "EARLY", TimerKind::After, 5, None, None)]).await;
    assert_eq!(due(next_due(Some(ns), &[])).await, Some(at(20_010)));
    assert_eq!(due(next_due(Some(other), &[])).await, Some(at(5_010)));
    assert_eq!(due(next_due(None, &[])).await, Some(at(5_010)), "every namespace");
    assert_eq!(due(next_due(Some(ns), &["order"])).await, Some(at(20_010)), "its machine");
    assert_eq!(due(next_due(None, &["billing"])).await, None, "another machine has none");
    assert_eq!(sweep(s, other, at(6_000)).await.fired, 1);
    assert_eq!(due(next_due(Some(other), &[])).await, None, "a fired after timer is gone");
    // Overdue timers count: a sweeper must not sleep past them.
    assert_eq!(due(next_due(Some(ns), &[])).await, Some(at(20_010)));
    assert_eq!(sweep(s, ns, at(25_000)).await.fired, 1);
    assert_eq!(
        due(next_due(Some(ns), &[])).await,
        Some(at(40_010)),
        "the every timer's next tick on the grid of its state entry"
    );
    settle(s, ns, id, at(30_000), vec!["a".into()]).await;
    assert_eq!(due(next_due(Some(ns), &[])).await, None, "leaving the state cancels both");
}

/// Waits (boundedly) for the next timer hint after `seen`, passing over gaps (a listener
/// that just connected reports one); `None` when none came.
async fn next_hint<S: Store>(s: &S, mut seen: u64, wait: Duration) -> (u64, Option<TimerHint>) {
    for _ in 0..3 {
        match tokio::time::timeout(wait, s.timer_hint_wait(seen)).await {
            Ok(hint @ TimerHint { due: Some(_), .. }) => return (hint.cursor, Some(hint)),
            Ok(gap) => seen = gap.cursor,
            Err(_) => return (seen, None),
        }
    }
    (seen, None)
}

/// A store with notifications tells waiting sweepers when a commit arms timers, with the
/// earliest due time armed; a commit that arms nothing, or is rejected, tells nothing.
pub async fn timer_hint_follows_a_commit_that_arms<S: Store>(s: &S) {
    if !s.capabilities().notifications {
        return;
    }
    let ns = "timer_hint";
    let short = Duration::from_millis(300);
    // Whatever came before (a listener's first gap) is not this contract's business.
    let (seen, _) = next_hint(s, 0, short).await;
    let id = insert_one(s, new_in(ns), at(0)).await;
    let first = claim_id(s, ns, id, at(5)).await;
    let (seen, hint) = next_hint(s, seen, short).await;
    assert_eq!(hint, None, "inserting and claiming arm nothing");

    let mut c = StepCommit::new(id, first.token(), park());
    c.timers_arm = vec![
        arm("a", "LATER", TimerKind::After, 90, None, None),
        arm("a", "SOONER", TimerKind::After, 30, None, None),
    ];
    commit_ok(s, c, at(10)).await;
    let (seen, hint) = next_hint(s, seen, Duration::from_secs(5)).await;
    assert_eq!(hint.and_then(|h| h.due), Some(at(30_010)), "the earliest due time armed");
    assert_eq!(s.timer_hint_wait(seen - 1).await.due, Some(at(30_010)), "re-readable");

    // A stale commit arming a sooner timer is rejected and hints nothing.
    super::support::send(s, id, "GO", at(20)).await;
    let second = claim_id(s, ns, id, at(30)).await;
    let mut stale = StepCommit::new(id, first.token(), park());
    stale.timers_arm = vec![arm("a", "STALE", TimerKind::After, 1, None, None)];
    assert!(super::support::commit(s, stale, at(40)).await.is_err(), "stale token");
    let mut plain =
        StepCommit::new(id, second.token(), park()).consume(second.inbox.iter().map(|s| s.id));
    plain.timers_cancel = vec!["b".into()];
    commit_ok(s, plain, at(40)).await;
    let (_, hint) = next_hint(s, seen, short).await;
    assert_eq!(hint, None, "a rejected commit and one that arms nothing hint nothing");
}

/// A terminal instance keeps no timers; a timer found for a missing or terminal instance
/// is dropped without delivering.
pub async fn timers_dropped_with_terminal_instances<S: Store>(s: &S) {
    let ns = "timer_terminal";
    let done = armed(s, ns, vec![arm("a", "T", TimerKind::After, 5, None, None)]).await;
    super::support::send(s, done, "GO", at(20)).await;
    let claimed = claim_id(s, ns, done, at(30)).await;
    commit_ok(
        s,
        StepCommit::new(done, claimed.token(), Outcome::Done { result: json!(1), step: None }),
        at(40),
    )
    .await;
    assert!(get(s, done).await.timers.is_empty());
    let cancelled = armed(s, ns, vec![arm("a", "T", TimerKind::After, 5, None, None)]).await;
    let params = keel_core::ports::store::CancelParams {
        id: cancelled,
        reason: "stop".into(),
        cascade: false,
        now: at(50),
        only_in: None,
    };
    s.instance_cancel(params).await.expect("cancel");
    assert!(get(s, cancelled).await.timers.is_empty());
    assert_eq!(sweep(s, ns, at(60_000)).await.fired, 0);
}

/// Timer status per machine (armed, next due, overdue, last sweep) and queue stats.
pub async fn timer_status_and_queue_stats<S: Store>(s: &S) {
    let ns = "timer_status";
    let id = armed(
        s,
        ns,
        vec![
            arm("a", "T1", TimerKind::After, 5, None, None),
            arm("a", "T2", TimerKind::After, 50, None, None),
        ],
    )
    .await;
    insert_one(s, new_in(ns).queue("q2"), at(0)).await;
    insert_one(s, new_in(ns).queue("q2").eligible_at(at(1_000_000)), at(0)).await;
    let status = s.timer_status(Some(ns.into()), at(6_000)).await.expect("timer_status");
    assert_eq!(status.len(), 1);
    let st = &status[0];
    assert_eq!(
        (st.machine.as_str(), st.armed, st.overdue, st.next_due),
        ("order", 2, 1, Some(at(5_010)))
    );
    assert_eq!(st.last_sweep_at, None);
    sweep(s, ns, at(7_000)).await;
    let st = s.timer_status(Some(ns.into()), at(7_000)).await.expect("timer_status").remove(0);
    assert_eq!((st.armed, st.overdue, st.last_sweep_at), (1, 0, Some(at(7_000))));

    let mut stats = s.queue_stats(Some(ns.into()), at(8_000)).await.expect("queue_stats");
    stats.sort_by(|a, b| a.queue.cmp(&b.queue));
    let summary: Vec<_> =
        stats.iter().map(|q| (q.queue.as_str(), q.ready, q.scheduled, q.waiting)).collect();
    assert_eq!(
        summary,
        [("default", 1, 0, 0), ("q2", 1, 1, 0)],
        "the fired timer woke the parked instance"
    );
    assert_eq!(row(s, id).await.status, Status::Runnable);
    assert_eq!(stats[1].oldest_ready_at, Some(at(0)));
}

/// The pages of one retime pass of `p`, page by page from `p.after` (at most `pages`
/// pages); each page moves at most `p.limit` timers.
async fn retime_pages<S: Store>(
    s: &S,
    mut p: keel_core::ports::store::TimerRetimeParams,
    pages: usize,
) -> Vec<keel_core::ports::store::TimerRetimePage> {
    let mut seen = Vec::new();
    for _ in 0..pages {
        let page = s.timers_retime(p.clone()).await.expect("a retime page");
        assert!(page.retimed.len() <= p.limit, "a page moves at most its limit: {page:?}");
        let next = page.next;
        seen.push(page);
        match next {
            Some(next) => p.after = Some(next),
            None => return seen,
        }
    }
    panic!("the retime pass did not end within {pages} pages: {seen:?}");
}

/// The timers one retime pass of `p` moves, page by page from `p.after` (at most `pages`
/// pages).
async fn retime_pass<S: Store>(
    s: &S,
    p: keel_core::ports::store::TimerRetimeParams,
    pages: usize,
) -> Vec<keel_core::TimerId> {
    retime_pages(s, p, pages).await.into_iter().flat_map(|page| page.retimed).collect()
}

/// A deploy that changes a timer's duration moves the timers instances of that machine
/// version already armed, from their original anchor, one page at a time in id order,
/// recording `TIMER_RETIMED`: a 7-day deadline shortened to 1 day fires at the next sweep
/// for an instance that has waited 2 days. Other versions, other timers and a second pass
/// are left alone; of a deployed list that names a timer twice, the first entry counts; a
/// bad page size is refused.
pub async fn timers_follow_a_deployed_duration<S: Store>(s: &S) {
    use keel_core::ports::store::TimerRetimeParams;
    let ns = "retime";
    let day = Duration::from_secs(86_400);
    let expire = |d: Duration| TimerArm {
        state: "awaiting".into(),
        event: "EXPIRE".into(),
        kind: TimerKind::After,
        interval: d,
        max: None,
        then: None,
    };
    let remind = arm("awaiting", "REMIND", TimerKind::Every, 3_600, None, None);
    let start = |version: i32| {
        keel_core::NewInstance::new(keel_core::MachineRef::new("retimed", version), "start")
            .namespace(ns)
    };
    let mut ids = Vec::new();
    for version in [1, 1, 1, 2] {
        let id = insert_one(s, start(version), at(0)).await;
        let claimed = claim_id(s, ns, id, at(5)).await;
        let mut c = StepCommit::new(id, claimed.token(), park());
        c.timers_arm = vec![expire(day * 7), remind.clone()];
        commit_ok(s, c, at(10)).await;
        ids.push(id);
    }
    let two_days = at(10).plus(day * 2);
    let params = |after| TimerRetimeParams {
        machine: keel_core::MachineRef::new("retimed", 1),
        timers: vec![expire(day), remind.clone()],
        after,
        limit: 4,
        now: two_days,
    };
    // A store may leave out of its pages the timers that cannot move, so how the pass
    // falls into pages is its own; what moves is not. (8 timers, pages of 4: at most 3.)
    let moved = retime_pass(s, params(None), 3).await;
    assert_eq!(moved.len(), 3, "the 3 version-1 deadlines moved: {moved:?}");
    assert!(moved.windows(2).all(|w| w[0] < w[1]), "in id order: {moved:?}");

    let report = sweep(s, ns, two_days).await;
    assert_eq!(report.fired, 3 + 4, "3 moved deadlines and one fire per reminder (no back-fill)");
    for id in &ids[..3] {
        assert!(inbox_names(s, *id).await.contains(&"EXPIRE".to_owned()), "instance {id}");
        let history = get(s, *id).await.history;
        let moved: Vec<_> = history.iter().filter(|h| h.entry.kind == "TIMER_RETIMED").collect();
        assert_eq!(moved.len(), 1);
        assert_eq!(moved[0].entry.data["to_ms"], json!(86_400_000));
    }
    assert!(!inbox_names(s, ids[3]).await.contains(&"EXPIRE".to_owned()), "version 2 waits");

    let again = s.timers_retime(params(None)).await.expect("again");
    assert!(again.retimed.is_empty(), "nothing left to move: {again:?}");

    // A deployed list naming a timer twice: the first entry is the one a timer follows.
    // With the reminders' own duration first nothing moves; with another first, the three
    // version-1 reminders move to it, whatever the second says.
    let minute = arm("awaiting", "REMIND", TimerKind::Every, 60, None, None);
    let deployed = |timers: Vec<TimerArm>| TimerRetimeParams { timers, ..params(None) };
    let hidden = retime_pass(s, deployed(vec![remind.clone(), minute.clone()]), 10).await;
    assert_eq!(hidden, [], "the first entry keeps the reminders' duration");
    let moved = retime_pass(s, deployed(vec![minute.clone(), remind.clone()]), 10).await;
    assert_eq!(moved.len(), 3, "the first entry moves the reminders: {moved:?}");
    for id in &ids[..3] {
        let timers = get(s, *id).await.timers;
        let reminder = timers.iter().find(|t| t.spec.event == "REMIND").expect("the reminder");
        assert_eq!(reminder.spec.interval, Duration::from_secs(60), "instance {id}");
    }

    let zero = TimerRetimeParams { limit: 0, ..params(None) };
    let err = s.timers_retime(zero).await.expect_err("a zero page");
    assert!(err.message.contains("limit"), "{}", err.message);
}

/// A retime reads only the timers that move: a second pass over a machine version whose
/// timers were moved already returns no timer (one empty page), whatever their number, as
/// does a deployed list that names a timer twice with its current duration first; a later
/// deploy that changes a duration again moves them all again.
///
/// Not in the shared contract list: a store may page over timers that cannot move (the
/// in-memory reference does), and then a second pass is more than one page. Stores that
/// leave such timers out of their pages call it from their own tests.
pub async fn retime_reads_only_the_timers_that_move<S: Store>(s: &S) {
    use keel_core::ports::store::TimerRetimeParams;
    let ns = "retime";
    let day = Duration::from_secs(86_400);
    let expire = |interval: Duration| TimerArm {
        state: "awaiting".into(),
        event: "EXPIRE".into(),
        kind: TimerKind::After,
        interval,
        max: None,
        then: None,
    };
    let remind = arm("awaiting", "REMIND", TimerKind::Every, 3_600, None, None);
    let deployed = |timers: Vec<TimerArm>| TimerRetimeParams {
        machine: keel_core::MachineRef::new("retimed", 1),
        timers,
        after: None,
        limit: 2,
        now: at(1_000),
    };
    let pass = |deadline: Duration| deployed(vec![expire(deadline), remind.clone()]);
    let moved = |pages: &[keel_core::ports::store::TimerRetimePage]| -> usize {
        pages.iter().map(|p| p.retimed.len()).sum()
    };
    let mut ids = Vec::new();
    for _ in 0..6 {
        let new = keel_core::NewInstance::new(keel_core::MachineRef::new("retimed", 1), "start")
            .namespace(ns);
        let id = insert_one(s, new, at(0)).await;
        let claimed = claim_id(s, ns, id, at(5)).await;
        let park = Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: None };
        let mut c = StepCommit::new(id, claimed.token(), park);
        c.timers_arm = vec![expire(day * 7), remind.clone()];
        commit_ok(s, c, at(10)).await;
        ids.push(id);
    }

    let first = retime_pages(s, pass(day), 20).await;
    assert_eq!(moved(&first), 6, "every deadline moved, no reminder: {first:?}");

    let second = retime_pages(s, pass(day), 20).await;
    assert_eq!(second.len(), 1, "the first page of a second pass is its last: {second:?}");
    assert!(second[0].retimed.is_empty(), "nothing moved again: {second:?}");
    for id in &ids {
        let history = get(s, *id).await.history;
        let retimed = history.iter().filter(|h| h.entry.kind == "TIMER_RETIMED").count();
        assert_eq!(retimed, 1, "instance {id} recorded one move");
    }

    // A deployed list naming the deadline twice: the first entry counts, and it is the
    // duration the deadlines have, so none may move and the pass is one empty page.
    let twice = deployed(vec![expire(day), expire(day * 3), remind.clone()]);
    let twice = retime_pages(s, twice, 20).await;
    assert_eq!(twice.len(), 1, "a duplicate that the first entry hides reads nothing: {twice:?}");
    assert!(twice[0].retimed.is_empty(), "nothing moved: {twice:?}");

    let third = retime_pages(s, pass(day * 2), 20).await;
    assert_eq!(moved(&third), 6, "a new deployed duration moves every deadline: {third:?}");
    let timers = get(s, ids[0]).await.timers;
    let deadline = timers.iter().find(|t| t.spec.event == "EXPIRE").expect("the deadline");
    assert_eq!(deadline.spec.interval, day * 2);
}
