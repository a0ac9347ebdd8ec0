//! `WorkerBuilder::run` serves until SIGTERM, then shuts down gracefully: a step running
//! at that moment finishes and commits within the grace period, and no lease is left.
//! Its own test binary, because it signals its own process.

#![cfg(unix)]

use keel::{Keel, MachineRef, NewInstance, Outcome, Status, StepContext, StepError, StepMachine};
use keel::{WorkerConfig, json};
use std::time::Duration;

/// One slow step, so SIGTERM arrives while it runs.
struct Slow;

#[keel::async_trait]
impl StepMachine for Slow {
    fn machine(&self) -> MachineRef {
        MachineRef::new("slow", 1)
    }

    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(Outcome::Done { result: json!({ "finished": true }), step: None })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_run_after_the_running_step_commits() {
    // Listening for SIGTERM from here on replaces its default action (ending the process),
    // so the signal below cannot kill the test binary even before `run` listens.
    let _listening = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("listen for SIGTERM");
    let keel = Keel::connect("sqlite::memory:").await.unwrap();
    let config =
        WorkerConfig { poll_interval: Duration::from_millis(20), ..WorkerConfig::default() };
    let run = tokio::spawn(keel.worker_with(config).register(Slow).unwrap().run());

    let id = keel.start(NewInstance::new(MachineRef::new("slow", 1), "work")).await.unwrap().id();
    let began = std::time::Instant::now();
    while keel.get(id).await.unwrap().instance.status != Status::Executing {
        assert!(began.elapsed() < Duration::from_secs(10), "the step never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = std::process::id().to_string();
    let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success(), "kill -TERM {pid}");

    let stats = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("run returns after SIGTERM")
        .expect("the run task did not panic")
        .expect("run ends without error");
    assert_eq!(stats.committed(), 1, "the step that was running finished and committed");
    let row = keel.get(id).await.unwrap().instance;
    assert_eq!(row.status, Status::Done);
    assert_eq!(row.lease_owner, None, "no lease left behind");
}
