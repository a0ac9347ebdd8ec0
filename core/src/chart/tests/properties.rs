//! Property tests on generated definitions and event sequences: the macrostep never panics,
//! always leaves a legal configuration, and is deterministic.

use proptest::prelude::*;
use serde_json::json;

use super::{chart, run};
use crate::chart::{ChartBuilder, Event, Limits, StateBuilder};

/// A tiny deterministic generator, so one `u64` seed describes a whole definition.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        // xorshift64*; the seed is forced odd so it never sticks at zero.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Atomic,
    Compound,
    Parallel,
    Final,
}

#[derive(Debug, Clone)]
struct Branch {
    event: Option<&'static str>,
    target: Option<String>,
    guard: Option<&'static str>,
    action: Option<&'static str>,
}

#[derive(Debug, Clone)]
struct Node {
    key: String,
    kind: Kind,
    children: Vec<Node>,
    branches: Vec<Branch>,
    done: Vec<Branch>,
    entry: Option<&'static str>,
}

const EVENTS: [&str; 4] = ["E0", "E1", "E2", "E3"];
const GUARDS: [Option<&str>; 5] = [None, None, Some("yes"), Some("no"), Some("n_lt_3")];
const ACTIONS: [Option<&str>; 6] =
    [None, None, Some("inc"), Some("raise:E1"), Some("raise:E2"), Some("fail")];

fn tree(
    rng: &mut Rng,
    depth: usize,
    key: String,
    paths: &mut Vec<String>,
    path: &str,
    in_parallel: bool,
) -> Node {
    let roll = rng.below(10);
    let kind = if depth >= 3 || roll < 4 {
        // A final first child (the initial one) would complete its parent on entry, which
        // mostly produces `@done` loops; finals come later in document order. A region of
        // a parallel state is never final (validation refuses it).
        if rng.below(4) == 0 && !key.ends_with('0') && !in_parallel {
            Kind::Final
        } else {
            Kind::Atomic
        }
    } else if roll < 7 {
        Kind::Compound
    } else {
        Kind::Parallel
    };
    let count = match kind {
        Kind::Compound => 1 + rng.below(3),
        Kind::Parallel => 2 + rng.below(2),
        _ => 0,
    };
    let children = (0..count)
        .map(|i| {
            let child = format!("{path}.s{i}");
            paths.push(child.clone());
            tree(rng, depth + 1, format!("s{i}"), paths, &child, kind == Kind::Parallel)
        })
        .collect();
    // Entry actions rarely raise: a raise on entry that re-enters the same state is a genuine
    // loop, and too many of them would leave most generated instances stuck at init.
    let entry = match rng.below(16) {
        0 => Some("raise:E1"),
        1..=6 => Some("inc"),
        _ => None,
    };
    Node { key, kind, children, branches: Vec::new(), done: Vec::new(), entry }
}

fn branch(rng: &mut Rng, paths: &[String], eventless: bool) -> Branch {
    let target = if rng.below(5) == 0 { None } else { Some(rng.pick(paths).clone()) };
    if eventless {
        // Eventless branches count up to a bound so most settle; the few that loop through
        // other paths still exercise the depth limit.
        return Branch { event: None, target, guard: Some("n_lt_3"), action: Some("inc") };
    }
    Branch {
        event: Some(*rng.pick(&EVENTS)),
        target,
        guard: *rng.pick(&GUARDS),
        action: *rng.pick(&ACTIONS),
    }
}

fn transitions(rng: &mut Rng, node: &mut Node, paths: &[String]) {
    if node.kind != Kind::Final {
        for _ in 0..rng.below(4) {
            let eventless = rng.below(8) == 0;
            node.branches.push(branch(rng, paths, eventless));
        }
    }
    // `@done` only where it can fire (validation refuses it elsewhere).
    if matches!(node.kind, Kind::Compound | Kind::Parallel) && rng.below(2) == 0 && finishes(node) {
        let mut done = branch(rng, paths, true);
        done.guard = *rng.pick(&GUARDS);
        done.action = *rng.pick(&ACTIONS[..5]);
        node.done.push(done);
    }
    for child in &mut node.children {
        transitions(rng, child, paths);
    }
}

/// Whether `node` can ever be complete: a final state is, a compound state with a final
/// child can be, a parallel state when every region can be.
fn finishes(node: &Node) -> bool {
    match node.kind {
        Kind::Final => true,
        Kind::Atomic => false,
        Kind::Compound => node.children.iter().any(|c| c.kind == Kind::Final),
        Kind::Parallel => node.children.iter().all(finishes),
    }
}

trait Parent: Sized {
    fn add(self, node: &Node) -> Self;
}

fn configure(mut s: StateBuilder, node: &Node) -> StateBuilder {
    if let Some(first) = node.children.first()
        && node.kind == Kind::Compound
    {
        s = s.initial(first.key.clone());
    }
    for child in &node.children {
        s = s.add(child);
    }
    if let Some(a) = node.entry {
        s = s.entry(a);
    }
    for b in &node.branches {
        let (target, guard, action) = (b.target.clone(), b.guard, b.action);
        let fill = |mut x: crate::chart::BranchBuilder| {
            if let Some(t) = target.clone() {
                x = x.target(t);
            }
            if let Some(g) = guard {
                x = x.guard(g);
            }
            if let Some(a) = action {
                x = x.action(a);
            }
            x
        };
        s = match b.event {
            Some(e) => s.on(e, |t| t.branch(fill)),
            None => s.always(fill),
        };
    }
    for b in &node.done {
        let (target, action) = (b.target.clone(), b.action);
        s = s.on_done(|mut x| {
            if let Some(t) = target {
                x = x.target(t);
            }
            if let Some(a) = action {
                x = x.action(a);
            }
            x
        });
    }
    s
}

impl Parent for StateBuilder {
    fn add(self, node: &Node) -> Self {
        match node.kind {
            Kind::Atomic | Kind::Compound => self.state(node.key.clone(), |s| configure(s, node)),
            Kind::Parallel => self.parallel(node.key.clone(), |s| configure(s, node)),
            Kind::Final => self.final_with(node.key.clone(), |s| configure(s, node)),
        }
    }
}

impl Parent for ChartBuilder {
    fn add(self, node: &Node) -> Self {
        match node.kind {
            Kind::Atomic | Kind::Compound => self.state(node.key.clone(), |s| configure(s, node)),
            Kind::Parallel => self.parallel(node.key.clone(), |s| configure(s, node)),
            Kind::Final => self.final_with(node.key.clone(), |s| configure(s, node)),
        }
    }
}

/// A random valid definition from a seed: up to three levels, compound, parallel and final
/// states, guarded event, eventless and `@done` transitions with random targets.
fn generated(seed: u64) -> ChartBuilder {
    let mut rng = Rng(seed | 1);
    let mut paths = Vec::new();
    let mut roots: Vec<Node> = (0..=rng.below(3))
        .map(|i| {
            let key = format!("t{i}");
            paths.push(key.clone());
            tree(&mut rng, 1, key.clone(), &mut paths, &key, false)
        })
        .collect();
    for node in &mut roots {
        transitions(&mut rng, node, &paths);
    }
    let mut builder = chart().initial(roots[0].key.clone());
    for node in &roots {
        builder = builder.add(node);
    }
    builder
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn generated_charts_stay_legal_and_deterministic(
        seed in any::<u64>(),
        picks in proptest::collection::vec(0..5usize, 0..12),
        limit in 1..40usize,
    ) {
        let def = generated(seed).build().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let events: Vec<Event> = picks
            .iter()
            .map(|&i| EVENTS.get(i).map_or_else(|| Event::new("UNKNOWN"), |e| Event::new(*e)))
            .collect();
        let limits = Limits { max_transition_depth: limit };
        let first = run(&def, &json!({}), &events, limits);
        let mut previous = crate::chart::Configuration::empty();
        for result in &first {
            if result.error.is_some() {
                // A failed macrostep commits nothing: the configuration it started from.
                prop_assert_eq!(&result.configuration, &previous);
            } else {
                prop_assert_eq!(result.configuration.check(&def), Ok(()), "{:?}", result);
                // Guards and timers only fire in legal states; arming is the net change.
                prop_assert!(result.timers_to_arm.iter().all(|t| result.configuration.contains(&t.state)));
                // Guards here read only the context, so an unhandled event changes nothing.
                if result.unhandled {
                    prop_assert_eq!(&result.configuration, &previous);
                    prop_assert!(result.changed_keys.is_empty() && result.actions().is_empty());
                }
            }
            previous = result.configuration.clone();
        }
        let second = run(&def, &json!({}), &events, limits);
        prop_assert_eq!(first, second);
    }
}
