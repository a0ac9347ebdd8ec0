//! Contracts for the operator's views: a machine's instances by page, what ended in a
//! window (throughput and turnaround), and the registry of workers seen by heartbeat.

use super::support::{
    at, claim, claim_id, claim_params, done, expect_kind, insert_one, new_in, next, step, worker,
};
use keel_core::ErrorKind;
use keel_core::ids::{InstanceId, MachineRef, Status};
use keel_core::limits::INSTANCE_LIST_MAX;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{ActivityParams, InstanceListParams, WorkerBeatParams};
use std::time::Duration;

fn list(ns: &str, limit: usize) -> InstanceListParams {
    InstanceListParams {
        namespace: ns.to_owned(),
        machine: Some("order".to_owned()),
        limit,
        ..InstanceListParams::default()
    }
}

fn ids(rows: &[keel_core::Instance]) -> Vec<InstanceId> {
    rows.iter().map(|r| r.id).collect()
}

/// Listing pages newest first, filters by status and state (a step's name or a chart
/// state in a JSON position), stays in its namespace and machine, and refuses a page size
/// out of range naming the field.
pub async fn instance_list_pages_newest_first_with_filters<S: Store>(s: &S) {
    let ns = "instance_list";
    let first = insert_one(s, new_in(ns), at(0)).await;
    let second = insert_one(s, new_in(ns), at(1)).await;
    let third = insert_one(s, new_in(ns), at(2)).await;
    insert_one(s, new_in("instance_list_other"), at(3)).await;
    let other_machine = keel_core::NewInstance::new(MachineRef::new("invoice", 1), "start")
        .namespace(ns)
        .context(serde_json::json!({}));
    insert_one(s, other_machine, at(4)).await;
    let claimed = claim_id(s, ns, first, at(10)).await;
    step(s, &claimed, next("pack", 1), at(20)).await;

    // The ids of a page: `ns`, machine `order`, newest first, narrowed by `narrow`.
    let listed = |narrow: &dyn Fn(&mut InstanceListParams), limit: usize| {
        let mut p = list(ns, limit);
        narrow(&mut p);
        async move { ids(&s.instance_list(p).await.expect("instance_list")) }
    };
    let all = |_: &mut InstanceListParams| {};
    assert_eq!(
        listed(&all, 10).await,
        [third, second, first],
        "newest first, one namespace, one machine"
    );
    assert_eq!(listed(&all, 2).await, [third, second]);
    let below_second = |p: &mut InstanceListParams| p.before = Some(second);
    assert_eq!(listed(&below_second, 2).await, [first], "the next page starts below the last id");
    let packing = |p: &mut InstanceListParams| p.state = Some("pack".into());
    assert_eq!(listed(&packing, 10).await, [first]);
    let runnable = |p: &mut InstanceListParams| p.status = Some(Status::Runnable);
    assert_eq!(listed(&runnable, 10).await, [third, second, first]);

    let claimed = claim_id(s, ns, second, at(30)).await;
    let chart_position = Outcome::Next {
        step: r#"["shipping.boxed","billing"]"#.into(),
        context: serde_json::json!({}),
    };
    step(s, &claimed, chart_position, at(40)).await;
    let billing = |p: &mut InstanceListParams| p.state = Some("billing".into());
    assert_eq!(listed(&billing, 10).await, [second], "a chart state inside a JSON position");
    let executing = |p: &mut InstanceListParams| p.status = Some(Status::Executing);
    assert!(listed(&executing, 10).await.is_empty());

    // Executing instances are listed with the rest, in id order, and by their status and
    // state.
    claim_id(s, ns, third, at(50)).await;
    // The other machine's instance is older than `first`: both go.
    let taken = claim(s, claim_params(ns, 2, at(51))).await;
    assert_eq!(taken.last().map(|c| c.instance.id), Some(first));
    assert_eq!(listed(&all, 10).await, [third, second, first], "executing ones too");
    assert_eq!(listed(&all, 2).await, [third, second]);
    assert_eq!(listed(&below_second, 2).await, [first], "an executing one below the cursor");
    assert_eq!(listed(&executing, 10).await, [third, first]);
    assert_eq!(listed(&runnable, 10).await, [second]);
    assert_eq!(listed(&billing, 10).await, [second]);
    assert_eq!(listed(&packing, 10).await, [first]);

    expect_kind(s.instance_list(list(ns, 0)).await, ErrorKind::Invalid, "limit 0");
    expect_kind(
        s.instance_list(list(ns, INSTANCE_LIST_MAX + 1)).await,
        ErrorKind::Invalid,
        "limit over the bound",
    );
    let e = s.instance_list(list(ns, 0)).await.unwrap_err();
    assert!(e.message.contains("limit"), "the error names the field: {e}");
}

/// Activity counts done and failed instances by the time they ended, per machine and
/// bucket, with the sum of their turnaround; cancelled, unfinished and out-of-window
/// instances do not count.
pub async fn instance_activity_counts_ended_instances_per_bucket<S: Store>(s: &S) {
    let ns = "activity";
    let finish = |outcome: Outcome, start: i64, end: i64| async move {
        let id = insert_one(s, new_in(ns), at(start)).await;
        let claimed = claim_id(s, ns, id, at(end - 1)).await;
        step(s, &claimed, outcome, at(end)).await;
        id
    };
    let stop = || Outcome::Stop { reason: "no stock".into() };
    finish(done(), 0, 1_000).await; // bucket 0, 1 s
    finish(done(), 500, 3_500).await; // bucket 0, 3 s
    finish(stop(), 60_000, 61_000).await; // bucket 1, 1 s
    finish(done(), 0, 200_000).await; // outside the window
    insert_one(s, new_in(ns), at(5)).await; // unfinished
    let cancelled = insert_one(s, new_in(ns), at(6)).await;
    s.instance_cancel(keel_core::ports::store::CancelParams {
        id: cancelled,
        reason: "operator".into(),
        cascade: false,
        now: at(7),
        only_in: None,
    })
    .await
    .expect("cancel");

    let params = ActivityParams {
        namespace: Some(ns.into()),
        since: at(0),
        until: at(120_000),
        bucket: Duration::from_secs(60),
    };
    let buckets = s.instance_activity(params.clone()).await.expect("instance_activity");
    let got: Vec<_> = buckets
        .iter()
        .map(|b| (b.machine.as_str(), b.bucket, b.completed, b.failed, b.turnaround_ms_total))
        .collect();
    assert_eq!(got, [("order", 0, 2, 0, 4_000), ("order", 1, 0, 1, 1_000)]);
    let elsewhere = ActivityParams { namespace: Some("activity_none".into()), ..params.clone() };
    assert!(s.instance_activity(elsewhere).await.expect("other namespace").is_empty());

    let too_fine = ActivityParams { bucket: Duration::from_millis(10), ..params.clone() };
    expect_kind(s.instance_activity(too_fine).await, ErrorKind::Invalid, "bucket under 1 s");
    let too_many = ActivityParams { until: at(60_000 * 2_000), ..params };
    expect_kind(s.instance_activity(too_many).await, ErrorKind::Invalid, "too many buckets");
}

fn beat(id: &str, machines: Vec<MachineRef>, now: i64) -> WorkerBeatParams {
    WorkerBeatParams {
        id: worker(id),
        name: format!("host-{id}"),
        machines,
        namespaces: vec!["registry".into()],
        started_at: at(0),
        now: at(now),
        forget_before: at(now - 86_400_000),
    }
}

/// A heartbeat records a worker and updates it in place; the list holds those seen since
/// a time, most recent first; long-silent workers are forgotten; bad names are refused.
pub async fn worker_heartbeat_records_and_lists_live_workers<S: Store>(s: &S) {
    let v1 = MachineRef::new("order", 1);
    let v2 = MachineRef::new("order", 2);
    s.worker_heartbeat(beat("w-a", vec![v1.clone()], 1_000)).await.expect("beat a");
    s.worker_heartbeat(beat("w-b", vec![v2.clone()], 2_000)).await.expect("beat b");
    s.worker_heartbeat(beat("w-a", vec![v1.clone(), v2.clone()], 3_000)).await.expect("again");

    let all = s.worker_list(at(0)).await.expect("worker_list");
    let got: Vec<_> = all.iter().map(|w| (w.id.0.as_str(), w.last_seen_at)).collect();
    assert_eq!(got, [("w-a", at(3_000)), ("w-b", at(2_000))], "most recently seen first");
    assert_eq!(all[0].machines, [v1.clone(), v2.clone()], "the newest beat's machines");
    assert_eq!((all[0].name.as_str(), all[0].started_at), ("host-w-a", at(0)));
    assert!(all[0].serves("registry", &v2) && !all[0].serves("elsewhere", &v2));

    let live = s.worker_list(at(2_500)).await.expect("recent");
    assert_eq!(live.len(), 1, "only workers seen since the cut-off");

    // A beat a day later forgets the workers silent since before then.
    s.worker_heartbeat(beat("w-c", vec![v1], 2_000 + 86_400_000 + 1)).await.expect("beat c");
    let left: Vec<_> =
        s.worker_list(at(0)).await.expect("after").into_iter().map(|w| w.id.0).collect();
    assert_eq!(left, ["w-c", "w-a"]);

    let mut bad = beat("w-d", Vec::new(), 5_000);
    bad.name = String::new();
    expect_kind(s.worker_heartbeat(bad).await, ErrorKind::Invalid, "empty name");
    assert_eq!(s.worker_list(at(0)).await.expect("unchanged").len(), 2, "nothing stored");
}
