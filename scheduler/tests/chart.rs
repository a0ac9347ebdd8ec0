//! Charts on the engine, on `MemoryStore` + `VirtualClock`: one inbox event per committed
//! macrostep, unhandled events recorded and dropped, action errors retried then
//! dead-lettered with later events kept in order (or skipped), the outbox, child machine
//! delegation with `@done` / `@fail`, and broadcast.

#![allow(clippy::items_after_statements)]

mod common;

use async_trait::async_trait;
use common::Harness;
use keel_core::chart::{ActionError, Definition, HistoryDepth};
use keel_core::config::{OnDeadLetter, QueueConfig};
use keel_core::ports::store::DeadLetterFilter;
use keel_core::retry::RetryPolicy;
use keel_core::{InstanceId, MachineRef, NewSignal, Outcome, Status};
use keel_scheduler::chart::INIT;
use keel_scheduler::{ChartMachine, StepContext, StepError, StepMachine, Worker, WorkerHandle};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn light() -> Definition {
    Definition::builder("light", 1)
        .initial("green")
        .state("green", |s| s.entry("count_green").on_to("NEXT", "yellow"))
        .state("yellow", |s| s.on_to("NEXT", "red").on("EMIT", |t| t.action("emit_hello")))
        .state("red", |s| s.on_to("NEXT", "green").on_to("STOP", "off"))
        .final_state("off")
        .build()
        .expect("valid chart")
}

fn light_machine(fail: Arc<AtomicBool>, target: Option<InstanceId>) -> ChartMachine {
    ChartMachine::new(light())
        .action("count_green", move |ctx, _| {
            let fail = Arc::clone(&fail);
            async move {
                if fail.load(Ordering::SeqCst) {
                    return Err(ActionError::new("the lamp controller is offline"));
                }
                let n: i64 = ctx.get_as("greens").unwrap_or(0);
                ctx.set("greens", n + 1);
                Ok(())
            }
        })
        .action("emit_hello", move |ctx, _| async move {
            if let Some(t) = target {
                ctx.emit(NewSignal::new(t, "HELLO").payload(json!({ "from": ctx.instance() })));
            }
            Ok(())
        })
}

fn position(row: &keel_core::Instance) -> Vec<String> {
    serde_json::from_str(&row.position).unwrap_or_default()
}

fn at_state(state: &'static str) -> impl Fn(&keel_core::Instance) -> bool {
    move |r| r.status == Status::AwaitingSignal && position(r).iter().any(|p| p == state)
}

async fn send(h: &Harness, id: InstanceId, events: &[&str]) {
    let signals = events.iter().map(|e| NewSignal::new(id, *e)).collect();
    h.client.send_many(signals).await.expect("send");
}

fn spawn(h: &Harness, machine: impl StepMachine) -> WorkerHandle {
    h.hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config()).register(machine))
        .spawn()
}

#[tokio::test]
async fn events_are_processed_one_macrostep_per_commit_in_arrival_order() {
    let h = Harness::new();
    let m = light_machine(Arc::default(), None);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    let row = h.wait(id, "initial state entered", at_state("green")).await;
    assert_eq!(row.context["greens"], json!(1), "entry action ran once");

    send(&h, id, &["NEXT", "NEXT", "NEXT", "NEXT"]).await;
    let row = h
        .wait(id, "back to yellow", |r| r.revision.0 == 5 && r.status == Status::AwaitingSignal)
        .await;
    assert_eq!(position(&row), ["yellow"]);
    assert_eq!(row.context["greens"], json!(2));
    let detail = h.client.get(id).await.unwrap();
    assert!(detail.inbox.is_empty(), "every event consumed");
    let macrosteps: Vec<Value> = detail
        .history
        .iter()
        .filter(|r| r.entry.kind == "MACROSTEP")
        .map(|r| r.entry.data["event"].clone())
        .collect();
    assert_eq!(
        macrosteps,
        [json!(null), json!("NEXT"), json!("NEXT"), json!("NEXT"), json!("NEXT")]
    );
    worker.shutdown().await;
}

#[tokio::test]
async fn an_unhandled_event_is_recorded_and_dropped() {
    let h = Harness::new();
    let m = light_machine(Arc::default(), None);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "green", at_state("green")).await;
    send(&h, id, &["STOP", "NEXT"]).await;
    let row = h.wait(id, "yellow", at_state("yellow")).await;
    assert_eq!(row.revision.0, 3);
    let history = h.client.get(id).await.unwrap().history;
    let unhandled: Vec<_> = history.iter().filter(|r| r.entry.kind == "EVENT_UNHANDLED").collect();
    assert_eq!(unhandled.len(), 1);
    assert_eq!(unhandled[0].entry.data["event"], json!("STOP"));
    worker.shutdown().await;
}

#[tokio::test]
async fn reaching_a_top_level_final_state_finishes_the_instance() {
    let h = Harness::new();
    let m = light_machine(Arc::default(), None);
    let id = h.start(m.new_instance(json!({ "owner": "ops" }))).await;
    let worker = spawn(&h, m);
    send(&h, id, &["NEXT", "NEXT", "STOP"]).await;
    let row = h.wait(id, "done", |r| r.status == Status::Done).await;
    assert_eq!(
        row.result.as_ref().map(|r| r["owner"].clone()),
        Some(json!("ops")),
        "the result is the final context"
    );
    worker.shutdown().await;
}

#[tokio::test]
async fn an_action_error_retries_then_suspends_keeping_later_events_in_order() {
    let h = Harness::new();
    let fail = Arc::new(AtomicBool::new(false));
    let policy = RetryPolicy { max_attempts: 2, ..RetryPolicy::default() };
    let m = light_machine(Arc::clone(&fail), None)
        .with_config(QueueConfig { retry: policy, ..QueueConfig::default() });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(id, "green", at_state("green")).await;
    send(&h, id, &["NEXT", "NEXT"]).await;
    h.wait(id, "red", at_state("red")).await;

    // Entering green again runs the failing entry action.
    fail.store(true, Ordering::SeqCst);
    send(&h, id, &["NEXT", "NEXT"]).await;
    h.wait(id, "a retry", |r| r.attempt == 1).await;
    h.clock.advance(Duration::from_secs(1));
    let row = h.wait(id, "suspended", |r| r.status == Status::Suspended).await;
    assert_eq!(position(&row), ["red"], "nothing of the failed macrostep was committed");
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].letter.event, Some(json!({ "name": "NEXT", "payload": null })));
    let inbox: Vec<String> =
        h.client.get(id).await.unwrap().inbox.iter().map(|s| s.name.clone()).collect();
    assert_eq!(inbox, ["NEXT", "NEXT"], "the failed event and the one after it wait, in order");

    fail.store(false, Ordering::SeqCst);
    h.client
        .dead_letter_retry(keel_scheduler::client::DeadLetterRetry::one(letters[0].id))
        .await
        .unwrap();
    let row = h.wait(id, "yellow after both events", at_state("yellow")).await;
    assert_eq!(row.context["greens"], json!(2));
    worker.shutdown().await;
}

#[tokio::test]
async fn with_skip_a_dead_lettered_event_is_dropped_and_the_next_one_runs() {
    let h = Harness::new();
    let fail = Arc::new(AtomicBool::new(false));
    let config = QueueConfig {
        retry: RetryPolicy { max_attempts: 1, ..RetryPolicy::default() },
        on_dead_letter: OnDeadLetter::Skip,
        ..QueueConfig::default()
    };
    let m = light_machine(Arc::clone(&fail), None).with_config(config);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    send(&h, id, &["NEXT", "NEXT"]).await;
    h.wait(id, "red", at_state("red")).await;
    fail.store(true, Ordering::SeqCst);
    send(&h, id, &["NEXT", "STOP"]).await;
    h.wait(id, "done via STOP", |r| r.status == Status::Done).await;
    let letters = h.client.dead_letters(DeadLetterFilter::default()).await.unwrap();
    assert_eq!(letters.len(), 1, "the skipped event is still dead-lettered");
    worker.shutdown().await;
}

#[tokio::test]
async fn actions_emit_to_other_instances_in_the_same_commit() {
    let h = Harness::new();
    let other = h.start(keel_core::NewInstance::new(MachineRef::new("mailbox", 1), "idle")).await;
    let m = light_machine(Arc::default(), Some(other));
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    send(&h, id, &["NEXT", "EMIT"]).await;
    h.wait(id, "emit processed", |r| r.revision.0 == 3).await;
    let inbox = h.client.get(other).await.unwrap().inbox;
    assert_eq!(inbox.len(), 1);
    assert_eq!(
        (inbox[0].name.as_str(), inbox[0].payload.clone()),
        ("HELLO", json!({ "from": id }))
    );
    worker.shutdown().await;
}

/// A step machine used as a delegated child: succeeds or fails as its context says.
struct Payment;

#[async_trait]
impl StepMachine for Payment {
    fn machine(&self) -> MachineRef {
        MachineRef::new("payment", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        assert_eq!(ctx.step, INIT, "delegated children start at @init");
        Ok(Outcome::Done {
            result: json!({ "charged": true, "parent": ctx.context["parent"] }),
            step: None,
        })
    }
}

struct FailingPayment;

#[async_trait]
impl StepMachine for FailingPayment {
    fn machine(&self) -> MachineRef {
        MachineRef::new("payment", 2)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Stop { reason: "card declined".into() })
    }
}

fn checkout(version: i32) -> ChartMachine {
    let def = Definition::builder("checkout", 1)
        .initial("paying")
        .state("paying", |s| {
            s.machine("payment")
                .on_done(|b| b.target("paid").action("note"))
                .on_fail(|b| b.target("declined"))
        })
        .final_state("paid")
        .final_state("declined")
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
        .action("note", |ctx, event| async move {
            ctx.set("payment", event.payload.clone());
            Ok(())
        })
        .with_child_version("payment", version)
}

#[tokio::test]
async fn a_delegated_child_machines_done_fires_the_parents_done() {
    let h = Harness::new();
    let m = checkout(1);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(m)
        .register(Payment);
    let worker = h.hinted(worker).spawn();
    let row = h.wait(id, "paid", |r| r.status == Status::Done).await;
    let result = row.result.unwrap_or_default();
    assert_eq!(result["payment"]["charged"], json!(true));
    assert_eq!(result["payment"]["parent"], json!(id));
    let children = h.client.get(id).await.unwrap().children;
    assert_eq!(children.len(), 1);
    assert_eq!(children[0].status, Status::Done);
    worker.shutdown().await;
}

#[tokio::test]
async fn a_delegated_child_machines_failure_fires_the_parents_fail() {
    let h = Harness::new();
    let m = checkout(2);
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(m)
        .register(FailingPayment);
    let worker = h.hinted(worker).spawn();
    let row = h.wait(id, "declined", |r| r.status == Status::Done).await;
    assert!(row.result.is_some());
    let history = h.client.get(id).await.unwrap().history;
    let last = history.iter().rev().find(|r| r.entry.kind == "MACROSTEP").expect("a macrostep");
    assert_eq!(last.entry.data["event"], json!("fail.state.paying"));
    worker.shutdown().await;
}

/// A payment that is declined on its first try and charged on the next.
struct FlakyPayment(Arc<std::sync::atomic::AtomicUsize>);

#[async_trait]
impl StepMachine for FlakyPayment {
    fn machine(&self) -> MachineRef {
        MachineRef::new("payment", 3)
    }
    async fn step(&self, _: &StepContext) -> Result<Outcome, StepError> {
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            return Ok(Outcome::Stop { reason: "card declined".into() });
        }
        Ok(Outcome::Done { result: json!({ "charged": true }), step: None })
    }
}

/// `@fail` back to the delegation state is a retry: a new child starts, and its `@done`
/// moves the chart on.
#[tokio::test]
async fn a_delegation_state_entered_again_on_its_childs_failure_starts_a_new_child() {
    let h = Harness::new();
    let def = Definition::builder("checkout", 2)
        .initial("paying")
        .state("paying", |s| {
            s.machine("payment").on_done(|b| b.target("paid")).on_fail(|b| b.target("paying"))
        })
        .final_state("paid")
        .build()
        .expect("valid chart");
    let m = ChartMachine::new(def).with_child_version("payment", 3);
    let id = h.start(m.new_instance(json!({}))).await;
    let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(m)
        .register(FlakyPayment(Arc::clone(&tries)));
    let worker = h.hinted(worker).spawn();
    h.wait(id, "paid after a retry", |r| r.status == Status::Done).await;
    let children = h.client.get(id).await.unwrap().children;
    let statuses: Vec<Status> = children.iter().map(|c| c.status).collect();
    assert_eq!(statuses, [Status::Failed, Status::Done], "one declined try, then a new child");
    assert_eq!(tries.load(Ordering::SeqCst), 2);
    worker.shutdown().await;
}

#[tokio::test]
async fn broadcast_reaches_charts_in_a_state() {
    let h = Harness::new();
    let m = light_machine(Arc::default(), None);
    let a = h.start(m.new_instance(json!({}))).await;
    let b = h.start(m.new_instance(json!({}))).await;
    let worker = spawn(&h, m);
    h.wait(a, "green", at_state("green")).await;
    h.wait(b, "green", at_state("green")).await;
    send(&h, b, &["NEXT"]).await;
    h.wait(b, "yellow", at_state("yellow")).await;
    let report = h
        .client
        .broadcast(keel_scheduler::Broadcast::new("light", "NEXT").in_state("green"))
        .await
        .unwrap();
    assert_eq!((report.delivered, report.woke), (1, 1));
    h.wait(a, "a moved on", at_state("yellow")).await;
    assert_eq!(h.client.get(b).await.unwrap().instance.revision.0, 2, "b was not in green");
    worker.shutdown().await;
}

#[test]
fn missing_actions_are_listed() {
    let m = ChartMachine::new(light());
    assert_eq!(m.missing_actions(), ["count_green", "emit_hello"]);
    assert!(light_machine(Arc::default(), None).missing_actions().is_empty());
}

/// A player that remembers, through deep history, where it was when switched off.
fn player() -> ChartMachine {
    let def = Definition::builder("player", 1)
        .initial("on")
        .state("on", |s| {
            s.initial("stopped")
                .history("resume", HistoryDepth::Deep, "stopped")
                .on_to("POWER_OFF", "off")
                .state("stopped", |s| s.on_to("PLAY", "playing"))
                .state("playing", |s| {
                    s.initial("normal").state("normal", |s| s.on_to("FAST", "fast")).leaf("fast")
                })
        })
        .state("off", |s| s.on_to("POWER_ON", "on.resume"))
        .build()
        .expect("valid chart");
    ChartMachine::new(def)
}

#[tokio::test]
async fn recorded_history_survives_the_commit_and_a_claim_by_another_worker() {
    let h = Harness::new();
    let id = h.start(player().new_instance(json!({}))).await;
    let first = spawn(&h, player());
    send(&h, id, &["PLAY", "FAST", "POWER_OFF"]).await;
    let row = h.wait(id, "switched off", |r| r.revision.0 == 4 && at_state("off")(r)).await;
    assert_eq!(position(&row), ["off"], "the position holds active states only");
    assert_eq!(row.context["@history"], json!({"on.resume": ["on.playing.fast"]}));
    first.shutdown().await;

    let second = spawn(&h, player());
    send(&h, id, &["POWER_ON"]).await;
    let row = h.wait(id, "resumed", at_state("on.playing.fast")).await;
    assert_eq!(position(&row), ["on", "on.playing", "on.playing.fast"]);
    second.shutdown().await;
}

/// A delegated child that waits for its parent to say how much to capture.
struct Capture;

#[async_trait]
impl StepMachine for Capture {
    fn machine(&self) -> MachineRef {
        MachineRef::new("capture", 1)
    }
    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        match ctx.signal("CAPTURE") {
            None => Ok(Outcome::Await {
                signal: "CAPTURE".into(),
                context: ctx.context.clone(),
                step: Some("waiting".into()),
            }),
            Some(s) => Ok(Outcome::Done { result: json!({ "captured": s.payload }), step: None }),
        }
    }
}

/// An action sends an event to the child its delegation state started, in the parent's
/// commit; the child's result comes back through `@done`.
#[tokio::test]
async fn an_action_sends_an_event_to_its_delegated_child() {
    let h = Harness::new();
    let def = Definition::builder("capturing", 1)
        .initial("paying")
        .state("paying", |s| {
            s.machine("capture")
                .on("SHIP", |t| t.action("capture_now"))
                .on_done(|b| b.target("paid").action("note"))
        })
        .final_state("paid")
        .build()
        .expect("valid chart");
    let m = ChartMachine::new(def)
        .action("capture_now", |ctx, event| async move {
            ctx.send_to_child("paying", "CAPTURE", event.payload.clone());
            Ok(())
        })
        .action("note", |ctx, event| async move {
            ctx.set("payment", event.payload.clone());
            Ok(())
        });
    let id = h.start(m.new_instance(json!({}))).await;
    let worker = Worker::new(Arc::clone(&h.store), h.clock.clone(), h.config())
        .register(m)
        .register(Capture)
        .spawn();
    let child = loop {
        let detail = h.client.get(id).await.unwrap();
        if let Some(c) = detail.children.first() {
            break c.id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    h.wait(child, "the child waits", |r| r.status == Status::AwaitingSignal).await;
    h.client.send(NewSignal::new(id, "SHIP").payload(json!({ "cents": 4200 }))).await.unwrap();
    let row = h.wait(id, "paid", |r| r.status == Status::Done).await;
    assert_eq!(row.result.unwrap_or_default()["payment"]["captured"], json!({ "cents": 4200 }));
    worker.shutdown().await;
}
