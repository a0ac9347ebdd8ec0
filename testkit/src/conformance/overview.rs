//! Contracts for what an operator's overview reads: dead letters a page at a time by id
//! cursor and counted per machine, and the per-queue counts of unfinished instances.

use super::support::{
    at, await_signal, claim_id, commit_ok, done, expect_kind, insert_one, new_in, suspend,
};
use keel_core::ports::Store;
use keel_core::ports::store::{
    DeadLetterCount, DeadLetterFilter, DeadLetterRetryParams, DeadLetterSelector, QueueStats,
};
use keel_core::{DeadLetterId, ErrorKind, MachineRef, NewInstance, StepCommit, Timestamp, limits};

/// Inserts an instance of `machine` in `ns`, claims it and suspends it: one dead letter.
async fn dead_letter<S: Store>(s: &S, ns: &str, machine: &str, now: Timestamp) -> DeadLetterId {
    let new = NewInstance::new(MachineRef::new(machine, 1), "start").namespace(ns);
    let id = insert_one(s, new, now).await;
    let claimed = claim_id(s, ns, id, now).await;
    suspend(s, &claimed, "boom", vec![], now).await
}

async fn page<S: Store>(s: &S, filter: DeadLetterFilter) -> Vec<DeadLetterId> {
    s.dead_letter_list(filter.clone())
        .await
        .unwrap_or_else(|e| panic!("dead_letter_list({filter:?}): {e}"))
        .iter()
        .map(|d| d.id)
        .collect()
}

/// Dead letters page by id: `after` the last id of a page gives the next page, `before`
/// the first id gives the previous one, both oldest first; every letter is listed once
/// across the pages, filters hold on every page, a cursor past either end gives an empty
/// page, and a page size over the bound or both cursors at once are refused naming the
/// field.
pub async fn dead_letter_list_pages_by_id_cursor<S: Store>(s: &S) {
    let ns = "dlq_pages";
    let mut all = Vec::new();
    let mut billing = Vec::new();
    for i in 0..7 {
        let machine = if i % 3 == 0 { "billing" } else { "order" };
        let id = dead_letter(s, ns, machine, at(10 * i)).await;
        all.push(id);
        if machine == "billing" {
            billing.push(id);
        }
        // Another namespace's letters sit between this one's and must never show.
        dead_letter(s, "dlq_pages_other", machine, at(10 * i + 5)).await;
    }
    let in_ns = |limit: usize| DeadLetterFilter {
        namespace: Some(ns.into()),
        limit,
        ..DeadLetterFilter::default()
    };
    assert_eq!(page(s, in_ns(0)).await, all, "no cursor and no limit: every letter, oldest first");

    let mut pages = Vec::new();
    let mut after = None;
    for _ in 0..10 {
        let got = page(s, DeadLetterFilter { after, ..in_ns(3) }).await;
        if got.is_empty() {
            break;
        }
        assert!(got.len() <= 3, "a page holds at most its limit: {got:?}");
        after = got.last().copied();
        pages.push(got);
    }
    assert_eq!(pages, [&all[0..3], &all[3..6], &all[6..7]], "pages of 3, oldest first");

    let previous = page(s, DeadLetterFilter { before: Some(all[6]), ..in_ns(3) }).await;
    assert_eq!(previous, &all[3..6], "before the first id of page 3 is page 2");
    let first = page(s, DeadLetterFilter { before: Some(all[2]), ..in_ns(3) }).await;
    assert_eq!(first, &all[0..2], "before the third letter: the two oldest, a short page");
    assert!(page(s, DeadLetterFilter { before: Some(all[0]), ..in_ns(3) }).await.is_empty());
    assert!(page(s, DeadLetterFilter { after: Some(all[6]), ..in_ns(3) }).await.is_empty());

    let of_billing = |after, before| DeadLetterFilter {
        namespace: Some(ns.into()),
        machine: Some("billing".into()),
        after,
        before,
        limit: 2,
    };
    let one = page(s, of_billing(None, None)).await;
    assert_eq!(one, &billing[0..2], "a machine's first page");
    let two = page(s, of_billing(one.last().copied(), None)).await;
    assert_eq!(two, &billing[2..], "a machine's next page skips the other machine's letters");
    assert_eq!(page(s, of_billing(None, two.first().copied())).await, one);

    let everywhere = page(s, DeadLetterFilter::default()).await;
    assert_eq!(everywhere.len(), 14, "no namespace: every namespace's letters");
    assert!(everywhere.windows(2).all(|w| w[0] < w[1]), "ascending ids: {everywhere:?}");

    let too_many = in_ns(limits::DEAD_LETTER_BATCH_MAX + 1);
    let both = DeadLetterFilter { after: Some(all[1]), before: Some(all[5]), ..in_ns(3) };
    for (filter, field) in [(too_many, "limit"), (both, "before")] {
        let refused = s.dead_letter_list(filter).await.map(|l| l.len());
        assert!(
            refused.as_ref().is_err_and(|e| e.message.starts_with(field)),
            "refused naming {field}: {refused:?}"
        );
        expect_kind(refused, ErrorKind::Invalid, field);
    }
}

/// Queue counts: per (namespace, queue, machine) in name order, unfinished instances by
/// status — ready (eligible by `now`) and scheduled (later), executing, waiting and
/// suspended — with the oldest ready time; ended instances count nowhere, and without a
/// namespace every namespace is counted.
pub async fn queue_stats_counts_every_unfinished_status<S: Store>(s: &S) {
    let ns = "queue_stats";
    let in_a = || new_in(ns).queue("a");
    // One of each unfinished status in queue "a", each taken there before the next row
    // becomes claimable, plus one that ends and so counts nowhere.
    let executing = insert_one(s, in_a(), at(0)).await;
    claim_id(s, ns, executing, at(1)).await;
    let parked = insert_one(s, in_a(), at(2)).await;
    let claimed = claim_id(s, ns, parked, at(3)).await;
    commit_ok(s, StepCommit::new(parked, claimed.token(), await_signal("go", 1)), at(4)).await;
    let failed = insert_one(s, in_a(), at(5)).await;
    let claimed = claim_id(s, ns, failed, at(6)).await;
    suspend(s, &claimed, "boom", vec![], at(7)).await;
    let ended = insert_one(s, in_a(), at(8)).await;
    let claimed = claim_id(s, ns, ended, at(9)).await;
    commit_ok(s, StepCommit::new(ended, claimed.token(), done()), at(10)).await;
    // Runnable rows: two ready (eligible at 20 and 30), one due only after `now`.
    insert_one(s, in_a().eligible_at(at(30)), at(11)).await;
    insert_one(s, in_a().eligible_at(at(20)), at(12)).await;
    insert_one(s, in_a().eligible_at(at(1_000_000)), at(13)).await;
    // Another queue, another machine in it, and another namespace.
    insert_one(s, new_in(ns).queue("b").eligible_at(at(40)), at(14)).await;
    let invoice = NewInstance::new(MachineRef::new("invoice", 1), "start").namespace(ns);
    insert_one(s, invoice.queue("b").eligible_at(at(50)), at(15)).await;
    insert_one(s, new_in("queue_stats_other").queue("a"), at(16)).await;

    let now = at(100);
    let row =
        |ns: &str, queue: &str, machine: &str, counts: [u64; 5], oldest: Option<i64>| QueueStats {
            namespace: ns.into(),
            queue: queue.into(),
            machine: machine.into(),
            ready: counts[0],
            scheduled: counts[1],
            executing: counts[2],
            waiting: counts[3],
            suspended: counts[4],
            oldest_ready_at: oldest.map(at),
        };
    let want = vec![
        row(ns, "a", "order", [2, 1, 1, 1, 1], Some(20)),
        row(ns, "b", "invoice", [1, 0, 0, 0, 0], Some(50)),
        row(ns, "b", "order", [1, 0, 0, 0, 0], Some(40)),
    ];
    let got = s.queue_stats(Some(ns.into()), now).await.expect("queue_stats");
    assert_eq!(got, want, "one namespace");

    let mut everywhere = s.queue_stats(None, now).await.expect("queue_stats, every namespace");
    everywhere.retain(|q| q.namespace.starts_with("queue_stats"));
    let mut want_all = want.clone();
    want_all.push(row("queue_stats_other", "a", "order", [1, 0, 0, 0, 0], Some(16)));
    assert_eq!(everywhere, want_all, "every namespace, in name order");

    let early = s.queue_stats(Some(ns.into()), at(25)).await.expect("queue_stats at 25");
    assert_eq!(
        (early[0].ready, early[0].scheduled, early[0].oldest_ready_at),
        (1, 2, Some(at(20))),
        "at 25 only the row eligible at 20 is ready"
    );
    assert!(s.queue_stats(Some("queue_stats_none".into()), now).await.expect("empty").is_empty());
}

/// Dead letters counted per (namespace, machine) in name order, exactly (not a page of
/// them): one namespace, or every namespace; a retried letter no longer counts; a bad
/// namespace name is refused naming the field.
pub async fn dead_letter_counts_per_machine<S: Store>(s: &S) {
    let ns = "dlq_counts";
    for (i, machine) in ["order", "billing", "order", "order", "billing"].iter().enumerate() {
        dead_letter(s, ns, machine, at(10 * i as i64)).await;
    }
    let retried = dead_letter(s, ns, "refund", at(60)).await;
    dead_letter(s, "dlq_counts_other", "order", at(70)).await;
    let count = |ns: &str, machine: &str, count: u64| DeadLetterCount {
        namespace: ns.into(),
        machine: machine.into(),
        count,
    };
    let got = s.dead_letter_counts(Some(ns.into())).await.expect("dead_letter_counts");
    assert_eq!(got, [count(ns, "billing", 2), count(ns, "order", 3), count(ns, "refund", 1)]);
    let retry = DeadLetterRetryParams {
        selector: DeadLetterSelector::Id(retried),
        delay: std::time::Duration::ZERO,
        now: at(80),
    };
    s.dead_letter_retry(retry).await.expect("retry");
    let got = s.dead_letter_counts(None).await.expect("dead_letter_counts, every namespace");
    assert_eq!(
        got,
        [count(ns, "billing", 2), count(ns, "order", 3), count("dlq_counts_other", "order", 1)],
        "every namespace, the retried letter gone"
    );
    let none = s.dead_letter_counts(Some("dlq_counts_none".into())).await.expect("empty");
    assert!(none.is_empty(), "{none:?}");
    let refused = s.dead_letter_counts(Some(String::new())).await.map(|c| c.len());
    assert!(refused.as_ref().is_err_and(|e| e.message.starts_with("namespace")), "{refused:?}");
}
