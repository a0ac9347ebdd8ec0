//! Requests other sites make through the operator's browser.
//!
//! A browser lets any page it shows send requests to `keel serve`, with the operator's
//! cookies and from the operator's own machine, so a loopback address or a cookie alone
//! does not tell an operator's action from a page's. Three rules close that:
//!
//! - a change (any method but GET and HEAD) the browser marks as sent by another site is
//!   refused: `Sec-Fetch-Site` other than `same-origin` or `none` (`cross-site`, or
//!   `same-site` for a sibling subdomain), or, from a browser that sends no
//!   `Sec-Fetch-Site`, an `Origin` whose host and port are not the request's `Host`. A
//!   request with neither header (curl, the SDKs, a worker) is not a browser's and passes
//!   as it is;
//! - without tokens the server listens on loopback only, and it answers only requests
//!   addressed to a loopback name, so a site whose name is made to resolve to 127.0.0.1
//!   (DNS rebinding) cannot read or change it either;
//! - both are checked before authentication, for the API, the worker protocol and the
//!   dashboard alike.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::api::ApiError;

/// Refuses (403) what another site sends through a browser and, without tokens, any
/// request addressed to a name that is not a loopback one.
pub async fn check(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let host = request_host(&request);
    let dashboard = request.uri().path() == "/" || request.uri().path().starts_with("/ui");
    if state.tokens.is_none()
        && let Some(host) = host.as_deref()
        && !loopback_host(host)
    {
        let message = format!(
            "host: without --tokens keel serve answers only requests addressed to a loopback name (localhost, 127.0.0.1 or [::1]), and this one is addressed to {host:?}; open it at http://127.0.0.1:<port>/, or start it with --tokens to serve other names"
        );
        return refuse(StatusCode::FORBIDDEN, "host", &message, dashboard);
    }
    if !matches!(*request.method(), Method::GET | Method::HEAD)
        && let Some((field, message)) = cross_site(request.headers(), host.as_deref())
    {
        return refuse(StatusCode::FORBIDDEN, field, &message, dashboard);
    }
    next.run(request).await
}

/// The address the request was sent to: its `Host` header, or the authority of an
/// absolute URI (HTTP/2).
fn request_host(request: &Request) -> Option<String> {
    request
        .headers()
        .get(header::HOST)
        // A Host that is not visible ASCII is not a loopback name.
        .map(|v| v.to_str().unwrap_or("?").to_owned())
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()))
}

/// Why a browser's change comes from another site (the header at fault and the message),
/// or `None` when it comes from the server's own pages or not from a browser.
fn cross_site(headers: &HeaderMap, host: Option<&str>) -> Option<(&'static str, String)> {
    // A browser that sends `Sec-Fetch-Site` says itself where the request comes from, and
    // that holds behind a proxy that rewrites `Host` or makes the browser send
    // `Origin: null`; `Origin` is compared with `Host` only for a browser that does not.
    match headers.get("sec-fetch-site").map(|v| v.to_str().unwrap_or("?")) {
        Some("same-origin" | "none") => return None,
        Some(site) => {
            return Some((
                "sec-fetch-site",
                format!(
                    "sec-fetch-site: the browser marks this request as sent by another site (`Sec-Fetch-Site: {site}`), and keel serve takes no changes from other sites; use the dashboard at the server's own address, or send the request from a script or worker, which sends no such header"
                ),
            ));
        }
        None => {}
    }
    let origin = headers.get(header::ORIGIN).map(|v| v.to_str().unwrap_or("?"))?;
    if host.is_some_and(|host| same_origin(origin, host)) {
        return None;
    }
    Some((
        "origin",
        format!(
            "origin: this request comes from a page of {origin:?} (its `Origin` header), not from the server's own address {:?}, and keel serve takes no changes from other sites; use the dashboard at the server's own address, and send no `Origin` header from a script",
            host.unwrap_or_default()
        ),
    ))
}

fn refuse(status: StatusCode, field: &str, message: &str, dashboard: bool) -> Response {
    if dashboard {
        let mut response = super::ui::refused_page(message);
        *response.status_mut() = status;
        response
    } else {
        ApiError::new(status, Some(field), message).into_response()
    }
}

/// An authority's host and its port when it names one (`[::1]:7878` → `[::1]`, `7878`).
fn split_port(authority: &str) -> (&str, Option<&str>) {
    let cut = match authority.rfind(':') {
        // An IPv6 literal's own colons are inside its brackets.
        Some(i) if !authority[i..].contains(']') => i,
        _ => return (authority, None),
    };
    let (host, port) = (&authority[..cut], &authority[cut + 1..]);
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return (authority, None);
    }
    (host, Some(port))
}

/// Whether a browser's `Origin` (`scheme://host[:port]`) names the host and port the
/// request was sent to. A port left out is the scheme's default on both sides; the
/// scheme itself is not compared, since a proxy in front may end TLS. `null` (an opaque
/// origin: a sandboxed frame, a `data:` page) is never the same.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => "80",
        "https" => "443",
        _ => return false,
    };
    if authority.is_empty() || authority.contains(['/', '@', '?', '#']) {
        return false;
    }
    let (origin_host, origin_port) = split_port(authority);
    let (host_name, host_port) = split_port(host);
    origin_host.eq_ignore_ascii_case(host_name)
        && origin_port.unwrap_or(default) == host_port.unwrap_or(default)
}

/// Whether a `Host` names this machine's loopback: `localhost` (and its subdomains, which
/// browsers resolve to loopback themselves), 127.0.0.0/8 or `[::1]`.
fn loopback_host(host: &str) -> bool {
    let name = split_port(host).0.to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    let literal = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')).unwrap_or(&name);
    literal.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_origin_is_the_same_only_for_the_same_host_and_port() {
        assert!(same_origin("http://127.0.0.1:7878", "127.0.0.1:7878"));
        assert!(same_origin("http://LOCALHOST:7878", "localhost:7878"));
        assert!(same_origin("http://[::1]:7878", "[::1]:7878"));
        assert!(same_origin("https://keel.example", "keel.example"));
        assert!(same_origin("https://keel.example", "keel.example:443"));
        assert!(same_origin("http://keel.example:80", "keel.example"));
        assert!(!same_origin("http://127.0.0.1:7879", "127.0.0.1:7878"), "another port");
        assert!(!same_origin("http://evil.example", "127.0.0.1:7878"));
        assert!(!same_origin("http://a.keel.example", "keel.example"), "a sibling");
        assert!(!same_origin("null", "127.0.0.1:7878"), "an opaque origin");
        assert!(!same_origin("http://keel.example", "keel.example:7878"));
        assert!(!same_origin("ftp://keel.example", "keel.example"));
        assert!(!same_origin("http://x@keel.example", "keel.example"));
    }

    #[test]
    fn loopback_names_are_localhost_127_and_v6_one() {
        for host in ["localhost", "localhost:7878", "app.localhost:1", "127.0.0.1:7878"] {
            assert!(loopback_host(host), "{host}");
        }
        for host in ["127.1.2.3", "[::1]:7878", "[::1]", "LocalHost:80"] {
            assert!(loopback_host(host), "{host}");
        }
        for host in ["evil.example:7878", "localhost.evil.example", "0.0.0.0:7878", "10.0.0.1"] {
            assert!(!loopback_host(host), "{host}");
        }
        assert!(!loopback_host("[::2]:7878"));
    }
}
