//! The whole training state on one device (docs/cost-and-memory.md, M4): parameters,
//! gradients, optimizer state and master weights, sharded by FSDP, beside the activation peak
//! the simulation finds, and compared with the device's memory.
//!
//! The model, per device, with `N` the FSDP shard degree:
//! - **Unsharded** (`N` = 1): every parameter is resident; gradients are op outputs the
//!   simulation already counts as backward makes them (`peak_bytes` holds those alive at the
//!   peak), so they add nothing beyond it.
//! - **FSDP** (`N` > 1, `fully_shard` on every decoder layer and on the root, as FSDP2 is
//!   used): each device holds `1/N` of every parameter (rounded up, as FSDP pads), plus the
//!   unsharded parameters being computed: the root's (what no single layer reads: embeddings,
//!   final norm, head), gathered for the whole step, and two layers' (the one running and the
//!   one prefetched). Gradients are simulated ([`crate::memory::simulate_sharded`]): a layer's
//!   are whole until its backward ends and `1/N` after, and the flat copy reduce-scattered
//!   lives from then until the next layer's backward ends; the root's are whole to the end.
//! - **Optimizer state**: AdamW two moments, SGD with momentum one buffer, per parameter
//!   element, in fp32 or the parameter's dtype; **master weights**: an fp32 copy of each
//!   parameter that is not fp32 or fp64. Both are resident for the whole step (from the first
//!   optimizer step on) and sharded `1/N`.
//! - **Optimizer step**: parameter shards, gradient shards, the state and master weights, and
//!   the step's scratch: AdamW's multi-tensor kernel (`foreach`, PyTorch's default on GPUs)
//!   materialises the square roots of all second moments at once, one moment's bytes; SGD
//!   updates in place.
//!
//! The device total is the larger of the forward/backward total and the optimizer step's.

use ir::{
    plan::{DevicePhase, DeviceTotal, Optimizer, StateDtype, Training},
    DType, Graph, ModelId, Role, ValueId,
};

use crate::memory::Simulation;

ir::spelled! {
    /// What `--budget` bounds.
    #[derive(Default)]
    pub enum BudgetBasis {
        /// The activation peak the planner predicts (parameters are resident apart).
        #[default]
        Activations => "activations",
        /// Parameters plus the activation peak.
        Params => "params",
        /// The device total: parameters, gradients, optimizer state and master weights (as
        /// the FSDP degree, the optimizer and master weights say) plus the activation peak.
        TrainingState => "training-state",
    }
}

/// A budget that leaves nothing for the activation peak.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("budget {budget} is not above {what} alone ({needed}){hint}")]
pub struct BudgetTooSmall {
    budget: String,
    what: &'static str,
    needed: String,
    hint: &'static str,
}

/// The parameters and gradients of a graph, grouped as FSDP wraps them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Tensors {
    /// All of them.
    total: u64,
    /// Those no single decoder layer owns (read outside layers, or by several).
    root: u64,
    /// The largest one layer owns.
    largest_layer: u64,
}

impl Tensors {
    /// Groups `values` by the layer that owns each (`None`: the root).
    fn of(values: impl Iterator<Item = (u64, Option<(ModelId, u32)>)>) -> Tensors {
        let mut layers: Vec<((ModelId, u32), u64)> = Vec::new();
        let mut tensors = Tensors::default();
        for (bytes, layer) in values {
            tensors.total = tensors.total.saturating_add(bytes);
            match layer {
                None => tensors.root = tensors.root.saturating_add(bytes),
                Some(at) => layers.push((at, bytes)),
            }
        }
        layers.sort_unstable();
        tensors.largest_layer = layers
            .chunk_by(|a, b| a.0 == b.0)
            .map(|group| group.iter().fold(0u64, |acc, g| acc.saturating_add(g.1)))
            .max()
            .unwrap_or(0);
        tensors
    }

    /// What one device holds in forward and backward under FSDP degree `n`: its shard, the
    /// root unsharded, two layers unsharded; everything when unsharded.
    fn resident(&self, n: u32) -> u64 {
        if n == 1 {
            return self.total;
        }
        shard(self.total, n)
            .saturating_add(self.root)
            .saturating_add(self.largest_layer.saturating_mul(2))
    }
}

/// `bytes` split `n` ways, rounded up (FSDP pads each parameter to a multiple of `n`).
fn shard(bytes: u64, n: u32) -> u64 {
    bytes.div_ceil(u64::from(n))
}

/// The layer that owns parameter `v`: the one layer of every node that reads it.
fn owner(graph: &Graph, v: ValueId) -> Option<(ModelId, u32)> {
    let mut owners = graph.consumers(v).iter().map(|&n| {
        let node = graph.node(n);
        node.layer.map(|l| (node.model, l))
    });
    let first = owners.next()??;
    owners.all(|o| o == Some(first)).then_some(first)
}

/// The training state of a graph under `training`, apart from the activation peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// Every parameter, unsharded (what `--budget-includes params` adds to the peak).
    all_parameter_bytes: u64,
    /// Parameters held through forward and backward.
    parameter_bytes: u64,
    /// How far the peak with sharded gradients may exceed the unsharded `peak_bytes`: two
    /// layers' gradients, copied for the reduce-scatter (none unsharded).
    reduce_scatter_bytes: u64,
    optimizer_state_bytes: u64,
    master_weight_bytes: u64,
    /// The device total during the optimizer step.
    optimizer_step_bytes: u64,
}

impl State {
    pub fn of(graph: &Graph, training: &Training) -> State {
        let n = training.fsdp.max(1);
        let parameters: Vec<(ValueId, &ir::Value)> = graph
            .values()
            .iter()
            .filter(|(_, v)| v.role == Role::Parameter)
            .collect();
        let params = Tensors::of(
            parameters
                .iter()
                .map(|&(id, v)| (v.bytes, owner(graph, id))),
        );
        let grads = Tensors::of(graph.outputs().iter().filter_map(|&v| {
            let value = graph.value(v);
            (value.role == Role::Gradient).then(|| {
                let layer = graph.producer(v).and_then(|p| {
                    let node = graph.node(p);
                    node.layer.map(|l| (node.model, l))
                });
                (value.bytes, layer)
            })
        }));
        let sum = |f: &dyn Fn(&ir::Value) -> u64| {
            parameters
                .iter()
                .fold(0u64, |acc, (_, v)| acc.saturating_add(f(v)))
        };
        let optimizer_state = sum(&|v| state_bytes(v, training));
        let master = sum(&|v| master_bytes(v, training));
        let scratch = match training.optimizer {
            Optimizer::AdamW => optimizer_state / 2,
            Optimizer::Sgd | Optimizer::None => 0,
        };
        let optimizer_step = [params.total, grads.total, optimizer_state, master, scratch]
            .into_iter()
            .fold(0u64, |acc, bytes| acc.saturating_add(shard(bytes, n)));
        State {
            all_parameter_bytes: params.total,
            parameter_bytes: params.resident(n),
            reduce_scatter_bytes: if n == 1 {
                0
            } else {
                grads.largest_layer.saturating_mul(2)
            },
            optimizer_state_bytes: shard(optimizer_state, n),
            master_weight_bytes: shard(master, n),
            optimizer_step_bytes: optimizer_step,
        }
    }

    /// Everything the forward/backward total holds besides the peak of activations and
    /// gradients.
    fn fixed(&self) -> u64 {
        self.parameter_bytes
            .saturating_add(self.optimizer_state_bytes)
            .saturating_add(self.master_weight_bytes)
    }

    /// The device total with the peak of `simulation` (simulated with the gradients sharded
    /// `fsdp` ways), against `memory_bytes`.
    pub fn total(&self, simulation: &Simulation, memory_bytes: u64) -> DeviceTotal {
        let activation_bytes = simulation.peak_sharded_gradients;
        let step = self.fixed().saturating_add(activation_bytes);
        let (total_bytes, phase) = if self.optimizer_step_bytes > step {
            (self.optimizer_step_bytes, DevicePhase::OptimizerStep)
        } else {
            (step, DevicePhase::ForwardBackward)
        };
        DeviceTotal {
            total_bytes,
            phase,
            parameter_bytes: self.parameter_bytes,
            activation_bytes,
            optimizer_state_bytes: self.optimizer_state_bytes,
            master_weight_bytes: self.master_weight_bytes,
            optimizer_step_bytes: self.optimizer_step_bytes,
            memory_bytes,
        }
    }

    /// The activation peak (`peak_bytes`) a budget of `size` bytes on `basis` allows. Under
    /// FSDP the device total counts the peak with sharded gradients, at most two layers'
    /// reduce-scatter copies above `peak_bytes`, so bounding `peak_bytes` by the budget less
    /// those copies keeps the total within the budget.
    pub fn activation_budget(&self, size: u64, basis: BudgetBasis) -> Result<u64, BudgetTooSmall> {
        let (what, needed, hint) = match basis {
            BudgetBasis::Activations => return Ok(size),
            BudgetBasis::Params => ("the parameters", self.all_parameter_bytes, ""),
            BudgetBasis::TrainingState if self.optimizer_step_bytes > size => (
                "the optimizer step",
                self.optimizer_step_bytes,
                "; shard it with --fsdp",
            ),
            BudgetBasis::TrainingState => (
                "the training state",
                self.fixed().saturating_add(self.reduce_scatter_bytes),
                "; shard it with --fsdp",
            ),
        };
        size.checked_sub(needed)
            .filter(|&left| left > 0)
            .ok_or_else(|| BudgetTooSmall {
                budget: crate::units::format_bytes(size),
                what,
                needed: crate::units::format_bytes(needed),
                hint,
            })
    }
}

/// Optimizer state bytes of one parameter.
fn state_bytes(v: &ir::Value, training: &Training) -> u64 {
    let per_element: u64 = match training.optimizer {
        Optimizer::AdamW => 2,
        Optimizer::Sgd => 1,
        Optimizer::None => 0,
    };
    let element = match training.state_dtype {
        StateDtype::F32 => DType::F32.size_bytes(),
        StateDtype::Param => v.dtype.size_bytes(),
    };
    elements(v)
        .saturating_mul(element)
        .saturating_mul(per_element)
}

/// fp32 master weight bytes of one parameter (none for fp32 and fp64 parameters).
fn master_bytes(v: &ir::Value, training: &Training) -> u64 {
    let wide = matches!(v.dtype, DType::F32 | DType::F64);
    if !training.master_weights || wide {
        return 0;
    }
    elements(v).saturating_mul(DType::F32.size_bytes())
}

fn elements(v: &ir::Value) -> u64 {
    v.bytes / v.dtype.size_bytes().max(1)
}
