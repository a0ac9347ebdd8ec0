//! Contracts for a claim's queue policy: `fifo` and `priority` order, the starvation
//! bound, and the global limit of a queue across all claimers.

use super::support::{at, claim, claim_params, done, expect_kind, ids, insert, new_in, next, step};
use keel_core::ErrorKind;
use keel_core::config::Strategy;
use keel_core::limits;
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
/// claimers, in claim order within the key; other keys are not held back (one row of each
/// key per round), and a finished row frees one.
pub async fn key_limit_runs_k_rows_of_a_key_at_once<S: Store>(s: &S) {
    let ns = "claim_key_k";
    let (busy, other) = (format!("{ns}-k"), format!("{ns}-j"));
    let mut news: Vec<_> =
        (0..7).map(|i| new_in(ns).concurrency_key(busy.clone()).eligible_at(at(i))).collect();
    news.push(new_in(ns).concurrency_key(other).eligible_at(at(50)));
    let out = insert(s, news, at(0)).await;
    let id = |i: usize| out[i].id();
    let policy = ClaimPolicy { key_limit: 3, ..ClaimPolicy::new(Strategy::Fifo) };
    // One row of each key per round: the other key's row comes before the key's second.
    let first = claim(s, with_policy(ns, 2, at(100), policy)).await;
    assert_eq!(ids(&first), vec![id(0), id(7)]);
    let second = claim(s, with_policy(ns, 10, at(100), policy)).await;
    assert_eq!(ids(&second), vec![id(1), id(2)], "the key's second and third rows");
    assert!(claim(s, with_policy(ns, 10, at(100), policy)).await.is_empty(), "over K = 3");
    step(s, &first[0], next("done", 1), at(110)).await;
    step(s, &first[1], next("done", 1), at(110)).await;
    // Two claimers race for the two free places of the key.
    let mut p2 = with_policy(ns, 10, at(120), policy);
    p2.worker = super::support::worker("w2");
    let (one, two) = tokio::join!(claim(s, with_policy(ns, 10, at(120), policy)), claim(s, p2));
    let mut got: Vec<_> = ids(&one).into_iter().chain(ids(&two)).collect();
    got.sort();
    assert_eq!(got, vec![id(3), id(7)], "the key's one freed place, and the other key again");
    let with_default = claim(s, claim_params(ns, 10, at(130))).await;
    assert!(with_default.is_empty(), "K = 1 sees the key busy");
}

/// A rate limit (token bucket) bounds a queue's starts across claims and claimers: a new
/// bucket holds `burst` tokens, refills at `starts` per `per` (fractions carry over) and
/// above `burst` only with what accrued since a claim the tokens cut short (at most one
/// period's worth); rows over the limit stay ready and are claimed when tokens return.
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
    // The last claim was cut short by the tokens, so rows were waiting: a long spell
    // without claims gives one period's worth (10), not more, and not just the burst.
    assert_eq!(claim(s, params(10, 60_000)).await.len(), 10, "one period's worth");
    let left = claim(s, with_policy(ns, 30, at(60_000), ClaimPolicy::new(Strategy::Fifo))).await;
    assert_eq!(left.len(), 30 - 4 - 1 - 2 - 1 - 1 - 10, "rows over the limit stayed ready");
    let mut p = with_policy(ns, 10, at(70_000), policy);
    p.queues = Vec::new();
    expect_kind(s.instance_claim(p).await, ErrorKind::Invalid, "rate limit without a queue");
}

/// With a burst of 1, a claimer that comes less often than tokens arrive still starts the
/// configured rate: each claim takes every token that accrued since the last one
/// (fractions carried exactly), as long as rows were left waiting; once the queue has run
/// dry, an idle spell saves up the burst only.
pub async fn rate_limit_burst_of_one_keeps_its_rate<S: Store>(s: &S) {
    let ns = "claim_rate_one";
    let queue = "metered_one";
    insert(s, (0..150).map(|i| new_in(ns).queue(queue).eligible_at(at(i))).collect(), at(0)).await;
    let rate = RateLimit { starts: 100, per: Duration::from_secs(1), burst: 1 };
    let policy = ClaimPolicy { rate: Some(rate), ..ClaimPolicy::new(Strategy::Fifo) };
    let params = |limit: usize, now: i64| {
        let mut p = with_policy(ns, limit, at(now), policy);
        p.queues = vec![queue.into()];
        p
    };
    // Claims every 25 ms for one second: 2.5 tokens accrue between two claims.
    let mut started = Vec::new();
    for t in (1_000..=2_000).step_by(25) {
        started.push(claim(s, params(50, t)).await.len());
    }
    assert_eq!(&started[..5], &[1, 2, 3, 2, 3], "the full bucket, then 2.5 tokens per claim");
    assert_eq!(started.iter().sum::<usize>(), 1 + 100, "one token, then 100 per second");
    // The rest (150 - 101 = 49) are claimed; the queue runs dry with tokens left.
    assert_eq!(claim(s, params(200, 2_500)).await.len(), 49, "50 tokens, 49 rows");
    insert(s, (0..5).map(|_| new_in(ns).queue(queue)).collect(), at(2_500)).await;
    assert_eq!(claim(s, params(50, 60_000)).await.len(), 1, "after running dry: the burst");
}

/// A claim takes its rows in rounds across concurrency keys — each round the next row of
/// every key (up to the key's limit) and the next row without a key, in claim order —
/// over the keys a rotation picks: with more keys than the claim can take, the keys after
/// the one a full claim of the queue served last come first. So a key with many ready
/// rows, even one already at its limit, cannot hold back another key's row.
pub async fn claim_fair_across_concurrency_keys<S: Store>(s: &S) {
    let ns = "claim_fair";
    let queue = "fair_q";
    let (key_a, key_b, key_c) = ("fair-a".to_owned(), "fair-b".to_owned(), "fair-c".to_owned());
    let mk = |q: &str, key: Option<&String>, ms: i64| {
        let row = new_in(ns).queue(q).eligible_at(at(ms));
        match key {
            Some(k) => row.concurrency_key(k.clone()),
            None => row,
        }
    };
    let out = insert(
        s,
        vec![
            mk(queue, Some(&key_a), 0),
            mk(queue, Some(&key_a), 1),
            mk(queue, Some(&key_a), 2),
            mk(queue, Some(&key_a), 3),
            mk(queue, None, 4),
            mk(queue, Some(&key_c), 5),
            mk(queue, Some(&key_c), 6),
            mk(queue, None, 7),
            mk(queue, Some(&key_b), 8),
        ],
        at(0),
    )
    .await;
    let id = |i: usize| out[i].id();
    let policy = ClaimPolicy { key_limit: 2, ..ClaimPolicy::new(Strategy::Fifo) };
    let params = |q: &str, limit: usize, now: i64| {
        let mut params = with_policy(ns, limit, at(now), policy);
        params.queues = vec![q.into()];
        params
    };
    // Round one in claim order: a's first, the first row without a key, c's first (b's
    // row is the youngest of round one and does not fit).
    let first = claim(s, params(queue, 3, 100)).await;
    assert_eq!(ids(&first), vec![id(0), id(4), id(5)], "one row of a key per round");
    let second = claim(s, params(queue, 3, 100)).await;
    assert_eq!(ids(&second), vec![id(1), id(6), id(7)], "round one again: a, c, unkeyed");
    // a and c are at their limit of 2: b's row is what is left.
    let third = claim(s, params(queue, 10, 100)).await;
    assert_eq!(ids(&third), vec![id(8)]);
    // With room for two rows of a key, a claim takes one of each key before a second.
    step(s, &first[0], done(), at(110)).await;
    step(s, &second[0], done(), at(110)).await;
    step(s, &first[2], done(), at(110)).await;
    let more =
        insert(s, vec![mk(queue, Some(&key_c), 9), mk(queue, Some(&key_c), 10)], at(110)).await;
    let fourth = claim(s, params(queue, 10, 120)).await;
    assert_eq!(
        ids(&fourth),
        vec![id(2), more[0].id(), id(3)],
        "round one: a's next and c's next (c has one place); round two: a's second"
    );

    // Rotation: four keys with one row each, the last key's row the oldest; a claim of two
    // takes the first two keys after the cursor, not the two oldest rows.
    let q3 = "fair_q3";
    let keys = ["fair-r1", "fair-r2", "fair-r3", "fair-r4"].map(String::from);
    let rot = insert(
        s,
        keys.iter().enumerate().map(|(i, k)| mk(q3, Some(k), 40 - i as i64)).collect(),
        at(0),
    )
    .await;
    let one = claim(s, params(q3, 2, 100)).await;
    assert_eq!(ids(&one), vec![rot[1].id(), rot[0].id()], "keys r1 and r2, in claim order");
    let two = claim(s, params(q3, 2, 100)).await;
    assert_eq!(ids(&two), vec![rot[3].id(), rot[2].id()], "then r3 and r4");

    // One key with many ready rows, one of them executing: another key's single row is
    // in the very next claim.
    let (busy, lone) = ("fair-busy".to_owned(), "fair-lone".to_owned());
    let many = insert(s, (0..200).map(|i| mk("fair_q2", Some(&busy), i)).collect(), at(0)).await;
    let mut plain = with_policy(ns, 1, at(300), ClaimPolicy::default());
    plain.queues = vec!["fair_q2".into()];
    assert_eq!(ids(&claim(s, plain.clone()).await), vec![many[0].id()], "the busy key's first row");
    let single = insert(s, vec![mk("fair_q2", Some(&lone), 299)], at(299)).await;
    assert_eq!(ids(&claim(s, ClaimParams { limit: 10, ..plain }).await), vec![single[0].id()]);
}

/// A fair claim reads a bounded number of keys, yet a key with room is not starved by more
/// keys at their limit than one claim visits: the scan carries on where the last stopped,
/// so the key's row is claimed within two claims, and no key over its limit gets a row.
pub async fn claim_fair_reaches_a_key_behind_more_full_keys_than_one_scan_visits<S: Store>(s: &S) {
    let ns = "claim_far";
    let full = limits::CLAIM_KEYS_SCAN_MAX + 5;
    let key = |i: usize| format!("far-{i:05}");
    let mk = |q: &str, k: String| new_in(ns).queue(q).eligible_at(at(0)).concurrency_key(k);
    let policy = ClaimPolicy { key_limit: 1, ..ClaimPolicy::new(Strategy::Fifo) };
    let params = |q: &str, limit: usize| {
        let mut params = with_policy(ns, limit, at(100), policy);
        params.queues = vec![q.into()];
        params
    };
    // Every key but the last runs a row (from another queue: a key's limit counts its
    // executing rows wherever they are) and has one more ready in the claimed queue.
    insert(s, (0..full).map(|i| mk("far_busy", key(i))).collect(), at(0)).await;
    let mut running = 0;
    while running < full {
        let got = claim(s, params("far_busy", limits::CLAIM_BATCH_MAX)).await;
        assert!(!got.is_empty(), "the busy queue drains ({running} of {full} claimed)");
        running += got.len();
    }
    insert(s, (0..full).map(|i| mk("far_q", key(i))).collect(), at(0)).await;
    let last = insert(s, vec![mk("far_q", "far-zzzzz".to_owned())], at(0)).await;
    let mut got = ids(&claim(s, params("far_q", 10)).await);
    if got.is_empty() {
        got = ids(&claim(s, params("far_q", 10)).await);
    }
    assert_eq!(got, vec![last[0].id()], "the one key with room, within two claims");
}

/// How many of `claims` are rows of each concurrency key (`-` for rows without one).
fn per_key(claims: &[keel_core::ports::store::Claim]) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for c in claims {
        let key = c.instance.concurrency_key.clone().unwrap_or_else(|| "-".to_owned());
        *out.entry(key).or_default() += 1;
    }
    out
}

/// A per-key rate limit gives every concurrency key of a queue its own token bucket,
/// across claims and claimers: a key's starts are bounded by its bucket (new: `burst`;
/// refilled at `starts` per `per`, fractions carried, above `burst` only with what accrued
/// since a claim its tokens cut short, at most one period's worth), while other keys'
/// rows and rows without a key are still claimed. Rows over a key's limit stay ready. The
/// bucket of a key with no ready row is dropped once full, so after running dry a key gets
/// the burst again.
pub async fn key_rate_limit_bounds_each_keys_starts<S: Store>(s: &S) {
    let ns = "claim_key_rate";
    let queue = "key_metered";
    let (key_a, key_b, key_c) = ("krate-a", "krate-b", "krate-c");
    let rows = |key: Option<&str>, n: usize| {
        (0..n)
            .map(|i| {
                let row = new_in(ns).queue(queue).eligible_at(at(i as i64));
                match key {
                    Some(k) => row.concurrency_key(k),
                    None => row,
                }
            })
            .collect::<Vec<_>>()
    };
    let mut all = rows(Some(key_a), 10);
    all.extend(rows(Some(key_b), 3));
    all.extend(rows(None, 1));
    insert(s, all, at(0)).await;
    let rate = RateLimit { starts: 4, per: Duration::from_secs(1), burst: 2 };
    let policy =
        ClaimPolicy { key_rate: Some(rate), key_limit: 10, ..ClaimPolicy::new(Strategy::Fifo) };
    let params = |limit: usize, now: i64| {
        let mut p = with_policy(ns, limit, at(now), policy);
        p.queues = vec![queue.into()];
        p
    };
    let count = |pairs: &[(&str, usize)]| {
        pairs
            .iter()
            .map(|(k, n)| ((*k).to_owned(), *n))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let first = claim(s, params(20, 1_000)).await;
    assert_eq!(per_key(&first), count(&[(key_a, 2), (key_b, 2), ("-", 1)]), "a new bucket: burst");
    assert!(claim(s, params(20, 1_000)).await.is_empty(), "both keys are out of tokens");
    insert(s, rows(Some(key_c), 1), at(1_000)).await;
    let other = claim(s, params(20, 1_000)).await;
    assert_eq!(per_key(&other), count(&[(key_c, 1)]), "another key is not held back");
    assert!(claim(s, params(20, 1_200)).await.is_empty(), "0.8 tokens is not a start");
    let refilled = claim(s, params(20, 1_250)).await;
    assert_eq!(per_key(&refilled), count(&[(key_a, 1), (key_b, 1)]), "one token each after 250 ms");
    // a's tokens cut its claim short, so a long gap gives it one period's worth (4, above
    // the burst); b ran dry and is idle, so this claim of the queue drops its full bucket.
    let period = claim(s, params(20, 3_000)).await;
    assert_eq!(per_key(&period), count(&[(key_a, 4)]), "one period's worth");
    insert(s, rows(Some(key_b), 5), at(3_000)).await;
    let later = claim(s, params(20, 60_000)).await;
    assert_eq!(
        per_key(&later),
        count(&[(key_a, 3), (key_b, 2)]),
        "a: its last 3 rows (4 tokens); b: a new bucket's burst"
    );
    let left = ClaimPolicy { key_limit: 10, ..ClaimPolicy::new(Strategy::Fifo) };
    let mut p = with_policy(ns, 20, at(60_000), left);
    p.queues = vec![queue.into()];
    assert_eq!(
        per_key(&claim(s, p).await),
        count(&[(key_b, 3)]),
        "rows over the limit stayed ready"
    );
    let mut p = params(10, 70_000);
    p.queues = Vec::new();
    expect_kind(s.instance_claim(p).await, ErrorKind::Invalid, "key rate limit without a queue");
    let by_ids = s.instance_claim_ids(vec![keel_core::InstanceId(1)], params(10, 70_000)).await;
    expect_kind(by_ids, ErrorKind::Invalid, "a claim of named instances with a key rate limit");
}

/// With a burst of 1, two keys claimed every 25 ms at 20 starts per second each start
/// exactly their rate: each claim takes every token that accrued for each key since its
/// last start (fractions carried exactly), and neither key's tokens count for the other.
pub async fn key_rate_limit_keeps_each_keys_rate<S: Store>(s: &S) {
    let ns = "claim_key_rate_one";
    let queue = "key_metered_one";
    let keys = ["krate1-a", "krate1-b"];
    insert(
        s,
        (0..60)
            .map(|i| {
                new_in(ns).queue(queue).eligible_at(at(i)).concurrency_key(keys[i as usize % 2])
            })
            .collect(),
        at(0),
    )
    .await;
    let rate = RateLimit { starts: 20, per: Duration::from_secs(1), burst: 1 };
    let policy =
        ClaimPolicy { key_rate: Some(rate), key_limit: 100, ..ClaimPolicy::new(Strategy::Fifo) };
    let mut started = std::collections::BTreeMap::<String, usize>::new();
    for t in (1_000..=2_000).step_by(25) {
        let mut p = with_policy(ns, 50, at(t), policy);
        p.queues = vec![queue.into()];
        for (key, n) in per_key(&claim(s, p).await) {
            *started.entry(key).or_default() += n;
        }
    }
    let expected: std::collections::BTreeMap<String, usize> =
        keys.iter().map(|k| ((*k).to_owned(), 1 + 20)).collect();
    assert_eq!(started, expected, "one token each, then 20 per second each");
}

/// A pending signal with a priority raises its instance's claim priority to it when that
/// is more urgent (whether the signal woke the instance or arrived during its step); a
/// signal without one changes nothing; a commit sets the priority again from the
/// signals it leaves unread, so the instance falls back to its own once they are
/// consumed.
pub async fn signal_priority_raises_the_claim_priority_until_consumed<S: Store>(s: &S) {
    use super::support::{await_signal, claim_id, commit_ok, deliver, get, insert_one, row, send};
    use keel_core::instance::NewSignal;
    use keel_core::ports::store::DeliveryOutcome;
    use keel_core::{Status, StepCommit};
    let ns = "signal_priority";
    let prio = |limit: usize, ms: i64| {
        with_policy(ns, limit, at(ms), ClaimPolicy::new(Strategy::Priority))
    };
    let parked = insert_one(s, new_in(ns).priority(Priority::Bulk), at(0)).await;
    let first = claim_id(s, ns, parked, at(0)).await;
    step(s, &first, await_signal("go", 1), at(1)).await;
    insert(s, vec![new_in(ns).priority(Priority::Low), new_in(ns).priority(Priority::Low)], at(1))
        .await;
    let (noise, _) = send(s, parked, "noise", at(2)).await;
    let before = row(s, parked).await;
    assert_eq!((before.priority, before.base_priority), (Priority::Bulk, Priority::Bulk));
    let out = deliver(s, vec![NewSignal::new(parked, "go").priority(Priority::High)], at(5)).await;
    let [DeliveryOutcome::Delivered { id: go, woke: true, .. }] = out.as_slice() else {
        panic!("expected the awaited signal to wake its target: {out:?}")
    };
    let woken = row(s, parked).await;
    assert_eq!(
        (woken.status, woken.priority, woken.base_priority),
        (Status::Runnable, Priority::High, Priority::Bulk),
        "the urgent signal raised the claim priority"
    );
    let claimed = claim(s, prio(1, 10)).await;
    assert_eq!(ids(&claimed), vec![parked], "claimed ahead of the low rows");
    let seen: Vec<_> = claimed[0].inbox.iter().map(|x| (x.id, x.priority)).collect();
    assert_eq!(seen, vec![(noise, None), (*go, Some(Priority::High))], "priorities kept");
    // Arriving during the step: raised, not woken.
    let out =
        deliver(s, vec![NewSignal::new(parked, "urgent").priority(Priority::Critical)], at(12))
            .await;
    let [DeliveryOutcome::Delivered { id: urgent, woke: false, .. }] = out.as_slice() else {
        panic!("expected a stored signal that wakes nothing: {out:?}")
    };
    let during = row(s, parked).await;
    assert_eq!((during.status, during.priority), (Status::Executing, Priority::Critical));
    commit_ok(s, StepCommit::new(parked, claimed[0].token(), next("b", 2)).consume([*go]), at(15))
        .await;
    assert_eq!(
        row(s, parked).await.priority,
        Priority::Critical,
        "the unread urgent signal counts"
    );
    let again = claim(s, prio(1, 20)).await;
    assert_eq!(ids(&again), vec![parked]);
    commit_ok(
        s,
        StepCommit::new(parked, again[0].token(), next("c", 3)).consume([noise, *urgent]),
        at(25),
    )
    .await;
    let after = row(s, parked).await;
    assert_eq!(after.priority, Priority::Bulk, "back to its own once nothing urgent is pending");
    assert!(get(s, parked).await.inbox.is_empty());
    let rest = claim(s, prio(3, 30)).await;
    assert_eq!(rest.last().map(|c| c.instance.id), Some(parked), "bulk again: after the low rows");
    assert_eq!(rest.len(), 3);
}
