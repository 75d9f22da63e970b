//! A graph made executable: one kernel per node, checked before anything runs.
//!
//! ATen ops are bound to libtorch's dispatcher by schema name ([`BoundCall`]); the marker op
//! runs as the copy eager PyTorch makes (`aten.clone`); `wait_tensor` is an identity; functional collectives go to the [`Communicator`]
//! (crate::comm) instead of libtorch. Preparing fails on the first node, in execution order,
//! whose op the runtime cannot execute on the run's device.

use ir::{AttrValue, Attribute, EntityId, Graph, Node, NodeId, MARKER_OP};
use tch::Device;
use thiserror::Error;

use crate::{
    comm::ReduceOp,
    ffi::{self, BoundCall},
};

/// The namespace of functional collectives (`_c10d_functional.all_to_all_single.default`).
const FUNCTIONAL_COLLECTIVES: &str = "_c10d_functional.";
const WAIT_TENSOR: &str = "_c10d_functional.wait_tensor.default";
/// What the marker op does: `checkpoint_record` returns a copy of its input. The runtime makes
/// the copy too, so that its memory is the graph's as exported, which the planner predicts (an
/// identity would hold one tensor less wherever a marker's input and output are both live).
const MARKER_KERNEL: &str = "aten.clone.default";

/// What runs for one node.
#[derive(Debug)]
pub enum Kernel {
    /// An ATen operator through the dispatcher; one whose kernel sums in no fixed order (the op
    /// knowledge base says which: `index_put` accumulating, scatter-adds) runs under PyTorch's
    /// deterministic algorithms, so that `--check` compares plans, not thread schedules.
    Aten(BoundCall),
    /// The output is the input itself, no copy (`wait_tensor`: collectives complete before
    /// they return).
    Identity,
    /// A functional collective, through the rank's communicator.
    Collective(Collective),
}

/// A functional collective over the whole world (the only group the IR's graphs use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Collective {
    /// Rows `input_splits[j]` of the input go to rank `j`; `output_splits[i]` rows come from
    /// rank `i`, concatenated along dim 0.
    AllToAll {
        output_splits: Vec<i64>,
        input_splits: Vec<i64>,
    },
    /// Every rank's input, concatenated along dim 0.
    AllGather,
    /// The ranks' inputs reduced, then split along dim 0; this rank keeps its slice.
    ReduceScatter(ReduceOp),
    /// The ranks' inputs reduced.
    AllReduce(ReduceOp),
}

impl Collective {
    /// The name collective errors use (`all_to_all_single`).
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllToAll { .. } => "all_to_all_single",
            Collective::AllGather => "all_gather_into_tensor",
            Collective::ReduceScatter(_) => "reduce_scatter_tensor",
            Collective::AllReduce(_) => "all_reduce",
        }
    }
}

/// Why a graph cannot run.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PrepareError {
    #[error("unsupported op `{op}` (first used by node `{node}`): {reason}")]
    Unsupported {
        op: String,
        node: String,
        reason: String,
    },
    #[error("node `{node}` ({op}) does not fit the op's schema: {reason}")]
    Binding {
        op: String,
        node: String,
        reason: String,
    },
    #[error(
        "node `{node}` ({op}) is a collective of {group_size} ranks, but the run has {world_size}"
    )]
    GroupSize {
        op: String,
        node: String,
        group_size: i64,
        world_size: usize,
    },
}

/// A graph with a kernel for every node, for one device and world size.
#[derive(Debug)]
pub struct Program<'g> {
    graph: &'g Graph,
    device: Device,
    kernels: Vec<Kernel>,
}

impl<'g> Program<'g> {
    /// Checks every op of `graph` against what the runtime executes on `device` with
    /// `world_size` ranks, and binds every node. The first node (in execution order) that
    /// cannot run is the error.
    pub fn prepare(
        graph: &'g Graph,
        device: Device,
        world_size: usize,
    ) -> Result<Program<'g>, PrepareError> {
        let home = home_device(graph);
        ffi::use_portable_bernoulli().map_err(|reason| PrepareError::Unsupported {
            op: "aten.bernoulli_.float".to_owned(),
            node: "-".to_owned(),
            reason,
        })?;
        let kernels = graph
            .nodes()
            .values()
            .map(|node| kernel(node, home, device, world_size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Program {
            graph,
            device,
            kernels,
        })
    }

    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn kernel(&self, node: NodeId) -> &Kernel {
        &self.kernels[node.index()]
    }
}

/// The device a graph was exported for: CUDA when any device argument names it (a GPU run
/// exported with fake CUDA tensors), else the CPU.
fn home_device(graph: &Graph) -> Device {
    let names_cuda = |node: &Node| {
        node.attributes.iter().any(|a| {
            a.name == "device" && matches!(&a.value, AttrValue::Str(d) if d.starts_with("cuda"))
        })
    };
    if graph.nodes().values().any(names_cuda) {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

fn kernel(
    node: &Node,
    home: Device,
    device: Device,
    world_size: usize,
) -> Result<Kernel, PrepareError> {
    let op = node.op.as_str();
    if op == WAIT_TENSOR {
        return Ok(Kernel::Identity);
    }
    if op.starts_with(FUNCTIONAL_COLLECTIVES) {
        return collective(node, world_size).map(Kernel::Collective);
    }
    if node.effects.collective.is_some() {
        return Err(unsupported(
            node,
            "mutating collectives (`c10d.*_`) are not executed; export functional collectives",
        ));
    }
    // The marker's one attribute, its name, is not an argument of the copy.
    let (op, attributes): (&str, &[Attribute]) = if op == MARKER_OP {
        (MARKER_KERNEL, &[])
    } else {
        (op, &node.attributes)
    };
    let call =
        BoundCall::bind(op, node.inputs.len(), attributes, home, device).map_err(|reason| {
            if reason.contains("Could not find schema") {
                unsupported(node, "libtorch has no such operator")
            } else {
                PrepareError::Binding {
                    op: op.to_owned(),
                    node: node.name.to_string(),
                    reason,
                }
            }
        })?;
    if !call.runs_on(device) {
        let reason = format!("libtorch has no kernel for it on {}", device_name(device));
        return Err(unsupported(node, &reason));
    }
    if node.sums_in_no_fixed_order() {
        return Ok(Kernel::Aten(call.deterministic()));
    }
    Ok(Kernel::Aten(call))
}

fn unsupported(node: &Node, reason: &str) -> PrepareError {
    PrepareError::Unsupported {
        op: node.op.to_string(),
        node: node.name.to_string(),
        reason: reason.to_owned(),
    }
}

/// `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse_device(text: &str) -> Option<Device> {
    match text {
        "cpu" => Some(Device::Cpu),
        "cuda" => Some(Device::Cuda(0)),
        _ => text.strip_prefix("cuda:")?.parse().ok().map(Device::Cuda),
    }
}

/// `cpu` or `cuda:N`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(index) => format!("cuda:{index}"),
        _ => "cpu".to_owned(),
    }
}

fn collective(node: &Node, world_size: usize) -> Result<Collective, PrepareError> {
    let name = node
        .op
        .strip_prefix(FUNCTIONAL_COLLECTIVES)
        .and_then(|rest| rest.rsplit_once('.'))
        .map_or("", |(name, _)| name);
    let collective = match name {
        "all_to_all_single" => Collective::AllToAll {
            output_splits: ints(node, "output_split_sizes")?,
            input_splits: ints(node, "input_split_sizes")?,
        },
        "all_gather_into_tensor" => {
            check_group_size(node, world_size)?;
            Collective::AllGather
        }
        "reduce_scatter_tensor" => {
            check_group_size(node, world_size)?;
            Collective::ReduceScatter(reduce_op(node)?)
        }
        "all_reduce" => Collective::AllReduce(reduce_op(node)?),
        _ => return Err(unsupported(node, "the runtime has no such collective")),
    };
    if node.inputs.len() != 1 || node.outputs.len() != 1 {
        return Err(binding(node, "a collective reads one tensor and makes one"));
    }
    if let Collective::AllToAll {
        output_splits,
        input_splits,
    } = &collective
    {
        if output_splits.len() != world_size || input_splits.len() != world_size {
            return Err(binding(
                node,
                &format!(
                    "split sizes {output_splits:?} / {input_splits:?} are not one per rank of {world_size}"
                ),
            ));
        }
    }
    Ok(collective)
}

fn binding(node: &Node, reason: &str) -> PrepareError {
    PrepareError::Binding {
        op: node.op.to_string(),
        node: node.name.to_string(),
        reason: reason.to_owned(),
    }
}

fn ints(node: &Node, name: &str) -> Result<Vec<i64>, PrepareError> {
    match node.attribute(name) {
        Some(AttrValue::Ints(v)) if v.iter().all(|&s| s >= 0) => Ok(v.clone()),
        _ => Err(binding(
            node,
            &format!("attribute `{name}` must be a list of sizes >= 0"),
        )),
    }
}

fn check_group_size(node: &Node, world_size: usize) -> Result<(), PrepareError> {
    match node.attribute("group_size") {
        Some(AttrValue::Int(g)) if usize::try_from(*g).ok() == Some(world_size) => Ok(()),
        Some(AttrValue::Int(g)) => Err(PrepareError::GroupSize {
            op: node.op.to_string(),
            node: node.name.to_string(),
            group_size: *g,
            world_size,
        }),
        _ => Err(binding(node, "attribute `group_size` must be an int")),
    }
}

fn reduce_op(node: &Node) -> Result<ReduceOp, PrepareError> {
    match node.attribute("reduce_op") {
        Some(AttrValue::Str(op)) => ReduceOp::from_name(op)
            .ok_or_else(|| binding(node, &format!("unknown reduce_op `{op}`"))),
        _ => Err(binding(node, "attribute `reduce_op` must be a string")),
    }
}
