//! The output formats of a [`Plan`]: human text, JSON (SPEC §8 keys), protobuf (`plan.proto`)
//! and DOT. Every one is deterministic: same plan, same bytes (R11).

use std::{collections::BTreeMap, fmt::Write as _};

use rustc_hash::FxHashMap as HashMap;

use ir::{wire::plan as pb, EntityId, Graph, Name, Phase};
use prost::Message;

use crate::{
    plan::{
        ConfigDoc, CostDoc, DiagnosticDoc, GraphRef, LayerKeepDoc, MemoryDoc, NodeDoc, Plan,
        ReplayDoc, SavedDoc, UnitDoc, UnitLayerDoc,
    },
    units::{format_bytes, format_seconds},
};

/// The human form: config, per-unit kept ops and bytes, saved set, replay, diagnostics.
pub fn text(plan: &Plan) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "plan for {}  (fingerprint {}, planner {})",
        plan.graph.name, plan.graph.fingerprint, plan.planner_version
    );
    let keep = match plan.config.keep.as_slice() {
        _ if plan.config.budget_bytes.is_some() => "per layer, for the budget".to_owned(),
        [] => "nothing (whole-layer recompute)".to_owned(),
        units => units.join(", "),
    };
    let _ = writeln!(
        w,
        "config: keep {keep}; recompute-ratio {}; collectives {}",
        plan.config.recompute_ratio, plan.config.collectives
    );
    text_budget(w, plan);
    text_decisions(w, &plan.nodes);
    text_units(w, plan);
    if plan.joint {
        text_saved(w, &plan.saved, plan.memory.saved_bytes);
        text_replay(w, plan);
        text_memory(w, plan);
    } else {
        let _ = writeln!(
            w,
            "partition: needs a joint forward+backward graph; this one has no backward nodes"
        );
    }
    text_diagnostics(w, &plan.diagnostics);
    out
}

/// The budget solver's per-layer choices, runs of equal choices folded.
fn text_budget(w: &mut String, plan: &Plan) {
    if let Some(budget) = plan.config.budget_bytes {
        let _ = writeln!(
            w,
            "budget {}: keeps {}",
            format_bytes(budget),
            crate::pareto::describe(&plan.config.layer_keep)
        );
    }
}

fn text_decisions(w: &mut String, nodes: &[NodeDoc]) {
    let counts = sorted_counts(
        nodes
            .iter()
            .map(|n| (n.decision.as_str(), n.reason.as_str())),
    );
    let _ = writeln!(w, "forward nodes: {}", nodes.len());
    for ((decision, reason), n) in counts {
        let _ = writeln!(w, "  {decision:<13} {reason:<22} {n}");
    }
}

fn text_units(w: &mut String, plan: &Plan) {
    if plan.units.is_empty() {
        let _ = writeln!(w, "kept units: none");
        return;
    }
    let _ = writeln!(w, "kept units:");
    let mut kept: HashMap<(&str, u32, &str), Vec<&NodeDoc>> = HashMap::default();
    for n in &plan.nodes {
        if let (Some(layer), Some(unit)) = (n.layer, n.unit.as_deref()) {
            kept.entry((&n.model, layer, unit)).or_default().push(n);
        }
    }
    for u in &plan.units {
        let _ = writeln!(
            w,
            "  {} / {}: {} ops kept, {} saved, {} of replay avoided",
            u.model,
            u.unit,
            u.kept_ops,
            format_bytes(u.saved_bytes),
            format_seconds(u.replay_time_avoided_s)
        );
        for l in &u.layers {
            let nodes = kept.get(&(u.model.as_str(), l.layer, u.unit.as_str()));
            let ops = op_histogram(nodes.into_iter().flatten().copied());
            let _ = writeln!(
                w,
                "    layer {}: {} ops, {}: {ops}",
                l.layer,
                l.kept_ops,
                format_bytes(l.saved_bytes)
            );
        }
    }
}

/// How often each key occurs, in key order (counted in a hash map: a million nodes).
pub(crate) fn sorted_counts<K: Ord + std::hash::Hash>(
    keys: impl Iterator<Item = K>,
) -> Vec<(K, usize)> {
    let mut counts: HashMap<K, usize> = HashMap::default();
    for key in keys {
        *counts.entry(key).or_default() += 1;
    }
    let mut counts: Vec<(K, usize)> = counts.into_iter().collect();
    counts.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    counts
}

/// `aten.mm.default ×3, aten.silu.default` in name order.
fn op_histogram<'a>(nodes: impl Iterator<Item = &'a NodeDoc>) -> String {
    histogram(sorted_counts(nodes.map(|n| n.op.as_str())))
}

/// `name ×count` items, a count of 1 left out.
fn histogram(counts: Vec<(&str, usize)>) -> String {
    counts
        .into_iter()
        .map(|(op, n)| match n {
            1 => op.to_owned(),
            n => format!("{op} ×{n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn text_saved(w: &mut String, saved: &[SavedDoc], activation_bytes: u64) {
    let mut by_kind: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for s in saved {
        let entry = by_kind.entry(&s.kind).or_default();
        entry.0 += 1;
        entry.1 = entry.1.saturating_add(s.bytes);
    }
    let _ = writeln!(
        w,
        "saved for backward: {} values, {} of activations",
        saved.len(),
        format_bytes(activation_bytes)
    );
    for (kind, (n, bytes)) in by_kind {
        let _ = writeln!(w, "  {kind:<17} {n:>5} values  {}", format_bytes(bytes));
    }
}

fn text_replay(w: &mut String, plan: &Plan) {
    if plan.replay.is_empty() {
        let _ = writeln!(w, "replay: nothing re-runs in backward");
        return;
    }
    let mut ops: HashMap<&str, &str> =
        HashMap::with_capacity_and_hasher(plan.nodes.len(), Default::default());
    ops.extend(plan.nodes.iter().map(|n| (n.name.as_str(), n.op.as_str())));
    let total: usize = plan.replay.iter().map(|r| r.nodes.len()).sum();
    let _ = writeln!(w, "replay: {total} ops in {} subgraphs", plan.replay.len());
    for r in &plan.replay {
        let _ = writeln!(
            w,
            "  {} layer {}: {} ops, before `{}`",
            r.model,
            r.layer,
            r.nodes.len(),
            r.before
        );
    }
    let replayed = plan
        .replay
        .iter()
        .flat_map(|r| r.nodes.iter())
        .filter_map(|n| ops.get(n.as_str()).copied());
    let _ = writeln!(w, "  replayed ops: {}", histogram(sorted_counts(replayed)));
}

fn text_memory(w: &mut String, plan: &Plan) {
    let m = &plan.memory;
    let c = &plan.cost;
    let peak = |p: Option<u64>| p.map_or_else(|| "-".to_owned(), format_bytes);
    let at = match (&m.peak_stage, &m.peak_node) {
        (Some(stage), Some(node)) => format!(" (in {stage}, at `{node}`)"),
        _ => String::new(),
    };
    let _ = writeln!(
        w,
        "memory (parameters apart: {}):",
        format_bytes(m.parameter_bytes)
    );
    let _ = writeln!(w, "  peak, this plan            {}{at}", peak(m.peak_bytes));
    let _ = writeln!(
        w,
        "  peak, no checkpointing     {}",
        peak(m.no_checkpoint_peak_bytes)
    );
    let _ = writeln!(
        w,
        "  peak, whole-layer recompute {}",
        peak(m.full_recompute_peak_bytes)
    );
    let _ = writeln!(
        w,
        "cost ({}): replay {} FLOPs, {} moved, {} re-communicated, {} (whole-layer recompute: {})",
        c.hw,
        c.replay_flops,
        format_bytes(c.replay_bytes),
        format_bytes(c.replay_comm_bytes),
        format_seconds(c.replay_time_s),
        format_seconds(c.full_recompute_replay_time_s)
    );
}

fn text_diagnostics(w: &mut String, diagnostics: &[DiagnosticDoc]) {
    if diagnostics.is_empty() {
        let _ = writeln!(w, "diagnostics: none");
        return;
    }
    let _ = writeln!(w, "diagnostics:");
    for d in diagnostics {
        let _ = writeln!(w, "{}[{}]: {}", d.level, d.code, d.message);
        let _ = writeln!(w, "  hint: {}", d.hint);
    }
}

/// Pretty JSON with a final newline.
pub fn json(plan: &Plan) -> String {
    let mut text = serde_json::to_string_pretty(plan).expect("a plan serialises to JSON");
    text.push('\n');
    text
}

/// The `plan.proto` encoding.
pub fn protobuf(plan: &Plan) -> Vec<u8> {
    to_wire(plan).encode_to_vec()
}

fn to_wire(plan: &Plan) -> pb::Plan {
    pb::Plan {
        planner_version: plan.planner_version.clone(),
        graph: Some(pb::GraphRef {
            name: plan.graph.name.clone(),
            fingerprint: plan.graph.fingerprint.clone(),
        }),
        config: Some(pb::Config {
            keep: plan.config.keep.clone(),
            recompute_ratio: plan.config.recompute_ratio,
            collectives: plan.config.collectives.clone(),
            budget_bytes: plan.config.budget_bytes,
            layer_keep: plan
                .config
                .layer_keep
                .iter()
                .map(|l| pb::LayerKeep {
                    model: l.model.clone(),
                    layer: l.layer,
                    keep: l.keep.clone(),
                })
                .collect(),
        }),
        nodes: plan
            .nodes
            .iter()
            .map(|n| pb::NodeDecision {
                name: n.name.to_string(),
                op: n.op.to_string(),
                model: n.model.to_string(),
                layer: n.layer,
                decision: decision_to_wire(&n.decision) as i32,
                reason: n.reason.to_string(),
                unit: n.unit.as_deref().unwrap_or_default().to_owned(),
            })
            .collect(),
        saved: plan
            .saved
            .iter()
            .map(|s| pb::SavedValue {
                value: s.value.to_string(),
                bytes: s.bytes,
                layer: s.layer,
                kind: s.kind.clone(),
                model: s.model.clone().unwrap_or_default(),
            })
            .collect(),
        replay: plan
            .replay
            .iter()
            .map(|r| pb::Replay {
                model: r.model.clone(),
                layer: r.layer,
                nodes: r.nodes.iter().map(|n| n.to_string()).collect(),
                before: r.before.clone(),
                seconds: r.seconds,
            })
            .collect(),
        units: plan
            .units
            .iter()
            .map(|u| pb::UnitSummary {
                model: u.model.clone(),
                unit: u.unit.clone(),
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
            })
            .collect(),
        memory: Some(memory_to_wire(&plan.memory)),
        cost: Some(pb::Cost {
            replay_flops: plan.cost.replay_flops,
            replay_comm_bytes: plan.cost.replay_comm_bytes,
            replay_time_s: plan.cost.replay_time_s,
            replay_bytes: plan.cost.replay_bytes,
            full_recompute_replay_time_s: plan.cost.full_recompute_replay_time_s,
            hw: plan.cost.hw.clone(),
        }),
        diagnostics: plan
            .diagnostics
            .iter()
            .map(|d| pb::Diagnostic {
                level: level_to_wire(&d.level) as i32,
                code: d.code.clone(),
                model: d.model.clone(),
                unit: d.unit.clone().unwrap_or_default(),
                message: d.message.clone(),
                hint: d.hint.clone(),
            })
            .collect(),
        joint: plan.joint,
    }
}

fn memory_to_wire(m: &MemoryDoc) -> pb::Memory {
    pb::Memory {
        peak_bytes: m.peak_bytes,
        saved_bytes: m.saved_bytes,
        no_checkpoint_peak_bytes: m.no_checkpoint_peak_bytes,
        full_recompute_peak_bytes: m.full_recompute_peak_bytes,
        peak_stage: m.peak_stage.clone().unwrap_or_default(),
        peak_node: m.peak_node.clone().unwrap_or_default(),
        parameter_bytes: m.parameter_bytes,
        gradient_bytes: m.gradient_bytes,
    }
}

fn memory_from_wire(m: pb::Memory) -> MemoryDoc {
    MemoryDoc {
        peak_bytes: m.peak_bytes,
        saved_bytes: m.saved_bytes,
        no_checkpoint_peak_bytes: m.no_checkpoint_peak_bytes,
        full_recompute_peak_bytes: m.full_recompute_peak_bytes,
        peak_stage: Some(m.peak_stage).filter(|s| !s.is_empty()),
        peak_node: Some(m.peak_node).filter(|s| !s.is_empty()),
        parameter_bytes: m.parameter_bytes,
        gradient_bytes: m.gradient_bytes,
    }
}

/// Reads a plan back from its protobuf encoding.
pub fn from_protobuf(bytes: &[u8]) -> Result<Plan, String> {
    let wire = pb::Plan::decode(bytes).map_err(|e| format!("not a valid protobuf plan ({e})"))?;
    let graph = wire.graph.unwrap_or_default();
    let config = wire.config.unwrap_or_default();
    Ok(Plan {
        planner_version: wire.planner_version,
        graph: GraphRef {
            name: graph.name,
            fingerprint: graph.fingerprint,
        },
        config: ConfigDoc {
            keep: config.keep,
            recompute_ratio: config.recompute_ratio,
            collectives: config.collectives,
            budget_bytes: config.budget_bytes,
            layer_keep: config
                .layer_keep
                .into_iter()
                .map(|l| LayerKeepDoc {
                    model: l.model,
                    layer: l.layer,
                    keep: l.keep,
                })
                .collect(),
        },
        joint: wire.joint,
        nodes: wire
            .nodes
            .into_iter()
            .map(|n| {
                Ok(NodeDoc {
                    decision: Name::new(decision_from_wire(n.decision)?),
                    name: Name::new(&n.name),
                    op: Name::new(&n.op),
                    model: Name::new(&n.model),
                    layer: n.layer,
                    reason: Name::new(&n.reason),
                    unit: Some(n.unit)
                        .filter(|u| !u.is_empty())
                        .map(|u| Name::new(&u)),
                })
            })
            .collect::<Result<_, String>>()?,
        saved: wire
            .saved
            .into_iter()
            .map(|s| SavedDoc {
                value: Name::new(&s.value),
                bytes: s.bytes,
                layer: s.layer,
                kind: s.kind,
                model: Some(s.model).filter(|m| !m.is_empty()),
            })
            .collect(),
        replay: wire
            .replay
            .into_iter()
            .map(|r| ReplayDoc {
                model: r.model,
                layer: r.layer,
                nodes: r.nodes.iter().map(Name::new).collect(),
                before: r.before,
                seconds: r.seconds,
            })
            .collect(),
        units: wire
            .units
            .into_iter()
            .map(|u| UnitDoc {
                model: u.model,
                unit: u.unit,
                kept_ops: u.kept_ops,
                saved_bytes: u.saved_bytes,
                replay_time_avoided_s: u.replay_time_avoided_s,
                layers: u
                    .layers
                    .into_iter()
                    .map(|l| UnitLayerDoc {
                        layer: l.layer,
                        kept_ops: l.kept_ops,
                        saved_bytes: l.saved_bytes,
                    })
                    .collect(),
            })
            .collect(),
        memory: memory_from_wire(wire.memory.unwrap_or_default()),
        cost: {
            let c = wire.cost.unwrap_or_default();
            CostDoc {
                replay_flops: c.replay_flops,
                replay_bytes: c.replay_bytes,
                replay_comm_bytes: c.replay_comm_bytes,
                replay_time_s: c.replay_time_s,
                full_recompute_replay_time_s: c.full_recompute_replay_time_s,
                hw: c.hw,
            }
        },
        diagnostics: wire
            .diagnostics
            .into_iter()
            .map(|d| {
                Ok(DiagnosticDoc {
                    level: level_from_wire(d.level)?.to_owned(),
                    code: d.code,
                    model: d.model,
                    unit: Some(d.unit).filter(|u| !u.is_empty()),
                    message: d.message,
                    hint: d.hint,
                })
            })
            .collect::<Result<_, String>>()?,
    })
}

const DECISIONS: [(&str, pb::Decision); 3] = [
    ("save", pb::Decision::Save),
    ("recompute", pb::Decision::Recompute),
    ("no-checkpoint", pb::Decision::NoCheckpoint),
];

const LEVELS: [(&str, pb::Level); 3] = [
    ("error", pb::Level::Error),
    ("warning", pb::Level::Warning),
    ("info", pb::Level::Info),
];

/// The wire enum for `name` in `table`, `unspecified` for a name it does not know.
fn to_wire_enum<T: Copy>(table: &[(&str, T)], name: &str, unspecified: T) -> T {
    table
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(unspecified, |&(_, value)| value)
}

/// The name of wire code `code` in `table`; `what` names the field in the error.
fn from_wire_enum<T: Copy + Into<i32>>(
    table: &[(&'static str, T)],
    code: i32,
    what: &str,
) -> Result<&'static str, String> {
    table
        .iter()
        .find(|&&(_, value)| value.into() == code)
        .map(|&(n, _)| n)
        .ok_or_else(|| format!("unknown {what} code {code}"))
}

fn decision_to_wire(name: &str) -> pb::Decision {
    to_wire_enum(&DECISIONS, name, pb::Decision::Unspecified)
}

fn decision_from_wire(code: i32) -> Result<&'static str, String> {
    from_wire_enum(&DECISIONS, code, "decision")
}

fn level_to_wire(name: &str) -> pb::Level {
    to_wire_enum(&LEVELS, name, pb::Level::Unspecified)
}

fn level_from_wire(code: i32) -> Result<&'static str, String> {
    from_wire_enum(&LEVELS, code, "diagnostic level")
}

/// Graphviz: forward nodes coloured by decision, replayed nodes outlined in red, backward grey.
pub fn dot(graph: &Graph, plan: &Plan) -> String {
    let decisions: BTreeMap<&str, &NodeDoc> =
        plan.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let replayed: std::collections::BTreeSet<&str> = plan
        .replay
        .iter()
        .flat_map(|r| r.nodes.iter().map(Name::as_str))
        .collect();
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "digraph \"{}\" {{", escape(&plan.graph.name));
    let _ = writeln!(
        w,
        "  node [shape=box, style=filled, fontname=\"monospace\"];"
    );
    for (id, node) in graph.nodes().iter() {
        let fill = match (node.phase, decisions.get(node.name.as_str())) {
            (Phase::Backward, _) => "#dddddd",
            (_, Some(d)) if d.decision == "save" => "#8fd18f",
            (_, Some(d)) if d.decision == "recompute" => "#f5c27a",
            _ => "#ffffff",
        };
        let outline = if replayed.contains(node.name.as_str()) {
            ", color=\"#d62728\", penwidth=3"
        } else {
            ""
        };
        let _ = writeln!(
            w,
            "  n{} [label=\"{}\\n{}\", fillcolor=\"{fill}\"{outline}];",
            id.index(),
            escape(&node.name),
            escape(&node.op)
        );
    }
    for (id, _) in graph.nodes().iter() {
        for succ in graph.successors(id) {
            let _ = writeln!(w, "  n{} -> n{};", id.index(), succ.index());
        }
    }
    let _ = writeln!(w, "}}");
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}
