//! A configuration file given to a `Keel` (`Keel::with_settings`) reaches both halves: the
//! client starts instances in the file's queues and every worker made from that `Keel`
//! serves them. `configured_worker` on such a `Keel` follows the same file, or refuses a
//! different one.

use keel::layers::core::config::KeelConfig;
use keel::{
    Error, Keel, MachineRef, NewInstance, Outcome, Status, StepContext, StepError, StepMachine,
    json,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One step that finishes at once.
struct Greeter;

#[keel::async_trait]
impl StepMachine for Greeter {
    fn machine(&self) -> MachineRef {
        MachineRef::new("greeter", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!("hello"), step: None })
    }
}

fn greet() -> NewInstance {
    NewInstance::new(MachineRef::new("greeter", 1), "greet")
}

/// Writes `text` as a configuration file in `dir`.
fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write the configuration file");
    path
}

fn load(path: &Path) -> KeelConfig {
    keel::settings::load(Some(path)).expect("a valid file").expect("a file was named")
}

const PAYMENTS: &str = "[machines.greeter.queue]\nname = \"payments\"\n";

#[tokio::test]
async fn a_worker_from_a_keel_with_settings_serves_the_queue_its_client_starts_in() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = file(dir.path(), "keel.toml", PAYMENTS);
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(load(&path));
    let worker = keel.worker().register(Greeter).expect("registers").spawn().expect("spawns");

    let id = keel.start(greet()).await.expect("a start").id();
    assert_eq!(keel.get(id).await.expect("read").instance.queue, "payments", "the file's queue");
    let ended = keel.wait_timeout(id, Duration::from_secs(10)).await.expect("a wait");
    let ended = ended.expect("the worker serves the file's queue, so the instance ends");
    assert_eq!(ended.status, Status::Done);
    worker.shutdown().await;
}

#[tokio::test]
async fn configured_worker_follows_the_keels_file_or_refuses_another() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = file(dir.path(), "keel.toml", PAYMENTS);
    let other = file(dir.path(), "other.toml", "[machines.greeter.queue]\nname = \"mail\"\n");
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(load(&path));

    // A different file: the client and the worker would disagree on the queue.
    let Err(e) = keel.configured_worker(keel::WorkerConfig::default(), Some(&other)) else {
        panic!("a second, different file was accepted");
    };
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let message = e.to_string();
    assert!(message.contains(&other.display().to_string()), "names the file: {message}");
    assert!(message.contains("differs from the settings this Keel was given"), "{message}");
    assert!(message.contains("give both the same file"), "the fix: {message}");
    assert!(message.contains("(in [machines.greeter])"), "says where they differ: {message}");

    // The same file, or none named (this test sets no `KEEL_CONFIG`), is the Keel's: its
    // queue is served.
    assert!(std::env::var_os(keel::settings::CONFIG_VAR).is_none(), "run without KEEL_CONFIG");
    for named in [Some(path.as_path()), None] {
        let worker = keel
            .configured_worker(keel::WorkerConfig::default(), named)
            .expect("the Keel's file")
            .register(Greeter)
            .expect("registers")
            .spawn()
            .expect("spawns");
        let id = keel.start(greet()).await.expect("a start").id();
        let ended = keel.wait_timeout(id, Duration::from_secs(10)).await.expect("a wait");
        assert_eq!(ended.expect("served").status, Status::Done, "{named:?}");
        worker.shutdown().await;
    }
}

#[tokio::test]
async fn a_file_workers_cannot_apply_stops_their_spawn() {
    // Parsing accepts it; a worker would not apply a queue's concurrency under a machine.
    let settings =
        KeelConfig::from_toml_str("[machines.greeter.queue]\nconcurrency = 5\n").expect("parses");
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(settings);
    let builder = keel.worker().register(Greeter).expect("registers");
    let Err(e) = builder.spawn() else { panic!("a worker started with a file it cannot apply") };
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let message = e.to_string();
    assert!(message.starts_with("configuration given to `Keel::with_settings`:"), "{message}");
    assert!(message.contains("concurrency"), "names the key: {message}");
}
