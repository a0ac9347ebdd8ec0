//! The store conformance suite (placeholder while the contracts are written).

/// Names of the store contracts.
pub const STORE_CONTRACTS: &[&str] = &[];
