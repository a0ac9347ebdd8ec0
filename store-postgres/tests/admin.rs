//! Migrations under a least-privilege role and behind another migration, and the cascade
//! of a cancel: children started while it waited, and the cut at its bound.

mod common;

use keel_core::instance::NewInstance;
use keel_core::ports::Store;
use keel_core::ports::store::{CancelParams, InsertParams};
use keel_core::{InstanceId, MachineRef, Status, Timestamp, limits};
use keel_store_postgres::{PgConfig, PgStore};
use std::collections::HashSet;
use std::time::Duration;

const T0: Timestamp = Timestamp(1_700_000_000_000);

async fn insert_root(s: &PgStore) -> InstanceId {
    s.instance_insert(InsertParams {
        instances: vec![NewInstance::new(MachineRef::new("m", 1), "p")],
        now: T0,
    })
    .await
    .unwrap()[0]
        .id()
}

/// `n` copies of instance `like` under `parent`, in one statement; their ids, ascending.
async fn children(c: &deadpool_postgres::Client, like: i64, parent: i64, n: i64) -> Vec<i64> {
    c.query(
        "INSERT INTO instances (namespace, machine, machine_version, queue, priority, position, \
         context, eligible_at, created_at, updated_at, base_priority, parent_id) \
         SELECT namespace, machine, machine_version, queue, priority, position, context, \
         eligible_at, created_at, updated_at, base_priority, $2 \
         FROM instances, generate_series(1, $3::int8) WHERE id = $1 RETURNING id",
        &[&like, &parent, &n],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<_, i64>(0))
    .collect::<std::collections::BTreeSet<i64>>()
    .into_iter()
    .collect()
}

fn cancel(id: InstanceId) -> CancelParams {
    CancelParams { id, reason: "stop".into(), cascade: true, now: T0, only_in: None }
}

/// A role that owns its (existing) schema but has no CREATE privilege on the database
/// migrates it, and migrates it again with nothing to do.
#[tokio::test]
async fn a_role_owning_its_schema_migrates_without_create_on_the_database() {
    let Some(url) = common::database_url() else { return };
    let Some(admin) = common::store().await else { return };
    let schema = common::fresh_schema();
    let role = format!("{schema}_r");
    let c = admin.client().await.unwrap();
    c.batch_execute(&format!(
        "CREATE ROLE \"{role}\" LOGIN; CREATE SCHEMA \"{schema}\" AUTHORIZATION \"{role}\""
    ))
    .await
    .unwrap();
    let can_create: bool = c
        .query_one("SELECT has_database_privilege($1, current_database(), 'CREATE')", &[&role])
        .await
        .unwrap()
        .get(0);
    let sep = if url.contains('?') { '&' } else { '?' };
    let cfg = PgConfig::new(format!("{url}{sep}user={role}")).schema(schema.clone()).pool_size(1);
    let runs = async {
        let store = PgStore::connect(cfg).await?;
        store.migrate().await?;
        store.migrate().await?;
        store.check_migrated().await
    }
    .await;
    // Cleaned up before asserting, so a failure leaves no role behind.
    c.batch_execute(&format!("DROP OWNED BY \"{role}\" CASCADE; DROP ROLE \"{role}\""))
        .await
        .unwrap();
    assert!(!can_create, "the test role must lack CREATE on the database");
    runs.unwrap();
}

/// A migration that finds another holding the schema's lock waits for it, then runs.
#[tokio::test]
async fn a_migration_waits_for_one_holding_the_lock() {
    let Some(url) = common::database_url() else { return };
    let Some(admin) = common::store().await else { return };
    let schema = common::fresh_schema();
    let c = admin.client().await.unwrap();
    let key = format!("keel.migrate.{schema}");
    c.execute("SELECT pg_advisory_lock(hashtext($1))", &[&key]).await.unwrap();
    let pid: i32 = c.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let store = PgStore::connect(PgConfig::new(url).schema(schema).pool_size(1)).await.unwrap();
    let run = tokio::spawn(async move { store.migrate().await.map(|()| store) });
    common::until_blocked_by(&c, pid).await;
    assert!(!run.is_finished());
    c.execute("SELECT pg_advisory_unlock(hashtext($1))", &[&key]).await.unwrap();
    let store = tokio::time::timeout(Duration::from_secs(60), run).await.unwrap().unwrap().unwrap();
    store.check_migrated().await.unwrap();
}

/// A child started by a descendant's step that commits while the cascade waits for that
/// descendant's lock is cancelled with the rest, not left live under a cancelled parent.
#[tokio::test]
async fn a_cascade_cancels_children_started_while_it_waited() {
    let Some(s) = common::store().await else { return };
    let root = insert_root(&s).await;
    let setup = s.client().await.unwrap();
    let child = children(&setup, root.0, root.0, 1).await[0];
    // Another transaction holds the child's row, as a step commit does, and starts a
    // grandchild under it.
    let mut other = s.client().await.unwrap();
    let tx = other.transaction().await.unwrap();
    let pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    tx.execute("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE", &[&child]).await.unwrap();
    let grandchild = tx
        .query_one(
            "INSERT INTO instances (namespace, machine, machine_version, queue, priority, \
             position, context, eligible_at, created_at, updated_at, base_priority, parent_id) \
             SELECT namespace, machine, machine_version, queue, priority, position, context, \
             eligible_at, created_at, updated_at, base_priority, id FROM instances \
             WHERE id = $1 RETURNING id",
            &[&child],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    let store = s.clone();
    let run = tokio::spawn(async move { store.instance_cancel(cancel(root)).await });
    common::until_blocked_by(&setup, pid).await;
    tx.commit().await.unwrap();
    let cancelled: HashSet<i64> = run.await.unwrap().unwrap().iter().map(|id| id.0).collect();
    assert_eq!(cancelled, HashSet::from([root.0, child, grandchild]));
    let got = s.instance_get(InstanceId(grandchild)).await.unwrap();
    assert_eq!(got.instance.status, Status::Cancelled);
}

/// At its bound the cascade keeps descendants in the walk's order (breadth first, each
/// parent's children after those of the parents before it), as the other stores do, not
/// in id order within a level.
#[tokio::test]
async fn a_cascade_at_its_bound_cuts_in_walk_order() {
    let Some(s) = common::store().await else { return };
    let root = insert_root(&s).await;
    let c = s.client().await.unwrap();
    let first = children(&c, root.0, root.0, 1).await[0];
    let second = children(&c, root.0, root.0, 1).await[0];
    // The second child's children get the lower ids; the first child's come first in the
    // walk. Together they pass the bound, which then cuts into the second child's.
    let half = (limits::CANCEL_CASCADE_MAX / 2) as i64;
    let of_second = children(&c, root.0, second, half).await;
    let of_first = children(&c, root.0, first, half).await;
    let cancelled: HashSet<i64> =
        s.instance_cancel(cancel(root)).await.unwrap().iter().map(|id| id.0).collect();
    assert_eq!(cancelled.len(), limits::CANCEL_CASCADE_MAX);
    assert!(of_first.iter().all(|id| cancelled.contains(id)), "the first child's are all cut");
    let kept = of_second.iter().filter(|id| cancelled.contains(id)).count();
    assert_eq!(kept, limits::CANCEL_CASCADE_MAX - 3 - of_first.len());
    assert_eq!(of_second[..kept].iter().filter(|id| cancelled.contains(id)).count(), kept);
}
