//! Shared test setup: a store on a fresh schema, or `None` (skip, saying so) when
//! `KEEL_TEST_DATABASE_URL` is unset — unless `KEEL_REQUIRE_BACKENDS=1`, which fails.

#![allow(dead_code)]

use keel_store_postgres::PgStore;
use keel_store_postgres::testing;

/// The test database URL, or `None` after printing why the test is skipped.
pub fn database_url() -> Option<String> {
    let url = testing::database_url();
    if url.is_none() {
        assert!(
            std::env::var("KEEL_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset; set it to run this test"
        );
        keel_testkit::conformance::skip_notice(
            "SKIPPED: a Postgres test: KEEL_TEST_DATABASE_URL is unset",
        );
    }
    url
}

/// A schema name no other test (or test process) uses.
pub fn fresh_schema() -> String {
    testing::unique_schema()
}

/// A migrated store on a fresh schema, with `pool_size` connections.
pub async fn store_with(pool_size: usize) -> Option<PgStore> {
    database_url()?;
    testing::fresh_schema_with(pool_size).await
}

/// A migrated store on a fresh schema.
pub async fn store() -> Option<PgStore> {
    store_with(8).await
}

/// Waits until some backend waits for a lock `pid` holds.
pub async fn until_blocked_by(c: &deadpool_postgres::Client, pid: i32) {
    for _ in 0..500 {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                &[&pid],
            )
            .await
            .unwrap()
            .get(0);
        if n > 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("nothing waited for backend {pid}");
}
