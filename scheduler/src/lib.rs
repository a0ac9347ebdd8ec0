//! Keel's worker runtime and client API.
//!
//! - [`Client`] starts instances, sends signals, cancels, inspects and operates dead
//!   letters and queues — against any [`Store`](keel_core::ports::Store).
//! - [`StepMachine`] is a gen_durable-style machine: named async steps that each return an
//!   [`Outcome`](keel_core::Outcome).
//! - [`Worker`] claims ready instances in batches, runs their steps concurrently within
//!   per-queue limits, and group-commits the results; it heartbeats leases, reaps expired
//!   ones, times out slow steps, applies the retry policy and shuts down gracefully.
//!
//! The scheduler is generic over `Store` and `Clock` and never names a concrete backend.

pub mod chart;
pub mod client;
pub mod clock;
pub mod health;
pub mod machine;
pub mod migrate;
pub mod prune;
pub mod schedules;
pub mod worker;

pub use chart::{ActionContext, ChartMachine};
pub use client::Client;
pub use client::{Broadcast, Cancel, DeadLetterRetry, Ended, StateValue};
pub use clock::SystemClock;
pub use health::{LoopHealth, WorkerHealth, WorkerLoop};
pub use keel_timers::{SweepConfig, SweepGroup, Sweeper};
pub use machine::{NonRetryable, StepContext, StepError, StepMachine};
pub use migrate::{Migrate, MigrationReport, Stopped};
pub use prune::{PruneCounts, Pruner};
pub use schedules::{ScheduleCounts, Schedules, UnknownSchedule};
pub use worker::{HintConfig, HintStats, Worker, WorkerConfig, WorkerHandle, worker_id_for};
