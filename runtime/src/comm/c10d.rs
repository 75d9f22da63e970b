//! Safe handles over libtorch's c10d pieces in the shim (`shim/dist.cpp`): the key-value store
//! PyTorch's launchers rendezvous through, gloo process groups and their pending collectives.

use std::{
    ffi::{c_char, c_void, CString},
    time::Duration,
};

use tch::Tensor;

use crate::ffi::{check, take_string};

mod sys {
    use std::ffi::{c_char, c_void};

    /// The C++ `at::Tensor`, seen only through pointers.
    pub type AtTensor = c_void;

    extern "C" {
        pub fn rt_store_open(
            host: *const c_char,
            port: u16,
            server: i32,
            workers: i64,
            timeout_ms: i64,
            prefix: *const c_char,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn rt_store_free(store: *mut c_void);
        pub fn rt_store_set(
            store: *mut c_void,
            key: *const c_char,
            value: *const u8,
            len: usize,
        ) -> *mut c_char;
        pub fn rt_store_get(
            store: *mut c_void,
            key: *const c_char,
            value: *mut *mut c_char,
            len: *mut usize,
        ) -> *mut c_char;
        pub fn rt_gloo_new(
            store: *mut c_void,
            prefix: *const c_char,
            rank: i32,
            world: i32,
            timeout_ms: i64,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn rt_gloo_free(group: *mut c_void);
        pub fn rt_gloo_allreduce(
            group: *mut c_void,
            tensor: *mut AtTensor,
            op: i32,
            work: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn rt_gloo_allgather(
            group: *mut c_void,
            output: *mut AtTensor,
            input: *mut AtTensor,
            work: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn rt_gloo_alltoall(
            group: *mut c_void,
            output: *mut AtTensor,
            input: *mut AtTensor,
            output_splits: *const i64,
            input_splits: *const i64,
            ranks: usize,
            work: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn rt_work_poll(work: *mut c_void, error: *mut *mut c_char) -> i32;
        pub fn rt_work_free(work: *mut c_void);
    }
}

fn c_string(text: &str) -> Result<CString, String> {
    CString::new(text).map_err(|_| format!("`{}` holds a NUL byte", text.escape_debug()))
}

fn millis(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX)
}

/// Where a [`Store`] lives and who serves it.
pub struct StoreAddress<'a> {
    pub host: &'a str,
    pub port: u16,
    /// This process serves the store.
    pub server: bool,
    /// The processes that use the store, this one included.
    pub workers: usize,
    /// Keys live under this prefix (none when empty).
    pub prefix: &'a str,
}

/// A c10d `TCPStore` (under a `PrefixStore`): keys every rank can set and wait for.
pub struct Store {
    raw: *mut c_void,
}

// SAFETY: c10d stores serialise their operations internally; the handle is only an owning
// pointer.
unsafe impl Send for Store {}
// SAFETY: as above.
unsafe impl Sync for Store {}

impl Store {
    /// Connects to the store at `address` (or serves it), every operation bounded by
    /// `timeout`.
    pub fn open(address: &StoreAddress<'_>, timeout: Duration) -> Result<Store, String> {
        let host = c_string(address.host)?;
        let prefix = c_string(address.prefix)?;
        let mut raw = std::ptr::null_mut();
        let workers = i64::try_from(address.workers).unwrap_or(i64::MAX);
        // SAFETY: valid strings; the shim writes `raw` on success.
        check(unsafe {
            sys::rt_store_open(
                host.as_ptr(),
                address.port,
                i32::from(address.server),
                workers,
                millis(timeout),
                prefix.as_ptr(),
                &mut raw,
            )
        })?;
        Ok(Store { raw })
    }

    pub fn set(&self, key: &str, value: &str) -> Result<(), String> {
        let key = c_string(key)?;
        // SAFETY: a live store, a valid key and byte range.
        check(unsafe { sys::rt_store_set(self.raw, key.as_ptr(), value.as_ptr(), value.len()) })
    }

    /// The value of `key`, once a rank has set it (within the store's timeout).
    pub fn get(&self, key: &str) -> Result<String, String> {
        let key = c_string(key)?;
        let mut value: *mut c_char = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live store and key; the shim writes a malloc'd string on success.
        check(unsafe { sys::rt_store_get(self.raw, key.as_ptr(), &mut value, &mut len) })?;
        Ok(take_string(value).unwrap_or_default())
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: the handle this store owns, freed once.
        unsafe { sys::rt_store_free(self.raw) };
    }
}

/// A reduction as c10d numbers it (`c10d::ReduceOp::RedOpType`).
#[derive(Debug, Clone, Copy)]
pub enum Reduction {
    Sum = 0,
    Product = 2,
    Min = 3,
    Max = 4,
}

/// One rank of a gloo process group (`c10d::ProcessGroupGloo`).
pub struct GlooGroup {
    raw: *mut c_void,
}

// SAFETY: the process group queues work from any thread and runs it on its own threads; the
// handle is only an owning pointer, used by one rank.
unsafe impl Send for GlooGroup {}

impl GlooGroup {
    /// Joins the group of `world` ranks as `rank`, meeting the others through `store` under
    /// `prefix` (the connections form within `timeout`, which also bounds each collective).
    pub fn new(
        store: &Store,
        prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<GlooGroup, String> {
        let prefix = c_string(prefix)?;
        let number = |n: usize| i32::try_from(n).map_err(|_| format!("{n} ranks are too many"));
        let mut raw = std::ptr::null_mut();
        // SAFETY: a live store and a valid prefix; the shim writes `raw` on success.
        check(unsafe {
            sys::rt_gloo_new(
                store.raw,
                prefix.as_ptr(),
                number(rank)?,
                number(world)?,
                millis(timeout),
                &mut raw,
            )
        })?;
        Ok(GlooGroup { raw })
    }

    /// Reduces `tensor` (contiguous) in place over the ranks.
    pub fn all_reduce(&self, tensor: &Tensor, op: Reduction) -> Result<Work, String> {
        Work::start(|work| {
            // SAFETY: a live group and tensor; the work holds its own reference to it.
            unsafe { sys::rt_gloo_allreduce(self.raw, at(tensor), op as i32, work) }
        })
    }

    /// Every rank's `input` concatenated in rank order into `output`.
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<Work, String> {
        Work::start(|work| {
            // SAFETY: as for `all_reduce`.
            unsafe { sys::rt_gloo_allgather(self.raw, at(output), at(input), work) }
        })
    }

    /// `input_splits[r]` rows of `input` to rank r, `output_splits[r]` rows from it into
    /// `output`.
    pub fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[i64],
        input_splits: &[i64],
    ) -> Result<Work, String> {
        if output_splits.len() != input_splits.len() {
            return Err(format!(
                "{} output splits but {} input splits",
                output_splits.len(),
                input_splits.len()
            ));
        }
        Work::start(|work| {
            // SAFETY: as for `all_reduce`; both split lists hold `len` entries.
            unsafe {
                sys::rt_gloo_alltoall(
                    self.raw,
                    at(output),
                    at(input),
                    output_splits.as_ptr(),
                    input_splits.as_ptr(),
                    input_splits.len(),
                    work,
                )
            }
        })
    }

    /// Leaves the group without destroying it: its destructor waits for every queued
    /// collective, and one whose peer is gone may only end at gloo's own timeout.
    pub fn abandon(self) {
        std::mem::forget(self);
    }
}

impl Drop for GlooGroup {
    fn drop(&mut self) {
        // SAFETY: the handle this group owns, freed once.
        unsafe { sys::rt_gloo_free(self.raw) };
    }
}

/// The `at::Tensor*` behind a tch tensor, as the shim's collectives take it.
fn at(tensor: &Tensor) -> *mut sys::AtTensor {
    tensor.as_ptr().cast_mut().cast()
}

/// Where a collective stands.
pub enum Progress {
    Running,
    Done,
    Failed(String),
}

/// A started collective (`c10d::Work`).
pub struct Work {
    raw: *mut c_void,
}

impl Work {
    fn start(start: impl FnOnce(*mut *mut c_void) -> *mut c_char) -> Result<Work, String> {
        let mut raw = std::ptr::null_mut();
        check(start(&mut raw))?;
        Ok(Work { raw })
    }

    pub fn poll(&self) -> Progress {
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live work handle; the shim writes a malloc'd message on failure.
        match unsafe { sys::rt_work_poll(self.raw, &mut error) } {
            0 => Progress::Running,
            1 => Progress::Done,
            _ => Progress::Failed(
                take_string(error).unwrap_or_else(|| "the collective failed".to_owned()),
            ),
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: the handle this work owns, freed once (the group keeps its own reference to
        // work it still runs).
        unsafe { sys::rt_work_free(self.raw) };
    }
}
