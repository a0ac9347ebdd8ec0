//! The durable runtime and `TestMachine` run the same chart step: one chart, driven with
//! the same events through both, records the same history — an unhandled event, a
//! transition with an action, a parallel state whose regions are dispatched as region
//! tasks, their reports (one region finishing, one stalling), and the region timeout that
//! fails the stuck parallel state.

mod common;

use common::Harness;
use keel_core::chart::{ActionError, Definition, Event};
use keel_core::instance::NewSignal;
use keel_core::{InstanceId, Status, WorkerId};
use keel_parallel::ParallelConfig;
use keel_scheduler::{ActionContext, ChartMachine, SweepConfig, Sweeper, Worker, WorkerConfig};
use keel_testkit::chart::TestMachine;
use keel_testkit::memory::MemoryStore;
use keel_timers::SweepOutcome;
use serde_json::{Value, json};
use std::future::{Ready, ready};
use std::sync::Arc;
use std::time::Duration;

const REGION_TIMEOUT: Duration = Duration::from_secs(120);

/// A cart that checks out into a parallel state of two regions with entry actions; the
/// inventory region finishes from its entry action, the payment region waits for an event
/// that never comes, so the region timeout fails the parallel state.
fn checkout() -> Definition {
    Definition::builder("checkout", 1)
        .initial("cart")
        .state("cart", |s| s.on("CHECKOUT", |t| t.target("processing").action("note")))
        .parallel("processing", |p| {
            p.state("inventory", |r| {
                r.initial("checking")
                    .state("checking", |s| {
                        s.entry("check_inventory").on_to("INVENTORY_OK", "ready")
                    })
                    .final_state("ready")
            })
            .state("payment", |r| {
                r.initial("validating")
                    .state("validating", |s| s.entry("validate_payment").on_to("PAYMENT_OK", "ok"))
                    .final_state("ok")
            })
            .on_done(|b| b.target("completed"))
            .on_fail(|b| b.target("failed"))
        })
        .final_state("completed")
        .final_state("failed")
        .build()
        .expect("valid chart")
}

fn parallel() -> ParallelConfig {
    ParallelConfig { region_timeout: REGION_TIMEOUT, job_tries: 1, ..ParallelConfig::enabled() }
}

type Done = Ready<Result<(), ActionError>>;

/// The durable machine; with `out_of_stock` the inventory check fails for good.
fn durable(out_of_stock: bool) -> ChartMachine {
    ChartMachine::new(checkout())
        .with_parallel(parallel())
        .action("note", |ctx: ActionContext, e: Event| -> Done {
            ctx.set("checked_out_by", e.name);
            ready(Ok(()))
        })
        .action("check_inventory", move |ctx: ActionContext, _| -> Done {
            if out_of_stock {
                return ready(Err(ActionError::permanent("no stock")));
            }
            ctx.set("inventory", true);
            ctx.raise("INVENTORY_OK");
            ready(Ok(()))
        })
        .action("validate_payment", |ctx: ActionContext, _| -> Done {
            ctx.set("payment_checked", true);
            ready(Ok(()))
        })
}

/// The same machine in memory.
fn in_memory(out_of_stock: bool) -> TestMachine {
    TestMachine::new(checkout())
        .with_parallel(parallel())
        .action_sync("note", |ctx, e| ctx.set("checked_out_by", e.name.clone()))
        .action("check_inventory", move |ctx, _| async move {
            if out_of_stock {
                return Err(ActionError::permanent("no stock"));
            }
            ctx.set("inventory", true);
            ctx.raise("INVENTORY_OK");
            Ok(())
        })
        .action_sync("validate_payment", |ctx, _| ctx.set("payment_checked", true))
}

/// The entries the chart step recorded, as (kind, data). The engine's own bookkeeping of
/// each commit (`STEP_*`) and of each timer fire (`TIMER_*`) names row ids and wall-clock
/// times and is written by the store, not the chart step, so it is left out.
fn chart_entries(history: impl IntoIterator<Item = (String, Value)>) -> Vec<(String, Value)> {
    history
        .into_iter()
        .filter(|(kind, _)| !kind.starts_with("STEP_") && !kind.starts_with("TIMER_"))
        .collect()
}

/// Polls until the instance has an empty inbox and is parked or finished.
async fn settled(h: &Harness, id: InstanceId) -> Status {
    for _ in 0..1_000 {
        let d = h.client.get(id).await.expect("get");
        if d.inbox.is_empty() && matches!(d.instance.status, Status::AwaitingSignal | Status::Done)
        {
            return d.instance.status;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("instance {id:?} did not settle");
}

/// Polls until the instance's history holds `n` entries of `kind`.
async fn until_recorded(h: &Harness, id: InstanceId, kind: &str, n: usize) {
    for _ in 0..1_000 {
        let history = h.client.get(id).await.expect("get").history;
        if history.iter().filter(|r| r.entry.kind == kind).count() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("instance {id:?} did not record {n} `{kind}` entries");
}

/// Sweeps until the due region timeout has been fired.
async fn sweep(h: &Harness) {
    let sweeper = Sweeper::new(Arc::clone(&h.store), h.clock.clone(), SweepConfig::default())
        .expect("sweeper");
    for _ in 0..400 {
        if let SweepOutcome::Swept { report, .. } = sweeper.sweep(&[]).await.expect("sweep")
            && report.processed > 0
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the region timeout was never swept");
}

/// The durable run: one worker on `MemoryStore` with a virtual clock, claiming one step
/// at a time, so the region tasks run (and report) in dispatch order, as `TestMachine`
/// runs them.
async fn durable_history() -> (Vec<(String, Value)>, String, Value) {
    let h: Harness<MemoryStore> = Harness::new();
    let machine = durable(false);
    let id = h.start(machine.new_instance(json!({}))).await;
    let config = WorkerConfig {
        worker_id: WorkerId("same-step".into()),
        queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), 1)],
        timers: None,
        ..h.config()
    };
    let worker = h
        .hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(machine))
        .spawn();
    settled(&h, id).await;
    h.client.send(NewSignal::new(id, "BOGUS")).await.expect("send");
    settled(&h, id).await;
    h.client.send(NewSignal::new(id, "CHECKOUT")).await.expect("send");
    until_recorded(&h, id, "PARALLEL_REGION_ENTER", 2).await;
    settled(&h, id).await;
    h.clock.advance(REGION_TIMEOUT + Duration::from_secs(1));
    sweep(&h).await;
    until_recorded(&h, id, "PARALLEL_REGION_TIMEOUT", 1).await;
    assert_eq!(settled(&h, id).await, Status::Done, "the timeout failed the parallel state");
    worker.shutdown().await;
    let detail = h.client.get(id).await.expect("get");
    let history = detail.history.into_iter().map(|r| (r.entry.kind, r.entry.data));
    let context = detail.instance.result.unwrap_or(Value::Null);
    (chart_entries(history), detail.instance.position, context)
}

#[tokio::test]
async fn test_machine_and_the_durable_runtime_record_the_same_history() {
    let (durable, durable_position, durable_context) = durable_history().await;

    // TestMachine drives its actions on a private runtime, so it runs off this one.
    let (memory, memory_position, memory_context) = tokio::task::spawn_blocking(|| {
        let mut m = in_memory(false);
        m.send("BOGUS").send("CHECKOUT");
        m.advance_timers(REGION_TIMEOUT + Duration::from_secs(1));
        m.assert_final().assert_state("failed");
        let history = m.history_entries().iter().map(|e| (e.kind.clone(), e.data.clone()));
        let history = chart_entries(history.collect::<Vec<_>>());
        (history, m.position(), m.context().clone())
    })
    .await
    .expect("the in-memory run");

    let kinds: Vec<&str> = durable.iter().map(|(kind, _)| kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "MACROSTEP",
            "MACROSTEP",
            "EVENT_UNHANDLED",
            "MACROSTEP",
            "PARALLEL_DISPATCH",
            "MACROSTEP",
            "PARALLEL_REGION_ENTER",
            "MACROSTEP",
            "PARALLEL_REGION_ENTER",
            "PARALLEL_REGION_STALLED",
            "PARALLEL_REGION_TIMEOUT",
            "MACROSTEP",
        ],
        "the durable history covers dispatch, both reports and the timeout: {durable:#?}"
    );
    assert_eq!(memory, durable, "the same events give the same history in memory and durably");
    assert_eq!(memory_position, durable_position);
    assert_eq!(memory_position, r#"["failed"]"#);
    assert_eq!(memory_context, durable_context);
    assert_eq!(
        durable_context,
        json!({ "checked_out_by": "CHECKOUT", "inventory": true, "payment_checked": true })
    );
}

/// A region whose entry action fails for good fails the parallel state through `@fail`,
/// with the same `PARALLEL_FAIL` (region, error, exception, attempts) in both runtimes.
#[tokio::test]
async fn a_failing_region_records_the_same_history_in_memory_and_durably() {
    let h: Harness<MemoryStore> = Harness::new();
    let machine = durable(true);
    let id = h.start(machine.new_instance(json!({}))).await;
    let config = WorkerConfig {
        worker_id: WorkerId("same-step".into()),
        queues: vec![(keel_core::ids::DEFAULT_QUEUE.to_owned(), 1)],
        timers: None,
        ..h.config()
    };
    let worker = h
        .hinted(Worker::new(Arc::clone(&h.store), h.clock.clone(), config).register(machine))
        .spawn();
    settled(&h, id).await;
    h.client.send(NewSignal::new(id, "CHECKOUT")).await.expect("send");
    // The payment region's report may still sit in the finished instance's inbox: wait
    // for the finish itself rather than for an empty inbox.
    h.wait(id, "the failed parallel state", |r| r.status == Status::Done).await;
    worker.shutdown().await;
    let detail = h.client.get(id).await.expect("get");
    let mut durable =
        chart_entries(detail.history.into_iter().map(|r| (r.entry.kind, r.entry.data)));
    // Whether the payment region reports before or after the parallel state failed is a
    // race between two instances (the worker claims the region while the failing report
    // commits); a late report is drained unread when the instance ends. Only such a
    // report may be drained.
    if let Some((kind, data)) = durable.last()
        && kind == "INBOX_DRAINED"
    {
        let names: Vec<&Value> =
            data["signals"].as_array().into_iter().flatten().map(|s| &s["name"]).collect();
        assert!(
            names.iter().all(|n| *n == "parallel.region"),
            "only late region reports are drained: {data}"
        );
        durable.pop();
    }

    let memory = tokio::task::spawn_blocking(|| {
        let mut m = in_memory(true);
        m.send("CHECKOUT").assert_final().assert_state("failed");
        let history = m.history_entries().iter().map(|e| (e.kind.clone(), e.data.clone()));
        chart_entries(history.collect::<Vec<_>>())
    })
    .await
    .expect("the in-memory run");

    let fail: Vec<&Value> =
        durable.iter().filter(|(kind, _)| kind == "PARALLEL_FAIL").map(|(_, data)| data).collect();
    assert_eq!(
        fail,
        [&json!({
            "region_id": "processing.inventory",
            "error": "action `check_inventory` of state `processing.inventory.checking` failed: no stock",
            "exception": "ActionError",
            "attempts": 1,
        })]
    );
    assert_eq!(memory, durable, "the same events give the same history in memory and durably");
    assert_eq!(detail.instance.position, r#"["failed"]"#);
}
