//! A poison row — a stored value no JSON reader accepts, planted straight into the
//! database past every check the client makes — must fail that instance alone. One
//! instance gets a poison context, another a poison signal in its inbox; a real `Worker`
//! runs 100 two-step instances next to them, on a SQLite file and on PostgreSQL (when
//! `KEEL_TEST_DATABASE_URL` is set; required under `KEEL_REQUIRE_BACKENDS=1`): all 100
//! finish, both poisoned instances end suspended in the dead-letter queue with the decode
//! error, `get` shows them, `cancel` ends them, and the stored value is still there.

use async_trait::async_trait;
use keel_core::instance::{NewInstance, undecodable_error};
use keel_core::outcome::UNDECODABLE_REASON;
use keel_core::ports::Store;
use keel_core::ports::store::DeadLetterFilter;
use keel_core::{InstanceId, MachineRef, Outcome, Status, WorkerId};
use keel_scheduler::{
    Client, StepContext, StepError, StepMachine, SystemClock, Worker, WorkerConfig,
};
use keel_store_postgres::PgStore;
use keel_store_sqlite::SqliteStore;
use serde_json::json;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

const NEIGHBOURS: usize = 100;
/// Far past the 128 levels serde_json reads back.
const POISON_DEPTH: usize = 200;
/// Longest the test waits for the neighbours (real time; they take well under a second).
const FINISH_WITHIN: Duration = Duration::from_secs(30);

/// Two steps, then done.
struct TwoSteps;

#[async_trait]
impl StepMachine for TwoSteps {
    fn machine(&self) -> MachineRef {
        MachineRef::new("two_steps", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(match ctx.step.as_str() {
            "one" => Outcome::Next { step: "two".into(), context: json!({ "one": true }) },
            _ => Outcome::Done { result: json!({ "two": true }), step: None },
        })
    }
}

/// `{"d": {"d": … {} …}}`, `POISON_DEPTH` objects deep, as JSON text.
fn poison_text() -> String {
    format!("{}{{}}{}", "{\"d\": ".repeat(POISON_DEPTH), "}".repeat(POISON_DEPTH))
}

/// Runs the scenario on `store`. `plant(a, b)` writes [`poison_text`] behind the store's
/// back as the context of `a` and as the payload of a new signal in the inbox of `b`;
/// `stored` reads the raw text of an instance's context column.
async fn poison_fails_alone<S, P, PF, R, RF>(store: S, plant: P, stored: R)
where
    S: Store + 'static,
    P: FnOnce(InstanceId, InstanceId) -> PF,
    PF: Future<Output = ()>,
    R: FnOnce(InstanceId) -> RF,
    RF: Future<Output = String>,
{
    let store = Arc::new(store);
    let client = Client::new(Arc::clone(&store), SystemClock);
    let new = || NewInstance::new(TwoSteps.machine(), "one");
    // The poison rows are inserted first, so they are in the first claim batch with others.
    let batch = (0..NEIGHBOURS + 2).map(|_| new()).collect();
    let ids: Vec<InstanceId> =
        client.start_many(batch).await.expect("start").iter().map(|o| o.id()).collect();
    let (poison, poison_inbox, neighbours) = (ids[0], ids[1], &ids[2..]);
    plant(poison, poison_inbox).await;

    let config = WorkerConfig {
        worker_id: WorkerId("poison-test".into()),
        queues: vec![("default".into(), 20)],
        claim_batch: 50,
        poll_interval: Duration::from_millis(20),
        reap_interval: Duration::from_millis(50),
        heartbeat: Duration::from_millis(200),
        shutdown_grace: Duration::from_millis(500),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(Arc::clone(&store), SystemClock, config).register(TwoSteps).spawn();
    let started = Instant::now();
    let mut unfinished = neighbours.to_vec();
    while !unfinished.is_empty() && started.elapsed() < FINISH_WITHIN {
        let rows = store.instance_rows(unfinished.clone()).await.expect("instance_rows");
        unfinished = rows.iter().filter(|r| r.status != Status::Done).map(|r| r.id).collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let detail = client.get(poison).await.expect("get works on the poison row");
    let inbox_detail = client.get(poison_inbox).await.expect("get works on the poison inbox");
    worker.shutdown().await;
    assert!(
        unfinished.is_empty(),
        "{} of {NEIGHBOURS} neighbours did not finish beside the poison row (it is {:?})",
        unfinished.len(),
        detail.instance.status
    );

    let row = &detail.instance;
    assert_eq!(row.status, Status::Suspended, "the poison row is dead-lettered");
    let error = row.last_error.clone().unwrap_or_default();
    assert!(error.contains("context") && error.contains("recursion limit"), "{error}");
    assert!(
        undecodable_error(&row.context).is_some(),
        "get shows the undecodable context as a marker: {}",
        row.context
    );
    let letters = client.dead_letters(DeadLetterFilter::default()).await.expect("dead letters");
    assert_eq!(letters.len(), 2, "{letters:?}");
    let letter = &letters[0].letter;
    assert_eq!((letter.instance, letter.reason.as_str()), (poison, UNDECODABLE_REASON));
    assert_eq!(letter.errors.last().map(|e| e.error.as_str()), Some(error.as_str()));
    let kinds: Vec<&str> = detail.history.iter().map(|h| h.entry.kind.as_str()).collect();
    assert!(kinds.ends_with(&["ROW_UNDECODABLE", "DEAD_LETTERED"]), "{kinds:?}");

    let row = &inbox_detail.instance;
    assert_eq!(row.status, Status::Suspended, "a poison signal dead-letters its target");
    let error = row.last_error.clone().unwrap_or_default();
    assert!(error.contains("inbox") && error.contains("recursion limit"), "{error}");
    assert_eq!(letters[1].letter.instance, poison_inbox);
    assert_eq!(inbox_detail.inbox.len(), 1, "the poison signal is kept");

    for id in [poison, poison_inbox] {
        let cancelled = client
            .cancel(keel_scheduler::Cancel::new(id).reason("poison"))
            .await
            .expect("cancel works");
        assert_eq!(cancelled, vec![id]);
        assert_eq!(client.get(id).await.expect("get").instance.status, Status::Cancelled);
    }
    let text = stored(poison).await;
    assert_eq!(text.matches("\"d\"").count(), POISON_DEPTH, "the stored value is kept: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_poison_row_fails_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("poison.db").display().to_string();
    let store = SqliteStore::open(&path).await.expect("open");
    let url = format!("sqlite://{path}");
    let plant = |context: InstanceId, inbox: InstanceId| {
        let url = url.clone();
        async move {
            let mut c = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
                .await
                .expect("a second connection to the file");
            sqlx::query("UPDATE keel_instances SET context = ? WHERE id = ?")
                .bind(poison_text())
                .bind(context.0)
                .execute(&mut c)
                .await
                .expect("plant the poison value");
            sqlx::query(
                "INSERT INTO keel_signals (target_id, name, payload, inserted_at) \
                 VALUES (?, 'POISON', ?, 0)",
            )
            .bind(inbox.0)
            .bind(poison_text())
            .execute(&mut c)
            .await
            .expect("plant the poison signal");
        }
    };
    let stored = |id: InstanceId| {
        let url = url.clone();
        async move {
            let mut c = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
                .await
                .expect("a second connection to the file");
            sqlx::query_scalar("SELECT context FROM keel_instances WHERE id = ?")
                .bind(id.0)
                .fetch_one(&mut c)
                .await
                .expect("read the stored value")
        }
    };
    poison_fails_alone(store, plant, stored).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_poison_row_fails_alone() {
    let Some(store) = keel_testkit::conformance::backend_or_skip(
        "postgres_poison_row_fails_alone",
        keel_store_postgres::testing::DATABASE_URL_VAR,
        keel_store_postgres::testing::fresh_schema_with(8).await,
    ) else {
        return;
    };
    let raw: Arc<PgStore> = Arc::new(store.clone());
    let plant = {
        let raw = Arc::clone(&raw);
        move |context: InstanceId, inbox: InstanceId| async move {
            let c = raw.client().await.expect("a connection");
            c.execute(
                "UPDATE instances SET context = $1::text::jsonb WHERE id = $2",
                &[&poison_text(), &context.0],
            )
            .await
            .expect("plant the poison value");
            c.execute(
                "INSERT INTO signals (target_id, name, payload, inserted_at) \
                 VALUES ($1, 'POISON', $2::text::jsonb, now())",
                &[&inbox.0, &poison_text()],
            )
            .await
            .expect("plant the poison signal");
        }
    };
    let stored = move |id: InstanceId| async move {
        let c = raw.client().await.expect("a connection");
        c.query_one("SELECT context::text FROM instances WHERE id = $1", &[&id.0])
            .await
            .expect("read the stored value")
            .try_get(0)
            .expect("text")
    };
    poison_fails_alone(store, plant, stored).await;
}
