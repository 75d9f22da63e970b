//! The process's CPU allocator as a step sees it: glibc's `malloc`, under libtorch's CPU
//! allocator.
//!
//! By default glibc returns large freed blocks to the kernel (each block above its mmap
//! threshold is unmapped when freed; the top of a heap is trimmed once enough of it is free),
//! so the next tensor of that size is fresh memory, and every 4 KiB page of it costs a page
//! fault on first touch: 1.4 us a page on this repository's 2-core test VM, 3% to 12% of a CPU
//! step at the budget ranking's widths. A GPU's caching allocator keeps what it obtained, and
//! the cost model counts no such fault. [`retain_freed_memory`] has glibc keep it too, so the
//! steps after the first run on memory already mapped; [`page_faults`] counts what a step
//! still pays.

/// Has glibc's `malloc` keep the memory it obtains from the kernel for the rest of the
/// process: no block is mapped on its own (each comes from the heap), the heap is never
/// trimmed, and no thread makes an arena of its own from now on (a thread's own arena is made
/// of 64 MiB heaps, each returned to the kernel whole as soon as it is free, whatever the trim
/// threshold; a thread started later shares the main heap or an arena made before).
/// Process-wide, and not undone. Where the C library is not glibc nothing changes: the
/// report's page faults show it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn retain_freed_memory() {
    for (param, value) in [
        (libc::M_MMAP_MAX, 0),
        (libc::M_TRIM_THRESHOLD, i32::MAX),
        (libc::M_ARENA_MAX, 1),
    ] {
        // SAFETY: `mallopt` only sets allocator parameters; these are valid at any time.
        unsafe { libc::mallopt(param, value) };
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn retain_freed_memory() {}

/// Minor page faults of the whole process so far (every thread's), where the OS counts them.
#[cfg(unix)]
pub fn page_faults() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `getrusage` fills the struct it is given; RUSAGE_SELF is always valid.
    let done = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    // SAFETY: zero-initialised, and filled by the call when it succeeds.
    let usage = unsafe { usage.assume_init() };
    (done == 0).then(|| u64::try_from(usage.ru_minflt).unwrap_or(0))
}

#[cfg(not(unix))]
pub fn page_faults() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 MiB touched fresh: 16,384 faults of 4 KiB pages, or 32 of 2 MiB ones where the
    /// kernel backs it with transparent huge pages.
    #[cfg(target_os = "linux")]
    #[test]
    fn touching_fresh_pages_counts_page_faults() {
        let before = page_faults().expect("Linux counts page faults");
        let mut fresh = vec![0u8; 64 << 20];
        for page in fresh.chunks_mut(4096) {
            page[0] = 1;
        }
        std::hint::black_box(&fresh);
        let after = page_faults().unwrap();
        assert!(after - before >= 32, "{before} -> {after}");
    }
}
