#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| planner_fuzz::targets::inspect_text(data));
