//! The order chart, run durably: 100 orders go through cart → checkout → payment →
//! processing (inventory ∥ payment as parallel regions) → completed, cancelled or failed.
//!
//! Every event an order receives is one committed macrostep: its actions run (async, with
//! IO), then configuration, context, history and the consumed event are committed
//! together. Kill the process at any moment and nothing already committed is lost.
//!
//! Unpaid orders expire through the chart's `after` timer on `awaiting_payment` —
//! shortened from 7 days to 3 seconds here — fired by the worker's timer sweeper.

use keel_core::chart::{ActionError, Timer};
use keel_core::ports::Store;
use keel_core::{InstanceId, NewSignal, Status};
use keel_examples::order;
use keel_scheduler::{
    ChartMachine, Client, SweepConfig, SweepGroup, SystemClock, Worker, WorkerConfig,
};
use keel_testkit::memory::MemoryStore;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ORDERS: usize = 100;

/// The chart with its actions. Actions are async and may call other systems; here they
/// only touch the context and raise the events the chart waits for.
fn machine() -> ChartMachine {
    ChartMachine::new(order::definition_with_expiry(Timer::seconds(3)))
        .action("add_item", |ctx, event| async move {
            let mut items: Vec<String> = ctx.get_as("items").unwrap_or_default();
            let sku = event.payload["sku"]
                .as_str()
                .ok_or_else(|| ActionError::permanent("ADD_ITEM needs a sku"))?;
            items.push(sku.to_owned());
            ctx.set_from("items", &items)?;
            Ok(())
        })
        .action("snapshot_total", |ctx, _| async move {
            let n = ctx.get_as::<Vec<String>>("items").map_or(0, |i| i.len());
            ctx.set("total_cents", n * 1_250);
            Ok(())
        })
        .action("reserve_stock", |ctx, _| async move {
            ctx.set("stock", "reserved"); // a call to the inventory service
            ctx.raise("STOCK_RESERVED");
            Ok(())
        })
        .action("charge_card", |ctx, _| async move {
            if ctx.get_as::<bool>("card_ok") == Some(true) {
                ctx.set("charged", true); // a call to the payment provider
                ctx.raise("PAYMENT_CAPTURED");
            }
            Ok(())
        })
        .action("send_receipt", |ctx, _| async move {
            ctx.set("receipt", format!("RCPT-{}", ctx.instance().0));
            Ok(())
        })
        .action("count_retry", |ctx, _| async move {
            let n = ctx.get_as::<u32>("retries").unwrap_or(0);
            ctx.set("retries", n + 1);
            Ok(())
        })
        .action("alert", |ctx, _| async move {
            ctx.set("alerted", true);
            Ok(())
        })
}

async fn settle<S: Store>(
    client: &Client<S, SystemClock>,
    ids: &[InstanceId],
    what: &str,
    done: impl Fn(&keel_core::Instance) -> bool,
) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        let mut all = true;
        for id in ids {
            all &= done(&client.get(*id).await.expect("get").instance);
        }
        if all {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("orders did not reach '{what}' within 60 s");
}

async fn run<S: Store>(store: Arc<S>) {
    let chart = machine();
    assert!(
        chart.missing_actions().is_empty(),
        "unregistered actions: {:?}",
        chart.missing_actions()
    );
    let client = Client::new(Arc::clone(&store), SystemClock);
    let starts = (0..ORDERS)
        .map(|n| {
            chart.new_instance(json!({ "card_ok": n % 10 != 6 })).business_key(format!("order-{n}"))
        })
        .collect();
    let sweep_often = SweepGroup { machines: vec![], cadence: Duration::from_millis(100) };
    let config = WorkerConfig {
        poll_interval: Duration::from_millis(10),
        timers: Some(SweepConfig { groups: vec![sweep_often], ..SweepConfig::default() }),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(Arc::clone(&store), SystemClock, config).register(chart).spawn();
    let started = Instant::now();
    let ids: Vec<InstanceId> =
        client.start_many(starts).await.expect("start").iter().map(|o| o.id()).collect();

    // Shoppers fill their carts and check out.
    let mut events = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        events.push(
            NewSignal::new(*id, "ADD_ITEM").payload(json!({ "sku": format!("SKU-{}", n % 7) })),
        );
        events.push(NewSignal::new(*id, "CHECKOUT"));
    }
    client.send_many(events).await.expect("send");
    let in_state = |state: &'static str| {
        move |r: &keel_core::Instance| r.position.contains(&format!("\"{state}\""))
    };
    settle(&client, &ids, "awaiting_payment", in_state("awaiting_payment")).await;

    // 70 pay; 30 never do and expire after the (shortened) payment deadline. Of the
    // payers, cards ending in 6 are declined and the payment gives up (the event the
    // 6-hourly retry timer's `then` would send after three tries).
    let events = ids
        .iter()
        .enumerate()
        .filter(|(n, _)| n % 10 < 7)
        .map(|(_, id)| NewSignal::new(*id, "PAY"))
        .collect();
    client.send_many(events).await.expect("send");
    settle(&client, &ids, "processed", |r| {
        r.status.is_terminal() || r.position.contains("charging")
    })
    .await;
    let stuck: Vec<NewSignal> = {
        let mut v = Vec::new();
        for id in &ids {
            if !client.get(*id).await.expect("get").instance.status.is_terminal() {
                v.push(NewSignal::new(*id, "PAYMENT_FAILED"));
            }
        }
        v
    };
    client.send_many(stuck).await.expect("send");
    settle(&client, &ids, "a final state", |r| r.status == Status::Done).await;
    let elapsed = started.elapsed();
    let stats = worker.shutdown().await;

    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    for id in &ids {
        let row = client.get(*id).await.expect("get").instance;
        let result = row.result.unwrap_or_default();
        let outcome = if result.get("receipt").is_some() {
            "completed"
        } else if result.get("charged").is_some() || result.get("stock").is_some() {
            "failed"
        } else {
            "expired"
        };
        *tally.entry(outcome.to_owned()).or_default() += 1;
    }
    println!("{ORDERS} orders, {} committed macrosteps in {:.2?}", stats.committed(), elapsed);
    println!("final tally: {tally:?}");
    let sample = client.get(ids[0]).await.expect("get");
    println!("\nhistory of {} (order-0):", ids[0]);
    for h in sample.history.iter().filter(|h| h.entry.kind == "MACROSTEP") {
        println!(
            "  rev {:>2}  {:<10} {}",
            h.revision.0,
            h.entry.data["event"].as_str().unwrap_or("(start)"),
            h.entry.data["records"]
        );
    }
    assert_eq!(tally.get("completed"), Some(&60));
    assert_eq!(tally.get("failed"), Some(&10));
    assert_eq!(tally.get("expired"), Some(&30));
}

#[tokio::main]
async fn main() {
    println!("Keel order example — store: in-memory (embedded, nothing to install)\n");
    run(Arc::new(MemoryStore::new())).await;
}
