//! A private PostgreSQL cluster for the chaos run: created with `initdb` in a temporary
//! directory, listening on a free loopback port, crashed and restarted at will, and
//! removed when dropped. Destructive scenarios never touch a shared server.

use anyhow::{Context, Result, bail};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long `pg_ctl` may take to start or stop the server.
const PG_CTL_TIMEOUT_SECS: &str = "60";

pub struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    pub port: u16,
    /// `runuser -u postgres --` when we are root (initdb refuses to run as root).
    as_postgres: bool,
}

/// The newest `/usr/lib/postgresql/<version>/bin` that has `initdb`.
fn find_bin() -> Result<PathBuf> {
    let found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL server binaries not found under /usr/lib/postgresql; install the postgresql package")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|dir| dir.join("bin").join("initdb").exists())
        .collect();
    newest(found)
        .map(|dir| dir.join("bin"))
        .context("no initdb under /usr/lib/postgresql/*/bin; install the postgresql package")
}

/// The version directory (`…/9.6`, `…/16`) with the highest version, compared part by part
/// as numbers (16 is newer than 9.6); a name that is not a version comes last.
fn newest(dirs: Vec<PathBuf>) -> Option<PathBuf> {
    let version = |dir: &PathBuf| -> Option<Vec<u64>> {
        let name = dir.file_name()?.to_str()?;
        name.split('.').map(|part| part.parse().ok()).collect()
    };
    dirs.into_iter().max_by(|a, b| version(a).cmp(&version(b)).then_with(|| a.cmp(b)))
}

/// A loopback port nobody listens on right now.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

impl Cluster {
    /// Creates and starts a cluster in a fresh directory under `parent`.
    pub fn create(parent: &Path) -> Result<Self> {
        let bin = find_bin()?;
        let port = free_port()?;
        let dir = parent.join(format!("pg-{port}"));
        std::fs::create_dir_all(&dir)?;
        let as_postgres = is_root();
        if as_postgres {
            let status =
                Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status()?;
            if !status.success() {
                bail!("could not hand {} to the postgres user", dir.display());
            }
        }
        let cluster = Cluster { bin, dir, port, as_postgres };
        cluster.run(
            "initdb",
            &["-D", &cluster.data(), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
        )?;
        cluster.start()?;
        Ok(cluster)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<()> {
        let program = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(&program);
            cmd
        } else {
            Command::new(&program)
        };
        let out = cmd
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("could not run {tool}"))?;
        if !out.status.success() {
            bail!(
                "{tool} {} failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) -> Result<()> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c max_connections=200",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "-t",
                PG_CTL_TIMEOUT_SECS,
                "start",
            ],
        )?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the private PostgreSQL on port {} did not accept connections within 30 s",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Kills the server the way a crash would (`-m immediate`: no checkpoint, recovery on
    /// the next start).
    pub fn stop_immediate(&self) -> Result<()> {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "-t", PG_CTL_TIMEOUT_SECS, "stop"],
        )
    }

    /// A crash and a restart.
    pub fn restart_immediate(&self) -> Result<()> {
        self.stop_immediate()?;
        self.start()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop_immediate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::newest;
    use std::path::PathBuf;

    #[test]
    fn the_newest_server_is_chosen_by_version_number_not_by_name() {
        let dirs = |names: &[&str]| -> Vec<PathBuf> {
            names.iter().map(|n| PathBuf::from("/usr/lib/postgresql").join(n)).collect()
        };
        let pick = |names: &[&str]| newest(dirs(names)).map(|d| d.display().to_string());
        let path = |name: &str| Some(format!("/usr/lib/postgresql/{name}"));
        assert_eq!(pick(&["9.6", "16", "10"]), path("16"));
        assert_eq!(pick(&["16", "9.6"]), path("16"));
        assert_eq!(pick(&["notes", "9.6"]), path("9.6"));
        assert_eq!(pick(&["15", "17"]), path("17"));
        assert_eq!(pick(&[]), None);
    }
}
