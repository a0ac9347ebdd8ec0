//! The real `keel` binary's operator views against SQLite and PostgreSQL (a fresh schema
//! when `KEEL_TEST_DATABASE_URL` is set; SKIPPED loudly otherwise, a failure under
//! `KEEL_REQUIRE_BACKENDS=1`): `list`, `history`, `purge`, `workers`, the last hour in
//! `status`, the `health` thresholds on it, `graph` and `upgrade`.

use std::time::Duration;

use assert_cmd::Command;
use keel::layers::core::chart::ChartBuilder;
use keel::layers::core::ports::Store;
use keel::layers::core::ports::store::ClaimParams;
use keel::{
    ChartMachine, ConnectOptions, Keel, MachineRef, NewInstance, Outcome, Status, StepContext,
    StepError, StepMachine, WorkerConfig, json,
};
use serde_json::Value;

struct Backend {
    name: &'static str,
    url: String,
    schema: String,
    dir: tempfile::TempDir,
}

impl Backend {
    fn keel_cmd(&self) -> Command {
        let mut cmd = Command::cargo_bin("keel").expect("the keel binary is built");
        cmd.env("KEEL_DATABASE_URL", &self.url)
            .env("KEEL_SCHEMA", &self.schema)
            .env_remove("KEEL_NAMESPACE")
            .env_remove("KEEL_CONFIG")
            .env_remove("KEEL_DEFINITIONS");
        cmd
    }

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

    fn json(&self, args: &[&str]) -> Value {
        self.json_code(args, 0)
    }

    fn json_code(&self, args: &[&str], code: i32) -> Value {
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

    fn file(&self, name: &str, text: &str) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }
}

fn backends(test: &str) -> Vec<Backend> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite://{}", dir.path().join("keel.db").display());
    let mut all = vec![Backend { name: "sqlite", url, schema: "keel".into(), dir }];
    if let Some(url) = keel::layers::postgres::testing::database_url() {
        let schema = keel::layers::postgres::testing::unique_schema();
        let dir = tempfile::tempdir().unwrap();
        all.push(Backend { name: "postgres", url, schema, dir });
    } else {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run {test}"
        );
        eprintln!("SKIPPED postgres part of {test}: set KEEL_TEST_DATABASE_URL to run it");
    }
    all
}

fn ids(doc: &Value) -> Vec<i64> {
    doc["instances"].as_array().unwrap().iter().map(|i| i["id"].as_i64().unwrap()).collect()
}

/// A step machine whose only step fails for good.
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

/// A step machine that finishes at once.
struct Echo;

#[keel::async_trait]
impl StepMachine for Echo {
    fn machine(&self) -> MachineRef {
        MachineRef::new("echo", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: ctx.context.clone(), step: None })
    }
}

/// Walks through five steps (one commit and one history entry each), then finishes.
struct Walker;

#[keel::async_trait]
impl StepMachine for Walker {
    fn machine(&self) -> MachineRef {
        MachineRef::new("walker", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        let n = ctx.context["n"].as_i64().unwrap_or(0);
        if n >= 5 {
            return Ok(Outcome::Done { result: json!({ "steps": n }), step: None });
        }
        Ok(Outcome::Next { step: format!("s{}", n + 1), context: json!({ "n": n + 1 }) })
    }
}

fn fast() -> WorkerConfig {
    WorkerConfig { poll_interval: Duration::from_millis(20), ..WorkerConfig::named("ops-test") }
}

async fn wait_for(keel: &Keel, id: keel::InstanceId, status: Status, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while keel.get(id).await.unwrap().instance.status != status {
        assert!(std::time::Instant::now() < deadline, "{what}: {id} never reached {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_and_filters_and_purge_cancels_pending_and_deletes_dead_letters() {
    for b in backends("list_pages_and_filters_and_purge") {
        b.run(&["migrate"], 0);
        for key in ["a", "b", "c"] {
            b.run(&["start", "ticket", "--key", key], 0);
        }
        b.run(&["start", "ticket", "--version", "2", "--at", "triage"], 0);
        b.run(&["start", "other"], 0);

        let all = b.json(&["list", "ticket"]);
        let listed = ids(&all);
        assert_eq!(listed.len(), 4, "{}: {all}", b.name);
        assert!(listed.windows(2).all(|w| w[0] > w[1]), "{}: newest first {listed:?}", b.name);
        assert_eq!(all["next"], Value::Null);
        let page = b.json(&["list", "ticket", "--limit", "2"]);
        assert_eq!(ids(&page), listed[..2]);
        let next = page["next"].as_i64().expect("a next cursor");
        let rest = b.json(&["list", "ticket", "--limit", "2", "--after", &format!("i{next}")]);
        assert_eq!(ids(&rest), listed[2..]);
        let triage = b.json(&["list", "ticket", "--state", "triage"]);
        assert_eq!(ids(&triage), [listed[0]], "{}", b.name);
        assert_eq!(triage["instances"][0]["machine"], json!({ "name": "ticket", "version": 2 }));
        assert_eq!(ids(&b.json(&["list", "ticket", "--status", "runnable"])).len(), 4);
        assert_eq!(ids(&b.json(&["list", "ticket", "--status", "done"])), Vec::<i64>::new());
        let (out, _) = b.run(&["list", "ticket", "--limit", "3"], 0);
        assert!(
            out.contains("triage") && out.contains("More: keel list ticket --limit 3 --after i"),
            "{out}"
        );
        // The hint continues the same listing: filters and namespace kept.
        let (out, _) = b.run(&["list", "ticket", "--status", "runnable", "--limit", "1"], 0);
        let hint =
            format!("More: keel list ticket --status runnable --limit 1 --after i{}", listed[0]);
        assert!(out.contains(&hint), "{}: {out}", b.name);
        for _ in 0..2 {
            b.run(&["-n", "ops", "start", "ticket", "--at", "triage"], 0);
        }
        let (out, _) =
            b.run(&["-n", "ops", "list", "ticket", "--state", "triage", "--limit", "1"], 0);
        let hint = "More: keel -n ops list ticket --state triage --limit 1 --after i";
        assert!(out.contains(hint), "{}: {out}", b.name);
        let (out, _) = b.run(&["list", "nobody"], 0);
        assert!(out.contains("No instances of \"nobody\""), "{out}");

        for (args, code, needle) in [
            (&["list", "ticket", "--status", "sleeping"][..], 1, "--status: unknown value"),
            (&["list", "ticket", "--limit", "0"], 1, "--limit: 0 is out of range"),
            (&["list", "ticket", "--limit", "5000"], 1, "give 1 to 1000"),
            (&["list", "ticket", "--after", "1' OR '1'='1"], 1, "--after:"),
            (&["list", ""], 1, "machine: must not be empty"),
            (&["purge", "ticket", "--pending"], 1, "add --confirm"),
            (&["purge", "ticket", "--confirm"], 2, "--pending"),
            (&["purge", "ticket", "--pending", "--dlq", "--confirm"], 2, "cannot be used with"),
        ] {
            let (_, err) = b.run(args, code);
            assert!(err.contains(needle), "{}: keel {args:?}: {err}", b.name);
        }
        assert_eq!(
            ids(&b.json(&["list", "ticket"])),
            listed,
            "{}: bad input changed nothing",
            b.name
        );

        let purged = b.json(&["purge", "ticket", "--pending", "--confirm"]);
        assert_eq!(purged["cancelled"], 4, "{}: {purged}", b.name);
        assert_eq!(purged["complete"], true, "{}: {purged}", b.name);
        assert_eq!(ids(&b.json(&["list", "ticket", "--status", "cancelled"])).len(), 4);
        assert_eq!(
            ids(&b.json(&["list", "other", "--status", "runnable"])).len(),
            1,
            "other machines stay"
        );
        let (out, _) = b.run(&["purge", "ticket", "--pending", "--confirm"], 0);
        assert!(out.contains("Cancelled 0 pending"), "{out}");

        // Dead letters of one machine, made by a real worker.
        let keel = b.open().await;
        let worker = keel.worker_with(fast()).register(Refuser).unwrap().spawn().unwrap();
        for key in ["x", "y"] {
            let new = NewInstance::new(MachineRef::new("refuser", 1), "charge").business_key(key);
            let id = keel.start(new).await.unwrap().id();
            wait_for(&keel, id, Status::Suspended, b.name).await;
        }
        worker.shutdown().await;
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"].as_array().unwrap().len(), 2);
        let (_, err) = b.run(&["purge", "refuser", "--dlq"], 1);
        assert!(err.contains("deletes every dead letter"), "{err}");
        // Both instances are still suspended: their letters are how they are retried.
        let purged = b.json(&["purge", "refuser", "--dlq", "--confirm"]);
        assert_eq!((&purged["purged"], &purged["complete"]), (&json!(0), &json!(true)), "{purged}");
        assert_eq!(purged["kept_suspended"], 2, "{}: {purged}", b.name);
        let purged = b.json(&["purge", "refuser", "--dlq", "--include-suspended", "--confirm"]);
        assert_eq!((&purged["purged"], &purged["complete"]), (&json!(2), &json!(true)), "{purged}");
        assert_eq!(purged["kept_suspended"], Value::Null, "{}: {purged}", b.name);
        assert_eq!(b.json(&["dlq", "list"])["dead_letters"], json!([]));
        assert_eq!(ids(&b.json(&["list", "refuser", "--status", "suspended"])).len(), 2);
    }
}

/// A listing filter given a name that matches nothing says what was probably meant:
/// `--status` names the flag, the value, every status and the close one (case is
/// ignored); a machine (`list`, `status --machine`, `dlq list --machine`) or queue
/// (`pause`, `resume`) the store holds nothing of is still answered, with the closest
/// known name on stderr and in `--json`.
#[test]
fn listing_filters_name_what_a_misspelt_value_meant() {
    const STATUSES: &str = "accepted: runnable, executing, awaiting_signal, \
                            awaiting_children, suspended, done, failed, cancelled";
    for b in backends("listing_filters_name_what_a_misspelt_value_meant") {
        b.run(&["migrate"], 0);
        b.run(&["start", "ticket", "--queue", "billing"], 0);

        let (_, err) = b.run(&["list", "ticket", "--status", "runnabel"], 1);
        let meant = r#"--status: unknown value "runnabel" (did you mean `runnable`?)"#;
        assert!(err.contains(meant) && err.contains(STATUSES), "{}: {err}", b.name);
        let body = b.json_code(&["list", "ticket", "--status", "awaiting-signal"], 1);
        let error = body["error"].as_str().unwrap();
        assert!(error.contains("did you mean `awaiting_signal`?"), "{}: {body}", b.name);
        // Nothing close: every status is still named.
        let (_, err) = b.run(&["list", "ticket", "--status", "sleeping"], 1);
        assert!(err.contains(STATUSES) && !err.contains("did you mean"), "{err}");
        assert_eq!(ids(&b.json(&["list", "ticket", "--status", "RUNNABLE"])).len(), 1);

        for args in [
            &["list", "tickt"][..],
            &["status", "--machine", "tickt"],
            &["dlq", "list", "--machine", "tickt"],
        ] {
            let (_, err) = b.run(args, 0);
            assert!(
                err.contains(r#"holds nothing of machine "tickt""#)
                    && err.contains("did you mean `ticket`?"),
                "{}: keel {args:?}: {err}",
                b.name
            );
            let body = b.json(args);
            assert_eq!(body["unknown_machine"], true, "{}: keel {args:?}: {body}", b.name);
            assert_eq!(body["did_you_mean"], "ticket", "{}: keel {args:?}: {body}", b.name);
        }
        // A known machine with nothing to list is not a typo.
        for args in [
            &["list", "ticket"][..],
            &["list", "ticket", "--status", "done"],
            &["status", "--machine", "ticket"],
            &["dlq", "list", "--machine", "ticket"],
        ] {
            let (_, err) = b.run(args, 0);
            assert!(!err.contains("warning"), "{}: keel {args:?}: {err}", b.name);
            assert_eq!(b.json(args)["unknown_machine"], false, "{}: keel {args:?}", b.name);
        }

        let (out, _) = b.run(&["pause", "biling"], 0);
        assert!(out.contains("did you mean `billing`?"), "{}: {out}", b.name);
        assert_eq!(b.json(&["resume", "biling"])["did_you_mean"], "billing");
        assert_eq!(b.json(&["pause", "billing"])["did_you_mean"], Value::Null);
        b.run(&["resume", "billing"], 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_activity_and_health_thresholds_come_from_stored_rows() {
    for b in backends("workers_activity_and_health_thresholds") {
        b.run(&["migrate"], 0);
        let (out, _) = b.run(&["workers"], 0);
        assert!(
            out.contains("No workers claiming from namespace \"default\" have reported"),
            "{out}"
        );

        let keel = b.open().await;
        let worker = keel.worker_with(fast()).register(Echo).unwrap().spawn().unwrap();
        for n in 0..3 {
            let new =
                NewInstance::new(MachineRef::new("echo", 1), "run").context(json!({ "n": n }));
            let id = keel.start(new).await.unwrap().id();
            wait_for(&keel, id, Status::Done, b.name).await;
        }
        // Version 2 has no worker: its ready instance is "ready work with no compatible worker".
        keel.start(NewInstance::new(MachineRef::new("echo", 2), "run")).await.unwrap();

        let fleet = b.json(&["workers"]);
        assert_eq!(fleet["live"], 1, "{}: {fleet}", b.name);
        let w = &fleet["workers"][0];
        assert!(w["id"].as_str().unwrap().ends_with("/ops-test"), "{w}");
        assert_eq!(w["machines"], json!([{ "name": "echo", "version": 1 }]));
        let (out, _) = b.run(&["workers"], 0);
        assert!(out.contains("1 live, 0 stale") && out.contains("echo@v1"), "{out}");
        let stale = b.json(&["workers", "--stale-after", "0s"]);
        assert_eq!((stale["live"].as_u64(), stale["stale"].as_u64()), (Some(0), Some(1)));
        let (_, err) = b.run(&["workers", "--stale-after", "soon"], 1);
        assert!(err.contains("--stale-after"), "{err}");

        let status = b.json(&["status", "--machine", "echo"]);
        let m = &status["machines"][0];
        assert_eq!(
            (m["machine"].as_str(), m["completed_last_hour"].as_u64()),
            (Some("echo"), Some(3))
        );
        assert_eq!(m["failed_last_hour"], 0);
        assert!(m["avg_processing_ms"].as_u64().is_some(), "{m}");
        assert_eq!(
            m["completed_per_minute"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .sum::<u64>(),
            3
        );
        assert_eq!(m["completed_per_minute"].as_array().unwrap().len(), 60);
        assert_eq!(
            (m["ready_without_worker"].as_u64(), &m["unserved_versions"]),
            (Some(1), &json!([2]))
        );
        let (out, _) = b.run(&["status"], 0);
        assert!(out.contains("Last hour") && out.contains("1 (v2)"), "{out}");
        // The mean covers insert to end, waits included: it is named for what it is.
        assert!(out.contains("avg turnaround") && !out.contains("avg processing"), "{out}");

        let config = |alerts: &str| b.file("keel.toml", &format!("[queue.alerts]\n{alerts}\n"));
        b.run(&["health", "--config", &config("oldest_ready_age_critical = \"1 hour\"")], 0);
        let report =
            b.json_code(&["health", "--config", &config("oldest_ready_age_warning = \"1ms\"")], 1);
        assert_eq!(report["findings"][0]["check"], "oldest_ready_age_ms", "{report}");
        let report = b.json_code(
            &[
                "health",
                "--config",
                &config("processing_time_warning = \"1ms\"\nprocessing_time_critical = \"2ms\""),
            ],
            2,
        );
        assert_eq!(report["findings"][0]["check"], "processing_time_ms", "{report}");
        let (_, err) = b.run(
            &["health", "--config", &config("stuck_leases_warning = 5\nstuck_leases_critical = 1")],
            1,
        );
        assert!(err.contains("queue.alerts.stuck_leases_warning"), "{err}");
        worker.shutdown().await;

        // A lease that ran out with nobody to reap it is a stuck lease.
        keel.start(NewInstance::new(MachineRef::new("stuck", 1), "run")).await.unwrap();
        let claimed = keel
            .store()
            .instance_claim(ClaimParams {
                worker: keel::layers::core::ids::WorkerId("gone".into()),
                namespaces: vec!["default".into()],
                queues: Vec::new(),
                machines: vec![MachineRef::new("stuck", 1)],
                policy: keel::layers::core::plan::claim::ClaimPolicy::default(),
                limit: 1,
                lease: Duration::from_millis(50),
                now: keel::layers::core::Timestamp(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_millis() as i64,
                ),
            })
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let report = b.json_code(&["health", "--config", &config("stuck_leases_warning = 1")], 1);
        assert_eq!(
            (report["findings"][0]["check"].as_str(), report["findings"][0]["value"].as_u64()),
            (Some("stuck_leases"), Some(1)),
            "{report}"
        );
    }
}

const DOORS: &str = r#"[
  { "name": "door", "version": 1, "initial": "closed", "states": [
    { "key": "closed", "on": [ { "event": "OPEN", "guards": ["unlocked"], "target": "open" } ] },
    { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] },
  { "name": "door", "version": 2, "initial": "shut", "states": [
    { "key": "shut", "on": [ { "event": "OPEN", "target": "open" } ] },
    { "key": "open", "on": [ { "event": "CLOSE", "target": "shut" } ] } ] } ]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_draws_and_upgrade_moves_instances_from_a_definitions_file() {
    for b in backends("graph_draws_and_upgrade_moves_instances") {
        b.run(&["migrate"], 0);
        let defs = b.file("doors.json", DOORS);
        let (out, _) = b.run(&["graph", "door", "--definitions", &defs], 0);
        assert!(out.contains("stateDiagram-v2") && out.contains("shut --> open : OPEN"), "{out}");
        let dot =
            b.json(&["graph", "door", "--format", "dot", "--version", "1", "--definitions", &defs]);
        assert_eq!((dot["format"].as_str(), dot["version"].as_u64()), (Some("dot"), Some(1)));
        assert!(dot["diagram"].as_str().unwrap().starts_with("digraph"), "{dot}");
        assert_eq!(dot["warnings"], json!([]), "a sound chart draws without warnings");
        // A chart with a state nothing enters still draws; stderr and `warnings` say so.
        let stray = b.file(
            "stray.json",
            r#"{ "name": "gate", "version": 1, "initial": "shut", "states": [
                { "key": "shut", "on": [ { "event": "OPEN", "target": "open" } ] },
                { "key": "open" }, { "key": "lost" } ] }"#,
        );
        let (out, err) = b.run(&["graph", "gate", "--definitions", &stray], 0);
        assert!(out.contains("stateDiagram-v2"), "{out}");
        assert!(
            err.contains("warning: gate v1: state `lost` is unreachable"),
            "{}: stderr: {err}",
            b.name
        );
        let body = b.json(&["graph", "gate", "--definitions", &stray]);
        assert_eq!(body["warnings"].as_array().map(Vec::len), Some(1), "{body}");
        let broken = b.file("broken.json", "[{\"name\": \"door\"}]");
        for (args, code, needle) in [
            (
                &["graph", "gate", "--definitions", &defs][..],
                1,
                "machine: \"gate\" is not in the definitions file",
            ),
            (
                &["graph", "door", "--version", "7", "--definitions", &defs],
                1,
                "version: door has no version 7",
            ),
            (
                &["graph", "door", "--format", "svgz", "--definitions", &defs],
                2,
                "invalid value 'svgz'",
            ),
            (
                &["graph", "door", "--definitions", "/no/such/file.json"],
                1,
                "--definitions: cannot read",
            ),
            (&["graph", "door", "--definitions", &broken], 1, "chart [0]"),
        ] {
            let (_, err) = b.run(args, code);
            assert!(err.contains(needle), "{}: keel {args:?}: {err}", b.name);
        }
        // A directory whose `*.json` entries include a link back to itself and a
        // sub-directory: only its regular files are read, nothing recurses.
        // A link to a regular file is read as that file (mounted volumes are links).
        let dir = b.dir.path().join("charts");
        std::fs::create_dir_all(dir.join("nested.json")).unwrap();
        std::fs::write(
            dir.join("nested.json").join("hidden.json"),
            DOORS.replace("door", "hidden"),
        )
        .unwrap();
        std::fs::write(dir.join("doors.json"), DOORS).unwrap();
        std::fs::write(b.dir.path().join("gate-source"), DOORS.replace("door", "gate")).unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&dir, dir.join("loop.json")).unwrap();
            std::os::unix::fs::symlink(b.dir.path().join("gate-source"), dir.join("gates.json"))
                .unwrap();
            let charts = dir.display().to_string();
            let (out, _) = b.run(&["graph", "gate", "--definitions", &charts], 0);
            assert!(out.contains("shut --> open : OPEN"), "{}: {out}", b.name);
        }
        let charts = dir.display().to_string();
        let (out, _) = b.run(&["graph", "door", "--definitions", &charts], 0);
        assert!(out.contains("shut --> open : OPEN"), "{}: {out}", b.name);
        let (_, err) = b.run(&["graph", "hidden", "--definitions", &charts], 1);
        assert!(err.contains("machine: \"hidden\" is not in the definitions file"), "{err}");

        // Two doors on v1, parked in `closed` by a real chart worker.
        let keel = b.open().await;
        let v1 = ChartBuilder::from_json(
            &serde_json::to_string(&serde_json::from_str::<Value>(DOORS).unwrap()[0]).unwrap(),
        )
        .unwrap()
        .guard("unlocked", |_, _| true)
        .build()
        .unwrap();
        let chart = ChartMachine::new(v1);
        let worker = keel.worker_with(fast()).register(chart.clone()).unwrap().spawn().unwrap();
        let mut doors = Vec::new();
        for _ in 0..2 {
            let id = keel.start(chart.new_instance(json!({}))).await.unwrap().id();
            wait_for(&keel, id, Status::AwaitingSignal, b.name).await;
            doors.push(id);
        }
        worker.shutdown().await;

        let base = ["upgrade", "door", "--from", "1", "--to", "2", "--definitions", &defs];
        let dry: Vec<&str> = base.iter().copied().chain(["--dry-run"]).collect();
        let report = b.json(&dry);
        assert_eq!((report["dry_run"].as_bool(), report["moved"].as_u64()), (Some(true), Some(0)));
        assert_eq!(report["refused"][0]["count"], 2, "{}: {report}", b.name);
        let (out, _) = b.run(&dry, 0);
        assert!(out.contains("dry run") && out.contains("--map OLD=NEW"), "{out}");
        // Applied, with instances refused: the report, and exit 1 for a deploy script.
        let report = b.json_code(&base, 1);
        assert_eq!(
            (report["dry_run"].as_bool(), report["moved"].as_u64()),
            (Some(false), Some(0)),
            "{report}"
        );
        assert_eq!(report["refused"][0]["count"], 2, "{}: {report}", b.name);
        let (out, _) = b.run(&base, 1);
        assert!(out.contains("Not every instance moved: 2 left on v1"), "{}: {out}", b.name);
        for (args, needle) in [
            (vec!["--map", "closed"], "--map: \"closed\" is not OLD=NEW"),
            (vec!["--map", "ajar=shut"], "--map ajar=shut"),
        ] {
            let all: Vec<&str> = base.iter().copied().chain(args).collect();
            let (_, err) = b.run(&all, 1);
            assert!(err.contains(needle), "{}: {err}", b.name);
        }
        let (_, err) =
            b.run(&["upgrade", "door", "--from", "1", "--to", "1", "--definitions", &defs], 1);
        assert!(err.contains("--to: it equals --from"), "{err}");
        let (_, err) =
            b.run(&["upgrade", "door", "--from", "1", "--to", "3", "--definitions", &defs], 1);
        assert!(err.contains("--to") && err.contains("no version 3"), "{err}");
        for id in &doors {
            let row = b.json(&["inspect", &id.to_string()]);
            assert_eq!(row["instance"]["machine"]["version"], 1, "{}: nothing moved yet", b.name);
        }

        let mapped: Vec<&str> = base.iter().copied().chain(["--map", "closed=shut"]).collect();
        let report = b.json(&mapped);
        assert_eq!(
            (report["dry_run"].as_bool(), report["moved"].as_u64()),
            (Some(false), Some(2)),
            "{report}"
        );
        for id in &doors {
            let row = b.json(&["inspect", &id.to_string()]);
            assert_eq!(row["instance"]["machine"]["version"], 2, "{}: {row}", b.name);
            assert!(row["instance"]["position"].as_str().unwrap().contains("shut"), "{row}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_armed_and_due_timers_and_how_late_the_sweep_runs() {
    for b in backends("metrics_show_armed_and_due_timers") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        let alarm = keel::Definition::builder("alarm", 1)
            .initial("waiting")
            .state("waiting", |s| s.on("RING", |t| t.target("rung").after(keel::Timer::seconds(1))))
            .final_state("rung")
            .build()
            .unwrap();
        let chart = ChartMachine::new(alarm);
        // No sweeper in this worker: the timer stays armed and falls due unswept.
        let config = WorkerConfig { timers: None, ..fast() };
        let worker = keel.worker_with(config).register(chart.clone()).unwrap().spawn().unwrap();
        let id = keel.start(chart.new_instance(json!({}))).await.unwrap().id();
        wait_for(&keel, id, Status::AwaitingSignal, b.name).await;
        worker.shutdown().await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;

        let mut serve = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
            .args([
                "--database-url",
                &b.url,
                "--schema",
                &b.schema,
                "serve",
                "--listen",
                "127.0.0.1:0",
                // The server's own worker would sweep the due timer.
                "--no-worker",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(serve.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let base = line.trim().strip_prefix("listening on ").unwrap().to_owned();
        let text = ureq::get(&format!("{base}/metrics"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        let _ = serve.kill();
        let _ = serve.wait();
        let value = |metric: &str| {
            text.lines()
                .find(|l| l.starts_with(metric) && l.contains("machine=\"alarm\""))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{}: no {metric} for alarm in\n{text}", b.name))
        };
        assert_eq!(value("keel_timers_armed"), 1.0, "{}", b.name);
        assert_eq!(value("keel_timers_overdue"), 1.0, "{}", b.name);
        let late = value("keel_timers_sweep_lateness_seconds");
        assert!(late >= 0.4, "{}: the due timer is at least 0.4 s late, got {late}", b.name);
    }
}

fn seqs(doc: &Value) -> Vec<i64> {
    doc["entries"].as_array().unwrap().iter().map(|e| e["seq"].as_i64().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pages_newest_first_down_to_the_oldest_entry() {
    for b in backends("history_pages_newest_first_down_to_the_oldest_entry") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        let worker = keel.worker_with(fast()).register(Walker).unwrap().spawn().unwrap();
        let new = NewInstance::new(MachineRef::new("walker", 1), "s0").business_key("w1");
        let id = keel.start(new).await.unwrap().id();
        wait_for(&keel, id, Status::Done, b.name).await;
        worker.shutdown().await;
        let stored: Vec<i64> =
            keel.get(id).await.unwrap().history.iter().rev().map(|h| h.seq).collect();
        assert!(stored.len() >= 6, "{}: five steps and the end: {stored:?}", b.name);

        let whole = b.json(&["history", "walker:w1"]);
        assert_eq!(seqs(&whole), stored, "{}: newest first", b.name);
        assert_eq!((whole["instance"].as_i64(), &whole["next"]), (Some(id.0), &Value::Null));
        let kinds: Vec<&str> = whole["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["entry"]["kind"].as_str().unwrap())
            .collect();
        assert!(kinds.contains(&"STEP_NEXT"), "{}: {kinds:?}", b.name);

        // Pages of two, following `next`, cover the history once.
        let mut walked = Vec::new();
        let mut before: Option<i64> = None;
        for _ in 0..stored.len() {
            let mut args =
                vec!["history".to_owned(), format!("i{}", id.0), "--limit".into(), "2".into()];
            if let Some(cursor) = before {
                args.extend(["--before".into(), cursor.to_string()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let page = b.json(&args);
            let got = seqs(&page);
            assert!(got.len() <= 2, "{}: {page}", b.name);
            walked.extend(got);
            match page["next"].as_i64() {
                Some(next) => before = Some(next),
                None => break,
            }
        }
        assert_eq!(walked, stored, "{}: the pages add up to the history", b.name);

        let (out, _) = b.run(&["history", "walker:w1", "--limit", "2"], 0);
        // The hint names the instance by id: the key could pass to a newer instance.
        let hint = format!("More: keel history {id} --limit 2 --before {}", stored[1]);
        assert!(out.contains("STEP_") && out.contains(&hint), "{}: {out}", b.name);
        let oldest = stored.last().unwrap().to_string();
        let (out, _) = b.run(&["history", "walker:w1", "--before", &oldest], 0);
        assert!(out.contains("No older history"), "{}: {out}", b.name);

        for (args, needle) in [
            (
                &["history", "walker:w1", "--limit", "1001"][..],
                "limit: 1001 is out of range; give 1 to 1000",
            ),
            (&["history", "walker:w1", "--limit", "0"], "limit: 0 is out of range"),
            (
                &["history", "walker:w1", "--before", "soon"],
                "--before: \"soon\" is not a history cursor",
            ),
            (
                &["history", "walker:nobody"],
                "no instance of machine \"walker\" with key \"nobody\"",
            ),
            (&["history", "i999999"], "target: no instance i999999"),
            (&["-n", "elsewhere", "history", &format!("i{}", id.0)], "in namespace \"elsewhere\""),
        ] {
            let (_, err) = b.run(args, 1);
            assert!(err.contains(needle), "{}: keel {args:?}: {err}", b.name);
        }
    }
}

/// A refuser of any machine name: every instance ends in the dead-letter queue.
struct NamedRefuser(&'static str);

#[keel::async_trait]
impl StepMachine for NamedRefuser {
    fn machine(&self) -> MachineRef {
        MachineRef::new(self.0, 1)
    }

    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Err(StepError::fatal("card declined"))
    }
}

/// Runs one SQL statement on a SQLite file (to install a failing trigger).
async fn sqlite_exec(url: &str, sql: String) {
    use sqlx::{ConnectOptions as _, Connection as _};
    let path = url.strip_prefix("sqlite://").expect("a SQLite URL");
    let mut conn =
        sqlx::sqlite::SqliteConnectOptions::new().filename(path).connect().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.unwrap();
    conn.close().await.unwrap();
}

/// A trigger that fails every `op` (UPDATE or DELETE) on `table` rows matching `when`
/// with a runtime error ("integer overflow"), which the store reports as an outage, not a
/// conflict (RAISE would be a constraint violation: a conflict, skipped by a bulk retry).
fn failing(name: &str, op: &str, table: &str, when: &str) -> String {
    format!(
        "CREATE TRIGGER {name} BEFORE {op} ON {table} WHEN {when} \
         BEGIN SELECT abs(-9223372036854775807 - 1); END"
    )
}

/// Bulk commands a store error stops part way say what they had already done (committed)
/// before the error, in the message and in the `--json` error body. SQLite only: a trigger
/// makes one row's write fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_commands_that_fail_part_way_say_what_they_already_did() {
    let b = backends("bulk_commands_that_fail_part_way").remove(0);
    assert_eq!(b.name, "sqlite");
    b.run(&["migrate"], 0);

    // purge --pending cancels newest first: the oldest one fails, after two were cancelled.
    let mut tickets = Vec::new();
    for key in ["a", "b", "c"] {
        tickets.push(b.json(&["start", "ticket", "--key", key])["id"].as_i64().unwrap());
    }
    let oldest = tickets[0];
    sqlite_exec(
        &b.url,
        failing("no_cancel", "UPDATE", "keel_instances", &format!("OLD.id = {oldest}")),
    )
    .await;
    let (_, err) = b.run(&["purge", "ticket", "--pending", "--confirm"], 1);
    assert!(
        err.contains(
            "error: cancelled 2 pending instance(s) of \"ticket\" in namespace \"default\", then failed: "
        ) && err.contains("integer overflow"),
        "{err}"
    );
    assert_eq!(ids(&b.json(&["list", "ticket", "--status", "cancelled"])).len(), 2);
    let body = b.json_code(&["purge", "ticket", "--pending", "--confirm"], 1);
    assert_eq!((&body["cancelled"], &body["complete"]), (&json!(0), &json!(false)), "{body}");
    assert!(body["error"].as_str().unwrap().contains("integer overflow"), "{body}");
    sqlite_exec(&b.url, "DROP TRIGGER no_cancel".to_owned()).await;

    // Dead letters of two machines, `alpha` and `beta`.
    let keel = b.open().await;
    let worker = keel
        .worker_with(fast())
        .register(NamedRefuser("alpha"))
        .unwrap()
        .register(NamedRefuser("beta"))
        .unwrap()
        .spawn()
        .unwrap();
    let mut letters = Vec::new();
    for (machine, key) in [("alpha", "1"), ("alpha", "2"), ("beta", "1")] {
        let new = NewInstance::new(MachineRef::new(machine, 1), "charge").business_key(key);
        let id = keel.start(new).await.unwrap().id();
        wait_for(&keel, id, Status::Suspended, b.name).await;
        letters.push(id);
    }
    worker.shutdown().await;

    // retry --all: the first instance is retried, the second one's update fails.
    let second = letters[1].0;
    sqlite_exec(
        &b.url,
        failing("no_retry", "UPDATE", "keel_instances", &format!("OLD.id = {second}")),
    )
    .await;
    let (_, err) = b.run(&["dlq", "retry", "--machine", "alpha", "--all"], 1);
    assert!(
        err.contains(
            "error: retried 1 instance(s) of \"alpha\" in namespace \"default\", then failed: "
        ),
        "{err}"
    );
    let body = b.json_code(&["dlq", "retry", "--machine", "alpha", "--all"], 1);
    assert_eq!((&body["retried"], &body["stale"]), (&json!([]), &json!(0)), "{body}");
    sqlite_exec(&b.url, "DROP TRIGGER no_retry".to_owned()).await;

    // dlq purge goes machine by machine: alpha's letter goes, beta's delete fails. Their
    // instances are still suspended, so only --include-suspended deletes their letters.
    sqlite_exec(&b.url, failing("no_purge", "DELETE", "keel_dead_letters", "OLD.machine = 'beta'"))
        .await;
    let args = ["dlq", "purge", "--older-than", "0s", "--include-suspended", "--confirm"];
    let (_, err) = b.run(&args, 1);
    assert!(
        err.contains(
            "error: purged 1 dead letter(s) older than 0 seconds in namespace \"default\", then failed: "
        ),
        "{err}"
    );
    let body = b.json_code(&["purge", "beta", "--dlq", "--include-suspended", "--confirm"], 1);
    assert_eq!((&body["purged"], &body["machine"]), (&json!(0), &json!("beta")), "{body}");
    assert!(
        body["error"].as_str().unwrap().starts_with("purged 0 dead letter(s) of \"beta\""),
        "{body}"
    );
    sqlite_exec(&b.url, "DROP TRIGGER no_purge".to_owned()).await;
    let left = b.json(&["dlq", "list"]);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1, "beta's letter stayed: {left}");
}

/// The wall clock in the store's unit.
fn wall_clock() -> keel::layers::core::Timestamp {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    keel::layers::core::Timestamp(ms.as_millis() as i64)
}

/// `n` new instances of `machine` in the default namespace, inserted at `at`.
async fn insert_many(
    keel: &Keel,
    machine: MachineRef,
    n: usize,
    at: keel::layers::core::Timestamp,
) {
    use keel::layers::core::ports::store::InsertParams;
    let instances = (0..n).map(|_| NewInstance::new(machine.clone(), "run")).collect::<Vec<_>>();
    let inserted = keel.store().instance_insert(InsertParams { instances, now: at }).await.unwrap();
    assert_eq!(inserted.len(), n);
}

/// Stuck leases and ready work without a worker are counted past the first list page, and
/// a count the page bound stops says it is a lower bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_leases_and_unserved_work_are_counted_past_one_page() {
    const N: u64 = 1_500;
    for b in backends("stuck_leases_and_unserved_work_are_counted_past_one_page") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        // An hour ago a worker (gone since) claimed every `busy` instance for a second.
        let then = wall_clock().minus(Duration::from_secs(3_600));
        let busy = MachineRef::new("busy", 1);
        insert_many(&keel, busy.clone(), N as usize, then).await;
        let mut claimed = 0;
        while claimed < N as usize {
            let page = keel
                .store()
                .instance_claim(ClaimParams {
                    worker: keel::layers::core::ids::WorkerId("gone".into()),
                    namespaces: vec!["default".into()],
                    queues: Vec::new(),
                    machines: vec![busy.clone()],
                    policy: keel::layers::core::plan::claim::ClaimPolicy::default(),
                    limit: 1_000,
                    lease: Duration::from_secs(1),
                    now: then.plus(Duration::from_secs(1)),
                })
                .await
                .unwrap();
            assert!(!page.is_empty(), "{}: every busy instance is claimable", b.name);
            claimed += page.len();
        }
        // Version 3 of `idle` has no worker at all.
        insert_many(&keel, MachineRef::new("idle", 3), N as usize, wall_clock()).await;

        let status = b.json(&["status"]);
        let machine = |name: &str| {
            status["machines"].as_array().unwrap().iter().find(|m| m["machine"] == name).cloned()
        };
        let busy_row = machine("busy").unwrap_or_else(|| panic!("{}: {status}", b.name));
        assert_eq!(
            (&busy_row["stuck_leases"], &busy_row["stuck_leases_complete"]),
            (&json!(N), &json!(true)),
            "{}: {busy_row}",
            b.name
        );
        let idle_row = machine("idle").unwrap_or_else(|| panic!("{}: {status}", b.name));
        assert_eq!(
            (
                &idle_row["ready_without_worker"],
                &idle_row["ready_without_worker_complete"],
                &idle_row["unserved_versions"]
            ),
            (&json!(N), &json!(true), &json!([3])),
            "{}: {idle_row}",
            b.name
        );
        let (out, _) = b.run(&["status"], 0);
        assert!(out.contains("1500 (v3)"), "{}: {out}", b.name);
        let config = b.file("keel.toml", "[queue.alerts]\nstuck_leases_critical = 1500\n");
        let report = b.json_code(&["health", "--config", &config], 2);
        assert_eq!(
            (&report["findings"][0]["check"], &report["findings"][0]["value"]),
            (&json!("stuck_leases"), &json!(N)),
            "{}: {report}",
            b.name
        );
        assert_eq!(report["findings"][0]["complete"], true, "{}: {report}", b.name);

        // Held to one page, the counts stop at it and say so.
        let now = wall_clock();
        let counted =
            keel_cli::operate::stuck_leases_within(&keel, "default", "busy", now, 1).await.unwrap();
        assert_eq!((counted.count, counted.complete), (1_000, false), "{}", b.name);
        let stats = keel.store().queue_stats(Some("default".into()), now).await.unwrap();
        let activity = keel_cli::operate::activity_within(&keel, "default", None, now, &stats, 1)
            .await
            .unwrap();
        let table = keel_cli::operate::activity_table(&activity);
        let row = |machine: &str| table.lines().find(|l| l.contains(machine)).unwrap_or_default();
        assert!(row("idle").contains("at least 1000 (v3)"), "{}: {table}", b.name);
        assert!(row("busy").contains("at least 1000"), "{}: stuck leases: {table}", b.name);
    }
}

/// A parent that schedules a quick `kid` and a `slow` child (no worker) and wakes once
/// one of them is done, leaving the other running; then it waits an hour.
struct Parent;

#[keel::async_trait]
impl StepMachine for Parent {
    fn machine(&self) -> MachineRef {
        MachineRef::new("parent", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        if ctx.step == "hold" {
            return Ok(Outcome::Retry {
                context: ctx.context.clone(),
                delay: Duration::from_secs(3_600),
            });
        }
        let children = vec![
            NewInstance::new(MachineRef::new("kid", 1), "go"),
            NewInstance::new(MachineRef::new("slow", 1), "go"),
        ];
        Ok(Outcome::schedule_children("hold", children, json!({}))
            .with_join(keel::Join::quorum(1).leave_running()))
    }
}

/// Finishes at once.
struct Kid;

#[keel::async_trait]
impl StepMachine for Kid {
    fn machine(&self) -> MachineRef {
        MachineRef::new("kid", 1)
    }

    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!({}), step: None })
    }
}

/// A pending `parent` whose `slow` child still runs: the child's id.
async fn parent_with_a_running_child(b: &Backend, keel: &Keel) -> (i64, i64) {
    let worker =
        keel.worker_with(fast()).register(Parent).unwrap().register(Kid).unwrap().spawn().unwrap();
    let parent = keel.start(NewInstance::new(MachineRef::new("parent", 1), "spawn")).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    // At `hold` the parent first waits for its children; the quick kid's end wakes it.
    let woken = |i: &keel::Instance| i.position == "hold" && i.status != Status::AwaitingChildren;
    while !woken(&keel.get(parent.id()).await.unwrap().instance) {
        assert!(std::time::Instant::now() < deadline, "{}: the parent never woke", b.name);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker.shutdown().await;
    let detail = keel.get(parent.id()).await.unwrap();
    assert_eq!(detail.instance.status, Status::Runnable, "{}: {detail:?}", b.name);
    let slow = detail.children.iter().find(|c| c.machine.name == "slow").expect("a slow child");
    assert_eq!(slow.status, Status::Runnable, "{}: the slow child runs on", b.name);
    (parent.id().0, slow.id.0)
}

/// `purge --pending` cancels the descendants of what it cancels, and says which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_pending_reports_the_descendants_its_cascade_cancelled() {
    for b in backends("purge_pending_reports_the_descendants_its_cascade_cancelled") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        let (parent, slow) = parent_with_a_running_child(&b, &keel).await;
        let report = b.json(&["purge", "parent", "--pending", "--confirm"]);
        assert_eq!(
            (
                &report["cancelled"],
                &report["ids"],
                &report["descendants"],
                &report["descendant_ids"]
            ),
            (&json!(1), &json!([parent]), &json!(1), &json!([slow])),
            "{}: {report}",
            b.name
        );
        let child = keel.get(keel::InstanceId(slow)).await.unwrap().instance;
        assert_eq!(child.status, Status::Cancelled, "{}", b.name);

        let (_, slow) = parent_with_a_running_child(&b, &keel).await;
        let (out, _) = b.run(&["purge", "parent", "--pending", "--confirm"], 0);
        let said = "Cancelled 1 pending instance(s) of \"parent\" in namespace \"default\" and 1 of their descendant(s)";
        assert!(out.contains(said), "{}: {out}", b.name);
        assert!(out.contains(&format!("running ones included): i{slow}.")), "{}: {out}", b.name);
    }
}

/// A bulk retry names the first instances and counts the rest; `--json` lists them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_retry_names_the_first_ids_and_counts_the_rest() {
    const N: usize = 25;
    for b in backends("a_bulk_retry_names_the_first_ids_and_counts_the_rest") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        let worker = keel.worker_with(fast()).register(Refuser).unwrap().spawn().unwrap();
        let mut started = Vec::new();
        for n in 0..N {
            let new = NewInstance::new(MachineRef::new("refuser", 1), "charge")
                .business_key(n.to_string());
            started.push(keel.start(new).await.unwrap().id());
        }
        for id in &started {
            wait_for(&keel, *id, Status::Suspended, b.name).await;
        }
        worker.shutdown().await;
        let (out, _) = b.run(&["dlq", "retry", "--machine", "refuser", "--all"], 0);
        let head = format!("Retried {N} instance(s) of \"refuser\" in namespace \"default\": ");
        assert!(out.starts_with(&head), "{}: {out}", b.name);
        assert!(out.trim_end().ends_with(" … and 5 more."), "{}: {out}", b.name);
        assert_eq!(out.matches(", i").count(), 19, "{}: twenty ids named: {out}", b.name);

        let worker = keel.worker_with(fast()).register(Refuser).unwrap().spawn().unwrap();
        for id in &started {
            wait_for(&keel, *id, Status::Suspended, b.name).await;
        }
        worker.shutdown().await;
        let report = b.json(&["dlq", "retry", "--machine", "refuser", "--all"]);
        let mut retried: Vec<i64> =
            report["retried"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
        retried.sort_unstable();
        assert_eq!(retried, started.iter().map(|id| id.0).collect::<Vec<_>>(), "{}", b.name);
    }
}

/// `inspect` says when children, timers or history fill their list, and where the older
/// history is. SQLite only: the rows are written with SQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_says_when_children_timers_or_history_are_cut() {
    use keel::layers::core::chart::{TimerArm, TimerKind};
    let b = backends("inspect_says_when_children_timers_or_history_are_cut").remove(0);
    assert_eq!(b.name, "sqlite");
    b.run(&["migrate"], 0);
    let id = b.json(&["start", "ticket"])["id"].as_i64().unwrap();
    let plain = b.json(&["start", "ticket"])["id"].as_i64().unwrap();
    let keel = b.open().await;
    insert_many(&keel, MachineRef::new("kid", 1), 1_000, wall_clock()).await;
    sqlite_exec(
        &b.url,
        format!("UPDATE keel_instances SET parent_id = {id} WHERE machine = 'kid'"),
    )
    .await;
    let spec = serde_json::to_string(&TimerArm {
        state: "open".into(),
        event: "REMIND".into(),
        kind: TimerKind::After,
        interval: Duration::from_secs(3_600),
        max: None,
        then: None,
    })
    .unwrap()
    .replace('\'', "''");
    let thousand = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)";
    sqlite_exec(
        &b.url,
        format!(
            "{thousand} INSERT INTO keel_timers (instance_id, namespace, machine, machine_version, \
             spec, next_fire_at, fire_count, armed_at) \
             SELECT {id}, 'default', 'ticket', 1, '{spec}', 4102444800000 + i, 0, 1 FROM n"
        ),
    )
    .await;
    sqlite_exec(
        &b.url,
        format!(
            "{thousand} INSERT INTO keel_history (instance_id, at, revision, attempt, kind, data) \
             SELECT {id}, 1000 + i, 1, 0, 'NOTE', '{{}}' FROM n"
        ),
    )
    .await;
    let detail = b.json(&["inspect", &id.to_string()]);
    let len = |key: &str| detail[key].as_array().map(Vec::len);
    assert_eq!(
        (len("children"), len("timers"), len("history")),
        (Some(1000), Some(1000), Some(1000))
    );
    let oldest = detail["history"][0]["seq"].as_i64().unwrap();
    let (out, _) = b.run(&["inspect", &id.to_string()], 0);
    for note in [
        "(the oldest 1000 children; more may exist)".to_owned(),
        "(the soonest 1000 armed timers; more may be armed)".to_owned(),
        format!("(the newest 1000 entries; older ones: `keel history i{id} --before {oldest}`)"),
    ] {
        assert!(out.contains(&note), "{note}:\n{out}");
    }
    let (out, _) = b.run(&["inspect", &plain.to_string()], 0);
    assert!(!out.contains("more may") && !out.contains("older ones"), "{out}");
}

/// Suggested commands quote the namespace for the shell, as they quote every other word.
#[test]
fn suggested_commands_quote_the_namespace() {
    for b in backends("suggested_commands_quote_the_namespace") {
        b.run(&["migrate"], 0);
        for _ in 0..2 {
            b.run(&["-n", "team a", "start", "ticket"], 0);
        }
        let (out, _) = b.run(&["-n", "team a", "list", "ticket", "--limit", "1"], 0);
        assert!(out.contains("More: keel -n 'team a' list ticket --limit 1 --after i"), "{out}");
        let (out, _) = b.run(&["-n", "it's", "pause", "nowhere"], 0);
        assert!(out.contains(r"`keel -n 'it'\''s' status`"), "{}: {out}", b.name);
    }
}

/// What a keeping purge reports: how many it deleted, how many it kept, whether it finished.
fn kept(doc: &Value) -> (&Value, &Value, &Value) {
    (&doc["purged"], &doc["kept_suspended"], &doc["complete"])
}

/// The dead letters of `refuser` in the default namespace, oldest first: (letter, instance).
fn letters(b: &Backend) -> Vec<(i64, i64)> {
    let listed = b.json(&["dlq", "list", "--machine", "refuser", "--limit", "1000"]);
    listed["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["id"].as_i64().unwrap(), d["letter"]["instance"].as_i64().unwrap()))
        .collect()
}

/// `n` instances of `refuser` dead-lettered by a real worker, which is returned still
/// running.
async fn refused(b: &Backend, keel: &Keel, n: usize) -> keel::WorkerHandle {
    let worker = keel.worker_with(fast()).register(Refuser).unwrap().spawn().unwrap();
    let mut started = Vec::with_capacity(n);
    for key in 0..n {
        let new =
            NewInstance::new(MachineRef::new("refuser", 1), "charge").business_key(key.to_string());
        started.push(keel.start(new).await.unwrap().id());
    }
    for id in started {
        wait_for(keel, id, Status::Suspended, b.name).await;
    }
    worker
}

/// A machine-wide retry reads only the dead letters there were when it began: an instance
/// it retried that fails again while the run goes on (its new letter sorts after the
/// others) is left for the operator, not retried again by the same run, and each instance
/// is reported once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_retry_leaves_the_letters_recorded_while_it_runs() {
    for b in backends("a_machine_retry_leaves_the_letters_recorded_while_it_runs") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        let worker = refused(&b, &keel, 5).await;
        let before = letters(&b);
        assert_eq!(before.len(), 5, "{}: {before:?}", b.name);
        let first_page: Vec<keel::InstanceId> =
            before[..2].iter().map(|(_, i)| keel::InstanceId(*i)).collect();

        // After the first page (two letters) is retried, the still-running worker fails
        // both instances again, and only then does the walk go on.
        let handle = tokio::runtime::Handle::current();
        let mut worker = Some(worker);
        let done = keel_cli::operate::retry_machine_letters(
            &keel,
            "default",
            "refuser",
            None,
            2,
            100,
            |_| {
                let Some(worker) = worker.take() else { return };
                tokio::task::block_in_place(|| {
                    handle.block_on(async {
                        for id in &first_page {
                            wait_for(&keel, *id, Status::Suspended, b.name).await;
                        }
                        worker.shutdown().await;
                    });
                });
            },
        )
        .await
        .expect("no store error");

        let all: Vec<keel::InstanceId> = before.iter().map(|(_, i)| keel::InstanceId(*i)).collect();
        assert_eq!((done.retried, done.stale, done.complete), (all, 0, true), "{}", b.name);
        // The two new letters stay, and their instances stay suspended. The worker fails
        // the two instances again in whichever order it claims them.
        let after = letters(&b);
        let mut instances: Vec<i64> = after.iter().map(|(_, i)| *i).collect();
        instances.sort_unstable();
        let mut first: Vec<i64> = before[..2].iter().map(|(_, i)| *i).collect();
        first.sort_unstable();
        assert_eq!(instances, first, "{}: {after:?}", b.name);
        assert!(after.iter().all(|(l, _)| *l > before[4].0), "{}: {after:?}", b.name);
        for id in &first_page {
            let row = keel.get(*id).await.unwrap().instance;
            assert_eq!(row.status, Status::Suspended, "{}: {id}", b.name);
        }
    }
}

/// A machine-wide retry reads its dead letters in small pages (each letter carries its
/// event's payload and every attempt's error), whatever page size it is asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_retry_reads_small_pages() {
    const N: usize = 150;
    for b in backends("a_machine_retry_reads_small_pages") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        refused(&b, &keel, N).await.shutdown().await;
        let mut pages = Vec::new();
        let done = keel_cli::operate::retry_machine_letters(
            &keel,
            "default",
            "refuser",
            None,
            keel::layers::core::limits::ROWS_BATCH_MAX,
            100,
            |n| pages.push(n),
        )
        .await
        .expect("no store error");
        assert_eq!((done.retried.len(), done.complete), (N, true), "{}", b.name);
        assert_eq!(pages, [100, 50], "{}: page sizes", b.name);
        assert_eq!(keel_cli::operate::RETRY_PAGE_MAX, 100);
    }
}

/// A cascading cancel that reaches the store's bound of instances says so, on stderr and
/// with `"complete": false`, and names how to find what is left; `purge --pending` too.
/// SQLite only: the children are attached with SQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascade_cut_at_its_bound_says_so() {
    use keel::layers::core::limits::CANCEL_CASCADE_MAX;
    let b = backends("a_cascade_cut_at_its_bound_says_so").remove(0);
    assert_eq!(b.name, "sqlite");
    b.run(&["migrate"], 0);
    let keel = b.open().await;
    let mut parents = Vec::new();
    for machine in ["fanout", "boss"] {
        let id = b.json(&["start", machine, "--version", "1"])["id"].as_i64().unwrap();
        // One insert takes at most as many instances as one cascade cancels.
        for n in [CANCEL_CASCADE_MAX, 5] {
            insert_many(&keel, MachineRef::new("kid", 1), n, wall_clock()).await;
        }
        sqlite_exec(
            &b.url,
            format!(
                "UPDATE keel_instances SET parent_id = {id} WHERE machine = 'kid' AND parent_id IS NULL"
            ),
        )
        .await;
        parents.push(id);
    }

    let out = b
        .keel_cmd()
        .args(["--json", "cancel", &parents[0].to_string(), "--cascade"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(report["cancelled"].as_array().unwrap().len(), CANCEL_CASCADE_MAX, "{err}");
    assert_eq!(report["complete"], false, "{err}");
    let said = format!(
        "warning: the cascade from i{} stopped at its bound of {CANCEL_CASCADE_MAX} instances",
        parents[0]
    );
    assert!(err.contains(&said), "{err}");
    assert!(err.contains("`keel list kid --status runnable`"), "{err}");
    assert!(err.contains("`keel cancel ID --cascade`"), "{err}");

    let out =
        b.keel_cmd().args(["--json", "purge", "boss", "--pending", "--confirm"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        (&report["cancelled"], &report["complete"], &report["cascade_cut"]),
        (&json!(1), &json!(false), &json!([parents[1]])),
        "{err}"
    );
    assert!(err.contains(&format!("warning: the cascade from i{} stopped", parents[1])), "{err}");

    // A cascade below the bound is complete.
    let small = b.json(&["start", "solo", "--version", "1"])["id"].as_i64().unwrap();
    let report = b.json(&["cancel", &small.to_string(), "--cascade"]);
    assert_eq!((&report["cancelled"], &report["complete"]), (&json!([small]), &json!(true)));
}

/// A purge of dead letters (`keel dlq purge`, `keel purge M --dlq`, and the dashboard's
/// through `purge_old_dead_letters`) keeps the letters of instances that are still
/// suspended, the only way to retry them, and says how many it kept and what to do with
/// them; `--include-suspended` deletes them too. Without `--confirm`, the refusal says
/// how many letters and suspended instances there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_keep_the_dead_letters_of_suspended_instances() {
    for b in backends("purges_keep_the_dead_letters_of_suspended_instances") {
        b.run(&["migrate"], 0);
        let keel = b.open().await;
        refused(&b, &keel, 3).await.shutdown().await;
        let all = letters(&b);
        assert_eq!(all.len(), 3, "{}: {all:?}", b.name);
        // One instance cancelled: its letter only records what happened.
        let (_, gone) = all[0];
        b.run(&["cancel", &gone.to_string()], 0);

        let (_, err) = b.run(&["purge", "refuser", "--dlq"], 1);
        assert!(
            err.contains(
                "(3 dead letter(s) in namespace \"default\" now; those of its 2 suspended instance(s) stay); add --confirm to proceed"
            ),
            "{}: {err}",
            b.name
        );
        let (_, err) = b.run(&["purge", "refuser", "--dlq", "--include-suspended"], 1);
        assert!(err.contains("would have nothing left to retry them by"), "{}: {err}", b.name);
        let (_, err) = b.run(&["purge", "refuser", "--pending"], 1);
        assert!(err.contains("(0 runnable in namespace \"default\" now"), "{}: {err}", b.name);
        let (_, err) = b.run(&["dlq", "purge", "--older-than", "0s"], 1);
        assert!(
            err.contains("(it holds 3 dead letter(s) of any age now")
                && err.contains("the letters of its 2 suspended instance(s) stay)"),
            "{}: {err}",
            b.name
        );
        assert_eq!(letters(&b).len(), 3, "{}: a refusal deletes nothing", b.name);

        let purged = b.json(&["dlq", "purge", "--older-than", "0s", "--confirm"]);
        assert_eq!(kept(&purged), (&json!(1), &json!(2), &json!(true)), "{}: {purged}", b.name);
        let left: Vec<i64> = letters(&b).into_iter().map(|(_, i)| i).collect();
        assert_eq!(left, [all[1].1, all[2].1], "{}: the suspended ones' letters stay", b.name);
        let (out, _) = b.run(&["dlq", "purge", "--older-than", "0s", "--confirm"], 0);
        assert!(
            out.contains(
                "\nKept 2 dead letter(s) whose instance is still suspended (a letter is the only way to retry it): retry them with `keel dlq retry ID`, or cancel the instances."
            ),
            "{}: {out}",
            b.name
        );
        let (out, _) = b.run(&["purge", "refuser", "--dlq", "--confirm"], 0);
        assert!(
            out.contains("Purged 0 dead letter(s) of \"refuser\" in namespace \"default\".")
                && out.contains("retry them with `keel dlq retry --machine refuser --all`"),
            "{}: {out}",
            b.name
        );
        // A keeping purge with something to delete deletes it and keeps the rest.
        b.run(&["cancel", &all[1].1.to_string()], 0);
        let purged = b.json(&["purge", "refuser", "--dlq", "--confirm"]);
        assert_eq!(kept(&purged), (&json!(1), &json!(1), &json!(true)), "{}: {purged}", b.name);
        let left: Vec<i64> = letters(&b).into_iter().map(|(_, i)| i).collect();
        assert_eq!(left, [all[2].1], "{}: the suspended one's letter stays", b.name);

        // The dashboard's purge keeps them too, and deletes the others.
        refused(&b, &keel, 2).await.shutdown().await;
        let fresh: Vec<i64> = letters(&b).into_iter().map(|(_, i)| i).skip(1).collect();
        assert_eq!(fresh.len(), 2, "{}: {fresh:?}", b.name);
        b.run(&["cancel", &fresh[0].to_string()], 0);
        let done = keel_cli::operate::purge_old_dead_letters(&keel, "default", Duration::ZERO, 10)
            .await
            .unwrap();
        assert_eq!((done.purged, done.complete), (1, true), "{}", b.name);
        let left: Vec<i64> = letters(&b).into_iter().map(|(_, i)| i).collect();
        assert_eq!(left, [all[2].1, fresh[1]], "{}", b.name);
        // A kept letter still retries its instance.
        let retried = b.json(&["dlq", "retry", &letters(&b)[0].0.to_string()]);
        assert_eq!(retried["retried"], json!([all[2].1]), "{}: {retried}", b.name);

        let purged =
            b.json(&["dlq", "purge", "--older-than", "0s", "--include-suspended", "--confirm"]);
        assert_eq!(
            (&purged["purged"], &purged["kept_suspended"]),
            (&json!(1), &Value::Null),
            "{}: {purged}",
            b.name
        );
        assert_eq!(letters(&b), [], "{}", b.name);
    }
}
