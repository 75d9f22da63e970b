//! `planner inspect`: what a graph holds, before any planning.

use std::{collections::BTreeMap, fmt::Write as _};

use ir::{Graph, ModelId, Phase, Role};
use serde::Serialize;

use crate::units::format_bytes;

#[derive(Debug, Serialize)]
pub struct Summary {
    pub graph: String,
    pub exporter_version: String,
    pub torch_version: String,
    pub world_size: u32,
    pub rank: u32,
    pub nodes: usize,
    pub forward_nodes: usize,
    pub backward_nodes: usize,
    pub values: usize,
    /// Bytes of the graph's values per role (`activation`, `parameter`, ...).
    pub bytes_by_role: BTreeMap<&'static str, u64>,
    pub models: Vec<ModelSummary>,
    pub compiled_regions: Vec<RegionSummary>,
    pub collectives: Vec<OpCount>,
    pub op_histogram: Vec<OpCount>,
    pub unknown_ops: Vec<OpCount>,
}

#[derive(Debug, Serialize)]
pub struct ModelSummary {
    pub name: String,
    pub parent: Option<String>,
    pub num_layers: u32,
    pub units: Vec<UnitSummary>,
    pub layers: Vec<LayerSummary>,
    /// Nodes of the model outside any layer (embedding, head, loss).
    pub nodes_outside_layers: usize,
}

#[derive(Debug, Serialize)]
pub struct UnitSummary {
    pub unit: String,
    pub intervals: Vec<[String; 2]>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct LayerSummary {
    pub layer: u32,
    pub forward_nodes: usize,
    pub backward_nodes: usize,
    pub activation_bytes: u64,
    /// Marker names in execution order; `name@mbN` for micro-batch N > 0.
    pub markers: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct RegionSummary {
    pub region: String,
    pub model: String,
    pub layers: Vec<u32>,
    pub forward_nodes: usize,
    pub backward_nodes: usize,
}

#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct OpCount {
    pub op: String,
    pub count: usize,
}

pub fn summarize(graph: &Graph) -> Summary {
    let nodes = graph.nodes();
    let forward_nodes = nodes.values().filter(|n| n.phase == Phase::Forward).count();
    let meta = graph.metadata();
    Summary {
        graph: graph.name().to_owned(),
        exporter_version: meta.exporter_version.clone(),
        torch_version: meta.torch_version.clone(),
        world_size: meta.world_size,
        rank: meta.rank,
        nodes: nodes.len(),
        forward_nodes,
        backward_nodes: nodes.len() - forward_nodes,
        values: graph.values().len(),
        bytes_by_role: bytes_by_role(graph),
        models: graph
            .models()
            .ids()
            .map(|m| model_summary(graph, m))
            .collect(),
        compiled_regions: compiled_regions(graph),
        collectives: histogram(graph, |n| n.effects.collective.is_some()),
        op_histogram: histogram(graph, |_| true),
        unknown_ops: histogram(graph, |n| !n.info.known),
    }
}

fn bytes_by_role(graph: &Graph) -> BTreeMap<&'static str, u64> {
    let mut bytes = BTreeMap::new();
    for value in graph.values().values() {
        let total = bytes.entry(value.role.name()).or_insert(0u64);
        *total = total.saturating_add(value.bytes);
    }
    bytes
}

fn model_summary(graph: &Graph, model: ModelId) -> ModelSummary {
    let declared = graph.model(model);
    let mut layers: BTreeMap<u32, LayerSummary> = BTreeMap::new();
    let mut outside = 0;
    for node in graph.nodes().values().filter(|n| n.model == model) {
        let Some(layer) = node.layer else {
            outside += 1;
            continue;
        };
        let summary = layers.entry(layer).or_insert_with(|| LayerSummary {
            layer,
            forward_nodes: 0,
            backward_nodes: 0,
            activation_bytes: 0,
            markers: Vec::new(),
        });
        match node.phase {
            Phase::Forward => summary.forward_nodes += 1,
            Phase::Backward => summary.backward_nodes += 1,
        }
        for &v in &node.outputs {
            let value = graph.value(v);
            if value.role == Role::Activation {
                summary.activation_bytes = summary.activation_bytes.saturating_add(value.bytes);
            }
        }
        if let Some(marker) = &node.marker {
            summary.markers.push(match node.micro_batch {
                0 => marker.to_string(),
                mb => format!("{marker}@mb{mb}"),
            });
        }
    }
    ModelSummary {
        name: declared.name.clone(),
        parent: declared.parent.map(|p| graph.model(p).name.clone()),
        num_layers: declared.num_layers,
        units: declared
            .units
            .values()
            .map(|u| UnitSummary {
                unit: u.name.clone(),
                intervals: u
                    .intervals
                    .iter()
                    .map(|i| [i.begin.clone(), i.end.clone()])
                    .collect(),
            })
            .collect(),
        layers: layers.into_values().collect(),
        nodes_outside_layers: outside,
    }
}

fn compiled_regions(graph: &Graph) -> Vec<RegionSummary> {
    let mut regions: BTreeMap<(&str, ModelId), RegionSummary> = BTreeMap::new();
    for node in graph.nodes().values() {
        let Some(region) = &node.compiled_region else {
            continue;
        };
        let summary = regions
            .entry((region.as_str(), node.model))
            .or_insert_with(|| RegionSummary {
                region: region.to_string(),
                model: graph.model(node.model).name.clone(),
                layers: Vec::new(),
                forward_nodes: 0,
                backward_nodes: 0,
            });
        match node.phase {
            Phase::Forward => summary.forward_nodes += 1,
            Phase::Backward => summary.backward_nodes += 1,
        }
        if let Some(layer) = node.layer {
            if let Err(at) = summary.layers.binary_search(&layer) {
                summary.layers.insert(at, layer);
            }
        }
    }
    regions.into_values().collect()
}

/// Counts of the ops of the nodes `keep` selects, most frequent first, then by name.
fn histogram(graph: &Graph, keep: impl Fn(&ir::Node) -> bool) -> Vec<OpCount> {
    let nodes = graph.nodes().values().filter(|n| keep(n));
    let mut ops: Vec<OpCount> = crate::render::sorted_counts(nodes.map(|n| n.op.as_str()))
        .into_iter()
        .map(|(op, count)| OpCount {
            op: op.to_owned(),
            count,
        })
        .collect();
    ops.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.op.cmp(&b.op)));
    ops
}

/// The human form of a summary.
pub fn render_text(s: &Summary) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "graph {}  (exporter {}, torch {}, rank {} of {})",
        s.graph,
        or_dash(&s.exporter_version),
        or_dash(&s.torch_version),
        s.rank,
        s.world_size
    );
    let _ = writeln!(
        w,
        "nodes {} (forward {}, backward {})  values {}",
        s.nodes, s.forward_nodes, s.backward_nodes, s.values
    );
    let _ = writeln!(w, "bytes by role:");
    for (role, bytes) in &s.bytes_by_role {
        let _ = writeln!(w, "  {role:<12} {}", format_bytes(*bytes));
    }
    for model in &s.models {
        render_model(w, model);
    }
    render_regions(w, &s.compiled_regions);
    render_counts(w, "collectives", &s.collectives);
    render_counts(w, "op histogram", &s.op_histogram);
    render_counts(w, "unknown ops (treated conservatively)", &s.unknown_ops);
    out
}

fn render_model(w: &mut String, m: &ModelSummary) {
    let parent = m
        .parent
        .as_ref()
        .map(|p| format!(", nested in {p}"))
        .unwrap_or_default();
    let _ = writeln!(w, "model {}  ({} layers{parent})", m.name, m.num_layers);
    if m.units.is_empty() {
        let _ = writeln!(w, "  units: none declared");
    } else {
        let _ = writeln!(w, "  units:");
        let width = m.units.iter().map(|u| u.unit.len()).max().unwrap_or(0);
        for u in &m.units {
            let intervals: Vec<String> = u
                .intervals
                .iter()
                .map(|[b, e]| format!("[{b}, {e})"))
                .collect();
            let _ = writeln!(w, "    {:<width$}  {}", u.unit, intervals.join(" "));
        }
    }
    let _ = writeln!(w, "  nodes outside layers: {}", m.nodes_outside_layers);
    for l in &m.layers {
        let _ = writeln!(
            w,
            "  layer {:<3} nodes {} fwd / {} bwd  activations {}",
            l.layer,
            l.forward_nodes,
            l.backward_nodes,
            format_bytes(l.activation_bytes)
        );
        let markers = if l.markers.is_empty() {
            "(none)".to_owned()
        } else {
            l.markers.join(" ")
        };
        let _ = writeln!(w, "            markers: {markers}");
    }
}

fn render_regions(w: &mut String, regions: &[RegionSummary]) {
    if regions.is_empty() {
        let _ = writeln!(w, "compiled regions: none (everything runs in eager)");
        return;
    }
    let _ = writeln!(w, "compiled regions:");
    for r in regions {
        let layers: Vec<String> = r.layers.iter().map(u32::to_string).collect();
        let _ = writeln!(
            w,
            "  {}  model {}  layers [{}]  nodes {} fwd / {} bwd",
            r.region,
            r.model,
            layers.join(", "),
            r.forward_nodes,
            r.backward_nodes
        );
    }
}

fn render_counts(w: &mut String, title: &str, counts: &[OpCount]) {
    if counts.is_empty() {
        let _ = writeln!(w, "{title}: none");
        return;
    }
    let _ = writeln!(w, "{title}:");
    let width = counts.iter().map(|c| c.op.len()).max().unwrap_or(0);
    for c in counts {
        let _ = writeln!(w, "  {:<width$}  {}", c.op, c.count);
    }
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() {
        "-"
    } else {
        s
    }
}
