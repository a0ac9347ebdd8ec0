//! Wake-ups sent after a commit: a notice that fails leaves the pooled connection usable.

use super::plans::fresh_schema_or_skip;
use super::{Notices, begin, end_tx_notices};

#[tokio::test]
async fn a_notice_that_fails_after_the_commit_leaves_the_connection_usable() {
    let Some(store) = fresh_schema_or_skip().await else { return };
    let c = store.client().await.expect("a connection");
    c.batch_execute("CREATE TABLE notice_probe (n int)").await.expect("create");
    // A payload over the server's 8 000-byte limit makes `pg_notify` fail.
    let notices = Notices { timer: Some("x".repeat(9_000)), ..Notices::ready(true) };
    begin(&c).await.expect("begin");
    c.batch_execute("INSERT INTO notice_probe VALUES (1)").await.expect("insert");
    end_tx_notices(&c, "keel_notice_probe", &notices)
        .await
        .expect("the commit landed; a failed notice is only logged");

    // The next user of the connection starts outside any transaction.
    let row = c.query_one("SELECT count(*) FROM notice_probe", &[]).await.expect(
        "the connection is usable after a failed notice (not left in an aborted transaction)",
    );
    assert_eq!(row.get::<_, i64>(0), 1, "the commit before the notice landed");
    begin(&c).await.expect("begin again");
    c.batch_execute("INSERT INTO notice_probe VALUES (2)").await.expect("insert again");
    end_tx_notices(&c, "keel_notice_probe", &Notices::ready(true)).await.expect("commit again");
    let row = c.query_one("SELECT count(*) FROM notice_probe", &[]).await.expect("count");
    assert_eq!(row.get::<_, i64>(0), 2, "a transaction after the failed notice commits");
}
