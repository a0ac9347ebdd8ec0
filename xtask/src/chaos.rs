//! `cargo xtask chaos [--minutes N] [--store postgres|sqlite] [--seed S] [--instances N]`:
//! Keel's guarantees under real faults, against real databases.
//!
//! PostgreSQL (a private cluster on a free loopback port, created here and removed after):
//! three worker processes run the chaos workload through the commit-unknown proxy while
//! one of them is SIGKILLed every 3–8 s (half restart under the same identity, half under
//! a new one), the server is crashed and restarted (`pg_ctl restart -m immediate`) three
//! times, stays down for an outage (60 s, or a fifth of a short run), and one worker runs
//! with its clock stepped by ±30 s. SQLite: one worker process on a file, killed at
//! random points 20 times. Then faults stop, the workers drain the work (bounded), and the
//! checker counts, from the database and the workers' side log of handler executions:
//! instances not terminal, step commits applied twice, handler executions per committed
//! step, leases left, leases the reaper took from parents, inbox rows of terminal
//! instances, timers fired early or twice, and `@done` per parent. Any lost or hung
//! instance, duplicate commit, duplicate `@done`, or timer fired early (by its recorded
//! times) or twice fails the run. The verdict is printed and written as JSON under
//! `target/chaos/`; each worker process's stderr is kept beside its side log
//! (`stderr-<id>-<n>.log` in the run directory) and quoted when a worker fails to start.

use crate::chaos_pg::Cluster;
use crate::chaos_proxy::{self, ProxyStats};
use crate::chaos_worker::{CHILDREN, STEPS, child_machine, new_parent, parent_machine};
use anyhow::{Context, Result, bail};
use keel_core::limits;
use keel_core::ports::Store;
use keel_core::ports::store::{InsertParams, SignalDeliverParams};
use keel_core::{HistoryKind, InstanceId, NewSignal, SignalTarget, Status, Timestamp};
use keel_store_postgres::{PgConfig, PgStore};
use keel_store_sqlite::SqliteStore;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const USAGE: &str =
    "usage: cargo xtask chaos [--minutes N] [--store postgres|sqlite] [--seed S] [--instances N]";
/// How long the workers may take to finish the work once faults stop.
const DRAIN_MAX: Duration = Duration::from_secs(240);
/// Worker processes on PostgreSQL.
const PG_WORKERS: usize = 3;
/// One commit in this many is cut by the proxy.
const CUT_ONE_IN: u32 = 100;
/// Kills of the SQLite worker.
const SQLITE_KILLS: usize = 20;
/// The longest outage.
const OUTAGE_MAX: Duration = Duration::from_secs(60);
/// The clock step of one worker.
const CLOCK_STEP_MS: i64 = 30_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKind {
    Postgres,
    Sqlite,
}

struct Options {
    minutes: f64,
    store: StoreKind,
    seed: u64,
    instances: usize,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        minutes: 5.0,
        store: StoreKind::Postgres,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs()),
        instances: 0,
    };
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let value = args.get(i + 1).with_context(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag {
            "--minutes" => {
                options.minutes = value
                    .parse::<f64>()
                    .ok()
                    .filter(|m| (0.1..=600.0).contains(m))
                    .with_context(|| format!("--minutes: `{value}` is not a number of minutes between 0.1 and 600; try --minutes 5"))?;
            }
            "--store" => {
                options.store = match value.as_str() {
                    "postgres" => StoreKind::Postgres,
                    "sqlite" => StoreKind::Sqlite,
                    other => bail!(
                        "--store: `{other}` is not a store this run knows; use --store postgres or --store sqlite"
                    ),
                };
            }
            "--seed" => {
                options.seed = value.parse().with_context(|| {
                    format!("--seed: `{value}` is not a whole number; try --seed 42")
                })?;
            }
            "--instances" => {
                options.instances = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=100_000).contains(n))
                    .with_context(|| {
                        format!("--instances: `{value}` is not a count between 1 and 100000")
                    })?;
            }
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
        i += 2;
    }
    if options.instances == 0 {
        options.instances = match options.store {
            StoreKind::Postgres => 3_000,
            StoreKind::Sqlite => 1_000,
        };
    }
    Ok(options)
}

fn now() -> Timestamp {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    Timestamp::from_millis(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// A worker process, SIGKILLed when dropped so a failing run leaves none behind.
struct WorkerProcess(Option<Child>);

impl WorkerProcess {
    fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How a worker process is started.
#[derive(Clone)]
struct Launch {
    /// The program: a copy of this xtask binary in the run directory, run
    /// as `chaos-worker`.
    program: PathBuf,
    store_args: Vec<String>,
    /// The run directory: each worker's exec log and its stderr are kept there.
    log_dir: PathBuf,
}

/// The copy of this binary a run launches its workers from, in its run directory; removed
/// when the run ends (it is as large as the debug build).
const WORKER_BIN: &str = "chaos-worker-bin";

/// Lines of a failed worker's stderr quoted in the error.
const STDERR_TAIL_LINES: usize = 20;

impl Launch {
    /// Workers are launched from a copy of this binary kept in the run
    /// directory, not from the binary itself: a build elsewhere that shares
    /// the target directory (another checkout's `cargo xtask …`) replaces
    /// `target/debug/xtask` while a run takes minutes, and every later
    /// restart would then fail to launch, or launch a different program.
    fn new(run_dir: &Path, store_args: Vec<String>) -> Result<Launch> {
        // `/proc/self/exe` reads the running binary even after its file was replaced
        // (`current_exe` then names a path that is gone).
        let proc_exe = Path::new("/proc/self/exe");
        let me = if proc_exe.exists() {
            proc_exe.to_path_buf()
        } else {
            std::env::current_exe().context("could not find the running xtask binary")?
        };
        let program = run_dir.join(WORKER_BIN);
        std::fs::copy(&me, &program)
            .with_context(|| format!("could not copy {} to {}", me.display(), program.display()))?;
        Ok(Launch { program, store_args, log_dir: run_dir.to_path_buf() })
    }

    fn start(&self, id: &str, clock_offset_ms: i64, generation: usize) -> Result<WorkerProcess> {
        let log = self.log_dir.join(format!("exec-{id}-{generation}.log"));
        let stderr_path = self.log_dir.join(format!("stderr-{id}-{generation}.log"));
        let stderr = std::fs::File::create(&stderr_path)
            .with_context(|| format!("could not create {}", stderr_path.display()))?;
        let mut child = Command::new(&self.program)
            .arg("chaos-worker")
            .args(&self.store_args)
            .args(["--worker-id", id, "--exec-log"])
            .arg(&log)
            .args(["--clock-offset-ms", &clock_offset_ms.to_string()])
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .context("could not start the chaos worker")?;
        // The worker says `ready` once connected (its own connect budget is two minutes);
        // a worker that hangs before that must not hang the run.
        let stdout = child.stdout.take().context("worker stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let read = BufReader::new(stdout).read_line(&mut line).map(|_| line);
            let _ = tx.send(read);
        });
        let line = match rx.recv_timeout(READY_WITHIN) {
            Ok(read) => read?,
            Err(_) => format!("nothing within {} s", READY_WITHIN.as_secs()),
        };
        if line.trim() != "ready" {
            let _ = child.kill();
            let status = child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
            let said = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            let lines: Vec<&str> = said.lines().collect();
            let tail = lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join("\n");
            bail!(
                "the chaos worker {id} did not start (said {line:?} on stdout; {status}); the end of its stderr ({}):\n{tail}",
                stderr_path.display()
            );
        }
        Ok(WorkerProcess(Some(child)))
    }
}

/// One worker slot: its process, and how it restarts.
struct Slot {
    base: String,
    id: String,
    generation: usize,
    clock_offset_ms: i64,
    process: WorkerProcess,
}

impl Slot {
    /// SIGKILL, then start again under the same identity or a new one.
    fn kill_and_restart(&mut self, launch: &Launch, same_id: bool) -> Result<()> {
        self.process.kill();
        self.generation += 1;
        if !same_id {
            self.id = format!("{}-g{}", self.base, self.generation);
        }
        self.process = launch.start(&self.id, self.clock_offset_ms, self.generation)?;
        Ok(())
    }
}

/// How long a started worker may take to say `ready`: its connect budget and a margin.
const READY_WITHIN: Duration = Duration::from_secs(180);

/// The checker's counts, and the faults injected.
#[derive(Debug, Default)]
struct Tally {
    instances: u64,
    not_terminal: u64,
    not_terminal_examples: Vec<String>,
    /// Parents and children that ended other than done: every step of the workload
    /// succeeds, so a failed or cancelled one is a fault turned into an ending.
    not_done: u64,
    duplicate_commits: u64,
    revision_mismatch: u64,
    wrong_trail: u64,
    commits: u64,
    executions: u64,
    max_executions_of_one_step: u64,
    leases_left: u64,
    leases_expired: u64,
    most_leases_expired_of_one_parent: u64,
    terminal_inbox_rows: u64,
    timers_fired: u64,
    timers_early: u64,
    timers_twice: u64,
    parents_done_not_once: u64,
    children_not_terminal: u64,
}

impl Tally {
    fn failed(&self) -> bool {
        self.not_terminal > 0
            || self.not_done > 0
            || self.duplicate_commits > 0
            || self.revision_mismatch > 0
            || self.wrong_trail > 0
            || self.parents_done_not_once > 0
            || self.children_not_terminal > 0
            || self.leases_left > 0
            || self.terminal_inbox_rows > 0
            || self.timers_early > 0
            || self.timers_twice > 0
    }

    fn json(&self) -> Value {
        json!({
            "instances": self.instances,
            "not_terminal": self.not_terminal,
            "not_terminal_examples": self.not_terminal_examples,
            "not_done": self.not_done,
            "duplicate_commits": self.duplicate_commits,
            "revision_vs_history_mismatch": self.revision_mismatch,
            "wrong_trail": self.wrong_trail,
            "step_commits": self.commits,
            "handler_executions": self.executions,
            "executions_per_commit": ratio(self.executions, self.commits),
            "max_executions_of_one_step": self.max_executions_of_one_step,
            "leases_left": self.leases_left,
            "parent_leases_expired": self.leases_expired,
            "most_leases_expired_of_one_parent": self.most_leases_expired_of_one_parent,
            "terminal_inbox_rows": self.terminal_inbox_rows,
            "timers_fired": self.timers_fired,
            "timers_fired_early": self.timers_early,
            "timers_fired_twice": self.timers_twice,
            "parents_done_not_exactly_once": self.parents_done_not_once,
            "children_not_terminal": self.children_not_terminal,
        })
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { (a as f64 / b as f64 * 1000.0).round() / 1000.0 }
}

/// Whether a `TIMER_FIRED` record's data shows a fire before the timer was due: its sweep
/// time `at` is before its due time `due`. A record without both cannot show it fired on
/// time, and counts as early.
fn fired_early(data: &Value) -> bool {
    let (at, due) = (data["at"].as_i64(), data["due"].as_i64());
    at.zip(due).is_none_or(|(at, due)| at < due)
}

/// Counts executions per (instance, step) in the side logs.
fn read_exec_logs(dir: &Path) -> Result<HashMap<(i64, String), u64>> {
    let mut counts = HashMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if !path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("exec-")) {
            continue;
        }
        for line in std::fs::read_to_string(&path)?.lines() {
            let mut parts = line.split(' ');
            let (Some(id), Some(step)) = (parts.next().and_then(|p| p.parse().ok()), parts.next())
            else {
                continue;
            };
            *counts.entry((id, step.to_owned())).or_default() += 1;
        }
    }
    Ok(counts)
}

/// Reads every parent (with its children, inbox, history and timers) and counts.
async fn check<S: Store>(store: &S, parents: &[InstanceId], log_dir: &Path) -> Result<Tally> {
    let mut t = Tally::default();
    let expected_trail: Vec<Value> = (0..STEPS).map(|n| json!(format!("s{n}"))).collect();
    for id in parents {
        let d = store.instance_get(*id).await.with_context(|| format!("read instance {id}"))?;
        let row = &d.instance;
        t.instances += 1 + d.children.len() as u64;
        if !row.status.is_terminal() {
            t.not_terminal += 1;
            if t.not_terminal_examples.len() < 10 {
                t.not_terminal_examples.push(format!("{id} {} at {}", row.status, row.position));
            }
        }
        let kinds =
            |k: HistoryKind| d.history.iter().filter(|h| k.is(&h.entry.kind)).count() as u64;
        // Leases the reaper took from a parent: its worker died, or lost the store.
        let expired = kinds(HistoryKind::LeaseExpired);
        t.leases_expired += expired;
        t.most_leases_expired_of_one_parent = t.most_leases_expired_of_one_parent.max(expired);
        let (next, sched, done) = (
            kinds(HistoryKind::StepNext),
            kinds(HistoryKind::StepScheduleChildren),
            kinds(HistoryKind::StepDone),
        );
        let step_records =
            d.history.iter().filter(|h| h.entry.kind.starts_with("STEP_")).count() as i64;
        if step_records != row.revision.0 {
            t.revision_mismatch += 1;
        }
        t.commits += row.revision.0 as u64;
        let expected_next = (STEPS - 2) as u64; // every step but the fan-out and the last
        t.duplicate_commits +=
            next.saturating_sub(expected_next) + sched.saturating_sub(1) + done.saturating_sub(1);
        if row.status.is_terminal() && row.status != Status::Done {
            t.not_done += 1;
        }
        if row.status == Status::Done {
            if done != 1 {
                t.parents_done_not_once += 1;
            }
            let trail = row
                .result
                .as_ref()
                .and_then(|r| r["trail"].as_array().cloned())
                .unwrap_or_default();
            if trail != expected_trail {
                t.wrong_trail += 1;
            }
        } else if done > 0 {
            t.parents_done_not_once += 1;
        }
        if row.lease_owner.is_some() {
            t.leases_left += 1;
        }
        if row.status.is_terminal() {
            t.terminal_inbox_rows += d.inbox.len() as u64;
        }
        let fired: Vec<&keel_core::instance::HistoryRecord> =
            d.history.iter().filter(|h| HistoryKind::TimerFired.is(&h.entry.kind)).collect();
        t.timers_fired += fired.len() as u64;
        t.timers_twice += (fired.len() as u64).saturating_sub(1);
        t.timers_early += fired.iter().filter(|h| fired_early(&h.entry.data)).count() as u64;
        if row.status == Status::Done && d.children.len() != CHILDREN {
            t.children_not_terminal += 1;
        }
        for child in &d.children {
            if child.status.is_terminal() {
                t.commits += 1;
                t.not_done += u64::from(child.status != Status::Done);
            } else {
                t.children_not_terminal += 1;
                t.not_terminal += 1;
            }
        }
    }
    let executions = read_exec_logs(log_dir)?;
    t.executions = executions.values().sum();
    t.max_executions_of_one_step = executions.values().copied().max().unwrap_or(0);
    Ok(t)
}

/// Inserts parents numbered `start..end` in bounded batches.
async fn insert<S: Store>(store: &S, start: usize, end: usize) -> Result<Vec<InstanceId>> {
    let mut ids = Vec::with_capacity(end - start);
    let all: Vec<_> = (start..end).map(new_parent).collect();
    for chunk in all.chunks(limits::INSERT_BATCH_MAX) {
        let out =
            store.instance_insert(InsertParams { instances: chunk.to_vec(), now: now() }).await?;
        ids.extend(out.into_iter().map(keel_core::ports::store::InsertOutcome::id));
    }
    Ok(ids)
}

/// Inserts the workload in waves spread over the fault phase, so faults hit a loaded
/// system from start to end. Each wave gets `go` ×2 for half of its instances at once and
/// for the other half with the next wave (or when faults stop).
struct Waves {
    count: usize,
    done: usize,
    per_wave: usize,
    total: usize,
    ids: Vec<InstanceId>,
    go_pending: Vec<InstanceId>,
}

const WAVES: usize = 10;

impl Waves {
    fn new(total: usize) -> Self {
        Waves {
            count: WAVES,
            done: 0,
            per_wave: total.div_ceil(WAVES),
            total,
            ids: Vec::new(),
            go_pending: Vec::new(),
        }
    }

    /// When the next wave is due, as a share of the fault phase.
    fn next_due(&self, phase: Duration) -> Option<Duration> {
        (self.done < self.count).then(|| phase * self.done as u32 / self.count as u32)
    }

    /// Inserts the next wave and sends the `go` signals that are due; an error (the
    /// database is down) leaves the wave for the next try.
    async fn step<S: Store>(&mut self, store: &S) -> Result<String> {
        let start = self.done * self.per_wave;
        let end = ((self.done + 1) * self.per_wave).min(self.total);
        let fresh = insert(store, start, end).await?;
        self.done += 1;
        let (now_half, later) = fresh.split_at(fresh.len() / 2);
        let mut go: Vec<InstanceId> = std::mem::take(&mut self.go_pending);
        go.extend_from_slice(now_half);
        self.go_pending = later.to_vec();
        self.ids.extend(fresh.iter().copied());
        // The wave is in; a failed delivery is retried with the next wave.
        if let Err(e) = send_go(store, &go).await {
            self.go_pending.extend(go);
            return Ok(format!(
                "wave {} inserted ({} instances); sending `go` failed: {e}",
                self.done,
                fresh.len()
            ));
        }
        Ok(format!(
            "wave {} inserted ({} instances); `go` ×2 sent to {}",
            self.done,
            fresh.len(),
            go.len()
        ))
    }

    /// The last `go` signals, after faults stop (bounded retries).
    async fn finish<S: Store>(&mut self, store: &S) -> Result<()> {
        for _ in 0..30 {
            if self.done < self.count {
                if self.step(store).await.is_err() {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                continue;
            }
            if self.go_pending.is_empty() {
                return Ok(());
            }
            match send_go(store, &self.go_pending).await {
                Ok(()) => self.go_pending.clear(),
                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
        bail!("could not insert the workload and send its signals within 30 tries")
    }
}

/// Delivers `go` twice (the same dedup key) to each instance: one is a duplicate while
/// the first is pending.
async fn send_go<S: Store>(store: &S, ids: &[InstanceId]) -> Result<()> {
    let per_batch = limits::DELIVER_BATCH_MAX / 2;
    for chunk in ids.chunks(per_batch.max(1)) {
        let signals = chunk
            .iter()
            .flat_map(|id| {
                let go = NewSignal::new(SignalTarget::Id(*id), "go").dedup_key(format!("go-{id}"));
                [go.clone(), go]
            })
            .collect();
        store.signal_deliver(SignalDeliverParams { signals, now: now() }).await?;
    }
    Ok(())
}

/// Instances not terminal yet, from the cheap per-queue counts.
async fn live<S: Store>(store: &S) -> Result<u64> {
    let stats = store.queue_stats(None, now()).await?;
    Ok(stats
        .iter()
        .filter(|q| q.machine == parent_machine().name || q.machine == child_machine().name)
        .map(|q| q.ready + q.scheduled + q.executing + q.waiting + q.suspended)
        .sum())
}

/// Polls until nothing is live or `max` passed; returns how long it took.
fn drain<S: Store>(rt: &tokio::runtime::Runtime, store: &S, max: Duration) -> Duration {
    let started = Instant::now();
    while started.elapsed() < max {
        match rt.block_on(live(store)) {
            Ok(0) => break,
            Ok(_) | Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
    started.elapsed()
}

/// A fault log line, printed and kept for the JSON.
struct Faults {
    started: Instant,
    lines: Vec<Value>,
    kills: u64,
    same_id_restarts: u64,
}

impl Faults {
    fn note(&mut self, what: impl Into<String>) {
        let what = what.into();
        let at = self.started.elapsed().as_secs_f64();
        eprintln!("chaos [{at:>6.1}s] {what}");
        self.lines.push(json!({ "at_s": (at * 10.0).round() / 10.0, "what": what }));
    }
}

pub fn main(root: &Path, args: &[String]) -> Result<()> {
    let options = parse(args)?;
    let out_dir = root.join("target").join("chaos");
    let name = match options.store {
        StoreKind::Postgres => "postgres",
        StoreKind::Sqlite => "sqlite",
    };
    let run_dir = out_dir.join(format!("{name}-seed{}", options.seed));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    eprintln!(
        "chaos: {name}, {} instances × {STEPS} steps, {} min of faults, seed {} (replay the fault schedule with --seed {})",
        options.instances, options.minutes, options.seed, options.seed
    );
    let started = Instant::now();
    let ran = match options.store {
        StoreKind::Postgres => run_postgres(&options, &run_dir),
        StoreKind::Sqlite => run_sqlite(&options, &run_dir),
    };
    // Every worker has stopped by now, whatever the outcome.
    let _ = std::fs::remove_file(run_dir.join(WORKER_BIN));
    let (tally, mut report) = ran?;
    let failed = tally.failed();
    report["store"] = json!(name);
    report["seed"] = json!(options.seed);
    report["minutes"] = json!(options.minutes);
    report["checker"] = tally.json();
    report["verdict"] = json!(if failed { "FAILED" } else { "passed" });
    report["wall_seconds"] = json!(started.elapsed().as_secs());
    let file = out_dir.join(format!("{name}-seed{}.json", options.seed));
    std::fs::write(&file, serde_json::to_string_pretty(&report)?)?;
    print_table(&tally, &report);
    eprintln!("chaos: report written to {}", file.display());
    if failed {
        bail!("chaos: FAILED — see the table above and {}", file.display());
    }
    eprintln!("chaos: passed in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn print_table(t: &Tally, report: &Value) {
    let rows: [(&str, String, bool); 17] = [
        ("instances (parents + children)", t.instances.to_string(), false),
        ("not terminal (lost or hung)", t.not_terminal.to_string(), t.not_terminal > 0),
        ("ended other than done", t.not_done.to_string(), t.not_done > 0),
        ("step commits applied twice", t.duplicate_commits.to_string(), t.duplicate_commits > 0),
        ("revision ≠ step history", t.revision_mismatch.to_string(), t.revision_mismatch > 0),
        ("finished with a wrong step trail", t.wrong_trail.to_string(), t.wrong_trail > 0),
        (
            "@done not exactly once per parent",
            t.parents_done_not_once.to_string(),
            t.parents_done_not_once > 0,
        ),
        (
            "children not terminal / missing",
            t.children_not_terminal.to_string(),
            t.children_not_terminal > 0,
        ),
        ("step commits", t.commits.to_string(), false),
        ("handler executions (at-least-once)", t.executions.to_string(), false),
        ("executions per commit", format!("{:.3}", ratio(t.executions, t.commits)), false),
        ("most executions of one step", t.max_executions_of_one_step.to_string(), false),
        ("leases left", t.leases_left.to_string(), t.leases_left > 0),
        (
            "parent leases expired / most of one",
            format!("{} / {}", t.leases_expired, t.most_leases_expired_of_one_parent),
            false,
        ),
        (
            "inbox rows of terminal instances",
            t.terminal_inbox_rows.to_string(),
            t.terminal_inbox_rows > 0,
        ),
        (
            "timers fired / early / twice",
            format!("{} / {} / {}", t.timers_fired, t.timers_early, t.timers_twice),
            t.timers_early > 0 || t.timers_twice > 0,
        ),
        ("drain after faults", format!("{} s", report["drain_seconds"]), false),
    ];
    eprintln!("\n{:<40} {:>14}", "checker", "count");
    for (label, value, bad) in rows {
        eprintln!("{label:<40} {value:>14}{}", if bad { "   <-- FAIL" } else { "" });
    }
    if let Some(proxy) = report.get("proxy") {
        eprintln!(
            "commit-unknown proxy: {} commits seen, {} cut, of those {} committed, {} rolled back, {} unknown",
            proxy["commits"],
            proxy["cuts"],
            proxy["cut_committed"],
            proxy["cut_rolled_back"],
            proxy["cut_unknown"]
        );
    }
    eprintln!();
}

fn temp_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("keel-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn run_postgres(options: &Options, run_dir: &Path) -> Result<(Tally, Value)> {
    let mut rng = fastrand::Rng::with_seed(options.seed);
    let tmp = temp_dir()?;
    let cluster = Cluster::create(&tmp)?;
    let mut faults =
        Faults { started: Instant::now(), lines: Vec::new(), kills: 0, same_id_restarts: 0 };
    faults.note(format!(
        "private PostgreSQL up on 127.0.0.1:{} in {}",
        cluster.port,
        tmp.display()
    ));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let schema = "keel_chaos";
    let store = rt.block_on(async {
        let store = PgStore::connect(PgConfig::new(cluster.url()).schema(schema)).await?;
        store.migrate().await?;
        Ok::<_, keel_core::StoreError>(store)
    })?;
    let mut waves = Waves::new(options.instances);

    let stats = Arc::new(ProxyStats::default());
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let proxy_port = listener.local_addr()?.port();
    rt.spawn(chaos_proxy::serve(listener, cluster.port, CUT_ONE_IN, options.seed, stats.clone()));
    let launch = Launch::new(
        run_dir,
        vec![
            "--postgres".into(),
            format!("postgres://postgres@127.0.0.1:{proxy_port}/postgres"),
            "--schema".into(),
            schema.into(),
        ],
    )?;
    let mut slots = Vec::new();
    for i in 0..PG_WORKERS {
        let base = format!("chaos-w{i}");
        let process = launch.start(&base, 0, 0)?;
        slots.push(Slot {
            base: base.clone(),
            id: base,
            generation: 0,
            clock_offset_ms: 0,
            process,
        });
    }
    faults.note(format!(
        "{PG_WORKERS} workers up behind the commit-unknown proxy on port {proxy_port}"
    ));

    let total = Duration::from_secs_f64(options.minutes * 60.0);
    let outage = OUTAGE_MAX.min(total / 5);
    let mut restarts_at = vec![total * 15 / 100, total * 30 / 100, total * 45 / 100];
    let mut outage_at = Some(total * 55 / 100);
    let mut clock_at = Some(total * 25 / 100);
    let mut clock_step_ms = 0;
    let chaos_started = Instant::now();
    let mut next_kill = Duration::from_millis(rng.u64(3_000..=8_000));
    let mut restarts = 0;
    while chaos_started.elapsed() < total {
        let t = chaos_started.elapsed();
        if waves.next_due(total).is_some_and(|at| t >= at) {
            match rt.block_on(waves.step(&store)) {
                Ok(line) => faults.note(line),
                Err(e) => faults.note(format!("inserting a wave failed ({e}); trying again")),
            }
        }
        if restarts_at.first().is_some_and(|at| t >= *at) {
            restarts_at.remove(0);
            cluster.restart_immediate()?;
            restarts += 1;
            faults.note(format!(
                "PostgreSQL crashed and restarted (restart -m immediate #{restarts})"
            ));
        }
        if outage_at.is_some_and(|at| t >= at) {
            outage_at = None;
            cluster.stop_immediate()?;
            faults.note(format!("PostgreSQL down for a {} s outage", outage.as_secs()));
            std::thread::sleep(outage);
            cluster.start()?;
            faults.note("PostgreSQL back after the outage");
        }
        if clock_at.is_some_and(|at| t >= at) {
            clock_at = None;
            let step = if rng.bool() { CLOCK_STEP_MS } else { -CLOCK_STEP_MS };
            clock_step_ms = step;
            let slot = &mut slots[PG_WORKERS - 1];
            slot.clock_offset_ms = step;
            slot.kill_and_restart(&launch, true)?;
            faults.note(format!("{}'s clock stepped by {:+} s", slot.id, step / 1000));
        }
        if t >= next_kill {
            let i = rng.usize(..PG_WORKERS);
            let same_id = rng.bool();
            let slot = &mut slots[i];
            let old = slot.id.clone();
            slot.kill_and_restart(&launch, same_id)?;
            faults.kills += 1;
            faults.same_id_restarts += u64::from(same_id);
            faults.note(format!("SIGKILL {old}; restarted as {}", slot.id));
            next_kill = t + Duration::from_millis(rng.u64(3_000..=8_000));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    faults.note("faults stop; draining");
    rt.block_on(waves.finish(&store))?;
    let drained = drain(&rt, &store, DRAIN_MAX);
    faults.note(format!("drained in {:.0} s", drained.as_secs_f64()));
    let tally = rt.block_on(check(&store, &waves.ids, run_dir))?;
    for slot in &mut slots {
        slot.process.kill();
    }
    let report = json!({
        "instances": options.instances,
        "workers": PG_WORKERS,
        "worker_kills": faults.kills,
        "same_id_restarts": faults.same_id_restarts,
        "postgres_restarts": restarts,
        "outage_seconds": outage.as_secs(),
        "clock_step_ms": clock_step_ms,
        "drain_seconds": drained.as_secs(),
        "proxy": {
            "connections": stats.connections.load(Ordering::Relaxed),
            "commits": stats.commits.load(Ordering::Relaxed),
            "cuts": stats.cuts.load(Ordering::Relaxed),
            "cut_committed": stats.cut_committed.load(Ordering::Relaxed),
            "cut_rolled_back": stats.cut_rolled_back.load(Ordering::Relaxed),
            "cut_unknown": stats.cut_unknown.load(Ordering::Relaxed),
        },
        "faults": faults.lines,
    });
    drop(store);
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(cluster);
    let _ = std::fs::remove_dir_all(&tmp);
    Ok((tally, report))
}

fn run_sqlite(options: &Options, run_dir: &Path) -> Result<(Tally, Value)> {
    let mut rng = fastrand::Rng::with_seed(options.seed);
    let tmp = temp_dir()?;
    let db = tmp.join("chaos.db");
    let mut faults =
        Faults { started: Instant::now(), lines: Vec::new(), kills: 0, same_id_restarts: 0 };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let store = rt.block_on(SqliteStore::open(&db))?;
    let mut waves = Waves::new(options.instances);
    faults.note(format!("SQLite file {}", db.display()));
    let launch = Launch::new(run_dir, vec!["--sqlite".into(), db.display().to_string()])?;
    let mut slot = Slot {
        base: "chaos-sqlite".into(),
        id: "chaos-sqlite".into(),
        generation: 0,
        clock_offset_ms: 0,
        process: launch.start("chaos-sqlite", 0, 0)?,
    };
    let total = Duration::from_secs_f64(options.minutes * 60.0);
    // Kill points spread over the run: each wait is random, 20 in all.
    let mean_ms = (total.as_millis() as u64 / SQLITE_KILLS as u64).max(200);
    let chaos_started = Instant::now();
    for _ in 0..SQLITE_KILLS {
        let until = Instant::now() + Duration::from_millis(rng.u64(mean_ms / 4..=mean_ms * 7 / 4));
        while Instant::now() < until {
            if waves.next_due(total).is_some_and(|at| chaos_started.elapsed() >= at) {
                let line = rt.block_on(waves.step(&store))?;
                faults.note(line);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let same_id = rng.bool();
        let old = slot.id.clone();
        slot.kill_and_restart(&launch, same_id)?;
        faults.kills += 1;
        faults.same_id_restarts += u64::from(same_id);
        faults.note(format!("SIGKILL {old}; restarted as {}", slot.id));
    }
    faults.note("faults stop; draining");
    rt.block_on(waves.finish(&store))?;
    let drained = drain(&rt, &store, DRAIN_MAX);
    faults.note(format!("drained in {:.0} s", drained.as_secs_f64()));
    let tally = rt.block_on(check(&store, &waves.ids, run_dir))?;
    slot.process.kill();
    let report = json!({
        "instances": options.instances,
        "workers": 1,
        "worker_kills": faults.kills,
        "same_id_restarts": faults.same_id_restarts,
        "drain_seconds": drained.as_secs(),
        "faults": faults.lines,
    });
    drop(store);
    rt.shutdown_timeout(Duration::from_secs(2));
    let _ = std::fs::remove_dir_all(&tmp);
    Ok((tally, report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_testkit::MemoryStore;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(String::from).collect()
    }

    /// A worker that exits before it is ready: the error quotes what it wrote to stderr,
    /// which stays in the run directory.
    #[test]
    fn a_worker_that_does_not_start_is_reported_with_its_stderr() {
        let dir = std::env::temp_dir().join(format!("keel-chaos-stderr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        // `sh chaos-worker …` fails to open a script named chaos-worker and says so on
        // stderr, as a chaos worker that cannot reach its store does.
        let launch = Launch { program: "sh".into(), store_args: Vec::new(), log_dir: dir.clone() };
        let error = launch.start("w1", 0, 0).err().expect("refused").to_string();
        let kept = std::fs::read_to_string(dir.join("stderr-w1-0.log")).expect("stderr kept");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(error.starts_with("the chaos worker w1 did not start"), "{error}");
        assert!(kept.contains("chaos-worker"), "{kept}");
        assert!(error.ends_with(kept.trim_end()), "{error}\n---\n{kept}");
    }

    #[test]
    fn bad_options_name_the_flag_and_the_fix() {
        let error = |text: &str| parse(&args(text)).err().expect("refused").to_string();
        assert!(error("--store mysql").contains("--store postgres or --store sqlite"));
        assert!(error("--minutes 0").contains("--minutes"));
        assert!(error("--seed x").contains("--seed 42"));
        assert!(error("--instances 0").contains("--instances"));
        assert!(error("--seed").contains("--seed needs a value"));
        let ok = parse(&args("--store sqlite --seed 9")).expect("valid");
        assert_eq!((ok.store, ok.seed, ok.instances), (StoreKind::Sqlite, 9, 1_000));
    }

    /// A timer fired before it was due fails the run, as one fired twice does; a fire
    /// record without its times counts as early.
    #[test]
    fn a_timer_fired_early_or_twice_fails_the_run() {
        let clean = Tally { instances: 1, timers_fired: 1, ..Tally::default() };
        assert!(!clean.failed(), "{clean:?}");
        assert!(Tally { timers_early: 1, ..Tally::default() }.failed());
        assert!(Tally { timers_twice: 1, ..Tally::default() }.failed());
        assert!(!fired_early(&json!({ "due": 1_000, "at": 1_000 })));
        assert!(!fired_early(&json!({ "due": 1_000, "at": 1_500 })));
        assert!(fired_early(&json!({ "due": 1_000, "at": 999 })));
        assert!(fired_early(&json!({ "due": 1_000 })));
        assert!(fired_early(&json!({ "at": 1_000 })));
        assert!(fired_early(&json!({})));
    }

    #[test]
    fn the_checker_fails_a_run_that_left_work_unfinished() {
        let store = MemoryStore::new();
        let dir = std::env::temp_dir().join(format!("keel-chaos-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("exec-w-0.log"), "1 s0 0\n1 s0 1\n2 s0 0\n").expect("log");
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let tally = rt
            .block_on(async {
                let ids = insert(&store, 0, 3).await?;
                check(&store, &ids, &dir).await
            })
            .expect("check");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(tally.not_terminal, 3);
        assert!(tally.failed(), "work that never ran is lost or hung");
        assert_eq!((tally.executions, tally.max_executions_of_one_step), (3, 2));
    }
}
