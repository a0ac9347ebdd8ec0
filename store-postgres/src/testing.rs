//! Test support: a migrated store on a fresh, uniquely named schema, so each test (and
//! each conformance contract) starts from an empty database of its own.

use crate::{PgConfig, PgStore};
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable the test helpers read the database URL from.
pub const DATABASE_URL_VAR: &str = "KEEL_TEST_DATABASE_URL";

/// A schema name no other test or test process uses (`keel_t_<pid>_<time>_<n>`).
pub fn unique_schema() -> String {
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

/// The test database URL from [`DATABASE_URL_VAR`], if set and non-empty.
pub fn database_url() -> Option<String> {
    std::env::var(DATABASE_URL_VAR).ok().filter(|u| !u.is_empty())
}

/// A migrated store on a fresh schema with `pool_size` connections; `None` when
/// [`DATABASE_URL_VAR`] is unset. Panics when the database is configured but unusable, so
/// a broken setup is not mistaken for a skipped backend.
pub async fn fresh_schema_with(pool_size: usize) -> Option<PgStore> {
    let url = database_url()?;
    let config = PgConfig::new(url).schema(unique_schema()).pool_size(pool_size);
    let store = PgStore::connect(config).await.expect("connect to the test database");
    store.migrate().await.expect("migrate a fresh schema");
    Some(store)
}

/// [`fresh_schema_with`] with a small pool (4 connections).
pub async fn fresh_schema() -> Option<PgStore> {
    fresh_schema_with(4).await
}
