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

use std::collections::{BTreeMap, HashSet};

use ir::{
    plan::{Decision, LayerRef, SavedKind},
    EntityId, Graph, NodeId, Phase, ValueId,
};

use super::{Builder, Hazard, HazardKind, Partition, Replay, Saved, Source};
use crate::policy::Policy;

/// The eager executor's partition of a joint graph under `policy`.
pub(super) fn partition(graph: &Graph, policy: &Policy) -> Partition {
    let order = graph.backward_order().to_vec();
    let layers = checkpointed_layers(graph, policy);
    let replays = replays(graph, policy, &layers, &order);
    let mut in_replay = vec![false; graph.nodes().len()];
    for r in &replays {
        for &n in &r.nodes {
            in_replay[n.index()] = true;
        }
    }
    let saved = resident(graph, policy, &layers, &replays, &in_replay, &order);
    let hazards = replays.iter().flat_map(|r| hazards(graph, r)).collect();
    Partition {
        order,
        saved,
        replays,
        hazards,
    }
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

/// Per layer whose outputs backward reads: the recomputed prefix and where it runs.
fn replays(
    graph: &Graph,
    policy: &Policy,
    layers: &BTreeMap<LayerRef, Vec<NodeId>>,
    order: &[NodeId],
) -> Vec<Replay> {
    let mut layer_of: Vec<Option<LayerRef>> = vec![None; graph.nodes().len()];
    for (&at, nodes) in layers {
        for &n in nodes {
            layer_of[n.index()] = Some(at);
        }
    }
    // Per layer: the first backward position reading anything its checkpoint saved, and its
    // last node whose output backward reads. A value the next layer reads is that layer's
    // checkpoint input, saved by the next checkpoint: reading it recomputes nothing here.
    let builder = Builder::new(graph, policy);
    let mut first_read: BTreeMap<LayerRef, usize> = BTreeMap::new();
    let mut last_needed: BTreeMap<LayerRef, NodeId> = BTreeMap::new();
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
            first_read.entry(at).or_insert(position);
            let last = last_needed.entry(at).or_insert(producer);
            *last = (*last).max(producer);
        }
    }
    let mut replays: Vec<Replay> = last_needed
        .into_iter()
        .map(|(at, last)| {
            let nodes = layers[&at]
                .iter()
                .copied()
                .take_while(|&n| n <= last)
                .filter(|&n| policy.decision(n) == Some(Decision::Recompute))
                .collect();
            let position = first_read[&at];
            Replay {
                layer: at,
                nodes,
                before: order[position],
                position,
            }
        })
        .filter(|r: &Replay| !r.nodes.is_empty())
        .collect();
    replays.sort_by_key(|r| (r.position, r.layer));
    replays
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
