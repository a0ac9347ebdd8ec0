//! Store micro-benchmark.
fn main() {}
