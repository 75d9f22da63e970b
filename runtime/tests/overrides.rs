//! The process-wide changes a run makes to libtorch (the portable Bernoulli sampler, the
//! budgeted CPU allocator, deterministic algorithms for kernels that sum in no fixed order)
//! are in place only while the run's programs live: code that uses libtorch around the
//! runtime finds it as it was before and after a run. One test in a binary of its own, since
//! what it checks is process-wide.

mod common;

use std::time::Duration;

use runtime::{ffi, program::Program, run::run_loopback, Device};

const BERNOULLI: &str = "aten.bernoulli_.float";
/// Where the dispatcher says the portable sampler was registered.
const SHIM: &str = "shim.cpp";

fn bernoulli_kernels() -> String {
    ffi::operator_state(BERNOULLI).expect("libtorch has the operator")
}

#[test]
fn libtorch_is_overridden_only_while_programs_live_and_as_it_was_after_a_run() {
    let stock_kernels = bernoulli_kernels();
    let stock_allocator = ffi::cpu_allocator();
    assert!(!stock_kernels.contains(SHIM), "{stock_kernels}");
    assert!(!ffi::deterministic_algorithms());

    // Two ranks' programs: the changes hold until the last one goes.
    let graph = common::golden("dense_dropout");
    let first = Program::prepare(&graph, Device::Cpu, 1).expect("every op runs");
    let second = Program::prepare(&graph, Device::Cpu, 1).expect("every op runs");
    assert!(
        bernoulli_kernels().contains(SHIM),
        "{}",
        bernoulli_kernels()
    );
    assert_ne!(ffi::cpu_allocator(), stock_allocator);
    drop(first);
    assert!(bernoulli_kernels().contains(SHIM));
    assert_ne!(ffi::cpu_allocator(), stock_allocator);
    drop(second);
    assert_eq!(bernoulli_kernels(), stock_kernels);
    assert_eq!(ffi::cpu_allocator(), stock_allocator);

    // A whole run, as `planner run` makes one: dropout draws through the portable sampler and
    // the embedding's backward sums under deterministic algorithms.
    run_loopback(
        common::jobs("dense_dropout", 1),
        &common::config(Duration::from_secs(60)),
    )
    .expect("the run succeeds");
    assert_eq!(bernoulli_kernels(), stock_kernels);
    assert_eq!(ffi::cpu_allocator(), stock_allocator);
    assert!(!ffi::deterministic_algorithms());
}
