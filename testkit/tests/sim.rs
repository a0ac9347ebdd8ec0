//! The simulator on a small payment machine: the real store passes a sweep of seeds under
//! crashes, lease expiry, skew and duplicate signals; a store with a deliberately broken
//! fencing rule is caught with a seed that replays; a broken user invariant is reported
//! with a short trace.

use async_trait::async_trait;
use keel_core::ports::Store;
use keel_core::ports::store::{
    BroadcastReport, CancelParams, Claim, ClaimParams, CommitParams, CommitReceipt,
    DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams, DeadLetterSkipParams,
    DeliveryOutcome, InsertOutcome, InsertParams, InstanceDetail, InstanceListParams,
    LeaseExtendParams, LeaseReapParams, LeaseReleaseParams, QueuePauseParams, QueueState,
    QueueStats, SignalBroadcastParams, SignalDeliverParams, StoreCapabilities, TimerNextDueParams,
    TimerStatus, TimerSweepParams, TimerSweepReport,
};
use keel_core::timers::TimerHint;
use keel_core::{
    DeadLetterId, Instance, InstanceId, MachineRef, NewInstance, NewSignal, Outcome, Signal,
    SignalTarget, Status, StepCommit, StoreResult, Timestamp,
};
use keel_testkit::MemoryStore;
use keel_testkit::sim::{SimConfig, Simulation};
use serde_json::json;

fn payment() -> MachineRef {
    MachineRef::new("payment", 1)
}

/// reserve → charge → wait for `confirm` → done; `charged` counts charges.
fn payment_step(row: &Instance, inbox: &[Signal]) -> StepCommit {
    let mut ctx = row.context.clone();
    let outcome = match row.position.as_str() {
        "reserve" => {
            ctx["reserved"] = json!(true);
            Outcome::Next { step: "charge".into(), context: ctx }
        }
        "charge" => {
            ctx["charged"] = json!(ctx["charged"].as_i64().unwrap_or(0) + 1);
            Outcome::Await { signal: "confirm".into(), context: ctx, step: Some("confirm".into()) }
        }
        _ => match inbox.iter().find(|s| s.name == "confirm") {
            Some(signal) => {
                return StepCommit::new(
                    row.id,
                    row.fencing_token,
                    Outcome::Done { result: ctx, step: None },
                )
                .consume([signal.id]);
            }
            None => Outcome::Await { signal: "confirm".into(), context: ctx, step: None },
        },
    };
    StepCommit::new(row.id, row.fencing_token, outcome)
}

fn payments(instances: usize) -> Simulation {
    let mut sim = Simulation::new()
        .machine(payment(), payment_step)
        .signals(|row| {
            vec![
                NewSignal::new(SignalTarget::Id(row.id), "confirm")
                    .dedup_key(format!("confirm-{}", row.id)),
            ]
        })
        .invariant("charged at most once", |row| {
            match row.context["charged"].as_i64().unwrap_or(0) {
                0 | 1 => Ok(()),
                n => Err(format!("charged {n} times")),
            }
        })
        .invariant("done only after a charge", |row| {
            if row.status == Status::Done && row.context["charged"] != json!(1) {
                return Err("finished without exactly one charge".into());
            }
            Ok(())
        });
    for _ in 0..instances {
        sim = sim.start(NewInstance::new(payment(), "reserve"));
    }
    sim
}

const SEEDS: std::ops::Range<u64> = 0..300;

#[test]
fn the_real_store_keeps_every_rule_under_faults() {
    let sweep = payments(6).check_seeds(SEEDS);
    assert_eq!(sweep.seeds, SEEDS.end - SEEDS.start);
    let t = sweep.total;
    // The sweep must really have hurt: crashes, lost leases and refused stale commits.
    assert!(t.crashes > 0 && t.reaped > 0 && t.commits_refused > 0, "{t:?}");
    // Every instance finished with its three steps committed once each.
    assert_eq!(t.instances, 6 * sweep.seeds);
    assert_eq!(t.commits, 3 * t.instances, "{t:?}");
    assert!(t.executions > t.commits, "re-executions are expected: {t:?}");
}

#[test]
fn a_seed_replays_exactly() {
    let sim = payments(4);
    for seed in [3, 17, 99] {
        assert_eq!(sim.run(seed), sim.run(seed));
    }
    assert_ne!(sim.run(3), sim.run(4), "different seeds should schedule differently");
}

/// A store with one deliberately wrong rule.
struct Broken(MemoryStore, Bug);

#[derive(Clone, Copy, PartialEq)]
enum Bug {
    /// The commit rule forgets fencing and lets a superseded claim's commit through while
    /// the instance is executing under a newer claim.
    ForgetsFencing,
    /// The reaper treats leases as expired a lease length early.
    ReapsEarly,
}

#[async_trait]
impl Store for Broken {
    fn capabilities(&self) -> StoreCapabilities {
        self.0.capabilities()
    }
    async fn instance_insert(&self, p: InsertParams) -> StoreResult<Vec<InsertOutcome>> {
        self.0.instance_insert(p).await
    }
    async fn instance_claim(&self, p: ClaimParams) -> StoreResult<Vec<Claim>> {
        self.0.instance_claim(p).await
    }
    async fn instance_ready_stale(
        &self,
        p: keel_core::ports::store::ReadyStaleParams,
    ) -> StoreResult<Vec<keel_core::Instance>> {
        self.0.instance_ready_stale(p).await
    }
    async fn step_commit(
        &self,
        mut p: CommitParams,
    ) -> StoreResult<Vec<StoreResult<CommitReceipt>>> {
        if self.1 != Bug::ForgetsFencing {
            return self.0.step_commit(p).await;
        }
        let ids = p.commits.iter().map(|c| c.id).collect();
        let rows = self.0.instance_rows(ids).await?;
        for commit in &mut p.commits {
            if let Some(row) = rows.iter().find(|r| r.id == commit.id)
                && row.status == Status::Executing
            {
                commit.token = row.fencing_token;
            }
        }
        self.0.step_commit(p).await
    }
    async fn lease_extend(&self, p: LeaseExtendParams) -> StoreResult<Vec<bool>> {
        self.0.lease_extend(p).await
    }
    async fn lease_reap(&self, mut p: LeaseReapParams) -> StoreResult<Vec<InstanceId>> {
        if self.1 == Bug::ReapsEarly && p.owner.is_none() {
            p.now = p.now.plus(std::time::Duration::from_secs(30));
        }
        self.0.lease_reap(p).await
    }
    async fn lease_release(&self, p: LeaseReleaseParams) -> StoreResult<Vec<bool>> {
        self.0.lease_release(p).await
    }
    async fn signal_deliver(&self, p: SignalDeliverParams) -> StoreResult<Vec<DeliveryOutcome>> {
        self.0.signal_deliver(p).await
    }
    async fn signal_broadcast(&self, p: SignalBroadcastParams) -> StoreResult<BroadcastReport> {
        self.0.signal_broadcast(p).await
    }
    async fn instance_cancel(&self, p: CancelParams) -> StoreResult<Vec<InstanceId>> {
        self.0.instance_cancel(p).await
    }
    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        self.0.instance_get(id).await
    }
    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>> {
        self.0.instance_rows(ids).await
    }
    async fn instance_list(&self, p: InstanceListParams) -> StoreResult<Vec<Instance>> {
        self.0.instance_list(p).await
    }
    async fn instance_lookup(&self, t: SignalTarget) -> StoreResult<Option<InstanceId>> {
        self.0.instance_lookup(t).await
    }
    async fn dead_letter_list(
        &self,
        f: DeadLetterFilter,
    ) -> StoreResult<Vec<keel_core::instance::DeadLetter>> {
        self.0.dead_letter_list(f).await
    }
    async fn dead_letter_get(
        &self,
        id: DeadLetterId,
    ) -> StoreResult<keel_core::instance::DeadLetter> {
        self.0.dead_letter_get(id).await
    }
    async fn dead_letter_retry(&self, p: DeadLetterRetryParams) -> StoreResult<Vec<InstanceId>> {
        self.0.dead_letter_retry(p).await
    }
    async fn dead_letter_skip(&self, p: DeadLetterSkipParams) -> StoreResult<InstanceId> {
        self.0.dead_letter_skip(p).await
    }
    async fn dead_letter_purge(&self, p: DeadLetterPurgeParams) -> StoreResult<u64> {
        self.0.dead_letter_purge(p).await
    }
    async fn queue_pause(&self, p: QueuePauseParams) -> StoreResult<()> {
        self.0.queue_pause(p).await
    }
    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>> {
        self.0.queue_list(namespace).await
    }
    async fn queue_stats(
        &self,
        ns: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>> {
        self.0.queue_stats(ns, now).await
    }
    async fn timer_sweep(&self, p: TimerSweepParams) -> StoreResult<TimerSweepReport> {
        self.0.timer_sweep(p).await
    }
    async fn worker_heartbeat(
        &self,
        p: keel_core::ports::store::WorkerBeatParams,
    ) -> StoreResult<()> {
        self.0.worker_heartbeat(p).await
    }
    async fn worker_list(
        &self,
        seen_since: Timestamp,
    ) -> StoreResult<Vec<keel_core::ports::store::WorkerRecord>> {
        self.0.worker_list(seen_since).await
    }
    async fn schedule_pause(
        &self,
        p: keel_core::ports::store::SchedulePauseParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        self.0.schedule_pause(p).await
    }
    async fn schedule_states(
        &self,
        namespace: String,
    ) -> StoreResult<Vec<keel_core::ports::store::ScheduleState>> {
        self.0.schedule_states(namespace).await
    }
    async fn schedule_fired(
        &self,
        p: keel_core::ports::store::ScheduleFiredParams,
    ) -> StoreResult<keel_core::ports::store::ScheduleState> {
        self.0.schedule_fired(p).await
    }
    async fn timers_retime(
        &self,
        p: keel_core::ports::store::TimerRetimeParams,
    ) -> StoreResult<keel_core::ports::store::TimerRetimePage> {
        self.0.timers_retime(p).await
    }
    async fn timer_next_due(&self, p: TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        self.0.timer_next_due(p).await
    }
    async fn timer_status(
        &self,
        ns: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>> {
        self.0.timer_status(ns, now).await
    }
    async fn ready_wait(&self) {
        self.0.ready_wait().await;
    }
    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        self.0.timer_hint_wait(seen).await
    }
}

#[test]
fn a_planted_fencing_bug_is_found_with_a_seed_that_replays() {
    let buggy = payments(6).with_store(|| Broken(MemoryStore::new(), Bug::ForgetsFencing));
    let failure = SEEDS
        .clone()
        .find_map(|seed| buggy.run(seed).err())
        .expect("the simulator must catch a store that accepts superseded commits");
    assert!(["stale-commit", "double-commit"].contains(&failure.kind.as_str()), "{failure}");
    // The printed report names the seed and how to replay it, with a short trace.
    let text = failure.to_string();
    println!("{text}");
    assert!(text.contains(&format!("SIM_SEED={}", failure.seed)), "{text}");
    assert!(failure.trace.len() <= failure.events_before_shrinking, "{text}");
    assert!(failure.trace.len() < 30, "the trace should shrink to a handful of events:\n{text}");
    // The seed replays to the same failure; the real store passes the same seed and every
    // seed tried before it.
    assert_eq!(buggy.run(failure.seed).err(), Some(failure.clone()));
    let real = payments(6);
    for seed in SEEDS.start..=failure.seed {
        assert!(real.run(seed).is_ok(), "seed {seed} fails on the real store");
    }
}

#[test]
fn a_reaper_that_reaps_live_leases_is_found() {
    let buggy = payments(6).with_store(|| Broken(MemoryStore::new(), Bug::ReapsEarly));
    let failure = SEEDS
        .clone()
        .find_map(|seed| buggy.run(seed).err())
        .expect("the simulator must catch a reaper that takes live leases");
    assert_eq!(failure.kind, "early-reap", "{failure}");
    assert_eq!(buggy.run(failure.seed).err(), Some(failure.clone()));
    assert!(payments(6).run(failure.seed).is_ok());
}

#[test]
fn a_broken_user_invariant_is_reported_with_its_name_and_a_short_trace() {
    let sim = payments(2).invariant("never confirmed twice", |row| {
        // Wrong on purpose: every finished payment was confirmed once.
        if row.status == Status::Done { Err("finished".into()) } else { Ok(()) }
    });
    let failure = sim.run(7).expect_err("the invariant is false for every finished payment");
    assert_eq!(failure.kind, "invariant:never confirmed twice");
    let text = failure.to_string();
    assert!(text.contains("seed 7") && text.contains("SIM_SEED=7"), "{text}");
    // Reserve, charge and confirm need at least three claims, runs and commits plus a
    // delivery; the shrinker keeps little more than that.
    assert!(failure.trace.len() >= 10 && failure.trace.len() < 40, "{text}");
}

#[test]
fn an_instance_that_waits_for_a_signal_nobody_sends_is_reported_hung() {
    let sim = payments(1)
        .signals(|_| Vec::new())
        .config(SimConfig { events: 50, ..SimConfig::default() });
    let failure = sim.run(1).expect_err("nothing confirms the payment");
    assert_eq!(failure.kind, "hung");
    assert!(failure.detail.contains("awaiting_signal at `confirm`"), "{failure}");
}

mod charts {
    use super::*;
    use keel_core::chart::{Definition, Timer};
    use keel_testkit::sim::SimChart;

    /// cart → (CHECKOUT) awaiting_payment, whose entry reserves stock → (PAY) paid, or
    /// cancelled when its two-minute timer fires first.
    fn order() -> SimChart {
        let def = Definition::builder("sim_order", 1)
            .initial("cart")
            .state("cart", |s| s.on_to("CHECKOUT", "awaiting_payment"))
            .state("awaiting_payment", |s| {
                s.entry("reserve")
                    .on_to("PAY", "paid")
                    .on("EXPIRED", |t| t.target("cancelled").after(Timer::minutes(2)))
            })
            .final_state("paid")
            .final_state("cancelled")
            .build()
            .unwrap();
        SimChart::new(def).action("reserve", |ctx, _event| {
            let n = ctx.get("reserved").and_then(|v| v.as_i64()).unwrap_or(0);
            ctx.set("reserved", n + 1);
            Ok(())
        })
    }

    fn orders() -> Simulation {
        let chart = order();
        let start = chart.new_instance(json!({}));
        Simulation::new()
            .chart(chart)
            .start(start.clone())
            .start(start.clone())
            .start(start)
            .signals(|row| {
                ["CHECKOUT", "PAY"]
                    .map(|name| NewSignal::new(SignalTarget::Id(row.id), name).dedup_key(name))
                    .to_vec()
            })
            .invariant("reserved once", |row| {
                let ctx = row.result.as_ref().unwrap_or(&row.context);
                match ctx["reserved"].as_i64().unwrap_or(0) {
                    0 | 1 => Ok(()),
                    n => Err(format!("reserved {n} times")),
                }
            })
    }

    #[test]
    fn a_chart_keeps_every_rule_under_faults() {
        let sweep = orders().check_seeds(0..200);
        assert_eq!(sweep.total.instances, 3 * 200);
        assert!(sweep.total.crashes > 0 && sweep.total.commits_refused > 0, "{:?}", sweep.total);
    }

    #[test]
    fn chart_timers_fire_in_simulated_time() {
        // Some seeds leave an order unpaid for two simulated minutes: its timer cancels it.
        let sim = orders().invariant("never expires", |row| {
            if row.position.contains("cancelled") { Err("expired".into()) } else { Ok(()) }
        });
        let failure = (0..200)
            .find_map(|seed| sim.run(seed).err())
            .expect("an unpaid order expires on some seed");
        assert_eq!(failure.kind, "invariant:never expires", "{failure}");
        assert!(
            failure.trace.iter().any(|line| line.contains("sweeps timers: 1 fired")),
            "{failure}"
        );
    }
}

/// A machine that waits for `go` twice: `first` then `second` record the id of the `go`
/// each step saw. The worker consumes the signal a step saw when the step does not park
/// again, so the second wait needs a second `go`.
mod consumption {
    use super::*;

    fn twice() -> MachineRef {
        MachineRef::new("twice", 1)
    }

    fn twice_step(row: &Instance, inbox: &[Signal]) -> StepCommit {
        let mut ctx = row.context.clone();
        let go = inbox.iter().find(|s| s.name == "go");
        let park = |ctx, step: &str| Outcome::Await {
            signal: "go".into(),
            context: ctx,
            step: Some(step.into()),
        };
        let outcome = match (row.position.as_str(), go) {
            ("start", _) => park(ctx, "got_first"),
            ("got_first", Some(signal)) => {
                ctx["first"] = json!(signal.id.0);
                Outcome::Next { step: "wait_again".into(), context: ctx }
            }
            ("wait_again", _) => park(ctx, "got_second"),
            ("got_second", Some(signal)) => {
                ctx["second"] = json!(signal.id.0);
                Outcome::Done { result: ctx, step: None }
            }
            (position, None) => park(ctx, position),
            (position, Some(_)) => Outcome::Stop { reason: format!("unknown step {position}") },
        };
        // No explicit `consume`: the default rule applies.
        StepCommit::new(row.id, row.fencing_token, outcome)
    }

    fn sim() -> Simulation {
        Simulation::new()
            .machine(twice(), twice_step)
            .start(NewInstance::new(twice(), "start"))
            .start(NewInstance::new(twice(), "start"))
            .signals(|row| {
                // One `go` per wait, deduplicated per wait.
                vec![
                    NewSignal::new(SignalTarget::Id(row.id), "go")
                        .dedup_key(format!("go-{}-{}", row.id, row.position)),
                ]
            })
            .invariant("each wait is woken by its own go", |row| {
                let Some(result) = row.result.as_ref().filter(|_| row.status == Status::Done)
                else {
                    return Ok(());
                };
                if result["first"] == result["second"] {
                    return Err(format!("both waits saw signal {}", result["first"]));
                }
                Ok(())
            })
    }

    #[test]
    fn a_step_consumes_the_awaited_signal_it_saw_without_naming_it() {
        let sweep = sim().check_seeds(0..100);
        assert_eq!(sweep.total.instances, 2 * 100);
        // Two deliveries per instance at least: the first `go` cannot wake the second wait.
        assert!(sweep.total.delivered >= 2 * 2 * 100, "{:?}", sweep.total);
    }
}

/// A panic in user code fails the seed by name, so that it can be replayed.
#[test]
fn a_panicking_step_names_its_seed() {
    let sim = Simulation::new()
        .machine(payment(), |_row: &Instance, _inbox: &[Signal]| -> StepCommit {
            panic!("the step exploded")
        })
        .start(NewInstance::new(payment(), "reserve"))
        .config(SimConfig { events: 20, ..SimConfig::default() });
    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.check_seeds(3..4)))
        .expect_err("the step panics");
    let text = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    assert!(
        text.contains("seed 3")
            && text.contains("SIM_SEED=3")
            && text.contains("the step exploded"),
        "{text}"
    );
}

/// Charts in the simulator cancel the children of a delegation state they leave, as the
/// durable runtime does, and start children at the version the chart names.
mod chart_children {
    use super::*;
    use keel_core::chart::Definition;
    use keel_testkit::sim::SimChart;

    /// `working` delegates to `shipping` (version 2), whose instances wait for a signal
    /// nobody sends; `CANCEL` leaves `working`, which must cancel the child.
    fn parent() -> SimChart {
        let def = Definition::builder("sim_parent", 1)
            .initial("working")
            .state("working", |s| {
                s.machine("shipping")
                    .on_to("CANCEL", "cancelled")
                    .on("done.invoke.working", |t| t.target("shipped"))
            })
            .final_state("shipped")
            .final_state("cancelled")
            .build()
            .unwrap();
        SimChart::new(def).with_child_version("shipping", 2)
    }

    fn sim() -> Simulation {
        let chart = parent();
        let start = chart.new_instance(json!({}));
        Simulation::new()
            .chart(chart)
            .machine(MachineRef::new("shipping", 2), |row: &Instance, _inbox: &[Signal]| {
                let park = Outcome::Await {
                    signal: "never".into(),
                    context: row.context.clone(),
                    step: None,
                };
                StepCommit::new(row.id, row.fencing_token, park)
            })
            .start(start.clone())
            .start(start)
            .signals(|row| {
                if row.machine.name != "sim_parent" {
                    return Vec::new();
                }
                vec![NewSignal::new(SignalTarget::Id(row.id), "CANCEL").dedup_key("cancel")]
            })
            .invariant("children run version 2", |row| {
                if row.machine.name == "shipping" && row.machine.version != 2 {
                    return Err(format!("child runs {}", row.machine));
                }
                Ok(())
            })
    }

    #[test]
    fn leaving_a_delegation_state_cancels_its_child() {
        let sweep = sim().check_seeds(0..50);
        // Each parent and its child: the child ends only by being cancelled.
        assert_eq!(sweep.total.instances, 2 * 2 * 50, "{:?}", sweep.total);
    }
}
