//! Retention: how long ended instances (with their history and inbox) are kept and how
//! many history entries each instance keeps, per machine or for all, and the passes a
//! pruner runs at a given time.
//!
//! `[retention]` in `keel.toml`:
//!
//! ```toml
//! [retention]
//! ended = "30 days"       # ended instances of every machine (default: kept forever)
//! history_per_instance = 1000  # newest history entries kept per instance (default: all)
//! interval = "1 minute"   # how often a worker's pruner runs (jittered by a tenth)
//! batch = 1000            # instances read per page (one short transaction each)
//! pause = "10 ms"         # between two pages, so claims and commits interleave
//!
//! [retention.machines.order]
//! ended = "7 days"        # this machine's own retention
//! history_per_instance = 200
//! ```
//!
//! A machine's section replaces the global values for that machine: a key it leaves out
//! is unbounded for it (a section with neither key keeps everything of that machine).
//!
//! Dead letters keep their own retention (`dead_letter.retention` of the machine's queue
//! settings).

use crate::config::ConfigError;
use crate::limits;
use crate::ports::store::{HistoryTrimParams, PruneParams};
use crate::time::Timestamp;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Longest a pruner waits between runs.
pub const INTERVAL_MAX: Duration = Duration::from_secs(24 * 3600);
/// Shortest a pruner waits between runs.
pub const INTERVAL_MIN: Duration = Duration::from_millis(10);
/// Longest pause between two pages.
pub const PAUSE_MAX: Duration = Duration::from_secs(60);
/// Most pages one pass of a run reads before it leaves the rest to the next run, so a run
/// ends in bounded time whatever the table's size (with the page bound, ten million rows).
pub const PAGES_PER_PASS_MAX: usize = 10_000;

/// The `[retention]` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// Ended instances older than this are pruned; `None` keeps them forever.
    #[serde(with = "crate::duration::serde_human::option")]
    pub ended: Option<Duration>,
    /// Each instance keeps its newest this many history entries; older ones are trimmed.
    /// `None` keeps them all.
    pub history_per_instance: Option<usize>,
    /// How often a pruner runs (each run jittered by up to a tenth).
    #[serde(with = "crate::duration::serde_human")]
    pub interval: Duration,
    /// Instances read per page (1 to [`limits::PRUNE_BATCH_MAX`]).
    pub batch: usize,
    /// Pause between two pages.
    #[serde(with = "crate::duration::serde_human")]
    pub pause: Duration,
    /// Machines with a retention of their own (`[retention.machines.<name>]`).
    pub machines: BTreeMap<String, MachineRetention>,
}

/// `[retention.machines.<name>]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MachineRetention {
    /// This machine's ended instances older than this are pruned; `None` keeps them.
    #[serde(with = "crate::duration::serde_human::option")]
    pub ended: Option<Duration>,
    /// This machine's instances keep their newest this many history entries; `None`
    /// keeps them all.
    pub history_per_instance: Option<usize>,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            ended: None,
            history_per_instance: None,
            interval: Duration::from_secs(60),
            batch: 1_000,
            pause: Duration::from_millis(10),
            machines: BTreeMap::new(),
        }
    }
}

/// One pass of a run: pages of these params, `after` moving, until no row is left.
pub type PrunePass = PruneParams;

impl RetentionConfig {
    /// Checks the bounds; errors name `retention.<field>` and the accepted range.
    ///
    /// # Errors
    ///
    /// A field out of its range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, reason: String| ConfigError::Invalid {
            path: format!("retention.{field}"),
            reason,
        };
        if !(INTERVAL_MIN..=INTERVAL_MAX).contains(&self.interval) {
            return Err(invalid("interval", "must be between 10 ms and 24 hours".into()));
        }
        if !(1..=limits::PRUNE_BATCH_MAX).contains(&self.batch) {
            return Err(invalid(
                "batch",
                format!("must be 1 to {} (got {})", limits::PRUNE_BATCH_MAX, self.batch),
            ));
        }
        if self.pause > PAUSE_MAX {
            return Err(invalid("pause", "must be at most 60 seconds".into()));
        }
        let zero = |d: Option<Duration>| d.is_some_and(|d| d.is_zero());
        if zero(self.ended) {
            return Err(invalid("ended", "must be more than zero; omit it to keep forever".into()));
        }
        let keep = |field: &str, n: Option<usize>| match n {
            Some(n) if !(1..=limits::HISTORY_KEEP_MAX).contains(&n) => Err(invalid(
                field,
                format!(
                    "must be 1 to {} (got {n}); omit it to keep every entry",
                    limits::HISTORY_KEEP_MAX
                ),
            )),
            _ => Ok(()),
        };
        keep("history_per_instance", self.history_per_instance)?;
        for (name, m) in &self.machines {
            if zero(m.ended) {
                return Err(invalid(
                    &format!("machines.{name}.ended"),
                    "must be more than zero; omit it to keep forever".into(),
                ));
            }
            keep(&format!("machines.{name}.history_per_instance"), m.history_per_instance)?;
        }
        Ok(())
    }

    /// The passes a run at `now` makes: one per machine with its own retention, then one
    /// over every other machine (when `ended` is set). A machine listed without `ended`
    /// is kept forever, even when `ended` is set for all.
    pub fn passes(&self, namespace: Option<&str>, now: Timestamp) -> Vec<PrunePass> {
        let pass = |machines: Vec<String>, except: Vec<String>, keep: Duration| PruneParams {
            namespace: namespace.map(str::to_owned),
            machines,
            except,
            ended_before: now.minus(keep),
            after: None,
            limit: self.batch,
        };
        let mut passes: Vec<PrunePass> = self
            .machines
            .iter()
            .filter_map(|(name, m)| m.ended.map(|keep| pass(vec![name.clone()], Vec::new(), keep)))
            .collect();
        if let Some(keep) = self.ended {
            passes.push(pass(Vec::new(), self.machines.keys().cloned().collect(), keep));
        }
        passes
    }

    /// The history trimming passes a run makes: one per machine with its own
    /// `history_per_instance`, then one over every machine without a section (when
    /// `history_per_instance` is set). A machine listed without its own value keeps all its
    /// history, like `ended`.
    pub fn trim_passes(&self, namespace: Option<&str>) -> Vec<HistoryTrimParams> {
        let pass = |machines: Vec<String>, except: Vec<String>, keep: usize| HistoryTrimParams {
            namespace: namespace.map(str::to_owned),
            machines,
            except,
            keep,
            after: None,
            limit: self.batch,
        };
        let mut passes: Vec<HistoryTrimParams> = self
            .machines
            .iter()
            .filter_map(|(name, m)| {
                m.history_per_instance.map(|keep| pass(vec![name.clone()], Vec::new(), keep))
            })
            .collect();
        if let Some(keep) = self.history_per_instance {
            passes.push(pass(Vec::new(), self.machines.keys().cloned().collect(), keep));
        }
        passes
    }

    /// The wait before the next run: `interval` moved by up to a tenth either way
    /// (`random` is uniform in `[0, 1)`), so workers started together do not prune in step.
    pub fn next_wait(&self, random: f64) -> Duration {
        let tenth = self.interval.as_secs_f64() / 10.0;
        let offset = (random.clamp(0.0, 1.0) * 2.0 - 1.0) * tenth;
        Duration::from_secs_f64((self.interval.as_secs_f64() + offset).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn config(source: &str) -> RetentionConfig {
        let config = crate::config::KeelConfig::from_toml_str(source).expect("valid");
        config.retention.expect("a [retention] section")
    }

    #[test]
    fn passes_per_machine_then_for_the_rest() {
        let r = config(
            r#"
            [retention]
            ended = "30 days"
            batch = 500
            [retention.machines.order]
            ended = "7 days"
            [retention.machines.audit]
            "#,
        );
        let now = Timestamp::from_millis(100 * 86_400_000);
        let passes = r.passes(Some("ns"), now);
        assert_eq!(passes.len(), 2, "{passes:?}");
        assert_eq!(passes[0].machines, ["order"]);
        assert_eq!(passes[0].ended_before, now.minus(7 * DAY));
        assert_eq!(passes[0].limit, 500);
        assert!(passes[1].machines.is_empty());
        assert_eq!(passes[1].except, ["audit", "order"], "audit is kept forever");
        assert_eq!(passes[1].ended_before, now.minus(30 * DAY));
        assert_eq!(passes[1].namespace.as_deref(), Some("ns"));
        // Nothing configured: nothing pruned.
        assert!(RetentionConfig::default().passes(None, now).is_empty());
    }

    #[test]
    fn trim_passes_per_machine_then_for_the_rest() {
        let r = config(
            r#"
            [retention]
            history_per_instance = 1000
            batch = 200
            [retention.machines.order]
            history_per_instance = 50
            [retention.machines.audit]
            ended = "7 days"
            "#,
        );
        let passes = r.trim_passes(Some("ns"));
        assert_eq!(passes.len(), 2, "{passes:?}");
        assert_eq!(
            (passes[0].machines.as_slice(), passes[0].keep),
            (&["order".to_owned()][..], 50)
        );
        assert_eq!(passes[0].limit, 200);
        assert!(passes[1].machines.is_empty());
        assert_eq!(passes[1].except, ["audit", "order"], "audit's section keeps its history");
        assert_eq!(passes[1].keep, 1000);
        assert_eq!(passes[1].namespace.as_deref(), Some("ns"));
        for p in &passes {
            p.validate().expect("a configured pass is a valid store call");
        }
        // Nothing configured: nothing trimmed; `ended` alone trims nothing either.
        assert!(RetentionConfig::default().trim_passes(None).is_empty());
        assert!(config("[retention]\nended = \"1 day\"").trim_passes(None).is_empty());
    }

    #[test]
    fn jitter_stays_within_a_tenth() {
        let r =
            RetentionConfig { interval: Duration::from_secs(100), ..RetentionConfig::default() };
        assert_eq!(r.next_wait(0.0), Duration::from_secs(90));
        assert_eq!(r.next_wait(0.5), Duration::from_secs(100));
        assert!(r.next_wait(0.999_999) <= Duration::from_secs(110));
    }

    #[test]
    fn bad_values_name_the_key() {
        for (source, expected) in [
            ("[retention]\nbatch = 0", "retention.batch: must be 1 to 10000"),
            ("[retention]\ninterval = \"1 ms\"", "retention.interval: must be between"),
            ("[retention]\nended = \"0 seconds\"", "retention.ended: must be more than zero"),
            ("[retention.machines.m]\nended = \"0 s\"", "retention.machines.m.ended"),
            ("[retention]\nkeep = \"1 day\"", "keep"),
            (
                "[retention]\nhistory_per_instance = 0",
                "retention.history_per_instance: must be 1 to 100000",
            ),
            (
                "[retention.machines.m]\nhistory_per_instance = 100001",
                "retention.machines.m.history_per_instance: must be 1 to 100000 (got 100001)",
            ),
            ("[retention]\nhistory_per_instance = -1", "history_per_instance"),
        ] {
            let err = crate::config::KeelConfig::from_toml_str(source).unwrap_err().to_string();
            assert!(err.contains(expected), "{source}: {err}");
        }
    }
}
