//! The order chart shared by the `order` example and its tests: cart → awaiting payment
//! (expires after 7 days) → processing (inventory ∥ payment) → completed / cancelled /
//! failed. Its renderings are checked in under `docs/`: `order-chart.mmd` (Mermaid),
//! `order-chart.dot` (Graphviz), `order-chart.svg` and its JSON form `order-chart.json`.

use keel::{ActionError, ChartMachine, Definition, ParallelConfig, Timer};

/// cart → awaiting_payment (expires after 7 days) → processing (inventory ∥ payment, with
/// `@done` and conditional `@fail`) → completed / cancelled / failed.
pub fn definition() -> Definition {
    definition_with_expiry(Timer::days(7))
}

/// The same chart with a different payment deadline (the `order` example shortens it so
/// you can watch orders expire).
pub fn definition_with_expiry(expiry: Timer) -> Definition {
    Definition::builder("order", 1)
        .guard("has_items", |ctx, _| {
            ctx.get_as::<Vec<String>>("items").is_some_and(|i| !i.is_empty())
        })
        .guard("can_retry", |ctx, _| ctx.get_as::<u32>("retries").unwrap_or(0) < 2)
        .initial("cart")
        .state("cart", |s| {
            s.on("ADD_ITEM", |t| t.action("add_item")).on("CHECKOUT", |t| {
                t.guard("has_items").target("awaiting_payment").action("snapshot_total")
            })
        })
        .state("awaiting_payment", |s| {
            s.on_to("PAY", "processing")
                .on("ORDER_EXPIRED", |t| t.target("cancelled").after(expiry))
                .on_to("CANCEL", "cancelled")
        })
        .parallel("processing", |s| {
            s.state("inventory", |r| {
                r.initial("checking")
                    .state("checking", |s| {
                        s.entry("reserve_stock").on_to("STOCK_RESERVED", "reserved")
                    })
                    .final_state("reserved")
            })
            .state("payment", |r| {
                r.initial("charging")
                    .state("charging", |s| {
                        s.entry("charge_card").on_to("PAYMENT_CAPTURED", "captured").on(
                            "RETRY_PAYMENT",
                            |t| {
                                t.action("charge_card")
                                    .every(Timer::hours(6))
                                    .max(3)
                                    .then("PAYMENT_FAILED")
                            },
                        )
                    })
                    .final_state("captured")
            })
            .on_to("PAYMENT_FAILED", "failed")
            .on_done(|b| b.target("completed").action("send_receipt"))
            .on_fail(|b| b.guard("can_retry").target("awaiting_payment").action("count_retry"))
            .on_fail(|b| b.target("failed").action("alert"))
        })
        .final_state("completed")
        .final_state("cancelled")
        .final_state("failed")
        .build()
        .expect("the order chart is valid")
}

/// [`machine`] with parallel dispatch on, as the `order` example runs it: entering
/// `processing` starts one task per region to run its entry actions (`reserve_stock`,
/// `charge_card`), and a region task that fails for good — a declined card — is reported
/// to the order as `fail.state.processing`, which the chart's `@fail` answers: it retries
/// the payment twice (`count_retry`), then fails the order (`alert`).
pub fn dispatched(expiry: Timer) -> ChartMachine {
    machine(expiry).with_parallel(ParallelConfig::enabled())
}

/// The chart with its actions, the payment deadline set to `expiry`, the regions' entry
/// actions run inline (see [`dispatched`] for the other way). Actions are async and may
/// call other systems; here they only touch the context and raise the events the chart
/// waits for.
///
/// `@fail` answers failed region tasks and child machines, not the chart's own actions:
/// inline, a declined card's error fails the step itself, which is retried and then
/// dead-lettered like any step's error.
pub fn machine(expiry: Timer) -> ChartMachine {
    ChartMachine::new(definition_with_expiry(expiry))
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
            // A call to the payment provider: captured, declined for good, or no answer
            // yet (`card_ok` unset), when the 6-hourly `RETRY_PAYMENT` asks again.
            match ctx.get_as::<bool>("card_ok") {
                Some(true) => {
                    ctx.set("charged", true);
                    ctx.raise("PAYMENT_CAPTURED");
                }
                Some(false) => return Err(ActionError::permanent("card declined")),
                None => {}
            }
            Ok(())
        })
        .action("send_receipt", |ctx, _| async move {
            ctx.set("receipt", format!("RCPT-{}", ctx.instance().0));
            Ok(())
        })
        .action("count_retry", |ctx, _| async move {
            // Back in `awaiting_payment`, pay again at once: `PAY` is handled in this same
            // step, so the order passes through `awaiting_payment` (its expiry is not armed)
            // and `processing` charges the card anew.
            let n = ctx.get_as::<u32>("retries").unwrap_or(0);
            ctx.set("retries", n + 1);
            ctx.raise("PAY");
            Ok(())
        })
        .action("alert", |ctx, _| async move {
            ctx.set("alerted", true);
            Ok(())
        })
}
