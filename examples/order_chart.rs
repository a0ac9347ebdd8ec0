//! The order chart shared by the `order` example and its tests: cart → awaiting payment
//! (expires after 7 days) → processing (inventory ∥ payment) → completed / cancelled /
//! failed. Its Mermaid rendering is checked in as `docs/order-chart.mmd`.

use keel_core::chart::{Definition, Timer};

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
