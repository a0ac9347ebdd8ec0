//! Contracts the chart runtime relies on: parking at a new position, delegated children
//! that report back through the parent's inbox without a barrier, and broadcast to every
//! instance of a machine in a state.

use super::support::{
    at, claim, claim_id, claim_params, commit_ok, ctx, get, insert_one, new_in, row, step,
};
use keel_core::instance::ANY_SIGNAL;
use keel_core::limits;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{
    BroadcastReport, InsertOutcome, InstanceListParams, LeaseReleaseParams, SignalBroadcastParams,
};
use keel_core::{ErrorKind, InstanceId, MachineRef, NewInstance, Status, StepCommit, Timestamp};
use serde_json::json;

fn park_at(step: &str) -> Outcome {
    Outcome::Await { signal: ANY_SIGNAL.into(), context: ctx(1), step: Some(step.into()) }
}

/// `Await` with a step moves the position and parks in one commit.
pub async fn await_with_step_moves_and_parks<S: Store>(s: &S) {
    let ns = "await_step";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    let receipt = step(s, &claimed, park_at(r#"["cart"]"#), at(20)).await;
    assert_eq!(receipt.status, Status::AwaitingSignal);
    let r = row(s, id).await;
    assert_eq!((r.position.as_str(), r.awaits.as_deref()), (r#"["cart"]"#, Some(ANY_SIGNAL)));
}

/// Claims `id` among the rows of `ns` in queue `default` at `now`, releasing the others.
async fn claim_only<S: Store>(
    s: &S,
    ns: &str,
    id: InstanceId,
    now: Timestamp,
) -> keel_core::ports::store::Claim {
    let claims = claim(s, claim_params(ns, 100, now)).await;
    let others =
        claims.iter().filter(|c| c.instance.id != id).map(|c| (c.instance.id, c.token())).collect();
    s.lease_release(LeaseReleaseParams { leases: others, now }).await.expect("release");
    claims.into_iter().find(|c| c.instance.id == id).expect("claimable")
}

/// Spawned children start in the parent's commit without parking it; each one's
/// terminal commit puts `done.invoke.<path>` / `fail.state.<path>` in the parent's inbox
/// (waking it), exactly once, and does not touch a barrier the parent never set.
pub async fn spawned_children_report_to_the_parent_inbox<S: Store>(s: &S) {
    let ns = "spawn_notice";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let kid = |n: i64| {
        NewInstance::new(MachineRef::new("payment", 1), "charge")
            .namespace(ns)
            .context(ctx(n))
            .invoked_by("processing.payment")
    };
    let mut c =
        StepCommit::new(parent, claimed.token(), park_at(r#"["processing","processing.payment"]"#));
    c.spawn = vec![kid(1), kid(2)];
    let receipt = commit_ok(s, c, at(20)).await;
    assert_eq!(receipt.status, Status::AwaitingSignal, "spawning does not park on a barrier");
    let kids: Vec<InstanceId> = receipt.spawned.iter().map(|o| o.id()).collect();
    assert!(receipt.spawned.iter().all(|o| matches!(o, InsertOutcome::Inserted(_))));
    let p = row(s, parent).await;
    assert_eq!(p.children_pending, 0);
    let child = row(s, kids[0]).await;
    assert_eq!(
        (child.parent, child.invoked_by.as_deref()),
        (Some(parent), Some("processing.payment"))
    );

    let c0 = claim_only(s, ns, kids[0], at(30)).await;
    step(s, &c0, Outcome::Done { result: json!({ "charged": 42 }), step: None }, at(40)).await;
    let d = get(s, parent).await;
    assert_eq!(
        d.instance.status,
        Status::Runnable,
        "the notice wakes a parent awaiting any signal"
    );
    assert_eq!(d.inbox.len(), 1);
    assert_eq!(
        (d.inbox[0].name.as_str(), d.inbox[0].payload.clone()),
        ("done.invoke.processing.payment", json!({ "charged": 42 }))
    );

    let c1 = claim_only(s, ns, kids[1], at(50)).await;
    step(s, &c1, Outcome::Stop { reason: "card declined".into() }, at(60)).await;
    let d = get(s, parent).await;
    assert_eq!(d.inbox.len(), 2);
    assert_eq!(d.inbox[1].name, "fail.state.processing.payment");
    assert_eq!(d.inbox[1].payload["error"], json!("card declined"));
    assert_eq!(d.inbox[1].payload["child"], json!(kids[1]));
    assert_eq!(d.instance.children_pending, 0, "never negative");
    assert_eq!(d.children.len(), 2);
}

/// Cancelling a delegated child reports `fail.state.<path>` to its parent.
pub async fn cancelled_child_reports_failure_to_the_parent<S: Store>(s: &S) {
    let ns = "spawn_cancel";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["waiting"]"#));
    c.spawn = vec![new_in(ns).invoked_by("waiting")];
    let kid = commit_ok(s, c, at(20)).await.spawned[0].id();
    let params = keel_core::ports::store::CancelParams {
        id: kid,
        reason: "operator".into(),
        cascade: false,
        now: at(30),
        only_in: None,
    };
    assert_eq!(s.instance_cancel(params).await.expect("cancel"), vec![kid]);
    let d = get(s, parent).await;
    assert_eq!(d.inbox.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["fail.state.waiting"]);
    assert_eq!(d.inbox[0].payload["status"], json!("cancelled"));
    assert_eq!(d.instance.status, Status::Runnable);
}

/// A child's notice of its end still unread when a commit leaves the delegation state
/// that started it is stale: the commit takes it out of the inbox
/// (`CHILD_NOTICE_WITHDRAWN`), so the parent never handles the end of work it left, and
/// it wakes nothing. A notice about a delegation state the commit keeps stays. Here the
/// children end while the parent runs the step that leaves `pay`.
pub async fn child_notice_unread_when_its_state_is_left_is_withdrawn<S: Store>(s: &S) {
    let ns = "notice_withdrawn";
    let mut parents = Vec::new();
    for spawned in [&["pay"][..], &["pay", "ship"]] {
        let parent = insert_one(s, new_in(ns), at(0)).await;
        let claimed = claim_id(s, ns, parent, at(10)).await;
        let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["pay"]"#));
        c.spawn = spawned.iter().map(|state| new_in(ns).invoked_by(*state)).collect();
        let kids: Vec<InstanceId> =
            commit_ok(s, c, at(20)).await.spawned.iter().map(|k| k.id()).collect();
        super::support::send(s, parent, "CANCEL", at(30)).await;
        parents.push((parent, claim_only(s, ns, parent, at(40)).await, kids));
    }
    for (_, _, kids) in &parents {
        for kid in kids {
            let c = claim_only(s, ns, *kid, at(50)).await;
            step(s, &c, Outcome::Stop { reason: "declined".into() }, at(60)).await;
        }
    }
    for (parent, claimed, _) in &parents {
        assert_eq!(claimed.inbox.len(), 1, "the step read CANCEL only");
        let mut c = StepCommit::new(*parent, claimed.token(), park_at(r#"["manual"]"#))
            .consume(claimed.inbox.iter().map(|s| s.id));
        c.children_cancel = vec!["pay".into()];
        commit_ok(s, c, at(70)).await;
    }
    let d = get(s, parents[0].0).await;
    assert!(d.inbox.is_empty(), "the stale fail.state.pay is gone: {:?}", d.inbox);
    assert_eq!(d.instance.status, Status::AwaitingSignal, "a withdrawn notice wakes nothing");
    let withdrawn: Vec<_> =
        d.history.iter().filter(|h| h.entry.kind == "CHILD_NOTICE_WITHDRAWN").collect();
    assert_eq!(withdrawn.len(), 1, "{:?}", d.history);
    assert_eq!(withdrawn[0].entry.data["event"], json!("fail.state.pay"));
    assert_eq!(withdrawn[0].entry.data["state"], json!("pay"));

    let d = get(s, parents[1].0).await;
    let names: Vec<&str> = d.inbox.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["fail.state.ship"], "a notice about a state not left stays");
    assert_eq!(d.instance.status, Status::Runnable, "and wakes the parent");
}

/// A signal sent while a step runs wakes the instance that step parks, also when the
/// commit leaves a delegation state and cancels timers (and so asks which unread signals
/// are fires or notices to withdraw): a signal without a dedup key is neither.
pub async fn a_signal_sent_during_a_step_that_withdraws_fires_still_wakes<S: Store>(s: &S) {
    let ns = "plain_signal_withdraw";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(10)).await;
    super::support::send(s, id, "APPROVE", at(20)).await;
    let mut c = StepCommit::new(id, claimed.token(), park_at(r#"["manual"]"#));
    c.children_cancel = vec!["paying".into()];
    c.timers_cancel = vec!["paying".into()];
    commit_ok(s, c, at(30)).await;
    let d = get(s, id).await;
    let names: Vec<&str> = d.inbox.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["APPROVE"], "nothing withdrawn");
    assert_eq!(d.instance.status, Status::Runnable, "the unread APPROVE wakes the instance");
}

/// Broadcast reaches every non-terminal instance of the machine in the state (by step
/// name, or inside a chart's configuration array), one that is running a step included,
/// and wakes those waiting for it.
pub async fn broadcast_reaches_instances_in_state<S: Store>(s: &S) {
    let ns = "broadcast";
    let parked = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parked, at(1)).await;
    step(s, &claimed, park_at(r#"["open","open.idle"]"#), at(2)).await;
    let runnable = insert_one(s, new_in(ns).context(ctx(2)), at(3)).await;
    let elsewhere =
        insert_one(s, NewInstance::new(MachineRef::new("order", 1), "closed").namespace(ns), at(4))
            .await;
    let finished = insert_one(s, new_in(ns), at(5)).await;
    let c = claim_only(s, ns, finished, at(6)).await;
    step(s, &c, Outcome::Done { result: json!(null), step: None }, at(7)).await;
    let other_machine = insert_one(
        s,
        NewInstance::new(MachineRef::new("invoice", 1), "open.idle").namespace(ns),
        at(8),
    )
    .await;
    // `new_in` starts at step "a": put the runnable one "in" open.idle by position.
    let c = claim_only(s, ns, runnable, at(9)).await;
    step(s, &c, Outcome::Next { step: "open.idle".into(), context: ctx(2) }, at(10)).await;
    // ...and is running its step when the broadcast comes: it gets the event all the same.
    let running = claim_only(s, ns, runnable, at(11)).await;

    let params = |state: &str| SignalBroadcastParams {
        namespace: ns.into(),
        machine: "order".into(),
        in_state: Some(state.into()),
        name: "PRICE_CHANGED".into(),
        payload: json!({ "pct": 5 }),
        dedup_key: Some("price:1".into()),
        now: at(20),
    };
    let report = s.signal_broadcast(params("open.idle")).await.expect("broadcast");
    assert_eq!((report.matched, report.delivered, report.woke), (2, 2, 1));
    assert_eq!(row(s, parked).await.status, Status::Runnable);
    assert_eq!(row(s, running.instance.id).await.status, Status::Executing);
    for (id, n) in [(parked, 1), (runnable, 1), (elsewhere, 0), (finished, 0), (other_machine, 0)] {
        assert_eq!(get(s, id).await.inbox.len(), n, "inbox of {id}");
    }
    let again = s.signal_broadcast(params("open.idle")).await.expect("broadcast");
    assert_eq!((again.matched, again.delivered), (2, 0), "the dedup key holds per target");
    let nobody = s.signal_broadcast(params("shipped")).await.expect("broadcast");
    assert_eq!(nobody, BroadcastReport::default(), "no instance in that state");
    let bad = SignalBroadcastParams { name: String::new(), ..params("open") };
    assert_eq!(s.signal_broadcast(bad).await.expect_err("empty name").kind, ErrorKind::Invalid);
}

/// `instance_list` pages a namespace's instances newest first, narrowed by machine, status,
/// state (a step's name, or a path in a chart's active configuration, as a broadcast reads
/// it) and business key; `before` continues after a page; other namespaces never show; a
/// page size of 0 or over the bound is refused naming `limit`.
pub async fn instance_list_filters_and_pages<S: Store>(s: &S) {
    let ns = "listing";
    let parked = insert_one(s, new_in(ns).business_key("k-parked"), at(0)).await;
    let claimed = claim_id(s, ns, parked, at(1)).await;
    step(s, &claimed, park_at(r#"["open","open.idle"]"#), at(2)).await;
    let fresh = insert_one(s, new_in(ns).business_key("k-fresh"), at(3)).await;
    let invoice =
        insert_one(s, NewInstance::new(MachineRef::new("invoice", 1), "open").namespace(ns), at(4))
            .await;
    let hidden = insert_one(s, new_in("listing_other").business_key("k-fresh"), at(5)).await;
    let list = |f: &dyn Fn(&mut InstanceListParams)| {
        let mut p = InstanceListParams { namespace: ns.into(), limit: 10, ..Default::default() };
        f(&mut p);
        p
    };
    let ids = |rows: Vec<keel_core::Instance>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let all = s.instance_list(list(&|_| {})).await.expect("list");
    assert_eq!(ids(all.clone()), vec![invoice, fresh, parked], "newest first, one namespace");
    assert_eq!(all[2], row(s, parked).await, "the same row instance_get reads");
    assert!(!ids(all).contains(&hidden));
    let by_machine = s.instance_list(list(&|p| p.machine = Some("invoice".into()))).await;
    assert_eq!(ids(by_machine.expect("machine")), vec![invoice]);
    let by_status = s.instance_list(list(&|p| p.status = Some(Status::AwaitingSignal))).await;
    assert_eq!(ids(by_status.expect("status")), vec![parked]);
    let by_path = s.instance_list(list(&|p| p.state = Some("open.idle".into()))).await;
    assert_eq!(ids(by_path.expect("chart path")), vec![parked]);
    let by_state = s.instance_list(list(&|p| p.state = Some("open".into()))).await;
    assert_eq!(ids(by_state.expect("step or path")), vec![invoice, parked]);
    let by_key = s.instance_list(list(&|p| p.business_key = Some("k-fresh".into()))).await;
    assert_eq!(ids(by_key.expect("key")), vec![fresh]);
    let page1 = s.instance_list(list(&|p| p.limit = 2)).await.expect("page 1");
    assert_eq!(ids(page1.clone()), vec![invoice, fresh]);
    let next = page1.last().map(|r| r.id);
    let page2 = s.instance_list(list(&|p| (p.limit, p.before) = (2, next))).await;
    assert_eq!(ids(page2.expect("page 2")), vec![parked]);
    for limit in [0, limits::INSTANCE_LIST_MAX + 1] {
        let err = s.instance_list(list(&|p| p.limit = limit)).await.expect_err("bad limit");
        assert_eq!(err.kind, ErrorKind::Invalid);
        assert!(err.message.contains("limit"), "the error names the field: {err}");
    }
    let err = s.instance_list(list(&|p| p.namespace.clear())).await.expect_err("no namespace");
    assert!(err.message.contains("namespace"), "the error names the field: {err}");
}

/// The children of a delegation state a commit keeps do not crowd out those of the state
/// it leaves: with a full step's worth of children started from a kept state (lower ids),
/// leaving another state still cancels that state's child.
pub async fn leaving_a_delegation_state_cancels_its_child_behind_many_kept_ones<S: Store>(s: &S) {
    let ns = "spawn_leave_many";
    // The children run in a namespace of their own, so claims in `ns` find the parent.
    let kids = "spawn_leave_many_kids";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["working"]"#));
    c.spawn = (0..limits::CHILDREN_PER_STEP_MAX).map(|_| new_in(kids).invoked_by("kept")).collect();
    let kept = commit_ok(s, c, at(20)).await.spawned[0].id();
    super::support::send(s, parent, "GO", at(30)).await;
    let woken = claim_only(s, ns, parent, at(40)).await;
    let mut c = StepCommit::new(parent, woken.token(), park_at(r#"["paying"]"#));
    c.consume = woken.inbox.iter().map(|s| s.id).collect();
    c.spawn = vec![new_in(kids).invoked_by("paying")];
    let paying = commit_ok(s, c, at(50)).await.spawned[0].id();
    super::support::send(s, parent, "GIVE_UP", at(60)).await;
    let woken = claim_only(s, ns, parent, at(70)).await;
    let mut c = StepCommit::new(parent, woken.token(), park_at(r#"["manual"]"#));
    c.consume = woken.inbox.iter().map(|s| s.id).collect();
    c.children_cancel = vec!["paying".into()];
    commit_ok(s, c, at(80)).await;
    assert_eq!(row(s, paying).await.status, Status::Cancelled, "the left state's child goes");
    assert_eq!(row(s, kept).await.status, Status::Runnable, "the kept state's children stay");
}

/// A commit that leaves a delegation state and enters it again (a retry after the state's
/// `@timeout`) cancels the child the state had and keeps the one the same commit starts
/// for it.
pub async fn a_retried_delegation_state_cancels_its_old_child_and_keeps_the_new<S: Store>(s: &S) {
    let ns = "spawn_retry";
    let kids = "spawn_retry_kids";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["paying"]"#));
    c.spawn = vec![new_in(kids).invoked_by("paying")];
    let old = commit_ok(s, c, at(20)).await.spawned[0].id();
    super::support::send(s, parent, "DEADLINE", at(30)).await;
    let woken = claim_only(s, ns, parent, at(40)).await;
    let mut c = StepCommit::new(parent, woken.token(), park_at(r#"["paying"]"#));
    c.consume = woken.inbox.iter().map(|s| s.id).collect();
    c.spawn = vec![new_in(kids).invoked_by("paying")];
    c.children_cancel = vec!["paying".into()];
    let new = commit_ok(s, c, at(50)).await.spawned[0].id();
    assert_ne!(old, new);
    assert_eq!(row(s, old).await.status, Status::Cancelled, "the timed-out child goes");
    assert_eq!(row(s, new).await.status, Status::Runnable, "the retry's child runs");
    let p = get(s, parent).await;
    assert_eq!(p.instance.status, Status::AwaitingSignal);
    assert!(p.inbox.is_empty(), "no notice of the old child's cancel: {:?}", p.inbox);
}

/// A commit that leaves a delegation state cancels, in the same transaction, the live
/// child machines the instance started from it, with their descendants; the parent hears
/// nothing of it through its inbox (it left that state). A cancelled child's running step
/// cannot commit afterwards, and children started from another state are left alone.
pub async fn leaving_a_delegation_state_cancels_its_children<S: Store>(s: &S) {
    let ns = "spawn_leave";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["paying"]"#));
    c.spawn = vec![new_in(ns).invoked_by("paying"), new_in(ns).invoked_by("shipping")];
    let kids: Vec<InstanceId> =
        commit_ok(s, c, at(20)).await.spawned.iter().map(|o| o.id()).collect();
    let (paying, shipping) = (kids[0], kids[1]);
    // The paying child is mid-step and has started a child of its own.
    let running = claim_only(s, ns, paying, at(30)).await;
    let next = Outcome::Next { step: "charge".into(), context: ctx(2) };
    let mut c = StepCommit::new(paying, running.token(), next);
    c.spawn = vec![new_in(ns).invoked_by("charging")];
    let grandchild = commit_ok(s, c, at(35)).await.spawned[0].id();
    let running = claim_only(s, ns, paying, at(36)).await;

    // The parent's deadline fires: it leaves `paying` for `cancelled_order`.
    super::support::send(s, parent, "DEADLINE", at(40)).await;
    let woken = claim_only(s, ns, parent, at(50)).await;
    let mut c = StepCommit::new(parent, woken.token(), park_at(r#"["cancelled_order"]"#));
    c.consume = woken.inbox.iter().map(|s| s.id).collect();
    c.children_cancel = vec!["paying".into()];
    commit_ok(s, c, at(60)).await;

    for id in [paying, grandchild] {
        let r = row(s, id).await;
        assert_eq!(r.status, Status::Cancelled, "instance {id} is cancelled with the state");
        assert_eq!(r.lease_owner, None);
    }
    assert!(
        row(s, paying).await.last_error.as_deref().is_some_and(|e| e.contains("`paying`")),
        "the reason names the state left"
    );
    assert_ne!(row(s, shipping).await.status, Status::Cancelled, "another state's child stays");
    let p = get(s, parent).await;
    assert_eq!(p.instance.status, Status::AwaitingSignal);
    assert!(p.inbox.is_empty(), "no notice for a state already left: {:?}", p.inbox);

    let late = StepCommit::new(
        paying,
        running.token(),
        Outcome::Done { result: json!({ "charged": true }), step: None },
    );
    let refused = super::support::commit(s, late, at(70)).await;
    assert_eq!(refused.expect_err("the child was cancelled").kind, ErrorKind::LeaseLost);
    assert_eq!(row(s, paying).await.status, Status::Cancelled);

    let other = insert_one(s, new_in(ns).context(ctx(9)), at(75)).await;
    let held = claim_only(s, ns, other, at(76)).await;
    let mut bad = StepCommit::new(other, held.token(), park_at(r#"["x"]"#));
    bad.children_cancel = vec![String::new()];
    let refused = super::support::commit(s, bad, at(80)).await;
    let err = refused.expect_err("an empty state name");
    assert!(err.message.contains("children_cancel[0]"), "{}", err.message);
    assert_eq!(row(s, other).await.status, Status::Executing, "a refused commit writes nothing");
}

/// An instance that fails takes its live delegated children with it (and their
/// descendants); children it started without a delegation state are left alone.
pub async fn failing_instance_cancels_its_delegated_children<S: Store>(s: &S) {
    let ns = "spawn_fail";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["paying"]"#));
    c.spawn = vec![new_in(ns).invoked_by("paying"), new_in(ns)];
    let kids: Vec<InstanceId> =
        commit_ok(s, c, at(20)).await.spawned.iter().map(|o| o.id()).collect();
    super::support::send(s, parent, "BROKEN", at(30)).await;
    let woken = claim_only(s, ns, parent, at(40)).await;
    step(s, &woken, Outcome::Stop { reason: "bad order".into() }, at(50)).await;
    assert_eq!(row(s, parent).await.status, Status::Failed);
    let delegated = row(s, kids[0]).await;
    assert_eq!(delegated.status, Status::Cancelled);
    assert!(delegated.last_error.as_deref().is_some_and(|e| e.contains("failed")));
    assert_eq!(row(s, kids[1]).await.status, Status::Runnable, "a plain child runs on");
}

/// A signal addressed to the child a parent started from a delegation state reaches the
/// newest such child, from a step commit's outbox or a plain send; with no such child the
/// emit refuses the commit, and a plain send reports it missing.
pub async fn signals_reach_a_delegated_child<S: Store>(s: &S) {
    use keel_core::instance::SignalTarget;
    let ns = "to_child";
    let parent = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let mut c = StepCommit::new(parent, claimed.token(), park_at(r#"["paying"]"#));
    c.spawn = vec![new_in(ns).invoked_by("paying"), new_in(ns).invoked_by("shipping")];
    let kids: Vec<InstanceId> =
        commit_ok(s, c, at(20)).await.spawned.iter().map(|o| o.id()).collect();
    let to = |state: &str| SignalTarget::Child { parent, state: state.into() };

    super::support::send(s, parent, "NUDGE", at(30)).await;
    let woken = claim_only(s, ns, parent, at(40)).await;
    let mut c = StepCommit::new(parent, woken.token(), park_at(r#"["paying"]"#));
    c.consume = woken.inbox.iter().map(|s| s.id).collect();
    c.emit = vec![keel_core::NewSignal::new(to("paying"), "CAPTURE").payload(json!(7))];
    commit_ok(s, c, at(50)).await;
    let inbox = get(s, kids[0]).await.inbox;
    assert_eq!(inbox.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["CAPTURE"]);
    assert!(get(s, kids[1]).await.inbox.is_empty(), "only the paying child");

    super::support::send(s, parent, "NUDGE", at(60)).await;
    let woken = claim_only(s, ns, parent, at(70)).await;
    let mut c = StepCommit::new(parent, woken.token(), park_at(r#"["paying"]"#));
    c.emit = vec![keel_core::NewSignal::new(to("refunding"), "CAPTURE")];
    let refused = super::support::commit(s, c, at(80)).await;
    assert_eq!(refused.expect_err("no such child").kind, ErrorKind::NotFound);

    assert_eq!(s.instance_lookup(to("shipping")).await.expect("lookup"), Some(kids[1]));
    let outside = SignalTarget::Child { parent: kids[0], state: "paying".into() };
    assert_eq!(s.instance_lookup(outside).await.expect("lookup"), None);
}
