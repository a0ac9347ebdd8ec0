//! The hot path's plans read by index even when they are made on empty tables.
//!
//! A hot-path transaction's statements keep their generic plan for the life of the
//! connection, and a batch over more rows is planned on the spot against whatever the
//! tables hold. On an empty `signals` or `timers` table the planner would pick a
//! sequential scan, which every later commit then runs against the grown table. These
//! plans are made on a fresh schema, the worst case, in a transaction opened the way the
//! store opens its hot-path transactions.

use super::{admin, begin_hot, claim, commit, signal, timer};
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
            ("unread timer fires", commit::FIRES, format!("{ids}, {ids}, {ids}")),
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

/// An operator's page and a broadcast read by index on a large table, with the plan made
/// for the call's values and with the generic one, before and after the table's
/// statistics exist: the rows that are not executing through the list index, the
/// executing ones (which the list index leaves out) through the lease index. Neither
/// reads the whole table.
#[tokio::test]
async fn listings_and_broadcasts_read_by_index_on_a_large_table() {
    let Some(store) = fresh_schema_or_skip().await else { return };
    let c = store.client().await.expect("a connection");
    // 40 000 rows, 80 of them of a rare machine (half of those executing); one in a hundred
    // executing.
    c.batch_execute(
        "INSERT INTO instances (namespace, machine, machine_version, queue, priority, \
           base_priority, status, position, context, eligible_at, lease_expires_at, \
           created_at, updated_at) \
         SELECT 'ns', CASE WHEN g % 1000 < 2 THEN 'rare' ELSE 'common' END, 1, 'default', 2, 2, \
           CASE WHEN g % 100 = 1 THEN 'executing' WHEN g % 3 = 0 THEN 'done' \
             ELSE 'awaiting_signal' END::status, \
           'open', '{}', now(), CASE WHEN g % 100 = 1 THEN now() END, now(), now() \
         FROM generate_series(1, 40000) g",
    )
    .await
    .expect("rows");
    let page = |status, before: Option<i64>| keel_core::ports::store::InstanceListParams {
        namespace: "ns".into(),
        machine: Some("rare".into()),
        status,
        before: before.map(keel_core::InstanceId),
        limit: 50,
        ..Default::default()
    };
    let sql = |p: keel_core::ports::store::InstanceListParams| {
        let values = admin::ListValues::of(&p);
        admin::list_statement(&p, &values).0
    };
    let cases = [
        ("a page of a machine", sql(page(None, None)), "'ns', 'rare', 50"),
        ("a deeper page of a machine", sql(page(None, Some(20_000))), "'ns', 'rare', 20000, 50"),
        (
            "a machine's executing instances",
            sql(page(Some(keel_core::Status::Executing), None)),
            "'ns', 'rare', 50",
        ),
        (
            "a machine's waiting instances",
            sql(page(Some(keel_core::Status::AwaitingSignal), None)),
            "'ns', 'rare', 50",
        ),
        (
            "a broadcast",
            signal::BROADCAST.clone(),
            "'ns', 'rare', 'open', 100001, 'E', '{}'::jsonb, NULL, now(), 'keel'",
        ),
    ];
    for analyzed in [false, true] {
        if analyzed {
            c.batch_execute("ANALYZE instances").await.expect("analyze");
        }
        for mode in ["force_custom_plan", "force_generic_plan"] {
            c.batch_execute(&format!("BEGIN; SET LOCAL plan_cache_mode = {mode}"))
                .await
                .expect("begin");
            for (what, sql, args) in &cases {
                let shown = plan(&c, sql, args).await;
                let when = format!("{what} ({mode}, statistics: {analyzed})");
                assert!(!shown.contains("Seq Scan on instances"), "{when} scans:\n{shown}");
                if !what.contains("waiting") {
                    assert!(
                        shown.contains("instances_lease"),
                        "{when} finds the executing rows without the lease index:\n{shown}"
                    );
                }
                // The primary key may look rows up by id, never walk a range of ids. (A
                // generic plan, which cannot know how rare the machine is, may: it is only
                // kept when it costs no more than the plans made for the calls.)
                if mode == "force_generic_plan" {
                    continue;
                }
                if !what.contains("executing") {
                    assert!(shown.contains("instances_list"), "{when} skips the list:\n{shown}");
                }
                let lines: Vec<&str> = shown.lines().collect();
                for (at, line) in lines.iter().enumerate() {
                    if line.contains("instances_pkey on instances") {
                        let cond = lines.get(at + 1).copied().unwrap_or_default();
                        assert!(
                            cond.contains("Index Cond: (id = "),
                            "{when} walks the primary key:\n{shown}"
                        );
                    }
                }
            }
            c.batch_execute("ROLLBACK").await.expect("rollback");
        }
    }
}
