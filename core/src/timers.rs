//! Durable timers as rows: armed in the commit that enters a state,
//! deleted in the commit that leaves it, and fired by a sweep that delivers each fire into
//! the instance's inbox with a dedup key, so two sweeps (or a re-run sweep) never deliver
//! the same fire twice.
//!
//! [`fire`] is the pure reference of one due timer: what to deliver, what to record, and
//! the row that remains. Every store's sweep must do exactly this, in one transaction per
//! batch.

use crate::chart::{TimerArm, TimerKind};
use crate::history::HistoryKind;
use crate::ids::{InstanceId, MachineRef, TimerId};
use crate::instance::{HistoryEntry, NewSignal};
use crate::limits;
use crate::outcome::StepCommit;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::VecDeque;
use std::time::Duration;

/// An armed timer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerRow {
    /// Its id.
    pub id: TimerId,
    /// The instance it belongs to.
    pub instance: InstanceId,
    /// The instance's namespace.
    pub namespace: String,
    /// The instance's machine.
    pub machine: MachineRef,
    /// What it delivers and when: owning state, event, kind, interval, `max`, `then`.
    pub spec: TimerArm,
    /// When it is due next.
    pub next_fire_at: Timestamp,
    /// How many times it has fired.
    pub fire_count: u32,
    /// When it was armed (the state entry).
    pub armed_at: Timestamp,
}

impl TimerRow {
    /// The row a store inserts when a commit at `now` arms `spec` for `instance`.
    pub fn armed(
        id: TimerId,
        instance: InstanceId,
        namespace: &str,
        machine: &MachineRef,
        spec: TimerArm,
        now: Timestamp,
    ) -> Self {
        TimerRow {
            id,
            instance,
            namespace: namespace.to_owned(),
            machine: machine.clone(),
            next_fire_at: now.plus(spec.interval),
            spec,
            fire_count: 0,
            armed_at: now,
        }
    }
}

/// What firing one due timer does.
#[derive(Debug, Clone, PartialEq)]
pub struct Fired {
    /// The event to deliver into the instance's inbox (with its dedup key).
    pub signal: NewSignal,
    /// The history entry to record on the instance.
    pub history: HistoryEntry,
    /// The timer after the fire; `None` deletes it.
    pub next: Option<TimerRow>,
}

/// How the dedup key of every signal a timer delivers begins.
pub const FIRE_KEY_PREFIX: &str = "timer:";

/// The dedup key of fire number `n` of timer `id`: `timer:{id}:{n}`.
pub fn fire_dedup_key(id: TimerId, n: u32) -> String {
    format!("{FIRE_KEY_PREFIX}{}:{n}", id.0)
}

/// The state that owned the timer a signal came from, when the signal is a timer's fire
/// (its dedup key begins with [`FIRE_KEY_PREFIX`] and its payload names the state); `None`
/// for any other signal.
pub fn fire_owner<'a>(dedup_key: Option<&str>, payload: &'a serde_json::Value) -> Option<&'a str> {
    dedup_key.filter(|k| k.starts_with(FIRE_KEY_PREFIX))?;
    payload.get("state")?.as_str()
}

/// Fires a due timer at `now`:
/// - `after`: delivers its event once, then the timer is gone;
/// - `every`: delivers its event and is due again at its next tick, the first
///   `due + k·interval` after `now` ([`next_tick`]): a late sweep does not delay the ticks
///   after it, and missed intervals are not back-filled;
/// - `every` + `max`: after `max` fires, the next due time delivers `then` exactly once
///   (`TIMER_EXHAUSTED`) and the timer is gone.
pub fn fire(timer: &TimerRow, now: Timestamp) -> Fired {
    let spec = &timer.spec;
    if exhausted(timer) {
        let event = spec.then.clone().unwrap_or_default();
        let signal = NewSignal::new(timer.instance, event.clone())
            .payload(json!({ "timer": timer.id, "state": spec.state, "fires": timer.fire_count }))
            .dedup_key(format!("{FIRE_KEY_PREFIX}{}:then", timer.id.0));
        let history = HistoryEntry::new(
            HistoryKind::TimerExhausted,
            json!({ "timer": timer.id, "state": spec.state, "event": spec.event, "then": spec.then, "fires": timer.fire_count }),
        );
        return Fired { signal, history, next: None };
    }
    let n = timer.fire_count + 1;
    let signal = NewSignal::new(timer.instance, spec.event.clone())
        .payload(json!({ "timer": timer.id, "state": spec.state, "fire": n }))
        .dedup_key(fire_dedup_key(timer.id, n));
    let history = HistoryEntry::new(
        HistoryKind::TimerFired,
        json!({ "timer": timer.id, "state": spec.state, "event": spec.event, "fire": n, "due": timer.next_fire_at, "at": now }),
    );
    let next = (spec.kind == TimerKind::Every).then(|| TimerRow {
        fire_count: n,
        next_fire_at: next_tick(timer.next_fire_at, spec.interval, now),
        ..timer.clone()
    });
    Fired { signal, history, next }
}

/// Whether a due `every` + `max` timer has used up its `max` fires, so its next due time
/// delivers `then` and ends it.
fn exhausted(timer: &TimerRow) -> bool {
    timer.spec.kind == TimerKind::Every && timer.spec.max.is_some_and(|max| timer.fire_count >= max)
}

/// Whether a due timer of a held instance — suspended (dead-lettered), or in a paused queue
/// ([`crate::plan::timer::Owner::Held`]) — is held rather than fired: every tick of an
/// `every` timer except an exhausted timer's `then`. Such an instance runs nothing until an
/// operator retries it or resumes its queue, which may be days away; its repeating timers
/// would otherwise fill its inbox with one fire per interval, all replayed at once after.
/// An `after` timer and a `then` still deliver once each, as they would to a live instance:
/// one signal each, waiting for the retry or the resume.
pub fn held_while_suspended(timer: &TimerRow) -> bool {
    timer.spec.kind == TimerKind::Every && !exhausted(timer)
}

/// A held tick ([`held_while_suspended`]) at `now`: nothing is delivered, recorded or
/// counted (the fire count, and so `max`, counts only fires the instance received), and
/// the timer is due again at its next tick after `now` ([`next_tick`]), so it never stays
/// due. After a retry or a resume the instance's next fire comes at most one interval
/// later, on the same ticks as if it had never been held: missed intervals are not
/// back-filled, as for a late sweep.
pub fn hold(timer: &TimerRow, now: Timestamp) -> TimerRow {
    TimerRow {
        next_fire_at: next_tick(timer.next_fire_at, timer.spec.interval, now),
        ..timer.clone()
    }
}

/// The next due time of an `every` timer due at `due` that fires or is held at `now`: the
/// first `due + k·interval` (k ≥ 1) after `now`. Ticks stay `interval` apart on the grid
/// that starts at the state entry, however late a sweep is: a late sweep does not push
/// the ticks after it later, and the ticks missed while no sweep ran are skipped, not
/// back-filled or bunched. A fire late by most of an interval comes shortly before the
/// next tick, which fires on time: two fires can be closer than an interval, as with
/// any fixed-rate timer. O(1), saturating at the end of time; an interval under a
/// millisecond (the stores' resolution) makes the timer due again at `now`.
pub fn next_tick(due: Timestamp, interval: Duration, now: Timestamp) -> Timestamp {
    let step = i128::try_from(interval.as_millis()).unwrap_or(i128::MAX);
    if step == 0 {
        return now;
    }
    let (due, now) = (i128::from(due.0), i128::from(now.0));
    // Whole intervals from `due` to `now`: the first tick after `now` is one more. Both
    // fit an i128 with room: `late` is under 2^65, `step` under 2^75.
    let k = if now < due { 1 } else { (now - due) / step + 1 };
    let next = due.saturating_add(k.saturating_mul(step));
    Timestamp(i64::try_from(next).unwrap_or(i64::MAX))
}

/// What the ready backlog lets one sweep of a group of timers do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backpressure {
    /// The backlog is at or below the threshold: fire everything due.
    Sweep,
    /// The backlog is above the threshold, but the group's earliest due timer is overdue by
    /// more than the group's cadence: fire one batch, soonest due first. Backpressure
    /// delays timers; it never stops them.
    OneBatch,
    /// The backlog is above the threshold and no due timer is overdue by more than the
    /// cadence: fire nothing now, count the backlog again shortly.
    Skip,
}

/// Decides what a sweep does, given the ready backlog of the machines it covers, the
/// backpressure threshold, how long the earliest due timer it covers has been due (`None`
/// when none is due) and the group's cadence (the longest it goes without a sweep). While
/// the backlog stays above the threshold, once the earliest due timer is a cadence late
/// each sweep fires one batch of the most overdue timers: a backlog nobody claims (a queue
/// no worker serves, a machine taken out of service) delays timers, by about a cadence
/// when fewer fall due than those batches fire, and never stops them for good.
pub fn backpressure(
    backlog: u64,
    threshold: u64,
    overdue: Option<Duration>,
    cadence: Duration,
) -> Backpressure {
    if backlog <= threshold {
        Backpressure::Sweep
    } else if overdue.is_some_and(|late| late > cadence) {
        Backpressure::OneBatch
    } else {
        Backpressure::Skip
    }
}

/// How long a timer due at `due` has been due at `now`; `None` when it is not due yet.
pub fn overdue_by(due: Timestamp, now: Timestamp) -> Option<Duration> {
    let ms = i128::from(now.0) - i128::from(due.0);
    (ms >= 0).then(|| Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
}

/// What following the deployed definition does to one armed timer.
#[derive(Debug, Clone, PartialEq)]
pub struct Retimed {
    /// The timer with the deployed duration and its new due time.
    pub next: TimerRow,
    /// The history entry recorded on the instance.
    pub history: HistoryEntry,
}

/// Whether the deployed timer `deployed` is the one an armed timer of spec `armed` follows:
/// the same state, event and kind.
fn follows(deployed: &TimerArm, armed: &TimerArm) -> bool {
    deployed.state == armed.state && deployed.event == armed.event && deployed.kind == armed.kind
}

/// Moves an armed timer to the duration the deployed definition gives it (`deployed`: the
/// timers of the instance's machine version that follow deploys, matched by state, event
/// and kind; the first match counts). The due time counts from the original anchor: the
/// state entry for an `after` timer, the last tick for an `every` timer — its last fire,
/// or its last tick held while its instance was suspended or its queue paused ([`hold`]),
/// even before its first fire — or its state entry while it has neither. A due time that
/// is already past makes the timer due at the next sweep. `None`
/// when no deployed timer matches, or the first match's duration is unchanged or zero.
pub fn retime(timer: &TimerRow, deployed: &[TimerArm]) -> Option<Retimed> {
    let spec = deployed.iter().find(|d| follows(d, &timer.spec))?;
    if spec.interval == timer.spec.interval || spec.interval.is_zero() {
        return None;
    }
    // The last tick of an `every` timer, fired or held (never before its state entry;
    // only an `every` timer outlives a fire); an `after` timer counts from the entry.
    let anchor = if timer.spec.kind == TimerKind::Every {
        timer.next_fire_at.minus(timer.spec.interval).max(timer.armed_at)
    } else {
        timer.armed_at
    };
    let due = anchor.plus(spec.interval);
    let history = HistoryEntry::new(
        HistoryKind::TimerRetimed,
        json!({
            "timer": timer.id,
            "state": timer.spec.state,
            "event": timer.spec.event,
            "from_ms": u64::try_from(timer.spec.interval.as_millis()).unwrap_or(u64::MAX),
            "to_ms": u64::try_from(spec.interval.as_millis()).unwrap_or(u64::MAX),
            "due_before": timer.next_fire_at,
            "due": due,
        }),
    );
    let next = TimerRow {
        spec: TimerArm { interval: spec.interval, ..timer.spec.clone() },
        next_fire_at: due,
        ..timer.clone()
    };
    Some(Retimed { next, history })
}

/// The deployed timers a store binds to read only the armed timers a retime may move: of
/// `deployed`, the first entry of each (state, event, kind) — the one [`retime`] matches —
/// unless its interval is zero, in `deployed`'s order. [`retime`] moves an armed timer
/// exactly when one of these has its state, event and kind and another interval, so a
/// store's filter of "a target of the same state, event and kind with another interval"
/// reads every timer that moves and no other; the plan still decides each move.
pub fn retime_targets(deployed: &[TimerArm]) -> Vec<TimerArm> {
    let mut seen: std::collections::HashSet<(&str, &str, TimerKind)> =
        std::collections::HashSet::with_capacity(deployed.len());
    deployed
        .iter()
        // Every entry counts as seen, a zero one included: it still hides later duplicates.
        .filter(|d| seen.insert((d.state.as_str(), d.event.as_str(), d.kind)))
        .filter(|d| !d.interval.is_zero())
        .cloned()
        .collect()
}

/// Whether an exhausted `every` timer has a `then` event to deliver (without one, the
/// exhausted timer is deleted and nothing is delivered).
pub fn delivers(fired: &Fired) -> bool {
    !fired.signal.name.is_empty()
}

/// Whether a timer owned by `state` is cancelled when `left` is left: the same state or
/// one of its descendants.
pub fn owned_by(state: &str, left: &str) -> bool {
    crate::chart::at_or_below(state, left)
}

/// Whether a timer owned by `state` goes when the states `cancel` are left.
pub fn cancelled(state: &str, cancel: &[String]) -> bool {
    cancel.iter().any(|left| owned_by(state, left))
}

/// The earliest due time among the timers a batch of commits at `now` arms (`None` when
/// it arms none): what a store tells the sweepers after the batch commits, so a sweeper
/// asleep until a later due time wakes up for this one.
pub fn armed_due<'a>(
    commits: impl IntoIterator<Item = &'a StepCommit>,
    now: Timestamp,
) -> Option<Timestamp> {
    commits
        .into_iter()
        .flat_map(|c| {
            // A join's deadline is a timer the commit arms too.
            let deadline = match &c.outcome {
                crate::outcome::Outcome::ScheduleChildren { join, .. } => join.within,
                _ => None,
            };
            c.timers_arm.iter().map(|spec| spec.interval).chain(deadline)
        })
        .map(|interval| now.plus(interval))
        .min()
}

/// What a sweeper learns from [`TimerHints::since`]: the hints after the one it saw last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimerHint {
    /// The newest hint's number; pass it as `seen` next time.
    pub cursor: u64,
    /// The earliest due time among the new hints. `None` when some were lost (the log
    /// overflowed, a listening connection dropped): read the earliest due time from the
    /// store instead.
    pub due: Option<Timestamp>,
}

/// A bounded log of "a commit armed timers due at `t`" hints, numbered from 1, that every
/// sweeper reads at its own pace with a cursor, so no sweeper misses a hint another one
/// read and a hint that lands while a sweeper is busy waits for it. Hints only shorten
/// latency: the sweeper's cadence stays the correctness path.
#[derive(Debug, Clone, Default)]
pub struct TimerHints {
    /// The newest hints, oldest first: `(number, due)`, `None` marking a gap.
    log: VecDeque<(u64, Option<Timestamp>)>,
    last: u64,
}

impl TimerHints {
    /// Records that a commit armed timers, the earliest due at `due`.
    pub fn push(&mut self, due: Timestamp) {
        self.append(Some(due));
    }

    /// Records that hints may have been lost (a listener reconnected): every reader whose
    /// cursor is older must read the earliest due time from the store.
    pub fn push_gap(&mut self) {
        self.append(None);
    }

    fn append(&mut self, due: Option<Timestamp>) {
        self.last += 1;
        if self.log.len() == limits::TIMER_HINTS_MAX {
            self.log.pop_front();
        }
        self.log.push_back((self.last, due));
    }

    /// The newest hint's number (0 before the first).
    pub fn last(&self) -> u64 {
        self.last
    }

    /// The hints after number `seen`, or `None` when there are none yet. A cursor from
    /// the future (another log) or older than what the log still holds reads as a gap.
    pub fn since(&self, seen: u64) -> Option<TimerHint> {
        if seen == self.last {
            return None;
        }
        let oldest = self.log.front().map_or(self.last + 1, |(n, _)| *n);
        let lost = seen > self.last || seen + 1 < oldest;
        let mut due: Option<Timestamp> = None;
        let mut gap = lost;
        for (_, d) in self.log.iter().filter(|(n, _)| *n > seen) {
            match d {
                Some(d) => due = Some(due.map_or(*d, |e| e.min(*d))),
                None => gap = true,
            }
        }
        Some(TimerHint { cursor: self.last, due: if gap { None } else { due } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn row(kind: TimerKind, max: Option<u32>, then: Option<&str>, fires: u32) -> TimerRow {
        let spec = TimerArm {
            state: "awaiting".into(),
            event: "TICK".into(),
            kind,
            interval: Duration::from_secs(10),
            max,
            then: then.map(str::to_owned),
        };
        let mut t = TimerRow::armed(
            TimerId(4),
            InstanceId(9),
            "ns",
            &MachineRef::new("m", 1),
            spec,
            Timestamp(0),
        );
        t.fire_count = fires;
        t
    }

    /// (case, timer, sweep time) → (event delivered, dedup key, history, next due, next count)
    #[test]
    fn fire_table() {
        type Want = (&'static str, &'static str, &'static str, Option<(i64, u32)>);
        let cases: Vec<(&str, TimerRow, i64, Want)> = vec![
            (
                "after fires once",
                row(TimerKind::After, None, None, 0),
                10_000,
                ("TICK", "timer:4:1", "TIMER_FIRED", None),
            ),
            (
                "every: next is one interval after this due time, not after the sweep",
                row(TimerKind::Every, None, None, 0),
                13_000,
                ("TICK", "timer:4:1", "TIMER_FIRED", Some((20_000, 1))),
            ),
            (
                "every: a late sweep does not back-fill",
                row(TimerKind::Every, None, None, 1),
                95_000,
                ("TICK", "timer:4:2", "TIMER_FIRED", Some((100_000, 2))),
            ),
            (
                "every+max: the max-th fire is an ordinary fire",
                row(TimerKind::Every, Some(3), Some("GIVE_UP"), 2),
                30_000,
                ("TICK", "timer:4:3", "TIMER_FIRED", Some((40_000, 3))),
            ),
            (
                "every+max: then after max fires, once",
                row(TimerKind::Every, Some(3), Some("GIVE_UP"), 3),
                40_000,
                ("GIVE_UP", "timer:4:then", "TIMER_EXHAUSTED", None),
            ),
            (
                "every+max without then: just stops",
                row(TimerKind::Every, Some(1), None, 1),
                20_000,
                ("", "timer:4:then", "TIMER_EXHAUSTED", None),
            ),
        ];
        for (case, timer, now, (event, key, kind, next)) in cases {
            let fired = fire(&timer, Timestamp(now));
            assert_eq!(fired.signal.name, event, "{case}");
            assert_eq!(fired.signal.dedup_key.as_deref(), Some(key), "{case}");
            assert_eq!(fired.history.kind, kind, "{case}");
            assert_eq!(fired.next.map(|n| (n.next_fire_at.0, n.fire_count)), next, "{case}");
            assert_eq!(delivers(&fire(&timer, Timestamp(now))), !event.is_empty(), "{case}");
        }
    }

    /// (case, timer) → held on a suspended instance; a held tick moves the due time to the
    /// first tick after the sweep and keeps the count.
    #[test]
    fn a_suspended_instance_holds_only_repeating_ticks() {
        let cases = [
            ("after: delivers once", row(TimerKind::After, None, None, 0), false),
            ("every: held", row(TimerKind::Every, None, None, 4), true),
            ("every+max below max: held", row(TimerKind::Every, Some(3), Some("GIVE_UP"), 2), true),
            (
                "every+max exhausted: then once",
                row(TimerKind::Every, Some(3), Some("GIVE_UP"), 3),
                false,
            ),
        ];
        for (case, timer, held) in cases {
            assert_eq!(held_while_suspended(&timer), held, "{case}");
        }
        let every = row(TimerKind::Every, None, None, 4);
        let next = hold(&every, Timestamp(95_000));
        assert_eq!((next.next_fire_at, next.fire_count), (Timestamp(100_000), 4));
        assert_eq!(TimerRow { next_fire_at: every.next_fire_at, ..next }, every, "nothing else");
    }

    /// (case, due, interval ms, sweep time) → the next due time of an `every` timer: the
    /// first `due + k·interval` (k ≥ 1) after the sweep, so ticks keep the phase of the
    /// state entry however late the sweep is, never pile up after an outage, and never
    /// overflow.
    #[test]
    fn every_ticks_stay_on_the_grid_of_the_state_entry() {
        let max = i64::MAX;
        let cases: Vec<(&str, i64, u64, i64, i64)> = vec![
            ("on time", 10_000, 10_000, 10_000, 20_000),
            ("a late sweep keeps the phase", 10_000, 10_000, 10_150, 20_000),
            ("late by just under an interval", 10_000, 10_000, 19_999, 20_000),
            (
                "late by exactly an interval: that tick merges into this fire",
                10_000,
                10_000,
                20_000,
                30_000,
            ),
            ("an outage skips missed ticks", 10_000, 10_000, 95_000, 100_000),
            ("a sweep before the due time", 10_000, 10_000, 9_000, 20_000),
            ("one millisecond", 5, 1, 1_000, 1_001),
            ("sub-millisecond interval", 5, 0, 1_000, 1_000),
            ("a huge interval saturates", 10_000, u64::MAX, 10_000, max),
            ("near the end of time", max - 5, 10, max - 5, max),
            ("from the start of time", i64::MIN, 1, max, max),
            ("a year late, one-second ticks", 0, 1_000, 31_536_000_123, 31_536_001_000),
        ];
        for (case, due, interval, now, want) in cases {
            let interval = if interval == 0 {
                Duration::from_micros(500)
            } else {
                Duration::from_millis(interval)
            };
            let got = next_tick(Timestamp(due), interval, Timestamp(now));
            assert_eq!(got, Timestamp(want), "{case}");
            let mut t = row(TimerKind::Every, None, None, 1);
            t.spec.interval = interval;
            t.next_fire_at = Timestamp(due);
            let fired = fire(&t, Timestamp(now)).next.expect("an every timer stays");
            assert_eq!(fired.next_fire_at, Timestamp(want), "fire: {case}");
            assert_eq!(hold(&t, Timestamp(now)).next_fire_at, Timestamp(want), "hold: {case}");
        }
        // Many late sweeps in a row: each tick stays on the grid, none drifts.
        let mut t = row(TimerKind::Every, None, None, 0);
        for n in 1..=50_i64 {
            let late = 1 + (n * 37) % 120;
            let next = fire(&t, t.next_fire_at.plus(Duration::from_millis(late as u64)));
            t = next.next.expect("an every timer stays");
            assert_eq!(t.next_fire_at, Timestamp(10_000 * (n + 1)), "tick {n}");
        }
    }

    /// A held `every` timer that never fired moves to the deployed interval from its last
    /// held tick, not from the state entry it held past.
    #[test]
    fn retime_of_a_held_every_timer_counts_from_its_last_held_tick() {
        let mut t = row(TimerKind::Every, None, None, 0);
        for now in [10_000, 20_000, 30_000, 40_000, 50_000] {
            t = hold(&t, Timestamp(now));
        }
        assert_eq!(t.next_fire_at, Timestamp(60_000));
        let deployed = |secs| TimerArm { interval: Duration::from_secs(secs), ..t.spec.clone() };
        let slower = retime(&t, &[deployed(20)]).expect("changed");
        assert_eq!(slower.next.next_fire_at, Timestamp(70_000), "from the held tick at 50s");
        let faster = retime(&t, &[deployed(4)]).expect("changed");
        assert_eq!(faster.next.next_fire_at, Timestamp(54_000));
        // Never armed-and-held: the state entry is still the anchor.
        let fresh = row(TimerKind::Every, None, None, 0);
        let r = retime(&fresh, &[deployed(20)]).expect("changed");
        assert_eq!(r.next.next_fire_at, Timestamp(20_000), "from the state entry");
        // An `after` timer always counts from the state entry.
        let after = row(TimerKind::After, None, None, 0);
        let r =
            retime(&after, &[TimerArm { interval: Duration::from_secs(3), ..after.spec.clone() }]);
        assert_eq!(r.expect("changed").next.next_fire_at, Timestamp(3_000));
    }

    /// (case, backlog, overdue ms, cadence ms) → what the sweep does; threshold 10.
    #[test]
    fn backpressure_only_delays() {
        use Backpressure::{OneBatch, Skip, Sweep};
        let cases = [
            ("at the threshold", 10, None, 60_000, Sweep),
            ("below, overdue", 3, Some(999_999), 60_000, Sweep),
            ("above, nothing due", 11, None, 60_000, Skip),
            ("above, just due", 11, Some(0), 60_000, Skip),
            ("above, overdue by the cadence", 11, Some(60_000), 60_000, Skip),
            ("above, overdue past the cadence", 11, Some(60_001), 60_000, OneBatch),
            ("above, a day overdue", u64::MAX, Some(86_400_000), 60_000, OneBatch),
        ];
        for (case, backlog, overdue, cadence, want) in cases {
            let overdue = overdue.map(Duration::from_millis);
            let got = backpressure(backlog, 10, overdue, Duration::from_millis(cadence));
            assert_eq!(got, want, "{case}");
        }
        assert_eq!(overdue_by(Timestamp(5_000), Timestamp(4_999)), None, "not due yet");
        assert_eq!(overdue_by(Timestamp(5_000), Timestamp(5_000)), Some(Duration::ZERO));
        assert_eq!(overdue_by(Timestamp(5_000), Timestamp(65_000)), Some(Duration::from_secs(60)));
        let far = overdue_by(Timestamp(i64::MIN), Timestamp(i64::MAX));
        assert_eq!(far, Some(Duration::from_millis(u64::MAX)), "no overflow");
    }

    #[test]
    fn arming_and_ownership() {
        let t = row(TimerKind::After, None, None, 0);
        assert_eq!(t.next_fire_at, Timestamp(10_000), "due one interval after the state entry");
        assert!(owned_by("processing.payment", "processing"));
        assert!(owned_by("processing", "processing"));
        assert!(!owned_by("processing_extra", "processing"));
        assert!(!owned_by("processing", "processing.payment"));
    }

    #[test]
    fn hints_are_read_per_cursor_with_gaps_and_overflow() {
        let mut h = TimerHints::default();
        assert_eq!(h.since(0), None, "nothing armed yet");
        h.push(Timestamp(50));
        h.push(Timestamp(20));
        assert_eq!(h.since(0), Some(TimerHint { cursor: 2, due: Some(Timestamp(20)) }));
        assert_eq!(h.since(1), Some(TimerHint { cursor: 2, due: Some(Timestamp(20)) }));
        assert_eq!(h.since(2), None, "a reader that saw everything waits");
        h.push_gap();
        h.push(Timestamp(5));
        assert_eq!(h.since(2), Some(TimerHint { cursor: 4, due: None }), "a gap: re-read");
        assert_eq!(h.since(3), Some(TimerHint { cursor: 4, due: Some(Timestamp(5)) }));
        assert_eq!(h.since(9), Some(TimerHint { cursor: 4, due: None }), "a foreign cursor");
        for n in 0..limits::TIMER_HINTS_MAX {
            h.push(Timestamp(1_000 + n as i64));
        }
        let last = h.last();
        assert_eq!(h.since(4).map(|x| x.due), Some(Some(Timestamp(1_000))), "all still held");
        h.push(Timestamp(7));
        assert_eq!(h.since(4), Some(TimerHint { cursor: last + 1, due: None }), "overflowed");
        assert_eq!(h.since(last).map(|x| x.due), Some(Some(Timestamp(7))));
    }

    #[test]
    fn armed_due_is_the_earliest_arm_of_the_batch() {
        use crate::ids::FencingToken;
        use crate::outcome::Outcome;
        let spec = |secs| TimerArm {
            state: "s".into(),
            event: "E".into(),
            kind: TimerKind::After,
            interval: Duration::from_secs(secs),
            max: None,
            then: None,
        };
        let park = || Outcome::Done { result: json!(null), step: None };
        let mut a = StepCommit::new(InstanceId(1), FencingToken(1), park());
        a.timers_arm = vec![spec(30), spec(10)];
        let mut b = StepCommit::new(InstanceId(2), FencingToken(1), park());
        b.timers_arm = vec![spec(5)];
        let none = StepCommit::new(InstanceId(3), FencingToken(1), park());
        assert_eq!(armed_due([&a, &b, &none], Timestamp(1_000)), Some(Timestamp(6_000)));
        assert_eq!(armed_due([&none], Timestamp(1_000)), None);
    }

    #[test]
    fn retime_follows_the_deployed_duration_from_the_original_anchor() {
        let day = Duration::from_secs(86_400);
        let mut week = row(TimerKind::After, None, None, 0);
        week.spec.interval = day * 7;
        week.next_fire_at = Timestamp(0).plus(day * 7);
        let deployed = |interval| TimerArm { interval, ..week.spec.clone() };
        let r = retime(&week, &[deployed(day)]).expect("shortened");
        assert_eq!(r.next.next_fire_at, Timestamp(0).plus(day), "from the state entry");
        assert_eq!(r.next.spec.interval, day);
        assert_eq!(r.history.kind, "TIMER_RETIMED");
        assert_eq!(r.history.data["to_ms"], json!(86_400_000));
        assert_eq!(retime(&week, &[deployed(day * 7)]), None, "unchanged");
        assert_eq!(retime(&r.next, &[deployed(day)]), None, "a second pass does nothing");
        let other = TimerArm { event: "OTHER".into(), ..deployed(day) };
        assert_eq!(retime(&week, &[other]), None, "another timer of the state");

        // An `every` timer that fired twice counts from its last fire.
        let every = row(TimerKind::Every, None, None, 2);
        let every = TimerRow { next_fire_at: Timestamp(30_000), ..every };
        let faster = TimerArm { interval: Duration::from_secs(4), ..every.spec.clone() };
        let r = retime(&every, &[faster]).expect("changed");
        assert_eq!(r.next.next_fire_at, Timestamp(24_000));
        assert_eq!(r.next.fire_count, 2);
    }

    /// (case, deployed list) → the targets a store binds; and for every armed timer, a
    /// target of its state, event and kind with another interval exists exactly when
    /// `retime` moves it.
    #[test]
    fn retime_targets_are_exactly_what_retime_matches() {
        type Case = (&'static str, Vec<TimerArm>, Vec<TimerArm>);
        let arm = |event: &str, kind, secs| TimerArm {
            state: "awaiting".into(),
            event: event.into(),
            kind,
            interval: Duration::from_secs(secs),
            max: None,
            then: None,
        };
        let (after, every) = (TimerKind::After, TimerKind::Every);
        let cases: Vec<Case> = vec![
            ("empty", vec![], vec![]),
            (
                "distinct timers all stay",
                vec![arm("A", after, 10), arm("B", after, 5), arm("A", every, 7)],
                vec![arm("A", after, 10), arm("B", after, 5), arm("A", every, 7)],
            ),
            (
                "a duplicate keeps its first entry",
                vec![arm("A", after, 10), arm("A", after, 20), arm("B", after, 5)],
                vec![arm("A", after, 10), arm("B", after, 5)],
            ),
            ("a zero interval is dropped", vec![arm("A", after, 0)], vec![]),
            (
                "a zero first entry hides a later duplicate",
                vec![arm("A", after, 0), arm("A", after, 20), arm("B", after, 5)],
                vec![arm("B", after, 5)],
            ),
        ];
        for (case, deployed, want) in cases {
            let targets = retime_targets(&deployed);
            assert_eq!(targets, want, "{case}");
            for kind in [after, every] {
                for event in ["A", "B", "C"] {
                    for secs in [0, 5, 7, 10, 20] {
                        let mut t = row(kind, None, None, 0);
                        t.spec = arm(event, kind, secs);
                        let may_move = targets
                            .iter()
                            .any(|d| follows(d, &t.spec) && d.interval != t.spec.interval);
                        assert_eq!(
                            retime(&t, &deployed).is_some(),
                            may_move,
                            "{case}: {event} {kind:?} {secs}s"
                        );
                    }
                }
            }
        }
    }
}
