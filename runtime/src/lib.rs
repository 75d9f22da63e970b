//! Executes recompute plans with libtorch: forward, the plan's replay subgraphs and backward,
//! one training step per rank, collectives through a communicator, and the checks that prove a
//! plan (bit-identical results, measured memory, op counts). This is the only crate of the
//! workspace that links libtorch; it reads the plan's typed form ([`ir::plan::Plan`]) and never
//! the planner's internals.

pub mod check;
pub mod comm;
pub mod exec;
pub mod ffi;
pub mod fingerprint;
pub mod host_memory;
pub mod inputs;
pub mod memory;
pub mod offload;
pub mod program;
pub mod rng;
pub mod run;
pub mod schedule;
pub mod tensor;
pub mod watch;

pub use tch::Device;

/// Whether libtorch sees a CUDA device.
pub fn cuda_available() -> bool {
    tch::Cuda::is_available()
}

/// Threads libtorch's CPU kernels run on.
pub fn cpu_threads() -> usize {
    usize::try_from(tch::get_num_threads()).unwrap_or(0)
}
