//! The client API: what an application calls to start instances, send them events,
//! cancel them, look at them, and operate dead letters and queues. Works against any
//! `Store`; every call is one store round trip (batches stay batches).

use keel_core::instance::DeadLetter;
use keel_core::instance::{NewInstance, NewSignal, SignalTarget};
use keel_core::ports::store::{
    BroadcastReport, CancelParams, DeadLetterFilter, DeadLetterPurgeParams, DeadLetterRetryParams,
    DeadLetterSelector, DeadLetterSkipParams, DeliveryOutcome, InsertOutcome, InsertParams,
    InstanceDetail, QueuePauseParams, SignalBroadcastParams, SignalDeliverParams,
};
use keel_core::ports::{Clock, Store};
use keel_core::{DeadLetterId, InstanceId, StoreError, StoreResult};
use std::sync::Arc;
use std::time::Duration;

/// A handle applications use to talk to Keel.
pub struct Client<S: Store, C: Clock> {
    store: Arc<S>,
    clock: C,
}

impl<S: Store, C: Clock + Clone> Clone for Client<S, C> {
    fn clone(&self) -> Self {
        Client { store: Arc::clone(&self.store), clock: self.clock.clone() }
    }
}

impl<S: Store, C: Clock> Client<S, C> {
    /// A client over `store`, reading time from `clock`.
    pub fn new(store: Arc<S>, clock: C) -> Self {
        Client { store, clock }
    }

    /// The store behind the client.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// Starts one instance; the new id, or the occupant of its unique key.
    pub async fn start(&self, instance: NewInstance) -> StoreResult<InsertOutcome> {
        let mut out = self.start_many(vec![instance]).await?;
        out.pop().ok_or_else(|| StoreError::unavailable("store returned no insert outcome"))
    }

    /// Starts many instances in one batch; per item, new id or existing occupant.
    pub async fn start_many(&self, instances: Vec<NewInstance>) -> StoreResult<Vec<InsertOutcome>> {
        self.store.instance_insert(InsertParams { instances, now: self.clock.now() }).await
    }

    /// Sends one signal (event). `NotFound` when the target does not exist; a terminal
    /// target is reported as `TargetTerminal` and nothing is stored (it would never be
    /// processed).
    pub async fn send(&self, signal: NewSignal) -> StoreResult<DeliveryOutcome> {
        let target = signal.target.clone();
        let mut out = self.send_many(vec![signal]).await?;
        match out.pop() {
            Some(DeliveryOutcome::TargetMissing) => {
                Err(StoreError::not_found(format!("no instance for signal target {target:?}")))
            }
            Some(outcome) => Ok(outcome),
            None => Err(StoreError::unavailable("store returned no delivery outcome")),
        }
    }

    /// Sends many signals in one batch; per item, what happened.
    pub async fn send_many(&self, signals: Vec<NewSignal>) -> StoreResult<Vec<DeliveryOutcome>> {
        self.store.signal_deliver(SignalDeliverParams { signals, now: self.clock.now() }).await
    }

    /// Delivers `event` to every non-terminal instance of `machine` in `namespace` whose
    /// position is in `in_state` (`None` = all of them), in one store call.
    pub async fn broadcast(
        &self,
        namespace: &str,
        machine: &str,
        in_state: Option<&str>,
        event: &str,
        payload: serde_json::Value,
    ) -> StoreResult<BroadcastReport> {
        let params = SignalBroadcastParams {
            namespace: namespace.to_owned(),
            machine: machine.to_owned(),
            in_state: in_state.map(str::to_owned),
            name: event.to_owned(),
            payload,
            dedup_key: None,
            now: self.clock.now(),
        };
        self.store.signal_broadcast(params).await
    }

    /// Cancels an instance (with `cascade`, its non-terminal descendants too).
    pub async fn cancel(
        &self,
        id: InstanceId,
        reason: &str,
        cascade: bool,
    ) -> StoreResult<Vec<InstanceId>> {
        let params = CancelParams { id, reason: reason.to_owned(), cascade, now: self.clock.now() };
        self.store.instance_cancel(params).await
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

    /// Retries one dead letter after `delay`.
    pub async fn dead_letter_retry(
        &self,
        id: DeadLetterId,
        delay: Duration,
    ) -> StoreResult<Vec<InstanceId>> {
        let params = DeadLetterRetryParams {
            selector: DeadLetterSelector::Id(id),
            delay,
            now: self.clock.now(),
        };
        self.store.dead_letter_retry(params).await
    }

    /// Retries every dead letter of a machine after `delay`.
    pub async fn dead_letter_retry_machine(
        &self,
        namespace: &str,
        machine: &str,
        delay: Duration,
    ) -> StoreResult<Vec<InstanceId>> {
        let selector = DeadLetterSelector::Machine {
            namespace: namespace.to_owned(),
            machine: machine.to_owned(),
        };
        self.store
            .dead_letter_retry(DeadLetterRetryParams { selector, delay, now: self.clock.now() })
            .await
    }

    /// Skips a dead letter: its signals are dropped and the instance carries on.
    pub async fn dead_letter_skip(&self, id: DeadLetterId) -> StoreResult<InstanceId> {
        self.store.dead_letter_skip(DeadLetterSkipParams { id, now: self.clock.now() }).await
    }

    /// Purges dead letters older than `age`.
    pub async fn dead_letter_purge_older_than(&self, age: Duration) -> StoreResult<u64> {
        let params =
            DeadLetterPurgeParams { selector: None, older_than: Some(self.clock.now().minus(age)) };
        self.store.dead_letter_purge(params).await
    }

    /// Pauses claiming from a queue (events still queue up).
    pub async fn queue_pause(&self, namespace: &str, queue: &str) -> StoreResult<()> {
        self.queue_set(namespace, queue, true).await
    }

    /// Resumes claiming from a queue.
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
