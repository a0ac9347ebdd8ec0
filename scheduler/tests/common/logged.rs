//! Log lines as the `fmt` subscriber writes them, kept for a test to read.

use std::sync::{Arc, Mutex};

/// What this thread logged since [`Logged::capture`].
#[derive(Clone, Default)]
pub struct Logged(Arc<Mutex<Vec<u8>>>);

impl Logged {
    /// Captures what this thread logs until the guard drops (the tests' runtimes have one
    /// thread, which the subscriber is set on).
    pub fn capture() -> (Logged, tracing::subscriber::DefaultGuard) {
        let logged = Logged::default();
        let writer = logged.clone();
        let subscriber =
            tracing_subscriber::fmt().with_writer(move || writer.clone()).without_time().finish();
        let guard = tracing::subscriber::set_default(subscriber);
        // Call sites another test's thread reached with nobody listening are decided
        // again, now that this capture listens.
        tracing::callsite::rebuild_interest_cache();
        (logged, guard)
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().expect("log lock").clone()).expect("utf-8 logs")
    }
}

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
