//! The recompute planner: policy, partition and cost model over the `ir` graph, and the
//! commands of the `planner` binary.
//!
//! **Architecture invariant:** nothing here links libtorch; planning is pure graph work.

pub mod budget;
pub mod calibration;
pub mod compose;
pub mod config;
pub mod convert;
pub mod cost;
pub mod diagnostics;
pub mod diff;
pub mod explore;
pub mod inspect;
pub mod memory;
pub mod offload;
pub mod pareto;
pub mod partition;
pub mod plan;
pub mod policy;
pub mod progress;
pub mod render;
pub mod state;
pub mod units;
