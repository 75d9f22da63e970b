//! Offload (docs/cost-and-memory.md, M5): saved values the executor copies to host memory
//! after their last forward read and brings back before backward reads them, instead of
//! keeping them on the device.
//!
//! [`select`] picks the storages `--offload` (what a kept unit saves) and `--offload-kinds`
//! (saved kinds) ask for and refuses those the device must keep: a storage another saved
//! value views without being offloaded, and a storage written in place. The memory
//! simulation ([`crate::memory::simulate_offloaded`]) decides where each one leaves the device
//! and comes back; [`transfer`] times the copies.

use ir::{
    plan::{Decision, Executor, LayerRef, SavedKind},
    EntityId, Graph, ModelId, NodeId, UnitId, ValueId,
};

use crate::{
    config::{PlanConfig, Resolved},
    cost::{HwProfile, NodeWork},
    memory::OffloadWindow,
    partition::Partition,
    policy::Policy,
};

/// Whether `executor` copies an offloaded storage to the host when it is first saved, so the
/// device may let go of it after its last forward read: eager checkpointing does (SAC's cache
/// copies a kept output as forward makes it, `recompute_planner.sac.offloading()` a layer input
/// at its first save); the graph executor copies it beside the step after that read.
pub fn copied_at_save(executor: Executor) -> bool {
    executor == Executor::Eager
}

/// The storages to offload, and those asked for that must stay on the device.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Storage roots to move, in value order.
    pub roots: Vec<ValueId>,
    pub refused: Vec<Refused>,
}

/// A storage asked for that stays on the device, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub root: ValueId,
    pub why: Refusal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `view`, a saved value sharing the storage, is not offloaded: the storage stays on the
    /// device for it.
    AliasedOnDevice { view: ValueId },
    /// `writer` writes the storage in place: it holds more than one version of the tensor,
    /// and a host copy of one of them is not what every read of the storage expects.
    WrittenInPlace { writer: NodeId },
}

/// The storages `config` asks to offload among the partition's saved values: those of kept
/// ops whose unit `--offload` names, and those of the kinds `--offload-kinds` names
/// (activations only: parameters and graph inputs are resident anyway).
pub fn select(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    policy: &Policy,
    partition: &Partition,
) -> Selection {
    if config.offload.kinds.is_empty() && !resolved.offloads_per_unit_or_layer() {
        return Selection::default();
    }
    let asked = |value: ValueId, kind: SavedKind| {
        kind.is_activation()
            && (config.offload.kinds.contains(&kind)
                || kept_by_offloaded_unit(graph, resolved, policy, value)
                || (kind == SavedKind::LayerInput
                    && input_of_offloaded_layer(graph, resolved, value)))
    };
    let mut roots: Vec<(ValueId, bool)> = partition
        .saved
        .iter()
        .map(|s| (graph.storage_root(s.value), asked(s.value, s.kind)))
        .collect();
    roots.sort_unstable();
    let mut selection = Selection::default();
    for group in roots.chunk_by(|a, b| a.0 == b.0) {
        let root = group[0].0;
        if !group.iter().any(|&(_, asked)| asked) || graph.producer(root).is_none() {
            continue;
        }
        match refusal(graph, partition, root, &asked) {
            Some(why) => selection.refused.push(Refused { root, why }),
            None => selection.roots.push(root),
        }
    }
    selection
}

/// Whether `value` is the output of an op kept by a unit offloaded in its layer (`--offload`,
/// or a per-layer choice).
fn kept_by_offloaded_unit(
    graph: &Graph,
    resolved: &Resolved,
    policy: &Policy,
    value: ValueId,
) -> bool {
    let Some(producer) = graph.producer(value) else {
        return false;
    };
    let node = graph.node(producer);
    let offloaded = match node.layer {
        Some(layer) => resolved.offloaded_at(LayerRef {
            model: node.model,
            layer,
        }),
        None => &resolved.offload_units[node.model],
    };
    policy.nodes[producer]
        .filter(|p| p.decision == Decision::Save)
        .and_then(|p| p.unit)
        .is_some_and(|unit| offloaded.contains(&unit))
}

/// Whether `value`, a layer input, was made in a layer whose inputs a per-layer choice moves.
fn input_of_offloaded_layer(graph: &Graph, resolved: &Resolved, value: ValueId) -> bool {
    graph.producer(value).is_some_and(|p| {
        let node = graph.node(p);
        node.layer.is_some_and(|layer| {
            resolved.offloads_input_of(LayerRef {
                model: node.model,
                layer,
            })
        })
    })
}

/// Why the storage of `root` must stay on the device, if it must.
fn refusal(
    graph: &Graph,
    partition: &Partition,
    root: ValueId,
    asked: &impl Fn(ValueId, SavedKind) -> bool,
) -> Option<Refusal> {
    if let Some(&writer) = graph.storage_writers(root).first() {
        return Some(Refusal::WrittenInPlace { writer });
    }
    partition
        .saved
        .iter()
        .find(|s| graph.storage_root(s.value) == root && !asked(s.value, s.kind))
        .map(|s| Refusal::AliasedOnDevice { view: s.value })
}

/// The model and kept unit a value belongs to: its producer's.
pub fn owner(graph: &Graph, policy: &Policy, value: ValueId) -> (ModelId, Option<UnitId>) {
    graph
        .producer(value)
        .map_or((ModelId::from_index(0), None), |p| {
            let unit = policy.nodes[p]
                .filter(|n| n.decision == Decision::Save)
                .and_then(|n| n.unit);
            (graph.node(p).model, unit)
        })
}

/// Seconds one copy of `bytes` between device and host takes: the host link's bandwidth and
/// the fixed cost of launching a copy (`op_overhead_s`). The copy is asynchronous: no host
/// synchronisation is paid.
pub fn copy_seconds(hw: &HwProfile, bytes: u64) -> f64 {
    bytes as f64 / hw.host_bytes_per_s + hw.op_overhead_s
}

/// Whether moving `bytes` over the host link takes less time than the copy's fixed cost:
/// the copy then costs more for what it launches than for what it moves.
pub fn too_small(hw: &HwProfile, bytes: u64) -> bool {
    (bytes as f64) / hw.host_bytes_per_s < hw.op_overhead_s
}

/// The time of the offload copies and reloads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Transfer {
    /// Every copy to the host and back.
    pub total_s: f64,
    /// The part compute does not hide, which the step waits for.
    pub exposed_s: f64,
}

/// Times the copies of the moved windows. `schedule` names each step's node
/// ([`crate::memory::schedule_nodes`]) and `forward_steps` how many of them are forward's. Each
/// moved storage is copied to the host once, and back once if it is reloaded (a storage nothing
/// reads after it leaves, eager SAC's cache holding its host copy, never is). On an
/// asynchronous profile each copy runs on a side stream beside compute: the copy to the host is
/// hidden by the forward steps after its last forward read, the reload by the steps of its
/// prefetch window; what they do not hide is exposed. Elsewhere every copy is exposed in full.
pub fn transfer(
    windows: &[OffloadWindow],
    schedule: &[NodeId],
    forward_steps: usize,
    work: &NodeWork,
    hw: &HwProfile,
) -> Transfer {
    let moved: Vec<&OffloadWindow> = windows.iter().filter(|w| w.moved).collect();
    if moved.is_empty() {
        return Transfer::default();
    }
    let elapsed = elapsed_before(schedule, work);
    let between = |from: usize, to: usize| elapsed[to.min(schedule.len())] - elapsed[from.min(to)];
    moved.iter().fold(Transfer::default(), |acc, w| {
        let copy = copy_seconds(hw, w.bytes);
        // The compute beside each copy: to the host, then back where it is reloaded.
        let to_host = between(w.last_forward_read + 1, forward_steps);
        let back = w
            .reload_at
            .zip(w.first_backward_read)
            .map(|(reload_at, first)| between(reload_at, first));
        let copies = if back.is_some() { 2.0 } else { 1.0 };
        let exposed = if hw.asynchronous {
            (copy - to_host).max(0.0) + back.map_or(0.0, |hidden| (copy - hidden).max(0.0))
        } else {
            copies * copy
        };
        Transfer {
            total_s: acc.total_s + copies * copy,
            exposed_s: acc.exposed_s + exposed,
        }
    })
}

/// The compute seconds before each step of `schedule` (one more entry than steps): each
/// step's op timed alone.
fn elapsed_before(schedule: &[NodeId], work: &NodeWork) -> Vec<f64> {
    let mut elapsed = Vec::with_capacity(schedule.len() + 1);
    elapsed.push(0.0);
    let mut total = 0.0;
    for &node in schedule {
        total += work.node(node).seconds;
        elapsed.push(total);
    }
    elapsed
}
