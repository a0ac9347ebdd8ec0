//! Contracts for a claim's queue policy: `fifo` and `priority` order, the starvation
//! bound, and the global limit of a queue across all claimers.

use super::support::{at, claim, claim_params, expect_kind, ids, insert, new_in, next, step};
use keel_core::ErrorKind;
use keel_core::config::Strategy;
use keel_core::plan::claim::{ClaimPolicy, RateLimit};
use keel_core::ports::Store;
use keel_core::ports::store::ClaimParams;
use keel_core::{Priority, Timestamp};
use std::collections::BTreeSet;
use std::time::Duration;

fn with_policy(ns: &str, limit: usize, now: Timestamp, policy: ClaimPolicy) -> ClaimParams {
    ClaimParams { policy, ..claim_params(ns, limit, now) }
}

/// `fifo` claims in eligible order (then id) and ignores priorities, also when it picks
/// which row of a concurrency key goes first; `priority` claims the same rows by priority.
pub async fn claim_order_fifo_ignores_priority<S: Store>(s: &S) {
    for (ns, strategy) in [("claim_fifo", Strategy::Fifo), ("claim_prio", Strategy::Priority)] {
        let mk = |p: Priority, ms: i64| new_in(ns).priority(p).eligible_at(at(ms));
        let out = insert(
            s,
            vec![
                mk(Priority::Bulk, 1),
                mk(Priority::Critical, 4),
                mk(Priority::Normal, 2),
                mk(Priority::High, 3),
                mk(Priority::Low, 2),
                // One key: the older, less urgent row is the key's first under fifo.
                mk(Priority::Low, 0).concurrency_key(format!("{ns}-k")),
                mk(Priority::Critical, 5).concurrency_key(format!("{ns}-k")),
            ],
            at(0),
        )
        .await;
        let id = |i: usize| out[i].id();
        let policy = ClaimPolicy::new(strategy);
        let got = ids(&claim(s, with_policy(ns, 3, at(10), policy)).await);
        let rest = ids(&claim(s, with_policy(ns, 10, at(10), policy)).await);
        match strategy {
            Strategy::Fifo => {
                assert_eq!(got, vec![id(5), id(0), id(2)], "fifo: eligible order, then id");
                assert_eq!(rest, vec![id(4), id(3), id(1)], "fifo: the key's second row waits");
            }
            Strategy::Priority => {
                assert_eq!(got, vec![id(1), id(6), id(3)], "priority: priority first");
                assert_eq!(rest, vec![id(2), id(4), id(0)], "priority: the key's second row waits");
            }
        }
    }
}

/// Under `priority` with a starvation bound, a row ready for at least the bound is
/// claimed ahead of every priority, oldest first; younger rows keep priority order.
pub async fn claim_order_starvation_bound_overtakes_priority<S: Store>(s: &S) {
    let ns = "claim_starve";
    let mk = |p: Priority, ms: i64| new_in(ns).priority(p).eligible_at(at(ms));
    let out = insert(
        s,
        vec![
            mk(Priority::Critical, 9_000),
            mk(Priority::Bulk, 1_000),
            mk(Priority::High, 8_000),
            mk(Priority::Low, 500),
            mk(Priority::Normal, 5_500),
        ],
        at(0),
    )
    .await;
    let id = |i: usize| out[i].id();
    let policy = ClaimPolicy {
        starvation_after: Some(Duration::from_secs(5)),
        ..ClaimPolicy::new(Strategy::Priority)
    };
    // At 10 s, rows eligible at or before 5 s are starving: 500 ms, then 1 s.
    let got = ids(&claim(s, with_policy(ns, 10, at(10_000), policy)).await);
    assert_eq!(got, vec![id(3), id(1), id(0), id(2), id(4)]);
}

/// A queue's global limit bounds its executing rows across every claimer: a claim takes
/// at most the limit minus what is executing, concurrent claims never exceed it together,
/// finishing a step frees room, and a limit without exactly one queue is refused.
pub async fn global_limit_bounds_a_queues_executing_rows<S: Store>(s: &S) {
    let ns = "claim_global";
    let out =
        insert(s, (0..12).map(|i| new_in(ns).queue("capped").eligible_at(at(i))).collect(), at(0))
            .await;
    let policy = ClaimPolicy { global_limit: Some(5), ..ClaimPolicy::new(Strategy::Fifo) };
    let params = |worker: &str, limit: usize, now: i64| {
        let mut p = with_policy(ns, limit, at(now), policy);
        p.queues = vec!["capped".into()];
        p.worker = super::support::worker(worker);
        p
    };
    let first = claim(s, params("w1", 3, 20)).await;
    assert_eq!(ids(&first), vec![out[0].id(), out[1].id(), out[2].id()]);
    let (a, b) = tokio::join!(claim(s, params("w2", 10, 20)), claim(s, params("w3", 10, 20)));
    assert_eq!(a.len() + b.len(), 2, "concurrent claims exceeded the global limit");
    let held: BTreeSet<_> = first.iter().chain(&a).chain(&b).map(|c| c.instance.id).collect();
    assert_eq!(held.len(), 5);
    assert!(claim(s, params("w1", 10, 21)).await.is_empty(), "claimed over the global limit");
    let by_id =
        s.instance_claim_ids(vec![out[11].id()], params("w1", 10, 21)).await.expect("claim by id");
    assert!(by_id.is_empty(), "a claim by id went over the global limit");
    // Another queue is not limited by this one.
    let other = insert(s, vec![new_in(ns).queue("free")], at(0)).await;
    let mut p = with_policy(ns, 10, at(22), ClaimPolicy::new(Strategy::Fifo));
    p.queues = vec!["free".into()];
    assert_eq!(ids(&claim(s, p).await), vec![other[0].id()]);
    // A finished step frees its room.
    step(s, &first[0], next("done", 1), at(30)).await;
    step(s, &first[1], next("done", 1), at(30)).await;
    let more = claim(s, params("w1", 10, 31)).await;
    assert_eq!(ids(&more), vec![out[5].id(), out[6].id()], "room freed by two finished steps");
    // The limit is counted per queue: it needs exactly one queue.
    let mut p = with_policy(ns, 10, at(40), policy);
    p.queues = Vec::new();
    expect_kind(s.instance_claim(p).await, ErrorKind::Invalid, "global limit without a queue");
}

/// A key limit of K runs up to K rows of one concurrency key at once, across claims and
/// claimers, in claim order; other keys are not held back, and a finished row frees one.
pub async fn key_limit_runs_k_rows_of_a_key_at_once<S: Store>(s: &S) {
    let ns = "claim_key_k";
    let (busy, other) = (format!("{ns}-k"), format!("{ns}-j"));
    let mut news: Vec<_> =
        (0..7).map(|i| new_in(ns).concurrency_key(busy.clone()).eligible_at(at(i))).collect();
    news.push(new_in(ns).concurrency_key(other).eligible_at(at(50)));
    let out = insert(s, news, at(0)).await;
    let id = |i: usize| out[i].id();
    let policy = ClaimPolicy { key_limit: 3, ..ClaimPolicy::new(Strategy::Fifo) };
    let first = claim(s, with_policy(ns, 2, at(100), policy)).await;
    assert_eq!(ids(&first), vec![id(0), id(1)]);
    let second = claim(s, with_policy(ns, 10, at(100), policy)).await;
    assert_eq!(ids(&second), vec![id(2), id(7)], "the key's third row, and the other key");
    assert!(claim(s, with_policy(ns, 10, at(100), policy)).await.is_empty(), "over K = 3");
    step(s, &first[0], next("done", 1), at(110)).await;
    step(s, &first[1], next("done", 1), at(110)).await;
    // Two claimers race for the two free places of the key.
    let mut p2 = with_policy(ns, 10, at(120), policy);
    p2.worker = super::support::worker("w2");
    let (one, two) = tokio::join!(claim(s, with_policy(ns, 10, at(120), policy)), claim(s, p2));
    let mut got: Vec<_> = ids(&one).into_iter().chain(ids(&two)).collect();
    got.sort();
    assert_eq!(got, vec![id(3), id(4)], "two places freed, the next two rows in order");
    let with_default = claim(s, claim_params(ns, 10, at(130))).await;
    assert!(with_default.is_empty(), "K = 1 sees the key busy");
}

/// A rate limit (token bucket) bounds a queue's starts across claims and claimers: a new
/// bucket holds `burst` tokens, refills at `starts` per `per` (fractions carry over) and
/// never above `burst`; rows over the limit stay ready and are claimed when tokens return.
pub async fn rate_limit_bounds_a_queues_starts<S: Store>(s: &S) {
    let ns = "claim_rate";
    let out =
        insert(s, (0..30).map(|i| new_in(ns).queue("metered").eligible_at(at(i))).collect(), at(0))
            .await;
    let rate = RateLimit { starts: 10, per: Duration::from_secs(1), burst: 4 };
    let policy = ClaimPolicy { rate: Some(rate), ..ClaimPolicy::new(Strategy::Fifo) };
    let params = |limit: usize, now: i64| {
        let mut p = with_policy(ns, limit, at(now), policy);
        p.queues = vec!["metered".into()];
        p
    };
    let first = claim(s, params(10, 1_000)).await;
    assert_eq!(
        ids(&first),
        (0..4).map(|i| out[i].id()).collect::<Vec<_>>(),
        "a full bucket: burst"
    );
    assert!(claim(s, params(10, 1_000)).await.is_empty(), "no token left");
    assert!(claim(s, params(10, 1_050)).await.is_empty(), "half a token is not a start");
    assert_eq!(claim(s, params(10, 1_100)).await.len(), 1, "0.5 + 0.5 tokens carried over");
    assert_eq!(claim(s, params(10, 1_300)).await.len(), 2);
    assert_eq!(claim(s, params(1, 1_500)).await.len(), 1, "the claim's own limit still holds");
    assert_eq!(claim(s, params(10, 1_500)).await.len(), 1, "the token left by the last claim");
    assert_eq!(claim(s, params(10, 60_000)).await.len(), 4, "an idle spell refills to burst only");
    let left = claim(s, with_policy(ns, 30, at(60_000), ClaimPolicy::new(Strategy::Fifo))).await;
    assert_eq!(left.len(), 30 - 4 - 1 - 2 - 1 - 1 - 4, "rows over the limit stayed ready");
    let mut p = with_policy(ns, 10, at(70_000), policy);
    p.queues = Vec::new();
    expect_kind(s.instance_claim(p).await, ErrorKind::Invalid, "rate limit without a queue");
}
