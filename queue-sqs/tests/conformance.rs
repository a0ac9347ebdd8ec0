//! The queue conformance suite on SQS, once on a standard queue and once on a FIFO queue.

mod standard {
    keel_testkit::queue_conformance_tests!(
        keel_queue_sqs::testing::fresh_queue(),
        keel_queue_sqs::testing::ENDPOINT_VAR
    );
}

mod fifo {
    keel_testkit::queue_conformance_tests!(
        keel_queue_sqs::testing::fresh_fifo_queue(),
        keel_queue_sqs::testing::ENDPOINT_VAR
    );
}
