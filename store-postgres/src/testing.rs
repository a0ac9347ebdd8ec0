//! Test support: a migrated store on a fresh, uniquely named schema, so each test (and
//! each conformance contract) starts from an empty database of its own.

use crate::{PgConfig, PgStore};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The environment variable the test helpers read the database URL from.
pub const DATABASE_URL_VAR: &str = "KEEL_TEST_DATABASE_URL";

/// How long a test schema is kept before a later test run drops it.
const STALE_AFTER_SECS: u64 = 3_600;

fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A schema name no other test or test process uses (`keel_t_<unix secs>_<pid>_<n>`).
pub fn unique_schema() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("keel_t_{}_{}_{}", unix_secs(), std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Drops test schemas (named by [`unique_schema`]) older than an hour, once per process,
/// so repeated test runs do not fill the test database. Failures are ignored: this is
/// housekeeping, not part of any test.
async fn drop_stale_schemas(store: &PgStore) {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.swap(true, Ordering::SeqCst) {
        return;
    }
    let Ok(c) = store.client().await else { return };
    let cutoff = (unix_secs().saturating_sub(STALE_AFTER_SECS)) as i64;
    let Ok(rows) = c
        .query(
            "SELECT nspname::text FROM pg_namespace \
             WHERE nspname ~ '^keel_t_[0-9]{9,12}_[0-9]+_[0-9]+$' \
               AND split_part(nspname, '_', 3)::int8 < $1",
            &[&cutoff],
        )
        .await
    else {
        return;
    };
    for r in rows {
        let Ok(name) = r.try_get::<_, String>(0) else { continue };
        let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE")).await;
    }
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
    drop_stale_schemas(&store).await;
    Some(store)
}

/// [`fresh_schema_with`] with a small pool (4 connections).
pub async fn fresh_schema() -> Option<PgStore> {
    fresh_schema_with(4).await
}
