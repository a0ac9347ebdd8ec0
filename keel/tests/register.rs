//! A worker refuses, at registration, a chart that names actions nobody bound, and at
//! start-up one that delegates to a machine nobody serves, naming every missing piece, and
//! settings out of their bounds, naming the field, as errors rather than panics.

use keel::queue::HintConfig;
use keel::{
    ChartMachine, Definition, Error, Keel, MachineRef, NewInstance, Outcome, RegistrationError,
    StepContext, StepError, StepMachine, SweepConfig, WorkerConfig, json,
};
use std::time::Duration;

fn chart() -> Definition {
    Definition::builder("claim", 2)
        .initial("filed")
        .state("filed", |s| s.entry("notify").on("REVIEW", |t| t.target("review").action("assign")))
        .state("review", |s| s.machine("assessment").on_done(|b| b.target("paid").action("pay")))
        .final_state("paid")
        .build()
        .expect("valid chart")
}

async fn keel() -> Keel {
    Keel::connect("sqlite::memory:").await.expect("SQLite in memory opens")
}

fn check(result: Result<impl Sized, RegistrationError>, machine: &str, missing: &[&str]) {
    let Err(error) = result else { panic!("{machine}: expected a registration error") };
    assert_eq!(error.machine, machine);
    assert_eq!(error.missing, missing);
    let message = error.to_string();
    for name in missing {
        assert!(message.contains(name), "the message names {name}: {message}");
    }
    assert!(message.contains("Fix:"), "the message says how to fix it: {message}");
}

#[tokio::test]
async fn register_lists_every_unbound_action() {
    let keel = keel().await;
    let machine = ChartMachine::new(chart()).action("assign", |_, _| async { Ok(()) });
    let result = keel.worker().register(machine);
    check(result, "claim v2", &["action `notify`", "action `pay`"]);
}

#[tokio::test]
async fn spawn_lists_every_delegated_machine_nobody_serves() {
    let keel = keel().await;
    let machine = ChartMachine::new(chart())
        .action("assign", |_, _| async { Ok(()) })
        .action("notify", |_, _| async { Ok(()) })
        .action("pay", |_, _| async { Ok(()) });
    let builder = keel.worker().register(machine.clone()).expect("every action is bound");
    let Err(Error::Registration(error)) = builder.spawn() else { panic!("a registration error") };
    check(Err::<(), _>(error), "claim v2", &["delegated machine `assessment` v1"]);

    // Declared as served by another worker, it starts.
    let worker = keel.worker().register(machine).unwrap().served_elsewhere("assessment");
    worker.spawn().expect("starts").shutdown().await;
}

/// A payment machine in version 2 only.
struct PaymentV2;

#[keel::async_trait]
impl StepMachine for PaymentV2 {
    fn machine(&self) -> MachineRef {
        MachineRef::new("payment", 2)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

fn checkout() -> ChartMachine {
    let def = Definition::builder("checkout", 1)
        .initial("paying")
        .state("paying", |s| s.machine("payment").on_done(|b| b.target("paid")))
        .final_state("paid")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

/// A chart's children run `payment` v1 unless it says otherwise: a worker that serves
/// only v2 would start children nobody claims, and the parent would wait forever.
#[tokio::test]
async fn spawn_refuses_a_delegated_machine_served_only_in_another_version() {
    let keel = keel().await;
    let builder = keel.worker().register(checkout()).unwrap().register(PaymentV2).unwrap();
    let Err(Error::Registration(error)) = builder.spawn() else {
        panic!("payment v1 is not served: a registration error")
    };
    let message = error.to_string();
    assert_eq!(error.machine, "checkout v1", "{message}");
    assert_eq!(error.missing.len(), 1, "{message}");
    assert!(error.missing[0].starts_with("delegated machine `payment` v1 ("), "{message}");
    for part in [
        "chart `checkout`",
        "registers `payment` v2 only",
        "with_child_version(\"payment\", 2)",
        "register `payment` v1",
        "Fix:",
    ] {
        assert!(message.contains(part), "the message says {part:?}: {message}");
    }

    // The version it serves, or declared as served elsewhere: it starts.
    let chart = checkout().with_child_version("payment", 2);
    let worker = keel.worker().register(chart).unwrap().register(PaymentV2).unwrap();
    worker.spawn().expect("payment v2 is served").shutdown().await;
    let worker = keel.worker().register(checkout()).unwrap().register(PaymentV2).unwrap();
    let worker = worker.served_elsewhere("payment");
    worker.spawn().expect("payment is served elsewhere").shutdown().await;
}

/// `with_child_version` and `with_child_queue` for a machine the chart does not delegate
/// to (a typo) would do nothing; the chart is refused, with the name it likely means.
#[tokio::test]
async fn child_settings_for_a_machine_the_chart_does_not_start_are_refused() {
    let keel = keel().await;
    let cases = [
        (checkout().with_child_version("paymnet", 2), "with_child_version"),
        (checkout().with_child_queue("paymnet", "payments"), "with_child_queue"),
    ];
    for (chart, call) in cases {
        let Err(error) = keel.worker().register(chart) else { panic!("{call}: refused") };
        let message = error.to_string();
        assert_eq!(error.machine, "checkout v1", "{message}");
        assert_eq!(error.missing.len(), 1, "{message}");
        for part in ["`paymnet`", call, "did you mean `payment`?"] {
            assert!(message.contains(part), "the message says {part:?}: {message}");
        }
    }
}

/// `start` takes one instance: its error names the field as the caller wrote it, without
/// the batch's `instances[0].`, as `send` does for its signal.
#[tokio::test]
async fn a_single_start_error_names_the_field_without_the_batch_prefix() {
    let keel = keel().await;
    let error = keel.start(NewInstance::new(MachineRef::new("order", 1), "")).await.unwrap_err();
    assert_eq!(error.message, "position: must not be empty");
    let error =
        keel.start_many(vec![NewInstance::new(MachineRef::new("order", 1), "")]).await.unwrap_err();
    assert_eq!(error.message, "instances[0].position: must not be empty", "a batch keeps it");
}

#[tokio::test]
async fn a_chart_guard_nobody_registered_is_refused_when_the_definition_is_built() {
    let built = Definition::builder("claim", 1)
        .initial("a")
        .state("a", |s| {
            s.on("GO", |t| t.guard("approved").target("b")).on("X", |t| t.guard("vip").target("b"))
        })
        .final_state("b")
        .build();
    let message = built.expect_err("unknown guards").to_string();
    assert!(message.contains("`approved`") && message.contains("`vip`"), "{message}");
}

#[tokio::test]
async fn unknown_urls_say_which_ones_work() {
    let error = Keel::connect("mysql://root@localhost/db").await.expect_err("not a Keel backend");
    assert_eq!(
        error.to_string(),
        "cannot use the store URL \"mysql://root@localhost/db\": unknown scheme; use `sqlite://<file>`, `sqlite::memory:`, `postgres://…` or `memory://`"
    );
}

#[tokio::test]
async fn worker_settings_out_of_bounds_are_errors_that_name_the_field() {
    let keel = keel().await;
    let d = WorkerConfig::default();
    let cases = [
        (WorkerConfig { lease: Duration::ZERO, ..d.clone() }, "lease: must be more than zero"),
        (
            WorkerConfig { heartbeat: Duration::from_secs(30), ..d.clone() },
            "heartbeat: must be shorter than lease",
        ),
        (WorkerConfig { poll_interval: Duration::ZERO, ..d.clone() }, "poll_interval: must be"),
        (WorkerConfig { claim_batch: 0, ..d.clone() }, "claim_batch: must be 1 to 1000 (got 0)"),
        (
            WorkerConfig { queues: vec![("default".into(), 0)], ..d.clone() },
            "queues[0] (default): concurrency must be 1 to 10000 (got 0)",
        ),
        (
            WorkerConfig { queues: vec![("a".into(), 1), ("a".into(), 2)], ..d.clone() },
            "queues[1]: queue \"a\" is listed twice",
        ),
        (WorkerConfig { stats_interval: Some(Duration::ZERO), ..d.clone() }, "None turns it off"),
        (
            WorkerConfig { shutdown_grace: Duration::MAX, ..d.clone() },
            "shutdown_grace: must be at most 366 days",
        ),
        (
            WorkerConfig { commit_interval: Duration::MAX, ..d.clone() },
            "commit_interval: must be at most 366 days",
        ),
        (
            WorkerConfig { worker_id: keel::layers::core::WorkerId(String::new()), ..d.clone() },
            "worker_id: must not be empty; WorkerConfig::named",
        ),
        (
            WorkerConfig { timers: Some(SweepConfig { batch: 0, ..SweepConfig::default() }), ..d },
            "timers.batch: must be 1 to",
        ),
    ];
    for (config, expected) in cases {
        let Err(error) = keel.worker_with(config).spawn() else {
            panic!("expected a settings error containing {expected:?}")
        };
        assert!(matches!(error, Error::Settings(_)), "{error}");
        let message = error.to_string();
        assert!(message.contains(expected), "{message:?} names {expected:?}");
    }

    let zero = HintConfig { wait: Duration::ZERO, ..HintConfig::default() };
    let queue = std::sync::Arc::new(keel::layers::testkit::MemoryQueue::new());
    let error = keel.clone().with_queue(queue.clone(), zero.clone()).expect_err("a zero wait");
    assert!(error.to_string().starts_with("invalid HintConfig: wait: must be more"), "{error}");
    let error = keel.worker().with_queue(queue, zero).err().expect("a zero wait");
    assert!(error.to_string().contains("wait: must be more than zero"), "{error}");
}

/// A `(name, version)` registered twice is refused at the second registration, naming
/// the machine and its version, as a registration error (not a settings one at spawn).
#[tokio::test]
async fn a_machine_version_registered_twice_is_a_registration_error() {
    let keel = keel().await;
    let once = keel.worker().register(Counter).expect("the first registration");
    let Err(error) = once.register(Counter) else { panic!("registered twice") };
    assert_eq!(error.machine, "counter v1");
    let message = error.to_string();
    assert!(message.contains("counter v1") && message.contains("registered"), "{message}");
    let as_error: Error = error.into();
    assert!(matches!(as_error, Error::Registration(_)), "{as_error:?}");
}

/// Counts its steps; each takes a while.
struct Counter;

static COUNTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[keel::async_trait]
impl StepMachine for Counter {
    fn machine(&self) -> MachineRef {
        MachineRef::new("counter", 1)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        COUNTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

/// Two workers of one `Keel` with the default id: the second is numbered, so its start
/// leaves the first's live lease alone and the step runs once.
#[tokio::test]
async fn two_default_workers_of_one_keel_run_a_step_once() {
    let keel = keel().await;
    let id = keel.start(NewInstance::new(MachineRef::new("counter", 1), "go")).await.unwrap().id();
    let fast =
        || WorkerConfig { poll_interval: Duration::from_millis(10), ..WorkerConfig::default() };
    let first = keel.worker_with(fast()).register(Counter).unwrap().spawn().unwrap();
    for _ in 0..500 {
        if COUNTED.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = keel.worker_with(fast()).register(Counter).unwrap().spawn().unwrap();
    keel.wait_timeout(id, Duration::from_secs(5)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    second.shutdown().await;
    first.shutdown().await;
    assert_eq!(keel.get(id).await.unwrap().instance.status, keel::Status::Done);
    assert_eq!(COUNTED.load(std::sync::atomic::Ordering::SeqCst), 1, "the step ran once");
}
