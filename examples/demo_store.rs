//! Which store an example runs on: PostgreSQL when `KEEL_DATABASE_URL` is set (schema
//! `KEEL_SCHEMA`, default `keel_demo`), the in-memory store with `--memory`, and
//! otherwise SQLite in `./keel-demo.db` (override the path with `KEEL_DEMO_DB`) — durable,
//! embedded, nothing to install. Kill an example half-way and run it again: it resumes
//! from the file. `--help` prints the usage; any other argument is refused by name, so a
//! typo never runs an example on the file unasked.

use clap::Parser;
use keel::{ConnectOptions, Keel};

/// What an example's command line asks for.
#[derive(Debug, Parser)]
#[command(
    about = "A Keel example. With no argument it keeps its state in ./keel-demo.db (SQLite; \
             KEEL_DEMO_DB names another file), or on PostgreSQL when KEEL_DATABASE_URL is set \
             (schema KEEL_SCHEMA, default keel_demo)."
)]
pub struct Args {
    /// Run on the in-memory store: nothing survives the process.
    #[arg(long)]
    pub memory: bool,
}

/// Opens the store the command line and the environment ask for, and a line describing
/// it for the example's banner. `--help` prints the usage and exits; a wrong argument
/// prints what was wrong and the usage, and exits with status 2.
pub async fn connect() -> Result<(Keel, String), keel::Error> {
    let args = Args::parse();
    if args.memory {
        let keel = Keel::connect("memory://").await?;
        return Ok((keel, "in-memory (--memory: nothing survives the process)".to_owned()));
    }
    if let Some(url) = std::env::var("KEEL_DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        let schema = std::env::var("KEEL_SCHEMA").unwrap_or_else(|_| "keel_demo".to_owned());
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

#[cfg(test)]
mod tests {
    use super::Args;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("order").chain(args.iter().copied()))
    }

    #[test]
    fn the_examples_take_memory_help_or_nothing() {
        assert!(!parse(&[]).expect("no argument").memory);
        assert!(parse(&["--memory"]).expect("--memory").memory);
        for help in [&["--memory", "--help"][..], &["-h"]] {
            let e = parse(help).expect_err("help is not a run");
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{e}");
        }
    }

    #[test]
    fn a_wrong_argument_is_named_instead_of_running_on_the_file() {
        let wrong = parse(&["--memroy"]).expect_err("a typo must not run the example");
        let wrong = wrong.to_string();
        assert!(wrong.contains("'--memroy'") && wrong.contains("--memory"), "{wrong}");
    }
}
