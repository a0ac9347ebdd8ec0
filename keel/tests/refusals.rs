//! What is refused early and how it is said: a worker configuration that carries a
//! settings file other than its `Keel`'s, a machine whose configuration in code cannot
//! apply (at `register`), and a wait on an instance that is not there.

use keel::layers::core::config::QueueConfig;
use keel::{
    Error, InstanceId, Keel, KeelConfig, MachineRef, Outcome, StepContext, StepError, StepMachine,
    WorkerConfig,
};
use std::time::Duration;

struct Greeter(QueueConfig);

#[keel::async_trait]
impl StepMachine for Greeter {
    fn machine(&self) -> MachineRef {
        MachineRef::new("greeter", 1)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::done_with(&keel::json!({}))?)
    }
    fn config(&self) -> QueueConfig {
        self.0
    }
}

fn file(queue: &str) -> KeelConfig {
    KeelConfig::from_toml_str(&format!("[machines.greeter.queue]\nname = \"{queue}\"\n"))
        .expect("parses")
}

#[tokio::test]
async fn a_worker_config_with_a_file_other_than_the_keels_is_refused() {
    let keel =
        Keel::connect("sqlite::memory:").await.expect("opens").with_settings(file("payments"));
    let own = WorkerConfig::default().with_settings(file("mail")).expect("applies");

    let builder = keel.worker_with(own.clone()).register(Greeter(QueueConfig::default()));
    let Err(e) = builder.expect("registers").spawn() else {
        panic!("a worker with a file of its own started")
    };
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let message = e.to_string();
    assert!(
        message.starts_with(
            "configuration `WorkerConfig::settings`: differs from the settings this Keel was \
             given with `Keel::with_settings` (in [machines.greeter])"
        ),
        "{message}"
    );
    assert!(message.contains("give both the same file"), "the fix: {message}");

    let Err(e) = keel.configured_worker(own, None) else {
        panic!("configured_worker took a file of the config's own")
    };
    assert!(e.to_string().contains("(in [machines.greeter])"), "{e}");

    // The Keel's own file carried by the config is no conflict.
    let same = WorkerConfig::default().with_settings(file("payments")).expect("applies");
    let worker = keel.worker_with(same).register(Greeter(QueueConfig::default())).unwrap();
    worker.spawn().expect("the same file").shutdown().await;
}

#[tokio::test]
async fn register_refuses_a_machine_configuration_in_code_that_cannot_apply() {
    let keel = Keel::connect("sqlite::memory:").await.expect("opens");
    let zero = QueueConfig { timeout: Duration::ZERO, ..QueueConfig::default() };
    let Err(e) = keel.worker().register(Greeter(zero)) else { panic!("a zero timeout") };
    assert_eq!(e.machine, "greeter v1");
    assert_eq!(
        e.to_string(),
        "machine greeter v1 cannot run on this worker; missing: invalid configuration in code: \
         QueueConfig.timeout: must be greater than zero, e.g. \"30 seconds\"."
    );

    let one = QueueConfig { concurrency: 1, ..QueueConfig::default() };
    let Err(e) = keel.worker().register(Greeter(one)) else { panic!("a concurrency in code") };
    let message = e.to_string();
    assert!(message.contains("its QueueConfig sets `concurrency`"), "{message}");
    assert!(message.contains("Fix: concurrency belongs to a queue"), "{message}");
}

#[tokio::test]
async fn a_wait_on_a_missing_instance_says_what_to_check() {
    let keel = Keel::connect("sqlite::memory:").await.expect("opens");
    let e = keel.wait_timeout(InstanceId(4242), Duration::from_secs(1)).await.expect_err("none");
    assert_eq!(e.kind, keel::ErrorKind::NotFound);
    assert!(
        e.message.starts_with("no instance i4242; check the id (`keel list MACHINE`"),
        "{}",
        e.message
    );
}
