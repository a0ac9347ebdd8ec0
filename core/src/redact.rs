//! Connection URLs without their passwords, for messages and logs.

/// The URL without its password, for messages and logs: the password of its user part
/// becomes `***`, and so does the value of every `password=` or `pass=` pair (query
/// parameters that libpq, tokio-postgres and redis accept).
///
/// The scheme ends at the first `:`. Only when `//` follows it is there a user part to
/// tell apart: it ends at the last `@`, and one that holds `/`, `?`, `#`, `=` or a second
/// `@` (an unencoded password) cannot be told apart from what follows it, so everything
/// before the host is hidden then. A user part without `:` is a user name and is kept.
/// Text without `//` after its scheme (a mistyped `postgres:/u:p@h`) has no user part to
/// tell apart, so everything between its scheme and its last `@` is hidden.
#[must_use]
pub fn redact_url(url: &str) -> String {
    let hidden = hide_password_pairs(url);
    if !url.contains('@') {
        return hidden;
    }
    let scheme = hidden.split_once(':').filter(|(scheme, _)| {
        !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    });
    let Some((scheme, rest)) = scheme.and_then(|(s, rest)| Some((s, rest.strip_prefix("//")?)))
    else {
        let Some(at) = hidden.rfind('@') else { return hidden };
        let host = &hidden[at + 1..];
        return match scheme {
            Some((scheme, _)) => format!("{scheme}:***@{host}"),
            None => format!("***@{host}"),
        };
    };
    let Some(at) = rest.rfind('@') else {
        // Every `@` went into a hidden value: where the user part ends cannot be told.
        return format!("{scheme}://***");
    };
    let (credentials, host) = (&rest[..at], &rest[at + 1..]);
    if credentials.contains(['/', '?', '#', '@', '=']) {
        return format!("{scheme}://***@{host}");
    }
    match credentials.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => hidden,
    }
}

/// `text` with the value of every `pass=` or `password=` pair replaced by `***` (and of
/// every key that ends in one of them, such as libpq's `sslpassword`): in a URL's query
/// (`?password=…`, `&pass=…`) or a `key=value` connection string (`password = '…'`).
fn hide_password_pairs(text: &str) -> String {
    const KEY: &str = "pass";
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some(found) = lower[from..].find(KEY) {
        let key = from + found;
        from = key + KEY.len();
        if lower[from..].starts_with("word") {
            from += "word".len();
        }
        let Some(value) = text[from..].trim_start().strip_prefix('=') else { continue };
        let value = value.trim_start();
        let value_at = text.len() - value.len();
        let len = if let Some(quoted) = value.strip_prefix('\'') {
            // A quoted value runs to its closing quote; `\` escapes the next character.
            let mut escaped = false;
            quoted
                .char_indices()
                .find(|&(_, c)| {
                    let close = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    close
                })
                .map_or(value.len(), |(i, _)| i + 2)
        } else {
            value
                .find(|c: char| matches!(c, '&' | '#' | ';') || c.is_whitespace())
                .unwrap_or(value.len())
        };
        out.push_str(&text[copied..value_at]);
        out.push_str("***");
        copied = value_at + len;
        from = copied;
    }
    out.push_str(&text[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url as redact;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(redact("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        // A password given as a query parameter, alone or among others.
        assert_eq!(redact("postgres://u@h/db?password=secret"), "postgres://u@h/db?password=***");
        assert_eq!(
            redact("postgres://u@h/db?sslmode=disable&PASSWORD=secret&application_name=a"),
            "postgres://u@h/db?sslmode=disable&PASSWORD=***&application_name=a"
        );
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=1&pass=s3cret"),
            "redis+unix:///run/redis.sock?db=1&pass=***"
        );
        // An unencoded `/`, `?`, `@` or `=` in the password: the user part is hidden whole.
        assert_eq!(redact("postgres://u:se/cret@h/db"), "postgres://***@h/db");
        assert_eq!(redact("redis://app:pa/ss@cache:6379/0"), "redis://***@cache:6379/0");
        assert_eq!(
            redact("postgres://u:se?cret@h/db?sslmode=disable"),
            "postgres://***@h/db?sslmode=disable"
        );
        assert_eq!(redact("postgres://u:se@cret@h/db"), "postgres://***@h/db");
        assert_eq!(redact("postgres://u:mypassword=secret@h/db"), "postgres://***");
        // An `@` inside a hidden query password leaves no piece of it behind.
        assert_eq!(redact("postgres://u@h/db?password=se@cret"), "postgres://u@h/db?password=***");
        // A key/value connection string (refused, but quoted in the error).
        assert_eq!(
            redact("host=h password = 'se cr\\'et' dbname=d"),
            "host=h password = *** dbname=d"
        );
        // Without `//` after the scheme there is no user part to find: all before the last
        // `@` is hidden, even when `://` comes later in the text.
        assert_eq!(redact("postgres:/keel:secret@db/keel"), "postgres:***@db/keel");
        assert_eq!(redact("redis:/app:secret@cache"), "redis:***@cache");
        assert_eq!(redact("postgresql:keel:secret@db"), "postgresql:***@db");
        assert_eq!(
            redact("postgres:/u:s3cret@db/x?sslrootcert=https://c"),
            "postgres:***@db/x?sslrootcert=https://c"
        );
        assert_eq!(redact("postgres:/u:s3cret@db/x?o=a://b@c"), "postgres:***@c");
        assert_eq!(redact("keel secret@db"), "***@db");
        assert_eq!(redact("sqlite:keel.db"), "sqlite:keel.db");
        assert_eq!(redact("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
        assert_eq!(redact("not a url"), "not a url");
        for url in [
            "postgres:/keel:secret@db/keel",
            "postgresql:keel:se@cret@db",
            "postgres:u:secret@h/db?password=secret",
            "postgres:/u:secret@db/x?sslrootcert=https://c",
            "postgres:/u:secret@db/x?o=a://b@c",
            "postgres://u:secret@h/db",
            "postgres://u@h/db?password=secret",
            "postgres://u@h/db?sslmode=disable&password=secret",
            "postgres://u:se/cret@h/db",
            "postgres://u:secret?@h/db",
            "postgres://u:s@ecret@h/db?x=1",
            "postgres://u@h/db?sslpassword=secret",
            "postgres://u:secret@h/db?application_name=a@b",
            "redis://app:pa/secret@cache:6379/0",
            "redis:/app:secret@cache",
            "rediss://:secret@cache/0?pass=secret",
        ] {
            let shown = redact(url);
            assert!(!shown.contains("secret") && !shown.contains("ecret"), "{url} -> {shown}");
        }
    }
}
