//! Table-driven tests of the chart semantics.
