//! A chart's definition warnings reach the person running it: registering a chart machine
//! on a worker logs each warning of its definition once, at `warn` level, naming the
//! machine and its version. The warnings themselves are tested in keel-core.

mod common;

use common::Lines;
use keel::{ChartMachine, Definition, Keel};

/// A chart with a state nothing leads to (`archived`) and a transition from one region of
/// a parallel state into the other (`checks.legal.asked` → `checks.finance.approved`).
fn chart() -> ChartMachine {
    let def = Definition::builder("claim", 3)
        .initial("checks")
        .parallel("checks", |p| {
            p.state("legal", |r| {
                r.initial("asked")
                    .state("asked", |s| {
                        s.on_to("CLEARED", "cleared").on_to("WAIVE", "finance.approved")
                    })
                    .final_state("cleared")
            })
            .state("finance", |r| {
                r.initial("pending")
                    .state("pending", |s| s.on_to("APPROVE", "approved"))
                    .final_state("approved")
            })
            .on_done(|b| b.target("paid"))
        })
        .final_state("paid")
        .final_state("archived")
        .build()
        .expect("warnings do not stop the build");
    ChartMachine::new(def)
}

#[tokio::test]
async fn registering_a_chart_logs_its_definition_warnings_once() {
    let keel = Keel::connect("sqlite::memory:").await.expect("opens");
    let machine = chart();
    let expected: Vec<String> = machine
        .definition()
        .warnings()
        .iter()
        .map(|w| format!("WARN chart claim v3: {w}"))
        .collect();
    assert_eq!(expected.len(), 2, "{expected:#?}");
    let lines = Lines::default();
    // The interest cache is rebuilt under this subscriber, so a callsite another test's
    // thread registered meanwhile cannot keep a stale "never" for it.
    let worker = tracing::subscriber::with_default(lines.clone(), || {
        tracing::callsite::rebuild_interest_cache();
        keel.worker().register(machine)
    })
    .expect("warnings never refuse a machine");
    let lines = lines.0.lock().expect("not poisoned").clone();
    let warned: Vec<&String> = lines.iter().filter(|l| l.starts_with("WARN chart ")).collect();
    assert_eq!(warned, expected.iter().collect::<Vec<_>>(), "{lines:#?}");
    assert!(
        warned[0].starts_with("WARN chart claim v3: state `archived` is unreachable"),
        "{warned:#?}"
    );
    assert!(
        warned[1].contains(
            "transition on `WAIVE` targets `checks.finance.approved` in another region of parallel state `checks`"
        ),
        "{warned:#?}"
    );
    worker.spawn().expect("starts").shutdown().await;
}
