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

    /// A fresh, migrated PostgreSQL schema. The caller drops it with
    /// [`Scratch::drop_schema`] on every path, failures included (`with_store!` does);
    /// a `Scratch` dropped without it names the schema it left on the server.
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
/// generic code, monomorphised once per store type). On PostgreSQL the body runs as an
/// async block, so its `?` and `bail!` end the block, not the scenario: the schema is
/// dropped whether the body succeeds or fails, and the error is returned after.
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
                let out = async { ::anyhow::Ok($body) }.await;
                scratch.drop_schema().await;
                out?
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

/// A benchmark's Postgres schema, to be dropped with [`Scratch::drop_schema`] when the run
/// is over, whether it succeeded or failed (dropping needs the async client, which `Drop`
/// cannot wait for). Dropped without it (a panic), it prints the schema it leaves behind.
pub struct Scratch(Option<(Arc<PgStore>, String)>);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some((_, schema)) = self.0.take() {
            eprintln!(
                "keel-bench: schema {schema} was left on the server; drop it with DROP SCHEMA \"{schema}\" CASCADE"
            );
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::{Factory, StoreKind};

    fn fails() -> anyhow::Result<()> {
        anyhow::bail!("the scenario failed")
    }

    /// The benchmark schemas of this process left on the server.
    async fn left(factory: &Factory) -> anyhow::Result<i64> {
        let (store, scratch) = factory.postgres().await?;
        let pattern = format!("keel\\_bench\\_{}\\_%", std::process::id());
        let row = store
            .client()
            .await?
            .query_one("SELECT count(*) FROM pg_namespace WHERE nspname LIKE $1", &[&pattern])
            .await?;
        scratch.drop_schema().await;
        // Less the one just made to ask.
        Ok(row.get::<_, i64>(0) - 1)
    }

    /// A scenario that fails half-way on PostgreSQL returns its error and leaves no schema
    /// behind.
    #[tokio::test]
    async fn a_failing_scenario_still_drops_its_schema() -> anyhow::Result<()> {
        let Ok(factory) = Factory::new(StoreKind::Postgres).await else {
            let required = std::env::var("KEEL_REQUIRE_BACKENDS").is_ok_and(|v| v == "1");
            assert!(!required, "KEEL_REQUIRE_BACKENDS=1 but KEEL_TEST_DATABASE_URL is unset");
            eprintln!(
                "SKIPPED a_failing_scenario_still_drops_its_schema: set KEEL_TEST_DATABASE_URL"
            );
            return Ok(());
        };
        let before = left(&factory).await?;
        let outcome: anyhow::Result<u8> = async {
            Ok(with_store!(factory, |store| {
                let _ = &store;
                fails()?;
                1u8
            }))
        }
        .await;
        assert_eq!(outcome.unwrap_err().to_string(), "the scenario failed");
        assert_eq!(left(&factory).await?, before, "the failed scenario's schema is gone");
        Ok(())
    }
}
