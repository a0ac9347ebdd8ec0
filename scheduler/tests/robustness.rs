//! The worker under conditions a new user meets early: step results the store refuses,
//! heartbeats racing commits, and failing or panicking store calls in background loops.
//!
//! Every test runs twice, driven by a `VirtualClock`: `memory::*` on `MemoryStore`, and
//! `postgres::*` on PostgreSQL (a fresh schema per test) on a multi-threaded runtime. The
//! Postgres tests need `KEEL_TEST_DATABASE_URL`; without it they are skipped loudly, and
//! under `KEEL_REQUIRE_BACKENDS=1` they fail.

#![allow(clippy::items_after_statements, clippy::unnecessary_wraps)]

#[macro_use]
mod common;

use async_trait::async_trait;
use common::faulty::{Fault, Faulty};
use common::{Harness, TestStore, eventually};
use keel_core::chart::{ActionError, Definition, Event};
use keel_core::config::{OnDeadLetter, QueueConfig};
use keel_core::instance::NewInstance;
use keel_core::ports::store::DeadLetterFilter;
use keel_core::ports::{Clock, Store};
use keel_core::{InstanceId, MachineRef, NewSignal, Outcome, Status, WorkerId};
use keel_scheduler::{
    ActionContext, ChartMachine, StepContext, StepError, StepMachine, SweepConfig, SweepGroup,
    WorkerConfig, WorkerLoop,
};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Barrier;

on_stores!(
    memory: [
        a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish,
        a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish,
        an_empty_step_name_is_dead_lettered_and_its_neighbours_finish,
        an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish,
        a_nul_character_the_store_refuses_is_dead_lettered_and_its_neighbours_finish,
        many_short_steps_never_report_a_lost_lease_on_heartbeat,
        background_loops_survive_failing_and_panicking_store_calls_and_finish_the_work,
        a_panicking_group_commit_loses_only_its_group_whose_steps_re_run,
        a_chart_event_whose_result_is_refused_is_dead_lettered_and_skipped_on_request,
        claims_overlap_slow_commits_within_the_spare_lease_bound,
        group_commits_run_side_by_side_up_to_the_configured_bound,
        results_finished_while_every_lane_is_busy_join_one_group,
        quick_steps_are_claimed_ahead_and_still_run_one_at_a_time,
        slow_steps_are_not_claimed_ahead,
        shutdown_gives_back_steps_claimed_ahead_without_running_them,
        a_next_step_claimed_before_its_last_group_settled_still_runs,
        a_schedule_tick_the_store_refuses_is_dropped_and_the_next_fires,
        a_step_whose_leases_expired_max_attempts_times_is_dead_lettered_not_run,
        a_step_that_polls_with_retry_runs_past_max_attempts,
        outages_longer_than_a_lease_cost_the_steps_under_way_no_attempt,
    ],
    postgres: [
        a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish,
        a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish,
        an_empty_step_name_is_dead_lettered_and_its_neighbours_finish,
        an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish,
        a_nul_character_the_store_refuses_is_dead_lettered_and_its_neighbours_finish,
        many_short_steps_never_report_a_lost_lease_on_heartbeat,
        background_loops_survive_failing_and_panicking_store_calls_and_finish_the_work,
        a_panicking_group_commit_loses_only_its_group_whose_steps_re_run,
        a_chart_event_whose_result_is_refused_is_dead_lettered_and_skipped_on_request,
        claims_overlap_slow_commits_within_the_spare_lease_bound,
        group_commits_run_side_by_side_up_to_the_configured_bound,
        results_finished_while_every_lane_is_busy_join_one_group,
        quick_steps_are_claimed_ahead_and_still_run_one_at_a_time,
        slow_steps_are_not_claimed_ahead,
        a_next_step_claimed_before_its_last_group_settled_still_runs,
        a_step_whose_leases_expired_max_attempts_times_is_dead_lettered_not_run,
        a_step_that_polls_with_retry_runs_past_max_attempts,
        outages_longer_than_a_lease_cost_the_steps_under_way_no_attempt,
    ],
);

fn machine() -> MachineRef {
    MachineRef::new("m", 1)
}

/// How a step's result is bad.
#[derive(Debug, Clone, Copy)]
enum Bad {
    HugeContext,
    NotAnObject,
    EmptyStep,
    Nul,
    EmitToMissing,
}

/// Good neighbours of the one bad step, claimed and committed in the same group.
const NEIGHBOURS: usize = 5;

/// A machine whose first steps all finish together (so their results share one group
/// commit); the instance with `{"bad": true}` returns a result the store must refuse.
struct Refusable {
    bad: Bad,
    together: Arc<Barrier>,
}

#[async_trait]
impl StepMachine for Refusable {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        self.together.wait().await;
        if ctx.context["bad"] != json!(true) {
            return Ok(Outcome::Done { result: json!({ "ok": true }), step: None });
        }
        let next = |context: Value| Outcome::Next { step: "b".into(), context };
        Ok(match self.bad {
            Bad::HugeContext => {
                next(json!({ "blob": "x".repeat(keel_core::limits::PAYLOAD_BYTES_MAX) }))
            }
            Bad::NotAnObject => next(json!([1, 2, 3])),
            Bad::EmptyStep => Outcome::Next { step: String::new(), context: json!({}) },
            Bad::Nul => next(json!({ "note": "a\u{0}b" })),
            Bad::EmitToMissing => {
                ctx.emit(NewSignal::new(InstanceId(i64::MAX - 7), "hello"));
                Outcome::Done { result: json!({}), step: None }
            }
        })
    }
}

/// One bad result among good ones: the bad instance is dead-lettered at once (suspended,
/// attempt 0, a non-retryable dead letter, the store's message in `last_error`), it is
/// not re-run, and every neighbour finishes.
async fn refused<S: TestStore>(bad: Bad, names: &[&str]) {
    let h = S::harness().await;
    let mut good = Vec::new();
    for n in 0..NEIGHBOURS {
        good.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    let id = h.start(NewInstance::new(machine(), "a").context(json!({ "bad": true }))).await;
    // A long commit interval: the group is flushed once every running step has finished.
    let config = WorkerConfig { commit_interval: Duration::from_secs(1), ..h.config() };
    let together = Arc::new(Barrier::new(NEIGHBOURS + 1));
    let worker = h.worker(config, Refusable { bad, together });

    let row = h.wait(id, "the dead letter", |r| r.status == Status::Suspended).await;
    let error = row.last_error.clone().unwrap_or_default();
    assert!(error.contains("the store refused the step's result"), "{bad:?}: {error}");
    assert!(names.iter().any(|n| error.contains(n)), "{bad:?}: names one of {names:?}: {error}");
    assert_eq!(row.attempt, 0, "{bad:?}: a refused result is not retried");
    for n in &good {
        h.wait(*n, "a neighbour finished", |r| r.status == Status::Done).await;
    }
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("dead letters");
    assert_eq!(letters.len(), 1, "{bad:?}");
    assert_eq!(letters[0].letter.instance, id);
    assert_eq!(letters[0].letter.reason, "non_retryable");

    // Long after any lease would have run out, nothing re-ran it.
    h.clock.advance(Duration::from_secs(120));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let row = h.client.get(id).await.expect("get").instance;
    assert_eq!((row.status, row.attempt), (Status::Suspended, 0), "{bad:?}");
    let stats = worker.shutdown().await;
    assert_eq!(stats.refused.load(Ordering::Relaxed), 1, "{bad:?}");
    assert_eq!(stats.committed(), NEIGHBOURS as u64 + 1, "{bad:?}");
}

async fn a_context_over_the_size_limit_is_dead_lettered_and_its_neighbours_finish<S: TestStore>() {
    refused::<S>(Bad::HugeContext, &["outcome.context"]).await;
}

async fn a_context_that_is_not_an_object_is_dead_lettered_and_its_neighbours_finish<
    S: TestStore,
>() {
    refused::<S>(Bad::NotAnObject, &["outcome.context"]).await;
}

async fn an_empty_step_name_is_dead_lettered_and_its_neighbours_finish<S: TestStore>() {
    refused::<S>(Bad::EmptyStep, &["outcome.step"]).await;
}

async fn an_emit_to_a_missing_instance_is_dead_lettered_and_its_neighbours_finish<S: TestStore>() {
    refused::<S>(Bad::EmitToMissing, &["emit[0].target"]).await;
}

/// A NUL character cannot be stored by every database; whichever layer refuses it (the
/// input checks or the database itself), the result is a dead letter, not a loop.
async fn a_nul_character_the_store_refuses_is_dead_lettered_and_its_neighbours_finish<
    S: TestStore,
>() {
    refused::<S>(Bad::Nul, &["22P05", "22021", "NUL", "nul"]).await;
}

/// Three short steps each (from `a`; one from `c`), each this long, finishing in a steady
/// stream.
struct ShortSteps(Duration);

/// Steps of a millisecond.
const SHORT: ShortSteps = ShortSteps(Duration::from_millis(1));

#[async_trait]
impl StepMachine for ShortSteps {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(self.0).await;
        Ok(match ctx.step.as_str() {
            "a" => Outcome::Next { step: "b".into(), context: ctx.context.clone() },
            "b" => Outcome::Next { step: "c".into(), context: ctx.context.clone() },
            _ => Outcome::Done { result: json!({ "ok": true }), step: None },
        })
    }
}

/// One-step instances whose steps take `.0` and note when each one finished.
struct TimedSteps(Duration, Arc<Mutex<Vec<Instant>>>);

#[async_trait]
impl StepMachine for TimedSteps {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        tokio::time::sleep(self.0).await;
        self.1.lock().unwrap().push(Instant::now());
        Ok(Outcome::Done { result: json!({ "ok": true }), step: None })
    }
}

/// A harness whose store takes `delay` longer over every group commit, with `instances`
/// one-step instances started (at step `c`).
async fn slow_commits<S: TestStore>(
    delay: Duration,
    instances: usize,
) -> (Harness<Faulty<S>>, Vec<InstanceId>) {
    let h = Harness::with_store(Faulty { commit_delay: delay, ..Faulty::new(S::fresh().await) });
    let mut ids = Vec::new();
    for n in 0..instances {
        ids.push(h.start(NewInstance::new(machine(), "c").context(json!({ "n": n }))).await);
    }
    (h, ids)
}

/// A worker of concurrency 1 whose commits are slow: it claims and runs the next steps
/// while earlier results commit (several commits under way at once), but never holds
/// more leases than its concurrency plus the spare floor of 32 (1 running, 32 waiting
/// for their commits), and finishes everything.
async fn claims_overlap_slow_commits_within_the_spare_lease_bound<S: TestStore>() {
    // More instances than the bound, so a worker ignoring it would be caught.
    const INSTANCES: usize = 48;
    const SPARE: usize = 32;
    let (h, ids) = slow_commits::<S>(Duration::from_millis(150), INSTANCES).await;
    let config = WorkerConfig {
        queues: vec![("default".into(), 1)],
        claim_batch: 1,
        commits_in_flight: 32,
        timers: None,
        ..h.config()
    };
    // The claim loop alone, even when the suites run with a queue in the loop: a hint
    // claim racing it can take a lease it releases at once, which the store would count.
    let worker = keel_scheduler::Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(SHORT)
        .spawn();
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert_eq!(stats.committed(), INSTANCES as u64);
    let commits = h.store.commits.lock().unwrap().1;
    assert!(commits >= 2, "steps ran while earlier results committed ({commits} commits at once)");
    let leases = h.store.leases.lock().unwrap().1;
    assert!(
        leases <= 1 + SPARE,
        "a worker of concurrency 1 held {leases} leases at once, more than 1 + {SPARE}"
    );
    assert!(leases > 2, "finished steps waiting for commits kept more than one spare lease");
}

/// Many steps finishing while commits are slow: full groups commit side by side, never
/// more at once than `commits_in_flight`, and every result lands exactly once.
async fn group_commits_run_side_by_side_up_to_the_configured_bound<S: TestStore>() {
    const INSTANCES: usize = 60;
    let (h, ids) = slow_commits::<S>(Duration::from_millis(100), INSTANCES).await;
    let config = WorkerConfig {
        queues: vec![("default".into(), 24)],
        commit_batch: 8,
        commits_in_flight: 3,
        commit_interval: Duration::from_millis(1),
        timers: None,
        ..h.config()
    };
    let worker = h.worker(config, SHORT);
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert_eq!(stats.committed(), INSTANCES as u64);
    assert_eq!(h.store.commits.lock().unwrap().1, 3, "three groups at once, never four");
    assert!(
        h.store.calls("step_commit") < INSTANCES,
        "results were grouped: {} commits for {INSTANCES} results",
        h.store.calls("step_commit")
    );
}

/// A worker of concurrency 1 with one commit lane and slow commits: the steps it runs
/// while its lane is busy all hand their results in at once, and the group that takes
/// the lane next carries them all, not the two or three the committer had room for.
async fn results_finished_while_every_lane_is_busy_join_one_group<S: TestStore>() {
    const INSTANCES: usize = 40;
    const COMMIT: Duration = Duration::from_millis(600);
    let (h, ids) = slow_commits::<S>(COMMIT, INSTANCES).await;
    let config = WorkerConfig {
        queues: vec![("default".into(), 1)],
        commits_in_flight: 1,
        timers: None,
        ..h.config()
    };
    let finished = Arc::new(Mutex::new(Vec::new()));
    // The claim loop alone (see `claims_overlap_slow_commits_within_the_spare_lease_bound`).
    let worker = keel_scheduler::Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(TimedSteps(Duration::from_millis(5), Arc::clone(&finished)))
        .spawn();
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert_eq!(stats.committed(), INSTANCES as u64);
    // The first result commits at once; during its slow commit more steps run (up to 32
    // spare leases' worth, as many as the claims bring in on a loaded machine) and hand
    // their results in, and the next group takes every one of them. One result may still
    // be on its way to the committer when the lane frees. Five or more tell the rule
    // apart from a committer with room for two results (groups of three at most); a
    // loaded two-core machine ran seven during a 300 ms commit.
    let groups = h.store.groups.lock().unwrap().clone();
    let first_end = h.store.commit_ends.lock().unwrap()[0];
    let ran_meanwhile =
        finished.lock().unwrap().iter().filter(|at| **at < first_end).count() - groups[0];
    assert!(
        ran_meanwhile >= 5,
        "only {ran_meanwhile} steps ran during the first ({COMMIT:?}) commit; groups {groups:?}"
    );
    assert!(
        groups.len() >= 2 && groups[1] + 1 >= ran_meanwhile,
        "{ran_meanwhile} results finished during the first ({COMMIT:?}) commit, and went out \
         in groups of {groups:?}"
    );
}

/// Many short steps under a heartbeat that runs all the time and whose store call takes
/// a while: results committed while a heartbeat was under way gave their lease up on
/// purpose, and no lease is reported lost.
async fn many_short_steps_never_report_a_lost_lease_on_heartbeat<S: TestStore>() {
    const INSTANCES: usize = 100;
    let store = Faulty { extend_delay: Duration::from_millis(3), ..Faulty::new(S::fresh().await) };
    let h = Harness::with_store(store);
    let mut ids = Vec::new();
    for n in 0..INSTANCES {
        ids.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    let config = WorkerConfig {
        heartbeat: Duration::from_millis(1),
        commit_interval: Duration::from_millis(5),
        timers: None,
        ..h.config()
    };
    let worker = h.worker(config, SHORT);
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert!(h.store.calls("lease_extend") > 10, "the heartbeat ran while steps finished");
    assert_eq!(stats.committed(), 3 * INSTANCES as u64);
    assert_eq!(stats.lease_lost.load(Ordering::Relaxed), 0, "no commit lost its lease");
    assert_eq!(
        stats.lease_lost_on_heartbeat.load(Ordering::Relaxed),
        0,
        "no lease was lost, so none may be reported lost"
    );
}

/// Claims, reaps, timer sweeps and stats samples that fail and panic a few times: every
/// loop logs, backs off and carries on (a panicking loop is restarted), the work is
/// finished — including a dead worker's instance, which only the reaper can return — and
/// the health report shows each loop running, with its restarts and last error.
async fn background_loops_survive_failing_and_panicking_store_calls_and_finish_the_work<
    S: TestStore,
>() {
    use Fault::{Error, Panic};
    const INSTANCES: usize = 20;
    let store = Faulty::new(S::fresh().await)
        .failing("instance_claim", &[Error, Panic, Error, Panic, Panic])
        .failing("lease_reap_owner", &[Panic, Error])
        .failing("lease_reap", &[Panic, Error, Panic])
        .failing("timer_sweep", &[Panic, Error])
        .failing("queue_stats", &[Error, Panic]);
    let h = Harness::with_store(store);
    let mut ids = Vec::new();
    for n in 0..INSTANCES {
        ids.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    // A worker that died holding a lease: only the reaper brings its instance back.
    let orphan = h.start(NewInstance::new(machine(), "a")).await;
    let ghost = keel_core::ports::store::ClaimParams {
        worker: WorkerId("ghost".into()),
        namespaces: vec![],
        queues: vec![],
        machines: vec![],
        limit: 1,
        lease: Duration::from_secs(30),
        now: h.clock.now(),
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    };
    let claimed = h.store.inner.instance_claim(ghost).await.expect("claim");
    assert_eq!(claimed.iter().map(|c| c.instance.id).collect::<Vec<_>>(), [ids[0]]);
    let config = WorkerConfig {
        timers: Some(SweepConfig {
            groups: vec![SweepGroup { machines: vec![], cadence: Duration::from_millis(100) }],
            ..SweepConfig::default()
        }),
        stats_interval: Some(Duration::from_millis(20)),
        // It counts the claim loop's calls: no queue in the loop, the usual fast polling.
        poll_interval: Duration::from_millis(5),
        notifications: true,
        ..h.config()
    };
    let worker = keel_scheduler::Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(SHORT)
        .spawn();
    for id in ids.iter().skip(1).chain([&orphan]) {
        h.wait(*id, "done despite the faults", |r| r.status == Status::Done).await;
    }
    h.clock.advance(Duration::from_secs(31));
    h.wait(ids[0], "the dead worker's instance, reaped and done", |r| r.status == Status::Done)
        .await;

    let health = worker.health();
    for which in [
        WorkerLoop::Claim,
        WorkerLoop::Committer,
        WorkerLoop::Heartbeat,
        WorkerLoop::Reaper,
        WorkerLoop::Stats,
        WorkerLoop::Sweeper,
    ] {
        let loop_ = health.get(which).unwrap_or_else(|| panic!("{which:?} reported"));
        assert!(loop_.running, "{which:?} runs: {loop_:?}");
    }
    let claim = health.get(WorkerLoop::Claim).unwrap();
    assert_eq!(claim.restarts, 3, "one restart per claim that panicked: {claim:?}");
    assert!(claim.last_success.is_some(), "{claim:?}");
    assert_eq!(claim.consecutive_failures, 0, "the last claim succeeded: {claim:?}");
    let error = &claim.last_error.as_ref().expect("the failures are reported").1;
    assert!(error.contains("injected instance_claim panic"), "{error}");
    let reaper = health.get(WorkerLoop::Reaper).unwrap();
    assert_eq!(reaper.restarts, 2, "one restart per reap that panicked: {reaper:?}");
    assert!(reaper.last_success.is_some(), "{reaper:?}");
    for which in [WorkerLoop::Committer, WorkerLoop::Heartbeat] {
        let loop_ = health.get(which).unwrap();
        assert!(loop_.last_success.is_some(), "{which:?}: {loop_:?}");
    }
    assert_eq!(
        h.store.calls("lease_reap_owner"),
        3,
        "the start-up reclaim was tried until it worked"
    );

    let stats = worker.shutdown().await;
    assert_eq!(stats.committed(), 3 * (INSTANCES as u64 + 1));
}

/// The committer's health report once `ready` holds of it, polled every 10 ms at most
/// `tries` times; the last report either way.
async fn committer_report(
    worker: &keel_scheduler::WorkerHandle,
    tries: usize,
    ready: impl Fn(&keel_scheduler::LoopHealth) -> bool,
) -> keel_scheduler::LoopHealth {
    let report = || worker.health().get(WorkerLoop::Committer).cloned().expect("reported");
    for _ in 0..tries {
        if ready(&report()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    report()
}

/// A group commit whose store call panics loses that group only: the steps leave the
/// running set (so no heartbeat keeps their leases alive), the leases expire, the reaper
/// returns them and the steps re-run and finish; the committer reports the panic.
async fn a_panicking_group_commit_loses_only_its_group_whose_steps_re_run<S: TestStore>() {
    let store = Faulty::new(S::fresh().await).failing("step_commit", &[Fault::Panic]);
    let h = Harness::with_store(store);
    let id = h.start(NewInstance::new(machine(), "c")).await;
    // A heartbeat far more often than the reaper looks: a lost result whose step stayed
    // in the running set would have its lease extended before the reaper could see it
    // expire.
    let config = WorkerConfig {
        heartbeat: Duration::from_millis(1),
        reap_interval: Duration::from_millis(100),
        timers: None,
        ..h.config()
    };
    let worker = h.worker(config, SHORT);
    h.wait(id, "the panicking commit", |_| h.store.calls("step_commit") >= 1).await;
    // The call is counted before it panics, and the panic hook (printing a backtrace, slow
    // in a fresh test process) runs before the committer sees the panic: wait for the
    // committer's report, then a moment for the group to leave the running set, before
    // moving the clock past the lease. Advancing earlier would let the heartbeat extend
    // the lease from the new time.
    let reported = committer_report(&worker, 3_000, |c| c.last_error.is_some()).await;
    assert!(reported.last_error.is_some(), "the committer did not report the panicking commit");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.status(id).await, Status::Executing, "its result was lost with the panic");
    // Well past the lease: nothing extends it any more, so the reaper takes it back.
    h.clock.advance(Duration::from_secs(31));
    let row = h.wait(id, "done after the re-run", |r| r.status == Status::Done).await;
    assert_eq!(row.revision.0, 1, "committed once");
    // The committer records its success just after the store accepted the commit, so the
    // row can read as done a moment before the health report says so.
    let committer = committer_report(&worker, 500, |c| c.last_success.is_some()).await;
    let error = &committer.last_error.as_ref().expect("the panic is reported").1;
    assert!(error.contains("step_commit panicked: injected step_commit panic"), "{error}");
    assert!(committer.running && committer.last_success.is_some(), "{committer:?}");
    worker.shutdown().await;
}

/// A refused result goes through the machine's error handling like any failure: a chart
/// under `on_dead_letter = skip` records the dead letter of the event whose macrostep the
/// store refused, drops that event, and carries on with the next one.
async fn a_chart_event_whose_result_is_refused_is_dead_lettered_and_skipped_on_request<
    S: TestStore,
>() {
    let h = S::harness().await;
    let definition = Definition::builder("bloat", 1)
        .initial("idle")
        .state("idle", |s| s.on("BIG", |t| t.action("inflate")).on_to("SMALL", "finished"))
        .final_state("finished")
        .build()
        .expect("valid chart");
    let chart = ChartMachine::new(definition)
        .action("inflate", |ctx: ActionContext, _: Event| {
            ctx.set("blob", "x".repeat(keel_core::limits::PAYLOAD_BYTES_MAX));
            std::future::ready(Ok::<(), ActionError>(()))
        })
        .with_config(QueueConfig { on_dead_letter: OnDeadLetter::Skip, ..QueueConfig::default() });
    let id = h.start(chart.new_instance(json!({}))).await;
    let worker = h.worker(h.config(), chart);
    h.wait(id, "parked", |r| r.status == Status::AwaitingSignal).await;
    h.client
        .send_many(vec![NewSignal::new(id, "BIG"), NewSignal::new(id, "SMALL")])
        .await
        .expect("send");
    let row = h.wait(id, "finished after skipping BIG", |r| r.status == Status::Done).await;
    assert!(row.result.as_ref().is_none_or(|r| r.get("blob").is_none()), "{:?}", row.result);
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("dead letters");
    assert_eq!(letters.len(), 1);
    let letter = &letters[0].letter;
    assert_eq!((letter.instance, letter.reason.as_str()), (id, "non_retryable"));
    assert_eq!(letter.event.as_ref().map(|e| e["name"].clone()), Some(json!("BIG")));
    let error = &letter.errors.last().expect("the error is kept").error;
    assert!(error.contains("the store refused the step's result"), "{error}");
    let stats = worker.shutdown().await;
    assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
}

/// Counts the steps running at once (and the most ever), and how many ran; a step sleeps
/// for its context's `ms`, or (`"forever": true`) until it is aborted. With `"two": true`
/// step `a` goes on to step `b`.
#[derive(Default, Clone)]
struct Counted {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    ran: Arc<AtomicUsize>,
}

#[async_trait]
impl StepMachine for Counted {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        self.ran.fetch_add(1, Ordering::SeqCst);
        if ctx.context["forever"] == json!(true) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let ms = ctx.context["ms"].as_u64().unwrap_or(0);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        self.now.fetch_sub(1, Ordering::SeqCst);
        if ctx.context["two"] == json!(true) && ctx.step == "a" {
            return Ok(Outcome::Next { step: "b".into(), context: ctx.context.clone() });
        }
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

/// One queue of concurrency 1, claim loop only (no hint loop racing it).
fn one_slot<S: Store>(
    h: &Harness<Faulty<S>>,
    claim_ahead: Duration,
    steps: Counted,
) -> keel_scheduler::WorkerHandle {
    let config = WorkerConfig {
        queues: vec![("default".into(), 1)],
        claim_ahead,
        shutdown_grace: Duration::from_millis(50),
        timers: None,
        ..h.config()
    };
    keel_scheduler::Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
        .register(steps)
        .spawn()
}

/// Quick steps on a queue of concurrency 1: each claim takes several steps (they wait in
/// the worker under their lease), so the slot does not wait out a claim after every step;
/// still only one step runs at a time, and the leases stay within the spare bound.
async fn quick_steps_are_claimed_ahead_and_still_run_one_at_a_time<S: TestStore>() {
    const INSTANCES: usize = 200;
    let h = Harness::with_store(Faulty::new(S::fresh().await));
    let mut ids = Vec::new();
    for n in 0..INSTANCES {
        ids.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    let steps = Counted::default();
    let worker = one_slot(&h, Duration::from_secs(1), steps.clone());
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert_eq!(stats.committed(), INSTANCES as u64);
    assert_eq!(steps.ran.load(Ordering::SeqCst), INSTANCES, "each step ran once");
    assert_eq!(steps.most.load(Ordering::SeqCst), 1, "one step at a time");
    let claims = h.store.calls("instance_claim");
    assert!(
        claims < INSTANCES / 2,
        "{claims} claims for {INSTANCES} quick steps: they were not claimed ahead"
    );
    let leases = h.store.leases.lock().unwrap().1;
    assert!(leases <= 1 + 32, "a worker of concurrency 1 held {leases} leases at once");
}

/// Once a group commit has landed, an instance's next step is claimable at once, even
/// while the worker is still settling that group: the new claim (here waiting in line
/// behind the steps claimed ahead of it) keeps its place in the worker and runs, rather
/// than being forgotten when the old group settles and left holding its lease.
async fn a_next_step_claimed_before_its_last_group_settled_still_runs<S: TestStore>() {
    const INSTANCES: usize = 6;
    let store = Faulty { settle_delay: Duration::from_millis(50), ..Faulty::new(S::fresh().await) };
    let h = Harness::with_store(store);
    let mut ids = Vec::new();
    for n in 0..INSTANCES {
        let context = json!({ "n": n, "ms": 20, "two": true });
        ids.push(h.start(NewInstance::new(machine(), "a").context(context)).await);
    }
    let steps = Counted::default();
    let worker = one_slot(&h, Duration::from_secs(1), steps.clone());
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    let stats = worker.shutdown().await;
    assert_eq!(stats.committed(), 2 * INSTANCES as u64);
    assert_eq!(steps.ran.load(Ordering::SeqCst), 2 * INSTANCES, "each step ran once");
    assert_eq!(steps.most.load(Ordering::SeqCst), 1, "one step at a time");
}

/// Steps slower than the claim-ahead budget are never claimed ahead: the waiting
/// instances stay claimable by other workers.
async fn slow_steps_are_not_claimed_ahead<S: TestStore>() {
    let h = Harness::with_store(Faulty::new(S::fresh().await));
    let mut ids = Vec::new();
    for n in 0..4 {
        ids.push(
            h.start(NewInstance::new(machine(), "a").context(json!({ "n": n, "ms": 60 }))).await,
        );
    }
    let steps = Counted::default();
    let worker = one_slot(&h, Duration::from_millis(5), steps.clone());
    for id in &ids {
        h.wait(*id, "done", |r| r.status == Status::Done).await;
    }
    worker.shutdown().await;
    // Leases held at once are no measure here: finished steps keep theirs until their
    // commits land, however slowly the database answers. A claim of more than the one
    // free slot is what claiming ahead would show.
    let largest = *h.store.largest_claim.lock().unwrap();
    assert_eq!(largest, 1, "a claim took {largest} slow steps: they were claimed ahead");
    assert!(h.store.calls("instance_claim") >= 4, "each slow step was claimed alone");
    assert_eq!(steps.ran.load(Ordering::SeqCst), 4, "each step ran once");
    assert_eq!(steps.most.load(Ordering::SeqCst), 1);
}

/// Shutdown gives back the leases of steps claimed ahead at once, without running them
/// and without counting an attempt; the step that was running is released after the
/// grace period as before.
async fn shutdown_gives_back_steps_claimed_ahead_without_running_them<S: TestStore>() {
    let h = Harness::with_store(Faulty::new(S::fresh().await));
    let steps = Counted::default();
    let worker = one_slot(&h, Duration::from_secs(1), steps.clone());
    // One quick step first, so the worker knows its steps are quick.
    let first = h.start(NewInstance::new(machine(), "a")).await;
    h.wait(first, "done", |r| r.status == Status::Done).await;
    let stuck = h.start(NewInstance::new(machine(), "a").context(json!({ "forever": true }))).await;
    let mut quick = Vec::new();
    for n in 0..4 {
        quick.push(h.start(NewInstance::new(machine(), "a").context(json!({ "n": n }))).await);
    }
    for _ in 0..1_000 {
        if h.store.leases.lock().unwrap().0 == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(h.store.leases.lock().unwrap().0, 5, "the stuck step and four claimed ahead");
    let stats = worker.shutdown().await;
    assert_eq!(steps.ran.load(Ordering::SeqCst), 2, "the steps claimed ahead never ran");
    assert_eq!(stats.released.load(Ordering::Relaxed), 5);
    for id in quick.iter().chain([&stuck]) {
        let row = h.client.get(*id).await.unwrap().instance;
        assert_eq!((row.status, row.attempt, row.lease_owner), (Status::Runnable, 0, None));
    }
}

/// Waits (bounded) until `worker`'s schedule runner has handled its schedules up to `now`.
async fn schedules_passed(worker: &keel_scheduler::WorkerHandle, now: keel_core::Timestamp) {
    for _ in 0..400 {
        if worker.schedules().passed().is_some_and(|p| p >= now) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the schedule runner did not reach {now} within 4 s");
}

/// A tick the store refuses for good (a broadcast reaching more instances than one
/// delivery takes, say) is dropped with an error naming the schedule, not retried every
/// second for ever with every other schedule's wake-ups; the next tick fires as usual.
async fn a_schedule_tick_the_store_refuses_is_dropped_and_the_next_fires<S: TestStore>() {
    use keel_core::schedule::{Schedule, ScheduleAction};
    let store = Faulty::new(S::fresh().await).failing("instance_insert", &[Fault::Refuse]);
    let h = Harness::with_store(store);
    let start = NewInstance::new(MachineRef::new("report", 1), "run");
    let schedule = Schedule::new("every-minute", "* * * * *", "UTC", ScheduleAction::Start(start))
        .expect("a valid schedule");
    let config = WorkerConfig {
        timers: None,
        queues: vec![("elsewhere".into(), 1)],
        schedules: keel_scheduler::Schedules::new(vec![schedule]),
        ..h.config()
    };
    let worker = keel_scheduler::Worker::new(Arc::clone(&h.store), h.clock.clone(), config).spawn();
    schedules_passed(&worker, h.clock.now()).await;
    let now = h.clock.advance(Duration::from_secs(60));
    schedules_passed(&worker, now).await;
    let counts = worker.schedules().counts();
    assert_eq!((counts.fired, counts.failed), (0, 1), "the refused tick is dropped: {counts:?}");
    let now = h.clock.advance(Duration::from_secs(60));
    schedules_passed(&worker, now).await;
    assert_eq!(worker.schedules().counts().fired, 1, "{:?}", worker.schedules().counts());
    worker.shutdown().await;
}

/// A step that takes its worker down with it (a crash, an abort, running out of memory)
/// leaves only an expired lease behind, and the reaper hands it back with its attempt
/// counted. Once the expired leases have used up the retry policy's attempts, the next
/// worker does not run it again: the instance is dead-lettered and suspended, and the
/// dead letter names the expired leases. A neighbour claimed alongside runs as usual.
async fn a_step_whose_leases_expired_max_attempts_times_is_dead_lettered_not_run<S: TestStore>() {
    use keel_core::plan::claim::ClaimPolicy;
    use keel_core::ports::store::{ClaimParams, LeaseReapParams};
    let h = S::harness().await;
    let id = h.start(NewInstance::new(machine(), "a").context(json!({ "kills": true }))).await;
    let max_attempts = QueueConfig::default().retry.max_attempts;
    let lease = Duration::from_secs(30);
    for dead in 0..max_attempts {
        let claimed = h
            .store
            .instance_claim(ClaimParams {
                worker: WorkerId(format!("dead-{dead}")),
                namespaces: vec![],
                queues: vec![],
                machines: vec![machine()],
                limit: 1,
                lease,
                now: h.clock.now(),
                policy: ClaimPolicy::default(),
            })
            .await
            .expect("claim");
        assert_eq!(claimed.len(), 1, "claimed by dead worker {dead}");
        // The worker dies with the step: its lease runs out and the reaper returns it.
        h.clock.advance(lease + Duration::from_secs(1));
        let params = LeaseReapParams { owner: None, limit: 10, now: h.clock.now() };
        assert_eq!(h.store.lease_reap(params).await.expect("reap"), vec![id]);
    }
    let row = h.client.get(id).await.expect("get").instance;
    assert_eq!((row.status, row.attempt), (Status::Runnable, max_attempts as i32));

    let neighbour = h.start(NewInstance::new(machine(), "a")).await;
    let steps = Counted::default();
    let worker = h.worker(h.config(), steps.clone());
    h.wait(neighbour, "the neighbour done", |r| r.status == Status::Done).await;
    let row = h.wait(id, "the dead letter", |r| r.status == Status::Suspended).await;
    let stats = worker.shutdown().await;
    assert_eq!(steps.ran.load(Ordering::SeqCst), 1, "only the neighbour's step ran");
    assert_eq!(stats.failed_steps.load(Ordering::Relaxed), 1);
    let error = row.last_error.clone().unwrap_or_default();
    let expected = format!("its lease expired {max_attempts} times");
    assert!(error.contains(&expected), "last_error: {error}");
    assert!(error.contains("may be killing its worker"), "last_error: {error}");
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("dead letters");
    assert_eq!(letters.len(), 1);
    let letter = &letters[0].letter;
    assert_eq!((letter.instance, letter.reason.as_str()), (id, "non_retryable"));
    assert_eq!(letter.attempts, max_attempts as i32 + 1);
    let last = letter.errors.last().map(|e| e.error.as_str()).unwrap_or_default();
    assert!(last.contains(&expected), "the dead letter's error: {last}");
}

/// Returns `Outcome::Retry` for its first `polls` runs, then finishes: a step polling for
/// something outside.
struct Poller {
    polls: usize,
    runs: Arc<AtomicUsize>,
}

#[async_trait]
impl StepMachine for Poller {
    fn machine(&self) -> MachineRef {
        MachineRef::new("poller", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if self.runs.fetch_add(1, Ordering::SeqCst) < self.polls {
            return Ok(Outcome::Retry { context: ctx.context.clone(), delay: Duration::ZERO });
        }
        Ok(Outcome::Done { result: json!({ "polled": self.polls }), step: None })
    }
}

/// A step's own `Outcome::Retry` counts an attempt without a failure: a step that polls
/// goes on past `max_attempts` for as long as it wants. Only expired leases in a row stop
/// a step from running.
async fn a_step_that_polls_with_retry_runs_past_max_attempts<S: TestStore>() {
    let h = S::harness().await;
    let id = h.start(NewInstance::new(MachineRef::new("poller", 1), "poll")).await;
    let polls = 3 * QueueConfig::default().retry.max_attempts as usize;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = h.worker(h.config(), Poller { polls, runs: Arc::clone(&runs) });
    let row = h.wait(id, "done after polling", |r| r.status.is_terminal()).await;
    worker.shutdown().await;
    assert_eq!((row.status, row.attempt), (Status::Done, polls as i32));
    assert_eq!(runs.load(Ordering::SeqCst), polls + 1, "every poll ran");
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.expect("dead letters");
    assert!(letters.is_empty(), "{letters:?}");
}

/// A step that runs until the test lets it finish (one permit per run), counting its
/// runs.
#[derive(Clone)]
struct Gated {
    go: Arc<tokio::sync::Semaphore>,
    ran: Arc<AtomicUsize>,
}

impl Default for Gated {
    fn default() -> Self {
        Gated { go: Arc::new(tokio::sync::Semaphore::new(0)), ran: Arc::default() }
    }
}

#[async_trait]
impl StepMachine for Gated {
    fn machine(&self) -> MachineRef {
        machine()
    }

    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        self.ran.fetch_add(1, Ordering::SeqCst);
        self.go.acquire().await.expect("the gate stays open").forget();
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

/// A store that cannot be reached for longer than a lease (a database failover, a
/// restart) costs the steps under way no attempt: the worker gives back the leases of the
/// results it could not commit once the store answers again, and its reaper, having seen
/// the store down, leaves expired leases alone for a lease period so it does not take
/// them first. As many outages in a row under one step as its retry policy allows
/// attempts neither count an attempt nor suspend it as a step that kills its worker.
async fn outages_longer_than_a_lease_cost_the_steps_under_way_no_attempt<S: TestStore>() {
    let h = Harness::with_store(Faulty::new(S::fresh().await));
    let id = h.start(NewInstance::new(machine(), "a")).await;
    let steps = Gated::default();
    let config = WorkerConfig { timers: None, ..h.config() };
    let lease = config.lease;
    let worker = h.worker(config, steps.clone());
    let outages = QueueConfig::default().retry.max_attempts as usize;
    for outage in 1..=outages {
        eventually(&format!("run {outage} of the step"), || {
            steps.ran.load(Ordering::SeqCst) == outage
        })
        .await;
        // The store goes down; the step finishes, and its group commit is tried until the
        // committer gives up.
        h.store.down.store(true, Ordering::SeqCst);
        let commits = h.store.calls("step_commit");
        steps.go.add_permits(1);
        eventually("the committer to give up", || h.store.calls("step_commit") >= commits + 5)
            .await;
        // The outage outlasts the lease, and the reaper finds the store down (reaping, or
        // asking whether it is back).
        h.clock.advance(lease + Duration::from_secs(1));
        let reaper_calls = || h.store.calls("lease_reap") + h.store.calls("worker_heartbeat");
        let before = reaper_calls();
        eventually("the reaper to call during the outage", || reaper_calls() > before).await;
        h.store.down.store(false, Ordering::SeqCst);
    }
    eventually("the last run", || steps.ran.load(Ordering::SeqCst) == outages + 1).await;
    steps.go.add_permits(1);
    let row = h.wait(id, "done", |r| r.status == Status::Done).await;
    let history = h.client.get(id).await.expect("get").history;
    let kinds: Vec<&str> = history.iter().map(|r| r.entry.kind.as_str()).collect();
    assert!(!kinds.contains(&"LEASE_EXPIRED"), "a lease was reaped: {kinds:?}");
    assert_eq!(row.revision.0, 1, "committed once");
    // Holding off is no failure: the reaper reads as healthy once the store answers.
    let reaper_ok =
        || worker.health().get(WorkerLoop::Reaper).is_some_and(|r| r.consecutive_failures == 0);
    eventually("the reaper to read as healthy", reaper_ok).await;
    let stats = worker.shutdown().await;
    assert_eq!(stats.reaped.load(Ordering::Relaxed), 0);
    assert_eq!(
        stats.released.load(Ordering::Relaxed),
        outages as u64,
        "one lease given back per outage"
    );
}
