//! The real `keel` binary against SQLite (a file in a temporary directory) and PostgreSQL
//! (a fresh schema, when `KEEL_TEST_DATABASE_URL` is set; SKIPPED loudly otherwise and a
//! failure under `KEEL_REQUIRE_BACKENDS=1`). Every command runs in its human and `--json`
//! form; failures are checked by exit code and message, and by reading the store after.

use std::time::Duration;

use assert_cmd::Command;
use keel::{
    ConnectOptions, Keel, MachineRef, NewInstance, Outcome, Status, StepContext, StepError,
    StepMachine, WorkerConfig, json,
};
use serde_json::Value;

/// One store the binary and the test both open.
struct Backend {
    name: &'static str,
    url: String,
    schema: String,
    _dir: Option<tempfile::TempDir>,
}

impl Backend {
    fn keel_cmd(&self) -> Command {
        let mut cmd = Command::cargo_bin("keel").expect("the keel binary is built");
        cmd.env("KEEL_DATABASE_URL", &self.url)
            .env("KEEL_SCHEMA", &self.schema)
            .env_remove("KEEL_NAMESPACE")
            .env_remove("KEEL_CONFIG");
        cmd
    }

    /// Runs `keel <args>`, expects `code`, and returns stdout and stderr.
    fn run(&self, args: &[&str], code: i32) -> (String, String) {
        let out = self.keel_cmd().args(args).output().expect("keel runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(
            out.status.code(),
            Some(code),
            "{}: keel {args:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            self.name
        );
        (stdout, stderr)
    }

    /// Runs `keel --json <args>`, expects success, and parses the document.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let (stdout, _) = self.run(&all, 0);
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{}: {args:?}: {e}: {stdout}", self.name))
    }

    /// Runs `keel --json <args>`, expects `code`, and parses the document.
    fn json_code_of(&self, args: &[&str], code: i32) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let (stdout, _) = self.run(&all, code);
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{}: {args:?}: {e}: {stdout}", self.name))
    }

    async fn open(&self) -> Keel {
        let options = ConnectOptions::default().schema(&self.schema).pool_size(2);
        Keel::connect_with(&self.url, options).await.expect("the test opens the store")
    }
}

/// SQLite in a fresh file, and PostgreSQL on a fresh schema when configured.
fn backends(test: &str) -> Vec<Backend> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite://{}", dir.path().join("keel.db").display());
    let mut all = vec![Backend { name: "sqlite", url, schema: "keel".into(), _dir: Some(dir) }];
    if let Some(url) = keel::layers::postgres::testing::database_url() {
        let schema = keel::layers::postgres::testing::unique_schema();
        all.push(Backend { name: "postgres", url, schema, _dir: None });
    } else {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run {test}"
        );
        eprintln!("SKIPPED postgres part of {test}: set KEEL_TEST_DATABASE_URL to run it");
    }
    all
}

#[test]
fn instances_start_receive_events_pause_and_cancel() {
    for b in backends("instances_start_receive_events_pause_and_cancel") {
        let (out, _) = b.run(&["migrate"], 0);
        assert!(out.contains("up to date"), "{out}");

        let started = b.json(&["start", "ticket", "--key", "T-1", "--context", r#"{"n":1}"#]);
        assert_eq!(started["inserted"], true);
        let id = started["id"].as_i64().expect("an id");
        let (out, _) = b.run(&["start", "ticket", "--key", "T-2"], 0);
        assert!(out.starts_with("Started i"), "{out}");

        let sent = b.json(&["send", "ticket:T-1", "START", "--payload", r#"{"by":"ops"}"#]);
        assert_eq!(sent["outcome"], "delivered");
        assert_eq!(sent["target"], id);
        let (out, _) = b.run(&["send", &format!("i{id}"), "PING"], 0);
        assert!(out.contains("Delivered PING"), "{out}");

        let shown = b.json(&["inspect", "ticket:T-1"]);
        assert_eq!(shown["instance"]["id"], id);
        assert_eq!(shown["instance"]["context"], json!({ "n": 1 }));
        let events: Vec<&str> = shown["inbox"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        assert_eq!(events, ["START", "PING"]);
        let (out, _) = b.run(&["inspect", &id.to_string()], 0);
        assert!(out.contains("status:   runnable") && out.contains("START"), "{out}");

        let status = b.json(&["status"]);
        let row = &status["queues"][0];
        assert_eq!((row["machine"].as_str(), row["ready"].as_u64()), (Some("ticket"), Some(2)));
        assert_eq!(row["paused"], false);

        let paused = b.json(&["pause", "default"]);
        assert_eq!((paused["paused"].as_bool(), paused["pending"].as_u64()), (Some(true), Some(2)));
        assert_eq!(paused["in_use"], true);
        // A queue nothing runs in can be paused ahead of time, but a typo looks the same.
        let (out, _) = b.run(&["pause", "defualt"], 0);
        assert!(out.contains("PAUSED (0 pending)") && out.contains("check the name"), "{out}");
        b.run(&["resume", "defualt"], 0);
        let (out, _) = b.run(&["status", "--machine", "ticket"], 0);
        assert!(out.contains("PAUSED"), "{out}");
        assert_eq!(b.json(&["status"])["queues"][0]["paused"], true);
        let (out, _) = b.run(&["resume", "default"], 0);
        assert!(out.contains("running (2 pending)"), "{out}");
        // Resuming a queue that is not paused writes nothing: a running one says so, and
        // a name with no pause and no work (a typo) is an error naming the closest queue,
        // every time (no settings row makes the typo a known queue).
        let again = b.json(&["resume", "default"]);
        assert_eq!((&again["changed"], &again["pending"]), (&json!(false), &json!(2)), "{again}");
        let (out, _) = b.run(&["resume", "default"], 0);
        assert!(out.contains("running (2 pending); it was not paused, nothing changed"), "{out}");
        for _ in 0..2 {
            let (_, err) = b.run(&["resume", "defaul"], 1);
            assert!(
                err.contains(
                    "queue: \"defaul\" in namespace \"default\" is not paused and holds no unfinished instance, so nothing was resumed; check the name, did you mean `default`?"
                ),
                "{}: {err}",
                b.name
            );
        }
        assert_eq!(b.json(&["status", "--machine", "ticket"])["queues"][0]["paused"], false);
        assert_eq!(b.json(&["status", "--machine", "nothing"])["queues"], json!([]));

        let cancelled = b.json(&["cancel", "ticket:T-1", "--reason", "duplicate"]);
        assert_eq!(cancelled["cancelled"], json!([id]));
        let (_, err) = b.run(&["send", "ticket:T-1", "START"], 1);
        assert!(err.contains("has ended (cancelled)"), "{err}");
        let (out, _) = b.run(&["cancel", "ticket:T-1"], 0);
        assert!(out.contains("already ended"), "{out}");

        assert_eq!(b.json(&["timers", "status"])["machines"], json!([]));
        let (out, _) = b.run(&["timers", "status"], 0);
        assert!(out.contains("No armed timers"), "{out}");
    }
}

/// A step machine whose only step fails for good: every instance ends in the dead-letter
/// queue.
struct Refuser;

#[keel::async_trait]
impl StepMachine for Refuser {
    fn machine(&self) -> MachineRef {
        MachineRef::new("refuser", 1)
    }

    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Err(StepError::fatal("card declined"))
    }
}

/// Two dead letters of `refuser`, made by a real worker.
async fn two_dead_letters(b: &Backend) {
    two_dead_letters_in(b, "default").await;
}

async fn two_dead_letters_in(b: &Backend, ns: &str) {
    dead_letters_in(b, ns, &["a", "b"]).await;
}

/// One dead letter of `refuser` per key, oldest first, made by a real worker; returns
/// their instances in the same order.
async fn dead_letters_in(b: &Backend, ns: &str, keys: &[&str]) -> Vec<keel::InstanceId> {
    let keel = b.open().await;
    let config = WorkerConfig {
        poll_interval: Duration::from_millis(20),
        namespaces: vec![ns.to_owned()],
        ..WorkerConfig::default()
    };
    let worker = keel.worker_with(config).register(Refuser).unwrap().spawn().unwrap();
    let mut ids = Vec::new();
    for &key in keys {
        let new = NewInstance::new(MachineRef::new("refuser", 1), "charge")
            .business_key(key)
            .namespace(ns);
        ids.push(keel.start(new).await.unwrap().id());
    }
    for id in &ids {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while keel.get(*id).await.unwrap().instance.status != Status::Suspended {
            assert!(std::time::Instant::now() < deadline, "{}: {id} never dead-lettered", b.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    worker.shutdown().await;
    ids
}

fn write_config(dir: &tempfile::TempDir, alerts: &str) -> String {
    let path = dir.path().join("keel.toml");
    std::fs::write(&path, format!("[queue.alerts]\n{alerts}\n")).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_drive_health_and_can_be_retried_and_purged() {
    for b in backends("dead_letters_drive_health_and_can_be_retried_and_purged") {
        b.run(&["migrate"], 0);
        two_dead_letters(&b).await;
        let dir = tempfile::tempdir().unwrap();

        let listed = b.json(&["dlq", "list", "--machine", "refuser"]);
        let letters = listed["dead_letters"].as_array().unwrap();
        assert_eq!(letters.len(), 2, "{}: {listed}", b.name);
        let first = letters[0]["id"].as_i64().unwrap();
        let second = letters[1]["id"].as_i64().unwrap();
        assert_eq!(listed["next"], json!(null), "{}: the whole list fits one page", b.name);
        // A page at a time: `next` is the last id of a full page, `--after` continues.
        let one = b.json(&["dlq", "list", "--limit", "1"]);
        assert_eq!(
            (one["dead_letters"][0]["id"].as_i64(), one["next"].as_i64()),
            (Some(first), Some(first))
        );
        let after = format!("dl{first}");
        let two = b.json(&["dlq", "list", "--limit", "1", "--after", &after]);
        assert_eq!(two["dead_letters"][0]["id"].as_i64(), Some(second), "{}: {two}", b.name);
        let end = b.json(&["dlq", "list", "--limit", "1", "--after", &second.to_string()]);
        assert_eq!((end["dead_letters"].clone(), end["next"].clone()), (json!([]), json!(null)));
        let (_, err) = b.run(&["dlq", "list", "--limit", "0"], 1);
        assert!(err.contains("--limit"), "{err}");
        let (_, err) = b.run(&["dlq", "list", "--after", "dl-x"], 1);
        assert!(err.contains("--after"), "{err}");
        let (out, _) = b.run(&["dlq", "list"], 0);
        assert!(out.contains("card declined") && out.contains("non_retryable"), "{out}");
        let (out, _) = b.run(&["dlq", "list", "--machine", "refuser", "--limit", "1"], 0);
        let hint = format!("More: keel dlq list --machine refuser --limit 1 --after dl{first}");
        assert!(out.contains(&hint), "{}: the hint keeps the filters: {out}", b.name);

        let one = b.json(&["dlq", "inspect", &format!("dl{first}")]);
        assert_eq!(one["letter"]["errors"][0]["error"], "card declined");
        let (out, _) = b.run(&["dlq", "inspect", &first.to_string()], 0);
        assert!(out.contains("card declined") && out.contains("charge"), "{out}");

        let status = b.json(&["status", "--machine", "refuser"]);
        assert_eq!(status["queues"][0]["dead_letters"], 2);
        assert_eq!(status["queues"][0]["suspended"], 2);

        // No thresholds: nothing to hold the counts against, so no "healthy" either.
        let (out, err) = b.run(&["health"], 1);
        assert!(!out.contains("HEALTHY"), "{out}");
        assert!(err.contains("--config: no alert thresholds configured"), "{err}");
        assert!(err.contains("[queue.alerts]"), "says what to add: {err}");
        let empty = write_config(&dir, "");
        let (_, err) = b.run(&["health", "--config", &empty], 1);
        assert!(err.contains("has no [queue.alerts]") && err.contains(&empty), "{err}");
        let doc = b.keel_cmd().args(["--json", "health"]).output().unwrap();
        assert_eq!(doc.status.code(), Some(1));
        let body: Value = serde_json::from_slice(&doc.stdout).unwrap();
        assert!(body["error"].as_str().unwrap().contains("--config"), "{body}");
        let warn = write_config(&dir, "dlq_warning = 2\ndlq_critical = 5");
        let (out, _) = b.run(&["health", "--config", &warn], 1);
        assert!(out.starts_with("WARNING") && out.contains("dead_letters"), "{out}");
        let crit = write_config(&dir, "dlq_warning = 1\ndlq_critical = 2");
        let out = b.keel_cmd().args(["--json", "health", "--config", &crit]).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["status"], "critical");
        assert_eq!(report["findings"][0]["value"], 2);
        let pending = write_config(&dir, "pending_warning = 1");
        b.run(&["health", "--config", &pending], 0);
        // The machine in a second queue: its dead letters still count once.
        b.run(&["start", "refuser", "--queue", "payments", "--at", "charge"], 0);
        let status = b.json(&["status", "--machine", "refuser"]);
        let rows = status["queues"].as_array().unwrap();
        assert_eq!(rows.len(), 2, "{}: {status}", b.name);
        let sum: u64 = rows.iter().map(|r| r["dead_letters"].as_u64().unwrap()).sum();
        assert_eq!(sum, 2, "{}: each dead letter once: {status}", b.name);
        let once = write_config(&dir, "dlq_warning = 2");
        let report = b.json_code_of(&["health", "--config", &once], 1);
        let findings = report["findings"].as_array().unwrap();
        assert_eq!(findings.len(), 1, "{}: one finding per machine: {report}", b.name);
        assert_eq!(
            (&findings[0]["check"], &findings[0]["value"]),
            (&json!("dead_letters"), &json!(2))
        );
        let wrong = write_config(&dir, "dlq_warning = 9\ndlq_critical = 2");
        let (_, err) = b.run(&["health", "--config", &wrong], 1);
        assert!(err.contains("queue.alerts.dlq_warning"), "{err}");

        let retried = b.json(&["dlq", "retry", &first.to_string()]);
        assert_eq!(retried["retried"].as_array().unwrap().len(), 1);
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"].as_array().unwrap().len(), 1);

        let (_, err) = b.run(&["dlq", "purge", "--older-than", "0s"], 1);
        assert!(err.contains("--confirm"), "{err}");
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"].as_array().unwrap().len(), 1);
        // Another namespace's dead letters are not this purge's business.
        two_dead_letters_in(&b, "other").await;
        // The one left is how its still suspended instance is retried: kept, and said.
        let purged = b.json(&["dlq", "purge", "--older-than", "0s", "--confirm"]);
        assert_eq!(
            (&purged["purged"], &purged["kept_suspended"], &purged["complete"]),
            (&json!(0), &json!(1), &json!(true)),
            "{}: {purged}",
            b.name
        );
        let purged =
            b.json(&["dlq", "purge", "--older-than", "0s", "--include-suspended", "--confirm"]);
        assert_eq!(
            (&purged["purged"], &purged["namespace"], &purged["complete"]),
            (&json!(1), &json!("default"), &json!(true)),
            "{}: {purged}",
            b.name
        );
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"], json!([]));
        let other = b.json(&["-n", "other", "dlq", "list"]);
        assert_eq!(other["dead_letters"].as_array().unwrap().len(), 2, "{}: {other}", b.name);
        let (out, _) = b.run(&["-n", "other", "dlq", "list", "--limit", "1"], 0);
        assert!(out.contains("More: keel -n other dlq list --limit 1 --after dl"), "{out}");
        let (out, _) = b.run(
            &[
                "-n",
                "other",
                "dlq",
                "purge",
                "--older-than",
                "0s",
                "--include-suspended",
                "--confirm",
            ],
            0,
        );
        assert!(out.contains("Purged 2 dead letter(s) older than"), "{out}");
        assert!(out.contains(r#"in namespace "other""#), "{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_of_a_whole_machine_needs_all_and_takes_a_delay() {
    for b in backends("retry_of_a_whole_machine_needs_all_and_takes_a_delay") {
        b.run(&["migrate"], 0);
        two_dead_letters(&b).await;
        let (_, err) = b.run(&["dlq", "retry", "--machine", "refuser"], 2);
        assert!(err.contains("--all"), "{err}");
        let (_, err) =
            b.run(&["dlq", "retry", "--machine", "refuser", "--all", "--delay", "soon"], 1);
        assert!(err.contains("--delay"), "{err}");
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"].as_array().unwrap().len(), 2);
        let retried =
            b.json(&["dlq", "retry", "--machine", "refuser", "--all", "--delay", "1 hour"]);
        assert_eq!(retried["retried"].as_array().unwrap().len(), 2);
        let row = &b.json(&["status", "--machine", "refuser"])["queues"][0];
        assert_eq!((row["scheduled"].as_u64(), row["suspended"].as_u64()), (Some(2), Some(0)));
    }
}

#[test]
fn bad_input_is_refused_with_the_field_named_and_nothing_changes() {
    for b in backends("bad_input_is_refused_with_the_field_named_and_nothing_changes") {
        b.run(&["migrate"], 0);
        b.run(&["start", "ticket", "--key", "K"], 0);
        let before = b.json(&["inspect", "ticket:K"]);

        let cases: &[(&[&str], i32, &str)] = &[
            (&["send", "1; DROP TABLE instances", "X"], 1, "target:"),
            (
                &["send", "ticket:K", "X", "--payload", "{not json"],
                1,
                "error: --payload: not valid JSON",
            ),
            (&["send", "ticket:nobody", "X"], 1, "no instance of machine \"ticket\""),
            (&["send", "i999999", "X"], 1, "no instance i999999"),
            (&["send", "ticket:K", ""], 1, "error: EVENT: must not be empty"),
            (&["send", "ticket:K", "X", "--dedup-key", ""], 1, "error: --dedup-key: must not"),
            (&["start", "ticket", "--key", ""], 1, "error: --key: must not be empty"),
            (&["start", "ticket", "--queue", ""], 1, "error: --queue: must not be empty"),
            (&["start", "ticket", "--at", "[x"], 1, "error: --at: \"[x\" starts with `[`"),
            (
                &["start", "ticket", "--context", "[1,2]"],
                1,
                "error: --context: must be a JSON object",
            ),
            (&["start", "ticket", "--context", "{\"a\":"], 1, "error: --context: not valid JSON"),
            (&["start", "", "--key", "Z"], 1, "machine"),
            (&["start", "ticket", "--version", "0"], 2, "--version"),
            (&["start", "ticket", "--version=-3"], 2, "--version"),
            (&["inspect", "-5"], 2, ""),
            (&["inspect", "0"], 1, "target:"),
            (&["dlq", "inspect", "dl'or'1"], 1, "id:"),
            (&["dlq", "inspect", "424242"], 1, "not_found"),
            (&["dlq", "purge", "--older-than", "1.5 hours", "--confirm"], 1, "--older-than"),
            (&["cancel", "ticket:K", "--namespace", "other"], 1, "namespace \"other\""),
            (&["pause", ""], 1, "queue"),
            (&["frobnicate"], 2, "unrecognized subcommand"),
        ];
        for (args, code, needle) in cases {
            let (_, err) = b.run(args, *code);
            assert!(err.contains(needle), "{}: keel {args:?}: {err}", b.name);
        }
        let out = b
            .keel_cmd()
            .args(["--json", "send", "ticket:K", "X", "--payload", "{"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let body: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(body["error"].as_str().unwrap().starts_with("--payload: not valid JSON"), "{body}");

        let after = b.json(&["inspect", "ticket:K"]);
        assert_eq!(before, after, "{}: bad input changed the instance", b.name);
        assert_eq!(b.json(&["status"])["queues"][0]["ready"], 1, "{}", b.name);
    }
}

#[test]
fn an_unreachable_store_is_a_failure_and_a_critical_health() {
    let b = Backend {
        name: "unreachable",
        url: "postgres://postgres@127.0.0.1:1/nothing".into(),
        schema: "keel".into(),
        _dir: None,
    };
    let (_, err) = b.run(&["status"], 1);
    assert!(err.contains("--database-url"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(&dir, "dlq_warning = 10");
    let (_, err) = b.run(&["--config", &config, "health"], 2);
    assert!(err.contains("critical: the store cannot be reached"), "{err}");
    let b = Backend { name: "bad url", url: "mysql://x".into(), schema: "keel".into(), _dir: None };
    let (_, err) = b.run(&["status"], 1);
    assert!(err.contains("unknown scheme"), "{err}");
}

/// `keel config show` lists `dead_letter.enabled` with where its value came from: the
/// event's section wins over the machine's, which wins over the system level and the
/// default; `dead_letter.retention` and `parallel_dispatch.*` likewise. It reads the file
/// only; no store is opened.
#[test]
fn config_show_names_dead_letter_enabled_and_its_source() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("keel.toml");
    std::fs::write(
        &path,
        "[queue.dead_letter]\nenabled = false\n\
         [machines.order.events.refund.queue.dead_letter]\nenabled = true\n\
         [machines.order.queue.dead_letter]\nretention = \"3 days\"\n\
         [parallel_dispatch]\nenabled = true\n\
         [machines.order.parallel_dispatch]\njob_tries = 5\n",
    )
    .expect("write the file");
    let show = |extra: &[&str]| -> Value {
        let mut cmd = Command::cargo_bin("keel").expect("the keel binary is built");
        cmd.env_remove("KEEL_CONFIG").env_remove("KEEL_DATABASE_URL");
        let path = path.display().to_string();
        let mut args =
            vec!["--json", "--config", path.as_str(), "config", "show", "--machine", "order"];
        args.extend_from_slice(extra);
        let out = cmd.args(&args).output().expect("keel runs");
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("a JSON document")
    };
    let key = |doc: &Value, key: &str| -> (String, String) {
        let line = doc["values"]
            .as_array()
            .and_then(|v| v.iter().find(|l| l["key"] == key))
            .unwrap_or_else(|| panic!("{key} listed: {doc}"));
        (line["value"].as_str().unwrap().to_owned(), line["source"].as_str().unwrap().to_owned())
    };
    let line = |doc: &Value| key(doc, "dead_letter.enabled");
    let machine = show(&[]);
    assert_eq!(line(&machine), ("false".to_owned(), "[queue]".to_owned()));
    assert_eq!(
        line(&show(&["--event", "refund"])),
        ("true".to_owned(), "[machines.order.events.refund.queue]".to_owned())
    );
    // The retention the pruner uses, and the chart's parallel dispatch, with their sections.
    let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(key(&machine, "dead_letter.retention"), pair("3 days", "[machines.order.queue]"));
    assert_eq!(key(&machine, "parallel_dispatch.enabled"), pair("true", "[parallel_dispatch]"));
    assert_eq!(
        key(&machine, "parallel_dispatch.job_tries"),
        pair("5", "[machines.order.parallel_dispatch]")
    );
}

#[test]
fn schedules_pause_and_resume_for_every_worker_and_list_the_stored_state() {
    for b in backends("schedules_pause_and_resume_for_every_worker_and_list_the_stored_state") {
        b.run(&["migrate"], 0);
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("keel.toml");
        std::fs::write(
            &config,
            "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n\n\
             [schedules.quiet]\ncron = \"* * * * *\"\npaused = true\n\
             broadcast = { machine = \"sub\", event = \"renew\", namespace = \"ops\" }\n",
        )
        .unwrap();
        let config = config.display().to_string();
        let listed = b.json(&["schedules", "--config", &config]);
        assert_eq!(listed["store_error"], Value::Null, "{}: {listed}", b.name);
        assert_eq!(listed["schedules"][0]["paused"], false);
        assert_eq!(listed["schedules"][1]["paused"], true, "keel.toml says paused");

        let (out, _) = b.run(&["schedules", "pause", "nightly", "--config", &config], 0);
        assert!(out.contains("nightly (namespace default) is paused for every worker"), "{out}");
        let resumed = b.json(&["schedules", "resume", "quiet", "--config", &config]);
        assert_eq!(resumed["state"]["namespace"], "ops", "the schedule's own namespace");
        assert_eq!(resumed["state"]["paused"], false);
        assert!(resumed["schedule"]["next_fire"].is_i64(), "{resumed}");

        let listed = b.json(&["schedules", "--config", &config]);
        let nightly = &listed["schedules"][0];
        assert_eq!((&nightly["paused"], &nightly["next_fire"]), (&json!(true), &Value::Null));
        assert!(nightly["changed_at"].is_i64(), "{listed}");
        assert_eq!(listed["schedules"][1]["paused"], false, "the stored resume wins");
        let (out, _) = b.run(&["schedules", "--config", &config], 0);
        assert!(out.contains("paused since"), "{out}");
        assert!(out.contains("Pause states read from the store"), "{out}");

        // A SQLite URL with options (`?mode=…`) reads the same file's stored states.
        if b.name == "sqlite" {
            let with_options = format!("{}?mode=rw", b.url);
            let listed =
                b.json(&["schedules", "--config", &config, "--database-url", &with_options]);
            assert_eq!(listed["store_error"], Value::Null, "{listed}");
            assert_eq!(listed["schedules"][0]["paused"], true, "the stored pause: {listed}");
        }

        let (_, err) = b.run(&["schedules", "pause", "nigthly", "--config", &config], 1);
        assert!(
            err.contains("no schedule named \"nigthly\"; the schedules are: nightly, quiet"),
            "{err}"
        );
        let (_, err) = b.run(&["schedules", "pause", "nightly"], 1);
        assert!(err.contains("--config"), "{err}");
    }
}

#[test]
fn a_sqlite_file_that_does_not_exist_is_an_error_until_migrate_creates_it() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("keel-demo.db");
    let url = format!("sqlite://{}", path.display());
    let keel = |args: &[&str]| {
        let mut cmd = Command::cargo_bin("keel").expect("the keel binary is built");
        cmd.env_remove("KEEL_CONFIG").env_remove("KEEL_NAMESPACE").env("KEEL_DATABASE_URL", &url);
        let out = cmd.args(args).output().expect("keel runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stdout, stderr)
    };
    // Reading commands and writing ones alike: a mistyped path must not become a new,
    // empty database that answers with nothing.
    for args in [
        &["status"][..],
        &["list", "order"],
        &["start", "order"],
        &["serve", "--listen", "127.0.0.1:0"],
    ] {
        let (code, _, stderr) = keel(args);
        assert_eq!(code, Some(1), "keel {args:?}: {stderr}");
        assert!(stderr.contains("there is no SQLite file"), "keel {args:?}: {stderr}");
        assert!(stderr.contains(&path.display().to_string()), "names the path: {stderr}");
        assert!(stderr.contains("keel migrate"), "says how to create it: {stderr}");
        assert!(!path.exists(), "keel {args:?} created the file");
    }
    // A health probe (with thresholds to check) reads a missing database as an outage.
    let config = write_config(&dir, "dlq_warning = 10");
    let (code, _, _) = keel(&["--config", &config, "health"]);
    assert_eq!(code, Some(2));
    assert!(!path.exists(), "keel health created the file");

    let (code, stdout, stderr) = keel(&["migrate"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("up to date"), "{stdout}");
    let (code, _, stderr) = keel(&["status"]);
    assert_eq!(code, Some(0), "once created, the file opens: {stderr}");
}

/// `KEEL_DATABASE_URL` may carry a password: help names the variable, never its value.
#[test]
fn help_never_prints_the_database_password() {
    for args in [&["--help"][..], &["status", "-h"], &["dlq", "retry", "--help"]] {
        let out = Command::cargo_bin("keel")
            .expect("the keel binary is built")
            .env("KEEL_DATABASE_URL", "postgres://u:s3cret@h/db")
            .args(args)
            .output()
            .expect("keel runs");
        assert_eq!(out.status.code(), Some(0), "keel {args:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(!help.contains("s3cret"), "keel {args:?} printed the password:\n{help}");
        assert!(help.contains("KEEL_DATABASE_URL"), "keel {args:?} names the variable:\n{help}");
    }
}

/// `-n` guards a retry by id as it guards `dlq inspect`: another namespace's dead letter
/// is "not found", and nothing is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_by_id_refuses_a_dead_letter_of_another_namespace() {
    for b in backends("a_retry_by_id_refuses_a_dead_letter_of_another_namespace") {
        b.run(&["migrate"], 0);
        two_dead_letters_in(&b, "billing").await;
        let listed = b.json(&["-n", "billing", "dlq", "list"]);
        let first = listed["dead_letters"][0]["id"].as_i64().unwrap();
        let wanted = format!("id: no dead letter dl{first} in namespace \"shipping\"");
        for id in [format!("dl{first}"), first.to_string()] {
            let (_, err) = b.run(&["-n", "shipping", "dlq", "retry", &id], 1);
            assert!(err.contains(&wanted), "{}: {err}", b.name);
            let (_, err) = b.run(&["-n", "shipping", "dlq", "inspect", &id], 1);
            assert!(err.contains(&wanted), "{}: inspect says the same: {err}", b.name);
        }
        let (_, err) = b.run(&["dlq", "retry", &first.to_string(), "--delay", "1m"], 1);
        assert!(err.contains("in namespace \"default\""), "{}: {err}", b.name);

        assert_eq!(
            b.json(&["-n", "billing", "dlq", "list"]),
            listed,
            "{}: nothing retried",
            b.name
        );
        let row = &b.json(&["-n", "billing", "status"])["queues"][0];
        assert_eq!(row["suspended"], 2, "{}: {row}", b.name);
        let retried = b.json(&["-n", "billing", "dlq", "retry", &first.to_string()]);
        assert_eq!(retried["retried"].as_array().unwrap().len(), 1, "{}: {retried}", b.name);
    }
}

/// Dead letters whose instance moved on (here: cancelled) sit ahead of retryable ones;
/// `--all` reads past them by id and retries the rest, saying how many it left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_all_reads_past_stale_dead_letters_and_says_when_more_remain() {
    for b in backends("retry_all_reads_past_stale_dead_letters_and_says_when_more_remain") {
        b.run(&["migrate"], 0);
        dead_letters_in(&b, "default", &["a", "b", "c", "d"]).await;
        // The instances in dead-letter order (a worker may fail them in any order).
        let listed = b.json(&["dlq", "list"]);
        let ids: Vec<keel::InstanceId> = listed["dead_letters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| keel::InstanceId(d["letter"]["instance"].as_i64().unwrap()))
            .collect();
        assert_eq!(ids.len(), 4, "{}: {listed}", b.name);
        for id in &ids[..2] {
            b.run(&["cancel", &id.to_string()], 0);
        }

        // A page of one letter and a bound of three pages: the two stale letters and the
        // first retryable one are read, and the bound says more remain.
        let keel = b.open().await;
        let done = keel_cli::operate::retry_machine_letters(
            &keel,
            "default",
            "refuser",
            None,
            1,
            3,
            |_| {},
        )
        .await
        .expect("no store error");
        assert_eq!(
            (done.retried.clone(), done.stale, done.complete),
            (vec![ids[2]], 2, false),
            "{}",
            b.name
        );

        let retried = b.json(&["dlq", "retry", "--machine", "refuser", "--all"]);
        assert_eq!(retried["retried"], json!([ids[3]]), "{}: {retried}", b.name);
        assert_eq!((&retried["stale"], &retried["complete"]), (&json!(2), &json!(true)));
        let (out, _) = b.run(&["dlq", "retry", "--machine", "refuser", "--all"], 0);
        assert!(out.contains("Retried 0 instance(s) of \"refuser\""), "{}: {out}", b.name);
        assert!(
            out.contains("Left 2 dead letter(s) whose instance is no longer suspended"),
            "{out}"
        );
        assert!(out.contains("`keel dlq list --machine refuser` lists them"), "{out}");
        let row = &b.json(&["status", "--machine", "refuser"])["queues"][0];
        assert_eq!((row["ready"].as_u64(), row["suspended"].as_u64()), (Some(2), Some(0)));
    }
}

/// Without `--queue`, `config show` shows the queue the machine's instances start in (its
/// `name`), not `default`'s.
#[test]
fn config_show_defaults_to_the_machines_own_queue() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("keel.toml");
    std::fs::write(
        &path,
        "[machines.order.queue]\nname = \"payments\"\n\
         [queues.payments]\nstrategy = \"priority\"\nglobal_concurrency = 5\n",
    )
    .expect("write the file");
    let path = path.display().to_string();
    let show = |extra: &[&str]| -> (Value, String) {
        let run = |json: bool| {
            let mut cmd = Command::cargo_bin("keel").expect("the keel binary is built");
            cmd.env_remove("KEEL_CONFIG").env_remove("KEEL_DATABASE_URL");
            let mut args = vec!["--config", path.as_str(), "config", "show", "--machine", "order"];
            if json {
                args.insert(0, "--json");
            }
            args.extend_from_slice(extra);
            let out = cmd.args(&args).output().expect("keel runs");
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        (serde_json::from_str(&run(true)).expect("a JSON document"), run(false))
    };
    let value = |doc: &Value, key: &str| -> Option<String> {
        doc["values"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["key"] == key)
            .map(|l| l["value"].as_str().unwrap().to_owned())
    };
    let (doc, human) = show(&[]);
    assert_eq!(doc["queue"], "payments", "{doc}");
    assert_eq!(value(&doc, "queues.payments.strategy").as_deref(), Some("priority"), "{doc}");
    assert_eq!(value(&doc, "queues.payments.global_concurrency").as_deref(), Some("5"), "{doc}");
    assert!(!doc.to_string().contains("queues.default."), "{doc}");
    assert!(human.contains("machine order, queue payments"), "{human}");
    let (doc, _) = show(&["--queue", "default"]);
    assert_eq!(doc["queue"], "default", "an explicit --queue still wins: {doc}");
    assert_eq!(value(&doc, "queues.default.strategy").as_deref(), Some("fifo"), "{doc}");
    // A machine without a section runs on `default`.
    let mut cmd = Command::cargo_bin("keel").expect("the keel binary is built");
    cmd.env_remove("KEEL_CONFIG").env_remove("KEEL_DATABASE_URL");
    let out = cmd
        .args(["--json", "--config", &path, "config", "show", "--machine", "refund"])
        .output()
        .expect("keel runs");
    let doc: Value = serde_json::from_slice(&out.stdout).expect("a JSON document");
    assert_eq!(doc["queue"], "default", "{doc}");
    // ... which may be a typo: the output says the file has no such section.
    assert_eq!(doc["sections_missing"], serde_json::json!(["[machines.refund]"]), "{doc}");
    let (doc, human) = show(&["--event", "PAY"]);
    assert_eq!(doc["sections_missing"], serde_json::json!(["[machines.order.events.PAY]"]));
    assert!(human.contains("Note: the file has no [machines.order.events.PAY] section"), "{human}");
    let (doc, _) = show(&[]);
    assert_eq!(doc["sections_missing"], serde_json::json!([]), "order has a section");
}

/// With `--json`, a command line the parser refuses is `{"error": …}` on stdout with the
/// parser's exit code (2), wherever `--json` stands; help and version stay text.
#[test]
fn usage_errors_with_json_are_a_json_error_on_stdout() {
    let keel = |args: &[&str]| {
        Command::cargo_bin("keel")
            .expect("the keel binary is built")
            .env("KEEL_DATABASE_URL", "postgres://postgres@127.0.0.1:1/nothing")
            .args(args)
            .output()
            .expect("keel runs")
    };
    let cases: &[(&[&str], &str)] = &[
        (&["--json", "dlq", "list", "--limit", "abc"], "invalid value 'abc' for '--limit"),
        (&["--json", "start", "ticket", "--version", "0"], "--version"),
        (&["--json", "inspect", "-5"], "unexpected argument '-5'"),
        (&["dlq", "list", "--json", "--limit", "abc"], "--limit"),
        (&["--json", "frobnicate"], "unrecognized subcommand 'frobnicate'"),
        (&["--json", "purge", "ticket", "--confirm"], "--pending"),
        (&["--json"], "'keel' requires a subcommand"),
        (&["--json", "dlq"], "'keel dlq' requires a subcommand"),
        (&["dlq", "--json"], "'keel dlq' requires a subcommand"),
    ];
    for (args, needle) in cases {
        let out = keel(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(2), "keel {args:?}: {stdout}");
        let body: Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("keel {args:?}: stdout is not JSON ({e}): {stdout}"));
        let error = body["error"].as_str().unwrap_or_else(|| panic!("keel {args:?}: {body}"));
        assert!(error.contains(needle), "keel {args:?}: {error}");
        assert!(!error.starts_with("error:"), "keel {args:?}: {error}");
        assert!(out.stderr.is_empty(), "keel {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Without --json, and after `--`, the parser's text goes to stderr as before.
    for args in [&["dlq", "list", "--limit", "abc"][..], &["start", "--", "--json", "extra"]] {
        let out = keel(args);
        assert_eq!(out.status.code(), Some(2), "keel {args:?}");
        assert!(out.stdout.is_empty(), "keel {args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: "), "keel {args:?}");
    }
    for (args, needle) in
        [(&["--json", "--help"][..], "Usage: keel"), (&["--json", "--version"], "keel ")]
    {
        let out = keel(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "keel {args:?}: {stdout}");
        assert!(stdout.contains(needle) && !stdout.starts_with('{'), "keel {args:?}: {stdout}");
    }
}

/// A reader that went away (`keel … | true`) is no crash: the exit code still says how
/// the command ended, whether the error goes to stdout (`--json`) or stderr.
#[test]
fn a_closed_stdout_or_stderr_leaves_the_exit_code_alone() {
    use std::process::Stdio;
    let closed = || {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        Stdio::from(writer)
    };
    let keel = || {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_keel"));
        cmd.env("KEEL_DATABASE_URL", "postgres://postgres@127.0.0.1:1/nothing");
        cmd
    };
    let failing = ["graph", "ticket", "--definitions", "/nonexistent/charts.json"];
    let mut json = vec!["--json"];
    json.extend(failing);
    let status = keel().args(&json).stdout(closed()).stderr(Stdio::null()).status().unwrap();
    assert_eq!(status.code(), Some(1), "--json error on a closed stdout");
    let status = keel().args(failing).stdout(Stdio::null()).stderr(closed()).status().unwrap();
    assert_eq!(status.code(), Some(1), "error on a closed stderr");
    let status = keel()
        .args(["--json", "dlq", "list", "--limit", "abc"])
        .stdout(closed())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2), "--json usage error on a closed stdout");
}

/// A store URL mistyped without `//` still has its password hidden in the error.
#[test]
fn a_url_without_slashes_keeps_its_password_out_of_errors() {
    for url in ["postgres:/keel:s3cret@db/keel", "postgresql:keel:s3cret@db"] {
        let b = Backend { name: "no slashes", url: url.into(), schema: "keel".into(), _dir: None };
        let (_, err) = b.run(&["status"], 1);
        assert!(err.contains("unknown scheme") && !err.contains("s3cret"), "{url}: {err}");
        let body = b.json_code_of(&["status"], 1);
        let error = body["error"].as_str().unwrap();
        assert!(error.contains("***@db") && !error.contains("s3cret"), "{url}: {error}");
    }
}

/// A bulk command given a machine name the store holds nothing of in the namespace (no
/// instance, dead letter or recent worker of it: a typo, or a machine defined in code with
/// nothing stored yet) does nothing and exits 0 with its usual 0 report, and warns on
/// stderr naming the machine, the namespace, the closest known machine and the known
/// ones; `--json` carries the same as fields of the report. Without `--confirm`, `purge`
/// still refuses, with the same note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_commands_warn_of_a_machine_the_store_holds_nothing_of() {
    for b in backends("bulk_commands_warn_of_a_machine_the_store_holds_nothing_of") {
        b.run(&["migrate"], 0);
        two_dead_letters(&b).await;
        b.run(&["start", "ticket", "--key", "K"], 0);

        let cases: &[(&[&str], &str, &str)] = &[
            (
                &["purge", "refusr", "--dlq", "--confirm"],
                "Purged 0 dead letter(s) of \"refusr\" in namespace \"default\"",
                "did you mean `refuser`?",
            ),
            (
                &["purge", "tiket", "--pending", "--confirm"],
                "Cancelled 0 pending instance(s) of \"tiket\" in namespace \"default\"",
                "did you mean `ticket`?",
            ),
            (
                &["dlq", "retry", "--machine", "refusr", "--all"],
                "Retried 0 instance(s) of \"refusr\" in namespace \"default\": none.",
                "did you mean `refuser`?",
            ),
            (
                &["purge", "reports", "--pending", "--confirm"],
                "Cancelled 0 pending instance(s) of \"reports\"",
                "(no instance, dead letter or worker seen in the last day).",
            ),
        ];
        for (args, report, near) in cases {
            let (out, err) = b.run(args, 0);
            assert!(out.contains(report), "{}: keel {args:?}: {out}", b.name);
            let machine = args[if args[0] == "purge" { 1 } else { 3 }];
            let warning = format!(
                "warning: namespace \"default\" holds nothing of machine \"{machine}\" (no instance, dead letter or worker seen in the last day)"
            );
            assert!(err.contains(&warning), "{}: keel {args:?}: {err}", b.name);
            assert!(err.contains(near), "{}: keel {args:?}: {err}", b.name);
            assert!(
                err.contains("Machines in namespace \"default\": refuser, ticket."),
                "{}: keel {args:?} lists the known machines: {err}",
                b.name
            );
        }
        let body = b.json(&["purge", "refusr", "--dlq", "--confirm"]);
        assert_eq!(
            (&body["purged"], &body["unknown_machine"], &body["did_you_mean"], &body["machines"]),
            (&json!(0), &json!(true), &json!("refuser"), &json!(["refuser", "ticket"])),
            "{}: {body}",
            b.name
        );
        let body = b.json(&["dlq", "retry", "--machine", "refusr", "--all"]);
        assert_eq!((&body["retried"], &body["unknown_machine"]), (&json!([]), &json!(true)));
        let body = b.json(&["purge", "reports", "--pending", "--confirm"]);
        assert_eq!((&body["cancelled"], &body["did_you_mean"]), (&json!(0), &json!(null)));
        assert_eq!(body["machines_more"], 0, "{}: {body}", b.name);
        // Without --confirm it still refuses, saying the machine is unknown.
        let (_, err) = b.run(&["purge", "refusr", "--dlq"], 1);
        assert!(err.contains("add --confirm to proceed"), "{}: {err}", b.name);
        assert!(err.contains("Note: namespace \"default\" holds nothing of machine"), "{err}");
        let (_, err) = b.run(&["-n", "other", "purge", "refuser", "--dlq", "--confirm"], 0);
        assert!(err.contains("the store knows no machine in namespace \"other\""), "{err}");
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"].as_array().unwrap().len(), 2);
        assert_eq!(b.json(&["status", "--machine", "ticket"])["queues"][0]["ready"], 1);

        // Known machines with nothing to act on: a plain 0, no warning.
        let cases: &[&[&str]] = &[
            &["purge", "ticket", "--dlq", "--confirm"],
            &["purge", "refuser", "--pending", "--confirm"],
            &["dlq", "retry", "--machine", "ticket", "--all"],
        ];
        for args in cases {
            let (_, err) = b.run(args, 0);
            assert!(!err.contains("warning"), "{}: keel {args:?}: {err}", b.name);
            let body = b.json(args);
            assert_eq!(body["unknown_machine"], false, "{}: keel {args:?}: {body}", b.name);
        }
    }
}

/// Numeric flags out of range name the flag the user typed and the valid range, never an
/// internal field name.
#[test]
fn numeric_flags_out_of_range_name_the_flag_and_the_range() {
    const DOOR: &str = r#"{ "name": "door", "version": 1, "initial": "closed", "states": [
        { "key": "closed", "on": [ { "event": "OPEN", "target": "open" } ] },
        { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] }"#;
    for b in backends("numeric_flags_out_of_range_name_the_flag_and_the_range") {
        b.run(&["migrate"], 0);
        b.run(&["start", "ticket", "--key", "K"], 0);
        let dir = tempfile::tempdir().unwrap();
        let defs = dir.path().join("door.json");
        std::fs::write(&defs, DOOR).unwrap();
        let defs = defs.display().to_string();
        let cases: &[(&[&str], &str)] = &[
            (
                &["history", "ticket:K", "--limit", "0"],
                "--limit: 0 is out of range; give 1 to 1000",
            ),
            (&["history", "ticket:K", "--limit", "1001"], "--limit: 1001 is out of range"),
            (&["list", "ticket", "--limit", "0"], "--limit: 0 is out of range; give 1 to 1000"),
            // Each letter carries its payload and errors: a page is capped as the API's is.
            (&["dlq", "list", "--limit", "1001"], "--limit: 1001 is out of range; give 1 to 1000"),
            (&["dlq", "retry", "1", "--delay", "400d"], "--delay: 400 days is longer than"),
            (
                &["dlq", "retry", "--machine", "ticket", "--all", "--delay", "400d"],
                "--delay: 400 days is longer than the limit of 366 days",
            ),
            (&["graph", "door", "--definitions", &defs, "--version", "9"], "--version: door has"),
            (
                &["upgrade", "door", "--from", "7", "--to", "1", "--definitions", &defs],
                "--from: door has no version 7",
            ),
        ];
        for (args, needle) in cases {
            let (_, err) = b.run(args, 1);
            assert!(err.contains(needle), "{}: keel {args:?}: {err}", b.name);
            let body = b.json_code_of(args, 1);
            assert!(body["error"].as_str().unwrap().contains(needle), "{}: {body}", b.name);
        }
        assert_eq!(b.json(&["history", "ticket:K", "--limit", "1000"])["entries"], json!([]));
    }
}

/// The configuration file is read and checked before the store is opened: a broken file
/// (or one without thresholds, for `health`) is the error even when the store cannot be
/// reached, and `health` with a good file still reports the outage as critical.
#[test]
fn a_bad_config_file_is_reported_before_an_unreachable_store() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[queue.alerts]\ndlq_warnin = 10\n").unwrap();
    let broken = broken.display().to_string();
    let good = write_config(&dir, "dlq_warning = 10");
    let b = Backend {
        name: "unreachable",
        url: "postgres://postgres@127.0.0.1:1/nothing".into(),
        schema: "keel".into(),
        _dir: None,
    };
    for args in [
        &["--config", &broken, "health"][..],
        &["--config", &broken, "start", "ticket"],
        &["--config", &broken, "send", "i1", "PING"],
        &["--config", &broken, "config", "check"],
    ] {
        let (_, err) = b.run(args, 1);
        assert!(err.contains("dlq_warnin"), "keel {args:?}: {err}");
        assert!(!err.contains("cannot be reached"), "keel {args:?}: {err}");
        let body = b.json_code_of(args, 1);
        assert!(body["error"].as_str().unwrap().contains("dlq_warnin"), "{body}");
    }
    let (_, err) = b.run(&["health"], 1);
    assert!(err.contains("--config: no alert thresholds configured"), "{err}");
    let (_, err) = b.run(&["--config", &good, "health"], 2);
    assert!(err.contains("critical: the store cannot be reached"), "{err}");
}

/// Every command line a user can type, each one's own arguments.
const EVERY_COMMAND: &[&[&str]] = &[
    &["status"],
    &["status", "--machine", "ticket"],
    &["pause", "q"],
    &["resume", "q"],
    &["dlq", "list"],
    &["dlq", "inspect", "dl1"],
    &["dlq", "retry", "dl1"],
    &["dlq", "retry", "--machine", "ticket", "--all"],
    &["dlq", "delete", "dl1"],
    &["dlq", "purge", "--older-than", "7d", "--confirm"],
    &["inspect", "i1"],
    &["history", "i1"],
    &["start", "ticket"],
    &["send", "i1", "PING"],
    &["cancel", "i1"],
    &["timers", "status"],
    &["health"],
    &["migrate"],
    &["config", "show", "--machine", "ticket"],
    &["config", "check"],
    &["list", "ticket"],
    &["workers"],
    &["graph", "ticket", "--definitions", "/nonexistent/charts.json"],
    &["purge", "ticket", "--pending", "--confirm"],
    &["upgrade", "ticket", "--from", "1", "--to", "2", "--definitions", "/nonexistent/c.json"],
    &["schedules"],
    &["schedules", "pause", "nightly"],
    &["schedules", "resume", "nightly"],
    &["schedules", "forget", "--all"],
    &["serve", "--listen", "127.0.0.1:0"],
];

/// `--config` (or `KEEL_CONFIG`) is checked by every command, also those that take
/// nothing from the file: a path that names no file, or a file that does not load, is an
/// error naming the path (before the store is opened and before any other file is read),
/// never a command that runs as if no file had been given.
#[test]
fn every_command_refuses_a_config_file_that_is_missing_or_broken() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml").display().to_string();
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[queue]\ntimeout = \"soon\"\n").unwrap();
    let broken = broken.display().to_string();
    let b = Backend {
        name: "unreachable",
        url: "postgres://postgres@127.0.0.1:1/nothing".into(),
        schema: "keel".into(),
        _dir: None,
    };
    for command in EVERY_COMMAND {
        for (file, needle) in [(&missing, "--config: cannot read"), (&broken, "timeout")] {
            let mut args = vec!["--config", file.as_str()];
            args.extend_from_slice(command);
            let (_, err) = b.run(&args, 1);
            assert!(err.contains(file.as_str()), "keel {args:?} names the file: {err}");
            assert!(err.contains(needle), "keel {args:?}: {err}");
            let body = b.json_code_of(&args, 1);
            assert!(body["error"].as_str().unwrap().contains(file.as_str()), "{args:?}: {body}");
        }
        // The same file named by the variable.
        let out = b.keel_cmd().env("KEEL_CONFIG", &missing).args(*command).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "KEEL_CONFIG keel {command:?}: {err}");
        assert!(err.contains(&missing) && err.contains("KEEL_CONFIG"), "{command:?}: {err}");
    }
    // A file that loads is accepted by a command that takes nothing from it.
    for b in backends("every_command_refuses_a_config_file_that_is_missing_or_broken") {
        let good = dir.path().join(format!("good-{}.toml", b.name));
        std::fs::write(&good, "[queue]\ntimeout = \"30 seconds\"\n").unwrap();
        let good = good.display().to_string();
        b.run(&["--config", &good, "migrate"], 0);
        b.run(&["--config", &good, "start", "ticket"], 0);
        let listed = b.json(&["--config", &good, "list", "ticket"]);
        assert_eq!(listed["instances"].as_array().unwrap().len(), 1, "{}: {listed}", b.name);
        assert_eq!(b.json(&["--config", &good, "status"])["queues"][0]["ready"], 1);
    }
}

/// `keel config check` holds the file's machine and queue sections against the machines
/// and queues the store knows in the namespace, with the rule a worker warns by: a likely
/// misspelling is a warning naming the section and the closest name, a section of a
/// machine the store has not seen a note; a file that loads exits 0 either way, since the
/// store cannot know a machine or queue not deployed yet (`order2` next to `order`). A
/// queue the store holds instances in is in use, even when it resembles the file's.
#[test]
fn config_check_warns_of_sections_that_look_like_misspellings() {
    for b in backends("config_check_warns_of_sections_that_look_like_misspellings") {
        b.run(&["migrate"], 0);
        b.run(&["start", "order", "--key", "K"], 0);
        b.run(&["start", "order", "--key", "L", "--queue", "tier1"], 0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.toml");
        let file = |text: &str| {
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let typos = file(
            "[machines.order.queue]\nname = \"payments\"\n\
             [machines.ordr.queue]\ntimeout = \"5s\"\n\
             [queues.paymnts]\nconcurrency = 2\n\
             [machines.checkout.queue]\ntimeout = \"9s\"\n",
        );
        let (out, _) = b.run(&["--config", &typos, "config", "check"], 0);
        for needle in [
            "valid (3 machine section(s), 1 queue section(s))",
            "Warning: [machines.ordr]: names nothing the store knows in namespace \"default\"; did you mean `order`?",
            "Warning: [queues.paymnts]: names no queue with unfinished instances or settings in namespace \"default\"; did you mean `payments`?",
            "Note: [machines.checkout]: no machine of that name",
        ] {
            assert!(out.contains(needle), "{}: {needle}: {out}", b.name);
        }
        let body = b.json(&["--config", &typos, "config", "check"]);
        assert_eq!((&body["likely_typos"], &body["valid"]), (&json!(2), &json!(true)));
        // A new machine and queue named next to known ones: warned of, not failed.
        let new = file("[machines.order2.queue]\nname = \"orders2\"\n[queues.orders2]\n");
        let (out, _) = b.run(&["--config", &new, "config", "check"], 0);
        assert!(out.contains("Warning: [machines.order2]"), "{}: {out}", b.name);
        // A misspelt retention section would leave `order` under the global retention.
        let retention = file(
            "[retention]\nended = \"7 days\"\n[retention.machines.ordr]\nended = \"90 days\"\n",
        );
        let (out, _) = b.run(&["--config", &retention, "config", "check"], 0);
        let needle = "Warning: [retention.machines.ordr]: names nothing the store knows in namespace \"default\"; did you mean `order`?";
        assert!(out.contains(needle), "{}: {out}", b.name);
        // `tier1` holds an instance: its section is in use, though close to `tier2`.
        let tiers = file("[machines.order.queue]\nname = \"tier2\"\n[queues.tier1]\n");
        let body = b.json(&["--config", &tiers, "config", "check"]);
        assert_eq!(body["unused"], json!([]), "{}: {body}", b.name);
        let fine = file("[machines.order.queue]\ntimeout = \"5s\"\n[machines.checkout]\n");
        let (out, _) = b.run(&["--config", &fine, "config", "check"], 0);
        assert!(out.contains("Note: [machines.checkout]") && !out.contains("Warning"), "{out}");
        let (_, err) = b.run(&["config", "check"], 1);
        assert!(err.contains("--config: name the file to check"), "{err}");
    }
}

/// The store knows a queue by its unfinished instances and its settings only, so a
/// `[queues.<q>]` section whose instances have all ended (a batch queue idle between
/// runs) that resembles a queue in use is warned of with those words, which say why and
/// that it is fine, not as a name the store never saw.
#[test]
fn config_check_says_a_queue_is_known_by_its_unfinished_instances() {
    for b in backends("config_check_says_a_queue_is_known_by_its_unfinished_instances") {
        b.run(&["migrate"], 0);
        let ended = b.json(&["start", "order", "--key", "A", "--queue", "batch1"]);
        b.run(&["cancel", &ended["id"].to_string()], 0);
        b.run(&["start", "order", "--key", "B", "--queue", "batch2"], 0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.toml");
        std::fs::write(&path, "[queues.batch1]\nconcurrency = 1\n[queues.batch2]\n").unwrap();
        let config = path.display().to_string();
        let (out, _) = b.run(&["--config", &config, "config", "check"], 0);
        let needle = "Warning: [queues.batch1]: names no queue with unfinished instances or settings in namespace \"default\"; did you mean `batch2`? Fix it if it is misspelt; a queue not deployed yet, or whose instances have all ended, is fine.";
        assert!(out.contains(needle), "{}: {out}", b.name);
        assert!(!out.contains("names nothing the store knows"), "{}: {out}", b.name);
    }
}

/// A dead letter whose instance moved on (here: cancelled) is deleted by id, so `status`
/// and `health` stop counting it; `dlq retry` on it names the command. One whose instance
/// is still suspended, or of another namespace, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_left_over_dead_letter_is_deleted_by_id_and_stops_counting() {
    for b in backends("a_left_over_dead_letter_is_deleted_by_id_and_stops_counting") {
        b.run(&["migrate"], 0);
        let instance = dead_letters_in(&b, "default", &["a"]).await[0];
        let letter = b.json(&["dlq", "list"])["dead_letters"][0]["id"].as_i64().unwrap();
        let dl = format!("dl{letter}");

        let (_, err) = b.run(&["dlq", "delete", &dl], 1);
        assert!(
            err.contains(&format!("`keel dlq retry {dl}`"))
                && err.contains(&format!("`keel cancel {instance}`")),
            "{}: a suspended instance's letter is how it is retried: {err}",
            b.name
        );
        let (_, err) = b.run(&["-n", "other", "dlq", "delete", &dl], 1);
        assert!(err.contains(&format!("no dead letter {dl} in namespace \"other\"")), "{err}");

        b.run(&["cancel", &instance.to_string()], 0);
        let (_, err) = b.run(&["dlq", "retry", &dl], 1);
        assert!(
            err.contains("is cancelled, not suspended")
                && err.contains(&format!("`keel dlq delete {dl}` removes it")),
            "{}: {err}",
            b.name
        );
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(&dir, "dlq_warning = 1");
        b.run(&["health", "--config", &config], 1);

        let deleted = b.json(&["dlq", "delete", &dl]);
        assert_eq!(
            (&deleted["deleted"], &deleted["instance"], &deleted["instance_status"]),
            (&json!(true), &json!(instance.0), &json!("cancelled")),
            "{}: {deleted}",
            b.name
        );
        let status = b.json(&["status"]);
        let dead: u64 = status["queues"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["dead_letters"].as_u64().unwrap())
            .sum();
        assert_eq!(dead, 0, "{}: {status}", b.name);
        let (out, _) = b.run(&["health", "--config", &config], 0);
        assert!(out.starts_with("HEALTHY"), "{out}");
        let (_, err) = b.run(&["dlq", "delete", &dl], 1);
        assert!(err.contains(&dl), "{}: a deleted letter is gone: {err}", b.name);
    }
}

/// The wall clock in the store's unit.
fn wall_clock() -> keel::layers::core::Timestamp {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    keel::layers::core::Timestamp(ms.as_millis() as i64)
}

/// `start` without `--version` takes the newest version a live worker serves for the
/// machine in the namespace, and says it in its output; with no such worker it takes 1
/// and a note on stderr says so and names `--version`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_without_a_version_takes_the_newest_a_live_worker_serves() {
    use keel::layers::core::ids::WorkerId;
    use keel::layers::core::ports::Store;
    use keel::layers::core::ports::store::WorkerBeatParams;
    for b in backends("start_without_a_version_takes_the_newest_a_live_worker_serves") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        let now = wall_clock();
        for (id, namespaces, version) in [
            ("old", vec![], 1),
            ("new", vec!["default".to_owned()], 2),
            ("far", vec!["x".into()], 3),
        ] {
            let beat = WorkerBeatParams {
                id: WorkerId(id.into()),
                name: id.into(),
                machines: vec![MachineRef::new("order", version)],
                namespaces,
                started_at: now,
                now,
                forget_before: now.minus(Duration::from_secs(86_400)),
            };
            keel.store().worker_heartbeat(beat).await.unwrap();
        }

        let (out, err) = b.run(&["start", "order"], 0);
        assert!(out.starts_with("Started i") && out.contains("(order v2)."), "{}: {out}", b.name);
        assert!(!err.contains("note:"), "{}: {err}", b.name);
        let started = b.json(&["start", "order"]);
        assert_eq!(started["version"], 2, "{}: {started}", b.name);
        let id = started["id"].as_i64().unwrap().to_string();
        let shown = b.json(&["inspect", &id]);
        assert_eq!(shown["instance"]["machine"], json!({ "name": "order", "version": 2 }));
        assert_eq!(b.json(&["start", "order", "--version", "1"])["version"], 1);

        let (out, err) = b.run(&["start", "lonely"], 0);
        assert!(out.contains("(lonely v1)."), "{}: {out}", b.name);
        assert!(
            err.contains("note: no live worker serves \"lonely\" in namespace \"default\", so this starts version 1; `--version N` starts another"),
            "{}: {err}",
            b.name
        );

        // `--key` is a business key, not a uniqueness claim: a second start with it starts
        // another instance, on the version this start chose, and `M:K` names the newest.
        let first = b.json(&["start", "lonely", "--key", "K", "--version", "3"]);
        let again = b.json(&["start", "lonely", "--key", "K"]);
        assert_eq!((&again["inserted"], &again["version"]), (&json!(true), &json!(1)));
        assert_ne!(first["id"], again["id"], "{}", b.name);
        assert_eq!(b.json(&["inspect", "lonely:K"])["instance"]["id"], again["id"]);

        // `keel workers` lists those that claim from the namespace (every namespace's
        // with --all-namespaces) and counts the others.
        let names = |doc: &Value| -> Vec<String> {
            let mut all: Vec<String> = doc["workers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w["name"].as_str().unwrap().to_owned())
                .collect();
            all.sort();
            all
        };
        let fleet = b.json(&["workers"]);
        assert_eq!(names(&fleet), ["new", "old"], "{}: {fleet}", b.name);
        assert_eq!((&fleet["other_namespaces"], &fleet["at_least"]), (&json!(1), &json!(false)));
        assert_eq!(names(&b.json(&["-n", "x", "workers"])), ["far", "old"], "{}", b.name);
        let every = b.json(&["workers", "--all-namespaces"]);
        assert_eq!(names(&every), ["far", "new", "old"], "{}: {every}", b.name);
        let (out, _) = b.run(&["workers"], 0);
        assert!(
            out.contains("2 live, 0 stale (not seen for 60s), claiming from namespace \"default\"")
                && out.contains("1 more claim only from other namespaces"),
            "{}: {out}",
            b.name
        );
        // At the store's bound, the counts are lower bounds: the 1000 workers seen last,
        // all live and claiming only from `busy`, hide those seen before them.
        let max = keel::layers::core::ports::store::WORKER_LIST_MAX;
        let later = now.plus(Duration::from_secs(1));
        for n in 0..max {
            let beat = WorkerBeatParams {
                id: WorkerId(format!("w{n}")),
                name: format!("w{n}"),
                machines: vec![MachineRef::new("order", 1)],
                namespaces: vec!["busy".into()],
                started_at: later,
                now: later,
                forget_before: later.minus(Duration::from_secs(86_400)),
            };
            keel.store().worker_heartbeat(beat).await.unwrap();
        }
        let full = b.json(&["workers", "--all-namespaces"]);
        assert_eq!((&full["at_least"], &full["live_at_least"]), (&json!(true), &json!(true)));
        let (out, _) = b.run(&["workers", "--all-namespaces"], 0);
        assert!(
            out.starts_with(
                "at least 1000 live, 0 stale (not seen for 60s) among the 1000 most recently seen, in any namespace"
            ) && out.contains("The store lists at most 1000 workers: there may be more."),
            "{}: {out}",
            b.name
        );
        // `default`'s workers were seen before the 1000: not "none reported", but none
        // among those the store listed.
        let (out, _) = b.run(&["workers"], 0);
        assert!(
            out.starts_with("No workers claiming from namespace \"default\" are among the 1000 most recently seen workers.")
                && out.contains("at least 1000 more claim only from other namespaces"),
            "{}: {out}",
            b.name
        );
    }
}

/// A paused queue that holds nothing unfinished (paused ahead of time, or misspelt) is
/// still named by `status`, in its text and its `--json`.
#[test]
fn status_names_a_paused_queue_that_holds_nothing() {
    for b in backends("status_names_a_paused_queue_that_holds_nothing") {
        b.run(&["migrate"], 0);
        b.run(&["start", "ticket", "--version", "1"], 0);
        b.run(&["pause", "ghost"], 0);
        b.run(&["pause", "default"], 0);
        let status = b.json(&["status"]);
        assert_eq!(status["paused_queues"], json!(["default", "ghost"]), "{}: {status}", b.name);
        let (out, _) = b.run(&["status"], 0);
        assert!(
            out.contains(
                "Paused, with nothing unfinished in them: ghost (`keel resume QUEUE` lets workers claim again)."
            ),
            "{}: {out}",
            b.name
        );
        b.run(&["resume", "ghost"], 0);
        assert_eq!(b.json(&["status"])["paused_queues"], json!(["default"]));
        let (out, _) = b.run(&["status"], 0);
        assert!(!out.contains("Paused, with nothing"), "{}: {out}", b.name);

        b.run(&["-n", "empty", "pause", "later"], 0);
        let (out, _) = b.run(&["-n", "empty", "status"], 0);
        assert!(
            out.contains("No unfinished instances")
                && out.contains(
                    "Paused, with nothing unfinished in them: later (`keel -n empty resume QUEUE`"
                ),
            "{}: {out}",
            b.name
        );

        // `--machine` narrows the rows, not what a queue holds: a paused queue with
        // another machine's work in it is not empty, and one with nothing in it still is.
        b.run(&["-n", "mixed", "start", "mail", "--version", "1", "--queue", "bulk"], 0);
        b.run(&["-n", "mixed", "pause", "bulk"], 0);
        b.run(&["-n", "mixed", "pause", "idle"], 0);
        let (out, _) = b.run(&["-n", "mixed", "status", "--machine", "order"], 0);
        assert!(
            out.contains("Paused, with nothing unfinished in them: idle (")
                && !out.contains("bulk"),
            "{}: {out}",
            b.name
        );
        let (out, _) = b.run(&["-n", "mixed", "status", "--machine", "mail"], 0);
        assert!(
            out.contains("Paused, with nothing unfinished in them: idle ("),
            "{}: {out}",
            b.name
        );
        assert!(out.contains("bulk") && out.contains("PAUSED"), "{}: {out}", b.name);
    }
}
