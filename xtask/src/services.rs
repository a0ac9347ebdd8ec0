//! Which backend services the tests can use. Each backend suite reads its service URL from
//! an environment variable; `cargo xtask test` fills in the local default when the service
//! answers there, and `cargo xtask ci` requires every backend whose crate exists. PostgreSQL
//! is checked with a real connection (the port answering is not enough: a missing
//! database or a refused login would fail every suite). The dashboard's browser test
//! (`cli/tests/ui.rs`) needs chromium and chromedriver on `PATH`, looked for the same way.

use anyhow::{Result, bail};
use keel_core::redact_url;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One backend the test suites can talk to.
pub struct Backend {
    /// Human name.
    pub name: &'static str,
    /// The crate directory whose tests need it.
    pub crate_dir: &'static str,
    /// The variable the tests read.
    pub env_var: &'static str,
    /// The URL the tests will get, `None` when skipped.
    pub url: Option<String>,
    /// Why it was skipped.
    pub skipped_because: Option<String>,
}

const BACKENDS: [(&str, &str, &str, &str); 3] = [
    (
        "PostgreSQL",
        "store-postgres",
        "KEEL_TEST_DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ),
    ("Redis", "queue-redis", "KEEL_TEST_REDIS_URL", "redis://127.0.0.1:6379"),
    ("SQS (moto)", "queue-sqs", "KEEL_TEST_SQS_ENDPOINT", "http://127.0.0.1:9324"),
];

/// The `host:port` of a service URL (`scheme://[user@]host[:port][/...]`); without a
/// port, the scheme's own (5432, 6379, 80, 443).
pub fn host_port(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hostport = rest.split(['/', '?']).next()?;
    if hostport.is_empty() {
        return None;
    }
    // `host:port` or `[v6]:port` carry a port; `host` and `[v6]` do not.
    let has_port = hostport.rsplit_once(':').is_some_and(|(host, _)| {
        !host.is_empty() && (!hostport.starts_with('[') || host.ends_with(']'))
    });
    if has_port {
        return Some(hostport.to_owned());
    }
    let port = match scheme {
        "postgres" | "postgresql" => 5432,
        "redis" | "rediss" => 6379,
        "http" => 80,
        "https" => 443,
        _ => return Some(hostport.to_owned()),
    };
    Some(format!("{hostport}:{port}"))
}

fn reachable(url: &str) -> bool {
    let Some(hp) = host_port(url) else { return false };
    let Ok(mut addrs) = hp.to_socket_addrs() else { return false };
    addrs.any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
}

/// How long the PostgreSQL probe may take to connect and log in.
const PG_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to PostgreSQL at `url` as the suites do (`PgStore::connect`); the driver's
/// reason when it cannot (no such database, a refused login, not PostgreSQL at all).
fn postgres_usable(url: &str) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("no runtime for the probe: {e}"))?;
    runtime.block_on(async {
        let config = keel_store_postgres::PgConfig::new(url).pool_size(1);
        match tokio::time::timeout(PG_PROBE_TIMEOUT, keel_store_postgres::PgStore::connect(config))
            .await
        {
            Ok(Ok(_store)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer to the login within {PG_PROBE_TIMEOUT:?}")),
        }
    })
}

/// Whether the backend `env_var` serves at `url`: `Err` says why not. PostgreSQL by a real
/// connection alone (its connection string need not name one host and port: the
/// key=value form, a socket directory, several hosts), every other backend by a TCP
/// connect.
fn probe(env_var: &str, url: &str) -> Result<(), String> {
    if env_var == "KEEL_TEST_DATABASE_URL" {
        return postgres_usable(url).map_err(|e| format!("a PostgreSQL connection fails: {e}"));
    }
    if !reachable(url) {
        return Err("nothing answers there".to_owned());
    }
    Ok(())
}

/// Resolves every backend whose crate exists. With `require`, a backend that cannot be
/// reached is an error naming the variable and how to start the service.
pub fn detect(root: &Path, require: bool) -> Result<Vec<Backend>> {
    let mut out = Vec::new();
    for (name, crate_dir, env_var, default_url) in BACKENDS {
        if !root.join(crate_dir).join("Cargo.toml").exists() {
            continue;
        }
        let configured = std::env::var(env_var).ok().filter(|v| !v.is_empty());
        let url = configured.clone().unwrap_or_else(|| default_url.to_owned());
        let mut b = Backend { name, crate_dir, env_var, url: None, skipped_because: None };
        if let Err(problem) = probe(env_var, &url) {
            let shown = redact_url(&url);
            let why = match configured {
                Some(_) => format!("{env_var}={shown}: {problem}"),
                None => format!("{env_var} is unset, and at {shown}: {problem}"),
            };
            if require {
                // The usual cause on a fresh local server: the `test` database is missing.
                let create = if env_var == "KEEL_TEST_DATABASE_URL" {
                    " (a local server without the test database: `createdb -h 127.0.0.1 -U postgres test`)"
                } else {
                    ""
                };
                bail!(
                    "{name} is required but cannot be used: {why}. Start it (see .ci/run){create}, or set {env_var} to one the tests can use."
                );
            }
            b.skipped_because = Some(why);
        } else {
            b.url = Some(url);
        }
        out.push(b);
    }
    Ok(out)
}

/// The first of `names` found as a file in a directory on `PATH` (as `cli/tests/ui.rs`
/// looks for its browser).
fn which(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|name| {
        std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
    })
}

/// Why the dashboard's browser test (`cli/tests/ui.rs`) will skip itself, `None` when it
/// will run. With `require`, a missing browser is an error, as the test makes it.
pub fn browser(require: bool) -> Result<Option<String>> {
    let chromium = which(&["chromium", "chromium-browser", "google-chrome"]);
    let driver = which(&["chromedriver", "chromium-driver"]);
    let missing: Vec<&str> = [(chromium.is_none(), "chromium"), (driver.is_none(), "chromedriver")]
        .into_iter()
        .filter_map(|(missing, name)| missing.then_some(name))
        .collect();
    if missing.is_empty() {
        return Ok(None);
    }
    let why = format!(
        "{} not on PATH (apt-get install -y chromium chromium-driver)",
        missing.join(" and ")
    );
    if require {
        bail!("the dashboard browser test is required but cannot run: {why}");
    }
    Ok(Some(why))
}

/// Prints which backend suites ran and which were skipped, the browser test included
/// (`browser_skipped`: why it skipped itself, from [`browser`]).
pub fn summary(backends: &[Backend], browser_skipped: Option<&str>) {
    for line in summary_lines(backends, browser_skipped) {
        eprintln!("{line}");
    }
}

/// The lines [`summary`] prints. A URL is shown with its password hidden: CI logs keep it.
fn summary_lines(backends: &[Backend], browser_skipped: Option<&str>) -> Vec<String> {
    let mut lines =
        vec!["backend suites:".to_owned(), "  memory (MemoryStore, MemoryQueue): ran".to_owned()];
    for b in backends {
        lines.push(match (&b.url, &b.skipped_because) {
            (Some(url), _) => {
                format!("  {} ({}): ran against {}", b.name, b.crate_dir, redact_url(url))
            }
            (None, why) => format!(
                "  {} ({}): SKIPPED — {}",
                b.name,
                b.crate_dir,
                why.as_deref().unwrap_or("unavailable")
            ),
        });
    }
    if backends.is_empty() {
        lines.push("  (no backend crates in this workspace yet)".to_owned());
    }
    lines.push(match browser_skipped {
        None => "  dashboard browser test (cli/tests/ui.rs): ran".to_owned(),
        Some(why) => format!("  dashboard browser test (cli/tests/ui.rs): SKIPPED — {why}"),
    });
    lines
}

#[cfg(test)]
mod tests {
    use super::{Backend, host_port, probe, summary_lines};

    /// A backend URL carrying a password is printed with the password hidden, as the
    /// skipped line and the error already print it.
    #[test]
    fn the_summary_hides_a_password_in_a_backend_url() {
        let backend = |name, url: &str| Backend {
            name,
            crate_dir: "store-postgres",
            env_var: "KEEL_TEST_DATABASE_URL",
            url: Some(url.to_owned()),
            skipped_because: None,
        };
        let backends = [
            backend("PostgreSQL", "postgres://keel:hunter2@db.local:5432/test"),
            backend("Redis", "redis://:hunter2@127.0.0.1:6379"),
        ];
        let text = summary_lines(&backends, None).join("\n");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(
            text.contains(
                "PostgreSQL (store-postgres): ran against postgres://keel:***@db.local:5432/test"
            ),
            "{text}"
        );
        assert!(text.contains("ran against redis://:***@127.0.0.1:6379"), "{text}");
    }

    #[test]
    fn host_port_of_service_urls() {
        for (url, expected) in [
            ("postgres://postgres@127.0.0.1:5432/test", Some("127.0.0.1:5432")),
            ("redis://127.0.0.1:6379", Some("127.0.0.1:6379")),
            ("http://127.0.0.1:9324", Some("127.0.0.1:9324")),
            ("postgres://u:p@db.local:5433/x?sslmode=disable", Some("db.local:5433")),
            ("postgres://localhost/test", Some("localhost:5432")),
            ("postgresql://u@[::1]/test", Some("[::1]:5432")),
            ("postgres://u@[::1]:5433/test", Some("[::1]:5433")),
            ("redis://localhost", Some("localhost:6379")),
            ("https://sqs.example.com", Some("sqs.example.com:443")),
            ("", None),
        ] {
            assert_eq!(host_port(url).as_deref(), expected, "{url}");
        }
    }

    /// A port that accepts connections and closes them at once: it answers, but it is not
    /// a usable PostgreSQL, and the probe says so rather than reporting the backend as up.
    #[test]
    fn a_port_that_answers_is_not_taken_for_a_working_postgres() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                drop(stream);
            }
        });
        let url = format!("postgres://postgres@127.0.0.1:{port}/test");
        let problem = probe("KEEL_TEST_DATABASE_URL", &url).unwrap_err();
        assert!(problem.contains("a PostgreSQL connection fails"), "{problem}");
        // Other backends are checked by their port alone.
        assert_eq!(probe("KEEL_TEST_REDIS_URL", &format!("redis://127.0.0.1:{port}")), Ok(()));
    }

    /// On a machine with the test database: it passes the probe, and a database that does
    /// not exist on the same server fails it with the server's reason.
    #[test]
    fn a_missing_database_on_a_live_server_fails_the_probe_with_the_reason() {
        let Some(url) = std::env::var("KEEL_TEST_DATABASE_URL").ok().filter(|u| !u.is_empty())
        else {
            return;
        };
        assert_eq!(probe("KEEL_TEST_DATABASE_URL", &url), Ok(()));
        // Another database on the same server, the URL's parameters kept; a connection
        // string in another form is not rewritten.
        let (base, query) = url.split_once('?').map_or((url.as_str(), ""), |(b, q)| (b, q));
        let Some((server, _)) = base
            .split_once("://")
            .filter(|(_, rest)| rest.contains('/'))
            .and_then(|_| base.rsplit_once('/'))
        else {
            return;
        };
        let query = if query.is_empty() { String::new() } else { format!("?{query}") };
        let missing = format!("{server}/keel_xtask_no_such_database{query}");
        let problem = probe("KEEL_TEST_DATABASE_URL", &missing).unwrap_err();
        assert!(problem.contains("keel_xtask_no_such_database"), "{problem}");
    }
}
