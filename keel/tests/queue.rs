//! A connection given a queue of hints (`Keel::with_queue`) wakes its workers through that
//! queue: a worker that neither polls within the test nor listens to the store runs the
//! instance a start made ready and the event a send delivered, on Redis, on SQS and on the
//! in-memory queue. Two connections to one SQLite file stand for two processes, which
//! SQLite cannot wake across.

use keel::queue::{HintConfig, Queue};
use keel::{ChartMachine, Definition, Keel, NewSignal, Status, WorkerConfig, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Fails under `KEEL_REQUIRE_BACKENDS=1`, else says loudly that `test` was skipped.
fn skipped(test: &str, var: &str) {
    assert!(
        std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
        "KEEL_REQUIRE_BACKENDS=1 but {var} is unset; set it to run {test}"
    );
    eprintln!("SKIPPED {test}: set {var} to run it");
}

fn ticket() -> ChartMachine {
    let chart = Definition::builder("ticket", 1)
        .initial("open")
        .state("open", |s| s.on_to("CLOSE", "closed"))
        .final_state("closed")
        .build()
        .expect("valid chart");
    ChartMachine::new(chart)
}

/// Far longer than the test may take: only a hint can wake the worker in time.
const POLL: Duration = Duration::from_secs(120);
const WITHIN: Duration = Duration::from_secs(15);

async fn a_worker_woken_only_by_hints_runs_starts_and_sends(queue: Arc<dyn Queue>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = format!("sqlite://{}", dir.path().join("keel.db").display());
    // No repair pass either: only the announcements themselves can bring the work.
    let hints = HintConfig {
        wait: Duration::from_millis(200),
        repair_after: None,
        ..HintConfig::default()
    };
    let producer = Keel::connect(&url).await.expect("SQLite opens");
    let producer = producer.with_queue(Arc::clone(&queue), hints.clone()).expect("valid hints");
    let consumer = Keel::connect(&url).await.expect("SQLite opens again");
    let consumer = consumer.with_queue(queue, hints).expect("valid hints");

    let config = WorkerConfig {
        notifications: false,
        poll_interval: POLL,
        timers: None,
        retention: None,
        stats_interval: None,
        ..WorkerConfig::named("hinted")
    };
    let builder = consumer.worker_with(config).register(ticket()).expect("registers");
    let stats = builder.hint_stats().expect("a worker from a connection with a queue has one");
    let worker = builder.spawn().expect("starts");
    // Past the worker's first claim, which finds nothing; its next poll is minutes away.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let began = Instant::now();
    let id = producer.start(ticket().new_instance(json!({}))).await.expect("starts").id();
    loop {
        let status = producer.get(id).await.expect("reads").instance.status;
        if !matches!(status, Status::Runnable | Status::Executing) {
            assert_eq!(status, Status::AwaitingSignal, "the chart parks in `open`");
            break;
        }
        assert!(began.elapsed() < WITHIN, "the start's hint did not wake the worker");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    producer.send(NewSignal::new(id, "CLOSE")).await.expect("delivers");
    let ended = producer
        .wait_timeout(id, WITHIN)
        .await
        .expect("reads")
        .expect("the send's hint woke the worker");
    assert_eq!((ended.status, ended.state.to_string()), (Status::Done, "closed".to_owned()));
    assert!(began.elapsed() < WITHIN, "took {:?}", began.elapsed());
    let claimed = stats.claimed.load(Ordering::Relaxed);
    assert!(claimed >= 2, "the start and the send were claimed through hints (got {claimed})");
    worker.shutdown().await;
}

#[tokio::test]
async fn redis_hints_wake_a_worker_across_connections() {
    match keel::queue::redis::testing::fresh_queue().await {
        Some(queue) => a_worker_woken_only_by_hints_runs_starts_and_sends(Arc::new(queue)).await,
        None => skipped("redis_hints_wake_a_worker_across_connections", "KEEL_TEST_REDIS_URL"),
    }
}

#[tokio::test]
async fn sqs_hints_wake_a_worker_across_connections() {
    match keel::queue::sqs::testing::fresh_queue().await {
        Some(queue) => a_worker_woken_only_by_hints_runs_starts_and_sends(Arc::new(queue)).await,
        None => skipped("sqs_hints_wake_a_worker_across_connections", "KEEL_TEST_SQS_ENDPOINT"),
    }
}

/// The same wiring with the in-memory queue, so it runs without any service.
#[tokio::test]
async fn in_memory_hints_wake_a_worker_across_connections() {
    let queue = keel::layers::testkit::MemoryQueue::new();
    a_worker_woken_only_by_hints_runs_starts_and_sends(Arc::new(queue)).await;
}
