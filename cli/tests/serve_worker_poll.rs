//! The worker protocol's long poll, with `keel serve`'s router run in-process so a test
//! can set the cap of waiting polls and the pauses between claim rounds, and watch how
//! many polls are waiting: a waiting poll gets a task started while it waits, through the
//! store's ready hint long before its pause would end; polls beyond the cap get 429 with
//! `Retry-After`; a shutdown ends the waiting polls at once, and a stopping server hands
//! out no task. On SQLite and PostgreSQL (a fresh schema when
//! `KEEL_TEST_DATABASE_URL` is set; SKIPPED loudly otherwise, a failure under
//! `KEEL_REQUIRE_BACKENDS=1`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::{ConnectOptions, Keel, MachineRef, NewInstance};
use keel_cli::serve::{AppState, POLLS_WAITING_MAX, serve_until};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A poll for `echo` tasks waiting up to `wait_ms`.
fn poll_body(worker: &str, wait_ms: u64) -> String {
    format!(
        r#"{{"worker":"{worker}","namespace":"default","machines":[{{"name":"echo","version":1}}],"wait_ms":{wait_ms}}}"#
    )
}

/// SQLite in a fresh file, and PostgreSQL on a fresh schema when configured.
async fn stores(test: &str) -> Vec<(&'static str, Keel, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("keel.db").display());
    let mut all = vec![("sqlite", Keel::connect(&url).await.unwrap(), Some(dir))];
    if let Some(url) = keel::layers::postgres::testing::database_url() {
        let schema = keel::layers::postgres::testing::unique_schema();
        let options = ConnectOptions::default().schema(schema).pool_size(4);
        all.push(("postgres", Keel::connect_with(&url, options).await.unwrap(), None));
    } else {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run {test}"
        );
        eprintln!("SKIPPED postgres part of {test}: set KEEL_TEST_DATABASE_URL to run it");
    }
    all
}

/// The router serving on a loopback port until `stop` is sent.
struct Served {
    base: String,
    state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn serve(keel: Keel, polls_waiting: usize) -> Served {
    serve_with(keel, polls_waiting, |_| {}).await
}

/// [`serve`], with `set` changing the state first.
async fn serve_with(keel: Keel, polls_waiting: usize, set: impl FnOnce(&mut AppState)) -> Served {
    let metrics = keel::prometheus::install().unwrap();
    let mut state = AppState::open(keel, "default", metrics);
    state.polls_waiting = tokio::sync::Semaphore::new(polls_waiting);
    set(&mut state);
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve_until(listener, Arc::clone(&state), async move {
        let _ = stopped.await;
    }));
    Served { base, state, stop: Some(stop), task }
}

impl Served {
    /// Long polls waiting now.
    fn waiting(&self, cap: usize) -> usize {
        cap - self.state.polls_waiting.available_permits()
    }

    /// Waits (at most 10 s) until `n` long polls are waiting.
    async fn until_waiting(&self, n: usize, cap: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.waiting(cap) != n {
            assert!(Instant::now() < deadline, "{} polls waiting, not {n}", self.waiting(cap));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The answer to a poll posted from a blocking thread: status, `Retry-After` and body.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Value,
}

fn post_poll(base: &str, body: String) -> JoinHandle<Answer> {
    let url = format!("{base}/v1/worker/tasks/poll");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let mut resp =
            agent.post(&url).content_type("application/json").send(body.as_str()).unwrap();
        let retry_after =
            resp.headers().get("retry-after").map(|v| v.to_str().unwrap_or_default().to_owned());
        let text = resp.body_mut().read_to_string().unwrap();
        Answer {
            status: resp.status().as_u16(),
            retry_after,
            body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        }
    })
}

/// Starts an `echo` instance, checks that the waiting `poll` is answered with it, and
/// returns how long after the start the answer came.
async fn start_and_answer(keel: &Keel, poll: JoinHandle<Answer>, name: &str) -> Duration {
    let started = Instant::now();
    let id = keel.start(NewInstance::new(MachineRef::new("echo", 1), "run")).await.unwrap().id();
    let answer = poll.await.unwrap();
    let after = started.elapsed();
    assert_eq!(answer.status, 200, "{name}: {}", answer.body);
    assert_eq!(answer.body["id"].as_i64(), Some(id.0), "{name}: {}", answer.body);
    after
}

/// A poll waiting for work gets a task started while it waits, long before its wait ends:
/// the wait's back-off and the store's ready hint do not leave it sleeping past the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_poll_gets_a_task_started_while_it_waits() {
    for (name, keel, _dir) in stores("a_waiting_poll_gets_a_task_started_while_it_waits").await {
        let served = serve(keel.clone(), POLLS_WAITING_MAX).await;
        let poll = post_poll(&served.base, poll_body("w1", 5_000));
        served.until_waiting(1, POLLS_WAITING_MAX).await;
        // Let the poll's pause grow past its first steps before the work comes.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let after = start_and_answer(&keel, poll, name).await;
        assert!(after < Duration::from_secs(3), "{name}: the task came {after:?} after its start");
        assert_eq!(served.waiting(POLLS_WAITING_MAX), 0, "{name}: the poll gave its place back");
    }
}

/// A poll whose pause has grown long gets a task started while it waits through the
/// store's ready hint, not the pause: with pauses of 2 s doubling to a minute, the rounds
/// fall about 2, 6, 14 and 30 s after the first, so a task started 7 s in would wait until
/// the 14 s round without the hint, and comes within a first pause or so with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backed_off_poll_gets_a_task_through_the_store_hint() {
    for (name, keel, _dir) in stores("a_backed_off_poll_gets_a_task_through_the_store_hint").await {
        let served = serve_with(keel.clone(), POLLS_WAITING_MAX, |state| {
            state.poll_interval_min = Duration::from_secs(2);
            state.poll_interval_max = Duration::from_secs(60);
        })
        .await;
        let poll = post_poll(&served.base, poll_body("w1", 30_000));
        served.until_waiting(1, POLLS_WAITING_MAX).await;
        tokio::time::sleep(Duration::from_secs(7)).await;
        let after = start_and_answer(&keel, poll, name).await;
        assert!(
            after < Duration::from_secs(5),
            "{name}: the task came {after:?} after its start: the poll slept through the store's ready hint"
        );
    }
}

/// A server that is shutting down hands out no task, whether the poll waits or not: it
/// answers 204, and the task stays runnable with no attempt counted, for the next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_hands_out_no_task() {
    for (name, keel, _dir) in stores("a_stopping_server_hands_out_no_task").await {
        let served = serve(keel.clone(), POLLS_WAITING_MAX).await;
        let id =
            keel.start(NewInstance::new(MachineRef::new("echo", 1), "run")).await.unwrap().id();
        // The server still takes requests, as it does for a request read on a kept-alive
        // connection while it shuts down.
        served.state.stop();
        for wait_ms in [0, 5_000] {
            let answer = post_poll(&served.base, poll_body("w1", wait_ms)).await.unwrap();
            assert_eq!(answer.status, 204, "{name}, wait_ms {wait_ms}: {}", answer.body);
        }
        let row = keel.get(id).await.unwrap().instance;
        assert_eq!(row.lease_owner, None, "{name}: the task was leased");
        assert_eq!(row.attempt, 0, "{name}");

        served.state.stopping.send_replace(false);
        let answer = post_poll(&served.base, poll_body("w2", 0)).await.unwrap();
        assert_eq!(answer.status, 200, "{name}: {}", answer.body);
        assert_eq!(answer.body["id"].as_i64(), Some(id.0), "{name}: {}", answer.body);
        assert_eq!(answer.body["attempt"].as_i64(), Some(0), "{name}: {}", answer.body);
    }
}

/// Polls beyond the cap of waiting polls are refused with 429 and `Retry-After`, naming
/// `wait_ms`, before they touch the store; polls that do not wait are still served; and a
/// shutdown answers the waiting polls at once instead of after their `wait_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_beyond_the_cap_get_429_and_a_shutdown_ends_the_waiting_ones() {
    const CAP: usize = 2;
    for (name, keel, _dir) in
        stores("polls_beyond_the_cap_get_429_and_a_shutdown_ends_the_waiting_ones").await
    {
        let mut served = serve(keel, CAP).await;
        let first = post_poll(&served.base, poll_body("w1", 30_000));
        let second = post_poll(&served.base, poll_body("w2", 30_000));
        served.until_waiting(CAP, CAP).await;

        let third = post_poll(&served.base, poll_body("w3", 5_000)).await.unwrap();
        assert_eq!(third.status, 429, "{name}: {}", third.body);
        assert_eq!(third.retry_after.as_deref(), Some("1"), "{name}");
        assert_eq!(third.body["field"], "wait_ms", "{name}: {}", third.body);
        let error = third.body["error"].as_str().unwrap_or_default();
        assert!(error.contains("fewer polling workers") && error.contains("shorter wait_ms"));
        let now = post_poll(&served.base, poll_body("w4", 0)).await.unwrap();
        assert_eq!(now.status, 204, "{name}: a poll that does not wait needs no place");

        let stop = Instant::now();
        served.stop.take().unwrap().send(()).unwrap();
        for poll in [first, second] {
            let answer = poll.await.unwrap();
            assert_eq!(answer.status, 204, "{name}: {}", answer.body);
        }
        let ended = stop.elapsed();
        assert!(ended < Duration::from_secs(5), "{name}: the waiting polls ended {ended:?} late");
        tokio::time::timeout(Duration::from_secs(10), served.task)
            .await
            .expect("the server stops once the polls are answered")
            .unwrap()
            .unwrap();
    }
}
