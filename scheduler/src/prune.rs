//! The pruner: the background loop of a worker that applies retention.
//!
//! Each run (every `retention.interval`, jittered by up to a tenth so workers do not prune
//! in step) makes the passes [`RetentionConfig::passes`] lists: pages of
//! `Store::instance_prune`, each one short transaction over at most `retention.batch`
//! rows, with `retention.pause` between pages and at most
//! [`PAGES_PER_PASS_MAX`] pages per pass; a pass that runs out of pages goes on from
//! there at the next run ([`PruneCursors`]). Then
//! it trims every instance's history to its newest `history_per_instance` entries
//! ([`RetentionConfig::trim_passes`]: pages of `Store::history_trim`, each deleting at
//! most `retention.batch` rows, under the same pause and page bound), and purges the dead
//! letters older than each registered machine's `dead_letter.retention` — and those of
//! each machine it does not register but whose section of its configuration file sets a
//! `dead_letter.retention` ([`named_dead_letter_retentions`]) — in calls bounded by the
//! store. Every row removed is counted in `keel_pruned_rows_total{kind}` and in
//! [`PruneCounts`].
//!
//! Several workers may prune at once: a row is deleted once (the other worker's page finds
//! it gone, or locked and left to the next pass).

use keel_core::limits;
use keel_core::ports::store::{DeadLetterPurgeParams, DeadLetterSelector, PrunePage};
use keel_core::ports::{Clock, Store};
use keel_core::retention::{PAGES_PER_PASS_MAX, RetentionConfig};
use keel_core::{InstanceId, StoreError, StoreResult, Timestamp};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// How long the pruner waits before its next run after a store call failed.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Rows a worker's pruner removed so far.
#[derive(Debug, Default)]
pub struct PruneStats {
    /// Runs completed.
    pub runs: AtomicU64,
    /// Ended instances deleted.
    pub instances: AtomicU64,
    /// History rows deleted with them.
    pub history: AtomicU64,
    /// Inbox rows deleted with them.
    pub signals: AtomicU64,
    /// Dead letters purged after their retention.
    pub dead_letters: AtomicU64,
    /// History rows trimmed from instances over `history_per_instance`.
    pub history_trimmed: AtomicU64,
}

/// A snapshot of [`PruneStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PruneCounts {
    /// Runs completed.
    pub runs: u64,
    /// Ended instances deleted.
    pub instances: u64,
    /// History rows deleted.
    pub history: u64,
    /// Inbox rows deleted.
    pub signals: u64,
    /// Dead letters purged.
    pub dead_letters: u64,
    /// History rows trimmed from instances over `history_per_instance`.
    pub history_trimmed: u64,
}

impl PruneStats {
    /// The counts now.
    pub fn counts(&self) -> PruneCounts {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PruneCounts {
            runs: load(&self.runs),
            instances: load(&self.instances),
            history: load(&self.history),
            signals: load(&self.signals),
            dead_letters: load(&self.dead_letters),
            history_trimmed: load(&self.history_trimmed),
        }
    }

    fn add_page(&self, page: &PrunePage) {
        self.instances.fetch_add(page.instances, Ordering::Relaxed);
        self.history.fetch_add(page.history, Ordering::Relaxed);
        self.signals.fetch_add(page.signals, Ordering::Relaxed);
        for (kind, n) in
            [("instances", page.instances), ("history", page.history), ("signals", page.signals)]
        {
            if n > 0 {
                metrics::counter!("keel_pruned_rows_total", "kind" => kind).increment(n);
            }
        }
    }
}

/// Dead-letter retention of one machine in one namespace, or in every namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterRetention {
    /// The namespace; `None`: every namespace that holds dead letters of the machine,
    /// listed at each run (`Store::dead_letter_counts`).
    pub namespace: Option<String>,
    /// Machine name.
    pub machine: String,
    /// How long its dead letters are kept.
    pub keep: Duration,
}

/// The dead-letter retentions `settings` sets explicitly for machines not in
/// `registered`: each `[machines.<name>.queue.dead_letter] retention` of a machine this
/// worker does not run, by machine name. A worker with retention on purges those
/// machines' letters too (a machine served only by HTTP workers has no pruner of its
/// own); a machine it neither registers nor names keeps its letters, since another
/// worker's policy for it may differ from this one's defaults.
pub fn named_dead_letter_retentions(
    settings: &keel_core::config::KeelConfig,
    registered: &std::collections::BTreeSet<&str>,
) -> Vec<(String, Duration)> {
    settings
        .machines
        .iter()
        .filter(|(name, _)| !registered.contains(name.as_str()))
        .filter_map(|(name, machine)| {
            let keep = machine.queue.dead_letter.and_then(|d| d.retention)?;
            Some((name.clone(), keep))
        })
        .collect()
}

/// A worker's pruner.
#[derive(Debug, Clone)]
pub struct Pruner {
    /// Retention of ended instances.
    pub config: RetentionConfig,
    /// Only these namespaces (empty = every namespace): a worker prunes and trims only
    /// what it serves, never another team's namespace under its own retention.
    pub namespaces: Vec<String>,
    /// Dead-letter retention per machine.
    pub dead_letters: Vec<DeadLetterRetention>,
    /// What it removed.
    pub stats: Arc<PruneStats>,
    /// Where each pass stopped at its page bound, for the next run to go on from.
    pub cursors: Arc<PruneCursors>,
}

/// The longest a pause between two pages goes without asking whether to stop.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// Sleeps `pause`, or until `stop` says so (asked every [`STOP_CHECK`]).
async fn pause_unless(pause: Duration, stop: &(dyn Fn() -> bool + Sync)) {
    let end = tokio::time::Instant::now() + pause;
    loop {
        let left = end.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() || stop() {
            return;
        }
        tokio::time::sleep(left.min(STOP_CHECK)).await;
    }
}

/// Which walk a cursor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PassKind {
    Prune,
    Trim,
}

/// A pass's cursor key: its namespace (`None`: all), its kind and its place in the run.
type PassKey = (Option<String>, PassKind, usize);

/// Where each pass of a pruner stopped when it ran out of pages: the next run goes on
/// from there, so a table larger than one run's pages is still walked to its end (a
/// pass that reached the end starts again from the lowest id).
#[derive(Debug, Default)]
pub struct PruneCursors(Mutex<BTreeMap<PassKey, InstanceId>>);

impl PruneCursors {
    fn get(&self, key: &PassKey) -> Option<InstanceId> {
        self.0.lock().expect("prune cursors lock").get(key).copied()
    }

    fn set(&self, key: PassKey, at: Option<InstanceId>) {
        let mut cursors = self.0.lock().expect("prune cursors lock");
        match at {
            Some(at) => cursors.insert(key, at),
            None => cursors.remove(&key),
        };
    }
}

impl Pruner {
    /// One run at `now`: every prune pass to its end (or its page bound), then every
    /// history trim pass, then the dead letters.
    ///
    /// # Errors
    ///
    /// The first store error; the rows already removed stay removed.
    pub async fn run_once<S: Store + ?Sized>(&self, store: &S, now: Timestamp) -> StoreResult<()> {
        self.run_unless(store, now, &|| false).await
    }

    /// [`run_once`](Self::run_once), stopping before the next page once `stop` says so (a
    /// worker shutting down waits for one page, not for a whole run over a large table);
    /// a run so stopped is not counted. A pass whose page fails keeps its cursor where it
    /// failed and the run goes on with the other passes, so one page the store keeps
    /// refusing holds up only its own pass; the run returns the first error at its end.
    async fn run_unless<S: Store + ?Sized>(
        &self,
        store: &S,
        now: Timestamp,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> StoreResult<()> {
        let scopes: Vec<Option<&str>> = if self.namespaces.is_empty() {
            vec![None]
        } else {
            self.namespaces.iter().map(|ns| Some(ns.as_str())).collect()
        };
        let mut first_error = None;
        for scope in &scopes {
            self.prune_and_trim(store, *scope, now, stop, &mut first_error).await;
        }
        if let Err(e) = self.purge_dead_letters(store, now, stop).await {
            first_error.get_or_insert(e);
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if !stop() {
            self.stats.runs.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Every prune pass, then every history trim pass, of one namespace (`None`: all); a
    /// failed pass leaves its error in `first_error` (unless one is there) and the next
    /// pass runs.
    async fn prune_and_trim<S: Store + ?Sized>(
        &self,
        store: &S,
        namespace: Option<&str>,
        now: Timestamp,
        stop: &(dyn Fn() -> bool + Sync),
        first_error: &mut Option<StoreError>,
    ) {
        let scope = || namespace.map(str::to_owned);
        for (n, pass) in self.config.passes(namespace, now).into_iter().enumerate() {
            let walked = self.walk((scope(), PassKind::Prune, n), stop, |after| {
                let mut params = pass.clone();
                params.after = after;
                async move {
                    let page = store.instance_prune(params).await?;
                    self.stats.add_page(&page);
                    Ok(page.last)
                }
            });
            if let Err(e) = walked.await {
                first_error.get_or_insert(e);
            }
        }
        for (n, pass) in self.config.trim_passes(namespace).into_iter().enumerate() {
            let walked = self.walk((scope(), PassKind::Trim, n), stop, |after| {
                let mut params = pass.clone();
                params.after = after;
                async move {
                    let page = store.history_trim(params).await?;
                    self.stats.history_trimmed.fetch_add(page.history, Ordering::Relaxed);
                    if page.history > 0 {
                        metrics::counter!("keel_pruned_rows_total", "kind" => "history_trimmed")
                            .increment(page.history);
                    }
                    Ok(page.last)
                }
            });
            if let Err(e) = walked.await {
                first_error.get_or_insert(e);
            }
        }
    }

    /// One pass's pages from where its last walk stopped: `page` removes the page after
    /// the given id and returns the last id it read (`None`: the pass reached the end).
    /// Stops at the page bound, at the end (the next walk starts from the lowest id), at a
    /// failed page or once `stop` says so, with `retention.pause` between two pages (cut
    /// short by `stop`); keeps the cursor for the next run, which retries a failed page.
    async fn walk<F>(
        &self,
        key: PassKey,
        stop: &(dyn Fn() -> bool + Sync),
        mut page: impl FnMut(Option<InstanceId>) -> F,
    ) -> StoreResult<()>
    where
        F: Future<Output = StoreResult<Option<InstanceId>>>,
    {
        let mut after = self.cursors.get(&key);
        let mut result = Ok(());
        for page_no in 0..PAGES_PER_PASS_MAX {
            if stop() {
                break;
            }
            match page(after).await {
                Ok(next) => after = next,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            if after.is_none() {
                break;
            }
            if page_no + 1 < PAGES_PER_PASS_MAX {
                pause_unless(self.config.pause, stop).await;
            }
        }
        self.cursors.set(key, after);
        result
    }

    /// Each machine's dead letters older than its retention, in its namespace or, for a
    /// retention of every namespace, in each namespace that holds dead letters of the
    /// machine now.
    async fn purge_dead_letters<S: Store + ?Sized>(
        &self,
        store: &S,
        now: Timestamp,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> StoreResult<()> {
        let held = if self.dead_letters.iter().any(|d| d.namespace.is_none()) {
            store.dead_letter_counts(None).await?
        } else {
            Vec::new()
        };
        let mut scopes = Vec::new();
        for d in &self.dead_letters {
            match &d.namespace {
                Some(namespace) => scopes.push((namespace.clone(), d)),
                None => scopes.extend(
                    held.iter()
                        .filter(|c| c.machine == d.machine && c.count > 0)
                        .map(|c| (c.namespace.clone(), d)),
                ),
            }
        }
        for (namespace, d) in scopes {
            let params = DeadLetterPurgeParams {
                selector: Some(DeadLetterSelector::Machine {
                    namespace,
                    machine: d.machine.clone(),
                }),
                older_than: Some(now.minus(d.keep)),
                // A letter is how its suspended instance is retried: retention leaves it
                // until the instance is retried or cancelled.
                keep_suspended: true,
            };
            // Each call purges at most the store's batch bound; a full batch means more may
            // be left, so go on, within the same page bound as instances, and stop between
            // two pages once the worker is shutting down.
            for _ in 0..PAGES_PER_PASS_MAX {
                if stop() {
                    return Ok(());
                }
                let purged = store.dead_letter_purge(params.clone()).await?;
                self.stats.dead_letters.fetch_add(purged, Ordering::Relaxed);
                if purged > 0 {
                    metrics::counter!("keel_pruned_rows_total", "kind" => "dead_letters")
                        .increment(purged);
                }
                if purged < limits::DEAD_LETTER_BATCH_MAX as u64 {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Runs until `shutdown` turns true: a first run at once, then one every jittered
    /// interval. A failed run is logged and the next one comes after [`RETRY_AFTER`] (or
    /// the interval, if shorter).
    pub async fn run<S: Store + ?Sized, C: Clock>(
        self,
        store: Arc<S>,
        clock: C,
        mut shutdown: watch::Receiver<bool>,
    ) {
        while !*shutdown.borrow() {
            let stop = || *shutdown.borrow();
            let wait = match self.run_unless(&*store, clock.now(), &stop).await {
                Ok(()) => self.config.next_wait(fastrand::f64()),
                Err(e) => {
                    tracing::warn!(error = %e, "pruning failed; it is tried again later");
                    RETRY_AFTER.min(self.config.interval)
                }
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
