//! What SQS adds beyond the shared contracts: redrive to the dead-letter queue,
//! deduplication on FIFO queues, and clear errors for a wrong endpoint or name.

use keel_core::ports::Queue;
use keel_core::ports::queue::Hint;
use keel_core::{ErrorKind, InstanceId};
use keel_queue_sqs::testing::{ENDPOINT_VAR, fresh_queue_with};
use keel_queue_sqs::{SqsQueue, static_client};
use keel_testkit::conformance::queue::queue_or_skip;
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

/// A hint received `max_receives` times without an ack moves to the dead-letter queue;
/// the repair pass (not the DLQ) is what brings its work back.
#[tokio::test]
async fn unacked_hint_moves_to_the_dead_letter_queue() {
    let Some(q) =
        queue_or_skip("sqs redrive", ENDPOINT_VAR, fresh_queue_with(false, Some(2)).await)
    else {
        return;
    };
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    for n in 1..=2 {
        let got = q.receive(1, S, 3 * S).await.unwrap();
        assert_eq!(got.len(), 1, "receive {n}");
        assert_eq!(got[0].receive_count, n);
    }
    tokio::time::sleep(S + Duration::from_millis(200)).await;
    assert!(q.receive(1, S, S).await.unwrap().is_empty(), "redriven after two receives");
    let dlq = q.dead_letter_queue().await.unwrap();
    let dead = dlq.receive(1, S, 2 * S).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].hint.instance, InstanceId(1));
}

/// On a FIFO queue the same instance and revision published twice is delivered once; a
/// new revision is a new hint.
#[tokio::test]
async fn fifo_deduplicates_instance_and_revision() {
    let Some(q) = queue_or_skip("sqs fifo dedup", ENDPOINT_VAR, fresh_queue_with(true, None).await)
    else {
        return;
    };
    let h = Hint::new(InstanceId(7), 3);
    q.enqueue(vec![h.clone(), h.clone()]).await.unwrap();
    q.enqueue(vec![h.clone(), Hint::new(InstanceId(7), 4)]).await.unwrap();
    let mut revisions = Vec::new();
    for _ in 0..4 {
        let got = q.receive(10, 5 * S, S).await.unwrap();
        revisions.extend(got.iter().map(|d| d.hint.revision));
        q.ack(got.into_iter().map(|d| d.receipt).collect()).await.unwrap();
    }
    assert_eq!(revisions, vec![3, 4]);
}

/// A standard queue does not deduplicate: both copies arrive, which is why a receiver
/// treats a hint as "go and look" and the store's fencing keeps the work single.
#[tokio::test]
async fn standard_queue_delivers_duplicates() {
    let Some(q) =
        queue_or_skip("sqs duplicates", ENDPOINT_VAR, fresh_queue_with(false, None).await)
    else {
        return;
    };
    let h = Hint::new(InstanceId(7), 3);
    q.enqueue(vec![h.clone(), h]).await.unwrap();
    let mut n = 0;
    for _ in 0..4 {
        let got = q.receive(10, 5 * S, S).await.unwrap();
        n += got.len();
        q.ack(got.into_iter().map(|d| d.receipt).collect()).await.unwrap();
    }
    assert_eq!(n, 2);
}

/// A FIFO queue refuses delayed hints instead of delivering them early.
#[tokio::test]
async fn fifo_refuses_delays_naming_the_fix() {
    let Some(q) = queue_or_skip("sqs fifo delay", ENDPOINT_VAR, fresh_queue_with(true, None).await)
    else {
        return;
    };
    let err = q.enqueue(vec![Hint::new(InstanceId(1), 1).delay(S)]).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.contains("keep the work in the store"), "{err}");
}

/// A bad queue name is refused before any call; an endpoint that does not answer is
/// `Unavailable` (retryable), not a hang.
#[tokio::test]
async fn bad_name_and_dead_endpoint() {
    let client = static_client("http://127.0.0.1:9", "us-east-1");
    let err = SqsQueue::create(client.clone(), "no spaces", None).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.starts_with("name"), "{err}");
    let q = SqsQueue::open(client, "http://127.0.0.1:9/000000000000/nowhere");
    let err = q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
}
