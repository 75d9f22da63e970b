//! Allocator settings for the `planner` binary and the scale benchmark, which both run
//! mimalloc as their global allocator.

use libmimalloc_sys::{mi_option_get, mi_option_set, mi_option_t};

/// `mi_option_purge_delay` in the `mi_option_e` enum of the mimalloc that libmimalloc-sys
/// 0.1.49 builds (v3 `include/mimalloc.h`; the index is the same in v2). The crate does not
/// export a constant for it.
const PURGE_DELAY: mi_option_t = 15;

/// The default purge delay (ms) of that mimalloc, which identifies the option above.
const DEFAULT_PURGE_DELAY_MS: std::ffi::c_long = 1000;

/// Keeps freed memory in the process instead of handing it back to the OS a second later.
///
/// A planner run is a few seconds of allocating and freeing large tables (the file buffer,
/// per-phase vectors, three memory simulations); returned pages come back as fresh ones, and
/// the kernel zeroes every fresh page, which was a third of a million-node run. The process
/// exits soon after, so holding the memory costs nothing. Returns false, changing nothing,
/// if the option at that index does not look like the purge delay.
pub fn keep_freed_memory() -> bool {
    // SAFETY: mimalloc's option calls are plain C functions on a static option table; they are
    // not thread safe, so this runs at the start of `main` before any thread is spawned.
    unsafe {
        if mi_option_get(PURGE_DELAY) != DEFAULT_PURGE_DELAY_MS {
            return false;
        }
        mi_option_set(PURGE_DELAY, -1);
    }
    true
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_delay_option_is_where_we_expect_it() {
        // mimalloc reads its options from the environment; a set delay is not the default.
        let set = ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        assert_eq!(super::keep_freed_memory(), !set);
    }
}
