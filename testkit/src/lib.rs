//! Keel's testing kit: the in-memory reference `Store`, a virtual clock, and the backend
//! conformance suites that every real backend runs under the same test names.

pub mod chart;
pub mod prop;

pub use chart::TestMachine;
