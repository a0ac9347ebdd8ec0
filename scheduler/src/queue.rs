//! A worker's queue link: ready-work hints through a `Queue` next to the store.
//!
//! With a queue ([`Worker::with_queue`]), a worker publishes a hint for every instance a
//! group commit left ready (the instance itself after `Next` or `Retry`, the children and
//! spawned instances it inserted), from the committed receipts, and a hint loop receives
//! hints and claims *those* instances by id (`Store::instance_claim_ids`) under the usual
//! lease and fencing. A hint whose instance is no longer ready — already claimed, stale, a
//! duplicate — is simply acked: nothing is committed twice, because only the claim's
//! fencing token can commit.
//!
//! The store stays the truth. The worker's ordinary claim loop keeps running next to the
//! hint loop and is the repair path: every `poll_interval` it claims whatever is ready
//! and was never hinted (a crash between commit and publish, a flushed or purged queue,
//! a signal delivered by a client, a delay longer than the queue keeps), and it carries
//! the whole load while the queue is down. A hint loop whose queue fails backs off and
//! tries again; nothing waits on it.

use super::{Finished, InFlight, Inner, QueueSlots, Worker, parents_of, release, run_step};
use crate::health::WorkerLoop;
use keel_core::ids::Status;
use keel_core::limits::HINT_RECEIVE_MAX;
use keel_core::outcome::Outcome;
use keel_core::ports::queue::{Delivery, Hint};
use keel_core::ports::store::{Claim, ClaimParams, CommitReceipt, InsertOutcome};
use keel_core::ports::{Clock, Queue, Store};
use keel_core::{InstanceId, StoreResult};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How a worker uses its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintConfig {
    /// How long a received hint stays invisible to other workers while this one claims
    /// its instance (the claim's own lease then protects the work). Default 30 s.
    pub visibility: Duration,
    /// How long one receive waits for a hint (at most `HINT_WAIT_MAX`). Default 1 s.
    pub wait: Duration,
}

impl Default for HintConfig {
    fn default() -> Self {
        HintConfig { visibility: Duration::from_secs(30), wait: Duration::from_secs(1) }
    }
}

/// Counters of a worker's queue link.
#[derive(Debug, Default)]
pub struct HintStats {
    /// Hints published after commits.
    pub published: AtomicU64,
    /// Hints that could not be published (the claim loop takes that work instead).
    pub publish_failed: AtomicU64,
    /// Hints received.
    pub received: AtomicU64,
    /// Instances claimed because of a hint.
    pub claimed: AtomicU64,
}

/// A worker's queue and its settings.
pub(crate) struct HintLink {
    queue: Arc<dyn Queue>,
    config: HintConfig,
    stats: Arc<HintStats>,
    /// Whether the last receive succeeded.
    flowing: AtomicBool,
}

/// Whether the worker's hints are flowing: then slots freed by commits are left to the
/// hint loop, and the claim loop only polls (the repair path). Without a queue, or while
/// the queue fails, the claim loop refills freed slots itself as usual.
pub(super) fn hints_flowing<S, C>(inner: &Inner<S, C>) -> bool {
    inner.hints.as_ref().is_some_and(|link| link.flowing.load(Ordering::Relaxed))
}

impl<S: Store, C: Clock + Clone> Worker<S, C> {
    /// Gives the worker a queue of ready-work hints (see the module doc); returns the
    /// queue link's counters with the worker. Run the store's notifications or a short
    /// `poll_interval` next to it as you like: polling stays the repair path.
    ///
    /// # Panics
    ///
    /// When `config.visibility` is zero or `config.wait` is over `HINT_WAIT_MAX`.
    #[must_use]
    pub fn with_queue(
        mut self,
        queue: Arc<dyn Queue>,
        config: HintConfig,
    ) -> (Self, Arc<HintStats>) {
        assert!(!config.visibility.is_zero(), "HintConfig::visibility must be positive");
        assert!(
            config.wait <= keel_core::limits::HINT_WAIT_MAX,
            "HintConfig::wait is over HINT_WAIT_MAX ({:?})",
            keel_core::limits::HINT_WAIT_MAX
        );
        let stats = Arc::new(HintStats::default());
        self.hints = Some(Arc::new(HintLink {
            queue,
            config,
            stats: Arc::clone(&stats),
            flowing: AtomicBool::new(false),
        }));
        (self, stats)
    }
}

/// The hints for what a group commit left ready, read from its receipts.
fn ready_hints(batch: &[Finished], results: &[Option<StoreResult<CommitReceipt>>]) -> Vec<Hint> {
    let mut hints = Vec::new();
    for (f, result) in batch.iter().zip(results) {
        let Some(Ok(receipt)) = result else { continue };
        let row = &f.origin.claim.instance;
        if receipt.status == Status::Runnable {
            let delay = match &f.commit.outcome {
                Outcome::Retry { delay, .. } => *delay,
                _ => Duration::ZERO,
            };
            let mut hint = Hint::new(receipt.id, receipt.revision.0 as u64)
                .delay(delay)
                .priority(row.priority);
            hint.group.clone_from(&row.concurrency_key);
            hints.push(hint);
        }
        for child in receipt.children.iter().chain(&receipt.spawned) {
            if let InsertOutcome::Inserted(id) = child {
                hints.push(Hint::new(*id, 0));
            }
        }
    }
    hints
}

/// Publishes the hints for a group commit in the background: the commit path never
/// waits on the queue, and a hint that is lost only leaves its work to the claim loop.
pub(super) fn publish_committed<S, C>(
    inner: &Inner<S, C>,
    batch: &[Finished],
    results: &[Option<StoreResult<CommitReceipt>>],
) {
    let Some(link) = inner.hints.clone() else { return };
    let delay_max = link.queue.capabilities().delay_max;
    let hints: Vec<Hint> = ready_hints(batch, results)
        .into_iter()
        .filter(|h| delay_max.is_none_or(|most| h.delay <= most))
        .collect();
    if hints.is_empty() {
        return;
    }
    tokio::spawn(async move {
        for chunk in hints.chunks(keel_core::limits::HINT_BATCH_MAX) {
            let n = chunk.len() as u64;
            match link.queue.enqueue(chunk.to_vec()).await {
                Ok(()) => link.stats.published.fetch_add(n, Ordering::Relaxed),
                Err(e) => {
                    tracing::debug!(error = %e, "publishing hints failed; polling takes the work");
                    link.stats.publish_failed.fetch_add(n, Ordering::Relaxed)
                }
            };
        }
    });
}

/// Starts the hint loop when the worker has a queue.
pub(super) fn spawn_hint_loop<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    shutdown: &watch::Receiver<bool>,
    queues: &Arc<Vec<QueueSlots>>,
    tx: &mpsc::Sender<Finished>,
) -> Option<tokio::task::JoinHandle<()>> {
    inner.hints.as_ref()?;
    let (queues, tx) = (Arc::clone(queues), tx.clone());
    Some(super::spawn_loop(inner, WorkerLoop::Hints, shutdown, move |inner, stop| {
        hint_loop(inner, Arc::clone(&queues), tx.clone(), stop)
    }))
}

/// Receives hints while slots are free, claims their instances by id and starts them.
async fn hint_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    queues: Arc<Vec<QueueSlots>>,
    tx: mpsc::Sender<Finished>,
    mut shutdown: watch::Receiver<bool>,
) {
    let Some(link) = inner.hints.clone() else { return };
    // Filling free slots from the store: every round while it finds a backlog, else at
    // most once per `wait`.
    let mut backlog = true;
    let mut last_fill = tokio::time::Instant::now();
    while !*shutdown.borrow() {
        let free: usize = queues.iter().map(QueueSlots::free).sum();
        if free == 0 {
            tokio::select! {
                () = inner.slot_freed.notified() => {}
                () = tokio::time::sleep(inner.config.poll_interval) => {}
                _ = shutdown.changed() => {}
            }
            continue;
        }
        let max = free.min(HINT_RECEIVE_MAX);
        let received = tokio::select! {
            r = link.queue.receive(max, link.config.visibility, link.config.wait) => r,
            _ = shutdown.changed() => return,
        };
        let deliveries = match received {
            Ok(d) => d,
            Err(e) => {
                // The claim loop carries the load meanwhile; try the queue again later.
                link.flowing.store(false, Ordering::Relaxed);
                inner.slot_freed.notify_one();
                let pause = inner
                    .loop_failed(WorkerLoop::Hints, &format!("receive hints: {e}"))
                    .max(inner.config.poll_interval);
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
        };
        inner.loop_ok(WorkerLoop::Hints);
        link.flowing.store(true, Ordering::Relaxed);
        if !deliveries.is_empty() {
            link.stats.received.fetch_add(deliveries.len() as u64, Ordering::Relaxed);
            claim_hinted(&inner, &link, &queues, &tx, deliveries).await;
        }
        // Slots the hints left free take ready work that was never hinted (inserted by a
        // client, signalled, or whose hint was lost).
        if backlog || last_fill.elapsed() >= link.config.wait {
            last_fill = tokio::time::Instant::now();
            backlog = fill(&inner, &queues, &tx).await;
        }
    }
}

/// An ordinary claim for the free slots; whether it filled them all (a backlog).
async fn fill<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    queues: &Arc<Vec<QueueSlots>>,
    tx: &mpsc::Sender<Finished>,
) -> bool {
    let Some(params) = claim_params(inner, queues, usize::MAX) else { return false };
    let limit = params.limit;
    match inner.store.instance_claim(params).await {
        Ok(claims) => {
            let full = claims.len() == limit;
            start(inner, queues, tx, claims).await;
            full
        }
        Err(e) => {
            tracing::debug!(error = %e, "claim for free slots failed; the claim loop retries");
            false
        }
    }
}

/// Claim parameters for at most `most` instances from the worker's queues that have free
/// slots; `None` when no slot is free.
fn claim_params<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    queues: &[QueueSlots],
    most: usize,
) -> Option<ClaimParams> {
    // A queue with a global limit is left to the claim loop, whose claim counts the limit
    // one queue at a time; a hint names rows, so order does not matter here.
    let open: Vec<String> = queues
        .iter()
        .filter(|s| s.free() > 0 && !inner.config.claim_policy(&s.name).is_queue_wide())
        .map(|s| s.name.clone())
        .collect();
    if open.is_empty() {
        return None;
    }
    let free: usize = queues.iter().map(QueueSlots::free).sum();
    let limit =
        free.min(most).min(inner.config.claim_batch).min(keel_core::limits::CLAIM_BATCH_MAX);
    (limit > 0).then(|| ClaimParams {
        worker: inner.config.worker_id.clone(),
        namespaces: inner.config.namespaces.clone(),
        queues: open,
        machines: inner.machines.keys().cloned().collect(),
        limit,
        lease: inner.config.lease,
        now: inner.clock.now(),
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    })
}

/// Claims the instances of `deliveries` by id, starts what was claimed and acks every
/// hint: one that claimed nothing was stale or a duplicate. When the store is
/// unavailable the hints are not acked and come back after their visibility.
async fn claim_hinted<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    link: &HintLink,
    queues: &Arc<Vec<QueueSlots>>,
    tx: &mpsc::Sender<Finished>,
    deliveries: Vec<Delivery>,
) {
    let ids: BTreeSet<InstanceId> = deliveries.iter().map(|d| d.hint.instance).collect();
    let Some(params) = claim_params(inner, queues, ids.len()) else {
        // No slot left after all: hand the hints back for another worker (or a later
        // round of this one).
        for d in deliveries {
            let _ = link.queue.nack(d.receipt, Duration::ZERO).await;
        }
        return;
    };
    match inner.store.instance_claim_ids(ids.into_iter().collect(), params).await {
        Ok(claims) => {
            link.stats.claimed.fetch_add(claims.len() as u64, Ordering::Relaxed);
            start(inner, queues, tx, claims).await;
        }
        Err(e) if e.is_retryable() => {
            tracing::debug!(error = %e, "claim by hint failed; the hints come back later");
            return;
        }
        Err(e) => tracing::warn!(error = %e, "claim by hint refused; dropping the hints"),
    }
    let receipts = deliveries.into_iter().map(|d| d.receipt).collect();
    if let Err(e) = link.queue.ack(receipts).await {
        tracing::debug!(error = %e, "acking hints failed; they come back and are acked then");
    }
}

/// Starts claimed steps, each holding a slot of its queue; a claim with no free slot is
/// released at once.
async fn start<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    queues: &Arc<Vec<QueueSlots>>,
    tx: &mpsc::Sender<Finished>,
    claims: Vec<Claim>,
) {
    let parents = parents_of(inner, &claims).await;
    for claim in claims {
        let slots = queues.iter().find(|s| s.name == claim.instance.queue);
        let Some(permit) = slots.and_then(|s| s.take(inner)) else {
            release(inner, vec![(claim.instance.id, claim.token())]).await;
            continue;
        };
        let id = claim.instance.id;
        let token = claim.token();
        let parent = claim.instance.parent.and_then(|p| parents.get(&p).cloned());
        // Register before spawning, so the heartbeat sees the lease at once.
        let mut in_flight = inner.in_flight.lock().expect("in_flight lock");
        let task = tokio::spawn(run_step(Arc::clone(inner), claim, parent, permit, tx.clone()));
        in_flight.insert(id, InFlight { token, task, committing: false });
    }
}
