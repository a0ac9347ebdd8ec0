//! Schedules run by workers: each tick fires once across workers, restarts and clock
//! steps (even once its broadcast was read or its instance pruned), the missed-tick policy
//! decides what a restart after an outage does, pause stops firing, and a broadcasting
//! schedule reaches the instances in its state once per tick. `memory::*` on `MemoryStore`,
//! `postgres::*` on PostgreSQL (a fresh schema per test), under a virtual clock.

#[macro_use]
mod common;

use async_trait::async_trait;
use common::logged::Logged;
use common::{Harness, TestStore};
use keel_core::ids::MachineRef;
use keel_core::instance::NewInstance;
use keel_core::instance::{DeadLetter, Instance, SignalTarget};
use keel_core::ports::store::{self as s, InstanceListParams, PruneParams, SchedulePauseParams};
use keel_core::ports::{Clock, Store};
use keel_core::schedule::{BroadcastAction, MissedTicks, Schedule, ScheduleAction};
use keel_core::timers::TimerHint;
use keel_core::{DeadLetterId, InstanceId, Outcome, Status, StoreResult, Timestamp, WorkerId};
use keel_scheduler::{
    Cancel, Schedules, StepContext, StepError, StepMachine, Worker, WorkerConfig, WorkerHandle,
};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

on_every_store!(
    ten_ticks_with_two_workers_start_exactly_ten_instances,
    after_five_missed_ticks_skip_fires_none_and_catch_up_fires_one,
    a_paused_schedule_fires_nothing_until_resumed,
    a_broadcast_tick_reaches_each_instance_in_the_state_once,
    a_pause_stored_for_the_fleet_stops_every_worker_and_resuming_fires_only_later_ticks,
    the_files_schedules_fire_on_a_worker_given_the_file,
    a_catch_up_restart_does_not_start_a_tick_again_after_its_instance_was_pruned,
    a_catch_up_restart_does_not_deliver_a_read_broadcast_again,
    a_clock_stepping_back_does_not_fire_a_tick_again,
    a_resume_re_anchors_a_fired_tick_ahead_of_the_clock,
    a_repeated_resume_from_a_clock_behind_does_not_let_a_restart_fire_a_tick_again,
    same_named_schedules_in_two_namespaces_each_start_their_own_tick,
    a_broadcast_tick_with_nobody_in_the_state_counts_as_fired_not_as_another_workers,
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
    worker_of(h, name, vec![schedule.clone()])
}

/// The same serving `schedules`, in this order.
fn worker_of<S: Store>(h: &Harness<S>, name: &str, schedules: Vec<Schedule>) -> WorkerHandle {
    let config = WorkerConfig {
        worker_id: WorkerId(name.into()),
        timers: None,
        queues: vec![("elsewhere".into(), 1)],
        schedules: Schedules::new(schedules),
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

/// Stores a pause (or resume) of the every-minute schedule at the clock's time, as
/// `keel schedules pause` does.
async fn store_pause<S: Store>(h: &Harness<S>, paused: bool) {
    let params = SchedulePauseParams {
        namespace: "default".into(),
        name: "every-minute".into(),
        paused,
        now: h.clock.now(),
    };
    h.store.schedule_pause(params).await.expect("schedule_pause");
}

async fn a_pause_stored_for_the_fleet_stops_every_worker_and_resuming_fires_only_later_ticks<
    S: TestStore,
>() {
    let h = S::harness().await;
    // Catch-up: a runner that starts fires the latest past tick, unless a rule stops it.
    let schedule = every_minute(MissedTicks::CatchUp);
    let (a, b) = (worker(&h, "a", &schedule), worker(&h, "b", &schedule));
    polled(&[&a, &b], h.clock.now()).await;
    let now = h.clock.advance(MINUTE);
    polled(&[&a, &b], now).await;
    let before = started(&h).await;
    assert!(before >= 1, "the schedule runs");

    // Paused through the store: neither worker fires, whatever its own handle says.
    store_pause(&h, true).await;
    a.schedules().resume("every-minute").expect("known schedule");
    for _ in 0..3 {
        let now = h.clock.advance(MINUTE);
        polled(&[&a, &b], now).await;
    }
    assert_eq!(started(&h).await, before, "a stored pause stops every worker");
    for w in [&a, &b] {
        let listed = w.schedules().list(h.clock.now());
        assert!(listed[0].paused && listed[0].next_fire.is_none(), "{listed:?}");
        assert!(listed[0].changed_at.is_some(), "the listing shows the stored state");
    }

    // Resumed through the store at a tick's time. A worker that starts now, defined
    // paused and set to catch up, fires neither that tick nor the ones passed while
    // paused: they are at or before the resume.
    let to_tick = 60_000 - h.clock.now().as_millis() % 60_000;
    let tick = h.clock.advance(Duration::from_millis(u64::try_from(to_tick).expect("positive")));
    polled(&[&a, &b], tick).await;
    assert_eq!(started(&h).await, before, "still paused at the tick");
    store_pause(&h, false).await;
    let c = worker(&h, "c", &schedule.clone().paused(true));
    polled(&[&a, &b, &c], h.clock.now()).await;
    assert_eq!(started(&h).await, before, "resuming fires nothing at or before its time");
    assert_eq!(c.schedules().counts().fired + c.schedules().counts().already_fired, 0);
    let listed = c.schedules().list(h.clock.now());
    assert_eq!(listed[0].next_fire, Some(tick.plus(MINUTE)), "{listed:?}");

    // The next tick fires once, by c alone while a and b are stopped (the stored resume
    // wins over its definition's `paused`).
    a.shutdown().await;
    b.shutdown().await;
    let now = h.clock.advance(MINUTE);
    polled(&[&c], now).await;
    assert_eq!(started(&h).await, before + 1);
    let cc = c.schedules().counts();
    assert_eq!(cc.fired, 1, "c served the tick: {cc:?}");
    // a and b start again and catch up: that tick is recorded as fired, nothing more runs.
    let (a, b) = (worker(&h, "a", &schedule), worker(&h, "b", &schedule));
    polled(&[&a, &b, &c], h.clock.now()).await;
    assert_eq!(started(&h).await, before + 1);
    // Neither tried it: c's instance for it still exists, so its key alone would keep it
    // once, and only the record keeps them from firing it at all.
    let (ca, cb) = (a.schedules().counts(), b.schedules().counts());
    assert_eq!(ca.fired + ca.already_fired + cb.fired + cb.already_fired, 0, "{ca:?} {cb:?}");
    // This worker's handle pause does not override the stored resume either.
    b.schedules().pause("every-minute").expect("known schedule");
    let now = h.clock.advance(MINUTE);
    polled(&[&a, &b, &c], now).await;
    assert_eq!(started(&h).await, before + 2);
    for w in [a, b, c] {
        w.shutdown().await;
    }
}

/// `[schedules.<name>]` in the configuration file fire on a worker given the file, beside
/// the program's own; a file schedule of the program's name replaces it.
async fn the_files_schedules_fire_on_a_worker_given_the_file<S: TestStore>() {
    let h = S::harness().await;
    let file = keel_core::config::KeelConfig::from_toml_str(
        "[schedules.every-minute]\ncron = \"* * * * *\"\nstart = { machine = \"report\", at = \"run\" }\n\
         [schedules.from-file]\ncron = \"* * * * *\"\nstart = { machine = \"report\", at = \"run\" }\n",
    )
    .expect("a valid file");
    let config = WorkerConfig {
        worker_id: WorkerId("filed".into()),
        timers: None,
        queues: vec![("elsewhere".into(), 1)],
        schedules: Schedules::new(vec![every_minute(MissedTicks::Skip)]),
        ..h.config()
    }
    .with_settings(file)
    .expect("the file applies");
    let names: Vec<&str> = config.schedules.schedules().iter().map(Schedule::name).collect();
    assert_eq!(names, ["every-minute", "from-file"]);
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), config).spawn();
    polled(&[&worker], h.clock.now()).await;
    let now = h.clock.advance(MINUTE);
    polled(&[&worker], now).await;
    assert_eq!(started(&h).await, 2, "one tick of each: {:?}", worker.schedules().counts());
    worker.shutdown().await;
}

/// Reads `renew` events: each one counts in the context (`renewed`), and the instance
/// parks in `active` for the next.
struct Subscription;

#[async_trait]
impl StepMachine for Subscription {
    fn machine(&self) -> MachineRef {
        MachineRef::new("subscription", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let mut context = ctx.context.clone();
        if let Some(renew) = ctx.signal("renew") {
            // Parking again consumes nothing by default: read this one.
            ctx.consume(vec![renew.id]);
            context["renewed"] = json!(context["renewed"].as_u64().unwrap_or(0) + 1);
        }
        Ok(Outcome::Await { signal: "renew".into(), context, step: None })
    }
}

/// A broadcasting schedule: `renew` to the subscriptions in `active`, every minute.
fn renewals(missed: MissedTicks) -> Schedule {
    let renew = ScheduleAction::Broadcast(BroadcastAction {
        namespace: "default".into(),
        machine: "subscription".into(),
        in_state: Some("active".into()),
        event: "renew".into(),
        payload: json!({}),
    });
    Schedule::new("renewals", "* * * * *", "UTC", renew).expect("valid").missed(missed)
}

/// Two active subscriptions, run by a worker of their own, parked for their first `renew`.
async fn subscriptions<S: Store>(h: &Harness<S>) -> (WorkerHandle, Vec<InstanceId>) {
    let runner = h.worker(h.config(), Subscription);
    let mut ids = Vec::new();
    for _ in 0..2 {
        let id = h.start(NewInstance::new(MachineRef::new("subscription", 1), "active")).await;
        h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
        ids.push(id);
    }
    (runner, ids)
}

/// Waits (bounded) until every subscription read `n` renewals and is parked again.
async fn renewed<S: Store>(h: &Harness<S>, ids: &[InstanceId], n: u64) {
    for id in ids {
        h.wait(*id, "renewed", |r| {
            r.status == Status::AwaitingSignal && r.context["renewed"] == json!(n)
        })
        .await;
    }
}

/// Each subscription read exactly `n` renewals and none is waiting in its inbox. A
/// second delivery shows as either: the commit that reads an event also counts it.
async fn renewed_exactly<S: Store>(h: &Harness<S>, ids: &[InstanceId], n: u64, why: &str) {
    for id in ids {
        let detail = h.client.get(*id).await.expect("get");
        let waiting = detail.inbox.iter().filter(|s| s.name == "renew").count();
        let read = &detail.instance.context["renewed"];
        assert!(waiting == 0 && *read == json!(n), "{why}: {id} read {read}, {waiting} waiting");
    }
}

/// Ends the schedule's one run and lets retention prune it: the tick's uniqueness key
/// goes with the row.
async fn cancel_and_prune_the_run<S: Store>(h: &Harness<S>) {
    let list = InstanceListParams {
        namespace: "default".into(),
        machine: Some(report().name),
        status: None,
        state: None,
        business_key: None,
        before: None,
        limit: 10,
    };
    let runs = h.store.instance_list(list).await.expect("list");
    assert_eq!(runs.len(), 1);
    h.client.cancel(Cancel::new(runs[0].id)).await.expect("cancel");
    let prune = PruneParams {
        namespace: None,
        machines: Vec::new(),
        except: Vec::new(),
        ended_before: h.clock.now().plus(Duration::from_millis(1)),
        after: None,
        limit: 10,
    };
    assert_eq!(h.store.instance_prune(prune).await.expect("prune").instances, 1);
}

async fn a_catch_up_restart_does_not_start_a_tick_again_after_its_instance_was_pruned<
    S: TestStore,
>() {
    let h = S::harness().await;
    let schedule = every_minute(MissedTicks::CatchUp);
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 1, "catch-up fired the latest past tick");
    // Its run ends, and retention prunes it: the tick's uniqueness key goes with the row.
    cancel_and_prune_the_run(&h).await;
    // A deploy restarts the worker within the same minute: the tick is not started again.
    a.shutdown().await;
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 0, "the pruned tick ran again: {:?}", a.schedules().counts());
    assert_eq!(a.schedules().counts().fired + a.schedules().counts().already_fired, 0);
    // The next tick starts as usual.
    let now = h.clock.advance(MINUTE);
    polled(&[&a], now).await;
    assert_eq!(started(&h).await, 1);
    a.shutdown().await;
}

async fn a_catch_up_restart_does_not_deliver_a_read_broadcast_again<S: TestStore>() {
    let h = S::harness().await;
    let (runner, ids) = subscriptions(&h).await;
    let schedule = renewals(MissedTicks::CatchUp);
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    assert_eq!(a.schedules().counts().fired, 1, "catch-up broadcast the latest past tick");
    // Each subscription reads it: the event, and with it its dedup key, is gone.
    renewed(&h, &ids, 1).await;
    // A restart within the same minute does not deliver that tick again.
    a.shutdown().await;
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    renewed_exactly(&h, &ids, 1, "after a restart").await;
    assert_eq!(a.schedules().counts().fired + a.schedules().counts().already_fired, 0);
    // The next tick is delivered once.
    let now = h.clock.advance(MINUTE);
    polled(&[&a], now).await;
    renewed(&h, &ids, 2).await;
    a.shutdown().await;
    runner.shutdown().await;
}

async fn a_clock_stepping_back_does_not_fire_a_tick_again<S: TestStore>() {
    clock_steps_back_over_a_fired_tick(&S::harness().await).await;
}

/// The same with every record of a fired tick failing: what the runner has passed alone
/// keeps the tick from firing again.
#[tokio::test]
async fn a_clock_stepping_back_does_not_fire_a_tick_again_without_its_record() {
    use common::faulty::{Fault, Faulty};
    let store =
        Faulty::new(keel_testkit::MemoryStore::new()).failing("schedule_fired", &[Fault::Error; 8]);
    let h = Harness::with_store(store);
    clock_steps_back_over_a_fired_tick(&h).await;
    assert_eq!(h.store.calls("schedule_fired"), 2, "both records were tried, and failed");
    let states = h.store.schedule_states("default".into()).await.expect("states");
    assert!(states.iter().all(|s| s.fired_through.is_none()), "{states:?}");
}

/// A tick is delivered, the clock steps back 30 s and passes the tick's time again: the
/// tick is not delivered a second time, and the next tick is delivered once.
async fn clock_steps_back_over_a_fired_tick<S: Store>(h: &Harness<S>) {
    let (runner, ids) = subscriptions(h).await;
    let a = worker(h, "a", &renewals(MissedTicks::Skip));
    polled(&[&a], h.clock.now()).await;
    let to_tick = 60_000 - h.clock.now().as_millis() % 60_000;
    let tick = h.clock.now().plus(Duration::from_millis(u64::try_from(to_tick).expect("positive")));
    h.clock.set(tick.plus(Duration::from_secs(1)));
    polled(&[&a], h.clock.now()).await;
    renewed(h, &ids, 1).await;
    // The clock steps back 30 s, the runner polls there, then the clock passes the tick's
    // time again: the tick is not delivered a second time.
    let back = tick.minus(Duration::from_secs(30));
    h.clock.set(back);
    for _ in 0..400 {
        if a.schedules().passed() == Some(back) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.schedules().passed(), Some(back), "the runner polled after the step back");
    h.clock.set(tick.plus(Duration::from_secs(2)));
    polled(&[&a], h.clock.now()).await;
    renewed_exactly(h, &ids, 1, "after the clock stepped back").await;
    let counts = a.schedules().counts();
    assert_eq!((counts.fired, counts.already_fired), (1, 0), "{counts:?}");
    // The next tick is delivered once.
    h.clock.set(tick.plus(MINUTE));
    polled(&[&a], h.clock.now()).await;
    renewed(h, &ids, 2).await;
    a.shutdown().await;
    runner.shutdown().await;
}

/// A record of a fired tick that fails is logged and counted in `failed`, not retried:
/// the tick stays fired once, and the next tick still fires.
#[tokio::test]
async fn a_failed_record_is_counted_and_the_next_tick_still_fires() {
    use common::faulty::{Fault, Faulty};
    let store =
        Faulty::new(keel_testkit::MemoryStore::new()).failing("schedule_fired", &[Fault::Error]);
    let h = Harness::with_store(store);
    let schedule = every_minute(MissedTicks::Skip);
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    let to_tick = 60_000 - h.clock.now().as_millis() % 60_000;
    let tick = h.clock.now().plus(Duration::from_millis(u64::try_from(to_tick).expect("positive")));
    h.clock.set(tick.plus(Duration::from_secs(1)));
    polled(&[&a], h.clock.now()).await;
    assert_eq!(h.store.calls("schedule_fired"), 1, "the failed record was not retried");
    let counts = a.schedules().counts();
    assert_eq!((counts.fired, counts.failed), (1, 1), "{counts:?}");
    assert_eq!(started(&h).await, 1);
    h.clock.set(tick.plus(MINUTE));
    polled(&[&a], h.clock.now()).await;
    let counts = a.schedules().counts();
    assert_eq!((counts.fired, counts.failed), (2, 1), "{counts:?}");
    assert_eq!(started(&h).await, 2, "the next tick fired");
    assert_eq!(h.store.calls("schedule_fired"), 2, "and was recorded");
    let states = h.store.schedule_states(schedule.namespace().to_owned()).await;
    let fired_through = states.expect("states").iter().find_map(|s| s.fired_through);
    assert_eq!(fired_through, Some(tick.plus(MINUTE)));
    a.shutdown().await;
}

/// A stored fired tick ahead of the worker's clock (recorded by a clock that ran ahead)
/// holds the schedule back; the runner says so once, naming the schedule and how to clear
/// it, not at every poll.
#[tokio::test]
async fn a_fired_tick_ahead_of_the_clock_is_warned_about_once() {
    let (logged, _default) = Logged::capture();
    let h = Harness::new();
    let schedule = every_minute(MissedTicks::Skip);
    let day_ahead = h.clock.now().plus(Duration::from_secs(86_400));
    h.store
        .schedule_fired(keel_core::ports::store::ScheduleFiredParams {
            namespace: schedule.namespace().to_owned(),
            name: schedule.name().to_owned(),
            tick: day_ahead,
        })
        .await
        .expect("recorded");
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    for _ in 0..3 {
        h.clock.advance(MINUTE);
        polled(&[&a], h.clock.now()).await;
    }
    assert_eq!(started(&h).await, 0, "no tick before the recorded one fires");
    a.shutdown().await;
    let text = logged.text();
    let warnings: Vec<&str> =
        text.lines().filter(|l| l.contains("ahead of this worker's clock")).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].contains("WARN") && warnings[0].contains("schedules.every-minute"));
    assert!(warnings[0].contains("set fired_through to NULL"), "{}", warnings[0]);
}

/// A tick recorded a day ahead (by a clock that ran ahead) holds a paused schedule back
/// even once resumed, unless the resume re-anchors it: after the resume, the next tick
/// fires on time. The listing shows the tick that will really fire, before and after.
async fn a_resume_re_anchors_a_fired_tick_ahead_of_the_clock<S: TestStore>() {
    let h = S::harness().await;
    let schedule = every_minute(MissedTicks::Skip);
    let day_ahead = h.clock.now().plus(Duration::from_secs(86_400));
    h.store
        .schedule_fired(keel_core::ports::store::ScheduleFiredParams {
            namespace: schedule.namespace().to_owned(),
            name: schedule.name().to_owned(),
            tick: day_ahead,
        })
        .await
        .expect("recorded");
    store_pause(&h, true).await;
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    // One second after a tick: paused, it does not fire.
    let to_tick = 60_000 - h.clock.now().as_millis() % 60_000;
    let tick = h.clock.now().plus(Duration::from_millis(u64::try_from(to_tick).expect("positive")));
    h.clock.set(tick.plus(Duration::from_secs(1)));
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 0, "paused");
    store_pause(&h, false).await;
    // Past STATES_REFRESH the runner reads the resume (and the re-anchored tick).
    h.clock.set(tick.plus(Duration::from_secs(7)));
    polled(&[&a], h.clock.now()).await;
    let info = a.schedules().list(h.clock.now()).remove(0);
    assert!(!info.paused && !info.fired_ahead, "{info:?}");
    assert_eq!(info.next_fire, Some(tick.plus(MINUTE)), "the next minute, not after {day_ahead}");
    h.clock.set(tick.plus(MINUTE));
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 1, "the next tick after the resume fired");
    a.shutdown().await;
}

/// A resume of a running schedule, repeated "to be sure" by a caller whose clock runs two
/// minutes behind the workers', leaves the recorded fired tick alone: a catch-up restart
/// after the tick's instance was pruned does not start that tick again.
async fn a_repeated_resume_from_a_clock_behind_does_not_let_a_restart_fire_a_tick_again<
    S: TestStore,
>() {
    let h = S::harness().await;
    let schedule = every_minute(MissedTicks::CatchUp);
    store_pause(&h, true).await;
    store_pause(&h, false).await;
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 0, "nothing at or before the resume fires");
    let now = h.clock.advance(MINUTE);
    polled(&[&a], now).await;
    assert_eq!(started(&h).await, 1, "the next tick fired");
    // Bounded wait for the runner to record the tick it fired.
    let mut recorded = None;
    for _ in 0..400 {
        let states = h.store.schedule_states("default".into()).await.expect("states");
        recorded = states.first().and_then(|s| s.fired_through);
        if recorded.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tick = recorded.expect("the fired tick is recorded");
    // Its run ends and retention prunes it: the tick's uniqueness key goes with the row.
    cancel_and_prune_the_run(&h).await;
    // The repeated resume, by a clock 110 s behind the tick.
    let behind = Timestamp::from_millis(tick.as_millis() - 110_000);
    let params = SchedulePauseParams {
        namespace: "default".into(),
        name: "every-minute".into(),
        paused: false,
        now: behind,
    };
    let state = h.store.schedule_pause(params).await.expect("resume again");
    assert_eq!(state.fired_through, Some(tick), "a repeated resume keeps the recorded tick");
    // A deploy restarts the worker within the same minute: the tick is not started again.
    a.shutdown().await;
    let a = worker(&h, "a", &schedule);
    polled(&[&a], h.clock.now()).await;
    assert_eq!(started(&h).await, 0, "the tick ran again: {:?}", a.schedules().counts());
    a.shutdown().await;
}

/// Ready instances of the report machine in `namespace`.
async fn started_in<S: Store>(h: &Harness<S>, namespace: &str) -> u64 {
    let stats = h.store.queue_stats(None, h.clock.now()).await.expect("queue stats");
    stats
        .iter()
        .filter(|q| q.namespace == namespace && q.machine == report().name)
        .map(|q| q.ready)
        .sum()
}

/// Two services share one store, each in its own namespace, and each defines a schedule
/// named `nightly` on the same pattern: every tick starts one instance in each namespace,
/// and neither takes the other's tick for its own.
async fn same_named_schedules_in_two_namespaces_each_start_their_own_tick<S: TestStore>() {
    let h = S::harness().await;
    let nightly = |namespace: &str| {
        let start = NewInstance::new(report(), "run").namespace(namespace);
        Schedule::new("nightly", "* * * * *", "UTC", ScheduleAction::Start(start))
            .expect("a valid schedule")
    };
    let a = worker(&h, "a", &nightly("team-a"));
    let b = worker(&h, "b", &nightly("team-b"));
    polled(&[&a, &b], h.clock.now()).await;
    for tick in 1..=2 {
        let now = h.clock.advance(MINUTE);
        polled(&[&a, &b], now).await;
        let counts = (started_in(&h, "team-a").await, started_in(&h, "team-b").await);
        assert_eq!(
            counts,
            (tick, tick),
            "each namespace's schedule starts its own tick: {:?} {:?}",
            a.schedules().counts(),
            b.schedules().counts()
        );
    }
    let (ca, cb) = (a.schedules().counts(), b.schedules().counts());
    assert_eq!((ca.fired, cb.fired), (2, 2), "{ca:?} {cb:?}");
    assert_eq!(ca.already_fired + cb.already_fired, 0, "{ca:?} {cb:?}");
    a.shutdown().await;
    b.shutdown().await;
}

/// A broadcast tick that finds no instance in the state did its tick: the runner counts
/// it as fired, not as a tick another worker fired first (which would send an operator
/// looking for a second worker).
async fn a_broadcast_tick_with_nobody_in_the_state_counts_as_fired_not_as_another_workers<
    S: TestStore,
>() {
    let h = S::harness().await;
    let a = worker(&h, "a", &renewals(MissedTicks::Skip));
    polled(&[&a], h.clock.now()).await;
    for _ in 0..2 {
        let now = h.clock.advance(MINUTE);
        polled(&[&a], now).await;
    }
    let counts = a.schedules().counts();
    assert_eq!((counts.fired, counts.already_fired, counts.failed), (2, 0, 0), "{counts:?}");
    a.shutdown().await;
}

/// A store that holds back every insert of a report instance while `hold` is set (a
/// schedule's fire that takes long, as a broadcast to 50 000 instances does) and passes
/// every other call on to the store inside.
struct Held<S> {
    inner: S,
    hold: tokio::sync::watch::Sender<bool>,
    /// Inserts held back so far.
    blocked: AtomicUsize,
}

impl<S> Held<S> {
    fn new(inner: S) -> Self {
        Held { inner, hold: tokio::sync::watch::channel(false).0, blocked: AtomicUsize::new(0) }
    }
}

macro_rules! held_store {
    ($($op:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        #[async_trait]
        impl<S: Store> Store for Held<S> {
            fn capabilities(&self) -> s::StoreCapabilities {
                self.inner.capabilities()
            }
            async fn instance_insert(
                &self,
                p: s::InsertParams,
            ) -> StoreResult<Vec<s::InsertOutcome>> {
                if p.instances.iter().any(|i| i.machine == report()) && *self.hold.borrow() {
                    self.blocked.fetch_add(1, Ordering::SeqCst);
                    let mut hold = self.hold.subscribe();
                    while *hold.borrow_and_update() {
                        hold.changed().await.expect("the store keeps the sender");
                    }
                }
                self.inner.instance_insert(p).await
            }
            async fn ready_wait(&self) {
                self.inner.ready_wait().await;
            }
            async fn instance_change_wait(&self) {
                self.inner.instance_change_wait().await;
            }
            $(async fn $op(&self, $($arg: $ty),*) -> $ret {
                self.inner.$op($($arg),*).await
            })*
        }
    };
}

held_store! {
    instance_claim(p: s::ClaimParams) -> StoreResult<Vec<s::Claim>>;
    instance_claim_ids(ids: Vec<InstanceId>, p: s::ClaimParams) -> StoreResult<Vec<s::Claim>>;
    instance_ready_stale(p: s::ReadyStaleParams) -> StoreResult<Vec<Instance>>;
    step_commit(p: s::CommitParams) -> StoreResult<Vec<StoreResult<s::CommitReceipt>>>;
    lease_extend(p: s::LeaseExtendParams) -> StoreResult<Vec<bool>>;
    lease_reap(p: s::LeaseReapParams) -> StoreResult<Vec<InstanceId>>;
    lease_release(p: s::LeaseReleaseParams) -> StoreResult<Vec<bool>>;
    signal_deliver(p: s::SignalDeliverParams) -> StoreResult<Vec<s::DeliveryOutcome>>;
    signal_broadcast(p: s::SignalBroadcastParams) -> StoreResult<s::BroadcastReport>;
    instance_cancel(p: s::CancelParams) -> StoreResult<Vec<InstanceId>>;
    instance_get(id: InstanceId) -> StoreResult<s::InstanceDetail>;
    instance_rows(ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>>;
    instance_list(p: s::InstanceListParams) -> StoreResult<Vec<Instance>>;
    instance_lookup(t: SignalTarget) -> StoreResult<Option<InstanceId>>;
    dead_letter_list(f: s::DeadLetterFilter) -> StoreResult<Vec<DeadLetter>>;
    dead_letter_get(id: DeadLetterId) -> StoreResult<DeadLetter>;
    dead_letter_retry(p: s::DeadLetterRetryParams) -> StoreResult<Vec<InstanceId>>;
    dead_letter_skip(p: s::DeadLetterSkipParams) -> StoreResult<InstanceId>;
    dead_letter_purge(p: s::DeadLetterPurgeParams) -> StoreResult<u64>;
    dead_letter_counts(ns: Option<String>) -> StoreResult<Vec<s::DeadLetterCount>>;
    queue_pause(p: s::QueuePauseParams) -> StoreResult<()>;
    queue_list(ns: String) -> StoreResult<Vec<s::QueueState>>;
    queue_stats(ns: Option<String>, now: Timestamp) -> StoreResult<Vec<s::QueueStats>>;
    schedule_pause(p: s::SchedulePauseParams) -> StoreResult<s::ScheduleState>;
    schedule_states(ns: String) -> StoreResult<Vec<s::ScheduleState>>;
    schedule_fired(p: s::ScheduleFiredParams) -> StoreResult<s::ScheduleState>;
    schedule_forget(p: s::ScheduleForgetParams) -> StoreResult<u64>;
    timer_sweep(p: s::TimerSweepParams) -> StoreResult<s::TimerSweepReport>;
    timers_retime(p: s::TimerRetimeParams) -> StoreResult<s::TimerRetimePage>;
    timer_next_due(p: s::TimerNextDueParams) -> StoreResult<Option<Timestamp>>;
    instance_migrate(p: s::MigrateParams) -> StoreResult<s::MigratePage>;
    instance_activity(p: s::ActivityParams) -> StoreResult<Vec<s::ActivityBucket>>;
    worker_heartbeat(p: s::WorkerBeatParams) -> StoreResult<()>;
    worker_list(seen_since: Timestamp) -> StoreResult<Vec<s::WorkerRecord>>;
    instance_prune(p: s::PruneParams) -> StoreResult<s::PrunePage>;
    history_page(p: s::HistoryPageParams) -> StoreResult<s::HistoryPage>;
    history_trim(p: s::HistoryTrimParams) -> StoreResult<s::HistoryTrimPage>;
    timer_status(ns: Option<String>, now: Timestamp) -> StoreResult<Vec<s::TimerStatus>>;
    timer_hint_wait(seen: u64) -> TimerHint;
}

/// A poll that fires two schedules fires the second on states read after the first
/// fired. Worker b serves a starting schedule, then a broadcasting one; its start of the
/// report run is held back after it read the states. Meanwhile worker a broadcasts the
/// same tick, records it, and the subscriptions read it (their inbox no longer holds its
/// dedup key): b, once its start goes through, does not broadcast that tick again.
#[tokio::test]
async fn a_tick_another_worker_fired_during_a_slow_earlier_fire_is_not_fired_again() {
    let h = Harness::with_store(Held::new(keel_testkit::MemoryStore::new()));
    let (runner, ids) = subscriptions(&h).await;
    let b = worker_of(&h, "b", vec![every_minute(MissedTicks::Skip), renewals(MissedTicks::Skip)]);
    polled(&[&b], h.clock.now()).await;
    h.store.hold.send_replace(true);
    let now = h.clock.advance(MINUTE);
    for _ in 0..400 {
        if h.store.blocked.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.store.blocked.load(Ordering::SeqCst), 1, "b is starting the tick's report run");
    // a starts now and catches up: it broadcasts the tick b has yet to reach, and records it.
    let a = worker(&h, "a", &renewals(MissedTicks::CatchUp));
    polled(&[&a], now).await;
    renewed(&h, &ids, 1).await;
    h.store.hold.send_replace(false);
    polled(&[&a, &b], now).await;
    renewed_exactly(&h, &ids, 1, "after b's slow start").await;
    let (ca, cb) = (a.schedules().counts(), b.schedules().counts());
    assert_eq!((ca.fired, ca.already_fired), (1, 0), "a broadcast the tick: {ca:?}");
    assert_eq!((cb.fired, cb.already_fired, cb.failed), (1, 0, 0), "b only started: {cb:?}");
    assert_eq!(started(&h).await, 1);
    // The next tick is delivered once, and b's report run starts.
    let now = h.clock.advance(MINUTE);
    polled(&[&a, &b], now).await;
    renewed(&h, &ids, 2).await;
    assert_eq!(started(&h).await, 2);
    a.shutdown().await;
    b.shutdown().await;
    runner.shutdown().await;
}
