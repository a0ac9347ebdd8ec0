//! Runs the whole store conformance suite on SQLite: each contract on a fresh database
//! in its own temporary file (WAL, writer + read pool — the real path), so it never skips.

keel_testkit::store_conformance_tests!(
    async {
        Some(
            keel_store_sqlite::SqliteStore::temporary()
                .await
                .expect("open a temporary sqlite store"),
        )
    },
    "nothing: the SQLite store needs no service"
);
