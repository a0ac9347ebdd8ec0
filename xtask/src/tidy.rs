//! `cargo xtask tidy`: the rules we can check by code, each with its reason.
//!
//! 1. keel-core's normal dependencies contain no runtime, database or network crate — the
//!    core is pure (ARCHITECTURE invariant 1).
//! 2. No crate under `store-*` or `queue-*` depends on `keel-scheduler` — backends depend
//!    on the core only (invariant 2).
//! 3. Every Rust file starts with a `//!` doc comment — a reader opening any file learns
//!    what it is for.
//! 4. No `#[ignore]` without a reason naming a tracking issue — an ignored failure is a
//!    hidden failure.
//! 5. Stores read and write; the core decides. The store crates and `MemoryStore` neither
//!    call nor import the core's decision functions (the ones the planners are built
//!    from): they call a `keel_core::plan` planner and execute its plan, so that a rule
//!    changes in one place for every backend.
//! 6. Code, rustdoc and the project's Markdown never cite the design notes the project was
//!    planned from (files outside this repository, their section numbers or reference
//!    documents): a reader of Keel cannot follow such a citation, so the rule is said in
//!    our own words where it applies.
//! 7. The example programs (the files directly under `examples/`, except the crash-test
//!    worker, which drives stores below the facade on purpose) name Keel only through the
//!    `keel` crate: a user copies them into a project whose one dependency is `keel`.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Crate name prefixes that must never appear in keel-core's normal dependency tree.
pub const FORBIDDEN_IN_CORE: &[&str] = &[
    "tokio",
    "postgres",
    "tokio-postgres",
    "deadpool",
    "redis",
    "aws-",
    "sqlx",
    "hyper",
    "reqwest",
    "mio",
    "async-std",
    "smol",
    "axum",
    "rusqlite",
    "libsqlite3",
];

/// The core decision functions a store must not call, each with the planner that makes
/// that decision for it. Only functions no store needs any more are listed: a store that
/// calls one of them is deciding semantics itself.
pub const DECISIONS: &[(&str, &str, &str)] = &[
    ("outcome", "apply", "plan::commit"),
    ("outcome", "validate_commit", "plan::commit"),
    ("outcome", "status_after", "plan::commit"),
    ("outcome", "signal_matches", "plan::commit or plan::deliver"),
    ("outcome", "release_parent", "plan::parent::release, with the release a plan carries"),
    ("outcome", "parent_notice", "the release a commit or cancel plan carries (plan::parent)"),
    ("outcome", "cancel", "plan::cancel"),
    ("outcome", "reap", "plan::lease"),
    ("outcome", "reap_history", "plan::lease"),
    ("outcome", "lease_expired", "plan::lease"),
    ("outcome", "release", "plan::lease"),
    ("outcome", "deliver", "plan::deliver"),
    ("outcome", "claim", "plan::claim::ClaimPlanner"),
    ("outcome", "claimable", "plan::claim::ClaimPlanner"),
    ("outcome", "undecodable_row", "plan::claim::undecodable"),
    ("outcome", "dead_letter_retry", "plan::dead_letter"),
    ("timers", "fire", "plan::timer"),
    ("timers", "delivers", "plan::timer"),
    ("timers", "owned_by", "plan::commit::TimerPlan::cancels"),
    ("timers", "cancelled", "plan::commit::TimerPlan::cancels or InboxRead::with_fires"),
    ("timers", "fire_owner", "plan::commit::UnreadFire::of"),
    ("inbox", "drained", "plan::commit or plan::cancel"),
    ("inbox", "accepts_signals", "plan::deliver"),
];

/// Citations of material outside the repository that a reader cannot follow (rule 6).
/// Each is spelled in two pieces so that this file does not cite them itself; it is still
/// the one file not checked, since its tests must write a citation to find one.
pub const OUTSIDE_CITATIONS: &[&str] = &[
    concat!("DESIGN", " §"),
    concat!("DESIGN", ".md"),
    concat!("seed", " 00"),
    concat!("..", "/shared/"),
];

/// Runs every check and returns the problems found.
pub fn check(root: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    problems.extend(core_is_pure(&core_tree(root)?));
    problems.extend(backends_skip_scheduler(root)?);
    for file in rust_files(root)? {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let rel = file.strip_prefix(root).unwrap_or(&file).display().to_string();
        problems.extend(doc_comment_first(&rel, &text));
        problems.extend(ignores_have_reasons(&rel, &text));
        if is_store_code(&rel) {
            problems.extend(stores_only_plan(&rel, &text));
        }
        if rel.replace('\\', "/") != "xtask/src/tidy.rs" {
            problems.extend(cites_outside(&rel, &text));
        }
        if is_example_program(&rel) {
            problems.extend(examples_use_the_facade(&rel, &text));
        }
    }
    for doc in ["README.md", "ARCHITECTURE.md"] {
        let text =
            std::fs::read_to_string(root.join(doc)).with_context(|| format!("reading {doc}"))?;
        problems.extend(cites_outside(doc, &text));
    }
    Ok(problems)
}

/// Prints problems and fails when there are any.
pub fn report(problems: &[String]) -> Result<()> {
    if problems.is_empty() {
        eprintln!("tidy: ok");
        return Ok(());
    }
    for p in problems {
        eprintln!("tidy: {p}");
    }
    bail!("tidy found {} problem(s)", problems.len())
}

fn core_tree(root: &Path) -> Result<String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root)
        .args(["tree", "-p", "keel-core", "-e", "normal", "--prefix", "none", "--format", "{p}"])
        .output()
        .context("running cargo tree")?;
    if !out.status.success() {
        bail!("cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Rule 1, on the output of `cargo tree --prefix none --format {p}` (one `name vX` a line).
pub fn core_is_pure(tree: &str) -> Vec<String> {
    let mut problems: Vec<String> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| FORBIDDEN_IN_CORE.iter().any(|f| name == f || (f.ends_with('-') && name.starts_with(f)) || name.starts_with(&format!("{f}-"))))
        .map(|name| format!("keel-core depends on `{name}` (normal dependencies); the core must stay free of runtimes, databases and networks — move that code to a backend or the scheduler"))
        .collect();
    problems.sort();
    problems.dedup();
    problems
}

fn backends_skip_scheduler(root: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    for entry in std::fs::read_dir(root)? {
        let dir = entry?.path();
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        let manifest = dir.join("Cargo.toml");
        if !(name.starts_with("store-") || name.starts_with("queue-")) || !manifest.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&manifest)?;
        problems.extend(manifest_avoids(&format!("{name}/Cargo.toml"), &text, "keel-scheduler")?);
    }
    Ok(problems)
}

/// Rule 2 on one manifest: `forbidden` appears in no dependency table.
pub fn manifest_avoids(label: &str, manifest: &str, forbidden: &str) -> Result<Vec<String>> {
    let doc: toml::Table = toml::from_str(manifest).with_context(|| format!("parsing {label}"))?;
    let mut problems = Vec::new();
    for table in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if doc.get(table).and_then(|t| t.as_table()).is_some_and(|t| t.contains_key(forbidden)) {
            problems.push(format!(
                "{label} has `{forbidden}` in [{table}]; backends depend on keel-core only"
            ));
        }
    }
    Ok(problems)
}

fn rust_files(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if path.is_dir() {
                if !(name.starts_with('.') || name == "target") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Rule 3: the first non-blank line is a `//!` comment.
pub fn doc_comment_first(label: &str, text: &str) -> Option<String> {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or_default();
    (!first.trim_start().starts_with("//!")).then(|| {
        format!("{label}: does not start with a `//!` doc comment saying what the file is for")
    })
}

/// Rule 4: every `#[ignore` carries a reason that names a tracking issue (`#N`).
pub fn ignores_have_reasons(label: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.trim_start().starts_with("#[ignore"))
        .filter(|(_, l)| !(l.contains("= \"") && l.contains('#') && l.matches('#').count() >= 2))
        .map(|(i, _)| format!("{label}:{}: `#[ignore]` without a reason naming a tracking issue (`#[ignore = \"flaky, see #12\"]`)", i + 1))
        .collect()
}

/// Rule 6: lines citing material outside the repository ([`OUTSIDE_CITATIONS`]), in any
/// letter case, so a capitalised citation is caught as well as a lower-case one.
pub fn cites_outside(label: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let line = l.to_lowercase();
            let cited = OUTSIDE_CITATIONS.iter().find(|c| line.contains(&c.to_lowercase()))?;
            Some(format!(
                "{label}:{}: cites `{cited}`, which is outside this repository; say the rule in our own words",
                i + 1
            ))
        })
        .collect()
}

/// The crates under the facade, as user code would name them.
pub const INNER_CRATES: &[&str] = &[
    "keel_core",
    "keel_scheduler",
    "keel_testkit",
    "keel_store_sqlite",
    "keel_store_postgres",
    "keel_queue_redis",
    "keel_queue_sqs",
];

/// Whether `rel` (a path from the repository root) is an example program a user copies
/// (rule 7): a file directly under `examples/`, other than the crash-test worker.
pub fn is_example_program(rel: &str) -> bool {
    let rel = rel.replace('\\', "/");
    rel.strip_prefix("examples/").is_some_and(|f| !f.contains('/'))
        && rel != "examples/crash_worker.rs"
}

/// Rule 7: lines of an example program that name a crate under the facade
/// ([`INNER_CRATES`]) instead of `keel`. Comments are skipped.
pub fn examples_use_the_facade(label: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .filter_map(|(i, l)| {
            let inner = INNER_CRATES.iter().find(|c| l.contains(&format!("{c}::")))?;
            Some(format!(
                "{label}:{}: names `{inner}`; an example uses the `keel` crate only (its root, \
                 or `keel::layers::…` for what the root does not re-export)",
                i + 1
            ))
        })
        .collect()
}

/// Whether `rel` (a path from the repository root) is store code: the sources of a
/// `store-*` crate, or `MemoryStore` and its modules.
pub fn is_store_code(rel: &str) -> bool {
    let rel = rel.replace('\\', "/");
    (rel.starts_with("store-") && rel.contains("/src/"))
        || rel == "testkit/src/memory.rs"
        || rel.starts_with("testkit/src/memory/")
}

/// Calls and imports of the core's decision functions ([`DECISIONS`]) in store code,
/// each named with its file, line and the planner to use instead. Comments are skipped:
/// a store may say which rule its SQL mirrors.
pub fn stores_only_plan(label: &str, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    // A `use` statement may span lines: it is checked as a whole, at its first line.
    let mut import: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let code = code.split("//").next().unwrap_or(code);
        if let Some((at, mut statement)) = import.take() {
            statement.push_str(code);
            if statement.contains(';') {
                problems.extend(imported_decisions(label, at, &statement));
            } else {
                import = Some((at, statement));
            }
            continue;
        }
        let bare = code.strip_prefix("pub ").or_else(|| code.strip_prefix("pub(crate) "));
        if let Some(statement) = bare.unwrap_or(code).strip_prefix("use ") {
            if statement.contains(';') {
                problems.extend(imported_decisions(label, i + 1, statement));
            } else {
                import = Some((i + 1, statement.to_owned()));
            }
            continue;
        }
        for (module, name, planner) in DECISIONS {
            let call = format!("{module}::{name}(");
            let called = code
                .match_indices(&call)
                .any(|(at, _)| !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_'));
            if called {
                problems.push(decision_problem(label, i + 1, module, name, planner));
            }
        }
    }
    problems
}

fn decision_problem(label: &str, line: usize, module: &str, name: &str, planner: &str) -> String {
    format!(
        "{label}:{line}: uses the core decision `{module}::{name}`; a store executes a plan instead: use `keel_core::{planner}`"
    )
}

/// The decision functions a `use` statement (the text after `use`) imports.
fn imported_decisions(label: &str, line: usize, statement: &str) -> Vec<String> {
    // `x as y` is kept apart as `x@y` before the whitespace goes.
    let statement = statement.split(';').next().unwrap_or("").split_whitespace();
    let tree: String =
        statement.collect::<Vec<_>>().join(" ").replace(" as ", "@").replace(' ', "");
    let mut problems = Vec::new();
    for path in use_paths(&tree) {
        let path = path.split('@').next().unwrap_or(&path).to_owned();
        let segments: Vec<&str> = path.split("::").collect();
        for (module, name, planner) in DECISIONS {
            if segments.windows(2).any(|w| w[0] == *module && w[1] == *name) {
                problems.push(decision_problem(label, line, module, name, planner));
            }
        }
    }
    problems
}

/// The full paths a use tree names: `a::{b, c::{d, e}}` gives `a::b`, `a::c::d`, `a::c::e`.
/// Whitespace must already be removed.
fn use_paths(tree: &str) -> Vec<String> {
    let Some(open) = tree.find('{') else { return vec![tree.to_owned()] };
    let prefix = &tree[..open];
    let inner = tree[open + 1..].strip_suffix('}').unwrap_or(&tree[open + 1..]);
    let (mut depth, mut start, mut out) = (0usize, 0usize, Vec::new());
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.extend(use_paths(&inner[start..i]).into_iter().map(|p| format!("{prefix}{p}")));
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < inner.len() {
        out.extend(use_paths(&inner[start..]).into_iter().map(|p| format!("{prefix}{p}")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tidy() {
        let problems = check(&crate::project_root()).expect("tidy runs");
        assert!(problems.is_empty(), "tidy problems:\n{}", problems.join("\n"));
    }

    #[test]
    fn core_purity_flags_runtime_database_and_network_crates() {
        let tree = "keel-core v0.1.0\nserde v1.0.0\ntokio v1.40.0\ntokio-macros v2.0.0\naws-sdk-sqs v1.0.0\nsqlx-core v0.9.0\nserde_json v1.0.0\n";
        let mut flagged: Vec<String> =
            core_is_pure(tree).iter().map(|p| p.split('`').nth(1).unwrap().to_owned()).collect();
        flagged.sort();
        assert_eq!(flagged, ["aws-sdk-sqs", "sqlx-core", "tokio", "tokio-macros"]);
        assert!(
            core_is_pure("keel-core v0.1.0\nserde v1\nthiserror v2\nasync-trait v0.1\n").is_empty()
        );
    }

    #[test]
    fn backends_must_not_depend_on_the_scheduler() {
        let bad = "[package]\nname='x'\n[dependencies]\nkeel-core = { path = '../core' }\nkeel-scheduler = { path = '../scheduler' }\n";
        assert_eq!(manifest_avoids("store-x/Cargo.toml", bad, "keel-scheduler").unwrap().len(), 1);
        let good = "[package]\nname='x'\n[dependencies]\nkeel-core = { path = '../core' }\n";
        assert!(manifest_avoids("store-x/Cargo.toml", good, "keel-scheduler").unwrap().is_empty());
    }

    #[test]
    fn files_start_with_a_doc_comment_and_ignores_name_an_issue() {
        assert!(doc_comment_first("a.rs", "\n//! What this is.\nfn f() {}").is_none());
        assert!(doc_comment_first("a.rs", "use x;\n").is_some());
        assert!(doc_comment_first("a.rs", "").is_some());
        assert_eq!(ignores_have_reasons("a.rs", "#[test]\n#[ignore]\nfn t() {}").len(), 1);
        assert_eq!(ignores_have_reasons("a.rs", "#[ignore = \"slow\"]").len(), 1);
        assert!(ignores_have_reasons("a.rs", "#[ignore = \"flaky, see #12\"]").is_empty());
    }

    #[test]
    fn citations_of_outside_notes_are_flagged() {
        let design = OUTSIDE_CITATIONS[0];
        let bad = format!("//! Timers.\n/// Fires a timer ({design}6).\nfn f() {{}}\n");
        let problems = cites_outside("core/src/t.rs", &bad);
        assert_eq!(problems.len(), 1, "{problems:?}");
        let expected = format!("core/src/t.rs:2: cites `{design}`");
        assert!(problems[0].starts_with(&expected), "{}", problems[0]);
        let seed = format!("see {}4 for more", OUTSIDE_CITATIONS[2]);
        assert_eq!(cites_outside("README.md", &seed).len(), 1);
        assert!(cites_outside("a.rs", "//! A simulator seed replays exactly.\n").is_empty());
    }

    #[test]
    fn examples_name_keel_only() {
        assert!(is_example_program("examples/order_chart.rs"));
        assert!(!is_example_program("examples/tests/crash.rs"));
        assert!(!is_example_program("examples/crash_worker.rs"));
        assert!(!is_example_program("keel/src/lib.rs"));
        let bad = "//! An example.\nuse keel_core::config::ParallelConfig;\n// keel_core:: in a comment\n";
        let problems = examples_use_the_facade("examples/x.rs", bad);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("examples/x.rs:2: names `keel_core`"), "{}", problems[0]);
        assert!(examples_use_the_facade("examples/x.rs", "use keel::ParallelConfig;\n").is_empty());
    }

    #[test]
    fn citations_are_found_in_any_letter_case() {
        let seed = OUTSIDE_CITATIONS[2];
        let capital = format!("{}{}", seed[..1].to_uppercase(), &seed[1..]);
        let doc = format!("//! Retries.\n    /// {capital}1 §6.4: 3 attempts.\nfn f() {{}}\n");
        let problems = cites_outside("core/src/retry.rs", &doc);
        assert_eq!(problems.len(), 1, "a capitalised citation is still one: {problems:?}");
        assert!(problems[0].starts_with("core/src/retry.rs:2: cites"), "{}", problems[0]);
        let design = OUTSIDE_CITATIONS[1].to_lowercase();
        assert_eq!(cites_outside("README.md", &format!("see {design}")).len(), 1);
    }

    #[test]
    fn stores_call_planners_not_the_core_decisions() {
        let bad = "//! A store.\nfn f() {\n    let next = outcome::release_parent(&row, now);\n}\n";
        let problems = stores_only_plan("store-x/src/ops.rs", bad);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("store-x/src/ops.rs:3: "), "{}", problems[0]);
        assert!(problems[0].contains("plan::parent::release"), "{}", problems[0]);
        let imported = "use keel_core::timers::{self, fire};\n";
        assert_eq!(stores_only_plan("store-x/src/ops.rs", imported).len(), 1);
        let multi_line = "//! A store.\nuse keel_core::{\n    outcome::{Outcome, apply},\n    timers::TimerRow,\n};\n";
        let problems = stores_only_plan("store-x/src/ops.rs", multi_line);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("store-x/src/ops.rs:2: "), "{}", problems[0]);
        assert!(problems[0].contains("outcome::apply"), "{}", problems[0]);
        let elsewhere =
            "use keel_core::{\n    outcome::Outcome,\n    plan::commit::{self, apply},\n};\n";
        assert!(
            stores_only_plan("store-x/src/ops.rs", elsewhere).is_empty(),
            "a planner's own `apply` is fine"
        );
        let renamed = "use keel_core::outcome::{lease_expired as expired, Outcome as O};\n";
        assert_eq!(stores_only_plan("store-x/src/ops.rs", renamed).len(), 1);
        let good = "/// Mirrors `outcome::release_parent` in SQL.\nlet next = plan::parent::release(&row, now);\nlet c = my_outcome::claim(x);\nuse keel_core::timers::TimerRow;\n";
        assert!(stores_only_plan("store-x/src/ops.rs", good).is_empty());
        assert!(is_store_code("store-sqlite/src/ops.rs"));
        assert!(is_store_code("testkit/src/memory.rs"));
        assert!(is_store_code("testkit/src/memory/tables.rs"));
        assert!(!is_store_code("store-sqlite/tests/files.rs"));
        assert!(!is_store_code("core/src/plan/commit.rs"));
    }
}
