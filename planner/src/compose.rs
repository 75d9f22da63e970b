//! Incremental planning: a plan's replay time, saved set and memory peak composed from what
//! each checkpointed layer contributes, so that a search trying one layer's option at a time
//! re-plans nothing.
//!
//! The policy decides each (model, layer, micro-batch) session from that layer's kept units
//! alone; a layer's replay subgraph, its position (the first backward read of a value it
//! replays) and the values it makes resident depend on its own decisions and on what backward
//! reads. So one plan of the graph with the same option in every layer of a model (a *run*)
//! gives every layer's contribution under that option, and `2^units` runs per model give them
//! all.
//!
//! Memory composes on a fixed *timeline*: one slot per forward node, then per backward
//! position the replay slots of every layer that any option replays there, then the backward
//! node. A plan's steps are a subsequence of the slots, and a slot no plan step uses never
//! holds more than the next used one, so the peak over the slots is the simulation's peak. A
//! storage lives from the slot that makes it to the last slot that reads it; each read is
//! owed to one layer's option (a replay's reads to its layer; a backward read to the layer
//! whose replay decides which copy it finds, the producer's) or to no option at all. A layer's
//! contribution is the storages its replay makes and the last slot at which it reads each
//! other storage; a storage's last read is the latest over the fixed reads and the current
//! option of every layer reading it. The live bytes of all slots sit in a max segment tree
//! under range additions, so changing one layer's option costs its storages' intervals times
//! log(slots), and the peak is the root.
//!
//! Where these facts do not hold (a replay reading a copy another layer's replay made; byte
//! totals beyond `i64`), the recording says so ([`Composer::exact`]), and callers check their
//! answers with full plans.

use ir::{
    plan::{Executor, LayerRef, SavedKind, Stage},
    EntityId, Graph, ModelId, NodeId, Phase, ValueId,
};

use crate::{
    cost::NodeWork,
    memory::{self, Instance, Observer, Step},
    partition::{Extra, Hold, Partition, Replay, Resized, Saved, Until},
    policy::Policy,
};

/// A storage's life on the timeline: from slot `alloc` to slot `last`, both included
/// (ordered by slots first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Life {
    alloc: u32,
    last: u32,
    bytes: u64,
}

/// What one checkpointed layer contributes to a plan under one option.
#[derive(Debug, Clone, Default)]
pub struct Contribution {
    /// False when the option makes the plan an error (an in-place write of a kept output that
    /// cannot replay, an unfaithful eager recompute in this layer).
    pub allowed: bool,
    /// Replay seconds of the layer, and the same in [`Ticks`].
    pub seconds: f64,
    pub ticks: Ticks,
    /// Bytes of the layer's kept outputs and of the recomputed ops that write a resident
    /// tensor (each storage once): what keeping costs by a linear peak model.
    pub kept_bytes: u64,
    /// The layer's replay, in schedule order (empty if it replays nothing).
    replay: Vec<Replay>,
    /// Storages the replay makes.
    made: Vec<Life>,
    /// Fixed storages this option reads: (creating value, last slot), by value.
    reads: Vec<(u32, u32)>,
    /// Saved values this option makes resident.
    saved: Vec<Saved>,
}

/// Slots of the layers a search chooses options for, and the layer of every node.
pub struct Layers {
    /// The layers, in order.
    pub at: Vec<LayerRef>,
    /// Per node: the index of its layer in `at` ([`NONE`] outside them).
    node_layer: Vec<u32>,
    /// Per value: whether a backward node reads it.
    read_by_backward: Vec<bool>,
}

const NONE: u32 = u32::MAX;
/// The group of reads and storages no option changes.
const FIXED: u32 = u32::MAX;
/// The group of reads and storages of layers another run records.
const IGNORED: u32 = u32::MAX - 1;

impl Layers {
    pub fn new(graph: &Graph, at: Vec<LayerRef>) -> Layers {
        let mut node_layer = vec![NONE; graph.nodes().len()];
        for (id, node) in graph.nodes().iter() {
            if let Some(layer) = node.layer {
                let key = LayerRef {
                    model: node.model,
                    layer,
                };
                if let Ok(i) = at.binary_search(&key) {
                    node_layer[id.index()] = i as u32;
                }
            }
        }
        let mut read_by_backward = vec![false; graph.values().len()];
        for &id in graph.backward_order() {
            for &v in &graph.node(id).inputs {
                read_by_backward[v.index()] = true;
            }
        }
        Layers {
            at,
            node_layer,
            read_by_backward,
        }
    }

    fn of_node(&self, node: NodeId) -> u32 {
        self.node_layer[node.index()]
    }

    /// The layer index of `node` when its model is `varied` ([`IGNORED`] for other searched
    /// models, [`FIXED`] outside the searched layers).
    fn group(&self, node: NodeId, varied: ModelId) -> u32 {
        match self.of_node(node) {
            NONE => FIXED,
            l if self.at[l as usize].model == varied => l,
            _ => IGNORED,
        }
    }
}

/// The slots: forward nodes, then per backward position the replay slots of every run and
/// the backward node.
pub struct Timeline {
    forward: u32,
    /// Per backward position, the start of its replay slots in `replay` (one more at the end).
    offsets: Vec<u32>,
    /// Replay slots by position, then layer, then node.
    replay: Vec<(LayerRef, NodeId)>,
}

impl Timeline {
    /// The timeline of a graph whose runs replay `replays`.
    pub fn new<'r>(graph: &Graph, replays: impl Iterator<Item = &'r Replay>) -> Timeline {
        let order = graph.backward_order();
        // Per position and layer, the union of the nodes its replays there run.
        let mut at: Vec<(u32, LayerRef, &[NodeId])> = replays
            .map(|r| (r.position as u32, r.layer, r.nodes.as_slice()))
            .collect();
        at.sort_unstable_by_key(|&(position, layer, _)| (position, layer));
        let mut offsets = vec![0u32; order.len() + 1];
        let mut replay = Vec::new();
        // The group each node was last pushed for: a union without sorting duplicates.
        let mut seen = vec![usize::MAX; graph.nodes().len()];
        for (k, group) in at.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)).enumerate() {
            let (position, layer, _) = group[0];
            let start = replay.len();
            for &n in group.iter().flat_map(|g| g.2) {
                if seen[n.index()] != k {
                    seen[n.index()] = k;
                    replay.push((layer, n));
                }
            }
            replay[start..].sort_unstable();
            offsets[position as usize + 1] += (replay.len() - start) as u32;
        }
        for p in 0..order.len() {
            offsets[p + 1] += offsets[p];
        }
        let forward = graph
            .nodes()
            .values()
            .filter(|n| n.phase == Phase::Forward)
            .count() as u32;
        Timeline {
            forward,
            offsets,
            replay,
        }
    }

    /// Number of slots.
    fn len(&self) -> usize {
        self.forward as usize + self.replay.len() + self.offsets.len() - 1
    }

    fn backward_slot(&self, position: usize) -> u32 {
        self.forward + self.offsets[position + 1] + position as u32
    }

    fn replay_slot(&self, position: usize, layer: LayerRef, node: NodeId) -> u32 {
        let (start, end) = (
            self.offsets[position] as usize,
            self.offsets[position + 1] as usize,
        );
        let k = self.replay[start..end]
            .binary_search(&(layer, node))
            .unwrap_or(0);
        self.forward + self.offsets[position] + position as u32 + k as u32
    }
}

/// One run: what the plan of the graph with option `option` in every searched layer of
/// `varied` (the other searched models keeping nothing) tells about each layer.
pub struct Run {
    varied: ModelId,
    option: usize,
    /// The run's replays, in schedule order.
    replays: Vec<Replay>,
    /// What its executor holds past the last reads (eager checkpointing's cache and inputs).
    holds: Vec<Hold>,
    /// The values its executor stores in other bytes (the same in every run: the graph's and
    /// the executor's).
    resized: Vec<Resized>,
    /// The memory its executor allocates of its own ([`Partition::extras`]): each owed to the
    /// layer whose forward or replay allocates it.
    extras: Vec<Extra>,
    /// Its executor runs no marker op ([`Partition::markers_alias`]; the same in every run).
    markers_alias: bool,
    /// Per layer of `varied`: its contribution, memory aside.
    contributions: Vec<(usize, Contribution)>,
    /// Saved values no option changes.
    fixed_saved: Vec<Saved>,
}

impl Run {
    /// Reads the run off its policy and partition.
    pub fn new(
        graph: &Graph,
        layers: &Layers,
        (varied, option): (ModelId, usize),
        policy: &Policy,
        partition: Partition,
        work: &NodeWork,
        executor: Executor,
    ) -> Run {
        let mut contributions = contributions(graph, layers, varied, policy, &partition, work);
        let mut fixed_saved = Vec::new();
        for (group, saved) in saved_by_group(graph, layers, varied, &partition, executor) {
            match group {
                FIXED => fixed_saved = saved,
                IGNORED => {}
                l => {
                    if let Some((_, c)) = contributions.iter_mut().find(|(k, _)| *k == l as usize) {
                        c.saved = saved;
                    }
                }
            }
        }
        Run {
            varied,
            option,
            replays: partition.replays,
            holds: partition.holds,
            resized: partition.resized,
            extras: partition.extras,
            markers_alias: partition.markers_alias,
            contributions,
            fixed_saved,
        }
    }
}

/// One layer's memory under one option: the lives of the storages its replay makes, and
/// its reads of fixed storages (creating value, last slot).
#[derive(Default)]
struct LayerMemory {
    made: Vec<Life>,
    reads: Vec<(u32, u32)>,
}

/// What a run's simulation records, per layer of the varied model and for the fixed part.
struct Recording {
    /// Per layer of the varied model (by index into [`Layers::at`]), its contribution's
    /// memory.
    layers: Vec<LayerMemory>,
    /// Storages no option changes, with the value that made them ([`NONE`]: made by a replay
    /// of a layer no search chooses for).
    fixed: Vec<(u32, Life)>,
    /// The run's simulated peak, for the composed one to match.
    peak: u64,
    exact: bool,
}

/// The observer that records lifetimes per group.
#[derive(Clone)]
struct Recorder<'a> {
    graph: &'a Graph,
    layers: &'a Layers,
    timeline: &'a Timeline,
    varied: ModelId,
    slot: u32,
    forward_steps: u32,
    stage: Stage,
    /// The group of the running replay.
    group: u32,
    /// Per value: the group owed the choice of its backward copy, and of its replayed copy.
    backward_group: Vec<u32>,
    replayed_group: Vec<u32>,
    /// Per storage: the group that made it, the value that made it, its life by its owner's
    /// reads.
    owner: Vec<u32>,
    made_by: Vec<u32>,
    life: Vec<Life>,
    /// Per layer of the varied model: its reads of fixed storages.
    reads: Vec<Vec<(u32, u32)>>,
    exact: bool,
}

impl Recorder<'_> {
    fn producer_group(&self, value: ValueId) -> u32 {
        self.graph
            .producer(value)
            .map_or(FIXED, |p| self.layers.group(p, self.varied))
    }

    /// The group owed a read of `value` at `stage` that found `copy`.
    fn read_group(&mut self, stage: Stage, value: ValueId, copy: Instance) -> u32 {
        match (stage, copy) {
            (Stage::Forward, _) => FIXED,
            (Stage::Replay, Instance::Replayed) => {
                // A copy another layer's replay made: that layer's option decides it.
                if self.replayed_group[value.index()] != self.group {
                    self.exact = false;
                }
                self.group
            }
            (Stage::Replay, _) => self.group,
            (Stage::Backward, Instance::Backward) => self.backward_group[value.index()],
            (Stage::Backward, Instance::Replayed) => self.replayed_group[value.index()],
            (Stage::Backward, Instance::Forward) => self.producer_group(value),
        }
    }
}

impl Observer for Recorder<'_> {
    fn step(&mut self, step: &Step) {
        self.stage = step.stage;
        self.slot = match (step.stage, step.replay) {
            (Stage::Forward, _) => {
                self.forward_steps += 1;
                self.forward_steps - 1
            }
            (Stage::Replay, Some(r)) => {
                self.group = self.layers.group(step.node, self.varied);
                self.timeline.replay_slot(step.position, r.layer, step.node)
            }
            _ => self.timeline.backward_slot(step.position),
        };
    }

    fn made(&mut self, storage: u32, value: ValueId, bytes: u64) {
        let owner = match self.stage {
            Stage::Replay => {
                self.replayed_group[value.index()] = self.group;
                self.group
            }
            Stage::Backward => {
                self.backward_group[value.index()] = FIXED;
                FIXED
            }
            Stage::Forward => FIXED,
        };
        debug_assert_eq!(storage as usize, self.owner.len());
        self.owner.push(owner);
        let anonymous = self.stage == Stage::Replay;
        self.made_by.push(if anonymous {
            NONE
        } else {
            value.index() as u32
        });
        self.life.push(Life {
            bytes,
            alloc: self.slot,
            last: self.slot,
        });
    }

    fn read(&mut self, stage: Stage, value: ValueId, storage: u32, copy: Instance) {
        let group = self.read_group(stage, value, copy);
        let s = storage as usize;
        let owner = self.owner[s];
        match (group, owner) {
            (IGNORED, o) if o == FIXED || o == IGNORED => {}
            (g, o) if g == o => self.life[s].last = self.slot,
            (g, FIXED) if g != IGNORED && self.made_by[s] != NONE => {
                self.reads[g as usize].push((self.made_by[s], self.slot));
            }
            // A read owed to one layer of a storage another layer's replay made (or made by
            // a replay no option changes): the layers are not independent.
            _ => self.exact = false,
        }
    }

    fn aliased(&mut self, stage: Stage, output: ValueId, base: ValueId, copy: Option<Instance>) {
        match stage {
            Stage::Replay => self.replayed_group[output.index()] = self.group,
            Stage::Backward => {
                self.backward_group[output.index()] =
                    copy.map_or(FIXED, |c| self.read_group(stage, base, c));
            }
            Stage::Forward => {}
        }
    }
}

/// The lives of `run`'s extras on `timeline`, each with the group of the layer that allocates it
/// (made by no value): a stash the layer's forward takes lives from its slot to the backward
/// slot its option frees it at, one its replay takes within the replay's slots.
fn extra_lives(
    graph: &Graph,
    layers: &Layers,
    run: &Run,
    timeline: &Timeline,
) -> Vec<(u32, u32, Life)> {
    if run.extras.is_empty() {
        return Vec::new();
    }
    let mut forward_slot = vec![0u32; graph.nodes().len()];
    let forward = graph
        .nodes()
        .iter()
        .filter(|(_, n)| n.phase == Phase::Forward);
    for (k, (id, _)) in forward.enumerate() {
        forward_slot[id.index()] = k as u32;
    }
    let replay_of = |node: NodeId| run.replays.iter().find(|r| r.nodes.contains(&node));
    let slot = |at: Until| match at {
        Until::Forward(node) => Some(forward_slot[node.index()]),
        Until::Replay(node) => {
            replay_of(node).map(|r| timeline.replay_slot(r.position, r.layer, node))
        }
        Until::Backward(position) => Some(timeline.backward_slot(position)),
    };
    run.extras
        .iter()
        .filter_map(|e| {
            let node = match e.from {
                Until::Forward(node) | Until::Replay(node) => node,
                Until::Backward(_) => return None,
            };
            let (alloc, last) = (slot(e.from)?, slot(e.until)?);
            let life = Life {
                alloc,
                last: last.max(alloc),
                bytes: e.bytes,
            };
            Some((layers.group(node, run.varied), NONE, life))
        })
        .collect()
}

/// The recorder of a simulation on `timeline`, before any step.
fn recorder<'a>(graph: &'a Graph, layers: &'a Layers, timeline: &'a Timeline) -> Recorder<'a> {
    let n = graph.values().len();
    Recorder {
        graph,
        layers,
        timeline,
        varied: ModelId::from_index(0),
        slot: 0,
        forward_steps: 0,
        stage: Stage::Forward,
        group: FIXED,
        backward_group: vec![FIXED; n],
        replayed_group: vec![FIXED; n],
        owner: Vec::with_capacity(graph.nodes().len()),
        made_by: Vec::with_capacity(graph.nodes().len()),
        life: Vec::with_capacity(graph.nodes().len()),
        reads: vec![Vec::new(); layers.at.len()],
        exact: true,
    }
}

/// Records `run`'s backward on `timeline`, from the shared forward; the fixed storages only
/// `with_fixed`.
fn record(
    graph: &Graph,
    forward: &memory::AfterForward<'_, Recorder<'_>>,
    run: &Run,
    with_fixed: bool,
    timeline: &Timeline,
) -> Recording {
    let mut sim = forward.clone();
    sim.observer_mut().varied = run.varied;
    let executed = memory::Executed::holding(&run.holds);
    let (simulation, recorder) = sim.backward(graph.backward_order(), &run.replays, executed);
    let layers_of = recorder.layers;
    let Recorder {
        owner,
        made_by,
        life,
        reads,
        exact,
        ..
    } = recorder;
    let mut made: Vec<Vec<Life>> = vec![Vec::new(); reads.len()];
    let mut fixed = Vec::new();
    let extras = extra_lives(graph, layers_of, run, timeline);
    let owned = owner
        .iter()
        .zip(&made_by)
        .zip(&life)
        .map(|((&o, &by), &l)| (o, by, l));
    for (owner, by, life) in owned.chain(extras) {
        match owner {
            FIXED if with_fixed => fixed.push((by, life)),
            FIXED => {}
            IGNORED => {}
            l => made[l as usize].push(life),
        }
    }
    // The recorded simulation runs without the extras: the run's own peak counts them.
    let peak = if run.extras.is_empty() {
        simulation.peak_bytes
    } else {
        let executed = memory::Executed {
            holds: &run.holds,
            resized: &run.resized,
            extras: &run.extras,
            markers_alias: run.markers_alias,
        };
        memory::simulate_executed(graph, graph.backward_order(), &run.replays, executed).peak_bytes
    };
    for lives in &mut made {
        lives.sort_unstable();
    }
    let layers = made
        .into_iter()
        .zip(reads)
        .map(|(made, mut reads)| {
            // Reads come in slot order: the last read of a storage is its last entry.
            reads.sort_by_key(|&(value, _)| value);
            let mut merged: Vec<(u32, u32)> = Vec::with_capacity(reads.len());
            for (value, slot) in reads {
                match merged.last_mut() {
                    Some(last) if last.0 == value => last.1 = last.1.max(slot),
                    _ => merged.push((value, slot)),
                }
            }
            LayerMemory {
                made,
                reads: merged,
            }
        })
        .collect();
    Recording {
        layers,
        fixed,
        peak,
        exact,
    }
}

/// The contribution of each layer of `varied`, memory and saved values aside.
fn contributions(
    graph: &Graph,
    layers: &Layers,
    varied: ModelId,
    policy: &Policy,
    partition: &Partition,
    work: &NodeWork,
) -> Vec<(usize, Contribution)> {
    let mut out: Vec<(usize, Contribution)> = layers
        .at
        .iter()
        .enumerate()
        .filter(|(_, at)| at.model == varied)
        .map(|(l, _)| {
            (
                l,
                Contribution {
                    allowed: true,
                    ..Contribution::default()
                },
            )
        })
        .collect();
    // A model's layers are consecutive in `layers.at`.
    let first = out.first().map_or(0, |&(l, _)| l);
    let count = out.len();
    let mine = |l: u32| {
        (l != NONE)
            .then(|| (l as usize).checked_sub(first))
            .flatten()
            .filter(|&k| k < count)
    };
    for w in &policy.findings.inplace_kept {
        if let Some(k) = mine(layers.of_node(w.node)) {
            out[k].1.allowed = false;
        }
    }
    for h in &partition.hazards {
        if let Some(k) = Some(layers.of_node(h.node)).and_then(mine) {
            out[k].1.allowed = false;
        }
    }
    let mut replayed: Vec<Vec<&[NodeId]>> = vec![Vec::new(); count];
    for r in &partition.replays {
        if let Some(k) = r.nodes.first().and_then(|&n| mine(layers.of_node(n))) {
            replayed[k].push(&r.nodes);
        }
    }
    for (k, replays) in replayed.into_iter().enumerate() {
        if !replays.is_empty() {
            // Each replay runs from a drained device, as a full plan times it.
            out[k].1.seconds = work.replays(replays).seconds;
            out[k].1.ticks = ticks(out[k].1.seconds);
        }
    }
    for s in &partition.saved {
        let counted = matches!(s.kind, SavedKind::Kept | SavedKind::WritesResident)
            && graph.storage_root(s.value) == s.value;
        let layer = graph.producer(s.value).map(|p| layers.of_node(p));
        if let (true, Some(k)) = (counted, layer.and_then(mine)) {
            let c = &mut out[k].1;
            c.kept_bytes = c.kept_bytes.saturating_add(graph.value(s.value).bytes);
        }
    }
    out
}

/// The saved values of a run, by the group whose option makes each resident: the layer of a
/// replay that reads it, and for a value backward reads (or, eagerly, a kept output) its
/// producer's layer. [`FIXED`] collects the rest.
fn saved_by_group(
    graph: &Graph,
    layers: &Layers,
    varied: ModelId,
    partition: &Partition,
    executor: Executor,
) -> Vec<(u32, Vec<Saved>)> {
    let mut kind: Vec<Option<SavedKind>> = vec![None; graph.values().len()];
    for s in &partition.saved {
        kind[s.value.index()] = Some(s.kind);
    }
    let mut by: Vec<(u32, Saved)> = Vec::new();
    for s in &partition.saved {
        let eager_kept = executor == Executor::Eager && s.kind == SavedKind::Kept;
        if layers.read_by_backward[s.value.index()] || eager_kept {
            let group = graph
                .producer(s.value)
                .map_or(FIXED, |p| layers.group(p, varied));
            by.push((group, s.clone()));
        }
    }
    for r in &partition.replays {
        let group = r.nodes.first().map_or(FIXED, |&n| layers.group(n, varied));
        for &n in &r.nodes {
            for &v in &graph.node(n).inputs {
                if let Some(kind) = kind[v.index()] {
                    by.push((group, Saved { value: v, kind }));
                }
            }
        }
    }
    by.sort_by_key(|(group, s)| (*group, s.value));
    by.dedup_by_key(|(group, s)| (*group, s.value));
    let mut grouped: Vec<(u32, Vec<Saved>)> = Vec::new();
    for (group, saved) in by {
        match grouped.last_mut() {
            Some((g, list)) if *g == group => list.push(saved),
            _ => grouped.push((group, vec![saved])),
        }
    }
    grouped
}

/// Everything incremental planning knows: per layer and option its contribution, and the
/// fixed part.
pub struct Model {
    /// `options[layer][option]`.
    pub options: Vec<Vec<Contribution>>,
    /// Storages no option changes; `fixed_of[value]` is the one `value` made.
    fixed: Vec<Life>,
    fixed_of: Vec<u32>,
    /// Per fixed storage: its index among those some option reads ([`NONE`] if none does).
    shared: Vec<u32>,
    shared_count: usize,
    /// Replays of layers no search chooses for, and saved values no option changes.
    fixed_replays: Vec<Replay>,
    fixed_saved: Vec<Saved>,
    fixed_ticks: Ticks,
    slots: usize,
    exact: bool,
}

impl Model {
    /// The model from the runs: the runs of each model come in option order from 0, the
    /// first run's fixed part stands for all. The runs are recorded in parallel, and the model
    /// is exact only if it composes each run's own simulated peak.
    pub fn new(graph: &Graph, layers: &Layers, runs: Vec<Run>, work: &NodeWork) -> Model {
        use rayon::prelude::*;
        let timeline = Timeline::new(graph, runs.iter().flat_map(|r| &r.replays));
        // What the executor holds in forward (the model's Python references) is the same in
        // every run: the first run's stands for all.
        let forward_holds: Vec<Hold> = runs.first().map_or_else(Vec::new, |run| {
            run.holds
                .iter()
                .filter(|h| matches!(h.until, Until::Forward(_)))
                .copied()
                .collect()
        });
        let executed = memory::Executed {
            holds: &forward_holds,
            resized: runs.first().map_or(&[], |run| &run.resized),
            extras: &[],
            markers_alias: runs.first().is_some_and(|run| run.markers_alias),
        };
        let forward = memory::forward(graph, recorder(graph, layers, &timeline), executed);
        let recordings: Vec<Recording> = runs
            .par_iter()
            .enumerate()
            .map(|(k, run)| record(graph, &forward, run, k == 0, &timeline))
            .collect();
        let mut options: Vec<Vec<Contribution>> = vec![Vec::new(); layers.at.len()];
        let mut exact = true;
        let mut peaks = Vec::with_capacity(runs.len());
        let mut runs = runs.into_iter().zip(recordings);
        let mut first = runs.next();
        let (fixed, fixed_saved, fixed_replays) = match &mut first {
            Some((run, recording)) => (
                std::mem::take(&mut recording.fixed),
                std::mem::take(&mut run.fixed_saved),
                run.replays
                    .iter()
                    .filter(|r| layers.at.binary_search(&r.layer).is_err())
                    .cloned()
                    .collect(),
            ),
            None => Default::default(),
        };
        for (run, recording) in first.into_iter().chain(runs) {
            exact &= recording.exact;
            peaks.push((run.varied, run.option, recording.peak));
            let mut memory: Vec<_> = recording.layers.into_iter().map(Some).collect();
            let mut replays: Vec<Vec<Replay>> = vec![Vec::new(); layers.at.len()];
            for r in run.replays {
                if let Ok(l) = layers.at.binary_search(&r.layer) {
                    replays[l].push(r);
                }
            }
            for (l, mut c) in run.contributions {
                exact &= options[l].len() == run.option;
                let LayerMemory { made, reads } = memory[l].take().unwrap_or_default();
                (c.made, c.reads, c.replay) = (made, reads, std::mem::take(&mut replays[l]));
                options[l].push(c);
            }
        }
        let mut model = Model::assemble(graph, options, fixed, fixed_replays, work);
        model.fixed_saved = fixed_saved;
        model.slots = timeline.len();
        model.exact &= exact;
        // Without a run there is no recorded fixed part to compose from (nothing to choose:
        // no checkpointed layer declares units): the figures come from full plans.
        model.exact &= !peaks.is_empty() && model.composes_runs(layers, &peaks);
        model
    }

    fn assemble(
        graph: &Graph,
        options: Vec<Vec<Contribution>>,
        fixed: Vec<(u32, Life)>,
        fixed_replays: Vec<Replay>,
        work: &NodeWork,
    ) -> Model {
        let mut fixed_of = vec![NONE; graph.values().len()];
        let mut lives = Vec::with_capacity(fixed.len());
        for (by, life) in fixed {
            if by != NONE {
                fixed_of[by as usize] = lives.len() as u32;
            }
            lives.push(life);
        }
        let mut exact = true;
        let mut shared = vec![NONE; lives.len()];
        let mut shared_count = 0;
        for &(v, _) in options.iter().flatten().flat_map(|c| &c.reads) {
            match fixed_of[v as usize] {
                NONE => exact = false,
                f if shared[f as usize] == NONE => {
                    shared[f as usize] = shared_count;
                    shared_count += 1;
                }
                _ => {}
            }
        }
        let total: u128 = lives
            .iter()
            .chain(options.iter().flatten().flat_map(|c| &c.made))
            .map(|l| u128::from(l.bytes))
            .sum();
        exact &= total <= i64::MAX as u128;
        let fixed_ticks = ticks(
            work.replays(fixed_replays.iter().map(|r| r.nodes.as_slice()))
                .seconds,
        );
        Model {
            options,
            fixed: lives,
            fixed_of,
            shared,
            shared_count: shared_count as usize,
            fixed_replays,
            fixed_saved: Vec::new(),
            fixed_ticks,
            slots: 0,
            exact,
        }
    }

    /// Whether the model composes the simulated peak of each model's first and last run
    /// (keeping nothing, keeping every unit).
    fn composes_runs(&self, layers: &Layers, peaks: &[(ModelId, usize, u64)]) -> bool {
        if !self.exact {
            return false;
        }
        let mut composer = Composer::new(self);
        let ends = peaks.iter().enumerate().filter(|&(k, &(model, _, _))| {
            let next = peaks.get(k + 1).map(|p| p.0);
            let previous = k.checked_sub(1).map(|j| peaks[j].0);
            next != Some(model) || previous != Some(model)
        });
        ends.map(|(_, p)| p).all(|&(varied, option, peak)| {
            let choice: Vec<u8> = layers
                .at
                .iter()
                .map(|at| if at.model == varied { option as u8 } else { 0 })
                .collect();
            composer.set(&choice);
            composer.peak() == peak
        })
    }

    /// Whether the composed figures are exact (else answers are checked with full plans).
    pub fn exact(&self) -> bool {
        self.exact
    }
}

/// Replay time in units of 10^-30 s: sums of these are exact, whatever the order.
pub type Ticks = u128;

/// `seconds` in [`Ticks`] (rounded; 0 for what is not a positive number).
pub fn ticks(seconds: f64) -> Ticks {
    (seconds * 1e30).round() as Ticks
}

/// Figures of a composed plan, summed in the order a full plan sums them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub peak_bytes: u64,
    pub replay_time_s: f64,
    pub saved_bytes: u64,
}

impl Model {
    /// Layers a search chooses options for.
    pub fn layers(&self) -> usize {
        self.options.len()
    }

    /// Replay time of `choice` in [`Ticks`], summed layer by layer: exact, so choices
    /// with the same layers' replays tie (the figures of a full plan, summed in its order,
    /// are [`Model::figures`]'s).
    pub fn time(&self, choice: &[u8]) -> Ticks {
        self.options
            .iter()
            .zip(choice)
            .fold(self.fixed_ticks, |acc, (o, &c)| {
                acc + o[usize::from(c)].ticks
            })
    }

    /// Whether every layer's option of `choice` is allowed.
    pub fn allowed(&self, choice: &[u8]) -> bool {
        self.options
            .iter()
            .zip(choice)
            .all(|(o, &c)| o[usize::from(c)].allowed)
    }

    /// The figures a full plan of `choice` reports: the replay time summed replay by replay
    /// in schedule order, and the saved activation bytes, each storage once.
    pub fn figures(&self, graph: &Graph, work: &NodeWork, choice: &[u8], peak: u64) -> Figures {
        let chosen = || {
            self.options
                .iter()
                .zip(choice)
                .map(|(o, &c)| &o[usize::from(c)])
        };
        let mut replays: Vec<&Replay> = self
            .fixed_replays
            .iter()
            .chain(chosen().flat_map(|c| &c.replay))
            .collect();
        replays.sort_by_key(|r| (r.position, r.layer));
        let seconds = work
            .replays(replays.iter().map(|r| r.nodes.as_slice()))
            .seconds;
        let saved = self
            .fixed_saved
            .iter()
            .chain(chosen().flat_map(|c| &c.saved));
        Figures {
            peak_bytes: peak,
            replay_time_s: seconds,
            saved_bytes: crate::plan::activation_bytes(graph, saved),
        }
    }
}

/// The live bytes of every slot under the current choice, in a max segment tree: a storage's
/// life is a range addition, and the peak is the root.
pub struct Composer<'m> {
    model: &'m Model,
    choice: Vec<u8>,
    tree: MaxTree,
    /// Per fixed storage some option reads (by [`Model::shared`]): the last slots of the
    /// current options' reads, sorted.
    readers: Vec<Vec<u32>>,
}

impl<'m> Composer<'m> {
    /// Every layer at option 0.
    pub fn new(model: &'m Model) -> Composer<'m> {
        let mut composer = Composer {
            model,
            choice: vec![0; model.options.len()],
            tree: MaxTree::default(),
            readers: vec![Vec::new(); model.shared_count],
        };
        composer.rebuild();
        composer
    }

    pub fn choice(&self) -> &[u8] {
        &self.choice
    }

    /// The simulated peak of the current choice.
    pub fn peak(&self) -> u64 {
        u64::try_from(self.tree.max()).unwrap_or(0)
    }

    /// Moves to `choice`: layer by layer when few layers change (at most 4, or an eighth),
    /// else from scratch.
    pub fn set(&mut self, choice: &[u8]) {
        let changed = self
            .choice
            .iter()
            .zip(choice)
            .filter(|(a, b)| a != b)
            .count();
        if changed > 4 && changed * 8 > choice.len() {
            self.choice.copy_from_slice(choice);
            self.rebuild();
        } else {
            for (l, &o) in choice.iter().enumerate() {
                self.apply(l, o);
            }
        }
    }

    /// The peak with `layer` at `option`, the current choice left as it is.
    pub fn try_option(&mut self, layer: usize, option: u8) -> u64 {
        let before = self.choice[layer];
        self.apply(layer, option);
        let peak = self.peak();
        self.apply(layer, before);
        peak
    }

    /// Puts `layer` at `option`.
    pub fn apply(&mut self, layer: usize, option: u8) {
        let from = self.choice[layer];
        if from == option {
            return;
        }
        let model: &'m Model = self.model;
        let options = &model.options[layer];
        let (old, new) = (&options[usize::from(from)], &options[usize::from(option)]);
        // Lives both options have cancel out; `made` is sorted.
        let (mut a, mut b) = (old.made.iter().peekable(), new.made.iter().peekable());
        loop {
            let (life, sign) = match (a.peek(), b.peek()) {
                (None, None) => break,
                (Some(x), Some(y)) if x == y => {
                    a.next();
                    b.next();
                    continue;
                }
                (Some(x), Some(y)) if x < y => (a.next(), -1),
                (Some(_), None) => (a.next(), -1),
                (_, Some(_)) => (b.next(), 1),
            };
            if let Some(life) = life {
                self.tree
                    .add(life.alloc, life.last, sign * life.bytes as i64);
            }
        }
        let (mut a, mut b) = (old.reads.iter().peekable(), new.reads.iter().peekable());
        loop {
            let (value, removed, added) = match (a.peek(), b.peek()) {
                (None, None) => break,
                (Some(&&(va, sa)), Some(&&(vb, sb))) if va == vb => {
                    a.next();
                    b.next();
                    (va, Some(sa), Some(sb))
                }
                (Some(&&(va, sa)), Some(&&(vb, _))) if va < vb => {
                    a.next();
                    (va, Some(sa), None)
                }
                (Some(&&(va, sa)), None) => {
                    a.next();
                    (va, Some(sa), None)
                }
                (_, Some(&&(vb, sb))) => {
                    b.next();
                    (vb, None, Some(sb))
                }
            };
            if removed != added {
                self.move_read(value, removed, added);
            }
        }
        self.choice[layer] = option;
    }

    /// One fixed storage's read by the changing layer moves from `removed` to `added`.
    fn move_read(&mut self, value: u32, removed: Option<u32>, added: Option<u32>) {
        let f = self.model.fixed_of[value as usize] as usize;
        let life = self.model.fixed[f];
        let readers = &mut self.readers[self.model.shared[f] as usize];
        let last = |r: &Vec<u32>| r.last().map_or(life.last, |&s| s.max(life.last));
        let before = last(readers);
        if let Some(slot) = removed {
            if let Ok(k) = readers.binary_search(&slot) {
                readers.remove(k);
            }
        }
        if let Some(slot) = added {
            let k = readers.partition_point(|&s| s < slot);
            readers.insert(k, slot);
        }
        let after = last(readers);
        let bytes = life.bytes as i64;
        match after.cmp(&before) {
            std::cmp::Ordering::Greater => self.tree.add(before + 1, after, bytes),
            std::cmp::Ordering::Less => self.tree.add(after + 1, before, -bytes),
            std::cmp::Ordering::Equal => {}
        }
    }

    /// Recomputes every slot's live bytes for the current choice.
    fn rebuild(&mut self) {
        let model = self.model;
        for r in &mut self.readers {
            r.clear();
        }
        let chosen: Vec<&Contribution> = model
            .options
            .iter()
            .zip(&self.choice)
            .map(|(o, &c)| &o[usize::from(c)])
            .collect();
        for c in &chosen {
            for &(value, slot) in &c.reads {
                let f = model.fixed_of[value as usize] as usize;
                self.readers[model.shared[f] as usize].push(slot);
            }
        }
        for r in &mut self.readers {
            r.sort_unstable();
        }
        let readers = &self.readers;
        self.tree.rebuild(model.slots + 1, |delta| {
            let mut live = |life: &Life, last: u32| {
                delta[life.alloc as usize] += life.bytes as i64;
                delta[last as usize + 1] -= life.bytes as i64;
            };
            for (f, life) in model.fixed.iter().enumerate() {
                let read = match model.shared[f] {
                    NONE => None,
                    s => readers[s as usize].last().copied(),
                };
                live(life, read.map_or(life.last, |r| r.max(life.last)));
            }
            for life in chosen.iter().flat_map(|c| &c.made) {
                live(life, life.last);
            }
        });
    }
}

/// Range addition and the maximum over all leaves.
#[derive(Default)]
struct MaxTree {
    /// Leaves, rounded up to a power of two.
    size: usize,
    /// Per node: the maximum of its subtree, its own additions included.
    max: Vec<i64>,
    /// Per inner node: what was added to its whole range.
    add: Vec<i64>,
}

impl MaxTree {
    /// Sets `leaves` leaves (reusing the memory): `deltas` writes each leaf's difference from
    /// the one before, and the leaves become their running sums.
    fn rebuild(&mut self, leaves: usize, deltas: impl FnOnce(&mut [i64])) {
        let size = leaves.next_power_of_two().max(1);
        if size != self.size {
            *self = MaxTree {
                size,
                max: vec![0; 2 * size],
                add: vec![0; size],
            };
        } else {
            self.max.fill(0);
            self.add.fill(0);
        }
        let leaf = &mut self.max[size..];
        deltas(&mut leaf[..leaves]);
        let mut running = 0i64;
        for v in leaf.iter_mut() {
            running += *v;
            *v = running;
        }
        for x in (1..size).rev() {
            self.max[x] = self.max[2 * x].max(self.max[2 * x + 1]);
        }
    }

    fn max(&self) -> i64 {
        self.max.get(1).copied().unwrap_or(0)
    }

    /// Adds `v` to leaves `lo..=hi`, bottom-up: the nodes covering the range take `v`, then
    /// the maxima above both ends are recomputed.
    fn add(&mut self, lo: u32, hi: u32, v: i64) {
        if v == 0 || lo > hi {
            return;
        }
        let (left, right) = (lo as usize + self.size, hi as usize + self.size);
        let (mut a, mut b) = (left, right + 1);
        while a < b {
            if a & 1 == 1 {
                self.take(a, v);
                a += 1;
            }
            if b & 1 == 1 {
                b -= 1;
                self.take(b, v);
            }
            a >>= 1;
            b >>= 1;
        }
        self.pull(left);
        self.pull(right);
    }

    fn take(&mut self, x: usize, v: i64) {
        self.max[x] += v;
        if x < self.size {
            self.add[x] += v;
        }
    }

    /// Recomputes the maxima of the ancestors of node `x`.
    fn pull(&mut self, mut x: usize) {
        x >>= 1;
        while x >= 1 {
            self.max[x] = self.max[2 * x].max(self.max[2 * x + 1]) + self.add[x];
            x >>= 1;
        }
    }
}
