//! `planner inspect`: what a graph holds, before any planning.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use ir::{display::name, EntityId, Graph, ModelId, Phase, Role};
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
        models: model_summaries(graph),
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

/// Each model's summary, all from one pass over the nodes.
fn model_summaries(graph: &Graph) -> Vec<ModelSummary> {
    let mut layers: Vec<BTreeMap<u32, LayerSummary>> =
        graph.models().ids().map(|_| BTreeMap::new()).collect();
    let mut outside = vec![0usize; graph.models().len()];
    for node in graph.nodes().values() {
        let model = node.model.index();
        let Some(layer) = node.layer else {
            outside[model] += 1;
            continue;
        };
        let summary = layers[model].entry(layer).or_insert_with(|| LayerSummary {
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
        if let Some(marker) = node.marker() {
            summary.markers.push(match node.micro_batch {
                0 => marker.to_string(),
                mb => format!("{marker}@mb{mb}"),
            });
        }
    }
    graph
        .models()
        .iter()
        .zip(layers.into_iter().zip(outside))
        .map(|((_, declared), (layers, outside))| ModelSummary {
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
        })
        .collect()
}

fn compiled_regions(graph: &Graph) -> Vec<RegionSummary> {
    let mut regions: BTreeMap<(&str, ModelId), (RegionSummary, BTreeSet<u32>)> = BTreeMap::new();
    for node in graph.nodes().values() {
        let Some(region) = &node.compiled_region else {
            continue;
        };
        let (summary, layers) = regions
            .entry((region.as_str(), node.model))
            .or_insert_with(|| {
                let summary = RegionSummary {
                    region: region.to_string(),
                    model: graph.model(node.model).name.clone(),
                    layers: Vec::new(),
                    forward_nodes: 0,
                    backward_nodes: 0,
                };
                (summary, BTreeSet::new())
            });
        match node.phase {
            Phase::Forward => summary.forward_nodes += 1,
            Phase::Backward => summary.backward_nodes += 1,
        }
        layers.extend(node.layer);
    }
    regions
        .into_values()
        .map(|(summary, layers)| RegionSummary {
            layers: layers.into_iter().collect(),
            ..summary
        })
        .collect()
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

/// The human form of a summary. Every name from the graph is shown through
/// [`ir::display::name`] (escaped, long ones shortened), so one entry stays one line.
pub fn render_text(s: &Summary) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "graph {}  (exporter {}, torch {}, rank {} of {})",
        name(&s.graph),
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

/// Columns of names are padded to the longest name shown, up to this many characters; a
/// longer name pushes its own line's next column out.
const MAX_COLUMN: usize = 80;

/// The width of a column of `names` as shown.
fn column_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names
        .map(|n| name(n).to_string().chars().count())
        .max()
        .unwrap_or(0)
        .min(MAX_COLUMN)
}

/// `text` shown and padded with spaces to `width` characters.
fn padded(text: &str, width: usize) -> String {
    let shown = name(text).to_string();
    let pad = width.saturating_sub(shown.chars().count());
    format!("{shown}{}", " ".repeat(pad))
}

fn render_model(w: &mut String, m: &ModelSummary) {
    let parent = m
        .parent
        .as_ref()
        .map(|p| format!(", nested in {}", name(p)))
        .unwrap_or_default();
    let _ = writeln!(
        w,
        "model {}  ({} layers{parent})",
        name(&m.name),
        m.num_layers
    );
    if m.units.is_empty() {
        let _ = writeln!(w, "  units: none declared");
    } else {
        let _ = writeln!(w, "  units:");
        let width = column_width(m.units.iter().map(|u| u.unit.as_str()));
        for u in &m.units {
            let intervals: Vec<String> = u
                .intervals
                .iter()
                .map(|[b, e]| format!("[{}, {})", name(b), name(e)))
                .collect();
            let _ = writeln!(w, "    {}  {}", padded(&u.unit, width), intervals.join(" "));
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
            let shown: Vec<String> = l.markers.iter().map(|m| name(m).to_string()).collect();
            shown.join(" ")
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
            name(&r.region),
            name(&r.model),
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
    let width = column_width(counts.iter().map(|c| c.op.as_str()));
    for c in counts {
        let _ = writeln!(w, "  {}  {}", padded(&c.op, width), c.count);
    }
}

/// A version string shown, or `-` when empty.
fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        name(s).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::wire::graph as pb;

    /// A one-node graph whose every name is `name` with a suffix.
    fn graph_named(name: &str) -> Graph {
        let attribute = |value: &str| pb::Attribute {
            name: "name".to_owned(),
            value: Some(pb::attribute::Value::Str(value.to_owned())),
        };
        let value = |suffix: &str, role: pb::Role| pb::Value {
            name: format!("{name}{suffix}"),
            dtype: pb::Dtype::Float32 as i32,
            shape: vec![2],
            role: role as i32,
        };
        let node = |suffix: &str, op: String, inputs: &str, outputs: &str| pb::Node {
            name: format!("{name}{suffix}"),
            op,
            inputs: vec![format!("{name}{inputs}")],
            outputs: vec![format!("{name}{outputs}")],
            phase: pb::Phase::Forward as i32,
            model: format!("{name}model"),
            layer: Some(0),
            compiled_region: format!("{name}region"),
            attributes: Vec::new(),
            ..Default::default()
        };
        let mut marker = node("marker", ir::MARKER_OP.to_owned(), "in", "marked");
        marker.attributes = vec![attribute(&format!("{name}begin"))];
        let wire = pb::Graph {
            name: format!("{name}graph"),
            values: vec![
                value("in", pb::Role::Input),
                value("marked", pb::Role::Activation),
                value("out", pb::Role::Activation),
            ],
            nodes: vec![marker, node("op", format!("{name}op"), "marked", "out")],
            models: vec![pb::Model {
                name: format!("{name}model"),
                num_layers: 1,
                units: vec![
                    pb::UnitIntervals {
                        unit: format!("{name}unit"),
                        intervals: vec![pb::MarkerInterval {
                            begin: format!("{name}begin"),
                            end: format!("{name}end"),
                        }],
                    },
                    pb::UnitIntervals {
                        unit: "short".to_owned(),
                        intervals: Vec::new(),
                    },
                ],
                ..Default::default()
            }],
            metadata: Some(pb::Metadata {
                exporter_version: format!("{name}exporter"),
                ..Default::default()
            }),
            ..Default::default()
        };
        Graph::from_wire(wire).expect("a valid graph")
    }

    #[test]
    fn very_long_names_render_shortened_without_panicking() {
        // Longer than any formatting width can be (65535).
        let long = "n".repeat(100_000);
        let text = render_text(&summarize(&graph_named(&long)));
        assert!(text.contains("bytes cut"), "{text}");
        let longest = text.lines().map(str::len).max().unwrap_or(0);
        assert!(longest < 1_000, "a line of {longest} bytes");
    }

    #[test]
    fn control_characters_in_names_are_escaped() {
        let text = render_text(&summarize(&graph_named("evil\n\u{1b}[2J\r\u{202e}")));
        assert!(text.contains("evil\\n\\u{1b}[2J\\r\\u{202e}"), "{text}");
        assert!(
            !text.chars().any(|c| c != '\n' && c.is_control()),
            "{text:?}"
        );
        // Every line is an entry of the summary: no name broke one in two.
        assert!(text.lines().all(|l| !l.starts_with("[2J")), "{text}");
    }

    #[test]
    fn a_long_name_pads_a_column_only_up_to_its_limit() {
        let text = render_text(&summarize(&graph_named(&"o".repeat(150))));
        let short = text
            .lines()
            .find(|l| l.trim_start().starts_with("short"))
            .expect("the short unit's line");
        // `    short` padded to the column's limit, then two spaces.
        assert_eq!(short.len(), 4 + MAX_COLUMN + 2, "{short:?}");
    }
}
