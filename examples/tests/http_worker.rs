//! The Python worker (`examples/http-worker/worker.py`) against a scripted stand-in for
//! `keel serve`'s worker protocol: `--tasks N` serves N tasks however many polls came back
//! empty along the way, gives up only after 100 empty polls in a row, waits as long as a
//! 429's `retry-after` says (the header in lower case, as the server sends it), tries a
//! poll or a complete again when no answer or a 503 comes, heartbeats about every third of
//! its lease and drops a task whose lease is lost, and sends its bearer token.
//! `keel serve` itself runs the worker in `cli/tests/serve.rs`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the stand-in answers to the n-th call (from 0) of each kind.
#[derive(Clone, Copy)]
struct Script {
    poll: fn(usize) -> Reply,
    heartbeat: fn(usize) -> Reply,
    complete: fn(usize) -> Reply,
}

impl Script {
    /// Polls answered by `poll`; every heartbeat and complete with 200.
    fn polls(poll: fn(usize) -> Reply) -> Self {
        Self { poll, heartbeat: |_| Reply::Status(200), complete: |_| Reply::Status(200) }
    }
}

enum Reply {
    /// A task, numbered from the poll.
    Task,
    Empty,
    Busy,
    /// The connection closed without an answer, as by a server that restarts.
    Hangup,
    /// A JSON answer with this status.
    Status(u16),
    /// A proxy's error page: a 502 whose body is HTML.
    ProxyPage,
}

/// One request the stand-in took: when, its request line, its headers (names in lower
/// case).
struct Request {
    at: Instant,
    line: String,
    headers: Vec<(String, String)>,
}

type Log = Arc<Mutex<Vec<Request>>>;

/// A server on a loopback port answering by `script`; returns its base URL and the log
/// of the requests it took.
fn serve(script: Script) -> (String, Log) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let log = Log::default();
    let seen = Arc::clone(&log);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            answer(stream, script, &seen);
        }
    });
    (base, log)
}

/// The instants of the requests whose line holds `path`.
fn calls(log: &Log, path: &str) -> Vec<Instant> {
    log.lock().unwrap().iter().filter(|r| r.line.contains(path)).map(|r| r.at).collect()
}

fn answer(mut stream: TcpStream, script: Script, log: &Mutex<Vec<Request>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    reader.read_line(&mut request_line).unwrap();
    let mut length = 0;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim().to_owned());
            if name == "content-length" {
                length = value.parse().unwrap();
            }
            headers.push((name, value));
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let (kind, script): (&str, fn(usize) -> Reply) = if request_line.contains("/poll") {
        ("/poll", script.poll)
    } else if request_line.contains("/heartbeat") {
        ("/heartbeat", script.heartbeat)
    } else {
        ("/complete", script.complete)
    };
    let n = {
        let mut log = log.lock().unwrap();
        let n = log.iter().filter(|r| r.line.contains(kind)).count();
        log.push(Request { at: Instant::now(), line: request_line.clone(), headers });
        n
    };
    let (status, headers, body) = match script(n) {
        Reply::Task => (
            "200 OK".to_owned(),
            "",
            format!(
                r#"{{"id":{},"token":1,"step":"greet","context":{{"name":"n{n}"}},"inbox":[]}}"#,
                n + 1
            ),
        ),
        Reply::Empty => ("204 No Content".to_owned(), "", String::new()),
        Reply::Busy => (
            "429 Too Many Requests".to_owned(),
            "retry-after: 0\r\n",
            r#"{"error":"too many waiting polls"}"#.to_owned(),
        ),
        Reply::Hangup => return,
        Reply::Status(200) => ("200 OK".to_owned(), "", r#"{"id":1,"status":"done"}"#.to_owned()),
        Reply::Status(code) => {
            (format!("{code} Scripted"), "", r#"{"error":"scripted"}"#.to_owned())
        }
        Reply::ProxyPage => (
            "502 Bad Gateway".to_owned(),
            "",
            "<html><body>502 Bad Gateway</body></html>".to_owned(),
        ),
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\n{headers}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn worker(base: &str, tasks: usize) -> Output {
    worker_with(base, tasks, &[], None)
}

/// The worker with extra arguments, and `KEEL_TOKEN` set to `token` (or unset).
fn worker_with(base: &str, tasks: usize, args: &[&str], token: Option<&str>) -> Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/http-worker/worker.py");
    let mut command = Command::new("python3");
    command
        .args([script, "--base", base, "--tasks", &tasks.to_string(), "--wait-ms", "0"])
        .args(args)
        .env_remove("KEEL_TOKEN");
    if let Some(token) = token {
        command.env("KEEL_TOKEN", token);
    }
    command.output().expect("python3 runs the example worker")
}

/// The JSON lines of finished tasks.
fn task_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with(r#"{"task""#))
        .map(str::to_owned)
        .collect()
}

#[test]
fn tasks_n_serves_n_tasks_past_a_hundred_polls() {
    // A task on every poll but every third, which comes back empty: 150 tasks take 224
    // polls, 74 of them empty, never two empty in a row.
    let (base, log) = serve(Script::polls(|n| if n % 3 == 2 { Reply::Empty } else { Reply::Task }));
    let out = worker(&base, 150);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(task_lines(&out).len(), 150, "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(calls(&log, "/poll").len(), 224);
}

#[test]
fn a_worker_that_never_gets_a_task_gives_up_after_a_hundred_empty_polls() {
    let (base, log) = serve(Script::polls(|_| Reply::Empty));
    let out = worker(&base, 1);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("no task after 100 empty polls"), "{stdout}");
    assert_eq!(calls(&log, "/poll").len(), 100);
}

#[test]
fn a_busy_server_is_polled_again_after_its_retry_after() {
    // Three 429s saying `retry-after: 0`, then a task: the worker polls again at once
    // each time (a worker that missed the header waits its default second).
    let (base, log) = serve(Script::polls(|n| if n < 3 { Reply::Busy } else { Reply::Task }));
    let out = worker(&base, 1);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(task_lines(&out).len(), 1);
    let polls = calls(&log, "/poll");
    assert_eq!(polls.len(), 4);
    for pair in polls.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap.as_millis() < 800, "polled again after {gap:?}, not at once");
    }
}

#[test]
fn a_poll_without_an_answer_or_with_a_proxy_page_is_tried_again() {
    // The connection closes unanswered (a server restarting), then a proxy's HTML 502,
    // then a task: the worker waits a little each time and serves the task.
    let script = Script::polls(|n| match n {
        0 => Reply::Hangup,
        1 => Reply::ProxyPage,
        _ => Reply::Task,
    });
    let (base, log) = serve(script);
    let out = worker(&base, 1);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(task_lines(&out).len(), 1, "{out:?}");
    assert_eq!(calls(&log, "/poll").len(), 3);
}

#[test]
fn a_503_on_complete_is_sent_again_until_it_is_taken() {
    // The store is out of reach twice: the lease is still the worker's, so it completes
    // again (after a backoff) rather than dropping the result.
    let script = Script {
        complete: |n| if n < 2 { Reply::Status(503) } else { Reply::Status(200) },
        ..Script::polls(|_| Reply::Task)
    };
    let (base, log) = serve(script);
    let out = worker(&base, 1);
    assert!(out.status.success(), "{out:?}");
    let lines = task_lines(&out);
    assert_eq!(lines.len(), 1, "{out:?}");
    assert!(lines[0].contains(r#""status": 200"#), "{lines:?}");
    assert_eq!(calls(&log, "/complete").len(), 3);
    assert_eq!(calls(&log, "/poll").len(), 1);
}

#[test]
fn a_result_not_confirmed_before_the_lease_ends_is_an_error_and_fails_the_run() {
    // Two 503s use up a 600 ms lease (the next backoff would outlast it): nothing said the
    // result landed, so the worker says so, serves the next task, and exits with status 1.
    let script = Script {
        complete: |n| if n < 2 { Reply::Status(503) } else { Reply::Status(200) },
        ..Script::polls(|_| Reply::Task)
    };
    let (base, log) = serve(script);
    let out = worker_with(&base, 2, &["--lease-ms", "600"], None);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(r#"{"error": "result not confirmed", "task": 1"#), "{stdout}");
    let lines = task_lines(&out);
    assert_eq!(lines.len(), 1, "{stdout}");
    assert!(lines[0].contains(r#""task": 2"#) && lines[0].contains(r#""status": 200"#));
    assert_eq!(calls(&log, "/complete").len(), 3);
    assert_eq!(calls(&log, "/poll").len(), 2);
}

#[test]
fn a_401_ends_the_worker_with_the_reason() {
    let (base, log) = serve(Script::polls(|_| Reply::Status(401)));
    let out = worker(&base, 1);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("poll failed") && stdout.contains("401"), "{stdout}");
    assert_eq!(calls(&log, "/poll").len(), 1);
}

#[test]
fn the_token_is_sent_as_a_bearer_on_every_call() {
    let bearer = |log: &Log| -> Vec<Option<String>> {
        log.lock()
            .unwrap()
            .iter()
            .map(|r| {
                r.headers.iter().find(|(name, _)| name == "authorization").map(|h| h.1.clone())
            })
            .collect()
    };
    // From `KEEL_TOKEN`, on the poll and the complete.
    let (base, log) = serve(Script::polls(|_| Reply::Task));
    let out = worker_with(&base, 1, &[], Some("from-env"));
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        bearer(&log),
        [Some("Bearer from-env".to_owned()), Some("Bearer from-env".to_owned())]
    );
    // `--token` wins over the environment, and reaches heartbeats too.
    let (base, log) = serve(Script::polls(|_| Reply::Task));
    let args = ["--token", "from-flag", "--lease-ms", "300", "--pause-ms", "250", "--heartbeat"];
    let out = worker_with(&base, 1, &args, Some("from-env"));
    assert!(out.status.success(), "{out:?}");
    let sent = bearer(&log);
    assert!(!calls(&log, "/heartbeat").is_empty(), "{sent:?}");
    assert!(sent.iter().all(|b| b.as_deref() == Some("Bearer from-flag")), "{sent:?}");
    // Without either, no header.
    let (base, log) = serve(Script::polls(|_| Reply::Task));
    let out = worker_with(&base, 1, &[], None);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(bearer(&log), [None, None]);
}

#[test]
fn heartbeats_come_every_third_of_the_lease_not_every_tick() {
    // A 1.5 s pause under a 1.5 s lease: a heartbeat at about 0.5 s and 1 s (and maybe
    // one just at the end), where one a tick would be 15.
    let (base, log) = serve(Script::polls(|_| Reply::Task));
    let args = ["--lease-ms", "1500", "--pause-ms", "1500", "--heartbeat"];
    let out = worker_with(&base, 1, &args, None);
    assert!(out.status.success(), "{out:?}");
    let beats = calls(&log, "/heartbeat").len();
    assert!((2..=3).contains(&beats), "{beats} heartbeats");
    assert_eq!(calls(&log, "/complete").len(), 1);
}

#[test]
fn a_409_on_a_heartbeat_drops_the_task_without_completing_it() {
    let script = Script { heartbeat: |_| Reply::Status(409), ..Script::polls(|_| Reply::Task) };
    let (base, log) = serve(script);
    let args = ["--lease-ms", "300", "--pause-ms", "1000", "--heartbeat"];
    let out = worker_with(&base, 1, &args, None);
    assert!(out.status.success(), "{out:?}");
    let lines = task_lines(&out);
    assert_eq!(lines.len(), 1, "{out:?}");
    assert!(lines[0].contains(r#""status": 409"#), "{lines:?}");
    assert_eq!(calls(&log, "/heartbeat").len(), 1);
    assert_eq!(calls(&log, "/complete").len(), 0, "the lost task's step ran to completion");
}
