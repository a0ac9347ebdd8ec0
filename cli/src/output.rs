//! What a command prints: a JSON document and the human rendering of the same data.

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde_json::Value;

use crate::exit::Code;

/// The result of one command.
#[derive(Debug)]
pub struct Report {
    /// The `--json` form: a stable document per command.
    pub json: Value,
    /// The human form.
    pub human: String,
    /// The exit code.
    pub code: Code,
}

impl Report {
    /// A successful report.
    pub fn ok(json: Value, human: impl Into<String>) -> Self {
        Report { json, human: human.into(), code: Code::Ok }
    }

    /// Prints the chosen form on stdout.
    pub fn print(&self, json: bool) {
        use std::io::Write as _;
        let text = if json {
            serde_json::to_string_pretty(&self.json).unwrap_or_default()
        } else {
            self.human.trim_end().to_owned()
        };
        // A closed pipe (`keel graph … | head`) is the reader's choice, not an error.
        let _ = writeln!(std::io::stdout(), "{text}");
    }
}

/// What a bulk command had already done when an error stopped it, attached to that error
/// (`error.context(PartlyDone { … })`): the message reads `"<done>, then failed: <error>"`
/// and the `--json` error body carries `json`'s fields next to `"error"`, so an operator
/// knows what was committed before re-running it.
#[derive(Debug, Clone)]
pub struct PartlyDone {
    /// What was done, e.g. `cancelled 2999 pending instance(s) of "order" in namespace "default"`.
    pub done: String,
    /// The same as JSON fields, e.g. `{"cancelled": 2999}`.
    pub json: Value,
}

impl std::fmt::Display for PartlyDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, then failed", self.done)
    }
}

impl PartlyDone {
    /// `error`, with what was done before it.
    pub fn wrap(error: impl Into<anyhow::Error>, done: String, json: Value) -> anyhow::Error {
        error.into().context(PartlyDone { done, json })
    }
}

/// Prints `warning: <text>` on stderr, whichever form `--json` chose for stdout: what a
/// user should know about a command that still succeeded (a command's `--json` report
/// carries the same as fields of its own).
pub fn warn(text: &str) {
    use std::io::Write as _;
    // A closed stderr leaves nobody to tell.
    let _ = writeln!(std::io::stderr(), "warning: {text}");
}

/// Prints `note: <text>` on stderr, whichever form `--json` chose for stdout: a choice a
/// command made for the user that they may want to make otherwise.
pub fn note(text: &str) {
    use std::io::Write as _;
    // A closed stderr leaves nobody to tell.
    let _ = writeln!(std::io::stderr(), "note: {text}");
}

/// Names or ids a human report lists before it counts the rest (`--json` carries them all).
pub const SHOWN_MAX: usize = 20;

/// The first [`SHOWN_MAX`] of `texts`, then `more(n)` for the `n` left out, if any; the
/// caller joins them with its own separator.
pub fn first_of(
    texts: impl ExactSizeIterator<Item = String>,
    more: impl FnOnce(usize) -> String,
) -> Vec<String> {
    let left_out = texts.len().saturating_sub(SHOWN_MAX);
    let mut shown: Vec<String> = texts.take(SHOWN_MAX).collect();
    if left_out > 0 {
        shown.push(more(left_out));
    }
    shown
}

/// The `--json` body of a failed command: `{"error": …}`, plus what a bulk command had
/// already done when it failed (see [`PartlyDone`]).
pub fn error_body(error: &anyhow::Error) -> Value {
    let mut body = serde_json::json!({ "error": format!("{error:#}") });
    if let (Some(partly), Some(fields)) = (error.downcast_ref::<PartlyDone>(), body.as_object_mut())
        && let Some(done) = partly.json.as_object()
    {
        for (key, value) in done {
            fields.entry(key.clone()).or_insert_with(|| value.clone());
        }
        fields.insert("complete".to_owned(), Value::Bool(false));
    }
    body
}

/// The `--json` body of a command line the argument parser refused: `{"error": …}` with
/// the parser's message, its `error: ` prefix dropped.
pub fn usage_error_body(message: &str) -> Value {
    let message = message.trim();
    serde_json::json!({ "error": message.strip_prefix("error: ").unwrap_or(message) })
}

/// A table with the given header, sized to the terminal when there is one.
pub fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(header.iter().copied());
    table
}

/// A millisecond timestamp as RFC 3339-like UTC text (`2026-11-23 04:18:52.123Z`).
pub fn time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// An age in milliseconds as a short human text (`3.2s`, `4m 10s`, `2h 5m`).
pub fn age(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{}m {}s", ms / 60_000, (ms % 60_000) / 1000)
    } else {
        format!("{}h {}m", ms / 3_600_000, (ms % 3_600_000) / 60_000)
    }
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(ms: i64, expected: &str) {
        assert_eq!(time(ms), expected);
    }

    #[test]
    fn times_read_as_utc_dates() {
        check(0, "1970-01-01 00:00:00.000Z");
        check(951_782_400_000, "2000-02-29 00:00:00.000Z");
        check(1_795_407_532_123, "2026-11-23 04:18:52.123Z");
    }

    #[test]
    fn a_partial_failure_says_what_was_done_in_text_and_json() {
        let error = PartlyDone::wrap(
            anyhow::anyhow!("database is locked"),
            "cancelled 2999 pending instance(s)".to_owned(),
            serde_json::json!({ "cancelled": 2999 }),
        );
        assert_eq!(
            format!("{error:#}"),
            "cancelled 2999 pending instance(s), then failed: database is locked"
        );
        let body = error_body(&error);
        assert_eq!(body["cancelled"], 2999);
        assert_eq!(body["complete"], false);
        assert!(body["error"].as_str().unwrap().ends_with("then failed: database is locked"));
        let plain = error_body(&anyhow::anyhow!("boom"));
        assert_eq!(plain, serde_json::json!({ "error": "boom" }));
    }

    #[test]
    fn ages_pick_a_readable_unit() {
        assert_eq!(age(3_200), "3.2s");
        assert_eq!(age(250_000), "4m 10s");
        assert_eq!(age(7_500_000), "2h 5m");
        assert_eq!(age(-5), "0.0s");
    }
}
