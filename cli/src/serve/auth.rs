//! Bearer tokens, each scoped to namespaces and to reading or operating.
//!
//! The tokens file (`keel serve --tokens tokens.toml`):
//!
//! ```toml
//! [[tokens]]
//! token = "a long random secret"
//! namespaces = ["billing"]   # "*" = every namespace
//! access = "operate"         # or "read"
//! ```
//!
//! A request outside a token's namespaces is answered 404, like a missing instance, so a
//! token cannot even learn what exists elsewhere. `/metrics`, `/health` and
//! `/v1/cluster/info` span every namespace and need a `"*"` token.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::AppState;
use super::api::ApiError;

/// Shortest secret accepted.
const TOKEN_BYTES_MIN: usize = 16;
/// Longest secret accepted: the dashboard keeps a token hex-encoded in a cookie and reads
/// back at most twice this many characters.
pub(super) const TOKEN_BYTES_MAX: usize = 1024;
/// Most tokens in a file.
const TOKENS_MAX: usize = 1000;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// Only reads.
    Read,
    /// Reads and writes.
    Operate,
}

/// One token.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    token: String,
    namespaces: Vec<String>,
    /// Optional only so that a missing value gets an error naming the accepted ones.
    access: Option<Access>,
}

impl Grant {
    /// Whether the token sees `ns`.
    pub fn sees(&self, ns: &str) -> bool {
        self.namespaces.iter().any(|n| n == "*" || n == ns)
    }

    /// What it may do.
    pub fn access(&self) -> Access {
        // `load` refuses a grant without one, so a loaded grant always has it.
        self.access.unwrap_or(Access::Read)
    }

    /// The namespaces it names (`"*"` = every one).
    pub fn namespaces(&self) -> &[String] {
        &self.namespaces
    }

    /// Whether it names every namespace (`"*"`).
    pub fn sees_all(&self) -> bool {
        self.namespaces.iter().any(|n| n == "*")
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<Grant>,
}

/// Reads and checks a tokens file.
pub fn load(path: &Path) -> anyhow::Result<Vec<Grant>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--tokens: cannot read {}", path.display()))?;
    let file: TokensFile =
        toml::from_str(&text).with_context(|| format!("--tokens: {}", path.display()))?;
    if file.tokens.is_empty() || file.tokens.len() > TOKENS_MAX {
        bail!("--tokens: {} must hold between 1 and {TOKENS_MAX} [[tokens]]", path.display());
    }
    for (i, grant) in file.tokens.iter().enumerate() {
        if grant.token.len() < TOKEN_BYTES_MIN {
            bail!(
                "--tokens: tokens[{i}].token is shorter than {TOKEN_BYTES_MIN} bytes; use a long random secret"
            );
        }
        if grant.token.len() > TOKEN_BYTES_MAX {
            bail!(
                "--tokens: tokens[{i}].token is longer than {TOKEN_BYTES_MAX} bytes; use a shorter random secret"
            );
        }
        if grant.namespaces.is_empty() {
            bail!(
                "--tokens: tokens[{i}].namespaces is empty; name the namespaces it may use, or \"*\""
            );
        }
        if grant.access.is_none() {
            bail!(
                "--tokens: tokens[{i}].access is missing; set access = \"read\" or access = \"operate\""
            );
        }
    }
    Ok(file.tokens)
}

/// Equal-length comparison that takes the same time wherever the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The grant of a presented token, if any.
pub(super) fn find<'a>(grants: &'a [Grant], presented: &str) -> Option<&'a Grant> {
    grants.iter().find(|g| same(g.token.as_bytes(), presented.as_bytes()))
}

/// Checks every request when tokens are configured, and hands the grant to handlers.
pub async fn check(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(grants) = &state.tokens else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let Some(grant) = presented.and_then(|p| find(grants, p)) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            Some("authorization"),
            "authorization: send `Authorization: Bearer <token>` with a token from the server's tokens file",
        )
        .into_response();
    };
    let path = request.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let write = !matches!(*request.method(), Method::GET | Method::HEAD);
    match segments.as_slice() {
        // The handlers see the namespace percent-decoded, so the check must too: a token
        // for `team a` reaches `/v1/namespaces/team%20a/…`, and one for a name holding
        // `%62` does not reach `b`.
        ["v1", "namespaces", ns, ..] => {
            let Ok(ns) = percent_encoding::percent_decode_str(ns).decode_utf8() else {
                return ApiError::bad(
                    "namespace",
                    "namespace: the path's namespace is not UTF-8 once percent-decoded; percent-encode the name's UTF-8 bytes",
                )
                .into_response();
            };
            if !grant.sees(&ns) {
                return ApiError::not_found("not found").into_response();
            }
        }
        ["v1", "worker", ..] => {}
        _ if !grant.sees_all() => return ApiError::not_found("not found").into_response(),
        _ => {}
    }
    if write && grant.access() == Access::Read {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            Some("authorization"),
            "authorization: this token may only read; use a token with access = \"operate\"",
        )
        .into_response();
    }
    request.extensions_mut().insert(grant.clone());
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"secret-secret-01", b"secret-secret-01"));
        assert!(!same(b"secret-secret-01", b"secret-secret-02"));
        assert!(!same(b"secret-secret-01", b"secret-secret-0"));
        assert!(!same(b"", b"x"));
    }

    fn load_text(text: &str) -> anyhow::Result<Vec<Grant>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tokens.toml");
        std::fs::write(&path, text)?;
        load(&path)
    }

    fn one_token(token: &str) -> String {
        format!("[[tokens]]\ntoken = \"{token}\"\nnamespaces = [\"*\"]\naccess = \"read\"\n")
    }

    #[test]
    fn tokens_longer_than_the_cookie_holds_are_refused() {
        let longest = "a".repeat(TOKEN_BYTES_MAX);
        assert_eq!(load_text(&one_token(&longest)).map(|g| g.len()).ok(), Some(1));
        let too_long = "a".repeat(TOKEN_BYTES_MAX + 1);
        let err = load_text(&one_token(&too_long)).err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "--tokens: tokens[0].token is longer than 1024 bytes; use a shorter random secret"
            )
        );
    }

    #[test]
    fn a_token_without_access_names_the_accepted_values() {
        let text = "[[tokens]]\ntoken = \"0123456789abcdef\"\nnamespaces = [\"*\"]\n";
        let err = load_text(text).err().map(|e| format!("{e:#}"));
        assert_eq!(
            err.as_deref(),
            Some(
                "--tokens: tokens[0].access is missing; set access = \"read\" or access = \"operate\""
            )
        );
        let wrong = text.to_owned() + "access = \"write\"\n";
        let err = load_text(&wrong).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(err.contains("`read`") && err.contains("`operate`"), "{err}");
    }
}
