//! Chart version migration: a page moves the waiting instances of the old version to the
//! mapped states of the new one (renamed states carried by the map, timers kept with their
//! due time under the new state name, history recorded, revision bumped), refuses an
//! instance whose state the new version lacks and one that is running a step, writes
//! nothing in a dry run, and pages by id.

use super::support::{at, claim_id, commit_ok, ctx, get, insert_one, new_in, row};
use keel_core::chart::migrate::Refusal;
use keel_core::chart::{Definition, Migration, Timer, TimerArm, TimerKind};
use keel_core::instance::ANY_SIGNAL;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{MigrateMoved, MigrateParams};
use keel_core::{InstanceId, Revision, Status, StepCommit};
use std::time::Duration;

fn version(v: u32, first: &str) -> Definition {
    Definition::builder("order", v)
        .initial(first)
        .state(first, |s| s.on("EXPIRE", |t| t.after(Timer::seconds(60)).target("paid")))
        .state("paid", |s| s.on_to("SHIP", "done"))
        .state("gone", |s| s.on_to("BACK", "paid"))
        .final_state("done")
        .build()
        .expect("a valid chart")
}

/// v1 has `cart` and `gone`; v2 renames `cart` to `basket` and has no `gone`.
fn migration() -> Migration {
    let mut v2 = Definition::builder("order", 2)
        .initial("basket")
        .state("basket", |s| s.on("EXPIRE", |t| t.after(Timer::seconds(60)).target("paid")))
        .state("paid", |s| s.on_to("SHIP", "done"))
        .final_state("done");
    v2 = v2.state("spare", |s| s.on_to("BACK", "paid"));
    Migration::new(version(1, "cart"), v2.build().expect("a valid chart"))
        .expect("two versions of one chart")
        .map("cart", "basket")
        .expect("both states exist")
}

/// Parks a new instance in `ns` at the chart position `config`, arming `timers`.
async fn parked<S: Store>(s: &S, ns: &str, config: &str, timers: Vec<TimerArm>) -> InstanceId {
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(5)).await;
    let park =
        Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx(1), step: Some(config.into()) };
    let mut c = StepCommit::new(id, claimed.token(), park);
    c.timers_arm = timers;
    commit_ok(s, c, at(10)).await;
    id
}

fn params(ns: &str, dry_run: bool, limit: usize) -> MigrateParams {
    MigrateParams {
        migration: migration(),
        namespace: Some(ns.into()),
        after: None,
        limit,
        dry_run,
        now: keel_core::Timestamp::from_millis(at(1_000).as_millis()),
    }
}

/// A dry run reports every move and refusal and writes nothing; the apply moves what it
/// can, fenced like a commit, and leaves the rest untouched.
pub async fn migration_dry_run_reports_and_apply_moves_mapped_instances<S: Store>(s: &S) {
    let ns = "migrate";
    let expire = TimerArm {
        state: "cart".into(),
        event: "EXPIRE".into(),
        kind: TimerKind::After,
        interval: Duration::from_secs(60),
        max: None,
        then: None,
    };
    let cart = parked(s, ns, r#"["cart"]"#, vec![expire]).await;
    let paid = parked(s, ns, r#"["paid"]"#, vec![]).await;
    let gone = parked(s, ns, r#"["gone"]"#, vec![]).await;
    let busy = insert_one(s, new_in(ns), at(0)).await;
    claim_id(s, ns, busy, at(20)).await;
    let due = get(s, cart).await.timers[0].next_fire_at;

    let page = s.instance_migrate(params(ns, true, 10)).await.expect("dry run");
    let outcomes: Vec<_> = page.items.iter().map(|i| (i.id, i.outcome.clone())).collect();
    let moved = |new: &str, kept| Ok(MigrateMoved { new: new.into(), kept, dropped: 0, armed: 0 });
    assert_eq!(
        outcomes,
        vec![
            (cart, moved(r#"["basket"]"#, 1)),
            (paid, moved(r#"["paid"]"#, 0)),
            (gone, Err(Refusal::Unmapped { state: "gone".into() })),
            (busy, Err(Refusal::Busy)),
        ]
    );
    assert_eq!(page.last, Some(busy));
    let before = row(s, cart).await;
    assert_eq!(
        (before.machine.version, before.position.as_str()),
        (1, r#"["cart"]"#),
        "a dry run writes nothing"
    );

    let page = s.instance_migrate(params(ns, false, 10)).await.expect("apply");
    assert_eq!(page.items.len(), 4);
    let after = get(s, cart).await;
    assert_eq!(after.instance.machine.version, 2);
    assert_eq!(after.instance.position, r#"["basket"]"#);
    assert_eq!(after.instance.revision, Revision(before.revision.0 + 1));
    assert_eq!(after.instance.status, Status::AwaitingSignal);
    let last = after.history.last().expect("history");
    assert_eq!(last.entry.kind, "MIGRATED");
    assert_eq!(last.entry.data["old"], serde_json::json!(["cart"]));
    assert_eq!(last.entry.data["new"], serde_json::json!(["basket"]));
    assert_eq!(after.timers.len(), 1, "the timer moves with its state");
    assert_eq!(
        (
            after.timers[0].spec.state.as_str(),
            after.timers[0].next_fire_at,
            after.timers[0].machine.version
        ),
        ("basket", due, 2),
        "it keeps its due time"
    );
    assert_eq!(row(s, paid).await.machine.version, 2);
    let g = row(s, gone).await;
    assert_eq!(
        (g.machine.version, g.position.as_str()),
        (1, r#"["gone"]"#),
        "a refused instance is untouched"
    );
    let b = row(s, busy).await;
    assert_eq!(
        (b.machine.version, b.status),
        (1, Status::Executing),
        "a running step is left alone"
    );

    // Paging: a page of one reads the first remaining v1 instance only.
    let mut one = params(ns, true, 1);
    one.after = None;
    let page = s.instance_migrate(one).await.expect("page");
    assert_eq!(page.items.iter().map(|i| i.id).collect::<Vec<_>>(), vec![gone]);
    let mut next = params(ns, true, 1);
    next.after = page.last;
    let page = s.instance_migrate(next).await.expect("next page");
    assert_eq!(page.items.iter().map(|i| i.id).collect::<Vec<_>>(), vec![busy]);
    let mut zero = params(ns, true, 0);
    zero.after = None;
    let err = s.instance_migrate(zero).await.expect_err("limit 0 is refused");
    assert!(err.to_string().contains("limit"), "{err}");
}
