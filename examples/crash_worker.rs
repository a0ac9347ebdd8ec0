//! `keel-crash-worker`: a worker process for the crash tests. It runs a five-step machine
//! (`five_steps`) and the order chart on the store named on its command line, until it is
//! killed. The tests start it, SIGKILL it at random moments, start it again, and check
//! that nothing was lost and no step was applied twice.
//!
//! Usage: `keel-crash-worker (--sqlite PATH | --postgres URL --schema NAME) [--worker-id ID]
//! [--lease-secs N] [--redis-queue URL NAME]`. Without `--worker-id` it runs under the
//! default worker id, the one a user's worker gets; the lease is 2 s unless `--lease-secs`
//! says otherwise. With `--redis-queue` it receives hints from that Redis queue and runs
//! its repair pass (1 s bound), with store notifications off and polling slowed to 500 ms,
//! so that the queue carries the work.

use async_trait::async_trait;
use keel_core::chart::Timer;
use keel_core::ports::{Queue, Store};
use keel_core::{MachineRef, Outcome, WorkerId};
use keel_examples::order;
use keel_queue_redis::{RedisQueue, RedisQueueConfig};
use keel_scheduler::{
    HintConfig, StepContext, StepError, StepMachine, SystemClock, Worker, WorkerConfig,
};
use keel_store_postgres::{PgConfig, PgStore};
use keel_store_sqlite::SqliteStore;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Five steps, each a little work, each committed before the next.
struct FiveSteps;

#[async_trait]
impl StepMachine for FiveSteps {
    fn machine(&self) -> MachineRef {
        MachineRef::new("five_steps", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let n: u64 = ctx.step.trim_start_matches("step").parse().unwrap_or(0);
        let mut state = ctx.context.clone();
        state[format!("did_{n}")] = json!(true);
        Ok(if n >= 5 {
            Outcome::Done { result: state, step: None }
        } else {
            Outcome::Next { step: format!("step{}", n + 1), context: state }
        })
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// The Redis queue `--redis-queue URL NAME` names, if any.
async fn redis_queue() -> Option<Arc<dyn Queue>> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == "--redis-queue")?;
    let (Some(url), Some(name)) = (args.get(at + 1), args.get(at + 2)) else {
        panic!("--redis-queue URL NAME");
    };
    let queue = RedisQueue::connect(RedisQueueConfig::new(url, name))
        .await
        .unwrap_or_else(|e| panic!("--redis-queue {url} {name}: {e}"));
    Some(Arc::new(queue))
}

/// `worker` receiving hints from `queue`, if there is one.
fn with_queue<S: Store>(
    worker: Worker<S, SystemClock>,
    queue: Option<Arc<dyn Queue>>,
) -> Worker<S, SystemClock> {
    let Some(queue) = queue else { return worker };
    let config = HintConfig {
        wait: Duration::from_millis(100),
        repair_after: Some(Duration::from_secs(1)),
        ..HintConfig::default()
    };
    worker.with_queue(queue, config).0
}

#[tokio::main]
async fn main() {
    let lease_secs = arg("--lease-secs").map_or(2, |s| s.parse().expect("--lease-secs N"));
    let defaults = WorkerConfig::default();
    let config = WorkerConfig {
        worker_id: arg("--worker-id").map_or(defaults.worker_id.clone(), WorkerId),
        queues: vec![("default".into(), 20)],
        lease: Duration::from_secs(lease_secs),
        heartbeat: Duration::from_millis(500),
        reap_interval: Duration::from_millis(200),
        poll_interval: Duration::from_millis(20),
        ..defaults
    };
    let queue = redis_queue().await;
    let config = match queue {
        Some(_) => WorkerConfig {
            notifications: false,
            poll_interval: Duration::from_millis(500),
            ..config
        },
        None => config,
    };
    let machine = || order::machine(Timer::hours(1));
    let _worker = if let Some(path) = arg("--sqlite") {
        let store = Arc::new(SqliteStore::open(&path).await.unwrap_or_else(|e| panic!("{e}")));
        let worker =
            Worker::new(store, SystemClock, config).register(FiveSteps).register(machine());
        with_queue(worker, queue).spawn()
    } else if let (Some(url), Some(schema)) = (arg("--postgres"), arg("--schema")) {
        let store = PgStore::connect(PgConfig::new(url).schema(schema))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let worker = Worker::new(Arc::new(store), SystemClock, config)
            .register(FiveSteps)
            .register(machine());
        with_queue(worker, queue).spawn()
    } else {
        eprintln!(
            "usage: keel-crash-worker (--sqlite PATH | --postgres URL --schema NAME) [--worker-id ID] [--lease-secs N] [--redis-queue URL NAME]"
        );
        std::process::exit(2);
    };
    println!("ready");
    // Runs until killed.
    std::future::pending::<()>().await;
}
