//! A worker given a configuration file checks its sections against the machines it
//! registers and the queues it claims from: a `[machines.<m>]` or `[queues.<q>]` section
//! nothing of the worker uses, and that looks like a misspelling of a name it does use,
//! is reported (logged as a warning at start-up) with that name. The rule itself
//! (`keel_core::config::unused_sections`, `closest`) is tested in keel-core.

mod common;

use common::Lines;
use keel::layers::core::config::KeelConfig;
use keel::settings::UnusedSection;
use keel::{
    Keel, MachineRef, Outcome, StepContext, StepError, StepMachine, WorkerBuilder, WorkerConfig,
    json,
};

struct Order;

#[keel::async_trait]
impl StepMachine for Order {
    fn machine(&self) -> MachineRef {
        MachineRef::new("order", 1)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!(null), step: None })
    }
}

fn config(text: &str) -> KeelConfig {
    KeelConfig::from_toml_str(text).expect("a valid file")
}

fn typo(section: &str, near: &str) -> UnusedSection {
    UnusedSection { section: section.to_owned(), closest: Some(near.to_owned()) }
}

/// Starts `worker` under a subscriber that keeps what it logs, stops it, and returns
/// the lines: what a worker reports at start-up never stops it.
async fn logged_at_start(worker: WorkerBuilder) -> Vec<String> {
    let lines = Lines::default();
    // The interest cache is rebuilt under this subscriber, so a callsite another test's
    // thread registered meanwhile cannot keep a stale "never" for it.
    let handle = tracing::subscriber::with_default(lines.clone(), || {
        tracing::callsite::rebuild_interest_cache();
        worker.spawn()
    })
    .expect("reported at start-up, not refused");
    handle.shutdown().await;
    lines.0.lock().expect("not poisoned").clone()
}

const FILE: &str = "[machines.order.queue]\nname = \"payments\"\n\
                    [machines.ordr.queue]\ntimeout = \"5s\"\n\
                    [machines.payment.queue]\ntimeout = \"7s\"\n\
                    [queues.paymnts]\nconcurrency = 2\n\
                    [queues.payments]\nconcurrency = 4\n\
                    [queues.bulk]\nconcurrency = 1\n";

#[tokio::test]
async fn a_worker_reports_the_sections_its_machines_do_not_use() {
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(config(FILE));
    let worker = keel.worker().register(Order).expect("registers");
    assert_eq!(
        worker.unused_sections(),
        [
            typo("[machines.ordr]", "order"),
            UnusedSection { section: "[machines.payment]".to_owned(), closest: None },
            typo("[queues.paymnts]", "payments"),
        ],
        "`bulk` resembles no queue of the worker's machines: a queue chosen in code, left out"
    );
    // A machine another worker serves is not reported; the warnings never stop a worker.
    let worker = worker.served_elsewhere("payment");
    let unused = worker.unused_sections();
    assert_eq!(unused, [typo("[machines.ordr]", "order"), typo("[queues.paymnts]", "payments")]);
    worker.spawn().expect("unused sections are reported, not refused").shutdown().await;
    // Without a file there is nothing to report.
    let plain = Keel::connect("sqlite::memory:").await.expect("opens");
    assert_eq!(plain.worker().register(Order).expect("registers").unused_sections(), []);
}

/// The queues a worker's program gives it to claim from are in use: a `[queues.<q>]`
/// section for one of them is not a misspelling, even when `q` is close to a queue the
/// file starts the worker's machines in; the same section on a worker that does not
/// claim from `q` is still reported.
#[tokio::test]
async fn a_queue_the_worker_claims_from_is_in_use() {
    let file = "[machines.order.queue]\nname = \"tier2\"\n[queues.tier1]\nconcurrency = 4\n";
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(config(file));
    let mut claims = WorkerConfig::default();
    claims.queues.push(("tier1".to_owned(), 4));
    let worker = keel.worker_with(claims.clone()).register(Order).expect("registers");
    assert_eq!(worker.unused_sections(), []);
    let worker = keel.configured_worker(claims, None).expect("the Keel's file").register(Order);
    assert_eq!(worker.expect("registers").unused_sections(), []);
    let other = keel.worker().register(Order).expect("registers");
    assert_eq!(other.unused_sections(), [typo("[queues.tier1]", "tier2")]);
}

#[tokio::test]
async fn a_starting_worker_warns_of_a_likely_misspelling_and_notes_the_rest() {
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(config(FILE));
    let worker = keel.worker().register(Order).expect("registers");
    let lines = logged_at_start(worker).await;
    let logged = |needle: &str| lines.iter().any(|l| l.contains(needle));
    assert!(
        logged(
            "WARN configuration section [machines.ordr] names no machine or queue of this worker"
        ) && logged("did you mean `order`?"),
        "{lines:#?}"
    );
    assert!(logged("WARN configuration section [queues.paymnts]"), "{lines:#?}");
    assert!(
        logged(
            "INFO configuration sections for machines this worker does not register (served by other workers, or misspelt): [machines.payment]"
        ),
        "{lines:#?}"
    );
}

struct OrderV2;

#[keel::async_trait]
impl StepMachine for OrderV2 {
    fn machine(&self) -> MachineRef {
        MachineRef::new("order", 2)
    }
    async fn step(&self, _ctx: &StepContext) -> Result<Outcome, StepError> {
        Ok(Outcome::Done { result: json!(null), step: None })
    }
}

/// A schedule left on the default `version = 1` after its machine moved to version 2
/// starts instances no worker of the new deploy runs: the worker says so when it starts,
/// naming the schedule and the fix.
#[tokio::test]
async fn a_worker_warns_of_a_schedule_that_starts_a_version_it_does_not_register() {
    let file = "[schedules.nightly]\ncron = \"0 3 * * *\"\nstart = { machine = \"order\" }\n";
    let keel = Keel::connect("sqlite::memory:").await.expect("opens").with_settings(config(file));
    let worker = keel.worker().register(OrderV2).expect("registers");
    assert_eq!(
        worker.schedule_versions(),
        ["schedule `nightly` starts `order` v1, but this worker registers `order` v2 only; \
             its instances wait for a worker that registers v1. If v2 is meant, set \
             `version = 2` in the schedule's start"]
    );
    // Warned about, not refused: older workers may still serve v1.
    let lines = logged_at_start(worker).await;
    assert!(lines.iter().any(|l| l.starts_with("WARN schedule `nightly` starts")), "{lines:#?}");

    // The version it starts is registered (beside another), or the worker registers no
    // machine of that name (a node that only fires schedules): nothing to say.
    let both = keel.worker().register(Order).expect("v1").register(OrderV2).expect("v2");
    assert_eq!(both.schedule_versions(), Vec::<String>::new());
    assert_eq!(keel.worker().schedule_versions(), Vec::<String>::new());
}

/// The chart `order`, whose only event is `checkout` (and its `after` timer's `expire`).
fn order_chart() -> keel::ChartMachine {
    let chart = keel::Definition::builder("order", 1)
        .initial("cart")
        .state("cart", |s| {
            s.on_to("checkout", "paid")
                .on("expire", |t| t.target("paid").after(keel::Timer::days(1)))
        })
        .final_state("paid")
        .build()
        .expect("a valid chart");
    keel::ChartMachine::new(chart)
}

const EVENTS_FILE: &str = "[machines.order.events.chekout.queue]\nretry = { max_attempts = 10 }\n\
                           [machines.order.events.checkout.queue]\ntimeout = \"5s\"\n\
                           [machines.order.events.expire.queue]\ntimeout = \"5s\"\n\
                           [machines.order.events.refund.queue]\ntimeout = \"5s\"\n";

/// A step takes an event's section by the name of the signal it processes: a section
/// naming an event the registered chart does not have never takes effect, and a likely
/// misspelling of one it has is warned of with that event, at start-up.
#[tokio::test]
async fn a_worker_reports_an_event_section_naming_no_event_of_its_chart() {
    let keel =
        Keel::connect("sqlite::memory:").await.expect("opens").with_settings(config(EVENTS_FILE));
    let worker = keel.worker().register(order_chart()).expect("registers");
    assert_eq!(
        worker.unused_sections(),
        [
            typo("[machines.order.events.chekout]", "checkout"),
            UnusedSection { section: "[machines.order.events.refund]".to_owned(), closest: None },
        ],
        "`checkout` and the timer's `expire` are the chart's events"
    );
    let lines = logged_at_start(worker).await;
    let logged = |needle: &str| lines.iter().any(|l| l.contains(needle));
    assert!(
        logged("WARN configuration section [machines.order.events.chekout] names no event")
            && logged("did you mean `checkout`?"),
        "{lines:#?}"
    );
    assert!(
        logged(
            "INFO configuration sections for events the charts of this worker do not have (events of other versions, or misspelt): [machines.order.events.refund]"
        ),
        "{lines:#?}"
    );

    // A step machine's events are not known up front, nor are those of the versions
    // another worker serves: their event sections are not reported.
    assert_eq!(keel.worker().register(Order).expect("registers").unused_sections(), []);
    let elsewhere = keel.worker().register(order_chart()).expect("registers");
    assert_eq!(elsewhere.served_elsewhere("order").unused_sections(), []);
    let mixed = keel.worker().register(order_chart()).expect("v1").register(OrderV2);
    assert_eq!(mixed.expect("v2").unused_sections(), []);
}
