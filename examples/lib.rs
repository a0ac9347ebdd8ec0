//! Keel's runnable examples live next to this file; run one with
//! `cargo run --example tour`. This library is empty on purpose.
