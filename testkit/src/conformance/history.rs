//! History paging and trimming: `history_page` walks an instance's history newest first
//! with a cursor down to its oldest entry and refuses bad pages; `history_trim` keeps each
//! instance's newest entries, deletes exactly the older ones, oldest first, at most a
//! page's `limit` rows per page, and leaves instances out of scope whole.

use super::support::{at, claim_params, ctx, expect_kind, insert_one, new_in};
use keel_core::instance::{HistoryEntry, HistoryRecord};
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{
    CommitParams, HistoryPageParams, HistoryTrimPage, HistoryTrimParams,
};
use keel_core::{ErrorKind, InstanceId, MachineRef, NewInstance, StepCommit, limits};
use serde_json::json;

/// Appends history to `id` at `at(t)`: one step (claimed by id) whose commit records `n`
/// notes before the engine's own entry for its `Next`. The instance stays runnable.
async fn append<S: Store>(s: &S, ns: &str, id: InstanceId, n: usize, t: i64) {
    let claims = s
        .instance_claim_ids(vec![id], claim_params(ns, 1, at(t)))
        .await
        .expect("instance_claim_ids");
    assert_eq!(claims.len(), 1, "instance {id} claimable at {t}");
    let mut commit = StepCommit::new(
        id,
        claims[0].token(),
        Outcome::Next { step: "start".into(), context: ctx(t) },
    );
    commit.history = (0..n).map(|i| HistoryEntry::new("NOTE", json!({ "t": t, "i": i }))).collect();
    let mut results = s
        .step_commit(CommitParams { commits: vec![commit], now: at(t) })
        .await
        .expect("step_commit");
    results.remove(0).expect("commit accepted");
}

/// The whole history of `id`, oldest first (the tests keep it under the inspect bound).
async fn all<S: Store>(s: &S, id: InstanceId) -> Vec<HistoryRecord> {
    let history = s.instance_get(id).await.expect("instance_get").history;
    assert!(history.len() < limits::HISTORY_LIST_MAX, "the test stays under the inspect bound");
    history
}

fn seqs(records: &[HistoryRecord]) -> Vec<i64> {
    records.iter().map(|r| r.seq).collect()
}

/// Walks every page of `id` of size `limit`; returns the pages' sequence numbers.
async fn walk<S: Store>(s: &S, id: InstanceId, limit: usize) -> Vec<Vec<i64>> {
    let mut pages = Vec::new();
    let mut before = None;
    // Bounded: every page moves `before` down over a finite history.
    for _ in 0..1_000 {
        let page = s
            .history_page(HistoryPageParams { instance: id, before, limit })
            .await
            .expect("history_page");
        assert!(page.entries.len() <= limit, "a page holds at most its limit");
        pages.push(seqs(&page.entries));
        match page.next {
            Some(next) => {
                assert_eq!(Some(&next), pages.last().and_then(|p| p.last()), "next = last entry");
                before = Some(next);
            }
            None => return pages,
        }
    }
    panic!("history pages of {id} did not end within 1000 pages");
}

/// Pages run newest first down to the oldest entry, each full but the last, with a
/// cursor exactly while older entries exist; another instance's entries in between never
/// show; bad pages are refused naming the field; a missing instance is `NotFound`.
pub async fn history_page_walks_newest_first_to_the_oldest_entry<S: Store>(s: &S) {
    let ns = "history_page";
    let a = insert_one(s, new_in(ns), at(0)).await;
    let b = insert_one(s, new_in(ns), at(0)).await;
    // Interleaved: b's entries fall between a's in sequence order.
    append(s, ns, a, 6, 10).await;
    append(s, ns, b, 3, 20).await;
    append(s, ns, a, 4, 30).await;
    let history = all(s, a).await;
    let newest_first: Vec<i64> = seqs(&history).into_iter().rev().collect();
    let total = newest_first.len();
    assert!(total >= 10, "a has at least its ten notes: {history:?}");

    let pages = walk(s, a, 4).await;
    assert_eq!(pages.concat(), newest_first, "the pages cover the history once, newest first");
    assert_eq!(pages.len(), total.div_ceil(4), "{pages:?}");
    assert!(pages[..pages.len() - 1].iter().all(|p| p.len() == 4), "full pages: {pages:?}");
    // A page that ends exactly at the oldest entry gives no cursor.
    assert_eq!(walk(s, a, total).await, std::slice::from_ref(&newest_first));
    let one_short = walk(s, a, total - 1).await;
    assert_eq!(one_short.len(), 2, "{one_short:?}");
    assert_eq!(one_short[1], [newest_first[total - 1]]);
    // A cursor from another instance's history still pages this one.
    let b_seq = all(s, b).await[0].seq;
    let below = s
        .history_page(HistoryPageParams { instance: a, before: Some(b_seq), limit: 100 })
        .await
        .expect("history_page");
    let want: Vec<i64> = newest_first.iter().copied().filter(|q| *q < b_seq).collect();
    assert_eq!((seqs(&below.entries), below.next), (want, None));
    assert!(below.entries.iter().all(|r| r.instance == a));
    // The largest page is accepted; anything outside the bounds is refused.
    let largest = HistoryPageParams { instance: a, before: None, limit: limits::HISTORY_PAGE_MAX };
    assert_eq!(s.history_page(largest).await.expect("largest page").entries.len(), total);
    for (before, limit, field) in
        [(None, 0, "limit"), (None, limits::HISTORY_PAGE_MAX + 1, "limit"), (Some(0), 10, "before")]
    {
        let result = s.history_page(HistoryPageParams { instance: a, before, limit }).await;
        match result {
            Err(e) if e.kind == ErrorKind::Invalid => {
                assert!(e.message.starts_with(field), "names {field}: {e}");
            }
            other => panic!("before {before:?} limit {limit}: expected Invalid, got {other:?}"),
        }
    }
    let missing = HistoryPageParams { instance: InstanceId(i64::MAX), before: None, limit: 10 };
    expect_kind(s.history_page(missing).await, ErrorKind::NotFound, "missing instance");
    // An instance with no history yet: one empty page.
    let fresh = insert_one(s, new_in(ns), at(40)).await;
    assert_eq!(walk(s, fresh, 10).await, [Vec::<i64>::new()]);
}

/// Runs a whole trim pass (pages until nothing is left) and returns each page.
async fn trim_pass<S: Store>(s: &S, p: &HistoryTrimParams) -> Vec<HistoryTrimPage> {
    let mut pages = Vec::new();
    let mut p = p.clone();
    // Bounded: every page deletes rows or moves `after` forward over a finite table.
    for _ in 0..1_000 {
        let page = s.history_trim(p.clone()).await.expect("history_trim");
        assert!(page.history <= p.limit as u64, "a page deletes at most its limit: {page:?}");
        pages.push(page);
        match page.last {
            Some(last) => p.after = Some(last),
            None => return pages,
        }
    }
    panic!("a trim pass did not end within 1000 pages");
}

fn trimmed(pages: &[HistoryTrimPage]) -> u64 {
    pages.iter().map(|p| p.history).sum()
}

/// Each instance in scope keeps exactly its newest `keep` entries; the older ones go,
/// oldest first, in pages of at most `limit` rows (an instance with more to lose than a
/// page spans pages); entries appended later are trimmed by the next pass; other
/// namespaces and excepted machines keep everything; bad passes are refused.
pub async fn history_trim_keeps_the_newest_entries_in_batches<S: Store>(s: &S) {
    let ns = "history_trim";
    let kept_machine = || NewInstance::new(MachineRef::new("kept", 1), "start").namespace(ns);
    let a = insert_one(s, new_in(ns), at(0)).await;
    let short = insert_one(s, new_in(ns), at(0)).await;
    let c = insert_one(s, new_in(ns), at(0)).await;
    let excepted = insert_one(s, kept_machine(), at(0)).await;
    let other = insert_one(s, new_in("history_trim_other"), at(0)).await;
    append(s, ns, a, 9, 10).await;
    append(s, ns, short, 1, 20).await;
    append(s, ns, c, 5, 30).await;
    append(s, ns, a, 2, 40).await;
    append(s, ns, excepted, 9, 50).await;
    append(s, "history_trim_other", other, 9, 60).await;
    let (a0, short0, c0) = (all(s, a).await, all(s, short).await, all(s, c).await);
    let (excepted0, other0) = (all(s, excepted).await, all(s, other).await);
    let keep = 4;
    assert!(short0.len() <= keep, "short stays under the bound: {short0:?}");
    assert!(a0.len() > keep + 3 && c0.len() > keep, "a and c exceed it");

    let params = HistoryTrimParams {
        namespace: Some(ns.into()),
        machines: Vec::new(),
        except: vec!["kept".into()],
        keep,
        after: None,
        limit: 3,
    };
    let pages = trim_pass(s, &params).await;
    let expected = (a0.len() - keep + c0.len() - keep) as u64;
    assert_eq!(trimmed(&pages), expected, "exactly the entries beyond the newest 4: {pages:?}");
    assert!(pages.len() as u64 >= expected.div_ceil(3), "pages of at most 3 rows: {pages:?}");
    assert!(pages.iter().filter(|p| p.history > 0).count() >= 2, "several batches: {pages:?}");
    assert_eq!(all(s, a).await, a0[a0.len() - keep..], "a keeps its newest 4");
    assert_eq!(all(s, c).await, c0[c0.len() - keep..], "c keeps its newest 4");
    assert_eq!(all(s, short).await, short0, "short had no more than 4");
    assert_eq!(all(s, excepted).await, excepted0, "an excepted machine keeps everything");
    assert_eq!(all(s, other).await, other0, "another namespace keeps everything");
    // A second pass finds nothing to do.
    assert_eq!(trimmed(&trim_pass(s, &params).await), 0);

    // Entries appended later: the next pass takes exactly the oldest ones again.
    append(s, ns, a, 2, 70).await;
    let a1 = all(s, a).await;
    assert_eq!(trimmed(&trim_pass(s, &params).await), (a1.len() - keep) as u64);
    assert_eq!(all(s, a).await, a1[a1.len() - keep..]);

    // A pass naming one machine trims only that machine.
    let only_kept = HistoryTrimParams {
        machines: vec!["kept".into()],
        except: Vec::new(),
        keep: 1,
        ..params.clone()
    };
    assert_eq!(trimmed(&trim_pass(s, &only_kept).await), (excepted0.len() - 1) as u64);
    assert_eq!(all(s, excepted).await, excepted0[excepted0.len() - 1..]);
    assert_eq!(all(s, other).await, other0);

    // Out of bounds: refused, nothing deleted; the largest values are accepted.
    for bad in [
        HistoryTrimParams { keep: 0, ..params.clone() },
        HistoryTrimParams { keep: limits::HISTORY_KEEP_MAX + 1, ..params.clone() },
        HistoryTrimParams { limit: 0, ..params.clone() },
        HistoryTrimParams { limit: limits::PRUNE_BATCH_MAX + 1, ..params.clone() },
    ] {
        let all_ns = HistoryTrimParams { namespace: None, keep: bad.keep, limit: bad.limit, ..bad };
        expect_kind(s.history_trim(all_ns).await, ErrorKind::Invalid, "trim bounds");
    }
    assert_eq!(all(s, other).await, other0, "nothing trimmed by a refused page");
    let largest = HistoryTrimParams {
        keep: limits::HISTORY_KEEP_MAX,
        limit: limits::PRUNE_BATCH_MAX,
        ..params.clone()
    };
    assert_eq!(trimmed(&trim_pass(s, &largest).await), 0);
}
