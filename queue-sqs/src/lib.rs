//! Keel's Amazon SQS queue: ready-work hints on a standard or FIFO queue.
//!
//! The store stays the only truth; a hint only says "instance 42 is ready", and a purged
//! queue delays work until the repair pass publishes it again.
//!
//! # What maps to what
//!
//! - A hint is one message whose body is `<instance>|<revision>|<priority>|<group>`. The
//!   group (the concurrency key) has `%` and the characters SQS refuses in a body
//!   (control characters other than tab and line breaks, U+FFFE, U+FFFF) written as
//!   `%XX` per UTF-8 byte, so every key a store accepts can be published.
//! - Batches are split into SQS's 10 entries per call (send, delete); a receive of more
//!   than 10 makes further calls without waiting while full pages keep coming.
//! - Visibility: `receive` sets `VisibilityTimeout`; `extend` and `nack` are
//!   `ChangeMessageVisibility` (a nack moves the lease's end to the delay). SQS counts
//!   whole seconds, so leases and delays are rounded up to a second (`resolution`).
//! - Delays: standard queues take per-message delays up to 15 minutes; FIFO queues take
//!   none (`delay_max` is zero). Longer or unsupported delays are refused with
//!   `Invalid`, never shortened: that work stays in the store until it is due.
//! - FIFO: `MessageGroupId` is the hint's group (its concurrency key) or else the
//!   instance, and the deduplication id is `<instance>-<revision>-<publish>`, where
//!   `<publish>` is a random number drawn once per [`Queue::enqueue`] call. SQS remembers
//!   a deduplication id for five minutes even after the message was received and
//!   deleted, so an id of `<instance>-<revision>` alone would swallow every later hint of
//!   the same pair for that long: a repair hint after a crash or a returned lease, or a
//!   parent woken again at the revision it already had. With the publish in the id, the
//!   same pair twice in one publish is delivered once, each publish is delivered, and
//!   SQS's own retry of a batch keeps its id and is still dropped. A duplicate costs one
//!   claim by id that takes nothing, as on a standard queue. SQS takes 1 to 128
//!   characters of printable ASCII as a group id: a key's group is `k-<key>` when that
//!   fits, else `h-` and a stable hash of the key ([`group_id`]), and the group of an
//!   instance's hints without a key is `i-<id>` ([`instance_group_id`]). So one key
//!   always maps to one group, and no key shares a group with an instance or with the
//!   hashed form of another key.
//! - A publish sends every batch of 10 even when SQS refuses entries of one, and then
//!   reports how many were refused and why.
//! - A received message that is not a hint (another application's message on a URL meant
//!   for it, a hint of a newer Keel) is deleted, so that it cannot hold up a FIFO group,
//!   logged at `warn` with the queue URL and message id at most once a minute, and counted
//!   ([`SqsQueue::discarded`]).
//! - Redrive: [`SqsQueue::create`] can create a dead-letter queue and a redrive policy, so
//!   a hint that keeps failing to be acked leaves the main queue after `max_receives`.
//!   Every hand-back of a hint (a worker that cannot take its instance returns it, up to
//!   [`HAND_BACK_MAX`] times) is a receive too, so `max_receives` must be at least
//!   [`MAX_RECEIVES_MIN`] (`HAND_BACK_MAX + 1`): with less, hints of ready work would move
//!   to the dead-letter queue in normal operation.
//!
//! There is no `aws-config` here: build the client with the credential chain you use
//! (`aws_config::load_from_env().await` gives an `SdkConfig`, then
//! `aws_sdk_sqs::Client::new(&sdk_config)`) and hand it to [`SqsQueue::open`], or use
//! [`static_client`] for an emulator.
//!
//! ```no_run
//! # async fn demo() -> keel_core::StoreResult<()> {
//! use keel_queue_sqs::{SqsQueue, static_client};
//! let client = static_client("http://127.0.0.1:9324", "us-east-1");
//! let queue = SqsQueue::create(client, "keel-hints.fifo", Some(25)).await?;
//! # let _ = queue;
//! # Ok(()) }
//! ```

pub mod testing;

/// The AWS SDK this crate is built on: build the [`Client`] for [`SqsQueue::open`] from
/// it (`aws_sdk_sqs::Client::new(&sdk_config)`) and its type is the one the queue takes.
pub use aws_sdk_sqs;

use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use keel_core::plan::hints::HAND_BACK_MAX;
use keel_core::ports::Queue;
use keel_core::ports::queue::{
    Delivery, Hint, QueueCapabilities, round_up, validate_enqueue, validate_nack_delay,
    validate_receipts, validate_receive, validate_visibility,
};
use keel_core::{InstanceId, Priority, StoreError, StoreResult};
use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Most entries SQS takes in one batch call (send, delete) and returns from one receive.
pub const SQS_BATCH_MAX: usize = 10;
/// The longest per-message delay of a standard queue.
pub const SQS_DELAY_MAX: Duration = Duration::from_secs(15 * 60);
/// The longest visibility timeout SQS accepts.
pub const SQS_VISIBILITY_MAX: Duration = Duration::from_secs(12 * 3600);
/// How long one call may take (a long poll waits up to 20 s of it).
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `MessageGroupId` SQS accepts, in characters.
pub const SQS_GROUP_ID_MAX: usize = 128;

/// A client with static credentials for an SQS endpoint such as a local emulator.
pub fn static_client(endpoint: &str, region: &str) -> Client {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region, timeout::TimeoutConfig};
    let credentials = Credentials::new("keel", "keel", None, None, "keel-static");
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region.to_owned()))
        .credentials_provider(credentials)
        .endpoint_url(endpoint)
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(2))
                .operation_timeout(OPERATION_TIMEOUT)
                .build(),
        )
        .build();
    Client::from_conf(config)
}

/// A `Queue` on one SQS queue.
#[derive(Debug, Clone)]
pub struct SqsQueue {
    client: Client,
    url: String,
    fifo: bool,
    /// Messages received that were not hints (shared by the clones of this handle).
    discards: Arc<Discards>,
}

/// How many received messages were not hints, and when the last warning about one was
/// given.
#[derive(Debug)]
struct Discards {
    count: AtomicU64,
    /// Seconds from `since` to the last warning (`u64::MAX`: never).
    warned: AtomicU64,
    since: Instant,
}

impl Discards {
    fn new() -> Arc<Self> {
        Arc::new(Discards {
            count: AtomicU64::new(0),
            warned: AtomicU64::new(u64::MAX),
            since: Instant::now(),
        })
    }

    /// Counts one message that is not a hint; whether to warn about it: the first time,
    /// then at most once a minute.
    fn count(&self) -> bool {
        self.count.fetch_add(1, Ordering::Relaxed);
        let now = self.since.elapsed().as_secs();
        let last = self.warned.load(Ordering::Relaxed);
        (last == u64::MAX || now >= last.saturating_add(60))
            && self.warned.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// The first characters of a message body, for a log line.
fn body_start(body: &str) -> &str {
    const SHOWN: usize = 64;
    match body.char_indices().nth(SHOWN) {
        Some((end, _)) => &body[..end],
        None => body,
    }
}

fn unavailable<E: std::error::Error + 'static>(what: &str, url: &str, e: &E) -> StoreError {
    StoreError::unavailable(format!("sqs {what} on {url}: {}", DisplayErrorContext(e)))
}

/// Whether a queue name or URL names a FIFO queue. SQS requires the suffix in lowercase,
/// so the comparison is case-sensitive on purpose.
#[allow(clippy::case_sensitive_file_extension_comparisons)]
fn is_fifo(name_or_url: &str) -> bool {
    name_or_url.ends_with(".fifo")
}

fn secs(d: Duration) -> i32 {
    i32::try_from(round_up(d, Duration::from_secs(1)).as_secs()).unwrap_or(i32::MAX)
}

fn encode(hint: &Hint) -> String {
    format!(
        "{}|{}|{}|{}",
        hint.instance.0,
        hint.revision,
        hint.priority.level(),
        hint.group.as_deref().map(encode_group).unwrap_or_default()
    )
}

/// Whether SQS takes `c` in a message body: `#x9 | #xA | #xD | #x20-#xD7FF |
/// #xE000-#xFFFD | #x10000-#x10FFFF` (a body with any other character is refused with
/// `InvalidMessageContents`).
fn body_takes(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | ' '..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
}

/// The group field of a message body: the concurrency key with `%` and every character SQS
/// refuses in a body (control characters other than tab and line breaks, U+FFFE, U+FFFF)
/// written as `%XX` per UTF-8 byte, so any key a store accepts can be published. A key
/// without such characters is written as it is.
fn encode_group(group: &str) -> Cow<'_, str> {
    if group.chars().all(|c| c != '%' && body_takes(c)) {
        return Cow::Borrowed(group);
    }
    let mut out = String::with_capacity(group.len() + 8);
    for c in group.chars() {
        if c != '%' && body_takes(c) {
            out.push(c);
        } else {
            let mut bytes = [0; 4];
            for b in c.encode_utf8(&mut bytes).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    Cow::Owned(out)
}

/// The concurrency key of a body's group field ([`encode_group`] undone); a `%` not
/// followed by two hex digits is kept as it is. A field whose decoded bytes are not
/// UTF-8 is kept as it is too: a writer from before keys were encoded put the key in
/// raw, and `sku%E9` is such a key, not a broken body.
fn decode_group(field: &str) -> String {
    if !field.contains('%') {
        return field.to_owned();
    }
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) if hi.is_ascii_hexdigit() && lo.is_ascii_hexdigit() => {
                std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            }
            _ => None,
        };
        if let Some(b) = hex {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| field.to_owned())
}

/// The FIFO `MessageDeduplicationId` of `hint` in publish `publish` (a random number
/// drawn once per enqueue call): `<instance>-<revision>-<publish in hex>`, at most 58 of
/// the 128 characters SQS takes. SQS drops a message whose id it saw in the last five
/// minutes, received and deleted or not, so the id must differ between publishes: a
/// later hint of the same instance and revision (a repair hint, a parent woken again) is
/// news the first one did not carry.
fn dedup_id(hint: &Hint, publish: u64) -> String {
    format!("{}-{}-{publish:016x}", hint.instance.0, hint.revision)
}

/// The FIFO `MessageGroupId` of the hints of ordering group `group` (a concurrency key).
/// SQS takes 1 to 128 characters of printable ASCII (`!` to `~`), while a concurrency key
/// may be any text up to 256 bytes. A key is sent as `k-<key>` when that is an id SQS
/// takes (the key is at most 126 characters, all of them `!` to `~`); any other key is
/// sent as `h-` and the FNV-1a 64-bit hash of its bytes in 16 hex digits, so the same key
/// always gives the same group and its hints stay in order.
///
/// Every group id starts with `k-`, `h-` or, for the hints of an instance without a key,
/// `i-` ([`instance_group_id`]), so the three kinds never meet: a key `42` is not in the
/// group of instance 42, and a key spelled like a hash (`h-…`) is sent as `k-h-…`, not in
/// the hashed group. Two `k-` ids are equal only for equal keys. Only two hashed keys
/// can share a group, when their hashes collide: their hints are then ordered together,
/// which delays but never loses one.
pub fn group_id(group: &str) -> String {
    let fits =
        group.len() + 2 <= SQS_GROUP_ID_MAX && group.bytes().all(|b| (b'!'..=b'~').contains(&b));
    if fits { format!("k-{group}") } else { format!("h-{:016x}", fnv1a64(group)) }
}

/// The FIFO `MessageGroupId` of the hints of `instance` when they have no concurrency
/// key: `i-` and the id in decimal (at most 22 characters), never equal to a key's group
/// ([`group_id`]), so an instance's hints and a key's hints never wait on each other.
pub fn instance_group_id(instance: InstanceId) -> String {
    format!("i-{}", instance.0)
}

/// The largest receive count SQS takes in a redrive policy (`maxReceiveCount`).
pub const MAX_RECEIVES_MAX: u32 = 1_000;

/// The smallest `max_receives` [`SqsQueue::create`] takes: one more than
/// [`HAND_BACK_MAX`]. A worker whose claim by id did not take a ready instance hands its
/// hint back (up to `HAND_BACK_MAX` times) and drops it on the next receive; each
/// hand-back counts as a receive, so a lower redrive count would move hints of ready work
/// to the dead-letter queue in normal operation.
pub const MAX_RECEIVES_MIN: u32 = HAND_BACK_MAX + 1;

/// FNV-1a over the bytes of `text`: the same value on every platform and every version,
/// which `std`'s hashers do not promise.
fn fnv1a64(text: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    text.bytes().fold(OFFSET, |hash, b| (hash ^ u64::from(b)).wrapping_mul(PRIME))
}

/// The entries SQS refused during one publish: how many, and the first one's reason.
#[derive(Debug, Default)]
struct Refused {
    count: usize,
    first: Option<String>,
}

impl Refused {
    fn add(&mut self, count: usize, reason: impl FnOnce() -> String) {
        self.count += count;
        if self.first.is_none() {
            self.first = Some(reason());
        }
    }
}

fn decode(body: &str) -> Option<Hint> {
    let mut parts = body.splitn(4, '|');
    let instance = InstanceId(parts.next()?.parse().ok()?);
    let revision = parts.next()?.parse().ok()?;
    let priority = Priority::from_level(parts.next()?.parse().ok()?)?;
    let group = parts.next()?;
    let group = (!group.is_empty()).then(|| decode_group(group));
    Some(Hint { instance, revision, delay: Duration::ZERO, priority, group })
}

/// Checks that `url` has the form of an SQS queue URL,
/// `http(s)://<host>/<account>/<queue name>`, and that an AWS endpoint's region is the
/// client's; the message names `url` and the form expected.
fn check_url(url: &str, client_region: Option<&str>) -> Result<(), String> {
    const FORM: &str = "expected an SQS queue URL such as \
        https://sqs.us-east-1.amazonaws.com/123456789012/keel-hints (what CreateQueue or \
        GetQueueUrl returns), not a queue name or ARN";
    let rest = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://"));
    let Some(rest) = rest else { return Err(format!("url {url:?}: {FORM}")) };
    let mut parts = rest.split('/');
    let (host, account, name) = (parts.next(), parts.next(), parts.next());
    let valid_name = |n: &str| {
        let base = n.strip_suffix(".fifo").unwrap_or(n);
        (1..=80).contains(&base.len())
            && base.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    match (host, account, name, parts.next()) {
        (Some(host), Some(account), Some(name), None)
            if !host.is_empty() && !account.is_empty() && valid_name(name) =>
        {
            let region = host.strip_prefix("sqs.").and_then(|h| {
                h.strip_suffix(".amazonaws.com").or_else(|| h.strip_suffix(".amazonaws.com.cn"))
            });
            match (region, client_region) {
                (Some(queue), Some(client)) if queue != client => Err(format!(
                    "url {url:?}: the queue is in region {queue} but the client is for \
                     {client}; build the client for {queue}"
                )),
                _ => Ok(()),
            }
        }
        _ => Err(format!("url {url:?}: {FORM}")),
    }
}

impl SqsQueue {
    /// A queue that already exists, by URL; a URL ending in `.fifo` is a FIFO queue.
    /// Refuses (`Invalid`, naming `url`) a string that is not an SQS queue URL
    /// (`http(s)://<host>/<account>/<name>`), and an AWS queue URL of another region
    /// than the client's, which would fail every call later.
    pub fn open(client: Client, url: impl Into<String>) -> StoreResult<Self> {
        let url = url.into();
        let region = client.config().region().map(|r| r.as_ref().to_owned());
        check_url(&url, region.as_deref()).map_err(StoreError::invalid)?;
        let fifo = is_fifo(&url);
        Ok(SqsQueue { client, url, fifo, discards: Discards::new() })
    }

    /// Creates queue `name` (FIFO when it ends in `.fifo`) if it does not exist. With
    /// `max_receives`, also creates `<name>-dlq` and a redrive policy: a hint received
    /// that many times without an ack moves there. `max_receives` is
    /// [`MAX_RECEIVES_MIN`] (21) to [`MAX_RECEIVES_MAX`] (1000), as every hand-back of a
    /// hint between workers is a receive; a lower one is refused with `Invalid`, before
    /// any call. Creating again with the same name and `max_receives` (a restart) gives
    /// the same queue.
    pub async fn create(
        client: Client,
        name: &str,
        max_receives: Option<u32>,
    ) -> StoreResult<Self> {
        let fifo = is_fifo(name);
        let base = name.strip_suffix(".fifo").unwrap_or(name);
        let max = base_name_max(fifo, max_receives.is_some());
        if base.is_empty()
            || base.len() > max
            || !base.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            let dlq = if max_receives.is_some() { " (the `-dlq` queue takes 4 more)" } else { "" };
            return Err(StoreError::invalid(format!(
                "name {name:?}: 1 to {max} letters, digits, `-` or `_`{dlq}, then `.fifo` for a \
                 FIFO queue; SQS allows {SQS_QUEUE_NAME_MAX} characters in a queue name"
            )));
        }
        let redrive = match max_receives {
            None => None,
            Some(n) if n < MAX_RECEIVES_MIN => {
                return Err(StoreError::invalid(format!(
                    "max_receives: {n} is too low: a worker hands a hint it cannot take back up \
                     to {HAND_BACK_MAX} times, and each hand-back counts as a receive, so hints \
                     of ready work would move to the dead-letter queue; use at least \
                     {MAX_RECEIVES_MIN} (e.g. 25); a queue already created with a lower bound \
                     keeps it: raise its RedrivePolicy's maxReceiveCount with \
                     SetQueueAttributes first, or use SqsQueue::open on it"
                )));
            }
            Some(n) if n > MAX_RECEIVES_MAX => {
                return Err(StoreError::invalid(format!(
                    "max_receives: {n} is more than SQS allows in a redrive policy; use \
                     {MAX_RECEIVES_MIN} to {MAX_RECEIVES_MAX}"
                )));
            }
            Some(n) => {
                let dlq_name =
                    if fifo { format!("{base}-dlq.fifo") } else { format!("{base}-dlq") };
                let dlq = Self::create_one(&client, &dlq_name, fifo, None).await?;
                let arn = dlq.attribute(QueueAttributeName::QueueArn).await?;
                Some(format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{n}"}}"#))
            }
        };
        Self::create_one(&client, name, fifo, redrive).await
    }

    async fn create_one(
        client: &Client,
        name: &str,
        fifo: bool,
        redrive: Option<String>,
    ) -> StoreResult<Self> {
        let mut call = client.create_queue().queue_name(name);
        if fifo {
            call = call.attributes(QueueAttributeName::FifoQueue, "true");
        }
        if let Some(policy) = redrive {
            call = call.attributes(QueueAttributeName::RedrivePolicy, policy);
        }
        let out = call.send().await.map_err(|e| match e.code() {
            // The name is taken by a queue created with other attributes (FIFO, or a
            // redrive policy that `max_receives` adds or changes): retrying cannot help.
            Some("QueueAlreadyExists" | "QueueNameExists") => StoreError::invalid(format!(
                "name {name:?}: a queue of that name already exists with other attributes \
                 (FIFO or redrive policy); delete or rename the queue, or pass the \
                 max_receives it was created with, or change its RedrivePolicy with \
                 SetQueueAttributes ({})",
                DisplayErrorContext(&e)
            )),
            _ => unavailable("CreateQueue", name, &e),
        })?;
        let url = out.queue_url().unwrap_or_default();
        check_url(url, None).map_err(|e| {
            StoreError::unavailable(format!("sqs CreateQueue on {name}: the answer's {e}"))
        })?;
        Ok(SqsQueue {
            client: client.clone(),
            url: url.to_owned(),
            fifo,
            discards: Discards::new(),
        })
    }

    /// The queue's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// How many received messages this handle (and its clones) deleted because they were
    /// not Keel hints: a body that is not `<instance>|<revision>|<priority level>|<group>`,
    /// such as another application's message on a queue URL meant for it, or a hint of a
    /// newer Keel that this one cannot read. Each is also logged at `warn`, at most once a
    /// minute. A message whose delete failed comes back after its visibility and counts
    /// again.
    pub fn discarded(&self) -> u64 {
        self.discards.count.load(Ordering::Relaxed)
    }

    /// The dead-letter queue of a queue made by [`SqsQueue::create`] with `max_receives`.
    pub async fn dead_letter_queue(&self) -> StoreResult<SqsQueue> {
        let name = self.url.rsplit('/').next().unwrap_or_default();
        let base = name.strip_suffix(".fifo").unwrap_or(name);
        let dlq = if self.fifo { format!("{base}-dlq.fifo") } else { format!("{base}-dlq") };
        let out = self
            .client
            .get_queue_url()
            .queue_name(&dlq)
            .send()
            .await
            .map_err(|e| unavailable("GetQueueUrl", &dlq, &e))?;
        SqsQueue::open(self.client.clone(), out.queue_url().unwrap_or_default()).map_err(|e| {
            StoreError::unavailable(format!("sqs GetQueueUrl on {dlq}: the answer's {}", e.message))
        })
    }

    /// Deletes every message of the queue (SQS allows one purge a minute per queue).
    pub async fn purge(&self) -> StoreResult<()> {
        self.client
            .purge_queue()
            .queue_url(&self.url)
            .send()
            .await
            .map(drop)
            .map_err(|e| unavailable("PurgeQueue", &self.url, &e))
    }

    async fn attribute(&self, name: QueueAttributeName) -> StoreResult<String> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(name.clone())
            .send()
            .await
            .map_err(|e| unavailable("GetQueueAttributes", &self.url, &e))?;
        out.attributes().and_then(|a| a.get(&name)).cloned().ok_or_else(|| {
            StoreError::unavailable(format!("sqs {}: no attribute {name}", self.url))
        })
    }

    /// Approximate number of visible hints (SQS's own estimate).
    pub async fn approximate_len(&self) -> StoreResult<u64> {
        let n = self.attribute(QueueAttributeName::ApproximateNumberOfMessages).await?;
        n.parse()
            .map_err(|_| StoreError::unavailable(format!("sqs {}: message count {n:?}", self.url)))
    }

    /// Sends one batch of at most 10 hints, the first of which is hint `first` of the
    /// publish (entry ids are positions in the publish, so a refusal names its hint).
    /// Refused entries, and a batch SQS refused as a whole, are added to `refused`; only a
    /// call that got no answer from SQS is an error, since the next batches would wait on
    /// the same outage.
    async fn send_batch(
        &self,
        first: usize,
        hints: &[Hint],
        publish: u64,
        refused: &mut Refused,
    ) -> StoreResult<()> {
        let mut call = self.client.send_message_batch().queue_url(&self.url);
        for (i, hint) in hints.iter().enumerate() {
            let mut entry = SendMessageBatchRequestEntry::builder()
                .id((first + i).to_string())
                .message_body(encode(hint));
            if self.fifo {
                let group = match &hint.group {
                    Some(group) => group_id(group),
                    None => instance_group_id(hint.instance),
                };
                entry =
                    entry.message_group_id(group).message_deduplication_id(dedup_id(hint, publish));
            } else if !hint.delay.is_zero() {
                entry = entry.delay_seconds(secs(hint.delay));
            }
            call = call.entries(
                entry.build().map_err(|e| unavailable("SendMessageBatch", &self.url, &e))?,
            );
        }
        let out = match call.send().await {
            Ok(out) => out,
            Err(e) if e.code().is_some() => {
                refused.add(hints.len(), || {
                    format!(
                        "the batch from instance {}: {}",
                        hints[0].instance.0,
                        DisplayErrorContext(&e)
                    )
                });
                return Ok(());
            }
            Err(e) => return Err(unavailable("SendMessageBatch", &self.url, &e)),
        };
        if let Some(failed) = out.failed().first() {
            let hint = failed
                .id()
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_sub(first))
                .and_then(|n| hints.get(n));
            refused.add(out.failed().len(), || {
                format!(
                    "{}: {} {}",
                    hint.map_or_else(
                        || format!("entry {}", failed.id()),
                        |h| format!("instance {}", h.instance.0)
                    ),
                    failed.code(),
                    failed.message().unwrap_or_default()
                )
            });
        }
        Ok(())
    }

    async fn delete_batch(&self, receipts: &[String]) -> StoreResult<()> {
        let mut call = self.client.delete_message_batch().queue_url(&self.url);
        for (i, receipt) in receipts.iter().enumerate() {
            let entry = DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(receipt)
                .build()
                .map_err(|e| unavailable("DeleteMessageBatch", &self.url, &e))?;
            call = call.entries(entry);
        }
        let out =
            call.send().await.map_err(|e| unavailable("DeleteMessageBatch", &self.url, &e))?;
        // A receipt that is no longer valid belongs to a hint that is gone or was handed
        // to someone else: the ack has nothing left to do.
        if let Some(failed) =
            out.failed().iter().find(|f| !receipt_gone(Some(f.code()), f.message()))
        {
            return Err(StoreError::unavailable(format!(
                "sqs DeleteMessageBatch on {}: {} {}",
                self.url,
                failed.code(),
                failed.message().unwrap_or_default()
            )));
        }
        Ok(())
    }

    async fn receive_page(
        &self,
        max: usize,
        visibility: i32,
        wait: i32,
    ) -> StoreResult<Vec<Delivery>> {
        let out = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.min(SQS_BATCH_MAX) as i32)
            .visibility_timeout(visibility)
            .wait_time_seconds(wait)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .map_err(|e| unavailable("ReceiveMessage", &self.url, &e))?;
        let mut deliveries = Vec::new();
        for message in out.messages() {
            let (Some(body), Some(receipt)) = (message.body(), message.receipt_handle()) else {
                continue;
            };
            let receive_count = message
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                .and_then(|n| n.parse().ok())
                .unwrap_or(1);
            let Some(hint) = decode(body) else {
                // Not a hint of ours: delete it so it cannot block a FIFO group forever. A
                // failed delete does not cost the good hints of the page, which are
                // leased already: the message comes back after its visibility and is
                // deleted then.
                self.discard(message.message_id().unwrap_or_default(), body, receive_count);
                let _ = self.delete_batch(&[receipt.to_owned()]).await;
                continue;
            };
            deliveries.push(Delivery { hint, receipt: receipt.to_owned(), receive_count });
        }
        Ok(deliveries)
    }

    /// Counts a received message that is not a hint and says so: at `warn` the first
    /// time and then at most once a minute, at `debug` otherwise.
    fn discard(&self, message_id: &str, body: &str, receive_count: u32) {
        if self.discards.count() {
            tracing::warn!(
                queue = %self.url,
                message_id,
                body = body_start(body),
                receive_count,
                discarded = self.discarded(),
                "deleting a message that is not a Keel hint (expected body \
                 `<instance>|<revision>|<priority level>|<group>`); only Keel should write to \
                 this queue: check that its URL is not another application's queue (said at \
                 most once a minute; `SqsQueue::discarded` counts them all)"
            );
        } else {
            tracing::debug!(queue = %self.url, message_id, "deleting a message that is not a Keel hint");
        }
    }

    async fn change_visibility(
        &self,
        receipt: String,
        timeout: i32,
        what: &str,
    ) -> StoreResult<()> {
        match self
            .client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .visibility_timeout(timeout)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if receipt_gone(e.code(), e.message()) => Err(StoreError::not_found(format!(
                "{what} on {}: the hint was acked or received again since, or its receipt \
                 expired ({})",
                self.url,
                e.code().unwrap_or_default()
            ))),
            Err(e) => Err(unavailable("ChangeMessageVisibility", &self.url, &e)),
        }
    }
}

#[async_trait]
impl Queue for SqsQueue {
    fn capabilities(&self) -> QueueCapabilities {
        QueueCapabilities {
            delay_max: Some(if self.fifo { Duration::ZERO } else { SQS_DELAY_MAX }),
            ordered_groups: self.fifo,
            priorities: false,
            visibility_max: Some(SQS_VISIBILITY_MAX),
            resolution: Duration::from_secs(1),
            hints_per_round_trip: SQS_BATCH_MAX,
        }
    }

    async fn enqueue(&self, hints: Vec<Hint>) -> StoreResult<()> {
        validate_enqueue(&hints, &self.capabilities())?;
        // One batch after the other, so a group's hints reach a FIFO queue in order. A
        // refused batch does not stop the others: its hints are reported after the last.
        let mut refused = Refused::default();
        let publish = fastrand::u64(..);
        for (n, chunk) in hints.chunks(SQS_BATCH_MAX).enumerate() {
            self.send_batch(n * SQS_BATCH_MAX, chunk, publish, &mut refused).await?;
        }
        match refused.first {
            None => Ok(()),
            Some(first) => Err(StoreError::unavailable(format!(
                "sqs SendMessageBatch on {}: {} of {} hints refused, the others were sent; \
                 first refusal: {first}",
                self.url,
                refused.count,
                hints.len()
            ))),
        }
    }

    async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> StoreResult<Vec<Delivery>> {
        validate_receive(max, visibility, wait, &self.capabilities())?;
        let visibility = secs(visibility);
        let mut out = self.receive_page(max, visibility, secs(wait)).await?;
        // Further pages only while full ones keep coming, without waiting; bounded by
        // `max`, which is at most a few pages. A page that fails ends the receive with
        // the deliveries already leased (failing it would hide them for their whole
        // visibility); the next receive meets the error if it lasts.
        let mut last = out.len();
        while last == SQS_BATCH_MAX && out.len() < max {
            let Ok(page) = self.receive_page(max - out.len(), visibility, 0).await else {
                break;
            };
            last = page.len();
            out.extend(page);
        }
        Ok(out)
    }

    /// Deletes every batch of 10 even when one fails, and then reports the first failure.
    async fn ack(&self, receipts: Vec<String>) -> StoreResult<()> {
        validate_receipts(&receipts)?;
        let mut first = None;
        for chunk in receipts.chunks(SQS_BATCH_MAX) {
            if let Err(e) = self.delete_batch(chunk).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn nack(&self, receipt: String, delay: Duration) -> StoreResult<()> {
        validate_receipts(std::slice::from_ref(&receipt))?;
        validate_nack_delay(delay, &self.capabilities())?;
        self.change_visibility(receipt, secs(delay), "nack").await
    }

    async fn extend(&self, receipt: String, visibility: Duration) -> StoreResult<()> {
        validate_receipts(std::slice::from_ref(&receipt))?;
        validate_visibility(visibility, &self.capabilities())?;
        self.change_visibility(receipt, secs(visibility), "extend").await
    }
}

/// Whether a `ChangeMessageVisibility` error (or a failed entry of a
/// `DeleteMessageBatch`) with `code` and `message` says that the
/// receipt no longer names a message this receiver holds (acked, received again, or
/// expired), so the lease is gone (`NotFound`) rather than SQS being out of reach. SQS
/// says so with `ReceiptHandleIsInvalid`, `MessageNotInflight`
/// (`AWS.SimpleQueueService.MessageNotInflight`), or `InvalidParameterValue` about the
/// receipt handle: "Value … for parameter ReceiptHandle is invalid. Reason: The receipt
/// handle has expired." or "… Message does not exist or is not available for visibility
/// timeout change.". An `InvalidParameterValue` about anything else (the timeout) is not.
fn receipt_gone(code: Option<&str>, message: Option<&str>) -> bool {
    let Some(code) = code else { return false };
    // A code may come with a prefix (`AWS.SimpleQueueService.`, `com.amazonaws.sqs#`).
    match code.rsplit(['.', '#']).next().unwrap_or(code) {
        "ReceiptHandleIsInvalid" | "MessageNotInflight" => true,
        "InvalidParameterValue" => {
            let message = message.unwrap_or_default().to_ascii_lowercase();
            ["receipthandle", "receipt handle", "not available for visibility timeout change"]
                .iter()
                .any(|about| message.contains(about))
        }
        _ => false,
    }
}

/// How long SQS lets a queue's name be, `.fifo` included.
const SQS_QUEUE_NAME_MAX: usize = 80;

/// How long the name of a queue [`SqsQueue::create`] makes may be before `.fifo`: what is
/// left of SQS's bound after `.fifo` and, with a redrive policy, the dead-letter queue's
/// `-dlq`, so both queues' names fit.
fn base_name_max(fifo: bool, dlq: bool) -> usize {
    SQS_QUEUE_NAME_MAX - if fifo { ".fifo".len() } else { 0 } - if dlq { "-dlq".len() } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::{
        SQS_GROUP_ID_MAX, body_takes, check_url, decode, encode, fnv1a64, group_id,
        instance_group_id, receipt_gone,
    };
    use keel_core::InstanceId;
    use keel_core::ports::queue::Hint;

    /// Every key a store accepts gives a body SQS takes, and the body gives the key back.
    #[test]
    fn every_key_makes_a_body_sqs_takes_and_comes_back() {
        for key in [
            "plain-key",
            "t\u{1}",
            "100%",
            "%41",
            "%+1",
            "%",
            "a|b",
            "\u{FFFE}\u{FFFF}",
            "tab\there",
            "日本\u{7f}",
        ] {
            let hint = Hint::new(InstanceId(3), 4).group(key);
            let body = encode(&hint);
            assert!(body.chars().all(body_takes), "key {key:?} gave body {body:?}");
            assert_eq!(decode(&body).and_then(|h| h.group).as_deref(), Some(key), "{body:?}");
        }
        let level = keel_core::Priority::Normal.level();
        let body = encode(&Hint::new(InstanceId(3), 4).group("plain key"));
        assert_eq!(body, format!("3|4|{level}|plain key"), "a key SQS takes is written as it is");
        // A body written before keys were encoded still decodes: a `%` not followed by two
        // hex digits is the character itself.
        let old = decode(&format!("3|4|{level}|50%+off")).and_then(|h| h.group);
        assert_eq!(old.as_deref(), Some("50%+off"));
        // So does one whose raw key reads as escapes of bytes that are not UTF-8: the
        // hint is kept, with the key as written.
        for raw in ["sku%E9", "%FF", "%C3x", "caf%E9-%41"] {
            let old = decode(&format!("3|4|{level}|{raw}"));
            assert_eq!(
                old.and_then(|h| h.group).as_deref(),
                Some(raw),
                "old body with key {raw:?}"
            );
        }
    }

    #[test]
    fn only_sqs_queue_urls_open() {
        for good in [
            "https://sqs.us-east-1.amazonaws.com/123456789012/keel-hints",
            "https://sqs.us-east-1.amazonaws.com/123456789012/keel-hints.fifo",
            "http://127.0.0.1:9324/000000000000/q",
            "http://localhost:9324/queue/q_1",
        ] {
            check_url(good, Some("us-east-1")).unwrap();
        }
        for bad in [
            "",
            "keel-hints",
            "arn:aws:sqs:us-east-1:123456789012:keel-hints",
            "https://sqs.us-east-1.amazonaws.com/keel-hints",
            "https://sqs.us-east-1.amazonaws.com/123456789012/",
            "https://sqs.us-east-1.amazonaws.com/123456789012/a/b",
            "ftp://host/1/q",
        ] {
            let error = check_url(bad, Some("us-east-1")).unwrap_err();
            assert!(
                error.starts_with(&format!("url {bad:?}: expected an SQS queue URL")),
                "{error}"
            );
        }
        let error =
            check_url("https://sqs.eu-west-1.amazonaws.com/123456789012/q", Some("us-east-1"))
                .unwrap_err();
        assert!(
            error.contains("the queue is in region eu-west-1 but the client is for us-east-1"),
            "{error}"
        );
    }

    /// What SQS takes as a `MessageGroupId`: 1 to 128 characters of `!` to `~`.
    fn sqs_takes(id: &str) -> bool {
        (1..=SQS_GROUP_ID_MAX).contains(&id.len()) && id.bytes().all(|b| (b'!'..=b'~').contains(&b))
    }

    #[test]
    fn every_key_maps_to_a_group_id_sqs_takes_and_always_the_same_one() {
        let long = "k".repeat(200);
        let keys = ["a b", "tenant Acme", "café", "日本", "tab\there", long.as_str()];
        for key in keys {
            let id = group_id(key);
            assert!(sqs_takes(&id), "key {key:?} gave group id {id:?}");
            assert!(id.starts_with("h-"), "key {key:?} does not fit after `k-`, so it is hashed");
            assert_eq!(id, group_id(key), "key {key:?} gave two different ids");
        }
        assert_ne!(group_id("a b"), group_id("a  b"), "different keys, different groups");
        assert_ne!(group_id(&long), group_id(&"k".repeat(201)));
        for instance in [0, 1, 42, i64::MAX, i64::MIN] {
            let id = instance_group_id(InstanceId(instance));
            assert!(sqs_takes(&id), "instance {instance} gave group id {id:?}");
        }
    }

    #[test]
    fn keys_that_fit_are_sent_behind_k() {
        let longest = "x".repeat(SQS_GROUP_ID_MAX - 2);
        for key in ["tenant-42", "a", "", "!~{}|:#", "1234", longest.as_str()] {
            assert_eq!(group_id(key), format!("k-{key}"));
            assert!(sqs_takes(&group_id(key)), "key {key:?}");
        }
        let too_long = "x".repeat(SQS_GROUP_ID_MAX - 1);
        assert_eq!(group_id(&too_long), format!("h-{:016x}", fnv1a64(&too_long)));
        assert_eq!(instance_group_id(InstanceId(42)), "i-42");
        assert_eq!(instance_group_id(InstanceId(-7)), "i--7");
    }

    /// A key never shares a FIFO group with an instance's hints, nor with the hashed
    /// group of another key, whatever it is spelled like.
    #[test]
    fn no_key_shares_a_group_with_an_instance_or_a_hashed_key() {
        let hashed = group_id("a b");
        assert!(hashed.starts_with("h-"), "{hashed}");
        let instance = instance_group_id(InstanceId(42));
        for key in ["42", &instance, &hashed, "k-42"] {
            let id = group_id(key);
            assert_ne!(id, instance, "key {key:?} and instance 42");
            assert_ne!(id, hashed, "key {key:?} and key \"a b\"");
        }
        assert_ne!(group_id("42"), group_id("k-42"), "different keys, different groups");
        // A key equal to the group id of another key is still its own group.
        assert_ne!(group_id(&group_id("tenant-42")), group_id("tenant-42"));
        for id in [0, 1, 42, -1, i64::MAX, i64::MIN] {
            let instance = instance_group_id(InstanceId(id));
            for key in [id.to_string(), instance.clone()] {
                assert_ne!(group_id(&key), instance, "key {key:?} and instance {id}");
            }
        }
    }

    /// A stale or expired receipt is `NotFound` whichever way SQS says so; an error about
    /// anything else stays what it was.
    #[test]
    fn a_stale_receipt_is_told_apart_from_other_visibility_errors() {
        let gone = [
            ("ReceiptHandleIsInvalid", "The input receipt handle is invalid."),
            ("AWS.SimpleQueueService.ReceiptHandleIsInvalid", ""),
            ("MessageNotInflight", ""),
            ("AWS.SimpleQueueService.MessageNotInflight", "Message is not in flight."),
            (
                "InvalidParameterValue",
                "Value AQEBzbVv for parameter ReceiptHandle is invalid. Reason: The receipt \
                 handle has expired.",
            ),
            (
                "InvalidParameterValue",
                "Value AQEBzbVv for parameter ReceiptHandle is invalid. Reason: Message does \
                 not exist or is not available for visibility timeout change.",
            ),
            ("InvalidParameterValue", "The receipt handle has expired."),
            (
                "InvalidParameterValue",
                "Message does not exist or is not available for visibility timeout change",
            ),
            ("AWS.SimpleQueueService.InvalidParameterValue", "The receipt handle has expired."),
        ];
        for (code, message) in gone {
            assert!(receipt_gone(Some(code), Some(message)), "{code}: {message}");
        }
        let other = [
            (
                "InvalidParameterValue",
                "Value 43201 for parameter VisibilityTimeout is invalid. Reason: Must be \
                 between 0 and 43200.",
            ),
            (
                "InvalidParameterValue",
                "Value 43200 for parameter VisibilityTimeout is invalid. Reason: Total \
                 VisibilityTimeout for the message is beyond the limit [43200 seconds]",
            ),
            ("InvalidParameterValue", ""),
            ("AWS.SimpleQueueService.NonExistentQueue", "The specified queue does not exist."),
            ("ThrottlingException", "Rate exceeded for receipt handle"),
            ("", "The receipt handle has expired."),
        ];
        for (code, message) in other {
            assert!(!receipt_gone(Some(code), Some(message)), "{code}: {message}");
        }
        assert!(!receipt_gone(Some("InvalidParameterValue"), None));
        assert!(!receipt_gone(None, Some("The receipt handle has expired.")));
    }

    /// The hash must never change between versions: a group id that changed during a
    /// rolling upgrade would let hints of one key overtake each other.
    #[test]
    fn the_hash_is_fnv1a_64() {
        assert_eq!(fnv1a64(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64("foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(group_id("a b"), format!("h-{:016x}", fnv1a64("a b")));
    }
}
