//! Keel's runnable examples live next to this file; run one with
//! `cargo run --example steps`. This library is empty on purpose.
