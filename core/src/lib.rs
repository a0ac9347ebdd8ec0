//! Keel's pure engine semantics.
//!
//! `keel-core` knows nothing about PostgreSQL, Redis, tokio or the system clock. Every
//! function here is a plain function of its inputs; `now` is always an argument. The port
//! traits (the `ports` module) describe what a backend must do; the backends implement them.

pub mod chart;
pub mod config;
pub mod context;
pub mod duration;
pub mod error;
pub mod history;
pub mod ids;
pub mod inbox;
pub mod instance;
pub mod join;
pub mod limits;
mod names;
pub mod outcome;
pub mod plan;
pub mod ports;
pub mod redact;
pub mod retention;
pub mod retry;
pub mod schedule;
pub mod time;
pub mod timers;

pub use error::{ErrorKind, StoreError, StoreResult};
pub use history::HistoryKind;
pub use ids::{
    DeadLetterId, FencingToken, InstanceId, MachineRef, Priority, Revision, SignalId, Status,
    StatusSet, TimerId, WorkerId,
};
pub use instance::{Instance, NewInstance, NewSignal, Signal, SignalTarget};
pub use outcome::{Outcome, StepCommit, StepFailure};
pub use redact::redact_url;
pub use time::Timestamp;
