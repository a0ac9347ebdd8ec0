//! Keel's pure engine semantics.
//!
//! `keel-core` knows nothing about PostgreSQL, Redis, tokio or the system clock. Every
//! function here is a plain function of its inputs; `now` is always an argument. The port
//! traits (the `ports` module) describe what a backend must do; the backends implement them.
pub mod chart;
