//! Named bounds on everything a caller can make large. Backends enforce them
//! with `Invalid` errors, and the conformance suite tests each one at the bound.

/// Most instances one `instance_insert` call may carry.
pub const INSERT_BATCH_MAX: usize = 10_000;
/// Most instances one page of a chart version migration reads.
pub const MIGRATE_BATCH_MAX: usize = 1_000;
/// Most instances one page of `instance_prune` reads (and so deletes).
pub const PRUNE_BATCH_MAX: usize = 10_000;
/// Most rows one `instance_claim` call may return.
pub const CLAIM_BATCH_MAX: usize = 1_000;
/// Most concurrency keys one fair claim visits (in rotation order) while it looks for keys
/// with room; a claim that reaches it stops there and the next claim carries on after the
/// last key it visited, so keys further on are served by later claims, never skipped.
pub const CLAIM_KEYS_SCAN_MAX: usize = 1_000;
/// Most rows of one concurrency key a claim takes under a per-key rate limit (however
/// many tokens the key's bucket holds): the stores keep this many of a bucket's next token
/// times, so a claim can count a key's tokens without the bucket's arithmetic.
pub const KEY_RATE_ROOM_MAX: usize = 100;
/// Most per-key rate buckets one claim deletes (buckets that are full and whose key has no
/// ready row in the queue: a new bucket would hold the same tokens or fewer).
pub const KEY_RATE_BUCKETS_PRUNE_MAX: usize = 100;
/// Most step results one `step_commit` call may carry.
pub const COMMIT_BATCH_MAX: usize = 1_000;
/// Most signals one `signal_deliver` call may carry.
pub const DELIVER_BATCH_MAX: usize = 10_000;
/// Most inbox signals a claim hands to a step; older ones first, the rest wait.
pub const CLAIM_INBOX_MAX: usize = 64;
/// Most signals an instance's detail lists (`Store::instance_get`): the oldest.
pub const INBOX_LIST_MAX: usize = 1_000;
/// Most pending signals (id and name) the history entry of a drained inbox lists; its
/// count covers every signal removed. An instance's inbox is drained when it ends.
pub const INBOX_DRAIN_LISTED_MAX: usize = 16;
/// Most children one `ScheduleChildren` outcome may spawn.
pub const CHILDREN_PER_STEP_MAX: usize = 1_000;
/// Most children summaries a claim or an inspect returns.
pub const CHILDREN_LIST_MAX: usize = 1_000;
/// Most history entries one step commit may append.
pub const HISTORY_PER_STEP_MAX: usize = 256;
/// Most events one step commit may emit to other instances.
pub const EMIT_PER_STEP_MAX: usize = 1_000;
/// Largest serialized context, payload or result, in bytes (1 MiB).
pub const PAYLOAD_BYTES_MAX: usize = 1 << 20;
/// Most attempt errors kept on an instance and copied into a dead letter.
pub const ATTEMPT_ERRORS_MAX: usize = 100;
/// Longest error message kept, in bytes; longer ones are cut at a char boundary.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 8 * 1024;
/// Deepest chain of children a cascading cancel follows.
pub const CANCEL_CASCADE_DEPTH_MAX: usize = 32;
/// Most instances one cancel (with its cascade) may touch.
pub const CANCEL_CASCADE_MAX: usize = 10_000;
/// Most ids one `instance_rows` call reads.
pub const ROWS_BATCH_MAX: usize = 1_000;
/// Most instances one `instance_list` page returns.
pub const INSTANCE_LIST_MAX: usize = 1_000;
/// Most history rows an inspect returns (newest last); older ones are read a page at a
/// time with `Store::history_page`.
pub const HISTORY_LIST_MAX: usize = 1_000;
/// Most history rows one `Store::history_page` call returns.
pub const HISTORY_PAGE_MAX: usize = 1_000;
/// Most history entries a retention may keep per instance (`history_per_instance`): a
/// trimming pass reads up to this many index entries of each instance it visits.
pub const HISTORY_KEEP_MAX: usize = 100_000;
/// Most dead letters one list or retry-by-machine call touches.
pub const DEAD_LETTER_BATCH_MAX: usize = 10_000;
/// Most rows one reap call returns to runnable.
pub const REAP_BATCH_MAX: usize = 10_000;
/// Longest name (machine, step, signal, queue, namespace, key), in bytes.
pub const NAME_BYTES_MAX: usize = 256;
/// Most instances one broadcast may reach.
pub const BROADCAST_MAX: usize = 100_000;
/// Most timers one step commit may arm (and, separately, cancel).
pub const TIMERS_PER_STEP_MAX: usize = 256;
/// Most due timers one sweep call fires.
pub const TIMER_SWEEP_BATCH_MAX: usize = 10_000;
/// Most armed timers one `timers_retime` call reads.
pub const TIMER_RETIME_BATCH_MAX: usize = 1_000;
/// Most deployed timers one `timers_retime` call matches against.
pub const TIMER_RETIME_SPECS_MAX: usize = 10_000;
/// Most timers an inspect returns.
pub const TIMER_LIST_MAX: usize = 1_000;
/// Deepest nesting of arrays and objects in a JSON value a caller hands Keel from outside
/// (a new instance's context, a delivered or broadcast payload). Common JSON readers,
/// serde_json included, stop at 128 levels; see [`JSON_DEPTH_STORED_MAX`] for the room
/// this leaves.
pub const JSON_DEPTH_MAX: usize = 64;
/// Deepest nesting of a JSON value a step commit may store (outcome contexts and results,
/// emitted payloads, children, history data, the failing event). Above
/// [`JSON_DEPTH_MAX`] because the engine wraps callers' values before committing them (a
/// region task carries the chart context two levels down; history and dead letters carry
/// an event one level down), and below 128 because stores wrap values again when they read
/// them back (a claim returns a child's result three levels down).
pub const JSON_DEPTH_STORED_MAX: usize = 100;
/// Longest delay of a `Retry` outcome (one year). A longer one is almost certainly a unit
/// mistake; park the instance on a signal or a timer instead.
pub const RETRY_DELAY_MAX: std::time::Duration = std::time::Duration::from_secs(366 * 86_400);
/// Longest timer interval (`after`, `every`, a delegation's `@timeout`): ten years of days.
pub const TIMER_INTERVAL_MAX: std::time::Duration = std::time::Duration::from_secs(3_660 * 86_400);
/// Latest time a caller may name (`NewInstance::eligible_at`): the last millisecond of the
/// year 9999, the end of the calendar that every store and date library represents exactly.
pub const TIMESTAMP_MAX: crate::time::Timestamp = crate::time::Timestamp(253_402_300_799_999);
/// Most "a commit armed a timer" hints a store keeps for sweepers that have not read them
/// yet; a sweeper that falls further behind reads the earliest due time from the store.
pub const TIMER_HINTS_MAX: usize = 1_024;
/// Largest chart definition accepted as JSON text; a chart that big is better split into child
/// machines, and the bound keeps a hostile file from exhausting memory while parsing.
pub const DEFINITION_JSON_BYTES_MAX: usize = 4 << 20;
/// Largest chart definition accepted as SCXML text, for the same reasons as the JSON bound.
pub const DEFINITION_SCXML_BYTES_MAX: usize = 4 << 20;
/// Deepest nesting of states an SCXML document may have; the importer recurses once per
/// level, and no real chart comes near it.
pub const SCXML_DEPTH_MAX: usize = 64;
/// Most hints one `Queue::enqueue` call may carry (and receipts one `Queue::ack` call);
/// backends with smaller native batches split them.
pub const HINT_BATCH_MAX: usize = 1_000;
/// Most rows one `Store::instance_ready_stale` page returns: the repair pass publishes a
/// page as one batch of hints.
pub const READY_STALE_BATCH_MAX: usize = HINT_BATCH_MAX;
/// Most `Store::instance_ready_stale` pages one repair pass reads before it waits for its
/// next turn (the cursor carries on from there), so one pass is bounded even with a huge
/// backlog.
pub const REPAIR_PAGES_MAX: usize = 100;
/// Most hints one `Queue::receive` call may return.
pub const HINT_RECEIVE_MAX: usize = 100;
/// Longest a `Queue::receive` call may wait for its first hint (the SQS long-poll bound).
pub const HINT_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(20);
/// Longest receipt a queue hands out and takes back, in bytes (SQS receipts are ~1 KiB).
pub const HINT_RECEIPT_BYTES_MAX: usize = 4 * 1024;
