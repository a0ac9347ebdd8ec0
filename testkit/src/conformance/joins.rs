//! Contracts for join policies on a children barrier: a quorum wakes its parent once, at
//! the k-th success (or when k is out of reach), and cancels or leaves the rest; a
//! deadline wakes it once, with whatever finished; children that no longer count change
//! nothing; bad policies are refused naming the field.

use super::support::{
    at, claim, claim_id, claim_params, commit, commit_ok, ctx, done, expect_kind, get, insert_one,
    new_in, row, step,
};
use keel_core::chart::{TimerArm, TimerKind};
use keel_core::history::HistoryKind;
use keel_core::instance::ANY_SIGNAL;
use keel_core::join::{Join, JoinState, JoinWoke};
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{CancelParams, Claim, TimerSweepParams};
use keel_core::{ErrorKind, InstanceId, NewInstance, NewSignal, Status, StepCommit, Timestamp};
use std::collections::HashMap;
use std::time::Duration;

/// A parent in `ns` (queue `parents`) that schedules `n` children (queue `default`) with
/// `join` at `at(20)`; returns the parent and its children, in order.
async fn fan_out<S: Store>(s: &S, ns: &str, n: usize, join: Join) -> (InstanceId, Vec<InstanceId>) {
    let parent = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let children: Vec<NewInstance> = (0..n).map(|_| new_in(ns)).collect();
    let outcome = Outcome::schedule_children("join", children, ctx(1)).with_join(join);
    let receipt = step(s, &claimed, outcome, at(20)).await;
    (parent, receipt.children.iter().map(|o| o.id()).collect())
}

/// Claims every ready child of `ns` at `now`, by id.
async fn claim_children<S: Store>(s: &S, ns: &str, now: Timestamp) -> HashMap<InstanceId, Claim> {
    let mut params = claim_params(ns, 100, now);
    params.queues = vec!["default".into()];
    claim(s, params).await.into_iter().map(|c| (c.instance.id, c)).collect()
}

/// Commits `outcome` for a claimed child.
async fn end<S: Store>(
    s: &S,
    claims: &HashMap<InstanceId, Claim>,
    id: InstanceId,
    outcome: Outcome,
    now: Timestamp,
) {
    step(s, &claims[&id], outcome, now).await;
}

fn stop() -> Outcome {
    Outcome::Stop { reason: "no quote".into() }
}

/// How often the parent's history records a wake from its join.
async fn wakes<S: Store>(s: &S, parent: InstanceId) -> usize {
    get(s, parent).await.history.iter().filter(|h| HistoryKind::JoinWoke.is(&h.entry.kind)).count()
}

fn join_of(row: &keel_core::Instance) -> JoinState {
    JoinState::of(&row.context).expect("the parent keeps its join state")
}

/// A quorum of 3 of 5 wakes the parent once, at the third success (a failure before it
/// does not count toward the quorum); the two children still running are cancelled in
/// the same commit, so a step one of them was running cannot commit afterwards, and the
/// woken parent sees every child's status and result.
pub async fn join_quorum_of_three_of_five_wakes_the_parent_once_at_the_third_success<S: Store>(
    s: &S,
) {
    let ns = "join_quorum";
    let (parent, kids) = fan_out(s, ns, 5, Join::quorum(3)).await;
    let claims = claim_children(s, ns, at(25)).await;
    assert_eq!(claims.len(), 5);
    end(s, &claims, kids[0], done(), at(30)).await;
    end(s, &claims, kids[1], stop(), at(31)).await;
    end(s, &claims, kids[2], done(), at(32)).await;
    let waiting = row(s, parent).await;
    assert_eq!((waiting.status, waiting.children_pending), (Status::AwaitingChildren, 2));
    end(s, &claims, kids[3], done(), at(33)).await;
    let woken = row(s, parent).await;
    assert_eq!(
        (woken.status, woken.eligible_at),
        (Status::Runnable, at(33)),
        "woken at the third success"
    );
    let state = join_of(&woken);
    assert_eq!(
        (state.woke, state.succeeded, state.ended, state.unfinished),
        (Some(JoinWoke::Quorum), 3, 4, 1)
    );
    assert_eq!(
        row(s, kids[4]).await.status,
        Status::Cancelled,
        "the rest is cancelled with the wake"
    );
    let late = StepCommit::new(kids[4], claims[&kids[4]].token(), done());
    expect_kind(commit(s, late, at(34)).await, ErrorKind::LeaseLost, "a cancelled child's step");
    assert_eq!(wakes(s, parent).await, 1);
    let claimed = claim_id(s, ns, parent, at(40)).await;
    assert_eq!(claimed.instance.position, "join");
    let statuses: Vec<Status> = claimed.children.iter().map(|c| c.status).collect();
    let expected = [Status::Done, Status::Failed, Status::Done, Status::Done, Status::Cancelled];
    assert_eq!(statuses, expected);
    assert_eq!(claimed.children[0].result, Some(serde_json::json!({ "ok": true })));
}

/// With the rest left running, children that end after the wake change nothing on the
/// parent (no second wake, no count), even once the parent waits on a new barrier: only
/// that barrier's own child releases it.
pub async fn join_left_running_children_never_count_again<S: Store>(s: &S) {
    let ns = "join_leave";
    let (parent, kids) = fan_out(s, ns, 3, Join::quorum(2).leave_running()).await;
    let claims = claim_children(s, ns, at(25)).await;
    end(s, &claims, kids[0], done(), at(30)).await;
    end(s, &claims, kids[1], done(), at(31)).await;
    assert_eq!(row(s, parent).await.status, Status::Runnable);
    assert_eq!(row(s, kids[2]).await.status, Status::Executing, "left running");
    // The woken parent schedules a second barrier (all of one child).
    let claimed = claim_id(s, ns, parent, at(40)).await;
    let second = Outcome::schedule_children("again", vec![new_in(ns)], ctx(2));
    let receipt = step(s, &claimed, second, at(41)).await;
    let newer = receipt.children[0].id();
    // The left-running child of the first barrier ends: the second barrier still waits.
    end(s, &claims, kids[2], done(), at(50)).await;
    let waiting = row(s, parent).await;
    assert_eq!((waiting.status, waiting.children_pending), (Status::AwaitingChildren, 1));
    let claims = claim_children(s, ns, at(55)).await;
    end(s, &claims, newer, done(), at(60)).await;
    let woken = row(s, parent).await;
    assert_eq!((woken.status, woken.position.as_str()), (Status::Runnable, "again"));
    assert_eq!(wakes(s, parent).await, 2, "one wake per barrier");
}

/// When enough children fail that the quorum cannot be reached, the parent wakes then,
/// and the child still running is cancelled.
pub async fn join_quorum_out_of_reach_wakes_the_parent_at_the_failure<S: Store>(s: &S) {
    let ns = "join_unreachable";
    let (parent, kids) = fan_out(s, ns, 3, Join::quorum(2)).await;
    let claims = claim_children(s, ns, at(25)).await;
    end(s, &claims, kids[0], stop(), at(30)).await;
    assert_eq!(row(s, parent).await.status, Status::AwaitingChildren);
    end(s, &claims, kids[1], stop(), at(31)).await;
    let woken = row(s, parent).await;
    assert_eq!(woken.status, Status::Runnable);
    assert_eq!(join_of(&woken).woke, Some(JoinWoke::Unreachable));
    assert_eq!(row(s, kids[2]).await.status, Status::Cancelled);
}

/// A deadline wakes the parent once when it passes, with the finished child done and the
/// others cancelled; two sweeps at once, and later sweeps, wake it no more.
pub async fn join_deadline_wakes_the_parent_once_with_what_finished<S: Store>(s: &S) {
    let ns = "join_deadline";
    let (parent, kids) = fan_out(s, ns, 3, Join::all().within(Duration::from_secs(60))).await;
    let claims = claim_children(s, ns, at(25)).await;
    end(s, &claims, kids[0], done(), at(30)).await;
    let sweep =
        |now| TimerSweepParams { namespace: Some(ns.into()), machines: vec![], limit: 100, now };
    s.timer_sweep(sweep(at(20 + 59_999))).await.expect("sweep");
    assert_eq!(row(s, parent).await.status, Status::AwaitingChildren, "not due yet");
    let due = at(20 + 60_000);
    let (a, b) = tokio::join!(s.timer_sweep(sweep(due)), s.timer_sweep(sweep(due)));
    a.expect("sweep");
    b.expect("sweep");
    let woken = row(s, parent).await;
    assert_eq!((woken.status, woken.eligible_at), (Status::Runnable, due));
    let state = join_of(&woken);
    assert_eq!((state.woke, state.succeeded, state.unfinished), (Some(JoinWoke::Deadline), 1, 2));
    assert_eq!(row(s, kids[1]).await.status, Status::Cancelled);
    assert_eq!(row(s, kids[2]).await.status, Status::Cancelled);
    s.timer_sweep(sweep(at(200_000))).await.expect("sweep");
    assert_eq!(wakes(s, parent).await, 1, "exactly once");
    assert!(get(s, parent).await.inbox.is_empty(), "a deadline delivers no event");
}

/// A sweep that fires a parent's join deadline together with a timer of a child the
/// deadline cancels (both overdue, as after a sweeper outage) leaves the child cancelled:
/// the timer's fire is delivered first and drained with the cancel, so the child keeps no
/// inbox, its timer is gone and no claim hands it out again.
pub async fn join_deadline_and_a_childs_timer_in_one_sweep_leave_the_child_cancelled<S: Store>(
    s: &S,
) {
    let ns = "join_deadline_child_timer";
    let (parent, kids) = fan_out(s, ns, 1, Join::all().within(Duration::from_secs(60))).await;
    let claims = claim_children(s, ns, at(25)).await;
    // The child parks on any signal with a timer of its own: due at(60_030), after the
    // parent's deadline at(60_020).
    let mut park = StepCommit::new(
        kids[0],
        claims[&kids[0]].token(),
        Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx(2), step: None },
    );
    park.timers_arm = vec![TimerArm {
        state: "start".into(),
        event: "tick".into(),
        kind: TimerKind::After,
        interval: Duration::from_secs(60),
        max: None,
        then: None,
    }];
    commit_ok(s, park, at(30)).await;
    assert_eq!(row(s, kids[0]).await.status, Status::AwaitingSignal);
    let sweep = TimerSweepParams {
        namespace: Some(ns.into()),
        machines: vec![],
        limit: 100,
        now: at(61_000),
    };
    s.timer_sweep(sweep).await.expect("sweep");
    assert_eq!(row(s, parent).await.status, Status::Runnable, "the deadline woke the parent");
    let child = get(s, kids[0]).await;
    assert_eq!(child.instance.status, Status::Cancelled, "the child stays cancelled");
    assert!(child.inbox.is_empty(), "a cancelled child keeps no signal: {:?}", child.inbox);
    assert!(child.timers.is_empty(), "a cancelled child keeps no timer");
    assert!(claim_children(s, ns, at(62_000)).await.is_empty(), "nothing to claim");
}

/// A quorum of 0 or above the children scheduled, or a deadline of zero, is refused naming
/// the field, and nothing is written: the parent still holds its lease and no child exists.
pub async fn join_bad_policies_are_refused_naming_the_field<S: Store>(s: &S) {
    let ns = "join_bad";
    let parent = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let cases = [
        (Join::quorum(0), "outcome.join.quorum: must be at least 1"),
        (Join::quorum(3), "outcome.join.quorum: 3 is more than the 2 children"),
        (Join::all().within(Duration::ZERO), "outcome.join.within: must be positive"),
    ];
    for (join, message) in cases {
        let children = vec![new_in(ns), new_in(ns)];
        let outcome = Outcome::schedule_children("join", children, ctx(1)).with_join(join);
        let refused = commit(s, StepCommit::new(parent, claimed.token(), outcome), at(20)).await;
        let error = refused.expect_err("refused");
        assert_eq!(error.kind, ErrorKind::Invalid);
        assert!(error.message.starts_with(message), "{error}");
    }
    assert_eq!(row(s, parent).await.status, Status::Executing);
    assert!(get(s, parent).await.children.is_empty());
}

/// When a quorum is met by a delegated child (one a chart state started, which reports to
/// its parent's inbox), the cancels of the children still running come first: their
/// reports reach the parent's inbox before the notice of the child that met the quorum.
pub async fn join_cancels_the_rest_before_the_deciding_childs_notice<S: Store>(s: &S) {
    let ns = "join_notice_order";
    let parent = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let children: Vec<NewInstance> = (0..3).map(|_| new_in(ns).invoked_by("join")).collect();
    let outcome = Outcome::schedule_children("join", children, ctx(1)).with_join(Join::quorum(1));
    let kids: Vec<InstanceId> =
        step(s, &claimed, outcome, at(20)).await.children.iter().map(|o| o.id()).collect();
    let claims = claim_children(s, ns, at(25)).await;
    end(s, &claims, kids[1], done(), at(30)).await;
    let d = get(s, parent).await;
    let inbox: Vec<&str> = d.inbox.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(
        inbox,
        ["fail.state.join", "fail.state.join", "done.invoke.join"],
        "the parent's inbox, in order"
    );
    let cancelled: Vec<i64> =
        d.inbox[..2].iter().filter_map(|x| x.payload["child"].as_i64()).collect();
    assert_eq!(cancelled, [kids[0].0, kids[2].0], "one report per cancelled child, in order");
}

/// A parent that schedules delegated children (which report to its inbox) and stops
/// waiting for them — its quorum met by a step commit, put out of reach by an operator's
/// cancel, or its deadline passed in a timer sweep — cancels the rest in the order it
/// scheduled them: their reports reach its inbox in that order, then (for a quorum) the
/// notice of the child that settled it; what the deciding commit emitted comes first.
pub async fn join_cancels_the_rest_in_the_order_the_children_were_scheduled<S: Store>(s: &S) {
    async fn fan_out_delegated<S: Store>(
        s: &S,
        ns: &str,
        join: Join,
    ) -> (InstanceId, Vec<InstanceId>) {
        let parent = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
        let claimed = claim_id(s, ns, parent, at(10)).await;
        let children: Vec<NewInstance> = (0..5).map(|_| new_in(ns).invoked_by("join")).collect();
        let outcome = Outcome::schedule_children("join", children, ctx(1)).with_join(join);
        let receipt = step(s, &claimed, outcome, at(20)).await;
        (parent, receipt.children.iter().map(|o| o.id()).collect())
    }
    /// The parent's inbox, in order: each signal's name, and the child a failure report
    /// names (a done notice carries the child's result instead).
    async fn reports<S: Store>(s: &S, parent: InstanceId) -> Vec<(String, Option<i64>)> {
        let inbox = get(s, parent).await.inbox;
        inbox.iter().map(|x| (x.name.clone(), x.payload["child"].as_i64())).collect()
    }
    let failed = |kid: InstanceId| ("fail.state.join".to_owned(), Some(kid.0));

    let ns = "join_cancel_order_quorum";
    let (parent, kids) = fan_out_delegated(s, ns, Join::quorum(1)).await;
    let claims = claim_children(s, ns, at(25)).await;
    // The deciding child also emits to its parent: a commit's outbox goes before what its
    // release leaves to do.
    let hello = NewSignal::new(parent, "hello");
    let decided = StepCommit::new(kids[2], claims[&kids[2]].token(), done()).emit(hello);
    commit_ok(s, decided, at(30)).await;
    let expected = vec![
        ("hello".to_owned(), None),
        failed(kids[0]),
        failed(kids[1]),
        failed(kids[3]),
        failed(kids[4]),
        ("done.invoke.join".to_owned(), None),
    ];
    assert_eq!(reports(s, parent).await, expected, "the parent's inbox, in order");

    let ns = "join_cancel_order_operator";
    let (parent, kids) = fan_out_delegated(s, ns, Join::quorum(5)).await;
    let cancel = CancelParams {
        id: kids[1],
        reason: "operator".into(),
        cascade: true,
        now: at(30),
        only_in: None,
    };
    s.instance_cancel(cancel).await.expect("cancel one child");
    assert_eq!(row(s, parent).await.status, Status::Runnable, "the quorum is out of reach");
    let expected = [kids[0], kids[2], kids[3], kids[4], kids[1]].map(failed).to_vec();
    assert_eq!(reports(s, parent).await, expected, "the parent's inbox, in order");

    let ns = "join_cancel_order_deadline";
    let (parent, kids) =
        fan_out_delegated(s, ns, Join::all().within(Duration::from_secs(60))).await;
    let sweep = TimerSweepParams {
        namespace: Some(ns.into()),
        machines: vec![],
        limit: 100,
        now: at(20 + 60_000),
    };
    s.timer_sweep(sweep).await.expect("sweep");
    assert_eq!(row(s, parent).await.status, Status::Runnable, "the deadline woke the parent");
    let expected: Vec<_> = kids.iter().map(|k| failed(*k)).collect();
    assert_eq!(reports(s, parent).await, expected, "the parent's inbox, in order");
}

/// A first barrier that settled before its deadline keeps its deadline timer; when it
/// and the second barrier's deadline timer fall due in one sweep, the parent wakes
/// once: one JOIN_WOKE per barrier, the second barrier's children cancelled.
pub async fn join_two_due_deadline_timers_of_one_parent_wake_it_once<S: Store>(s: &S) {
    let ns = "join_two_deadlines";
    let within = || Join::all().within(Duration::from_secs(60));
    let (parent, kids) = fan_out(s, ns, 1, within()).await;
    let claims = claim_children(s, ns, at(25)).await;
    end(s, &claims, kids[0], done(), at(30)).await;
    assert_eq!(row(s, parent).await.status, Status::Runnable, "the first barrier settled");
    // A second barrier with a deadline; the first one's deadline timer is still armed.
    let claimed = claim_id(s, ns, parent, at(40)).await;
    let kids = vec![new_in(ns), new_in(ns)];
    let second = Outcome::schedule_children("again", kids, ctx(2)).with_join(within());
    let receipt = step(s, &claimed, second, at(41)).await;
    let second_kids: Vec<InstanceId> = receipt.children.iter().map(|o| o.id()).collect();
    assert_eq!(get(s, parent).await.timers.len(), 2, "both deadline timers armed");

    let report = s.timer_sweep(sweep(ns, at(61_000))).await.expect("sweep");
    assert_eq!((report.processed, report.fired), (2, 0));
    let detail = get(s, parent).await;
    assert_eq!(wakes(s, parent).await, 2, "one wake per barrier: {:#?}", detail.history);
    assert_eq!(detail.instance.status, Status::Runnable);
    let state = join_of(&detail.instance);
    assert_eq!((state.woke, state.unfinished), (Some(JoinWoke::Deadline), 2));
    for k in second_kids {
        assert_eq!(row(s, k).await.status, Status::Cancelled);
    }
    assert!(detail.timers.is_empty(), "both deadline timers gone");
}

/// A parent's deadline that cancels a child which is itself a parent whose deadline
/// falls due in the same sweep leaves that child cancelled: its deadline is planned
/// from the row as the first one left it, not as read at the pick (which would wake
/// the cancelled child and write it back runnable).
pub async fn join_a_deadline_leaves_a_child_an_earlier_deadline_of_the_sweep_cancelled<S: Store>(
    s: &S,
) {
    let ns = "join_nested_deadlines";
    let within = || Join::all().within(Duration::from_secs(60));
    let (parent, kids) = fan_out(s, ns, 1, within()).await;
    let middle = kids[0];
    let claims = claim_children(s, ns, at(25)).await;
    let inner = Outcome::schedule_children("inner", vec![new_in(ns)], ctx(2)).with_join(within());
    let leaf = step(s, &claims[&middle], inner, at(30)).await.children[0].id();

    // The parent's deadline (due at 60 020) comes first, then the middle one's (60 030).
    let report = s.timer_sweep(sweep(ns, at(61_000))).await.expect("sweep");
    assert_eq!(report.processed, 2);
    let woken = row(s, parent).await;
    assert_eq!(woken.status, Status::Runnable, "the parent's deadline woke it");
    let detail = get(s, middle).await;
    assert_eq!(
        detail.instance.status,
        Status::Cancelled,
        "the cancelled child stays cancelled: {:#?}",
        detail.history
    );
    assert_eq!(wakes(s, middle).await, 0, "a cancelled child is not woken");
    assert_eq!(row(s, leaf).await.status, Status::Cancelled);
}

/// A sweep of `ns`'s timers due at `now`.
fn sweep(ns: &str, now: Timestamp) -> TimerSweepParams {
    TimerSweepParams { namespace: Some(ns.into()), machines: vec![], limit: 100, now }
}
