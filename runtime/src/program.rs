//! A graph made executable: one kernel per node, checked before anything runs.
//!
//! ATen ops are bound to libtorch's dispatcher by schema name ([`BoundCall`]); the marker op
//! runs as the copy eager PyTorch makes (`aten.clone`); `wait_tensor` is an identity; functional collectives go to the [`Communicator`]
//! (crate::comm) instead of libtorch. Preparing fails on the first node, in execution order,
//! whose op the runtime cannot execute on the run's device.

use std::sync::Arc;

use ir::{plan::Stage, AttrValue, Attribute, EntityId, Graph, Node, NodeId, MARKER_OP};
use tch::{Device, Tensor};
use thiserror::Error;

use crate::{
    comm::ReduceOp,
    ffi::{self, BindError, BoundCall, KernelOverrides},
    watch::{OpGuard, RankActivity},
};

/// What an op may allocate on the CPU, beyond [`ALLOCATION_FACTOR`] times the bytes of the
/// tensors it reads and writes as the graph declares them: room for the workspaces of small
/// ops. An op whose allocations pass its budget fails before the allocation is made.
pub const ALLOCATION_FLOOR: u64 = 256 << 20;
/// How many times its declared inputs and outputs an op may allocate (copies of
/// non-contiguous inputs, type promotion, intermediate results of composite ops).
pub const ALLOCATION_FACTOR: u64 = 4;

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
    /// Per node: the bytes its op may allocate on the CPU.
    budgets: Vec<u64>,
    /// Where the rank shows which op it runs, when it is watched.
    activity: Option<Arc<RankActivity>>,
    /// libtorch's process-wide settings for running it, in place while it lives.
    _overrides: KernelOverrides,
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
        let overrides = KernelOverrides::acquire().map_err(|reason| PrepareError::Unsupported {
            op: "-".to_owned(),
            node: "-".to_owned(),
            reason,
        })?;
        let kernels = graph
            .nodes()
            .iter()
            .map(|(_, node)| kernel(graph, node, home, device, world_size))
            .collect::<Result<Vec<_>, _>>()?;
        let budgets = graph
            .nodes()
            .values()
            .map(|node| allocation_budget(graph, node))
            .collect();
        Ok(Program {
            graph,
            device,
            kernels,
            budgets,
            activity: None,
            _overrides: overrides,
        })
    }

    /// The program with its ops shown on `activity` while they run.
    pub fn watched(self, activity: Arc<RankActivity>) -> Program<'g> {
        Program {
            activity: Some(activity),
            ..self
        }
    }

    /// Shows `node` of `stage` as the op the rank runs until the guard drops (`timed` when
    /// the watchdog limits how long it may run).
    pub fn showing(&self, stage: Stage, node: NodeId, timed: bool) -> Option<OpGuard<'_>> {
        self.activity.as_ref().map(|a| a.enter(stage, node, timed))
    }

    /// Runs `node`'s ATen op (`call`) of `stage` on `inputs`, within the node's allocation
    /// budget, shown on the rank's activity while it runs.
    pub fn run_aten(
        &self,
        stage: Stage,
        node: NodeId,
        call: &BoundCall,
        inputs: &[&Tensor],
    ) -> Result<Vec<Tensor>, String> {
        let _running = self.showing(stage, node, true);
        let budget = self.budgets[node.index()];
        let outputs = self.graph.node(node).outputs.len();
        match ffi::with_allocation_budget(budget, || call.run(inputs, outputs)) {
            (Err(_), Some(refused)) => Err(format!(
                "the op asked for {refused} bytes at once, past the {budget} bytes it may \
                 allocate ({ALLOCATION_FACTOR} times its declared inputs and outputs, plus \
                 {ALLOCATION_FLOOR}): its attributes or inputs disagree with the shapes the \
                 graph declares"
            )),
            (result, _) => result,
        }
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

/// The bytes `node`'s op may allocate: [`ALLOCATION_FACTOR`] times the bytes of the values it
/// reads and writes, plus [`ALLOCATION_FLOOR`].
fn allocation_budget(graph: &Graph, node: &Node) -> u64 {
    let declared = node
        .inputs
        .iter()
        .chain(&node.outputs)
        .fold(0u64, |total, &v| total.saturating_add(graph.value(v).bytes));
    declared
        .saturating_mul(ALLOCATION_FACTOR)
        .saturating_add(ALLOCATION_FLOOR)
}

fn kernel(
    graph: &Graph,
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
        return collective(graph, node, world_size).map(Kernel::Collective);
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
        BoundCall::bind(op, node.inputs.len(), attributes, home, device).map_err(|error| {
            match error {
                BindError::NoSuchOperator(_) => unsupported(node, "libtorch has no such operator"),
                BindError::Mismatch(reason) => PrepareError::Binding {
                    op: op.to_owned(),
                    node: node.name.to_string(),
                    reason,
                },
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

fn collective(graph: &Graph, node: &Node, world_size: usize) -> Result<Collective, PrepareError> {
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
        check_splits(graph, node, node.inputs[0], "input", input_splits)?;
        check_splits(graph, node, node.outputs[0], "output", output_splits)?;
    }
    Ok(collective)
}

/// An all-to-all's split sizes must add up to the rows its input (or output) declares, so
/// every chunk it cuts or assembles lies within a declared tensor.
fn check_splits(
    graph: &Graph,
    node: &Node,
    value: ir::ValueId,
    which: &str,
    splits: &[i64],
) -> Result<(), PrepareError> {
    let value = graph.value(value);
    let rows = value.shape.first().copied();
    let total = splits
        .iter()
        .try_fold(0u64, |sum, &s| sum.checked_add(u64::try_from(s).ok()?));
    if total.is_some() && total == rows {
        return Ok(());
    }
    let total = total.map_or_else(|| "more than 64 bits hold".to_owned(), |t| t.to_string());
    Err(binding(
        node,
        &format!(
            "{which} split sizes {splits:?} add up to {total} rows, but {which} `{}` has shape {:?}",
            ir::display::name(&value.name),
            value.shape.as_slice()
        ),
    ))
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
