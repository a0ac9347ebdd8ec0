//! Focused tests of the PostgreSQL store: migrations, the main paths, and invalid input
//! (typed errors, no partial writes).

mod common;

use keel_core::instance::{HistoryEntry, NewInstance, NewSignal, SignalTarget};
use keel_core::outcome::{Outcome, StepCommit, StepFailure};
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, ClaimParams, CommitParams, DeadLetterFilter, DeadLetterRetryParams,
    DeadLetterSelector, DeliveryOutcome, InsertOutcome, InsertParams, LeaseReapParams,
    QueuePauseParams, SignalDeliverParams,
};
use keel_core::{
    ErrorKind, InstanceId, MachineRef, Status, StatusSet, Timestamp, WorkerId, limits,
};
use keel_store_postgres::{PgConfig, PgStore};
use serde_json::json;
use std::fmt::Write as _;
use std::time::Duration;

const T0: Timestamp = Timestamp(1_700_000_000_000);

fn new(pos: &str) -> NewInstance {
    NewInstance::new(MachineRef::new("m", 1), pos)
}

fn claim_params(limit: usize, now: Timestamp) -> ClaimParams {
    ClaimParams {
        worker: WorkerId("w1".into()),
        namespaces: vec![],
        queues: vec![],
        machines: vec![],
        limit,
        lease: Duration::from_secs(30),
        now,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    }
}

async fn insert(s: &PgStore, items: Vec<NewInstance>) -> Vec<InsertOutcome> {
    s.instance_insert(InsertParams { instances: items, now: T0 }).await.unwrap()
}

async fn commit_one(
    s: &PgStore,
    c: StepCommit,
) -> keel_core::StoreResult<keel_core::ports::store::CommitReceipt> {
    s.step_commit(CommitParams { commits: vec![c], now: T0 }).await.unwrap().remove(0)
}

#[tokio::test]
async fn migrate_is_idempotent_and_refuses_a_newer_schema() {
    let Some(s) = common::store().await else { return };
    s.migrate().await.unwrap();
    let c = s.client().await.unwrap();
    c.batch_execute(
        "INSERT INTO keel_schema_history (version, name, applied_on, checksum) VALUES (99, 'future', '', '0')",
    )
    .await
    .unwrap();
    // A deployment problem (upgrade Keel), as on SQLite: `Invalid`, from both entry points.
    let err = s.migrate().await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
    assert!(err.message.contains("newer"), "{err}");
    assert!(err.message.contains("upgrade keel"), "{err}");
    let err = s.check_migrated().await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
    assert!(err.message.contains("newer"), "{err}");
}

/// A schema whose recorded migrations differ from this build's is refused as a `Conflict`
/// (retrying will not help), naming the history table.
#[tokio::test]
async fn migrate_refuses_a_divergent_history() {
    let Some(s) = common::store().await else { return };
    let c = s.client().await.unwrap();
    c.batch_execute("UPDATE keel_schema_history SET checksum = '1' WHERE version = 1")
        .await
        .unwrap();
    let err = s.migrate().await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert!(err.message.contains("keel_schema_history"), "{err}");
}

#[tokio::test]
async fn concurrent_migrations_apply_once() {
    let Some(url) = common::database_url() else { return };
    let schema = common::fresh_schema();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let cfg = PgConfig::new(url.clone()).schema(schema.clone()).pool_size(1);
        tasks.push(tokio::spawn(
            async move { PgStore::connect(cfg).await.unwrap().migrate().await },
        ));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn bad_schema_names_are_refused() {
    let Some(url) = common::database_url() else { return };
    let err = PgStore::connect(PgConfig::new(url).schema("Robert'); DROP")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
}

/// A caller waiting for results is woken when a commit ends an instance and when a cancel
/// ends one; a commit that only parks one does not wake it.
#[tokio::test]
async fn waiters_for_results_are_woken_when_instances_end() {
    let Some(s) = common::store().await else { return };
    let s = std::sync::Arc::new(s);
    let ids = insert(&s, vec![new("a"), new("b")]).await;
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    let woken = |s: std::sync::Arc<PgStore>| {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let wait = s.instance_change_wait();
            tokio::pin!(wait);
            // Poll once so the wait is registered (and listening) before the commit.
            let _ = futures_poll_once(&mut wait).await;
            let _ = ready_tx.send(());
            wait.await;
        });
        (task, ready_rx)
    };
    // Parking does not end anything.
    let (task, ready) = woken(std::sync::Arc::clone(&s));
    ready.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let park = Outcome::Await { signal: "*".into(), context: json!({}), step: None };
    commit_one(&s, StepCommit::new(ids[0].id(), claims[0].token(), park)).await.unwrap();
    let parked = tokio::time::timeout(Duration::from_millis(500), task).await;
    assert!(parked.is_err(), "a park is not an end");
    // A commit that ends an instance wakes the waiter.
    let (task, ready) = woken(std::sync::Arc::clone(&s));
    ready.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let done = Outcome::Done { result: json!({}), step: None };
    commit_one(&s, StepCommit::new(ids[1].id(), claims[1].token(), done)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), task).await.expect("woken by the end").unwrap();
    // So does a cancel.
    let (task, ready) = woken(std::sync::Arc::clone(&s));
    ready.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cancel = CancelParams {
        id: ids[0].id(),
        reason: "test".into(),
        cascade: false,
        now: T0,
        only_in: None,
    };
    s.instance_cancel(cancel).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), task).await.expect("woken by the cancel").unwrap();
}

/// Polls `fut` once without blocking.
async fn futures_poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut *fut).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

#[tokio::test]
async fn insert_claim_commit_done_round_trip() {
    let Some(s) = common::store().await else { return };
    let ids = insert(&s, vec![new("a"), new("b")]).await;
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    assert_eq!(claims.len(), 2);
    assert_eq!(claims[0].instance.id, ids[0].id());
    assert_eq!(claims[0].instance.status, Status::Executing);
    assert_eq!(claims[0].token().0, 1);
    let commits = claims
        .iter()
        .map(|c| {
            StepCommit::new(
                c.instance.id,
                c.token(),
                Outcome::Done { result: json!({"ok": 1}), step: None },
            )
        })
        .collect();
    let out = s.step_commit(CommitParams { commits, now: T0 }).await.unwrap();
    for r in &out {
        let r = r.as_ref().unwrap();
        assert_eq!(r.status, Status::Done);
        assert_eq!(r.revision.0, 1);
    }
    let d = s.instance_get(ids[0].id()).await.unwrap();
    assert_eq!(d.instance.result, Some(json!({"ok": 1})));
    assert_eq!(d.history.len(), 1);
    assert_eq!(d.history[0].entry.kind, "STEP_DONE");
    // A stale commit is rejected and changes nothing.
    let stale = commit_one(
        &s,
        StepCommit::new(ids[0].id(), claims[0].token(), Outcome::Stop { reason: "x".into() }),
    )
    .await;
    assert_eq!(stale.unwrap_err().kind, ErrorKind::LeaseLost);
    assert_eq!(s.instance_get(ids[0].id()).await.unwrap().instance.status, Status::Done);
}

#[tokio::test]
async fn uniqueness_within_a_batch_and_against_existing_rows() {
    let Some(s) = common::store().await else { return };
    let a = new("a").unique(b"k".to_vec(), StatusSet::LIVE);
    let out = insert(&s, vec![a.clone(), a.clone(), new("x")]).await;
    assert!(matches!(out[0], InsertOutcome::Inserted(_)));
    assert_eq!(out[1], InsertOutcome::Existing(out[0].id()));
    assert!(matches!(out[2], InsertOutcome::Inserted(_)));
    let again = insert(&s, vec![a.clone()]).await;
    assert_eq!(again[0], InsertOutcome::Existing(out[0].id()));
    // Leaving the scope frees the key.
    s.instance_cancel(CancelParams {
        id: out[0].id(),
        reason: "r".into(),
        cascade: false,
        now: T0,
        only_in: None,
    })
    .await
    .unwrap();
    let third = insert(&s, vec![a]).await;
    assert!(matches!(third[0], InsertOutcome::Inserted(id) if id != out[0].id()));
}

#[tokio::test]
async fn await_parks_and_a_signal_wakes_with_dedup() {
    let Some(s) = common::store().await else { return };
    let id = insert(&s, vec![new("a")]).await[0].id();
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    let r = commit_one(
        &s,
        StepCommit::new(
            id,
            c.token(),
            Outcome::Await { signal: "go".into(), context: json!({}), step: None },
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.status, Status::AwaitingSignal);
    let sig = NewSignal::new(id, "go").dedup_key("d1");
    let out = s
        .signal_deliver(SignalDeliverParams {
            signals: vec![sig.clone(), sig, NewSignal::new(InstanceId(999_999), "go")],
            now: T0,
        })
        .await
        .unwrap();
    assert!(matches!(out[0], DeliveryOutcome::Delivered { woke: true, .. }));
    assert!(matches!(out[1], DeliveryOutcome::Duplicate { .. }));
    assert_eq!(out[2], DeliveryOutcome::TargetMissing);
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    assert_eq!(c.inbox.len(), 1);
    assert_eq!(c.inbox[0].name, "go");
    let r = commit_one(
        &s,
        StepCommit::new(
            id,
            c.token(),
            Outcome::Next { step: "b".into(), context: json!({"n": 1}) },
        )
        .consume([c.inbox[0].id]),
    )
    .await
    .unwrap();
    assert_eq!(r.status, Status::Runnable);
    assert!(s.instance_get(id).await.unwrap().inbox.is_empty());
}

#[tokio::test]
async fn await_with_a_waiting_signal_stays_runnable() {
    let Some(s) = common::store().await else { return };
    let id = insert(&s, vec![new("a")]).await[0].id();
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    s.signal_deliver(SignalDeliverParams { signals: vec![NewSignal::new(id, "go")], now: T0 })
        .await
        .unwrap();
    let r = commit_one(
        &s,
        StepCommit::new(
            id,
            c.token(),
            Outcome::Await { signal: "*".into(), context: json!({}), step: None },
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.status, Status::Runnable);
}

#[tokio::test]
async fn children_barrier_releases_the_parent_once() {
    let Some(s) = common::store().await else { return };
    let parent = insert(&s, vec![new("p")]).await[0].id();
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    let kids = vec![
        new("c"),
        new("c"),
        new("c").unique(b"u".to_vec(), StatusSet::LIVE),
        new("c").unique(b"u".to_vec(), StatusSet::LIVE),
    ];
    let r = commit_one(
        &s,
        StepCommit::new(
            parent,
            c.token(),
            Outcome::ScheduleChildren {
                next: "join".into(),
                children: kids,
                context: json!({}),
                join: keel_core::join::Join::default(),
            },
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.status, Status::AwaitingChildren);
    assert_eq!(r.children.len(), 4);
    assert_eq!(r.children[3], InsertOutcome::Existing(r.children[2].id()));
    assert_eq!(s.instance_get(parent).await.unwrap().instance.children_pending, 3);
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    assert_eq!(claims.len(), 3);
    let commits = claims
        .iter()
        .map(|c| {
            StepCommit::new(
                c.instance.id,
                c.token(),
                Outcome::Done { result: json!(null), step: None },
            )
        })
        .collect();
    s.step_commit(CommitParams { commits, now: T0 }).await.unwrap();
    let p = s.instance_get(parent).await.unwrap();
    assert_eq!(p.instance.status, Status::Runnable);
    assert_eq!(p.instance.children_pending, 0);
    assert_eq!(p.instance.position, "join");
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    assert_eq!(c.children.len(), 3);
    assert_eq!(c.children[0].result, Some(json!(null)));
}

#[tokio::test]
async fn concurrency_key_one_at_a_time_and_paused_queues_skipped() {
    let Some(s) = common::store().await else { return };
    insert(
        &s,
        vec![new("a").concurrency_key("k"), new("b").concurrency_key("k"), new("c").queue("q2")],
    )
    .await;
    s.queue_pause(QueuePauseParams {
        namespace: "default".into(),
        queue: "q2".into(),
        paused: true,
        now: T0,
    })
    .await
    .unwrap();
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].instance.position, "a");
    assert!(s.instance_claim(claim_params(10, T0)).await.unwrap().is_empty());
    commit_one(
        &s,
        StepCommit::new(
            claims[0].instance.id,
            claims[0].token(),
            Outcome::Done { result: json!(1), step: None },
        ),
    )
    .await
    .unwrap();
    s.queue_pause(QueuePauseParams {
        namespace: "default".into(),
        queue: "q2".into(),
        paused: false,
        now: T0,
    })
    .await
    .unwrap();
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    assert_eq!(claims.len(), 2);
}

#[tokio::test]
async fn reaper_and_dead_letters() {
    let Some(s) = common::store().await else { return };
    let id = insert(&s, vec![new("a")]).await[0].id();
    s.instance_claim(claim_params(1, T0)).await.unwrap();
    let later = T0.plus(Duration::from_mins(1));
    let reaped =
        s.lease_reap(LeaseReapParams { owner: None, limit: 10, now: later }).await.unwrap();
    assert_eq!(reaped, vec![id]);
    let c = s.instance_claim(claim_params(1, later)).await.unwrap().remove(0);
    assert_eq!(c.instance.attempt, 1);
    let failure = StepFailure {
        error: "boom".into(),
        retryable: true,
        dead_letter: true,
        signals: vec![],
        event: None,
    };
    let r = s
        .step_commit(CommitParams {
            commits: vec![
                StepCommit::new(id, c.token(), Outcome::Suspend)
                    .failure(failure)
                    .record(HistoryEntry::new("X", json!({}))),
            ],
            now: later,
        })
        .await
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(r.status, Status::Suspended);
    let dl = r.dead_letter.unwrap();
    let letters = s.dead_letter_list(DeadLetterFilter::default()).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].id, dl);
    assert_eq!(letters[0].letter.attempts, 2);
    let retried = s
        .dead_letter_retry(DeadLetterRetryParams {
            selector: DeadLetterSelector::Id(dl),
            delay: Duration::ZERO,
            now: later,
        })
        .await
        .unwrap();
    assert_eq!(retried, vec![id]);
    assert!(s.dead_letter_list(DeadLetterFilter::default()).await.unwrap().is_empty());
    assert_eq!(s.instance_get(id).await.unwrap().instance.status, Status::Runnable);
}

#[tokio::test]
async fn invalid_input_gets_a_typed_error_and_writes_nothing() {
    let Some(s) = common::store().await else { return };
    // A context that is not an object, in the middle of a batch: nothing is inserted.
    let err = s
        .instance_insert(InsertParams {
            instances: vec![new("a"), new("b").context(json!([1])), new("c")],
            now: T0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.contains("instances[1].context"), "{err}");
    assert!(s.instance_claim(claim_params(10, T0)).await.unwrap().is_empty());
    // Over-limit payload.
    let big = json!({ "x": "a".repeat(limits::PAYLOAD_BYTES_MAX) });
    let err = s
        .instance_insert(InsertParams { instances: vec![new("a").context(big.clone())], now: T0 })
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    let err = s
        .signal_deliver(SignalDeliverParams {
            signals: vec![NewSignal::new(InstanceId(1), "s").payload(big.clone())],
            now: T0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
    // Unknown ids.
    assert_eq!(s.instance_get(InstanceId(424_242)).await.unwrap_err().kind, ErrorKind::NotFound);
    let err = s
        .instance_cancel(CancelParams {
            id: InstanceId(424_242),
            reason: "r".into(),
            cascade: true,
            now: T0,
            only_in: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
    let r = commit_one(
        &s,
        StepCommit::new(
            InstanceId(424_242),
            keel_core::FencingToken(1),
            Outcome::Done { result: json!(1), step: None },
        ),
    )
    .await;
    assert_eq!(r.unwrap_err().kind, ErrorKind::NotFound);
    // A bad item in a commit batch is rejected alone; its row is unchanged, the good one commits.
    let ids = insert(&s, vec![new("a"), new("b")]).await;
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    let bad = StepCommit::new(
        ids[0].id(),
        claims[0].token(),
        Outcome::Next { step: "n".into(), context: json!("str") },
    );
    let bad_big =
        StepCommit::new(ids[1].id(), claims[1].token(), Outcome::Done { result: big, step: None });
    let good = StepCommit::new(
        ids[1].id(),
        claims[1].token(),
        Outcome::Done { result: json!(2), step: None },
    );
    let out =
        s.step_commit(CommitParams { commits: vec![bad, bad_big, good], now: T0 }).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap_err().kind, ErrorKind::Invalid);
    assert_eq!(out[1].as_ref().unwrap_err().kind, ErrorKind::Invalid);
    assert_eq!(out[2].as_ref().unwrap().status, Status::Done);
    let row = s.instance_get(ids[0].id()).await.unwrap();
    assert_eq!(row.instance.status, Status::Executing);
    assert_eq!(row.instance.revision.0, 0);
    assert!(row.history.is_empty());
    // Over-limit batch.
    let err = s.instance_claim(claim_params(limits::CLAIM_BATCH_MAX + 1, T0)).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Invalid);
}

#[tokio::test]
async fn cancel_cascades_to_descendants() {
    let Some(s) = common::store().await else { return };
    let parent = insert(&s, vec![new("p")]).await[0].id();
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    let r = commit_one(
        &s,
        StepCommit::new(
            parent,
            c.token(),
            Outcome::ScheduleChildren {
                next: "j".into(),
                children: vec![new("c"), new("c")],
                context: json!({}),
                join: keel_core::join::Join::default(),
            },
        ),
    )
    .await
    .unwrap();
    let cancelled = s
        .instance_cancel(CancelParams {
            id: parent,
            reason: "stop".into(),
            cascade: true,
            now: T0,
            only_in: None,
        })
        .await
        .unwrap();
    assert_eq!(cancelled.len(), 3);
    for o in r.children {
        assert_eq!(s.instance_get(o.id()).await.unwrap().instance.status, Status::Cancelled);
    }
}

#[tokio::test]
async fn lookup_by_business_key_and_notifications() {
    let Some(s) = common::store().await else { return };
    let mut listener = s.listen().await.unwrap();
    let id = insert(&s, vec![new("a").business_key("order:1")]).await[0].id();
    let target = SignalTarget::Key {
        namespace: "default".into(),
        machine: "m".into(),
        key: "order:1".into(),
    };
    assert_eq!(s.instance_lookup(target).await.unwrap(), Some(id));
    tokio::time::timeout(Duration::from_secs(5), listener.recv()).await.unwrap().unwrap();
    assert!(s.capabilities().notifications);
}

/// The longest schema names still get their wake-ups: the channel (`keel_<schema>_ready`
/// would be longer than PostgreSQL allows) is shortened the same way for `LISTEN` and
/// `pg_notify`, and two long names with the same prefix get different channels.
#[tokio::test]
async fn a_schema_name_of_63_characters_still_gets_wake_ups() {
    let Some(url) = common::database_url() else { return };
    let base = common::fresh_schema();
    let long = |tail: char| {
        let mut name = base.clone();
        while name.len() < 62 {
            name.push('x');
        }
        name.push(tail);
        name
    };
    let (a, b) = (long('a'), long('b'));
    assert_eq!(a.len(), 63);
    let store = PgStore::connect(PgConfig::new(&url).schema(a.clone())).await.unwrap();
    let other = PgStore::connect(PgConfig::new(&url).schema(b)).await.unwrap();
    assert!(store.channel().len() <= 63, "{}", store.channel());
    assert_ne!(store.channel(), other.channel());
    store.migrate().await.unwrap();
    let mut listener = store.listen().await.unwrap();
    insert(&store, vec![new("a")]).await;
    tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("the insert's wake-up arrives")
        .unwrap();
    let c = store.client().await.unwrap();
    c.batch_execute(&format!("DROP SCHEMA \"{a}\" CASCADE")).await.unwrap();
}

#[tokio::test]
async fn a_claim_is_not_shortened_by_rows_of_a_busy_or_repeated_key() {
    let Some(s) = common::store().await else { return };
    let mut items: Vec<NewInstance> = (0..5).map(|_| new("k").concurrency_key("k")).collect();
    items.extend((0..3).map(|_| new("free")));
    insert(&s, items).await;
    let claims = s.instance_claim(claim_params(4, T0)).await.unwrap();
    let positions: Vec<&str> = claims.iter().map(|c| c.instance.position.as_str()).collect();
    assert_eq!(positions, vec!["k", "free", "free", "free"]);
}

#[tokio::test]
async fn a_key_scoped_to_executing_only_runs_one_at_a_time() {
    let Some(s) = common::store().await else { return };
    let scope = StatusSet::of(&[Status::Executing]);
    let out = insert(
        &s,
        vec![new("a").unique(b"x".to_vec(), scope), new("b").unique(b"x".to_vec(), scope)],
    )
    .await;
    assert!(
        out.iter().all(|o| matches!(o, InsertOutcome::Inserted(_))),
        "not occupied while runnable"
    );
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    assert_eq!(claims.len(), 1);
    assert!(s.instance_claim(claim_params(10, T0)).await.unwrap().is_empty());
    commit_one(
        &s,
        StepCommit::new(
            claims[0].instance.id,
            claims[0].token(),
            Outcome::Done { result: json!(1), step: None },
        ),
    )
    .await
    .unwrap();
    assert_eq!(s.instance_claim(claim_params(10, T0)).await.unwrap().len(), 1);
}

/// Every sweeper of all machines notes its sweep in one row; a sweep must not wait for
/// another sweep's transaction that holds it.
#[tokio::test]
async fn a_sweep_does_not_wait_for_another_sweep_noting_its_time() {
    use keel_core::chart::{TimerArm, TimerKind};
    use keel_core::ports::store::TimerSweepParams;
    let Some(s) = common::store().await else { return };
    let sweep = |now: Timestamp| {
        s.timer_sweep(TimerSweepParams { namespace: None, machines: vec![], limit: 100, now })
    };
    let id = insert(&s, vec![new("wait")]).await[0].id();
    let c = s.instance_claim(claim_params(1, T0)).await.unwrap().remove(0);
    let mut park = StepCommit::new(
        id,
        c.token(),
        Outcome::Await { signal: "*".into(), context: json!({}), step: None },
    );
    park.timers_arm = vec![TimerArm {
        state: "wait".into(),
        event: "WAKE".into(),
        kind: TimerKind::After,
        interval: Duration::from_secs(1),
        max: None,
        then: None,
    }];
    commit_one(&s, park).await.unwrap();
    assert_eq!(sweep(T0).await.unwrap().fired, 0, "nothing due yet; the sweep is noted");

    // Another sweep's transaction holds the row.
    let holder = s.client().await.unwrap();
    holder.batch_execute("BEGIN; SELECT * FROM timer_sweeps FOR UPDATE").await.unwrap();
    let later = T0.plus(Duration::from_secs(2));
    let report = tokio::time::timeout(Duration::from_secs(10), sweep(later))
        .await
        .expect("the sweep waited for another sweep's lock")
        .unwrap();
    assert_eq!(report.fired, 1);
    holder.batch_execute("ROLLBACK").await.unwrap();

    let later = T0.plus(Duration::from_secs(3));
    sweep(later).await.unwrap();
    let noted: i64 = holder
        .query_one("SELECT (extract(epoch FROM swept_at) * 1000)::int8 FROM timer_sweeps", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(noted, later.0, "a sweep with the row free notes its time");
}

/// The size of the store's out-of-line storage of `instances` (where large contexts
/// live). The schema is the test's own, so nothing else writes there.
async fn out_of_line(s: &PgStore) -> i64 {
    let db = s.client().await.unwrap();
    let size =
        "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'instances'::regclass";
    db.query_one(size, &[]).await.unwrap().get(0)
}

/// Commits `c` and tells how many bytes [`out_of_line`] grew by meanwhile.
async fn stored_by(s: &PgStore, c: StepCommit) -> (keel_core::ports::store::CommitReceipt, i64) {
    let before = out_of_line(s).await;
    let receipt = commit_one(s, c).await.unwrap();
    (receipt, out_of_line(s).await - before)
}

#[tokio::test]
async fn a_step_that_leaves_a_large_context_alone_does_not_write_it_again() {
    let Some(s) = common::store().await else { return };
    // 64 KiB of digits that do not compress much: stored out of line, tens of KiB a copy.
    let mut filler = String::with_capacity(65_536);
    for i in 0..8_192u64 {
        write!(filler, "{:08x}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32).unwrap();
    }
    let large = json!({ "filler": filler });
    let ids = insert(&s, (0..3).map(|_| new("a").context(large.clone())).collect()).await;
    let claims = s.instance_claim(claim_params(10, T0)).await.unwrap();
    assert_eq!(claims.len(), 3);
    let token = |id: InstanceId| claims.iter().find(|c| c.instance.id == id).unwrap().token();
    let (ending, moving, parking) = (ids[0].id(), ids[1].id(), ids[2].id());

    // A step that ends without touching the context: the stored copy stays.
    let (done, grew) = stored_by(
        &s,
        StepCommit::new(
            ending,
            token(ending),
            Outcome::Done { result: json!({"ok": true}), step: None },
        ),
    )
    .await;
    assert_eq!(done.status, Status::Done);
    assert_eq!(grew, 0, "the commit stored {grew} more bytes: it copied the 64 KiB context");
    let read = s.instance_get(ending).await.unwrap().instance;
    assert_eq!(read.context, large);
    assert_eq!(read.result, Some(json!({"ok": true})));

    // A step that changes it: the new one is written.
    let changed = json!({ "filler": filler, "n": 1 });
    let (next, grew) = stored_by(
        &s,
        StepCommit::new(
            moving,
            token(moving),
            Outcome::Next { step: "b".into(), context: changed.clone() },
        ),
    )
    .await;
    assert_eq!(next.status, Status::Runnable);
    assert!(grew > 16_384, "the commit stored {grew} more bytes: the new context is missing");
    assert_eq!(s.instance_get(moving).await.unwrap().instance.context, changed);

    // Parking on a signal with the same context, then the signal's wake-up: neither
    // stores it again.
    let park = Outcome::Await { signal: "go".into(), context: large.clone(), step: None };
    let (parked, grew) = stored_by(&s, StepCommit::new(parking, token(parking), park)).await;
    assert_eq!(parked.status, Status::AwaitingSignal);
    assert_eq!(grew, 0, "parking stored {grew} more bytes: it copied the context");
    let before = out_of_line(&s).await;
    let out = s
        .signal_deliver(SignalDeliverParams {
            signals: vec![NewSignal::new(parking, "go")],
            now: T0,
        })
        .await
        .unwrap();
    assert!(matches!(out[0], DeliveryOutcome::Delivered { woke: true, .. }), "{out:?}");
    let grew = out_of_line(&s).await - before;
    assert_eq!(grew, 0, "the wake-up stored {grew} more bytes: it copied the context");
    let woken = s.instance_get(parking).await.unwrap().instance;
    assert_eq!((woken.status, woken.context), (Status::Runnable, large));
}
