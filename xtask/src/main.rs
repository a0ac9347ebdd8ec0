//! Project tasks, run as `cargo xtask <task>`:
//!
//! - `test`: the workspace tests with every backend this machine can reach; prints which
//!   backend suites ran and which were skipped (the dashboard's browser test too).
//! - `ci`: what `.ci/run` runs — checks that every backend (and the browser test's
//!   chromium) can be used, then fmt, clippy
//!   (deny warnings), tidy, rustdoc (deny warnings), the tests with `KEEL_REQUIRE_BACKENDS=1`, the `steps`,
//!   `order` and `ticket` examples on fresh SQLite files, `sim_transfer` on 300 seeds and
//!   a minute of fuzzing of the chart loaders; with `--chaos` (or `KEEL_CI_CHAOS=1`) also
//!   a short chaos run on SQLite and PostgreSQL.
//! - `tidy`: the project's checkable style and architecture rules (also a `#[test]`).
//! - `chaos`: faults against real databases (worker kills, server crashes and an outage,
//!   cut commits, a stepped clock) and a checker; see `chaos.rs`.
//! - `json-schema`: rewrites `docs/chart-definition.schema.json` from the chart JSON types
//!   (a `#[test]` fails while the committed file is stale).
//! - `bench`: the benchmarks in release mode (`keel-bench`; its `--help` lists every
//!   option), and `store` for the PostgreSQL store's claim and commit micro-benchmark.
//! - `migrate`: applies the PostgreSQL migrations to a database.

mod chaos;
mod chaos_pg;
mod chaos_proxy;
mod chaos_worker;
mod json_schema;
mod services;
mod tidy;

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const USAGE: &str = "usage: cargo xtask <test|ci [--chaos]|tidy|json-schema|chaos [--minutes N] [--store postgres|sqlite] [--seed S] [--instances N]|bench [steps|chart|timers|parallel|start|http|ui|prune|fairness|store] [--store memory|sqlite|postgres] [--queue redis|sqs] [more: cargo xtask bench --help]|migrate --database-url URL [--schema NAME]>";

/// What each task does, for `cargo xtask --help`.
const TASKS: &str = "\
tasks:
  test         every test on every backend it can reach; says which it skipped
  ci [--chaos] what .ci/run runs: checks services, fmt, clippy, tidy, docs, every test
               with every backend required, the examples; --chaos adds the short chaos runs
  tidy         architecture and style rules checked by code
  json-schema  writes docs/chart-definition.schema.json
  chaos        worker processes killed and PostgreSQL crashed under load, then a checker
  bench        the benchmarks (release build): cargo xtask bench --help
  migrate      applies the PostgreSQL migrations to a database";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = project_root();
    let rest = args.get(1..).unwrap_or_default();
    // Help for every task but `bench`, whose own binary answers `--help`.
    let asks_help = |a: &String| matches!(a.as_str(), "--help" | "-h" | "help");
    if args.first().is_none_or(asks_help)
        || (args.first().is_some_and(|t| t != "bench") && rest.iter().any(asks_help))
    {
        println!("{USAGE}\n{TASKS}");
        return Ok(());
    }
    match args.first().map(String::as_str) {
        Some("test") => {
            refuse_others("test", rest, &[])?;
            test(&root, false)
        }
        Some("ci") => {
            refuse_others("ci", rest, &["--chaos"])?;
            ci(&root, rest.iter().any(|a| a == "--chaos"))
        }
        Some("chaos") => chaos::main(&root, &args[1..]),
        Some("chaos-worker") => chaos_worker::main(&args[1..]),
        Some("bench") => bench(&root, &args[1..]),
        Some("migrate") => migrate(&args[1..]),
        Some("tidy") => {
            refuse_others("tidy", rest, &[])?;
            let problems = tidy::check(&root)?;
            tidy::report(&problems)
        }
        Some("json-schema") => {
            refuse_others("json-schema", rest, &[])?;
            json_schema::write(&root)
        }
        Some(other) => bail!("unknown task {other:?}\n{USAGE}"),
        None => unreachable!("no task prints the help above"),
    }
}

/// An error naming the first of `args` that `task` does not take (a typo such as `--chaso`
/// must not run the task without what was asked for).
fn refuse_others(task: &str, args: &[String], takes: &[&str]) -> Result<()> {
    if let Some(other) = args.iter().find(|a| !takes.contains(&a.as_str())) {
        let takes = if takes.is_empty() { "none".to_owned() } else { takes.join(", ") };
        bail!("cargo xtask {task}: unknown argument {other:?} (it takes: {takes})\n{USAGE}");
    }
    Ok(())
}

/// Gives `cmd` each backend's variable, or removes it when the backend is skipped (a value
/// inherited from the shell would otherwise run a suite the summary calls skipped).
fn backend_env(cmd: &mut Command, backends: &[services::Backend]) {
    for b in backends {
        if let Some(url) = &b.url {
            cmd.env(b.env_var, url);
        } else {
            cmd.env_remove(b.env_var);
        }
    }
}

/// The workspace root (the parent of `xtask/`).
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root);
    cmd
}

fn run(step: &str, mut cmd: Command) -> Result<()> {
    let started = Instant::now();
    eprintln!("==> {step}");
    let status = cmd.status().with_context(|| format!("could not start {step}"))?;
    eprintln!(
        "<== {step}: {} in {:.1}s",
        if status.success() { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    if !status.success() {
        bail!("{step} failed ({status})");
    }
    Ok(())
}

fn test(root: &Path, require: bool) -> Result<()> {
    let backends = services::detect(root, require)?;
    let browser_skipped = services::browser(require)?;
    let mut cmd = cargo(root);
    // Default targets: libraries, binaries, integration tests, examples (built) and doc
    // tests; clippy --all-targets already checks that the benches compile.
    cmd.args(["test", "--workspace"]);
    backend_env(&mut cmd, &backends);
    if require {
        cmd.env("KEEL_REQUIRE_BACKENDS", "1");
    }
    let result = run("cargo test --workspace", cmd);
    services::summary(&backends, browser_skipped.as_deref());
    result?;
    // The suites that exercise wake-ups (parents woken by their children and by join
    // deadlines, and sends, among them), and the crash test, again with a Redis queue in
    // the loop (their harness reads KEEL_TEST_WORKER_QUEUE): same tests, hints carrying
    // the work.
    let Some(redis) = backends.iter().find(|b| b.env_var == "KEEL_TEST_REDIS_URL") else {
        return Ok(());
    };
    let Some(url) = &redis.url else { return Ok(()) };
    let mut cmd = cargo(root);
    cmd.args(["test", "-p", "keel-scheduler"]);
    for suite in [
        "worker",
        "robustness",
        "terminal",
        "timers",
        "chart",
        "same_step",
        "parallel",
        "joins",
        "send",
    ] {
        cmd.args(["--test", suite]);
    }
    let mut crash = cargo(root);
    crash.args(["test", "-p", "keel-examples", "--test", "crash"]);
    for cmd in [&mut cmd, &mut crash] {
        backend_env(cmd, &backends);
        cmd.env("KEEL_TEST_REDIS_URL", url).env("KEEL_TEST_WORKER_QUEUE", "redis");
        if require {
            cmd.env("KEEL_REQUIRE_BACKENDS", "1");
        }
    }
    run("scheduler wake-up suites with a Redis queue in the loop", cmd)?;
    run("crash test with a Redis queue in the loop", crash)
}

/// `cargo xtask migrate --database-url URL [--schema NAME]`: applies Keel's PostgreSQL
/// migrations (the same ones `PgStore::migrate` runs at start-up, under the same lock).
fn migrate(args: &[String]) -> Result<()> {
    let value =
        |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let url = value("--database-url")
        .or_else(|| std::env::var("KEEL_DATABASE_URL").ok())
        .context("--database-url URL (or KEEL_DATABASE_URL) is required")?;
    let schema = value("--schema").unwrap_or_else(|| "keel".to_owned());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let config = keel_store_postgres::PgConfig::new(url).schema(schema.clone());
        let store = keel_store_postgres::PgStore::connect(config).await?;
        store.migrate().await?;
        eprintln!("migrate: schema {schema} is at version {}", keel_store_postgres::SCHEMA_VERSION);
        Ok::<(), keel_core::StoreError>(())
    })?;
    Ok(())
}

/// `cargo xtask bench [steps|chart|timers|store ...] [--store memory|sqlite|postgres] [...]`:
/// the engine benchmarks in release mode (`keel-bench`), and `store` for the Postgres
/// store's claim + commit micro-benchmark. With `store` named, `keel-bench` runs only when
/// a scenario of its own is named too; `--help` only asks `keel-bench` for its help.
fn bench(root: &Path, args: &[String]) -> Result<()> {
    let split = split_bench_args(args);
    // Help is keel-bench's to give, without running anything.
    if split.store && !split.help {
        store_bench(root)?;
        if !split.scenario {
            let rest: Vec<&str> = split.rest.iter().map(String::as_str).collect();
            let store_named = [&["--store", "postgres"][..], &["--store=postgres"][..]];
            if !rest.is_empty() && !store_named.contains(&rest.as_slice()) {
                eprintln!(
                    "bench: the store micro-benchmark takes no options; ignored {} (name a keel-bench scenario to run one with them)",
                    split.rest.join(" ")
                );
            }
            return Ok(());
        }
    }
    let mut cmd = cargo(root);
    cmd.args(["run", "--release", "--quiet", "-p", "keel-bench", "--"]).args(&split.rest);
    run("keel-bench", cmd)
}

/// The variables the store micro-benchmark (`store-postgres/benches/store.rs`) reads its
/// database from, in order.
const STORE_BENCH_URL_VARS: [&str; 2] = ["KEEL_BENCH_DATABASE_URL", "KEEL_TEST_DATABASE_URL"];

/// The store micro-benchmark; said to be skipped, not "ok", when it has no database (the
/// benchmark itself then only prints that it skipped).
fn store_bench(root: &Path) -> Result<()> {
    let has_url =
        STORE_BENCH_URL_VARS.iter().any(|v| std::env::var(v).is_ok_and(|u| !u.is_empty()));
    if !has_url {
        eprintln!(
            "<== store micro-benchmark: SKIPPED — set {} (or {}) to a PostgreSQL database",
            STORE_BENCH_URL_VARS[0], STORE_BENCH_URL_VARS[1]
        );
        return Ok(());
    }
    let mut cmd = cargo(root);
    cmd.args(["bench", "-p", "keel-store-postgres", "--bench", "store"]);
    run("store micro-benchmark", cmd)
}

/// `cargo xtask bench` arguments: whether the store micro-benchmark is named, and what
/// goes to `keel-bench`.
#[derive(Debug, PartialEq)]
struct BenchArgs {
    /// `store` was named as a scenario.
    store: bool,
    /// The rest names one of `keel-bench`'s own scenarios.
    scenario: bool,
    /// The rest asks for `keel-bench`'s help.
    help: bool,
    /// Everything but `store`, in order, for `keel-bench`.
    rest: Vec<String>,
}

/// Splits `cargo xtask bench` arguments. Every `keel-bench` option but `--help`/`-h`
/// takes a value, as the next argument or after `=`; what is left are scenario names. A
/// value is never taken for a scenario (`--out store` names a directory).
fn split_bench_args(args: &[String]) -> BenchArgs {
    let mut split = BenchArgs { store: false, scenario: false, help: false, rest: Vec::new() };
    let mut value_next = false;
    for arg in args {
        if value_next {
            value_next = false;
        } else if matches!(arg.as_str(), "--help" | "-h") {
            split.help = true;
        } else if arg.starts_with('-') {
            value_next = !arg.contains('=');
        } else if arg == "store" {
            split.store = true;
            continue;
        } else {
            split.scenario = true;
        }
        split.rest.push(arg.clone());
    }
    split
}

/// `cargo xtask ci [--chaos]`; with `--chaos` (or `KEEL_CI_CHAOS=1`) it ends with a short
/// chaos run on both stores.
/// Cases per loader property in CI: about a minute on two cores (150 000 took 109 s).
const LOADER_FUZZ_CI_CASES: &str = "90000";

fn ci(root: &Path, chaos: bool) -> Result<()> {
    let chaos = chaos || std::env::var("KEEL_CI_CHAOS").is_ok_and(|v| v == "1");
    let started = Instant::now();
    // A missing service fails at once, not after fmt, clippy and rustdoc (the tests check
    // again when they start).
    services::detect(root, true)?;
    services::browser(true)?;
    let mut fmt = cargo(root);
    fmt.args(["fmt", "--all", "--", "--check"]);
    run("cargo fmt --check", fmt)?;
    let mut clippy = cargo(root);
    clippy.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    run("cargo clippy -D warnings", clippy)?;
    eprintln!("==> tidy");
    tidy::report(&tidy::check(root)?)?;
    // The API docs are what `cargo doc -p keel --open` shows a user: no broken links.
    let mut doc = cargo(root);
    doc.args(["doc", "--workspace", "--no-deps", "--all-features", "--lib"])
        .env("RUSTDOCFLAGS", "-D warnings");
    run("cargo doc -D warnings", doc)?;
    test(root, true)?;
    // The examples are the first thing a new user runs: they must run, not just compile.
    // On SQLite, as a new user runs them, each in a fresh file.
    for example in ["steps", "order", "ticket"] {
        let db = std::env::temp_dir().join(format!("keel-ci-{example}-{}.db", std::process::id()));
        let mut cmd = cargo(root);
        // `ticket` takes any store URL in KEEL_DATABASE_URL; the others read KEEL_DEMO_DB.
        let url = format!("sqlite://{}", db.display());
        cmd.args(["run", "--quiet", "--example", example])
            .env("KEEL_DEMO_DB", &db)
            .env("KEEL_DATABASE_URL", if example == "ticket" { url.as_str() } else { "" });
        let result = run(&format!("example {example}"), cmd);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
        }
        result?;
    }
    // A fixed-seed sweep of the simulator on a user's machine, as a new user runs it (the
    // simulator's own tests sweep more seeds inside `cargo test`).
    let mut sim = cargo(root);
    sim.args(["run", "--quiet", "-p", "keel-examples", "--example", "sim_transfer", "--", "300"]);
    run("example sim_transfer (300 seeds)", sim)?;
    // The chart loaders under a minute of fuzzing (the test suite's own run is a few
    // seconds): arbitrary and mutated JSON and SCXML must never panic, and every refusal
    // must name a place.
    let mut fuzz = cargo(root);
    fuzz.args(["test", "--quiet", "-p", "keel-testkit", "--test", "loaders_fuzz"])
        .env("LOADER_FUZZ_CASES", LOADER_FUZZ_CI_CASES);
    run("loader fuzzing (about a minute)", fuzz)?;
    if chaos {
        // Short runs, fixed seeds: about four minutes together on two cores.
        for args in [
            ["--store", "sqlite", "--minutes", "0.5", "--instances", "500", "--seed", "1"],
            ["--store", "postgres", "--minutes", "2", "--instances", "1000", "--seed", "1"],
        ] {
            let step = Instant::now();
            eprintln!("==> chaos {}", args.join(" "));
            chaos::main(root, &args.map(String::from))?;
            eprintln!("<== chaos {}: ok in {:.1}s", args[1], step.elapsed().as_secs_f64());
        }
    }
    eprintln!("ci: all green in {:.0}s", started.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{BenchArgs, refuse_others, split_bench_args};

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|a| (*a).to_owned()).collect()
    }

    #[test]
    fn a_task_refuses_an_argument_it_does_not_take_by_name() {
        assert!(refuse_others("ci", &args(&["--chaos"]), &["--chaos"]).is_ok());
        assert!(refuse_others("test", &args(&[]), &[]).is_ok());
        let typo = refuse_others("ci", &args(&["--chaos", "--chaso"]), &["--chaos"]).unwrap_err();
        assert!(
            typo.to_string()
                .starts_with("cargo xtask ci: unknown argument \"--chaso\" (it takes: --chaos)"),
            "{typo}"
        );
        let extra = refuse_others("tidy", &args(&["--fix"]), &[]).unwrap_err();
        assert!(
            extra.to_string().contains("unknown argument \"--fix\" (it takes: none)"),
            "{extra}"
        );
    }

    #[test]
    fn bench_runs_keel_bench_only_for_a_scenario_of_its_own_beside_store() {
        let split = |list: &[&str]| split_bench_args(&args(list));
        let only = |store, scenario, help, rest: &[&str]| BenchArgs {
            store,
            scenario,
            help,
            rest: args(rest),
        };
        // `store` alone, or with options only: no keel-bench run.
        assert_eq!(split(&["store"]), only(true, false, false, &[]));
        assert_eq!(
            split(&["store", "--store", "postgres"]),
            only(true, false, false, &["--store", "postgres"])
        );
        assert_eq!(
            split(&["--store=postgres", "store"]),
            only(true, false, false, &["--store=postgres"])
        );
        // A scenario beside it, before or after the options.
        assert_eq!(
            split(&["store", "--store", "postgres", "fairness"]),
            only(true, true, false, &["--store", "postgres", "fairness"])
        );
        assert_eq!(split(&["timers", "store"]), only(true, true, false, &["timers"]));
        // An option's value is not a scenario, `store` included.
        assert_eq!(
            split(&["--out", "store", "--instances", "10"]),
            only(false, false, false, &["--out", "store", "--instances", "10"])
        );
        assert_eq!(split(&["store", "--help"]), only(true, false, true, &["--help"]));
        // Without `store`, keel-bench gets everything (its default scenarios when none).
        assert_eq!(split(&[]), only(false, false, false, &[]));
    }
}
