//! Which store an example runs on: PostgreSQL when `KEEL_DATABASE_URL` is set (schema
//! `KEEL_DATABASE_SCHEMA`, default `keel_demo`), the
//! in-memory store with `--memory`, and otherwise SQLite in `./keel-demo.db` (override the
//! path with `KEEL_DEMO_DB`) — durable, embedded, nothing to install. Kill an example
//! half-way and run it again: it resumes from the file.

use keel_store_postgres::{PgConfig, PgStore};
use keel_store_sqlite::SqliteStore;
use keel_testkit::MemoryStore;
use std::sync::Arc;

/// The store an example was asked to use.
pub enum DemoStore {
    /// In memory (`--memory`): nothing survives the process.
    Memory(Arc<MemoryStore>),
    /// SQLite in a file.
    Sqlite(Arc<SqliteStore>, String),
    /// PostgreSQL (`KEEL_DATABASE_URL`, schema `KEEL_DATABASE_SCHEMA` or `keel_demo`).
    Postgres(Arc<PgStore>, String),
}

impl DemoStore {
    /// Picks the store from the command line and the environment.
    pub async fn from_env() -> Result<Self, String> {
        if std::env::args().any(|a| a == "--memory") {
            return Ok(DemoStore::Memory(Arc::new(MemoryStore::new())));
        }
        if let Some(url) = std::env::var("KEEL_DATABASE_URL").ok().filter(|u| !u.is_empty()) {
            let schema =
                std::env::var("KEEL_DATABASE_SCHEMA").unwrap_or_else(|_| "keel_demo".to_owned());
            let store = PgStore::connect(PgConfig::new(url).schema(schema.clone()))
                .await
                .map_err(|e| format!("connecting to KEEL_DATABASE_URL: {e}"))?;
            store.migrate().await.map_err(|e| format!("migrating schema {schema}: {e}"))?;
            return Ok(DemoStore::Postgres(Arc::new(store), schema));
        }
        let path = std::env::var("KEEL_DEMO_DB").unwrap_or_else(|_| "keel-demo.db".to_owned());
        let store = SqliteStore::open(&path).await.map_err(|e| format!("opening {path}: {e}"))?;
        Ok(DemoStore::Sqlite(Arc::new(store), path))
    }

    /// A one-line description for the example's banner.
    pub fn describe(&self) -> String {
        match self {
            DemoStore::Memory(_) => "in-memory (--memory: nothing survives the process)".to_owned(),
            DemoStore::Postgres(_, schema) => {
                format!(
                    "PostgreSQL, schema {schema} (KEEL_DATABASE_URL; drop the schema to start over)"
                )
            }
            DemoStore::Sqlite(_, path) => {
                format!(
                    "SQLite file {path} (durable; kill me and run me again to resume, delete the file to start over)"
                )
            }
        }
    }
}

/// Runs `$body` with `$store` bound to the chosen store's `Arc` (the body is generic code,
/// compiled once per store type).
#[macro_export]
macro_rules! on_demo_store {
    ($demo:expr, |$store:ident| $body:expr) => {
        match $demo {
            $crate::demo_store::DemoStore::Memory($store) => $body,
            $crate::demo_store::DemoStore::Sqlite($store, _) => $body,
            $crate::demo_store::DemoStore::Postgres($store, _) => $body,
        }
    };
}
