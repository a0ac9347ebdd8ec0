//! `Keel::testing`: the in-memory store on a virtual clock. A test moves time with
//! `VirtualClock::advance` instead of sleeping, and the worker's timer sweep, which reads
//! the clock at least every 250 ms, fires what the move made due.

use keel::{ChartMachine, Definition, Keel, Status, Timer, Timestamp, VirtualClock, json};
use std::time::{Duration, Instant};

#[tokio::test]
async fn advancing_the_virtual_clock_fires_an_hour_long_timer_at_once() {
    let clock = VirtualClock::new(Timestamp(1_700_000_000_000));
    let keel = Keel::testing(clock.clone());
    let def = Definition::builder("reminder", 1)
        .initial("waiting")
        .state("waiting", |s| s.on("REMIND", |t| t.after(Timer::seconds(3_600)).target("reminded")))
        .final_state("reminded")
        .build()
        .expect("valid chart");
    let chart = ChartMachine::new(def);
    let worker = keel.worker().register(chart.clone()).expect("registers").spawn().expect("starts");
    let id = keel.start(chart.new_instance(json!({}))).await.expect("starts").id();

    // Entered `waiting` (its timer armed), the instance waits for virtual time.
    let waiting = Instant::now();
    loop {
        let row = keel.get(id).await.expect("reads").instance;
        if row.status == Status::AwaitingSignal {
            break;
        }
        assert!(waiting.elapsed() < Duration::from_secs(10), "never parked: {row:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(keel.get(id).await.unwrap().instance.position.contains("waiting"));

    let fired = Instant::now();
    clock.advance(Duration::from_secs(3_600));
    let ended = tokio::time::timeout(Duration::from_secs(10), keel.wait(id))
        .await
        .expect("the timer fires soon after the clock moved")
        .expect("waits");
    assert_eq!(ended.status, Status::Done);
    assert!(ended.state.matches("reminded"), "{:?}", ended.state);
    assert!(fired.elapsed() < Duration::from_secs(5), "took {:?}", fired.elapsed());
    worker.shutdown().await;
}

/// The types the facade's own API takes are named from the crate root: `Keel::from_store`
/// takes a `Store`, `AnyClock::new` a `Clock`, `ChartMachine::with_limits` `Limits`,
/// `SweepConfig::groups` `SweepGroup`s, the dead-letter calls a `DeadLetterId`.
#[test]
fn the_root_names_the_types_the_facade_takes() {
    fn takes(_: &dyn keel::Store, _: &dyn keel::Clock, _: keel::Limits, _: keel::DeadLetterId) {}
    let _ = takes;
    let group = keel::SweepGroup { machines: Vec::new(), cadence: Duration::from_secs(60) };
    let sweep = keel::SweepConfig { groups: vec![group], ..keel::SweepConfig::default() };
    assert_eq!(sweep.groups.len(), 1);
    let clock = VirtualClock::new(Timestamp(0));
    let _ = keel::AnyClock::new(clock);
}
