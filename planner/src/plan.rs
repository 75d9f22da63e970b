//! `planner plan`: config -> policy -> partition -> diagnostics, assembled into a [`Plan`], the
//! document every output format renders (JSON keys are SPEC §8's and stable).

use std::collections::BTreeMap;

use ir::{Graph, Name, NodeId};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{
    config::{self, Collectives, ConfigError, Keep, PlanConfig, Resolved},
    cost::{ForwardWork, HwProfile},
    diagnostics::{self, Diagnostic, Level},
    memory::{self, Simulation},
    partition::{self, Partition, PartitionError},
    policy::{self, Decision, NodePolicy, Policy},
};

pub const PLANNER_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub planner_version: String,
    pub graph: GraphRef,
    pub config: ConfigDoc,
    /// False for a forward-only graph, which gets decisions and diagnostics but no partition.
    pub joint: bool,
    pub nodes: Vec<NodeDoc>,
    pub saved: Vec<SavedDoc>,
    pub replay: Vec<ReplayDoc>,
    pub units: Vec<UnitDoc>,
    pub memory: MemoryDoc,
    pub cost: CostDoc,
    pub diagnostics: Vec<DiagnosticDoc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphRef {
    pub name: String,
    pub fingerprint: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigDoc {
    pub keep: Vec<String>,
    pub recompute_ratio: f64,
    pub collectives: String,
    /// `--budget` in bytes, when the units were chosen per layer to fit it.
    pub budget_bytes: Option<u64>,
    /// Per-layer unit choices (the budget solver's); empty when `keep` applies everywhere.
    pub layer_keep: Vec<LayerKeepDoc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerKeepDoc {
    pub model: String,
    pub layer: u32,
    pub keep: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
/// One per forward node, so its strings are [`Name`]s: inline, no allocation each.
pub struct NodeDoc {
    pub name: Name,
    pub op: Name,
    pub model: Name,
    pub layer: Option<u32>,
    pub decision: Name,
    pub reason: Name,
    pub unit: Option<Name>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedDoc {
    pub value: Name,
    pub bytes: u64,
    pub layer: Option<u32>,
    pub kind: String,
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayDoc {
    pub model: String,
    pub layer: u32,
    pub nodes: Vec<Name>,
    pub before: String,
    /// Estimated seconds of this replay.
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnitDoc {
    pub model: String,
    pub unit: String,
    pub kept_ops: u64,
    pub saved_bytes: u64,
    /// Estimated replay time whole-layer recompute would spend on the ops this unit keeps.
    pub replay_time_avoided_s: f64,
    pub layers: Vec<UnitLayerDoc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitLayerDoc {
    pub layer: u32,
    pub kept_ops: u64,
    pub saved_bytes: u64,
}

/// Peaks need a joint graph; they are `null` for a forward-only one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDoc {
    /// Peak live bytes of the step under this plan (parameters excluded, see below).
    pub peak_bytes: Option<u64>,
    /// Activation bytes saved for backward (parameters and graph inputs excluded).
    pub saved_bytes: u64,
    pub no_checkpoint_peak_bytes: Option<u64>,
    pub full_recompute_peak_bytes: Option<u64>,
    /// Where the plan's peak is: `forward`, `replay` or `backward`, and the node running.
    pub peak_stage: Option<String>,
    pub peak_node: Option<String>,
    /// Resident for the whole step, not part of the peaks.
    pub parameter_bytes: u64,
    /// Gradients the step outputs (part of the peaks when the peak is at the end).
    pub gradient_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostDoc {
    pub replay_flops: u64,
    pub replay_bytes: u64,
    pub replay_comm_bytes: u64,
    pub replay_time_s: f64,
    /// Replay time of whole-layer recompute, for comparison.
    pub full_recompute_replay_time_s: f64,
    /// The hardware profile the times assume.
    pub hw: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiagnosticDoc {
    pub level: String,
    pub code: String,
    pub model: String,
    pub unit: Option<String>,
    pub message: String,
    pub hint: String,
}

#[derive(Debug, Error)]
pub enum PlanError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("internal error, please report it: the partition is not closed: {0}")]
    Partition(#[from] PartitionError),
}

/// A plan used with a graph it was not made for (R11).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the plan was made for graph `{plan_graph}` ({plan_fingerprint}), not for `{graph}` ({fingerprint}): re-plan this graph")]
pub struct GraphMismatch {
    pub plan_graph: String,
    pub plan_fingerprint: String,
    pub graph: String,
    pub fingerprint: String,
}

impl Plan {
    /// R11: a plan applies only to the graph whose fingerprint it carries; consumers (the
    /// runtime, the torch integrations) call this before using it.
    pub fn check_graph(&self, graph: &Graph) -> Result<(), GraphMismatch> {
        if self.graph.fingerprint == graph.fingerprint() {
            return Ok(());
        }
        Err(GraphMismatch {
            plan_graph: self.graph.name.clone(),
            plan_fingerprint: self.graph.fingerprint.clone(),
            graph: graph.name().to_owned(),
            fingerprint: graph.fingerprint().to_owned(),
        })
    }

    pub fn has_errors(&self) -> bool {
        self.diagnostics
            .iter()
            .any(|d| d.level == Level::Error.name())
    }

    pub fn has_warnings(&self) -> bool {
        self.diagnostics
            .iter()
            .any(|d| d.level == Level::Warning.name())
    }
}

/// Plans `graph` under `config` (SPEC §4), with costs estimated for `hw` (SPEC §5).
pub fn plan(graph: &Graph, config: &PlanConfig, hw: &HwProfile) -> Result<Plan, PlanError> {
    let resolved = config::resolve(graph, config)?;
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
        || joint.then(|| Baselines::of(graph)),
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

/// The policy and, for a joint graph, the checked partition and its memory simulation.
fn analyse(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    joint: bool,
) -> Result<(Policy, Option<(Partition, Simulation)>), PlanError> {
    let policy = policy::apply(graph, config, resolved);
    if !joint {
        return Ok((policy, None));
    }
    let partition = checked_partition(graph, &policy)?;
    let memory = memory::simulate(graph, &partition.order, &partition.replays);
    Ok((policy, Some((partition, memory))))
}

/// The plan document from the analysis and, for a joint graph, the baselines.
fn finish(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    (policy, analysed): (Policy, Option<(Partition, Simulation)>),
    baselines: Option<&Baselines>,
    hw: &HwProfile,
) -> Plan {
    let joint = analysed
        .zip(baselines)
        .map(|((partition, memory), baselines)| Joint {
            partition,
            memory,
            baselines,
        });
    let diagnostics = diagnostics::diagnose(
        graph,
        config,
        resolved,
        &policy.findings,
        joint.as_ref().map(|j| &j.partition),
    );
    assemble(
        graph,
        config,
        resolved,
        &policy,
        joint.as_ref(),
        hw,
        diagnostics,
    )
}

/// The partition of a joint graph and its memory simulation, beside the baselines.
struct Joint<'b> {
    partition: Partition,
    memory: Simulation,
    baselines: &'b Baselines,
}

/// The two baselines of M1, the same whatever the configuration: no checkpointing, and
/// whole-layer recompute of every layer.
pub struct Baselines {
    no_checkpoint: Simulation,
    full_recompute: Partition,
    full_recompute_memory: Simulation,
}

impl Baselines {
    /// Both baselines of a joint graph, in parallel.
    pub fn of(graph: &Graph) -> Result<Baselines, PlanError> {
        let (whole_layer, no_checkpoint) = rayon::join(
            || -> Result<_, PlanError> {
                let config = PlanConfig {
                    keep: Keep::Nothing,
                    recompute_ratio: 1.0,
                    collectives: Collectives::Recompute,
                };
                let resolved = config::resolve(graph, &config)?;
                let policy = policy::apply(graph, &config, &resolved);
                let partition = checked_partition(graph, &policy)?;
                let memory = memory::simulate(graph, &partition.order, &partition.replays);
                Ok((partition, memory))
            },
            || memory::simulate(graph, graph.backward_order(), &[]),
        );
        let (full_recompute, full_recompute_memory) = whole_layer?;
        Ok(Baselines {
            no_checkpoint,
            full_recompute,
            full_recompute_memory,
        })
    }
}

fn checked_partition(graph: &Graph, policy: &Policy) -> Result<Partition, PlanError> {
    let partition = partition::partition(graph, policy);
    partition::verify(graph, policy, &partition)?;
    Ok(partition)
}

fn assemble(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    policy: &Policy,
    joint: Option<&Joint>,
    hw: &HwProfile,
    diagnostics: Vec<Diagnostic>,
) -> Plan {
    let partition = joint.map(|j| &j.partition);
    let saved = partition.map_or_else(Vec::new, |p| saved_docs(graph, p));
    let work = ForwardWork::of(graph, hw);
    Plan {
        planner_version: PLANNER_VERSION.to_owned(),
        graph: GraphRef {
            name: graph.name().to_owned(),
            fingerprint: graph.fingerprint().to_owned(),
        },
        config: ConfigDoc {
            keep: config.keep.names(),
            recompute_ratio: config.recompute_ratio,
            collectives: config.collectives.to_string(),
            budget_bytes: None,
            layer_keep: layer_keep_docs(graph, resolved),
        },
        joint: partition.is_some(),
        nodes: node_docs(graph, policy),
        replay: partition.map_or_else(Vec::new, |p| replay_docs(graph, p, &work)),
        units: unit_docs(graph, policy, joint, &work),
        memory: memory_doc(graph, joint),
        cost: cost_doc(joint, hw, &work),
        saved,
        diagnostics: diagnostics.into_iter().map(diagnostic_doc).collect(),
    }
}

fn memory_doc(graph: &Graph, joint: Option<&Joint>) -> MemoryDoc {
    let parameter_bytes = graph
        .values()
        .values()
        .filter(|v| v.role == ir::Role::Parameter)
        .fold(0u64, |acc, v| acc.saturating_add(v.bytes));
    let Some(j) = joint else {
        return MemoryDoc {
            peak_bytes: None,
            saved_bytes: 0,
            no_checkpoint_peak_bytes: None,
            full_recompute_peak_bytes: None,
            peak_stage: None,
            peak_node: None,
            parameter_bytes,
            gradient_bytes: 0,
        };
    };
    MemoryDoc {
        peak_bytes: Some(j.memory.peak_bytes),
        saved_bytes: saved_activation_bytes(graph, &j.partition),
        no_checkpoint_peak_bytes: Some(j.baselines.no_checkpoint.peak_bytes),
        full_recompute_peak_bytes: Some(j.baselines.full_recompute_memory.peak_bytes),
        peak_stage: j.memory.peak_at.map(|(stage, _)| stage.name().to_owned()),
        peak_node: j
            .memory
            .peak_at
            .map(|(_, n)| graph.node(n).name.to_string()),
        parameter_bytes,
        gradient_bytes: j.memory.gradient_bytes,
    }
}

fn cost_doc(joint: Option<&Joint>, hw: &HwProfile, work: &ForwardWork) -> CostDoc {
    let (replay, baseline) = match joint {
        Some(j) => (
            work.sum(replayed(&j.partition)),
            work.sum(replayed(&j.baselines.full_recompute)),
        ),
        None => Default::default(),
    };
    CostDoc {
        replay_flops: replay.flops,
        replay_bytes: replay.bytes,
        replay_comm_bytes: replay.comm_bytes,
        replay_time_s: replay.seconds,
        full_recompute_replay_time_s: baseline.seconds,
        hw: hw.name.clone(),
    }
}

/// Every node the partition replays.
fn replayed(partition: &Partition) -> impl Iterator<Item = NodeId> + '_ {
    partition
        .replays
        .iter()
        .flat_map(|r| r.nodes.iter().copied())
}

fn saved_activation_bytes(graph: &Graph, partition: &Partition) -> u64 {
    partition
        .saved
        .iter()
        .filter(|s| s.kind.is_activation())
        .fold(0u64, |acc, s| {
            acc.saturating_add(graph.value(s.value).bytes)
        })
}

/// One document per forward node, built in parallel (in node order).
fn node_docs(graph: &Graph, policy: &Policy) -> Vec<NodeDoc> {
    let decided: Vec<(NodeId, NodePolicy)> = policy
        .nodes
        .iter()
        .filter_map(|(id, p)| Some((id, (*p)?)))
        .collect();
    // Indexed, so rayon writes each document straight into its slot of the result.
    decided
        .into_par_iter()
        .map(|(id, p)| {
            let node = graph.node(id);
            let model = graph.model(node.model);
            NodeDoc {
                name: node.name.clone(),
                op: node.op.clone(),
                model: Name::new(&model.name),
                layer: node.layer,
                decision: Name::const_new(p.decision.name()),
                reason: Name::const_new(p.reason.name()),
                unit: p
                    .unit
                    .filter(|_| p.decision == Decision::Save)
                    .map(|u| Name::new(&model.units[u].name)),
            }
        })
        .collect()
}

fn saved_docs(graph: &Graph, partition: &Partition) -> Vec<SavedDoc> {
    partition
        .saved
        .iter()
        .map(|s| {
            let producer = graph.producer(s.value).map(|p| graph.node(p));
            SavedDoc {
                value: graph.value(s.value).name.clone(),
                bytes: graph.value(s.value).bytes,
                layer: producer.and_then(|p| p.layer),
                kind: s.kind.name().to_owned(),
                model: producer.map(|p| graph.model(p.model).name.clone()),
            }
        })
        .collect()
}

fn replay_docs(graph: &Graph, partition: &Partition, work: &ForwardWork) -> Vec<ReplayDoc> {
    partition
        .replays
        .iter()
        .map(|r| ReplayDoc {
            model: graph.model(r.model).name.clone(),
            layer: r.layer,
            nodes: r
                .nodes
                .iter()
                .map(|&n| graph.node(n).name.clone())
                .collect(),
            before: graph.node(r.before).name.to_string(),
            seconds: work.sum(r.nodes.iter().copied()).seconds,
        })
        .collect()
}

fn layer_keep_docs(graph: &Graph, resolved: &Resolved) -> Vec<LayerKeepDoc> {
    resolved
        .layer_units
        .iter()
        .map(|(&(model, layer), units)| {
            let declared = graph.model(model);
            LayerKeepDoc {
                model: declared.name.clone(),
                layer,
                keep: units
                    .iter()
                    .map(|&u| declared.units[u].name.clone())
                    .collect(),
            }
        })
        .collect()
}

/// Per kept unit: ops kept and bytes of their outputs that backward needs, per layer, and the
/// replay time whole-layer recompute would spend on those ops.
fn unit_docs(
    graph: &Graph,
    policy: &Policy,
    joint: Option<&Joint>,
    work: &ForwardWork,
) -> Vec<UnitDoc> {
    let mut saved = vec![false; graph.values().len()];
    for s in joint
        .map(|j| j.partition.saved.as_slice())
        .unwrap_or_default()
    {
        saved[ir::EntityId::index(s.value)] = true;
    }
    let mut replayed_by_baseline = vec![false; graph.nodes().len()];
    for r in joint
        .map(|j| j.baselines.full_recompute.replays.as_slice())
        .unwrap_or_default()
    {
        for &n in &r.nodes {
            replayed_by_baseline[ir::EntityId::index(n)] = true;
        }
    }
    let mut avoided: BTreeMap<(ir::ModelId, usize), f64> = BTreeMap::new();
    let mut per: BTreeMap<(ir::ModelId, usize), BTreeMap<u32, (u64, u64)>> = BTreeMap::new();
    for (id, node) in graph.nodes().iter() {
        let Some(p) = policy.nodes[id].filter(|p| p.decision == Decision::Save) else {
            continue;
        };
        let Some(unit) = p.unit else { continue };
        if replayed_by_baseline[ir::EntityId::index(id)] {
            *avoided.entry((node.model, unit)).or_default() += work.node(id).seconds;
        }
        let layer = per
            .entry((node.model, unit))
            .or_default()
            .entry(node.layer.unwrap_or_default())
            .or_default();
        layer.0 += 1;
        layer.1 = layer.1.saturating_add(saved_bytes_of(graph, id, &saved));
    }
    per.into_iter()
        .map(|((model, unit), layers)| {
            let declared = graph.model(model);
            let layers: Vec<UnitLayerDoc> = layers
                .into_iter()
                .map(|(layer, (ops, bytes))| UnitLayerDoc {
                    layer,
                    kept_ops: ops,
                    saved_bytes: bytes,
                })
                .collect();
            UnitDoc {
                model: declared.name.clone(),
                unit: declared.units[unit].name.clone(),
                replay_time_avoided_s: avoided.get(&(model, unit)).copied().unwrap_or(0.0),
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
        .filter(|&&v| saved[ir::EntityId::index(v)])
        .fold(0u64, |acc, &v| acc.saturating_add(graph.value(v).bytes))
}

fn diagnostic_doc(d: Diagnostic) -> DiagnosticDoc {
    DiagnosticDoc {
        level: d.level.name().to_owned(),
        code: d.code.name().to_owned(),
        model: d.model,
        unit: d.unit,
        message: d.message,
        hint: d.hint,
    }
}
