//! Crash tests: worker *processes* are SIGKILLed at random moments while they run 500
//! five-step instances and 100 order charts — on a SQLite file, and on PostgreSQL when
//! `KEEL_TEST_DATABASE_URL` is set (required under `KEEL_REQUIRE_BACKENDS=1`) — then
//! started again (once
//! with the same worker id, which reclaims its leases at start-up, once with a new id,
//! which waits for the reaper). Afterwards every instance must be finished, no step may
//! have been committed twice (each instance's revision grows by exactly one per step), and
//! no lease may be left behind. A worker killed under the default worker id (what a user
//! gets) and started again must take its 30 s leases back at once, finishing within 10 s.

use keel_core::instance::NewInstance;
use keel_core::ports::Store;
use keel_core::ports::store::{InsertParams, SignalDeliverParams};
use keel_core::{InstanceId, MachineRef, NewSignal, Status, Timestamp};
use keel_examples::order;
use keel_store_sqlite::SqliteStore;
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: usize = 500;
const ORDERS: usize = 100;

fn now() -> Timestamp {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    Timestamp(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// A worker process, SIGKILLed when dropped, so a failing test leaves none behind.
struct WorkerProcess(Option<Child>);

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts a worker process on the store `store_args` names and waits (bounded) until it
/// says it is running.
fn start_worker(store_args: &[String], id: &str) -> WorkerProcess {
    start_worker_with(store_args, &["--worker-id", id])
}

/// Starts a worker process with further command-line arguments (see `keel-crash-worker`).
fn start_worker_with(store_args: &[String], extra: &[&str]) -> WorkerProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel-crash-worker"))
        .args(store_args)
        .args(extra)
        .args(queue_args(store_args))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start keel-crash-worker");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
    assert_eq!(line.trim(), "ready", "the worker did not start");
    WorkerProcess(Some(child))
}

/// With `KEEL_TEST_WORKER_QUEUE=redis`, the workers' Redis queue (`KEEL_TEST_REDIS_URL`),
/// one per test (named after its store), so that the crash runs have a queue in the loop:
/// instances inserted straight into the store are announced by the workers' repair pass,
/// and the steps after them by the workers' own hints.
fn queue_args(store_args: &[String]) -> Vec<String> {
    match std::env::var("KEEL_TEST_WORKER_QUEUE").as_deref() {
        Ok("redis") => {}
        Ok("") | Err(_) => return Vec::new(),
        Ok(other) => panic!("KEEL_TEST_WORKER_QUEUE={other}: the only queue it takes is `redis`"),
    }
    let url = std::env::var("KEEL_TEST_REDIS_URL")
        .expect("KEEL_TEST_WORKER_QUEUE=redis needs KEEL_TEST_REDIS_URL");
    let mut hash = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(store_args, &mut hash);
    let name = format!("crash-{:016x}", std::hash::Hasher::finish(&hash));
    vec!["--redis-queue".to_owned(), url, name]
}

/// SIGKILL, and reap the process.
fn kill(mut worker: WorkerProcess) {
    let mut child = worker.0.take().expect("running");
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("wait");
    assert!(!status.success(), "the worker was killed, not stopped");
}

/// Finished instances, from one cheap aggregate query (reading 600 instances one by one
/// would take longer than the run it measures).
async fn terminal<S: Store>(store: &S, ids: &[InstanceId]) -> usize {
    let stats = store.queue_stats(None, now()).await.expect("queue_stats");
    let live: u64 =
        stats.iter().map(|q| q.ready + q.scheduled + q.executing + q.waiting + q.suspended).sum();
    ids.len() - usize::try_from(live).expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sigkilled_workers_lose_nothing_and_apply_no_step_twice() {
    let (_dir, store, args) = sqlite_store().await;
    crash_run(&store, &args).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sigkilled_workers_lose_nothing_and_apply_no_step_twice() {
    let Some((store, args)) =
        postgres_store("postgres_sigkilled_workers_lose_nothing_and_apply_no_step_twice").await
    else {
        return;
    };
    crash_run(&store, &args).await;
}

/// A fresh SQLite file (kept alive by the returned directory) and the worker's arguments
/// for it.
async fn sqlite_store() -> (tempfile::TempDir, SqliteStore, Vec<String>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("keel.db").display().to_string();
    let store = SqliteStore::open(&db).await.expect("open");
    (dir, store, vec!["--sqlite".to_owned(), db])
}

/// A fresh PostgreSQL schema and the worker's arguments for it; `None` (said loudly) when
/// no database is configured.
async fn postgres_store(test: &str) -> Option<(keel_store_postgres::PgStore, Vec<String>)> {
    let store = keel_testkit::conformance::backend_or_skip(
        test,
        keel_store_postgres::testing::DATABASE_URL_VAR,
        keel_store_postgres::testing::fresh_schema().await,
    )?;
    let url = keel_store_postgres::testing::database_url().expect("configured");
    let args = vec!["--postgres".to_owned(), url, "--schema".to_owned(), store.schema().to_owned()];
    Some((store, args))
}

async fn crash_run<S: Store>(store: &S, store_args: &[String]) {
    let mut news: Vec<NewInstance> = (0..STEPS)
        .map(|n| {
            NewInstance::new(MachineRef::new("five_steps", 1), "step1").context(json!({ "n": n }))
        })
        .collect();
    let chart = keel_scheduler::ChartMachine::new(order::definition());
    news.extend((0..ORDERS).map(|_| chart.new_instance(json!({ "card_ok": true }))));
    let ids: Vec<InstanceId> = store
        .instance_insert(InsertParams { instances: news, now: now() })
        .await
        .expect("insert")
        .iter()
        .map(|o| o.id())
        .collect();
    let (steps, orders) = ids.split_at(STEPS);
    let events = orders
        .iter()
        .flat_map(|id| {
            [
                NewSignal::new(*id, "ADD_ITEM").payload(json!({ "sku": "A" })),
                NewSignal::new(*id, "CHECKOUT"),
                NewSignal::new(*id, "PAY"),
            ]
        })
        .collect();
    store
        .signal_deliver(SignalDeliverParams { signals: events, now: now() })
        .await
        .expect("deliver");

    let seed = fastrand::u64(..);
    eprintln!("crash test seed: {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut kills = 0;
    // Kill at a random moment once the worker is under way: after a random number of
    // further instances finished (or a bounded wait).
    let mut done = 0;
    for worker_id in ["crash-a", "crash-a", "crash-b"] {
        let child = start_worker(store_args, worker_id);
        let target = done + rng.usize(20..150);
        let started = Instant::now();
        while done < target && started.elapsed() < Duration::from_secs(20) {
            tokio::time::sleep(Duration::from_millis(rng.u64(5..40))).await;
            done = terminal(store, &ids).await;
        }
        kill(child);
        kills += 1;
        done = terminal(store, &ids).await;
        let stats = store.queue_stats(None, now()).await.expect("queue_stats");
        let executing: u64 = stats.iter().map(|q| q.executing).sum();
        eprintln!(
            "after kill {kills}: {done} of {} finished, {executing} executing under a dead lease",
            ids.len()
        );
    }
    assert!(done < ids.len(), "the kills happened mid-run");

    let survivor = start_worker(store_args, "crash-c");
    let started = Instant::now();
    loop {
        let done = terminal(store, &ids).await;
        if done == ids.len() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "only {done} of {} finished after the restarts",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    kill(survivor);
    assert!(kills >= 2);

    for id in steps {
        let d = store.instance_get(*id).await.expect("get");
        assert_eq!(d.instance.status, Status::Done, "{id}");
        assert_eq!(d.instance.revision.0, 5, "{id}: five steps, five commits");
        assert_eq!(
            (d.instance.lease_owner.clone(), d.instance.lease_expires_at),
            (None, None),
            "{id}: no lease left"
        );
        let mut revisions: Vec<i64> = d
            .history
            .iter()
            .filter(|h| h.entry.kind == "STEP_NEXT" || h.entry.kind == "STEP_DONE")
            .map(|h| h.revision.0)
            .collect();
        revisions.sort_unstable();
        assert_eq!(revisions, [1, 2, 3, 4, 5], "{id}: each step committed exactly once");
        for n in 1..=5 {
            assert_eq!(
                d.instance.result.as_ref().map(|r| r[format!("did_{n}")].clone()),
                Some(json!(true)),
                "{id} step {n}"
            );
        }
    }
    for id in orders {
        let d = store.instance_get(*id).await.expect("get");
        assert_eq!(d.instance.status, Status::Done, "{id}");
        assert!(d.inbox.is_empty(), "{id}: every event consumed");
        let revisions: Vec<i64> = d
            .history
            .iter()
            .filter(|h| h.entry.kind == "MACROSTEP")
            .map(|h| h.revision.0)
            .collect();
        assert_eq!(
            revisions,
            (1..=d.instance.revision.0).collect::<Vec<_>>(),
            "{id}: one macrostep per revision"
        );
        assert_eq!(d.instance.revision.0, 4, "{id}: init + three events");
        assert!(
            d.instance.result.as_ref().is_some_and(|r| r.get("receipt").is_some()),
            "{id}: completed"
        );
    }
}

/// Rows executing under a lease right now.
async fn executing<S: Store>(store: &S) -> u64 {
    let stats = store.queue_stats(None, now()).await.expect("queue_stats");
    stats.iter().map(|q| q.executing).sum()
}

/// A worker that runs under the default worker id, killed while it holds leases and
/// started again, takes its leases back at start-up: everything finishes long before the
/// 30 s lease of the killed process would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_worker_restarted_under_the_default_id_reclaims_its_leases_at_start_up() {
    let (_dir, store, args) = sqlite_store().await;
    restart_run(&store, &args).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_worker_restarted_under_the_default_id_reclaims_its_leases_at_start_up() {
    let Some((store, args)) = postgres_store(
        "postgres_a_worker_restarted_under_the_default_id_reclaims_its_leases_at_start_up",
    )
    .await
    else {
        return;
    };
    restart_run(&store, &args).await;
}

async fn restart_run<S: Store>(store: &S, store_args: &[String]) {
    const LEASE_SECS: &str = "30";
    const KILL_TRIES: usize = 5;
    let news: Vec<NewInstance> = (0..STEPS)
        .map(|n| {
            NewInstance::new(MachineRef::new("five_steps", 1), "step1").context(json!({ "n": n }))
        })
        .collect();
    let ids: Vec<InstanceId> = store
        .instance_insert(InsertParams { instances: news, now: now() })
        .await
        .expect("insert")
        .iter()
        .map(|o| o.id())
        .collect();

    // Kill the worker at a moment when it holds leases; a run that happened to hold none
    // at the kill is started again (a bounded number of times).
    let mut held = Vec::new();
    for _ in 0..KILL_TRIES {
        let worker = start_worker_with(store_args, &["--lease-secs", LEASE_SECS]);
        let started = Instant::now();
        while executing(store).await == 0 && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        kill(worker);
        held = leased(store, &ids).await;
        if !held.is_empty() {
            break;
        }
    }
    assert!(!held.is_empty(), "no kill in {KILL_TRIES} tries caught the worker holding a lease");
    eprintln!("killed holding {} leases", held.len());

    // The leases are taken back at start-up, long before the killed process's 30 s lease
    // runs out: each row the dead process held is released or leased anew. Measured on the
    // held rows themselves, so a slow (loaded) machine does not make it look lost.
    let restarted = Instant::now();
    let _worker = start_worker_with(store_args, &["--lease-secs", LEASE_SECS]);
    loop {
        let rows = store.instance_rows(held.iter().map(|(id, _)| *id).collect()).await;
        let rows = rows.expect("instance_rows");
        let still = rows
            .iter()
            .filter(|r| r.status == Status::Executing && held.contains(&(r.id, r.fencing_token)))
            .count();
        if still == 0 {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(15),
            "{still} of the {} rows the killed worker held are still under its lease 15 s after \
             the restart (the lease is {LEASE_SECS} s): the restarted worker did not reclaim them",
            held.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("reclaimed {} leases {:?} after the restart", held.len(), restarted.elapsed());
    // And nothing is lost: every instance finishes (a bound for a slow machine only).
    loop {
        let done = terminal(store, &ids).await;
        if done == ids.len() {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(120),
            "only {done} of {} finished 120 s after the restart",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The rows of `ids` executing under a lease now, with their fencing tokens.
async fn leased<S: Store>(
    store: &S,
    ids: &[InstanceId],
) -> Vec<(InstanceId, keel_core::FencingToken)> {
    let rows = store.instance_rows(ids.to_vec()).await.expect("instance_rows");
    rows.iter().filter(|r| r.status == Status::Executing).map(|r| (r.id, r.fencing_token)).collect()
}
