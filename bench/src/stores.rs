//! The stores a benchmark can run against. Each run gets a fresh, empty store.

use anyhow::Result;
use clap::ValueEnum;
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
}

impl StoreKind {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Sqlite => "sqlite",
        }
    }
}

/// Makes fresh stores of one kind.
pub struct Factory {
    kind: StoreKind,
}

impl Factory {
    /// A factory for `kind` (connecting to its server if it has one).
    #[allow(clippy::unused_async)] // server-backed stores connect here
    pub async fn new(kind: StoreKind) -> Result<Self> {
        Ok(Factory { kind })
    }

    /// What the store is.
    pub fn describe(&self) -> String {
        match self.kind {
            StoreKind::Memory => "in-process, no durability".to_owned(),
            StoreKind::Sqlite => {
                "a fresh temporary file per run, WAL, synchronous = FULL".to_owned()
            }
        }
    }

    /// A fresh in-memory store.
    #[allow(clippy::unused_async)] // async like every other store constructor, for `with_store!`
    pub async fn memory(&self) -> Result<Arc<MemoryStore>> {
        Ok(Arc::new(MemoryStore::new()))
    }

    /// A fresh SQLite store in a temporary file.
    pub async fn sqlite(&self) -> Result<Arc<SqliteStore>> {
        Ok(Arc::new(SqliteStore::temporary().await?))
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
        }
    };
}

impl Factory {
    /// The kind.
    pub fn kind(&self) -> StoreKind {
        self.kind
    }
}
