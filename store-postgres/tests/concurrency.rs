//! Concurrency tests on the real server (issue 4 item 5): uniqueness contention, the
//! signal-versus-park race, concurrent claimers, and a children barrier released by
//! concurrent siblings. Each runs in its own schema and takes a few seconds at most.

mod common;

use keel_core::instance::{NewInstance, NewSignal};
use keel_core::outcome::{Outcome, StepCommit};
use keel_core::ports::Store;
use keel_core::ports::store::{
    Claim, ClaimParams, CommitParams, DeliveryOutcome, InsertOutcome, InsertParams,
    SignalDeliverParams,
};
use keel_core::{ErrorKind, InstanceId, MachineRef, Status, StatusSet, Timestamp, WorkerId};
use keel_store_postgres::PgStore;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_postgres::IsolationLevel;

const T0: Timestamp = Timestamp(1_700_000_000_000);
const KEYS: usize = 32;
const INSERTERS: u64 = 16;
const TRIALS: usize = 10_000;
const CHUNK: usize = 25;
const ROWS: usize = 10_000;

fn new(pos: &str) -> NewInstance {
    NewInstance::new(MachineRef::new("m", 1), pos)
}

fn claim(worker: &str, limit: usize) -> ClaimParams {
    ClaimParams {
        worker: WorkerId(worker.into()),
        namespaces: vec![],
        queues: vec![],
        machines: vec![],
        limit,
        lease: Duration::from_hours(1),
        now: T0,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    }
}

/// A tiny deterministic generator (xorshift), so failures replay with the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

async fn insert(s: &PgStore, items: Vec<NewInstance>) -> Vec<InstanceId> {
    let mut out = Vec::new();
    for chunk in items.chunks(5_000) {
        let r =
            s.instance_insert(InsertParams { instances: chunk.to_vec(), now: T0 }).await.unwrap();
        out.extend(r.iter().map(|o| o.id()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uniqueness_contention_with_rollbacks_and_repeatable_read() {
    let Some(s) = common::store_with(20).await else { return };
    let mut tasks = Vec::new();
    for n in 0..INSERTERS {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (n + 1));
            let mut committed: Vec<HashMap<usize, InstanceId>> = Vec::new();
            for round in 0..3 {
                let mut keys: Vec<usize> = (0..KEYS).collect();
                rng.shuffle(&mut keys);
                let rollback = (n + round) % 4 == 3;
                let isolation = if n % 2 == 0 {
                    IsolationLevel::RepeatableRead
                } else {
                    IsolationLevel::ReadCommitted
                };
                let mut tries = 0;
                loop {
                    tries += 1;
                    assert!(tries < 500, "inserter {n} could not commit in 500 tries (livelock?)");
                    let mut c = s.client().await.unwrap();
                    let tx =
                        c.build_transaction().isolation_level(isolation).start().await.unwrap();
                    let items = keys
                        .iter()
                        .map(|k| new("a").unique(format!("key-{k}").into_bytes(), StatusSet::LIVE))
                        .collect();
                    match s
                        .instance_insert_tx(&tx, InsertParams { instances: items, now: T0 })
                        .await
                    {
                        Ok(out) => {
                            if rollback {
                                tx.rollback().await.unwrap();
                            } else if tx.commit().await.is_ok() {
                                committed.push(
                                    keys.iter().zip(&out).map(|(k, o)| (*k, o.id())).collect(),
                                );
                            } else {
                                continue;
                            }
                            break;
                        }
                        // Serialization failure (REPEATABLE READ) or deadlock: retry the transaction.
                        Err(e) if e.kind == ErrorKind::Unavailable => {
                            drop(tx);
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            committed
        }));
    }
    let mut told: Vec<HashMap<usize, InstanceId>> = Vec::new();
    for t in tasks {
        told.extend(t.await.unwrap());
    }
    let c = s.client().await.unwrap();
    let rows = c
        .query("SELECT unique_key, count(*), min(id) FROM instances GROUP BY unique_key", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), KEYS, "one row per key");
    let mut actual = HashMap::new();
    for r in &rows {
        assert_eq!(r.get::<_, i64>(1), 1, "exactly one row per key");
        let key = String::from_utf8(r.get::<_, Vec<u8>>(0)).unwrap();
        actual.insert(key, InstanceId(r.get(2)));
    }
    assert!(!told.is_empty());
    for caller in &told {
        for (k, id) in caller {
            assert_eq!(
                actual[&format!("key-{k}")],
                *id,
                "every committed caller is told the same id"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn signal_versus_park_race_loses_no_wake_up() {
    let Some(s) = common::store_with(12).await else { return };
    let ids = insert(&s, (0..TRIALS).map(|_| new("a")).collect()).await;
    let mut tokens = HashMap::new();
    while tokens.len() < TRIALS {
        for c in s.instance_claim(claim("w", 1_000)).await.unwrap() {
            tokens.insert(c.instance.id, c.token());
        }
    }
    let mut rng = Rng(42);
    let mut commit_order = ids.clone();
    let mut deliver_order = ids.clone();
    rng.shuffle(&mut commit_order);
    rng.shuffle(&mut deliver_order);
    let tokens = Arc::new(tokens);
    let mut tasks = Vec::new();
    for w in 0..4 {
        let (s1, tokens) = (s.clone(), tokens.clone());
        let mine: Vec<InstanceId> = commit_order.iter().skip(w).step_by(4).copied().collect();
        tasks.push(tokio::spawn(async move {
            let mut saw = 0usize;
            for chunk in mine.chunks(CHUNK) {
                let commits = chunk
                    .iter()
                    .map(|id| {
                        StepCommit::new(
                            *id,
                            tokens[id],
                            Outcome::Await { signal: "go".into(), context: json!({}), step: None },
                        )
                    })
                    .collect();
                for r in s1.step_commit(CommitParams { commits, now: T0 }).await.unwrap() {
                    if r.unwrap().status == Status::Runnable {
                        saw += 1;
                    }
                }
            }
            saw
        }));
        let s2 = s.clone();
        let mine: Vec<InstanceId> = deliver_order.iter().skip(w).step_by(4).copied().collect();
        tasks.push(tokio::spawn(async move {
            let mut woke = 0usize;
            for chunk in mine.chunks(CHUNK) {
                let signals = chunk.iter().map(|id| NewSignal::new(*id, "go")).collect();
                let out =
                    s2.signal_deliver(SignalDeliverParams { signals, now: T0 }).await.unwrap();
                woke += out
                    .iter()
                    .filter(|o| matches!(o, DeliveryOutcome::Delivered { woke: true, .. }))
                    .count();
            }
            woke
        }));
    }
    // Every instance is made runnable exactly once: either its Await commit saw the
    // signal, or the delivery woke it — never neither (a lost wake-up), never both.
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, TRIALS, "wake-ups: commits that saw the signal + deliveries that woke");
    let c = s.client().await.unwrap();
    let lost: i64 = c
        .query_one(
            "SELECT count(*) FROM instances i WHERE i.status = 'awaiting_signal' \
             AND EXISTS (SELECT 1 FROM signals s WHERE s.target_id = i.id AND s.name = i.awaits)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(lost, 0, "instances parked with a matching signal in the inbox");
    let runnable: i64 = c
        .query_one("SELECT count(*) FROM instances WHERE status = 'runnable'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(runnable, TRIALS as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_claimers_never_claim_a_row_twice() {
    let Some(s) = common::store_with(12).await else { return };
    insert(&s, (0..ROWS).map(|_| new("a")).collect()).await;
    let mut tasks = Vec::new();
    for w in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let claims = s.instance_claim(claim(&format!("w{w}"), 100)).await.unwrap();
                if claims.is_empty() {
                    break got;
                }
                got.extend(claims.iter().map(|c| c.instance.id));
            }
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        for id in t.await.unwrap() {
            assert!(seen.insert(id), "{id} claimed twice while leased");
        }
    }
    assert_eq!(seen.len(), ROWS);
}

/// Eight claimers take rows ten at a time until twenty claims in a row find none; each
/// hands the rows it claimed to `check` while they run, then commits them done. Returns
/// how many were committed.
async fn drain_with_eight_claimers<F, Fut>(s: &PgStore, check: F) -> usize
where
    F: Fn(Vec<Claim>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Vec<Claim>> + Send,
{
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (s, check) = (s.clone(), check.clone());
        tasks.push(tokio::spawn(async move {
            let (mut done, mut idle) = (0, 0);
            while idle < 20 {
                let claims = s.instance_claim(claim(&format!("w{w}"), 10)).await.unwrap();
                if claims.is_empty() {
                    idle += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                idle = 0;
                let commits = check(claims)
                    .await
                    .iter()
                    .map(|c| {
                        StepCommit::new(
                            c.instance.id,
                            c.token(),
                            Outcome::Done { result: json!(null), step: None },
                        )
                    })
                    .collect();
                for r in s.step_commit(CommitParams { commits, now: T0 }).await.unwrap() {
                    r.unwrap();
                    done += 1;
                }
            }
            done
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_keys_hold_under_eight_claimers() {
    let Some(s) = common::store_with(12).await else { return };
    insert(&s, (0..200).map(|i| new("a").concurrency_key(format!("k{}", i % 5))).collect()).await;
    let running: Arc<Mutex<HashSet<String>>> = Arc::default();
    let total = drain_with_eight_claimers(&s, move |claims: Vec<Claim>| {
        let running = running.clone();
        async move {
            for c in &claims {
                let key = c.instance.concurrency_key.clone().unwrap();
                assert!(
                    running.lock().unwrap().insert(key.clone()),
                    "two claims of key {key} at once"
                );
            }
            for c in &claims {
                running.lock().unwrap().remove(c.instance.concurrency_key.as_deref().unwrap());
            }
            claims
        }
    })
    .await;
    assert_eq!(total, 200);
}

/// Unique keys scoped to executing alone hold under eight claimers: a claim that loses
/// the race for a key (another claim took it after this one's snapshot) is refused by the
/// index and runs again, never running two rows of one key at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unique_keys_scoped_to_executing_hold_under_eight_claimers() {
    let Some(s) = common::store_with(12).await else { return };
    let running = StatusSet::of(&[Status::Executing]);
    let rows = (0..200).map(|i| new("a").unique(format!("u{}", i % 5).into_bytes(), running));
    insert(&s, rows.collect()).await;
    let store = s.clone();
    let total = drain_with_eight_claimers(&s, move |claims: Vec<Claim>| {
        let store = store.clone();
        async move {
            let db = store.client().await.unwrap();
            for c in &claims {
                // Read while this claim's row still runs: it must be its key's only one.
                let key = c.instance.unique.as_ref().unwrap().key.clone();
                let count: i64 = db
                    .query_one(
                        "SELECT count(*) FROM instances \
                         WHERE status = 'executing' AND unique_key = $1",
                        &[&key],
                    )
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(count, 1, "two rows of one key running at once");
            }
            claims
        }
    })
    .await;
    assert_eq!(total, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_children_completing_concurrently_release_the_parent_once() {
    let Some(s) = common::store_with(24).await else { return };
    for _trial in 0..10 {
        let parent = insert(&s, vec![new("p")]).await[0];
        let c = s.instance_claim(claim("w", 1)).await.unwrap().remove(0);
        assert_eq!(c.instance.id, parent);
        let r = s
            .step_commit(CommitParams {
                commits: vec![StepCommit::new(
                    parent,
                    c.token(),
                    Outcome::ScheduleChildren {
                        next: "join".into(),
                        children: (0..50).map(|_| new("c")).collect(),
                        context: json!({}),
                        join: keel_core::join::Join::default(),
                    },
                )],
                now: T0,
            })
            .await
            .unwrap()
            .remove(0)
            .unwrap();
        assert!(r.children.iter().all(|o| matches!(o, InsertOutcome::Inserted(_))));
        let kids = s.instance_claim(claim("w", 50)).await.unwrap();
        assert_eq!(kids.len(), 50);
        let mut tasks = Vec::new();
        for k in kids {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.step_commit(CommitParams {
                    commits: vec![StepCommit::new(
                        k.instance.id,
                        k.token(),
                        Outcome::Done { result: json!(null), step: None },
                    )],
                    now: T0,
                })
                .await
                .unwrap()
                .remove(0)
                .unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let p = s.instance_get(parent).await.unwrap().instance;
        assert_eq!(p.status, Status::Runnable);
        assert_eq!(p.children_pending, 0);
        let again = s.instance_claim(claim("w", 10)).await.unwrap();
        assert_eq!(again.len(), 1, "the parent is released exactly once");
        assert_eq!(again[0].instance.id, parent);
        assert_eq!(again[0].children.len(), 50);
        s.step_commit(CommitParams {
            commits: vec![StepCommit::new(
                parent,
                again[0].token(),
                Outcome::Done { result: json!(null), step: None },
            )],
            now: T0,
        })
        .await
        .unwrap();
    }
}

/// Forty children of a quorum-of-ten parent commit `Done` at once, each in its own
/// transaction: the parent wakes exactly once with exactly ten successes counted, and every
/// child either committed before the wake or was cancelled by it (its late commit is
/// refused as a lost lease). Commits that end siblings and the cancel of the rest lock the
/// same rows in different orders; the deadlocks this causes are retried, never surfaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forty_children_racing_a_quorum_of_ten_wake_the_parent_once() {
    use keel_core::join::{Join, JoinState};
    let Some(s) = common::store_with(24).await else { return };
    for _trial in 0..5 {
        let parent = insert(&s, vec![new("p")]).await[0];
        let c = s.instance_claim(claim("w", 1)).await.unwrap().remove(0);
        assert_eq!(c.instance.id, parent);
        let fan_out =
            Outcome::schedule_children("join", (0..40).map(|_| new("c")).collect(), json!({}))
                .with_join(Join::quorum(10));
        s.step_commit(CommitParams {
            commits: vec![StepCommit::new(parent, c.token(), fan_out)],
            now: T0,
        })
        .await
        .unwrap()
        .remove(0)
        .unwrap();
        let kids = s.instance_claim(claim("w", 40)).await.unwrap();
        assert_eq!(kids.len(), 40);
        let mut tasks = Vec::new();
        for k in kids {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let done = StepCommit::new(
                    k.instance.id,
                    k.token(),
                    Outcome::Done { result: json!(null), step: None },
                );
                s.step_commit(CommitParams { commits: vec![done], now: T0 })
                    .await
                    .unwrap()
                    .remove(0)
            }));
        }
        let (mut committed, mut refused) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => committed += 1,
                Err(e) if e.kind == ErrorKind::LeaseLost => refused += 1,
                Err(e) => panic!("a child's commit failed: {e}"),
            }
        }
        let detail = s.instance_get(parent).await.unwrap();
        let p = detail.instance;
        assert_eq!(p.status, Status::Runnable);
        let state = JoinState::of(&p.context).expect("join state");
        assert_eq!(state.succeeded, 10, "exactly the quorum is counted");
        let wakes = detail.history.iter().filter(|h| h.entry.kind == "JOIN_WOKE").count();
        assert_eq!(wakes, 1, "the parent woke once");
        let done = detail.children.iter().filter(|c| c.status == Status::Done).count();
        let cancelled = detail.children.iter().filter(|c| c.status == Status::Cancelled).count();
        assert_eq!(
            (done, cancelled),
            (committed, refused),
            "every child committed or was cancelled"
        );
        assert_eq!(done + cancelled, 40);
        assert!(done >= 10, "{done} done");
        let again = s.instance_claim(claim("w", 10)).await.unwrap();
        assert_eq!(again.len(), 1, "the parent is released exactly once");
        s.step_commit(CommitParams {
            commits: vec![StepCommit::new(
                parent,
                again[0].token(),
                Outcome::Done { result: json!(null), step: None },
            )],
            now: T0,
        })
        .await
        .unwrap();
    }
}

/// Four sweepers race each other over 1 000 due timers and a stream of deliveries to the
/// same instances (which
/// lock the rows a sweep needs): every timer fires exactly once, none is left, and no call
/// fails (a sweep never waits for a lock, so it cannot deadlock with a delivery or commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn timer_sweeps_race_deliveries_fire_each_once() {
    use keel_core::chart::{TimerArm, TimerKind};
    use keel_core::ports::store::TimerSweepParams;
    const N: usize = 1_000;
    let Some(s) = common::store_with(12).await else { return };
    let ids = insert(&s, (0..N).map(|_| new("a")).collect()).await;
    let claims = s.instance_claim(claim("w", N)).await.unwrap();
    assert_eq!(claims.len(), N);
    let arm = TimerArm {
        state: "a".into(),
        event: "WAKE".into(),
        kind: TimerKind::After,
        interval: Duration::from_millis(1),
        max: None,
        then: None,
    };
    let commits = claims
        .iter()
        .map(|c| {
            let mut sc = StepCommit::new(
                c.instance.id,
                c.token(),
                Outcome::Await { signal: "WAKE".into(), context: json!({}), step: None },
            );
            sc.timers_arm = vec![arm.clone()];
            sc
        })
        .collect();
    let r = s.step_commit(CommitParams { commits, now: T0 }).await.unwrap();
    assert!(r.iter().all(Result::is_ok));
    let now = Timestamp(T0.0 + 10_000);
    let mut sweepers = Vec::new();
    for _ in 0..4 {
        let s = s.clone();
        sweepers.push(tokio::spawn(async move {
            let mut fired = 0;
            for _ in 0..200 {
                let p = TimerSweepParams { namespace: None, machines: vec![], limit: 50, now };
                let r = s.timer_sweep(p).await.expect("sweep");
                fired += r.fired;
                if r.processed == 0 {
                    let armed: u64 =
                        s.timer_status(None, now).await.unwrap().iter().map(|t| t.armed).sum();
                    if armed == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            fired
        }));
    }
    let noise = {
        let s = s.clone();
        let ids = ids.clone();
        tokio::spawn(async move {
            for chunk in ids.chunks(10) {
                let signals =
                    chunk.iter().map(|id| NewSignal::new(*id, "NOISE").payload(json!(1))).collect();
                s.signal_deliver(SignalDeliverParams { signals, now }).await.expect("deliver");
            }
        })
    };
    let mut total = 0;
    for t in sweepers {
        total += t.await.unwrap();
    }
    noise.await.unwrap();
    assert_eq!(total, N as u64, "every timer fired exactly once");
    for id in ids {
        let d = s.instance_get(id).await.unwrap();
        let wakes = d.inbox.iter().filter(|m| m.name == "WAKE").count();
        assert_eq!(wakes, 1, "instance {id}");
        assert!(d.timers.is_empty());
        assert_eq!(d.instance.status, Status::Runnable);
    }
}

/// `ready_wait` resolves on another handle's NOTIFY (an insert), keeps a permit for a
/// wake-up that lands while nobody waits, and none for one that woke a waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_wait_wakes_on_notify() {
    let Some(s) = common::store().await else { return };
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(10), s.ready_wait()).await.is_ok()
        })
    };
    // Let the waiter open its LISTEN connection, then make work ready from elsewhere.
    tokio::time::sleep(Duration::from_millis(300)).await;
    insert(&s, vec![new("a")]).await;
    assert!(waiter.await.unwrap(), "ready_wait resolved on the insert's NOTIFY");
    // The wake-up that found a waiter left nothing behind: the next wait waits.
    let idle = tokio::time::timeout(Duration::from_millis(500), s.ready_wait()).await;
    assert!(idle.is_err(), "a wait after a delivered wake-up returned with nothing new");
    insert(&s, vec![new("b")]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = tokio::time::timeout(Duration::from_secs(5), s.ready_wait()).await;
    assert!(again.is_ok(), "a NOTIFY with nobody waiting is kept for the next wait");
}

/// Heartbeats of overlapping lease sets in different orders, concurrently: each call
/// locks its rows in id order and retries a deadlock, so none fails and every lease it
/// names is extended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_lease_extends_over_overlapping_rows_in_any_order_never_fail() {
    const LEASES: usize = 200;
    const HEARTBEATS: u64 = 8;
    const ROUNDS: usize = 25;
    let Some(s) = common::store_with(HEARTBEATS as usize + 2).await else { return };
    insert(&s, (0..LEASES).map(|_| new("a")).collect()).await;
    let claims = s.instance_claim(claim("w", LEASES)).await.unwrap();
    assert_eq!(claims.len(), LEASES);
    let leases: Vec<_> = claims.iter().map(|c| (c.instance.id, c.token())).collect();
    let mut tasks = Vec::new();
    for n in 0..HEARTBEATS {
        let (s, mut leases) = (s.clone(), leases.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (n + 1));
            for round in 0..ROUNDS {
                rng.shuffle(&mut leases);
                let some = leases[..LEASES * 3 / 4].to_vec();
                let params = keel_core::ports::store::LeaseExtendParams {
                    worker: WorkerId("w".into()),
                    leases: some.clone(),
                    lease: Duration::from_hours(1),
                    now: Timestamp(T0.0 + (round as i64 + 1) * 1_000),
                };
                let held = s
                    .lease_extend(params)
                    .await
                    .unwrap_or_else(|e| panic!("heartbeat {n} round {round}: {e}"));
                assert_eq!(held, vec![true; some.len()], "heartbeat {n} round {round}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// A signal sent by business key to an instance that another transaction deletes after
/// the key was looked up and before the delivery locks the row (pruning does that) finds
/// no target: the delivery answers "missing" for it instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_target_deleted_while_its_key_is_looked_up_is_missing() {
    let Some(s) = common::store_with(4).await else { return };
    let id = insert(&s, vec![new("a").business_key("order-7")]).await[0];
    let holder = s.client().await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    let holder_pid: i32 = holder.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    holder.execute("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE", &[&id.0]).await.unwrap();
    let s2 = s.clone();
    let delivery = tokio::spawn(async move {
        let target = keel_core::instance::SignalTarget::Key {
            namespace: "default".into(),
            machine: "m".into(),
            key: "order-7".into(),
        };
        s2.signal_deliver(SignalDeliverParams {
            signals: vec![NewSignal::new(target, "go")],
            now: T0,
        })
        .await
    });
    // The delivery has looked the key up and now waits for the row's lock.
    let watcher = s.client().await.unwrap();
    common::until_blocked_by(&watcher, holder_pid).await;
    holder.execute("DELETE FROM instances WHERE id = $1", &[&id.0]).await.unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    let out = delivery.await.expect("the delivery does not panic").unwrap();
    assert_eq!(out, vec![DeliveryOutcome::TargetMissing]);
}
