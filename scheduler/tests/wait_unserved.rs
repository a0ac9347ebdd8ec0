//! A wait on an instance whose machine version no live worker serves says so in a
//! warning, instead of waiting in silence.

mod common;

use async_trait::async_trait;
use common::Harness;
use common::logged::Logged;
use keel_core::instance::NewInstance;
use keel_core::{MachineRef, Outcome};
use keel_scheduler::client::WAIT_UNSERVED_AFTER;
use keel_scheduler::{StepContext, StepError, StepMachine};
use std::time::Duration;

struct Ghost;

#[async_trait]
impl StepMachine for Ghost {
    fn machine(&self) -> MachineRef {
        MachineRef::new("ghost", 1)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: serde_json::json!({}), step: None })
    }
}

#[tokio::test]
async fn a_wait_on_a_version_no_worker_serves_warns_once_naming_the_versions_served() {
    let (logged, _default) = Logged::capture();
    let h = Harness::new();
    let worker = h.worker(h.config(), Ghost);
    let id = h.start(NewInstance::new(MachineRef::new("ghost", 2), "start")).await;
    let waited = h.client.wait_timeout(id, WAIT_UNSERVED_AFTER + Duration::from_secs(1)).await;
    assert_eq!(waited.expect("the wait"), None, "nobody runs v2");
    let text = logged.text();
    let warnings: Vec<&str> =
        text.lines().filter(|l| l.contains("WARN") && l.contains("has been runnable")).collect();
    assert_eq!(warnings.len(), 1, "one warning per wait: {text}");
    assert!(
        warnings[0].contains(&format!(
            "instance {id} has been runnable for 10 s and no live worker serves \"ghost\" v2 in \
             namespace \"default\" (live workers serve \"ghost\" v1 there)"
        )),
        "{}",
        warnings[0]
    );

    // The version the worker serves runs, and its wait says nothing.
    let served = h.start(NewInstance::new(MachineRef::new("ghost", 1), "start")).await;
    let ended = h.client.wait_timeout(served, Duration::from_secs(10)).await.expect("the wait");
    assert!(ended.is_some(), "v1 is served");
    assert!(!logged.text().contains(&format!("instance {served} has been runnable")));
    worker.shutdown().await;
}
