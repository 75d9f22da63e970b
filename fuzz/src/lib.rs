//! The fuzz targets' bodies and the structure-aware graph generator, shared with the stable
//! replay test (`planner/tests/fuzz_corpus.rs` includes these files), so the corpus is
//! replayed through exactly the checks the fuzzer ran. A new target is a function in
//! `targets.rs`, a one-line file in `fuzz_targets/`, a `[[bin]]` here and a line in the replay
//! test's list. `run_inputs` (the runtime, with the `run` feature) is replayed by
//! `cli/tests/run_fuzz_corpus.rs` instead.

pub mod graphs;
#[cfg(feature = "run")]
pub mod run_inputs;
pub mod targets;
