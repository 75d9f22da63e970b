//! The `planner` command line. Exit codes: 0 success (warnings allowed), 1 bad input or
//! configuration (`error: ...` on stderr) or, for `diff`, plans whose decisions differ, 2
//! usage, 3 `--deny-warnings` with warnings present.
//!
//! With the `run` feature, `planner run` runs in the runtime library built beside the binary
//! (`lib.rs`, the only part that links libtorch), loaded for that command alone: every other
//! command starts without loading libtorch.

mod allocator;
#[cfg(feature = "run")]
mod runtime_library;

use std::process::ExitCode;

use planner_commands::Runtime;

/// Loading and planning allocate millions of small strings and vectors: mimalloc does that
/// faster than the system allocator, above all across threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    allocator::keep_freed_memory();
    ExitCode::from(planner_commands::main(std::env::args_os(), runtime()))
}

/// `run` and `calibrate`: in the runtime library, loaded for them alone.
#[cfg(feature = "run")]
fn runtime() -> Runtime<'static> {
    Runtime::Linked(&runtime_library::HandOver)
}

/// A binary built without the runtime names the build that has one.
#[cfg(not(feature = "run"))]
fn runtime() -> Runtime<'static> {
    Runtime::Absent(
        "this `planner` was built without the runtime: after `source scripts/env.sh`, \
         build it with `cargo build --release -p planner-cli --features run`",
    )
}
