//! The Lua scripts behind every queue operation. Each runs atomically on the server and
//! reads the server's clock (`TIME`), so clients with skewed clocks agree on leases.
//!
//! Keys of one queue (all sharing one hash tag, so they live on one cluster slot):
//! `vis` — sorted set, member = hint id (`<instance>:<revision>`), score = the millisecond
//! from which it may be handed out (its delay's end, or its lease's end once received);
//! `body` — hash, hint id → the encoded hint; `count` — hash, hint id → times received;
//! `wake` — a short list that receivers block on, pushed when hints become visible.

use redis::Script;
use std::sync::LazyLock;

/// The server time in milliseconds, shared by every script.
const NOW: &str =
    "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n";

/// Most wake tokens kept for receivers that are not waiting yet.
pub const WAKE_TOKENS_MAX: usize = 64;

/// Most entries one publish removes to bring the queue back to its capacity: enough for
/// a full batch of new hints, with room to shrink a queue whose capacity was lowered.
pub const TRIM_MAX: usize = 2 * keel_core::limits::HINT_BATCH_MAX;

/// KEYS: vis, body, count, wake. ARGV: the queue's capacity, then triples of (id, delay
/// ms, body). Adds each hint that is not queued yet. A hint already waiting and never received stays as it is (the
/// same instance and revision say the same thing). A hint that was received since its
/// publish is published anew: its receive count goes up by one, so the receipt handed out
/// for it is stale and its ack removes nothing, and it becomes visible again at
/// `now + delay` even while leased. Otherwise the receiver of the old delivery would ack
/// the new publish away. Then pushes wake tokens for the receivers. Last, while the queue
/// holds more hints than its capacity, removes the hints that were visible before this
/// millisecond, lowest score first (visible the longest without a receiver), at most
/// `TRIM_MAX` a call, and returns how many it removed. A delayed or leased hint is never
/// removed, nor one published in this call: a queue full of those stays over its capacity
/// until they become visible, and a later publish trims it.
pub static ENQUEUE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
local added = 0
for i = 2, #ARGV, 3 do
  local at = now + tonumber(ARGV[i + 1])
  if redis.call('ZADD', KEYS[1], 'NX', at, ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
    added = added + 1
  elseif redis.call('HEXISTS', KEYS[3], ARGV[i]) == 1 then
    redis.call('HINCRBY', KEYS[3], ARGV[i], 1)
    redis.call('ZADD', KEYS[1], 'XX', at, ARGV[i])
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
    added = added + 1
  end
end
if added > 0 then
  for i = 1, math.min(added, {WAKE_TOKENS_MAX}) do redis.call('LPUSH', KEYS[4], 1) end
  redis.call('LTRIM', KEYS[4], 0, {WAKE_TOKENS_MAX} - 1)
end
local over = math.min(redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1]), {TRIM_MAX})
local dropped = 0
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('(%d', now), 'LIMIT', 0, over)) do
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    dropped = dropped + 1
  end
end
return dropped"
    ))
});

/// KEYS: vis, body, count. ARGV: max, visibility ms. Leases up to `max` visible hints
/// (their score moves to the lease's end, which is also how a crashed receiver's hints
/// come back) and returns `{ms until the next one is visible or -1, id, count, body, …}`.
pub static RECEIVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local out = {{-1}}
for _, id in ipairs(ids) do
  local body = redis.call('HGET', KEYS[2], id)
  if body then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    local count = redis.call('HINCRBY', KEYS[3], id, 1)
    table.insert(out, id)
    table.insert(out, count)
    table.insert(out, body)
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
if #out == 1 then
  local next = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if next[2] then out[1] = math.max(tonumber(next[2]) - now, 0) end
end
return out"
    ))
});

/// KEYS: vis, body, count. ARGV: pairs of (id, count). Removes each hint whose receipt is
/// current; a stale or repeated ack changes nothing.
pub static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local removed = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[3], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
    removed = removed + 1
  end
end
return removed",
    )
});

/// KEYS: vis, count, wake. ARGV: id, count, ms, wake (0/1). Moves a hint whose receipt
/// is current to `now + ms` (a nack's delay or an extended lease); returns 0 for a stale
/// receipt. With `wake`, pushes a token so a waiting receiver looks again.
pub static RESCHEDULE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[3]), ARGV[1]) == 0
   and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
if ARGV[4] == '1' then
  redis.call('LPUSH', KEYS[3], 1)
  redis.call('LTRIM', KEYS[3], 0, {WAKE_TOKENS_MAX} - 1)
end
return 1"
    ))
});
