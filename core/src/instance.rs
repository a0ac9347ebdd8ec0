//! The instance row and the values that travel with it: new instances, signals, children
//! summaries, history entries and dead letters. These are the store's logical schema.

use crate::error::{StoreError, StoreResult};
use crate::ids::{
    DEFAULT_NAMESPACE, DEFAULT_QUEUE, DeadLetterId, FencingToken, InstanceId, MachineRef, Priority,
    Revision, SignalId, Status, StatusSet, WorkerId,
};
use crate::limits;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The signal name that an `Await` uses to wake on any signal (chart instances park on it
/// between events). Delivered signals may not use it as their own name.
pub const ANY_SIGNAL: &str = "*";

/// The key of the marker object a store shows in place of a stored JSON value it cannot
/// read back (`{"keel_undecodable": {"column": …, "error": …}}`). Writers never write a
/// marker over the stored value, so nothing stored is lost; callers may not use the key.
pub const UNDECODABLE: &str = "keel_undecodable";

/// The marker for a stored `column` that could not be decoded, naming the decode error.
pub fn undecodable(column: &str, error: &str) -> Value {
    serde_json::json!({ UNDECODABLE: { "column": column, "error": clip_error(error) } })
}

/// For a marker made by [`undecodable`]: `"<column>: <error>"`; `None` for any other value.
pub fn undecodable_error(value: &Value) -> Option<String> {
    let inner = value.as_object().filter(|m| m.len() == 1)?.get(UNDECODABLE)?;
    let column = inner.get("column").and_then(Value::as_str).unwrap_or("a column");
    let error = inner.get("error").and_then(Value::as_str).unwrap_or("cannot be decoded");
    Some(format!("{column}: {error}"))
}

/// One error of one attempt, kept on the instance until the step progresses and copied
/// into the dead letter when retries are exhausted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptError {
    /// The attempt that failed (0-based).
    pub attempt: i32,
    /// The error message.
    pub error: String,
    /// When it failed.
    pub at: Timestamp,
}

/// A uniqueness claim: `key` is occupied while the instance's status is in `scope`.
/// The key is stored verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UniqueSpec {
    /// The user's key, verbatim.
    pub key: Vec<u8>,
    /// The statuses in which the key is occupied.
    pub scope: StatusSet,
}

/// The guard value of a uniqueness claim: the key while `status` is in scope, else `None`
/// (a generated column). Two instances may not have equal guards.
pub fn unique_guard(unique: Option<&UniqueSpec>, status: Status) -> Option<&[u8]> {
    unique.filter(|u| u.scope.contains(status)).map(|u| u.key.as_slice())
}

/// One instance: one aggregate, one row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    /// Store-assigned id.
    pub id: InstanceId,
    /// Tenancy boundary; workers and tokens are scoped to namespaces.
    pub namespace: String,
    /// The definition it runs, pinned for its whole life.
    pub machine: MachineRef,
    /// Optional business key (`order:abc123`), for addressing events.
    pub business_key: Option<String>,
    /// The queue it is claimed from.
    pub queue: String,
    /// Claim order under the `priority` strategy: the most urgent of
    /// [`base_priority`](Self::base_priority) and its pending signals' priorities
    /// ([`crate::inbox::claim_priority`]).
    pub priority: Priority,
    /// The priority it was started with, which its claim priority returns to once no
    /// more urgent signal is pending.
    #[serde(default)]
    pub base_priority: Priority,
    /// Instances sharing a key run one at a time.
    pub concurrency_key: Option<String>,
    /// Where it is in its life.
    pub status: Status,
    /// The current step (steps style) or the encoded active configuration (chart style).
    pub position: String,
    /// The JSON context (always an object).
    pub context: Value,
    /// The result of `Done`.
    pub result: Option<Value>,
    /// The signal name it awaits (`*` = any), kept after the wake-up for the step to see.
    pub awaits: Option<String>,
    /// The last error (`Stop` reason, exhausted retry, cancel reason).
    pub last_error: Option<String>,
    /// Attempts of the current step so far (0 on the first run).
    pub attempt: i32,
    /// The errors of the current step's failed attempts, oldest first.
    pub errors: Vec<AttemptError>,
    /// Accepted step commits so far.
    pub revision: Revision,
    /// Not claimable before this time.
    pub eligible_at: Timestamp,
    /// The worker holding the lease, while executing.
    pub lease_owner: Option<WorkerId>,
    /// When the lease runs out, while executing.
    pub lease_expires_at: Option<Timestamp>,
    /// The token of the latest claim.
    pub fencing_token: FencingToken,
    /// The parent that spawned it, if any.
    pub parent: Option<InstanceId>,
    /// Children not yet terminal that the parent's barrier waits on.
    pub children_pending: i32,
    /// For a child machine started by a chart's delegation state: that state's path in
    /// the parent. The child's terminal commit delivers `done.invoke.<path>` or
    /// `fail.state.<path>` into the parent's inbox.
    pub invoked_by: Option<String>,
    /// Its uniqueness claim, if any.
    pub unique: Option<UniqueSpec>,
    /// Correlation (conversation) id carried into dead letters, for tracing across machines.
    pub correlation_id: Option<String>,
    /// Insert time.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
}

impl Instance {
    /// What the store could not decode of this row (its context or result shown as an
    /// [`undecodable`] marker), or `None` for a whole row.
    pub fn damage(&self) -> Option<String> {
        undecodable_error(&self.context)
            .or_else(|| self.result.as_ref().and_then(undecodable_error))
    }

    /// The instance's uniqueness guard in its current status.
    pub fn unique_guard(&self) -> Option<&[u8]> {
        unique_guard(self.unique.as_ref(), self.status)
    }

    /// Builds the row a store inserts for `new`, with the given id, parent and time. Stores
    /// that assign ids themselves use this for everything else.
    pub fn from_new(
        id: InstanceId,
        new: &NewInstance,
        parent: Option<InstanceId>,
        now: Timestamp,
    ) -> Self {
        Instance {
            id,
            namespace: new.namespace.clone(),
            machine: new.machine.clone(),
            business_key: new.business_key.clone(),
            queue: new.queue.clone(),
            priority: new.priority,
            base_priority: new.priority,
            concurrency_key: new.concurrency_key.clone(),
            status: Status::Runnable,
            position: new.position.clone(),
            context: new.context.clone(),
            result: None,
            awaits: None,
            last_error: None,
            attempt: 0,
            errors: Vec::new(),
            revision: Revision(0),
            eligible_at: new.eligible_at.unwrap_or(now).max(now),
            lease_owner: None,
            lease_expires_at: None,
            fencing_token: FencingToken(0),
            parent,
            children_pending: 0,
            invoked_by: new.invoked_by.clone(),
            unique: new.unique.clone(),
            correlation_id: new.correlation_id.clone(),
            created_at: now,
            updated_at: now,
        }
    }
}

/// What a caller supplies to start an instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewInstance {
    /// Namespace (default `"default"`).
    pub namespace: String,
    /// The definition to run.
    pub machine: MachineRef,
    /// The first step, or the encoded initial configuration.
    pub position: String,
    /// The input context; must be a JSON object.
    pub context: Value,
    /// Optional business key.
    pub business_key: Option<String>,
    /// Queue (default `"default"`). Set it with the [`queue`](Self::queue) builder: a
    /// value assigned to this field directly is replaced by the queue a configuration file
    /// sets for the machine (`[queue] name`, or the machine's), when the client or worker
    /// starting it has one, unless [`given`](Self::given)`.queue` is set too.
    pub queue: String,
    /// Priority (default normal). Set it with the [`priority`](Self::priority) builder: a
    /// value assigned to this field directly is replaced by the priority a configuration
    /// file sets for the machine, when the client or worker starting it has one, unless
    /// [`given`](Self::given)`.priority` is set too.
    pub priority: Priority,
    /// Optional per-key serialization.
    pub concurrency_key: Option<String>,
    /// Optional uniqueness claim.
    pub unique: Option<UniqueSpec>,
    /// Not claimable before this time (a delayed start); `None` = now.
    pub eligible_at: Option<Timestamp>,
    /// Optional correlation id.
    pub correlation_id: Option<String>,
    /// For a child started by a chart delegation state: that state's path in the parent.
    pub invoked_by: Option<String>,
    /// Which of the keys a configuration file may fill the caller set explicitly (the
    /// [`queue`](Self::queue) and [`priority`](Self::priority) builders mark them).
    #[serde(default, skip_serializing_if = "Given::is_none")]
    pub given: Given,
}

/// The start keys a caller set explicitly, which a configuration file leaves alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Given {
    /// The queue was chosen by the caller.
    pub queue: bool,
    /// The priority was chosen by the caller.
    pub priority: bool,
}

impl Given {
    /// Whether the caller chose neither.
    pub fn is_none(&self) -> bool {
        !self.queue && !self.priority
    }
}

impl NewInstance {
    /// A new instance of `machine` starting at `position` with an empty context, in the
    /// default namespace and queue.
    pub fn new(machine: MachineRef, position: impl Into<String>) -> Self {
        NewInstance {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            machine,
            position: position.into(),
            context: Value::Object(serde_json::Map::new()),
            business_key: None,
            queue: DEFAULT_QUEUE.to_owned(),
            priority: Priority::Normal,
            concurrency_key: None,
            unique: None,
            eligible_at: None,
            correlation_id: None,
            invoked_by: None,
            given: Given::default(),
        }
    }

    /// Sets the context.
    pub fn context(mut self, context: Value) -> Self {
        self.context = context;
        self
    }
    /// Sets the context from a typed value (a struct or a map: contexts are JSON objects).
    pub fn context_of<C: Serialize>(self, context: &C) -> Result<Self, serde_json::Error> {
        Ok(self.context(serde_json::to_value(context)?))
    }
    /// Sets the namespace.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }
    /// Sets the queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self.given.queue = true;
        self
    }
    /// Sets the priority.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self.given.priority = true;
        self
    }
    /// Sets the business key.
    pub fn business_key(mut self, key: impl Into<String>) -> Self {
        self.business_key = Some(key.into());
        self
    }
    /// Sets the concurrency key.
    pub fn concurrency_key(mut self, key: impl Into<String>) -> Self {
        self.concurrency_key = Some(key.into());
        self
    }
    /// Sets the uniqueness claim.
    pub fn unique(mut self, key: impl Into<Vec<u8>>, scope: StatusSet) -> Self {
        self.unique = Some(UniqueSpec { key: key.into(), scope });
        self
    }
    /// Delays the first claim until `at`.
    pub fn eligible_at(mut self, at: Timestamp) -> Self {
        self.eligible_at = Some(at);
        self
    }
    /// Sets the correlation id.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }
    /// Marks the instance as the child machine of the parent's delegation state `path`.
    pub fn invoked_by(mut self, path: impl Into<String>) -> Self {
        self.invoked_by = Some(path.into());
        self
    }

    /// Checks names, sizes and the context shape. Errors name the field and the fix.
    pub fn validate(&self, field: &str) -> StoreResult<()> {
        self.validate_within(field, limits::JSON_DEPTH_MAX)
    }

    /// [`validate`](Self::validate) with another bound on the context's nesting (a step
    /// commit's children use [`limits::JSON_DEPTH_STORED_MAX`]).
    pub fn validate_within(&self, field: &str, depth_max: usize) -> StoreResult<()> {
        check_name(&format!("{field}.namespace"), &self.namespace)?;
        check_name(&format!("{field}.machine.name"), &self.machine.name)?;
        check_position(&format!("{field}.position"), &self.position)?;
        check_name(&format!("{field}.queue"), &self.queue)?;
        check_object_within(&format!("{field}.context"), &self.context, depth_max)?;
        for (name, value) in [
            ("business_key", &self.business_key),
            ("concurrency_key", &self.concurrency_key),
            ("correlation_id", &self.correlation_id),
            ("invoked_by", &self.invoked_by),
        ] {
            if let Some(v) = value {
                check_name(&format!("{field}.{name}"), v)?;
            }
        }
        if let Some(at) = self.eligible_at
            && at > limits::TIMESTAMP_MAX
        {
            return Err(StoreError::invalid(format!(
                "{field}.eligible_at: {} ms since the epoch is after the latest allowed time {} (the end of year 9999); pick a real date, or park the instance on a signal instead",
                at.0,
                limits::TIMESTAMP_MAX.0
            )));
        }
        if let Some(u) = &self.unique
            && (u.key.is_empty() || u.key.len() > limits::NAME_BYTES_MAX)
        {
            return Err(StoreError::invalid(format!(
                "{field}.unique.key: must be 1 to {} bytes (got {})",
                limits::NAME_BYTES_MAX,
                u.key.len()
            )));
        }
        Ok(())
    }
}

/// Where a signal goes: an instance id, or a business key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SignalTarget {
    /// By instance id.
    Id(InstanceId),
    /// By `(namespace, machine name, business key)`: the newest instance with that key.
    Key {
        /// Namespace.
        namespace: String,
        /// Machine name (any version).
        machine: String,
        /// Business key.
        key: String,
    },
    /// The child machine `parent` started from its delegation state `state` (the newest,
    /// when the state was entered more than once).
    Child {
        /// The parent instance.
        parent: InstanceId,
        /// The parent's delegation state path.
        state: String,
    },
}

impl From<InstanceId> for SignalTarget {
    fn from(id: InstanceId) -> Self {
        SignalTarget::Id(id)
    }
}

/// How the dedup keys of the engine's own signals begin, each with what it keys: a
/// timer's fires ([`crate::timers::FIRE_KEY_PREFIX`]) and a child machine's notice to its
/// parent ([`crate::outcome::NOTICE_KEY_PREFIX`]). The engine tells those signals from a
/// sender's by this prefix (an unread fire is withdrawn when its state is left; a second
/// fire or notice under a taken key is a duplicate), so a sender's signal may not use one
/// ([`NewSignal::validate`]).
pub const RESERVED_DEDUP_KEY_PREFIXES: [(&str, &str); 2] = [
    (crate::timers::FIRE_KEY_PREFIX, "timer fires"),
    (crate::outcome::NOTICE_KEY_PREFIX, "a child machine's notice to its parent"),
];

/// How the names of the engine's own chart events begin: a state's completion
/// (`done.state.<path>`), a child machine's end (`done.invoke.<path>`, `fail.state.<path>`),
/// a delegation's `@timeout` (`timeout.invoke.<path>`) and a parallel state's region timeout
/// (`parallel.timeout.<path>`). Those events fire `@done`, `@fail` and `@timeout`, so a
/// sender's signal may not use one ([`NewSignal::validate`]): it would fire them early.
/// A region's report (`parallel.region`) is sent through the same path as a sender's
/// signal, and its payload is checked on arrival, so it stays allowed.
pub const RESERVED_SIGNAL_NAME_PREFIXES: [&str; 5] = [
    crate::chart::DONE_STATE,
    crate::chart::DONE_INVOKE,
    crate::chart::FAIL_STATE,
    crate::chart::TIMEOUT_INVOKE,
    crate::chart::step::TIMEOUT_EVENT_PREFIX,
];

/// Whether `name` is one of the engine's own chart events: one beginning with a
/// [`RESERVED_SIGNAL_NAME_PREFIXES`] prefix, or a region's report.
pub fn is_engine_event(name: &str) -> bool {
    name == crate::chart::step::REGION_REPORT_EVENT
        || RESERVED_SIGNAL_NAME_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// A signal (or chart event) to deliver into an instance's inbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewSignal {
    /// Where it goes.
    pub target: SignalTarget,
    /// Its name (the event type).
    pub name: String,
    /// Its payload (any JSON value).
    pub payload: Value,
    /// Optional dedup key: a second signal with the same key for the same target is a
    /// duplicate and is not stored again.
    pub dedup_key: Option<String>,
    /// How urgent it is: while it is pending, its instance is claimed at this priority
    /// when that is more urgent than the instance's own. `None` = no urgency of its own.
    #[serde(default)]
    pub priority: Option<Priority>,
}

impl NewSignal {
    /// A signal with a null payload and no dedup key.
    pub fn new(target: impl Into<SignalTarget>, name: impl Into<String>) -> Self {
        NewSignal {
            target: target.into(),
            name: name.into(),
            payload: Value::Null,
            dedup_key: None,
            priority: None,
        }
    }
    /// Sets the payload.
    pub fn payload(mut self, payload: Value) -> Self {
        self.payload = payload;
        self
    }
    /// Sets the payload from a typed value.
    pub fn payload_of<P: Serialize>(self, payload: &P) -> Result<Self, serde_json::Error> {
        Ok(self.payload(serde_json::to_value(payload)?))
    }
    /// Sets the dedup key.
    pub fn dedup_key(mut self, key: impl Into<String>) -> Self {
        self.dedup_key = Some(key.into());
        self
    }
    /// Sets the priority (see [`NewSignal::priority`]).
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Checks the name, dedup key and payload size.
    pub fn validate(&self, field: &str) -> StoreResult<()> {
        self.validate_within(field, limits::JSON_DEPTH_MAX)
    }

    /// [`validate`](Self::validate) with another bound on the payload's nesting (a step
    /// commit's emits use [`limits::JSON_DEPTH_STORED_MAX`]).
    ///
    /// Every signal a sender gives goes through here (a delivery, a broadcast, a step's
    /// emits); the engine's own signals (timer fires, a child's notice to its parent) are
    /// built by the core and never do, so the names of the engine's own events
    /// ([`RESERVED_SIGNAL_NAME_PREFIXES`]) and the dedup-key prefixes that tell its signals
    /// apart ([`RESERVED_DEDUP_KEY_PREFIXES`]) are refused here.
    pub fn validate_within(&self, field: &str, depth_max: usize) -> StoreResult<()> {
        check_name(&format!("{field}.name"), &self.name)?;
        if self.name == ANY_SIGNAL {
            return Err(StoreError::invalid(format!(
                "{field}.name: \"{ANY_SIGNAL}\" is reserved for awaiting any signal; use a real event name"
            )));
        }
        if let Some(prefix) =
            RESERVED_SIGNAL_NAME_PREFIXES.iter().find(|prefix| self.name.starts_with(*prefix))
        {
            return Err(StoreError::invalid(format!(
                "{field}.name: {:?} begins with {prefix:?}, which is reserved for the engine's \
                 own events (it would fire `@done`, `@fail` or `@timeout` early); use another \
                 event name",
                self.name
            )));
        }
        if let Some(k) = &self.dedup_key {
            check_name(&format!("{field}.dedup_key"), k)?;
            if let Some((prefix, owner)) =
                RESERVED_DEDUP_KEY_PREFIXES.iter().find(|(prefix, _)| k.starts_with(prefix))
            {
                return Err(StoreError::invalid(format!(
                    "{field}.dedup_key: {k:?} begins with {prefix:?}, which is reserved for \
                     {owner} (the engine would take this signal for one); use another prefix"
                )));
            }
        }
        match &self.target {
            SignalTarget::Id(_) => {}
            SignalTarget::Key { namespace, machine, key } => {
                check_name(&format!("{field}.target.namespace"), namespace)?;
                check_name(&format!("{field}.target.machine"), machine)?;
                check_name(&format!("{field}.target.key"), key)?;
            }
            SignalTarget::Child { state, .. } => {
                check_name(&format!("{field}.target.state"), state)?;
            }
        }
        check_size_within(&format!("{field}.payload"), &self.payload, depth_max)
    }
}

/// A stored signal in an inbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Signal {
    /// Its id; ids increase in arrival order.
    pub id: SignalId,
    /// The instance whose inbox holds it.
    pub target: InstanceId,
    /// Its name.
    pub name: String,
    /// Its payload.
    pub payload: Value,
    /// Its dedup key.
    pub dedup_key: Option<String>,
    /// Its priority, when the sender gave one.
    #[serde(default)]
    pub priority: Option<Priority>,
    /// When it arrived.
    pub inserted_at: Timestamp,
}

impl Signal {
    /// The payload deserialized as `P`, or serde's error, which names neither the event
    /// nor the signal. A payload that does not fit never will, however often a step is
    /// retried: a runtime's typed reader should fail the step for good, naming both.
    pub fn payload_as<P: serde::de::DeserializeOwned>(&self) -> Result<P, serde_json::Error> {
        serde_json::from_value(self.payload.clone())
    }

    /// The event as a dead letter and a discard record show it: `{"name", "payload"}`.
    pub fn event_json(&self) -> Value {
        serde_json::json!({ "name": self.name, "payload": self.payload })
    }
}

/// Whether an instance at `position` is "in" `state`: the position is the state itself
/// (step machines), or a JSON array of active state paths that contains it (charts).
pub fn position_in_state(position: &str, state: &str) -> bool {
    if position == state {
        return true;
    }
    chart_paths(position)
        .is_some_and(|paths| paths.is_ok_and(|paths| paths.iter().any(|p| p == state)))
}

/// A position read as a chart's configuration: `None` when it does not start with `[`
/// (a step's or state's name), else the JSON array of active paths it should be.
fn chart_paths(position: &str) -> Option<Result<Vec<String>, serde_json::Error>> {
    position.starts_with('[').then(|| serde_json::from_str::<Vec<String>>(position))
}

/// What a parent sees of a child after its barrier released.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildSummary {
    /// The child's id.
    pub id: InstanceId,
    /// Its machine.
    pub machine: MachineRef,
    /// Its status.
    pub status: Status,
    /// Its position.
    pub position: String,
    /// Its context.
    pub context: Value,
    /// Its result, when done.
    pub result: Option<Value>,
    /// Its last error, when failed or cancelled.
    pub last_error: Option<String>,
}

impl ChildSummary {
    /// The summary of a child row.
    pub fn of(child: &Instance) -> Self {
        ChildSummary {
            id: child.id,
            machine: child.machine.clone(),
            status: child.status,
            position: child.position.clone(),
            context: child.context.clone(),
            result: child.result.clone(),
            last_error: child.last_error.clone(),
        }
    }
}

/// A history entry to append (the store adds instance, time, attempt and revision).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    /// What happened: `STEP_NEXT`, `EVENT_UNHANDLED`, `LEASE_EXPIRED`, `TIMER_FIRED`, …
    pub kind: String,
    /// Details, as the kind defines.
    pub data: Value,
}

impl HistoryEntry {
    /// Builds an entry.
    pub fn new(kind: impl Into<String>, data: Value) -> Self {
        HistoryEntry { kind: kind.into(), data }
    }
}

/// A stored history row (append-only audit trail).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryRecord {
    /// The instance it belongs to.
    pub instance: InstanceId,
    /// Sequence number within the store; increases with time.
    pub seq: i64,
    /// When it was recorded.
    pub at: Timestamp,
    /// The instance's revision after the change it records.
    pub revision: Revision,
    /// The attempt it was recorded in.
    pub attempt: i32,
    /// Kind and details.
    pub entry: HistoryEntry,
}

/// A dead letter before the store assigns it an id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewDeadLetter {
    /// The instance that failed.
    pub instance: InstanceId,
    /// Its namespace.
    pub namespace: String,
    /// Its machine.
    pub machine: MachineRef,
    /// The step (or configuration) it failed in.
    pub position: String,
    /// The inbox signals the failing step was processing; `skip` consumes them.
    pub signals: Vec<SignalId>,
    /// The failing event (name and payload), when the step processed one.
    pub event: Option<Value>,
    /// The instance's correlation id.
    pub correlation_id: Option<String>,
    /// Why it was dead-lettered: `exhausted` or `non_retryable`.
    pub reason: String,
    /// How many attempts failed, the last one included (a step's own polls with
    /// `Outcome::Retry` are not failures and are not counted).
    pub attempts: i32,
    /// Every attempt's error, oldest first.
    pub errors: Vec<AttemptError>,
    /// First attempt's failure time.
    pub first_attempt_at: Timestamp,
    /// Last attempt's failure time.
    pub last_attempt_at: Timestamp,
}

/// A stored dead letter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Its id.
    pub id: DeadLetterId,
    /// When it was recorded.
    pub created_at: Timestamp,
    /// Everything needed to debug and replay.
    pub letter: NewDeadLetter,
}

/// A name-like field check: non-empty, at most [`limits::NAME_BYTES_MAX`] bytes, no NUL.
pub fn check_name(field: &str, value: &str) -> StoreResult<()> {
    if value.is_empty() {
        return Err(StoreError::invalid(format!("{field}: must not be empty")));
    }
    check_text(field, value)?;
    if value.len() > limits::NAME_BYTES_MAX {
        return Err(StoreError::invalid(format!(
            "{field}: is {} bytes; the limit is {} bytes",
            value.len(),
            limits::NAME_BYTES_MAX
        )));
    }
    Ok(())
}

/// A position check: a name ([`check_name`]) that, when it starts with `[`, is a chart's
/// JSON array of active state paths, since that is how every reader
/// ([`position_in_state`], the stores' state filters) takes such a position. A step or
/// state named `[x` would be stored as-is and then break those readers.
pub fn check_position(field: &str, value: &str) -> StoreResult<()> {
    check_name(field, value)?;
    match chart_paths(value) {
        Some(Err(_)) => Err(StoreError::invalid(format!(
            "{field}: {value:?} starts with `[`, which marks a chart's JSON array of active \
             states (like [\"a.b\",\"c\"]), but is not one; a step or state name cannot \
             start with `[`"
        ))),
        // `check_name` saw no NUL in the text, but JSON can write one as `\u0000`, and
        // PostgreSQL cannot read such JSON as `jsonb`.
        Some(Ok(paths)) if paths.iter().any(|p| p.contains('\0')) => Err(StoreError::invalid(
            format!("{field}: {value:?} holds a state path with a NUL character (\\u0000)"),
        )),
        None | Some(Ok(_)) => Ok(()),
    }
}

/// Checks that `value` is a JSON object within the payload size limit.
pub fn check_object(field: &str, value: &Value) -> StoreResult<()> {
    check_object_within(field, value, limits::JSON_DEPTH_MAX)
}

/// [`check_object`] with another depth bound.
pub fn check_object_within(field: &str, value: &Value, depth_max: usize) -> StoreResult<()> {
    if !value.is_object() {
        return Err(StoreError::invalid(format!(
            "{field}: must be a JSON object like {{\"key\": \"value\"}} (got {})",
            json_type(value)
        )));
    }
    check_size_within(field, value, depth_max)
}

/// Checks that a text field has no NUL character. Some stores (PostgreSQL) cannot hold one
/// in text or JSON at all, so every store refuses it at the door to behave the same.
pub fn check_text(field: &str, value: &str) -> StoreResult<()> {
    match value.find('\0') {
        Some(at) => Err(StoreError::invalid(format!(
            "{field}: contains a NUL character (\\0) at byte {at}; remove it, or encode binary data (base64, hex) before passing it to Keel"
        ))),
        None => Ok(()),
    }
}

/// Checks a JSON value a caller hands Keel: nested at most [`limits::JSON_DEPTH_MAX`]
/// levels, no NUL character in any string or key, and not an object carrying the reserved
/// [`UNDECODABLE`] key (stores use it to mark values they cannot read back). Walks the value
/// with an explicit stack, so a hostile value cannot exhaust the call stack here.
pub fn check_json(field: &str, value: &Value) -> StoreResult<()> {
    check_json_within(field, value, limits::JSON_DEPTH_MAX)
}

/// [`check_json`] with another depth bound (a commit's is [`limits::JSON_DEPTH_STORED_MAX`]).
pub fn check_json_within(field: &str, value: &Value, depth_max: usize) -> StoreResult<()> {
    if let Value::Object(map) = value
        && map.contains_key(UNDECODABLE)
    {
        return Err(StoreError::invalid(format!(
            "{field}: the key \"{UNDECODABLE}\" is reserved for values a store cannot read back; rename it"
        )));
    }
    walk_json(field, value, depth_max, true)
}

/// Checks only the nesting of `value` (and its size): for records Keel writes itself, such
/// as history data and a dead letter's failing event, whose NUL characters are replaced
/// ([`scrub_nul`]) rather than refused.
pub fn check_record_within(field: &str, value: &Value, depth_max: usize) -> StoreResult<()> {
    walk_json(field, value, depth_max, false)?;
    check_bytes(field, value)
}

/// `value` with every NUL character in its strings and keys replaced by U+FFFD.
pub fn scrub_nul(value: &Value) -> Value {
    match value {
        Value::String(s) if s.contains('\0') => Value::String(s.replace('\0', "\u{fffd}")),
        Value::Array(items) => Value::Array(items.iter().map(scrub_nul).collect()),
        Value::Object(map) => Value::Object(
            map.iter().map(|(k, v)| (k.replace('\0', "\u{fffd}"), scrub_nul(v))).collect(),
        ),
        other => other.clone(),
    }
}

fn walk_json(field: &str, value: &Value, depth_max: usize, refuse_nul: bool) -> StoreResult<()> {
    let mut stack: Vec<(&Value, usize)> = vec![(value, 0)];
    while let Some((v, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::String(s) => {
                if refuse_nul {
                    check_text(field, s)?;
                }
                continue;
            }
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(map) => {
                for key in map.keys().filter(|_| refuse_nul) {
                    check_text(&format!("{field} (an object key)"), key)?;
                }
                Box::new(map.values())
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => continue,
        };
        if depth + 1 > depth_max {
            return Err(StoreError::invalid(format!(
                "{field}: JSON is nested deeper than {depth_max} levels of arrays and objects; flatten it (stores and JSON readers cannot read such values back)"
            )));
        }
        stack.extend(children.map(|c| (c, depth + 1)));
    }
    Ok(())
}

/// Checks that `value` is a well-formed JSON value for Keel ([`check_json`]) that serializes
/// within [`limits::PAYLOAD_BYTES_MAX`].
pub fn check_size(field: &str, value: &Value) -> StoreResult<()> {
    check_size_within(field, value, limits::JSON_DEPTH_MAX)
}

/// [`check_size`] with another depth bound.
pub fn check_size_within(field: &str, value: &Value, depth_max: usize) -> StoreResult<()> {
    check_json_within(field, value, depth_max)?;
    check_bytes(field, value)
}

fn check_bytes(field: &str, value: &Value) -> StoreResult<()> {
    let len = serde_json::to_vec(value).map_or(usize::MAX, |v| v.len());
    if len > limits::PAYLOAD_BYTES_MAX {
        return Err(StoreError::invalid(format!(
            "{field}: is {len} bytes of JSON; the limit is {} bytes — keep large data outside Keel and store a reference",
            limits::PAYLOAD_BYTES_MAX
        )));
    }
    Ok(())
}

/// Checks a batch length against its bound.
pub fn check_batch(field: &str, len: usize, max: usize) -> StoreResult<()> {
    if len > max {
        return Err(StoreError::invalid(format!(
            "{field}: {len} items is over the limit of {max}; split the batch"
        )));
    }
    Ok(())
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Cuts an error message to [`limits::ERROR_MESSAGE_BYTES_MAX`] at a char boundary, and
/// replaces NUL characters (which not every store can hold) with U+FFFD. Error messages come
/// from anywhere, so they are cleaned rather than refused: refusing one would lose the
/// failure it reports.
pub fn clip_error(message: &str) -> String {
    if message.contains('\0') {
        return clip_error(&message.replace('\0', "\u{fffd}"));
    }
    if message.len() <= limits::ERROR_MESSAGE_BYTES_MAX {
        return message.to_owned();
    }
    let mut end = limits::ERROR_MESSAGE_BYTES_MAX;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}
