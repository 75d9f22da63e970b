//! Safe wrappers over the C++ shim (`shim/shim.cpp`): operators bound by schema name and called
//! through libtorch's dispatcher, storage identity, generator state and CUDA queries.
//!
//! Tensors cross as `at::Tensor*`, tch's `C_tensor`: an input is borrowed with
//! [`Tensor::as_ptr`], an output is a fresh `at::Tensor*` that [`Tensor::from_ptr`] takes over.

use std::{
    ffi::{c_char, c_void, CStr, CString},
    ptr::NonNull,
};

use ir::{AttrValue, Attribute};
use tch::{Device, Tensor};

// `AttrKind`, `BindStatus`, `DeviceType` and `EventState`, written by build.rs from
// `shim/codes.h`.
include!(concat!(env!("OUT_DIR"), "/codes.rs"));

#[allow(non_camel_case_types)]
mod sys {
    use std::ffi::{c_char, c_void};

    use tch::Tensor;

    use super::AttrKind;

    /// The C++ `at::Tensor`, seen only through pointers.
    pub type AtTensor = c_void;

    #[repr(C)]
    pub struct rt_attr {
        pub name: *const c_char,
        pub kind: AttrKind,
        pub int_value: i64,
        pub float_value: f64,
        pub str_value: *const c_char,
        pub ints: *const i64,
        pub floats: *const f64,
        pub strs: *const *const c_char,
        pub len: usize,
    }

    extern "C" {
        pub fn rt_free_error(text: *mut c_char);
        pub fn rt_bind(
            name: *const c_char,
            overload: *const c_char,
            num_inputs: usize,
            attrs: *const rt_attr,
            num_attrs: usize,
            home_type: i32,
            run_type: i32,
            run_index: i32,
            out: *mut *mut c_void,
            status: *mut i32,
        ) -> *mut c_char;
        pub fn rt_call_free(call: *mut c_void);
        pub fn rt_call_runs_on(call: *mut c_void, device_type: i32) -> i32;
        pub fn rt_call_schema(call: *mut c_void) -> *mut c_char;
        pub fn rt_call_run(
            call: *mut c_void,
            inputs: *const *const AtTensor,
            num_inputs: usize,
            deterministic: i32,
            outputs: *mut *mut AtTensor,
            capacity: usize,
            num_outputs: *mut usize,
        ) -> *mut c_char;
        pub fn rt_storage(tensor: *const AtTensor, key: *mut usize, nbytes: *mut usize);
        pub fn rt_rng_get_state(
            device_type: i32,
            device_index: i32,
            out: *mut *mut AtTensor,
        ) -> *mut c_char;
        pub fn rt_rng_set_state(
            device_type: i32,
            device_index: i32,
            state: *const AtTensor,
        ) -> *mut c_char;
        pub fn rt_rng_seeded_state(
            device_type: i32,
            device_index: i32,
            seed: u64,
            out: *mut *mut AtTensor,
        ) -> *mut c_char;
        pub fn rt_kernel_overrides_acquire() -> *mut c_char;
        pub fn rt_kernel_overrides_release() -> *mut c_char;
        pub fn rt_cpu_allocator() -> usize;
        pub fn rt_deterministic_algorithms() -> i32;
        pub fn rt_operator_state(
            name: *const c_char,
            overload: *const c_char,
            out: *mut *mut c_char,
        ) -> *mut c_char;
        pub fn rt_set_allocation_budget(bytes: i64);
        pub fn rt_refused_allocation() -> u64;
        pub fn rt_cuda_set_device(device_index: i32) -> *mut c_char;
        pub fn rt_cuda_current_stream(device_index: i32, out: *mut *mut c_void) -> *mut c_char;
        pub fn rt_cuda_synchronize(device_index: i32) -> *mut c_char;
        pub fn rt_cuda_record_event(device_index: i32, out: *mut *mut c_void) -> *mut c_char;
        pub fn rt_event_query(event: *mut c_void) -> i32;
        pub fn rt_event_free(event: *mut c_void);
        pub fn rt_cuda_peak_allocated(device_index: i32, out: *mut u64) -> *mut c_char;
        pub fn rt_cuda_reset_peak(device_index: i32) -> *mut c_char;
    }

    /// The `at::Tensor*` behind a tch tensor.
    pub fn at(tensor: &Tensor) -> *const AtTensor {
        tensor.as_ptr().cast()
    }
}

/// Takes over a string the shim malloc'd (`None` for null).
pub(crate) fn take_string(text: *mut c_char) -> Option<String> {
    if text.is_null() {
        return None;
    }
    // SAFETY: a non-null pointer is a NUL-terminated string the shim malloc'd for us.
    let owned = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: freed once, by the allocator that made it.
    unsafe { sys::rt_free_error(text) };
    Some(owned)
}

/// A message from libtorch (a C++ exception's text), or `Ok`.
pub(crate) fn check(message: *mut c_char) -> Result<(), String> {
    take_string(message).map_or(Ok(()), Err)
}

/// `(type, index)` of a device as the shim numbers them ([`DeviceType`]).
fn device_code(device: Device) -> (i32, i32) {
    match cuda_index(device) {
        Some(index) => (DeviceType::Cuda.code(), index),
        None => (DeviceType::Cpu.code(), 0),
    }
}

/// The CUDA device index of `device`, if it is one.
fn cuda_index(device: Device) -> Option<i32> {
    match device {
        Device::Cuda(index) => Some(i32::try_from(index).unwrap_or(i32::MAX)),
        _ => None,
    }
}

/// An IR op name split into the dispatcher's `namespace::name` and overload
/// (`aten.add.Tensor` -> `aten::add`, `Tensor`); `None` when it has fewer than three parts.
pub fn schema_name(op: &str) -> Option<(String, String)> {
    let (namespace, rest) = op.split_once('.')?;
    let (name, overload) = rest.rsplit_once('.')?;
    (!namespace.is_empty() && !name.is_empty() && !overload.is_empty())
        .then(|| (format!("{namespace}::{name}"), overload.to_owned()))
}

/// Why an IR node could not be bound to an ATen operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    /// libtorch has no operator of this name and overload (`aten.mm.default`).
    #[error("libtorch has no operator `{0}`")]
    NoSuchOperator(String),
    /// The operator exists but the node does not fit its schema, or its name or attributes
    /// cannot be handed to libtorch; the message says which.
    #[error("{0}")]
    Mismatch(String),
}

impl From<String> for BindError {
    fn from(message: String) -> BindError {
        BindError::Mismatch(message)
    }
}

/// An ATen operator bound to one IR node's inputs and attributes: every argument is either a
/// constant made once here or an input slot filled at each call.
#[derive(Debug)]
pub struct BoundCall {
    call: NonNull<c_void>,
    num_inputs: usize,
    /// Run under PyTorch's deterministic algorithms.
    deterministic: bool,
}

// SAFETY: a bound call is immutable after binding; running it copies its constants onto a
// fresh stack, so any number of threads may run it at once.
unsafe impl Send for BoundCall {}
// SAFETY: as above.
unsafe impl Sync for BoundCall {}

impl Drop for BoundCall {
    fn drop(&mut self) {
        // SAFETY: made by `rt_bind`, freed once.
        unsafe { sys::rt_call_free(self.call.as_ptr()) }
    }
}

/// Attribute strings as C strings, kept alive while the shim reads them.
struct CAttrs {
    _strings: Vec<CString>,
    _lists: Vec<Vec<*const c_char>>,
    attrs: Vec<sys::rt_attr>,
}

fn c_string(text: &str) -> Result<CString, String> {
    CString::new(text).map_err(|_| format!("`{text}` holds a NUL byte"))
}

impl CAttrs {
    fn new(attributes: &[Attribute]) -> Result<CAttrs, String> {
        let mut strings = Vec::new();
        let mut lists = Vec::new();
        let mut attrs = Vec::with_capacity(attributes.len());
        for attribute in attributes {
            let name = c_string(&attribute.name)?;
            let mut attr = sys::rt_attr {
                name: name.as_ptr(),
                kind: AttrKind::Int,
                int_value: 0,
                float_value: 0.0,
                str_value: std::ptr::null(),
                ints: std::ptr::null(),
                floats: std::ptr::null(),
                strs: std::ptr::null(),
                len: 0,
            };
            strings.push(name);
            match &attribute.value {
                AttrValue::Int(v) => attr.int_value = *v,
                AttrValue::Float(v) => {
                    attr.kind = AttrKind::Float;
                    attr.float_value = *v;
                }
                AttrValue::Str(s) => {
                    let s = c_string(s)?;
                    attr.kind = AttrKind::Str;
                    attr.str_value = s.as_ptr();
                    strings.push(s);
                }
                AttrValue::Bool(b) => {
                    attr.kind = AttrKind::Bool;
                    attr.int_value = i64::from(*b);
                }
                AttrValue::Ints(v) => {
                    attr.kind = AttrKind::Ints;
                    attr.ints = v.as_ptr();
                    attr.len = v.len();
                }
                AttrValue::Floats(v) => {
                    attr.kind = AttrKind::Floats;
                    attr.floats = v.as_ptr();
                    attr.len = v.len();
                }
                AttrValue::Strs(v) => {
                    let owned = v
                        .iter()
                        .map(|s| c_string(s))
                        .collect::<Result<Vec<_>, _>>()?;
                    let ptrs: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
                    attr.kind = AttrKind::Strs;
                    attr.strs = ptrs.as_ptr();
                    attr.len = ptrs.len();
                    strings.extend(owned);
                    lists.push(ptrs);
                }
            }
            attrs.push(attr);
        }
        Ok(CAttrs {
            _strings: strings,
            _lists: lists,
            attrs,
        })
    }
}

impl BoundCall {
    /// Finds the operator `op` (`aten.mm.default`) and binds it to a node with `num_inputs`
    /// tensor inputs and `attributes`. Device arguments of the graph's `home` device type run on
    /// `run`. Fails when libtorch has no such operator or the node does not fit its schema.
    pub fn bind(
        op: &str,
        num_inputs: usize,
        attributes: &[Attribute],
        home: Device,
        run: Device,
    ) -> Result<BoundCall, BindError> {
        let (name, overload) = schema_name(op).ok_or_else(|| {
            BindError::Mismatch(format!("`{op}` is not `namespace.name.overload`"))
        })?;
        let (name, overload) = (c_string(&name)?, c_string(&overload)?);
        let attrs = CAttrs::new(attributes)?;
        let (home_type, _) = device_code(home);
        let (run_type, run_index) = device_code(run);
        let mut call = std::ptr::null_mut();
        let mut status = BindStatus::Mismatch.code();
        // SAFETY: every pointer is valid for the call; the shim copies what it keeps.
        let message = take_string(unsafe {
            sys::rt_bind(
                name.as_ptr(),
                overload.as_ptr(),
                num_inputs,
                attrs.attrs.as_ptr(),
                attrs.attrs.len(),
                home_type,
                run_type,
                run_index,
                &mut call,
                &mut status,
            )
        });
        match (BindStatus::from_code(status), message) {
            (Some(BindStatus::Ok), None) => {}
            (Some(BindStatus::NoSuchOperator), _) => {
                return Err(BindError::NoSuchOperator(op.to_owned()))
            }
            (_, message) => {
                let message = message.unwrap_or_else(|| format!("binding failed ({status})"));
                return Err(BindError::Mismatch(message));
            }
        }
        let call = NonNull::new(call)
            .ok_or_else(|| BindError::Mismatch("the shim bound nothing".to_owned()))?;
        Ok(BoundCall {
            call,
            num_inputs,
            deterministic: false,
        })
    }

    /// The same call, run under PyTorch's deterministic algorithms: for a kernel that sums in
    /// no fixed order (the op knowledge base knows which), so that two runs on the same inputs
    /// agree bit for bit whatever the thread count.
    pub fn deterministic(mut self) -> BoundCall {
        self.deterministic = true;
        self
    }

    /// Whether libtorch has a kernel for this operator on `device` (its own, a composite one
    /// or a fallback).
    pub fn runs_on(&self, device: Device) -> bool {
        // SAFETY: a live bound call.
        unsafe { sys::rt_call_runs_on(self.call.as_ptr(), device_code(device).0) != 0 }
    }

    /// The operator's schema as libtorch prints it.
    pub fn schema(&self) -> String {
        // SAFETY: a live bound call; the result is a malloc'd string (or null).
        take_string(unsafe { sys::rt_call_schema(self.call.as_ptr()) }).unwrap_or_default()
    }

    /// Runs the operator on `inputs`; returns the tensors it produced (at most `max_outputs`).
    pub fn run(&self, inputs: &[&Tensor], max_outputs: usize) -> Result<Vec<Tensor>, String> {
        if inputs.len() != self.num_inputs {
            return Err(format!(
                "called with {} inputs, bound for {}",
                inputs.len(),
                self.num_inputs
            ));
        }
        let ptrs: Vec<*const sys::AtTensor> = inputs.iter().map(|t| sys::at(t)).collect();
        let mut outputs: Vec<*mut sys::AtTensor> = vec![std::ptr::null_mut(); max_outputs];
        let mut count = 0usize;
        // SAFETY: `ptrs` point at live tensors; `outputs` has room for `max_outputs`.
        check(unsafe {
            sys::rt_call_run(
                self.call.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len(),
                i32::from(self.deterministic),
                outputs.as_mut_ptr(),
                max_outputs,
                &mut count,
            )
        })?;
        Ok(outputs
            .into_iter()
            .take(count)
            // SAFETY: each is a fresh `at::Tensor*` the shim made for us to own.
            .map(|p| unsafe { Tensor::from_ptr(p.cast()) })
            .collect())
    }
}

/// The storage a tensor's data lives in: an identity (the same for every view of it) and its
/// size in bytes; `None` for a tensor without storage.
pub fn storage(tensor: &Tensor) -> Option<(usize, u64)> {
    let (mut key, mut nbytes) = (0usize, 0usize);
    // SAFETY: a live tensor; the shim writes the two integers.
    unsafe { sys::rt_storage(sys::at(tensor), &mut key, &mut nbytes) };
    (key != 0).then_some((key, nbytes as u64))
}

/// The state of the default generator of `device`.
pub fn rng_state(device: Device) -> Result<Tensor, String> {
    let (kind, index) = device_code(device);
    let mut out = std::ptr::null_mut();
    // SAFETY: the shim writes a fresh `at::Tensor*` on success.
    check(unsafe { sys::rt_rng_get_state(kind, index, &mut out) })?;
    // SAFETY: as above.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

/// The state the default generator of `device` has once seeded with `seed` (the generator
/// itself is left alone).
pub fn seeded_rng_state(device: Device, seed: u64) -> Result<Tensor, String> {
    let (kind, index) = device_code(device);
    let mut out = std::ptr::null_mut();
    // SAFETY: the shim writes a fresh `at::Tensor*` on success.
    check(unsafe { sys::rt_rng_seeded_state(kind, index, seed, &mut out) })?;
    // SAFETY: as above.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

/// Restores the default generator of `device` to `state`.
pub fn set_rng_state(device: Device, state: &Tensor) -> Result<(), String> {
    let (kind, index) = device_code(device);
    // SAFETY: a live tensor.
    check(unsafe { sys::rt_rng_set_state(kind, index, sys::at(state)) })
}

/// A hold on the process-wide changes a run makes to libtorch, in place while any hold lives
/// and undone when the last one drops, so code around the runtime sees libtorch as it was:
///
/// - libtorch's CPU Bernoulli sampler (dropout masks) draws as PyTorch's own kernel does on
///   every CPU (PyTorch's MKL builds draw other masks on Intel CPUs, and the exporter's
///   reference uses the portable draw);
/// - an allocator in front of libtorch's CPU allocator holds each thread to the budget
///   [`with_allocation_budget`] sets.
///
/// A prepared program holds one ([`crate::program::Program`]). While a hold lives the changes
/// apply to the whole process, other threads included.
#[derive(Debug)]
pub struct KernelOverrides(());

impl KernelOverrides {
    pub fn acquire() -> Result<KernelOverrides, String> {
        // SAFETY: plain call.
        check(unsafe { sys::rt_kernel_overrides_acquire() })?;
        Ok(KernelOverrides(()))
    }
}

impl Drop for KernelOverrides {
    fn drop(&mut self) {
        // SAFETY: plain call; releasing only counts down and restores, and cannot fail but
        // through a C++ exception the shim turns into a message, which a drop can only drop.
        drop(take_string(unsafe { sys::rt_kernel_overrides_release() }));
    }
}

/// The CPU allocator libtorch allocates with now (an identity to compare).
pub fn cpu_allocator() -> usize {
    // SAFETY: plain call.
    unsafe { sys::rt_cpu_allocator() }
}

/// Whether PyTorch's deterministic algorithms are on (process-wide).
pub fn deterministic_algorithms() -> bool {
    // SAFETY: plain call.
    unsafe { sys::rt_deterministic_algorithms() != 0 }
}

/// The dispatcher's account of operator `op` (`aten.bernoulli_.float`): its kernels by
/// dispatch key and where each was registered.
pub fn operator_state(op: &str) -> Result<String, String> {
    let (name, overload) =
        schema_name(op).ok_or_else(|| format!("`{op}` is not `namespace.name.overload`"))?;
    let overload = if overload == "default" {
        String::new()
    } else {
        overload
    };
    let (name, overload) = (c_string(&name)?, c_string(&overload)?);
    let mut out = std::ptr::null_mut();
    // SAFETY: valid strings; the shim writes a malloc'd string on success.
    check(unsafe { sys::rt_operator_state(name.as_ptr(), overload.as_ptr(), &mut out) })?;
    Ok(take_string(out).unwrap_or_default())
}

/// Runs `body` with this thread's CPU allocations held to `bytes` in all: an allocation past
/// the budget fails in libtorch (the op returns an error) and is not made. Returns `body`'s
/// result and the size of the first allocation refused, if any.
pub fn with_allocation_budget<R>(bytes: u64, body: impl FnOnce() -> R) -> (R, Option<u64>) {
    /// Lifts the budget even when `body` panics.
    struct Lift;
    impl Drop for Lift {
        fn drop(&mut self) {
            // SAFETY: plain call on this thread's state.
            unsafe { sys::rt_set_allocation_budget(-1) }
        }
    }
    // SAFETY: plain call on this thread's state.
    unsafe { sys::rt_set_allocation_budget(i64::try_from(bytes).unwrap_or(i64::MAX)) };
    let lift = Lift;
    let result = body();
    // SAFETY: plain call on this thread's state.
    let refused = unsafe { sys::rt_refused_allocation() };
    drop(lift);
    (result, (refused > 0).then_some(refused))
}

/// Makes `device` the calling thread's current CUDA device (nothing for the CPU).
pub fn set_device(device: Device) -> Result<(), String> {
    match cuda_index(device) {
        // SAFETY: plain call.
        Some(index) => check(unsafe { sys::rt_cuda_set_device(index) }),
        None => Ok(()),
    }
}

/// The `cudaStream_t` ATen launches kernels on for a CUDA device.
pub fn current_stream(device: Device) -> Result<*mut c_void, String> {
    let index = cuda_index(device).ok_or("the CPU has no stream")?;
    let mut stream = std::ptr::null_mut();
    // SAFETY: the shim writes the handle.
    check(unsafe { sys::rt_cuda_current_stream(index, &mut stream) })?;
    Ok(stream)
}

/// Waits for everything queued on a CUDA device's current stream (nothing for the CPU).
pub fn synchronize(device: Device) -> Result<(), String> {
    match cuda_index(device) {
        // SAFETY: plain call.
        Some(index) => check(unsafe { sys::rt_cuda_synchronize(index) }),
        None => Ok(()),
    }
}

/// The CUDA caching allocator's peak allocated bytes since its last reset.
pub fn cuda_peak_allocated(device: Device) -> Result<u64, String> {
    let index = cuda_index(device).ok_or("the CPU has no caching allocator")?;
    let mut peak = 0u64;
    // SAFETY: the shim writes the integer.
    check(unsafe { sys::rt_cuda_peak_allocated(index, &mut peak) })?;
    Ok(peak)
}

/// Resets the CUDA caching allocator's peak statistics.
pub fn cuda_reset_peak(device: Device) -> Result<(), String> {
    let index = cuda_index(device).ok_or("the CPU has no caching allocator")?;
    // SAFETY: plain call.
    check(unsafe { sys::rt_cuda_reset_peak(index) })
}

/// A CUDA event recorded on a device's current stream.
#[derive(Debug)]
pub struct Event(NonNull<c_void>);

// SAFETY: a CUDA event may be queried and destroyed from any thread.
unsafe impl Send for Event {}

impl Event {
    /// Records an event after everything queued so far on `device`'s current stream.
    pub fn record(device: Device) -> Result<Event, String> {
        let index = cuda_index(device).ok_or("the CPU has no stream")?;
        let mut event = std::ptr::null_mut();
        // SAFETY: the shim writes a fresh event.
        check(unsafe { sys::rt_cuda_record_event(index, &mut event) })?;
        NonNull::new(event)
            .map(Event)
            .ok_or_else(|| "no event".to_owned())
    }

    /// Whether everything queued before the event has run (`Err` if the device failed).
    pub fn done(&self) -> Result<bool, String> {
        // SAFETY: a live event.
        match EventState::from_code(unsafe { sys::rt_event_query(self.0.as_ptr()) }) {
            Some(EventState::Done) => Ok(true),
            Some(EventState::Pending) => Ok(false),
            Some(EventState::Failed) | None => Err("the device reported an error".to_owned()),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: made by `rt_cuda_record_event`, freed once.
        unsafe { sys::rt_event_free(self.0.as_ptr()) }
    }
}
