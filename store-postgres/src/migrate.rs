//! Schema migrations: versioned SQL files under `store-postgres/migrations/`, embedded at
//! build time and applied by `refinery` under a session advisory lock, so two workers
//! starting together apply them once. A database whose schema is newer than this build is
//! refused.

use crate::PgStore;
use crate::error::pg;
use keel_core::{ErrorKind, StoreError, StoreResult};

refinery::embed_migrations!("migrations");

/// The newest schema version this build knows (the highest `V<n>__` migration).
pub const SCHEMA_VERSION: i32 = 13;

/// The table refinery records applied migrations in (inside the store's schema).
const HISTORY_TABLE: &str = "keel_schema_history";

impl PgStore {
    /// Creates the schema if it is missing and applies pending migrations. Safe to call from
    /// many processes at once: the run holds a session advisory lock keyed by the schema
    /// name (a run that finds it taken logs that it waits). A role that owns an existing
    /// schema needs no CREATE privilege on the database.
    /// Fails with `Invalid` when the database was migrated by a newer build (a deployment
    /// problem: upgrade Keel), with `Conflict` when the schema's recorded migrations differ
    /// from this build's, and with `Unavailable` when the connection or the server failed
    /// mid-run (an unfinished step is rolled back: run it again).
    pub async fn migrate(&self) -> StoreResult<()> {
        let (mut client, conn) = self.pg.connect(self.tls.clone()).await.map_err(|e| pg(&e))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let result = self.migrate_on(&mut client).await;
        drop(client);
        let _ = driver.await;
        result
    }

    /// The schema's version: the newest migration applied to it, or `None` when it holds
    /// no Keel tables yet.
    pub async fn schema_version(&self) -> StoreResult<Option<i32>> {
        let client = self.client().await?;
        applied_version(&client, &self.schema).await
    }

    /// Checks, without changing anything, that the schema is at this build's version: for
    /// a process that leaves migrating to someone else (an operator's tool, a deploy step).
    /// A schema with no Keel tables, or an older one, is `Invalid` and says to run
    /// `keel migrate`; a newer one is `Invalid` too, saying to upgrade Keel, as for
    /// [`migrate`](Self::migrate).
    pub async fn check_migrated(&self) -> StoreResult<()> {
        match self.schema_version().await? {
            None => Err(StoreError::invalid(format!(
                "schema {:?} holds no Keel tables: nothing was migrated into it; run `keel \
                 migrate` against this database (or connect with migrations on) first",
                self.schema
            ))),
            Some(v) if v < SCHEMA_VERSION => Err(StoreError::invalid(format!(
                "schema {:?} is at version {v}, older than this build's {SCHEMA_VERSION}; run \
                 `keel migrate` against this database (or connect with migrations on) to bring \
                 it up to date",
                self.schema
            ))),
            Some(v) if v > SCHEMA_VERSION => Err(newer(&self.schema, v)),
            Some(_) => Ok(()),
        }
    }

    async fn migrate_on(&self, client: &mut tokio_postgres::Client) -> StoreResult<()> {
        let key = format!("keel.migrate.{}", self.schema);
        let took: bool = client
            .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&key])
            .await
            .map_err(|e| pg(&e))?
            .try_get(0)
            .map_err(|e| pg(&e))?;
        if !took {
            // Another process is migrating this schema (or died holding the lock on a
            // connection the server has not yet closed): say why start-up pauses.
            tracing::info!(
                schema = %self.schema,
                "waiting for another process's migration of schema {:?}",
                self.schema
            );
            client
                .execute("SELECT pg_advisory_lock(hashtext($1))", &[&key])
                .await
                .map_err(|e| pg(&e))?;
        }
        let result = self.migrate_locked(client).await;
        let unlock = client.execute("SELECT pg_advisory_unlock(hashtext($1))", &[&key]).await;
        result?;
        unlock.map_err(|e| pg(&e))?;
        Ok(())
    }

    async fn migrate_locked(&self, client: &mut tokio_postgres::Client) -> StoreResult<()> {
        // The schema is created only when missing: `CREATE SCHEMA IF NOT EXISTS` needs the
        // CREATE privilege on the database even when the schema exists, which a role that
        // owns its schema but nothing else lacks. The name is compared as stored (no
        // identifier parsing), and `check_schema` allows only lowercase letters, digits and
        // `_`, so the quoted name below is the same one.
        let present: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
                &[&self.schema],
            )
            .await
            .map_err(|e| pg(&e))?
            .try_get(0)
            .map_err(|e| pg(&e))?;
        if !present {
            client
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{}\"", self.schema))
                .await
                .map_err(|e| pg(&e))?;
        }
        if let Some(v) = applied_version(client, &self.schema).await?
            && v > SCHEMA_VERSION
        {
            return Err(newer(&self.schema, v));
        }
        let mut runner = migrations::runner().set_abort_divergent(true).set_abort_missing(true);
        runner.set_migration_table_name(HISTORY_TABLE);
        runner.run_async(client).await.map_err(|e| runner_error(&self.schema, &e))?;
        Ok(())
    }
}

/// The newest migration applied to `schema`, or `None` when it has no history table (no
/// Keel tables yet).
async fn applied_version(
    client: &tokio_postgres::Client,
    schema: &str,
) -> StoreResult<Option<i32>> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL",
            &[&schema, &HISTORY_TABLE],
        )
        .await
        .map_err(|e| pg(&e))?
        .try_get(0)
        .map_err(|e| pg(&e))?;
    if !exists {
        return Ok(None);
    }
    client
        .query_one(&format!("SELECT max(version) FROM \"{schema}\".{HISTORY_TABLE}"), &[])
        .await
        .map_err(|e| pg(&e))?
        .try_get(0)
        .map_err(|e| pg(&e))
}

/// How deep [`driver_cause`] looks through an error's causes: refinery wraps a driver
/// error once or twice, so this is ample.
const MAX_CAUSES: usize = 8;

/// The driver error behind a migration runner's error, if one is.
fn driver_cause(e: &refinery::Error) -> Option<&tokio_postgres::Error> {
    let mut cause = std::error::Error::source(e);
    for _ in 0..MAX_CAUSES {
        let current = cause?;
        if let Some(pg) = current.downcast_ref::<tokio_postgres::Error>() {
            return Some(pg);
        }
        cause = current.source();
    }
    None
}

/// Converts the migration runner's error. A driver error (a dropped connection, a restart,
/// a refused statement) keeps the kind the store gives any driver error, so a connection
/// lost mid-run is `Unavailable`; the runner's own refusals (the schema's recorded
/// migrations differ from this build's) are `Conflict`.
fn runner_error(schema: &str, e: &refinery::Error) -> StoreError {
    let step = match e.kind() {
        refinery::error::Kind::Connection(step, _) => step.as_str(),
        _ => "running the migrations",
    };
    if let Some(driver) = driver_cause(e) {
        let cause = pg(driver);
        let advice = match cause.kind {
            ErrorKind::Unavailable => {
                "the connection or the server failed mid-run and the unfinished step was rolled \
                 back; run the migration again"
            }
            _ => {
                "the server refused a migration step; fix what it names (for example the role's \
                 privileges on the schema) and run the migration again"
            }
        };
        return StoreError::new(
            cause.kind,
            format!("migrating schema {schema:?}: {step}: {}; {advice}", cause.message),
        );
    }
    match e.kind() {
        refinery::error::Kind::DivergentVersion(..) | refinery::error::Kind::MissingVersion(_) => {
            StoreError::conflict(format!(
                "migrating schema {schema:?}: {e}; the migrations recorded in its \
                 {HISTORY_TABLE} table differ from this build's: it was migrated by another \
                 build of Keel or the table was edited; run the build that migrated it, or \
                 point this one at a fresh schema"
            ))
        }
        // The build's own migrations are malformed: retrying will not help.
        _ => StoreError::conflict(format!("migrating schema {schema:?}: {e}")),
    }
}

/// The refusal of a schema migrated by a newer build.
fn newer(schema: &str, version: i32) -> StoreError {
    StoreError::invalid(format!(
        "schema {schema:?} is at version {version}, newer than this build's {SCHEMA_VERSION}; \
         upgrade keel before running it against this database"
    ))
}

#[cfg(test)]
mod tests {
    use super::runner_error;
    use keel_core::ErrorKind;
    use refinery::error::WrapMigrationError;

    /// A driver error from a connection nothing accepts (no server needed).
    async fn refused() -> tokio_postgres::Error {
        // Nothing listens on port 1 of the loopback.
        let Err(e) =
            tokio_postgres::connect("host=127.0.0.1 port=1 user=keel", tokio_postgres::NoTls).await
        else {
            panic!("nothing listens on port 1");
        };
        e
    }

    /// A connection lost mid-run is retryable, however deep the runner wraps it.
    #[tokio::test]
    async fn a_driver_failure_while_migrating_is_retryable() {
        let once = Err::<(), _>(refused().await).migration_err("error applying migrations", None);
        let once = once.expect_err("wrapped");
        let e = runner_error("keel", &once);
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(e.message.contains("error applying migrations"), "{e}");
        assert!(e.message.contains("run the migration again"), "{e}");

        let inner = Err::<(), _>(refused().await)
            .migration_err("error getting applied migrations", None)
            .expect_err("wrapped");
        let twice = Err::<(), _>(inner)
            .migration_err("error getting current schema version", None)
            .expect_err("wrapped");
        let e = runner_error("keel", &twice);
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    }

    /// The runner's own refusal, with no driver error behind it, stays `Conflict`.
    #[test]
    fn a_refusal_by_the_runner_is_a_conflict() {
        let e = refinery::Migration::unapplied("not a migration name", "SELECT 1")
            .expect_err("a bad name is refused");
        let e = runner_error("keel", &e);
        assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
        assert!(e.message.contains("migration name"), "{e}");
    }
}
