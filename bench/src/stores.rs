//! The stores a benchmark can run against. Each run gets a fresh, empty store.

use anyhow::Result;
use clap::ValueEnum;
use keel_store_postgres::{PgConfig, PgStore};
use keel_store_sqlite::SqliteStore;
use keel_testkit::MemoryStore;
use std::sync::Arc;

/// Which store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// The in-memory reference store.
    Memory,
    /// SQLite in a temporary file (WAL, synchronous = FULL).
    Sqlite,
    /// PostgreSQL at `KEEL_BENCH_DATABASE_URL` (or `KEEL_TEST_DATABASE_URL`), a fresh
    /// schema per run, dropped afterwards. Over a plain connection unless the URL names an
    /// `sslmode`: the figures compare with other engines on the same local server.
    Postgres,
}

impl StoreKind {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Sqlite => "sqlite",
            StoreKind::Postgres => "postgres",
        }
    }
}

/// Makes fresh stores of one kind.
pub struct Factory {
    kind: StoreKind,
    url: Option<String>,
}

impl Factory {
    /// A factory for `kind` (connecting to its server if it has one).
    #[allow(clippy::unused_async)] // kept async: a server check may move here
    pub async fn new(kind: StoreKind) -> Result<Self> {
        let url = ["KEEL_BENCH_DATABASE_URL", "KEEL_TEST_DATABASE_URL"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()));
        if kind == StoreKind::Postgres && url.is_none() {
            anyhow::bail!(
                "--store postgres needs KEEL_BENCH_DATABASE_URL or KEEL_TEST_DATABASE_URL"
            );
        }
        // The store would take TLS where the server offers it (its default); a local
        // benchmark measures the engine, so it connects plainly unless told otherwise.
        Ok(Factory { kind, url: url.map(|u| plain_unless_told(&u)) })
    }

    /// What the store is.
    pub fn describe(&self) -> String {
        match self.kind {
            StoreKind::Memory => "in-process, no durability".to_owned(),
            StoreKind::Sqlite => {
                "a fresh temporary file per run, WAL, synchronous = FULL".to_owned()
            }
            StoreKind::Postgres => {
                "a fresh schema per run on the local server, pool of 16, no TLS unless the \
                 URL's sslmode asks for it"
                    .to_owned()
            }
        }
    }

    /// A fresh in-memory store.
    #[allow(clippy::unused_async)] // async like every other store constructor, for `with_store!`
    pub async fn memory(&self) -> Result<Arc<MemoryStore>> {
        Ok(Arc::new(MemoryStore::new()))
    }

    /// A fresh, migrated PostgreSQL schema (dropped when the `Scratch` guard drops).
    pub async fn postgres(&self) -> Result<(Arc<PgStore>, Scratch)> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let url = self.url.clone().expect("checked in new");
        let schema = format!(
            "keel_bench_{}_{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let store = PgStore::connect(PgConfig::new(named(&url)).schema(schema.clone())).await?;
        store.migrate().await?;
        let store = Arc::new(store);
        Ok((Arc::clone(&store), Scratch(Some((store, schema)))))
    }

    /// A fresh SQLite store in a temporary file.
    pub async fn sqlite(&self) -> Result<Arc<SqliteStore>> {
        Ok(Arc::new(SqliteStore::temporary().await?))
    }
}

/// The `application_name` of this process's benchmark sessions, so a scenario can tell
/// them from other sessions on a shared server (`pg_stat_activity`).
pub fn application_name() -> String {
    format!("keel-bench-{}", std::process::id())
}

/// `url` with `sslmode=disable`, unless it names an `sslmode` already.
fn plain_unless_told(url: &str) -> String {
    if url.contains("sslmode") {
        url.to_owned()
    } else if url.contains("://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}sslmode=disable")
    } else {
        format!("{url} sslmode=disable")
    }
}

/// `url` with [`application_name`], unless it names one already.
fn named(url: &str) -> String {
    if url.contains("application_name") {
        url.to_owned()
    } else if url.contains("://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}application_name={}", application_name())
    } else {
        format!("{url} application_name={}", application_name())
    }
}

/// Runs `$body` with `$store` bound to a fresh store of the factory's kind (the body is
/// generic code, monomorphised once per store type).
#[macro_export]
macro_rules! with_store {
    ($factory:expr, |$store:ident| $body:expr) => {
        match $factory.kind() {
            $crate::stores::StoreKind::Memory => {
                let $store = $factory.memory().await?;
                $body
            }
            $crate::stores::StoreKind::Sqlite => {
                let $store = $factory.sqlite().await?;
                $body
            }
            $crate::stores::StoreKind::Postgres => {
                let ($store, scratch) = $factory.postgres().await?;
                let out = $body;
                scratch.drop_schema().await;
                out
            }
        }
    };
}

impl Factory {
    /// The kind.
    pub fn kind(&self) -> StoreKind {
        self.kind
    }
}

/// Drops a benchmark's Postgres schema when the run is over.
pub struct Scratch(Option<(Arc<PgStore>, String)>);

impl Scratch {
    /// Drops the schema (errors are reported, not fatal: the data is disposable).
    pub async fn drop_schema(mut self) {
        if let Some((store, schema)) = self.0.take() {
            let dropped = match store.client().await {
                Ok(c) => c
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = dropped {
                eprintln!("keel-bench: could not drop schema {schema}: {e}");
            }
        }
    }
}
