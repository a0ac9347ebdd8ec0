//! The web dashboard `keel serve` answers under `/ui` (and `/` sends there): server-rendered HTML
//! pages (overview, instances, an instance with its chart drawn, dead letters) with a
//! stylesheet and one small script embedded in the binary — no CDN, no build step.
//!
//! Authentication is the API's tokens. A browser cannot send a bearer header on a link,
//! so it presents the token once — the login form, or `?token=` on any dashboard URL —
//! and gets it back as an `HttpOnly`, `SameSite=Strict` cookie scoped to `/ui`; the
//! `Authorization: Bearer` header is accepted too. Namespaces are checked on every page
//! and fragment exactly as on the API: one the token may not see is a 404.
//! Writes (retry, purge, pause, resume) are form POSTs that need an `operate` token; the
//! strict same-site cookie keeps other sites from posting them with the operator's cookie,
//! and the server refuses any change a browser marks as sent by another site (`site`).

mod charts;
mod html;
mod pages;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{any, get, post};

use super::AppState;
use super::auth::{Access, Grant};

/// The cookie that carries a browser's token (hex-encoded).
const COOKIE: &str = "keel_token";

/// Who is looking: everyone when the server has no tokens, else one token's grant.
#[derive(Clone)]
pub struct Viewer {
    grant: Option<Grant>,
}

impl Viewer {
    /// Whether the viewer sees namespace `ns`.
    pub fn sees(&self, ns: &str) -> bool {
        self.grant.as_ref().is_none_or(|g| g.sees(ns))
    }

    /// Whether the viewer sees every namespace (no tokens, or a `"*"` token).
    pub fn sees_all(&self) -> bool {
        self.grant.as_ref().is_none_or(Grant::sees_all)
    }

    /// Whether the viewer may retry, purge, pause and resume.
    pub fn operates(&self) -> bool {
        self.grant.as_ref().is_none_or(|g| g.access() == Access::Operate)
    }

    /// The namespace a viewer lands in: the first one its token names, or the server's.
    fn home<'a>(&'a self, server: &'a str) -> &'a str {
        self.grant
            .as_ref()
            .and_then(|g| g.namespaces().iter().find(|n| *n != "*"))
            .map_or(server, String::as_str)
    }

    /// The namespaces to offer in the switcher; `None` when any may be typed in.
    fn namespaces(&self) -> Option<&[String]> {
        self.grant.as_ref().map(Grant::namespaces).filter(|ns| !ns.iter().any(|n| n == "*"))
    }
}

/// The dashboard's routes, with their own authentication layer (cookies as well as
/// bearer headers); merged into the API router.
pub fn router(state: Arc<AppState>) -> Router<Arc<AppState>> {
    let scoped = Router::new()
        .route("/", get(pages::overview))
        .route("/fragments/overview", get(pages::overview_fragment))
        .route("/instances", get(pages::instances))
        .route("/instances/{id}", get(pages::instance))
        .route("/instances/{id}/fragment", get(pages::instance_fragment))
        .route("/dead-letters", get(pages::dead_letters))
        .route("/dead-letters/retry", post(pages::retry_selected))
        .route("/dead-letters/retry-machine", post(pages::retry_machine))
        .route("/dead-letters/purge", post(pages::purge))
        .route("/dead-letters/{id}", get(pages::dead_letter))
        .route("/dead-letters/{id}/retry", post(pages::retry_one))
        .route("/queues/{queue}/pause", post(pages::pause))
        .route("/queues/{queue}/resume", post(pages::resume))
        .route_layer(from_fn_with_state(Arc::clone(&state), scope))
        .fallback(unknown);
    Router::new()
        .route("/ui", get(home))
        .route("/ui/", get(home))
        .route("/ui/login", get(pages::login_form).post(pages::login))
        .route("/ui/logout", post(pages::logout))
        .route("/ui/assets/style.css", get(style))
        .route("/ui/assets/live.js", get(script))
        .route("/ui/ns/{ns}/", get(without_slash))
        .nest("/ui/ns/{ns}", scoped)
        // A mistyped dashboard address is the dashboard's own "not found" page, for a
        // signed-in browser too (the API's answers are JSON and want a bearer header).
        .route("/ui/{*rest}", any(unknown))
        .layer(from_fn_with_state(state, authenticate))
        // Outermost, so sign-in redirects and refusals carry them too.
        .layer(from_fn(no_framing))
        // Outside authentication: the cookie is scoped to `/ui`, so a browser never sends
        // it here, and `/` only hands over to `/ui`, `?token=` included.
        .route("/", get(root))
}

/// No other site may show a dashboard page in a frame: a framed page's buttons post to
/// its own origin, so a click lured through an overlay would pause or retry for real.
async fn no_framing(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("frame-ancestors 'none'"),
    );
    response
}

/// `/` is the dashboard at `/ui`, with the same query (`/?token=…` signs in there).
async fn root(uri: axum::http::Uri) -> Response {
    match uri.query() {
        Some(query) => Redirect::to(&format!("/ui?{query}")).into_response(),
        None => Redirect::to("/ui").into_response(),
    }
}

/// The page of a request refused before it reached the dashboard, with the reason.
pub(super) fn refused_page(message: &str) -> Response {
    let body = format!(
        "<h1>Refused</h1><div class=\"error\">{}</div><p><a href=\"/ui\">Open the dashboard</a></p>",
        html::esc(message)
    );
    html::page("Refused", None, &Viewer { grant: None }, &body).into_response()
}

/// An address under `/ui` that is no page.
async fn unknown(request: Request) -> Response {
    pages::not_found(request.extensions().get::<Viewer>())
}

/// `/ui/ns/{ns}/` is the overview at `/ui/ns/{ns}`.
async fn without_slash(Path(ns): Path<String>, request: Request) -> Response {
    match request.extensions().get::<Viewer>() {
        Some(viewer) if viewer.sees(&ns) => Redirect::to(&html::ns_url(&ns, "")).into_response(),
        viewer => pages::not_found(viewer),
    }
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", include_str!("assets/style.css"))
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", include_str!("assets/live.js"))
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    let headers = [(header::CONTENT_TYPE, kind), (header::CACHE_CONTROL, "max-age=300")];
    (headers, body).into_response()
}

/// `/ui`: the overview of the viewer's namespace.
async fn home(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let viewer = request.extensions().get::<Viewer>().cloned();
    match viewer {
        Some(v) => Redirect::to(&html::ns_url(v.home(&state.namespace), "")).into_response(),
        None => Redirect::to("/ui/login").into_response(),
    }
}

/// Finds the viewer: no tokens = everyone; else `?token=` (which sets the cookie and
/// redirects to the same page without it), the cookie, or a bearer header. Without a
/// valid token a page redirects to the login form and anything else gets 401.
async fn authenticate(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(grants) = &state.tokens else {
        request.extensions_mut().insert(Viewer { grant: None });
        return next.run(request).await;
    };
    let path = request.uri().path().to_owned();
    let public = path == "/ui/login" || path.starts_with("/ui/assets/");
    if let Some(presented) = query_token(request.uri().query()) {
        return match super::auth::find(grants, &presented) {
            Some(_) => {
                let rest = query_without_token(request.uri().query());
                let target = if rest.is_empty() { path } else { format!("{path}?{rest}") };
                with_cookie(Redirect::to(&target).into_response(), &presented)
            }
            None => pages::login_page(Some("token: this token is not in the server's tokens file"))
                .into_response_with(StatusCode::UNAUTHORIZED),
        };
    }
    let presented = cookie_token(request.headers()).or_else(|| {
        request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned)
    });
    match presented.as_deref().and_then(|p| super::auth::find(grants, p)) {
        Some(grant) => {
            request.extensions_mut().insert(Viewer { grant: Some(grant.clone()) });
            next.run(request).await
        }
        None if public => next.run(request).await,
        None if request.method() == Method::GET => Redirect::to("/ui/login").into_response(),
        None => (StatusCode::UNAUTHORIZED, "sign in at /ui/login with a token").into_response(),
    }
}

/// The namespace of `/ui/ns/{ns}/…` must be one the viewer sees (404 otherwise, like the
/// API), and a POST needs an `operate` token (403).
async fn scope(
    Path(params): Path<BTreeMap<String, String>>,
    request: Request,
    next: Next,
) -> Response {
    let viewer = request.extensions().get::<Viewer>().cloned();
    let ns = params.get("ns").map_or("", String::as_str);
    let Some(viewer) = viewer.filter(|v| v.sees(ns)) else {
        return pages::not_found(None);
    };
    if request.method() != Method::GET && !viewer.operates() {
        return html::page(
            "Not allowed",
            None,
            &viewer,
            "<div class=\"error\">authorization: this token may only read; sign in with a token whose access is \"operate\".</div>",
        )
        .into_response_with(StatusCode::FORBIDDEN);
    }
    next.run(request).await
}

fn query_token(query: Option<&str>) -> Option<String> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query?).ok()?;
    pairs.into_iter().find(|(k, _)| k == "token").map(|(_, v)| v)
}

fn query_without_token(query: Option<&str>) -> String {
    let pairs: Vec<(String, String)> =
        query.and_then(|q| serde_urlencoded::from_str(q).ok()).unwrap_or_default();
    let kept: Vec<(String, String)> = pairs.into_iter().filter(|(k, _)| k != "token").collect();
    serde_urlencoded::to_string(kept).unwrap_or_default()
}

fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .and_then(|(_, value)| unhex(value))
}

/// Adds the token cookie to a response.
fn with_cookie(mut response: Response, token: &str) -> Response {
    let cookie = format!("{COOKIE}={}; Path=/ui; HttpOnly; SameSite=Strict", hex(token));
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().append(header::SET_COOKIE, value);
    }
    response
}

fn hex(text: &str) -> String {
    text.bytes().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

fn unhex(text: &str) -> Option<String> {
    if !text.len().is_multiple_of(2) || text.len() > 2 * super::auth::TOKEN_BYTES_MAX {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// A response with a status other than 200.
trait WithStatus {
    fn into_response_with(self, status: StatusCode) -> Response;
}

impl<T: IntoResponse> WithStatus for T {
    fn into_response_with(self, status: StatusCode) -> Response {
        let mut response = self.into_response();
        *response.status_mut() = status;
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_survive_the_cookie_encoding() {
        for token in ["plain-token-0123", "with; semicolons, and spaces=", "ünïcode-tøken"] {
            assert_eq!(unhex(&hex(token)).as_deref(), Some(token));
        }
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("abc"), None);
    }

    #[test]
    fn the_token_leaves_the_query_and_the_rest_stays() {
        assert_eq!(query_token(Some("a=1&token=s%20t")), Some("s t".to_owned()));
        assert_eq!(query_without_token(Some("a=1&token=secret&b=2")), "a=1&b=2");
        assert_eq!(query_token(Some("a=1")), None);
    }
}
