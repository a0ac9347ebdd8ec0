//! Step outcomes and the pure reference transitions of an instance row.
//!
//! Every store must change its rows exactly as these functions say; the in-memory store
//! calls them directly and the conformance suite holds the real backends to the same
//! results. The functions take the facts a store knows only at commit time (is a matching
//! signal waiting in the inbox, how many children did uniqueness let in) as arguments, so
//! they stay pure.

use crate::chart::{Event, TimerArm};
use crate::error::{StoreError, StoreResult};
use crate::history::HistoryKind;
use crate::ids::{FencingToken, InstanceId, Revision, SignalId, Status, WorkerId};
use crate::instance::{
    ANY_SIGNAL, AttemptError, HistoryEntry, Instance, NewDeadLetter, NewInstance, NewSignal,
    Signal, check_batch, check_name, check_object_within, check_position, check_record_within,
    check_size_within, clip_error, scrub_nul,
};
use crate::join::{JOIN_KEY, Join};
use crate::limits;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::time::Duration;

/// What a step (or the error handler) returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Outcome {
    /// Move to `step` with the new context; runnable now; attempt reset.
    Next {
        /// The next step.
        step: String,
        /// The new context.
        context: Value,
    },
    /// Run the same step again after `delay`; attempt + 1. The instance keeps what it
    /// awaited, so the next attempt processes (and on success consumes) the same signals.
    Retry {
        /// The context to retry with.
        context: Value,
        /// How long to wait.
        #[serde(with = "duration_ms")]
        delay: Duration,
    },
    /// Park until a signal named `signal` (or any signal, for `*`) arrives; runnable at
    /// once if one is already in the inbox (no lost wake-up). With `step`, move there
    /// first (a chart instance parks at its new configuration after every event).
    Await {
        /// The awaited signal name, or `*` for any.
        signal: String,
        /// The context to park with.
        context: Value,
        /// The step (or encoded configuration) to park at; `None` stays at the current one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        step: Option<String>,
    },
    /// Spawn `children` and park until the join says the parent wakes (by default, when
    /// every child is terminal); then run `next`. Zero children inserted (uniqueness may
    /// drop some) ⇒ runnable at `next` at once. Build it with
    /// [`Outcome::schedule_children`] and, for a quorum or a deadline,
    /// [`Outcome::with_join`].
    ScheduleChildren {
        /// The step to run once the barrier releases.
        next: String,
        /// The children to spawn.
        children: Vec<NewInstance>,
        /// The context to park with.
        context: Value,
        /// When the parent wakes, and what becomes of the children still running then
        /// (default: when all have ended).
        #[serde(default, skip_serializing_if = "is_default_join")]
        join: Join,
    },
    /// Finish with a result (the context is not rewritten). With `step`, move there
    /// first: a chart instance finishes at its final configuration, so its position says
    /// which final state it reached.
    Done {
        /// The result.
        result: Value,
        /// The step (or encoded final configuration) to finish at; `None` stays at the
        /// current one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        step: Option<String>,
    },
    /// Finish as failed with a reason.
    Stop {
        /// Why.
        reason: String,
    },
    /// Retries are exhausted (or the error is not retryable): park as `suspended` until an
    /// operator retries, skips or cancels. The commit must carry a dead-lettering
    /// [`StepFailure`]. Produced by the engine's retry policy, not by user steps.
    Suspend,
}

fn is_default_join(join: &Join) -> bool {
    *join == Join::default()
}

impl Outcome {
    /// [`Outcome::ScheduleChildren`] waiting for all `children` to end, then running `next`.
    pub fn schedule_children(
        next: impl Into<String>,
        children: Vec<NewInstance>,
        context: Value,
    ) -> Outcome {
        Outcome::ScheduleChildren { next: next.into(), children, context, join: Join::default() }
    }

    /// The same outcome with `join` as its join policy: a quorum, a deadline, and what
    /// becomes of the children still running when the parent wakes. Only
    /// [`Outcome::ScheduleChildren`] has a join; any other outcome is returned unchanged.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_core::{NewInstance, MachineRef, Outcome};
    /// use keel_core::join::Join;
    /// use serde_json::json;
    ///
    /// let quotes = (0..5).map(|_| NewInstance::new(MachineRef::new("quote", 1), "ask")).collect();
    /// let outcome = Outcome::schedule_children("compare", quotes, json!({}))
    ///     .with_join(Join::quorum(3).within(Duration::from_secs(30)));
    /// ```
    #[must_use]
    pub fn with_join(mut self, policy: Join) -> Outcome {
        if let Outcome::ScheduleChildren { join, .. } = &mut self {
            *join = policy;
        }
        self
    }

    /// [`Outcome::Next`] with a typed context, serialized.
    pub fn next_with<C: Serialize>(
        step: impl Into<String>,
        context: &C,
    ) -> Result<Outcome, serde_json::Error> {
        Ok(Outcome::Next { step: step.into(), context: serde_json::to_value(context)? })
    }

    /// [`Outcome::Await`] of `signal`, staying at the current step, with a typed context.
    pub fn await_with<C: Serialize>(
        signal: impl Into<String>,
        context: &C,
    ) -> Result<Outcome, serde_json::Error> {
        let context = serde_json::to_value(context)?;
        Ok(Outcome::Await { signal: signal.into(), context, step: None })
    }

    /// [`Outcome::Done`] with a typed result, serialized, staying at the current step.
    pub fn done_with<R: Serialize>(result: &R) -> Result<Outcome, serde_json::Error> {
        Ok(Outcome::Done { result: serde_json::to_value(result)?, step: None })
    }

    /// The outcome's snake_case name.
    pub const fn name(&self) -> &'static str {
        match self {
            Outcome::Next { .. } => "next",
            Outcome::Retry { .. } => "retry",
            Outcome::Await { .. } => "await",
            Outcome::ScheduleChildren { .. } => "schedule_children",
            Outcome::Done { .. } => "done",
            Outcome::Stop { .. } => "stop",
            Outcome::Suspend => "suspend",
        }
    }

    /// The context the outcome writes, if it writes one.
    pub fn context(&self) -> Option<&Value> {
        match self {
            Outcome::Next { context, .. }
            | Outcome::Retry { context, .. }
            | Outcome::Await { context, .. }
            | Outcome::ScheduleChildren { context, .. } => Some(context),
            Outcome::Done { .. } | Outcome::Stop { .. } | Outcome::Suspend => None,
        }
    }
}

mod duration_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// The failure behind a commit, when the step errored: its message is kept with the
/// attempt, and it may dead-letter the step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepFailure {
    /// The error message.
    pub error: String,
    /// Whether the error was retryable (decides the dead letter's reason).
    pub retryable: bool,
    /// Whether this failure produces a dead letter (always with `Suspend`; with a
    /// progressing outcome under `on_dead_letter = skip`).
    pub dead_letter: bool,
    /// The inbox signals the failing step was processing.
    pub signals: Vec<SignalId>,
    /// The failing event (name and payload), when there was one.
    pub event: Option<Value>,
}

impl StepFailure {
    /// The failure of a step, before its plan decides on a dead letter: it names the one
    /// event the step was processing (`processing`, a chart's transition), whose name and
    /// payload it keeps, or else every signal of the `inbox` it was claimed with.
    pub fn of_step(
        error: impl Into<String>,
        retryable: bool,
        processing: Option<&Signal>,
        inbox: &[Signal],
    ) -> Self {
        Self {
            error: error.into(),
            retryable,
            dead_letter: false,
            signals: processing
                .map_or_else(|| inbox.iter().map(|s| s.id).collect(), |s| vec![s.id]),
            event: processing.map(Signal::event_json),
        }
    }
}

/// One step's result, committed atomically: the outcome, the signals it consumed, the
/// events it emitted to other instances (outbox), and history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepCommit {
    /// The instance.
    pub id: InstanceId,
    /// The token of the claim this result belongs to.
    pub token: FencingToken,
    /// What the step decided.
    pub outcome: Outcome,
    /// Inbox signals the step saw and consumed; deleted in the same commit. Ids that are
    /// no longer in the inbox are ignored.
    pub consume: Vec<SignalId>,
    /// Events for other instances, inserted in the same commit (transactional outbox).
    pub emit: Vec<NewSignal>,
    /// History entries to append before the engine's own outcome entry.
    pub history: Vec<HistoryEntry>,
    /// The error, when the step failed.
    pub failure: Option<StepFailure>,
    /// Child instances to start in the same commit without parking on a barrier (chart
    /// delegation states); their `parent` is this instance. Uniqueness applies.
    #[serde(default)]
    pub spawn: Vec<NewInstance>,
    /// Timers to cancel: every timer of this instance owned by one of these states or
    /// their descendants (`timers::owned_by`). Applied before `timers_arm`.
    #[serde(default)]
    pub timers_cancel: Vec<String>,
    /// Timers to arm, due one interval after this commit (the state entry).
    #[serde(default)]
    pub timers_arm: Vec<TimerArm>,
    /// Delegation states the step left: the live child machines this instance started
    /// from one of them are cancelled in the same commit, with their own descendants.
    #[serde(default)]
    pub children_cancel: Vec<String>,
}

impl StepCommit {
    /// A commit of `outcome` with nothing consumed, emitted or recorded.
    pub fn new(id: InstanceId, token: FencingToken, outcome: Outcome) -> Self {
        StepCommit {
            id,
            token,
            outcome,
            consume: Vec::new(),
            emit: Vec::new(),
            history: Vec::new(),
            failure: None,
            spawn: Vec::new(),
            timers_cancel: Vec::new(),
            timers_arm: Vec::new(),
            children_cancel: Vec::new(),
        }
    }
    /// Sets the consumed signals.
    pub fn consume(mut self, ids: impl IntoIterator<Item = SignalId>) -> Self {
        self.consume = ids.into_iter().collect();
        self
    }
    /// Adds an emitted event.
    pub fn emit(mut self, signal: NewSignal) -> Self {
        self.emit.push(signal);
        self
    }
    /// Adds a history entry.
    pub fn record(mut self, entry: HistoryEntry) -> Self {
        self.history.push(entry);
        self
    }
    /// Sets the failure.
    pub fn failure(mut self, failure: StepFailure) -> Self {
        self.failure = Some(failure);
        self
    }
}

/// Checks a commit against the row it targets: the fence first (`LeaseLost` when the
/// instance is no longer executing under this token), then the shape and limits of the
/// outcome (`Invalid`, naming the field). A rejected commit changes nothing.
pub fn validate_commit(row: &Instance, commit: &StepCommit) -> StoreResult<()> {
    if row.status != Status::Executing || row.fencing_token != commit.token {
        return Err(StoreError::lease_lost(format!(
            "instance {} is {} with fencing token {}; this commit holds token {} — another claim superseded it",
            row.id, row.status, row.fencing_token.0, commit.token.0
        )));
    }
    validate_commit_shape(commit)
}

/// The row-independent part of [`validate_commit`].
pub fn validate_commit_shape(commit: &StepCommit) -> StoreResult<()> {
    // Everything a commit carries may be nested up to the stored bound: the engine wraps
    // callers' values (bounded tighter at the door) before it commits them.
    let depth = limits::JSON_DEPTH_STORED_MAX;
    if let Some(ctx) = commit.outcome.context() {
        check_object_within("outcome.context", ctx, depth)?;
    }
    match &commit.outcome {
        Outcome::Next { step, .. } => check_position("outcome.step", step)?,
        Outcome::Await { signal, step, .. } => {
            check_name("outcome.signal", signal)?;
            if let Some(step) = step {
                check_position("outcome.step", step)?;
            }
        }
        Outcome::ScheduleChildren { next, children, join, .. } => {
            check_position("outcome.next", next)?;
            check_batch("outcome.children", children.len(), limits::CHILDREN_PER_STEP_MAX)?;
            join.validate("outcome.join", children.len())?;
            for (i, c) in children.iter().enumerate() {
                c.validate_within(&format!("outcome.children[{i}]"), depth)?;
            }
        }
        Outcome::Done { result, step } => {
            check_size_within("outcome.result", result, depth)?;
            if let Some(step) = step {
                check_position("outcome.step", step)?;
            }
        }
        Outcome::Suspend => {
            if !commit.failure.as_ref().is_some_and(|f| f.dead_letter) {
                return Err(StoreError::invalid(
                    "outcome: Suspend needs a failure with dead_letter = true; it is the retry policy's exhaustion outcome",
                ));
            }
        }
        Outcome::Retry { delay, .. } => {
            if *delay > limits::RETRY_DELAY_MAX {
                return Err(StoreError::invalid(format!(
                    "outcome.delay: {} s is longer than the limit of {} s (one year); to wait that long, park on a signal or a timer",
                    delay.as_secs(),
                    limits::RETRY_DELAY_MAX.as_secs()
                )));
            }
        }
        Outcome::Stop { .. } => {}
    }
    let scheduled = match &commit.outcome {
        Outcome::ScheduleChildren { children, .. } => children.len(),
        _ => 0,
    };
    check_batch("spawn", commit.spawn.len() + scheduled, limits::CHILDREN_PER_STEP_MAX)?;
    for (i, c) in commit.spawn.iter().enumerate() {
        c.validate_within(&format!("spawn[{i}]"), depth)?;
    }
    check_batch("timers_arm", commit.timers_arm.len(), limits::TIMERS_PER_STEP_MAX)?;
    check_batch("timers_cancel", commit.timers_cancel.len(), limits::TIMERS_PER_STEP_MAX)?;
    check_batch("children_cancel", commit.children_cancel.len(), limits::CHILDREN_PER_STEP_MAX)?;
    for (i, state) in commit.children_cancel.iter().enumerate() {
        check_name(&format!("children_cancel[{i}]"), state)?;
    }
    for (i, t) in commit.timers_arm.iter().enumerate() {
        check_name(&format!("timers_arm[{i}].state"), &t.state)?;
        check_name(&format!("timers_arm[{i}].event"), &t.event)?;
        if t.interval.is_zero() {
            return Err(StoreError::invalid(format!(
                "timers_arm[{i}].interval: must be positive (InvalidTimerDefinition); use Timer::seconds(n) with n > 0"
            )));
        }
        if t.interval > limits::TIMER_INTERVAL_MAX {
            return Err(StoreError::invalid(format!(
                "timers_arm[{i}].interval: {} s is longer than the limit of {} s (ten years); use a shorter timer",
                t.interval.as_secs(),
                limits::TIMER_INTERVAL_MAX.as_secs()
            )));
        }
        if t.max == Some(0) {
            return Err(StoreError::invalid(format!(
                "timers_arm[{i}].max: must be at least 1 fire; drop `max` for a timer that repeats while the state is active"
            )));
        }
        if let Some(then) = &t.then {
            check_name(&format!("timers_arm[{i}].then"), then)?;
        }
    }
    check_batch("emit", commit.emit.len(), limits::EMIT_PER_STEP_MAX)?;
    for (i, s) in commit.emit.iter().enumerate() {
        s.validate_within(&format!("emit[{i}]"), depth)?;
    }
    check_batch("history", commit.history.len(), limits::HISTORY_PER_STEP_MAX)?;
    for (i, h) in commit.history.iter().enumerate() {
        check_name(&format!("history[{i}].kind"), &h.kind)?;
        check_record_within(&format!("history[{i}].data"), &h.data, depth)?;
    }
    if let Some(event) = commit.failure.as_ref().and_then(|f| f.event.as_ref()) {
        check_record_within("failure.event", event, depth)?;
    }
    Ok(())
}

/// The facts a store knows only while committing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyFacts {
    /// Commit time.
    pub now: Timestamp,
    /// For `Await`: after this commit's consumption, does the inbox hold a signal whose
    /// name matches the awaited one (any signal, for `*`)?
    pub signal_waiting: bool,
    /// For `ScheduleChildren`: how many children were actually inserted.
    pub children_inserted: i32,
}

/// The result of applying a commit to a row.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The row after the commit.
    pub row: Instance,
    /// History to append: the commit's entries, then the engine's own.
    pub history: Vec<HistoryEntry>,
    /// The dead letter to store, if the commit produced one.
    pub dead_letter: Option<NewDeadLetter>,
}

impl Applied {
    /// Whether the commit made the row terminal (so its parent's barrier counts it).
    pub fn became_terminal(&self) -> bool {
        self.row.status.is_terminal()
    }
}

/// Whether a signal named `name` wakes an instance awaiting `awaits`.
pub fn signal_matches(awaits: &str, name: &str) -> bool {
    awaits == ANY_SIGNAL || awaits == name
}

fn release_lease(row: &mut Instance) {
    row.lease_owner = None;
    row.lease_expires_at = None;
}

fn push_error(errors: &mut Vec<AttemptError>, attempt: i32, error: &str, at: Timestamp) {
    errors.push(AttemptError { attempt, error: clip_error(error), at });
    if errors.len() > limits::ATTEMPT_ERRORS_MAX {
        let excess = errors.len() - limits::ATTEMPT_ERRORS_MAX;
        errors.drain(..excess);
    }
}

/// The status a row lands in when `outcome` is committed with the commit-time `facts`.
/// [`apply`] sets exactly this status; a store that must know where a row may land before
/// it knows every fact (how many children uniqueness lets in) asks this.
pub fn status_after(outcome: &Outcome, facts: ApplyFacts) -> Status {
    match outcome {
        Outcome::Next { .. } | Outcome::Retry { .. } => Status::Runnable,
        Outcome::Await { .. } if facts.signal_waiting => Status::Runnable,
        Outcome::Await { .. } => Status::AwaitingSignal,
        Outcome::ScheduleChildren { .. } if facts.children_inserted == 0 => Status::Runnable,
        Outcome::ScheduleChildren { .. } => Status::AwaitingChildren,
        Outcome::Done { .. } => Status::Done,
        Outcome::Stop { .. } => Status::Failed,
        Outcome::Suspend => Status::Suspended,
    }
}

/// The reference transition of a step outcome: the row after `commit`, given the commit-time
/// `facts`. The caller has already checked [`validate_commit`].
pub fn apply(row: &Instance, commit: &StepCommit, facts: ApplyFacts) -> Applied {
    let now = facts.now;
    let mut next = row.clone();
    release_lease(&mut next);
    next.updated_at = now;
    next.revision = Revision(row.revision.0 + 1);
    next.status = status_after(&commit.outcome, facts);

    let mut errors = row.errors.clone();
    if let Some(f) = &commit.failure {
        push_error(&mut errors, row.attempt, &f.error, now);
    }

    // History is Keel's own record of what happened, often quoting errors; a NUL in it is
    // replaced rather than refused (which would lose the step's result).
    let mut history: Vec<HistoryEntry> = commit
        .history
        .iter()
        .map(|h| HistoryEntry::new(h.kind.clone(), scrub_nul(&h.data)))
        .collect();
    // After a failure, the attempts that failed, this one included (a step's own polls
    // are not failures), as the retry decision counts them.
    let failed_attempts = commit.failure.as_ref().map(|_| crate::retry::failed_attempts(row) + 1);
    let engine_entry = match &commit.outcome {
        Outcome::Next { step, context } => {
            next.position.clone_from(step);
            next.context = context.clone();
            next.eligible_at = now;
            next.attempt = 0;
            next.awaits = None;
            errors.clear();
            HistoryEntry::new(HistoryKind::StepNext, json!({ "from": row.position, "to": step }))
        }
        Outcome::Retry { context, delay } => {
            next.context = context.clone();
            next.eligible_at = now.plus(*delay);
            next.attempt = row.attempt + 1;
            // `awaits` stays: the next attempt processes the same signals (a failed attempt
            // consumed none), so its success consumes them and they do not wake a later
            // `Await` a second time.
            let error = commit.failure.as_ref().map(|f| clip_error(&f.error));
            HistoryEntry::new(
                HistoryKind::StepRetry,
                json!({ "step": row.position, "delay_ms": delay.as_millis() as u64, "error": error }),
            )
        }
        Outcome::Await { signal, context, step } => {
            if let Some(step) = step {
                next.position.clone_from(step);
            }
            next.context = context.clone();
            next.awaits = Some(signal.clone());
            next.eligible_at = now;
            next.attempt = 0;
            errors.clear();
            HistoryEntry::new(
                HistoryKind::StepAwait,
                json!({ "signal": signal, "parked": !facts.signal_waiting, "at": next.position }),
            )
        }
        Outcome::ScheduleChildren { next: step, context, children, .. } => {
            next.position.clone_from(step);
            next.context = context.clone();
            next.children_pending = facts.children_inserted;
            next.eligible_at = now;
            next.attempt = 0;
            next.awaits = None;
            errors.clear();
            HistoryEntry::new(
                HistoryKind::StepScheduleChildren,
                json!({ "next": step, "requested": children.len(), "inserted": facts.children_inserted }),
            )
        }
        Outcome::Done { result, step } => {
            if let Some(step) = step {
                next.position.clone_from(step);
            }
            next.result = Some(result.clone());
            next.awaits = None;
            errors.clear();
            HistoryEntry::new(
                HistoryKind::StepDone,
                json!({ "step": row.position, "at": next.position }),
            )
        }
        Outcome::Stop { reason } => {
            next.last_error = Some(clip_error(reason));
            next.awaits = None;
            errors.clear();
            HistoryEntry::new(
                HistoryKind::StepStop,
                json!({ "step": row.position, "reason": clip_error(reason) }),
            )
        }
        Outcome::Suspend => {
            next.last_error = commit.failure.as_ref().map(|f| clip_error(&f.error));
            // After a failure, the attempts that failed; else every run.
            let attempts = failed_attempts
                .unwrap_or_else(|| u32::try_from(row.attempt + 1).unwrap_or(u32::MAX));
            HistoryEntry::new(
                HistoryKind::StepSuspended,
                json!({ "step": row.position, "attempts": attempts }),
            )
        }
    };
    history.push(engine_entry);
    keep_join(row, &mut next);

    let dead_letter = commit.failure.as_ref().filter(|f| f.dead_letter).map(|f| {
        // The errors of every attempt of this step: those kept on the row, plus this one.
        let mut all = row.errors.clone();
        push_error(&mut all, row.attempt, &f.error, now);
        let reason = if f.retryable { "exhausted" } else { "non_retryable" };
        let attempts = failed_attempts.unwrap_or(1);
        history.push(HistoryEntry::new(
            HistoryKind::DeadLettered,
            json!({ "reason": reason, "attempts": attempts, "error": clip_error(&f.error) }),
        ));
        NewDeadLetter {
            instance: row.id,
            namespace: row.namespace.clone(),
            machine: row.machine.clone(),
            position: row.position.clone(),
            signals: f.signals.clone(),
            event: f.event.as_ref().map(scrub_nul),
            correlation_id: row.correlation_id.clone(),
            reason: reason.to_owned(),
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
            first_attempt_at: all.first().map_or(now, |e| e.at),
            last_attempt_at: now,
            errors: all,
        }
    });
    next.errors = errors;
    Applied { row: next, history, dead_letter }
}

/// A join's bookkeeping in the context ([`crate::join::JOIN_KEY`]) is the engine's: a
/// step's new context that leaves it out keeps the stored one, so children left running
/// by an earlier join can never count on a later barrier.
fn keep_join(row: &Instance, next: &mut Instance) {
    let Some(kept) = row.context.get(JOIN_KEY) else { return };
    if let Some(map) = next.context.as_object_mut()
        && !map.contains_key(JOIN_KEY)
    {
        map.insert(JOIN_KEY.to_owned(), kept.clone());
    }
}

/// Why a dead letter was made for a row the store could not decode.
pub const UNDECODABLE_REASON: &str = "undecodable";

/// What becomes of a claimed row the store could not fully decode (a stored context, result
/// or inbox payload no JSON reader accepts): it fails alone. The row is suspended with its
/// lease released and `last_error` naming the decode error, a dead letter with reason
/// [`UNDECODABLE_REASON`] carries the error, and history records both. The caller is the
/// claim, holding `row` (already executing under the claim's token); it writes the result
/// back without touching the undecodable columns, so the stored value is kept for an
/// operator to inspect, fix by hand, retry or cancel.
pub fn undecodable_row(row: &Instance, error: &str, now: Timestamp) -> Applied {
    let error = clip_error(&format!("stored value cannot be read back: {error}"));
    let mut next = row.clone();
    release_lease(&mut next);
    next.status = Status::Suspended;
    next.last_error = Some(error.clone());
    next.updated_at = now;
    next.revision = Revision(row.revision.0 + 1);
    // Counted as every other dead letter counts: the attempts that failed, this one included.
    let attempts = crate::retry::failed_attempts(row) + 1;
    let mut errors = row.errors.clone();
    push_error(&mut errors, row.attempt, &error, now);
    next.errors.clone_from(&errors);
    let history = vec![
        HistoryEntry::new(HistoryKind::RowUndecodable, json!({ "error": error })),
        HistoryEntry::new(
            HistoryKind::DeadLettered,
            json!({ "reason": UNDECODABLE_REASON, "attempts": attempts, "error": error }),
        ),
    ];
    let dead_letter = NewDeadLetter {
        instance: row.id,
        namespace: row.namespace.clone(),
        machine: row.machine.clone(),
        position: row.position.clone(),
        signals: Vec::new(),
        event: None,
        correlation_id: row.correlation_id.clone(),
        reason: UNDECODABLE_REASON.to_owned(),
        attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
        first_attempt_at: errors.first().map_or(now, |e| e.at),
        last_attempt_at: now,
        errors,
    };
    Applied { row: next, history, dead_letter: Some(dead_letter) }
}

/// The event a child machine's terminal commit delivers into its parent's inbox, in the
/// same transaction: `done.invoke.<path>` with the child's result, or
/// `fail.state.<path>` with its error, for a child started by the parent's delegation state
/// `path`. `None` for other rows. The dedup key makes it exactly once per child.
pub fn parent_notice(child: &Instance) -> Option<NewSignal> {
    let (parent, path) = (child.parent?, child.invoked_by.as_deref()?);
    let event = match child.status {
        Status::Done => Event::done_invoke(path, child.result.clone().unwrap_or(Value::Null)),
        Status::Failed | Status::Cancelled => Event::fail_state(
            path,
            json!({ "child": child.id, "status": child.status, "error": child.last_error }),
        ),
        _ => return None,
    };
    Some(
        NewSignal::new(parent, event.name.clone())
            .payload(event.payload.clone())
            .dedup_key(format!("{NOTICE_KEY_PREFIX}{}{NOTICE_KEY_SUFFIX}", child.id.0)),
    )
}

/// How the dedup key of a child's notice to its parent begins (`child:<id>:terminal`).
pub const NOTICE_KEY_PREFIX: &str = "child:";
/// How the dedup key of a child's notice to its parent ends.
pub const NOTICE_KEY_SUFFIX: &str = ":terminal";

/// The delegation state a signal is a child's notice about ([`parent_notice`]: its dedup
/// key is a notice's and its name `done.invoke.<state>` or `fail.state.<state>`), or
/// `None` when it is not such a notice.
pub fn notice_state<'a>(dedup_key: &str, name: &'a str) -> Option<&'a str> {
    if !(dedup_key.starts_with(NOTICE_KEY_PREFIX) && dedup_key.ends_with(NOTICE_KEY_SUFFIX)) {
        return None;
    }
    name.strip_prefix(crate::chart::DONE_INVOKE)
        .or_else(|| name.strip_prefix(crate::chart::FAIL_STATE))
}

/// The row after a claim: executing under a new lease and the next fencing token.
pub fn claim(row: &Instance, worker: &WorkerId, lease: Duration, now: Timestamp) -> Instance {
    let mut next = row.clone();
    next.status = Status::Executing;
    next.lease_owner = Some(worker.clone());
    next.lease_expires_at = Some(now.plus(lease));
    next.fencing_token = FencingToken(row.fencing_token.0 + 1);
    next.updated_at = now;
    next
}

/// Whether a row may be claimed now (status and time only; filters, pauses and
/// concurrency keys are the store's).
pub fn claimable(row: &Instance, now: Timestamp) -> bool {
    row.status == Status::Runnable && row.eligible_at <= now
}

/// A signal named `name` delivered to `row`, changed in place (its context may be large,
/// so it is not copied): an instance awaiting that name becomes runnable now, and `awaits`
/// is kept for the woken step to see; says whether it woke. Any other row is unchanged
/// (the signal waits in the inbox).
pub fn deliver(row: &mut Instance, name: &str, now: Timestamp) -> bool {
    let wakes = row.status == Status::AwaitingSignal
        && row.awaits.as_deref().is_some_and(|a| signal_matches(a, name));
    if wakes {
        row.status = Status::Runnable;
        row.eligible_at = now;
        row.updated_at = now;
    }
    wakes
}

/// Whether a lease has run out at `now`.
pub fn lease_expired(row: &Instance, now: Timestamp) -> bool {
    row.status == Status::Executing && row.lease_expires_at.is_some_and(|t| t < now)
}

/// The error an attempt records when its lease expired with no result from the worker
/// holding it ([`reap`]): how [`crate::retry::attempts_used_up`] tells such attempts from
/// failed ones and from a step's own retries.
pub const LEASE_EXPIRED_ERROR: &str = "the lease expired with no result from the worker holding it";

/// The row after the reaper returns it (its worker died): runnable now, attempt + 1,
/// the attempt's error [`LEASE_EXPIRED_ERROR`], no handler call.
pub fn reap(row: &Instance, now: Timestamp) -> Instance {
    let mut next = row.clone();
    release_lease(&mut next);
    next.status = Status::Runnable;
    push_error(&mut next.errors, row.attempt, LEASE_EXPIRED_ERROR, now);
    next.attempt = row.attempt + 1;
    next.eligible_at = now;
    next.updated_at = now;
    next
}

/// The history entry the reaper records.
pub fn reap_history(row: &Instance) -> HistoryEntry {
    HistoryEntry::new(
        HistoryKind::LeaseExpired,
        json!({ "worker": row.lease_owner, "lease_expires_at": row.lease_expires_at, "attempt": row.attempt }),
    )
}

/// The row after a graceful release (shutdown): runnable now, attempt unchanged — the
/// step did not fail, it was not run to the end.
pub fn release(row: &Instance, now: Timestamp) -> Instance {
    let mut next = row.clone();
    release_lease(&mut next);
    next.status = Status::Runnable;
    next.eligible_at = now;
    next.updated_at = now;
    next
}

/// The parent after one of its children became terminal: one less pending child, and
/// runnable now when that was the last one and it is still waiting on the barrier. The
/// count never goes below zero.
pub fn release_parent(parent: &Instance, now: Timestamp) -> Instance {
    let mut next = parent.clone();
    next.children_pending = (parent.children_pending - 1).max(0);
    if next.children_pending == 0 && parent.status == Status::AwaitingChildren {
        next.status = Status::Runnable;
        next.eligible_at = now;
    }
    next.updated_at = now;
    next
}

/// The row after a cancel, or `None` when it is already terminal (nothing to do).
pub fn cancel(row: &Instance, reason: &str, now: Timestamp) -> Option<Instance> {
    (!row.status.is_terminal()).then(|| {
        let mut next = row.clone();
        release_lease(&mut next);
        next.status = Status::Cancelled;
        next.last_error = Some(clip_error(reason));
        next.awaits = None;
        next.updated_at = now;
        next
    })
}

/// The status an instance must be in for its dead letter to be retried or skipped. A
/// letter can outlive that status (the instance was cancelled, or a letter recorded under
/// `on_dead_letter = skip` while it carried on); a retry by machine reads only the letters
/// of instances in it, so such records never crowd out the ones that can be retried.
pub const DEAD_LETTER_RETRYABLE: Status = Status::Suspended;

/// The row after an operator retries its dead letter: runnable at `at`, a fresh attempt
/// count and error list. `Conflict` unless the row is [`DEAD_LETTER_RETRYABLE`].
pub fn dead_letter_retry(row: &Instance, at: Timestamp, now: Timestamp) -> StoreResult<Instance> {
    if row.status != DEAD_LETTER_RETRYABLE {
        return Err(StoreError::conflict(format!(
            "instance {} is {}, not suspended; only a suspended instance can be retried from the dead-letter queue",
            row.id, row.status
        )));
    }
    let mut next = row.clone();
    next.status = Status::Runnable;
    next.attempt = 0;
    next.errors.clear();
    next.eligible_at = at.max(now);
    next.updated_at = now;
    Ok(next)
}
