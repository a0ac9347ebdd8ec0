//! Enums that configuration names by a lowercase word (`"fifo"`, `"exponential"`, `"high"`).
//!
//! Every such enum parses the same way and fails the same way: the error quotes what was
//! written and lists every accepted word, so a user can fix the file without the docs.
//! The [`name_enum!`] macro keeps the several enums from drifting apart.

/// A word that is not one of an enum's accepted names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown value {got:?}; accepted: {accepted}")]
pub struct UnknownName {
    /// What was written.
    pub got: String,
    /// The accepted names, comma separated, in declaration order.
    pub accepted: &'static str,
}

/// Declares a fieldless enum whose values are written as lowercase words, with `ALL`,
/// `as_str`, `Display`, `FromStr` (case-insensitive, error [`UnknownName`]) and serde
/// support through those strings.
macro_rules! name_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The accepted spellings, comma separated, for error messages.
            pub const ACCEPTED: &'static str = $crate::names::join!($($text),+);

            /// The lowercase word that names this value in configuration.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::names::UnknownName;

            fn from_str(input: &str) -> Result<Self, Self::Err> {
                let word = input.trim();
                Self::ALL
                    .iter()
                    .copied()
                    .find(|value| value.as_str().eq_ignore_ascii_case(word))
                    .ok_or_else(|| $crate::names::UnknownName {
                        got: input.to_owned(),
                        accepted: Self::ACCEPTED,
                    })
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let word = <::std::borrow::Cow<'de, str> as ::serde::Deserialize>::deserialize(deserializer)?;
                word.parse().map_err(<D::Error as ::serde::de::Error>::custom)
            }
        }
    };
}

/// Joins string literals with `", "` at compile time.
macro_rules! join {
    ($first:literal $(, $rest:literal)*) => {
        concat!($first $(, ", ", $rest)*)
    };
}

pub(crate) use join;
pub(crate) use name_enum;

/// Names longer than this (in characters) are never compared by [`closest`]: no machine
/// or queue name is that long, and the comparison's cost grows with the product of the
/// two lengths.
const NAME_COMPARE_MAX: usize = 128;

/// The name in `known` that `name` is most likely a misspelling of, if any: the one at
/// the smallest edit distance (insertions, deletions and substitutions of characters,
/// case ignored), when that distance is at most a third of `name`'s length (and at least
/// 1), ties broken by the name that sorts first. `name` itself is never suggested.
///
/// This is the one "did you mean" rule of Keel's tools: a worker warning about a
/// configuration section for a machine it does not register, `keel config check`, and
/// the `keel` bulk commands given a machine name the store holds nothing of all use it.
///
/// ```
/// use keel_core::config::closest;
/// assert_eq!(closest("ordr", ["order", "payment"]), Some("order"));
/// assert_eq!(closest("Order", ["order"]), Some("order"));
/// assert_eq!(closest("shipping", ["order", "payment"]), None);
/// ```
pub fn closest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let wanted: Vec<char> = name.to_lowercase().chars().collect();
    if wanted.is_empty() || wanted.len() > NAME_COMPARE_MAX {
        return None;
    }
    let within = (wanted.len() / 3).max(1);
    let mut best: Option<(usize, &'a str)> = None;
    for candidate in known {
        if candidate == name || candidate.chars().count() > NAME_COMPARE_MAX {
            continue;
        }
        let other: Vec<char> = candidate.to_lowercase().chars().collect();
        let distance = edit_distance(&wanted, &other);
        let better = best.is_none_or(|(d, b)| (distance, candidate) < (d, b));
        if distance <= within && better {
            best = Some((distance, candidate));
        }
    }
    best.map(|(_, name)| name)
}

/// Levenshtein distance over characters, one row at a time.
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, known: &[&str], expected: Option<&str>) {
        assert_eq!(closest(name, known.iter().copied()), expected, "{name} among {known:?}");
    }

    #[test]
    fn closest_is_a_near_name_or_none() {
        check("ordr", &["order", "payment"], Some("order"));
        check("ORDER", &["order"], Some("order"));
        check("order", &["order"], None);
        check("ab", &["ac", "ad"], Some("ac"));
        check("a", &["b"], Some("b"));
        check("shipping", &["order", "payment"], None);
        check("", &["order"], None);
        check(&"x".repeat(200), &[&"x".repeat(199)], None);
        check("paymnts", &["payment", "payments"], Some("payments"));
    }

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        let d = |a: &str, b: &str| {
            edit_distance(&a.chars().collect::<Vec<_>>(), &b.chars().collect::<Vec<_>>())
        };
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("abc", ""), 3);
        assert_eq!(d("order", "order"), 0);
        assert_eq!(d("ordr", "order"), 1);
    }
}
