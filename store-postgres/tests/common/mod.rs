//! Shared test setup: a store on a fresh schema, or `None` (skip) when
//! `KEEL_TEST_DATABASE_URL` is unset — unless `KEEL_REQUIRE_BACKENDS=1`.

#![allow(dead_code)]

use keel_store_postgres::{PgConfig, PgStore};
use std::sync::atomic::{AtomicU64, Ordering};

/// The test database URL, or `None` after printing why the test is skipped.
pub fn database_url() -> Option<String> {
    match std::env::var("KEEL_TEST_DATABASE_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
                "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset"
            );
            eprintln!("SKIPPED: KEEL_TEST_DATABASE_URL is unset");
            None
        }
    }
}

/// A schema name no other test (or test process) uses.
pub fn fresh_schema() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "keel_t_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000_000,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A migrated store on a fresh schema, with `pool_size` connections.
pub async fn store_with(pool_size: usize) -> Option<PgStore> {
    let url = database_url()?;
    let store = PgStore::connect(PgConfig::new(url).schema(fresh_schema()).pool_size(pool_size))
        .await
        .expect("connect to KEEL_TEST_DATABASE_URL");
    store.migrate().await.expect("migrate a fresh schema");
    Some(store)
}

/// A migrated store on a fresh schema.
pub async fn store() -> Option<PgStore> {
    store_with(8).await
}
