//! Moving instances to a new version of their chart, page by page, with a dry run.
//!
//! ```
//! # use keel_core::chart::{Definition, Migration};
//! # use keel_core::instance::NewInstance;
//! # use keel_core::MachineRef;
//! # use keel_scheduler::{Client, SystemClock};
//! # use std::sync::Arc;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let store = Arc::new(keel_testkit::memory::MemoryStore::new());
//! # let client = Client::new(store, SystemClock);
//! let v1 = Definition::builder("order", 1).initial("cart")
//!     .state("cart", |s| s.on_to("PAY", "paid")).final_state("paid").build()?;
//! let v2 = Definition::builder("order", 2).initial("basket")
//!     .state("basket", |s| s.on_to("PAY", "paid")).final_state("paid").build()?;
//! client.start(NewInstance::new(MachineRef::new("order", 1), r#"["cart"]"#)).await?;
//!
//! let migration = Migration::new(v1, v2)?.map("cart", "basket")?;
//! let report = client.migrate(migration.clone()).dry_run().await?; // what would move where
//! assert_eq!(report.moved(), 1);
//! println!("{report}");
//! let report = client.migrate(migration).apply().await?;           // move them
//! assert_eq!((report.moved(), report.refusals()), (1, 0));
//! # Ok(())
//! # }
//! ```
//!
//! Each page is one store call over at most [`Migrate::batch`] instances, locked and moved
//! in one transaction, fenced like a commit: an instance running a step is left alone (a
//! later run moves it), and one that moved or finished meanwhile is skipped.

use crate::client::Client;
use keel_core::chart::Migration;
use keel_core::ports::store::MigrateParams;
use keel_core::ports::{Clock, Store};
use keel_core::{InstanceId, StoreError, StoreResult, limits};
use std::collections::BTreeMap;
use std::fmt;

/// The default page size of a migration.
pub const MIGRATE_BATCH_DEFAULT: usize = 500;

/// A migration about to run: choose a namespace or page size, then
/// [`dry_run`](Migrate::dry_run) or [`apply`](Migrate::apply).
pub struct Migrate<'a, S: Store, C: Clock> {
    client: &'a Client<S, C>,
    migration: Migration,
    namespace: Option<String>,
    batch: usize,
}

/// A paged bulk operation (a migration, an operator's purge or retry) that a store error
/// stopped part way: what the pages before the error did, which stays done, and the error.
#[derive(Debug)]
pub struct Stopped<T> {
    /// What was done before the error (for a migration, applied unless a dry run).
    pub done: T,
    /// The store's error.
    pub error: StoreError,
}

/// What a migration did (or, in a dry run, would do), summed over every page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Whether this was a dry run (nothing written).
    pub dry_run: bool,
    /// Instances moved (or that would move), per (old configuration, new configuration).
    pub moves: BTreeMap<(String, String), usize>,
    /// Instances refused, per (old configuration, reason).
    pub refused: BTreeMap<(String, String), usize>,
    /// Instances left alone because a step was running (a later run moves them).
    pub busy: usize,
    /// Timers that keep their due time.
    pub timers_kept: usize,
    /// Timers dropped.
    pub timers_dropped: usize,
    /// Timers armed from now.
    pub timers_armed: usize,
}

impl MigrationReport {
    /// Instances moved (or that would move).
    pub fn moved(&self) -> usize {
        self.moves.values().sum()
    }

    /// Instances refused (not counting busy ones).
    pub fn refusals(&self) -> usize {
        self.refused.values().sum()
    }
}

impl fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.dry_run { "would move" } else { "moved" };
        writeln!(f, "{verb} {} instance(s):", self.moved())?;
        for ((old, new), n) in &self.moves {
            writeln!(f, "  {n:>6}  {old} -> {new}")?;
        }
        if !self.refused.is_empty() {
            writeln!(f, "refused {} instance(s):", self.refusals())?;
            for ((old, why), n) in &self.refused {
                writeln!(f, "  {n:>6}  {old}: {why}")?;
            }
        }
        if self.busy > 0 {
            writeln!(f, "left {} instance(s) running a step; run the migration again", self.busy)?;
        }
        write!(
            f,
            "timers: {} kept, {} dropped, {} armed",
            self.timers_kept, self.timers_dropped, self.timers_armed
        )
    }
}

impl<S: Store, C: Clock> Client<S, C> {
    /// A migration of this store's instances of `migration`'s chart from its old version
    /// to its new one. Nothing moves until [`Migrate::apply`].
    pub fn migrate(&self, migration: Migration) -> Migrate<'_, S, C> {
        Migrate { client: self, migration, namespace: None, batch: MIGRATE_BATCH_DEFAULT }
    }
}

impl<S: Store, C: Clock> Migrate<'_, S, C> {
    /// Only instances of `namespace`.
    #[must_use]
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Instances per page (1 to the store's bound; default [`MIGRATE_BATCH_DEFAULT`]).
    #[must_use]
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.clamp(1, limits::MIGRATE_BATCH_MAX);
        self
    }

    /// Reports what would move where, what would be refused and what would happen to
    /// timers; writes nothing.
    ///
    /// # Errors
    ///
    /// The store's error, if a page fails.
    pub async fn dry_run(self) -> StoreResult<MigrationReport> {
        self.run(true).await.map_err(|stopped| stopped.error)
    }

    /// Moves every instance it can, page by page, each move recorded in the instance's
    /// history.
    ///
    /// # Errors
    ///
    /// The store's error, if a page fails (the pages before it stay applied).
    pub async fn apply(self) -> StoreResult<MigrationReport> {
        self.run(false).await.map_err(|stopped| stopped.error)
    }

    /// [`apply`](Self::apply) (or, with `dry_run`, [`dry_run`](Self::dry_run)), keeping what
    /// the pages before a failing one did: an operator re-running a migration that failed
    /// half way learns how much had already moved.
    ///
    /// # Errors
    ///
    /// [`Stopped`]: the store's error and the report of the pages before it.
    pub async fn run(self, dry_run: bool) -> Result<MigrationReport, Stopped<MigrationReport>> {
        let mut report = MigrationReport { dry_run, ..MigrationReport::default() };
        let mut after: Option<InstanceId> = None;
        // Each page reads past the last id of the one before, so the loop ends.
        loop {
            let params = MigrateParams {
                migration: self.migration.clone(),
                namespace: self.namespace.clone(),
                after,
                limit: self.batch,
                dry_run,
                now: self.client.now(),
            };
            let page = match self.client.store().instance_migrate(params).await {
                Ok(page) => page,
                Err(error) => return Err(Stopped { done: report, error }),
            };
            let read = page.items.len();
            for item in page.items {
                match item.outcome {
                    Ok(moved) => {
                        *report.moves.entry((item.old, moved.new)).or_default() += 1;
                        report.timers_kept += moved.kept;
                        report.timers_dropped += moved.dropped;
                        report.timers_armed += moved.armed;
                    }
                    Err(keel_core::chart::migrate::Refusal::Busy) => report.busy += 1,
                    Err(why) => {
                        *report.refused.entry((item.old, why.to_string())).or_default() += 1;
                    }
                }
            }
            match page.last {
                Some(last) if read == self.batch => after = Some(last),
                _ => return Ok(report),
            }
        }
    }
}
