//! Runs the whole store conformance suite on the in-memory reference store.

keel_testkit::store_conformance_tests!(async { Some(keel_testkit::MemoryStore::new()) });
