//! A worker's queue link: ready-work hints through a `Queue` next to the store.
//!
//! With a queue ([`Worker::with_queue`]), a worker publishes hints for the work each group
//! commit made ready (`keel_core::plan::hints::after_commit`: the instance itself after
//! `Next` or `Retry`, delayed by the retry's back-off; the children and spawned instances
//! it inserted; the targets of its emitted events; its parent when it ended), from the
//! committed receipts, and a hint loop receives hints and claims *those* instances by id
//! (`Store::instance_claim_ids`) under the usual lease and fencing. A hint whose instance
//! is not ready — already claimed, stale, a duplicate, a parent still waiting — is simply
//! acked: nothing is committed twice, because only the claim's fencing token can commit.
//!
//! The store stays the truth. A repair pass (every worker with a `repair_after` bound,
//! jittered) publishes hints again for the instances that have been ready for the bound
//! (`Store::instance_ready_stale`): work whose hint was lost (a crash between commit and
//! publish, a flushed or purged queue) or never sent (a producer without the queue, a
//! delay longer than the queue keeps, an event addressed by business key). The worker's
//! ordinary claim loop keeps polling every `poll_interval` next to the hint loop, and
//! carries the whole load while the queue is down: a hint loop whose queue fails backs
//! off and tries again; nothing waits on it.
//!
//! Slots freed by commits are left to the hint loop only while its hints bring work.
//! `HINT_MISSES_MAX` receives in a row that come back empty, or whose hints all name
//! instances that are no longer ready (the queue lags behind the store: a slow queue, a
//! backlog started by a producer without the queue, hints that polling got to first),
//! hand the freed slots back to the claim loop, so a worker with a queue is not held to
//! its poll interval while the store has work it was not told about; the next receive
//! that claims something hands them back to the hints. A failed receive hands them over
//! at once.
//!
//! A queue that stops answering holds nothing up: a receive gives up after its wait and
//! [`RECEIVE_MARGIN`] (counted as a failed receive), every other call after
//! [`QUEUE_CALL_TIMEOUT`], and a worker or client has at most [`PUBLISHES_MAX`] publishes
//! under way; the hints of any further one are dropped and counted, and polling and the
//! repair pass find their work.

use super::{Finished, Inner, QueueSlots, Worker, launch};
use crate::health::WorkerLoop;
use keel_core::limits::{HINT_RECEIVE_MAX, READY_STALE_BATCH_MAX, REPAIR_PAGES_MAX};
use keel_core::plan::hints;
use keel_core::ports::queue::{Delivery, Hint};
use keel_core::ports::store::{ClaimParams, CommitReceipt, ReadyStaleParams};
use keel_core::ports::{Clock, Queue, Store};
use keel_core::{InstanceId, StoreError, StoreResult, Timestamp};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::time::error::Elapsed;

/// How much longer than its wait a receive may take before the hint loop gives up on it
/// and counts it as failed.
pub const RECEIVE_MARGIN: Duration = Duration::from_secs(5);
/// How long a publish, ack or hand-back call to the queue may take before the worker or
/// client gives up on it (the hints then wait for polling, the repair pass or their
/// visibility, as after any failed call). A publish is made of calls of one round trip each
/// (the queue's `hints_per_round_trip`: 10 hints on SQS, a whole batch on Redis), and each
/// call has this bound of its own.
pub const QUEUE_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Most publishes one worker (or one client and its clones) has under way at once; the
/// hints of a commit, start or send beyond them are dropped and counted.
pub const PUBLISHES_MAX: usize = 32;

/// How a worker uses its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintConfig {
    /// How long a received hint stays invisible to other workers while this one claims
    /// its instance (the claim's own lease then protects the work). Default 30 s.
    pub visibility: Duration,
    /// How long one receive waits for a hint (more than zero, at most `HINT_WAIT_MAX`).
    /// Default 1 s.
    pub wait: Duration,
    /// The repair bound: an instance ready for this long is published again by this
    /// worker's repair pass, which runs once per half to whole bound (jittered, so the
    /// passes of several workers spread out). A lost hint's work is so announced again
    /// within about twice the bound. `None` turns this worker's pass off (keep it on in
    /// at least one worker per deployment). Default 10 s.
    pub repair_after: Option<Duration>,
}

impl HintConfig {
    /// Checks the bounds; the message names the field and the fix.
    pub fn validate(&self) -> Result<(), String> {
        let max = keel_core::limits::HINT_WAIT_MAX;
        if self.visibility.is_zero() {
            return Err("visibility: must be more than zero; the default is 30s".to_owned());
        }
        // A receive that does not wait turns an idle hint loop into a busy loop.
        if self.wait.is_zero() || self.wait > max {
            return Err(format!(
                "wait: must be more than zero and at most {max:?} (got {:?}); the default is 1s",
                self.wait
            ));
        }
        if self.repair_after.is_some_and(|d| d.is_zero()) {
            return Err("repair_after: must be more than zero; None turns this worker's \
                        repair pass off"
                .to_owned());
        }
        Ok(())
    }

    /// [`validate`](Self::validate), and the bounds of `queue`: a visibility longer than
    /// the queue keeps a lease would fail every receive, which the worker would take for
    /// an outage and retry for ever.
    pub fn validate_for(&self, queue: &dyn Queue) -> Result<(), String> {
        self.validate()?;
        match queue.capabilities().visibility_max {
            Some(most) if self.visibility > most => Err(format!(
                "visibility: {:?} is longer than this queue keeps a lease ({most:?}); give at most that",
                self.visibility
            )),
            _ => Ok(()),
        }
    }
}

impl Default for HintConfig {
    fn default() -> Self {
        HintConfig {
            visibility: Duration::from_secs(30),
            wait: Duration::from_secs(1),
            repair_after: Some(Duration::from_secs(10)),
        }
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
    /// Hints the repair pass published again.
    pub repaired: AtomicU64,
    /// Hints left to the store because their delay is longer than the queue keeps.
    pub held_back: AtomicU64,
    /// Hints whose instance was ready but not claimed here, handed back for another
    /// worker.
    pub handed_back: AtomicU64,
    /// Hints not published because [`PUBLISHES_MAX`] publishes were already under way (a
    /// queue that answers slowly or not at all); polling and the repair pass find their
    /// work.
    pub dropped: AtomicU64,
}

/// A worker's queue and its settings.
pub(crate) struct HintLink {
    queue: Arc<dyn Queue>,
    /// The background publishes after commits.
    publisher: Publisher,
    config: HintConfig,
    stats: Arc<HintStats>,
    /// Whether the hints bring work: the queue answers, and fewer than
    /// `HINT_MISSES_MAX` receives in a row claimed nothing.
    flowing: AtomicBool,
    /// Receives in a row that claimed nothing (empty, or every hint stale).
    misses: AtomicU32,
    /// Woken when `flowing` turns false, so a claim loop that left its freed slots to the
    /// hint loop takes them back at once instead of at its next poll.
    stopped: Notify,
}

/// Receives in a row that may claim nothing (come back empty, or with stale hints only)
/// before the claim loop refills freed slots itself. One such receive is common while
/// the hints keep up (a duplicate, an instance the poll took first); several in a row
/// mean the hints do not bring the work.
pub(crate) const HINT_MISSES_MAX: u32 = 3;

impl HintLink {
    /// Records what a receive claimed: a claim hands freed slots to the hints,
    /// `HINT_MISSES_MAX` misses in a row to the claim loop.
    fn claimed(&self, n: usize) {
        if n > 0 {
            self.misses.store(0, Ordering::Relaxed);
            self.set_flowing(true);
        } else if self.misses.fetch_add(1, Ordering::Relaxed) + 1 >= HINT_MISSES_MAX {
            self.set_flowing(false);
        }
    }

    /// The hint loop failed at the queue or the store: the claim loop carries the load
    /// until hints bring work again, and the loop's failure is recorded; returns how long
    /// the loop backs off. That is the loops' own schedule (from 50 ms, doubling with each
    /// failure in a row up to 5 s, reset by a success), not the poll interval: a queue
    /// back after a blip of a second must not leave the hints off for a poll interval
    /// that a worker with a queue often sets to minutes.
    fn failed<S: Store, C: Clock>(&self, inner: &Inner<S, C>, error: &str) -> Duration {
        self.misses.store(HINT_MISSES_MAX, Ordering::Relaxed);
        self.set_flowing(false);
        inner.loop_failed(WorkerLoop::Hints, &error)
    }

    /// Records whether the hints bring work; waking the claim loop when they stopped.
    fn set_flowing(&self, flowing: bool) {
        if self.flowing.swap(flowing, Ordering::Relaxed) && !flowing {
            // One stored permit at most: a claim loop not waiting yet wakes at its next
            // wait, once, and goes back to sleep if there is nothing to claim.
            self.stopped.notify_one();
        }
    }

    /// Receives up to `max` hints, giving up after the wait and [`RECEIVE_MARGIN`].
    async fn receive(&self, max: usize) -> StoreResult<Vec<Delivery>> {
        let (visibility, wait) = (self.config.visibility, self.config.wait);
        bounded(wait + RECEIVE_MARGIN, "receive", self.queue.receive(max, visibility, wait)).await
    }

    /// Acks `receipts`; a failure (or no answer within [`QUEUE_CALL_TIMEOUT`]) only means
    /// the hints come back after their visibility and are acked then.
    async fn ack(&self, receipts: Vec<String>) {
        if receipts.is_empty() {
            return;
        }
        let acking = self.queue.ack(receipts);
        if let Err(e) = bounded(QUEUE_CALL_TIMEOUT, "ack", acking).await {
            tracing::debug!(error = %e, "acking hints failed; they come back and are acked then");
        }
    }

    /// Hands each `(receipt, delay)` back; after a call that got no answer the rest are
    /// left to their visibility rather than each waiting out its own timeout.
    async fn nack_all(&self, nacks: impl IntoIterator<Item = (String, Duration)>) {
        for (receipt, delay) in nacks {
            let handing = self.queue.nack(receipt, delay);
            match tokio::time::timeout(QUEUE_CALL_TIMEOUT, handing).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "handing a hint back failed; it comes back after its visibility");
                }
                Err(_) => {
                    tracing::debug!(
                        "handing a hint back got no answer within {QUEUE_CALL_TIMEOUT:?}; the \
                         hints come back after their visibility"
                    );
                    return;
                }
            }
        }
    }
}

/// `call`, or an `Unavailable` error naming `what` when it takes longer than `limit`.
async fn bounded<T>(
    limit: Duration,
    what: &str,
    call: impl Future<Output = StoreResult<T>>,
) -> StoreResult<T> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(StoreError::unavailable(format!("queue {what}: no answer within {limit:?}")))
    })
}

/// Runs publishes in the background, at most [`PUBLISHES_MAX`] at once, so a queue that
/// hangs cannot pile up tasks at the rate of commits, starts and sends.
pub(crate) struct Publisher {
    queue: Arc<dyn Queue>,
    slots: Arc<Semaphore>,
    /// Hints dropped because every slot was taken.
    dropped: AtomicU64,
}

impl Publisher {
    pub(crate) fn new(queue: Arc<dyn Queue>) -> Self {
        Publisher {
            queue,
            slots: Arc::new(Semaphore::new(PUBLISHES_MAX)),
            dropped: AtomicU64::new(0),
        }
    }

    /// Hints dropped so far because [`PUBLISHES_MAX`] publishes were under way.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Publishes `hints` in the background and hands what happened to `done`; `None`
    /// (the hints dropped and counted) when [`PUBLISHES_MAX`] publishes are under way.
    pub(crate) fn spawn(
        &self,
        hints: Vec<Hint>,
        done: impl FnOnce(Published) + Send + 'static,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
            let n = hints.len() as u64;
            self.dropped.fetch_add(n, Ordering::Relaxed);
            if publish_warning_due() {
                tracing::warn!(
                    dropped = n,
                    "{PUBLISHES_MAX} publishes of hints are under way (the queue answers slowly \
                     or not at all): dropping these hints; polling and the repair pass take the \
                     work (said at most once a minute)"
                );
            }
            return None;
        };
        let queue = Arc::clone(&self.queue);
        Some(tokio::spawn(async move {
            let published = publish(&queue, hints).await;
            drop(slot);
            done(published);
        }))
    }
}

impl HintStats {
    fn count(&self, p: Published) {
        self.published.fetch_add(p.taken, Ordering::Relaxed);
        self.publish_failed.fetch_add(p.failed, Ordering::Relaxed);
        self.held_back.fetch_add(p.held_back, Ordering::Relaxed);
    }
}

/// Whether the worker's hints are flowing (its last receive claimed work): then slots
/// freed by commits are left to the hint loop, and the claim loop only polls (the repair
/// path), except the slots of a queue hints never claim into (a queue-wide limit), which
/// the claim loop still refills the moment they free. Without a queue, while the queue
/// fails, and while its hints bring nothing, the claim loop refills freed slots itself as
/// usual.
pub(super) fn hints_flowing<S, C>(inner: &Inner<S, C>) -> bool {
    inner.hints.as_ref().is_some_and(|link| link.flowing.load(Ordering::Relaxed))
}

/// Completes when the worker's hints stop flowing (never without a queue).
pub(super) async fn hints_stopped<S, C>(inner: &Inner<S, C>) {
    match &inner.hints {
        Some(link) => link.stopped.notified().await,
        None => std::future::pending().await,
    }
}

impl<S: Store, C: Clock + Clone> Worker<S, C> {
    /// Gives the worker a queue of ready-work hints (see the module doc); returns the
    /// queue link's counters with the worker. Run the store's notifications or a short
    /// `poll_interval` next to it as you like: polling stays the repair path.
    ///
    /// # Panics
    ///
    /// When [`HintConfig::validate_for`] refuses `config` for `queue`.
    #[must_use]
    pub fn with_queue(
        mut self,
        queue: Arc<dyn Queue>,
        config: HintConfig,
    ) -> (Self, Arc<HintStats>) {
        if let Err(e) = config.validate_for(queue.as_ref()) {
            panic!("invalid HintConfig: {e}");
        }
        let stats = Arc::new(HintStats::default());
        self.hints = Some(Arc::new(HintLink {
            publisher: Publisher::new(Arc::clone(&queue)),
            queue,
            config,
            stats: Arc::clone(&stats),
            // The claim loop leads until a receive claims something: a queue strategy
            // such as priority order is the claim loop's (hints name rows in publish
            // order), and its first claims must not wait on the queue.
            flowing: AtomicBool::new(false),
            misses: AtomicU32::new(0),
            stopped: Notify::new(),
        }));
        (self, stats)
    }
}

/// The hints for what a group commit left ready, read from its receipts
/// (`plan::hints::after_commit`).
fn ready_hints(
    batch: &[Finished],
    results: &[Option<StoreResult<CommitReceipt>>],
    config: &super::WorkerConfig,
) -> Vec<Hint> {
    let mut hints = Vec::new();
    for (f, result) in batch.iter().zip(results) {
        let Some(Ok(receipt)) = result else { continue };
        let row = &f.origin.claim.instance;
        // A row that stays runnable in a queue hints may not claim into is left to the
        // claim loop: its hint would only be received and handed back.
        let own = config.hints_claim_into(&row.queue);
        hints.extend(
            hints::after_commit(row, &f.commit, receipt)
                .into_iter()
                .filter(|hint| own || hint.instance != receipt.id),
        );
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
    let hints = ready_hints(batch, results, &inner.config);
    if hints.is_empty() {
        return;
    }
    let n = hints.len() as u64;
    let stats = Arc::clone(&link.stats);
    if link.publisher.spawn(hints, move |published| stats.count(published)).is_none() {
        link.stats.dropped.fetch_add(n, Ordering::Relaxed);
    }
}

/// Whether a failed publish is worth a warning: the first, then at most one a minute in
/// this process (a queue that is down fails every publish; one line says so).
fn publish_warning_due() -> bool {
    static SINCE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    static LAST: AtomicU64 = AtomicU64::new(u64::MAX);
    let now = SINCE.get_or_init(std::time::Instant::now).elapsed().as_secs();
    let last = LAST.load(Ordering::Relaxed);
    (last == u64::MAX || now >= last.saturating_add(60))
        && LAST.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
}

/// What [`publish`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Published {
    /// Hints the queue took.
    pub(crate) taken: u64,
    /// Hints it refused or could not be reached for (their work waits for the repair pass
    /// or polling).
    pub(crate) failed: u64,
    /// Hints left to the store because their delay is longer than the queue keeps.
    pub(crate) held_back: u64,
    /// Whether a queue call got no answer within [`QUEUE_CALL_TIMEOUT`], which ended the
    /// publish (its unsent hints count as failed).
    pub(crate) stalled: bool,
}

/// Queue calls one publish has under way at once on a queue without ordered groups. A
/// queue with ordered groups gets one call after the other, so the hints of a group
/// arrive in publish order.
pub(crate) const PUBLISH_CALLS_MAX: usize = 4;

/// Publishes `hints` in calls of one round trip each (the queue's
/// `hints_per_round_trip`, so that [`QUEUE_CALL_TIMEOUT`] bounds one round trip and never
/// a whole publish of up to `HINT_BATCH_MAX` hints), up to [`PUBLISH_CALLS_MAX`] at
/// once (one at a time on a queue with ordered groups), leaving delays the queue cannot
/// keep to the store. A failure only costs latency: the repair pass and polling find the
/// work. A refused call counts its own hints as failed and the others go on. A call the
/// queue does not answer within [`QUEUE_CALL_TIMEOUT`] ends the publish: the calls under
/// way finish (each within its own bound), no further call is made, since it would wait
/// on the same queue, and the hints not taken count as failed.
pub(crate) async fn publish(queue: &Arc<dyn Queue>, hints: Vec<Hint>) -> Published {
    let total = hints.len() as u64;
    let caps = queue.capabilities();
    let hints = hints::publishable(hints, caps.delay_max);
    let publishable = hints.len() as u64;
    let mut out = Published { held_back: total - publishable, ..Published::default() };
    let at_once = if caps.ordered_groups { 1 } else { PUBLISH_CALLS_MAX };
    let per_call = caps.hints_per_round_trip.clamp(1, keel_core::limits::HINT_BATCH_MAX);
    let mut first_error: Option<String> = None;
    let mut settle =
        |out: &mut Published, n: u64, answer: Result<StoreResult<()>, Elapsed>| match answer {
            Ok(Ok(())) => out.taken += n,
            Ok(Err(e)) => {
                first_error.get_or_insert_with(|| e.to_string());
            }
            Err(_) => {
                out.stalled = true;
                first_error.get_or_insert_with(|| {
                    format!("the queue did not answer within {QUEUE_CALL_TIMEOUT:?}")
                });
            }
        };
    if hints.len() <= per_call {
        // One round trip (the usual publish of a group commit): made here, no task spawned.
        if !hints.is_empty() {
            let n = hints.len() as u64;
            settle(
                &mut out,
                n,
                tokio::time::timeout(QUEUE_CALL_TIMEOUT, queue.enqueue(hints)).await,
            );
        }
    } else {
        let mut chunks = hints.chunks(per_call);
        let mut calls = tokio::task::JoinSet::new();
        loop {
            while !out.stalled && calls.len() < at_once {
                let Some(chunk) = chunks.next() else { break };
                let (queue, chunk) = (Arc::clone(queue), chunk.to_vec());
                calls.spawn(async move {
                    let n = chunk.len() as u64;
                    (n, tokio::time::timeout(QUEUE_CALL_TIMEOUT, queue.enqueue(chunk)).await)
                });
            }
            let Some(joined) = calls.join_next().await else { break };
            match joined {
                Ok((n, answer)) => settle(&mut out, n, answer),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => {
                    // Cancelled: the runtime is shutting down, and so is this publish.
                    out.stalled = true;
                }
            }
        }
    }
    out.failed = publishable - out.taken;
    if let Some(error) = first_error {
        if publish_warning_due() {
            tracing::warn!(error = %error, taken = out.taken, failed = out.failed, "publishing hints failed; the repair pass or polling takes the work (said at most once a minute)");
        } else {
            tracing::debug!(error = %error, taken = out.taken, failed = out.failed, "publishing hints failed");
        }
    }
    out
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

/// Starts the repair pass when the worker has a queue and a repair bound.
pub(super) fn spawn_repair_loop<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    shutdown: &watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let bound = inner.hints.as_ref()?.config.repair_after?;
    Some(super::spawn_loop(inner, WorkerLoop::Repair, shutdown, move |inner, stop| {
        repair_loop(inner, bound, stop)
    }))
}

/// Every half to whole `bound` (jittered), publishes hints again for the instances that
/// have been ready for `bound` (`Store::instance_ready_stale`), carrying a cursor from one
/// pass to the next so that a huge backlog is covered a bounded page count at a time.
async fn repair_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    bound: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let Some(link) = inner.hints.clone() else { return };
    let mut cover = Cover::default();
    loop {
        let pause = bound.mul_f64(0.5 + fastrand::f64() / 2.0);
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        match repair_pass(&inner, &link, bound, &mut cover, &shutdown).await {
            Ok(()) => inner.loop_ok(WorkerLoop::Repair),
            Err(e) => {
                let pause = inner.loop_failed(WorkerLoop::Repair, &format!("repair pass: {e}"));
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = shutdown.changed() => return,
                }
            }
        }
    }
}

/// Where the repair passes are in their walk over the ready instances.
#[derive(Debug, Default)]
struct Cover {
    /// Where the next pass goes on (`None`: from the start).
    cursor: Option<InstanceId>,
    /// When the walk under way began.
    started: Option<Timestamp>,
    /// When the walk before it began: every instance was looked at since then.
    previous: Option<Timestamp>,
}

/// One repair pass: up to `REPAIR_PAGES_MAX` pages from where the last one stopped; of
/// each page, the instances `plan::hints::repair_due` picks are published as one batch.
/// Once `shutdown` turns true the pass stops before its next page, the cursor left where
/// it stood (as after a failed page), so a worker shutting down waits for one page, not
/// for a walk over a huge backlog.
async fn repair_pass<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    link: &HintLink,
    bound: Duration,
    cover: &mut Cover,
    shutdown: &watch::Receiver<bool>,
) -> StoreResult<()> {
    let now = inner.clock.now();
    // Where the walk stood before this pass: a page that fails goes again next pass, and
    // a walk that failed on its first page is not counted as begun.
    let (walk_started, walk_previous) = (cover.started, cover.previous);
    if cover.cursor.is_none() {
        cover.previous = cover.started;
        cover.started = Some(now);
    }
    let since_last_look = cover.previous.map(|at| now.since(at));
    // Only the queues hints may claim into: the rest are the claim loop's alone.
    let queues: Vec<String> = inner
        .config
        .queues
        .iter()
        .map(|(q, _)| q.clone())
        .filter(|q| inner.config.hints_claim_into(q))
        .collect();
    if queues.is_empty() {
        return Ok(());
    }
    for _ in 0..REPAIR_PAGES_MAX {
        let page_from = cover.cursor;
        let rewind = |cover: &mut Cover| {
            cover.cursor = page_from;
            if page_from.is_none() {
                (cover.started, cover.previous) = (walk_started, walk_previous);
            }
        };
        if *shutdown.borrow() {
            rewind(cover);
            return Ok(());
        }
        let params = ReadyStaleParams {
            namespaces: inner.config.namespaces.clone(),
            queues: queues.clone(),
            machines: inner.machines.keys().cloned().collect(),
            ready_for: bound,
            after: cover.cursor,
            limit: READY_STALE_BATCH_MAX,
            now,
        };
        let rows = match inner.store.instance_ready_stale(params).await {
            Ok(rows) => rows,
            Err(e) => {
                rewind(cover);
                return Err(e);
            }
        };
        let full = rows.len() == READY_STALE_BATCH_MAX;
        cover.cursor = if full { rows.last().map(|r| r.id) } else { None };
        let hints: Vec<Hint> = rows
            .iter()
            .filter(|row| {
                let age = hints::ready_since(row, now).map_or(Duration::ZERO, |at| now.since(at));
                hints::repair_due(age, bound, since_last_look)
            })
            .map(hints::repair_hint)
            .collect();
        if !hints.is_empty() {
            let published = publish(&link.queue, hints).await;
            link.stats.count(published);
            link.stats.repaired.fetch_add(published.taken, Ordering::Relaxed);
            // Hints the queue took are announced: a page it took part of is done (the
            // rest waits for a later look, like any lost hint). A page it took none of,
            // or that it stopped answering during, goes again next pass.
            if published.stalled || (published.taken == 0 && published.failed > 0) {
                rewind(cover);
                return Err(keel_core::StoreError::unavailable(format!(
                    "the queue took {} of the repair pass's {} hints{}; this page goes again \
                     next pass",
                    published.taken,
                    published.taken + published.failed,
                    if published.stalled { " and stopped answering" } else { "" }
                )));
            }
        }
        if !full {
            return Ok(());
        }
    }
    Ok(())
}

/// Receives hints while slots are free, claims their instances by id and starts them.
async fn hint_loop<S: Store, C: Clock>(
    inner: Arc<Inner<S, C>>,
    queues: Arc<Vec<QueueSlots>>,
    tx: mpsc::Sender<Finished>,
    mut shutdown: watch::Receiver<bool>,
) {
    let Some(link) = inner.hints.clone() else { return };
    while !*shutdown.borrow() {
        // Only slots a hint may fill count: receiving for a queue whose limits leave its
        // claims to the claim loop would hand every hint straight back, again and again.
        let free: usize = queues
            .iter()
            .filter(|s| inner.config.hints_claim_into(&s.name))
            .map(QueueSlots::free)
            .sum();
        if free == 0 {
            tokio::select! {
                () = inner.slot_freed.hints.notified() => {}
                () = tokio::time::sleep(inner.config.poll_interval) => {}
                _ = shutdown.changed() => {}
            }
            continue;
        }
        let max = free.min(HINT_RECEIVE_MAX);
        let received = tokio::select! {
            r = link.receive(max) => r,
            _ = shutdown.changed() => return,
        };
        let deliveries = match received {
            Ok(d) => d,
            Err(e) => {
                // Try the queue again later.
                let pause = link.failed(&inner, &format!("receive hints: {e}"));
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
        };
        if deliveries.is_empty() {
            inner.loop_ok(WorkerLoop::Hints);
            link.claimed(0);
            continue;
        }
        link.stats.received.fetch_add(deliveries.len() as u64, Ordering::Relaxed);
        let received = deliveries.len();
        match claim_hinted(&inner, &link, &queues, &tx, deliveries).await {
            Ok(claimed) => {
                inner.loop_ok(WorkerLoop::Hints);
                if claimed == Some(0) {
                    tracing::debug!(
                        received,
                        "no hinted instance was ready: the queue lags behind the store"
                    );
                }
                if let Some(claimed) = claimed {
                    link.claimed(claimed);
                }
            }
            Err((e, deliveries)) => {
                // The store is unavailable: the hints come back once this loop's back-off
                // is over, not after their visibility.
                let pause = link.failed(&inner, &format!("claim by hint: {e}"));
                link.nack_all(deliveries.into_iter().map(|d| (d.receipt, pause))).await;
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = shutdown.changed() => {}
                }
            }
        }
    }
}

/// Claim parameters for at most `most` instances, one per worker queue that hints may
/// claim into and that has a free slot, each bounded by that queue's own free slots and
/// key limit; empty when no slot is free. A claim by id names rows, not queues, so one
/// claim spanning every open queue bounded by their summed free slots could take more
/// rows of one queue than it has slots, and those rows would only be released again.
fn claim_params<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    queues: &[QueueSlots],
    most: usize,
) -> Vec<ClaimParams> {
    let batch = most.min(inner.config.claim_batch).min(keel_core::limits::CLAIM_BATCH_MAX);
    queues
        .iter()
        .filter(|s| inner.config.hints_claim_into(&s.name))
        .filter_map(|s| {
            let limit = s.free().min(batch);
            (limit > 0).then(|| ClaimParams {
                worker: inner.config.worker_id.clone(),
                namespaces: inner.config.namespaces.clone(),
                queues: vec![s.name.clone()],
                machines: inner.machines.keys().cloned().collect(),
                limit,
                lease: inner.config.lease,
                now: inner.clock.now(),
                // A hint names rows, so their order does not matter here.
                policy: keel_core::plan::claim::ClaimPolicy {
                    key_limit: inner.config.claim_policy(&s.name).key_limit,
                    ..keel_core::plan::claim::ClaimPolicy::default()
                },
            })
        })
        .collect()
}

/// Claims the instances of `deliveries` by id, one claim per queue with free slots (the
/// ids not taken yet, at most that queue's free slots), starts what was claimed and
/// settles every hint: a claimed one is acked; one that took nothing is acked when its
/// instance is gone or not ready (stale or a duplicate) and handed back for another
/// worker when it is ready (`plan::hints::unclaimed`: another worker may serve its
/// machine, namespace or queue, or have the slot this one lacks). When the store is
/// unavailable the hints not claimed are neither acked nor handed back here: they go
/// back to the caller with the error, which backs off (what was claimed before the error
/// runs, and its hints are acked). Returns how many instances the hints claimed, `None`
/// when no slot was free or the store refused the claim for good before any was taken.
async fn claim_hinted<S: Store, C: Clock>(
    inner: &Arc<Inner<S, C>>,
    link: &HintLink,
    queues: &Arc<Vec<QueueSlots>>,
    tx: &mpsc::Sender<Finished>,
    deliveries: Vec<Delivery>,
) -> Result<Option<usize>, (StoreError, Vec<Delivery>)> {
    let mut left: BTreeSet<InstanceId> = deliveries.iter().map(|d| d.hint.instance).collect();
    let plans = claim_params(inner, queues, left.len());
    if plans.is_empty() {
        // No slot left after all: hand the hints back for another worker (or a later
        // round of this one).
        link.nack_all(deliveries.into_iter().map(|d| (d.receipt, Duration::ZERO))).await;
        return Ok(None);
    }
    // At most one claim per worker queue, and none once every id is taken.
    let mut claims = Vec::new();
    let mut failure = None;
    for params in plans {
        if left.is_empty() {
            break;
        }
        match inner.store.instance_claim_ids(left.iter().copied().collect(), params).await {
            Ok(taken) => {
                for claim in &taken {
                    left.remove(&claim.instance.id);
                }
                claims.extend(taken);
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let n = claims.len();
    link.stats.claimed.fetch_add(n as u64, Ordering::Relaxed);
    let taken: BTreeSet<InstanceId> = claims.iter().map(|c| c.instance.id).collect();
    if !claims.is_empty() {
        launch(inner, queues, tx, claims, false).await;
    }
    let (mut done, missed): (Vec<Delivery>, Vec<Delivery>) =
        deliveries.into_iter().partition(|d| taken.contains(&d.hint.instance));
    let claimed = match failure {
        None => Some(n),
        Some(e) if e.is_retryable() => {
            link.ack(done.into_iter().map(|d| d.receipt).collect()).await;
            return Err((e, missed));
        }
        Some(e) => {
            tracing::warn!(error = %e, "claim by hint refused; dropping the hints");
            done.extend(missed);
            link.ack(done.into_iter().map(|d| d.receipt).collect()).await;
            return Ok((n > 0).then_some(n));
        }
    };
    if !missed.is_empty() {
        done.extend(hand_back(inner, link, missed).await);
    }
    link.ack(done.into_iter().map(|d| d.receipt).collect()).await;
    Ok(claimed)
}

/// Hands back the hints of `missed` whose instances are ready, for another worker;
/// returns the rest, to be acked. When the rows cannot be read, every hint is returned
/// (acked): polling and the repair pass find what was ready.
async fn hand_back<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    link: &HintLink,
    missed: Vec<Delivery>,
) -> Vec<Delivery> {
    let ids: BTreeSet<InstanceId> = missed.iter().map(|d| d.hint.instance).collect();
    let rows = match inner.store.instance_rows(ids.into_iter().collect()).await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::debug!(error = %e, "reading unclaimed hints' instances failed; dropping the hints");
            return missed;
        }
    };
    let now = inner.clock.now();
    let (mut drop, mut back) = (Vec::new(), Vec::new());
    for d in missed {
        let row = rows.iter().find(|r| r.id == d.hint.instance);
        match hints::unclaimed(row, d.receive_count, now) {
            hints::Unclaimed::Drop => drop.push(d),
            hints::Unclaimed::HandBack(delay) => back.push((d.receipt, delay)),
        }
    }
    link.stats.handed_back.fetch_add(back.len() as u64, Ordering::Relaxed);
    link.nack_all(back).await;
    drop
}

#[cfg(test)]
mod tests {
    use super::{PUBLISH_CALLS_MAX, Published, publish};
    use async_trait::async_trait;
    use keel_core::ports::Queue;
    use keel_core::ports::queue::{Delivery, Hint, QueueCapabilities};
    use keel_core::{InstanceId, StoreError, StoreResult};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// A queue that sends each batch of `round_trip` hints (10 unless set) as one round trip
    /// of `per_batch`, one after the other (as SQS does), refuses the hint of instance
    /// `refuse` (sending the rest) and records what it took, its calls and how many it had
    /// under way at once.
    struct Slow {
        per_batch: Duration,
        round_trip: usize,
        calls: AtomicUsize,
        ordered: bool,
        refuse: Option<InstanceId>,
        taken: Mutex<Vec<InstanceId>>,
        under_way: AtomicUsize,
        most_under_way: AtomicUsize,
    }

    impl Slow {
        fn new(per_batch: Duration) -> Self {
            Slow {
                per_batch,
                round_trip: 10,
                calls: AtomicUsize::new(0),
                ordered: false,
                refuse: None,
                taken: Mutex::new(Vec::new()),
                under_way: AtomicUsize::new(0),
                most_under_way: AtomicUsize::new(0),
            }
        }
    }

    #[async_trait]
    impl Queue for Slow {
        fn capabilities(&self) -> QueueCapabilities {
            QueueCapabilities {
                delay_max: Some(Duration::from_secs(900)),
                ordered_groups: self.ordered,
                priorities: false,
                visibility_max: Some(Duration::from_secs(3600)),
                resolution: Duration::from_secs(1),
                hints_per_round_trip: self.round_trip,
            }
        }
        async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
            let now = self.under_way.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_under_way.fetch_max(now, Ordering::SeqCst);
            self.calls.fetch_add(1, Ordering::SeqCst);
            let mut refused = 0;
            for batch in hints.chunks(self.round_trip) {
                tokio::time::sleep(self.per_batch).await;
                let mut taken = self.taken.lock().unwrap();
                for hint in batch {
                    if Some(hint.instance) == self.refuse {
                        refused += 1;
                    } else {
                        taken.push(hint.instance);
                    }
                }
            }
            self.under_way.fetch_sub(1, Ordering::SeqCst);
            if refused > 0 {
                return Err(StoreError::unavailable(format!(
                    "{refused} of {} hints refused, the others were sent",
                    hints.len()
                )));
            }
            Ok(())
        }
        async fn receive(&self, _: usize, _: Duration, _: Duration) -> StoreResult<Vec<Delivery>> {
            Ok(Vec::new())
        }
        async fn ack(&self, _: Vec<String>) -> StoreResult<()> {
            Ok(())
        }
        async fn nack(&self, _: String, _: Duration) -> StoreResult<()> {
            Ok(())
        }
        async fn extend(&self, _: String, _: Duration) -> StoreResult<()> {
            Ok(())
        }
    }

    fn hints(n: i64) -> Vec<Hint> {
        (1..=n).map(|i| Hint::new(InstanceId(i), 1)).collect()
    }

    /// A publish of 1 000 hints to a queue that needs 100 round trips of 110 ms for them
    /// (11 s in a row, over the 10 s a queue call may take) is taken whole: the time limit
    /// bounds one round trip, not the publish.
    #[tokio::test]
    async fn a_large_publish_to_a_slow_queue_is_taken_whole() {
        let slow = Arc::new(Slow::new(Duration::from_millis(110)));
        let queue: Arc<dyn Queue> = Arc::clone(&slow) as Arc<dyn Queue>;
        let published = publish(&queue, hints(1_000)).await;
        assert_eq!(
            published,
            Published { taken: 1_000, failed: 0, held_back: 0, stalled: false },
            "every hint of a large publish is taken and counted as taken"
        );
        assert_eq!(slow.taken.lock().unwrap().len(), 1_000);
        assert!(slow.most_under_way.load(Ordering::SeqCst) <= PUBLISH_CALLS_MAX);
    }

    /// A queue that takes a whole batch in one round trip (Redis) gets the publish in one
    /// call, not in calls of SQS's ten.
    #[tokio::test]
    async fn a_queue_that_takes_a_batch_in_one_round_trip_gets_one_call() {
        let mut slow = Slow::new(Duration::ZERO);
        slow.round_trip = 1_000;
        let slow = Arc::new(slow);
        let queue: Arc<dyn Queue> = Arc::clone(&slow) as Arc<dyn Queue>;
        assert_eq!(publish(&queue, hints(1_000)).await.taken, 1_000);
        assert_eq!(slow.calls.load(Ordering::SeqCst), 1, "one call for one round trip");
        let queue: Arc<dyn Queue> = Arc::new(Slow::new(Duration::ZERO));
        assert_eq!(publish(&queue, hints(25)).await.taken, 25);
        // A one-call publish the queue refuses counts its hints as failed.
        let mut refusing = Slow::new(Duration::ZERO);
        (refusing.round_trip, refusing.refuse) = (1_000, Some(InstanceId(7)));
        let queue: Arc<dyn Queue> = Arc::new(refusing);
        let published = publish(&queue, hints(20)).await;
        assert_eq!((published.taken, published.failed, published.stalled), (0, 20, false));
        assert_eq!(publish(&queue, Vec::new()).await, Published::default(), "nothing to send");
    }

    /// One hint the queue refuses costs the hints of its own call, never the publish:
    /// the others are sent and counted as taken.
    #[tokio::test]
    async fn one_refused_hint_costs_only_its_call() {
        let mut slow = Slow::new(Duration::ZERO);
        slow.refuse = Some(InstanceId(500));
        let slow = Arc::new(slow);
        let queue: Arc<dyn Queue> = Arc::clone(&slow) as Arc<dyn Queue>;
        let published = publish(&queue, hints(1_000)).await;
        let call = slow.capabilities().hints_per_round_trip as u64;
        assert_eq!(
            (published.taken, published.failed),
            (1_000 - call, call),
            "one refused hint counts only its call's hints as failed"
        );
        assert_eq!(slow.taken.lock().unwrap().len(), 999, "every other hint was sent");
    }

    /// A queue with ordered groups gets one call after the other, so a group's hints
    /// arrive in publish order.
    #[tokio::test]
    async fn ordered_queues_get_one_call_at_a_time_in_order() {
        let mut slow = Slow::new(Duration::from_millis(1));
        slow.ordered = true;
        let slow = Arc::new(slow);
        let queue: Arc<dyn Queue> = Arc::clone(&slow) as Arc<dyn Queue>;
        let published = publish(&queue, hints(95)).await;
        assert_eq!(published.taken, 95);
        assert_eq!(slow.most_under_way.load(Ordering::SeqCst), 1);
        let order: Vec<i64> = slow.taken.lock().unwrap().iter().map(|i| i.0).collect();
        assert_eq!(order, (1..=95).collect::<Vec<_>>());
    }
}
