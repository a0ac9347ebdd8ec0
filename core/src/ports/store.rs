//! The store port: the source of truth for instances, inboxes, history and dead letters.
//!
//! The trait is **batch-first**: throughput on a real database is decided by how many rows
//! one statement and one commit carry, so every hot operation takes and returns a batch
//! and reports per item. Methods are named noun-first and take one params struct.
//! Every method takes `now` from the caller; a store never reads a clock.
//! Every params struct with something to check has a `validate()` that every store calls
//! before it reads or writes anything, so bad input is refused the same way everywhere.
//!
//! Every implementation — the in-memory reference included — must pass the conformance
//! suite in `keel-testkit`, which compares it with the pure functions of
//! [`crate::outcome`].

use crate::error::{StoreError, StoreResult};
use crate::ids::{
    DeadLetterId, FencingToken, InstanceId, MachineRef, Revision, SignalId, Status, StatusSet,
    WorkerId,
};
use crate::instance::{
    ChildSummary, DeadLetter, HistoryRecord, Instance, NewInstance, NewSignal, Signal,
    SignalTarget, check_batch, check_name, position_in_state,
};
use crate::limits;
use crate::outcome::StepCommit;
use crate::time::Timestamp;
use crate::timers::{TimerHint, TimerRow};
use async_trait::async_trait;
use std::time::Duration;

/// Insert a batch of instances.
#[derive(Debug, Clone, PartialEq)]
pub struct InsertParams {
    /// The instances, each validated; one invalid item rejects the whole batch.
    pub instances: Vec<NewInstance>,
    /// Insert time.
    pub now: Timestamp,
}

impl InsertParams {
    /// Checks the batch size and every new instance; one invalid item rejects the batch.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("instances", self.instances.len(), limits::INSERT_BATCH_MAX)?;
        for (i, new) in self.instances.iter().enumerate() {
            new.validate(&format!("instances[{i}]"))?;
        }
        Ok(())
    }
}

/// What happened to one inserted instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InsertOutcome {
    /// A new instance with this id.
    Inserted(InstanceId),
    /// Its unique key is occupied by this existing instance (possibly an earlier item of
    /// the same batch); nothing was inserted.
    Existing(InstanceId),
}

impl InsertOutcome {
    /// The id the caller got, new or existing.
    pub const fn id(self) -> InstanceId {
        match self {
            InsertOutcome::Inserted(id) | InsertOutcome::Existing(id) => id,
        }
    }
}

/// Claim up to `limit` runnable instances.
///
/// Empty filter lists mean "any". Order: the policy's rank (priority by default; one rank
/// under `fifo`; starving rows first), then `eligible_at`, then id
/// ([`crate::plan::claim::ClaimPolicy::rank`]). Rows in a paused queue are skipped; with a
/// global limit, the claim names one queue and takes no more than the limit minus the
/// queue's executing rows. Of rows sharing a `concurrency_key`, none is claimed while
/// another is executing, and at most one per claim.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimParams {
    /// The lease owner.
    pub worker: WorkerId,
    /// Namespaces to claim from (empty = any).
    pub namespaces: Vec<String>,
    /// Queues to claim from (empty = any).
    pub queues: Vec<String>,
    /// The `(machine, version)` pairs the worker can run (empty = any).
    pub machines: Vec<MachineRef>,
    /// Most rows to claim; at most [`crate::limits::CLAIM_BATCH_MAX`].
    pub limit: usize,
    /// Lease length.
    pub lease: Duration,
    /// Claim time.
    pub now: Timestamp,
    /// Order and limits of the queue claimed from (default: priority order, no limits).
    pub policy: crate::plan::claim::ClaimPolicy,
}

impl ClaimParams {
    /// Checks the claim bound and the policy.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("limit", self.limit, limits::CLAIM_BATCH_MAX)?;
        self.policy.validate(&self.queues)
    }

    /// Checks a claim of named instances (`Store::instance_claim_ids`): as
    /// [`validate`](Self::validate), and refuses a per-key rate limit, which a claim of
    /// the queue applies (it walks the queue's keys; a hint claim leaves such queues to
    /// the claim loop).
    pub fn validate_by_ids(&self) -> StoreResult<()> {
        self.validate()?;
        if self.policy.key_rate.is_some() {
            return Err(StoreError::invalid(
                "policy.key_rate: a claim of named instances cannot apply a per-key rate limit; claim the queue instead",
            ));
        }
        Ok(())
    }
}

/// One page of [`Store::instance_ready_stale`]: ready instances that have been ready for
/// at least `ready_for` (see [`crate::plan::hints`]), in id order after `after`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyStaleParams {
    /// Namespaces to read (empty = any).
    pub namespaces: Vec<String>,
    /// Queues to read (empty = any).
    pub queues: Vec<String>,
    /// The `(machine, version)` pairs to read (empty = any).
    pub machines: Vec<MachineRef>,
    /// How long an instance must have been ready to be returned.
    pub ready_for: Duration,
    /// Only ids greater than this one (the previous page's last id).
    pub after: Option<InstanceId>,
    /// Most rows to return; at most [`crate::limits::READY_STALE_BATCH_MAX`].
    pub limit: usize,
    /// Read time.
    pub now: Timestamp,
}

impl ReadyStaleParams {
    /// Checks the page bound.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("limit", self.limit, limits::READY_STALE_BATCH_MAX)
    }
}

/// A claimed instance: everything its step needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// The row after the claim (executing; `fencing_token` is this claim's token).
    pub instance: Instance,
    /// The oldest inbox signals, in arrival order, at most
    /// [`crate::limits::CLAIM_INBOX_MAX`]. These are the signals the step "saw".
    pub inbox: Vec<Signal>,
    /// The instance's children, oldest first, at most [`crate::limits::CHILDREN_LIST_MAX`].
    pub children: Vec<ChildSummary>,
}

impl Claim {
    /// This claim's fencing token.
    pub fn token(&self) -> FencingToken {
        self.instance.fencing_token
    }
}

/// Commit a batch of step results; each is fenced and accepted or rejected on its own.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitParams {
    /// The results.
    pub commits: Vec<StepCommit>,
    /// Commit time.
    pub now: Timestamp,
}

impl CommitParams {
    /// Checks the batch size; each commit is checked against its row on its own
    /// ([`crate::outcome::validate_commit`]), so one bad item does not reject the others.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("commits", self.commits.len(), limits::COMMIT_BATCH_MAX)
    }
}

/// An accepted commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitReceipt {
    /// The instance.
    pub id: InstanceId,
    /// Its revision after the commit.
    pub revision: Revision,
    /// Its status after the commit.
    pub status: Status,
    /// For `ScheduleChildren`: per requested child, new or existing id.
    pub children: Vec<InsertOutcome>,
    /// Per `spawn` item, new or existing id.
    pub spawned: Vec<InsertOutcome>,
    /// The dead letter the commit produced, if any.
    pub dead_letter: Option<DeadLetterId>,
}

/// Extend the leases of running steps (heartbeat).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseExtendParams {
    /// The owner.
    pub worker: WorkerId,
    /// The claims to extend.
    pub leases: Vec<(InstanceId, FencingToken)>,
    /// New lease length from `now`.
    pub lease: Duration,
    /// Heartbeat time.
    pub now: Timestamp,
}

impl LeaseExtendParams {
    /// Checks the batch size (a worker holds at most one claim batch per heartbeat) and
    /// that no lease (instance and token) is named twice: the answer is one flag per lease.
    /// An instance may be named under several tokens (a worker that still keeps an old
    /// claim of it); only the live one can be held.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("leases", self.leases.len(), limits::COMMIT_BATCH_MAX)?;
        let mut seen = std::collections::HashSet::with_capacity(self.leases.len());
        for (id, token) in &self.leases {
            if !seen.insert((*id, *token)) {
                return Err(StoreError::invalid(format!(
                    "leases: instance {id} is named twice under token {}; name each lease once",
                    token.0
                )));
            }
        }
        Ok(())
    }
}

/// Return expired leases to runnable (attempt + 1).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseReapParams {
    /// With `Some(worker)`: every row that worker holds, expired or not (a restarted
    /// worker reclaiming what it held before a crash). With `None`: expired leases only.
    pub owner: Option<WorkerId>,
    /// Most rows to return; at most [`crate::limits::REAP_BATCH_MAX`].
    pub limit: usize,
    /// Reap time.
    pub now: Timestamp,
}

impl LeaseReapParams {
    /// Checks the reap bound.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("limit", self.limit, limits::REAP_BATCH_MAX)
    }
}

/// Release leases without counting an attempt (graceful shutdown).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseReleaseParams {
    /// The claims to release.
    pub leases: Vec<(InstanceId, FencingToken)>,
    /// Release time.
    pub now: Timestamp,
}

impl LeaseReleaseParams {
    /// Checks the batch size, the same bound as a heartbeat.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("leases", self.leases.len(), limits::COMMIT_BATCH_MAX)
    }
}

/// One page of a chart version migration: the waiting instances of the migration's old
/// version with ids above `after`, in id order, at most `limit` of them, each locked,
/// planned with its timers (`plan::migrate`) and — unless `dry_run` — moved.
#[derive(Debug, Clone)]
pub struct MigrateParams {
    /// How states, context and timers map.
    pub migration: crate::chart::Migration,
    /// Only this namespace (`None` = every namespace).
    pub namespace: Option<String>,
    /// Continue after this id (`None` = from the start).
    pub after: Option<InstanceId>,
    /// Most instances this page reads.
    pub limit: usize,
    /// Report what would happen, write nothing.
    pub dry_run: bool,
    /// Migration time.
    pub now: Timestamp,
}

impl MigrateParams {
    /// Checks the page size.
    pub fn validate(&self) -> StoreResult<()> {
        if self.limit == 0 {
            return Err(StoreError::invalid("limit: must be at least 1"));
        }
        check_batch("limit", self.limit, limits::MIGRATE_BATCH_MAX)
    }
}

/// One page of pruning: the instances with ids above `after`, in id order, at most `limit`
/// of them, are read, and those [`plan::prune`](crate::plan::prune) finds prunable (ended
/// before `ended_before`, in scope, and not a child its live parent may still read) are
/// deleted with their history, inbox and timers, in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneParams {
    /// Only this namespace (`None` = every namespace).
    pub namespace: Option<String>,
    /// Only these machine names (empty = every machine).
    pub machines: Vec<String>,
    /// Of these, not these machine names (machines with a retention of their own).
    pub except: Vec<String>,
    /// Terminal instances whose last change is before this time are pruned.
    pub ended_before: Timestamp,
    /// Continue after this id (`None` = from the start).
    pub after: Option<InstanceId>,
    /// Most instances this page reads.
    pub limit: usize,
}

impl PruneParams {
    /// Checks the page size and the names.
    pub fn validate(&self) -> StoreResult<()> {
        if self.limit == 0 {
            return Err(StoreError::invalid("prune.limit: must be at least 1"));
        }
        check_batch("prune.limit", self.limit, limits::PRUNE_BATCH_MAX)?;
        if let Some(ns) = &self.namespace {
            check_name("prune.namespace", ns)?;
        }
        for m in self.machines.iter().chain(&self.except) {
            check_name("prune.machines", m)?;
        }
        Ok(())
    }
}

/// What one prune page deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrunePage {
    /// Instances deleted.
    pub instances: u64,
    /// History rows deleted with them.
    pub history: u64,
    /// Inbox rows deleted with them.
    pub signals: u64,
    /// The last id read: pass it as `after` for the next page (`None`: nothing was left).
    pub last: Option<InstanceId>,
}

/// One page of an instance's history, newest first: the entries with a sequence number
/// below `before` (all of them when `None`), at most `limit` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryPageParams {
    /// The instance.
    pub instance: InstanceId,
    /// Only entries older than this sequence number: the previous page's
    /// [`HistoryPage::next`] (`None` = from the newest).
    pub before: Option<i64>,
    /// Most entries returned: 1 to [`limits::HISTORY_PAGE_MAX`].
    pub limit: usize,
}

impl HistoryPageParams {
    /// Checks the page size and the cursor.
    pub fn validate(&self) -> StoreResult<()> {
        if !(1..=limits::HISTORY_PAGE_MAX).contains(&self.limit) {
            return Err(StoreError::invalid(format!(
                "limit: {} is out of range; give 1 to {} and follow `next` for older entries",
                self.limit,
                limits::HISTORY_PAGE_MAX
            )));
        }
        if self.before.is_some_and(|b| b <= 0) {
            return Err(StoreError::invalid(
                "before: must be a positive sequence number; pass the `next` of the previous page",
            ));
        }
        Ok(())
    }

    /// How many entries a store reads: one more than the page, so the planner knows
    /// whether an older page exists.
    pub const fn read_limit(&self) -> usize {
        self.limit + 1
    }
}

/// One page of an instance's history.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HistoryPage {
    /// The entries, newest first.
    pub entries: Vec<HistoryRecord>,
    /// Pass it as `before` for the next, older page; `None` when no older entry is left.
    pub next: Option<i64>,
}

/// One page of trimming history: the instances with ids above `after`, in id order, at
/// most `limit` of them, are read, and of those in scope each keeps its newest `keep`
/// entries; older ones are deleted, oldest first, at most `limit` rows in the page
/// ([`plan::history::trim`](crate::plan::history::trim) decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryTrimParams {
    /// Only this namespace (`None` = every namespace).
    pub namespace: Option<String>,
    /// Only these machine names (empty = every machine).
    pub machines: Vec<String>,
    /// Of these, not these machine names (machines with a retention of their own).
    pub except: Vec<String>,
    /// The newest entries kept per instance: 1 to [`limits::HISTORY_KEEP_MAX`].
    pub keep: usize,
    /// Continue after this id (`None` = from the start).
    pub after: Option<InstanceId>,
    /// Most instances this page reads and most history rows it deletes: 1 to
    /// [`limits::PRUNE_BATCH_MAX`].
    pub limit: usize,
}

impl HistoryTrimParams {
    /// Checks the bounds and the names.
    pub fn validate(&self) -> StoreResult<()> {
        if self.limit == 0 {
            return Err(StoreError::invalid("trim.limit: must be at least 1"));
        }
        check_batch("trim.limit", self.limit, limits::PRUNE_BATCH_MAX)?;
        if !(1..=limits::HISTORY_KEEP_MAX).contains(&self.keep) {
            return Err(StoreError::invalid(format!(
                "trim.keep: {} is out of range; keep 1 to {} entries per instance",
                self.keep,
                limits::HISTORY_KEEP_MAX
            )));
        }
        if let Some(ns) = &self.namespace {
            check_name("trim.namespace", ns)?;
        }
        for m in self.machines.iter().chain(&self.except) {
            check_name("trim.machines", m)?;
        }
        Ok(())
    }

    /// How far a store counts an instance's entries beyond the newest `keep`: one more than
    /// a page may delete, which is enough for the planner to tell a whole trim from a
    /// partial one.
    pub const fn count_cap(&self) -> usize {
        self.limit + 1
    }
}

/// What one trim page deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HistoryTrimPage {
    /// Instances that lost entries.
    pub instances: u64,
    /// History rows deleted.
    pub history: u64,
    /// Pass it as `after` for the next page (`None`: nothing was left). When the page's
    /// row budget ran out inside an instance, it is the id just below that instance, so
    /// the next page carries on with it.
    pub last: Option<InstanceId>,
}

/// What one migration page did (or, in a dry run, would do) to each instance it read.
#[derive(Debug, Clone, PartialEq)]
pub struct MigratePage {
    /// One entry per instance read, in id order.
    pub items: Vec<MigrateItem>,
    /// The last id read: pass it as `after` for the next page (`None`: nothing was left).
    pub last: Option<InstanceId>,
}

/// One instance of a migration page.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrateItem {
    /// The instance.
    pub id: InstanceId,
    /// Its configuration before (its stored position).
    pub old: String,
    /// The move, or why it cannot move now.
    pub outcome: Result<MigrateMoved, crate::chart::migrate::Refusal>,
}

/// A move a migration made (or would make).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateMoved {
    /// The configuration after, as a stored position.
    pub new: String,
    /// Timers that keep their due time.
    pub kept: usize,
    /// Timers dropped.
    pub dropped: usize,
    /// Timers armed from now.
    pub armed: usize,
}

/// Deliver a batch of signals.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalDeliverParams {
    /// The signals.
    pub signals: Vec<NewSignal>,
    /// Delivery time.
    pub now: Timestamp,
}

impl SignalDeliverParams {
    /// Checks the batch size and every signal; one invalid item rejects the batch.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("signals", self.signals.len(), limits::DELIVER_BATCH_MAX)?;
        for (i, s) in self.signals.iter().enumerate() {
            s.validate(&format!("signals[{i}]"))?;
        }
        Ok(())
    }
}

/// What happened to one delivered signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// Stored in the target's inbox; `woke` when it made an awaiting target runnable.
    Delivered {
        /// The new signal.
        id: SignalId,
        /// The target.
        target: InstanceId,
        /// Whether the target was woken.
        woke: bool,
    },
    /// A signal with the same dedup key is already in the target's inbox (or earlier in
    /// the batch); nothing new was stored.
    Duplicate {
        /// The existing signal.
        id: SignalId,
        /// The target.
        target: InstanceId,
    },
    /// The target is terminal: its inbox is closed (`keel_core::inbox`), so nothing was
    /// stored — the signal would never be processed.
    TargetTerminal {
        /// The target.
        target: InstanceId,
        /// The target's terminal status.
        status: Status,
    },
    /// No such instance; nothing was stored.
    TargetMissing,
}

/// Deliver one event to every instance of a machine in a given state, in one statement.
/// Fails with `Invalid`, delivering nothing, when more than
/// [`crate::limits::BROADCAST_MAX`] instances match.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalBroadcastParams {
    /// Namespace.
    pub namespace: String,
    /// Machine name (any version).
    pub machine: String,
    /// Only instances in this state (`instance::position_in_state`); `None` = every
    /// non-terminal instance of the machine.
    pub in_state: Option<String>,
    /// Event name.
    pub name: String,
    /// Event payload.
    pub payload: serde_json::Value,
    /// Optional dedup key, applied per target.
    pub dedup_key: Option<String>,
    /// Delivery time.
    pub now: Timestamp,
}

impl SignalBroadcastParams {
    /// Checks the names that select the targets and the event, which is held to the same
    /// rules as any delivered signal.
    pub fn validate(&self) -> StoreResult<()> {
        self.signal(InstanceId(0)).validate("broadcast")?;
        check_name("broadcast.namespace", &self.namespace)?;
        check_name("broadcast.machine", &self.machine)?;
        match &self.in_state {
            Some(state) => check_name("broadcast.in_state", state),
            None => Ok(()),
        }
    }

    /// The event as a signal to one target.
    pub fn signal(&self, target: InstanceId) -> NewSignal {
        NewSignal {
            target: SignalTarget::Id(target),
            name: self.name.clone(),
            payload: self.payload.clone(),
            dedup_key: self.dedup_key.clone(),
            priority: None,
        }
    }
}

/// What a broadcast did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BroadcastReport {
    /// Instances the event was addressed to: the live instances of the machine (in the
    /// state asked for) when it was delivered, duplicates included.
    pub matched: u64,
    /// Instances that got the event (duplicates by dedup key not counted).
    pub delivered: u64,
    /// Of those, instances it woke.
    pub woke: u64,
}

/// Cancel an instance.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelParams {
    /// The instance.
    pub id: InstanceId,
    /// Recorded as `last_error`.
    pub reason: String,
    /// Also cancel every non-terminal descendant.
    pub cascade: bool,
    /// Cancel time.
    pub now: Timestamp,
    /// Cancel only when the instance is, at the cancel, in one of these statuses; else
    /// nothing is cancelled (an empty result, as for an instance already ended). An
    /// operator who read a page of runnable rows cancels with `Runnable` here, so one a
    /// worker claimed since the read is left to its step. `None`: any live status.
    pub only_in: Option<StatusSet>,
}

/// An instance with everything an operator wants to see.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceDetail {
    /// The row.
    pub instance: Instance,
    /// Its inbox, in arrival order: the oldest [`crate::limits::INBOX_LIST_MAX`].
    pub inbox: Vec<Signal>,
    /// Its children, oldest first.
    pub children: Vec<ChildSummary>,
    /// Its history, oldest first (the newest [`crate::limits::HISTORY_LIST_MAX`]).
    pub history: Vec<HistoryRecord>,
    /// Its armed timers, soonest first (at most [`crate::limits::TIMER_LIST_MAX`]).
    pub timers: Vec<TimerRow>,
}

/// Fire due timers: up to `limit` timers whose `next_fire_at <= now`, in due order, each
/// delivered into its instance's inbox with its dedup key, recorded, and advanced or
/// deleted (`timers::fire`) — in one transaction. Concurrent sweeps skip each other's
/// timers (SKIP LOCKED) and the dedup keys make a re-run sweep harmless.
#[derive(Debug, Clone, PartialEq)]
pub struct TimerSweepParams {
    /// Only this namespace (`None` = all).
    pub namespace: Option<String>,
    /// Only these machine names (empty = all).
    pub machines: Vec<String>,
    /// Most timers to fire; at most [`crate::limits::TIMER_SWEEP_BATCH_MAX`].
    pub limit: usize,
    /// Sweep time.
    pub now: Timestamp,
}

impl TimerSweepParams {
    /// Checks the sweep bound.
    pub fn validate(&self) -> StoreResult<()> {
        check_batch("limit", self.limit, limits::TIMER_SWEEP_BATCH_MAX)
    }
}

/// Moves the armed timers of one machine version to the durations its deployed definition
/// gives them (`timers::retime`), one page at a time in timer id order: for a deploy that
/// changed an `after` / `every` duration, so instances already waiting follow it.
#[derive(Debug, Clone, PartialEq)]
pub struct TimerRetimeParams {
    /// The machine version whose instances' timers are moved.
    pub machine: MachineRef,
    /// The deployed definition's timers that follow deploys (`Definition::followed_timers`).
    pub timers: Vec<crate::chart::TimerArm>,
    /// Only timers with a greater id: the previous page's [`TimerRetimePage::next`].
    pub after: Option<crate::ids::TimerId>,
    /// Most armed timers to read; at most [`crate::limits::TIMER_RETIME_BATCH_MAX`].
    pub limit: usize,
    /// When (the history entries' time).
    pub now: Timestamp,
}

impl TimerRetimeParams {
    /// Checks the bounds and names.
    pub fn validate(&self) -> StoreResult<()> {
        check_name("machine.name", &self.machine.name)?;
        check_batch("limit", self.limit, limits::TIMER_RETIME_BATCH_MAX)?;
        if self.limit == 0 {
            return Err(StoreError::invalid("limit: must be at least 1; pass the page size"));
        }
        check_batch("timers", self.timers.len(), limits::TIMER_RETIME_SPECS_MAX)?;
        for (i, t) in self.timers.iter().enumerate() {
            if t.interval.is_zero() {
                return Err(StoreError::invalid(format!(
                    "timers[{i}].interval: must be positive; take the timers from Definition::followed_timers"
                )));
            }
        }
        Ok(())
    }
}

/// One page of a retime.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TimerRetimePage {
    /// The timers moved, in id order.
    pub retimed: Vec<crate::ids::TimerId>,
    /// Where the next page starts (pass it as [`TimerRetimeParams::after`]); `None` when
    /// this page was the last.
    pub next: Option<crate::ids::TimerId>,
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TimerSweepReport {
    /// Timer events delivered (not counting duplicates).
    pub fired: u64,
    /// `every` + `max` timers that ran out (their `then` delivered).
    pub exhausted: u64,
    /// Timers processed (fired, exhausted, held or found stale), at most `limit`.
    pub processed: u64,
    /// Timers the sweep picked, at most `limit`: the processed ones, plus those left for a
    /// later sweep because a commit held their instance (PostgreSQL never waits for that
    /// lock). Equal to `limit` means more may be due, even when `processed` is less.
    pub picked: u64,
}

/// Which timers [`Store::timer_next_due`] looks at: the ones a sweep with the same
/// filters would fire.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TimerNextDueParams {
    /// Only this namespace (`None` = all).
    pub namespace: Option<String>,
    /// Only these machine names (empty = all).
    pub machines: Vec<String>,
}

impl TimerNextDueParams {
    /// The earliest due time in scope among per-machine timer statuses (of this namespace,
    /// or of every namespace when it is `None`).
    pub fn earliest_in(&self, status: &[TimerStatus]) -> Option<Timestamp> {
        status
            .iter()
            .filter(|s| self.namespace.as_ref().is_none_or(|ns| &s.namespace == ns))
            .filter(|s| self.machines.is_empty() || self.machines.contains(&s.machine))
            .filter_map(|s| s.next_due)
            .min()
    }
}

/// Timer health per machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimerStatus {
    /// Namespace.
    pub namespace: String,
    /// Machine name.
    pub machine: String,
    /// Armed timers.
    pub armed: u64,
    /// The soonest due time.
    pub next_due: Option<Timestamp>,
    /// Timers already due at `now` and not fired yet.
    pub overdue: u64,
    /// When a sweep covering this machine last ran.
    pub last_sweep_at: Option<Timestamp>,
}

/// Counts per queue and machine, for metrics, health and backpressure.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueueStats {
    /// Namespace.
    pub namespace: String,
    /// Queue.
    pub queue: String,
    /// Machine name.
    pub machine: String,
    /// Runnable and eligible now.
    pub ready: u64,
    /// Runnable but not eligible yet (delayed, backing off).
    pub scheduled: u64,
    /// Executing under a lease.
    pub executing: u64,
    /// Parked on a signal or on children.
    pub waiting: u64,
    /// Suspended (dead-lettered).
    pub suspended: u64,
    /// The oldest `eligible_at` among ready rows.
    pub oldest_ready_at: Option<Timestamp>,
}

/// Most buckets one [`Store::instance_activity`] call may ask for (a day of minutes).
pub const ACTIVITY_BUCKETS_MAX: i64 = 1_440;

/// Most workers one [`Store::worker_list`] call returns.
pub const WORKER_LIST_MAX: usize = 1_000;

/// Most machines one worker heartbeat may declare.
pub const WORKER_MACHINES_MAX: usize = 1_000;

/// How often a worker records itself in the worker registry.
pub const WORKER_BEAT_INTERVAL: Duration = Duration::from_secs(15);

/// A worker not seen for this long counts as stale: four missed registry beats.
pub const WORKER_STALE_AFTER: Duration = Duration::from_secs(60);

/// A worker not seen for this long is dropped from the registry by the next beat.
pub const WORKER_FORGET_AFTER: Duration = Duration::from_secs(7 * 86_400);

impl WorkerBeatParams {
    /// A beat at `now`, forgetting workers silent for [`WORKER_FORGET_AFTER`].
    pub fn at(
        id: WorkerId,
        name: String,
        machines: Vec<MachineRef>,
        namespaces: Vec<String>,
        started_at: Timestamp,
        now: Timestamp,
    ) -> Self {
        let forget_before = now.minus(WORKER_FORGET_AFTER);
        WorkerBeatParams { id, name, machines, namespaces, started_at, now, forget_before }
    }
}

/// Instances that ended (done or failed) between `since` and `until`, counted per machine
/// and per bucket of `bucket` width: throughput and turnaround from stored rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivityParams {
    /// Only this namespace; `None` = every namespace.
    pub namespace: Option<String>,
    /// Start of the window (inclusive).
    pub since: Timestamp,
    /// End of the window (exclusive), normally `now`.
    pub until: Timestamp,
    /// Bucket width.
    pub bucket: Duration,
}

impl ActivityParams {
    /// The bucket width in milliseconds (at least 1).
    pub fn bucket_ms(&self) -> i64 {
        i64::try_from(self.bucket.as_millis()).unwrap_or(i64::MAX).max(1)
    }

    /// Which bucket an end time falls in, or `None` outside the window.
    pub fn bucket_of(&self, at: Timestamp) -> Option<i64> {
        (at >= self.since && at < self.until).then(|| (at.0 - self.since.0) / self.bucket_ms())
    }

    /// Checks the window: ordered, buckets of at least a second, at most
    /// [`ACTIVITY_BUCKETS_MAX`] of them.
    pub fn validate(&self) -> StoreResult<()> {
        if let Some(ns) = &self.namespace {
            check_name("activity.namespace", ns)?;
        }
        if self.bucket < Duration::from_secs(1) {
            return Err(StoreError::invalid(
                "activity.bucket: buckets are at least one second wide",
            ));
        }
        if self.until < self.since {
            return Err(StoreError::invalid(
                "activity.until: the window ends before it starts; swap since and until",
            ));
        }
        let width = self.bucket_ms();
        let buckets = (self.until.0 - self.since.0 + width - 1) / width;
        if buckets > ACTIVITY_BUCKETS_MAX {
            return Err(StoreError::invalid(format!(
                "activity.bucket: the window holds {buckets} buckets, more than {ACTIVITY_BUCKETS_MAX}; widen the bucket or shorten the window"
            )));
        }
        Ok(())
    }
}

/// What ended in one bucket for one machine.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ActivityBucket {
    /// Namespace.
    pub namespace: String,
    /// Machine name.
    pub machine: String,
    /// Bucket number from the window's start (`0..`).
    pub bucket: i64,
    /// Instances that finished `done`.
    pub completed: u64,
    /// Instances that finished `failed`.
    pub failed: u64,
    /// Sum over both of (last change - insert time), in milliseconds.
    pub turnaround_ms_total: u64,
}

/// A worker saying it is alive: recorded at a bounded rate, listed by `worker_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerBeatParams {
    /// The worker's id (unique per process).
    pub id: WorkerId,
    /// A name for people: host and process, or what the worker calls itself.
    pub name: String,
    /// The machines and versions it runs.
    pub machines: Vec<MachineRef>,
    /// The namespaces it claims from (empty = every namespace).
    pub namespaces: Vec<String>,
    /// When it started.
    pub started_at: Timestamp,
    /// Now: its last-seen time.
    pub now: Timestamp,
    /// Forget workers last seen before this (the registry stays bounded).
    pub forget_before: Timestamp,
}

impl WorkerBeatParams {
    /// Checks names and bounds.
    pub fn validate(&self) -> StoreResult<()> {
        check_name("worker.id", &self.id.0)?;
        check_name("worker.name", &self.name)?;
        check_batch("worker.machines", self.machines.len(), WORKER_MACHINES_MAX)?;
        for m in &self.machines {
            check_name("worker.machines", &m.name)?;
        }
        for ns in &self.namespaces {
            check_name("worker.namespaces", ns)?;
        }
        Ok(())
    }
}

/// One worker as last recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WorkerRecord {
    /// Its id.
    pub id: WorkerId,
    /// Its name.
    pub name: String,
    /// The machines and versions it runs.
    pub machines: Vec<MachineRef>,
    /// The namespaces it claims from (empty = every namespace).
    pub namespaces: Vec<String>,
    /// When it started.
    pub started_at: Timestamp,
    /// Its last heartbeat.
    pub last_seen_at: Timestamp,
}

impl WorkerRecord {
    /// Whether it claims from `namespace`: it names it, or names none (every namespace).
    pub fn claims_from(&self, namespace: &str) -> bool {
        self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace)
    }

    /// Whether it serves `machine` in `namespace`.
    pub fn serves(&self, namespace: &str, machine: &MachineRef) -> bool {
        self.claims_from(namespace) && self.machines.contains(machine)
    }
}

/// Which dead letters to list, oldest (lowest id) first, a page at a time. Pages are
/// keyset-paginated on the dead letter's id, so a page costs the same however deep it is
/// and a letter recorded or removed meanwhile never shifts another page: pass the last id
/// of a page as `after` for the next page, or the first id as `before` for the previous.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeadLetterFilter {
    /// Only this namespace.
    pub namespace: Option<String>,
    /// Only this machine name.
    pub machine: Option<String>,
    /// Only ids above this one: the page after a page whose last id this is.
    pub after: Option<DeadLetterId>,
    /// Only ids below this one, and of those the `limit` nearest to it (still listed
    /// oldest first): the page before a page whose first id this is. Not with `after`.
    pub before: Option<DeadLetterId>,
    /// Most to return, up to [`crate::limits::DEAD_LETTER_BATCH_MAX`]; `0` means that bound.
    pub limit: usize,
}

impl DeadLetterFilter {
    /// The page size a store applies: `limit`, or the bound when it is `0`.
    pub fn page_size(&self) -> usize {
        match self.limit {
            0 => limits::DEAD_LETTER_BATCH_MAX,
            n => n,
        }
    }

    /// Checks the names, the page size and that at most one cursor is set.
    pub fn validate(&self) -> StoreResult<()> {
        if let Some(ns) = &self.namespace {
            check_name("namespace", ns)?;
        }
        if let Some(machine) = &self.machine {
            check_name("machine", machine)?;
        }
        if self.limit > limits::DEAD_LETTER_BATCH_MAX {
            return Err(StoreError::invalid(format!(
                "limit: {} is out of range; ask for 1 to {} dead letters per page",
                self.limit,
                limits::DEAD_LETTER_BATCH_MAX
            )));
        }
        if self.after.is_some() && self.before.is_some() {
            return Err(StoreError::invalid(
                "before: give either after (the next page) or before (the previous page), not both",
            ));
        }
        Ok(())
    }

    /// Whether `letter` passes the namespace and machine filters and the cursor (the page
    /// size aside).
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        self.namespace.as_ref().is_none_or(|ns| letter.letter.namespace == *ns)
            && self.machine.as_ref().is_none_or(|m| letter.letter.machine.name == *m)
            && self.after.is_none_or(|a| letter.id > a)
            && self.before.is_none_or(|b| letter.id < b)
    }
}

/// Most pages [`Store::dead_letter_counts`]'s default reads (of
/// [`crate::limits::DEAD_LETTER_BATCH_MAX`] each): a million dead letters.
pub const DEAD_LETTER_COUNT_PAGES_MAX: usize = 100;

/// How many dead letters one machine of one namespace holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeadLetterCount {
    /// Namespace.
    pub namespace: String,
    /// Machine name.
    pub machine: String,
    /// Dead-letter records.
    pub count: u64,
}

/// One page of a namespace's instances for an operator's list, newest first, narrowed by
/// the filters that are set. Pages are keyset-paginated: pass the last id of a page as
/// `before` to get the next one, so a page costs the same however deep it is.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InstanceListParams {
    /// The namespace (required: a list never spans namespaces).
    pub namespace: String,
    /// Only this machine name.
    pub machine: Option<String>,
    /// Only this status.
    pub status: Option<Status>,
    /// Only instances at this state: a step machine's current step, or a state path in a
    /// chart's active configuration ([`crate::instance::position_in_state`]).
    pub state: Option<String>,
    /// Only this business key (exact).
    pub business_key: Option<String>,
    /// Only ids below this one (the last id of the previous page).
    pub before: Option<InstanceId>,
    /// Most to return, 1 to [`crate::limits::INSTANCE_LIST_MAX`].
    pub limit: usize,
}

impl InstanceListParams {
    /// Checks the names and the page size.
    pub fn validate(&self) -> StoreResult<()> {
        check_name("namespace", &self.namespace)?;
        if let Some(machine) = &self.machine {
            check_name("machine", machine)?;
        }
        if let Some(state) = &self.state {
            check_name("state", state)?;
        }
        if let Some(key) = &self.business_key {
            check_name("business_key", key)?;
        }
        if self.limit == 0 || self.limit > limits::INSTANCE_LIST_MAX {
            return Err(StoreError::invalid(format!(
                "limit: {} is out of range; ask for 1 to {} instances per page",
                self.limit,
                limits::INSTANCE_LIST_MAX
            )));
        }
        Ok(())
    }

    /// Whether `instance` passes every filter except the page bounds.
    pub fn matches(&self, instance: &Instance) -> bool {
        instance.namespace == self.namespace
            && self.machine.as_ref().is_none_or(|m| instance.machine.name == *m)
            && self.status.is_none_or(|s| instance.status == s)
            && self.state.as_ref().is_none_or(|s| position_in_state(&instance.position, s))
            && self.business_key.as_ref().is_none_or(|k| instance.business_key.as_ref() == Some(k))
            && self.before.is_none_or(|b| instance.id < b)
    }
}

/// Which dead letters a retry or purge touches.
#[derive(Debug, Clone, PartialEq)]
pub enum DeadLetterSelector {
    /// One dead letter.
    Id(DeadLetterId),
    /// Every dead letter of a machine in a namespace (bounded by
    /// [`crate::limits::DEAD_LETTER_BATCH_MAX`] per call). A retry reads only the letters
    /// whose instance is still [`crate::outcome::DEAD_LETTER_RETRYABLE`], oldest first, so
    /// calling it again while it returns a full batch reaches every retryable letter.
    Machine {
        /// Namespace.
        namespace: String,
        /// Machine name.
        machine: String,
    },
}

impl DeadLetterSelector {
    /// Checks the names of a machine selector.
    pub fn validate(&self) -> StoreResult<()> {
        match self {
            DeadLetterSelector::Id(_) => Ok(()),
            DeadLetterSelector::Machine { namespace, machine } => {
                check_name("selector.namespace", namespace)?;
                check_name("selector.machine", machine)
            }
        }
    }
}

/// Retry dead letters: their suspended instances become runnable at `now + delay` with a
/// fresh attempt count; the dead letters are removed (history keeps the record).
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterRetryParams {
    /// Which.
    pub selector: DeadLetterSelector,
    /// Wait before the retry runs.
    pub delay: Duration,
    /// Retry time.
    pub now: Timestamp,
}

impl DeadLetterRetryParams {
    /// The status a store reads letters' instances in, when the retry names a machine:
    /// only letters of instances still [`crate::outcome::DEAD_LETTER_RETRYABLE`], so
    /// records of instances that moved on never fill the batch. `None` for one named
    /// letter, which is read whatever its instance's status (and refused if it cannot be
    /// retried).
    pub fn instance_status(&self) -> Option<crate::ids::Status> {
        match self.selector {
            DeadLetterSelector::Id(_) => None,
            DeadLetterSelector::Machine { .. } => Some(crate::outcome::DEAD_LETTER_RETRYABLE),
        }
    }

    /// Checks the selector and the delay, which is bounded like a step's own retry delay.
    pub fn validate(&self) -> StoreResult<()> {
        self.selector.validate()?;
        if self.delay > limits::RETRY_DELAY_MAX {
            return Err(StoreError::invalid(format!(
                "delay: {} s is longer than the limit of {} s (one year); retry sooner, or leave the dead letter until it is time",
                self.delay.as_secs(),
                limits::RETRY_DELAY_MAX.as_secs()
            )));
        }
        Ok(())
    }
}

/// Skip a dead letter: consume the signals it recorded and make the instance runnable,
/// so it carries on with its next event.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterSkipParams {
    /// Which.
    pub id: DeadLetterId,
    /// Skip time.
    pub now: Timestamp,
}

/// Purge dead letters (instances are not touched).
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterPurgeParams {
    /// Which (`None` = all, subject to `older_than`).
    pub selector: Option<DeadLetterSelector>,
    /// Only those created before this time (retention pruning).
    pub older_than: Option<Timestamp>,
    /// Leave the letters whose instance is still suspended
    /// ([`crate::plan::dead_letter::retries_its_instance`]): such a letter is how its
    /// instance is retried, so purging it would leave the instance waiting for an operator
    /// with nothing to retry it by. Retention sets it; an operator purging by hand
    /// chooses (`false` purges them too, and their instances stay suspended).
    pub keep_suspended: bool,
}

impl DeadLetterPurgeParams {
    /// Checks the selector.
    pub fn validate(&self) -> StoreResult<()> {
        self.selector.as_ref().map_or(Ok(()), DeadLetterSelector::validate)
    }
}

/// Pause or resume claiming from a queue. A pause records the queue's settings (creating
/// them if the queue had none); a resume only changes settings a pause recorded and never
/// creates any, so resuming a queue that was never paused (a misspelt name, say) changes
/// nothing and does not make it appear in [`Store::queue_list`].
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePauseParams {
    /// Namespace.
    pub namespace: String,
    /// Queue.
    pub queue: String,
    /// `true` to pause, `false` to resume.
    pub paused: bool,
    /// Time of the change.
    pub now: Timestamp,
}

impl QueuePauseParams {
    /// Checks the queue's names.
    pub fn validate(&self) -> StoreResult<()> {
        check_name("namespace", &self.namespace)?;
        check_name("queue", &self.queue)
    }
}

/// A queue's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    /// Namespace.
    pub namespace: String,
    /// Queue.
    pub queue: String,
    /// Whether claiming is paused.
    pub paused: bool,
}

/// Pause or resume a schedule for every worker that serves it (the stored state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulePauseParams {
    /// The schedule's namespace (where its ticks start instances or broadcast).
    pub namespace: String,
    /// The schedule's name.
    pub name: String,
    /// `true` to pause, `false` to resume.
    pub paused: bool,
    /// Time of the change (a resume's time bounds which ticks may still fire).
    pub now: Timestamp,
}

impl SchedulePauseParams {
    /// Checks the names.
    pub fn validate(&self) -> StoreResult<()> {
        check_schedule_names(&self.namespace, &self.name)
    }
}

/// Records that a schedule's tick fired, for every worker that serves it and every
/// restart: no tick at or before the recorded one fires again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleFiredParams {
    /// The schedule's namespace (where its ticks start instances or broadcast).
    pub namespace: String,
    /// The schedule's name.
    pub name: String,
    /// The tick that fired (its scheduled time, not the clock's).
    pub tick: Timestamp,
}

impl ScheduleFiredParams {
    /// Checks the names.
    pub fn validate(&self) -> StoreResult<()> {
        check_schedule_names(&self.namespace, &self.name)
    }
}

/// Forgets the stored states of schedules that no longer exist (removed or renamed), so
/// they stop counting toward the namespace's bound. `keel schedules forget` names them
/// ([`crate::schedule::plan_forget`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleForgetParams {
    /// The namespace the states are stored under.
    pub namespace: String,
    /// The schedules whose states are deleted: at most
    /// [`crate::schedule::SCHEDULE_STATES_MAX`]; a name without a state is passed over.
    pub names: Vec<String>,
}

impl ScheduleForgetParams {
    /// Checks the names and their count.
    pub fn validate(&self) -> StoreResult<()> {
        let max = crate::schedule::SCHEDULE_STATES_MAX;
        if self.names.len() > max {
            return Err(StoreError::invalid(format!(
                "names: {} schedules in one call; forget at most {max} at once (the most a \
                 namespace holds)",
                self.names.len()
            )));
        }
        check_name("namespace", &self.namespace)?;
        self.names.iter().try_for_each(|name| check_schedule_name(name))
    }
}

fn check_schedule_names(namespace: &str, name: &str) -> StoreResult<()> {
    check_name("namespace", namespace)?;
    check_schedule_name(name)
}

/// Checks one schedule name: a name, and at most [`crate::schedule::SCHEDULE_NAME_MAX`]
/// bytes.
fn check_schedule_name(name: &str) -> StoreResult<()> {
    check_name("name", name)?;
    if name.len() > crate::schedule::SCHEDULE_NAME_MAX {
        return Err(StoreError::invalid(format!(
            "name: is {} bytes; a schedule name has at most {} bytes",
            name.len(),
            crate::schedule::SCHEDULE_NAME_MAX
        )));
    }
    Ok(())
}

/// A schedule's stored state, shared by every worker that serves it: its pause state
/// once one was stored, and the latest tick any worker fired.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ScheduleState {
    /// Namespace.
    pub namespace: String,
    /// Schedule name.
    pub name: String,
    /// Whether its ticks are passed over (`false` while no pause was ever stored).
    pub paused: bool,
    /// When a stored pause or resume last changed it; `None` when none was ever stored
    /// (the row only records fired ticks), so the definition and each worker decide.
    pub changed_at: Option<Timestamp>,
    /// The latest tick fired by any worker ([`Store::schedule_fired`]); no tick at or
    /// before it fires again.
    pub fired_through: Option<Timestamp>,
}

/// What a store can do beyond the contract, reported honestly.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoreCapabilities {
    /// Whether the store can push "work is ready" notifications and timer hints
    /// (LISTEN/NOTIFY, in-process); polling stays the correctness path either way.
    pub notifications: bool,
}

/// The durable source of truth for instances, inboxes, history and dead letters.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// What this backend supports.
    fn capabilities(&self) -> StoreCapabilities;

    /// Inserts instances; per item, the new id or the occupant of its unique key.
    async fn instance_insert(&self, params: InsertParams) -> StoreResult<Vec<InsertOutcome>>;

    /// Claims runnable instances under a new lease and fencing token.
    async fn instance_claim(&self, params: ClaimParams) -> StoreResult<Vec<Claim>>;

    /// Claims the instances `ids` names (a queue hint's targets) under the usual lease and
    /// fencing, with `params`' filters; `params.limit` still bounds the batch. An id that
    /// is not ready, is held, is filtered out or does not exist is skipped: a hint is never
    /// the truth.
    ///
    /// The default, for a store without a claim by id, is an ordinary claim of up to
    /// `ids.len()` ready instances. That keeps what a hint means ("work is ready") but may
    /// take other instances than the named ones.
    async fn instance_claim_ids(
        &self,
        ids: Vec<InstanceId>,
        params: ClaimParams,
    ) -> StoreResult<Vec<Claim>> {
        let limit = params.limit.min(ids.len());
        if limit == 0 {
            return Ok(Vec::new());
        }
        self.instance_claim(ClaimParams { limit, ..params }).await
    }

    /// One page of instances that are ready (claimable now, in an unpaused queue, within
    /// `params`' filters) and have been for at least `params.ready_for`, in id order after
    /// `params.after`: the rows [`crate::plan::hints::needs_hint`] selects. What a
    /// queue's repair pass publishes hints for again; it reads and changes nothing else.
    async fn instance_ready_stale(&self, params: ReadyStaleParams) -> StoreResult<Vec<Instance>>;

    /// Commits step results; per item, a receipt or the reason it was rejected
    /// (`LeaseLost` for a stale token, `Invalid` for a malformed outcome). A rejected item
    /// changes nothing; the others are unaffected.
    async fn step_commit(
        &self,
        params: CommitParams,
    ) -> StoreResult<Vec<StoreResult<CommitReceipt>>>;

    /// Extends leases; per item, whether the lease is still held.
    async fn lease_extend(&self, params: LeaseExtendParams) -> StoreResult<Vec<bool>>;

    /// Returns expired (or a restarted owner's) leases to runnable with attempt + 1.
    async fn lease_reap(&self, params: LeaseReapParams) -> StoreResult<Vec<InstanceId>>;

    /// Releases leases without counting an attempt; per item, whether it was still held.
    async fn lease_release(&self, params: LeaseReleaseParams) -> StoreResult<Vec<bool>>;

    /// Delivers signals; per item, what happened.
    async fn signal_deliver(
        &self,
        params: SignalDeliverParams,
    ) -> StoreResult<Vec<DeliveryOutcome>>;

    /// Delivers one event to every non-terminal instance of a machine in a state.
    async fn signal_broadcast(&self, params: SignalBroadcastParams)
    -> StoreResult<BroadcastReport>;

    /// Cancels an instance (and with `cascade`, its non-terminal descendants); returns
    /// the ids it cancelled. `NotFound` for a missing instance; an already terminal one
    /// is left as it is (empty result).
    async fn instance_cancel(&self, params: CancelParams) -> StoreResult<Vec<InstanceId>>;

    /// An instance with its inbox, children and history. `NotFound` if missing.
    async fn instance_get(&self, id: InstanceId) -> StoreResult<InstanceDetail>;

    /// The rows of several instances at once, without inbox, children or history: each
    /// existing id once, in id order; missing ids are left out. At most
    /// [`crate::limits::ROWS_BATCH_MAX`] ids (`Invalid` beyond, naming `ids`). What a
    /// worker reads, in one call per claim, for its steps' lock-free pre-checks.
    async fn instance_rows(&self, ids: Vec<InstanceId>) -> StoreResult<Vec<Instance>>;

    /// One page of a namespace's instances, newest first (see [`InstanceListParams`]).
    async fn instance_list(&self, params: InstanceListParams) -> StoreResult<Vec<Instance>>;

    /// Resolves a signal target to an instance id (`None` when there is none).
    async fn instance_lookup(&self, target: SignalTarget) -> StoreResult<Option<InstanceId>>;

    /// One page of dead letters, oldest first (see [`DeadLetterFilter`]). `Invalid`
    /// naming the field for a bad name, a page size above the bound or both cursors.
    async fn dead_letter_list(&self, filter: DeadLetterFilter) -> StoreResult<Vec<DeadLetter>>;

    /// One dead letter. `NotFound` if missing.
    async fn dead_letter_get(&self, id: DeadLetterId) -> StoreResult<DeadLetter>;

    /// Retries dead letters; returns the instances made runnable.
    async fn dead_letter_retry(
        &self,
        params: DeadLetterRetryParams,
    ) -> StoreResult<Vec<InstanceId>>;

    /// Skips a dead letter; returns the instance made runnable.
    async fn dead_letter_skip(&self, params: DeadLetterSkipParams) -> StoreResult<InstanceId>;

    /// Purges dead letters; returns how many were removed.
    async fn dead_letter_purge(&self, params: DeadLetterPurgeParams) -> StoreResult<u64>;

    /// How many dead letters each (namespace, machine) holds, in name order; `None` =
    /// every namespace. Stores answer it with one grouped count on an index; this default
    /// pages through [`Store::dead_letter_list`] by its id cursor (at most
    /// [`DEAD_LETTER_COUNT_PAGES_MAX`] pages), so a store that wraps another stays correct
    /// without overriding it.
    async fn dead_letter_counts(
        &self,
        namespace: Option<String>,
    ) -> StoreResult<Vec<DeadLetterCount>> {
        let mut counts: std::collections::BTreeMap<(String, String), u64> =
            std::collections::BTreeMap::new();
        let mut after = None;
        for _ in 0..DEAD_LETTER_COUNT_PAGES_MAX {
            let filter = DeadLetterFilter {
                namespace: namespace.clone(),
                after,
                limit: limits::DEAD_LETTER_BATCH_MAX,
                ..DeadLetterFilter::default()
            };
            let page = self.dead_letter_list(filter).await?;
            for d in &page {
                let key = (d.letter.namespace.clone(), d.letter.machine.name.clone());
                *counts.entry(key).or_default() += 1;
            }
            if page.len() < limits::DEAD_LETTER_BATCH_MAX {
                break;
            }
            after = page.last().map(|d| d.id);
        }
        Ok(counts
            .into_iter()
            .map(|((namespace, machine), count)| DeadLetterCount { namespace, machine, count })
            .collect())
    }

    /// Pauses or resumes a queue. A pause records the queue's settings, creating them if
    /// needed; a resume sets `paused = false` on recorded settings only and creates none,
    /// so resuming a never-paused queue is a no-op that leaves it out of
    /// [`Store::queue_list`]. Either way it is not an error.
    async fn queue_pause(&self, params: QueuePauseParams) -> StoreResult<()>;

    /// Queues with settings in a namespace (those a pause recorded, resumed or not), in name
    /// order. A queue without settings is not listed, whether or not it holds instances,
    /// and is not paused.
    async fn queue_list(&self, namespace: String) -> StoreResult<Vec<QueueState>>;

    /// Counts of non-terminal instances per (namespace, queue, machine); `None` = every
    /// namespace. `now` splits runnable rows into ready and scheduled.
    async fn queue_stats(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<QueueStats>>;

    /// Stores a schedule's pause state for every worker ([`SchedulePauseParams`]) and
    /// returns it as stored. Pausing a paused schedule (or resuming a running one) changes
    /// nothing, its time included. A new schedule in a namespace that already holds
    /// [`crate::schedule::SCHEDULE_STATES_MAX`] states is refused (`Invalid`). The rule is
    /// [`crate::schedule::plan_pause`]. The default refuses (a wrapper store forwards it).
    async fn schedule_pause(&self, params: SchedulePauseParams) -> StoreResult<ScheduleState> {
        let _ = params;
        Err(StoreError::invalid(
            "schedule_pause: this store keeps no schedule states; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// The stored schedule states of a namespace, in name order, at most
    /// [`crate::schedule::SCHEDULE_STATES_MAX`]. What every schedule runner reads before
    /// it fires a tick. The default, for a store that keeps no states (and so refuses
    /// [`Store::schedule_pause`]), has none; a wrapper store forwards it.
    async fn schedule_states(&self, namespace: String) -> StoreResult<Vec<ScheduleState>> {
        let _ = namespace;
        Ok(Vec::new())
    }

    /// Records that a schedule's tick fired ([`ScheduleFiredParams`]) and returns the
    /// state as stored: its `fired_through` becomes the later of the stored tick and this
    /// one, and never moves back. A schedule without a row in a namespace that already
    /// holds [`crate::schedule::SCHEDULE_STATES_MAX`] states is refused (`Invalid`). The
    /// rule is [`crate::schedule::plan_fired`]. The default refuses (a wrapper store
    /// forwards it).
    async fn schedule_fired(&self, params: ScheduleFiredParams) -> StoreResult<ScheduleState> {
        let _ = params;
        Err(StoreError::invalid(
            "schedule_fired: this store keeps no schedule states; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// Deletes the stored states of the named schedules in a namespace
    /// ([`ScheduleForgetParams`]) and returns how many it deleted; a name without a state
    /// is passed over. Their pauses and recorded ticks are gone, and they no longer count
    /// toward [`crate::schedule::SCHEDULE_STATES_MAX`]. The default refuses (a wrapper
    /// store forwards it).
    async fn schedule_forget(&self, params: ScheduleForgetParams) -> StoreResult<u64> {
        let _ = params;
        Err(StoreError::invalid(
            "schedule_forget: this store keeps no schedule states; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// Fires due timers.
    async fn timer_sweep(&self, params: TimerSweepParams) -> StoreResult<TimerSweepReport>;

    /// Moves one page of a machine version's armed timers to its deployed durations
    /// ([`TimerRetimeParams`]), recording `TIMER_RETIMED` on each instance whose timer
    /// moved, in one transaction. A timer fired, cancelled or moved meanwhile is left as
    /// it now is.
    async fn timers_retime(&self, params: TimerRetimeParams) -> StoreResult<TimerRetimePage>;

    /// The earliest `next_fire_at` among the armed timers in scope (`None` when there are
    /// none), overdue ones included: what a sweeper sleeps until. Stores answer it with one
    /// indexed read; this default derives it from [`Store::timer_status`] (a scan), so a
    /// store that wraps another stays correct without overriding it.
    async fn timer_next_due(&self, params: TimerNextDueParams) -> StoreResult<Option<Timestamp>> {
        // `now` only splits overdue timers from the others in the status; any value will do.
        let status = self.timer_status(params.namespace.clone(), Timestamp(0)).await?;
        Ok(params.earliest_in(&status))
    }

    /// One page of a chart version migration ([`MigrateParams`]). A store without its own
    /// implementation refuses (a wrapper store forwards it).
    async fn instance_migrate(&self, params: MigrateParams) -> StoreResult<MigratePage> {
        let _ = params;
        Err(StoreError::invalid(
            "instance_migrate: this store cannot migrate instances; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// Done and failed instances per machine and time bucket, from their rows' insert and
    /// last-change times. The default refuses (a wrapper store forwards it).
    async fn instance_activity(&self, params: ActivityParams) -> StoreResult<Vec<ActivityBucket>> {
        let _ = params;
        Err(StoreError::invalid(
            "instance_activity: this store cannot count activity; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// Records a worker's heartbeat (insert or update by id) and forgets workers not seen
    /// since `forget_before`. The default refuses (a wrapper store forwards it).
    async fn worker_heartbeat(&self, params: WorkerBeatParams) -> StoreResult<()> {
        let _ = params;
        Err(StoreError::invalid(
            "worker_heartbeat: this store keeps no worker registry; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// Workers seen since `seen_since`, most recently seen first, at most
    /// [`WORKER_LIST_MAX`]. The default refuses (a wrapper store forwards it).
    async fn worker_list(&self, seen_since: Timestamp) -> StoreResult<Vec<WorkerRecord>> {
        let _ = seen_since;
        Err(StoreError::invalid(
            "worker_list: this store keeps no worker registry; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// One page of pruning ended instances ([`PruneParams`]). A store without its own
    /// implementation refuses (a wrapper store forwards it).
    async fn instance_prune(&self, params: PruneParams) -> StoreResult<PrunePage> {
        let _ = params;
        Err(StoreError::invalid(
            "instance_prune: this store cannot prune instances; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// One page of an instance's history, newest first, with the cursor to the next, older
    /// page ([`HistoryPageParams`]). `NotFound` if the instance does not exist; `Invalid`
    /// naming the field for a page size out of bounds or a bad cursor. The default
    /// refuses (a wrapper store forwards it).
    async fn history_page(&self, params: HistoryPageParams) -> StoreResult<HistoryPage> {
        let _ = params;
        Err(StoreError::invalid(
            "history_page: this store cannot page history; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// One page of trimming history to the newest entries per instance
    /// ([`HistoryTrimParams`]). The default refuses (a wrapper store forwards it).
    async fn history_trim(&self, params: HistoryTrimParams) -> StoreResult<HistoryTrimPage> {
        let _ = params;
        Err(StoreError::invalid(
            "history_trim: this store cannot trim history; use MemoryStore, SQLite or PostgreSQL",
        ))
    }

    /// Timer health per (namespace, machine); `None` = every namespace.
    async fn timer_status(
        &self,
        namespace: Option<String>,
        now: Timestamp,
    ) -> StoreResult<Vec<TimerStatus>>;

    /// Resolves when the store learns that work may have become ready (a commit, a
    /// delivery, an insert) — a wake-up hint that only shortens latency. A store without
    /// notifications never resolves; callers race it against their poll interval, which
    /// stays the correctness path.
    async fn ready_wait(&self) {
        std::future::pending::<()>().await;
    }

    /// Resolves when the store learns that an instance may have changed status (a commit,
    /// a cancel) — a wake-up hint for callers waiting on an instance's result, never a
    /// promise that one ended. A store without such notifications never resolves; callers
    /// race it against polling with a bounded back-off, which stays the correctness path.
    async fn instance_change_wait(&self) {
        std::future::pending::<()>().await;
    }

    /// Resolves once a commit has armed timers since hint number `seen` (0 at first), with
    /// the earliest due time among them, so a sweeper asleep until a later due time can
    /// wake up earlier. Every caller reads every hint with its own cursor (see
    /// [`crate::timers::TimerHints`]); when hints may have been lost the result says so and
    /// the caller reads [`Store::timer_next_due`]. A hint may be spurious (a rolled back or
    /// rejected item, another sweeper's machines). A store without notifications never
    /// resolves; sweepers race it against their cadence, which stays the correctness path.
    async fn timer_hint_wait(&self, seen: u64) -> TimerHint {
        let _ = seen;
        std::future::pending::<TimerHint>().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// `Ok` for valid input, or the start of the `Invalid` message (the field it names).
    fn check(result: StoreResult<()>, expected: Result<(), &str>) {
        match (result, expected) {
            (Ok(()), Ok(())) => {}
            (Err(e), Err(field)) => {
                assert_eq!(e.kind, ErrorKind::Invalid, "{e:?}");
                assert!(e.message.starts_with(field), "{} does not name {field}", e.message);
            }
            (got, want) => panic!("got {got:?}, expected {want:?}"),
        }
    }

    #[test]
    fn params_refuse_batches_over_their_bound_naming_the_field() {
        let now = Timestamp(0);
        let leases = |n: usize| (1..=n as i64).map(|i| (InstanceId(i), FencingToken(1))).collect();
        let worker = WorkerId("w".into());
        let claim = |limit| ClaimParams {
            worker: worker.clone(),
            namespaces: vec![],
            queues: vec![],
            machines: vec![],
            limit,
            lease: Duration::from_secs(1),
            now,
            policy: crate::plan::claim::ClaimPolicy::default(),
        };
        let extend = |n| LeaseExtendParams {
            worker: worker.clone(),
            leases: leases(n),
            lease: Duration::from_secs(1),
            now,
        };
        let reap = |limit| LeaseReapParams { owner: None, limit, now };
        let release = |n| LeaseReleaseParams { leases: leases(n), now };
        let sweep = |limit| TimerSweepParams { namespace: None, machines: vec![], limit, now };
        let commits = CommitParams { commits: vec![], now };
        check(claim(limits::CLAIM_BATCH_MAX).validate(), Ok(()));
        check(claim(limits::CLAIM_BATCH_MAX + 1).validate(), Err("limit"));
        check(extend(limits::COMMIT_BATCH_MAX).validate(), Ok(()));
        check(extend(limits::COMMIT_BATCH_MAX + 1).validate(), Err("leases"));
        check(reap(limits::REAP_BATCH_MAX).validate(), Ok(()));
        check(reap(limits::REAP_BATCH_MAX + 1).validate(), Err("limit"));
        let twice = LeaseExtendParams {
            leases: vec![(InstanceId(7), FencingToken(2)), (InstanceId(7), FencingToken(2))],
            ..extend(0)
        };
        check(twice.validate(), Err("leases: instance i7 is named twice under token 2"));
        let stale_and_live = LeaseExtendParams {
            leases: vec![(InstanceId(7), FencingToken(1)), (InstanceId(7), FencingToken(2))],
            ..extend(0)
        };
        check(stale_and_live.validate(), Ok(()));
        check(release(limits::COMMIT_BATCH_MAX).validate(), Ok(()));
        check(release(limits::COMMIT_BATCH_MAX + 1).validate(), Err("leases"));
        check(sweep(limits::TIMER_SWEEP_BATCH_MAX).validate(), Ok(()));
        check(sweep(limits::TIMER_SWEEP_BATCH_MAX + 1).validate(), Err("limit"));
        check(commits.validate(), Ok(()));
    }

    #[test]
    fn params_refuse_bad_names_naming_the_field() {
        let broadcast = |ns: &str, state: Option<&str>, name: &str| SignalBroadcastParams {
            namespace: ns.into(),
            machine: "m".into(),
            in_state: state.map(str::to_owned),
            name: name.into(),
            payload: serde_json::Value::Null,
            dedup_key: None,
            now: Timestamp(0),
        };
        check(broadcast("ns", Some("a.b"), "go").validate(), Ok(()));
        check(broadcast("", None, "go").validate(), Err("broadcast.namespace"));
        check(broadcast("ns", Some(""), "go").validate(), Err("broadcast.in_state"));
        check(broadcast("ns", None, "").validate(), Err("broadcast"));
        let pause = |ns: &str, queue: &str| QueuePauseParams {
            namespace: ns.into(),
            queue: queue.into(),
            paused: true,
            now: Timestamp(0),
        };
        check(pause("ns", "q").validate(), Ok(()));
        check(pause("", "q").validate(), Err("namespace"));
        check(pause("ns", "").validate(), Err("queue"));
        let deliver = |name: &str| SignalDeliverParams {
            signals: vec![NewSignal::new(InstanceId(1), name.to_owned())],
            now: Timestamp(0),
        };
        check(deliver("go").validate(), Ok(()));
        check(deliver("").validate(), Err("signals[0]"));
        let machine =
            |ns: &str| DeadLetterSelector::Machine { namespace: ns.into(), machine: "m".into() };
        let retry = |selector, delay| DeadLetterRetryParams { selector, delay, now: Timestamp(0) };
        check(retry(machine("ns"), limits::RETRY_DELAY_MAX).validate(), Ok(()));
        check(retry(machine(""), Duration::ZERO).validate(), Err("selector.namespace"));
        let long = limits::RETRY_DELAY_MAX + Duration::from_secs(1);
        check(retry(DeadLetterSelector::Id(DeadLetterId(1)), long).validate(), Err("delay"));
        let purge =
            |selector| DeadLetterPurgeParams { selector, older_than: None, keep_suspended: false };
        check(purge(None).validate(), Ok(()));
        check(purge(Some(machine(""))).validate(), Err("selector.namespace"));
    }

    #[test]
    fn senders_may_not_use_the_dedup_keys_of_timer_fires_and_child_notices() {
        use crate::outcome::{NOTICE_KEY_PREFIX, Outcome, StepCommit, validate_commit_shape};
        use crate::timers::FIRE_KEY_PREFIX;
        let keyed = |key: &str| NewSignal::new(InstanceId(1), "PING").dedup_key(key);
        let deliver =
            |key: &str| SignalDeliverParams { signals: vec![keyed(key)], now: Timestamp(0) };
        let broadcast = |key: &str| SignalBroadcastParams {
            namespace: "ns".into(),
            machine: "m".into(),
            in_state: None,
            name: "PING".into(),
            payload: serde_json::Value::Null,
            dedup_key: Some(key.into()),
            now: Timestamp(0),
        };
        let emit = |key: &str| {
            let done = Outcome::Done { result: serde_json::Value::Null, step: None };
            let mut commit = StepCommit::new(InstanceId(2), crate::FencingToken(1), done);
            commit.emit.push(keyed(key));
            validate_commit_shape(&commit)
        };
        for key in [format!("{FIRE_KEY_PREFIX}7:1"), format!("{NOTICE_KEY_PREFIX}3:terminal")] {
            check(deliver(&key).validate(), Err("signals[0].dedup_key:"));
            check(broadcast(&key).validate(), Err("broadcast.dedup_key:"));
            check(emit(&key), Err("emit[0].dedup_key:"));
            let message = deliver(&key).validate().unwrap_err().message;
            assert!(message.contains("use another prefix"), "{message}");
        }
        // A key that only mentions them further in is the sender's own.
        check(deliver("my-timer:7:1").validate(), Ok(()));
        check(broadcast("schedule:3:ns:nightly:0").validate(), Ok(()));
        check(emit("order-child:3"), Ok(()));
    }

    #[test]
    fn dead_letter_pages_take_one_cursor_and_a_bounded_size() {
        let page = |limit: usize, after: Option<i64>, before: Option<i64>| DeadLetterFilter {
            namespace: Some("ns".into()),
            machine: None,
            after: after.map(DeadLetterId),
            before: before.map(DeadLetterId),
            limit,
        };
        check(page(0, None, None).validate(), Ok(()));
        check(page(limits::DEAD_LETTER_BATCH_MAX, Some(3), None).validate(), Ok(()));
        check(page(50, None, Some(3)).validate(), Ok(()));
        check(page(limits::DEAD_LETTER_BATCH_MAX + 1, None, None).validate(), Err("limit"));
        check(page(50, Some(3), Some(9)).validate(), Err("before"));
        let named = |ns: &str, machine: &str| DeadLetterFilter {
            namespace: Some(ns.into()),
            machine: Some(machine.into()),
            ..DeadLetterFilter::default()
        };
        check(named("", "m").validate(), Err("namespace"));
        check(named("ns", "").validate(), Err("machine"));
        assert_eq!(page(0, None, None).page_size(), limits::DEAD_LETTER_BATCH_MAX);
        assert_eq!(page(7, None, None).page_size(), 7);
    }

    #[test]
    fn earliest_due_from_timer_status() {
        let st = |ns: &str, machine: &str, due: Option<i64>| TimerStatus {
            namespace: ns.into(),
            machine: machine.into(),
            armed: 1,
            next_due: due.map(Timestamp),
            overdue: 0,
            last_sweep_at: None,
        };
        let status = [st("a", "m", Some(30)), st("a", "n", Some(10)), st("b", "m", Some(5))];
        let p = |ns: Option<&str>, machines: &[&str]| TimerNextDueParams {
            namespace: ns.map(str::to_owned),
            machines: machines.iter().map(|m| (*m).to_owned()).collect(),
        };
        assert_eq!(p(None, &[]).earliest_in(&status), Some(Timestamp(5)));
        assert_eq!(p(Some("a"), &[]).earliest_in(&status), Some(Timestamp(10)));
        assert_eq!(p(Some("a"), &["m"]).earliest_in(&status), Some(Timestamp(30)));
        assert_eq!(p(Some("c"), &[]).earliest_in(&status), None);
        assert_eq!(p(None, &["x"]).earliest_in(&status), None);
        assert_eq!(p(None, &[]).earliest_in(&[st("a", "m", None)]), None);
    }
}
