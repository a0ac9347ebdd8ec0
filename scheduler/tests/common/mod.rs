//! Shared harness for the scheduler's tests: a store (`MemoryStore` unless a test brings
//! another), a `VirtualClock`, a client, and bounded waits.

#![allow(dead_code, clippy::unused_self)]

use keel_core::instance::NewInstance;
use keel_core::ports::Store;
use keel_core::{Instance, InstanceId, Status, Timestamp, WorkerId};
use keel_scheduler::{Client, StepMachine, Worker, WorkerConfig, WorkerHandle};
use keel_testkit::clock::VirtualClock;
use keel_testkit::memory::MemoryStore;
use std::sync::Arc;
use std::time::Duration;

pub const T0: Timestamp = Timestamp(1_700_000_000_000);

pub struct Harness<S: Store = MemoryStore> {
    pub store: Arc<S>,
    pub clock: VirtualClock,
    pub client: Client<S, VirtualClock>,
}

impl Harness<MemoryStore> {
    pub fn new() -> Self {
        Harness::with_store(MemoryStore::new())
    }
}

impl<S: Store> Harness<S> {
    /// A harness over `store` (stores take `now` from the caller, so the virtual clock
    /// drives any backend).
    pub fn with_store(store: S) -> Self {
        let store = Arc::new(store);
        let clock = VirtualClock::new(T0);
        let client = Client::new(Arc::clone(&store), clock.clone());
        Harness { store, clock, client }
    }

    pub fn config(&self) -> WorkerConfig {
        WorkerConfig {
            worker_id: WorkerId("test-worker".into()),
            poll_interval: Duration::from_millis(5),
            reap_interval: Duration::from_millis(10),
            heartbeat: Duration::from_millis(10),
            shutdown_grace: Duration::from_millis(200),
            ..WorkerConfig::default()
        }
    }

    pub fn worker(&self, config: WorkerConfig, machine: impl StepMachine) -> WorkerHandle {
        Worker::new(Arc::clone(&self.store), self.clock.clone(), config).register(machine).spawn()
    }

    pub async fn start(&self, new: NewInstance) -> InstanceId {
        self.client.start(new).await.expect("start").id()
    }

    pub async fn status(&self, id: InstanceId) -> Status {
        self.client.get(id).await.expect("get").instance.status
    }

    /// Polls until `cond` holds for the instance (at most 5 s of real time).
    pub async fn wait(
        &self,
        id: InstanceId,
        what: &str,
        cond: impl Fn(&Instance) -> bool,
    ) -> Instance {
        for _ in 0..1_000 {
            let row = self.client.get(id).await.expect("get").instance;
            if cond(&row) {
                return row;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let row = self.client.get(id).await.expect("get").instance;
        panic!(
            "timed out waiting for {what}; instance is {:?} at {:?} attempt {}",
            row.status, row.position, row.attempt
        );
    }
}
