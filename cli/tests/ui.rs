//! The dashboard in a real browser: headless Chromium driven over WebDriver (fantoccini +
//! Debian's `chromium` and `chromium-driver`) against a real `keel serve` process on a
//! loopback port, on SQLite and on PostgreSQL.
//!
//! Without chromium or chromedriver the test says SKIPPED loudly; under
//! `KEEL_REQUIRE_BACKENDS=1` their absence (or PostgreSQL's) is a failure. Screenshots of
//! every page go to `target/ui-screenshots/`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use keel::{
    ChartMachine, ConnectOptions, Definition, Keel, MachineRef, NewInstance, NewSignal, Outcome,
    StepContext, StepError, StepMachine, WorkerConfig, json,
};

const TOKEN_A: &str = "ui-token-for-namespace-a";
const TOKEN_B: &str = "ui-token-for-namespace-b";
const READ_A: &str = "ui-read-only-token-for-a";
const TOKENS: &str = r#"
[[tokens]]
token = "ui-token-for-namespace-a"
namespaces = ["a", "pages"]
access = "operate"

[[tokens]]
token = "ui-token-for-namespace-b"
namespaces = ["b"]
access = "operate"

[[tokens]]
token = "ui-read-only-token-for-a"
namespaces = ["a"]
access = "read"
"#;

fn required() -> bool {
    std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() == Ok("1")
}

fn which(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|name| {
        std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
    })
}

/// Kills and reaps a child process when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn screenshots() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"), PathBuf::from);
    let dir = target.join("ui-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `door`: closed ⇄ open, drawn by the dashboard from its JSON.
fn door() -> ChartMachine {
    ChartMachine::new(
        Definition::builder("door", 1)
            .initial("closed")
            .state("closed", |s| s.on_to("OPEN", "open"))
            .state("open", |s| s.on_to("CLOSE", "closed"))
            .build()
            .unwrap(),
    )
}

/// `flaky`: every step fails for good, so each instance becomes a dead letter.
struct Flaky;

#[keel::async_trait]
impl StepMachine for Flaky {
    fn machine(&self) -> MachineRef {
        MachineRef::new("flaky", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Err(StepError::fatal("the payment provider said no"))
    }
}

/// What the test put in the store.
struct Seeded {
    /// `door` in namespace a, key door-7, parked in `open`.
    door_a: i64,
    /// `door` in namespace b, key secret-b-key.
    door_b: i64,
    /// A dead letter of namespace b.
    letter_b: i64,
}

/// Dead letters in namespace `pages`: more than one page of the dead-letter list.
const PAGED_LETTERS: usize = 57;
/// The dead-letter list's page size.
const LETTER_PAGE: usize = 50;

async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts instances through the library, runs a worker until they sit where the test
/// wants them (a door open, two dead letters in `a`, one in `b`), and stops it.
async fn seed(url: &str, schema: &str) -> Seeded {
    let keel = Keel::connect_with(url, ConnectOptions::default().schema(schema)).await.unwrap();
    let chart = door();
    let config = WorkerConfig {
        poll_interval: Duration::from_millis(20),
        queues: vec![("default".into(), 4), ("jobs".into(), 4)],
        ..WorkerConfig::default()
    };
    let worker = keel.worker_with(config).register(chart.clone()).unwrap().register(Flaky).unwrap();
    let worker = worker.spawn().unwrap();
    let start = |ns: &str, key: &str| {
        chart.new_instance(json!({ "owner": key })).namespace(ns).business_key(key)
    };
    let door_a = keel.start(start("a", "door-7")).await.unwrap().id();
    let _other = keel.start(start("a", "door-8")).await.unwrap().id();
    let door_b = keel.start(start("b", "secret-b-key")).await.unwrap().id();
    let flaky = |ns: &str, key: &str| {
        NewInstance::new(MachineRef::new("flaky", 1), "charge")
            .namespace(ns)
            .queue("jobs")
            .business_key(key)
    };
    for (ns, key) in [("a", "charge-1"), ("a", "charge-2"), ("b", "secret-b-charge")] {
        keel.start(flaky(ns, key)).await.unwrap();
    }
    let paged = (0..PAGED_LETTERS).map(|i| flaky("pages", &format!("paged-{i}"))).collect();
    keel.start_many(paged).await.unwrap();
    until("the doors to settle", || async {
        keel.get(door_a).await.is_ok_and(|d| d.instance.position.contains("closed"))
    })
    .await;
    keel.send(NewSignal::new(door_a, "OPEN")).await.unwrap();
    until("door-7 to open", || async {
        keel.get(door_a).await.is_ok_and(|d| d.instance.position == r#"["open"]"#)
    })
    .await;
    let letters = |ns: &'static str| {
        let keel = keel.clone();
        async move {
            keel.dead_letters(keel::DeadLetterFilter {
                namespace: Some(ns.into()),
                machine: None,
                limit: 100,
                ..keel::DeadLetterFilter::default()
            })
            .await
            .unwrap()
        }
    };
    until("the dead letters", || async {
        letters("a").await.len() == 2
            && letters("b").await.len() == 1
            && letters("pages").await.len() == PAGED_LETTERS
    })
    .await;
    worker.shutdown().await;
    Seeded { door_a: door_a.0, door_b: door_b.0, letter_b: letters("b").await[0].id.0 }
}

fn serve(url: &str, schema: &str, dir: &Path) -> (Reaped, String) {
    let bin = assert_cmd::cargo::cargo_bin("keel");
    let migrate =
        Command::new(&bin).args(["--database-url", url, "--schema", schema, "migrate"]).output();
    assert!(migrate.as_ref().is_ok_and(|o| o.status.success()), "{migrate:?}");
    let charts = dir.join("charts");
    std::fs::create_dir_all(&charts).unwrap();
    std::fs::write(charts.join("door.json"), door().definition().to_json()).unwrap();
    let tokens = dir.join("tokens.toml");
    std::fs::write(&tokens, TOKENS).unwrap();
    let mut child = Command::new(&bin)
        .args(["--database-url", url, "--schema", schema, "serve", "--listen", "127.0.0.1:0"])
        .arg("--tokens")
        .arg(&tokens)
        .arg("--definitions")
        .arg(&charts)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let base = line.trim().strip_prefix("listening on ").expect("the address line").to_owned();
    (Reaped(child), base)
}

async fn browser(chromium: &Path, chromedriver: &Path) -> (Reaped, Client) {
    let port = free_port();
    let driver = Reaped(
        Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not listen on {port}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1280,900"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a chromium session");
    (driver, client)
}

async fn shot(c: &Client, store: &str, name: &str) {
    let png = c.screenshot().await.unwrap();
    std::fs::write(screenshots().join(format!("{store}-{name}.png")), png).unwrap();
}

async fn source(c: &Client) -> String {
    c.source().await.unwrap()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into()
}

fn status_of(base: &str, path: &str, token: &str) -> u16 {
    let request = agent().get(&format!("{base}{path}"));
    let request = request.header("Authorization", &format!("Bearer {token}"));
    request.call().unwrap().status().as_u16()
}

fn post_status(base: &str, path: &str, token: &str) -> u16 {
    let request = agent().post(&format!("{base}{path}"));
    let request = request.header("Authorization", &format!("Bearer {token}"));
    request.send("").unwrap().status().as_u16()
}

/// The ids of the dead letters listed on the current page, in page order.
async fn letter_ids(c: &Client) -> Vec<i64> {
    let mut ids = Vec::new();
    for row in c.find_all(Locator::Css("tr[data-dead-letter]")).await.unwrap() {
        let id = row.attr("data-dead-letter").await.unwrap().unwrap_or_default();
        ids.push(id.parse().unwrap());
    }
    ids
}

async fn drive(c: &Client, store: &str, base: &str, seeded: &Seeded) {
    // Sign in once with ?token=: the cookie carries it from then on.
    c.goto(&format!("{base}/ui/ns/a?token={TOKEN_A}")).await.unwrap();
    let url = c.current_url().await.unwrap();
    assert!(!url.as_str().contains("token="), "{store}: the token leaves the address bar: {url}");
    c.wait().for_element(Locator::Css("table#queues")).await.unwrap();
    let overview = source(c).await;
    assert!(overview.contains("flaky") && overview.contains("door"), "{store}: {overview}");
    assert!(
        overview.contains("id=\"workers-seen\"") && overview.contains("Last hour"),
        "{store}: the workers and last-hour panels: {overview}"
    );
    shot(c, store, "overview").await;

    // Find door-7 by its key and open its page: the chart shows `open` highlighted.
    c.goto(&format!("{base}/ui/ns/a/instances")).await.unwrap();
    c.find(Locator::Css("#filter-key")).await.unwrap().send_keys("door-7").await.unwrap();
    c.find(Locator::Css("#filter-apply")).await.unwrap().click().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.current_url().await.unwrap().as_str().contains("key=door-7") {
        assert!(Instant::now() < deadline, "{store}: the filter form did not submit");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.wait().for_element(Locator::Css("table#instances")).await.unwrap();
    let rows = c.find_all(Locator::Css("table#instances tr td:first-child a")).await.unwrap();
    assert_eq!(rows.len(), 1, "{store}: exactly door-7 matches its key");
    shot(c, store, "instances").await;
    rows[0].click().await.unwrap();
    let active = c
        .wait()
        .for_element(Locator::Css("#chart svg g.active[data-state=\"open\"]"))
        .await
        .unwrap_or_else(|e| panic!("{store}: no highlighted `open` state: {e}"));
    assert!(active.is_displayed().await.unwrap());
    let closed = c.find(Locator::Css("#chart svg g[data-state=\"closed\"]")).await.unwrap();
    let class = closed.attr("class").await.unwrap().unwrap_or_default();
    assert!(!class.contains("active"), "{store}: `closed` is not highlighted ({class})");
    let history = source(c).await;
    assert!(history.contains("MACROSTEP"), "{store}: the timeline lists the macrosteps");
    assert!(
        c.current_url().await.unwrap().path().ends_with(&format!("/instances/{}", seeded.door_a))
    );
    shot(c, store, "instance").await;

    // Retry one dead letter: it leaves the list.
    c.goto(&format!("{base}/ui/ns/a/dead-letters")).await.unwrap();
    let before = c.find_all(Locator::Css("tr[data-dead-letter]")).await.unwrap();
    assert_eq!(before.len(), 2, "{store}: two dead letters in a");
    shot(c, store, "dead-letters").await;
    let button = c.find(Locator::Css("button.retry-one")).await.unwrap();
    let id = button.attr("data-id").await.unwrap().unwrap();
    button.click().await.unwrap();
    c.wait().for_element(Locator::Css(".flash")).await.unwrap();
    let after = c.find_all(Locator::Css("tr[data-dead-letter]")).await.unwrap();
    assert_eq!(after.len(), 1, "{store}: one dead letter left");
    let gone = c.find_all(Locator::Css(&format!("tr[data-dead-letter=\"{id}\"]"))).await.unwrap();
    assert!(gone.is_empty(), "{store}: dead letter {id} left the list");

    // Page through more dead letters than one page holds: next, then previous, by cursor.
    c.goto(&format!("{base}/ui/ns/pages/dead-letters")).await.unwrap();
    let first = letter_ids(c).await;
    assert_eq!(first.len(), LETTER_PAGE, "{store}: a full first page");
    assert!(first.windows(2).all(|w| w[0] < w[1]), "{store}: oldest first: {first:?}");
    assert!(c.find(Locator::Css("#previous-page")).await.is_err(), "{store}: no page before");
    c.find(Locator::Css("#next-page")).await.unwrap().click().await.unwrap();
    c.wait().for_element(Locator::Css("#previous-page")).await.unwrap();
    let second = letter_ids(c).await;
    assert_eq!(second.len(), PAGED_LETTERS - LETTER_PAGE, "{store}: the rest on page two");
    assert!(second[0] > first[LETTER_PAGE - 1], "{store}: page two follows page one");
    assert!(c.find(Locator::Css("#next-page")).await.is_err(), "{store}: no page after");
    shot(c, store, "dead-letters-page-2").await;
    c.find(Locator::Css("#previous-page")).await.unwrap().click().await.unwrap();
    c.wait().for_element(Locator::Css("#next-page")).await.unwrap();
    assert_eq!(letter_ids(c).await, first, "{store}: previous returns to page one");

    // Pause the jobs queue: the flag shows.
    c.goto(&format!("{base}/ui/ns/a")).await.unwrap();
    c.find(Locator::Css("button[data-queue=\"jobs\"]")).await.unwrap().click().await.unwrap();
    c.wait()
        .for_element(Locator::Css("tr[data-queue=\"jobs\"] .badge.paused"))
        .await
        .unwrap_or_else(|e| panic!("{store}: no PAUSED flag on jobs: {e}"));
    shot(c, store, "paused").await;

    // A read-only token reads the overview but may not resume the queue.
    assert_eq!(status_of(base, "/ui/ns/a", READ_A), 200, "{store}: read token reads");
    assert_eq!(post_status(base, "/ui/ns/a/queues/jobs/resume", READ_A), 403, "{store}");
    c.refresh().await.unwrap();
    c.wait()
        .for_element(Locator::Css("tr[data-queue=\"jobs\"] .badge.paused"))
        .await
        .unwrap_or_else(|e| panic!("{store}: a read token's resume changed the queue: {e}"));

    // A queue paused with nothing in it (ahead of a deploy) is listed, counted in the
    // card and resumed from its own row; once resumed, it leaves the list.
    assert_eq!(post_status(base, "/v1/namespaces/a/queues/deploy/pause", TOKEN_A), 200, "{store}");
    c.refresh().await.unwrap();
    c.wait()
        .for_element(Locator::Css("tr[data-queue=\"deploy\"] .badge.paused"))
        .await
        .unwrap_or_else(|e| panic!("{store}: the empty paused queue is not listed: {e}"));
    let overview = source(c).await;
    let card = "<div class=\"k\">paused queues</div><div class=\"v\">2</div>";
    assert!(overview.contains(card), "{store}: jobs and deploy are counted: {overview}");
    shot(c, store, "paused-empty-queue").await;
    c.find(Locator::Css("tr[data-queue=\"deploy\"] button[data-queue=\"deploy\"]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The page still shows the pause's flash until the resume's page replaces it.
    until("the resume's page", || async { source(c).await.contains("Queue resumed.") }).await;
    let overview = source(c).await;
    assert!(!overview.contains("data-queue=\"deploy\""), "{store}: resumed: {overview}");

    // Token a sees nothing of namespace b, on any page or fragment, by either path.
    let b_paths = [
        "/ui/ns/b".to_owned(),
        "/ui/ns/b/".to_owned(),
        "/ui/ns/b/fragments/overview".to_owned(),
        "/ui/ns/b/instances".to_owned(),
        "/ui/ns/b/instances?key=secret-b-key".to_owned(),
        format!("/ui/ns/b/instances/{}", seeded.door_b),
        format!("/ui/ns/b/instances/{}/fragment", seeded.door_b),
        format!("/ui/ns/a/instances/{}", seeded.door_b),
        format!("/ui/ns/a/instances/{}/fragment", seeded.door_b),
        "/ui/ns/b/dead-letters".to_owned(),
        format!("/ui/ns/b/dead-letters/{}", seeded.letter_b),
        format!("/ui/ns/a/dead-letters/{}", seeded.letter_b),
    ];
    for path in &b_paths {
        c.goto(&format!("{base}{path}")).await.unwrap();
        let page = source(c).await;
        assert!(page.contains("Not found"), "{store}: {path} must be a 404 page:\n{page}");
        assert!(!page.contains("secret-b"), "{store}: {path} leaks namespace b");
        assert_eq!(status_of(base, path, TOKEN_A), 404, "{store}: {path}");
    }
    for path in
        ["/ui/ns/a", "/ui/ns/a/instances", "/ui/ns/a/dead-letters", "/ui/ns/a/fragments/overview"]
    {
        c.goto(&format!("{base}{path}")).await.unwrap();
        assert!(!source(c).await.contains("secret-b"), "{store}: {path} shows namespace b");
    }
    shot(c, store, "not-found").await;
    // Token b sees its own instance, so the checks above were not vacuous.
    let path = format!("/ui/ns/b/instances/{}", seeded.door_b);
    assert_eq!(status_of(base, &path, TOKEN_B), 200, "{store}: b sees its own");
    assert_eq!(status_of(base, "/ui/ns/a", "not-a-token-at-all-000"), 303, "{store}: login");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_a_browser_shows_finds_retries_pauses_and_isolates_namespaces() {
    let (Some(chromium), Some(chromedriver)) = (
        which(&["chromium", "chromium-browser", "google-chrome"]),
        which(&["chromedriver", "chromium-driver"]),
    ) else {
        assert!(
            !required(),
            "KEEL_REQUIRE_BACKENDS=1 but chromium or chromedriver is missing; install them with `apt-get install -y chromium chromium-driver`"
        );
        eprintln!(
            "SKIPPED the dashboard browser test: chromium or chromedriver not on PATH (apt-get install -y chromium chromium-driver)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut stores = vec![(
        "sqlite",
        format!("sqlite://{}", dir.path().join("keel.db").display()),
        "keel".to_owned(),
    )];
    if let Some(url) = keel::layers::postgres::testing::database_url() {
        stores.push(("postgres", url, keel::layers::postgres::testing::unique_schema()));
    } else {
        assert!(!required(), "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset");
        eprintln!("SKIPPED the postgres part of the dashboard test: set KEEL_TEST_DATABASE_URL");
    }
    let (_driver, client) = browser(&chromium, &chromedriver).await;
    for (store, url, schema) in stores {
        let work = tempfile::tempdir().unwrap();
        let (_server, base) = serve(&url, &schema, work.path());
        let seeded = seed(&url, &schema).await;
        drive(&client, store, &base, &seeded).await;
        // A fresh cookie jar for the next store's server (another port, same host).
        client.delete_all_cookies().await.unwrap();
    }
    client.close().await.unwrap();
}
