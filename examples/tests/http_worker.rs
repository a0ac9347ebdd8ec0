//! The Python worker (`examples/http-worker/worker.py`) against a scripted stand-in for
//! `keel serve`'s worker protocol: `--tasks N` serves N tasks however many polls came back
//! empty along the way, gives up only after 100 empty polls in a row, and waits as long as
//! a 429's `retry-after` says (the header in lower case, as the server sends it).
//! `keel serve` itself runs the worker in `cli/tests/serve.rs`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the stand-in answers to the n-th poll (from 0).
type Script = fn(usize) -> Reply;

enum Reply {
    Task,
    Empty,
    Busy,
}

/// A server on a loopback port answering polls by `script` and every complete with 200;
/// returns its base URL and the instants the polls came in.
fn serve(script: Script) -> (String, Arc<Mutex<Vec<Instant>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let polls = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&polls);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            answer(stream, script, &seen);
        }
    });
    (base, polls)
}

fn answer(mut stream: TcpStream, script: Script, polls: &Mutex<Vec<Instant>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    reader.read_line(&mut request_line).unwrap();
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let (status, headers, body) = if request_line.contains("/v1/worker/tasks/poll") {
        let n = {
            let mut polls = polls.lock().unwrap();
            polls.push(Instant::now());
            polls.len() - 1
        };
        match script(n) {
            Reply::Task => (
                "200 OK",
                "",
                format!(
                    r#"{{"id":{},"token":1,"step":"greet","context":{{"name":"n{n}"}},"inbox":[]}}"#,
                    n + 1
                ),
            ),
            Reply::Empty => ("204 No Content", "", String::new()),
            Reply::Busy => (
                "429 Too Many Requests",
                "retry-after: 0\r\n",
                r#"{"error":"too many waiting polls"}"#.to_owned(),
            ),
        }
    } else {
        ("200 OK", "", r#"{"ok":true}"#.to_owned())
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\n{headers}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn worker(base: &str, tasks: usize) -> Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/http-worker/worker.py");
    Command::new("python3")
        .args([script, "--base", base, "--tasks", &tasks.to_string(), "--wait-ms", "0"])
        .output()
        .expect("python3 runs the example worker")
}

fn task_lines(out: &Output) -> usize {
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with(r#"{"task""#)).count()
}

#[test]
fn tasks_n_serves_n_tasks_past_a_hundred_polls() {
    // A task on every poll but every third, which comes back empty: 150 tasks take 224
    // polls, 74 of them empty, never two empty in a row.
    let (base, polls) = serve(|n| if n % 3 == 2 { Reply::Empty } else { Reply::Task });
    let out = worker(&base, 150);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(task_lines(&out), 150, "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(polls.lock().unwrap().len(), 224);
}

#[test]
fn a_worker_that_never_gets_a_task_gives_up_after_a_hundred_empty_polls() {
    let (base, polls) = serve(|_| Reply::Empty);
    let out = worker(&base, 1);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("no task after 100 empty polls"), "{stdout}");
    assert_eq!(polls.lock().unwrap().len(), 100);
}

#[test]
fn a_busy_server_is_polled_again_after_its_retry_after() {
    // Three 429s saying `retry-after: 0`, then a task: the worker polls again at once
    // each time (a worker that missed the header waits its default second).
    let (base, polls) = serve(|n| if n < 3 { Reply::Busy } else { Reply::Task });
    let out = worker(&base, 1);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(task_lines(&out), 1);
    let polls = polls.lock().unwrap();
    assert_eq!(polls.len(), 4);
    for pair in polls.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap.as_millis() < 800, "polled again after {gap:?}, not at once");
    }
}
