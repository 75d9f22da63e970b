//! Retires the toolchain risk: libtorch from the pinned pip torch links, loads and computes.

use ir::{DType, Role, Value};
use runtime::tensor::{kind_of, sizes_of, zeros_like_value, TensorError};
use tch::{Device, Kind, Tensor};

fn value(dtype: DType, shape: &[u64]) -> Value {
    Value {
        name: "v".into(),
        dtype,
        shape: shape.into(),
        role: Role::Activation,
        bytes: shape.iter().product::<u64>() * dtype.size_bytes(),
    }
}

#[test]
fn matmul_runs_on_cpu_and_gives_the_right_numbers() {
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).reshape([2, 2]);
    let b = Tensor::from_slice(&[5.0f32, 6.0, 7.0, 8.0]).reshape([2, 2]);
    let c = a.mm(&b);
    let got: Vec<f32> = Vec::try_from(c.reshape([-1])).expect("f32 tensor converts to Vec");
    assert_eq!(got, vec![19.0, 22.0, 43.0, 50.0]);
}

#[test]
fn ir_values_become_tensors_of_the_declared_kind_shape_and_byte_size() {
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::I64,
        DType::Bool,
        DType::F8E4M3,
    ] {
        let v = value(dtype, &[3, 5]);
        let t = zeros_like_value(&v, Device::Cpu).expect("small shape");
        assert_eq!(t.size(), vec![3, 5]);
        assert_eq!(t.kind(), kind_of(dtype));
        let bytes = t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        assert_eq!(
            bytes, v.bytes,
            "{dtype}: libtorch and ir disagree on byte size"
        );
    }
    assert_eq!(kind_of(DType::BF16), Kind::BFloat16);
}

#[test]
fn a_dimension_beyond_i64_is_an_error_not_a_panic() {
    let v = value(DType::U8, &[u64::MAX]);
    assert_eq!(
        sizes_of(&v),
        Err(TensorError::DimTooLarge {
            value: "v".to_owned(),
            size: u64::MAX
        })
    );
}

/// NCCL is the torch wheel's own `libnccl.so.2` (which libtorch_cuda loads), opened without a
/// link of its own or a library path; making a unique id needs no GPU.
#[test]
fn the_wheels_nccl_loads_and_makes_a_unique_id() {
    assert!(runtime::comm::nccl::available());
    let id = runtime::comm::nccl::unique_id().expect("a unique id");
    assert_eq!(id.len(), 128);
    assert!(id.iter().any(|&b| b != 0), "an id that is all zeros");
}
