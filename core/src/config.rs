//! Queue configuration with inheritance: system → machine → event.
//!
//! Each level is a [`PartialQueueConfig`]: every field optional, unknown keys rejected.
//! [`PartialQueueConfig::overlay`] merges two levels key by key (the upper level wins,
//! unspecified keys inherit, nested blocks such as `retry` merge recursively), and
//! [`PartialQueueConfig::resolve`] fills the remaining gaps with the documented defaults and
//! validates the result into a complete [`QueueConfig`].
//!
//! [`KeelConfig`] is the TOML file shape the CLI loads:
//!
//! ```
//! use std::time::Duration;
//! use keel_core::config::KeelConfig;
//! use keel_core::Priority;
//!
//! let config = KeelConfig::from_toml_str(r#"
//!     [queue]
//!     timeout = "30 seconds"
//!     retry = { max_attempts = 5 }
//!
//!     [machines.order.queue]
//!     timeout = "2 minutes"
//!
//!     [machines.order.events.checkout.queue]
//!     priority = "high"
//! "#).unwrap();
//! config.check_applied().unwrap(); // a worker applies every key of it
//!
//! let checkout = config.queue_for("order", Some("checkout")).unwrap();
//! assert_eq!(checkout.timeout, Duration::from_secs(120)); // from the machine
//! assert_eq!(checkout.retry.max_attempts, 5);             // inherited from the system
//! assert_eq!(checkout.priority, Priority::High);          // from the event
//! ```
//!
//! Parsing accepts every documented key at every level; [`KeelConfig::check_applied`]
//! (run by [`KeelConfig::load`]) refuses one a worker would not apply there, such as a
//! queue's `concurrency` under a machine (it belongs to `[queues.<name>]`).
//!
//! Every error names the field by its full path (`machines.order.queue.retry.max_attempts`)
//! and says which values are accepted.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::time::Duration;

use serde::Deserialize;

use crate::duration::serde_human;
use crate::ids::Priority;
pub use crate::names::UnknownName;
pub use crate::names::closest;
use crate::names::name_enum;
use crate::retry::{Backoff, Jitter, RetryPolicy};

name_enum! {
    /// The order in which a queue hands out events.
    #[derive(Default)]
    pub enum Strategy {
        /// Oldest first; priorities are ignored.
        #[default]
        Fifo = "fifo",
        /// Lowest priority value first, oldest first within a priority.
        Priority = "priority",
    }
}

name_enum! {
    /// What happens to an instance when one of its events is dead-lettered.
    #[derive(Default)]
    pub enum OnDeadLetter {
        /// Suspend the instance until the entry is retried or purged, so later events for
        /// the same aggregate keep their order.
        #[default]
        Suspend = "suspend",
        /// Drop the event and carry on with the next one.
        Skip = "skip",
    }
}

/// Dead-letter queue settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadLetterConfig {
    /// Whether failed events are kept at all.
    pub enabled: bool,
    /// How long an entry is kept before the pruner removes it, once its instance is no
    /// longer suspended (cancelled, ended, retried through another entry, or gone): an
    /// entry whose instance is still suspended stays, since it is how that instance is
    /// retried.
    pub retention: Duration,
}

impl Default for DeadLetterConfig {
    /// Enabled, kept for 7 days.
    fn default() -> Self {
        Self { enabled: true, retention: Duration::from_hours(7 * 24) }
    }
}

/// Alerting thresholds. Every threshold is optional; none are set by
/// default. The same type serves as a configuration level, merged field by field.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlertThresholds {
    /// Pending events that raise a warning.
    pub pending_warning: Option<u64>,
    /// Pending events that raise a critical alert.
    pub pending_critical: Option<u64>,
    /// Dead-letter entries that raise a warning.
    pub dlq_warning: Option<u64>,
    /// Dead-letter entries that raise a critical alert.
    pub dlq_critical: Option<u64>,
    /// Processing time that raises a warning.
    #[serde(with = "serde_human::option")]
    pub processing_time_warning: Option<Duration>,
    /// Processing time that raises a critical alert.
    #[serde(with = "serde_human::option")]
    pub processing_time_critical: Option<Duration>,
    /// Age of the oldest ready instance that raises a warning.
    #[serde(with = "serde_human::option")]
    pub oldest_ready_age_warning: Option<Duration>,
    /// Age of the oldest ready instance that raises a critical alert.
    #[serde(with = "serde_human::option")]
    pub oldest_ready_age_critical: Option<Duration>,
    /// Executing instances whose lease ran out (stuck leases) that raise a warning.
    pub stuck_leases_warning: Option<u64>,
    /// Stuck leases that raise a critical alert.
    pub stuck_leases_critical: Option<u64>,
}

impl AlertThresholds {
    /// Merges two levels: values set in `over` win.
    pub fn overlay(&self, over: &Self) -> Self {
        Self {
            pending_warning: over.pending_warning.or(self.pending_warning),
            pending_critical: over.pending_critical.or(self.pending_critical),
            dlq_warning: over.dlq_warning.or(self.dlq_warning),
            dlq_critical: over.dlq_critical.or(self.dlq_critical),
            processing_time_warning: over.processing_time_warning.or(self.processing_time_warning),
            processing_time_critical: over
                .processing_time_critical
                .or(self.processing_time_critical),
            oldest_ready_age_warning: over
                .oldest_ready_age_warning
                .or(self.oldest_ready_age_warning),
            oldest_ready_age_critical: over
                .oldest_ready_age_critical
                .or(self.oldest_ready_age_critical),
            stuck_leases_warning: over.stuck_leases_warning.or(self.stuck_leases_warning),
            stuck_leases_critical: over.stuck_leases_critical.or(self.stuck_leases_critical),
        }
    }

    fn validate(&self, path: &str) -> Result<(), ConfigError> {
        ordered(path, "pending", self.pending_warning, self.pending_critical)?;
        ordered(path, "dlq", self.dlq_warning, self.dlq_critical)?;
        ordered(
            path,
            "processing_time",
            self.processing_time_warning,
            self.processing_time_critical,
        )?;
        ordered(
            path,
            "oldest_ready_age",
            self.oldest_ready_age_warning,
            self.oldest_ready_age_critical,
        )?;
        ordered(path, "stuck_leases", self.stuck_leases_warning, self.stuck_leases_critical)
    }
}

/// A warning threshold above its critical threshold would never warn first.
fn ordered<T: PartialOrd + fmt::Debug>(
    path: &str,
    name: &str,
    warning: Option<T>,
    critical: Option<T>,
) -> Result<(), ConfigError> {
    match (warning, critical) {
        (Some(warning), Some(critical)) if warning > critical => Err(ConfigError::invalid(
            format!("{path}.{name}_warning"),
            format!(
                "must not exceed {name}_critical ({warning:?} > {critical:?}); a warning should fire before the critical alert"
            ),
        )),
        _ => Ok(()),
    }
}

/// A complete, validated queue configuration for one machine or event.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueConfig {
    /// Processing order (default `fifo`).
    pub strategy: Strategy,
    /// Events of this queue processed at once on one worker (default 10).
    pub concurrency: u32,
    /// Processing timeout per event (default 30 seconds).
    pub timeout: Duration,
    /// Priority given to events that do not say otherwise (default `normal`).
    pub priority: Priority,
    /// Retry policy (defaults: 3 attempts, exponential from 1 s, capped at 5 min).
    pub retry: RetryPolicy,
    /// Dead-letter settings (default: enabled, 7 days).
    pub dead_letter: DeadLetterConfig,
    /// What a dead-lettered event does to its instance (default `suspend`).
    pub on_dead_letter: OnDeadLetter,
    /// Alerting thresholds (default: none).
    pub alerts: AlertThresholds,
}

impl QueueConfig {
    /// The upper bound on `concurrency`: every queue has an explicit bound (architecture
    /// invariant 5), and more in-flight events than this on one worker is a typo.
    pub const CONCURRENCY_LIMIT: u32 = 10_000;

    /// Checks every field, naming it under `path` (normally `queue`) in the error.
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        check_concurrency(path, self.concurrency)?;
        check_timeout(path, self.timeout)?;
        self.retry.validate().map_err(|error| {
            ConfigError::invalid(format!("{path}.{}", error.field), error.reason)
        })?;
        check_retention(path, self.dead_letter.retention)?;
        self.alerts.validate(&format!("{path}.alerts"))
    }

    /// Why a machine's configuration set in code (`StepMachine::config`) cannot be used,
    /// or `None`: a field a machine's configuration does not apply
    /// ([`not_applied_in_code`](Self::not_applied_in_code)), or a value out of its bounds
    /// ([`validate`](Self::validate)). Runtimes refuse such a machine, naming it before
    /// this reason.
    ///
    /// ```
    /// use keel_core::config::QueueConfig;
    /// use std::time::Duration;
    ///
    /// assert_eq!(QueueConfig::default().problem_in_code(), None);
    /// let zero = QueueConfig { timeout: Duration::ZERO, ..QueueConfig::default() };
    /// assert_eq!(
    ///     zero.problem_in_code().unwrap(),
    ///     "invalid configuration in code: QueueConfig.timeout: must be greater than zero, e.g. \"30 seconds\""
    /// );
    /// ```
    pub fn problem_in_code(&self) -> Option<String> {
        if let Some((field, fix)) = self.not_applied_in_code() {
            return Some(format!(
                "its QueueConfig sets `{field}`, which a machine's configuration does not \
                 apply (it would change nothing); leave it at its default. Fix: {fix}"
            ));
        }
        let error = self.validate("QueueConfig").err()?;
        Some(format!("invalid configuration in code: {error}"))
    }

    /// The first field a machine's configuration set in code (`StepMachine::config`) moves
    /// away from its default although a machine's configuration does not apply it, with
    /// where it belongs: `concurrency` and `strategy` are a queue's, `priority` is an
    /// instance's or an event's, `alerts` are checked from the configuration file. A
    /// worker applies only `timeout`, `retry`, `dead_letter` and `on_dead_letter` per
    /// step, so any of these four set in code would silently change nothing.
    ///
    /// ```
    /// use keel_core::config::QueueConfig;
    ///
    /// assert_eq!(QueueConfig::default().not_applied_in_code(), None);
    /// let one_at_a_time = QueueConfig { concurrency: 1, ..QueueConfig::default() };
    /// let (field, fix) = one_at_a_time.not_applied_in_code().unwrap();
    /// assert_eq!(field, "concurrency");
    /// assert!(fix.contains("WorkerConfig::queues"));
    /// ```
    pub fn not_applied_in_code(&self) -> Option<(&'static str, &'static str)> {
        let d = Self::default();
        if self.concurrency != d.concurrency {
            return Some((
                "concurrency",
                "concurrency belongs to a queue: give the queue's slots per worker in \
                 WorkerConfig::queues or `[queues.<name>] concurrency`, or a limit across all \
                 workers with `[queues.<name>] global_concurrency`",
            ));
        }
        if self.strategy != d.strategy {
            return Some((
                "strategy",
                "the claim order belongs to a queue: set `[queues.<name>] strategy` (or \
                 `[queue] strategy` for every queue) in the configuration file",
            ));
        }
        if self.priority != d.priority {
            return Some((
                "priority",
                "a priority belongs to an instance or an event: set NewInstance::priority or \
                 NewSignal::priority, or `[machines.<machine>.queue] priority` in the \
                 configuration file",
            ));
        }
        if self.alerts != d.alerts {
            return Some((
                "alerts",
                "alert thresholds are read by `keel health` and /health from the \
                 configuration file: set them under `[machines.<machine>.queue.alerts]` (or \
                 `[queue.alerts]`)",
            ));
        }
        None
    }
}

impl Default for QueueConfig {
    /// The documented defaults.
    fn default() -> Self {
        Self {
            strategy: Strategy::default(),
            concurrency: 10,
            timeout: Duration::from_secs(30),
            priority: Priority::default(),
            retry: RetryPolicy::default(),
            dead_letter: DeadLetterConfig::default(),
            on_dead_letter: OnDeadLetter::default(),
            alerts: AlertThresholds::default(),
        }
    }
}

fn check_concurrency(path: &str, concurrency: u32) -> Result<(), ConfigError> {
    let limit = QueueConfig::CONCURRENCY_LIMIT;
    if (1..=limit).contains(&concurrency) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            format!("{path}.concurrency"),
            format!("must be at least 1 and at most {limit} (got {concurrency})"),
        ))
    }
}

fn check_timeout(path: &str, timeout: Duration) -> Result<(), ConfigError> {
    if timeout.is_zero() {
        return Err(ConfigError::invalid(
            format!("{path}.timeout"),
            "must be greater than zero, e.g. \"30 seconds\"",
        ));
    }
    Ok(())
}

fn check_retention(path: &str, retention: Duration) -> Result<(), ConfigError> {
    if retention.is_zero() {
        return Err(ConfigError::invalid(
            format!("{path}.dead_letter.retention"),
            "must be greater than zero, e.g. \"7 days\"; to keep no entries set dead_letter.enabled = false",
        ));
    }
    Ok(())
}

/// One level of retry settings; unset fields inherit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PartialRetryPolicy {
    /// See [`RetryPolicy::max_attempts`].
    pub max_attempts: Option<u32>,
    /// See [`RetryPolicy::backoff`].
    pub backoff: Option<Backoff>,
    /// See [`RetryPolicy::initial_delay`].
    #[serde(with = "serde_human::option")]
    pub initial_delay: Option<Duration>,
    /// See [`RetryPolicy::max_delay`].
    #[serde(with = "serde_human::option")]
    pub max_delay: Option<Duration>,
    /// See [`RetryPolicy::jitter`].
    pub jitter: Option<Jitter>,
}

impl PartialRetryPolicy {
    /// Merges two levels: values set in `over` win.
    pub fn overlay(&self, over: &Self) -> Self {
        Self {
            max_attempts: over.max_attempts.or(self.max_attempts),
            backoff: over.backoff.or(self.backoff),
            initial_delay: over.initial_delay.or(self.initial_delay),
            max_delay: over.max_delay.or(self.max_delay),
            jitter: over.jitter.or(self.jitter),
        }
    }

    /// Fills unset fields from `defaults`.
    pub fn resolve(&self, defaults: &RetryPolicy) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.max_attempts.unwrap_or(defaults.max_attempts),
            backoff: self.backoff.unwrap_or(defaults.backoff),
            initial_delay: self.initial_delay.unwrap_or(defaults.initial_delay),
            max_delay: self.max_delay.unwrap_or(defaults.max_delay),
            jitter: self.jitter.unwrap_or(defaults.jitter),
        }
    }
}

/// One level of dead-letter settings; unset fields inherit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PartialDeadLetterConfig {
    /// See [`DeadLetterConfig::enabled`].
    pub enabled: Option<bool>,
    /// See [`DeadLetterConfig::retention`].
    #[serde(with = "serde_human::option")]
    pub retention: Option<Duration>,
}

impl PartialDeadLetterConfig {
    /// Merges two levels: values set in `over` win.
    pub fn overlay(&self, over: &Self) -> Self {
        Self {
            enabled: over.enabled.or(self.enabled),
            retention: over.retention.or(self.retention),
        }
    }
}

/// One level of queue configuration (system, machine or event); unset fields inherit.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PartialQueueConfig {
    /// See [`QueueConfig::strategy`].
    pub strategy: Option<Strategy>,
    /// See [`QueueConfig::concurrency`].
    pub concurrency: Option<u32>,
    /// See [`QueueConfig::timeout`].
    #[serde(with = "serde_human::option")]
    pub timeout: Option<Duration>,
    /// See [`QueueConfig::priority`]. From the file: at the system or machine level, the
    /// priority an instance of the machine starts with; at an event's level, the priority
    /// that event carries when sent ([`KeelConfig::start_defaults`],
    /// [`KeelConfig::event_priority`]) — each only where the caller gave none.
    pub priority: Option<Priority>,
    /// The queue new instances of the machine start in (`name = "payments"`), where the
    /// caller gave none; system or machine level only.
    pub name: Option<String>,
    /// See [`QueueConfig::retry`].
    pub retry: Option<PartialRetryPolicy>,
    /// See [`QueueConfig::dead_letter`].
    pub dead_letter: Option<PartialDeadLetterConfig>,
    /// See [`QueueConfig::on_dead_letter`].
    pub on_dead_letter: Option<OnDeadLetter>,
    /// See [`QueueConfig::alerts`].
    pub alerts: Option<AlertThresholds>,
    /// The per-key rate limit of every queue without its own (`[queue]` only; see
    /// [`QueueSettings::key_rate_limit`]).
    pub key_rate_limit: Option<RateLimitSettings>,
}

impl PartialQueueConfig {
    /// Merges two levels key by key: values set in `over` win, unset ones inherit from
    /// `self`, and nested blocks merge recursively.
    pub fn overlay(&self, over: &Self) -> Self {
        Self {
            strategy: over.strategy.or(self.strategy),
            concurrency: over.concurrency.or(self.concurrency),
            timeout: over.timeout.or(self.timeout),
            priority: over.priority.or(self.priority),
            name: over.name.clone().or_else(|| self.name.clone()),
            retry: nested(self.retry, over.retry, PartialRetryPolicy::overlay),
            dead_letter: nested(self.dead_letter, over.dead_letter, |base, over| {
                base.overlay(over)
            }),
            on_dead_letter: over.on_dead_letter.or(self.on_dead_letter),
            alerts: nested(self.alerts, over.alerts, AlertThresholds::overlay),
            key_rate_limit: over.key_rate_limit.or(self.key_rate_limit),
        }
    }

    /// Fills unset fields with the defaults and validates the result; errors name the
    /// field under `queue.`.
    pub fn resolve(&self) -> Result<QueueConfig, ConfigError> {
        let defaults = QueueConfig::default();
        let dead_letter = self.dead_letter.unwrap_or_default();
        let config = QueueConfig {
            strategy: self.strategy.unwrap_or(defaults.strategy),
            concurrency: self.concurrency.unwrap_or(defaults.concurrency),
            timeout: self.timeout.unwrap_or(defaults.timeout),
            priority: self.priority.unwrap_or(defaults.priority),
            retry: self.retry.unwrap_or_default().resolve(&defaults.retry),
            dead_letter: DeadLetterConfig {
                enabled: dead_letter.enabled.unwrap_or(defaults.dead_letter.enabled),
                retention: dead_letter.retention.unwrap_or(defaults.dead_letter.retention),
            },
            on_dead_letter: self.on_dead_letter.unwrap_or(defaults.on_dead_letter),
            alerts: self.alerts.unwrap_or_default(),
        };
        config.validate("queue")?;
        Ok(config)
    }

    /// Checks the fields this level sets on their own, naming them under `path`.
    ///
    /// Rules that relate two fields (`initial_delay` ≤ `max_delay`, warning ≤ critical)
    /// wait for [`resolve`](Self::resolve): the other field may come from another level.
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if let Some(concurrency) = self.concurrency {
            check_concurrency(path, concurrency)?;
        }
        if let Some(timeout) = self.timeout {
            check_timeout(path, timeout)?;
        }
        if let Some(retry) = &self.retry {
            // Validate the set fields against values that pass every relational rule.
            let probe = RetryPolicy {
                initial_delay: Duration::ZERO,
                max_delay: retry.max_delay.unwrap_or(crate::limits::RETRY_DELAY_MAX),
                ..retry.resolve(&RetryPolicy::default())
            };
            probe.validate().map_err(|error| {
                ConfigError::invalid(format!("{path}.{}", error.field), error.reason)
            })?;
        }
        if let Some(retention) = self.dead_letter.and_then(|dead_letter| dead_letter.retention) {
            check_retention(path, retention)?;
        }
        if let Some(rate) = self.key_rate_limit {
            rate.validate(&format!("{path}.key_rate_limit"))?;
        }
        Ok(())
    }
}

fn nested<T: Copy>(base: Option<T>, over: Option<T>, merge: impl Fn(&T, &T) -> T) -> Option<T> {
    match (base, over) {
        (Some(base), Some(over)) => Some(merge(&base, &over)),
        (base, over) => over.or(base),
    }
}

/// The position of a region task instance: a child of a chart's own machine that runs one
/// region's entry actions under [`ParallelConfig::job_config`] (`keel_parallel` re-exports
/// it as `REGION_POSITION`).
pub const REGION_POSITION: &str = "@region";

/// Parallel dispatch of region entry actions. Durations accept whole seconds (`300`) or a human
/// string (`"5 minutes"`).
///
/// There are no `lock_timeout` and `lock_ttl` fields: Keel applies region results in
/// the parent's one-event-at-a-time processing under its lease, so nothing waits on a lock,
/// and the lease (`WorkerConfig::lease`) is what expires when a holder dies.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Master switch (default `false`: region entry actions run inline).
    pub enabled: bool,
    /// The queue region tasks run on (`None` = the parent instance's queue). A worker that
    /// registers the chart serves this queue too while dispatch is on.
    pub queue: Option<String>,
    /// Timeout of one region task attempt (default 300 s).
    #[serde(with = "seconds_or_human")]
    pub job_timeout: Duration,
    /// Attempts of a region task before it fails the parallel state (default 3).
    pub job_tries: u32,
    /// Delay between attempts (default 30 s).
    #[serde(with = "seconds_or_human")]
    pub job_backoff: Duration,
    /// How long a dispatched parallel state may stay unfinished before `@fail` (default 0
    /// = off).
    #[serde(with = "seconds_or_human")]
    pub region_timeout: Duration,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            queue: None,
            job_timeout: Duration::from_secs(300),
            job_tries: 3,
            job_backoff: Duration::from_secs(30),
            region_timeout: Duration::ZERO,
        }
    }
}

impl ParallelConfig {
    /// Dispatch on, every other setting at its default.
    pub fn enabled() -> Self {
        Self { enabled: true, ..Self::default() }
    }

    /// The queue settings of region tasks: `job_timeout` per attempt, `job_tries` attempts
    /// `job_backoff` apart (no jitter), everything else from `base` (the machine's
    /// configuration with the configuration file's levels applied: these job settings win
    /// over the file's `timeout` and `retry`).
    pub fn job_config(&self, base: QueueConfig) -> QueueConfig {
        QueueConfig {
            timeout: self.job_timeout,
            retry: RetryPolicy {
                max_attempts: self.job_tries.max(1),
                backoff: Backoff::Linear,
                initial_delay: self.job_backoff,
                max_delay: self.job_backoff,
                jitter: Jitter::None,
            },
            ..base
        }
    }

    /// What a chart machine under these settings sets on its step at `position` over
    /// every level of the configuration file (`resolved`): a region task
    /// ([`REGION_POSITION`]) runs with [`job_config`](Self::job_config), any other step
    /// with `resolved` unchanged.
    pub fn over_step(&self, position: &str, resolved: QueueConfig) -> QueueConfig {
        if position == REGION_POSITION { self.job_config(resolved) } else { resolved }
    }

    /// Checks the ranges, naming fields under `path` (e.g. `parallel_dispatch`).
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        PartialParallelConfig::from(self.clone()).validate(path)
    }
}

/// One level (system or machine) of [`ParallelConfig`]; unset fields inherit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PartialParallelConfig {
    /// See [`ParallelConfig::enabled`].
    pub enabled: Option<bool>,
    /// See [`ParallelConfig::queue`].
    pub queue: Option<String>,
    /// See [`ParallelConfig::job_timeout`].
    #[serde(with = "seconds_or_human::option")]
    pub job_timeout: Option<Duration>,
    /// See [`ParallelConfig::job_tries`].
    pub job_tries: Option<u32>,
    /// See [`ParallelConfig::job_backoff`].
    #[serde(with = "seconds_or_human::option")]
    pub job_backoff: Option<Duration>,
    /// See [`ParallelConfig::region_timeout`].
    #[serde(with = "seconds_or_human::option")]
    pub region_timeout: Option<Duration>,
}

impl From<ParallelConfig> for PartialParallelConfig {
    fn from(c: ParallelConfig) -> Self {
        Self {
            enabled: Some(c.enabled),
            queue: c.queue,
            job_timeout: Some(c.job_timeout),
            job_tries: Some(c.job_tries),
            job_backoff: Some(c.job_backoff),
            region_timeout: Some(c.region_timeout),
        }
    }
}

impl PartialParallelConfig {
    /// Merges two levels: values set in `over` win.
    pub fn overlay(&self, over: &Self) -> Self {
        Self {
            enabled: over.enabled.or(self.enabled),
            queue: over.queue.clone().or_else(|| self.queue.clone()),
            job_timeout: over.job_timeout.or(self.job_timeout),
            job_tries: over.job_tries.or(self.job_tries),
            job_backoff: over.job_backoff.or(self.job_backoff),
            region_timeout: over.region_timeout.or(self.region_timeout),
        }
    }

    /// Fills unset fields with the documented defaults.
    pub fn resolve(&self) -> ParallelConfig {
        let d = ParallelConfig::default();
        ParallelConfig {
            enabled: self.enabled.unwrap_or(d.enabled),
            queue: self.queue.clone().or(d.queue),
            job_timeout: self.job_timeout.unwrap_or(d.job_timeout),
            job_tries: self.job_tries.unwrap_or(d.job_tries),
            job_backoff: self.job_backoff.unwrap_or(d.job_backoff),
            region_timeout: self.region_timeout.unwrap_or(d.region_timeout),
        }
    }

    /// Checks the fields this level sets, naming them under `path`.
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if let Some(tries) = self.job_tries
            && !(1..=RetryPolicy::MAX_ATTEMPTS_LIMIT).contains(&tries)
        {
            return Err(ConfigError::invalid(
                format!("{path}.job_tries"),
                format!("must be between 1 and {} (got {tries})", RetryPolicy::MAX_ATTEMPTS_LIMIT),
            ));
        }
        if self.job_timeout.is_some_and(|t| t.is_zero()) {
            return Err(ConfigError::invalid(
                format!("{path}.job_timeout"),
                "must be greater than zero, e.g. 300 (seconds)",
            ));
        }
        if let Some(queue) = &self.queue
            && queue.is_empty()
        {
            return Err(ConfigError::invalid(
                format!("{path}.queue"),
                "must not be empty; leave it out to use the default queue",
            ));
        }
        // A region task's retry waits `job_backoff` and its region arms a `region_timeout`
        // timer; the store refuses longer ones, so they are refused here, at load.
        let spans = [
            ("job_backoff", self.job_backoff, crate::limits::RETRY_DELAY_MAX),
            ("region_timeout", self.region_timeout, crate::limits::TIMER_INTERVAL_MAX),
        ];
        for (field, value, max) in spans {
            if let Some(value) = value
                && value > max
            {
                return Err(ConfigError::invalid(
                    format!("{path}.{field}"),
                    format!("must be at most {} seconds (got {})", max.as_secs(), value.as_secs()),
                ));
            }
        }
        Ok(())
    }
}

/// Durations as whole seconds or a human string.
mod seconds_or_human {
    use std::fmt;
    use std::time::Duration;

    use serde::de::{self, Deserializer, Visitor};
    use serde::ser::Serializer;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        d.deserialize_any(SecondsOrHuman)
    }

    struct SecondsOrHuman;

    impl Visitor<'_> for SecondsOrHuman {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("whole seconds such as 300, or a duration string such as \"5 minutes\"")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_secs(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v)
                .map(Duration::from_secs)
                .map_err(|_| E::custom(format!("must not be negative (got {v})")))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
            crate::duration::parse(v).map_err(E::custom)
        }
    }

    pub mod option {
        use std::time::Duration;

        use serde::Deserializer;

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}

/// Configuration of one machine: its queue level and its events.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MachineConfig {
    /// Overrides of the system queue settings for this machine.
    pub queue: PartialQueueConfig,
    /// Overrides of the system parallel dispatch settings (`[machines.<name>.parallel_dispatch]`).
    pub parallel_dispatch: PartialParallelConfig,
    /// Per-event overrides, by event name.
    pub events: BTreeMap<String, EventConfig>,
    /// The order its steps see pending events in (`[machines.<name>] inbox_order`):
    /// `arrival` (the default) or `priority`. Unset keeps what the program set in code.
    pub inbox_order: Option<crate::inbox::InboxOrder>,
}

/// Configuration of one event of a machine.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventConfig {
    /// Overrides of the machine queue settings for this event.
    pub queue: PartialQueueConfig,
}

/// The configuration file: system defaults and per-machine, per-event overrides.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KeelConfig {
    /// System-level queue defaults (`[queue]`).
    pub queue: PartialQueueConfig,
    /// Machines by name (`[machines.<name>.queue]`, `[machines.<name>.events.<event>.queue]`).
    pub machines: BTreeMap<String, MachineConfig>,
    /// System-level parallel dispatch defaults (`[parallel_dispatch]`).
    pub parallel_dispatch: PartialParallelConfig,
    /// Schedules by name (`[schedules.<name>]`).
    pub schedules: BTreeMap<String, crate::schedule::ScheduleConfig>,
    /// How long ended instances are kept (`[retention]`); `None` when the file has no
    /// `[retention]` section. A section present (`Some`) replaces the retention a worker
    /// was given in code as a whole, even one whose values are all the defaults.
    pub retention: Option<crate::retention::RetentionConfig>,
    /// Settings of each queue, by queue name (`[queues.<name>]`): claim order and limits.
    pub queues: BTreeMap<String, QueueSettings>,
    /// System-level keys set from the environment ([`ENV_OVERRIDES`]), key → variable,
    /// so [`explain`](Self::explain) can say where a value came from. Not a file key.
    #[serde(skip)]
    pub env_overrides: BTreeMap<String, String>,
}

impl KeelConfig {
    /// Parses and checks a TOML configuration. Syntax errors, unknown keys and unknown
    /// values keep the toml crate's line/column report, prefixed by the key's full path;
    /// out-of-range values name the full path of the offending level.
    pub fn from_toml_str(source: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(source).map_err(|error| ConfigError::Toml {
            path: error.span().and_then(|span| key_path_at(source, &span)),
            error,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every level on its own (see [`PartialQueueConfig::validate`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.queue.validate("queue")?;
        self.parallel_dispatch.validate("parallel_dispatch")?;
        for (name, queue) in &self.queues {
            queue.validate(&format!("queues.{name}"))?;
        }
        for (machine_name, machine) in &self.machines {
            machine.queue.validate(&format!("machines.{machine_name}.queue"))?;
            machine
                .parallel_dispatch
                .validate(&format!("machines.{machine_name}.parallel_dispatch"))?;
            for (event_name, event) in &machine.events {
                event
                    .queue
                    .validate(&format!("machines.{machine_name}.events.{event_name}.queue"))?;
            }
        }
        if let Some(retention) = &self.retention {
            retention.validate()?;
        }
        self.schedules().map(drop)
    }

    /// The machines the file gives a retention of their own (`[retention.machines.<m>]`),
    /// in name order; none without a `[retention]` section.
    pub fn retention_machines(&self) -> impl Iterator<Item = &String> {
        self.retention.iter().flat_map(|retention| retention.machines.keys())
    }

    /// The schedules of `[schedules.<name>]`, checked and ready to serve.
    pub fn schedules(&self) -> Result<Vec<crate::schedule::Schedule>, ConfigError> {
        self.schedules.iter().map(|(name, s)| s.to_schedule(name)).collect()
    }

    /// The merged, not yet resolved levels for a machine and optionally one of its events.
    /// A machine or event without a section simply inherits.
    pub fn layered(&self, machine: &str, event: Option<&str>) -> PartialQueueConfig {
        let Some(machine) = self.machines.get(machine) else {
            return self.queue.clone();
        };
        let merged = self.queue.overlay(&machine.queue);
        match event.and_then(|event| machine.events.get(event)) {
            Some(event) => merged.overlay(&event.queue),
            None => merged,
        }
    }

    /// The inbox order the file sets for `machine`, if it does (it wins over the code's).
    pub fn inbox_order(&self, machine: &str) -> Option<crate::inbox::InboxOrder> {
        self.machines.get(machine).and_then(|m| m.inbox_order)
    }

    /// The parallel dispatch settings of a machine: its section over the system's, then
    /// the documented defaults.
    pub fn parallel_for(&self, machine: &str) -> ParallelConfig {
        self.parallel_over(ParallelConfig::default(), machine)
    }

    /// Checks that every level the file names resolves over the documented defaults: the
    /// system level, each `[machines.<m>]` and each of its events. What a process without
    /// the machines' code (the HTTP server) resolves per step, checked once up front, so a
    /// rule relating fields of two levels (warning ≤ critical, `initial_delay` ≤
    /// `max_delay`) fails at start-up naming the level, not on some later request.
    pub fn check_levels(&self) -> Result<(), ConfigError> {
        self.queue.resolve()?;
        for (machine, section) in &self.machines {
            self.queue_for(machine, None)?;
            for event in section.events.keys() {
                self.queue_for(machine, Some(event))?;
            }
        }
        Ok(())
    }

    /// The complete queue configuration for a machine, or for one of its events: the
    /// file's levels over the documented defaults. A rule the merge breaks is named at the
    /// deepest level the file has for them.
    pub fn queue_for(
        &self,
        machine: &str,
        event: Option<&str>,
    ) -> Result<QueueConfig, ConfigError> {
        self.layered(machine, event).resolve().map_err(|e| self.at_level(machine, event, false, e))
    }

    /// Names an error of a merged configuration (which [`PartialQueueConfig::resolve`]
    /// reports under `queue`, whichever level set the value) at the deepest level the file
    /// has for `machine` and `event`: `machines.<m>.events.<e>.queue` when it has a section
    /// for that event, else `machines.<m>.queue` when it has one for the machine, else
    /// `queue`. A rule relating two fields (`initial_delay` ≤ `max_delay`, warning ≤
    /// critical) may take them from two levels; the deepest is where a fix usually goes.
    /// `over_code`: the file's levels resolve on their own and break the rule only over
    /// what the program set in code, which the path then says.
    fn at_level(
        &self,
        machine: &str,
        event: Option<&str>,
        over_code: bool,
        error: ConfigError,
    ) -> ConfigError {
        let (path, reason) = match error {
            ConfigError::Invalid { path, reason } => (path, reason),
            other @ ConfigError::Toml { .. } => return other,
        };
        let level = match self.machines.get(machine) {
            Some(section) => match event.filter(|e| section.events.contains_key(*e)) {
                Some(event) => format!("machines.{machine}.events.{event}.queue"),
                None => format!("machines.{machine}.queue"),
            },
            None => "queue".to_owned(),
        };
        let field = path.strip_prefix("queue").unwrap_or(&path);
        let note = if over_code { " (over the machine's settings in code)" } else { "" };
        ConfigError::invalid(format!("{level}{field}{note}"), reason)
    }
}

/// A configuration that cannot be used, with the field's path and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The TOML did not parse or did not match the expected shape.
    // toml's report ends with a newline; trim it so the message composes with others.
    #[error(
        "{}{}",
        path.as_ref().map(|path| format!("{path}: ")).unwrap_or_default(),
        error.to_string().trim_end()
    )]
    Toml {
        /// The dotted path of the key the error points at, when it could be determined.
        path: Option<String>,
        /// The toml crate's error, with line and column.
        error: toml::de::Error,
    },
    /// A value out of its accepted range.
    #[error("{path}: {reason}")]
    Invalid {
        /// The dotted path of the field, e.g. `queue.retry.max_attempts`.
        path: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

impl ConfigError {
    fn invalid(path: String, reason: impl Into<String>) -> Self {
        Self::Invalid { path, reason: reason.into() }
    }
}

/// The dotted path of the key an error span points at, so an error can name
/// `machines.order.queue.strategy` rather than only a line number.
fn key_path_at(source: &str, span: &Range<usize>) -> Option<String> {
    let root = toml::de::DeTable::parse(source).ok()?;
    let mut path = Vec::new();
    find_key_path(root.get_ref(), span, &mut path).then(|| path.join("."))
}

/// Depth-first search for the key or value containing `span`. A `[header]` table's span
/// covers only its header, not its body, so every table is searched, not only the ones
/// whose span contains the error.
fn find_key_path(
    table: &toml::de::DeTable<'_>,
    span: &Range<usize>,
    path: &mut Vec<String>,
) -> bool {
    let contains = |outer: Range<usize>| outer.start <= span.start && span.end <= outer.end;
    for (key, value) in table {
        path.push(key.get_ref().to_string());
        if contains(key.span()) {
            return true;
        }
        if let toml::de::DeValue::Table(inner) = value.get_ref()
            && find_key_path(inner, span, path)
        {
            return true;
        }
        if contains(value.span()) {
            return true;
        }
        path.pop();
    }
    false
}

/// Settings of one queue (`[queues.<name>]`), shared by every machine whose instances run
/// on it: the claim order and how many of its rows run at once. Unset fields inherit from
/// the system `[queue]` level where it has the key (`strategy`, `concurrency`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueSettings {
    /// Claim order: `fifo` (eligible order, priorities ignored) or `priority`.
    pub strategy: Option<Strategy>,
    /// Under `priority`: a row ready for at least this long is claimed ahead of every
    /// priority. Unset = no bound.
    #[serde(with = "serde_human::option")]
    pub starvation_after: Option<Duration>,
    /// Rows of this queue one worker runs at once (its slots).
    pub concurrency: Option<u32>,
    /// Rows of this queue executing at once across all workers, enforced by the store.
    pub global_concurrency: Option<u32>,
    /// Rows of one concurrency key executing at once across all workers (default 1).
    pub key_concurrency: Option<u32>,
    /// Starts of this queue per period across all workers (a token bucket).
    pub rate_limit: Option<RateLimitSettings>,
    /// Starts of each concurrency key of this queue per period across all workers (a
    /// token bucket per key). Unset: `[queue] key_rate_limit`, else none.
    pub key_rate_limit: Option<RateLimitSettings>,
}

/// `rate_limit = { starts = 100, per = "1 second", burst = 10 }`: at most `starts` steps of
/// the queue start per `per` across all workers, `burst` at once after an idle spell
/// (default `starts`). Steps over the limit stay ready until tokens return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitSettings {
    /// Starts per period.
    pub starts: u32,
    /// The period.
    #[serde(with = "serde_human")]
    pub per: Duration,
    /// Most starts at once after an idle spell (default `starts`).
    #[serde(default)]
    pub burst: Option<u32>,
}

impl RateLimitSettings {
    /// Checks the fields, naming them under `path` (e.g. `queues.emails.rate_limit`).
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if self.starts == 0 {
            return Err(ConfigError::invalid(
                format!("{path}.starts"),
                "must be at least 1; pause the queue to stop it",
            ));
        }
        if self.burst == Some(0) {
            return Err(ConfigError::invalid(
                format!("{path}.burst"),
                "must be at least 1 (starts at once after an idle spell); leave it out for `starts`",
            ));
        }
        if self.per.is_zero() {
            return Err(ConfigError::invalid(
                format!("{path}.per"),
                "must be greater than zero, e.g. \"1 second\"",
            ));
        }
        Ok(())
    }

    /// The token bucket a claim applies.
    pub fn limit(&self) -> crate::plan::claim::RateLimit {
        crate::plan::claim::RateLimit {
            starts: self.starts,
            per: self.per,
            burst: self.burst.unwrap_or(self.starts),
        }
    }
}

impl QueueSettings {
    /// Checks the fields, naming them under `path` (e.g. `queues.emails`).
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if let Some(concurrency) = self.concurrency {
            check_concurrency(path, concurrency)?;
        }
        if let Some(global) = self.global_concurrency
            && !(1..=QueueConfig::CONCURRENCY_LIMIT).contains(&global)
        {
            return Err(ConfigError::invalid(
                format!("{path}.global_concurrency"),
                format!(
                    "must be at least 1 and at most {} (got {global}); pause the queue to stop it",
                    QueueConfig::CONCURRENCY_LIMIT
                ),
            ));
        }
        if let Some(rate) = self.rate_limit {
            rate.validate(&format!("{path}.rate_limit"))?;
        }
        if let Some(rate) = self.key_rate_limit {
            rate.validate(&format!("{path}.key_rate_limit"))?;
        }
        if let Some(k) = self.key_concurrency
            && !(1..=QueueConfig::CONCURRENCY_LIMIT).contains(&k)
        {
            return Err(ConfigError::invalid(
                format!("{path}.key_concurrency"),
                format!(
                    "must be at least 1 and at most {} (got {k}); 1 runs one row of a key at a time",
                    QueueConfig::CONCURRENCY_LIMIT
                ),
            ));
        }
        if self.starvation_after.is_some_and(|d| d.is_zero()) {
            return Err(ConfigError::invalid(
                format!("{path}.starvation_after"),
                "must be greater than zero, e.g. \"5 minutes\"; leave it out for no bound",
            ));
        }
        if self.starvation_after.is_some() && self.strategy == Some(Strategy::Fifo) {
            return Err(ConfigError::invalid(
                format!("{path}.starvation_after"),
                "applies only to strategy = \"priority\" (a fifo queue cannot starve a row); remove it or set strategy = \"priority\"",
            ));
        }
        Ok(())
    }
}

/// Where an effective configuration value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Keel's built-in default.
    Default,
    /// What the program set in code for the machine (`with_config`).
    Code,
    /// The system level of the file (`[queue]`).
    System,
    /// The machine's level (`[machines.<m>.queue]`).
    Machine(String),
    /// The machine's own section (`[machines.<m>]`), for keys that are not queue keys.
    MachineSection(String),
    /// The event's level (`[machines.<m>.events.<e>.queue]`).
    Event(String, String),
    /// The queue's section (`[queues.<q>]`).
    Queue(String),
    /// An environment variable.
    Env(String),
    /// Another section of the file, by its name (e.g. `[parallel_dispatch]`).
    Section(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Code => f.write_str("code"),
            Source::System => f.write_str("[queue]"),
            Source::Machine(m) => write!(f, "[machines.{m}.queue]"),
            Source::MachineSection(m) => write!(f, "[machines.{m}]"),
            Source::Event(m, e) => write!(f, "[machines.{m}.events.{e}.queue]"),
            Source::Queue(q) => write!(f, "[queues.{q}]"),
            Source::Env(var) => write!(f, "env {var}"),
            Source::Section(name) => write!(f, "[{name}]"),
        }
    }
}

/// One line of an effective configuration: the key, its value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effective {
    /// Dotted key, e.g. `retry.max_attempts` or `queues.default.strategy`.
    pub key: String,
    /// The value as it would be written in the file.
    pub value: String,
    /// Where the value came from.
    pub source: Source,
}

/// The environment variables that override the file, each a system-level key (the
/// machine and event levels of the file still win over them for their own keys; the
/// `[queue]` section is what they replace).
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("KEEL_QUEUE_TIMEOUT", "timeout"),
    ("KEEL_QUEUE_CONCURRENCY", "concurrency"),
    ("KEEL_QUEUE_STRATEGY", "strategy"),
    ("KEEL_QUEUE_RETRY_MAX_ATTEMPTS", "retry.max_attempts"),
];

impl KeelConfig {
    /// Reads a configuration file, then applies the environment overrides
    /// ([`ENV_OVERRIDES`]) read through `env`, then checks that every key is applied by
    /// this version ([`check_applied`](Self::check_applied)). Errors name the file, the
    /// key and the fix.
    pub fn load(
        source: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<Effective>), ConfigError> {
        let mut config = Self::from_toml_str(source)?;
        let overrides = config.apply_env(env)?;
        config.check_applied()?;
        Ok((config, overrides))
    }

    /// Applies the environment overrides to the system level; returns what was
    /// overridden, for display.
    pub fn apply_env(
        &mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Vec<Effective>, ConfigError> {
        let mut applied = Vec::new();
        for &(var, key) in ENV_OVERRIDES {
            let Some(raw) = env(var) else { continue };
            let raw = raw.trim().to_owned();
            let bad = |reason: String| ConfigError::invalid(var.to_owned(), reason);
            match key {
                "timeout" => {
                    let d = crate::duration::parse(&raw)
                        .map_err(|e| bad(format!("{e}, e.g. KEEL_QUEUE_TIMEOUT=\"30 seconds\"")))?;
                    self.queue.timeout = Some(d);
                }
                "concurrency" => {
                    let n = raw.parse::<u32>().map_err(|_| {
                        bad(format!(
                            "must be a whole number from 1 to {} (got {raw:?})",
                            QueueConfig::CONCURRENCY_LIMIT
                        ))
                    })?;
                    self.queue.concurrency = Some(n);
                }
                "strategy" => {
                    let s = raw.parse::<Strategy>().map_err(|e| bad(e.to_string()))?;
                    self.queue.strategy = Some(s);
                }
                _ => {
                    let n = raw.parse::<u32>().map_err(|_| {
                        bad(format!("must be a whole number of attempts, at least 1 (got {raw:?})"))
                    })?;
                    let retry = self.queue.retry.get_or_insert_default();
                    retry.max_attempts = Some(n);
                }
            }
            self.env_overrides.insert(key.to_owned(), var.to_owned());
            applied.push(Effective {
                key: key.to_owned(),
                value: raw,
                source: Source::Env(var.to_owned()),
            });
        }
        // The file was checked when read, so what fails now is a variable's value: name
        // the variable (`KEEL_QUEUE_CONCURRENCY`), not the key it sets.
        self.queue.validate("queue").map_err(|e| match e {
            ConfigError::Invalid { path, reason } => {
                let var = path.strip_prefix("queue.").and_then(|key| self.env_overrides.get(key));
                match var {
                    Some(var) => ConfigError::invalid(var.clone(), reason),
                    None => ConfigError::invalid(format!("{path} (from the environment)"), reason),
                }
            }
            other @ ConfigError::Toml { .. } => other,
        })?;
        Ok(applied)
    }

    /// Refuses a key this version parses but does not apply, so a configuration never
    /// silently means less than it says. Each error names the key and what to do instead.
    pub fn check_applied(&self) -> Result<(), ConfigError> {
        // (path, system level, event level)
        let mut levels: Vec<(String, &PartialQueueConfig, bool, bool)> =
            vec![("queue".to_owned(), &self.queue, true, false)];
        for (m, machine) in &self.machines {
            levels.push((format!("machines.{m}.queue"), &machine.queue, false, false));
            for (e, event) in &machine.events {
                levels.push((format!("machines.{m}.events.{e}.queue"), &event.queue, false, true));
            }
        }
        for (path, level, system, event) in levels {
            let refuse = |key: &str, fix: &str| {
                Err(ConfigError::invalid(
                    format!("{path}.{key}"),
                    format!("is not applied here: {fix}"),
                ))
            };
            if !system && level.strategy.is_some() {
                return refuse(
                    "strategy",
                    "the claim order belongs to a queue; set it under [queues.<name>] (or [queue] for every queue)",
                );
            }
            if !system && level.key_rate_limit.is_some() {
                return refuse(
                    "key_rate_limit",
                    "a rate limit belongs to a queue; set it under [queues.<name>] (or [queue] for every queue)",
                );
            }
            if !system && level.concurrency.is_some() {
                return refuse(
                    "concurrency",
                    "concurrency belongs to a queue; set [queues.<name>] concurrency (slots per worker) or global_concurrency (across all workers)",
                );
            }
            if event && level.alerts.is_some() {
                return refuse(
                    "alerts",
                    "alert thresholds are checked per machine; set them under [machines.<machine>.queue.alerts] (or [queue.alerts] for every machine)",
                );
            }
            if event && level.name.is_some() {
                return refuse(
                    "name",
                    "an instance runs on one queue, chosen when it starts, so an event cannot move it; set the queue under [machines.<machine>.queue] or [queue]",
                );
            }
            if let Some(name) = &level.name
                && name.trim().is_empty()
            {
                return Err(ConfigError::invalid(
                    format!("{path}.name"),
                    "must not be empty; leave it out to start instances in the default queue",
                ));
            }
            if event && level.dead_letter.is_some_and(|dead_letter| dead_letter.retention.is_some())
            {
                return refuse(
                    "dead_letter.retention",
                    "dead letters are purged per machine; set the retention under the machine's [machines.<name>.queue.dead_letter] (or [queue.dead_letter] for every machine)",
                );
            }
        }
        // A starvation bound is read only when ranking by priority; on a queue whose
        // strategy resolves to fifo (its section, else `[queue]` or the environment, else
        // the default) it would do nothing.
        for (name, settings) in &self.queues {
            if settings.starvation_after.is_none()
                || self.claim_policy(name).strategy != Strategy::Fifo
            {
                continue;
            }
            let from = if settings.strategy.is_some() {
                format!("[queues.{name}] strategy")
            } else if let Some(var) = self.env_overrides.get("strategy") {
                format!("the environment ({var})")
            } else if self.queue.strategy.is_some() {
                "[queue] strategy".to_owned()
            } else {
                "the default".to_owned()
            };
            return Err(ConfigError::invalid(
                format!("queues.{name}.starvation_after"),
                format!(
                    "applies only to strategy = \"priority\", and this queue's strategy is fifo (from {from}), so it would do nothing; set strategy = \"priority\" under [queues.{name}] (or [queue] for every queue), or remove starvation_after"
                ),
            ));
        }
        Ok(())
    }

    /// The parallel dispatch settings a chart machine runs with: what the program set in
    /// code (`base`), under the file's `[parallel_dispatch]` and then the machine's own
    /// section; a key the file sets wins, a key it leaves out keeps the code's value.
    pub fn parallel_over(&self, base: ParallelConfig, machine: &str) -> ParallelConfig {
        let mut level = PartialParallelConfig::from(base).overlay(&self.parallel_dispatch);
        if let Some(m) = self.machines.get(machine) {
            level = level.overlay(&m.parallel_dispatch);
        }
        level.resolve()
    }

    /// Fills what the caller of a start left unset ([`NewInstance::given`]) from the
    /// file's system and machine levels: the priority the instance starts with and the
    /// queue it starts in. What the caller set explicitly is kept.
    ///
    /// [`NewInstance::given`]: crate::instance::NewInstance::given
    pub fn start_defaults(&self, new: &mut crate::instance::NewInstance) {
        let level = self.layered(&new.machine.name, None);
        if !new.given.priority
            && let Some(priority) = level.priority
        {
            new.priority = priority;
        }
        if !new.given.queue
            && let Some(queue) = level.name
        {
            new.queue = queue;
        }
    }

    /// Every queue the file names: the `name` of the system level and of each machine's
    /// level (where instances start), the `start.queue` of each `[schedules.<name>]`
    /// (where its ticks start instances), the `queue` of `[parallel_dispatch]` and of each
    /// machine's (where region tasks run) and each `[queues.<q>]` section, in name order. A
    /// worker or poll that takes the file serves these besides what it lists itself.
    pub fn named_queues(&self) -> std::collections::BTreeSet<String> {
        let starts = std::iter::once(&self.queue)
            .chain(self.machines.values().map(|m| &m.queue))
            .filter_map(|level| level.name.clone());
        let regions = std::iter::once(&self.parallel_dispatch)
            .chain(self.machines.values().map(|m| &m.parallel_dispatch))
            .filter_map(|level| level.queue.clone());
        starts
            .chain(self.schedule_queues())
            .chain(regions)
            .chain(self.queues.keys().cloned())
            .collect()
    }

    /// The queues the file's schedules start instances in (`[schedules.<name>] start =
    /// { queue = … }`).
    fn schedule_queues(&self) -> impl Iterator<Item = String> + '_ {
        self.schedules.values().filter_map(|s| s.start.as_ref()?.queue.clone())
    }

    /// The priority the file gives event `event` sent to an instance of `machine`: the
    /// event's own section (`[machines.<machine>.events.<event>.queue] priority`). The
    /// machine and system levels set the priority instances start with, not their
    /// events' (an event at its instance's own priority would change nothing).
    pub fn event_priority(&self, machine: &str, event: &str) -> Option<Priority> {
        self.machines.get(machine)?.events.get(event)?.queue.priority
    }

    /// Whether some machine's section for events named `event` sets a priority: a sender
    /// that does not know its target's machine looks it up only then.
    pub fn names_event_priority(&self, event: &str) -> bool {
        self.machines
            .values()
            .any(|m| m.events.get(event).is_some_and(|e| e.queue.priority.is_some()))
    }

    /// The claim policy of `queue`: its strategy (its section, else `[queue]`, else
    /// `fifo`), starvation bound, global limit, key limit, rate limit and per-key rate
    /// limit (its section, else `[queue]`).
    pub fn claim_policy(&self, queue: &str) -> crate::plan::claim::ClaimPolicy {
        let settings = self.queues.get(queue).copied().unwrap_or_default();
        crate::plan::claim::ClaimPolicy {
            strategy: settings.strategy.or(self.queue.strategy).unwrap_or_default(),
            starvation_after: settings.starvation_after,
            global_limit: settings.global_concurrency,
            key_limit: settings.key_concurrency.unwrap_or(1),
            rate: settings.rate_limit.map(|r| r.limit()),
            key_rate: settings.key_rate_limit.or(self.queue.key_rate_limit).map(|r| r.limit()),
        }
    }

    /// The slots one worker gives `queue`, when the file says: its section's
    /// `concurrency`, else the system `[queue] concurrency`.
    pub fn worker_slots(&self, queue: &str) -> Option<u32> {
        self.queues.get(queue).and_then(|q| q.concurrency).or(self.queue.concurrency)
    }

    /// The configuration one step runs with: what the program set in code (`base`), under
    /// the file's levels for the machine and the event the step processes — system, then
    /// machine, then event; a key the file sets wins over the code, a key it leaves out
    /// keeps the code's value.
    pub fn step_config(
        &self,
        base: QueueConfig,
        machine: &str,
        event: Option<&str>,
    ) -> Result<QueueConfig, ConfigError> {
        let file = self.layered(machine, event);
        PartialQueueConfig::from(base).overlay(&file).resolve().map_err(|error| {
            // When the file's levels resolve on their own, the code's values are involved.
            let over_code = file.resolve().is_ok();
            self.at_level(machine, event, over_code, error)
        })
    }

    /// The configuration a step of `machine` at `position` processing `event` runs with
    /// where only this file is known, not the machine's code (`keel serve` handing steps
    /// to remote workers): [`step_config`](Self::step_config) over the documented
    /// defaults, then what a chart sets over the file at that position with the file's
    /// parallel dispatch settings ([`ParallelConfig::over_step`] of
    /// [`parallel_for`](Self::parallel_for): a region task's job settings). This is what
    /// an in-process worker resolves for a chart that sets nothing in code, with the
    /// event [`crate::inbox::step_event`] picks. The server cannot tell a chart's region
    /// task from a plain machine's step named `@region` or `@init`, so it treats every
    /// step at those two positions as a chart's (an in-process plain machine keeps its
    /// own settings and the first signal's there).
    pub fn file_step_config(
        &self,
        machine: &str,
        position: &str,
        event: Option<&str>,
    ) -> Result<QueueConfig, ConfigError> {
        let resolved = self.step_config(QueueConfig::default(), machine, event)?;
        Ok(self.parallel_for(machine).over_step(position, resolved))
    }

    /// The effective configuration of a machine (and optionally one event, and the queue
    /// it runs on), each key with its value and where it came from. `base` is what the
    /// program set in code, when known.
    pub fn explain(
        &self,
        machine: &str,
        event: Option<&str>,
        queue: &str,
        base: Option<QueueConfig>,
    ) -> Result<Vec<Effective>, ConfigError> {
        let resolved = match base {
            Some(base) => self.step_config(base, machine, event)?,
            None => self.queue_for(machine, event)?,
        };
        let m = self.machines.get(machine);
        let e = event.and_then(|e| m.and_then(|m| m.events.get(e)).map(|c| (e, c)));
        let fallback = if base.is_some() { Source::Code } else { Source::Default };
        let source = |pick: &dyn Fn(&PartialQueueConfig) -> bool| -> Source {
            if let Some((name, ev)) = e
                && pick(&ev.queue)
            {
                return Source::Event(machine.to_owned(), name.to_owned());
            }
            if let Some(mc) = m
                && pick(&mc.queue)
            {
                return Source::Machine(machine.to_owned());
            }
            if pick(&self.queue) { Source::System } else { fallback.clone() }
        };
        let retry = |f: &dyn Fn(&PartialRetryPolicy) -> bool| {
            source(&|q: &PartialQueueConfig| q.retry.as_ref().is_some_and(f))
        };
        let jitter = match resolved.retry.jitter {
            Jitter::None => "none".to_owned(),
            Jitter::Full => "full".to_owned(),
            Jitter::Equal => "equal".to_owned(),
            Jitter::Fraction(f) => f.to_string(),
        };
        let human = crate::duration::format;
        let mut out = vec![
            Effective {
                key: "timeout".into(),
                value: human(resolved.timeout),
                source: source(&|q| q.timeout.is_some()),
            },
            Effective {
                key: "retry.max_attempts".into(),
                value: resolved.retry.max_attempts.to_string(),
                source: retry(&|r| r.max_attempts.is_some()),
            },
            Effective {
                key: "retry.backoff".into(),
                value: format!("{:?}", resolved.retry.backoff).to_lowercase(),
                source: retry(&|r| r.backoff.is_some()),
            },
            Effective {
                key: "retry.initial_delay".into(),
                value: human(resolved.retry.initial_delay),
                source: retry(&|r| r.initial_delay.is_some()),
            },
            Effective {
                key: "retry.max_delay".into(),
                value: human(resolved.retry.max_delay),
                source: retry(&|r| r.max_delay.is_some()),
            },
            Effective {
                key: "retry.jitter".into(),
                value: jitter,
                source: retry(&|r| r.jitter.is_some()),
            },
            Effective {
                key: "on_dead_letter".into(),
                value: resolved.on_dead_letter.to_string(),
                source: source(&|q| q.on_dead_letter.is_some()),
            },
            Effective {
                key: "dead_letter.enabled".into(),
                value: resolved.dead_letter.enabled.to_string(),
                source: source(&|q| q.dead_letter.as_ref().is_some_and(|d| d.enabled.is_some())),
            },
            Effective {
                key: "dead_letter.retention".into(),
                value: human(resolved.dead_letter.retention),
                source: source(&|q| q.dead_letter.as_ref().is_some_and(|d| d.retention.is_some())),
            },
        ];
        // What a start or a send takes from the file: the machine and system levels only
        // for an instance, the event's own section only for an event.
        let start = |pick: &dyn Fn(&PartialQueueConfig) -> bool| match m {
            Some(mc) if pick(&mc.queue) => Source::Machine(machine.to_owned()),
            _ if pick(&self.queue) => Source::System,
            _ => Source::Default,
        };
        let starts = self.layered(machine, None);
        out.push(Effective {
            key: "priority".into(),
            value: starts.priority.unwrap_or_default().to_string(),
            source: start(&|q| q.priority.is_some()),
        });
        out.push(Effective {
            key: "name".into(),
            value: starts.name.clone().unwrap_or_else(|| crate::ids::DEFAULT_QUEUE.to_owned()),
            source: start(&|q| q.name.is_some()),
        });
        if let Some(event) = event {
            let given = self.event_priority(machine, event);
            out.push(Effective {
                key: format!("events.{event}.priority"),
                value: given.map_or_else(|| "none (the instance's)".to_owned(), |p| p.to_string()),
                source: match given {
                    Some(_) => Source::Event(machine.to_owned(), event.to_owned()),
                    None => Source::Default,
                },
            });
        }
        let order = self.inbox_order(machine);
        out.push(Effective {
            key: "inbox_order".into(),
            value: order.unwrap_or_default().to_string(),
            source: match order {
                Some(_) => Source::MachineSection(machine.to_owned()),
                None => fallback.clone(),
            },
        });
        // A system-level value set from the environment says so.
        for line in &mut out {
            if line.source == Source::System
                && let Some(var) = self.env_overrides.get(&line.key)
            {
                line.source = Source::Env(var.clone());
            }
        }
        let settings = self.queues.get(queue).copied().unwrap_or_default();
        let policy = self.claim_policy(queue);
        let env = |key: &str| self.env_overrides.get(key).map(|v| Source::Env(v.clone()));
        let qsource = |set: bool, system: bool| {
            if set {
                Source::Queue(queue.to_owned())
            } else if system {
                Source::System
            } else {
                Source::Default
            }
        };
        out.push(Effective {
            key: format!("queues.{queue}.strategy"),
            value: policy.strategy.to_string(),
            source: match env("strategy") {
                Some(source) if settings.strategy.is_none() => source,
                _ => qsource(settings.strategy.is_some(), self.queue.strategy.is_some()),
            },
        });
        out.push(Effective {
            key: format!("queues.{queue}.starvation_after"),
            value: policy.starvation_after.map_or_else(|| "none".to_owned(), human),
            source: qsource(settings.starvation_after.is_some(), false),
        });
        out.push(Effective {
            key: format!("queues.{queue}.concurrency"),
            value: self
                .worker_slots(queue)
                .map_or_else(|| "worker's setting".to_owned(), |n| n.to_string()),
            source: match env("concurrency") {
                Some(source) if settings.concurrency.is_none() => source,
                _ => qsource(settings.concurrency.is_some(), self.queue.concurrency.is_some()),
            },
        });
        out.push(Effective {
            key: format!("queues.{queue}.global_concurrency"),
            value: policy.global_limit.map_or_else(|| "none".to_owned(), |n| n.to_string()),
            source: qsource(settings.global_concurrency.is_some(), false),
        });
        out.push(Effective {
            key: format!("queues.{queue}.rate_limit"),
            value: policy.rate.map_or_else(
                || "none".to_owned(),
                |r| format!("{} per {}, burst {}", r.starts, human(r.per), r.burst),
            ),
            source: qsource(settings.rate_limit.is_some(), false),
        });
        out.push(Effective {
            key: format!("queues.{queue}.key_concurrency"),
            value: policy.key_limit.to_string(),
            source: qsource(settings.key_concurrency.is_some(), false),
        });
        out.push(Effective {
            key: format!("queues.{queue}.key_rate_limit"),
            value: policy.key_rate.map_or_else(
                || "none".to_owned(),
                |r| format!("{} per {} per key, burst {}", r.starts, human(r.per), r.burst),
            ),
            source: qsource(settings.key_rate_limit.is_some(), self.queue.key_rate_limit.is_some()),
        });
        // Parallel dispatch of a chart machine: its section over `[parallel_dispatch]`.
        let parallel = self.parallel_for(machine);
        let own = m.map(|m| &m.parallel_dispatch);
        let psource = |pick: &dyn Fn(&PartialParallelConfig) -> bool| {
            if own.is_some_and(pick) {
                Source::Section(format!("machines.{machine}.parallel_dispatch"))
            } else if pick(&self.parallel_dispatch) {
                Source::Section("parallel_dispatch".to_owned())
            } else {
                Source::Default
            }
        };
        let rows: [(&str, String, Source); 6] = [
            ("enabled", parallel.enabled.to_string(), psource(&|p| p.enabled.is_some())),
            (
                "queue",
                parallel.queue.clone().unwrap_or_else(|| "the machine's".to_owned()),
                psource(&|p| p.queue.is_some()),
            ),
            ("job_timeout", human(parallel.job_timeout), psource(&|p| p.job_timeout.is_some())),
            ("job_tries", parallel.job_tries.to_string(), psource(&|p| p.job_tries.is_some())),
            ("job_backoff", human(parallel.job_backoff), psource(&|p| p.job_backoff.is_some())),
            (
                "region_timeout",
                if parallel.region_timeout.is_zero() {
                    "off".to_owned()
                } else {
                    human(parallel.region_timeout)
                },
                psource(&|p| p.region_timeout.is_some()),
            ),
        ];
        for (key, value, source) in rows {
            out.push(Effective { key: format!("parallel_dispatch.{key}"), value, source });
        }
        Ok(out)
    }
}

impl From<QueueConfig> for PartialQueueConfig {
    /// Every key set: a complete configuration as a level (e.g. the one a program set in
    /// code, under the file's levels).
    fn from(c: QueueConfig) -> Self {
        PartialQueueConfig {
            strategy: Some(c.strategy),
            concurrency: Some(c.concurrency),
            timeout: Some(c.timeout),
            priority: Some(c.priority),
            name: None,
            retry: Some(PartialRetryPolicy {
                max_attempts: Some(c.retry.max_attempts),
                backoff: Some(c.retry.backoff),
                initial_delay: Some(c.retry.initial_delay),
                max_delay: Some(c.retry.max_delay),
                jitter: Some(c.retry.jitter),
            }),
            dead_letter: Some(PartialDeadLetterConfig {
                enabled: Some(c.dead_letter.enabled),
                retention: Some(c.dead_letter.retention),
            }),
            on_dead_letter: Some(c.on_dead_letter),
            alerts: Some(c.alerts),
            // A queue's limits are not part of a step's configuration.
            key_rate_limit: None,
        }
    }
}

/// A section of the configuration file that names a machine or queue nothing in use
/// needs, so none of its keys takes effect there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnusedSection {
    /// The section as written in the file: `[machines.ordr]`, `[queues.paymnts]`,
    /// `[retention.machines.ordr]`.
    pub section: String,
    /// The name it is most likely a misspelling of ([`closest`]), if any.
    pub closest: Option<String>,
}

impl UnusedSection {
    /// A likely misspelling ([`closest`] found a name): worth a warning. Without one, the
    /// section most likely belongs to another program sharing the file, or to a machine
    /// not deployed yet.
    pub fn is_likely_typo(&self) -> bool {
        self.closest.is_some()
    }
}

/// The sections of `config` that the `machines` and `queues` in use leave unused:
///
/// - every `[machines.<m>]` whose `m` is not one of `machines`;
/// - every `[retention.machines.<m>]` whose `m` is not one of `machines` (a misspelt one
///   leaves its machine under the global `[retention]`, which may prune it sooner);
/// - every `[queues.<q>]` whose `q` is not in use, when `q` is a likely misspelling of
///   one that is. In use: `default`, every one of `queues` (a worker's own claim queues,
///   or the queues a store holds instances in: names a program chose in code, which the
///   file cannot show), the queues `machines` start in or dispatch regions to by the
///   file (`name`, `parallel_dispatch` `queue`, at the system or the machine's level),
///   and the queues the file's schedules start instances in. A queue with no close name
///   is left out for the same reason: a program may start instances in a queue it names
///   only in code.
///
/// A file shared by workers serving different machines names machines a given worker
/// does not register, and a section may be written before its machine is deployed, so
/// this is a report (a worker logs it, `keel config check` prints it), never a refusal;
/// a section with a [`closest`] name is the case worth a warning. Pure: the callers
/// gather the names.
pub fn unused_sections(
    config: &KeelConfig,
    machines: &[&str],
    queues: &[&str],
) -> Vec<UnusedSection> {
    let mut unused = Vec::new();
    let sections = config.machines.keys().map(|name| (name, format!("[machines.{name}]")));
    let retention =
        config.retention_machines().map(|name| (name, format!("[retention.machines.{name}]")));
    for (name, section) in sections.chain(retention) {
        if !machines.contains(&name.as_str()) {
            unused.push(UnusedSection {
                section,
                closest: closest(name, machines.iter().copied()).map(str::to_owned),
            });
        }
    }
    let mut used = std::collections::BTreeSet::from([crate::ids::DEFAULT_QUEUE.to_owned()]);
    used.extend(queues.iter().map(|q| (*q).to_owned()));
    used.extend(config.queue.name.clone());
    used.extend(config.parallel_dispatch.queue.clone());
    used.extend(config.schedule_queues());
    for machine in machines {
        used.extend(config.layered(machine, None).name);
        used.extend(config.parallel_for(machine).queue);
    }
    for queue in config.queues.keys().filter(|q| !used.contains(*q)) {
        if let Some(near) = closest(queue, used.iter().map(String::as_str)) {
            unused.push(UnusedSection {
                section: format!("[queues.{queue}]"),
                closest: Some(near.to_owned()),
            });
        }
    }
    unused
}

/// The `[machines.<machine>.events.<e>]` sections of `config` whose `e` is none of
/// `events`, every event `machine`'s steps can process, each with the event it most
/// likely misspells ([`closest`]). A step takes an event's section by the name of the
/// signal it processes, so such a section never takes effect. The engine's own chart
/// events ([`is_engine_event`](crate::instance::is_engine_event)) are never reported.
/// Only for a machine whose events are all known (a chart), not a step machine's.
pub fn unused_event_sections(
    config: &KeelConfig,
    machine: &str,
    events: &[&str],
) -> Vec<UnusedSection> {
    let Some(section) = config.machines.get(machine) else { return Vec::new() };
    section
        .events
        .keys()
        .filter(|e| !events.contains(&e.as_str()) && !crate::instance::is_engine_event(e))
        .map(|event| UnusedSection {
            section: format!("[machines.{machine}.events.{event}]"),
            closest: closest(event, events.iter().copied()).map(str::to_owned),
        })
        .collect()
}

#[cfg(test)]
mod unused_tests {
    use super::*;

    fn config(text: &str) -> KeelConfig {
        KeelConfig::from_toml_str(text).expect("a valid file")
    }

    fn section(section: &str, near: Option<&str>) -> UnusedSection {
        UnusedSection { section: section.to_owned(), closest: near.map(str::to_owned) }
    }

    const FILE: &str = "[machines.order.queue]\nname = \"payments\"\n\
                        [machines.ordr.queue]\ntimeout = \"5s\"\n\
                        [machines.payment.queue]\ntimeout = \"7s\"\n\
                        [queues.paymnts]\nconcurrency = 2\n\
                        [queues.payments]\nconcurrency = 4\n\
                        [queues.bulk]\nconcurrency = 1\n";

    #[test]
    fn unused_sections_are_machines_not_in_use_and_queues_close_to_one_in_use() {
        let check = |machines: &[&str], queues: &[&str], expected: &[UnusedSection]| {
            let got = unused_sections(&config(FILE), machines, queues);
            assert_eq!(got, expected, "machines {machines:?}, queues {queues:?}");
        };
        check(
            &["order"],
            &[],
            &[
                section("[machines.ordr]", Some("order")),
                section("[machines.payment]", None),
                section("[queues.paymnts]", Some("payments")),
            ],
        );
        check(
            &["order", "payment"],
            &[],
            &[
                section("[machines.ordr]", Some("order")),
                section("[queues.paymnts]", Some("payments")),
            ],
        );
        // A queue in use by code (claimed by the worker, or holding instances) is used.
        check(&["order", "payment", "ordr"], &["paymnts"], &[]);
        check(
            &[],
            &[],
            &[
                section("[machines.order]", None),
                section("[machines.ordr]", None),
                section("[machines.payment]", None),
            ],
        );
        assert_eq!(
            unused_sections(&config("[machines.ship]\n"), &[], &[]),
            [section("[machines.ship]", None)]
        );
    }

    #[test]
    fn a_retention_section_of_a_machine_not_in_use_is_reported_with_the_closest_name() {
        let file = config(
            "[retention]\nended = \"7 days\"\n\
             [retention.machines.ordr]\nended = \"90 days\"\n\
             [retention.machines.audit]\nhistory_per_instance = 10\n\
             [retention.machines.mail]\nended = \"1 day\"\n",
        );
        assert_eq!(
            unused_sections(&file, &["order", "mail"], &[]),
            [
                section("[retention.machines.audit]", None),
                section("[retention.machines.ordr]", Some("order")),
            ],
            "a misspelt machine leaves `order` under the global 7 days"
        );
        assert_eq!(unused_sections(&file, &["order", "mail", "ordr", "audit"], &[]), []);
    }

    #[test]
    fn a_queue_a_file_schedule_starts_in_is_used() {
        let file = config(
            "[schedules.nightly]\ncron = \"0 2 * * *\"\n\
             start = { machine = \"report\", queue = \"tier2\" }\n\
             [queues.tier2]\nconcurrency = 1\n",
        );
        assert_eq!(
            unused_sections(&file, &["report"], &["tier1"]),
            [],
            "tier2 is where the schedule starts instances, not a misspelling of tier1"
        );
    }

    #[test]
    fn a_queue_the_code_claims_from_is_used_even_when_it_resembles_a_file_queue() {
        let file =
            config("[machines.order.queue]\nname = \"tier2\"\n[queues.tier1]\nconcurrency = 4\n");
        assert_eq!(
            unused_sections(&file, &["order"], &[]),
            [section("[queues.tier1]", Some("tier2"))],
            "nothing says tier1 is in use: it looks like a misspelling of tier2"
        );
        assert_eq!(unused_sections(&file, &["order"], &["default", "tier1"]), []);
        // A queue in use is also a name a misspelling is held against.
        let file = config("[queues.tier1x]\nconcurrency = 4\n");
        assert_eq!(
            unused_sections(&file, &[], &["tier1"]),
            [section("[queues.tier1x]", Some("tier1"))]
        );
    }

    fn order_chart() -> crate::chart::Definition {
        use crate::chart::{Definition, Timer};
        Definition::builder("order", 1)
            .initial("cart")
            .state("cart", |s| {
                s.on_to("checkout", "paying")
                    .on("remind", |t| t.every(Timer::hours(1)).max(3).then("give_up"))
                    .on_to("give_up", "paid")
            })
            .state("paying", |s| {
                s.on_to("pay", "paid").on("expire", |t| t.target("paid").after(Timer::days(1)))
            })
            .final_state("paid")
            .build()
            .expect("a valid chart")
    }

    #[test]
    fn an_event_section_naming_no_event_of_the_chart_is_reported_with_the_closest_event() {
        let file = config(
            "[machines.order.events.chekout.queue]\nretry = { max_attempts = 10 }\n\
             [machines.order.events.checkout.queue]\ntimeout = \"5s\"\n\
             [machines.order.events.give_up.queue]\ntimeout = \"5s\"\n\
             [machines.order.events.shipping.queue]\ntimeout = \"5s\"\n\
             [machines.order.events.\"done.invoke.paying\".queue]\ntimeout = \"5s\"\n\
             [machines.order.events.\"parallel.region\".queue]\ntimeout = \"5s\"\n\
             [machines.ship.events.chekout.queue]\ntimeout = \"5s\"\n",
        );
        let events = order_chart().event_alphabet();
        assert_eq!(events, ["checkout", "expire", "give_up", "pay", "remind"], "timer events too");
        let events: Vec<&str> = events.iter().map(String::as_str).collect();
        assert_eq!(
            unused_event_sections(&file, "order", &events),
            [
                section("[machines.order.events.chekout]", Some("checkout")),
                section("[machines.order.events.shipping]", None),
            ],
            "the engine's own events and the events the chart has are in use"
        );
        assert_eq!(unused_event_sections(&file, "payment", &events), []);
        // The machine-level check is unchanged: event sections are not machine sections.
        assert_eq!(unused_sections(&file, &["order", "ship"], &[]), []);
    }
}

#[cfg(test)]
mod parallel_tests {
    use super::*;

    #[test]
    fn parallel_defaults_follow_the_seed() {
        let c = ParallelConfig::default();
        assert!(!c.enabled);
        assert_eq!(c.queue, None);
        assert_eq!(c.job_timeout, Duration::from_secs(300));
        assert_eq!(c.job_tries, 3);
        assert_eq!(c.job_backoff, Duration::from_secs(30));
        assert!(c.region_timeout.is_zero());
        assert_eq!(KeelConfig::default().parallel_for("any"), c);
    }

    #[test]
    fn parallel_settings_inherit_system_then_machine() {
        let config = KeelConfig::from_toml_str(
            r#"
            [parallel_dispatch]
            enabled = true
            job_backoff = 10
            region_timeout = "2 minutes"

            [machines.order.parallel_dispatch]
            job_tries = 5
            queue = "regions"
            "#,
        )
        .unwrap();
        let order = config.parallel_for("order");
        assert!(order.enabled);
        assert_eq!(order.job_tries, 5);
        assert_eq!(order.queue.as_deref(), Some("regions"));
        assert_eq!(order.job_backoff, Duration::from_secs(10));
        assert_eq!(order.region_timeout, Duration::from_secs(120));
        assert_eq!(order.job_timeout, Duration::from_secs(300));
        assert_eq!(config.parallel_for("other").job_tries, 3);
    }

    #[test]
    fn parallel_errors_name_the_field() {
        let e = KeelConfig::from_toml_str("[machines.order.parallel_dispatch]\njob_tries = 0")
            .unwrap_err();
        assert!(e.to_string().starts_with("machines.order.parallel_dispatch.job_tries:"), "{e}");
        let e = KeelConfig::from_toml_str("[parallel_dispatch]\nlock_ttl = 60").unwrap_err();
        assert!(e.to_string().contains("lock_ttl"), "{e}");
        let e = KeelConfig::from_toml_str("[parallel_dispatch]\njob_timeout = 0").unwrap_err();
        assert!(e.to_string().starts_with("parallel_dispatch.job_timeout:"), "{e}");
        // Longer than the store takes: refused when the file loads, not at the first failure.
        let e = KeelConfig::from_toml_str("[parallel_dispatch]\njob_backoff = \"400 days\"")
            .unwrap_err();
        assert!(e.to_string().starts_with("parallel_dispatch.job_backoff: must be at most"), "{e}");
        let e = KeelConfig::from_toml_str(
            "[machines.order.parallel_dispatch]\nregion_timeout = 400000000",
        )
        .unwrap_err();
        let e = e.to_string();
        assert!(e.starts_with("machines.order.parallel_dispatch.region_timeout:"), "{e}");
        KeelConfig::from_toml_str("[parallel_dispatch]\njob_backoff = \"366 days\"")
            .expect("the longest retry delay the store takes");
    }

    #[test]
    fn job_config_maps_tries_backoff_and_timeout() {
        let q = ParallelConfig::enabled().job_config(QueueConfig::default());
        assert_eq!(q.timeout, Duration::from_secs(300));
        assert_eq!(q.retry.max_attempts, 3);
        assert_eq!(q.retry.delay_for(0, 0.5), Duration::from_secs(30));
        assert_eq!(q.retry.delay_for(1, 0.5), Duration::from_secs(30));
        let json: ParallelConfig =
            serde_json::from_value(serde_json::json!({"enabled": true, "job_timeout": "1 minute"}))
                .unwrap();
        assert_eq!(json.job_timeout, Duration::from_secs(60));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    /// One inheritance case: a TOML file, the machine and event asked for, and the
    /// expected differences from the defaults.
    fn check(toml: &str, machine: &str, event: Option<&str>, expected: fn(&mut QueueConfig)) {
        let config = KeelConfig::from_toml_str(toml).unwrap_or_else(|error| panic!("{error}"));
        let mut want = QueueConfig::default();
        expected(&mut want);
        let got = config.queue_for(machine, event).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(got, want, "queue_for({machine:?}, {event:?}) of\n{toml}");
    }

    const FILE: &str = r#"
        [queue]
        concurrency = 10
        timeout = "30 seconds"
        [queue.retry]
        max_attempts = 4
        backoff = "exponential"
        initial_delay = "2s"
        [queue.dead_letter]
        retention = "14 days"

        [machines.order.queue]
        concurrency = 5
        timeout = "60 seconds"
        [machines.order.queue.retry]
        backoff = "linear"

        [machines.order.events.checkout.queue]
        priority = "high"
        [machines.order.events.checkout.queue.retry]
        max_attempts = 6

        [machines.report.queue]
        concurrency = 1
        timeout = "10 minutes"
        on_dead_letter = "skip"
        [machines.report.queue.dead_letter]
        enabled = false
    "#;

    /// TOML, machine, event, and the expected differences from the defaults.
    type InheritanceCase = (&'static str, &'static str, Option<&'static str>, fn(&mut QueueConfig));

    #[test]
    fn inheritance_system_machine_event() {
        let cases: &[InheritanceCase] = &[
            // Empty file: the documented defaults.
            ("", "order", None, |_| {}),
            ("", "order", Some("checkout"), |_| {}),
            // System only: a machine without a section inherits everything.
            (FILE, "invoice", None, |q| {
                q.retry.max_attempts = 4;
                q.retry.initial_delay = S(2);
                q.dead_letter.retention = S(14 * 86_400);
            }),
            // Machine override; nested retry merges (backoff from machine, rest from system).
            (FILE, "order", None, |q| {
                q.concurrency = 5;
                q.timeout = S(60);
                q.retry.max_attempts = 4;
                q.retry.initial_delay = S(2);
                q.retry.backoff = Backoff::Linear;
                q.dead_letter.retention = S(14 * 86_400);
            }),
            // An event without a section is the machine's configuration.
            (FILE, "order", Some("add_item"), |q| {
                q.concurrency = 5;
                q.timeout = S(60);
                q.retry.max_attempts = 4;
                q.retry.initial_delay = S(2);
                q.retry.backoff = Backoff::Linear;
                q.dead_letter.retention = S(14 * 86_400);
            }),
            // Event override on top of machine on top of system, nested retry three deep.
            (FILE, "order", Some("checkout"), |q| {
                q.concurrency = 5;
                q.timeout = S(60);
                q.priority = Priority::High;
                q.retry.max_attempts = 6;
                q.retry.initial_delay = S(2);
                q.retry.backoff = Backoff::Linear;
                q.dead_letter.retention = S(14 * 86_400);
            }),
            // Nested dead_letter merges: enabled from machine, retention from system.
            (FILE, "report", Some("generate"), |q| {
                q.concurrency = 1;
                q.timeout = S(600);
                q.on_dead_letter = OnDeadLetter::Skip;
                q.retry.max_attempts = 4;
                q.retry.initial_delay = S(2);
                q.dead_letter = DeadLetterConfig { enabled: false, retention: S(14 * 86_400) };
            }),
            // Every option, including alerts and jitter forms.
            (
                r#"
                [queue]
                strategy = "priority"
                priority = "bulk"
                [queue.retry]
                jitter = 0.25
                max_delay = "1 minute"
                [queue.alerts]
                pending_warning = 100
                pending_critical = 500
                dlq_warning = 10
                dlq_critical = 50
                processing_time_warning = "5 seconds"
                processing_time_critical = "30 seconds"
                [machines.a.queue.retry]
                jitter = "full"
                [machines.a.queue.alerts]
                pending_warning = 200
                "#,
                "a",
                None,
                |q| {
                    q.strategy = Strategy::Priority;
                    q.priority = Priority::Bulk;
                    q.retry.jitter = Jitter::Full;
                    q.retry.max_delay = S(60);
                    q.alerts = AlertThresholds {
                        pending_warning: Some(200),
                        pending_critical: Some(500),
                        dlq_warning: Some(10),
                        dlq_critical: Some(50),
                        processing_time_warning: Some(S(5)),
                        processing_time_critical: Some(S(30)),
                        ..AlertThresholds::default()
                    };
                },
            ),
            // Bounds are inclusive.
            ("[queue]\nconcurrency = 10000", "m", None, |q| {
                q.concurrency = 10_000;
            }),
            ("[queue.retry]\nmax_attempts = 1", "m", None, |q| {
                q.retry.max_attempts = 1;
            }),
        ];
        for &(toml, machine, event, expected) in cases {
            check(toml, machine, event, expected);
        }
    }

    #[test]
    fn overlay_merges_partials_key_by_key() {
        let system = PartialQueueConfig {
            concurrency: Some(10),
            retry: Some(PartialRetryPolicy {
                max_attempts: Some(3),
                ..PartialRetryPolicy::default()
            }),
            ..PartialQueueConfig::default()
        };
        let machine = PartialQueueConfig {
            concurrency: Some(5),
            retry: Some(PartialRetryPolicy {
                backoff: Some(Backoff::Linear),
                ..PartialRetryPolicy::default()
            }),
            ..PartialQueueConfig::default()
        };
        let merged = system.overlay(&machine);
        assert_eq!(merged.concurrency, Some(5));
        assert_eq!(
            merged.retry,
            Some(PartialRetryPolicy {
                max_attempts: Some(3),
                backoff: Some(Backoff::Linear),
                ..PartialRetryPolicy::default()
            })
        );
        assert_eq!(PartialQueueConfig::default().overlay(&system), system);
        assert_eq!(system.overlay(&PartialQueueConfig::default()), system);
    }

    /// One bad-input case: a TOML file, where to resolve, and fragments the error text
    /// must contain (the field's path, the bad value, the accepted values or the fix).
    fn check_error(toml: &str, machine: &str, event: Option<&str>, expected: &[&str]) {
        let error = KeelConfig::from_toml_str(toml)
            .and_then(|config| config.queue_for(machine, event))
            .expect_err("configuration should be rejected")
            .to_string();
        for fragment in expected {
            assert!(error.contains(fragment), "{fragment:?} not in error:\n{error}");
        }
    }

    #[test]
    fn bad_input_names_the_field_and_the_fix() {
        let units = "accepted units: milliseconds (ms), seconds (s), minutes (m), hours (h), days (d), weeks (w)";
        let cases: &[(&str, &str, Option<&str>, &[&str])] = &[
            (
                "[machines.order.events.checkout.queue]\npriority = \"urgent\"",
                "order",
                Some("checkout"),
                &[
                    "machines.order.events.checkout.queue.priority: ",
                    "line 2",
                    "unknown value \"urgent\"; accepted: critical, high, normal, low, bulk",
                ],
            ),
            (
                "[queue]\ntimeout = \"5 fortnights\"",
                "m",
                None,
                &[
                    "queue.timeout: ",
                    "line 2, column 11",
                    "invalid duration \"5 fortnights\": unknown unit \"fortnights\"",
                    units,
                ],
            ),
            (
                "[queue.retry]\ninitial_delay = \"-5 seconds\"",
                "m",
                None,
                &[
                    "queue.retry.initial_delay: ",
                    "invalid duration \"-5 seconds\": durations must not be negative",
                ],
            ),
            (
                "[queue.retry]\nmax_attempts = 0",
                "m",
                None,
                &["queue.retry.max_attempts: must be at least 1 (got 0)"],
            ),
            (
                "[machines.order.queue.retry]\nmax_attempts = 0",
                "order",
                None,
                &["machines.order.queue.retry.max_attempts: must be at least 1 (got 0)"],
            ),
            (
                "[queue.retry]\nmax_attempts = 10001",
                "m",
                None,
                &["queue.retry.max_attempts: must be at most 10000 (got 10001)"],
            ),
            (
                "[queue]\nstrategy = \"lifo\"",
                "m",
                None,
                &["queue.strategy: ", "line 2", "unknown value \"lifo\"; accepted: fifo, priority"],
            ),
            (
                "[queue.retry]\nbackoff = \"quadratic\"",
                "m",
                None,
                &["queue.retry.backoff: ", "accepted: linear, exponential"],
            ),
            (
                "[machines.order.queue]\non_dead_letter = \"drop\"",
                "order",
                None,
                &["machines.order.queue.on_dead_letter: ", "accepted: suspend, skip"],
            ),
            (
                "[queue]\nconcurrency = 10\nconcurency = 5",
                "m",
                None,
                &["queue.concurency: ", "line 3", "unknown field `concurency`", "`concurrency`"],
            ),
            (
                "[queue.retry]\nattempts = 5",
                "m",
                None,
                &["queue.retry.attempts: ", "unknown field `attempts`", "`max_attempts`"],
            ),
            (
                "[database]\nurl = \"postgres://\"",
                "m",
                None,
                &[
                    "database: ",
                    "unknown field `database`",
                    "expected one of `queue`, `machines`, `parallel_dispatch`",
                ],
            ),
            (
                "[queue]\nconcurrency = 0",
                "m",
                None,
                &["queue.concurrency: must be at least 1 and at most 10000 (got 0)"],
            ),
            (
                "[machines.m.events.e.queue]\ntimeout = \"0s\"",
                "m",
                Some("e"),
                &["machines.m.events.e.queue.timeout: must be greater than zero"],
            ),
            (
                "[queue.dead_letter]\nretention = \"0 days\"",
                "m",
                None,
                &["queue.dead_letter.retention: must be greater than zero", "enabled = false"],
            ),
            (
                "[queue.retry]\njitter = 2.0",
                "m",
                None,
                &[
                    "queue.retry.jitter: must be \"none\", \"full\", \"equal\" or a number from 0.0 to 1.0 (got 2)",
                ],
            ),
            // Relational rules are checked on the merged result, where both values are known.
            (
                "[queue.retry]\nmax_delay = \"1 minute\"\n[machines.m.queue.retry]\ninitial_delay = \"2 minutes\"",
                "m",
                None,
                // Named at the deepest level the file has for the machine.
                &[
                    "machines.m.queue.retry.initial_delay: must not exceed max_delay (2 minutes > 1 minute)",
                ],
            ),
            (
                "[queue.alerts]\ndlq_warning = 60\ndlq_critical = 50",
                "m",
                None,
                &["queue.alerts.dlq_warning: must not exceed dlq_critical (60 > 50)"],
            ),
            // Syntax errors keep toml's line and column.
            ("[queue]\nconcurrency = = 3", "m", None, &["TOML parse error at line 2"]),
            (
                "[queue]\nconcurrency = \"ten\"",
                "m",
                None,
                &["queue.concurrency: ", "line 2", "invalid type: string \"ten\", expected u32"],
            ),
        ];
        for &(toml, machine, event, expected) in cases {
            check_error(toml, machine, event, expected);
        }
    }

    #[test]
    fn check_levels_names_the_level_whose_merge_breaks_a_rule() {
        let cases: &[(&str, &str)] = &[
            (
                "[queue.alerts]\npending_warning = 100\npending_critical = 10",
                "queue.alerts.pending_warning: must not exceed pending_critical (100 > 10)",
            ),
            (
                "[queue.alerts]\npending_critical = 10\n[machines.m.queue.alerts]\npending_warning = 100",
                "machines.m.queue.alerts.pending_warning: must not exceed pending_critical (100 > 10)",
            ),
            (
                "[queue.retry]\nmax_delay = \"1 minute\"\n[machines.m.events.e.queue.retry]\ninitial_delay = \"2 minutes\"",
                "machines.m.events.e.queue.retry.initial_delay: must not exceed max_delay",
            ),
        ];
        for (toml, expected) in cases {
            let config = KeelConfig::from_toml_str(toml).expect("each level is valid alone");
            let error = config.check_levels().expect_err(toml).to_string();
            assert!(error.starts_with(expected), "{toml}: {error}");
        }
        let fine =
            "[queue.alerts]\npending_warning = 1\n[machines.m.queue.alerts]\npending_critical = 5";
        KeelConfig::from_toml_str(fine).unwrap().check_levels().unwrap();
    }

    #[test]
    fn resolve_validates_programmatic_layers_too() {
        let layer = PartialQueueConfig {
            retry: Some(PartialRetryPolicy {
                max_attempts: Some(0),
                ..PartialRetryPolicy::default()
            }),
            ..PartialQueueConfig::default()
        };
        assert_eq!(
            layer.resolve().unwrap_err().to_string(),
            "queue.retry.max_attempts: must be at least 1 (got 0)"
        );
        assert_eq!(PartialQueueConfig::default().resolve(), Ok(QueueConfig::default()));
    }

    #[test]
    fn priority_names_map_to_seed_levels() {
        let cases: &[(&str, u8)] =
            &[("critical", 0), ("high", 1), ("normal", 2), ("low", 3), ("bulk", 4), ("HIGH", 1)];
        for &(name, value) in cases {
            let parsed: Priority = name.parse().unwrap();
            assert_eq!(parsed.level(), i16::from(value), "{name}");
        }
        assert_eq!(Priority::default(), Priority::Normal);
    }
}

#[cfg(test)]
mod applied_tests {
    use super::*;
    use crate::plan::claim::ClaimPolicy;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_key_parsed_but_not_applied_is_refused_with_the_fix() {
        let cases: &[(&str, &str)] = &[
            (
                "[machines.m.queue]\nstrategy = \"priority\"",
                "machines.m.queue.strategy: is not applied here: the claim order belongs to a queue",
            ),
            (
                "[machines.m.events.e.queue]\nconcurrency = 2",
                "machines.m.events.e.queue.concurrency: is not applied here: concurrency belongs to a queue; set [queues.<name>]",
            ),
            (
                "[machines.m.events.e.queue]\nname = \"fast\"",
                "machines.m.events.e.queue.name: is not applied here: an instance runs on one queue",
            ),
            (
                "[machines.m.events.e.queue.dead_letter]\nretention = \"3 days\"",
                "machines.m.events.e.queue.dead_letter.retention: is not applied here: dead letters are purged per machine",
            ),
            (
                "[machines.m.events.e.queue.alerts]\npending_critical = 5",
                "machines.m.events.e.queue.alerts: is not applied here: alert thresholds are checked per machine",
            ),
        ];
        for (toml, expected) in cases {
            let error = KeelConfig::load(toml, |_| None).expect_err(toml).to_string();
            assert!(error.starts_with(expected), "{toml}:\n{error}");
        }
        // What a worker applies loads.
        let ok = "[queue]\nstrategy = \"priority\"\nconcurrency = 4\ntimeout = \"5s\"\n\
                  [queue.alerts]\npending_warning = 10\n\
                  [machines.m.queue]\ntimeout = \"9s\"\non_dead_letter = \"skip\"\n\
                  [machines.m.events.e.queue.dead_letter]\nenabled = false\n\
                  [machines.m.queue.dead_letter]\nretention = \"3 days\"\n\
                  [queue.dead_letter]\nretention = \"1 day\"\n\
                  [parallel_dispatch]\nenabled = true\n\
                  [machines.m.parallel_dispatch]\njob_tries = 5\n\
                  [machines.m.events.e.queue]\npriority = \"high\"\n\
                  [queues.q]\nstarvation_after = \"1 minute\"\nglobal_concurrency = 3";
        KeelConfig::load(ok, |_| None).expect("every key applied");
    }

    #[test]
    fn priority_and_queue_fill_what_a_start_or_a_send_left_unset() {
        use crate::ids::MachineRef;
        use crate::instance::NewInstance;
        let (config, _) = KeelConfig::load(
            "[queue]\npriority = \"low\"\nname = \"bulk\"\n\
             [machines.order.queue]\npriority = \"high\"\n\
             [machines.order.events.cancel.queue]\npriority = \"critical\"\n\
             [machines.mail.queue]\nname = \"mail\"",
            |_| None,
        )
        .expect("priority and name are applied");
        let start = |machine: &str, new: fn(NewInstance) -> NewInstance| {
            let mut n = new(NewInstance::new(MachineRef::new(machine, 1), "a"));
            config.start_defaults(&mut n);
            (n.priority, n.queue)
        };
        assert_eq!(start("order", |n| n), (Priority::High, "bulk".into()), "machine over system");
        assert_eq!(start("mail", |n| n), (Priority::Low, "mail".into()));
        assert_eq!(start("other", |n| n), (Priority::Low, "bulk".into()), "system level");
        assert_eq!(
            start("order", |n| n.priority(Priority::Normal).queue("default")),
            (Priority::Normal, "default".into()),
            "what the caller chose is kept, even the defaults"
        );
        let mut untouched = NewInstance::new(MachineRef::new("m", 1), "a");
        KeelConfig::default().start_defaults(&mut untouched);
        assert_eq!((untouched.priority, untouched.queue.as_str()), (Priority::Normal, "default"));
        assert_eq!(config.event_priority("order", "cancel"), Some(Priority::Critical));
        assert_eq!(config.event_priority("order", "pay"), None, "only the event's own section");
        assert!(config.names_event_priority("cancel") && !config.names_event_priority("pay"));
        let lines = config.explain("order", Some("cancel"), "q", None).unwrap();
        let get = |key: &str| {
            let line = lines.iter().find(|l| l.key == key).unwrap_or_else(|| panic!("{key}"));
            (line.value.clone(), line.source.to_string())
        };
        assert_eq!(get("priority"), ("high".into(), "[machines.order.queue]".into()));
        assert_eq!(get("name"), ("bulk".into(), "[queue]".into()));
        assert_eq!(
            get("events.cancel.priority"),
            ("critical".into(), "[machines.order.events.cancel.queue]".into())
        );
        assert_eq!(get("inbox_order"), ("arrival".into(), "default".into()));
        let ordered =
            KeelConfig::load("[machines.order]\ninbox_order = \"priority\"", |_| None).unwrap().0;
        assert_eq!(ordered.inbox_order("order"), Some(crate::inbox::InboxOrder::Priority));
        let line = ordered.explain("order", None, "q", None).unwrap();
        let line = line.iter().find(|l| l.key == "inbox_order").unwrap();
        assert_eq!(
            (line.value.as_str(), line.source.to_string()),
            ("priority", "[machines.order]".into())
        );
        let empty = KeelConfig::load("[machines.m.queue]\nname = \" \"", |_| None).unwrap_err();
        assert!(
            empty.to_string().starts_with("machines.m.queue.name: must not be empty"),
            "{empty}"
        );
    }

    #[test]
    fn queue_sections_give_the_claim_policy_and_the_slots() {
        let config = KeelConfig::from_toml_str(
            "[queue]\nstrategy = \"priority\"\nconcurrency = 4\n\
             [queues.mail]\nstrategy = \"fifo\"\nglobal_concurrency = 2\nconcurrency = 7\n\
             [queues.api]\nstarvation_after = \"30s\"",
        )
        .unwrap();
        assert_eq!(
            config.claim_policy("mail"),
            ClaimPolicy { global_limit: Some(2), ..ClaimPolicy::new(Strategy::Fifo) }
        );
        assert_eq!(
            config.claim_policy("api"),
            ClaimPolicy { starvation_after: Some(S(30)), ..ClaimPolicy::new(Strategy::Priority) }
        );
        assert_eq!(config.claim_policy("other"), ClaimPolicy::new(Strategy::Priority));
        assert_eq!(KeelConfig::default().claim_policy("any"), ClaimPolicy::new(Strategy::Fifo));
        assert_eq!((config.worker_slots("mail"), config.worker_slots("api")), (Some(7), Some(4)));
        assert_eq!(KeelConfig::default().worker_slots("any"), None);
        for (toml, expected) in [
            (
                "[queues.q]\nglobal_concurrency = 0",
                "queues.q.global_concurrency: must be at least 1",
            ),
            (
                "[queues.q]\nstarvation_after = \"0s\"",
                "queues.q.starvation_after: must be greater than zero",
            ),
            (
                "[queues.q]\nstrategy = \"fifo\"\nstarvation_after = \"1m\"",
                "queues.q.starvation_after: applies only to strategy = \"priority\"",
            ),
        ] {
            let error = KeelConfig::from_toml_str(toml).unwrap_err().to_string();
            assert!(error.starts_with(expected), "{error}");
        }
    }

    #[test]
    fn key_rate_limit_is_parsed_inherited_from_queue_and_checked() {
        use crate::plan::claim::RateLimit;
        let config = KeelConfig::load(
            "[queue]\nkey_rate_limit = { starts = 5, per = \"1 minute\" }\n\
             [queues.api]\nkey_rate_limit = { starts = 20, per = \"1 second\", burst = 2 }\n\
             key_concurrency = 3\n[queues.mail]\nstrategy = \"fifo\"",
            |_| None,
        )
        .unwrap()
        .0;
        let api = config.claim_policy("api");
        assert_eq!(
            (api.key_rate, api.key_limit),
            (Some(RateLimit { starts: 20, per: S(1), burst: 2 }), 3)
        );
        assert_eq!(
            config.claim_policy("mail").key_rate,
            Some(RateLimit { starts: 5, per: S(60), burst: 5 }),
            "[queue] gives every queue its per-key limit; burst defaults to starts"
        );
        assert_eq!(KeelConfig::default().claim_policy("any").key_rate, None);
        let lines = config.explain("m", None, "api", None).unwrap();
        let line = lines.iter().find(|l| l.key == "queues.api.key_rate_limit").expect("listed");
        assert_eq!(
            (line.value.as_str(), line.source.to_string()),
            ("20 per 1 second per key, burst 2", "[queues.api]".to_owned())
        );
        let lines = config.explain("m", None, "mail", None).unwrap();
        let line = lines.iter().find(|l| l.key == "queues.mail.key_rate_limit").expect("listed");
        assert_eq!(line.source.to_string(), "[queue]");
        let lines = KeelConfig::default().explain("m", None, "q", None).unwrap();
        let line = lines.iter().find(|l| l.key == "queues.q.key_rate_limit").expect("listed");
        assert_eq!((line.value.as_str(), line.source.to_string()), ("none", "default".into()));
        for (toml, expected) in [
            (
                "[queues.q]\nkey_rate_limit = { starts = 0, per = \"1s\" }",
                "queues.q.key_rate_limit.starts: must be at least 1",
            ),
            (
                "[queues.q]\nkey_rate_limit = { starts = 3, per = \"0s\" }",
                "queues.q.key_rate_limit.per: must be greater than zero",
            ),
            (
                "[queues.q]\nkey_rate_limit = { starts = 3, per = \"1s\", burst = 0 }",
                "queues.q.key_rate_limit.burst: must be at least 1",
            ),
            (
                "[queue]\nkey_rate_limit = { starts = 0, per = \"1s\" }",
                "queue.key_rate_limit.starts: must be at least 1",
            ),
            (
                "[queues.q]\nrate_limit = { starts = 0, per = \"1s\" }",
                "queues.q.rate_limit.starts: must be at least 1",
            ),
        ] {
            let error = KeelConfig::from_toml_str(toml).unwrap_err().to_string();
            assert!(error.starts_with(expected), "{toml}: {error}");
        }
        // Unknown fields and a missing `per` are refused with the key's path.
        for toml in [
            "[queues.q]\nkey_rate_limit = { starts = 3, per = \"1s\", rate = 2 }",
            "[queues.q]\nkey_rate_limit = { starts = 3 }",
        ] {
            let error = KeelConfig::from_toml_str(toml).unwrap_err().to_string();
            assert!(error.contains("key_rate_limit"), "{toml}: {error}");
        }
        let error = KeelConfig::load(
            "[machines.m.queue]\nkey_rate_limit = { starts = 3, per = \"1s\" }",
            |_| None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.starts_with("machines.m.queue.key_rate_limit: is not applied here"),
            "{error}"
        );
    }

    #[test]
    fn a_step_takes_the_event_over_the_machine_over_the_code() {
        let config = KeelConfig::from_toml_str(
            "[queue]\ntimeout = \"20s\"\n\
             [machines.m.queue.retry]\nmax_attempts = 5\n\
             [machines.m.events.pay.queue]\ntimeout = \"2s\"\non_dead_letter = \"skip\"",
        )
        .unwrap();
        let code = QueueConfig {
            timeout: S(99),
            on_dead_letter: OnDeadLetter::Suspend,
            ..QueueConfig::default()
        };
        let pay = config.step_config(code, "m", Some("pay")).unwrap();
        assert_eq!(
            (pay.timeout, pay.retry.max_attempts, pay.on_dead_letter),
            (S(2), 5, OnDeadLetter::Skip)
        );
        let other = config.step_config(code, "m", Some("browse")).unwrap();
        assert_eq!((other.timeout, other.retry.max_attempts), (S(20), 5));
        let elsewhere = config.step_config(code, "n", None).unwrap();
        assert_eq!((elsewhere.timeout, elsewhere.retry.max_attempts), (S(20), 3));
        assert_eq!(KeelConfig::default().step_config(code, "m", Some("pay")).unwrap(), code);
    }

    #[test]
    fn a_step_known_only_by_the_file_takes_its_event_and_a_region_task_its_job_settings() {
        let config = KeelConfig::from_toml_str(
            "[machines.m.queue]\nretry = { max_attempts = 1 }\n\
             [machines.m.events.pay.queue]\nretry = { max_attempts = 5 }\n\
             dead_letter = { enabled = false }\n\
             [machines.m.parallel_dispatch]\njob_tries = 7\njob_timeout = 9",
        )
        .unwrap();
        let pay = config.file_step_config("m", "charge", Some("pay")).unwrap();
        assert_eq!((pay.retry.max_attempts, pay.dead_letter.enabled), (5, false));
        let step = config.file_step_config("m", "charge", None).unwrap();
        assert_eq!((step.retry.max_attempts, step.dead_letter.enabled), (1, true));
        assert_eq!(step, config.queue_for("m", None).unwrap(), "the file over the defaults");
        let region = config.file_step_config("m", REGION_POSITION, None).unwrap();
        assert_eq!((region.retry.max_attempts, region.timeout), (7, S(9)));
        assert_eq!(region.retry.backoff, Backoff::Linear);
        let other = config.file_step_config("n", REGION_POSITION, None).unwrap();
        assert_eq!(other, ParallelConfig::default().job_config(QueueConfig::default()));
    }

    #[test]
    fn explain_names_where_each_value_came_from() {
        let (config, env) = KeelConfig::load(
            "[queue]\ntimeout = \"20s\"\n[queue.retry]\nmax_attempts = 4\n\
             [machines.m.queue]\non_dead_letter = \"skip\"\n\
             [machines.m.queue.dead_letter]\nenabled = false\n\
             [machines.m.events.pay.queue.retry]\nmax_attempts = 9\n\
             [queues.q]\nglobal_concurrency = 3",
            |var| (var == "KEEL_QUEUE_TIMEOUT").then(|| "1 minute".to_owned()),
        )
        .unwrap();
        assert_eq!(env.len(), 1);
        let lines = config.explain("m", Some("pay"), "q", None).unwrap();
        let get = |key: &str| {
            let line = lines.iter().find(|l| l.key == key).unwrap_or_else(|| panic!("{key}"));
            (line.value.clone(), line.source.to_string())
        };
        assert_eq!(get("timeout"), ("1 minute".into(), "env KEEL_QUEUE_TIMEOUT".into()));
        assert_eq!(get("retry.max_attempts"), ("9".into(), "[machines.m.events.pay.queue]".into()));
        assert_eq!(get("on_dead_letter"), ("skip".into(), "[machines.m.queue]".into()));
        assert_eq!(get("dead_letter.enabled"), ("false".into(), "[machines.m.queue]".into()));
        let system = config.explain("other", None, "q", None).unwrap();
        let enabled = system.iter().find(|l| l.key == "dead_letter.enabled").expect("listed");
        assert_eq!(
            (enabled.value.as_str(), enabled.source.to_string()),
            ("true", "default".into())
        );
        assert_eq!(get("retry.backoff"), ("exponential".into(), "default".into()));
        assert_eq!(get("queues.q.strategy"), ("fifo".into(), "default".into()));
        assert_eq!(get("queues.q.global_concurrency"), ("3".into(), "[queues.q]".into()));
        let bad = KeelConfig::load("", |var| {
            (var == "KEEL_QUEUE_CONCURRENCY").then(|| "lots".to_owned())
        });
        assert!(
            bad.unwrap_err()
                .to_string()
                .starts_with("KEEL_QUEUE_CONCURRENCY: must be a whole number")
        );
        let zero =
            KeelConfig::load("", |var| (var == "KEEL_QUEUE_CONCURRENCY").then(|| "0".to_owned()));
        assert!(
            zero.unwrap_err().to_string().starts_with(
                "KEEL_QUEUE_CONCURRENCY: must be at least 1 and at most 10000 (got 0)"
            )
        );
        let none = KeelConfig::load("", |var| {
            (var == "KEEL_QUEUE_RETRY_MAX_ATTEMPTS").then(|| "0".to_owned())
        });
        let error = none.unwrap_err().to_string();
        assert!(error.starts_with("KEEL_QUEUE_RETRY_MAX_ATTEMPTS: must be at least 1"), "{error}");
    }

    #[test]
    fn a_rule_the_merge_breaks_names_the_files_deepest_level_and_the_code_under_it() {
        let code = QueueConfig {
            retry: RetryPolicy { max_delay: S(10), ..RetryPolicy::default() },
            ..QueueConfig::default()
        };
        let config = KeelConfig::from_toml_str(
            "[machines.order.queue.retry]
initial_delay = \"1 minute\"
\
             [machines.order.events.pay.queue]
timeout = \"5 seconds\"",
        )
        .unwrap();
        // The file alone resolves: only the code's max_delay breaks the rule.
        config.check_levels().unwrap();
        let error = |config: &KeelConfig, base: QueueConfig, machine: &str, event: Option<&str>| {
            config.step_config(base, machine, event).unwrap_err().to_string()
        };
        let over_code = "(over the machine's settings in code): must not exceed max_delay";
        assert_eq!(
            error(&config, code, "order", None),
            "machines.order.queue.retry.initial_delay (over the machine's settings in code): \
             must not exceed max_delay (1 minute > 10 seconds)"
        );
        let at_event = error(&config, code, "order", Some("pay"));
        assert!(
            at_event.starts_with(&format!(
                "machines.order.events.pay.queue.retry.initial_delay {over_code}"
            )),
            "{at_event}"
        );
        // An event the file has no section for: the machine's level.
        let at_machine = error(&config, code, "order", Some("ship"));
        assert!(
            at_machine
                .starts_with(&format!("machines.order.queue.retry.initial_delay {over_code}")),
            "{at_machine}"
        );
        // A machine the file has no section for: the system level.
        let system = KeelConfig::from_toml_str(
            "[queue.retry]
initial_delay = \"1 minute\"",
        )
        .unwrap();
        let at_system = error(&system, code, "order", None);
        assert!(
            at_system.starts_with(&format!("queue.retry.initial_delay {over_code}")),
            "{at_system}"
        );
        // The file's levels break the rule on their own: no word of the code.
        let file = KeelConfig::from_toml_str(
            "[queue.retry]
max_delay = \"10 seconds\"
\
             [machines.order.queue.retry]
initial_delay = \"1 minute\"",
        )
        .unwrap();
        for base in [code, QueueConfig::default()] {
            let alone = error(&file, base, "order", None);
            assert!(
                alone.starts_with(
                    "machines.order.queue.retry.initial_delay: must not exceed max_delay"
                ),
                "{alone}"
            );
        }
        assert!(
            file.queue_for("order", Some("pay"))
                .unwrap_err()
                .to_string()
                .starts_with("machines.order.queue.retry.initial_delay: ")
        );
    }

    #[test]
    fn a_retention_section_is_kept_even_when_it_sets_only_the_defaults() {
        use crate::retention::RetentionConfig;
        assert_eq!(KeelConfig::from_toml_str("").unwrap().retention, None);
        let defaults = KeelConfig::from_toml_str(
            "[retention]
interval = \"1 minute\"",
        )
        .unwrap();
        assert_eq!(defaults.retention, Some(RetentionConfig::default()));
        assert_eq!(
            KeelConfig::from_toml_str("[retention]").unwrap().retention,
            Some(RetentionConfig::default())
        );
        let own = KeelConfig::from_toml_str(
            "[retention.machines.audit]
ended = \"1 day\"",
        )
        .unwrap();
        assert_eq!(own.retention_machines().collect::<Vec<_>>(), ["audit"]);
        let bad = KeelConfig::from_toml_str(
            "[retention]
batch = 0",
        )
        .unwrap_err()
        .to_string();
        assert!(bad.starts_with("retention.batch: "), "{bad}");
    }
    #[test]
    fn the_files_dead_letter_retention_and_parallel_dispatch_resolve_with_their_source() {
        let config = KeelConfig::load(
            "[queue.dead_letter]\nretention = \"1 day\"\n\
             [machines.m.queue.dead_letter]\nretention = \"3 days\"\n\
             [parallel_dispatch]\nenabled = true\njob_timeout = \"1 minute\"\n\
             [machines.m.parallel_dispatch]\njob_tries = 5",
            |_| None,
        )
        .unwrap()
        .0;
        // The step's configuration carries the file's retention over the code's.
        let code = QueueConfig {
            dead_letter: DeadLetterConfig { enabled: true, retention: S(60) },
            ..QueueConfig::default()
        };
        assert_eq!(
            config.step_config(code, "m", None).unwrap().dead_letter.retention,
            S(3 * 86_400)
        );
        assert_eq!(
            config.step_config(code, "other", None).unwrap().dead_letter.retention,
            S(86_400)
        );
        // Parallel dispatch: the machine's section over the system's over the code.
        let base = ParallelConfig { job_backoff: S(7), job_tries: 2, ..ParallelConfig::default() };
        let m = config.parallel_over(base.clone(), "m");
        assert!(m.enabled);
        assert_eq!((m.job_tries, m.job_timeout, m.job_backoff), (5, S(60), S(7)));
        let other = config.parallel_over(base, "other");
        assert_eq!((other.enabled, other.job_tries), (true, 2));
        let lines = config.explain("m", None, "q", Some(code)).unwrap();
        let get = |key: &str| {
            let line = lines.iter().find(|l| l.key == key).unwrap_or_else(|| panic!("{key}"));
            (line.value.clone(), line.source.to_string())
        };
        assert_eq!(get("dead_letter.retention"), ("3 days".into(), "[machines.m.queue]".into()));
        assert_eq!(get("parallel_dispatch.enabled"), ("true".into(), "[parallel_dispatch]".into()));
        assert_eq!(
            get("parallel_dispatch.job_tries"),
            ("5".into(), "[machines.m.parallel_dispatch]".into())
        );
        assert_eq!(get("parallel_dispatch.region_timeout"), ("off".into(), "default".into()));
    }

    #[test]
    fn named_queues_are_where_instances_start_and_every_queue_section() {
        let config = KeelConfig::from_toml_str(
            "[queue]\nname = \"main\"\n[machines.order.queue]\nname = \"payments\"\n\
             [machines.mail.queue]\npriority = \"low\"\n[queues.reports]\nconcurrency = 2\n\
             [queues.payments]\nconcurrency = 10",
        )
        .unwrap();
        let named: Vec<String> = config.named_queues().into_iter().collect();
        assert_eq!(named, ["main", "payments", "reports"]);
        assert!(KeelConfig::default().named_queues().is_empty());
    }

    #[test]
    fn named_queues_include_where_file_schedules_start_instances() {
        let config = KeelConfig::from_toml_str(
            "[schedules.nightly]\ncron = \"0 2 * * *\"\n\
             start = { machine = \"report\", queue = \"reports\" }\n\
             [schedules.hourly]\ncron = \"0 * * * *\"\nstart = { machine = \"report\" }\n\
             [schedules.renew]\ncron = \"0 * * * *\"\n\
             broadcast = { machine = \"sub\", event = \"renew\" }\n",
        )
        .unwrap();
        let named: Vec<String> = config.named_queues().into_iter().collect();
        assert_eq!(named, ["reports"], "a worker given the file must claim the schedule's queue");
    }

    #[test]
    fn starvation_after_on_a_queue_that_resolves_to_fifo_is_refused_with_the_fix() {
        let jobs = "[queues.jobs]\nstarvation_after = \"5 minutes\"\n";
        let refused = |text: &str, env: &[(&str, &str)], from: &str| {
            let error = KeelConfig::load(text, |var| {
                env.iter().find(|(k, _)| *k == var).map(|(_, v)| (*v).to_owned())
            })
            .expect_err(text)
            .to_string();
            assert!(
                error.starts_with(
                    "queues.jobs.starvation_after: applies only to strategy = \"priority\""
                ),
                "{text}: {error}"
            );
            assert!(error.contains(&format!("(from {from})")), "{text}: {error}");
            assert!(error.contains("set strategy = \"priority\" under [queues.jobs]"), "{error}");
        };
        refused(jobs, &[], "the default");
        refused(&format!("[queue]\nstrategy = \"fifo\"\n{jobs}"), &[], "[queue] strategy");
        refused(
            &format!("[queue]\nstrategy = \"priority\"\n{jobs}"),
            &[("KEEL_QUEUE_STRATEGY", "fifo")],
            "the environment (KEEL_QUEUE_STRATEGY)",
        );
        // Where the strategy resolves to priority, the bound is applied.
        for (text, env) in [
            (format!("[queue]\nstrategy = \"priority\"\n{jobs}"), None),
            (format!("{jobs}strategy = \"priority\"\n"), Some("fifo")),
            (jobs.to_owned(), Some("priority")),
        ] {
            let (config, _) = KeelConfig::load(&text, |var| {
                (var == "KEEL_QUEUE_STRATEGY").then_some(env).flatten().map(str::to_owned)
            })
            .unwrap_or_else(|e| panic!("{text} with {env:?}: {e}"));
            let policy = config.claim_policy("jobs");
            assert_eq!(
                (policy.strategy, policy.starvation_after),
                (Strategy::Priority, Some(S(300))),
                "{text}"
            );
        }
    }

    #[test]
    fn named_queues_include_where_region_tasks_run() {
        let config = KeelConfig::from_toml_str(
            "[parallel_dispatch]
enabled = true
queue = \"regions\"
             [machines.order.parallel_dispatch]
queue = \"order-regions\"
             [machines.mail.parallel_dispatch]
enabled = true
",
        )
        .unwrap();
        let named: Vec<String> = config.named_queues().into_iter().collect();
        assert_eq!(named, ["order-regions", "regions"]);
    }
}
