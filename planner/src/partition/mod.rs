//! Partition of a joint graph into forward / replay / backward, and the verifier that
//! proves it closed.
//!
//! Saved = exactly the forward values backward needs, directly or through replay, that are
//! available without re-running anything: kept outputs, checkpointed layers' inputs, outputs of
//! ops outside checkpointed layers, parameters and graph inputs. Every other value backward
//! needs is produced by a replay subgraph of its layer, scheduled just before the first backward
//! node that reads what the replay produces.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;

mod eager;

use ir::{
    plan::{Decision, Executor, LayerRef, SavedKind},
    EntityId, Graph, NodeId, Phase, ValueId,
};
use thiserror::Error;

use crate::policy::Policy;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub value: ValueId,
    pub kind: SavedKind,
}

/// The forward nodes one checkpointed layer re-executes in backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    pub layer: LayerRef,
    /// Forward nodes in execution order.
    pub nodes: Vec<NodeId>,
    /// The first backward node that reads a value this replay produces; it runs just before.
    pub before: NodeId,
    /// The position of `before` in [`Partition::order`].
    pub position: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The order backward runs in ([`Graph::backward_order`]).
    pub order: Vec<NodeId>,
    /// In value order.
    pub saved: Vec<Saved>,
    /// In schedule order (by `position`, then model and layer).
    pub replays: Vec<Replay>,
    /// Where an eager recompute would not reproduce forward (always empty for the graph
    /// executor, whose partition avoids them).
    pub hazards: Vec<Hazard>,
    /// Forward values the executor itself holds past their last read by an op (always empty
    /// for the graph executor, whose executor holds only what ops read).
    pub holds: Vec<Hold>,
    /// Values the executor stores in other bytes than the graph says (always empty for the
    /// graph executor, which makes what the graph says).
    pub resized: Vec<Resized>,
    /// Memory the executor allocates that no value of the graph stands for (always empty for
    /// the graph executor).
    pub extras: Vec<Extra>,
    /// The executor runs no marker op, so a marker's output is its input (eager; the graph
    /// executor runs the graph's markers as the copies they are).
    pub markers_alias: bool,
}

impl Partition {
    /// What the executor does to memory beyond the graph's ops, for the simulation.
    pub fn executed(&self) -> crate::memory::Executed<'_> {
        crate::memory::Executed {
            holds: &self.holds,
            resized: &self.resized,
            extras: &self.extras,
            markers_alias: self.markers_alias,
        }
    }
}

/// A value the executor stores in `bytes`, where the graph's value has other bytes: the eager
/// counterpart of a traced op holds another tensor (eager CPU dropout's mask).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resized {
    pub value: ValueId,
    pub bytes: u64,
}

/// Memory the executor allocates just before the step `from` runs and keeps through the step
/// `until` (eager checkpointing's stash of the CPU generator state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extra {
    pub bytes: u64,
    pub from: Until,
    pub until: Until,
}

/// A forward value the executor holds until a step: eager checkpointing's cache of a kept op's
/// outputs, a checkpoint's inputs, what eager autograd and the model's Python code keep
/// referenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub value: ValueId,
    pub until: Until,
    pub kind: HoldKind,
}

/// Which tensor a [`Hold`] keeps, which matters only for a storage the plan offloads
/// (docs/cost-and-memory.md, M5): eager SAC's cache then holds the host copy, while everything
/// else holds the device tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldKind {
    /// The device tensor: autograd's saved tensors, the model's Python references.
    Device,
    /// Eager SAC's cache entry of a kept op's output. For an offloaded storage the cache holds
    /// the host copy: the hold keeps nothing on the device and asks for no reload.
    Cache,
    /// The recompute taking an offloaded kept output back from the cache: a read of the device
    /// tensor, which the reload brings back. Nothing for a storage left on the device, which
    /// its [`HoldKind::Cache`] hold keeps.
    CacheServe,
    /// A checkpoint's input, held by its frame: the device tensor, even where eager SAC's cache
    /// also holds a host copy of it.
    Frame,
}

/// A step of the schedule: the last step at which a [`Hold`] keeps its value, or where an
/// [`Extra`] begins or ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// The forward step of this node.
    Forward(NodeId),
    /// The replay step of this forward node.
    Replay(NodeId),
    /// The backward step at this position of [`Partition::order`].
    Backward(usize),
}

/// A replayed op of an eager recompute that cannot reproduce what it did in forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hazard {
    pub layer: LayerRef,
    /// The replayed op.
    pub node: NodeId,
    /// The resident tensor it writes again, or reads after forward wrote it.
    pub value: ValueId,
    pub kind: HazardKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HazardKind {
    /// It writes in place a tensor that stays resident: the write happens twice.
    WritesResident,
    /// It reads a resident tensor that forward writes in place after it (by `writer`).
    ReadsOverwritten { writer: NodeId },
}

/// The partition is not closed: a bug in the planner, never a user error.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PartitionError {
    #[error("backward node `{node}` reads `{value}`, which is neither saved, a graph input, produced by a replay scheduled before it, nor produced earlier in backward")]
    Unavailable { node: String, value: String },
    #[error("replay node `{node}` reads `{value}`, which is neither saved, a graph input, nor produced earlier in the same replay")]
    ReplayInputUnavailable { node: String, value: String },
    #[error("replay holds `{node}`, which the policy decided to {decision}")]
    ReplaysNonRecompute {
        node: String,
        decision: &'static str,
    },
    #[error("replay node `{node}` mutates `{value}`, which that replay does not produce")]
    ReplayMutatesOutside { node: String, value: String },
    #[error("replay node `{node}` reads `{value}`, which `{writer}` writes in place before it in forward, but the replay does not re-run `{writer}`")]
    ReplayMissesWrite {
        node: String,
        value: String,
        writer: String,
    },
    #[error("replay node `{node}` reads resident `{value}`, which `{writer}` writes in place after it in forward: the replay would read the written value")]
    ReplayReadsOverwritten {
        node: String,
        value: String,
        writer: String,
    },
    #[error("replay node `{node}` reads `{value}`, which `{writer}` writes in place {forward} it in forward, but the replay runs `{writer}` {replay} it")]
    ReplayReordersWrite {
        node: String,
        value: String,
        writer: String,
        forward: &'static str,
        replay: &'static str,
    },
}

/// Whether the graph has a backward phase to partition.
pub fn is_joint(graph: &Graph) -> bool {
    graph.nodes().values().any(|n| n.phase == Phase::Backward)
}

/// Partitions a joint graph under `policy`.
pub fn partition(graph: &Graph, policy: &Policy, executor: Executor) -> Partition {
    if executor == Executor::Eager {
        return eager::partition(graph, policy);
    }
    let order = graph.backward_order().to_vec();
    let mut state = Builder::new(graph, policy);
    for (at, &id) in order.iter().enumerate() {
        for &v in &graph.node(id).inputs {
            state.need(v, at);
        }
    }
    let mut partition = state.finish(order);
    partition.markers_alias = markers_alias(executor);
    partition
}

/// What the executor holds when nothing is checkpointed: eager autograd keeps saved tensors
/// by node and some only for their shape, and the model's Python code keeps values referenced
/// past their last use; a graph executor frees op by op.
pub fn no_checkpoint_holds(graph: &Graph, executor: Executor) -> Vec<Hold> {
    match executor {
        Executor::Eager => {
            let mut holds = eager::autograd_holds(graph, graph.backward_order());
            holds.extend(eager::python_holds(graph));
            holds
        }
        Executor::Graph | Executor::Compiled => Vec::new(),
    }
}

/// Whether the executor runs no marker op, checkpointed or not: eager PyTorch's markers
/// return their tensor, and the compile stage removes them from its graphs.
pub fn markers_alias(executor: Executor) -> bool {
    matches!(executor, Executor::Eager | Executor::Compiled)
}

/// The values the executor stores in other bytes than the graph says, checkpointed or not
/// (eager CPU dropout's mask; nothing for a graph executor).
pub fn resized(graph: &Graph, executor: Executor) -> Vec<Resized> {
    match executor {
        Executor::Eager => eager::resized(graph),
        Executor::Graph | Executor::Compiled => Vec::new(),
    }
}

/// How a forward value reaches backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Unvisited,
    /// Resident: saved (or a graph input).
    Saved(SavedKind),
    /// Produced by the replay of its producer's layer.
    Replayed,
    /// Produced in backward.
    Backward,
}

struct Builder<'a> {
    graph: &'a Graph,
    policy: &'a Policy,
    source: Vec<Source>,
    in_replay: Vec<bool>,
    /// Per (model, layer): the position (in backward order) of the first node needing that
    /// layer's replay.
    first_use: HashMap<LayerRef, usize>,
    /// The values [`Builder::need`] still has to visit (kept to reuse its allocation).
    stack: Vec<ValueId>,
    /// Where each value comes from, once classified.
    memo: std::cell::RefCell<Vec<Memo>>,
}

#[derive(Debug, Clone, Copy)]
enum Memo {
    Unknown,
    InProgress,
    Known(Source),
}

impl<'a> Builder<'a> {
    fn new(graph: &'a Graph, policy: &'a Policy) -> Self {
        Builder {
            graph,
            policy,
            source: vec![Source::Unvisited; graph.values().len()],
            in_replay: vec![false; graph.nodes().len()],
            first_use: HashMap::default(),
            stack: Vec::new(),
            memo: std::cell::RefCell::new(vec![Memo::Unknown; graph.values().len()]),
        }
    }

    /// Makes `value` available to the backward node at position `user`: saved if it can be,
    /// else replayed.
    fn need(&mut self, value: ValueId, user: usize) {
        let mut stack = std::mem::take(&mut self.stack);
        stack.push(value);
        while let Some(v) = stack.pop() {
            if self.source[v.index()] == Source::Replayed {
                self.note_use(v, user);
                continue;
            }
            if self.source[v.index()] != Source::Unvisited {
                continue;
            }
            let source = self.settled(v, self.classify(v));
            self.source[v.index()] = source;
            if source != Source::Replayed {
                continue;
            }
            self.note_use(v, user);
            let producer = self
                .graph
                .producer(v)
                .expect("replayed values have a producer");
            // A replayed tensor must also be written by the in-place ops that wrote it in
            // forward, or later readers of its old name would see it unwritten.
            for n in std::iter::once(producer).chain(self.in_place_writers(v)) {
                if !self.in_replay[n.index()] {
                    self.in_replay[n.index()] = true;
                    stack.extend(self.graph.node(n).inputs.iter().copied());
                }
            }
        }
        self.stack = stack;
    }

    /// `source`, `value`'s classification, checked again now that the tensors it depended on
    /// are known: a value classified inside a cycle of in-place writes was classified assuming
    /// the storages of that cycle replay, and its producer may turn out to write, or read, a
    /// tensor that stays resident, so it cannot replay after all.
    fn settled(&self, value: ValueId, source: Source) -> Source {
        if source != Source::Replayed {
            return source;
        }
        let producer = self
            .graph
            .producer(value)
            .expect("replayed values have a producer");
        let kind = if self.writes_resident(producer) {
            SavedKind::WritesResident
        } else if self.reads_overwritten(producer) {
            SavedKind::ReadsOverwritten
        } else {
            return source;
        };
        let settled = Source::Saved(kind);
        self.memo.borrow_mut()[value.index()] = Memo::Known(settled);
        settled
    }

    /// Where `value` comes from, without replay if possible (memoised).
    fn classify(&self, value: ValueId) -> Source {
        match self.memo.borrow()[value.index()] {
            Memo::Known(source) => return source,
            // A cycle through in-place writes: assume the value replays; the verifier checks
            // the partition that comes of it.
            Memo::InProgress => return Source::Replayed,
            Memo::Unknown => {}
        }
        self.memo.borrow_mut()[value.index()] = Memo::InProgress;
        let source = self.classify_once(value);
        self.memo.borrow_mut()[value.index()] = Memo::Known(source);
        source
    }

    fn classify_once(&self, value: ValueId) -> Source {
        let graph = self.graph;
        let Some(producer) = graph.producer(value) else {
            return Source::Saved(match graph.value(value).role {
                ir::Role::Parameter => SavedKind::Parameter,
                _ => SavedKind::GraphInput,
            });
        };
        let node = graph.node(producer);
        if node.phase == Phase::Backward {
            return Source::Backward;
        }
        match self.policy.decision(producer) {
            Some(Decision::Save) => Source::Saved(SavedKind::Kept),
            Some(Decision::NoCheckpoint) | None => Source::Saved(SavedKind::NotCheckpointed),
            Some(Decision::Recompute) if self.leaves_its_layer(value, producer) => {
                Source::Saved(SavedKind::LayerInput)
            }
            Some(Decision::Recompute) if self.writes_resident(producer) => {
                Source::Saved(SavedKind::WritesResident)
            }
            Some(Decision::Recompute) if self.reads_overwritten(producer) => {
                Source::Saved(SavedKind::ReadsOverwritten)
            }
            Some(Decision::Recompute) if self.written_unreplayably(value) => {
                Source::Saved(SavedKind::WrittenUnreplayably)
            }
            Some(Decision::Recompute) => Source::Replayed,
        }
    }

    /// A recomputed value read by a forward node of another layer is that layer's input, which
    /// whole-layer checkpointing saves.
    fn leaves_its_layer(&self, value: ValueId, producer: NodeId) -> bool {
        let p = self.graph.node(producer);
        self.graph.consumers(value).iter().any(|&c| {
            let c = self.graph.node(c);
            c.phase == Phase::Forward && (c.model, c.layer) != (p.model, p.layer)
        })
    }

    /// Forward ops of the layer that made `value`'s storage which write that storage in place,
    /// through `value` or any view of it, and which the policy recomputes.
    fn layer_writers(&self, value: ValueId) -> impl Iterator<Item = NodeId> + '_ {
        let root = self.graph.storage_root(value);
        let layer = self
            .graph
            .producer(root)
            .map(|p| (self.graph.node(p).model, self.graph.node(p).layer));
        self.graph
            .storage_writers(value)
            .iter()
            .copied()
            .filter(move |&m| {
                let n = self.graph.node(m);
                n.phase == Phase::Forward
                    && Some((n.model, n.layer)) == layer
                    && self.policy.decision(m) == Some(Decision::Recompute)
            })
    }

    /// The in-place writers a replay of `value` re-runs with it: those of its storage, when
    /// the storage itself is replayed (a resident storage holds its writes already).
    fn in_place_writers(&self, value: ValueId) -> Vec<NodeId> {
        let root = self.graph.storage_root(value);
        if self.classify(root) != Source::Replayed {
            return Vec::new();
        }
        self.layer_writers(value).collect()
    }

    /// Whether replaying `node` reproduces what it did in forward.
    fn replayable(&self, node: NodeId) -> bool {
        !self.writes_resident(node) && !self.reads_overwritten(node)
    }

    /// Whether replaying `value`'s producer would make a storage that an op which cannot
    /// replay writes in place: `value` must then stay resident, holding that write. A replayed
    /// op makes all its fresh outputs again, so each of them is asked, not only `value`.
    fn written_unreplayably(&self, value: ValueId) -> bool {
        let Some(producer) = self.graph.producer(value) else {
            return false;
        };
        self.graph.node(producer).outputs.iter().any(|&made| {
            self.graph.storage_root(made) == made
                && self.layer_writers(made).any(|w| !self.replayable(w))
        })
    }

    /// Whether `node` writes in place the storage of a tensor that is resident rather than
    /// replayed (directly or through a view): a replay would write it twice. The written
    /// tensor itself may be resident while its storage's root is not (an alias saved as the
    /// input of a later layer), so both are asked.
    fn writes_resident(&self, node: NodeId) -> bool {
        let node = self.graph.node(node);
        node.effects.mutates.iter().any(|&p| {
            let written = node.inputs[p];
            [written, self.graph.storage_root(written)]
                .into_iter()
                .any(|v| matches!(self.classify(v), Source::Saved(_)))
        })
    }

    /// Whether `node` reads a resident tensor that forward writes in place after it: in
    /// backward the resident tensor holds the written value, so a replay of `node` would read
    /// something else than forward did. A view reads nothing: it aliases whatever its base
    /// holds, in forward as in replay. As for writes, the tensor read may be resident while
    /// its storage's root is not (an alias saved as the input of a later layer): both are
    /// asked.
    fn reads_overwritten(&self, node: NodeId) -> bool {
        let n = self.graph.node(node);
        if n.effects.view_of.is_some() {
            return false;
        }
        n.inputs.iter().any(|&input| {
            let written_later = self
                .graph
                .storage_writers(input)
                .iter()
                .any(|&w| w > node && self.graph.node(w).phase == Phase::Forward);
            written_later
                && [input, self.graph.storage_root(input)]
                    .into_iter()
                    .any(|v| matches!(self.classify(v), Source::Saved(_)))
        })
    }

    /// The first backward use of a value produced by replay schedules its layer's replay.
    fn note_use(&mut self, value: ValueId, user: usize) {
        let Some(producer) = self.graph.producer(value) else {
            return;
        };
        let node = self.graph.node(producer);
        let Some(layer) = node.layer else { return };
        let at = LayerRef {
            model: node.model,
            layer,
        };
        let first = self.first_use.entry(at).or_insert(user);
        if user < *first {
            *first = user;
        }
    }

    fn finish(self, order: Vec<NodeId>) -> Partition {
        let saved = self
            .source
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Source::Saved(kind) => Some(Saved {
                    value: ValueId::from_index(i),
                    kind: *kind,
                }),
                _ => None,
            })
            .collect();
        let mut by_layer: BTreeMap<LayerRef, Vec<NodeId>> = BTreeMap::new();
        for (id, node) in self.graph.nodes().iter() {
            if self.in_replay[id.index()] {
                // Replayed nodes are recomputed ones, which only exist in layers.
                let layer = LayerRef {
                    model: node.model,
                    layer: node.layer.unwrap_or_default(),
                };
                by_layer.entry(layer).or_default().push(id);
            }
        }
        let steps = ReplaySteps::new(self.graph, &order, &self.in_replay);
        let mut replays: Vec<Replay> = by_layer
            .into_iter()
            .flat_map(|(layer, nodes)| {
                // Every replayed value was needed, which noted its layer's first use.
                steps.split(layer, nodes, self.first_use[&layer], &order)
            })
            .collect();
        replays.sort_by_key(|r| (r.position, r.layer));
        Partition {
            order,
            saved,
            replays,
            hazards: Vec::new(),
            holds: Vec::new(),
            resized: Vec::new(),
            extras: Vec::new(),
            markers_alias: false,
        }
    }
}

/// When each replayed node runs: just before the first backward node that needs it, directly
/// or through a replayed node that reads it (as torch.compile's partitioner orders recompute),
/// so a replayed value lives from its first use to its last, not from its layer's first use.
///
/// The ops of a layer's replay that touch a tensor something writes in place keep forward's
/// order among themselves, so every read sees the writes it saw in forward. Every layer of a
/// graph whose backward writes in place a tensor it did not make replays at once, before its
/// first use (a later replay could read the written tensor).
struct ReplaySteps<'a> {
    graph: &'a Graph,
    /// Per node: the first backward position that reads one of its outputs (`usize::MAX`:
    /// none does).
    anchor: Vec<usize>,
    /// Whether replays may be split at all.
    split: bool,
}

impl<'a> ReplaySteps<'a> {
    fn new(graph: &'a Graph, order: &[NodeId], in_replay: &[bool]) -> ReplaySteps<'a> {
        let mut anchor = vec![usize::MAX; graph.nodes().len()];
        let mut split = true;
        for (at, &id) in order.iter().enumerate() {
            let node = graph.node(id);
            for &v in &node.inputs {
                if let Some(p) = graph.producer(v).filter(|p| in_replay[p.index()]) {
                    anchor[p.index()] = anchor[p.index()].min(at);
                }
            }
            split &= node.effects.mutates.iter().all(|&i| {
                let root = graph.storage_root(node.inputs[i]);
                graph
                    .producer(root)
                    .is_some_and(|p| graph.node(p).phase == Phase::Backward)
            });
        }
        ReplaySteps {
            graph,
            anchor,
            split,
        }
    }

    /// `layer`'s replay of `nodes` (in forward order) as steps in schedule order.
    fn split(
        &self,
        layer: LayerRef,
        nodes: Vec<NodeId>,
        first_use: usize,
        order: &[NodeId],
    ) -> Vec<Replay> {
        let at = |position: usize, nodes: Vec<NodeId>| Replay {
            layer,
            before: order[position],
            position,
            nodes,
        };
        if !self.split {
            return vec![at(first_use, nodes)];
        }
        let positions = self.positions(&nodes, first_use);
        let mut by_position: BTreeMap<usize, Vec<NodeId>> = BTreeMap::new();
        for (&n, position) in nodes.iter().zip(positions) {
            by_position.entry(position).or_default().push(n);
        }
        by_position
            .into_iter()
            .map(|(position, nodes)| at(position, nodes))
            .collect()
    }

    /// Per node of `nodes` (one layer's replay, in forward order): the first backward position
    /// that needs it, through the replayed nodes that read it (`first_use` for a node nothing
    /// needs that way), and never after a later node that touches a storage it touches which
    /// something writes in place (so writes and reads of it keep forward's order).
    fn positions(&self, nodes: &[NodeId], first_use: usize) -> Vec<usize> {
        let before = self.earlier_nodes(nodes);
        let mut positions: Vec<usize> = nodes.iter().map(|n| self.anchor[n.index()]).collect();
        no_later_than(&before, &mut positions);
        if positions.contains(&usize::MAX) {
            for p in positions.iter_mut().filter(|p| **p == usize::MAX) {
                *p = first_use;
            }
            no_later_than(&before, &mut positions);
        }
        positions
    }

    /// Per node of `nodes` (by index): the earlier nodes of `nodes` it must not run before: the
    /// producers of its inputs, and for each written storage it touches (through any alias), the
    /// node that touched it last before it in forward order.
    fn earlier_nodes(&self, nodes: &[NodeId]) -> Vec<Vec<usize>> {
        let graph = self.graph;
        let mut last_touch: HashMap<ValueId, usize> = HashMap::default();
        nodes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let node = graph.node(n);
                let mut earlier: Vec<usize> = node
                    .inputs
                    .iter()
                    .filter_map(|&v| graph.producer(v))
                    .filter_map(|p| nodes.binary_search(&p).ok())
                    .collect();
                for &v in node.inputs.iter().chain(&node.outputs) {
                    let root = graph.storage_root(v);
                    if graph.storage_writers(root).is_empty() {
                        continue;
                    }
                    if let Some(previous) = last_touch.insert(root, k).filter(|&j| j != k) {
                        earlier.push(previous);
                    }
                }
                earlier
            })
            .collect()
    }
}

/// Moves each node no later than the nodes that must come after it (`before[k]` lists the
/// earlier nodes node `k` must not precede); one pass in reverse order settles every chain.
fn no_later_than(before: &[Vec<usize>], positions: &mut [usize]) {
    for k in (0..before.len()).rev() {
        let needed_at = positions[k];
        for &j in &before[k] {
            positions[j] = positions[j].min(needed_at);
        }
    }
}

/// Proves the partition closed: every value a backward node reads is saved, a graph input,
/// produced by a replay scheduled before it or produced earlier in backward; every replay input
/// is saved, a graph input or produced earlier in the same replay; replay holds only recomputed
/// ops, and a mutable op in replay writes only what that replay produced.
pub fn verify(graph: &Graph, policy: &Policy, partition: &Partition) -> Result<(), PartitionError> {
    let mut resident = vec![false; graph.values().len()];
    for s in &partition.saved {
        resident[s.value.index()] = true;
    }
    for (id, value) in graph.values().iter() {
        if graph.producer(id).is_none() {
            resident[id.index()] = value.role.is_graph_input();
        }
    }
    // Each layer's replay over all its steps, numbered from 1 (its stamp).
    let mut layers: BTreeMap<LayerRef, Vec<NodeId>> = BTreeMap::new();
    for r in &partition.replays {
        layers.entry(r.layer).or_default().extend(&r.nodes);
    }
    let layers: HashMap<LayerRef, (u32, Vec<NodeId>)> = layers
        .into_iter()
        .enumerate()
        .map(|(k, (layer, mut nodes))| {
            nodes.sort_unstable();
            (layer, (k as u32 + 1, nodes))
        })
        .collect();
    // Which layer's replay (by stamp) produced each value; 0 for none.
    let mut produced_by = vec![0u32; graph.values().len()];
    let mut replays = partition.replays.iter().peekable();
    for (at, &id) in partition.order.iter().enumerate() {
        let node = graph.node(id);
        while let Some(replay) = replays.next_if(|r| r.position <= at) {
            let (stamp, whole) = &layers[&replay.layer];
            let step = ReplayStep {
                nodes: &replay.nodes,
                layer: whole,
                stamp: *stamp,
            };
            verify_replay(graph, policy, &step, &mut resident, &mut produced_by)?;
        }
        for &v in &node.inputs {
            if !resident[v.index()] {
                return Err(PartitionError::Unavailable {
                    node: node.name.to_string(),
                    value: graph.value(v).name.to_string(),
                });
            }
        }
        for &v in &node.outputs {
            resident[v.index()] = true;
        }
    }
    Ok(())
}

/// What a replayed `reader` sees of `value` must be what it saw in forward. When `value`'s
/// storage was made by this layer's replay (`replayed`), every forward op of that storage's
/// layer that wrote it in place before `reader` ran must be in the replay too and have run
/// (`ran`), and no write after it in forward may have run yet; when the storage is resident, no
/// forward op may write it after `reader` ran (backward holds the written value).
fn check_reads_see_forward(
    graph: &Graph,
    replay: &ReplayStep,
    (reader, value): (NodeId, ValueId),
    replayed: bool,
    ran: impl Fn(NodeId) -> bool,
) -> Result<(), PartitionError> {
    let root = graph.storage_root(value);
    let producer = graph.producer(root).map(|p| graph.node(p));
    for &m in graph.storage_writers(value) {
        let writer = graph.node(m);
        if writer.phase != Phase::Forward || m == reader {
            continue;
        }
        let same_layer =
            producer.is_some_and(|p| (p.model, p.layer) == (writer.model, writer.layer));
        let in_replay = replay.layer.binary_search(&m).is_ok();
        if replayed && m < reader && same_layer && !in_replay {
            return Err(PartitionError::ReplayMissesWrite {
                node: graph.node(reader).name.to_string(),
                value: graph.value(value).name.to_string(),
                writer: writer.name.to_string(),
            });
        }
        if replayed && in_replay && (m < reader) != ran(m) {
            let (forward, replay) = if m < reader {
                ("before", "after")
            } else {
                ("after", "before")
            };
            return Err(PartitionError::ReplayReordersWrite {
                node: graph.node(reader).name.to_string(),
                value: graph.value(value).name.to_string(),
                writer: writer.name.to_string(),
                forward,
                replay,
            });
        }
        // A view reads nothing: it aliases whatever its base holds.
        let reads_data = graph.node(reader).effects.view_of.is_none();
        if !replayed && m > reader && reads_data {
            return Err(PartitionError::ReplayReadsOverwritten {
                node: graph.node(reader).name.to_string(),
                value: graph.value(value).name.to_string(),
                writer: writer.name.to_string(),
            });
        }
    }
    Ok(())
}

/// One step of a layer's replay, as the verifier checks it.
struct ReplayStep<'a> {
    nodes: &'a [NodeId],
    /// Every node of the layer's replay, over all its steps (sorted).
    layer: &'a [NodeId],
    /// Numbers the layer's replay: no per-replay table to clear.
    stamp: u32,
}

fn verify_replay(
    graph: &Graph,
    policy: &Policy,
    replay: &ReplayStep,
    resident: &mut [bool],
    produced_by: &mut [u32],
) -> Result<(), PartitionError> {
    // Made by this layer's replay, in this step or an earlier one.
    let here = |v: ValueId, produced_by: &[u32]| produced_by[v.index()] == replay.stamp;
    for &id in replay.nodes {
        let node = graph.node(id);
        match policy.nodes[id] {
            Some(p) if p.decision == Decision::Recompute => {}
            other => {
                return Err(PartitionError::ReplaysNonRecompute {
                    node: node.name.to_string(),
                    decision: other.map_or("leave undecided", |p| p.decision.name()),
                })
            }
        }
        for &v in &node.inputs {
            let produced_here = here(v, produced_by);
            if !resident[v.index()] && !produced_here {
                return Err(PartitionError::ReplayInputUnavailable {
                    node: node.name.to_string(),
                    value: graph.value(v).name.to_string(),
                });
            }
            // The replay reads `v`'s own copy: a storage this replay made only if `v` was made
            // here too (a resident alias of it, like the output of an in-place op that does
            // not replay, still holds the forward storage with its writes).
            let storage_here = produced_here && here(graph.storage_root(v), produced_by);
            let ran = |m: NodeId| {
                graph
                    .node(m)
                    .outputs
                    .first()
                    .is_some_and(|&o| here(o, produced_by))
            };
            check_reads_see_forward(graph, replay, (id, v), storage_here, ran)?;
        }
        for &p in &node.effects.mutates {
            let written = node.inputs[p];
            // Writing a view of a resident tensor writes the resident tensor.
            let root = graph.storage_root(written);
            if !here(written, produced_by) || !here(root, produced_by) {
                return Err(PartitionError::ReplayMutatesOutside {
                    node: node.name.to_string(),
                    value: graph.value(written).name.to_string(),
                });
            }
        }
        for &v in &node.outputs {
            produced_by[v.index()] = replay.stamp;
        }
    }
    for &id in replay.nodes {
        for &v in &graph.node(id).outputs {
            resident[v.index()] = true;
        }
    }
    Ok(())
}
