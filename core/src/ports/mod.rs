//! The port traits: what a backend must do. `Store` is the source of truth; `Queue`
//! carries hints only; `Clock` is the one way to learn the time.

pub mod clock;
pub mod queue;
pub mod store;

pub use clock::Clock;
pub use queue::Queue;
pub use store::Store;
