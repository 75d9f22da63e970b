//! One rank runs one training step: the schedule's steps in order, each node's kernel on the
//! copies of its inputs the schedule names, every copy freed after its last read.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use ir::{plan::Stage, EntityId, NodeId, ValueId};
use tch::{Device, Tensor};
use thiserror::Error;

use crate::{
    comm::{CommError, Communicator, Site},
    ffi, host_memory,
    inputs::RankInputs,
    memory::{HostBytes, LiveBytes},
    program::{Kernel, Program},
    rng::RankRng,
    schedule::Schedule,
};

/// A failure injected into one rank, to prove that the others end with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    /// Before this collective (counted from 0 on the rank).
    pub before_collective: u64,
    pub kind: FaultKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank fails with an error.
    Fail,
    /// The rank stops for this long before calling the collective.
    Stall(Duration),
    /// The rank's thread panics, as a libtorch call that fails inside tch does.
    Panic,
}

#[derive(Debug, Error)]
pub enum StepError {
    #[error("{stage} node `{node}` ({op}): {message}")]
    Op {
        stage: Stage,
        node: String,
        op: String,
        message: String,
    },
    #[error("{stage} node `{node}`: {source}")]
    Collective {
        stage: Stage,
        node: String,
        source: CommError,
    },
    #[error("fault injected before {site}")]
    Injected { site: String },
}

impl StepError {
    /// Whether this error only reports another rank's failure (not this rank's own).
    pub fn is_from_another_rank(&self) -> bool {
        matches!(self, StepError::Collective { .. })
    }
}

/// How many times each node ran in each stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpCounts {
    /// Per node: forward, replay, backward.
    per_node: Vec<[u32; 3]>,
}

impl OpCounts {
    fn new(nodes: usize) -> OpCounts {
        OpCounts {
            per_node: vec![[0; 3]; nodes],
        }
    }

    fn slot(stage: Stage) -> usize {
        match stage {
            Stage::Forward => 0,
            Stage::Replay => 1,
            Stage::Backward => 2,
        }
    }

    fn count(&mut self, stage: Stage, node: NodeId) {
        self.per_node[node.index()][Self::slot(stage)] += 1;
    }

    /// How many times `node` ran in `stage`.
    pub fn of(&self, node: NodeId, stage: Stage) -> u32 {
        self.per_node
            .get(node.index())
            .map_or(0, |c| c[Self::slot(stage)])
    }

    /// Ops run in `stage`, all nodes together.
    pub fn total(&self, stage: Stage) -> u64 {
        self.per_node
            .iter()
            .map(|c| u64::from(c[Self::slot(stage)]))
            .sum()
    }
}

/// What one rank's step produced.
#[derive(Debug)]
pub struct StepResult {
    /// The graph's outputs (loss, gradients), in the graph's output order.
    pub outputs: Vec<(ValueId, Tensor)>,
    /// Peak bytes of the storages the runtime held (parameters excluded).
    pub peak_bytes: u64,
    /// Bytes of the activations forward left for backward: see [`held_activation_bytes`].
    pub saved_bytes: u64,
    /// CUDA only: the caching allocator's peak during the step, parameters excluded.
    pub allocator_peak_bytes: Option<u64>,
    pub counts: OpCounts,
    /// Wall time of the step (on CUDA, until the device finished).
    pub seconds: f64,
    /// Minor page faults the process took during the step (every thread's: with ranks as
    /// threads of one process, the other ranks' too), where the OS counts them.
    pub page_faults: Option<u64>,
    /// Wall time spent in each stage's steps (forward, replay, backward), each step's kernel
    /// and the runtime's work around it. On CUDA, without a synchronisation per op, a stage
    /// counts the host's time to launch its kernels; the step's time counts the device's.
    pub stage_seconds: StageSeconds,
    /// Wall time per node, summed over the stages that ran it (the same attribution).
    pub node_seconds: Vec<f64>,
    /// The offloaded storages' host memory and the copies' wall time.
    pub host: HostFigures,
}

/// What offloading cost one step: host memory, and the wall time of the copies to the host and
/// back (synchronous: all of it exposed; counted in its stage's time, in no node's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostFigures {
    pub bytes: HostBytes,
    pub seconds: f64,
}

/// Seconds per stage of a step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageSeconds([f64; 3]);

impl StageSeconds {
    /// Forward, replay and backward seconds.
    pub fn new(seconds: [f64; 3]) -> StageSeconds {
        StageSeconds(seconds)
    }

    fn add(&mut self, stage: Stage, seconds: f64) {
        self.0[OpCounts::slot(stage)] += seconds;
    }

    /// Seconds spent in `stage`.
    pub fn of(&self, stage: Stage) -> f64 {
        self.0[OpCounts::slot(stage)]
    }
}

/// Runs one step on this rank.
pub fn run_step(
    program: &Program<'_>,
    schedule: &Schedule,
    inputs: &RankInputs,
    comm: &mut dyn Communicator,
    rng: &mut RankRng,
    fault: Option<Fault>,
) -> Result<StepResult, StepError> {
    let graph = program.graph();
    let device = program.device();
    let n = graph.values().len();
    let mut env = Env {
        copies: [empty(n), empty(n), empty(n)],
        memory: LiveBytes::default(),
        parked: HashMap::new(),
        roots: HashMap::new(),
        host: HostFigures::default(),
    };
    let mut resident_bytes = 0u64;
    let input_storages: HashSet<usize> = inputs
        .values
        .iter()
        .filter_map(|(_, tensor)| ffi::storage(tensor).map(|(key, _)| key))
        .collect();
    for (id, tensor) in &inputs.values {
        if graph.value(*id).role == ir::Role::Parameter {
            env.memory.resident(tensor);
            resident_bytes += ffi::storage(tensor).map_or(0, |(_, b)| b);
        }
        env.put(Slot(Stage::Forward, *id), tensor.shallow_clone());
    }
    let allocator = matches!(device, Device::Cuda(_));
    if allocator {
        ffi::synchronize(device).map_err(|m| op_error(program, Stage::Forward, None, m))?;
        ffi::cuda_reset_peak(device).map_err(|m| op_error(program, Stage::Forward, None, m))?;
    }
    let faults_before = host_memory::page_faults();
    let started = Instant::now();
    let mut saved_bytes = None;
    let mut counts = OpCounts::new(graph.nodes().len());
    let mut collectives = 0u64;
    let mut stage_seconds = StageSeconds::default();
    let mut node_seconds = vec![0.0; graph.nodes().len()];
    for (step, &(stage, id)) in schedule.steps().iter().enumerate() {
        if stage != Stage::Forward && saved_bytes.is_none() {
            saved_bytes = Some(held_activation_bytes(graph, &env, &input_storages));
        }
        let back: Vec<ValueId> = schedule.moves().back_before(step).collect();
        if !back.is_empty() {
            let started = drained(device).map_err(|m| op_error(program, stage, Some(id), m))?;
            for root in back {
                env.reload(root, device)
                    .map_err(|m| op_error(program, stage, Some(id), m))?;
            }
            env.copied(stage, started, &mut stage_seconds);
        }
        let step_started = Instant::now();
        let node = graph.node(id);
        let inputs: Vec<&Tensor> = node
            .inputs
            .iter()
            .zip(schedule.reads(step))
            .map(|(&v, &copy)| env.get(Slot(copy, v)))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                op_error(
                    program,
                    stage,
                    Some(id),
                    "an input was freed before its last read".into(),
                )
            })?;
        let outputs = match program.kernel(id) {
            Kernel::Identity => inputs
                .first()
                .map(|t| vec![t.shallow_clone()])
                .unwrap_or_default(),
            Kernel::Aten(call) if node.effects.random => rng
                .run(stage, id, || program.run_aten(stage, id, call, &inputs))
                .map_err(|m| op_error(program, stage, Some(id), m))?,
            Kernel::Aten(call) => program
                .run_aten(stage, id, call, &inputs)
                .map_err(|m| op_error(program, stage, Some(id), m))?,
            Kernel::Collective(collective) => {
                let _shown = program.showing(stage, id, false);
                let site = Site {
                    seq: collectives,
                    op: collective.name(),
                    node: node.name.to_string(),
                };
                collectives += 1;
                inject(fault, comm.rank(), &site)?;
                let input = inputs.first().copied().ok_or_else(|| {
                    op_error(
                        program,
                        stage,
                        Some(id),
                        "a collective needs an input".into(),
                    )
                })?;
                vec![comm.run(&site, collective, input).map_err(|source| {
                    StepError::Collective {
                        stage,
                        node: node.name.to_string(),
                        source,
                    }
                })?]
            }
        };
        if outputs.len() != node.outputs.len() {
            let message = format!(
                "the op returned {} tensors, the node has {} outputs",
                outputs.len(),
                node.outputs.len()
            );
            return Err(op_error(program, stage, Some(id), message));
        }
        for (&v, tensor) in node.outputs.iter().zip(&outputs) {
            check_output(graph.value(v), tensor)
                .map_err(|m| op_error(program, stage, Some(id), m))?;
        }
        counts.count(stage, id);
        for (&v, tensor) in node.outputs.iter().zip(outputs) {
            if stage == Stage::Forward && schedule.moves().moves(v) {
                env.made_root(v, &tensor);
            }
            env.put(Slot(stage, v), tensor);
        }
        env.memory.sample();
        for slot in schedule.frees(step) {
            env.take(Slot(slot.copy, slot.value));
        }
        let elapsed = step_started.elapsed().as_secs_f64();
        stage_seconds.add(stage, elapsed);
        node_seconds[id.index()] += elapsed;
        let out: Vec<ValueId> = schedule.moves().out_after(step).collect();
        if !out.is_empty() {
            let started = drained(device).map_err(|m| op_error(program, stage, Some(id), m))?;
            for root in out {
                env.offload(root, graph)
                    .map_err(|m| op_error(program, stage, Some(id), m))?;
            }
            env.copied(stage, started, &mut stage_seconds);
        }
        env.host.bytes.sample();
    }
    if allocator {
        ffi::synchronize(device).map_err(|m| op_error(program, Stage::Backward, None, m))?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let page_faults = faults_before
        .zip(host_memory::page_faults())
        .map(|(before, after)| after.saturating_sub(before));
    let allocator_peak_bytes = if allocator {
        let peak = ffi::cuda_peak_allocated(device)
            .map_err(|m| op_error(program, Stage::Backward, None, m))?;
        Some(peak.saturating_sub(resident_bytes))
    } else {
        None
    };
    let outputs = schedule
        .outputs()
        .iter()
        .filter_map(|slot| {
            env.get(Slot(slot.copy, slot.value))
                .map(|t| (slot.value, t.shallow_clone()))
        })
        .collect();
    Ok(StepResult {
        outputs,
        peak_bytes: env.memory.peak(),
        saved_bytes: saved_bytes
            .unwrap_or_else(|| held_activation_bytes(graph, &env, &input_storages)),
        allocator_peak_bytes,
        counts,
        seconds,
        page_faults,
        stage_seconds,
        node_seconds,
        host: env.host,
    })
}

fn inject(fault: Option<Fault>, rank: usize, site: &Site) -> Result<(), StepError> {
    match fault {
        Some(f) if f.rank == rank && f.before_collective == site.seq => match f.kind {
            FaultKind::Fail => Err(StepError::Injected {
                site: site.to_string(),
            }),
            FaultKind::Stall(pause) => {
                std::thread::sleep(pause);
                Ok(())
            }
            FaultKind::Panic => panic!("fault injected before {site}"),
        },
        _ => Ok(()),
    }
}

fn op_error(
    program: &Program<'_>,
    stage: Stage,
    node: Option<NodeId>,
    message: String,
) -> StepError {
    let node = node.map(|id| program.graph().node(id));
    StepError::Op {
        stage,
        node: node.map_or_else(|| "-".to_owned(), |n| n.name.to_string()),
        op: node.map_or_else(|| "device".to_owned(), |n| n.op.to_string()),
        message,
    }
}

/// A value copy: the stage that made it and the value.
#[derive(Clone, Copy)]
struct Slot(Stage, ValueId);

/// The tensors the rank holds, by copy, with their storages counted.
struct Env {
    copies: [Vec<Option<Tensor>>; 3],
    memory: LiveBytes,
    /// Offloaded storages in host memory, by the value that made them.
    parked: HashMap<ValueId, Parked>,
    /// The storage (key) each value to offload was made in.
    roots: HashMap<ValueId, usize>,
    host: HostFigures,
}

/// One storage in host memory, and the copies that viewed it on the device.
struct Parked {
    host: Tensor,
    bytes: u64,
    views: Vec<View>,
}

/// A copy of a value as a view of its storage.
struct View {
    slot: Slot,
    size: Vec<i64>,
    stride: Vec<i64>,
    offset: i64,
}

impl Env {
    fn table(&mut self, stage: Stage) -> &mut Vec<Option<Tensor>> {
        &mut self.copies[OpCounts::slot(stage)]
    }

    fn get(&self, Slot(stage, value): Slot) -> Option<&Tensor> {
        self.copies[OpCounts::slot(stage)][value.index()].as_ref()
    }

    fn put(&mut self, slot: Slot, tensor: Tensor) {
        self.memory.hold(&tensor);
        if let Some(old) = self.table(slot.0)[slot.1.index()].replace(tensor) {
            self.memory.release(&old);
        }
    }

    fn take(&mut self, slot: Slot) {
        if let Some(old) = self.table(slot.0)[slot.1.index()].take() {
            self.memory.release(&old);
        }
    }

    /// `root`, a value to offload, was made in `tensor`'s storage.
    fn made_root(&mut self, root: ValueId, tensor: &Tensor) {
        if let Some((key, _)) = ffi::storage(tensor) {
            self.roots.insert(root, key);
        }
    }

    /// Copies the storage `root` made to host memory and releases every copy on the device
    /// that shares it (their views are rebuilt on the reload).
    fn offload(&mut self, root: ValueId, graph: &ir::Graph) -> Result<(), String> {
        let name = &graph.value(root).name;
        let key = self.roots.get(&root).copied();
        let held: Vec<(Slot, Tensor)> = Stage::ALL
            .iter()
            .flat_map(|&stage| {
                let table = &self.copies[OpCounts::slot(stage)];
                table.iter().enumerate().filter_map(move |(i, t)| {
                    let t = t.as_ref()?;
                    let shares = key.is_some() && ffi::storage(t).map(|(k, _)| k) == key;
                    shares.then(|| (Slot(stage, ValueId::from_index(i)), t.shallow_clone()))
                })
            })
            .collect();
        let Some((_, first)) = held.first() else {
            return Err(format!(
                "offloaded `{name}` is held by no copy when forward is done with it"
            ));
        };
        let bytes = ffi::storage(first).map_or(0, |(_, b)| b);
        let kind = first.kind();
        if held.iter().any(|(_, t)| t.kind() != kind) {
            return Err(format!(
                "offloaded `{name}` is viewed with two element types"
            ));
        }
        let elements = i64::try_from(bytes / kind.elt_size_in_bytes() as u64)
            .map_err(|_| format!("offloaded `{name}` is too large to copy"))?;
        let whole = first
            .f_as_strided([elements], [1], 0)
            .map_err(|e| format!("viewing offloaded `{name}` whole: {e}"))?;
        let host = copy_to(&whole, Device::Cpu)
            .map_err(|e| format!("copying offloaded `{name}` to the host: {e}"))?;
        let views = held
            .iter()
            .map(|(slot, t)| View {
                slot: *slot,
                size: t.size(),
                stride: t.stride(),
                offset: t.storage_offset(),
            })
            .collect();
        for (slot, _) in &held {
            self.take(*slot);
        }
        self.host.bytes.park(bytes);
        self.parked.insert(root, Parked { host, bytes, views });
        Ok(())
    }

    /// Brings the storage `root` made back to `device` and rebuilds the copies that viewed it.
    fn reload(&mut self, root: ValueId, device: Device) -> Result<(), String> {
        let Some(parked) = self.parked.remove(&root) else {
            return Err("a reload of a storage that was never offloaded".into());
        };
        let whole = copy_to(&parked.host, device).map_err(|e| format!("reloading: {e}"))?;
        self.host.bytes.unpark(parked.bytes);
        for view in parked.views {
            let tensor = whole
                .f_as_strided(view.size.as_slice(), view.stride.as_slice(), view.offset)
                .map_err(|e| format!("rebuilding a view of a reloaded storage: {e}"))?;
            self.put(view.slot, tensor);
        }
        Ok(())
    }

    /// Adds the time since `since`, spent copying to or from the host, to `stage`'s.
    fn copied(&mut self, stage: Stage, since: Instant, stages: &mut StageSeconds) {
        let seconds = since.elapsed().as_secs_f64();
        self.host.seconds += seconds;
        stages.add(stage, seconds);
    }
}

/// Now, once `device` has run what was queued on it (on CUDA: a copy to or from the host timed
/// from here is the copy's time, not the queued kernels' a blocking copy waits for).
fn drained(device: Device) -> Result<Instant, String> {
    if matches!(device, Device::Cuda(_)) {
        ffi::synchronize(device)?;
    }
    Ok(Instant::now())
}

/// A new copy of `tensor` on `device` (a new storage even on the tensor's own device).
fn copy_to(tensor: &Tensor, device: Device) -> Result<Tensor, tch::TchError> {
    if tensor.device() == device {
        let mut copy = tensor.f_empty_like()?;
        copy.f_copy_(tensor)?;
        Ok(copy)
    } else {
        tensor.f_to_device(device)
    }
}

/// What forward leaves for backward, as the planner's saved activation bytes count it: the
/// storages offloaded to host memory, and those of the forward copies still held that ops made
/// (not the storages of the step's inputs, parameters included, which views of them share),
/// the graph's outputs (the loss) aside. Each storage counts once, by its real size.
fn held_activation_bytes(graph: &ir::Graph, env: &Env, inputs: &HashSet<usize>) -> u64 {
    let forward = &env.copies[OpCounts::slot(Stage::Forward)];
    let storage_of = |v: ValueId| forward[v.index()].as_ref().and_then(ffi::storage);
    let outputs: HashSet<ValueId> = graph.outputs().iter().copied().collect();
    let mut counted: HashMap<usize, u64> = HashMap::new();
    for (id, _) in graph.values().iter() {
        if graph.producer(id).is_none() || outputs.contains(&id) {
            continue;
        }
        if let Some((key, bytes)) = storage_of(id).filter(|(key, _)| !inputs.contains(key)) {
            counted.insert(key, bytes);
        }
    }
    counted.values().sum::<u64>() + env.host.bytes.live()
}

fn empty(n: usize) -> Vec<Option<Tensor>> {
    (0..n).map(|_| None).collect()
}

/// An output must have the dtype and shape the IR declares for its value: anything else means
/// the op ran with other arguments than the exported step did.
fn check_output(value: &ir::Value, tensor: &Tensor) -> Result<(), String> {
    let kind = crate::tensor::kind_of(value.dtype);
    let sizes = crate::tensor::sizes_of(value).map_err(|e| e.to_string())?;
    if tensor.kind() == kind && tensor.size() == sizes {
        return Ok(());
    }
    Err(format!(
        "output `{}` is {:?}{:?}, but the graph declares {}{:?}",
        value.name,
        tensor.kind(),
        tensor.size(),
        value.dtype,
        value.shape.as_slice()
    ))
}
