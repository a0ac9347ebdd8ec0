//! Project tasks: `cargo xtask test | ci | tidy`.

fn main() {}
