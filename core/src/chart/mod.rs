//! Statecharts: definitions, validation, the sans-IO macrostep algorithm, and diagrams.
//!
//! The semantics follow the W3C SCXML algorithm (document order, exit and entry sets,
//! `done.state.*` events, eventless transitions, conflict resolution) for everything that does
//! not need a scripting data model (DESIGN §4). The pieces:
//!
//! - [`ChartBuilder`] → [`Definition`]: the states tree with named actions, guards registered
//!   as pure functions, and timer specs; [`ChartBuilder::build`] validates (`validate`).
//! - [`Macrostep`]: one event in, the actions to run out (one at a time), then a
//!   [`MacrostepResult`] with the new [`Configuration`], context, history records, and the
//!   timers and child machines to arm or cancel. No IO, no clock, no async.
//! - [`ChartContext`]: the JSON context API actions use, with change tracking and `raise`.
//! - [`Definition::to_mermaid`]: a `stateDiagram-v2` rendering.

mod algorithm;
mod configuration;
mod context;
mod definition;
mod mermaid;
mod timer;
mod validate;

pub use algorithm::{
    ActionError, ActionPhase, ActionRequest, ChildStart, Limits, Macrostep, MacrostepError,
    MacrostepResult, Next, Record, run_to_completion,
};
pub use configuration::Configuration;
pub use context::{ActionResult, ChartContext};
pub use definition::{
    Branch, BranchBuilder, ChartBuilder, Definition, Delegation, Event, Guard, StateBuilder,
    StateKind, StateNode, TransitionBuilder, TransitionDef,
};
pub use timer::{Timer, TimerArm, TimerCancel, TimerKind, TimerSpec, TimerUnit};
pub use validate::{ChartError, ChartWarning, ValidationErrors};

#[cfg(test)]
mod tests;
