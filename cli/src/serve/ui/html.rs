//! Small HTML helpers: escaping, URLs, the page frame.

use std::fmt::Write as _;

use axum::response::Html;

use super::Viewer;

/// Text made safe for element content and quoted attributes.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A path segment percent-encoded.
pub fn seg(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// `/ui/ns/<ns><rest>`.
pub fn ns_url(ns: &str, rest: &str) -> String {
    format!("/ui/ns/{}{rest}", seg(ns))
}

/// A query string from pairs, leaving out empty values.
pub fn query(pairs: &[(&str, &str)]) -> String {
    let kept: Vec<(&str, &str)> = pairs.iter().copied().filter(|(_, v)| !v.is_empty()).collect();
    if kept.is_empty() {
        String::new()
    } else {
        format!("?{}", serde_urlencoded::to_string(kept).unwrap_or_default())
    }
}

/// Pretty JSON, escaped.
pub fn json(value: &serde_json::Value) -> String {
    esc(&serde_json::to_string_pretty(value).unwrap_or_default())
}

/// A status badge.
pub fn badge(text: &str) -> String {
    format!("<span class=\"badge {}\">{}</span>", esc(text), esc(text))
}

/// The page frame: header with navigation and the namespace switcher, then `body`.
pub fn page(title: &str, ns: Option<&str>, viewer: &Viewer, body: &str) -> Html<String> {
    let mut nav = String::new();
    let mut switcher = String::new();
    if let Some(ns) = ns {
        let _ = write!(
            nav,
            "<nav><a href=\"{}\">Overview</a><a href=\"{}\">Instances</a><a href=\"{}\">Dead letters</a></nav>",
            esc(&ns_url(ns, "")),
            esc(&ns_url(ns, "/instances")),
            esc(&ns_url(ns, "/dead-letters")),
        );
        switcher = match viewer.namespaces() {
            Some(list) => {
                let options = list.iter().fold(String::new(), |mut out, n| {
                    let selected = if n == ns { " selected" } else { "" };
                    let _ = write!(out, "<option value=\"{0}\"{selected}>{0}</option>", esc(n));
                    out
                });
                format!(
                    "<form class=\"ns\" method=\"get\" action=\"/ui\" onchange=\"location.href='/ui/ns/'+encodeURIComponent(this.ns.value)\"><label>namespace <select name=\"ns\">{options}</select></label></form>"
                )
            }
            None => format!(
                "<form class=\"ns\" onsubmit=\"location.href='/ui/ns/'+encodeURIComponent(this.ns.value);return false\"><label>namespace <input name=\"ns\" value=\"{}\"></label></form>",
                esc(ns)
            ),
        };
    }
    let logout = if viewer.grant.is_some() {
        "<form class=\"inline\" method=\"post\" action=\"/ui/logout\"><button>Sign out</button></form>"
    } else {
        ""
    };
    Html(format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>{} · Keel</title><link rel=\"stylesheet\" href=\"/ui/assets/style.css\"></head><body><header><a class=\"brand\" href=\"/ui\">Keel</a>{nav}{switcher}{logout}</header><main>{body}</main><script src=\"/ui/assets/live.js\"></script></body></html>",
        esc(title)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_and_urls_are_escaped() {
        assert_eq!(esc("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
        assert_eq!(query(&[("machine", "m&x"), ("state", "")]), "?machine=m%26x");
    }
}
