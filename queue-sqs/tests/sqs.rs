//! What SQS adds beyond the shared contracts: redrive to the dead-letter queue,
//! deduplication on FIFO queues, and clear errors for a wrong endpoint or name.

use keel_core::ports::Queue;
use keel_core::ports::queue::Hint;
use keel_core::{ErrorKind, InstanceId};
use keel_queue_sqs::testing::{ENDPOINT_VAR, fresh_queue_with};
use keel_queue_sqs::{SqsQueue, static_client};
use keel_testkit::conformance::queue::queue_or_skip;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

/// A hint received `max_receives` times without an ack moves to the dead-letter queue;
/// the repair pass (not the DLQ) is what brings its work back.
#[tokio::test]
async fn unacked_hint_moves_to_the_dead_letter_queue() {
    let Some(q) =
        queue_or_skip("sqs redrive", ENDPOINT_VAR, fresh_queue_with(false, Some(2)).await)
    else {
        return;
    };
    q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap();
    for n in 1..=2 {
        let got = q.receive(1, S, 3 * S).await.unwrap();
        assert_eq!(got.len(), 1, "receive {n}");
        assert_eq!(got[0].receive_count, n);
    }
    tokio::time::sleep(S + Duration::from_millis(200)).await;
    assert!(q.receive(1, S, S).await.unwrap().is_empty(), "redriven after two receives");
    let dlq = q.dead_letter_queue().await.unwrap();
    let dead = dlq.receive(1, S, 2 * S).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].hint.instance, InstanceId(1));
}

/// On a FIFO queue the same instance and revision published twice is delivered once; a
/// new revision is a new hint.
#[tokio::test]
async fn fifo_deduplicates_instance_and_revision() {
    let Some(q) = queue_or_skip("sqs fifo dedup", ENDPOINT_VAR, fresh_queue_with(true, None).await)
    else {
        return;
    };
    let h = Hint::new(InstanceId(7), 3);
    q.enqueue(vec![h.clone(), h.clone()]).await.unwrap();
    q.enqueue(vec![h.clone(), Hint::new(InstanceId(7), 4)]).await.unwrap();
    let mut revisions = Vec::new();
    for _ in 0..4 {
        let got = q.receive(10, 5 * S, S).await.unwrap();
        revisions.extend(got.iter().map(|d| d.hint.revision));
        q.ack(got.into_iter().map(|d| d.receipt).collect()).await.unwrap();
    }
    assert_eq!(revisions, vec![3, 4]);
}

/// A standard queue does not deduplicate: both copies arrive, which is why a receiver
/// treats a hint as "go and look" and the store's fencing keeps the work single.
#[tokio::test]
async fn standard_queue_delivers_duplicates() {
    let Some(q) =
        queue_or_skip("sqs duplicates", ENDPOINT_VAR, fresh_queue_with(false, None).await)
    else {
        return;
    };
    let h = Hint::new(InstanceId(7), 3);
    q.enqueue(vec![h.clone(), h]).await.unwrap();
    let mut n = 0;
    for _ in 0..4 {
        let got = q.receive(10, 5 * S, S).await.unwrap();
        n += got.len();
        q.ack(got.into_iter().map(|d| d.receipt).collect()).await.unwrap();
    }
    assert_eq!(n, 2);
}

/// A FIFO queue refuses delayed hints instead of delivering them early.
#[tokio::test]
async fn fifo_refuses_delays_naming_the_fix() {
    let Some(q) = queue_or_skip("sqs fifo delay", ENDPOINT_VAR, fresh_queue_with(true, None).await)
    else {
        return;
    };
    let err = q.enqueue(vec![Hint::new(InstanceId(1), 1).delay(S)]).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.contains("keep the work in the store"), "{err}");
}

/// A bad queue name or receive count is refused before any call; an endpoint that does not answer is
/// `Unavailable` (retryable), not a hang.
#[tokio::test]
async fn bad_name_and_dead_endpoint() {
    let client = static_client("http://127.0.0.1:9", "us-east-1");
    let err = SqsQueue::create(client.clone(), "no spaces", None).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.starts_with("name"), "{err}");
    let err = SqsQueue::create(client.clone(), "hints", Some(1_001)).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid, "refused before any call: {err}");
    assert!(err.message.starts_with("max_receives: 1001") && err.message.contains("1 to 1000"));
    let q = SqsQueue::open(client, "http://127.0.0.1:9/000000000000/nowhere");
    let err = q.enqueue(vec![Hint::new(InstanceId(1), 1)]).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
}

/// Receives until `want` hints arrived (at most 10 rounds), acking each; the instances in
/// the order received.
async fn drain(q: &SqsQueue, want: usize) -> Vec<i64> {
    let mut seen = Vec::new();
    for _ in 0..10 {
        if seen.len() >= want {
            break;
        }
        let got = q.receive(10, 10 * S, S).await.unwrap();
        seen.extend(got.iter().map(|d| d.hint.instance.0));
        if !got.is_empty() {
            q.ack(got.into_iter().map(|d| d.receipt).collect()).await.unwrap();
        }
    }
    seen
}

/// On a FIFO queue, concurrency keys that SQS would refuse as a `MessageGroupId` (a
/// space, non-ASCII, over 128 characters) still publish, and one key's hints keep their
/// order.
#[tokio::test]
async fn fifo_takes_any_concurrency_key_as_its_group() {
    let Some(q) =
        queue_or_skip("sqs fifo group ids", ENDPOINT_VAR, fresh_queue_with(true, None).await)
    else {
        return;
    };
    let long = "k".repeat(200);
    let hints: Vec<Hint> = (1..=11)
        .map(|n| {
            let group = match n {
                1..=3 => "a b",
                4 => "café",
                5 => long.as_str(),
                _ => "plain-key",
            };
            Hint::new(InstanceId(n), 1).group(group)
        })
        .collect();
    q.enqueue(hints).await.unwrap();
    let seen = drain(&q, 11).await;
    let mut all = seen.clone();
    all.sort_unstable();
    assert_eq!(all, (1..=11).collect::<Vec<_>>(), "every hint arrives once");
    let key_a_b: Vec<i64> = seen.into_iter().filter(|n| (1..=3).contains(n)).collect();
    assert_eq!(key_a_b, [1, 2, 3], "one key's hints in publish order");
}

/// A stand-in SQS endpoint that answers `SendMessageBatch` only: it refuses the entry of
/// instance 1, refuses as a whole a batch that holds instance 15, accepts every other
/// entry and records its instance. It serves at most 100 connections, one call each.
fn fake_sqs() -> (String, Arc<Mutex<Vec<i64>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&accepted);
    std::thread::spawn(move || {
        for stream in listener.incoming().take(100).flatten() {
            let _ = answer_send_batch(stream, &sink);
        }
    });
    (url, accepted)
}

fn answer_send_batch(mut stream: TcpStream, accepted: &Mutex<Vec<i64>>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut length = 0;
    for _ in 0..100 {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let body = String::from_utf8_lossy(&body);
    // The SDK writes compact JSON; each entry has one `Id` and one `MessageBody`, whose
    // first field is the instance.
    let values = |key: &str| -> Vec<String> {
        body.match_indices(key)
            .map(|(at, _)| {
                let rest = &body[at + key.len()..];
                rest[..rest.find('"').unwrap_or(rest.len())].to_owned()
            })
            .collect()
    };
    let ids = values("\"Id\":\"");
    let instances: Vec<i64> = values("\"MessageBody\":\"")
        .iter()
        .map(|b| b.split('|').next().and_then(|n| n.parse().ok()).unwrap_or(-1))
        .collect();
    let (status, reply) = if instances.contains(&15) {
        (
            "400 Bad Request",
            r#"{"__type":"com.amazonaws.sqs#InvalidParameterValue","message":"whole batch refused"}"#
                .to_owned(),
        )
    } else {
        let (mut sent, mut failed) = (Vec::new(), Vec::new());
        for (id, n) in ids.iter().zip(&instances) {
            if *n == 1 {
                failed.push(format!(
                    r#"{{"Id":"{id}","SenderFault":true,"Code":"InvalidParameterValue","Message":"entry refused"}}"#
                ));
            } else {
                accepted.lock().unwrap().push(*n);
                sent.push(format!(r#"{{"Id":"{id}","MessageId":"m{id}","MD5OfMessageBody":"-"}}"#));
            }
        }
        (
            "200 OK",
            format!(r#"{{"Successful":[{}],"Failed":[{}]}}"#, sent.join(","), failed.join(",")),
        )
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/x-amz-json-1.0\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{reply}",
        reply.len()
    )?;
    stream.flush()
}

/// A publish does not stop at a refused entry or a refused batch of 10: every other hint
/// is sent, then the error says how many were refused and why.
#[tokio::test]
async fn refusals_do_not_stop_the_other_batches() {
    let (url, accepted) = fake_sqs();
    let q = SqsQueue::open(static_client(&url, "us-east-1"), format!("{url}/000000000000/q"));
    let err = q.enqueue((1..=25).map(|n| Hint::new(InstanceId(n), 1)).collect()).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    assert!(err.message.contains("11 of 25 hints refused"), "{err}");
    assert!(err.message.contains("instance 1: InvalidParameterValue entry refused"), "{err}");
    let mut sent = accepted.lock().unwrap().clone();
    sent.sort_unstable();
    let expected: Vec<i64> = (2..=10).chain(21..=25).collect();
    assert_eq!(sent, expected, "the batches after a refusal were sent");
}
