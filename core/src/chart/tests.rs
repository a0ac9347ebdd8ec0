//! Table-driven tests of the chart semantics.
//!
//! Every behaviour test goes through one helper, [`check`]: build a definition, run the
//! initial entry and a list of events with a tiny synchronous action runner, and compare a
//! textual dump (exits, entries, actions, unhandled events, final configuration, context)
//! with the expected text. Actions in these charts are interpreted by name:
//! `inc` adds one to `n`, `raise:X` raises `X`, `set:k=json` sets a key, `fail` fails;
//! anything else does nothing.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::*;

fn exec(request: &ActionRequest, ctx: &ChartContext) -> Result<ActionResult, ActionError> {
    let mut ctx = ChartContext::new(ctx.to_value());
    let name = request.name.as_str();
    if name == "inc" {
        let n = ctx.get_as::<i64>("n").unwrap_or(0);
        ctx.set("n", n + 1);
    } else if let Some(event) = name.strip_prefix("raise:") {
        ctx.raise(event);
    } else if let Some(kv) = name.strip_prefix("set:") {
        let (k, v) = kv.split_once('=').expect("set:k=v");
        ctx.set(k, serde_json::from_str::<Value>(v).expect("json"));
    } else if name == "fail" {
        return Err(ActionError::new("boom"));
    } else if name == "reject" {
        return Err(ActionError::permanent("card rejected"));
    } else if name == "payload" {
        ctx.set("payload", request.event.payload.clone());
    }
    Ok(ctx.into_result())
}

/// A builder with the guards the tables use.
fn chart() -> ChartBuilder {
    Definition::builder("test", 1)
        .guard("yes", |_, _| true)
        .guard("no", |_, _| false)
        .guard("n_ge_3", |c, _| c.get_as::<i64>("n").unwrap_or(0) >= 3)
        .guard("n_lt_3", |c, _| c.get_as::<i64>("n").unwrap_or(0) < 3)
        .guard("flag", |c, _| c.get("flag") == Some(&Value::Bool(true)))
        .guard("payload_ok", |_, e| e.payload == json!({"ok": true}))
}

fn events(list: &[&str]) -> Vec<Event> {
    list.iter()
        .map(|e| match e.split_once(' ') {
            Some((name, payload)) => {
                Event::with_payload(name, serde_json::from_str(payload).expect("payload json"))
            }
            None => Event::new(*e),
        })
        .collect()
}

/// Runs `init` then every event; returns every macrostep result.
fn run(
    def: &Definition,
    context: &Value,
    events: &[Event],
    limits: Limits,
) -> Vec<MacrostepResult> {
    let mut results = vec![run_to_completion(Macrostep::init(def, context.clone(), limits), exec)];
    for event in events {
        let last = results.last().expect("init ran");
        let step =
            Macrostep::start(def, &last.configuration, last.context.clone(), event.clone(), limits);
        let result = run_to_completion(step, exec);
        results.push(result);
    }
    results
}

fn dump(def: &Definition, results: &[MacrostepResult], names: &[String]) -> String {
    let mut out = Vec::new();
    for (result, name) in results.iter().zip(names) {
        let mut line = format!("{name}:");
        let parts =
            [("exit", result.exited()), ("enter", result.entered()), ("actions", result.actions())];
        for (label, items) in parts {
            if !items.is_empty() {
                let _ = write!(line, " {label} {}", items.join(","));
            }
        }
        if result.unhandled {
            line.push_str(" unhandled");
        }
        if let Some(e) = &result.error {
            let _ = write!(line, " error {e}");
        }
        out.push(line);
    }
    let last = results.last().expect("init ran");
    out.push(format!("config: {}", last.configuration.leaves(def).join(",")));
    if last.context != json!({}) {
        out.push(format!("context: {}", last.context));
    }
    out.join("\n")
}

/// The one helper: `events` entries are `NAME` or `NAME {json payload}`.
fn check_with(builder: ChartBuilder, context: &Value, limits: Limits, list: &[&str], expect: &str) {
    let def = builder.build().unwrap_or_else(|e| panic!("{e}"));
    let evs = events(list);
    let results = run(&def, context, &evs, limits);
    let names: Vec<String> =
        std::iter::once("@init".to_owned()).chain(evs.iter().map(|e| e.name.clone())).collect();
    for r in &results {
        assert_eq!(
            r.configuration.check(&def),
            Ok(()),
            "illegal configuration {:?}",
            r.configuration
        );
    }
    let got = dump(&def, &results, &names);
    let want: Vec<&str> = expect.trim().lines().map(str::trim).collect();
    assert_eq!(got, want.join("\n"), "\n--- got ---\n{got}\n");
}

fn check(builder: ChartBuilder, list: &[&str], expect: &str) {
    check_with(builder, &json!({}), Limits::default(), list, expect);
}

#[test]
fn entry_parents_first_exit_children_first() {
    check(
        chart()
            .initial("a")
            .state("a", |s| {
                s.entry("in_a").exit("out_a").initial("a1").state("a1", |s| {
                    s.entry("in_a1").exit("out_a1").initial("a11").state("a11", |s| {
                        s.entry("in_a11")
                            .exit("out_a11")
                            .on("GO", |t| t.target("b.b1").action("go"))
                    })
                })
            })
            .state("b", |s| s.entry("in_b").initial("b1").state("b1", |s| s.entry("in_b1"))),
        &["GO"],
        "
        @init: enter a,a.a1,a.a1.a11 actions in_a,in_a1,in_a11
        GO: exit a.a1.a11,a.a1,a enter b,b.b1 actions out_a11,out_a1,out_a,go,in_b,in_b1
        config: b.b1
        ",
    );
}

#[test]
fn document_order_selection() {
    // Two transitions for the same event on one state: the first in document order wins;
    // guards that fail are skipped.
    check(
        chart()
            .initial("a")
            .state("a", |s| {
                s.on("E", |t| t.guard("no").target("x"))
                    .on("E", |t| t.target("y").action("second"))
                    .on("E", |t| t.target("z").action("third"))
            })
            .leaf("x")
            .leaf("y")
            .leaf("z"),
        &["E"],
        "
        @init: enter a
        E: exit a enter y actions second
        config: y
        ",
    );
    // Parallel regions: both enabled transitions fire, in document order.
    check(
        chart().initial("p").parallel("p", |s| {
            s.state("r1", |r| {
                r.initial("a").state("a", |s| s.on("E", |t| t.target("b").action("r1"))).leaf("b")
            })
            .state("r2", |r| {
                r.initial("a").state("a", |s| s.on("E", |t| t.target("b").action("r2"))).leaf("b")
            })
        }),
        &["E"],
        "
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.a
        E: exit p.r2.a,p.r1.a enter p.r1.b,p.r2.b actions r1,r2
        config: p.r1.b,p.r2.b
        ",
    );
}

#[test]
fn inner_transition_preempts_outer() {
    check(
        chart()
            .initial("p")
            .state("p", |s| {
                s.on("E", |t| t.target("outer").action("outer"))
                    .initial("c")
                    .state("c", |s| s.on("E", |t| t.target("d").action("inner")))
                    .leaf("d")
            })
            .leaf("outer"),
        &["E", "E"],
        "
        @init: enter p,p.c
        E: exit p.c enter p.d actions inner
        E: exit p.d,p enter outer actions outer
        config: outer
        ",
    );
    // In a parallel state, a transition in a later region that conflicts with an earlier
    // one (both leave the parallel state) is pre-empted: document order wins.
    check(
        chart()
            .initial("p")
            .parallel("p", |s| {
                s.state("r1", |r| {
                    r.initial("a").state("a", |s| s.on("E", |t| t.target("x").action("first")))
                })
                .state("r2", |r| {
                    r.initial("a").state("a", |s| s.on("E", |t| t.target("y").action("second")))
                })
            })
            .leaf("x")
            .leaf("y"),
        &["E"],
        "
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.a
        E: exit p.r2.a,p.r2,p.r1.a,p.r1,p enter x actions first
        config: x
        ",
    );
}

#[test]
fn targetless_transitions_do_not_exit_or_enter() {
    check(
        chart()
            .initial("a")
            .state("a", |s| s.entry("in_a").exit("out_a").on("TICK", |t| t.action("inc"))),
        &["TICK", "TICK"],
        r#"
        @init: enter a actions in_a
        TICK: actions inc
        TICK: actions inc
        config: a
        context: {"n":2}
        "#,
    );
    // A self-transition, by contrast, exits and re-enters (SCXML external).
    check(
        chart().initial("a").state("a", |s| s.entry("in_a").exit("out_a").on_to("SELF", "a")),
        &["SELF"],
        "
        @init: enter a actions in_a
        SELF: exit a enter a actions out_a,in_a
        config: a
        ",
    );
    // An internal transition to a child does not exit its compound source.
    check(
        chart().initial("p").state("p", |s| {
            s.exit("out_p").initial("a").leaf("a").leaf("b").on("E", |t| t.target(".b").internal())
        }),
        &["E"],
        "
        @init: enter p,p.a
        E: exit p.a enter p.b
        config: p.b
        ",
    );
}

#[test]
fn raised_events_run_before_the_next_external_event() {
    check(
        chart()
            .initial("a")
            .state("a", |s| s.on("GO", |t| t.target("b").action("raise:R1").action("raise:R2")))
            .state("b", |s| {
                s.on("R1", |t| t.target("c").action("got_r1")).on("LATER", |t| t.target("z"))
            })
            .state("c", |s| s.on("R2", |t| t.target("d").action("got_r2")))
            .state("d", |s| s.on_to("LATER", "e"))
            .leaf("e")
            .leaf("z"),
        &["GO", "LATER"],
        "
        @init: enter a
        GO: exit a,b,c enter b,c,d actions raise:R1,raise:R2,got_r1,got_r2
        LATER: exit d enter e
        config: e
        ",
    );
}

#[test]
fn always_chains_until_stable_and_guards_see_fresh_context() {
    check(
        chart()
            .initial("a")
            .state("a", |s| s.on("GO", |t| t.target("b")))
            .state("b", |s| s.always(|b| b.target("c").action("inc")))
            .state("c", |s| s.always(|b| b.guard("n_lt_3").target("b")).always(|b| b.target("d")))
            .leaf("d"),
        &["GO"],
        r#"
        @init: enter a
        GO: exit a,b,c,b,c,b,c enter b,c,b,c,b,c,d actions inc,inc,inc
        config: d
        context: {"n":3}
        "#,
    );
}

/// The depth error names the state whose transition loops (in a parallel chart, the
/// looping region's, not the last active leaf's) and the event being processed.
#[test]
fn depth_error_names_the_looping_state_and_the_event_being_processed() {
    let def = chart()
        .initial("p")
        .parallel("p", |p| {
            p.state("r1", |r| {
                r.initial("x")
                    .state("x", |s| s.always(|b| b.target("y")))
                    .state("y", |s| s.always(|b| b.target("x")))
            })
            .state("r2", |r| r.initial("quiet").leaf("quiet"))
        })
        .build()
        .unwrap();
    let step = Macrostep::init(&def, json!({}), Limits { max_transition_depth: 5 });
    let result = run_to_completion(step, exec);
    let Some(MacrostepError::MaxTransitionDepthExceeded { limit, state, event }) = result.error
    else {
        panic!("depth error: {:?}", result.error);
    };
    assert_eq!(limit, 5);
    // Five microsteps ran (x→y, y→x, x→y, y→x, x→y): the sixth is from `y`.
    assert_eq!(state, "p.r1.y", "the looping region's state, not `p.r2.quiet`");
    assert_eq!(event, "@init");

    // A raise loop: the event at the limit is the one just taken off the queue.
    let def = chart()
        .initial("a")
        .state("a", |s| {
            s.on("PING", |t| t.action("raise:PONG")).on("PONG", |t| t.action("raise:PING"))
        })
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["PING"]), Limits { max_transition_depth: 3 });
    let Some(MacrostepError::MaxTransitionDepthExceeded { state, event, .. }) = &results[1].error
    else {
        panic!("depth error: {:?}", results[1].error);
    };
    // PONG (1), PING (2), PONG (3), then PING goes over the limit.
    assert_eq!((state.as_str(), event.as_str()), ("a", "PING"));
}

#[test]
fn always_loop_hits_the_depth_limit() {
    let looping = || {
        chart()
            .initial("a")
            .state("a", |s| s.on_to("GO", "b"))
            .state("b", |s| s.always(|b| b.target("c")))
            .state("c", |s| s.always(|b| b.target("b")))
    };
    check_with(
        looping(),
        &json!({}),
        Limits { max_transition_depth: 10 },
        &["GO"],
        "
        @init: enter a
        GO: exit a,b,c,b,c,b,c,b,c,b,c enter b,c,b,c,b,c,b,c,b,c,b error MaxTransitionDepthExceeded: more than 10 microsteps after one event (last from state `b` on `GO`); fix: break the @always/raise loop or raise Limits::max_transition_depth
        config: a
        ",
    );
    // A raise loop is bounded the same way, with the default limit.
    let def = chart()
        .initial("a")
        .state("a", |s| s.on("PING", |t| t.action("raise:PING")))
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["PING"]), Limits::default());
    let err = results[1].error.as_ref().expect("depth error");
    assert!(matches!(err, MacrostepError::MaxTransitionDepthExceeded { limit: 100, .. }), "{err}");
    assert_eq!(results[1].configuration, results[0].configuration);
}

#[test]
fn compound_done() {
    check(
        chart()
            .initial("p")
            .state("p", |s| {
                s.initial("work")
                    .state("work", |s| s.on_to("FINISH", "end"))
                    .final_with("end", |s| s.entry("in_end"))
                    .on_done(|b| b.target("next").action("p_done"))
            })
            .leaf("next"),
        &["FINISH"],
        "
        @init: enter p,p.work
        FINISH: exit p.work,p.end,p enter p.end,next actions in_end,p_done
        config: next
        ",
    );
}

#[test]
fn parallel_done_waits_for_every_region_and_follows_region_done() {
    let def = chart()
        .initial("p")
        .parallel("p", |s| {
            s.state("r1", |r| {
                r.initial("a")
                    .state("a", |s| s.on_to("A", "fin"))
                    .final_state("fin")
                    .on_done(|b| b.action("r1_done"))
            })
            .state("r2", |r| {
                r.initial("b")
                    .state("b", |s| s.on_to("B", "fin"))
                    .final_state("fin")
                    .on_done(|b| b.action("r2_done"))
            })
            .on_done(|b| b.target("out").action("p_done"))
        })
        .leaf("out");
    check(
        def,
        &["A", "B"],
        "
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.b
        A: exit p.r1.a enter p.r1.fin actions r1_done
        B: exit p.r2.b,p.r2.fin,p.r2,p.r1.fin,p.r1,p enter p.r2.fin,out actions r2_done,p_done
        config: out
        ",
    );
}

#[test]
fn parallel_done_event_order() {
    let def = chart()
        .initial("p")
        .parallel("p", |s| {
            s.state("r1", |r| {
                r.initial("a").state("a", |s| s.on_to("GO", "fin")).final_state("fin")
            })
            .state("r2", |r| r.initial("b").state("b", |s| s.on_to("GO", "fin")).final_state("fin"))
            .on_done(|b| b.target("out"))
        })
        .leaf("out")
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["GO"]), Limits::default());
    let names: Vec<&str> = results[1].internal_events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["done.state.p.r1", "done.state.p.r2", "done.state.p"]);
}

/// A parallel state used as a region completes its parent when it finishes last: its
/// `done.state` is followed by the outer parallel state's, and the outer `@done` fires,
/// whichever region finishes last.
#[test]
fn a_nested_parallel_region_finishing_last_completes_the_outer_parallel_state() {
    let region = |r: StateBuilder, event: &'static str| {
        r.initial("a").state("a", move |s| s.on_to(event, "f")).final_state("f")
    };
    let def = chart()
        .initial("p")
        .parallel("p", |p| {
            p.state("r1", |r| region(r, "A"))
                .parallel("r2", |q| q.state("x", |r| region(r, "X")).state("y", |r| region(r, "Y")))
                .on_done(|b| b.target("z"))
        })
        .leaf("z")
        .build()
        .expect("valid");
    for order in [["A", "X", "Y"], ["X", "A", "Y"], ["X", "Y", "A"]] {
        let results = run(&def, &json!({}), &events(&order), Limits::default());
        let last = results.last().expect("ran");
        assert_eq!(last.configuration.leaves(&def), ["z"], "after {order:?}");
        let names: Vec<&str> = last.internal_events.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names.last(), Some(&"done.state.p"), "after {order:?}: {names:?}");
        assert_eq!(names.iter().filter(|n| **n == "done.state.p").count(), 1, "{names:?}");
    }
}

#[test]
fn conditional_done_and_fail() {
    let def = || {
        chart()
            .initial("p")
            .parallel("p", |s| {
                s.state("r1", |r| {
                    r.initial("a").state("a", |s| s.on_to("GO", "fin")).final_state("fin")
                })
                .state("r2", |r| {
                    r.initial("b").state("b", |s| s.on_to("GO", "fin")).final_state("fin")
                })
                .on_done(|b| b.guard("n_ge_3").target("big"))
                .on_done(|b| b.target("small"))
                .on_fail(|b| b.guard("flag").target("retrying").action("inc"))
                .on_fail(|b| b.target("failed").action("payload"))
            })
            .leaf("big")
            .leaf("small")
            .leaf("retrying")
            .leaf("failed")
    };
    let done = "
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.b
        GO: exit p.r2.b,p.r1.a,p.r2.fin,p.r2,p.r1.fin,p.r1,p enter p.r1.fin,p.r2.fin,{target}
        config: {target}
        context: {context}
    ";
    let n3 = json!({"n": 3});
    let expect = done.replace("{target}", "big").replace("{context}", &n3.to_string());
    check_with(def(), &n3, Limits::default(), &["GO"], &expect);
    let n1 = json!({"n": 1});
    let expect = done.replace("{target}", "small").replace("{context}", &n1.to_string());
    check_with(def(), &n1, Limits::default(), &["GO"], &expect);
    // @fail from a region's failure (as the runtime delivers it): first matching branch wins.
    check_with(
        def(),
        &json!({"flag": true}),
        Limits::default(),
        &["fail.state.p.r1 {\"region_id\":\"p.r1\"}"],
        r#"
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.b
        fail.state.p.r1: exit p.r2.b,p.r2,p.r1.a,p.r1,p enter retrying actions inc
        config: retrying
        context: {"flag":true,"n":1}
        "#,
    );
    check(
        def(),
        &["fail.state.p.r1 {\"region_id\":\"p.r1\"}"],
        r#"
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.b
        fail.state.p.r1: exit p.r2.b,p.r2,p.r1.a,p.r1,p enter failed actions payload
        config: failed
        context: {"payload":{"region_id":"p.r1"}}
        "#,
    );
}

#[test]
fn leaving_a_parallel_state_exits_every_region() {
    check(
        chart()
            .initial("p")
            .parallel("p", |s| {
                s.exit("out_p")
                    .on("CANCEL", |t| t.target("cancelled").action("cancel"))
                    .state("r1", |r| r.exit("out_r1").initial("a").state("a", |s| s.exit("out_r1a")))
                    .state("r2", |r| r.exit("out_r2").initial("b").state("b", |s| s.exit("out_r2b")))
            })
            .leaf("cancelled"),
        &["CANCEL"],
        "
        @init: enter p,p.r1,p.r1.a,p.r2,p.r2.b
        CANCEL: exit p.r2.b,p.r2,p.r1.a,p.r1,p enter cancelled actions out_r2b,out_r2,out_r1a,out_r1,out_p,cancel
        config: cancelled
        ",
    );
}

#[test]
fn unhandled_events_leave_the_configuration_unchanged() {
    check(
        chart().initial("a").state("a", |s| s.on("E", |t| t.guard("no").target("b"))).leaf("b"),
        &["NOPE", "E"],
        "
        @init: enter a
        NOPE: unhandled
        E: unhandled
        config: a
        ",
    );
}

#[test]
fn guards_see_payload_and_actions_see_event() {
    check(
        chart()
            .initial("a")
            .state("a", |s| s.on("PAY", |t| t.guard("payload_ok").target("paid").action("payload")))
            .final_state("paid"),
        &["PAY {\"ok\":false}", "PAY {\"ok\":true}", "PAY"],
        r#"
        @init: enter a
        PAY: unhandled
        PAY: exit a enter paid actions payload
        PAY: unhandled
        config: paid
        context: {"payload":{"ok":true}}
        "#,
    );
}

#[test]
fn action_error_fails_the_macrostep_and_commits_nothing() {
    check(
        chart()
            .initial("a")
            .state("a", |s| s.on("GO", |t| t.target("b").action("inc").action("fail")))
            .leaf("b"),
        &["GO"],
        "
        @init: enter a
        GO: exit a actions inc,fail error action `fail` of state `a` failed: boom
        config: a
        ",
    );
}

#[test]
fn action_errors_say_whether_a_retry_can_help() {
    let def = chart()
        .initial("a")
        .state("a", |s| s.on("RETRY", |t| t.action("fail")).on("REJECT", |t| t.action("reject")))
        .state("b", |s| s.always(|b| b.target("b")))
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["RETRY", "REJECT"]), Limits::default());
    assert!(results[1].error.as_ref().is_some_and(MacrostepError::is_retryable));
    let rejected = results[2].error.as_ref().expect("error");
    assert!(!rejected.is_retryable());
    assert_eq!(rejected.to_string(), "action `reject` of state `a` failed: card rejected");
    let loop_config = Configuration::from_paths(["b"]);
    let looped = run_to_completion(
        Macrostep::start(&def, &loop_config, json!({}), Event::new("X"), Limits::default()),
        exec,
    );
    assert!(!looped.error.expect("depth").is_retryable());
}

#[test]
fn illegal_configuration_is_reported() {
    let def = chart().initial("a").leaf("a").leaf("b").build().unwrap();
    for (paths, reason) in [
        (vec![], "compound `(root)` has 0 active children, expected exactly 1"),
        (vec!["a", "b"], "compound `(root)` has 2 active children, expected exactly 1"),
        (vec!["zz"], "unknown state `zz`"),
    ] {
        let config = Configuration::from_paths(paths);
        let result = run_to_completion(
            Macrostep::start(&def, &config, json!({}), Event::new("E"), Limits::default()),
            exec,
        );
        let message = result.error.expect("error").to_string();
        assert_eq!(
            message,
            format!(
                "the stored configuration does not fit definition `test v1`: {reason}; the chart was changed under the same version, so it no longer fits the instances already running on it; fix: restore the states the change removed or moved, or restore this version as it was, publish the change as a new version and move the instances with `Migration::new(old, new)`"
            )
        );
    }
    // An instance waiting in `cart` after the chart lost `cart` under the same version: the
    // fix is not a migration to "this version" (the instance is on it, and a migration
    // between two definitions of one version is refused).
    let edited = Definition::builder("order", 1).initial("basket").leaf("basket").build().unwrap();
    let waiting = Configuration::from_paths(["cart"]);
    let result = run_to_completion(
        Macrostep::start(&edited, &waiting, json!({}), Event::new("PAY"), Limits::default()),
        exec,
    );
    let message = result.error.expect("error").to_string();
    assert!(message.contains("unknown state `cart`"), "{message}");
    assert!(message.contains("changed under the same version"), "{message}");
    assert!(message.contains("publish the change as a new version"), "{message}");
    assert!(!message.contains("migrate the instance to this version"), "{message}");
}

#[test]
fn context_must_be_an_object() {
    let def = chart().initial("a").leaf("a").build().unwrap();
    let init = run_to_completion(Macrostep::init(&def, json!(null), Limits::default()), exec);
    assert_eq!((init.error, init.context), (None, json!({})));
    let bad = run_to_completion(Macrostep::init(&def, json!([1]), Limits::default()), exec);
    let message = bad.error.expect("error").to_string();
    assert_eq!(
        message,
        "the context must be a JSON object, got `array`; fix: wrap the value in a struct or map"
    );
    let config = Configuration::from_paths(["a"]);
    let bad = run_to_completion(
        Macrostep::start(&def, &config, json!(3), Event::new("E"), Limits::default()),
        exec,
    );
    assert!(matches!(bad.error, Some(MacrostepError::ContextNotObject { .. })));
    assert_eq!(bad.configuration, config);
}

#[test]
fn top_level_final_completes_the_machine() {
    let def = chart()
        .initial("a")
        .state("a", |s| s.on_to("END", "done"))
        .final_state("done")
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["END", "END"]), Limits::default());
    assert!(!results[0].is_final);
    assert!(results[1].is_final);
    assert!(results[2].unhandled);
    assert_eq!(results[2].configuration.leaves(&def), ["done"]);
}

/// State, event, kind, interval in seconds, max, then.
type Arm = (String, String, TimerKind, u64, Option<u32>, Option<String>);

fn timer_chart() -> ChartBuilder {
    chart()
        .initial("cart")
        .state("cart", |s| s.on_to("CHECKOUT", "awaiting"))
        .state("awaiting", |s| {
            s.on_to("PAY", "paid")
                .on("ORDER_EXPIRED", |t| t.target("cancelled").after(Timer::days(7)))
                .on("REMIND", |t| t.action("remind").every(Timer::hours(6)).max(3).then("GIVE_UP"))
                .on_to("GIVE_UP", "cancelled")
                .on("TOUCH", |t| t.target("awaiting"))
        })
        .state("paid", |s| {
            s.machine("shipping")
                .on_timeout(Timer::minutes(5), |b| b.target("cancelled"))
                .on("done.invoke.paid", |t| t.target("shipped"))
        })
        .final_state("shipped")
        .final_state("cancelled")
}

#[test]
fn timers_and_children_follow_state_entry_and_exit() {
    let def = timer_chart().build().unwrap();
    let results = run(&def, &json!({}), &events(&["CHECKOUT", "TOUCH", "PAY"]), Limits::default());
    let arm: Vec<Arm> = results[1]
        .timers_to_arm
        .iter()
        .map(|t| {
            (t.state.clone(), t.event.clone(), t.kind, t.interval.as_secs(), t.max, t.then.clone())
        })
        .collect();
    assert_eq!(
        arm,
        vec![
            ("awaiting".into(), "ORDER_EXPIRED".into(), TimerKind::After, 604_800, None, None),
            (
                "awaiting".into(),
                "REMIND".into(),
                TimerKind::Every,
                21_600,
                Some(3),
                Some("GIVE_UP".into())
            ),
        ]
    );
    assert!(results[1].timers_to_cancel.is_empty());
    // A self-loop exits and re-enters, but the timers keep their original anchor.
    assert_eq!(results[2].exited(), ["awaiting"]);
    assert!(results[2].timers_to_arm.is_empty() && results[2].timers_to_cancel.is_empty());
    // Leaving cancels; entering a delegation state starts the child and arms @timeout.
    assert_eq!(results[3].timers_to_cancel, [TimerCancel { state: "awaiting".into() }]);
    assert_eq!(
        results[3].children_to_start,
        [ChildStart { state: "paid".into(), machine: "shipping".into() }]
    );
    assert_eq!(results[3].timers_to_arm[0].event, "timeout.invoke.paid");
    assert_eq!(results[3].timers_to_arm[0].interval.as_secs(), 300);
    // @timeout fires from the runtime's timer event.
    let timeout = run_to_completion(
        Macrostep::start(
            &def,
            &results[3].configuration,
            json!({}),
            Event::timeout_invoke("paid"),
            Limits::default(),
        ),
        exec,
    );
    assert_eq!(timeout.configuration.leaves(&def), ["cancelled"]);
    assert_eq!(timeout.children_to_cancel, ["paid"]);
    assert!(timeout.is_final);
}

/// Renewable timers: a deadline is renewed by leaving its state for a transit state that
/// comes straight back with `@always`; a self-loop and a targetless transition keep it.
/// A parent that was never left keeps its own timers while its child renews.
#[test]
fn a_transit_state_renews_timers_and_a_self_loop_keeps_them() {
    let def = chart()
        .initial("session")
        .state("session", |s| {
            s.initial("idle")
                .on("SESSION_END", |t| t.target("closed").after(Timer::hours(8)))
                .state("idle", |i| {
                    i.on("LOGOUT", |t| t.target("closed").after(Timer::minutes(30)))
                        .on("PING", |t| t.every(Timer::minutes(5)).action("ping"))
                        .on_to("ACTIVITY", "renewing")
                        .on_to("TOUCH", "idle")
                        .on("NOTE", |t| t.action("note"))
                })
                .state("renewing", |r| r.always(|b| b.target("idle")))
        })
        .final_state("closed")
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["ACTIVITY", "TOUCH", "NOTE"]), Limits::default());
    let arms = |r: &MacrostepResult| {
        r.timers_to_arm.iter().map(|t| format!("{}:{}", t.state, t.event)).collect::<Vec<_>>()
    };
    let cancels = |r: &MacrostepResult| {
        r.timers_to_cancel.iter().map(|t| t.state.clone()).collect::<Vec<_>>()
    };
    assert_eq!(
        arms(&results[0]),
        ["session:SESSION_END", "session.idle:LOGOUT", "session.idle:PING"]
    );
    // ACTIVITY: idle → renewing → @always → idle. The net configuration is unchanged, but
    // idle was left and entered again: its timers count from now. session was never left.
    assert_eq!(results[1].configuration.leaves(&def), ["session.idle"]);
    assert_eq!(results[1].exited(), ["session.idle", "session.renewing"]);
    assert_eq!(cancels(&results[1]), ["session.idle"]);
    assert_eq!(arms(&results[1]), ["session.idle:LOGOUT", "session.idle:PING"]);
    // TOUCH is a self-loop: idle is exited and re-entered by one transition, never left.
    assert_eq!(results[2].exited(), ["session.idle"]);
    assert!(cancels(&results[2]).is_empty() && arms(&results[2]).is_empty());
    // NOTE is targetless: nothing is exited.
    assert!(results[3].exited().is_empty());
    assert!(cancels(&results[3]).is_empty() && arms(&results[3]).is_empty());
}

fn arms(r: &MacrostepResult) -> Vec<String> {
    r.timers_to_arm.iter().map(|t| format!("{}:{}", t.state, t.event)).collect()
}

fn cancels(r: &MacrostepResult) -> Vec<String> {
    r.timers_to_cancel.iter().map(|t| t.state.clone()).collect()
}

fn starts(r: &MacrostepResult) -> Vec<String> {
    r.children_to_start.iter().map(|c| format!("{}:{}", c.state, c.machine)).collect()
}

/// `@fail → same state` retries: the state re-entered while handling the end of its own
/// child starts a new child (the old one is over), directly or through a transit state,
/// and its `@timeout` deadline counts from the new entry. `@done → same state` runs the
/// job again. Nothing is cancelled, so the commit cannot cancel the child it starts.
#[test]
fn a_delegation_state_reentered_on_the_end_of_its_child_starts_a_new_one() {
    let def = chart()
        .initial("work")
        .state("work", |s| {
            s.machine("job")
                .on_timeout(Timer::minutes(5), |b| b.target("gave_up"))
                .on_fail(|b| b.target("work"))
                .on_done(|b| b.target("work"))
        })
        .state("work2", |s| s.machine("job").on_fail(|b| b.target("again")))
        .state("again", |s| s.always(|b| b.target("work2")))
        .final_state("gave_up")
        .build()
        .unwrap();
    let failed = Event::fail_state("work", json!({ "child": 7, "status": "failed" }));
    let results =
        run(&def, &json!({}), &[failed, Event::done_invoke("work", json!(1))], Limits::default());
    assert_eq!(starts(&results[0]), ["work:job"]);
    for r in &results[1..] {
        assert_eq!(r.exited(), ["work"]);
        assert_eq!(starts(r), ["work:job"], "a new child for the retry");
        assert!(
            r.children_to_cancel.is_empty(),
            "the old child is over: {:?}",
            r.children_to_cancel
        );
        assert_eq!(cancels(r), ["work"]);
        assert_eq!(arms(r), ["work:timeout.invoke.work"], "a fresh deadline for the new child");
    }
    // Through a transit state.
    let at = Configuration::from_paths(["work2"]);
    let failed = Event::fail_state("work2", json!({ "child": 8, "status": "failed" }));
    let retry =
        run_to_completion(Macrostep::start(&def, &at, json!({}), failed, Limits::default()), exec);
    assert_eq!(retry.configuration.leaves(&def), ["work2"]);
    assert_eq!(starts(&retry), ["work2:job"]);
    assert!(retry.children_to_cancel.is_empty());
    // Another event that re-enters the state keeps the running child.
    let def = chart()
        .initial("work")
        .state("work", |s| s.machine("job").on_to("POKE", "work"))
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["POKE"]), Limits::default());
    assert_eq!(results[1].exited(), ["work"]);
    assert!(starts(&results[1]).is_empty() && results[1].children_to_cancel.is_empty());
}

/// A timer's fire, as the sweep delivers it: its payload names the owning state.
fn fire_of(event: &str, state: &str) -> Event {
    Event::with_payload(event, json!({ "timer": 1, "state": state, "fire": 1 }))
}

/// `@timeout → same state` is a retry: the timed-out child is cancelled, a new one starts
/// with a fresh deadline, and the state's other timers are armed afresh. The same event
/// sent by someone else (its payload names no owner) is no timeout and retries nothing.
#[test]
fn a_delegation_state_reentered_on_its_timeout_retries_its_child() {
    let def = chart()
        .initial("work")
        .state("work", |s| {
            s.machine("job")
                .on_timeout(Timer::minutes(5), |b| b.target("work"))
                .on("NAG", |t| t.after(Timer::minutes(1)).action("nag"))
        })
        .build()
        .unwrap();
    let fired = fire_of("timeout.invoke.work", "work");
    let results = run(&def, &json!({}), &[fired], Limits::default());
    assert_eq!(results[1].exited(), ["work"]);
    assert_eq!(results[1].children_to_cancel, ["work"], "the timed-out child is cancelled");
    assert_eq!(starts(&results[1]), ["work:job"], "and a new one starts");
    assert_eq!(cancels(&results[1]), ["work"]);
    assert_eq!(arms(&results[1]), ["work:NAG", "work:timeout.invoke.work"]);
    let forged = Event::with_payload("timeout.invoke.work", json!({ "state": "elsewhere" }));
    let results = run(&def, &json!({}), &[forged], Limits::default());
    assert!(starts(&results[1]).is_empty() && results[1].children_to_cancel.is_empty());
}

/// A polling loop: an `after` transition that targets its own state arms its timer again
/// (the fire deleted it), and so does a `then` that comes back; an `every` self-loop keeps
/// its still-armed timer and its count. The state's other timers, and its descendants',
/// keep their anchors: a self-loop renews only what it used up.
#[test]
fn a_self_loop_on_a_spent_timer_arms_it_again() {
    let def = chart()
        .initial("polling")
        .state("polling", |s| {
            s.entry("poll")
                .on("AGAIN", |t| t.target("polling").after(Timer::minutes(1)))
                .on("TICK", |t| t.target("polling").every(Timer::minutes(1)).max(3).then("RESTART"))
                .on_to("RESTART", "polling")
                .on("EXPIRE", |t| t.target("expired").after(Timer::days(7)))
                .initial("inner")
                .state("inner", |i| i.on("PING", |t| t.every(Timer::seconds(10)).action("ping")))
        })
        .leaf("expired")
        .build()
        .unwrap();
    let fires = [
        fire_of("AGAIN", "polling"),
        fire_of("TICK", "polling"),
        fire_of("RESTART", "polling"),
        Event::new("AGAIN"),
    ];
    let results = run(&def, &json!({}), &fires, Limits::default());
    let all = ["polling:AGAIN", "polling:TICK", "polling:EXPIRE", "polling.inner:PING"];
    assert_eq!(arms(&results[0]), all);
    // AGAIN: the `after` timer fired and is gone; the new entry arms it alone again.
    assert_eq!(results[1].actions(), ["poll"]);
    assert!(cancels(&results[1]).is_empty(), "EXPIRE and PING keep their anchors");
    assert_eq!(arms(&results[1]), ["polling:AGAIN"]);
    // TICK: the `every` timer is still armed and keeps counting towards `then`.
    assert_eq!(results[2].actions(), ["poll"]);
    assert!(cancels(&results[2]).is_empty() && arms(&results[2]).is_empty());
    // RESTART: the `then` was delivered, the `every` timer is spent.
    assert!(cancels(&results[3]).is_empty());
    assert_eq!(arms(&results[3]), ["polling:TICK"]);
    // An AGAIN sent by someone else uses up no timer: the armed one stays, none is added.
    assert_eq!(results[4].actions(), ["poll"]);
    assert!(cancels(&results[4]).is_empty() && arms(&results[4]).is_empty());
}

#[test]
fn macrostep_protocol_repeats_pending_action_and_ignores_stray_results() {
    let def = chart().initial("a").state("a", |s| s.on("E", |t| t.action("x"))).build().unwrap();
    let config = Configuration::from_paths(["a"]);
    let mut step = Macrostep::start(&def, &config, json!({}), Event::new("E"), Limits::default());
    let Next::RunAction(first) = step.poll() else { panic!("expected an action") };
    assert_eq!(step.poll(), Next::RunAction(first.clone()));
    assert_eq!(first.phase, ActionPhase::Transition);
    assert_eq!(first.state, "a");
    step.handle_action_result(Ok(ActionResult::empty().set("k", 1)));
    step.handle_action_result(Ok(ActionResult::empty().set("k", 2)));
    let Next::Done(result) = step.poll() else { panic!("expected done") };
    assert_eq!(result.context, json!({"k": 1}));
    assert_eq!(result.changed_keys, ["k"]);
    assert_eq!(step.poll(), Next::Done(result));
}

#[test]
fn configuration_state_value_and_matches() {
    let def = chart()
        .initial("p")
        .parallel("p", |s| {
            s.state("inventory", |r| r.initial("checking").leaf("checking"))
                .state("payment", |r| r.initial("charging").leaf("charging"))
        })
        .build()
        .unwrap();
    let init = run(&def, &json!({}), &[], Limits::default()).remove(0);
    let config = init.configuration;
    assert_eq!(
        config.state_value(&def),
        json!({"p": {"inventory": "checking", "payment": "charging"}})
    );
    assert!(config.matches(&json!("p")));
    assert!(config.matches(&json!("p.inventory.checking")));
    assert!(config.matches(&json!({"p": {"payment": "charging"}})));
    assert!(!config.matches(&json!({"p": {"payment": "done"}})));
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(
        json,
        r#"["p","p.inventory","p.inventory.checking","p.payment","p.payment.charging"]"#
    );
    assert_eq!(serde_json::from_str::<Configuration>(&json).unwrap(), config);
}

/// Every validation error, with its full message.
#[test]
fn validation_errors_name_the_state_and_the_fix() {
    let cases: Vec<(ChartBuilder, &str)> = vec![
        (
            chart().initial("a").state("a", |s| s.on_to("GO", "nowhere")),
            "state `a`: transition on `GO` targets unknown state `nowhere`; fix: use the key of a sibling or ancestor's sibling, `.child` for a child, or a full dotted path",
        ),
        (
            chart().initial("a").state("a", |s| s.leaf("x").leaf("y")),
            "compound state `a` has no initial state; fix: call `.initial(\"<child key>\")` on it",
        ),
        (
            chart().leaf("a"),
            "compound state `(root)` has no initial state; fix: call `.initial(\"<child key>\")` on it",
        ),
        (
            chart().initial("b").leaf("a"),
            "state `(root)`: initial `b` is not one of its children (a); fix: name a direct child",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").after(Timer::days(1)).max(3))),
            "state `a`: transition on `E` has `max` but no `every` timer; fix: add `.every(Timer::…)` or drop `max`",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").every(Timer::days(1)).then("E"))),
            "state `a`: transition on `E` has `then` but no `max`; fix: add `.max(n)` so `then` knows when to fire",
        ),
        (
            chart().initial("a").state("a", |s| {
                s.on("E", |t| t.action("x").every(Timer::days(1)).max(2).then("MAX"))
            }),
            "state `a`: transition on `E` has `then` event `MAX`, which no state has a transition for; fix: add `.on(\"MAX\", …)` where it should be handled or correct the name",
        ),
        (
            chart().initial("a").state("a", |s| {
                s.on("E", |t| t.action("x").every(Timer::days(1)).after(Timer::days(2)))
            }),
            "state `a`: transition on `E` has both `after` and `every`; fix: keep one timer per event",
        ),
        (
            chart().initial("a").state("a", |s| {
                s.on("REMIND", |t| t.guard("yes").action("x").after(Timer::hours(1)))
                    .on("REMIND", |t| t.action("y").after(Timer::days(1)))
            }),
            "state `a`: two transitions on `REMIND` have timers, but a state has one timer per event: a fire is only the event, taken by whichever transition on it is enabled, and a deploy's new durations and `keep_armed` find timers by their event; fix: put both branches under one `on` with one timer, or use distinct events",
        ),
        (
            chart().initial("a").state("a", |s| {
                s.on("REMIND", |t| t.action("x").after(Timer::hours(1)))
                    .on("REMIND", |t| t.action("y").every(Timer::days(1)))
            }),
            "state `a`: two transitions on `REMIND` have timers, but a state has one timer per event: a fire is only the event, taken by whichever transition on it is enabled, and a deploy's new durations and `keep_armed` find timers by their event; fix: put both branches under one `on` with one timer, or use distinct events",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").after(Timer::seconds(0)))),
            "state `a`: timer on `E` is `0 seconds`, which is not positive (InvalidTimerDefinition); fix: use a duration of at least 1 unit",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").every(Timer::weeks(-2)))),
            "state `a`: timer on `E` is `-2 weeks`, which is not positive (InvalidTimerDefinition); fix: use a duration of at least 1 unit",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.machine("child").on_timeout(Timer::minutes(0), |b| b)),
            "state `a`: timer on `@timeout` is `0 minutes`, which is not positive (InvalidTimerDefinition); fix: use a duration of at least 1 unit",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").after(Timer::days(i64::MAX)))),
            "state `a`: timer on `E` is `9223372036854775807 days`, which is longer than the limit of 3660 days (InvalidTimerDefinition); fix: use a shorter timer, or park on a signal",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").every(Timer::seconds(i64::MAX)))),
            "state `a`: timer on `E` is `9223372036854775807 seconds`, which is longer than the limit of 3660 days (InvalidTimerDefinition); fix: use a shorter timer, or park on a signal",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").after(Timer::days(3_661)))),
            "state `a`: timer on `E` is `3661 days`, which is longer than the limit of 3660 days (InvalidTimerDefinition); fix: use a shorter timer, or park on a signal",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.machine("child").on_timeout(Timer::weeks(i64::MAX), |b| b)),
            "state `a`: timer on `@timeout` is `9223372036854775807 weeks`, which is longer than the limit of 3660 days (InvalidTimerDefinition); fix: use a shorter timer, or park on a signal",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on("E", |t| t.action("x").every(Timer::days(1)).max(0))),
            "state `a`: transition on `E` has `max(0)`, so its timer would never fire; fix: use `.max(n)` with n >= 1, or drop `max`",
        ),
        (
            chart().initial("a").state("a", |s| s.initial("x").leaf("x").leaf("x")),
            "duplicate state id `a.x`; fix: give sibling states distinct keys",
        ),
        (
            chart().initial("a.b").leaf("a.b"),
            "state key `a.b` under `(root)` is invalid; fix: use a non-empty key without `.` or NUL characters",
        ),
        (
            chart().initial("a\0b").leaf("a\0b"),
            "state key `a\0b` under `(root)` is invalid; fix: use a non-empty key without `.` or NUL characters",
        ),
        (
            chart().initial("a").leaf("a").final_with("f", |s| s.on_to("E", "a")),
            "final state `f` has outgoing transitions; fix: remove them or make it a normal state",
        ),
        (
            chart().initial("a").leaf("a").final_with("f", |s| s.leaf("x")),
            "final state `f` has child states; fix: make it a compound state with a final child",
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| s.on_to("GO", "f"))
                .final_with("f", |s| s.machine("notify")),
            "final state `f` delegates to a child machine; fix: delegate from a normal state and go to the final state on its `@done`",
        ),
        (
            chart().initial("p").parallel("p", |s| s.state("r1", |r| r.initial("a").leaf("a"))),
            "parallel state `p` has 1 region(s); fix: give it at least two regions or make it a compound state",
        ),
        (
            chart().initial("a").state("a", |s| s.always(|b| b.guard("missing").target("a"))),
            "state `a`: transition on `@always` uses unknown guard `missing`; fix: register it with `ChartBuilder::guard(\"missing\", …)`",
        ),
        (
            chart().initial("a").state("a", |s| s.on_timeout(Timer::minutes(1), |b| b)),
            "state `a` has `@timeout` but no child machine; fix: add `.machine(\"<name>\")` or use an `after` timer",
        ),
    ];
    for (builder, message) in cases {
        let errors = builder.build().expect_err(message).errors;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].to_string(), message);
    }
}

/// `@done` that nothing can ever send is refused: an atomic state without a child
/// machine, a compound state without a final child, a parallel state with a region that
/// can never finish. With a child machine, or a final child in every region, it builds.
#[test]
fn done_that_can_never_fire_is_refused() {
    let fix = "fix: give it a final child and a transition into it (every region of a parallel state needs one), or delegate it to a child machine with `.machine(\"<name>\")` (JSON: `\"machine\"`)";
    let region = |r: StateBuilder, fin: bool| {
        let r = r.initial("a").state("a", |s| s.on_to("A", "b")).leaf("b");
        if fin { r.final_state("end") } else { r }
    };
    let cases: Vec<(ChartBuilder, String)> = vec![
        (
            chart().initial("a").state("a", |s| s.on_done(|b| b.target("z"))).leaf("z"),
            format!(
                "state `a` has `@done`, which can never fire: it is an atomic state without a child machine, so nothing ever completes it; {fix}"
            ),
        ),
        (
            chart()
                .initial("p")
                .state("p", |s| {
                    s.initial("w")
                        .state("w", |s| s.on_to("GO", "x"))
                        .leaf("x")
                        .on_done(|b| b.target("z"))
                })
                .leaf("z"),
            format!("state `p` has `@done`, which can never fire: it has no final child; {fix}"),
        ),
        (
            chart()
                .initial("p")
                .parallel("p", |p| {
                    p.state("r1", |r| region(r, true))
                        .state("r2", |r| region(r, false))
                        .on_done(|b| b.target("z"))
                })
                .leaf("z"),
            format!(
                "state `p` has `@done`, which can never fire: its region `p.r2` can never reach a final state, so its regions are never all done; {fix}"
            ),
        ),
    ];
    for (builder, message) in cases {
        let errors = builder.build().expect_err(&message).errors;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].to_string(), message);
    }
    // The same from JSON.
    let json = r#"{"name": "t", "version": 1, "initial": "a",
        "states": [{"key": "a", "@done": [{"target": "z"}]}, {"key": "z"}]}"#;
    let refused = ChartBuilder::from_json(json).expect("parses").build().unwrap_err();
    assert!(
        matches!(&refused.errors[..], [ChartError::DoneNeverFires { state, .. }] if state == "a"),
        "{refused}"
    );
    // Two timed transitions on one event in one state, from JSON.
    let json = r#"{"name": "t", "version": 1, "initial": "a",
        "states": [{"key": "a", "on": [
            {"event": "REMIND", "actions": ["x"], "after": {"amount": 1, "unit": "hours"}},
            {"event": "REMIND", "actions": ["y"], "after": {"amount": 1, "unit": "days"}}]}]}"#;
    let refused = ChartBuilder::from_json(json).expect("parses").build().unwrap_err();
    assert!(
        matches!(&refused.errors[..], [ChartError::DuplicateTimedEvent { state, event }]
            if state == "a" && event == "REMIND"),
        "{refused}"
    );
    // One timed and one untimed transition on the same event stay allowed.
    chart()
        .initial("a")
        .state("a", |s| {
            s.on("REMIND", |t| t.action("x").after(Timer::hours(1))).on("REMIND", |t| t.action("y"))
        })
        .build()
        .expect("one timer per event");
    // A child machine's end, a final child, a nested parallel region with final children.
    chart()
        .initial("a")
        .state("a", |s| s.machine("job").on_done(|b| b.target("z")))
        .leaf("z")
        .build()
        .expect("a delegation state is done when its child is");
    chart()
        .initial("p")
        .parallel("p", |p| {
            p.state("r1", |r| region(r, true))
                .parallel("r2", |q| {
                    q.state("x", |r| region(r, true)).state("y", |r| region(r, true))
                })
                .on_done(|b| b.target("z"))
        })
        .leaf("z")
        .build()
        .expect("every region can finish");
}

/// An `on` event named like one of Keel's own triggers is refused, naming the builder call
/// and the JSON key that mean it; the likely slip is `"@done"` inside a JSON `on` list.
/// Any other name starting with `@` is a signal name a caller can send, and still builds.
#[test]
fn on_events_named_like_keel_triggers_are_refused() {
    let message = |event: &str, fix: &str| {
        format!(
            "state `a`: transition on `{event}` can never fire: `{event}` is one of Keel's own triggers (`@done`, `@always`, `@fail`, `@timeout`), which no `on` entry receives; fix: {fix}"
        )
    };
    for (event, fix) in [
        ("@done", "use `.on_done(…)` in Rust, or the state's `\"@done\"` key in JSON"),
        ("@always", "use `.always(…)` in Rust, or the state's `\"@always\"` key in JSON"),
        ("@fail", "use `.on_fail(…)` in Rust, or the state's `\"@fail\"` key in JSON"),
        ("@timeout", "use `.on_timeout(…)` in Rust, or the state's `\"@timeout\"` key in JSON"),
    ] {
        let errors = chart()
            .initial("a")
            .state("a", |s| s.on_to(event, "b"))
            .leaf("b")
            .build()
            .expect_err(event)
            .errors;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].to_string(), message(event, fix));
    }
    let json = r#"{"name": "t", "version": 1, "initial": "a", "states": [
        {"key": "a", "on": [{"event": "@done", "target": "b"}]}, {"key": "b"}]}"#;
    let refused = ChartBuilder::from_json(json).expect("parses").build().unwrap_err();
    assert_eq!(refused.errors.len(), 1, "{refused}");
    assert!(refused.to_string().contains("the state's `\"@done\"` key in JSON"), "{refused}");

    // A signal named `@GO` is delivered to `on("@GO")` like any other name.
    let def = chart()
        .initial("a")
        .state("a", |s| s.on_to("@GO", "b"))
        .leaf("b")
        .build()
        .expect("`@GO` is an ordinary signal name");
    let results = run(&def, &json!({}), &events(&["@GO"]), Limits::default());
    let done = results.last().expect("ran");
    assert_eq!(done.configuration.leaves(&def), ["b"]);
}

#[test]
fn a_final_state_with_a_timeout_is_refused_too() {
    let errors = chart()
        .initial("a")
        .state("a", |s| s.on_to("GO", "f"))
        .final_with("f", |s| s.machine("notify").on_timeout(Timer::minutes(1), |b| b))
        .build()
        .expect_err("a final state cannot delegate")
        .errors;
    assert!(errors.contains(&ChartError::FinalWithMachine { state: "f".into() }), "{errors:?}");
}

#[test]
fn unreachable_states_are_warnings() {
    let def = chart()
        .initial("a")
        .state("a", |s| s.on_to("GO", "b"))
        .leaf("b")
        .state("island", |s| s.on_to("X", "island2"))
        .leaf("island2")
        .build()
        .unwrap();
    let warnings: Vec<String> = def.warnings().iter().map(ToString::to_string).collect();
    assert_eq!(
        warnings,
        [
            "state `island` is unreachable: no initial state or transition leads to it; fix: add a transition targeting it or remove it",
            "state `island2` is unreachable: no initial state or transition leads to it; fix: add a transition targeting it or remove it",
        ]
    );
}

#[test]
fn timers_at_the_limits_are_valid() {
    let def = chart()
        .initial("a")
        .state("a", |s| {
            s.on("E", |t| t.action("x").after(Timer::days(3_660)))
                .on("F", |t| t.action("y").every(Timer::seconds(1)).max(1))
        })
        .build()
        .unwrap();
    assert!(def.warnings().is_empty());
}

/// A transition after an unguarded one on the same trigger in the same state can never be
/// taken, whether it has a guard or not; guarded ones before an unguarded fallback are fine.
#[test]
fn transitions_after_an_unguarded_one_are_shadowed_warnings() {
    let def = chart()
        .initial("a")
        .state("a", |s| {
            s.on_to("GO", "b")
                .on_to("GO", "c")
                .on_to("PICK", "b")
                .on("PICK", |t| t.guard("ok").target("c"))
                .on("PICK", |t| t.target("b"))
                .on("CHECK", |t| t.guard("ok").target("b").branch(|b| b.target("c")))
                .always(|b| b.guard("ok").target("b"))
                .always(|b| b.target("c"))
                .always(|b| b.target("b"))
        })
        .leaf("b")
        .leaf("c")
        .guard("ok", |_, _| true)
        .build()
        .unwrap();
    let warnings: Vec<String> = def.warnings().iter().map(ToString::to_string).collect();
    let shadowed = |count: usize, trigger: &str| {
        format!(
            "state `a`: {count} transition(s) on `{trigger}` come after one without a guard, which is always taken first, so they can never be taken; fix: move the unguarded transition last (as the fallback), give it a guard, or remove the transitions after it"
        )
    };
    assert_eq!(warnings, [shadowed(1, "GO"), shadowed(2, "PICK"), shadowed(1, "@always")]);
    assert_eq!(
        def.warnings()[1],
        ChartWarning::ShadowedTransition { state: "a".into(), trigger: "PICK".into(), count: 2 }
    );
}

/// A transition from one region of a parallel state to a state in a sibling region exits
/// and re-enters the whole parallel state (SCXML's rule): it builds, with a warning that
/// says so. A transition within one region, or out of the parallel state, is no warning.
#[test]
fn a_transition_into_a_sibling_region_is_a_warning() {
    let def = chart()
        .initial("p")
        .parallel("p", |s| {
            s.state("r1", |r| {
                r.initial("a")
                    .state("a", |s| s.on_to("A", "b"))
                    .state("b", |s| s.on_to("X", "r2.d").on_to("OUT", "z"))
            })
            .state("r2", |r| r.initial("c").state("c", |s| s.on_to("C", "d")).leaf("d"))
        })
        .leaf("z")
        .build()
        .unwrap();
    let warnings: Vec<String> = def.warnings().iter().map(ToString::to_string).collect();
    assert_eq!(
        def.warnings(),
        [ChartWarning::CrossRegionTarget {
            state: "p.r1.b".into(),
            trigger: "X".into(),
            target: "p.r2.d".into(),
            parallel: "p".into(),
        }],
        "{warnings:#?}"
    );
    assert_eq!(
        warnings[0],
        "state `p.r1.b`: transition on `X` targets `p.r2.d` in another region of parallel state `p`, so it exits and re-enters all of `p`: every region restarts at its initial state, and the entry actions and timers of `p` run again; fix: to move only the region of `p.r2.d`, raise an event one of its states handles, or target `p` itself if a restart is meant"
    );
    // What the warning says: r1 loses its progress.
    let results = run(&def, &json!({}), &events(&["A", "X"]), Limits::default());
    let last = results.last().expect("results");
    assert_eq!(last.configuration.leaves(&def), ["p.r1.a", "p.r2.d"]);
}

#[test]
fn validation_collects_every_error() {
    let errors =
        chart().initial("a").state("a", |s| s.on_to("E", "x").on_to("F", "y")).build().unwrap_err();
    assert_eq!(errors.errors.len(), 2);
    assert!(errors.to_string().starts_with("invalid chart definition (2 error(s)):"));
}

/// The ten documented transition + timer combinations all build, and their timers are
/// recorded when the state is entered.
#[test]
fn seed_002_timer_combinations() {
    let def = chart()
        .initial("s")
        .state("s", |s| {
            s.on_to("PAY", "done") // 1. simple target
                .on("ORDER_EXPIRED", |t| t.target("done").after(Timer::days(7))) // 2.
                .on("HEARTBEAT", |t| t.target("s").every(Timer::hours(1))) // 3.
                .on("EXPIRE_GUARDED", |t| t.target("done").guard("flag").after(Timer::days(7))) // 4.
                .on("BILLING", |t| t.action("bill").guard("flag").every(Timer::days(30))) // 5.
                .on("EXPIRE_MULTI", |t| {
                    t.branch(|b| b.target("done").guard("flag"))
                        .branch(|b| b.target("late"))
                        .after(Timer::days(7))
                }) // 6.
                .on("RETRY", |t| {
                    t.branch(|b| b.target("done").guard("flag"))
                        .branch(|b| b.action("retry"))
                        .every(Timer::hours(6))
                        .max(3)
                        .then("MAX_RETRIES")
                }) // 7.
                .on("SEND_REMINDER", |t| t.action("remind").after(Timer::days(1))) // 8.
                .on("CHECK_STATUS", |t| t.action("check").every(Timer::hours(6))) // 9.
                .on_to("MAX_RETRIES", "late")
        })
        .state("child", |s| {
            // 10. timers on a delegation state with @done/@fail/@timeout
            s.machine("payment")
                .on_done(|b| b.target("done"))
                .on_fail(|b| b.target("late"))
                .on_timeout(Timer::seconds(300), |b| b.target("late"))
                .on("REMIND_CHILD", |t| t.action("nudge").every(Timer::hours(6)))
                .on("FORCE_CANCEL", |t| t.target("late").after(Timer::days(7)))
        })
        .leaf("late")
        .final_state("done")
        .build()
        .unwrap();
    let init = run(&def, &json!({}), &[], Limits::default()).remove(0);
    let events: Vec<&str> = init.timers_to_arm.iter().map(|t| t.event.as_str()).collect();
    assert_eq!(
        events,
        [
            "ORDER_EXPIRED",
            "HEARTBEAT",
            "EXPIRE_GUARDED",
            "BILLING",
            "EXPIRE_MULTI",
            "RETRY",
            "SEND_REMINDER",
            "CHECK_STATUS"
        ]
    );
    // Multi-branch timer event: first matching branch wins (flag unset ⇒ late).
    let r = run_to_completion(
        Macrostep::start(
            &def,
            &init.configuration,
            json!({}),
            Event::new("EXPIRE_MULTI"),
            Limits::default(),
        ),
        exec,
    );
    assert_eq!(r.configuration.leaves(&def), ["late"]);
    let child = Configuration::from_paths(["child"]);
    let done = run_to_completion(
        Macrostep::start(
            &def,
            &child,
            json!({}),
            Event::done_invoke("child", json!(null)),
            Limits::default(),
        ),
        exec,
    );
    assert_eq!(done.configuration.leaves(&def), ["done"]);
    let failed = run_to_completion(
        Macrostep::start(
            &def,
            &child,
            json!({}),
            Event::fail_state("child", json!({"error": "x"})),
            Limits::default(),
        ),
        exec,
    );
    assert_eq!(failed.configuration.leaves(&def), ["late"]);
}

#[test]
fn history_records_read_as_text() {
    let def = chart()
        .initial("a")
        .state("a", |s| s.on("GO", |t| t.target("b").action("x")))
        .state("b", |s| s.always(|b| b.action("y").target("c")))
        .leaf("c")
        .build()
        .unwrap();
    let results = run(&def, &json!({}), &events(&["GO"]), Limits::default());
    let text: Vec<String> = results[1].records.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "event GO",
            "transition a -> b on GO",
            "exit a",
            "action x",
            "enter b",
            "transition b -> c on @always",
            "exit b",
            "action y",
            "enter c",
        ]
    );
}

#[test]
fn depth_limit_is_exact_at_the_bound() {
    // Three eventless microsteps after the event: a limit of 3 is enough, 2 is not.
    let chain = || {
        chart()
            .initial("a")
            .state("a", |s| s.on_to("GO", "b"))
            .state("b", |s| s.always(|b| b.target("c")))
            .state("c", |s| s.always(|b| b.target("d")))
            .state("d", |s| s.always(|b| b.target("e")))
            .leaf("e")
            .build()
            .unwrap()
    };
    let ok = run(&chain(), &json!({}), &events(&["GO"]), Limits { max_transition_depth: 3 });
    assert_eq!(ok[1].error, None);
    assert_eq!(ok[1].configuration.leaves(&chain()), ["e"]);
    let err = run(&chain(), &json!({}), &events(&["GO"]), Limits { max_transition_depth: 2 });
    assert!(matches!(
        err[1].error,
        Some(MacrostepError::MaxTransitionDepthExceeded { limit: 2, .. })
    ));
}

#[test]
fn macrostep_can_move_to_an_async_worker() {
    fn assert_send<T: Send>() {}
    assert_send::<Macrostep<'static>>();
    assert_send::<Definition>();
    assert_send::<MacrostepResult>();
}

#[test]
fn definition_introspection() {
    let def = timer_chart().build().unwrap();
    assert_eq!(def.name(), "test");
    assert_eq!(def.version(), 1);
    assert_eq!(
        def.event_alphabet(),
        ["CHECKOUT", "GIVE_UP", "ORDER_EXPIRED", "PAY", "REMIND", "TOUCH", "done.invoke.paid"]
    );
    assert_eq!(def.action_names(), ["remind"]);
    assert_eq!(def.state("awaiting").map(|s| s.kind), Some(StateKind::Atomic));
    assert_eq!(def.states().count(), 5);
    assert!(def.warnings().is_empty());
}

#[test]
fn mermaid_for_always_delegation_and_final() {
    let def = chart()
        .initial("a")
        .state("a", |s| {
            s.always(|b| b.guard("flag").target("child"))
                .on("TICK", |t| t.action("tick").every(Timer::minutes(5)))
        })
        .state("child", |s| {
            s.machine("payment")
                .on_done(|b| b.target("done"))
                .on_timeout(Timer::seconds(30), |b| b.target("done"))
        })
        .final_state("done")
        .build()
        .unwrap();
    let expected = "---
title: test v1
---
stateDiagram-v2
    state \"a\" as a
    state \"child\" as child
    state \"done\" as done
    [*] --> a
    a --> a : TICK (every 5 minutes) / tick
    a --> child : @always [flag]
    child --> done : @done
    child --> done : @timeout (after 30 seconds)
    done --> [*]
";
    assert_eq!(def.to_mermaid(), expected);
}

mod history;
mod properties;

#[test]
fn raise_actions_are_run_by_the_core_in_action_order() {
    // `@raise:X` needs no binding: it queues `X` between the actions around it, and
    // `X` is processed after the microstep, before the next external event.
    check(
        chart()
            .initial("a")
            .state("a", |s| {
                s.on("GO", |t| t.target("b").action("first").action("@raise:NEXT").action("last"))
            })
            .state("b", |s| s.on("NEXT", |t| t.target("c").action("next")))
            .leaf("c"),
        &["GO"],
        "
        @init: enter a
        GO: exit a,b enter b,c actions first,last,next
        config: c
        ",
    );
    let def = chart().initial("a").state("a", |s| s.entry("@raise:X").entry("log")).build();
    assert_eq!(def.expect("valid").action_names(), ["log"]);
}

#[test]
fn a_version_beyond_what_stores_hold_is_refused() {
    let refused = Definition::builder("big", 3_000_000_000)
        .initial("a")
        .final_state("a")
        .build()
        .unwrap_err();
    assert!(
        refused.to_string().contains("version 3000000000 is more than 2147483647"),
        "{refused}"
    );
    let largest = u32::try_from(i32::MAX).unwrap();
    Definition::builder("edge", largest).initial("a").final_state("a").build().expect("i32::MAX");
}

/// A parallel state `p` (regions `r1`, `r2`, each with `x`/`y`) next to a leaf `a`, with a
/// transition on `GO` from `a` to `targets`.
fn two_regions(targets: &str) -> ChartBuilder {
    chart().initial("a").state("a", |s| s.on_to("GO", targets)).parallel("p", |p| {
        p.state("r1", |r| r.initial("x").leaf("x").leaf("y"))
            .state("r2", |r| r.initial("x").leaf("x").leaf("y"))
    })
}

const REGIONS_FIX: &str = "fix: targets of one transition must lie in different regions of one parallel state, so name one state per region or keep a single target";

#[test]
fn multi_targets_that_cannot_all_be_active_are_refused() {
    let cases: Vec<(ChartBuilder, String)> = vec![
        // Siblings of a compound state (the audit's trigger).
        (
            chart().initial("x").state("x", |s| s.on_to("GO", "a b")).leaf("a").leaf("b"),
            format!(
                "state `x`: transition on `GO` targets `a b`, which cannot all be active at once: `a` and `b` meet at `(root)`, a compound state, which has one active child at a time; {REGIONS_FIX}"
            ),
        ),
        // An ancestor and its descendant.
        (
            two_regions("p p.r1.y"),
            format!(
                "state `a`: transition on `GO` targets `p p.r1.y`, which cannot all be active at once: `p` contains `p.r1.y`; {REGIONS_FIX}"
            ),
        ),
        (
            two_regions("p.r2.y  p.r2"),
            format!(
                "state `a`: transition on `GO` targets `p.r2.y p.r2`, which cannot all be active at once: `p.r2` contains `p.r2.y`; {REGIONS_FIX}"
            ),
        ),
        // Two states of one region.
        (
            two_regions("p.r1.x p.r1.y"),
            format!(
                "state `a`: transition on `GO` targets `p.r1.x p.r1.y`, which cannot all be active at once: `p.r1.x` and `p.r1.y` meet at `p.r1`, a compound state, which has one active child at a time; {REGIONS_FIX}"
            ),
        ),
        // Fine pairwise except one: the first bad pair is named.
        (
            two_regions("p.r1.x p.r2.x a"),
            format!(
                "state `a`: transition on `GO` targets `p.r1.x p.r2.x a`, which cannot all be active at once: `p.r1.x` and `a` meet at `(root)`, a compound state, which has one active child at a time; {REGIONS_FIX}"
            ),
        ),
        (
            two_regions("p.r1.x p.r1.x"),
            format!(
                "state `a`: transition on `GO` targets `p.r1.x p.r1.x`, which cannot all be active at once: `p.r1.x` is named twice; {REGIONS_FIX}"
            ),
        ),
        // Eventless and `@done` triggers are named like events.
        (
            chart().initial("a").state("a", |s| s.always(|b| b.target("b c"))).leaf("b").leaf("c"),
            format!(
                "state `a`: transition on `@always` targets `b c`, which cannot all be active at once: `b` and `c` meet at `(root)`, a compound state, which has one active child at a time; {REGIONS_FIX}"
            ),
        ),
        (
            chart()
                .initial("a")
                .state("a", |s| {
                    s.initial("w")
                        .state("w", |s| s.on_to("FIN", "fin"))
                        .final_state("fin")
                        .on_done(|b| b.target("b c.d"))
                })
                .leaf("b")
                .state("c", |s| s.initial("d").leaf("d")),
            format!(
                "state `a`: transition on `@done` targets `b c.d`, which cannot all be active at once: `b` and `c.d` meet at `(root)`, a compound state, which has one active child at a time; {REGIONS_FIX}"
            ),
        ),
        // A history restores states anywhere inside its parent.
        (
            chart()
                .initial("a")
                .state("a", |s| s.on_to("GO", "p.h p.x"))
                .state("p", |s| s.initial("x").history("h", HistoryDepth::Shallow, "x").leaf("x")),
            format!(
                "state `a`: transition on `GO` targets `p.h p.x`, which cannot all be active at once: history `p.h` restores states inside `p`, which contains `p.x`; {REGIONS_FIX}"
            ),
        ),
    ];
    for (builder, message) in cases {
        let errors = builder.build().expect_err(&message).errors;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].to_string(), message);
    }
    // JSON definitions go through the same validation.
    let json = r#"{"name": "t", "version": 1, "initial": "x", "states": [
        {"key": "x", "on": [{"event": "GO", "target": "a b"}]}, {"key": "a"}, {"key": "b"}]}"#;
    let refused = ChartBuilder::from_json(json).expect("parses").build().unwrap_err();
    assert!(
        refused.to_string().contains(
            "state `x`: transition on `GO` targets `a b`, which cannot all be active at once"
        ),
        "{refused}"
    );
}

#[test]
fn multi_target_transitions_into_different_regions_build_and_run() {
    check(
        two_regions("p.r1.y p.r2.y"),
        &["GO"],
        "
        @init: enter a
        GO: exit a enter p,p.r1,p.r1.y,p.r2,p.r2.y
        config: p.r1.y,p.r2.y
        ",
    );
    // A region itself, a history of a region, and regions of a nested parallel state.
    let def = chart()
        .initial("a")
        .state("a", |s| {
            s.on_to("REGION", "p.r1 p.r2.y")
                .on_to("HISTORY", "p.r1.h p.r2.y")
                .on_to("NESTED", "p.r1.q.q1.n p.r1.q.q2.n p.r2.y")
        })
        .parallel("p", |p| {
            p.state("r1", |r| {
                r.initial("x").history("h", HistoryDepth::Shallow, "x").leaf("x").parallel(
                    "q",
                    |q| {
                        q.state("q1", |r| r.initial("m").leaf("m").leaf("n"))
                            .state("q2", |r| r.initial("m").leaf("m").leaf("n"))
                    },
                )
            })
            .state("r2", |r| r.initial("x").leaf("x").leaf("y"))
        })
        .build()
        .expect("legal multi-targets build");
    assert!(def.warnings().is_empty(), "{:?}", def.warnings());
    for (event, leaves) in [
        ("REGION", vec!["p.r1.x", "p.r2.y"]),
        ("HISTORY", vec!["p.r1.x", "p.r2.y"]),
        ("NESTED", vec!["p.r1.q.q1.n", "p.r1.q.q2.n", "p.r2.y"]),
    ] {
        let results = run(&def, &json!({}), &events(&[event]), Limits::default());
        let last = results.last().expect("ran");
        assert_eq!(last.error, None, "{event}");
        assert_eq!(last.configuration.check(&def), Ok(()), "{event}");
        assert_eq!(last.configuration.leaves(&def), leaves, "{event}");
    }
}

#[test]
fn history_defaults_that_cannot_all_be_active_are_refused() {
    let refused = chart()
        .initial("w")
        .state("w", |s| {
            s.initial("p").history("h", HistoryDepth::Deep, "p.r1.x p.r1.y").parallel("p", |p| {
                p.state("r1", |r| r.initial("x").leaf("x").leaf("y"))
                    .state("r2", |r| r.initial("x").leaf("x"))
            })
        })
        .build()
        .unwrap_err();
    assert_eq!(refused.errors.len(), 1, "{refused}");
    assert_eq!(
        refused.errors[0].to_string(),
        "state `w`: history `h` has default targets `p.r1.x p.r1.y`, which cannot all be active at once: `w.p.r1.x` and `w.p.r1.y` meet at `w.p.r1`, a compound state, which has one active child at a time; fix: default targets must lie in different regions of one parallel state, so name one state per region or keep a single default"
    );
    // One default per region is fine.
    chart()
        .initial("w")
        .state("w", |s| {
            s.initial("p").history("h", HistoryDepth::Deep, "p.r1.y p.r2.x").parallel("p", |p| {
                p.state("r1", |r| r.initial("x").leaf("x").leaf("y"))
                    .state("r2", |r| r.initial("x").leaf("x"))
            })
        })
        .build()
        .expect("one default per region");
}

#[test]
fn a_final_state_directly_under_a_parallel_state_is_refused() {
    let message = "parallel state `p` has final state `p.a` as a region; fix: wrap it in a compound region with an initial state, so the region is done when it reaches its final child";
    // The audit's trigger: `@done` would fire on entry while region `b` is still at `w`.
    let refused = chart()
        .initial("p")
        .parallel("p", |p| {
            p.final_state("a")
                .state("b", |r| {
                    r.initial("w").state("w", |s| s.on_to("GO", "fin")).final_state("fin")
                })
                .on_done(|d| d.target("out"))
        })
        .leaf("out")
        .build()
        .unwrap_err();
    assert_eq!(refused.errors.len(), 1, "{refused}");
    assert_eq!(refused.errors[0].to_string(), message);
    let json = r#"{"name": "t", "version": 1, "initial": "p", "states": [
        {"key": "p", "type": "parallel", "states": [
            {"key": "a", "type": "final"},
            {"key": "b", "initial": "w", "states": [{"key": "w"}]}]}]}"#;
    let refused = ChartBuilder::from_json(json).expect("parses").build().unwrap_err();
    assert_eq!(refused.errors.len(), 1, "{refused}");
    assert_eq!(refused.errors[0].to_string(), message);
    // Wrapped in a compound region, the same chart builds.
    chart()
        .initial("p")
        .parallel("p", |p| {
            p.state("a", |r| r.initial("done").final_state("done"))
                .state("b", |r| r.initial("w").leaf("w"))
        })
        .build()
        .expect("a compound region with a final child");
}

/// A sender may not use the names of the engine's own events: they would fire `@done`,
/// `@fail` or `@timeout` early. A region's report, sent the same way, stays allowed.
#[test]
fn senders_may_not_use_the_engines_own_event_names() {
    use crate::ids::InstanceId;
    use crate::instance::{NewSignal, RESERVED_SIGNAL_NAME_PREFIXES};
    let engine = [
        Event::done_state("pay").name,
        Event::done_invoke("pay", Value::Null).name,
        Event::fail_state("pay", Value::Null).name,
        Event::timeout_invoke("pay").name,
        step::timeout_event("pay"),
    ];
    for name in &engine {
        assert!(
            RESERVED_SIGNAL_NAME_PREFIXES.iter().any(|p| name.starts_with(p)),
            "{name} is reserved"
        );
        let err = NewSignal::new(InstanceId(1), name.as_str()).validate("signal").unwrap_err();
        let message = err.to_string();
        assert!(message.contains("signal.name"), "{message}");
        assert!(message.contains("reserved for the engine's own events"), "{message}");
    }
    for name in [step::REGION_REPORT_EVENT, "done", "done.stateless", "PAY", "failed.state.x"] {
        NewSignal::new(InstanceId(1), name).validate("signal").expect(name);
    }
}
