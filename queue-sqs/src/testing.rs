//! Test support: a fresh queue per test on the endpoint named by `KEEL_TEST_SQS_ENDPOINT`
//! (a local SQS emulator).

use crate::{SqsQueue, static_client};

/// The variable naming the test endpoint.
pub const ENDPOINT_VAR: &str = "KEEL_TEST_SQS_ENDPOINT";

/// A standard (`fifo == false`) or FIFO queue with a fresh random name, optionally with a
/// dead-letter queue after `max_receives`, or `None` when `KEEL_TEST_SQS_ENDPOINT` is
/// unset. Panics if the endpoint is named but refuses: a configured backend that is down
/// is a failure, not a skip.
pub async fn fresh_queue_with(fifo: bool, max_receives: Option<u32>) -> Option<SqsQueue> {
    let endpoint = std::env::var(ENDPOINT_VAR).ok()?;
    let suffix = if fifo { ".fifo" } else { "" };
    let name = format!("keel-test-{:016x}{suffix}", fastrand::u64(..));
    let client = static_client(&endpoint, "us-east-1");
    Some(
        SqsQueue::create(client, &name, max_receives)
            .await
            .unwrap_or_else(|e| panic!("{ENDPOINT_VAR}={endpoint}: {e}")),
    )
}

/// A fresh standard queue.
pub async fn fresh_queue() -> Option<SqsQueue> {
    fresh_queue_with(false, None).await
}

/// A fresh FIFO queue.
pub async fn fresh_fifo_queue() -> Option<SqsQueue> {
    fresh_queue_with(true, None).await
}
