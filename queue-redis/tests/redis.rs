//! What the Redis queue adds beyond the shared contracts: a receiver that crashes loses
//! nothing, losing the data loses only hints, duplicates collapse, and a wrong URL or a
//! server that is down gives a clear error.

use keel_core::ports::Queue;
use keel_core::ports::queue::Hint;
use keel_core::{ErrorKind, InstanceId};
use keel_queue_redis::testing::{URL_VAR, fresh_queue};
use keel_queue_redis::{RedisQueue, RedisQueueConfig};
use keel_testkit::conformance::queue::queue_or_skip;
use std::time::Duration;

const MS: Duration = Duration::from_millis(1);

/// Hints leased by a receiver that went away come back once their lease runs out, to a
/// receiver on another connection.
#[tokio::test]
async fn crashed_receiver_hints_come_back() {
    let Some(q) = queue_or_skip("redis crash", URL_VAR, fresh_queue().await) else { return };
    q.enqueue((1..=5).map(|n| Hint::new(InstanceId(n), 1)).collect()).await.unwrap();
    let url = std::env::var(URL_VAR).unwrap();
    {
        let crashed = RedisQueue::connect(RedisQueueConfig::new(&url, q.name())).await.unwrap();
        assert_eq!(crashed.receive(5, 300 * MS, MS).await.unwrap().len(), 5);
    }
    assert!(q.receive(5, 300 * MS, Duration::ZERO).await.unwrap().is_empty());
    let back = q.receive(5, 300 * MS, 1000 * MS).await.unwrap();
    assert_eq!(back.len(), 5);
    assert!(back.iter().all(|d| d.receive_count == 2));
}

/// The same instance and revision published twice is one hint; a purge drops them all.
#[tokio::test]
async fn duplicates_collapse_and_purge_empties() {
    let Some(q) = queue_or_skip("redis dedup", URL_VAR, fresh_queue().await) else { return };
    let h = Hint::new(InstanceId(7), 3);
    q.enqueue(vec![h.clone(), h.clone()]).await.unwrap();
    q.enqueue(vec![h, Hint::new(InstanceId(7), 4)]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 2);
    q.purge().await.unwrap();
    assert_eq!(q.len().await.unwrap(), 0);
    assert!(q.receive(10, 100 * MS, 10 * MS).await.unwrap().is_empty());
}

/// A receipt of an earlier delivery cannot extend or nack the current one.
#[tokio::test]
async fn stale_receipt_is_not_found() {
    let Some(q) = queue_or_skip("redis stale receipt", URL_VAR, fresh_queue().await) else {
        return;
    };
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let first = q.receive(1, 50 * MS, 100 * MS).await.unwrap();
    let second = q.receive(1, 5000 * MS, 500 * MS).await.unwrap();
    assert_eq!(second[0].receive_count, 2);
    let err = q.extend(first[0].receipt.clone(), 5000 * MS).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    q.ack(vec![first[0].receipt.clone()]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 1, "a stale ack removed the current delivery");
}

/// Bad settings name the field; a server that is not there is `Unavailable`.
#[tokio::test]
async fn bad_url_name_and_server_down() {
    let err = RedisQueue::connect(RedisQueueConfig::new("http://x", "q")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.starts_with("url"), "{err}");
    let err = RedisQueue::connect(RedisQueueConfig::new("redis://127.0.0.1:6379", "a{b}"))
        .await
        .unwrap_err();
    assert!(err.message.starts_with("name"), "{err}");
    let err =
        RedisQueue::connect(RedisQueueConfig::new("redis://127.0.0.1:9", "q")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
}

/// Entries under the queue's keys that are not hints (written by something else, edited
/// by hand, or encoded by another version) are removed when received, and the good hints
/// leased with them are handed out in the same receive, or at once behind them.
#[tokio::test]
async fn entries_that_are_not_hints_are_removed_and_good_hints_still_arrive() {
    let Some(q) = queue_or_skip("redis junk entries", URL_VAR, fresh_queue().await) else {
        return;
    };
    let url = std::env::var(URL_VAR).unwrap();
    let conn = redis::aio::ConnectionManager::new(redis::Client::open(url).unwrap()).await.unwrap();
    let prefix = format!("keel:{{{}}}", q.name());
    let (vis, body, count) =
        (format!("{prefix}:vis"), format!("{prefix}:body"), format!("{prefix}:count"));
    // An id that is not `<instance>:<revision>`, and a good id with a body of another
    // encoding; both visible since the epoch, so they come before any real hint.
    let plant = |mut conn: redis::aio::ConnectionManager| {
        let (vis, body) = (vis.clone(), body.clone());
        async move {
            for (id, text) in [("x:y", "junk"), ("5:1", "no-priority-level")] {
                redis::cmd("HSET").arg(&body).arg(id).arg(text).exec_async(&mut conn).await?;
                redis::cmd("ZADD").arg(&vis).arg(0).arg(id).exec_async(&mut conn).await?;
            }
            redis::RedisResult::Ok(())
        }
    };
    let fields = |key: String, mut conn: redis::aio::ConnectionManager| async move {
        let mut names: Vec<String> = redis::cmd("HKEYS").arg(&key).query_async(&mut conn).await?;
        names.sort();
        redis::RedisResult::Ok(names)
    };

    // Junk and a good hint leased in one batch.
    plant(conn.clone()).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let got = q.receive(10, 5000 * MS, 100 * MS).await.unwrap();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), vec![1]);
    assert_eq!(q.len().await.unwrap(), 1, "the junk entries are still queued");
    assert_eq!(fields(body.clone(), conn.clone()).await.unwrap(), ["1:1"]);
    assert_eq!(fields(count.clone(), conn.clone()).await.unwrap(), ["1:1"]);
    q.ack(vec![got[0].receipt.clone()]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 0);

    // Junk alone in the first rounds: a receive of one looks again at once.
    plant(conn.clone()).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(2), 1)]).await.unwrap();
    let got = q.receive(1, 5000 * MS, 100 * MS).await.unwrap();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), vec![2]);
    assert_eq!(q.len().await.unwrap(), 1, "the junk entries are still queued");
    q.ack(vec![got[0].receipt.clone()]).await.unwrap();
    assert!(fields(body, conn.clone()).await.unwrap().is_empty());
    assert!(fields(count, conn).await.unwrap().is_empty());
}
