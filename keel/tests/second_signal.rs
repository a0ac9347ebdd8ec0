//! `WorkerBuilder::run` and a second stop request: an operator who sends Ctrl-C or
//! SIGTERM again while the graceful shutdown waits for a long step does not wait out the
//! grace period. Its own test binary, because it signals its own process.

#![cfg(unix)]

use keel::{Keel, MachineRef, NewInstance, Outcome, Status, StepContext, StepError, StepMachine};
use keel::{WorkerConfig, json};
use std::time::Duration;

/// One step that runs far longer than anyone waits.
struct Stuck;

#[keel::async_trait]
impl StepMachine for Stuck {
    fn machine(&self) -> MachineRef {
        MachineRef::new("stuck", 1)
    }

    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(Duration::from_secs(600)).await;
        Ok(Outcome::Done { result: json!(null), step: None })
    }
}

/// An operator who sends a second stop request while the graceful shutdown waits for a
/// long step does not wait out the grace period: `run` returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stop_request_ends_the_wait_for_running_steps() {
    let _listening = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("listen for SIGTERM");
    let keel = Keel::connect("sqlite::memory:").await.unwrap();
    let config = WorkerConfig {
        poll_interval: Duration::from_millis(20),
        shutdown_grace: Duration::from_secs(300),
        ..WorkerConfig::default()
    };
    let run = tokio::spawn(keel.worker_with(config).register(Stuck).unwrap().run());
    let id = keel.start(NewInstance::new(MachineRef::new("stuck", 1), "work")).await.unwrap().id();
    let began = std::time::Instant::now();
    while keel.get(id).await.unwrap().instance.status != Status::Executing {
        assert!(began.elapsed() < Duration::from_secs(10), "the step never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = std::process::id().to_string();
    let term = || std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(term().success(), "kill -TERM {pid}");
    // The first request is taken (the worker stops claiming) before the second is sent.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!run.is_finished(), "the graceful shutdown waits for the running step");
    assert!(term().success(), "kill -TERM {pid}");
    let stats = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("run returns after the second SIGTERM, without the 300 s grace")
        .expect("the run task did not panic")
        .expect("run ends without error");
    assert_eq!(stats.committed(), 0, "the long step did not finish");
}
