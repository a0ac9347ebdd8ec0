//! The commit-unknown proxy: a TCP proxy between the workers and PostgreSQL that reads the
//! wire protocol's message frames and, on a share of the transactions, cuts the client's
//! connection as it sends `COMMIT`: by coin, right after forwarding the `COMMIT` (the
//! proxy keeps reading the server's answer to learn whether it committed) or instead of
//! forwarding it (the server rolls back when the connection ends). Either way the client
//! never learns whether its commit happened.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The protocol codes of the SSL and GSS encryption requests a client may send first.
const SSL_REQUEST: u32 = 80_877_103;
const GSS_REQUEST: u32 = 80_877_104;
/// The largest frame the proxy accepts (PostgreSQL's own limit for a message is 1 GB).
const FRAME_MAX: usize = 1 << 30;
/// The connection's state: not cut, cut after forwarding `COMMIT`, cut instead of it.
const OPEN: u8 = 0;
const CUT_AFTER_COMMIT: u8 = 1;
const CUT_BEFORE_COMMIT: u8 = 2;
/// How long the proxy waits for the server's answer to a cut commit.
const OUTCOME_WAIT: Duration = Duration::from_secs(10);

/// What the proxy saw.
#[derive(Debug, Default)]
pub struct ProxyStats {
    pub connections: AtomicU64,
    pub commits: AtomicU64,
    pub cuts: AtomicU64,
    pub cut_committed: AtomicU64,
    pub cut_rolled_back: AtomicU64,
    pub cut_unknown: AtomicU64,
}

/// Accepts connections on `listener` and forwards them to `upstream`, cutting one commit
/// in `one_in`. Runs until the runtime stops.
pub async fn serve(
    listener: TcpListener,
    upstream: u16,
    one_in: u32,
    seed: u64,
    stats: Arc<ProxyStats>,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
            // The database is down: the client sees a refused connection, as it would.
            drop(client);
            continue;
        };
        stats.connections.fetch_add(1, Ordering::Relaxed);
        let seed = rng.u64(..);
        tokio::spawn(connection(client, server, one_in, seed, stats.clone()));
    }
}

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R, typed: bool) -> std::io::Result<Vec<u8>> {
    let head = if typed { 5 } else { 4 };
    let mut frame = vec![0u8; head];
    r.read_exact(&mut frame).await?;
    let len = u32::from_be_bytes(frame[head - 4..head].try_into().expect("four bytes")) as usize;
    if !(4..=FRAME_MAX).contains(&len) {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "bad frame length"));
    }
    frame.resize(head + len - 4, 0);
    r.read_exact(&mut frame[head..]).await?;
    Ok(frame)
}

async fn connection(
    client: TcpStream,
    server: TcpStream,
    one_in: u32,
    seed: u64,
    stats: Arc<ProxyStats>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let cut = Arc::new(AtomicU8::new(OPEN));
    let cut_up = cut.clone();
    let stats_up = stats.clone();
    let (refuse_tx, mut refuse_rx) = tokio::sync::mpsc::channel::<()>(4);
    let up = async move {
        let mut rng = fastrand::Rng::with_seed(seed);
        // Start-up: answer encryption requests with "no" ourselves, forward the rest.
        loop {
            let frame = read_frame(&mut client_read, false).await?;
            let code = u32::from_be_bytes(frame[4..8].try_into().expect("four bytes"));
            if code == SSL_REQUEST || code == GSS_REQUEST {
                refuse_tx.send(()).await.ok();
                continue;
            }
            server_write.write_all(&frame).await?;
            break;
        }
        loop {
            let frame = read_frame(&mut client_read, true).await?;
            let is_commit = frame[0] == b'Q' && frame[5..].starts_with(b"COMMIT");
            if is_commit {
                stats_up.commits.fetch_add(1, Ordering::Relaxed);
                if rng.u32(..one_in.max(1)) == 0 {
                    stats_up.cuts.fetch_add(1, Ordering::Relaxed);
                    if rng.bool() {
                        cut_up.store(CUT_AFTER_COMMIT, Ordering::SeqCst);
                        server_write.write_all(&frame).await?;
                    } else {
                        // The server never sees the COMMIT: it rolls back at the EOF.
                        cut_up.store(CUT_BEFORE_COMMIT, Ordering::SeqCst);
                        stats_up.cut_rolled_back.fetch_add(1, Ordering::Relaxed);
                    }
                    // Stop reading the client; the other half closes its socket.
                    return Ok::<(), std::io::Error>(());
                }
            }
            server_write.write_all(&frame).await?;
        }
    };
    let down = async move {
        loop {
            tokio::select! {
                Some(()) = refuse_rx.recv() => client_write.write_all(b"N").await?,
                frame = read_frame(&mut server_read, true) => {
                    let frame = frame?;
                    let state = cut.load(Ordering::SeqCst);
                    if state == CUT_BEFORE_COMMIT {
                        return Ok(());
                    }
                    if state == CUT_AFTER_COMMIT {
                        drop(client_write);
                        let outcome = tokio::time::timeout(OUTCOME_WAIT, async {
                            let mut frame = frame;
                            loop {
                                if frame[0] == b'C' && frame[5..].starts_with(b"COMMIT") {
                                    return Some(true);
                                }
                                if frame[0] == b'C' && frame[5..].starts_with(b"ROLLBACK") {
                                    return Some(false);
                                }
                                frame = read_frame(&mut server_read, true).await.ok()?;
                            }
                        })
                        .await
                        .ok()
                        .flatten();
                        let counter = match outcome {
                            Some(true) => &stats.cut_committed,
                            Some(false) => &stats.cut_rolled_back,
                            None => &stats.cut_unknown,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        return Ok::<(), std::io::Error>(());
                    }
                    client_write.write_all(&frame).await?;
                }
            }
        }
    };
    // A side that ends drops its halves, which closes the other side's peer: the client's
    // EOF reaches the server and the other way round; after a cut, the server's answer is
    // still read to the end.
    let _ = tokio::join!(up, down);
}
