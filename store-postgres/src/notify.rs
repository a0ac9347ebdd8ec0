//! LISTEN/NOTIFY wake-ups: a dedicated connection listens on the store's channel and
//! forwards each notification as a coalesced "work may be ready" signal.

use crate::PgStore;
use crate::error::pg;
use keel_core::StoreResult;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;

/// A stream of "work is ready" wake-ups. Notifications that arrive while one is already
/// pending are coalesced. Polling remains the correctness path: a listener that misses a
/// notification (for example across a reconnect) only delays work.
#[derive(Debug)]
pub struct PgListener {
    rx: mpsc::Receiver<()>,
    _client: tokio_postgres::Client,
}

impl PgListener {
    /// Waits for the next wake-up; `None` once the listening connection is gone.
    pub async fn recv(&mut self) -> Option<()> {
        self.rx.recv().await
    }

    /// Takes a pending wake-up without waiting.
    pub fn try_recv(&mut self) -> Option<()> {
        self.rx.try_recv().ok()
    }
}

impl PgStore {
    /// Opens a connection that LISTENs on [`PgStore::channel`].
    pub async fn listen(&self) -> StoreResult<PgListener> {
        let (client, mut conn) =
            self.pg.connect(tokio_postgres::NoTls).await.map_err(|e| pg(&e))?;
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            while let Some(msg) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
                match msg {
                    Ok(AsyncMessage::Notification(_)) => {
                        // A full channel already holds a wake-up: coalesce.
                        if let Err(mpsc::error::TrySendError::Closed(())) = tx.try_send(()) {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        client.batch_execute(&format!("LISTEN \"{}\"", self.channel)).await.map_err(|e| pg(&e))?;
        Ok(PgListener { rx, _client: client })
    }
}

/// The store's shared wake-up for [`keel_core::ports::Store::ready_wait`]: one listening
/// connection per store (opened on the first wait, reopened after it drops) that wakes
/// every current waiter and leaves a permit for the next one, so a NOTIFY that lands
/// between a worker's claim and its wait is not lost.
#[derive(Debug, Default)]
pub(crate) struct WakeHub {
    ready: tokio::sync::Notify,
    listening: tokio::sync::Mutex<bool>,
}

impl WakeHub {
    fn wake(&self) {
        self.ready.notify_waiters();
        self.ready.notify_one();
    }
}

impl PgStore {
    /// Resolves on the next NOTIFY on [`PgStore::channel`] (or a stored one).
    pub(crate) async fn wait_ready(&self) {
        let notified = self.wake.ready.notified();
        if let Err(e) = self.ensure_listening().await {
            // Without a listener only polling finds work; do not spin on a dead server.
            let _ = e;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            return;
        }
        notified.await;
    }

    async fn ensure_listening(&self) -> StoreResult<()> {
        let mut listening = self.wake.listening.lock().await;
        if *listening {
            return Ok(());
        }
        let mut listener = self.listen().await?;
        *listening = true;
        let hub = std::sync::Arc::downgrade(&self.wake);
        tokio::spawn(async move {
            while listener.recv().await.is_some() {
                let Some(hub) = hub.upgrade() else { return };
                hub.wake();
            }
            // The connection is gone: the next wait reconnects; wake waiters so they poll.
            if let Some(hub) = hub.upgrade() {
                *hub.listening.lock().await = false;
                hub.wake();
            }
        });
        Ok(())
    }
}
