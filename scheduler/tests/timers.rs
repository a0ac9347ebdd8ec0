//! Durable chart timers end to end (issue: keel-timers), on `MemoryStore` + `VirtualClock`:
//! the worker runs the chart, the test moves virtual time and runs the sweep by hand.
//!
//! The tests at the end run twice, on `MemoryStore` (`memory::*`) and on PostgreSQL
//! (`postgres::*`, a fresh schema per test; skipped loudly without
//! `KEEL_TEST_DATABASE_URL`, failing under `KEEL_REQUIRE_BACKENDS=1`): a worker with the
//! default sweep settings fires a due timer promptly, and a transit state renews a deadline.

#[macro_use]
mod common;

use common::{Harness, TestStore, in_state};
use keel_core::chart::{Definition, Timer};
use keel_core::ports::{Clock, Store};
use keel_core::{InstanceId, NewSignal, Status};
use keel_scheduler::{ChartMachine, SweepConfig, Sweeper, Worker, WorkerConfig, WorkerHandle};
use keel_testkit::VirtualClock;
use keel_testkit::memory::MemoryStore;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

fn sweeper(h: &Harness) -> Sweeper<MemoryStore, VirtualClock> {
    Sweeper::new(Arc::clone(&h.store), h.clock.clone(), SweepConfig::default())
        .expect("valid config")
}

fn worker(h: &Harness, m: ChartMachine) -> WorkerHandle {
    // The test sweeps by hand: no sweeper inside the worker.
    let config = WorkerConfig { timers: None, ..h.config() };
    h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m)).spawn()
}

/// Moves time, sweeps once, and returns how many timer events were delivered.
async fn advance(h: &Harness, s: &Sweeper<MemoryStore, VirtualClock>, by: Duration) -> u64 {
    h.clock.advance(by);
    match s.sweep(&[]).await.expect("sweep") {
        keel_timers::SweepOutcome::Swept { report, .. }
        | keel_timers::SweepOutcome::Overdue { report, .. } => report.fired + report.exhausted,
        keel_timers::SweepOutcome::Skipped { .. } => 0,
    }
}

async fn fired<S: Store>(h: &Harness<S>, id: InstanceId, event: &str) -> usize {
    let history = h.client.get(id).await.unwrap().history;
    history
        .iter()
        .filter(|r| r.entry.kind == "TIMER_FIRED" && r.entry.data["event"] == json!(event))
        .count()
}

fn checkout() -> ChartMachine {
    let def = Definition::builder("checkout", 1)
        .guard("vip", |ctx, _| ctx.get_as::<bool>("vip") == Some(true))
        .initial("awaiting")
        .state("awaiting", |s| {
            s.on_to("PAY", "paid")
                .on("EXPIRE", |t| {
                    t.after(Timer::seconds(10))
                        .branch(|b| b.guard("vip").target("grace"))
                        .branch(|b| b.target("expired"))
                })
                .on("REMIND", |t| t.every(Timer::seconds(4)).action("remind"))
        })
        .state("grace", |s| s.on("EXPIRE_GRACE", |t| t.target("expired").after(Timer::seconds(20))))
        .state("paid", |s| s.on_to("ARCHIVE", "archived"))
        .final_state("expired")
        .final_state("archived")
        .build()
        .expect("valid chart");
    ChartMachine::new(def).action("remind", |ctx, _| async move {
        let n: u64 = ctx.get_as("reminders").unwrap_or(0);
        ctx.set("reminders", n + 1);
        Ok(())
    })
}

#[tokio::test]
async fn an_after_timer_fires_once_after_its_duration() {
    let h = Harness::new();
    let s = sweeper(&h);
    let m = checkout();
    let id = h.start(m.new_instance(json!({}))).await;
    let w = worker(&h, m);
    h.wait(id, "awaiting", in_state("awaiting")).await;
    let detail = h.client.get(id).await.unwrap();
    assert_eq!(
        detail.timers.iter().map(|t| t.spec.event.as_str()).collect::<Vec<_>>(),
        ["REMIND", "EXPIRE"]
    );

    assert_eq!(advance(&h, &s, Duration::from_secs(4)).await, 1, "a reminder at 4 s");
    assert_eq!(
        advance(&h, &s, Duration::from_secs(5)).await,
        1,
        "the one due at 8 s, swept at 9 s"
    );
    h.wait(id, "reminded twice", |r| r.context["reminders"] == json!(2)).await;
    assert_eq!(
        advance(&h, &s, Duration::from_secs(1)).await,
        1,
        "the expiry at 10 s; the next reminder is due at 12 s"
    );
    let row = h.wait(id, "expired", |r| r.status == Status::Done).await;
    assert!(in_state("expired")(&row) || row.result.is_some());
    assert_eq!(fired(&h, id, "EXPIRE").await, 1);
    assert_eq!(
        advance(&h, &s, Duration::from_secs(60)).await,
        0,
        "a finished instance has no timers"
    );
    w.shutdown().await;
}

#[tokio::test]
async fn leaving_the_state_before_the_deadline_cancels_its_timers() {
    let h = Harness::new();
    let s = sweeper(&h);
    let m = checkout();
    let id = h.start(m.new_instance(json!({}))).await;
    let w = worker(&h, m);
    h.wait(id, "awaiting", in_state("awaiting")).await;
    h.clock.advance(Duration::from_secs(3));
    h.client.send(NewSignal::new(id, "PAY")).await.unwrap();
    h.wait(id, "paid", in_state("paid")).await;
    assert!(h.client.get(id).await.unwrap().timers.is_empty());
    assert_eq!(
        advance(&h, &s, Duration::from_secs(10)).await,
        0,
        "a sweep at the deadline changes nothing"
    );
    assert_eq!(fired(&h, id, "EXPIRE").await, 0);
    w.shutdown().await;
}

#[tokio::test]
async fn a_guarded_timer_event_takes_the_branch_whose_guard_holds_when_processed() {
    let h = Harness::new();
    let s = sweeper(&h);
    let m = checkout();
    let vip = h.start(m.new_instance(json!({ "vip": true }))).await;
    let w = worker(&h, m);
    h.wait(vip, "awaiting", in_state("awaiting")).await;
    advance(&h, &s, Duration::from_secs(10)).await;
    h.wait(vip, "grace", in_state("grace")).await;
    let timers = h.client.get(vip).await.unwrap().timers;
    assert_eq!(
        timers.iter().map(|t| t.spec.event.as_str()).collect::<Vec<_>>(),
        ["EXPIRE_GRACE"],
        "entering grace armed its own timer"
    );
    advance(&h, &s, Duration::from_secs(20)).await;
    h.wait(vip, "expired after the grace period", |r| r.status == Status::Done).await;
    w.shutdown().await;
}

fn retrying() -> ChartMachine {
    let def = Definition::builder("retrying", 1)
        .initial("charging")
        .state("charging", |s| {
            s.on("RETRY", |t| t.every(Timer::seconds(10)).max(3).then("GIVE_UP").action("charge"))
                .on_to("GIVE_UP", "failed")
        })
        .final_state("failed")
        .build()
        .expect("valid chart");
    ChartMachine::new(def).action("charge", |ctx, _| async move {
        let n: u64 = ctx.get_as("charges").unwrap_or(0);
        ctx.set("charges", n + 1);
        Ok(())
    })
}

#[tokio::test]
async fn every_with_max_fires_max_times_then_sends_then_exactly_once() {
    let h = Harness::new();
    let s = sweeper(&h);
    let m = retrying();
    let id = h.start(m.new_instance(json!({}))).await;
    let w = worker(&h, m);
    h.wait(id, "charging", in_state("charging")).await;
    for n in 1..=3 {
        assert_eq!(advance(&h, &s, Duration::from_secs(10)).await, 1, "sweep {n}");
        h.wait(id, "charged", |r| r.context["charges"] == json!(n)).await;
        assert_eq!(advance(&h, &s, Duration::ZERO).await, 0, "an immediate re-sweep fires nothing");
    }
    assert_eq!(advance(&h, &s, Duration::from_secs(10)).await, 1, "sweep 4 delivers GIVE_UP");
    h.wait(id, "failed", |r| r.status == Status::Done).await;
    assert_eq!(advance(&h, &s, Duration::from_secs(10)).await, 0, "sweep 5 is a no-op");
    let history = h.client.get(id).await.unwrap().history;
    assert_eq!(history.iter().filter(|r| r.entry.kind == "TIMER_EXHAUSTED").count(), 1);
    w.shutdown().await;
}

#[tokio::test]
async fn a_delegation_states_timeout_and_its_own_timer_coexist() {
    let h = Harness::new();
    let s = sweeper(&h);
    let def = Definition::builder("delegating", 1)
        .initial("waiting")
        .state("waiting", |st| {
            st.machine("slow_child")
                .on("NUDGE", |t| t.every(Timer::seconds(10)).action("nudge"))
                .on_timeout(Timer::seconds(30), |b| b.target("timed_out"))
        })
        .final_state("timed_out")
        .build()
        .expect("valid chart");
    let m = ChartMachine::new(def).action("nudge", |ctx, _| async move {
        let n: u64 = ctx.get_as("nudges").unwrap_or(0);
        ctx.set("nudges", n + 1);
        Ok(())
    });
    let id = h.start(m.new_instance(json!({}))).await;
    let w = worker(&h, m); // nobody runs slow_child: it never finishes
    h.wait(id, "waiting", in_state("waiting")).await;
    let mut nudges = 0;
    for _ in 0..2 {
        nudges += advance(&h, &s, Duration::from_secs(10)).await;
    }
    assert_eq!(nudges, 2);
    h.wait(id, "nudged", |r| r.context["nudges"] == json!(2)).await;
    advance(&h, &s, Duration::from_secs(10)).await; // 30 s: the nudge and the timeout
    let row = h.wait(id, "timed out", |r| r.status == Status::Done).await;
    // Both were due at 30 s; fires are delivered in due order, then timer id (the nudge
    // was armed first), and the inbox is processed in arrival order.
    assert_eq!(row.result.as_ref().map(|r| r["nudges"].clone()), Some(json!(3)));
    w.shutdown().await;
}

#[tokio::test]
async fn the_worker_runs_the_sweeper_when_configured() {
    let h = Harness::new();
    let m = checkout();
    let id = h.start(m.new_instance(json!({}))).await;
    let cadence =
        keel_scheduler::SweepGroup { machines: vec![], cadence: Duration::from_millis(100) };
    let config = WorkerConfig {
        timers: Some(SweepConfig { groups: vec![cadence], ..SweepConfig::default() }),
        ..h.config()
    };
    let w =
        h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m)).spawn();
    h.wait(id, "awaiting", in_state("awaiting")).await;
    h.clock.advance(Duration::from_secs(11));
    h.wait(id, "expired by the worker's own sweeper", |r| r.status == Status::Done).await;
    w.shutdown().await;
}

on_every_store!(
    a_default_worker_fires_a_due_timer_well_before_the_cadence,
    a_transit_state_renews_a_deadline_and_a_self_loop_keeps_it,
    a_deadline_fired_behind_the_event_that_renews_it_is_withdrawn,
);

fn expiring() -> ChartMachine {
    let def = Definition::builder("expiring", 1)
        .initial("awaiting")
        .state("awaiting", |s| {
            s.on("EXPIRE", |t| t.target("expired").after(Timer::seconds(1))).on_to("PAY", "paid")
        })
        .final_state("expired")
        .final_state("paid")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

/// A worker on the default sweep settings (a one-minute fallback cadence) fires an `after`
/// timer as soon as it falls due: its sweeper sleeps until the earliest due time and a
/// commit arming an earlier timer wakes it. Real time allowed: a few seconds, far below
/// the cadence.
async fn a_default_worker_fires_a_due_timer_well_before_the_cadence<S: TestStore>() {
    let h = S::harness().await;
    let config = h.config();
    assert_eq!(config.timers, Some(SweepConfig::default()), "the default sweep settings");
    let m = expiring();
    let w = h
        .hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m.clone()))
        .spawn();
    // Let the sweeper run its start-up sweep and go to sleep before the timer exists.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let id = h.start(m.new_instance(json!({}))).await;
    h.wait(id, "awaiting", in_state("awaiting")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.status(id).await, Status::AwaitingSignal, "never before the due time");
    let due = std::time::Instant::now();
    h.clock.advance(Duration::from_secs(1));
    let row = h.wait(id, "expired by the worker's own sweeper", |r| r.status == Status::Done).await;
    assert!(row.result.is_some());
    // Typically within a few hundred milliseconds; the bound is generous for a loaded
    // machine and still far below the 60 s cadence.
    assert!(
        due.elapsed() < Duration::from_secs(20),
        "fired {:?} after its due time; the cadence is 60 s",
        due.elapsed()
    );
    assert_eq!(fired(&h, id, "EXPIRE").await, 1);
    w.shutdown().await;
}

fn session() -> ChartMachine {
    let def = Definition::builder("session", 1)
        .initial("idle")
        .state("idle", |s| {
            s.on("LOGOUT", |t| t.target("closed").after(Timer::seconds(30)))
                .on_to("ACTIVITY", "renewing")
                .on_to("TOUCH", "idle")
        })
        .state("renewing", |s| s.always(|b| b.target("idle")))
        .final_state("closed")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

/// Sweeps by hand until a sweep fired something (PostgreSQL leaves a timer whose instance
/// is locked at that moment for the next sweep), at most a bounded number of times.
async fn sweep_until_fired<S: Store>(s: &Sweeper<S, VirtualClock>) -> u64 {
    for _ in 0..200 {
        if let keel_timers::SweepOutcome::Swept { report, .. } = s.sweep(&[]).await.expect("sweep")
            && report.fired > 0
        {
            return report.fired;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    0
}

async fn due_times<S: Store>(h: &Harness<S>, id: InstanceId) -> Vec<keel_core::Timestamp> {
    h.client.get(id).await.unwrap().timers.iter().map(|t| t.next_fire_at).collect()
}

/// Waits until the instance's timers are due at `want` (the commit that re-arms them has
/// landed).
async fn wait_due<S: Store>(h: &Harness<S>, id: InstanceId, want: keel_core::Timestamp) {
    for _ in 0..1_000 {
        if due_times(h, id).await == [want] {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timers of {id} are due at {:?}, expected [{want:?}]", due_times(h, id).await);
}

/// Event → transit state → `@always` back renews the `after` deadline durably (the commit
/// cancels and re-arms it from the event's time); a self-loop keeps the original one.
async fn a_transit_state_renews_a_deadline_and_a_self_loop_keeps_it<S: TestStore>() {
    let h = S::harness().await;
    let s = Sweeper::new(Arc::clone(&h.store), h.clock.clone(), SweepConfig::default())
        .expect("valid config");
    let m = session();
    let config = WorkerConfig { timers: None, ..h.config() };
    let w = h
        .hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m.clone()))
        .spawn();
    let renewed = h.start(m.new_instance(json!({}))).await;
    let kept = h.start(m.new_instance(json!({}))).await;
    let t0 = h.clock.now();
    wait_due(&h, renewed, t0.plus(Duration::from_secs(30))).await;
    wait_due(&h, kept, t0.plus(Duration::from_secs(30))).await;

    h.clock.advance(Duration::from_secs(20));
    h.client.send(NewSignal::new(renewed, "ACTIVITY")).await.unwrap();
    h.client.send(NewSignal::new(kept, "TOUCH")).await.unwrap();
    wait_due(&h, renewed, t0.plus(Duration::from_secs(50))).await;
    h.wait(kept, "touched", |r| r.status == Status::AwaitingSignal && r.revision.0 >= 2).await;
    assert_eq!(due_times(&h, kept).await, [t0.plus(Duration::from_secs(30))], "kept");

    h.clock.advance(Duration::from_secs(15)); // 35 s: only the kept deadline is due
    assert_eq!(sweep_until_fired(&s).await, 1);
    h.wait(kept, "closed at the original deadline", |r| r.status == Status::Done).await;
    assert_eq!(h.status(renewed).await, Status::AwaitingSignal, "renewed: not due before 50 s");
    assert_eq!(fired(&h, renewed, "LOGOUT").await, 0);

    h.clock.advance(Duration::from_secs(15)); // 50 s: the renewed deadline
    assert_eq!(sweep_until_fired(&s).await, 1);
    h.wait(renewed, "closed at the renewed deadline", |r| r.status == Status::Done).await;
    w.shutdown().await;
}

/// A deadline that falls due while the event renewing it waits unprocessed (no worker
/// ran) lands in the inbox behind that event. Processing the event renews the deadline,
/// and the old deadline's fire is withdrawn instead of closing the session renewed a
/// moment before; the renewed deadline closes it.
async fn a_deadline_fired_behind_the_event_that_renews_it_is_withdrawn<S: TestStore>() {
    let h = S::harness().await;
    let s = Sweeper::new(Arc::clone(&h.store), h.clock.clone(), SweepConfig::default())
        .expect("valid config");
    let m = session();
    let spawn = || {
        let config = WorkerConfig { timers: None, ..h.config() };
        h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m.clone()))
            .spawn()
    };
    let w = spawn();
    let id = h.start(m.new_instance(json!({}))).await;
    let t0 = h.clock.now();
    wait_due(&h, id, t0.plus(Duration::from_secs(30))).await;
    w.shutdown().await;

    h.clock.advance(Duration::from_secs(20));
    h.client.send(NewSignal::new(id, "ACTIVITY")).await.unwrap();
    h.clock.advance(Duration::from_secs(15)); // 35 s: the deadline fires behind ACTIVITY
    assert_eq!(sweep_until_fired(&s).await, 1);
    let inbox: Vec<String> =
        h.client.get(id).await.unwrap().inbox.iter().map(|s| s.name.clone()).collect();
    assert_eq!(inbox, ["ACTIVITY", "LOGOUT"]);

    let w = spawn();
    let row = h
        .wait(id, "ACTIVITY processed", |r| {
            r.status == Status::Done || (r.status == Status::AwaitingSignal && r.revision.0 >= 2)
        })
        .await;
    assert_eq!(row.status, Status::AwaitingSignal, "the stale deadline closed the session");
    let history = h.client.get(id).await.unwrap().history;
    let withdrawn: Vec<_> = history.iter().filter(|r| r.entry.kind == "TIMER_WITHDRAWN").collect();
    assert_eq!(withdrawn.len(), 1, "{history:#?}");
    assert_eq!(withdrawn[0].entry.data["event"], json!("LOGOUT"));
    assert_eq!(due_times(&h, id).await, [t0.plus(Duration::from_secs(65))], "renewed at 35 s");

    h.clock.advance(Duration::from_secs(30)); // 65 s: the renewed deadline
    assert_eq!(sweep_until_fired(&s).await, 1);
    h.wait(id, "closed at the renewed deadline", |r| r.status == Status::Done).await;
    w.shutdown().await;
}

/// A child machine (`held_payment`) whose step runs until the test lets it go: every try,
/// or with `first_only` only the first (its later tries are charged at once).
struct HeldPayment {
    release: Arc<tokio::sync::Notify>,
    tries: Arc<std::sync::atomic::AtomicUsize>,
    first_only: bool,
}

impl HeldPayment {
    fn new(release: &Arc<tokio::sync::Notify>, first_only: bool) -> Self {
        HeldPayment { release: Arc::clone(release), tries: Arc::default(), first_only }
    }
}

#[async_trait::async_trait]
impl keel_scheduler::StepMachine for HeldPayment {
    fn machine(&self) -> keel_core::MachineRef {
        keel_core::MachineRef::new("held_payment", 1)
    }
    async fn step(
        &self,
        _: &keel_scheduler::StepContext,
    ) -> Result<keel_core::Outcome, keel_scheduler::StepError> {
        let first = self.tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        if first || !self.first_only {
            self.release.notified().await;
        }
        Ok(keel_core::Outcome::Done { result: json!({ "charged": true }), step: None })
    }
}

/// A delegation state left by its `@timeout` cancels the child machine it started: the
/// child is cancelled in the parent's commit, the step it was running cannot commit
/// afterwards, and the parent hears no failure notice for the state it already left.
/// The child runs in the parent's namespace and queue.
#[tokio::test]
async fn a_delegation_timeout_cancels_the_running_child() {
    let h = Harness::new();
    let s = sweeper(&h);
    let def = Definition::builder("paying_order", 1)
        .initial("paying")
        .state("paying", |st| {
            st.machine("held_payment")
                .on_done(|b| b.target("paid"))
                .on_timeout(Timer::seconds(30), |b| b.target("gave_up"))
        })
        .state("gave_up", |st| st.on_to("RETRY", "paying"))
        .final_state("paid")
        .build()
        .expect("valid chart");
    let m = ChartMachine::new(def);
    let release = Arc::new(tokio::sync::Notify::new());
    let config = WorkerConfig {
        timers: None,
        namespaces: vec!["shop".into()],
        queues: vec![("orders".into(), 4)],
        ..h.config()
    };
    let w = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(m.clone())
        .register(HeldPayment::new(&release, false))
        .spawn();
    let start = m.new_instance(json!({})).namespace("shop").queue("orders");
    let id = h.start(start).await;
    h.wait(id, "paying", in_state("paying")).await;
    let child = loop {
        let detail = h.client.get(id).await.unwrap();
        if let Some(c) = detail.children.first() {
            break c.id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let running =
        h.wait(child, "the child's step running", |r| r.status == Status::Executing).await;
    assert_eq!(running.parent, Some(id));
    assert_eq!((running.namespace.as_str(), running.queue.as_str()), ("shop", "orders"));

    assert_eq!(advance(&h, &s, Duration::from_secs(30)).await, 1, "the deadline fires");
    h.wait(id, "gave up", in_state("gave_up")).await;
    let cancelled = h.client.get(child).await.unwrap();
    assert_eq!(cancelled.instance.status, Status::Cancelled);
    assert!(
        cancelled.instance.last_error.as_deref().is_some_and(|e| e.contains("`paying`")),
        "{:?}",
        cancelled.instance.last_error
    );

    release.notify_waiters();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = h.client.get(child).await.unwrap();
    assert_eq!(after.instance.status, Status::Cancelled, "the late step did not commit");
    assert_eq!(after.instance.result, None);
    let parent = h.client.get(id).await.unwrap();
    assert!(in_state("gave_up")(&parent.instance), "the parent stays where its deadline put it");
    assert!(parent.inbox.is_empty(), "no notice for a state already left: {:?}", parent.inbox);
    w.shutdown().await;
}

/// `@timeout` back to the delegation state is a retry: the hung child is cancelled in the
/// parent's commit, a new child starts, and its `@done` moves the chart on. The hung
/// step, released afterwards, cannot commit.
#[tokio::test]
async fn a_delegation_state_entered_again_on_its_timeout_retries_its_child() {
    let h = Harness::new();
    let s = sweeper(&h);
    let def = Definition::builder("retrying_order", 1)
        .initial("paying")
        .state("paying", |st| {
            st.machine("held_payment")
                .on_done(|b| b.target("paid"))
                .on_timeout(Timer::seconds(30), |b| b.target("paying"))
        })
        .final_state("paid")
        .build()
        .expect("valid chart");
    let m = ChartMachine::new(def);
    let release = Arc::new(tokio::sync::Notify::new());
    let config = WorkerConfig { timers: None, ..h.config() };
    let w = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(m.clone())
        .register(HeldPayment::new(&release, true));
    let w = h.hinted(w).spawn();
    let id = h.start(m.new_instance(json!({}))).await;
    h.wait(id, "paying", in_state("paying")).await;
    let child = loop {
        let detail = h.client.get(id).await.unwrap();
        if let Some(c) = detail.children.first() {
            break c.id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    h.wait(child, "the first try hanging", |r| r.status == Status::Executing).await;
    assert_eq!(advance(&h, &s, Duration::from_secs(30)).await, 1, "the deadline fires");
    h.wait(id, "paid after the retry", |r| r.status == Status::Done).await;
    let children = h.client.get(id).await.unwrap().children;
    let statuses: Vec<Status> = children.iter().map(|c| c.status).collect();
    assert_eq!(statuses, [Status::Cancelled, Status::Done], "the hung try, then a new child");
    release.notify_waiters();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let late = h.client.get(child).await.unwrap().instance;
    assert_eq!((late.status, late.result), (Status::Cancelled, None), "the late step lost");
    w.shutdown().await;
}

fn deadline(after: Timer, keep_armed: bool) -> ChartMachine {
    let def = Definition::builder("deadline", 1)
        .initial("awaiting")
        .state("awaiting", |s| {
            s.on("EXPIRE", |t| {
                let t = t.target("expired").after(after);
                if keep_armed { t.keep_armed() } else { t }
            })
        })
        .final_state("expired")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

/// A deploy that shortens an `after` from 7 days to 1 day: a worker starting with the new
/// definition moves the timer of an instance that has waited 2 days, which then fires at
/// the next sweep; with `keep_armed` it keeps its 7 days.
#[tokio::test]
async fn a_deploy_that_shortens_a_deadline_moves_waiting_timers() {
    for keep_armed in [false, true] {
        let h = Harness::new();
        let s = sweeper(&h);
        let old = deadline(Timer::days(7), false);
        let id = h.start(old.new_instance(json!({}))).await;
        let w = worker(&h, old);
        h.wait(id, "awaiting", in_state("awaiting")).await;
        w.shutdown().await;

        h.clock.advance(Duration::from_secs(2 * 86_400));
        let w = worker(&h, deadline(Timer::days(1), keep_armed));
        let moved = |h: &Harness| {
            let h = h.client.clone();
            async move {
                let history = h.get(id).await.unwrap().history;
                history.iter().any(|r| r.entry.kind == "TIMER_RETIMED")
            }
        };
        if keep_armed {
            // Give the start-up pass time to run; it must leave the timer alone.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(!moved(&h).await, "keep_armed keeps the armed duration");
            assert_eq!(advance(&h, &s, Duration::ZERO).await, 0, "not due before 7 days");
        } else {
            for _ in 0..200 {
                if moved(&h).await {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(moved(&h).await, "the start-up pass moved the timer");
            assert_eq!(advance(&h, &s, Duration::ZERO).await, 1, "due at the next sweep");
            h.wait(id, "expired", |r| r.status == Status::Done).await;
        }
        w.shutdown().await;
    }
}

/// `keel_timers_fired_total` against what the store delivered, when one store call of a
/// sweep fails after others committed.
mod fired_counter {
    use super::common::faulty::{Fault, Faulty};
    use super::{Harness, expiring, fired, in_state};
    use keel_scheduler::{SweepConfig, Sweeper, Worker, WorkerConfig};
    use keel_testkit::memory::MemoryStore;
    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
    use serde_json::json;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// A recorder that keeps each counter's total by name, to read what was counted.
    #[derive(Default)]
    struct Counters(Mutex<HashMap<String, Arc<AtomicU64>>>);

    impl Counters {
        fn get(&self, name: &str) -> u64 {
            self.0.lock().unwrap().get(name).map_or(0, |c| c.load(Ordering::SeqCst))
        }
    }

    impl metrics::Recorder for Counters {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let mut counters = self.0.lock().unwrap();
            Counter::from_arc(Arc::clone(counters.entry(key.name().to_owned()).or_default()))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// 150 due timers, batches of 100: the first call fires 100, then a wave of two calls
    /// runs, one failing and the other firing the last 50. The sweep reports the failure,
    /// and the counter still counts all 150 fires the store delivered. The recorder is
    /// this thread's, and the runtime has this one thread, so other tests' sweeps do not
    /// count in it.
    #[test]
    fn fires_committed_before_a_sweep_call_failed_are_counted() {
        let counters = Counters::default();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let delivered = metrics::with_local_recorder(&counters, || {
            runtime.block_on(async {
                // The first store call of the sweep goes through, the second fails.
                let store = Faulty::new(MemoryStore::new())
                    .failing("timer_sweep", &[Fault::Pass, Fault::Error]);
                let h = Harness::with_store(store);
                let m = expiring();
                let config = WorkerConfig { timers: None, ..h.config() };
                let w = Worker::new(Arc::clone(&h.store), h.clock.clone(), config);
                let w = h.hinted(w.register(m.clone())).spawn();
                let mut ids = Vec::with_capacity(150);
                for _ in 0..150 {
                    ids.push(h.start(m.new_instance(json!({}))).await);
                }
                for id in &ids {
                    h.wait(*id, "awaiting", in_state("awaiting")).await;
                }
                w.shutdown().await;
                h.clock.advance(Duration::from_secs(1));
                let config =
                    SweepConfig { batch: 100, batches_in_flight: 2, ..SweepConfig::default() };
                let sweeper = Sweeper::new(Arc::clone(&h.store), h.clock.clone(), config).unwrap();
                let err = sweeper.sweep(&[]).await.expect_err("the second store call fails");
                assert!(err.to_string().contains("injected timer_sweep failure"), "{err}");
                let mut delivered = 0;
                for id in &ids {
                    delivered += fired(&h, *id, "EXPIRE").await;
                }
                delivered
            })
        });
        assert_eq!(delivered, 150, "the first call and the failing call's sibling committed");
        assert_eq!(
            counters.get("keel_timers_fired_total"),
            150,
            "every fire the store delivered is counted"
        );
    }
}
