//! The commands, each a function from its arguments and a connected store to a [`Report`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, anyhow, bail};
use keel::layers::core::ids::DeadLetterId;
use keel::layers::core::ports::Store;
use keel::layers::core::ports::store::{
    DeadLetterPurgeParams, DeadLetterSelector, QueuePauseParams, QueueState, QueueStats,
    WorkerRecord,
};
use keel::{
    Cancel, ConnectOptions, DeadLetterFilter, DeadLetterRetry, DeliveryOutcome, InsertOutcome,
    InstanceId, Keel, MachineRef, NewInstance, NewSignal, SignalTarget, Value, json,
};
use keel_core::Timestamp;
use keel_core::duration;
use serde::Serialize;

use crate::output::{PartlyDone, Report, SHOWN_MAX, age, table, time};
use crate::{Cli, Command, DlqCommand, StartArgs, TimersCommand};

/// Pages of `DEAD_LETTER_BATCH_MAX` one `keel dlq purge` deletes at most.
const PURGE_PAGES_MAX: usize = 1_000;

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<Report> {
    // Every command reads and checks its configuration file before it opens the store, as
    // `serve` does: a broken keel.toml is the more basic error, and an unreachable store
    // (a connect timeout) must not hide it. `graph` and `upgrade` read it before their
    // definitions file too; `health`, `schedules`, `config` and `serve` read it themselves
    // below.
    let file = settings(&cli)?;
    if let Command::Graph { machine, format, definitions, version } = &cli.command {
        return crate::operate::graph(machine, *format, definitions, *version);
    }
    let migrate = matches!(cli.command, Command::Migrate);
    if let Command::Schedules { command } = &cli.command {
        return crate::schedules_cmd::run(&cli, command.as_ref()).await;
    }
    if let Command::Config(command) = &cli.command {
        return crate::config_cmd::run(&cli, command).await;
    }
    if matches!(cli.command, Command::Health) {
        let config = crate::health::thresholds(&cli)?;
        let keel = crate::health::connect(&cli).await?;
        return crate::health::run(&keel, &cli, &config).await;
    }
    if let Command::Serve { listen, tokens, definitions, no_worker } = &cli.command {
        // The flags and files are checked before the store is opened.
        let (tokens, definitions) = (tokens.as_deref(), definitions.as_deref());
        crate::serve::run(&cli, *listen, tokens, definitions, !*no_worker).await?;
        return Ok(Report::ok(json!({ "stopped": true }), "Stopped."));
    }
    let mut keel = connect(&cli, migrate).await?;
    if let Some(file) = file {
        keel = keel.with_settings(file);
    }
    let ns = cli.namespace.as_str();
    match cli.command {
        Command::Status { machine } => status(&keel, ns, machine.as_deref()).await,
        Command::Pause { queue } => pause(&keel, ns, &queue, true).await,
        Command::Resume { queue } => pause(&keel, ns, &queue, false).await,
        Command::Dlq(command) => dlq(&keel, ns, command).await,
        Command::Inspect { target } => inspect(&keel, ns, &target).await,
        Command::History(args) => {
            let id = resolve(&keel, ns, &args.target).await?;
            let before = args.before.as_deref();
            crate::operate::history(&keel, ns, id, before, args.limit).await
        }
        Command::Start(args) => start(&keel, ns, args).await,
        Command::Send { target, event, payload, dedup_key, priority } => {
            send(&keel, ns, &target, &event, payload.as_deref(), dedup_key, priority).await
        }
        Command::Cancel { target, cascade, reason } => {
            cancel(&keel, ns, &target, cascade, reason).await
        }
        Command::Timers(TimersCommand::Status) => timers(&keel, ns).await,
        Command::Migrate => Ok(Report::ok(
            json!({ "migrated": true, "store": keel.describe() }),
            format!("The store is up to date: {}.", keel.describe()),
        )),
        Command::List(args) => {
            let (machine, first) = (args.machine.clone(), args.after.is_none());
            let report = crate::operate::list(&keel, ns, args).await?;
            let empty = report.json["instances"].as_array().is_none_or(Vec::is_empty);
            unknown_if_empty(&keel, ns, Some(&machine), first && empty, report).await
        }
        Command::Workers { stale_after, all_namespaces } => {
            let only = (!all_namespaces).then_some(ns);
            crate::operate::workers_in(&keel, only, &stale_after).await
        }
        Command::Purge { machine, pending, dlq: _, include_suspended, confirm } => {
            crate::operate::purge(&keel, ns, &machine, pending, include_suspended, confirm).await
        }
        Command::Upgrade(args) => crate::operate::upgrade(&keel, ns, args).await,
        Command::Health
        | Command::Serve { .. }
        | Command::Graph { .. }
        | Command::Schedules { .. }
        | Command::Config(_) => {
            unreachable!("handled above")
        }
    }
}

/// The configuration file `--config` (or `KEEL_CONFIG`) names, read and checked the way
/// a worker reads it ([`crate::config_cmd::load`]), for the commands that do not read it
/// themselves. What `start` or `send` leaves unset takes the file's queue and priority, so
/// for them it is returned (also when only `KEEL_QUEUE_*` overrides are set, as a worker
/// applies them). The other commands take nothing from it, yet a file that is missing or
/// does not load is still an error naming it: a user who named a file expects it to be
/// the one in force, and a command that runs silently past a broken file hides a deploy
/// that will fail. A file that loads is accepted, as `KEEL_CONFIG` is often set for a
/// whole environment.
fn settings(cli: &Cli) -> anyhow::Result<Option<keel_core::config::KeelConfig>> {
    match cli.command {
        Command::Health
        | Command::Schedules { .. }
        | Command::Config(_)
        | Command::Serve { .. } => Ok(None),
        Command::Start(_) | Command::Send { .. } => {
            let (config, overrides) = crate::config_cmd::load(cli)?;
            Ok((cli.config.is_some() || !overrides.is_empty()).then_some(config))
        }
        _ => {
            if cli.config.is_some() {
                crate::config_cmd::load(cli)?;
            }
            Ok(None)
        }
    }
}

/// Opens the store. Only `migrate` creates a database or changes PostgreSQL tables: the
/// other commands leave a schema as they find it (an existing SQLite file is always
/// brought up to date) and refuse a SQLite file that does not exist, so a mistyped path
/// is an error rather than a new, empty database.
pub async fn connect(cli: &Cli, migrate: bool) -> anyhow::Result<Keel> {
    let options = ConnectOptions::default().schema(&cli.schema).migrate(migrate).create(migrate);
    Keel::connect_with(&cli.database_url, options)
        .await
        .context("connect with --database-url or KEEL_DATABASE_URL (run `keel migrate` first on a new database)")
}

/// The wall clock in the store's unit.
pub fn now() -> Timestamp {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    Timestamp(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// One row of `status`.
#[derive(Debug, Serialize)]
pub struct StatusRow {
    /// Namespace.
    pub namespace: String,
    /// Queue (empty for a machine with only dead letters left).
    pub queue: String,
    /// Machine name.
    pub machine: String,
    /// Runnable now.
    pub ready: u64,
    /// Runnable later (back-off, delayed start).
    pub scheduled: u64,
    /// Under a lease.
    pub executing: u64,
    /// Parked on a signal or on children.
    pub waiting: u64,
    /// Dead-lettered, waiting for an operator.
    pub suspended: u64,
    /// The machine's dead-letter records (they belong to a machine, not a queue): on the
    /// machine's first row only, `0` on its others, so a sum over rows counts each once.
    pub dead_letters: u64,
    /// Age of the oldest ready instance.
    pub oldest_ready_age_ms: Option<i64>,
    /// Whether the queue is paused.
    pub paused: bool,
}

/// Per queue and machine counts, joined with dead letters and pause flags.
pub async fn status_rows(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
) -> anyhow::Result<Vec<StatusRow>> {
    let now = now();
    let stats = keel.store().queue_stats(Some(ns.to_owned()), now).await?;
    let queues = keel.store().queue_list(ns.to_owned()).await?;
    status_rows_from(keel, ns, machine, &stats, &queues, now).await
}

/// The status rows and the last hour of `ns` at `now`, from one read of the queue counts:
/// what `keel status`, the health probe and the dashboard's overview show together.
pub async fn status_and_activity(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    now: Timestamp,
) -> anyhow::Result<(Vec<StatusRow>, Vec<crate::operate::MachineActivity>)> {
    let status = status_activity_and_queues(keel, ns, machine, now).await?;
    Ok((status.rows, status.activity))
}

/// What `keel status` shows, from one read of the queue counts and one of the queue list.
pub(crate) struct StatusRead {
    /// The status rows, filtered to the `machine` asked for.
    pub(crate) rows: Vec<StatusRow>,
    /// The last hour, per machine.
    pub(crate) activity: Vec<crate::operate::MachineActivity>,
    /// The queues that hold unfinished instances of any machine (not only `machine`'s).
    pub(crate) busy: std::collections::BTreeSet<String>,
    /// The paused queues, sorted: those with unfinished instances and those without.
    pub(crate) paused: Vec<String>,
}

impl StatusRead {
    /// The paused queues with nothing unfinished in them, in name order.
    pub(crate) fn idle_paused(&self) -> Vec<String> {
        idle_paused(&self.paused, &self.busy)
    }
}

/// The queues of `paused` that `busy` does not hold: paused with nothing unfinished in
/// them (paused ahead of a deploy, or a name no work has used yet), in `paused`'s order.
/// `keel status` and the dashboard's overview both name these.
pub(crate) fn idle_paused(
    paused: &[String],
    busy: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    paused.iter().filter(|q| !busy.contains(q.as_str())).cloned().collect()
}

/// [`status_and_activity`], with the queues that hold unfinished instances of any machine
/// (the rows are filtered to `machine`; this set is not) and the paused queues, both read
/// with the rows so they agree with them.
pub(crate) async fn status_activity_and_queues(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    now: Timestamp,
) -> anyhow::Result<StatusRead> {
    let stats = keel.store().queue_stats(Some(ns.to_owned()), now).await?;
    let queues = keel.store().queue_list(ns.to_owned()).await?;
    let rows = status_rows_from(keel, ns, machine, &stats, &queues, now).await?;
    let activity = crate::operate::activity_from(keel, ns, machine, now, &stats).await?;
    let busy = stats.into_iter().map(|s| s.queue).collect();
    let mut paused: Vec<String> =
        queues.into_iter().filter(|q| q.paused).map(|q| q.queue).collect();
    paused.sort();
    Ok(StatusRead { rows, activity, busy, paused })
}

/// [`status_rows`] from queue counts and the queue list already read at `now`.
async fn status_rows_from(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    stats: &[QueueStats],
    queues: &[QueueState],
    now: Timestamp,
) -> anyhow::Result<Vec<StatusRow>> {
    let paused: BTreeMap<&str, bool> =
        queues.iter().map(|q| (q.queue.as_str(), q.paused)).collect();
    let dead = dead_letter_counts(keel, ns).await?;
    let mut rows: BTreeMap<(String, String), StatusRow> = BTreeMap::new();
    for s in stats {
        rows.insert(
            (s.queue.clone(), s.machine.clone()),
            StatusRow {
                paused: paused.get(s.queue.as_str()).copied().unwrap_or(false),
                dead_letters: dead.get(&s.machine).copied().unwrap_or(0),
                oldest_ready_age_ms: s.oldest_ready_at.map(|at| now.0 - at.0),
                namespace: s.namespace.clone(),
                queue: s.queue.clone(),
                machine: s.machine.clone(),
                ready: s.ready,
                scheduled: s.scheduled,
                executing: s.executing,
                waiting: s.waiting,
                suspended: s.suspended,
            },
        );
    }
    // Each machine's dead letters on its first row only (a machine in two queues would
    // otherwise count them twice).
    let mut counted = std::collections::BTreeSet::new();
    for row in rows.values_mut() {
        if !counted.insert(row.machine.clone()) {
            row.dead_letters = 0;
        }
    }
    // A machine whose instances all ended can still hold dead letters worth showing.
    for (name, count) in dead {
        if !rows.keys().any(|(_, m)| *m == name) {
            rows.insert(
                (String::new(), name.clone()),
                StatusRow {
                    namespace: ns.to_owned(),
                    queue: String::new(),
                    machine: name,
                    ready: 0,
                    scheduled: 0,
                    executing: 0,
                    waiting: 0,
                    suspended: 0,
                    dead_letters: count,
                    oldest_ready_age_ms: None,
                    paused: false,
                },
            );
        }
    }
    Ok(rows.into_values().filter(|r| machine.is_none_or(|m| r.machine == m)).collect())
}

/// Dead letters per machine of `ns`, counted by the store (every one, not a page).
pub(crate) async fn dead_letter_counts(
    keel: &Keel,
    ns: &str,
) -> anyhow::Result<BTreeMap<String, u64>> {
    let counts = keel.store().dead_letter_counts(Some(ns.to_owned())).await?;
    Ok(counts.into_iter().map(|c| (c.machine, c.count)).collect())
}

async fn status(keel: &Keel, ns: &str, machine: Option<&str>) -> anyhow::Result<Report> {
    let status = status_activity_and_queues(keel, ns, machine, now()).await?;
    let idle = status.idle_paused();
    let StatusRead { rows, activity, paused, .. } = status;
    let mut t = table(&[
        "queue",
        "machine",
        "ready",
        "scheduled",
        "executing",
        "waiting",
        "suspended",
        "dead letters",
        "oldest ready",
        "paused",
    ]);
    for r in &rows {
        t.add_row(vec![
            r.queue.clone(),
            r.machine.clone(),
            r.ready.to_string(),
            r.scheduled.to_string(),
            r.executing.to_string(),
            r.waiting.to_string(),
            r.suspended.to_string(),
            r.dead_letters.to_string(),
            r.oldest_ready_age_ms.map(age).unwrap_or_default(),
            if r.paused { "PAUSED".into() } else { String::new() },
        ]);
    }
    let mut human = if rows.is_empty() {
        format!("No unfinished instances and no dead letters in namespace {ns:?}.")
    } else {
        format!("Namespace {ns:?}\n{t}")
    };
    // A pause outlives the queue's work (and a misspelt queue never had any): a paused
    // queue with no unfinished instance is still named, so it is not forgotten until work
    // arrives. Whether it is empty is decided over every machine, not the `--machine`
    // rows above: another machine's work in it is still unfinished.
    let empty: Vec<String> = idle.iter().map(|q| shell_word(q)).collect();
    if !empty.is_empty() {
        let _ = write!(
            human,
            "\nPaused, with nothing unfinished in them: {} (`{}` lets workers claim again).",
            crate::output::first_of(empty.into_iter(), |n| format!("and {n} more")).join(", "),
            hint(ns, "resume QUEUE")
        );
    }
    if !activity.is_empty() {
        let _ = write!(human, "\nLast hour\n{}", crate::operate::activity_table(&activity));
    }
    let empty = rows.is_empty() && activity.is_empty();
    let report = Report::ok(
        json!({ "namespace": ns, "queues": rows, "paused_queues": paused, "machines": activity }),
        human,
    );
    unknown_if_empty(keel, ns, machine, empty, report).await
}

/// Finishes the report of a listing filtered to `machine` (`list`, `status --machine`,
/// `dlq list --machine`): an `empty` first page may be a misspelt machine, so when the
/// store holds nothing of it the listing warns on stderr with the closest known name and
/// its `--json` report says so ([`crate::operate::note_unknown_machine`]). A page with
/// rows needs no look-up: `unknown_machine` is false. Without `machine` the report is
/// left as it is.
async fn unknown_if_empty(
    keel: &Keel,
    ns: &str,
    machine: Option<&str>,
    empty: bool,
    mut report: Report,
) -> anyhow::Result<Report> {
    let Some(machine) = machine else { return Ok(report) };
    if empty {
        return crate::operate::note_unknown_machine(keel, ns, machine, report).await;
    }
    report.json["unknown_machine"] = false.into();
    Ok(report)
}

/// What [`set_paused`] found and did.
pub struct PauseChange {
    /// The queue's stored settings said paused before the call.
    pub was_paused: bool,
    /// The call changed whether the queue is paused (a pause of a running queue, a resume
    /// of a paused one).
    pub changed: bool,
    /// The namespace's stored queue settings, as read before the write.
    pub settings: Vec<QueueState>,
}

/// Pauses or resumes a queue; the one place the CLI, the HTTP API and the dashboard do
/// it. A pause always writes the queue's settings row. A resume only updates a stored row
/// (the store never creates one for it): with nothing paused there is nothing to undo, and
/// creating a row would give a misspelt name settings, after which it counts as a known
/// queue. The settings are read first only to report what was paused before.
pub async fn set_paused(
    keel: &Keel,
    ns: &str,
    queue: &str,
    paused: bool,
) -> Result<PauseChange, keel::StoreError> {
    let settings = keel.store().queue_list(ns.to_owned()).await?;
    let was_paused = settings.iter().any(|q| q.namespace == ns && q.queue == queue && q.paused);
    keel.store()
        .queue_pause(QueuePauseParams {
            namespace: ns.to_owned(),
            queue: queue.to_owned(),
            paused,
            now: now(),
        })
        .await?;
    Ok(PauseChange { was_paused, changed: paused != was_paused, settings })
}

/// `keel pause Q` / `keel resume Q`. A pause is stored as the queue's settings row. A
/// resume only updates a stored row: resuming a queue with no settings has nothing to
/// undo, and creating a row would make a misspelt name a queue with settings (one
/// `status` and the did-you-mean hints then treat as known). When such a queue holds
/// unfinished work the resume is a no-op said as one (exit 0: it is running, as asked);
/// when it holds none either, nothing of that name exists, so it is an error naming the
/// closest queue (which may be the paused one the user meant to resume).
async fn pause(keel: &Keel, ns: &str, queue: &str, paused: bool) -> anyhow::Result<Report> {
    let PauseChange { was_paused, changed, settings } = set_paused(keel, ns, queue, paused).await?;
    let stored = settings.iter().find(|q| q.namespace == ns && q.queue == queue);
    let stats = keel.store().queue_stats(Some(ns.to_owned()), now()).await?;
    let in_queue: Vec<_> = stats.iter().filter(|s| s.queue == queue).collect();
    let pending: u64 = in_queue.iter().map(|s| s.ready + s.scheduled).sum();
    // Pausing a queue before anything runs in it is allowed; a typo looks the same, so
    // say so rather than let an operator believe the busy queue stopped.
    let known = !in_queue.is_empty();
    let near = if known {
        None
    } else {
        // The closest queue that holds unfinished work or has settings (a pause).
        let names: std::collections::BTreeSet<&str> = stats
            .iter()
            .map(|s| s.queue.as_str())
            .chain(settings.iter().map(|q| q.queue.as_str()))
            .filter(|q| *q != queue)
            .collect();
        keel::settings::closest(queue, names).map(str::to_owned)
    };
    let check = match &near {
        Some(n) => format!("check the name, did you mean `{n}`?"),
        None => "check the name".to_owned(),
    };
    if !paused && !was_paused && !known && stored.is_none() {
        bail!(
            "queue: {queue:?} in namespace {ns:?} is not paused and holds no unfinished instance, so nothing was resumed; {check} (`{}` lists the queues in use and the paused ones)",
            hint(ns, "status")
        );
    }
    let mut human = if paused {
        format!("Queue {queue:?} in namespace {ns:?}: PAUSED ({pending} pending)")
    } else if was_paused {
        format!("Queue {queue:?} in namespace {ns:?}: running ({pending} pending)")
    } else {
        format!(
            "Queue {queue:?} in namespace {ns:?}: running ({pending} pending); it was not paused, nothing changed"
        )
    };
    if !known {
        let _ = write!(
            human,
            "\nNote: no unfinished instance is in queue {queue:?} in namespace {ns:?}; {check} (`{}` lists the queues in use).",
            hint(ns, "status")
        );
    }
    Ok(Report::ok(
        json!({ "namespace": ns, "queue": queue, "paused": paused, "changed": changed, "pending": pending, "in_use": known, "did_you_mean": near }),
        human,
    ))
}

/// Reads `i42`, `42`, `dl3` or `3` as a number; the error names the field and the form.
fn parse_id(field: &str, prefix: &str, input: &str) -> anyhow::Result<i64> {
    let digits = input.trim().strip_prefix(prefix).unwrap_or(input.trim());
    digits.parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
        anyhow!("{field}: {input:?} is not an id; write a positive number such as {prefix}42 or 42")
    })
}

/// An instance id, or `machine:key` resolved to the newest instance with that key.
async fn resolve(keel: &Keel, ns: &str, target: &str) -> anyhow::Result<InstanceId> {
    if let Some((machine, key)) = target.split_once(':') {
        let found = keel
            .lookup(SignalTarget::Key {
                namespace: ns.to_owned(),
                machine: machine.to_owned(),
                key: key.to_owned(),
            })
            .await?;
        return found.ok_or_else(|| {
            anyhow!(
                "target: no instance of machine {machine:?} with key {key:?} in namespace {ns:?}"
            )
        });
    }
    let id = InstanceId(parse_id("target", "i", target)?);
    let rows = keel.store().instance_rows(vec![id]).await?;
    if !rows.iter().any(|row| row.id == id && row.namespace == ns) {
        bail!("target: no instance {id} in namespace {ns:?}");
    }
    Ok(id)
}

/// Reads a flag's JSON; the error names the flag as typed (`--context`), as the store's
/// refusals of the same value do.
fn parse_json(flag: &str, input: &str) -> anyhow::Result<Value> {
    serde_json::from_str(input).map_err(|error| {
        anyhow!(
            "{flag}: not valid JSON ({error}); quote it for the shell, e.g. {flag} '{{\"a\":1}}'"
        )
    })
}

async fn start(keel: &Keel, ns: &str, args: StartArgs) -> anyhow::Result<Report> {
    let context = match args.context.as_deref() {
        Some(text) => parse_json("--context", text)?,
        None => json!({}),
    };
    if !context.is_object() {
        bail!("--context: must be a JSON object, e.g. --context '{{\"order\":42}}'");
    }
    let (version, note) = match args.version {
        Some(version) => (version, None),
        None => default_version(keel, ns, &args.machine).await?,
    };
    let mut new = NewInstance::new(MachineRef::new(&args.machine, version), &args.at)
        .namespace(ns)
        .context(context);
    if let Some(key) = &args.key {
        new = new.business_key(key);
    }
    if let Some(queue) = &args.queue {
        new = new.queue(queue);
    }
    if let Some(priority) = args.priority {
        new = new.priority(priority);
    }
    let outcome = keel.start(new).await.map_err(|e| flagged(e, START_FLAGS))?;
    let (id, inserted) = match outcome {
        InsertOutcome::Inserted(id) => (id, true),
        InsertOutcome::Existing(id) => (id, false),
    };
    if inserted {
        // Said only for an instance this start created: it is the version it runs.
        if let Some(note) = note {
            crate::output::note(&note);
        }
        let human = format!("Started {id} ({} v{version}).", args.machine);
        return Ok(Report::ok(json!({ "id": id, "inserted": true, "version": version }), human));
    }
    // The key's holder runs the version it was started on, not the one this start chose.
    let held = keel.store().instance_rows(vec![id]).await?.into_iter().find(|r| r.id == id);
    let held = held.map(|r| r.machine);
    let human = match &held {
        Some(m) => {
            format!("Not started: {id} ({} v{}) already holds that unique key.", m.name, m.version)
        }
        None => format!("Not started: {id} already holds that unique key."),
    };
    Ok(Report::ok(
        json!({ "id": id, "inserted": false, "version": held.map(|m| m.version) }),
        human,
    ))
}

/// The version `keel start M` uses without `--version`: the newest one a live worker
/// (seen within `WORKER_STALE_AFTER`) serves for `machine` in `ns`, so a start after a
/// deploy runs on the new code. With no such worker it is 1, with the note (for stderr, once
/// an instance is started) that says so and how to pick another.
async fn default_version(
    keel: &Keel,
    ns: &str,
    machine: &str,
) -> anyhow::Result<(i32, Option<String>)> {
    let live = crate::operate::live_workers(keel, now()).await?;
    if let Some(version) = newest_served(&live, ns, machine) {
        return Ok((version, None));
    }
    let note = format!(
        "no live worker serves {machine:?} in namespace {ns:?}, so this starts version 1; `--version N` starts another"
    );
    Ok((1, Some(note)))
}

/// The newest version of `machine` that one of `workers` serves in `ns`.
pub(crate) fn newest_served(workers: &[WorkerRecord], ns: &str, machine: &str) -> Option<i32> {
    workers
        .iter()
        .filter(|w| w.claims_from(ns))
        .flat_map(|w| &w.machines)
        .filter(|m| m.name == machine)
        .map(|m| m.version)
        .max()
}

/// The store's names for a start's fields, and the argument of `keel start` that gives
/// each (the client's single start already drops the batch's `instances[0].`).
const START_FLAGS: &[(&str, &str)] = &[
    ("machine.name", "machine"),
    ("machine.version", "--version"),
    ("position", "--at"),
    ("business_key", "--key"),
    ("queue", "--queue"),
    ("context", "--context"),
];

/// The store's names for an event's fields, and the argument of `keel send` that gives
/// each.
const SEND_FLAGS: &[(&str, &str)] =
    &[("name", "EVENT"), ("payload", "--payload"), ("dedup_key", "--dedup-key")];

/// A refusal of bad input that names the store's field (`business_key: must not be
/// empty`) said with the argument the user typed (`--key: must not be empty`); any other
/// error as it is.
fn flagged(error: keel_core::StoreError, flags: &[(&str, &str)]) -> anyhow::Error {
    if error.kind == keel_core::ErrorKind::Invalid {
        for (field, flag) in flags {
            if let Some(rest) = error.message.strip_prefix(field).filter(|r| r.starts_with(':')) {
                return anyhow!("{flag}{rest}");
            }
        }
    }
    error.into()
}

async fn send(
    keel: &Keel,
    ns: &str,
    target: &str,
    event: &str,
    payload: Option<&str>,
    dedup_key: Option<String>,
    priority: Option<keel_core::Priority>,
) -> anyhow::Result<Report> {
    let id = resolve(keel, ns, target).await?;
    let mut signal = NewSignal::new(id, event);
    if let Some(text) = payload {
        signal = signal.payload(parse_json("--payload", text)?);
    }
    if let Some(key) = dedup_key {
        signal = signal.dedup_key(key);
    }
    if let Some(priority) = priority {
        signal = signal.priority(priority);
    }
    match keel.send(signal).await.map_err(|e| flagged(e, SEND_FLAGS))? {
        DeliveryOutcome::Delivered { id: signal, target, woke } => Ok(Report::ok(
            json!({ "outcome": "delivered", "signal": signal, "target": target, "woke": woke }),
            format!(
                "Delivered {event} to {target} as {signal}{}.",
                if woke { " (woke it)" } else { "" }
            ),
        )),
        DeliveryOutcome::Duplicate { id: signal, target } => Ok(Report::ok(
            json!({ "outcome": "duplicate", "signal": signal, "target": target }),
            format!("Already delivered: {signal} in {target} has the same dedup key."),
        )),
        DeliveryOutcome::TargetTerminal { target, status } => {
            bail!("target: {target} has ended ({status}); its inbox is closed")
        }
        DeliveryOutcome::TargetMissing => bail!("target: no instance {id}"),
    }
}

async fn cancel(
    keel: &Keel,
    ns: &str,
    target: &str,
    cascade: bool,
    reason: String,
) -> anyhow::Result<Report> {
    let id = resolve(keel, ns, target).await?;
    let mut request = Cancel::new(id).reason(reason);
    if cascade {
        request = request.cascade();
    }
    let cancelled = keel.cancel(request).await?;
    let human = if cancelled.is_empty() {
        format!("Nothing to cancel: {id} has already ended.")
    } else if cancelled.len() <= SHOWN_MAX {
        format!("Cancelled {}.", ids(&cancelled))
    } else {
        format!("Cancelled {} instances: {}.", cancelled.len(), ids(&cancelled))
    };
    let cut = cascade_cut(&cancelled);
    if cut {
        crate::output::warn(&cascade_cut_note(keel, ns, id, &cancelled).await);
    }
    Ok(Report::ok(json!({ "cancelled": cancelled, "complete": !cut }), human))
}

/// Whether a cascading cancel that returned `cancelled` may have stopped at the store's
/// bound with live descendants left (`keel_core::plan::cancel::may_be_cut`).
pub fn cascade_cut(cancelled: &[InstanceId]) -> bool {
    keel_core::plan::cancel::may_be_cut(cancelled.len())
}

/// What the warning of a cut cascade from `root` says: that live descendants may still
/// run, and how to find and cancel them, by the machines of the last ones it cancelled
/// (the cut falls after them; one read of at most `ROWS_BATCH_MAX` rows).
pub async fn cascade_cut_note(
    keel: &Keel,
    ns: &str,
    root: InstanceId,
    cancelled: &[InstanceId],
) -> String {
    let max = keel_core::limits::CANCEL_CASCADE_MAX;
    let tail = cancelled.len().saturating_sub(keel_core::limits::ROWS_BATCH_MAX);
    let tail: Vec<InstanceId> =
        cancelled[tail..].iter().copied().filter(|id| *id != root).collect();
    // The machines are a hint; a failed read leaves the hint general.
    let mut machines: Vec<String> = keel
        .store()
        .instance_rows(tail)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|row| row.machine.name)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if machines.is_empty() {
        machines.push("MACHINE".to_owned());
    }
    let lists = machines
        .iter()
        .take(SHOWN_MAX)
        .map(|m| format!("`{}`", hint(ns, &format!("list {} --status runnable", shell_word(m)))))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "the cascade from {root} stopped at its bound of {max} instances, so live descendants may still run, and cancelling {root} again does nothing now that it has ended. Find them by machine with {lists} (and the other unfinished statuses: executing, awaiting_signal, awaiting_children, suspended), then `{}` each",
        hint(ns, "cancel ID --cascade")
    )
}

async fn inspect(keel: &Keel, ns: &str, target: &str) -> anyhow::Result<Report> {
    let id = resolve(keel, ns, target).await?;
    let detail = keel.get(id).await?;
    let i = &detail.instance;
    let mut human = format!(
        "{} {} ({}) in {}/{}\nstatus:   {}\nposition: {}\nattempt:  {}{}\ncontext:  {}\n",
        i.id,
        i.machine,
        i.business_key.as_deref().unwrap_or("no key"),
        i.namespace,
        i.queue,
        i.status,
        i.position,
        i.attempt,
        i.last_error.as_ref().map(|e| format!(" (last error: {e})")).unwrap_or_default(),
        i.context,
    );
    if let Some(result) = &i.result {
        let _ = writeln!(human, "result:   {result}");
    }
    if !detail.inbox.is_empty() {
        let mut t = table(&["signal", "event", "payload", "received"]);
        for s in &detail.inbox {
            t.add_row(vec![
                s.id.to_string(),
                s.name.clone(),
                s.payload.to_string(),
                time(s.inserted_at.0),
            ]);
        }
        let _ = writeln!(human, "inbox:\n{t}");
        if detail.inbox.len() == keel_core::limits::INBOX_LIST_MAX {
            let _ = writeln!(
                human,
                "(the oldest {} pending signals; more may be waiting)",
                keel_core::limits::INBOX_LIST_MAX
            );
        }
    }
    if !detail.timers.is_empty() {
        let mut t = table(&["timer", "next fire", "fired"]);
        for timer in &detail.timers {
            t.add_row(vec![
                timer.id.to_string(),
                time(timer.next_fire_at.0),
                timer.fire_count.to_string(),
            ]);
        }
        let _ = writeln!(human, "timers:\n{t}");
        if detail.timers.len() == keel_core::limits::TIMER_LIST_MAX {
            let _ = writeln!(
                human,
                "(the soonest {} armed timers; more may be armed)",
                keel_core::limits::TIMER_LIST_MAX
            );
        }
    }
    if !detail.children.is_empty() {
        let mut t = table(&["child", "machine", "status", "position"]);
        for c in &detail.children {
            t.add_row(vec![
                c.id.to_string(),
                c.machine.to_string(),
                c.status.to_string(),
                c.position.clone(),
            ]);
        }
        let _ = writeln!(human, "children:\n{t}");
        if detail.children.len() == keel_core::limits::CHILDREN_LIST_MAX {
            let _ = writeln!(
                human,
                "(the oldest {} children; more may exist)",
                keel_core::limits::CHILDREN_LIST_MAX
            );
        }
    }
    let mut t = table(&["at", "rev", "attempt", "entry"]);
    for h in &detail.history {
        t.add_row(vec![
            time(h.at.0),
            h.revision.0.to_string(),
            h.attempt.to_string(),
            serde_json::to_string(&h.entry).unwrap_or_default(),
        ]);
    }
    if detail.history.is_empty() {
        human.push_str("history:  none yet (no step has run)");
    } else {
        let _ = write!(human, "history:\n{t}");
    }
    // The detail holds the newest entries only; older ones are a page read away.
    if detail.history.len() == keel_core::limits::HISTORY_LIST_MAX
        && let Some(oldest) = detail.history.first()
    {
        let more = format!("history {} --before {}", i.id, oldest.seq);
        let _ = write!(
            human,
            "\n(the newest {} entries; older ones: `{}`)",
            keel_core::limits::HISTORY_LIST_MAX,
            hint(ns, &more)
        );
    }
    let body = json!({
        "instance": detail.instance,
        "inbox": detail.inbox,
        "timers": detail.timers,
        "children": detail.children,
        "history": detail.history,
    });
    Ok(Report::ok(body, human))
}

async fn timers(keel: &Keel, ns: &str) -> anyhow::Result<Report> {
    let now = now();
    let status = keel.store().timer_status(Some(ns.to_owned()), now).await?;
    let mut t = table(&["machine", "armed", "overdue", "next due", "last sweep"]);
    let mut rows = Vec::new();
    for s in &status {
        t.add_row(vec![
            s.machine.clone(),
            s.armed.to_string(),
            s.overdue.to_string(),
            s.next_due.map(|at| time(at.0)).unwrap_or_default(),
            s.last_sweep_at.map_or_else(|| "never".into(), |at| time(at.0)),
        ]);
        rows.push(json!({
            "namespace": s.namespace,
            "machine": s.machine,
            "armed": s.armed,
            "overdue": s.overdue,
            "next_due": s.next_due,
            "last_sweep_at": s.last_sweep_at,
        }));
    }
    let human = if status.is_empty() {
        format!("No armed timers in namespace {ns:?}.")
    } else {
        t.to_string()
    };
    Ok(Report::ok(json!({ "namespace": ns, "machines": rows }), human))
}

async fn dlq(keel: &Keel, ns: &str, command: DlqCommand) -> anyhow::Result<Report> {
    match command {
        DlqCommand::List { machine, limit, after } => {
            let first = after.is_none();
            let report =
                dead_letter_page(keel, ns, machine.clone(), limit, after.as_deref()).await?;
            let empty = report.json["dead_letters"].as_array().is_none_or(Vec::is_empty);
            unknown_if_empty(keel, ns, machine.as_deref(), first && empty, report).await
        }
        DlqCommand::Inspect { id } => {
            let d = letter_in(keel, ns, &id).await?;
            let mut human = format!(
                "{} for {} ({}) at {}\nreason:   {} after {} attempts\nevent:    {}\ncorrelation: {}\nerrors:\n",
                d.id,
                d.letter.instance,
                d.letter.machine,
                d.letter.position,
                d.letter.reason,
                d.letter.attempts,
                d.letter.event.as_ref().map_or_else(|| "none (a step)".into(), ToString::to_string),
                d.letter.correlation_id.as_deref().unwrap_or("none"),
            );
            let mut t = table(&["attempt", "at", "error"]);
            for e in &d.letter.errors {
                t.add_row(vec![e.attempt.to_string(), time(e.at.0), e.error.clone()]);
            }
            human.push_str(&t.to_string());
            Ok(Report::ok(json!(d), human))
        }
        DlqCommand::Retry { id, machine, all: _, delay } => {
            let delay = parse_duration("delay", delay.as_deref())?;
            // Bounded as the store bounds it, but said with the flag the user typed.
            let max = keel_core::limits::RETRY_DELAY_MAX;
            if let Some(delay) = delay.filter(|d| *d > max) {
                bail!(
                    "--delay: {} is longer than the limit of {} (one year); retry sooner, or leave the dead letter until it is time",
                    duration::format(delay),
                    duration::format(max)
                );
            }
            match (id, machine) {
                (Some(id), _) => {
                    // The id alone selects across namespaces: check it is this one's first.
                    let letter = letter_in(keel, ns, &id).await?;
                    let retry = DeadLetterRetry::one(letter.id).after(delay.unwrap_or_default());
                    let retried = keel.dead_letter_retry(retry).await.map_err(|e| {
                        if !crate::operate::letter_left_over(&e) {
                            return anyhow::Error::from(e);
                        }
                        anyhow!(
                            "{e}; this dead letter is left over: `{}` removes it",
                            hint(ns, &format!("dlq delete {}", letter.id))
                        )
                    })?;
                    let human =
                        format!("Retried {} instance(s): {}.", retried.len(), ids(&retried));
                    Ok(Report::ok(json!({ "retried": retried }), human))
                }
                (None, Some(machine)) => retry_machine(keel, ns, &machine, delay).await,
                (None, None) => bail!("id: give a dead letter id, or --machine M --all"),
            }
        }
        DlqCommand::Delete { id } => delete_letter(keel, ns, &id).await,
        DlqCommand::Purge { older_than, include_suspended, confirm } => {
            let age = parse_duration("older-than", Some(&older_than))?.unwrap_or_default();
            let older = duration::format(age);
            if !confirm {
                // Counted first (grouped counts, not a read of every letter), so the purge
                // is confirmed knowing what it may touch.
                let letters: u64 = dead_letter_counts(keel, ns).await?.values().sum();
                let stats = keel.store().queue_stats(Some(ns.to_owned()), now()).await?;
                let suspended: u64 =
                    stats.iter().filter(|s| s.namespace == ns).map(|s| s.suspended).sum();
                let kept = if include_suspended {
                    format!(
                        "the letters of its {suspended} suspended instance(s) go too, leaving them nothing to be retried by"
                    )
                } else {
                    format!("the letters of its {suspended} suspended instance(s) stay")
                };
                bail!(
                    "purge deletes the dead letters older than {older} in namespace {ns:?} for good (it holds {letters} dead letter(s) of any age now; {kept}); add --confirm to proceed"
                );
            }
            let keep = !include_suspended;
            let cutoff = now().minus(age);
            let bar = indicatif::ProgressBar::new_spinner().with_message("purging dead letters");
            let done =
                crate::operate::purge_dead_letters_before(keel, ns, cutoff, PURGE_PAGES_MAX, keep)
                    .await;
            bar.finish_and_clear();
            let what = |n: u64| {
                format!("purged {n} dead letter(s) older than {older} in namespace {ns:?}")
            };
            let crate::operate::OldLettersPurged { purged, complete } = done.map_err(|failed| {
                let n = failed.done.purged;
                let json = json!({ "namespace": ns, "purged": n });
                PartlyDone::wrap(failed.error, what(n), json)
            })?;
            let more = if complete { "" } else { "; more remain, run it again" };
            // Counted only after a complete purge: before it, what is left is not only
            // the kept.
            let kept = if keep && complete {
                crate::operate::kept_letters(keel, ns, None, Some(cutoff)).await
            } else {
                None
            };
            let kept_line = crate::operate::kept_line(kept, ns, "dlq retry ID");
            Ok(Report::ok(
                json!({
                    "namespace": ns,
                    "purged": purged,
                    "complete": complete,
                    "include_suspended": include_suspended,
                    "kept_suspended": kept.map(|k| k.count),
                    "kept_at_least": kept.is_some_and(|k| !k.complete),
                }),
                format!("{}{more}.{kept_line}", capitalized(&what(purged))),
            ))
        }
    }
}

/// `keel dlq delete ID`: removes one dead letter of `ns` whose instance is no longer
/// suspended (cancelled, ended, retried through another letter, or gone), so `status` and
/// `health` stop counting it. A letter whose instance is still suspended is refused: it is
/// how that instance is retried, so deleting it would leave the instance suspended with
/// nothing to retry it by.
async fn delete_letter(keel: &Keel, ns: &str, raw: &str) -> anyhow::Result<Report> {
    let letter = letter_in(keel, ns, raw).await?;
    let instance = letter.letter.instance;
    let row =
        keel.store().instance_rows(vec![instance]).await?.into_iter().find(|r| r.id == instance);
    let status = row.as_ref().map(|r| r.status);
    if keel_core::plan::dead_letter::retries_its_instance(status) {
        bail!(
            "id: {} is how the suspended {instance} is retried; retry it (`{}`), or cancel the instance first (`{}`), then delete the letter",
            letter.id,
            hint(ns, &format!("dlq retry {}", letter.id)),
            hint(ns, &format!("cancel {instance}"))
        );
    }
    let removed = keel
        .store()
        .dead_letter_purge(DeadLetterPurgeParams {
            selector: Some(DeadLetterSelector::Id(letter.id)),
            older_than: None,
            // The check above read the instance's status before this write: an instance
            // suspended again since (retried through another letter, failed again) keeps
            // the letter.
            keep_suspended: true,
        })
        .await?;
    let state = status.map_or_else(|| "gone".to_owned(), |s| s.to_string());
    let human = if removed == 0 {
        format!(
            "Nothing deleted: {} was removed meanwhile, or {instance} is suspended again (it is then how {instance} is retried).",
            letter.id
        )
    } else {
        format!("Deleted {} ({instance} is {state}).", letter.id)
    };
    Ok(Report::ok(
        json!({
            "namespace": ns,
            "dead_letter": letter.id,
            "instance": instance,
            "instance_status": status,
            "deleted": removed > 0,
        }),
        human,
    ))
}

/// A `keel` command line to suggest, with `-n ns` when `ns` is not the default namespace
/// (so running it acts on the same namespace; quoted for the shell like every other word).
pub fn hint(ns: &str, args: &str) -> String {
    if ns == keel_core::ids::DEFAULT_NAMESPACE {
        format!("keel {args}")
    } else {
        format!("keel -n {} {args}", shell_word(ns))
    }
}

/// `word` as one shell word: as is when it is plain, else in single quotes.
pub fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_.:/@,+=".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// `text` with its first letter in upper case.
pub fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars.next().map(|first| first.to_uppercase().chain(chars).collect()).unwrap_or_default()
}

/// Dead letters `keel dlq list` shows when no `--limit` is given.
pub const DLQ_LIST_DEFAULT: usize = 100;

/// Most dead letters one `keel dlq list` page (and `GET …/dead-letters`) returns: each
/// carries its event's payload and every attempt's error, so a page stays a page.
pub const DLQ_LIST_MAX: usize = 1_000;

/// The dead letter `raw` names (`dl3` or `3`) when it belongs to namespace `ns`; another
/// namespace's letter is "not found", as a missing one is.
async fn letter_in(
    keel: &Keel,
    ns: &str,
    raw: &str,
) -> anyhow::Result<keel_core::instance::DeadLetter> {
    let id = DeadLetterId(parse_id("id", "dl", raw)?);
    let letter = keel.store().dead_letter_get(id).await?;
    if letter.letter.namespace != ns {
        bail!("id: no dead letter {id} in namespace {ns:?}");
    }
    Ok(letter)
}

/// `keel dlq list` and `GET …/dead-letters`: one page of a namespace's dead letters,
/// oldest first, after the id `after`; `next` is the page's last id when the page is full
/// (pass it as `after` for the next page), `null` on the last page.
pub async fn dead_letter_page(
    keel: &Keel,
    ns: &str,
    machine: Option<String>,
    limit: usize,
    after: Option<&str>,
) -> anyhow::Result<Report> {
    if limit == 0 || limit > DLQ_LIST_MAX {
        bail!(
            "--limit: {limit} is out of range; give 1 to {DLQ_LIST_MAX} and page on with --after (the `next` id)"
        );
    }
    let after = after.map(|raw| parse_id("--after", "dl", raw).map(DeadLetterId)).transpose()?;
    let filter = DeadLetterFilter {
        namespace: Some(ns.to_owned()),
        machine: machine.clone(),
        after,
        before: None,
        limit,
    };
    let letters = keel.dead_letters(filter).await?;
    let next = (letters.len() == limit).then(|| letters.last().map(|d| d.id)).flatten();
    let mut t =
        table(&["id", "instance", "machine", "position", "reason", "attempts", "last error"]);
    for d in &letters {
        t.add_row(vec![
            d.id.to_string(),
            d.letter.instance.to_string(),
            d.letter.machine.to_string(),
            d.letter.position.clone(),
            d.letter.reason.clone(),
            d.letter.attempts.to_string(),
            d.letter.errors.last().map(|e| e.error.clone()).unwrap_or_default(),
        ]);
    }
    let mut human = if letters.is_empty() {
        format!("No dead letters in namespace {ns:?}.")
    } else {
        t.to_string()
    };
    if let Some(next) = next {
        // The same listing, continued: every filter kept.
        let mut args = "dlq list".to_owned();
        if let Some(m) = &machine {
            let _ = write!(args, " --machine {}", shell_word(m));
        }
        if limit != DLQ_LIST_DEFAULT {
            let _ = write!(args, " --limit {limit}");
        }
        let _ = write!(human, "\nMore: {} --after {next}", hint(ns, &args));
    }
    Ok(Report::ok(json!({ "namespace": ns, "dead_letters": letters, "next": next }), human))
}

/// `keel dlq retry --machine M --all`: every dead letter of the machine whose instance is
/// still suspended, with a progress bar sized by the dead letters counted first.
async fn retry_machine(
    keel: &Keel,
    ns: &str,
    machine: &str,
    delay: Option<Duration>,
) -> anyhow::Result<Report> {
    let counted = dead_letter_counts(keel, ns).await?.get(machine).copied().unwrap_or(0);
    let bar = indicatif::ProgressBar::new(counted).with_message("retrying dead letters");
    let (page, pages) = (crate::operate::RETRY_PAGE_MAX, crate::operate::RETRY_PAGES_MAX);
    let done = crate::operate::retry_machine_letters(keel, ns, machine, delay, page, pages, |n| {
        bar.inc(n);
    })
    .await;
    bar.finish_and_clear();
    let what = |n: usize| format!("retried {n} instance(s) of {machine:?} in namespace {ns:?}");
    let done = done.map_err(|failed| {
        let done = failed.done;
        let text = what(done.retried.len());
        let json = json!({ "namespace": ns, "machine": machine, "retried": done.retried, "stale": done.stale });
        PartlyDone::wrap(failed.error, text, json)
    })?;
    let mut human = format!("{}: {}.", capitalized(&what(done.retried.len())), ids(&done.retried));
    if done.stale > 0 {
        let _ = write!(
            human,
            "\nLeft {} dead letter(s) whose instance is no longer suspended (cancelled, moved on or retried through another letter) or was already retried by this run; `{}` lists them, `{}` removes one.",
            done.stale,
            hint(ns, &format!("dlq list --machine {}", shell_word(machine))),
            hint(ns, "dlq delete ID")
        );
    }
    if !done.complete {
        let _ = write!(
            human,
            "\nStopped after reading {pages} pages of dead letters; more remain, run it again."
        );
    }
    let report = Report::ok(
        json!({
            "namespace": ns,
            "machine": machine,
            "retried": done.retried,
            "stale": done.stale,
            "complete": done.complete,
        }),
        human,
    );
    // A machine the namespace holds nothing of (a typo, or one not deployed yet) did
    // nothing, as above: said on stderr and in the JSON, exit 0.
    crate::operate::note_unknown_machine(keel, ns, machine, report).await
}

/// The first [`SHOWN_MAX`] of `list`, then how many more (`i1, i2, … and 180 more`);
/// `--json` carries the whole list.
pub fn ids(list: &[InstanceId]) -> String {
    if list.is_empty() {
        return "none".into();
    }
    let shown: Vec<String> = list.iter().take(SHOWN_MAX).map(ToString::to_string).collect();
    let mut text = shown.join(", ");
    if list.len() > SHOWN_MAX {
        let _ = write!(text, " … and {} more", list.len() - SHOWN_MAX);
    }
    text
}

fn parse_duration(field: &str, input: Option<&str>) -> anyhow::Result<Option<Duration>> {
    input
        .map(|text| duration::parse(text).map_err(|error| anyhow!("--{field}: {error}")))
        .transpose()
}
