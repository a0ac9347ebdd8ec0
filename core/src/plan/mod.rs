//! Planners: the whole decision of each store operation, as pure functions.
//!
//! A store operation has three parts: read what the decision depends on, decide, and write
//! the decision down. Only the middle part is semantics, and it lives here, once. Each
//! planner takes a typed *read set* (the rows, inbox entries and key occupants a store
//! read, locked where the store locks), the operation's params and `now`, and returns a
//! typed *plan*: the writes to perform, or a refusal. A store reads the read set in
//! whatever way suits it (one batched statement on PostgreSQL, one lookup at a time in
//! memory), calls the planner, and executes the plan without deciding anything itself.
//!
//! Ids a store assigns while it writes (signal and instance ids) are not known to a
//! planner: a plan refers to the rows it inserts by their index in its insert list, and
//! the plan turns that into the caller's result once the store knows the ids.

pub mod cancel;
pub mod claim;
pub mod commit;
pub mod dead_letter;
pub mod deliver;
pub mod hints;
pub mod history;
pub mod insert;
pub mod lease;
pub mod migrate;
pub mod parent;
pub mod prune;
pub mod timer;

use crate::instance::{HistoryEntry, Instance};

/// A row a plan writes, in its new state, with the history entries the change records (in
/// order, at the row's new revision, each marked with `attempt`: the attempt the instance
/// was in when the change happened).
#[derive(Debug, Clone, PartialEq)]
pub struct RowWrite {
    /// The row after the change.
    pub row: Instance,
    /// The attempt the history entries belong to.
    pub attempt: i32,
    /// The history to append.
    pub history: Vec<HistoryEntry>,
}
