//! The queue conformance suite: one generic async function per contract, run by every
//! `Queue` backend — `MemoryQueue` included — under the same test names.
//!
//! Queues keep real time (a Redis server, an SQS endpoint), so these contracts sleep. The
//! time unit of a contract is the backend's `resolution`, at least 100 ms, so the same
//! contract takes a few hundred milliseconds on Redis and a few seconds on SQS. Each
//! contract expects a fresh, empty queue: the constructor expression runs once per test.
//! Contracts whose behaviour a backend does not promise (ordered groups, priorities)
//! still run and check what every backend promises: each hint is delivered. A contract
//! that a backend cannot hold at all is named in the suite's `except` list with the
//! reason, and its test prints that reason instead of running.
//!
//! ```text
//! // queue-redis/tests/conformance.rs
//! keel_testkit::queue_conformance_tests!(
//!     keel_queue_redis::testing::fresh_queue(),   // async, returns Option<RedisQueue>
//!     "KEEL_TEST_REDIS_URL"
//! );
//! ```

use crate::conformance::support::expect_invalid;
use crate::conformance::{REQUIRE_BACKENDS_VAR, skip_notice};
use keel_core::limits::{HINT_BATCH_MAX, HINT_RECEIVE_MAX, HINT_WAIT_MAX, NAME_BYTES_MAX};
use keel_core::ports::Queue;
use keel_core::ports::queue::{Delivery, Hint};
use keel_core::{InstanceId, Priority};
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::time::{Instant, sleep};

/// The one list of queue contracts, feeding [`QUEUE_CONTRACTS`] and
/// [`queue_conformance_tests!`](crate::queue_conformance_tests).
#[doc(hidden)]
#[macro_export]
macro_rules! __queue_contract_list {
    ($callback:ident ; $($args:tt)*) => {
        $crate::$callback! { [$($args)*]
            queue_capabilities_are_kept,
            queue_round_trip_keeps_every_field,
            queue_lease_hides_then_redelivers,
            queue_extend_prolongs_the_lease,
            queue_nack_returns_after_its_delay,
            queue_delayed_hint_waits,
            queue_receive_waits_for_a_later_publish,
            queue_batches_beyond_native_size,
            queue_group_order_where_promised,
            queue_priority_where_promised,
            queue_bounds_refused_naming_the_field,
            queue_ack_twice_is_harmless,
            queue_republish_while_leased_is_delivered_again,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __queue_contract_names {
    ([] $($name:ident),* $(,)?) => {
        /// The names of every queue contract, in suite order.
        pub const QUEUE_CONTRACTS: &[&str] = &[$(stringify!($name)),*];
    };
}

__queue_contract_list!(__queue_contract_names;);

#[doc(hidden)]
#[macro_export]
macro_rules! __queue_conformance_expand {
    ([$ctor:expr, $var:expr, $except:expr] $($name:ident),* $(,)?) => {
        $(
            #[::tokio::test]
            async fn $name() {
                let except: &[(&str, &str)] = $except;
                if let Some((_, why)) = except.iter().find(|(n, _)| *n == stringify!($name)) {
                    $crate::conformance::skip_notice(&format!(
                        "SKIPPED: queue contract {}: this backend does not promise it: {why}",
                        stringify!($name)
                    ));
                    return;
                }
                if let Some(queue) = $crate::conformance::queue::queue_or_skip(stringify!($name), $var, $ctor.await) {
                    $crate::conformance::queue::$name(&queue).await;
                }
            }
        )*
    };
}

/// Expands the queue conformance suite into one named `#[tokio::test]` per contract.
///
/// `queue_conformance_tests!(ctor, "ENV_VAR")`: `ctor` evaluates to a future of
/// `Option<Q>` with `Q: Queue` (`None` = backend not configured), `ENV_VAR` names what to
/// set to configure it.
///
/// `queue_conformance_tests!(ctor, "ENV_VAR", except = [contract => "reason", …])`: the
/// named contracts, which this backend cannot hold, print the reason instead of running
/// (a name that is no contract does not compile). Each contract's doc says which backends
/// may leave it out.
///
/// ```text
/// keel_testkit::queue_conformance_tests!(async { Some(keel_testkit::MemoryQueue::new()) }, "-");
/// ```
#[macro_export]
macro_rules! queue_conformance_tests {
    ($ctor:expr, $var:expr $(,)?) => {
        $crate::queue_conformance_tests!($ctor, $var, except = []);
    };
    ($ctor:expr, $var:expr, except = [$($skip:ident => $why:expr),* $(,)?] $(,)?) => {
        const _: () = { $(let _ = $crate::conformance::queue::$skip::<$crate::MemoryQueue>;)* };
        $crate::__queue_contract_list!(
            __queue_conformance_expand; $ctor, $var, &[$((stringify!($skip), $why)),*]
        );
    };
}

/// The queue, or `None` after a loud skip line — or a panic naming `var` when
/// `KEEL_REQUIRE_BACKENDS=1`.
pub fn queue_or_skip<Q>(contract: &str, var: &str, queue: Option<Q>) -> Option<Q> {
    if queue.is_some() {
        return queue;
    }
    let required = std::env::var(REQUIRE_BACKENDS_VAR).is_ok_and(|v| v == "1");
    assert!(
        !required,
        "{contract}: queue backend not configured but {REQUIRE_BACKENDS_VAR}=1; set {var} to run it"
    );
    skip_notice(&format!(
        "SKIPPED: queue contract {contract}: backend not configured (set {var} to run it)"
    ));
    None
}

/// The contract time unit of `q`: its resolution, at least 100 ms.
fn unit<Q: Queue>(q: &Q) -> Duration {
    q.capabilities().resolution.max(Duration::from_millis(100))
}

fn hint(n: i64) -> Hint {
    Hint::new(InstanceId(n), 7)
}

async fn recv<Q: Queue>(q: &Q, max: usize, visibility: Duration, wait: Duration) -> Vec<Delivery> {
    q.receive(max, visibility, wait).await.expect("receive")
}

fn instances(deliveries: &[Delivery]) -> Vec<i64> {
    deliveries.iter().map(|d| d.hint.instance.0).collect()
}

fn receipts(deliveries: &[Delivery]) -> Vec<String> {
    deliveries.iter().map(|d| d.receipt.clone()).collect()
}

/// Receives until `want` distinct instances arrived (bounded rounds), acking each.
async fn drain<Q: Queue>(q: &Q, want: usize) -> BTreeSet<i64> {
    let u = unit(q);
    let mut seen = BTreeSet::new();
    for _ in 0..(want + 20) {
        if seen.len() >= want {
            break;
        }
        let got = recv(q, HINT_RECEIVE_MAX, 10 * u, 2 * u).await;
        seen.extend(instances(&got));
        if !got.is_empty() {
            q.ack(receipts(&got)).await.expect("ack");
        }
    }
    seen
}

/// Reported bounds are enforced at the bound, not beyond or before.
pub async fn queue_capabilities_are_kept<Q: Queue>(q: &Q) {
    let caps = q.capabilities();
    assert!(caps.resolution > Duration::ZERO, "resolution must be positive");
    match caps.delay_max {
        Some(most) => {
            q.enqueue(vec![hint(1).delay(most)]).await.expect("a delay of exactly delay_max");
            expect_invalid(q.enqueue(vec![hint(2).delay(most + caps.resolution)]).await, "delay");
        }
        None => q.enqueue(vec![hint(1).delay(Duration::from_secs(86_400))]).await.expect("1 day"),
    }
    if let Some(most) = caps.visibility_max {
        expect_invalid(q.receive(1, most + caps.resolution, Duration::ZERO).await, "visibility");
        q.receive(1, most, Duration::ZERO).await.expect("a lease of exactly visibility_max");
    }
    assert!(
        recv(q, 1, unit(q), Duration::ZERO).await.is_empty(),
        "a delayed hint was delivered at once"
    );
}

/// A hint comes back as published, counted once, and is gone after its ack.
pub async fn queue_round_trip_keeps_every_field<Q: Queue>(q: &Q) {
    let u = unit(q);
    let published = Hint::new(InstanceId(42), 9).priority(Priority::High).group("key-a");
    q.enqueue(vec![published.clone()]).await.expect("enqueue");
    let got = recv(q, 10, 10 * u, 5 * u).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].hint, published);
    assert_eq!(got[0].receive_count, 1);
    q.ack(receipts(&got)).await.expect("ack");
    sleep(u).await;
    assert!(recv(q, 10, u, u).await.is_empty(), "an acked hint came back");
}

/// A leased hint is hidden from other receivers until its lease runs out, then comes back
/// counted twice: a receiver that crashed loses nothing.
pub async fn queue_lease_hides_then_redelivers<Q: Queue>(q: &Q) {
    let u = unit(q);
    q.enqueue(vec![hint(1)]).await.expect("enqueue");
    let first = recv(q, 1, 2 * u, 5 * u).await;
    assert_eq!(instances(&first), vec![1]);
    assert!(recv(q, 1, 2 * u, Duration::ZERO).await.is_empty(), "a leased hint was handed out");
    let again = recv(q, 1, 10 * u, 6 * u).await;
    assert_eq!(instances(&again), vec![1], "the hint did not come back after its lease");
    assert_eq!(again[0].receive_count, 2);
    q.ack(receipts(&again)).await.expect("ack");
}

/// Extending a lease keeps the hint hidden past the first lease's end.
pub async fn queue_extend_prolongs_the_lease<Q: Queue>(q: &Q) {
    let u = unit(q);
    q.enqueue(vec![hint(1)]).await.expect("enqueue");
    let got = recv(q, 1, 2 * u, 5 * u).await;
    assert_eq!(instances(&got), vec![1]);
    q.extend(got[0].receipt.clone(), 8 * u).await.expect("extend");
    sleep(4 * u).await;
    assert!(recv(q, 1, u, Duration::ZERO).await.is_empty(), "the extended lease did not hold");
    q.ack(receipts(&got)).await.expect("ack");
}

/// A nack with no delay hands the hint out again at once; with a delay, after it.
pub async fn queue_nack_returns_after_its_delay<Q: Queue>(q: &Q) {
    let u = unit(q);
    q.enqueue(vec![hint(1)]).await.expect("enqueue");
    let got = recv(q, 1, 20 * u, 5 * u).await;
    q.nack(got[0].receipt.clone(), Duration::ZERO).await.expect("nack");
    let again = recv(q, 1, 20 * u, 5 * u).await;
    assert_eq!(instances(&again), vec![1], "a nacked hint did not come back at once");
    assert_eq!(again[0].receive_count, 2);
    let nacked = Instant::now();
    q.nack(again[0].receipt.clone(), 3 * u).await.expect("nack with delay");
    assert!(recv(q, 1, 20 * u, Duration::ZERO).await.is_empty(), "the nack delay was ignored");
    let third = recv(q, 1, 20 * u, 8 * u).await;
    assert_eq!(instances(&third), vec![1], "the hint did not come back after its nack delay");
    assert!(nacked.elapsed() + u >= 3 * u, "back after {:?}", nacked.elapsed());
    q.ack(receipts(&third)).await.expect("ack");
}

/// A delayed hint is not delivered before its delay; the undelayed one is.
pub async fn queue_delayed_hint_waits<Q: Queue>(q: &Q) {
    let u = unit(q);
    let delay = 3 * u;
    if q.capabilities().delay_max.is_some_and(|most| most < delay) {
        // Such a backend refuses the delay (checked by `queue_capabilities_are_kept`); the
        // caller keeps delayed work in the store.
        expect_invalid(q.enqueue(vec![hint(1).delay(delay)]).await, "delay");
        return;
    }
    let published = Instant::now();
    q.enqueue(vec![hint(1).delay(delay), hint(2)]).await.expect("enqueue");
    let now = recv(q, 10, 20 * u, 2 * u).await;
    assert_eq!(instances(&now), vec![2], "only the undelayed hint is due");
    q.ack(receipts(&now)).await.expect("ack");
    let later = recv(q, 10, 20 * u, 8 * u).await;
    assert_eq!(instances(&later), vec![1]);
    assert!(published.elapsed() + u >= delay, "delivered after {:?}", published.elapsed());
    assert_eq!(later[0].hint.delay, Duration::ZERO, "a delivered hint is due");
    q.ack(receipts(&later)).await.expect("ack");
}

/// A receive that is waiting returns as soon as a hint is published, not at its deadline.
pub async fn queue_receive_waits_for_a_later_publish<Q: Queue>(q: &Q) {
    let u = unit(q);
    let wait = (8 * u).min(HINT_WAIT_MAX);
    let started = Instant::now();
    let (got, ()) = tokio::join!(recv(q, 10, 10 * u, wait), async {
        sleep(u).await;
        q.enqueue(vec![hint(5)]).await.expect("enqueue");
    });
    assert_eq!(instances(&got), vec![5]);
    assert!(started.elapsed() < wait, "the receive waited out its deadline ({wait:?})");
    q.ack(receipts(&got)).await.expect("ack");
}

/// Batches larger than any backend's native batch (SQS: 10) go through whole, and a
/// receive never returns more than asked.
pub async fn queue_batches_beyond_native_size<Q: Queue>(q: &Q) {
    let u = unit(q);
    q.enqueue((1..=25).map(hint).collect()).await.expect("enqueue 25");
    let first = recv(q, 3, 20 * u, 5 * u).await;
    assert!(!first.is_empty() && first.len() <= 3, "asked for 3, got {}", first.len());
    q.ack(receipts(&first)).await.expect("ack");
    let mut seen: BTreeSet<i64> = instances(&first).into_iter().collect();
    seen.extend(drain(q, 25 - seen.len()).await);
    assert_eq!(seen, (1..=25).collect(), "every hint of the batch arrives");
}

/// With `ordered_groups`, a group's hints come in publish order, and none is handed out
/// while an earlier one of its group is leased (one receive may carry several of a group,
/// in order); without, every hint still arrives.
pub async fn queue_group_order_where_promised<Q: Queue>(q: &Q) {
    let u = unit(q);
    let g = |n| hint(n).group("g");
    q.enqueue(vec![g(1), g(2), g(3), hint(9).group("h")]).await.expect("enqueue");
    if !q.capabilities().ordered_groups {
        assert_eq!(drain(q, 4).await, BTreeSet::from([1, 2, 3, 9]));
        return;
    }
    let in_group = |got: &[Delivery], group: &str| -> Vec<i64> {
        got.iter()
            .filter(|d| d.hint.group.as_deref() == Some(group))
            .map(|d| d.hint.instance.0)
            .collect()
    };
    let mut order = Vec::new();
    let mut others = Vec::new();
    for _ in 0..10 {
        if order.len() == 3 {
            break;
        }
        let got = recv(q, 10, 20 * u, 3 * u).await;
        let more = recv(q, 10, 20 * u, Duration::ZERO).await;
        assert!(
            in_group(&more, "g").is_empty(),
            "a hint of a group was handed out while an earlier one was leased: {more:?}"
        );
        order.extend(in_group(&got, "g"));
        others.extend(in_group(&got, "h"));
        others.extend(in_group(&more, "h"));
        q.ack(receipts(&got)).await.expect("ack");
        q.ack(receipts(&more)).await.expect("ack");
    }
    assert_eq!(order, vec![1, 2, 3], "group order");
    assert_eq!(others, vec![9], "the other group is not held back");
}

/// With `priorities`, more urgent hints visible at once come first; without, every hint
/// still arrives.
pub async fn queue_priority_where_promised<Q: Queue>(q: &Q) {
    let u = unit(q);
    q.enqueue(vec![
        hint(1).priority(Priority::Bulk),
        hint(2).priority(Priority::Normal),
        hint(3).priority(Priority::Critical),
    ])
    .await
    .expect("enqueue");
    if !q.capabilities().priorities {
        assert_eq!(drain(q, 3).await, BTreeSet::from([1, 2, 3]));
        return;
    }
    let mut order = Vec::new();
    for _ in 0..3 {
        let got = recv(q, 1, 20 * u, 3 * u).await;
        order.extend(instances(&got));
        q.ack(receipts(&got)).await.expect("ack");
    }
    assert_eq!(order, vec![3, 2, 1], "most urgent first");
}

/// Every bound is refused as `Invalid`, naming the field, before anything is published.
pub async fn queue_bounds_refused_naming_the_field<Q: Queue>(q: &Q) {
    let u = unit(q);
    expect_invalid(q.enqueue(vec![hint(1); HINT_BATCH_MAX + 1]).await, "hints");
    expect_invalid(q.enqueue(vec![hint(1).group("k".repeat(NAME_BYTES_MAX + 1))]).await, "group");
    expect_invalid(q.receive(0, u, Duration::ZERO).await, "max");
    expect_invalid(q.receive(HINT_RECEIVE_MAX + 1, u, Duration::ZERO).await, "max");
    expect_invalid(q.receive(1, Duration::ZERO, Duration::ZERO).await, "visibility");
    expect_invalid(q.receive(1, u, HINT_WAIT_MAX + u).await, "wait");
    expect_invalid(q.ack(vec![String::new()]).await, "receipt");
    expect_invalid(q.ack(vec!["r".to_owned(); HINT_BATCH_MAX + 1]).await, "receipts");
    assert!(recv(q, 10, u, u).await.is_empty(), "a refused batch published something");
}

/// Acking a hint twice is not an error and does not bring it back.
pub async fn queue_ack_twice_is_harmless<Q: Queue>(q: &Q) {
    let u = unit(q);
    q.enqueue(vec![hint(1)]).await.expect("enqueue");
    let got = recv(q, 1, 10 * u, 5 * u).await;
    q.ack(receipts(&got)).await.expect("ack");
    q.ack(receipts(&got)).await.expect("a second ack");
    assert!(recv(q, 1, u, 2 * u).await.is_empty(), "an acked hint came back");
}

/// A hint published again while the same instance and revision is leased is not lost:
/// acking the earlier delivery leaves the new publish, which is handed out again soon,
/// not only after the earlier lease. A publisher that knows no newer revision (a parent
/// woken by a child, the target of an event) publishes the same pair again for news that
/// came after the first publish, so dropping it delays that work until the repair pass.
///
/// A backend that deduplicates publishes must do so within one publish only: a publish
/// whose (instance, revision) it saw before, even once acked, is news and must be
/// delivered (SQS FIFO's deduplication id therefore carries a per-publish nonce).
pub async fn queue_republish_while_leased_is_delivered_again<Q: Queue>(q: &Q) {
    let u = unit(q);
    let republished = Hint::new(InstanceId(7), 0);
    q.enqueue(vec![republished.clone()]).await.expect("enqueue");
    let first = recv(q, 1, 20 * u, 5 * u).await;
    assert_eq!(instances(&first), vec![7]);
    q.enqueue(vec![republished]).await.expect("enqueue again while leased");
    q.ack(receipts(&first)).await.expect("ack the first delivery");
    let again = recv(q, 1, 20 * u, 5 * u).await;
    assert_eq!(
        instances(&again),
        vec![7],
        "the hint published while the first delivery was leased was lost with its ack"
    );
    q.ack(receipts(&again)).await.expect("ack");
}
