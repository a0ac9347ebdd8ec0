//! Moving armed timers to a deployed definition's durations reads only the timers that
//! move: a second pass over a machine version whose timers were moved already returns no
//! timer (one empty page), whatever their number, as does a deployed list that names a
//! timer twice with its current duration first; a later deploy that changes a duration
//! again moves them all again.

use keel_store_sqlite::SqliteStore;

#[tokio::test]
async fn a_second_retime_pass_reads_nothing_and_a_new_duration_moves_every_timer_again() {
    let s = SqliteStore::temporary().await.expect("store");
    keel_testkit::conformance::retime_reads_only_the_timers_that_move(&s).await;
}
