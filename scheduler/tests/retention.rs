//! Retention run by a worker's pruner under a virtual clock: ended instances older than
//! the retention go (with their history), younger and live ones stay, a machine's own
//! retention wins, dead letters go after their machine's `dead_letter.retention` (the
//! configuration file's, when it sets one, over the code's), and each instance's history
//! is trimmed to the newest `history_per_instance` entries.
//! `memory::*` on `MemoryStore`, `postgres::*` on PostgreSQL (a fresh schema per test).

#[macro_use]
mod common;

use async_trait::async_trait;
use common::{Harness, TestStore};
use keel_core::config::QueueConfig;
use keel_core::ids::MachineRef;
use keel_core::instance::NewInstance;
use keel_core::ports::Store;
use keel_core::retention::{MachineRetention, RetentionConfig};
use keel_core::{ErrorKind, InstanceId, Outcome, Status};
use keel_scheduler::{
    Cancel, DeadLetterRetry, StepContext, StepError, StepMachine, Worker, WorkerConfig,
    WorkerHandle,
};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

on_every_store!(
    the_pruner_removes_exactly_the_instances_ended_before_the_retention,
    dead_letters_go_after_their_machine_retention,
    the_files_dead_letter_retention_wins_over_the_code,
    a_worker_of_every_namespace_purges_dead_letters_in_every_namespace,
    a_worker_purges_the_dead_letters_of_machines_its_file_names_only,
    history_is_trimmed_to_the_newest_entries_per_instance,
    a_worker_prunes_only_the_namespaces_it_serves,
    shutdown_waits_for_one_prune_page_not_the_whole_run,
);

const HOUR: Duration = Duration::from_secs(3_600);

/// Finishes at once, or fails for good when the context says so.
struct Quick(&'static str);

#[async_trait]
impl StepMachine for Quick {
    fn machine(&self) -> MachineRef {
        MachineRef::new(self.0, 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if ctx.context["fail"] == json!(true) {
            return Err(StepError::fatal("refused"));
        }
        Ok(Outcome::Done { result: json!({}), step: None })
    }

    fn config(&self) -> QueueConfig {
        let mut config = QueueConfig::default();
        config.dead_letter.retention = 2 * HOUR;
        config
    }
}

fn retention(ended: Duration) -> RetentionConfig {
    RetentionConfig {
        ended: Some(ended),
        interval: Duration::from_millis(20),
        batch: 3,
        pause: Duration::ZERO,
        ..RetentionConfig::default()
    }
}

async fn finished<S: Store>(h: &Harness<S>, machine: &str, n: usize) -> Vec<InstanceId> {
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(h.start(NewInstance::new(MachineRef::new(machine, 1), "go")).await);
    }
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    ids
}

async fn gone<S: Store>(h: &Harness<S>, id: InstanceId) -> bool {
    match h.client.get(id).await {
        Ok(_) => false,
        Err(e) if e.kind == ErrorKind::NotFound => true,
        Err(e) => panic!("get {id}: {e}"),
    }
}

/// Waits (bounded) until the pruner completed `runs` more runs than `before`.
async fn runs_after(worker: &WorkerHandle, before: u64, runs: u64) {
    for _ in 0..500 {
        if worker.pruned().runs >= before + runs {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the pruner did not run {runs} more times within 5 s: {:?}", worker.pruned());
}

async fn the_pruner_removes_exactly_the_instances_ended_before_the_retention<S: TestStore>() {
    let h = S::harness().await;
    let mut config = WorkerConfig { retention: Some(retention(24 * HOUR)), ..h.config() };
    // `brief` keeps its ended instances one hour only.
    let own = MachineRetention { ended: Some(HOUR), ..MachineRetention::default() };
    config.retention.as_mut().unwrap().machines.insert("brief".into(), own);
    let worker =
        keel_scheduler::Worker::new(std::sync::Arc::clone(&h.store), h.clock.clone(), config)
            .register(Quick("quick"))
            .register(Quick("brief"))
            .spawn();
    let old = finished(&h, "quick", 7).await;
    let brief = finished(&h, "brief", 2).await;
    h.clock.advance(12 * HOUR);
    let young = finished(&h, "quick", 4).await;
    let live = h.start(NewInstance::new(MachineRef::new("idle", 1), "wait")).await;
    // 12 h later: `old` ended 24 h + 1 s ago, `young` 12 h + 1 s ago; `brief` long past 1 h.
    h.clock.advance(12 * HOUR + Duration::from_secs(1));
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    for id in old.iter().chain(&brief) {
        assert!(gone(&h, *id).await, "{id} ended before the retention: pruned");
    }
    for id in young.iter().chain([&live]) {
        assert!(!gone(&h, *id).await, "{id} kept");
    }
    let counts = worker.pruned();
    assert_eq!(counts.instances, 9, "{counts:?}");
    assert!(counts.history >= 9, "their history went too: {counts:?}");
    worker.shutdown().await;
}

/// A worker with `config` (pruning every 20 ms, nothing ended pruned) over a `quick`
/// instance that failed for good: returns once its one dead letter is written, with the
/// instance (suspended).
async fn one_dead_letter<S: TestStore>(
    h: &Harness<S>,
    file: Option<keel_core::config::KeelConfig>,
) -> (WorkerHandle, InstanceId) {
    let every =
        RetentionConfig { interval: Duration::from_millis(20), ..RetentionConfig::default() };
    let mut config = WorkerConfig { retention: Some(every), ..h.config() };
    if let Some(file) = file {
        config = config.with_settings(file).expect("applied");
    }
    let worker = h.worker(config, Quick("quick"));
    let id = h
        .start(NewInstance::new(MachineRef::new("quick", 1), "go").context(json!({ "fail": true })))
        .await;
    h.wait(id, "dead-lettered", |r| r.status == Status::Suspended).await;
    (worker, id)
}

/// An operator gives up on `id`: its letter then only records what happened.
async fn give_up<S: TestStore>(h: &Harness<S>, id: InstanceId) {
    h.client.cancel(Cancel::new(id).reason("gave up")).await.expect("cancel");
}

/// How many dead letters the store holds (at most 10).
async fn letters<S: TestStore>(h: &Harness<S>) -> usize {
    let filter = keel_core::ports::store::DeadLetterFilter { limit: 10, ..Default::default() };
    h.client.dead_letters(filter).await.expect("dead letters").len()
}

async fn dead_letters_go_after_their_machine_retention<S: TestStore>() {
    let h = S::harness().await;
    // No `ended`: instances are kept; dead letters still go after their retention.
    let (worker, id) = one_dead_letter(&h, None).await;
    let before = worker.pruned().runs;
    runs_after(&worker, before, 1).await;
    assert_eq!(letters(&h).await, 1, "younger than its retention");
    // The machine keeps dead letters two hours; the instance is still suspended, and its
    // letter is how it is retried, so it stays.
    h.clock.advance(2 * HOUR + Duration::from_secs(1));
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert_eq!(letters(&h).await, 1, "kept: its instance is still suspended");
    let retried = h.client.dead_letter_retry(DeadLetterRetry::machine("quick")).await;
    assert_eq!(retried.expect("retry"), [id], "the old letter still retries its instance");
    h.wait(id, "dead-lettered again", |r| r.status == Status::Suspended).await;
    // Given up on, its new letter goes once past the retention.
    give_up(&h, id).await;
    h.clock.advance(2 * HOUR + Duration::from_secs(1));
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert_eq!(letters(&h).await, 0, "purged after its retention");
    assert_eq!(worker.pruned().dead_letters, 1);
    worker.shutdown().await;
}

async fn the_files_dead_letter_retention_wins_over_the_code<S: TestStore>() {
    let h = S::harness().await;
    // The code keeps dead letters two hours; the file says ten minutes for this machine.
    let file = keel_core::config::KeelConfig::load(
        "[machines.quick.queue.dead_letter]\nretention = \"10 minutes\"",
        |_| None,
    )
    .expect("valid file")
    .0;
    let (worker, id) = one_dead_letter(&h, Some(file)).await;
    give_up(&h, id).await;
    h.clock.advance(Duration::from_secs(9 * 60));
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert_eq!(letters(&h).await, 1, "younger than the file's ten minutes");
    h.clock.advance(Duration::from_secs(61));
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert_eq!(letters(&h).await, 0, "purged after the file's retention, not the code's two hours");
    assert_eq!(worker.pruned().dead_letters, 1);
    worker.shutdown().await;
}

async fn a_worker_of_every_namespace_purges_dead_letters_in_every_namespace<S: TestStore>() {
    let h = S::harness().await;
    // The default: the worker claims from every namespace.
    let every =
        RetentionConfig { interval: Duration::from_millis(20), ..RetentionConfig::default() };
    let config = WorkerConfig { retention: Some(every), ..h.config() };
    assert!(config.namespaces.is_empty());
    let worker = h.worker(config, Quick("quick"));
    for namespace in ["other", "default"] {
        let failing = NewInstance::new(MachineRef::new("quick", 1), "go")
            .namespace(namespace)
            .context(json!({ "fail": true }));
        let id = h.start(failing).await;
        h.wait(id, "dead-lettered", |r| r.status == Status::Suspended).await;
        give_up(&h, id).await;
    }
    assert_eq!(letters(&h).await, 2);
    // Past the machine's two hours: the letters of both namespaces go.
    h.clock.advance(2 * HOUR + Duration::from_secs(1));
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert_eq!(letters(&h).await, 0, "a dead letter outside namespace default was kept");
    assert_eq!(worker.pruned().dead_letters, 2);
    worker.shutdown().await;
}

/// The instances whose dead letters the store holds (at most 10), oldest letter first.
async fn lettered<S: TestStore>(h: &Harness<S>) -> Vec<InstanceId> {
    let filter = keel_core::ports::store::DeadLetterFilter { limit: 10, ..Default::default() };
    let letters = h.client.dead_letters(filter).await.expect("dead letters");
    letters.iter().map(|l| l.letter.instance).collect()
}

/// A machine no pruning worker registers (served by HTTP workers, say) has its dead
/// letters purged by a worker whose configuration file names it with a dead-letter
/// retention; a machine it neither registers nor names keeps its letters, under no
/// default of this worker's (neither the file's system level nor the built-in seven
/// days), and a letter whose instance is still suspended stays as ever.
async fn a_worker_purges_the_dead_letters_of_machines_its_file_names_only<S: TestStore>() {
    let h = S::harness().await;
    // Another worker, pruning nothing, runs `remote` and `stranger` and dead-letters
    // three of their instances; two are given up on.
    let other = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(Quick("remote"))
        .register(Quick("stranger"));
    let other = h.hinted(other).spawn();
    let failing = |machine: &str| {
        NewInstance::new(MachineRef::new(machine, 1), "go").context(json!({ "fail": true }))
    };
    let remote = h.start(failing("remote")).await;
    let suspended = h.start(failing("remote")).await;
    let stranger = h.start(failing("stranger")).await;
    for id in [remote, suspended, stranger] {
        h.wait(id, "dead-lettered", |r| r.status == Status::Suspended).await;
    }
    other.shutdown().await;
    give_up(&h, remote).await;
    give_up(&h, stranger).await;
    // The pruning worker runs `quick` only; its file names `remote`.
    let file = keel_core::config::KeelConfig::load(
        "[queue.dead_letter]\nretention = \"1 hour\"\n\
         [machines.remote.queue.dead_letter]\nretention = \"10 minutes\"\n",
        |_| None,
    )
    .expect("valid file")
    .0;
    let every =
        RetentionConfig { interval: Duration::from_millis(20), ..RetentionConfig::default() };
    let config =
        WorkerConfig { retention: Some(every), ..h.config() }.with_settings(file).expect("applied");
    let (logged, guard) = common::logged::Logged::capture();
    let worker = h.worker(config, Quick("quick"));
    drop(guard);
    let said = logged.text();
    assert!(
        said.contains("purges the dead letters of these machines")
            && said.contains(r#"machines=["remote"]"#),
        "the start says which machines it purges for: {said}"
    );
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert_eq!(lettered(&h).await.len(), 3, "younger than every retention");
    // Past `remote`'s ten minutes, the file's hour and the built-in seven days.
    h.clock.advance(QueueConfig::default().dead_letter.retention + HOUR);
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    let mut left = lettered(&h).await;
    left.sort();
    let mut kept = vec![suspended, stranger];
    kept.sort();
    assert_eq!(left, kept, "only the given-up letter of the named machine goes");
    assert_eq!(worker.pruned().dead_letters, 1);
    worker.shutdown().await;
}

/// Walks through `STEPS` steps (one commit each), then finishes.
struct Walker(&'static str);

const STEPS: i64 = 5;

#[async_trait]
impl StepMachine for Walker {
    fn machine(&self) -> MachineRef {
        MachineRef::new(self.0, 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let n = ctx.context["n"].as_i64().unwrap_or(0);
        if n >= STEPS {
            return Ok(Outcome::Done { result: json!({ "steps": n }), step: None });
        }
        Ok(Outcome::Next { step: format!("s{}", n + 1), context: json!({ "n": n + 1 }) })
    }
}

async fn history_of<S: Store>(h: &Harness<S>, id: InstanceId) -> Vec<(i64, String)> {
    let detail = h.client.get(id).await.expect("get");
    detail.history.iter().map(|r| (r.revision.0, r.entry.kind.clone())).collect()
}

async fn history_is_trimmed_to_the_newest_entries_per_instance<S: TestStore>() {
    let h = S::harness().await;
    // From the file: three entries per instance; `brief` keeps one; `audit` has a section
    // without the key, so it keeps everything.
    let file = keel_core::config::KeelConfig::from_toml_str(
        r#"
        [retention]
        history_per_instance = 3
        interval = "20 ms"
        batch = 2
        pause = "0 ms"
        [retention.machines.brief]
        history_per_instance = 1
        [retention.machines.audit]
        "#,
    )
    .expect("valid");
    let config = h.config().with_settings(file).expect("applied");
    let worker =
        keel_scheduler::Worker::new(std::sync::Arc::clone(&h.store), h.clock.clone(), config)
            .register(Walker("walk"))
            .register(Walker("brief"))
            .register(Walker("audit"))
            .spawn();
    let mut started = Vec::new();
    for (machine, n) in [("walk", 3), ("brief", 2), ("audit", 1)] {
        for _ in 0..n {
            let id = h.start(NewInstance::new(MachineRef::new(machine, 1), "s0")).await;
            started.push((machine, id));
        }
    }
    for (_, id) in &started {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    let audit = history_of(&h, started.last().unwrap().1).await;
    let whole = audit.len();
    assert!(whole > 3, "a walk records more than three entries: {audit:?}");
    for (machine, id) in &started {
        let kept = history_of(&h, *id).await;
        let keep = match *machine {
            "walk" => 3,
            "brief" => 1,
            _ => whole,
        };
        assert_eq!(kept, audit[whole - keep..], "{machine} {id}: the newest {keep} entries");
    }
    let counts = worker.pruned();
    let trimmed = 3 * (whole - 3) + 2 * (whole - 1);
    assert_eq!(counts.history_trimmed, trimmed as u64, "every older entry once: {counts:?}");
    assert_eq!(counts.instances, 0, "no `ended`: instances stay");
    worker.shutdown().await;
}

/// A worker serving namespaces `a` and `b` prunes under its retention there and leaves
/// namespace `c`, which another deployment serves under its own, alone.
async fn a_worker_prunes_only_the_namespaces_it_serves<S: TestStore>() {
    let h = S::harness().await;
    let config = WorkerConfig {
        namespaces: vec!["a".into(), "b".into()],
        retention: Some(retention(HOUR)),
        ..h.config()
    };
    let worker =
        keel_scheduler::Worker::new(std::sync::Arc::clone(&h.store), h.clock.clone(), config)
            .register(Quick("quick"))
            .spawn();
    let mut ended = Vec::new();
    for ns in ["a", "b", "c"] {
        let id = h.start(NewInstance::new(MachineRef::new("idle", 1), "wait").namespace(ns)).await;
        h.client.cancel(keel_scheduler::Cancel::new(id)).await.expect("cancel");
        ended.push(id);
    }
    h.clock.advance(2 * HOUR);
    let before = worker.pruned().runs;
    runs_after(&worker, before, 2).await;
    assert!(gone(&h, ended[0]).await, "namespace a is served: pruned");
    assert!(gone(&h, ended[1]).await, "namespace b is served: pruned");
    assert!(!gone(&h, ended[2]).await, "namespace c is not this worker's: kept");
    worker.shutdown().await;
}

/// A worker shutting down stops its pruner between two pages, and does not sit out the
/// pause between them: with six one-row pages twenty seconds apart, the run would hold the
/// shutdown for over a minute, and one pause for twenty seconds.
async fn shutdown_waits_for_one_prune_page_not_the_whole_run<S: TestStore>() {
    let h = S::harness().await;
    for _ in 0..6 {
        let id = h.start(NewInstance::new(MachineRef::new("idle", 1), "wait")).await;
        h.client.cancel(keel_scheduler::Cancel::new(id)).await.expect("cancel");
    }
    h.clock.advance(2 * HOUR);
    let slow = RetentionConfig { batch: 1, pause: Duration::from_secs(20), ..retention(HOUR) };
    let config = WorkerConfig { retention: Some(slow), ..h.config() };
    let worker =
        keel_scheduler::Worker::new(std::sync::Arc::clone(&h.store), h.clock.clone(), config)
            .register(Quick("quick"))
            .spawn();
    for _ in 0..500 {
        if worker.pruned().instances >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(worker.pruned().instances >= 1, "the pruner never started: {:?}", worker.pruned());
    let began = std::time::Instant::now();
    worker.shutdown().await;
    assert!(began.elapsed() < Duration::from_secs(5), "shutdown took {:?}", began.elapsed());
}

/// A table larger than one run's pages is still walked to its end: a pass that ran out
/// of pages goes on from there at the next run instead of walking the same first pages
/// again (here 10 000 live rows, one per page, fill the first run's bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_run_goes_on_where_the_last_one_ran_out_of_pages() {
    use keel_core::ports::Clock;
    use keel_core::retention::PAGES_PER_PASS_MAX;
    let h = <keel_testkit::memory::MemoryStore as TestStore>::harness().await;
    for _ in 0..PAGES_PER_PASS_MAX / 1_000 {
        let news =
            (0..1_000).map(|_| NewInstance::new(MachineRef::new("idle", 1), "wait")).collect();
        h.client.start_many(news).await.expect("start");
    }
    let last = h.start(NewInstance::new(MachineRef::new("idle", 1), "wait")).await;
    h.client.cancel(keel_scheduler::Cancel::new(last)).await.expect("cancel");
    h.clock.advance(2 * HOUR);
    let pruner = keel_scheduler::Pruner {
        config: RetentionConfig { batch: 1, ..retention(HOUR) },
        namespaces: Vec::new(),
        dead_letters: Vec::new(),
        stats: std::sync::Arc::default(),
        cursors: std::sync::Arc::default(),
    };
    pruner.run_once(&*h.store, h.clock.now()).await.expect("first run");
    assert!(!gone(&h, last).await, "past the first run's pages");
    pruner.run_once(&*h.store, h.clock.now()).await.expect("second run");
    assert!(gone(&h, last).await, "the second run goes on and prunes it");
}

/// A prune pass whose page the store keeps failing holds up only that pass: the history
/// trims and the dead-letter purge after it still run, and the run reports the error.
#[tokio::test]
async fn a_failing_prune_page_does_not_stop_the_trims_and_purges_after_it() {
    use common::faulty::{Fault, Faulty};
    let store =
        Faulty::new(keel_testkit::MemoryStore::new()).failing("instance_prune", &[Fault::Error; 4]);
    let pruner = keel_scheduler::Pruner {
        config: RetentionConfig { history_per_instance: Some(10), ..retention(HOUR) },
        namespaces: Vec::new(),
        dead_letters: vec![keel_scheduler::prune::DeadLetterRetention {
            namespace: Some("default".to_owned()),
            machine: "quick".to_owned(),
            keep: HOUR,
        }],
        stats: std::sync::Arc::default(),
        cursors: std::sync::Arc::default(),
    };
    let now = keel_core::Timestamp(1_700_000_000_000);
    let err = pruner.run_once(&store, now).await.expect_err("the prune page failed");
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert_eq!(store.calls("instance_prune"), 1, "the failed pass stops at its page");
    assert_eq!(store.calls("history_trim"), 1, "the trim pass still ran");
    assert_eq!(store.calls("dead_letter_purge"), 1, "the purge still ran");
}

/// A `[retention]` section in the file replaces the retention set in code as a whole, even
/// when its values are the defaults, and turns on a pruner the code turned off; a file
/// without the section keeps the code's.
#[test]
fn a_files_retention_section_equal_to_the_defaults_still_replaces_the_codes() {
    let file = |toml: &str| keel_core::config::KeelConfig::from_toml_str(toml).expect("valid");
    let hourly = RetentionConfig { ended: Some(HOUR), ..retention(HOUR) };
    let hourly = RetentionConfig { interval: HOUR, ..hourly };
    let code = WorkerConfig { retention: Some(hourly.clone()), ..WorkerConfig::default() };
    let off = WorkerConfig { retention: None, ..WorkerConfig::default() };
    let defaults = "[retention]\ninterval = \"1 minute\"";
    let applied = |config: &WorkerConfig, toml: &str| {
        config.clone().with_settings(file(toml)).expect("applied").retention
    };
    assert_eq!(applied(&code, defaults), Some(RetentionConfig::default()));
    assert_eq!(applied(&off, defaults), Some(RetentionConfig::default()));
    assert_eq!(applied(&off, "[retention]"), Some(RetentionConfig::default()));
    // A section that sets one key: the others take their defaults, not the code's.
    let day = Duration::from_secs(86_400);
    assert_eq!(
        applied(&code, "[retention]\nended = \"1 day\""),
        Some(RetentionConfig { ended: Some(day), ..RetentionConfig::default() })
    );
    // No section: what the code set stays, the pruner off included.
    assert_eq!(applied(&code, "[queue]\ntimeout = \"5 seconds\""), Some(hourly));
    assert_eq!(applied(&off, ""), None);
}
