//! # Keel: durable state machines
//!
//! Keel runs many long-lived **instances** of a machine — a statechart, or a list of async
//! steps — and commits every step an instance takes (its new state, its context, the
//! events it consumed and sent, its timers) to a database before the next one starts. A
//! crash, a deploy or a Ctrl-C loses nothing: the next worker carries on from the last
//! commit.
//!
//! This crate is the one dependency an application needs. It re-exports what user code
//! names, opens the store a URL points at with [`Keel::connect`], and hands out one
//! client type ([`Client`], which [`Keel`] dereferences to) and workers
//! ([`Keel::worker`]) — no generic parameters in user code.
//!
//! ## Quickstart
//!
//! A ticket chart and a step machine, run by one worker on an in-memory SQLite database:
//!
//! ```
//! use keel::{
//!     ChartMachine, Definition, Keel, MachineRef, NewInstance, NewSignal, Outcome, Status,
//!     StepContext, StepError, StepMachine, json,
//! };
//!
//! /// A step machine: one step that greets the name in its context and finishes.
//! struct Greeter;
//!
//! #[keel::async_trait]
//! impl StepMachine for Greeter {
//!     fn machine(&self) -> MachineRef {
//!         MachineRef::new("greeter", 1)
//!     }
//!     async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
//!         let name = ctx.context["name"].as_str().unwrap_or("world");
//!         Ok(Outcome::Done { result: json!({ "greeting": format!("hello, {name}") }), step: None })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let keel = Keel::connect("sqlite::memory:").await?;
//!
//! let ticket = Definition::builder("ticket", 1)
//!     .initial("open")
//!     .state("open", |s| s.on_to("START", "in_progress"))
//!     .state("in_progress", |s| s.entry("stamp").on_to("CLOSE", "closed"))
//!     .final_state("closed")
//!     .build()?;
//! let ticket = ChartMachine::new(ticket).action("stamp", |ctx, _event| async move {
//!     ctx.set("started", true);
//!     Ok(())
//! });
//!
//! let worker = keel.worker().register(ticket.clone())?.register(Greeter)?.spawn()?;
//!
//! let id = keel.start(ticket.new_instance(json!({}))).await?.id();
//! keel.send(NewSignal::new(id, "START")).await?;
//! keel.send(NewSignal::new(id, "CLOSE")).await?;
//! let ended = keel.wait(id).await?;
//! assert_eq!(ended.status, Status::Done);
//! assert!(ended.state.matches("closed"));
//! assert_eq!(ended.result.unwrap()["started"], json!(true));
//!
//! let hello = keel
//!     .start(NewInstance::new(MachineRef::new("greeter", 1), "greet").context(json!({ "name": "Ada" })))
//!     .await?
//!     .id();
//! assert_eq!(keel.wait(hello).await?.result.unwrap()["greeting"], "hello, Ada");
//!
//! worker.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! ## Choosing a backend
//!
//! | URL | feature | what it is for |
//! |---|---|---|
//! | `sqlite://keel.db` | `sqlite` (default) | one process, durable in a file, nothing to install; several processes may share the file, but only one writes at a time and wake-ups stay inside each process (a queue of hints carries them across, see below) |
//! | `sqlite::memory:` | `sqlite` (default) | tests and demos: the real SQL store, gone with the process |
//! | `postgres://user@host/db` | `postgres` | many workers on many machines; `SKIP LOCKED` claims and LISTEN/NOTIFY wake-ups; tables in the schema `keel` (see [`ConnectOptions::schema`]); TLS as libpq's `sslmode` (`disable`, `prefer` the default, `require`, `verify-ca`, `verify-full`; roots from `sslrootcert=<PEM file>` or the system) |
//! | `memory://` | `testkit` | the in-memory reference store, with `Keel::testing` for a virtual clock |
//!
//! Wake-ups between processes can also travel through a queue of "work is ready" hints:
//! Redis (feature `redis`) or Amazon SQS (feature `sqs`), given with [`Keel::with_queue`];
//! see [`queue`]. The database stays the only source of truth.
//!
//! Two copies of one program on one host that share a store need distinct worker names,
//! such as `keel.worker_with(WorkerConfig::named("billing-1"))`, each kept across restarts:
//! a starting worker takes back the leases held under its id, and the default id
//! ([`WorkerConfig::worker_id`]) is the host and the program's name, so a second copy
//! would take the first one's live work and run those steps twice.
//!
//! ```toml
//! [dependencies]
//! keel = { version = "0.1", features = ["postgres"] }
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! ```
//!
//! ## Steps are re-run after a crash
//!
//! A step is the unit of re-execution: a crash before its commit runs it again from the
//! start, so effects inside a step (a payment call, an e-mail) must be idempotent — pass
//! the instance id as an idempotency key. Inside a step, `?` turns any
//! [`std::error::Error`] into a retryable [`StepError`]; use [`StepError::fatal`] or
//! [`NonRetryable::non_retryable`] for failures that another attempt cannot fix.
//!
//! ## Your own types
//!
//! Contexts and payloads are JSON in the store; code can stay typed at both ends.
//! Start with [`NewInstance::context_of`] or [`ChartMachine::new_instance_of`], send with
//! [`NewSignal::payload_of`]; read with [`StepContext::context_as`],
//! [`StepContext::payload_as`] (a signal's payload, in a step), [`Event::payload_as`] and,
//! in chart actions and guards, `ctx.get_as` / `ctx.set_from` and
//! `ChartBuilder::guard_typed`; answer with [`Outcome::next_with`], [`Outcome::await_with`]
//! or [`Outcome::done_with`]; read the result with [`Ended::result_as`]. A context or a
//! payload read through the [`StepContext`] that does not fit its type is a fatal
//! [`StepError`] naming the instance (and the event): it will not fit on a later attempt
//! either. Any other serde error inside a step, [`Signal::payload_as`]'s included, is a
//! retryable [`StepError`] through `?`.
//!
//! ## Logs and metrics
//!
//! Keel logs through [`tracing`](https://docs.rs/tracing) and counts through
//! [`metrics`](https://docs.rs/metrics); it installs neither a subscriber nor a recorder.
//! With the `prometheus` feature, `keel::prometheus::serve(addr)` installs a recorder and
//! serves the counts as Prometheus text at `http://addr/metrics`.
//! For logs on stderr, add `tracing-subscriber = "0.3"` and `tracing = "0.1"` to your
//! dependencies and call, at the start of `main`:
//!
//! ```text
//! tracing_subscriber::fmt().with_max_level(tracing::Level::INFO).init();
//! ```
//!
//! ## Timer precision
//!
//! `after` and `every` timers are rows in the store, fired by the sweeper each worker runs
//! (see [`WorkerConfig::timers`]). A timer never fires before its due time by the clock of
//! the worker that sweeps it; with the default settings it fires within about 100 ms plus
//! one sweep's duration of its due time. It fires later only while the ready backlog is
//! above the sweeper's backpressure threshold, or when no sweeper in the process heard of
//! it (a timer armed by another process on the same SQLite file): then at the latest one
//! sweep cadence (60 s by default) after it fell due.
//! Time is kept in milliseconds since the epoch, read from each process's clock: the due
//! time from the clock of the process that armed the timer, so clock skew between hosts
//! shifts fires by that skew, earlier or later. Run NTP on every worker host.

mod connect;
#[cfg(feature = "prometheus")]
pub mod prometheus;
pub mod settings;
mod shutdown;
mod store;
mod worker;

pub use connect::ConnectOptions;
pub use shutdown::shutdown_signal;
pub use store::AnyStore;
pub use worker::{RegistrationError, WorkerBuilder};

pub use async_trait::async_trait;
pub use serde_json::{Value, json};

pub use keel_core::chart::{ActionError, Definition, Event, Limits, Migration, Timer};
pub use keel_core::config::{
    AlertThresholds, DeadLetterConfig, KeelConfig, OnDeadLetter, ParallelConfig, QueueConfig,
    Strategy,
};
pub use keel_core::inbox::InboxOrder;
pub use keel_core::instance::{NewInstance, NewSignal, Signal, SignalTarget};
pub use keel_core::join::Join;
pub use keel_core::ports::store::{DeadLetterFilter, DeliveryOutcome, InsertOutcome};
pub use keel_core::ports::{Clock, Store};
pub use keel_core::retention::{MachineRetention, RetentionConfig};
pub use keel_core::retry::{Backoff, Jitter, RetryPolicy};
pub use keel_core::schedule::{
    BroadcastAction, MissedTicks, Schedule, ScheduleAction, ScheduleError, ScheduleInfo,
};
pub use keel_core::{
    DeadLetterId, ErrorKind, HistoryKind, Instance, InstanceId, MachineRef, Outcome, Priority,
    Status, StatusSet, StoreError, StoreResult, Timestamp, WorkerId,
};
pub use keel_scheduler::worker::WorkerStats;
pub use keel_scheduler::{
    ActionContext, Broadcast, Cancel, ChartMachine, DeadLetterRetry, Ended, NonRetryable,
    Schedules, StateValue, StepContext, StepError, StepMachine, SweepConfig, SweepGroup,
    WorkerConfig, WorkerHandle,
};
/// The clock `Keel::testing` takes: tests move time with [`VirtualClock::advance`].
#[cfg(feature = "testkit")]
pub use keel_testkit::VirtualClock;

/// The layers under this crate, for what it does not re-export: the pure semantics
/// (chart definitions in full, outcomes, the rest of the configuration types, the rest of
/// the ports), the runtime, and each backend enabled by a feature.
pub mod layers {
    pub use keel_core as core;
    pub use keel_scheduler as scheduler;
    #[cfg(feature = "postgres")]
    pub use keel_store_postgres as postgres;
    #[cfg(feature = "sqlite")]
    pub use keel_store_sqlite as sqlite;
    #[cfg(feature = "testkit")]
    pub use keel_testkit as testkit;
}

/// Wake-up transports. A connection given a queue ([`Keel::with_queue`]) announces on it
/// the instances its starts and sends make ready, and each worker made from it publishes
/// a hint for every instance its commits make ready and claims hinted instances by id as
/// they arrive, next to its usual polling. The store stays the only truth: a lost hint
/// (a queue flushed or down) only delays its work until a worker's repair pass publishes
/// it again ([`queue::HintConfig::repair_after`]) or polling finds it.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use keel::queue::redis::{RedisQueue, RedisQueueConfig};
/// use keel::queue::HintConfig;
/// use std::sync::Arc;
///
/// // `connect_lazy` gives the queue even while Redis is down (its calls fail until it is
/// // back, and the worker polls meanwhile); `connect` fails at once instead.
/// let hints = RedisQueue::connect_lazy(RedisQueueConfig::new("redis://127.0.0.1:6379", "orders")).await?;
/// let keel = keel::Keel::connect("postgres://app@db/app").await?
///     .with_queue(Arc::new(hints), HintConfig::default())?;
/// # Ok(()) }
/// ```
pub mod queue {
    pub use keel_core::ports::Queue;
    #[cfg(feature = "redis")]
    pub use keel_queue_redis as redis;
    #[cfg(feature = "sqs")]
    pub use keel_queue_sqs as sqs;
    pub use keel_scheduler::{HintConfig, HintStats};
}

use keel_scheduler::SystemClock;
use std::sync::Arc;

/// The client: start instances, send them events, wait for their results, cancel them,
/// look at them, operate dead letters and queues. Cheap to clone.
pub type Client = keel_scheduler::Client<AnyStore, AnyClock>;

/// Any [`Clock`] behind one type: the system clock in production, a virtual one in tests
/// (`Keel::testing`, with the `testkit` feature).
#[derive(Clone)]
pub struct AnyClock(Arc<dyn Clock>);

impl AnyClock {
    /// Wraps `clock`.
    pub fn new(clock: impl Clock) -> Self {
        AnyClock(Arc::new(clock))
    }
}

impl Clock for AnyClock {
    fn now(&self) -> Timestamp {
        self.0.now()
    }
}

/// Everything that can go wrong in this crate's own calls.
///
/// Its `Debug` output is its message, so `fn main() -> Result<(), Box<dyn Error>>` prints
/// a sentence a person can act on rather than a struct dump.
#[derive(thiserror::Error)]
pub enum Error {
    /// A URL Keel cannot use.
    #[error("cannot use the store URL {url:?}: {message}")]
    Url {
        /// The URL, password removed.
        url: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The store could not be opened or migrated.
    #[error("cannot open the store at {url}: {error}")]
    Connect {
        /// The URL, password removed.
        url: String,
        /// The store's error, already part of this error's message (so it is not also
        /// its `source()`, which would make error reporters print it twice).
        error: StoreError,
    },
    /// A store call failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A machine cannot be registered as given.
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    /// A worker's or a queue link's settings are out of bounds ([`WorkerConfig`],
    /// [`queue::HintConfig`]); the message names the field and the fix.
    #[error("{0}")]
    Settings(String),
    /// The configuration file cannot be used.
    #[error("configuration {file}: {message}")]
    Config {
        /// The file, or `(defaults)` when only the environment was read.
        file: String,
        /// What is wrong, naming the key and the fix.
        message: String,
    },
}

impl Error {
    pub(crate) fn url(url: &str, message: &str) -> Self {
        Error::Url { url: keel_core::redact_url(url), message: message.to_owned() }
    }

    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres")),
        allow(dead_code, reason = "only the database stores can fail to open")
    )]
    pub(crate) fn connect(url: impl Into<String>, error: StoreError) -> Self {
        Error::Connect { url: url.into(), error }
    }

    #[allow(dead_code, reason = "used only when a backend feature is off")]
    pub(crate) fn feature(url: &str, feature: &str) -> Self {
        Error::url(
            url,
            &format!(
                "this build of keel has no `{feature}` feature; enable it in Cargo.toml: keel = {{ version = \"0.1\", features = [\"{feature}\"] }}"
            ),
        )
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// A connection to Keel: the [`Client`] (through `Deref`) plus [`worker`](Self::worker)s
/// on the same store.
#[derive(Clone)]
pub struct Keel {
    client: Client,
    store: AnyStore,
    clock: AnyClock,
    described: String,
    /// The queue of hints its workers receive from, and how ([`Keel::with_queue`]).
    hints: Option<(Arc<dyn keel_core::ports::Queue>, keel_scheduler::HintConfig)>,
}

/// What configuration errors name as their file when the settings came through
/// [`Keel::with_settings`].
const GIVEN_SETTINGS: &str = "given to `Keel::with_settings`";

impl Keel {
    /// Opens the store `url` names (see the table in the crate docs), bringing its schema
    /// up to date, with the system clock.
    pub async fn connect(url: &str) -> Result<Keel, Error> {
        Self::connect_with(url, ConnectOptions::default()).await
    }

    /// [`connect`](Self::connect) with settings.
    pub async fn connect_with(url: &str, options: ConnectOptions) -> Result<Keel, Error> {
        let (store, described) = connect::open(url, &options).await?;
        Ok(Self::assemble(store, AnyClock::new(SystemClock), described))
    }

    /// Uses a store you built yourself (any [`Store`]), with the system clock.
    pub fn from_store(store: impl Store) -> Keel {
        Self::assemble(AnyStore::new(store), AnyClock::new(SystemClock), "a custom store".into())
    }

    /// The in-memory store driven by `clock`: tests move time with
    /// [`VirtualClock::advance`] instead of sleeping; a worker's timer sweep reads the
    /// clock at least every 250 ms, so a timer the advance makes due fires about that soon.
    ///
    /// Everything else the engine times is on that clock too: retry back-offs, delayed
    /// starts and leases. A step that fails once is tried again only after an `advance`
    /// past its back-off, however long the test waits; a delayed start runs once the clock
    /// reaches it; and an `advance` past the lease while a step runs expires its lease, so
    /// the reaper may hand the step to a worker again and run it a second time.
    #[cfg(feature = "testkit")]
    pub fn testing(clock: VirtualClock) -> Keel {
        Self::assemble(
            AnyStore::new(keel_testkit::MemoryStore::new()),
            AnyClock::new(clock),
            "in memory, virtual clock (testkit)".into(),
        )
    }

    fn assemble(store: AnyStore, clock: AnyClock, described: String) -> Keel {
        let client = Client::new(Arc::new(store.clone()), clock.clone());
        Keel { client, store, clock, described, hints: None }
    }

    /// The same connection with a queue of ready-work hints: its client announces on
    /// `queue` each instance a start makes ready (a delayed start when it is due) and each
    /// target a send wakes, and every worker made from it afterwards receives hints from
    /// `queue` with `config` and publishes one for each instance its commits make ready.
    /// A worker so woken claims the hinted instance at once, without waiting for its poll
    /// or for the store's own notifications (which SQLite cannot send between
    /// processes). Give every process of a deployment the same queue. A bad `config` is
    /// an error naming the field.
    pub fn with_queue(
        mut self,
        queue: Arc<dyn keel_core::ports::Queue>,
        config: keel_scheduler::HintConfig,
    ) -> Result<Keel, Error> {
        worker::check_hints(&config, queue.as_ref())?;
        self.client = self.client.with_queue(Arc::clone(&queue));
        self.hints = Some((queue, config));
        Ok(self)
    }

    /// The same connection with a configuration file ([`settings::load`] reads one): its
    /// client applies the file's priorities and queue names to what it starts and sends
    /// (see `Client::with_settings`), and every worker made from it afterwards
    /// ([`worker`](Self::worker), [`worker_with`](Self::worker_with),
    /// [`configured_worker`](Self::configured_worker)) applies the whole file as
    /// `WorkerConfig::with_settings` does — it serves the queues the file starts instances
    /// in, so what this client starts is claimed. A file a worker cannot apply (a key it
    /// would not apply, a bad retention or schedule; [`settings::load`] already refuses the
    /// first) makes that worker's [`spawn`](WorkerBuilder::spawn) fail with
    /// [`Error::Config`], before anything runs.
    #[must_use]
    pub fn with_settings(mut self, settings: KeelConfig) -> Keel {
        self.client = self.client.with_settings(settings);
        self
    }

    /// The client (also reachable through `Deref`: `keel.start(…)`).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The store, type-erased.
    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// Which store this is, for banners and logs (passwords removed).
    pub fn describe(&self) -> &str {
        &self.described
    }

    /// A worker on this store with the default [`WorkerConfig`] (and the file given to
    /// [`with_settings`](Self::with_settings), if any). Its id is the host and the
    /// program's name: a second copy of the program on this host sharing the store needs
    /// [`worker_with`](Self::worker_with)`(WorkerConfig::named(..))`, or each copy would
    /// take back the other's live leases when it starts.
    /// Within one process, workers of this `Keel` are kept apart for you (see
    /// [`WorkerConfig::worker_id`](keel_scheduler::WorkerConfig::worker_id)).
    pub fn worker(&self) -> WorkerBuilder {
        self.worker_with(WorkerConfig::default())
    }

    /// A worker on this store with `config`, to which the file given to
    /// [`with_settings`](Self::with_settings), if any, is applied
    /// (`WorkerConfig::with_settings`). A `config` that carries a file of its own
    /// ([`WorkerConfig::settings`](keel_scheduler::WorkerConfig::settings)) different
    /// from the `Keel`'s makes the worker's [`spawn`](WorkerBuilder::spawn) fail with
    /// [`Error::Config`]: the client would start instances by one file while the worker
    /// served them by the other.
    pub fn worker_with(&self, config: WorkerConfig) -> WorkerBuilder {
        let own = own_queues(&config);
        let Some(file) = self.client.settings() else { return self.builder(config, own) };
        let applied = match own_settings_differ(&config, file) {
            Some(e) => Err(e),
            None => apply(config, file.clone(), GIVEN_SETTINGS),
        };
        match applied {
            Ok(config) => self.builder(config, own),
            // Never spawned: `spawn` returns the error.
            Err(e) => {
                let config = WorkerConfig::default();
                let own = own_queues(&config);
                self.builder(config, own).refuse(e)
            }
        }
    }

    /// A worker on this store configured by the file at `path`, or at `$KEEL_CONFIG` when
    /// `path` is `None`, with the environment overrides applied ([`settings::load`]). A key
    /// the worker would not apply, or a bad value, is an error here, before anything runs.
    ///
    /// On a `Keel` given a file with [`with_settings`](Self::with_settings), the client
    /// and its workers follow one file: with no `path` and no `$KEEL_CONFIG` the worker
    /// applies the `Keel`'s file; a file named here is read as above and must equal the
    /// `Keel`'s, else this is an [`Error::Config`] (the client would start instances in
    /// queues by one file while the worker served them by the other). So must a file
    /// `config` carries already
    /// ([`WorkerConfig::settings`](keel_scheduler::WorkerConfig::settings)).
    pub fn configured_worker(
        &self,
        config: WorkerConfig,
        path: Option<&std::path::Path>,
    ) -> Result<WorkerBuilder, Error> {
        let label = || path.map_or_else(|| "$KEEL_CONFIG".to_owned(), |p| p.display().to_string());
        let names_file = path.is_some() || std::env::var_os(settings::CONFIG_VAR).is_some();
        let own = own_queues(&config);
        if let Some(e) =
            self.client.settings().and_then(|given| own_settings_differ(&config, given))
        {
            return Err(e);
        }
        let config = match (self.client.settings(), names_file) {
            (Some(given), false) => apply(config, given.clone(), GIVEN_SETTINGS)?,
            (given, _) => match (settings::load(path)?, given) {
                (Some(loaded), Some(given)) if loaded != *given => {
                    return Err(differs_from_given(label(), &loaded, given));
                }
                (Some(loaded), _) => apply(config, loaded, &label())?,
                (None, _) => config,
            },
        };
        Ok(self.builder(config, own))
    }

    /// A worker on this store with `config` as it is, and this connection's queue of hints;
    /// `own` are the queues the program gave it ([`own_queues`], taken before a file was
    /// applied).
    fn builder(&self, config: WorkerConfig, own: Vec<String>) -> WorkerBuilder {
        let builder = WorkerBuilder::new(self.store.clone(), self.clock.clone(), config, own);
        match &self.hints {
            Some((queue, hints)) => builder.hints_from(Arc::clone(queue), hints.clone()),
            None => builder,
        }
    }
}

/// The queues `config` claims from as the program set them, before a configuration file
/// adds its own.
fn own_queues(config: &WorkerConfig) -> Vec<String> {
    config.queues.iter().map(|(q, _)| q.clone()).collect()
}

/// The error for a worker's configuration file (`file` names it) that is not the one its
/// `Keel` was given (`given`).
fn differs_from_given(file: String, other: &KeelConfig, given: &KeelConfig) -> Error {
    let differ = settings::differences(other, given).join(", ");
    Error::Config {
        file,
        message: format!(
            "differs from the settings this Keel was given with `Keel::with_settings` (in \
             {differ}), so its client would start instances by one file while this worker \
             served them by the other; give both the same file (read with the same \
             environment), or give the worker no file of its own: \
             `keel.worker_with(config)` with `config.settings` unset applies the Keel's"
        ),
    }
}

/// The error when `config` carries a configuration file of its own
/// (`WorkerConfig::with_settings`) that is not `given`, the `Keel`'s.
fn own_settings_differ(config: &WorkerConfig, given: &KeelConfig) -> Option<Error> {
    let own = config.settings.as_deref().filter(|own| *own != given)?;
    Some(differs_from_given("`WorkerConfig::settings`".to_owned(), own, given))
}

/// `config` with the configuration file `settings` applied; an error names `file`.
fn apply(config: WorkerConfig, settings: KeelConfig, file: &str) -> Result<WorkerConfig, Error> {
    config
        .with_settings(settings)
        .map_err(|e| Error::Config { file: file.to_owned(), message: e.to_string() })
}

impl std::ops::Deref for Keel {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl std::fmt::Debug for Keel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keel").field("store", &self.described).finish_non_exhaustive()
    }
}
