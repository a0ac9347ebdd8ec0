//! The queue port: ready-work **hints** between the store and workers.
//!
//! A hint says "instance 42 is ready"; it is never the truth. A worker that receives one
//! claims the instance in the store by id (fenced) and acks the hint whatever happened.
//! Losing every hint delays work, never loses it: a repair pass re-publishes ready
//! instances from the store.
//!
//! Delivery is at least once on every backend: a hint may arrive twice (after its lease
//! ran out, or because it was published twice), so a receiver must treat each one as "go
//! and look", never as "this is yours". What differs between backends is reported by
//! [`QueueCapabilities`] and checked by the queue conformance suite; nothing is emulated
//! behind a caller's back. The checks every backend applies to its arguments live here
//! ([`validate_enqueue`], [`validate_receive`], …) so the errors read the same everywhere.

use crate::error::{StoreError, StoreResult};
use crate::ids::{InstanceId, Priority};
use crate::limits::{
    HINT_BATCH_MAX, HINT_RECEIPT_BYTES_MAX, HINT_RECEIVE_MAX, HINT_WAIT_MAX, NAME_BYTES_MAX,
};
use async_trait::async_trait;
use std::time::Duration;

/// What a queue backend can and cannot do, reported honestly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueCapabilities {
    /// The longest delay `enqueue` accepts; longer ones must wait in the store until a
    /// sweep publishes them (SQS: 15 minutes; SQS FIFO: none at all). `None`: no limit.
    pub delay_max: Option<Duration>,
    /// Whether hints of one ordering group are delivered in publish order: while one is
    /// leased, no later hint of its group is handed out (one receive may carry several
    /// of a group, in order).
    pub ordered_groups: bool,
    /// Whether `priority` influences delivery order among hints visible at once.
    pub priorities: bool,
    /// The longest visibility lease `receive` and `extend` accept, and the longest delay
    /// of a `nack` (which only moves a lease's end). `None`: no limit.
    pub visibility_max: Option<Duration>,
    /// The unit delays and leases are kept in; shorter non-zero values are rounded up to
    /// it (SQS counts whole seconds).
    pub resolution: Duration,
    /// The most hints the backend takes in one round trip (SQS: 10, one send batch; Redis:
    /// one script call takes a whole [`HINT_BATCH_MAX`] batch). `enqueue` accepts up to
    /// `HINT_BATCH_MAX` whatever this says and makes as many round trips as it needs;
    /// a caller that bounds each call's time splits a publish into calls of this many (at
    /// most `HINT_BATCH_MAX`, at least 1, whatever this says), so its bound covers one
    /// round trip.
    pub hints_per_round_trip: usize,
}

/// A hint to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hint {
    /// The ready instance.
    pub instance: InstanceId,
    /// Which state of the instance the hint is about (its fencing token when it was
    /// published). Two hints with the same instance and revision say the same thing, and a
    /// backend with deduplication may keep one.
    pub revision: u64,
    /// Deliver no earlier than after this delay.
    pub delay: Duration,
    /// Delivery priority, where supported.
    pub priority: Priority,
    /// Ordering group (instance or concurrency key), where supported.
    pub group: Option<String>,
}

impl Hint {
    /// A hint for `instance` at `revision`: no delay, normal priority, no group.
    pub fn new(instance: InstanceId, revision: u64) -> Self {
        Hint { instance, revision, delay: Duration::ZERO, priority: Priority::Normal, group: None }
    }
    /// The same hint delivered no earlier than `delay` from now.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
    /// The same hint with `priority`.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }
    /// The same hint in ordering group `group`.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }
}

/// A received hint, leased until acked, nacked or its visibility runs out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The hint (its `delay` is zero: it was due when received).
    pub hint: Hint,
    /// Opaque receipt used to ack, nack or extend.
    pub receipt: String,
    /// How many times this hint has been received, this time included (1 the first time).
    pub receive_count: u32,
}

/// A carrier of ready-work hints.
#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// What this backend supports.
    fn capabilities(&self) -> QueueCapabilities;
    /// Publishes up to [`HINT_BATCH_MAX`] hints (backends split them into their own
    /// batches). A delay over `delay_max` is refused as `Invalid`.
    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()>;
    /// Receives up to `max` (1 to [`HINT_RECEIVE_MAX`]) hints, each invisible to others
    /// for `visibility`; waits up to `wait` (at most [`HINT_WAIT_MAX`]) for the first one.
    /// It may return fewer than `max` even when more are visible.
    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>>;
    /// Acknowledges up to [`HINT_BATCH_MAX`] hints: they are gone. Acking a receipt
    /// twice is not an error.
    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()>;
    /// Returns a leased hint to the queue, visible again after `delay` (at most
    /// `visibility_max`).
    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()>;
    /// Extends a hint's visibility lease to `visibility` from now.
    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()>;
}

/// Checks an `enqueue` batch: its size, each delay against `delay_max`, and each group's
/// length.
pub fn validate_enqueue(hints: &[Hint], caps: &QueueCapabilities) -> StoreResult<()> {
    if hints.len() > HINT_BATCH_MAX {
        return Err(StoreError::invalid(format!(
            "hints: {} in one enqueue, the most is {HINT_BATCH_MAX}; split the batch",
            hints.len()
        )));
    }
    for hint in hints {
        validate_delay("hint.delay", hint.delay, caps)?;
        if let Some(group) = &hint.group
            && (group.is_empty() || group.len() > NAME_BYTES_MAX)
        {
            return Err(StoreError::invalid(format!(
                "hint.group of {}: {} bytes, must be 1 to {NAME_BYTES_MAX}; use a shorter \
                 concurrency key or none",
                hint.instance,
                group.len()
            )));
        }
    }
    Ok(())
}

/// Checks a `receive` call's `max`, `visibility` and `wait`.
pub fn validate_receive(
    max: usize,
    visibility: Duration,
    wait: Duration,
    caps: &QueueCapabilities,
) -> StoreResult<()> {
    if max == 0 || max > HINT_RECEIVE_MAX {
        return Err(StoreError::invalid(format!(
            "max: {max} hints per receive, must be 1 to {HINT_RECEIVE_MAX}"
        )));
    }
    validate_visibility(visibility, caps)?;
    if wait > HINT_WAIT_MAX {
        return Err(StoreError::invalid(format!(
            "wait: {wait:?} is over the {HINT_WAIT_MAX:?} a receive may wait; receive again instead"
        )));
    }
    Ok(())
}

/// Checks a visibility lease for `receive` or `extend`: non-zero and within
/// `visibility_max`.
pub fn validate_visibility(visibility: Duration, caps: &QueueCapabilities) -> StoreResult<()> {
    if visibility.is_zero() {
        return Err(StoreError::invalid(
            "visibility: a lease of zero would hand the hint to the next receiver at once; give \
             the time a claim takes",
        ));
    }
    if let Some(most) = caps.visibility_max
        && visibility > most
    {
        return Err(StoreError::invalid(format!(
            "visibility: {visibility:?} is over this queue's {most:?}; extend the lease instead"
        )));
    }
    Ok(())
}

/// Checks a `nack`'s delay: a nack moves the end of a lease, so `visibility_max` bounds
/// it.
pub fn validate_nack_delay(delay: Duration, caps: &QueueCapabilities) -> StoreResult<()> {
    match caps.visibility_max {
        Some(most) if delay > most => Err(StoreError::invalid(format!(
            "delay: a nack delay of {delay:?} is over this queue's {most:?}; ack the hint and \
             let the store publish it again when it is due"
        ))),
        _ => Ok(()),
    }
}

/// Checks a delay (`field` names it in the error) against `delay_max`.
pub fn validate_delay(field: &str, delay: Duration, caps: &QueueCapabilities) -> StoreResult<()> {
    match caps.delay_max {
        Some(most) if delay > most => Err(StoreError::invalid(format!(
            "{field}: {delay:?} is over this queue's {most:?}; keep the work in the store and \
             publish its hint when it is due"
        ))),
        _ => Ok(()),
    }
}

/// Checks receipts handed back to `ack`, `nack` or `extend`: how many, and that each is
/// a plausible receipt.
pub fn validate_receipts(receipts: &[String]) -> StoreResult<()> {
    if receipts.len() > HINT_BATCH_MAX {
        return Err(StoreError::invalid(format!(
            "receipts: {} in one call, the most is {HINT_BATCH_MAX}; split the batch",
            receipts.len()
        )));
    }
    for receipt in receipts {
        if receipt.is_empty() || receipt.len() > HINT_RECEIPT_BYTES_MAX {
            return Err(StoreError::invalid(format!(
                "receipt: {} bytes, must be 1 to {HINT_RECEIPT_BYTES_MAX}; pass the receipt a \
                 receive returned",
                receipt.len()
            )));
        }
    }
    Ok(())
}

/// `duration` rounded up to a whole multiple of `resolution` (a zero resolution leaves it
/// as it is).
pub fn round_up(duration: Duration, resolution: Duration) -> Duration {
    let unit = resolution.as_nanos();
    if unit == 0 {
        return duration;
    }
    let n = duration.as_nanos().div_ceil(unit);
    Duration::from_nanos(u64::try_from(n * unit).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> QueueCapabilities {
        QueueCapabilities {
            delay_max: Some(Duration::from_secs(900)),
            ordered_groups: false,
            priorities: false,
            visibility_max: Some(Duration::from_secs(3600)),
            resolution: Duration::from_secs(1),
            hints_per_round_trip: 10,
        }
    }

    #[test]
    fn bounds_name_the_field() {
        let over = vec![Hint::new(InstanceId(1), 0); HINT_BATCH_MAX + 1];
        assert!(validate_enqueue(&over, &caps()).unwrap_err().message.starts_with("hints:"));
        let late = [Hint::new(InstanceId(1), 0).delay(Duration::from_secs(901))];
        assert!(validate_enqueue(&late, &caps()).unwrap_err().message.starts_with("hint.delay:"));
        let long = [Hint::new(InstanceId(1), 0).group("g".repeat(NAME_BYTES_MAX + 1))];
        assert!(validate_enqueue(&long, &caps()).unwrap_err().message.starts_with("hint.group"));
        let ok = vec![Hint::new(InstanceId(1), 0).delay(Duration::from_secs(900)); HINT_BATCH_MAX];
        assert!(validate_enqueue(&ok, &caps()).is_ok());
        let s = Duration::from_secs(1);
        assert!(validate_receive(0, s, s, &caps()).unwrap_err().message.starts_with("max:"));
        assert!(validate_receive(HINT_RECEIVE_MAX, s, HINT_WAIT_MAX, &caps()).is_ok());
        assert!(validate_receive(1, Duration::ZERO, s, &caps()).is_err());
        assert!(validate_receive(1, s, HINT_WAIT_MAX + s, &caps()).is_err());
        assert!(validate_receipts(&[String::new()]).is_err());
    }

    #[test]
    fn round_up_keeps_whole_units() {
        let s = Duration::from_secs(1);
        assert_eq!(round_up(Duration::from_millis(1), s), s);
        assert_eq!(round_up(Duration::ZERO, s), Duration::ZERO);
        assert_eq!(round_up(Duration::from_millis(2001), s), Duration::from_secs(3));
        assert_eq!(round_up(Duration::from_millis(7), Duration::ZERO), Duration::from_millis(7));
    }
}
