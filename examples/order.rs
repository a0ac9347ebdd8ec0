//! The order chart, run durably: 100 orders go through cart → checkout → payment →
//! processing (inventory ∥ payment as parallel regions) → completed, cancelled or failed.
//!
//! Every event an order receives is one committed macrostep: its actions run (async, with
//! IO), then configuration, context, history and the consumed event are committed
//! together. Kill the process at any moment and nothing already committed is lost.
//!
//! Unpaid orders expire through the chart's `after` timer on `awaiting_payment` —
//! shortened from 7 days to 5 seconds here — fired by the worker's timer sweeper.

use keel_core::chart::Timer;
use keel_core::ports::Store;
use keel_core::ports::store::InsertOutcome;
use keel_core::{HistoryKind, Instance, InstanceId, NewSignal, Status, StatusSet};
use keel_examples::demo_store::DemoStore;
use keel_examples::on_demo_store;
use keel_examples::order;
use keel_scheduler::chart::INIT;
use keel_scheduler::{Client, SweepConfig, SystemClock, Worker, WorkerConfig};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ORDERS: usize = 100;

/// Polls (bounded) until every order satisfies `done`.
async fn settle<S: Store>(
    client: &Client<S, SystemClock>,
    ids: &[InstanceId],
    what: &str,
    done: impl Fn(&Instance) -> bool,
) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(120) {
        let mut all = true;
        for id in ids {
            all &= done(&client.get(*id).await.expect("get").instance);
        }
        if all {
            return;
        }
        // Reading every order is not free on a real store: look five times a second.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("orders did not reach '{what}' within 120 s");
}

fn in_state(r: &Instance, state: &str) -> bool {
    r.position.contains(&format!("\"{state}\""))
}

/// Sends `event` to every order (index, id) that `pick` selects and that has nothing
/// pending in its inbox — so a resumed run never sends an event twice.
async fn send_where<S: Store>(
    client: &Client<S, SystemClock>,
    ids: &[InstanceId],
    events: impl Fn(usize) -> Vec<NewSignal>,
    pick: impl Fn(usize, &Instance) -> bool,
) {
    let mut batch = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let d = client.get(*id).await.expect("get");
        if d.inbox.is_empty() && pick(n, &d.instance) {
            batch.extend(events(n));
        }
    }
    if !batch.is_empty() {
        client.send_many(batch).await.expect("send");
    }
}

async fn run<S: Store>(store: Arc<S>) {
    let chart = order::machine(Timer::seconds(5));
    assert!(
        chart.missing_actions().is_empty(),
        "unregistered actions: {:?}",
        chart.missing_actions()
    );
    let client = Client::new(Arc::clone(&store), SystemClock);
    // A unique key per order: running the example again finds the orders it started.
    let starts = (0..ORDERS)
        .map(|n| {
            chart
                .new_instance(json!({ "card_ok": n % 10 != 6 }))
                .business_key(format!("order-{n}"))
                .unique(format!("order-{n}"), StatusSet::ALL)
        })
        .collect();
    let config = WorkerConfig {
        poll_interval: Duration::from_millis(10),
        timers: Some(SweepConfig::default()),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(Arc::clone(&store), SystemClock, config).register(chart).spawn();
    let started = Instant::now();
    let outcomes = client.start_many(starts).await.expect("start");
    let resumed = outcomes.iter().filter(|o| matches!(o, InsertOutcome::Existing(_))).count();
    if resumed > 0 {
        println!("resuming: {resumed} of {ORDERS} orders were already in the store");
    }
    let ids: Vec<InstanceId> = outcomes.iter().map(|o| o.id()).collect();
    settle(&client, &ids, "their initial state", |r| r.position != INIT).await;

    // Shoppers fill their carts and check out.
    let sku = |n: usize| json!({ "sku": format!("SKU-{}", n % 7) });
    send_where(
        &client,
        &ids,
        |n| {
            vec![
                NewSignal::new(ids[n], "ADD_ITEM").payload(sku(n)),
                NewSignal::new(ids[n], "CHECKOUT"),
            ]
        },
        |_, r| in_state(r, "cart"),
    )
    .await;
    settle(&client, &ids, "checkout", |r| !in_state(r, "cart")).await;

    // 70 pay; 30 never do and expire after the (shortened) payment deadline. Of the
    // payers, cards ending in 6 are declined and the payment gives up (the event the
    // 6-hourly retry timer's `then` would send after three tries).
    send_where(
        &client,
        &ids,
        |n| vec![NewSignal::new(ids[n], "PAY")],
        |n, r| n % 10 < 7 && in_state(r, "awaiting_payment"),
    )
    .await;
    settle(&client, &ids, "payment", |r| {
        r.status.is_terminal() || in_state(r, "processing.payment.charging")
    })
    .await;
    send_where(
        &client,
        &ids,
        |n| vec![NewSignal::new(ids[n], "PAYMENT_FAILED")],
        |_, r| in_state(r, "processing.payment.charging"),
    )
    .await;
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
    println!(
        "{ORDERS} orders, {} macrosteps committed by this run in {:.2?}",
        stats.committed(),
        elapsed
    );
    println!("final tally: {tally:?}");
    let sample = client.get(ids[0]).await.expect("get");
    println!("\nhistory of {} (order-0):", ids[0]);
    for h in sample.history.iter().filter(|h| h.entry.kind == HistoryKind::Macrostep.as_str()) {
        let records = h.entry.data["records"].as_array().map_or(0, Vec::len);
        println!(
            "  rev {:>2}  {:<10} {records:>2} records",
            h.revision.0,
            h.entry.data["event"].as_str().unwrap_or("(start)")
        );
    }
    // A resumed run must end exactly where an uninterrupted one does: a crash may delay
    // orders, never change how they end.
    let expected: BTreeMap<String, usize> =
        [("completed", 60), ("expired", 30), ("failed", 10)].map(|(k, n)| (k.to_owned(), n)).into();
    if tally != expected {
        eprintln!("error: the tally {tally:?} differs from the expected {expected:?}");
        std::process::exit(1);
    }
}

#[tokio::main]
async fn main() {
    let demo = DemoStore::from_env().await.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2);
    });
    println!("Keel order example — store: {}\n", demo.describe());
    on_demo_store!(demo, |store| run(store).await);
}
