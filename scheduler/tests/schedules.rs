//! Schedules run by workers: each tick fires once across workers, the missed-tick policy
//! decides what a restart after an outage does, pause stops firing, and a broadcasting
//! schedule reaches the instances in its state once per tick. `memory::*` on `MemoryStore`,
//! `postgres::*` on PostgreSQL (a fresh schema per test), under a virtual clock.

#[macro_use]
mod common;

use common::{Harness, TestStore};
use keel_core::ids::MachineRef;
use keel_core::instance::NewInstance;
use keel_core::ports::{Clock, Store};
use keel_core::schedule::{BroadcastAction, MissedTicks, Schedule, ScheduleAction};
use keel_core::{Timestamp, WorkerId};
use keel_scheduler::{Schedules, Worker, WorkerConfig, WorkerHandle};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

on_every_store!(
    ten_ticks_with_two_workers_start_exactly_ten_instances,
    after_five_missed_ticks_skip_fires_none_and_catch_up_fires_one,
    a_paused_schedule_fires_nothing_until_resumed,
    a_broadcast_tick_reaches_each_instance_in_the_state_once,
);

const MINUTE: Duration = Duration::from_secs(60);

fn report() -> MachineRef {
    MachineRef::new("report", 1)
}

fn every_minute(missed: MissedTicks) -> Schedule {
    let start = NewInstance::new(report(), "run");
    Schedule::new("every-minute", "* * * * *", "UTC", ScheduleAction::Start(start))
        .expect("a valid schedule")
        .missed(missed)
}

/// A worker serving `schedule` that claims from another queue: the instances it starts
/// stay ready, so the test counts them.
fn worker<S: Store>(h: &Harness<S>, name: &str, schedule: &Schedule) -> WorkerHandle {
    let config = WorkerConfig {
        worker_id: WorkerId(name.into()),
        timers: None,
        queues: vec![("elsewhere".into(), 1)],
        schedules: Schedules::new(vec![schedule.clone()]),
        ..h.config()
    };
    Worker::new(Arc::clone(&h.store), h.clock.clone(), config).spawn()
}

/// Waits (bounded) until every worker's runner has handled the schedules up to `now`.
async fn polled(workers: &[&WorkerHandle], now: Timestamp) {
    for _ in 0..400 {
        if workers.iter().all(|w| w.schedules().passed().is_some_and(|p| p >= now)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the schedule runners did not reach {now} within 4 s");
}

/// Ready instances of the report machine.
async fn started<S: Store>(h: &Harness<S>) -> u64 {
    let stats = h.store.queue_stats(None, h.clock.now()).await.expect("queue stats");
    stats.iter().filter(|q| q.machine == report().name).map(|q| q.ready).sum()
}

async fn ten_ticks_with_two_workers_start_exactly_ten_instances<S: TestStore>() {
    let h = S::harness().await;
    let schedule = every_minute(MissedTicks::Skip);
    let (a, b) = (worker(&h, "a", &schedule), worker(&h, "b", &schedule));
    polled(&[&a, &b], h.clock.now()).await;
    for tick in 1..=10 {
        let now = h.clock.advance(MINUTE);
        polled(&[&a, &b], now).await;
        assert_eq!(started(&h).await, tick, "after tick {tick}: {:?}", a.schedules().counts());
    }
    let (ca, cb) = (a.schedules().counts(), b.schedules().counts());
    assert_eq!(ca.fired + cb.fired, 10, "one first firing per tick: {ca:?} {cb:?}");
    assert_eq!(ca.already_fired + cb.already_fired, 10, "each tick seen by both: {ca:?} {cb:?}");
    assert_eq!(ca.failed + cb.failed, 0);
    a.shutdown().await;
    b.shutdown().await;
    assert_eq!(started(&h).await, 10);
}

async fn after_five_missed_ticks_skip_fires_none_and_catch_up_fires_one<S: TestStore>() {
    for (missed, expected) in [(MissedTicks::Skip, 0), (MissedTicks::CatchUp, 1)] {
        let h = S::harness().await;
        let schedule = every_minute(missed);
        let (a, b) = (worker(&h, "a", &schedule), worker(&h, "b", &schedule));
        polled(&[&a, &b], h.clock.now()).await;
        // A runner that starts cannot know whether the latest past tick ran: catch-up
        // fires it (once), skip does not. The store starts empty, so that shows here too.
        assert_eq!(started(&h).await, expected, "{missed}: at the first start");
        let now = h.clock.advance(MINUTE);
        polled(&[&a, &b], now).await;
        let before = started(&h).await;
        assert_eq!(before, expected + 1, "{missed}: the tick before the outage");
        a.shutdown().await;
        b.shutdown().await;
        // Five ticks pass with no worker running.
        h.clock.advance(5 * MINUTE);
        let (a, b) = (worker(&h, "a", &schedule), worker(&h, "b", &schedule));
        polled(&[&a, &b], h.clock.now()).await;
        assert_eq!(started(&h).await - before, expected, "{missed}: runs to catch up");
        // Restarting again without a tick in between fires nothing more: the key is taken.
        a.shutdown().await;
        let a = worker(&h, "a", &schedule);
        polled(&[&a], h.clock.now()).await;
        assert_eq!(started(&h).await - before, expected, "{missed}: a second restart");
        // The next tick fires as usual.
        let now = h.clock.advance(MINUTE);
        polled(&[&a, &b], now).await;
        assert_eq!(started(&h).await - before, expected + 1, "{missed}: the next tick");
        a.shutdown().await;
        b.shutdown().await;
    }
}

async fn a_paused_schedule_fires_nothing_until_resumed<S: TestStore>() {
    let h = S::harness().await;
    let schedule = every_minute(MissedTicks::Skip);
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    let now = h.clock.advance(MINUTE);
    polled(&[&a], now).await;
    assert_eq!(started(&h).await, 1);
    a.schedules().pause("every-minute").expect("known schedule");
    let listed = a.schedules().list(h.clock.now());
    assert!(listed[0].paused && listed[0].next_fire.is_none(), "{listed:?}");
    for _ in 0..3 {
        let now = h.clock.advance(MINUTE);
        polled(&[&a], now).await;
    }
    assert_eq!(started(&h).await, 1, "paused: no tick fired");
    a.schedules().resume("every-minute").expect("known schedule");
    let listed = a.schedules().list(h.clock.now());
    let next = h.clock.now().plus(MINUTE).as_millis() / 60_000 * 60_000;
    assert_eq!(listed[0].next_fire, Some(Timestamp::from_millis(next)));
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 1, "resuming does not fire the ticks passed while paused");
    let now = h.clock.advance(MINUTE);
    polled(&[&a], now).await;
    assert_eq!(started(&h).await, 2);
    let unknown = a.schedules().pause("nope").unwrap_err();
    assert!(unknown.to_string().contains("no schedule named \"nope\""), "{unknown}");
    a.shutdown().await;
}

async fn a_broadcast_tick_reaches_each_instance_in_the_state_once<S: TestStore>() {
    let h = S::harness().await;
    let sub = MachineRef::new("subscription", 1);
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(h.start(NewInstance::new(sub.clone(), "active")).await);
    }
    let other = h.start(NewInstance::new(sub.clone(), "cancelled")).await;
    let renew = ScheduleAction::Broadcast(BroadcastAction {
        namespace: "default".into(),
        machine: sub.name.clone(),
        in_state: Some("active".into()),
        event: "renew".into(),
        payload: json!({}),
    });
    let schedule = Schedule::new("renewals", "* * * * *", "UTC", renew).expect("valid");
    let (a, b) = (worker(&h, "a", &schedule), worker(&h, "b", &schedule));
    polled(&[&a, &b], h.clock.now()).await;
    for _ in 0..2 {
        let now = h.clock.advance(MINUTE);
        polled(&[&a, &b], now).await;
    }
    for id in ids {
        let inbox = h.client.get(id).await.expect("get").inbox;
        let renewals = inbox.iter().filter(|s| s.name == "renew").count();
        assert_eq!(renewals, 2, "one renew per tick for {id}: {inbox:?}");
    }
    assert!(h.client.get(other).await.expect("get").inbox.is_empty(), "not in the state");
    let (ca, cb) = (a.schedules().counts(), b.schedules().counts());
    assert_eq!(ca.fired + cb.fired, 2, "{ca:?} {cb:?}");
    a.shutdown().await;
    b.shutdown().await;
}
