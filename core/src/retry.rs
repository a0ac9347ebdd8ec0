//! Retry policy, backoff schedule and the retry-or-dead-letter decision.
//!
//! Failures are counted from 0. With `max_attempts = 3` a step may fail twice and run
//! again; its third failure sends it to the dead-letter queue. A non-retryable failure goes
//! to the dead-letter queue at once, whatever attempt it was. Only failures use up the
//! attempts ([`failed_attempts`]): a step polling with its own `Retry` runs as long as it
//! wants and keeps its whole budget for when it fails.
//!
//! Everything here is a plain function of its inputs. Jitter needs randomness, so the caller
//! passes in a uniform random number in `[0, 1)`; tests pass fixed values.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::retry::{decide, ErrorClass, RetryDecision, RetryPolicy};
//!
//! let policy = RetryPolicy::default(); // 3 attempts, exponential from 1 s, capped at 5 min
//! assert_eq!(
//!     decide(&policy, 1, ErrorClass::Retryable, 0.0),
//!     RetryDecision::Retry { delay: Duration::from_secs(2) },
//! );
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{OnDeadLetter, QueueConfig};
use crate::error::ErrorKind;
use crate::history::HistoryKind;
use crate::ids::SignalId;
use crate::instance::{ANY_SIGNAL, HistoryEntry, Instance, Signal, clip_error};
use crate::names::name_enum;
use crate::outcome::{Outcome, StepCommit, StepFailure};

name_enum! {
    /// How the delay grows between attempts.
    pub enum Backoff {
        /// The same delay (`initial_delay`) before every retry.
        Linear = "linear",
        /// `initial_delay`, then double each time: 1 s, 2 s, 4 s, ….
        Exponential = "exponential",
    }
}

/// Randomization of the backoff delay, so that many steps failing together do not all
/// retry at the same instant.
///
/// Each kind shrinks the computed delay `d` by a random share, so jitter never lengthens a
/// delay beyond `max_delay`.
///
/// Written in configuration as `"none"`, `"full"`, `"equal"` or a bare number; anything
/// else is refused with a message listing those.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// Exactly `d`.
    #[default]
    None,
    /// Uniform in `(0, d]` ("full jitter").
    Full,
    /// Uniform in `(d/2, d]` ("equal jitter").
    Equal,
    /// Uniform in `(d·(1 − f), d]` for a fraction `f` in `[0, 1]`; `Full` is `Fraction(1.0)`
    /// and `Equal` is `Fraction(0.5)`. Written as a bare number in configuration.
    #[serde(untagged)]
    Fraction(f64),
}

/// What a jitter value may be, as a deserialization error says it.
const JITTER_EXPECTED: &str = "\"none\", \"full\", \"equal\" or a number from 0.0 to 1.0";

impl<'de> Deserialize<'de> for Jitter {
    /// A name (`"none"`, `"full"`, `"equal"`) or a number (an integer counts). The range of
    /// a number is checked by [`RetryPolicy::validate`], which names the field.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Jitter;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(JITTER_EXPECTED)
            }
            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<Jitter, E> {
                match value {
                    "none" => Ok(Jitter::None),
                    "full" => Ok(Jitter::Full),
                    "equal" => Ok(Jitter::Equal),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(value), &self)),
                }
            }
            fn visit_f64<E: serde::de::Error>(self, value: f64) -> Result<Jitter, E> {
                Ok(Jitter::Fraction(value))
            }
            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<Jitter, E> {
                Ok(Jitter::Fraction(value as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<Jitter, E> {
                Ok(Jitter::Fraction(value as f64))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

impl Jitter {
    /// The share of the delay that may be taken away: 0 for none, 1 for full.
    pub fn fraction(self) -> f64 {
        match self {
            Self::None => 0.0,
            Self::Full => 1.0,
            Self::Equal => 0.5,
            Self::Fraction(fraction) => fraction,
        }
    }
}

/// A user's retry configuration, as written in a configuration file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// How many attempts of a step may fail (an expired lease counts as one) before the
    /// last failure is dead-lettered. At least 1. A step's own `Outcome::Retry` (polling)
    /// does not count, so a polling step may run many more times.
    pub max_attempts: u32,
    /// How the delay grows.
    pub backoff: Backoff,
    /// The delay before the first retry.
    pub initial_delay: Duration,
    /// No delay is ever longer than this.
    pub max_delay: Duration,
    /// Randomization applied after the cap.
    pub jitter: Jitter,
}

impl RetryPolicy {
    /// The upper bound on `max_attempts`: a retry count must be bounded (architecture
    /// invariant 5), and more than this many attempts means a misconfiguration, not
    /// patience.
    pub const MAX_ATTEMPTS_LIMIT: u32 = 10_000;

    /// Checks the invariants a policy must hold. The error names the field under `retry.`;
    /// configuration prefixes it with where the block came from.
    pub fn validate(&self) -> Result<(), InvalidPolicy> {
        if self.max_attempts < 1 {
            return Err(InvalidPolicy::new(
                "retry.max_attempts",
                format!("must be at least 1 (got {})", self.max_attempts),
            ));
        }
        if self.max_attempts > Self::MAX_ATTEMPTS_LIMIT {
            return Err(InvalidPolicy::new(
                "retry.max_attempts",
                format!("must be at most {} (got {})", Self::MAX_ATTEMPTS_LIMIT, self.max_attempts),
            ));
        }
        if self.max_delay > crate::limits::RETRY_DELAY_MAX {
            // The store refuses a `Retry` delay over the limit, so a longer policy would
            // produce retries that can never be committed.
            return Err(InvalidPolicy::new(
                "retry.max_delay",
                format!(
                    "must be at most {} (got {}); to wait longer, park on a signal or a timer",
                    crate::duration::format(crate::limits::RETRY_DELAY_MAX),
                    crate::duration::format(self.max_delay)
                ),
            ));
        }
        if self.initial_delay > self.max_delay {
            return Err(InvalidPolicy::new(
                "retry.initial_delay",
                format!(
                    "must not exceed max_delay ({} > {})",
                    crate::duration::format(self.initial_delay),
                    crate::duration::format(self.max_delay)
                ),
            ));
        }
        let fraction = self.jitter.fraction();
        if !(0.0..=1.0).contains(&fraction) {
            return Err(InvalidPolicy::new(
                "retry.jitter",
                format!(
                    "must be \"none\", \"full\", \"equal\" or a number from 0.0 to 1.0 (got {fraction})"
                ),
            ));
        }
        Ok(())
    }

    /// The delay before the retry that follows the failure of `failed_attempt` (0-based),
    /// with `random` (uniform in `[0, 1)`, supplied by the caller) driving the jitter.
    ///
    /// Exponential: `initial_delay · 2^failed_attempt`; linear: `initial_delay`. Both are
    /// capped at `max_delay` without overflow for any attempt number. A `random` outside
    /// `[0, 1]` is clamped into it (NaN counts as 0).
    pub fn delay_for(&self, failed_attempt: u32, random: f64) -> Duration {
        let base = match self.backoff {
            Backoff::Linear => self.initial_delay,
            Backoff::Exponential => doubled(self.initial_delay, failed_attempt, self.max_delay),
        };
        apply_jitter(base.min(self.max_delay), self.jitter, random)
    }
}

impl Default for RetryPolicy {
    /// 3 attempts, exponential from 1 second, capped at 5 minutes, no jitter.
    fn default() -> Self {
        Self {
            max_attempts: 3,
            backoff: Backoff::Exponential,
            initial_delay: Duration::from_secs(1),
            max_delay: Duration::from_mins(5),
            jitter: Jitter::None,
        }
    }
}

/// `initial · 2^exponent`, or `cap` when that would exceed it (or overflow).
fn doubled(initial: Duration, exponent: u32, cap: Duration) -> Duration {
    let cap_nanos = cap.as_nanos();
    let factor = 1u128.checked_shl(exponent).unwrap_or(0);
    match initial.as_nanos().checked_mul(factor) {
        Some(nanos) if factor != 0 && nanos <= cap_nanos => from_nanos(nanos),
        _ => cap,
    }
}

/// Shrinks `delay` by a random share of at most `jitter.fraction()`.
fn apply_jitter(delay: Duration, jitter: Jitter, random: f64) -> Duration {
    let fraction = clamp_unit(jitter.fraction());
    if fraction == 0.0 {
        return delay;
    }
    let keep = 1.0 - fraction * clamp_unit(random);
    let nanos = delay.as_nanos();
    // The float product is at most `nanos`; `min` guards against rounding up past it, and
    // the cast saturates, so this never panics.
    from_nanos(((nanos as f64 * keep) as u128).min(nanos))
}

fn clamp_unit(value: f64) -> f64 {
    if value.is_nan() { 0.0 } else { value.clamp(0.0, 1.0) }
}

/// Builds a duration from nanoseconds known to fit (they came from a `Duration`).
fn from_nanos(nanos: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
    Duration::new(secs, (nanos % NANOS_PER_SEC) as u32)
}

/// A retry policy field with a value it must not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidPolicy {
    /// The field, e.g. `retry.max_attempts`.
    pub field: &'static str,
    /// What is wrong and how to fix it.
    pub reason: String,
}

impl InvalidPolicy {
    fn new(field: &'static str, reason: String) -> Self {
        Self { field, reason }
    }
}

/// Whether a failure is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Timeouts, connection errors, rate limits: the same input may succeed later.
    Retryable,
    /// Validation errors, business-rule failures, authentication errors: it will fail
    /// the same way every time.
    NonRetryable,
}

/// What kind of failure a step had. Every decision about a failed step (retry, dead-letter,
/// skip, discard) and every name a failure is reported under is made from this kind, never
/// from the error's message, so rewording a message cannot change behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The step's own code returned an error that may go away (a dependency was down, a
    /// rate limit was hit).
    Action,
    /// The step's own code returned an error that will recur on every attempt (bad input,
    /// a business rule, an authentication failure).
    NonRetryable,
    /// The step ran past its timeout and was cancelled.
    Timeout,
    /// The step panicked.
    Panic,
    /// The claim was superseded before the result was committed: another worker owns the
    /// instance now, so this result is stale.
    LeaseLost,
    /// The store could not be reached while committing the result; the same commit may be
    /// accepted later.
    Unavailable,
    /// The store refused the result itself (an invalid outcome, a missing target, a
    /// conflict): it would be refused on every attempt.
    Refused,
}

impl FailureKind {
    /// Whether trying the step again may help.
    pub const fn class(self) -> ErrorClass {
        match self {
            Self::Action | Self::Timeout | Self::Panic | Self::LeaseLost | Self::Unavailable => {
                ErrorClass::Retryable
            }
            Self::NonRetryable | Self::Refused => ErrorClass::NonRetryable,
        }
    }

    /// The kind of a step result the store refused, from the portable kind of the refusal.
    pub const fn of_refusal(kind: ErrorKind) -> Self {
        match kind {
            ErrorKind::LeaseLost => Self::LeaseLost,
            ErrorKind::Unavailable => Self::Unavailable,
            ErrorKind::Invalid | ErrorKind::NotFound | ErrorKind::Conflict => Self::Refused,
        }
    }

    /// The exception name a failure is reported under to a parent (a failed region's
    /// `exception`): `Timeout`, `Panic`, or `ActionError` for everything else.
    pub const fn exception(self) -> &'static str {
        match self {
            Self::Timeout => "Timeout",
            Self::Panic => "Panic",
            Self::Action
            | Self::NonRetryable
            | Self::LeaseLost
            | Self::Unavailable
            | Self::Refused => "ActionError",
        }
    }
}

impl From<ErrorClass> for FailureKind {
    /// An error the step's code returned, retryable or not.
    fn from(class: ErrorClass) -> Self {
        match class {
            ErrorClass::Retryable => Self::Action,
            ErrorClass::NonRetryable => Self::NonRetryable,
        }
    }
}

/// Why an event or step went to the dead-letter queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterReason {
    /// Every allowed attempt failed.
    Exhausted,
    /// The failure was classed as non-retryable.
    NonRetryable,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Run the step again after `delay`.
    Retry {
        /// How long to wait before the next attempt.
        delay: Duration,
    },
    /// Stop and move the event (or step) to the dead-letter queue.
    DeadLetter {
        /// Why.
        reason: DeadLetterReason,
    },
    /// Leave the instance untouched: the result is stale (its lease was lost) or could not
    /// reach the store. Either another worker owns the instance, or the lease expires and
    /// the reaper hands the step to a worker again.
    Discard,
}

/// Decides what follows the failure of attempt `failed_attempt` (0-based), from the kind
/// of the failure (an [`ErrorClass`] stands for an error the step's code returned).
///
/// A lost lease or an unreachable store discards the result; a non-retryable kind
/// dead-letters at once; any other kind retries until the policy's attempts are used up.
/// `random` is a uniform number in `[0, 1)` for jitter (see [`RetryPolicy::delay_for`]).
/// A policy with `max_attempts = 0` (which [`RetryPolicy::validate`] rejects) behaves as
/// if it were 1: the first failure is final.
pub fn decide(
    policy: &RetryPolicy,
    failed_attempt: u32,
    kind: impl Into<FailureKind>,
    random: f64,
) -> RetryDecision {
    let kind = kind.into();
    if matches!(kind, FailureKind::LeaseLost | FailureKind::Unavailable) {
        return RetryDecision::Discard;
    }
    if kind.class() == ErrorClass::NonRetryable {
        return RetryDecision::DeadLetter { reason: DeadLetterReason::NonRetryable };
    }
    if failed_attempt.saturating_add(1) >= policy.max_attempts {
        return RetryDecision::DeadLetter { reason: DeadLetterReason::Exhausted };
    }
    RetryDecision::Retry { delay: policy.delay_for(failed_attempt, random) }
}

/// What a failed step leads to, all things considered: the retry decision, and for a
/// dead letter, what the instance does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePlan {
    /// Run the step again after `delay`, with its attempt counted.
    Retry {
        /// How long to wait before the next attempt.
        delay: Duration,
    },
    /// Dead-letter the failure and suspend the instance until the dead letter is retried
    /// or purged, so later events keep their order.
    Suspend {
        /// Why it was dead-lettered.
        reason: DeadLetterReason,
    },
    /// Dead-letter the event being processed, consume it, and carry on with the next one
    /// at the same position.
    Skip {
        /// Why it was dead-lettered.
        reason: DeadLetterReason,
    },
    /// Dead letters are disabled for this step: write no dead letter, consume the event
    /// being processed, record the discard ([`discard_record`]) and carry on with the next
    /// event at the same position.
    DropEvent {
        /// Why it would have been dead-lettered.
        reason: DeadLetterReason,
    },
    /// Dead letters are disabled for this step and it processed no single event that could
    /// be dropped (a step machine's step, a chart's start): write no dead letter, record the
    /// discard ([`discard_record`]) and fail the instance, since there is nothing to skip to.
    FailInstance {
        /// Why it would have been dead-lettered.
        reason: DeadLetterReason,
    },
    /// Leave the instance untouched (see [`RetryDecision::Discard`]).
    Discard,
}

/// Plans what follows the failure of attempt `failed_attempt` (0-based) of a step run
/// under `config`: the retry decision of [`decide`] with `config.retry`, then, where that
/// decision is a dead letter:
///
/// - with `config.dead_letter.enabled = false`, nothing is dead-lettered and the instance
///   is not suspended, whatever `on_dead_letter` says (a suspended instance with no dead
///   letter would wait for an operator who has nothing to retry): the event the step was
///   processing (`processing_event`) is dropped and the instance carries on, or, without
///   such an event, the instance fails;
/// - otherwise `config.on_dead_letter`: `skip` drops the event the step was processing and
///   carries on; a step that processed no single event, or `suspend`, suspends the
///   instance.
pub fn plan_failure(
    config: &QueueConfig,
    failed_attempt: u32,
    kind: impl Into<FailureKind>,
    processing_event: bool,
    random: f64,
) -> FailurePlan {
    match decide(&config.retry, failed_attempt, kind, random) {
        RetryDecision::Retry { delay } => FailurePlan::Retry { delay },
        RetryDecision::Discard => FailurePlan::Discard,
        RetryDecision::DeadLetter { reason } => {
            match (config.dead_letter.enabled, config.on_dead_letter, processing_event) {
                (false, _, true) => FailurePlan::DropEvent { reason },
                (false, _, false) => FailurePlan::FailInstance { reason },
                (true, OnDeadLetter::Skip, true) => FailurePlan::Skip { reason },
                (true, _, _) => FailurePlan::Suspend { reason },
            }
        }
    }
}

impl DeadLetterReason {
    /// The stored name, as in a dead letter's `reason`: `exhausted` or `non_retryable`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Exhausted => "exhausted",
            Self::NonRetryable => "non_retryable",
        }
    }
}

/// The history entry recording a failure discarded because dead letters are disabled
/// ([`FailurePlan::DropEvent`], [`FailurePlan::FailInstance`]): why it would have been
/// dead-lettered, how many attempts ran, the last error, the step, and the dropped event
/// (name and payload) when there was one. With no dead letter to inspect, this entry is
/// what an operator reads to learn what was lost.
pub fn discard_record(
    reason: DeadLetterReason,
    attempts: i32,
    error: &str,
    step: &str,
    event: Option<&serde_json::Value>,
) -> HistoryEntry {
    HistoryEntry::new(
        HistoryKind::FailureDiscarded,
        serde_json::json!({
            "reason": reason.as_str(),
            "attempts": attempts,
            "error": clip_error(error),
            "step": step,
            "event": event,
            "outcome": if event.is_some() { "event_dropped" } else { "instance_failed" },
        }),
    )
}

/// The reason a step machine's instance fails with when its failure is discarded
/// ([`FailurePlan::FailInstance`]): the step's error, and why no dead letter was written.
pub fn discard_stop_reason(reason: DeadLetterReason, attempts: i32, error: &str) -> String {
    let why = match reason {
        DeadLetterReason::Exhausted => format!("failed after {attempts} attempts"),
        DeadLetterReason::NonRetryable => "failed with a non-retryable error".to_owned(),
    };
    format!("{error} ({why}; dead letters are disabled, so the step was discarded)")
}

/// What the commit of a failed step carries, as [`failed_step`] decides it.
#[derive(Debug, Clone, PartialEq)]
pub struct FailedStep {
    /// The outcome to commit: a retry, a suspension, the next event at the same position,
    /// or the end of the instance.
    pub outcome: Outcome,
    /// Whether the commit writes a dead letter.
    pub dead_letter: bool,
    /// The event consumed with the commit: the one the step processed, when it is skipped
    /// or dropped.
    pub consume: Option<SignalId>,
    /// The history entry recording a discarded failure ([`discard_record`]).
    pub history: Option<HistoryEntry>,
}

/// How many earlier attempts of `row`'s step failed, the one failing now not counted: the
/// 0-based number of the failure now being decided, as [`decide`] and
/// [`RetryPolicy::delay_for`] take it.
///
/// Failures, not runs, use up `max_attempts`: a step's own [`Outcome::Retry`] (a step
/// polling) counts an attempt on the row but records no error, so it is not counted here.
/// A failed attempt and an expired lease each record an error with the attempt's number,
/// and the errors are cleared whenever the step moves on, so the failures are the distinct
/// attempt numbers among the row's errors. When the row holds as many errors as it keeps
/// ([`crate::limits::ATTEMPT_ERRORS_MAX`]), older ones may have been dropped: every dropped
/// one came before the oldest kept, so at most that attempt's number of them, and the
/// count adds that number. It is then never less than the failures (any `max_attempts`
/// is still reached) and never counts a poll made after the oldest kept error.
pub fn failed_attempts(row: &Instance) -> u32 {
    let mut attempts: Vec<i32> = row.errors.iter().map(|e| e.attempt).collect();
    attempts.sort_unstable();
    attempts.dedup();
    let kept = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
    let dropped = match attempts.first() {
        Some(&oldest) if row.errors.len() >= crate::limits::ATTEMPT_ERRORS_MAX => {
            u32::try_from(oldest).unwrap_or(0)
        }
        _ => 0,
    };
    kept.saturating_add(dropped)
}

/// Decides what follows the failure of a step of `row` that ran under `config`: the
/// [`plan_failure`] of its failure count ([`failed_attempts`]), then what the commit
/// carries for that plan; a step that polled with its own `Retry` before failing keeps
/// its whole retry budget.
///
/// `processing` is the one event the step was processing (a chart's transition), `None`
/// for a step machine's step or a chart's start; `error` is the step's error message.
/// A lost lease or an unreachable store reported by the step's own code counts as a
/// retryable failure of the step: the instance is still leased to the runtime asking,
/// so the result cannot be dropped as stale, and the retry policy bounds it like any
/// other.
///
/// - retry: the instance keeps its context and runs again after the delay;
/// - skip (dead letter written): the event is consumed and the instance waits for its
///   next event at the same position;
/// - drop (dead letters disabled): the same without a dead letter, and history records
///   the dropped event;
/// - fail (dead letters disabled, no event to drop): history records the discard and the
///   instance stops with [`discard_stop_reason`];
/// - suspend, or a skip with no event to skip: a dead letter is written and the instance
///   is suspended.
pub fn failed_step(
    config: &QueueConfig,
    row: &Instance,
    kind: impl Into<FailureKind>,
    processing: Option<&Signal>,
    error: &str,
    random: f64,
) -> FailedStep {
    let kind = match kind.into() {
        FailureKind::LeaseLost | FailureKind::Unavailable => FailureKind::Action,
        kind => kind,
    };
    let failed = failed_attempts(row);
    let plan = plan_failure(config, failed, kind, processing.is_some(), random);
    let attempts = i32::try_from(failed.saturating_add(1)).unwrap_or(i32::MAX);
    // Back to waiting at the same position for what it awaited (a chart awaits any
    // signal): a step machine waiting for one event is not made to take every other.
    let wait_next = || Outcome::Await {
        signal: row.awaits.clone().unwrap_or_else(|| ANY_SIGNAL.into()),
        context: row.context.clone(),
        step: None,
    };
    let mut step =
        FailedStep { outcome: Outcome::Suspend, dead_letter: false, consume: None, history: None };
    match (plan, processing) {
        (FailurePlan::Retry { delay }, _) => {
            step.outcome = Outcome::Retry { context: row.context.clone(), delay };
        }
        (FailurePlan::Skip { .. }, Some(event)) => {
            step.dead_letter = true;
            step.consume = Some(event.id);
            step.outcome = wait_next();
        }
        (FailurePlan::DropEvent { reason }, Some(event)) => {
            let dropped = event.event_json();
            step.consume = Some(event.id);
            step.history =
                Some(discard_record(reason, attempts, error, &row.position, Some(&dropped)));
            step.outcome = wait_next();
        }
        (FailurePlan::FailInstance { reason } | FailurePlan::DropEvent { reason }, _) => {
            step.history = Some(discard_record(reason, attempts, error, &row.position, None));
            step.outcome = Outcome::Stop { reason: discard_stop_reason(reason, attempts, error) };
        }
        // A discard cannot come from here (lost leases and outages count as retryable
        // above); were it to, the instance waits for an operator with its dead letter.
        (FailurePlan::Skip { .. } | FailurePlan::Suspend { .. } | FailurePlan::Discard, _) => {
            step.dead_letter = true;
        }
    }
    step
}

/// A claimed step whose attempts are used up before it runs ([`attempts_used_up`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptsUsedUp {
    /// How many of its attempts ended with the lease expiring, with no result from the
    /// worker that held it.
    pub leases_expired: u32,
    /// The step's error: names the expired leases and what they mean.
    pub message: String,
}

impl AttemptsUsedUp {
    /// The kind of failure the step fails with: non-retryable, since one more run would
    /// go past the policy's bound.
    pub const KIND: FailureKind = FailureKind::NonRetryable;
}

/// Checks a claimed step before it runs: `Some` when its last attempts all ended with
/// their lease expiring ([`crate::outcome::reap`] records
/// [`crate::outcome::LEASE_EXPIRED_ERROR`] for each), `max(policy.max_attempts, 2)` of
/// them in a row.
///
/// A failed attempt goes through [`decide`], which dead-letters the failure of the last
/// allowed attempt; only the reaper counts an attempt without that decision. A step whose
/// every run takes its worker down with it (a crash, an abort, running out of memory)
/// would therefore be run again for ever. Such a step is not run again: the runtime fails
/// it with [`AttemptsUsedUp::KIND`] and the message returned, through the same failure
/// handling as any other failed step (by default a dead letter, with the instance
/// suspended; without dead letters the instance fails). A failed attempt or a step's own
/// [`Outcome::Retry`] in between breaks the run, and at least two
/// expired leases in a row are needed, so one lost commit (a database failover) never
/// stops a step even under `max_attempts = 1`. The runtime does not know which single
/// event the step would have processed, so nothing is skipped.
///
/// ```
/// use keel_core::ids::{InstanceId, MachineRef};
/// use keel_core::instance::{Instance, NewInstance};
/// use keel_core::outcome::reap;
/// use keel_core::retry::{attempts_used_up, RetryPolicy};
/// use keel_core::Timestamp;
///
/// let new = NewInstance::new(MachineRef::new("order", 1), "charge");
/// let mut row = Instance::from_new(InstanceId(1), &new, None, Timestamp(0));
/// let policy = RetryPolicy::default(); // 3 attempts
/// for _ in 0..2 {
///     row = reap(&row, Timestamp(0));
/// }
/// assert_eq!(attempts_used_up(&policy, &row), None);
/// row = reap(&row, Timestamp(0)); // three leases expired in a row
/// let used_up = attempts_used_up(&policy, &row).unwrap();
/// assert_eq!(used_up.leases_expired, 3);
/// assert!(used_up.message.contains("may be killing its worker"));
/// ```
pub fn attempts_used_up(policy: &RetryPolicy, row: &Instance) -> Option<AttemptsUsedUp> {
    // At least two; at most the errors a row keeps, or a large bound could never be met.
    let needed = policy.max_attempts.clamp(2, crate::limits::ATTEMPT_ERRORS_MAX as u32);
    let expired = |attempt: i32| {
        row.errors
            .iter()
            .any(|e| e.attempt == attempt && e.error == crate::outcome::LEASE_EXPIRED_ERROR)
    };
    // The attempts just before this one, newest first, while each ended in an expired
    // lease (bounded: the row keeps at most `ATTEMPT_ERRORS_MAX` errors).
    let run = (1..=crate::limits::ATTEMPT_ERRORS_MAX as i32)
        .map(|back| row.attempt - back)
        .take_while(|&attempt| attempt >= 0 && expired(attempt))
        .count();
    let leases_expired = u32::try_from(run).unwrap_or(u32::MAX);
    if leases_expired < needed {
        return None;
    }
    let message = format!(
        "step `{}` was not run again: its lease expired {leases_expired} times in a row with \
         no result from the worker holding it (retry.max_attempts is {}); the step may be \
         killing its worker (a crash, an abort, running out of memory)",
        row.position, policy.max_attempts
    );
    Some(AttemptsUsedUp { leases_expired, message })
}

/// What a runtime does with a step result the store refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedCommit {
    /// The claim was superseded (`LeaseLost`): another worker owns the instance now, so
    /// this result is stale and is dropped without touching the instance.
    Discard,
    /// The store could not be reached (`Unavailable`): the same commit may be accepted
    /// later, so it is tried again within the runtime's bound.
    Retry,
    /// The store refused the result itself (`Invalid`, `NotFound`, `Conflict`): it will
    /// be refused every time, so re-running the step cannot help. The step has failed
    /// with a non-retryable error carrying the store's message, and goes through the
    /// machine's error handling like any other failure (by default: dead-lettered).
    Fail(ErrorClass),
}

/// Decides what a refused step result means, from the portable kind of the refusal.
///
/// ```
/// use keel_core::ErrorKind;
/// use keel_core::retry::{refused_commit, ErrorClass, RefusedCommit};
///
/// assert_eq!(refused_commit(ErrorKind::Invalid), RefusedCommit::Fail(ErrorClass::NonRetryable));
/// assert_eq!(refused_commit(ErrorKind::LeaseLost), RefusedCommit::Discard);
/// ```
pub const fn refused_commit(kind: ErrorKind) -> RefusedCommit {
    match FailureKind::of_refusal(kind) {
        FailureKind::LeaseLost => RefusedCommit::Discard,
        FailureKind::Unavailable => RefusedCommit::Retry,
        failure => RefusedCommit::Fail(failure.class()),
    }
}

/// The error a step fails with when the store refused its result
/// ([`RefusedCommit::Fail`]): the store's own message, which says what to fix.
pub fn refused_error(refusal: &impl std::fmt::Display) -> String {
    format!("the store refused the step's result: {refusal}")
}

/// The error of the [`last_resort`] commit: the store refused the step's result
/// (`first`) and then the failure commit that followed it (`second`).
pub fn refused_twice_error(
    first: &impl std::fmt::Display,
    second: &impl std::fmt::Display,
) -> String {
    format!("the store refused the step's result ({first}) and then its failure commit ({second})")
}

/// The smallest failure commit, for a step whose result and then whose failure commit
/// (`refused`) the store refused: suspend with a dead letter carrying `error`, keeping the
/// signals the refused commit named, and nothing else (no context, emits or history, which
/// may be what the store refused). A NUL in the message is escaped, as some stores refuse
/// it in text.
pub fn last_resort(refused: &StepCommit, error: &str) -> StepCommit {
    let signals = refused.failure.as_ref().map(|f| f.signals.clone()).unwrap_or_default();
    let failure = StepFailure {
        error: error.replace('\0', "\\u0000"),
        retryable: false,
        dead_letter: true,
        signals,
        event: None,
    };
    StepCommit::new(refused.id, refused.token, Outcome::Suspend).failure(failure)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;
    const S: fn(u64) -> Duration = Duration::from_secs;

    fn policy(backoff: Backoff, initial: Duration, max: Duration, jitter: Jitter) -> RetryPolicy {
        RetryPolicy { max_attempts: 10, backoff, initial_delay: initial, max_delay: max, jitter }
    }

    /// One schedule: the delays after the failures of attempts 0, 1, 2, … with the given
    /// random value.
    fn check_schedule(policy: &RetryPolicy, random: f64, expected: &[Duration]) {
        let actual: Vec<Duration> =
            (0..expected.len() as u32).map(|attempt| policy.delay_for(attempt, random)).collect();
        assert_eq!(actual, expected, "{policy:?} with random {random}");
    }

    #[test]
    fn backoff_schedules() {
        use Backoff::{Exponential, Linear};
        use Jitter::None as NoJitter;
        let exp = |initial, max, jitter| policy(Exponential, initial, max, jitter);
        let lin = |initial, max, jitter| policy(Linear, initial, max, jitter);
        #[rustfmt::skip]
        let cases: &[(RetryPolicy, f64, &[Duration])] = &[
            // The default policy doubles each delay: 1 s, 2 s, 4 s …, capped at 5 min.
            (RetryPolicy::default(),         0.0,  &[S(1), S(2), S(4), S(8), S(16), S(32), S(64), S(128), S(256), S(300), S(300)]),
            // Linear is the same delay every time.
            (lin(S(1), S(60), NoJitter),     0.0,  &[S(1), S(1), S(1), S(1)]),
            (exp(MS(100), S(1), NoJitter),   0.0,  &[MS(100), MS(200), MS(400), MS(800), S(1), S(1)]),
            // An initial delay above the cap is capped from the start, in both modes.
            (exp(S(10), S(5), NoJitter),     0.0,  &[S(5), S(5)]),
            (lin(S(10), S(5), NoJitter),     0.0,  &[S(5), S(5)]),
            (exp(S(0), S(5), NoJitter),      0.0,  &[S(0), S(0), S(0)]),
            // Jitter shrinks the capped delay by a share driven by the injected random value.
            (exp(S(1), S(60), Jitter::Full),  0.0,  &[S(1), S(2), S(4)]),
            (exp(S(1), S(60), Jitter::Full),  0.5,  &[MS(500), S(1), S(2)]),
            (exp(S(1), S(60), Jitter::Equal), 0.5,  &[MS(750), MS(1500), S(3)]),
            (lin(S(10), S(60), Jitter::Fraction(0.1)), 0.5, &[MS(9500), MS(9500)]),
            (exp(S(60), S(60), Jitter::Full), 0.25, &[S(45), S(45)]),
            // Out-of-range randoms are clamped rather than trusted.
            (lin(S(10), S(60), Jitter::Full), 1.5,      &[S(0)]),
            (lin(S(10), S(60), Jitter::Full), -1.0,     &[S(10)]),
            (lin(S(10), S(60), Jitter::Full), f64::NAN, &[S(10)]),
        ];
        for (policy, random, expected) in cases {
            check_schedule(policy, *random, expected);
        }
    }

    #[test]
    fn exponential_backoff_never_overflows() {
        let exp = |initial, max, jitter| policy(Backoff::Exponential, initial, max, jitter);
        let max = Duration::MAX;
        #[rustfmt::skip]
        let cases: &[(RetryPolicy, u32, Duration)] = &[
            (RetryPolicy::default(),          60,       S(300)),
            (RetryPolicy::default(),          127,      S(300)),
            (RetryPolicy::default(),          128,      S(300)),
            (RetryPolicy::default(),          u32::MAX, S(300)),
            (exp(max, max, Jitter::None),     1,        max),
            (exp(S(1), max, Jitter::None),    60,       S(1 << 60)),
            (exp(S(1), max, Jitter::None),    u32::MAX, max),
            (exp(S(1), max, Jitter::Full),    u32::MAX, max),
        ];
        for (policy, attempt, expected) in cases {
            let delay = policy.delay_for(*attempt, 0.0);
            assert_eq!(delay, *expected, "attempt {attempt} of {policy:?}");
        }
    }

    #[test]
    fn jitter_stays_within_bounds_for_any_random() {
        let cases: &[(Jitter, Duration, Duration)] = &[
            (Jitter::None, S(8), S(8)),
            (Jitter::Full, S(0), S(8)),
            (Jitter::Equal, S(4), S(8)),
            (Jitter::Fraction(0.25), S(6), S(8)),
        ];
        for &(jitter, low, high) in cases {
            let policy = policy(Backoff::Exponential, S(1), S(60), jitter);
            for step in 0..=100 {
                let random = f64::from(step) / 100.0;
                let delay = policy.delay_for(3, random);
                assert!(low <= delay && delay <= high, "{jitter:?} random {random}: {delay:?}");
            }
        }
    }

    /// One decision: policy, failed attempt, error class, expected decision.
    fn check(
        policy: &RetryPolicy,
        failed_attempt: u32,
        class: ErrorClass,
        expected: RetryDecision,
    ) {
        assert_eq!(
            decide(policy, failed_attempt, class, 0.0),
            expected,
            "attempt {failed_attempt}, {class:?}, {policy:?}"
        );
    }

    #[test]
    fn retry_decisions() {
        use DeadLetterReason::{Exhausted, NonRetryable as Fatal};
        use ErrorClass::{NonRetryable, Retryable};
        let retry = |delay| RetryDecision::Retry { delay };
        let dead = |reason| RetryDecision::DeadLetter { reason };
        let three = RetryPolicy::default();
        let one = RetryPolicy { max_attempts: 1, ..three };
        let zero = RetryPolicy { max_attempts: 0, ..three };
        let limit = RetryPolicy { max_attempts: u32::MAX, ..three };
        #[rustfmt::skip]
        let cases: &[(&RetryPolicy, u32, ErrorClass, RetryDecision)] = &[
            // max_attempts = 3: runs at attempts 0, 1, 2; the failure of 2 is final.
            (&three, 0, Retryable, retry(S(1))),
            (&three, 1, Retryable, retry(S(2))),
            (&three, 2, Retryable, dead(Exhausted)),
            (&three, 3, Retryable, dead(Exhausted)),
            (&three, u32::MAX, Retryable, dead(Exhausted)),
            // Non-retryable failures skip the remaining attempts.
            (&three, 0, NonRetryable, dead(Fatal)),
            (&three, 1, NonRetryable, dead(Fatal)),
            (&one, 0, Retryable, dead(Exhausted)),
            // An invalid policy still gives a safe answer: no retries.
            (&zero, 0, Retryable, dead(Exhausted)),
            (&limit, u32::MAX - 2, Retryable, retry(S(300))),
            (&limit, u32::MAX - 1, Retryable, dead(Exhausted)),
        ];
        for &(policy, attempt, class, expected) in cases {
            check(policy, attempt, class, expected);
        }
    }

    /// The whole decision table by failure kind: the same policy and attempt give a retry,
    /// a dead letter or a discard depending only on what kind of failure it was.
    #[test]
    fn decisions_by_failure_kind() {
        use DeadLetterReason::{Exhausted, NonRetryable as Fatal};
        use FailureKind::*;
        let retry = |delay| RetryDecision::Retry { delay };
        let dead = |reason| RetryDecision::DeadLetter { reason };
        let three = RetryPolicy::default();
        let one = RetryPolicy { max_attempts: 1, ..three };
        #[rustfmt::skip]
        let cases: &[(FailureKind, &RetryPolicy, u32, RetryDecision)] = &[
            // Failures that may go away retry with the policy's backoff until exhausted.
            (Action,       &three, 0, retry(S(1))),
            (Action,       &three, 2, dead(Exhausted)),
            (Timeout,      &three, 0, retry(S(1))),
            (Timeout,      &three, 1, retry(S(2))),
            (Timeout,      &three, 2, dead(Exhausted)),
            (Panic,        &three, 0, retry(S(1))),
            (Panic,        &one,   0, dead(Exhausted)),
            // Failures that recur every time skip the remaining attempts.
            (NonRetryable, &three, 0, dead(Fatal)),
            (Refused,      &three, 0, dead(Fatal)),
            (Refused,      &three, 1, dead(Fatal)),
            // A stale or undeliverable result never touches the instance, whatever attempt.
            (LeaseLost,    &three, 0, RetryDecision::Discard),
            (LeaseLost,    &one,   5, RetryDecision::Discard),
            (Unavailable,  &three, 2, RetryDecision::Discard),
        ];
        for &(kind, policy, attempt, expected) in cases {
            assert_eq!(decide(policy, attempt, kind, 0.0), expected, "{kind:?}, attempt {attempt}");
        }
        // An error class is the kind of an error the step's code returned.
        assert_eq!(FailureKind::from(ErrorClass::Retryable), Action);
        assert_eq!(FailureKind::from(ErrorClass::NonRetryable), NonRetryable);
    }

    /// Retry, dead-letter and suspend, dead-letter and skip, drop the event, fail the
    /// instance, or discard: one table over kind, attempt, the dead-letter settings and
    /// whether the step processed one event.
    #[test]
    fn failure_plans_by_kind_attempt_and_dead_letter_policy() {
        use DeadLetterReason::{Exhausted, NonRetryable as Fatal};
        use FailureKind::*;
        use OnDeadLetter::{Skip as S_, Suspend as P_};
        let retry = |delay| FailurePlan::Retry { delay };
        let suspend = |reason| FailurePlan::Suspend { reason };
        let skip = |reason| FailurePlan::Skip { reason };
        let drop = |reason| FailurePlan::DropEvent { reason };
        let fail = |reason| FailurePlan::FailInstance { reason };
        #[rustfmt::skip]
        let cases: &[(FailureKind, u32, OnDeadLetter, bool, bool, FailurePlan)] = &[
            // kind,       attempt, on_dead_letter, dead letters enabled, processing an event
            (Action,       0, P_, true,  true,  retry(S(1))),
            (Action,       0, S_, true,  true,  retry(S(1))),
            (Timeout,      1, S_, true,  true,  retry(S(2))),
            (Action,       2, P_, true,  true,  suspend(Exhausted)),
            (Action,       2, S_, true,  true,  skip(Exhausted)),
            (Panic,        2, S_, true,  true,  skip(Exhausted)),
            // Skipping needs an event to drop; without one the instance suspends.
            (Action,       2, S_, true,  false, suspend(Exhausted)),
            (NonRetryable, 0, P_, true,  true,  suspend(Fatal)),
            (NonRetryable, 0, S_, true,  true,  skip(Fatal)),
            (Refused,      0, S_, true,  false, suspend(Fatal)),
            (LeaseLost,    0, S_, true,  true,  FailurePlan::Discard),
            (Unavailable,  2, P_, true,  true,  FailurePlan::Discard),
            // Dead letters disabled: retries still run; what would be dead-lettered drops
            // the event, or fails the instance when there is no event, whatever
            // on_dead_letter says.
            (Action,       0, P_, false, true,  retry(S(1))),
            (Action,       2, P_, false, true,  drop(Exhausted)),
            (Action,       2, S_, false, true,  drop(Exhausted)),
            (NonRetryable, 0, P_, false, true,  drop(Fatal)),
            (Action,       2, P_, false, false, fail(Exhausted)),
            (NonRetryable, 0, S_, false, false, fail(Fatal)),
            (LeaseLost,    2, P_, false, false, FailurePlan::Discard),
        ];
        for &(kind, attempt, on_dead_letter, enabled, processing, expected) in cases {
            let mut config = QueueConfig { on_dead_letter, ..QueueConfig::default() };
            config.dead_letter.enabled = enabled;
            assert_eq!(
                plan_failure(&config, attempt, kind, processing, 0.0),
                expected,
                "{kind:?}, attempt {attempt}, {on_dead_letter:?}, enabled {enabled}, processing an event: {processing}"
            );
        }
    }

    #[test]
    fn a_discard_records_what_was_lost() {
        let event = serde_json::json!({ "name": "pay", "payload": { "amount": 5 } });
        let entry =
            discard_record(DeadLetterReason::Exhausted, 3, "card declined", "@p", Some(&event));
        assert!(HistoryKind::FailureDiscarded.is(&entry.kind));
        assert_eq!(
            entry.data,
            serde_json::json!({
                "reason": "exhausted", "attempts": 3, "error": "card declined", "step": "@p",
                "event": event, "outcome": "event_dropped",
            })
        );
        let entry = discard_record(DeadLetterReason::NonRetryable, 1, "bad", "charge", None);
        assert_eq!(entry.data["outcome"], "instance_failed");
        assert_eq!(entry.data["reason"], "non_retryable");
        assert_eq!(
            discard_stop_reason(DeadLetterReason::Exhausted, 3, "card declined"),
            "card declined (failed after 3 attempts; dead letters are disabled, so the step was discarded)"
        );
    }

    #[test]
    fn failures_are_classed_and_named_by_kind() {
        use ErrorClass::{NonRetryable as Fatal, Retryable};
        use FailureKind::*;
        #[rustfmt::skip]
        let cases = [
            (Action,       Retryable, "ActionError"),
            (NonRetryable, Fatal,     "ActionError"),
            (Timeout,      Retryable, "Timeout"),
            (Panic,        Retryable, "Panic"),
            (LeaseLost,    Retryable, "ActionError"),
            (Unavailable,  Retryable, "ActionError"),
            (Refused,      Fatal,     "ActionError"),
        ];
        for (kind, class, exception) in cases {
            assert_eq!((kind.class(), kind.exception()), (class, exception), "{kind:?}");
        }
        #[rustfmt::skip]
        let refusals = [
            (ErrorKind::LeaseLost,   LeaseLost),
            (ErrorKind::Unavailable, Unavailable),
            (ErrorKind::Invalid,     Refused),
            (ErrorKind::NotFound,    Refused),
            (ErrorKind::Conflict,    Refused),
        ];
        for (store, kind) in refusals {
            assert_eq!(FailureKind::of_refusal(store), kind, "{store:?}");
        }
    }

    /// Retries never reach the bound (the last allowed attempt's failure dead-letters),
    /// nor do a step's own retries; expired leases in a row do, after `max_attempts` runs
    /// (at least two), and only then.
    #[test]
    fn attempts_are_used_up_only_by_expired_leases_in_a_row() {
        use crate::instance::AttemptError;
        use crate::outcome::reap;
        use crate::time::Timestamp;
        let fresh = fresh_row();
        for max_attempts in [1, 2, 3, 10] {
            let policy = RetryPolicy { max_attempts, ..RetryPolicy::default() };
            // Every run fails: each retry is checked before it runs, and none is refused.
            let mut row = fresh.clone();
            loop {
                assert_eq!(attempts_used_up(&policy, &row), None, "retry at {}", row.attempt);
                let attempt = u32::try_from(row.attempt).unwrap();
                match decide(&policy, attempt, FailureKind::Action, 0.0) {
                    RetryDecision::Retry { .. } => {
                        row.errors.push(AttemptError {
                            attempt: row.attempt,
                            error: "boom".into(),
                            at: Timestamp(0),
                        });
                        row.attempt += 1;
                    }
                    decision => {
                        assert_eq!(
                            decision,
                            RetryDecision::DeadLetter { reason: DeadLetterReason::Exhausted }
                        );
                        break;
                    }
                }
            }
            // Every run takes its worker down: the step runs `max_attempts` times (at
            // least twice), then is refused, naming the leases.
            let mut row = fresh.clone();
            let mut runs = 0;
            while attempts_used_up(&policy, &row).is_none() {
                runs += 1;
                row = reap(&row, Timestamp(0));
                assert!(runs <= max_attempts.max(2), "ran {runs} times under {max_attempts}");
            }
            assert_eq!(runs, max_attempts.max(2));
            let used_up = attempts_used_up(&policy, &row).unwrap();
            assert_eq!(used_up.leases_expired, max_attempts.max(2));
            let times = format!("lease expired {} times in a row", max_attempts.max(2));
            assert!(used_up.message.contains(&times), "{}", used_up.message);
            assert!(used_up.message.contains("may be killing its worker"), "{}", used_up.message);
        }
        // A step that polls with its own `Retry` goes past `max_attempts` and keeps running;
        // a lease lost between two polls is not a run.
        let policy = RetryPolicy::default();
        let mut row = fresh.clone();
        for poll in 0..10 {
            row.attempt += 1; // the step's own Retry: no error recorded
            if poll % 3 == 0 {
                row = reap(&row, Timestamp(0));
            }
            assert_eq!(attempts_used_up(&policy, &row), None, "poll {poll}");
        }
        // A failure breaks the run: two leases after it are not three in a row.
        let mut row = fresh;
        row = reap(&row, Timestamp(0));
        row.errors.push(AttemptError { attempt: 1, error: "boom".into(), at: Timestamp(0) });
        row.attempt = 2;
        row = reap(&reap(&row, Timestamp(0)), Timestamp(0));
        assert_eq!(row.attempt, 4);
        assert_eq!(attempts_used_up(&policy, &row), None);
        row = reap(&row, Timestamp(0));
        assert_eq!(attempts_used_up(&policy, &row).unwrap().leases_expired, 3);
    }

    #[test]
    fn a_refused_commit_is_discarded_retried_or_a_non_retryable_failure_by_kind() {
        use RefusedCommit::{Discard, Fail, Retry};
        #[rustfmt::skip]
        let cases = [
            (ErrorKind::LeaseLost,   Discard),
            (ErrorKind::Unavailable, Retry),
            (ErrorKind::Invalid,     Fail(ErrorClass::NonRetryable)),
            (ErrorKind::NotFound,    Fail(ErrorClass::NonRetryable)),
            (ErrorKind::Conflict,    Fail(ErrorClass::NonRetryable)),
        ];
        for (kind, expected) in cases {
            assert_eq!(refused_commit(kind), expected, "{kind:?}");
        }
    }

    #[test]
    fn validation_names_the_field_and_the_fix() {
        let base = RetryPolicy::default();
        let attempts = |max_attempts| RetryPolicy { max_attempts, ..base };
        let jitter = |fraction| RetryPolicy { jitter: Jitter::Fraction(fraction), ..base };
        let initial = RetryPolicy { initial_delay: S(600), ..base };
        let max_delay = |max_delay| RetryPolicy { max_delay, ..base };
        let year = crate::limits::RETRY_DELAY_MAX;
        #[rustfmt::skip]
        let cases: &[(RetryPolicy, Result<(), &str>)] = &[
            (base,            Ok(())),
            (attempts(1),     Ok(())),
            (attempts(10_000), Ok(())),
            (attempts(0),     Err("retry.max_attempts: must be at least 1 (got 0)")),
            (attempts(10_001), Err("retry.max_attempts: must be at most 10000 (got 10001)")),
            (initial,         Err("retry.initial_delay: must not exceed max_delay (10 minutes > 5 minutes)")),
            (max_delay(year), Ok(())),
            (max_delay(year + S(86_400)), Err("retry.max_delay: must be at most 366 days (got 367 days); to wait longer, park on a signal or a timer")),
            (jitter(0.0),     Ok(())),
            (jitter(1.0),     Ok(())),
            (jitter(1.5),     Err("retry.jitter: must be \"none\", \"full\", \"equal\" or a number from 0.0 to 1.0 (got 1.5)")),
            (jitter(-0.1),    Err("retry.jitter: must be \"none\", \"full\", \"equal\" or a number from 0.0 to 1.0 (got -0.1)")),
            (jitter(f64::NAN), Err("retry.jitter: must be \"none\", \"full\", \"equal\" or a number from 0.0 to 1.0 (got NaN)")),
        ];
        for (policy, expected) in cases {
            let actual = policy.validate().map_err(|error| error.to_string());
            assert_eq!(actual, expected.map_err(str::to_owned), "{policy:?}");
        }
    }

    #[test]
    fn names_parse_case_insensitively_and_list_the_accepted_values() {
        assert_eq!("exponential".parse(), Ok(Backoff::Exponential));
        assert_eq!("Linear".parse(), Ok(Backoff::Linear));
        let error = "quadratic".parse::<Backoff>().unwrap_err().to_string();
        assert_eq!(error, "unknown value \"quadratic\"; accepted: linear, exponential");
        let jitters: Vec<Jitter> =
            serde_json::from_str(r#"["none", "full", "equal", 0.25]"#).unwrap();
        assert_eq!(jitters, [Jitter::None, Jitter::Full, Jitter::Equal, Jitter::Fraction(0.25)]);
    }

    /// What the commit of a failed step carries, for each plan: the outcome, the dead
    /// letter, the event consumed and the history entry.
    #[test]
    fn a_failed_step_commits_what_its_plan_says() {
        use crate::ids::{InstanceId, MachineRef, SignalId};
        use crate::instance::NewInstance;
        use crate::time::Timestamp;
        let new = NewInstance::new(MachineRef::new("order", 1), "charge")
            .context(serde_json::json!({"n": 1}));
        let mut row = Instance::from_new(InstanceId(7), &new, None, Timestamp(0));
        let event = Signal {
            id: SignalId(9),
            target: row.id,
            name: "PAY".into(),
            payload: serde_json::json!({"amount": 5}),
            dedup_key: None,
            priority: None,
            inserted_at: Timestamp(0),
        };
        let config = |on_dead_letter, enabled| {
            let mut config = QueueConfig { on_dead_letter, ..QueueConfig::default() };
            config.dead_letter.enabled = enabled;
            config
        };
        let wait_next =
            Outcome::Await { signal: ANY_SIGNAL.into(), context: row.context.clone(), step: None };
        let wait_pay =
            Outcome::Await { signal: "PAY".into(), context: row.context.clone(), step: None };
        let suspend = config(OnDeadLetter::Suspend, true);
        let skip = config(OnDeadLetter::Skip, true);
        let disabled = config(OnDeadLetter::Suspend, false);

        // Attempt 0 retries with the context it had; a lost lease reported by the step's
        // code is a retryable failure like any other, not a stale result.
        for kind in [FailureKind::Action, FailureKind::LeaseLost, FailureKind::Unavailable] {
            let step = failed_step(&suspend, &row, kind, Some(&event), "boom", 0.0);
            assert_eq!(
                (step.outcome, step.dead_letter, step.consume, step.history),
                (Outcome::Retry { context: row.context.clone(), delay: S(1) }, false, None, None),
                "{kind:?}"
            );
        }
        // Two failed attempts so far: the third is the last.
        for attempt in 0..2 {
            row.errors.push(crate::instance::AttemptError {
                attempt,
                error: "boom".into(),
                at: Timestamp(0),
            });
        }
        row.attempt = 2;
        // The last attempt: suspended with a dead letter, or the event skipped.
        let step = failed_step(&suspend, &row, FailureKind::Action, Some(&event), "boom", 0.0);
        assert_eq!((step.outcome, step.dead_letter, step.consume), (Outcome::Suspend, true, None));
        let step = failed_step(&skip, &row, FailureKind::Action, Some(&event), "boom", 0.0);
        assert_eq!(
            (step.outcome, step.dead_letter, step.consume, step.history),
            (wait_next.clone(), true, Some(SignalId(9)), None)
        );
        // A step machine waiting for one event goes back to waiting for that one, so its
        // next success consumes none of the others it did not await.
        let awaiting = Instance { awaits: Some("PAY".into()), ..row.clone() };
        let step = failed_step(&skip, &awaiting, FailureKind::Action, Some(&event), "boom", 0.0);
        assert_eq!((step.outcome, step.consume), (wait_pay, Some(SignalId(9))));
        // Nothing to skip: suspended.
        let step = failed_step(&skip, &row, FailureKind::Action, None, "boom", 0.0);
        assert_eq!((step.outcome, step.dead_letter, step.consume), (Outcome::Suspend, true, None));
        // Dead letters disabled: the event is dropped and history says what it was ...
        let step = failed_step(&disabled, &row, FailureKind::Action, Some(&event), "boom", 0.0);
        let dropped = serde_json::json!({"name": "PAY", "payload": {"amount": 5}});
        assert_eq!(
            (step.outcome, step.dead_letter, step.consume, step.history),
            (
                wait_next,
                false,
                Some(SignalId(9)),
                Some(discard_record(
                    DeadLetterReason::Exhausted,
                    3,
                    "boom",
                    "charge",
                    Some(&dropped)
                ))
            )
        );
        // ... or, with no event, the instance fails.
        let step = failed_step(&disabled, &row, FailureKind::NonRetryable, None, "boom", 0.0);
        assert_eq!(
            (step.outcome, step.dead_letter, step.consume, step.history),
            (
                Outcome::Stop {
                    reason: discard_stop_reason(DeadLetterReason::NonRetryable, 3, "boom")
                },
                false,
                None,
                Some(discard_record(DeadLetterReason::NonRetryable, 3, "boom", "charge", None))
            )
        );
        // The failure names the event it processed, or else the whole inbox it had.
        let other = Signal { id: SignalId(10), ..event.clone() };
        let inbox = [event.clone(), other];
        let failure = crate::StepFailure::of_step("boom", true, Some(&event), &inbox);
        assert_eq!((failure.signals, failure.event), (vec![SignalId(9)], Some(dropped)));
        let failure = crate::StepFailure::of_step("boom", false, None, &inbox);
        assert_eq!((failure.signals, failure.event), (vec![SignalId(9), SignalId(10)], None));
        assert!(!failure.dead_letter && !failure.retryable);
    }

    /// A row of step `charge` at attempt 0 with no errors.
    fn fresh_row() -> Instance {
        use crate::ids::{InstanceId, MachineRef};
        use crate::instance::NewInstance;
        let new = NewInstance::new(MachineRef::new("order", 1), "charge");
        Instance::from_new(InstanceId(7), &new, None, crate::time::Timestamp(0))
    }

    /// Applies `commit`'s outcome to `row` as the store does, with `failure` when given.
    fn commit(
        row: &Instance,
        outcome: Outcome,
        failure: Option<StepFailure>,
    ) -> crate::outcome::Applied {
        let mut commit = StepCommit::new(row.id, row.fencing_token, outcome);
        commit.failure = failure;
        let facts = crate::outcome::ApplyFacts {
            now: crate::time::Timestamp(0),
            signal_waiting: false,
            children_inserted: 0,
        };
        crate::outcome::apply(row, &commit, facts)
    }

    /// The step polls: its own `Retry`, with no failure.
    fn poll(row: &Instance) -> Instance {
        commit(row, Outcome::Retry { context: row.context.clone(), delay: S(0) }, None).row
    }

    /// The step fails (retryably) and the worker commits what [`failed_step`] plans under
    /// `config`; returns the plan and what the commit applied.
    fn fail(config: &QueueConfig, row: &Instance) -> (FailedStep, crate::outcome::Applied) {
        let step = failed_step(config, row, FailureKind::Action, None, "boom", 0.0);
        let mut failure = StepFailure::of_step("boom", true, None, &[]);
        failure.dead_letter = step.dead_letter;
        let applied = commit(row, step.outcome.clone(), Some(failure));
        (step, applied)
    }

    fn disabled_dead_letters() -> QueueConfig {
        let mut config = QueueConfig::default();
        config.dead_letter.enabled = false;
        config
    }

    /// A step that polled with its own `Retry` up to and past `max_attempts` still has its
    /// whole budget when it first fails: it is retried after the first delay, not
    /// dead-lettered.
    #[test]
    fn polls_do_not_use_up_the_attempts_of_a_later_failure() {
        let config = QueueConfig::default();
        assert_eq!(config.retry.max_attempts, 3);
        let mut row = fresh_row();
        for _ in 0..3 {
            row = poll(&row);
        }
        assert_eq!((row.attempt, row.errors.len()), (3, 0), "a poll records no error");
        assert_eq!(failed_attempts(&row), 0);
        let (step, applied) = fail(&config, &row);
        assert_eq!(
            (step.outcome, step.dead_letter),
            (Outcome::Retry { context: row.context.clone(), delay: S(1) }, false)
        );
        assert_eq!(applied.dead_letter, None);
        assert_eq!(failed_attempts(&applied.row), 1);
    }

    /// Three failures use up `max_attempts = 3`: the third is dead-lettered as exhausted
    /// after 3 attempts, and the dead letter and its history entry say 3 whether or not
    /// the step polled in between.
    #[test]
    fn three_failures_use_up_three_attempts() {
        for (config, polls) in
            [(QueueConfig::default(), 0), (QueueConfig::default(), 2), (disabled_dead_letters(), 0)]
        {
            let mut row = fresh_row();
            for delay in [S(1), S(2)] {
                let (step, applied) = fail(&config, &row);
                assert_eq!(step.outcome, Outcome::Retry { context: row.context.clone(), delay });
                row = applied.row;
                for _ in 0..polls {
                    row = poll(&row);
                }
            }
            assert_eq!(failed_attempts(&row), 2);
            let (step, applied) = fail(&config, &row);
            if config.dead_letter.enabled {
                assert_eq!((step.outcome, step.dead_letter), (Outcome::Suspend, true));
                let letter = applied.dead_letter.expect("a dead letter");
                assert_eq!((letter.reason.as_str(), letter.attempts), ("exhausted", 3));
                assert_eq!(letter.errors.len(), 3);
                let said: Vec<_> =
                    applied.history.iter().filter_map(|h| h.data.get("attempts")).collect();
                assert_eq!(said, [&serde_json::json!(3), &serde_json::json!(3)], "{polls} polls");
            } else {
                assert_eq!(
                    step.history,
                    Some(discard_record(DeadLetterReason::Exhausted, 3, "boom", "charge", None))
                );
                assert_eq!(
                    step.outcome,
                    Outcome::Stop {
                        reason: discard_stop_reason(DeadLetterReason::Exhausted, 3, "boom")
                    }
                );
            }
        }
    }

    /// Failures among polls: only the failures count, for the budget, for the back-off
    /// delay (1 s, then 2 s) and for the attempts reported.
    #[test]
    fn only_failures_among_polls_count() {
        let config = disabled_dead_letters();
        let mut row = poll(&fresh_row());
        let mut delays = Vec::new();
        for _ in 0..2 {
            let (step, applied) = fail(&config, &row);
            let Outcome::Retry { delay, .. } = step.outcome else {
                panic!("a retry after {} failures: {step:?}", failed_attempts(&row));
            };
            delays.push(delay);
            row = poll(&poll(&applied.row));
        }
        assert_eq!(delays, [S(1), S(2)]);
        assert_eq!((row.attempt, failed_attempts(&row)), (7, 2));
        let (step, _) = fail(&config, &row);
        assert_eq!(
            step.history,
            Some(discard_record(DeadLetterReason::Exhausted, 3, "boom", "charge", None))
        );
        // Moving on clears the errors, and with them the count.
        let next = Outcome::Next { step: "ship".into(), context: row.context.clone() };
        assert_eq!(failed_attempts(&commit(&row, next, None).row), 0);
    }

    /// Below the errors a row keeps, the failures are counted; once it holds that many
    /// (older ones may be gone), `row.attempt` is, so a large `max_attempts` still ends.
    #[test]
    fn a_full_error_list_counts_attempts_instead() {
        use crate::instance::AttemptError;
        use crate::limits::ATTEMPT_ERRORS_MAX;
        let max = ATTEMPT_ERRORS_MAX as i32;
        let mut config = QueueConfig::default();
        config.retry.max_attempts = 150;
        let at = crate::time::Timestamp(0);
        let error = |attempt| AttemptError { attempt, error: "boom".into(), at };
        let mut row = fresh_row();
        row.attempt = 150;
        // One fewer than the cap, with polls between: 99 failures, the 100th is retried.
        row.errors = (0..max - 1).map(|n| error(150 - (max - 1) + n - 1)).collect();
        assert_eq!(failed_attempts(&row), ATTEMPT_ERRORS_MAX as u32 - 1);
        let (step, _) = fail(&config, &row);
        assert!(matches!(step.outcome, Outcome::Retry { .. }), "{step:?}");
        // At the cap: attempt 150 of 150 allowed has failed.
        row.errors = (0..max).map(|n| error(150 - max + n)).collect();
        assert_eq!(failed_attempts(&row), 150);
        let (step, applied) = fail(&config, &row);
        assert_eq!((step.outcome, step.dead_letter), (Outcome::Suspend, true));
        assert_eq!(applied.dead_letter.map(|l| l.attempts), Some(151));
        // Duplicate attempt numbers count once.
        row.errors = vec![error(0), error(0), error(2)];
        assert_eq!(failed_attempts(&row), 2);
    }

    /// A jitter value that is none of the accepted ones is refused with the list of them,
    /// naming the key; an integer is a number.
    #[test]
    fn a_bad_jitter_lists_the_accepted_values() {
        use crate::config::KeelConfig;
        for (value, found) in [
            ("\"half\"", "invalid value: string \"half\""),
            ("true", "invalid type: boolean `true`"),
        ] {
            let source = format!("[queue.retry]\njitter = {value}");
            let error = KeelConfig::from_toml_str(&source).unwrap_err().to_string();
            let expected = format!(
                "{found}, expected \"none\", \"full\", \"equal\" or a number from 0.0 to 1.0"
            );
            assert!(error.starts_with("queue.retry.jitter: "), "{error}");
            assert!(error.contains(&expected), "{error}");
        }
        let config = KeelConfig::from_toml_str("[queue.retry]\njitter = 1").unwrap();
        assert_eq!(config.queue.retry.and_then(|r| r.jitter), Some(Jitter::Fraction(1.0)));
        let config = KeelConfig::from_toml_str("[queue.retry]\njitter = \"equal\"").unwrap();
        assert_eq!(config.queue.retry.and_then(|r| r.jitter), Some(Jitter::Equal));
        let json = serde_json::to_string(&[Jitter::None, Jitter::Full, Jitter::Fraction(0.25)]);
        assert_eq!(json.unwrap(), r#"["none","full",0.25]"#);
    }
}
