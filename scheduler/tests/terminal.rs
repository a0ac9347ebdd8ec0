//! What a finished chart instance looks like to its users: its position is the final
//! configuration it reached, and its inbox is closed (signals it never consumed are
//! recorded and removed when it finishes; later signals are reported, not stored).
//!
//! Every test runs on `MemoryStore` (`memory::*`) and on PostgreSQL (`postgres::*`, a
//! fresh schema per test, needs `KEEL_TEST_DATABASE_URL`; skipped loudly without it, and
//! failing under `KEEL_REQUIRE_BACKENDS=1`), each driven by a durable worker.

#[macro_use]
mod common;

use common::TestStore;
use keel_core::chart::Definition;
use keel_core::ports::store::DeliveryOutcome;
use keel_core::{Instance, NewSignal, Status};
use keel_scheduler::ChartMachine;
use keel_testkit::chart::TestMachine;
use serde_json::json;

on_every_store!(
    a_finished_chart_shows_which_final_state_it_reached,
    a_finished_chart_closes_its_inbox,
);

/// A review with two ways to finish.
fn review() -> Definition {
    Definition::builder("review", 1)
        .initial("pending")
        .state("pending", |s| s.on_to("APPROVE", "approved").on_to("REJECT", "rejected"))
        .final_state("approved")
        .final_state("rejected")
        .build()
        .expect("valid chart")
}

fn finished(r: &Instance) -> bool {
    r.status == Status::Done
}

async fn a_finished_chart_shows_which_final_state_it_reached<S: TestStore>() {
    let h = S::harness().await;
    let m = ChartMachine::new(review());
    let approved = h.start(m.new_instance(json!({}))).await;
    let rejected = h.start(m.new_instance(json!({}))).await;
    let worker = h.worker(h.config(), m);
    h.client.send(NewSignal::new(approved, "APPROVE")).await.expect("send");
    h.client.send(NewSignal::new(rejected, "REJECT")).await.expect("send");
    let a = h.wait(approved, "approved", finished).await;
    let r = h.wait(rejected, "rejected", finished).await;
    worker.shutdown().await;
    assert_eq!(a.position, r#"["approved"]"#, "a done chart's position is its final configuration");
    assert_eq!(r.position, r#"["rejected"]"#, "a done chart's position is its final configuration");
    // The in-memory harness encodes the same final configuration the same way.
    assert_eq!(a.position, TestMachine::new(review()).send("APPROVE").position());
    assert_eq!(r.position, TestMachine::new(review()).send("REJECT").position());
}

async fn a_finished_chart_closes_its_inbox<S: TestStore>() {
    let h = S::harness().await;
    let m = ChartMachine::new(review());
    let id = h.start(m.new_instance(json!({}))).await;
    // Delivered together: the chart finishes on APPROVE and never consumes the two
    // events behind it.
    let batch = ["APPROVE", "NOTE", "REJECT"].iter().map(|e| NewSignal::new(id, *e)).collect();
    h.client.send_many(batch).await.expect("send");
    let worker = h.worker(h.config(), m);
    h.wait(id, "approved", finished).await;
    worker.shutdown().await;
    let detail = h.client.get(id).await.expect("get");
    assert!(detail.inbox.is_empty(), "a finished instance keeps no signals: {:?}", detail.inbox);
    let drained: Vec<_> =
        detail.history.iter().filter(|r| r.entry.kind == "INBOX_DRAINED").collect();
    assert_eq!(drained.len(), 1, "one history entry records what was left unread");
    assert_eq!(drained[0].entry.data["count"], json!(2));
    assert_eq!(detail.history.last().map(|r| r.entry.kind.as_str()), Some("INBOX_DRAINED"));
    let names: Vec<_> = drained[0].entry.data["signals"]
        .as_array()
        .expect("signals listed")
        .iter()
        .map(|s| s["name"].clone())
        .collect();
    assert_eq!(names, [json!("NOTE"), json!("REJECT")]);
    let late = h.client.send(NewSignal::new(id, "APPROVE")).await.expect("send");
    assert_eq!(late, DeliveryOutcome::TargetTerminal { target: id, status: Status::Done });
    assert!(h.client.get(id).await.expect("get").inbox.is_empty(), "a late signal was stored");
}
