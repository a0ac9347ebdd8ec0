//! A step machine on Keel: an order workflow written as durable steps, run by a Keel worker on
//! SQLite in `./keel-demo.db` (nothing to install; `--memory` runs it on the in-memory store).
//!
//! It shows, in order: starting instances in one batch (with a uniqueness key), a step
//! that parks on a signal (`Await`), signals delivered from outside (one twice, deduped),
//! a transient failure retried with the configured backoff, a fan-out to child instances
//! and the fan-in barrier (`ScheduleChildren`), cancellation, and the history an operator
//! sees. Every step's outcome is committed before the next step runs.

use keel::{
    Cancel, InstanceId, Keel, MachineRef, NewInstance, NewSignal, Outcome, Status, StatusSet,
    StepContext, StepError, StepMachine, WorkerConfig, async_trait, json,
};
use std::collections::BTreeMap;
use std::time::Duration;

const ORDERS: usize = 20;

/// The `order_steps` machine (named apart from the `order` chart of `cargo run --example order`,
/// which shares the demo's file): reserve → await payment → ship (fan out parcels) → complete.
struct Order;

#[async_trait]
impl StepMachine for Order {
    fn machine(&self) -> MachineRef {
        MachineRef::new("order_steps", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let mut state = ctx.context.clone();
        Ok(match ctx.step.as_str() {
            "reserve" => {
                // A flaky inventory service: every third order fails on its first attempt.
                let n = state["n"].as_u64().unwrap_or(0);
                if n.is_multiple_of(3) && ctx.attempt == 0 {
                    return Err(StepError::retryable(format!(
                        "inventory service timed out for order {n}"
                    )));
                }
                state["reserved"] = json!(true);
                Outcome::Next { step: "await_payment".into(), context: state }
            }
            "await_payment" => match ctx.signal("PAID") {
                Some(paid) => {
                    state["paid_cents"] = paid.payload["cents"].clone();
                    Outcome::Next { step: "ship".into(), context: state }
                }
                None => Outcome::Await { signal: "PAID".into(), context: state, step: None },
            },
            "ship" => {
                let parcels = (0..2)
                    .map(|i| {
                        NewInstance::new(MachineRef::new("parcel", 1), "pack")
                            .context(json!({ "parcel": i }))
                    })
                    .collect();
                Outcome::schedule_children("complete", parcels, state)
            }
            "complete" => {
                let packed = ctx.children.iter().filter(|c| c.status == Status::Done).count();
                Outcome::Done { result: json!({ "parcels_packed": packed }), step: None }
            }
            other => Outcome::Stop { reason: format!("unknown step {other}") },
        })
    }
}

/// The `parcel` child machine: one step.
struct Parcel;

#[async_trait]
impl StepMachine for Parcel {
    fn machine(&self) -> MachineRef {
        MachineRef::new("parcel", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!({ "label": format!("PARCEL-{}", ctx.id) }), step: None })
    }
}

/// Polls (bounded: 10 s at most) until every instance's status satisfies `done`.
async fn wait_until(
    keel: &Keel,
    ids: &[InstanceId],
    done: impl Fn(Status) -> bool,
) -> Result<(), keel::Error> {
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        let mut all = true;
        for id in ids {
            all &= done(keel.get(*id).await?.instance.status);
        }
        if all {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the example did not settle within 10 s");
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (keel, described) = keel_examples::demo_store::connect().await?;
    println!("Keel steps example — store: {described}\n");
    let config =
        WorkerConfig { poll_interval: Duration::from_millis(20), ..WorkerConfig::default() };
    let worker = keel.worker_with(config).register(Order)?.register(Parcel)?.spawn()?;

    // 1. Start orders in one batch. The unique key makes a second start of order:0 a no-op.
    let mut batch: Vec<NewInstance> = (0..ORDERS)
        .map(|n| {
            NewInstance::new(MachineRef::new("order_steps", 1), "reserve")
                .business_key(format!("order:{n}"))
                .unique(format!("order:{n}"), StatusSet::ALL)
                .context(json!({ "n": n }))
        })
        .collect();
    batch.push(batch[0].clone());
    let inserted = keel.start_many(batch).await?;
    let ids: Vec<_> = inserted.iter().take(ORDERS).map(|o| o.id()).collect();
    println!("started {ORDERS} orders; starting order:0 again returned {:?}", inserted[ORDERS]);

    // 2. Orders reserve stock (every third fails once and is retried after 1 s) and park.
    wait_until(&keel, &ids, |s| s == Status::AwaitingSignal || s.is_terminal()).await?;
    println!("all orders reserved and waiting for payment");

    // 3. Customers pay 15 orders (order:0 pays twice: the dedup key keeps one); 5 are cancelled.
    let payments = ids[..15]
        .iter()
        .chain(std::iter::once(&ids[0]))
        .map(|id| {
            NewSignal::new(*id, "PAID")
                .payload(json!({ "cents": 4200 }))
                .dedup_key(format!("payment:{id}"))
        })
        .collect();
    keel.send_many(payments).await?;
    for id in &ids[15..] {
        keel.cancel(Cancel::new(*id).cascade().reason("customer changed their mind")).await?;
    }

    // 4. Paid orders ship two parcels each (child instances), join, and complete.
    for id in &ids {
        if keel.wait_timeout(*id, Duration::from_secs(60)).await?.is_none() {
            return Err(format!("order {id} has not ended after 60 s").into());
        }
    }
    let stats = worker.shutdown().await;

    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    for id in &ids {
        *tally.entry(keel.get(*id).await?.instance.status.to_string()).or_default() += 1;
    }
    println!("worker committed {} steps; final tally of orders: {tally:?}", stats.committed());
    let detail = keel.get(ids[0]).await?;
    println!(
        "\nhistory of {} ({}):",
        ids[0],
        detail.instance.business_key.as_deref().unwrap_or("-")
    );
    for h in &detail.history {
        let data = &h.entry.data;
        println!("  rev {:>2}  attempt {}  {:<24} {data}", h.revision.0, h.attempt, h.entry.kind);
    }
    println!("result: {}", detail.instance.result.clone().unwrap_or_default());
    assert_eq!(tally.get("done"), Some(&15), "every paid order completes");
    assert_eq!(tally.get("cancelled"), Some(&5), "every unpaid order is cancelled");
    Ok(())
}
