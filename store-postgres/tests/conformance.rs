//! Runs the whole store conformance suite on PostgreSQL, each contract in its own fresh
//! schema. Skips (saying so) when `KEEL_TEST_DATABASE_URL` is unset, unless
//! `KEEL_REQUIRE_BACKENDS=1`.

keel_testkit::store_conformance_tests!(
    keel_store_postgres::testing::fresh_schema(),
    "KEEL_TEST_DATABASE_URL"
);
