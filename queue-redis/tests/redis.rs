//! What the Redis queue adds beyond the shared contracts: a receiver that crashes loses
//! nothing, losing the data loses only hints, duplicates collapse, and a wrong URL or a
//! server that is down gives a clear error.

use keel_core::ports::Queue;
use keel_core::ports::queue::Hint;
use keel_core::{ErrorKind, InstanceId};
use keel_queue_redis::testing::{URL_VAR, fresh_queue};
use keel_queue_redis::{RedisQueue, RedisQueueConfig};
use keel_testkit::conformance::queue::queue_or_skip;
use std::time::Duration;

const MS: Duration = Duration::from_millis(1);

/// Hints leased by a receiver that went away come back once their lease runs out, to a
/// receiver on another connection.
#[tokio::test]
async fn crashed_receiver_hints_come_back() {
    let Some(q) = queue_or_skip("redis crash", URL_VAR, fresh_queue().await) else { return };
    q.enqueue((1..=5).map(|n| Hint::new(InstanceId(n), 1)).collect()).await.unwrap();
    let url = std::env::var(URL_VAR).unwrap();
    {
        let crashed = RedisQueue::connect(RedisQueueConfig::new(&url, q.name())).await.unwrap();
        assert_eq!(crashed.receive(5, 300 * MS, MS).await.unwrap().len(), 5);
    }
    assert!(q.receive(5, 300 * MS, Duration::ZERO).await.unwrap().is_empty());
    let back = q.receive(5, 300 * MS, 1000 * MS).await.unwrap();
    assert_eq!(back.len(), 5);
    assert!(back.iter().all(|d| d.receive_count == 2));
}

/// The same instance and revision published twice is one hint; a purge drops them all.
#[tokio::test]
async fn duplicates_collapse_and_purge_empties() {
    let Some(q) = queue_or_skip("redis dedup", URL_VAR, fresh_queue().await) else { return };
    let h = Hint::new(InstanceId(7), 3);
    q.enqueue(vec![h.clone(), h.clone()]).await.unwrap();
    q.enqueue(vec![h, Hint::new(InstanceId(7), 4)]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 2);
    q.purge().await.unwrap();
    assert_eq!(q.len().await.unwrap(), 0);
    assert!(q.receive(10, 100 * MS, 10 * MS).await.unwrap().is_empty());
}

/// A receipt of an earlier delivery cannot extend or nack the current one.
#[tokio::test]
async fn stale_receipt_is_not_found() {
    let Some(q) = queue_or_skip("redis stale receipt", URL_VAR, fresh_queue().await) else {
        return;
    };
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let first = q.receive(1, 50 * MS, 100 * MS).await.unwrap();
    let second = q.receive(1, 5000 * MS, 500 * MS).await.unwrap();
    assert_eq!(second[0].receive_count, 2);
    let err = q.extend(first[0].receipt.clone(), 5000 * MS).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    q.ack(vec![first[0].receipt.clone()]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 1, "a stale ack removed the current delivery");
}

/// Bad settings name the field; a server that is not there is `Unavailable`.
#[tokio::test]
async fn bad_url_name_and_server_down() {
    let err = RedisQueue::connect(RedisQueueConfig::new("http://x", "q")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.starts_with("url"), "{err}");
    let err = RedisQueue::connect(RedisQueueConfig::new("redis://127.0.0.1:6379", "a{b}"))
        .await
        .unwrap_err();
    assert!(err.message.starts_with("name"), "{err}");
    let err =
        RedisQueue::connect(RedisQueueConfig::new("redis://127.0.0.1:9", "q")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
}

/// A lazy queue is made while its server is down: its calls are `Unavailable` until the
/// server answers, and then hints flow without making the queue again. Its settings are
/// still checked at once.
#[tokio::test]
async fn a_lazy_queue_is_made_while_the_server_is_down_and_works_once_it_is_up() {
    let err = RedisQueue::connect_lazy(RedisQueueConfig::new("http://x", "q")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.starts_with("url"), "{err}");
    let err = RedisQueue::connect_lazy(RedisQueueConfig::new("redis://127.0.0.1:9", "a{b}"))
        .await
        .unwrap_err();
    assert!(err.message.starts_with("name"), "{err}");
    let on = std::env::var(URL_VAR).is_ok();
    let server = on.then(keel_queue_redis::testing::PrivateServer::start);
    let Some(mut server) = queue_or_skip("redis lazy connect", URL_VAR, server) else { return };
    server.shutdown();
    let q = RedisQueue::connect_lazy(RedisQueueConfig::new(server.url(), "lazy"))
        .await
        .expect("a lazy queue is made while its server is down");
    let err = q.receive(1, 1000 * MS, 10 * MS).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    let err = q.enqueue(vec![Hint::new(InstanceId(42), 1)]).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    server.restart();
    // The connections are opened again on their own; a call may still meet the attempt
    // made while the server was down.
    let mut published = Err(err);
    for _ in 0..50 {
        published = q.enqueue(vec![Hint::new(InstanceId(42), 1)]).await;
        if published.is_ok() {
            break;
        }
        tokio::time::sleep(100 * MS).await;
    }
    published.expect("a publish once the server is up");
    let mut got = Vec::new();
    for _ in 0..50 {
        if let Ok(page) = q.receive(1, 5000 * MS, 100 * MS).await
            && !page.is_empty()
        {
            got = page;
            break;
        }
    }
    let instances: Vec<i64> = got.iter().map(|d| d.hint.instance.0).collect();
    assert_eq!(instances, [42], "the hint published once the server was up is received");
}

/// Every event logged while it is the default subscriber of the thread, as its level
/// and its fields (`name=value`, the message last).
#[derive(Clone, Default)]
struct Logged(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Logged {
    fn at(&self, level: tracing::Level) -> Vec<String> {
        let prefix = format!("{level} ");
        let lines = self.0.lock().unwrap();
        lines.iter().filter(|l| l.starts_with(&prefix)).cloned().collect()
    }
}

struct Fields<'a>(&'a mut Vec<String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push(format!("{}={value:?}", field.name()));
    }
}

impl tracing::Subscriber for Logged {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        let line = format!("{} {}", event.metadata().level(), fields.join(" "));
        self.0.lock().unwrap().push(line);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Entries under the queue's keys that are not hints (written by something else, edited
/// by hand, or encoded by another version) are removed when received, and the good hints
/// leased with them are handed out in the same receive, or at once behind them. Every
/// removal is counted, and the warning about them is given once a minute, not once per
/// entry: it names the queue, its key, one entry and the count so far.
#[tokio::test(flavor = "current_thread")]
async fn entries_that_are_not_hints_are_removed_counted_and_good_hints_still_arrive() {
    let Some(q) = queue_or_skip("redis junk entries", URL_VAR, fresh_queue().await) else {
        return;
    };
    let logged = Logged::default();
    let _guard = tracing::subscriber::set_default(logged.clone());
    let url = std::env::var(URL_VAR).unwrap();
    let conn = redis::aio::ConnectionManager::new(redis::Client::open(url).unwrap()).await.unwrap();
    let prefix = format!("keel:{{{}}}", q.name());
    let (vis, body, count) =
        (format!("{prefix}:vis"), format!("{prefix}:body"), format!("{prefix}:count"));
    // An id that is not `<instance>:<revision>`, a good id with a body of another
    // encoding, an id without a revision and an id that is not UTF-8; all visible since
    // the epoch, so they come before any real hint.
    let junk: [(&[u8], &str); 4] =
        [(b"x:y", "junk"), (b"5:1", "no-priority-level"), (b"7", "0|"), (b"\xff:1", "0|")];
    let plant = |mut conn: redis::aio::ConnectionManager| {
        let (vis, body) = (vis.clone(), body.clone());
        async move {
            for (id, text) in junk {
                redis::cmd("HSET").arg(&body).arg(id).arg(text).exec_async(&mut conn).await?;
                redis::cmd("ZADD").arg(&vis).arg(0).arg(id).exec_async(&mut conn).await?;
            }
            redis::RedisResult::Ok(())
        }
    };
    let fields = |key: String, mut conn: redis::aio::ConnectionManager| async move {
        let names: Vec<Vec<u8>> = redis::cmd("HKEYS").arg(&key).query_async(&mut conn).await?;
        let mut names: Vec<String> =
            names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect();
        names.sort();
        redis::RedisResult::Ok(names)
    };

    // Junk and a good hint leased in one batch.
    plant(conn.clone()).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let got = q.receive(10, 5000 * MS, 100 * MS).await.unwrap();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), vec![1]);
    assert_eq!(q.len().await.unwrap(), 1, "the junk entries are still queued");
    assert_eq!(fields(body.clone(), conn.clone()).await.unwrap(), ["1:1"]);
    assert_eq!(fields(count.clone(), conn.clone()).await.unwrap(), ["1:1"]);
    assert_eq!(q.junk_removed(), 4, "every entry that is not a hint is counted");
    q.ack(vec![got[0].receipt.clone()]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 0);

    // Junk alone in the first rounds: a receive of one looks again at once.
    plant(conn.clone()).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(2), 1)]).await.unwrap();
    let got = q.receive(1, 5000 * MS, 100 * MS).await.unwrap();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), vec![2]);
    assert_eq!(q.len().await.unwrap(), 1, "the junk entries are still queued");
    q.ack(vec![got[0].receipt.clone()]).await.unwrap();
    assert!(fields(body, conn.clone()).await.unwrap().is_empty());
    assert!(fields(count, conn).await.unwrap().is_empty());
    assert_eq!(q.junk_removed(), 8, "the entries removed by later receives add up");

    let warnings = logged.at(tracing::Level::WARN);
    assert_eq!(warnings.len(), 1, "one warning a minute, not one per entry: {warnings:?}");
    let warning = &warnings[0];
    assert!(warning.contains(&format!("queue={}", q.name())), "{warning}");
    assert!(warning.contains(&format!("key={vis}")), "{warning}");
    assert!(warning.contains("removed=4"), "the count so far: {warning}");
    let example = ["x:y", "5:1", "7", "\u{fffd}:1"];
    assert!(example.iter().any(|id| warning.contains(&format!("entry={id} "))), "{warning}");
    assert!(warning.contains("`<instance>:<revision>`"), "what a hint looks like: {warning}");
    assert!(warning.contains("only Keel should write under these keys"), "{warning}");
    assert!(warning.contains("`RedisQueue::junk_removed` counts them all"), "{warning}");
}

/// A URL's password never shows in an error: not when the server is down, not when the
/// URL does not parse.
#[tokio::test]
async fn connect_errors_hide_the_password() {
    let err = RedisQueue::connect(RedisQueueConfig::new("redis://:s3cret@127.0.0.1:9/0", "q"))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert!(!err.message.contains("s3cret"), "{err}");
    assert!(err.message.starts_with("redis at redis://:***@127.0.0.1:9/0: "), "{err}");
    let err = RedisQueue::connect(RedisQueueConfig::new("redis://app:s3cret@host:port/0", "q"))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
    assert!(!err.message.contains("s3cret"), "{err}");
    assert!(err.message.starts_with(r#"url "redis://app:***@host:port/0""#), "{err}");
    // An unencoded `/` in the password, and a URL without `//`: both refused as they stand.
    for (url, shown) in [
        ("redis://app:s3/cret@host:6379/0", "redis://***@host:6379/0"),
        ("redis:/app:s3cret@host", "redis:***@host"),
    ] {
        let err = RedisQueue::connect(RedisQueueConfig::new(url, "q")).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
        assert!(!err.message.contains("s3"), "{err}");
        assert!(err.message.starts_with(&format!("url {shown:?}")), "{err}");
        let config = RedisQueueConfig::new(url, "q");
        assert!(!format!("{config:?}").contains("s3"), "{config:?}");
    }
    let config = RedisQueueConfig::new("redis://:s3cret@127.0.0.1:9/0", "q");
    assert!(!format!("{config:?}").contains("s3cret"), "{config:?}");
    let err = RedisQueue::connect(config.capacity(0)).await.unwrap_err();
    assert!(err.message.starts_with("capacity: 0 would drop every hint"), "{err}");
}

/// A queue holds at most its capacity: a publish that takes it over drops the hints that
/// have been visible the longest (never a delayed one or one leased by a receiver) and
/// counts them.
#[tokio::test]
async fn a_full_queue_drops_its_oldest_visible_hints() {
    let q = match std::env::var(URL_VAR) {
        Ok(url) => {
            let name = format!("test-{:016x}", fastrand::u64(..));
            Some(RedisQueue::connect(RedisQueueConfig::new(url, name).capacity(4)).await.unwrap())
        }
        Err(_) => None,
    };
    let Some(q) = queue_or_skip("redis capacity", URL_VAR, q) else { return };
    // 1 is leased, 2 is delayed; 3, 4 and 5 wait, 3 the longest.
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let leased = q.receive(1, 60_000 * MS, 100 * MS).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(2), 1).delay(60_000 * MS)]).await.unwrap();
    for n in 3..=5 {
        q.enqueue(vec![Hint::new(InstanceId(n), 1)]).await.unwrap();
        tokio::time::sleep(5 * MS).await;
    }
    assert_eq!((q.len().await.unwrap(), q.dropped()), (4, 1), "hint 3 was dropped");
    q.enqueue(vec![Hint::new(InstanceId(6), 1), Hint::new(InstanceId(7), 1)]).await.unwrap();
    assert_eq!((q.len().await.unwrap(), q.dropped()), (4, 3));
    let got = q.receive(10, 60_000 * MS, 100 * MS).await.unwrap();
    let mut visible: Vec<i64> = got.iter().map(|d| d.hint.instance.0).collect();
    visible.sort_unstable();
    assert_eq!(visible, [6, 7], "the newest hints are kept");
    q.ack(vec![leased[0].receipt.clone()]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 3, "the lease was kept, and its ack still counts");
}

/// A publish into a queue that is over its capacity only because of leased and delayed
/// hints drops nothing: not a lease about to end, not a delayed hint, and not the hint it
/// has just published. The queue stays over its capacity until hints become visible.
#[tokio::test]
async fn a_full_queue_never_drops_leased_delayed_or_new_hints() {
    let q = match std::env::var(URL_VAR) {
        Ok(url) => {
            let name = format!("test-{:016x}", fastrand::u64(..));
            Some(RedisQueue::connect(RedisQueueConfig::new(url, name).capacity(2)).await.unwrap())
        }
        Err(_) => None,
    };
    let Some(q) = queue_or_skip("redis capacity, nothing visible", URL_VAR, q) else { return };
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let leased = q.receive(1, 60_000 * MS, 100 * MS).await.unwrap();
    assert_eq!(leased.len(), 1);
    q.enqueue(vec![Hint::new(InstanceId(2), 1).delay(60_000 * MS)]).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(3), 1)]).await.unwrap();
    assert_eq!((q.len().await.unwrap(), q.dropped()), (3, 0), "nothing was visible before");
    let got = q.receive(10, 60_000 * MS, 100 * MS).await.unwrap();
    let got: Vec<i64> = got.iter().map(|d| d.hint.instance.0).collect();
    assert_eq!(got, [3], "the hint just published is kept");
    q.ack(vec![leased[0].receipt.clone()]).await.unwrap();
    assert_eq!(q.len().await.unwrap(), 2, "the lease was kept, and its ack still counts");
}

/// The scripts a server has run (`EVALSHA` and `EVAL` calls), from `INFO commandstats`.
async fn scripts_run(conn: &mut redis::aio::ConnectionManager) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await.unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// Several receivers sharing one queue (the workers of a process) wait on its one
/// blocking connection together: while idle they do not poll the server, and a publish
/// wakes them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_receivers_sharing_a_queue_do_not_poll() {
    let on = std::env::var(URL_VAR).is_ok();
    let server = on.then(keel_queue_redis::testing::PrivateServer::start);
    let q = match &server {
        Some(server) => {
            Some(RedisQueue::connect(RedisQueueConfig::new(server.url(), "shared")).await.unwrap())
        }
        None => None,
    };
    let Some(q) = queue_or_skip("redis shared receivers", URL_VAR, q) else { return };
    let q = std::sync::Arc::new(q);
    let url = server.as_ref().unwrap().url();
    let mut conn =
        redis::aio::ConnectionManager::new(redis::Client::open(url).unwrap()).await.unwrap();
    let before = scripts_run(&mut conn).await;
    let receivers: Vec<_> = (0..4)
        .map(|_| {
            let q = std::sync::Arc::clone(&q);
            tokio::spawn(async move { q.receive(10, 5000 * MS, 1000 * MS).await.unwrap() })
        })
        .collect();
    let mut got = 0;
    for r in receivers {
        got += r.await.unwrap().len();
    }
    assert_eq!(got, 0);
    // Four receives of one second: a first look and a look after the wait each, not a
    // look every few milliseconds.
    let idle = scripts_run(&mut conn).await - before;
    assert!(idle <= 16, "{idle} scripts for four idle receives of one second");

    // A publish while they wait reaches them.
    let receivers: Vec<_> = (0..4)
        .map(|_| {
            let q = std::sync::Arc::clone(&q);
            tokio::spawn(async move { q.receive(10, 5000 * MS, 2000 * MS).await.unwrap() })
        })
        .collect();
    tokio::time::sleep(200 * MS).await;
    q.enqueue((1..=3).map(|n| Hint::new(InstanceId(n), 1)).collect()).await.unwrap();
    let mut got = 0;
    for r in receivers {
        got += r.await.unwrap().len();
    }
    assert_eq!(got, 3, "every hint was received by the waiting receivers");
}

/// A receiver whose wait is dropped (a caller's timeout, a shutdown) while it holds the
/// blocking connection wakes the receivers waiting behind it: they do not sleep out their
/// whole wait, and a publish reaches them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_wait_wakes_the_receivers_behind_it() {
    let Some(q) = queue_or_skip("redis dropped wait", URL_VAR, fresh_queue().await) else {
        return;
    };
    let q = std::sync::Arc::new(q);
    let wait = 20_000 * MS;
    let holder = {
        let q = std::sync::Arc::clone(&q);
        tokio::spawn(
            async move { tokio::time::timeout(300 * MS, q.receive(1, 5000 * MS, wait)).await },
        )
    };
    // The holder is in its `BLPOP` well before the second receiver comes.
    tokio::time::sleep(100 * MS).await;
    let waiter = {
        let q = std::sync::Arc::clone(&q);
        tokio::spawn(async move { q.receive(10, 5000 * MS, wait).await.unwrap() })
    };
    assert!(holder.await.unwrap().is_err(), "the holder's receive was dropped at its timeout");
    // One hint, one wake token: the `BLPOP` of the dropped receive, still pending on the
    // server, must not be the one that takes it.
    tokio::time::sleep(100 * MS).await;
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let got = tokio::time::timeout(wait / 2, waiter)
        .await
        .expect("the waiter was woken, not left asleep for its whole wait")
        .unwrap();
    assert!(!got.is_empty(), "the waiter received the published hints");
}

/// A receive dropped during its wait leaves nothing on the server that takes a later
/// publish's wake token, also when a receiver of another handle (another process) has
/// been waiting on the queue longer: the server hands a token to the client that waits
/// longest, so a pushed token would not end the dropped wait. A publish after the drop
/// reaches a receiver at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_wait_does_not_take_a_later_publish() {
    let Some(a) = queue_or_skip("redis dropped wait, two handles", URL_VAR, fresh_queue().await)
    else {
        return;
    };
    let url = std::env::var(URL_VAR).unwrap();
    let b = RedisQueue::connect(RedisQueueConfig::new(&url, a.name())).await.unwrap();
    let (a, b) = (std::sync::Arc::new(a), std::sync::Arc::new(b));
    let wait = 20_000 * MS;
    // The other handle's receiver waits first, so it has waited longest.
    let other = {
        let b = std::sync::Arc::clone(&b);
        tokio::spawn(async move { b.receive(10, 5000 * MS, wait).await.unwrap() })
    };
    tokio::time::sleep(100 * MS).await;
    let holder = {
        let a = std::sync::Arc::clone(&a);
        tokio::spawn(
            async move { tokio::time::timeout(300 * MS, a.receive(1, 5000 * MS, wait)).await },
        )
    };
    assert!(holder.await.unwrap().is_err(), "the holder's receive was dropped at its timeout");
    let waiter = {
        let a = std::sync::Arc::clone(&a);
        tokio::spawn(async move { a.receive(10, 5000 * MS, wait).await.unwrap() })
    };
    tokio::time::sleep(300 * MS).await;
    let published = std::time::Instant::now();
    a.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    let (other_abort, waiter_abort) = (other.abort_handle(), waiter.abort_handle());
    let got = tokio::time::timeout(5000 * MS, async {
        tokio::select! {
            got = other => got.unwrap(),
            got = waiter => got.unwrap(),
        }
    })
    .await;
    other_abort.abort();
    waiter_abort.abort();
    let got = got.unwrap_or_else(|_| {
        panic!("no receiver got the hint within {:?} of its publish", published.elapsed())
    });
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), [1]);
}

/// A TCP proxy in front of a Redis server whose connections can be made to go silent:
/// still open, still acknowledged by the kernel, but nothing forwarded any more (a NAT
/// or firewall that forgot them, a hung middlebox). Connections opened after
/// [`SilencingProxy::silence`] are forwarded as usual. New connections can be sent to
/// another server ([`SilencingProxy::redirect`], a failover that moved a name or an
/// address), while the open ones stay with the old one.
struct SilencingProxy {
    port: u16,
    open: std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>>>,
    upstream: std::sync::Arc<std::sync::Mutex<String>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl SilencingProxy {
    async fn start(upstream: String) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let upstream = std::sync::Arc::new(std::sync::Mutex::new(upstream));
        let accepting = {
            let open = std::sync::Arc::clone(&open);
            let upstream = std::sync::Arc::clone(&upstream);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let to = upstream.lock().unwrap().clone();
                    let Ok(server) = tokio::net::TcpStream::connect(&to).await else {
                        continue;
                    };
                    let silent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                    open.lock().unwrap().push(std::sync::Arc::clone(&silent));
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    for (mut from, mut to) in
                        [(client_read, server_write), (server_read, client_write)]
                    {
                        let silent = std::sync::Arc::clone(&silent);
                        tokio::spawn(async move {
                            let mut buf = vec![0u8; 16 * 1024];
                            loop {
                                let n = match from.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                if silent.load(std::sync::atomic::Ordering::SeqCst) {
                                    // Keeps both ends open and forwards nothing.
                                    std::future::pending::<()>().await;
                                }
                                if to.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        });
                    }
                }
            })
        };
        SilencingProxy { port, open, upstream, accepting }
    }

    /// Connections opened from now on go to `upstream` (`host:port`).
    fn redirect(&self, upstream: String) {
        *self.upstream.lock().unwrap() = upstream;
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// How many connections the proxy has forwarded so far.
    fn opened(&self) -> usize {
        self.open.lock().unwrap().len()
    }

    /// Every connection open now stops forwarding, in both directions, for good.
    fn silence(&self) {
        for silent in self.open.lock().unwrap().iter() {
            silent.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

impl Drop for SilencingProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// A connection that goes silent without being closed is replaced within seconds:
/// publishing works again well before the kernel would give up on the old connection,
/// and a waiting receive gets a new connection too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_replaced_within_seconds() {
    let Ok(url) = std::env::var(URL_VAR) else {
        let _ = queue_or_skip::<RedisQueue>("redis silent connection", URL_VAR, None);
        return;
    };
    let upstream = host_port(&url);
    let proxy = SilencingProxy::start(upstream).await;
    let name = format!("test-{:016x}", fastrand::u64(..));
    let q = RedisQueue::connect(RedisQueueConfig::new(proxy.url(), name)).await.unwrap();
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    assert_eq!(q.receive(1, 60_000 * MS, 100 * MS).await.unwrap().len(), 1);

    proxy.silence();
    let started = std::time::Instant::now();
    let mut errors = Vec::new();
    loop {
        match q.enqueue(vec![Hint::new(InstanceId(2), 1)]).await {
            Ok(()) => break,
            Err(e) => errors.push(format!("{:?}: {e}", started.elapsed())),
        }
        assert!(
            started.elapsed() < 15_000 * MS,
            "publishing still fails 15 s after the connection went silent: {errors:?}"
        );
    }
    // The receive's wait runs on its own connection, silent too: it ends at its time
    // (with the wait's margin), not with an error, and the next one waits on a new
    // connection that a publish wakes.
    let waited = std::time::Instant::now();
    let got = q.receive(1, 60_000 * MS, 1000 * MS).await.unwrap();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), [2]);
    let got = q.receive(1, 60_000 * MS, 1000 * MS).await.unwrap();
    assert!(got.is_empty(), "{got:?}");
    assert!(waited.elapsed() < 5000 * MS, "the waits took {:?}", waited.elapsed());
    let q = std::sync::Arc::new(q);
    a_publish_wakes_a_waiting_receive(&q).await;
}

/// A receive waiting up to 10 s gets the hint (instance 3) published 300 ms into its
/// wait, within 2 s of the publish: its wait is on a live connection.
async fn a_publish_wakes_a_waiting_receive(q: &std::sync::Arc<RedisQueue>) {
    let waiter = {
        let q = std::sync::Arc::clone(q);
        tokio::spawn(async move { q.receive(1, 60_000 * MS, 10_000 * MS).await.unwrap() })
    };
    tokio::time::sleep(300 * MS).await;
    let published = std::time::Instant::now();
    q.enqueue(vec![Hint::new(InstanceId(3), 1)]).await.unwrap();
    let got = waiter.await.unwrap();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), [3]);
    assert!(published.elapsed() < 2000 * MS, "woken after {:?}", published.elapsed());
}

/// Commands sent on a silent connection shortly before it was replaced time out after
/// the swap: they do not replace the new, healthy connection once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_timeouts_of_a_replaced_connection_keep_the_new_one() {
    let Ok(url) = std::env::var(URL_VAR) else {
        let _ = queue_or_skip::<RedisQueue>("redis late timeouts", URL_VAR, None);
        return;
    };
    let upstream = host_port(&url);
    let proxy = SilencingProxy::start(upstream).await;
    let name = format!("test-{:016x}", fastrand::u64(..));
    let q = RedisQueue::connect(RedisQueueConfig::new(proxy.url(), name)).await.unwrap();
    let q = std::sync::Arc::new(q);
    q.len().await.unwrap();
    let opened = proxy.opened();

    proxy.silence();
    // The first two commands time out about 2 s from now and replace the connection;
    // the last two were sent on the old one before that and time out about 1 s later.
    let mut calls = Vec::new();
    for after in [0, 100, 1000, 1500] {
        let q = std::sync::Arc::clone(&q);
        calls.push(tokio::spawn(async move {
            tokio::time::sleep(after * MS).await;
            q.len().await
        }));
    }
    for call in calls {
        assert!(call.await.unwrap().is_err(), "a command on the silent connection failed");
    }
    assert_eq!(q.len().await.unwrap(), 0, "the new connection answers");
    assert_eq!(
        proxy.opened(),
        opened + 1,
        "one new connection replaced the silent one; the late timeouts opened no other"
    );
}

/// `host:port` of a `redis://host:port[/db]` URL.
fn host_port(url: &str) -> String {
    url.trim_start_matches("redis://").split('/').next().unwrap().to_owned()
}

/// After a failover that leaves the old primary up as a replica (its connections still
/// open, every write refused with `READONLY`) and moves the URL's address to the new
/// primary, the queue works again at once, without a restart: the command refused on
/// the old connection fails, and the connection is replaced once, however many commands
/// were refused on it. A waiting receive's connection is replaced as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_turned_replica_by_a_failover_is_left_for_the_new_primary() {
    let on = std::env::var(URL_VAR).is_ok();
    let servers = on.then(|| {
        (
            keel_queue_redis::testing::PrivateServer::start(),
            keel_queue_redis::testing::PrivateServer::start(),
        )
    });
    let Some((old, new)) = queue_or_skip("redis failover", URL_VAR, servers) else { return };
    let proxy = SilencingProxy::start(host_port(&old.url())).await;
    let q = RedisQueue::connect(RedisQueueConfig::new(proxy.url(), "failover")).await.unwrap();
    let q = std::sync::Arc::new(q);
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    assert_eq!(q.receive(1, 60_000 * MS, 100 * MS).await.unwrap().len(), 1);
    assert!(q.receive(1, 60_000 * MS, 50 * MS).await.unwrap().is_empty());
    let opened = proxy.opened();

    // The failover: the address moves to the new primary, and the old one, still up with
    // the queue's connections open, becomes a replica (of a primary it cannot reach, so
    // that it stays one and answers at once).
    proxy.redirect(host_port(&new.url()));
    let mut old_conn =
        redis::aio::ConnectionManager::new(redis::Client::open(old.url()).unwrap()).await.unwrap();
    redis::cmd("REPLICAOF").arg("127.0.0.1").arg(9).exec_async(&mut old_conn).await.unwrap();

    // Publishes sent together on the old connection: the refused ones fail naming the
    // refusal, and the connection is replaced once.
    let publishes: Vec<_> = (10..14)
        .map(|n| {
            let q = std::sync::Arc::clone(&q);
            tokio::spawn(async move { q.enqueue(vec![Hint::new(InstanceId(n), 1)]).await })
        })
        .collect();
    let mut refused = 0;
    for publish in publishes {
        if let Err(e) = publish.await.unwrap() {
            assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
            assert!(e.message.contains("read only replica"), "{e}");
            refused += 1;
        }
    }
    assert!(refused >= 1, "the old primary refused the publishes sent to it");
    q.enqueue(vec![Hint::new(InstanceId(2), 1)])
        .await
        .expect("a publish after the refusal goes to the new primary");
    assert_eq!(proxy.opened(), opened + 1, "one new connection, not one per refusal");
    let mut new_conn =
        redis::aio::ConnectionManager::new(redis::Client::open(new.url()).unwrap()).await.unwrap();
    let on_new: u64 =
        redis::cmd("ZCARD").arg("keel:{failover}:vis").query_async(&mut new_conn).await.unwrap();
    assert!(on_new >= 1, "the publish landed on the new primary");

    // The waiting receive's connection is still with the old primary: its wait is
    // refused once, and the next one waits on the new primary, where a publish wakes it.
    q.purge().await.unwrap();
    let mut errors = Vec::new();
    for _ in 0..3 {
        match q.receive(1, 60_000 * MS, 100 * MS).await {
            Ok(got) => {
                assert!(got.is_empty(), "{got:?}");
                break;
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    assert_eq!(errors.len(), 1, "one wait refused, then waits on the new primary: {errors:?}");
    assert!(errors[0].contains("read only replica"), "{errors:?}");
    a_publish_wakes_a_waiting_receive(&q).await;
    assert_eq!(proxy.opened(), opened + 2, "one new connection for the waits");
}

/// A hint handed back with a delay (a worker that received it but cannot take it) wakes
/// a receiver of another handle that is already waiting: it gets the hint soon after the
/// delay, not at the end of its own wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_hand_back_wakes_a_waiting_receiver() {
    let Some(a) = queue_or_skip("redis hand-back wake", URL_VAR, fresh_queue().await) else {
        return;
    };
    let url = std::env::var(URL_VAR).unwrap();
    let b = RedisQueue::connect(RedisQueueConfig::new(&url, a.name())).await.unwrap();
    a.enqueue(vec![Hint::new(InstanceId(9), 1)]).await.unwrap();
    let held = a.receive(1, 60_000 * MS, 1000 * MS).await.unwrap();
    assert_eq!(held.len(), 1);
    let waiter = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let got = b.receive(1, 30_000 * MS, 5000 * MS).await.unwrap();
        (got, started.elapsed())
    });
    // The other handle is in its wait well before the hand-back.
    tokio::time::sleep(300 * MS).await;
    let handed_back = std::time::Instant::now();
    a.nack(held[0].receipt.clone(), 50 * MS).await.unwrap();
    let (got, _) = waiter.await.unwrap();
    let after = handed_back.elapsed();
    assert_eq!(got.iter().map(|d| d.hint.instance.0).collect::<Vec<_>>(), [9]);
    assert!(after < 1000 * MS, "the waiting receiver got the hint {after:?} after the hand-back");
}

/// `rediss://` (TLS, as managed Redis services with encryption in transit require) is
/// built in: a server that is not there is `Unavailable`, and a server that does not
/// speak TLS fails the handshake, not the URL.
#[tokio::test]
async fn rediss_urls_connect_with_tls() {
    let err = RedisQueue::connect(RedisQueueConfig::new("rediss://:s3cret@127.0.0.1:9/0", "q"))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert!(err.message.starts_with("redis at rediss://:***@127.0.0.1:9/0: "), "{err}");
    let url = std::env::var(URL_VAR).ok();
    let Some(url) = queue_or_skip("redis TLS handshake", URL_VAR, url) else { return };
    // The test server speaks plain RESP: the TLS handshake with it fails.
    let tls = url.replacen("redis://", "rediss://", 1);
    let err = RedisQueue::connect(RedisQueueConfig::new(&tls, "q")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert!(!err.message.contains("feature"), "{err}");
}
