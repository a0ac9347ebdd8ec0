//! Identifiers and small values shared by every crate: ids, machine references,
//! [`Priority`], [`Status`] and the sets of statuses used by uniqueness scopes.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

macro_rules! int_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub i64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

int_id!(
    /// The id of one instance (one aggregate, one row). Assigned by the store.
    InstanceId,
    "i"
);
int_id!(
    /// The id of one inbox row. Ids increase in arrival order within a store.
    SignalId,
    "s"
);
int_id!(
    /// The id of one dead-letter record.
    DeadLetterId,
    "dl"
);
int_id!(
    /// The id of one armed timer.
    TimerId,
    "t"
);

/// A fencing token: increases on every claim of an instance. A commit names the token of
/// its claim; a commit whose token is not the instance's current one is rejected
/// (`LeaseLost`) and changes nothing.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct FencingToken(pub i64);

/// The number of committed changes to an instance row. Every accepted step commit adds
/// exactly one, so a step applied twice would be visible as a gap.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct Revision(pub i64);

/// The name of a worker process, used as the lease owner. A worker that restarts with
/// the same id reclaims what it held before it crashed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(pub String);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A machine definition's address: its name and version. Workers claim only the
/// `(name, version)` pairs they can run (their "compatibility family").
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MachineRef {
    /// The machine's name, e.g. `"order"`.
    pub name: String,
    /// The definition's version; running instances keep the version they started on.
    pub version: i32,
}

impl MachineRef {
    /// Builds a machine reference.
    pub fn new(name: impl Into<String>, version: i32) -> Self {
        MachineRef { name: name.into(), version }
    }
}

impl fmt::Display for MachineRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@v{}", self.name, self.version)
    }
}

/// The default namespace for instances that do not name one.
pub const DEFAULT_NAMESPACE: &str = "default";
/// The default queue for instances that do not name one.
pub const DEFAULT_QUEUE: &str = "default";

/// Scheduling priority. Lower runs first under the `priority` strategy.
/// Serialized as its lowercase name; parsing ignores case and lists the accepted names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    /// System emergencies, circuit breakers (0).
    Critical = 0,
    /// User-facing actions, payments (1).
    High = 1,
    /// Standard operations (2, the default).
    #[default]
    Normal = 2,
    /// Background tasks, analytics (3).
    Low = 3,
    /// Batch processing, reports (4).
    Bulk = 4,
}

impl Priority {
    /// Every priority, most urgent first.
    pub const ALL: [Priority; 5] =
        [Priority::Critical, Priority::High, Priority::Normal, Priority::Low, Priority::Bulk];

    /// The numeric level, 0 (critical) to 4 (bulk).
    pub const fn level(self) -> i16 {
        self as i16
    }

    /// The priority for a numeric level, if it is one.
    pub fn from_level(level: i16) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.level() == level)
    }

    /// The lowercase name used in configuration.
    pub const fn name(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
            Priority::Bulk => "bulk",
        }
    }
}

/// A value that is not the name of a [`Priority`] or [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown value {input:?}; accepted: {accepted}")]
pub struct UnknownName {
    /// What was being parsed (`priority`, `status`).
    pub what: &'static str,
    /// The input as given.
    pub input: String,
    /// The accepted names, comma separated.
    pub accepted: String,
}

impl FromStr for Priority {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|p| p.name() == s.trim().to_ascii_lowercase()).ok_or_else(|| {
            UnknownName {
                what: "priority",
                input: s.to_owned(),
                accepted: Self::ALL.map(Priority::name).join(", "),
            }
        })
    }
}

impl Serialize for Priority {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Priority {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an instance is in its life.
///
/// `runnable → executing → {runnable, awaiting_signal, awaiting_children, suspended, done,
/// failed}`; `cancelled` can be reached from any non-terminal status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Ready to be claimed once `eligible_at` has come.
    Runnable,
    /// Claimed by a worker under a lease.
    Executing,
    /// Parked until a signal with the awaited name arrives.
    AwaitingSignal,
    /// Parked until every child it spawned is terminal.
    AwaitingChildren,
    /// Retries exhausted; the failing step or event is in the dead-letter queue and the
    /// instance waits for an operator. Not terminal.
    Suspended,
    /// Terminal: finished with a result.
    Done,
    /// Terminal: stopped with an error.
    Failed,
    /// Terminal: cancelled by an operator or a cascading cancel.
    Cancelled,
}

impl Status {
    /// Every status, in declaration order.
    pub const ALL: [Status; 8] = [
        Status::Runnable,
        Status::Executing,
        Status::AwaitingSignal,
        Status::AwaitingChildren,
        Status::Suspended,
        Status::Done,
        Status::Failed,
        Status::Cancelled,
    ];

    /// `done`, `failed` and `cancelled` are terminal: nothing moves an instance out of them.
    pub const fn is_terminal(self) -> bool {
        matches!(self, Status::Done | Status::Failed | Status::Cancelled)
    }

    /// The snake_case name used in SQL, JSON and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            Status::Runnable => "runnable",
            Status::Executing => "executing",
            Status::AwaitingSignal => "awaiting_signal",
            Status::AwaitingChildren => "awaiting_children",
            Status::Suspended => "suspended",
            Status::Done => "done",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    const fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

impl FromStr for Status {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|st| st.name() == s.trim()).ok_or_else(|| UnknownName {
            what: "status",
            input: s.to_owned(),
            accepted: Self::ALL.map(Status::name).join(", "),
        })
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of statuses, e.g. a uniqueness scope: the statuses in which a unique key is
/// "occupied".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StatusSet(u16);

impl StatusSet {
    /// The empty set.
    pub const EMPTY: StatusSet = StatusSet(0);

    /// Every non-terminal status: the usual "one live instance per key" scope.
    pub const LIVE: StatusSet = StatusSet(
        Status::Runnable.bit()
            | Status::Executing.bit()
            | Status::AwaitingSignal.bit()
            | Status::AwaitingChildren.bit()
            | Status::Suspended.bit(),
    );

    /// Every status: the key is never released.
    pub const ALL: StatusSet = StatusSet(0xff);

    /// Builds a set from statuses.
    pub fn of(statuses: &[Status]) -> Self {
        StatusSet(statuses.iter().fold(0, |acc, s| acc | s.bit()))
    }

    /// Whether `status` is in the set.
    pub const fn contains(self, status: Status) -> bool {
        self.0 & status.bit() != 0
    }

    /// The statuses in the set, in declaration order.
    pub fn to_vec(self) -> Vec<Status> {
        Status::ALL.into_iter().filter(|s| self.contains(*s)).collect()
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl Serialize for StatusSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_vec().serialize(s)
    }
}

impl<'de> Deserialize<'de> for StatusSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(StatusSet::of(&Vec::<Status>::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_names_round_trip_and_bad_names_list_accepted_values() {
        for p in Priority::ALL {
            assert_eq!(p.name().parse::<Priority>(), Ok(p));
            assert_eq!(Priority::from_level(p.level()), Some(p));
        }
        assert_eq!(" HIGH ".parse::<Priority>(), Ok(Priority::High));
        let err = "urgent".parse::<Priority>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"unknown value "urgent"; accepted: critical, high, normal, low, bulk"#
        );
        assert!(Priority::Critical < Priority::Bulk);
        assert_eq!(Priority::default(), Priority::Normal);
    }

    #[test]
    fn status_sets() {
        for s in Status::ALL {
            assert_eq!(s.name().parse::<Status>(), Ok(s));
            assert_eq!(StatusSet::LIVE.contains(s), !s.is_terminal());
            assert!(StatusSet::ALL.contains(s));
            assert!(!StatusSet::EMPTY.contains(s));
        }
        let set = StatusSet::of(&[Status::Runnable, Status::Done]);
        assert_eq!(set.to_vec(), vec![Status::Runnable, Status::Done]);
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(json, r#"["runnable","done"]"#);
        assert_eq!(serde_json::from_str::<StatusSet>(&json).unwrap(), set);
    }
}
