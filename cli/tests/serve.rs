//! `keel serve` as a real process on a loopback port, driven over HTTP, on SQLite and on
//! PostgreSQL (a fresh schema when `KEEL_TEST_DATABASE_URL` is set; SKIPPED loudly
//! otherwise, a failure under `KEEL_REQUIRE_BACKENDS=1`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::Duration;

use keel::{MachineRef, Outcome, StepContext, StepError, StepMachine, WorkerConfig};
use serde_json::{Value, json};

struct Server {
    child: Child,
    base: String,
    agent: ureq::Agent,
    /// The store the server serves, for a test that opens it through the library.
    url: String,
    schema: String,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whichever stores this run can reach, each with `keel serve` started on port 0.
fn servers(test: &str, config: Option<&str>) -> Vec<(&'static str, Server)> {
    servers_with(test, config, None)
}

/// As [`servers`], with a tokens file when `tokens` is given.
fn servers_with(
    test: &str,
    config: Option<&str>,
    tokens: Option<&str>,
) -> Vec<(&'static str, Server)> {
    servers_full(test, config, tokens, None)
}

/// As [`servers_with`], with a chart definitions file when `definitions` is given.
fn servers_full(
    test: &str,
    config: Option<&str>,
    tokens: Option<&str>,
    definitions: Option<&str>,
) -> Vec<(&'static str, Server)> {
    let mut stores = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("keel.db").display());
    stores.push(("sqlite", url, "keel".to_owned(), Some(dir)));
    if let Some(url) = keel::layers::postgres::testing::database_url() {
        stores.push(("postgres", url, keel::layers::postgres::testing::unique_schema(), None));
    } else {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run {test}"
        );
        eprintln!("SKIPPED postgres part of {test}: set KEEL_TEST_DATABASE_URL to run it");
    }
    stores
        .into_iter()
        .map(|(name, url, schema, dir)| {
            (name, spawn(&url, &schema, config, tokens, definitions, dir))
        })
        .collect()
}

fn spawn(
    url: &str,
    schema: &str,
    config: Option<&str>,
    tokens: Option<&str>,
    definitions: Option<&str>,
    dir: Option<tempfile::TempDir>,
) -> Server {
    let bin = assert_cmd::cargo::cargo_bin("keel");
    let migrate = std::process::Command::new(&bin)
        .args(["--database-url", url, "--schema", schema, "migrate"])
        .output()
        .unwrap();
    assert!(migrate.status.success(), "{migrate:?}");
    let mut cmd = std::process::Command::new(&bin);
    cmd.args(["--database-url", url, "--schema", schema, "serve", "--listen", "127.0.0.1:0"]);
    let config_dir = tempfile::tempdir().unwrap();
    if let Some(text) = config {
        let path = config_dir.path().join("keel.toml");
        std::fs::write(&path, text).unwrap();
        cmd.arg("--config").arg(path);
    }
    if let Some(text) = tokens {
        let path = config_dir.path().join("tokens.toml");
        std::fs::write(&path, text).unwrap();
        cmd.arg("--tokens").arg(path);
    }
    if let Some(text) = definitions {
        let path = config_dir.path().join("charts.json");
        std::fs::write(&path, text).unwrap();
        cmd.arg("--definitions").arg(path);
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let base = line.trim().strip_prefix("listening on ").expect("the address line").to_owned();
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into();
    Server {
        child,
        base,
        agent,
        url: url.to_owned(),
        schema: schema.to_owned(),
        _dir: dir.or(Some(config_dir)),
    }
}

impl Server {
    /// The server's store, opened through the library on `rt`.
    fn keel(&self, rt: &tokio::runtime::Runtime) -> keel::Keel {
        let options = keel::ConnectOptions::default().schema(&self.schema);
        rt.block_on(keel::Keel::connect_with(&self.url, options)).unwrap()
    }

    fn post(&self, path: &str, body: &str) -> (u16, Value) {
        self.post_as("", path, body)
    }

    /// A POST with a bearer token (none when empty).
    fn post_as(&self, token: &str, path: &str, body: &str) -> (u16, Value) {
        let mut req =
            self.agent.post(&format!("{}{path}", self.base)).content_type("application/json");
        if !token.is_empty() {
            req = req.header("Authorization", &format!("Bearer {token}"));
        }
        let mut resp = req.send(body).unwrap();
        let text = resp.body_mut().read_to_string().unwrap();
        (resp.status().as_u16(), serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// A raw request announcing a body with `Expect: 100-continue`, as curl does for large
    /// bodies; returns the final response's text.
    fn post_expecting_continue(&self, path: &str, body: &str) -> String {
        use std::io::{Read, Write};
        let addr = self.base.strip_prefix("http://").unwrap();
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        let mut buf = vec![0u8; 4096];
        let n = stream.read(&mut buf).unwrap();
        let first = String::from_utf8_lossy(&buf[..n]).into_owned();
        if !first.starts_with("HTTP/1.1 100") {
            let mut rest = String::new();
            let _ = stream.read_to_string(&mut rest);
            return first + &rest;
        }
        // The server may stop reading (and close) once the body passes its limit; what
        // it answered is still there to read.
        let _ = stream.write_all(body.as_bytes());
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        String::from_utf8_lossy(&rest).into_owned()
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.get_as("", path)
    }

    /// A GET with a bearer token (none when empty).
    fn get_as(&self, token: &str, path: &str) -> (u16, String) {
        let mut req = self.agent.get(&format!("{}{path}", self.base));
        if !token.is_empty() {
            req = req.header("Authorization", &format!("Bearer {token}"));
        }
        let mut resp = req.call().unwrap();
        (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap())
    }

    fn get_json(&self, path: &str) -> (u16, Value) {
        let (code, text) = self.get(path);
        (code, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// The server's `host:port`.
    fn addr(&self) -> &str {
        self.base.strip_prefix("http://").unwrap()
    }

    /// A request written by hand, as a browser would send it: `Host` (the server's own
    /// address unless given) and the extra `Name: value` lines; the status and the body.
    fn raw(
        &self,
        method: &str,
        path: &str,
        host: Option<&str>,
        headers: &[&str],
        body: &str,
    ) -> (u16, String) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.addr()).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            host.unwrap_or(self.addr()),
            body.len()
        );
        for line in headers {
            head.push_str(line);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body.as_bytes()).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let status = answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        (status, body)
    }

    /// Writes `request` on a new connection left open and returns the answer's head (the
    /// status line and headers, lower case) and whether the server closed the connection
    /// after the answer's body (else it kept it open for 2 s).
    fn answer_head(&self, request: &str) -> (String, bool) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.addr()).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |n| n.trim().parse().unwrap());
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let closed = matches!(stream.read(&mut byte), Ok(0));
        (head, closed)
    }

    /// [`Server::raw`] with a JSON answer.
    fn raw_json(&self, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, Value) {
        let (code, text) = self.raw(method, path, None, headers, body);
        (code, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }
}

#[test]
fn events_are_accepted_validated_and_scoped_to_their_namespace() {
    for (name, s) in servers("events_are_accepted_validated_and_scoped_to_their_namespace", None) {
        let (code, started) = s.post(
            "/v1/namespaces/a/instances",
            r#"{"machine":"ticket","key":"T-1","context":{"n":1}}"#,
        );
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();

        let (code, sent) = s.post(
            "/v1/namespaces/a/events",
            r#"{"machine":"ticket","key":"T-1","event":"START","payload":{"by":"ops"}}"#,
        );
        assert_eq!(code, 202, "{name}: {sent}");
        assert_eq!(sent["instance"], id);
        let (code, again) = s.post(
            "/v1/namespaces/a/events",
            &format!(r#"{{"instance":{id},"event":"PING","dedup_key":"p"}}"#),
        );
        assert_eq!((code, again["duplicate"].as_bool()), (202, Some(false)), "{name}: {again}");
        let (code, dup) = s.post(
            "/v1/namespaces/a/events",
            &format!(r#"{{"instance":{id},"event":"PING","dedup_key":"p"}}"#),
        );
        assert_eq!((code, dup["duplicate"].as_bool()), (202, Some(true)), "{name}: {dup}");
        // A key of the engine's own is refused, naming the body's field.
        let (code, refused) = s.post(
            "/v1/namespaces/a/events",
            &format!(r#"{{"instance":{id},"event":"PING","dedup_key":"timer:1:1"}}"#),
        );
        assert_eq!(
            (code, refused["field"].as_str()),
            (400, Some("dedup_key")),
            "{name}: {refused}"
        );

        let (code, detail) = s.get_json(&format!("/v1/namespaces/a/instances/{id}"));
        assert_eq!(code, 200, "{name}: {detail}");
        let inbox: Vec<&str> = detail["inbox"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(inbox, ["START", "PING"], "{name}");
        assert_eq!(detail["inbox"][0]["payload"], json!({ "by": "ops" }));
        let (code, by_key) = s.get_json("/v1/namespaces/a/machines/ticket/keys/T-1");
        assert_eq!((code, &by_key["instance"]["id"]), (200, &json!(id)), "{name}");

        // Namespace `b` sees nothing of `a`: every read and write is a 404.
        let before = s.get_json(&format!("/v1/namespaces/a/instances/{id}")).1;
        let other: [(&str, String); 4] = [
            ("GET", format!("/v1/namespaces/b/instances/{id}")),
            ("GET", "/v1/namespaces/b/machines/ticket/keys/T-1".into()),
            ("POST", "/v1/namespaces/b/events".into()),
            ("POST", format!("/v1/namespaces/b/instances/{id}/cancel")),
        ];
        for (method, path) in other {
            let code = if method == "GET" {
                s.get(&path).0
            } else {
                let body = format!(r#"{{"instance":{id},"event":"STOP"}}"#);
                let body = if path.ends_with("cancel") { String::new() } else { body };
                s.post(&path, &body).0
            };
            assert_eq!(code, 404, "{name}: {method} {path}");
        }
        let (code, by_key) =
            s.post("/v1/namespaces/b/events", r#"{"machine":"ticket","key":"T-1","event":"X"}"#);
        assert_eq!(code, 404, "{name}: {by_key}");
        assert_eq!(s.get_json(&format!("/v1/namespaces/a/instances/{id}")).1, before, "{name}");

        let (code, cancelled) = s.post(&format!("/v1/namespaces/a/instances/{id}/cancel"), "");
        assert_eq!((code, &cancelled["cancelled"]), (200, &json!([id])), "{name}");
        let (code, ended) =
            s.post("/v1/namespaces/a/events", &format!(r#"{{"instance":{id},"event":"X"}}"#));
        assert_eq!(code, 409, "{name}: {ended}");
        assert!(ended["error"].as_str().unwrap().contains("has ended"), "{ended}");
    }
}

#[test]
fn bad_input_gets_400_naming_the_field_and_stores_nothing() {
    for (name, s) in servers("bad_input_gets_400_naming_the_field_and_stores_nothing", None) {
        let (_, started) =
            s.post("/v1/namespaces/a/instances", r#"{"machine":"ticket","key":"K"}"#);
        let id = started["id"].as_i64().unwrap();
        let before = s.get_json(&format!("/v1/namespaces/a/instances/{id}")).1;

        let events = "/v1/namespaces/a/events";
        let instances = "/v1/namespaces/a/instances";
        let cancel = format!("/v1/namespaces/a/instances/{id}/cancel");
        let cases: Vec<(&str, String, u16, &str)> = vec![
            (events, "{not json".into(), 400, "body"),
            (
                events,
                r#"{"instance":"1; DROP TABLE instances","event":"X"}"#.into(),
                400,
                "instance",
            ),
            (events, format!(r#"{{"instance":{id}}}"#), 400, "event"),
            (events, format!(r#"{{"instance":{id},"event":7}}"#), 400, "event"),
            (events, format!(r#"{{"instance":{id},"event":""}}"#), 400, "event"),
            (events, format!(r#"{{"instance":{id},"event":"X","colour":1}}"#), 400, "colour"),
            (events, r#"{"event":"X"}"#.into(), 400, "instance"),
            (events, r#"{"instance":-3,"event":"X"}"#.into(), 400, "instance"),
            (events, r#"{"instance":999999,"event":"X"}"#.into(), 404, ""),
            (events, r#"{"machine":"nobody","key":"K","event":"X"}"#.into(), 404, ""),
            (instances, r#"{"machine":"ticket","context":[1]}"#.into(), 400, "context"),
            (instances, r#"{"machine":"ticket","version":"one"}"#.into(), 400, "version"),
            (instances, r#"{"key":"K2"}"#.into(), 400, "machine"),
            (instances, r#"{"machine":""}"#.into(), 400, "machine"),
            (&cancel, r#"{"cascade":"yes"}"#.into(), 400, "cascade"),
        ];
        for (path, body, code, field) in &cases {
            let (got, answer) = s.post(path, body);
            assert_eq!(got, *code, "{name}: POST {path} {body}: {answer}");
            if *code == 400 {
                assert!(
                    answer["field"].as_str().unwrap_or_default().contains(field),
                    "{name}: {body}: {answer}"
                );
                assert!(!answer["error"].as_str().unwrap().is_empty());
            }
        }
        for path in ["/v1/namespaces/a/instances/1%3B%20DROP", "/v1/namespaces/a/instances/0"] {
            let (code, answer) = s.get_json(path);
            assert_eq!(
                (code, answer["field"].as_str()),
                (400, Some("id")),
                "{name}: {path}: {answer}"
            );
        }
        // A parameter a route does not take is named, not ignored.
        let (code, answer) = s.get_json("/v1/namespaces/a/status?machine=ticket");
        assert_eq!((code, answer["field"].as_str()), (400, Some("machine")), "{name}: {answer}");
        let (code, answer) = s.get_json(&format!("/v1/namespaces/a/instances/{id}?x=1"));
        assert_eq!((code, answer["field"].as_str()), (400, Some("x")), "{name}: {answer}");
        // A known path with another method: 405 in the API's JSON shape.
        let (code, answer) = s.get_json(events);
        assert_eq!(code, 405, "{name}: {answer}");
        assert!(answer["error"].as_str().unwrap().starts_with("GET is not allowed"), "{answer}");
        let huge =
            format!(r#"{{"instance":{id},"event":"X","payload":"{}"}}"#, "x".repeat(10 << 20));
        let answer = s.post_expecting_continue(events, &huge);
        assert!(answer.starts_with("HTTP/1.1 413"), "{name}: {answer}");
        assert!(answer.contains(r#""field":"body""#), "{name}: {answer}");
        assert_eq!(s.get_json(&format!("/v1/namespaces/a/instances/{id}")).1, before, "{name}");
    }
}

/// A 400 names the request's own field or path parameter, in the API's JSON shape: never
/// a store-internal path (`instances[0].business_key`), never a plain-text rejection, and
/// a namespace no store can hold is the client's mistake, not a 503.
#[test]
fn a_400_names_the_requests_own_field_or_parameter() {
    for (name, s) in servers("a_400_names_the_requests_own_field_or_parameter", None) {
        let (code, started) =
            s.post("/v1/namespaces/a/instances", r#"{"machine":"ticket","key":"K"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();
        let events = "/v1/namespaces/a/events";
        let instances = "/v1/namespaces/a/instances";
        let poll = "/v1/worker/tasks/poll";
        let cases: Vec<(&str, String, &str)> = vec![
            (instances, r#"{"machine":"ticket","key":""}"#.into(), "key"),
            (instances, r#"{"machine":"ticket","at":""}"#.into(), "at"),
            (instances, r#"{"machine":"ticket","queue":""}"#.into(), "queue"),
            (instances, r#"{"machine":"ticket","version":0}"#.into(), "version"),
            (instances, r#"{"machine":"ticket","version":-3}"#.into(), "version"),
            (events, format!(r#"{{"instance":{id},"event":""}}"#), "event"),
            (events, r#"{"machine":"ticket","key":"","event":"X"}"#.into(), "key"),
            (events, r#"{"machine":"","key":"K","event":"X"}"#.into(), "machine"),
            (
                poll,
                r#"{"worker":"w","namespace":"a","machines":[{"name":"ticket","version":0}]}"#
                    .into(),
                "machines[0].version",
            ),
        ];
        for (path, body, field) in &cases {
            let (code, answer) = s.post(path, body);
            assert_eq!(
                (code, answer["field"].as_str()),
                (400, Some(*field)),
                "{name}: POST {path} {body}: {answer}"
            );
            let error = answer["error"].as_str().unwrap_or_default();
            assert!(error.starts_with(&format!("{field}:")), "{name}: {body}: {answer}");
        }
        let (_, list) = s.get_json("/v1/namespaces/a/machines/ticket/instances");
        assert_eq!(list["instances"].as_array().map(Vec::len), Some(1), "{name}: {list}");

        let long = "n".repeat(257);
        for path in [
            format!("/v1/namespaces/{long}/status"),
            format!("/v1/namespaces/{long}/activity"),
            "/v1/namespaces/a%00b/status".to_owned(),
            "/v1/namespaces/a%00b/activity".to_owned(),
            "/v1/namespaces/%FF/status".to_owned(),
            "/v1/namespaces/%FF/instances".to_owned(),
        ] {
            let (code, answer) = if path.ends_with("/instances") {
                s.post(&path, r#"{"machine":"ticket"}"#)
            } else {
                s.get_json(&path)
            };
            assert_eq!(
                (code, answer["field"].as_str()),
                (400, Some("namespace")),
                "{name}: {path}: {answer}"
            );
        }
        let (code, answer) = s.get_json("/v1/namespaces/a/instances/%FF");
        assert_eq!((code, answer["field"].as_str()), (400, Some("id")), "{name}: {answer}");

        // A cancel says whether its cascade reached every live descendant.
        let (code, answer) =
            s.post(&format!("/v1/namespaces/a/instances/{id}/cancel"), r#"{"cascade":true}"#);
        assert_eq!(code, 200, "{name}: {answer}");
        assert_eq!(answer["cancelled"], json!([id]), "{name}: {answer}");
        assert_eq!(answer["complete"], json!(true), "{name}: {answer}");
    }
}

/// A heartbeat without `lease_ms` extends by the lease the worker's poll asked for, never
/// by the 30 s default below it: the task is not reaped under a worker still running it.
#[test]
fn a_heartbeat_without_lease_ms_never_shortens_the_polled_lease() {
    for (name, s) in servers("a_heartbeat_without_lease_ms_never_shortens_the_polled_lease", None) {
        let ns = "/v1/namespaces/default/instances";
        let (code, a) = s.post(ns, r#"{"machine":"long","at":"run"}"#);
        assert_eq!(code, 201, "{name}: {a}");
        let id = a["id"].as_i64().unwrap();
        let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("long", 600_000));
        assert_eq!((code, task["id"].as_i64()), (200, Some(id)), "{name}: {task}");
        let granted = task["lease_expires_at"].as_i64().unwrap();
        let token = task["token"].as_i64().unwrap();
        let (code, beat) = s.post(
            &format!("/v1/worker/tasks/{id}/heartbeat"),
            &format!(r#"{{"worker":"w","token":{token}}}"#),
        );
        assert_eq!(code, 200, "{name}: {beat}");
        assert!(beat["lease_ms"].as_u64().unwrap_or(0) >= 600_000, "{name}: {beat}");
        let (_, row) = s.get_json(&format!("{ns}/{id}"));
        let expires = row["instance"]["lease_expires_at"].as_i64().unwrap();
        assert!(expires >= granted, "{name}: the lease shrank from {granted} to {expires}");
        // One that names `lease_ms` gets what it asked for.
        let (code, beat) = s.post(
            &format!("/v1/worker/tasks/{id}/heartbeat"),
            &format!(r#"{{"worker":"w","token":{token},"lease_ms":1000}}"#),
        );
        assert_eq!((code, beat["lease_ms"].as_u64()), (200, Some(1000)), "{name}: {beat}");
    }
}

#[test]
fn metrics_are_prometheus_text_and_health_follows_the_thresholds() {
    let config = "[queue.alerts]\npending_warning = 1\npending_critical = 2\n";
    for (name, s) in
        servers("metrics_are_prometheus_text_and_health_follows_the_thresholds", Some(config))
    {
        let (code, body) = s.get_json("/health");
        assert_eq!((code, body["status"].as_str()), (200, Some("healthy")), "{name}: {body}");
        s.post("/v1/namespaces/default/instances", r#"{"machine":"ticket"}"#);
        let (code, body) = s.get_json("/health");
        assert_eq!((code, body["status"].as_str()), (200, Some("warning")), "{name}: {body}");
        s.post("/v1/namespaces/default/instances", r#"{"machine":"ticket"}"#);
        let (code, body) = s.get_json("/health");
        assert_eq!((code, body["status"].as_str()), (503, Some("critical")), "{name}: {body}");

        let (code, text) = s.get("/metrics");
        assert_eq!(code, 200, "{name}");
        let samples = parse_prometheus(&text);
        let pending = samples
            .iter()
            .find(|(metric, labels, _)| {
                metric == "keel_queue_pending" && labels.contains("machine=\"ticket\"")
            })
            .unwrap_or_else(|| panic!("{name}: no keel_queue_pending in\n{text}"));
        assert_eq!(pending.2, 2.0, "{name}");
        // Once the store holds nothing for the group, its gauge reads 0, not its last count.
        let (_, listed) = s.get_json("/v1/namespaces/default/machines/ticket/instances");
        for row in listed["instances"].as_array().unwrap() {
            let id = row["id"].as_i64().unwrap();
            let (code, answer) =
                s.post(&format!("/v1/namespaces/default/instances/{id}/cancel"), "");
            assert_eq!(code, 200, "{name}: {answer}");
        }
        let (_, text) = s.get("/metrics");
        let drained = parse_prometheus(&text)
            .into_iter()
            .find(|(metric, labels, _)| {
                metric == "keel_queue_pending" && labels.contains("machine=\"ticket\"")
            })
            .map(|sample| sample.2);
        assert_eq!(drained, Some(0.0), "{name}: {text}");
        for documented in [
            "keel_queue_processing",
            "keel_queue_scheduled",
            "keel_queue_dlq_size",
            "keel_queue_oldest_ready_seconds",
        ] {
            assert!(
                samples.iter().any(|(m, _, _)| m == documented),
                "{name}: {documented} missing\n{text}"
            );
        }
        let (code, info) = s.get_json("/v1/cluster/info");
        assert_eq!(
            (code, info["version"].as_str()),
            (200, Some(env!("CARGO_PKG_VERSION"))),
            "{name}"
        );
        assert_eq!(s.get("/no/such/thing").0, 404);
    }
}

/// Every sample line of Prometheus text format: name, label text, value. Panics on a line
/// that is neither a comment, blank, nor a well-formed sample.
fn parse_prometheus(text: &str) -> Vec<(String, String, f64)> {
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let (metric, labels) = match series.split_once('{') {
            Some((m, rest)) => {
                (m, rest.strip_suffix('}').unwrap_or_else(|| panic!("bad labels {line:?}")))
            }
            None => (series, ""),
        };
        assert!(
            metric.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        samples.push((metric.to_owned(), labels.to_owned(), value));
    }
    samples
}

struct Greeter;

#[keel::async_trait]
impl StepMachine for Greeter {
    fn machine(&self) -> MachineRef {
        MachineRef::new("greeter", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!({ "hello": "world" }), step: None })
    }
}

/// An embedded worker exposes its counts with one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_worker_serves_its_metrics_with_one_call() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    keel::prometheus::serve(addr).expect("the exporter installs");
    let keel = keel::Keel::connect("sqlite::memory:").await.unwrap();
    let config =
        WorkerConfig { poll_interval: Duration::from_millis(20), ..WorkerConfig::default() };
    let worker = keel.worker_with(config).register(Greeter).unwrap().spawn().unwrap();
    let id = keel
        .start(keel::NewInstance::new(MachineRef::new("greeter", 1), "greet"))
        .await
        .unwrap()
        .id();
    keel.wait(id).await.unwrap();
    worker.shutdown().await;
    let text = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).build().into();
        agent
            .get(&format!("http://{addr}/metrics"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    })
    .await
    .unwrap();
    let samples = parse_prometheus(&text);
    let completed = samples
        .iter()
        .find(|(m, l, _)| m == "keel_queue_completed_total" && l.contains("greeter"))
        .unwrap_or_else(|| panic!("no completed counter in\n{text}"));
    assert!(completed.2 >= 1.0, "{text}");
}

/// Starts the Python example worker against `base` with extra arguments.
fn python_worker(base: &str, args: &[&str]) -> std::process::Child {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/http-worker/worker.py");
    std::process::Command::new("python3")
        .arg(script)
        .args(["--base", base])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the example worker")
}

/// Waits for a worker; its exit code and its JSON lines.
fn lines(child: std::process::Child) -> (i32, Vec<Value>) {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let parsed = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (out.status.code().unwrap_or(-1), parsed)
}

#[test]
fn a_python_worker_runs_steps_over_the_worker_protocol() {
    for (name, s) in servers("a_python_worker_runs_steps_over_the_worker_protocol", None) {
        let ns = "/v1/namespaces/default/instances";
        let (_, a) = s.post(ns, r#"{"machine":"greeter","at":"greet","context":{"name":"Ada"}}"#);
        let (_, b) = s.post(ns, r#"{"machine":"greeter","at":"greet","context":{"refuse":true}}"#);
        let (code, out) = lines(python_worker(&s.base, &["--tasks", "2"]));
        assert_eq!(code, 0, "{name}: {out:?}");
        assert!(out.iter().all(|l| l["status"] == 200), "{name}: {out:?}");

        let (_, done) = s.get_json(&format!("{ns}/{}", a["id"]));
        assert_eq!(done["instance"]["status"], "done", "{name}: {done}");
        assert_eq!(done["instance"]["result"]["greeting"], "hello, Ada");
        let (_, refused) = s.get_json(&format!("{ns}/{}", b["id"]));
        assert_eq!(refused["instance"]["status"], "suspended", "{name}: {refused}");
        let (code, text) = s.get("/metrics");
        assert_eq!(code, 200);
        let letters = parse_prometheus(&text)
            .into_iter()
            .find(|(m, l, _)| m == "keel_dead_letters" && l.contains("greeter"))
            .unwrap_or_else(|| panic!("{name}: no dead letter gauge in\n{text}"));
        assert_eq!(letters.2, 1.0, "{name}");
        // The remote steps count in the step metrics as an in-process worker's do: two
        // committed, one of them a failure.
        let counted = |metric: &str| {
            parse_prometheus(&text)
                .into_iter()
                .find(|(m, l, _)| m == metric && l.contains("machine=\"greeter\""))
                .map(|sample| sample.2)
        };
        assert_eq!(counted("keel_queue_completed_total"), Some(2.0), "{name}: {text}");
        assert_eq!(counted("keel_queue_failed_total"), Some(1.0), "{name}: {text}");
        assert_eq!(counted("keel_queue_wait_time_seconds_count"), Some(2.0), "{name}: {text}");

        // Nothing to do: a poll waits, then answers 204.
        let poll = r#"{"worker":"rust","namespace":"default","machines":[{"name":"greeter","version":1}],"wait_ms":200}"#;
        let (code, _) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!(code, 204, "{name}");
        for (body, field) in [
            (r#"{"worker":"w","namespace":"default","machines":[]}"#, "machines"),
            (
                r#"{"worker":"w","namespace":"default","machines":[{"name":"greeter","version":1}],"wait_ms":999999}"#,
                "wait_ms",
            ),
            (
                r#"{"worker":"w","namespace":"default","machines":[{"name":"greeter","version":1}],"lease_ms":1}"#,
                "lease_ms",
            ),
            (
                r#"{"worker":"w","namespace":"default","machines":[{"name":"greeter","version":"1"}]}"#,
                "machines[0].version",
            ),
            (
                r#"{"worker":"","namespace":"default","machines":[{"name":"greeter","version":1}]}"#,
                "worker",
            ),
            (
                r#"{"worker":"w","namespace":"","machines":[{"name":"greeter","version":1}]}"#,
                "namespace",
            ),
            (
                r#"{"worker":"w","namespace":"default","machines":[{"name":"","version":1}]}"#,
                "machines[0].name",
            ),
        ] {
            let (code, answer) = s.post("/v1/worker/tasks/poll", body);
            assert_eq!(
                (code, answer["field"].as_str()),
                (400, Some(field)),
                "{name}: {body}: {answer}"
            );
        }
        let (code, answer) = s.post(
            "/v1/worker/tasks/x1/complete",
            r#"{"worker":"w","token":1,"outcome":{"type":"done","result":{}}}"#,
        );
        assert_eq!((code, answer["field"].as_str()), (400, Some("id")), "{name}");
    }
}

#[test]
fn a_lease_that_expires_mid_task_hands_the_task_over_and_the_stale_token_gets_409() {
    for (name, s) in servers(
        "a_lease_that_expires_mid_task_hands_the_task_over_and_the_stale_token_gets_409",
        None,
    ) {
        let ns = "/v1/namespaces/default/instances";
        let (_, a) = s.post(ns, r#"{"machine":"greeter","at":"greet","context":{"name":"slow"}}"#);
        let id = a["id"].as_i64().unwrap();
        // The Python worker takes the task with a short lease and no heartbeat, then
        // sleeps past it.
        let slow = python_worker(
            &s.base,
            &["--tasks", "1", "--lease-ms", "300", "--pause-ms", "2500", "--worker", "slow"],
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let first_token = loop {
            let (_, row) = s.get_json(&format!("{ns}/{id}"));
            if row["instance"]["status"] == "executing" {
                break row["instance"]["fencing_token"].as_i64().unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "{name}: the worker never claimed");
            std::thread::sleep(Duration::from_millis(20));
        };
        // Another worker polls: the expired lease is reaped and the task is claimed anew.
        let poll = r#"{"worker":"fast","namespace":"default","machines":[{"name":"greeter","version":1}],"wait_ms":5000}"#;
        let (code, task) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!((code, task["id"].as_i64()), (200, Some(id)), "{name}: {task}");
        let token = task["token"].as_i64().unwrap();
        assert!(token > first_token, "{name}");
        let (code, _) = s.post(
            &format!("/v1/worker/tasks/{id}/heartbeat"),
            &format!(r#"{{"worker":"slow","token":{first_token}}}"#),
        );
        assert_eq!(code, 409, "{name}: a stale heartbeat");
        let (code, _) = s.post(
            &format!("/v1/worker/tasks/{id}/heartbeat"),
            &format!(r#"{{"worker":"fast","token":{token}}}"#),
        );
        assert_eq!(code, 200, "{name}");
        let (code, answer) = s.post(
            &format!("/v1/worker/tasks/{id}/complete"),
            &format!(r#"{{"worker":"fast","token":{token},"outcome":{{"type":"done","result":{{"by":"rust"}}}}}}"#),
        );
        assert_eq!((code, answer["status"].as_str()), (200, Some("done")), "{name}: {answer}");

        // The slow worker wakes up, completes with its old token, and is refused.
        let (code, out) = lines(slow);
        assert_eq!(code, 0, "{name}");
        assert_eq!(out[0]["status"], 409, "{name}: {out:?}");
        let (_, row) = s.get_json(&format!("{ns}/{id}"));
        assert_eq!(
            row["instance"]["result"],
            json!({ "by": "rust" }),
            "{name}: the stale result was dropped"
        );
        let (code, _) = s.post(
            &format!("/v1/worker/tasks/{id}/fail"),
            &format!(r#"{{"worker":"fast","token":{token},"error":"late"}}"#),
        );
        assert_eq!(code, 409, "{name}: a committed task cannot fail afterwards");
    }
}

const TOKENS: &str = r#"
[[tokens]]
token = "token-for-namespace-a"
namespaces = ["a"]
access = "operate"

[[tokens]]
token = "token-for-namespace-b"
namespaces = ["b"]
access = "operate"

[[tokens]]
token = "read-only-token-for-a"
namespaces = ["a"]
access = "read"

[[tokens]]
token = "operator-of-everything"
namespaces = ["*"]
access = "read"

[[tokens]]
token = "token-for-team-a-spaced"
namespaces = ["team a", "a%62"]
access = "operate"
"#;

/// A token's namespaces bound what its remote steps start, and they are matched against
/// the path's namespace as decoded, which is the namespace the handlers act on.
#[test]
fn a_token_starts_children_only_in_its_namespaces_and_paths_match_decoded() {
    let (a, all, spaced) =
        ("token-for-namespace-a", "operator-of-everything", "token-for-team-a-spaced");
    for (name, s) in
        servers_with("a_token_starts_children_only_in_its_namespaces", None, Some(TOKENS))
    {
        let (code, started) =
            s.post_as(a, "/v1/namespaces/a/instances", r#"{"machine":"greeter","at":"greet"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();
        let poll = r#"{"worker":"w","namespace":"a","machines":[{"name":"greeter","version":1}]}"#;
        let (code, task) = s.post_as(a, "/v1/worker/tasks/poll", poll);
        assert_eq!(code, 200, "{name}: {task}");
        let token = task["token"].as_i64().unwrap();
        let child = |ns: &str| {
            format!(
                r#"{{"namespace":"{ns}","machine":{{"name":"greeter","version":1}},"position":"greet","context":{{}},"business_key":null,"queue":"default","priority":"normal","concurrency_key":null,"unique":null,"eligible_at":null,"correlation_id":null,"invoked_by":null}}"#
            )
        };
        let complete = |children: String| {
            s.post_as(
                a,
                &format!("/v1/worker/tasks/{id}/complete"),
                &format!(
                    r#"{{"worker":"w","token":{token},"outcome":{{"type":"schedule_children","next":"after","context":{{}},"children":[{children}]}}}}"#
                ),
            )
        };
        // A child in namespace b, which token a does not see: 403 naming the child, and
        // nothing started anywhere.
        let (code, answer) = complete(format!("{},{}", child("a"), child("b")));
        assert_eq!(
            (code, answer["field"].as_str()),
            (403, Some("outcome.children[1].namespace")),
            "{name}: {answer}"
        );
        let (_, listed) = s.get_as(all, "/v1/namespaces/b/machines/greeter/instances");
        let listed: Value = serde_json::from_str(&listed).unwrap();
        assert_eq!(listed["instances"], json!([]), "{name}: {listed}");
        let (_, row) = s.get_as(a, &format!("/v1/namespaces/a/instances/{id}"));
        let row: Value = serde_json::from_str(&row).unwrap();
        assert_eq!(row["instance"]["status"], "executing", "{name}: {row}");
        // Children in the token's own namespace start.
        let (code, answer) = complete(child("a"));
        assert_eq!(code, 200, "{name}: {answer}");

        // `team%20a` is the namespace `team a`, which the spaced token lists; `a%62` in a
        // path is the namespace `ab`, which no token but "*" lists.
        let start = r#"{"machine":"greeter","at":"greet"}"#;
        let (code, started) = s.post_as(spaced, "/v1/namespaces/team%20a/instances", start);
        assert_eq!(code, 201, "{name}: {started}");
        let (code, status) = s.get_as(spaced, "/v1/namespaces/team%20a/status");
        assert_eq!(code, 200, "{name}: {status}");
        assert_eq!(s.get_as(spaced, "/v1/namespaces/a%62/status").0, 404, "{name}");
        let (code, bad) = s.get_as(spaced, "/v1/namespaces/%FF/status");
        let bad: Value = serde_json::from_str(&bad).unwrap();
        assert_eq!((code, bad["field"].as_str()), (400, Some("namespace")), "{name}: {bad}");
    }
}

/// A task carries the step's timeout by the file, which only the remote worker can
/// enforce: the machine's where it sets one, else the default.
#[test]
fn a_task_carries_the_steps_timeout_by_the_file() {
    let config = "[machines.slow.queue]\ntimeout = \"5 seconds\"\n";
    for (name, s) in servers("a_task_carries_the_steps_timeout_by_the_file", Some(config)) {
        let ns = "/v1/namespaces/default/instances";
        for (machine, expected) in [("slow", 5_000), ("quick", 30_000)] {
            let (code, started) = s.post(ns, &format!(r#"{{"machine":"{machine}","at":"run"}}"#));
            assert_eq!(code, 201, "{name}: {started}");
            let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for(machine, 30_000));
            assert_eq!(code, 200, "{name}: {task}");
            assert_eq!(task["timeout_ms"], json!(expected), "{name}: {machine}: {task}");
        }
    }
}

/// With only HTTP workers, the server worker fires timers: a fan-out's join
/// deadline wakes the parent, whose children nobody runs, and it is handed out again at
/// its next step.
#[test]
fn the_server_worker_fires_a_join_deadline_with_only_http_workers() {
    for (name, s) in servers("the_server_worker_fires_a_join_deadline", None) {
        let ns = "/v1/namespaces/default/instances";
        let (code, started) = s.post(ns, r#"{"machine":"fan","at":"split"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();
        let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("fan", 30_000));
        assert_eq!((code, task["id"].as_i64()), (200, Some(id)), "{name}: {task}");
        let token = task["token"].as_i64().unwrap();
        let child = r#"{"namespace":"default","machine":{"name":"kid","version":1},"position":"run","context":{},"business_key":null,"queue":"default","priority":"normal","concurrency_key":null,"unique":null,"eligible_at":null,"correlation_id":null,"invoked_by":null}"#;
        let (code, answer) = s.post(
            &format!("/v1/worker/tasks/{id}/complete"),
            &format!(
                r#"{{"worker":"w","token":{token},"outcome":{{"type":"schedule_children","next":"gather","context":{{}},"children":[{child},{child}],"join":{{"quorum":2,"within":300}}}}}}"#
            ),
        );
        assert_eq!(
            (code, answer["status"].as_str()),
            (200, Some("awaiting_children")),
            "{name}: {answer}"
        );
        // Nobody serves `kid`; the deadline alone wakes the parent at `gather`.
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let task = loop {
            let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("fan", 30_000));
            if code == 200 {
                break task;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: the join deadline never woke the parent: {}",
                s.get_json(&format!("{ns}/{id}")).1
            );
        };
        assert_eq!(
            (task["id"].as_i64(), task["step"].as_str()),
            (Some(id), Some("gather")),
            "{name}: {task}"
        );
        let (_, row) = s.get_json(&format!("{ns}/{id}"));
        let children = row["children"].as_array().unwrap();
        assert_eq!(children.len(), 2, "{name}: {row}");
        assert!(
            children.iter().all(|c| c["status"] == "cancelled"),
            "{name}: the rest is cancelled: {row}"
        );
    }
}

/// A remote failure retries after the configured backoff with its jitter: each delay
/// within the range, and failures at the same moment spread over it.
#[test]
fn remote_retries_are_jittered_within_the_backoff() {
    let config =
        "[queue.retry]\nmax_attempts = 5\ninitial_delay = \"10 seconds\"\njitter = \"full\"\n";
    for (name, s) in servers("remote_retries_are_jittered_within_the_backoff", Some(config)) {
        let ns = "/v1/namespaces/default/instances";
        let mut delays = Vec::new();
        // One machine per round, so a poll cannot claim an earlier round's instance whose
        // jittered delay (anywhere from 0 to 10 s) has already run out.
        for round in 0..8 {
            let start = format!(r#"{{"machine":"flaky{round}","at":"call"}}"#);
            let (code, _) = s.post(ns, &start);
            assert_eq!(code, 201, "{name}");
            let poll = format!(
                r#"{{"worker":"w","namespace":"default","machines":[{{"name":"flaky{round}","version":1}}],"wait_ms":2000}}"#
            );
            let (code, task) = s.post("/v1/worker/tasks/poll", &poll);
            assert_eq!(code, 200, "{name}: {task}");
            let (id, token) = (task["id"].as_i64().unwrap(), task["token"].as_i64().unwrap());
            let fail = format!(r#"{{"worker":"w","token":{token},"error":"timeout upstream"}}"#);
            let (code, answer) = s.post(&format!("/v1/worker/tasks/{id}/fail"), &fail);
            assert_eq!(
                (code, answer["status"].as_str()),
                (200, Some("runnable")),
                "{name}: {answer}"
            );
            let (_, row) = s.get_json(&format!("{ns}/{id}"));
            let row = &row["instance"];
            assert_eq!(row["attempt"], 1, "{name}: {row}");
            let delay = row["eligible_at"].as_i64().unwrap() - row["updated_at"].as_i64().unwrap();
            assert!((0..=10_000).contains(&delay), "{name}: a delay of {delay} ms");
            delays.push(delay);
        }
        delays.sort_unstable();
        delays.dedup();
        assert!(delays.len() > 1, "{name}: eight remote retries all after {delays:?} ms");
    }
}

#[test]
fn a_token_never_sees_or_changes_another_namespace() {
    let (a, b, ra, all) = (
        "token-for-namespace-a",
        "token-for-namespace-b",
        "read-only-token-for-a",
        "operator-of-everything",
    );
    for (name, s) in
        servers_with("a_token_never_sees_or_changes_another_namespace", None, Some(TOKENS))
    {
        let start = r#"{"machine":"greeter","at":"greet","key":"K"}"#;
        assert_eq!(s.post("/v1/namespaces/a/instances", start).0, 401, "{name}: no token");
        assert_eq!(
            s.post_as("wrong-token-wrong-token", "/v1/namespaces/a/instances", start).0,
            401
        );
        let (code, started) = s.post_as(a, "/v1/namespaces/a/instances", start);
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();
        let before = s.get_as(a, &format!("/v1/namespaces/a/instances/{id}"));
        assert_eq!(before.0, 200, "{name}");

        // Token b: every read and write on a's instance, by either namespace path, is 404.
        let event = format!(r#"{{"instance":{id},"event":"X"}}"#);
        let by_key = r#"{"machine":"greeter","key":"K","event":"X"}"#;
        assert_eq!(s.get_as(b, &format!("/v1/namespaces/a/instances/{id}")).0, 404, "{name}");
        assert_eq!(s.get_as(b, &format!("/v1/namespaces/b/instances/{id}")).0, 404, "{name}");
        assert_eq!(s.get_as(b, "/v1/namespaces/a/machines/greeter/keys/K").0, 404, "{name}");
        assert_eq!(s.post_as(b, "/v1/namespaces/a/events", &event).0, 404, "{name}");
        assert_eq!(s.post_as(b, "/v1/namespaces/b/events", &event).0, 404, "{name}");
        assert_eq!(s.post_as(b, "/v1/namespaces/b/events", by_key).0, 404, "{name}");
        assert_eq!(s.post_as(b, &format!("/v1/namespaces/a/instances/{id}/cancel"), "").0, 404);
        assert_eq!(s.post_as(b, &format!("/v1/namespaces/b/instances/{id}/cancel"), "").0, 404);
        let poll_a =
            r#"{"worker":"w","namespace":"a","machines":[{"name":"greeter","version":1}]}"#;
        assert_eq!(s.post_as(b, "/v1/worker/tasks/poll", poll_a).0, 404, "{name}");
        for call in ["heartbeat", "complete", "fail"] {
            let body = r#"{"worker":"w","token":1,"lease_ms":1000,"error":"x","outcome":{"type":"done","result":{}}}"#;
            assert_eq!(
                s.post_as(b, &format!("/v1/worker/tasks/{id}/{call}"), body).0,
                404,
                "{name}: {call}"
            );
        }
        // Operator endpoints span every namespace: only a "*" token.
        for path in ["/metrics", "/health", "/v1/cluster/info", "/v1/workers"] {
            assert_eq!(s.get_as(a, path).0, 404, "{name}: {path}");
            assert_eq!(s.get_as(all, path).0, 200, "{name}: {path}");
        }
        // A read-only token reads its namespace and writes nothing.
        assert_eq!(s.get_as(ra, &format!("/v1/namespaces/a/instances/{id}")).0, 200);
        let (code, answer) = s.post_as(ra, "/v1/namespaces/a/events", &event);
        assert_eq!((code, answer["field"].as_str()), (403, Some("authorization")), "{name}");
        assert_eq!(
            s.get_as(a, &format!("/v1/namespaces/a/instances/{id}")),
            before,
            "{name}: nothing changed"
        );

        assert_eq!(s.post_as(a, "/v1/namespaces/a/events", &event).0, 202, "{name}");
        let (code, task) = s.post_as(a, "/v1/worker/tasks/poll", poll_a);
        assert_eq!(code, 200, "{name}");
        let fail =
            format!(r#"{{"worker":"w","token":{},"error":"no","retryable":false}}"#, task["token"]);
        assert_eq!(s.post_as(a, &format!("/v1/worker/tasks/{id}/fail"), &fail).0, 200, "{name}");

        // Dead letters and queues of `a` are invisible to token b, by either path.
        let (code, list) = s.get_as(a, "/v1/namespaces/a/dead-letters");
        assert_eq!(code, 200, "{name}");
        let list: Value = serde_json::from_str(&list).unwrap();
        let dl = list["dead_letters"][0]["id"].as_i64().unwrap_or_else(|| panic!("{name}: {list}"));
        // Pages by cursor: the one letter fills a page of one, and the page after it is empty.
        let (code, page) = s.get_as(a, "/v1/namespaces/a/dead-letters?limit=1");
        let page: Value = serde_json::from_str(&page).unwrap();
        assert_eq!((code, page["next"].as_i64()), (200, Some(dl)), "{name}: {page}");
        let (code, rest) =
            s.get_as(a, &format!("/v1/namespaces/a/dead-letters?limit=1&after={dl}"));
        let rest: Value = serde_json::from_str(&rest).unwrap();
        assert_eq!((code, rest["dead_letters"].clone()), (200, json!([])), "{name}: {rest}");
        for query in ["limit=20000", "limit=1001", "limit=0", "limit=-1"] {
            let (code, bad) = s.get_as(a, &format!("/v1/namespaces/a/dead-letters?{query}"));
            let bad: Value = serde_json::from_str(&bad).unwrap();
            assert_eq!((code, bad["field"].as_str()), (400, Some("limit")), "{name}: {bad}");
        }
        let (_, theirs) = s.get_as(b, "/v1/namespaces/b/dead-letters");
        assert_eq!(
            serde_json::from_str::<Value>(&theirs).unwrap()["dead_letters"],
            json!([]),
            "{name}"
        );
        for path in [
            "/v1/namespaces/a/dead-letters".to_owned(),
            format!("/v1/namespaces/a/dead-letters/{dl}"),
            format!("/v1/namespaces/b/dead-letters/{dl}"),
            "/v1/namespaces/a/status".to_owned(),
            "/v1/namespaces/a/activity".to_owned(),
            "/v1/namespaces/a/machines/greeter/instances".to_owned(),
        ] {
            assert_eq!(s.get_as(b, &path).0, 404, "{name}: GET {path}");
        }
        for path in [
            format!("/v1/namespaces/a/dead-letters/{dl}/retry"),
            format!("/v1/namespaces/b/dead-letters/{dl}/retry"),
            "/v1/namespaces/a/queues/default/pause".to_owned(),
            "/v1/namespaces/a/queues/default/resume".to_owned(),
        ] {
            assert_eq!(s.post_as(b, &path, "").0, 404, "{name}: POST {path}");
        }
        let (_, status) = s.get_as(a, "/v1/namespaces/a/status");
        let status: Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["queues"][0]["paused"], false, "{name}: token b paused nothing");
        assert_eq!(status["queues"][0]["suspended"], 1, "{name}: {status}");
        assert_eq!(s.get_as(a, &format!("/v1/namespaces/a/dead-letters/{dl}")).0, 200);
        assert_eq!(s.get_as(a, "/v1/namespaces/a/dead-letters/dl'--").0, 400, "{name}");

        // Token a operates its own namespace.
        let (code, paused) = s.post_as(a, "/v1/namespaces/a/queues/default/pause", "");
        assert_eq!((code, &paused["paused"]), (200, &json!(true)), "{name}");
        let (code, retried) =
            s.post_as(a, &format!("/v1/namespaces/a/dead-letters/{dl}/retry"), "");
        assert_eq!((code, &retried["retried"]), (200, &json!([id])), "{name}");
        assert_eq!(s.post_as(a, "/v1/namespaces/a/queues/default/resume", "").0, 200);
    }
}

#[test]
fn serve_refuses_a_public_address_without_tokens_and_bad_tokens_files() {
    let bin = assert_cmd::cargo::cargo_bin("keel");
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("keel.db").display());
    let out = std::process::Command::new(&bin)
        .args(["--database-url", &url, "serve", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a loopback address"));
    let short = dir.path().join("short.toml");
    std::fs::write(
        &short,
        "[[tokens]]\ntoken = \"abc\"\nnamespaces = [\"a\"]\naccess = \"operate\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(&bin)
        .args(["--database-url", &url, "serve", "--listen", "127.0.0.1:0", "--tokens"])
        .arg(&short)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokens[0].token is shorter"), "{out:?}");
    let charts = dir.path().join("charts.json");
    std::fs::write(&charts, r#"[{"name": "door", "version": 1, "states": "none"}]"#).unwrap();
    let out = std::process::Command::new(&bin)
        .args(["--database-url", &url, "serve", "--listen", "127.0.0.1:0", "--definitions"])
        .arg(&charts)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--definitions") && err.contains("chart [0]"), "{err}");

    // The configuration is the one a worker would run with: checked across its levels and
    // with the environment's overrides, before anything listens.
    let config = dir.path().join("keel.toml");
    std::fs::write(
        &config,
        "[queue.alerts]\npending_critical = 10\n[machines.order.queue.alerts]\npending_warning = 100\n",
    )
    .unwrap();
    let serve = |env: Option<(&str, &str)>| {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["--database-url", &url, "serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config);
        if let Some((var, value)) = env {
            cmd.env(var, value);
        }
        cmd.output().unwrap()
    };
    let out = serve(None);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("machines.order.queue.alerts.pending_warning: must not exceed"), "{err}");
    std::fs::write(&config, "").unwrap();
    let out = serve(Some(("KEEL_QUEUE_RETRY_MAX_ATTEMPTS", "many")));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("KEEL_QUEUE_RETRY_MAX_ATTEMPTS"), "{err}");
}

const DOORS: &str = r#"[
  { "name": "door", "version": 1, "initial": "closed", "states": [
    { "key": "closed", "on": [ { "event": "OPEN", "target": "open" } ] },
    { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] },
  { "name": "door", "version": 2, "initial": "closed", "states": [
    { "key": "closed", "on": [ { "event": "OPEN", "target": "open" } ] },
    { "key": "open", "on": [ { "event": "CLOSE", "target": "closed" } ] } ] } ]"#;

#[test]
fn with_definitions_unknown_machines_versions_and_events_get_400_naming_the_field() {
    for (name, s) in servers_full("with_definitions_unknown_get_400", None, None, Some(DOORS)) {
        let ns = "/v1/namespaces/default";
        let (code, started) =
            s.post(&format!("{ns}/instances"), r#"{"machine":"door","key":"d1"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        assert_eq!(started["version"], 2, "{name}: without a version, the file's newest");
        let id = started["id"].as_i64().unwrap();
        let cases = [
            (format!(r#"{{"instance":{id},"event":"KNOCK"}}"#), "event", "has no event \"KNOCK\""),
            (r#"{"machine":"gate","key":"d1","event":"OPEN"}"#.to_owned(), "machine", "gate"),
        ];
        for (body, field, needle) in &cases {
            let (code, err) = s.post(&format!("{ns}/events"), body);
            assert_eq!((code, err["field"].as_str()), (400, Some(*field)), "{name}: {body}: {err}");
            assert!(err["error"].as_str().unwrap().contains(needle), "{name}: {err}");
        }
        for (body, field) in
            [(r#"{"machine":"gate"}"#, "machine"), (r#"{"machine":"door","version":3}"#, "version")]
        {
            let (code, err) = s.post(&format!("{ns}/instances"), body);
            assert_eq!((code, err["field"].as_str()), (400, Some(field)), "{name}: {body}: {err}");
        }
        let (code, detail) = s.get_json(&format!("{ns}/instances/{id}"));
        assert_eq!(code, 200);
        assert_eq!(detail["inbox"], json!([]), "{name}: a refused event stored nothing: {detail}");
        let (code, ok) =
            s.post(&format!("{ns}/events"), &format!(r#"{{"instance":{id},"event":"OPEN"}}"#));
        assert_eq!(code, 202, "{name}: a known event is accepted: {ok}");
        let (code, ok) =
            s.post(&format!("{ns}/events"), r#"{"machine":"door","key":"d1","event":"CLOSE"}"#);
        assert_eq!(code, 202, "{name}: {ok}");

        // The operator views over HTTP.
        let (code, list) =
            s.get_json(&format!("{ns}/machines/door/instances?status=runnable&limit=5"));
        assert_eq!((code, list["instances"][0]["id"].as_i64()), (200, Some(id)), "{name}: {list}");
        let (code, err) = s.get_json(&format!("{ns}/machines/door/instances?limit=0"));
        assert_eq!((code, err["field"].as_str()), (400, Some("limit")), "{name}: {err}");
        let (code, err) = s.get_json(&format!("{ns}/machines/door/instances?limit=x"));
        assert_eq!((code, err["field"].as_str()), (400, Some("limit")), "{name}: {err}");
        let (code, err) = s.get_json(&format!("{ns}/machines/door/instances?sort=asc"));
        assert_eq!((code, err["field"].as_str()), (400, Some("sort")), "{name}: {err}");
        let (code, activity) = s.get_json(&format!("{ns}/activity"));
        assert_eq!((code, activity["bucket_ms"].as_u64()), (200, Some(60_000)), "{name}");
        let door = &activity["machines"][0];
        assert_eq!(
            (door["machine"].as_str(), door["ready_without_worker"].as_u64()),
            (Some("door"), Some(1))
        );
        assert_eq!(door["completed_per_minute"].as_array().unwrap().len(), 60);
        let (code, workers) = s.get_json("/v1/workers");
        assert_eq!(code, 200, "{name}: {workers}");
        assert_eq!(step_workers(&workers), Vec::<&Value>::new(), "{name}: {workers}");
    }
}

/// The listed workers but the server's own, which runs no steps (and may not have
/// recorded itself yet when a test asks).
fn step_workers(listed: &Value) -> Vec<&Value> {
    let all = listed["workers"].as_array().expect("a worker list");
    all.iter().filter(|w| !w["id"].as_str().is_some_and(|id| id.ends_with("/keel-serve"))).collect()
}

#[test]
fn a_start_without_a_version_runs_the_newest_one_a_live_worker_serves() {
    for (name, s) in servers("a_start_without_a_version", None) {
        let start = |body: &str| {
            let (code, started) = s.post("/v1/namespaces/default/instances", body);
            assert_eq!(code, 201, "{name}: {body}: {started}");
            started["version"].as_i64()
        };
        let greet = r#"{"machine":"greet","at":"run"}"#;
        assert_eq!(start(greet), Some(1), "{name}: no live worker serves greet yet");
        let poll = r#"{"worker":"py-2","namespace":"default","machines":[{"name":"greet","version":2},{"name":"greet","version":3},{"name":"other","version":9}],"wait_ms":0}"#;
        let (code, _) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!(code, 204, "{name}: the version 1 instance is not this worker's");
        // A start reuses its read of the live workers for a second.
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(start(greet), Some(3), "{name}: the newest version served");
        assert_eq!(start(r#"{"machine":"greet","at":"run","version":2}"#), Some(2), "{name}");
        let elsewhere = r#"{"machine":"greet","at":"run"}"#;
        let (code, started) = s.post("/v1/namespaces/other/instances", elsewhere);
        assert_eq!((code, started["version"].as_i64()), (201, Some(1)), "{name}: {started}");
    }
}

#[test]
fn a_polling_http_worker_is_listed_and_lease_gauges_are_exported() {
    for (name, s) in servers("a_polling_http_worker_is_listed", None) {
        let poll = r#"{"worker":"py-1","namespace":"default","machines":[{"name":"echo","version":1}],"wait_ms":0}"#;
        let (code, _) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!(code, 204, "{name}: nothing to do yet");
        let (code, workers) = s.get_json("/v1/workers");
        assert_eq!(code, 200, "{name}: {workers}");
        let listed = step_workers(&workers);
        assert_eq!(listed.len(), 1, "{name}: {workers}");
        let w = listed[0];
        assert_eq!(
            (w["id"].as_str(), &w["machines"]),
            (Some("py-1"), &json!([{ "name": "echo", "version": 1 }]))
        );
        assert_eq!(w["namespaces"], json!(["default"]));

        s.post("/v1/namespaces/default/instances", r#"{"machine":"echo","at":"run"}"#);
        let lease = r#"{"worker":"py-1","namespace":"default","machines":[{"name":"echo","version":1}],"lease_ms":100}"#;
        let (code, task) = s.post("/v1/worker/tasks/poll", lease);
        assert_eq!(code, 200, "{name}: {task}");
        // A second queue of the machine, later in name order, with nothing executing: the
        // machine's expired lease still counts.
        let (code, other) = s.post(
            "/v1/namespaces/default/instances",
            r#"{"machine":"echo","at":"run","queue":"zz"}"#,
        );
        assert_eq!(code, 201, "{name}: {other}");
        std::thread::sleep(Duration::from_millis(300));
        let (code, text) = s.get("/metrics");
        assert_eq!(code, 200, "{name}");
        let samples = parse_prometheus(&text);
        // Summed over the machine's queues (`keel_leases_held` has one series per queue).
        let value = |metric: &str| {
            let matching: Vec<f64> = samples
                .iter()
                .filter(|(m, labels, _)| m == metric && labels.contains("machine=\"echo\""))
                .map(|s| s.2)
                .collect();
            assert!(!matching.is_empty(), "{name}: no {metric} for echo in\n{text}");
            matching.iter().sum::<f64>()
        };
        assert_eq!(value("keel_leases_held"), 1.0, "{name}");
        assert_eq!(value("keel_leases_expired"), 1.0, "{name}: the lease ran out unreaped");
        // The next poll reaps it.
        s.post("/v1/worker/tasks/poll", poll);
        let (_, text) = s.get("/metrics");
        let samples = parse_prometheus(&text);
        let reaped = samples.iter().find(|(m, _, _)| m == "keel_leases_reaped_total");
        assert!(reaped.is_some_and(|r| r.2 >= 1.0), "{name}: {text}");
        let (_, text) = s.get("/metrics");
        for documented in ["keel_leases_held", "keel_leases_expired", "keel_leases_reaped_total"] {
            assert!(text.contains(documented), "{name}: {documented} missing\n{text}");
        }
    }
}

#[test]
fn schedules_are_listed_paused_and_resumed_per_namespace() {
    let config = "[schedules.nightly]\ncron = \"0 2 * * *\"\nstart = { machine = \"report\" }\n\n\
                  [schedules.hourly]\ncron = \"0 * * * *\"\n\
                  start = { machine = \"report\", namespace = \"ops\" }\n";
    for (name, s) in servers("schedules_are_listed_paused_and_resumed_per_namespace", Some(config))
    {
        let (code, listed) = s.get_json("/v1/namespaces/default/schedules");
        assert_eq!(code, 200, "{name}: {listed}");
        let schedules = listed["schedules"].as_array().unwrap();
        assert_eq!(schedules.len(), 1, "{name}: only this namespace's: {listed}");
        assert_eq!(schedules[0]["name"], "nightly");
        assert!(schedules[0]["next_fire"].is_i64(), "{name}: {listed}");

        let (code, paused) = s.post("/v1/namespaces/default/schedules/nightly/pause", "");
        assert_eq!((code, &paused["state"]["paused"]), (200, &json!(true)), "{name}: {paused}");
        let (_, listed) = s.get_json("/v1/namespaces/default/schedules");
        assert_eq!(listed["schedules"][0]["paused"], true, "{name}: {listed}");
        assert_eq!(listed["schedules"][0]["changed_at"], paused["state"]["changed_at"]);
        let (code, resumed) = s.post("/v1/namespaces/default/schedules/nightly/resume", "");
        assert_eq!((code, &resumed["state"]["paused"]), (200, &json!(false)), "{name}");

        // A schedule of another namespace, or an unknown one, is not found.
        let (code, err) = s.post("/v1/namespaces/default/schedules/hourly/pause", "");
        assert_eq!(code, 404, "{name}: {err}");
        assert!(err["error"].as_str().unwrap().contains("--config"), "{name}: {err}");
        assert_eq!(s.post("/v1/namespaces/ops/schedules/nope/resume", "").0, 404, "{name}");
        let (code, hourly) = s.post("/v1/namespaces/ops/schedules/hourly/pause", "");
        assert_eq!((code, &hourly["state"]["namespace"]), (200, &json!("ops")), "{name}");
    }
}

#[test]
fn history_pages_over_http_with_a_cursor_and_404_for_another_namespace() {
    for (name, s) in servers("history_pages_over_http_with_a_cursor", None) {
        let ns = "/v1/namespaces/default/instances";
        let (_, a) = s.post(ns, r#"{"machine":"walker","at":"s0","context":{}}"#);
        let id = a["id"].as_i64().unwrap();
        // Four steps over the worker protocol, one history entry each, then the end.
        let poll = r#"{"worker":"w","namespace":"default","machines":[{"name":"walker","version":1}],"wait_ms":5000}"#;
        for i in 1..=5 {
            let (code, task) = s.post("/v1/worker/tasks/poll", poll);
            assert_eq!((code, task["id"].as_i64()), (200, Some(id)), "{name}: {task}");
            let token = task["token"].as_i64().unwrap();
            let outcome = if i < 5 {
                format!(r#"{{"type":"next","step":"s{i}","context":{{}}}}"#)
            } else {
                r#"{"type":"done","result":{}}"#.to_owned()
            };
            let (code, answer) = s.post(
                &format!("/v1/worker/tasks/{id}/complete"),
                &format!(r#"{{"worker":"w","token":{token},"outcome":{outcome}}}"#),
            );
            assert_eq!(code, 200, "{name}: {answer}");
        }
        let (code, whole) = s.get_json(&format!("{ns}/{id}/history"));
        assert_eq!(code, 200, "{name}: {whole}");
        let seqs = |doc: &Value| -> Vec<i64> {
            doc["entries"].as_array().unwrap().iter().map(|e| e["seq"].as_i64().unwrap()).collect()
        };
        let all = seqs(&whole);
        assert!(all.len() >= 5 && all.windows(2).all(|w| w[0] > w[1]), "{name}: {all:?}");
        assert_eq!(whole["next"], Value::Null);

        let (_, first) = s.get_json(&format!("{ns}/{id}/history?limit=3"));
        assert_eq!(seqs(&first), all[..3], "{name}");
        let next = first["next"].as_i64().expect("a cursor while older entries exist");
        let (_, rest) = s.get_json(&format!("{ns}/{id}/history?limit=1000&before={next}"));
        assert_eq!((seqs(&rest), &rest["next"]), (all[3..].to_vec(), &Value::Null), "{name}");

        for (path, code, field) in [
            (format!("{ns}/{id}/history?limit=1001"), 400, "limit"),
            (format!("{ns}/{id}/history?limit=0"), 400, "limit"),
            (format!("{ns}/{id}/history?before=later"), 400, "before"),
            (format!("{ns}/{id}/history?sort=asc"), 400, "sort"),
            (format!("{ns}/{id}/history?limit=ten"), 400, "limit"),
            (format!("{ns}/nope/history"), 400, "id"),
        ] {
            let (got, body) = s.get_json(&path);
            assert_eq!(
                (got, body["field"].as_str()),
                (code, Some(field)),
                "{name}: {path}: {body}"
            );
        }
        let (code, _) = s.get_json(&format!("/v1/namespaces/other/instances/{id}/history"));
        assert_eq!(code, 404, "{name}: another namespace's instance is not found");
        let (code, _) = s.get_json(&format!("{ns}/999999/history"));
        assert_eq!(code, 404, "{name}");
    }
}

/// A remote step that ends a wait consumes the awaited signals it was handed, and no
/// others: an event delivered while the step ran stays pending for the next step.
/// A poll claims queue by queue under the file's settings, as an in-process worker does:
/// a global limit holds across HTTP workers, and the queues served are the ones named.
#[test]
fn polls_claim_each_queue_under_its_settings() {
    let config =
        "[queues.default]\nglobal_concurrency = 1\n[machines.mailer.queue]\nname = \"mail\"\n";
    for (name, s) in servers("polls_claim_each_queue_under_its_settings", Some(config)) {
        let ns = "/v1/namespaces/default";
        for _ in 0..2 {
            let (code, started) =
                s.post(&format!("{ns}/instances"), r#"{"machine":"greeter","at":"greet"}"#);
            assert_eq!(code, 201, "{name}: {started}");
        }
        let poll = |worker: &str, machine: &str, queues: &str| {
            s.post(
                "/v1/worker/tasks/poll",
                &format!(
                    r#"{{"worker":"{worker}","namespace":"default","machines":[{{"name":"{machine}","version":1}}]{queues}}}"#
                ),
            )
        };
        let (code, task) = poll("w1", "greeter", "");
        assert_eq!(code, 200, "{name}: {task}");
        // One executing in `default` is its global limit: a second worker gets nothing.
        let (code, none) = poll("w2", "greeter", "");
        assert_eq!(code, 204, "{name}: {none}");
        let (code, answer) = s.post(
            &format!("/v1/worker/tasks/{}/complete", task["id"]),
            &format!(
                r#"{{"worker":"w1","token":{},"outcome":{{"type":"done","result":{{}}}}}}"#,
                task["token"]
            ),
        );
        assert_eq!(code, 200, "{name}: {answer}");
        assert_eq!(poll("w2", "greeter", "").0, 200, "{name}: the slot came back");

        // `mailer` starts in `mail`, which the file names, so a poll serves it by default;
        // a queue nobody names is served only by a poll that lists it.
        let (code, _) = s.post(&format!("{ns}/instances"), r#"{"machine":"mailer","at":"send"}"#);
        assert_eq!(code, 201, "{name}");
        assert_eq!(poll("w3", "mailer", "").0, 200, "{name}: the file's queue");
        let (code, _) = s
            .post(&format!("{ns}/instances"), r#"{"machine":"mailer","at":"send","queue":"side"}"#);
        assert_eq!(code, 201, "{name}");
        assert_eq!(poll("w3", "mailer", "").0, 204, "{name}: `side` is not served by default");
        let (code, task) = poll("w3", "mailer", r#","queues":["side"]"#);
        assert_eq!((code, task["machine"].as_str()), (200, Some("mailer")), "{name}: {task}");
        for bad in [r#","queues":[]"#, r#","queues":[""]"#] {
            let (code, answer) = poll("w3", "mailer", bad);
            assert_eq!(code, 400, "{name}: {bad}: {answer}");
            assert!(answer["field"].as_str().unwrap().starts_with("queues"), "{name}: {answer}");
        }
    }
}

#[test]
fn a_remote_step_consumes_only_the_signals_its_task_carried() {
    for (name, s) in servers("a_remote_step_consumes_only_seen_signals", None) {
        let ns = "/v1/namespaces/default";
        let poll = r#"{"worker":"w","namespace":"default","machines":[{"name":"payer","version":1}],"wait_ms":5000}"#;
        let (code, started) =
            s.post(&format!("{ns}/instances"), r#"{"machine":"payer","at":"bill"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();
        let complete = |token: i64, rest: &str| {
            s.post(
                &format!("/v1/worker/tasks/{id}/complete"),
                &format!(r#"{{"worker":"w","token":{token},{rest}}}"#),
            )
        };
        // The first step parks on `payment`.
        let (code, task) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!(code, 200, "{name}: {task}");
        let (code, answer) = complete(
            task["token"].as_i64().unwrap(),
            r#""outcome":{"type":"await","signal":"payment","context":{}}"#,
        );
        assert_eq!(code, 200, "{name}: {answer}");
        let send = |n: i64| {
            let (code, sent) = s.post(
                &format!("{ns}/events"),
                &format!(r#"{{"instance":{id},"event":"payment","payload":{n}}}"#),
            );
            assert_eq!(code, 202, "{name}: {sent}");
            sent["signal"].as_i64().unwrap()
        };
        let first = send(1);
        let (code, task) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!(code, 200, "{name}: {task}");
        let token = task["token"].as_i64().unwrap();
        let handed: Vec<i64> =
            task["inbox"].as_array().unwrap().iter().map(|s| s["id"].as_i64().unwrap()).collect();
        assert_eq!(handed, [first], "{name}: {task}");
        // A second payment arrives while the remote step runs.
        let second = send(2);

        // Without `seen` the commit cannot tell what the step saw: refused, nothing stored.
        let next = r#""outcome":{"type":"next","step":"ship","context":{}}"#;
        let (code, answer) = complete(token, next);
        assert_eq!((code, answer["field"].as_str()), (400, Some("seen")), "{name}: {answer}");
        let (_, row) = s.get_json(&format!("{ns}/instances/{id}"));
        assert_eq!(row["instance"]["status"], "executing", "{name}: {row}");

        let (code, answer) = complete(token, &format!(r#"{next},"seen":[{first}]"#));
        assert_eq!(code, 200, "{name}: {answer}");
        let (_, row) = s.get_json(&format!("{ns}/instances/{id}"));
        let pending: Vec<i64> =
            row["inbox"].as_array().unwrap().iter().map(|s| s["id"].as_i64().unwrap()).collect();
        assert_eq!(pending, [second], "{name}: the unseen payment stays pending: {row}");
        let (code, task) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!((code, task["step"].as_str()), (200, Some("ship")), "{name}: {task}");
        assert_eq!(task["inbox"][0]["id"].as_i64(), Some(second), "{name}: {task}");

        // A failure's dead letter lists what the task carried, not a signal that came
        // later: skipping the dead letter drops the signals it lists.
        let third = send(3);
        let token = task["token"].as_i64().unwrap();
        let (code, answer) = s.post(
            &format!("/v1/worker/tasks/{id}/fail"),
            &format!(
                r#"{{"worker":"w","token":{token},"error":"no","retryable":false,"seen":[{second}]}}"#
            ),
        );
        assert_eq!(code, 200, "{name}: {answer}");
        let (_, letters) = s.get_json(&format!("{ns}/dead-letters"));
        let listed = &letters["dead_letters"][0]["letter"]["signals"];
        assert_eq!(listed, &json!([second]), "{name}: {letters}");
        let (_, row) = s.get_json(&format!("{ns}/instances/{id}"));
        let pending: Vec<i64> =
            row["inbox"].as_array().unwrap().iter().map(|s| s["id"].as_i64().unwrap()).collect();
        assert_eq!(pending, [second, third], "{name}: {row}");
    }
}

/// A browser lets any page send requests to a loopback server. Changes it marks as sent by
/// another site are refused on the API, the worker protocol and the dashboard, and without
/// tokens so is any request addressed to a name that is not a loopback one (DNS
/// rebinding); scripts, which send neither header, are not affected.
#[test]
fn changes_from_other_sites_and_requests_to_other_names_are_refused() {
    for (name, s) in servers("changes_from_other_sites_are_refused", None) {
        let start = r#"{"machine":"greeter","at":"greet"}"#;
        let starts = "/v1/namespaces/default/instances";
        let own = format!("Origin: http://{}", s.addr());
        let port = s.addr().rsplit(':').next().unwrap().parse::<u16>().unwrap();
        let other_port = format!("Origin: http://127.0.0.1:{}", port.wrapping_add(1).max(1));
        let cases: [(&[&str], &str); 6] = [
            (&["Origin: http://evil.example", "Content-Type: text/plain"], "origin"),
            (&["Origin: null", "Content-Type: text/plain"], "origin"),
            (&[other_port.as_str()], "origin"),
            (&["Sec-Fetch-Site: cross-site", "Origin: http://evil.example"], "sec-fetch-site"),
            (&["Sec-Fetch-Site: cross-site"], "sec-fetch-site"),
            // A sibling subdomain is the same site, but not the dashboard's own page.
            (&["Sec-Fetch-Site: same-site", own.as_str()], "sec-fetch-site"),
        ];
        for (headers, field) in cases {
            let (code, answer) = s.raw_json("POST", starts, headers, start);
            assert_eq!((code, answer["field"].as_str()), (403, Some(field)), "{name}: {headers:?}");
            assert!(
                answer["error"].as_str().unwrap().contains("no changes from other sites"),
                "{name}: {answer}"
            );
        }
        let (code, answer) = s.raw_json(
            "POST",
            "/v1/worker/tasks/poll",
            &["Origin: http://evil.example"],
            r#"{"worker":"w","namespace":"default","machines":[{"name":"greeter","version":1}]}"#,
        );
        assert_eq!((code, answer["field"].as_str()), (403, Some("origin")), "{name}: {answer}");
        let (_, listed) = s.get_json("/v1/namespaces/default/machines/greeter/instances");
        assert_eq!(listed["instances"], json!([]), "{name}: nothing started: {listed}");

        // The server's own pages, and scripts without browser headers, change things.
        let (code, answer) =
            s.raw_json("POST", starts, &[own.as_str(), "Sec-Fetch-Site: same-origin"], start);
        assert_eq!(code, 201, "{name}: {answer}");
        assert_eq!(s.post(starts, start).0, 201, "{name}");
        // Behind a proxy that rewrites `Host` the browser's `Origin` names the public
        // address, or is `null` under `Referrer-Policy: no-referrer`; `Sec-Fetch-Site`
        // still says the page is the server's own, and decides alone.
        for origin in ["Origin: https://keel.example", "Origin: null"] {
            let (code, answer) =
                s.raw_json("POST", starts, &[origin, "Sec-Fetch-Site: same-origin"], start);
            assert_eq!(code, 201, "{name}: {origin}: {answer}");
        }
        // A read is not a change: the browser keeps its answer from the other site's page.
        let (code, _) = s.raw_json(
            "GET",
            "/v1/namespaces/default/status",
            &["Origin: http://evil.example", "Sec-Fetch-Site: cross-site"],
            "",
        );
        assert_eq!(code, 200, "{name}");

        // The dashboard's forms: another site's post is refused with a page that says why.
        let form = "Content-Type: application/x-www-form-urlencoded";
        let pause = "/ui/ns/default/queues/default/pause";
        let (code, page) = s.raw("POST", pause, None, &["Origin: http://evil.example", form], "");
        assert_eq!(code, 403, "{name}: {page}");
        assert!(page.contains("<h1>Refused</h1>") && page.contains("origin:"), "{name}: {page}");
        let (_, status) = s.get_json("/v1/namespaces/default/status");
        assert_eq!(status["queues"][0]["paused"], false, "{name}: {status}");
        let same = [own.as_str(), "Sec-Fetch-Site: same-origin", form];
        let (code, _) = s.raw("POST", pause, None, &same, "");
        assert_eq!(code, 303, "{name}: the dashboard's own form");
        let proxied = ["Origin: https://keel.example", "Sec-Fetch-Site: same-origin", form];
        let resume = "/ui/ns/default/queues/default/resume";
        let (code, page) = s.raw("POST", resume, Some(s.addr()), &proxied, "");
        assert_eq!(code, 303, "{name}: the dashboard's form behind a proxy: {page}");
        let (code, _) = s.raw("POST", pause, None, &same, "");
        assert_eq!(code, 303, "{name}: paused again");
        let (_, status) = s.get_json("/v1/namespaces/default/status");
        assert_eq!(status["queues"][0]["paused"], true, "{name}: {status}");

        // Without tokens, only loopback names: a name rebound to 127.0.0.1 reads nothing.
        let rebound = format!("evil.example:{port}");
        for path in ["/v1/namespaces/default/status", "/ui/ns/default"] {
            let (code, text) = s.raw("GET", path, Some(&rebound), &[], "");
            assert_eq!(code, 403, "{name}: {path}: {text}");
            assert!(text.contains("host:") && text.contains("loopback"), "{name}: {text}");
        }
        // A Host that is not visible ASCII cannot be read as a loopback name.
        let (code, text) =
            s.raw("GET", "/v1/namespaces/default/status", Some("h\u{e9}st"), &[], "");
        assert_eq!(code, 403, "{name}: {text}");
        assert!(text.contains("host:") && text.contains("loopback"), "{name}: {text}");
        for host in [format!("localhost:{port}"), s.addr().to_owned()] {
            let (code, _) = s.raw("GET", "/v1/namespaces/default/status", Some(&host), &[], "");
            assert_eq!(code, 200, "{name}: {host}");
        }
    }
}

/// A request refused before its body was read is answered with `Connection: close`, and
/// the connection closes: the server cannot take another request on it, and a client that
/// keeps connections open must not send its next one there.
#[test]
fn a_request_refused_before_its_body_is_read_closes_its_connection() {
    for (name, s) in servers("a_request_refused_before_its_body_is_read", None) {
        let body = r#"{"machine":"m","at":"a"}"#;
        let head = |path: &str| {
            format!(
                "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                s.addr(),
                body.len()
            )
        };
        // Refused on its query; the body is never sent.
        let (refused, closed) = s.answer_head(&head("/v1/namespaces/default/instances?queue=fast"));
        assert!(refused.starts_with("http/1.1 400"), "{name}: {refused}");
        assert!(refused.contains("\r\nconnection: close\r\n"), "{name}: {refused}");
        assert!(closed, "{name}: the server closes the connection it said it would");
        // An accepted request keeps its connection open.
        let (accepted, closed) = s.answer_head(&(head("/v1/namespaces/default/instances") + body));
        assert!(accepted.starts_with("http/1.1 201"), "{name}: {accepted}");
        assert!(!accepted.contains("connection: close") && !closed, "{name}: {accepted}");
    }
}

/// Every route that takes no query string refuses one, naming it, before it acts.
#[test]
fn routes_without_parameters_refuse_a_query_naming_it() {
    for (name, s) in servers("routes_without_parameters_refuse_a_query", None) {
        let ns = "/v1/namespaces/default";
        let (code, started) = s.post(&format!("{ns}/instances"), r#"{"machine":"m","at":"a"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        let id = started["id"].as_i64().unwrap();
        let event = format!(r#"{{"instance":{id},"event":"E"}}"#);
        let poll = r#"{"worker":"w","namespace":"default","machines":[{"name":"m","version":1}]}"#;
        let task = r#"{"worker":"w","token":1,"error":"x"}"#;
        let posts = [
            (format!("{ns}/instances/{id}/cancel?cascade=true"), "", "cascade"),
            (format!("{ns}/events?dedup_key=once"), event.as_str(), "dedup_key"),
            (format!("{ns}/instances?queue=fast"), r#"{"machine":"m","at":"a"}"#, "queue"),
            (format!("{ns}/queues/default/pause?until=1h"), "", "until"),
            (format!("{ns}/queues/default/resume?x=1"), "", "x"),
            (format!("{ns}/schedules/nightly/pause?x=1"), "", "x"),
            (format!("{ns}/schedules/nightly/resume?x=1"), "", "x"),
            (format!("{ns}/dead-letters/1/retry?all=true"), "", "all"),
            ("/v1/worker/tasks/poll?wait_ms=1000".to_owned(), poll, "wait_ms"),
            (format!("/v1/worker/tasks/{id}/heartbeat?lease_ms=1"), task, "lease_ms"),
            (format!("/v1/worker/tasks/{id}/complete?x=1"), task, "x"),
            (format!("/v1/worker/tasks/{id}/fail?retryable=false"), task, "retryable"),
        ];
        for (path, body, field) in posts {
            let (code, answer) = s.post(&path, body);
            assert_eq!((code, answer["field"].as_str()), (400, Some(field)), "{name}: {path}");
            assert!(
                answer["error"].as_str().unwrap().contains("takes no query parameters"),
                "{name}: {answer}"
            );
        }
        // A query without a parameter name is refused too, naming the query as a whole.
        for query in ["?=1", "?&=x", "?", "?&"] {
            let path = format!("{ns}/queues/default/pause{query}");
            let (code, answer) = s.raw_json("POST", &path, &[], "");
            assert_eq!((code, answer["field"].as_str()), (400, Some("query")), "{name}: {path}");
            let error = answer["error"].as_str().unwrap();
            assert!(
                error.starts_with("query: this route takes no query parameters")
                    && error.contains(&format!("{query:?}")),
                "{name}: {answer}"
            );
        }
        for path in ["/health?verbose=1", "/metrics?x=1", "/v1/cluster/info?x=1"] {
            let (code, answer) = s.get_json(path);
            assert_eq!(code, 400, "{name}: {path}: {answer}");
        }
        // Nothing acted: the instance is neither cancelled nor claimed, and no event came.
        let (_, row) = s.get_json(&format!("{ns}/instances/{id}"));
        assert_eq!(row["instance"]["status"], "runnable", "{name}: {row}");
        assert_eq!(row["inbox"], json!([]), "{name}: {row}");
        let (_, status) = s.get_json(&format!("{ns}/status"));
        assert_eq!(status["queues"][0]["paused"], false, "{name}: {status}");
    }
}

const CHILD_TOKENS: &str = r#"
[[tokens]]
token = "token-for-namespace-a"
namespaces = ["a"]
access = "operate"

[[tokens]]
token = "token-for-namespace-b"
namespaces = ["b"]
access = "read"

[[tokens]]
token = "worker-for-every-namespace"
namespaces = ["*"]
access = "operate"
"#;

/// A child `greeter` v1 at `greet` in namespace `ns` with `context`, as a worker's
/// `schedule_children` outcome lists it.
fn greeter_child(ns: &str, context: &str) -> String {
    format!(
        r#"{{"namespace":"{ns}","machine":{{"name":"greeter","version":1}},"position":"greet","context":{context},"business_key":null,"queue":"default","priority":"normal","concurrency_key":null,"unique":null,"eligible_at":null,"correlation_id":null,"invoked_by":null}}"#
    )
}

/// Starts a `parent` in namespace a with `starter`'s token, then, as the HTTP worker with
/// the token `worker`, claims it and completes it by scheduling `children` (child JSON,
/// comma-separated); returns the parent's id.
fn parent_with_children(
    s: &Server,
    name: &str,
    starter: &str,
    worker: &str,
    children: &str,
) -> i64 {
    let (code, started) =
        s.post_as(starter, "/v1/namespaces/a/instances", r#"{"machine":"parent","at":"spawn"}"#);
    assert_eq!(code, 201, "{name}: {started}");
    let id = started["id"].as_i64().unwrap();
    let poll = r#"{"worker":"w","namespace":"a","machines":[{"name":"parent","version":1}]}"#;
    let (code, task) = s.post_as(worker, "/v1/worker/tasks/poll", poll);
    assert_eq!((code, task["id"].as_i64()), (200, Some(id)), "{name}: {task}");
    let done = format!(
        r#"{{"worker":"w","token":{},"outcome":{{"type":"schedule_children","next":"after","context":{{}},"children":[{children}]}}}}"#,
        task["token"]
    );
    let (code, answer) = s.post_as(worker, &format!("/v1/worker/tasks/{id}/complete"), &done);
    assert_eq!(code, 200, "{name}: {answer}");
    id
}

/// A parent in `a` may have children in `b` (started by a worker that sees both). A token
/// for `a` sees the parent without them, and cannot cancel them through it; a token for
/// every namespace sees and cancels them as before.
#[test]
fn children_in_other_namespaces_are_neither_shown_nor_cancelled_through_their_parent() {
    let (a, all) = ("token-for-namespace-a", "worker-for-every-namespace");
    for (name, s) in servers_with("children_in_other_namespaces", None, Some(CHILD_TOKENS)) {
        let child =
            |ns: &str, secret: &str| greeter_child(ns, &format!(r#"{{"secret":"{secret}"}}"#));
        // One parent with a child in a and one in b, one with a child in a only.
        let mixed = || format!("{},{}", child("a", "for-a"), child("b", "only-for-b"));
        let parents: Vec<i64> = [mixed(), child("a", "for-a"), mixed()]
            .iter()
            .map(|children| parent_with_children(&s, name, a, all, children))
            .collect();
        let (parent, lonely, ended_in_b) = (parents[0], parents[1], parents[2]);
        let detail_of = |token: &str, parent: i64| {
            let (code, text) = s.get_as(token, &format!("/v1/namespaces/a/instances/{parent}"));
            assert_eq!(code, 200, "{name}: {text}");
            (serde_json::from_str::<Value>(&text).unwrap(), text)
        };
        let detail = |token: &str| detail_of(token, parent);
        let in_b = |id: i64| s.get_as(all, &format!("/v1/namespaces/b/instances/{id}")).0 == 200;
        // A parent's children as (the one in a, the one in b).
        let children_of = |parent: i64| {
            let (everything, _) = detail_of(all, parent);
            let ids: Vec<i64> = everything["children"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["id"].as_i64().unwrap())
                .collect();
            assert_eq!((ids.len(), everything["children_hidden"].as_u64()), (2, Some(0)), "{name}");
            let (ca, cb) = if in_b(ids[1]) { (ids[0], ids[1]) } else { (ids[1], ids[0]) };
            assert!(in_b(cb) && !in_b(ca), "{name}");
            (ca, cb)
        };
        let (ca, cb) = children_of(parent);

        // Token a: the child in b is left out of the API's detail and the dashboard's page.
        let (seen, text) = detail(a);
        let shown: Vec<i64> = seen["children"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_i64().unwrap())
            .collect();
        assert_eq!(shown, vec![ca], "{name}: {seen}");
        assert_eq!(seen["children_hidden"], 1, "{name}: {seen}");
        assert!(!text.contains("only-for-b"), "{name}: b's context leaked: {text}");
        let (code, page) = s.get_as(a, &format!("/ui/ns/a/instances/{parent}"));
        assert_eq!(code, 200, "{name}: {page}");
        assert!(page.contains(&format!("/ui/ns/a/instances/{ca}\"")), "{name}: {page}");
        assert!(!page.contains(&format!("/ui/ns/a/instances/{cb}\"")), "{name}: {page}");
        assert!(page.contains("id=\"children-hidden\""), "{name}: {page}");

        // Token a cannot cancel b's child through the parent; nothing is cancelled.
        let cancel = format!("/v1/namespaces/a/instances/{parent}/cancel");
        let (code, answer) = s.post_as(a, &cancel, r#"{"cascade":true}"#);
        assert_eq!((code, answer["field"].as_str()), (403, Some("cascade")), "{name}: {answer}");
        assert!(answer["error"].as_str().unwrap().contains("nothing was cancelled"), "{answer}");
        for (ns, id) in [("a", parent), ("a", ca), ("b", cb)] {
            let (_, row) = s.get_as(all, &format!("/v1/namespaces/{ns}/instances/{id}"));
            let row: Value = serde_json::from_str(&row).unwrap();
            assert_ne!(row["instance"]["status"], "cancelled", "{name}: {id}");
        }
        // A tree within the token's namespaces cascades as before.
        let (code, answer) = s.post_as(
            a,
            &format!("/v1/namespaces/a/instances/{lonely}/cancel"),
            r#"{"cascade":true}"#,
        );
        assert_eq!(code, 200, "{name}: {answer}");
        assert_eq!(answer["cancelled"].as_array().unwrap().len(), 2, "{name}: {answer}");
        // A child in b that has ended is left as it is by the cascade, so token a may
        // cascade through its parent: the cancel reaches only what is in a.
        let (ended_a, ended_b) = children_of(ended_in_b);
        let (code, answer) =
            s.post_as(all, &format!("/v1/namespaces/b/instances/{ended_b}/cancel"), "");
        assert_eq!(code, 200, "{name}: {answer}");
        let (code, answer) = s.post_as(
            a,
            &format!("/v1/namespaces/a/instances/{ended_in_b}/cancel"),
            r#"{"cascade":true}"#,
        );
        assert_eq!(code, 200, "{name}: {answer}");
        let mut cancelled: Vec<i64> =
            answer["cancelled"].as_array().unwrap().iter().map(|i| i.as_i64().unwrap()).collect();
        cancelled.sort_unstable();
        let mut within_a = vec![ended_in_b, ended_a];
        within_a.sort_unstable();
        assert_eq!(cancelled, within_a, "{name}: {answer}");
        // A token for every namespace cancels the whole tree.
        let (code, answer) = s.post_as(all, &cancel, r#"{"cascade":true}"#);
        assert_eq!(code, 200, "{name}: {answer}");
        let mut cancelled: Vec<i64> =
            answer["cancelled"].as_array().unwrap().iter().map(|i| i.as_i64().unwrap()).collect();
        cancelled.sort_unstable();
        let mut tree = vec![parent, ca, cb];
        tree.sort_unstable();
        assert_eq!(cancelled, tree, "{name}: {answer}");
    }
}

/// On the dashboard a child and a parent in another namespace are linked under their own
/// namespace, and a parent the token may not see is named without a link.
#[test]
fn parents_and_children_are_linked_under_their_own_namespace() {
    let (b, all) = ("token-for-namespace-b", "worker-for-every-namespace");
    for (name, s) in servers_with("linked_under_their_own_namespace", None, Some(CHILD_TOKENS)) {
        let parent = parent_with_children(&s, name, all, all, &greeter_child("b", "{}"));
        let (_, detail) = s.get_as(all, &format!("/v1/namespaces/a/instances/{parent}"));
        let detail: Value = serde_json::from_str(&detail).unwrap();
        let child = detail["children"][0]["id"].as_i64().unwrap();

        let (code, page) = s.get_as(all, &format!("/ui/ns/a/instances/{parent}"));
        assert_eq!(code, 200, "{name}: {page}");
        assert!(page.contains(&format!("href=\"/ui/ns/b/instances/{child}\"")), "{name}: {page}");
        let (code, page) = s.get_as(all, &format!("/ui/ns/b/instances/{child}/fragment"));
        assert_eq!(code, 200, "{name}: {page}");
        let link = format!("parent <a href=\"/ui/ns/a/instances/{parent}\">i{parent}</a>");
        assert!(page.contains(&link), "{name}: {page}");
        // A token for b sees the child, and its parent in a only by id.
        let (code, page) = s.get_as(b, &format!("/ui/ns/b/instances/{child}/fragment"));
        assert_eq!(code, 200, "{name}: {page}");
        assert!(page.contains(&format!(" · parent i{parent}</p>")), "{name}: {page}");
        assert!(!page.contains("/ui/ns/a/"), "{name}: {page}");
    }
}

/// Every dashboard answer forbids framing by another site: pages, fragments, assets, the
/// login form and the sign-in redirect.
#[test]
fn dashboard_answers_may_not_be_framed() {
    let frame_headers = |s: &Server, path: &str| {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .build()
            .into();
        let response = agent.get(&format!("{}{path}", s.base)).call().unwrap();
        let header =
            |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
        (response.status().as_u16(), header("x-frame-options"), header("content-security-policy"))
    };
    let deny = (Some("DENY".to_owned()), Some("frame-ancestors 'none'".to_owned()));
    for (name, s) in servers("dashboard_answers_may_not_be_framed", None) {
        for (path, status) in [
            ("/ui/ns/default", 200),
            ("/ui/ns/default/fragments/overview", 200),
            ("/ui/assets/live.js", 200),
            ("/ui/assets/style.css", 200),
            ("/ui/typo", 404),
        ] {
            let (code, frame, csp) = frame_headers(&s, path);
            assert_eq!((code, (frame, csp)), (status, deny.clone()), "{name}: {path}");
        }
    }
    for (name, s) in servers_with("dashboard_answers_may_not_be_framed", None, Some(TOKENS)) {
        for (path, status) in [("/ui/login", 200), ("/ui/ns/a", 303), ("/ui/assets/live.js", 200)] {
            let (code, frame, csp) = frame_headers(&s, path);
            assert_eq!((code, (frame, csp)), (status, deny.clone()), "{name}: {path}");
        }
    }
}

/// A browser that follows redirects and sends a cookie only under its `Path`, as browsers
/// do; from `start`, the final address, status and page.
fn browse(s: &Server, start: &str, jar: &mut Option<(String, String)>) -> (String, u16, String) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into();
    let mut at = start.to_owned();
    for _ in 0..10 {
        let path = at.split('?').next().unwrap().to_owned();
        let mut request = agent.get(&format!("{}{at}", s.base));
        if let Some((cookie, scope)) = jar.as_ref() {
            let under = path == *scope
                || (path.starts_with(scope.as_str())
                    && (scope.ends_with('/') || path[scope.len()..].starts_with('/')));
            if under {
                request = request.header("Cookie", cookie);
            }
        }
        let mut response = request.call().unwrap();
        if let Some(set) = response.headers().get("set-cookie") {
            let set = set.to_str().unwrap();
            let pair = set.split(';').next().unwrap().trim().to_owned();
            let scope = set
                .split(';')
                .find_map(|part| part.trim().strip_prefix("Path="))
                .unwrap_or("/")
                .to_owned();
            *jar = Some((pair, scope));
        }
        if response.status().is_redirection() {
            response.headers()["location"].to_str().unwrap().clone_into(&mut at);
            continue;
        }
        let status = response.status().as_u16();
        return (path, status, response.body_mut().read_to_string().unwrap());
    }
    panic!("more than 10 redirects from {start}");
}

/// `/?token=…` signs in and lands on the dashboard, and `/` reaches it once signed in.
#[test]
fn the_root_address_and_its_token_link_reach_the_dashboard() {
    for (name, s) in servers_with("the_root_address_reaches_the_dashboard", None, Some(TOKENS)) {
        let mut jar = None;
        let (at, code, _) = browse(&s, "/", &mut jar);
        assert_eq!((at.as_str(), code), ("/ui/login", 200), "{name}: not signed in yet");
        let (at, code, page2) = browse(&s, "/?token=token-for-namespace-a", &mut jar);
        assert_eq!((at.as_str(), code), ("/ui/ns/a", 200), "{name}: {page2}");
        assert!(page2.contains("Namespace a"), "{name}: {page2}");
        let (at, code, _) = browse(&s, "/", &mut jar);
        assert_eq!((at.as_str(), code), ("/ui/ns/a", 200), "{name}: signed in");
        let (at, _, _) = browse(&s, "/ui/login", &mut jar);
        assert_eq!(at, "/ui/ns/a", "{name}: the form is not shown again once signed in");
        // A mistyped dashboard address is the dashboard's page, not the API's JSON.
        for typo in ["/ui/ns/a/typo", "/ui/typo"] {
            let (at, code, page) = browse(&s, typo, &mut jar);
            assert_eq!((at.as_str(), code), (typo, 404), "{name}: {page}");
            assert!(page.contains("<h1>Not found</h1>"), "{name}: {typo}: {page}");
        }
        let (at, code, page3) = browse(&s, "/?token=not-a-token-of-this-server", &mut None);
        assert_eq!((at.as_str(), code), ("/ui", 401), "{name}: {page3}");
        assert!(page3.contains("this token is not in the server"), "{name}: {page3}");

        // With tokens, other names are served (behind a proxy, say), and another site's
        // changes are refused even with a valid token.
        let auth = "Authorization: Bearer token-for-namespace-a";
        let (code, _) =
            s.raw("GET", "/v1/namespaces/a/status", Some("keel.example:443"), &[auth], "");
        assert_eq!(code, 200, "{name}");
        let (code, answer) = s.raw_json(
            "POST",
            "/v1/namespaces/a/queues/default/pause",
            &[auth, "Sec-Fetch-Site: same-site"],
            "",
        );
        assert_eq!((code, answer["field"].as_str()), (403, Some("sec-fetch-site")), "{answer}");
    }
}

/// A gauge sampled from the store is dropped once the store no longer reports its group:
/// it reads 0 on the scrape after its last instance ended, and is gone from the next.
#[test]
fn gauges_of_a_group_the_store_no_longer_holds_are_dropped() {
    for (name, s) in servers("gauges_of_a_group_the_store_no_longer_holds_are_dropped", None) {
        let (code, started) =
            s.post("/v1/namespaces/short-lived/instances", r#"{"machine":"ephemeral"}"#);
        assert_eq!(code, 201, "{name}: {started}");
        let pending = |text: &str| {
            parse_prometheus(text)
                .into_iter()
                .find(|(m, labels, _)| {
                    m == "keel_queue_pending" && labels.contains("machine=\"ephemeral\"")
                })
                .map(|sample| sample.2)
        };
        let (_, text) = s.get("/metrics");
        assert_eq!(pending(&text), Some(1.0), "{name}: {text}");
        let id = started["id"].as_i64().unwrap();
        let (code, answer) =
            s.post(&format!("/v1/namespaces/short-lived/instances/{id}/cancel"), "");
        assert_eq!(code, 200, "{name}: {answer}");
        let (_, text) = s.get("/metrics");
        assert_eq!(pending(&text), Some(0.0), "{name}: the drain reads 0 once\n{text}");
        let (_, text) = s.get("/metrics");
        assert!(
            !text.contains("ephemeral") && !text.contains("short-lived"),
            "{name}: the group's gauges are gone\n{text}"
        );
    }
}

/// The message after a dashboard action comes from a code the server renders; a link
/// carrying text of its own shows nothing.
#[test]
fn dashboard_flash_messages_are_the_servers_own() {
    for (name, s) in servers("dashboard_flash_messages_are_the_servers_own", None) {
        // The action redirects to the overview, which says what it did.
        let url = format!("{}/ui/ns/default/queues/jobs/pause", s.base);
        let mut resp = s.agent.post(&url).send("").unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{name}");
        let page = resp.body_mut().read_to_string().unwrap();
        assert!(page.contains("<div class=\"flash\">Queue paused.</div>"), "{name}: {page}");
        let crafted = "/ui/ns/default?done=Your+session+expired%2C+sign+in+at+evil.example";
        let (code, page) = s.get(crafted);
        assert_eq!(code, 200, "{name}");
        assert!(
            !page.contains("class=\"flash\"") && !page.contains("evil.example"),
            "{name}: {page}"
        );
    }
}

/// A resume, over HTTP or from the dashboard, writes only over a stored pause: resuming a
/// name that is not paused (a typo) stores nothing, so it does not become a known queue.
#[test]
fn a_resume_of_a_queue_that_is_not_paused_stores_nothing() {
    use keel::layers::core::ports::Store as _;
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (name, s) in servers("a_resume_of_a_queue_that_is_not_paused_stores_nothing", None) {
        let (code, answer) = s.post("/v1/namespaces/default/queues/defualt/resume", "");
        let expected = json!({ "namespace": "default", "queue": "defualt", "paused": false, "changed": false });
        assert_eq!((code, &answer), (200, &expected), "{name}");
        let url = format!("{}/ui/ns/default/queues/defualt/resume", s.base);
        let resp = s.agent.post(&url).send("").unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{name}: the dashboard's resume");
        let keel = s.keel(&rt);
        let stored = rt.block_on(keel.store().queue_list("default".into())).unwrap();
        assert!(stored.iter().all(|q| q.queue != "defualt"), "{name}: {stored:?}");

        // A pause writes, and a resume over it writes and says it changed something.
        let (code, answer) = s.post("/v1/namespaces/default/queues/jobs/pause", "");
        assert_eq!((code, &answer["changed"]), (200, &json!(true)), "{name}: {answer}");
        let (code, answer) = s.post("/v1/namespaces/default/queues/jobs/pause", "");
        assert_eq!((code, &answer["changed"]), (200, &json!(false)), "{name}: {answer}");
        let (code, answer) = s.post("/v1/namespaces/default/queues/jobs/resume", "");
        assert_eq!((code, &answer["changed"]), (200, &json!(true)), "{name}: {answer}");
        let stored = rt.block_on(keel.store().queue_list("default".into())).unwrap();
        assert!(stored.iter().any(|q| q.queue == "jobs" && !q.paused), "{name}: {stored:?}");
    }
}

/// A remote step whose worker dies with it leaves only an expired lease behind. Once the
/// expired leases have used up the retry policy's attempts, a poll does not hand the task
/// out again: it fails it into the dead letters, naming the expired leases.
#[test]
fn a_task_whose_leases_used_up_its_attempts_is_dead_lettered_not_handed_out() {
    let config = "[queue.retry]\nmax_attempts = 2\n";
    for (name, s) in servers(
        "a_task_whose_leases_used_up_its_attempts_is_dead_lettered_not_handed_out",
        Some(config),
    ) {
        let ns = "/v1/namespaces/default/instances";
        let (code, a) = s.post(ns, r#"{"machine":"crashy","at":"call"}"#);
        assert_eq!(code, 201, "{name}: {a}");
        let id = a["id"].as_i64().unwrap();
        let poll = r#"{"worker":"w","namespace":"default","machines":[{"name":"crashy","version":1}],"lease_ms":100}"#;
        // Two workers take the task and die with it: each lease runs out unreported.
        for attempt in 0..2 {
            let (code, task) = s.post("/v1/worker/tasks/poll", poll);
            assert_eq!((code, task["attempt"].as_i64()), (200, Some(attempt)), "{name}: {task}");
            std::thread::sleep(Duration::from_millis(250));
        }
        // The next poll reaps the second lease and finds both attempts used up.
        let (code, task) = s.post("/v1/worker/tasks/poll", poll);
        assert_eq!(code, 204, "{name}: the task was handed out again: {task}");
        let (_, row) = s.get_json(&format!("{ns}/{id}"));
        let row = &row["instance"];
        assert_eq!(row["status"], "suspended", "{name}: {row}");
        let error = row["last_error"].as_str().unwrap_or_default();
        assert!(error.contains("its lease expired 2 times"), "{name}: {error}");
        assert!(error.contains("may be killing its worker"), "{name}: {error}");
        let (code, list) = s.get_json("/v1/namespaces/default/dead-letters");
        assert_eq!(code, 200, "{name}: {list}");
        let letters = list["dead_letters"].as_array().cloned().unwrap_or_default();
        assert_eq!(letters.len(), 1, "{name}: {list}");
        assert_eq!(letters[0]["letter"]["reason"], "non_retryable", "{name}: {list}");
    }
}

/// A poll for one task of `machine` by worker `w`.
fn poll_for(machine: &str, lease_ms: u64) -> String {
    format!(
        r#"{{"worker":"w","namespace":"default","machines":[{{"name":"{machine}","version":1}}],"lease_ms":{lease_ms},"wait_ms":2000}}"#
    )
}

/// A remote step runs under the file's settings for the event it processes, picked as an
/// in-process worker picks it: the first signal in the machine's inbox order, which the
/// task's inbox is handed in. Here `hello` (5 attempts) overtakes an earlier `other` under
/// `inbox_order = "priority"`, so its failure is retried, where the machine's single
/// attempt would dead-letter it; a step that processes `other` gets the machine's.
#[test]
fn a_remote_failure_is_retried_under_the_settings_of_the_event_it_processed() {
    let config = "[machines.greeter]\ninbox_order = \"priority\"\n\
                  [machines.greeter.queue]\nretry = { max_attempts = 1 }\n\
                  [machines.greeter.events.hello.queue]\n\
                  retry = { max_attempts = 5, initial_delay = \"1s\" }\n";
    for (name, s) in servers(
        "a_remote_failure_is_retried_under_the_settings_of_the_event_it_processed",
        Some(config),
    ) {
        let ns = "/v1/namespaces/default";
        let send = |id: i64, event: &str, priority: &str| {
            let (code, sent) = s.post(
                &format!("{ns}/events"),
                &format!(r#"{{"instance":{id},"event":"{event}"{priority}}}"#),
            );
            assert_eq!(code, 202, "{name}: {sent}");
            sent["signal"].as_i64().unwrap()
        };
        let fail = |task: &Value, seen: &[i64]| {
            let (id, token) = (task["id"].as_i64().unwrap(), task["token"].as_i64().unwrap());
            s.post(
                &format!("/v1/worker/tasks/{id}/fail"),
                &format!(
                    r#"{{"worker":"w","token":{token},"error":"upstream down","seen":{seen:?}}}"#
                ),
            )
        };
        for (events, status) in
            [(&["other", "hello"][..], "runnable"), (&["other"][..], "suspended")]
        {
            let (code, a) =
                s.post(&format!("{ns}/instances"), r#"{"machine":"greeter","at":"greet"}"#);
            assert_eq!(code, 201, "{name}: {a}");
            let id = a["id"].as_i64().unwrap();
            let sent: Vec<i64> = events
                .iter()
                .map(|e| send(id, e, if *e == "hello" { r#","priority":"critical""# } else { "" }))
                .collect();
            let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("greeter", 30_000));
            assert_eq!((code, task["id"].as_i64()), (200, Some(id)), "{name}: {task}");
            let handed: Vec<&str> = task["inbox"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["name"].as_str().unwrap())
                .collect();
            let mut ordered = events.to_vec();
            ordered.reverse();
            assert_eq!(handed, ordered, "{name}: the urgent event first: {task}");
            let (code, answer) = fail(&task, &sent);
            assert_eq!(
                (code, answer["status"].as_str()),
                (200, Some(status)),
                "{name} {events:?}: {answer}"
            );
        }
    }
}

/// An event's own `dead_letter = { enabled = false }` applies to a remote step processing
/// it: its last failure fails the instance, with no dead letter.
#[test]
fn a_remote_failure_follows_its_events_dead_letter_setting() {
    let config = "[machines.greeter.queue]\nretry = { max_attempts = 1 }\n\
                  [machines.greeter.events.hello.queue]\ndead_letter = { enabled = false }\n";
    for (name, s) in
        servers("a_remote_failure_follows_its_events_dead_letter_setting", Some(config))
    {
        let ns = "/v1/namespaces/default";
        let (code, a) = s.post(&format!("{ns}/instances"), r#"{"machine":"greeter","at":"greet"}"#);
        assert_eq!(code, 201, "{name}: {a}");
        let id = a["id"].as_i64().unwrap();
        let (code, sent) =
            s.post(&format!("{ns}/events"), &format!(r#"{{"instance":{id},"event":"hello"}}"#));
        assert_eq!(code, 202, "{name}: {sent}");
        let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("greeter", 30_000));
        assert_eq!(code, 200, "{name}: {task}");
        let token = task["token"].as_i64().unwrap();
        // Without `seen`: the inbox as it stands, whose first signal is the event.
        let (code, answer) = s.post(
            &format!("/v1/worker/tasks/{id}/fail"),
            &format!(r#"{{"worker":"w","token":{token},"error":"no","retryable":false}}"#),
        );
        assert_eq!((code, answer["status"].as_str()), (200, Some("failed")), "{name}: {answer}");
        let (_, letters) = s.get_json(&format!("{ns}/dead-letters"));
        assert_eq!(letters["dead_letters"], json!([]), "{name}: {letters}");
    }
}

/// A step result the store refuses for good (here: it would bring the instance's unique
/// key back into scope while another instance holds it) fails the step, as it does
/// in-process, with the store's message; the worker is told so with 422, not told its
/// lease is gone while it still holds it.
#[test]
fn a_result_the_store_refuses_fails_the_step_with_the_stores_message() {
    use keel::{MachineRef, NewInstance, Status, StatusSet};
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (name, s) in
        servers("a_result_the_store_refuses_fails_the_step_with_the_stores_message", None)
    {
        let keel = s.keel(&rt);
        let keyed = NewInstance::new(MachineRef::new("keyed", 1), "run")
            .unique(b"k".to_vec(), StatusSet::of(&[Status::Runnable, Status::AwaitingSignal]));
        let a = rt.block_on(keel.start(keyed)).unwrap().id();
        let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("keyed", 30_000));
        assert_eq!((code, task["id"].as_i64()), (200, Some(a.0)), "{name}: {task}");
        // While `a` executes its key is free, and another instance takes it.
        let holder = NewInstance::new(MachineRef::new("holder", 1), "run")
            .unique(b"k".to_vec(), StatusSet::of(&[Status::Runnable]));
        rt.block_on(keel.start(holder)).unwrap().id();
        let token = task["token"].as_i64().unwrap();
        let (code, answer) = s.post(
            &format!("/v1/worker/tasks/{}/complete", a.0),
            &format!(r#"{{"worker":"w","token":{token},"outcome":{{"type":"await","signal":"go","context":{{}}}}}}"#),
        );
        assert_eq!((code, answer["status"].as_str()), (422, Some("suspended")), "{name}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.starts_with("the store refused the step's result: "), "{name}: {error}");
        assert!(error.contains("occupies it"), "{name}: {error}");
        let row = rt.block_on(keel.get(a)).unwrap().instance;
        assert_eq!((row.status, row.lease_owner), (Status::Suspended, None), "{name}");
        let (_, letters) = s.get_json("/v1/namespaces/default/dead-letters");
        let letter = &letters["dead_letters"][0]["letter"];
        assert_eq!(letter["reason"], "non_retryable", "{name}: {letters}");
        assert!(letter["errors"].to_string().contains("occupies it"), "{name}: {letters}");
    }
}

/// A task whose leases used up its attempts is failed at the poll; when the store refuses
/// every suspension of it (its unique key, back in scope when suspended, is held by
/// another instance), the instance fails with the store's message instead of coming back
/// after every lease.
#[test]
fn a_used_up_task_the_store_cannot_suspend_fails_rather_than_coming_back() {
    use keel::{MachineRef, NewInstance, Status, StatusSet};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = "[queue.retry]\nmax_attempts = 2\n";
    for (name, s) in servers(
        "a_used_up_task_the_store_cannot_suspend_fails_rather_than_coming_back",
        Some(config),
    ) {
        let keel = s.keel(&rt);
        let crashy = NewInstance::new(MachineRef::new("crashy", 1), "call")
            .unique(b"k".to_vec(), StatusSet::of(&[Status::Suspended]));
        let a = rt.block_on(keel.start(crashy)).unwrap().id();
        for attempt in 0..2 {
            let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("crashy", 100));
            assert_eq!((code, task["attempt"].as_i64()), (200, Some(attempt)), "{name}: {task}");
            std::thread::sleep(Duration::from_millis(250));
        }
        let holder = NewInstance::new(MachineRef::new("holder", 1), "run")
            .unique(b"k".to_vec(), StatusSet::of(&[Status::Runnable]));
        rt.block_on(keel.start(holder)).unwrap();
        let (code, task) = s.post("/v1/worker/tasks/poll", &poll_for("crashy", 100));
        assert_eq!(code, 204, "{name}: the task was handed out again: {task}");
        let row = rt.block_on(keel.get(a)).unwrap().instance;
        assert_eq!(row.status, Status::Failed, "{name}: {row:?}");
        let error = row.last_error.unwrap_or_default();
        assert!(error.contains("its lease expired 2 times"), "{name}: {error}");
        assert!(error.contains("occupies it"), "{name}: {error}");
    }
}

/// A body is one JSON document: anything but whitespace after it (garbage, or a second
/// document) is a 400 naming `body`, nothing done; trailing whitespace is fine.
#[test]
fn a_body_with_data_after_its_document_is_refused_naming_body() {
    for (name, s) in servers("a_body_with_data_after_its_document_is_refused_naming_body", None) {
        let ns = "/v1/namespaces/default/instances";
        let start = r#"{"machine":"echo","at":"run"}"#;
        let poll =
            r#"{"worker":"w","namespace":"default","machines":[{"name":"echo","version":1}]}"#;
        for (path, body) in [
            (ns, format!("{start} garbage")),
            (ns, format!("{start}{start}")),
            ("/v1/worker/tasks/poll", format!("{poll} {poll}")),
        ] {
            let (code, answer) = s.post(path, &body);
            assert_eq!(code, 400, "{name}: {path} {body}: {answer}");
            assert_eq!(answer["field"], "body", "{name}: {path} {body}: {answer}");
        }
        let (_, list) = s.get_json("/v1/namespaces/default/machines/echo/instances");
        assert_eq!(list["instances"], json!([]), "{name}: nothing was started: {list}");
        let (code, answer) = s.post(ns, &format!("{start} \n"));
        assert_eq!(code, 201, "{name}: {answer}");
    }
}

/// A heartbeat for a task that does not exist is 404, as `complete` and `fail` answer,
/// not the 409 of a lease that is no longer the worker's.
#[test]
fn a_heartbeat_for_a_task_that_does_not_exist_is_not_found() {
    for (name, s) in servers("a_heartbeat_for_a_task_that_does_not_exist_is_not_found", None) {
        let body = r#"{"worker":"w","token":1,"lease_ms":1000}"#;
        let (code, answer) = s.post("/v1/worker/tasks/999999/heartbeat", body);
        assert_eq!(code, 404, "{name}: {answer}");
        let (code, answer) = s.post(
            "/v1/worker/tasks/999999/complete",
            r#"{"worker":"w","token":1,"outcome":{"type":"done","result":{}}}"#,
        );
        assert_eq!(code, 404, "{name}: {answer}");
        // A task that exists but whose lease is not the worker's is still 409.
        let (code, a) =
            s.post("/v1/namespaces/default/instances", r#"{"machine":"echo","at":"run"}"#);
        assert_eq!(code, 201, "{name}: {a}");
        let id = a["id"].as_i64().unwrap();
        let (code, answer) = s.post(&format!("/v1/worker/tasks/{id}/heartbeat"), body);
        assert_eq!(code, 409, "{name}: {answer}");
    }
}
