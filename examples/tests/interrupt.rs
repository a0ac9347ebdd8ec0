//! Ctrl-C during the order example loses nothing: the example is interrupted with SIGINT
//! half-way, says it stopped cleanly, and a second run on the same SQLite file, started
//! after the orders' payment deadline has passed, resumes and ends with the full, correct
//! tally.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The order example's binary, built by this test with the same cargo and profile, so it is
/// never stale.
fn order_example() -> PathBuf {
    // Tests run from target/<profile>/deps; examples are built into target/<profile>/examples.
    let exe = std::env::current_exe().expect("test binary path");
    let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "--quiet", "-p", "keel-examples", "--example", "order"]);
    if profile.file_name().is_some_and(|name| name == "release") {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build");
    assert!(status.success(), "building the order example failed");
    let path = profile.join("examples").join("order");
    assert!(path.exists(), "no order example at {}", path.display());
    path
}

/// The example process, killed when dropped so a failing test leaves none behind.
struct Example(Child);

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(exe: &Path, db: &Path) -> Child {
    Command::new(exe)
        .env("KEEL_DEMO_DB", db)
        .env_remove("KEEL_DATABASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the order example")
}

#[test]
fn ctrl_c_during_the_order_example_then_a_rerun_gives_the_full_tally() {
    let exe = order_example();
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");

    // First run: interrupt it once the orders are started and moving.
    let mut first = Example(start(&exe, &db));
    let mut out = BufReader::new(first.0.stdout.take().expect("stdout"));
    let mut seen = String::new();
    let began = Instant::now();
    loop {
        let mut line = String::new();
        let n = out.read_line(&mut line).expect("read the example's output");
        assert!(n > 0, "the example ended before it was interrupted:\n{seen}");
        seen.push_str(&line);
        if line.contains("checked out") {
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(60), "no progress within 60 s:\n{seen}");
    }
    let pid = first.0.id().to_string();
    let status = Command::new("kill").args(["-INT", &pid]).status().expect("run kill");
    assert!(status.success(), "kill -INT {pid} failed");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).expect("read the rest");
    let code = first.0.wait().expect("wait for the example").code();
    assert_eq!(code, Some(130), "an interrupted run exits with 130:\n{seen}{rest}");
    assert!(rest.contains("interrupted: stopped cleanly"), "{seen}{rest}");
    assert!(!rest.contains("final tally"), "interrupted before the end:\n{seen}{rest}");

    // Second run, later than the orders' 5-second payment deadline (a person reruns at
    // their own pace): it resumes from the file and ends with the tally of an
    // uninterrupted run, since nothing a paying order needs was left unsent.
    std::thread::sleep(Duration::from_secs(6));
    let second = start(&exe, &db);
    let output = second.wait_with_output_bounded();
    assert!(output.contains("resuming: 100 of 100 orders were already in the store"), "{output}");
    assert!(
        output.contains(r#"final tally: {"cancelled": 30, "completed": 60, "failed": 10}"#),
        "{output}"
    );
    // The history listing reads as a table: its record counts line up, whatever the
    // event (`parallel.region` is the longest the order chart delivers).
    let rows: Vec<&str> = output.lines().filter(|l| l.starts_with("  rev ")).collect();
    assert!(rows.len() > 1, "a history listing:\n{output}");
    let column = |row: &str| row.find(" records").expect("a record count");
    assert!(rows.iter().any(|row| row.contains("parallel.region")), "{output}");
    assert!(rows.iter().all(|row| column(row) == column(rows[0])), "{}", rows.join("\n"));
}

trait WaitBounded {
    fn wait_with_output_bounded(self) -> String;
}

impl WaitBounded for Child {
    /// Its stdout once it exits successfully; fails the test after 120 s.
    fn wait_with_output_bounded(mut self) -> String {
        let stdout = self.stdout.take().expect("stdout");
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut BufReader::new(stdout), &mut text).map(|_| text)
        });
        let began = Instant::now();
        let status = loop {
            if let Some(status) = self.try_wait().expect("poll the example") {
                break status;
            }
            if began.elapsed() > Duration::from_secs(120) {
                let _ = self.kill();
                panic!("the resumed run did not finish within 120 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let text = reader.join().expect("reader thread").expect("read stdout");
        assert!(status.success(), "the resumed run failed ({status}):\n{text}");
        text
    }
}
