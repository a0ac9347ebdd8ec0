//! The chaos workload and the worker process the chaos run kills (`cargo xtask
//! chaos-worker …`, started by `cargo xtask chaos`, never by hand).
//!
//! The `chaos` machine has twelve steps `s0` … `s11`: `s3` fans out to two `chaos_child`
//! instances and waits for them, `s6` waits for the signal `go` (delivered twice, with one
//! dedup key), `s8` arms a 2 s timer and waits for it. Every step appends its name to the
//! context's `trail`, so a finished instance shows each step it committed, in order. Every
//! handler execution is appended to a side log (one line: instance, step, attempt), so
//! the checker can count executions per committed step.

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::config::QueueConfig;
use keel_core::instance::NewInstance;
use keel_core::ports::Clock;
use keel_core::retry::RetryPolicy;
use keel_core::{MachineRef, Outcome, StatusSet, Timestamp, WorkerId};
use keel_scheduler::{StepContext, StepError, StepMachine, SystemClock, Worker, WorkerConfig};
use keel_store_postgres::{PgConfig, PgStore};
use keel_store_sqlite::SqliteStore;
use serde_json::{Value, json};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Steps of the parent machine.
pub const STEPS: usize = 12;
/// The step that fans out to children.
pub const FAN_OUT: usize = 3;
/// Children per parent.
pub const CHILDREN: usize = 2;
/// The step that waits for `go`.
pub const SIGNAL_STEP: usize = 6;
/// The step that waits for its timer.
pub const TIMER_STEP: usize = 8;
/// Connection attempts, 500 ms apart, before a worker gives up at start-up.
const CONNECT_TRIES: usize = 240;
/// The timer's delay.
pub const TIMER_DELAY: Duration = Duration::from_secs(2);

pub fn parent_machine() -> MachineRef {
    MachineRef::new("chaos", 1)
}

pub fn child_machine() -> MachineRef {
    MachineRef::new("chaos_child", 1)
}

/// A new parent instance, numbered `n`. Its unique key makes a retried insert (after an
/// error whose commit may have happened) return the existing instance.
pub fn new_parent(n: usize) -> NewInstance {
    NewInstance::new(parent_machine(), "s0")
        .context(json!({ "n": n, "trail": [] }))
        .unique(format!("chaos-{n}"), StatusSet::ALL)
}

/// Appends executions to the side log, one `write` per line (atomic on an append-only
/// file), so lines of concurrent worker processes never interleave.
struct ExecLog(Mutex<std::fs::File>);

impl ExecLog {
    fn record(&self, ctx: &StepContext) {
        let line = format!("{} {} {}\n", ctx.id.0, ctx.step, ctx.attempt);
        let mut file = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A failed write must not fail the step; the checker reports missing lines as
        // fewer executions than commits.
        let _ = file.write_all(line.as_bytes());
    }
}

struct Parent(Arc<ExecLog>);

fn with_trail(context: &Value, step: &str) -> Value {
    let mut next = context.clone();
    let mut trail = next["trail"].as_array().cloned().unwrap_or_default();
    trail.push(json!(step));
    next["trail"] = Value::Array(trail);
    next
}

/// The machines' settings: the default but for more attempts. A step whose worker dies
/// holding it counts an attempt, and after `max_attempts` such deaths in a row it is
/// suspended as a step that kills its worker. This run kills a worker every 3 to 8
/// seconds, far more often than any fleet loses one, so three kills can land on one step
/// in a row by chance; the run checks that nothing is lost or doubled, not that rule
/// (the worker's own tests do).
fn chaos_config() -> QueueConfig {
    let retry = RetryPolicy { max_attempts: 10, ..RetryPolicy::default() };
    QueueConfig { retry, ..QueueConfig::default() }
}

#[async_trait]
impl StepMachine for Parent {
    fn machine(&self) -> MachineRef {
        parent_machine()
    }

    fn config(&self) -> QueueConfig {
        chaos_config()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        self.0.record(ctx);
        let n: usize = ctx.step.trim_start_matches('s').parse().unwrap_or(STEPS);
        let next = format!("s{}", n + 1);
        if n == SIGNAL_STEP {
            let Some(go) = ctx.signal("go") else {
                return Ok(Outcome::Await {
                    signal: "go".into(),
                    context: ctx.context.clone(),
                    step: None,
                });
            };
            ctx.consume(vec![go.id]);
        }
        if n == TIMER_STEP {
            if ctx.context["timer_armed"] != json!(true) {
                ctx.timer_arm(TimerArm {
                    state: "s8".into(),
                    event: "wake".into(),
                    kind: TimerKind::After,
                    interval: TIMER_DELAY,
                    max: None,
                    then: None,
                });
                let mut waiting = ctx.context.clone();
                waiting["timer_armed"] = json!(true);
                return Ok(Outcome::Await { signal: "wake".into(), context: waiting, step: None });
            }
            let Some(wake) = ctx.signal("wake") else {
                return Ok(Outcome::Await {
                    signal: "wake".into(),
                    context: ctx.context.clone(),
                    step: None,
                });
            };
            ctx.consume(vec![wake.id]);
        }
        let context = with_trail(&ctx.context, &ctx.step);
        Ok(if n == FAN_OUT {
            let children = (0..CHILDREN)
                .map(|i| NewInstance::new(child_machine(), "c0").context(json!({ "i": i })))
                .collect();
            Outcome::ScheduleChildren {
                next,
                children,
                context,
                join: keel_core::join::Join::default(),
            }
        } else if n + 1 >= STEPS {
            Outcome::Done { result: context, step: None }
        } else {
            Outcome::Next { step: next, context }
        })
    }
}

struct Child(Arc<ExecLog>);

#[async_trait]
impl StepMachine for Child {
    fn machine(&self) -> MachineRef {
        child_machine()
    }

    fn config(&self) -> QueueConfig {
        chaos_config()
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        self.0.record(ctx);
        Ok(Outcome::Done { result: with_trail(&ctx.context, &ctx.step), step: None })
    }
}

/// The system clock moved by a fixed offset: a worker whose clock was stepped.
#[derive(Clone)]
struct SteppedClock(i64);

impl Clock for SteppedClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(SystemClock.now().as_millis() + self.0)
    }
}

fn value(args: &[String], flag: &str) -> Option<String> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned()
}

/// `chaos-worker (--postgres URL --schema NAME | --sqlite PATH) --worker-id ID --exec-log
/// PATH [--clock-offset-ms MS]`: runs until killed.
pub fn main(args: &[String]) -> Result<()> {
    let worker_id = value(args, "--worker-id").context("--worker-id ID is required")?;
    let log_path = value(args, "--exec-log").context("--exec-log PATH is required")?;
    let offset: i64 = match value(args, "--clock-offset-ms") {
        Some(ms) => ms.parse().with_context(|| {
            format!("--clock-offset-ms: `{ms}` is not a whole number of milliseconds")
        })?,
        None => 0,
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("could not open the execution log {log_path}"))?;
    let log = Arc::new(ExecLog(Mutex::new(file)));
    let config = WorkerConfig {
        worker_id: WorkerId(worker_id),
        queues: vec![("default".into(), 32)],
        lease: Duration::from_secs(5),
        heartbeat: Duration::from_secs(1),
        reap_interval: Duration::from_millis(500),
        poll_interval: Duration::from_millis(200),
        stats_interval: None,
        ..WorkerConfig::default()
    };
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let clock = SteppedClock(offset);
        let _handle = if let Some(path) = value(args, "--sqlite") {
            let store = SqliteStore::open(&path).await?;
            Worker::new(Arc::new(store), clock, config)
                .register(Parent(log.clone()))
                .register(Child(log))
                .spawn()
        } else if let (Some(url), Some(schema)) =
            (value(args, "--postgres"), value(args, "--schema"))
        {
            // The store keeps retrying while the database is away, so a worker started
            // during an outage waits for it instead of exiting.
            let mut store = None;
            for _ in 0..CONNECT_TRIES {
                match PgStore::connect(
                    PgConfig::new(url.clone()).schema(schema.clone()).pool_size(8),
                )
                .await
                {
                    Ok(connected) => {
                        store = Some(connected);
                        break;
                    }
                    Err(e) => {
                        eprintln!("chaos-worker: waiting for PostgreSQL: {e}");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
            let store = store.context("PostgreSQL stayed unreachable for two minutes")?;
            Worker::new(Arc::new(store), clock, config)
                .register(Parent(log.clone()))
                .register(Child(log))
                .spawn()
        } else {
            bail!("chaos-worker needs --postgres URL --schema NAME or --sqlite PATH");
        };
        println!("ready");
        std::future::pending::<()>().await;
        Ok(())
    })
}
