//! Replays every committed input of the `run_inputs` fuzz target (`fuzz/corpus/run_inputs/`,
//! `fuzz/regressions/run_inputs/`) through the checks the fuzzer ran, on stable Rust: the
//! target's body is the fuzz crate's own file, compiled here (`docs/fuzzing.md`).

#![cfg(feature = "run")]

#[path = "../../fuzz/src/run_inputs.rs"]
mod run_inputs;

use std::path::{Path, PathBuf};

/// The files directly under `dir`, in name order; none when it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.is_file());
    files.sort();
    files
}

#[test]
fn every_kept_run_input_runs_or_fails_cleanly() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let inputs: Vec<PathBuf> = ["corpus", "regressions"]
        .iter()
        .flat_map(|kind| files(&fuzz.join(kind).join("run_inputs")))
        .collect();
    assert!(!inputs.is_empty(), "no corpus for run_inputs");
    for input in inputs {
        let data = std::fs::read(&input).expect("readable");
        run_inputs::run_inputs(&data);
    }
}
