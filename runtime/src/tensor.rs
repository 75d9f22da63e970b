//! The bridge between IR values and libtorch tensors.

use ir::{DType, Value};
use tch::{Device, Kind, Tensor};
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TensorError {
    #[error("value `{value}`: dimension of size {size} does not fit libtorch's i64 sizes")]
    DimTooLarge { value: String, size: u64 },
}

/// A libtorch error in one line: its first, without the C++ backtrace libtorch appends.
pub fn one_line(message: &str) -> String {
    message.lines().next().unwrap_or_default().to_owned()
}

/// The libtorch element kind of an IR dtype.
pub fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::F32 => Kind::Float,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F64 => Kind::Double,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::I16 => Kind::Int16,
        DType::I8 => Kind::Int8,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
        DType::F8E4M3 => Kind::Float8e4m3fn,
        DType::F8E5M2 => Kind::Float8e5m2,
        DType::C64 => Kind::ComplexFloat,
    }
}

/// The shape of `value` as libtorch sizes.
pub fn sizes_of(value: &Value) -> Result<Vec<i64>, TensorError> {
    value
        .shape
        .iter()
        .map(|&size| {
            i64::try_from(size).map_err(|_| TensorError::DimTooLarge {
                value: value.name.to_string(),
                size,
            })
        })
        .collect()
}

/// A zero tensor with the shape and dtype `value` declares.
pub fn zeros_like_value(value: &Value, device: Device) -> Result<Tensor, TensorError> {
    Ok(Tensor::zeros(
        sizes_of(value)?,
        (kind_of(value.dtype), device),
    ))
}
