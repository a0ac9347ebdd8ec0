//! The file-level promises of the SQLite store: what is committed survives a reopen, and
//! a corrupt or locked file is a clear error that names the file, never a panic.

use keel_core::ports::Store;
use keel_core::ports::store::{
    ClaimParams, CommitParams, InsertOutcome, InsertParams, SignalDeliverParams,
};
use keel_core::{
    ErrorKind, MachineRef, NewInstance, NewSignal, Outcome, Status, StepCommit, Timestamp, WorkerId,
};
use keel_store_sqlite::{SqliteConfig, SqliteStore};
use serde_json::json;
use sqlx::{Connection, SqliteConnection};
use std::time::Duration;

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(T0.as_millis() + ms)
}

fn new_order() -> NewInstance {
    NewInstance::new(MachineRef::new("order", 1), "start").context(json!({ "n": 1 }))
}

fn claim_params(now: Timestamp) -> ClaimParams {
    ClaimParams {
        worker: WorkerId("w1".into()),
        namespaces: Vec::new(),
        queues: Vec::new(),
        machines: Vec::new(),
        limit: 10,
        lease: Duration::from_secs(30),
        now,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    }
}

async fn insert(store: &SqliteStore, new: NewInstance, now: Timestamp) -> keel_core::InstanceId {
    match store
        .instance_insert(InsertParams { instances: vec![new], now })
        .await
        .expect("insert")
        .as_slice()
    {
        [InsertOutcome::Inserted(id)] => *id,
        other => panic!("expected a new instance, got {other:?}"),
    }
}

#[tokio::test]
async fn committed_state_survives_closing_and_reopening_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("durable.db");
    let (id, waiting) = {
        let store = SqliteStore::open(&path).await.expect("open");
        let id = insert(&store, new_order().business_key("o-1"), at(0)).await;
        let waiting = insert(&store, new_order(), at(1)).await;
        let claim = store.instance_claim(claim_params(at(10))).await.expect("claim").remove(0);
        assert_eq!(claim.instance.id, id);
        let commit = StepCommit::new(
            id,
            claim.token(),
            Outcome::Next { step: "pay".into(), context: json!({ "n": 2 }) },
        );
        let receipt = store
            .step_commit(CommitParams { commits: vec![commit], now: at(20) })
            .await
            .expect("commit")
            .remove(0)
            .expect("accepted");
        assert_eq!(receipt.status, Status::Runnable);
        let signal = NewSignal::new(waiting, "paid").payload(json!({ "amount": 5 }));
        store
            .signal_deliver(SignalDeliverParams { signals: vec![signal], now: at(30) })
            .await
            .expect("deliver");
        (id, waiting)
    };

    let store = SqliteStore::open(&path).await.expect("reopen");
    let detail = store.instance_get(id).await.expect("get after reopen");
    assert_eq!(detail.instance.position, "pay");
    assert_eq!(detail.instance.context, json!({ "n": 2 }));
    assert_eq!(detail.instance.revision.0, 1);
    assert_eq!(detail.instance.fencing_token.0, 1, "the claim's token is durable too");
    assert_eq!(
        detail.history.iter().map(|h| h.entry.kind.as_str()).collect::<Vec<_>>(),
        ["STEP_NEXT"]
    );
    let inbox = store.instance_get(waiting).await.expect("get").inbox;
    assert_eq!(inbox.len(), 1);
    assert_eq!((inbox[0].name.as_str(), &inbox[0].payload), ("paid", &json!({ "amount": 5 })));
    let target = keel_core::SignalTarget::Key {
        namespace: "default".into(),
        machine: "order".into(),
        key: "o-1".into(),
    };
    assert_eq!(store.instance_lookup(target).await.expect("lookup"), Some(id));
    // Ids keep growing after a reopen, and the next claim takes the next token.
    let third = insert(&store, new_order(), at(40)).await;
    assert!(third > waiting);
    let claims = store.instance_claim(claim_params(at(50))).await.expect("claim");
    let token = claims.iter().find(|c| c.instance.id == id).expect("claimed again").token();
    assert_eq!(token.0, 2);
}

#[tokio::test]
async fn a_corrupt_file_is_a_clear_error_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("garbage.db");
    let garbage: Vec<u8> =
        (0..16_384u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
    std::fs::write(&path, garbage).expect("write garbage");
    let err = SqliteStore::open(&path).await.expect_err("garbage is not a database");
    eprintln!("{err}");
    assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
    assert!(err.message.contains(&path.display().to_string()), "names the file: {err}");
    assert!(err.message.contains("corrupt or not a SQLite database"), "{err}");
}

#[tokio::test]
async fn a_locked_file_is_unavailable_after_the_busy_timeout_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("locked.db");
    let config = SqliteConfig::new(&path).busy_timeout(Duration::from_millis(200));
    let store = SqliteStore::open_with(config.clone()).await.expect("open");
    insert(&store, new_order(), at(0)).await;

    // Another connection (as another process would) takes the write lock and keeps it.
    let url = format!("sqlite://{}", path.display());
    let mut other = SqliteConnection::connect(&url).await.expect("second connection");
    sqlx::query("BEGIN EXCLUSIVE").execute(&mut other).await.expect("lock");
    sqlx::query("UPDATE keel_instances SET updated_at = updated_at")
        .execute(&mut other)
        .await
        .expect("write under the lock");

    let started = std::time::Instant::now();
    let err = store
        .instance_insert(InsertParams { instances: vec![new_order()], now: at(10) })
        .await
        .expect_err("the write lock is held elsewhere");
    assert!(started.elapsed() >= Duration::from_millis(150), "waited for the busy timeout");
    eprintln!("{err}");
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert!(err.is_retryable());
    assert!(err.message.contains(&path.display().to_string()), "names the file: {err}");
    assert!(err.message.contains("locked"), "{err}");
    // Reads still work under WAL while another connection writes.
    let stats = store.queue_stats(Some("default".into()), at(10)).await.expect("read");
    assert_eq!(stats.iter().map(|q| q.ready).sum::<u64>(), 1, "the one instance: {stats:?}");

    sqlx::query("ROLLBACK").execute(&mut other).await.expect("unlock");
    insert(&store, new_order(), at(20)).await;
}

#[tokio::test]
async fn opening_a_file_locked_by_another_process_is_unavailable_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("held.db");
    // A rollback-journal database held under an exclusive lock: nobody can even read it.
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut other = SqliteConnection::connect(&url).await.expect("create");
    sqlx::query("CREATE TABLE t (x INTEGER)").execute(&mut other).await.expect("table");
    sqlx::query("BEGIN EXCLUSIVE").execute(&mut other).await.expect("lock");
    sqlx::query("INSERT INTO t VALUES (1)").execute(&mut other).await.expect("write");

    let config = SqliteConfig::new(&path).busy_timeout(Duration::from_millis(200));
    let err = SqliteStore::open_with(config).await.expect_err("the file is locked");
    eprintln!("{err}");
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert!(err.message.contains(&path.display().to_string()), "names the file: {err}");
    sqlx::query("ROLLBACK").execute(&mut other).await.expect("unlock");
}

#[tokio::test]
async fn ready_wait_fires_after_an_insert() {
    let store = SqliteStore::memory().await.expect("open");
    assert!(store.capabilities().notifications);
    let waiter = store.ready_wait();
    tokio::pin!(waiter);
    // Register interest before the write, as a worker racing its poll interval does.
    assert!(futures_poll_once(waiter.as_mut()).await.is_none());
    insert(&store, new_order(), at(0)).await;
    tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("woken by the insert");
}

/// A wake-up that lands while no worker waits yet (between its empty claim and its wait)
/// is kept for the next wait, so that worker does not sleep a whole poll interval.
#[tokio::test]
async fn a_wake_up_before_anyone_waits_is_kept_for_the_next_wait() {
    let store = SqliteStore::memory().await.expect("open");
    insert(&store, new_order(), at(0)).await;
    tokio::time::timeout(Duration::from_secs(5), store.ready_wait())
        .await
        .expect("the insert's wake-up was kept");
}

/// Polls a future once; `Some` if it finished.
async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
    let mut f = f;
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// A file written by the first schema (before charts and timers) migrates forward on open:
/// its rows read back with the new column empty, and they can arm and fire timers.
#[tokio::test]
async fn a_file_from_the_first_schema_migrates_forward() {
    use keel_core::chart::{TimerArm, TimerKind};
    use keel_core::ports::store::TimerSweepParams;
    use sqlx::SqlSafeStr;
    use sqlx::migrate::{Migration, MigrationType, Migrator};

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("old.db");
    {
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let mut old = SqliteConnection::connect(&url).await.expect("create the old file");
        let first = Migration::new(
            1,
            "schema".into(),
            MigrationType::Simple,
            include_str!("../migrations/0001_schema.sql").into_sql_str(),
            false,
        );
        Migrator::with_migrations(vec![first]).run(&mut old).await.expect("first schema");
        sqlx::query(
            "INSERT INTO keel_instances (namespace, machine, machine_version, queue, priority, \
             status, position, context, attempt, errors, revision, eligible_at, fencing_token, \
             created_at, updated_at) VALUES ('default', 'order', 1, 'default', 2, 'runnable', \
             'start', '{}', 0, '[]', 0, ?, 0, ?, ?)",
        )
        .bind(at(0).as_millis())
        .bind(at(0).as_millis())
        .bind(at(0).as_millis())
        .execute(&mut old)
        .await
        .expect("a row in the old schema");
        old.close().await.expect("close");
    }

    let store = SqliteStore::open(&path).await.expect("open migrates forward");
    let claim = store.instance_claim(claim_params(at(10))).await.expect("claim").remove(0);
    assert_eq!(claim.instance.invoked_by, None);
    let id = claim.instance.id;
    let mut commit = StepCommit::new(
        id,
        claim.token(),
        Outcome::Await { signal: "*".into(), context: json!({}), step: Some("waiting".into()) },
    );
    commit.timers_arm = vec![TimerArm {
        state: "waiting".into(),
        event: "EXPIRED".into(),
        kind: TimerKind::After,
        interval: Duration::from_secs(1),
        max: None,
        then: None,
    }];
    store
        .step_commit(CommitParams { commits: vec![commit], now: at(20) })
        .await
        .expect("commit")
        .remove(0)
        .expect("accepted");
    let params =
        TimerSweepParams { namespace: None, machines: Vec::new(), limit: 10, now: at(5_000) };
    assert_eq!(store.timer_sweep(params).await.expect("sweep").fired, 1);
    let detail = store.instance_get(id).await.expect("get");
    assert_eq!(detail.instance.status, Status::Runnable);
    assert_eq!(detail.inbox[0].name, "EXPIRED");
}

/// Commits of plain steps are written together in one query; when one item's write fails
/// there, only that item is rejected and the others still commit, as if each had been
/// written alone. A trigger makes the database refuse the history row of one instance.
#[tokio::test]
async fn a_write_that_fails_in_a_commit_batch_rejects_only_its_own_item() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("batch.db");
    let store = SqliteStore::open(&path).await.expect("open");
    let ids = [
        insert(&store, new_order(), at(0)).await,
        insert(&store, new_order(), at(1)).await,
        insert(&store, new_order(), at(2)).await,
    ];
    let claims = store.instance_claim(claim_params(at(10))).await.expect("claim");
    assert_eq!(claims.len(), 3);
    let mut conn =
        SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER refuse_one BEFORE INSERT ON keel_history WHEN NEW.instance_id = {} \
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        ids[1].0
    )))
    .execute(&mut conn)
    .await
    .expect("create trigger");
    conn.close().await.expect("close");

    let commits = ids
        .iter()
        .map(|id| {
            let claim = claims.iter().find(|c| c.instance.id == *id).expect("claimed");
            StepCommit::new(
                *id,
                claim.token(),
                Outcome::Done { result: json!({ "id": id.0 }), step: None },
            )
        })
        .collect();
    let receipts =
        store.step_commit(CommitParams { commits, now: at(20) }).await.expect("the batch commits");
    assert_eq!(receipts.len(), 3);
    assert_eq!(receipts[0].as_ref().expect("first accepted").status, Status::Done);
    let refused = receipts[1].as_ref().expect_err("the refused write rejects its item");
    assert_eq!(refused.kind, ErrorKind::Conflict);
    assert!(refused.message.contains("refused by the test"), "{}", refused.message);
    assert_eq!(receipts[2].as_ref().expect("third accepted").status, Status::Done);

    for (id, status) in [(ids[0], Status::Done), (ids[1], Status::Executing)] {
        let detail = store.instance_get(id).await.expect("get");
        assert_eq!(detail.instance.status, status, "instance {id:?}");
    }
    let third = store.instance_get(ids[2]).await.expect("get");
    assert_eq!(third.instance.status, Status::Done);
    assert_eq!(third.instance.result, Some(json!({ "id": ids[2].0 })));
    assert_eq!(
        third.history.iter().map(|h| h.entry.kind.as_str()).collect::<Vec<_>>(),
        ["STEP_DONE"]
    );
    assert!(store.instance_get(ids[1]).await.expect("get").history.is_empty());
}

/// Workers started together on one new file (a deploy that starts several at once) all
/// open it: one applies each migration, the others find it applied. (Each connection runs
/// on its own driver thread, so the four opens race in SQLite itself.)
#[tokio::test]
async fn processes_opening_one_new_file_at_once_all_open_it() {
    for round in 0..10 {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("shared.db");
        let opened = tokio::join!(
            SqliteStore::open(&path),
            SqliteStore::open(&path),
            SqliteStore::open(&path),
            SqliteStore::open(&path),
        );
        for store in [opened.0, opened.1, opened.2, opened.3] {
            if let Err(e) = store {
                panic!("round {round}: an open failed: {e}");
            }
        }
    }
}

/// A sweep whose only effect is expiring a join deadline (no event delivered) sets the
/// parent runnable, and so wakes a worker waiting for ready work.
#[tokio::test]
async fn a_sweep_that_expires_a_join_deadline_wakes_ready_waiters() {
    use keel_core::join::Join;
    use keel_core::outcome::Outcome;
    use keel_core::ports::store::TimerSweepParams;
    use keel_core::{NewInstance, Status};
    use keel_testkit::conformance::support::{at, claim_id, ctx, insert_one, new_in, row, step};
    let s = SqliteStore::memory().await.expect("open");
    let ns = "join_deadline_wake";
    let parent = insert_one(&s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(&s, ns, parent, at(10)).await;
    let children: Vec<NewInstance> = vec![new_in(ns)];
    let outcome = Outcome::schedule_children("join", children, ctx(1))
        .with_join(Join::all().within(Duration::from_secs(60)));
    step(&s, &claimed, outcome, at(20)).await;
    assert_eq!(row(&s, parent).await.status, Status::AwaitingChildren);
    // Use up the wake-up the setup's commits left for the next wait.
    let _ = tokio::time::timeout(Duration::from_millis(200), s.ready_wait()).await;
    let waiter = s.ready_wait();
    tokio::pin!(waiter);
    assert!(futures_poll_once(waiter.as_mut()).await.is_none(), "nothing woke it yet");
    let report = s
        .timer_sweep(TimerSweepParams {
            namespace: Some(ns.into()),
            machines: vec![],
            limit: 100,
            now: at(20 + 60_000),
        })
        .await
        .expect("sweep");
    assert_eq!((report.fired, report.exhausted), (0, 0), "a deadline delivers no event");
    assert_eq!(row(&s, parent).await.status, Status::Runnable, "the deadline woke the parent");
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the sweep that made the parent runnable wakes the waiting workers");
}
