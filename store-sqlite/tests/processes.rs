//! Two `SqliteStore`s on one file behave like two worker processes: they take turns on
//! the write lock, every row is claimed exactly once, and a late commit by the worker
//! whose lease was reaped and re-claimed elsewhere is fenced off.

use keel_core::ports::Store;
use keel_core::ports::store::{
    ClaimParams, CommitParams, InsertParams, InstanceListParams, LeaseReapParams,
};
use keel_core::{ErrorKind, MachineRef, NewInstance, Outcome, StepCommit, Timestamp, WorkerId};
use keel_store_sqlite::SqliteStore;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);
const ROWS: usize = 200;

fn claim_params(worker: &str, now: Timestamp) -> ClaimParams {
    ClaimParams {
        worker: WorkerId(worker.into()),
        namespaces: Vec::new(),
        queues: Vec::new(),
        machines: Vec::new(),
        limit: 7,
        lease: Duration::from_secs(30),
        now,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    }
}

async fn drain(store: SqliteStore, worker: &'static str) -> Vec<keel_core::InstanceId> {
    let mut got = Vec::new();
    loop {
        let claims = store.instance_claim(claim_params(worker, T0)).await.expect("claim");
        if claims.is_empty() {
            return got;
        }
        got.extend(claims.iter().map(|c| c.instance.id));
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_file_claim_every_row_exactly_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("shared.db");
    let a = SqliteStore::open(&path).await.expect("open a");
    let b = SqliteStore::open(&path).await.expect("open b");
    let instances = vec![NewInstance::new(MachineRef::new("order", 1), "start"); ROWS];
    a.instance_insert(InsertParams { instances, now: T0 }).await.expect("insert");

    let (ga, gb) = tokio::join!(tokio::spawn(drain(a, "a")), tokio::spawn(drain(b, "b")));
    let (ga, gb) = (ga.expect("task a"), gb.expect("task b"));
    let all: BTreeSet<_> = ga.iter().chain(&gb).copied().collect();
    assert_eq!(ga.len() + gb.len(), ROWS, "no row claimed twice");
    assert_eq!(all.len(), ROWS, "every row claimed");
}

#[tokio::test]
async fn a_late_commit_from_another_store_is_fenced_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("fenced.db");
    let slow = SqliteStore::open(&path).await.expect("open slow");
    let fast = SqliteStore::open(&path).await.expect("open fast");
    let new = NewInstance::new(MachineRef::new("order", 1), "start");
    slow.instance_insert(InsertParams { instances: vec![new], now: T0 }).await.expect("insert");

    let stale = slow.instance_claim(claim_params("slow", T0)).await.expect("claim").remove(0);
    let later = T0.plus(Duration::from_secs(60));
    let reaped = fast
        .lease_reap(LeaseReapParams { owner: None, limit: 10, now: later })
        .await
        .expect("reap");
    assert_eq!(reaped, vec![stale.instance.id]);
    let fresh = fast.instance_claim(claim_params("fast", later)).await.expect("claim").remove(0);
    assert_eq!(fresh.token().0, stale.token().0 + 1, "a claim adds one to the token");

    let next = |token| {
        StepCommit::new(
            stale.instance.id,
            token,
            Outcome::Next { step: "pay".into(), context: json!({}) },
        )
    };
    let results = slow
        .step_commit(CommitParams { commits: vec![next(stale.token())], now: later })
        .await
        .expect("commit call");
    assert_eq!(results[0].as_ref().map_err(|e| e.kind), Err(ErrorKind::LeaseLost));
    let results = fast
        .step_commit(CommitParams { commits: vec![next(fresh.token())], now: later })
        .await
        .expect("commit call");
    assert_eq!(results[0].as_ref().expect("the live claim commits").revision.0, 1);
}

/// Every revision of the test's instances, read in one statement: one snapshot.
async fn revisions(store: &SqliteStore) -> BTreeSet<i64> {
    let rows = store
        .instance_list(InstanceListParams {
            namespace: "default".into(),
            machine: Some("order".into()),
            status: None,
            state: None,
            business_key: None,
            before: None,
            limit: ROWS,
        })
        .await
        .expect("list");
    assert_eq!(rows.len(), ROWS);
    rows.iter().map(|r| r.revision.0).collect()
}

/// A commit call dropped part-way (a caller's timeout, a shutdown deadline) is all or
/// nothing: dropped before the driver was told to commit, it rolls back; dropped after,
/// the driver's thread still commits it whole. No reader sees part of it, and the next
/// write waits until it has ended either way, then runs.
#[tokio::test]
async fn a_write_cancelled_half_way_leaves_nothing_behind_and_the_store_usable() {
    let mut rolled_back = 0;
    // Several budgets, so the drop lands at different points of the transaction.
    for budget in [200, 500, 1_000, 2_000, 4_000].map(Duration::from_micros) {
        let store = SqliteStore::temporary().await.expect("open");
        let instances = vec![NewInstance::new(MachineRef::new("order", 1), "start"); ROWS];
        store.instance_insert(InsertParams { instances, now: T0 }).await.expect("insert");
        let mut params = claim_params("w", T0);
        params.limit = ROWS;
        let claims = store.instance_claim(params).await.expect("claim");
        assert_eq!(claims.len(), ROWS);
        let commits: Vec<StepCommit> = claims
            .iter()
            .map(|c| {
                StepCommit::new(
                    c.instance.id,
                    c.token(),
                    Outcome::Next { step: "pay".into(), context: json!({}) },
                )
            })
            .collect();
        let cancelled = tokio::time::timeout(
            budget,
            store.step_commit(CommitParams { commits: commits.clone(), now: T0 }),
        )
        .await
        .is_err();
        // Read at once, while a commit handed to the driver may still be landing.
        let early = revisions(&store).await;
        assert_eq!(early.len(), 1, "{budget:?}: a reader saw part of a commit: {early:?}");
        // An empty commit takes the writer, so it runs after the dropped transaction ended.
        store
            .step_commit(CommitParams { commits: Vec::new(), now: T0 })
            .await
            .expect("the writer is usable again");
        let settled = revisions(&store).await;
        assert!(
            settled == BTreeSet::from([0]) || settled == BTreeSet::from([1]),
            "{budget:?}: all or nothing, got revisions {settled:?}"
        );
        if !cancelled {
            assert_eq!(settled, BTreeSet::from([1]), "{budget:?}: a finished call committed");
        }
        if settled == BTreeSet::from([0]) {
            rolled_back += 1;
            let results = store
                .step_commit(CommitParams { commits, now: T0 })
                .await
                .expect("the commit again");
            assert!(results.iter().all(Result::is_ok), "{budget:?}: {results:?}");
            assert_eq!(revisions(&store).await, BTreeSet::from([1]));
        }
    }
    // 200 commits take far longer than 200 µs, so at least the first drop is a rollback.
    assert!(rolled_back > 0, "no budget dropped the call before its commit");
}
