//! The Prometheus recorder: installing it twice hands back the first recorder.
#![cfg(feature = "prometheus")]

/// A program (or a test that starts several servers) may ask for the handle more than
/// once: every call returns the one recorder, and what any part records shows in the
/// text every handle renders.
#[test]
fn install_twice_returns_the_recorder_installed_first() {
    let first = keel::prometheus::install().expect("the first install");
    let second = keel::prometheus::install().expect("a second install returns the first");
    metrics::counter!("keel_test_installs_total").increment(3);
    for handle in [&first, &second] {
        let text = handle.render();
        assert!(
            text.lines().any(|l| l == "keel_test_installs_total 3"),
            "the counter is missing from the rendered text:\n{text}"
        );
    }
    let serve = keel::prometheus::serve("127.0.0.1:0".parse().unwrap());
    assert!(serve.is_err(), "serve must refuse once a recorder is installed");
}
