//! The SQLite store against the reference: one scenario over every chart and timer
//! operation, run on `MemoryStore` and on `SqliteStore`, must give equal receipts, reports,
//! status, stats and whole instance details (rows, inboxes, children, history in order,
//! timers). The conformance suite checks the contracts; this checks that nothing it does
//! not look at (history order, counts, ids) drifts from the reference.

use keel_core::chart::{TimerArm, TimerKind};
use keel_core::instance::ANY_SIGNAL;
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, ClaimParams, CommitParams, InsertParams, SignalBroadcastParams, TimerSweepParams,
};
use keel_core::{
    InstanceId, MachineRef, NewInstance, NewSignal, Outcome, StatusSet, StepCommit, Timestamp,
    WorkerId,
};
use keel_store_sqlite::SqliteStore;
use keel_testkit::MemoryStore;
use serde_json::json;
use std::fmt::Debug;
use std::time::Duration;

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);
const NS: &str = "ref";

fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(T0.as_millis() + ms)
}

fn arm(state: &str, event: &str, kind: TimerKind, secs: u64, max: Option<u32>) -> TimerArm {
    TimerArm {
        state: state.into(),
        event: event.into(),
        kind,
        interval: Duration::from_secs(secs),
        max,
        then: max.map(|_| "GIVE_UP".to_owned()),
    }
}

fn park_at(step: &str) -> Outcome {
    Outcome::Await { signal: ANY_SIGNAL.into(), context: json!({}), step: Some(step.into()) }
}

/// Everything observable after each stage, as text, so a mismatch shows where.
struct Trace(Vec<String>);

impl Trace {
    fn push(&mut self, what: &str, value: impl Debug) {
        self.0.push(format!("{what}: {value:#?}"));
    }
}

/// Claims every runnable instance in `NS`; the one with `id` is returned, the others too.
async fn claim_all<S: Store>(s: &S, now: Timestamp) -> Vec<keel_core::ports::store::Claim> {
    s.instance_claim(ClaimParams {
        worker: WorkerId("w".into()),
        namespaces: vec![NS.into()],
        queues: Vec::new(),
        machines: Vec::new(),
        limit: 100,
        lease: Duration::from_secs(30),
        now,
        policy: keel_core::plan::claim::ClaimPolicy::default(),
    })
    .await
    .expect("claim")
}

async fn commit<S: Store>(s: &S, c: StepCommit, now: Timestamp, t: &mut Trace) {
    let out = s.step_commit(CommitParams { commits: vec![c], now }).await.expect("commit");
    t.push("commit", out);
}

async fn details<S: Store>(s: &S, n: i64, now: Timestamp, t: &mut Trace) {
    for id in 1..=n {
        t.push(&format!("instance {id}"), s.instance_get(InstanceId(id)).await.expect("get"));
    }
    t.push("timer status", s.timer_status(Some(NS.into()), now).await.expect("timer_status"));
    t.push("queue stats", s.queue_stats(None, now).await.expect("queue_stats"));
}

async fn sweep<S: Store>(s: &S, machines: &[&str], limit: usize, now: Timestamp, t: &mut Trace) {
    let params = TimerSweepParams {
        namespace: Some(NS.into()),
        machines: machines.iter().map(|m| (*m).to_owned()).collect(),
        limit,
        now,
    };
    t.push("sweep", s.timer_sweep(params).await.expect("sweep"));
}

async fn scenario<S: Store>(s: &S) -> Vec<String> {
    let mut t = Trace(Vec::new());
    let chart = NewInstance::new(MachineRef::new("chart", 1), "start").namespace(NS);
    let ids = s
        .instance_insert(InsertParams {
            instances: vec![chart.clone(), chart.clone().business_key("b"), chart],
            now: at(0),
        })
        .await
        .expect("insert");
    t.push("insert", &ids);

    // Every chart parks at a configuration; the first spawns three children (two share a
    // unique key) and arms timers in nested states.
    for claim in claim_all(s, at(10)).await {
        let id = claim.instance.id;
        let mut c = StepCommit::new(id, claim.token(), park_at(r#"["a","a.b"]"#));
        if id == InstanceId(1) {
            let kid = |n: i64| {
                NewInstance::new(MachineRef::new("payment", 1), "charge")
                    .namespace(NS)
                    .context(json!({ "n": n }))
                    .invoked_by("a.b")
            };
            c.spawn = vec![
                kid(1),
                kid(2).unique(b"k".to_vec(), StatusSet::LIVE),
                kid(3).unique(b"k".to_vec(), StatusSet::LIVE),
            ];
            c.timers_arm = vec![
                arm("a", "A_AFTER", TimerKind::After, 5, None),
                arm("a.b", "B_EVERY", TimerKind::Every, 10, Some(2)),
                arm("c", "C_EVERY", TimerKind::Every, 7, None),
            ];
        } else {
            c.timers_arm = vec![
                arm("a.b", "TICK", TimerKind::After, 3, None),
                arm("z", "Z", TimerKind::Every, 4, Some(1)),
            ];
        }
        commit(s, c, at(20), &mut t).await;
    }
    details(s, 5, at(20), &mut t).await;

    // Sweeps: scoped to another machine (nothing), bounded, then the rest.
    sweep(s, &["payment"], 100, at(60_000), &mut t).await;
    sweep(s, &[], 2, at(6_000), &mut t).await;
    sweep(s, &["chart"], 100, at(12_000), &mut t).await;
    details(s, 5, at(12_000), &mut t).await;

    // Broadcast to charts in `a.b`, with a dedup key, twice.
    for now in [at(13_000), at(13_500)] {
        let params = SignalBroadcastParams {
            namespace: NS.into(),
            machine: "chart".into(),
            in_state: Some("a.b".into()),
            name: "PING".into(),
            payload: json!({ "x": 1 }),
            dedup_key: Some("ping-1".into()),
            now,
        };
        t.push("broadcast", s.signal_broadcast(params).await.expect("broadcast"));
    }

    // Children: one finishes, one is cancelled (each notifies the parent), one fails.
    for claim in claim_all(s, at(14_000)).await {
        let id = claim.instance.id;
        let outcome = match id.0 {
            4 => Outcome::Done { result: json!({ "charged": 1 }), step: None },
            1 => {
                // The parent leaves `a` (its timers and its descendants' go) and arms anew.
                let mut c = StepCommit::new(id, claim.token(), park_at(r#"["c"]"#))
                    .consume(claim.inbox.iter().map(|s| s.id));
                c.timers_cancel = vec!["a".into()];
                c.timers_arm = vec![arm("c", "C_AFTER", TimerKind::After, 1, None)];
                commit(s, c, at(15_000), &mut t).await;
                continue;
            }
            _ => park_at(r#"["x"]"#),
        };
        commit(s, StepCommit::new(id, claim.token(), outcome), at(15_000), &mut t).await;
    }
    let cancelled = s
        .instance_cancel(CancelParams {
            id: InstanceId(5),
            reason: "stop".into(),
            cascade: false,
            now: at(16_000),
            only_in: None,
        })
        .await
        .expect("cancel");
    t.push("cancel", cancelled);
    // Cancelling a chart with timers drops them, cascading to nothing.
    let cancelled = s
        .instance_cancel(CancelParams {
            id: InstanceId(2),
            reason: "stop".into(),
            cascade: true,
            now: at(16_500),
            only_in: None,
        })
        .await
        .expect("cancel");
    t.push("cancel", cancelled);
    let delivered = s
        .signal_deliver(keel_core::ports::store::SignalDeliverParams {
            signals: vec![NewSignal::new(InstanceId(3), "HELLO")],
            now: at(16_700),
        })
        .await
        .expect("deliver");
    t.push("deliver", delivered);
    details(s, 5, at(17_000), &mut t).await;

    sweep(s, &[], 100, at(40_000), &mut t).await;
    sweep(s, &[], 100, at(80_000), &mut t).await;
    details(s, 5, at(80_000), &mut t).await;
    t.0
}

#[tokio::test]
async fn charts_and_timers_match_the_memory_store() {
    let reference = scenario(&MemoryStore::new()).await;
    let on_file = scenario(&SqliteStore::temporary().await.expect("open")).await;
    assert_eq!(reference.len(), on_file.len());
    for (want, got) in reference.iter().zip(&on_file) {
        assert_eq!(got, want);
    }
}
