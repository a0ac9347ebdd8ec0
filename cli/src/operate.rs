//! The operator commands added on top of the store's views: `list`, `history`,
//! `workers`, `graph`, `purge`, `upgrade`, and the last hour's activity `status` and
//! `health` show.
//!
//! Activity is computed from stored rows, not from process-local counters, so every
//! `keel` invocation and every `keel serve` replica agrees: an instance counts as
//! completed (or failed) in the minute its row last changed to `done` (or `failed`), and
//! its processing time is that moment minus its insert time (turnaround: queueing, steps
//! and waits included).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{anyhow, bail};
use keel::layers::scheduler::Stopped;
use keel::{Cancel, Keel, Migration, json};
use keel_core::Timestamp;
use keel_core::ids::{DeadLetterId, InstanceId, Status, StatusSet};
use keel_core::instance::Instance;
use keel_core::limits::INSTANCE_LIST_MAX;
use keel_core::ports::Store;
use keel_core::ports::store::{
    ActivityParams, DeadLetterPurgeParams, DeadLetterSelector, HistoryPageParams,
    InstanceListParams, QueueStats, WORKER_STALE_AFTER, WorkerRecord,
};
use serde::Serialize;

use crate::commands::{capitalized, hint, now, shell_word};
use crate::definitions::Definitions;
use crate::output::{PartlyDone, Report, SHOWN_MAX, age, table, time};
use crate::{GraphFormat, ListArgs, UpgradeArgs};

/// The window `status` and `health` summarise.
pub const ACTIVITY_WINDOW: Duration = Duration::from_secs(3_600);
/// The width of one activity bucket (sparklines draw one point per bucket).
pub const ACTIVITY_BUCKET: Duration = Duration::from_secs(60);
/// Instances `keel list` shows when no `--limit` is given.
pub const LIST_PAGE_DEFAULT: usize = 50;
/// Entries `keel history` and the HTTP history page show when no limit is given.
pub const HISTORY_PAGE_DEFAULT: usize = 100;
/// Most pages a purge or a per-machine scan walks (each page is at most
/// [`INSTANCE_LIST_MAX`] instances).
const PAGES_MAX: usize = 1_000;
/// Most pages (of [`INSTANCE_LIST_MAX`] instances, newest first) `status`, `health` and
/// the dashboard read per machine to count stuck leases and ready work without a worker.
/// A count that reaches it is a lower bound and says so.
pub const COUNT_PAGES_MAX: usize = 10;

/// A count taken over a bounded walk of list pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counted {
    /// What the pages read held.
    pub count: u64,
    /// False when the page bound stopped the walk with rows left: `count` is then a lower
    /// bound.
    pub complete: bool,
}

impl Counted {
    /// A count read whole.
    pub const fn exact(count: u64) -> Self {
        Counted { count, complete: true }
    }

    /// The count as text: `"12"`, or `"at least 10000"` when the walk stopped early.
    pub fn text(self) -> String {
        if self.complete { self.count.to_string() } else { format!("at least {}", self.count) }
    }
}

/// The last hour of one machine: what ended, how long it took, and ready work no live
/// worker can take.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MachineActivity {
    /// Machine name.
    pub machine: String,
    /// Instances that finished `done` in the window.
    pub completed_last_hour: u64,
    /// Instances that finished `failed` in the window.
    pub failed_last_hour: u64,
    /// Mean turnaround of those, in milliseconds: from each one's insert to its end, so
    /// queueing, back-off and waits for events or children count, not only the time its
    /// steps ran (`keel status` and the dashboard label it "avg turnaround"; the name is
    /// kept for the JSON documents that carry it).
    pub avg_processing_ms: Option<u64>,
    /// Ended instances per minute over the window.
    pub throughput_per_minute: f64,
    /// Ready instances whose machine version no live worker declares (counted over at most
    /// [`COUNT_PAGES_MAX`] pages of runnable instances, newest first).
    pub ready_without_worker: u64,
    /// The versions those belong to.
    pub unserved_versions: Vec<i32>,
    /// False when the page bound stopped the `ready_without_worker` count: it is then a
    /// lower bound ("at least").
    pub ready_without_worker_complete: bool,
    /// Executing instances whose lease has run out (a worker died mid-step and no reaper
    /// has returned them yet), counted over at most [`COUNT_PAGES_MAX`] pages.
    pub stuck_leases: u64,
    /// False when the page bound stopped the `stuck_leases` count: it is then a lower
    /// bound ("at least").
    pub stuck_leases_complete: bool,
    /// Completed per minute, oldest first (one entry per bucket of the window).
    pub completed_per_minute: Vec<u64>,
    /// Failed per minute, oldest first.
    pub failed_per_minute: Vec<u64>,
}

impl MachineActivity {
    /// [`MachineActivity::stuck_leases`] with whether the walk read it whole.
    pub fn stuck_leases_counted(&self) -> Counted {
        Counted { count: self.stuck_leases, complete: self.stuck_leases_complete }
    }

    /// [`MachineActivity::ready_without_worker`] with whether the walk read it whole.
    pub fn ready_without_worker_counted(&self) -> Counted {
        Counted { count: self.ready_without_worker, complete: self.ready_without_worker_complete }
    }
}

/// The last hour of every machine of `ns` with activity or unfinished work.
pub async fn activity(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    now: Timestamp,
) -> anyhow::Result<Vec<MachineActivity>> {
    let stats = keel.store().queue_stats(Some(ns.to_owned()), now).await?;
    activity_from(keel, ns, machine, now, &stats).await
}

/// [`activity`] with the namespace's queue counts already read at `now`.
pub async fn activity_from(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    now: Timestamp,
    stats: &[QueueStats],
) -> anyhow::Result<Vec<MachineActivity>> {
    activity_within(keel, ns, machine, now, stats, COUNT_PAGES_MAX).await
}

/// [`activity_from`], counting stuck leases and ready work without a worker over at most
/// `pages_max` list pages per machine.
pub async fn activity_within(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    now: Timestamp,
    stats: &[QueueStats],
    pages_max: usize,
) -> anyhow::Result<Vec<MachineActivity>> {
    // The window is (now - 1 h, now]: exactly 60 buckets, the last one ending now.
    let until = now.plus(Duration::from_millis(1));
    let params = ActivityParams {
        namespace: Some(ns.to_owned()),
        since: until.minus(ACTIVITY_WINDOW),
        until,
        bucket: ACTIVITY_BUCKET,
    };
    let buckets_len = (ACTIVITY_WINDOW.as_secs() / ACTIVITY_BUCKET.as_secs()) as usize;
    let mut out: BTreeMap<String, MachineActivity> = BTreeMap::new();
    let blank = |name: &str| MachineActivity {
        machine: name.to_owned(),
        completed_per_minute: vec![0; buckets_len],
        failed_per_minute: vec![0; buckets_len],
        ready_without_worker_complete: true,
        stuck_leases_complete: true,
        ..MachineActivity::default()
    };
    let mut turnaround: BTreeMap<String, u64> = BTreeMap::new();
    for b in keel.store().instance_activity(params).await? {
        let e = out.entry(b.machine.clone()).or_insert_with(|| blank(&b.machine));
        e.completed_last_hour += b.completed;
        e.failed_last_hour += b.failed;
        if let Ok(i) = usize::try_from(b.bucket)
            && i < buckets_len
        {
            e.completed_per_minute[i] += b.completed;
            e.failed_per_minute[i] += b.failed;
        }
        *turnaround.entry(b.machine).or_default() += b.turnaround_ms_total;
    }
    let live = live_workers(keel, now).await?;
    let mut ready: BTreeMap<String, u64> = BTreeMap::new();
    let mut executing: BTreeSet<String> = BTreeSet::new();
    for s in stats {
        out.entry(s.machine.clone()).or_insert_with(|| blank(&s.machine));
        *ready.entry(s.machine.clone()).or_default() += s.ready;
        if s.executing > 0 {
            executing.insert(s.machine.clone());
        }
    }
    for (name, e) in &mut out {
        let ended = e.completed_last_hour + e.failed_last_hour;
        e.avg_processing_ms = turnaround.get(name).copied().unwrap_or(0).checked_div(ended);
        e.throughput_per_minute = ended as f64 / (ACTIVITY_WINDOW.as_secs_f64() / 60.0);
        if ready.get(name).copied().unwrap_or(0) > 0 {
            let (counted, versions) = unserved(keel, ns, name, &live, now, pages_max).await?;
            e.ready_without_worker = counted.count;
            e.ready_without_worker_complete = counted.complete;
            e.unserved_versions = versions;
        }
        if executing.contains(name) {
            let counted = stuck_leases_within(keel, ns, name, now, pages_max).await?;
            e.stuck_leases = counted.count;
            e.stuck_leases_complete = counted.complete;
        }
    }
    Ok(out.into_values().filter(|a| machine.is_none_or(|m| a.machine == m)).collect())
}

/// The workers seen within [`WORKER_STALE_AFTER`] of `now`.
pub(crate) async fn live_workers(
    keel: &Keel,
    now: Timestamp,
) -> Result<Vec<WorkerRecord>, keel::StoreError> {
    keel.store().worker_list(now.minus(WORKER_STALE_AFTER)).await
}

fn list_params(ns: &str, machine: &str, status: Status) -> InstanceListParams {
    InstanceListParams {
        namespace: ns.to_owned(),
        machine: Some(machine.to_owned()),
        status: Some(status),
        limit: INSTANCE_LIST_MAX,
        ..InstanceListParams::default()
    }
}

/// Walks `machine`'s instances with `status` in `ns`, newest first, a page at a time, at
/// most `pages_max` pages, calling `visit` on each: true when every one was read, false
/// when the page bound stopped the walk first.
async fn walk_pages(
    keel: &Keel,
    ns: &str,
    machine: &str,
    status: Status,
    pages_max: usize,
    mut visit: impl FnMut(&Instance),
) -> anyhow::Result<bool> {
    let mut before = None;
    for _ in 0..pages_max {
        let params = InstanceListParams { before, ..list_params(ns, machine, status) };
        let page = keel.store().instance_list(params).await?;
        page.iter().for_each(&mut visit);
        if page.len() < INSTANCE_LIST_MAX {
            return Ok(true);
        }
        before = page.last().map(|r| r.id);
    }
    Ok(false)
}

/// Ready instances whose version no live worker serves (over at most `pages_max` pages of
/// runnable instances), and those versions.
async fn unserved(
    keel: &Keel,
    ns: &str,
    machine: &str,
    live: &[WorkerRecord],
    now: Timestamp,
    pages_max: usize,
) -> anyhow::Result<(Counted, Vec<i32>)> {
    let mut count = 0;
    let mut versions = BTreeSet::new();
    let complete = walk_pages(keel, ns, machine, Status::Runnable, pages_max, |row| {
        if row.eligible_at <= now && !live.iter().any(|w| w.serves(ns, &row.machine)) {
            count += 1;
            versions.insert(row.machine.version);
        }
    })
    .await?;
    Ok((Counted { count, complete }, versions.into_iter().collect()))
}

/// Executing instances of `machine` whose lease has expired, counted over at most
/// [`COUNT_PAGES_MAX`] pages (a lower bound beyond them; see [`stuck_leases_within`]).
pub async fn stuck_leases(
    keel: &Keel,
    ns: &str,
    machine: &str,
    now: Timestamp,
) -> anyhow::Result<u64> {
    Ok(stuck_leases_within(keel, ns, machine, now, COUNT_PAGES_MAX).await?.count)
}

/// Executing instances of `machine` whose lease has expired, counted over at most
/// `pages_max` pages of executing instances, newest first.
pub async fn stuck_leases_within(
    keel: &Keel,
    ns: &str,
    machine: &str,
    now: Timestamp,
    pages_max: usize,
) -> anyhow::Result<Counted> {
    let mut count = 0;
    let complete = walk_pages(keel, ns, machine, Status::Executing, pages_max, |row| {
        if row.lease_expires_at.is_some_and(|at| at < now) {
            count += 1;
        }
    })
    .await?;
    Ok(Counted { count, complete })
}

/// The activity table `status` prints under its queue table.
pub fn activity_table(rows: &[MachineActivity]) -> String {
    let mut t = table(&[
        "machine",
        "completed 1h",
        "failed 1h",
        "avg turnaround",
        "per minute",
        "stuck leases",
        "ready, no worker",
    ]);
    for a in rows {
        t.add_row(vec![
            a.machine.clone(),
            a.completed_last_hour.to_string(),
            a.failed_last_hour.to_string(),
            a.avg_processing_ms.map(|ms| age(ms as i64)).unwrap_or_default(),
            format!("{:.2}", a.throughput_per_minute),
            a.stuck_leases_counted().text(),
            if a.ready_without_worker == 0 {
                String::new()
            } else {
                format!(
                    "{} (v{})",
                    a.ready_without_worker_counted().text(),
                    a.unserved_versions
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", v")
                )
            },
        ]);
    }
    t.to_string()
}

/// `keel list`.
pub async fn list(keel: &Keel, ns: &str, args: ListArgs) -> anyhow::Result<Report> {
    if args.limit == 0 || args.limit > INSTANCE_LIST_MAX {
        bail!("--limit: {} is out of range; give 1 to {INSTANCE_LIST_MAX}", args.limit);
    }
    let status = args.status.as_deref().map(parse_status).transpose()?;
    let before = args
        .after
        .as_deref()
        .map(|raw| {
            raw.trim()
                .strip_prefix('i')
                .unwrap_or(raw.trim())
                .parse::<i64>()
                .ok()
                .filter(|n| *n > 0)
                .map(InstanceId)
                .ok_or_else(|| anyhow!("--after: {raw:?} is not an instance id; write i42 or 42"))
        })
        .transpose()?;
    let params = InstanceListParams {
        namespace: ns.to_owned(),
        machine: Some(args.machine.clone()),
        status,
        state: args.state.clone(),
        business_key: None,
        before,
        limit: args.limit,
    };
    let rows = keel.store().instance_list(params).await?;
    let next = (rows.len() == args.limit).then(|| rows.last().map(|r| r.id)).flatten();
    let mut t = table(&["id", "version", "key", "status", "position", "attempt", "updated"]);
    let mut items = Vec::with_capacity(rows.len());
    for r in &rows {
        t.add_row(vec![
            r.id.to_string(),
            r.machine.version.to_string(),
            r.business_key.clone().unwrap_or_default(),
            r.status.to_string(),
            r.position.clone(),
            r.attempt.to_string(),
            time(r.updated_at.0),
        ]);
        items.push(json!({
            "id": r.id,
            "machine": r.machine,
            "business_key": r.business_key,
            "status": r.status,
            "position": r.position,
            "attempt": r.attempt,
            "queue": r.queue,
            "created_at": r.created_at,
            "updated_at": r.updated_at,
        }));
    }
    let mut human = if rows.is_empty() {
        format!("No instances of {:?} in namespace {ns:?} match.", args.machine)
    } else {
        t.to_string()
    };
    if let Some(next) = next {
        // The same listing, continued: every filter kept.
        let mut more = format!("list {}", shell_word(&args.machine));
        if let Some(state) = &args.state {
            let _ = write!(more, " --state {}", shell_word(state));
        }
        if let Some(status) = status {
            let _ = write!(more, " --status {status}");
        }
        if args.limit != LIST_PAGE_DEFAULT {
            let _ = write!(more, " --limit {}", args.limit);
        }
        let _ = write!(human, "\nMore: {} --after {next}", hint(ns, &more));
    }
    Ok(Report::ok(
        json!({ "namespace": ns, "machine": args.machine, "instances": items, "next": next }),
        human,
    ))
}

/// Reads `--status`: one of the instance statuses ([`Status::ALL`]), case ignored. The
/// error names the flag, the value, every accepted value and, when one is close
/// (`keel_core::config::closest`), the one meant.
pub fn parse_status(raw: &str) -> anyhow::Result<Status> {
    let word = raw.trim();
    if let Some(status) = Status::ALL.into_iter().find(|s| s.name().eq_ignore_ascii_case(word)) {
        return Ok(status);
    }
    let names = Status::ALL.map(Status::name);
    let near = match keel::settings::closest(word, names) {
        Some(near) => format!(" (did you mean `{near}`?)"),
        None => String::new(),
    };
    bail!("--status: unknown value {raw:?}{near}; accepted: {}", names.join(", "))
}

/// `keel history`: one page of `id`'s history, newest first, and the cursor to the next,
/// older page. The "More:" hint names the instance by its id, as `keel inspect` does, not
/// by how the caller named it: a business key may pass to a newer instance between pages,
/// and the cursor belongs to this one.
pub async fn history(
    keel: &Keel,
    ns: &str,
    id: InstanceId,
    before: Option<&str>,
    limit: usize,
) -> anyhow::Result<Report> {
    // Checked here rather than left to the store, whose message names its own field
    // (`limit`): the user typed `--limit` (`keel serve` drops the dashes for its query).
    let max = keel_core::limits::HISTORY_PAGE_MAX;
    if limit == 0 || limit > max {
        bail!(
            "--limit: {limit} is out of range; give 1 to {max} and follow `next` for older entries"
        );
    }
    let before = before
        .map(|raw| {
            raw.trim().parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                anyhow!("--before: {raw:?} is not a history cursor; pass the `next` of the previous page")
            })
        })
        .transpose()?;
    let page = keel.store().history_page(HistoryPageParams { instance: id, before, limit }).await?;
    let mut t = table(&["seq", "at", "rev", "attempt", "kind", "data"]);
    for h in &page.entries {
        t.add_row(vec![
            h.seq.to_string(),
            time(h.at.0),
            h.revision.0.to_string(),
            h.attempt.to_string(),
            h.entry.kind.clone(),
            h.entry.data.to_string(),
        ]);
    }
    let mut human = if page.entries.is_empty() {
        match before {
            Some(_) => format!("No older history for {id}."),
            None => format!("No history for {id} yet (no step has run)."),
        }
    } else {
        t.to_string()
    };
    if let Some(next) = page.next {
        let mut more = format!("history {id}");
        if limit != HISTORY_PAGE_DEFAULT {
            let _ = write!(more, " --limit {limit}");
        }
        let _ = write!(human, "\nMore: {} --before {next}", hint(ns, &more));
    }
    Ok(Report::ok(json!({ "instance": id, "entries": page.entries, "next": page.next }), human))
}

/// Whether the store's worker list stopped at its bound
/// ([`WORKER_LIST_MAX`](keel_core::ports::store::WORKER_LIST_MAX)), and so which counts
/// of live and stale workers are lower bounds (`keel workers` and the dashboard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkersBound {
    /// The list holds as many workers as the store returns: there may be more.
    pub at_least: bool,
    /// Every worker read is live, so live ones may have been left out too. (The list is
    /// most recently seen first: once it holds a stale worker, it holds every live one,
    /// and only the stale count can fall short.)
    pub live_at_least: bool,
}

impl WorkersBound {
    /// Said under the counts when the list is at its bound.
    pub fn note() -> String {
        let max = keel_core::ports::store::WORKER_LIST_MAX;
        format!("The store lists at most {max} workers: there may be more.")
    }

    /// The bound of `read`, a worker list the store returned, where a worker last seen at
    /// or after `live_since` is live.
    pub fn of(read: &[WorkerRecord], live_since: keel_core::Timestamp) -> Self {
        let at_least = read.len() >= keel_core::ports::store::WORKER_LIST_MAX;
        let live_at_least = at_least && read.iter().all(|w| w.last_seen_at >= live_since);
        Self { at_least, live_at_least }
    }

    /// `"{live} live, {stale} {stale_label}"`, with "at least" where a count is a lower
    /// bound.
    pub fn counts(self, live: usize, stale: usize, stale_label: &str) -> String {
        let max = keel_core::ports::store::WORKER_LIST_MAX;
        let live_bound = if self.live_at_least { "at least " } else { "" };
        let stale_text = match (self.at_least, stale) {
            (false, _) => format!("{stale} {stale_label}"),
            (true, 0) => format!("0 {stale_label} among the {max} most recently seen"),
            (true, _) => format!("at least {stale} {stale_label}"),
        };
        format!("{live_bound}{live} live, {stale_text}")
    }
}

/// `keel workers`: those that claim from `ns` (every worker when it is `None`, as with
/// `--all-namespaces` and `GET /v1/workers`).
pub async fn workers_in(
    keel: &Keel,
    ns: Option<&str>,
    stale_after: &str,
) -> anyhow::Result<Report> {
    let stale =
        keel_core::duration::parse(stale_after).map_err(|e| anyhow!("--stale-after: {e}"))?;
    let now = now();
    // Stale workers are listed for a day past the threshold, then left out.
    let shown_since = now.minus(stale + Duration::from_secs(86_400));
    let read = keel.store().worker_list(shown_since).await?;
    let max = keel_core::ports::store::WORKER_LIST_MAX;
    let bound = WorkersBound::of(&read, now.minus(stale));
    let WorkersBound { at_least, live_at_least } = bound;
    let (list, others): (Vec<WorkerRecord>, Vec<WorkerRecord>) =
        read.into_iter().partition(|w| ns.is_none_or(|ns| w.claims_from(ns)));
    let mut t =
        table(&["worker", "name", "state", "last seen", "started", "machines", "namespaces"]);
    let mut items = Vec::with_capacity(list.len());
    let (mut live, mut stale_count) = (0, 0);
    for w in &list {
        let is_live = w.last_seen_at >= now.minus(stale);
        if is_live {
            live += 1;
        } else {
            stale_count += 1;
        }
        let machines: Vec<String> = w.machines.iter().map(ToString::to_string).collect();
        t.add_row(vec![
            w.id.to_string(),
            w.name.clone(),
            if is_live { "live".into() } else { "STALE".into() },
            format!("{} ago", age(now.0 - w.last_seen_at.0)),
            time(w.started_at.0),
            machines.join(", "),
            if w.namespaces.is_empty() { "*".into() } else { w.namespaces.join(", ") },
        ]);
        items.push(json!({
            "id": w.id,
            "name": w.name,
            "live": is_live,
            "last_seen_at": w.last_seen_at,
            "started_at": w.started_at,
            "machines": w.machines,
            "namespaces": w.namespaces,
        }));
    }
    let others_bound = if at_least { "at least " } else { "" };
    let scope = match ns {
        None => "in any namespace".to_owned(),
        Some(ns) => format!("claiming from namespace {ns:?}"),
    };
    let mut human = if list.is_empty() && at_least {
        format!("No workers {scope} are among the {max} most recently seen workers.")
    } else if list.is_empty() {
        format!("No workers {scope} have reported in the last day.")
    } else {
        let counts =
            bound.counts(live, stale_count, &format!("stale (not seen for {stale_after})"));
        format!("{counts}, {scope}\n{t}")
    };
    if !others.is_empty() {
        let _ = write!(
            human,
            "\n{others_bound}{} more claim only from other namespaces (`keel workers --all-namespaces` lists them).",
            others.len()
        );
    }
    if at_least {
        let _ = write!(human, "\n{}", WorkersBound::note());
    }
    Ok(Report::ok(
        json!({
            "namespace": ns,
            "live": live,
            "stale": stale_count,
            "other_namespaces": others.len(),
            "at_least": at_least,
            "live_at_least": live_at_least,
            "stale_after_ms": stale.as_millis() as u64,
            "workers": items,
        }),
        human,
    ))
}

/// `keel graph`.
pub fn graph(
    machine: &str,
    format: GraphFormat,
    definitions: &std::path::Path,
    version: Option<u32>,
) -> anyhow::Result<Report> {
    let defs = Definitions::load(definitions)?;
    let chart = defs.find(machine, version, "--version")?;
    let (name, text) = match format {
        GraphFormat::Mermaid => ("mermaid", chart.to_mermaid()),
        GraphFormat::Dot => ("dot", chart.to_dot()),
    };
    // The chart is drawn as it is; what it likely got wrong goes to stderr (and `warnings`).
    let warnings: Vec<String> = chart.warnings().iter().map(ToString::to_string).collect();
    for w in &warnings {
        crate::output::warn(&format!("{machine} v{}: {w}", chart.version()));
    }
    Ok(Report::ok(
        json!({
            "machine": machine,
            "version": chart.version(),
            "format": name,
            "diagram": text,
            "warnings": warnings,
        }),
        text,
    ))
}

/// `keel purge`.
pub async fn purge(
    keel: &Keel,
    ns: &str,
    machine: &str,
    pending: bool,
    include_suspended: bool,
    confirm: bool,
) -> anyhow::Result<Report> {
    if !confirm {
        // Counted first, so the purge is confirmed knowing what it touches.
        let (what, count) = if pending {
            let n = machine_stats(keel, ns, machine)
                .await?
                .iter()
                .map(|s| s.ready + s.scheduled)
                .sum::<u64>();
            (
                "cancels every runnable instance of the machine (new, between steps, waiting to retry, woken by an event) and their live descendants",
                format!("{n} runnable in namespace {ns:?} now, descendants not counted"),
            )
        } else {
            let letters = letter_count(keel, ns, machine).await?;
            let suspended: u64 =
                machine_stats(keel, ns, machine).await?.iter().map(|s| s.suspended).sum();
            if include_suspended {
                (
                    "deletes every dead letter of the machine, those of its suspended instances included,",
                    format!(
                        "{letters} dead letter(s) in namespace {ns:?} now; its {suspended} suspended instance(s) would have nothing left to retry them by"
                    ),
                )
            } else {
                (
                    "deletes every dead letter of the machine, except those of its still suspended instances,",
                    format!(
                        "{letters} dead letter(s) in namespace {ns:?} now; those of its {suspended} suspended instance(s) stay"
                    ),
                )
            }
        };
        // A misspelt machine is said before the confirmation is asked for: confirming it
        // would only purge nothing.
        let note = match unknown_machine(keel, ns, machine).await? {
            Some(unknown) => format!("\nNote: {unknown}"),
            None => String::new(),
        };
        bail!("purge {what} for good ({count}); add --confirm to proceed{note}");
    }
    let report = if pending {
        purge_pending(keel, ns, machine).await?
    } else {
        purge_dlq(keel, ns, machine, !include_suspended).await?
    };
    note_unknown_machine(keel, ns, machine, report).await
}

/// `machine`'s counts in `ns`, one row per queue it has unfinished instances in.
async fn machine_stats(keel: &Keel, ns: &str, machine: &str) -> anyhow::Result<Vec<QueueStats>> {
    let stats = keel.store().queue_stats(Some(ns.to_owned()), now()).await?;
    Ok(stats.into_iter().filter(|s| s.namespace == ns && s.machine == machine).collect())
}

/// How many dead letters `machine` holds in `ns` (one grouped count).
async fn letter_count(keel: &Keel, ns: &str, machine: &str) -> anyhow::Result<u64> {
    Ok(crate::commands::dead_letter_counts(keel, ns).await?.get(machine).copied().unwrap_or(0))
}

async fn purge_pending(keel: &Keel, ns: &str, machine: &str) -> anyhow::Result<Report> {
    let counted: u64 = keel
        .store()
        .queue_stats(Some(ns.to_owned()), now())
        .await?
        .iter()
        .filter(|s| s.machine == machine)
        .map(|s| s.ready + s.scheduled)
        .sum();
    let bar = indicatif::ProgressBar::new(counted).with_message("cancelling pending instances");
    let done = cancel_pending(keel, ns, machine, || bar.inc(1)).await;
    bar.finish_and_clear();
    let what = |p: &PendingCancelled| {
        let mut text = format!(
            "cancelled {} pending instance(s) of {machine:?} in namespace {ns:?}",
            p.cancelled.len()
        );
        if !p.descendants.is_empty() {
            let _ = write!(text, " and {} of their descendant(s)", p.descendants.len());
        }
        text
    };
    let body = |p: &PendingCancelled| {
        json!({
            "namespace": ns,
            "machine": machine,
            "cancelled": p.cancelled.len(),
            "ids": p.cancelled,
            "descendants": p.descendants.len(),
            "descendant_ids": p.descendants,
        })
    };
    let done = done
        .map_err(|failed| PartlyDone::wrap(failed.error, what(&failed.done), body(&failed.done)))?;
    let mut json = body(&done);
    let cut: Vec<InstanceId> = done.cut.iter().map(|(id, _)| *id).collect();
    json["complete"] = json!(done.complete && cut.is_empty());
    json["cascade_cut"] = json!(cut);
    // A cut cascade leaves descendants a second run cannot reach (their root has ended).
    for (root, cancelled) in done.cut.iter().take(SHOWN_MAX) {
        crate::output::warn(&crate::commands::cascade_cut_note(keel, ns, *root, cancelled).await);
    }
    if cut.len() > SHOWN_MAX {
        crate::output::warn(&format!(
            "{} more cancelled instance(s) stopped their cascade at the same bound; `--json` lists them all in `cascade_cut`",
            cut.len() - SHOWN_MAX
        ));
    }
    let more = if done.complete { "" } else { "; more remain, run it again" };
    let human = capitalized(&what(&done));
    let mut human = format!("{human} (their history records why){more}.");
    if !done.descendants.is_empty() {
        let _ = write!(
            human,
            "\nDescendants cancelled with them (any machine, running ones included): {}.",
            crate::commands::ids(&done.descendants)
        );
    }
    Ok(Report::ok(json, human))
}

/// What [`cancel_pending`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PendingCancelled {
    /// The machine's pending instances cancelled, newest first.
    cancelled: Vec<InstanceId>,
    /// Their live descendants the cascade cancelled with them (of any machine, in any
    /// status but ended).
    descendants: Vec<InstanceId>,
    /// The cancelled instances whose cascade reached the store's bound
    /// ([`crate::commands::cascade_cut`]): live descendants of theirs may be left. The
    /// first [`SHOWN_MAX`] come with what their cancel returned, the others with nothing.
    cut: Vec<(InstanceId, Vec<InstanceId>)>,
    /// False when the page bound stopped it with more left.
    complete: bool,
}

/// Cancels (with cascade) the runnable instances of `machine` in `ns`, newest first, a
/// page at a time, at most [`PAGES_MAX`] pages, recording each one cancelled and every
/// descendant its cascade cancelled. On a store error, what was already cancelled comes
/// with the error.
async fn cancel_pending(
    keel: &Keel,
    ns: &str,
    machine: &str,
    mut on_cancel: impl FnMut(),
) -> Result<PendingCancelled, Stopped<PendingCancelled>> {
    let mut done = PendingCancelled::default();
    let mut before = None;
    for _ in 0..PAGES_MAX {
        let params = InstanceListParams { before, ..list_params(ns, machine, Status::Runnable) };
        let page = match keel.store().instance_list(params).await {
            Ok(page) => page,
            Err(error) => return Err(Stopped { done, error }),
        };
        for row in &page {
            let request = Cancel::new(row.id)
                .reason("purged with keel purge --pending")
                .cascade()
                .only_in(StatusSet::of(&[Status::Runnable]));
            match keel.cancel(request).await {
                // Not in the list when it is no longer runnable: ended (cancelled as a
                // descendant of an earlier one, or on its own), or claimed by a worker
                // since the page was read, which is left to its step.
                Ok(ids) => {
                    if crate::commands::cascade_cut(&ids) {
                        // Only the first ones are named in a warning: keep their ids.
                        let named = done.cut.len() < SHOWN_MAX;
                        done.cut.push((row.id, if named { ids.clone() } else { Vec::new() }));
                    }
                    if ids.contains(&row.id) {
                        done.cancelled.push(row.id);
                        on_cancel();
                    }
                    done.descendants.extend(ids.into_iter().filter(|id| *id != row.id));
                }
                Err(error) => return Err(Stopped { done, error }),
            }
        }
        if page.len() < INSTANCE_LIST_MAX {
            done.complete = true;
            return Ok(done);
        }
        before = page.last().map(|r| r.id);
    }
    Ok(done)
}

async fn purge_dlq(
    keel: &Keel,
    ns: &str,
    machine: &str,
    keep_suspended: bool,
) -> anyhow::Result<Report> {
    let counted = letter_count(keel, ns, machine).await?;
    let bar = indicatif::ProgressBar::new(counted).with_message("deleting dead letters");
    let mut pages_left = PAGES_MAX;
    let scope = LetterScope { ns, machine, older_than: None, keep_suspended };
    let done = purge_machine_letters(keel, scope, &mut pages_left, |n| bar.inc(n)).await;
    bar.finish_and_clear();
    let what = |n: u64| format!("purged {n} dead letter(s) of {machine:?} in namespace {ns:?}");
    let OldLettersPurged { purged, complete } = done.map_err(|failed| {
        let json = json!({ "namespace": ns, "machine": machine, "purged": failed.done.purged });
        PartlyDone::wrap(failed.error, what(failed.done.purged), json)
    })?;
    let more = if complete { "" } else { "; more remain, run it again" };
    let human = capitalized(&what(purged));
    // Counted only after a complete purge: before it, what is left is not only the kept.
    let kept = if keep_suspended && complete {
        kept_letters(keel, ns, Some(machine), None).await
    } else {
        None
    };
    let tail = if keep_suspended {
        let retry = format!("dlq retry --machine {} --all", shell_word(machine));
        format!("{more}.{}", kept_line(kept, ns, &retry))
    } else {
        format!("; the instances stay suspended{more}.")
    };
    Ok(Report::ok(
        json!({
            "namespace": ns,
            "machine": machine,
            "purged": purged,
            "complete": complete,
            "include_suspended": !keep_suspended,
            "kept_suspended": kept.map(|k| k.count),
            "kept_at_least": kept.is_some_and(|k| !k.complete),
        }),
        format!("{human}{tail}"),
    ))
}

/// `keel upgrade`.
pub async fn upgrade(keel: &Keel, ns: &str, args: UpgradeArgs) -> anyhow::Result<Report> {
    if args.from == args.to {
        bail!("--to: it equals --from ({}); name the version to move to", args.from);
    }
    let defs = Definitions::load(&args.definitions)?;
    let from = defs.find(&args.machine, Some(args.from), "--from")?.clone();
    let to = defs.find(&args.machine, Some(args.to), "--to")?.clone();
    let mut migration = Migration::new(from, to).map_err(|e| anyhow!("{e}"))?;
    for map in &args.maps {
        let (old, new) = map.split_once('=').ok_or_else(|| {
            anyhow!("--map: {map:?} is not OLD=NEW; write e.g. --map cart=basket")
        })?;
        migration =
            migration.map(old.trim(), new.trim()).map_err(|e| anyhow!("--map {map}: {e}"))?;
    }
    let run = keel.migrate(migration).namespace(ns).run(args.dry_run).await;
    let report = run.map_err(|stopped| {
        let r = &stopped.done;
        let done = format!(
            "moved {} instance(s) of {} v{} to v{} in namespace {ns:?} ({} refused, {} running a step)",
            r.moved(),
            args.machine,
            args.from,
            args.to,
            r.refusals(),
            r.busy
        );
        let json = json!({ "namespace": ns, "moved": r.moved(), "refused": r.refusals(), "busy": r.busy, "dry_run": r.dry_run });
        PartlyDone::wrap(stopped.error, done, json)
    })?;
    let moves: Vec<_> = report
        .moves
        .iter()
        .map(|((old, new), n)| json!({ "from": old, "to": new, "count": n }))
        .collect();
    let refused: Vec<_> = report
        .refused
        .iter()
        .map(|((old, why), n)| json!({ "from": old, "reason": why, "count": n }))
        .collect();
    let body = json!({
        "namespace": ns,
        "machine": args.machine,
        "from_version": args.from,
        "to_version": args.to,
        "dry_run": report.dry_run,
        "moved": report.moved(),
        "moves": moves,
        "refused": refused,
        "busy": report.busy,
        "timers": { "kept": report.timers_kept, "dropped": report.timers_dropped, "armed": report.timers_armed },
    });
    let mut human = format!(
        "{} v{} -> v{} in namespace {ns:?}{}\n{report}",
        args.machine,
        args.from,
        args.to,
        if report.dry_run { " (dry run: nothing written)" } else { "" }
    );
    if report.dry_run {
        if report.refusals() > 0 {
            human.push_str(
                "\nAdd --map OLD=NEW for the refused states, then run without --dry-run.",
            );
        }
        return Ok(Report::ok(body, human));
    }
    // Instances left on the old version make the upgrade a failure a deploy script sees
    // (exit 1), with the report of what did move.
    let left = report.refusals() + report.busy;
    if left == 0 {
        return Ok(Report::ok(body, human));
    }
    let _ = write!(
        human,
        "\nNot every instance moved: {left} left on v{} (refused ones need --map OLD=NEW; busy ones move on a later run).",
        args.from
    );
    Ok(Report { json: body, human, code: crate::exit::Code::Failure })
}

/// What [`purge_old_dead_letters`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OldLettersPurged {
    /// Dead letters deleted.
    pub purged: u64,
    /// False when the page bound stopped it with more left to delete.
    pub complete: bool,
}

/// Deletes namespace `ns`'s dead letters created more than `age` ago, machine by machine
/// and a page (`DEAD_LETTER_BATCH_MAX`) at a time, at most `pages_max` pages in all,
/// keeping those whose instance is still suspended: such a letter is the only way to
/// retry its instance. The purge of the dashboard's form; other namespaces are
/// untouched. On a store error, what was deleted before it comes with the error.
pub async fn purge_old_dead_letters(
    keel: &Keel,
    ns: &str,
    age: Duration,
    pages_max: usize,
) -> Result<OldLettersPurged, Stopped<OldLettersPurged>> {
    purge_dead_letters_before(keel, ns, now().minus(age), pages_max, true).await
}

/// Deletes namespace `ns`'s dead letters created before `cutoff`, as
/// [`purge_old_dead_letters`] does; `keep_suspended` false deletes those whose instance
/// is still suspended too (`keel dlq purge --include-suspended`), leaving those instances
/// with nothing to retry them by.
pub async fn purge_dead_letters_before(
    keel: &Keel,
    ns: &str,
    cutoff: Timestamp,
    pages_max: usize,
    keep_suspended: bool,
) -> Result<OldLettersPurged, Stopped<OldLettersPurged>> {
    let nothing = OldLettersPurged { purged: 0, complete: false };
    let machines: BTreeSet<String> = keel
        .store()
        .dead_letter_counts(Some(ns.to_owned()))
        .await
        .map_err(|error| Stopped { done: nothing, error })?
        .into_iter()
        .filter(|c| c.namespace == ns && c.count > 0)
        .map(|c| c.machine)
        .collect();
    let (mut purged, mut pages_left) = (0, pages_max);
    for machine in machines {
        let scope = LetterScope { ns, machine: &machine, older_than: Some(cutoff), keep_suspended };
        let done = purge_machine_letters(keel, scope, &mut pages_left, |_| {}).await.map_err(
            |failed| Stopped {
                done: OldLettersPurged { purged: purged + failed.done.purged, complete: false },
                error: failed.error,
            },
        )?;
        purged += done.purged;
        if !done.complete {
            return Ok(OldLettersPurged { purged, complete: false });
        }
    }
    Ok(OldLettersPurged { purged, complete: true })
}

/// Which dead letters [`purge_machine_letters`] deletes.
struct LetterScope<'a> {
    ns: &'a str,
    machine: &'a str,
    /// Only those created before it (all, without it).
    older_than: Option<Timestamp>,
    /// Leave those whose instance is still suspended.
    keep_suspended: bool,
}

/// Deletes `machine`'s dead letters in `ns` (those created before `older_than`, or all;
/// not those of a still suspended instance when `keep_suspended`) a page
/// (`DEAD_LETTER_BATCH_MAX`) at a time while `pages_left` lasts, calling `on_page` with
/// each page's count; `complete` is false when the pages ran out first.
async fn purge_machine_letters(
    keel: &Keel,
    scope: LetterScope<'_>,
    pages_left: &mut usize,
    mut on_page: impl FnMut(u64),
) -> Result<OldLettersPurged, Stopped<OldLettersPurged>> {
    let page = keel_core::limits::DEAD_LETTER_BATCH_MAX as u64;
    let mut purged = 0;
    loop {
        if *pages_left == 0 {
            return Ok(OldLettersPurged { purged, complete: false });
        }
        *pages_left -= 1;
        let n = keel
            .store()
            .dead_letter_purge(DeadLetterPurgeParams {
                selector: Some(DeadLetterSelector::Machine {
                    namespace: scope.ns.to_owned(),
                    machine: scope.machine.to_owned(),
                }),
                older_than: scope.older_than,
                keep_suspended: scope.keep_suspended,
            })
            .await
            .map_err(|error| Stopped {
                done: OldLettersPurged { purged, complete: false },
                error,
            })?;
        purged += n;
        on_page(n);
        if n < page {
            return Ok(OldLettersPurged { purged, complete: true });
        }
    }
}

/// Most dead letters read to count those a purge kept ([`kept_letters`]).
pub const KEPT_READ_MAX: usize = 1_000;

/// How many of `ns`'s dead letters (of `machine`, or all) created before `older_than`
/// (all, without it) are left after a complete purge that kept the letters of suspended
/// instances: those are the kept ones (give or take letters recorded meanwhile). Without
/// a cutoff the grouped count of letters left is the answer; with one, it reads at most
/// [`KEPT_READ_MAX`] letters, oldest first (ids follow creation time), when that count
/// says there is anything to read, and the count is not `complete` when that read
/// stopped first with older letters left. `None` when a read fails: the purge itself is
/// done, only the count is missing.
pub async fn kept_letters(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    older_than: Option<Timestamp>,
) -> Option<Counted> {
    let counts = crate::commands::dead_letter_counts(keel, ns).await.ok()?;
    let left: u64 = counts
        .iter()
        .filter(|(name, _)| machine.is_none_or(|m| name.as_str() == m))
        .map(|(_, count)| count)
        .sum();
    // Without a cutoff every letter left is a kept one: the grouped count is exact.
    if left == 0 || older_than.is_none() {
        return Some(Counted::exact(left));
    }
    let filter = keel_core::ports::store::DeadLetterFilter {
        namespace: Some(ns.to_owned()),
        machine: machine.map(str::to_owned),
        limit: KEPT_READ_MAX,
        ..Default::default()
    };
    let page = keel.store().dead_letter_list(filter).await.ok()?;
    let old = |d: &keel_core::instance::DeadLetter| older_than.is_none_or(|t| d.created_at < t);
    let count = page.iter().filter(|d| old(d)).count() as u64;
    let cut = page.len() == KEPT_READ_MAX && page.last().is_some_and(old);
    Some(Counted { count, complete: !cut })
}

/// The line a purge that kept suspended instances' letters adds, naming how to act on
/// them (`retry` is the retry command for them); empty when none were kept.
pub fn kept_line(kept: Option<Counted>, ns: &str, retry: &str) -> String {
    match kept {
        Some(Counted { count: 0, .. }) | None => String::new(),
        Some(kept) => format!(
            "\nKept {} dead letter(s) whose instance is still suspended (a letter is the only way to retry it): retry them with `{}`, or cancel the instances.",
            kept.text(),
            hint(ns, retry)
        ),
    }
}

/// What [`retry_machine_letters`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MachineRetried {
    /// The instances made runnable, in dead-letter order, each once.
    pub retried: Vec<InstanceId>,
    /// Dead letters read and left in place: their instance is no longer suspended
    /// (cancelled, moved on, or retried through an older letter), is gone, or was already
    /// retried by this run (it failed again since: retrying it again would only repeat
    /// the failure).
    pub stale: u64,
    /// False when the page bound stopped it with dead letters left to read.
    pub complete: bool,
}

/// Whether the store refused a dead-letter retry because the letter is left over: its
/// instance is no longer suspended (moved on, cancelled, retried through an older letter)
/// or is gone. Such a letter only counts against `status` and `health` until it is deleted.
pub(crate) fn letter_left_over(error: &keel::StoreError) -> bool {
    matches!(error.kind, keel::ErrorKind::Conflict | keel::ErrorKind::NotFound)
}

/// Dead letters retried one at a time under one rule, by `keel dlq retry --machine M --all`
/// ([`retry_machine_letters`]) and by the dashboard's "retry selected". An instance runs
/// again at most once per run: a later letter of one already retried is counted stale and
/// left, without asking the store. A letter the store refuses because its instance is no
/// longer suspended (cancelled, moved on, retried through another letter) or is gone is
/// counted stale and left too, so a stale letter never stops the letters after it; such a
/// letter only counts against `status` and `health` until `keel dlq delete ID` removes it.
#[derive(Debug, Clone, Default)]
pub struct LetterRetries {
    retried: Vec<InstanceId>,
    seen: BTreeSet<InstanceId>,
    stale: u64,
}

impl LetterRetries {
    /// Retries `letter`, a dead letter of `instance`, making the instance runnable after
    /// `delay`. Only a store error other than the refusals above is returned; what was
    /// retried before it stays counted here.
    pub async fn retry(
        &mut self,
        keel: &Keel,
        letter: DeadLetterId,
        instance: InstanceId,
        delay: Duration,
    ) -> Result<(), keel::StoreError> {
        if self.seen.contains(&instance) {
            self.stale += 1;
            return Ok(());
        }
        match keel.dead_letter_retry(keel::DeadLetterRetry::one(letter).after(delay)).await {
            Ok(ids) => {
                for id in ids {
                    if self.seen.insert(id) {
                        self.retried.push(id);
                    }
                }
                Ok(())
            }
            // The store refuses a letter whose instance is no longer suspended (moved on,
            // cancelled, retried through an older letter) or is gone.
            Err(e) if letter_left_over(&e) => {
                self.stale += 1;
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// The instances made runnable, in the order their letters were retried, each once.
    pub fn retried(&self) -> &[InstanceId] {
        &self.retried
    }

    /// Letters left in place: their instance was no longer suspended, was gone, or was
    /// already retried by this run.
    pub fn stale(&self) -> u64 {
        self.stale
    }

    /// What a machine-wide retry did, from these retries.
    fn machine(&self, complete: bool) -> MachineRetried {
        MachineRetried { retried: self.retried.clone(), stale: self.stale, complete }
    }
}

/// Dead letters a machine-wide retry reads per page at most. A dead letter carries its
/// event's payload (up to 1 MiB) and the errors of its attempts, and the retry only needs
/// its id and instance, so pages stay small to bound the memory one page holds.
pub const RETRY_PAGE_MAX: usize = 100;

/// Pages (of [`RETRY_PAGE_MAX`] dead letters) a machine-wide retry reads at most: ten
/// million dead letters.
pub const RETRY_PAGES_MAX: usize = 100_000;

/// Retries every dead letter of `machine` in `ns` whose instance is still suspended,
/// reading the letters oldest first by id cursor, `page_size` at a time (1 to
/// [`RETRY_PAGE_MAX`]), at most `pages_max` pages, calling `on_page` with each page's size.
///
/// Only the letters that exist when it starts are read: the newest letter's id is read
/// first and the walk stops there, so an instance retried here that fails again (and is
/// dead-lettered again while the walk goes on) is not retried a second time by the same
/// run, and a run lasts as long as the letters it started with. An instance is retried at
/// most once per run: a later letter of one already retried is counted stale and left.
///
/// Each letter is retried by its id; one the store refuses because its instance is no
/// longer suspended (or is gone) is counted stale and left, so stale letters, however many
/// and wherever they sit, never hide the ones behind them (a store's machine-wide retry
/// only looks at the oldest batch). On a store error, the instances already retried come
/// with the error.
pub async fn retry_machine_letters(
    keel: &Keel,
    ns: &str,
    machine: &str,
    delay: Option<Duration>,
    page_size: usize,
    pages_max: usize,
    mut on_page: impl FnMut(u64),
) -> Result<MachineRetried, Stopped<MachineRetried>> {
    let page_size = page_size.clamp(1, RETRY_PAGE_MAX);
    let mut done = LetterRetries::default();
    let filter = |after, before, limit| keel::DeadLetterFilter {
        namespace: Some(ns.to_owned()),
        machine: Some(machine.to_owned()),
        after,
        before,
        limit,
    };
    // The newest letter now: the page of one letter before the end of the id range (a
    // `before` cursor reads downwards from it; `after` and `before` cannot be combined,
    // so the walk below reads by `after` and stops at this id itself).
    let newest = match keel.dead_letters(filter(None, Some(DeadLetterId(i64::MAX)), 1)).await {
        Ok(letters) => letters.last().map(|d| d.id),
        Err(error) => return Err(Stopped { done: done.machine(false), error }),
    };
    let Some(last) = newest else {
        return Ok(done.machine(true));
    };
    let mut after = None;
    for _ in 0..pages_max {
        let letters = match keel.dead_letters(filter(after, None, page_size)).await {
            Ok(letters) => letters,
            Err(error) => return Err(Stopped { done: done.machine(false), error }),
        };
        // Letters recorded since the run began (above `last`) are left to a later run.
        let in_run = letters.iter().take_while(|d| d.id <= last);
        let mut read = 0;
        for d in in_run {
            read += 1;
            let delay = delay.unwrap_or_default();
            if let Err(error) = done.retry(keel, d.id, d.letter.instance, delay).await {
                return Err(Stopped { done: done.machine(false), error });
            }
        }
        on_page(read);
        let reached = letters.last().is_none_or(|d| d.id >= last);
        if reached || letters.len() < page_size {
            return Ok(done.machine(true));
        }
        after = letters.last().map(|d| d.id);
    }
    Ok(done.machine(false))
}

/// How far back [`known_names`] looks at ended instances and worker beats: a machine
/// that ended an instance, or had a worker, within this is known.
pub const KNOWN_WITHIN: Duration = Duration::from_secs(86_400);

/// A machine name the store holds nothing of in a namespace: no instance (in any status),
/// no dead letter, and no worker seen in the last day declares it. A bulk command given
/// one does nothing, as for any machine with nothing to act on, and exits 0 (a machine
/// defined in code may have nothing stored yet); it says so on stderr, with the closest
/// known name, and its `--json` report carries the same ([`UnknownMachine::annotate`]),
/// so a typo never reads as a plain "0 affected".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownMachine {
    /// The name given.
    pub machine: String,
    /// The namespace looked in.
    pub namespace: String,
    /// The known name it most likely misspells (`keel_core::config::closest`).
    pub closest: Option<String>,
    /// Names the store knows in the namespace, sorted, at most [`SHOWN_MAX`] (the
    /// closest one is named besides, wherever it sorts).
    pub known: Vec<String>,
    /// How many more names were found than `known` lists.
    pub known_more: usize,
}

impl std::fmt::Display for UnknownMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let UnknownMachine { machine, namespace: ns, .. } = self;
        write!(
            f,
            "namespace {ns:?} holds nothing of machine {machine:?} (no instance, dead letter or worker seen in the last day)"
        )?;
        if self.known.is_empty() {
            return write!(
                f,
                "; the store knows no machine in namespace {ns:?}: check the namespace (-n / KEEL_NAMESPACE) and --database-url."
            );
        }
        let more = match self.known_more {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        match &self.closest {
            Some(near) => write!(f, "; did you mean `{near}`?")?,
            None => f.write_str(".")?,
        }
        write!(
            f,
            " Machines in namespace {ns:?}: {}{more}. Check the name, or the namespace (-n).",
            self.known.join(", ")
        )
    }
}

impl UnknownMachine {
    /// Adds to a bulk command's `--json` report what its text says on stderr:
    /// `unknown_machine: true`, the closest known name (`did_you_mean`, or null) and the
    /// names known (`machines`, bounded, with `machines_more`).
    pub fn annotate(&self, json: &mut serde_json::Value) {
        json["unknown_machine"] = true.into();
        json["did_you_mean"] = json!(self.closest);
        json["machines"] = json!(self.known);
        json["machines_more"] = self.known_more.into();
    }
}

/// The machine `machine` when the store holds nothing of it in `ns` ([`UnknownMachine`]):
/// no instance in any status (one indexed read of at most one row), and then not among
/// the [`known_names`]. `None`: the store knows it.
pub async fn unknown_machine(
    keel: &Keel,
    ns: &str,
    machine: &str,
) -> anyhow::Result<Option<UnknownMachine>> {
    if has_instances(keel, ns, machine).await? {
        return Ok(None);
    }
    let known = known_names(keel, ns).await?.machines;
    if known.contains(machine) {
        return Ok(None);
    }
    let closest = keel::settings::closest(machine, known.iter().map(String::as_str));
    Ok(Some(UnknownMachine {
        machine: machine.to_owned(),
        namespace: ns.to_owned(),
        closest: closest.map(str::to_owned),
        known_more: known.len().saturating_sub(SHOWN_MAX),
        known: known.into_iter().take(SHOWN_MAX).collect(),
    }))
}

/// Finishes the report of a bulk command that acted on `machine` in `ns`: when the store
/// holds nothing of it ([`unknown_machine`]), prints a warning on stderr and marks the
/// `--json` report ([`UnknownMachine::annotate`]); else `unknown_machine: false`. The
/// exit code stays the report's.
pub async fn note_unknown_machine(
    keel: &Keel,
    ns: &str,
    machine: &str,
    mut report: Report,
) -> anyhow::Result<Report> {
    match unknown_machine(keel, ns, machine).await? {
        Some(unknown) => {
            crate::output::warn(&unknown.to_string());
            unknown.annotate(&mut report.json);
        }
        None => report.json["unknown_machine"] = false.into(),
    }
    Ok(report)
}

/// The names the store knows in a namespace (see [`known_names`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownNames {
    /// Machines, sorted.
    pub machines: BTreeSet<String>,
    /// Queues, sorted.
    pub queues: BTreeSet<String>,
}

/// Whether `ns` holds any instance of `machine`, in any status: one indexed read of at
/// most one row.
pub async fn has_instances(keel: &Keel, ns: &str, machine: &str) -> anyhow::Result<bool> {
    let any = InstanceListParams {
        namespace: ns.to_owned(),
        machine: Some(machine.to_owned()),
        limit: 1,
        ..InstanceListParams::default()
    };
    Ok(!keel.store().instance_list(any).await?.is_empty())
}

/// The machine and queue names the store knows in `ns`, from grouped reads that carry
/// names and counts, never instance rows: machines with dead letters
/// (`dead_letter_counts`), with unfinished instances (`queue_stats`, which `keel status`
/// reads too), with instances ended within [`KNOWN_WITHIN`] (`instance_activity` over
/// one bucket, on the index of ended instances), and those declared for `ns` by workers
/// seen within [`KNOWN_WITHIN`] of going stale (at most `WORKER_LIST_MAX`); queues that
/// hold unfinished instances or have settings (`queue_list`: paused ones). The grouped
/// reads return one row per name; they scan what they count, as `keel status` does.
pub async fn known_names(keel: &Keel, ns: &str) -> anyhow::Result<KnownNames> {
    let mut known = KnownNames::default();
    for count in keel.store().dead_letter_counts(Some(ns.to_owned())).await? {
        known.machines.insert(count.machine);
    }
    let now = now();
    for stats in keel.store().queue_stats(Some(ns.to_owned()), now).await? {
        known.machines.insert(stats.machine);
        known.queues.insert(stats.queue);
    }
    for queue in keel.store().queue_list(ns.to_owned()).await? {
        known.queues.insert(queue.queue);
    }
    let until = now.plus(Duration::from_millis(1));
    let ended = ActivityParams {
        namespace: Some(ns.to_owned()),
        since: until.minus(KNOWN_WITHIN),
        until,
        bucket: KNOWN_WITHIN,
    };
    for bucket in keel.store().instance_activity(ended).await? {
        known.machines.insert(bucket.machine);
    }
    let seen_since = now.minus(WORKER_STALE_AFTER + KNOWN_WITHIN);
    for worker in keel.store().worker_list(seen_since).await? {
        if worker.claims_from(ns) {
            known.machines.extend(worker.machines.into_iter().map(|m| m.name));
        }
    }
    Ok(known)
}
