//! The step commit: what committing one step result does, for every store.
//!
//! A store commits a batch of step results. For each item, in batch order, it reads a
//! [`CommitRead`] under the row's lock and hands it to [`CommitPlanner::admit`], which
//! checks the item against the row as earlier items of the batch left it (a stale fencing
//! token is `LeaseLost`, a bad shape is `Invalid` naming the field, a missing row or emit
//! target is `NotFound`, a unique key that would come back into scope while another
//! instance holds it is `Conflict`). A refused item writes nothing. An admitted item names
//! the children it wants inserted; the store inserts them with its ordinary uniqueness
//! rule and passes the outcomes to [`Admitted::finish`], which returns the
//! [`CommitPlan`]: every write of the item, in the order the store performs them.
//!
//! The two phases exist because stores that let the database assign ids only learn which
//! children uniqueness let in by inserting them, and the row's new status depends on that
//! count (zero children inserted releases the barrier at once).

use super::cancel::LeftDelegations;
use super::parent::ParentRelease;
use crate::chart::{TimerArm, TimerKind};
use crate::error::{StoreError, StoreResult};
use crate::history::HistoryKind;
use crate::ids::{InstanceId, SignalId, Status, TimerId};
use crate::inbox;
use crate::instance::{
    HistoryEntry, Instance, NewDeadLetter, NewInstance, NewSignal, Signal, unique_guard,
};
use crate::join::{DEADLINE_EVENT, DEADLINE_OWNER, JoinState, JoinWoke};
use crate::outcome::{self, ApplyFacts, Outcome, StepCommit};
use crate::ports::store::{CommitReceipt, InsertOutcome};
use crate::time::Timestamp;
use crate::timers::{self, TimerRow};
use serde_json::json;
use std::collections::HashMap;

/// What a store read for one commit item, under the lock of the item's row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommitRead {
    /// The instance row, or `None` when no such instance exists.
    pub row: Option<Instance>,
    /// Per emitted signal, in order, the instance its target resolves to (`None`: no such
    /// instance).
    pub emit_targets: Vec<Option<InstanceId>>,
    /// What the commit needs to know about the instance's inbox.
    pub inbox: InboxRead,
    /// The instance, other than this one, holding the unique key named by
    /// [`reentering_key`] for this item; `None` when that key is free or there is none.
    pub key_occupant: Option<InstanceId>,
}

/// The inbox facts a commit depends on, read after the row's lock so that no delivery can
/// slip in between.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxRead {
    /// For `Await`: whether a signal the instance awaits is in the inbox, the ones this
    /// commit consumes left out.
    pub signal_waiting: bool,
    /// For an outcome that ends the instance: the signals left unread once this commit's
    /// consumption is removed (see [`inbox::drains`]).
    pub pending: inbox::Pending,
    /// The most urgent priority among the signals this commit leaves unread (`None`: no
    /// unread signal has one), from which the row's claim priority is set again
    /// ([`inbox::claim_priority`]).
    pub pending_priority: Option<crate::ids::Priority>,
    /// The timer fires and child notices this commit takes out of the inbox unread (see
    /// [`InboxRead::with_fires`]).
    pub withdrawn: Vec<UnreadFire>,
}

/// A signal waiting unread in the committing instance's inbox that belongs to one entry
/// of a state: a timer's fire, or a delegated child's notice of its end
/// ([`outcome::parent_notice`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadFire {
    /// The signal.
    pub id: SignalId,
    /// Its event.
    pub name: String,
    /// The state that owned the timer, or the delegation state that started the child.
    pub state: String,
    /// Its dedup key (which timer and which fire, or which child).
    pub key: String,
}

impl UnreadFire {
    /// The fire `signal` is, or `None` when it is neither a timer's fire nor a child's
    /// notice.
    pub fn of(signal: &Signal) -> Option<Self> {
        let state =
            timers::fire_owner(signal.dedup_key.as_deref(), &signal.payload).map(str::to_owned);
        Self::read(signal.id, &signal.name, signal.dedup_key.as_deref(), state)
    }

    /// The fire a stored signal is, from its id, name, dedup key and the `state` its
    /// payload names (a store that reads only these columns); `None` when it is neither a
    /// timer's fire nor a child's notice.
    pub fn read(
        id: SignalId,
        name: &str,
        dedup_key: Option<&str>,
        payload_state: Option<String>,
    ) -> Option<Self> {
        let key = dedup_key?;
        let state = if key.starts_with(timers::FIRE_KEY_PREFIX) {
            payload_state?
        } else {
            outcome::notice_state(key, name)?.to_owned()
        };
        Some(UnreadFire { id, name: name.to_owned(), state, key: key.to_owned() })
    }

    /// Whether this is a child's notice rather than a timer's fire.
    pub fn is_notice(&self) -> bool {
        outcome::notice_state(&self.key, &self.name).is_some()
    }

    /// Whether `commit` leaves the state entry this belongs to: a timer's fire whose
    /// owner's timers it cancels, or a child's notice whose delegation state it leaves.
    fn stale(&self, commit: &StepCommit) -> bool {
        if self.is_notice() {
            commit.children_cancel.contains(&self.state)
        } else {
            timers::cancelled(&self.state, &commit.timers_cancel)
        }
    }

    fn history(&self) -> HistoryEntry {
        let kind = if self.is_notice() {
            HistoryKind::ChildNoticeWithdrawn
        } else {
            HistoryKind::TimerWithdrawn
        };
        HistoryEntry::new(
            kind,
            json!({ "signal": self.id, "event": self.name, "state": self.state, "key": self.key }),
        )
    }
}

/// Whether committing `commit` may withdraw fires, so that the store must read the
/// instance's unread fires and child notices for [`InboxRead::with_fires`]: the commit
/// cancels timers or leaves delegation states, and does not end the instance (an ending
/// instance's whole inbox goes anyway).
pub fn withdraws_fires(commit: &StepCommit) -> bool {
    (!commit.timers_cancel.is_empty() || !commit.children_cancel.is_empty())
        && !inbox::drains(&commit.outcome)
}

impl InboxRead {
    /// The facts, from the instance's whole inbox in arrival order (for a store that reads
    /// the inbox rather than asking these questions in its query language).
    pub fn of<'a>(inbox: impl IntoIterator<Item = &'a Signal>, commit: &StepCommit) -> Self {
        let unread: Vec<&Signal> =
            inbox.into_iter().filter(|s| !commit.consume.contains(&s.id)).collect();
        let fires: Vec<UnreadFire> = if withdraws_fires(commit) {
            unread.iter().filter_map(|s| UnreadFire::of(s)).collect()
        } else {
            Vec::new()
        };
        let signal_waiting = match &commit.outcome {
            Outcome::Await { signal, .. } => unread.iter().any(|s| {
                !fires.iter().any(|f| f.id == s.id) && outcome::signal_matches(signal, &s.name)
            }),
            _ => false,
        };
        let pending_priority = unread.iter().filter_map(|s| s.priority).min();
        let pending = if inbox::drains(&commit.outcome) {
            inbox::Pending::of(unread)
        } else {
            inbox::Pending::default()
        };
        InboxRead { signal_waiting, pending, pending_priority, withdrawn: Vec::new() }
            .with_fires(commit, fires)
    }

    /// Completes facts whose `signal_waiting` left fires out, given the unread `fires`
    /// (a store reads both only when [`withdraws_fires`]; otherwise fires count like any
    /// signal and `fires` is empty). A fire whose timer belonged to a state this commit
    /// leaves (or one of its descendants), or a child's notice about a delegation state it
    /// leaves, is stale: the state entry it was meant for is over, so it is withdrawn,
    /// unread, with a `TIMER_WITHDRAWN` or `CHILD_NOTICE_WITHDRAWN` entry, even when the
    /// commit enters the state again. The other fires count toward `signal_waiting`.
    pub fn with_fires(mut self, commit: &StepCommit, fires: Vec<UnreadFire>) -> Self {
        let (withdrawn, kept): (Vec<_>, Vec<_>) = fires.into_iter().partition(|f| f.stale(commit));
        if let Outcome::Await { signal, .. } = &commit.outcome {
            self.signal_waiting |= kept.iter().any(|f| outcome::signal_matches(signal, &f.name));
        }
        self.withdrawn = withdrawn;
        self
    }
}

/// The unique key `commit` could bring back into scope for `row`: the row's key when its
/// scope leaves out `executing` (the claim took the key out of scope) but includes a status
/// the outcome may land in. For `ScheduleChildren` both landings count, since how many
/// children uniqueness lets in is not known yet. A store reads who holds this key (other
/// than the row itself) into [`CommitRead::key_occupant`].
pub fn reentering_key<'a>(
    row: &'a Instance,
    commit: &StepCommit,
    signal_waiting: bool,
) -> Option<&'a [u8]> {
    let unique = row.unique.as_ref()?;
    if unique.scope.contains(Status::Executing) {
        return None;
    }
    let requested = match &commit.outcome {
        Outcome::ScheduleChildren { children, .. } => children.len(),
        _ => 0,
    };
    let counts: &[i32] = if requested == 0 { &[0] } else { &[0, 1] };
    let lands = counts.iter().any(|n| {
        let facts = ApplyFacts { now: row.updated_at, signal_waiting, children_inserted: *n };
        unique.scope.contains(outcome::status_after(&commit.outcome, facts))
    });
    lands.then_some(unique.key.as_slice())
}

/// Every child a commit starts, named by its field.
fn child_fields(commit: &StepCommit) -> impl Iterator<Item = (String, &NewInstance)> {
    let barrier: &[NewInstance] = match &commit.outcome {
        Outcome::ScheduleChildren { children, .. } => children,
        _ => &[],
    };
    let barrier = barrier.iter().enumerate().map(|(i, c)| (format!("outcome.children[{i}]"), c));
    barrier.chain(commit.spawn.iter().enumerate().map(|(i, c)| (format!("spawn[{i}]"), c)))
}

/// The earliest due time among the timers a committed batch armed, for the sweepers' hint:
/// only accepted items that stay live keep the timers they armed. `None` when none did.
pub fn armed_due(
    commits: &[StepCommit],
    results: &[StoreResult<CommitReceipt>],
    now: Timestamp,
) -> Option<Timestamp> {
    let armed = commits
        .iter()
        .zip(results)
        .filter(|(_, r)| r.as_ref().is_ok_and(|r| !r.status.is_terminal()))
        .map(|(c, _)| c);
    timers::armed_due(armed, now)
}

/// Plans the items of one commit batch in order, remembering what earlier items changed:
/// an admitted item takes its row out of `executing` (so a second item for the same
/// instance is stale) and may take a unique key (so a later item that would bring the same
/// key back is refused).
#[derive(Debug, Clone)]
pub struct CommitPlanner {
    now: Timestamp,
    /// Rows as admitted items of this batch left them.
    rows: HashMap<InstanceId, Instance>,
    /// Unique keys admitted items of this batch bring back into scope.
    keys: HashMap<Vec<u8>, InstanceId>,
}

impl CommitPlanner {
    /// A planner for a batch committed at `now`.
    pub fn new(now: Timestamp) -> Self {
        CommitPlanner { now, rows: HashMap::new(), keys: HashMap::new() }
    }

    /// Checks one item against what the store read and what earlier items of the batch
    /// did. On success the item is admitted: its row counts as no longer executing for
    /// the rest of the batch.
    pub fn admit(&mut self, commit: &StepCommit, read: CommitRead) -> StoreResult<Admitted> {
        let row = match self.rows.get(&commit.id) {
            Some(row) => row.clone(),
            None => read.row.ok_or_else(|| {
                StoreError::not_found(format!(
                    "instance {} does not exist; nothing was committed for it",
                    commit.id
                ))
            })?,
        };
        outcome::validate_commit(&row, commit)?;
        let mut emits = Vec::with_capacity(commit.emit.len());
        for (i, signal) in commit.emit.iter().enumerate() {
            let target = read.emit_targets.get(i).copied().flatten().ok_or_else(|| {
                StoreError::not_found(format!(
                    "emit[{i}].target: no instance {:?}; the step result was rejected, nothing was committed",
                    signal.target
                ))
            })?;
            emits.push((signal.clone(), target));
        }
        if let Some(key) = reentering_key(&row, commit, read.inbox.signal_waiting) {
            let earlier = self.keys.get(key).copied().filter(|id| *id != row.id);
            if let Some(other) = read.key_occupant.filter(|id| *id != row.id).or(earlier) {
                return Err(StoreError::conflict(format!(
                    "instance {}: its unique key would be back in scope, but instance {other} occupies it",
                    row.id
                )));
            }
            // A child started by this commit would take the key first (children are
            // inserted before the row is written), leaving two holders of one key.
            if let Some(field) = child_fields(commit)
                .find(|(_, spec)| unique_guard(spec.unique.as_ref(), Status::Runnable) == Some(key))
            {
                return Err(StoreError::conflict(format!(
                    "{}: the child's unique key is the one instance {} brings back into scope; give the child another key",
                    field.0, row.id
                )));
            }
            self.keys.insert(key.to_vec(), row.id);
        }
        let mut after = row.clone();
        after.status = outcome::status_after(
            &commit.outcome,
            ApplyFacts {
                now: self.now,
                signal_waiting: read.inbox.signal_waiting,
                children_inserted: 0,
            },
        );
        self.rows.insert(row.id, after);
        let barrier: &[NewInstance] = match &commit.outcome {
            Outcome::ScheduleChildren { children, .. } => children,
            _ => &[],
        };
        let children = barrier
            .iter()
            .map(|spec| ChildInsert { spec: spec.clone(), parent: row.id, barrier: true })
            .chain(commit.spawn.iter().map(|spec| ChildInsert {
                spec: spec.clone(),
                parent: row.id,
                barrier: false,
            }))
            .collect();
        Ok(Admitted { now: self.now, row, inbox: read.inbox, emits, children })
    }
}

/// A child an admitted commit starts: a `ScheduleChildren` child (counted on the parent's
/// barrier) or a `spawn` item (not counted). The store inserts it under the ordinary
/// uniqueness rule, with `parent` as its parent.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildInsert {
    /// What to insert.
    pub spec: NewInstance,
    /// The committing instance.
    pub parent: InstanceId,
    /// Whether the parent's barrier waits for it.
    pub barrier: bool,
}

/// An item the planner admitted, waiting for the outcomes of its child inserts.
#[derive(Debug, Clone)]
pub struct Admitted {
    now: Timestamp,
    row: Instance,
    inbox: InboxRead,
    emits: Vec<(NewSignal, InstanceId)>,
    /// The children to insert, barrier children first, then spawned ones.
    pub children: Vec<ChildInsert>,
}

impl Admitted {
    /// The complete plan, given one insert outcome per entry of
    /// [`children`](Self::children), in the same order.
    pub fn finish(self, commit: &StepCommit, inserted: &[InsertOutcome]) -> CommitPlan {
        let barrier = self.children.iter().filter(|c| c.barrier).count().min(inserted.len());
        let (children, spawned) = inserted.split_at(barrier);
        let children_inserted =
            children.iter().filter(|o| matches!(o, InsertOutcome::Inserted(_))).count();
        let facts = ApplyFacts {
            now: self.now,
            signal_waiting: self.inbox.signal_waiting,
            children_inserted: i32::try_from(children_inserted).unwrap_or(i32::MAX),
        };
        let applied = outcome::apply(&self.row, commit, facts);
        let terminal = applied.became_terminal();
        let mut row = applied.row;
        row.priority = inbox::claim_priority(row.base_priority, [self.inbox.pending_priority]);
        let mut history = applied.history;
        let deadline = start_join(&self.row, commit, children, &mut row, self.now);
        if terminal && let Some(entry) = inbox::drained(&self.inbox.pending) {
            history.push(entry);
        }
        // A terminal instance keeps no timers, so its timer changes are moot.
        let timers = if terminal {
            TimerPlan::DropAll
        } else {
            let arm = commit.timers_arm.iter().map(|spec| {
                TimerRow::armed(
                    TimerId(0),
                    row.id,
                    &row.namespace,
                    &row.machine,
                    spec.clone(),
                    self.now,
                )
            });
            let arm = arm.chain(deadline.map(|spec| {
                TimerRow::armed(TimerId(0), row.id, &row.namespace, &row.machine, spec, self.now)
            }));
            TimerPlan::Change { cancel: commit.timers_cancel.clone(), arm: arm.collect() }
        };
        let mut consume = commit.consume.clone();
        if !terminal {
            for fire in &self.inbox.withdrawn {
                consume.push(fire.id);
                history.push(fire.history());
            }
        }
        let release = super::parent::ended(&row);
        let parent_notice = release.as_ref().and_then(|r| r.notice.clone());
        let receipt = CommitReceipt {
            id: row.id,
            revision: row.revision,
            status: row.status,
            children: children.to_vec(),
            spawned: spawned.to_vec(),
            dead_letter: None,
        };
        CommitPlan {
            attempt: self.row.attempt,
            consume,
            drain_inbox: terminal,
            history,
            dead_letter: applied.dead_letter,
            timers,
            emits: self.emits,
            barrier_release: release,
            parent_notice,
            children_cancel: LeftDelegations::of(
                &commit.children_cancel,
                row.status == Status::Failed,
            )
            .sparing(inserted.iter().filter_map(|o| match o {
                InsertOutcome::Inserted(id) => Some(*id),
                InsertOutcome::Existing(_) => None,
            })),
            receipt,
            row,
        }
    }
}

/// Starts the join of a `ScheduleChildren` commit on `row` (the row after the commit):
/// a non-default join, or any join of a parent that used one before, keeps its
/// bookkeeping in the context ([`JoinState`]) over the barrier children actually inserted.
/// Returns the deadline timer to arm while the parent waits. If fewer children went in
/// than the quorum needs, the parent does not wait at all: it wakes at once (the children
/// that did go in run on).
fn start_join(
    before: &Instance,
    commit: &StepCommit,
    inserted: &[InsertOutcome],
    row: &mut Instance,
    now: Timestamp,
) -> Option<TimerArm> {
    let Outcome::ScheduleChildren { join, .. } = &commit.outcome else { return None };
    if join.is_all() && JoinState::of(&before.context).is_none() {
        return None;
    }
    let pending: Vec<InstanceId> = inserted
        .iter()
        .filter_map(|o| match o {
            InsertOutcome::Inserted(id) => Some(*id),
            InsertOutcome::Existing(_) => None,
        })
        .collect();
    let mut state = JoinState::start(join, pending, now);
    let waiting = row.status == Status::AwaitingChildren;
    if waiting && let Some(why) = state.settled() {
        state.woke = Some(why);
        state.unfinished = u32::try_from(state.pending.len()).unwrap_or(u32::MAX);
        state.pending.clear();
        row.status = Status::Runnable;
        row.eligible_at = now;
        row.children_pending = 0;
    } else if !waiting {
        // No child went in: nothing to wait for.
        state.woke = Some(JoinWoke::All);
    }
    state.store(&mut row.context);
    let deadline = join.within.filter(|_| row.status == Status::AwaitingChildren)?;
    Some(TimerArm {
        state: DEADLINE_OWNER.to_owned(),
        event: DEADLINE_EVENT.to_owned(),
        kind: TimerKind::After,
        interval: deadline,
        max: None,
        then: None,
    })
}

impl TimerPlan {
    /// Whether this plan deletes a timer of the instance owned by `state`: every timer
    /// when the instance ended, otherwise those owned by a cancelled state or one of its
    /// descendants.
    pub fn cancels(&self, state: &str) -> bool {
        match self {
            TimerPlan::Change { cancel, .. } => timers::cancelled(state, cancel),
            TimerPlan::DropAll => true,
        }
    }
}

/// What happens to the committing instance's timers.
#[derive(Debug, Clone, PartialEq)]
pub enum TimerPlan {
    /// Delete every timer of the instance owned by one of the `cancel` states or their
    /// descendants (see [`TimerPlan::cancels`]), then insert `arm`.
    Change {
        /// The states whose timers end.
        cancel: Vec<String>,
        /// The timers to arm, each due one interval after the commit; their ids are
        /// placeholders the store replaces with ones it assigns.
        arm: Vec<TimerRow>,
    },
    /// The instance became terminal: delete every timer it has.
    DropAll,
}

/// Every write of one accepted commit item, performed in the same transaction as its
/// read. The children are already inserted. The row must be written before the emits and
/// the parent notice are delivered (an instance may signal itself, and a delivery wakes
/// the row as written), and the parent's barrier is released before its notice arrives;
/// the other writes are independent of each other.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitPlan {
    /// The row after the commit.
    pub row: Instance,
    /// The attempt the history entries are recorded under (the row's attempt before).
    pub attempt: i32,
    /// Inbox signals to delete: the consumed ones and the withdrawn timer fires; ids no
    /// longer in the inbox are ignored.
    pub consume: Vec<SignalId>,
    /// Whether the whole inbox is deleted: the instance ended, and its inbox closes. The
    /// drain's history entry, when anything was pending, is already in `history`.
    pub drain_inbox: bool,
    /// History to append, in order.
    pub history: Vec<HistoryEntry>,
    /// The dead letter to store.
    pub dead_letter: Option<NewDeadLetter>,
    /// The timer changes.
    pub timers: TimerPlan,
    /// Outbox signals to deliver, each with its resolved target, through the ordinary
    /// delivery rules.
    pub emits: Vec<(NewSignal, InstanceId)>,
    /// The parent whose barrier counts this instance as ended, with what it counts (see
    /// [`super::parent::release`]); the parent may no longer exist.
    pub barrier_release: Option<ParentRelease>,
    /// The event the parent hears of this instance's end through its inbox, delivered
    /// after the barrier release; dropped when the parent no longer exists.
    pub parent_notice: Option<NewSignal>,
    /// The delegated children the commit cancels (those of the delegation states it
    /// left, or all of them when the instance failed): after the writes above, the store
    /// plans each live child [`LeftDelegations::covers`] with
    /// [`super::cancel::left_delegation`] (its descendants too) and writes it, in the same
    /// transaction.
    pub children_cancel: LeftDelegations,
    /// The receipt; the store fills in the dead letter's id once it has one.
    pub receipt: CommitReceipt,
}

#[cfg(test)]
mod tests;
