//! What a commit needs to know about an instance's inbox, asked in SQL: whether any signal
//! is there, whether an awaited one is unread, the most urgent unread priority, the unread
//! timer fires and child notices it may withdraw, and for an ending instance how many
//! signals it leaves unread with the oldest of them. None of these reads a payload or
//! returns more than [`limits::INBOX_DRAIN_LISTED_MAX`] signals (or the unread fires) per
//! instance, so a commit of an instance with a long inbox, or with large payloads, costs a
//! scan of its inbox's index in SQLite rather than decoding every signal in it.

use crate::error::corrupt;
use crate::rows::Db;
use keel_core::inbox::{self, Pending};
use keel_core::instance::ANY_SIGNAL;
use keel_core::limits;
use keel_core::plan::commit::{self, InboxRead, UnreadFire};
use keel_core::{InstanceId, Outcome, Priority, SignalId, StepCommit, StoreResult};
use serde_json::json;
use sqlx::Row;
use std::collections::HashMap;

/// Whether signal `s` is a fire a commit may withdraw (what `UnreadFire::read` accepts):
/// a timer's fire, whose dedup key starts with the fire prefix and whose payload names
/// the state that owned the timer as a string (a payload that is not JSON is no fire), or
/// a child's notice, whose dedup key is `child:<id>:terminal` and whose name is
/// `done.invoke.<state>` or `fail.state.<state>`. Never NULL: a signal without a dedup key
/// is no fire (a NULL here would leave it out of the await check too).
macro_rules! is_fire {
    () => {
        "coalesce((substr(s.dedup_key, 1, 6) = 'timer:' AND \
           CASE WHEN json_valid(s.payload) THEN json_type(s.payload, '$.state') END = 'text') \
          OR (substr(s.dedup_key, 1, 6) = 'child:' AND substr(s.dedup_key, -9) = ':terminal' \
              AND (substr(s.name, 1, 12) = 'done.invoke.' \
                   OR substr(s.name, 1, 11) = 'fail.state.')), 0)"
    };
}

/// The asks, one JSON array per item: `[id, consumed ids, awaited name or null, awaits
/// any name, may withdraw fires, drains]`; `consumed` is a JSON array of signal ids.
macro_rules! asks {
    () => {
        "(SELECT json_extract(j.value, '$[0]') AS id, json_extract(j.value, '$[1]') AS consumed, \
           json_extract(j.value, '$[2]') AS awaits, json_extract(j.value, '$[3]') AS any_name, \
           json_extract(j.value, '$[4]') AS fires, json_extract(j.value, '$[5]') AS drains \
         FROM json_each(?) j) a"
    };
}

/// The unread signals of `a`'s instance.
macro_rules! unread {
    () => {
        "s.target_id = a.id AND s.id NOT IN (SELECT value FROM json_each(a.consumed))"
    };
}

/// Per item: whether its inbox holds any signal (consumed ones too); the most urgent
/// priority among its unread signals, asked only where a signal raised the row's claim
/// priority above its own (otherwise no pending signal is more urgent than the row's own
/// priority, which the commit keeps); whether a signal it awaits is unread (fires and notices
/// left out for an item that may withdraw them: [`FIRES_SQL`] reads those); and, for an
/// item that ends its instance, how many signals it leaves unread.
pub(crate) const FACTS_SQL: &str = concat!(
    "SELECT a.id, EXISTS (SELECT 1 FROM keel_signals s WHERE s.target_id = a.id), \
       CASE WHEN EXISTS (SELECT 1 FROM keel_instances i \
                         WHERE i.id = a.id AND i.priority <> i.base_priority) \
         THEN (SELECT min(s.priority) FROM keel_signals s WHERE ",
    unread!(),
    " AND s.priority IS NOT NULL) END, \
       a.awaits IS NOT NULL AND EXISTS (SELECT 1 FROM keel_signals s WHERE ",
    unread!(),
    " AND (a.any_name OR s.name = a.awaits) AND NOT (a.fires AND ",
    is_fire!(),
    ")), \
       CASE WHEN a.drains THEN (SELECT count(*) FROM keel_signals s WHERE ",
    unread!(),
    ") ELSE 0 END \
     FROM ",
    asks!()
);

/// The unread timer fires and child notices of the items that may withdraw them, oldest
/// first per item.
pub(crate) const FIRES_SQL: &str = concat!(
    "SELECT s.target_id, s.id, s.name, \
       CASE WHEN substr(s.dedup_key, 1, 6) = 'timer:' THEN json_extract(s.payload, '$.state') END, \
       s.dedup_key \
     FROM ",
    asks!(),
    " JOIN keel_signals s ON ",
    unread!(),
    " WHERE a.fires AND ",
    is_fire!(),
    " ORDER BY s.target_id, s.id"
);

/// The oldest unread signals of each item (at most the second parameter each), by id and
/// name, each item's read stopping at the bound.
pub(crate) const PENDING_SQL: &str = concat!(
    "SELECT s.target_id, s.id, s.name FROM ",
    asks!(),
    " JOIN keel_signals s ON s.id IN (SELECT s.id FROM keel_signals s WHERE ",
    unread!(),
    " ORDER BY s.id LIMIT +?) ORDER BY s.target_id, s.id"
);

/// What one item asks of its instance's inbox.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask<'a> {
    pub id: InstanceId,
    pub consumed: &'a [SignalId],
    /// The signal an `Await` outcome waits for.
    pub awaits: Option<&'a str>,
    /// The commit may withdraw unread timer fires and child notices
    /// ([`commit::withdraws_fires`]).
    pub fires: bool,
    /// The commit ends the instance ([`inbox::drains`]).
    pub drains: bool,
}

impl<'a> Ask<'a> {
    /// What committing `c` asks.
    pub(crate) fn of(c: &'a StepCommit) -> Self {
        Ask {
            id: c.id,
            consumed: &c.consume,
            awaits: match &c.outcome {
                Outcome::Await { signal, .. } => Some(signal.as_str()),
                _ => None,
            },
            fires: commit::withdraws_fires(c),
            drains: inbox::drains(&c.outcome),
        }
    }

    /// The pending signals of an instance that ends without consuming any (a cancel).
    pub(crate) fn ending(id: InstanceId) -> Self {
        Ask { id, consumed: &[], awaits: None, fires: false, drains: true }
    }
}

/// The answers for one item.
#[derive(Debug, Clone, Default)]
pub(crate) struct Facts {
    /// Whether the inbox holds any signal, consumed ones included.
    pub any: bool,
    /// The facts with the unread fires left out of them.
    read: InboxRead,
    /// The unread fires, for [`InboxRead::with_fires`] (which needs the commit).
    fires: Vec<UnreadFire>,
}

impl Facts {
    /// The commit's inbox facts for `c`, the item these facts were asked for.
    pub(crate) fn read(&self, c: &StepCommit) -> InboxRead {
        self.read.clone().with_fires(c, self.fires.clone())
    }

    /// The signals left unread (for an [`Ask::ending`] or a draining commit).
    pub(crate) fn pending(&self) -> &Pending {
        &self.read.pending
    }
}

impl Db<'_> {
    /// The inbox facts of `asks`, by instance (an instance asked twice keeps the last ask's
    /// answers): one statement, plus one for the unread fires when an item may withdraw
    /// them and one for the oldest pending signals when an ending item leaves any.
    pub(crate) async fn inbox_facts(
        &mut self,
        asks: &[Ask<'_>],
    ) -> StoreResult<HashMap<InstanceId, Facts>> {
        let mut out: HashMap<InstanceId, Facts> = HashMap::with_capacity(asks.len());
        if asks.is_empty() {
            return Ok(out);
        }
        let json = asks_json(asks.iter());
        let rows = sqlx::query(FACTS_SQL)
            .bind(&json)
            .fetch_all(&mut *self.conn)
            .await
            .map_err(self.err("reading inbox facts"))?;
        let mut listed = Vec::new();
        for r in &rows {
            let id = InstanceId(r.try_get(0).map_err(|e| corrupt(self.file, "id", e))?);
            let any: bool = r.try_get(1).map_err(|e| corrupt(self.file, "signals", e))?;
            let urgent: Option<i64> =
                r.try_get(2).map_err(|e| corrupt(self.file, "priority", e))?;
            let waiting: bool = r.try_get(3).map_err(|e| corrupt(self.file, "signals", e))?;
            let unread: i64 = r.try_get(4).map_err(|e| corrupt(self.file, "signals", e))?;
            let pending_priority = urgent
                .map(|p| {
                    i16::try_from(p)
                        .ok()
                        .and_then(Priority::from_level)
                        .ok_or_else(|| corrupt(self.file, "priority", p))
                })
                .transpose()?;
            if unread > 0 {
                listed.push(id);
            }
            let read = InboxRead {
                signal_waiting: waiting,
                pending: Pending { count: u64::try_from(unread).unwrap_or(0), oldest: Vec::new() },
                pending_priority,
                withdrawn: Vec::new(),
            };
            out.insert(id, Facts { any, read, fires: Vec::new() });
        }
        if !listed.is_empty() {
            let json = asks_json(asks.iter().filter(|a| listed.contains(&a.id)));
            let rows = sqlx::query(PENDING_SQL)
                .bind(json)
                .bind(limits::INBOX_DRAIN_LISTED_MAX as i64)
                .fetch_all(&mut *self.conn)
                .await
                .map_err(self.err("reading pending signals"))?;
            for r in &rows {
                let target: i64 = r.try_get(0).map_err(|e| corrupt(self.file, "target_id", e))?;
                let id: i64 = r.try_get(1).map_err(|e| corrupt(self.file, "id", e))?;
                let name: String = r.try_get(2).map_err(|e| corrupt(self.file, "name", e))?;
                if let Some(f) = out.get_mut(&InstanceId(target)) {
                    f.read.pending.oldest.push((SignalId(id), name));
                }
            }
        }
        if asks.iter().any(|a| a.fires) {
            let json = asks_json(asks.iter().filter(|a| a.fires));
            let rows = sqlx::query(FIRES_SQL)
                .bind(json)
                .fetch_all(&mut *self.conn)
                .await
                .map_err(self.err("reading unread timer fires and child notices"))?;
            for r in &rows {
                let target: i64 = r.try_get(0).map_err(|e| corrupt(self.file, "target_id", e))?;
                let id = SignalId(r.try_get(1).map_err(|e| corrupt(self.file, "id", e))?);
                let name: String = r.try_get(2).map_err(|e| corrupt(self.file, "name", e))?;
                let state: Option<String> =
                    r.try_get(3).map_err(|e| corrupt(self.file, "payload", e))?;
                let key: Option<String> =
                    r.try_get(4).map_err(|e| corrupt(self.file, "dedup_key", e))?;
                // The statement selects what `UnreadFire::read` accepts: every row reads.
                let Some(fire) = UnreadFire::read(id, &name, key.as_deref(), state) else {
                    continue;
                };
                if let Some(f) = out.get_mut(&InstanceId(target)) {
                    f.fires.push(fire);
                }
            }
        }
        Ok(out)
    }
}

fn asks_json<'a, 'b: 'a>(asks: impl Iterator<Item = &'a Ask<'b>>) -> String {
    let items: Vec<serde_json::Value> = asks
        .map(|a| {
            let consumed: Vec<i64> = a.consumed.iter().map(|s| s.0).collect();
            json!([a.id.0, consumed, a.awaits, a.awaits == Some(ANY_SIGNAL), a.fires, a.drains])
        })
        .collect();
    serde_json::Value::Array(items).to_string()
}

#[cfg(test)]
mod tests {
    /// The fire test in SQL names the prefix the core gives every fire's dedup key.
    #[test]
    fn the_fire_test_names_the_cores_fire_prefix() {
        let prefix = keel_core::timers::FIRE_KEY_PREFIX;
        let expected = format!("substr(s.dedup_key, 1, {}) = '{prefix}'", prefix.len());
        assert!(is_fire!().contains(&expected), "{}", is_fire!());
    }
}
