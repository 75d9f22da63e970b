//! The tensors a rank starts from: weights, data inputs and tangents, and PyTorch's reference
//! loss and gradients to check against, from the graph's safetensors twin.
//!
//! Keys, as the exporter writes them: `param/<value>` (parameters and buffers), `input/<value>`,
//! `tangent/<value>`, `ref/loss`, `ref/grad/<gradient value>`, and `rng/seed` (the seed of
//! the CPU generator the reference step started from). A value with no tensor is filled
//! from a seed when one is given (floats uniform in [-0.5, 0.5), integers zero, which is a valid
//! index for any embedding or loss target), and is an error otherwise.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use ir::{
    io::{read_input_file_within, InputKind},
    Graph, LoadError, Role, ValueId,
};
use safetensors::{tensor::TensorView, Dtype, SafeTensorError, SafeTensors};
use tch::{Device, Kind, Tensor};
use thiserror::Error;

use crate::tensor::{kind_of, one_line, sizes_of};

/// The key of the reference step's generator seed.
const RNG_SEED: &str = "rng/seed";

#[derive(Debug, Error)]
pub enum InputError {
    /// The file could not be read (not a regular file, over the limit, unreadable).
    #[error("{0}")]
    File(LoadError),
    #[error("{path}: not a valid safetensors file: {reason}")]
    Format { path: String, reason: String },
    #[error("{path}: tensor `{key}`: {reason}")]
    Tensor {
        path: String,
        key: String,
        reason: String,
    },
    #[error("{path}: `{key}` is {got}, but value `{value}` is {want}")]
    Mismatch {
        path: String,
        key: String,
        value: String,
        got: String,
        want: String,
    },
    #[error(
        "{path}: `{RNG_SEED}` must hold one integer >= 0 (the seed of the reference step's \
         generator), but it is {got}"
    )]
    Seed { path: String, got: String },
    #[error("no tensor for {role} `{value}` ({source_name}); pass --seed to fill missing inputs")]
    Missing {
        role: &'static str,
        value: String,
        source_name: String,
    },
    #[error("cannot fill {role} `{value}` from the seed: {reason}")]
    Fill {
        role: &'static str,
        value: String,
        reason: String,
    },
    #[error("{0}")]
    Shape(#[from] crate::tensor::TensorError),
}

/// The reference a rank's results are checked against.
#[derive(Debug, Default)]
pub struct Reference {
    pub loss: Option<Tensor>,
    /// By gradient value name.
    pub grads: HashMap<String, Tensor>,
}

/// Everything one rank starts from.
#[derive(Debug)]
pub struct RankInputs {
    /// One tensor per graph input, on the run's device.
    pub values: Vec<(ValueId, Tensor)>,
    pub reference: Reference,
    /// Graph inputs filled from the seed (the reference does not apply to a filled rank).
    pub seeded: Vec<ValueId>,
    /// The seed of the CPU generator the reference step started from, if recorded.
    pub rng_seed: Option<u64>,
}

/// Rank `rank`'s version of a file: `path` itself for rank 0, `STEM.rank<r>.EXT` beside it for
/// the others (`model.safetensors` -> `model.rank1.safetensors`).
pub fn rank_path(path: &Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_owned();
    }
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// The safetensors twin of a graph file (`model.pb` -> `model.safetensors`).
pub fn twin(graph_path: &Path) -> PathBuf {
    graph_path.with_extension("safetensors")
}

fn describe(kind: Kind, sizes: &[i64]) -> String {
    format!("{kind:?}{sizes:?}")
}

/// This machine's memory (`MemTotal` in `/proc/meminfo`): by default, the most bytes of
/// inputs a run starts from. `None` where it cannot be read.
pub fn machine_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The bytes of graph inputs a rank of `graph` starts from (weights, inputs, tangents), as the
/// graph declares them: what loading its inputs allocates, known before anything is read.
pub fn declared_bytes(graph: &Graph) -> u64 {
    graph
        .values()
        .iter()
        .filter(|(id, _)| graph.producer(*id).is_none())
        .fold(0u64, |total, (_, value)| total.saturating_add(value.bytes))
}

/// The tensors of a safetensors file, by key; an empty map when the file does not exist. The
/// file is read through the bounded reader (a regular file of at most `max_bytes`), then
/// every tensor is checked and copied out of it.
fn read_tensors(
    path: &Path,
    max_bytes: u64,
) -> Result<Option<HashMap<String, Tensor>>, InputError> {
    let bytes = match read_input_file_within(path, InputKind::Tensors, max_bytes) {
        Ok(bytes) => bytes,
        Err(LoadError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(InputError::File(e)),
    };
    let shown = ir::display::path(path).to_string();
    let file = SafeTensors::deserialize(&bytes).map_err(|e| InputError::Format {
        path: shown.clone(),
        reason: format_reason(e),
    })?;
    let mut tensors = HashMap::new();
    for (key, view) in file.tensors() {
        let tensor = tensor_of(&view).map_err(|reason| InputError::Tensor {
            path: shown.clone(),
            key: ir::display::name(&key).to_string(),
            reason,
        })?;
        tensors.insert(key, tensor);
    }
    Ok(Some(tensors))
}

/// Why a safetensors file is malformed, in plain words.
fn format_reason(error: SafeTensorError) -> String {
    match error {
        SafeTensorError::HeaderTooSmall => {
            "it is shorter than the 8 bytes that give its header's length".to_owned()
        }
        SafeTensorError::InvalidHeaderLength => {
            "the header length it starts with runs past the end of the file".to_owned()
        }
        SafeTensorError::HeaderTooLarge => "its header is over the format's 100 MB".to_owned(),
        SafeTensorError::InvalidHeader => "its header is not UTF-8 text".to_owned(),
        SafeTensorError::InvalidHeaderStart => "its header does not start with `{`".to_owned(),
        SafeTensorError::InvalidHeaderDeserialization => "its header is not JSON".to_owned(),
        SafeTensorError::JsonError(e) => format!("its header is not valid: {e}"),
        SafeTensorError::TensorNotFound(key) => {
            format!("it holds no tensor `{}`", ir::display::name(&key))
        }
        SafeTensorError::TensorInvalidInfo => {
            "a tensor's byte range does not match its shape and dtype".to_owned()
        }
        SafeTensorError::InvalidOffset(key) => format!(
            "the byte range of tensor `{}` is not where the previous one ends",
            ir::display::name(&key)
        ),
        SafeTensorError::InvalidTensorView(dtype, shape, bytes) => {
            format!("a {dtype:?} tensor of shape {shape:?} cannot hold {bytes} bytes")
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            "its tensors do not cover its data section exactly".to_owned()
        }
        SafeTensorError::ValidationOverflow => {
            "a tensor's size in bytes overflows 64 bits".to_owned()
        }
        SafeTensorError::IoError(e) => e.to_string(),
    }
}

/// A libtorch tensor holding a copy of `view`'s data.
fn tensor_of(view: &TensorView<'_>) -> Result<Tensor, String> {
    let kind = match view.dtype() {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        other => return Err(format!("dtype {other:?} is not one the runtime reads")),
    };
    let sizes = view
        .shape()
        .iter()
        .map(|&d| i64::try_from(d).map_err(|_| format!("dimension {d} is too large")))
        .collect::<Result<Vec<i64>, String>>()?;
    Tensor::f_from_data_size(view.data(), &sizes, kind).map_err(|e| one_line(&e.to_string()))
}

/// The seed in `rng/seed`: one integer >= 0, of any integer dtype and any shape of one element.
fn rng_seed(path: &str, tensor: &Tensor) -> Result<u64, InputError> {
    let bad = || InputError::Seed {
        path: path.to_owned(),
        got: describe(tensor.kind(), &tensor.size()),
    };
    let integer = matches!(
        tensor.kind(),
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
    );
    if !integer || tensor.numel() != 1 {
        return Err(bad());
    }
    let value = tensor
        .f_reshape([-1])
        .and_then(|t| t.f_int64_value(&[0]))
        .map_err(|_| bad())?;
    u64::try_from(value).map_err(|_| bad())
}

/// Reads `path` (if it exists, at most `max_bytes` of it) and builds the rank's inputs;
/// missing tensors are filled from `seed` (mixed with `rank`) when given.
pub fn load(
    graph: &Graph,
    path: &Path,
    rank: usize,
    seed: Option<u64>,
    device: Device,
    max_bytes: u64,
) -> Result<RankInputs, InputError> {
    let display = ir::display::path(path).to_string();
    let file = read_tensors(path, max_bytes)?;
    let exists = file.is_some();
    let mut tensors = file.unwrap_or_default();
    let mut fill = seed.map(|s| Fill::new(s, rank));
    let mut values = Vec::new();
    let mut seeded = Vec::new();
    for (id, value) in graph.values().iter() {
        if graph.producer(id).is_some() {
            continue;
        }
        let prefix = match value.role {
            Role::Parameter | Role::Buffer => "param",
            Role::Tangent => "tangent",
            _ => "input",
        };
        let key = format!("{prefix}/{}", value.name);
        let want_kind = kind_of(value.dtype);
        let want_sizes = sizes_of(value)?;
        let tensor = match tensors.remove(&key) {
            Some(t) => {
                if t.kind() != want_kind || t.size() != want_sizes {
                    return Err(InputError::Mismatch {
                        path: display,
                        key,
                        value: value.name.to_string(),
                        got: describe(t.kind(), &t.size()),
                        want: describe(want_kind, &want_sizes),
                    });
                }
                t
            }
            None => {
                let fill = fill.as_mut().ok_or_else(|| InputError::Missing {
                    role: value.role.name(),
                    value: value.name.to_string(),
                    source_name: if exists {
                        format!("`{key}` is not in {display}")
                    } else {
                        format!("{display} does not exist")
                    },
                })?;
                seeded.push(id);
                fill.tensor(want_kind, &want_sizes)
                    .map_err(|reason| InputError::Fill {
                        role: value.role.name(),
                        value: value.name.to_string(),
                        reason,
                    })?
            }
        };
        let tensor = tensor.f_to_device(device).map_err(|e| InputError::Tensor {
            path: display.clone(),
            key,
            reason: one_line(&e.to_string()),
        })?;
        values.push((id, tensor));
    }
    let mut reference = Reference {
        loss: tensors.remove("ref/loss"),
        grads: HashMap::new(),
    };
    let rng_seed = tensors
        .remove(RNG_SEED)
        .map(|t| rng_seed(&display, &t))
        .transpose()?;
    for (key, tensor) in tensors {
        if let Some(name) = key.strip_prefix("ref/grad/") {
            reference.grads.insert(name.to_owned(), tensor);
        }
    }
    Ok(RankInputs {
        values,
        reference,
        seeded,
        rng_seed,
    })
}

/// Deterministic fill values (splitmix64), the same on every machine.
struct Fill {
    state: u64,
}

impl Fill {
    fn new(seed: u64, rank: usize) -> Fill {
        Fill {
            state: seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        }
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A tensor of `kind` and `sizes` from the stream; an allocation that fails is an error.
    fn tensor(&mut self, kind: Kind, sizes: &[i64]) -> Result<Tensor, String> {
        if !is_float(kind) {
            return Tensor::f_zeros(sizes, (kind, Device::Cpu))
                .map_err(|e| one_line(&e.to_string()));
        }
        let numel = sizes
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
            .ok_or("its number of elements overflows")?;
        let mut data: Vec<f32> = Vec::new();
        data.try_reserve_exact(numel)
            .map_err(|_| format!("cannot allocate {numel} elements"))?;
        data.extend((0..numel).map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5));
        Tensor::f_from_slice(&data)
            .and_then(|t| t.f_reshape(sizes))
            .and_then(|t| t.f_to_kind(kind))
            .map_err(|e| one_line(&e.to_string()))
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}
