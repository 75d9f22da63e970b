//! The partition an eager executor really runs: `torch.utils.checkpoint` (non-reentrant) with a
//! selective-checkpoint policy that saves the plan's kept ops.
//!
//! In forward, the policy caches the whole output tuple of every kept op; the checkpoint keeps
//! the layer's inputs; everything else is freed. In backward, the first read of any tensor the
//! layer's ops saved for backward starts a recompute of the layer's forward, in order: kept ops
//! return their cached outputs, every other op re-runs (whether backward needs its output or
//! not: a `topk` feeding a kept copy, an all-to-all), and the recompute stops after the last op
//! whose output backward reads. So a layer's replay is the prefix of its forward up to that op,
//! less the kept ops, run just before the first backward read of anything the layer made.
//! What torch holds beyond the reads of ops becomes the partition's holds ([`holds`],
//! [`autograd_holds`]), and so does what the model's Python code keeps referenced, in forward
//! and in the recompute ([`python_holds`], [`recompute_python_holds`]; docs/cost-and-memory.md,
//! "Eager checkpointing"). On a graph traced on the CPU, eager dropout's mask is a float noise
//! tensor ([`resized`]) and a checkpoint of a layer with random ops stashes the CPU generator
//! state ([`rng_stashes`]).

use std::collections::{BTreeMap, HashSet};

use ir::{
    plan::{Decision, LayerRef, Reason, SavedKind},
    EntityId, Graph, NodeId, Phase, ValueId,
};

use super::{
    Builder, Extra, Hazard, HazardKind, Hold, HoldKind, Partition, Replay, Resized, Saved, Source,
    Until,
};
use crate::policy::{traced_on_host, Policy, EAGER_HOST_UNCACHED_RANDOM};

/// The eager executor's partition of a joint graph under `policy`.
pub(super) fn partition(graph: &Graph, policy: &Policy) -> Partition {
    let order = graph.backward_order().to_vec();
    let layers = checkpointed_layers(graph, policy);
    let layer_of = layer_of(graph, &layers);
    let recomputes = recomputes(graph, policy, &layer_of, &order);
    let replays = replays(policy, &layers, &recomputes, &order);
    let mut holds = holds(graph, policy, &layers, &recomputes, &order);
    holds.extend(autograd_holds(graph, &order));
    holds.extend(python_holds(graph));
    holds.extend(recompute_python_holds(
        graph,
        &layer_of,
        &recomputes,
        &replays,
    ));
    let mut in_replay = vec![false; graph.nodes().len()];
    for r in &replays {
        for &n in &r.nodes {
            in_replay[n.index()] = true;
        }
    }
    let saved = resident(graph, policy, &layers, &replays, &in_replay, &order);
    let hazards = replays.iter().flat_map(|r| hazards(graph, r)).collect();
    let extras = if traced_on_host(graph) {
        rng_stashes(policy, &layers, &recomputes, &replays, order.len())
    } else {
        Vec::new()
    };
    Partition {
        order,
        saved,
        replays,
        hazards,
        holds,
        resized: resized(graph),
        extras,
        markers_alias: true,
    }
}

/// The bytes of the CPU generator's state, as `torch.get_rng_state()` returns it (a uint8
/// tensor on the CPU allocator; python/tests/test_eager_dropout.py checks the figure against
/// torch).
pub(crate) const CPU_GENERATOR_STATE_BYTES: u64 = 5056;

/// What eager PyTorch stores in other bytes than a graph traced on the CPU says: CPU dropout
/// ([`EAGER_HOST_UNCACHED_RANDOM`]) draws its mask into a noise tensor of the input's dtype
/// (`bernoulli_` into `empty_like(input)`, scaled in place) and multiplies the input by it, so
/// autograd saves that noise where the trace's `native_dropout` returns a bool mask. A graph
/// traced for another device runs the fused `native_dropout` in eager too: nothing differs.
pub(super) fn resized(graph: &Graph) -> Vec<Resized> {
    if !traced_on_host(graph) {
        return Vec::new();
    }
    graph
        .nodes()
        .values()
        .filter(|n| n.draws_random() && EAGER_HOST_UNCACHED_RANDOM.contains(&n.packet()))
        .filter_map(|n| {
            let (&input, &mask) = (n.inputs.first()?, n.outputs.get(1)?);
            let (input, mask) = (graph.value(input), graph.value(mask));
            let elements = mask.bytes / mask.dtype.size_bytes().max(1);
            Some(Resized {
                value: n.outputs[1],
                bytes: elements * input.dtype.size_bytes(),
            })
        })
        .collect()
}

/// The CPU generator state torch's checkpoint stashes for a layer with random ops (the
/// selective checkpoint asks for `preserve_rng_state` only there, `recompute_planner.sac`):
/// one copy taken before the layer's first op and kept by the checkpoint's frame until the
/// layer's last backward read frees it (the end of the step for a layer never recomputed), and
/// one more while the recompute runs (`torch.random.fork_rng` saves the state it restores
/// after). Host memory: on a graph traced for a GPU the stash is not device memory (the GPU
/// generator's state is returned as a CPU tensor too), so only a graph traced on the CPU
/// counts it.
fn rng_stashes(
    policy: &Policy,
    layers: &BTreeMap<LayerRef, Vec<NodeId>>,
    recomputes: &BTreeMap<LayerRef, Recompute>,
    replays: &[Replay],
    steps: usize,
) -> Vec<Extra> {
    let random = |n: NodeId| {
        policy.nodes[n].is_some_and(|p| matches!(p.reason, Reason::Random | Reason::RandomReplayed))
    };
    let mut stashes = Vec::new();
    for (at, nodes) in layers {
        let Some(&first) = nodes.first().filter(|_| nodes.iter().any(|&n| random(n))) else {
            continue;
        };
        let freed = recomputes
            .get(at)
            .map_or(steps.saturating_sub(1), |r| r.last_read);
        stashes.push(Extra {
            bytes: CPU_GENERATOR_STATE_BYTES,
            from: Until::Forward(first),
            until: Until::Backward(freed),
        });
        let replay = replays.iter().find(|r| r.layer == *at);
        if let Some((&start, &end)) = replay.and_then(|r| Some((r.nodes.first()?, r.nodes.last()?)))
        {
            stashes.push(Extra {
                bytes: CPU_GENERATOR_STATE_BYTES,
                from: Until::Replay(start),
                until: Until::Replay(end),
            });
        }
    }
    stashes
}

/// Where the replayed prefix `replay` would not reproduce forward: a replayed op that writes a
/// tensor that is not the replay's own copy (it is resident, and already holds the write), or
/// that reads one after forward wrote it later.
///
/// The replay's own copy of a value is one it produced, over a storage it made. An alias made
/// outside the replay (by an op of no layer or of another layer) stays the resident forward
/// tensor even when the replay makes its storage's root again, as the verifier and the runtime
/// resolve it.
fn hazards(graph: &Graph, replay: &Replay) -> Vec<Hazard> {
    let mut produced = HashSet::new();
    let mut made_here = HashSet::new();
    let mut found = Vec::new();
    for &id in &replay.nodes {
        let node = graph.node(id);
        // The resident tensor behind `v`: its storage's root unless the replay made that
        // root again, in which case `v` itself (an alias of the forward storage).
        let resident = |v: ValueId| {
            let root = graph.storage_root(v);
            if !made_here.contains(&root) {
                Some(root)
            } else if produced.contains(&v) {
                None
            } else {
                Some(v)
            }
        };
        for &p in &node.effects.mutates {
            if let Some(value) = resident(node.inputs[p]) {
                found.push(Hazard {
                    layer: replay.layer,
                    node: id,
                    value,
                    kind: HazardKind::WritesResident,
                });
            }
        }
        if node.effects.view_of.is_none() {
            for &v in &node.inputs {
                let Some(value) = resident(v) else { continue };
                let later = graph
                    .storage_writers(v)
                    .iter()
                    .copied()
                    .find(|&w| w > id && graph.node(w).phase == Phase::Forward);
                if let Some(writer) = later {
                    found.push(Hazard {
                        layer: replay.layer,
                        node: id,
                        value,
                        kind: HazardKind::ReadsOverwritten { writer },
                    });
                }
            }
        }
        // A fresh output is made here; a view or in-place result keeps its base's storage.
        for &v in &node.outputs {
            produced.insert(v);
            if graph.storage_root(v) == v {
                made_here.insert(v);
            }
        }
    }
    found
}

/// The forward nodes of each checkpointed layer (kept or recomputed), in execution order.
fn checkpointed_layers(graph: &Graph, policy: &Policy) -> BTreeMap<LayerRef, Vec<NodeId>> {
    let mut layers: BTreeMap<LayerRef, Vec<NodeId>> = BTreeMap::new();
    for (id, node) in graph.nodes().iter() {
        let checkpointed = matches!(
            policy.decision(id),
            Some(Decision::Save | Decision::Recompute)
        );
        if let (true, Some(layer)) = (checkpointed && node.phase == Phase::Forward, node.layer) {
            let at = LayerRef {
                model: node.model,
                layer,
            };
            layers.entry(at).or_default().push(id);
        }
    }
    layers
}

/// When torch runs one checkpointed layer's recompute and releases its frame, from what
/// backward reads of the values the layer made (a value the next layer reads is that layer's
/// checkpoint input, saved by the next checkpoint: reading it recomputes nothing here).
#[derive(Debug, Clone, Copy)]
struct Recompute {
    /// The first backward position reading anything the layer saved: the recompute runs
    /// just before it.
    first_read: usize,
    /// The last backward position reading anything the layer saved: after it, no saved
    /// tensor of the layer is left and the frame (its inputs, what the cache still holds)
    /// is freed.
    last_read: usize,
    /// The layer's last node whose output backward reads: the recompute stops after it.
    last_needed: NodeId,
}

fn recomputes(
    graph: &Graph,
    policy: &Policy,
    layer_of: &[Option<LayerRef>],
    order: &[NodeId],
) -> BTreeMap<LayerRef, Recompute> {
    let builder = Builder::new(graph, policy);
    let mut found: BTreeMap<LayerRef, Recompute> = BTreeMap::new();
    for (position, &id) in order.iter().enumerate() {
        for &v in &graph.node(id).inputs {
            let Some(producer) = graph.producer(v) else {
                continue;
            };
            let Some(at) = layer_of[producer.index()] else {
                continue;
            };
            if builder.leaves_its_layer(v, producer) {
                continue;
            }
            let r = found.entry(at).or_insert(Recompute {
                first_read: position,
                last_read: position,
                last_needed: producer,
            });
            r.last_read = position;
            r.last_needed = r.last_needed.max(producer);
        }
    }
    found
}

/// Per checkpointed node: its layer.
fn layer_of(graph: &Graph, layers: &BTreeMap<LayerRef, Vec<NodeId>>) -> Vec<Option<LayerRef>> {
    let mut layer_of: Vec<Option<LayerRef>> = vec![None; graph.nodes().len()];
    for (&at, nodes) in layers {
        for &n in nodes {
            layer_of[n.index()] = Some(at);
        }
    }
    layer_of
}

/// Per layer whose outputs backward reads: the recomputed prefix (the layer's forward up to
/// its last needed node, less the kept ops) and where it runs.
fn replays(
    policy: &Policy,
    layers: &BTreeMap<LayerRef, Vec<NodeId>>,
    recomputes: &BTreeMap<LayerRef, Recompute>,
    order: &[NodeId],
) -> Vec<Replay> {
    let mut replays: Vec<Replay> = recomputes
        .iter()
        .map(|(&at, r)| Replay {
            layer: at,
            nodes: prefix(&layers[&at], r)
                .filter(|&n| policy.decision(n) == Some(Decision::Recompute))
                .collect(),
            before: order[r.first_read],
            position: r.first_read,
        })
        .filter(|r: &Replay| !r.nodes.is_empty())
        .collect();
    replays.sort_by_key(|r| (r.position, r.layer));
    replays
}

/// The nodes of a layer its recompute runs (kept ones served from the cache), in order.
fn prefix<'a>(nodes: &'a [NodeId], r: &Recompute) -> impl Iterator<Item = NodeId> + 'a {
    let last = r.last_needed;
    nodes.iter().copied().take_while(move |&n| n <= last)
}

/// What torch's checkpoint holds beyond what ops read (docs/cost-and-memory.md):
///
/// - the policy's cache holds every output of a kept op from forward until the recompute
///   reaches that op (the entry is consumed: from then on the tensor lives as long as
///   something reads it), or, for a kept op after the recompute stops, until the recompute
///   returns: the cache belongs to the policy's context managers (`recompute_planner.sac`),
///   not to the checkpoint's frame, and the recompute's is the last to let it go
///   ([`HoldKind::Cache`]); where the recompute reaches the op it takes the outputs back
///   ([`HoldKind::CacheServe`]: the reload of an offloaded one);
/// - the checkpoint holds the layer's inputs until its frame is freed after the layer's last
///   backward read ([`HoldKind::Frame`]).
///
/// A layer backward never reads is never recomputed: its cache and frame live to the end of
/// the step.
fn holds(
    graph: &Graph,
    policy: &Policy,
    layers: &BTreeMap<LayerRef, Vec<NodeId>>,
    recomputes: &BTreeMap<LayerRef, Recompute>,
    order: &[NodeId],
) -> Vec<Hold> {
    let end = order.len().saturating_sub(1);
    let mut holds = Vec::new();
    for (at, nodes) in layers {
        let recompute = recomputes.get(at);
        let frame_freed = Until::Backward(recompute.map_or(end, |r| r.last_read));
        let mut hold =
            |value: ValueId, until: Until, kind: HoldKind| holds.push(Hold { value, until, kind });
        // Kept ops the recompute reaches release their cache entry when it does: just after
        // the replayed node before them (the first one if none is), else at the recompute.
        let mut consumed_at = recompute.map(|r| {
            let first = prefix(nodes, r).find(|&n| policy.decision(n) == Some(Decision::Recompute));
            first.map_or(Until::Backward(r.first_read), Until::Replay)
        });
        // The cache is dropped as the recompute returns: after its last replayed node (at the
        // recompute if it replays nothing).
        let recompute_returns = recompute.map_or(frame_freed, |r| {
            let last =
                prefix(nodes, r).filter(|&n| policy.decision(n) == Some(Decision::Recompute));
            last.last()
                .map_or(Until::Backward(r.first_read), Until::Replay)
        });
        let reached = |n: NodeId| recompute.is_some_and(|r| n <= r.last_needed);
        for &n in nodes {
            let node = graph.node(n);
            match policy.decision(n) {
                Some(Decision::Recompute) if reached(n) => consumed_at = Some(Until::Replay(n)),
                Some(Decision::Save) => {
                    let until = match consumed_at {
                        Some(until) if reached(n) => until,
                        _ => recompute_returns,
                    };
                    let served = recompute
                        .filter(|_| reached(n))
                        .map(|r| served_at(policy, nodes, r, n, until));
                    for &v in &node.outputs {
                        hold(v, until, HoldKind::Cache);
                        if let Some(served) = served {
                            hold(v, served, HoldKind::CacheServe);
                        }
                    }
                }
                _ => {}
            }
            for &v in &node.inputs {
                let inside = graph.producer(v).is_some_and(|p| {
                    let p = graph.node(p);
                    (p.model, p.layer) == (at.model, Some(at.layer))
                });
                if !inside {
                    hold(v, frame_freed, HoldKind::Frame);
                }
            }
        }
    }
    holds
}

/// Where the recompute `r` takes the kept op `kept`'s outputs from the cache, as the step
/// they must be on the device again by: the first replayed node after `kept` (the recompute
/// reaches the kept op just before it), else `consumed`, where its cache entry is let go.
/// Each kept output comes back when the recompute gets to it, not all at its start.
fn served_at(
    policy: &Policy,
    nodes: &[NodeId],
    r: &Recompute,
    kept: NodeId,
    consumed: Until,
) -> Until {
    prefix(nodes, r)
        .find(|&m| m > kept && policy.decision(m) == Some(Decision::Recompute))
        .map_or(consumed, Until::Replay)
}

/// What the model's Python code keeps referenced in forward past the last forward read (a
/// function's locals live until it returns): each value is held through the forward node after
/// which the export saw Python release it ([`ir::Node::python_releases`]). Graphs exported
/// without that observation hold nothing here.
pub(super) fn python_holds(graph: &Graph) -> Vec<Hold> {
    graph
        .nodes()
        .iter()
        .filter(|(_, node)| node.phase == Phase::Forward)
        .flat_map(|(id, node)| {
            node.python_releases().iter().map(move |&value| Hold {
                value,
                until: Until::Forward(id),
                kind: HoldKind::Device,
            })
        })
        .collect()
}

/// The same Python references in a layer's recompute, which re-runs the layer's Python code:
/// a value the recompute makes (or serves from the cache) is held through the last replayed
/// node up to its release, or up to the recompute's last node when the release comes later
/// (the recompute stops there by raising, or returns: either frees the frame's locals).
fn recompute_python_holds(
    graph: &Graph,
    layer_of: &[Option<LayerRef>],
    recomputes: &BTreeMap<LayerRef, Recompute>,
    replays: &[Replay],
) -> Vec<Hold> {
    let replay_of: BTreeMap<LayerRef, &Replay> = replays.iter().map(|r| (r.layer, r)).collect();
    let mut holds = Vec::new();
    for (id, node) in graph.nodes().iter() {
        // Only forward nodes list releases (the graph's validation checks it).
        for &value in node.python_releases() {
            let Some(producer) = graph.producer(value) else {
                continue;
            };
            let Some(at) = layer_of[producer.index()] else {
                continue;
            };
            let (Some(recompute), Some(replay)) = (recomputes.get(&at), replay_of.get(&at)) else {
                continue;
            };
            if producer > recompute.last_needed {
                continue; // the recompute stops before making it
            }
            let end = id.min(recompute.last_needed);
            // The last node the recompute runs (not served from the cache) by then.
            let last_run = replay.nodes[..replay.nodes.partition_point(|&n| n <= end)].last();
            if let Some(&last_run) = last_run.filter(|&&n| n >= producer) {
                holds.push(Hold {
                    value,
                    until: Until::Replay(last_run),
                    kind: HoldKind::Device,
                });
            }
        }
    }
    holds
}

/// Inputs eager autograd saves that the traced backward never reads (it needs only their
/// shape, which the trace made static): (op, saved input, an input the same node saves that
/// backward does read, which tells when the node runs), inputs counted among the node's
/// tensor inputs (`dim` is an attribute).
const EAGER_ONLY_SAVES: &[(&str, usize, usize)] = &[
    // `index_add(self, dim, index, source)` saves `source` for `expand_as(source)`.
    ("aten.index_add", 2, 1),
    // `gather(self, dim, index)` saves `self` for `gather_backward(grad, self, ...)`.
    ("aten.gather", 0, 1),
];

/// Temporaries of a backward formula that eager computes in one C++ expression, so they live
/// until the expression's result exists, where the traced backward frees each after its last
/// read: (op making the temporary, its one consumer, the op making the result from that
/// consumer's output). `pow_backward` is `grad * (exponent * self.pow(exponent - 1))`:
/// `self.pow(exponent - 1)` lives until the product with `grad` is made (a ReLU² MLP's
/// intermediate-size tensor, or a norm's square), and so does `self`, which the node holds
/// until it returns.
const FORMULA_TEMPORARIES: &[(&str, &str, &str)] = &[(
    "aten.pow.Tensor_Scalar",
    "aten.mul.Scalar",
    "aten.mul.Tensor",
)];

/// What eager autograd holds beyond the traced backward's reads, checkpointed or not:
///
/// - a node releases its saved tensors only after it has computed all its outputs
///   (`MulBackward0` holds both factors until both gradients exist); the joint graph lists a
///   node's backward ops one after another but not where the node ends, so a forward tensor
///   backward reads is held through the backward op after its last read;
/// - inputs saved only for their shape ([`EAGER_ONLY_SAVES`]) are held until their node runs;
/// - a formula's temporaries ([`FORMULA_TEMPORARIES`]) are held until its result is made.
pub(super) fn autograd_holds(graph: &Graph, order: &[NodeId]) -> Vec<Hold> {
    let mut last: BTreeMap<ValueId, usize> = BTreeMap::new();
    for (position, &id) in order.iter().enumerate() {
        for &v in &graph.node(id).inputs {
            let forward = graph
                .producer(v)
                .is_some_and(|p| graph.node(p).phase == Phase::Forward);
            if forward {
                last.insert(v, position);
            }
        }
    }
    let end = order.len().saturating_sub(1);
    let after = |position: usize| Until::Backward((position + 1).min(end));
    let mut holds: Vec<Hold> = last
        .iter()
        .map(|(&value, &position)| Hold {
            value,
            until: after(position),
            kind: HoldKind::Device,
        })
        .collect();
    for (_, node) in graph.nodes().iter() {
        let packet = node.packet();
        let packet = packet.strip_suffix('_').unwrap_or(packet);
        for &(op, saved, with) in EAGER_ONLY_SAVES {
            let (Some(&value), Some(partner)) = (node.inputs.get(saved), node.inputs.get(with))
            else {
                continue;
            };
            if let (true, Some(&position)) = (packet == op, last.get(partner)) {
                holds.push(Hold {
                    value,
                    until: after(position),
                    kind: HoldKind::Device,
                });
            }
        }
    }
    holds.extend(formula_temporary_holds(graph, order));
    holds
}

/// Each [`FORMULA_TEMPORARIES`] temporary in backward and the inputs it is made from, held
/// until the op making the formula's result (the first such reader of its consumer's output).
fn formula_temporary_holds(graph: &Graph, order: &[NodeId]) -> Vec<Hold> {
    let position: BTreeMap<NodeId, usize> =
        order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let only_output = |n: NodeId, op: &str| {
        let node = graph.node(n);
        match node.outputs.as_slice() {
            [v] if node.op.as_str() == op => Some(*v),
            _ => None,
        }
    };
    let mut holds = Vec::new();
    for &(temporary_op, consumer_op, result_op) in FORMULA_TEMPORARIES {
        for &id in order {
            let Some(temporary) = only_output(id, temporary_op) else {
                continue;
            };
            let [consumer] = graph.consumers(temporary) else {
                continue;
            };
            let Some(partial) = only_output(*consumer, consumer_op) else {
                continue;
            };
            let result = graph
                .consumers(partial)
                .iter()
                .filter(|&&n| graph.node(n).op.as_str() == result_op)
                .filter_map(|n| position.get(n))
                .min();
            // The node's saved input lives as long as the node, to its result too.
            let saved = graph.node(id).inputs.iter().copied();
            if let Some(&at) = result {
                holds.extend(std::iter::once(temporary).chain(saved).map(|value| Hold {
                    value,
                    until: Until::Backward(at),
                    kind: HoldKind::Device,
                }));
            }
        }
    }
    holds
}

/// What stays resident: every value backward or a replay reads that no replay makes, and the
/// whole output tuple of every kept op (the policy caches them in forward; a recompute that
/// stops before one never releases it).
fn resident(
    graph: &Graph,
    policy: &Policy,
    layers: &BTreeMap<LayerRef, Vec<NodeId>>,
    replays: &[Replay],
    in_replay: &[bool],
    order: &[NodeId],
) -> Vec<Saved> {
    let builder = Builder::new(graph, policy);
    let mut kind: BTreeMap<ValueId, SavedKind> = BTreeMap::new();
    let mut note = |v: ValueId| {
        if kind.contains_key(&v) {
            return;
        }
        // Resident whatever replays: a layer's input (the checkpoint keeps it), a kept
        // output, what no checkpoint covers, parameters and inputs.
        if let Source::Saved(
            k @ (SavedKind::LayerInput
            | SavedKind::Kept
            | SavedKind::NotCheckpointed
            | SavedKind::Parameter
            | SavedKind::GraphInput),
        ) = builder.classify(v)
        {
            kind.insert(v, k);
            return;
        }
        let producer = graph.producer(v);
        let made_by_replay = producer.is_some_and(|p| in_replay[p.index()]);
        if !made_by_replay && producer.is_some_and(|p| graph.node(p).phase == Phase::Forward) {
            // A recomputed value outside every replayed prefix that something reads after
            // forward: it must have left its layer (the next layer's input).
            kind.insert(v, SavedKind::LayerInput);
        }
    };
    for &id in order {
        for &v in &graph.node(id).inputs {
            note(v);
        }
    }
    for r in replays {
        for &id in &r.nodes {
            for &v in &graph.node(id).inputs {
                note(v);
            }
        }
    }
    for &n in layers.values().flatten() {
        if policy.decision(n) == Some(Decision::Save) {
            for &v in &graph.node(n).outputs {
                kind.insert(v, SavedKind::Kept);
            }
        }
    }
    kind.into_iter()
        .map(|(value, kind)| Saved { value, kind })
        .collect()
}
