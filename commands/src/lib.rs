//! The `planner` command line: its arguments (`args`), its commands (`commands`), where their
//! output goes (`output`) and their progress bars (`progress`). One crate, linked by each
//! program that runs the command line: the `planner` binary, the runtime library it loads for
//! `planner run`, and the Python package's native extension (its `planner` console script).
//! Each says through a [`Runtime`] whether and how it runs the two commands that need libtorch.

pub mod args;
mod commands;
pub mod output;
pub mod progress;

pub use commands::{load_hw, main, report_errors, Failure, Runtime, RuntimeCommands};
