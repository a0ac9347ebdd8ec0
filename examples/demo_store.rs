//! Which store an example runs on: PostgreSQL when `KEEL_DATABASE_URL` is set (schema
//! `KEEL_DATABASE_SCHEMA`, default `keel_demo`), the in-memory store with `--memory`, and
//! otherwise SQLite in `./keel-demo.db` (override the path with `KEEL_DEMO_DB`) — durable,
//! embedded, nothing to install. Kill an example half-way and run it again: it resumes
//! from the file. `--help` prints the usage; any other argument is refused by name, so a typo
//! never runs an example on the file unasked.

use keel::{ConnectOptions, Keel};

/// What an example's command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Args {
    /// No argument: the durable store (SQLite, or PostgreSQL when `KEEL_DATABASE_URL` is set).
    Durable,
    /// `--memory`: the in-memory store.
    Memory,
    /// `--help` or `-h`: the usage, and nothing run.
    Help,
}

/// The usage example `name` prints for `--help` and after a wrong argument.
pub fn usage(name: &str) -> String {
    format!("usage: cargo run --example {name} [-- --memory]\n\n{USAGE_BODY}")
}

const USAGE_BODY: &str = "With no argument the example keeps its state in ./keel-demo.db (SQLite; KEEL_DEMO_DB\n\
    names another file), or on PostgreSQL when KEEL_DATABASE_URL is set (schema\n\
    KEEL_DATABASE_SCHEMA, default keel_demo). --memory runs it on the in-memory store.";

/// Reads an example's arguments (without the program name). A wrong one is an error that
/// names it, so a typo such as `--memroy` never runs the example on the file instead.
pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut chosen = Args::Durable;
    for arg in args {
        match arg.as_str() {
            "--memory" => chosen = Args::Memory,
            "--help" | "-h" => return Ok(Args::Help),
            other => {
                return Err(format!(
                    "unknown argument `{other}`: the examples take only `--memory` (or none)"
                ));
            }
        }
    }
    Ok(chosen)
}

/// Opens the store the command line and the environment ask for, and a line describing
/// it for the example's banner. `--help` prints the usage and exits; a wrong argument
/// prints what was wrong and the usage, and exits with status 2.
pub async fn connect() -> Result<(Keel, String), keel::Error> {
    let mut argv = std::env::args();
    let name = argv
        .next()
        .and_then(|p| {
            std::path::Path::new(&p).file_stem().map(|s| s.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "<name>".to_owned());
    let args = match parse_args(argv) {
        Ok(Args::Help) => {
            println!("{}", usage(&name));
            std::process::exit(0);
        }
        Ok(args) => args,
        Err(wrong) => {
            eprintln!("{wrong}\n\n{}", usage(&name));
            std::process::exit(2);
        }
    };
    if args == Args::Memory {
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

#[cfg(test)]
mod tests {
    use super::{Args, parse_args};

    fn parse(args: &[&str]) -> Result<Args, String> {
        parse_args(args.iter().map(|a| (*a).to_owned()))
    }

    #[test]
    fn the_examples_take_memory_help_or_nothing() {
        assert_eq!(parse(&[]), Ok(Args::Durable));
        assert_eq!(parse(&["--memory"]), Ok(Args::Memory));
        assert_eq!(parse(&["--memory", "--help"]), Ok(Args::Help));
        assert_eq!(parse(&["-h"]), Ok(Args::Help));
    }

    #[test]
    fn a_wrong_argument_is_named_instead_of_running_on_the_file() {
        let wrong = parse(&["--memroy"]).expect_err("a typo must not run the example");
        assert!(wrong.contains("`--memroy`") && wrong.contains("--memory"), "{wrong}");
    }
}
