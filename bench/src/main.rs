//! `keel-bench`: Keel's benchmarks, normally run through `cargo xtask bench [SCENARIO]`.
//!
//! Scenarios:
//! - `steps`: no-op step throughput, draining N instances at worker concurrency 1, 10, 100
//!   and 500;
//!   with `--queue redis|sqs`, the instances are announced through that queue and the
//!   worker claims what it is told about;
//! - `chart`: a 3-state chart with one external signal per instance — macrosteps and
//!   transitions per second, and signal → step-start latency p50 / p99 with the store's
//!   notifications on and off, or with `--queue redis|sqs` through that queue;
//! - `timers`: N timers due at the same instant — time until the last one fired, and
//!   lateness p50 / p99;
//! - `http`: `keel serve` on loopback — events accepted per second and worker-protocol
//!   steps per second with 16 concurrent HTTP clients;
//! - `parallel`: a parallel state whose regions sleep 500 ms and 200 ms — event → `@done`
//!   inline and dispatched, and the dispatch overhead;
//! - `start`: single start p50 / p99, bulk start rate, and the process's memory with a
//!   worker holding 10 000 parked instances;
//! - `ui`: the dashboard's pages with `--ui-instances` (default 100 000) instances in the
//!   store — p50 / p95 / max per page.
//! - `fairness` (PostgreSQL only): claim latency with N ready rows on one busy concurrency
//!   key and one ready row on another (`--fairness-rows`, default 100 000).
//! - `prune` (PostgreSQL only): pruning N ended instances while claiming — claim latency
//!   p50 / p99 / max before and during pruning.
//!
//! Without a scenario named, `steps`, `chart`, `timers`, `parallel` and `start` run. Every
//! scenario prints a table and writes JSON to `target/bench/<scenario>-<store>.json`.

mod fairness;
mod http;
mod prune;
mod queues;
mod report;
mod scenarios;
mod starts;
mod stores;
mod ui;

use anyhow::Result;
use clap::{Parser, ValueEnum};

/// The allocator the `keel` binary ships with; the figures are measured on it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keel benchmarks.
#[derive(Debug, Parser)]
#[command(name = "keel-bench", about = "Keel benchmarks: start, steps, chart, timers, parallel")]
struct Cli {
    /// Which scenarios to run, one after another (default: start, steps, chart, timers,
    /// parallel — start first, so that its memory rows measure a fresh process; name http,
    /// ui, prune or fairness to run them).
    #[arg(value_enum)]
    scenarios: Vec<Scenario>,
    /// The store to run against.
    #[arg(long, value_enum, default_value_t = stores::StoreKind::Memory)]
    store: stores::StoreKind,
    /// The queue carrying ready-work hints in `steps` and `chart` (none: the store's own
    /// wake-ups).
    #[arg(long, value_enum, default_value_t = queues::QueueKind::None)]
    queue: queues::QueueKind,
    /// Instances for `steps`, and the bulk-start count in `start` (default 50 000).
    #[arg(long, default_value_t = 50_000)]
    instances: usize,
    /// Worker concurrencies for `steps` (default 1,10,100,500).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10, 100, 500])]
    concurrency: Vec<usize>,
    /// Bytes of context each `steps` instance carries (default 0: an empty context). The
    /// steps leave it unchanged, as most steps do.
    #[arg(long, default_value_t = 0)]
    context_bytes: usize,
    /// Instances for `chart` (default 5 000).
    #[arg(long, default_value_t = 5_000)]
    chart_instances: usize,
    /// Timers for `timers` (default 50 000).
    #[arg(long, default_value_t = 50_000)]
    timers: usize,
    /// Events for `http` (default 20 000).
    #[arg(long, default_value_t = 20_000)]
    http_events: usize,
    /// Worker-protocol steps for `http` (default 5 000).
    #[arg(long, default_value_t = 5_000)]
    http_steps: usize,
    /// Instances in the store for `ui` (default 100 000).
    #[arg(long, default_value_t = 100_000)]
    ui_instances: usize,
    /// Ended instances for `prune` (default 1 000 000).
    #[arg(long, default_value_t = 1_000_000)]
    prune_instances: usize,
    /// Ready rows on the busy key for `fairness` (default 100 000).
    #[arg(long, default_value_t = 100_000)]
    fairness_rows: usize,
    /// The workers' `claim_ahead`, in milliseconds (0 claims only free slots).
    #[arg(long, default_value_t = 5)]
    claim_ahead_ms: u64,
    /// Where JSON results go.
    #[arg(long, default_value = "target/bench")]
    out: std::path::PathBuf,
}

/// A benchmark scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// No-op step throughput.
    Steps,
    /// Chart transitions and signal latency.
    Chart,
    /// A burst of due timers.
    Timers,
    /// Inline vs dispatched parallel regions.
    Parallel,
    /// Single and bulk starts, and memory with parked instances.
    Start,
    /// `keel serve`: events and worker-protocol steps per second over HTTP.
    Http,
    /// The dashboard's page times with many instances in the store.
    Ui,
    /// Pruning ended instances on PostgreSQL: claim latency before and during.
    Prune,
    /// Claim latency with one busy concurrency key holding many ready rows (PostgreSQL).
    Fairness,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let scenarios = if cli.scenarios.is_empty() {
        vec![
            Scenario::Start,
            Scenario::Steps,
            Scenario::Chart,
            Scenario::Timers,
            Scenario::Parallel,
        ]
    } else {
        cli.scenarios.clone()
    };
    scenarios::set_claim_ahead(std::time::Duration::from_millis(cli.claim_ahead_ms));
    std::fs::create_dir_all(&cli.out)?;
    let store = stores::Factory::new(cli.store).await?;
    eprintln!("keel-bench: store {} ({})", cli.store.name(), store.describe());
    for (i, scenario) in scenarios.into_iter().enumerate() {
        let report = match scenario {
            Scenario::Steps => {
                scenarios::steps(
                    &store,
                    cli.instances,
                    &cli.concurrency,
                    cli.queue,
                    cli.context_bytes,
                )
                .await?
            }
            Scenario::Chart => scenarios::chart(&store, cli.chart_instances, cli.queue).await?,
            Scenario::Timers => scenarios::timers(&store, cli.timers).await?,
            Scenario::Parallel => scenarios::parallel(&store, 10).await?,
            Scenario::Start => starts::start(&store, cli.instances, i > 0).await?,
            Scenario::Http => http::http(&store, cli.http_events, cli.http_steps).await?,
            Scenario::Ui => ui::ui(&store, cli.ui_instances).await?,
            Scenario::Prune => prune::prune(&store, cli.prune_instances).await?,
            Scenario::Fairness => fairness::fairness(&store, cli.fairness_rows).await?,
        };
        report.print();
        let suffix = match (scenario, cli.queue) {
            (Scenario::Steps | Scenario::Chart, q) if q != queues::QueueKind::None => {
                format!("-{}", q.name())
            }
            _ => String::new(),
        };
        let path = cli.out.join(format!("{}-{}{suffix}.json", report.name, cli.store.name()));
        std::fs::write(&path, serde_json::to_vec_pretty(&report.json(cli.store.name()))?)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
