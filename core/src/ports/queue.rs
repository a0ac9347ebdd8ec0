//! The queue port (DESIGN §7): ready-work **hints** between the store and workers.
//!
//! A hint says "instance 42 is ready"; it is never the truth. A worker that receives one
//! claims the instance in the store by id (fenced) and acks the hint whatever happened.
//! Losing every hint delays work, never loses it: a repair pass re-publishes ready
//! instances from the store.

use crate::error::StoreResult;
use crate::ids::{InstanceId, Priority};
use async_trait::async_trait;
use std::time::Duration;

/// What a queue backend can and cannot do, reported honestly (STYLE 6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueCapabilities {
    /// The longest delay `enqueue` accepts; longer ones wait in the store until a sweep
    /// publishes them (SQS: 15 minutes).
    pub delay_max: Option<Duration>,
    /// Whether hints of one ordering group are delivered one at a time, in order.
    pub ordered_groups: bool,
    /// Whether `priority` influences delivery order.
    pub priorities: bool,
    /// The longest visibility lease `receive` and `extend` accept.
    pub visibility_max: Option<Duration>,
}

/// A hint to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hint {
    /// The ready instance.
    pub instance: InstanceId,
    /// Deliver no earlier than after this delay.
    pub delay: Duration,
    /// Delivery priority, where supported.
    pub priority: Priority,
    /// Ordering group (instance or concurrency key), where supported.
    pub group: Option<String>,
}

/// A received hint, leased until acked, nacked or its visibility runs out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The hint.
    pub hint: Hint,
    /// Opaque receipt used to ack, nack or extend.
    pub receipt: String,
    /// How many times this hint has been received.
    pub receive_count: u32,
}

/// A carrier of ready-work hints.
#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// What this backend supports.
    fn capabilities(&self) -> QueueCapabilities;
    /// Publishes hints.
    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()>;
    /// Receives up to `max` hints, each invisible to others for `visibility`; waits up to
    /// `wait` for the first one.
    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>>;
    /// Acknowledges hints: they are gone.
    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()>;
    /// Returns a hint to the queue, visible again after `delay`.
    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()>;
    /// Extends a hint's visibility lease.
    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()>;
}
