//! The hint queue a benchmark worker uses (`--queue`): none (the store's own claims and
//! notifications), Redis, or SQS — each run on a fresh queue.

use anyhow::{Context, Result};
use clap::ValueEnum;
use keel_core::ports::Queue;
use std::sync::Arc;

/// Which queue carries ready-work hints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueueKind {
    /// No queue: the store's claim loop and notifications.
    None,
    /// Redis at `KEEL_TEST_REDIS_URL` (default `redis://127.0.0.1:6379`).
    Redis,
    /// SQS at `KEEL_TEST_SQS_ENDPOINT` (default `http://127.0.0.1:9324`, an emulator).
    Sqs,
}

impl QueueKind {
    /// The name used in file names and tables.
    pub fn name(self) -> &'static str {
        match self {
            QueueKind::None => "none",
            QueueKind::Redis => "redis",
            QueueKind::Sqs => "sqs",
        }
    }

    /// A fresh queue of this kind, `None` for [`QueueKind::None`].
    pub async fn fresh(self) -> Result<Option<Arc<dyn Queue>>> {
        let name = format!("bench-{:016x}", fastrand::u64(..));
        Ok(match self {
            QueueKind::None => None,
            QueueKind::Redis => {
                let url = std::env::var("KEEL_TEST_REDIS_URL")
                    .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
                let config = keel_queue_redis::RedisQueueConfig::new(&url, name);
                let q = keel_queue_redis::RedisQueue::connect(config)
                    .await
                    .with_context(|| format!("Redis queue at {url}"))?;
                Some(Arc::new(q))
            }
            QueueKind::Sqs => {
                let endpoint = std::env::var("KEEL_TEST_SQS_ENDPOINT")
                    .unwrap_or_else(|_| "http://127.0.0.1:9324".to_owned());
                let client = keel_queue_sqs::static_client(&endpoint, "us-east-1");
                let q = keel_queue_sqs::SqsQueue::create(client, &name, None)
                    .await
                    .with_context(|| format!("SQS queue at {endpoint}"))?;
                Some(Arc::new(q))
            }
        })
    }
}
