//! The sweeper on `MemoryStore` + `VirtualClock`: batching (in waves), backpressure (skipped and
//! logged, fired on the next sweep below the threshold; a recent reading reused; only the
//! group's machines counted; one batch once timers are a cadence late),
//! configuration bounds, the cadence loop, and the run loop's sleeping until the earliest
//! due time.

use keel_core::chart::{TimerArm, TimerKind};
use keel_core::instance::{ANY_SIGNAL, NewInstance};
use keel_core::ports::store::{ClaimParams, CommitParams};
use keel_core::ports::{Clock, Store};
use keel_core::{InstanceId, MachineRef, Outcome, StepCommit, Timestamp, WorkerId};
use keel_testkit::{MemoryStore, VirtualClock};
use keel_timers::{SweepConfig, SweepGroup, SweepOutcome, Sweeper};
use serde_json::json;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const T0: Timestamp = Timestamp(1_700_000_000_000);

/// Inserts `n` instances of `machine`, each parked with one `after 1 s` timer.
async fn with_timers(
    store: &MemoryStore,
    machine: &str,
    n: usize,
    now: Timestamp,
) -> Vec<InstanceId> {
    with_timers_after(store, machine, n, now, Duration::from_secs(1)).await
}

/// Inserts `n` instances of `machine`, each parked with one `after` timer of `interval`.
async fn with_timers_after(
    store: &MemoryStore,
    machine: &str,
    n: usize,
    now: Timestamp,
    interval: Duration,
) -> Vec<InstanceId> {
    let news = (0..n).map(|_| NewInstance::new(MachineRef::new(machine, 1), "wait")).collect();
    let ids: Vec<InstanceId> = store
        .instance_insert(keel_core::ports::store::InsertParams { instances: news, now })
        .await
        .unwrap()
        .iter()
        .map(|o| o.id())
        .collect();
    let params = ClaimParams {
        worker: WorkerId("w".into()),
        namespaces: vec![],
        queues: vec![],
        machines: vec![MachineRef::new(machine, 1)],
        limit: n,
        lease: Duration::from_secs(30),
        now,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    };
    let claims = store.instance_claim(params).await.unwrap();
    let commits = claims
        .iter()
        .map(|c| {
            let mut commit = StepCommit::new(
                c.instance.id,
                c.token(),
                Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: None },
            );
            commit.timers_arm = vec![TimerArm {
                state: "wait".into(),
                event: "WAKE".into(),
                kind: TimerKind::After,
                interval,
                max: None,
                then: None,
            }];
            commit
        })
        .collect();
    let receipts = store.step_commit(CommitParams { commits, now }).await.unwrap();
    assert!(receipts.iter().all(Result::is_ok));
    ids
}

fn fired(outcome: SweepOutcome) -> u64 {
    match outcome {
        SweepOutcome::Swept { report, .. } | SweepOutcome::Overdue { report, .. } => report.fired,
        SweepOutcome::Skipped { .. } => 0,
    }
}

#[tokio::test]
async fn a_sweep_fires_everything_due_in_bounded_batches() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    with_timers(&store, "m", 250, clock.now()).await;
    let config = SweepConfig { batch: 100, ..SweepConfig::default() };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    assert_eq!(fired(sweeper.sweep(&[]).await.unwrap()), 0, "nothing due yet");
    clock.advance(Duration::from_secs(1));
    match sweeper.sweep(&[]).await.unwrap() {
        SweepOutcome::Swept { report, batches } => assert_eq!((report.fired, batches), (250, 3)),
        other => panic!("{other:?}"),
    }
    let bounded = Sweeper::new(
        Arc::clone(&store),
        clock.clone(),
        SweepConfig { batch: 10, batches_per_sweep: 2, ..SweepConfig::default() },
    )
    .unwrap();
    with_timers(&store, "m", 30, clock.now()).await;
    clock.advance(Duration::from_secs(1));
    assert_eq!(fired(bounded.sweep(&[]).await.unwrap()), 20, "a sweep stops at its batch bound");
    assert_eq!(fired(bounded.sweep(&[]).await.unwrap()), 10, "the rest fire on the next sweep");
}

/// After its first batch, a sweep runs its batches `batches_in_flight` at a time, within
/// its per-sweep bound, and fires every due timer exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_swept_in_waves_of_batches_each_timer_once() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let ids = with_timers(&store, "m", 95, clock.now()).await;
    let config = SweepConfig {
        batch: 10,
        batches_per_sweep: 6,
        batches_in_flight: 3,
        ..SweepConfig::default()
    };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    clock.advance(Duration::from_secs(1));
    // One batch, then a wave of three, then the last two the bound leaves.
    match sweeper.sweep(&[]).await.unwrap() {
        SweepOutcome::Swept { report, batches } => assert_eq!((report.fired, batches), (60, 6)),
        other => panic!("{other:?}"),
    }
    // 35 left: one batch, then a wave of three, one of which comes back short.
    match sweeper.sweep(&[]).await.unwrap() {
        SweepOutcome::Swept { report, batches } => assert_eq!((report.fired, batches), (35, 4)),
        other => panic!("{other:?}"),
    }
    for id in ids {
        let inbox = store.instance_get(id).await.unwrap().inbox;
        assert_eq!(inbox.len(), 1, "instance {id:?} woken once: {inbox:?}");
    }
}

#[tokio::test]
async fn a_sweep_covers_only_its_groups_machines() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    with_timers(&store, "fast", 3, clock.now()).await;
    with_timers(&store, "slow", 2, clock.now()).await;
    clock.advance(Duration::from_secs(2));
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), SweepConfig::default()).unwrap();
    assert_eq!(fired(sweeper.sweep(&["fast".to_owned()]).await.unwrap()), 3);
    assert_eq!(fired(sweeper.sweep(&[]).await.unwrap()), 2);
}

/// A `MakeWriter` into a shared buffer, to read what the sweeper logged.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Buffer {
    type Writer = Buffer;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn backpressure_skips_and_logs_then_fires_below_the_threshold() {
    let logs = Buffer::default();
    let subscriber = tracing_subscriber::fmt().with_writer(logs.clone()).with_ansi(false).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();

    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let parked = with_timers(&store, "m", 5, clock.now()).await;
    // A backlog of 4 ready instances, over a threshold of 3.
    let backlog: Vec<NewInstance> =
        (0..4).map(|_| NewInstance::new(MachineRef::new("busy", 1), "go")).collect();
    let ids = store
        .instance_insert(keel_core::ports::store::InsertParams {
            instances: backlog,
            now: clock.now(),
        })
        .await
        .unwrap();
    clock.advance(Duration::from_secs(5));
    let config = SweepConfig { backpressure_threshold: 3, ..SweepConfig::default() };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    assert_eq!(sweeper.sweep(&[]).await.unwrap(), SweepOutcome::Skipped { backlog: 4 });
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains("WARN")
            && logged.contains("timer sweep skipped")
            && logged.contains("backlog=4"),
        "{logged}"
    );
    for id in &parked {
        assert!(
            store.instance_get(*id).await.unwrap().inbox.is_empty(),
            "nothing fired while skipped"
        );
    }

    // The backlog drains below the threshold: the next sweep fires every overdue timer.
    let params = keel_core::ports::store::CancelParams {
        id: ids[0].id(),
        reason: "drained".into(),
        cascade: false,
        now: clock.now(),
        only_in: None,
    };
    store.instance_cancel(params).await.unwrap();
    assert_eq!(fired(sweeper.sweep(&[]).await.unwrap()), 5);
}

/// A machine no group sweeps is named in one warning, with the fix; a covered one is not.
#[test]
fn a_machine_in_no_sweep_group_is_warned_about_once() {
    let logs = Buffer::default();
    let subscriber = tracing_subscriber::fmt().with_writer(logs.clone()).with_ansi(false).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();
    let config = SweepConfig {
        groups: vec![SweepGroup {
            machines: vec!["order".into()],
            cadence: Duration::from_secs(60),
        }],
        ..SweepConfig::default()
    };
    assert_eq!(config.warn_uncovered(["order", "mail", "mail"]), ["mail"]);
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert_eq!(logged.matches("WARN").count(), 1, "{logged}");
    assert!(
        logged.contains("machine=mail")
            && logged.contains("add it to a group")
            && logged.contains("a group without a machine list"),
        "{logged}"
    );
    assert!(!logged.contains("machine=order"), "{logged}");
    assert!(SweepConfig::default().warn_uncovered(["order", "mail"]).is_empty());
}

/// A sweep right after one that the backlog let run reuses that reading instead of
/// counting the instance table again; once the reading is older than `BACKLOG_MAX_AGE`
/// the sweep counts again and sees the new backlog.
#[tokio::test(start_paused = true)]
async fn a_backlog_reading_that_let_a_sweep_run_is_reused_for_a_second() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let config = SweepConfig { backpressure_threshold: 3, ..SweepConfig::default() };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    with_timers(&store, "m", 2, clock.now()).await;
    clock.advance(Duration::from_secs(5));
    assert_eq!(fired(sweeper.sweep(&[]).await.unwrap()), 2, "backlog 0: the sweep runs");

    // Four ready instances appear, over the threshold of 3.
    let backlog: Vec<NewInstance> =
        (0..4).map(|_| NewInstance::new(MachineRef::new("busy", 1), "go")).collect();
    let params = keel_core::ports::store::InsertParams { instances: backlog, now: clock.now() };
    store.instance_insert(params).await.unwrap();
    with_timers(&store, "m", 2, clock.now()).await;
    clock.advance(Duration::from_secs(5));
    assert_eq!(fired(sweeper.sweep(&[]).await.unwrap()), 2, "the reading of 0 is reused");

    with_timers(&store, "m", 2, clock.now()).await;
    clock.advance(Duration::from_secs(5));
    tokio::time::advance(keel_timers::BACKLOG_MAX_AGE).await;
    let outcome = sweeper.sweep(&[]).await.unwrap();
    assert!(
        matches!(outcome, SweepOutcome::Skipped { backlog } if backlog >= 4),
        "a second later the backlog is counted again: {outcome:?}"
    );
}

#[test]
fn configuration_bounds_name_the_field() {
    let cases = [
        (
            SweepConfig { batch: 0, ..SweepConfig::default() },
            "timers.batch: must be 1 to 10000 (got 0)",
        ),
        (
            SweepConfig { batches_per_sweep: 0, ..SweepConfig::default() },
            "timers.batches_per_sweep: must be 1 to 10000 (got 0)",
        ),
        (
            SweepConfig { batches_per_sweep: 10_001, ..SweepConfig::default() },
            "timers.batches_per_sweep: must be 1 to 10000 (got 10001)",
        ),
        (
            SweepConfig { batches_in_flight: 0, ..SweepConfig::default() },
            "timers.batches_in_flight: must be 1 to 16 (got 0)",
        ),
        (
            SweepConfig { batches_in_flight: 17, ..SweepConfig::default() },
            "timers.batches_in_flight: must be 1 to 16 (got 17)",
        ),
        (
            SweepConfig { groups: vec![], ..SweepConfig::default() },
            "timers.groups: give at least one group",
        ),
        (
            SweepConfig {
                groups: vec![SweepGroup { machines: vec![], cadence: Duration::from_millis(50) }],
                ..SweepConfig::default()
            },
            "timers.groups[0].cadence: 50 ms is below the minimum of 100 ms",
        ),
        (
            SweepConfig {
                groups: vec![SweepGroup {
                    machines: vec![],
                    cadence: Duration::from_secs(2 * 24 * 3_600),
                }],
                ..SweepConfig::default()
            },
            "timers.groups[0].cadence: 172800 s is above the maximum of 86400 s",
        ),
    ];
    for (config, expected) in cases {
        let err = config.validate().unwrap_err();
        assert!(err.starts_with(expected), "{err}");
    }
    assert!(SweepConfig::default().validate().is_ok());
    let most = SweepConfig {
        batches_per_sweep: keel_timers::BATCHES_PER_SWEEP_MAX,
        ..SweepConfig::default()
    };
    assert!(most.validate().is_ok(), "the maximum itself is allowed");
}

#[tokio::test]
async fn the_run_loop_sweeps_each_group_at_its_cadence_until_shutdown() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let ids = with_timers(&store, "m", 3, clock.now()).await;
    let group = SweepGroup { machines: vec![], cadence: Duration::from_millis(100) };
    let sweeper = Sweeper::new(
        Arc::clone(&store),
        clock.clone(),
        SweepConfig { groups: vec![group], ..SweepConfig::default() },
    )
    .unwrap();
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(sweeper.run(rx));
    clock.advance(Duration::from_secs(1));
    for _ in 0..200 {
        let mut all = true;
        for id in &ids {
            all &= !store.instance_get(*id).await.unwrap().inbox.is_empty();
        }
        if all {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for id in &ids {
        assert_eq!(store.instance_get(*id).await.unwrap().inbox.len(), 1);
    }
    tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task).await.expect("stops on shutdown").unwrap();
}

/// Polls (at most `limit` of real time) until every instance has a signal in its inbox.
async fn all_fired(store: &MemoryStore, ids: &[InstanceId], limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        let mut all = true;
        for id in ids {
            all &= !store.instance_get(*id).await.unwrap().inbox.is_empty();
        }
        if all {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// With the default settings (a one-minute cadence) the run loop sleeps until the earliest
/// due time on the injected clock: a timer armed while it sleeps wakes it, nothing fires
/// before its due time, and it fires promptly once due — far sooner than the cadence.
#[tokio::test]
async fn a_default_sweeper_wakes_for_a_timer_armed_while_it_sleeps_and_never_fires_early() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), SweepConfig::default()).unwrap();
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(sweeper.run(rx));
    // The start-up sweep finds nothing; the sweeper goes to sleep for its cadence.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ids = with_timers_after(&store, "m", 2, clock.now(), Duration::from_millis(300)).await;
    assert!(
        !all_fired(&store, &ids, Duration::from_millis(500)).await,
        "not due on the injected clock: nothing fires"
    );
    clock.advance(Duration::from_millis(300));
    // Typically within a few hundred milliseconds; the bound is generous for a loaded
    // machine and still far below the 60 s cadence.
    assert!(all_fired(&store, &ids, Duration::from_secs(10)).await, "fired once due");
    tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task).await.expect("stops on shutdown").unwrap();
}

/// A group whose sweep was skipped for backpressure counts the backlog again about once a
/// second — not at every due time, so an overloaded store is not scanned many times a
/// second — warning once for the whole run of skipped sweeps; once the backlog has drained
/// its due timers fire at the next count, not a cadence (a minute) later.
#[tokio::test(flavor = "current_thread")]
async fn after_a_skipped_sweep_the_backlog_is_counted_again_and_timers_fire_once_it_drains() {
    let logs = Buffer::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let parked = with_timers(&store, "m", 2, clock.now()).await;
    let backlog: Vec<NewInstance> =
        (0..4).map(|_| NewInstance::new(MachineRef::new("busy", 1), "go")).collect();
    let busy = store
        .instance_insert(keel_core::ports::store::InsertParams {
            instances: backlog,
            now: clock.now(),
        })
        .await
        .unwrap();
    clock.advance(Duration::from_secs(5));
    let config = SweepConfig { backpressure_threshold: 3, ..SweepConfig::default() };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(sweeper.run(rx));
    tokio::time::sleep(keel_timers::BACKPRESSURE_RECHECK * 2 + Duration::from_millis(500)).await;
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert_eq!(logged.matches("timer sweep skipped:").count(), 1, "one warning: {logged}");
    let rechecks = logged.matches("timer sweep skipped again").count();
    assert!((1..=3).contains(&rechecks), "about one count a second, got {rechecks}: {logged}");
    assert!(!all_fired(&store, &parked, Duration::ZERO).await, "nothing fires while skipped");

    for b in &busy {
        let params = keel_core::ports::store::CancelParams {
            id: b.id(),
            reason: "drained".into(),
            cascade: false,
            now: clock.now(),
            only_in: None,
        };
        store.instance_cancel(params).await.unwrap();
    }
    // The next count comes within a second; the bound is generous for a loaded machine
    // and still far below the one-minute cadence.
    assert!(all_fired(&store, &parked, Duration::from_secs(10)).await, "fired once drained");
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(logged.contains("timer sweeps resumed"), "{logged}");
    tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task).await.expect("stops on shutdown").unwrap();
}

/// Ready instances in a paused queue cannot drain until it is resumed, so they do not hold
/// back the sweep: another machine's `after` timers fire while a queue holding more ready
/// instances than the threshold is paused, and the same instances count again once it is
/// resumed.
#[tokio::test]
async fn ready_instances_in_a_paused_queue_do_not_hold_back_the_sweep() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let parked = with_timers(&store, "m", 2, clock.now()).await;
    let pause = |paused| keel_core::ports::store::QueuePauseParams {
        namespace: keel_core::ids::DEFAULT_NAMESPACE.to_owned(),
        queue: "bulk".into(),
        paused,
        now: clock.now(),
    };
    store.queue_pause(pause(true)).await.unwrap();
    // Five ready instances in the paused queue, over a threshold of 3.
    let bulk: Vec<NewInstance> = (0..5)
        .map(|_| NewInstance::new(MachineRef::new("bulk_job", 1), "go").queue("bulk"))
        .collect();
    let params = keel_core::ports::store::InsertParams { instances: bulk, now: clock.now() };
    store.instance_insert(params).await.unwrap();
    clock.advance(Duration::from_secs(5));
    let config = SweepConfig { backpressure_threshold: 3, ..SweepConfig::default() };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config.clone()).unwrap();
    let outcome = sweeper.sweep(&[]).await.unwrap();
    assert!(
        matches!(outcome, SweepOutcome::Swept { report, .. } if report.fired == 2),
        "a paused queue's backlog does not skip the sweep: {outcome:?}"
    );
    for id in &parked {
        assert_eq!(store.instance_get(*id).await.unwrap().inbox.len(), 1, "fired once");
    }

    // Resumed, the same instances can drain, and count again (with the two the fired
    // timers woke).
    store.queue_pause(pause(false)).await.unwrap();
    let fresh = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    assert_eq!(fresh.sweep(&[]).await.unwrap(), SweepOutcome::Skipped { backlog: 7 });
}

/// Inserts `n` ready instances of `machine` in `queue`, which no worker in these tests
/// claims.
async fn unclaimed(store: &MemoryStore, machine: &str, queue: &str, n: usize, now: Timestamp) {
    let instances =
        (0..n).map(|_| NewInstance::new(MachineRef::new(machine, 1), "go").queue(queue)).collect();
    let params = keel_core::ports::store::InsertParams { instances, now };
    store.instance_insert(params).await.unwrap();
}

/// Another machine's backlog does not hold a group back: runnable instances nobody
/// claims (a retired machine) do not stop the timers of the machines the group sweeps.
#[tokio::test]
async fn a_backlog_nobody_claims_does_not_stop_timers_forever() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    with_timers(&store, "m", 3, clock.now()).await;
    unclaimed(&store, "orphan", "default", 2, clock.now()).await;
    let config = SweepConfig {
        backpressure_threshold: 1,
        groups: vec![SweepGroup { machines: vec!["m".into()], cadence: Duration::from_secs(60) }],
        ..SweepConfig::default()
    };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    clock.advance(Duration::from_secs(24 * 3_600));
    let outcome = sweeper.sweep(&["m".to_owned()]).await.unwrap();
    assert!(
        matches!(outcome, SweepOutcome::Swept { report, .. } if report.fired == 3),
        "a day overdue, held back by another machine's unclaimed rows: {outcome:?}"
    );
}

/// A group's own backlog that never drains (its instances sit in a queue no worker
/// serves) skips its sweeps only while its timers are less than a cadence late; after
/// that each sweep fires one batch, soonest due first, so every timer fires at last.
#[tokio::test]
async fn a_backlog_that_never_drains_only_delays_timers_by_about_a_cadence() {
    let store = Arc::new(MemoryStore::new());
    let clock = VirtualClock::new(T0);
    let parked = with_timers(&store, "m", 3, clock.now()).await;
    unclaimed(&store, "m", "misspelt", 2, clock.now()).await;
    let minute = Duration::from_secs(60);
    let config = SweepConfig {
        backpressure_threshold: 1,
        batch: 2,
        groups: vec![SweepGroup { machines: vec!["m".into()], cadence: minute }],
        ..SweepConfig::default()
    };
    let sweeper = Sweeper::new(Arc::clone(&store), clock.clone(), config).unwrap();
    let m = ["m".to_owned()];
    clock.advance(Duration::from_secs(31));
    let outcome = sweeper.sweep(&m).await.unwrap();
    assert_eq!(outcome, SweepOutcome::Skipped { backlog: 2 }, "half a cadence late: skipped");
    clock.advance(minute);
    let outcome = sweeper.sweep(&m).await.unwrap();
    assert!(
        matches!(outcome, SweepOutcome::Overdue { backlog: 2, report } if report.fired == 2),
        "a cadence late: one batch fires despite the backlog: {outcome:?}"
    );
    // The two woken instances add to the backlog; the last timer still fires.
    let outcome = sweeper.sweep(&m).await.unwrap();
    assert!(
        matches!(outcome, SweepOutcome::Overdue { backlog: 4, report } if report.fired == 1),
        "the next batch: {outcome:?}"
    );
    for id in &parked {
        assert_eq!(store.instance_get(*id).await.unwrap().inbox.len(), 1, "fired once");
    }
    let outcome = sweeper.sweep(&m).await.unwrap();
    assert_eq!(outcome, SweepOutcome::Skipped { backlog: 5 }, "nothing due: skipped");
}
