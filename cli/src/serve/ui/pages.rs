//! The dashboard's pages and the fragments live updates fetch. Every list is bounded:
//! instances and dead letters come in keyset pages of [`INSTANCE_PAGE`] and
//! [`DEAD_LETTER_PAGE`] (the store's id cursors), and an instance's inbox, timers,
//! children and history are the store's bounded reads cut at [`SECTION_ROWS_MAX`] rows.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;

use axum::Form;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use keel::{DeadLetterFilter, InstanceId, StoreError};
use keel_core::duration;
use keel_core::ids::{DeadLetterId, Status};
use keel_core::instance::DeadLetter;
use keel_core::limits;
use keel_core::ports::Store;
use keel_core::ports::store::{InstanceDetail, InstanceListParams};
use serde::Deserialize;
use serde_json::Value;

use super::html::{badge, esc, json, ns_url, page, query, seg};
use super::{AppState, Viewer, WithStatus, charts, with_cookie};
use crate::commands::{StatusRead, StatusRow, now, status_activity_and_queues};
use crate::health::{self, Level};
use crate::operate::WorkersBound;
use crate::output::{age, time};
use crate::serve::scope::{self, in_namespace};

/// Instances per page.
pub const INSTANCE_PAGE: usize = 50;
/// Dead letters per page.
pub const DEAD_LETTER_PAGE: usize = 50;
/// Most rows of one section of the instance page (inbox, timers, children, history).
pub const SECTION_ROWS_MAX: usize = 500;
/// Most dead letters one "retry selected" touches.
const RETRY_SELECTED_MAX: usize = 500;
/// Most store batches one purge runs.
const ROUNDS_MAX: usize = 100;
/// Most pages (of [`RETRY_PAGE_MAX`](crate::operate::RETRY_PAGE_MAX) dead letters) one
/// "retry all of a machine" reads: 100 000 dead letters.
const RETRY_PAGES: usize = 1_000;

type Page = Result<Response, Response>;

fn flat(result: Page) -> Response {
    result.unwrap_or_else(|e| e)
}

/// The 404 page: what does not exist and what the token may not see look the same.
pub fn not_found(viewer: Option<&Viewer>) -> Response {
    let open = Viewer { grant: None };
    page(
        "Not found",
        None,
        viewer.unwrap_or(&open),
        "<h1>Not found</h1><p>Nothing here, or nothing this token may see.</p>",
    )
    .into_response_with(StatusCode::NOT_FOUND)
}

fn store_failed(viewer: &Viewer, ns: &str, error: &dyn std::fmt::Display) -> Response {
    let body = format!(
        "<h1>The store did not answer</h1><div class=\"error\">{}</div><p>Check that the database is reachable and reload.</p>",
        esc(&format!("{error:#}"))
    );
    page("Store error", Some(ns), viewer, &body).into_response_with(StatusCode::SERVICE_UNAVAILABLE)
}

fn bad_input(viewer: &Viewer, ns: &str, message: &str) -> Response {
    let body = format!("<h1>Bad input</h1><div class=\"error\">{}</div>", esc(message));
    page("Bad input", Some(ns), viewer, &body).into_response_with(StatusCode::BAD_REQUEST)
}

/// The `?done=` code of the action a page was redirected from, and its counts. Every
/// value is text here, so a malformed one means no message rather than a 400.
#[derive(Debug, Default, Deserialize)]
pub struct Flash {
    done: Option<String>,
    n: Option<String>,
    of: Option<String>,
    stale: Option<String>,
    older_ms: Option<String>,
    more: Option<String>,
}

/// What an action did, shown once on the page it redirects to. The redirect names it by
/// a code and counts (`?done=purged&n=3&older_ms=…`) and the page renders the words, so a
/// link made elsewhere can show at most one of these messages with other numbers, never
/// words of its own; an unknown code or a count that is not a number shows nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    QueuePaused,
    QueueResumed,
    /// Dead letters ticked and retried by id, the instances that run again, and the
    /// letters left because their instance was no longer suspended.
    Retried {
        letters: u64,
        instances: u64,
        stale: u64,
    },
    /// A machine's dead letters retried: the instances, the letters left because their
    /// instance moved on, and whether the round bound stopped it.
    RetriedMachine {
        instances: u64,
        stale: u64,
        more: bool,
    },
    /// Dead letters purged, the age they were older than, and whether more remain.
    Purged {
        letters: u64,
        older_ms: u64,
        more: bool,
    },
}

impl Done {
    /// The query string that names this outcome.
    fn query(self) -> String {
        let (code, n, of, stale, older_ms, more) = match self {
            Done::QueuePaused => ("queue-paused", None, None, None, None, false),
            Done::QueueResumed => ("queue-resumed", None, None, None, None, false),
            Done::Retried { letters, instances, stale } => {
                let stale = (stale > 0).then_some(stale);
                ("retried", Some(letters), Some(instances), stale, None, false)
            }
            Done::RetriedMachine { instances, stale, more } => {
                ("retried-machine", None, Some(instances), Some(stale), None, more)
            }
            Done::Purged { letters, older_ms, more } => {
                ("purged", Some(letters), None, None, Some(older_ms), more)
            }
        };
        let text = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
        let (n, of, stale, older_ms) = (text(n), text(of), text(stale), text(older_ms));
        query(&[
            ("done", code),
            ("n", &n),
            ("of", &of),
            ("stale", &stale),
            ("older_ms", &older_ms),
            ("more", if more { "1" } else { "" }),
        ])
    }

    /// The outcome a page's query names, if it names one completely.
    fn parse(f: &Flash) -> Option<Done> {
        let count = |v: &Option<String>| v.as_deref().and_then(|v| v.parse::<u64>().ok());
        let more = f.more.as_deref() == Some("1");
        Some(match f.done.as_deref()? {
            "queue-paused" => Done::QueuePaused,
            "queue-resumed" => Done::QueueResumed,
            "retried" => Done::Retried {
                letters: count(&f.n)?,
                instances: count(&f.of)?,
                stale: if f.stale.is_some() { count(&f.stale)? } else { 0 },
            },
            "retried-machine" => {
                Done::RetriedMachine { instances: count(&f.of)?, stale: count(&f.stale)?, more }
            }
            "purged" => Done::Purged { letters: count(&f.n)?, older_ms: count(&f.older_ms)?, more },
            _ => return None,
        })
    }

    /// The words for this outcome in namespace `ns` (for the commands it suggests).
    fn message(self, ns: &str) -> String {
        // Letters a retry left: what they are and how to remove them.
        let left = |n: u64| match n {
            0 => String::new(),
            n => format!(
                " {n} dead letter(s) left: their instance is no longer suspended; `{}` removes one.",
                crate::commands::hint(ns, "dlq delete ID")
            ),
        };
        match self {
            Done::QueuePaused => "Queue paused.".into(),
            Done::QueueResumed => "Queue resumed.".into(),
            Done::Retried { letters, instances, stale: 0 } => {
                format!("Retried {letters} dead letter(s): {instances} instance(s) run again.")
            }
            Done::Retried { letters, instances, stale } => format!(
                "Retried {} of {letters} dead letter(s): {instances} instance(s) run again.{}",
                letters.saturating_sub(stale),
                left(stale)
            ),
            Done::RetriedMachine { instances, stale, more } => {
                let stale = left(stale);
                let more = if more { " More remain, retry again." } else { "" };
                format!("Retried {instances} instance(s) of the machine.{stale}{more}")
            }
            Done::Purged { letters, older_ms, more } => {
                let age = duration::format(std::time::Duration::from_millis(older_ms));
                let more = if more { "; more remain, purge again" } else { "" };
                format!("Purged {letters} dead letter(s) older than {age}{more}.")
            }
        }
    }
}

/// The message of the outcome `f` names on a page of namespace `ns`; nothing for an
/// unknown or incomplete one.
fn flash(f: &Flash, ns: &str) -> String {
    Done::parse(f)
        .map(|done| format!("<div class=\"flash\">{}</div>", esc(&done.message(ns))))
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Login

/// The login form.
pub fn login_page(error: Option<&str>) -> Html<String> {
    let error = error.map(|e| format!("<div class=\"error\">{}</div>", esc(e))).unwrap_or_default();
    page(
        "Sign in",
        None,
        &Viewer { grant: None },
        &format!(
            "<h1>Sign in</h1>{error}<form method=\"post\" action=\"/ui/login\"><p>Paste a token from the server's tokens file. It is kept in a cookie for this site only.</p><p><input type=\"password\" name=\"token\" size=\"48\" autofocus required> <button>Sign in</button></p></form>"
        ),
    )
}

/// `GET /ui/login`: the form, or the dashboard for a viewer already signed in (or for
/// everyone on a server without tokens).
pub async fn login_form(viewer: Option<Extension<Viewer>>) -> Response {
    match viewer {
        Some(_) => Redirect::to("/ui").into_response(),
        None => login_page(None).into_response(),
    }
}

/// `POST /ui/login`: a valid token sets the cookie.
pub async fn login(
    State(state): State<Arc<AppState>>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let token = form.into_iter().find(|(k, _)| k == "token").map(|(_, v)| v).unwrap_or_default();
    let Some(grants) = &state.tokens else {
        return Redirect::to("/ui").into_response();
    };
    if super::super::auth::find(grants, &token).is_none() {
        return login_page(Some("token: this token is not in the server's tokens file"))
            .into_response_with(StatusCode::UNAUTHORIZED);
    }
    with_cookie(Redirect::to("/ui").into_response(), &token)
}

/// `POST /ui/logout`: forgets the cookie.
pub async fn logout() -> Response {
    let mut response = Redirect::to("/ui/login").into_response();
    if let Ok(value) = axum::http::HeaderValue::from_str(&format!(
        "{}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0",
        super::COOKIE
    )) {
        response.headers_mut().append(axum::http::header::SET_COOKIE, value);
    }
    response
}

// ---------------------------------------------------------------------------------------
// Overview

/// `GET /ui/ns/{ns}/`.
pub async fn overview(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
    Query(flash_msg): Query<Flash>,
) -> Response {
    flat(async {
        let inner = overview_html(&state, &ns, &viewer).await?;
        let body = format!(
            "<h1>Namespace {}</h1>{}<div data-live=\"{}\">{inner}</div><p id=\"live-status\" class=\"live-status\"></p>",
            esc(&ns),
            flash(&flash_msg, &ns),
            esc(&ns_url(&ns, "/fragments/overview")),
        );
        Ok(page("Overview", Some(&ns), &viewer, &body).into_response())
    }
    .await)
}

/// `GET /ui/ns/{ns}/fragments/overview`: the overview's live part.
pub async fn overview_fragment(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    flat(overview_html(&state, &ns, &viewer).await.map(|h| Html(h).into_response()))
}

/// The overview's panels, in order. A new panel (per-minute completions, workers seen)
/// is one more function pushed here.
async fn overview_html(state: &AppState, ns: &str, viewer: &Viewer) -> Result<String, Response> {
    let at = now();
    let store = state.keel.store();
    // The panels' reads are independent: the queue counts and the queue list (read once
    // for the totals, the queues, the paused ones and the last hour), the timers and the
    // worker registry go out together.
    let since = at.minus(std::time::Duration::from_secs(86_400));
    let (counts, timers, seen) = tokio::join!(
        // The queue list names the paused queues with nothing unfinished in them too, so
        // such a queue is still shown, with its Resume.
        status_activity_and_queues(&state.keel, ns, None, at),
        store.timer_status(Some(ns.to_owned()), at),
        // Workers seen in the last day, live ones first; those that claim from this namespace.
        store.worker_list(since),
    );
    let counts = counts.map_err(|e| read_failed(viewer, ns, &e))?;
    let timers = timers.map_err(|e| store_or_input(viewer, ns, &e))?;
    let seen = seen.map_err(|e| store_or_input(viewer, ns, &e))?;
    let idle = counts.idle_paused();
    let StatusRead { rows, activity, .. } = counts;
    let bound = WorkersBound::of(&seen, at.minus(keel_core::ports::store::WORKER_STALE_AFTER));
    let workers: Vec<_> = seen.into_iter().filter(|w| w.claims_from(ns)).collect();
    let mut out = String::new();
    out.push_str(&totals_panel(&rows, &idle));
    out.push_str(&health_panel(state, &rows, &activity));
    out.push_str(&activity_panel(&activity));
    out.push_str(&workers_panel(&workers, at, bound));
    out.push_str(&queues_panel(ns, &rows, &idle, viewer));
    if !timers.is_empty() {
        out.push_str("<h2>Timers</h2><table><tr><th>machine</th><th class=\"num\">armed</th><th class=\"num\">overdue</th><th>next due</th><th>last sweep</th></tr>");
        for t in &timers {
            let _ = write!(
                out,
                "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
                esc(&t.machine),
                t.armed,
                t.overdue,
                t.next_due.map(|at| time(at.0)).unwrap_or_default(),
                t.last_sweep_at.map_or_else(|| "never".into(), |at| time(at.0)),
            );
        }
        out.push_str("</table>");
    }
    Ok(out)
}

/// The cards; `idle` are the paused queues with no row, counted with the rows' ones.
fn totals_panel(rows: &[StatusRow], idle: &[String]) -> String {
    let sum = |f: fn(&StatusRow) -> u64| rows.iter().map(f).sum::<u64>();
    let oldest = rows.iter().filter_map(|r| r.oldest_ready_age_ms).max();
    let paused: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r.paused)
        .map(|r| r.queue.as_str())
        .chain(idle.iter().map(String::as_str))
        .collect();
    let card = |k: &str, v: String| {
        format!("<div class=\"card\"><div class=\"k\">{k}</div><div class=\"v\">{v}</div></div>")
    };
    [
        card("pending", sum(|r| r.ready + r.scheduled).to_string()),
        card("running", sum(|r| r.executing).to_string()),
        card("waiting", sum(|r| r.waiting).to_string()),
        card("suspended", sum(|r| r.suspended).to_string()),
        card("dead letters", sum(|r| r.dead_letters).to_string()),
        card("oldest ready", oldest.map_or_else(|| "—".into(), age)),
        card("paused queues", paused.len().to_string()),
    ]
    .into_iter()
    .fold(String::from("<div class=\"cards\">"), |acc, c| acc + &c)
        + "</div>"
}

/// Completed and failed per minute over the last hour, per machine, as sparklines, with
/// the hour's totals, mean turnaround and ready work no live worker serves.
fn activity_panel(activity: &[crate::operate::MachineActivity]) -> String {
    let mut out = String::from("<h2>Last hour</h2>");
    if activity.is_empty() {
        out.push_str("<p class=\"muted\">Nothing finished or waiting in the last hour.</p>");
        return out;
    }
    out.push_str("<table id=\"activity\"><tr><th>machine</th><th>completed / min</th><th class=\"num\">completed</th><th>failed / min</th><th class=\"num\">failed</th><th class=\"num\" title=\"mean time from start to end, waits included\">avg turnaround</th><th class=\"num\">ready, no worker</th></tr>");
    for a in activity {
        let avg = a.avg_processing_ms.map_or_else(|| "—".into(), |ms| age(ms as i64));
        let _ = write!(
            out,
            "<tr data-machine=\"{m}\"><td>{m}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{avg}</td><td class=\"num\">{}</td></tr>",
            sparkline(&a.completed_per_minute, "completed"),
            a.completed_last_hour,
            sparkline(&a.failed_per_minute, "failed"),
            a.failed_last_hour,
            a.ready_without_worker_counted().text(),
            m = esc(&a.machine),
        );
    }
    out.push_str("</table>");
    out
}

/// A small inline SVG line of `points` (oldest first), scaled to its own maximum.
fn sparkline(points: &[u64], class: &str) -> String {
    const W: f64 = 120.0;
    const H: f64 = 24.0;
    let max = points.iter().copied().max().unwrap_or(0).max(1) as f64;
    let step = if points.len() > 1 { W / (points.len() - 1) as f64 } else { 0.0 };
    let coords: Vec<String> = points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!("{:.1},{:.1}", i as f64 * step, H - (*p as f64 / max) * (H - 2.0) - 1.0)
        })
        .collect();
    let total: u64 = points.iter().sum();
    format!(
        "<svg class=\"spark {class}\" width=\"120\" height=\"24\" viewBox=\"0 0 120 24\" role=\"img\" aria-label=\"{total} {class} in the last hour\"><polyline fill=\"none\" points=\"{}\"/></svg>",
        coords.join(" ")
    )
}

/// Workers seen by heartbeat that claim from this namespace: live ones, then stale ones.
fn workers_panel(
    workers: &[keel_core::ports::store::WorkerRecord],
    now: keel_core::Timestamp,
    bound: WorkersBound,
) -> String {
    let max = keel_core::ports::store::WORKER_LIST_MAX;
    let stale_before = now.minus(keel_core::ports::store::WORKER_STALE_AFTER);
    let live = workers.iter().filter(|w| w.last_seen_at >= stale_before).count();
    let stale = workers.len() - live;
    let note = if bound.at_least {
        format!("<p class=\"muted\" id=\"workers-bound\">{}</p>", WorkersBound::note())
    } else {
        String::new()
    };
    let counts = bound.counts(live, stale, "stale");
    let mut out = format!("<h2>Workers</h2><p id=\"workers-seen\">{counts}</p>");
    if workers.is_empty() {
        if bound.at_least {
            let _ = write!(
                out,
                "<p class=\"muted\">No worker claiming from this namespace is among the {max} most recently seen workers.</p>{note}"
            );
        } else {
            out.push_str("<p class=\"muted\">No worker has reported in the last day.</p>");
        }
        return out;
    }
    out.push_str(
        "<table><tr><th>worker</th><th>state</th><th>last seen</th><th>machines</th></tr>",
    );
    let mut sorted: Vec<_> = workers.iter().collect();
    sorted.sort_by_key(|w| (w.last_seen_at < stale_before, w.name.clone()));
    for w in sorted {
        let state = if w.last_seen_at >= stale_before { "live" } else { "stale" };
        let machines: Vec<String> =
            w.machines.iter().map(|m| format!("{} v{}", m.name, m.version)).collect();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&w.name),
            badge(state),
            time(w.last_seen_at.0),
            esc(&machines.join(", ")),
        );
    }
    out.push_str("</table>");
    out + &note
}

fn health_panel(
    state: &AppState,
    rows: &[StatusRow],
    activity: &[crate::operate::MachineActivity],
) -> String {
    findings_panel(health::evaluate(&state.config, rows, activity))
}

/// The health panel for the findings (or the error that stopped their evaluation); a
/// value counted over a bounded walk that stopped early reads "at least".
fn findings_panel(findings: anyhow::Result<Vec<health::Finding>>) -> String {
    match findings {
        Ok(findings) => {
            let level = findings.iter().map(|f| f.level).max().unwrap_or(Level::Healthy);
            let name = serde_json::to_value(level).ok();
            let name = name.as_ref().and_then(Value::as_str).unwrap_or("unknown");
            let mut out = format!("<h2>Health {}</h2>", badge(name));
            if findings.is_empty() {
                out.push_str("<p class=\"muted\">Every configured threshold holds.</p>");
            } else {
                out.push_str("<table><tr><th>level</th><th>machine</th><th>check</th><th class=\"num\">value</th><th class=\"num\">threshold</th></tr>");
                for f in findings {
                    let v = serde_json::to_value(&f).unwrap_or_default();
                    let text = |k: &str| match &v[k] {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    let _ = write!(
                        out,
                        "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                        badge(&text("level")),
                        esc(&text("machine")),
                        esc(&text("check")),
                        esc(&f.value().text()),
                        esc(&text("threshold")),
                    );
                }
                out.push_str("</table>");
            }
            out
        }
        Err(error) => format!(
            "<h2>Health {}</h2><div class=\"error\">{}</div>",
            badge("critical"),
            esc(&format!("{error:#}"))
        ),
    }
}

/// The Pause or Resume button of `queue` for a viewer who operates; nothing otherwise
/// (and nothing for the queue-less row of a machine's dead letters).
fn queue_action(ns: &str, queue: &str, paused: bool, viewer: &Viewer) -> String {
    if !viewer.operates() || queue.is_empty() {
        return String::new();
    }
    let (path, label) = if paused { ("resume", "Resume") } else { ("pause", "Pause") };
    format!(
        "<form class=\"inline\" method=\"post\" action=\"{}\"><button data-queue=\"{}\">{label}</button></form>",
        esc(&ns_url(ns, &format!("/queues/{}/{path}", seg(queue)))),
        esc(queue)
    )
}

/// A row per queue and machine with unfinished work or dead letters, then a row per
/// paused queue with nothing unfinished (`idle`, at most [`SECTION_ROWS_MAX`] of them).
fn queues_panel(ns: &str, rows: &[StatusRow], idle: &[String], viewer: &Viewer) -> String {
    if rows.is_empty() && idle.is_empty() {
        return "<h2>Queues and machines</h2><p class=\"muted\">No unfinished instances and no dead letters in this namespace.</p>".into();
    }
    let mut out = String::from(
        "<h2>Queues and machines</h2><table id=\"queues\"><tr><th>queue</th><th>machine</th><th class=\"num\">ready</th><th class=\"num\">scheduled</th><th class=\"num\">running</th><th class=\"num\">waiting</th><th class=\"num\">suspended</th><th class=\"num\">dead letters</th><th>oldest ready</th><th>state</th><th></th></tr>",
    );
    for r in rows {
        let action = queue_action(ns, &r.queue, r.paused, viewer);
        let machine_link = ns_url(ns, &format!("/instances{}", query(&[("machine", &r.machine)])));
        let _ = write!(
            out,
            "<tr data-queue=\"{q}\" data-machine=\"{m}\"><td>{q}</td><td><a href=\"{link}\">{m}</a></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{action}</td></tr>",
            r.ready,
            r.scheduled,
            r.executing,
            r.waiting,
            r.suspended,
            r.dead_letters,
            r.oldest_ready_age_ms.map(age).unwrap_or_default(),
            if r.paused { badge("paused") } else { String::new() },
            q = esc(&r.queue),
            m = esc(&r.machine),
            link = esc(&machine_link),
        );
    }
    for q in idle.iter().take(SECTION_ROWS_MAX) {
        let _ = write!(
            out,
            "<tr data-queue=\"{q}\" data-machine=\"\" class=\"idle\"><td>{q}</td><td class=\"muted\">nothing unfinished</td><td class=\"num\">0</td><td class=\"num\">0</td><td class=\"num\">0</td><td class=\"num\">0</td><td class=\"num\">0</td><td class=\"num\"></td><td></td><td>{}</td><td>{}</td></tr>",
            badge("paused"),
            queue_action(ns, q, true, viewer),
            q = esc(q),
        );
    }
    out.push_str("</table>");
    if idle.len() > SECTION_ROWS_MAX {
        let _ = write!(
            out,
            "<p class=\"muted\">{} more paused queue(s) with nothing unfinished not shown.</p>",
            idle.len() - SECTION_ROWS_MAX
        );
    }
    out
}

async fn set_paused(
    state: &AppState,
    ns: &str,
    queue: &str,
    paused: bool,
    viewer: &Viewer,
) -> Response {
    // A resume of a queue that is not paused writes nothing (see `commands::set_paused`).
    match crate::commands::set_paused(&state.keel, ns, queue, paused).await {
        Ok(_) => {
            let done = if paused { Done::QueuePaused } else { Done::QueueResumed };
            Redirect::to(&format!("{}{}", ns_url(ns, ""), done.query())).into_response()
        }
        Err(e) => store_or_input(viewer, ns, &e),
    }
}

fn store_or_input(viewer: &Viewer, ns: &str, e: &StoreError) -> Response {
    if e.kind == keel::ErrorKind::Invalid {
        bad_input(viewer, ns, &e.message)
    } else {
        store_failed(viewer, ns, e)
    }
}

/// [`store_or_input`] for a read that wraps the store's errors: a refused input (a
/// namespace the store will not take, say) is the 400 page, anything else the 503 page.
fn read_failed(viewer: &Viewer, ns: &str, e: &anyhow::Error) -> Response {
    match e.downcast_ref::<StoreError>() {
        Some(store) if store.kind == keel::ErrorKind::Invalid => {
            bad_input(viewer, ns, &format!("{e:#}"))
        }
        _ => store_failed(viewer, ns, &format!("{e:#}")),
    }
}

/// `POST /ui/ns/{ns}/queues/{queue}/pause`.
pub async fn pause(
    State(state): State<Arc<AppState>>,
    Path((ns, queue)): Path<(String, String)>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    set_paused(&state, &ns, &queue, true, &viewer).await
}

/// `POST /ui/ns/{ns}/queues/{queue}/resume`.
pub async fn resume(
    State(state): State<Arc<AppState>>,
    Path((ns, queue)): Path<(String, String)>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    set_paused(&state, &ns, &queue, false, &viewer).await
}

// ---------------------------------------------------------------------------------------
// Instances

/// The instance list's filters.
#[derive(Debug, Default, Deserialize)]
pub struct InstanceFilters {
    #[serde(default)]
    machine: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    before: String,
}

fn some(text: &str) -> Option<String> {
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// `GET /ui/ns/{ns}/instances`.
pub async fn instances(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
    Query(f): Query<InstanceFilters>,
) -> Response {
    let status = match some(&f.status).map(|s| s.parse::<Status>()) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(_)) => {
            let names: Vec<&str> = Status::ALL.iter().map(|s| s.name()).collect();
            return bad_input(
                &viewer,
                &ns,
                &format!("status: {:?} is not a status; use one of {}", f.status, names.join(", ")),
            );
        }
    };
    let before = match some(&f.before).map(|b| b.trim_start_matches('i').parse::<i64>()) {
        None => None,
        Some(Ok(n)) if n > 0 => Some(InstanceId(n)),
        Some(_) => {
            return bad_input(&viewer, &ns, "before: not an instance id; follow the page links");
        }
    };
    let params = InstanceListParams {
        namespace: ns.clone(),
        machine: some(&f.machine),
        status,
        state: some(&f.state),
        business_key: some(&f.key),
        before,
        limit: INSTANCE_PAGE,
    };
    let rows = match state.keel.store().instance_list(params).await {
        Ok(rows) => rows,
        Err(e) => return store_or_input(&viewer, &ns, &e),
    };
    let options: String = std::iter::once(String::from("<option value=\"\">any</option>"))
        .chain(Status::ALL.iter().map(|s| {
            let selected = if f.status == s.name() { " selected" } else { "" };
            format!("<option{selected}>{}</option>", s.name())
        }))
        .collect();
    let mut body = format!(
        "<h1>Instances</h1><form class=\"filters\" method=\"get\" action=\"{}\"><label>machine<input name=\"machine\" value=\"{}\"></label><label>status<select name=\"status\">{options}</select></label><label>state<input name=\"state\" value=\"{}\" placeholder=\"step or state path\"></label><label>business key<input name=\"key\" id=\"filter-key\" value=\"{}\"></label><button id=\"filter-apply\">Filter</button> <a href=\"{}\">clear</a></form>",
        esc(&ns_url(&ns, "/instances")),
        esc(&f.machine),
        esc(&f.state),
        esc(&f.key),
        esc(&ns_url(&ns, "/instances")),
    );
    if rows.is_empty() {
        body.push_str("<p class=\"muted\" id=\"no-instances\">No instance matches.</p>");
    } else {
        body.push_str("<table id=\"instances\"><tr><th>id</th><th>business key</th><th>machine</th><th>status</th><th>state</th><th>queue</th><th class=\"num\">attempt</th></tr>");
        for i in &rows {
            let _ = write!(
                body,
                "<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td>{} v{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td class=\"num\">{}</td></tr>",
                esc(&ns_url(&ns, &format!("/instances/{}", i.id.0))),
                i.id,
                esc(i.business_key.as_deref().unwrap_or("")),
                esc(&i.machine.name),
                i.machine.version,
                badge(i.status.name()),
                esc(&short(&i.position, 80)),
                esc(&i.queue),
                i.attempt,
            );
        }
        body.push_str("</table>");
    }
    let mut pager = String::from("<div class=\"pager\">");
    if before.is_some() {
        let first = query(&[
            ("machine", &f.machine),
            ("status", &f.status),
            ("state", &f.state),
            ("key", &f.key),
        ]);
        let _ = write!(
            pager,
            "<a href=\"{}{}\">« newest</a>",
            esc(&ns_url(&ns, "/instances")),
            esc(&first)
        );
    }
    if rows.len() == INSTANCE_PAGE {
        let last = rows.last().map(|r| r.id.0.to_string()).unwrap_or_default();
        let next = query(&[
            ("machine", &f.machine),
            ("status", &f.status),
            ("state", &f.state),
            ("key", &f.key),
            ("before", &last),
        ]);
        let _ = write!(
            pager,
            "<a id=\"next-page\" href=\"{}{}\">older »</a>",
            esc(&ns_url(&ns, "/instances")),
            esc(&next)
        );
    }
    pager.push_str("</div>");
    body.push_str(&pager);
    page("Instances", Some(&ns), &viewer, &body).into_response()
}

fn short(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        text.chars().take(max).collect::<String>() + "…"
    }
}

async fn detail_in(
    state: &AppState,
    ns: &str,
    raw: &str,
    viewer: &Viewer,
) -> Result<Shown, Response> {
    let id =
        raw.trim_start_matches('i').parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
            bad_input(
                viewer,
                ns,
                &format!("id: {raw:?} is not an instance id; write a positive number such as 42"),
            )
        })?;
    let mut detail = match in_namespace(state.keel.get(InstanceId(id)).await, ns) {
        Ok(Some(detail)) => detail,
        Ok(None) => return Err(not_found(Some(viewer))),
        Err(e) => return Err(store_failed(viewer, ns, &e)),
    };
    // The namespaces of its children and its parent, read by id: each is linked under its
    // own namespace. Children the API would leave out (in namespaces the viewer does not
    // see, or gone by now) are left out here too, and counted.
    let mut ids: Vec<InstanceId> = detail.children.iter().map(|c| c.id).collect();
    ids.extend(detail.instance.parent);
    let mut homes = scope::namespaces_of(state.keel.store(), &ids)
        .await
        .map_err(|e| store_failed(viewer, ns, &e))?;
    let hidden = scope::hide_children(&mut detail, &homes, |home| viewer.sees(home));
    homes.retain(|_, home| viewer.sees(home));
    Ok(Shown { detail, children_hidden: hidden, homes })
}

/// An instance's detail as the viewer may see it.
struct Shown {
    detail: InstanceDetail,
    /// Its children left out because the viewer does not see their namespace.
    children_hidden: usize,
    /// The namespace of its parent and of each child shown, when the viewer sees it.
    homes: BTreeMap<InstanceId, String>,
}

/// `GET /ui/ns/{ns}/instances/{id}`.
pub async fn instance(
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    flat(async {
        let shown = detail_in(&state, &ns, &id, &viewer).await?;
        let i = &shown.detail.instance;
        let live = instance_live(&state, &ns, &shown);
        let body = format!(
            "<h1>{} <small class=\"muted\">{} v{}{}</small></h1><div data-live=\"{}\">{live}</div><p id=\"live-status\" class=\"live-status\"></p>",
            i.id,
            esc(&i.machine.name),
            i.machine.version,
            i.business_key.as_deref().map(|k| format!(" · key {}", esc(k))).unwrap_or_default(),
            esc(&ns_url(&ns, &format!("/instances/{}/fragment", i.id.0))),
        );
        Ok(page(&format!("Instance {}", i.id), Some(&ns), &viewer, &body).into_response())
    }
    .await)
}

/// `GET /ui/ns/{ns}/instances/{id}/fragment`: the instance page's live part.
pub async fn instance_fragment(
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    flat(
        async {
            let shown = detail_in(&state, &ns, &id, &viewer).await?;
            Ok(Html(instance_live(&state, &ns, &shown)).into_response())
        }
        .await,
    )
}

fn instance_live(state: &AppState, ns: &str, shown: &Shown) -> String {
    let d = &shown.detail;
    let i = &d.instance;
    let mut out = String::new();
    let _ = write!(
        out,
        "<p>{} in queue <b>{}</b> · revision {} · attempt {}{}{}</p>",
        badge(i.status.name()),
        esc(&i.queue),
        i.revision.0,
        i.attempt,
        i.last_error
            .as_deref()
            .map(|e| format!(" · last error: <code>{}</code>", esc(e)))
            .unwrap_or_default(),
        // A parent the viewer may not see (or that is gone) is named without a link.
        i.parent
            .map(|p| match shown.homes.get(&p) {
                Some(home) => format!(
                    " · parent <a href=\"{}\">{p}</a>",
                    esc(&ns_url(home, &format!("/instances/{}", p.0)))
                ),
                None => format!(" · parent {p}"),
            })
            .unwrap_or_default(),
    );
    out.push_str("<div class=\"grid2\"><div>");
    let chart = state.definitions.as_ref().and_then(|defs| {
        u32::try_from(i.machine.version).ok().and_then(|v| defs.get(&i.machine.name, v))
    });
    match chart {
        Some(def) => {
            let _ = write!(
                out,
                "<h2>Chart</h2><div class=\"diagram\" id=\"chart\">{}</div>",
                charts::svg(def, &i.position)
            );
        }
        None => out.push_str(&position_panel(d)),
    }
    out.push_str(&values_panel(i));
    out.push_str("</div><div>");
    out.push_str(&inbox_panel(d));
    out.push_str(&timers_panel(d));
    out.push_str(&children_panel(ns, d, shown.children_hidden, &shown.homes));
    out.push_str("</div></div>");
    out.push_str(&history_panel(d));
    out
}

/// The instance's context and its result, each cut at [`PRE_BYTES_MAX`].
fn values_panel(i: &keel_core::instance::Instance) -> String {
    let (context, note) = json_cut(&i.context, &i.namespace, i.id);
    let mut out = format!("<h2>Context</h2><pre id=\"context\">{context}</pre>{note}");
    if let Some(result) = &i.result {
        let (result, note) = json_cut(result, &i.namespace, i.id);
        let _ = write!(out, "<h2>Result</h2><pre>{result}</pre>{note}");
    }
    out
}

/// Without a loaded chart: a chart's active paths, or a step machine's steps as its
/// history shows them with the current one marked.
fn position_panel(d: &InstanceDetail) -> String {
    let i = &d.instance;
    if let Ok(paths) = serde_json::from_str::<Vec<String>>(&i.position) {
        let items: String = paths.iter().fold(String::new(), |mut out, p| {
            let _ = write!(out, "<li><code>{}</code></li>", esc(p));
            out
        });
        return format!(
            "<h2>Active states</h2><ul id=\"active-states\">{items}</ul><p class=\"muted\">Start <code>keel serve --definitions PATH</code> with this chart's JSON definition to see it drawn.</p>"
        );
    }
    let mut steps: Vec<String> = Vec::new();
    for h in &d.history {
        for key in ["from", "to", "step"] {
            if let Some(s) = h.entry.data.get(key).and_then(Value::as_str)
                && !steps.iter().any(|x| x == s)
            {
                steps.push(s.to_owned());
            }
        }
    }
    if !steps.contains(&i.position) {
        steps.push(i.position.clone());
    }
    let items = steps.iter().take(SECTION_ROWS_MAX).fold(String::new(), |mut out, s| {
        let class = if *s == i.position { " class=\"current\"" } else { "" };
        let _ = write!(out, "<li{class}><code>{}</code></li>", esc(s));
        out
    });
    format!(
        "<h2>Steps</h2><ol class=\"steps\" id=\"steps\">{items}</ol><p class=\"muted\">The steps this instance has been through, as its history records them.</p>"
    )
}

/// The note under a section of `total` rows read from the store; `cut` when the store
/// returned as many as its bound lets it, so the list may go on: what is past the shown
/// rows is then a lower bound ("at least"), never a count.
fn more(total: usize, cut: bool) -> String {
    let hidden = total.saturating_sub(SECTION_ROWS_MAX);
    match (hidden, cut) {
        (0, false) => String::new(),
        (0, true) => "<p class=\"muted\">More may exist beyond these.</p>".into(),
        (n, true) => format!("<p class=\"muted\">At least {n} more not shown.</p>"),
        (n, false) => format!("<p class=\"muted\">{n} more not shown.</p>"),
    }
}

/// Most bytes of one JSON value (context, result, a payload, a history entry's data)
/// the instance page prints; live updates fetch the page again every few seconds.
pub const PRE_BYTES_MAX: usize = 8 * 1024;

/// `value` as pretty JSON, escaped, cut at [`PRE_BYTES_MAX`] bytes (on a character
/// boundary), and the note for after its `<pre>`: how many bytes were left out and where
/// instance `id` of namespace `ns` is read in full. Nothing is left out: no note.
fn json_cut(value: &Value, ns: &str, id: InstanceId) -> (String, String) {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    if text.len() <= PRE_BYTES_MAX {
        return (esc(&text), String::new());
    }
    let mut end = PRE_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let command = crate::commands::hint(ns, &format!("inspect {id} --json"));
    let note = format!(
        "<p class=\"muted cut\">{} more bytes not shown: <code>{}</code> or <code>GET /v1/namespaces/{}/instances/{}</code> returns all of it.</p>",
        text.len() - end,
        esc(&command),
        esc(&seg(ns)),
        id.0,
    );
    (esc(&text[..end]) + "…", note)
}

fn inbox_panel(d: &InstanceDetail) -> String {
    if d.inbox.is_empty() {
        return "<h2>Inbox</h2><p class=\"muted\">Empty.</p>".into();
    }
    let mut out = String::from(
        "<h2>Inbox</h2><table id=\"inbox\"><tr><th>signal</th><th>event</th><th>received</th></tr>",
    );
    for s in d.inbox.iter().take(SECTION_ROWS_MAX) {
        let (payload, note) = json_cut(&s.payload, &d.instance.namespace, d.instance.id);
        let _ = write!(
            out,
            "<tr><td>{}</td><td><details data-key=\"s{}\"><summary>{}</summary><pre>{payload}</pre>{note}</details></td><td>{}</td></tr>",
            s.id,
            s.id,
            esc(&s.name),
            time(s.inserted_at.0)
        );
    }
    out + "</table>" + &more(d.inbox.len(), d.inbox.len() >= limits::INBOX_LIST_MAX)
}

fn timers_panel(d: &InstanceDetail) -> String {
    if d.timers.is_empty() {
        return "<h2>Timers</h2><p class=\"muted\">None armed.</p>".into();
    }
    let mut out = String::from(
        "<h2>Timers</h2><table id=\"timers\"><tr><th>timer</th><th>due</th><th class=\"num\">fired</th><th>spec</th></tr>",
    );
    for t in d.timers.iter().take(SECTION_ROWS_MAX) {
        let spec = serde_json::to_value(&t.spec).unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td><code>{}</code></td></tr>",
            t.id,
            time(t.next_fire_at.0),
            t.fire_count,
            esc(&short(&spec.to_string(), 120))
        );
    }
    out + "</table>" + &more(d.timers.len(), d.timers.len() >= limits::TIMER_LIST_MAX)
}

/// `homes` names each child's namespace (a child missing from it is linked under `ns`).
fn children_panel(
    ns: &str,
    d: &InstanceDetail,
    hidden_count: usize,
    homes: &BTreeMap<InstanceId, String>,
) -> String {
    let hidden = match hidden_count {
        0 => String::new(),
        n => format!(
            "<p class=\"muted\" id=\"children-hidden\">{n} child(ren) in namespaces this token does not see are not shown.</p>"
        ),
    };
    if d.children.is_empty() {
        let none = if hidden.is_empty() { "<p class=\"muted\">None.</p>" } else { "" };
        return format!("<h2>Children</h2>{none}{hidden}");
    }
    let mut out = String::from(
        "<h2>Children</h2><table id=\"children\"><tr><th>child</th><th>machine</th><th>status</th><th>state</th></tr>",
    );
    for c in d.children.iter().take(SECTION_ROWS_MAX) {
        let _ = write!(
            out,
            "<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
            esc(&ns_url(
                homes.get(&c.id).map_or(ns, String::as_str),
                &format!("/instances/{}", c.id.0)
            )),
            c.id,
            esc(&c.machine.to_string()),
            badge(c.status.name()),
            esc(&short(&c.position, 80)),
        );
    }
    // The store's bound counts the children read, those left out here included.
    let cut = d.children.len() + hidden_count >= limits::CHILDREN_LIST_MAX;
    out + "</table>" + &more(d.children.len(), cut) + &hidden
}

fn history_panel(d: &InstanceDetail) -> String {
    if d.history.is_empty() {
        return "<h2>History</h2><p class=\"muted\">No step has run yet.</p>".into();
    }
    let mut out = String::from("<h2>History</h2><ol class=\"timeline\" id=\"history\">");
    let skip = d.history.len().saturating_sub(SECTION_ROWS_MAX);
    for h in d.history.iter().skip(skip) {
        let (data, note) = json_cut(&h.entry.data, &d.instance.namespace, d.instance.id);
        let _ = write!(
            out,
            "<li><details data-key=\"h{}\"><summary><time>{}</time> <span class=\"kind\">{}</span> <span class=\"muted\">rev {} · attempt {}</span></summary><pre>{data}</pre>{note}</details></li>",
            h.seq,
            time(h.at.0),
            esc(&h.entry.kind),
            h.revision.0,
            h.attempt,
        );
    }
    out.push_str("</ol>");
    // The detail holds the newest entries only; older ones are a page read away.
    let oldest_shown = d.history.get(skip).map(|h| h.seq);
    if let Some(before) =
        oldest_shown.filter(|_| skip > 0 || d.history.len() >= limits::HISTORY_LIST_MAX)
    {
        let id = d.instance.id;
        let ns = &d.instance.namespace;
        let command = crate::commands::hint(ns, &format!("history {id} --before {before}"));
        let _ = write!(
            out,
            "<p class=\"muted\">Older entries are not shown: <code>{}</code> or <code>GET /v1/namespaces/{}/instances/{}/history?before={before}</code>.</p>",
            esc(&command),
            esc(&seg(ns)),
            id.0,
        );
    }
    out
}

// ---------------------------------------------------------------------------------------
// Dead letters

/// The dead-letter list's filters and cursor.
#[derive(Debug, Default, Deserialize)]
pub struct LetterFilters {
    #[serde(default)]
    machine: String,
    /// The page after this id (the "next" link).
    #[serde(default)]
    after: String,
    /// The page before this id (the "previous" link).
    #[serde(default)]
    before: String,
    #[serde(flatten)]
    flash: Flash,
}

/// One page of a namespace's dead letters by the store's id cursor, oldest first, and
/// whether there are letters before and after it.
struct LetterPage {
    letters: Vec<DeadLetter>,
    earlier: bool,
    later: bool,
}

async fn letter_page(
    state: &AppState,
    ns: &str,
    machine: Option<String>,
    after: Option<DeadLetterId>,
    before: Option<DeadLetterId>,
) -> Result<LetterPage, StoreError> {
    // One letter more than a page tells whether another page lies beyond it.
    let filter = DeadLetterFilter {
        namespace: Some(ns.to_owned()),
        machine,
        after,
        before,
        limit: DEAD_LETTER_PAGE + 1,
    };
    let mut letters = state.keel.dead_letters(filter.clone()).await?;
    let beyond = letters.len() > DEAD_LETTER_PAGE;
    if before.is_none() {
        letters.truncate(DEAD_LETTER_PAGE);
        return Ok(LetterPage { letters, earlier: after.is_some(), later: beyond });
    }
    if !beyond {
        // Going back reached the oldest letters: show the first page in full rather than
        // a short page that only ends where the previous one started.
        let first = DeadLetterFilter { before: None, ..filter };
        let mut letters = state.keel.dead_letters(first).await?;
        let later = letters.len() > DEAD_LETTER_PAGE;
        letters.truncate(DEAD_LETTER_PAGE);
        return Ok(LetterPage { letters, earlier: false, later });
    }
    letters.remove(0);
    Ok(LetterPage { letters, earlier: true, later: true })
}

/// `GET /ui/ns/{ns}/dead-letters?machine=&after=|before=`: a page of
/// [`DEAD_LETTER_PAGE`] dead letters, oldest first, with previous / next links that
/// carry the store's id cursor, so a page deep in a long queue costs what the first does.
pub async fn dead_letters(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
    Query(f): Query<LetterFilters>,
) -> Response {
    // A cursor is an id from a page link; anything else names its field.
    let cursor = |field: &'static str, raw: &str| match some(raw) {
        None => Ok(None),
        Some(text) => letter_id(&text).map(Some).ok_or(field),
    };
    let (after, before) = match (cursor("after", &f.after), cursor("before", &f.before)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(field), _) | (_, Err(field)) => {
            let message = format!("{field}: not a dead letter id; follow the page links");
            return bad_input(&viewer, &ns, &message);
        }
    };
    let shown = match letter_page(&state, &ns, some(&f.machine), after, before).await {
        Ok(p) => p,
        Err(e) => return store_or_input(&viewer, &ns, &e),
    };
    let mut body = format!(
        "<h1>Dead letters</h1>{}<form class=\"filters\" method=\"get\" action=\"{}\"><label>machine<input name=\"machine\" value=\"{}\"></label><button>Filter</button></form>",
        flash(&f.flash, &ns),
        esc(&ns_url(&ns, "/dead-letters")),
        esc(&f.machine),
    );
    if shown.letters.is_empty() {
        body.push_str("<p class=\"muted\" id=\"no-dead-letters\">No dead letters.</p>");
        body.push_str(&letter_pager(&ns, &f.machine, &shown));
    } else {
        let operate = viewer.operates();
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}\" id=\"selected\"><table id=\"dead-letters\"><tr><th></th><th>id</th><th>instance</th><th>machine</th><th>at</th><th>reason</th><th class=\"num\">attempts</th><th>last error</th><th>recorded</th><th></th></tr>",
            esc(&ns_url(&ns, "/dead-letters/retry"))
        );
        let mut machines = BTreeMap::new();
        for d in &shown.letters {
            *machines.entry(d.letter.machine.name.clone()).or_insert(0usize) += 1;
            let retry = if operate {
                format!(
                    "<button class=\"retry-one\" data-id=\"{}\" formaction=\"{}\">Retry</button>",
                    d.id.0,
                    esc(&ns_url(&ns, &format!("/dead-letters/{}/retry", d.id.0)))
                )
            } else {
                String::new()
            };
            let _ = write!(
                body,
                "<tr data-dead-letter=\"{id}\"><td><input type=\"checkbox\" name=\"ids\" value=\"{id}\"></td><td><a href=\"{}\">{}</a></td><td><a href=\"{}\">{}</a></td><td>{}</td><td><code>{}</code></td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{retry}</td></tr>",
                esc(&ns_url(&ns, &format!("/dead-letters/{}", d.id.0))),
                d.id,
                esc(&ns_url(&ns, &format!("/instances/{}", d.letter.instance.0))),
                d.letter.instance,
                esc(&d.letter.machine.to_string()),
                esc(&short(&d.letter.position, 60)),
                esc(&d.letter.reason),
                d.letter.attempts,
                esc(&short(
                    &d.letter.errors.last().map(|e| e.error.clone()).unwrap_or_default(),
                    120
                )),
                time(d.created_at.0),
                id = d.id.0,
            );
        }
        body.push_str("</table>");
        if operate {
            body.push_str("<p><button id=\"retry-selected\">Retry selected</button></p>");
        }
        body.push_str("</form>");
        body.push_str(&letter_pager(&ns, &f.machine, &shown));
        if operate {
            body.push_str("<h2>Retry every dead letter of a machine</h2><p>");
            for m in machines.keys() {
                let _ = write!(
                    body,
                    "<form class=\"inline\" method=\"post\" action=\"{}\" data-confirm=\"Retry every dead letter of {m} in this namespace?\"><input type=\"hidden\" name=\"machine\" value=\"{m}\"><button>Retry all of {m}</button></form> ",
                    esc(&ns_url(&ns, "/dead-letters/retry-machine")),
                    m = esc(m),
                );
            }
            body.push_str("</p>");
        }
    }
    if viewer.operates() {
        let _ = write!(
            body,
            "<h2>Purge</h2><form method=\"post\" action=\"{}\" data-confirm=\"Delete these dead letters for good?\"><p>Delete this namespace's dead letters older than <input name=\"older_than\" value=\"7d\" size=\"8\"> (the letters of instances still suspended stay: a letter is how its instance is retried). <label><input type=\"checkbox\" name=\"confirm\" value=\"yes\" required> I understand this cannot be undone</label> <button class=\"danger\">Purge</button></p></form>",
            esc(&ns_url(&ns, "/dead-letters/purge"))
        );
    }
    page("Dead letters", Some(&ns), &viewer, &body).into_response()
}

/// "« oldest", "« previous" and "next »" for a page of dead letters, each keeping the
/// machine filter.
fn letter_pager(ns: &str, machine: &str, shown: &LetterPage) -> String {
    let base = ns_url(ns, "/dead-letters");
    let mut pager = String::from("<div class=\"pager\">");
    if shown.earlier {
        let _ = write!(
            pager,
            "<a id=\"oldest-page\" href=\"{}\">« oldest</a> ",
            esc(&format!("{base}{}", query(&[("machine", machine)])))
        );
        if let Some(first) = shown.letters.first() {
            let cursor = first.id.0.to_string();
            let _ = write!(
                pager,
                "<a id=\"previous-page\" href=\"{}\">« previous</a> ",
                esc(&format!("{base}{}", query(&[("machine", machine), ("before", &cursor)])))
            );
        }
    }
    if shown.later
        && let Some(last) = shown.letters.last()
    {
        let cursor = last.id.0.to_string();
        let _ = write!(
            pager,
            "<a id=\"next-page\" href=\"{}\">next »</a>",
            esc(&format!("{base}{}", query(&[("machine", machine), ("after", &cursor)])))
        );
    }
    pager + "</div>"
}

fn letter_id(raw: &str) -> Option<DeadLetterId> {
    raw.trim().trim_start_matches("dl").parse::<i64>().ok().filter(|n| *n > 0).map(DeadLetterId)
}

async fn letter_in(
    state: &AppState,
    ns: &str,
    raw: &str,
    viewer: &Viewer,
) -> Result<DeadLetter, Response> {
    let id = letter_id(raw).ok_or_else(|| {
        bad_input(
            viewer,
            ns,
            &format!("id: {raw:?} is not a dead letter id; write a positive number such as 3"),
        )
    })?;
    match in_namespace(state.keel.store().dead_letter_get(id).await, ns) {
        Ok(Some(d)) => Ok(d),
        Ok(None) => Err(not_found(Some(viewer))),
        Err(e) => Err(store_failed(viewer, ns, &e)),
    }
}

/// `GET /ui/ns/{ns}/dead-letters/{id}`.
pub async fn dead_letter(
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    flat(async {
        let d = letter_in(&state, &ns, &id, &viewer).await?;
        let l = &d.letter;
        let mut body = format!(
            "<h1>Dead letter {}</h1><p>Instance <a href=\"{}\">{}</a> ({}) at <code>{}</code>: {} after {} attempt(s); first {} · last {}.</p>",
            d.id,
            esc(&ns_url(&ns, &format!("/instances/{}", l.instance.0))),
            l.instance,
            esc(&l.machine.to_string()),
            esc(&l.position),
            esc(&l.reason),
            l.attempts,
            time(l.first_attempt_at.0),
            time(l.last_attempt_at.0),
        );
        if viewer.operates() {
            let _ = write!(
                body,
                "<form method=\"post\" action=\"{}\"><button>Retry now</button></form>",
                esc(&ns_url(&ns, &format!("/dead-letters/{}/retry", d.id.0)))
            );
        }
        let _ = write!(
            body,
            "<h2>Event</h2><pre>{}</pre><p>correlation: {}</p><h2>Errors</h2><table><tr><th class=\"num\">attempt</th><th>at</th><th>error</th></tr>",
            l.event.as_ref().map_or_else(|| "none (a step failed)".into(), json),
            esc(l.correlation_id.as_deref().unwrap_or("none")),
        );
        for e in l.errors.iter().take(SECTION_ROWS_MAX) {
            let _ = write!(body, "<tr><td class=\"num\">{}</td><td>{}</td><td><pre>{}</pre></td></tr>", e.attempt, time(e.at.0), esc(&e.error));
        }
        body.push_str("</table>");
        Ok(page(&format!("Dead letter {}", d.id), Some(&ns), &viewer, &body).into_response())
    }
    .await)
}

fn back_to_letters(ns: &str, done: Done) -> Response {
    Redirect::to(&format!("{}{}", ns_url(ns, "/dead-letters"), done.query())).into_response()
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// `POST /ui/ns/{ns}/dead-letters/{id}/retry`.
pub async fn retry_one(
    State(state): State<Arc<AppState>>,
    Path((ns, id)): Path<(String, String)>,
    Extension(viewer): Extension<Viewer>,
) -> Response {
    flat(
        async {
            let d = letter_in(&state, &ns, &id, &viewer).await?;
            // A letter whose instance moved on is left and said so, as "retry selected"
            // says it.
            let mut done = crate::operate::LetterRetries::default();
            done.retry(&state.keel, d.id, d.letter.instance, std::time::Duration::ZERO)
                .await
                .map_err(|e| store_or_input(&viewer, &ns, &e))?;
            let done = Done::Retried {
                letters: 1,
                instances: count(done.retried().len()),
                stale: done.stale(),
            };
            Ok(back_to_letters(&ns, done))
        }
        .await,
    )
}

/// `POST /ui/ns/{ns}/dead-letters/retry` with `ids=…` (repeated).
pub async fn retry_selected(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    flat(async {
        let raw: Vec<String> = form.into_iter().filter(|(k, _)| k == "ids").map(|(_, v)| v).collect();
        if raw.is_empty() {
            return Err(bad_input(&viewer, &ns, "ids: tick at least one dead letter to retry"));
        }
        if raw.len() > RETRY_SELECTED_MAX {
            return Err(bad_input(&viewer, &ns, &format!("ids: at most {RETRY_SELECTED_MAX} at once; use \"retry all of a machine\" for more")));
        }
        // Check every one before retrying any, so a bad id changes nothing. An id given
        // twice (`dl5` and `5` too) is one letter, retried once.
        let mut letters = BTreeMap::new();
        for id in &raw {
            let d = letter_in(&state, &ns, id, &viewer).await?;
            letters.insert(d.id, d.letter.instance);
        }
        // The rule `keel dlq retry --machine M --all` follows: a letter whose instance is
        // no longer suspended, or whose instance an earlier ticked letter retried, is
        // left and counted, not a reason to stop.
        let mut done = crate::operate::LetterRetries::default();
        for (n, (id, instance)) in letters.iter().enumerate() {
            let retry = done.retry(&state.keel, *id, *instance, std::time::Duration::ZERO).await;
            retry.map_err(|e| {
                if n == 0 {
                    return store_or_input(&viewer, &ns, &e);
                }
                // The letters before this one were retried or left: say so with the error.
                let stale = done.stale();
                let left = match stale {
                    0 => String::new(),
                    k => format!(", and left {k} whose instance is no longer suspended"),
                };
                let done = format!(
                    "retried {} dead letter(s) ({} instance(s) run again){left}",
                    count(n).saturating_sub(stale),
                    done.retried().len()
                );
                let error = crate::output::PartlyDone::wrap(e, done, Value::Null);
                store_failed(&viewer, &ns, &format!("{error:#}"))
            })?;
        }
        let done = Done::Retried {
            letters: count(letters.len()),
            instances: count(done.retried().len()),
            stale: done.stale(),
        };
        Ok(back_to_letters(&ns, done))
    }
    .await)
}

fn field(form: &[(String, String)], name: &str) -> String {
    form.iter().find(|(k, _)| k == name).map(|(_, v)| v.trim().to_owned()).unwrap_or_default()
}

/// `POST /ui/ns/{ns}/dead-letters/retry-machine` with `machine=…`.
pub async fn retry_machine(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    flat(
        async {
            let machine = field(&form, "machine");
            if machine.is_empty() {
                return Err(bad_input(
                    &viewer,
                    &ns,
                    "machine: name the machine whose dead letters to retry",
                ));
            }
            // Letters whose instance moved on are skipped, not a reason to stop.
            let done = crate::operate::retry_machine_letters(
                &state.keel,
                &ns,
                &machine,
                None,
                crate::operate::RETRY_PAGE_MAX,
                RETRY_PAGES,
                |_| {},
            )
            .await
            .map_err(|failed| {
                if failed.done.retried.is_empty() {
                    return store_or_input(&viewer, &ns, &failed.error);
                }
                let done =
                    format!("retried {} instance(s) of {machine}", failed.done.retried.len());
                let error = crate::output::PartlyDone::wrap(failed.error, done, Value::Null);
                store_failed(&viewer, &ns, &format!("{error:#}"))
            })?;
            Ok(back_to_letters(
                &ns,
                Done::RetriedMachine {
                    instances: count(done.retried.len()),
                    stale: done.stale,
                    more: !done.complete,
                },
            ))
        }
        .await,
    )
}

/// `POST /ui/ns/{ns}/dead-letters/purge` with `older_than=…&confirm=yes`: this
/// namespace's dead letters older than the age, machine by machine.
pub async fn purge(
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    Extension(viewer): Extension<Viewer>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    flat(
        async {
            if field(&form, "confirm") != "yes" {
                return Err(bad_input(
                    &viewer,
                    &ns,
                    "confirm: tick the box to confirm; purged dead letters cannot be restored",
                ));
            }
            let older = field(&form, "older_than");
            let age = duration::parse(&older)
                .map_err(|e| bad_input(&viewer, &ns, &format!("older_than: {e}")))?;
            let crate::operate::OldLettersPurged { purged, complete } =
                crate::operate::purge_old_dead_letters(&state.keel, &ns, age, ROUNDS_MAX)
                    .await
                    .map_err(|failed| {
                        if failed.done.purged == 0 {
                            return store_or_input(&viewer, &ns, &failed.error);
                        }
                        let done = format!("purged {} dead letter(s)", failed.done.purged);
                        let error =
                            crate::output::PartlyDone::wrap(failed.error, done, Value::Null);
                        store_failed(&viewer, &ns, &format!("{error:#}"))
                    })?;
            let older_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            Ok(back_to_letters(&ns, Done::Purged { letters: purged, older_ms, more: !complete }))
        }
        .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::{MachineRef, Revision};
    use keel_core::instance::{HistoryEntry, HistoryRecord, Instance, NewInstance};

    fn detail(entries: usize) -> InstanceDetail {
        let new = NewInstance::new(MachineRef::new("m", 1), "start").namespace("ops");
        let instance = Instance::from_new(InstanceId(7), &new, None, keel_core::Timestamp(0));
        let history = (1..=entries as i64)
            .map(|seq| HistoryRecord {
                instance: InstanceId(7),
                seq,
                at: keel_core::Timestamp(seq),
                revision: Revision(seq),
                attempt: 1,
                entry: HistoryEntry::new("STEP_NEXT", serde_json::json!({})),
            })
            .collect();
        InstanceDetail { instance, inbox: vec![], children: vec![], history, timers: vec![] }
    }

    #[test]
    fn counts_cut_at_their_page_bound_read_at_least() {
        let a = crate::operate::MachineActivity {
            machine: "busy".into(),
            ready_without_worker: 1_000,
            unserved_versions: vec![3],
            stuck_leases: 1_000,
            ..Default::default()
        };
        let panel = activity_panel(std::slice::from_ref(&a));
        assert!(panel.contains("<td class=\"num\">at least 1000</td>"), "{panel}");
        let config = keel_core::config::KeelConfig::from_toml_str(
            "[queue.alerts]\nstuck_leases_warning = 10\n",
        )
        .unwrap();
        let panel = findings_panel(health::evaluate(&config, &[], &[a]));
        assert!(panel.contains("<td class=\"num\">at least 1000</td>"), "{panel}");
    }

    #[test]
    fn the_history_command_quotes_its_namespace() {
        let mut d = detail(SECTION_ROWS_MAX + 2);
        d.instance.namespace = "team a".into();
        let long = history_panel(&d);
        let note = long.rsplit("<p class=\"muted\">").next().unwrap_or_default();
        assert!(note.contains("keel -n &#39;team a&#39; history i7 --before 3"), "{note}");
    }

    #[test]
    fn the_history_path_percent_encodes_its_namespace() {
        let mut d = detail(SECTION_ROWS_MAX + 2);
        d.instance.namespace = "team a/b?c".into();
        let long = history_panel(&d);
        assert!(
            long.contains("GET /v1/namespaces/team%20a%2Fb%3Fc/instances/7/history?before=3"),
            "{long}"
        );
    }

    /// The activity table names what it shows: the mean time from an instance's start to
    /// its end, waits included, not the time its steps ran.
    #[test]
    fn the_activity_table_says_turnaround() {
        let a = crate::operate::MachineActivity {
            machine: "order".into(),
            completed_last_hour: 2,
            avg_processing_ms: Some(172_800_000),
            ..Default::default()
        };
        let panel = activity_panel(std::slice::from_ref(&a));
        assert!(panel.contains(">avg turnaround</th>"), "{panel}");
        assert!(!panel.contains("avg time"), "{panel}");
    }

    /// A step machine whose only step fails for good: each instance becomes a dead letter.
    struct Refuser;

    #[keel::async_trait]
    impl keel::StepMachine for Refuser {
        fn machine(&self) -> MachineRef {
            MachineRef::new("refuser", 1)
        }

        async fn step(&self, _ctx: &keel::StepContext) -> Result<keel::Outcome, keel::StepError> {
            Err(keel::StepError::fatal("card declined"))
        }
    }

    /// A SQLite store in `dir` with `n` dead letters of `refuser`: the store, its URL and
    /// the letters, oldest first.
    async fn dead_letters(
        dir: &tempfile::TempDir,
        n: usize,
    ) -> (keel::Keel, String, Vec<DeadLetter>) {
        let url = format!("sqlite://{}", dir.path().join("keel.db").display());
        let keel = keel::Keel::connect(&url).await.unwrap();
        let config = keel::WorkerConfig {
            poll_interval: std::time::Duration::from_millis(20),
            ..keel::WorkerConfig::named("ui-test")
        };
        let worker = keel.worker_with(config).register(Refuser).unwrap().spawn().unwrap();
        for key in 0..n {
            let new = keel::NewInstance::new(MachineRef::new("refuser", 1), "charge")
                .business_key(key.to_string());
            keel.start(new).await.unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let filter = DeadLetterFilter { limit: 100, ..DeadLetterFilter::default() };
        let letters = loop {
            let letters = keel.dead_letters(filter.clone()).await.unwrap();
            if letters.len() == n {
                break letters;
            }
            assert!(std::time::Instant::now() < deadline, "{} of {n} dead letters", letters.len());
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        worker.shutdown().await;
        (keel, url, letters)
    }

    async fn post_retry_selected(
        keel: &keel::Keel,
        ids: &[String],
    ) -> (StatusCode, String, String) {
        let state = AppState::open(keel.clone(), "default", keel::prometheus::install().unwrap());
        let form = ids.iter().map(|id| ("ids".to_owned(), id.clone())).collect();
        let response = retry_selected(
            State(Arc::new(state)),
            Path("default".to_owned()),
            Extension(Viewer { grant: None }),
            Form(form),
        )
        .await;
        let status = response.status();
        let location = response
            .headers()
            .get(axum::http::header::LOCATION)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (status, location, String::from_utf8_lossy(&body).into_owned())
    }

    /// "Retry selected" with one letter ticked twice (as `dl5` and `5`) retries it once
    /// and counts it once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_selected_counts_a_letter_given_twice_once() {
        let dir = tempfile::tempdir().unwrap();
        let (keel, _, letters) = dead_letters(&dir, 1).await;
        let id = letters[0].id;
        let (status, location, body) =
            post_retry_selected(&keel, &[id.to_string(), id.0.to_string()]).await;
        assert!(status.is_redirection(), "{status}: {body}");
        assert!(location.ends_with("?done=retried&n=1&of=1"), "{location}");
    }

    /// "Retry selected" with a letter whose instance is no longer suspended among those
    /// ticked retries the others and says that one was left, naming how to remove it, as
    /// `keel dlq retry --machine M --all` does; retrying that letter alone says the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_selected_leaves_a_letter_whose_instance_moved_on() {
        let dir = tempfile::tempdir().unwrap();
        let (keel, _, letters) = dead_letters(&dir, 3).await;
        let moved_on = letters[1].letter.instance;
        keel.cancel(keel::Cancel::new(moved_on)).await.unwrap();
        let ids: Vec<String> = letters.iter().map(|d| d.id.to_string()).collect();
        let (status, location, body) = post_retry_selected(&keel, &ids).await;
        assert!(status.is_redirection(), "{status}: {body}");
        assert!(location.ends_with("?done=retried&n=3&of=2&stale=1"), "{location}");
        for (d, want) in letters.iter().zip([Status::Runnable, Status::Cancelled, Status::Runnable])
        {
            let row = keel.get(d.letter.instance).await.unwrap().instance;
            assert_eq!(row.status, want, "{}", d.letter.instance);
        }
        let left = keel.dead_letters(DeadLetterFilter { limit: 10, ..Default::default() });
        let left: Vec<DeadLetterId> = left.await.unwrap().iter().map(|d| d.id).collect();
        assert_eq!(left, [letters[1].id]);

        let state = AppState::open(keel.clone(), "default", keel::prometheus::install().unwrap());
        let response = retry_one(
            State(Arc::new(state)),
            Path(("default".to_owned(), letters[1].id.to_string())),
            Extension(Viewer { grant: None }),
        )
        .await;
        let location = response.headers().get(axum::http::header::LOCATION).cloned();
        assert!(response.status().is_redirection(), "{}", response.status());
        let location = location.unwrap();
        assert!(location.to_str().unwrap().ends_with("?done=retried&n=1&of=0&stale=1"));
    }

    /// When a later retry of "retry selected" fails, the page says which were retried
    /// before it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_selected_that_fails_part_way_says_what_it_retried() {
        use sqlx::{ConnectOptions as _, Connection as _};
        let dir = tempfile::tempdir().unwrap();
        let (keel, url, letters) = dead_letters(&dir, 2).await;
        // The second letter's instance cannot be written (a runtime error: an outage).
        let second = letters[1].letter.instance.0;
        let path = url.strip_prefix("sqlite://").unwrap();
        let mut conn =
            sqlx::sqlite::SqliteConnectOptions::new().filename(path).connect().await.unwrap();
        let trigger = format!(
            "CREATE TRIGGER no_retry BEFORE UPDATE ON keel_instances WHEN OLD.id = {second} \
             BEGIN SELECT abs(-9223372036854775807 - 1); END"
        );
        sqlx::query(sqlx::AssertSqlSafe(trigger)).execute(&mut conn).await.unwrap();
        conn.close().await.unwrap();
        let ids: Vec<String> = letters.iter().map(|d| d.id.to_string()).collect();
        let (status, _, body) = post_retry_selected(&keel, &ids).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(
            body.contains("retried 1 dead letter(s) (1 instance(s) run again), then failed: "),
            "{body}"
        );
        let first = keel.get(letters[0].letter.instance).await.unwrap().instance;
        assert_eq!(first.status, Status::Runnable, "the first retry was done");
    }

    /// The flash a page shows for the query string `raw`.
    fn flash_of(raw: &str) -> String {
        let f: Flash = serde_urlencoded::from_str(raw).unwrap();
        flash(&f, "default")
    }

    #[test]
    fn flash_messages_come_only_from_known_codes() {
        let all = [
            Done::QueuePaused,
            Done::QueueResumed,
            Done::Retried { letters: 2, instances: 1, stale: 0 },
            Done::Retried { letters: 3, instances: 2, stale: 1 },
            Done::RetriedMachine { instances: 5, stale: 1, more: true },
            Done::Purged { letters: 3, older_ms: 7 * 86_400_000, more: false },
        ];
        for done in all {
            let query = done.query();
            let shown = flash_of(query.strip_prefix('?').unwrap_or_default());
            assert_eq!(
                shown,
                format!("<div class=\"flash\">{}</div>", esc(&done.message("default")))
            );
        }
        assert_eq!(
            flash_of("done=purged&n=3&older_ms=604800000"),
            "<div class=\"flash\">Purged 3 dead letter(s) older than 1 week.</div>"
        );
        assert!(flash_of("done=retried-machine&of=5&stale=1&more=1").contains(
            "Retried 5 instance(s) of the machine. 1 dead letter(s) left: their instance is no longer suspended; `keel dlq delete ID` removes one. More remain, retry again."
        ));
        assert_eq!(
            flash_of("done=retried&n=3&of=2&stale=1"),
            "<div class=\"flash\">Retried 2 of 3 dead letter(s): 2 instance(s) run again. 1 dead letter(s) left: their instance is no longer suspended; `keel dlq delete ID` removes one.</div>"
        );
        // Free text, an unknown code, a count that is not a number, or a missing count
        // show nothing.
        for raw in [
            "done=Your+session+expired%3A+sign+in+at+evil.example",
            "done=Queue+paused.",
            "done=retried&n=2&of=one",
            "done=retried&n=2",
            "done=retried&n=2&of=1&stale=x",
            "done=purged&n=-1&older_ms=1",
            "",
        ] {
            assert_eq!(flash_of(raw), "", "{raw}");
        }
    }

    /// The `paused queues` card's number.
    fn paused_card(page: &str) -> &str {
        let card = "<div class=\"k\">paused queues</div><div class=\"v\">";
        let at = page.find(card).expect("the paused queues card") + card.len();
        page[at..].split('<').next().unwrap_or_default()
    }

    /// A queue paused with nothing unfinished in it (paused ahead of a deploy) is on the
    /// overview with its Resume button and counted in the card, as a paused queue with
    /// work is; a resumed queue with nothing in it is not listed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_queue_with_nothing_unfinished_is_shown_with_its_resume() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("keel.db").display());
        let keel = keel::Keel::connect(&url).await.unwrap();
        let new = keel::NewInstance::new(MachineRef::new("m", 1), "go").queue("busy");
        keel.start(new).await.unwrap();
        let pause = |queue: &str, paused: bool| keel_core::ports::store::QueuePauseParams {
            namespace: "default".into(),
            queue: queue.into(),
            paused,
            now: now(),
        };
        for (queue, paused) in [("busy", true), ("deploy", true), ("calm", true), ("calm", false)] {
            keel.store().queue_pause(pause(queue, paused)).await.unwrap();
        }
        let state = AppState::open(keel.clone(), "default", keel::prometheus::install().unwrap());
        let response = overview_fragment(
            State(Arc::new(state)),
            Path("default".to_owned()),
            Extension(Viewer { grant: None }),
        )
        .await;
        assert_eq!(response.status(), StatusCode::OK);
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body = String::from_utf8_lossy(&body);
        assert_eq!(paused_card(&body), "2", "{body}");
        let row = body.split("<tr data-queue=\"deploy\"").nth(1).expect("a row for deploy");
        let row = row.split("</tr>").next().unwrap_or_default();
        assert!(row.contains(&badge("paused")), "{row}");
        assert!(
            row.contains("action=\"/ui/ns/default/queues/deploy/resume\"")
                && row.contains(">Resume</button>"),
            "{row}"
        );
        assert!(body.contains("<tr data-queue=\"busy\" data-machine=\"m\">"), "{body}");
        assert!(!body.contains("data-queue=\"calm\""), "{body}");
        // With no unfinished instance at all, the panel still lists the paused queue.
        let only = crate::commands::idle_paused(&["deploy".to_owned()], &BTreeSet::new());
        let panel = queues_panel("default", &[], &only, &Viewer { grant: None });
        assert!(panel.contains("/ui/ns/default/queues/deploy/resume"), "{panel}");
        assert_eq!(paused_card(&totals_panel(&[], &only)), "1");
    }

    /// The note under a section the store cut at its bound says "at least": 5 000 pending
    /// signals read as the store's first 1 000 are not "500 more".
    #[test]
    fn sections_the_store_cut_say_at_least_how_many_more() {
        let signal = |n: usize| keel_core::instance::Signal {
            id: keel_core::ids::SignalId(n as i64),
            target: InstanceId(7),
            name: "PING".into(),
            payload: serde_json::json!({}),
            dedup_key: None,
            priority: None,
            inserted_at: keel_core::Timestamp(0),
        };
        let mut d = detail(0);
        d.inbox = (1..=limits::INBOX_LIST_MAX).map(signal).collect();
        let cut = limits::INBOX_LIST_MAX - SECTION_ROWS_MAX;
        assert!(inbox_panel(&d).ends_with(&format!("At least {cut} more not shown.</p>")));
        d.inbox.truncate(SECTION_ROWS_MAX + 100);
        assert!(inbox_panel(&d).ends_with("<p class=\"muted\">100 more not shown.</p>"));
        d.inbox.truncate(SECTION_ROWS_MAX);
        assert!(inbox_panel(&d).ends_with("</table>"));

        let child = |n: usize| {
            let new = NewInstance::new(MachineRef::new("c", 1), "start").namespace("ops");
            let row =
                Instance::from_new(InstanceId(100 + n as i64), &new, None, keel_core::Timestamp(0));
            keel_core::instance::ChildSummary::of(&row)
        };
        d.children = (0..limits::CHILDREN_LIST_MAX).map(child).collect();
        let panel = children_panel("ops", &d, 0, &BTreeMap::new());
        assert!(panel.contains(&format!("At least {cut} more not shown.")), "{panel}");
        // Children of namespaces the token does not see were read too: still cut.
        d.children.truncate(limits::CHILDREN_LIST_MAX - 3);
        let panel = children_panel("ops", &d, 3, &BTreeMap::new());
        assert!(panel.contains(&format!("At least {} more not shown.", cut - 3)), "{panel}");
        d.children.truncate(SECTION_ROWS_MAX + 1);
        let panel = children_panel("ops", &d, 0, &BTreeMap::new());
        assert!(panel.contains("<p class=\"muted\">1 more not shown.</p>"), "{panel}");

        // Timers use the same note.
        assert_eq!(
            more(limits::TIMER_LIST_MAX, true),
            format!("<p class=\"muted\">At least {cut} more not shown.</p>")
        );
        assert_eq!(more(SECTION_ROWS_MAX, false), "");
    }

    /// At the store's bound the workers panel gives lower bounds, as `keel workers` does.
    #[test]
    fn the_workers_panel_says_at_least_when_the_store_list_is_full() {
        use keel_core::ports::store::{WORKER_LIST_MAX, WORKER_STALE_AFTER, WorkerRecord};
        let now = keel_core::Timestamp(10_000_000);
        let worker = |n: usize, live: bool| WorkerRecord {
            id: keel_core::ids::WorkerId(format!("w{n}")),
            name: format!("w{n}"),
            machines: vec![],
            namespaces: vec![],
            started_at: keel_core::Timestamp(0),
            last_seen_at: if live {
                now
            } else {
                now.minus(WORKER_STALE_AFTER + std::time::Duration::from_secs(1))
            },
        };
        let few: Vec<_> = (0..3).map(|n| worker(n, n < 2)).collect();
        let panel = workers_panel(&few, now, WorkersBound::of(&few, now.minus(WORKER_STALE_AFTER)));
        assert!(panel.contains(">2 live, 1 stale</p>"), "{panel}");
        assert!(!panel.contains("at most"), "{panel}");

        let full: Vec<_> = (0..WORKER_LIST_MAX).map(|n| worker(n, n < 10)).collect();
        let panel =
            workers_panel(&full, now, WorkersBound::of(&full, now.minus(WORKER_STALE_AFTER)));
        let stale = WORKER_LIST_MAX - 10;
        assert!(panel.contains(&format!(">10 live, at least {stale} stale</p>")), "{panel}");
        assert!(
            panel.ends_with(&format!(
                "The store lists at most {WORKER_LIST_MAX} workers: there may be more.</p>"
            )),
            "{panel}"
        );

        let live: Vec<_> = (0..WORKER_LIST_MAX).map(|n| worker(n, true)).collect();
        let panel =
            workers_panel(&live, now, WorkersBound::of(&live, now.minus(WORKER_STALE_AFTER)));
        let seen = format!(
            ">at least {WORKER_LIST_MAX} live, 0 stale among the {WORKER_LIST_MAX} most recently seen</p>"
        );
        assert!(panel.contains(&seen), "{panel}");

        // None of the full list claims from this namespace.
        let panel = workers_panel(&[], now, WorkersBound::of(&full, now.minus(WORKER_STALE_AFTER)));
        assert!(
            panel.contains(&format!(
                "No worker claiming from this namespace is among the {WORKER_LIST_MAX} most recently seen workers."
            )),
            "{panel}"
        );
    }

    /// A child in another namespace is linked under its own namespace.
    #[test]
    fn children_are_linked_under_their_own_namespace() {
        let child = |n: i64| {
            let new = NewInstance::new(MachineRef::new("c", 1), "start").namespace("ops");
            let row = Instance::from_new(InstanceId(n), &new, None, keel_core::Timestamp(0));
            keel_core::instance::ChildSummary::of(&row)
        };
        let mut d = detail(0);
        d.children = vec![child(101), child(102)];
        let homes = BTreeMap::from([(InstanceId(102), "billing".to_owned())]);
        let panel = children_panel("ops", &d, 0, &homes);
        assert!(panel.contains("href=\"/ui/ns/ops/instances/101\""), "{panel}");
        assert!(panel.contains("href=\"/ui/ns/billing/instances/102\""), "{panel}");
    }

    /// Undoes [`esc`].
    fn unescape(text: &str) -> String {
        text.replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&amp;", "&")
    }

    /// The text of the first `<pre>` after `from` in `html`, unescaped, and the note after it.
    fn pre_after<'a>(html: &'a str, from: &str) -> (String, &'a str) {
        let rest = &html[html.find(from).expect(from)..];
        let start = rest.find("<pre").unwrap();
        let rest = &rest[start..];
        let body = &rest[rest.find('>').unwrap() + 1..];
        let end = body.find("</pre>").unwrap();
        (unescape(&body[..end]), &body[end + "</pre>".len()..])
    }

    /// Checks that `shown` (a `<pre>`'s text and what follows it) is `value` cut at
    /// [`PRE_BYTES_MAX`] on a character boundary, with a note naming the bytes left out and
    /// where to read all of it.
    fn assert_cut(value: &Value, (shown, after): (String, &str)) {
        let full = serde_json::to_string_pretty(value).unwrap();
        let kept = shown.strip_suffix('…').expect("a cut value ends in …");
        assert!(kept.len() <= PRE_BYTES_MAX && kept.len() > PRE_BYTES_MAX - 4, "{}", kept.len());
        assert!(full.starts_with(kept));
        let note = after.split("</p>").next().unwrap_or_default();
        let left = full.len() - kept.len();
        assert!(note.contains(&format!(">{left} more bytes not shown: ")), "{note}");
        assert!(
            note.contains("<code>keel -n ops inspect i7 --json</code>")
                && note.contains("<code>GET /v1/namespaces/ops/instances/7</code>"),
            "{note}"
        );
    }

    /// Context, result, inbox payloads and history data longer than [`PRE_BYTES_MAX`]
    /// are cut, still escaped, with a note of what was left out; shorter ones are whole.
    #[test]
    fn long_values_on_the_instance_page_are_cut_with_a_note() {
        // Two-byte characters and markup: the cut lands on a character boundary and the
        // kept text is escaped.
        let big = serde_json::json!({ "blob": "<b>é".repeat(5_000) });
        let small = serde_json::json!({ "note": "<i>short</i>" });
        let mut d = detail(0);
        d.instance.context = big.clone();
        d.instance.result = Some(small.clone());
        let panel = values_panel(&d.instance);
        assert!(!panel.contains("<b>") && !panel.contains("<i>"), "markup is escaped");
        assert_cut(&big, pre_after(&panel, "<h2>Context</h2>"));
        let (result, after) = pre_after(&panel, "<h2>Result</h2>");
        assert_eq!(result, serde_json::to_string_pretty(&small).unwrap());
        assert!(!after.contains("more bytes"), "{after}");
        assert!(panel.len() < 3 * PRE_BYTES_MAX, "{}", panel.len());

        d.inbox = vec![keel_core::instance::Signal {
            id: keel_core::ids::SignalId(1),
            target: InstanceId(7),
            name: "BIG".into(),
            payload: big.clone(),
            dedup_key: None,
            priority: None,
            inserted_at: keel_core::Timestamp(0),
        }];
        let panel = inbox_panel(&d);
        assert!(!panel.contains("<b>"), "markup is escaped");
        assert_cut(&big, pre_after(&panel, "<summary>BIG</summary>"));

        let mut d = detail(2);
        d.history[1].entry = HistoryEntry::new("STEP_NEXT", big.clone());
        let panel = history_panel(&d);
        assert!(!panel.contains("<b>"), "markup is escaped");
        assert_cut(&big, pre_after(&panel, "data-key=\"h2\""));
        let (first, _) = pre_after(&panel, "data-key=\"h1\"");
        assert_eq!(first, "{}");
    }

    #[test]
    fn the_history_panel_points_to_older_entries_only_when_some_are_hidden() {
        let short = history_panel(&detail(3));
        assert!(!short.contains("Older entries"), "{short}");
        let long = history_panel(&detail(SECTION_ROWS_MAX + 2));
        // Entries 1 and 2 are hidden; the oldest shown is 3.
        assert!(!long.contains("data-key=\"h2\"") && long.contains("data-key=\"h3\""));
        assert!(
            long.contains("keel -n ops history i7 --before 3")
                && long.contains("GET /v1/namespaces/ops/instances/7/history?before=3"),
            "{long}"
        );
    }
}
