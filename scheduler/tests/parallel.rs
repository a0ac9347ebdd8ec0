//! Parallel dispatch end to end: region tasks as child instances,
//! results merged into the parent one at a time, exactly one `@done` / `@fail`, conflicts,
//! stalls, guard aborts, replays, the region timeout and the `dispatched` flag.
//!
//! Every test runs twice, driven by a `VirtualClock`: `memory::*` on `MemoryStore` with one
//! worker, and `postgres::*` on PostgreSQL (a fresh schema per test) with two workers
//! racing for the parent and its region tasks, on a multi-threaded runtime. The Postgres
//! tests need `KEEL_TEST_DATABASE_URL`; without it they are skipped loudly, and under
//! `KEEL_REQUIRE_BACKENDS=1` they fail.

#![allow(clippy::items_after_statements)]

#[macro_use]
mod common;

use common::{Harness, TestStore};
use keel_core::chart::{ActionError, Definition, Event};
use keel_core::config::QueueConfig;
use keel_core::ports::Clock;
use keel_core::ports::store::LeaseReapParams;
use keel_core::retry::RetryPolicy;
use keel_core::{Instance, InstanceId, NewInstance, NewSignal, Status, WorkerId};
use keel_parallel::{ParallelConfig, REGION_POSITION, REGION_REPORT_EVENT};
use keel_scheduler::WorkerHandle;
use keel_scheduler::chart::dispatched;
use keel_scheduler::{ActionContext, ChartMachine, SweepConfig, Sweeper, Worker, WorkerConfig};
use keel_timers::SweepOutcome;
use serde_json::{Value, json};
use std::future::{Ready, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::{Barrier, Notify};

on_every_store!(
    regions_finishing_together_fire_exactly_one_done,
    the_dispatched_flag_is_true_after_dispatch_and_false_inline,
    a_single_region_with_entry_actions_runs_inline,
    both_regions_failing_fire_one_fail_and_one_parallel_fail,
    without_fail_the_machine_stays_and_records_parallel_fail_once,
    a_late_sibling_after_fail_is_a_no_op_adding_no_history,
    a_result_for_a_region_that_advanced_is_guard_aborted_with_what_it_discarded,
    a_result_arriving_after_the_state_was_left_is_guard_aborted,
    a_replayed_region_task_or_report_after_completion_is_a_no_op,
    if_the_commit_entering_the_parallel_state_fails_no_region_task_exists,
    a_rejected_commit_entering_the_parallel_state_leaves_no_region_task,
    a_key_written_by_both_regions_is_recorded_as_a_conflict,
    a_region_that_does_not_advance_is_recorded_as_stalled,
    the_region_timeout_fails_a_stuck_parallel_state_once,
    two_workers_finish_many_dispatches_with_exactly_one_done_each,
    a_region_task_over_its_job_timeout_fails_with_a_timeout_on_its_own_queue,
    the_files_parallel_dispatch_turns_dispatch_on,
    the_files_machine_section_turns_dispatch_off,
    region_tasks_on_a_queue_set_in_code_are_served_by_the_charts_workers,
    job_timeout_and_job_tries_win_over_the_files_queue_timeout_and_retry,
);

/// Two regions, each with an entry action that may raise the event finishing the region.
fn order(with_fail: bool) -> Definition {
    Definition::builder("order", 1)
        .initial("processing")
        .parallel("processing", |p| {
            let p = p
                .entry("prepare")
                .state("inventory", |r| {
                    r.initial("checking")
                        .state("checking", |s| {
                            s.entry("check_inventory").on_to("INVENTORY_OK", "ready")
                        })
                        .final_state("ready")
                })
                .state("payment", |r| {
                    r.initial("validating")
                        .state("validating", |s| {
                            s.entry("validate_payment")
                                .on_to("PAYMENT_OK", "ok")
                                .on_to("SKIP", "ok")
                        })
                        .final_state("ok")
                })
                .on_done(|b| b.target("completed"))
                .on_to("ABORT", "aborted")
                .on_to("PAUSE", "paused");
            if with_fail { p.on_fail(|b| b.target("failed")) } else { p }
        })
        .final_state("completed")
        .final_state("failed")
        .final_state("aborted")
        .leaf("paused")
        .build()
        .expect("valid chart")
}

type Done = Ready<Result<(), ActionError>>;

/// An entry action that sets `key` to `true` and raises `raise`.
fn writes(
    key: &'static str,
    raise: Option<&'static str>,
) -> impl Fn(ActionContext, Event) -> Done + Send + Sync + 'static {
    move |ctx, _| {
        ctx.set(key, true);
        if let Some(e) = raise {
            ctx.raise(e);
        }
        ready(Ok(()))
    }
}

fn noop(_: ActionContext, _: Event) -> Done {
    ready(Ok(()))
}

fn config(tries: u32) -> ParallelConfig {
    ParallelConfig { job_tries: tries, ..ParallelConfig::enabled() }
}

fn machine(with_fail: bool, parallel: ParallelConfig) -> ChartMachine {
    ChartMachine::new(order(with_fail)).with_parallel(parallel).action("prepare", noop)
}

fn happy(parallel: ParallelConfig) -> ChartMachine {
    machine(true, parallel)
        .action("check_inventory", writes("inventory", Some("INVENTORY_OK")))
        .action("validate_payment", writes("payment", Some("PAYMENT_OK")))
}

/// The workers running one test: [`TestStore::WORKERS`] of them, with distinct ids.
struct Workers(Vec<WorkerHandle>);

impl Workers {
    /// Commits refused as `LeaseLost`, over every worker.
    fn lease_lost(&self) -> u64 {
        self.0.iter().map(|w| w.stats().lease_lost.load(Ordering::Relaxed)).sum()
    }

    async fn shutdown(self) {
        for w in self.0 {
            w.shutdown().await;
        }
    }
}

fn spawn<S: TestStore>(h: &Harness<S>, m: ChartMachine) -> Workers {
    spawn_with(h, m, None)
}

/// [`spawn`], the workers reading the configuration file `file` when given.
fn spawn_with<S: TestStore>(h: &Harness<S>, m: ChartMachine, file: Option<&str>) -> Workers {
    let handles = vec![m; S::WORKERS]
        .into_iter()
        .enumerate()
        .map(|(n, m)| {
            let worker_id = WorkerId(format!("w{}", n + 1));
            let mut config = WorkerConfig { worker_id, timers: None, ..h.config() };
            if let Some(file) = file {
                let settings = keel_core::config::KeelConfig::load(file, |_| None).expect("file").0;
                config = config.with_settings(settings).expect("applied");
            }
            h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m)).spawn()
        })
        .collect();
    Workers(handles)
}

fn position(row: &Instance) -> Vec<String> {
    serde_json::from_str(&row.position).unwrap_or_default()
}

fn in_state(state: &'static str) -> impl Fn(&Instance) -> bool {
    move |r| r.status == Status::AwaitingSignal && position(r).iter().any(|p| p == state)
}

/// The data of every history entry of `kind`, oldest first.
async fn entries<S: TestStore>(h: &Harness<S>, id: InstanceId, kind: &str) -> Vec<Value> {
    let history = h.client.get(id).await.expect("get").history;
    history.iter().filter(|r| r.entry.kind == kind).map(|r| r.entry.data.clone()).collect()
}

/// The configuration the last macrostep ended in, from history (the same for a waiting
/// and a finished instance, whose position is its final configuration).
async fn last_configuration<S: TestStore>(h: &Harness<S>, id: InstanceId) -> Vec<Value> {
    let steps = entries(h, id, "MACROSTEP").await;
    steps.last().and_then(|s| s["configuration"].as_array().cloned()).unwrap_or_default()
}

/// Polls `done` every 5 ms until it holds; panics naming `what` after 2 s.
async fn eventually(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..400 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Waits until the instance's history holds `n` or more entries of `kind`.
async fn until_recorded<S: TestStore>(h: &Harness<S>, id: InstanceId, kind: &str, n: usize) {
    let what = format!("instance {id:?} to record {n} `{kind}` entries");
    eventually(&what, async || entries(h, id, kind).await.len() >= n).await;
}

async fn history_len<S: TestStore>(h: &Harness<S>, id: InstanceId) -> usize {
    h.client.get(id).await.expect("get").history.len()
}

/// Waits until the instance has no inbox left and is parked (or terminal).
async fn settled<S: TestStore>(h: &Harness<S>, id: InstanceId) {
    for _ in 0..1_000 {
        let d = h.client.get(id).await.expect("get");
        if d.inbox.is_empty()
            && matches!(d.instance.status, Status::AwaitingSignal | Status::Done | Status::Failed)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("instance {id:?} did not settle");
}

async fn region_tasks<S: TestStore>(
    h: &Harness<S>,
    id: InstanceId,
) -> Vec<keel_core::instance::ChildSummary> {
    h.client.get(id).await.expect("get").children
}

async fn regions_finishing_together_fire_exactly_one_done<S: TestStore>() {
    let h = S::harness().await;
    let barrier = Arc::new(Barrier::new(2));
    let (b1, b2) = (Arc::clone(&barrier), Arc::clone(&barrier));
    let m = machine(true, config(3))
        .action("check_inventory", move |ctx, _| {
            let b = Arc::clone(&b1);
            async move {
                b.wait().await;
                ctx.set("inventory", 5);
                ctx.raise("INVENTORY_OK");
                Ok(())
            }
        })
        .action("validate_payment", move |ctx, _| {
            let b = Arc::clone(&b2);
            async move {
                b.wait().await;
                ctx.set("payment", "ok");
                ctx.raise("PAYMENT_OK");
                Ok(())
            }
        });
    let id = h.start(m.new_instance(json!({ "order": 7 }))).await;
    let worker = spawn(&h, m);
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(
        row.result.expect("result"),
        json!({ "order": 7, "inventory": 5, "payment": "ok" }),
        "both diffs merged, no bookkeeping left in the result"
    );
    assert_eq!(
        entries(&h, id, "PARALLEL_DONE").await,
        [json!({ "parallel_state_id": "processing" })]
    );
    assert_eq!(entries(&h, id, "PARALLEL_REGION_ENTER").await.len(), 2);
    assert_eq!(entries(&h, id, "PARALLEL_DISPATCH").await.len(), 1);
    let done_steps = entries(&h, id, "MACROSTEP")
        .await
        .into_iter()
        .filter(|m| m["records"].as_array().is_some_and(|r| r.contains(&json!("enter completed"))))
        .count();
    assert_eq!(done_steps, 1, "exactly one @done");
    let tasks = region_tasks(&h, id).await;
    assert_eq!(tasks.len(), 2);
    assert!(tasks.iter().all(|t| t.status == Status::Done));
    worker.shutdown().await;
}

async fn the_dispatched_flag_is_true_after_dispatch_and_false_inline<S: TestStore>() {
    let h = S::harness().await;
    let gate = Arc::new(Notify::new());
    let g = Arc::clone(&gate);
    let m = happy(config(3)).action("validate_payment", move |ctx, _| {
        let g = Arc::clone(&g);
        async move {
            g.notified().await;
            ctx.raise("PAYMENT_OK");
            Ok(())
        }
    });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "entered", in_state("processing")).await;
    // The ungated region's report may already have been applied in a later macrostep, so
    // look for the macrostep that entered `processing` rather than the latest one.
    let entering: Vec<Value> = entries(&h, id, "MACROSTEP")
        .await
        .into_iter()
        .filter(|m| m["records"].as_array().is_some_and(|r| r.contains(&json!("enter processing"))))
        .collect();
    assert_eq!(entering.len(), 1);
    assert_eq!(entering[0]["dispatched"], json!(true), "the entering step dispatched");
    let d = h.client.get(id).await.unwrap();
    assert_eq!(d.instance.context.get("payment"), None, "entry work not done inline");
    gate.notify_one();
    h.wait(id, "completed", |r| r.status == Status::Done).await;
    worker.shutdown().await;

    // Inline: same chart, dispatch off.
    let h = S::harness().await;
    let m = happy(ParallelConfig::default());
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(row.result.unwrap(), json!({ "inventory": true, "payment": true }));
    let d = h.client.get(id).await.unwrap();
    assert!(!dispatched(&d));
    assert!(d.children.is_empty(), "no region task inline");
    assert!(entries(&h, id, "PARALLEL_DONE").await.is_empty(), "inline records no dispatch events");
    worker.shutdown().await;
}

async fn a_single_region_with_entry_actions_runs_inline<S: TestStore>() {
    let h = S::harness().await;
    let m = machine(true, config(3))
        .action("check_inventory", writes("inventory", Some("INVENTORY_OK")))
        .action("validate_payment", noop);
    // Only one region's action does anything, but both *have* entry actions: dispatched.
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "payment waits", in_state("processing.payment.validating")).await;
    settled(&h, id).await;
    assert_eq!(region_tasks(&h, id).await.len(), 2);
    worker.shutdown().await;

    let def = Definition::builder("solo", 1)
        .initial("p")
        .parallel("p", |p| {
            p.state("a", |r| r.initial("x").state("x", |s| s.entry("work")))
                .state("b", |r| r.initial("y").leaf("y"))
        })
        .build()
        .unwrap();
    let h = S::harness().await;
    let m = ChartMachine::new(def).with_parallel(config(3)).action("work", writes("work", None));
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    let row = h.wait(id, "entered", in_state("p.a.x")).await;
    assert_eq!(row.context["work"], json!(true), "one region: ran inline");
    assert!(region_tasks(&h, id).await.is_empty());
    worker.shutdown().await;
}

async fn both_regions_failing_fire_one_fail_and_one_parallel_fail<S: TestStore>() {
    let h = S::harness().await;
    let fail = |_: ActionContext, _: Event| -> Done { ready(Err(ActionError::new("API down"))) };
    let m = machine(true, ParallelConfig { job_backoff: Duration::from_secs(30), ..config(2) })
        .action("check_inventory", fail)
        .action("validate_payment", fail);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "entered", in_state("processing")).await;
    for task in region_tasks(&h, id).await {
        h.wait(task.id, "a retry", |r| r.attempt == 1 && r.status == Status::Runnable).await;
    }
    h.clock.advance(Duration::from_secs(30));
    let row = h.wait(id, "failed", |r| r.status == Status::Done).await;
    // The first report to arrive fails the parent; wait for the other task's terminal
    // commit too, so a second @fail would be seen.
    for task in region_tasks(&h, id).await {
        h.wait(task.id, "the task failed", |r| r.status == Status::Failed).await;
    }
    assert!(last_configuration(&h, id).await.contains(&json!("failed")), "{row:?}");
    let fails = entries(&h, id, "PARALLEL_FAIL").await;
    assert_eq!(fails.len(), 1, "{fails:?}");
    assert_eq!(fails[0]["attempts"], json!(2));
    assert_eq!(fails[0]["exception"], json!("ActionError"));
    assert!(fails[0]["error"].as_str().unwrap().contains("API down"));
    assert!(fails[0]["region_id"].as_str().unwrap().starts_with("processing."));
    let fail_steps = entries(&h, id, "MACROSTEP")
        .await
        .into_iter()
        .filter(|m| m["records"].as_array().is_some_and(|r| r.contains(&json!("enter failed"))))
        .count();
    assert_eq!(fail_steps, 1, "exactly one @fail");
    worker.shutdown().await;
}

async fn without_fail_the_machine_stays_and_records_parallel_fail_once<S: TestStore>() {
    let h = S::harness().await;
    let m = machine(false, config(1))
        .action("check_inventory", |_, _| -> Done {
            ready(Err(ActionError::permanent("no stock")))
        })
        .action("validate_payment", writes("payment", Some("PAYMENT_OK")));
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "payment finished", in_state("processing.payment.ok")).await;
    until_recorded(&h, id, "PARALLEL_FAIL", 1).await;
    settled(&h, id).await;
    let fails = entries(&h, id, "PARALLEL_FAIL").await;
    assert_eq!(fails.len(), 1);
    assert_eq!(fails[0]["region_id"], json!("processing.inventory"));
    assert_eq!(fails[0]["attempts"], json!(1));
    let row = h.client.get(id).await.unwrap().instance;
    assert!(position(&row).contains(&"processing.inventory.checking".to_owned()), "stays");
    assert!(
        entries(&h, id, "EVENT_UNHANDLED").await.is_empty(),
        "internal @fail is not 'unhandled'"
    );
    // Still operable: an event finishes the region by hand.
    h.client.send(NewSignal::new(id, "INVENTORY_OK")).await.unwrap();
    h.wait(id, "completed", |r| r.status == Status::Done).await;
    worker.shutdown().await;
}

async fn a_late_sibling_after_fail_is_a_no_op_adding_no_history<S: TestStore>() {
    let h = S::harness().await;
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let m = machine(true, ParallelConfig { job_backoff: Duration::from_secs(30), ..config(3) })
        .action("check_inventory", |_, _| -> Done {
            ready(Err(ActionError::permanent("no stock")))
        })
        .action("validate_payment", move |ctx, _| {
            // Fails its first attempt, so its retry starts after the sibling's @fail.
            let first = r.fetch_add(1, Ordering::SeqCst) == 0;
            ctx.set("payment", true);
            ready(if first { Err(ActionError::new("flaky")) } else { Ok(()) })
        });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "failed", |r| r.status == Status::Done).await;
    let before = history_len(&h, id).await;
    h.clock.advance(Duration::from_secs(30));
    eventually("every region task to end", async || {
        region_tasks(&h, id).await.iter().all(|t| t.status.is_terminal())
    })
    .await;
    let tasks = region_tasks(&h, id).await;
    assert!(tasks.iter().all(|t| t.status.is_terminal()), "{tasks:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry did not run the action again");
    let payment = tasks.iter().find(|t| t.status == Status::Done).expect("the late sibling");
    assert_eq!(payment.result, Some(json!({ "skipped": "machine_left_parallel_state" })));
    assert_eq!(history_len(&h, id).await, before, "the parent saw nothing");
    worker.shutdown().await;
}

/// Runs the chart with a payment action that waits for the gate, sends `event` once the
/// inventory region's result is in, then opens the gate; returns the guard abort records.
async fn guard_abort_after<S: TestStore>(event: &str, until: &'static str) -> (Vec<Value>, Value) {
    let h = S::harness().await;
    let gate = Arc::new(Notify::new());
    let g = Arc::clone(&gate);
    let m = machine(true, config(3)).action("check_inventory", noop).action(
        "validate_payment",
        move |ctx, _| {
            let g = Arc::clone(&g);
            async move {
                g.notified().await;
                ctx.set("payment", true);
                ctx.set("receipt", "r-1");
                ctx.raise("PAYMENT_OK");
                Ok(())
            }
        },
    );
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    until_recorded(&h, id, "PARALLEL_REGION_ENTER", 1).await;
    settled(&h, id).await;
    h.client.send(NewSignal::new(id, event)).await.unwrap();
    h.wait(id, "moved on", in_state(until)).await;
    gate.notify_one();
    until_recorded(&h, id, "PARALLEL_REGION_GUARD_ABORT", 1).await;
    settled(&h, id).await;
    let aborts = entries(&h, id, "PARALLEL_REGION_GUARD_ABORT").await;
    let context = h.client.get(id).await.unwrap().instance.context;
    worker.shutdown().await;
    (aborts, context)
}

async fn a_result_for_a_region_that_advanced_is_guard_aborted_with_what_it_discarded<
    S: TestStore,
>() {
    let (aborts, context) = guard_abort_after::<S>("SKIP", "processing.payment.ok").await;
    assert_eq!(
        aborts,
        [json!({
            "region_id": "processing.payment",
            "reason": "region_already_advanced",
            "discarded_context": ["payment", "receipt"],
            "discarded_events": 1,
            "work_was_discarded": true,
        })]
    );
    assert_eq!(context.get("receipt"), None, "nothing of the discarded work applied");
}

async fn a_result_arriving_after_the_state_was_left_is_guard_aborted<S: TestStore>() {
    let (aborts, context) = guard_abort_after::<S>("PAUSE", "paused").await;
    assert_eq!(aborts.len(), 1);
    assert_eq!(aborts[0]["reason"], json!("machine_left_parallel_state"));
    assert_eq!(aborts[0]["discarded_context"], json!(["payment", "receipt"]));
    assert_eq!(context.get("payment"), None);
}

async fn a_replayed_region_task_or_report_after_completion_is_a_no_op<S: TestStore>() {
    let h = S::harness().await;
    let m = machine(true, config(3))
        .action("check_inventory", writes("inventory", None))
        .action("validate_payment", writes("payment", None));
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    until_recorded(&h, id, "PARALLEL_REGION_ENTER", 2).await;
    settled(&h, id).await;
    let before = history_len(&h, id).await;
    let context = h.client.get(id).await.unwrap().instance.context;

    // Replay the task itself: a fresh instance with the same work.
    let original = region_tasks(&h, id).await[0].id;
    let task = h.client.get(original).await.unwrap().instance;
    let replay =
        NewInstance::new(task.machine.clone(), REGION_POSITION).context(task.context.clone());
    let replay = h.client.start(replay).await.unwrap().id();
    // Started by hand it has no parent link, so no lock-free pre-check: its report reaches
    // the parent, whose guard sees the region applied already and does nothing.
    h.wait(replay, "replay done", |r| r.status == Status::Done).await;
    settled(&h, id).await;

    // Replay the report: delivered again under another dedup key.
    let report = entries(&h, original, "STEP_DONE").await;
    assert_eq!(report.len(), 1);
    let payload = {
        let mut ctx = task.context.clone();
        let key = ctx["task"]["key"].take();
        json!({ "outcome": "completed", "key": key, "diff": {"changed": {}, "added": {"x": 1}, "removed": []}, "baseline": {}, "raised": [] })
    };
    h.client.send(NewSignal::new(id, REGION_REPORT_EVENT).payload(payload)).await.unwrap();
    settled(&h, id).await;
    let d = h.client.get(id).await.unwrap();
    assert_eq!(d.instance.context, context, "nothing applied");
    let new: Vec<&str> = d.history[before..].iter().map(|r| r.entry.kind.as_str()).collect();
    assert!(new.iter().all(|k| !k.starts_with("PARALLEL_") && *k != "MACROSTEP"), "{new:?}");
    worker.shutdown().await;
}

async fn if_the_commit_entering_the_parallel_state_fails_no_region_task_exists<S: TestStore>() {
    let h = S::harness().await;
    let fails = Arc::new(AtomicU32::new(1));
    let f = Arc::clone(&fails);
    let m = happy(config(3))
        .action("prepare", move |_, _| -> Done {
            let fail =
                f.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
            ready(if fail { Err(ActionError::new("db blip")) } else { Ok(()) })
        })
        .with_config(QueueConfig {
            retry: RetryPolicy { max_attempts: 3, ..RetryPolicy::default() },
            ..QueueConfig::default()
        });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "a retry", |r| r.attempt == 1 && r.status == Status::Runnable).await;
    assert!(region_tasks(&h, id).await.is_empty(), "the failed step spawned nothing");
    assert!(entries(&h, id, "PARALLEL_DISPATCH").await.is_empty());
    h.clock.advance(Duration::from_secs(60));
    h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(region_tasks(&h, id).await.len(), 2, "the successful retry dispatched");
    worker.shutdown().await;
}

/// The commit itself rejected: the entering step's lease is taken away while its action
/// runs (as when a worker stalls past its lease and the reaper hands the row on), another
/// run dispatches, and the stale run's commit — with its region tasks — is refused whole.
async fn a_rejected_commit_entering_the_parallel_state_leaves_no_region_task<S: TestStore>() {
    let h = S::harness().await;
    let calls = Arc::new(AtomicU32::new(0));
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (count, entering, gating) = (Arc::clone(&calls), Arc::clone(&entered), Arc::clone(&gate));
    let m = happy(config(3)).action("prepare", move |_, _| {
        let first = count.fetch_add(1, Ordering::SeqCst) == 0;
        let (entering, gating) = (Arc::clone(&entering), Arc::clone(&gating));
        async move {
            if first {
                entering.notify_one();
                gating.notified().await;
            }
            Ok(())
        }
    });
    let id = h.start(m.new_instance(json!({}))).await;
    let workers = spawn(&h, m);
    tokio::time::timeout(Duration::from_secs(5), entered.notified()).await.expect("first run");
    // Take the lease from the worker that holds it: the row is runnable again. A reap
    // skips a row another transaction has locked (here: the holder's heartbeat), so try
    // again, like the reaper's next round.
    let holder = h.client.get(id).await.expect("get").instance.lease_owner.expect("held");
    let mut reaped = Vec::new();
    eventually("the lease to be reaped", async || {
        let params = LeaseReapParams { owner: Some(holder.clone()), limit: 10, now: h.clock.now() };
        reaped = h.store.lease_reap(params).await.expect("reap");
        !reaped.is_empty()
    })
    .await;
    assert_eq!(reaped, [id]);
    // The second run dispatches and the machine completes while the first still waits.
    h.wait(id, "completed", |r| r.status == Status::Done).await;
    gate.notify_one();
    eventually("the stale commit to be refused", async || workers.lease_lost() == 1).await;
    assert_eq!(workers.lease_lost(), 1, "the stale run's commit was refused");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(region_tasks(&h, id).await.len(), 2, "only the accepted commit's tasks exist");
    assert_eq!(entries(&h, id, "PARALLEL_DISPATCH").await.len(), 1);
    workers.shutdown().await;
}

async fn a_key_written_by_both_regions_is_recorded_as_a_conflict<S: TestStore>() {
    let h = S::harness().await;
    let both = |region: &'static str, raise: &'static str| {
        move |ctx: ActionContext, _: Event| -> Done {
            ctx.set("total", region);
            ctx.set(region, true);
            ctx.raise(raise);
            ready(Ok(()))
        }
    };
    let m = machine(true, config(3))
        .action("check_inventory", both("inventory", "INVENTORY_OK"))
        .action("validate_payment", both("payment", "PAYMENT_OK"));
    let id = h.start(m.new_instance(json!({ "total": 0 }))).await;
    let worker = spawn(&h, m);
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    let conflicts = entries(&h, id, "PARALLEL_CONTEXT_CONFLICT").await;
    let enters = entries(&h, id, "PARALLEL_REGION_ENTER").await;
    let second = enters[1]["region_id"].clone();
    assert_eq!(conflicts, [json!({ "region_id": second, "conflicted_keys": ["total"] })]);
    let winner = second.as_str().unwrap().rsplit('.').next().unwrap().to_owned();
    assert_eq!(row.result.unwrap()["total"], json!(winner), "last writer wins");
    worker.shutdown().await;
}

async fn a_region_that_does_not_advance_is_recorded_as_stalled<S: TestStore>() {
    let h = S::harness().await;
    let m = machine(true, config(3))
        .action("check_inventory", writes("inventory", None))
        .action("validate_payment", noop);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    until_recorded(&h, id, "PARALLEL_REGION_STALLED", 2).await;
    let mut stalls = entries(&h, id, "PARALLEL_REGION_STALLED").await;
    stalls.sort_by_key(|s| s["region_id"].as_str().unwrap_or_default().to_owned());
    assert_eq!(
        stalls,
        [
            json!({ "region_id": "processing.inventory", "initial_state_id": "processing.inventory.checking", "context_changed": true }),
            json!({ "region_id": "processing.payment", "initial_state_id": "processing.payment.validating", "context_changed": false }),
        ]
    );
    settled(&h, id).await;
    h.client
        .send_many(vec![NewSignal::new(id, "INVENTORY_OK"), NewSignal::new(id, "PAYMENT_OK")])
        .await
        .unwrap();
    h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(entries(&h, id, "PARALLEL_DONE").await.len(), 1, "done by hand still records it");
    worker.shutdown().await;
}

/// Sweeps until the one due timer has been processed. A sweep never waits for a busy
/// instance (Postgres skips a timer whose instance another worker has locked and leaves
/// it for the next sweep), so, like the sweep service, try again.
async fn sweep<S: TestStore>(h: &Harness<S>) {
    let sweeper = Sweeper::new(Arc::clone(&h.store), h.clock.clone(), SweepConfig::default())
        .expect("sweeper");
    eventually("the due timer to be swept", async || {
        matches!(sweeper.sweep(&[]).await.expect("sweep"),
            SweepOutcome::Swept { report, .. } if report.processed > 0)
    })
    .await;
}

async fn the_region_timeout_fails_a_stuck_parallel_state_once<S: TestStore>() {
    let h = S::harness().await;
    let parallel = ParallelConfig { region_timeout: Duration::from_secs(120), ..config(3) };
    let m = machine(false, parallel)
        .action("check_inventory", writes("inventory", Some("INVENTORY_OK")))
        .action("validate_payment", noop);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    until_recorded(&h, id, "PARALLEL_REGION_ENTER", 2).await;
    settled(&h, id).await;
    h.clock.advance(Duration::from_secs(121));
    sweep(&h).await;
    until_recorded(&h, id, "PARALLEL_REGION_TIMEOUT", 1).await;
    settled(&h, id).await;
    assert_eq!(
        entries(&h, id, "PARALLEL_REGION_TIMEOUT").await,
        [
            json!({ "parallel_state_id": "processing", "timeout_seconds": 120, "stalled_regions": ["processing.payment"] })
        ]
    );
    // Without @fail the machine stays. The timer's event cannot be sent by a client (the
    // engine's own event names are reserved), so nothing fires it a second time.
    let before = entries(&h, id, "MACROSTEP").await.len();
    let refused = h.client.send(NewSignal::new(id, "parallel.timeout.processing")).await;
    let refused = refused.expect_err("an engine event name is refused");
    assert!(refused.to_string().contains("reserved"), "{refused}");
    settled(&h, id).await;
    assert_eq!(entries(&h, id, "PARALLEL_REGION_TIMEOUT").await.len(), 1);
    assert_eq!(entries(&h, id, "MACROSTEP").await.len(), before);
    worker.shutdown().await;

    // With @fail it fails the state; after that, and after @done, the timer is a no-op.
    let h = S::harness().await;
    let parallel = ParallelConfig { region_timeout: Duration::from_secs(120), ..config(3) };
    let m =
        machine(true, parallel).action("check_inventory", noop).action("validate_payment", noop);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "entered", in_state("processing")).await;
    assert_eq!(h.client.get(id).await.unwrap().timers.len(), 1, "one region timer armed");
    h.clock.advance(Duration::from_secs(121));
    sweep(&h).await;
    h.wait(id, "failed", |r| r.status == Status::Done).await;
    assert!(last_configuration(&h, id).await.contains(&json!("failed")));
    worker.shutdown().await;

    let h = S::harness().await;
    let parallel = ParallelConfig { region_timeout: Duration::from_secs(120), ..config(3) };
    let id = h.start(happy(parallel.clone()).new_instance(json!({}))).await;
    let worker = spawn(&h, happy(parallel));
    h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert!(h.client.get(id).await.unwrap().timers.is_empty(), "the timer was cancelled");
    worker.shutdown().await;
}

async fn two_workers_finish_many_dispatches_with_exactly_one_done_each<S: TestStore>() {
    let h = S::harness().await;
    let slow = |key: &'static str, raise: &'static str| {
        move |ctx: ActionContext, _: Event| async move {
            tokio::time::sleep(Duration::from_millis(fastrand_ms())).await;
            ctx.set(key, true);
            ctx.raise(raise);
            Ok(())
        }
    };
    let make = || {
        machine(true, config(3))
            .action("check_inventory", slow("inventory", "INVENTORY_OK"))
            .action("validate_payment", slow("payment", "PAYMENT_OK"))
    };
    let mut ids = Vec::new();
    for n in 0..12 {
        ids.push(h.start(make().new_instance(json!({ "n": n }))).await);
    }
    let workers: Vec<WorkerHandle> = ["w1", "w2"]
        .into_iter()
        .map(|w| {
            let config = WorkerConfig {
                worker_id: keel_core::WorkerId(w.into()),
                timers: None,
                ..h.config()
            };
            h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(make()))
                .spawn()
        })
        .collect();
    for &id in &ids {
        let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
        let result = row.result.expect("result");
        assert_eq!(
            (result["inventory"].clone(), result["payment"].clone()),
            (json!(true), json!(true))
        );
        assert_eq!(entries(&h, id, "PARALLEL_DONE").await.len(), 1);
        assert_eq!(entries(&h, id, "PARALLEL_REGION_ENTER").await.len(), 2);
        assert!(entries(&h, id, "PARALLEL_REGION_GUARD_ABORT").await.is_empty());
    }
    // 12 parents and 24 region tasks do not fit in one worker's 10 slots: both took part.
    let committed: Vec<u64> = workers.iter().map(|w| w.stats().committed()).collect();
    assert!(committed.iter().all(|&c| c > 0), "steps committed per worker: {committed:?}");
    for w in workers {
        w.shutdown().await;
    }
}

/// A small varying delay (0–4 ms) so region tasks on two workers interleave differently.
fn fastrand_ms() -> u64 {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(3, Ordering::Relaxed) % 5
}

async fn a_region_task_over_its_job_timeout_fails_with_a_timeout_on_its_own_queue<S: TestStore>() {
    let h = S::harness().await;
    let parallel = ParallelConfig {
        job_timeout: Duration::from_millis(30),
        queue: Some("regions".into()),
        ..config(1)
    };
    let m = machine(true, parallel)
        .action("check_inventory", |_, _| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(())
        })
        .action("validate_payment", writes("payment", Some("PAYMENT_OK")));
    let id = h.start(m.new_instance(json!({}))).await;
    let config = WorkerConfig {
        timers: None,
        queues: vec![("default".into(), 4), ("regions".into(), 4)],
        ..h.config()
    };
    let worker =
        h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(m)).spawn();
    h.wait(id, "failed", |r| r.status == Status::Done).await;
    let fails = entries(&h, id, "PARALLEL_FAIL").await;
    assert_eq!(fails.len(), 1);
    assert_eq!(fails[0]["region_id"], json!("processing.inventory"));
    assert_eq!(fails[0]["exception"], json!("Timeout"));
    for task in region_tasks(&h, id).await {
        assert_eq!(h.client.get(task.id).await.unwrap().instance.queue, "regions");
    }
    worker.shutdown().await;
}

/// The `MACROSTEP` entries that entered `processing`.
async fn entering<S: TestStore>(h: &Harness<S>, id: InstanceId) -> Vec<Value> {
    entries(h, id, "MACROSTEP")
        .await
        .into_iter()
        .filter(|m| m["records"].as_array().is_some_and(|r| r.contains(&json!("enter processing"))))
        .collect()
}

async fn the_files_parallel_dispatch_turns_dispatch_on<S: TestStore>() {
    let h = S::harness().await;
    // Dispatch is off in code; the file's system section turns it on.
    let m = happy(ParallelConfig::default());
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn_with(&h, m, Some("[parallel_dispatch]\nenabled = true"));
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(row.result.unwrap(), json!({ "inventory": true, "payment": true }));
    let steps = entering(&h, id).await;
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0]["dispatched"], json!(true), "the entering step dispatched");
    assert_eq!(region_tasks(&h, id).await.len(), 2, "one region task per region");
    assert_eq!(entries(&h, id, "PARALLEL_DONE").await.len(), 1);
    worker.shutdown().await;
}

async fn the_files_machine_section_turns_dispatch_off<S: TestStore>() {
    let h = S::harness().await;
    // Dispatch is on in code and in the system section; the machine's section wins.
    let m = happy(config(3));
    let id = h.start(m.new_instance(json!({}))).await;
    let file = "[parallel_dispatch]\nenabled = true\n\
                [machines.order.parallel_dispatch]\nenabled = false";
    let worker = spawn_with(&h, m, Some(file));
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(row.result.unwrap(), json!({ "inventory": true, "payment": true }));
    let d = h.client.get(id).await.unwrap();
    assert!(!dispatched(&d));
    assert!(d.children.is_empty(), "no region task: the entry actions ran inline");
    assert!(entries(&h, id, "PARALLEL_DONE").await.is_empty());
    worker.shutdown().await;
}

/// `ParallelConfig::queue` set in code sends region tasks to a queue the program did not
/// list: the workers that register the chart serve it, so the parallel state completes.
async fn region_tasks_on_a_queue_set_in_code_are_served_by_the_charts_workers<S: TestStore>() {
    let h = S::harness().await;
    let m = happy(ParallelConfig { queue: Some("regions".into()), ..config(3) });
    let id = h.start(m.new_instance(json!({}))).await;
    // The harness's workers list only the default queue.
    let worker = spawn(&h, m);
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert_eq!(row.result.unwrap(), json!({ "inventory": true, "payment": true }));
    let tasks = region_tasks(&h, id).await;
    assert_eq!(tasks.len(), 2, "one region task per region");
    for task in tasks {
        assert_eq!(h.client.get(task.id).await.unwrap().instance.queue, "regions");
    }
    worker.shutdown().await;
}

/// `[parallel_dispatch] job_timeout` and `job_tries` are the region tasks' own settings:
/// the file's `[queue]` timeout and retry apply to the chart's other steps, not to them. A
/// 600 ms region action runs to the end under a 10 s `job_timeout` although `[queue]`
/// says 200 ms; a failing region action is tried `job_tries` times, not the file's
/// `max_attempts`.
async fn job_timeout_and_job_tries_win_over_the_files_queue_timeout_and_retry<S: TestStore>() {
    let h = S::harness().await;
    let file = "[queue]\ntimeout = \"200 ms\"\n[queue.retry]\nmax_attempts = 5\n\
                initial_delay = \"0 seconds\"\n\
                [parallel_dispatch]\njob_timeout = \"10 seconds\"\njob_tries = 1";
    let m = happy(config(3)).action("check_inventory", |ctx, _| async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        ctx.set("inventory", true);
        ctx.raise("INVENTORY_OK");
        Ok(())
    });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn_with(&h, m, Some(file));
    let row = h.wait(id, "completed", |r| r.status == Status::Done).await;
    assert!(
        entries(&h, id, "PARALLEL_FAIL").await.is_empty(),
        "{:?}",
        entries(&h, id, "PARALLEL_FAIL").await
    );
    assert_eq!(row.result.unwrap(), json!({ "inventory": true, "payment": true }));
    worker.shutdown().await;

    // One try (`job_tries = 1`), although the file's `[queue.retry]` allows five.
    let h = S::harness().await;
    let tries = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&tries);
    let m = happy(config(3)).action("check_inventory", move |_, _| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err(ActionError::new("the warehouse is unreachable")) }
    });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn_with(&h, m, Some(file));
    h.wait(id, "failed", |r| r.status == Status::Done).await;
    assert!(last_configuration(&h, id).await.contains(&json!("failed")));
    let fails = entries(&h, id, "PARALLEL_FAIL").await;
    assert_eq!(fails.len(), 1, "{fails:?}");
    assert_eq!(fails[0]["attempts"], json!(1), "{fails:?}");
    assert_eq!(tries.load(Ordering::SeqCst), 1);
    worker.shutdown().await;
}
