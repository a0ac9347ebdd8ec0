//! The queue conformance suite on Redis.

keel_testkit::queue_conformance_tests!(
    keel_queue_redis::testing::fresh_queue(),
    keel_queue_redis::testing::URL_VAR
);
