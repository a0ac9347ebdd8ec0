//! The worker runtime on `MemoryStore` + `VirtualClock`: retries with the policy's delays,
//! dead letters, timeouts, lease loss, the reaper, shutdown, pause, per-key serialization,
//! priority and the emit outbox. Virtual time drives eligibility; real time only paces the
//! worker's polling, with every wait bounded.

#![allow(clippy::items_after_statements, clippy::unnecessary_wraps, clippy::unused_self)]

mod common;

use async_trait::async_trait;
use keel_core::chart::{Definition, Timer};
use keel_core::config::QueueConfig;
use keel_core::instance::NewInstance;
use keel_core::ports::store::InsertParams;
use keel_core::ports::store::{ClaimParams, CommitParams, DeadLetterFilter, LeaseReapParams};
use keel_core::ports::{Clock, Store};
use keel_core::retry::RetryPolicy;
use keel_core::{
    InstanceId, MachineRef, NewSignal, Outcome, Priority, Status, StepCommit, WorkerId,
};
use keel_scheduler::{
    ChartMachine, StepContext, StepError, StepMachine, Worker, WorkerConfig, WorkerHandle,
    WorkerLoop,
};
use keel_testkit::memory::MemoryStore;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Harness;
use common::faulty::{Faulty, Hooks as StoreHooks};
use common::logged::Logged;

fn machine() -> MachineRef {
    MachineRef::new("m", 1)
}

fn new() -> NewInstance {
    NewInstance::new(machine(), "a")
}

/// A machine whose steps are a closure.
struct Fn_<F>(F, QueueConfig);

#[async_trait]
impl<F> StepMachine for Fn_<F>
where
    F: Fn(&StepContext) -> Result<Outcome, StepError> + Send + Sync + 'static,
{
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        (self.0)(ctx)
    }
    fn config(&self) -> QueueConfig {
        self.1
    }
}

fn steps<F>(f: F) -> Fn_<F>
where
    F: Fn(&StepContext) -> Result<Outcome, StepError> + Send + Sync + 'static,
{
    Fn_(f, QueueConfig::default())
}

fn done() -> Result<Outcome, StepError> {
    Ok(Outcome::Done { result: json!("ok"), step: None })
}

/// A machine whose every step sleeps this long, then finishes with this result.
struct Sleeps(Duration, &'static str);

#[async_trait]
impl StepMachine for Sleeps {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(self.0).await;
        Ok(Outcome::Done { result: json!(self.1), step: None })
    }
}

#[tokio::test]
async fn retries_wait_the_policy_delays_then_suspend_and_a_dead_letter_retry_resumes() {
    let h = Harness::new();
    let healed = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&healed);
    let m = steps(move |_| {
        if flag.load(Ordering::SeqCst) { done() } else { Err(StepError::retryable("db down")) }
    });
    let worker = h.worker(h.config(), m);
    let id = h.start(new()).await;

    // Exponential from 1 s (the default policy): 1 s, 2 s, then dead-lettered after 3 attempts.
    for (attempt, delay_ms) in [(1, 1000), (2, 2000)] {
        let row =
            h.wait(id, "a retry", |r| r.attempt == attempt && r.status == Status::Runnable).await;
        assert_eq!(
            row.eligible_at,
            h.clock.now().plus(Duration::from_millis(delay_ms)),
            "attempt {attempt}"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(h.status(id).await, Status::Runnable, "not run before its delay");
        h.clock.advance(Duration::from_millis(delay_ms));
    }
    let row = h.wait(id, "suspension", |r| r.status == Status::Suspended).await;
    assert_eq!(row.last_error.as_deref(), Some("db down"));
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].letter.attempts, 3);
    assert_eq!(letters[0].letter.errors.len(), 3, "every attempt's error is kept");

    healed.store(true, Ordering::SeqCst);
    h.client
        .dead_letter_retry(keel_scheduler::client::DeadLetterRetry::one(letters[0].id))
        .await
        .unwrap();
    h.wait(id, "done after the dead-letter retry", |r| r.status == Status::Done).await;
    worker.shutdown().await;
}

#[tokio::test]
async fn a_non_retryable_error_is_dead_lettered_at_once() {
    let h = Harness::new();
    let worker = h.worker(h.config(), steps(|_| Err(StepError::fatal("card number invalid"))));
    let id = h.start(new()).await;
    let row = h.wait(id, "suspension", |r| r.status == Status::Suspended).await;
    assert_eq!(row.attempt, 0, "no retries for a non-retryable error");
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.unwrap();
    assert_eq!(letters[0].letter.reason, "non_retryable");
    worker.shutdown().await;
}

#[tokio::test]
async fn a_step_over_its_timeout_is_cancelled_and_retried() {
    let h = Harness::new();
    struct Slow(Arc<AtomicUsize>);
    #[async_trait]
    impl StepMachine for Slow {
        fn machine(&self) -> MachineRef {
            machine()
        }
        async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
            if ctx.attempt == 0 {
                tokio::time::sleep(Duration::from_secs(30)).await;
                self.0.fetch_add(1, Ordering::SeqCst); // never reached: the step is cancelled
            }
            done()
        }
        fn config(&self) -> QueueConfig {
            QueueConfig { timeout: Duration::from_millis(50), ..QueueConfig::default() }
        }
    }
    let finished_slow = Arc::new(AtomicUsize::new(0));
    let worker = h.worker(h.config(), Slow(Arc::clone(&finished_slow)));
    let id = h.start(new()).await;
    let row = h.wait(id, "a retry after the timeout", |r| r.attempt == 1).await;
    assert!(row.errors[0].error.contains("timed out after 50 ms"), "{:?}", row.errors);
    h.clock.advance(Duration::from_secs(1));
    h.wait(id, "done", |r| r.status == Status::Done).await;
    assert_eq!(finished_slow.load(Ordering::SeqCst), 0);
    worker.shutdown().await;
}

/// A step that fails, and an error handler that panics (`hang` false) or never returns
/// (`hang` true) under a 50 ms step timeout.
struct BadHandler {
    hang: bool,
}

#[async_trait]
impl StepMachine for BadHandler {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Err(StepError::fatal("the step failed"))
    }
    async fn handle(
        &self,
        _error: &StepError,
        _ctx: &StepContext,
    ) -> Result<Option<Outcome>, StepError> {
        if self.hang {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        panic!("bug in handler");
    }
    fn config(&self) -> QueueConfig {
        QueueConfig { timeout: Duration::from_millis(50), ..QueueConfig::default() }
    }
}

/// A step that blocks its thread past its timeout (a long computation, a blocking call)
/// still times out on time and is retried: the worker's wait for it is not stuck behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_step_that_blocks_its_thread_still_times_out() {
    let h = Harness::new();
    let blocking = |ctx: &StepContext| {
        if ctx.attempt == 0 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        done()
    };
    let config = QueueConfig { timeout: Duration::from_millis(50), ..QueueConfig::default() };
    let worker = h.worker(h.config(), Fn_(blocking, config));
    let id = h.start(new()).await;
    let row = h.wait(id, "a retry after the timeout", |r| r.attempt == 1).await;
    assert!(row.errors[0].error.contains("timed out after 50 ms"), "{:?}", row.errors);
    h.clock.advance(Duration::from_secs(1));
    h.wait(id, "done", |r| r.status == Status::Done).await;
    worker.shutdown().await;
}

#[tokio::test]
async fn an_error_handler_that_panics_or_hangs_fails_the_instance() {
    for (hang, why) in [
        (false, "the error handler panicked: bug in handler"),
        (true, "the error handler timed out after 50 ms"),
    ] {
        let (logged, _default) = Logged::capture();
        let h = Harness::new();
        let worker = h.worker(h.config(), BadHandler { hang });
        let id = h.start(new()).await;
        let row = h.wait(id, "the instance ends", |r| r.status.is_terminal()).await;
        assert_eq!(row.status, Status::Failed, "{row:?}");
        let said = format!("{:?} {:?}", row.last_error, row.errors);
        assert!(said.contains(why), "expected {why:?} in {said}");
        assert!(said.contains("while handling: the step failed"), "{said}");
        worker.shutdown().await;
        // The worker's own line about the handler names the step it came from.
        assert_in_step_span(&logged, id, |l| l.contains("ERROR") && l.contains(why));
    }
}

#[tokio::test]
async fn a_panicking_step_is_a_retryable_failure() {
    let h = Harness::new();
    let worker = h.worker(
        h.config(),
        steps(|ctx| if ctx.attempt == 0 { panic!("bug in step") } else { done() }),
    );
    let id = h.start(new()).await;
    let row = h.wait(id, "retry", |r| r.attempt == 1).await;
    assert!(row.errors[0].error.contains("step panicked: bug in step"), "{:?}", row.errors);
    h.clock.advance(Duration::from_secs(1));
    h.wait(id, "done", |r| r.status == Status::Done).await;
    worker.shutdown().await;
}

/// Asserts that the first line `which` picks was logged in the span of instance `id`'s
/// first run of step `a`.
fn assert_in_step_span(logged: &Logged, id: InstanceId, which: impl Fn(&str) -> bool) {
    let text = logged.text();
    let line = text.lines().find(|l| which(l)).expect("logged");
    assert!(
        line.contains(&format!("step{{instance={id} machine=m@v1 step=a attempt=0}}")),
        "the log line lacks the step's span: {line}"
    );
}

/// What a step and its error handler log carries the step's span: which instance,
/// machine, step and attempt it came from. (The test's runtime has one thread, which the
/// subscriber is set on.)
#[tokio::test]
async fn what_a_step_and_its_error_handler_log_names_its_instance_and_step() {
    struct Chatty;
    #[async_trait]
    impl StepMachine for Chatty {
        fn machine(&self) -> MachineRef {
            machine()
        }
        async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
            tracing::info!(n = ctx.attempt, "hello from the step");
            Err(StepError::fatal("the step failed"))
        }
        async fn handle(
            &self,
            error: &StepError,
            _ctx: &StepContext,
        ) -> Result<Option<Outcome>, StepError> {
            tracing::info!("hello from the error handler");
            Ok(Some(Outcome::Stop { reason: error.message.clone() }))
        }
    }
    let (logged, _default) = Logged::capture();
    let h = Harness::new();
    let worker = h.worker(h.config(), Chatty);
    let id = h.start(new()).await;
    h.wait(id, "stopped", |r| r.status == Status::Failed).await;
    worker.shutdown().await;
    for what in ["hello from the step", "hello from the error handler"] {
        assert_in_step_span(&logged, id, |l| l.contains(what));
    }
}

#[tokio::test]
async fn a_result_whose_lease_was_lost_is_discarded() {
    let h = Harness::new();
    // No heartbeat within the test's few hundred milliseconds (the lease runs on the
    // virtual clock, the heartbeat on the runtime's).
    let config = WorkerConfig { heartbeat: Duration::from_secs(29), ..h.config() };
    let worker = h.worker(config, Sleeps(Duration::from_millis(300), "from the slow worker"));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;

    // The slow worker's lease runs out; another worker reaps, claims and finishes it.
    h.clock.advance(Duration::from_secs(31));
    h.store
        .lease_reap(LeaseReapParams { owner: None, limit: 10, now: h.clock.now() })
        .await
        .unwrap();
    let other = WorkerId("other".into());
    let claim = h
        .store
        .instance_claim(ClaimParams {
            worker: other,
            namespaces: vec![],
            queues: vec![],
            machines: vec![],
            limit: 1,
            lease: Duration::from_secs(30),
            now: h.clock.now(),
            policy: keel_core::plan::claim::ClaimPolicy::default(),
        })
        .await
        .unwrap()
        .pop()
        .expect("claimable after the reap");
    let commit = StepCommit::new(
        id,
        claim.token(),
        Outcome::Done { result: json!("from the other worker"), step: None },
    );
    h.store.step_commit(CommitParams { commits: vec![commit], now: h.clock.now() }).await.unwrap()
        [0]
    .clone()
    .unwrap();

    tokio::time::sleep(Duration::from_millis(400)).await;
    let stats = worker.shutdown().await;
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 1);
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!(row.result, Some(json!("from the other worker")));
}

/// The one ready instance claimed with a 30 s lease by a worker `dead` that never comes
/// back.
async fn claimed_by_a_dead_worker(h: &Harness) {
    let params = ClaimParams {
        worker: WorkerId("dead".into()),
        namespaces: vec![],
        queues: vec![],
        machines: vec![],
        limit: 1,
        lease: Duration::from_secs(30),
        now: h.clock.now(),
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    };
    assert_eq!(h.store.instance_claim(params).await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_reaper_returns_a_dead_workers_lease_and_the_step_reruns() {
    let h = Harness::new();
    let id = h.start(new()).await;
    // A worker claims it and dies.
    claimed_by_a_dead_worker(&h).await;
    let worker = h.worker(h.config(), steps(|_| done()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.status(id).await, Status::Executing, "an unexpired lease is left alone");
    h.clock.advance(Duration::from_secs(31));
    let row = h.wait(id, "done after the reap", |r| r.status == Status::Done).await;
    let history = h.client.get(id).await.unwrap().history;
    assert!(history.iter().any(|r| r.entry.kind == "LEASE_EXPIRED"));
    assert_eq!(row.revision.0, 1, "the step was committed once");
    worker.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_releases_unfinished_steps_without_counting_an_attempt() {
    let h = Harness::new();
    let worker = h.worker(
        WorkerConfig { shutdown_grace: Duration::from_millis(50), ..h.config() },
        Sleeps(Duration::from_secs(60), "ok"),
    );
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    let stats = worker.shutdown().await;
    assert_eq!(stats.released.load(Ordering::Relaxed), 1);
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!((row.status, row.attempt, row.lease_owner), (Status::Runnable, 0, None));
}

#[tokio::test]
async fn graceful_shutdown_lets_quick_steps_finish_and_commit() {
    let h = Harness::new();
    let worker = h.worker(h.config(), Sleeps(Duration::from_millis(50), "ok"));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    worker.shutdown().await;
    assert_eq!(h.status(id).await, Status::Done);
}

#[tokio::test]
async fn a_paused_queue_is_not_claimed_until_resumed() {
    let h = Harness::new();
    h.client.queue_pause("default", "default").await.unwrap();
    let worker = h.worker(h.config(), steps(|_| done()));
    let id = h.start(new()).await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(h.status(id).await, Status::Runnable);
    h.client.queue_resume("default", "default").await.unwrap();
    h.wait(id, "done", |r| r.status == Status::Done).await;
    worker.shutdown().await;
}

#[tokio::test]
async fn instances_sharing_a_concurrency_key_run_one_at_a_time() {
    let h = Harness::new();
    let running = Arc::new(AtomicUsize::new(0));
    let max_seen = Arc::new(AtomicUsize::new(0));
    struct Counting(Arc<AtomicUsize>, Arc<AtomicUsize>);
    #[async_trait]
    impl StepMachine for Counting {
        fn machine(&self) -> MachineRef {
            machine()
        }
        async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
            let now = self.0.fetch_add(1, Ordering::SeqCst) + 1;
            self.1.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(10)).await;
            self.0.fetch_sub(1, Ordering::SeqCst);
            done()
        }
    }
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(h.start(new().concurrency_key("account:1")).await);
    }
    let free = h.start(new()).await;
    let worker = h.worker(h.config(), Counting(Arc::clone(&running), Arc::clone(&max_seen)));
    for id in ids.iter().chain([&free]) {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    worker.shutdown().await;
    assert_eq!(
        max_seen.load(Ordering::SeqCst),
        2,
        "one of the key at a time, plus the keyless one"
    );
}

/// The order one slot runs three rows inserted bulk, normal, critical, under `settings`.
async fn run_order(settings: Option<&str>) -> Vec<String> {
    let h = Harness::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&order);
    let m = steps(move |ctx| {
        seen.lock().unwrap().push(ctx.context["name"].as_str().unwrap_or_default().to_owned());
        done()
    });
    for (name, p) in
        [("bulk", Priority::Bulk), ("normal", Priority::Normal), ("critical", Priority::Critical)]
    {
        h.start(new().priority(p).context(json!({ "name": name }))).await;
        h.clock.advance(Duration::from_millis(1));
    }
    let mut config =
        WorkerConfig { queues: vec![("default".into(), 1)], claim_batch: 1, ..h.config() };
    if let Some(toml) = settings {
        let file = keel_core::config::KeelConfig::from_toml_str(toml).expect("valid file");
        config = config.with_settings(file).expect("applied");
    }
    let worker = h.worker(config, m);
    for _ in 0..1_000 {
        if order.lock().unwrap().len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    worker.shutdown().await;
    order.lock().unwrap().clone()
}

#[tokio::test]
async fn the_default_fifo_strategy_runs_in_eligible_order_whatever_the_priority() {
    assert_eq!(run_order(None).await, ["bulk", "normal", "critical"]);
    assert_eq!(
        run_order(Some("[queues.default]\nstrategy = \"fifo\"")).await,
        ["bulk", "normal", "critical"]
    );
}

#[tokio::test]
async fn a_priority_queue_runs_higher_priority_first() {
    let by_queue = "[queues.default]\nstrategy = \"priority\"";
    assert_eq!(run_order(Some(by_queue)).await, ["critical", "normal", "bulk"]);
    let system_wide = "[queue]\nstrategy = \"priority\"";
    assert_eq!(run_order(Some(system_wide)).await, ["critical", "normal", "bulk"]);
}

#[tokio::test]
async fn emitted_events_are_delivered_with_the_step_commit() {
    let h = Harness::new();
    let target = h.start(NewInstance::new(MachineRef::new("other", 1), "x")).await;
    let m = steps(move |ctx| {
        if ctx.attempt == 0 {
            // This emit is discarded with the failed attempt.
            ctx.emit(NewSignal::new(target, "FROM_FAILED_ATTEMPT"));
            return Err(StepError::retryable("flaky"));
        }
        ctx.emit(NewSignal::new(target, "HELLO").payload(json!({ "from": ctx.id })));
        done()
    });
    let worker = h.worker(h.config(), m);
    let id = h.start(new()).await;
    h.wait(id, "retry", |r| r.attempt == 1).await;
    assert!(h.client.get(target).await.unwrap().inbox.is_empty(), "a failed step emits nothing");
    h.clock.advance(Duration::from_secs(1));
    h.wait(id, "done", |r| r.status == Status::Done).await;
    worker.shutdown().await;
    let inbox = h.client.get(target).await.unwrap().inbox;
    assert_eq!(inbox.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["HELLO"]);
    assert_eq!(inbox[0].payload, json!({ "from": id }));
}

#[tokio::test]
async fn await_wakes_on_the_signal_and_consumes_only_what_it_saw() {
    let h = Harness::new();
    let m = steps(|ctx| match ctx.signal("GO") {
        Some(s) => Ok(Outcome::Next { step: "b".into(), context: json!({ "got": s.payload }) }),
        None if ctx.step == "a" => {
            Ok(Outcome::Await { signal: "GO".into(), context: ctx.context.clone(), step: None })
        }
        None => done(),
    });
    let worker = h.worker(h.config(), m);
    let id = h.start(new()).await;
    h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
    let other = NewSignal::new(id, "UNRELATED");
    h.client.send_many(vec![other, NewSignal::new(id, "GO").payload(json!(7))]).await.unwrap();
    let row = h.wait(id, "done", |r| r.status == Status::Done).await;
    worker.shutdown().await;
    assert_eq!(row.context, json!({ "got": 7 }));
    // Only GO was consumed: UNRELATED was still pending when the instance finished, so
    // the finish drained it from the inbox into history.
    let detail = h.client.get(id).await.unwrap();
    assert!(detail.inbox.is_empty(), "a finished instance keeps no signals");
    let drained: Vec<&serde_json::Value> = detail
        .history
        .iter()
        .filter(|r| r.entry.kind == "INBOX_DRAINED")
        .map(|r| &r.entry.data)
        .collect();
    assert_eq!(drained.len(), 1, "one drain entry");
    let names: Vec<&str> = drained[0]["signals"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, ["UNRELATED"], "only GO was consumed");
}

#[tokio::test]
async fn cancel_with_cascade_ends_the_children_too() {
    let h = Harness::new();
    let m = steps(|ctx| match ctx.step.as_str() {
        "a" => Ok(Outcome::ScheduleChildren {
            next: "b".into(),
            children: vec![NewInstance::new(MachineRef::new("child", 1), "wait"); 2],
            context: ctx.context.clone(),
            join: keel_core::join::Join::default(),
        }),
        _ => done(),
    });
    let worker = h.worker(h.config(), m);
    let id = h.start(new()).await;
    h.wait(id, "waiting on children", |r| r.status == Status::AwaitingChildren).await;
    let cancelled = h
        .client
        .cancel(keel_scheduler::Cancel::new(id).cascade().reason("operator"))
        .await
        .unwrap();
    assert_eq!(cancelled.len(), 3);
    let detail = h.client.get(id).await.unwrap();
    assert!(detail.children.iter().all(|c| c.status == Status::Cancelled));
    worker.shutdown().await;
}

#[tokio::test]
async fn the_worker_claims_only_the_versions_it_runs() {
    let h = Harness::new();
    let worker = h.worker(h.config(), steps(|_| done()));
    let v2 = h.start(NewInstance::new(MachineRef::new("m", 2), "a")).await;
    let v1 = h.start(new()).await;
    h.wait(v1, "v1 done", |r| r.status == Status::Done).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(h.status(v2).await, Status::Runnable, "v2 waits for a worker that runs v2");
    worker.shutdown().await;
}

#[tokio::test]
async fn a_retry_policy_from_configuration_is_used() {
    let h = Harness::new();
    let policy = RetryPolicy { max_attempts: 1, ..RetryPolicy::default() };
    let m = Fn_(
        |_: &StepContext| Err(StepError::retryable("nope")),
        QueueConfig { retry: policy, ..QueueConfig::default() },
    );
    let worker = h.worker(h.config(), m);
    let id = h.start(new()).await;
    let row = h.wait(id, "suspended after one attempt", |r| r.status == Status::Suspended).await;
    assert_eq!(row.attempt, 0);
    worker.shutdown().await;
}

/// A machine exercising the hooks parallel dispatch relies on: `step_config` per step,
/// `wants_parent`, and emits made by the error handler riding the failure commit.
struct Hooks {
    saw_parent: Arc<Mutex<Option<Status>>>,
}

#[async_trait]
impl StepMachine for Hooks {
    fn machine(&self) -> MachineRef {
        machine()
    }
    fn step_config(&self, step: &str) -> QueueConfig {
        let attempts = if step == "child" { 1 } else { 3 };
        QueueConfig {
            retry: RetryPolicy { max_attempts: attempts, ..RetryPolicy::default() },
            ..QueueConfig::default()
        }
    }
    fn wants_parent(&self, step: &str) -> bool {
        step == "child"
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if ctx.step == "parent" {
            if let Some(report) = ctx.signal("report") {
                return Ok(Outcome::Done { result: report.payload.clone(), step: None });
            }
            ctx.spawn(NewInstance::new(machine(), "child"));
            return Ok(Outcome::Await { signal: "report".into(), context: json!({}), step: None });
        }
        *self.saw_parent.lock().unwrap() = ctx.parent.as_ref().map(|p| p.status);
        // Dropped: a failed step's own outbox never commits.
        ctx.emit(NewSignal::new(ctx.parent.as_ref().unwrap().id, "from_step"));
        Err(StepError::retryable("boom"))
    }
    async fn handle(
        &self,
        error: &StepError,
        ctx: &StepContext,
    ) -> Result<Option<Outcome>, StepError> {
        let parent = ctx.parent.as_ref().map(|p| p.id).expect("parent read");
        ctx.emit(NewSignal::new(parent, "report").payload(json!({ "error": error.message })));
        Ok(Some(Outcome::Stop { reason: error.message.clone() }))
    }
}

#[tokio::test]
async fn the_error_handler_emits_in_the_failure_commit_and_steps_may_read_their_parent() {
    let h = Harness::new();
    let saw_parent = Arc::new(Mutex::new(None));
    let worker = h.worker(h.config(), Hooks { saw_parent: Arc::clone(&saw_parent) });
    let parent = h.start(NewInstance::new(machine(), "parent")).await;
    let row = h
        .wait(parent, "the handler's report finished the parent", |r| r.status == Status::Done)
        .await;
    assert_eq!(row.result, Some(json!({ "error": "boom" })));
    let detail = h.client.get(parent).await.unwrap();
    assert_eq!(detail.children.len(), 1);
    assert_eq!(detail.children[0].status, Status::Failed, "the handler's Stop, one attempt");
    assert_eq!(*saw_parent.lock().unwrap(), Some(Status::AwaitingSignal));
    worker.shutdown().await;
    let inbox: Vec<String> = detail.inbox.iter().map(|s| s.name.clone()).collect();
    assert!(!inbox.contains(&"from_step".to_owned()));
}

/// Polls `cond` every 5 ms for at most `within` of real time; whether it came true.
async fn within(within: Duration, cond: impl Fn() -> bool) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cond()
}

/// A worker running a long step whose lease is then taken away behind its back (as a
/// reaper elsewhere would), the instance left unclaimed (its queue paused).
async fn running_step_whose_lease_is_taken<S: Store>(h: &Harness<S>) -> WorkerHandle {
    let config = WorkerConfig { shutdown_grace: Duration::from_millis(50), ..h.config() };
    let worker = h.worker(config.clone(), Sleeps(Duration::from_secs(60), "ok"));
    let id = h.start(new()).await;
    h.wait(id, "claimed", |r| r.status == Status::Executing).await;
    h.client.queue_pause("default", "default").await.unwrap();
    let params =
        LeaseReapParams { owner: Some(config.worker_id.clone()), limit: 10, now: h.clock.now() };
    assert_eq!(h.store.lease_reap(params).await.unwrap(), vec![id]);
    worker
}

#[tokio::test]
async fn a_lease_lost_under_a_running_step_is_counted_once_and_no_longer_extended() {
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), StoreHooks::default()));
    let worker = running_step_whose_lease_is_taken(&h).await;

    // Ten heartbeat periods: the loss is found once, and the lease is not sent again.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let extends = h.store.calls("lease_extend");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.store.calls("lease_extend"), extends, "the lost lease is still extended");
    let stats = worker.shutdown().await;
    assert_eq!(stats.lease_lost_on_heartbeat.load(Ordering::Relaxed), 1);
}

/// The committer tries a group five times while the store is unavailable, then gives up
/// at once; the step's lease is given back (the store takes other calls), so the step
/// runs again without counting an attempt rather than waiting for its lease to expire.
#[tokio::test]
async fn a_group_commit_gives_up_right_after_its_last_try() {
    let hooks = StoreHooks { commits_unavailable: true, ..StoreHooks::default() };
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
    let worker = h.worker(h.config(), steps(|_| done()));
    let id = h.start(new()).await;
    let gave_up = || {
        worker
            .health()
            .get(WorkerLoop::Committer)
            .and_then(|l| l.last_error.clone())
            .is_some_and(|(_, error)| error.contains("still failing"))
    };
    assert!(within(Duration::from_secs(5), gave_up).await, "the committer never gave up");
    let noticed = Instant::now();
    let tries = h.store.call_times("step_commit");
    // The step may already have run again (its lease given back) and its next group
    // begun; the first group's tries are the first five.
    assert!(tries.len() >= 5, "one group, tried five times: {}", tries.len());
    // The tries before pause 20, 40, 80 and 160 ms; the last one is followed by none.
    let gaps: Vec<Duration> = tries[..5].windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps[3] >= Duration::from_millis(160), "the tries back off: {gaps:?}");
    let after_last = noticed - tries[4];
    assert!(after_last < Duration::from_millis(200), "gave up {after_last:?} after the last try");
    let again = || h.store.calls("step_commit") > 5;
    assert!(within(Duration::from_secs(5), again).await, "the step never ran again");
    let stats = worker.shutdown().await;
    assert!(stats.released.load(Ordering::Relaxed) >= 1, "no lease was given back");
    assert_eq!(stats.reaped.load(Ordering::Relaxed), 0, "a lease was left to expire");
    let row = h.client.get(id).await.unwrap().instance;
    assert_eq!(row.attempt, 0, "a run the store could not record counts no attempt: {row:?}");
}

/// A commit that fails as unavailable every time while the store answers everything else
/// is no outage: the step's lease is given back three times in a row, then left to
/// expire, so the reaper counts the attempt and the retry policy can end the loop.
#[tokio::test]
async fn a_commit_that_always_fails_is_given_back_three_times_then_counts_attempts() {
    let hooks = StoreHooks { commits_unavailable: true, ..StoreHooks::default() };
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
    let worker = h.worker(h.config(), steps(|_| done()));
    let id = h.start(new()).await;
    // Four runs of five tries each: three given back, the fourth left to its lease.
    let four = || h.store.calls("step_commit") >= 20;
    assert!(within(Duration::from_secs(10), four).await, "the step did not run four times");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.store.calls("step_commit"), 20, "a fifth run came without the lease expiring");
    assert_eq!(h.status(id).await, Status::Executing, "the fourth lease is left to expire");
    // Past the lease the reaper takes it, counting the attempt.
    h.clock.advance(Duration::from_secs(31));
    let row = h.wait(id, "the reaped lease", |r| r.attempt == 1).await;
    let history = h.client.get(id).await.unwrap().history;
    assert!(history.iter().any(|r| r.entry.kind == "LEASE_EXPIRED"), "{row:?}");
    let stats = worker.shutdown().await;
    assert_eq!(stats.released.load(Ordering::Relaxed), 3, "three leases given back");
}

/// A chart named `name` whose one transition waits a day: it has a timer that follows
/// deploys.
fn deadline_chart(name: &str) -> ChartMachine {
    let def = Definition::builder(name, 1)
        .initial("awaiting")
        .state("awaiting", |s| s.on("EXPIRE", |t| t.target("expired").after(Timer::days(1))))
        .final_state("expired")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

#[tokio::test]
async fn a_machine_whose_timers_cannot_be_moved_does_not_stop_the_others() {
    let hooks = StoreHooks { refuse_retime: vec!["refused".into()], ..StoreHooks::default() };
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
    // A worker goes through its machines in an order of its own, so several starts put the
    // refused machine first in most of them; each start moves both.
    for start in 1..=8 {
        let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
            .register(deadline_chart("refused"))
            .register(deadline_chart("moved"))
            .spawn();
        let both = within(Duration::from_secs(1), || h.store.calls("timers_retime") >= 2 * start);
        assert!(both.await, "start {start}: a machine was left out after the refused one");
        worker.shutdown().await;
    }
    assert_eq!(h.store.calls("timers_retime"), 16, "one page per machine and start");
}

#[tokio::test]
async fn a_restarted_worker_takes_back_more_than_one_page_of_its_old_leases() {
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), StoreHooks::default()));
    let config = h.config();
    // The worker's previous life held a page of leases and a few more.
    let held = keel_core::limits::REAP_BATCH_MAX + 5;
    let mut inserted = 0;
    while inserted < held {
        let n = (held - inserted).min(keel_core::limits::INSERT_BATCH_MAX);
        let instances = vec![new(); n];
        h.store.instance_insert(InsertParams { instances, now: h.clock.now() }).await.unwrap();
        inserted += n;
    }
    let mut claimed = 0;
    while claimed < held {
        let params = ClaimParams {
            worker: config.worker_id.clone(),
            namespaces: vec![],
            queues: vec![],
            machines: vec![],
            limit: keel_core::limits::CLAIM_BATCH_MAX,
            lease: Duration::from_secs(30),
            now: h.clock.now(),
            policy: keel_core::plan::claim::ClaimPolicy::default(),
        };
        let got = h.store.instance_claim(params).await.unwrap().len();
        assert!(got > 0, "claimed {claimed} of {held}");
        claimed += got;
    }
    // Paused, so the restarted worker takes back its leases but claims nothing again.
    h.client.queue_pause("default", "default").await.unwrap();
    let worker = h.worker(config.clone(), steps(|_| done()));
    let started = within(Duration::from_secs(5), || h.store.calls("lease_reap_owner") >= 1);
    assert!(started.await, "the start-up reclaim never ran");
    // A moment for further pages, then nothing of the old life is held any more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    worker.shutdown().await;
    let params = LeaseReapParams { owner: Some(config.worker_id), limit: 10, now: h.clock.now() };
    let left = h.store.lease_reap(params).await.unwrap();
    assert!(left.is_empty(), "{} old leases were left to expire", left.len());
}

#[tokio::test]
async fn a_machine_version_registered_twice_is_refused() {
    let h = Harness::new();
    let twice = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(steps(|_| done()))
        .register(Sleeps(Duration::from_millis(1), "second"));
    let error = twice.check().expect_err("one (name, version), two machines");
    assert!(error.contains("machine m v1 is registered twice"), "{error}");
    let refused = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(steps(|_| done()))
        .register(steps(|_| done()))
        .try_spawn();
    assert!(refused.is_err(), "a worker with a machine registered twice started");
    // Two versions of one machine are two machines.
    struct V2;
    #[async_trait]
    impl StepMachine for V2 {
        fn machine(&self) -> MachineRef {
            MachineRef::new("m", 2)
        }
        async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
            done()
        }
    }
    let both = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(steps(|_| done()))
        .register(V2);
    assert_eq!(both.check(), Ok(()));
}

/// A machine tried once per step, whose settings for step `x` panic.
struct SettingsPanicAtX;

#[async_trait]
impl StepMachine for SettingsPanicAtX {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        done()
    }
    fn config(&self) -> QueueConfig {
        let retry = RetryPolicy { max_attempts: 1, ..RetryPolicy::default() };
        QueueConfig { retry, ..QueueConfig::default() }
    }
    fn step_config(&self, step: &str) -> QueueConfig {
        assert!(step != "x", "no settings for step x");
        self.config()
    }
}

#[tokio::test]
async fn a_step_whose_machine_settings_panic_fails_as_a_panicking_step() {
    let h = Harness::new();
    let worker = h.worker(h.config(), SettingsPanicAtX);
    let id = h.start(NewInstance::new(machine(), "x")).await;
    // Tried once, then dead-lettered with the panic, its lease given up: not held (and
    // extended by the heartbeat) for as long as the worker runs.
    let row = h.wait(id, "dead-lettered", |r| r.status == Status::Suspended).await;
    assert_eq!(row.lease_owner, None);
    let said = format!("{:?}", row.errors);
    assert!(said.contains("panicked: no settings for step x"), "{said}");
    // The machine's other steps run as usual.
    let other = h.start(new()).await;
    h.wait(other, "done", |r| r.status == Status::Done).await;
    let stats = worker.shutdown().await;
    assert_eq!(stats.failed_steps.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_claimed_step_that_cannot_run_here_gives_its_lease_back_at_once() {
    // The first claim hands the step out under a machine this worker does not run.
    let hooks = StoreHooks { foreign_claims: 1, ..StoreHooks::default() };
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
    let worker = h.worker(h.config(), steps(|_| done()));
    let id = h.start(new()).await;
    // Its lease goes back instead of being extended for as long as the worker runs, and
    // the next claim runs the step, no attempt counted.
    let row = h.wait(id, "done", |r| r.status == Status::Done).await;
    assert_eq!(row.attempt, 0);
    assert!(h.store.calls("lease_release") >= 1);
    worker.shutdown().await;
}

/// A machine whose step `slow` retries 30 s apart (as a chart's region tasks do by
/// default), its other steps with the defaults.
struct SlowRetries;

#[async_trait]
impl StepMachine for SlowRetries {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        done()
    }
    fn step_config(&self, step: &str) -> QueueConfig {
        let mut config = QueueConfig::default();
        if step == "slow" {
            config.retry.initial_delay = Duration::from_secs(30);
            config.retry.max_delay = Duration::from_secs(30);
        }
        config
    }
}

#[tokio::test]
async fn file_settings_that_do_not_resolve_on_a_steps_own_are_counted_and_warned_once() {
    let (logged, _default) = Logged::capture();
    let h = Harness::new();
    // Fine on the machine's configuration (1 s initial delay), not on step `slow`'s 30 s.
    let file =
        keel_core::config::KeelConfig::load("[queue.retry]\nmax_delay = \"10 seconds\"", |_| None)
            .expect("valid file")
            .0;
    let config = h.config().with_settings(file).expect("applied");
    let worker = h.worker(config, SlowRetries);
    for _ in 0..2 {
        let id = h.start(NewInstance::new(machine(), "slow")).await;
        h.wait(id, "done", |r| r.status == Status::Done).await;
    }
    let id = h.start(new()).await;
    h.wait(id, "done", |r| r.status == Status::Done).await;
    let stats = worker.shutdown().await;
    assert_eq!(stats.settings_unresolved.load(Ordering::Relaxed), 2);
    let text = logged.text();
    let warned: Vec<&str> = text.lines().filter(|l| l.contains("do not resolve")).collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("step=slow") && warned[0].contains("max_delay"), "{}", warned[0]);
}

#[tokio::test]
async fn a_queue_whose_claims_fail_does_not_slow_the_other_queues() {
    let hooks = StoreHooks { claims_unavailable_in: vec!["a".into()], ..StoreHooks::default() };
    let h = Harness::with_store(Faulty::hooked(MemoryStore::new(), hooks));
    // One slot, nothing claimed ahead: queue `b` claims once per step.
    let config = WorkerConfig {
        queues: vec![("a".into(), 1), ("b".into(), 1)],
        claim_ahead: Duration::ZERO,
        ..h.config()
    };
    let worker = h.worker(config, steps(|_| done()));
    let began = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..10 {
        ids.push(h.start(new().queue("b")).await);
    }
    for id in ids {
        h.wait(id, "done", |r| r.status == Status::Done).await;
    }
    // Ten claims of `b` in a row: one each back-off of `a` (50 ms doubling to 5 s) would
    // take more than 8 s.
    let took = began.elapsed();
    assert!(took < Duration::from_secs(2), "queue b's ten steps took {took:?}");
    let claim = worker.health().get(WorkerLoop::Claim).cloned().expect("claim loop");
    let (_, error) = claim.last_error.expect("queue a's failure is in the claim loop's health");
    assert!(error.contains("claim from queue a"), "{error}");
    assert!(claim.consecutive_failures > 0, "a queue still failing reads healthy");
    worker.shutdown().await;
}

#[tokio::test]
async fn a_lease_taken_away_before_shutdown_is_not_counted_as_released() {
    let h = Harness::new();
    let worker = running_step_whose_lease_is_taken(&h).await;
    // Shutdown asks to release it; the store has nothing of this worker's to release.
    let stats = worker.shutdown().await;
    assert_eq!(stats.released.load(Ordering::Relaxed), 0);
}

/// A worker that registers no machine (one kept for schedules, timers and pruning) claims
/// nothing: another machine's ready instance is left exactly as it was (no claim, no
/// release, its place in the queue kept), while the worker's other loops run.
#[tokio::test]
async fn a_worker_with_no_machine_claims_nothing() {
    let h = Harness::with_store(Faulty::new(MemoryStore::new()));
    let id = h.start(new()).await;
    let before = h.client.get(id).await.unwrap().instance;
    let worker = h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())).spawn();
    // About 200 poll intervals of the harness's worker.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let reaper = worker.health().get(WorkerLoop::Reaper).cloned().unwrap_or_default();
    let stats = worker.shutdown().await;
    assert_eq!(h.store.calls("instance_claim"), 0, "a claim naming no machine takes any");
    assert_eq!(stats.released.load(Ordering::Relaxed), 0);
    let after = h.client.get(id).await.unwrap().instance;
    assert_eq!(
        (after.status, after.eligible_at, after.fencing_token, after.attempt),
        (Status::Runnable, before.eligible_at, before.fencing_token, 0),
        "the instance was touched"
    );
    assert!(reaper.last_success.is_some(), "the reaper ran: {reaper:?}");
}

/// A chart whose definition names an action no code was bound to is refused when the
/// worker starts, with the action named and the fix, rather than dead-lettering every
/// instance that reaches it.
#[tokio::test]
async fn a_worker_refuses_to_start_with_an_unbound_action() {
    let h = Harness::new();
    let def = Definition::builder("notifier", 1)
        .initial("idle")
        .state("idle", |s| s.on("GO", |t| t.target("sent").action("notify")))
        .final_state("sent")
        .build()
        .expect("valid chart");
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(ChartMachine::new(def));
    let error = worker.check().expect_err("an unbound action is refused");
    assert_eq!(
        error,
        "machine notifier v1 cannot run on this worker; missing: action `notify`. Fix: bind \
         each action with `ChartMachine::action(name, …)`."
    );
    let Err(error) = worker.try_spawn() else { panic!("the worker started") };
    assert!(error.contains("action `notify`"), "{error}");
}

/// A delegated child that finishes at once.
struct Charge;

#[async_trait]
impl StepMachine for Charge {
    fn machine(&self) -> MachineRef {
        MachineRef::new("charge", 1)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!({ "charged": true }), step: None })
    }
}

/// Children sent with `ChartMachine::with_child_queue` to a queue the program did not list
/// are served by the worker that registers the chart: the child runs and the parent's
/// `@done` fires.
#[tokio::test]
async fn children_sent_to_a_queue_set_in_code_are_served() {
    let h = Harness::new();
    let def = Definition::builder("checkout", 1)
        .initial("paying")
        .state("paying", |s| s.machine("charge").on_done(|b| b.target("paid")))
        .final_state("paid")
        .build()
        .expect("valid chart");
    let chart = ChartMachine::new(def).with_child_queue("charge", "payments");
    let id = h.start(chart.new_instance(json!({}))).await;
    // Only the default queue is listed.
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(chart)
        .register(Charge);
    let worker = h.hinted(worker).spawn();
    h.wait(id, "paid", |r| r.status == Status::Done).await;
    let children = h.client.get(id).await.unwrap().children;
    assert_eq!(children.len(), 1);
    let child = h.client.get(children[0].id).await.unwrap().instance;
    assert_eq!((child.queue.as_str(), child.status), ("payments", Status::Done));
    worker.shutdown().await;
}

/// A machine's configuration in code that sets what a machine's configuration does not
/// apply (a queue's concurrency or claim order, a priority, alert thresholds) is refused
/// when the worker starts, naming the field and where it belongs, instead of silently
/// changing nothing.
#[test]
fn a_machine_configuration_setting_what_it_does_not_apply_is_refused() {
    let h = Harness::new();
    let def =
        || Definition::builder("m", 1).initial("a").final_state("a").build().expect("valid chart");
    let cases = [
        (
            "concurrency",
            QueueConfig { concurrency: 1, ..QueueConfig::default() },
            "WorkerConfig::queues",
        ),
        (
            "strategy",
            QueueConfig {
                strategy: keel_core::config::Strategy::Priority,
                ..QueueConfig::default()
            },
            "[queues.<name>] strategy",
        ),
        (
            "priority",
            QueueConfig { priority: Priority::High, ..QueueConfig::default() },
            "NewInstance::priority",
        ),
        (
            "alerts",
            QueueConfig {
                alerts: keel_core::config::AlertThresholds {
                    pending_warning: Some(5),
                    ..Default::default()
                },
                ..QueueConfig::default()
            },
            "[machines.<machine>.queue.alerts]",
        ),
    ];
    for (field, config, fix) in cases {
        let chart = ChartMachine::new(def()).with_config(config);
        let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config()).register(chart);
        let refused = worker.check().expect_err(field);
        assert!(refused.contains(&format!("`{field}`")) && refused.contains(fix), "{refused}");
        assert!(refused.contains("machine m v1"), "{refused}");
    }
    // What a machine's configuration applies is accepted.
    let applied = QueueConfig { timeout: Duration::from_secs(5), ..QueueConfig::default() };
    let chart = ChartMachine::new(def()).with_config(applied);
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config()).register(chart);
    assert_eq!(worker.check(), Ok(()));
}

/// A machine whose steps count their runs and take a while.
struct SlowCounted(Arc<AtomicUsize>, Duration);

#[async_trait]
impl StepMachine for SlowCounted {
    fn machine(&self) -> MachineRef {
        machine()
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.1).await;
        done()
    }
}

/// Two workers spawned in one process on one store with the default id: the second is
/// numbered (`<id>/2`) instead of taking the first's id, so its start-up reclaim leaves
/// the first's live lease alone and the first's step runs once. Once both stopped, the
/// default id is free again.
#[tokio::test]
async fn workers_with_the_default_id_on_one_store_are_numbered_and_keep_their_leases() {
    let h = Harness::new();
    let default = WorkerConfig::default().worker_id;
    let config = WorkerConfig { worker_id: default.clone(), ..h.config() };
    let runs = Arc::new(AtomicUsize::new(0));
    let slow = || SlowCounted(Arc::clone(&runs), Duration::from_millis(500));
    let id = h.start(new()).await;
    let first = h.worker(config.clone(), slow());
    let row = h.wait(id, "leased by the first", |r| r.lease_owner.is_some()).await;
    assert_eq!(row.lease_owner.as_ref(), Some(&default));
    // The second serves another queue: what it claims is its own.
    let second = WorkerConfig { queues: vec![("second".into(), 1)], ..config.clone() };
    let second = h.worker(second, slow());
    let other = h.start(new().queue("second")).await;
    let row = h.wait(other, "leased by the second", |r| r.lease_owner.is_some()).await;
    assert_eq!(row.lease_owner, Some(WorkerId(format!("{}/2", default.0))), "numbered");
    for id in [id, other] {
        h.wait(id, "done", |r| r.status == Status::Done).await;
    }
    let first = first.shutdown().await;
    second.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each step ran once");
    assert_eq!(first.lease_lost.load(Ordering::Relaxed), 0, "the first kept its lease");
    // Both stopped: the next worker with the default id takes it as it is.
    let third = h.worker(config, slow());
    let again = h.start(new()).await;
    let row = h.wait(again, "leased by the third", |r| r.lease_owner.is_some()).await;
    assert_eq!(row.lease_owner, Some(default));
    third.shutdown().await;
}

/// A worker given an id that a running worker on the same store in this process uses is
/// refused at spawn, naming the id and `WorkerConfig::named`; another store has ids of
/// its own, and the id is free again once its worker stopped, by shutdown or by its
/// handle being dropped.
#[tokio::test]
async fn a_named_worker_id_in_use_on_the_same_store_is_refused_until_its_worker_stops() {
    let h = Harness::new();
    let config = WorkerConfig { worker_id: WorkerId("twin".into()), ..h.config() };
    let spawn = |h: &Harness| {
        Worker::new(Arc::clone(&h.store), h.clock.clone(), config.clone())
            .register(steps(|_| done()))
            .try_spawn()
    };
    let first = spawn(&h).expect("the first starts");
    let Err(error) = spawn(&h) else { panic!("a second worker `twin` started on the store") };
    assert!(error.contains("`twin`") && error.contains("WorkerConfig::named"), "{error}");
    let elsewhere = Harness::new();
    spawn(&elsewhere).expect("another store has ids of its own").shutdown().await;
    first.shutdown().await;
    let second = spawn(&h).expect("free once the first shut down");
    drop(second);
    let mut freed = None;
    for _ in 0..500 {
        if let Ok(worker) = spawn(&h) {
            freed = Some(worker);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    freed.expect("free once the dropped worker stopped").shutdown().await;
}

/// The client's purge by age keeps the letters of instances still suspended (a letter is
/// the only handle to retry its instance), as the worker's retention does; the store's
/// purge with `keep_suspended: false` deletes those too.
#[tokio::test]
async fn the_clients_purge_by_age_keeps_the_letters_of_suspended_instances() {
    use keel_core::ports::store::DeadLetterPurgeParams;
    let h = Harness::new();
    let config = WorkerConfig { retention: None, ..h.config() };
    let worker = h.worker(config, steps(|_| Err(StepError::fatal("refused"))));
    let (kept, purged) = (h.start(new()).await, h.start(new()).await);
    for id in [kept, purged] {
        h.wait(id, "dead-lettered", |r| r.status == Status::Suspended).await;
    }
    worker.shutdown().await;
    h.client.cancel(keel_scheduler::Cancel::new(purged)).await.expect("cancel");
    h.clock.advance(Duration::from_secs(3_600));
    let gone = h.client.dead_letter_purge_older_than(Duration::from_secs(60)).await.unwrap();
    assert_eq!(gone, 1, "only the letter of the cancelled instance");
    let left = h.client.dead_letters(DeadLetterFilter::default()).await.unwrap();
    let left: Vec<InstanceId> = left.iter().map(|l| l.letter.instance).collect();
    assert_eq!(left, [kept], "the suspended instance keeps its letter");
    let all = DeadLetterPurgeParams { selector: None, older_than: None, keep_suspended: false };
    assert_eq!(h.store.dead_letter_purge(all).await.unwrap(), 1, "the store's purge takes it");
}

/// Shutdown gives back the leases of more steps than one release call takes (a store
/// refuses more than `COMMIT_BATCH_MAX` leases in one call): every step still running
/// is runnable again at once, without counting an attempt, rather than waiting for its
/// lease to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_gives_back_more_leases_than_one_release_call_takes() {
    let h = Harness::new();
    let n = keel_core::limits::COMMIT_BATCH_MAX + 100;
    let instances = vec![new(); n];
    let ids: Vec<InstanceId> = h
        .store
        .instance_insert(InsertParams { instances, now: h.clock.now() })
        .await
        .unwrap()
        .iter()
        .map(|inserted| inserted.id())
        .collect();
    assert_eq!(ids.len(), n);
    let started = Arc::new(AtomicUsize::new(0));
    let config = WorkerConfig {
        queues: vec![("default".into(), n)],
        shutdown_grace: Duration::from_millis(50),
        ..h.config()
    };
    let worker =
        h.worker(config.clone(), SlowCounted(Arc::clone(&started), Duration::from_secs(60)));
    let all_running = within(Duration::from_secs(10), || started.load(Ordering::SeqCst) == n);
    assert!(all_running.await, "{} of {n} steps started", started.load(Ordering::SeqCst));
    let stats = worker.shutdown().await;
    assert_eq!(stats.released.load(Ordering::Relaxed), n as u64);
    let params = LeaseReapParams { owner: Some(config.worker_id), limit: 10, now: h.clock.now() };
    let left = h.store.lease_reap(params).await.unwrap();
    assert!(left.is_empty(), "{} leases were left to expire", left.len());
    for id in ids {
        let row = h.client.get(id).await.unwrap().instance;
        assert_eq!((row.status, row.attempt, row.lease_owner), (Status::Runnable, 0, None));
    }
}

/// A machine's configuration in code is checked when the worker starts even with no
/// configuration file: a zero timeout (every step would time out at once) or a retry
/// delay over its bound is refused at spawn, naming the machine and the field.
#[tokio::test]
async fn a_machine_configuration_in_code_out_of_bounds_is_refused_at_spawn() {
    let h = Harness::new();
    let over = keel_core::limits::RETRY_DELAY_MAX + Duration::from_secs(86_400);
    let cases = [
        ("timeout", QueueConfig { timeout: Duration::ZERO, ..QueueConfig::default() }),
        (
            "retry.max_delay",
            QueueConfig {
                retry: RetryPolicy { max_delay: over, ..RetryPolicy::default() },
                ..QueueConfig::default()
            },
        ),
    ];
    for (field, config) in cases {
        assert!(h.config().settings.is_none());
        let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
            .register(Fn_(|_: &StepContext| done(), config));
        let refused = worker.try_spawn().err().unwrap_or_else(|| panic!("{field} accepted"));
        assert!(refused.contains(&format!("{field}:")), "{refused}");
        assert!(refused.contains("machine m v1"), "{refused}");
    }
}

/// A worker with `reap_expired` off leaves another worker's expired lease alone (where
/// something else reaps), and still records itself in the worker registry.
#[tokio::test]
async fn a_worker_that_does_not_reap_leaves_an_expired_lease_alone() {
    let h = Harness::new();
    let id = h.start(new()).await;
    claimed_by_a_dead_worker(&h).await;
    h.clock.advance(Duration::from_secs(31));
    let config = WorkerConfig { reap_expired: false, ..h.config() };
    let worker = h.worker(config.clone(), steps(|_| done()));
    // Several reap periods go by.
    tokio::time::sleep(config.reap_interval * 5).await;
    assert_eq!(h.status(id).await, Status::Executing, "the expired lease was reaped");
    let listed = h.store.worker_list(keel_core::Timestamp(0)).await.unwrap();
    assert!(
        listed.iter().any(|w| w.id == config.worker_id),
        "the worker records itself all the same"
    );
    worker.shutdown().await;
}
