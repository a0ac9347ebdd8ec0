//! `TestMachine` in parallel dispatch mode (issue 7): the same semantics as the durable
//! runtime, in memory — and the property that inline and dispatched modes agree when the
//! regions write disjoint keys.

use keel_core::chart::parallel::RegionReport;
use keel_core::chart::{ActionError, Definition, Event};
use keel_testkit::chart::{ActionContext, TestMachine};
use proptest::prelude::*;
use serde_json::{Value, json};

fn order() -> Definition {
    Definition::builder("order", 1)
        .initial("processing")
        .parallel("processing", |p| {
            p.state("inventory", |r| {
                r.initial("checking")
                    .state("checking", |s| {
                        s.entry("check_inventory").on_to("INVENTORY_OK", "ready")
                    })
                    .final_state("ready")
            })
            .state("payment", |r| {
                r.initial("validating")
                    .state("validating", |s| {
                        s.entry("validate_payment").on_to("PAYMENT_OK", "ok").on_to("SKIP", "ok")
                    })
                    .final_state("ok")
            })
            .on_done(|b| b.target("completed"))
            .on_fail(|b| b.target("failed"))
        })
        .final_state("completed")
        .final_state("failed")
        .build()
        .expect("valid chart")
}

fn sets(
    key: &'static str,
    value: Value,
    raise: Option<&'static str>,
) -> impl Fn(&ActionContext, &Event) + Send + Sync + 'static {
    move |ctx, _| {
        ctx.set(key, value.clone());
        if let Some(e) = raise {
            ctx.raise(e);
        }
    }
}

fn machine(dispatch: bool) -> TestMachine {
    TestMachine::new(order())
        .with_parallel_dispatch(dispatch)
        .action_sync("check_inventory", sets("inventory", json!(5), Some("INVENTORY_OK")))
        .action_sync("validate_payment", sets("payment", json!("ok"), Some("PAYMENT_OK")))
}

#[test]
fn both_modes_complete_with_the_same_context_and_dispatch_records_its_work() {
    let mut inline = machine(false);
    inline.assert_state("completed").assert_recorded("PARALLEL_DISPATCH", 0);
    let mut dispatched = machine(true);
    dispatched
        .assert_state("completed")
        .assert_recorded("PARALLEL_DISPATCH", 1)
        .assert_recorded("PARALLEL_REGION_ENTER", 2)
        .assert_recorded("PARALLEL_DONE", 1)
        .assert_recorded("PARALLEL_REGION_STALLED", 0);
    assert_eq!(inline.context(), dispatched.context());
}

#[test]
fn held_regions_finish_in_any_order_with_one_done() {
    let mut m = machine(true).hold_regions(true);
    assert_eq!(m.pending_regions(), ["processing.inventory", "processing.payment"]);
    m.assert_state("processing.payment.validating").assert_context("payment", Value::Null);
    m.run_region("processing.payment").assert_state("processing.payment.ok");
    m.assert_recorded("PARALLEL_DONE", 0);
    m.run_region("processing.inventory")
        .assert_state("completed")
        .assert_recorded_with("PARALLEL_DONE", json!({ "parallel_state_id": "processing" }))
        .assert_recorded("PARALLEL_DONE", 1);
}

#[test]
fn a_key_both_regions_write_is_a_conflict_and_the_last_writer_wins() {
    let mut m = TestMachine::new(order())
        .with_parallel_dispatch(true)
        .hold_regions(true)
        .with_context(json!({ "total": 0 }))
        .action_sync("check_inventory", |ctx, _| {
            ctx.set("total", 1);
            ctx.set("inventory", true);
        })
        .action_sync("validate_payment", |ctx, _| {
            ctx.set("total", 2);
            ctx.set("payment", true);
        });
    m.run_region("processing.payment").assert_recorded("PARALLEL_CONTEXT_CONFLICT", 0);
    m.run_region("processing.inventory")
        .assert_recorded_with(
            "PARALLEL_CONTEXT_CONFLICT",
            json!({ "region_id": "processing.inventory", "conflicted_keys": ["total"] }),
        )
        .assert_context("total", 1)
        .assert_context("payment", true);
}

#[test]
fn regions_that_do_not_advance_are_stalled_with_context_changed() {
    let mut m = TestMachine::new(order())
        .with_parallel_dispatch(true)
        .action_sync("check_inventory", sets("inventory", json!(1), None))
        .action_sync("validate_payment", |_, _| {});
    assert_eq!(
        m.recorded("PARALLEL_REGION_STALLED"),
        [
            json!({ "region_id": "processing.inventory", "initial_state_id": "processing.inventory.checking", "context_changed": true }),
            json!({ "region_id": "processing.payment", "initial_state_id": "processing.payment.validating", "context_changed": false }),
        ]
    );
    m.send("INVENTORY_OK")
        .send("PAYMENT_OK")
        .assert_state("completed")
        .assert_recorded("PARALLEL_DONE", 1);
}

#[test]
fn late_work_is_guard_aborted_and_a_replayed_report_is_a_no_op() {
    let mut m = machine(true).hold_regions(true);
    let late = m.run_region_detached("processing.payment");
    m.send("SKIP").assert_state("processing.payment.ok");
    m.deliver_report(&late)
        .assert_recorded_with(
            "PARALLEL_REGION_GUARD_ABORT",
            json!({
                "region_id": "processing.payment",
                "reason": "region_already_advanced",
                "discarded_context": ["payment"],
                "discarded_events": 1,
                "work_was_discarded": true,
            }),
        )
        .assert_context("payment", Value::Null);

    let mut m = machine(true).hold_regions(true);
    let report = m.run_region_detached("processing.inventory");
    m.deliver_report(&report).assert_recorded("PARALLEL_REGION_ENTER", 1);
    let context = m.context().clone();
    m.deliver_report(&report).assert_recorded("PARALLEL_REGION_ENTER", 1);
    assert_eq!(m.context(), &context, "the replay changed nothing");
    assert_eq!(m.recorded("PARALLEL_REGION_GUARD_ABORT"), Vec::<Value>::new());
}

#[test]
fn failures_fire_one_fail_and_later_siblings_are_no_ops() {
    let mut m = machine(true).hold_regions(true);
    m.fail_region("processing.inventory", "no stock")
        .assert_state("failed")
        .assert_recorded_with(
            "PARALLEL_FAIL",
            json!({ "region_id": "processing.inventory", "error": "no stock", "exception": "ActionError", "attempts": 1 }),
        );
    m.fail_region("processing.payment", "declined").assert_recorded("PARALLEL_FAIL", 1);

    // An action error in a region task fails the region the same way.
    let mut m = TestMachine::new(order())
        .with_parallel_dispatch(true)
        .hold_regions(true)
        .action("check_inventory", |_, _| async { Err(ActionError::new("API down")) })
        .action_sync("validate_payment", sets("payment", json!(1), Some("PAYMENT_OK")));
    m.run_region("processing.inventory").assert_state("failed");
    let before = m.recorded("PARALLEL_REGION_ENTER").len();
    m.run_region("processing.payment");
    assert_eq!(m.recorded("PARALLEL_REGION_ENTER").len(), before, "the late sibling did nothing");
}

#[test]
fn a_failed_report_for_another_visit_is_ignored() {
    let mut m = machine(true).hold_regions(true);
    let RegionReport::Completed { key, .. } = m.run_region_detached("processing.inventory") else {
        panic!("completed");
    };
    let stale = RegionReport::Failed {
        key: keel_core::chart::parallel::RegionKey { dispatch: key.dispatch + 1, ..key },
        error: "x".into(),
        exception: "ActionError".into(),
        attempts: 3,
    };
    m.deliver_report(&stale).assert_recorded("PARALLEL_FAIL", 0).assert_state("processing");
}

/// A generated chart: `regions` regions of a parallel state `p`; region `i` is a chain of
/// `len[i]` states whose first has an entry action writing key `r{i}` (and maybe raising
/// the event that advances it), each transition writes `r{i}` too; every region ends in a
/// final state, `p`'s `@done` goes to `end`, and `RESET` re-enters `p` (a new dispatch).
#[derive(Debug, Clone)]
struct Spec {
    regions: Vec<(usize, bool)>,
}

fn spec() -> impl Strategy<Value = Spec> {
    proptest::collection::vec((1usize..4, any::<bool>()), 2..4).prop_map(|regions| Spec { regions })
}

fn build(spec: &Spec) -> Definition {
    let regions = spec.regions.clone();
    Definition::builder("generated", 1)
        .initial("p")
        .parallel("p", move |mut p| {
            for (i, &(len, _)) in regions.iter().enumerate() {
                p = p.state(format!("r{i}"), move |mut r| {
                    r = r.initial("s0");
                    for j in 0..len {
                        let next =
                            if j + 1 == len { "fin".to_owned() } else { format!("s{}", j + 1) };
                        r = r.state(format!("s{j}"), move |mut s| {
                            if j == 0 {
                                s = s.entry(format!("enter_r{i}"));
                            }
                            s.on(format!("E{i}_{j}"), |t| {
                                t.target(next).action(format!("step_r{i}"))
                            })
                        });
                    }
                    r.final_state("fin")
                });
            }
            p.on_done(|b| b.target("end")).on_to("RESET", "p")
        })
        .leaf("end")
        .build()
        .expect("generated chart is valid")
}

fn run(spec: &Spec, dispatch: bool, events: &[String]) -> (Vec<String>, Value) {
    let mut m = TestMachine::new(build(spec)).with_parallel_dispatch(dispatch);
    for (i, &(_, raises)) in spec.regions.iter().enumerate() {
        let key = format!("r{i}");
        let k = key.clone();
        m = m.action_sync(format!("enter_r{i}"), move |ctx, _| {
            let n: i64 = ctx.get_as(&k).unwrap_or(0);
            ctx.set(k.clone(), n + 100);
            if raises {
                ctx.raise(format!("E{i}_0"));
            }
        });
        m = m.action_sync(format!("step_r{i}"), move |ctx, _| {
            let n: i64 = ctx.get_as(&key).unwrap_or(0);
            ctx.set(key.clone(), n + 1);
        });
    }
    for e in events {
        m.send(e.as_str());
    }
    let paths = m.configuration().paths().map(str::to_owned).collect();
    (paths, m.context().clone())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn inline_and_dispatched_modes_agree_for_disjoint_keys(
        spec in spec(),
        picks in proptest::collection::vec((0usize..4, 0usize..4, 0u8..10), 0..12),
    ) {
        let events: Vec<String> = picks
            .iter()
            .map(|&(i, j, reset)| {
                if reset == 0 { "RESET".to_owned() } else { format!("E{}_{}", i % spec.regions.len(), j) }
            })
            .collect();
        let inline = run(&spec, false, &events);
        let dispatched = run(&spec, true, &events);
        prop_assert_eq!(inline, dispatched);
    }
}

#[test]
fn conditional_fail_branches_see_the_failure_and_the_context() {
    let def = Definition::builder("retrying", 1)
        .guard("can_retry", |ctx, event| {
            ctx.get_as::<u32>("retries").unwrap_or(0) < 1 && event.payload["attempts"] == json!(1)
        })
        .initial("p")
        .parallel("p", |p| {
            p.state("a", |r| r.initial("x").state("x", |s| s.entry("a")))
                .state("b", |r| r.initial("y").state("y", |s| s.entry("b")))
                .on_fail(|b| b.guard("can_retry").target("retrying"))
                .on_fail(|b| b.target("failed"))
        })
        .state("retrying", |s| s.entry("count_retry").on_to("RETRY", "p"))
        .final_state("failed")
        .build()
        .unwrap();
    let mut m = TestMachine::new(def).with_parallel_dispatch(true).hold_regions(true).action_sync(
        "count_retry",
        |ctx, _| {
            let n: u32 = ctx.get_as("retries").unwrap_or(0);
            ctx.set("retries", n + 1);
        },
    );
    m.fail_region("p.a", "boom").assert_state("retrying").assert_context("retries", 1);
    m.send("RETRY");
    assert_eq!(m.pending_regions(), ["p.b", "p.a", "p.b"], "a new dispatch; the old p.b is stale");
    m.run_region("p.b").assert_recorded("PARALLEL_REGION_ENTER", 0);
    m.fail_region("p.a", "boom again").assert_state("failed").assert_recorded("PARALLEL_FAIL", 2);
}
