//! The NCCL library as the torch wheel ships it: `libnccl.so.2` (the `nvidia-nccl` wheel),
//! which `libtorch_cuda.so` already loads through its rpath. It is opened by that name (the
//! loaded copy answers), or from the library path; nothing links it, so the runtime builds and
//! runs on machines without CUDA.

use std::{
    ffi::{c_char, c_int, c_void, CStr},
    sync::OnceLock,
};

use libloading::Library;

/// The names NCCL is opened by, in order: the wheel's, then a plain development link.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// `ncclResult_t`, kept as the integer NCCL returns.
pub type Status = c_int;
pub const SUCCESS: Status = 0;
/// `ncclInProgress`: a non-blocking operation still runs (not an error).
pub const IN_PROGRESS: Status = 7;

/// `ncclComm_t`.
pub type Comm = *mut c_void;
/// `cudaStream_t`.
pub type Stream = *mut c_void;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

/// `ncclDataType_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub enum DataType {
    Int8 = 0,
    Uint8 = 1,
    Int32 = 2,
    Uint32 = 3,
    Int64 = 4,
    Uint64 = 5,
    Float16 = 6,
    Float32 = 7,
    Float64 = 8,
    Bfloat16 = 9,
    Float8e4m3 = 10,
    Float8e5m2 = 11,
}

/// `ncclRedOp_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub enum RedOp {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    Avg = 4,
}

type Buffer = *const c_void;
type BufferMut = *mut c_void;

/// The entry points the runtime calls, resolved once.
pub struct Nccl {
    /// Keeps the entry points loaded.
    _library: Library,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    pub comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Status,
    pub comm_abort: unsafe extern "C" fn(Comm) -> Status,
    pub comm_destroy: unsafe extern "C" fn(Comm) -> Status,
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut Status) -> Status,
    pub group_start: unsafe extern "C" fn() -> Status,
    pub group_end: unsafe extern "C" fn() -> Status,
    pub send: unsafe extern "C" fn(Buffer, usize, DataType, c_int, Comm, Stream) -> Status,
    pub recv: unsafe extern "C" fn(BufferMut, usize, DataType, c_int, Comm, Stream) -> Status,
    pub all_gather:
        unsafe extern "C" fn(Buffer, BufferMut, usize, DataType, Comm, Stream) -> Status,
    pub reduce_scatter:
        unsafe extern "C" fn(Buffer, BufferMut, usize, DataType, RedOp, Comm, Stream) -> Status,
    pub all_reduce:
        unsafe extern "C" fn(Buffer, BufferMut, usize, DataType, RedOp, Comm, Stream) -> Status,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

impl Nccl {
    /// NCCL's name for `status` (`unhandled cuda error ...`).
    pub fn describe(&self, status: Status) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string for any code.
        let text = unsafe { (self.get_error_string)(status) };
        if text.is_null() {
            return format!("NCCL error {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{text} (NCCL error {status})")
    }
}

/// NCCL, loaded on first use; the error says which names were tried.
pub fn nccl() -> Result<&'static Nccl, String> {
    static LOADED: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LOADED.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Nccl, String> {
    let mut failures = Vec::new();
    for name in NAMES {
        // SAFETY: NCCL's initialisers only set up its own state.
        match unsafe { Library::new(name) } {
            Ok(library) => return resolve(library),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "NCCL cannot be loaded (the torch wheel's nvidia-nccl package ships libnccl.so.2, which \
         libtorch_cuda loads): {}",
        failures.join("; ")
    ))
}

/// The entry point `name` of `library`, as the function pointer type `F`.
///
/// # Safety
/// `F` must be the C signature of that entry point.
unsafe fn symbol<F: Copy>(library: &Library, name: &str) -> Result<F, String> {
    // SAFETY: the caller vouches for the type.
    let symbol =
        unsafe { library.get::<F>(name) }.map_err(|e| format!("libnccl has no {name}: {e}"))?;
    Ok(*symbol)
}

fn resolve(library: Library) -> Result<Nccl, String> {
    let l = &library;
    // SAFETY (every call): each field's type is the C signature of the NCCL entry point named.
    unsafe {
        Ok(Nccl {
            get_unique_id: symbol(l, "ncclGetUniqueId")?,
            comm_init_rank: symbol(l, "ncclCommInitRank")?,
            comm_abort: symbol(l, "ncclCommAbort")?,
            comm_destroy: symbol(l, "ncclCommDestroy")?,
            comm_get_async_error: symbol(l, "ncclCommGetAsyncError")?,
            group_start: symbol(l, "ncclGroupStart")?,
            group_end: symbol(l, "ncclGroupEnd")?,
            send: symbol(l, "ncclSend")?,
            recv: symbol(l, "ncclRecv")?,
            all_gather: symbol(l, "ncclAllGather")?,
            reduce_scatter: symbol(l, "ncclReduceScatter")?,
            all_reduce: symbol(l, "ncclAllReduce")?,
            get_error_string: symbol(l, "ncclGetErrorString")?,
            _library: library,
        })
    }
}
