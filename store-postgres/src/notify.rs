//! LISTEN/NOTIFY wake-ups: a dedicated connection listens on the store's channel and
//! turns each notification into a coalesced "work may be ready" signal, or, for a timer
//! hint (payload `timer:<due ms>`), into an entry of the sweepers' hint log.

use crate::PgStore;
use crate::error::pg;
use crate::ops::{Notice, parse_notice};
use keel_core::timers::{TimerHint, TimerHints};
use keel_core::{StoreResult, Timestamp};
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
    /// Opens a connection that LISTENs on [`PgStore::channel`]. It yields the "work is
    /// ready" wake-ups only; timer hints on the same channel are left to the store's own
    /// sweeper wake-ups ([`keel_core::ports::Store::timer_hint_wait`]).
    pub async fn listen(&self) -> StoreResult<PgListener> {
        let (tx, rx) = mpsc::channel(1);
        let client = self
            .listen_with(move |payload| {
                let Some(payload) = payload else { return false };
                if parse_notice(payload) != Notice::Ready {
                    return true;
                }
                // A full channel already holds a wake-up: coalesce.
                !matches!(tx.try_send(()), Err(mpsc::error::TrySendError::Closed(())))
            })
            .await?;
        Ok(PgListener { rx, _client: client })
    }

    /// Opens a listening connection and hands every notification's payload to `on`, in
    /// arrival order, until `on` returns `false`; when the connection ends, `on` gets
    /// `None`. The connection stays open while the returned client lives.
    async fn listen_with(
        &self,
        mut on: impl FnMut(Option<&str>) -> bool + Send + 'static,
    ) -> StoreResult<tokio_postgres::Client> {
        let (client, mut conn) = self.pg.connect(self.tls.clone()).await.map_err(|e| pg(&e))?;
        tokio::spawn(async move {
            while let Some(msg) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
                match msg {
                    Ok(AsyncMessage::Notification(n)) => {
                        if !on(Some(n.payload())) {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            on(None);
        });
        client.batch_execute(&format!("LISTEN \"{}\"", self.channel)).await.map_err(|e| pg(&e))?;
        Ok(client)
    }
}

/// The store's shared wake-ups for [`keel_core::ports::Store::ready_wait`] and
/// [`keel_core::ports::Store::timer_hint_wait`]: one listening connection per store (opened
/// on the first wait, reopened after it drops). A ready notification wakes every current
/// waiter; when nobody waits, it leaves a permit for the next wait, so a NOTIFY that lands
/// between a worker's claim and its wait is not lost. It leaves no permit when it woke a
/// waiter: that waiter claims after the notice, and a permit would only make its next
/// wait return at once for an empty claim (one per notice on a quiet worker). A second
/// claim loop on the same store that was busy at that moment relies on the woken one, or
/// on its next poll, for that notice's work. A timer hint goes into the hint log that every sweeper
/// reads with its own cursor. Opening the connection logs a gap, since hints sent before
/// the LISTEN took effect were never heard.
#[derive(Debug, Default)]
pub(crate) struct WakeHub {
    ready: tokio::sync::Notify,
    /// Calls of `wait_ready` under way (registered for `ready`, not yet returned).
    ready_waiting: std::sync::atomic::AtomicUsize,
    /// Held while (re)connecting, so concurrent waiters open one connection.
    connecting: tokio::sync::Mutex<()>,
    /// The listening connection's client while the connection is open.
    listener: std::sync::Mutex<Option<tokio_postgres::Client>>,
    hints: std::sync::Mutex<TimerHints>,
    hinted: tokio::sync::Notify,
    /// Instances ended: wakes callers waiting for a result.
    changed: tokio::sync::Notify,
}

impl WakeHub {
    fn wake(&self) {
        self.ready.notify_waiters();
        if self.ready_waiting.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            self.ready.notify_one();
        }
    }

    fn hint(&self, due: Option<Timestamp>) {
        let mut hints = self.hints.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match due {
            Some(due) => hints.push(due),
            None => hints.push_gap(),
        }
        drop(hints);
        self.hinted.notify_waiters();
    }

    fn listener(&self) -> std::sync::MutexGuard<'_, Option<tokio_postgres::Client>> {
        self.listener.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A notification's payload, or `None` when the connection ended: then the next wait
    /// reconnects, and everything the listener may have missed is reported (waiters poll,
    /// sweepers re-read the earliest due time).
    fn on_payload(&self, payload: Option<&str>) {
        match payload.map(parse_notice) {
            Some(Notice::Ready) => self.wake(),
            Some(Notice::Timer(due)) => self.hint(Some(due)),
            Some(Notice::TimerUnreadable) => self.hint(None),
            Some(Notice::Ended) => self.changed.notify_waiters(),
            None => {
                self.listener().take();
                self.wake();
                self.hint(None);
                self.changed.notify_waiters();
            }
        }
    }
}

impl PgStore {
    /// Resolves on the next ready NOTIFY on [`PgStore::channel`] (or a stored one).
    pub(crate) async fn wait_ready(&self) {
        // Created before the count goes up: a wake-up in between still reaches it.
        let notified = self.wake.ready.notified();
        let _waiting = ReadyWaiting::new(&self.wake.ready_waiting);
        if let Err(e) = self.ensure_listening().await {
            // Without a listener only polling finds work; do not spin on a dead server.
            let _ = e;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            return;
        }
        notified.await;
    }

    /// Resolves on the next "instances ended" NOTIFY (see `Store::instance_change_wait`);
    /// without a listener it waits a second, and the caller's polling finds the result.
    pub(crate) async fn wait_changed(&self) {
        // Registered before anything else, so a notification during the connect counts.
        let notified = self.wake.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.ensure_listening().await.is_err() {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            return;
        }
        notified.await;
    }

    /// Resolves with the timer hints after number `seen` (see `Store::timer_hint_wait`).
    pub(crate) async fn wait_timer_hint(&self, seen: u64) -> TimerHint {
        loop {
            // Registered before the log is read, so a hint pushed in between still wakes us.
            let notified = self.wake.hinted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.ensure_listening().await.is_err() {
                // No listener: report the loss after a pause (no spinning on a dead
                // server); the sweeper re-reads the store and its cadence still holds.
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                let last = self.hints().last();
                return TimerHint { cursor: last, due: None };
            }
            if let Some(hint) = self.hints().since(seen) {
                return hint;
            }
            notified.await;
        }
    }

    fn hints(&self) -> std::sync::MutexGuard<'_, TimerHints> {
        self.wake.hints.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn ensure_listening(&self) -> StoreResult<()> {
        let open = |hub: &WakeHub| hub.listener().as_ref().is_some_and(|c| !c.is_closed());
        if open(&self.wake) {
            return Ok(());
        }
        let _connecting = self.wake.connecting.lock().await;
        if open(&self.wake) {
            return Ok(());
        }
        let hub = std::sync::Arc::downgrade(&self.wake);
        let client = self
            .listen_with(move |payload| match hub.upgrade() {
                Some(hub) => {
                    hub.on_payload(payload);
                    true
                }
                None => false,
            })
            .await?;
        *self.wake.listener() = Some(client);
        // Hints sent before the LISTEN took effect were not heard.
        self.wake.hint(None);
        Ok(())
    }
}

/// One call of `wait_ready` counted while it lasts, however it ends (resolved, or dropped
/// by a caller that stopped waiting).
struct ReadyWaiting<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> ReadyWaiting<'a> {
    fn new(count: &'a std::sync::atomic::AtomicUsize) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ReadyWaiting(count)
    }
}

impl Drop for ReadyWaiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
