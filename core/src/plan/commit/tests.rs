//! Tests of the commit planner: the refusals, the batch memory, and the plan of each
//! kind of outcome, without a store.

use super::*;
use crate::chart::{TimerArm, TimerKind};
use crate::error::ErrorKind;
use crate::ids::{FencingToken, MachineRef, StatusSet};
use crate::instance::{SignalTarget, UniqueSpec};
use serde_json::json;

const NOW: Timestamp = Timestamp::from_millis(1_000_000);

/// An instance executing under token 1.
fn executing(id: i64) -> Instance {
    let new = NewInstance::new(MachineRef::new("m", 1), "start");
    let mut row = Instance::from_new(InstanceId(id), &new, None, Timestamp::from_millis(0));
    row.status = Status::Executing;
    row.fencing_token = FencingToken(1);
    row
}

fn read(row: Instance) -> CommitRead {
    CommitRead { row: Some(row), ..CommitRead::default() }
}

fn next(id: i64) -> StepCommit {
    StepCommit::new(
        InstanceId(id),
        FencingToken(1),
        Outcome::Next { step: "b".into(), context: json!({}) },
    )
}

fn done(id: i64) -> StepCommit {
    StepCommit::new(
        InstanceId(id),
        FencingToken(1),
        Outcome::Done { result: json!({ "ok": true }), step: None },
    )
}

fn signal(id: i64, name: &str) -> Signal {
    Signal {
        id: SignalId(id),
        target: InstanceId(1),
        name: name.into(),
        payload: json!(null),
        dedup_key: None,
        priority: None,
        inserted_at: Timestamp::from_millis(0),
    }
}

#[test]
fn a_missing_row_is_not_found_and_a_stale_token_is_lease_lost() {
    let mut planner = CommitPlanner::new(NOW);
    let missing = planner.admit(&next(1), CommitRead::default()).unwrap_err();
    assert_eq!(missing.kind, ErrorKind::NotFound);
    let mut stale = executing(1);
    stale.fencing_token = FencingToken(2);
    let lost = planner.admit(&next(1), read(stale)).unwrap_err();
    assert_eq!(lost.kind, ErrorKind::LeaseLost);
}

#[test]
fn a_second_item_for_the_same_instance_in_one_batch_is_stale() {
    let mut planner = CommitPlanner::new(NOW);
    planner.admit(&next(1), read(executing(1))).unwrap();
    let second = planner.admit(&done(1), read(executing(1))).unwrap_err();
    assert_eq!(second.kind, ErrorKind::LeaseLost);
}

#[test]
fn an_unresolved_emit_target_refuses_the_item_naming_the_emit() {
    let mut planner = CommitPlanner::new(NOW);
    let commit = next(1)
        .emit(NewSignal::new(InstanceId(7), "PING"))
        .emit(NewSignal::new(InstanceId(8), "PING"));
    let mut r = read(executing(1));
    r.emit_targets = vec![Some(InstanceId(7)), None];
    let err = planner.admit(&commit, r).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
    assert!(err.message.starts_with("emit[1].target"), "{}", err.message);
    // Refused items leave the row executing: a corrected retry of the same item is admitted.
    let mut r = read(executing(1));
    r.emit_targets = vec![Some(InstanceId(7)), Some(InstanceId(8))];
    let admitted = planner.admit(&commit, r).unwrap();
    let plan = admitted.finish(&commit, &[]);
    assert_eq!(plan.emits.len(), 2);
    assert_eq!(plan.emits[1].1, InstanceId(8));
}

#[test]
fn a_unique_key_coming_back_into_scope_conflicts_with_its_occupant_and_earlier_items() {
    let keyed = |id| {
        let mut row = executing(id);
        row.unique = Some(UniqueSpec {
            key: b"k".to_vec(),
            scope: StatusSet::of(&[Status::Runnable, Status::AwaitingSignal]),
        });
        row
    };
    assert_eq!(reentering_key(&keyed(1), &next(1), false), Some(&b"k"[..]));
    assert_eq!(reentering_key(&keyed(1), &done(1), false), None);

    let mut planner = CommitPlanner::new(NOW);
    let mut r = read(keyed(1));
    r.key_occupant = Some(InstanceId(9));
    assert_eq!(planner.admit(&next(1), r).unwrap_err().kind, ErrorKind::Conflict);

    let mut planner = CommitPlanner::new(NOW);
    planner.admit(&next(1), read(keyed(1))).unwrap();
    let later = planner.admit(&next(2), read(keyed(2))).unwrap_err();
    assert_eq!(later.kind, ErrorKind::Conflict);
}

#[test]
fn schedule_children_parks_on_the_barrier_only_when_a_child_was_inserted() {
    let child = NewInstance::new(MachineRef::new("c", 1), "start");
    let commit = StepCommit::new(
        InstanceId(1),
        FencingToken(1),
        Outcome::ScheduleChildren {
            next: "after".into(),
            children: vec![child.clone(), child.clone()],
            context: json!({}),
            join: crate::join::Join::default(),
        },
    );
    let mut commit = commit;
    commit.spawn = vec![child];
    let admitted = CommitPlanner::new(NOW).admit(&commit, read(executing(1))).unwrap();
    let barrier: Vec<bool> = admitted.children.iter().map(|c| c.barrier).collect();
    assert_eq!(barrier, [true, true, false]);
    let existing = InsertOutcome::Existing(InstanceId(5));
    let plan = admitted.clone().finish(&commit, &[existing, existing, existing]);
    assert_eq!(plan.row.status, Status::Runnable);
    assert_eq!(plan.receipt.children, [existing, existing]);
    assert_eq!(plan.receipt.spawned, [existing]);
    let new = InsertOutcome::Inserted(InstanceId(6));
    let plan = admitted.finish(&commit, &[new, existing, existing]);
    assert_eq!(plan.row.status, Status::AwaitingChildren);
    assert_eq!(plan.row.children_pending, 1);
}

#[test]
fn await_wakes_at_once_on_an_unconsumed_matching_signal_only() {
    let commit = StepCommit::new(
        InstanceId(1),
        FencingToken(1),
        Outcome::Await { signal: "GO".into(), context: json!({}), step: None },
    );
    let inbox = [signal(1, "GO"), signal(2, "OTHER")];
    assert!(InboxRead::of(&inbox, &commit).signal_waiting);
    let consumed = commit.clone().consume([SignalId(1)]);
    assert!(!InboxRead::of(&inbox, &consumed).signal_waiting);

    let mut r = read(executing(1));
    r.inbox = InboxRead::of(&inbox, &commit);
    let plan = CommitPlanner::new(NOW).admit(&commit, r).unwrap().finish(&commit, &[]);
    assert_eq!(plan.row.status, Status::Runnable);
    assert!(!plan.drain_inbox);
}

/// The fire of timer `timer` owned by `state`, as a sweep delivers it.
fn fire(id: i64, name: &str, state: &str) -> Signal {
    Signal {
        payload: json!({ "timer": 7, "state": state, "fire": 1 }),
        dedup_key: Some(crate::timers::fire_dedup_key(crate::ids::TimerId(7), 1)),
        ..signal(id, name)
    }
}

#[test]
fn unread_fires_of_a_cancelled_state_are_withdrawn_and_wake_nothing() {
    let park = Outcome::Await { signal: "*".into(), context: json!({}), step: None };
    let mut commit = StepCommit::new(InstanceId(1), FencingToken(1), park).consume([SignalId(1)]);
    commit.timers_cancel = vec!["idle".into()];
    // A user's signal that merely looks like a fire (no dedup key) is an ordinary signal.
    let lookalike = Signal { payload: json!({ "state": "idle" }), ..signal(5, "LOGOUT") };
    let inbox = [signal(1, "ACTIVITY"), fire(2, "LOGOUT", "idle.typing"), fire(3, "NUDGE", "side")];
    let facts = InboxRead::of(&inbox, &commit);
    assert_eq!(facts.withdrawn.iter().map(|f| f.id).collect::<Vec<_>>(), [SignalId(2)]);
    assert!(facts.signal_waiting, "the fire of a state not left still wakes the instance");
    let only_stale = InboxRead::of(&inbox[..2], &commit);
    assert!(!only_stale.signal_waiting, "a withdrawn fire wakes nothing");
    assert!(InboxRead::of(&[inbox[0].clone(), lookalike], &commit).withdrawn.is_empty());

    let mut r = read(executing(1));
    r.inbox = only_stale;
    let plan = CommitPlanner::new(NOW).admit(&commit, r).unwrap().finish(&commit, &[]);
    assert_eq!(plan.consume, [SignalId(1), SignalId(2)]);
    assert_eq!(plan.row.status, Status::AwaitingSignal);
    let entry = plan.history.iter().find(|h| h.kind == "TIMER_WITHDRAWN").expect("recorded");
    assert_eq!(entry.data["event"], json!("LOGOUT"));
    assert_eq!(entry.data["state"], json!("idle.typing"));
    assert_eq!(entry.data["key"], json!("timer:7:1"));

    // Without a cancel (or when the commit ends the instance) nothing is withdrawn.
    commit.timers_cancel.clear();
    assert!(InboxRead::of(&inbox, &commit).withdrawn.is_empty());
    let mut ending = done(1);
    ending.timers_cancel = vec!["idle".into()];
    assert!(InboxRead::of(&inbox, &ending).withdrawn.is_empty());
}

#[test]
fn an_ending_commit_drains_the_inbox_drops_timers_and_tells_its_parent() {
    let mut row = executing(1);
    row.parent = Some(InstanceId(50));
    row.invoked_by = Some("pay".into());
    let commit = done(1).consume([SignalId(1)]);
    let inbox = [signal(1, "USED"), signal(2, "LATE")];
    let mut r = read(row);
    r.inbox = InboxRead::of(&inbox, &commit);
    assert_eq!(r.inbox.pending.count, 1);
    let plan = CommitPlanner::new(NOW).admit(&commit, r).unwrap().finish(&commit, &[]);
    assert_eq!(plan.row.status, Status::Done);
    assert!(plan.drain_inbox);
    assert_eq!(plan.timers, TimerPlan::DropAll);
    let kinds: Vec<&str> = plan.history.iter().map(|h| h.kind.as_str()).collect();
    assert_eq!(kinds, ["STEP_DONE", inbox::INBOX_DRAINED]);
    assert_eq!(
        plan.barrier_release.as_ref().map(|r| (r.parent, r.succeeded)),
        Some((InstanceId(50), true))
    );
    let notice = plan.parent_notice.expect("a delegated child tells its parent");
    assert_eq!(notice.target, SignalTarget::Id(InstanceId(50)));
    assert_eq!(plan.receipt.status, Status::Done);
}

#[test]
fn a_live_commit_changes_timers_and_leaves_the_parent_alone() {
    let mut row = executing(1);
    row.parent = Some(InstanceId(50));
    let mut commit = next(1);
    commit.timers_cancel = vec!["a".into()];
    let arm = TimerArm {
        state: "b".into(),
        event: "TICK".into(),
        kind: TimerKind::After,
        interval: std::time::Duration::from_secs(30),
        max: None,
        then: None,
    };
    commit.timers_arm = vec![arm];
    let plan = CommitPlanner::new(NOW).admit(&commit, read(row)).unwrap().finish(&commit, &[]);
    let TimerPlan::Change { cancel, arm } = &plan.timers else { panic!("{:?}", plan.timers) };
    assert_eq!(cancel, &["a".to_owned()]);
    assert_eq!(arm.len(), 1);
    assert_eq!((arm[0].instance, arm[0].armed_at), (InstanceId(1), NOW));
    assert_eq!(arm[0].next_fire_at, NOW.plus(std::time::Duration::from_secs(30)));
    assert_eq!(plan.barrier_release, None);
    assert_eq!(plan.parent_notice, None);
    assert!(plan.history.iter().all(|h| h.kind != inbox::INBOX_DRAINED));
}

#[test]
fn a_child_holding_the_key_its_parent_brings_back_is_refused() {
    let mut row = executing(1);
    row.unique = Some(UniqueSpec { key: b"k".to_vec(), scope: StatusSet::of(&[Status::Runnable]) });
    let mut child = NewInstance::new(MachineRef::new("c", 1), "start");
    child.unique = Some(UniqueSpec { key: b"k".to_vec(), scope: StatusSet::ALL });
    let mut commit = next(1);
    commit.spawn = vec![child];
    let err = CommitPlanner::new(NOW).admit(&commit, read(row)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Conflict);
    assert!(err.message.starts_with("spawn[0]"), "{}", err.message);
}

#[test]
fn only_accepted_items_that_stay_live_hint_their_armed_timers() {
    let arm = |secs| TimerArm {
        state: "s".into(),
        event: "E".into(),
        kind: TimerKind::After,
        interval: std::time::Duration::from_secs(secs),
        max: None,
        then: None,
    };
    let mut live = next(1);
    live.timers_arm = vec![arm(30)];
    let mut refused = next(2);
    refused.timers_arm = vec![arm(5)];
    let mut ended = done(3);
    ended.timers_arm = vec![arm(1)];
    let receipt = |status| CommitReceipt {
        id: InstanceId(1),
        revision: crate::ids::Revision(1),
        status,
        children: Vec::new(),
        spawned: Vec::new(),
        dead_letter: None,
    };
    let results = [
        Ok(receipt(Status::Runnable)),
        Err(StoreError::lease_lost("stale")),
        Ok(receipt(Status::Done)),
    ];
    let due = armed_due(&[live, refused, ended], &results, NOW);
    assert_eq!(due, Some(NOW.plus(std::time::Duration::from_secs(30))));
}

#[test]
fn a_timer_plan_cancels_timers_of_left_states_and_their_descendants_or_all_when_ended() {
    let change = TimerPlan::Change { cancel: vec!["processing".into()], arm: vec![] };
    assert!(change.cancels("processing"));
    assert!(change.cancels("processing.payment"));
    assert!(!change.cancels("processing_extra"));
    assert!(!TimerPlan::Change { cancel: vec![], arm: vec![] }.cancels("processing"));
    assert!(TimerPlan::DropAll.cancels("anything"));
}
