//! Claim policies on PostgreSQL at a size the conformance suite does not reach: a key
//! with 100 000 ready rows, one of them executing, does not keep another key's single row
//! out of the next claim, under the plain statement, a key limit and a global limit. (How
//! long such a claim takes is measured by `keel-bench fairness`.)

mod common;

use keel_core::config::Strategy;
use keel_core::instance::NewInstance;
use keel_core::plan::claim::ClaimPolicy;
use keel_core::ports::Store;
use keel_core::ports::store::{ClaimParams, InsertParams};
use keel_core::{MachineRef, Timestamp, WorkerId, limits};
use std::time::Duration;

const T0: Timestamp = Timestamp(1_700_000_000_000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_busy_key_at_its_limit_does_not_delay_another_keys_row() {
    const BUSY: usize = 100_000;
    let Some(s) = common::store().await else { return };
    // Key A: 100 000 rows, all older than key B's single row.
    for chunk in 0..BUSY / limits::INSERT_BATCH_MAX {
        let news: Vec<NewInstance> = (0..limits::INSERT_BATCH_MAX)
            .map(|i| {
                let n = (chunk * limits::INSERT_BATCH_MAX + i) as i64;
                NewInstance::new(MachineRef::new("m", 1), "a")
                    .queue("q")
                    .concurrency_key("A")
                    .eligible_at(Timestamp(T0.0 + n))
            })
            .collect();
        s.instance_insert(InsertParams { instances: news, now: T0 }).await.expect("insert A");
    }
    let now = Timestamp(T0.0 + 10 * BUSY as i64);
    let params = |policy: ClaimPolicy, limit: usize| ClaimParams {
        worker: WorkerId("w".into()),
        namespaces: vec![],
        queues: vec!["q".into()],
        machines: vec![],
        limit,
        lease: Duration::from_secs(30),
        now,
        policy,
    };
    // A's first row runs: key A is at its limit of one.
    let running = s.instance_claim(params(ClaimPolicy::default(), 1)).await.expect("claim A");
    assert_eq!(running.len(), 1);
    let b = NewInstance::new(MachineRef::new("m", 1), "a")
        .queue("q")
        .concurrency_key("B")
        .eligible_at(Timestamp(T0.0 + BUSY as i64 + 1));
    let b =
        s.instance_insert(InsertParams { instances: vec![b], now: T0 }).await.expect("B")[0].id();
    let policies = [
        ("priority (plain statement)", ClaimPolicy::default(), vec!["B"]),
        // Two more places for A: round one takes A's next row and B's, round two A's third.
        (
            "fifo, K = 3",
            ClaimPolicy { key_limit: 3, ..ClaimPolicy::new(Strategy::Fifo) },
            vec!["A", "B", "A"],
        ),
        (
            "fifo, global limit 50",
            ClaimPolicy { global_limit: Some(50), ..ClaimPolicy::new(Strategy::Fifo) },
            vec!["B"],
        ),
    ];
    for (what, policy, expected) in policies {
        let claims = s.instance_claim(params(policy, 10)).await.expect("claim");
        let keys: Vec<_> =
            claims.iter().map(|c| c.instance.concurrency_key.clone().unwrap_or_default()).collect();
        assert_eq!(keys, expected, "{what}: the next claim's rows by key");
        assert!(claims.iter().any(|c| c.instance.id == b), "{what}: B's row is not in the claim");
        // Hand the rows back so the next policy starts from the same state.
        let leases = claims.iter().map(|c| (c.instance.id, c.token())).collect();
        s.lease_release(keel_core::ports::store::LeaseReleaseParams { leases, now })
            .await
            .expect("release");
    }
}
