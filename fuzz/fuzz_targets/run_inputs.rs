#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| planner_fuzz::run_inputs::run_inputs(data));
