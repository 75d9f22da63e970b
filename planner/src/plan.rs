//! `planner plan`: config -> policy -> partition -> diagnostics, assembled into the typed
//! [`Plan`] every output format renders.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use ir::{
    plan::{
        Config, Cost, Decision, Executor, GraphRef, Keep, LayerKeep, LayerOffload, LayerRef,
        Memory, NodeDecision, Plan, Replay, SavedValue, UnitLayer, UnitSummary, PLANNER_VERSION,
    },
    EntityId, Graph, NodeId, Phase, Role, UnitId,
};
use rayon::prelude::*;
use thiserror::Error;

use crate::{
    config::{self, Choices, ConfigError, PlanConfig, Resolved},
    cost::{self, HwProfile, NodeWork},
    diagnostics,
    memory::{self, OffloadRequest, OffloadWindow, Simulation},
    offload,
    partition::{self, Partition, PartitionError},
    policy::{self, Policy, UnitKey},
    state::State,
};

#[derive(Debug, Error)]
pub enum PlanError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("internal error, please report it: the partition is not closed: {0}")]
    Partition(#[from] PartitionError),
}

/// Plans `graph` under `config`, with costs estimated for `hw`.
pub fn plan(graph: &Graph, config: &PlanConfig, hw: &HwProfile) -> Result<Plan, PlanError> {
    let resolved = config::resolve(graph, config)?;
    plan_resolved(graph, config, resolved, hw)
}

/// Plans `graph` under `config` with per-layer `choices` over it (what a `--choices` file
/// states: the units each listed layer keeps and offloads; other layers follow `config`).
pub fn plan_with_choices(
    graph: &Graph,
    config: &PlanConfig,
    choices: Choices,
    hw: &HwProfile,
) -> Result<Plan, PlanError> {
    let resolved = config::resolve(graph, config)?.with_choices(graph, choices)?;
    plan_resolved(graph, config, resolved, hw)
}

/// Plans with an already resolved configuration (per-layer unit choices included).
pub fn plan_resolved(
    graph: &Graph,
    config: &PlanConfig,
    resolved: Resolved,
    hw: &HwProfile,
) -> Result<Plan, PlanError> {
    let joint = partition::is_joint(graph);
    // This plan and the baselines are independent.
    let (mine, baselines) = rayon::join(
        || analyse(graph, config, &resolved, joint),
        || joint.then(|| Baselines::of(graph, config.executor)),
    );
    let mine = mine?;
    let baselines = baselines.transpose()?;
    Ok(finish(
        graph,
        config,
        &resolved,
        mine,
        baselines.as_ref(),
        hw,
    ))
}

/// [`plan_resolved`] for a joint graph whose baselines are already known: what a search that
/// plans one graph under many configurations calls.
pub fn plan_against(
    graph: &Graph,
    config: &PlanConfig,
    resolved: Resolved,
    hw: &HwProfile,
    baselines: &Baselines,
) -> Result<Plan, PlanError> {
    let mine = analyse(graph, config, &resolved, partition::is_joint(graph))?;
    Ok(finish(graph, config, &resolved, mine, Some(baselines), hw))
}

/// The policy and, for a joint graph, the checked partition, its memory simulation and what
/// it offloads.
struct Analysis {
    policy: Policy,
    joint: Option<(Partition, Simulation, Offloaded)>,
}

/// The storages a plan offloads: those selected, and where each leaves the device and comes
/// back (a window per selected root, in the same order).
struct Offloaded {
    selection: offload::Selection,
    windows: Vec<OffloadWindow>,
}

fn analyse(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    joint: bool,
) -> Result<Analysis, PlanError> {
    let policy = policy::apply(graph, config, resolved);
    if !joint {
        return Ok(Analysis {
            policy,
            joint: None,
        });
    }
    let partition = checked_partition(graph, &policy, config.executor)?;
    let selection = offload::select(graph, config, resolved, &policy, &partition);
    let (memory, windows) = memory::simulate_offloaded(
        graph,
        &partition.order,
        &partition.replays,
        partition.executed(),
        config.training.fsdp,
        OffloadRequest {
            values: &selection.roots,
            prefetch: config.offload.prefetch as usize,
            copied_at_save: offload::copied_at_save(config.executor),
        },
    );
    Ok(Analysis {
        policy,
        joint: Some((partition, memory, Offloaded { selection, windows })),
    })
}

/// The plan from the analysis and, for a joint graph, the baselines.
fn finish(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    analysis: Analysis,
    baselines: Option<&Baselines>,
    hw: &HwProfile,
) -> Plan {
    let Analysis { policy, joint } = analysis;
    let joint = joint
        .zip(baselines)
        .map(|((partition, memory, offloaded), baselines)| Joint {
            partition,
            memory,
            offloaded,
            baselines,
        });
    let mut diagnostics = diagnostics::diagnose(
        graph,
        config,
        resolved,
        &policy,
        joint.as_ref().map(|j| &j.partition),
    );
    if let Some(j) = &joint {
        let worse = diagnostics::eager_costs_memory(
            graph,
            &j.partition,
            j.memory.peak_bytes,
            j.baselines.no_checkpoint.peak_bytes,
        );
        diagnostics.extend(worse);
        diagnostics.extend(diagnostics::offload(
            graph,
            &policy,
            &j.offloaded.selection.refused,
            &j.offloaded.windows,
            j.memory.host.peak_bytes,
            hw,
        ));
        diagnostics.sort();
    }
    let work = NodeWork::of(graph, hw, config.executor, |n| {
        resolved.is_checkpointed(n.model, n.layer)
    });
    let partition = joint.as_ref().map(|j| &j.partition);
    let saved = joint
        .as_ref()
        .map_or_else(Vec::new, |j| saved_values(graph, j));
    Plan {
        planner_version: PLANNER_VERSION.to_owned(),
        graph: GraphRef {
            name: graph.name().to_owned(),
            fingerprint: graph.fingerprint().to_owned(),
        },
        config: Config {
            keep: config.keep.clone(),
            recompute_ratio: config.recompute_ratio,
            collectives: config.collectives,
            random_ops: config.random_ops,
            executor: config.executor,
            budget_bytes: None,
            layer_keep: layer_choices(&resolved.layer_units),
            training: config.training,
            offload: config.offload.clone(),
            layer_offload: layer_offload_choices(resolved),
        },
        joint: partition.is_some(),
        nodes: node_decisions(graph, &policy, &saved),
        saved,
        replay: partition.map_or_else(Vec::new, |p| replays(p, &work)),
        units: unit_summaries(graph, &policy, joint.as_ref(), &work),
        memory: memory_figures(graph, config, joint.as_ref(), hw),
        cost: cost_figures(joint.as_ref(), graph, hw, &work),
        diagnostics,
    }
}

/// The partition of a joint graph, its memory simulation and offload, beside the baselines.
struct Joint<'b> {
    partition: Partition,
    memory: Simulation,
    offloaded: Offloaded,
    baselines: &'b Baselines,
}

impl Joint<'_> {
    /// The storage roots the plan moves to the host, sorted.
    fn moved_roots(&self) -> Vec<ir::ValueId> {
        let mut roots: Vec<ir::ValueId> = self
            .offloaded
            .windows
            .iter()
            .filter(|w| w.moved)
            .map(|w| w.value)
            .collect();
        roots.sort_unstable();
        roots
    }
}

/// The two memory baselines, the same whatever the configuration: no checkpointing, and
/// whole-layer recompute of every layer.
pub struct Baselines {
    no_checkpoint: Simulation,
    full_recompute: Partition,
    full_recompute_memory: Simulation,
}

impl Baselines {
    /// Both baselines of a joint graph for `executor`, in parallel.
    pub fn of(graph: &Graph, executor: Executor) -> Result<Baselines, PlanError> {
        let (whole_layer, no_checkpoint) = rayon::join(
            || -> Result<_, PlanError> {
                let config = PlanConfig {
                    keep: Keep::Nothing,
                    executor,
                    ..PlanConfig::default()
                };
                let resolved = config::resolve(graph, &config)?;
                let policy = policy::apply(graph, &config, &resolved);
                let partition = checked_partition(graph, &policy, executor)?;
                let memory = memory::simulate_executed(
                    graph,
                    &partition.order,
                    &partition.replays,
                    partition.executed(),
                );
                Ok((partition, memory))
            },
            || {
                let holds = partition::no_checkpoint_holds(graph, executor);
                let resized = partition::resized(graph, executor);
                let executed = memory::Executed {
                    holds: &holds,
                    resized: &resized,
                    extras: &[],
                    markers_alias: partition::markers_alias(executor),
                };
                memory::simulate_executed(graph, graph.backward_order(), &[], executed)
            },
        );
        let (full_recompute, full_recompute_memory) = whole_layer?;
        Ok(Baselines {
            no_checkpoint,
            full_recompute,
            full_recompute_memory,
        })
    }
}

fn checked_partition(
    graph: &Graph,
    policy: &Policy,
    executor: Executor,
) -> Result<Partition, PlanError> {
    let partition = partition::partition(graph, policy, executor);
    // An eager recompute with hazards does not reproduce forward: the plan reports them as
    // errors; the verifier proves the other partitions faithful.
    if partition.hazards.is_empty() {
        partition::verify(graph, policy, &partition)?;
    }
    Ok(partition)
}

fn memory_figures(
    graph: &Graph,
    config: &PlanConfig,
    joint: Option<&Joint>,
    hw: &HwProfile,
) -> Memory {
    let parameter_bytes = graph
        .values()
        .values()
        .filter(|v| v.role == Role::Parameter)
        .fold(0u64, |acc, v| acc.saturating_add(v.bytes));
    let Some(j) = joint else {
        return Memory {
            parameter_bytes,
            ..Memory::default()
        };
    };
    let saved = saved_activation_bytes(graph, &j.partition);
    Memory {
        peak_bytes: Some(j.memory.peak_bytes),
        saved_bytes: saved,
        no_checkpoint_peak_bytes: Some(j.baselines.no_checkpoint.peak_bytes),
        full_recompute_peak_bytes: Some(j.baselines.full_recompute_memory.peak_bytes),
        peak: j.memory.peak,
        parameter_bytes,
        gradient_bytes: j.memory.gradient_bytes,
        device: Some(State::of(graph, &config.training).total(&j.memory, hw.memory_bytes as u64)),
        offloaded_bytes: j.memory.host.offloaded_bytes,
        host_peak_bytes: j.memory.host.peak_bytes,
        host_memory_bytes: hw.host_memory_bytes as u64,
        saved_on_device_bytes: saved.saturating_sub(j.memory.host.left_in_forward_bytes),
    }
}

fn cost_figures(joint: Option<&Joint>, graph: &Graph, hw: &HwProfile, work: &NodeWork) -> Cost {
    let (replay, baseline, replay_host_syncs) = match joint {
        Some(j) => (
            replay_work(work, &j.partition),
            replay_work(work, &j.baselines.full_recompute),
            replayed(&j.partition)
                .filter(|&id| cost::is_host_sync(graph.node(id)))
                .count() as u64,
        ),
        None => Default::default(),
    };
    let forward = work.pass(graph, Phase::Forward);
    let backward = work.pass(graph, Phase::Backward);
    let transfer = joint.map_or_else(offload::Transfer::default, |j| {
        offload::transfer(
            &j.offloaded.windows,
            &memory::schedule_nodes(graph, &j.partition.order, &j.partition.replays),
            memory::forward_step_count(graph),
            work,
            hw,
        )
    });
    Cost {
        replay_flops: replay.flops,
        replay_bytes: replay.bytes,
        replay_comm_bytes: replay.comm_bytes,
        replay_time_s: replay.seconds,
        full_recompute_replay_time_s: baseline.seconds,
        forward_time_s: forward.seconds,
        backward_time_s: backward.seconds,
        step_time_s: forward.seconds + replay.seconds + backward.seconds + transfer.exposed_s,
        replay_host_syncs,
        transfer_time_s: transfer.total_s,
        exposed_transfer_time_s: transfer.exposed_s,
        hw: hw.name.clone(),
    }
}

/// The partition's replays, each run in turn, in schedule order (the order the budget
/// search's composed figures add them in: the same sum to the last bit).
fn replay_work(work: &NodeWork, partition: &Partition) -> cost::Work {
    let mut replays: Vec<_> = partition.replays.iter().collect();
    replays.sort_by_key(|r| (r.position, r.layer));
    work.replays(replays.into_iter().map(|r| r.nodes.as_slice()))
}

/// Every node the partition replays.
fn replayed(partition: &Partition) -> impl Iterator<Item = NodeId> + '_ {
    partition
        .replays
        .iter()
        .flat_map(|r| r.nodes.iter().copied())
}

/// Bytes of the activation storages the saved values hold, each storage once: a saved view
/// of a weight or of the labels holds no activation, and two saved views of one tensor hold
/// it once.
fn saved_activation_bytes(graph: &Graph, partition: &Partition) -> u64 {
    activation_bytes(graph, &partition.saved)
}

/// [`saved_activation_bytes`] of any saved values (repeats count once).
pub(crate) fn activation_bytes<'s>(
    graph: &Graph,
    saved: impl IntoIterator<Item = &'s partition::Saved>,
) -> u64 {
    let mut roots: Vec<ir::ValueId> = saved
        .into_iter()
        .filter(|s| s.kind.is_activation())
        .map(|s| graph.storage_root(s.value))
        .filter(|&root| graph.producer(root).is_some())
        .collect();
    roots.sort_unstable();
    roots.dedup();
    roots.into_iter().fold(0u64, |acc, root| {
        acc.saturating_add(graph.value(root).bytes)
    })
}

/// One decision per forward node, in node order; a node is offloaded when one of its outputs
/// in the saved set is.
fn node_decisions(graph: &Graph, policy: &Policy, saved: &[SavedValue]) -> Vec<NodeDecision> {
    let offloaded: HashSet<NodeId> = saved
        .iter()
        .filter(|s| s.offloaded)
        .filter_map(|s| graph.producer(s.value))
        .collect();
    policy
        .nodes
        .iter()
        .filter_map(|(id, p)| {
            let p = (*p)?;
            let node = graph.node(id);
            Some(NodeDecision {
                node: id,
                model: node.model,
                layer: node.layer,
                decision: p.decision,
                reason: p.reason,
                unit: p.unit.filter(|_| p.decision == Decision::Save),
                offloaded: offloaded.contains(&id),
            })
        })
        .collect()
}

fn saved_values(graph: &Graph, joint: &Joint) -> Vec<SavedValue> {
    let moved = joint.moved_roots();
    joint
        .partition
        .saved
        .iter()
        .map(|s| {
            let producer = graph.producer(s.value).map(|p| graph.node(p));
            let root = graph.storage_root(s.value);
            SavedValue {
                offloaded: moved.binary_search(&root).is_ok(),
                value: s.value,
                alias_of: (root != s.value).then_some(root),
                bytes: graph.value(s.value).bytes,
                model: producer.map(|p| p.model),
                layer: producer.and_then(|p| p.layer),
                kind: s.kind,
            }
        })
        .collect()
}

fn replays(partition: &Partition, work: &NodeWork) -> Vec<Replay> {
    partition
        .replays
        .par_iter()
        .map(|r| Replay {
            at: r.layer,
            nodes: r.nodes.clone(),
            before: r.before,
            seconds: work.sum(r.nodes.iter().copied()).seconds,
        })
        .collect()
}

/// Per-layer kept units as the plan's configuration states them.
fn layer_choices(choices: &BTreeMap<LayerRef, Vec<UnitId>>) -> Vec<LayerKeep> {
    choices
        .iter()
        .map(|(&at, units)| LayerKeep {
            at,
            units: units.clone(),
        })
        .collect()
}

/// Per-layer offload choices as the plan's configuration states them: each layer with
/// offloaded units or offloaded layer inputs by a per-layer choice (a layer listed for its
/// inputs alone states the units `--offload` moves there, so that the choices read back
/// the same).
fn layer_offload_choices(resolved: &Resolved) -> Vec<LayerOffload> {
    let mut layers: BTreeSet<LayerRef> = resolved.layer_offload.keys().copied().collect();
    layers.extend(resolved.layer_offload_inputs.iter().copied());
    layers
        .into_iter()
        .map(|at| LayerOffload {
            at,
            units: resolved.offloaded_at(at).to_vec(),
            layer_input: resolved.offloads_input_of(at),
        })
        .collect()
}

/// Per kept unit: ops kept and bytes of their outputs that backward needs, per layer, and the
/// replay time whole-layer recompute would spend on those ops.
fn unit_summaries(
    graph: &Graph,
    policy: &Policy,
    joint: Option<&Joint>,
    work: &NodeWork,
) -> Vec<UnitSummary> {
    let mut saved = vec![false; graph.values().len()];
    for s in joint
        .map(|j| j.partition.saved.as_slice())
        .unwrap_or_default()
    {
        saved[s.value.index()] = true;
    }
    let mut replayed_by_baseline = vec![false; graph.nodes().len()];
    for r in joint
        .map(|j| j.baselines.full_recompute.replays.as_slice())
        .unwrap_or_default()
    {
        for &n in &r.nodes {
            replayed_by_baseline[n.index()] = true;
        }
    }
    let mut avoided: BTreeMap<UnitKey, f64> = BTreeMap::new();
    let mut per: BTreeMap<UnitKey, BTreeMap<u32, UnitLayer>> = BTreeMap::new();
    for (id, node) in graph.nodes().iter() {
        let Some(p) = policy.nodes[id].filter(|p| p.decision == Decision::Save) else {
            continue;
        };
        let Some(unit) = p.unit else { continue };
        let key = UnitKey {
            model: node.model,
            unit,
        };
        if replayed_by_baseline[id.index()] {
            *avoided.entry(key).or_default() += work.node(id).seconds;
        }
        let layer = node.layer.unwrap_or_default();
        let figures = per
            .entry(key)
            .or_default()
            .entry(layer)
            .or_insert(UnitLayer {
                layer,
                kept_ops: 0,
                saved_bytes: 0,
            });
        figures.kept_ops += 1;
        figures.saved_bytes = figures
            .saved_bytes
            .saturating_add(saved_bytes_of(graph, id, &saved));
    }
    per.into_iter()
        .map(|(key, layers)| {
            let layers: Vec<UnitLayer> = layers.into_values().collect();
            UnitSummary {
                model: key.model,
                unit: key.unit,
                replay_time_avoided_s: avoided.get(&key).copied().unwrap_or(0.0),
                kept_ops: layers.iter().map(|l| l.kept_ops).sum(),
                saved_bytes: layers
                    .iter()
                    .fold(0u64, |acc, l| acc.saturating_add(l.saved_bytes)),
                layers,
            }
        })
        .collect()
}

fn saved_bytes_of(graph: &Graph, node: NodeId, saved: &[bool]) -> u64 {
    graph
        .node(node)
        .outputs
        .iter()
        .filter(|&&v| saved[v.index()])
        .fold(0u64, |acc, &v| acc.saturating_add(graph.value(v).bytes))
}
