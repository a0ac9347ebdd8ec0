//! A worker refuses, at registration, a chart that names actions nobody bound, and at
//! start-up one that delegates to a machine nobody serves, naming every missing piece.

use keel::{ChartMachine, Definition, Keel, RegistrationError};

fn chart() -> Definition {
    Definition::builder("claim", 2)
        .initial("filed")
        .state("filed", |s| s.entry("notify").on("REVIEW", |t| t.target("review").action("assign")))
        .state("review", |s| s.machine("assessment").on_done(|b| b.target("paid").action("pay")))
        .final_state("paid")
        .build()
        .expect("valid chart")
}

async fn keel() -> Keel {
    Keel::connect("sqlite::memory:").await.expect("SQLite in memory opens")
}

fn check(result: Result<impl Sized, RegistrationError>, machine: &str, missing: &[&str]) {
    let Err(error) = result else { panic!("{machine}: expected a registration error") };
    assert_eq!(error.machine, machine);
    assert_eq!(error.missing, missing);
    let message = error.to_string();
    for name in missing {
        assert!(message.contains(name), "the message names {name}: {message}");
    }
    assert!(message.contains("Fix:"), "the message says how to fix it: {message}");
}

#[tokio::test]
async fn register_lists_every_unbound_action() {
    let keel = keel().await;
    let machine = ChartMachine::new(chart()).action("assign", |_, _| async { Ok(()) });
    let result = keel.worker().register(machine);
    check(result, "claim v2", &["action `notify`", "action `pay`"]);
}

#[tokio::test]
async fn spawn_lists_every_delegated_machine_nobody_serves() {
    let keel = keel().await;
    let machine = ChartMachine::new(chart())
        .action("assign", |_, _| async { Ok(()) })
        .action("notify", |_, _| async { Ok(()) })
        .action("pay", |_, _| async { Ok(()) });
    let builder = keel.worker().register(machine.clone()).expect("every action is bound");
    check(builder.spawn(), "claim v2", &["delegated machine `assessment`"]);

    // Declared as served by another worker, it starts.
    let worker = keel.worker().register(machine).unwrap().served_elsewhere("assessment");
    worker.spawn().expect("starts").shutdown().await;
}

#[tokio::test]
async fn a_chart_guard_nobody_registered_is_refused_when_the_definition_is_built() {
    let built = Definition::builder("claim", 1)
        .initial("a")
        .state("a", |s| {
            s.on("GO", |t| t.guard("approved").target("b")).on("X", |t| t.guard("vip").target("b"))
        })
        .final_state("b")
        .build();
    let message = built.expect_err("unknown guards").to_string();
    assert!(message.contains("`approved`") && message.contains("`vip`"), "{message}");
}

#[tokio::test]
async fn unknown_urls_say_which_ones_work() {
    let error = Keel::connect("mysql://root@localhost/db").await.expect_err("not a Keel backend");
    assert_eq!(
        error.to_string(),
        "cannot use the store URL \"mysql://root@localhost/db\": unknown scheme; use `sqlite://<file>`, `sqlite::memory:`, `postgres://…` or `memory://`"
    );
}
