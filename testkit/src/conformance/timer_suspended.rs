//! Timer contracts for an instance that runs nothing until an operator acts — suspended
//! (dead-lettered), or in a paused queue: its repeating timers are held — no fire
//! delivered, recorded or counted, the timer due again at its next tick after each held tick —
//! while an `after` timer delivers once; after a retry or a resume the repeating timer
//! fires again at its next tick, once.

use super::support::{at, claim_id, commit_ok, ctx, get, insert_one, new_in, suspend};
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::ids::{DEFAULT_QUEUE, TimerId};
use keel_core::instance::ANY_SIGNAL;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{
    DeadLetterRetryParams, DeadLetterSelector, QueuePauseParams, TimerNextDueParams,
    TimerSweepParams,
};
use keel_core::timers::FIRE_KEY_PREFIX;
use keel_core::{InstanceId, Status, StepCommit, Timestamp};
use std::time::Duration;

/// How many minutes the instance stays suspended, one sweep a minute.
const SUSPENDED_SWEEPS: i64 = 100;

fn arm(event: &str, kind: TimerKind, interval: Duration) -> TimerArm {
    TimerArm { state: "waiting".into(), event: event.into(), kind, interval, max: None, then: None }
}

fn park() -> Outcome {
    Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx(1), step: None }
}

async fn sweep<S: Store>(s: &S, ns: &str, now: Timestamp) -> u64 {
    let params = TimerSweepParams { namespace: Some(ns.into()), machines: vec![], limit: 100, now };
    s.timer_sweep(params).await.expect("timer_sweep").fired
}

/// An instance parked in a state with `every 1m REMIND` and `after 90s EXPIRE` is
/// suspended at once. A hundred sweeps a minute apart deliver `EXPIRE` once and no
/// `REMIND`, record no fire of it, and leave the timer armed, not due, its count kept.
/// After a retry the instance runs; parked again, it gets `REMIND` at the next tick, as
/// fire 1.
pub async fn timer_every_is_held_while_its_instance_is_suspended<S: Store>(s: &S) {
    let ns = "timer_suspended";
    let minute = Duration::from_secs(60);
    let id = parked_with_timers(s, ns, DEFAULT_QUEUE).await;
    let timer = remind_timer(s, id).await;
    super::support::send(s, id, "GO", at(20)).await;
    let claimed = claim_id(s, ns, id, at(30)).await;
    let read = claimed.inbox.iter().map(|m| m.id).collect();
    let letter = suspend(s, &claimed, "boom", read, at(40)).await;
    assert_eq!(get(s, id).await.instance.status, Status::Suspended);

    let mut now = at(10);
    let mut fired = 0;
    for _ in 0..SUSPENDED_SWEEPS {
        now = now.plus(minute);
        fired += sweep(s, ns, now).await;
    }
    let d = get(s, id).await;
    let fires: Vec<&str> = d
        .inbox
        .iter()
        .filter(|m| m.dedup_key.as_deref().is_some_and(|k| k.starts_with(FIRE_KEY_PREFIX)))
        .map(|m| m.name.as_str())
        .collect();
    assert_eq!(
        fires,
        ["EXPIRE"],
        "a suspended instance's inbox holds {} timer fires after {SUSPENDED_SWEEPS} sweeps",
        fires.len()
    );
    assert_eq!(fired, 1, "only the after timer fired");
    let recorded = d.history.iter().filter(|h| h.entry.kind == "TIMER_FIRED").count();
    assert_eq!(recorded, 1, "a held tick records nothing");
    assert_eq!(d.timers.len(), 1, "the every timer stays armed");
    assert_eq!(d.timers[0].fire_count, 0, "held ticks are not fires");
    assert_eq!(
        d.timers[0].next_fire_at,
        now.plus(minute),
        "due at its next tick (the sweep fell on one)"
    );
    let next = TimerNextDueParams { namespace: Some(ns.into()), machines: vec![] };
    let due = s.timer_next_due(next).await.expect("timer_next_due");
    assert_eq!(due, Some(now.plus(minute)), "a held timer is not left due");
    assert_eq!(sweep(s, ns, now).await, 0, "a second sweep at once finds nothing");

    let retry = DeadLetterRetryParams {
        selector: DeadLetterSelector::Id(letter),
        delay: Duration::ZERO,
        now: now.plus(Duration::from_secs(1)),
    };
    s.dead_letter_retry(retry).await.expect("dead_letter_retry");
    let claimed = claim_id(s, ns, id, now.plus(Duration::from_secs(2))).await;
    let read = claimed.inbox.iter().map(|m| m.id);
    let c = StepCommit::new(id, claimed.token(), park()).consume(read);
    commit_ok(s, c, now.plus(Duration::from_secs(3))).await;
    assert_eq!(sweep(s, ns, now.plus(minute)).await, 1, "the next tick fires");
    let d = get(s, id).await;
    let keys: Vec<Option<&str>> = d.inbox.iter().map(|m| m.dedup_key.as_deref()).collect();
    assert_eq!(keys, [Some(format!("{FIRE_KEY_PREFIX}{}:1", timer.0).as_str())]);
}

/// An instance of `queue` in `ns`, parked at `at(10)` in a state with `every 1m REMIND`
/// and `after 90s EXPIRE`.
async fn parked_with_timers<S: Store>(s: &S, ns: &str, queue: &str) -> InstanceId {
    let id = insert_one(s, new_in(ns).queue(queue), at(0)).await;
    let claimed = claim_id(s, ns, id, at(5)).await;
    let mut c = StepCommit::new(id, claimed.token(), park());
    c.timers_arm = vec![
        arm("REMIND", TimerKind::Every, Duration::from_secs(60)),
        arm("EXPIRE", TimerKind::After, Duration::from_secs(90)),
    ];
    commit_ok(s, c, at(10)).await;
    id
}

/// The id of the `every 1m REMIND` timer [`parked_with_timers`] armed.
async fn remind_timer<S: Store>(s: &S, id: InstanceId) -> TimerId {
    get(s, id)
        .await
        .timers
        .iter()
        .find(|t| t.spec.event == "REMIND")
        .expect("the every timer is armed")
        .id
}

/// The timer fires in an instance's inbox, by event name, in arrival order.
async fn fires<S: Store>(s: &S, id: InstanceId) -> Vec<String> {
    get(s, id)
        .await
        .inbox
        .iter()
        .filter(|m| m.dedup_key.as_deref().is_some_and(|k| k.starts_with(FIRE_KEY_PREFIX)))
        .map(|m| m.name.clone())
        .collect()
}

/// How many minutes the queue stays paused, one sweep a minute.
const PAUSED_SWEEPS: usize = 20;

/// Three instances parked with `every 1m REMIND` and `after 90s EXPIRE`: one in the queue
/// `mail`, which is then paused, one in another queue of the namespace, one in a queue
/// `mail` of another namespace. Twenty sweeps a minute apart deliver the paused queue's
/// instance `EXPIRE` once and no `REMIND`, record no fire of it, and leave its timer armed,
/// due at its next tick after the last sweep, its count kept; the two others get every tick.
/// After the queue is resumed, the next due sweep delivers one `REMIND` (fire 1), not the
/// twenty held ones.
pub async fn timer_every_is_held_while_its_queue_is_paused<S: Store>(s: &S) {
    let (ns, other_ns) = ("timer_paused_queue", "timer_paused_queue_other");
    let minute = Duration::from_secs(60);
    let held = parked_with_timers(s, ns, "mail").await;
    let free = parked_with_timers(s, ns, "bulk").await;
    let elsewhere = parked_with_timers(s, other_ns, "mail").await;
    let remind = remind_timer(s, held).await;
    let pause = |paused: bool, now| QueuePauseParams {
        namespace: ns.into(),
        queue: "mail".into(),
        paused,
        now,
    };
    s.queue_pause(pause(true, at(20))).await.expect("queue_pause");

    let mut now = at(10);
    for _ in 0..PAUSED_SWEEPS {
        now = now.plus(minute);
        sweep(s, ns, now).await;
        sweep(s, other_ns, now).await;
    }
    assert_eq!(
        fires(s, held).await,
        ["EXPIRE"],
        "a paused queue's instance gets its after timer once and no repeating tick"
    );
    let d = get(s, held).await;
    let recorded = d.history.iter().filter(|h| h.entry.kind == "TIMER_FIRED").count();
    assert_eq!(recorded, 1, "a held tick records nothing");
    assert_eq!(d.timers.len(), 1, "the every timer stays armed");
    assert_eq!(d.timers[0].fire_count, 0, "held ticks are not fires");
    assert_eq!(
        d.timers[0].next_fire_at,
        now.plus(minute),
        "due at its next tick (the sweep fell on one)"
    );
    let ticks = |f: Vec<String>| f.iter().filter(|n| *n == "REMIND").count();
    assert_eq!(ticks(fires(s, free).await), PAUSED_SWEEPS, "another queue's instance ticks");
    assert_eq!(
        ticks(fires(s, elsewhere).await),
        PAUSED_SWEEPS,
        "a queue of the same name in another namespace ticks"
    );
    let next = TimerNextDueParams { namespace: Some(ns.into()), machines: vec![] };
    let due = s.timer_next_due(next).await.expect("timer_next_due");
    assert_eq!(due, Some(now.plus(minute)), "a held timer is not left due");

    s.queue_pause(pause(false, now.plus(Duration::from_secs(1)))).await.expect("resume");
    sweep(s, ns, now.plus(minute)).await;
    assert_eq!(fires(s, held).await, ["EXPIRE", "REMIND"], "one tick after the resume");
    let d = get(s, held).await;
    let key = format!("{FIRE_KEY_PREFIX}{}:1", remind.0);
    let tick = d.inbox.iter().find(|m| m.name == "REMIND").expect("the tick");
    assert_eq!(tick.dedup_key.as_deref(), Some(key.as_str()), "the first fire, not a backlog");
    assert_eq!(d.timers[0].fire_count, 1);
}
