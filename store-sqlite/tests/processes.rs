//! Two `SqliteStore`s on one file behave like two worker processes: they take turns on
//! the write lock, every row is claimed exactly once, and a late commit by the worker
//! whose lease was reaped and re-claimed elsewhere is fenced off.

use keel_core::ports::Store;
use keel_core::ports::store::{ClaimParams, CommitParams, InsertParams, LeaseReapParams};
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

#[tokio::test]
async fn a_write_cancelled_half_way_leaves_nothing_behind_and_the_store_usable() {
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
    // Dropped long before 200 commits can finish: the transaction must roll back.
    let cancelled = tokio::time::timeout(
        Duration::from_millis(2),
        store.step_commit(CommitParams { commits: commits.clone(), now: T0 }),
    )
    .await;
    eprintln!("cancelled half-way: {}", cancelled.is_err());
    let mut revisions = BTreeSet::new();
    for c in &claims {
        revisions.insert(store.instance_get(c.instance.id).await.expect("get").instance.revision.0);
    }
    assert_eq!(revisions.len(), 1, "all or nothing, got revisions {revisions:?}");
    if cancelled.is_err() {
        assert_eq!(revisions, BTreeSet::from([0]));
        let results = store
            .step_commit(CommitParams { commits, now: T0 })
            .await
            .expect("the writer is usable again");
        assert!(results.iter().all(Result::is_ok));
    }
}
