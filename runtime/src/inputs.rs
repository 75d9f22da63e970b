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

use ir::{Graph, Role, ValueId};
use tch::{Device, Kind, Tensor};
use thiserror::Error;

use crate::tensor::{kind_of, sizes_of};

#[derive(Debug, Error)]
pub enum InputError {
    #[error("{path}: {message}")]
    Read { path: String, message: String },
    #[error("{path}: `{key}` is {got}, but value `{value}` is {want}")]
    Mismatch {
        path: String,
        key: String,
        value: String,
        got: String,
        want: String,
    },
    #[error("no tensor for {role} `{value}` ({source_name}); pass --seed to fill missing inputs")]
    Missing {
        role: &'static str,
        value: String,
        source_name: String,
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

/// Reads `path` (if it exists) and builds the rank's inputs; missing tensors are filled from
/// `seed` (mixed with `rank`) when given.
pub fn load(
    graph: &Graph,
    path: &Path,
    rank: usize,
    seed: Option<u64>,
    device: Device,
) -> Result<RankInputs, InputError> {
    let display = path.display().to_string();
    let mut tensors: HashMap<String, Tensor> = if path.exists() {
        Tensor::read_safetensors(path)
            .map_err(|e| InputError::Read {
                path: display.clone(),
                message: e.to_string(),
            })?
            .into_iter()
            .collect()
    } else {
        HashMap::new()
    };
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
                    source_name: if path.exists() {
                        format!("`{key}` is not in {display}")
                    } else {
                        format!("{display} does not exist")
                    },
                })?;
                seeded.push(id);
                fill.tensor(want_kind, &want_sizes)
            }
        };
        values.push((id, tensor.to_device(device)));
    }
    let mut reference = Reference {
        loss: tensors.remove("ref/loss"),
        grads: HashMap::new(),
    };
    let rng_seed = tensors
        .remove("rng/seed")
        .and_then(|t| u64::try_from(t.int64_value(&[])).ok());
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

    fn tensor(&mut self, kind: Kind, sizes: &[i64]) -> Tensor {
        let numel: i64 = sizes.iter().product();
        if !is_float(kind) {
            return Tensor::zeros(sizes, (kind, Device::Cpu));
        }
        let data: Vec<f32> = (0..numel)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        Tensor::from_slice(&data).reshape(sizes).to_kind(kind)
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}
