//! Keel's Redis queue: ready-work hints for workers, held in Redis.
//!
//! The store stays the only truth; a hint only says "instance 42 is ready". Losing every
//! hint (a `FLUSHALL`, a restart without persistence) delays work until the repair pass
//! publishes it again, and never loses it.
//!
//! # Shape
//!
//! One sorted set per queue scores each hint with the millisecond from which it may be
//! handed out. Publishing with a delay sets that score in the future; receiving moves it
//! to the end of the lease; a nack or an extension moves it again; an ack removes it. A
//! receiver that crashes simply lets its lease run out, and the next receive hands the
//! hint out again, counted once more — no separate reclaim step to run or forget. Every
//! operation is one Lua script (atomic, on the server's clock). Receivers wait on a short
//! list with `BLPOP`, pushed whenever hints become visible, so a hint published to an idle
//! queue is picked up at once rather than at the next poll.
//!
//! A hint published again while it is leased is queued again: the receiver's receipt goes
//! stale, so its ack does not remove news that came after its delivery. An entry under the
//! queue's keys that is not a hint (written by another application or a script) is removed
//! when received and does not hold up the hints received with it. The removals are
//! counted ([`RedisQueue::junk_removed`]) and logged at `warn` at most once a minute,
//! naming the queue, its key and one such entry.
//!
//! A queue holds at most its capacity ([`RedisQueueConfig::capacity`], 100 000 hints by
//! default): a publish that takes it over removes the hints that have been visible the
//! longest without being received, counts them ([`RedisQueue::dropped`]) and warns at
//! most once a minute. It never removes a delayed or leased hint, nor the one it
//! publishes: a queue full of those stays over its capacity until they become visible. Hints that no worker receives (their queue's claims are left to
//! the claim loop, or every worker is gone) so cost a bounded amount of memory, and their
//! work is found by polling and the repair pass as after any other loss.
//!
//! A connection that stops answering without being closed (a NAT or firewall that forgot
//! it, a failover that moved the server's address) is replaced: the kernel's keepalive
//! probes and, on Linux, its user timeout close such a socket within about 20 s, and
//! [`TIMEOUTS_BEFORE_RECONNECT`] commands in a row that time out, or a receive's wait
//! that gets no answer [`RESPONSE_TIMEOUT`] after its end, open a new connection at once.
//! So does a command that the server refuses because it no longer takes writes
//! (`READONLY`: a primary that a failover turned into a replica; `MASTERDOWN`: a replica
//! cut off from its primary): when the URL's name or address has moved to the new
//! primary, the new connection reaches it, and the queue works again without a restart.
//! The command that was refused still fails.
//!
//! It needs Redis 6.0 or later (a receive waits fractions of a second); [`RedisQueue::connect`]
//! refuses an older server, naming its version.
//!
//! [`RedisQueue::connect`] needs the server to answer. [`RedisQueue::connect_lazy`] opens
//! the connections on first use instead: a worker started while Redis is down runs its
//! steps by polling the store, its queue calls fail with `Unavailable` until the server
//! answers, and hints flow from then on.
//!
//! What it does not do, and says so in [`QueueCapabilities`]: priorities and ordered
//! groups (hints visible at the same time come in publish order across all groups).
//!
//! ```no_run
//! # async fn demo() -> keel_core::StoreResult<()> {
//! use keel_core::ports::Queue;
//! use keel_core::ports::queue::Hint;
//! use keel_queue_redis::{RedisQueue, RedisQueueConfig};
//! let queue = RedisQueue::connect(RedisQueueConfig::new("redis://127.0.0.1:6379", "default")).await?;
//! queue.enqueue(vec![Hint::new(keel_core::InstanceId(42), 1)]).await?;
//! # Ok(()) }
//! ```

mod scripts;
pub mod testing;

use async_trait::async_trait;
use keel_core::limits::NAME_BYTES_MAX;
use keel_core::ports::Queue;
use keel_core::ports::queue::{
    Delivery, Hint, QueueCapabilities, validate_enqueue, validate_nack_delay, validate_receipts,
    validate_receive, validate_visibility,
};
use keel_core::{InstanceId, Priority, StoreError, StoreResult};
use redis::IntoConnectionInfo;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::socket2::TcpKeepalive;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// How long a command may take before the queue reports itself unavailable.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a (re)connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Commands in a row that may time out before the queue drops its connection and opens a
/// new one. A connection that goes silent without being closed (a NAT or firewall that
/// forgets it, a failover that moves the server's address, a hung proxy) is otherwise
/// kept until the kernel gives up on it, which can take a quarter of an hour.
pub const TIMEOUTS_BEFORE_RECONNECT: u32 = 2;
/// How long a connection may sit idle before the kernel checks, with keepalive probes,
/// that the other end is still there.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// The time between two keepalive probes that go unanswered.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// How long data sent on a connection may stay unacknowledged before the kernel closes it
/// (Linux only, `TCP_USER_TIMEOUT`); keepalive probes count as data.
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);
/// Most rounds of one receive that look again at once because they leased only entries
/// that are not hints.
const JUNK_ROUNDS_MAX: u32 = 8;
/// The least time, in seconds, between two warnings of one kind from one queue handle.
const WARNING_INTERVAL_SECS: u64 = 60;
/// The most characters of an entry's id that a warning shows.
const ENTRY_SHOWN_MAX: usize = 64;

/// The capacity of a queue whose settings name none.
pub const CAPACITY_DEFAULT: u64 = 100_000;
/// The oldest server the queue runs on, as (major, minor): a receive's `BLPOP` waits a
/// fraction of a second, which older servers refuse.
pub const SERVER_VERSION_MIN: (u32, u32) = (6, 0);

/// Connection settings.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisQueueConfig {
    /// A Redis URL, e.g. `redis://127.0.0.1:6379/0`, or `rediss://cache.example.com:6380/0`
    /// for TLS (the server's certificate is checked against the system's roots).
    pub url: String,
    /// The queue's name; its keys are `keel:{<name>}:…`.
    pub name: String,
    /// The most hints the queue holds; a publish beyond it removes the hints visible the
    /// longest without being received (see the crate doc). At least 1; default
    /// [`CAPACITY_DEFAULT`].
    pub capacity: u64,
}

impl std::fmt::Debug for RedisQueueConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisQueueConfig")
            .field("url", &keel_core::redact_url(&self.url))
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl RedisQueueConfig {
    /// Settings for queue `name` on the server at `url`, with the default capacity.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        RedisQueueConfig { url: url.into(), name: name.into(), capacity: CAPACITY_DEFAULT }
    }

    /// The same settings with room for at most `capacity` hints.
    #[must_use]
    pub fn capacity(mut self, capacity: u64) -> Self {
        self.capacity = capacity;
        self
    }
}

/// Checks the `redis_version` of an `INFO server` reply against [`SERVER_VERSION_MIN`];
/// a reply without one (a proxy that hides it) passes.
fn check_server_version(info: &str) -> Result<(), String> {
    let Some(version) = info.lines().find_map(|l| l.trim().strip_prefix("redis_version:")) else {
        return Ok(());
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let (major, minor) = (parts.next().flatten(), parts.next().flatten().unwrap_or(0));
    let (least_major, least_minor) = SERVER_VERSION_MIN;
    match major {
        Some(major) if (major, minor) < SERVER_VERSION_MIN => Err(format!(
            "server version {version} is older than {least_major}.{least_minor}, which the \
             queue needs (a receive waits fractions of a second); upgrade the server to Redis \
             {least_major}.{least_minor} or later"
        )),
        _ => Ok(()),
    }
}

/// Wakes every receiver waiting on a `Notify` when dropped.
struct WakeOnDrop<'a>(&'a tokio::sync::Notify);

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        self.0.notify_waiters();
    }
}

/// The keys of one queue.
#[derive(Debug, Clone)]
struct Keys {
    vis: String,
    body: String,
    count: String,
    wake: String,
}

/// The connection for every command but `BLPOP`, and what decides when to replace it.
struct Current {
    manager: ConnectionManager,
    /// How many times the connection was replaced; a command's answer or timeout counts only
    /// when it came on the connection in use now, not on one already replaced.
    generation: u64,
    /// Commands on this connection that timed out since the last one that was answered.
    timeouts: u32,
    /// The server on this connection refused a command because it takes no writes (see
    /// [`Failure::NoWrites`]); a later answer to a read does not clear it.
    refused: bool,
}

impl Current {
    /// Whether the connection is to be replaced.
    fn due(&self) -> bool {
        self.refused || self.timeouts >= TIMEOUTS_BEFORE_RECONNECT
    }
}

/// What a failed command says about the connection it was sent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// No answer in time: the connection may have gone silent. It is replaced after
    /// [`TIMEOUTS_BEFORE_RECONNECT`] of these in a row.
    Timeout,
    /// The server answered that it takes no writes: `READONLY` (a primary that a failover
    /// turned into a replica, or a URL that names a replica) or `MASTERDOWN` (a replica
    /// cut off from its primary). redis-rs keeps such a connection, and every write would
    /// fail on it until the process restarts; a new one reaches the new primary when the
    /// URL's name or address moved to it. Replaced at once. `LOADING` is not one of these:
    /// a server loading its data answers once it is done, and one that comes back as a
    /// replica answers `READONLY` then.
    NoWrites,
    /// Anything else (a closed connection, which redis-rs reopens by itself, or an error
    /// of the command): the connection is kept.
    Other,
}

/// How a script's error from Redis before 7.0 reads when it tried to write on a
/// read-only replica: the code is `ERR`, and this is in its message.
const READONLY_IN_SCRIPT: &str = "READONLY You can't write against a read only replica";

fn failure(e: &redis::RedisError) -> Failure {
    use redis::{ErrorKind, ServerErrorKind};
    if e.is_timeout() {
        return Failure::Timeout;
    }
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown) => {
            Failure::NoWrites
        }
        ErrorKind::Server(ServerErrorKind::ResponseError)
            if e.detail().is_some_and(|d| d.contains(READONLY_IN_SCRIPT)) =>
        {
            Failure::NoWrites
        }
        _ => Failure::Other,
    }
}

/// A `Queue` on Redis.
pub struct RedisQueue {
    name: String,
    keys: Keys,
    capacity: u64,
    /// Hints removed because the queue was over its capacity.
    dropped: AtomicU64,
    /// When the last warning about dropped hints was given, in seconds since
    /// `created` (`u64::MAX`: never).
    dropped_warned: AtomicU64,
    /// Entries under the queue's keys that receives removed because they were not hints.
    junk_removed: AtomicU64,
    /// When the last warning about removed entries was given, in seconds since `created`
    /// (`u64::MAX`: never).
    junk_warned: AtomicU64,
    created: Instant,
    /// Opens the connections, again when one stops answering.
    client: redis::Client,
    /// The settings of `conn`.
    settings: ConnectionManagerConfig,
    /// The settings of `blocking`.
    blocking_settings: ConnectionManagerConfig,
    /// The connection for every command but `BLPOP`. Replaced by a new one after
    /// [`TIMEOUTS_BEFORE_RECONNECT`] timeouts in a row, or at once when its server takes
    /// no writes ([`Failure::NoWrites`]); callers take a clone.
    conn: std::sync::Mutex<Current>,
    /// Held while `conn` is being replaced, so that one caller replaces it at a time.
    reconnecting: tokio::sync::Mutex<()>,
    /// A second connection for `BLPOP`, which would hold up every other command on a
    /// shared connection while it waits.
    blocking: tokio::sync::Mutex<ConnectionManager>,
    /// Set while a `BLPOP` runs on `blocking`; still set after it when its receive was
    /// dropped before the reply came, and the server still runs it.
    blocking_abandoned: AtomicBool,
    /// Woken whenever the receiver holding `blocking` stops waiting (its `BLPOP` returns,
    /// or its receive is dropped), for the receivers that wait while another holds it (several workers of a process share one queue).
    woken: tokio::sync::Notify,
}

impl std::fmt::Debug for RedisQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisQueue").field("name", &self.name).finish_non_exhaustive()
    }
}

/// What a queue is made of before its connections are opened: the checked settings.
struct Prepared {
    name: String,
    capacity: u64,
    /// The URL without its password, for messages.
    url: String,
    client: redis::Client,
    settings: ConnectionManagerConfig,
    blocking_settings: ConnectionManagerConfig,
}

impl RedisQueue {
    /// Connects to the server and checks that it answers and is Redis 6.0 or later.
    /// Errors show the URL without its password. A server that is not there fails this
    /// with `Unavailable`; [`RedisQueue::connect_lazy`] gives a queue that connects when
    /// the server is there.
    pub async fn connect(config: RedisQueueConfig) -> StoreResult<Self> {
        let p = Self::prepare(config)?;
        let url = &p.url;
        let unavailable =
            |e: redis::RedisError| StoreError::unavailable(format!("redis at {url}: {e}"));
        let conn = ConnectionManager::new_with_config(p.client.clone(), p.settings.clone())
            .await
            .map_err(unavailable)?;
        match redis::cmd("INFO").arg("server").query_async::<String>(&mut conn.clone()).await {
            Ok(info) => check_server_version(&info)
                .map_err(|e| StoreError::invalid(format!("redis at {url}: {e}")))?,
            // A server that does not answer was reported above; one that refuses `INFO`
            // (a proxy, a renamed command) cannot be checked.
            Err(e) if e.code().is_some() => {
                tracing::debug!(error = %e, "could not read the Redis server's version");
            }
            Err(e) => return Err(unavailable(e)),
        }
        let blocking =
            ConnectionManager::new_with_config(p.client.clone(), p.blocking_settings.clone())
                .await
                .map_err(unavailable)?;
        Ok(Self::assemble(p, conn, blocking))
    }

    /// A queue that opens its connections on first use, without waiting for the server:
    /// a process that starts while Redis is down (a failover, a maintenance window, a
    /// deploy that starts both together) still gets its queue. Until the server answers,
    /// every call fails with `Unavailable`, which a worker treats as a queue that is down:
    /// its claim loop polls the store and its hint loop tries again, and hints flow once
    /// the server is there. Only the settings are checked here (`Invalid`, naming the
    /// field). The server's version is not: on a server older than Redis 6.0 receives
    /// fail with the server's error.
    #[allow(
        clippy::unused_async,
        reason = "async like `connect`, and so called where a Tokio runtime runs: the \
                  connections' tasks are spawned on it"
    )]
    pub async fn connect_lazy(config: RedisQueueConfig) -> StoreResult<Self> {
        let p = Self::prepare(config)?;
        let url = p.url.clone();
        let lazy = |settings: &ConnectionManagerConfig| {
            ConnectionManager::new_lazy_with_config(p.client.clone(), settings.clone())
                .map_err(|e| StoreError::invalid(format!("url {url:?}: {e}")))
        };
        let (conn, blocking) = (lazy(&p.settings)?, lazy(&p.blocking_settings)?);
        Ok(Self::assemble(p, conn, blocking))
    }

    /// Checks the settings and builds the client, without connecting.
    fn prepare(config: RedisQueueConfig) -> StoreResult<Prepared> {
        let name = config.name;
        if config.capacity == 0 {
            return Err(StoreError::invalid(format!(
                "capacity: 0 would drop every hint; give at least 1 (the default is \
                 {CAPACITY_DEFAULT})"
            )));
        }
        let url = keel_core::redact_url(&config.url);
        if name.is_empty()
            || name.len() > NAME_BYTES_MAX
            || name.contains(['{', '}'])
            || name.chars().any(char::is_control)
        {
            return Err(StoreError::invalid(format!(
                "name {name:?}: a queue name is 1 to {NAME_BYTES_MAX} bytes without braces or \
                 control characters"
            )));
        }
        let invalid_url = |e: redis::RedisError| {
            StoreError::invalid(format!(
                "url {url:?}: {e}; expected redis://host:port[/db], or rediss://host:port[/db] \
                 for TLS"
            ))
        };
        let info = config.url.as_str().into_connection_info().map_err(invalid_url)?;
        if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
            // TLS (`rediss://`) checks the server's certificate against the system's
            // roots, with the aws-lc-rs provider unless the process installed another.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        }
        let tcp = info.tcp_settings().clone().set_keepalive(
            TcpKeepalive::new().with_time(KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL),
        );
        #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
        let tcp = tcp.set_user_timeout(TCP_USER_TIMEOUT);
        let client = redis::Client::open(info.set_tcp_settings(tcp)).map_err(invalid_url)?;
        let base = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_number_of_retries(1);
        let settings = base.clone().set_response_timeout(Some(RESPONSE_TIMEOUT));
        let blocking_settings = base.set_response_timeout(Some(
            keel_core::limits::HINT_WAIT_MAX + RESPONSE_TIMEOUT + RESPONSE_TIMEOUT,
        ));
        Ok(Prepared { name, capacity: config.capacity, url, client, settings, blocking_settings })
    }

    /// The queue on connections `conn` and `blocking`.
    fn assemble(p: Prepared, conn: ConnectionManager, blocking: ConnectionManager) -> Self {
        let Prepared { name, capacity, client, settings, blocking_settings, .. } = p;
        let prefix = format!("keel:{{{name}}}");
        let keys = Keys {
            vis: format!("{prefix}:vis"),
            body: format!("{prefix}:body"),
            count: format!("{prefix}:count"),
            wake: format!("{prefix}:wake"),
        };
        RedisQueue {
            name,
            keys,
            capacity,
            dropped: AtomicU64::new(0),
            dropped_warned: AtomicU64::new(u64::MAX),
            junk_removed: AtomicU64::new(0),
            junk_warned: AtomicU64::new(u64::MAX),
            created: Instant::now(),
            client,
            settings,
            blocking_settings,
            conn: std::sync::Mutex::new(Current {
                manager: conn,
                generation: 0,
                timeouts: 0,
                refused: false,
            }),
            reconnecting: tokio::sync::Mutex::new(()),
            blocking: tokio::sync::Mutex::new(blocking),
            blocking_abandoned: AtomicBool::new(false),
            woken: tokio::sync::Notify::new(),
        }
    }

    /// What every Redis queue can do: any delay at 1 ms, no priorities, no ordered groups.
    pub const CAPABILITIES: QueueCapabilities = QueueCapabilities {
        delay_max: None,
        ordered_groups: false,
        priorities: false,
        visibility_max: None,
        resolution: Duration::from_millis(1),
        hints_per_round_trip: keel_core::limits::HINT_BATCH_MAX,
    };

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many hints this handle's publishes removed because the queue was over its
    /// capacity (their work waits for polling or the repair pass).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// How many entries under the queue's keys this handle's receives removed because
    /// they were not Keel hints: an id that is not `<instance>:<revision>` or a body that
    /// is not `<priority level>|<group>`, written by another application or a script that
    /// uses the same keys, or by a Keel version that encodes hints differently. Each
    /// removal is counted here; the warning about them is logged at most once a minute.
    /// An entry whose removal failed comes back after its lease and is counted when it is
    /// removed.
    pub fn junk_removed(&self) -> u64 {
        self.junk_removed.load(Ordering::Relaxed)
    }

    /// Whether a warning given at most once a minute is due, `warned` holding when the
    /// last one was given; claims it when it is, so that one caller gives it.
    fn warning_due(&self, warned: &AtomicU64) -> bool {
        let now = self.created.elapsed().as_secs();
        let last = warned.load(Ordering::Relaxed);
        (last == u64::MAX || now >= last.saturating_add(WARNING_INTERVAL_SECS))
            && warned.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    /// Counts `n` hints removed over capacity, warning at most once a minute.
    fn count_dropped(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.dropped.fetch_add(n, Ordering::Relaxed);
        if self.warning_due(&self.dropped_warned) {
            tracing::warn!(
                queue = %self.name,
                capacity = self.capacity,
                dropped = self.dropped(),
                "the queue is over its capacity: removing the hints visible the longest without \
                 a receiver (polling and the repair pass find their work); check that workers \
                 receive from this queue, or raise its capacity (said at most once a minute)"
            );
        }
    }

    /// Deletes every hint of this queue, leased or not (what a `FLUSHALL` does to it).
    pub async fn purge(&self) -> StoreResult<()> {
        let k = &self.keys;
        let mut cmd = redis::cmd("DEL");
        cmd.arg(&k.vis).arg(&k.body).arg(&k.count).arg(&k.wake);
        let (generation, mut conn) = self.conn();
        self.call(generation, cmd.query_async::<()>(&mut conn)).await
    }

    /// How many hints the queue holds, leased and delayed ones included.
    pub async fn len(&self) -> StoreResult<u64> {
        let mut cmd = redis::cmd("ZCARD");
        cmd.arg(&self.keys.vis);
        let (generation, mut conn) = self.conn();
        self.call(generation, cmd.query_async(&mut conn)).await
    }

    fn unavailable(&self, e: &redis::RedisError) -> StoreError {
        StoreError::unavailable(format!("redis queue {}: {e}", self.name))
    }

    /// The connection for every command but `BLPOP`, locked for a moment (never across
    /// an `.await`).
    fn current(&self) -> std::sync::MutexGuard<'_, Current> {
        self.conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A handle on the connection for every command but `BLPOP`, with its generation, to
    /// pass to [`Self::call`].
    fn conn(&self) -> (u64, ConnectionManager) {
        let current = self.current();
        (current.generation, current.manager.clone())
    }

    /// Runs a command on the connection of `generation`. An answer resets the count of
    /// timeouts in a row; the [`TIMEOUTS_BEFORE_RECONNECT`]th timeout in a row, or a
    /// refusal by a server that takes no writes ([`Failure::NoWrites`]), replaces the
    /// connection (the command still fails: the connection it was sent on is gone).
    /// Answers, timeouts and refusals of a connection already replaced count for nothing:
    /// commands sent on it before the swap fail after it, and must not replace the new one.
    async fn call<T>(
        &self,
        generation: u64,
        command: impl Future<Output = redis::RedisResult<T>>,
    ) -> StoreResult<T> {
        match command.await {
            Ok(value) => {
                let mut current = self.current();
                if current.generation == generation {
                    current.timeouts = 0;
                }
                Ok(value)
            }
            Err(e) => {
                let failure = failure(&e);
                let replace = failure != Failure::Other && {
                    let mut current = self.current();
                    if current.generation == generation {
                        match failure {
                            Failure::Timeout => {
                                current.timeouts = current.timeouts.saturating_add(1);
                            }
                            Failure::NoWrites => current.refused = true,
                            Failure::Other => {}
                        }
                    }
                    current.generation == generation && current.due()
                };
                if replace {
                    self.reconnect(generation, &e).await;
                }
                Err(self.unavailable(&e))
            }
        }
    }

    /// Replaces the connection of `generation` with a new one, unless another caller is
    /// doing so or has done so; `cause` is the error that made it due. A failed attempt
    /// keeps the old one (the next timeout or refusal tries again); an attempt takes at
    /// most two tries of [`CONNECT_TIMEOUT`].
    async fn reconnect(&self, generation: u64, cause: &redis::RedisError) {
        let Ok(_only_one) = self.reconnecting.try_lock() else { return };
        {
            let current = self.current();
            if current.generation != generation || !current.due() {
                return; // replaced by another caller since this one's failure
            }
        }
        let why = match failure(cause) {
            Failure::NoWrites => {
                "the Redis server of the connection takes no writes (a replica now?)"
            }
            _ => "the Redis connection stopped answering",
        };
        match ConnectionManager::new_with_config(self.client.clone(), self.settings.clone()).await {
            Ok(fresh) => {
                let old = {
                    let mut current = self.current();
                    current.generation += 1;
                    current.timeouts = 0;
                    current.refused = false;
                    std::mem::replace(&mut current.manager, fresh)
                };
                drop(old);
                tracing::warn!(
                    queue = %self.name,
                    error = %cause,
                    "{why}; replaced it with a new one"
                );
            }
            Err(e) => tracing::warn!(
                queue = %self.name,
                error = %e,
                cause = %cause,
                "{why}, and a new one could not be opened; trying again at the next failure"
            ),
        }
    }

    /// Puts a new blocking connection in place of `conn`: closing the old one ends a
    /// `BLPOP` still running on it.
    async fn replace_blocking(&self, conn: &mut ConnectionManager) -> StoreResult<()> {
        *conn =
            ConnectionManager::new_with_config(self.client.clone(), self.blocking_settings.clone())
                .await
                .map_err(|e| self.unavailable(&e))?;
        self.blocking_abandoned.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Waits up to `block` for a wake token. A receiver that finds the blocking connection
    /// busy waits, as long, for the `BLPOP` of the one holding it to return (a token or its
    /// own time up) and then looks again: one script per wake-up and receiver, not a poll.
    async fn wait_for_wake(&self, block: Duration) -> StoreResult<()> {
        let block = block.max(Duration::from_millis(1));
        // Registered before the lock is tried, so a wake-up between the two is not missed.
        let woken = self.woken.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let Ok(mut conn) = self.blocking.try_lock() else {
            let _ = tokio::time::timeout(block, woken).await;
            return Ok(());
        };
        // Wakes the receivers waiting for this one however it ends: also when its future
        // is dropped (a caller's timeout, a shutdown), which would otherwise leave them
        // asleep for their whole wait.
        let _wake_the_others = WakeOnDrop(&self.woken);
        if self.blocking_abandoned.load(Ordering::Relaxed) {
            // A receive was dropped during its `BLPOP`. The server still runs it on this
            // connection, where it would take the next wake token, and the `BLPOP` below
            // would only start once it returns. A pushed token would not end it: the
            // server hands a token to the client blocked longest on the key, often a
            // receiver of another process. Closing the connection ends it for sure, so
            // it is replaced by a new one.
            self.replace_blocking(&mut conn).await?;
        }
        self.blocking_abandoned.store(true, Ordering::Relaxed);
        let mut blpop = redis::cmd("BLPOP");
        blpop.arg(&self.keys.wake).arg(block.as_secs_f64());
        // The server answers by the end of `block`: a connection that has not answered
        // well after it has gone silent, and is replaced.
        let popped = tokio::time::timeout(
            block + RESPONSE_TIMEOUT,
            blpop.query_async::<Option<(String, String)>>(&mut *conn),
        )
        .await;
        match popped {
            Ok(Ok(_)) => {
                self.blocking_abandoned.store(false, Ordering::Relaxed);
                Ok(())
            }
            Ok(Err(e)) if failure(&e) == Failure::NoWrites => {
                // The wait was refused, not run: the server takes no writes (`BLPOP` is
                // one), and redis-rs keeps the connection. A new one reaches the new
                // primary of a failover; this receive still fails, so that a URL that
                // names a replica for good does not open a connection per round.
                self.replace_blocking(&mut conn).await?;
                tracing::warn!(
                    queue = %self.name,
                    error = %e,
                    "the Redis server of a waiting receive's connection takes no writes (a \
                     replica now?); replaced it with a new one"
                );
                Err(self.unavailable(&e))
            }
            Ok(Err(e)) if !e.is_timeout() => {
                self.blocking_abandoned.store(false, Ordering::Relaxed);
                Err(self.unavailable(&e))
            }
            _ => {
                self.replace_blocking(&mut conn).await?;
                tracing::warn!(
                    queue = %self.name,
                    "the Redis connection of a waiting receive stopped answering; replaced it \
                     with a new one"
                );
                Ok(())
            }
        }
    }

    async fn reschedule(&self, receipt: &str, ms: u64, wake: bool, what: &str) -> StoreResult<()> {
        let (id, count) = split_receipt(receipt)?;
        let mut script = scripts::RESCHEDULE.prepare_invoke();
        script.key(&self.keys.vis).key(&self.keys.count).key(&self.keys.wake);
        script.arg(id).arg(count).arg(ms).arg(u8::from(wake));
        let (generation, mut conn) = self.conn();
        let done: i64 = self.call(generation, script.invoke_async(&mut conn)).await?;
        if done == 0 {
            return Err(StoreError::not_found(format!(
                "{what} of receipt {receipt}: the hint was acked or received again since"
            )));
        }
        Ok(())
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn hint_id(hint: &Hint) -> String {
    format!("{}:{}", hint.instance.0, hint.revision)
}

/// The stored part of a hint that its id does not carry: `<priority level>|<group>`.
fn encode_body(hint: &Hint) -> String {
    format!("{}|{}", hint.priority.level(), hint.group.as_deref().unwrap_or(""))
}

fn decode(id: &str, body: &str) -> Option<Hint> {
    let (instance, revision) = id.split_once(':')?;
    let (level, group) = body.split_once('|')?;
    Some(Hint {
        instance: InstanceId(instance.parse().ok()?),
        revision: revision.parse().ok()?,
        delay: Duration::ZERO,
        priority: Priority::from_level(level.parse().ok()?)?,
        group: (!group.is_empty()).then(|| group.to_owned()),
    })
}

/// A receipt is `<hint id>#<receive count>`: it names one delivery, so a receiver whose
/// lease ran out cannot ack or extend the delivery that replaced it.
fn split_receipt(receipt: &str) -> StoreResult<(&str, &str)> {
    receipt
        .rsplit_once('#')
        .filter(|(id, count)| id.contains(':') && count.parse::<u32>().is_ok())
        .ok_or_else(|| {
            StoreError::invalid(format!("receipt {receipt:?}: not a receipt this queue handed out"))
        })
}

#[async_trait]
impl Queue for RedisQueue {
    fn capabilities(&self) -> QueueCapabilities {
        Self::CAPABILITIES
    }

    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
        validate_enqueue(&hints, &self.capabilities())?;
        if hints.is_empty() {
            return Ok(());
        }
        let mut call = scripts::ENQUEUE.prepare_invoke();
        call.key(&self.keys.vis).key(&self.keys.body).key(&self.keys.count).key(&self.keys.wake);
        call.arg(self.capacity);
        for hint in &hints {
            call.arg(hint_id(hint)).arg(millis(hint.delay)).arg(encode_body(hint));
        }
        let (generation, mut conn) = self.conn();
        let dropped = self.call(generation, call.invoke_async::<u64>(&mut conn)).await?;
        self.count_dropped(dropped);
        Ok(())
    }

    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>> {
        validate_receive(max, visibility, wait, &self.capabilities())?;
        let deadline = Instant::now() + wait;
        let mut junk_rounds = 0;
        // Each round leases what is visible or waits for a wake token, the next visible
        // hint or the deadline, whichever comes first; the deadline bounds the rounds, and
        // rounds that look again at once are bounded by `JUNK_ROUNDS_MAX`.
        loop {
            let mut script = scripts::RECEIVE.prepare_invoke();
            script.key(&self.keys.vis).key(&self.keys.body).key(&self.keys.count);
            script.arg(max).arg(millis(visibility).max(1));
            let (generation, mut conn) = self.conn();
            let reply: Vec<redis::Value> =
                self.call(generation, script.invoke_async(&mut conn)).await?;
            let received = self.parse_receive(&reply)?;
            let had_junk = !received.junk.is_empty();
            if had_junk {
                self.remove_junk(&received.junk).await;
            }
            if !received.deliveries.is_empty() {
                return Ok(received.deliveries);
            }
            // A round that leased only entries that are not hints looks again at once:
            // good hints may be visible behind them.
            if had_junk && junk_rounds < JUNK_ROUNDS_MAX {
                junk_rounds += 1;
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Vec::new());
            }
            let block = received.next_ms.map_or(left, |ms| left.min(Duration::from_millis(ms)));
            self.wait_for_wake(block).await?;
        }
    }

    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()> {
        validate_receipts(&receipts)?;
        if receipts.is_empty() {
            return Ok(());
        }
        let mut call = scripts::ACK.prepare_invoke();
        call.key(&self.keys.vis).key(&self.keys.body).key(&self.keys.count);
        for receipt in &receipts {
            let (id, count) = split_receipt(receipt)?;
            call.arg(id).arg(count);
        }
        let (generation, mut conn) = self.conn();
        self.call(generation, call.invoke_async::<i64>(&mut conn)).await.map(drop)
    }

    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()> {
        validate_receipts(std::slice::from_ref(&receipt))?;
        validate_nack_delay(delay, &self.capabilities())?;
        // Every nack wakes a waiting receiver, also one with a delay: the receiver looks
        // again, sees when the hint becomes visible and waits only that long, instead of
        // its whole wait.
        self.reschedule(&receipt, millis(delay), true, "nack").await
    }

    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()> {
        validate_receipts(std::slice::from_ref(&receipt))?;
        validate_visibility(visibility, &self.capabilities())?;
        self.reschedule(&receipt, millis(visibility).max(1), false, "extend").await
    }
}

/// What one run of the receive script handed out.
struct Received {
    /// Milliseconds until the next hint is visible, when nothing was handed out.
    next_ms: Option<u64>,
    /// The leased hints.
    deliveries: Vec<Delivery>,
    /// Leased entries that are not Keel hints, as (id, receive count): written under the
    /// queue's keys by something else, or by a version that encoded hints differently.
    junk: Vec<(Vec<u8>, i64)>,
}

impl RedisQueue {
    /// Reads the receive script's reply. An entry whose id or body does not decode is put
    /// aside as junk rather than failing the receive: the script has already leased every
    /// entry of the batch, and failing would hide the good hints for a whole lease.
    fn parse_receive(&self, reply: &[redis::Value]) -> StoreResult<Received> {
        let bad = || StoreError::unavailable(format!("redis queue {}: malformed reply", self.name));
        let (first, rest) = reply.split_first().ok_or_else(bad)?;
        let next_ms = match first {
            redis::Value::Int(ms) if *ms >= 0 => Some(*ms as u64),
            redis::Value::Int(_) => None,
            _ => return Err(bad()),
        };
        let mut received =
            Received { next_ms, deliveries: Vec::with_capacity(rest.len() / 3), junk: Vec::new() };
        for item in rest.chunks(3) {
            let [id, count, body] = item else { return Err(bad()) };
            let id: Vec<u8> = redis::from_redis_value_ref(id).map_err(|_| bad())?;
            let count: i64 = redis::from_redis_value_ref(count).map_err(|_| bad())?;
            let body: Vec<u8> = redis::from_redis_value_ref(body).map_err(|_| bad())?;
            let good = match (std::str::from_utf8(&id), std::str::from_utf8(&body)) {
                (Ok(id), Ok(body)) => {
                    decode(id, body).zip(u32::try_from(count).ok()).map(|(hint, receive_count)| {
                        Delivery { hint, receipt: format!("{id}#{receive_count}"), receive_count }
                    })
                }
                _ => None,
            };
            match good {
                Some(delivery) => received.deliveries.push(delivery),
                None => received.junk.push((id, count)),
            }
        }
        Ok(received)
    }

    /// Removes entries that are not hints (with their body and receive count), unless
    /// they were published again since they were leased, and counts the ones removed. A
    /// failed removal is logged each time (it comes only when the server stops answering,
    /// which the other calls report as well): the entry comes back after its lease and is
    /// removed then.
    async fn remove_junk(&self, junk: &[(Vec<u8>, i64)]) {
        let Some((example, _)) = junk.first() else { return };
        let mut call = scripts::ACK.prepare_invoke();
        call.key(&self.keys.vis).key(&self.keys.body).key(&self.keys.count);
        for (id, count) in junk {
            call.arg(id.as_slice()).arg(*count);
        }
        let (generation, mut conn) = self.conn();
        match self.call(generation, call.invoke_async::<u64>(&mut conn)).await {
            Ok(removed) => self.count_junk(removed, example),
            Err(e) => tracing::warn!(
                queue = %self.name,
                error = %e,
                "could not remove entries that are not Keel hints; trying again after their lease"
            ),
        }
    }

    /// Counts `n` removed entries that were not hints, `example` the id of one of them,
    /// warning at most once a minute: an application that writes under the queue's keys
    /// would otherwise fill the log with one line per entry.
    fn count_junk(&self, n: u64, example: &[u8]) {
        if n == 0 {
            return;
        }
        self.junk_removed.fetch_add(n, Ordering::Relaxed);
        if self.warning_due(&self.junk_warned) {
            tracing::warn!(
                queue = %self.name,
                key = %self.keys.vis,
                entry = %entry_start(example),
                removed = self.junk_removed(),
                "removed entries under the queue's keys that are not Keel hints (a hint has \
                 id `<instance>:<revision>` and body `<priority level>|<group>`); only Keel \
                 should write under these keys: stop the application or script that writes \
                 there, or give Keel a database or queue name of its own (said at most once \
                 a minute; `RedisQueue::junk_removed` counts them all)"
            );
        } else {
            tracing::debug!(
                queue = %self.name,
                removed = n,
                "removed entries under the queue's keys that are not Keel hints"
            );
        }
    }
}

/// The start of an entry's id, for a log line: at most [`ENTRY_SHOWN_MAX`] characters,
/// bytes that are not UTF-8 shown as U+FFFD.
fn entry_start(id: &[u8]) -> String {
    let text = String::from_utf8_lossy(id);
    match text.char_indices().nth(ENTRY_SHOWN_MAX) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        ENTRY_SHOWN_MAX, Failure, READONLY_IN_SCRIPT, RedisQueueConfig, check_server_version,
        entry_start, failure,
    };
    use redis::{ErrorKind, RedisError, ServerErrorKind};

    /// A server that takes no writes (a primary turned replica by a failover, a replica
    /// cut off from its primary) gets the connection replaced at once, also when the
    /// refusal comes wrapped in a script error of Redis before 7.0; a timeout counts
    /// toward a replacement; anything else keeps the connection.
    #[test]
    fn refusals_of_a_server_that_takes_no_writes_replace_the_connection() {
        let server = |kind| RedisError::from((ErrorKind::Server(kind), "server error"));
        assert_eq!(failure(&server(ServerErrorKind::ReadOnly)), Failure::NoWrites);
        assert_eq!(failure(&server(ServerErrorKind::MasterDown)), Failure::NoWrites);
        let old_script = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ResponseError),
            "server error",
            format!(
                "Error running script (call to f_0123): @user_script:2: -{READONLY_IN_SCRIPT}."
            ),
        ));
        assert_eq!(failure(&old_script), Failure::NoWrites);
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert_eq!(failure(&timeout), Failure::Timeout);
        for other in [
            server(ServerErrorKind::BusyLoading),
            server(ServerErrorKind::NoScript),
            server(ServerErrorKind::ResponseError),
            RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            RedisError::from((ErrorKind::UnexpectedReturnType, "type")),
        ] {
            assert_eq!(failure(&other), Failure::Other, "{other}");
        }
    }

    /// A warning about an entry that is not a hint shows its id readably and briefly,
    /// whatever was written there.
    #[test]
    fn entry_ids_in_warnings_are_short_and_readable() {
        assert_eq!(entry_start(b"x:y"), "x:y");
        assert_eq!(entry_start(b"\xff:1"), "\u{fffd}:1");
        let long = "é".repeat(10_000);
        let shown = entry_start(long.as_bytes());
        assert_eq!(shown, format!("{}…", "é".repeat(ENTRY_SHOWN_MAX)));
    }

    #[test]
    fn servers_older_than_6_0_are_refused_naming_their_version() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        for old in ["5.0.14", "4.0.9", "2.8.24"] {
            let error = check_server_version(&info(old)).unwrap_err();
            assert!(
                error.starts_with(&format!("server version {old} is older than 6.0")),
                "{error}"
            );
            assert!(error.contains("upgrade the server to Redis 6.0 or later"), "{error}");
        }
        for new in ["6.0.0", "6.2.14", "7.2.4", "8.0.1", "10.0"] {
            check_server_version(&info(new)).unwrap();
        }
        check_server_version("# Server\r\nproxy:yes\r\n").unwrap();
    }

    #[test]
    fn passwords_are_hidden() {
        let shown = |url: &str| format!("{:?}", RedisQueueConfig::new(url, "q"));
        assert!(shown("redis://:s3cret@cache:6379/0").contains("redis://:***@cache:6379/0"));
        assert!(shown("rediss://app:s3cret@cache/0?x=1").contains("rediss://app:***@cache/0?x=1"));
        assert!(
            shown("redis+unix:///run/redis.sock?db=1&pass=s3cret")
                .contains("redis+unix:///run/redis.sock?db=1&pass=***")
        );
        // An unencoded `/` in the password, and a URL without `//`: redis refuses both, and
        // its message quotes the URL.
        assert!(shown("redis://app:pa/ss@cache:6379/0").contains("redis://***@cache:6379/0"));
        assert!(shown("redis:/app:secret@cache").contains("redis:***@cache"));
        for url in ["redis://app:pa/ss@cache:6379/0", "redis:/app:secret@cache"] {
            assert!(!shown(url).contains("ss@") && !shown(url).contains("secret"), "{url}");
        }
        assert!(shown("redis://127.0.0.1:6379/0").contains("redis://127.0.0.1:6379/0"));
    }
}
