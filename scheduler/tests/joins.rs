//! Join policies end to end: a step machine fans out to children with a quorum or a
//! deadline, workers run parent and children, and the parent wakes once and decides from
//! what its children did.
//!
//! Each test runs on `MemoryStore` and on PostgreSQL (a fresh schema per test, two workers
//! racing; skipped loudly without `KEEL_TEST_DATABASE_URL`, failing under
//! `KEEL_REQUIRE_BACKENDS=1`).

#[macro_use]
mod common;

use async_trait::async_trait;
use common::{Harness, TestStore};
use keel_core::history::HistoryKind;
use keel_core::join::Join;
use keel_core::ports::Store;
use keel_core::{InstanceId, MachineRef, NewInstance, Outcome, Status, WorkerId};
use keel_scheduler::{
    StepContext, StepError, StepMachine, SweepConfig, Sweeper, Worker, WorkerConfig, WorkerHandle,
};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

on_every_store!(
    a_quorum_of_three_of_five_wakes_the_parent_once_at_the_third_success,
    a_deadline_wakes_the_parent_with_what_finished_and_cancels_the_rest,
);

/// A bid: succeeds, fails or never answers, as its context's `answer` says.
struct Bid;

#[async_trait]
impl StepMachine for Bid {
    fn machine(&self) -> MachineRef {
        MachineRef::new("bid", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        match ctx.context["answer"].as_str() {
            Some("yes") => Ok(Outcome::Done { result: ctx.context.clone(), step: None }),
            Some("no") => Ok(Outcome::Stop { reason: "declined".into() }),
            _ => Ok(Outcome::Await {
                signal: "never".into(),
                context: ctx.context.clone(),
                step: None,
            }),
        }
    }
}

/// Asks one bid per answer with `join`, then reports what came back.
struct Auction {
    answers: Vec<&'static str>,
    join: Join,
    decided: Arc<AtomicUsize>,
}

#[async_trait]
impl StepMachine for Auction {
    fn machine(&self) -> MachineRef {
        MachineRef::new("auction", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        match ctx.step.as_str() {
            "start" => {
                let bids = self
                    .answers
                    .iter()
                    .enumerate()
                    .map(|(i, answer)| {
                        ctx.child(MachineRef::new("bid", 1), "start")
                            .context(json!({ "i": i, "answer": answer }))
                    })
                    .collect();
                Ok(Outcome::schedule_children("decide", bids, json!({})).with_join(self.join))
            }
            "decide" => {
                self.decided.fetch_add(1, Ordering::SeqCst);
                let count =
                    |status: Status| ctx.children.iter().filter(|c| c.status == status).count();
                let won: Vec<Value> = ctx
                    .children
                    .iter()
                    .filter(|c| c.status == Status::Done)
                    .map(|c| c.result.as_ref().map_or(Value::Null, |r| r["i"].clone()))
                    .collect();
                Ok(Outcome::Done {
                    result: json!({
                        "won": won,
                        "done": count(Status::Done),
                        "failed": count(Status::Failed),
                        "cancelled": count(Status::Cancelled),
                        "woke": ctx.context["@join"]["woke"],
                    }),
                    step: None,
                })
            }
            other => Err(StepError::fatal(format!("no step {other}"))),
        }
    }
}

/// `S::WORKERS` workers serving both machines; no timer sweeper (tests sweep by hand).
fn workers<S: TestStore>(h: &Harness<S>, auction: &Arc<Auction>) -> Vec<WorkerHandle> {
    (0..S::WORKERS)
        .map(|i| {
            let config = WorkerConfig {
                worker_id: WorkerId(format!("joins-{i}")),
                timers: None,
                ..h.config()
            };
            let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), config)
                .register(Bid)
                .register(Shared(Arc::clone(auction)));
            h.hinted(worker).spawn()
        })
        .collect()
}

/// An `Auction` shared between workers.
struct Shared(Arc<Auction>);

#[async_trait]
impl StepMachine for Shared {
    fn machine(&self) -> MachineRef {
        self.0.machine()
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        self.0.step(ctx).await
    }
}

async fn join_wakes<S: Store>(h: &Harness<S>, id: InstanceId) -> usize {
    let history = h.client.get(id).await.expect("get").history;
    history.iter().filter(|r| HistoryKind::JoinWoke.is(&r.entry.kind)).count()
}

/// Five bids, three of which say yes, one no and one never answers; the auction needs
/// three: it wakes once, at the third yes, decides once, and the silent bid is cancelled
/// (the declining one too, when the quorum came before a worker ran it).
async fn a_quorum_of_three_of_five_wakes_the_parent_once_at_the_third_success<S: TestStore>() {
    let h = S::harness().await;
    let decided = Arc::new(AtomicUsize::new(0));
    let auction = Arc::new(Auction {
        answers: vec!["yes", "no", "yes", "yes", "silent"],
        join: Join::quorum(3),
        decided: Arc::clone(&decided),
    });
    let running = workers(&h, &auction);
    let id = h.start(NewInstance::new(MachineRef::new("auction", 1), "start")).await;
    let row = h.wait(id, "decided", |r| r.status.is_terminal()).await;
    assert_eq!(row.status, Status::Done, "{:?}", row.last_error);
    let result = row.result.expect("a result");
    // The declining bid fails if a worker ran it before the third yes, and is cancelled
    // with the silent one if not: either way the two that did not win are accounted for.
    let (failed, cancelled) = (&result["failed"], &result["cancelled"]);
    assert!(
        (failed, cancelled) == (&json!(1), &json!(1))
            || (failed, cancelled) == (&json!(0), &json!(2)),
        "{result}"
    );
    assert_eq!((&result["done"], &result["woke"]), (&json!(3), &json!("quorum")), "{result}");
    let mut won: Vec<i64> =
        result["won"].as_array().unwrap().iter().filter_map(Value::as_i64).collect();
    won.sort_unstable();
    assert_eq!(won, [0, 2, 3]);
    assert_eq!(decided.load(Ordering::SeqCst), 1, "the parent ran its next step once");
    assert_eq!(join_wakes(&h, id).await, 1);
    let children = h.client.get(id).await.expect("get").children;
    assert_eq!(h.status(children[4].id).await, Status::Cancelled);
    let declined = if failed == &json!(1) { Status::Failed } else { Status::Cancelled };
    assert_eq!(h.status(children[1].id).await, declined, "the declining bid as the parent saw it");
    for w in running {
        w.shutdown().await;
    }
}

/// Three bids with a one-minute deadline: one says yes, two never answer. Nothing happens
/// until the virtual clock passes the deadline; then one sweep wakes the auction with the
/// one yes, and the silent bids are cancelled.
async fn a_deadline_wakes_the_parent_with_what_finished_and_cancels_the_rest<S: TestStore>() {
    let h = S::harness().await;
    let decided = Arc::new(AtomicUsize::new(0));
    let auction = Arc::new(Auction {
        answers: vec!["yes", "silent", "silent"],
        join: Join::all().within(Duration::from_secs(60)),
        decided: Arc::clone(&decided),
    });
    let running = workers(&h, &auction);
    let id = h.start(NewInstance::new(MachineRef::new("auction", 1), "start")).await;
    h.wait(id, "waiting on its bids", |r| r.status == Status::AwaitingChildren).await;
    let bids: Vec<InstanceId> =
        h.client.get(id).await.expect("get").children.iter().map(|c| c.id).collect();
    h.wait(bids[0], "the yes", |r| r.status == Status::Done).await;
    h.wait(bids[1], "a silent bid parked", |r| r.status == Status::AwaitingSignal).await;
    h.wait(bids[2], "a silent bid parked", |r| r.status == Status::AwaitingSignal).await;
    let sweeper = Sweeper::new(Arc::clone(&h.store), h.clock.clone(), SweepConfig::default())
        .expect("valid sweep config");
    h.clock.advance(Duration::from_secs(59));
    sweeper.sweep(&[]).await.expect("sweep");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.status(id).await, Status::AwaitingChildren, "the deadline has not passed");
    h.clock.advance(Duration::from_secs(2));
    sweeper.sweep(&[]).await.expect("sweep");
    let row = h.wait(id, "decided", |r| r.status.is_terminal()).await;
    let result = row.result.expect("a result");
    assert_eq!(
        (&result["won"], &result["cancelled"], &result["woke"]),
        (&json!([0]), &json!(2), &json!("deadline")),
        "{result}"
    );
    sweeper.sweep(&[]).await.expect("sweep");
    assert_eq!(join_wakes(&h, id).await, 1);
    assert_eq!(decided.load(Ordering::SeqCst), 1);
    for w in running {
        w.shutdown().await;
    }
}
