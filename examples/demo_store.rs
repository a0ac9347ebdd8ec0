//! Which store an example runs on: PostgreSQL when `KEEL_DATABASE_URL` is set (schema
//! `KEEL_DATABASE_SCHEMA`, default `keel_demo`), the in-memory store with `--memory`, and
//! otherwise SQLite in `./keel-demo.db` (override the path with `KEEL_DEMO_DB`) — durable,
//! embedded, nothing to install. Kill an example half-way and run it again: it resumes
//! from the file.

use keel::{ConnectOptions, Keel};

/// Opens the store the command line and the environment ask for, and a line describing
/// it for the example's banner.
pub async fn connect() -> Result<(Keel, String), keel::Error> {
    if std::env::args().any(|a| a == "--memory") {
        let keel = Keel::connect("memory://").await?;
        return Ok((keel, "in-memory (--memory: nothing survives the process)".to_owned()));
    }
    if let Some(url) = std::env::var("KEEL_DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        let schema =
            std::env::var("KEEL_DATABASE_SCHEMA").unwrap_or_else(|_| "keel_demo".to_owned());
        let keel = Keel::connect_with(&url, ConnectOptions::default().schema(schema)).await?;
        let described = format!("{} (drop the schema to start over)", keel.describe());
        return Ok((keel, described));
    }
    let path = std::env::var("KEEL_DEMO_DB").unwrap_or_else(|_| "keel-demo.db".to_owned());
    let keel = Keel::connect(&format!("sqlite://{path}")).await?;
    let described = format!(
        "{} (durable; kill me and run me again to resume, delete the file to start over)",
        keel.describe()
    );
    Ok((keel, described))
}
