//! The plan's wire message (`proto/plan.proto`): the one conversion between the typed plan and
//! its named form, which the `.pb` encoding writes as is and the JSON reader decodes into.

use prost::Message;

use super::{
    Code, Collectives, Config, Cost, Decision, DevicePhase, DeviceTotal, Diagnostic, Executor,
    GraphRef, Keep, LayerKeep, LayerOffload, LayerRef, Level, Memory, NameTable, NodeDecision,
    Offload, Optimizer, Peak, Plan, PlanNames, PlanReadError, RandomOps, Reason, Replay, SavedKind,
    SavedValue, Spelled, Stage, StateDtype, Training, UnitLayer, UnitSummary,
};
use crate::{wire::plan as pb, UnitId};

/// The `plan.proto` encoding of `plan`.
pub fn encode(plan: &Plan, names: &dyn PlanNames) -> Vec<u8> {
    to_wire(plan, names).encode_to_vec()
}

pub(super) fn decode(bytes: &[u8]) -> Result<pb::Plan, PlanReadError> {
    pb::Plan::decode(bytes).map_err(|e| PlanReadError::Protobuf(e.to_string()))
}

/// The named form of `plan`.
pub fn to_wire(plan: &Plan, names: &dyn PlanNames) -> pb::Plan {
    pb::Plan {
        planner_version: plan.planner_version.clone(),
        graph: Some(pb::GraphRef {
            name: plan.graph.name.clone(),
            fingerprint: plan.graph.fingerprint.clone(),
        }),
        config: Some(config_to_wire(&plan.config, names)),
        nodes: plan.nodes.iter().map(|n| node_to_wire(n, names)).collect(),
        saved: plan.saved.iter().map(|s| saved_to_wire(s, names)).collect(),
        replay: plan
            .replay
            .iter()
            .map(|r| replay_to_wire(r, names))
            .collect(),
        units: plan.units.iter().map(|u| unit_to_wire(u, names)).collect(),
        memory: Some(memory_to_wire(&plan.memory, names)),
        cost: Some(pb::Cost {
            replay_flops: plan.cost.replay_flops,
            replay_comm_bytes: plan.cost.replay_comm_bytes,
            replay_time_s: plan.cost.replay_time_s,
            replay_bytes: plan.cost.replay_bytes,
            full_recompute_replay_time_s: plan.cost.full_recompute_replay_time_s,
            hw: plan.cost.hw.clone(),
            forward_time_s: plan.cost.forward_time_s,
            backward_time_s: plan.cost.backward_time_s,
            step_time_s: plan.cost.step_time_s,
            replay_host_syncs: plan.cost.replay_host_syncs,
            transfer_time_s: plan.cost.transfer_time_s,
            exposed_transfer_time_s: plan.cost.exposed_transfer_time_s,
        }),
        diagnostics: plan
            .diagnostics
            .iter()
            .map(|d| diagnostic_to_wire(d, names))
            .collect(),
        joint: plan.joint,
    }
}

fn node_to_wire(n: &NodeDecision, names: &dyn PlanNames) -> pb::NodeDecision {
    pb::NodeDecision {
        name: names.node(n.node).to_owned(),
        op: names.op(n.node).to_owned(),
        model: names.model(n.model).to_owned(),
        layer: n.layer,
        decision: n.decision.name().to_owned(),
        reason: n.reason.name().to_owned(),
        unit: n.unit.map(|u| names.unit(n.model, u).to_owned()),
        offloaded: n.offloaded,
    }
}

fn saved_to_wire(s: &SavedValue, names: &dyn PlanNames) -> pb::SavedValue {
    pb::SavedValue {
        value: names.value(s.value).to_owned(),
        bytes: s.bytes,
        layer: s.layer,
        kind: s.kind.name().to_owned(),
        model: s.model.map(|m| names.model(m).to_owned()),
        alias_of: s.alias_of.map(|v| names.value(v).to_owned()),
        offloaded: s.offloaded,
    }
}

fn replay_to_wire(r: &Replay, names: &dyn PlanNames) -> pb::Replay {
    pb::Replay {
        model: names.model(r.at.model).to_owned(),
        layer: r.at.layer,
        nodes: r.nodes.iter().map(|&n| names.node(n).to_owned()).collect(),
        before: names.node(r.before).to_owned(),
        seconds: r.seconds,
    }
}

fn unit_to_wire(u: &UnitSummary, names: &dyn PlanNames) -> pb::UnitSummary {
    pb::UnitSummary {
        model: names.model(u.model).to_owned(),
        unit: names.unit(u.model, u.unit).to_owned(),
        kept_ops: u.kept_ops,
        saved_bytes: u.saved_bytes,
        replay_time_avoided_s: u.replay_time_avoided_s,
        layers: u
            .layers
            .iter()
            .map(|l| pb::UnitLayer {
                layer: l.layer,
                kept_ops: l.kept_ops,
                saved_bytes: l.saved_bytes,
            })
            .collect(),
    }
}

fn diagnostic_to_wire(d: &Diagnostic, names: &dyn PlanNames) -> pb::Diagnostic {
    pb::Diagnostic {
        level: d.level.name().to_owned(),
        code: d.code.name().to_owned(),
        model: names.model(d.model).to_owned(),
        unit: d.unit.map(|u| names.unit(d.model, u).to_owned()),
        message: d.message.clone(),
        hint: d.hint.clone(),
    }
}

/// The named form of per-layer unit choices (a plan's, or a Pareto point's).
pub fn layer_keep_to_wire(layer_keep: &[LayerKeep], names: &dyn PlanNames) -> Vec<pb::LayerKeep> {
    layer_keep
        .iter()
        .map(|l| pb::LayerKeep {
            model: names.model(l.at.model).to_owned(),
            layer: l.at.layer,
            keep: unit_names(l.at, &l.units, names),
        })
        .collect()
}

/// The names of `units` of the model of `at`.
fn unit_names(at: LayerRef, units: &[UnitId], names: &dyn PlanNames) -> Vec<String> {
    units
        .iter()
        .map(|&u| names.unit(at.model, u).to_owned())
        .collect()
}

/// The named form of per-layer offload choices.
fn layer_offload_to_wire(
    layer_offload: &[LayerOffload],
    names: &dyn PlanNames,
) -> Vec<pb::LayerOffload> {
    layer_offload
        .iter()
        .map(|l| pb::LayerOffload {
            model: names.model(l.at.model).to_owned(),
            layer: l.at.layer,
            offload: unit_names(l.at, &l.units, names),
            layer_input: l.layer_input,
        })
        .collect()
}

fn config_to_wire(config: &Config, names: &dyn PlanNames) -> pb::Config {
    pb::Config {
        keep: config.keep.names(),
        recompute_ratio: config.recompute_ratio,
        collectives: config.collectives.name().to_owned(),
        random_ops: config.random_ops.name().to_owned(),
        executor: config.executor.name().to_owned(),
        budget_bytes: config.budget_bytes,
        layer_keep: layer_keep_to_wire(&config.layer_keep, names),
        fsdp: config.training.fsdp,
        optimizer: config.training.optimizer.name().to_owned(),
        optimizer_state_dtype: config.training.state_dtype.name().to_owned(),
        master_weights: config.training.master_weights,
        offload: config.offload.units.clone(),
        offload_kinds: config
            .offload
            .kinds
            .iter()
            .map(|k| k.name().to_owned())
            .collect(),
        offload_prefetch: config.offload.prefetch,
        layer_offload: layer_offload_to_wire(&config.layer_offload, names),
    }
}

fn memory_to_wire(m: &Memory, names: &dyn PlanNames) -> pb::Memory {
    pb::Memory {
        peak_bytes: m.peak_bytes,
        saved_bytes: m.saved_bytes,
        no_checkpoint_peak_bytes: m.no_checkpoint_peak_bytes,
        full_recompute_peak_bytes: m.full_recompute_peak_bytes,
        peak_stage: m.peak.map(|p| p.stage.name().to_owned()),
        peak_node: m.peak.map(|p| names.node(p.node).to_owned()),
        parameter_bytes: m.parameter_bytes,
        gradient_bytes: m.gradient_bytes,
        device_total_bytes: m.device.map(|d| d.total_bytes),
        device_peak_phase: m.device.map(|d| d.phase.name().to_owned()),
        device_parameter_bytes: m.device.map(|d| d.parameter_bytes),
        device_activation_bytes: m.device.map(|d| d.activation_bytes),
        optimizer_state_bytes: m.device.map(|d| d.optimizer_state_bytes),
        master_weight_bytes: m.device.map(|d| d.master_weight_bytes),
        optimizer_step_bytes: m.device.map(|d| d.optimizer_step_bytes),
        device_memory_bytes: m.device.map(|d| d.memory_bytes),
        offloaded_bytes: m.offloaded_bytes,
        host_peak_bytes: m.host_peak_bytes,
        host_memory_bytes: m.host_memory_bytes,
        saved_on_device_bytes: Some(m.saved_on_device_bytes),
    }
}

/// A spelled enum field of the wire message, read back.
fn spelled<T: Spelled>(field: &'static str, text: &str) -> Result<T, PlanReadError> {
    T::from_name(text).ok_or_else(|| PlanReadError::UnknownName {
        field,
        value: text.to_owned(),
        expected: T::spellings(),
    })
}

/// The typed plan of a wire message, with the names it holds.
pub fn from_wire(wire: pb::Plan) -> Result<(Plan, NameTable), PlanReadError> {
    let mut names = NameTable::default();
    let graph = wire.graph.ok_or(PlanReadError::Missing {
        what: "the plan",
        field: "graph",
    })?;
    let config = config_from_wire(
        wire.config.ok_or(PlanReadError::Missing {
            what: "the plan",
            field: "config",
        })?,
        &mut names,
    )?;
    let nodes = wire
        .nodes
        .into_iter()
        .map(|n| node_from_wire(n, &mut names))
        .collect::<Result<_, _>>()?;
    let saved = wire
        .saved
        .into_iter()
        .map(|s| saved_from_wire(s, &mut names))
        .collect::<Result<_, _>>()?;
    let replay = wire
        .replay
        .into_iter()
        .map(|r| replay_from_wire(r, &mut names))
        .collect();
    let units = wire
        .units
        .into_iter()
        .map(|u| unit_from_wire(u, &mut names))
        .collect();
    let memory = memory_from_wire(wire.memory.unwrap_or_default(), &mut names)?;
    let cost = wire.cost.unwrap_or_default();
    let diagnostics = wire
        .diagnostics
        .into_iter()
        .map(|d| diagnostic_from_wire(d, &mut names))
        .collect::<Result<_, _>>()?;
    let plan = Plan {
        planner_version: wire.planner_version,
        graph: GraphRef {
            name: graph.name,
            fingerprint: graph.fingerprint,
        },
        config,
        joint: wire.joint,
        nodes,
        saved,
        replay,
        units,
        memory,
        cost: Cost {
            replay_flops: cost.replay_flops,
            replay_bytes: cost.replay_bytes,
            replay_comm_bytes: cost.replay_comm_bytes,
            replay_time_s: cost.replay_time_s,
            full_recompute_replay_time_s: cost.full_recompute_replay_time_s,
            hw: cost.hw,
            forward_time_s: cost.forward_time_s,
            backward_time_s: cost.backward_time_s,
            step_time_s: cost.step_time_s,
            replay_host_syncs: cost.replay_host_syncs,
            transfer_time_s: cost.transfer_time_s,
            exposed_transfer_time_s: cost.exposed_transfer_time_s,
        },
        diagnostics,
    };
    Ok((plan, names))
}

/// Per-layer unit choices back from their named form, interning their names in `names`.
pub fn layer_keep_from_wire(wire: Vec<pb::LayerKeep>, names: &mut NameTable) -> Vec<LayerKeep> {
    wire.into_iter()
        .map(|l| {
            let (at, units) = layer_units_from_wire(&l.model, l.layer, &l.keep, names);
            LayerKeep { at, units }
        })
        .collect()
}

/// Per-layer offload choices back from their named form, interning their names in `names`.
fn layer_offload_from_wire(
    wire: Vec<pb::LayerOffload>,
    names: &mut NameTable,
) -> Vec<LayerOffload> {
    wire.into_iter()
        .map(|l| {
            let (at, units) = layer_units_from_wire(&l.model, l.layer, &l.offload, names);
            LayerOffload {
                at,
                units,
                layer_input: l.layer_input,
            }
        })
        .collect()
}

/// One layer and some of its model's units back from their names.
fn layer_units_from_wire(
    model: &str,
    layer: u32,
    units: &[String],
    names: &mut NameTable,
) -> (LayerRef, Vec<UnitId>) {
    let model = names.model(model);
    let units = units.iter().map(|u| names.unit(model, u)).collect();
    (LayerRef { model, layer }, units)
}

fn config_from_wire(c: pb::Config, names: &mut NameTable) -> Result<Config, PlanReadError> {
    Ok(Config {
        keep: Keep::from_names(c.keep),
        recompute_ratio: c.recompute_ratio,
        collectives: spelled::<Collectives>("collectives", &c.collectives)?,
        random_ops: spelled::<RandomOps>("random ops", &c.random_ops)?,
        executor: spelled::<Executor>("executor", &c.executor)?,
        budget_bytes: c.budget_bytes,
        layer_keep: layer_keep_from_wire(c.layer_keep, names),
        training: Training {
            fsdp: match c.fsdp {
                0 => return Err(PlanReadError::Zero { field: "fsdp" }),
                n => n,
            },
            optimizer: spelled::<Optimizer>("optimizer", &c.optimizer)?,
            state_dtype: spelled::<StateDtype>("optimizer state dtype", &c.optimizer_state_dtype)?,
            master_weights: c.master_weights,
        },
        offload: Offload {
            units: c.offload,
            kinds: c
                .offload_kinds
                .iter()
                .map(|k| spelled::<SavedKind>("offload kind", k))
                .collect::<Result<_, _>>()?,
            prefetch: c.offload_prefetch,
        },
        layer_offload: layer_offload_from_wire(c.layer_offload, names),
    })
}

fn node_from_wire(
    n: pb::NodeDecision,
    names: &mut NameTable,
) -> Result<NodeDecision, PlanReadError> {
    let model = names.model(&n.model);
    Ok(NodeDecision {
        node: names.node(&n.name, &n.op),
        model,
        layer: n.layer,
        decision: spelled::<Decision>("decision", &n.decision)?,
        reason: spelled::<Reason>("reason", &n.reason)?,
        unit: n.unit.map(|u| names.unit(model, &u)),
        offloaded: n.offloaded,
    })
}

fn saved_from_wire(s: pb::SavedValue, names: &mut NameTable) -> Result<SavedValue, PlanReadError> {
    Ok(SavedValue {
        value: names.value(&s.value),
        alias_of: s.alias_of.map(|v| names.value(&v)),
        bytes: s.bytes,
        model: s.model.map(|m| names.model(&m)),
        layer: s.layer,
        kind: spelled::<SavedKind>("saved kind", &s.kind)?,
        offloaded: s.offloaded,
    })
}

fn replay_from_wire(r: pb::Replay, names: &mut NameTable) -> Replay {
    Replay {
        at: LayerRef {
            model: names.model(&r.model),
            layer: r.layer,
        },
        nodes: r.nodes.iter().map(|n| names.node(n, "")).collect(),
        before: names.node(&r.before, ""),
        seconds: r.seconds,
    }
}

fn unit_from_wire(u: pb::UnitSummary, names: &mut NameTable) -> UnitSummary {
    let model = names.model(&u.model);
    UnitSummary {
        model,
        unit: names.unit(model, &u.unit),
        kept_ops: u.kept_ops,
        saved_bytes: u.saved_bytes,
        replay_time_avoided_s: u.replay_time_avoided_s,
        layers: u
            .layers
            .into_iter()
            .map(|l| UnitLayer {
                layer: l.layer,
                kept_ops: l.kept_ops,
                saved_bytes: l.saved_bytes,
            })
            .collect(),
    }
}

fn memory_from_wire(m: pb::Memory, names: &mut NameTable) -> Result<Memory, PlanReadError> {
    let device = device_from_wire(&m)?;
    let peak = match (m.peak_stage, m.peak_node) {
        (Some(stage), Some(node)) => Some(Peak {
            stage: spelled::<Stage>("peak stage", &stage)?,
            node: names.node(&node, ""),
        }),
        _ => None,
    };
    Ok(Memory {
        peak_bytes: m.peak_bytes,
        saved_bytes: m.saved_bytes,
        no_checkpoint_peak_bytes: m.no_checkpoint_peak_bytes,
        full_recompute_peak_bytes: m.full_recompute_peak_bytes,
        peak,
        parameter_bytes: m.parameter_bytes,
        gradient_bytes: m.gradient_bytes,
        device,
        offloaded_bytes: m.offloaded_bytes,
        host_peak_bytes: m.host_peak_bytes,
        host_memory_bytes: m.host_memory_bytes,
        saved_on_device_bytes: m
            .saved_on_device_bytes
            .unwrap_or_else(|| m.saved_bytes.saturating_sub(m.offloaded_bytes)),
    })
}

/// The device total: every part present, or none (a forward-only plan).
fn device_from_wire(m: &pb::Memory) -> Result<Option<DeviceTotal>, PlanReadError> {
    let Some(total_bytes) = m.device_total_bytes else {
        return Ok(None);
    };
    let part = |value: Option<u64>, field: &'static str| {
        value.ok_or(PlanReadError::Missing {
            what: "the device total",
            field,
        })
    };
    let phase = m
        .device_peak_phase
        .as_deref()
        .ok_or(PlanReadError::Missing {
            what: "the device total",
            field: "device_peak_phase",
        })?;
    Ok(Some(DeviceTotal {
        total_bytes,
        phase: spelled::<DevicePhase>("device peak phase", phase)?,
        parameter_bytes: part(m.device_parameter_bytes, "device_parameter_bytes")?,
        activation_bytes: part(m.device_activation_bytes, "device_activation_bytes")?,
        optimizer_state_bytes: part(m.optimizer_state_bytes, "optimizer_state_bytes")?,
        master_weight_bytes: part(m.master_weight_bytes, "master_weight_bytes")?,
        optimizer_step_bytes: part(m.optimizer_step_bytes, "optimizer_step_bytes")?,
        memory_bytes: part(m.device_memory_bytes, "device_memory_bytes")?,
    }))
}

fn diagnostic_from_wire(
    d: pb::Diagnostic,
    names: &mut NameTable,
) -> Result<Diagnostic, PlanReadError> {
    let model = names.model(&d.model);
    Ok(Diagnostic {
        level: spelled::<Level>("level", &d.level)?,
        code: spelled::<Code>("code", &d.code)?,
        model,
        unit: d.unit.map(|u| names.unit(model, &u)),
        message: d.message,
        hint: d.hint,
    })
}
