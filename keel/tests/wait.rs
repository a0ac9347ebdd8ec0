//! Waiting for results through the facade, on every store: an instance that finishes, one
//! that fails, one that is cancelled, one still running when the wait times out; `?` on
//! an IO error inside a step retries it; a non-retryable error does not.

use keel::layers::core::config::QueueConfig;
use keel::layers::core::retry::RetryPolicy;
use keel::{
    Cancel, ChartMachine, Definition, Keel, MachineRef, NewInstance, NewSignal, NonRetryable,
    Outcome, Status, StepContext, StepError, StepMachine, WorkerConfig, json,
};
use std::time::{Duration, Instant};

/// Every store this test can reach: MemoryStore, SQLite (in memory), and PostgreSQL on a
/// fresh schema when `KEEL_TEST_DATABASE_URL` is set.
async fn keels(test: &str) -> Vec<Keel> {
    let mut all = vec![
        Keel::from_store(keel_testkit::MemoryStore::new()),
        Keel::connect("sqlite::memory:").await.expect("SQLite in memory opens"),
    ];
    let url = keel_store_postgres::testing::database_url();
    if let Some(url) = url {
        let schema = keel_store_postgres::testing::unique_schema();
        let options = keel::ConnectOptions::default().schema(schema).pool_size(4);
        all.push(Keel::connect_with(&url, options).await.expect("PostgreSQL connects"));
    } else {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run {test}"
        );
        eprintln!("SKIPPED postgres part of {test}: set KEEL_TEST_DATABASE_URL to run it");
    }
    all
}

fn config() -> WorkerConfig {
    WorkerConfig { poll_interval: Duration::from_millis(20), ..WorkerConfig::default() }
}

fn ticket() -> ChartMachine {
    let chart = Definition::builder("ticket", 1)
        .initial("open")
        .state("open", |s| s.on_to("CLOSE", "closed"))
        .state("closed", |s| s.entry("stamp").on_to("ARCHIVE", "archived"))
        .final_state("archived")
        .build()
        .expect("valid chart");
    ChartMachine::new(chart).action("stamp", |ctx, _| async move {
        ctx.set("stamped", true);
        Ok(())
    })
}

/// A claim whose review is delegated to the `assessor` machine: `@done` approves it,
/// `@fail` rejects it.
fn claim() -> ChartMachine {
    let chart = Definition::builder("claim", 1)
        .initial("review")
        .state("review", |s| {
            s.machine("assessor")
                .on_done(|b| b.target("approved"))
                .on_fail(|b| b.target("rejected"))
        })
        .final_state("approved")
        .final_state("rejected")
        .build()
        .expect("valid chart");
    ChartMachine::new(chart)
}

/// The delegated child machine: it always gives up.
struct Assessor;

#[keel::async_trait]
impl StepMachine for Assessor {
    fn machine(&self) -> MachineRef {
        MachineRef::new("assessor", 1)
    }

    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Stop { reason: "the assessor found no cover".into() })
    }
}

/// Steps named after what they do to the instance.
struct Steps;

#[keel::async_trait]
impl StepMachine for Steps {
    fn machine(&self) -> MachineRef {
        MachineRef::new("steps", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        match ctx.step.as_str() {
            "stop" => Ok(Outcome::Stop { reason: "the order is invalid".into() }),
            "park" => Ok(Outcome::Await { signal: "NEVER".into(), context: json!({}), step: None }),
            "read" => {
                // The first attempt reads a file that is not there: an io::Error, through `?`.
                let path = if ctx.attempt == 0 { "/no/such/keel/file" } else { "/dev/null" };
                let text = std::fs::read_to_string(path)?;
                Ok(Outcome::Done {
                    result: json!({ "attempt": ctx.attempt, "len": text.len() }),
                    step: None,
                })
            }
            "parse" => {
                let port: u16 = "not a number".parse().non_retryable()?;
                Ok(Outcome::Done { result: json!({ "port": port }), step: None })
            }
            other => Err(StepError::fatal(format!("unknown step {other}"))),
        }
    }

    fn config(&self) -> QueueConfig {
        let retry = RetryPolicy {
            max_attempts: 3,
            initial_delay: Duration::from_millis(10),
            ..RetryPolicy::default()
        };
        QueueConfig { retry, ..QueueConfig::default() }
    }
}

fn start(step: &str) -> NewInstance {
    NewInstance::new(MachineRef::new("steps", 1), step)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_reports_how_each_instance_ended_on_every_store() {
    for keel in keels("wait_reports_how_each_instance_ended_on_every_store").await {
        let store = keel.describe().to_owned();
        let worker =
            keel.worker_with(config()).register(ticket()).unwrap().register(Steps).unwrap();
        let worker = worker.register(claim()).unwrap().register(Assessor).unwrap();
        let worker = worker.spawn().unwrap();

        // Done: the final configuration and the result context.
        let id = keel.start(ticket().new_instance(json!({ "n": 1 }))).await.unwrap().id();
        keel.send_many(vec![NewSignal::new(id, "CLOSE"), NewSignal::new(id, "ARCHIVE")])
            .await
            .unwrap();
        let ended = keel.wait(id).await.unwrap();
        assert_eq!(ended.status, Status::Done, "{store}");
        assert!(
            ended.state.matches("archived") && !ended.state.matches("closed"),
            "{store}: {:?}",
            ended.state
        );
        assert_eq!(ended.result, Some(json!({ "n": 1, "stamped": true })), "{store}");
        assert_eq!(ended.error, None, "{store}");

        // Failed: the reason is the last error. `Duration::MAX`, "no limit", waits as
        // `wait` does (it once overflowed the clock and panicked).
        let id = keel.start(start("stop")).await.unwrap().id();
        let ended = keel.wait_timeout(id, Duration::MAX).await.unwrap().expect("ends");
        assert_eq!(ended.status, Status::Failed, "{store}");
        assert_eq!(ended.error.as_deref(), Some("the order is invalid"), "{store}");
        assert_eq!(ended.result, None, "{store}");

        // A chart whose delegated machine failed: its `@fail` branch leads to a final state.
        let id = keel.start(claim().new_instance(json!({}))).await.unwrap().id();
        let ended = keel.wait_timeout(id, Duration::from_secs(20)).await.unwrap().expect("ends");
        assert_eq!(ended.status, Status::Done, "{store}");
        assert_eq!(ended.state.to_string(), "rejected", "{store}");

        // Still running: the wait times out after about its bound and says so.
        let parked = keel.start(start("park")).await.unwrap().id();
        let began = Instant::now();
        let waited = keel.wait_timeout(parked, Duration::from_millis(300)).await.unwrap();
        assert!(waited.is_none(), "{store}: a parked instance has not ended");
        let took = began.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{store}: {took:?}"
        );
        assert!(keel.state(parked).await.unwrap().matches("park"), "{store}");

        // Cancelled, while someone waits: the waiter wakes with the reason.
        let waiter = {
            let client = keel.client().clone();
            tokio::spawn(async move { client.wait_timeout(parked, Duration::from_secs(20)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        keel.cancel(Cancel::new(parked).reason("customer left")).await.unwrap();
        let ended = waiter.await.unwrap().unwrap().expect("the cancel ends the wait");
        assert_eq!(ended.status, Status::Cancelled, "{store}");
        assert_eq!(ended.error.as_deref(), Some("customer left"), "{store}");

        // A missing instance is an error, not an endless wait.
        let missing = keel.wait_timeout(keel::InstanceId(999_999), Duration::from_secs(1)).await;
        assert_eq!(missing.unwrap_err().kind, keel::ErrorKind::NotFound, "{store}");
        worker.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_io_error_through_question_mark_is_retried_and_a_non_retryable_one_is_not() {
    for keel in keels("an_io_error_through_question_mark_is_retried").await {
        let store = keel.describe().to_owned();
        let worker = keel.worker_with(config()).register(Steps).unwrap().spawn().unwrap();

        let id = keel.start(start("read")).await.unwrap().id();
        let ended = keel.wait_timeout(id, Duration::from_secs(20)).await.unwrap().expect("ends");
        assert_eq!(ended.status, Status::Done, "{store}");
        assert_eq!(ended.result, Some(json!({ "attempt": 1, "len": 0 })), "{store}: retried once");

        // Not retried: the first failure is dead-lettered and the instance suspended.
        let id = keel.start(start("parse")).await.unwrap().id();
        let began = Instant::now();
        let row = loop {
            let row = keel.get(id).await.unwrap().instance;
            if row.status == Status::Suspended || began.elapsed() > Duration::from_secs(20) {
                break row;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(row.status, Status::Suspended, "{store}");
        assert_eq!(row.errors.len(), 1, "{store}: one attempt only: {:?}", row.errors);
        assert!(row.last_error.unwrap_or_default().contains("invalid digit"), "{store}");
        worker.shutdown().await;
    }
}

/// A process that leaves migrating to someone else and connects to a schema nothing was
/// migrated into is refused at connect, told to run `keel migrate`, instead of failing at
/// its first query with "relation does not exist".
#[tokio::test]
async fn connecting_without_migrating_to_an_empty_schema_says_to_migrate() {
    let Some(url) = keel_store_postgres::testing::database_url() else {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset"
        );
        eprintln!("SKIPPED connecting_without_migrating: set KEEL_TEST_DATABASE_URL to run it");
        return;
    };
    let schema = keel_store_postgres::testing::unique_schema();
    let unmigrated = keel::ConnectOptions::default().schema(&schema).pool_size(1).migrate(false);
    let Err(e) = Keel::connect_with(&url, unmigrated.clone()).await else {
        panic!("a schema with no Keel tables was accepted");
    };
    let message = e.to_string();
    assert!(message.contains("holds no Keel tables"), "{message}");
    assert!(message.contains("run `keel migrate`"), "{message}");
    // Once migrated, the same options connect.
    let migrated = keel::ConnectOptions::default().schema(&schema).pool_size(1);
    drop(Keel::connect_with(&url, migrated).await.expect("migrating connect"));
    Keel::connect_with(&url, unmigrated).await.expect("a migrated schema is accepted");
}
