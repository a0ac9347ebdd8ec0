//! Timer contracts (DESIGN §6, seed 002): armed and cancelled by commits, fired by sweeps
//! exactly once per fire, `every` counted from the last fire without back-fill, `max` +
//! `then` delivered once, and the status and stats a sweep service relies on.

use super::support::{at, claim_id, commit_ok, ctx, get, insert_one, new_in, row};
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::instance::ANY_SIGNAL;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{TimerSweepParams, TimerSweepReport};
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

/// `every`: the next fire counts from the last fire; an immediate re-sweep does not fire;
/// a late sweep does not back-fill missed intervals.
pub async fn timer_every_counts_from_last_fire<S: Store>(s: &S) {
    let ns = "timer_every";
    let id = armed(s, ns, vec![arm("polling", "POLL", TimerKind::Every, 10, None, None)]).await;
    assert_eq!(sweep(s, ns, at(12_000)).await.fired, 1, "first fire at entry + 10 s");
    assert_eq!(sweep(s, ns, at(12_001)).await.fired, 0, "an immediate re-sweep does not fire");
    assert_eq!(get(s, id).await.timers[0].next_fire_at, at(22_000), "counted from the last fire");
    assert_eq!(sweep(s, ns, at(95_000)).await.fired, 1, "one fire for many missed intervals");
    let t = &get(s, id).await.timers[0];
    assert_eq!((t.fire_count, t.next_fire_at), (2, at(105_000)));
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
