//! Which backend services the tests can use. Each backend suite reads its service URL from
//! an environment variable; `cargo xtask test` fills in the local default when the service
//! answers there, and `cargo xtask ci` requires every backend whose crate exists.

use anyhow::{Result, bail};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
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

/// The `host:port` of a service URL (`scheme://[user@]host:port[/...]`).
pub fn host_port(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hostport = rest.split(['/', '?']).next()?;
    (!hostport.is_empty()).then(|| hostport.to_owned())
}

fn reachable(url: &str) -> bool {
    let Some(hp) = host_port(url) else { return false };
    let Ok(mut addrs) = hp.to_socket_addrs() else { return false };
    addrs.any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
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
        if reachable(&url) {
            b.url = Some(url);
        } else {
            let why = match configured {
                Some(_) => format!("{env_var}={url} does not answer"),
                None => format!("{env_var} is unset and nothing answers at {default_url}"),
            };
            if require {
                bail!(
                    "{name} is required but unreachable: {why}. Start it (see .ci/run) or set {env_var}."
                );
            }
            b.skipped_because = Some(why);
        }
        out.push(b);
    }
    Ok(out)
}

/// Prints which backend suites ran and which were skipped.
pub fn summary(backends: &[Backend]) {
    eprintln!("backend suites:");
    eprintln!("  memory (MemoryStore, MemoryQueue): ran");
    for b in backends {
        match (&b.url, &b.skipped_because) {
            (Some(url), _) => eprintln!("  {} ({}): ran against {url}", b.name, b.crate_dir),
            (None, why) => eprintln!(
                "  {} ({}): SKIPPED — {}",
                b.name,
                b.crate_dir,
                why.as_deref().unwrap_or("unavailable")
            ),
        }
    }
    if backends.is_empty() {
        eprintln!("  (no backend crates in this workspace yet)");
    }
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn host_port_of_service_urls() {
        for (url, expected) in [
            ("postgres://postgres@127.0.0.1:5432/test", Some("127.0.0.1:5432")),
            ("redis://127.0.0.1:6379", Some("127.0.0.1:6379")),
            ("http://127.0.0.1:9324", Some("127.0.0.1:9324")),
            ("postgres://u:p@db.local:5433/x?sslmode=disable", Some("db.local:5433")),
            ("", None),
        ] {
            assert_eq!(host_port(url).as_deref(), expected, "{url}");
        }
    }
}
