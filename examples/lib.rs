//! Keel's runnable examples live next to this file: `cargo run --example order` (a chart),
//! `steps` (step functions), `ticket` (the README's chart in full) and `sim_transfer` (a
//! machine written as a step function, under simulated faults). The library holds what the
//! examples and their tests share: the order chart's definition and the choice of store.

pub mod demo_store;
#[path = "order_chart.rs"]
pub mod order;

use keel::{Definition, Timer};

/// Every chart the examples build, for tests that must cover all of them (the JSON round
/// trip, for one). Add a chart here when an example gains one.
pub fn charts() -> Vec<Definition> {
    vec![order::definition(), order::definition_with_expiry(Timer::seconds(5))]
}
