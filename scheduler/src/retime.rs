//! Timers follow the deployed definition: at start-up a worker moves the armed timers of
//! every chart machine version it serves to the durations that definition gives them
//! (`Store::timers_retime`), so a deploy that shortens a 7-day deadline to 1 day applies to
//! instances already waiting, counted from their original anchor. Transitions marked
//! `keep_armed` are left alone. Every worker does it; a second pass finds nothing to move.
//! The worker's sweeper starts sweeping only once this pass has ended (done, given up, or
//! panicked), or after a minute at most, so its first sweep does not fire a timer under a
//! duration the deploy changed.

use super::Inner;
use keel_core::limits;
use keel_core::ports::store::TimerRetimeParams;
use keel_core::ports::{Clock, Store};
use std::sync::Arc;
use std::time::Duration;

/// Most pages one machine version's pass reads (a million timers at the page size).
const PAGES_MAX: usize = 1_000;
/// Attempts per page while the store is unavailable.
const ATTEMPTS_MAX: u32 = 10;

/// Moves the timers of every registered machine that has timers following deploys. A
/// machine whose page fails keeps the rest of its timers on their armed durations; the
/// other machines are still moved.
pub(super) async fn retime_all<S: Store, C: Clock>(inner: Arc<Inner<S, C>>) {
    for (machine, m) in &inner.machines {
        let timers = m.followed_timers();
        if timers.is_empty() {
            continue;
        }
        let mut after = None;
        let mut moved = 0usize;
        let mut ended = false;
        for _ in 0..PAGES_MAX {
            let params = TimerRetimeParams {
                machine: machine.clone(),
                timers: timers.clone(),
                after,
                limit: limits::TIMER_RETIME_BATCH_MAX,
                now: inner.clock.now(),
            };
            let Some(page) = page(&inner, params).await else {
                tracing::warn!(
                    machine = %machine,
                    moved,
                    "stopped moving this machine's armed timers after a failed page; the rest \
                     keep their armed durations until the next start"
                );
                ended = true;
                break;
            };
            moved += page.retimed.len();
            after = page.next;
            if after.is_none() {
                ended = true;
                break;
            }
        }
        if !ended {
            tracing::warn!(
                machine = %machine,
                moved,
                pages = PAGES_MAX,
                "stopped moving this machine's armed timers at the page bound; the rest keep \
                 their armed durations until the next start"
            );
        }
        if moved > 0 {
            tracing::info!(
                machine = %machine,
                moved,
                "armed timers moved to the deployed definition's durations"
            );
        }
    }
}

/// One page, retried with a growing pause while the store is unavailable; `None` gives up
/// (logged): the timers then keep their armed durations until the next start.
async fn page<S: Store, C: Clock>(
    inner: &Inner<S, C>,
    params: TimerRetimeParams,
) -> Option<keel_core::ports::store::TimerRetimePage> {
    let mut pause = Duration::from_millis(100);
    for attempt in 1..=ATTEMPTS_MAX {
        match inner.store.timers_retime(params.clone()).await {
            Ok(page) => return Some(page),
            Err(e) if e.kind == keel_core::ErrorKind::Unavailable && attempt < ATTEMPTS_MAX => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(e) => {
                tracing::error!(
                    machine = %params.machine,
                    error = %e,
                    "could not move armed timers to the deployed durations"
                );
                return None;
            }
        }
    }
    None
}
