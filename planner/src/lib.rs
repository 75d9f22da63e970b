//! The recompute planner: policy, partition and cost model over the `ir` graph, and the
//! commands of the `planner` binary.
//!
//! **Architecture invariant:** nothing here links libtorch; planning is pure graph work.

pub mod convert;
pub mod inspect;
pub mod units;
