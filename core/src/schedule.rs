//! Schedules: a cron pattern read in a time zone that, at each of its ticks, starts an
//! instance or broadcasts an event to the instances of a machine in a state.
//!
//! The rules live here as plain functions of `now` and what a runner remembers, so every
//! worker decides the same thing:
//!
//! - **Which tick is due** ([`Schedule::poll`]): the latest tick at or before `now` that
//!   this runner has not yet passed. Ticks that fell due while the runner was alive but
//!   busy collapse into that one tick: a schedule never fires a burst.
//! - **Missed ticks** (the runner just started, so it cannot know what happened while no
//!   worker ran): [`MissedTicks::Skip`] fires nothing until the next tick;
//!   [`MissedTicks::CatchUp`] fires the latest past tick once.
//! - **Exactly once across workers**: every runner that sees a tick fires it under the same
//!   key ([`Schedule::tick_key`]): the uniqueness key of the started instance (occupied in
//!   every status, so a finished run still holds it) or the dedup key of the broadcast
//!   event. The store's uniqueness rule makes the second firing a no-op while that key is
//!   held. The key names the schedule's namespace as well as its name: uniqueness keys are
//!   global in a store, and services sharing one, each in its own namespace, may name
//!   their schedules alike.
//! - **Exactly once across restarts and clock steps**: those keys do not last (a read
//!   event frees its dedup key, a pruned instance its uniqueness key), so after a tick
//!   fires the runner records it in the schedule's stored state ([`plan_fired`]:
//!   `fired_through` only moves forward), and [`Schedule::poll`] never fires a tick at or
//!   before the recorded one, nor one at or before what the runner already passed (which
//!   does not move back when the clock does).
//! - **Paused** schedules pass over their ticks; resuming fires nothing for the ticks
//!   passed while paused. A pause stored for the fleet ([`plan_pause`]) wins over the
//!   definition's `paused` and one worker's handle once set ([`Pause::resolve`]); after
//!   a stored resume only ticks strictly after the resume time fire, so a worker that did
//!   not poll while the schedule was paused still fires nothing that fell due in the pause.
//!   A resume that ends a stored pause also re-anchors a recorded fired tick that lies
//!   ahead of the resume time (a clock that ran ahead recorded it): the schedule fires
//!   from its next tick after the resume, not only once the clock passes the recorded
//!   tick. A repeated resume of a running schedule changes nothing, so a caller whose
//!   clock runs behind cannot move the record below a tick that really fired.
//! - **What fires next** ([`Schedule::next_fire`]): the first tick after `now`, the resume
//!   time and the recorded fired tick, the same bound [`Schedule::poll`] applies, so a
//!   listing never shows a time that will not fire.
//! - **Leftover states** ([`plan_forget`]): a stored state whose schedule is no longer
//!   defined still counts toward its namespace's bound until it is forgotten; one used
//!   within [`FORGET_QUIET_MS`] is still served by some worker ([`recently_used`]).

use crate::config::ConfigError;
use crate::error::{StoreError, StoreResult};
use crate::ids::{DEFAULT_NAMESPACE, MachineRef, StatusSet};
use crate::instance::NewInstance;
use crate::limits;
use crate::ports::store::{ScheduleFiredParams, SchedulePauseParams, ScheduleState};
use crate::time::Timestamp;
use croner::Cron;
use jiff::tz::TimeZone;
use serde::Deserialize;
use serde_json::Value;
use std::fmt;

/// Most schedules one runner serves; each poll looks at each of them once.
pub const SCHEDULES_MAX: usize = 1_000;

/// Longest schedule name, in bytes (the name is part of every tick key).
pub const SCHEDULE_NAME_MAX: usize = 100;

/// The widest tick a key is written for (the most digits a time in milliseconds takes):
/// [`Schedule::new`] checks that a key of this tick fits a uniqueness key.
const WIDEST_TICK: Timestamp = Timestamp(i64::MIN);

/// Where [`Schedule::new`] looks for a pattern's first match (2000-01-01T00:00:00Z): any
/// fixed time works, as a pattern without a year field repeats with the calendar.
const NEVER_CHECK_FROM: Timestamp = Timestamp(946_684_800_000);

/// Most stored schedule states (fleet-wide pauses and resumes) one namespace holds: one
/// per schedule a runner can serve. Every read of the states is bounded by it.
pub const SCHEDULE_STATES_MAX: usize = SCHEDULES_MAX;

/// How far ahead of a clock a recorded fired tick may lie before it counts as recorded by
/// a clock that ran ahead, in milliseconds: within it, the gap is ordinary skew between
/// hosts (a worker a little ahead recorded a tick this clock has not reached yet), and a
/// resume must keep it, or that tick could fire a second time.
pub const FIRED_AHEAD_SLACK_MS: i64 = 5_000;

/// The recorded fired tick when it lies more than [`FIRED_AHEAD_SLACK_MS`] ahead of
/// `now`: no worker fires the schedule's ticks up to it until the clock passes it, so a
/// runner warns and a listing says so; a resume re-anchors it ([`plan_pause`]).
pub fn fired_ahead(fired_through: Option<Timestamp>, now: Timestamp) -> Option<Timestamp> {
    fired_through.filter(|t| t.as_millis().saturating_sub(now.as_millis()) > FIRED_AHEAD_SLACK_MS)
}

/// A schedule's pause state as a runner applies it at one poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pause {
    /// Whether ticks are passed over.
    pub paused: bool,
    /// When a stored pause or resume last changed the state; `None` while only the
    /// definition and one worker's handle decide. While resumed, only ticks strictly
    /// after this time fire.
    pub since: Option<Timestamp>,
}

impl Pause {
    /// Not paused, with nothing stored.
    pub const RUNNING: Pause = Pause { paused: false, since: None };

    /// The state a runner applies: the stored state once a pause or resume was stored
    /// (a fleet-wide pause or resume wins over the definition and over one worker's
    /// handle), else `local` (the definition's `paused`, as the worker's handle changed
    /// it). A stored row that only records fired ticks leaves the pause to `local`.
    pub fn resolve(local: bool, stored: Option<&ScheduleState>) -> Pause {
        match stored.and_then(|s| s.changed_at.map(|at| (s.paused, at))) {
            Some((paused, at)) => Pause { paused, since: Some(at) },
            None => Pause { paused: local, since: None },
        }
    }
}

/// The one rule of storing a pause or resume. `current` is the schedule's stored state
/// (if any) and `held` how many states its namespace holds. Returns the state to write,
/// or `None` when a stored pause or resume already put the schedule in the asked state:
/// its time is kept, so a second resume does not move the bound of which ticks may fire,
/// and a second pause does not hide when the first began.
///
/// The recorded fired tick is kept as it is, except on a resume that ends a stored pause
/// when it lies ahead of the resume time ([`fired_ahead`]): then it is re-anchored at the
/// resume time, so the schedule fires from its next tick after the resume rather than
/// staying silent until the clock passes a tick that a clock running ahead recorded. No
/// tick at or before the resume time fires either way (the resume time bounds them); the
/// ticks between the resume time and the old record may fire a second time, which the
/// report of the resume says ([`re_anchored`]).
///
/// The resume time is the caller's clock. A resume of a schedule that is not stored as
/// paused (a repeat, or a row that only records ticks) never re-anchors: workers record
/// ticks while it runs, and a caller whose clock runs behind theirs would otherwise move
/// the record below a tick that really fired, which a catch-up restart then fires again.
/// To re-anchor a running schedule, pause it, then resume it.
///
/// # Errors
///
/// `Invalid` for bad names, or for a schedule without a state in a namespace that
/// already holds [`SCHEDULE_STATES_MAX`].
pub fn plan_pause(
    current: Option<&ScheduleState>,
    held: usize,
    p: &SchedulePauseParams,
) -> StoreResult<Option<ScheduleState>> {
    p.validate()?;
    let recorded = current.and_then(|c| c.fired_through);
    let stored_paused = current.is_some_and(|c| c.changed_at.is_some() && c.paused);
    let fired_through = match fired_ahead(recorded, p.now) {
        Some(_) if stored_paused && !p.paused => Some(p.now),
        _ => recorded,
    };
    match current {
        Some(c) if c.changed_at.is_some() && c.paused == p.paused => Ok(None),
        None if held >= SCHEDULE_STATES_MAX => Err(full(&p.namespace, "pausing or resuming")),
        _ => Ok(Some(ScheduleState {
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            paused: p.paused,
            changed_at: Some(p.now),
            fired_through,
        })),
    }
}

/// The recorded fired tick a resume moved back, as `(from, to)`: `before` is the state
/// read before the resume and `after` the one it stored. Only a resume's re-anchor
/// ([`plan_pause`]) moves `fired_through` back (a recorded tick only moves forward), so
/// a lower `after` is that move; `from` is the tick as `before` read it.
pub fn re_anchored(
    before: Option<&ScheduleState>,
    after: &ScheduleState,
) -> Option<(Timestamp, Timestamp)> {
    let from = before?.fired_through?;
    let to = after.fired_through?;
    (to < from).then_some((from, to))
}

/// How long after a stored state was last used (a recorded tick, a pause or resume) it
/// counts as still served by some worker, in milliseconds: a day. A worker records each
/// tick it fires, so a schedule that fires at least daily and is still served keeps its
/// `fired_through` within this window; forgetting such a state would drop what that
/// worker relies on.
pub const FORGET_QUIET_MS: i64 = 24 * 60 * 60 * 1_000;

/// Which field of `state` shows it was used within [`FORGET_QUIET_MS`] before `now` (or
/// lies ahead of `now`), and its time: `fired_through` first, then `changed_at`. `None`
/// when both are older or unset, so forgetting it drops nothing a worker used lately.
pub fn recently_used(state: &ScheduleState, now: Timestamp) -> Option<(&'static str, Timestamp)> {
    let recent = |t: Timestamp| now.as_millis().saturating_sub(t.as_millis()) < FORGET_QUIET_MS;
    let fields = [("fired_through", state.fired_through), ("changed_at", state.changed_at)];
    fields.into_iter().find_map(|(field, at)| at.filter(|t| recent(*t)).map(|t| (field, t)))
}

/// The stored states in `namespace` that no schedule of `defined` has: states left over
/// by schedules that were removed or renamed. They still count toward the namespace's
/// [`SCHEDULE_STATES_MAX`] until forgotten (`Store::schedule_forget`); nothing forgets
/// them on its own, since workers may serve different schedules in one namespace (and,
/// during a rolling deploy, old workers still serve an old name), and forgetting a state
/// another worker still uses would drop its pause and its recorded tick. Names in order,
/// at most [`SCHEDULE_STATES_MAX`].
pub fn plan_forget(namespace: &str, stored: &[ScheduleState], defined: &[Schedule]) -> Vec<String> {
    let live: std::collections::BTreeSet<&str> =
        defined.iter().filter(|s| s.namespace() == namespace).map(Schedule::name).collect();
    let mut leftover: Vec<String> = stored
        .iter()
        .filter(|s| s.namespace == namespace && !live.contains(s.name.as_str()))
        .map(|s| s.name.clone())
        .collect();
    leftover.sort();
    leftover.dedup();
    leftover.truncate(SCHEDULE_STATES_MAX);
    leftover
}

/// The one rule of recording a fired tick. `current` is the schedule's stored state (if
/// any) and `held` how many states its namespace holds. Returns the state to write (its
/// `fired_through` the later of the stored tick and `p.tick`), or `None` when a tick at or
/// after `p.tick` is already recorded: the record never moves back. A new row stores no
/// pause, so the definition and each worker's handle still decide that.
///
/// A runner records a tick right after its start or broadcast succeeded. A crash between
/// the two leaves the tick unrecorded, so a restart that catches up may fire that one tick
/// once more: a starting tick is still kept once by its instance's uniqueness key while
/// the instance exists; a broadcast may reach its targets a second time.
///
/// # Errors
///
/// `Invalid` for bad names, or for a schedule without a state in a namespace that
/// already holds [`SCHEDULE_STATES_MAX`].
pub fn plan_fired(
    current: Option<&ScheduleState>,
    held: usize,
    p: &ScheduleFiredParams,
) -> StoreResult<Option<ScheduleState>> {
    p.validate()?;
    match current {
        Some(c) if c.fired_through.is_some_and(|through| through >= p.tick) => Ok(None),
        Some(c) => Ok(Some(ScheduleState { fired_through: Some(p.tick), ..c.clone() })),
        None if held >= SCHEDULE_STATES_MAX => Err(full(&p.namespace, "recording a fired tick")),
        None => Ok(Some(ScheduleState {
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            paused: false,
            changed_at: None,
            fired_through: Some(p.tick),
        })),
    }
}

/// The refusal of one more stored state in a full namespace.
fn full(namespace: &str, what: &str) -> StoreError {
    StoreError::invalid(format!(
        "name: {what} needs a new stored schedule state, and namespace {namespace:?} already \
         holds {SCHEDULE_STATES_MAX}, the most a runner serves; states of schedules that no \
         longer exist are left over: delete their rows with `keel schedules forget --config \
         keel.toml` (it lists them first), or from the store's table of schedule states \
         (keel_schedule_states in SQLite, schedule_states in Keel's PostgreSQL schema)"
    ))
}

crate::names::name_enum! {
    /// What a runner that just started does about the ticks that fell while no worker ran.
    #[derive(Default)]
    pub enum MissedTicks {
        /// Fire nothing until the next tick.
        #[default]
        Skip = "skip",
        /// Fire the latest missed tick once (however many were missed).
        CatchUp = "catch_up",
    }
}

/// What a tick does.
#[derive(Debug, Clone, PartialEq)]
pub enum ScheduleAction {
    /// Start an instance like this one. Its uniqueness claim is replaced by the tick's
    /// key, held in every status.
    Start(NewInstance),
    /// Deliver an event to every instance of a machine (optionally only those in a state).
    Broadcast(BroadcastAction),
}

/// The event a broadcasting schedule delivers at each tick.
#[derive(Debug, Clone, PartialEq)]
pub struct BroadcastAction {
    /// Namespace of the targets.
    pub namespace: String,
    /// Machine name (any version).
    pub machine: String,
    /// Only instances in this state; `None` = every live instance of the machine.
    pub in_state: Option<String>,
    /// Event name.
    pub event: String,
    /// Event payload.
    pub payload: Value,
}

/// A schedule that cannot be used, naming the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schedule {name:?}: {field}: {reason}")]
pub struct ScheduleError {
    /// The schedule's name.
    pub name: String,
    /// The field at fault (`cron`, `time_zone`, `name`, …).
    pub field: &'static str,
    /// What is wrong and how to fix it.
    pub reason: String,
}

/// A cron pattern in a time zone, what it does at each tick, and its missed-tick policy.
///
/// ```
/// use keel_core::ids::MachineRef;
/// use keel_core::instance::NewInstance;
/// use keel_core::schedule::{Schedule, ScheduleAction};
/// use keel_core::Timestamp;
///
/// let report = NewInstance::new(MachineRef::new("report", 1), "@init");
/// let nightly = Schedule::new("nightly", "0 2 * * *", "Europe/Paris", ScheduleAction::Start(report))?;
/// // 2026-01-01T00:00:00Z is 01:00 in Paris: the next 02:00 there is 01:00 UTC.
/// let now = Timestamp::from_millis(1_767_225_600_000);
/// assert_eq!(nightly.next_after(now), Some(Timestamp::from_millis(1_767_229_200_000)));
/// # Ok::<(), keel_core::schedule::ScheduleError>(())
/// ```
#[derive(Clone)]
pub struct Schedule {
    name: String,
    pattern: String,
    cron: Cron,
    zone_name: String,
    zone: TimeZone,
    /// The pattern fires at fixed times of day: its ticks keep to the wall clock across
    /// daylight-saving changes (see [`Schedule::next_after`]).
    wall_clock: bool,
    action: ScheduleAction,
    missed: MissedTicks,
    paused: bool,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("name", &self.name)
            .field("cron", &self.pattern)
            .field("time_zone", &self.zone_name)
            .field("action", &self.action)
            .field("missed", &self.missed)
            .field("paused", &self.paused)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Schedule {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.pattern == other.pattern
            && self.zone_name == other.zone_name
            && self.action == other.action
            && self.missed == other.missed
            && self.paused == other.paused
    }
}

/// What one poll of a schedule decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickPlan {
    /// The tick to fire now, if any.
    pub fire: Option<Timestamp>,
    /// What the runner remembers as passed from now on: `now`, or what it had passed when
    /// that is later (a clock that stepped back does not un-pass a tick).
    pub passed: Timestamp,
    /// The schedule's next tick after `now` (when to poll again); `None` if it never fires
    /// again.
    pub next: Option<Timestamp>,
}

/// One schedule as listed for an operator.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScheduleInfo {
    /// Name.
    pub name: String,
    /// The cron pattern as written.
    pub cron: String,
    /// The time zone it is read in.
    pub time_zone: String,
    /// `start <machine> v<version>` or `broadcast <event> to <machine>[ in <state>]`.
    pub action: String,
    /// The missed-tick policy.
    pub missed: MissedTicks,
    /// The namespace its ticks act in (where its stored state lives).
    pub namespace: String,
    /// Whether it is paused.
    pub paused: bool,
    /// When a stored (fleet-wide) pause or resume last changed it; `None` when nothing is
    /// stored and the definition (or one worker's handle) decides.
    pub changed_at: Option<Timestamp>,
    /// The latest tick recorded as fired by any worker (`None` when none is recorded).
    pub fired_through: Option<Timestamp>,
    /// Whether `fired_through` lies ahead of the clock it was listed by ([`fired_ahead`]):
    /// nothing fires until the clock passes it, unless a resume re-anchors it.
    pub fired_ahead: bool,
    /// The next tick that will fire ([`Schedule::next_fire`]): `None` when paused or never
    /// again.
    pub next_fire: Option<Timestamp>,
}

impl Schedule {
    /// A schedule named `name` (unique among a deployment's schedules: it keys the ticks)
    /// firing at the times `cron` matches, read in the IANA time zone `time_zone`
    /// (`"UTC"`, `"Europe/Paris"`). Five fields (minute precision) or six (seconds first);
    /// no year field.
    ///
    /// # Errors
    ///
    /// A bad name, pattern or time zone, a pattern that never matches (such as 30
    /// February), or an action that would be refused at every tick.
    pub fn new(
        name: impl Into<String>,
        cron: &str,
        time_zone: &str,
        action: ScheduleAction,
    ) -> Result<Self, ScheduleError> {
        let name = name.into();
        let fail = |field, reason: String| ScheduleError { name: name.clone(), field, reason };
        if name.is_empty() || name.len() > SCHEDULE_NAME_MAX || name.chars().any(char::is_control) {
            return Err(fail(
                "name",
                format!(
                    "must be 1 to {SCHEDULE_NAME_MAX} bytes without control characters, e.g. \"nightly-report\""
                ),
            ));
        }
        // No year field: the pattern then repeats with the calendar, so one that matches
        // once matches for good, and one that never matches is seen at once (below).
        let parser = croner::parser::CronParser::builder().year(croner::parser::Year::Disallowed);
        let parsed = parser.build().parse(cron).map_err(|e| {
            fail(
                "cron",
                format!(
                    "{cron:?} is not a cron pattern ({e}); write five fields \"minute hour day month weekday\", e.g. \"*/5 * * * *\", or six with seconds first"
                ),
            )
        })?;
        let zone = TimeZone::get(time_zone).map_err(|_| {
            fail(
                "time_zone",
                format!(
                    "{time_zone:?} is not a known IANA time zone; write e.g. \"UTC\" or \"Europe/Paris\""
                ),
            )
        })?;
        check_action(&action).map_err(|reason| fail("action", reason))?;
        let schedule = Schedule {
            name: name.clone(),
            pattern: cron.to_owned(),
            cron: parsed,
            zone_name: time_zone.to_owned(),
            zone,
            wall_clock: names_its_hours(cron),
            action,
            missed: MissedTicks::Skip,
            paused: false,
        };
        // The calendar repeats every 400 years, so a pattern without a match after this
        // fixed time has none at all; it would never fire, and every poll would search
        // to the cron library's year limit for nothing.
        if schedule.next_after(NEVER_CHECK_FROM).is_none() {
            return Err(fail(
                "cron",
                format!(
                    "{cron:?} never matches: no date has the day of month and month it names \
                     (such as 30 February or 31 April); check the day-of-month and month \
                     fields, e.g. \"0 0 28 2 *\" or \"0 0 L 2 *\" for the last day of February"
                ),
            ));
        }
        // Refused once here, rather than by the store at every tick.
        let widest = schedule.tick_key(WIDEST_TICK).len();
        if widest > limits::NAME_BYTES_MAX {
            return Err(fail(
                "name",
                format!(
                    "in namespace {:?} its tick keys take up to {widest} bytes, and a key holds \
                     at most {}: shorten the schedule's name or the namespace",
                    schedule.namespace(),
                    limits::NAME_BYTES_MAX
                ),
            ));
        }
        Ok(schedule)
    }

    /// Sets the missed-tick policy (default [`MissedTicks::Skip`]).
    #[must_use]
    pub fn missed(mut self, missed: MissedTicks) -> Self {
        self.missed = missed;
        self
    }

    /// Starts the schedule paused (it can be resumed at run time).
    #[must_use]
    pub fn paused(mut self, paused: bool) -> Self {
        self.paused = paused;
        self
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What each tick does.
    pub fn action(&self) -> &ScheduleAction {
        &self.action
    }

    /// The namespace its ticks start instances in or broadcast to: where its stored pause
    /// state is kept.
    pub fn namespace(&self) -> &str {
        match &self.action {
            ScheduleAction::Start(new) => &new.namespace,
            ScheduleAction::Broadcast(b) => &b.namespace,
        }
    }

    /// Whether the schedule was defined as paused.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The missed-tick policy.
    pub fn missed_ticks(&self) -> MissedTicks {
        self.missed
    }

    /// The first tick strictly after `t`; `None` when the pattern never matches again
    /// within the search bound of the cron library (a few years).
    ///
    /// A pattern of fixed times of day (`"30 2 * * *"`, `"15,45 2 * * *"`, `"0 9-17 * * *"`:
    /// no `*` in its seconds, minute or hour field) keeps to the wall clock when the time
    /// zone changes to or from daylight-saving time, as cron does: the times it names in
    /// the hour the clocks skip fire once between them, at the change, and those in the
    /// hour the clocks repeat fire in its first pass only. A pattern with a `*` there
    /// (`"*/10 * * * *"`, `"*/20 2 * * *"`) follows real time: it fires in both passes of
    /// a repeated hour, and not at all in a skipped one.
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        let mut from = self.zoned(t)?;
        let mut inclusive = false;
        let mut next = None;
        // Each skip jumps past a whole repeated hour, and such hours are months apart.
        for _ in 0..REPEATED_SKIPS_MAX {
            let tick = self.search(&from, inclusive, true)?;
            let Some((_, end)) = self.repeated_pass(tick) else {
                next = Some(tick);
                break;
            };
            (from, inclusive) = (end.to_zoned(self.zone.clone()), true);
        }
        let next = next?;
        let after = jiff::Timestamp::from_millisecond(t.as_millis()).ok()?;
        let skipped = self
            .zone
            .following(after)
            .take_while(|change| change.timestamp() < next)
            .take(CHANGES_SEARCHED_MAX)
            .map(|change| change.timestamp())
            .find(|&change| self.names_a_skipped_time(change));
        Some(millis(skipped.unwrap_or(next)))
    }

    /// The latest tick at or before `t`: the same ticks as [`Schedule::next_after`] gives.
    pub fn latest_at_or_before(&self, t: Timestamp) -> Option<Timestamp> {
        let mut from = self.zoned(t)?;
        let mut latest = None;
        for _ in 0..REPEATED_SKIPS_MAX {
            let tick = self.search(&from, true, false)?;
            let Some((start, _)) = self.repeated_pass(tick) else {
                latest = Some(tick);
                break;
            };
            let before = start.checked_sub(jiff::SignedDuration::from_nanos(1)).ok()?;
            from = before.to_zoned(self.zone.clone());
        }
        let latest = latest?;
        let at = jiff::Timestamp::from_millisecond(t.as_millis()).ok()?;
        // Changes strictly before `at + 1 ns`: at or before `at`.
        let upto = at.checked_add(jiff::SignedDuration::from_nanos(1)).ok()?;
        let skipped = self
            .zone
            .preceding(upto)
            .take_while(|change| change.timestamp() > latest)
            .take(CHANGES_SEARCHED_MAX)
            .map(|change| change.timestamp())
            .find(|&change| self.names_a_skipped_time(change));
        Some(millis(skipped.unwrap_or(latest)))
    }

    /// The cron library's next (`forward`) or previous tick from `from`. A wall time the
    /// clocks repeat stands for two instants, and the library may answer the one on the
    /// wrong side of `from`; the other one is then the answer.
    fn search(
        &self,
        from: &jiff::Zoned,
        inclusive: bool,
        forward: bool,
    ) -> Option<jiff::Timestamp> {
        let found = if forward {
            self.cron.find_next_occurrence(from, inclusive).ok()?
        } else {
            self.cron.find_previous_occurrence(from, inclusive).ok()?
        };
        let (start, tick) = (from.timestamp(), found.timestamp());
        let beyond = |t: jiff::Timestamp| match (forward, inclusive) {
            (true, true) => t < start,
            (true, false) => t <= start,
            (false, true) => t > start,
            (false, false) => t >= start,
        };
        if !beyond(tick) {
            return Some(tick);
        }
        let both = self.zone.to_ambiguous_zoned(found.datetime());
        let other = if forward { both.later() } else { both.earlier() }.ok()?.timestamp();
        (!beyond(other)).then_some(other)
    }

    /// When `tick` lies in the second pass of an hour the clocks repeat and the pattern
    /// keeps to the wall clock: that pass's start and end (a tick there fired already in
    /// the first pass).
    fn repeated_pass(&self, tick: jiff::Timestamp) -> Option<(jiff::Timestamp, jiff::Timestamp)> {
        if !self.wall_clock {
            return None;
        }
        let upto = tick.checked_add(jiff::SignedDuration::from_nanos(1)).ok()?;
        let change = self.zone.preceding(upto).next()?.timestamp();
        let (before, after) = self.offsets_around(change)?;
        let repeated = before.seconds() - after.seconds();
        if repeated <= 0 {
            return None;
        }
        let end = change.checked_add(jiff::SignedDuration::from_secs(i64::from(repeated))).ok()?;
        (tick < end).then_some((change, end))
    }

    /// Whether the clocks skip forward at `change` and the pattern, keeping to the wall
    /// clock, names a time they skip: that time fires once, at the change.
    fn names_a_skipped_time(&self, change: jiff::Timestamp) -> bool {
        if !self.wall_clock {
            return false;
        }
        let Some((before, after)) = self.offsets_around(change) else { return false };
        let skipped = after.seconds() - before.seconds();
        if skipped <= 0 {
            return false;
        }
        // The skipped wall times, read as plain times (in UTC, which skips none).
        let first = before.to_datetime(change);
        let Ok(end) = first.checked_add(jiff::SignedDuration::from_secs(i64::from(skipped))) else {
            return false;
        };
        let Ok(first) = first.to_zoned(TimeZone::UTC) else { return false };
        self.cron.find_next_occurrence(&first, true).is_ok_and(|named| named.datetime() < end)
    }

    /// The zone's offsets just before and at `change`.
    fn offsets_around(
        &self,
        change: jiff::Timestamp,
    ) -> Option<(jiff::tz::Offset, jiff::tz::Offset)> {
        let before = change.checked_sub(jiff::SignedDuration::from_nanos(1)).ok()?;
        Some((self.zone.to_offset(before), self.zone.to_offset(change)))
    }

    /// The one rule of a schedule runner's poll. `passed` is the time up to which this
    /// runner already handled the schedule (`None` right after it started); `pause` is the
    /// schedule's current pause state; `fired_through` the latest tick recorded as fired in
    /// the stored state ([`plan_fired`]), by any worker before or since any restart.
    ///
    /// A tick at or before `fired_through` never fires again, whatever this runner
    /// remembers: that is what keeps a `catch_up` restart from repeating a tick whose
    /// broadcast was already read or whose instance was already pruned. A tick at or
    /// before a stored resume's time never fires: it fell due while the schedule was
    /// paused, whether or not this runner polled in between. `passed` never moves back, so
    /// a clock stepping back does not fire a tick again either.
    pub fn poll(
        &self,
        passed: Option<Timestamp>,
        now: Timestamp,
        pause: Pause,
        fired_through: Option<Timestamp>,
    ) -> TickPlan {
        let next = self.next_after(now);
        let latest = self.latest_at_or_before(now);
        let fire = match (pause.paused, passed) {
            (true, _) => None,
            (false, Some(passed)) => latest.filter(|tick| *tick > passed),
            (false, None) => match self.missed {
                MissedTicks::Skip => None,
                MissedTicks::CatchUp => latest,
            },
        };
        let bound = fire_bound(pause, fired_through);
        let fire = fire.filter(|tick| bound.is_none_or(|bound| *tick > bound));
        let passed = passed.map_or(now, |passed| passed.max(now));
        TickPlan { fire, passed, next }
    }

    /// The next tick that will fire, as of `now`: the first tick after `now` that
    /// [`Schedule::poll`] lets through, so after the resume time and after the recorded
    /// fired tick (which lies ahead of `now` when a clock ran ahead). `None` when paused,
    /// or when the pattern never matches again.
    pub fn next_fire(
        &self,
        now: Timestamp,
        pause: Pause,
        fired_through: Option<Timestamp>,
    ) -> Option<Timestamp> {
        if pause.paused {
            return None;
        }
        self.next_after(fire_bound(pause, fired_through).map_or(now, |bound| bound.max(now)))
    }

    /// The key that makes one tick fire once across all workers: the uniqueness key of the
    /// instance it starts, or the dedup key of the event it broadcasts:
    /// `schedule:<namespace length>:<namespace>:<name>:<tick in ms>`, such as
    /// `schedule:7:billing:nightly:1767229200000`. Uniqueness keys are global in a store,
    /// so a schedule of the same name in another namespace keys its ticks apart; the
    /// length keeps the parts apart whatever characters a namespace holds.
    pub fn tick_key(&self, tick: Timestamp) -> String {
        let namespace = self.namespace();
        format!("schedule:{}:{namespace}:{}:{}", namespace.len(), self.name, tick.as_millis())
    }

    /// The instance a tick starts (for a starting schedule), keyed by the tick.
    pub fn instance_for(&self, tick: Timestamp) -> Option<NewInstance> {
        match &self.action {
            ScheduleAction::Start(template) => {
                Some(template.clone().unique(self.tick_key(tick), StatusSet::ALL))
            }
            ScheduleAction::Broadcast(_) => None,
        }
    }

    /// How an operator sees the schedule at `now` in the pause state `pause`, with the
    /// stored fired tick `fired_through`.
    pub fn info(
        &self,
        now: Timestamp,
        pause: Pause,
        fired_through: Option<Timestamp>,
    ) -> ScheduleInfo {
        let action = match &self.action {
            ScheduleAction::Start(new) => {
                format!("start {} v{}", new.machine.name, new.machine.version)
            }
            ScheduleAction::Broadcast(b) => match &b.in_state {
                Some(state) => format!("broadcast {} to {} in {state}", b.event, b.machine),
                None => format!("broadcast {} to {}", b.event, b.machine),
            },
        };
        ScheduleInfo {
            name: self.name.clone(),
            cron: self.pattern.clone(),
            time_zone: self.zone_name.clone(),
            action,
            missed: self.missed,
            namespace: self.namespace().to_owned(),
            paused: pause.paused,
            changed_at: pause.since,
            fired_through,
            fired_ahead: fired_ahead(fired_through, now).is_some(),
            next_fire: self.next_fire(now, pause, fired_through),
        }
    }

    fn zoned(&self, t: Timestamp) -> Option<jiff::Zoned> {
        let ts = jiff::Timestamp::from_millisecond(t.as_millis()).ok()?;
        Some(ts.to_zoned(self.zone.clone()))
    }
}

/// Most repeated-hour passes one tick search skips in a row. Clock changes come months
/// apart, so one is the most a search meets; the bound only keeps the loop finite.
const REPEATED_SKIPS_MAX: usize = 4;

/// Most clock changes searched between two ticks of the cron pattern for a skipped time
/// it names; a pattern that fires at least once a year meets about two. One that fires
/// more rarely (29 February) may meet more, on dates no zone changes its clocks.
const CHANGES_SEARCHED_MAX: usize = 16;

fn millis(t: jiff::Timestamp) -> Timestamp {
    Timestamp::from_millis(t.as_millisecond())
}

/// Whether a cron pattern fires at fixed times of day, as cron tells them: no time-of-day
/// field (seconds, minute, hour) starts with `*`. Such a pattern keeps to the wall clock
/// across daylight-saving changes; one with a `*` there (`*/10 * * * *`, `*/20 2 * * *`)
/// follows real time. Nicknames are fixed times but for `@hourly`.
fn names_its_hours(cron: &str) -> bool {
    let fields: Vec<&str> = cron.split_whitespace().collect();
    let time_of_day = match fields.len() {
        5 => &fields[..2],
        6 => &fields[..3],
        _ => return !cron.trim().eq_ignore_ascii_case("@hourly"),
    };
    !time_of_day.iter().any(|field| field.starts_with('*'))
}

/// The time no tick at or before may fire: the later of a stored resume's time and the
/// recorded fired tick. The one bound [`Schedule::poll`] and [`Schedule::next_fire`] share.
fn fire_bound(pause: Pause, fired_through: Option<Timestamp>) -> Option<Timestamp> {
    // `None` orders below any `Some`, so the later of two known times, or the one known.
    pause.since.max(fired_through)
}

/// Checks a list of schedules served together: at most [`SCHEDULES_MAX`], names unique.
///
/// # Errors
///
/// Too many schedules, or two with one name (a worker's pause handle, listing and metrics
/// know its schedules by name).
pub fn check_schedules(schedules: &[Schedule]) -> Result<(), ScheduleError> {
    if schedules.len() > SCHEDULES_MAX {
        return Err(ScheduleError {
            name: String::new(),
            field: "schedules",
            reason: format!(
                "{} schedules; the limit is {SCHEDULES_MAX}: merge schedules that share a pattern",
                schedules.len()
            ),
        });
    }
    let mut names = std::collections::BTreeSet::new();
    for s in schedules {
        if !names.insert(s.name.as_str()) {
            return Err(ScheduleError {
                name: s.name.clone(),
                field: "name",
                reason: "two schedules have this name; rename one (a worker knows its schedules \
                         by name)"
                    .into(),
            });
        }
    }
    Ok(())
}

fn check_action(action: &ScheduleAction) -> Result<(), String> {
    match action {
        ScheduleAction::Start(new) => {
            new.validate("start").map_err(|e| e.to_string())?;
            if new.business_key.is_some() {
                return Err("start: a business key would refuse the second tick's instance; \
                     leave it unset (each tick's instance is keyed by the tick)"
                    .into());
            }
            Ok(())
        }
        ScheduleAction::Broadcast(b) => {
            let params = crate::ports::store::SignalBroadcastParams {
                namespace: b.namespace.clone(),
                machine: b.machine.clone(),
                in_state: b.in_state.clone(),
                name: b.event.clone(),
                payload: b.payload.clone(),
                dedup_key: Some("schedule:check".into()),
                now: Timestamp::from_millis(0),
            };
            params.validate().map_err(|e| e.to_string())
        }
    }
}

/// `[schedules.<name>]` in `keel.toml`: exactly one of `start` and `broadcast`.
///
/// ```toml
/// [schedules.nightly-report]
/// cron = "0 2 * * *"
/// time_zone = "Europe/Paris"
/// missed = "catch_up"
/// start = { machine = "report", context = { kind = "daily" } }
///
/// [schedules.renewals]
/// cron = "*/10 * * * *"
/// broadcast = { machine = "subscription", state = "active", event = "renew" }
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// The cron pattern.
    pub cron: String,
    /// IANA time zone (default `"UTC"`).
    #[serde(default = "utc")]
    pub time_zone: String,
    /// Missed-tick policy (default `skip`).
    #[serde(default)]
    pub missed: MissedTicks,
    /// Start paused.
    #[serde(default)]
    pub paused: bool,
    /// Start an instance at each tick.
    #[serde(default)]
    pub start: Option<StartConfig>,
    /// Broadcast an event at each tick.
    #[serde(default)]
    pub broadcast: Option<BroadcastConfig>,
}

fn utc() -> String {
    "UTC".into()
}

fn init() -> String {
    crate::chart::INIT_POSITION.into()
}

const fn one() -> i32 {
    1
}

/// `start = { … }` of a schedule in `keel.toml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartConfig {
    /// Machine name.
    pub machine: String,
    /// Machine version (default 1).
    #[serde(default = "one")]
    pub version: i32,
    /// Where the instance starts (default `"@init"`, a chart's initial configuration).
    #[serde(default = "init")]
    pub at: String,
    /// Namespace (default `"default"`).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Queue (default `"default"`).
    #[serde(default)]
    pub queue: Option<String>,
    /// Initial context, a table (default empty).
    #[serde(default)]
    pub context: Option<Value>,
}

/// `broadcast = { … }` of a schedule in `keel.toml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BroadcastConfig {
    /// Machine name (any version).
    pub machine: String,
    /// Only instances in this state.
    #[serde(default)]
    pub state: Option<String>,
    /// Event name.
    pub event: String,
    /// Event payload (default `{}`).
    #[serde(default)]
    pub payload: Option<Value>,
    /// Namespace (default `"default"`).
    #[serde(default)]
    pub namespace: Option<String>,
}

impl ScheduleConfig {
    /// The schedule this section describes; errors name `schedules.<name>.<field>`.
    ///
    /// # Errors
    ///
    /// Neither or both of `start` / `broadcast`, or any [`Schedule::new`] refusal.
    pub fn to_schedule(&self, name: &str) -> Result<Schedule, ConfigError> {
        let path = |field: &str| format!("schedules.{name}.{field}");
        let action = match (&self.start, &self.broadcast) {
            (Some(start), None) => {
                let mut new =
                    NewInstance::new(MachineRef::new(&start.machine, start.version), &start.at)
                        .namespace(start.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE))
                        .context(
                            start
                                .context
                                .clone()
                                .unwrap_or_else(|| Value::Object(serde_json::Map::default())),
                        );
                if let Some(queue) = &start.queue {
                    new = new.queue(queue);
                }
                ScheduleAction::Start(new)
            }
            (None, Some(b)) => ScheduleAction::Broadcast(BroadcastAction {
                namespace: b.namespace.clone().unwrap_or_else(|| DEFAULT_NAMESPACE.into()),
                machine: b.machine.clone(),
                in_state: b.state.clone(),
                event: b.event.clone(),
                payload: b
                    .payload
                    .clone()
                    .unwrap_or_else(|| Value::Object(serde_json::Map::default())),
            }),
            _ => {
                return Err(ConfigError::Invalid {
                    path: path("start"),
                    reason: "write exactly one of `start = { machine = \"…\" }` and \
                             `broadcast = { machine = \"…\", event = \"…\" }`"
                        .into(),
                });
            }
        };
        Schedule::new(name, &self.cron, &self.time_zone, action)
            .map(|s| s.missed(self.missed).paused(self.paused))
            .map_err(|e| ConfigError::Invalid { path: path(e.field), reason: e.reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: i64 = 60_000;
    // 2026-01-01T00:00:00Z.
    const T0: i64 = 1_767_225_600_000;

    fn every_minute(missed: MissedTicks) -> Schedule {
        let new = NewInstance::new(MachineRef::new("report", 1), "@init");
        Schedule::new("m", "* * * * *", "UTC", ScheduleAction::Start(new)).unwrap().missed(missed)
    }

    fn ts(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// One row: (policy, passed, now, paused) → tick fired.
    fn check(missed: MissedTicks, passed: Option<i64>, now: i64, paused: bool, fire: Option<i64>) {
        let pause = Pause::resolve(paused, None);
        let plan = every_minute(missed).poll(passed.map(ts), ts(now), pause, None);
        assert_eq!(plan.fire, fire.map(ts), "{missed} passed={passed:?} now={now} paused={paused}");
        assert_eq!(plan.passed, ts(now));
    }

    #[test]
    fn which_tick_is_due() {
        use MissedTicks::{CatchUp, Skip};
        // On time: the tick between the last poll and now fires, under both policies.
        check(Skip, Some(T0 - 1), T0 + 10, false, Some(T0));
        check(CatchUp, Some(T0 - 1), T0 + 10, false, Some(T0));
        // Already passed: nothing.
        check(Skip, Some(T0 + 10), T0 + 20, false, None);
        // A poll exactly at the tick fires it; the next poll at the same time does not.
        check(Skip, Some(T0 - 5), T0, false, Some(T0));
        check(Skip, Some(T0), T0, false, None);
        // A runner that stalled over three ticks fires only the latest.
        check(Skip, Some(T0 - 1), T0 + 3 * MINUTE + 5, false, Some(T0 + 3 * MINUTE));
        // Just started, ticks missed: skip fires none, catch-up the latest one.
        check(Skip, None, T0 + 5 * MINUTE + 30_000, false, None);
        check(CatchUp, None, T0 + 5 * MINUTE + 30_000, false, Some(T0 + 5 * MINUTE));
        // Paused: nothing, whatever the policy.
        check(CatchUp, None, T0 + 10, true, None);
        check(Skip, Some(T0 - 1), T0 + 10, true, None);
    }

    #[test]
    fn a_stored_resume_fires_only_ticks_after_it() {
        use MissedTicks::{CatchUp, Skip};
        let stored = |paused, at| ScheduleState {
            namespace: "default".into(),
            name: "m".into(),
            paused,
            changed_at: Some(ts(at)),
            fired_through: None,
        };
        // The stored state wins over the local flag, both ways.
        assert_eq!(
            Pause::resolve(false, Some(&stored(true, 5))),
            Pause { paused: true, since: Some(ts(5)) }
        );
        assert!(!Pause::resolve(true, Some(&stored(false, 5))).paused);
        assert_eq!(Pause::resolve(true, None), Pause { paused: true, since: None });
        let poll = |missed, passed: Option<i64>, now, pause: Pause| {
            every_minute(missed).poll(passed.map(ts), ts(now), pause, None).fire
        };
        // A runner that last polled before the pause, and first again after the resume,
        // does not fire the tick that fell due in between.
        let resumed = Pause::resolve(false, Some(&stored(false, T0 + 100)));
        assert_eq!(poll(Skip, Some(T0 - 500), T0 + 200, resumed), None);
        // A tick exactly at the resume time fell due while paused: not fired either.
        let at_tick = Pause::resolve(false, Some(&stored(false, T0)));
        assert_eq!(poll(Skip, Some(T0 - 500), T0 + 200, at_tick), None);
        // Catch-up on a fresh runner does not reach back before the resume.
        assert_eq!(poll(CatchUp, None, T0 + 200, resumed), None);
        // The next tick after the resume fires as usual.
        assert_eq!(poll(Skip, Some(T0 + 200), T0 + MINUTE, resumed), Some(ts(T0 + MINUTE)));
        assert_eq!(poll(CatchUp, None, T0 + MINUTE + 1, resumed), Some(ts(T0 + MINUTE)));
        // Stored paused: nothing.
        let paused = Pause::resolve(false, Some(&stored(true, T0 - 1)));
        assert_eq!(poll(Skip, Some(T0 - 500), T0 + 200, paused), None);
    }

    #[test]
    fn storing_a_pause_keeps_the_time_of_the_first_change() {
        let params = |paused, now| SchedulePauseParams {
            namespace: "ns".into(),
            name: "nightly".into(),
            paused,
            now: ts(now),
        };
        let first = plan_pause(None, 0, &params(true, 10)).unwrap().unwrap();
        assert_eq!((first.paused, first.changed_at), (true, Some(ts(10))));
        assert_eq!(plan_pause(Some(&first), 1, &params(true, 20)).unwrap(), None);
        let resumed = plan_pause(Some(&first), 1, &params(false, 30)).unwrap().unwrap();
        assert_eq!((resumed.paused, resumed.changed_at), (false, Some(ts(30))));
        // A full namespace refuses a new schedule but still changes the ones it holds.
        let full = SCHEDULE_STATES_MAX;
        let err = plan_pause(None, full, &params(true, 40)).unwrap_err();
        assert!(err.message.starts_with("name:") && err.message.contains("1000"), "{err}");
        assert!(plan_pause(Some(&resumed), full, &params(true, 40)).unwrap().is_some());
        let long =
            SchedulePauseParams { name: "x".repeat(SCHEDULE_NAME_MAX + 1), ..params(true, 1) };
        assert!(plan_pause(None, 0, &long).unwrap_err().message.starts_with("name:"));
        let bad = SchedulePauseParams { namespace: String::new(), ..params(true, 1) };
        assert!(plan_pause(None, 0, &bad).unwrap_err().message.starts_with("namespace"));
    }

    #[test]
    fn next_tick_and_keys() {
        let s = every_minute(MissedTicks::Skip);
        assert_eq!(s.next_after(ts(T0)), Some(ts(T0 + MINUTE)));
        assert_eq!(s.next_after(ts(T0 + 1)), Some(ts(T0 + MINUTE)));
        assert_eq!(s.latest_at_or_before(ts(T0 + MINUTE - 1)), Some(ts(T0)));
        assert_eq!(s.poll(None, ts(T0 + 1), Pause::RUNNING, None).next, Some(ts(T0 + MINUTE)));
        assert_eq!(s.tick_key(ts(T0)), format!("schedule:7:default:m:{T0}"));
        let new = s.instance_for(ts(T0)).unwrap();
        let unique = new.unique.unwrap();
        assert_eq!(unique.key, format!("schedule:7:default:m:{T0}").into_bytes());
        assert_eq!(unique.scope, StatusSet::ALL, "a finished run keeps its tick taken");
    }

    #[test]
    fn a_tick_key_names_its_namespace() {
        let start = |namespace: &str, name: &str| {
            let new = NewInstance::new(MachineRef::new("report", 1), "@init").namespace(namespace);
            Schedule::new(name, "* * * * *", "UTC", ScheduleAction::Start(new)).unwrap()
        };
        let broadcast = |namespace: &str| {
            let action = ScheduleAction::Broadcast(BroadcastAction {
                namespace: namespace.into(),
                machine: "subscription".into(),
                in_state: None,
                event: "renew".into(),
                payload: Value::Null,
            });
            Schedule::new("nightly", "* * * * *", "UTC", action).unwrap()
        };
        // Uniqueness keys are global in every store: two services sharing one, each in its
        // own namespace, may both name a schedule `nightly`.
        let (a, b) = (start("team-a", "nightly"), start("team-b", "nightly"));
        assert_ne!(a.tick_key(ts(T0)), b.tick_key(ts(T0)), "a tick key names its namespace");
        let (a, b) = (broadcast("team-a"), broadcast("team-b"));
        assert_ne!(a.tick_key(ts(T0)), b.tick_key(ts(T0)), "a tick key names its namespace");
        // A namespace may hold `:`: where it ends is never in doubt.
        let (a, b) = (start("a:b", "c"), start("a", "b:c"));
        assert_ne!(a.tick_key(ts(T0)), b.tick_key(ts(T0)));
        // A namespace and name too long for a uniqueness key are refused at once, not at
        // every tick.
        let long = "n".repeat(crate::limits::NAME_BYTES_MAX - 20);
        let new = NewInstance::new(MachineRef::new("report", 1), "@init").namespace(long);
        let err = Schedule::new("nightly-report", "* * * * *", "UTC", ScheduleAction::Start(new))
            .unwrap_err();
        assert_eq!(err.field, "name", "{err}");
        assert!(err.reason.contains("shorten"), "{err}");
        // The widest tick key of the longest name in a namespace of a usual length fits.
        let name = "x".repeat(SCHEDULE_NAME_MAX);
        let s = start(&"n".repeat(100), &name);
        assert!(s.tick_key(ts(i64::MIN)).len() <= crate::limits::NAME_BYTES_MAX);
    }

    #[test]
    fn time_zones_move_the_ticks() {
        let new = NewInstance::new(MachineRef::new("report", 1), "@init");
        let paris =
            Schedule::new("p", "0 2 * * *", "Europe/Paris", ScheduleAction::Start(new.clone()))
                .unwrap();
        let utc = Schedule::new("u", "0 2 * * *", "UTC", ScheduleAction::Start(new)).unwrap();
        // Winter: Paris is UTC+1, so 02:00 there is 01:00 UTC.
        assert_eq!(paris.next_after(ts(T0)), Some(ts(T0 + 60 * MINUTE)));
        assert_eq!(utc.next_after(ts(T0)), Some(ts(T0 + 120 * MINUTE)));
        // 2026-07-01T00:00:00Z, summer: UTC+2, so 02:00 in Paris is midnight UTC.
        let july = 1_782_864_000_000;
        assert_eq!(paris.next_after(ts(july - 1)), Some(ts(july)));
    }

    /// The ticks of `cron` in `zone` from `from` (exclusive) up to `until`, as UTC times
    /// (`2026-03-29T01:00:00Z`), checking on the way that the latest tick at or before
    /// each tick is that tick, and just before it the tick before.
    fn ticks(cron: &str, zone: &str, from: &str, until: &str) -> Vec<String> {
        let new = NewInstance::new(MachineRef::new("report", 1), "@init");
        let s = Schedule::new("d", cron, zone, ScheduleAction::Start(new)).unwrap();
        let at = |text: &str| ts(text.parse::<jiff::Timestamp>().unwrap().as_millisecond());
        let (mut t, until) = (at(from), at(until));
        let mut out = Vec::new();
        while let Some(next) = s.next_after(t).filter(|next| *next <= until) {
            assert_eq!(s.latest_at_or_before(next), Some(next), "{cron} in {zone}");
            if !out.is_empty() {
                let before = s.latest_at_or_before(Timestamp(next.0 - 1));
                assert_eq!(before, Some(t), "{cron} in {zone}: the tick before {next:?}");
            }
            out.push(jiff::Timestamp::from_millisecond(next.0).unwrap().to_string());
            t = next;
            assert!(out.len() < 5_000, "{cron}: runaway");
        }
        out
    }

    #[test]
    fn named_hours_keep_to_the_wall_clock_across_daylight_saving_changes() {
        // Paris, 2026: 02:00-03:00 is skipped on 29 March (01:00Z) and repeated on
        // 25 October (first pass 00:00-01:00Z, second 01:00-02:00Z).
        let (spring, fall) = (
            ("2026-03-28T12:00Z", "2026-03-30T12:00Z"),
            ("2026-10-24T12:00Z", "2026-10-26T12:00Z"),
        );
        let paris =
            |cron: &str, (from, until): (&str, &str)| ticks(cron, "Europe/Paris", from, until);
        // One time a night: in the skipped hour, at the change; in the repeated one, once.
        assert_eq!(paris("30 2 * * *", spring), ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]);
        assert_eq!(paris("30 2 * * *", fall), ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]);
        // A list in the skipped hour fires once at the change (the cron library alone
        // fired none that night), and each time in the repeated hour once (it fired each
        // twice).
        assert_eq!(
            paris("15,45 2 * * *", spring),
            ["2026-03-29T01:00:00Z", "2026-03-30T00:15:00Z", "2026-03-30T00:45:00Z"]
        );
        assert_eq!(
            paris("15,45 2 * * *", fall),
            [
                "2026-10-25T00:15:00Z",
                "2026-10-25T00:45:00Z",
                "2026-10-26T01:15:00Z",
                "2026-10-26T01:45:00Z"
            ]
        );
        // A range over the change: 01:30, then 02:30 (skipped) at the change, 03:30.
        assert_eq!(
            paris("30 1-3 * * *", ("2026-03-28T23:00Z", "2026-03-29T12:00Z")),
            ["2026-03-29T00:30:00Z", "2026-03-29T01:00:00Z", "2026-03-29T01:30:00Z"]
        );
        assert_eq!(
            paris("30 1-3 * * *", ("2026-10-24T22:00Z", "2026-10-25T12:00Z")),
            ["2026-10-24T23:30:00Z", "2026-10-25T00:30:00Z", "2026-10-25T02:30:00Z"]
        );
        // Fixed minutes in the hour too: `0,20,40 2` fires each once.
        assert_eq!(
            paris("0,20,40 2 * * *", ("2026-10-24T22:00Z", "2026-10-25T12:00Z")),
            ["2026-10-25T00:00:00Z", "2026-10-25T00:20:00Z", "2026-10-25T00:40:00Z"]
        );
        // A `*` in the minute follows real time, as in cron: `*/20 2` fires in both
        // passes of the repeated hour, and not in the skipped one.
        assert_eq!(paris("*/20 2 * * *", fall).len(), 6 + 3);
        assert_eq!(paris("*/20 2 * * *", spring).len(), 3);
        // Every hour follows real time: both passes of the repeated hour, none skipped.
        assert_eq!(
            paris("30 * * * *", ("2026-10-24T23:00Z", "2026-10-25T03:00Z")),
            [
                "2026-10-24T23:30:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T01:30:00Z",
                "2026-10-25T02:30:00Z"
            ]
        );
        assert_eq!(
            paris("30 * * * *", ("2026-03-28T23:00Z", "2026-03-29T03:00Z")),
            [
                "2026-03-28T23:30:00Z",
                "2026-03-29T00:30:00Z",
                "2026-03-29T01:30:00Z",
                "2026-03-29T02:30:00Z"
            ]
        );
        // Seconds too: `30 0 2 * * *` fires once in the repeated hour.
        let seconds = paris("30 0 2 * * *", ("2026-10-24T22:00Z", "2026-10-25T12:00Z"));
        assert_eq!(seconds, ["2026-10-25T00:00:30Z"]);
    }

    #[test]
    fn a_year_of_wall_clock_ticks_names_each_time_once_a_day_in_zones_that_change() {
        // New York's changes come at 02:00 too; Lord Howe moves its clocks by half an
        // hour; Sydney is south, changing in April and October; UTC never changes.
        for zone in ["America/New_York", "Australia/Lord_Howe", "Australia/Sydney", "UTC"] {
            for (cron, per_day) in [("30 2 * * *", 1), ("15,45 2 * * *", 2), ("0 1-3 * * *", 3)] {
                let all = ticks(cron, zone, "2026-01-01T00:00Z", "2027-01-01T00:00Z");
                let tz = TimeZone::get(zone).unwrap();
                let mut per_date = std::collections::BTreeMap::<jiff::civil::Date, usize>::new();
                for tick in &all {
                    let local = tick.parse::<jiff::Timestamp>().unwrap().to_zoned(tz.clone());
                    *per_date.entry(local.date()).or_default() += 1;
                }
                assert!(per_date.len() >= 364, "{cron} in {zone}: {} dates", per_date.len());
                // The nights the clocks skip forward: the skipped times a pattern names
                // there fire once between them, at the change.
                let start = "2026-01-01T00:00Z".parse::<jiff::Timestamp>().unwrap();
                let skip_nights: Vec<jiff::civil::Date> = tz
                    .following(start)
                    .take_while(|c| c.timestamp().as_second() < 1_798_761_600)
                    .filter(|c| {
                        let before = c.timestamp() - jiff::SignedDuration::from_nanos(1);
                        tz.to_offset(before) < c.offset()
                    })
                    .map(|c| c.timestamp().to_zoned(tz.clone()).date())
                    .collect();
                for (date, n) in &per_date {
                    if skip_nights.contains(date) {
                        assert!((1..=per_day).contains(n), "{cron} in {zone} on {date}: {n}");
                    } else {
                        assert_eq!(*n, per_day, "{cron} in {zone} on {date}");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_definitions_name_the_field_and_the_fix() {
        let new = NewInstance::new(MachineRef::new("report", 1), "@init");
        let start = || ScheduleAction::Start(new.clone());
        let err = Schedule::new("n", "61 * * * *", "UTC", start()).unwrap_err();
        assert_eq!(err.field, "cron");
        assert!(err.to_string().contains("five fields"), "{err}");
        let err = Schedule::new("n", "* * * * *", "Mars/Olympus", start()).unwrap_err();
        assert_eq!(err.field, "time_zone");
        assert!(err.to_string().contains("Europe/Paris"), "{err}");
        let err = Schedule::new("", "* * * * *", "UTC", start()).unwrap_err();
        assert_eq!(err.field, "name");
        let keyed = ScheduleAction::Start(new.clone().business_key("k"));
        let err = Schedule::new("n", "* * * * *", "UTC", keyed).unwrap_err();
        assert_eq!(err.field, "action");
        let a = Schedule::new("same", "* * * * *", "UTC", start()).unwrap();
        let err = check_schedules(&[a.clone(), a]).unwrap_err();
        assert!(err.to_string().contains("two schedules"), "{err}");
    }

    #[test]
    fn listing_shows_the_next_fire_time() {
        let s = every_minute(MissedTicks::CatchUp);
        let info = s.info(ts(T0 + 1), Pause::RUNNING, None);
        assert_eq!(info.next_fire, Some(ts(T0 + MINUTE)));
        assert_eq!(info.action, "start report v1");
        assert_eq!(info.namespace, "default");
        assert_eq!(s.info(ts(T0 + 1), Pause::resolve(true, None), None).next_fire, None);
        // Resumed (stored) at a time ahead of this clock: the next fire is after it.
        let resumed = Pause { paused: false, since: Some(ts(T0 + MINUTE)) };
        let info = s.info(ts(T0 + 1), resumed, None);
        assert_eq!((info.next_fire, info.changed_at), (Some(ts(T0 + 2 * MINUTE)), resumed.since));
    }

    #[test]
    fn the_listed_next_fire_is_the_next_tick_a_poll_fires() {
        let s = every_minute(MissedTicks::CatchUp);
        let now = ts(T0 + 1);
        // A tick recorded ten minutes ahead (by a clock that ran ahead): the ticks up to
        // it do not fire, so the listing shows the first one after it, and says so.
        let ahead = Some(ts(T0 + 10 * MINUTE));
        let info = s.info(now, Pause::RUNNING, ahead);
        assert_eq!(info.next_fire, Some(ts(T0 + 11 * MINUTE)));
        assert_eq!((info.fired_through, info.fired_ahead), (ahead, true));
        // What the listing shows is what a poll fires: nothing before it, that tick at it.
        let mut passed = Some(now);
        let mut first = None;
        for minute in 1..=11 {
            let plan = s.poll(passed, ts(T0 + minute * MINUTE), Pause::RUNNING, ahead);
            passed = Some(plan.passed);
            first = first.or(plan.fire);
        }
        assert_eq!(first, info.next_fire);
        // A tick recorded in the past, or within the slack of ordinary skew, changes
        // nothing but is not reported as ahead.
        let info = s.info(now, Pause::RUNNING, Some(ts(T0)));
        assert_eq!((info.next_fire, info.fired_ahead), (Some(ts(T0 + MINUTE)), false));
        let skew = Some(ts(T0 + 1 + FIRED_AHEAD_SLACK_MS));
        assert!(!s.info(now, Pause::RUNNING, skew).fired_ahead);
        // The later of the resume time and the recorded tick bounds it.
        let resumed = Pause { paused: false, since: Some(ts(T0 + 20 * MINUTE)) };
        assert_eq!(s.next_fire(now, resumed, ahead), Some(ts(T0 + 21 * MINUTE)));
        assert_eq!(s.next_fire(now, Pause::resolve(true, None), None), None);
    }

    #[test]
    fn a_resume_re_anchors_a_fired_tick_ahead_of_the_clock() {
        let params = |paused, now| SchedulePauseParams {
            namespace: "ns".into(),
            name: "nightly".into(),
            paused,
            now: ts(now),
        };
        let fired = |tick| ScheduleFiredParams {
            namespace: "ns".into(),
            name: "nightly".into(),
            tick: ts(tick),
        };
        // A clock that ran an hour ahead recorded a tick; the schedule is then paused.
        let ahead = plan_fired(None, 0, &fired(T0 + 60 * MINUTE)).unwrap().unwrap();
        let paused = plan_pause(Some(&ahead), 1, &params(true, T0)).unwrap().unwrap();
        assert_eq!(paused.fired_through, Some(ts(T0 + 60 * MINUTE)), "a pause keeps it");
        // The resume re-anchors it at the resume time: the next tick after it fires.
        let resumed = plan_pause(Some(&paused), 1, &params(false, T0 + 10)).unwrap().unwrap();
        assert_eq!(
            (resumed.paused, resumed.changed_at, resumed.fired_through),
            (false, Some(ts(T0 + 10)), Some(ts(T0 + 10)))
        );
        let s = every_minute(MissedTicks::Skip);
        let pause = Pause::resolve(false, Some(&resumed));
        let plan = s.poll(Some(ts(T0 + 10)), ts(T0 + MINUTE), pause, resumed.fired_through);
        assert_eq!(plan.fire, Some(ts(T0 + MINUTE)));
        // The report of the resume sees the move back from the tick read before it.
        assert_eq!(re_anchored(Some(&paused), &resumed), Some((ts(T0 + 60 * MINUTE), ts(T0 + 10))));
        assert_eq!(re_anchored(Some(&resumed), &resumed), None);
        assert_eq!(re_anchored(None, &resumed), None);
        // Resuming a schedule that runs (a repeat) changes nothing, even with a tick
        // recorded ahead of the caller's clock: a caller whose clock runs behind the
        // workers' must not move the record below a tick that really fired.
        let running = ScheduleState { fired_through: Some(ts(T0 + 60 * MINUTE)), ..resumed };
        assert_eq!(plan_pause(Some(&running), 1, &params(false, T0 + 20)).unwrap(), None);
        // A row that only records ticks is not stored as paused: its resume is stored,
        // keeping the recorded tick.
        let first = plan_pause(Some(&ahead), 1, &params(false, T0)).unwrap().unwrap();
        assert_eq!(
            (first.changed_at, first.fired_through),
            (Some(ts(T0)), Some(ts(T0 + 60 * MINUTE)))
        );
        // Pausing it, then resuming it, re-anchors it.
        let paused_again = plan_pause(Some(&first), 1, &params(true, T0 + 20)).unwrap().unwrap();
        let re = plan_pause(Some(&paused_again), 1, &params(false, T0 + 30)).unwrap().unwrap();
        assert_eq!((re.changed_at, re.fired_through), (Some(ts(T0 + 30)), Some(ts(T0 + 30))));
        // Within the slack of ordinary skew the recorded tick is kept: re-anchoring it
        // would let a tick a worker slightly ahead fired fire again.
        let near = plan_fired(None, 0, &fired(T0 + FIRED_AHEAD_SLACK_MS)).unwrap().unwrap();
        let near = plan_pause(Some(&near), 1, &params(true, T0 - 10)).unwrap().unwrap();
        let kept = plan_pause(Some(&near), 1, &params(false, T0)).unwrap().unwrap();
        assert_eq!(kept.fired_through, Some(ts(T0 + FIRED_AHEAD_SLACK_MS)));
    }

    #[test]
    fn forgetting_names_the_states_no_defined_schedule_has() {
        let state = |ns: &str, name: &str| ScheduleState {
            namespace: ns.into(),
            name: name.into(),
            paused: false,
            changed_at: None,
            fired_through: Some(ts(T0)),
        };
        let stored = [state("default", "old"), state("default", "m"), state("default", "older")];
        let defined = [every_minute(MissedTicks::Skip)];
        assert_eq!(plan_forget("default", &stored, &defined), ["old", "older"]);
        // A schedule of the same name in another namespace does not keep a state.
        let elsewhere = [state("ops", "m")];
        assert_eq!(plan_forget("ops", &elsewhere, &defined), ["m"]);
        assert_eq!(plan_forget("default", &stored[1..2], &defined), Vec::<String>::new());
    }

    #[test]
    fn a_state_used_within_a_day_counts_as_served() {
        let state = |changed_at: Option<i64>, fired_through: Option<i64>| ScheduleState {
            namespace: "default".into(),
            name: "old".into(),
            paused: false,
            changed_at: changed_at.map(ts),
            fired_through: fired_through.map(ts),
        };
        let now = ts(T0 + FORGET_QUIET_MS);
        // A tick recorded a minute ago, or ahead of this clock: some worker serves it.
        let ticked = state(None, Some(T0 + FORGET_QUIET_MS - MINUTE));
        assert_eq!(
            recently_used(&ticked, now),
            Some(("fired_through", ts(T0 + FORGET_QUIET_MS - MINUTE)))
        );
        let ahead = state(None, Some(T0 + FORGET_QUIET_MS + MINUTE));
        assert_eq!(recently_used(&ahead, now).map(|(field, _)| field), Some("fired_through"));
        // A pause or resume stored within the day.
        let changed = state(Some(T0 + 1), Some(T0));
        assert_eq!(recently_used(&changed, now), Some(("changed_at", ts(T0 + 1))));
        // Both a day old or more, or nothing recorded: quiet.
        assert_eq!(recently_used(&state(Some(T0), Some(T0)), now), None);
        assert_eq!(recently_used(&state(None, None), now), None);
    }

    #[test]
    fn keel_toml_defines_schedules() {
        let config = crate::config::KeelConfig::from_toml_str(
            r#"
            [schedules.nightly]
            cron = "0 2 * * *"
            time_zone = "Europe/Paris"
            missed = "catch_up"
            start = { machine = "report", version = 2, context = { kind = "daily" } }

            [schedules.renewals]
            cron = "*/10 * * * *"
            paused = true
            broadcast = { machine = "subscription", state = "active", event = "renew" }
            "#,
        )
        .unwrap();
        let schedules = config.schedules().unwrap();
        let nightly = &schedules[0];
        assert_eq!(nightly.missed_ticks(), MissedTicks::CatchUp);
        let new = nightly.instance_for(ts(T0)).unwrap();
        assert_eq!(new.machine, MachineRef::new("report", 2));
        assert_eq!(new.context, serde_json::json!({ "kind": "daily" }));
        let renewals = &schedules[1];
        assert!(renewals.is_paused());
        assert_eq!(
            renewals.info(ts(T0), Pause::RUNNING, None).action,
            "broadcast renew to subscription in active"
        );
    }

    #[test]
    fn keel_toml_refuses_bad_schedules_with_their_path() {
        let cases = [
            ("cron = \"* * * * *\"", "schedules.s.start: write exactly one of"),
            (
                "cron = \"nope\"\nstart = { machine = \"m\" }",
                "schedules.s.cron: \"nope\" is not a cron pattern",
            ),
            (
                "cron = \"* * * * *\"\ntime_zone = \"Nowhere\"\nstart = { machine = \"m\" }",
                "schedules.s.time_zone:",
            ),
            ("cron = \"* * * * *\"\nmissed = \"later\"\nstart = { machine = \"m\" }", "catch_up"),
            ("cron = \"* * * * *\"\nstart = { machine = \"m\", colour = 1 }", "colour"),
        ];
        for (body, expected) in cases {
            let source = format!("[schedules.s]\n{body}\n");
            let err = crate::config::KeelConfig::from_toml_str(&source).unwrap_err().to_string();
            assert!(err.contains(expected), "{source}: {err}");
        }
    }

    #[test]
    fn a_recorded_tick_never_fires_again() {
        use MissedTicks::{CatchUp, Skip};
        let s = every_minute(CatchUp);
        // A restart that catches up does not fire the latest tick when it is recorded.
        assert_eq!(s.poll(None, ts(T0 + 10), Pause::RUNNING, Some(ts(T0))).fire, None);
        // Recorded by a worker whose clock is ahead: nothing up to it fires here either.
        assert_eq!(
            s.poll(Some(ts(T0 - 1)), ts(T0 + 10), Pause::RUNNING, Some(ts(T0 + MINUTE))).fire,
            None
        );
        // An older record does not hold back a newer tick.
        let plan = s.poll(None, ts(T0 + 10), Pause::RUNNING, Some(ts(T0 - MINUTE)));
        assert_eq!(plan.fire, Some(ts(T0)));
        let plan = every_minute(Skip).poll(
            Some(ts(T0 - 1)),
            ts(T0 + 10),
            Pause::RUNNING,
            Some(ts(T0 - MINUTE)),
        );
        assert_eq!(plan.fire, Some(ts(T0)));
    }

    #[test]
    fn a_clock_stepping_back_does_not_fire_a_tick_again() {
        let s = every_minute(MissedTicks::Skip);
        let fired = s.poll(Some(ts(T0 - 1)), ts(T0 + 1_000), Pause::RUNNING, None);
        assert_eq!((fired.fire, fired.passed), (Some(ts(T0)), ts(T0 + 1_000)));
        // The clock steps back 30 s: nothing fires and what was passed stays passed.
        let back = s.poll(Some(fired.passed), ts(T0 - 30_000), Pause::RUNNING, None);
        assert_eq!((back.fire, back.passed), (None, ts(T0 + 1_000)));
        // Back at the tick's time: it is not fired a second time.
        let again = s.poll(Some(back.passed), ts(T0 + 2_000), Pause::RUNNING, None);
        assert_eq!((again.fire, again.passed), (None, ts(T0 + 2_000)));
        // The next tick fires as usual.
        assert_eq!(
            s.poll(Some(again.passed), ts(T0 + MINUTE), Pause::RUNNING, None).fire,
            Some(ts(T0 + MINUTE))
        );
    }

    #[test]
    fn recording_a_fired_tick_keeps_the_latest_and_leaves_the_pause_alone() {
        let fired = |tick| ScheduleFiredParams {
            namespace: "ns".into(),
            name: "nightly".into(),
            tick: ts(tick),
        };
        let first = plan_fired(None, 0, &fired(100)).unwrap().unwrap();
        assert_eq!(
            (first.fired_through, first.changed_at, first.paused),
            (Some(ts(100)), None, false)
        );
        // A row that only records ticks stores no pause: the definition decides.
        assert_eq!(Pause::resolve(true, Some(&first)), Pause { paused: true, since: None });
        assert_eq!(Pause::resolve(false, Some(&first)), Pause::RUNNING);
        // An older or equal tick changes nothing; a newer one moves it forward.
        assert_eq!(plan_fired(Some(&first), 1, &fired(50)).unwrap(), None);
        assert_eq!(plan_fired(Some(&first), 1, &fired(100)).unwrap(), None);
        let later = plan_fired(Some(&first), 1, &fired(160)).unwrap().unwrap();
        assert_eq!(later.fired_through, Some(ts(160)));
        // Resuming a schedule whose row only records ticks stores the resume, and keeps
        // the recorded tick; recording keeps the stored pause.
        let pause = |paused, now| SchedulePauseParams {
            namespace: "ns".into(),
            name: "nightly".into(),
            paused,
            now: ts(now),
        };
        let resumed = plan_pause(Some(&later), 1, &pause(false, 200)).unwrap().unwrap();
        assert_eq!((resumed.changed_at, resumed.fired_through), (Some(ts(200)), Some(ts(160))));
        let paused = plan_pause(Some(&resumed), 1, &pause(true, 300)).unwrap().unwrap();
        let recorded = plan_fired(Some(&paused), 1, &fired(400)).unwrap().unwrap();
        assert_eq!(
            (recorded.paused, recorded.changed_at, recorded.fired_through),
            (true, Some(ts(300)), Some(ts(400)))
        );
        // A full namespace refuses a new row, naming the bound and the fix, but still
        // records the ticks of the schedules it holds.
        let err = plan_fired(None, SCHEDULE_STATES_MAX, &fired(100)).unwrap_err();
        assert!(err.message.starts_with("name:") && err.message.contains("1000"), "{err}");
        assert!(err.message.contains("delete their rows"), "{err}");
        assert!(err.message.contains("keel schedules forget"), "{err}");
        assert!(err.message.contains("keel_schedule_states in SQLite"), "{err}");
        assert!(err.message.contains("schedule_states in Keel's PostgreSQL schema"), "{err}");
        assert!(plan_fired(Some(&first), SCHEDULE_STATES_MAX, &fired(500)).unwrap().is_some());
        let bad = ScheduleFiredParams { namespace: String::new(), ..fired(1) };
        assert!(plan_fired(None, 0, &bad).unwrap_err().message.starts_with("namespace"));
    }

    #[test]
    fn a_pattern_that_never_matches_is_refused() {
        let new = NewInstance::new(MachineRef::new("report", 1), "@init");
        let start = || ScheduleAction::Start(new.clone());
        for never in ["0 0 30 2 *", "0 0 31 4 *", "0 0 0 31 11 *"] {
            let err = Schedule::new("n", never, "UTC", start()).unwrap_err();
            assert_eq!(err.field, "cron", "{never}");
            assert!(err.to_string().contains("never matches"), "{err}");
            assert!(err.to_string().contains("day-of-month and month"), "{err}");
        }
        // A year field is not part of the pattern: seven fields are refused.
        let err = Schedule::new("n", "0 0 2 1 1 * 2024", "UTC", start()).unwrap_err();
        assert_eq!(err.field, "cron");
        assert!(err.to_string().contains("five fields"), "{err}");
        // Rare days still match: 29 February, the last day of February, nicknames.
        for rare in ["0 0 29 2 *", "0 0 L 2 *", "@yearly", "0 0 29 2 +MON"] {
            let s = Schedule::new("n", rare, "Europe/Paris", start()).expect(rare);
            assert!(s.next_after(ts(T0)).is_some(), "{rare}");
        }
    }
}
