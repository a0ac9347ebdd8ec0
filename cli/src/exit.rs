//! Exit codes.
//!
//! `0` success (or healthy); `1` the command failed — the store refused it, the target
//! does not exist, the input was wrong — or `health` found a warning; `2` a usage error
//! reported by the argument parser, or `health` found a critical condition (a store that
//! cannot be reached counts as critical, so a probe never reads an outage as healthy).

use std::process::ExitCode;

/// What the process reports to its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Success, or healthy.
    Ok,
    /// A failed command, or a health warning.
    Failure,
    /// A critical health condition.
    Critical,
}

impl From<Code> for ExitCode {
    fn from(code: Code) -> ExitCode {
        ExitCode::from(match code {
            Code::Ok => 0,
            Code::Failure => 1,
            Code::Critical => 2,
        })
    }
}

/// A health check that could not run is critical; any other error is a failure.
pub fn classify(error: &anyhow::Error) -> Code {
    if error.downcast_ref::<crate::health::Unreachable>().is_some() {
        Code::Critical
    } else {
        Code::Failure
    }
}
