//! Retention: pages of `instance_prune` delete exactly the terminal instances that ended
//! before the cutoff (with their history and inbox), page by id within the page bound,
//! keep live instances, other namespaces, the children a live parent may still read, a
//! parent until its children are gone and an instance its dead letters name, and free the
//! unique keys the pruned rows held.

use super::support::{
    at, claim_id, claim_params, ctx, done, expect_kind, insert_one, new_in, step, suspend,
};
use keel_core::ids::{InstanceId, StatusSet};
use keel_core::instance::SignalTarget;
use keel_core::outcome::Outcome;
use keel_core::ports::Store;
use keel_core::ports::store::{
    CancelParams, DeadLetterPurgeParams, DeadLetterSelector, InsertOutcome, InsertParams,
    LeaseReleaseParams, PrunePage, PruneParams,
};
use keel_core::{ErrorKind, Timestamp, limits};

/// An instance in `ns` that ends with `outcome` at `at(t)`.
async fn ended<S: Store>(s: &S, ns: &str, new: keel_core::NewInstance, t: i64) -> InstanceId {
    let id = insert_one(s, new.namespace(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(t - 5)).await;
    step(s, &claimed, done(), at(t)).await;
    id
}

/// Runs a whole pass (pages of `limit` until nothing is left) and returns each page.
async fn pass<S: Store>(s: &S, ns: &str, ended_before: Timestamp, limit: usize) -> Vec<PrunePage> {
    let mut pages = Vec::new();
    let mut after = None;
    // Bounded: every page moves `after` forward over a finite table.
    for _ in 0..1_000 {
        let params = PruneParams {
            namespace: Some(ns.into()),
            machines: Vec::new(),
            except: Vec::new(),
            ended_before,
            after,
            limit,
        };
        let page = s.instance_prune(params).await.expect("instance_prune");
        assert!(page.instances <= limit as u64, "a page deletes at most its limit: {page:?}");
        pages.push(page);
        match page.last {
            Some(last) => after = Some(last),
            None => return pages,
        }
    }
    panic!("a prune pass did not end within 1000 pages");
}

fn total(pages: &[PrunePage]) -> (u64, u64) {
    pages.iter().fold((0, 0), |(i, h), p| (i + p.instances, h + p.history))
}

async fn gone<S: Store>(s: &S, id: InstanceId) -> bool {
    match s.instance_get(id).await {
        Ok(_) => false,
        Err(e) if e.kind == ErrorKind::NotFound => true,
        Err(e) => panic!("instance_get {id}: {e}"),
    }
}

/// Exactly the rows older than the cutoff go, page by page; later passes take the rest
/// as the cutoff moves; a child stays while its parent lives.
pub async fn prune_deletes_exactly_the_instances_ended_before_the_cutoff<S: Store>(s: &S) {
    let ns = "prune_exact";
    let keyed = new_in(ns).unique(b"tick-1".to_vec(), StatusSet::ALL);
    let d100 = ended(s, ns, keyed, 100).await;
    let d200 = ended(s, ns, new_in(ns), 200).await;
    let d300 = ended(s, ns, new_in(ns), 300).await;
    let elsewhere = ended(s, "prune_exact_other", new_in("prune_exact_other"), 100).await;
    // A parent waiting on its child; the child ends at 150, the parent lives on.
    let parent = insert_one(s, new_in(ns).queue("parents"), at(0)).await;
    let claimed = claim_id(s, ns, parent, at(10)).await;
    let children = vec![new_in(ns)];
    let spawn = Outcome::ScheduleChildren {
        next: "join".into(),
        children,
        context: ctx(1),
        join: keel_core::join::Join::default(),
    };
    let receipt = step(s, &claimed, spawn, at(20)).await;
    let child = receipt.children[0].id();
    let mut params = claim_params(ns, 100, at(145));
    params.queues = vec!["default".into()];
    let claims = super::support::claim(s, params).await;
    let others =
        claims.iter().filter(|c| c.instance.id != child).map(|c| (c.instance.id, c.token()));
    let leases = others.collect();
    s.lease_release(LeaseReleaseParams { leases, now: at(145) }).await.expect("release");
    let c = claims.iter().find(|c| c.instance.id == child).expect("child claimable");
    step(s, c, done(), at(150)).await;
    // A live instance, old but not terminal.
    let live = insert_one(s, new_in(ns), at(0)).await;

    // Retention 1 s at virtual time 1.2 s: the cutoff is 200, so only d100 goes (the child
    // ended at 150 but its parent lives); pages of 2 over the 8 rows of the store.
    let pages = pass(s, ns, at(200), 2).await;
    assert!(pages.len() >= 4, "8 rows in pages of 2: {pages:?}");
    let (instances, history) = total(&pages);
    assert_eq!(instances, 1, "only the instance ended before 200: {pages:?}");
    assert!(history >= 1, "its history went with it: {pages:?}");
    assert!(gone(s, d100).await, "d100 pruned");
    for kept in [d200, d300, elsewhere, live, parent, child] {
        assert!(!gone(s, kept).await, "{kept} kept");
    }
    // The unique key the pruned row held is free again.
    let again = s
        .instance_insert(InsertParams {
            instances: vec![new_in(ns).unique(b"tick-1".to_vec(), StatusSet::ALL)],
            now: at(1_200),
        })
        .await
        .expect("insert");
    assert!(matches!(again[0], InsertOutcome::Inserted(_)), "key freed: {again:?}");

    // The clock moves on: cutoff 301 takes d200 and d300, nothing else.
    let (instances, _) = total(&pass(s, ns, at(301), 3).await);
    assert_eq!(instances, 2);
    assert!(gone(s, d200).await && gone(s, d300).await);
    assert!(!gone(s, child).await, "still protected by its live parent");

    // The parent ends (cancelled at 400): its child goes in the next pass, the parent (still
    // pointed at by the child when the pass read it) in the pass after.
    s.instance_cancel(CancelParams {
        id: parent,
        reason: "done".into(),
        cascade: false,
        now: at(400),
        only_in: None,
    })
    .await
    .expect("cancel");
    let (instances, _) = total(&pass(s, ns, at(1_000), 1_000).await);
    assert_eq!(instances, 1, "the child first");
    assert!(gone(s, child).await && !gone(s, parent).await);
    let (instances, _) = total(&pass(s, ns, at(1_000), 1_000).await);
    assert_eq!(instances, 1, "then the parent");
    assert!(gone(s, parent).await);
    assert!(!gone(s, live).await && !gone(s, elsewhere).await);
}

/// An instance that dead letters still name stays until they are purged (they have their
/// own retention); then it goes like any other.
pub async fn prune_keeps_an_instance_its_dead_letters_name<S: Store>(s: &S) {
    let ns = "prune_dead_letters";
    let id = insert_one(s, new_in(ns), at(0)).await;
    let claimed = claim_id(s, ns, id, at(5)).await;
    let letter = suspend(s, &claimed, "boom", vec![], at(10)).await;
    s.instance_cancel(CancelParams {
        id,
        reason: "gave up".into(),
        cascade: false,
        now: at(20),
        only_in: None,
    })
    .await
    .expect("cancel");
    let (instances, _) = total(&pass(s, ns, at(1_000), 10).await);
    assert_eq!(instances, 0, "kept while its dead letter exists");
    let purge = DeadLetterPurgeParams {
        selector: Some(DeadLetterSelector::Id(letter)),
        older_than: None,
        keep_suspended: false,
    };
    s.dead_letter_purge(purge).await.expect("purge");
    let (instances, _) = total(&pass(s, ns, at(1_000), 10).await);
    assert_eq!(instances, 1, "pruned once its dead letter is gone");
    assert!(gone(s, id).await);
}

/// The page size is bounded on both sides, and a bad page changes nothing.
pub async fn prune_refuses_a_page_size_out_of_bounds<S: Store>(s: &S) {
    let ns = "prune_bounds";
    let id = ended(s, ns, new_in(ns), 100).await;
    for limit in [0, limits::PRUNE_BATCH_MAX + 1] {
        let params = PruneParams {
            namespace: Some(ns.into()),
            machines: Vec::new(),
            except: Vec::new(),
            ended_before: at(1_000),
            after: None,
            limit,
        };
        expect_kind(s.instance_prune(params).await, ErrorKind::Invalid, "prune limit");
    }
    assert!(!gone(s, id).await, "nothing pruned by a refused page");
    let (instances, _) = total(&pass(s, ns, at(1_000), limits::PRUNE_BATCH_MAX).await);
    assert_eq!(instances, 1, "the largest page is accepted");
}

/// A business key names the newest instance that carries it and still exists: once the
/// newest is pruned, the key resolves to the one before it.
pub async fn a_business_key_resolves_to_its_newest_instance_left_after_a_prune<S: Store>(s: &S) {
    let ns = "prune_business_key";
    let key = || SignalTarget::Key {
        namespace: ns.into(),
        machine: "order".into(),
        key: "acct-9".into(),
    };
    // The older one is not claimable yet, so only the newer is claimed and ended.
    let older =
        insert_one(s, new_in(ns).business_key("acct-9").eligible_at(at(1_000_000)), at(0)).await;
    let newer = ended(s, ns, new_in(ns).business_key("acct-9"), 100).await;
    assert_eq!(s.instance_lookup(key()).await.expect("lookup"), Some(newer));
    let (instances, _) = total(&pass(s, ns, at(200), 10).await);
    assert_eq!(instances, 1, "the newer, ended instance is pruned");
    assert_eq!(
        s.instance_lookup(key()).await.expect("lookup"),
        Some(older),
        "the key resolves to the instance left"
    );
}
