//! Comparing a step's results: bit for bit between two runs of the runtime, and within a
//! tolerance against PyTorch's reference.

use tch::{Device, Kind, Tensor};

/// Reference results agree when `|actual - expected| <= ATOL + RTOL * |expected|` everywhere.
/// PyTorch's float kernels give other last bits on other CPU models (vector widths, thread
/// splits), so the comparison with a reference made elsewhere needs room for a few ulps of
/// float32 accumulated over a step.
pub const RTOL: f64 = 1e-4;
pub const ATOL: f64 = 1e-5;

/// Whether two tensors have the same dtype, shape and bytes.
pub fn identical(a: &Tensor, b: &Tensor) -> bool {
    a.kind() == b.kind() && a.size() == b.size() && bytes(a) == bytes(b)
}

/// A fingerprint of a tensor's dtype, shape and bytes (32 hex digits): equal for tensors
/// [`identical`] says are the same, so runs in separate processes compare through it.
pub fn digest(t: &Tensor) -> String {
    let mut all = format!("{:?} {:?}\0", t.kind(), t.size()).into_bytes();
    all.extend(bytes(t));
    ir::fingerprint(&all)
}

fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let numel = t.numel();
    let mut out = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, numel);
    out
}

/// How far `actual` is from `expected`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Error {
    pub max_abs: f64,
    pub max_rel: f64,
    /// Within [`ATOL`] and [`RTOL`] everywhere (and the same shape).
    pub within: bool,
}

/// The largest absolute and relative differences of `actual` from `expected`.
pub fn error(actual: &Tensor, expected: &Tensor) -> Error {
    if actual.size() != expected.size() {
        return Error {
            max_abs: f64::INFINITY,
            max_rel: f64::INFINITY,
            within: false,
        };
    }
    if actual.numel() == 0 {
        return Error {
            max_abs: 0.0,
            max_rel: 0.0,
            within: true,
        };
    }
    let a = actual.to_device(Device::Cpu).to_kind(Kind::Double);
    let e = expected.to_device(Device::Cpu).to_kind(Kind::Double);
    let diff = (&a - &e).abs();
    let scale = e.abs();
    let max_abs = diff.max().double_value(&[]);
    let max_rel = (&diff / scale.clamp_min(f64::MIN_POSITIVE))
        .max()
        .double_value(&[]);
    let bound = scale * RTOL + ATOL;
    let within = diff.le_tensor(&bound).all().int64_value(&[]) != 0;
    Error {
        max_abs,
        max_rel,
        within: within && max_abs.is_finite(),
    }
}
