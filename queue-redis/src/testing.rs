//! Test support: a fresh queue per test on the server named by `KEEL_TEST_REDIS_URL`.

use crate::{RedisQueue, RedisQueueConfig};

/// The variable naming the test server.
pub const URL_VAR: &str = "KEEL_TEST_REDIS_URL";

/// A queue with a fresh random name on the test server, or `None` when
/// `KEEL_TEST_REDIS_URL` is unset. Panics if the server is named but does not answer: a
/// configured backend that is down is a failure, not a skip.
pub async fn fresh_queue() -> Option<RedisQueue> {
    let url = std::env::var(URL_VAR).ok()?;
    let name = format!("test-{:016x}", fastrand::u64(..));
    Some(
        RedisQueue::connect(RedisQueueConfig::new(&url, name))
            .await
            .unwrap_or_else(|e| panic!("{URL_VAR}={url}: {e}")),
    )
}

/// A `redis-server` of a test's own on a free loopback port, for tests that flush or stop
/// their server (never the shared one other tests use). Needs `redis-server` and
/// `redis-cli` on `PATH`; stopped when dropped.
#[derive(Debug)]
pub struct PrivateServer {
    port: u16,
    child: Option<std::process::Child>,
}

impl PrivateServer {
    /// Starts a server without persistence on a free port and waits (at most 5 s) until
    /// it answers. Panics when it cannot: a test that asked for one cannot run without.
    pub fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let mut server = PrivateServer { port, child: None };
        server.restart();
        server
    }

    /// The server's URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on its port and waits until it answers.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the private redis-server is running");
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting redis-server (is it on PATH?): {e}"));
        self.child = Some(child);
        for _ in 0..250 {
            if self.cli(&["ping"]).is_some_and(|out| out.trim() == "PONG") {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("the private redis-server on port {} did not answer within 5 s", self.port);
    }

    /// `SHUTDOWN NOSAVE`: the server goes away with everything it held.
    pub fn shutdown(&mut self) {
        let _ = self.cli(&["shutdown", "nosave"]);
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// `FLUSHALL`: every key of every database gone, leased hints included.
    pub fn flushall(&self) {
        let out = self.cli(&["flushall"]);
        assert_eq!(out.as_deref().map(str::trim), Some("OK"), "FLUSHALL on port {}", self.port);
    }

    /// Runs `redis-cli` against the server; its output, or `None` when it failed.
    fn cli(&self, args: &[&str]) -> Option<String> {
        let out = std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
