//! Keel's testing kit: the in-memory reference `Store`, a virtual clock, and the backend
//! conformance suites that every real backend runs under the same test names.
//!
//! A backend crate runs the store suite with one line in an integration test:
//!
//! ```text
//! keel_testkit::store_conformance_tests!(async { my_backend::connect_for_test().await });
//! ```
//!
//! The constructor expression is evaluated once per generated test, so each test may get
//! a fresh schema. It returns `Option<S>`; `None` means "backend not configured".

pub mod chart;
pub mod clock;
pub mod conformance;
pub mod memory;
pub mod prop;
pub mod queue;
pub mod sim;

pub use chart::TestMachine;
pub use clock::VirtualClock;
pub use conformance::STORE_CONTRACTS;
pub use conformance::queue::QUEUE_CONTRACTS;
pub use memory::MemoryStore;
pub use queue::MemoryQueue;
