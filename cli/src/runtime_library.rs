//! `planner run` in the binary: the runtime library built beside it (`libplanner_run.so`, the
//! package's library: this command line with libtorch linked in) is loaded for this command
//! alone and runs the whole command line.

use std::{
    env::consts::{DLL_PREFIX, DLL_SUFFIX},
    ffi::{c_char, c_int, CString},
    os::unix::ffi::OsStringExt,
    path::PathBuf,
};

use planner_commands::{
    args::{CalibrateArgs, RunArgs},
    Failure, RuntimeCommands,
};

/// The library's entry (`planner_run_main` in `lib.rs`): runs a command line, then ends the
/// process.
type Entry = unsafe extern "C" fn(argc: c_int, argv: *const *const c_char) -> !;

/// `planner run` and `planner calibrate`: the binary has parsed the arguments (its `--help` is
/// the binary's own); the runtime library parses the command line again and runs it.
pub(crate) struct HandOver;

impl RuntimeCommands for HandOver {
    fn run(&self, _: RunArgs) -> Result<(), Failure> {
        hand_over()
    }

    fn calibrate(&self, _: CalibrateArgs) -> Result<(), Failure> {
        hand_over()
    }
}

/// Loads the runtime library and hands it this process's command line; it ends the process.
/// Returns only when the library cannot be loaded.
fn hand_over() -> Result<(), Failure> {
    let path = library_path()?;
    // SAFETY: the library is this package's own, built with this binary; loading it runs
    // libtorch's initialisers, as linking it would.
    let library = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("cannot load the runtime library {}: {e}", path.display()))?;
    // SAFETY: `planner_run_main` has the signature of `Entry`.
    let entry = unsafe { library.get::<Entry>(b"planner_run_main\0") }
        .map_err(|e| format!("{} is not the runtime library: {e}", path.display()))?;
    let args = std::env::args_os()
        .map(|arg| CString::new(arg.into_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "an argument holds a NUL byte".to_owned())?;
    let argv: Vec<*const c_char> = args.iter().map(|arg| arg.as_ptr()).collect();
    let argc = c_int::try_from(argv.len()).map_err(|_| "too many arguments".to_owned())?;
    // SAFETY: `argv` holds `argc` strings that outlive the call, which does not return.
    unsafe { entry(argc, argv.as_ptr()) }
}

/// The runtime library: beside this executable, or in `deps/` beside it (where `cargo run`
/// and `cargo test` may leave it).
fn library_path() -> Result<PathBuf, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this executable's directory: {e}"))?;
    let dir = exe.parent().unwrap_or(&exe);
    let name = format!("{DLL_PREFIX}planner_run{DLL_SUFFIX}");
    [dir.join(&name), dir.join("deps").join(&name)]
        .into_iter()
        .find(|path| path.is_file())
        .ok_or_else(|| {
            format!(
                "`planner run` needs the runtime library {name} beside the planner executable \
                 (in {}); build both with `cargo build --release -p planner-cli --features run`",
                dir.display()
            )
        })
}
