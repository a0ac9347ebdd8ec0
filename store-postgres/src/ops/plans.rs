//! The hot path's plans read by index even when they are made on empty tables.
//!
//! A hot-path transaction's statements keep their generic plan for the life of the
//! connection, and a batch over more rows is planned on the spot against whatever the
//! tables hold. On an empty `signals` or `timers` table the planner would pick a
//! sequential scan, which every later commit then runs against the grown table. These
//! plans are made on a fresh schema, the worst case, in a transaction opened the way the
//! store opens its hot-path transactions.

use super::{begin_hot, claim, commit, signal, timer};
use crate::testing;
use keel_testkit::conformance::{REQUIRE_BACKENDS_VAR, skip_notice};

/// The plan `EXPLAIN EXECUTE` shows for `sql` with the arguments `args`.
async fn plan(c: &deadpool_postgres::Client, sql: &str, args: &str) -> String {
    c.batch_execute(&format!("PREPARE hot AS {sql}")).await.expect("prepare");
    let call = if args.is_empty() { "hot".to_owned() } else { format!("hot({args})") };
    let rows = c.query(&format!("EXPLAIN EXECUTE {call}"), &[]).await.expect("explain");
    c.batch_execute("DEALLOCATE hot").await.expect("deallocate");
    rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n")
}

/// A fresh schema, or `None` (after saying so) when no PostgreSQL is configured; with
/// backends required, a missing one fails the test.
pub(super) async fn fresh_schema_or_skip() -> Option<crate::PgStore> {
    let store = testing::fresh_schema().await;
    if store.is_none() {
        assert!(
            std::env::var(REQUIRE_BACKENDS_VAR).as_deref() != Ok("1"),
            "{REQUIRE_BACKENDS_VAR}=1 but {} is unset; set it to run this test",
            testing::DATABASE_URL_VAR
        );
        skip_notice("SKIPPED: a Postgres test: KEEL_TEST_DATABASE_URL is unset");
    }
    store
}

#[tokio::test]
async fn hot_statements_read_by_index_on_empty_tables() {
    let Some(store) = fresh_schema_or_skip().await else { return };
    let c = store.client().await.expect("a connection");
    // One row: the generic plan. A thousand: a custom plan for arrays of that length.
    for rows in [1usize, 1_000] {
        begin_hot(&c, rows).await.expect("begin");
        let ids = format!("array_fill(1::int8, ARRAY[{rows}])");
        let names = format!("array_fill('s'::text, ARRAY[{rows}])");
        let none = "'{}'";
        let cases = [
            ("an inbox's pending signals", signal::PENDING, format!("{ids}, {ids}, {ids}, 4")),
            ("consumed signals removed", signal::REMOVE, format!("{ids}, {ids}")),
            ("pending signal priority", commit::PENDING_PRIORITY, format!("{ids}, {ids}, {ids}")),
            (
                "a commit's timer changes",
                timer::CHANGE,
                format!(
                    "{ids}, {names}, {ids}, {none}, {none}, {none}, {none}, {none}, {none}, {none}, now()"
                ),
            ),
            (
                "the due timers of a sweep",
                timer::DUE.as_str(),
                format!("now(), NULL, {none}, {rows}"),
            ),
        ];
        for (what, sql, args) in cases {
            let shown = plan(&c, sql, &args).await;
            for table in ["signals", "timers", "instances"] {
                assert!(
                    !shown.contains(&format!("Seq Scan on {table}")),
                    "{what} ({rows} rows) scans all of {table}:\n{shown}"
                );
            }
        }
        c.batch_execute("ROLLBACK").await.expect("rollback");
    }
}

/// The probe an empty claim asks (is a row with a concurrency key ready?) has a generic
/// plan that reads a keyed-only index, even on empty tables: PostgreSQL keeps it rather
/// than planning each call, and it never scans the table.
#[tokio::test]
async fn the_keyed_row_probe_reads_an_index_with_its_generic_plan() {
    let Some(store) = fresh_schema_or_skip().await else { return };
    let c = store.client().await.expect("a connection");
    begin_hot(&c, 1).await.expect("begin");
    let by_queue = plan(&c, claim::KEYED_READY_IN, "ARRAY['default']").await;
    assert!(by_queue.contains("queue = ANY ($1)"), "not the generic plan:\n{by_queue}");
    let any = plan(&c, claim::KEYED_READY_ANY, "").await;
    for shown in [&by_queue, &any] {
        assert!(!shown.contains("Seq Scan"), "the probe scans the table:\n{shown}");
        assert!(shown.contains("Index"), "the probe reads no index:\n{shown}");
    }
    c.batch_execute("ROLLBACK").await.expect("rollback");
}
