//! Test and benchmark support shared by the crates of the workspace: a builder of small valid
//! joint graphs, deep graphs made from shallow ones, and golden-file helpers. Never a
//! dependency of the product itself.

pub mod builder;
pub mod deepen;
pub mod golden;

pub use builder::{accumulating_index_put, activation_dominated, Builder, MODEL};
pub use deepen::{deepen, DeepenError};
pub use golden::{check_golden, golden_graph, repo_root, unified_diff, updating};

/// The commands every build of `planner` parses and documents (`run` and `calibrate` run only
/// in a build with the runtime).
pub const PLANNER_COMMANDS: &[&str] = &[
    "plan",
    "diff",
    "pareto",
    "inspect",
    "convert",
    "run",
    "calibrate",
];
