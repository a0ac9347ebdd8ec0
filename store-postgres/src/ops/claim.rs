//! `instance_claim`: one statement. A `FOR UPDATE SKIP LOCKED` picker over runnable rows
//! (partial index `instances_pick`) that skips keys with an executing row and every row of
//! a key but its first in claim order (partial index `instances_key_runnable`), the
//! `UPDATE` to executing, and each claimed row's inbox and children as JSON. The picker and
//! the `UPDATE` are the core's claim rule (`plan::claim::ClaimPlanner`) written in SQL, so
//! that a whole batch is claimed in one round trip: the same filters, pauses, one row per
//! concurrency key, claim order and limit, and the same row transition (executing under a
//! new lease and the next fencing token).

use super::{begin, commit, end_tx};
use crate::error::{OpError, OpResult, is_unique_violation};
use crate::rows::{self, HistoryWrite, ts};
use deadpool_postgres::GenericClient;
use keel_core::config::Strategy;
use keel_core::instance::{ChildSummary, Signal};
use keel_core::plan;
use keel_core::ports::store::{Claim, ClaimParams};
use keel_core::{
    Instance, InstanceId, MachineRef, SignalId, Status, StoreError, Timestamp, limits,
};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::LazyLock;

/// Whether a claim lost a race for a key (another claimer's row with the same concurrency
/// key, or the same unique key scoped to executing rows, became executing after this
/// statement's snapshot): re-running it is correct, and the re-run skips that row.
pub(crate) fn is_key_race(e: &OpError) -> bool {
    matches!(e, OpError::Pg(e)
        if is_unique_violation(e, "instances_concurrency")
            || is_unique_violation(e, "instances_unique"))
}

/// The worker's filters (namespaces, queues, machines; empty = any) and the paused-queue
/// exclusion, over the table alias `t` (also the repair read's filters).
pub(crate) fn filters(t: &str) -> String {
    format!(
        "(cardinality($2::text[]) = 0 OR {t}.namespace = ANY($2)) \
         AND (cardinality($3::text[]) = 0 OR {t}.queue = ANY($3)) \
         AND (cardinality($4::text[]) = 0 OR ({t}.machine, {t}.machine_version) IN \
              (SELECT m.name, m.version FROM unnest($4::text[], $5::int4[]) AS m(name, version))) \
         AND ({t}.namespace, {t}.queue) NOT IN (SELECT q.namespace, q.queue FROM queues q WHERE q.paused)"
    )
}

/// The claim order a statement sorts by.
#[derive(Clone, Copy)]
enum Order {
    /// Priority, then eligible order: the `instances_pick` index order.
    Priority,
    /// Eligible order alone (`fifo`): the `instances_pick_fifo` index order.
    Fifo,
    /// Priority with a starvation bound (`$12`): a row eligible at or before it ranks
    /// ahead of every priority, as `ClaimPolicy::rank` says.
    Ranked,
}

/// The claim order key over the table alias `t`, as a row constructor body.
fn key(order: Order, t: &str) -> String {
    match order {
        Order::Priority => format!("{t}.priority, {t}.eligible_at, {t}.id"),
        Order::Fifo => format!("{t}.eligible_at, {t}.id"),
        Order::Ranked => format!(
            "CASE WHEN {t}.eligible_at <= $12 THEN -1 ELSE {t}.priority END, {t}.eligible_at, {t}.id"
        ),
    }
}

/// The claim of named instances (a queue hint's targets, `$9`): the same statement with
/// the candidates narrowed to those ids.
static SQL_IDS: LazyLock<String> =
    LazyLock::new(|| sql(Order::Priority, "AND i.id = ANY($9::int8[])", "$6", Keys::One));

/// Whether any queue holds a ready row with a concurrency key: one probe of the keyed-only
/// indexes. Without parameters, so its one plan is cached.
pub(crate) const KEYED_READY_ANY: &str = "SELECT EXISTS (SELECT 1 FROM instances n \
     WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL)";

/// Whether the claim's queues (`$1`, not empty) hold a ready row with a concurrency key:
/// one probe of the keyed-only indexes. No `OR` on the parameter, which only a plan made
/// for one call's value could simplify.
pub(crate) const KEYED_READY_IN: &str = "SELECT EXISTS (SELECT 1 FROM instances n \
     WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL \
       AND n.queue = ANY($1::text[]))";

/// Asks [`KEYED_READY_ANY`] or [`KEYED_READY_IN`]. An empty claim runs this probe, and
/// claims come back empty often (every poll of an idle worker, and most of the claims that
/// follow one delivery's notice, since several claim loops wake for it). Written as one
/// statement with `cardinality($1) = 0 OR queue = ANY($1)`, PostgreSQL planned it afresh
/// on every call (only a plan for the call's value can drop the `OR`): about 0.25 ms of
/// server CPU against microseconds of execution. The two forms keep their generic plans.
async fn keyed_ready<C: GenericClient + Sync>(c: &C, queues: &[String]) -> OpResult<bool> {
    let row = if queues.is_empty() {
        let stmt = c.prepare_cached(KEYED_READY_ANY).await?;
        c.query_one(&stmt, &[]).await?
    } else {
        let stmt = c.prepare_cached(KEYED_READY_IN).await?;
        c.query_one(&stmt, &[&queues]).await?
    };
    Ok(rows::col(&row, 0)?)
}

/// How a statement bounds the rows of one concurrency key.
#[derive(Clone, Copy)]
enum Keys {
    /// One at a time: a key with an executing row is skipped, and only the key's first
    /// runnable row (claim order) is a candidate; the claimed row takes slot 0.
    One,
    /// Up to `$11` at a time: a row is a candidate while the key's executing rows plus its
    /// runnable rows ahead of it are fewer than `$11` (each count stops at `$11`), and a
    /// claimed row takes the key's lowest free slot.
    Up,
}

/// A claim of named instances under a policy: `$9` the ids, `$10` is the queue's global
/// limit (NULL = none), counted against the queue's executing rows at the statement's
/// snapshot (the caller holds the queue's claim lock while it runs, so two claims of one
/// limited queue cannot both see the same free room), and `$11` is the key limit.
fn policy_sql(order: Order) -> String {
    sql(
        order,
        "AND i.id = ANY($9::int8[])",
        "CASE WHEN $10::int8 IS NULL THEN $6 ELSE least($6, greatest(0, $10::int8 - \
           (SELECT count(*) FROM instances x WHERE x.status = 'executing' \
              AND x.queue = ANY($3)))) END",
        Keys::Up,
    )
}

static SQL_IDS_FIFO: LazyLock<String> = LazyLock::new(|| policy_sql(Order::Fifo));
static SQL_IDS_PRIORITY: LazyLock<String> = LazyLock::new(|| policy_sql(Order::Priority));
static SQL_IDS_RANKED: LazyLock<String> = LazyLock::new(|| policy_sql(Order::Ranked));

/// The claim when the claim's queues hold no ready row with a concurrency key (the hot
/// path of work without keys): the plain picker over the rows without a key, a statement
/// small enough to plan in microseconds. `$9`–`$11` are typed but unused. It claims
/// nothing when its own snapshot sees a ready keyed row in the claim's queues (one probe
/// of `instances_fair`, evaluated once), so it can run without asking first: when it
/// comes back empty, [`keyed_ready`] tells whether the fair statement should run.
fn unkeyed_sql(order: Order, global: bool) -> String {
    let limit = if global {
        "least($6, greatest(0, $9::int8 - (SELECT count(*) FROM instances x \
           WHERE x.status = 'executing' AND x.queue = ANY($3))))"
    } else {
        "$6"
    };
    sql(
        order,
        "AND i.concurrency_key IS NULL AND ($9::int8 IS NULL OR true) \
         AND ($10::int4 IS NULL OR true) AND ($11::text IS NULL OR true) \
         AND NOT EXISTS (SELECT 1 FROM instances n WHERE n.status = 'runnable' \
           AND n.concurrency_key IS NOT NULL \
           AND (cardinality($3::text[]) = 0 OR n.queue = ANY($3::text[])))",
        limit,
        Keys::One,
    )
}

static UNKEYED_PRIORITY: LazyLock<String> = LazyLock::new(|| unkeyed_sql(Order::Priority, false));
static UNKEYED_FIFO: LazyLock<String> = LazyLock::new(|| unkeyed_sql(Order::Fifo, false));
static UNKEYED_RANKED: LazyLock<String> = LazyLock::new(|| unkeyed_sql(Order::Ranked, false));
static UNKEYED_PRIORITY_LIMITED: LazyLock<String> =
    LazyLock::new(|| unkeyed_sql(Order::Priority, true));
static UNKEYED_FIFO_LIMITED: LazyLock<String> = LazyLock::new(|| unkeyed_sql(Order::Fifo, true));
static UNKEYED_RANKED_LIMITED: LazyLock<String> =
    LazyLock::new(|| unkeyed_sql(Order::Ranked, true));

static FAIR_PRIORITY: LazyLock<String> = LazyLock::new(|| fair_sql(Order::Priority, false));
static FAIR_FIFO: LazyLock<String> = LazyLock::new(|| fair_sql(Order::Fifo, false));
static FAIR_RANKED: LazyLock<String> = LazyLock::new(|| fair_sql(Order::Ranked, false));
static FAIR_PRIORITY_LIMITED: LazyLock<String> = LazyLock::new(|| fair_sql(Order::Priority, true));
static FAIR_FIFO_LIMITED: LazyLock<String> = LazyLock::new(|| fair_sql(Order::Fifo, true));
static FAIR_RANKED_LIMITED: LazyLock<String> = LazyLock::new(|| fair_sql(Order::Ranked, true));

/// The fair claim (`plan::claim::fair_order` in SQL), of every claim but one of named
/// instances. Parameters: `$1`–`$8` as in every claim, `$9` the queue's global limit
/// (counted like the ids claim's), `$10` the key limit, `$11` the claim's one queue
/// (`plan::claim::cursor_queue`; NULL: no rotation cursor), `$12` the starvation bound
/// (ranked order only; NULL otherwise), `$13` under a per-key rate limit the tokens of a
/// new bucket (`plan::claim::key_rate_room` of a full one; NULL: no per-key rate limit)
/// and `$14` the claim's time in epoch milliseconds (what the buckets' token times are
/// compared with).
///
/// - `uc`: the rows without a key, the first `limit` in claim order, locked as they are
///   found (`FOR UPDATE SKIP LOCKED`, as the plain picker always did), over the pickers
///   that hold only such rows.
/// - `scan`: a skip scan over the distinct `(queue, key)` pairs with runnable rows, one
///   index probe per key (`instances_fair`), in rotation order: the keys after the cursor,
///   then (with a cursor) from the first key up to and including it. Each key's room is
///   its limit less its executing rows (a count that stops at the limit), and under a
///   per-key rate limit at most its bucket's whole tokens (one primary-key probe). The scan stops
///   after as many keys with room and a due row as the claim can take, or after
///   `CLAIM_KEYS_SCAN_MAX` keys. A key at its limit costs one probe, however many rows
///   it has waiting.
/// - `kc`: each key's first `room` due rows in claim order, with their round.
/// - `chosen`: rounds, then claim order, cut at the limit; keyed rows are then locked
///   (`SKIP LOCKED`: a row another claimer holds is left out).
/// - the cursor moves as `plan::claim::cursor_after` says: to the last key in rotation
///   order a full claim took, or, when the scan reached its bound without filling up, to
///   the last key it visited (its `stopped`), so the next claim carries on there.
///
/// Without a global limit (`global` false) the statement's limit is `$6` alone: a limit
/// expression with the executing count in it costs a count on every claim even when `$9`
/// is NULL, so the two are separate statements.
/// What a claim statement returns for each row of its `UPDATE … RETURNING` (`u`): the
/// row's columns, then its inbox and its children as JSON arrays, each bounded.
fn claimed_rows() -> String {
    let cols = rows::INSTANCE_COLS_I.replace("i.", "u.");
    format!(
        "SELECT {cols}, \
           (SELECT coalesce(jsonb_agg(jsonb_build_object('id', s.id, 'name', s.name, \
               'payload', s.payload, 'dedup_key', s.dedup_key, 'priority', s.priority, \
               'at', floor(extract(epoch FROM s.inserted_at) * 1000)::int8) ORDER BY s.id), '[]') \
            FROM (SELECT * FROM signals WHERE target_id = u.id ORDER BY id LIMIT {inbox}) s), \
           (SELECT coalesce(jsonb_agg(jsonb_build_object('id', c.id, 'machine', c.machine, \
               'version', c.machine_version, 'status', c.status, 'position', c.position, \
               'context', c.context, \
               'result', CASE WHEN c.result IS NULL THEN NULL ELSE jsonb_build_array(c.result) END, 'last_error', c.last_error) \
               ORDER BY c.id), '[]') \
            FROM (SELECT * FROM instances WHERE parent_id = u.id ORDER BY id LIMIT {children}) c)",
        inbox = limits::CLAIM_INBOX_MAX,
        children = limits::CHILDREN_LIST_MAX,
    )
}

fn fair_sql(order: Order, global: bool) -> String {
    let key_i = key(order, "i");
    let filters_i = filters("i");
    let filters_o = filters("o");
    let limit = if global {
        "(least($6, greatest(0, $9::int8 - \
           (SELECT count(*) FROM instances x WHERE x.status = 'executing' \
              AND x.queue = ANY($3)))))"
    } else {
        "$6"
    };
    let unique = "(i.unique_key IS NULL OR 'runnable' = ANY(i.unique_scope) \
                  OR NOT 'executing' = ANY(i.unique_scope) \
                  OR NOT EXISTS (SELECT 1 FROM instances g WHERE g.unique_guard = i.unique_key))";
    let guard = "CASE WHEN i.unique_key IS NOT NULL AND 'executing' = ANY(i.unique_scope) \
                   AND NOT 'runnable' = ANY(i.unique_scope) THEN i.unique_key END";
    // The next (queue, key) pair after `(pq, pk)` among the claim's queues: the next key
    // of the same queue, else the first key of a later queue. (Two probes with an equality
    // on the queue, so each positions the index after `pk` instead of walking its rows.)
    let next_after = |pq: &str, pk: &str| {
        format!(
            "SELECT * FROM ( \
               (SELECT n.queue, n.concurrency_key, 0 AS o FROM instances n \
                WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL \
                  AND n.queue = {pq} AND n.concurrency_key > {pk} \
                ORDER BY n.concurrency_key LIMIT 1) \
               UNION ALL \
               (SELECT n.queue, n.concurrency_key, 1 FROM instances n \
                WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL \
                  AND cardinality($3::text[]) <> 1 AND n.queue > {pq} \
                  AND (cardinality($3::text[]) = 0 OR n.queue = ANY($3)) \
                ORDER BY n.queue, n.concurrency_key LIMIT 1) \
             ) nq ORDER BY o LIMIT 1"
        )
    };
    let first = "SELECT n.queue, n.concurrency_key FROM instances n \
             WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL \
               AND (cardinality($3::text[]) = 0 OR n.queue = ANY($3)) \
             ORDER BY n.queue, n.concurrency_key LIMIT 1";
    // A key's room: its limit less its executing rows and, under a per-key rate limit
    // (`cur.key_burst` set), at most the whole tokens of its bucket now (the stored times
    // its next tokens arrive that are past; a key without a bucket has a new one's burst).
    let room = |q: &str, k: &str| {
        format!(
            "least($10::int4 - (SELECT count(*) FROM (SELECT 1 FROM instances e \
               WHERE e.status = 'executing' AND e.concurrency_key = {k} LIMIT $10::int4) z)::int4, \
             CASE WHEN cur.key_burst IS NULL THEN $10::int4 ELSE coalesce( \
               (SELECT (SELECT count(*) FROM unnest(b.token_times) t WHERE t <= cur.now_ms)::int4 \
                FROM key_rate_buckets b WHERE b.queue = {q} AND b.concurrency_key = {k}), \
               cur.key_burst) END)"
        )
    };
    // In index order with a limit rather than `EXISTS`, so the planner walks the key's
    // index range instead of scanning the table when one key holds most rows.
    let due = |q: &str, k: &str| {
        format!(
            "(SELECT true FROM instances o WHERE o.status = 'runnable' AND o.queue = {q} \
               AND o.concurrency_key = {k} AND o.eligible_at <= $1 AND {filters_o} \
             ORDER BY o.queue, o.concurrency_key, o.eligible_at LIMIT 1) IS NOT NULL"
        )
    };
    format!(
        "WITH RECURSIVE cur AS ( \
           SELECT (SELECT after_key FROM claim_cursors WHERE queue = $11::text) AS k, \
             $9::int8 AS global_limit, $12::timestamptz AS starving, $13::int4 AS key_burst, \
             $14::int8 AS now_ms \
         ), uc AS ( \
           SELECT i.id, i.concurrency_key AS ckey, ({key_i}) AS ord, {guard} AS guard \
           FROM instances i \
           WHERE i.status = 'runnable' AND i.concurrency_key IS NULL AND i.eligible_at <= $1 \
             AND {filters_i} AND {unique} \
           ORDER BY {key_i} \
           LIMIT {limit} \
           FOR UPDATE SKIP LOCKED \
         ), step0 AS ( \
           SELECT 0 AS ph, f.queue AS q, f.concurrency_key AS k FROM cur, LATERAL ( \
             SELECT * FROM ( \
               (SELECT n.queue, n.concurrency_key, 0 AS o FROM instances n \
                WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL \
                  AND cur.k IS NULL AND (cardinality($3::text[]) = 0 OR n.queue = ANY($3)) \
                ORDER BY n.queue, n.concurrency_key LIMIT 1) \
               UNION ALL \
               (SELECT n.queue, n.concurrency_key, 0 AS o FROM instances n \
                WHERE n.status = 'runnable' AND n.concurrency_key IS NOT NULL \
                  AND n.queue = $11::text AND n.concurrency_key > cur.k \
                ORDER BY n.concurrency_key LIMIT 1) \
               UNION ALL \
               (SELECT x.queue, x.concurrency_key, 1 FROM ({first}) x WHERE cur.k IS NOT NULL) \
             ) y ORDER BY o LIMIT 1) f \
         ), scan AS ( \
           SELECT s.ph, s.q, s.k, 1 AS n, s.room, \
             CASE WHEN s.room > 0 THEN CASE WHEN {due_s} THEN 1 ELSE 0 END ELSE 0 END AS got \
           FROM (SELECT CASE WHEN st.ph = 0 AND cur.k IS NOT NULL AND st.k <= cur.k \
                   AND st.q = $11::text THEN 2 ELSE 0 END AS ph, st.q, st.k, {room_st} AS room \
                 FROM step0 st, cur) s \
           UNION ALL \
           SELECT nx.ph, nx.q, nx.k, scan.n + 1, nx.room, \
             scan.got + CASE WHEN nx.room > 0 THEN CASE WHEN {due_nx} THEN 1 ELSE 0 END ELSE 0 END \
           FROM scan, cur, LATERAL ( \
             SELECT z.ph, z.q, z.k, {room_z} AS room FROM ( \
               SELECT * FROM ( \
                 (SELECT scan.ph AS ph, a.queue AS q, a.concurrency_key AS k, 0 AS o \
                  FROM ({next_scan}) a) \
                 UNION ALL \
                 (SELECT 2, b.queue, b.concurrency_key, 1 FROM ({first}) b \
                  WHERE scan.ph = 0 AND cur.k IS NOT NULL) \
               ) y ORDER BY o LIMIT 1) z \
             WHERE NOT (z.ph = 2 AND (z.q, z.k) > ($11::text, cur.k))) nx \
           WHERE scan.n < {keys_max} AND scan.got < $6 \
         ), kc AS ( \
           SELECT h.id, h.ckey, h.ord, h.guard, s.ph, s.room, \
             row_number() OVER (PARTITION BY s.q, s.k ORDER BY h.ord) - 1 AS rnd \
           FROM scan s, LATERAL ( \
             SELECT i.id, i.concurrency_key AS ckey, ({key_i}) AS ord, {guard} AS guard \
             FROM instances i \
             WHERE i.status = 'runnable' AND i.queue = s.q AND i.concurrency_key = s.k \
               AND i.eligible_at <= $1 AND {filters_i} AND {unique} \
             ORDER BY {key_i} LIMIT greatest(s.room, 0)) h \
           WHERE s.room > 0 \
         ), allc AS ( \
           SELECT id, ckey, ord, guard, 0 AS ph, NULL::int4 AS room, \
             row_number() OVER (ORDER BY ord) - 1 AS rnd FROM uc \
           UNION ALL \
           SELECT id, ckey, ord, guard, ph, room, rnd FROM kc \
         ), chosen AS ( \
           SELECT * FROM allc ORDER BY rnd, ord LIMIT {limit} \
         ), lockk AS ( \
           SELECT i.id FROM instances i \
           WHERE i.id IN (SELECT id FROM chosen WHERE ckey IS NOT NULL) AND i.status = 'runnable' \
           FOR UPDATE SKIP LOCKED \
         ), deduped AS ( \
           SELECT c.*, row_number() OVER (PARTITION BY c.guard ORDER BY c.rnd, c.ord) AS gn \
           FROM chosen c WHERE c.ckey IS NULL OR c.id IN (SELECT id FROM lockk) \
         ), numbered AS ( \
           SELECT id, ckey, rnd, ord, ph, room, \
             row_number() OVER (PARTITION BY ckey ORDER BY rnd, ord) - 1 AS kn \
           FROM deduped WHERE guard IS NULL OR gn = 1 \
         ), pick AS ( \
           SELECT * FROM numbered WHERE ckey IS NULL OR kn < room \
         ), fullc AS ( \
           SELECT (SELECT count(*) FROM pick) >= {limit} AS full, \
             (SELECT ckey FROM pick WHERE ckey IS NOT NULL ORDER BY ph DESC, ckey DESC LIMIT 1) AS last, \
             (SELECT k FROM scan ORDER BY n DESC LIMIT 1) AS visited, \
             (SELECT max(n) FROM scan) >= {keys_max} AS bounded \
         ), cw AS ( \
           INSERT INTO claim_cursors (queue, after_key) \
           SELECT $11::text, CASE WHEN f.full THEN f.last ELSE f.visited END FROM fullc f, cur \
           WHERE $11::text IS NOT NULL \
             AND ((f.full AND f.last IS NOT NULL) OR (NOT f.full AND f.bounded)) \
             AND CASE WHEN f.full THEN f.last ELSE f.visited END IS DISTINCT FROM cur.k \
           ON CONFLICT (queue) DO UPDATE SET after_key = excluded.after_key \
           RETURNING 1 \
         ), u AS ( \
           UPDATE instances i SET status = 'executing', lease_owner = $7, \
             lease_expires_at = $8, fencing_token = i.fencing_token + 1, updated_at = $1, \
             key_slot = CASE WHEN pick.ckey IS NULL OR $10::int4 = 1 THEN 0 ELSE \
               coalesce((SELECT s FROM generate_series(0, $10::int4 - 1) s \
                 WHERE NOT EXISTS (SELECT 1 FROM instances e WHERE e.status = 'executing' \
                   AND e.concurrency_key = pick.ckey AND e.key_slot = s) \
                 ORDER BY s OFFSET pick.kn LIMIT 1), 0) END \
           FROM pick WHERE i.id = pick.id \
           RETURNING i.*, pick.rnd AS fair_rnd, pick.ord AS fair_ord \
         ) \
         {claimed} \
         FROM u ORDER BY u.fair_rnd, u.fair_ord",
        due_s = due("s.q", "s.k"),
        due_nx = due("nx.q", "nx.k"),
        room_st = room("st.q", "st.k"),
        room_z = room("z.q", "z.k"),
        next_scan = next_after("scan.q", "scan.k"),
        keys_max = limits::CLAIM_KEYS_SCAN_MAX,
        claimed = claimed_rows(),
    )
}

fn sql(order: Order, only: &str, limit: &str, keys: Keys) -> String {
    let (key_i, key_o) = (key(order, "i"), key(order, "o"));
    let filters_o = filters("o");
    let (key_rule, slot) = match keys {
        Keys::One => (
            format!(
                "NOT EXISTS (SELECT 1 FROM instances e \
                   WHERE e.status = 'executing' AND e.concurrency_key = i.concurrency_key) \
                 AND NOT EXISTS (SELECT 1 FROM instances o \
                   WHERE o.status = 'runnable' AND o.concurrency_key = i.concurrency_key \
                     AND o.eligible_at <= $1 AND {filters_o} AND ({key_o}) < ({key_i}))"
            ),
            "0".to_owned(),
        ),
        Keys::Up => (
            format!(
                "(SELECT count(*) FROM (SELECT 1 FROM instances e \
                   WHERE e.status = 'executing' AND e.concurrency_key = i.concurrency_key \
                   LIMIT $11::int4) ke) \
                 + (SELECT count(*) FROM (SELECT 1 FROM instances o \
                   WHERE o.status = 'runnable' AND o.concurrency_key = i.concurrency_key \
                     AND o.eligible_at <= $1 AND {filters_o} AND ({key_o}) < ({key_i}) \
                   LIMIT $11::int4) ko) < $11::int4"
            ),
            "coalesce((SELECT s FROM generate_series(0, $11::int4 - 1) s \
               WHERE NOT EXISTS (SELECT 1 FROM instances e WHERE e.status = 'executing' \
                 AND e.concurrency_key = pick.ckey AND e.key_slot = s) \
               ORDER BY s OFFSET pick.kn LIMIT 1), 0)"
                .to_owned(),
        ),
    };
    format!(
        "WITH cand AS ( \
           SELECT i.id, i.priority, i.eligible_at, i.concurrency_key AS ckey, ({key_i}) AS ord, \
             CASE WHEN i.unique_key IS NOT NULL AND 'executing' = ANY(i.unique_scope) \
                   AND NOT 'runnable' = ANY(i.unique_scope) THEN i.unique_key END AS guard \
           FROM instances i \
           WHERE i.status = 'runnable' AND i.eligible_at <= $1 {only} AND {filters_i} \
             AND (i.concurrency_key IS NULL OR ({key_rule})) \
             AND (i.unique_key IS NULL OR 'runnable' = ANY(i.unique_scope) \
                  OR NOT 'executing' = ANY(i.unique_scope) \
                  OR NOT EXISTS (SELECT 1 FROM instances g WHERE g.unique_guard = i.unique_key)) \
           ORDER BY {key_i} \
           LIMIT {limit} \
           FOR UPDATE SKIP LOCKED \
         ), pick AS ( \
           SELECT id, ckey, row_number() OVER (PARTITION BY ckey ORDER BY ord) - 1 AS kn \
           FROM (SELECT id, ckey, ord, guard, row_number() OVER \
             (PARTITION BY guard ORDER BY ord) AS rn FROM cand) r \
           WHERE guard IS NULL OR rn = 1 \
         ), u AS ( \
           UPDATE instances i SET status = 'executing', lease_owner = $7, \
             lease_expires_at = $8, fencing_token = i.fencing_token + 1, updated_at = $1, \
             key_slot = {slot} \
           FROM pick WHERE i.id = pick.id \
           RETURNING i.* \
         ) \
         {claimed} \
         FROM u ORDER BY {key_u}",
        key_i = key_i,
        key_u = key(order, "u"),
        filters_i = filters("i"),
        claimed = claimed_rows(),
    )
}

/// Takes the claim lock of the claim's queue for the rest of the transaction: claims of a
/// queue with a global limit run one at a time, each counting the executing rows that
/// the previous ones committed. The lock lives only as long as the short claim
/// transaction; no connection is held while steps run.
pub(crate) async fn lock_queue<C: GenericClient + Sync>(c: &C, p: &ClaimParams) -> OpResult<()> {
    let stmt = c
        .prepare_cached(
            "SELECT pg_advisory_xact_lock(hashtextextended('keel claim ' || current_schema() || ' ' || q, 0)) \
             FROM unnest($1::text[]) AS q ORDER BY q",
        )
        .await?;
    c.query(&stmt, &[&p.queues]).await?;
    Ok(())
}

/// Reads the claim's queue's rate bucket and returns it refilled, with the claim's limit
/// lowered to the tokens it holds (the core's token bucket). Runs under the queue's
/// claim lock.
pub(crate) async fn rate_room<C: GenericClient + Sync>(
    c: &C,
    p: &ClaimParams,
) -> OpResult<Option<(plan::claim::Bucket, usize)>> {
    if p.policy.rate.is_none() {
        return Ok(None);
    }
    let stmt = c
        .prepare_cached(
            "SELECT millitokens, floor(extract(epoch FROM at) * 1000)::int8, carry, backlog \
             FROM rate_buckets WHERE queue = $1",
        )
        .await?;
    let stored = c.query_opt(&stmt, &[&p.queues[0]]).await?.map(|r| plan::claim::Bucket {
        millitokens: r.get(0),
        at: Timestamp(r.get(1)),
        carry: r.get(2),
        backlog: r.get(3),
    });
    let mut planner = plan::claim::ClaimPlanner::new(p);
    Ok(planner.rate(stored).map(|refilled| (refilled, planner.cap())))
}

/// Stores the bucket after a rate-limited claim took `taken` rows.
pub(crate) async fn rate_spent<C: GenericClient + Sync>(
    c: &C,
    p: &ClaimParams,
    refilled: plan::claim::Bucket,
    taken: usize,
) -> OpResult<()> {
    let left = plan::claim::RateLimit::after_claim(refilled, p.limit, taken);
    let stmt = c
        .prepare_cached(
            "INSERT INTO rate_buckets (queue, millitokens, at, carry, backlog) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (queue) DO UPDATE SET \
               millitokens = excluded.millitokens, at = excluded.at, carry = excluded.carry, \
               backlog = excluded.backlog",
        )
        .await?;
    c.execute(&stmt, &[&p.queues[0], &left.millitokens, &ts(left.at), &left.carry, &left.backlog])
        .await?;
    Ok(())
}

/// Stores the per-key buckets after a claim under a per-key rate limit took `taken` rows
/// of each key (`plan::claim::key_bucket_after` from the stored bucket, for the keys that
/// took rows), and deletes up to `KEY_RATE_BUCKETS_PRUNE_MAX` of the queue's buckets that
/// are full and whose key has no ready row. Runs under the queue's claim lock, like the
/// claim it follows.
pub(crate) async fn key_rate_spent<C: GenericClient + Sync>(
    c: &C,
    p: &ClaimParams,
    taken: &std::collections::BTreeMap<String, usize>,
) -> OpResult<()> {
    if p.policy.key_rate.is_none() {
        return Ok(());
    }
    let queue = &p.queues[0];
    let keys: Vec<&str> = taken.keys().map(String::as_str).collect();
    let read = c
        .prepare_cached(
            "SELECT concurrency_key, millitokens, at_ms, carry, backlog FROM key_rate_buckets \
             WHERE queue = $1 AND concurrency_key = ANY($2::text[])",
        )
        .await?;
    let stored: HashMap<String, plan::claim::Bucket> = c
        .query(&read, &[queue, &keys])
        .await?
        .iter()
        .map(|r| {
            let bucket = plan::claim::Bucket {
                millitokens: r.get(1),
                at: Timestamp(r.get(2)),
                carry: r.get(3),
                backlog: r.get(4),
            };
            (r.get::<_, String>(0), bucket)
        })
        .collect();
    let written: Vec<plan::claim::KeyBucket> = taken
        .iter()
        .filter_map(|(key, n)| {
            plan::claim::key_bucket_after(
                &p.policy,
                key,
                stored.get(key).copied(),
                p.now,
                p.limit,
                *n,
            )
        })
        .collect();
    let millitokens: Vec<i64> = written.iter().map(|k| k.bucket.millitokens).collect();
    let at: Vec<i64> = written.iter().map(|k| k.bucket.at.0).collect();
    let carry: Vec<i64> = written.iter().map(|k| k.bucket.carry).collect();
    let backlog: Vec<bool> = written.iter().map(|k| k.bucket.backlog).collect();
    let times: Vec<String> = written
        .iter()
        .map(|k| {
            let list: Vec<String> = k.token_times.iter().map(|t| t.0.to_string()).collect();
            format!("{{{}}}", list.join(","))
        })
        .collect();
    let full_at: Vec<i64> = written.iter().map(|k| k.full_at.0).collect();
    let write = c
        .prepare_cached(&format!(
            "WITH gc AS ( \
               DELETE FROM key_rate_buckets d WHERE (d.queue, d.concurrency_key) IN ( \
                 SELECT b.queue, b.concurrency_key FROM key_rate_buckets b \
                 WHERE b.queue = $1 AND b.full_at_ms <= $9 \
                   AND NOT (b.concurrency_key = ANY($2::text[])) \
                   AND NOT EXISTS (SELECT 1 FROM instances i WHERE i.status = 'runnable' \
                     AND i.queue = b.queue AND i.concurrency_key = b.concurrency_key) \
                 ORDER BY b.full_at_ms LIMIT {prune}) \
               RETURNING 1 \
             ) \
             INSERT INTO key_rate_buckets \
               (queue, concurrency_key, millitokens, at_ms, carry, backlog, token_times, full_at_ms) \
             SELECT $1, u.k, u.m, u.a, u.c, u.b, u.t::int8[], u.f \
             FROM unnest($2::text[], $3::int8[], $4::int8[], $5::int8[], $6::bool[], $7::text[], \
               $8::int8[]) AS u(k, m, a, c, b, t, f) \
             ON CONFLICT (queue, concurrency_key) DO UPDATE SET \
               millitokens = excluded.millitokens, at_ms = excluded.at_ms, \
               carry = excluded.carry, backlog = excluded.backlog, \
               token_times = excluded.token_times, full_at_ms = excluded.full_at_ms",
            prune = limits::KEY_RATE_BUCKETS_PRUNE_MAX,
        ))
        .await?;
    let keys: Vec<&str> = written.iter().map(|k| k.key.as_str()).collect();
    c.execute(
        &write,
        &[queue, &keys, &millitokens, &at, &carry, &backlog, &times, &full_at, &p.now.0],
    )
    .await?;
    Ok(())
}

/// What one claim statement returned: the claims to hand out, and the claimed rows that
/// could not be decoded (each with the decode error), which [`poison`] dead-letters.
#[derive(Default)]
pub(crate) struct Claimed {
    pub(crate) claims: Vec<Claim>,
    pub(crate) undecodable: Vec<(Instance, String)>,
}

/// Runs the claim statement (autocommit: the claim is its own short transaction). A row
/// whose context, result, inbox or children cannot be decoded is set aside, never an error
/// for the whole batch.
pub(crate) async fn run<C: GenericClient + Sync>(
    c: &C,
    p: &ClaimParams,
    ids: Option<&[i64]>,
) -> OpResult<Claimed> {
    if p.limit == 0 || ids.is_some_and(<[i64]>::is_empty) {
        return Ok(Claimed::default());
    }
    let names: Vec<&str> = p.machines.iter().map(|m| m.name.as_str()).collect();
    let versions: Vec<i32> = p.machines.iter().map(|m| m.version).collect();
    let limit = p.limit as i64;
    let expires = ts(p.now.plus(p.lease));
    let now = ts(p.now);
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
        vec![&now, &p.namespaces, &p.queues, &names, &versions, &limit, &p.worker.0, &expires];
    let policy = &p.policy;
    let ids_vec: Option<Vec<i64>> = ids.map(<[i64]>::to_vec);
    let global = policy.global_limit.map(i64::from);
    let key_limit = i32::try_from(policy.key_limit).unwrap_or(i32::MAX);
    let starving = policy.starving_at_or_before(p.now).map(ts);
    let cursor_queue: Option<&str> = plan::claim::cursor_queue(p);
    let key_burst: Option<i32> = policy.key_rate.map(|r| {
        let full = plan::claim::key_rate_room(&r.refill(None, p.now));
        i32::try_from(full).unwrap_or(i32::MAX)
    });
    let now_ms = p.now.0;
    let stmt = match &ids {
        Some(ids) if policy.is_plain_priority() => {
            params.push(ids);
            c.prepare_cached(&SQL_IDS).await?
        }
        Some(_) => {
            params.push(&ids_vec);
            params.push(&global);
            params.push(&key_limit);
            let sql: &str = match (policy.strategy, &starving) {
                (Strategy::Fifo, _) => &SQL_IDS_FIFO,
                (Strategy::Priority, None) => &SQL_IDS_PRIORITY,
                (Strategy::Priority, Some(bound)) => {
                    params.push(bound);
                    &SQL_IDS_RANKED
                }
            };
            c.prepare_cached(sql).await?
        }
        None => {
            params.push(&global);
            params.push(&key_limit);
            params.push(&cursor_queue);
            // The plain picker first: it claims nothing while a ready row with a key waits
            // in the claim's queues (nothing to be fair between otherwise). Only when it
            // claimed nothing does one index probe decide whether the fair statement, whose
            // planning alone costs milliseconds, runs: the hot path of work without keys
            // is one statement, and the probe's planning is paid only by empty claims.
            let limited = global.is_some();
            let unkeyed: &str = match (policy.strategy, &starving, limited) {
                (Strategy::Fifo, _, false) => &UNKEYED_FIFO,
                (Strategy::Fifo, _, true) => &UNKEYED_FIFO_LIMITED,
                (Strategy::Priority, None, false) => &UNKEYED_PRIORITY,
                (Strategy::Priority, None, true) => &UNKEYED_PRIORITY_LIMITED,
                (Strategy::Priority, Some(_), false) => &UNKEYED_RANKED,
                (Strategy::Priority, Some(_), true) => &UNKEYED_RANKED_LIMITED,
            };
            let plain = c.prepare_cached(unkeyed).await?;
            let mut plain_params = params.clone();
            if let Some(bound) = &starving {
                plain_params.push(bound);
            }
            let found = c.query(&plain, &plain_params).await?;
            if !found.is_empty() {
                return decode(&found);
            }
            if !keyed_ready(c, &p.queues).await? {
                return Ok(Claimed::default());
            }
            params.push(&starving);
            params.push(&key_burst);
            params.push(&now_ms);
            let sql: &str = match (policy.strategy, starving.is_some(), limited) {
                (Strategy::Fifo, _, false) => &FAIR_FIFO,
                (Strategy::Fifo, _, true) => &FAIR_FIFO_LIMITED,
                (Strategy::Priority, false, false) => &FAIR_PRIORITY,
                (Strategy::Priority, false, true) => &FAIR_PRIORITY_LIMITED,
                (Strategy::Priority, true, false) => &FAIR_RANKED,
                (Strategy::Priority, true, true) => &FAIR_RANKED_LIMITED,
            };
            c.prepare_cached(sql).await?
        }
    };
    let found = c.query(&stmt, &params).await?;
    decode(&found)
}

/// Splits claimed rows into claims and the rows that could not be decoded.
fn decode(found: &[tokio_postgres::Row]) -> OpResult<Claimed> {
    let mut out = Claimed::default();
    for r in found {
        let instance = rows::instance(r)?;
        if let Some(damage) = instance.damage() {
            out.undecodable.push((instance, damage));
            continue;
        }
        let inbox = rows::col(r, 30).and_then(|v| inbox(instance.id, v));
        let children = rows::col(r, 31).and_then(children);
        match (inbox, children) {
            (Ok(inbox), Ok(children)) => out.claims.push(Claim { instance, inbox, children }),
            (Err(e), _) => out.undecodable.push((instance, format!("inbox: {}", e.message))),
            (_, Err(e)) => out.undecodable.push((instance, format!("children: {}", e.message))),
        }
    }
    Ok(out)
}

/// Dead-letters claimed rows that could not be decoded, as the core's
/// `plan::claim::undecodable` decides, in one transaction. A row that is no longer executing under this claim's token
/// (cancelled meanwhile, say) is left alone. The write keeps the stored undecodable values.
pub(crate) async fn poison<C: GenericClient + Sync>(
    c: &C,
    rows_in: &[(Instance, String)],
    now: Timestamp,
) -> OpResult<()> {
    begin(c).await?;
    let mut ids: Vec<i64> = rows_in.iter().map(|(r, _)| r.id.0).collect();
    ids.sort_unstable();
    let current: HashMap<i64, Instance> =
        rows::lock_instances(c, &ids).await?.into_iter().map(|r| (r.id.0, r)).collect();
    let mut writes = Vec::new();
    let mut history = HistoryWrite::default();
    let mut letters = Vec::new();
    for (claimed, error) in rows_in {
        let Some(now_row) = current.get(&claimed.id.0) else { continue };
        if now_row.status != Status::Executing || now_row.fencing_token != claimed.fencing_token {
            continue;
        }
        let applied = plan::claim::undecodable(now_row, error, now);
        for entry in applied.history {
            history.push(&applied.row, now_row.attempt, now, entry);
        }
        letters.extend(applied.dead_letter);
        writes.push(applied.row);
    }
    rows::write_instances(c, &writes).await?;
    rows::write_history(c, &history).await?;
    commit::write_dead_letters(c, &letters, now).await?;
    end_tx(c, None).await
}

fn bad(what: &str) -> StoreError {
    StoreError::conflict(format!("claim: malformed {what} JSON from the database"))
}

/// Decodes the inbox JSON built by the claim statement.
pub(crate) fn inbox(target: InstanceId, v: Value) -> Result<Vec<Signal>, StoreError> {
    let Value::Array(items) = v else { return Err(bad("inbox")) };
    items
        .into_iter()
        .map(|mut s| {
            Ok(Signal {
                id: SignalId(s["id"].as_i64().ok_or_else(|| bad("inbox id"))?),
                target,
                name: s["name"].as_str().ok_or_else(|| bad("inbox name"))?.to_owned(),
                payload: s["payload"].take(),
                dedup_key: s["dedup_key"].as_str().map(str::to_owned),
                priority: s["priority"]
                    .as_i64()
                    .and_then(|p| i16::try_from(p).ok())
                    .and_then(keel_core::Priority::from_level),
                inserted_at: Timestamp(s["at"].as_i64().ok_or_else(|| bad("inbox time"))?),
            })
        })
        .collect()
}

/// Decodes the children JSON built by the claim statement.
pub(crate) fn children(v: Value) -> Result<Vec<ChildSummary>, StoreError> {
    let Value::Array(items) = v else { return Err(bad("children")) };
    items
        .into_iter()
        .map(|mut c| {
            let opt = |v: Value| match v {
                Value::Array(mut a) if a.len() == 1 => a.pop(),
                _ => None,
            };
            Ok(ChildSummary {
                id: InstanceId(c["id"].as_i64().ok_or_else(|| bad("child id"))?),
                machine: MachineRef {
                    name: c["machine"].as_str().ok_or_else(|| bad("child machine"))?.to_owned(),
                    version: c["version"].as_i64().ok_or_else(|| bad("child version"))? as i32,
                },
                status: rows::status(c["status"].as_str().ok_or_else(|| bad("child status"))?)?,
                position: c["position"].as_str().ok_or_else(|| bad("child position"))?.to_owned(),
                context: c["context"].take(),
                result: opt(c["result"].take()),
                last_error: c["last_error"].as_str().map(str::to_owned),
            })
        })
        .collect()
}
