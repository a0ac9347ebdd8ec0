//! Chart version migration through the client: 1 000 instances of version 1 spread over
//! four states, version 2 renames two of them and drops one. The dry run reports every
//! move and the refusal of the dropped state; the apply with a full map moves every
//! instance to its mapped state at version 2 with the move in its history; instances
//! running a step when the migration runs are left alone, commit normally, and move on the
//! next run.

#[macro_use]
mod common;

use common::TestStore;
use keel_core::chart::{Definition, Migration, Timer};
use keel_core::instance::{ANY_SIGNAL, NewInstance};
use keel_core::outcome::{Outcome, StepCommit};
use keel_core::ports::Clock;
use keel_core::ports::store::{ClaimParams, CommitParams};
use keel_core::{MachineRef, Status, WorkerId};
use serde_json::json;
use std::time::Duration;

on_every_store!(a_thousand_instances_move_to_version_two_after_a_dry_run);

const PER_STATE: usize = 250;

fn v1() -> Definition {
    Definition::builder("ticket", 1)
        .initial("open")
        .state("open", |s| s.on("REMIND", |t| t.after(Timer::days(7)).target("triage")))
        .state("triage", |s| s.on_to("TAKE", "working"))
        .state("working", |s| s.on_to("PARK", "parked").on_to("CLOSE", "closed"))
        .state("parked", |s| s.on_to("RESUME", "working"))
        .final_state("closed")
        .build()
        .expect("v1")
}

/// `open` is now `new` (its reminder included), `triage` is `review`, `parked` is gone.
fn v2() -> Definition {
    Definition::builder("ticket", 2)
        .initial("new")
        .state("new", |s| s.on("REMIND", |t| t.after(Timer::days(7)).target("review")))
        .state("review", |s| s.on_to("TAKE", "working"))
        .state("working", |s| s.on_to("CLOSE", "closed"))
        .final_state("closed")
        .build()
        .expect("v2")
}

fn renames() -> Migration {
    Migration::new(v1(), v2())
        .and_then(|m| m.map("open", "new"))
        .and_then(|m| m.map("triage", "review"))
        .expect("a valid migration")
}

async fn a_thousand_instances_move_to_version_two_after_a_dry_run<S: TestStore>() {
    let h = S::harness().await;
    let machine = MachineRef::new("ticket", 1);
    let states = ["open", "triage", "working", "parked"];
    let news: Vec<NewInstance> = (0..PER_STATE * states.len())
        .map(|i| NewInstance::new(machine.clone(), format!("[\"{}\"]", states[i % 4])))
        .collect();
    let ids: Vec<_> =
        h.client.start_many(news).await.expect("start").iter().map(|o| o.id()).collect();

    let dry = h.client.migrate(renames()).batch(300).dry_run().await.expect("dry run");
    let pos = |s: &str| format!("[\"{s}\"]");
    let expected_moves = [
        ((pos("open"), pos("new")), PER_STATE),
        ((pos("triage"), pos("review")), PER_STATE),
        ((pos("working"), pos("working")), PER_STATE),
    ];
    assert_eq!(dry.moves, expected_moves.into_iter().collect(), "{dry}");
    assert_eq!(dry.refusals(), PER_STATE, "{dry}");
    let (refused_at, why) = dry.refused.keys().next().expect("a refusal").clone();
    assert_eq!(refused_at, pos("parked"));
    assert!(why.contains("`parked` has no counterpart") && why.contains("Migration::map"), "{why}");
    assert_eq!(dry.timers_armed, PER_STATE, "each `new` instance gets its reminder");
    let text = dry.to_string();
    println!("{text}");
    assert!(text.starts_with("would move 750 instance(s):"), "{text}");
    assert_eq!(h.client.get(ids[0]).await.expect("get").instance.machine.version, 1, "dry");

    // Ten instances are running a step while the migration runs.
    let claims = h
        .store
        .instance_claim(ClaimParams {
            worker: WorkerId("busy".into()),
            namespaces: vec![],
            queues: vec![],
            machines: vec![],
            limit: 10,
            lease: Duration::from_secs(60),
            now: h.clock.now(),
            policy: keel_core::plan::claim::ClaimPolicy::default(),
        })
        .await
        .expect("claim");
    assert_eq!(claims.len(), 10);

    let full = renames().map("parked", "working").expect("map parked");
    let applied = h.client.migrate(full.clone()).batch(300).apply().await.expect("apply");
    assert_eq!(applied.moved(), 1_000 - 10, "{applied}");
    assert_eq!((applied.busy, applied.refusals()), (10, 0), "{applied}");
    println!("{applied}");

    let busy: Vec<_> = claims.iter().map(|c| c.instance.id).collect();
    let mapped = |old: &str| match old {
        "open" => "new",
        "triage" => "review",
        _ => "working",
    };
    for (i, id) in ids.iter().enumerate() {
        let detail = h.client.get(*id).await.expect("get");
        if busy.contains(id) {
            assert_eq!(detail.instance.machine.version, 1, "a running step's instance stays");
            continue;
        }
        let row = &detail.instance;
        assert_eq!(row.machine.version, 2, "instance {id}");
        assert_eq!(row.position, pos(mapped(states[i % 4])), "instance {id}");
        let last = detail.history.last().expect("history");
        assert_eq!((last.entry.kind.as_str(), &last.entry.data["from"]), ("MIGRATED", &json!(1)));
    }

    // The running steps commit under their own leases, untouched by the migration...
    let now = h.clock.now();
    let commits = claims
        .iter()
        .map(|c| {
            let park = Outcome::Await {
                signal: ANY_SIGNAL.into(),
                context: json!({}),
                step: Some(c.instance.position.clone()),
            };
            StepCommit::new(c.instance.id, c.token(), park)
        })
        .collect();
    let receipts = h.store.step_commit(CommitParams { commits, now }).await.expect("commit");
    assert!(receipts.iter().all(Result::is_ok), "{receipts:?}");
    for id in &busy {
        assert_eq!(h.status(*id).await, Status::AwaitingSignal);
    }
    // ... and the next run moves them.
    let again = h.client.migrate(full).apply().await.expect("second apply");
    assert_eq!((again.moved(), again.busy), (10, 0), "{again}");
    for id in &busy {
        assert_eq!(h.client.get(*id).await.expect("get").instance.machine.version, 2);
    }
}
