//! Runs the whole store conformance suite on SQLite's private in-memory database (one
//! connection for everything), so `SqliteStore::memory()` is held to the same contracts.

keel_testkit::store_conformance_tests!(
    async {
        Some(
            keel_store_sqlite::SqliteStore::memory().await.expect("open an in-memory sqlite store"),
        )
    },
    "nothing: the SQLite store needs no service"
);
