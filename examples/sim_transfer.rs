//! Your own machine under simulated faults: a money transfer written as step functions,
//! run by Keel's deterministic simulator on the in-memory store with three simulated
//! workers that crash, lose leases, run on skewed clocks and get duplicate signals.
//! The simulator takes synchronous step functions over the claimed row and its inbox (and
//! charts with synchronous actions, `SimChart`), not a `StepMachine` or a `ChartMachine`:
//! a machine written as one is written again in this form to be simulated.
//!
//! After every simulated event the simulator checks Keel's rules (fencing, one commit per
//! step, nothing lost or hung) and the invariant written here: money is never created or
//! destroyed. A failing seed is printed with the shortest trace that still fails, and
//! `SIM_SEED=<seed>` replays it exactly.
//!
//! ```text
//! cargo run -p keel-examples --example sim_transfer            # 1 000 seeds
//! cargo run -p keel-examples --example sim_transfer -- 20000   # more seeds
//! SIM_SEED=42 cargo run -p keel-examples --example sim_transfer
//! ```

use keel::layers::core::StepCommit;
use keel::layers::testkit::sim::Simulation;
use keel::{
    Instance, MachineRef, NewInstance, NewSignal, Outcome, Signal, SignalTarget, Status, json,
};
use std::time::Instant;

const AMOUNT: i64 = 250;

fn transfer() -> MachineRef {
    MachineRef::new("transfer", 1)
}

/// debit → wait for `approve` or `reject` → credit or refund → done.
fn step(row: &Instance, inbox: &[Signal]) -> StepCommit {
    let mut ctx = row.context.clone();
    let next = |step: &str, context| Outcome::Next { step: step.into(), context };
    let outcome = match row.position.as_str() {
        "debit" => {
            ctx["from"] = json!(ctx["from"].as_i64().unwrap_or(0) - AMOUNT);
            Outcome::Await { signal: "*".into(), context: ctx, step: Some("decide".into()) }
        }
        "decide" => match inbox.iter().find(|s| s.name == "approve" || s.name == "reject") {
            Some(decision) => {
                let then = if decision.name == "approve" { "credit" } else { "refund" };
                return StepCommit::new(row.id, row.fencing_token, next(then, ctx))
                    .consume([decision.id]);
            }
            None => Outcome::Await { signal: "*".into(), context: ctx, step: None },
        },
        "credit" => {
            ctx["to"] = json!(ctx["to"].as_i64().unwrap_or(0) + AMOUNT);
            Outcome::Done { result: ctx, step: None }
        }
        _ => {
            ctx["from"] = json!(ctx["from"].as_i64().unwrap_or(0) + AMOUNT);
            Outcome::Done { result: ctx, step: None }
        }
    };
    StepCommit::new(row.id, row.fencing_token, outcome)
}

/// Money is conserved: what left `from` is in flight (between debit and credit or refund)
/// or arrived in `to`, and once the transfer is done nothing is in flight.
fn conserved(row: &Instance) -> Result<(), String> {
    let ctx = row.result.as_ref().unwrap_or(&row.context);
    let (from, to) = (ctx["from"].as_i64().unwrap_or(0), ctx["to"].as_i64().unwrap_or(0));
    let in_flight = 1_000 - from - to;
    let allowed = if row.status == Status::Done { 0..=0 } else { 0..=AMOUNT };
    if allowed.contains(&in_flight) {
        Ok(())
    } else {
        Err(format!("from = {from}, to = {to}: {in_flight} in flight"))
    }
}

fn main() {
    let seeds: u64 = match std::env::args().nth(1) {
        None => 1_000,
        Some(text) => text.parse().unwrap_or_else(|_| {
            eprintln!(
                "error: the number of seeds must be a whole number (got `{text}`); try `-- 5000`"
            );
            std::process::exit(2);
        }),
    };
    let mut sim = Simulation::new()
        .machine(transfer(), step)
        .signals(|row| {
            // Both decisions compete; the dedup key lets the first one pending win.
            let decision = |name| {
                NewSignal::new(SignalTarget::Id(row.id), name)
                    .dedup_key(format!("decision-{}", row.id))
            };
            vec![decision("approve"), decision("reject")]
        })
        .invariant("money is conserved", conserved);
    for _ in 0..5 {
        sim = sim.start(
            NewInstance::new(transfer(), "debit").context(json!({ "from": 1_000, "to": 0 })),
        );
    }
    let started = Instant::now();
    let sweep = sim.check_seeds(0..seeds);
    let t = sweep.total;
    println!(
        "{} seeds in {:.1} s: {} transfers finished, {} step commits, {} handler runs ({} lost to crashes or lost leases), {} crashes, {} leases reaped, {} stale commits refused — no rule broken",
        sweep.seeds,
        started.elapsed().as_secs_f64(),
        t.instances,
        t.commits,
        t.executions,
        t.executions - t.commits,
        t.crashes,
        t.reaped,
        t.commits_refused
    );
}
