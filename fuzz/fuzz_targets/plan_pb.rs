#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| planner_fuzz::targets::plan_pb(data));
