//! The `keel` command as a library: its argument definitions, its commands and the
//! `keel serve` router, so benchmarks and tests can run the HTTP API in-process.
//!
//! Every command connects to the store named by `--database-url` (or `KEEL_DATABASE_URL`),
//! prints a human table by default and a stable JSON document with `--json`, and exits
//! with a code a script can rely on (see [`exit`]).

pub mod commands;
pub mod config_cmd;
pub mod definitions;
pub mod exit;
pub mod health;
pub mod operate;
pub mod output;
pub mod schedules_cmd;
pub mod serve;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Whether a command line (program name first) asks for `--json`, read without the
/// parser: a line the parser refuses still gets its error in the form it asked for. Words
/// after `--` are values, not flags.
pub fn json_requested<I>(args: I) -> bool
where
    I: IntoIterator,
    I::Item: AsRef<std::ffi::OsStr>,
{
    args.into_iter()
        .skip(1)
        .take_while(|arg| arg.as_ref() != "--")
        .any(|arg| arg.as_ref() == "--json")
}

/// Operate a Keel store: queues, dead letters, instances, timers and health.
#[derive(Debug, Parser)]
#[command(name = "keel", version, about, long_about = None)]
pub struct Cli {
    /// The store: `sqlite://<file>` or `postgres://user@host/db`. Help never prints the
    /// variable's value (it may hold a password).
    #[arg(
        long,
        env = "KEEL_DATABASE_URL",
        hide_env_values = true,
        default_value = "sqlite://keel.db",
        global = true
    )]
    pub database_url: String,

    /// The PostgreSQL schema Keel's tables live in.
    #[arg(long, env = "KEEL_SCHEMA", default_value = "keel", global = true)]
    pub schema: String,

    /// The namespace to work in.
    #[arg(long, short = 'n', env = "KEEL_NAMESPACE", default_value = "default", global = true)]
    pub namespace: String,

    /// The configuration file (TOML): `alerts` for `health` and `serve`'s `/health`, the
    /// queue and priority defaults of `start` and `send`, the schedules of `schedules` and
    /// `serve`, everything for `config show`. Every other command takes nothing from it
    /// but still refuses a file that is missing or does not load.
    #[arg(long, env = "KEEL_CONFIG", global = true)]
    pub config: Option<PathBuf>,

    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Per queue and machine: ready, scheduled, executing, waiting, suspended, dead
    /// letters, oldest ready age and whether the queue is paused; paused queues that hold
    /// nothing unfinished; per machine, the last hour: completed, failed, average
    /// turnaround (insert to end, waits included), throughput, stuck leases and ready work
    /// no live worker can take.
    Status {
        /// Only this machine.
        #[arg(long)]
        machine: Option<String>,
    },
    /// Stop workers claiming from a queue (instances already running finish their step).
    Pause {
        /// The queue.
        queue: String,
    },
    /// Let workers claim from a paused queue again.
    Resume {
        /// The queue.
        queue: String,
    },
    /// Dead letters: list, inspect, retry, delete, purge.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// An instance: status, position, context, inbox, timers, children and history.
    Inspect {
        /// An instance id (`i42` or `42`) or `machine:key`.
        target: String,
    },
    /// An instance's history, newest first, a page at a time (`--before` the `next` of
    /// the previous page reads older entries).
    History(HistoryArgs),
    /// Start an instance of a machine.
    Start(StartArgs),
    /// The schedules of the `--config` file with their pause state (from the store when
    /// it is reachable) and next fire times; `pause` / `resume` one for every worker;
    /// `forget` the stored states of schedules the file no longer defines.
    Schedules {
        /// Pause, resume or forget; without one, list them.
        #[command(subcommand)]
        command: Option<SchedulesCommand>,
    },
    /// Send an event to an instance.
    Send {
        /// An instance id (`i42` or `42`) or `machine:key`.
        target: String,
        /// The event's name.
        event: String,
        /// The event's payload, a JSON value.
        #[arg(long)]
        payload: Option<String>,
        /// A key that makes a second send with the same key a no-op.
        #[arg(long)]
        dedup_key: Option<String>,
        /// How urgent the event is: critical, high, normal, low or bulk. While it is
        /// pending, its instance is claimed at this priority if that is more urgent
        /// (default: the `--config` file's for the event, else none).
        #[arg(long)]
        priority: Option<keel_core::Priority>,
    },
    /// Cancel an instance.
    Cancel {
        /// An instance id (`i42` or `42`) or `machine:key`.
        target: String,
        /// Cancel its live descendants too: at most 10 000 instances (the root included)
        /// and 32 levels deep; a cascade that reaches the count bound warns on stderr and
        /// reports `"complete": false`.
        #[arg(long)]
        cascade: bool,
        /// Why, recorded in the history.
        #[arg(long, default_value = "cancelled from the keel command line")]
        reason: String,
    },
    /// Timers per machine: armed, overdue, next due, last sweep.
    #[command(subcommand)]
    Timers(TimersCommand),
    /// Check the thresholds of the configuration's `alerts` sections; exit 0 healthy,
    /// 1 warning (or a file that does not load, or no threshold configured: name the file
    /// with `--config`; the file is checked before the store), 2 critical.
    Health,
    /// Create or bring up to date the store's tables.
    Migrate,
    /// Show the configuration a worker would apply (`--config` / `KEEL_CONFIG`), or check
    /// the file's sections against the machines the store knows.
    #[command(subcommand)]
    Config(config_cmd::ConfigCommand),
    /// Serve the event and instance API, `/metrics`, `/health` and the web dashboard
    /// (`/`) over HTTP.
    Serve {
        /// The address to listen on; loopback only without `--tokens`.
        #[arg(long, default_value = "127.0.0.1:7878")]
        listen: std::net::SocketAddr,
        /// The bearer tokens file (TOML `[[tokens]]` with `token`, `namespaces`, `access`).
        #[arg(long, env = "KEEL_TOKENS")]
        tokens: Option<PathBuf>,
        /// Chart definitions: a JSON file (one chart or an array) or a directory of
        /// them. With it, events and starts naming a machine, version or event they lack
        /// get 400, and the dashboard draws those charts for their instances.
        #[arg(long, env = "KEEL_DEFINITIONS")]
        definitions: Option<PathBuf>,
        /// Run no background worker. By default the server also runs one that runs no
        /// steps but fires due timers and join deadlines, fires the `--config`
        /// schedules and applies the `--config` retention, in every namespace, so HTTP
        /// workers alone need no Rust program beside them. Running it beside in-process
        /// workers that do the same is safe.
        #[arg(long)]
        no_worker: bool,
    },
    /// Instances of a machine, newest first, a page at a time.
    List(ListArgs),
    /// Workers seen by heartbeat that claim from the namespace: live or stale, and the
    /// machines each serves.
    Workers {
        /// Seen within this long counts as live (`30s`, `2m`).
        #[arg(long, default_value = "60s")]
        stale_after: String,
        /// Every worker, whichever namespaces it claims from.
        #[arg(long)]
        all_namespaces: bool,
    },
    /// Draw a chart from a definitions file as Mermaid or Graphviz DOT.
    Graph {
        /// The chart's name.
        machine: String,
        /// `mermaid` or `dot`.
        #[arg(long, value_enum, default_value_t = GraphFormat::Mermaid)]
        format: GraphFormat,
        /// The chart definitions (JSON: one chart or an array).
        #[arg(long, env = "KEEL_DEFINITIONS")]
        definitions: PathBuf,
        /// The version to draw (default: the newest in the file).
        #[arg(long)]
        version: Option<u32>,
    },
    /// Cancel a machine's runnable instances (with history) or delete its dead letters.
    #[command(group(clap::ArgGroup::new("what").required(true).args(["pending", "dlq"])))]
    Purge {
        /// The machine (when the store holds no instance, dead letter or recent worker of
        /// it in the namespace, nothing is done and a warning names the closest known one).
        machine: String,
        /// Cancel every runnable instance of the machine, not only the backlog: new ones
        /// that never ran, ones between two steps, ones waiting to retry a failed step
        /// (back-off), and ones an event woke; not those waiting for an event or for
        /// children, or suspended. Each is cancelled only if it is still runnable when
        /// its turn comes: one a worker claimed since it was read is left to its step.
        /// With each, its live
        /// descendants go too (of any machine, running ones included); the report counts
        /// and names them.
        #[arg(long)]
        pending: bool,
        /// Delete the machine's dead letters, except those whose instance is still
        /// suspended (a letter is the only way to retry its instance).
        #[arg(long)]
        dlq: bool,
        /// With `--dlq`, delete the letters of still suspended instances too: those
        /// instances stay suspended with nothing to retry them by (cancel them instead).
        #[arg(long, requires = "dlq")]
        include_suspended: bool,
        /// Confirms the purge.
        #[arg(long)]
        confirm: bool,
    },
    /// Move a chart's waiting instances from one version to another; exit 1 when some
    /// were left on the old version (refused, or running a step).
    Upgrade(UpgradeArgs),
}

/// How `graph` draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GraphFormat {
    /// A Mermaid `stateDiagram-v2`.
    Mermaid,
    /// Graphviz DOT.
    Dot,
}

/// `keel list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// The machine.
    pub machine: String,
    /// Only instances at this state (a step's name, or a chart state's key or path).
    #[arg(long)]
    pub state: Option<String>,
    /// Only instances with this status (`runnable`, `executing`, `awaiting_signal`,
    /// `awaiting_children`, `suspended`, `done`, `failed`, `cancelled`).
    #[arg(long)]
    pub status: Option<String>,
    /// Most to show (at most 1000).
    #[arg(long, default_value_t = operate::LIST_PAGE_DEFAULT)]
    pub limit: usize,
    /// Continue after this instance id (the `next` of the previous page).
    #[arg(long)]
    pub after: Option<String>,
}

/// `keel history`.
#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// An instance id (`i42` or `42`) or `machine:key`.
    pub target: String,
    /// Only entries older than this one: the `next` of the previous page.
    #[arg(long)]
    pub before: Option<String>,
    /// Most entries to show (1 to 1000).
    #[arg(long, default_value_t = operate::HISTORY_PAGE_DEFAULT)]
    pub limit: usize,
}

/// `keel upgrade`.
#[derive(Debug, Args)]
pub struct UpgradeArgs {
    /// The chart's name.
    pub machine: String,
    /// The version instances are on.
    #[arg(long)]
    pub from: u32,
    /// The version to move them to.
    #[arg(long)]
    pub to: u32,
    /// The chart definitions holding both versions (JSON: one chart or an array).
    #[arg(long, env = "KEEL_DEFINITIONS")]
    pub definitions: PathBuf,
    /// Where instances in an old state go: `OLD=NEW` (repeat for several).
    #[arg(long = "map", value_name = "OLD=NEW")]
    pub maps: Vec<String>,
    /// Show what would move and write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `keel start`.
#[derive(Debug, Args)]
pub struct StartArgs {
    /// The machine's name.
    pub machine: String,
    /// The machine's version (1 or more). Without it: the newest version a live worker
    /// serves for the machine in the namespace, else 1 (a note on stderr says which).
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
    pub version: Option<i32>,
    /// The initial context, a JSON object.
    #[arg(long)]
    pub context: Option<String>,
    /// A business key: `send` and `inspect` accept `machine:key` afterwards.
    #[arg(long)]
    pub key: Option<String>,
    /// Where the instance starts: `@init` for a chart, the first step's name for a step
    /// machine.
    #[arg(long, default_value = "@init")]
    pub at: String,
    /// The queue it runs in (default: the `--config` file's `name` for the machine, else
    /// `default`).
    #[arg(long)]
    pub queue: Option<String>,
    /// Its priority: critical, high, normal, low or bulk (default: the `--config` file's
    /// for the machine, else normal).
    #[arg(long)]
    pub priority: Option<keel_core::Priority>,
}

/// `keel dlq …`.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Dead letters, oldest first, a page at a time (the `next` id continues).
    List {
        /// Only this machine.
        #[arg(long)]
        machine: Option<String>,
        /// Most to show (1 to 1000).
        #[arg(long, default_value_t = commands::DLQ_LIST_DEFAULT)]
        limit: usize,
        /// Only dead letters after this one (`dl42` or `42`): the `next` of the last page.
        #[arg(long)]
        after: Option<String>,
    },
    /// One dead letter: the failing event, the error of every attempt.
    Inspect {
        /// Its id (`dl3` or `3`).
        id: String,
    },
    /// Make dead-lettered instances runnable again with a fresh attempt count.
    Retry {
        /// One dead letter's id.
        #[arg(conflicts_with_all = ["machine", "all"], required_unless_present = "machine")]
        id: Option<String>,
        /// Every dead letter of this machine (needs `--all`; when the store holds nothing of
        /// it in the namespace, nothing is done and a warning names the closest known one).
        #[arg(long, requires = "all")]
        machine: Option<String>,
        /// Confirms retrying every dead letter of `--machine`.
        #[arg(long, requires = "machine")]
        all: bool,
        /// Wait this long before the retry runs (`30s`, `5 minutes`).
        #[arg(long)]
        delay: Option<String>,
    },
    /// Delete one dead letter whose instance is no longer suspended (cancelled, ended,
    /// retried through another letter, or gone), so `status` and `health` stop counting
    /// it. A letter whose instance is still suspended is refused: retry it, or cancel the
    /// instance first.
    Delete {
        /// Its id (`dl3` or `3`).
        id: String,
    },
    /// Delete dead letters older than an age, except those whose instance is still
    /// suspended (a letter is the only way to retry its instance).
    Purge {
        /// The age (`7d`, `12 hours`).
        #[arg(long)]
        older_than: String,
        /// Delete the letters of still suspended instances too: those instances stay
        /// suspended with nothing to retry them by (cancel them instead).
        #[arg(long)]
        include_suspended: bool,
        /// Confirms the deletion.
        #[arg(long)]
        confirm: bool,
    },
}

/// `keel schedules …`.
#[derive(Debug, Subcommand)]
pub enum SchedulesCommand {
    /// Stop every worker firing a schedule of the `--config` file (stored in the database;
    /// ticks passed while paused are never fired later).
    Pause {
        /// The schedule's name (`[schedules.<name>]`).
        name: String,
    },
    /// Let every worker fire a paused schedule again, from its first tick after now. When
    /// it ends a stored pause, a fired tick recorded more than 5 s ahead of this host's
    /// clock (by a clock that ran ahead) is re-anchored at now, and the report says so:
    /// ticks between now and the old record may fire again. Resuming a running schedule
    /// changes nothing.
    Resume {
        /// The schedule's name (`[schedules.<name>]`).
        name: String,
    },
    /// Delete stored states (pause, recorded tick) that no schedule of the `--config` file
    /// defines, in the namespaces its schedules act in; they count toward the namespace's
    /// limit of 1000 stored states until deleted. Another deploy's keel.toml in the same
    /// namespace may still define them: forget one only if no other deploy's file does.
    /// A state used within the last 24 hours (a recorded tick or a pause or resume) is
    /// refused unless --force.
    Forget {
        /// The leftover states to delete: `NAME`, or `NAMESPACE/NAME` when the name is
        /// left over in several namespaces.
        #[arg(value_name = "NAME", conflicts_with = "all")]
        names: Vec<String>,
        /// Delete every leftover state `keel schedules` lists.
        #[arg(long)]
        all: bool,
        /// Delete states used within the last 24 hours too (a worker may still serve them:
        /// its pause is dropped and it fires again).
        #[arg(long)]
        force: bool,
    },
}

/// `keel timers …`.
#[derive(Debug, Subcommand)]
pub enum TimersCommand {
    /// Armed and overdue timers per machine.
    Status,
}
