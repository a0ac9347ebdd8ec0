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
