//! How a worker stops: when its handle is dropped, what happens to the leases of steps
//! still running through the grace period, what happens to the user code of steps the
//! grace period cut short, and how long a pruner in the middle of a purge holds it up.
//! Virtual time drives leases; real time paces the worker, with every wait bounded.

#![allow(clippy::items_after_statements)]

mod common;

use async_trait::async_trait;
use common::faulty::{Fault, Faulty, Hooks};
use common::{Harness, eventually};
use keel_core::instance::NewInstance;
use keel_core::ports::store::LeaseReapParams;
use keel_core::ports::{Clock, Store};
use keel_core::{MachineRef, Outcome, Status};
use keel_scheduler::{StepContext, StepError, StepMachine, WorkerConfig};
use keel_testkit::memory::MemoryStore;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

fn machine() -> MachineRef {
    MachineRef::new("m", 1)
}

fn new() -> NewInstance {
    NewInstance::new(machine(), "a")
}

fn done() -> Outcome {
    Outcome::Done { result: json!("ok"), step: None }
}

/// A machine whose every step sleeps this long, then sets the flag and finishes.
struct SleepsThenFlags(Duration, Arc<AtomicBool>);

#[async_trait]
impl StepMachine for SleepsThenFlags {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(self.0).await;
        self.1.store(true, Ordering::SeqCst);
        Ok(done())
    }
}

/// A machine whose every step waits until the test lets it finish.
struct WaitsFor(Arc<Notify>);

#[async_trait]
impl StepMachine for WaitsFor {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        self.0.notified().await;
        Ok(done())
    }
}

#[tokio::test]
async fn a_dropped_handle_stops_claiming_and_lets_the_running_step_commit() {
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), Hooks::default()));
    let config = WorkerConfig { shutdown_grace: Duration::from_secs(3), ..h.config() };
    let ended = Arc::new(AtomicBool::new(false));
    let worker = h.worker(config, SleepsThenFlags(Duration::from_millis(300), Arc::clone(&ended)));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    drop(worker);

    // The claim loop sees the dropped handle as a shutdown: a claim already under way may
    // finish, and then no other goes out, idle or not.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let claims = h.store.calls("instance_claim");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.store.calls("instance_claim"), claims, "a worker whose handle is gone claims");

    // The step that ran is given the grace period, and its result is committed.
    let row = h.wait(id, "committed", |r| r.status == Status::Done).await;
    assert!(ended.load(Ordering::SeqCst));
    assert_eq!((row.attempt, row.lease_owner), (0, None));
}

#[tokio::test]
async fn leases_of_running_steps_are_kept_through_the_shutdown_grace() {
    let h = Harness::new();
    let config = WorkerConfig {
        lease: Duration::from_millis(300),
        heartbeat: Duration::from_millis(100),
        shutdown_grace: Duration::from_secs(5),
        ..h.config()
    };
    let finish = Arc::new(Notify::new());
    let worker = h.worker(config, WaitsFor(Arc::clone(&finish)));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    let stopping = tokio::spawn(worker.shutdown());

    // Twice the lease goes by on the lease clock during the grace, with more than one
    // heartbeat period of real time after each move.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        h.clock.advance(Duration::from_millis(200));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let reaped = h
        .store
        .lease_reap(LeaseReapParams { owner: None, limit: 10, now: h.clock.now() })
        .await
        .unwrap();
    assert_eq!(reaped, vec![], "the lease of a step running through the grace ran out");

    finish.notify_one();
    let stats = tokio::time::timeout(Duration::from_secs(5), stopping)
        .await
        .expect("shutdown ends once the step finished")
        .unwrap();
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0);
    assert_eq!(stats.committed(), 1);
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!((row.status, row.attempt), (Status::Done, 0));
}

#[tokio::test]
async fn a_step_cut_short_by_the_grace_stops_running() {
    let h = Harness::new();
    let config = WorkerConfig { shutdown_grace: Duration::from_millis(50), ..h.config() };
    let ended = Arc::new(AtomicBool::new(false));
    let worker = h.worker(config, SleepsThenFlags(Duration::from_millis(500), Arc::clone(&ended)));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    let stats = worker.shutdown().await;
    assert_eq!(stats.released.load(Ordering::Relaxed), 1);

    // Well past the step's own end: its code was stopped with its lease given back, so
    // it never ran to the end behind another worker that took the instance.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!ended.load(Ordering::SeqCst), "the step ran on after the shutdown");
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!((row.status, row.attempt, row.lease_owner), (Status::Runnable, 0, None));
}

/// A store that fails for a moment as the shutdown gives leases back does not leave them
/// to expire (and the steps to count an attempt they never made): the release is tried
/// again.
#[tokio::test]
async fn a_release_the_store_fails_for_a_moment_is_tried_again() {
    let store = Faulty::new(MemoryStore::new()).failing("lease_release", &[Fault::Error]);
    let h = Harness::with_store(store);
    let config = WorkerConfig { shutdown_grace: Duration::from_millis(50), ..h.config() };
    let ended = Arc::new(AtomicBool::new(false));
    let worker = h.worker(config, SleepsThenFlags(Duration::from_secs(60), Arc::clone(&ended)));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    let stats = worker.shutdown().await;
    assert_eq!(h.store.calls("lease_release"), 2, "one failed release, then one that held");
    assert_eq!(stats.released.load(Ordering::Relaxed), 1);
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!((row.status, row.attempt, row.lease_owner), (Status::Runnable, 0, None));
}

#[tokio::test]
async fn a_result_committing_at_the_end_of_the_grace_keeps_its_lease_and_commits() {
    let store =
        Faulty { commit_delay: Duration::from_millis(300), ..Faulty::new(MemoryStore::new()) };
    let h = Harness::with_store(store);
    let config = WorkerConfig { shutdown_grace: Duration::from_millis(100), ..h.config() };
    let ended = Arc::new(AtomicBool::new(false));
    let worker = h.worker(config, SleepsThenFlags(Duration::from_millis(20), Arc::clone(&ended)));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    // The step finishes within the grace; its group commit is still under way when the
    // grace ends.
    let stats = worker.shutdown().await;
    assert!(ended.load(Ordering::SeqCst));
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0, "the commit found its lease gone");
    assert_eq!(stats.released.load(Ordering::Relaxed), 0);
    assert_eq!(stats.committed(), 1);
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!((row.status, row.attempt), (Status::Done, 0));
}

#[tokio::test]
async fn shutdown_stops_a_long_dead_letter_purge_between_pages() {
    // Every purge page comes back full, as on a huge backlog of old dead letters.
    let hooks = Hooks { purge_full_after: Some(Duration::from_millis(2)), ..Hooks::default() };
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
    // A worker of one namespace purges there whether or not the store lists dead letters.
    let config = WorkerConfig { namespaces: vec!["default".into()], ..h.config() };
    let worker = h.worker(config, WaitsFor(Arc::new(Notify::new())));
    eventually("the purge under way", || h.store.calls("dead_letter_purge") >= 3).await;

    let stats = tokio::time::timeout(Duration::from_secs(3), worker.shutdown()).await;
    assert!(stats.is_ok(), "shutdown waited for the whole purge");
    let purged = h.store.calls("dead_letter_purge");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.store.calls("dead_letter_purge"), purged, "the purge goes on after shutdown");
}
