//! The rule for every row `keel serve` reads by id — in the API and in the dashboard
//! alike: a row answers only under the URL of its own namespace. Another namespace's row
//! is reported exactly like a missing one, so a token scoped to one namespace cannot
//! learn that an id exists in another. Each caller keeps its own form of "not found"
//! (the API's JSON 404, the dashboard's page).
//!
//! The same holds for the rows an instance's detail carries: a parent may have children
//! in other namespaces, and those are left out for a caller that does not see them.

use std::collections::{BTreeMap, HashSet};

use keel::{AnyStore, ErrorKind, StoreError};
use keel_core::ids::InstanceId;
use keel_core::instance::{DeadLetter, Instance};
use keel_core::limits::ROWS_BATCH_MAX;
use keel_core::ports::Store;
use keel_core::ports::store::InstanceDetail;

/// A row that belongs to one namespace.
pub trait Namespaced {
    /// The namespace it belongs to.
    fn namespace(&self) -> &str;
}

impl Namespaced for Instance {
    fn namespace(&self) -> &str {
        &self.namespace
    }
}

impl Namespaced for InstanceDetail {
    fn namespace(&self) -> &str {
        &self.instance.namespace
    }
}

impl Namespaced for DeadLetter {
    fn namespace(&self) -> &str {
        &self.letter.namespace
    }
}

/// A read by id seen from namespace `ns`: `Some` when the row exists there, `None` when
/// it is missing or in another namespace (both answer "not found"); a store failure
/// stays an error.
pub fn in_namespace<T: Namespaced>(
    read: Result<T, StoreError>,
    ns: &str,
) -> Result<Option<T>, StoreError> {
    match read {
        Ok(row) if row.namespace() == ns => Ok(Some(row)),
        Ok(_) => Ok(None),
        Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`in_namespace`] for a batch read of rows by id (`Store::instance_rows`), which
/// leaves a missing id out rather than failing.
pub fn row_in_namespace(
    read: Result<Vec<Instance>, StoreError>,
    id: InstanceId,
    ns: &str,
) -> Result<Option<Instance>, StoreError> {
    let found = read.map(|rows| rows.into_iter().find(|row| row.id == id));
    in_namespace(
        found.and_then(|row| row.ok_or_else(|| StoreError::not_found(format!("instance {id}")))),
        ns,
    )
}

/// The rows of `ids` split by `sees`: the ids of those in a namespace it allows, and the
/// rows of those outside it. The rows are read by id in batches; an id whose row is gone
/// by then is in neither.
pub async fn split_by_namespace(
    store: &AnyStore,
    ids: &[InstanceId],
    sees: impl Fn(&str) -> bool,
) -> Result<(HashSet<InstanceId>, Vec<Instance>), StoreError> {
    let (mut seen, mut unseen) = (HashSet::new(), Vec::new());
    for row in rows_of(store, ids).await? {
        if sees(&row.namespace) {
            seen.insert(row.id);
        } else {
            unseen.push(row);
        }
    }
    Ok((seen, unseen))
}

/// The rows of `ids` that exist, read by id in batches.
async fn rows_of(store: &AnyStore, ids: &[InstanceId]) -> Result<Vec<Instance>, StoreError> {
    let mut rows = Vec::with_capacity(ids.len());
    for batch in ids.chunks(ROWS_BATCH_MAX) {
        rows.extend(store.instance_rows(batch.to_vec()).await?);
    }
    Ok(rows)
}

/// Leaves out of `detail.children` every child in a namespace `sees` refuses, and returns
/// how many were left out. A child whose row is gone by the time it is read is left out
/// too, as it could not be shown anyway.
pub async fn hide_unseen_children(
    store: &AnyStore,
    detail: &mut InstanceDetail,
    sees: impl Fn(&str) -> bool,
) -> Result<usize, StoreError> {
    let ids: Vec<InstanceId> = detail.children.iter().map(|c| c.id).collect();
    let homes = namespaces_of(store, &ids).await?;
    Ok(hide_children(detail, &homes, sees))
}

/// [`hide_unseen_children`] over namespaces already read ([`namespaces_of`]): a child is
/// kept when its row was found in a namespace `sees` allows.
pub fn hide_children(
    detail: &mut InstanceDetail,
    homes: &BTreeMap<InstanceId, String>,
    sees: impl Fn(&str) -> bool,
) -> usize {
    let before = detail.children.len();
    detail.children.retain(|c| homes.get(&c.id).is_some_and(|home| sees(home)));
    before - detail.children.len()
}

/// The namespace of each of `ids` whose row exists, read by id in batches.
pub async fn namespaces_of(
    store: &AnyStore,
    ids: &[InstanceId],
) -> Result<BTreeMap<InstanceId, String>, StoreError> {
    Ok(rows_of(store, ids).await?.into_iter().map(|row| (row.id, row.namespace)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::{MachineRef, NewInstance};

    fn instance(ns: &str) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start").namespace(ns);
        Instance::from_new(InstanceId(7), &new, None, keel_core::Timestamp(0))
    }

    #[test]
    fn a_row_answers_only_in_its_own_namespace() {
        assert!(in_namespace(Ok(instance("a")), "a").unwrap().is_some());
        assert!(in_namespace(Ok(instance("a")), "b").unwrap().is_none(), "another namespace");
        let missing: Result<Instance, _> = Err(StoreError::not_found("instance 7"));
        assert!(in_namespace(missing, "a").unwrap().is_none(), "missing");
        let down: Result<Instance, _> = Err(StoreError::unavailable("connection refused"));
        assert!(in_namespace(down, "a").is_err(), "a store failure is not a 404");
        let rows = || Ok(vec![instance("a")]);
        assert!(row_in_namespace(rows(), InstanceId(7), "a").unwrap().is_some());
        assert!(row_in_namespace(rows(), InstanceId(8), "a").unwrap().is_none());
        assert!(row_in_namespace(rows(), InstanceId(7), "b").unwrap().is_none());
    }
}
