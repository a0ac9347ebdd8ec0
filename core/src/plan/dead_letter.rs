//! Operator actions on dead letters: retry, skip and purge.
//!
//! A dead letter stands for a suspended instance. Retrying it makes the instance runnable
//! after a delay with a fresh attempt count ([`outcome::dead_letter_retry`]); skipping it
//! also consumes the signals the failing step was processing, so the instance carries on
//! with its next event; either way the dead letter goes (history keeps the record). A
//! letter whose instance is no longer suspended (cancelled, already retried) cannot be
//! retried: naming it is a `Conflict`, and a machine-wide retry does not read it.

use super::RowWrite;
use crate::error::{StoreError, StoreResult};
use crate::history::HistoryKind;
use crate::ids::{DeadLetterId, InstanceId, SignalId, Status};
use crate::instance::{DeadLetter, HistoryEntry, Instance};
use crate::limits;
use crate::outcome;
use crate::ports::store::{
    DeadLetterPurgeParams, DeadLetterRetryParams, DeadLetterSelector, DeadLetterSkipParams,
};
use crate::time::Timestamp;
use serde_json::json;
use std::collections::HashMap;

/// The writes of a retry.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RetryPlan {
    /// The instances made runnable, in letter order.
    pub rows: Vec<RowWrite>,
    /// The dead letters to remove.
    pub remove: Vec<DeadLetterId>,
}

impl RetryPlan {
    /// The instances made runnable: the caller's result.
    pub fn retried(&self) -> Vec<InstanceId> {
        self.rows.iter().map(|w| w.row.id).collect()
    }
}

/// The error for a letter whose instance no longer exists.
fn instance_gone(letter: DeadLetterId, instance: InstanceId) -> StoreError {
    StoreError::not_found(format!("instance {instance} of dead letter {letter} is gone"))
}

/// Plans a retry. `letters` are the `(letter, instance)` pairs the selector matched, oldest
/// first, at most [`limits::DEAD_LETTER_BATCH_MAX`] (for a machine selector, only those
/// whose instance is [`outcome::DEAD_LETTER_RETRYABLE`] when read); `rows` the rows of
/// their instances (missing ones left out). `NotFound` when a named letter does not exist
/// or its instance is gone.
pub fn retry(
    p: &DeadLetterRetryParams,
    letters: &[(DeadLetterId, InstanceId)],
    rows: impl IntoIterator<Item = Instance>,
) -> StoreResult<RetryPlan> {
    let by_id = match p.selector {
        DeadLetterSelector::Id(id) if letters.is_empty() => {
            return Err(StoreError::not_found(format!("dead letter {id} does not exist")));
        }
        DeadLetterSelector::Id(_) => true,
        DeadLetterSelector::Machine { .. } => false,
    };
    let mut rows: HashMap<InstanceId, Instance> = rows.into_iter().map(|r| (r.id, r)).collect();
    let at = p.now.plus(p.delay);
    let mut plan = RetryPlan::default();
    for (letter, instance) in letters.iter().take(limits::DEAD_LETTER_BATCH_MAX) {
        let next = match rows.get(instance) {
            None => Err(instance_gone(*letter, *instance)),
            Some(row) => outcome::dead_letter_retry(row, at, p.now),
        };
        let next = match next {
            Ok(next) => next,
            // Retrying one named letter reports why it cannot; a machine-wide retry leaves
            // letters whose instance moved on (cancelled, skipped) alone.
            Err(e) if by_id => return Err(e),
            Err(_) => continue,
        };
        let entry = HistoryEntry::new(
            HistoryKind::DeadLetterRetried,
            json!({ "dead_letter": letter, "delay_ms": p.delay.as_millis() as u64 }),
        );
        let attempt = rows[instance].attempt;
        // A later letter of the same instance sees it runnable, and is left alone.
        rows.insert(*instance, next.clone());
        plan.rows.push(RowWrite { row: next, attempt, history: vec![entry] });
        plan.remove.push(*letter);
    }
    Ok(plan)
}

/// The writes of a skip.
#[derive(Debug, Clone, PartialEq)]
pub struct SkipPlan {
    /// The instance, runnable now.
    pub row: RowWrite,
    /// The signals to remove from its inbox (ids no longer there are ignored).
    pub consume: Vec<SignalId>,
    /// The dead letter to remove.
    pub remove: DeadLetterId,
}

/// Plans skipping `letter`, whose instance's row is `row` (`None` when it is gone).
pub fn skip(
    p: &DeadLetterSkipParams,
    letter: &DeadLetter,
    row: Option<&Instance>,
) -> StoreResult<SkipPlan> {
    let instance = letter.letter.instance;
    let row = row.ok_or_else(|| instance_gone(p.id, instance))?;
    let next = outcome::dead_letter_retry(row, p.now, p.now)?;
    let entry = HistoryEntry::new(
        HistoryKind::DeadLetterSkipped,
        json!({ "dead_letter": p.id, "signals": letter.letter.signals }),
    );
    Ok(SkipPlan {
        row: RowWrite { row: next, attempt: row.attempt, history: vec![entry] },
        consume: letter.letter.signals.clone(),
        remove: p.id,
    })
}

/// Whether a letter still stands for its instance: the instance (`None` when it is gone) is
/// suspended, and the letter is how it is retried. Such a letter is left by a purge that
/// keeps them ([`DeadLetterPurgeParams::keep_suspended`]) and by `keel dlq delete`; a
/// letter whose instance was cancelled, ended or retried through another letter only
/// records what happened.
pub fn retries_its_instance(instance: Option<Status>) -> bool {
    instance == Some(Status::Suspended)
}

/// Plans a purge: among `letters` (each letter's id, its `created_at` and its instance's
/// status, `None` when the instance is gone; those the selector matched, oldest first),
/// those created before `older_than` (all, without it), less those whose instance they
/// still retry when the purge keeps them, at most [`limits::DEAD_LETTER_BATCH_MAX`]. A
/// store whose read stops at a page applies the same two conditions in the read, so a
/// page of kept letters does not hide older purgeable ones behind it.
pub fn purge(
    p: &DeadLetterPurgeParams,
    letters: impl IntoIterator<Item = (DeadLetterId, Timestamp, Option<Status>)>,
) -> Vec<DeadLetterId> {
    letters
        .into_iter()
        .filter(|(_, created_at, _)| p.older_than.is_none_or(|t| *created_at < t))
        .filter(|(_, _, instance)| !(p.keep_suspended && retries_its_instance(*instance)))
        .map(|(id, _, _)| id)
        .take(limits::DEAD_LETTER_BATCH_MAX)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use crate::ids::MachineRef;
    use crate::instance::{NewDeadLetter, NewInstance};
    use std::time::Duration;

    const NOW: Timestamp = Timestamp(1_000);

    fn row(id: i64, status: Status) -> Instance {
        let new = NewInstance::new(MachineRef::new("m", 1), "start");
        let mut row = Instance::from_new(InstanceId(id), &new, None, Timestamp(0));
        row.status = status;
        row.attempt = 4;
        row
    }

    fn retry_params(selector: DeadLetterSelector) -> DeadLetterRetryParams {
        DeadLetterRetryParams { selector, delay: Duration::from_secs(5), now: NOW }
    }

    fn machine() -> DeadLetterSelector {
        DeadLetterSelector::Machine { namespace: "ns".into(), machine: "m".into() }
    }

    fn pairs(v: &[(i64, i64)]) -> Vec<(DeadLetterId, InstanceId)> {
        v.iter().map(|(l, i)| (DeadLetterId(*l), InstanceId(*i))).collect()
    }

    #[test]
    fn a_machine_wide_retry_resumes_suspended_instances_and_leaves_the_rest() {
        let rows = [row(1, Status::Suspended), row(2, Status::Cancelled)];
        // Letter 12 names instance 1 again, already resumed by letter 10; 13's instance is gone.
        let letters = pairs(&[(10, 1), (11, 2), (12, 1), (13, 3)]);
        let plan = retry(&retry_params(machine()), &letters, rows).unwrap();
        assert_eq!(plan.retried(), [InstanceId(1)]);
        assert_eq!(plan.remove, [DeadLetterId(10)]);
        let w = &plan.rows[0];
        assert_eq!(
            (w.row.status, w.row.attempt, w.row.eligible_at),
            (Status::Runnable, 0, Timestamp(6_000))
        );
        assert_eq!((w.attempt, w.history[0].kind.as_str()), (4, "DEAD_LETTER_RETRIED"));
    }

    #[test]
    fn a_named_retry_reports_why_it_cannot() {
        let p = |id| retry_params(DeadLetterSelector::Id(DeadLetterId(id)));
        let kind = |r: StoreResult<RetryPlan>| r.unwrap_err().kind;
        assert_eq!(kind(retry(&p(10), &[], [])), ErrorKind::NotFound);
        assert_eq!(kind(retry(&p(10), &pairs(&[(10, 3)]), [])), ErrorKind::NotFound);
        let cancelled = [row(2, Status::Cancelled)];
        assert_eq!(kind(retry(&p(11), &pairs(&[(11, 2)]), cancelled)), ErrorKind::Conflict);
    }

    #[test]
    fn a_skip_consumes_the_failing_signals_and_resumes_now() {
        let letter = DeadLetter {
            id: DeadLetterId(10),
            created_at: Timestamp(500),
            letter: NewDeadLetter {
                instance: InstanceId(1),
                namespace: "ns".into(),
                machine: MachineRef::new("m", 1),
                position: "start".into(),
                signals: vec![SignalId(7)],
                event: None,
                correlation_id: None,
                reason: "exhausted".into(),
                attempts: 5,
                errors: Vec::new(),
                first_attempt_at: Timestamp(400),
                last_attempt_at: Timestamp(500),
            },
        };
        let p = DeadLetterSkipParams { id: DeadLetterId(10), now: NOW };
        let plan = skip(&p, &letter, Some(&row(1, Status::Suspended))).unwrap();
        assert_eq!((plan.row.row.status, plan.row.row.eligible_at), (Status::Runnable, NOW));
        assert_eq!((plan.consume, plan.remove), (vec![SignalId(7)], DeadLetterId(10)));
        assert_eq!(skip(&p, &letter, None).unwrap_err().kind, ErrorKind::NotFound);
        let done = row(1, Status::Done);
        assert_eq!(skip(&p, &letter, Some(&done)).unwrap_err().kind, ErrorKind::Conflict);
    }

    #[test]
    fn a_purge_takes_letters_older_than_the_cutoff() {
        let letters = || {
            [
                (DeadLetterId(1), Timestamp(10), Some(Status::Cancelled)),
                (DeadLetterId(2), Timestamp(20), None),
            ]
        };
        let p = |older: Option<i64>| DeadLetterPurgeParams {
            selector: None,
            older_than: older.map(Timestamp),
            keep_suspended: false,
        };
        assert_eq!(purge(&p(None), letters()), [DeadLetterId(1), DeadLetterId(2)]);
        assert_eq!(purge(&p(Some(20)), letters()), [DeadLetterId(1)]);
        assert_eq!(purge(&p(Some(10)), letters()), []);
    }

    #[test]
    fn a_purge_that_keeps_suspended_instances_leaves_the_letters_they_are_retried_by() {
        let letters = || {
            [
                (DeadLetterId(1), Timestamp(10), Some(Status::Suspended)),
                (DeadLetterId(2), Timestamp(10), Some(Status::Cancelled)),
                (DeadLetterId(3), Timestamp(10), Some(Status::Runnable)),
                (DeadLetterId(4), Timestamp(10), None),
            ]
        };
        let p = |keep_suspended| DeadLetterPurgeParams {
            selector: None,
            older_than: Some(Timestamp(20)),
            keep_suspended,
        };
        assert_eq!(
            purge(&p(true), letters()),
            [DeadLetterId(2), DeadLetterId(3), DeadLetterId(4)],
            "the suspended instance keeps its letter; the others only record what happened"
        );
        assert_eq!(purge(&p(false), letters()).len(), 4, "an operator's purge takes them all");
    }
}
