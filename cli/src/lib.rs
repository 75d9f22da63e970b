//! The runtime library (`libplanner_run.so`, built with the `run` feature): the `planner`
//! command line with `planner run` and `planner calibrate` in process and libtorch linked in. The binary loads it only
//! to run a plan, so no other command loads libtorch, and the binary itself never links it.
#![cfg(feature = "run")]

mod calibrate;
mod run;

use std::{
    ffi::{c_char, c_int, CStr, OsString},
    os::unix::ffi::OsStringExt,
};

use planner_commands::{
    args::{CalibrateArgs, RunArgs},
    Failure, Runtime, RuntimeCommands,
};

/// `run` and `calibrate` in this process, with libtorch linked in.
struct InProcess;

impl RuntimeCommands for InProcess {
    fn run(&self, args: RunArgs) -> Result<(), Failure> {
        run::run_run(args)
    }

    fn calibrate(&self, args: CalibrateArgs) -> Result<(), Failure> {
        calibrate::run_calibrate(args)
    }
}

/// The library's entry, which the binary calls for `planner run`: runs the command line
/// `argv` (`argc` strings, the program name first) and ends the process with its exit status
/// (`std::process::exit` flushes standard output).
///
/// # Safety
/// `argv` points at `argc` valid NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn planner_run_main(argc: c_int, argv: *const *const c_char) -> ! {
    let args: Vec<OsString> = (0..usize::try_from(argc).unwrap_or(0))
        .map(|i| {
            // SAFETY: the caller passes `argc` valid strings.
            let arg = unsafe { CStr::from_ptr(*argv.add(i)) };
            OsString::from_vec(arg.to_bytes().to_vec())
        })
        .collect();
    std::process::exit(i32::from(planner_commands::main(
        args,
        Runtime::Linked(&InProcess),
    )))
}
