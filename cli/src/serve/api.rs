//! The event and instance API under `/v1/namespaces/{ns}/…`.
//!
//! Bodies are parsed by hand from bytes so that every bad input — malformed JSON, a wrong
//! type, an unknown field — is answered with 400 and a message naming the field, never
//! with the framework's plain-text rejection. An instance of another namespace answers
//! 404, exactly like one that does not exist.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::FromRequestParts;
use axum::extract::rejection::BytesRejection;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, State};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use keel::{
    Cancel, DeliveryOutcome, ErrorKind, InsertOutcome, InstanceId, MachineRef, NewInstance,
    NewSignal, SignalTarget, StoreError, Value,
};
use keel_core::ports::Store;
use keel_core::ports::store::WorkerRecord;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::AppState;
use super::auth::Grant;

/// An API error: a status, the field at fault when there is one, and how to fix it.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    field: Option<String>,
    message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, field: Option<&str>, message: impl Into<String>) -> Self {
        ApiError { status, field: field.map(str::to_owned), message: message.into() }
    }

    pub(super) fn bad(field: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }

    pub(super) fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, field: None, message: message.into() }
    }

    pub(super) fn conflict(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::CONFLICT, field: None, message: message.into() }
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        let status = match error.kind {
            ErrorKind::Invalid => StatusCode::BAD_REQUEST,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::Conflict | ErrorKind::LeaseLost => StatusCode::CONFLICT,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        };
        // Store messages start with the field they are about (`name: …`).
        let field = (status == StatusCode::BAD_REQUEST)
            .then(|| error.message.split(':').next().unwrap_or_default().trim().to_owned())
            .filter(|f| !f.is_empty() && !f.contains(' '));
        ApiError { status, field, message: error.message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message, "field": self.field }))).into_response()
    }
}

type ApiResult = Result<Response, ApiError>;

/// A store error about a request body, with the store's field path (`position`, `name`,
/// `target.key`) rewritten to the body's own name for it (`renames`: store path → body
/// field), in `field` and at the head of the message. A path `renames` does not list is
/// kept as it is.
fn renamed(error: StoreError, renames: &[(&str, &str)]) -> ApiError {
    let mut api = ApiError::from(error);
    let found = api.field.as_deref().and_then(|f| renames.iter().find(|(store, _)| *store == f));
    if let Some(&(store, body)) = found {
        if let Some(rest) = api.message.strip_prefix(store) {
            api.message = format!("{body}{rest}");
        }
        api.field = Some(body.to_owned());
    }
    api
}

/// The store's names for a start's fields that the body names otherwise (the client's
/// single start already drops the batch's `instances[0].`).
const START_FIELDS: &[(&str, &str)] = &[
    ("machine.name", "machine"),
    ("machine.version", "version"),
    ("position", "at"),
    ("business_key", "key"),
];

/// The store's names for an event's fields that the body names otherwise (the client's
/// single send already drops the batch's `signals[0].`).
const EVENT_FIELDS: &[(&str, &str)] = &[
    ("name", "event"),
    ("target.machine", "machine"),
    ("target.key", "key"),
    ("target.namespace", "namespace"),
];

/// `axum`'s path extractor answering a parameter it cannot take (invalid UTF-8 after
/// percent-decoding, say) with 400 in the API's JSON shape, naming the parameter.
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(rejection) => Err(path_rejected(rejection)),
        }
    }
}

fn path_rejected(rejection: PathRejection) -> ApiError {
    use axum::extract::path::ErrorKind as Kind;
    let PathRejection::FailedToDeserializePathParams(failed) = rejection else {
        return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, None, rejection.body_text());
    };
    let param = match failed.kind() {
        Kind::InvalidUtf8InPathParam { key }
        | Kind::ParseErrorAtKey { key, .. }
        | Kind::DeserializeError { key, .. } => key.clone(),
        _ => "path".to_owned(),
    };
    // The routes call the namespace `{ns}`; every error names it `namespace`.
    let param = if param == "ns" { "namespace".to_owned() } else { param };
    let why = match failed.kind() {
        Kind::InvalidUtf8InPathParam { .. } => {
            "is not valid UTF-8 once percent-decoded; percent-encode the UTF-8 bytes of the name"
                .to_owned()
        }
        kind => kind.to_string(),
    };
    ApiError::bad(&param, format!("{param}: {why}"))
}

/// Parses a JSON body; the error names the field at fault (its path in the document).
pub(super) fn body<T: DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|error| named(error, "body"))?;
    // One JSON document and nothing after it but whitespace.
    de.end().map_err(|error| ApiError::bad("body", format!("body: {error}")))?;
    Ok(value)
}

/// A query string's parameters, or 400 naming the parameter at fault, as for bodies.
pub(super) fn query<T: DeserializeOwned>(raw: Option<&str>) -> Result<T, ApiError> {
    let pairs = form_urlencoded::parse(raw.unwrap_or_default().as_bytes());
    serde_path_to_error::deserialize(serde_urlencoded::Deserializer::new(pairs))
        .map_err(|error| named(error, "query"))
}

/// A 400 naming the field at fault: its path, or at the top level (an unknown or missing
/// field) the field the message names, else `whole`.
fn named<E: std::fmt::Display>(error: serde_path_to_error::Error<E>, whole: &str) -> ApiError {
    let path = error.path().to_string();
    let inner = error.into_inner().to_string();
    let field = if path == "." || path == "?" {
        inner.split('`').nth(1).filter(|_| inner.contains("field")).unwrap_or(whole).to_owned()
    } else {
        path
    };
    ApiError::bad(&field, format!("{field}: {inner}"))
}

/// Refuses any query parameter, for the routes that take none: a parameter a route would
/// ignore (`/status?machine=…`) is a 400 naming it, not a silently wider answer.
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        // Any query is refused, `?` and `?&` included; the error names its first parameter,
        // or the query as a whole when that has no name (`?=1`).
        let Some(raw) = parts.uri.query() else {
            return Ok(NoQuery);
        };
        let first = form_urlencoded::parse(raw.as_bytes()).next();
        match first.map(|(name, _)| name).filter(|name| !name.is_empty()) {
            Some(name) => Err(ApiError::bad(
                &name,
                format!("{name}: this route takes no query parameters; leave it out"),
            )),
            None => Err(ApiError::bad(
                "query",
                format!(
                    "query: this route takes no query parameters, and this request has {:?}; leave it out",
                    format!("?{raw}")
                ),
            )),
        }
    }
}

/// The 405 of a known path called with another method, in the API's JSON shape.
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        None,
        format!(
            "{method} is not allowed on {}; the README's API table lists each route's method",
            uri.path()
        ),
    )
}

/// The raw body, or 413 / 400 in the API's JSON shape when it cannot be read.
pub(super) fn read(bytes: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    bytes.map_err(|rejection| ApiError {
        status: rejection.status(),
        field: Some("body".into()),
        message: format!(
            "body: {}; bodies are at most {} bytes",
            rejection.body_text(),
            super::BODY_BYTES_MAX
        ),
    })
}

pub(super) fn parse_id(raw: &str) -> Result<InstanceId, ApiError> {
    let digits = raw.strip_prefix('i').unwrap_or(raw);
    digits.parse::<i64>().ok().filter(|n| *n > 0).map(InstanceId).ok_or_else(|| {
        ApiError::bad(
            "id",
            format!("{raw:?} is not an instance id; write a positive number such as 42 or i42"),
        )
    })
}

/// The instance, when it exists in `ns`; otherwise 404 (another namespace's included).
pub(super) async fn instance_in(
    state: &AppState,
    ns: &str,
    id: InstanceId,
) -> Result<(), ApiError> {
    let read = state.keel.store().instance_rows(vec![id]).await;
    match super::scope::row_in_namespace(read, id, ns)? {
        Some(_) => Ok(()),
        None => Err(ApiError::not_found(format!("no instance {id} in namespace {ns:?}"))),
    }
}

/// `POST …/events`: where it goes, the event's name, its payload.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventBody {
    /// An instance id.
    instance: Option<i64>,
    /// With `key`: the newest instance of this machine with that business key.
    machine: Option<String>,
    /// The business key.
    key: Option<String>,
    /// The event's name.
    event: String,
    /// The payload (default `{}`).
    #[serde(default)]
    payload: Option<Value>,
    /// A second event with the same key to the same instance is not stored again.
    dedup_key: Option<String>,
    /// How urgent the event is (`critical` … `bulk`); default: its event section's in the
    /// configuration file, else none.
    #[serde(default)]
    priority: Option<keel_core::Priority>,
}

async fn target(state: &AppState, ns: &str, b: &EventBody) -> Result<InstanceId, ApiError> {
    match (b.instance, &b.machine, &b.key) {
        (Some(raw), None, None) => {
            let id = Some(raw).filter(|n| *n > 0).map(InstanceId).ok_or_else(|| {
                ApiError::bad(
                    "instance",
                    format!("{raw} is not an instance id; give a positive number such as 42"),
                )
            })?;
            instance_in(state, ns, id).await?;
            Ok(id)
        }
        (None, Some(machine), Some(key)) => {
            // A name no instance can hold is a 400 naming it, as for a start, not a 404.
            for (field, value) in [("machine", machine), ("key", key)] {
                keel_core::instance::check_name(field, value).map_err(ApiError::from)?;
            }
            let target = SignalTarget::Key {
                namespace: ns.to_owned(),
                machine: machine.clone(),
                key: key.clone(),
            };
            state.keel.lookup(target).await.map_err(|e| renamed(e, EVENT_FIELDS))?.ok_or_else(
                || {
                    ApiError::not_found(format!(
                        "no instance of machine {machine:?} with key {key:?} in namespace {ns:?}"
                    ))
                },
            )
        }
        _ => Err(ApiError::bad(
            "instance",
            "name the target with either \"instance\": <id> or both \"machine\" and \"key\"",
        )),
    }
}

fn unknown_machine(machine: &str) -> ApiError {
    ApiError::bad(
        "machine",
        format!(
            "machine: {machine:?} is not a machine this server knows; check the name against the definitions file"
        ),
    )
}

/// Against the known charts: the target's machine and version exist and the event is one
/// of the chart's events; 400 naming the field otherwise.
fn check_event(
    defs: &crate::definitions::Definitions,
    machine: &MachineRef,
    event: &str,
) -> Result<(), ApiError> {
    let versions = defs.versions(&machine.name);
    if versions.is_empty() {
        return Err(unknown_machine(&machine.name));
    }
    let version = u32::try_from(machine.version).unwrap_or(0);
    let Some(chart) = defs.get(&machine.name, version) else {
        return Err(ApiError::bad(
            "version",
            format!(
                "version: {} has no version {} in the definitions file (it holds {versions:?})",
                machine.name, machine.version
            ),
        ));
    };
    let events = chart.event_alphabet();
    if !events.iter().any(|e| e == event) {
        return Err(ApiError::bad(
            "event",
            format!(
                "event: {} v{} has no event {event:?}; it accepts {}",
                machine.name,
                machine.version,
                events.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Stores an event for an instance: 202 with the signal id.
pub async fn send_event(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let b: EventBody = body(&read(bytes)?)?;
    if let (Some(defs), Some(machine)) = (&state.definitions, &b.machine)
        && !defs.has_machine(machine)
    {
        return Err(unknown_machine(machine));
    }
    let id = target(&state, &ns, &b).await?;
    if let Some(defs) = &state.definitions {
        let rows = state.keel.store().instance_rows(vec![id]).await?;
        if let Some(row) = rows.iter().find(|r| r.id == id) {
            check_event(defs, &row.machine, &b.event)?;
        }
    }
    let mut signal = NewSignal::new(id, &b.event);
    if let Some(payload) = b.payload.clone() {
        signal = signal.payload(payload);
    }
    if let Some(key) = b.dedup_key.clone() {
        signal = signal.dedup_key(key);
    }
    if let Some(priority) = b.priority {
        signal = signal.priority(priority);
    }
    match state.keel.send(signal).await.map_err(|e| renamed(e, EVENT_FIELDS))? {
        DeliveryOutcome::Delivered { id: signal, target, .. } => Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "signal": signal.0, "instance": target.0, "duplicate": false })),
        )
            .into_response()),
        DeliveryOutcome::Duplicate { id: signal, target } => Ok((
            StatusCode::ACCEPTED,
            Json(json!({ "signal": signal.0, "instance": target.0, "duplicate": true })),
        )
            .into_response()),
        DeliveryOutcome::TargetTerminal { target, status } => Err(ApiError {
            status: StatusCode::CONFLICT,
            field: Some("instance".into()),
            message: format!("instance {target} has ended ({status}); its inbox is closed"),
        }),
        DeliveryOutcome::TargetMissing => Err(ApiError::not_found(format!("no instance {id}"))),
    }
}

/// `POST …/instances`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    machine: String,
    #[serde(default)]
    version: Option<i32>,
    #[serde(default)]
    context: Option<Value>,
    key: Option<String>,
    #[serde(default = "chart_start")]
    at: String,
    queue: Option<String>,
    #[serde(default)]
    priority: Option<keel_core::Priority>,
}

fn chart_start() -> String {
    "@init".to_owned()
}

/// How long a start without a version reuses its read of the live workers: a burst of
/// starts reads the store once a second, and a worker's record is written only every
/// few seconds anyway.
const SERVED_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// The live workers a start without a version picks its version from, read at most once
/// per [`SERVED_FRESH`].
#[derive(Default)]
pub struct ServedVersions(std::sync::Mutex<Option<(std::time::Instant, Arc<Vec<WorkerRecord>>)>>);

impl ServedVersions {
    /// The newest version of `machine` a live worker serves in `ns`, else 1.
    async fn newest(&self, keel: &keel::Keel, ns: &str, machine: &str) -> Result<i32, StoreError> {
        let lock = || self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let fresh = lock()
            .as_ref()
            .filter(|(at, _)| at.elapsed() < SERVED_FRESH)
            .map(|(_, w)| Arc::clone(w));
        let live = if let Some(live) = fresh {
            live
        } else {
            let live = Arc::new(crate::operate::live_workers(keel, crate::commands::now()).await?);
            *lock() = Some((std::time::Instant::now(), Arc::clone(&live)));
            live
        };
        Ok(crate::commands::newest_served(&live, ns, machine).unwrap_or(1))
    }
}

/// Starts an instance: 201 with its id, or 200 with the existing one's.
pub async fn start_instance(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    Path(ns): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let b: StartBody = body(&read(bytes)?)?;
    if let Some(version) = b.version.filter(|v| *v < 1) {
        return Err(ApiError::bad(
            "version",
            format!(
                "version: {version} is not a version; versions start at 1 (leave it out for the newest one served)"
            ),
        ));
    }
    let version = match (&state.definitions, b.version) {
        (Some(defs), version) => {
            if !defs.has_machine(&b.machine) {
                return Err(unknown_machine(&b.machine));
            }
            // The machine is in the file, so it holds at least one version.
            let held = defs.versions(&b.machine);
            match version {
                None => held.last().map_or(1, |v| i32::try_from(*v).unwrap_or(i32::MAX)),
                Some(v) if u32::try_from(v).is_ok_and(|v| held.contains(&v)) => v,
                Some(v) => {
                    return Err(ApiError::bad(
                        "version",
                        format!(
                            "version: {} has no version {v} in the definitions file (it holds {held:?})",
                            b.machine,
                        ),
                    ));
                }
            }
        }
        (None, Some(version)) => version,
        // As `keel start` without `--version`: the newest version a live worker serves
        // here, so a start after a deploy runs the new code; 1 when none is live.
        (None, None) => state.served.newest(&state.keel, &ns, &b.machine).await?,
    };
    let context = b.context.unwrap_or_else(|| json!({}));
    if !context.is_object() {
        return Err(ApiError::bad(
            "context",
            "context: must be a JSON object such as {\"order\": 42}",
        ));
    }
    let mut new = NewInstance::new(MachineRef::new(&b.machine, version), &b.at)
        .namespace(&ns)
        .context(context);
    if let Some(key) = b.key {
        new = new.business_key(key);
    }
    if let Some(queue) = b.queue {
        new = new.queue(queue);
    }
    if let Some(priority) = b.priority {
        new = new.priority(priority);
    }
    Ok(match state.keel.start(new).await.map_err(|e| renamed(e, START_FIELDS))? {
        InsertOutcome::Inserted(id) => {
            (StatusCode::CREATED, Json(json!({ "id": id.0, "inserted": true, "version": version })))
                .into_response()
        }
        InsertOutcome::Existing(id) => {
            (StatusCode::OK, Json(json!({ "id": id.0, "inserted": false }))).into_response()
        }
    })
}

/// The instance's detail; its children in namespaces the token does not see are left out
/// and counted in `children_hidden`.
async fn detail(state: &AppState, ns: &str, id: InstanceId, grant: Option<&Grant>) -> ApiResult {
    instance_in(state, ns, id).await?;
    let mut d = state.keel.get(id).await?;
    let hidden = match grant.filter(|g| !g.sees_all()) {
        Some(grant) => {
            super::scope::hide_unseen_children(state.keel.store(), &mut d, |n| grant.sees(n))
                .await?
        }
        None => 0,
    };
    Ok(Json(json!({
        "instance": d.instance,
        "inbox": d.inbox,
        "timers": d.timers,
        "children": d.children,
        "children_hidden": hidden,
        "history": d.history,
    }))
    .into_response())
}

/// One instance with its inbox, timers, children and history.
pub async fn get_instance(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    Path((ns, id)): Path<(String, String)>,
) -> ApiResult {
    detail(&state, &ns, parse_id(&id)?, grant.as_ref().map(|Extension(g)| g)).await
}

/// The newest instance of a machine with a business key.
pub async fn get_by_key(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    Path((ns, machine, key)): Path<(String, String, String)>,
) -> ApiResult {
    let target =
        SignalTarget::Key { namespace: ns.clone(), machine: machine.clone(), key: key.clone() };
    let id = state.keel.lookup(target).await?.ok_or_else(|| {
        ApiError::not_found(format!(
            "no instance of machine {machine:?} with key {key:?} in namespace {ns:?}"
        ))
    })?;
    detail(&state, &ns, id, grant.as_ref().map(|Extension(g)| g)).await
}

/// `POST …/instances/{id}/cancel` (an empty body is allowed).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelBody {
    #[serde(default)]
    cascade: bool,
    reason: Option<String>,
}

/// Cancels an instance (and its descendants with `cascade`).
pub async fn cancel_instance(
    _: NoQuery,
    State(state): State<Arc<AppState>>,
    grant: Option<Extension<Grant>>,
    Path((ns, id)): Path<(String, String)>,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let id = parse_id(&id)?;
    let bytes = read(bytes)?;
    let b: CancelBody = if bytes.is_empty() { CancelBody::default() } else { body(&bytes)? };
    instance_in(&state, &ns, id).await?;
    let mut cancel =
        Cancel::new(id).reason(b.reason.unwrap_or_else(|| "cancelled over HTTP".into()));
    if b.cascade {
        if let Some(Extension(grant)) = grant.filter(|Extension(g)| !g.sees_all()) {
            cascade_within(&state, id, &grant).await?;
        }
        cancel = cancel.cascade();
    }
    let cancelled = state.keel.cancel(cancel).await?;
    // A cascade that stopped at the store's bound may leave live descendants running, as
    // `keel cancel --cascade` warns; `complete` says whether it may have.
    let complete = !(b.cascade && crate::commands::cascade_cut(&cancelled));
    let cancelled: Vec<i64> = cancelled.iter().map(|i| i.0).collect();
    Ok(Json(json!({ "cancelled": cancelled, "complete": complete })).into_response())
}

/// Most instances a cascading cancel by a token scoped to some namespaces reads to check
/// that every live descendant is in one of them.
const CASCADE_CHECK_MAX: usize = 1_000;

/// A cascading cancel reaches every live descendant the store's cascade walks (children
/// of ended ones too, down to its depth bound), whatever their namespace; a token scoped
/// to some namespaces may only start it when every live one is in those (403 naming
/// `cascade` otherwise, nothing cancelled). Ended descendants are never cancelled, so
/// their namespaces do not matter. The tree is read with bounded reads, as the cascade
/// walks it; one too large to check in [`CASCADE_CHECK_MAX`] reads is refused as well.
///
/// The check and the cancel are two steps: a descendant that starts a child in another
/// namespace in between (only a worker not scoped by a token can) has that child
/// cancelled too. The window is one request long and the child belongs to the tree the
/// caller may cancel; closing it would need the store's cancel to take a namespace scope.
async fn cascade_within(state: &AppState, id: InstanceId, grant: &Grant) -> Result<(), ApiError> {
    let refused = |why: String| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            Some("cascade"),
            format!(
                "cascade: {why}; cancel instance {id} without `cascade`, or with a token for every namespace (\"*\") (nothing was cancelled)"
            ),
        )
    };
    let mut level = vec![id];
    let mut reads = 0;
    for depth in 0..keel_core::limits::CANCEL_CASCADE_DEPTH_MAX {
        let mut next = Vec::new();
        for parent in level {
            reads += 1;
            if reads > CASCADE_CHECK_MAX {
                return Err(refused(format!(
                    "instance {id} has more descendants than this token's cancel checks ({CASCADE_CHECK_MAX})"
                )));
            }
            let detail = match state.keel.get(parent).await {
                Ok(detail) => detail,
                // Gone since it was listed: nothing below it to cancel.
                Err(e) if e.kind == ErrorKind::NotFound => continue,
                Err(e) => return Err(e.into()),
            };
            // An ended root is left as it is, descendants included.
            if depth == 0 && detail.instance.status.is_terminal() {
                return Ok(());
            }
            if detail.children.len() >= keel_core::limits::CHILDREN_LIST_MAX {
                return Err(refused(format!(
                    "instance {parent} has more children than one read lists ({})",
                    keel_core::limits::CHILDREN_LIST_MAX
                )));
            }
            // The cascade cancels only live descendants and walks on through ended ones, so
            // an ended child in another namespace is left as it is: only the live ones'
            // namespaces are read, and every child is walked.
            let live: Vec<InstanceId> =
                detail.children.iter().filter(|c| !c.status.is_terminal()).map(|c| c.id).collect();
            let (_, unseen) =
                super::scope::split_by_namespace(state.keel.store(), &live, |n| grant.sees(n))
                    .await?;
            if unseen.iter().any(|row| !row.status.is_terminal()) {
                return Err(refused(format!(
                    "a live descendant of instance {id} is in a namespace this token does not see"
                )));
            }
            next.extend(detail.children.iter().map(|c| c.id));
        }
        if next.is_empty() {
            break;
        }
        level = next;
    }
    Ok(())
}

/// Any other path.
pub async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint; see the README for the API")
}
