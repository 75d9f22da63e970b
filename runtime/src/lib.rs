//! Executes recompute plans with libtorch through tch (SPEC §6). This is the only crate of the
//! workspace that links libtorch.

pub mod tensor;
