//! Planners: what a store operation does, decided once for every backend.
//!
//! A planner takes what a store read (a typed read set), the request and `now`, and returns
//! a typed plan of the writes to perform, or a typed refusal. Stores only read, call the
//! planner and execute its plan, so the meaning of an operation lives here and nowhere
//! else. Planners are plain functions and state machines: no IO, no clock.

pub mod commit;
