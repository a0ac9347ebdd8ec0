//! The queue conformance suite on `MemoryQueue`, the reference every backend is held to.

keel_testkit::queue_conformance_tests!(
    async { Some(keel_testkit::MemoryQueue::new()) },
    "nothing (MemoryQueue is always there)"
);

/// Purging drops every hint, leased or not: what a receiver sees when the server behind a
/// real queue loses its data.
#[tokio::test]
async fn purge_drops_every_hint() {
    use keel_core::ports::Queue;
    use keel_core::ports::queue::Hint;
    use std::time::Duration;
    let q = keel_testkit::MemoryQueue::new();
    q.enqueue(vec![Hint::new(keel_core::InstanceId(1), 1), Hint::new(keel_core::InstanceId(2), 1)])
        .await
        .unwrap();
    let leased = q.receive(1, Duration::from_secs(5), Duration::ZERO).await.unwrap();
    assert_eq!(leased.len(), 1);
    q.purge();
    assert!(q.is_empty());
    assert!(q.receive(10, Duration::from_secs(5), Duration::ZERO).await.unwrap().is_empty());
}

/// Acking a group's head unblocks the next hint of the group at once: a receive already
/// waiting gets it, instead of sleeping out its whole wait.
#[tokio::test]
async fn acking_a_group_head_wakes_a_waiting_receive() {
    use keel_core::ports::Queue;
    use keel_core::ports::queue::Hint;
    use std::time::{Duration, Instant};
    let q = keel_testkit::MemoryQueue::new();
    let hint = |id| Hint::new(keel_core::InstanceId(id), 1).group("g");
    q.enqueue(vec![hint(1), hint(2)]).await.unwrap();
    let head = q.receive(10, Duration::from_secs(60), Duration::ZERO).await.unwrap();
    assert_eq!(head.len(), 1, "the head blocks the rest of its group");
    let receipt = head[0].receipt.clone();
    let started = Instant::now();
    let wait = Duration::from_secs(10);
    let (next, acked) = tokio::join!(q.receive(10, Duration::from_secs(60), wait), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        q.ack(vec![receipt]).await
    });
    acked.unwrap();
    let next = next.unwrap();
    let took = started.elapsed();
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].hint.instance, keel_core::InstanceId(2));
    assert!(took < Duration::from_secs(5), "the receive slept {took:?} of its {wait:?} wait");
}
