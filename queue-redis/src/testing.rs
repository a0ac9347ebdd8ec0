//! Test support: a fresh queue per test on the server named by `KEEL_TEST_REDIS_URL`.

use crate::{RedisQueue, RedisQueueConfig};

/// The variable naming the test server.
pub const URL_VAR: &str = "KEEL_TEST_REDIS_URL";

/// A queue with a fresh random name on the test server, or `None` when
/// `KEEL_TEST_REDIS_URL` is unset. Panics if the server is named but does not answer: a
/// configured backend that is down is a failure, not a skip.
pub async fn fresh_queue() -> Option<RedisQueue> {
    let url = std::env::var(URL_VAR).ok()?;
    let name = format!("test-{:016x}", fastrand::u64(..));
    Some(
        RedisQueue::connect(RedisQueueConfig::new(&url, name))
            .await
            .unwrap_or_else(|e| panic!("{URL_VAR}={url}: {e}")),
    )
}
