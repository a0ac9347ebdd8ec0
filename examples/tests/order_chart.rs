//! The order example chart end to end: built with the builder, run with `TestMachine` and
//! async inline actions, checked with a property, and rendered to the golden Mermaid file
//! `docs/order-chart.mmd` (rewrite it with `KEEL_BLESS=1 cargo test`).

use std::path::PathBuf;

use keel_core::chart::Timer;
use keel_examples::order::definition;
use keel_testkit::TestMachine;
use keel_testkit::prop::{InvariantOptions, check_invariant, check_invariant_with};
use serde::Serialize;
use serde_json::json;

#[derive(Serialize)]
struct Order {
    items: Vec<String>,
    card_ok: bool,
}

fn machine(card_ok: bool) -> TestMachine {
    TestMachine::new(definition())
        .with_context(Order { items: vec![], card_ok })
        .action("add_item", |ctx, event| async move {
            let mut items: Vec<String> = ctx.get_as("items").unwrap_or_default();
            items.push(event.payload["sku"].as_str().ok_or("ADD_ITEM needs a sku")?.to_owned());
            ctx.set_from("items", &items)?;
            Ok(())
        })
        .action_sync("snapshot_total", |ctx, _| {
            let n = ctx.get_as::<Vec<String>>("items").map_or(0, |i| i.len());
            ctx.set("total", n * 10);
        })
        .action("reserve_stock", |ctx, _| async move {
            tokio::task::yield_now().await; // an "API call"
            ctx.set("stock", "reserved");
            ctx.raise("STOCK_RESERVED");
            Ok(())
        })
        .action("charge_card", |ctx, _| async move {
            if ctx.get_as::<bool>("card_ok") == Some(true) {
                ctx.set("charged", true);
                ctx.raise("PAYMENT_CAPTURED");
            }
            Ok(())
        })
        .action_sync("count_retry", |ctx, _| {
            let retries = ctx.get_as::<u32>("retries").unwrap_or(0);
            ctx.set("retries", retries + 1);
        })
}

#[test]
fn happy_path_completes_in_one_macrostep_after_pay() {
    machine(true)
        .assert_state("cart")
        .send("CHECKOUT")
        .assert_state("cart") // guarded: no items yet
        .assert_unhandled()
        .send_with("ADD_ITEM", json!({"sku": "A-1"}))
        .assert_context("items", ["A-1"])
        .send("CHECKOUT")
        .assert_state("awaiting_payment")
        .assert_context("total", 10)
        .assert_has_timer("ORDER_EXPIRED")
        .send("PAY")
        .assert_no_timer("ORDER_EXPIRED")
        .assert_state("completed")
        .assert_final()
        .assert_context("charged", true)
        .assert_context("stock", "reserved")
        .assert_history(&[
            "enter processing",
            "enter processing.inventory.checking",
            "action reserve_stock",
            "enter processing.payment.charging",
            "action charge_card",
            // Raised events queue in order; each region's done event follows its own final
            // state's entry, so both raised events come first (SCXML internal queue).
            "internal STOCK_RESERVED",
            "internal PAYMENT_CAPTURED",
            "internal done.state.processing.inventory",
            "internal done.state.processing.payment",
            "internal done.state.processing",
            "transition processing -> completed on done.state.processing",
            "exit processing",
            "action send_receipt",
            "enter completed",
        ]);
}

#[test]
fn declined_card_waits_in_processing_and_fail_retries_then_fails() {
    let mut m = machine(false);
    m.send_with("ADD_ITEM", json!({"sku": "A-1"})).send("CHECKOUT").send("PAY");
    m.assert_matches(json!({"processing": {"inventory": "reserved", "payment": "charging"}}))
        .assert_has_timer("RETRY_PAYMENT");
    let fail = json!({"region_id": "processing.payment", "error": "declined", "attempts": 3});
    m.send_with("fail.state.processing.payment", &fail)
        .assert_state("awaiting_payment")
        .assert_context("retries", 1)
        .send("PAY")
        .send_with("fail.state.processing.payment", &fail)
        .assert_context("retries", 2)
        .send("PAY")
        .send_with("fail.state.processing.payment", &fail)
        .assert_state("failed")
        .assert_history(&["action alert", "enter failed"])
        .assert_final();
}

#[test]
fn expiry_and_unknown_events() {
    machine(true)
        .send_with("ADD_ITEM", json!({"sku": "A-1"}))
        .send("CHECKOUT")
        .send("NOT_AN_EVENT")
        .assert_unhandled()
        .assert_state("awaiting_payment")
        .send("ORDER_EXPIRED")
        .assert_state("cancelled")
        .assert_final();
}

#[test]
fn failing_action_reports_the_error_and_commits_nothing() {
    let mut m = machine(true);
    let err = m.try_send("ADD_ITEM").unwrap_err();
    assert_eq!(err.to_string(), "action `add_item` of state `cart` failed: ADD_ITEM needs a sku");
    m.assert_state("cart").assert_context("items", Vec::<String>::new());
}

#[test]
fn invariants_hold_for_random_event_sequences() {
    let def = definition();
    // Without actions: the structure alone.
    check_invariant(def.clone(), |s| {
        !(s.configuration.contains("completed") && s.configuration.contains("failed"))
    });
    // With actions: completing always means the card was charged.
    let lenient = || {
        machine(true).action_sync("add_item", |ctx, _| {
            let mut items: Vec<String> = ctx.get_as("items").unwrap_or_default();
            items.push("sku".to_owned());
            ctx.set_from("items", &items).expect("strings serialize");
        })
    };
    check_invariant_with(&def, lenient, &InvariantOptions { cases: 64, max_len: 12 }, |s| {
        !s.configuration.contains("completed") || s.context["charged"] == json!(true)
    });
}

#[test]
#[should_panic(expected = "invariant of `order` violated")]
fn a_false_invariant_is_reported() {
    check_invariant(definition(), |s| !s.result.unhandled);
}

#[test]
fn mermaid_matches_the_golden_file() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/order-chart.mmd");
    let actual = definition().to_mermaid();
    if std::env::var_os("KEEL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &actual).expect("write the golden file");
    }
    let golden = std::fs::read_to_string(&path)
        .expect("docs/order-chart.mmd exists (run with KEEL_BLESS=1)");
    assert_eq!(actual, golden, "Mermaid output changed; rerun with KEEL_BLESS=1 to accept it");
}

#[test]
fn unpaid_orders_expire_after_seven_days() {
    machine(true)
        .send_with("ADD_ITEM", json!({"sku": "A-1"}))
        .send("CHECKOUT")
        .advance_timers(Timer::days(6))
        .assert_state("awaiting_payment")
        .advance_timers(Timer::days(1))
        .assert_timer_fired("ORDER_EXPIRED")
        .assert_state("cancelled")
        .assert_no_timer("ORDER_EXPIRED");
}

#[test]
fn paying_cancels_the_expiry_timer() {
    machine(true)
        .send_with("ADD_ITEM", json!({"sku": "A-1"}))
        .send("CHECKOUT")
        .advance_timers(Timer::days(3))
        .send("PAY")
        .advance_timers(Timer::weeks(2))
        .assert_state("completed");
}

#[test]
fn payment_retries_every_six_hours_then_gives_up() {
    let mut m = machine(false);
    m.send_with("ADD_ITEM", json!({"sku": "A-1"}))
        .send("CHECKOUT")
        .send("PAY")
        .advance_timers(Timer::hours(17))
        .assert_state("processing.payment.charging");
    let retries = m.history().iter().filter(|r| *r == "event RETRY_PAYMENT").count();
    assert_eq!(retries, 2);
    m.advance_timers(Timer::hours(1))
        .assert_timer_fired("PAYMENT_FAILED")
        .assert_state("failed")
        .assert_history(&[
            "event RETRY_PAYMENT",
            "action charge_card",
            "event PAYMENT_FAILED",
            "enter failed",
        ]);
    assert_eq!(m.history().iter().filter(|r| *r == "event RETRY_PAYMENT").count(), 3);
}
