//! Contracts for operator calls and limits: cancel (with cascade), inspect and lookup,
//! payload size and batch bounds.

use super::support::{
    at, claim, claim_id, claim_params, commit, ctx, deliver, done, expect_kind, get, insert,
    insert_one, new_in, order, row, send, step,
};
use keel_core::instance::{NewSignal, SignalTarget};
use keel_core::limits;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, CommitParams, InsertOutcome, InsertParams, LeaseReapParams, SignalDeliverParams,
};
use keel_core::{ErrorKind, InstanceId, NewInstance, Priority, Status, StepCommit, Timestamp};
use serde_json::{Value, json};
use std::collections::BTreeSet;

fn cancel(id: InstanceId, cascade: bool, now: Timestamp) -> CancelParams {
    CancelParams { id, reason: "operator".into(), cascade, now, only_in: None }
}

fn schedule(ns: &str, n: usize) -> Outcome {
    Outcome::ScheduleChildren {
        next: "join".into(),
        children: vec![new_in(ns).queue("kids"); n],
        context: ctx(1),
        join: keel_core::join::Join::default(),
    }
}

/// Cancel with cascade cancels every non-terminal descendant; each cancelled child
/// releases its parent's barrier, and cancelling a lone child releases a waiting parent.
pub async fn cancel_cascade_releases_parent_barrier<S: Store>(s: &S) {
    let ns = "cancel_cascade";
    let p = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, p, at(10)).await;
    let kids: Vec<InstanceId> =
        step(s, &claimed, schedule(ns, 2), at(20)).await.children.iter().map(|c| c.id()).collect();
    let c1 = claim_id(s, ns, kids[0], at(30)).await;
    let grandkids: Vec<InstanceId> =
        step(s, &c1, schedule(ns, 1), at(40)).await.children.iter().map(|c| c.id()).collect();
    assert_eq!(
        s.instance_cancel(cancel(kids[1], false, at(50))).await.expect("cancel"),
        vec![kids[1]]
    );
    let parent = row(s, p).await;
    assert_eq!(
        (parent.status, parent.children_pending),
        (Status::AwaitingChildren, 1),
        "a cancelled child did not count"
    );
    let cancelled: BTreeSet<_> =
        s.instance_cancel(cancel(p, true, at(60))).await.expect("cancel").into_iter().collect();
    assert_eq!(cancelled, BTreeSet::from([p, kids[0], grandkids[0]]));
    for id in [p, kids[0], grandkids[0]] {
        let d = get(s, id).await;
        assert_eq!(
            (d.instance.status, d.instance.last_error.as_deref()),
            (Status::Cancelled, Some("operator"))
        );
        assert_eq!(d.history.last().map(|h| h.entry.kind.as_str()), Some("CANCELLED"));
    }
    assert_eq!(
        row(s, kids[0]).await.children_pending,
        0,
        "the grandchild did not count on its parent"
    );

    let lone = insert_one(s, new_in(ns).queue("solo"), at(100)).await;
    let mut params = claim_params(ns, 1, at(110));
    params.queues = vec!["solo".into()];
    let claimed = claim(s, params).await.remove(0);
    assert_eq!(claimed.instance.id, lone);
    let kid = step(s, &claimed, schedule(ns, 1), at(120)).await.children[0].id();
    s.instance_cancel(cancel(kid, false, at(130))).await.expect("cancel");
    let released = row(s, lone).await;
    assert_eq!(
        (released.status, released.position.as_str(), released.eligible_at),
        (Status::Runnable, "join", at(130))
    );
}

/// The ids of the children a step schedules.
async fn children<S: Store>(
    s: &S,
    claimed: &keel_core::ports::store::Claim,
    n: usize,
    ns: &str,
    at_ms: i64,
) -> Vec<InstanceId> {
    step(s, claimed, schedule(ns, n), at(at_ms)).await.children.iter().map(|c| c.id()).collect()
}

/// Whether `d` was cancelled by the operator's cancel, reached from `from` (`None`: the
/// cancel named it), as its history's one `CANCELLED` entry records.
fn cancelled_from(d: &keel_core::ports::store::InstanceDetail, from: Option<InstanceId>) -> bool {
    let cancels: Vec<_> = d.history.iter().filter(|h| h.entry.kind == "CANCELLED").collect();
    d.instance.status == Status::Cancelled
        && d.instance.last_error.as_deref() == Some("operator")
        && cancels.len() == 1
        && cancels[0].entry.data["cascade_from"] == json!(from.map(|f| f.0))
}

/// A cascade over a wide tree cancels every live descendant in one call — the children of
/// a parent with the most children one step may start, and a live grandchild under a child
/// that had already ended — and nothing outside the tree: the root's sibling and an
/// unrelated instance stay as they were, and the root's parent only counts the root as
/// ended.
pub async fn cancel_cascade_reaches_every_live_descendant_of_a_wide_tree<S: Store>(s: &S) {
    let ns = "cancel_wide";
    let top = insert_one(s, new_in(ns), at(0)).await;
    let unrelated = insert_one(s, new_in(ns).queue("other"), at(0)).await;
    let claimed = claim_id(s, ns, top, at(10)).await;
    let pair = children(s, &claimed, 2, ns, 20).await;
    let mut params = claim_params(ns, 2, at(30));
    params.queues = vec!["kids".into()];
    let both = claim(s, params).await;
    let (root, sibling) = (&both[0], &both[1]);
    assert_eq!(BTreeSet::from([root.instance.id, sibling.instance.id]), BTreeSet::from_iter(pair));
    let kids = children(s, root, limits::CHILDREN_PER_STEP_MAX, ns, 40).await;
    let mut params = claim_params(ns, 1, at(50));
    params.queues = vec!["kids".into()];
    let first = claim(s, params).await.remove(0);
    assert_eq!(first.instance.id, kids[0], "the oldest child is claimed first");
    let grandkid = children(s, &first, 1, ns, 60).await[0];
    s.instance_cancel(cancel(kids[0], false, at(70))).await.expect("cancel");
    send(s, kids[1], "go", at(80)).await;
    let sibling_before = get(s, sibling.instance.id).await;
    let unrelated_before = get(s, unrelated).await;
    let top_before = row(s, top).await;

    let root_id = root.instance.id;
    let cancelled: BTreeSet<_> = s
        .instance_cancel(cancel(root_id, true, at(100)))
        .await
        .expect("cancel")
        .into_iter()
        .collect();
    let mut want: BTreeSet<_> = kids[1..].iter().copied().collect();
    want.extend([root_id, grandkid]);
    assert_eq!(cancelled.len(), want.len(), "how many the cascade cancelled");
    assert_eq!(cancelled, want, "the live tree, and nothing else");
    assert!(cancelled_from(&get(s, root_id).await, None), "the root records its own cancel");
    for id in [kids[1], kids[kids.len() - 1], grandkid] {
        let d = get(s, id).await;
        assert!(cancelled_from(&d, Some(root_id)), "{id} records the cascade: {:?}", d.history);
        assert!(d.inbox.is_empty(), "{id} keeps no inbox");
    }
    let drained = get(s, kids[1]).await.history;
    assert!(
        drained.iter().any(|h| h.entry.kind == keel_core::inbox::INBOX_DRAINED),
        "the unread signal is recorded as drained"
    );
    for chunk in kids[1..].chunks(limits::ROWS_BATCH_MAX) {
        for r in s.instance_rows(chunk.to_vec()).await.expect("instance_rows") {
            assert_eq!(r.status, Status::Cancelled, "child {}", r.id);
        }
    }
    let ended = get(s, kids[0]).await;
    let cancels = ended.history.iter().filter(|h| h.entry.kind == "CANCELLED").count();
    assert_eq!(
        (ended.instance.status, cancels),
        (Status::Cancelled, 1),
        "an ended child is not cancelled again"
    );
    assert_eq!(get(s, sibling.instance.id).await, sibling_before, "the sibling is untouched");
    assert_eq!(get(s, unrelated).await, unrelated_before, "an unrelated instance is untouched");
    let top_after = row(s, top).await;
    assert_eq!(
        (top_after.status, top_after.children_pending),
        (Status::AwaitingChildren, top_before.children_pending - 1),
        "the root's parent counts the root as ended and waits for the sibling"
    );
}

/// A cascade follows a chain of children down to `CANCEL_CASCADE_DEPTH_MAX` levels below
/// the cancelled instance, and no further: the one below stays live.
pub async fn cancel_cascade_follows_a_deep_chain_to_the_depth_bound<S: Store>(s: &S) {
    let ns = "cancel_deep";
    let root = insert_one(s, new_in(ns), at(0)).await;
    let mut chain = vec![root];
    let mut t = 10;
    for _ in 0..=limits::CANCEL_CASCADE_DEPTH_MAX {
        let newest = *chain.last().expect("the chain starts at the root");
        let claimed = claim_id(s, ns, newest, at(t)).await;
        chain.extend(children(s, &claimed, 1, ns, t + 1).await);
        t += 10;
    }
    // The root, then one instance on each level down to one past the bound.
    assert_eq!(chain.len(), limits::CANCEL_CASCADE_DEPTH_MAX + 2);
    let beyond = chain[limits::CANCEL_CASCADE_DEPTH_MAX + 1];
    let beyond_before = get(s, beyond).await;
    let cancelled: BTreeSet<_> =
        s.instance_cancel(cancel(root, true, at(t))).await.expect("cancel").into_iter().collect();
    let want: BTreeSet<_> = chain[..=limits::CANCEL_CASCADE_DEPTH_MAX].iter().copied().collect();
    assert_eq!(cancelled, want, "every level down to the bound");
    let deepest = get(s, chain[limits::CANCEL_CASCADE_DEPTH_MAX]).await;
    assert!(cancelled_from(&deepest, Some(root)), "the deepest level records the cascade");
    assert_eq!(get(s, beyond).await, beyond_before, "the level past the bound is untouched");
}

/// A cascade over children with and without unique keys, in turn, cancels every one of
/// them once and frees each key: an instance inserted with a cancelled child's key afterwards
/// is new, and an unrelated holder of another key keeps it.
pub async fn cancel_cascade_frees_the_keys_of_a_mixed_tree<S: Store>(s: &S) {
    use keel_core::ids::StatusSet;
    let ns = "cancel_keys";
    let keyed = |key: &str| new_in(ns).queue("kids").unique(key, StatusSet::LIVE);
    let plain = || new_in(ns).queue("kids");
    let root = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, root, at(10)).await;
    let mix = vec![plain(), keyed("k-1"), plain(), keyed("k-2"), plain()];
    let outcome = Outcome::ScheduleChildren {
        next: "join".into(),
        children: mix,
        context: ctx(1),
        join: keel_core::join::Join::default(),
    };
    let kids: Vec<InstanceId> =
        step(s, &claimed, outcome, at(20)).await.children.iter().map(|c| c.id()).collect();
    assert_eq!(kids.len(), 5, "every child was inserted: {kids:?}");
    // Inserted after the root's claim, so that claim cannot pick it.
    let holder =
        insert_one(s, new_in(ns).queue("other").unique("k-other", StatusSet::LIVE), at(25)).await;

    let cancelled: BTreeSet<_> =
        s.instance_cancel(cancel(root, true, at(30))).await.expect("cancel").into_iter().collect();
    let mut want: BTreeSet<_> = kids.iter().copied().collect();
    want.insert(root);
    assert_eq!(cancelled, want, "the root and every child");
    for id in &kids {
        let d = get(s, *id).await;
        assert!(cancelled_from(&d, Some(root)), "{id} records one cascade: {:?}", d.history);
    }
    for key in ["k-1", "k-2"] {
        let again = insert(s, vec![new_in(ns).unique(key, StatusSet::LIVE)], at(40)).await;
        assert!(
            matches!(again.as_slice(), [InsertOutcome::Inserted(id)] if !kids.contains(id)),
            "the cancelled child's key {key} is free: {again:?}"
        );
    }
    let other = insert(s, vec![new_in(ns).unique("k-other", StatusSet::LIVE)], at(40)).await;
    assert_eq!(other, [InsertOutcome::Existing(holder)], "another key stays held");
}

/// Cancel: missing → `NotFound`; terminal → nothing; executing → the worker's commit is
/// `LeaseLost`; without cascade the children go on.
pub async fn cancel_rules_terminal_missing_executing<S: Store>(s: &S) {
    let ns = "cancel_rules";
    expect_kind(
        s.instance_cancel(cancel(InstanceId(i64::MAX), false, at(0))).await,
        ErrorKind::NotFound,
        "cancel of a missing instance",
    );
    let finished = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, finished, at(10)).await;
    step(s, &claimed, done(), at(20)).await;
    let before = get(s, finished).await;
    assert!(s.instance_cancel(cancel(finished, true, at(30))).await.expect("cancel").is_empty());
    assert_eq!(get(s, finished).await, before, "cancel changed a terminal instance");
    let running = insert_one(s, new_in(ns), at(40)).await;
    let claimed = claim_id(s, ns, running, at(50)).await;
    let kid = step(s, &claimed, schedule(ns, 1), at(60)).await.children[0].id();
    let next = claim(s, claim_params(ns, 1, at(70))).await.remove(0);
    assert_eq!(next.instance.id, kid);
    assert_eq!(
        s.instance_cancel(cancel(running, false, at(80))).await.expect("cancel"),
        vec![running]
    );
    assert_eq!(
        row(s, kid).await.status,
        Status::Executing,
        "cancel without cascade touched a child"
    );
    assert_eq!(step(s, &next, done(), at(90)).await.status, Status::Done);
    let victim = insert_one(s, new_in(ns), at(100)).await;
    let claimed = claim_id(s, ns, victim, at(110)).await;
    s.instance_cancel(cancel(victim, false, at(120))).await.expect("cancel");
    let late = StepCommit::new(victim, claimed.token(), done());
    expect_kind(commit(s, late, at(130)).await, ErrorKind::LeaseLost, "commit after cancel");
    assert_eq!(row(s, victim).await.status, Status::Cancelled);
}

/// A cancel limited to some statuses (`only_in`) cancels nothing when the instance has
/// left them: an operator's "cancel these runnable rows" leaves one a worker claimed
/// since the read to its step, whose commit then goes through; a row still runnable is
/// cancelled, with its cascade.
pub async fn a_cancel_limited_to_runnable_leaves_a_claimed_instance_to_its_step<S: Store>(s: &S) {
    let ns = "cancel_only_in";
    let runnable = keel_core::StatusSet::of(&[Status::Runnable]);
    let only_runnable = |id, now| CancelParams { only_in: Some(runnable), ..cancel(id, true, now) };
    let claimed_since = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, claimed_since, at(10)).await;
    assert_eq!(
        s.instance_cancel(only_runnable(claimed_since, at(20))).await.expect("cancel"),
        Vec::<InstanceId>::new(),
        "an executing instance is outside the statuses the cancel was limited to"
    );
    assert_eq!(row(s, claimed_since).await.status, Status::Executing);
    assert_eq!(step(s, &claimed, done(), at(30)).await.status, Status::Done, "its step commits");

    let parent = insert_one(s, new_in(ns), at(40)).await;
    let claimed = claim_id(s, ns, parent, at(50)).await;
    let kid = step(s, &claimed, schedule(ns, 1), at(60)).await.children[0].id();
    let waiting = row(s, parent).await.status;
    assert_eq!(waiting, Status::AwaitingChildren);
    assert!(s.instance_cancel(only_runnable(parent, at(70))).await.expect("cancel").is_empty());
    assert_eq!(row(s, kid).await.status, Status::Runnable, "no cascade from a row left alone");
    assert_eq!(
        s.instance_cancel(only_runnable(kid, at(80))).await.expect("cancel"),
        vec![kid],
        "a row still runnable is cancelled"
    );
}

/// A start alone and the same start in a batch store the same row: every field the caller
/// gave (queue, priority, business and concurrency keys, context, due time, correlation
/// id) and the same defaults. Stores may take a shorter path for a batch of one.
pub async fn a_lone_insert_stores_what_a_batch_stores<S: Store>(s: &S) {
    let ns = "lone_insert";
    let given = new_in(ns)
        .queue("mail")
        .priority(Priority::High)
        .business_key("order-7")
        .concurrency_key("customer-3")
        .context(json!({ "items": [1, 2], "note": "ünï" }))
        .eligible_at(at(500))
        .correlation_id("corr-7");
    let lone = insert_one(s, given.clone(), at(10)).await;
    let alone = row(s, lone).await;
    // A batch without unique keys, and one where another row has a unique key: stores may
    // take a different statement for each.
    let keyed = new_in(ns).unique("lone-insert-key", keel_core::StatusSet::LIVE);
    for (batch, kind) in [
        (vec![given.clone(), new_in(ns)], "a batch without unique keys"),
        (vec![given.clone(), keyed], "a batch with a unique key beside it"),
    ] {
        let batch = insert(s, batch, at(10)).await;
        let [InsertOutcome::Inserted(batched), InsertOutcome::Inserted(_)] = batch.as_slice()
        else {
            panic!("expected two new instances from {kind}, got {batch:?}");
        };
        let mut in_batch = row(s, *batched).await;
        assert_ne!(alone.id, in_batch.id);
        in_batch.id = alone.id;
        assert_eq!(alone, in_batch, "one start alone stores what the same start in {kind} stores");
    }
    assert_eq!(
        (
            alone.queue.as_str(),
            alone.priority,
            alone.business_key.as_deref(),
            alone.concurrency_key.as_deref(),
            &alone.context,
            alone.eligible_at,
            alone.correlation_id.as_deref(),
            alone.status,
            alone.position.as_str(),
        ),
        (
            "mail",
            Priority::High,
            Some("order-7"),
            Some("customer-3"),
            &json!({ "items": [1, 2], "note": "ünï" }),
            at(500),
            Some("corr-7"),
            Status::Runnable,
            "start",
        ),
        "every field the start gave is stored"
    );
}

/// A batch insert answers in batch order: the i-th outcome is the i-th instance's id (or
/// its key's occupant), with or without unique keys in the batch, at the largest batch.
pub async fn a_batch_insert_answers_in_batch_order<S: Store>(s: &S) {
    let ns = "batch_order";
    let n = limits::ROWS_BATCH_MAX.min(limits::INSERT_BATCH_MAX);
    let numbered = |i: usize| new_in(ns).context(json!({ "n": i })).business_key(format!("b-{i}"));
    let occupant =
        insert_one(s, new_in(ns).unique("taken", keel_core::StatusSet::LIVE), at(0)).await;
    let plain: Vec<NewInstance> = (0..n).map(numbered).collect();
    // Every third row with a unique key of its own, and row 1 with a key already taken.
    let keyed: Vec<NewInstance> = (0..n)
        .map(|i| match i {
            1 => numbered(i).unique("taken", keel_core::StatusSet::LIVE),
            _ if i % 3 == 0 => numbered(i).unique(format!("k-{i}"), keel_core::StatusSet::LIVE),
            _ => numbered(i),
        })
        .collect();
    for (batch, kind) in [(plain, "without unique keys"), (keyed, "with unique keys")] {
        let out = insert(s, batch, at(10)).await;
        assert_eq!(out.len(), n, "one outcome per instance of the batch {kind}");
        let rows: std::collections::HashMap<InstanceId, _> = s
            .instance_rows(out.iter().map(|o| o.id()).collect())
            .await
            .expect("instance_rows")
            .into_iter()
            .map(|r| (r.id, r))
            .collect();
        let mut ids = BTreeSet::new();
        for (i, outcome) in out.iter().enumerate() {
            match outcome {
                InsertOutcome::Existing(id) => {
                    assert_eq!((i, *id), (1, occupant), "batch {kind}: only row 1 was taken");
                }
                InsertOutcome::Inserted(id) => {
                    let stored = &rows[id];
                    assert_eq!(
                        (stored.context["n"].as_u64(), stored.business_key.as_deref()),
                        (Some(i as u64), Some(format!("b-{i}").as_str())),
                        "batch {kind}: outcome {i} names the row of instance {i}"
                    );
                    assert!(ids.insert(*id), "batch {kind}: id {id:?} answered twice");
                }
            }
        }
    }
}

/// `instance_get` returns the row, inbox in arrival order, children and the history of
/// every commit in order; `instance_lookup` resolves ids and business keys (newest).
pub async fn instance_get_and_lookup<S: Store>(s: &S) {
    let ns = "get_lookup";
    expect_kind(
        s.instance_get(InstanceId(i64::MAX)).await,
        ErrorKind::NotFound,
        "get of a missing instance",
    );
    let first = insert_one(s, new_in(ns).business_key("order-1"), at(0)).await;
    let key = |ns: &str, k: &str| SignalTarget::Key {
        namespace: ns.into(),
        machine: order().name,
        key: k.into(),
    };
    assert_eq!(s.instance_lookup(key(ns, "order-1")).await.expect("lookup"), Some(first));
    let second =
        insert_one(s, new_in(ns).business_key("order-1").eligible_at(at(1_000_000)), at(1)).await;
    assert_eq!(
        s.instance_lookup(key(ns, "order-1")).await.expect("lookup"),
        Some(second),
        "newest instance wins"
    );
    assert_eq!(s.instance_lookup(key("get_lookup_other", "order-1")).await.expect("lookup"), None);
    let other_machine = SignalTarget::Key {
        namespace: ns.into(),
        machine: "billing".into(),
        key: "order-1".into(),
    };
    assert_eq!(s.instance_lookup(other_machine).await.expect("lookup"), None);
    assert_eq!(s.instance_lookup(SignalTarget::Id(first)).await.expect("lookup"), Some(first));
    assert_eq!(
        s.instance_lookup(SignalTarget::Id(InstanceId(i64::MAX))).await.expect("lookup"),
        None
    );
    let (a, _) = send(s, first, "a", at(2)).await;
    let (b, _) = send(s, first, "b", at(3)).await;
    let c1 = claim_id(s, ns, first, at(10)).await;
    step(s, &c1, super::support::next("second", 1), at(20)).await;
    let c2 = claim_id(s, ns, first, at(30)).await;
    step(s, &c2, super::support::next("third", 2), at(40)).await;
    let d = get(s, first).await;
    assert_eq!(d.instance.revision.0, 2, "one revision per accepted commit");
    assert_eq!(d.inbox.iter().map(|x| x.id).collect::<Vec<_>>(), vec![a, b]);
    let kinds: Vec<&str> = d.history.iter().map(|h| h.entry.kind.as_str()).collect();
    assert_eq!(kinds, vec!["STEP_NEXT", "STEP_NEXT"]);
    assert_eq!(
        d.history.iter().map(|h| (h.revision.0, h.at)).collect::<Vec<_>>(),
        vec![(1, at(20)), (2, at(40))]
    );
    assert_eq!(d.history[1].entry.data, json!({ "from": "second", "to": "third" }));

    // An inbox past the listing bound lists its oldest signals.
    let many = (0..=limits::INBOX_LIST_MAX).map(|i| NewSignal::new(second, format!("s{i}")));
    let delivered = super::support::deliver(s, many.collect(), at(50)).await;
    let d = get(s, second).await;
    assert_eq!(d.inbox.len(), limits::INBOX_LIST_MAX, "the inbox listing is bounded");
    assert_eq!(d.inbox[0].name, "s0", "the oldest first");
    assert_eq!(delivered.len(), limits::INBOX_LIST_MAX + 1);
}

/// `instance_rows` returns the rows of the ids that exist — each once, in id order, equal
/// to what `instance_get` reports — and refuses more than `ROWS_BATCH_MAX` ids.
pub async fn instance_rows_read_many_at_once<S: Store>(s: &S) {
    let ns = "rows_many";
    let a = insert_one(s, new_in(ns).context(json!({ "n": 1 })), at(0)).await;
    let b = insert_one(s, new_in(ns).context(json!({ "n": 2 })), at(0)).await;
    let c1 = claim_id(s, ns, a, at(10)).await;
    step(s, &c1, super::support::next("second", 3), at(20)).await;
    let missing = InstanceId(i64::MAX);
    let rows = s.instance_rows(vec![b, missing, a, b]).await.expect("instance_rows");
    assert_eq!(
        rows.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![a, b],
        "existing ids, once each, in id order"
    );
    assert_eq!(rows[0], get(s, a).await.instance, "the same row instance_get reads");
    assert_eq!(rows[0].position, "second");
    assert_eq!(rows[1], get(s, b).await.instance);
    assert!(s.instance_rows(Vec::new()).await.expect("no ids").is_empty());
    assert!(s.instance_rows(vec![missing]).await.expect("only missing").is_empty());
    let err =
        s.instance_rows(vec![a; limits::ROWS_BATCH_MAX + 1]).await.expect_err("over the limit");
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(err.message.contains("ids"), "the error names the field: {err}");
}

/// Contexts, payloads and results up to `PAYLOAD_BYTES_MAX` are accepted; one byte more
/// is `Invalid`, naming the field, with nothing of the batch written.
pub async fn payload_over_limit_rejected<S: Store>(s: &S) {
    let ns = "payload_limit";
    // `{"b":"…"}` is 8 bytes of JSON around the string.
    let ctx_of = |len: usize| json!({ "b": "x".repeat(len) });
    let fits = limits::PAYLOAD_BYTES_MAX - 8;
    let id = insert_one(s, new_in(ns).context(ctx_of(fits)), at(0)).await;
    let too_big = vec![new_in(ns), new_in(ns).context(ctx_of(fits + 1))];
    let err = s
        .instance_insert(InsertParams { instances: too_big, now: at(1) })
        .await
        .expect_err("oversized context");
    assert_eq!(err.kind, ErrorKind::Invalid);
    assert!(
        err.message.contains("instances[1].context"),
        "message names the field: {}",
        err.message
    );
    assert_eq!(
        claim(s, claim_params(ns, 10, at(2))).await.len(),
        1,
        "a rejected batch inserted something"
    );
    // A string payload is its length plus two quotes.
    let payload = |len: usize| Value::String("x".repeat(len));
    let big = vec![
        NewSignal::new(id, "ok"),
        NewSignal::new(id, "big").payload(payload(limits::PAYLOAD_BYTES_MAX - 1)),
    ];
    expect_kind(
        s.signal_deliver(SignalDeliverParams { signals: big, now: at(3) }).await,
        ErrorKind::Invalid,
        "oversized payload",
    );
    assert!(get(s, id).await.inbox.is_empty(), "a rejected delivery batch stored something");
    deliver(
        s,
        vec![NewSignal::new(id, "max").payload(payload(limits::PAYLOAD_BYTES_MAX - 2))],
        at(4),
    )
    .await;
    let claimed = get(s, id).await.instance;
    let result = StepCommit::new(
        id,
        claimed.fencing_token,
        Outcome::Done { result: payload(limits::PAYLOAD_BYTES_MAX - 1), step: None },
    );
    expect_kind(commit(s, result, at(5)).await, ErrorKind::Invalid, "oversized result");
    assert_eq!(row(s, id).await, claimed, "a rejected commit changed the row");
}

/// Every batch bound is enforced with `Invalid` and nothing written; a batch at the bound
/// is accepted.
pub async fn batch_over_limit_rejected<S: Store>(s: &S) {
    let ns = "batch_limit";
    let many = |n: usize| -> Vec<NewInstance> { vec![new_in(ns).eligible_at(at(1_000_000)); n] };
    expect_kind(
        s.instance_insert(InsertParams {
            instances: many(limits::INSERT_BATCH_MAX + 1),
            now: at(0),
        })
        .await,
        ErrorKind::Invalid,
        "insert batch",
    );
    let bad_item = vec![new_in(ns), NewInstance::new(order(), "").namespace(ns)];
    expect_kind(
        s.instance_insert(InsertParams { instances: bad_item, now: at(0) }).await,
        ErrorKind::Invalid,
        "empty position",
    );
    assert!(
        claim(s, claim_params(ns, 10, at(2_000_000))).await.is_empty(),
        "a rejected insert wrote rows"
    );
    assert_eq!(
        insert(s, many(limits::INSERT_BATCH_MAX), at(0)).await.len(),
        limits::INSERT_BATCH_MAX,
        "a batch at the bound"
    );
    expect_kind(
        s.instance_claim(claim_params(ns, limits::CLAIM_BATCH_MAX + 1, at(1))).await,
        ErrorKind::Invalid,
        "claim limit",
    );
    let id = insert_one(s, new_in(ns), at(0)).await;
    let signals = vec![NewSignal::new(id, "e"); limits::DELIVER_BATCH_MAX + 1];
    expect_kind(
        s.signal_deliver(SignalDeliverParams { signals, now: at(1) }).await,
        ErrorKind::Invalid,
        "deliver batch",
    );
    let reserved = vec![NewSignal::new(id, "*")];
    expect_kind(
        s.signal_deliver(SignalDeliverParams { signals: reserved, now: at(1) }).await,
        ErrorKind::Invalid,
        "`*` as a signal name",
    );
    assert!(get(s, id).await.inbox.is_empty());
    let claimed = claim_id(s, ns, id, at(2)).await;
    let commits = vec![StepCommit::new(id, claimed.token(), done()); limits::COMMIT_BATCH_MAX + 1];
    expect_kind(
        s.step_commit(CommitParams { commits, now: at(3) }).await,
        ErrorKind::Invalid,
        "commit batch",
    );
    let children = Outcome::ScheduleChildren {
        next: "join".into(),
        children: many(limits::CHILDREN_PER_STEP_MAX + 1),
        context: ctx(1),
        join: keel_core::join::Join::default(),
    };
    expect_kind(
        commit(s, StepCommit::new(id, claimed.token(), children), at(4)).await,
        ErrorKind::Invalid,
        "children per step",
    );
    assert_eq!(row(s, id).await, claimed.instance, "a rejected commit changed the row");
    let reap = LeaseReapParams { owner: None, limit: limits::REAP_BATCH_MAX + 1, now: at(5) };
    expect_kind(s.lease_reap(reap).await, ErrorKind::Invalid, "reap limit");
}
