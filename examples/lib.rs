//! Keel's runnable examples live next to this file (`cargo run --example steps`,
//! `cargo run --example order`). The library holds what the examples and their tests
//! share: the order chart's definition and the choice of store.

pub mod demo_store;
#[path = "order_chart.rs"]
pub mod order;
