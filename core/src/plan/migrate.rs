//! `instance_migrate`: one page of a chart version migration.
//!
//! The read set is the page's rows, locked, each with its timers. Every row is planned by
//! [`Migration::plan`](crate::chart::Migration::plan); the plan is the report of each item
//! and, unless the page is a dry run, the moves to write: each row at its new version,
//! position, context and revision, its history entry, and its whole new set of timers.

use crate::chart::migrate::Move;
use crate::instance::Instance;
use crate::plan::RowWrite;
use crate::ports::store::{MigrateItem, MigrateMoved, MigrateParams};
use crate::timers::TimerRow;

/// The writes of one migration page and its report.
#[derive(Debug, Clone, PartialEq)]
pub struct MigratePlan {
    /// The report, one item per row read.
    pub items: Vec<MigrateItem>,
    /// The rows to write (none in a dry run).
    pub rows: Vec<RowWrite>,
    /// Per written row, in the same order: the timers that replace all its timers.
    pub timers: Vec<Vec<TimerRow>>,
}

/// Plans a page: `read` is the page's rows (in id order) with their timers.
pub fn page(p: &MigrateParams, read: Vec<(Instance, Vec<TimerRow>)>) -> MigratePlan {
    let mut plan = MigratePlan { items: Vec::new(), rows: Vec::new(), timers: Vec::new() };
    for (row, timers) in read {
        let outcome = p.migration.plan(&row, &timers, p.now);
        let report = outcome.as_ref().map(|m: &Move| MigrateMoved {
            new: m.row.position.clone(),
            kept: m.kept,
            dropped: m.dropped,
            armed: m.armed,
        });
        plan.items.push(MigrateItem {
            id: row.id,
            old: row.position.clone(),
            outcome: report.map_err(Clone::clone),
        });
        if let (Ok(m), false) = (outcome, p.dry_run) {
            plan.rows.push(RowWrite { attempt: row.attempt, history: vec![m.history], row: m.row });
            plan.timers.push(m.timers);
        }
    }
    plan
}
