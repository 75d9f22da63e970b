//! The `planner` command line. Exit codes: 0 success (warnings allowed), 1 bad input or
//! configuration (`error: ...` on stderr) or, for `diff`, plans whose decisions differ, 2
//! usage, 3 `--deny-warnings` with warnings present.
//!
//! With the `run` feature, `planner run` runs in the runtime library built beside the binary
//! (`lib.rs`, the only part that links libtorch), loaded for that command alone: every other
//! command starts without loading libtorch.

mod allocator;
mod args;
mod commands;
mod output;
mod progress;
#[cfg(feature = "run")]
mod runtime_library;

use std::process::ExitCode;

#[cfg(feature = "run")]
use runtime_library::{calibrate_command, run_command};

/// Loading and planning allocate millions of small strings and vectors: mimalloc does that
/// faster than the system allocator, above all across threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    allocator::keep_freed_memory();
    ExitCode::from(commands::main(std::env::args_os()))
}
