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
