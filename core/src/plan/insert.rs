//! Inserting instances under uniqueness.
//!
//! A new instance's unique key is in scope from the start (it is inserted runnable). An
//! item whose key is held by an existing instance, or by an earlier item of the same batch,
//! is not inserted: the caller gets the occupant's id instead. So the first item of a batch
//! wins, and inserting the same batch twice inserts nothing the second time.

use crate::ids::{InstanceId, Status};
use crate::instance::{NewInstance, unique_guard};
use crate::ports::store::InsertOutcome;
use std::collections::HashMap;

/// What a store read for a batch of inserts: the current occupant of each unique key the
/// batch names (keys nobody holds left out).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertRead {
    /// Occupant per unique key.
    pub occupants: HashMap<Vec<u8>, InstanceId>,
}

/// What becomes of one item of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertItem {
    /// Inserted as the `insert`-th new row of the plan.
    New {
        /// Index into [`InsertPlan::inserts`].
        insert: usize,
    },
    /// Its key is held by this existing instance.
    Existing(InstanceId),
    /// Its key is taken by the `insert`-th new row of this same batch.
    SameKeyAs {
        /// Index into [`InsertPlan::inserts`].
        insert: usize,
    },
}

/// The writes of a batch of inserts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertPlan {
    /// Per item of the batch, in order.
    pub items: Vec<InsertItem>,
    /// The batch indices of the items to insert, in the order their ids must increase.
    pub inserts: Vec<usize>,
}

impl InsertPlan {
    /// The caller's result, given the ids the store assigned to the inserts (one per
    /// insert, in order).
    ///
    /// # Panics
    /// When `ids` has fewer entries than the plan has inserts.
    pub fn outcomes(&self, ids: &[InstanceId]) -> Vec<InsertOutcome> {
        assert!(ids.len() >= self.inserts.len(), "one id per inserted instance");
        self.items
            .iter()
            .map(|item| match *item {
                InsertItem::New { insert } => InsertOutcome::Inserted(ids[insert]),
                InsertItem::Existing(id) => InsertOutcome::Existing(id),
                InsertItem::SameKeyAs { insert } => InsertOutcome::Existing(ids[insert]),
            })
            .collect()
    }
}

/// Plans inserting `instances` (already validated) given the key occupants in `read`.
pub fn insert(instances: &[NewInstance], read: InsertRead) -> InsertPlan {
    let mut taken: HashMap<Vec<u8>, InsertItem> =
        read.occupants.into_iter().map(|(k, id)| (k, InsertItem::Existing(id))).collect();
    let mut plan = InsertPlan::default();
    for (i, new) in instances.iter().enumerate() {
        let guard = unique_guard(new.unique.as_ref(), Status::Runnable);
        let holder = guard.and_then(|g| taken.get(g)).map(|held| match *held {
            InsertItem::New { insert } => InsertItem::SameKeyAs { insert },
            other => other,
        });
        if let Some(holder) = holder {
            plan.items.push(holder);
            continue;
        }
        let insert = plan.inserts.len();
        if let Some(g) = guard {
            taken.insert(g.to_vec(), InsertItem::New { insert });
        }
        plan.inserts.push(i);
        plan.items.push(InsertItem::New { insert });
    }
    plan
}

/// The unique keys in scope for a batch's new rows: what a store reads the occupants of.
pub fn keys(instances: &[NewInstance]) -> impl Iterator<Item = &[u8]> {
    instances.iter().filter_map(|n| unique_guard(n.unique.as_ref(), Status::Runnable))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{MachineRef, StatusSet};
    use crate::instance::UniqueSpec;

    fn new(key: Option<&str>, scope: &[Status]) -> NewInstance {
        let mut n = NewInstance::new(MachineRef::new("m", 1), "start");
        n.unique =
            key.map(|k| UniqueSpec { key: k.as_bytes().to_vec(), scope: StatusSet::of(scope) });
        n
    }

    #[test]
    fn the_first_holder_of_a_key_wins_in_the_store_and_in_the_batch() {
        let live = [Status::Runnable, Status::Executing];
        let batch = [
            new(Some("a"), &live),
            new(Some("b"), &live),
            new(None, &[]),
            new(Some("b"), &live),
            // Out of scope while runnable: the key does not hold yet.
            new(Some("a"), &[Status::Done]),
        ];
        let read = InsertRead { occupants: HashMap::from([(b"a".to_vec(), InstanceId(7))]) };
        let plan = insert(&batch, read);
        assert_eq!(plan.inserts, [1, 2, 4]);
        let ids = [InstanceId(20), InstanceId(21), InstanceId(22)];
        assert_eq!(
            plan.outcomes(&ids),
            [
                InsertOutcome::Existing(InstanceId(7)),
                InsertOutcome::Inserted(InstanceId(20)),
                InsertOutcome::Inserted(InstanceId(21)),
                InsertOutcome::Existing(InstanceId(20)),
                InsertOutcome::Inserted(InstanceId(22)),
            ]
        );
        assert_eq!(keys(&batch).collect::<Vec<_>>(), [b"a", b"b", b"b"]);
    }
}
