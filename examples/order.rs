//! The order chart, run durably: 100 orders go through cart → checkout → payment →
//! processing (inventory ∥ payment as parallel regions) → completed, cancelled or failed.
//!
//! Every event an order receives is one committed macrostep: its actions run (async, with
//! IO), then configuration, context, history and the consumed event are committed
//! together. Kill the process at any moment and nothing already committed is lost.
//!
//! Unpaid orders expire through the chart's `after` timer on `awaiting_payment` —
//! shortened from 7 days to 5 seconds here — fired by the worker's timer sweeper.
//!
//! The regions' entry actions run as tasks of their own (parallel dispatch). A declined
//! card fails the payment region's task for good; the chart's `@fail` answers it, paying
//! again twice (`count_retry`) before it fails the order with an alert.

use keel::{
    ChartMachine, HistoryKind, InsertOutcome, InstanceId, Keel, NewSignal, StateValue, Status,
    StatusSet, Timer, WorkerConfig, json,
};
use keel_examples::order;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const ORDERS: usize = 100;

/// A chart instance's position before it entered its initial states.
const INIT: &str = "@init";

/// Polls (bounded) until every order's state satisfies `done`.
async fn settle(
    keel: &Keel,
    ids: &[InstanceId],
    what: &str,
    done: impl Fn(Status, &StateValue) -> bool,
) -> Result<(), keel::Error> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(120) {
        let mut all = true;
        for id in ids {
            let row = keel.get(*id).await?.instance;
            all &= done(row.status, &StateValue::from_position(&row.position));
        }
        if all {
            return Ok(());
        }
        // Reading every order is not free on a real store: look five times a second.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("orders did not reach '{what}' within 120 s");
}

/// Sends `event` to every order (index, id) that `pick` selects and that has nothing
/// pending in its inbox — so a resumed run never sends an event twice.
async fn send_where(
    keel: &Keel,
    ids: &[InstanceId],
    events: impl Fn(usize) -> Vec<NewSignal>,
    pick: impl Fn(usize, &StateValue) -> bool,
) -> Result<(), keel::Error> {
    let mut batch = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let d = keel.get(*id).await?;
        if d.inbox.is_empty() && pick(n, &StateValue::from_position(&d.instance.position)) {
            batch.extend(events(n));
        }
    }
    if !batch.is_empty() {
        keel.send_many(batch).await?;
    }
    Ok(())
}

/// Drives the orders to their end; returns the tally of how they ended.
async fn run(keel: &Keel, chart: &ChartMachine) -> Result<BTreeMap<String, usize>, keel::Error> {
    // A unique key per order: running the example again finds the orders it started.
    let starts = (0..ORDERS)
        .map(|n| {
            chart
                .new_instance(json!({ "card_ok": n % 10 != 6 }))
                .business_key(format!("order-{n}"))
                .unique(format!("order-{n}"), StatusSet::ALL)
        })
        .collect();
    let outcomes = keel.start_many(starts).await?;
    let resumed = outcomes.iter().filter(|o| matches!(o, InsertOutcome::Existing(_))).count();
    if resumed > 0 {
        println!("resuming: {resumed} of {ORDERS} orders were already in the store");
    }
    let ids: Vec<InstanceId> = outcomes.iter().map(|o| o.id()).collect();
    settle(keel, &ids, "their initial state", |_, s| !s.matches(INIT)).await?;
    println!("{ORDERS} orders are in their carts");

    // Shoppers fill their carts and check out, and 70 of them pay; 30 never do and expire
    // after the (shortened) payment deadline. An order's events go in one batch and its
    // inbox keeps them in order, so PAY follows CHECKOUT: no order waits for a payment
    // this program has yet to send, and a run stopped anywhere and resumed after the
    // deadline still ends as an uninterrupted run does.
    let sku = |n: usize| json!({ "sku": format!("SKU-{}", n % 7) });
    let shop = |n: usize| {
        let mut events = vec![
            NewSignal::new(ids[n], "ADD_ITEM").payload(sku(n)),
            NewSignal::new(ids[n], "CHECKOUT"),
        ];
        if n % 10 < 7 {
            events.push(NewSignal::new(ids[n], "PAY"));
        }
        events
    };
    send_where(keel, &ids, shop, |_, s| s.matches("cart")).await?;
    settle(keel, &ids, "checkout", |_, s| !s.matches("cart")).await?;
    println!("every cart is checked out; 70 orders are paying");

    // Of the payers, cards ending in 6 are declined: the chart's `@fail` pays again twice,
    // then fails the order and raises an alert. Nothing more to send: every order ends.
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    for id in &ids {
        let ended = keel.wait_timeout(*id, Duration::from_secs(120)).await?;
        let ended = ended.unwrap_or_else(|| panic!("order {id} did not end within 120 s"));
        let mut state = ended.state.to_string();
        // A failed order got there through `@fail`: two retries, then the alert.
        let result = ended.result.unwrap_or_default();
        if state == "failed" && (result["retries"] != json!(2) || result["alerted"] != json!(true))
        {
            state = format!("failed without two retries and an alert: {result}");
        }
        *tally.entry(state).or_default() += 1;
    }
    println!("payments are in and the unpaid orders have expired");
    let sample = keel.get(ids[0]).await?;
    println!("\nhistory of {} (order-0):", ids[0]);
    for h in sample.history.iter().filter(|h| h.entry.kind == HistoryKind::Macrostep.as_str()) {
        let records = h.entry.data["records"].as_array().map_or(0, Vec::len);
        println!(
            "  rev {:>2}  {:<16} {records:>2} records",
            h.revision.0,
            h.entry.data["event"].as_str().unwrap_or("(start)")
        );
    }
    Ok(tally)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (keel, described) = keel_examples::demo_store::connect().await?;
    println!("Keel order example — store: {described}\n");
    let chart = order::dispatched(Timer::seconds(5));
    let config =
        WorkerConfig { poll_interval: Duration::from_millis(10), ..WorkerConfig::default() };
    let worker = keel.worker_with(config).register(chart.clone())?.spawn()?;
    let started = Instant::now();
    // Ctrl-C (or SIGTERM) stops the run gracefully: the worker finishes or releases what
    // it holds, so a rerun resumes at once where this one stopped.
    let tally = tokio::select! {
        tally = run(&keel, &chart) => tally?,
        () = keel::shutdown_signal() => {
            let stats = worker.shutdown().await;
            println!(
                "\ninterrupted: stopped cleanly after {} macrosteps; run me again to resume",
                stats.committed()
            );
            std::process::exit(130);
        }
    };
    let elapsed = started.elapsed();
    let stats = worker.shutdown().await;
    println!(
        "\n{ORDERS} orders, {} macrosteps committed by this run in {elapsed:.2?}",
        stats.committed()
    );
    println!("final tally: {tally:?}");
    // A resumed run must end exactly where an uninterrupted one does: an interruption may
    // delay orders, never change how they end.
    let expected: BTreeMap<String, usize> = [("cancelled", 30), ("completed", 60), ("failed", 10)]
        .map(|(k, n)| (k.to_owned(), n))
        .into();
    if tally != expected {
        eprintln!("error: the tally {tally:?} differs from the expected {expected:?}");
        std::process::exit(1);
    }
    Ok(())
}
