//! Join policies: when a parent that scheduled children wakes, and what becomes of the
//! children still running then.
//!
//! By default a parent waits for **all** of its children to end ([`Join::all`]). A
//! [`Join::quorum`] wakes it once `k` of its `n` children have succeeded (or as soon as
//! enough have failed that `k` can no longer be reached); a deadline
//! ([`Join::within`]) wakes it when the time runs out, with whatever has finished. Either
//! way the parent wakes exactly once per barrier, and the children still running then are
//! cancelled (with their descendants) in the same transaction, or left running
//! ([`Join::leave_running`]): their later ends are not counted on anything.
//!
//! A non-default join keeps its bookkeeping in the parent's context under the reserved key
//! [`JOIN_KEY`] ([`JoinState`]); the rules that read and change it are in
//! [`crate::plan::parent`]. The step the parent wakes into can read there why it woke.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::join::Join;
//!
//! // Wake when 3 children succeeded, or after 10 minutes, whichever comes first; the
//! // children still running then are cancelled.
//! let join = Join::quorum(3).within(Duration::from_secs(600));
//! assert_eq!(join.quorum, Some(3));
//! assert!(!join.is_all());
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{StoreError, StoreResult};
use crate::ids::InstanceId;
use crate::limits;
use crate::names::name_enum;
use crate::time::Timestamp;

/// The context key a non-default join's bookkeeping lives under. Reserved: a step may read
/// it, and the engine keeps it when a step's new context leaves it out.
pub const JOIN_KEY: &str = "@join";

/// The timer owner (a name no state has) of a join's deadline timer.
pub const DEADLINE_OWNER: &str = "@join";

/// The event name of a join's deadline timer. The timer sweep never delivers it: it wakes
/// the parent through [`crate::plan::parent::expire`] instead.
pub const DEADLINE_EVENT: &str = "@join.deadline";

name_enum! {
    /// What becomes of the children still running when a parent wakes before all of them
    /// ended (a quorum reached, or a deadline passed).
    #[derive(Default)]
    pub enum JoinRest {
        /// Cancel them, with their descendants, in the transaction that wakes the parent.
        #[default]
        Cancel = "cancel",
        /// Let them run on; their ends are not counted on the parent any more.
        Leave = "leave",
    }
}

/// When a parent waiting on the children of a `ScheduleChildren` wakes (see the module
/// docs). The default waits for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Join {
    /// Wake once this many children succeeded (`done`); `None` waits for all to end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quorum: Option<u32>,
    /// Wake at the latest this long after the commit that scheduled the children.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_ms")]
    pub within: Option<Duration>,
    /// What becomes of the children still running when the parent wakes early.
    #[serde(default, skip_serializing_if = "JoinRest::is_cancel")]
    pub rest: JoinRest,
}

impl JoinRest {
    /// Whether the rest is cancelled (the default, left out of the JSON form).
    #[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
    fn is_cancel(&self) -> bool {
        *self == JoinRest::Cancel
    }
}

impl Join {
    /// Wait for every child to end (succeeded, failed or cancelled): the default.
    pub fn all() -> Self {
        Join::default()
    }

    /// Wake once `k` children succeeded, or once enough failed that `k` cannot be reached
    /// any more; the children still running then are cancelled unless
    /// [`leave_running`](Self::leave_running) is set.
    pub fn quorum(k: u32) -> Self {
        Join { quorum: Some(k), ..Join::default() }
    }

    /// Wake at the latest `deadline` after the scheduling commit, with whatever has
    /// finished by then.
    #[must_use]
    pub fn within(mut self, deadline: Duration) -> Self {
        self.within = Some(deadline);
        self
    }

    /// Let the children still running when the parent wakes early run on, instead of
    /// cancelling them.
    #[must_use]
    pub fn leave_running(mut self) -> Self {
        self.rest = JoinRest::Leave;
        self
    }

    /// Whether this is the default join (all children, no deadline).
    pub fn is_all(&self) -> bool {
        self.quorum.is_none() && self.within.is_none()
    }

    /// Checks the policy against the number of children scheduled; errors name the field
    /// under `field` (e.g. `outcome.join`) and say how to fix it.
    pub fn validate(&self, field: &str, children: usize) -> StoreResult<()> {
        if let Some(k) = self.quorum {
            if k == 0 {
                return Err(StoreError::invalid(format!(
                    "{field}.quorum: must be at least 1; to wake without waiting for any child, do not schedule children"
                )));
            }
            if k as usize > children {
                return Err(StoreError::invalid(format!(
                    "{field}.quorum: {k} is more than the {children} children scheduled; a quorum can be at most the number of children"
                )));
            }
        }
        if let Some(within) = self.within {
            if within.is_zero() {
                return Err(StoreError::invalid(format!(
                    "{field}.within: must be positive (a deadline after the scheduling commit), e.g. 30 seconds"
                )));
            }
            if within > limits::TIMER_INTERVAL_MAX {
                return Err(StoreError::invalid(format!(
                    "{field}.within: {} s is longer than the limit of {} s (ten years); use a shorter deadline",
                    within.as_secs(),
                    limits::TIMER_INTERVAL_MAX.as_secs()
                )));
            }
        }
        Ok(())
    }
}

/// Why a parent woke from its barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinWoke {
    /// Every child ended.
    All,
    /// The quorum of successes was reached.
    Quorum,
    /// Enough children failed or were cancelled that the quorum cannot be reached.
    Unreachable,
    /// The deadline passed.
    Deadline,
}

/// The bookkeeping of a non-default join, kept in the parent's context under
/// [`JOIN_KEY`]. Only the children in `pending` count: a child counts once (it leaves the
/// list), and a child of an earlier barrier, or one started outside the barrier, never
/// counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinState {
    /// Successes that wake the parent; `None`: all children.
    #[serde(default)]
    pub quorum: Option<u32>,
    /// When the parent wakes at the latest.
    #[serde(default)]
    pub deadline: Option<Timestamp>,
    /// What becomes of the children still running when the parent wakes early.
    #[serde(default)]
    pub rest: JoinRest,
    /// The barrier's children that have not ended yet.
    #[serde(default)]
    pub pending: Vec<InstanceId>,
    /// How many of the barrier's children ended.
    #[serde(default)]
    pub ended: u32,
    /// How many of them succeeded.
    #[serde(default)]
    pub succeeded: u32,
    /// Why the parent woke; `None` while it still waits.
    #[serde(default)]
    pub woke: Option<JoinWoke>,
    /// When the parent woke early: how many children were still running (and were then
    /// cancelled, or left running).
    #[serde(default)]
    pub unfinished: u32,
}

impl JoinState {
    /// The state of a barrier just scheduled with `join` over the children `pending`,
    /// committed at `now`.
    pub fn start(join: &Join, pending: Vec<InstanceId>, now: Timestamp) -> Self {
        JoinState {
            quorum: join.quorum,
            deadline: join.within.map(|d| now.plus(d)),
            rest: join.rest,
            pending,
            ended: 0,
            succeeded: 0,
            woke: None,
            unfinished: 0,
        }
    }

    /// The state kept in `context`, if any. A value that does not read back as a join
    /// state counts as none.
    pub fn of(context: &Value) -> Option<Self> {
        context.get(JOIN_KEY).and_then(|v| serde_json::from_value(v.clone()).ok())
    }

    /// Writes the state into `context` (an object).
    pub fn store(&self, context: &mut Value) {
        if let Some(map) = context.as_object_mut() {
            map.insert(JOIN_KEY.to_owned(), serde_json::to_value(self).unwrap_or(Value::Null));
        }
    }

    /// Whether the parent still waits on this barrier.
    pub fn open(&self) -> bool {
        self.woke.is_none()
    }

    /// Why the parent should wake now, from the counts alone (not the deadline).
    pub fn settled(&self) -> Option<JoinWoke> {
        let live = u32::try_from(self.pending.len()).unwrap_or(u32::MAX);
        if let Some(k) = self.quorum {
            if self.succeeded >= k {
                return Some(JoinWoke::Quorum);
            }
            if self.succeeded.saturating_add(live) < k {
                return Some(JoinWoke::Unreachable);
            }
        }
        (live == 0).then_some(JoinWoke::All)
    }
}

mod opt_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    #[allow(clippy::ref_option)]
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bad_policies_name_the_field_and_the_fix() {
        let cases: &[(Join, usize, Option<&str>)] = &[
            (Join::all(), 0, None),
            (Join::quorum(3), 5, None),
            (Join::quorum(5), 5, None),
            (Join::quorum(0), 5, Some("outcome.join.quorum: must be at least 1")),
            (
                Join::quorum(6),
                5,
                Some("outcome.join.quorum: 6 is more than the 5 children scheduled"),
            ),
            (Join::all().within(Duration::ZERO), 2, Some("outcome.join.within: must be positive")),
            (
                Join::all().within(limits::TIMER_INTERVAL_MAX + Duration::from_secs(1)),
                2,
                Some("outcome.join.within: 316224001 s is longer than the limit"),
            ),
        ];
        for (join, n, expected) in cases {
            let got = join.validate("outcome.join", *n).map_err(|e| e.message);
            match expected {
                None => assert!(got.is_ok(), "{join:?}: {got:?}"),
                Some(prefix) => {
                    let message = got.expect_err("refused");
                    assert!(message.starts_with(prefix), "{join:?}: {message}");
                }
            }
        }
    }

    #[test]
    fn policies_travel_as_json_with_readable_defaults() {
        let join = Join::quorum(2).within(Duration::from_secs(5)).leave_running();
        let value = serde_json::to_value(join).unwrap();
        assert_eq!(value, json!({ "quorum": 2, "within": 5000, "rest": "leave" }));
        assert_eq!(serde_json::from_value::<Join>(value).unwrap(), join);
        assert_eq!(serde_json::to_value(Join::all()).unwrap(), json!({}));
        assert_eq!(serde_json::from_value::<Join>(json!({})).unwrap(), Join::all());
    }

    #[test]
    fn a_state_settles_by_quorum_unreachability_or_all_ended() {
        let ids = |n: i64| (1..=n).map(InstanceId).collect::<Vec<_>>();
        let mut s = JoinState::start(&Join::quorum(3), ids(5), Timestamp(0));
        assert_eq!(s.settled(), None);
        s.pending.truncate(3);
        s.ended = 2;
        s.succeeded = 2;
        assert_eq!(s.settled(), None);
        s.pending.truncate(2);
        s.ended = 3;
        s.succeeded = 3;
        assert_eq!(s.settled(), Some(JoinWoke::Quorum));
        let mut s = JoinState::start(&Join::quorum(3), ids(5), Timestamp(0));
        s.pending.truncate(2);
        s.ended = 3;
        assert_eq!(s.settled(), Some(JoinWoke::Unreachable), "0 + 2 live < 3");
        let mut s =
            JoinState::start(&Join::all().within(Duration::from_secs(1)), ids(1), Timestamp(0));
        assert_eq!(s.deadline, Some(Timestamp(1_000)));
        s.pending.clear();
        assert_eq!(s.settled(), Some(JoinWoke::All));
        let mut context = json!({ "a": 1 });
        s.store(&mut context);
        assert_eq!(JoinState::of(&context), Some(s));
        assert_eq!(JoinState::of(&json!({})), None);
    }
}
