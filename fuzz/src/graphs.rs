//! A structure-aware generator of graphs for fuzzing: `arbitrary` bytes become a valid graph
//! (values produced before they are read, one model with layers, units over marker
//! intervals, attributes of every kind, compiled regions, micro-batches), then a list of
//! mutations breaks it in the ways a real file can be broken (duplicate, dangling and hostile
//! names, bad codes and shapes, nodes out of order, models nested in themselves). Targets that
//! plan graphs can build on [`GraphSpec::wire`].

use arbitrary::{Arbitrary, Unstructured};
use ir::wire::graph as pb;

/// A graph to build, then to break.
#[derive(Debug, Arbitrary)]
pub struct GraphSpec {
    layers: u8,
    nodes: Vec<NodeSpec>,
    units: Vec<UnitSpec>,
    mutations: Vec<Mutation>,
}

#[derive(Debug, Arbitrary)]
struct NodeSpec {
    op: u8,
    /// Picks among the values made so far.
    inputs: Vec<u16>,
    outputs: u8,
    layer: Option<u8>,
    backward: bool,
    region: Option<u8>,
    micro_batch: u8,
    attributes: Vec<AttributeSpec>,
    marker: u8,
}

#[derive(Debug, Arbitrary)]
enum AttributeSpec {
    Int(i64),
    /// A double by its bits: every NaN payload, subnormal and infinity.
    Float(u64),
    Str(u8),
    Bool(bool),
    Ints(Vec<i64>),
    Floats(Vec<u64>),
    Strs(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
struct UnitSpec {
    name: u8,
    intervals: Vec<(u8, u8)>,
}

/// One way a file breaks; indices pick elements modulo their count.
#[derive(Debug, Arbitrary)]
enum Mutation {
    RenameNode(u16, u16),
    RenameValue(u16, u16),
    DropValue(u16),
    SwapNodes(u16, u16),
    Dtype(u16, i32),
    Role(u16, i32),
    Phase(u16, i32),
    Collective(u16, i32),
    Layer(u16, u32),
    Shape(u16, Vec<i64>),
    DanglingInput(u16),
    UnknownModel(u16),
    SchemaPosition(u16, u32),
    NestModelInItself,
    HostileNodeName(u16, Hostile),
    HostileOp(u16, Hostile),
    HostileUnit(Hostile),
    EmptyAttribute(u16),
    UnnamedMarker(u16),
    DuplicateUnit,
    NoNodes,
}

/// A name a file can hold that a terminal or a message should not show raw.
#[derive(Debug, Arbitrary)]
enum Hostile {
    Newline,
    Escape,
    Bidi,
    Empty,
    Long(u8),
    Any(String),
}

impl Hostile {
    fn name(&self) -> String {
        match self {
            Hostile::Newline => "line\nbreak".to_owned(),
            Hostile::Escape => "\u{1b}[2J\u{1b}]0;title\u{7}".to_owned(),
            Hostile::Bidi => "a\u{202e}b\u{2066}c\u{200b}".to_owned(),
            Hostile::Empty => String::new(),
            // Up to 255 KiB: past any formatting width.
            Hostile::Long(kib) => "n".repeat(1024 * usize::from(*kib)),
            Hostile::Any(s) => s.clone(),
        }
    }
}

const OPS: [&str; 8] = [
    "aten.mm.default",
    "aten.add.Tensor",
    "aten.add_.Tensor",
    "aten.view.default",
    "aten.native_dropout.default",
    "_c10d_functional.all_to_all_single.default",
    ir::MARKER_OP,
    "mystery.op.default",
];

const MODEL: &str = "main";

/// A forward `mm` of the graph's input, outside layers.
static PLAIN_NODE: NodeSpec = NodeSpec {
    op: 0,
    inputs: Vec::new(),
    outputs: 0,
    layer: None,
    backward: false,
    region: None,
    micro_batch: 0,
    attributes: Vec::new(),
    marker: 0,
};

/// At most this many nodes, so an input builds quickly.
const MAX_NODES: usize = 64;

impl GraphSpec {
    /// The graph `data` describes, if it describes one.
    pub fn from_bytes(data: &[u8]) -> Option<GraphSpec> {
        GraphSpec::arbitrary_take_rest(Unstructured::new(data)).ok()
    }

    /// The graph as built, before any mutation: always valid.
    pub fn valid(&self) -> pb::Graph {
        self.build()
    }

    /// The wire graph: valid as built, then mutated.
    pub fn wire(&self) -> pb::Graph {
        let mut graph = self.build();
        for mutation in &self.mutations {
            mutate(&mut graph, mutation);
        }
        graph
    }

    fn build(&self) -> pb::Graph {
        let layers = u32::from(self.layers % 4);
        let mut values = vec![
            value("input", pb::Role::Input),
            value("weight", pb::Role::Parameter),
        ];
        let mut nodes = Vec::new();
        // A graph has a node: without any, one plain node.
        let specs = match self.nodes.as_slice() {
            [] => std::slice::from_ref(&PLAIN_NODE),
            specs => specs,
        };
        for (i, spec) in specs.iter().take(MAX_NODES).enumerate() {
            // Forward reads no result of backward (gradients): the loader refuses that.
            let readable: Vec<&str> = values
                .iter()
                .filter(|v| spec.backward || v.role != pb::Role::Gradient as i32)
                .map(|v| v.name.as_str())
                .collect();
            let inputs: Vec<String> = spec
                .inputs
                .iter()
                .take(4)
                .map(|&pick| readable[usize::from(pick) % readable.len()].to_owned())
                .collect();
            let role = if spec.backward {
                pb::Role::Gradient
            } else {
                pb::Role::Activation
            };
            let outputs: Vec<String> = (0..1 + spec.outputs % 2)
                .map(|k| {
                    let v = value(&format!("v{i}_{k}"), role);
                    let name = v.name.clone();
                    values.push(v);
                    name
                })
                .collect();
            let op = OPS[usize::from(spec.op) % OPS.len()];
            let mut attributes: Vec<pb::Attribute> =
                spec.attributes.iter().take(4).map(attribute).collect();
            if op == ir::MARKER_OP {
                attributes.push(str_attribute("name", &marker(spec.marker)));
            }
            // Some forward nodes say Python released their inputs after them.
            let python_releases = if !spec.backward && spec.micro_batch % 2 == 1 {
                inputs.clone()
            } else {
                Vec::new()
            };
            nodes.push(pb::Node {
                name: format!("n{i}"),
                op: op.to_owned(),
                inputs,
                outputs,
                attributes,
                phase: if spec.backward {
                    pb::Phase::Backward
                } else {
                    pb::Phase::Forward
                } as i32,
                model: MODEL.to_owned(),
                layer: spec
                    .layer
                    .filter(|_| layers > 0)
                    .map(|l| u32::from(l) % layers),
                module_path: format!("layers.{i}"),
                compiled_region: spec
                    .region
                    .map(|r| format!("region{}", r % 3))
                    .unwrap_or_default(),
                micro_batch: u32::from(spec.micro_batch % 3),
                schema: None,
                stack_trace: Vec::new(),
                python_releases,
            });
        }
        let units = self
            .units
            .iter()
            .take(4)
            .enumerate()
            .map(|(i, u)| pb::UnitIntervals {
                unit: format!("SAVE_{i}_{}", u.name % 4),
                intervals: u
                    .intervals
                    .iter()
                    .take(3)
                    .map(|&(b, e)| pb::MarkerInterval {
                        begin: marker(b),
                        end: marker(e),
                    })
                    .collect(),
            })
            .collect();
        pb::Graph {
            name: "fuzz".to_owned(),
            values,
            nodes,
            outputs: Vec::new(),
            models: vec![pb::Model {
                name: MODEL.to_owned(),
                parent: String::new(),
                num_layers: layers,
                units,
            }],
            metadata: Some(pb::Metadata {
                exporter_version: "fuzz".to_owned(),
                torch_version: "2.13.0".to_owned(),
                world_size: 2,
                rank: 0,
            }),
        }
    }
}

fn marker(pick: u8) -> String {
    format!("marker{}", pick % 6)
}

fn value(name: &str, role: pb::Role) -> pb::Value {
    pb::Value {
        name: name.to_owned(),
        dtype: pb::Dtype::Float32 as i32,
        shape: vec![2, 4],
        role: role as i32,
    }
}

fn str_attribute(name: &str, value: &str) -> pb::Attribute {
    pb::Attribute {
        name: name.to_owned(),
        value: Some(pb::attribute::Value::Str(value.to_owned())),
    }
}

fn attribute(spec: &AttributeSpec) -> pb::Attribute {
    use pb::attribute::Value as V;
    let value = match spec {
        AttributeSpec::Int(v) => V::Int(*v),
        AttributeSpec::Float(bits) => V::Float(f64::from_bits(*bits)),
        AttributeSpec::Str(s) => V::Str(format!("s{s}")),
        AttributeSpec::Bool(b) => V::Bool(*b),
        AttributeSpec::Ints(v) => V::Ints(pb::IntList { values: v.clone() }),
        AttributeSpec::Floats(bits) => V::Floats(pb::FloatList {
            values: bits.iter().map(|&b| f64::from_bits(b)).collect(),
        }),
        AttributeSpec::Strs(v) => V::Strs(pb::StringList {
            values: v.iter().map(|s| format!("s{s}")).collect(),
        }),
    };
    pb::Attribute {
        name: "attr".to_owned(),
        value: Some(value),
    }
}

/// Element `pick` of `items`, if there is any.
fn pick<T>(items: &mut [T], pick: u16) -> Option<&mut T> {
    let len = items.len();
    (len > 0).then(|| &mut items[usize::from(pick) % len])
}

fn mutate(graph: &mut pb::Graph, mutation: &Mutation) {
    use Mutation as M;
    let node_name = |graph: &pb::Graph, i: u16| {
        let len = graph.nodes.len().max(1);
        graph
            .nodes
            .get(usize::from(i) % len)
            .map(|n| n.name.clone())
    };
    let value_name = |graph: &pb::Graph, i: u16| {
        let len = graph.values.len().max(1);
        graph
            .values
            .get(usize::from(i) % len)
            .map(|v| v.name.clone())
    };
    match mutation {
        M::RenameNode(a, b) => {
            if let Some(name) = node_name(graph, *b) {
                if let Some(n) = pick(&mut graph.nodes, *a) {
                    n.name = name;
                }
            }
        }
        M::RenameValue(a, b) => {
            if let Some(name) = value_name(graph, *b) {
                if let Some(v) = pick(&mut graph.values, *a) {
                    v.name = name;
                }
            }
        }
        M::DropValue(i) => {
            if !graph.values.is_empty() {
                let len = graph.values.len();
                graph.values.remove(usize::from(*i) % len);
            }
        }
        M::SwapNodes(a, b) => {
            let len = graph.nodes.len();
            if len > 0 {
                graph
                    .nodes
                    .swap(usize::from(*a) % len, usize::from(*b) % len);
            }
        }
        M::Dtype(i, code) => {
            if let Some(v) = pick(&mut graph.values, *i) {
                v.dtype = *code;
            }
        }
        M::Role(i, code) => {
            if let Some(v) = pick(&mut graph.values, *i) {
                v.role = *code;
            }
        }
        M::Phase(i, code) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.phase = *code;
            }
        }
        M::Collective(i, code) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.schema.get_or_insert_with(Default::default).collective = *code;
            }
        }
        M::Layer(i, layer) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.layer = Some(*layer);
            }
        }
        M::Shape(i, shape) => {
            let shape: Vec<i64> = shape.iter().copied().take(8).collect();
            if let Some(v) = pick(&mut graph.values, *i) {
                v.shape = shape;
            }
        }
        M::DanglingInput(i) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.inputs.push("nowhere".to_owned());
            }
        }
        M::UnknownModel(i) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.model = "elsewhere".to_owned();
            }
        }
        M::SchemaPosition(i, position) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.schema
                    .get_or_insert_with(Default::default)
                    .mutates
                    .push(*position);
            }
        }
        M::NestModelInItself => {
            if let Some(m) = graph.models.first_mut() {
                m.parent = m.name.clone();
            }
        }
        M::HostileNodeName(i, hostile) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.name = hostile.name();
            }
        }
        M::HostileOp(i, hostile) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.op = hostile.name();
            }
        }
        M::HostileUnit(hostile) => {
            if let Some(u) = graph.models.first_mut().and_then(|m| m.units.first_mut()) {
                u.unit = hostile.name();
            }
        }
        M::EmptyAttribute(i) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.attributes.push(pb::Attribute {
                    name: "empty".to_owned(),
                    value: None,
                });
            }
        }
        M::UnnamedMarker(i) => {
            if let Some(n) = pick(&mut graph.nodes, *i) {
                n.op = ir::MARKER_OP.to_owned();
                n.attributes.clear();
            }
        }
        M::DuplicateUnit => {
            if let Some(m) = graph.models.first_mut() {
                if let Some(u) = m.units.first().cloned() {
                    m.units.push(u);
                }
            }
        }
        M::NoNodes => graph.nodes.clear(),
    }
}
