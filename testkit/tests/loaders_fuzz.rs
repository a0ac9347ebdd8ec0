//! The chart loaders under hostile input: arbitrary text, and the project's own valid
//! documents (the order chart as JSON, the SCXML corpus) cut, spliced and sprinkled with
//! random characters. A loader must never panic, and every refusal must say where: a line
//! for SCXML, a line and column or a state path for JSON.
//!
//! The number of cases per property is `LOADER_FUZZ_CASES` (default 4096); a longer run is
//! `LOADER_FUZZ_CASES=100000 cargo test -p keel-testkit --test loaders_fuzz`.

use keel_core::chart::ChartBuilder;
use proptest::prelude::*;
use std::path::PathBuf;

fn cases() -> u32 {
    std::env::var("LOADER_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4096)
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

fn json_seed() -> String {
    std::fs::read_to_string(root().join("docs/order-chart.json")).expect("docs/order-chart.json")
}

fn scxml_seeds() -> Vec<String> {
    let dir = root().join("testkit/tests/scxml");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the SCXML corpus")
        .map(|e| e.expect("a corpus entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "scxml"))
        .collect();
    files.sort();
    files.iter().map(|p| std::fs::read_to_string(p).expect("a corpus file")).collect()
}

/// One edit of a document: remove a range, insert text, or copy a range elsewhere, at
/// positions given as fractions of the length (so they always land inside the text).
#[derive(Debug, Clone)]
enum Edit {
    Remove(f64, f64),
    Insert(f64, String),
    Copy(f64, f64, f64),
}

fn edit() -> impl Strategy<Value = Edit> {
    let at = 0.0..1.0f64;
    prop_oneof![
        (at.clone(), at.clone()).prop_map(|(a, b)| Edit::Remove(a, b)),
        (at.clone(), "[<>/=\"{}\\[\\]:,a-z0-9 \\n.#@-]{0,12}")
            .prop_map(|(a, s)| Edit::Insert(a, s)),
        (at.clone(), at.clone(), at).prop_map(|(a, b, c)| Edit::Copy(a, b, c)),
    ]
}

/// Applies `edits` to `text` on char boundaries.
fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    let pos = |f: f64, len: usize| ((f * len as f64) as usize).min(len);
    for e in edits {
        let len = chars.len();
        match e {
            Edit::Remove(a, b) => {
                let (a, b) = (pos(*a, len), pos(*b, len));
                let (lo, hi) = (a.min(b), a.max(b).min(lo_plus(a.min(b), 64, len)));
                chars.drain(lo..hi);
            }
            Edit::Insert(a, s) => {
                let at = pos(*a, len);
                chars.splice(at..at, s.chars());
            }
            Edit::Copy(a, b, c) => {
                let (a, b) = (pos(*a, len), pos(*b, len));
                let (lo, hi) = (a.min(b), a.max(b).min(lo_plus(a.min(b), 64, len)));
                let piece: Vec<char> = chars[lo..hi].to_vec();
                let at = pos(*c, chars.len());
                chars.splice(at..at, piece);
            }
        }
    }
    chars.into_iter().collect()
}

fn lo_plus(lo: usize, n: usize, len: usize) -> usize {
    (lo + n).min(len)
}

/// Loads JSON; a refusal must name a place (line and column, or a state path) or a bound.
fn check_json(text: &str) {
    if let Err(e) = ChartBuilder::from_json(text) {
        let message = e.to_string();
        assert!(!message.is_empty(), "an empty error for {text:?}");
        assert!(
            message.contains("line") || message.contains("state") || message.contains("fix"),
            "the error names no place or fix: {message}"
        );
    }
}

/// Loads SCXML; a refusal must name its line (1-based), its element and a fix.
fn check_scxml(text: &str) {
    if let Err(e) = ChartBuilder::from_scxml(text, 1) {
        assert!(e.line >= 1, "line 0 in {e:?}");
        assert!(!e.element.is_empty() && !e.fix.is_empty(), "no element or fix in {e:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn json_loader_survives_arbitrary_text(text in any::<String>()) {
        check_json(&text);
    }

    #[test]
    fn json_loader_survives_edits_of_a_real_chart(edits in prop::collection::vec(edit(), 1..6)) {
        check_json(&mutate(&json_seed(), &edits));
    }

    #[test]
    fn scxml_loader_survives_arbitrary_text(text in any::<String>()) {
        check_scxml(&text);
    }

    #[test]
    fn scxml_loader_survives_edits_of_the_corpus(
        which in 0usize..64,
        edits in prop::collection::vec(edit(), 1..6),
    ) {
        let seeds = scxml_seeds();
        check_scxml(&mutate(&seeds[which % seeds.len()], &edits));
    }
}

/// The seeds themselves load: the edits start from valid documents.
#[test]
fn the_seeds_load() {
    ChartBuilder::from_json(&json_seed()).expect("the order chart JSON loads");
    for (i, doc) in scxml_seeds().iter().enumerate() {
        ChartBuilder::from_scxml(doc, 1).unwrap_or_else(|e| panic!("corpus file {i}: {e:?}"));
    }
}
