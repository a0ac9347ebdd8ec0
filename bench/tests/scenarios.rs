//! The benchmark binary as a user runs it: several scenarios named in one run.

use std::process::Command;

/// `http` and `ui` both serve `keel serve`'s router, whose metrics need the process's one
/// recorder: named together, both run and both write their results.
#[test]
fn http_and_ui_run_in_one_process() {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-http-ui");
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new(env!("CARGO_BIN_EXE_keel-bench"))
        .args(["http", "ui", "--store", "memory", "--http-events", "64"])
        .args(["--http-steps", "16", "--ui-instances", "200", "--out"])
        .arg(&out)
        .output()
        .expect("keel-bench starts");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "keel-bench http ui failed:\n{stderr}");
    for report in ["http-memory.json", "ui-memory.json"] {
        let path = out.join(report);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{} not written: {e}\n{stderr}", path.display()));
        let json: serde_json::Value = serde_json::from_str(&text).expect("the report is JSON");
        assert!(
            json["results"].as_array().is_some_and(|rows| !rows.is_empty()),
            "{report} has no rows: {text}"
        );
    }
}
