//! `MemoryQueue`: the in-memory reference `Queue`, with every capability a queue can
//! have (priorities, ordered groups, any delay), so the conformance suite's optional
//! contracts have a reference too.
//!
//! Time is tokio's clock, so a test on a paused runtime moves leases and delays with
//! `tokio::time::advance` instead of sleeping.

use async_trait::async_trait;
use keel_core::ports::Queue;
use keel_core::ports::queue::{
    Delivery, Hint, QueueCapabilities, validate_enqueue, validate_nack_delay, validate_receipts,
    validate_receive, validate_visibility,
};
use keel_core::{StoreError, StoreResult};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// One stored hint.
#[derive(Debug)]
struct Entry {
    hint: Hint,
    /// When it may be handed out: after its delay, or when its lease runs out.
    visible_at: Instant,
    receive_count: u32,
    /// Whether it was handed out and its lease has not been given back by a nack.
    leased: bool,
}

#[derive(Debug, Default)]
struct State {
    /// Hints by publish sequence number (publish order).
    entries: BTreeMap<u64, Entry>,
    next_seq: u64,
}

/// An in-memory `Queue` with priorities and ordered groups.
#[derive(Debug, Default)]
pub struct MemoryQueue {
    state: Mutex<State>,
    published: Notify,
}

impl MemoryQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many hints it holds, leased ones included.
    pub fn len(&self) -> usize {
        self.state.lock().expect("queue lock").entries.len()
    }

    /// Whether it holds no hint.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every hint, as if the queue's server lost its data.
    pub fn purge(&self) {
        self.state.lock().expect("queue lock").entries.clear();
    }

    /// Leases up to `max` visible hints; the earliest time another one becomes visible.
    fn take(&self, max: usize, visibility: Duration) -> (Vec<Delivery>, Option<Instant>) {
        let now = Instant::now();
        let mut state = self.state.lock().expect("queue lock");
        // The head (lowest sequence number) of each group blocks the rest of its group.
        let mut heads = std::collections::HashSet::new();
        let mut candidates: Vec<(u8, u64)> = Vec::new();
        let mut next_visible: Option<Instant> = None;
        for (&seq, entry) in &state.entries {
            if let Some(group) = &entry.hint.group
                && !heads.insert(group.clone())
            {
                continue;
            }
            if entry.visible_at <= now {
                candidates.push((entry.hint.priority.level() as u8, seq));
            } else {
                next_visible =
                    Some(next_visible.map_or(entry.visible_at, |t| t.min(entry.visible_at)));
            }
        }
        candidates.sort_unstable();
        let mut out = Vec::new();
        for (_, seq) in candidates.into_iter().take(max) {
            let entry = state.entries.get_mut(&seq).expect("candidate exists");
            entry.receive_count += 1;
            entry.leased = true;
            entry.visible_at = now + visibility;
            let mut hint = entry.hint.clone();
            hint.delay = Duration::ZERO;
            out.push(Delivery {
                hint,
                receipt: format!("{seq}:{}", entry.receive_count),
                receive_count: entry.receive_count,
            });
        }
        (out, next_visible)
    }

    /// Applies `f` to the entry a current receipt names; a stale or unknown receipt is
    /// `NotFound`.
    fn with_leased(&self, receipt: &str, f: impl FnOnce(&mut Entry)) -> StoreResult<()> {
        let (seq, count) = parse_receipt(receipt)?;
        let mut state = self.state.lock().expect("queue lock");
        match state.entries.get_mut(&seq) {
            Some(entry) if entry.receive_count == count && entry.leased => {
                f(entry);
                Ok(())
            }
            _ => Err(StoreError::not_found(format!(
                "receipt {receipt}: the hint was acked or received again since"
            ))),
        }
    }
}

fn parse_receipt(receipt: &str) -> StoreResult<(u64, u32)> {
    receipt
        .split_once(':')
        .and_then(|(seq, count)| Some((seq.parse().ok()?, count.parse().ok()?)))
        .ok_or_else(|| {
            StoreError::invalid(format!("receipt {receipt:?}: not a receipt this queue handed out"))
        })
}

#[async_trait]
impl Queue for MemoryQueue {
    fn capabilities(&self) -> QueueCapabilities {
        QueueCapabilities {
            delay_max: None,
            ordered_groups: true,
            priorities: true,
            visibility_max: None,
            resolution: Duration::from_millis(1),
            hints_per_round_trip: keel_core::limits::HINT_BATCH_MAX,
        }
    }

    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
        validate_enqueue(&hints, &self.capabilities())?;
        let now = Instant::now();
        {
            let mut state = self.state.lock().expect("queue lock");
            for hint in hints {
                let seq = state.next_seq;
                state.next_seq += 1;
                let visible_at = now + hint.delay;
                state
                    .entries
                    .insert(seq, Entry { hint, visible_at, receive_count: 0, leased: false });
            }
        }
        self.published.notify_waiters();
        Ok(())
    }

    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>> {
        validate_receive(max, visibility, wait, &self.capabilities())?;
        let deadline = Instant::now() + wait;
        // Each round either returns or sleeps until the deadline, the next visible hint or
        // a publish; the deadline bounds the rounds.
        loop {
            let published = self.published.notified();
            let (out, next_visible) = self.take(max, visibility);
            if !out.is_empty() || Instant::now() >= deadline {
                return Ok(out);
            }
            let until = next_visible.map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                () = published => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()> {
        validate_receipts(&receipts)?;
        let parsed = receipts.iter().map(|r| parse_receipt(r)).collect::<StoreResult<Vec<_>>>()?;
        {
            let mut state = self.state.lock().expect("queue lock");
            for (seq, count) in parsed {
                if state.entries.get(&seq).is_some_and(|e| e.receive_count == count) {
                    state.entries.remove(&seq);
                }
            }
        }
        // An acked group head unblocks the next hint of its group: wake waiting receivers.
        self.published.notify_waiters();
        Ok(())
    }

    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()> {
        validate_receipts(std::slice::from_ref(&receipt))?;
        validate_nack_delay(delay, &self.capabilities())?;
        self.with_leased(&receipt, |entry| {
            entry.leased = false;
            entry.visible_at = Instant::now() + delay;
        })?;
        self.published.notify_waiters();
        Ok(())
    }

    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()> {
        validate_receipts(std::slice::from_ref(&receipt))?;
        validate_visibility(visibility, &self.capabilities())?;
        self.with_leased(&receipt, |entry| entry.visible_at = Instant::now() + visibility)
    }
}
