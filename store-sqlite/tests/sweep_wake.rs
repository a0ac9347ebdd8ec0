//! A timer sweep that makes an instance runnable wakes the workers waiting in
//! `ready_wait`, so the instance runs now rather than at their next claim poll.

use keel_core::join::Join;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::TimerSweepParams;
use keel_core::{NewInstance, Status};
use keel_store_sqlite::SqliteStore;
use keel_testkit::conformance::support::{at, claim_id, ctx, insert_one, new_in, row, step};
use std::time::Duration;

/// Polls a future once; `Some` if it finished.
async fn poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
    let mut f = f;
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// A sweep whose only effect is expiring a join deadline (no event delivered) sets the
/// parent runnable, and so wakes a worker waiting for ready work.
#[tokio::test]
async fn a_sweep_that_expires_a_join_deadline_wakes_ready_waiters() {
    let s = SqliteStore::memory().await.expect("open");
    let ns = "join_deadline_wake";
    let parent = insert_one(&s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(&s, ns, parent, at(10)).await;
    let children: Vec<NewInstance> = vec![new_in(ns)];
    let outcome = Outcome::schedule_children("join", children, ctx(1))
        .with_join(Join::all().within(Duration::from_secs(60)));
    step(&s, &claimed, outcome, at(20)).await;
    assert_eq!(row(&s, parent).await.status, Status::AwaitingChildren);
    // Use up the wake-up the setup's commits left for the next wait.
    let _ = tokio::time::timeout(Duration::from_millis(200), s.ready_wait()).await;
    let waiter = s.ready_wait();
    tokio::pin!(waiter);
    assert!(poll_once(waiter.as_mut()).await.is_none(), "nothing woke it yet");
    let report = s
        .timer_sweep(TimerSweepParams {
            namespace: Some(ns.into()),
            machines: vec![],
            limit: 100,
            now: at(20 + 60_000),
        })
        .await
        .expect("sweep");
    assert_eq!((report.fired, report.exhausted), (0, 0), "a deadline delivers no event");
    assert_eq!(row(&s, parent).await.status, Status::Runnable, "the deadline woke the parent");
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the sweep that made the parent runnable wakes the waiting workers");
}
