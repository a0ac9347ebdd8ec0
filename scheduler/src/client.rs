//! The client API: what an application calls to start instances, send them events,
//! cancel them, look at them, and operate dead letters and queues. Works against any
//! `Store`; every call is one store round trip (batches stay batches).

use keel_core::config::KeelConfig;
use keel_core::instance::DeadLetter;
use keel_core::instance::{NewInstance, NewSignal, SignalTarget};
use keel_core::plan::hints;
use keel_core::ports::store::{
    BroadcastReport, CancelParams, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSelector, DeadLetterSkipParams, DeliveryOutcome, InsertOutcome, InsertParams,
    InstanceDetail, QueuePauseParams, SignalBroadcastParams, SignalDeliverParams,
    WORKER_STALE_AFTER, WorkerRecord,
};
use keel_core::ports::{Clock, Queue, Store};
use keel_core::{
    DeadLetterId, Instance, InstanceId, Status, StatusSet, StoreError, StoreResult, Timestamp,
};
use serde_json::Value;
use std::fmt;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// The longest [`Client::wait`] waits before it gives up.
pub const WAIT_MAX: Duration = Duration::from_secs(30 * 86_400);
/// The first pause of a wait's polling.
pub const WAIT_POLL_MIN: Duration = Duration::from_millis(5);
/// The shortest gap between two reads of a wait that store wake-ups cut short.
pub const WAIT_WAKE_GAP: Duration = Duration::from_millis(10);
/// The longest pause between two reads of a wait's polling.
pub const WAIT_POLL_MAX: Duration = Duration::from_millis(250);
/// How long a wait sees its instance runnable and due before it looks, once, whether a
/// live worker serves the instance's machine and version (see [`Client::wait_timeout`]).
pub const WAIT_UNSERVED_AFTER: Duration = Duration::from_secs(10);

/// A handle applications use to talk to Keel.
pub struct Client<S: Store, C: Clock> {
    store: Arc<S>,
    clock: C,
    /// Where starts and sends announce the work they made ready, if anywhere (shared by
    /// the client's clones, with its bound on publishes under way).
    publisher: Option<Arc<crate::worker::Publisher>>,
    /// The configuration file whose priorities and queue names fill what starts and
    /// sends leave unset, if any.
    settings: Option<Arc<KeelConfig>>,
}

/// Longest a start or send waits for its announcement on the queue of hints.
pub const ANNOUNCE_WAIT: Duration = Duration::from_millis(100);

impl<S: Store, C: Clock + Clone> Clone for Client<S, C> {
    fn clone(&self) -> Self {
        Client {
            store: Arc::clone(&self.store),
            clock: self.clock.clone(),
            publisher: self.publisher.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: Store, C: Clock> Client<S, C> {
    /// A client over `store`, reading time from `clock`.
    pub fn new(store: Arc<S>, clock: C) -> Self {
        Client { store, clock, publisher: None, settings: None }
    }

    /// The same client applying a configuration file to what it starts and sends: an
    /// instance started without an explicit priority or queue takes the file's (its
    /// machine's section, else `[queue]`; [`KeelConfig::start_defaults`]), and an event
    /// sent without a priority takes its event section's
    /// ([`KeelConfig::event_priority`]).
    #[must_use]
    pub fn with_settings(mut self, settings: KeelConfig) -> Self {
        self.settings = Some(Arc::new(settings));
        self
    }

    /// The configuration file this client applies, if it was given one.
    pub fn settings(&self) -> Option<&KeelConfig> {
        self.settings.as_deref()
    }

    /// The priorities the settings give the signals of a batch that carry none. A
    /// signal's machine is known from a business-key target; the other targets are looked
    /// up (their rows read [`keel_core::limits::ROWS_BATCH_MAX`] at a time), only for events some
    /// machine's section prioritizes.
    async fn event_priorities(&self, signals: &mut [NewSignal]) -> StoreResult<()> {
        let Some(settings) = &self.settings else { return Ok(()) };
        let wanted = |s: &NewSignal| s.priority.is_none() && settings.names_event_priority(&s.name);
        let mut ids: Vec<Option<InstanceId>> = Vec::with_capacity(signals.len());
        for s in signals.iter() {
            ids.push(match &s.target {
                _ if !wanted(s) => None,
                SignalTarget::Key { .. } => None,
                SignalTarget::Id(id) => Some(*id),
                child @ SignalTarget::Child { .. } => {
                    self.store.instance_lookup(child.clone()).await?
                }
            });
        }
        let mut read: Vec<InstanceId> = ids.iter().flatten().copied().collect();
        read.sort_unstable();
        read.dedup();
        // A batch may target more instances than one read returns.
        let mut machines = std::collections::HashMap::<InstanceId, String>::new();
        for chunk in read.chunks(keel_core::limits::ROWS_BATCH_MAX) {
            let rows = self.store.instance_rows(chunk.to_vec()).await?;
            machines.extend(rows.into_iter().map(|r| (r.id, r.machine.name)));
        }
        for (s, id) in signals.iter_mut().zip(ids) {
            if !wanted(s) {
                continue;
            }
            let machine = match (&s.target, id) {
                (SignalTarget::Key { machine, .. }, _) => Some(machine.as_str()),
                (_, Some(id)) => machines.get(&id).map(String::as_str),
                _ => None,
            };
            if let Some(machine) = machine {
                s.priority = settings.event_priority(machine, &s.name);
            }
        }
        Ok(())
    }

    /// The same client announcing the work its starts and sends make ready on `queue`
    /// (each new instance, delayed until it is due; each target a send woke), for workers
    /// that receive hints from it. The store stays the truth: the announcement follows the
    /// store call and its failure is only logged (the workers' repair pass finds the work).
    /// A delay longer than the queue keeps is not announced. At most
    /// [`PUBLISHES_MAX`](crate::worker::PUBLISHES_MAX) announcements of the client and its
    /// clones are under way at once; the hints of a start or send beyond them are dropped
    /// and counted ([`hints_dropped`](Self::hints_dropped)).
    #[must_use]
    pub fn with_queue(mut self, queue: Arc<dyn Queue>) -> Self {
        self.publisher = Some(Arc::new(crate::worker::Publisher::new(queue)));
        self
    }

    /// How many hints the client and its clones dropped because
    /// [`PUBLISHES_MAX`](crate::worker::PUBLISHES_MAX) announcements were already under
    /// way (a queue that answers slowly or not at all); the workers' polling and repair
    /// pass find their work.
    pub fn hints_dropped(&self) -> u64 {
        self.publisher.as_ref().map_or(0, |p| p.dropped())
    }

    /// Publishes `hints` when the client has a queue. The call waits for the queue at
    /// most [`ANNOUNCE_WAIT`]: a slow or unreachable queue finishes (or times out) in the
    /// background instead of adding its timeouts to every start and send.
    async fn announce(&self, hints: impl FnOnce() -> Vec<keel_core::ports::queue::Hint>) {
        if let Some(publisher) = &self.publisher {
            let hints = hints();
            if hints.is_empty() {
                return;
            }
            if let Some(publishing) = publisher.spawn(hints, drop) {
                let _ = tokio::time::timeout(ANNOUNCE_WAIT, publishing).await;
            }
        }
    }

    /// The store behind the client.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// The client's clock reading.
    pub(crate) fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// Starts one instance; the new id, or the occupant of its unique key.
    pub async fn start(&self, instance: NewInstance) -> StoreResult<InsertOutcome> {
        let mut out = self.start_many(vec![instance]).await.map_err(one_instance)?;
        out.pop().ok_or_else(|| StoreError::unavailable("store returned no insert outcome"))
    }

    /// Starts many instances in one batch; per item, new id or existing occupant.
    pub async fn start_many(
        &self,
        mut instances: Vec<NewInstance>,
    ) -> StoreResult<Vec<InsertOutcome>> {
        if let Some(settings) = &self.settings {
            for n in &mut instances {
                settings.start_defaults(n);
            }
        }
        let now = self.clock.now();
        let protos: Vec<_> = match self.publisher {
            Some(_) => instances.iter().map(|n| hints::for_new(n, now)).collect(),
            None => Vec::new(),
        };
        let out = self.store.instance_insert(InsertParams { instances, now }).await?;
        self.announce(|| hints::inserted(protos, &out)).await;
        Ok(out)
    }

    /// Sends one signal (event). `NotFound` when the target does not exist; a terminal
    /// target is reported as `TargetTerminal` and nothing is stored (it would never be
    /// processed).
    pub async fn send(&self, signal: NewSignal) -> StoreResult<DeliveryOutcome> {
        let target = signal.target.clone();
        let mut out = self.send_many(vec![signal]).await.map_err(one_signal)?;
        match out.pop() {
            Some(DeliveryOutcome::TargetMissing) => Err(StoreError::not_found(missing(&target))),
            Some(outcome) => Ok(outcome),
            None => Err(StoreError::unavailable("store returned no delivery outcome")),
        }
    }

    /// Sends many signals in one batch; per item, what happened.
    pub async fn send_many(
        &self,
        mut signals: Vec<NewSignal>,
    ) -> StoreResult<Vec<DeliveryOutcome>> {
        self.event_priorities(&mut signals).await?;
        let params = SignalDeliverParams { signals, now: self.clock.now() };
        let out = self.store.signal_deliver(params).await?;
        self.announce(|| hints::after_delivery(&out)).await;
        Ok(out)
    }

    /// Delivers one event to every non-terminal instance a [`Broadcast`] selects, in one
    /// store call.
    ///
    /// ```no_run
    /// # async fn demo<S: keel_core::ports::Store>(client: keel_scheduler::Client<S, keel_scheduler::SystemClock>) -> keel_core::StoreResult<()> {
    /// use keel_scheduler::client::Broadcast;
    /// let report = client
    ///     .broadcast(Broadcast::new("light", "NEXT").in_state("green"))
    ///     .await?;
    /// println!("{} lights got the event", report.delivered);
    /// # Ok(()) }
    /// ```
    pub async fn broadcast(&self, broadcast: Broadcast) -> StoreResult<BroadcastReport> {
        self.store.signal_broadcast(broadcast.into_params(self.clock.now())).await
    }

    /// Cancels what a [`Cancel`] describes; returns the ids it cancelled (empty when the
    /// instance had already ended).
    ///
    /// ```no_run
    /// # async fn demo<S: keel_core::ports::Store>(client: keel_scheduler::Client<S, keel_scheduler::SystemClock>, id: keel_core::InstanceId) -> keel_core::StoreResult<()> {
    /// use keel_scheduler::client::Cancel;
    /// client.cancel(Cancel::new(id).cascade().reason("customer changed their mind")).await?;
    /// # Ok(()) }
    /// ```
    pub async fn cancel(&self, cancel: Cancel) -> StoreResult<Vec<InstanceId>> {
        let params = CancelParams {
            id: cancel.id,
            reason: cancel.reason,
            cascade: cancel.cascade,
            now: self.clock.now(),
            only_in: cancel.only_in,
        };
        self.store.instance_cancel(params).await
    }

    /// Waits until instance `id` ends (done, failed or cancelled) and returns how it ended.
    /// It wakes on the store's change notifications where the store has them and polls
    /// with a back-off (a few milliseconds, growing to [`WAIT_POLL_MAX`]) otherwise.
    /// A suspended instance (its failure is a dead letter) has not ended: it waits for an
    /// operator. Gives up with an `Unavailable` error after [`WAIT_MAX`]; use
    /// [`wait_timeout`](Self::wait_timeout) for a shorter bound.
    pub async fn wait(&self, id: InstanceId) -> StoreResult<Ended> {
        match self.wait_timeout(id, WAIT_MAX).await? {
            Some(ended) => Ok(ended),
            None => Err(StoreError::unavailable(format!(
                "instance {id} has not ended after {} days of waiting; use wait_timeout to choose the bound",
                WAIT_MAX.as_secs() / 86_400
            ))),
        }
    }

    /// Like [`wait`](Self::wait), but returns `Ok(None)` when `id` is still running after
    /// `timeout`. `NotFound` when there is no such instance.
    ///
    /// A wait that has seen its instance runnable and due for [`WAIT_UNSERVED_AFTER`]
    /// looks once in the store's worker registry: when workers were seen within
    /// `WORKER_STALE_AFTER` but none of them serves the instance's machine and version in
    /// its namespace, it logs a warning naming them and the versions live workers do serve
    /// (an instance started in a version no worker registers waits until one does). With
    /// no live worker at all it says nothing (the workers may not have started yet). It
    /// keeps waiting either way.
    pub async fn wait_timeout(
        &self,
        id: InstanceId,
        timeout: Duration,
    ) -> StoreResult<Option<Ended>> {
        // A timeout past what the clock can hold (`Duration::MAX` for "no limit") waits
        // thirty years, as tokio's own far future does.
        let start = tokio::time::Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or_else(|| start + Duration::from_secs(30 * 365 * 86_400));
        let mut pause = WAIT_POLL_MIN;
        // Since when this wait has seen the instance runnable and due, until the one look
        // at the worker registry.
        let mut runnable_since: Option<tokio::time::Instant> = None;
        let mut looked = false;
        loop {
            // Listen before reading: polling the wake-up once registers this waiter with
            // the store, so a change that lands between the read and the wait still wakes it.
            let mut changed = self.store.instance_change_wait();
            let already =
                std::future::poll_fn(|cx| Poll::Ready(changed.as_mut().poll(cx).is_ready()));
            let mut changed_now = already.await;
            let read_at = tokio::time::Instant::now();
            let row = self.row(id).await?;
            if row.status.is_terminal() {
                return Ok(Some(Ended::from_row(row)));
            }
            if !looked {
                if keel_core::outcome::claimable(&row, self.clock.now()) {
                    let since = *runnable_since.get_or_insert(read_at);
                    if read_at.duration_since(since) >= WAIT_UNSERVED_AFTER {
                        looked = true;
                        self.warn_if_unserved(&row).await;
                    }
                } else {
                    runnable_since = None;
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let sleep_until = deadline.min(now + pause);
            if !changed_now {
                tokio::select! {
                    () = &mut changed => changed_now = true,
                    () = tokio::time::sleep_until(sleep_until) => {}
                }
            }
            // A wake-up reads again soon, but never sooner than WAIT_WAKE_GAP after the
            // last read: a store busy with other instances must not turn every waiter
            // into a busy loop. Only a quiet poll backs off further.
            if changed_now {
                tokio::time::sleep_until(deadline.min(read_at + WAIT_WAKE_GAP)).await;
                continue;
            }
            pause = (pause * 2).min(WAIT_POLL_MAX);
        }
    }

    /// Logs a warning when no live worker serves `row`'s machine and version in its
    /// namespace, naming the versions live workers serve; silent when one does, or when
    /// the store keeps no worker registry or cannot be read.
    async fn warn_if_unserved(&self, row: &Instance) {
        let live = match self.store.worker_list(self.clock.now().minus(WORKER_STALE_AFTER)).await {
            Ok(live) => live,
            Err(e) => {
                tracing::debug!(error = %e, "wait: the worker registry could not be read");
                return;
            }
        };
        if let Some(warning) = unserved_warning(row, &live) {
            tracing::warn!(
                instance = %row.id,
                machine = %row.machine.name,
                version = row.machine.version,
                namespace = %row.namespace,
                "{warning}"
            );
        }
    }

    /// The current state of instance `id`: its active chart configuration (or, for a step
    /// machine, its current step), like a statechart snapshot's value.
    pub async fn state(&self, id: InstanceId) -> StoreResult<StateValue> {
        Ok(StateValue::from_position(&self.row(id).await?.position))
    }

    async fn row(&self, id: InstanceId) -> StoreResult<Instance> {
        self.store
            .instance_rows(vec![id])
            .await?
            .pop()
            .ok_or_else(|| StoreError::not_found(missing(&SignalTarget::Id(id))))
    }

    /// An instance with its inbox, children and history.
    pub async fn get(&self, id: InstanceId) -> StoreResult<InstanceDetail> {
        self.store.instance_get(id).await
    }

    /// Resolves a business key to an instance id.
    pub async fn lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>> {
        self.store.instance_lookup(target).await
    }

    /// Dead letters matching `filter`, oldest first.
    pub async fn dead_letters(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        self.store.dead_letter_list(filter).await
    }

    /// Retries what a [`DeadLetterRetry`] selects: one dead letter, or every dead letter
    /// of a machine; returns the instances made runnable.
    ///
    /// ```no_run
    /// # async fn demo<S: keel_core::ports::Store>(client: keel_scheduler::Client<S, keel_scheduler::SystemClock>, id: keel_core::DeadLetterId) -> keel_core::StoreResult<()> {
    /// use keel_scheduler::client::DeadLetterRetry;
    /// use std::time::Duration;
    /// client.dead_letter_retry(DeadLetterRetry::one(id)).await?;
    /// client.dead_letter_retry(DeadLetterRetry::machine("order").after(Duration::from_secs(60))).await?;
    /// # Ok(()) }
    /// ```
    pub async fn dead_letter_retry(&self, retry: DeadLetterRetry) -> StoreResult<Vec<InstanceId>> {
        let params = DeadLetterRetryParams {
            selector: retry.selector,
            delay: retry.delay,
            now: self.clock.now(),
        };
        self.store.dead_letter_retry(params).await
    }

    /// Skips a dead letter: its signals are dropped and the instance carries on.
    pub async fn dead_letter_skip(&self, id: DeadLetterId) -> StoreResult<InstanceId> {
        self.store.dead_letter_skip(DeadLetterSkipParams { id, now: self.clock.now() }).await
    }

    /// Purges dead letters older than `age` in every namespace, at most
    /// [`keel_core::limits::DEAD_LETTER_BATCH_MAX`] per call (call again while it returns
    /// that many); returns how many went. For one namespace, purge machine by machine with
    /// `DeadLetterSelector::Machine` through the store. The letters of instances still
    /// suspended are kept, as the worker's retention, the CLI and the dashboard keep them:
    /// a letter is the only handle to retry its instance. To delete those too (their
    /// instances then stay suspended with nothing to retry them by; retry or cancel them
    /// first), call the store's `dead_letter_purge` with `keep_suspended: false`.
    pub async fn dead_letter_purge_older_than(&self, age: Duration) -> StoreResult<u64> {
        let params = DeadLetterPurgeParams {
            selector: None,
            older_than: Some(self.clock.now().minus(age)),
            keep_suspended: true,
        };
        self.store.dead_letter_purge(params).await
    }

    /// Pauses claiming from a queue (events still queue up).
    pub async fn queue_pause(&self, namespace: &str, queue: &str) -> StoreResult<()> {
        self.queue_set(namespace, queue, true).await
    }

    /// Resumes claiming from a queue. A queue that was never paused is left as it is (no
    /// settings are recorded for it).
    pub async fn queue_resume(&self, namespace: &str, queue: &str) -> StoreResult<()> {
        self.queue_set(namespace, queue, false).await
    }

    async fn queue_set(&self, namespace: &str, queue: &str, paused: bool) -> StoreResult<()> {
        let params = QueuePauseParams {
            namespace: namespace.to_owned(),
            queue: queue.to_owned(),
            paused,
            now: self.clock.now(),
        };
        self.store.queue_pause(params).await
    }
}

/// Cancels an instance: what [`Client::cancel`] takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    id: InstanceId,
    reason: String,
    cascade: bool,
    only_in: Option<StatusSet>,
}

impl Cancel {
    /// Cancels instance `id` alone, with the reason `"cancelled"`.
    pub fn new(id: InstanceId) -> Self {
        Cancel { id, reason: "cancelled".to_owned(), cascade: false, only_in: None }
    }

    /// Also cancels every non-terminal descendant (children it started, their children…).
    pub fn cascade(mut self) -> Self {
        self.cascade = true;
        self
    }

    /// The reason, recorded as the instance's last error.
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = reason.into();
        self
    }

    /// Cancels only if the instance is, when the cancel runs, in one of `statuses`;
    /// otherwise nothing is cancelled (an empty result). A tool that listed runnable
    /// instances and cancels them one by one passes `Runnable`, so an instance a worker
    /// claimed since the list was read is left to its step.
    pub fn only_in(mut self, statuses: StatusSet) -> Self {
        self.only_in = Some(statuses);
        self
    }
}

/// Which dead letters to retry, and when: what [`Client::dead_letter_retry`] takes.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterRetry {
    selector: DeadLetterSelector,
    delay: Duration,
}

impl DeadLetterRetry {
    /// Retries dead letter `id`, at once.
    pub fn one(id: DeadLetterId) -> Self {
        DeadLetterRetry { selector: DeadLetterSelector::Id(id), delay: Duration::ZERO }
    }

    /// Retries every dead letter of `machine` (any version) in the default namespace, at
    /// once.
    pub fn machine(machine: impl Into<String>) -> Self {
        let selector = DeadLetterSelector::Machine {
            namespace: keel_core::ids::DEFAULT_NAMESPACE.to_owned(),
            machine: machine.into(),
        };
        DeadLetterRetry { selector, delay: Duration::ZERO }
    }

    /// For [`machine`](Self::machine): the machine's namespace instead of the default one
    /// (no effect on a retry of one dead letter, which its id names already).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        if let DeadLetterSelector::Machine { namespace: ns, .. } = &mut self.selector {
            *ns = namespace.into();
        }
        self
    }

    /// Makes the instances runnable after `delay` instead of at once.
    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// An error about a batch of one, as the sender of that one signal reads it: the batch
/// names the signal's fields `signals[0].<field>` (`signals[0].dedup_key`), while the
/// caller passed one signal, or a command line or request body with a bare `dedup_key`.
fn one_signal(mut e: StoreError) -> StoreError {
    if let Some(bare) = e.message.strip_prefix("signals[0].") {
        e.message = bare.to_owned();
    }
    e
}

/// An error about a batch of one, as the starter of that one instance reads it: the batch
/// names the instance's fields `instances[0].<field>` (`instances[0].position`), while
/// [`Client::start`]'s caller passed one instance.
fn one_instance(mut e: StoreError) -> StoreError {
    if let Some(bare) = e.message.strip_prefix("instances[0].") {
        e.message = bare.to_owned();
    }
    e
}

/// What a wait logs when none of the `live` workers serves `row`'s machine and version in
/// its namespace; `None` when one does.
fn unserved_warning(row: &Instance, live: &[WorkerRecord]) -> Option<String> {
    let (ns, m) = (&row.namespace, &row.machine);
    // With no live worker at all the registry says nothing about versions: every worker
    // may be between beats of a clock that jumped (a test's virtual clock), or not started
    // yet; the warning is for a machine or version the running workers do not serve.
    if live.is_empty() || live.iter().any(|w| w.serves(ns, m)) {
        return None;
    }
    let mut versions: Vec<i32> = live
        .iter()
        .filter(|w| w.claims_from(ns))
        .flat_map(|w| &w.machines)
        .filter(|other| other.name == m.name)
        .map(|other| other.version)
        .collect();
    versions.sort_unstable();
    versions.dedup();
    let served = if versions.is_empty() {
        format!("no live worker serves any version of {:?} there", m.name)
    } else {
        let listed = versions.iter().map(|v| format!("v{v}")).collect::<Vec<_>>().join(", ");
        format!("live workers serve {:?} {listed} there", m.name)
    };
    Some(format!(
        "instance {} has been runnable for {} s and no live worker serves {:?} v{} in \
         namespace {ns:?} ({served}), so it waits until a worker registers that machine and \
         version; start a version a worker serves, or register v{} on a worker",
        row.id,
        WAIT_UNSERVED_AFTER.as_secs(),
        m.name,
        m.version,
        m.version
    ))
}

/// What [`Client::send`] (and [`Client::wait`] and [`Client::state`], given an id) says
/// when `target` is not there: the instance as the `keel` command line names it, and what
/// to check.
fn missing(target: &SignalTarget) -> String {
    match target {
        SignalTarget::Id(id) => format!(
            "no instance {id}; check the id (`keel list MACHINE` lists a machine's instances): \
             it is not in this store, or it ended and was pruned"
        ),
        SignalTarget::Key { namespace, machine, key } => format!(
            "no instance of machine {machine:?} with key {key:?} in namespace {namespace:?}; \
             check the machine, the key and the namespace, or start one with that business key"
        ),
        SignalTarget::Child { parent, state } => format!(
            "no child of {parent} started by state {state:?}; check that {parent} exists and \
             has entered that delegation state (its child starts then)"
        ),
    }
}

/// One event for every non-terminal instance of a machine: what [`Client::broadcast`]
/// takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Broadcast {
    namespace: String,
    machine: String,
    in_state: Option<String>,
    event: String,
    payload: Value,
    dedup_key: Option<String>,
}

impl Broadcast {
    /// `event` (payload `null`) for every non-terminal instance of `machine` (any
    /// version) in the default namespace.
    pub fn new(machine: impl Into<String>, event: impl Into<String>) -> Self {
        Broadcast {
            namespace: keel_core::ids::DEFAULT_NAMESPACE.to_owned(),
            machine: machine.into(),
            in_state: None,
            event: event.into(),
            payload: Value::Null,
            dedup_key: None,
        }
    }

    /// Only instances whose active configuration contains `state` (a dotted path).
    pub fn in_state(mut self, state: impl Into<String>) -> Self {
        self.in_state = Some(state.into());
        self
    }

    /// Instances of this namespace instead of the default one.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// The event's payload.
    pub fn payload(mut self, payload: Value) -> Self {
        self.payload = payload;
        self
    }

    /// A dedup key, applied per target: a target that still holds an event with this key
    /// does not get a second one.
    pub fn dedup_key(mut self, key: impl Into<String>) -> Self {
        self.dedup_key = Some(key.into());
        self
    }

    fn into_params(self, now: Timestamp) -> SignalBroadcastParams {
        SignalBroadcastParams {
            namespace: self.namespace,
            machine: self.machine,
            in_state: self.in_state,
            name: self.event,
            payload: self.payload,
            dedup_key: self.dedup_key,
            now,
        }
    }
}

/// How an instance ended: what [`Client::wait`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    /// `Done`, `Failed` or `Cancelled`.
    pub status: Status,
    /// The final state: a chart's final configuration, a step machine's last step.
    pub state: StateValue,
    /// The result context of a finished instance (`None` when it failed or was cancelled).
    pub result: Option<Value>,
    /// The last error: why it failed or was cancelled.
    pub error: Option<String>,
    /// The whole row, for everything else.
    pub instance: Instance,
}

impl Ended {
    fn from_row(row: Instance) -> Self {
        Ended {
            status: row.status,
            state: StateValue::from_position(&row.position),
            result: row.result.clone(),
            error: row.last_error.clone(),
            instance: row,
        }
    }

    /// Whether it finished with a result.
    pub fn is_done(&self) -> bool {
        self.status == Status::Done
    }

    /// The result deserialized as `T`.
    pub fn result_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_value(self.result.clone().unwrap_or(Value::Null))
    }
}

/// Where an instance is: the active states of a chart (every active state path, parents
/// included, sorted), or the current step of a step machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateValue {
    active: Vec<String>,
}

impl StateValue {
    /// Reads a stored position: a chart's JSON array of active paths, or a step name.
    pub fn from_position(position: &str) -> Self {
        let active = match serde_json::from_str::<Vec<String>>(position) {
            Ok(paths) if position.trim_start().starts_with('[') => paths,
            _ => vec![position.to_owned()],
        };
        StateValue { active }
    }

    /// Whether the state at the dotted `path` is active (`"processing"` and
    /// `"processing.payment"` both match inside `processing.payment.charging`).
    pub fn matches(&self, path: &str) -> bool {
        self.active.iter().any(|p| p == path)
    }

    /// Every active path, sorted.
    pub fn active(&self) -> &[String] {
        &self.active
    }

    /// The active states without an active child: the innermost ones.
    pub fn leaves(&self) -> Vec<&str> {
        self.active
            .iter()
            .filter(|p| {
                !self.active.iter().any(|q| {
                    q.len() > p.len() && q.starts_with(p.as_str()) && q.as_bytes()[p.len()] == b'.'
                })
            })
            .map(String::as_str)
            .collect()
    }
}

/// The innermost states, comma-separated (`closed`, `processing.inventory.done, processing.payment.charging`).
impl fmt::Display for StateValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.leaves().join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::StateValue;

    #[test]
    fn a_wait_warns_of_a_version_no_live_worker_serves() {
        use keel_core::ports::store::WorkerRecord;
        use keel_core::{Instance, InstanceId, MachineRef, Timestamp, WorkerId};
        let new = keel_core::instance::NewInstance::new(MachineRef::new("order", 2), "start");
        let row = Instance::from_new(InstanceId(7), &new, None, Timestamp(0));
        let worker = |namespaces: Vec<String>, machines: Vec<MachineRef>| WorkerRecord {
            id: WorkerId("w".into()),
            name: "w".into(),
            machines,
            namespaces,
            started_at: Timestamp(0),
            last_seen_at: Timestamp(0),
        };
        let v1 = worker(Vec::new(), vec![MachineRef::new("order", 1)]);
        let elsewhere = worker(vec!["other".into()], vec![MachineRef::new("order", 3)]);
        let warning = super::unserved_warning(&row, &[v1.clone(), elsewhere.clone()])
            .expect("no worker serves v2 in the default namespace");
        assert!(
            warning.starts_with(
                "instance i7 has been runnable for 10 s and no live worker serves \"order\" v2 \
                 in namespace \"default\" (live workers serve \"order\" v1 there)"
            ),
            "{warning}"
        );
        let none = super::unserved_warning(&row, std::slice::from_ref(&elsewhere))
            .expect("no worker serves order in the default namespace");
        assert!(none.contains("(no live worker serves any version of \"order\" there)"), "{none}");
        assert_eq!(super::unserved_warning(&row, &[]), None, "no live worker at all");
        let v2 = worker(Vec::new(), vec![MachineRef::new("order", 2)]);
        assert_eq!(super::unserved_warning(&row, &[v1, v2]), None);
    }

    #[test]
    fn state_value_reads_chart_and_step_positions() {
        let chart = StateValue::from_position(
            r#"["processing","processing.payment","processing.payment.charging","processing.stock"]"#,
        );
        assert!(chart.matches("processing.payment"));
        assert!(!chart.matches("processing.pay"));
        assert_eq!(chart.leaves(), ["processing.payment.charging", "processing.stock"]);
        assert_eq!(chart.to_string(), "processing.payment.charging, processing.stock");
        let step = StateValue::from_position("await_payment");
        assert!(step.matches("await_payment"));
        assert_eq!(step.to_string(), "await_payment");
    }
}
