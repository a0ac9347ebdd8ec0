//! Parallel dispatch, the pure half.
//!
//! With [`Macrostep::dispatch_regions`] on, entering a parallel state whose regions (two or
//! more) have entry actions reports them as [`RegionDispatch`]es instead of running them.
//! The runtime then:
//!
//! 1. records the dispatch in the instance's [`ParallelBook`] (one [`DispatchRecord`] per
//!    parallel state, with a dispatch number so that results of an earlier visit of the
//!    same state are recognised) and starts one region task per [`RegionTask`];
//! 2. in the task: [`check`] against the parent's state without any lock (a failed check
//!    is a silent no-op), then [`RegionRun`] runs the region's entry actions on the
//!    snapshot and yields a [`RegionReport::Completed`] (context diff + raised events);
//!    a task that runs out of tries yields a [`RegionReport::Failed`];
//! 3. in the parent's normal one-event-at-a-time processing: [`apply_report`] guards
//!    against fresh state, merges the diff (last writer wins, conflicts recorded) and hands
//!    back a macrostep for the raised events (or the `@fail` event); after running it,
//!    [`finish_report`] records `PARALLEL_REGION_ENTER`, `PARALLEL_REGION_STALLED` and
//!    `PARALLEL_DONE`;
//! 4. [`timeout`] turns a due region-timeout timer into `PARALLEL_REGION_TIMEOUT` + `@fail`.
//!
//! Everything here is deterministic: the same inputs give the same records, so the
//! in-memory `TestMachine` and the durable runtime share it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::algorithm::{
    ActionError, ActionPhase, ActionRequest, Limits, Macrostep, add_descendants,
    eventless_at_or_above, region_dispatches,
};
use super::configuration::Configuration;
use super::context::{ActionResult, ChartContext};
use super::definition::{Definition, Event, StateKind};
use crate::context::{self, ContextDiff};
use crate::instance::HistoryEntry;

/// History kind: a region's result was applied.
pub const PARALLEL_REGION_ENTER: &str = "PARALLEL_REGION_ENTER";
/// History kind: a region's result was discarded by the under-lock guard.
pub const PARALLEL_REGION_GUARD_ABORT: &str = "PARALLEL_REGION_GUARD_ABORT";
/// History kind: a region overwrote keys a sibling had changed since dispatch.
pub const PARALLEL_CONTEXT_CONFLICT: &str = "PARALLEL_CONTEXT_CONFLICT";
/// History kind: a region's entry work finished but the region did not advance.
pub const PARALLEL_REGION_STALLED: &str = "PARALLEL_REGION_STALLED";
/// History kind: the region timeout passed with regions unfinished.
pub const PARALLEL_REGION_TIMEOUT: &str = "PARALLEL_REGION_TIMEOUT";
/// History kind: every region is final and `@done` fired.
pub const PARALLEL_DONE: &str = "PARALLEL_DONE";
/// History kind: a region task ran out of tries.
pub const PARALLEL_FAIL: &str = "PARALLEL_FAIL";
/// History kind: region tasks were started (the durable form of the `dispatched` flag).
pub const PARALLEL_DISPATCH: &str = "PARALLEL_DISPATCH";

/// The reserved top-level context key the runtime keeps the [`ParallelBook`] under. Actions
/// and guards never see it; results never contain it.
pub const BOOK_KEY: &str = "@parallel";

/// A region whose entry actions the macrostep left for the runtime to run elsewhere.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDispatch {
    /// The parallel state's path.
    pub parallel_state: String,
    /// The region's path (a child of `parallel_state`).
    pub region: String,
    /// The region's states entered, in entry order (the region first, its leaf last); this
    /// is "the region at its initial state".
    pub entered: Vec<String>,
    /// The event whose processing entered the parallel state (what the actions see).
    pub event: Event,
}

impl RegionDispatch {
    /// The entry actions to run, in order.
    pub fn actions(&self, def: &Definition) -> Vec<ActionRequest> {
        self.entered
            .iter()
            .filter_map(|path| def.state(path))
            .flat_map(|node| {
                node.entry.iter().map(|name| ActionRequest {
                    name: name.clone(),
                    event: self.event.clone(),
                    state: node.path.clone(),
                    phase: ActionPhase::Entry,
                })
            })
            .collect()
    }
}

/// Which visit of which region a task or report belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionKey {
    /// The dispatch number ([`DispatchRecord::dispatch`]).
    pub dispatch: u64,
    /// The parallel state's path.
    pub parallel_state: String,
    /// The region's path.
    pub region: String,
    /// The region's states as entered.
    pub entered: Vec<String>,
}

/// What a region task carries: which region to enter, and the context snapshot at dispatch
/// (also the baseline conflicts are detected against).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionTask {
    /// The region.
    pub key: RegionKey,
    /// The event that entered the parallel state.
    pub event: Event,
    /// The context at dispatch (without the book).
    pub snapshot: Value,
}

impl RegionTask {
    /// The region's entry actions, in order.
    pub fn actions(&self, def: &Definition) -> Vec<ActionRequest> {
        RegionDispatch {
            parallel_state: self.key.parallel_state.clone(),
            region: self.key.region.clone(),
            entered: self.key.entered.clone(),
            event: self.event.clone(),
        }
        .actions(def)
    }
}

/// What a region task reports to its parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RegionReport {
    /// The entry actions ran.
    Completed {
        /// The region.
        key: RegionKey,
        /// What they changed, against the snapshot.
        diff: ContextDiff,
        /// The snapshot's values of the keys in `diff` (absent = absent at dispatch).
        baseline: Map<String, Value>,
        /// The events they raised, in order.
        raised: Vec<Event>,
    },
    /// The task ran out of tries (or failed permanently).
    Failed {
        /// The region.
        key: RegionKey,
        /// The last error message.
        error: String,
        /// The error's kind: `ActionError`, `Timeout`, `Panic`, …
        exception: String,
        /// Attempts made.
        attempts: u32,
    },
}

impl RegionReport {
    /// The region the report is about.
    pub fn key(&self) -> &RegionKey {
        match self {
            Self::Completed { key, .. } | Self::Failed { key, .. } => key,
        }
    }
}

/// Runs one region's entry actions against a snapshot: [`poll`](Self::poll) the next
/// action, run it on [`context`](Self::context), feed
/// [`handle_action_result`](Self::handle_action_result); then [`report`](Self::report).
#[derive(Debug)]
pub struct RegionRun {
    key: RegionKey,
    snapshot: Value,
    context: ChartContext,
    actions: std::collections::VecDeque<ActionRequest>,
    raised: Vec<Event>,
}

impl RegionRun {
    /// A run of `task`'s entry actions.
    pub fn new(def: &Definition, task: &RegionTask) -> Self {
        let mut run = Self {
            key: task.key.clone(),
            snapshot: task.snapshot.clone(),
            context: ChartContext::new(task.snapshot.clone()),
            actions: task.actions(def).into(),
            raised: Vec::new(),
        };
        run.raise_builtins();
        run
    }

    /// Runs the core's built-in raise actions at the front of the queue, as the macrostep
    /// does, so that the runtime is only ever asked for actions it binds.
    fn raise_builtins(&mut self) {
        while let Some(event) = self
            .actions
            .front()
            .and_then(|a| a.name.strip_prefix(super::algorithm::RAISE_ACTION_PREFIX))
        {
            self.raised.push(Event::new(event));
            self.actions.pop_front();
        }
    }

    /// The next action to run, or `None` when all ran.
    pub fn poll(&self) -> Option<&ActionRequest> {
        self.actions.front()
    }

    /// The context as the earlier actions left it.
    pub fn context(&self) -> &ChartContext {
        &self.context
    }

    /// Feeds the result of the action [`poll`](Self::poll) returned. An error ends the run:
    /// the runtime retries the whole task (from the snapshot) per its policy.
    pub fn handle_action_result(
        &mut self,
        result: Result<ActionResult, ActionError>,
    ) -> Result<(), ActionError> {
        self.actions.pop_front();
        let result = result?;
        self.context.apply(&result);
        self.raised.extend(result.raised);
        self.raise_builtins();
        Ok(())
    }

    /// The report, once every action ran.
    pub fn report(&self) -> RegionReport {
        let after = self.context.to_value();
        let diff = context::diff(&self.snapshot, &after).unwrap_or_default();
        let baseline = diff
            .keys()
            .into_iter()
            .filter_map(|k| self.snapshot.get(k).map(|v| (k.to_owned(), v.clone())))
            .collect();
        RegionReport::Completed {
            key: self.key.clone(),
            diff,
            baseline,
            raised: self.raised.clone(),
        }
    }
}

/// The error a region task reports when its action `request` failed with `error`: it
/// names the action and its state, so the parent's `PARALLEL_FAIL` says where the region
/// failed, whichever runtime ran the task.
pub fn action_failure(request: &ActionRequest, error: &ActionError) -> String {
    format!("action `{}` of state `{}` failed: {}", request.name, request.state, error.message)
}

/// A region's progress within one dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionStatus {
    /// Dispatched, no result applied yet.
    Pending,
    /// Its result was applied.
    Applied,
    /// Its task ran out of tries.
    Failed,
}

/// One dispatch of one parallel state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchRecord {
    /// Unique within the instance; a result for another number is stale.
    pub dispatch: u64,
    /// Dispatched regions by path.
    pub regions: BTreeMap<String, RegionStatus>,
    /// `PARALLEL_FAIL` was recorded (later failures and the region timeout are no-ops).
    #[serde(default)]
    pub failed: bool,
    /// The region timeout was handled (a second firing and later failures are no-ops).
    #[serde(default)]
    pub timed_out: bool,
}

impl DispatchRecord {
    /// Whether this dispatch had its one `@fail` already, from a region that failed or
    /// from the region timeout: a later failure or timeout raises nothing new.
    pub fn fail_handled(&self) -> bool {
        self.failed || self.timed_out
    }
}

/// The runtime's bookkeeping of dispatched parallel states, kept in the context under
/// [`BOOK_KEY`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelBook {
    /// The last dispatch number handed out.
    pub last_dispatch: u64,
    /// Active dispatches by parallel state path.
    pub active: BTreeMap<String, DispatchRecord>,
}

impl ParallelBook {
    /// Removes the book from `context` (a context without one gives an empty book).
    pub fn take(context: &mut Value) -> Self {
        context
            .as_object_mut()
            .and_then(|m| m.remove(BOOK_KEY))
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default()
    }

    /// Puts the book back into `context` (nothing when it is empty).
    pub fn put(&self, context: &mut Value) {
        if *self == Self::default() {
            return;
        }
        if let (Some(map), Ok(value)) = (context.as_object_mut(), serde_json::to_value(self)) {
            map.insert(BOOK_KEY.to_owned(), value);
        }
    }

    /// Records `regions` as dispatched with `snapshot` and returns one task per region.
    pub fn dispatch(&mut self, regions: &[RegionDispatch], snapshot: &Value) -> Vec<RegionTask> {
        let mut numbers: BTreeMap<&str, u64> = BTreeMap::new();
        let mut tasks = Vec::with_capacity(regions.len());
        for r in regions {
            let dispatch = *numbers.entry(&r.parallel_state).or_insert_with(|| {
                self.last_dispatch += 1;
                self.last_dispatch
            });
            let record = self.active.entry(r.parallel_state.clone()).or_insert(DispatchRecord {
                dispatch,
                regions: BTreeMap::new(),
                failed: false,
                timed_out: false,
            });
            if record.dispatch != dispatch {
                *record = DispatchRecord {
                    dispatch,
                    regions: BTreeMap::new(),
                    failed: false,
                    timed_out: false,
                };
            }
            record.regions.insert(r.region.clone(), RegionStatus::Pending);
            tasks.push(RegionTask {
                key: RegionKey {
                    dispatch,
                    parallel_state: r.parallel_state.clone(),
                    region: r.region.clone(),
                    entered: r.entered.clone(),
                },
                event: r.event.clone(),
                snapshot: snapshot.clone(),
            });
        }
        tasks
    }

    /// Forgets the dispatches of parallel states no longer active, and of those `exited`
    /// by the step even if it entered them again (that visit's region tasks are stale, and
    /// a re-entry that dispatches again starts a new record); returns their paths.
    pub fn prune(&mut self, configuration: &Configuration, exited: &[&str]) -> Vec<String> {
        let gone: Vec<String> = self
            .active
            .keys()
            .filter(|p| !configuration.contains(p) || exited.contains(&p.as_str()))
            .cloned()
            .collect();
        for p in &gone {
            self.active.remove(p);
        }
        gone
    }
}

/// Why a region's work is not (or no longer) wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Skip {
    /// The machine is not in that visit of the parallel state any more.
    MachineLeftParallelState,
    /// The region moved away from the states it entered.
    RegionAlreadyAdvanced,
    /// This region's result was applied already (a replay).
    AlreadyApplied,
}

impl Skip {
    /// The `reason` written into `PARALLEL_REGION_GUARD_ABORT`.
    pub fn reason(self) -> &'static str {
        match self {
            Self::MachineLeftParallelState => "machine_left_parallel_state",
            Self::RegionAlreadyAdvanced => "region_already_advanced",
            Self::AlreadyApplied => "already_applied",
        }
    }
}

/// The double guard: is `key`'s work still wanted by an instance at `configuration` with
/// `book`? The region task runs it without a lock before doing any work; [`apply_report`]
/// runs it again on fresh state.
pub fn check(
    configuration: &Configuration,
    book: &ParallelBook,
    key: &RegionKey,
) -> Result<(), Skip> {
    let record = book
        .active
        .get(&key.parallel_state)
        .filter(|r| r.dispatch == key.dispatch && configuration.contains(&key.parallel_state))
        .ok_or(Skip::MachineLeftParallelState)?;
    if record.regions.get(&key.region) != Some(&RegionStatus::Pending) {
        return Err(Skip::AlreadyApplied);
    }
    if !key.entered.iter().all(|p| configuration.contains(p)) {
        return Err(Skip::RegionAlreadyAdvanced);
    }
    Ok(())
}

/// What the parent does with a report.
#[derive(Debug)]
pub enum ReportPlan<'d> {
    /// Nothing, and nothing recorded: a replayed result, or a failure that is already
    /// handled or concerns a visit that is over.
    Noop,
    /// Record `PARALLEL_REGION_GUARD_ABORT` (the entry) and change nothing else.
    Abort(HistoryEntry),
    /// Record `records`, drive `step` (the raised events, or the `@fail` event) like any
    /// macrostep, then call [`finish_report`] with `followup`.
    Run {
        /// Entries to record first (`PARALLEL_CONTEXT_CONFLICT`, `PARALLEL_FAIL`).
        records: Vec<HistoryEntry>,
        /// The macrostep to drive.
        step: Box<Macrostep<'d>>,
        /// What [`finish_report`] needs.
        followup: Followup,
    },
}

/// What [`finish_report`] needs to know about the report that was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Followup {
    /// The region, `None` for a failure (nothing to report about entering).
    pub region: Option<RegionKey>,
    /// The parallel state.
    pub parallel_state: String,
    /// Whether the region's entry actions changed the context.
    pub context_changed: bool,
}

/// The `PARALLEL_REGION_GUARD_ABORT` entry of a report whose work is no longer wanted:
/// why (`skip`), and the context keys and raised events it would have brought.
fn guard_abort(
    key: &RegionKey,
    skip: Skip,
    discarded: &[&str],
    discarded_events: usize,
) -> HistoryEntry {
    HistoryEntry::new(
        PARALLEL_REGION_GUARD_ABORT,
        json!({
            "region_id": key.region,
            "reason": skip.reason(),
            "discarded_context": discarded,
            "discarded_events": discarded_events,
            "work_was_discarded": !discarded.is_empty() || discarded_events > 0,
        }),
    )
}

/// Applies a region's report to the parent's fresh `configuration` and `context` (without
/// the book), updating `book`. See [`ReportPlan`].
pub fn apply_report<'d>(
    def: &'d Definition,
    configuration: &Configuration,
    context: &Value,
    book: &mut ParallelBook,
    report: &RegionReport,
    limits: Limits,
) -> ReportPlan<'d> {
    match report {
        RegionReport::Completed { key, diff, baseline, raised } => {
            match check(configuration, book, key) {
                Ok(()) => {}
                Err(Skip::AlreadyApplied) => return ReportPlan::Noop,
                Err(skip) => {
                    let discarded: Vec<&str> = diff.keys().into_iter().collect();
                    return ReportPlan::Abort(guard_abort(key, skip, &discarded, raised.len()));
                }
            }
            let baseline_value = Value::Object(baseline.clone());
            let merged = context::merge(context, diff, &baseline_value).unwrap_or_else(|_| {
                context::MergeResult { context: context.clone(), conflicted_keys: Vec::new() }
            });
            let mut records = Vec::new();
            if !merged.conflicted_keys.is_empty() {
                records.push(HistoryEntry::new(
                    PARALLEL_CONTEXT_CONFLICT,
                    json!({ "region_id": key.region, "conflicted_keys": merged.conflicted_keys }),
                ));
            }
            if let Some(record) = book.active.get_mut(&key.parallel_state) {
                record.regions.insert(key.region.clone(), RegionStatus::Applied);
            }
            let step =
                Macrostep::resume(def, configuration, merged.context, raised.clone(), limits);
            ReportPlan::Run {
                records,
                step: Box::new(step),
                followup: Followup {
                    region: Some(key.clone()),
                    parallel_state: key.parallel_state.clone(),
                    context_changed: !diff.is_empty(),
                },
            }
        }
        RegionReport::Failed { key, error, exception, attempts } => {
            // One failure, one `@fail` per dispatch: once a region failed or the region
            // timeout fired, a later failure of the same visit raises nothing new.
            let handled = book
                .active
                .get(&key.parallel_state)
                .is_some_and(|r| r.dispatch == key.dispatch && r.fail_handled());
            if handled {
                return ReportPlan::Noop;
            }
            match check(configuration, book, key) {
                Ok(()) => {}
                // The region moved on (an event advanced it while the task ran its last
                // try): the work that failed is no longer wanted, as a late success's is not.
                Err(skip @ Skip::RegionAlreadyAdvanced) => {
                    let mut entry = guard_abort(key, skip, &[], 0);
                    entry.data["error"] = json!(error);
                    return ReportPlan::Abort(entry);
                }
                // A visit that is over, or a region whose result was applied already.
                Err(Skip::MachineLeftParallelState | Skip::AlreadyApplied) => {
                    return ReportPlan::Noop;
                }
            }
            let record =
                book.active.get_mut(&key.parallel_state).expect("`check` found the record");
            record.failed = true;
            record.regions.insert(key.region.clone(), RegionStatus::Failed);
            let payload = json!({
                "region_id": key.region,
                "error": error,
                "exception": exception,
                "attempts": attempts,
            });
            // Named after the parallel state: a failure is handled once per dispatch, by
            // the parallel state's `@fail` (or an ancestor's), not inside the region.
            let event = Event::fail_state(&key.parallel_state, payload.clone());
            ReportPlan::Run {
                records: vec![HistoryEntry::new(PARALLEL_FAIL, payload)],
                step: Box::new(Macrostep::start(
                    def,
                    configuration,
                    context.clone(),
                    event,
                    limits,
                )),
                followup: Followup {
                    region: None,
                    parallel_state: key.parallel_state.clone(),
                    context_changed: false,
                },
            }
        }
    }
}

/// The entries to record after the macrostep of a [`ReportPlan::Run`] ended at
/// `configuration`: `PARALLEL_REGION_ENTER`, and `PARALLEL_REGION_STALLED` when the region
/// is still at the states it entered.
pub fn finish_report(followup: &Followup, configuration: &Configuration) -> Vec<HistoryEntry> {
    let mut records = Vec::new();
    if let Some(key) = &followup.region {
        records.push(HistoryEntry::new(
            PARALLEL_REGION_ENTER,
            json!({ "region_id": key.region, "parallel_state_id": key.parallel_state }),
        ));
        if key.entered.iter().all(|p| configuration.contains(p)) {
            records.push(HistoryEntry::new(
                PARALLEL_REGION_STALLED,
                json!({
                    "region_id": key.region,
                    "initial_state_id": key.entered.last(),
                    "context_changed": followup.context_changed,
                }),
            ));
        }
    }
    records
}

/// `PARALLEL_DONE` for every dispatched parallel state in `book` whose `done.state` event a
/// macrostep queued (`internal_events`): every region became final, whether through region
/// results or through events sent by hand. The core raises `done.state.<p>` once per
/// completion, so the entry is recorded exactly once per dispatch.
pub fn done_records(book: &ParallelBook, internal_events: &[Event]) -> Vec<HistoryEntry> {
    book.active
        .keys()
        .filter(|p| internal_events.iter().any(|e| e.name == Event::done_state(p).name))
        .map(|p| HistoryEntry::new(PARALLEL_DONE, json!({ "parallel_state_id": p })))
        .collect()
}

/// The region timeout of `parallel_state` is due. `None` (a no-op) when that state is not
/// active under a dispatch any more, the timeout was handled already, a region of the
/// dispatch failed already (its `@fail` was the dispatch's one), or every region is
/// final; else the `PARALLEL_REGION_TIMEOUT` entry and the macrostep that delivers `@fail`.
pub fn timeout<'d>(
    def: &'d Definition,
    configuration: &Configuration,
    context: &Value,
    book: &mut ParallelBook,
    parallel_state: &str,
    timeout_seconds: u64,
    limits: Limits,
) -> Option<(HistoryEntry, Box<Macrostep<'d>>)> {
    // A dispatch whose region failed already had its one `@fail`.
    let record = book.active.get_mut(parallel_state).filter(|r| !r.fail_handled())?;
    let &id = def.by_path.get(parallel_state)?;
    if !configuration.contains(parallel_state) {
        return None;
    }
    let stalled: Vec<&str> = def.states[id]
        .children
        .iter()
        .filter(|&&r| !region_final(def, configuration, r))
        .map(|&r| def.path(r))
        .collect();
    if stalled.is_empty() {
        return None;
    }
    record.timed_out = true;
    let payload = json!({
        "parallel_state_id": parallel_state,
        "timeout_seconds": timeout_seconds,
        "stalled_regions": stalled,
    });
    let mut fail = payload.clone();
    fail["error"] = json!(format!("parallel state did not complete within {timeout_seconds} s"));
    fail["exception"] = json!("RegionTimeout");
    let step = Macrostep::start(
        def,
        configuration,
        context.clone(),
        Event::fail_state(parallel_state, fail),
        limits,
    );
    Some((HistoryEntry::new(PARALLEL_REGION_TIMEOUT, payload), Box::new(step)))
}

/// The parallel states whose region failures no `@fail` answers, in document order: a
/// parallel state the runtime dispatches when it is entered by default (no `@always` on
/// it or an ancestor, and at least two regions whose default entry, the region and its
/// initial states down, has an entry action and neither `@always` nor a final state, as
/// the macrostep's dispatch rule asks) with no `@fail` branch on it or on an ancestor.
/// A state dispatched only when a transition enters it below its initial states is not
/// listed: the warning stays for what certainly happens. A region task of one that runs
/// out of tries raises `fail.state.<path>`, which nothing handles, so the instance stays
/// in the parallel state with no sign of it but the `PARALLEL_FAIL` entry. A runtime with dispatch on warns of
/// each once; the fix is a `@fail` on the state (`.on_fail(…)`, JSON `"@fail"`).
pub fn unhandled_region_failures(def: &Definition) -> Vec<&str> {
    // A region entered by default enters what the macrostep would enter with it.
    let dispatches = |region: usize| {
        let mut entered = BTreeSet::new();
        add_descendants(def, region, &mut entered);
        region_dispatches(def, &entered.into_iter().collect::<Vec<_>>())
    };
    let answered = |p: usize| {
        std::iter::successors(Some(p), |&x| def.parent(x))
            .any(|a| !def.states[a].on_fail.is_empty())
    };
    def.states
        .iter()
        .enumerate()
        .filter(|(_, node)| node.kind == StateKind::Parallel)
        .filter(|&(p, _)| !eventless_at_or_above(def, p))
        .filter(|(_, node)| node.children.iter().filter(|&&r| dispatches(r)).count() >= 2)
        .filter(|&(p, _)| !answered(p))
        .map(|(_, node)| node.path.as_str())
        .collect()
}

fn region_final(def: &Definition, configuration: &Configuration, s: usize) -> bool {
    let node = &def.states[s];
    match node.kind {
        StateKind::Compound => node
            .children
            .iter()
            .any(|&c| def.kind(c) == StateKind::Final && configuration.contains(def.path(c))),
        StateKind::Parallel => node.children.iter().all(|&c| region_final(def, configuration, c)),
        StateKind::Final => configuration.contains(&node.path),
        StateKind::Atomic => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::{ActionResult, MacrostepResult, run_to_completion};

    fn def(second_entry: bool) -> Definition {
        Definition::builder("p", 1)
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p").on_to("DEEP", "p.b.y"))
            .parallel("p", |p| {
                p.entry("p_entry")
                    .state("a", |r| {
                        r.initial("x")
                            .state("x", |s| s.entry("ax").on_to("A", "fin"))
                            .final_state("fin")
                    })
                    .state("b", |r| {
                        r.entry("b_entry")
                            .initial("x")
                            .state("x", |s| {
                                let s = s.on_to("B", "y");
                                if second_entry { s.entry("bx") } else { s }
                            })
                            .state("y", |s| s.on_to("B", "fin"))
                            .final_state("fin")
                    })
                    .on_done(|b| b.target("idle"))
            })
            .build()
            .unwrap()
    }

    fn go(def: &Definition, event: &str) -> MacrostepResult {
        let config = Configuration::from_paths(["idle"]);
        let step = Macrostep::start(def, &config, json!({}), Event::new(event), Limits::default())
            .dispatch_regions(true);
        run_to_completion(step, |_, _| Ok(ActionResult::empty()))
    }

    #[test]
    fn regions_with_entry_actions_are_reported_not_run() {
        let d = def(true);
        let result = go(&d, "GO");
        assert_eq!(result.actions(), ["p_entry"], "the parallel state's own entry still runs");
        let regions: Vec<(&str, &[String])> = result
            .regions_to_dispatch
            .iter()
            .map(|r| (r.region.as_str(), r.entered.as_slice()))
            .collect();
        assert_eq!(
            regions,
            [
                ("p.a", &["p.a".to_owned(), "p.a.x".to_owned()][..]),
                ("p.b", &["p.b".to_owned(), "p.b.x".to_owned()][..])
            ]
        );
        let names: Vec<String> =
            result.regions_to_dispatch[1].actions(&d).into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["b_entry", "bx"], "entry order, region first");
        assert!(result.configuration.contains("p.b.x"), "the states are entered");
    }

    #[test]
    fn entering_a_region_below_its_initial_state_dispatches_what_was_entered() {
        let result = go(&def(false), "DEEP");
        let b = result.regions_to_dispatch.iter().find(|r| r.region == "p.b").unwrap();
        assert_eq!(b.entered, ["p.b", "p.b.y"]);
    }

    #[test]
    fn without_dispatch_or_with_one_region_of_work_everything_runs_inline() {
        let d = def(true);
        let config = Configuration::from_paths(["idle"]);
        let step = Macrostep::start(&d, &config, json!({}), Event::new("GO"), Limits::default());
        let result = run_to_completion(step, |_, _| Ok(ActionResult::empty()));
        assert_eq!(result.actions(), ["p_entry", "ax", "b_entry", "bx"]);
        assert!(result.regions_to_dispatch.is_empty());

        let one = Definition::builder("one", 1)
            .initial("p")
            .parallel("p", |p| {
                p.state("a", |r| r.initial("x").state("x", |s| s.entry("ax")))
                    .state("b", |r| r.initial("y").leaf("y"))
            })
            .build()
            .unwrap();
        let step = Macrostep::init(&one, json!({}), Limits::default()).dispatch_regions(true);
        let result = run_to_completion(step, |_, _| Ok(ActionResult::empty()));
        assert_eq!(result.actions(), ["ax"]);
        assert!(result.regions_to_dispatch.is_empty());
    }

    /// Runs the initial entry of `def` in dispatch mode: the actions run inline and the
    /// regions planned for dispatch, as `(region, entry actions)`.
    fn init_dispatching(def: &Definition) -> (Vec<String>, Vec<(String, Vec<String>)>) {
        let step = Macrostep::init(def, json!({}), Limits::default()).dispatch_regions(true);
        let result = run_to_completion(step, |_, _| Ok(ActionResult::empty()));
        let regions = result
            .regions_to_dispatch
            .iter()
            .map(|r| (r.region.clone(), r.actions(def).into_iter().map(|a| a.name).collect()))
            .collect();
        (result.actions().iter().map(ToString::to_string).collect(), regions)
    }

    #[test]
    fn a_nested_parallel_state_is_its_outer_regions_work_and_runs_each_entry_once() {
        let d = Definition::builder("nested", 1)
            .initial("p")
            .parallel("p", |p| {
                p.state("r1", |r| {
                    r.initial("q").parallel("q", |q| {
                        q.state("q1", |r| r.initial("x").state("x", |s| s.entry("A")))
                            .state("q2", |r| r.initial("y").state("y", |s| s.entry("B")))
                    })
                })
                .state("r2", |r| r.initial("z").state("z", |s| s.entry("C")))
            })
            .build()
            .unwrap();
        let (inline, regions) = init_dispatching(&d);
        assert!(inline.is_empty(), "{inline:?}");
        assert_eq!(
            regions,
            [
                ("p.r1".to_owned(), vec!["A".to_owned(), "B".to_owned()]),
                ("p.r2".to_owned(), vec!["C".to_owned()])
            ],
            "one task per outer region; A and B once each"
        );
    }

    #[test]
    fn a_region_that_may_move_on_without_an_event_runs_its_entry_inline() {
        let region_moves = Definition::builder("moves", 1)
            .initial("p")
            .parallel("p", |p| {
                p.state("r1", |r| {
                    r.initial("a")
                        .state("a", |s| s.entry("load").always(|b| b.target("b")))
                        .leaf("b")
                })
                .state("r2", |r| r.initial("c").state("c", |s| s.entry("fetch")))
                .state("r3", |r| r.initial("e").state("e", |s| s.entry("warm")))
            })
            .build()
            .unwrap();
        let (inline, regions) = init_dispatching(&region_moves);
        assert_eq!(inline, ["load"], "r1 leaves `a` at once: its entry runs in the step");
        let names: Vec<&str> = regions.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(names, ["p.r2", "p.r3"]);

        let whole_moves = Definition::builder("leaves", 1)
            .guard("done_loading", |ctx, _| ctx.get_as::<bool>("loaded") == Some(true))
            .initial("p")
            .parallel("p", |p| {
                p.always(|b| b.guard("done_loading").target("out"))
                    .state("r1", |r| r.initial("a").state("a", |s| s.entry("load")))
                    .state("r2", |r| r.initial("c").state("c", |s| s.entry("fetch")))
            })
            .leaf("out")
            .build()
            .unwrap();
        let (inline, regions) = init_dispatching(&whole_moves);
        assert_eq!(inline, ["load", "fetch"], "`p` may be left at once: nothing dispatched");
        assert!(regions.is_empty());
    }

    /// Runs `GO` from `idle` in dispatch mode; the `mark` action sets `looped`.
    fn go_marking(def: &Definition) -> MacrostepResult {
        let config = Configuration::from_paths(["idle"]);
        let step = Macrostep::start(def, &config, json!({}), Event::new("GO"), Limits::default())
            .dispatch_regions(true);
        run_to_completion(step, |request, _| {
            Ok(if request.name == "mark" {
                ActionResult::empty().set("looped", true)
            } else {
                ActionResult::empty()
            })
        })
    }

    fn dispatched(def: &Definition, result: &MacrostepResult) -> Vec<(String, Vec<String>)> {
        result
            .regions_to_dispatch
            .iter()
            .map(|r| (r.region.clone(), r.actions(def).into_iter().map(|a| a.name).collect()))
            .collect()
    }

    /// A parallel state exited and entered again within one macrostep dispatches its
    /// regions once, for the visit that stays.
    #[test]
    fn a_parallel_state_re_entered_in_one_macrostep_dispatches_its_regions_once() {
        let d = Definition::builder("again", 1)
            .guard("first", |ctx, _| ctx.get_as::<bool>("looped") != Some(true))
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p"))
            .parallel("p", |p| {
                p.entry("@raise:AGAIN")
                    .on("AGAIN", |b| b.guard("first").action("mark").target("p"))
                    .state("a", |r| r.initial("x").state("x", |s| s.entry("ax")))
                    .state("b", |r| r.initial("y").state("y", |s| s.entry("by")))
            })
            .build()
            .unwrap();
        let result = go_marking(&d);
        assert_eq!(result.actions(), ["mark"]);
        assert_eq!(
            dispatched(&d, &result),
            [("p.a".to_owned(), vec!["ax".to_owned()]), ("p.b".to_owned(), vec!["by".to_owned()])],
            "one task per region, each entry action once"
        );
        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({}));
        assert_eq!(tasks.len(), 2);
        assert!(tasks.iter().all(|t| t.key.dispatch == 1));
        assert_eq!(book.active["p"].regions.len(), 2);
        assert!(tasks.iter().all(|t| check(&result.configuration, &book, &t.key).is_ok()));
    }

    /// A region whose entered state is exited and entered again in the same macrostep ran
    /// that entry inline the second time: its task is not sent as well.
    #[test]
    fn a_region_re_entered_in_one_macrostep_is_not_dispatched_as_well() {
        let d = Definition::builder("region_again", 1)
            .guard("first", |ctx, _| ctx.get_as::<bool>("looped") != Some(true))
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p"))
            .parallel("p", |p| {
                p.entry("@raise:AGAIN")
                    .state("a", |r| {
                        r.initial("x").state("x", |s| {
                            s.entry("ax")
                                .on("AGAIN", |b| b.guard("first").action("mark").target("x"))
                        })
                    })
                    .state("b", |r| r.initial("y").state("y", |s| s.entry("by")))
                    .state("c", |r| r.initial("z").state("z", |s| s.entry("cz")))
            })
            .build()
            .unwrap();
        let result = go_marking(&d);
        assert_eq!(result.actions(), ["mark", "ax"], "the second entry of `x` ran inline");
        let regions: Vec<String> = dispatched(&d, &result).into_iter().map(|(r, _)| r).collect();
        assert_eq!(regions, ["p.b", "p.c"]);
    }

    /// A region state that stays while its child is exited and entered again in the same
    /// macrostep keeps its dispatched entry action: it runs once, in the region's task,
    /// and the child's second entry runs inline. So does one whose child moves on.
    #[test]
    fn a_region_state_that_stays_keeps_its_dispatched_entry() {
        for (case, again) in [("re-entered", "x"), ("moved on", "w")] {
            let d = Definition::builder("region_stays", 1)
                .guard("first", |ctx, _| ctx.get_as::<bool>("looped") != Some(true))
                .initial("idle")
                .state("idle", |s| s.on_to("GO", "p"))
                .parallel("p", |p| {
                    p.entry("@raise:AGAIN")
                        .state("a", |r| {
                            r.entry("reserve")
                                .initial("x")
                                .state("x", |s| {
                                    s.entry("ax").on("AGAIN", |b| {
                                        b.guard("first").action("mark").target(again)
                                    })
                                })
                                .state("w", |s| s.entry("aw"))
                        })
                        .state("b", |r| r.initial("y").state("y", |s| s.entry("by")))
                })
                .build()
                .unwrap();
            let result = go_marking(&d);
            let inline = if again == "x" { "ax" } else { "aw" };
            assert_eq!(result.actions(), ["mark", inline], "{case}");
            assert_eq!(
                dispatched(&d, &result),
                [
                    ("p.a".to_owned(), vec!["reserve".to_owned()]),
                    ("p.b".to_owned(), vec!["by".to_owned()])
                ],
                "{case}: `reserve` runs once, in the region's task"
            );
        }
    }

    /// A failure inside a region goes to the innermost `@fail` on the failing state's own
    /// ancestor chain: a targetless handler on the failing state keeps the parallel
    /// state's `@fail` (reached by a sibling region's leaf before) from also running.
    #[test]
    fn a_regions_own_fail_handler_wins_over_the_parallel_states() {
        let d = Definition::builder("fails", 1)
            .initial("p")
            .parallel("p", |p| {
                p.state("r1", |r| {
                    r.initial("d").state("d", |s| s.machine("pay").on_fail(|b| b.action("log")))
                })
                .state("r2", |r| r.initial("z").leaf("z"))
                .on_fail(|b| b.target("failed"))
            })
            .leaf("failed")
            .build()
            .unwrap();
        let config = Configuration::from_paths(["p", "p.r1", "p.r1.d", "p.r2", "p.r2.z"]);
        let run = |event| {
            let step = Macrostep::start(&d, &config, json!({}), event, Limits::default());
            run_to_completion(step, |_, _| Ok(ActionResult::empty()))
        };
        let own = run(Event::fail_state("p.r1.d", json!({ "error": "declined" })));
        assert_eq!(own.actions(), ["log"]);
        assert!(own.configuration.contains("p.r2.z"), "the parallel state's @fail did not run");
        // A failure the region does not handle still reaches the parallel state.
        let whole = run(Event::fail_state("p.r2.z", json!({ "error": "lost" })));
        assert!(whole.configuration.contains("failed"));
    }

    #[test]
    fn the_book_round_trips_through_the_context_and_numbers_each_dispatch() {
        let d = def(true);
        let result = go(&d, "GO");
        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({"k": 1}));
        assert_eq!(tasks.len(), 2);
        assert!(tasks.iter().all(|t| t.key.dispatch == 1 && t.snapshot == json!({"k": 1})));
        let mut context = json!({"k": 1});
        book.put(&mut context);
        assert!(context.get(BOOK_KEY).is_some());
        assert_eq!(ParallelBook::take(&mut context), book);
        assert_eq!(context, json!({"k": 1}));
        let again = book.dispatch(&result.regions_to_dispatch, &json!({}));
        assert_eq!(again[0].key.dispatch, 2, "a new visit gets a new number");
        assert_eq!(
            check(&result.configuration, &book, &tasks[0].key),
            Err(Skip::MachineLeftParallelState)
        );
        assert_eq!(check(&result.configuration, &book, &again[0].key), Ok(()));
        assert_eq!(book.prune(&Configuration::from_paths(["idle"]), &[]), ["p"]);
        assert_eq!(ParallelBook::take(&mut json!({})), ParallelBook::default());
    }

    #[test]
    fn a_report_is_merged_then_its_raised_events_are_processed() {
        let d = def(true);
        let result = go(&d, "GO");
        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({"n": 0}));
        let mut run = RegionRun::new(&d, &tasks[0]);
        while run.poll().is_some() {
            run.handle_action_result(Ok(ActionResult::empty().set("a", 1).raise("A"))).unwrap();
        }
        let report = run.report();
        let plan = apply_report(
            &d,
            &result.configuration,
            &json!({"n": 5}),
            &mut book,
            &report,
            Limits::default(),
        );
        let ReportPlan::Run { records, step, followup } = plan else { panic!("runs") };
        assert!(records.is_empty(), "no conflict: `a` was untouched since dispatch");
        let after = run_to_completion(*step, |_, _| Ok(ActionResult::empty()));
        assert_eq!(after.context, json!({"n": 5, "a": 1}));
        assert!(after.configuration.contains("p.a.fin"));
        let recorded = finish_report(&followup, &after.configuration);
        assert_eq!(recorded.len(), 1, "entered, not stalled: {recorded:?}");
        assert_eq!(recorded[0].kind, PARALLEL_REGION_ENTER);
        let replay = apply_report(
            &d,
            &after.configuration,
            &after.context,
            &mut book,
            &report,
            Limits::default(),
        );
        assert!(matches!(replay, ReportPlan::Noop));
    }

    #[test]
    fn a_region_task_raises_built_in_raise_actions_itself() {
        let d = Definition::builder("raising", 1)
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p"))
            .parallel("p", |p| {
                p.state("a", |r| r.entry("@raise:A_READY").entry("ax").initial("x").leaf("x"))
                    .state("b", |r| r.entry("bx").initial("x").leaf("x"))
            })
            .build()
            .unwrap();
        let result = go(&d, "GO");
        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({}));
        let mut run = RegionRun::new(&d, &tasks[0]);
        let mut asked = Vec::new();
        while let Some(request) = run.poll() {
            asked.push(request.name.clone());
            run.handle_action_result(Ok(ActionResult::empty().raise("AFTER"))).unwrap();
        }
        assert_eq!(asked, ["ax"], "the runtime is never asked for a built-in action");
        let RegionReport::Completed { raised, .. } = run.report() else {
            panic!("the run completed");
        };
        let names: Vec<&str> = raised.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["A_READY", "AFTER"], "raised in action order");
    }

    /// The report of a region task that used up its three tries on `boom`.
    fn failed(key: RegionKey) -> RegionReport {
        RegionReport::Failed {
            key,
            error: "boom".into(),
            exception: "ActionError".into(),
            attempts: 3,
        }
    }

    /// A region task that runs out of tries after its region moved on (an event advanced
    /// it during the last try) is discarded like a late success: no `@fail` for work
    /// nobody wants, a guard abort on record, and the dispatch can still fail for real.
    #[test]
    fn a_failure_of_a_region_that_moved_on_is_discarded_not_failed() {
        let d = def(true);
        let result = go(&d, "GO");
        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({}));
        let key = |region: &str| tasks.iter().find(|t| t.key.region == region).unwrap().key.clone();
        let step = Macrostep::start(
            &d,
            &result.configuration,
            json!({}),
            Event::new("B"),
            Limits::default(),
        );
        let moved = run_to_completion(step, |_, _| Ok(ActionResult::empty()));
        assert!(moved.configuration.contains("p.b.y"), "the event advanced region b");

        let late = failed(key("p.b"));
        let apply = |book: &mut ParallelBook, report: &RegionReport| {
            apply_report(&d, &moved.configuration, &moved.context, book, report, Limits::default())
        };
        let ReportPlan::Abort(entry) = apply(&mut book, &late) else {
            panic!("the failure is discarded, no `fail.state.p` raised");
        };
        assert_eq!(entry.kind, PARALLEL_REGION_GUARD_ABORT);
        assert_eq!(
            entry.data,
            json!({
                "region_id": "p.b",
                "reason": "region_already_advanced",
                "discarded_context": [],
                "discarded_events": 0,
                "work_was_discarded": false,
                "error": "boom",
            })
        );
        assert!(!book.active["p"].failed, "the dispatch did not fail");

        // The sibling, still where it was dispatched, fails the parallel state.
        let ReportPlan::Run { records, step, .. } = apply(&mut book, &failed(key("p.a"))) else {
            panic!("a failure of a region still at its entered states fails the dispatch");
        };
        assert_eq!(records[0].kind, PARALLEL_FAIL);
        let after = run_to_completion(*step, |_, _| Ok(ActionResult::empty()));
        assert!(after.unhandled, "`fail.state.p` was raised (nothing answers it here)");
        assert!(book.active["p"].failed);
        assert!(matches!(apply(&mut book, &late), ReportPlan::Noop), "handled once");
    }

    /// A chart whose parallel state `p` answers a failure without leaving (`@fail` is
    /// targetless), so the dispatch's record stays after its `@fail`.
    fn staying_on_failure() -> Definition {
        Definition::builder("stays", 1)
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p"))
            .parallel("p", |p| {
                p.state("a", |r| {
                    r.initial("x")
                        .state("x", |s| s.entry("ax").on_to("A", "fin"))
                        .final_state("fin")
                })
                .state("b", |r| {
                    r.initial("y")
                        .state("y", |s| s.entry("by").on_to("B", "fin"))
                        .final_state("fin")
                })
                .on_fail(|b| b.action("note_failure"))
            })
            .build()
            .unwrap()
    }

    /// One failure, one `@fail` per dispatch: the region timeout after a region failed,
    /// and a region failure after the region timeout fired, raise nothing new.
    #[test]
    fn a_dispatch_fails_once_whether_a_region_or_the_timeout_fails_it_first() {
        let d = staying_on_failure();
        let result = go(&d, "GO");
        let config = &result.configuration;
        let due = |book: &mut ParallelBook| {
            timeout(&d, config, &json!({}), book, "p", 60, Limits::default()).is_some()
        };

        let apply = |book: &mut ParallelBook, report: &RegionReport| {
            apply_report(&d, config, &json!({}), book, report, Limits::default())
        };

        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({}));
        let plan = apply(&mut book, &failed(tasks[0].key.clone()));
        let ReportPlan::Run { step, .. } = plan else { panic!("the failure fires @fail") };
        let after = run_to_completion(*step, |_, _| Ok(ActionResult::empty()));
        assert_eq!(after.actions(), ["note_failure"]);
        assert!(after.configuration.contains("p.a.x"), "the targetless @fail stays in `p`");
        assert!(!due(&mut book), "the timeout after the failure is a no-op");

        let mut book = ParallelBook::default();
        let tasks = book.dispatch(&result.regions_to_dispatch, &json!({}));
        assert!(due(&mut book), "the timeout fires @fail");
        let plan = apply(&mut book, &failed(tasks[1].key.clone()));
        assert!(matches!(plan, ReportPlan::Noop), "the failure after the timeout is a no-op");
    }

    #[test]
    fn parallel_states_no_fail_answers_are_listed() {
        let d = Definition::builder("hangs", 1)
            .initial("idle")
            .state("idle", |s| s.on_to("GO", "p").on_to("Q", "q").on_to("W", "outer"))
            // Dispatchable, no @fail anywhere above: listed.
            .parallel("p", |p| {
                p.state("a", |r| r.initial("x").state("x", |s| s.entry("ax")))
                    .state("b", |r| r.entry("b").initial("y").leaf("y"))
            })
            // One region with entry work: never dispatched.
            .parallel("q", |p| {
                p.state("a", |r| r.initial("x").state("x", |s| s.entry("ax")))
                    .state("b", |r| r.initial("y").leaf("y"))
            })
            // An ancestor's @fail answers the inner parallel state's failures.
            .state("outer", |s| {
                s.initial("inner")
                    .parallel("inner", |p| {
                        p.state("a", |r| r.initial("x").state("x", |s| s.entry("ax")))
                            .state("b", |r| r.initial("y").state("y", |s| s.entry("by")))
                    })
                    .on_fail(|b| b.target("idle"))
            })
            .build()
            .unwrap();
        assert_eq!(unhandled_region_failures(&d), ["p"]);
        assert!(unhandled_region_failures(&staying_on_failure()).is_empty(), "its own @fail");

        // Entry work reached only by an event, or in a region that moves on by itself (an
        // `@always`, a final initial state): the macrostep that enters `p` keeps it inline.
        let later = Definition::builder("later", 1)
            .initial("p")
            .parallel("p", |p| {
                p.state("a", |r| {
                    r.initial("idle")
                        .state("idle", |s| s.on_to("X", "work"))
                        .state("work", |s| s.entry("aw"))
                })
                .state("b", |r| r.initial("y").state("y", |s| s.entry("by")))
                .state("c", |r| {
                    r.initial("go")
                        .state("go", |s| s.entry("cg").always(|b| b.target("rest")))
                        .leaf("rest")
                })
            })
            .build()
            .unwrap();
        assert!(unhandled_region_failures(&later).is_empty(), "one region dispatches at most");
        assert_eq!(unhandled_region_failures(&def(true)), ["p"]);
    }
}
