//! The runtime library (`libplanner_run.so`, built with the `run` feature): the `planner`
//! command line with `planner run` and `planner calibrate` in process and libtorch linked in. The binary loads it only
//! to run a plan, so no other command loads libtorch, and the binary itself never links it.
#![cfg(feature = "run")]

mod args;
mod calibrate;
mod commands;
mod output;
mod progress;
mod run;

use std::{
    ffi::{c_char, c_int, CStr, OsString},
    os::unix::ffi::OsStringExt,
};

use calibrate::run_calibrate as calibrate_command;
use run::run_run as run_command;

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
    std::process::exit(i32::from(commands::main(args)))
}
