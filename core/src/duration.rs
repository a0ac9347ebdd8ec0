//! Human-readable durations: `"30 seconds"`, `"5 minutes"`, `"500ms"`, `"7d"`.
//!
//! Configuration files write durations as a whole number followed by a unit.
//! [`parse`] turns such a string into a [`std::time::Duration`]; [`format()`] writes the
//! canonical form back (the largest unit that represents the value exactly), so a parsed
//! and re-serialized config reads the way a person would have written it.
//!
//! Only whole numbers are accepted: `"1.5 hours"` is rejected with a hint to use
//! `"90 minutes"`, because a fraction of a unit invites rounding surprises.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::duration;
//!
//! assert_eq!(duration::parse("5 minutes"), Ok(Duration::from_secs(300)));
//! assert_eq!(duration::parse("500ms"), Ok(Duration::from_millis(500)));
//! assert_eq!(duration::format(Duration::from_secs(3600)), "1 hour");
//! ```

use std::fmt;
use std::time::Duration;

/// The accepted units, listed in every error so a user can fix the input without the docs.
const ACCEPTED_UNITS: &str =
    "milliseconds (ms), seconds (s), minutes (m), hours (h), days (d), weeks (w)";

/// One unit: its length in milliseconds, its canonical singular and plural names, and every
/// spelling we accept. Ordered from largest to smallest, which [`format`] relies on.
struct Unit {
    millis: u64,
    singular: &'static str,
    plural: &'static str,
    spellings: &'static [&'static str],
}

const UNITS: &[Unit] = &[
    Unit {
        millis: 7 * 24 * 60 * 60 * 1000,
        singular: "week",
        plural: "weeks",
        spellings: &["w", "wk", "wks", "week", "weeks"],
    },
    Unit {
        millis: 24 * 60 * 60 * 1000,
        singular: "day",
        plural: "days",
        spellings: &["d", "day", "days"],
    },
    Unit {
        millis: 60 * 60 * 1000,
        singular: "hour",
        plural: "hours",
        spellings: &["h", "hr", "hrs", "hour", "hours"],
    },
    Unit {
        millis: 60 * 1000,
        singular: "minute",
        plural: "minutes",
        spellings: &["m", "min", "mins", "minute", "minutes"],
    },
    Unit {
        millis: 1000,
        singular: "second",
        plural: "seconds",
        spellings: &["s", "sec", "secs", "second", "seconds"],
    },
    Unit {
        millis: 1,
        singular: "millisecond",
        plural: "milliseconds",
        spellings: &["ms", "msec", "msecs", "millisecond", "milliseconds"],
    },
];

/// A duration string that could not be parsed. The message quotes the input and says how
/// to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {kind}")]
pub struct DurationError {
    /// The input exactly as given.
    pub input: String,
    /// What was wrong with it.
    pub kind: DurationErrorKind,
}

/// Why a duration string was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DurationErrorKind {
    /// The input was empty or only whitespace.
    Empty,
    /// The input started with a minus sign.
    Negative,
    /// The input did not start with a whole number.
    NotANumber,
    /// The number had a fractional part (`"1.5 hours"`).
    Fractional,
    /// A number without a unit (`"30"`); we do not guess whether seconds or milliseconds
    /// were meant.
    MissingUnit,
    /// The unit is not one we know.
    UnknownUnit(String),
    /// The value does not fit in a [`Duration`].
    TooLarge,
}

impl fmt::Display for DurationErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(
                f,
                "expected a whole number followed by a unit, e.g. \"30 seconds\" or \"500ms\""
            ),
            Self::Negative => write!(f, "durations must not be negative"),
            Self::NotANumber => write!(
                f,
                "expected a whole number before the unit, e.g. \"30 seconds\" or \"500ms\""
            ),
            Self::Fractional => write!(
                f,
                "fractions are not accepted; use a smaller unit, e.g. \"90 minutes\" instead of \"1.5 hours\""
            ),
            Self::MissingUnit => write!(f, "missing unit; accepted units: {ACCEPTED_UNITS}"),
            Self::UnknownUnit(unit) => {
                write!(f, "unknown unit {unit:?}; accepted units: {ACCEPTED_UNITS}")
            }
            Self::TooLarge => write!(f, "too large to represent"),
        }
    }
}

/// Parses a human duration such as `"30 seconds"`, `"1 hour"`, `"500ms"` or `"7d"`.
///
/// The grammar is: optional whitespace, a whole non-negative number, optional whitespace,
/// a unit (case-insensitive, singular or plural, or its short form), optional whitespace.
pub fn parse(input: &str) -> Result<Duration, DurationError> {
    parse_inner(input).map_err(|kind| DurationError { input: input.to_owned(), kind })
}

fn parse_inner(input: &str) -> Result<Duration, DurationErrorKind> {
    let trimmed = input.trim();
    if trimmed.is_empty() {
        return Err(DurationErrorKind::Empty);
    }
    if trimmed.starts_with('-') {
        return Err(DurationErrorKind::Negative);
    }
    let digits_end = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, rest) = trimmed.split_at(digits_end);
    if digits.is_empty() {
        return Err(DurationErrorKind::NotANumber);
    }
    if rest.starts_with(['.', ',']) {
        return Err(DurationErrorKind::Fractional);
    }
    // A digit string can only fail to parse by overflowing u64.
    let amount: u64 = digits.parse().map_err(|_| DurationErrorKind::TooLarge)?;
    let unit_text = rest.trim();
    if unit_text.is_empty() {
        return Err(DurationErrorKind::MissingUnit);
    }
    let lowered = unit_text.to_ascii_lowercase();
    let unit = UNITS
        .iter()
        .find(|unit| unit.spellings.contains(&lowered.as_str()))
        .ok_or_else(|| DurationErrorKind::UnknownUnit(unit_text.to_owned()))?;
    let millis = amount.checked_mul(unit.millis).ok_or(DurationErrorKind::TooLarge)?;
    Ok(Duration::from_millis(millis))
}

/// Writes `duration` in its canonical human form: the largest unit that represents it
/// exactly, pluralized (`"1 hour"`, `"90 minutes"`, `"0 seconds"`).
///
/// Precision is whole milliseconds, the finest unit [`parse`] accepts; a sub-millisecond
/// remainder is dropped. [`serde_human`] refuses such values instead of dropping them.
pub fn format(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis == 0 {
        return "0 seconds".to_owned();
    }
    let unit = UNITS
        .iter()
        .find(|unit| millis.is_multiple_of(u128::from(unit.millis)))
        .unwrap_or(&UNITS[UNITS.len() - 1]);
    let amount = millis / u128::from(unit.millis);
    let name = if amount == 1 { unit.singular } else { unit.plural };
    format!("{amount} {name}")
}

/// Serde support: `#[serde(with = "keel_core::duration::serde_human")]` on a `Duration`
/// field, or `serde_human::option` on an `Option<Duration>` field.
///
/// Deserializes from a human string (see [`parse`]); serializes to the canonical string
/// (see [`format()`]). Serializing a duration with a sub-millisecond part is an error rather
/// than a silent rounding.
pub mod serde_human {
    use std::fmt;
    use std::time::Duration;

    use serde::de::{self, Deserializer, Visitor};
    use serde::ser::{self, Serializer};

    /// Serializes a duration as its canonical human string.
    pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        if !duration.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ser::Error::custom(format!(
                "duration {duration:?} has a sub-millisecond part, which the human format cannot express"
            )));
        }
        serializer.serialize_str(&super::format(*duration))
    }

    /// Deserializes a duration from a human string such as `"30 seconds"`.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_str(HumanVisitor)
    }

    struct HumanVisitor;

    impl Visitor<'_> for HumanVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration string such as \"30 seconds\" or \"500ms\"")
        }

        fn visit_str<E: de::Error>(self, value: &str) -> Result<Duration, E> {
            super::parse(value).map_err(E::custom)
        }
    }

    /// The same format for `Option<Duration>` fields; pair it with `#[serde(default)]` so a
    /// missing key means `None`.
    pub mod option {
        use std::time::Duration;

        use serde::{Deserialize, Deserializer, Serializer};

        /// Serializes `Some(duration)` as its human string and `None` as none.
        pub fn serialize<S: Serializer>(
            duration: &Option<Duration>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            match duration {
                Some(duration) => super::serialize(duration, serializer),
                None => serializer.serialize_none(),
            }
        }

        /// Deserializes an optional human duration string.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Option<Duration>, D::Error> {
            #[derive(Deserialize)]
            struct Human(#[serde(with = "super")] Duration);
            Ok(Option::<Human>::deserialize(deserializer)?.map(|Human(duration)| duration))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNITS_MSG: &str = "accepted units: milliseconds (ms), seconds (s), minutes (m), hours (h), days (d), weeks (w)";

    /// One parse case: the input and either the expected duration or the exact error text.
    fn check(input: &str, expected: Result<Duration, &str>) {
        let actual = parse(input).map_err(|error| error.to_string());
        let expected = expected.map_err(str::to_owned);
        assert_eq!(actual, expected, "parse({input:?})");
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;
    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn parses_long_short_singular_and_plural_forms() {
        let cases: &[(&str, Duration)] = &[
            ("30 seconds", S(30)),
            ("1 second", S(1)),
            ("5 minutes", S(300)),
            ("1 minute", S(60)),
            ("1 hour", S(3600)),
            ("2 hours", S(7200)),
            ("500 milliseconds", MS(500)),
            ("1 millisecond", MS(1)),
            ("7 days", S(7 * 86_400)),
            ("1 day", S(86_400)),
            ("1 week", S(7 * 86_400)),
            ("2 weeks", S(14 * 86_400)),
            ("30s", S(30)),
            ("5m", S(300)),
            ("1h", S(3600)),
            ("500ms", MS(500)),
            ("7d", S(7 * 86_400)),
            ("1w", S(7 * 86_400)),
            ("10 secs", S(10)),
            ("3 mins", S(180)),
            ("2 hrs", S(7200)),
            ("0 seconds", S(0)),
            ("  30   Seconds  ", S(30)),
            ("5 MINUTES", S(300)),
        ];
        for &(input, expected) in cases {
            check(input, Ok(expected));
        }
    }

    #[test]
    fn rejects_bad_input_with_a_message_that_says_how_to_fix_it() {
        let fortnights =
            format!("invalid duration \"5 fortnights\": unknown unit \"fortnights\"; {UNITS_MSG}");
        let missing = format!("invalid duration \"30\": missing unit; {UNITS_MSG}");
        let cases: &[(&str, &str)] = &[
            ("5 fortnights", &fortnights),
            ("30", &missing),
            ("-5 seconds", "invalid duration \"-5 seconds\": durations must not be negative"),
            (
                "",
                "invalid duration \"\": expected a whole number followed by a unit, e.g. \"30 seconds\" or \"500ms\"",
            ),
            (
                "   ",
                "invalid duration \"   \": expected a whole number followed by a unit, e.g. \"30 seconds\" or \"500ms\"",
            ),
            (
                "soon",
                "invalid duration \"soon\": expected a whole number before the unit, e.g. \"30 seconds\" or \"500ms\"",
            ),
            (
                "seconds",
                "invalid duration \"seconds\": expected a whole number before the unit, e.g. \"30 seconds\" or \"500ms\"",
            ),
            (
                "1.5 hours",
                "invalid duration \"1.5 hours\": fractions are not accepted; use a smaller unit, e.g. \"90 minutes\" instead of \"1.5 hours\"",
            ),
            (
                "99999999999999999999 seconds",
                "invalid duration \"99999999999999999999 seconds\": too large to represent",
            ),
            (
                "18446744073709551615 weeks",
                "invalid duration \"18446744073709551615 weeks\": too large to represent",
            ),
        ];
        for &(input, expected) in cases {
            check(input, Err(expected));
        }
    }

    #[test]
    fn formats_with_the_largest_exact_unit() {
        let cases: &[(Duration, &str)] = &[
            (S(0), "0 seconds"),
            (MS(1), "1 millisecond"),
            (MS(500), "500 milliseconds"),
            (MS(1500), "1500 milliseconds"),
            (S(1), "1 second"),
            (S(30), "30 seconds"),
            (S(90), "90 seconds"),
            (S(300), "5 minutes"),
            (S(5400), "90 minutes"),
            (S(3600), "1 hour"),
            (S(86_400), "1 day"),
            (S(7 * 86_400), "1 week"),
            (S(8 * 86_400), "8 days"),
        ];
        for &(duration, expected) in cases {
            assert_eq!(format(duration), expected, "format({duration:?})");
            assert_eq!(parse(expected), Ok(duration), "round trip of {expected:?}");
        }
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Holder {
        #[serde(with = "serde_human")]
        timeout: Duration,
        #[serde(default, with = "serde_human::option")]
        retention: Option<Duration>,
    }

    #[test]
    fn serde_helper_reads_human_strings_and_writes_canonical_ones() {
        let holder: Holder =
            serde_json::from_str(r#"{"timeout": "60s", "retention": "7 days"}"#).unwrap();
        assert_eq!(holder, Holder { timeout: S(60), retention: Some(S(7 * 86_400)) });
        assert_eq!(
            serde_json::to_string(&holder).unwrap(),
            r#"{"timeout":"1 minute","retention":"1 week"}"#
        );

        let missing: Holder = serde_json::from_str(r#"{"timeout": "1s"}"#).unwrap();
        assert_eq!(missing.retention, None);

        let bad = serde_json::from_str::<Holder>(r#"{"timeout": "5 fortnights"}"#)
            .unwrap_err()
            .to_string();
        assert!(bad.contains("unknown unit \"fortnights\""), "{bad}");

        let sub_ms = Holder { timeout: Duration::from_micros(1500), retention: None };
        let error = serde_json::to_string(&sub_ms).unwrap_err().to_string();
        assert!(error.contains("sub-millisecond"), "{error}");
    }
}
