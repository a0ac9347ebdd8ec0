//! History pseudo-states and multi-target transitions, in the table style of the parent
//! module: each case builds a chart, runs events and compares the dump.

use serde_json::json;

use super::*;

/// `p` remembers its past; `out` leaves it and `BACK` returns through `p.h`.
fn remembering(depth: HistoryDepth, default: &str) -> ChartBuilder {
    chart()
        .initial("p")
        .state("p", |s| {
            s.initial("a")
                .history("h", depth, default)
                .on_to("LEAVE", "out")
                .state("a", |s| s.on_to("NEXT", "b"))
                .state("b", |s| {
                    s.initial("b1")
                        .state("b1", |s| s.entry("in_b1").on_to("DEEP", "b2"))
                        .state("b2", |s| s.entry("in_b2"))
                })
        })
        .state("out", |s| s.on_to("BACK", "p.h"))
}

#[test]
fn shallow_history_restores_the_child_and_enters_its_initial_state() {
    check(
        remembering(HistoryDepth::Shallow, "a"),
        &["NEXT", "DEEP", "LEAVE", "BACK"],
        r#"
        @init: enter p,p.a
        NEXT: exit p.a enter p.b,p.b.b1 actions in_b1
        DEEP: exit p.b.b1 enter p.b.b2 actions in_b2
        LEAVE: exit p.b.b2,p.b,p enter out
        BACK: exit out enter p,p.b,p.b.b1 actions in_b1
        config: p.b.b1
        context: {"@history":{"p.h":["p.b"]}}
        "#,
    );
}

#[test]
fn deep_history_restores_every_descendant() {
    check(
        remembering(HistoryDepth::Deep, "a"),
        &["NEXT", "DEEP", "LEAVE", "BACK"],
        r#"
        @init: enter p,p.a
        NEXT: exit p.a enter p.b,p.b.b1 actions in_b1
        DEEP: exit p.b.b1 enter p.b.b2 actions in_b2
        LEAVE: exit p.b.b2,p.b,p enter out
        BACK: exit out enter p,p.b,p.b.b2 actions in_b2
        config: p.b.b2
        context: {"@history":{"p.h":["p.b.b2"]}}
        "#,
    );
}

#[test]
fn history_without_a_record_takes_its_default() {
    // The chart starts outside `p`, so nothing is recorded when `BACK` arrives; the default
    // (not the parent's initial child) is entered, and deep defaults may be nested.
    check(
        remembering(HistoryDepth::Shallow, "b").initial("out"),
        &["BACK"],
        "
        @init: enter out
        BACK: exit out enter p,p.b,p.b.b1 actions in_b1
        config: p.b.b1
        ",
    );
    check(
        remembering(HistoryDepth::Deep, "b.b2").initial("out"),
        &["BACK"],
        "
        @init: enter out
        BACK: exit out enter p,p.b,p.b.b2 actions in_b2
        config: p.b.b2
        ",
    );
}

#[test]
fn the_latest_exit_overwrites_the_record() {
    check(
        remembering(HistoryDepth::Deep, "a"),
        &["NEXT", "LEAVE", "BACK", "DEEP", "LEAVE", "BACK"],
        r#"
        @init: enter p,p.a
        NEXT: exit p.a enter p.b,p.b.b1 actions in_b1
        LEAVE: exit p.b.b1,p.b,p enter out
        BACK: exit out enter p,p.b,p.b.b1 actions in_b1
        DEEP: exit p.b.b1 enter p.b.b2 actions in_b2
        LEAVE: exit p.b.b2,p.b,p enter out
        BACK: exit out enter p,p.b,p.b.b2 actions in_b2
        config: p.b.b2
        context: {"@history":{"p.h":["p.b.b2"]}}
        "#,
    );
}

/// A parallel state `w.p` with two regions, remembered by deep history `w.h`.
fn regions() -> ChartBuilder {
    chart()
        .initial("w")
        .state("w", |s| {
            s.initial("p").history("h", HistoryDepth::Deep, "p").on_to("LEAVE", "out").parallel(
                "p",
                |p| {
                    p.state("r1", |r| r.initial("x").state("x", |s| s.on_to("X", "y")).leaf("y"))
                        .state("r2", |r| r.initial("u").state("u", |s| s.on_to("U", "v")).leaf("v"))
                },
            )
        })
        .state("out", |s| {
            s.on_to("BACK", "w.h").on_to("BOTH", "w.p.r1.y w.p.r2.v").on_to("ONE", "w.p.r2.v")
        })
}

#[test]
fn deep_history_restores_every_region_of_a_parallel_state() {
    check(
        regions(),
        &["X", "U", "LEAVE", "BACK"],
        r#"
        @init: enter w,w.p,w.p.r1,w.p.r1.x,w.p.r2,w.p.r2.u
        X: exit w.p.r1.x enter w.p.r1.y
        U: exit w.p.r2.u enter w.p.r2.v
        LEAVE: exit w.p.r2.v,w.p.r2,w.p.r1.y,w.p.r1,w.p,w enter out
        BACK: exit out enter w,w.p,w.p.r1,w.p.r1.y,w.p.r2,w.p.r2.v
        config: w.p.r1.y,w.p.r2.v
        context: {"@history":{"w.h":["w.p.r1.y","w.p.r2.v"]}}
        "#,
    );
}

#[test]
fn multi_target_transitions_enter_each_named_region() {
    // Both regions named: each gets its target. One region named: the other region enters
    // its initial state.
    check(
        regions().initial("out"),
        &["BOTH"],
        "
        @init: enter out
        BOTH: exit out enter w,w.p,w.p.r1,w.p.r1.y,w.p.r2,w.p.r2.v
        config: w.p.r1.y,w.p.r2.v
        ",
    );
    check(
        regions().initial("out"),
        &["ONE"],
        "
        @init: enter out
        ONE: exit out enter w,w.p,w.p.r1,w.p.r1.x,w.p.r2,w.p.r2.v
        config: w.p.r1.x,w.p.r2.v
        ",
    );
}

#[test]
fn the_record_is_kept_by_the_committed_context_not_the_position() {
    let def = remembering(HistoryDepth::Deep, "a").build().expect("valid");
    let results = run(&def, &json!({}), &events(&["NEXT", "DEEP", "LEAVE"]), Limits::default());
    let left = results.last().expect("ran");
    assert_eq!(left.configuration.position(), r#"["out"]"#);
    assert_eq!(left.changed_keys, [HISTORY_CONTEXT_KEY]);
    // A fresh macrostep (another worker after a claim) sees only what was committed.
    let step = Macrostep::start(
        &def,
        &Configuration::from_paths(["out"]),
        left.context.clone(),
        Event::new("BACK"),
        Limits::default(),
    );
    let back = run_to_completion(step, exec);
    assert_eq!(back.configuration.leaves(&def), ["p.b.b2"]);
    // A chart without history never writes the key.
    assert!(results[0].context.get(HISTORY_CONTEXT_KEY).is_none());
}

#[test]
fn a_record_this_definition_cannot_read_is_refused() {
    let def = remembering(HistoryDepth::Deep, "a").build().expect("valid");
    for (context, reason) in [
        (json!({"@history": {"p.gone": ["p.a"]}}), "unknown history `p.gone`"),
        (json!({"@history": {"p.h": ["p.renamed"]}}), "records unknown state"),
        (json!({"@history": []}), "is not an object"),
    ] {
        let step = Macrostep::start(
            &def,
            &Configuration::from_paths(["out"]),
            context,
            Event::new("BACK"),
            Limits::default(),
        );
        let result = run_to_completion(step, exec);
        let error = result.error.expect("refused").to_string();
        assert!(error.contains(reason), "{error}");
        assert!(error.contains("publish the change as a new version"), "{error}");
    }
}

#[test]
fn invalid_histories_name_the_state_and_the_fix() {
    let cases: Vec<(ChartBuilder, &str)> = vec![
        (
            chart().initial("a").state("a", |s| s.history("h", HistoryDepth::Shallow, "a")),
            "state `a`: history `h` belongs to a state without children; fix: put the history inside a compound or parallel state",
        ),
        (
            chart()
                .initial("p")
                .leaf("z")
                .state("p", |s| s.initial("a").leaf("a").history("h", HistoryDepth::Shallow, "z")),
            "state `p`: history `h` has default target `z`, which is not a state inside its parent",
        ),
        (
            chart().initial("p").state("p", |s| {
                s.initial("a").state("a", |s| s.initial("a1").leaf("a1")).history(
                    "h",
                    HistoryDepth::Shallow,
                    "a.a1",
                )
            }),
            "has default target `a.a1`, which is not a state inside its parent; fix: name a child of the parent (any descendant for deep history)",
        ),
        (
            chart()
                .initial("p")
                .state("p", |s| s.initial("a").leaf("a").history("a", HistoryDepth::Deep, "a")),
            "duplicate state id `p.a`",
        ),
        (
            chart()
                .initial("p")
                .state("p", |s| s.initial("a").leaf("a").history("h", HistoryDepth::Deep, " ")),
            "history `h` has no default target",
        ),
        (
            chart().initial("a").state("a", |s| s.on_to("GO", "a b.nope")).leaf("b"),
            "targets unknown state `b.nope`",
        ),
    ];
    for (builder, want) in cases {
        let error = builder.build().expect_err("invalid").to_string();
        assert!(error.contains(want), "want `{want}` in\n{error}");
    }
}

#[test]
fn history_loads_from_json() {
    let text = r#"{"name": "h", "version": 1, "initial": "p", "states": [
        {"key": "p", "initial": "a", "history": [{"key": "h", "depth": "deep", "default": "a"}],
         "on": [{"event": "LEAVE", "target": "out"}],
         "states": [{"key": "a", "on": [{"event": "NEXT", "target": "b"}]}, {"key": "b"}]},
        {"key": "out", "on": [{"event": "BACK", "target": "p.h"}]}]}"#;
    let def = ChartBuilder::from_json(text).expect("loads").build().expect("valid");
    let results = run(&def, &json!({}), &events(&["NEXT", "LEAVE", "BACK"]), Limits::default());
    assert_eq!(results.last().expect("ran").configuration.leaves(&def), ["p.b"]);
    assert_eq!(
        def.state("p").expect("p").history,
        [HistoryDef { key: "h".into(), depth: HistoryDepth::Deep, default: "a".into() }]
    );
}

#[test]
fn diagrams_draw_one_arrow_per_target_and_history_as_its_parent() {
    let def = regions().build().expect("valid");
    let mermaid = def.to_mermaid();
    let both: Vec<&str> = mermaid.lines().filter(|l| l.ends_with(": BOTH")).collect();
    assert_eq!(both.len(), 2, "{mermaid}");
    assert!(both[0].contains("r1") && both[1].contains("r2"), "{mermaid}");
    let back: Vec<&str> = mermaid.lines().filter(|l| l.ends_with(": BACK")).collect();
    assert_eq!(back.len(), 1, "{mermaid}");
    assert!(back[0].trim().ends_with("--> w : BACK"), "{mermaid}");
    let dot = def.to_dot();
    assert_eq!(dot.matches("\"BOTH\"").count(), 2, "{dot}");
}
