//! Property testing for chart definitions: event sequences drawn from a definition's event
//! alphabet, and user invariants checked after every step.
//!
//! ```
//! use keel_core::chart::Definition;
//! let def = Definition::builder("light", 1)
//!     .initial("green")
//!     .state("green", |s| s.on_to("NEXT", "yellow"))
//!     .state("yellow", |s| s.on_to("NEXT", "red"))
//!     .state("red", |s| s.on_to("NEXT", "green"))
//!     .build()
//!     .unwrap();
//! keel_testkit::prop::check_invariant(def, |snapshot| snapshot.configuration.leaves(snapshot.definition).len() == 1);
//! ```

use std::sync::Arc;

use keel_core::chart::{Definition, Event};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::chart::{Snapshot, TestMachine};

/// A strategy for event sequences of up to `max_len` events, drawn from the definition's
/// event alphabet plus one event no state handles (so unhandled paths are exercised too).
pub fn events(definition: &Definition, max_len: usize) -> BoxedStrategy<Vec<Event>> {
    let mut alphabet = definition.event_alphabet();
    alphabet.push("__UNHANDLED__".to_owned());
    proptest::collection::vec(proptest::sample::select(alphabet).prop_map(Event::new), 0..=max_len)
        .boxed()
}

/// Options for [`check_invariant_with`].
#[derive(Debug, Clone)]
pub struct InvariantOptions {
    /// How many event sequences to try.
    pub cases: u32,
    /// The longest sequence.
    pub max_len: usize,
}

impl Default for InvariantOptions {
    fn default() -> Self {
        Self { cases: 256, max_len: 20 }
    }
}

/// Runs random event sequences against `definition` (no actions registered) and checks, after
/// the initial entry and after every event, that the configuration is legal, no macrostep
/// fails, and `invariant` holds. Panics with the shortest failing sequence found.
pub fn check_invariant(
    definition: impl Into<Arc<Definition>>,
    invariant: impl Fn(&Snapshot<'_>) -> bool,
) {
    let def: Arc<Definition> = definition.into();
    let factory = {
        let def = Arc::clone(&def);
        move || TestMachine::new(Arc::clone(&def))
    };
    check_invariant_with(&def, factory, &InvariantOptions::default(), invariant);
}

/// Like [`check_invariant`], with a machine factory (to register actions and a context) and
/// options.
pub fn check_invariant_with(
    definition: &Definition,
    factory: impl Fn() -> TestMachine,
    options: &InvariantOptions,
    invariant: impl Fn(&Snapshot<'_>) -> bool,
) {
    let mut runner = TestRunner::new(Config {
        cases: options.cases,
        failure_persistence: None,
        ..Config::default()
    });
    let outcome = runner.run(&events(definition, options.max_len), |events| {
        let mut machine = factory();
        check_snapshot(&mut machine, &invariant, "the initial entry")?;
        for (i, event) in events.iter().enumerate() {
            if let Err(e) = machine.try_send(event.clone()) {
                return Err(TestCaseError::fail(format!(
                    "event #{i} `{}` failed: {e}",
                    event.name
                )));
            }
            check_snapshot(&mut machine, &invariant, &format!("event #{i} `{}`", event.name))?;
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("invariant of `{}` violated: {e}", definition.name());
    }
}

fn check_snapshot(
    machine: &mut TestMachine,
    invariant: &impl Fn(&Snapshot<'_>) -> bool,
    after: &str,
) -> Result<(), TestCaseError> {
    let snapshot = machine.snapshot();
    if let Err(reason) = snapshot.configuration.check(snapshot.definition) {
        return Err(TestCaseError::fail(format!("illegal configuration after {after}: {reason}")));
    }
    if !invariant(&snapshot) {
        return Err(TestCaseError::fail(format!(
            "invariant false after {after}: active {:?}, context {}",
            snapshot.configuration.leaves(snapshot.definition),
            snapshot.context
        )));
    }
    Ok(())
}
