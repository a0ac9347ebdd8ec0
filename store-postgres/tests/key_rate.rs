//! Per-key rate limits on PostgreSQL: across concurrent claimers on real time, each key
//! starts its configured rate; and the buckets of idle keys are deleted in bounded
//! batches. The rate test measures time, so it lives alone in this test binary (cargo
//! runs test binaries one after another) and the other test here takes no time.

mod common;

use keel_core::config::Strategy;
use keel_core::instance::NewInstance;
use keel_core::plan::claim::{ClaimPolicy, RateLimit};
use keel_core::ports::Store;
use keel_core::ports::store::{ClaimParams, InsertParams};
use keel_core::{MachineRef, Timestamp, WorkerId, limits};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn wall() -> Timestamp {
    Timestamp(SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as i64)
}

fn params(queue: &str, now: Timestamp, policy: ClaimPolicy, worker: &str) -> ClaimParams {
    ClaimParams {
        worker: WorkerId(worker.into()),
        namespaces: vec![],
        queues: vec![queue.into()],
        machines: vec![],
        limit: 50,
        lease: Duration::from_secs(60),
        now,
        policy,
    }
}

/// Two keys at 20 starts per second each (burst 1), claimed by three claimers every
/// 10 ms for 3 s on the wall clock: each key starts 1 + 20 per second of the run, within
/// 5 %, whatever the other key and the other claimers do.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_keys_at_20_per_second_each_start_their_rate_across_three_claimers() {
    const RUN: Duration = Duration::from_secs(3);
    let Some(s) = common::store().await else { return };
    let s = Arc::new(s);
    let keys = ["ka", "kb"];
    let news: Vec<NewInstance> = (0..400)
        .map(|i| {
            NewInstance::new(MachineRef::new("m", 1), "s")
                .queue("rated")
                .concurrency_key(keys[i % 2])
        })
        .collect();
    s.instance_insert(InsertParams { instances: news, now: Timestamp(0) }).await.expect("insert");
    let rate = RateLimit { starts: 20, per: Duration::from_secs(1), burst: 1 };
    let policy =
        ClaimPolicy { key_rate: Some(rate), key_limit: 1_000, ..ClaimPolicy::new(Strategy::Fifo) };
    let first = wall();
    let started = Instant::now();
    let mut claimers = Vec::new();
    for w in 0..3 {
        let s = Arc::clone(&s);
        claimers.push(tokio::spawn(async move {
            let mut got: Vec<(i64, String)> = Vec::new();
            while started.elapsed() < RUN {
                let now = wall();
                let claims = s
                    .instance_claim(params("rated", now, policy, &format!("w{w}")))
                    .await
                    .expect("claim");
                for c in claims {
                    got.push((now.0, c.instance.concurrency_key.clone().expect("keyed")));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            got
        }));
    }
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    let mut last = first.0;
    for claimer in claimers {
        for (at, key) in claimer.await.expect("claimer") {
            last = last.max(at);
            *per_key.entry(key).or_default() += 1;
        }
    }
    let seconds = (last - first.0) as f64 / 1_000.0;
    let expected = 1.0 + 20.0 * seconds;
    for key in keys {
        let got = per_key.get(key).copied().unwrap_or(0) as f64;
        println!("key {key}: {got} starts in {seconds:.2} s (expected {expected:.1})");
        assert!(
            (got - expected).abs() <= expected * 0.05,
            "key {key}: {got} starts in {seconds:.2} s, expected {expected:.1} ± 5 %"
        );
    }
}

/// A claim deletes at most `KEY_RATE_BUCKETS_PRUNE_MAX` buckets, and only full ones whose
/// key has no ready row in the queue: 150 idle keys' buckets go in two claims, while the
/// bucket of a key with a row waiting (not yet due) stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_buckets_of_idle_keys_are_deleted_in_bounded_batches() {
    let Some(s) = common::store().await else { return };
    let t0 = Timestamp(1_700_000_000_000);
    let idle = limits::KEY_RATE_BUCKETS_PRUNE_MAX + 50;
    let row = |key: String| {
        NewInstance::new(MachineRef::new("m", 1), "s").queue("gc").concurrency_key(key)
    };
    let mut news: Vec<NewInstance> = (0..idle).map(|i| row(format!("idle-{i:04}"))).collect();
    news.push(row("waiting".into()));
    news.push(row("waiting".into()).eligible_at(Timestamp(t0.0 + 10 * 86_400_000)));
    s.instance_insert(InsertParams { instances: news, now: t0 }).await.expect("insert");
    let rate = RateLimit { starts: 1, per: Duration::from_secs(60), burst: 1 };
    let policy =
        ClaimPolicy { key_rate: Some(rate), key_limit: 5, ..ClaimPolicy::new(Strategy::Fifo) };
    let claim = |now: Timestamp| {
        let mut p = params("gc", now, policy, "w");
        p.limit = limits::CLAIM_BATCH_MAX;
        let s = &s;
        async move { s.instance_claim(p).await.expect("claim").len() }
    };
    let buckets = || async {
        let c = s.client().await.expect("client");
        let n: i64 =
            c.query_one("SELECT count(*) FROM key_rate_buckets", &[]).await.expect("count").get(0);
        n as usize
    };
    assert_eq!(claim(t0).await, idle + 1, "every key's first row");
    assert_eq!(claim(t0).await, 0);
    assert_eq!(buckets().await, idle + 1, "a bucket per key that started a row; none full yet");
    // Two minutes later every bucket is full; the claims find nothing due and only prune.
    let later = Timestamp(t0.0 + 120_000);
    assert_eq!(claim(later).await, 0);
    assert_eq!(buckets().await, idle + 1 - limits::KEY_RATE_BUCKETS_PRUNE_MAX, "one batch");
    assert_eq!(claim(later).await, 0);
    assert_eq!(buckets().await, 1, "the idle keys' buckets are gone");
    assert_eq!(claim(later).await, 0);
    assert_eq!(buckets().await, 1, "the key with a row waiting keeps its bucket");
}
