//! Claiming: which candidates a claim takes, and the row each becomes.
//!
//! A store offers candidates in claim order: the claim's [`ClaimPolicy`] ranks each row
//! ([`ClaimPolicy::rank`]), then `eligible_at`, then id. A
//! candidate is taken when it is runnable and due, passes the claim's namespace, queue
//! and machine filters, its queue is not paused, no other instance with its concurrency
//! key is executing beyond the policy's key limit (counting those taken earlier in the
//! claim), its queue is under the policy's global limit, and no other
//! instance holds its unique key in the executing scope. At most `limit` are taken. A claim
//! offers its candidates in fair order across concurrency keys ([`fair_order`]: rounds,
//! each taking the next row of every key, over the keys a rotation that continues from
//! the queue's cursor picks); a claim of named instances offers them in claim order. A
//! taken row that holds a stored value no reader accepts (or whose inbox does) is not
//! handed out: it is suspended and dead-lettered alone ([`undecodable`]), and its
//! neighbours are claimed as usual.

use crate::config::Strategy;
use crate::error::{StoreError, StoreResult};
use crate::ids::Priority;
use crate::instance::{Instance, Signal, undecodable_error};
use crate::limits;
use crate::outcome::{self, Applied};
use crate::ports::store::ClaimParams;
use crate::time::Timestamp;
use std::collections::HashMap;
use std::time::Duration;

/// How one claim orders and bounds the rows of the queue it claims from: the queue's
/// strategy, its starvation bound and its limit across all workers.
///
/// The [`Default`] is the order a store uses when its caller names no strategy (priority,
/// no starvation bound, no global limit); a worker always passes the strategy its queue
/// is configured with, whose documented default is `fifo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimPolicy {
    /// `fifo`: eligible order, priorities ignored; `priority`: priority, then eligible
    /// order.
    pub strategy: Strategy,
    /// Under `priority`, a ready row that has been eligible for at least this long is
    /// claimed ahead of every priority (oldest first among such rows), so a steady stream
    /// of urgent work cannot starve the rest. Ignored under `fifo`, which cannot starve.
    pub starvation_after: Option<Duration>,
    /// Most rows of the queue executing at once across all workers; a claim takes at most
    /// the difference between this and the rows already executing in the queue.
    pub global_limit: Option<u32>,
    /// Rows of one concurrency key executing at once (1 = one at a time, in claim order).
    pub key_limit: u32,
    /// Starts of the queue per period across all workers (a token bucket); rows over it
    /// stay ready until tokens return.
    pub rate: Option<RateLimit>,
    /// Starts of each concurrency key of the queue per period across all workers: one token
    /// bucket per (queue, key). A keyed row is admitted only while its key's bucket holds a
    /// token; rows over it stay ready, and other keys' rows are claimed meanwhile.
    pub key_rate: Option<RateLimit>,
}

/// A token bucket: up to `burst` starts at once, refilled at `starts` per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Starts allowed per period.
    pub starts: u32,
    /// The period.
    pub per: Duration,
    /// Most tokens the bucket holds (starts at once after an idle spell); a new bucket
    /// starts full.
    pub burst: u32,
}

/// A queue's bucket as a store keeps it. Refills are exact: whole thousandths of a token
/// go to `millitokens`, and what is left of a thousandth is kept in `carry` (in units of
/// one thousandth of a token divided by the period in milliseconds), so frequent claims
/// lose nothing to rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Tokens left, in thousandths of a token.
    pub millitokens: i64,
    /// When `millitokens` was computed (the last claim of the queue).
    pub at: Timestamp,
    /// The part of a thousandth not yet added: `carry / per_ms` thousandths.
    pub carry: i64,
    /// The last claim was cut short by the tokens (it could have taken more rows): rows
    /// are waiting for tokens, so what accrues until the next claim is theirs and not
    /// lost to the burst cap (up to one period's worth; see [`RateLimit::refill`]).
    pub backlog: bool,
}

impl RateLimit {
    fn per_ms(&self) -> i128 {
        i128::try_from(self.per.as_millis()).unwrap_or(i128::MAX).max(1)
    }

    /// Thousandths of a token accrued over `ms` milliseconds (whole ones, and the rest in
    /// `carry` units).
    fn accrued(&self, ms: i128, carry: i64) -> (i128, i64) {
        let num = ms.max(0) * i128::from(self.starts) * 1000 + i128::from(carry.max(0));
        let per = self.per_ms();
        (num / per, i64::try_from(num % per).unwrap_or(0))
    }

    /// The bucket refilled up to `now` (a missing bucket is full).
    ///
    /// The bucket holds at most `burst` tokens, except that tokens which accrued since the
    /// last claim while rows were waiting for tokens ([`Bucket::backlog`]) are kept on top
    /// of what was left, up to one period's worth (`starts`): a claimer polling less often
    /// than tokens arrive still gets the configured rate, and a long spell without any
    /// claimer does not save up more than one period.
    pub fn refill(&self, bucket: Option<Bucket>, now: Timestamp) -> Bucket {
        let cap = i128::from(self.burst) * 1000;
        let Some(b) = bucket else {
            return Bucket { millitokens: Self::clamp(cap), at: now, carry: 0, backlog: false };
        };
        let elapsed = i128::from(now.0.saturating_sub(b.at.0).max(0));
        let (gained, carry) = self.accrued(elapsed, b.carry);
        let tokens = i128::from(b.millitokens) + gained;
        let ceiling = if b.backlog {
            let window = elapsed.min(self.per_ms());
            cap.max(i128::from(b.millitokens) + self.accrued(window, b.carry).0)
        } else {
            cap
        };
        if tokens > ceiling {
            return Bucket {
                millitokens: Self::clamp(ceiling),
                at: now.max(b.at),
                carry: 0,
                backlog: b.backlog,
            };
        }
        Bucket { millitokens: Self::clamp(tokens), at: now.max(b.at), carry, backlog: b.backlog }
    }

    fn clamp(v: i128) -> i64 {
        i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
    }

    /// How many starts the refilled bucket allows now.
    pub fn room(bucket: &Bucket) -> usize {
        usize::try_from(bucket.millitokens / 1000).unwrap_or(0)
    }

    /// The bucket after `taken` starts.
    pub fn spend(bucket: Bucket, taken: usize) -> Bucket {
        let spent = i64::try_from(taken).unwrap_or(i64::MAX).saturating_mul(1000);
        Bucket { millitokens: bucket.millitokens.saturating_sub(spent), ..bucket }
    }

    /// The earliest time, from the bucket's own `at` on, at which the refilled bucket passes
    /// `reached` (which must stay true once it holds: tokens and the cap only grow with
    /// time), or `None` when it never does. A binary search over [`refill`](Self::refill)
    /// itself, so the answer follows the same exact accounting.
    fn first_time(
        &self,
        b: Bucket,
        tokens: u64,
        reached: impl Fn(&Bucket) -> bool,
    ) -> Option<Timestamp> {
        if reached(&self.refill(Some(b), b.at)) {
            return Some(b.at);
        }
        // `tokens` whole tokens accrue within `tokens / starts + 2` periods, from any bucket.
        let periods = i128::from(tokens) / i128::from(self.starts.max(1)) + 2;
        let span = Self::clamp(periods.saturating_mul(self.per_ms()));
        let mut hi = b.at.0.saturating_add(span);
        if !reached(&self.refill(Some(b), Timestamp(hi))) {
            return None;
        }
        // Halves `lo..hi` each turn: at most 64 turns over i64 milliseconds.
        let mut lo = b.at.0;
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if reached(&self.refill(Some(b), Timestamp(mid))) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Some(Timestamp(hi))
    }

    /// The times at which the stored bucket `b` first holds 1, 2, … `most` whole tokens
    /// (fewer when its cap stops it earlier), ascending. How many of them are at or before
    /// a time is the bucket's room then, up to `most`, so a store can count a key's tokens
    /// with a comparison of times.
    pub fn token_times(&self, b: Bucket, most: usize) -> Vec<Timestamp> {
        let mut out = Vec::with_capacity(most.min(limits::KEY_RATE_ROOM_MAX));
        for n in 1..=most.min(limits::KEY_RATE_ROOM_MAX) {
            let tokens = u64::try_from(n).unwrap_or(u64::MAX);
            match self.first_time(b, tokens, |r| Self::room(r) >= n) {
                Some(t) => out.push(t),
                None => break,
            }
        }
        out
    }

    /// When the stored bucket `b` is full (holds at least `burst` tokens, what a new bucket
    /// holds); a bucket that is full and whose key has no ready row may be deleted, since a
    /// new bucket would start no more rows than it.
    pub fn full_at(&self, b: Bucket) -> Timestamp {
        let cap = i64::from(self.burst).saturating_mul(1000);
        self.first_time(b, u64::from(self.burst), |r| r.millitokens >= cap)
            .unwrap_or(limits::TIMESTAMP_MAX)
    }

    /// Whether the stored bucket `b` is full at `now` (see [`full_at`](Self::full_at)).
    pub fn is_full(&self, b: Bucket, now: Timestamp) -> bool {
        self.refill(Some(b), now).millitokens >= i64::from(self.burst).saturating_mul(1000)
    }

    /// The bucket to store after a claim that asked for `limit` rows took `taken` of them
    /// from the `refilled` bucket: spent, and marked as having rows waiting for tokens
    /// when the tokens (not the claim's own limit, nor a lack of ready rows) cut it short.
    pub fn after_claim(refilled: Bucket, limit: usize, taken: usize) -> Bucket {
        let room = Self::room(&refilled);
        let backlog = room < limit && taken >= room;
        Bucket { backlog, ..Self::spend(refilled, taken) }
    }
}

/// A concurrency key's bucket as a store writes it after a claim took rows of the key:
/// the bucket, the times its next tokens arrive ([`RateLimit::token_times`], up to the
/// key limit and [`limits::KEY_RATE_ROOM_MAX`]) and when it is full
/// ([`RateLimit::full_at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyBucket {
    /// The concurrency key.
    pub key: String,
    /// The bucket after the claim.
    pub bucket: Bucket,
    /// When the bucket holds 1, 2, … whole tokens.
    pub token_times: Vec<Timestamp>,
    /// When the bucket is full again.
    pub full_at: Timestamp,
}

/// How many rows of a key the refilled bucket `refilled` admits in one claim: its whole
/// tokens, at most [`limits::KEY_RATE_ROOM_MAX`].
pub fn key_rate_room(refilled: &Bucket) -> usize {
    RateLimit::room(refilled).min(limits::KEY_RATE_ROOM_MAX)
}

/// The bucket of `key` to store after a claim of `limit` rows under `policy` took `taken`
/// rows of the key at `now`, from its `stored` bucket (`None`: a new, full bucket). The
/// exact accounting of the queue's bucket ([`RateLimit::after_claim`]), per key.
pub fn key_bucket_after(
    policy: &ClaimPolicy,
    key: &str,
    stored: Option<Bucket>,
    now: Timestamp,
    limit: usize,
    taken: usize,
) -> Option<KeyBucket> {
    let rate = policy.key_rate?;
    let bucket = RateLimit::after_claim(rate.refill(stored, now), limit, taken);
    let most = usize::try_from(policy.key_limit).unwrap_or(usize::MAX);
    Some(KeyBucket {
        key: key.to_owned(),
        bucket,
        token_times: rate.token_times(bucket, most),
        full_at: rate.full_at(bucket),
    })
}

impl Default for ClaimPolicy {
    fn default() -> Self {
        ClaimPolicy {
            strategy: Strategy::Priority,
            starvation_after: None,
            global_limit: None,
            key_limit: 1,
            rate: None,
            key_rate: None,
        }
    }
}

/// One rank of the claim order and the rows it holds (see [`ClaimPolicy::rank_bands`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankBand {
    /// The rank its rows take.
    pub rank: i16,
    /// Only rows of this priority (`None`: any).
    pub priority: Option<Priority>,
    /// Only rows eligible at or before this time (`None`: no bound).
    pub at_or_before: Option<Timestamp>,
    /// Only rows eligible after this time (`None`: no bound).
    pub after: Option<Timestamp>,
}

impl RankBand {
    /// Whether `row` is in this band.
    pub fn holds(&self, row: &Instance) -> bool {
        self.priority.is_none_or(|p| row.priority == p)
            && self.at_or_before.is_none_or(|t| row.eligible_at <= t)
            && self.after.is_none_or(|t| row.eligible_at > t)
    }
}

/// The rank a starving row takes: ahead of the most urgent priority (`critical` = 0).
pub const STARVING_RANK: i16 = -1;

/// The rank every row of a `fifo` queue takes: one rank, so eligible order alone decides.
pub const FIFO_RANK: i16 = 0;

impl ClaimPolicy {
    /// A policy with `strategy`, no starvation bound and no global limit.
    pub fn new(strategy: Strategy) -> Self {
        ClaimPolicy { strategy, ..ClaimPolicy::default() }
    }

    /// The policy of today's index order (priority, then eligible order, no limit), which
    /// stores serve with their plain claim statement.
    pub fn is_plain_priority(&self) -> bool {
        self.strategy == Strategy::Priority
            && self.starvation_after.is_none()
            && self.global_limit.is_none()
            && self.key_limit == 1
            && self.rate.is_none()
            && self.key_rate.is_none()
    }

    /// `eligible_at` at or before which a row is starving at `now`, when the policy has a
    /// starvation bound that applies.
    pub fn starving_at_or_before(&self, now: Timestamp) -> Option<Timestamp> {
        match (self.strategy, self.starvation_after) {
            (Strategy::Priority, Some(age)) => Some(now.minus(age)),
            _ => None,
        }
    }

    /// The first component of a row's claim order at `now`: [`FIFO_RANK`] for every row
    /// under `fifo`; under `priority`, [`STARVING_RANK`] for a row eligible for at least
    /// the starvation bound, else its priority level. Rows are claimed by rank, then
    /// `eligible_at`, then id.
    pub fn rank(&self, row: &Instance, now: Timestamp) -> i16 {
        match self.strategy {
            Strategy::Fifo => FIFO_RANK,
            Strategy::Priority => match self.starving_at_or_before(now) {
                Some(bound) if row.eligible_at <= bound => STARVING_RANK,
                _ => row.priority.level(),
            },
        }
    }

    /// The ranks of the claim order at `now`, in claim order, each with the rows it holds
    /// (a priority and a range of `eligible_at`): every row falls in exactly one band,
    /// the one of its [`rank`](Self::rank), and within a band rows are claimed in
    /// (`eligible_at`, id) order. A store reads a ranked order band by band along an index
    /// in that order, instead of ranking and sorting every ready row.
    pub fn rank_bands(&self, now: Timestamp) -> Vec<RankBand> {
        match self.strategy {
            Strategy::Fifo => vec![RankBand { rank: FIFO_RANK, ..RankBand::default() }],
            Strategy::Priority => {
                let bound = self.starving_at_or_before(now);
                let starving = bound.map(|at_or_before| RankBand {
                    rank: STARVING_RANK,
                    at_or_before: Some(at_or_before),
                    ..RankBand::default()
                });
                let levels = Priority::ALL.into_iter().map(|priority| RankBand {
                    rank: priority.level(),
                    priority: Some(priority),
                    after: bound,
                    ..RankBand::default()
                });
                starving.into_iter().chain(levels).collect()
            }
        }
    }

    /// Whether a claim under this policy must be serialized with the other claims of its
    /// queue (it reads and writes queue-wide state: the executing count, the buckets).
    pub fn is_queue_wide(&self) -> bool {
        self.global_limit.is_some() || self.rate.is_some() || self.key_rate.is_some()
    }

    /// The full claim order key of a row at `now`.
    pub fn order_key(&self, row: &Instance, now: Timestamp) -> (i16, Timestamp, i64) {
        (self.rank(row, now), row.eligible_at, row.id.0)
    }

    /// How many rows a claim of one queue may still take under the global limit, given
    /// how many of the queue's rows are executing (`None` = no global limit).
    pub fn room(&self, executing: u64) -> Option<usize> {
        self.global_limit
            .map(|limit| usize::try_from(u64::from(limit).saturating_sub(executing)).unwrap_or(0))
    }

    /// Checks the policy against the claim it rides on: a global limit is counted per
    /// queue, so the claim must name exactly one queue.
    pub fn validate(&self, queues: &[String]) -> StoreResult<()> {
        if let Some(limit) = self.global_limit {
            if limit == 0 {
                return Err(StoreError::invalid(
                    "policy.global_limit: must be at least 1; pause the queue to stop it",
                ));
            }
            if queues.len() != 1 {
                return Err(StoreError::invalid(format!(
                    "policy.global_limit: a global limit is counted per queue, so the claim must name exactly one queue (it names {})",
                    queues.len()
                )));
            }
        }
        if let Some(rate) = self.rate {
            if rate.starts == 0 || rate.burst == 0 || rate.per.is_zero() {
                return Err(StoreError::invalid(
                    "policy.rate: starts, burst and per must be greater than zero; pause the queue to stop it",
                ));
            }
            if queues.len() != 1 {
                return Err(StoreError::invalid(format!(
                    "policy.rate: a rate limit is counted per queue, so the claim must name exactly one queue (it names {})",
                    queues.len()
                )));
            }
        }
        if let Some(rate) = self.key_rate {
            if rate.starts == 0 || rate.burst == 0 || rate.per.is_zero() {
                return Err(StoreError::invalid(
                    "policy.key_rate: starts, burst and per must be greater than zero; pause the queue to stop it",
                ));
            }
            if queues.len() != 1 {
                return Err(StoreError::invalid(format!(
                    "policy.key_rate: a key's bucket is counted per queue, so the claim must name exactly one queue (it names {})",
                    queues.len()
                )));
            }
        }
        if self.key_limit == 0 {
            return Err(StoreError::invalid(
                "policy.key_limit: must be at least 1 (1 = one row of a key at a time)",
            ));
        }
        if self.starvation_after.is_some_and(|d| d.is_zero()) {
            return Err(StoreError::invalid(
                "policy.starvation_after: must be greater than zero, or unset for no bound",
            ));
        }
        Ok(())
    }
}

/// What a store read about one candidate, beyond its row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CandidateRead {
    /// The candidate's queue is paused.
    pub queue_paused: bool,
    /// Another instance with the candidate's concurrency key is executing.
    pub key_executing: bool,
    /// How many instances with the candidate's concurrency key are executing (read only
    /// when the policy's key limit is above 1; `key_executing` alone counts as 1).
    pub key_running: u32,
    /// How many rows of the candidate's queue are executing (read only when the claim's
    /// policy has a global limit; 0 otherwise).
    pub queue_executing: u64,
}

/// The decisions of one claim call, candidate by candidate.
#[derive(Debug)]
pub struct ClaimPlanner<'a> {
    params: &'a ClaimParams,
    /// Concurrency keys taken earlier in this claim, with how many rows each.
    keys: HashMap<String, u32>,
    /// Rows taken earlier in this claim, per queue (for the global limit).
    per_queue: HashMap<String, u64>,
    taken: usize,
    /// Most rows this claim takes: the claim's limit, lowered by the rate limit's room.
    cap: usize,
    /// Under a per-key rate limit: each key's stored bucket refilled to the claim's time,
    /// with how many of its rows the claim may take ([`key_rate_room`]).
    key_buckets: HashMap<String, (Option<Bucket>, usize)>,
}

impl<'a> ClaimPlanner<'a> {
    /// A planner for one claim call.
    pub fn new(params: &'a ClaimParams) -> Self {
        ClaimPlanner {
            params,
            keys: HashMap::new(),
            per_queue: HashMap::new(),
            taken: 0,
            cap: params.limit,
            key_buckets: HashMap::new(),
        }
    }

    /// Under a per-key rate limit, reads the stored bucket of concurrency key `key`
    /// (`None`: the key has none, so a new, full one) and returns how many of the key's
    /// rows the claim may take; `None` without a per-key rate limit. A store calls it for
    /// every key whose rows it offers: a keyed row of a key it was not called for is not
    /// admitted.
    pub fn key_rate(&mut self, key: &str, stored: Option<Bucket>) -> Option<usize> {
        let rate = self.params.policy.key_rate?;
        let room = key_rate_room(&rate.refill(stored, self.params.now));
        self.key_buckets.insert(key.to_owned(), (stored, room));
        Some(room)
    }

    /// How many more rows of `key` the per-key rate limit admits in this claim (`None`:
    /// no per-key rate limit).
    pub fn key_rate_room(&self, key: &str) -> Option<usize> {
        self.params.policy.key_rate?;
        let room = self.key_buckets.get(key).map_or(0, |(_, room)| *room);
        let taken = usize::try_from(self.keys.get(key).copied().unwrap_or(0)).unwrap_or(usize::MAX);
        Some(room.saturating_sub(taken))
    }

    /// The buckets to store after the claim: one per key the claim took rows of
    /// ([`key_bucket_after`]). Keys that took none keep their stored bucket.
    pub fn key_buckets_spent(&self) -> Vec<KeyBucket> {
        let mut out: Vec<KeyBucket> = self
            .key_buckets
            .iter()
            .filter_map(|(key, (stored, _))| {
                let taken = usize::try_from(*self.keys.get(key)?).unwrap_or(usize::MAX);
                key_bucket_after(
                    &self.params.policy,
                    key,
                    *stored,
                    self.params.now,
                    self.params.limit,
                    taken,
                )
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// Whether the claim has taken as many rows as it asked for.
    pub fn is_full(&self) -> bool {
        self.taken >= self.cap
    }

    /// Applies the policy's rate limit to the queue's stored bucket: the claim takes no
    /// more rows than the refilled bucket has tokens. Returns the refilled bucket, which
    /// the store writes back through [`spent`](Self::spent) after the claim.
    pub fn rate(&mut self, bucket: Option<Bucket>) -> Option<Bucket> {
        let rate = self.params.policy.rate?;
        let refilled = rate.refill(bucket, self.params.now);
        self.cap = self.cap.min(RateLimit::room(&refilled));
        Some(refilled)
    }

    /// The bucket to store after the claim: the refilled one less what was taken, noting
    /// whether the tokens cut the claim short ([`RateLimit::after_claim`]).
    pub fn spent(&self, refilled: Bucket) -> Bucket {
        RateLimit::after_claim(refilled, self.params.limit, self.taken)
    }

    /// How many rows the claim may take at most (after [`rate`](Self::rate)).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The row `row` becomes when claimed, or `None` when it may not be claimed. The store
    /// then looks up who holds the returned row's unique guard (its unique key in the
    /// executing scope) and calls [`take`](Self::take).
    pub fn offer(&self, row: &Instance, read: CandidateRead) -> Option<Instance> {
        let p = self.params;
        let admitted = !self.is_full()
            && matches(p, row)
            && !read.queue_paused
            && self.under_global_limit(&row.queue, read.queue_executing)
            && row.concurrency_key.as_ref().is_none_or(|k| self.under_key_limit(k, read))
            && row.concurrency_key.as_ref().is_none_or(|k| self.key_rate_room(k) != Some(0));
        admitted.then(|| outcome::claim(row, &p.worker, p.lease, p.now))
    }

    /// Whether one more row of key `key` fits the policy's key limit, given the rows of it
    /// executing before the claim and those taken earlier in it.
    fn under_key_limit(&self, key: &str, read: CandidateRead) -> bool {
        let running = read.key_running.max(u32::from(read.key_executing));
        let taken = self.keys.get(key).copied().unwrap_or(0);
        running.saturating_add(taken) < self.params.policy.key_limit
    }

    /// Whether one more row of `queue` fits the policy's global limit, given the rows of it
    /// executing before the claim and those taken earlier in it.
    fn under_global_limit(&self, queue: &str, executing: u64) -> bool {
        let taken = self.per_queue.get(queue).copied().unwrap_or(0);
        self.params.policy.room(executing.saturating_add(taken)).is_none_or(|room| room > 0)
    }

    /// Whether the offered row `next` is taken, given whether another instance holds its
    /// unique guard. A taken row counts towards the limit and holds its concurrency key
    /// for the rest of the claim; the store writes it.
    pub fn take(&mut self, next: &Instance, key_occupied: bool) -> bool {
        if key_occupied {
            return false;
        }
        if let Some(k) = &next.concurrency_key {
            *self.keys.entry(k.clone()).or_default() += 1;
        }
        *self.per_queue.entry(next.queue.clone()).or_default() += 1;
        self.taken += 1;
        true
    }
}

/// Whether `row` is runnable and due and passes the claim's namespace, queue and machine
/// filters: what a candidate must be before any limit is looked at.
pub fn matches(p: &ClaimParams, row: &Instance) -> bool {
    outcome::claimable(row, p.now)
        && (p.namespaces.is_empty() || p.namespaces.contains(&row.namespace))
        && (p.queues.is_empty() || p.queues.contains(&row.queue))
        && (p.machines.is_empty() || p.machines.contains(&row.machine))
}

/// Whether a claim orders its candidates fairly across concurrency keys: every claim but
/// one of named instances (a queue hint's targets), which takes its rows in claim order.
pub fn is_fair(_params: &ClaimParams, by_ids: bool) -> bool {
    !by_ids
}

/// The queue whose rotation cursor a fair claim reads and moves: its one queue. A claim of
/// several queues, or of any queue, starts its rotation at the first key every time.
pub fn cursor_queue(params: &ClaimParams) -> Option<&str> {
    match params.queues.as_slice() {
        [one] => Some(one),
        _ => None,
    }
}

/// Where a concurrency key stands in the rotation that starts after the queue's cursor
/// `after` (the key served last): first the keys after it in ascending order, then the
/// keys up to and including it. Without a cursor the keys are in ascending order.
pub fn rotation<'k>(key: &'k str, after: Option<&str>) -> (bool, &'k str) {
    (after.is_some_and(|a| key <= a), key)
}

/// Orders a fair claim's candidates, given in claim order.
///
/// The keys that take part are the first `limit` keys in [`rotation`] order that have
/// room (`room(key)`: the key's limit less its executing rows) and a candidate; each
/// offers its first `room` candidates. The rows without a key all take part. The result is
/// in rounds — round `n` holds the `n`-th candidate of every key and the `n`-th row
/// without a key — and in claim order within a round. So a key contributes at most one
/// row to a round: one key with many ready rows delays another key's row by at most one
/// round, a key at its limit costs nothing, and with more keys than a claim can take the
/// rotation serves the others next.
pub fn fair_order(
    candidates: Vec<Instance>,
    after: Option<&str>,
    limit: usize,
    room: impl Fn(&str) -> u32,
) -> Vec<Instance> {
    let mut keys: Vec<&str> =
        candidates.iter().filter_map(|r| r.concurrency_key.as_deref()).collect();
    keys.sort_by(|a, b| rotation(a, after).cmp(&rotation(b, after)));
    keys.dedup();
    let rooms: HashMap<String, usize> = keys
        .into_iter()
        .filter_map(|k| {
            let r = room(k);
            (r > 0).then(|| (k.to_owned(), usize::try_from(r).unwrap_or(usize::MAX)))
        })
        .take(limit)
        .collect();
    let mut seen: HashMap<Option<String>, usize> = HashMap::new();
    let mut ranked: Vec<(usize, Instance)> = candidates
        .into_iter()
        .filter_map(|row| {
            let cap = match &row.concurrency_key {
                Some(k) => *rooms.get(k)?,
                None => usize::MAX,
            };
            let n = seen.entry(row.concurrency_key.clone()).or_default();
            let round = *n;
            *n += 1;
            (round < cap).then_some((round, row))
        })
        .collect();
    // Stable: claim order within a round.
    ranked.sort_by_key(|(round, _)| *round);
    ranked.into_iter().map(|(_, row)| row).collect()
}

/// The queue's rotation cursor after a fair claim: when the claim took all it could
/// (`full`), the last key in rotation order among the rows it took, so the next claim
/// starts with the keys after it. A claim that did not fill up but whose scan of the keys
/// stopped at its bound ([`limits::CLAIM_KEYS_SCAN_MAX`] keys visited, `stopped` naming
/// the last) moves the cursor to that key, so the next claim carries on past the keys
/// this one found without room. Otherwise every key with room was served and the cursor
/// stays.
pub fn cursor_after(
    after: Option<String>,
    taken: &[Instance],
    full: bool,
    stopped: Option<&str>,
) -> Option<String> {
    if !full {
        return stopped.map(str::to_owned).or(after);
    }
    let last = taken
        .iter()
        .filter_map(|r| r.concurrency_key.as_deref())
        .max_by(|a, b| rotation(a, after.as_deref()).cmp(&rotation(b, after.as_deref())));
    match last {
        Some(k) => Some(k.to_owned()),
        None => after,
    }
}

/// Why a taken row cannot be handed out: a stored value of the row or of the first inbox
/// signals it carries that no reader accepts.
pub fn damage(row: &Instance, inbox: &[Signal]) -> Option<String> {
    row.damage().or_else(|| {
        inbox.iter().find_map(|s| undecodable_error(&s.payload).map(|e| format!("inbox {e}")))
    })
}

/// The writes for a taken row that cannot be read: suspended, with its history and a dead
/// letter, so that it fails alone.
pub fn undecodable(row: &Instance, error: &str, now: Timestamp) -> Applied {
    outcome::undecodable_row(row, error, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{InstanceId, MachineRef, SignalId, Status, WorkerId};
    use crate::instance::NewInstance;
    use serde_json::json;
    use std::time::Duration;

    fn params(limit: usize) -> ClaimParams {
        ClaimParams {
            worker: WorkerId("w".into()),
            namespaces: vec![],
            queues: vec!["default".into()],
            machines: vec![],
            limit,
            lease: Duration::from_secs(30),
            now: Timestamp(100),
            policy: ClaimPolicy::default(),
        }
    }

    fn row(id: i64, key: Option<&str>) -> Instance {
        let mut new = NewInstance::new(MachineRef::new("m", 1), "start");
        new.concurrency_key = key.map(String::from);
        Instance::from_new(InstanceId(id), &new, None, Timestamp(0))
    }

    #[test]
    fn one_row_per_concurrency_key_up_to_the_limit() {
        let p = params(2);
        let mut planner = ClaimPlanner::new(&p);
        let first = planner.offer(&row(1, Some("k")), CandidateRead::default()).unwrap();
        assert_eq!((first.status, first.fencing_token.0), (Status::Executing, 1));
        assert!(planner.take(&first, false));
        assert_eq!(planner.offer(&row(2, Some("k")), CandidateRead::default()), None);
        let other = planner.offer(&row(3, None), CandidateRead::default()).unwrap();
        assert!(!planner.take(&other, true), "an occupied unique key is skipped");
        let other = planner.offer(&row(4, None), CandidateRead::default()).unwrap();
        assert!(planner.take(&other, false));
        assert!(planner.is_full());
        assert_eq!(planner.offer(&row(5, None), CandidateRead::default()), None);
    }

    #[test]
    fn filters_pauses_executing_keys_and_due_time_refuse_a_candidate() {
        let p = params(5);
        let planner = ClaimPlanner::new(&p);
        let paused = CandidateRead { queue_paused: true, ..CandidateRead::default() };
        let busy = CandidateRead { key_executing: true, ..CandidateRead::default() };
        assert_eq!(planner.offer(&row(1, None), paused), None);
        assert_eq!(planner.offer(&row(1, Some("k")), busy), None);
        let mut elsewhere = row(1, None);
        elsewhere.queue = "other".into();
        assert_eq!(planner.offer(&elsewhere, CandidateRead::default()), None);
        let mut later = row(1, None);
        later.eligible_at = Timestamp(101);
        assert_eq!(planner.offer(&later, CandidateRead::default()), None);
    }

    #[test]
    fn an_undecodable_inbox_payload_is_damage() {
        let signal = |payload| Signal {
            id: SignalId(1),
            target: InstanceId(1),
            name: "go".into(),
            payload,
            dedup_key: None,
            priority: None,
            inserted_at: Timestamp(0),
        };
        assert_eq!(damage(&row(1, None), &[signal(json!({ "a": 1 }))]), None);
        let bad = crate::instance::undecodable("payload", "bad");
        assert_eq!(damage(&row(1, None), &[signal(bad)]).as_deref(), Some("inbox payload: bad"));
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;
    use crate::ids::{InstanceId, MachineRef};
    use crate::instance::NewInstance;

    fn row(priority: Priority, eligible_ms: i64) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "s")
            .priority(priority)
            .eligible_at(Timestamp(eligible_ms));
        Instance::from_new(InstanceId(1), &new, None, Timestamp(0))
    }

    #[test]
    fn rank_follows_the_strategy_and_the_starvation_bound() {
        let now = Timestamp(10_000);
        let fifo = ClaimPolicy::new(Strategy::Fifo);
        assert_eq!(fifo.rank(&row(Priority::Critical, 9_000), now), FIFO_RANK);
        assert_eq!(fifo.rank(&row(Priority::Bulk, 9_000), now), FIFO_RANK);
        let priority = ClaimPolicy::new(Strategy::Priority);
        assert_eq!(priority.rank(&row(Priority::Low, 0), now), Priority::Low.level());
        let starving = ClaimPolicy { starvation_after: Some(Duration::from_secs(5)), ..priority };
        assert_eq!(
            starving.rank(&row(Priority::Bulk, 5_000), now),
            STARVING_RANK,
            "exactly the bound"
        );
        assert_eq!(starving.rank(&row(Priority::Bulk, 5_001), now), Priority::Bulk.level());
        let fifo_bound = ClaimPolicy { starvation_after: Some(Duration::from_secs(5)), ..fifo };
        assert_eq!(fifo_bound.starving_at_or_before(now), None, "fifo cannot starve a row");
        assert!(ClaimPolicy::default().is_plain_priority());
        assert!(!fifo.is_plain_priority());
    }

    #[test]
    fn rank_bands_hold_each_row_once_in_the_band_of_its_rank_in_claim_order() {
        let now = Timestamp(10_000);
        let priority = ClaimPolicy::new(Strategy::Priority);
        let policies = [
            ClaimPolicy::new(Strategy::Fifo),
            priority,
            ClaimPolicy { starvation_after: Some(Duration::from_secs(5)), ..priority },
        ];
        for policy in policies {
            let bands = policy.rank_bands(now);
            assert!(bands.windows(2).all(|w| w[0].rank < w[1].rank), "{bands:?}");
            for p in Priority::ALL {
                for eligible in [0, 4_999, 5_000, 5_001, 10_000] {
                    let r = row(p, eligible);
                    let holding: Vec<&RankBand> = bands.iter().filter(|b| b.holds(&r)).collect();
                    assert_eq!(holding.len(), 1, "{policy:?} {p:?} at {eligible}: {holding:?}");
                    assert_eq!(
                        holding[0].rank,
                        policy.rank(&r, now),
                        "{policy:?} {p:?} {eligible}"
                    );
                }
            }
        }
    }

    #[test]
    fn global_limit_counts_executing_rows_and_rows_taken_in_the_claim() {
        let policy = ClaimPolicy { global_limit: Some(3), ..ClaimPolicy::new(Strategy::Fifo) };
        assert_eq!((policy.room(1), policy.room(3), policy.room(7)), (Some(2), Some(0), Some(0)));
        let p = ClaimParams {
            worker: crate::ids::WorkerId("w".into()),
            namespaces: vec![],
            queues: vec!["default".into()],
            machines: vec![],
            limit: 10,
            lease: Duration::from_secs(30),
            now: Timestamp(100),
            policy,
        };
        let mut planner = ClaimPlanner::new(&p);
        let read = CandidateRead { queue_executing: 1, ..CandidateRead::default() };
        let mut taken = 0;
        for id in 1..=5 {
            let mut r = row(Priority::Normal, 0);
            r.id = InstanceId(id);
            if let Some(next) = planner.offer(&r, read) {
                assert!(planner.take(&next, false));
                taken += 1;
            }
        }
        assert_eq!(taken, 2, "3 allowed, 1 already executing");
        assert!(ClaimPolicy { global_limit: Some(0), ..policy }.validate(&p.queues).is_err());
        assert!(policy.validate(&[]).is_err(), "a global limit needs exactly one queue");
    }
}

#[cfg(test)]
mod rate_tests {
    use super::*;

    #[test]
    fn a_bucket_starts_full_refills_at_the_rate_and_caps_at_the_burst() {
        let rate = RateLimit { starts: 10, per: Duration::from_secs(1), burst: 4 };
        let full = rate.refill(None, Timestamp(0));
        assert_eq!(RateLimit::room(&full), 4);
        let empty = RateLimit::spend(full, 4);
        assert_eq!(RateLimit::room(&rate.refill(Some(empty), Timestamp(50))), 0, "half a token");
        assert_eq!(RateLimit::room(&rate.refill(Some(empty), Timestamp(250))), 2);
        let later = rate.refill(Some(empty), Timestamp(60_000));
        assert_eq!(RateLimit::room(&later), 4, "never above the burst");
        // Fractions carry over: 3 refills of 50 ms make 1.5 tokens.
        let mut b = empty;
        for t in [50, 100, 150] {
            b = rate.refill(Some(b), Timestamp(t));
        }
        assert_eq!(b.millitokens, 1_500);
    }
}

#[cfg(test)]
mod accuracy_tests {
    use super::*;

    /// A claimer that polls every `gap` ms for 10 s, always with more rows ready than the
    /// bucket allows, starts exactly the configured rate: tokens accrued between claims are
    /// not lost to a burst of 1, nor to rounding.
    #[test]
    fn a_burst_of_one_keeps_the_rate_whatever_the_claim_cadence() {
        for (starts, per_ms, gap) in
            [(100, 1_000, 7), (100, 1_000, 25), (1, 3_000, 1), (7, 1_000, 13)]
        {
            let rate = RateLimit { starts, per: Duration::from_millis(per_ms), burst: 1 };
            let mut stored = None;
            let mut started = 0usize;
            let mut now = 0;
            while now <= 30_000 {
                let refilled = rate.refill(stored, Timestamp(now));
                let took = RateLimit::room(&refilled).min(50);
                started += took;
                stored = Some(RateLimit::after_claim(refilled, 50, took));
                now += gap;
            }
            let last = now - gap;
            // A full bucket at 0 (1 token), then `starts` per `per`.
            let expected = 1 + (i64::from(starts) * last / i64::try_from(per_ms).unwrap()) as usize;
            assert_eq!(started, expected, "{starts} per {per_ms} ms polled every {gap} ms");
        }
    }

    #[test]
    fn an_idle_queue_saves_up_to_the_burst_and_a_waiting_one_one_period() {
        let rate = RateLimit { starts: 10, per: Duration::from_secs(1), burst: 2 };
        let full = rate.refill(None, Timestamp(0));
        // The queue ran dry: two tokens, one row taken.
        let dry = RateLimit::after_claim(full, 10, 1);
        assert!(!dry.backlog);
        assert_eq!(RateLimit::room(&rate.refill(Some(dry), Timestamp(60_000))), 2, "burst");
        // The tokens cut the claim short: rows wait, and a long gap gives one period.
        let short = RateLimit::after_claim(full, 10, 2);
        assert!(short.backlog);
        assert_eq!(RateLimit::room(&rate.refill(Some(short), Timestamp(60_000))), 10);
        assert_eq!(RateLimit::room(&rate.refill(Some(short), Timestamp(400))), 4, "all of it");
        // The claim's own limit cut it short, not the tokens: the burst cap applies.
        let own = RateLimit::after_claim(full, 1, 1);
        assert!(!own.backlog);
    }
}

#[cfg(test)]
mod fair_tests {
    use super::*;
    use crate::ids::{InstanceId, MachineRef};
    use crate::instance::NewInstance;

    fn row(id: i64, key: Option<&str>) -> Instance {
        let mut new = NewInstance::new(MachineRef::new("m", 1), "s");
        new.concurrency_key = key.map(String::from);
        Instance::from_new(InstanceId(id), &new, None, Timestamp(0))
    }

    fn order(rows: Vec<Instance>, after: Option<&str>, limit: usize) -> Vec<i64> {
        let room = |k: &str| if k == "full" { 0 } else { 2 };
        fair_order(rows, after, limit, room).iter().map(|r| r.id.0).collect()
    }

    #[test]
    fn rounds_in_claim_order_over_the_keys_the_rotation_picks() {
        let rows = || {
            vec![
                row(1, Some("a")),
                row(2, Some("full")),
                row(3, Some("a")),
                row(4, None),
                row(5, Some("c")),
                row(6, None),
                row(7, Some("b")),
                row(8, Some("a")),
            ]
        };
        // Round one: a, the first row without a key, c, b; round two: a's second (room
        // 2), the second row without a key. a's third is over its room; `full` has none.
        assert_eq!(order(rows(), None, 10), vec![1, 4, 5, 7, 3, 6]);
        // Two keys take part: after the cursor a, that is b and c.
        assert_eq!(order(rows(), Some("a"), 2), vec![4, 5, 7, 6]);
        assert_eq!(order(rows(), Some("b"), 2), vec![1, 4, 5, 3, 6]);
    }

    #[test]
    fn the_cursor_moves_to_the_last_key_in_rotation_of_a_full_claim() {
        let taken = vec![row(1, Some("c")), row(2, None), row(3, Some("a"))];
        assert_eq!(cursor_after(Some("b".into()), &taken, true, None).as_deref(), Some("a"));
        assert_eq!(cursor_after(None, &taken, true, None).as_deref(), Some("c"));
        assert_eq!(cursor_after(Some("x".into()), &taken, false, None).as_deref(), Some("x"));
        assert_eq!(cursor_after(Some("x".into()), &taken[1..2], true, None).as_deref(), Some("x"));
        // A full claim moves by what it took, even when its scan stopped at the bound.
        assert_eq!(cursor_after(Some("b".into()), &taken, true, Some("z")).as_deref(), Some("a"));
    }

    #[test]
    fn a_scan_stopped_at_its_bound_moves_the_cursor_to_the_last_key_it_visited() {
        let taken = vec![row(1, Some("c"))];
        assert_eq!(cursor_after(Some("b".into()), &taken, false, Some("k")).as_deref(), Some("k"));
        assert_eq!(cursor_after(None, &[], false, Some("k")).as_deref(), Some("k"));
    }
}

#[cfg(test)]
mod key_rate_tests {
    use super::*;
    use crate::ids::{InstanceId, MachineRef, WorkerId};
    use crate::instance::NewInstance;

    fn row(id: i64, key: &str) -> Instance {
        let mut new = NewInstance::new(MachineRef::new("m", 1), "s");
        new.concurrency_key = Some(key.to_owned());
        Instance::from_new(InstanceId(id), &new, None, Timestamp(0))
    }

    fn params(now: i64, policy: ClaimPolicy) -> ClaimParams {
        ClaimParams {
            worker: WorkerId("w".into()),
            namespaces: vec![],
            queues: vec!["default".into()],
            machines: vec![],
            limit: 10,
            lease: Duration::from_secs(30),
            now: Timestamp(now),
            policy,
        }
    }

    #[test]
    fn a_key_takes_no_more_rows_than_its_bucket_and_other_keys_are_unaffected() {
        let rate = RateLimit { starts: 2, per: Duration::from_secs(1), burst: 2 };
        let policy = ClaimPolicy { key_rate: Some(rate), key_limit: 5, ..ClaimPolicy::default() };
        let p = params(1_000, policy);
        let mut planner = ClaimPlanner::new(&p);
        assert_eq!(planner.key_rate("a", None), Some(2), "a new bucket is full");
        let spent = Bucket { millitokens: 500, at: Timestamp(900), carry: 0, backlog: true };
        assert_eq!(planner.key_rate("b", Some(spent)), Some(0), "0.7 tokens");
        let mut taken = Vec::new();
        for (id, key) in [(1, "a"), (2, "b"), (3, "a"), (4, "a"), (5, "c")] {
            if let Some(next) = planner.offer(&row(id, key), CandidateRead::default()) {
                assert!(planner.take(&next, false));
                taken.push(id);
            }
        }
        assert_eq!(taken, vec![1, 3], "two tokens of a; none of b; c was never read");
        let written = planner.key_buckets_spent();
        assert_eq!(written.len(), 1, "only keys that took rows are written");
        assert_eq!((written[0].key.as_str(), written[0].bucket.millitokens), ("a", 0));
        // Tokens come back at 2 per second: one at 1.5 s, two at 2 s (capped there).
        assert_eq!(written[0].token_times, vec![Timestamp(1_500), Timestamp(2_000)]);
        assert_eq!(written[0].full_at, Timestamp(2_000));
        assert!(
            ClaimPolicy { key_rate: Some(rate), ..ClaimPolicy::default() }.validate(&[]).is_err()
        );
        let bad = RateLimit { starts: 0, ..rate };
        let e = ClaimPolicy { key_rate: Some(bad), ..ClaimPolicy::default() }
            .validate(&p.queues)
            .unwrap_err();
        assert!(e.message.contains("policy.key_rate"), "{}", e.message);
    }

    #[test]
    fn token_times_count_the_room_of_the_refilled_bucket() {
        for (starts, per_ms, burst) in [(20, 1_000, 1), (7, 3_000, 4), (100, 1_000, 10)] {
            let rate = RateLimit { starts, per: Duration::from_millis(per_ms), burst };
            for b in [
                Bucket { millitokens: 0, at: Timestamp(10_000), carry: 0, backlog: false },
                Bucket { millitokens: 300, at: Timestamp(10_000), carry: 5, backlog: true },
            ] {
                let times = rate.token_times(b, 50);
                for t in (10_000..10_000 + 2 * per_ms as i64 + 50).step_by(7) {
                    let counted = times.iter().filter(|x| x.0 <= t).count();
                    let room = RateLimit::room(&rate.refill(Some(b), Timestamp(t))).min(50);
                    assert_eq!(counted, room, "{starts}/{per_ms}ms burst {burst} at {t}");
                }
                let full = rate.full_at(b);
                assert!(rate.is_full(b, full) && !rate.is_full(b, Timestamp(full.0 - 1)));
            }
        }
    }
}
