//! Peak memory from a liveness simulation (docs/cost-and-memory.md).
//!
//! The step runs forward in execution order, then backward in order with each replay subgraph
//! materialised just before the backward node it is scheduled for. Every op output is a new
//! storage, except an alias (a view, `wait_tensor`, an in-place op's result), which shares the
//! storage of the input it aliases, so views cost nothing and extend their base's life. A
//! storage lives from the step that makes it to the last step that reads it (or any alias of
//! it); graph outputs (loss, gradients) live to the end. What is *saved* needs no bookkeeping:
//! a forward value that backward or replay reads simply stays alive until that read, and
//! everything else dies after its last forward use. An executor may hold a value past its last
//! read by an op (eager checkpointing's cache and inputs, eager autograd's saved tensors, the
//! model's Python references): a partition's *holds* are reads at a forward, replay or
//! backward step that no op makes. It may also store a value in other bytes than the graph
//! says (*resized*: eager CPU dropout's mask is a float noise tensor) and allocate memory of its
//! own that no value stands for (*extras*: a checkpoint's stash of the CPU generator state),
//! and it may run no marker op at all (eager PyTorch: a marker's output is its input).
//!
//! Parameters are resident throughout and reported apart; so are the gradients among the graph
//! outputs. Collective buffers are ordinary op outputs and count like any other.

use ir::{
    plan::{Peak, Stage},
    EntityId, Graph, ModelId, Node, NodeId, Phase, ValueId, MARKER_OP,
};

use crate::partition::{Extra, Hold, HoldKind, Replay, Resized, Until};

/// What an executor does to memory beyond running the graph's ops ([`crate::partition`]): the
/// values it holds past their last read, the values it stores in other bytes, the storages of
/// its own it allocates, whether it runs the markers. The default is a graph executor's:
/// nothing beyond the graph.
#[derive(Debug, Clone, Copy, Default)]
pub struct Executed<'a> {
    pub holds: &'a [Hold],
    pub resized: &'a [Resized],
    pub extras: &'a [Extra],
    /// The executor runs no marker op: a marker's output is its input's storage, not a copy
    /// (eager PyTorch, where `checkpoint_record` returns its tensor).
    pub markers_alias: bool,
}

impl<'a> Executed<'a> {
    /// Only `holds`.
    pub fn holding(holds: &'a [Hold]) -> Executed<'a> {
        Executed {
            holds,
            ..Executed::default()
        }
    }
}

/// What the simulation found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Simulation {
    /// Largest sum of live bytes (everything but parameters) at any step.
    pub peak_bytes: u64,
    /// Where the peak happens.
    pub peak: Option<Peak>,
    /// Bytes of the gradients the graph outputs, alive at the end of the step.
    pub gradient_bytes: u64,
    /// The peak with the gradients sharded as FSDP reduce-scatters them
    /// ([`simulate_sharded`]); `peak_bytes` when unsharded.
    pub peak_sharded_gradients: u64,
    /// Bytes the offloaded storages hold in host memory: in all, and at most at once.
    pub host: HostMemory,
}

/// Host memory of the offloaded storages ([`simulate_offloaded`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostMemory {
    pub offloaded_bytes: u64,
    pub peak_bytes: u64,
    /// The moved storages that leave the device before forward ends (the others leave in
    /// backward, where a checkpoint's frame held them).
    pub left_in_forward_bytes: u64,
}

/// Values to move to host memory after their last forward read, each reloaded `prefetch`
/// backward steps before its first read after forward ([`simulate_offloaded`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct OffloadRequest<'a> {
    /// Storage roots (values that make a storage), each once.
    pub values: &'a [ValueId],
    pub prefetch: usize,
    /// The executor copies a storage to the host when it is first saved, before its last
    /// forward read (eager: SAC's cache as forward makes it, `offloading()` at its first
    /// save), so the device is free of it once that read has run; otherwise the copy runs
    /// beside the step after that read, which it holds the storage through.
    pub copied_at_save: bool,
}

/// Where one requested storage leaves the device and comes back, in schedule steps (forward
/// steps first, then backward's replay and backward steps: [`schedule_nodes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadWindow {
    pub value: ValueId,
    pub bytes: u64,
    /// The last forward step that reads the storage (through any alias, holds included):
    /// the copy to the host runs beside the step after it.
    pub last_forward_read: usize,
    /// The last step the device keeps the storage for before it may leave, the step after:
    /// `last_forward_read`, or later where a checkpoint's frame keeps the device tensor of a
    /// storage whose host copy eager SAC's cache holds ([`HoldKind::Frame`]).
    pub held_until: usize,
    /// The first step after `held_until` (and forward) that reads it, if any: what the reload
    /// is for.
    pub first_backward_read: Option<usize>,
    /// The step the reload allocates the storage again at, `prefetch` steps before
    /// `first_backward_read` and never in forward (for a storage that stays on the device,
    /// where it would be). None where nothing reads the storage after `held_until`: moved, it
    /// is copied to the host once and never comes back.
    pub reload_at: Option<usize>,
    /// Whether the storage leaves the device at all: when the device is free of it for at
    /// least one step between the copy and the reload, or, never reloaded, when eager SAC's
    /// cache holds it past `held_until` (its host copy).
    pub moved: bool,
}

/// One storage (a tensor's memory) and its lifetime in steps.
#[derive(Debug, Clone, Copy)]
struct Storage {
    bytes: u64,
    alloc: usize,
    last: usize,
}

/// Storage ids per value, per copy: the forward one, the replayed one, the backward one
/// ([`NO_STORAGE`] where there is none: 4 bytes a value, not 8).
#[derive(Clone)]
struct Instances {
    forward: Vec<u32>,
    replayed: Vec<u32>,
    backward: Vec<u32>,
}

const NO_STORAGE: u32 = u32::MAX;

fn storage(id: u32) -> Option<u32> {
    (id != NO_STORAGE).then_some(id)
}

/// Which copy of a value a read found: the one forward made, the one a replay made, or the
/// one backward made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Instance {
    Forward,
    Replayed,
    Backward,
}

/// One step of a training step's schedule.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Step<'r> {
    pub stage: Stage,
    pub node: NodeId,
    /// For a backward or replay step, the position in the backward order it runs at.
    pub position: usize,
    /// For a replay step, its replay.
    pub replay: Option<&'r Replay>,
}

/// Watches a simulation: what each step reads and makes. The plain simulation watches
/// nothing; [`crate::compose`] records lifetimes per layer through it.
pub(crate) trait Observer {
    /// `step` is about to run (graph inputs are placed before the first).
    fn step(&mut self, _step: &Step) {}
    /// A fresh storage of `bytes` was made for `value`.
    fn made(&mut self, _storage: u32, _value: ValueId, _bytes: u64) {}
    /// A read of `value` at `stage` found `storage`, the copy `copy` (graph outputs are read
    /// once more at the end, in backward).
    fn read(&mut self, _stage: Stage, _value: ValueId, _storage: u32, _copy: Instance) {}
    /// `output` aliases `base`, whose read found the copy `copy` (none: a parameter).
    fn aliased(
        &mut self,
        _stage: Stage,
        _output: ValueId,
        _base: ValueId,
        _copy: Option<Instance>,
    ) {
    }
}

/// The plain simulation watches nothing.
impl Observer for () {}

#[derive(Clone)]
struct Simulator<'g, O> {
    graph: &'g Graph,
    storages: Vec<Storage>,
    inst: Instances,
    /// Steps run so far.
    steps: usize,
    observer: O,
    /// FSDP's shard degree for the gradients (1: unsharded, nothing more is recorded).
    gradient_shards: u32,
    /// Under FSDP, the last backward step of each layer: where its gradients are
    /// reduce-scattered.
    layer_ends: rustc_hash::FxHashMap<(ModelId, u32), usize>,
    /// The bytes the executor stores a value in where they differ from the graph's.
    resized: rustc_hash::FxHashMap<ValueId, u64>,
    /// The executor's own storages ([`Extra`]), apart from the values' (whose index is the
    /// storage id observers see), each with the step it ends at.
    extras: Vec<(Storage, Until)>,
    /// A marker's output shares its input's storage ([`Executed::markers_alias`]).
    markers_alias: bool,
    /// The storages to offload, as the simulation finds their reads.
    offload: Offloading,
}

/// What the simulation records of the storages it is asked to offload.
#[derive(Clone, Default)]
struct Offloading {
    /// Requested storage roots, by value.
    requested: rustc_hash::FxHashSet<ValueId>,
    prefetch: usize,
    /// Steps the copy to the host holds a storage on the device after its last forward read
    /// (0 where the executor copies it when saved: [`OffloadRequest::copied_at_save`]).
    copy_steps: usize,
    /// Storage id -> index into `tracked`.
    by_storage: rustc_hash::FxHashMap<u32, usize>,
    tracked: Vec<Tracked>,
    /// Forward steps (the first backward step's index).
    forward_steps: usize,
    /// The device's second life of each moved storage, from its reload.
    reloads: Vec<Storage>,
    windows: Vec<OffloadWindow>,
    host: HostMemory,
}

/// The reads and holds of one requested storage.
#[derive(Clone)]
struct Tracked {
    value: ValueId,
    storage: u32,
    last_forward_read: Option<usize>,
    /// The steps after forward that read it (ops and device holds), in order.
    backward_reads: Vec<usize>,
    /// The last step eager SAC's cache holds it ([`HoldKind::Cache`]): the host copy where it
    /// moves, the device tensor where it stays.
    cache_until: Option<usize>,
    /// The last step a checkpoint's frame holds it as an input ([`HoldKind::Frame`]).
    frame_until: Option<usize>,
}

/// Simulates one training step with backward in `order` (see [`Graph::backward_order`]) under
/// the given replays (none: no checkpointing at all) and executor holds.
pub fn simulate(graph: &Graph, order: &[NodeId], replays: &[Replay], holds: &[Hold]) -> Simulation {
    simulate_executed(graph, order, replays, Executed::holding(holds))
}

/// [`simulate`] under everything the executor does ([`Executed`]).
pub fn simulate_executed(
    graph: &Graph,
    order: &[NodeId],
    replays: &[Replay],
    executed: Executed<'_>,
) -> Simulation {
    forward(graph, (), executed)
        .backward(order, replays, executed)
        .0
}

/// [`simulate`], and the peak with the gradients FSDP-sharded `shards` ways as FSDP2 holds them
/// (docs/cost-and-memory.md, M4): a gradient made in a decoder layer is whole until that
/// layer's backward ends, then `1/shards` of it; there a flat copy of the layer's gradients is
/// made for the reduce-scatter and lives until the next layer's backward ends (the end of the
/// step for the last); a gradient made outside layers (the root's) stays whole to the end.
pub fn simulate_sharded(
    graph: &Graph,
    order: &[NodeId],
    replays: &[Replay],
    executed: Executed<'_>,
    shards: u32,
) -> Simulation {
    let mut after = forward(graph, (), executed);
    after.0.gradient_shards = shards.max(1);
    after.backward(order, replays, executed).0
}

/// [`simulate_sharded`] with the storages of `offload` moved to host memory where the device
/// can be free of them (docs/cost-and-memory.md, M5): each lives on the device from its making
/// through the step after its last forward read (the copy to the host reads it beside that
/// step), then again from its reload, `offload.prefetch` backward steps before its first read
/// after forward (never before the first backward step), to its last read. A storage whose
/// reload would come before its copy ends stays on the device. Eager SAC's cache holds the
/// host copy ([`HoldKind`]): a kept output the recompute never takes back is copied and never
/// reloaded, and a checkpoint input the cache holds stays on the device until the frame lets it
/// go. Also the windows found ([`OffloadWindow`]), in the order of `offload.values`.
pub fn simulate_offloaded(
    graph: &Graph,
    order: &[NodeId],
    replays: &[Replay],
    executed: Executed<'_>,
    shards: u32,
    offload: OffloadRequest<'_>,
) -> (Simulation, Vec<OffloadWindow>) {
    let mut after = forward_offloading(graph, (), executed, offload);
    after.0.gradient_shards = shards.max(1);
    let mut sim = after.backward_simulator(order, replays, executed);
    let simulation = sim.simulation(order, replays);
    let mut windows = std::mem::take(&mut sim.offload.windows);
    let rank: rustc_hash::FxHashMap<ValueId, usize> = offload
        .values
        .iter()
        .enumerate()
        .map(|(i, &v)| (v, i))
        .collect();
    windows.sort_by_key(|w| rank.get(&w.value).copied());
    (simulation, windows)
}

/// The nodes of the schedule's steps, in order: what each step index of an
/// [`OffloadWindow`] runs.
pub fn schedule_nodes(graph: &Graph, order: &[NodeId], replays: &[Replay]) -> Vec<NodeId> {
    schedule(graph, order, replays)
        .map(|step| step.node)
        .collect()
}

/// How many steps of the schedule are forward's.
pub fn forward_step_count(graph: &Graph) -> usize {
    forward_steps(graph).count()
}

/// The values an executor holds until each step, as reads at that step: by the forward node
/// whose forward or replay step it is, and by backward position.
struct HeldUntil {
    forward: Vec<Vec<(ValueId, HoldKind)>>,
    replay: Vec<Vec<(ValueId, HoldKind)>>,
    backward: Vec<Vec<(ValueId, HoldKind)>>,
}

impl HeldUntil {
    fn new(graph: &Graph, order: &[NodeId], holds: &[Hold]) -> HeldUntil {
        let per_node = if holds.is_empty() {
            0
        } else {
            graph.nodes().len()
        };
        let mut held = HeldUntil {
            forward: vec![Vec::new(); per_node],
            replay: vec![Vec::new(); per_node],
            backward: vec![Vec::new(); if holds.is_empty() { 0 } else { order.len() }],
        };
        for h in holds {
            let list = match h.until {
                Until::Forward(node) => held.forward.get_mut(node.index()),
                Until::Replay(node) => held.replay.get_mut(node.index()),
                Until::Backward(position) => held.backward.get_mut(position),
            };
            if let Some(list) = list {
                list.push((h.value, h.kind));
            }
        }
        held
    }

    fn at(&self, step: &Step) -> &[(ValueId, HoldKind)] {
        let list = match step.stage {
            Stage::Forward => self.forward.get(step.node.index()),
            Stage::Replay => self.replay.get(step.node.index()),
            Stage::Backward => self.backward.get(step.position),
        };
        list.map_or(&[], Vec::as_slice)
    }
}

/// A simulation that has run forward: what every partition of the graph shares, to continue
/// under several ones (a clone each).
#[derive(Clone)]
pub(crate) struct AfterForward<'g, O>(Simulator<'g, O>);

/// Runs forward (graph inputs placed, every forward node), reporting to `observer`, under the
/// holds that end in forward (the others are for [`AfterForward::backward`]), with the values
/// `executed` resizes in their bytes and its extras allocated (they end in backward).
pub(crate) fn forward<'g, O: Observer>(
    graph: &'g Graph,
    observer: O,
    executed: Executed<'_>,
) -> AfterForward<'g, O> {
    forward_offloading(graph, observer, executed, OffloadRequest::default())
}

/// [`forward`], recording the reads of the storages `offload` asks to move.
fn forward_offloading<'g, O: Observer>(
    graph: &'g Graph,
    observer: O,
    executed: Executed<'_>,
    offload: OffloadRequest<'_>,
) -> AfterForward<'g, O> {
    let n = graph.values().len();
    let mut sim = Simulator {
        graph,
        storages: Vec::with_capacity(graph.nodes().len()),
        inst: Instances {
            forward: vec![NO_STORAGE; n],
            replayed: vec![NO_STORAGE; n],
            backward: vec![NO_STORAGE; n],
        },
        steps: 0,
        observer,
        gradient_shards: 1,
        layer_ends: Default::default(),
        resized: executed
            .resized
            .iter()
            .map(|r| (r.value, r.bytes))
            .collect(),
        extras: Vec::new(),
        markers_alias: executed.markers_alias,
        offload: Offloading {
            requested: offload.values.iter().copied().collect(),
            prefetch: offload.prefetch,
            copy_steps: usize::from(!offload.copied_at_save),
            ..Offloading::default()
        },
    };
    sim.place_graph_inputs();
    let held = HeldUntil::new(graph, &[], executed.holds);
    for step in forward_steps(graph) {
        sim.allocate_extras(executed.extras, &step);
        sim.run(&step);
        sim.touch(step.stage, held.at(&step));
        sim.touch_extras(&step);
    }
    sim.offload.forward_steps = sim.steps;
    AfterForward(sim)
}

impl<'g, O: Observer> AfterForward<'g, O> {
    /// The observer, as forward left it.
    pub(crate) fn observer_mut(&mut self) -> &mut O {
        &mut self.0.observer
    }

    /// Runs backward in `order` under `replays` and what `executed` holds (its resized
    /// values, extras and markers were forward's), and finds the peak.
    pub(crate) fn backward(
        self,
        order: &[NodeId],
        replays: &[Replay],
        executed: Executed<'_>,
    ) -> (Simulation, O) {
        let mut sim = self.backward_simulator(order, replays, executed);
        let simulation = sim.simulation(order, replays);
        (simulation, sim.observer)
    }

    /// The simulator once backward has run.
    fn backward_simulator(
        self,
        order: &[NodeId],
        replays: &[Replay],
        executed: Executed<'_>,
    ) -> Simulator<'g, O> {
        let mut sim = self.0;
        let held = HeldUntil::new(sim.graph, order, executed.holds);
        for step in backward_steps(order, replays) {
            sim.allocate_extras(executed.extras, &step);
            sim.run(&step);
            sim.touch(step.stage, held.at(&step));
            sim.touch_extras(&step);
        }
        sim
    }
}

impl<O: Observer> Simulator<'_, O> {
    /// The figures of the step just simulated.
    fn simulation(&mut self, order: &[NodeId], replays: &[Replay]) -> Simulation {
        let Finish {
            peak_bytes,
            peak_step,
            gradient_bytes,
            peak_sharded_gradients,
        } = self.finish();
        Simulation {
            peak_bytes,
            peak_sharded_gradients,
            peak: peak_step
                .and_then(|s| schedule(self.graph, order, replays).nth(s))
                .map(|step| Peak {
                    stage: step.stage,
                    node: step.node,
                }),
            gradient_bytes,
            host: self.offload.host,
        }
    }
}

/// The steps of one training step: forward nodes in execution order, then backward in
/// `order` with each replay's nodes just before the node it is scheduled for.
fn schedule<'a>(
    graph: &'a Graph,
    order: &'a [NodeId],
    replays: &'a [Replay],
) -> impl Iterator<Item = Step<'a>> + 'a {
    forward_steps(graph).chain(backward_steps(order, replays))
}

fn forward_steps(graph: &Graph) -> impl Iterator<Item = Step<'_>> + '_ {
    graph
        .nodes()
        .iter()
        .filter(|(_, node)| node.phase == Phase::Forward)
        .map(|(id, _)| Step {
            stage: Stage::Forward,
            node: id,
            position: 0,
            replay: None,
        })
}

fn backward_steps<'a>(
    order: &'a [NodeId],
    replays: &'a [Replay],
) -> impl Iterator<Item = Step<'a>> + 'a {
    let mut pending = replays.iter().peekable();
    order.iter().enumerate().flat_map(move |(at, &id)| {
        let mut due = Vec::new();
        while let Some(replay) = pending.next_if(|r| r.position <= at) {
            due.push(replay);
        }
        due.into_iter()
            .flat_map(move |r| {
                r.nodes.iter().map(move |&n| Step {
                    stage: Stage::Replay,
                    node: n,
                    position: at,
                    replay: Some(r),
                })
            })
            .chain(std::iter::once(Step {
                stage: Stage::Backward,
                node: id,
                position: at,
                replay: None,
            }))
    })
}

impl<O: Observer> Simulator<'_, O> {
    /// Data inputs and tangents are alive from the start; parameters are counted apart.
    fn place_graph_inputs(&mut self) {
        for (id, value) in self.graph.values().iter() {
            if self.graph.producer(id).is_none() && value.role != ir::Role::Parameter {
                let storage = self.new_storage(value.bytes, 0);
                self.observer.made(storage, id, value.bytes);
                self.inst.forward[id.index()] = storage;
            }
        }
    }

    fn new_storage(&mut self, bytes: u64, step: usize) -> u32 {
        self.storages.push(Storage {
            bytes,
            alloc: step,
            last: step,
        });
        (self.storages.len() - 1) as u32
    }

    /// The storage a read of `value` at `stage` sees, and which copy of the value it is.
    fn read(&self, stage: Stage, value: ValueId) -> Option<(u32, Instance)> {
        let i = value.index();
        let forward = || storage(self.inst.forward[i]).map(|s| (s, Instance::Forward));
        let replayed = || storage(self.inst.replayed[i]).map(|s| (s, Instance::Replayed));
        match stage {
            Stage::Forward => forward(),
            Stage::Replay => replayed().or_else(forward),
            Stage::Backward => storage(self.inst.backward[i])
                .map(|s| (s, Instance::Backward))
                .or_else(replayed)
                .or_else(forward),
        }
    }

    fn run(&mut self, step: &Step) {
        let Step {
            stage, node: id, ..
        } = *step;
        let at = self.steps;
        self.steps += 1;
        self.observer.step(step);
        let node = self.graph.node(id);
        if self.gradient_shards > 1 && stage == Stage::Backward {
            if let Some(layer) = node.layer {
                self.layer_ends.insert((node.model, layer), at);
            }
        }
        for &v in &node.inputs {
            if let Some((s, copy)) = self.read(stage, v) {
                self.storages[s as usize].last = at;
                self.offload.read(s, stage, at);
                self.observer.read(stage, v, s, copy);
            }
        }
        for (k, &v) in node.outputs.iter().enumerate() {
            let storage = match self.aliased_input(node, k) {
                // None when the base is a parameter (no storage): the view is resident memory
                // too, counted in `parameter_bytes`.
                Some(p) => {
                    let base = node.inputs[p];
                    let found = self.read(stage, base);
                    self.observer
                        .aliased(stage, v, base, found.map(|(_, copy)| copy));
                    found.map(|(s, _)| s)
                }
                None => {
                    let bytes = self.bytes(v);
                    let s = self.new_storage(bytes, at);
                    self.observer.made(s, v, bytes);
                    if stage == Stage::Forward {
                        self.offload.track(v, s);
                    }
                    Some(s)
                }
            };
            let slot = match stage {
                Stage::Forward => &mut self.inst.forward,
                Stage::Replay => &mut self.inst.replayed,
                Stage::Backward => &mut self.inst.backward,
            };
            slot[v.index()] = storage.unwrap_or(NO_STORAGE);
        }
    }

    /// The input whose storage output `k` of `node` shares: the node's own aliasing (views,
    /// in-place writes) or, where the executor runs no markers, a marker's input.
    fn aliased_input(&self, node: &Node, k: usize) -> Option<usize> {
        let skipped_marker =
            self.markers_alias && k == 0 && !node.inputs.is_empty() && node.op == MARKER_OP;
        node.aliased_input(k).or(skipped_marker.then_some(0))
    }

    /// The bytes the executor stores `value` in.
    fn bytes(&self, value: ValueId) -> u64 {
        self.resized
            .get(&value)
            .copied()
            .unwrap_or_else(|| self.graph.value(value).bytes)
    }

    /// Allocates the `extras` that begin at `step`, the step about to run.
    fn allocate_extras(&mut self, extras: &[Extra], step: &Step) {
        let at = self.steps;
        for extra in extras.iter().filter(|e| names(e.from, step)) {
            let storage = Storage {
                bytes: extra.bytes,
                alloc: at,
                last: at,
            };
            self.extras.push((storage, extra.until));
        }
    }

    /// Keeps the extras that end at `step`, the step just run, alive through it.
    fn touch_extras(&mut self, step: &Step) {
        let at = self.steps.saturating_sub(1);
        for (storage, until) in &mut self.extras {
            if names(*until, step) {
                storage.last = storage.last.max(at);
            }
        }
    }

    /// Keeps `values` alive through the step just run (a read by the executor, not by an op),
    /// where their holds keep the device tensor ([`Offloading::hold`]).
    fn touch(&mut self, stage: Stage, values: &[(ValueId, HoldKind)]) {
        let at = self.steps.saturating_sub(1);
        for &(v, kind) in values {
            let Some((s, copy)) = self.read(stage, v) else {
                continue;
            };
            if self.offload.hold(s, kind, stage, at) {
                let last = &mut self.storages[s as usize].last;
                *last = (*last).max(at);
                self.observer.read(stage, v, s, copy);
            }
        }
    }

    /// The peaks and the bytes of the output gradients.
    fn finish(&mut self) -> Finish {
        let end = self.steps.saturating_sub(1);
        let mut gradient_bytes = 0u64;
        let mut gradients = Vec::new();
        for &v in self.graph.outputs() {
            let found = self.read(Stage::Backward, v);
            if let Some((s, copy)) = found {
                self.storages[s as usize].last = end;
                self.offload.read(s, Stage::Backward, end);
                self.observer.read(Stage::Backward, v, s, copy);
            }
            if self.graph.value(v).role == ir::Role::Gradient {
                gradient_bytes = gradient_bytes.saturating_add(self.graph.value(v).bytes);
                gradients.extend(found.map(|(s, _)| (s, v)));
            }
        }
        self.offload.split(&mut self.storages, self.steps);
        let extras = self.extras.iter().map(|(s, _)| s);
        let reloads = self.offload.reloads.iter();
        let (peak_bytes, peak_step) = peak(
            self.storages.iter().chain(extras).chain(reloads),
            self.steps,
        );
        let peak_sharded_gradients = if self.gradient_shards > 1 {
            self.sharded_peak(gradients, end)
        } else {
            peak_bytes
        };
        Finish {
            peak_bytes,
            peak_step,
            gradient_bytes,
            peak_sharded_gradients,
        }
    }

    /// The peak with the gradient storages in `gradients` (storage, value) held as FSDP holds
    /// them ([`simulate_sharded`]); `end` is the last step.
    fn sharded_peak(&self, gradients: Vec<(u32, ValueId)>, end: usize) -> u64 {
        let shards = u64::from(self.gradient_shards);
        let mut sharded = vec![false; self.storages.len()];
        let mut pieces = Vec::new();
        // Per layer: the step its backward ends and the bytes of its flat reduce-scatter copy.
        let mut copies: rustc_hash::FxHashMap<(ModelId, u32), (usize, u64)> = Default::default();
        for (s, v) in gradients {
            let storage = self.storages[s as usize];
            let reduced = self.graph.producer(v).and_then(|p| {
                let node = self.graph.node(p);
                let key = (node.model, node.layer?);
                Some((key, *self.layer_ends.get(&key)?))
            });
            let Some((key, at)) = reduced.filter(|&(_, at)| at >= storage.alloc) else {
                continue; // the root's: whole to the end, as simulated
            };
            if std::mem::replace(&mut sharded[s as usize], true) {
                continue; // a storage two outputs share counts once
            }
            pieces.push(Storage {
                last: at,
                ..storage
            });
            if at < end {
                pieces.push(Storage {
                    bytes: storage.bytes.div_ceil(shards),
                    alloc: at + 1,
                    last: end,
                });
            }
            let copy = copies.entry(key).or_insert((at, 0));
            copy.1 = copy.1.saturating_add(storage.bytes);
        }
        // A layer's copy lives until the next reduce-scatter is issued (FSDP2 frees it once
        // the next layer's backward ends), the last one to the end of the step.
        let mut ends: Vec<usize> = self.layer_ends.values().copied().collect();
        ends.sort_unstable();
        pieces.extend(copies.into_values().map(|(at, bytes)| {
            Storage {
                bytes,
                alloc: at,
                last: ends[ends.partition_point(|&e| e <= at)..]
                    .first()
                    .copied()
                    .unwrap_or(end),
            }
        }));
        let whole = self
            .storages
            .iter()
            .zip(&sharded)
            .filter(|(_, &sharded)| !sharded)
            .map(|(s, _)| s)
            .chain(self.extras.iter().map(|(s, _)| s))
            .chain(&self.offload.reloads);
        peak(whole.chain(&pieces), self.steps).0
    }
}

impl Offloading {
    /// Tracks the reads of `storage`, made for `value`, if `value` is to be offloaded.
    fn track(&mut self, value: ValueId, storage: u32) {
        if self.requested.contains(&value) {
            self.by_storage.insert(storage, self.tracked.len());
            self.tracked.push(Tracked {
                value,
                storage,
                last_forward_read: None,
                backward_reads: Vec::new(),
                cache_until: None,
                frame_until: None,
            });
        }
    }

    /// Records a read of `storage` at step `at` of `stage`.
    fn read(&mut self, storage: u32, stage: Stage, at: usize) {
        let Some(&i) = self.by_storage.get(&storage) else {
            return;
        };
        let tracked = &mut self.tracked[i];
        if stage == Stage::Forward {
            tracked.last_forward_read = Some(at);
        } else {
            tracked.backward_reads.push(at);
        }
    }

    /// Records a hold of kind `kind` on `storage` through step `at` of `stage`, and says
    /// whether it keeps the device tensor. For a storage not asked to move, every hold but
    /// [`HoldKind::CacheServe`] does (the cache keeps the device tensor itself). For one asked
    /// to move, the cache's hold keeps the host copy, recorded apart; the others read the device
    /// tensor, and a frame's is also recorded, for where the cache holds the same storage
    /// ([`Tracked::pinned_until`]).
    fn hold(&mut self, storage: u32, kind: HoldKind, stage: Stage, at: usize) -> bool {
        let Some(&i) = self.by_storage.get(&storage) else {
            return kind != HoldKind::CacheServe;
        };
        let tracked = &mut self.tracked[i];
        match kind {
            HoldKind::Cache => {
                tracked.cache_until = Some(tracked.cache_until.map_or(at, |c| c.max(at)));
                return false;
            }
            HoldKind::Frame => {
                tracked.frame_until = Some(tracked.frame_until.map_or(at, |f| f.max(at)));
            }
            HoldKind::Device | HoldKind::CacheServe => {}
        }
        self.read(storage, stage, at);
        true
    }

    /// Splits the life of each tracked storage the device can be free of into the part up to
    /// its copy to the host and the part from its reload (`reloads`, none for a storage nothing
    /// reads again), records the windows, and the host memory the moved storages hold from
    /// their copy to their reload (or, never reloaded, until eager SAC's cache lets go of
    /// them).
    fn split(&mut self, storages: &mut [Storage], steps: usize) {
        let timing = Timing {
            prefetch: self.prefetch,
            forward_steps: self.forward_steps,
            copy_steps: self.copy_steps,
        };
        let mut host = Vec::new();
        for t in &self.tracked {
            let storage = &mut storages[t.storage as usize];
            let window = t.window(storage, timing, steps);
            let leaves_after = window.held_until + self.copy_steps;
            if window.moved {
                if let Some(reload_at) = window.reload_at {
                    self.reloads.push(Storage {
                        alloc: reload_at,
                        ..*storage
                    });
                }
                let host_until = window
                    .reload_at
                    .unwrap_or_else(|| t.cache_until.map_or(leaves_after, |c| c.max(leaves_after)));
                host.push(Storage {
                    bytes: storage.bytes,
                    alloc: window.last_forward_read + 1,
                    last: host_until,
                });
                storage.last = leaves_after;
                self.host.offloaded_bytes = self.host.offloaded_bytes.saturating_add(storage.bytes);
                if leaves_after < self.forward_steps {
                    self.host.left_in_forward_bytes += storage.bytes;
                }
            } else if let Some(cache_until) = t.cache_until {
                // Left on the device, the storage is what the cache holds.
                storage.last = storage.last.max(cache_until);
            }
            self.windows.push(window);
        }
        self.host.peak_bytes = peak(&host, steps).0;
    }
}

/// When offloaded storages move, in schedule steps.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// Backward steps a reload comes before the read it is for.
    prefetch: usize,
    /// Forward steps (the first backward step's index): no reload comes before.
    forward_steps: usize,
    /// Steps the copy to the host holds a storage after its last forward read.
    copy_steps: usize,
}

impl Tracked {
    /// Where the storage leaves the device and comes back: it leaves after `held_until` (and
    /// the copy's steps) and is reloaded `prefetch` steps before the first read after that
    /// (never in forward: [`Timing`]). It moves when the device is free of it for at least one
    /// step before the reload, or, read by nothing after `held_until`, when eager SAC's cache
    /// holds it and the device is free of it for a step before the step's `steps` end: the
    /// cache holds the host copy and nothing reloads it.
    fn window(&self, storage: &Storage, timing: Timing, steps: usize) -> OffloadWindow {
        let Timing {
            prefetch,
            forward_steps,
            copy_steps,
        } = timing;
        let free_from = copy_steps + 1;
        let last_forward_read = self.last_forward_read.unwrap_or(storage.alloc);
        let held_until = self
            .pinned_until()
            .map_or(last_forward_read, |p| p.max(last_forward_read));
        let first_backward_read = self
            .backward_reads
            .iter()
            .copied()
            .find(|&r| r > held_until);
        let reload_at =
            first_backward_read.map(|first| first.saturating_sub(prefetch).max(forward_steps));
        let moved = match reload_at {
            Some(reload_at) => reload_at > held_until + free_from,
            None => self.cache_until.is_some() && held_until + free_from < steps,
        };
        OffloadWindow {
            value: self.value,
            bytes: storage.bytes,
            last_forward_read,
            held_until,
            first_backward_read,
            reload_at,
            moved,
        }
    }

    /// The last step a checkpoint's frame keeps the device tensor of a storage eager SAC's
    /// cache also holds: the cache's host copy does not free the device of the frame's input.
    /// Reads until then find the device tensor; none of them reloads it.
    fn pinned_until(&self) -> Option<usize> {
        self.frame_until.filter(|_| self.cache_until.is_some())
    }
}

/// Whether `at` names `step`.
fn names(at: Until, step: &Step) -> bool {
    match at {
        Until::Forward(node) => step.stage == Stage::Forward && step.node == node,
        Until::Replay(node) => step.stage == Stage::Replay && step.node == node,
        Until::Backward(position) => step.stage == Stage::Backward && step.position == position,
    }
}

/// What [`Simulator::finish`] found.
struct Finish {
    peak_bytes: u64,
    /// The step where the peak is first reached.
    peak_step: Option<usize>,
    gradient_bytes: u64,
    peak_sharded_gradients: u64,
}

/// The largest sum of live bytes over steps, and the first step where it is reached.
fn peak<'s>(storages: impl IntoIterator<Item = &'s Storage>, steps: usize) -> (u64, Option<usize>) {
    let mut delta = vec![0i128; steps + 1];
    for s in storages {
        delta[s.alloc] += i128::from(s.bytes);
        delta[s.last + 1] -= i128::from(s.bytes);
    }
    let (mut live, mut best, mut at) = (0i128, 0i128, None);
    for (step, d) in delta.iter().take(steps).enumerate() {
        live += d;
        if live > best {
            best = live;
            at = Some(step);
        }
    }
    (u64::try_from(best).unwrap_or(u64::MAX), at)
}

#[cfg(test)]
mod tests {
    use super::peak;
    use super::Storage;

    #[test]
    fn peak_counts_overlapping_lifetimes_once_each() {
        let s = |bytes, alloc, last| Storage { bytes, alloc, last };
        // 10 lives 0..=1, 20 lives 1..=2, 5 lives 3..=3: the peak is 30 at step 1.
        let storages = [s(10, 0, 1), s(20, 1, 2), s(5, 3, 3)];
        assert_eq!(peak(&storages, 4), (30, Some(1)));
        assert_eq!(peak(&[], 0), (0, None));
    }
}
