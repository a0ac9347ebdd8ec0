//! A worker's sweeper starts after the worker's start-up retime has ended: timers follow
//! the deployed definition, so a timer a deploy lengthened is not fired by the first sweep
//! under its old duration. A retime that fails or panics does not keep timers from firing.

mod common;

use common::faulty::{Fault, Faulty};
use common::{Harness, eventually, in_state};
use keel_core::chart::{Definition, Timer};
use keel_core::{InstanceId, Status};
use keel_scheduler::{ChartMachine, SweepConfig, WorkerConfig, WorkerHandle};
use keel_testkit::memory::MemoryStore;
use serde_json::json;
use std::time::Duration;

type H = Harness<Faulty<MemoryStore>>;

/// A chart whose one transition fires `after` in the state `awaiting` (a timer that
/// follows deploys).
fn deadline(after: Timer) -> ChartMachine {
    let def = Definition::builder("deadline", 1)
        .initial("awaiting")
        .state("awaiting", |s| s.on("EXPIRE", |t| t.target("expired").after(after)))
        .final_state("expired")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

fn worker(h: &H, m: ChartMachine, timers: Option<SweepConfig>) -> WorkerHandle {
    h.worker(WorkerConfig { timers, ..h.config() }, m)
}

async fn history_has(h: &H, id: InstanceId, kind: &str) -> usize {
    let history = h.client.get(id).await.unwrap().history;
    history.iter().filter(|r| r.entry.kind == kind).count()
}

/// An instance waits under a one-day deadline; the workers are down for two days; then
/// `faults` are due on `timers_retime` and a worker starts with the deadline lengthened to
/// seven days and its sweeper on.
async fn lengthened_after_downtime(faults: &[Fault]) -> (H, InstanceId, WorkerHandle) {
    let h = Harness::with_store(Faulty::new(MemoryStore::new()));
    let old = deadline(Timer::days(1));
    let id = h.start(old.new_instance(json!({}))).await;
    let w = worker(&h, old, None);
    h.wait(id, "awaiting", in_state("awaiting")).await;
    w.shutdown().await;

    h.clock.advance(Duration::from_secs(2 * 86_400));
    h.store.faults.lock().unwrap().entry("timers_retime").or_default().extend(faults);
    let w = worker(&h, deadline(Timer::days(7)), Some(SweepConfig::default()));
    (h, id, w)
}

/// The retime meets a short outage (three failed tries, about 0.7 s of back-off); the
/// sweeper waits for it, so the timer, due under the old day but not under the deployed
/// seven, does not fire, and no sweep ran before the retime's last store call.
#[tokio::test]
async fn the_first_sweep_waits_for_the_start_up_retime() {
    let (h, id, w) = lengthened_after_downtime(&[Fault::Error; 3]).await;
    let mut moved = false;
    for _ in 0..500 {
        if history_has(&h, id, "TIMER_RETIMED").await > 0 {
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(moved, "the start-up retime moved the timer");
    eventually("a sweep after the retime", || h.store.calls("timer_sweep") > 0).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    assert_eq!(history_has(&h, id, "TIMER_FIRED").await, 0, "not due under seven days");
    h.wait(id, "still awaiting", in_state("awaiting")).await;
    let retimed = *h.store.call_times("timers_retime").last().expect("a retime call");
    let sweeps = h.store.call_times("timer_sweep");
    assert!(sweeps.iter().all(|t| *t >= retimed), "a sweep ran before the retime ended");
    w.shutdown().await;
}

/// A retime refused by the store, or one that panics, ends the wait all the same: the
/// timer keeps its armed duration and fires.
#[tokio::test]
async fn a_failed_start_up_retime_does_not_hold_timers_back() {
    for fault in [Fault::Refuse, Fault::Panic] {
        let (h, id, w) = lengthened_after_downtime(&[fault]).await;
        h.wait(id, "expired under the armed deadline", |r| r.status == Status::Done).await;
        assert_eq!(history_has(&h, id, "TIMER_FIRED").await, 1, "{fault:?}");
        assert_eq!(history_has(&h, id, "TIMER_RETIMED").await, 0, "{fault:?}");
        w.shutdown().await;
    }
}
