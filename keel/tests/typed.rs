//! Typed contexts and payloads: a step machine and a chart that read and write their own
//! structs instead of JSON values, end to end through a store.

use keel::{
    ChartMachine, Definition, Keel, MachineRef, NewInstance, NewSignal, Outcome, Status,
    StepContext, StepError, StepMachine,
};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Order {
    sku: String,
    cents: u64,
    paid: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct Paid {
    cents: u64,
}

struct Checkout;

#[keel::async_trait]
impl StepMachine for Checkout {
    fn machine(&self) -> MachineRef {
        MachineRef::new("checkout", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let mut order: Order = ctx.context_as()?;
        match ctx.signal("PAID") {
            Some(signal) => {
                let paid: Paid = signal.payload_as()?;
                order.paid = paid.cents == order.cents;
                Ok(Outcome::done_with(&order)?)
            }
            None => Ok(Outcome::await_with("PAID", &order)?),
        }
    }
}

#[tokio::test]
async fn a_step_machine_works_on_its_own_types() {
    let keel = Keel::connect("sqlite::memory:").await.unwrap();
    let worker = keel.worker().register(Checkout).unwrap().spawn().unwrap();
    let order = Order { sku: "SKU-1".into(), cents: 4200, paid: false };
    let start = NewInstance::new(MachineRef::new("checkout", 1), "pay").context_of(&order).unwrap();
    let id = keel.start(start).await.unwrap().id();
    keel.send(NewSignal::new(id, "PAID").payload_of(&Paid { cents: 4200 }).unwrap()).await.unwrap();
    let ended = keel.wait_timeout(id, Duration::from_secs(20)).await.unwrap().expect("ends");
    assert_eq!(ended.status, Status::Done);
    assert_eq!(ended.result_as::<Order>().unwrap(), Order { paid: true, ..order });
    worker.shutdown().await;
}

#[tokio::test]
async fn a_chart_reads_typed_payloads_and_starts_from_a_typed_context() {
    let keel = Keel::connect("sqlite::memory:").await.unwrap();
    let chart = Definition::builder("till", 1)
        .guard_typed::<Order>("unpaid", |order, _| !order.paid)
        .initial("open")
        .state("open", |s| s.on("PAY", |t| t.guard("unpaid").target("paid").action("take")))
        .final_state("paid")
        .build()
        .unwrap();
    let till = ChartMachine::new(chart).action("take", |ctx, event| async move {
        let paid: Paid = event.payload_as()?;
        ctx.set_from("cents", &paid.cents)?;
        ctx.set("paid", true);
        Ok(())
    });
    let worker = keel.worker().register(till.clone()).unwrap().spawn().unwrap();
    let order = Order { sku: "SKU-2".into(), cents: 0, paid: false };
    let id = keel.start(till.new_instance_of(&order).unwrap()).await.unwrap().id();
    keel.send(NewSignal::new(id, "PAY").payload_of(&Paid { cents: 990 }).unwrap()).await.unwrap();
    let ended = keel.wait_timeout(id, Duration::from_secs(20)).await.unwrap().expect("ends");
    assert!(ended.state.matches("paid"));
    assert_eq!(ended.result_as::<Order>().unwrap(), Order { cents: 990, paid: true, ..order });
    worker.shutdown().await;
}
