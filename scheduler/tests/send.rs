//! Sending through the client: what a sender may not use, and what it is told when the
//! target is not there. On `MemoryStore` under a virtual clock.

#[macro_use]
mod common;

use common::Harness;
use keel_core::InstanceId;
use keel_core::error::ErrorKind;
use keel_core::ids::MachineRef;
use keel_core::instance::{NewInstance, NewSignal, SignalTarget};
use keel_core::ports::store::DeliveryOutcome;
use keel_scheduler::Broadcast;

/// Dedup keys beginning `timer:` or `child:` are how the engine's own timer fires and
/// child notices are kept once. A sender's signal under such a key would take the place
/// of a real fire (which is then lost) or be read as one, so the client refuses it, naming
/// the field and the fix, and stores nothing.
#[tokio::test]
async fn a_send_or_broadcast_under_a_key_reserved_for_timers_or_children_is_refused() {
    let h = Harness::new();
    let id = h.start(NewInstance::new(MachineRef::new("reminder", 1), "waiting")).await;
    for key in ["timer:1:1", "child:3:terminal"] {
        let sent = h.client.send(NewSignal::new(id, "PING").dedup_key(key)).await;
        let err = sent.expect_err("a reserved dedup key is refused");
        assert_eq!(err.kind, ErrorKind::Invalid, "{err}");
        assert!(err.message.starts_with("dedup_key:"), "a send names the field bare: {err}");
        assert!(err.message.contains("use another prefix"), "{err}");
        let broadcast = Broadcast::new("reminder", "PING").dedup_key(key);
        let err = h.client.broadcast(broadcast).await.expect_err("refused in a broadcast too");
        assert!(err.message.starts_with("broadcast.dedup_key:"), "{err}");
    }
    assert!(h.client.get(id).await.expect("get").inbox.is_empty(), "nothing was stored");
    // A key that only mentions a timer elsewhere is the sender's own.
    let own = h.client.send(NewSignal::new(id, "PING").dedup_key("my-timer:1")).await;
    assert!(matches!(own, Ok(DeliveryOutcome::Delivered { .. })), "{own:?}");
}

/// A send to a target that is not there says which instance it looked for, as the `keel`
/// command line names it, and what to check.
#[tokio::test]
async fn a_send_to_a_missing_target_names_it_as_an_operator_does() {
    let h = Harness::new();
    let err = h.client.send(NewSignal::new(InstanceId(999_999), "PING")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.starts_with("no instance i999999;"), "{err}");
    assert!(err.message.contains("keel list"), "{err}");
    let by_key = SignalTarget::Key {
        namespace: "default".into(),
        machine: "order".into(),
        key: "A-1".into(),
    };
    let err = h.client.send(NewSignal::new(by_key, "PING")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(
        err.message.starts_with(
            "no instance of machine \"order\" with key \"A-1\" in namespace \"default\";"
        ),
        "{err}"
    );
    let parent = h.start(NewInstance::new(MachineRef::new("order", 1), "paying")).await;
    let child = SignalTarget::Child { parent, state: "pay".into() };
    let err = h.client.send(NewSignal::new(child, "PING")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(
        err.message.starts_with(&format!("no child of {parent} started by state \"pay\";")),
        "{err}"
    );
}

/// A batch targeting more instances by id than one read of rows returns, through a
/// client whose file gives an event a priority, is sent whole: the targets' machines are
/// read a page at a time, and each signal carries its event's priority.
#[tokio::test]
async fn a_batch_over_one_read_of_rows_gets_its_event_priorities() {
    use keel_core::Priority;
    use keel_core::config::KeelConfig;
    let h = Harness::new();
    let (file, _) =
        KeelConfig::load("[machines.shop.events.cancel.queue]\npriority = \"critical\"\n", |_| {
            None
        })
        .expect("an event priority is applied");
    let client = h.client.clone().with_settings(file);
    let n = keel_core::limits::ROWS_BATCH_MAX + 500;
    let new = vec![NewInstance::new(MachineRef::new("shop", 1), "open"); n];
    let ids: Vec<InstanceId> = client
        .start_many(new)
        .await
        .expect("start")
        .into_iter()
        .map(keel_core::ports::store::InsertOutcome::id)
        .collect();
    let signals: Vec<NewSignal> = ids.iter().map(|id| NewSignal::new(*id, "cancel")).collect();
    let sent = client.send_many(signals).await.expect("a batch over one read of rows is sent");
    assert_eq!(sent.len(), n);
    assert!(sent.iter().all(|s| matches!(s, DeliveryOutcome::Delivered { .. })), "all delivered");
    for id in [ids[0], ids[n - 1]] {
        let inbox = client.get(id).await.expect("get").inbox;
        assert_eq!(inbox.len(), 1);
        assert_eq!(inbox[0].priority, Some(Priority::Critical), "the event's priority");
    }
}
