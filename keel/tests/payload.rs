//! A payload that does not fit the type a step reads it as, read through
//! `StepContext::payload_as`: dead-lettered after one attempt, naming the event.

use keel::{
    Keel, MachineRef, NewInstance, NewSignal, Outcome, Status, StepContext, StepError, StepMachine,
    json,
};
use serde::Deserialize;
use std::time::Duration;

#[derive(Debug, Deserialize)]
struct Paid {
    #[allow(dead_code)]
    cents: u64,
}

struct Till;

#[keel::async_trait]
impl StepMachine for Till {
    fn machine(&self) -> MachineRef {
        MachineRef::new("till", 1)
    }

    async fn step(&self, ctx: &StepContext) -> Result<Outcome, StepError> {
        match ctx.signal("PAID") {
            Some(signal) => {
                let _paid: Paid = ctx.payload_as(signal)?;
                Ok(Outcome::done_with(&json!({}))?)
            }
            None => Ok(Outcome::await_with("PAID", &json!({}))?),
        }
    }
}

#[tokio::test]
async fn a_payload_that_does_not_fit_is_dead_lettered_after_one_attempt_naming_the_event() {
    let keel = Keel::connect("sqlite::memory:").await.expect("SQLite in memory opens");
    let worker = keel.worker().register(Till).expect("registers").spawn().expect("spawns");
    let id = keel.start(NewInstance::new(MachineRef::new("till", 1), "pay")).await.unwrap().id();
    let sent = keel.send(NewSignal::new(id, "PAID").payload(json!({ "cents": "42" }))).await;
    let sent = sent.expect("a send");
    let keel::DeliveryOutcome::Delivered { id: signal, .. } = sent else {
        panic!("not delivered: {sent:?}")
    };

    let mut status = Status::Runnable;
    for _ in 0..400 {
        status = keel.get(id).await.expect("read").instance.status;
        if status == Status::Suspended {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(status, Status::Suspended, "dead-lettered at once, not retried");
    let letters = keel.dead_letters(keel::DeadLetterFilter::default()).await.expect("listed");
    let [letter] = letters.as_slice() else { panic!("one dead letter: {letters:?}") };
    let letter = &letter.letter;
    assert_eq!(letter.attempts, 1, "{letter:?}");
    assert_eq!(letter.reason, "non_retryable");
    assert_eq!(letter.signals, [signal], "the letter holds the event");
    assert_eq!(letter.event, Some(json!({ "name": "PAID", "payload": { "cents": "42" } })));
    let error = &letter.errors[0].error;
    assert_eq!(
        *error,
        format!(
            "the payload of event \"PAID\" (signal {signal}) to instance {id} does not fit the \
             step's payload type: invalid type: string \"42\", expected u64"
        )
    );
    worker.shutdown().await;
}
