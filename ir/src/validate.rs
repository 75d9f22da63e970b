//! Wire graph -> validated core [`Graph`]. The only way a `Graph` comes to be.

use rayon::prelude::*;
use rustc_hash::FxHashMap as HashMap;

use prost::Message;
use xxhash_rust::xxh3::xxh3_128;

use crate::{
    dag::Dag,
    error::ValidationError as E,
    graph::{
        AttrValue, Attribute, Consumers, DType, Effects, Graph, MarkerInterval, Metadata, Model,
        Name, Node, Phase, Role, Shape, Storage, Unit, Value, ValueIds, MARKER_NAME_ATTR,
        MARKER_OP,
    },
    id::{EntityId, IdVec, ModelId, NodeId, UnitId, ValueId},
    name_index::{NameIndex, RecentFirst},
    ops::{self, CollectiveKind},
    view::{RawAttrValue, RawAttribute, RawNode, RawSchema, RawValue},
    wire::graph as pb,
};

/// Entity counts must fit the `u32` ids.
const MAX_ENTITIES: usize = u32::MAX as usize;

impl Graph {
    /// Validates a decoded wire graph and converts it into the core model.
    pub fn from_wire(wire: pb::Graph) -> Result<Graph, E> {
        let fingerprint = fingerprint(&wire.encode_to_vec());
        Graph::from_wire_encoded(wire, fingerprint)
    }

    /// [`Graph::from_wire`] for a graph whose canonical encoding was already hashed with
    /// [`fingerprint`] (a `.pb` file as written by prost or by Python's deterministic
    /// serialiser, which are canonical).
    pub fn from_wire_encoded(mut wire: pb::Graph, fingerprint: String) -> Result<Graph, E> {
        let values = std::mem::take(&mut wire.values);
        let nodes = std::mem::take(&mut wire.nodes);
        build(
            wire,
            &values,
            &nodes,
            |_, v| Ok(RawValue::of(v)),
            |_, n| Ok(RawNode::of(n)),
            fingerprint,
        )
    }

    /// [`Graph::from_wire_encoded`] for a graph whose values and nodes are still encoded
    /// (`header` holds the other fields): each element is decoded, borrowing its strings, just
    /// before it is converted, so the decoded graph never exists. As with decoding first, bad
    /// protobuf anywhere is reported before any broken rule.
    pub(crate) fn from_encoded(
        header: pb::Graph,
        values: &[&[u8]],
        nodes: &[&[u8]],
        fingerprint: String,
    ) -> Result<Graph, BuildError> {
        let protobuf = BuildError::Protobuf;
        let built = build(
            header,
            values,
            nodes,
            |i, v| decode_value(i, v).map_err(protobuf),
            |i, n| decode_node(i, n).map_err(protobuf),
            fingerprint,
        );
        built.map_err(|error| match error {
            // Conversion stops at the first broken rule, maybe before reaching bad protobuf.
            BuildError::Invalid(invalid) => {
                first_protobuf_error(values, nodes).map_or(BuildError::Invalid(invalid), protobuf)
            }
            error => error,
        })
    }
}

/// The first element, values before nodes, that is not valid protobuf.
fn first_protobuf_error(values: &[&[u8]], nodes: &[&[u8]]) -> Option<String> {
    let value = values
        .iter()
        .enumerate()
        .find_map(|(i, v)| decode_value(i, v).err());
    value.or_else(|| {
        let mut nodes = nodes.iter().enumerate();
        nodes.find_map(|(i, n)| decode_node(i, n).err())
    })
}

/// Decodes value `index`; an error names it.
fn decode_value(index: usize, bytes: &[u8]) -> Result<RawValue<'_>, String> {
    RawValue::decode(bytes).map_err(|e| format!("value #{index}: {e}"))
}

/// Decodes node `index`; an error names it.
fn decode_node(index: usize, bytes: &[u8]) -> Result<RawNode<'_>, String> {
    RawNode::decode(bytes).map_err(|e| format!("node #{index}: {e}"))
}

/// Why an encoded graph did not become a [`Graph`].
#[derive(Debug)]
pub(crate) enum BuildError {
    /// An element is not valid protobuf.
    Protobuf(String),
    Invalid(E),
}

impl From<E> for BuildError {
    fn from(error: E) -> Self {
        BuildError::Invalid(error)
    }
}

/// Converts `header` (the fields other than `values` and `nodes`) and the elements, each first
/// viewed as its wire message by `value` / `node` (given its index).
fn build<'w, V: Sync, N: Sync, Err: From<E> + Send>(
    header: pb::Graph,
    values: &'w [V],
    nodes: &'w [N],
    value: impl Fn(usize, &'w V) -> Result<RawValue<'w>, Err> + Sync,
    node: impl Fn(usize, &'w N) -> Result<RawNode<'w>, Err> + Sync,
    fingerprint: String,
) -> Result<Graph, Err> {
    check_counts(nodes.len(), values.len(), header.models.len())?;
    let models = convert_models(header.models)?;
    let values = convert_values(values, value)?;
    let value_ids =
        NameIndex::build(&values, |v| &v.name).map_err(|name| E::DuplicateValue { name })?;
    let model_ids =
        NameIndex::build(&models, |m| &m.name).map_err(|name| E::DuplicateModel { name })?;
    let nodes = convert_nodes(nodes, node, &value_ids, &model_ids, &models)?;
    let outputs = header
        .outputs
        .into_iter()
        .map(|name| match value_ids.get(&name) {
            Some(id) => Ok(id),
            None => Err(E::UnknownGraphOutput { value: name }),
        })
        .collect::<Result<Vec<_>, _>>();
    // The node-name check runs beside the structure; its error still comes first.
    let (names, structure) = rayon::join(
        || {
            NameIndex::build(&nodes, |n| &n.name)
                .map(drop)
                .map_err(|name| E::DuplicateNode { name })
        },
        || Structure::build(&nodes, &values),
    );
    names?;
    let outputs = outputs?;
    let Structure {
        producers,
        consumers,
        storage,
    } = structure?;
    Ok(Graph {
        name: header.name,
        fingerprint,
        nodes,
        values,
        models,
        outputs,
        metadata: convert_metadata(header.metadata.unwrap_or_default()),
        producers,
        consumers,
        storage,
        backward_order: std::sync::OnceLock::new(),
    })
}

/// The fingerprint of a graph: xxh3-128 of its canonical protobuf encoding, so `.pb` and
/// `.json` of one graph agree (R11).
pub fn fingerprint(canonical_encoding: &[u8]) -> String {
    format!("{:032x}", xxh3_128(canonical_encoding))
}

/// What is derived from the nodes: producers, the DAG (checked acyclic), the execution order
/// check, consumers and in-place writers.
struct Structure {
    producers: IdVec<ValueId, Option<NodeId>>,
    consumers: Consumers,
    storage: Storage,
}

impl Structure {
    fn build(nodes: &IdVec<NodeId, Node>, values: &IdVec<ValueId, Value>) -> Result<Self, E> {
        let producers = producers(nodes, values)?;
        // In execution order every input is produced earlier, which rules out cycles; only a
        // graph out of order needs the DAG, to tell a cycle (named by a node on it) apart.
        if let Err(misordered) = check_execution_order(nodes, values, &producers) {
            let dag = Dag::build(nodes.values().map(|n| n.inputs.iter().copied()), &producers);
            return Err(match dag.node_on_cycle() {
                Some(node) => E::Cycle {
                    node: nodes[node].name.to_string(),
                },
                None => misordered,
            });
        }
        let (consumers, storage) = rayon::join(
            || Consumers::build(values.len(), nodes),
            || storage(nodes, values.len()),
        );
        Ok(Structure {
            producers,
            consumers,
            storage,
        })
    }
}

fn check_counts(nodes: usize, values: usize, models: usize) -> Result<(), E> {
    if nodes == 0 {
        return Err(E::NoNodes);
    }
    for (what, count) in [("nodes", nodes), ("values", values), ("models", models)] {
        if count > MAX_ENTITIES {
            return Err(E::TooMany {
                what,
                count,
                limit: MAX_ENTITIES,
            });
        }
    }
    Ok(())
}

fn convert_models(wire: Vec<pb::Model>) -> Result<IdVec<ModelId, Model>, E> {
    let names: Vec<String> = wire.iter().map(|m| m.name.clone()).collect();
    let find = |name: &str| {
        names
            .iter()
            .position(|n| n == name)
            .map(ModelId::from_index)
    };
    let mut models = IdVec::new();
    for (index, m) in wire.into_iter().enumerate() {
        if m.name.is_empty() {
            return Err(E::UnnamedModel { index });
        }
        let parent = match m.parent.as_str() {
            "" => None,
            parent => Some(find(parent).ok_or_else(|| E::UndeclaredParent {
                model: m.name.clone(),
                parent: parent.to_owned(),
            })?),
        };
        let units = convert_units(&m.name, m.units)?;
        models.push(Model {
            name: m.name,
            parent,
            num_layers: m.num_layers,
            units,
        });
    }
    check_nesting(&models)?;
    Ok(models)
}

fn check_nesting(models: &IdVec<ModelId, Model>) -> Result<(), E> {
    for (id, model) in models.iter() {
        let mut current = model.parent;
        for _ in 0..models.len() {
            match current {
                Some(p) if p == id => break,
                Some(p) => current = models[p].parent,
                None => break,
            }
        }
        if current == Some(id) {
            return Err(E::ParentCycle {
                model: model.name.clone(),
            });
        }
    }
    Ok(())
}

fn convert_units(model: &str, wire: Vec<pb::UnitIntervals>) -> Result<IdVec<UnitId, Unit>, E> {
    let mut units: IdVec<UnitId, Unit> = IdVec::new();
    let mut seen: rustc_hash::FxHashSet<String> = rustc_hash::FxHashSet::default();
    for (index, u) in wire.into_iter().enumerate() {
        if u.unit.is_empty() {
            return Err(E::UnnamedUnit {
                model: model.to_owned(),
                index,
            });
        }
        if !seen.insert(u.unit.clone()) {
            return Err(E::DuplicateUnit {
                model: model.to_owned(),
                unit: u.unit,
            });
        }
        let intervals = u
            .intervals
            .into_iter()
            .map(|i| {
                let empty = |side| E::EmptyIntervalMarker {
                    model: model.to_owned(),
                    unit: u.unit.clone(),
                    side,
                };
                match (i.begin.is_empty(), i.end.is_empty()) {
                    (true, _) => Err(empty("begin")),
                    (_, true) => Err(empty("end")),
                    _ => Ok(MarkerInterval {
                        begin: i.begin,
                        end: i.end,
                    }),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        units.push(Unit {
            name: u.unit,
            intervals,
        });
    }
    Ok(units)
}

/// Converts every value, in parallel; the first error in value order wins.
fn convert_values<'w, V: Sync, Err: From<E> + Send>(
    wire: &'w [V],
    decode: impl Fn(usize, &'w V) -> Result<RawValue<'w>, Err> + Sync,
) -> Result<IdVec<ValueId, Value>, Err> {
    first_error_in_order(
        wire.par_iter()
            .enumerate()
            .map(|(index, v)| Ok(convert_value(index, decode(index, v)?)?))
            .collect(),
    )
}

fn convert_value(index: usize, v: RawValue<'_>) -> Result<Value, E> {
    if v.name.is_empty() {
        return Err(E::UnnamedValue { index });
    }
    let dtype = convert_dtype(v.name, v.dtype)?;
    let role = convert_role(v.name, v.role)?;
    let shape = convert_shape(v.name, &v.shape)?;
    let bytes = byte_size(&shape, dtype).ok_or_else(|| E::ShapeOverflow {
        value: v.name.to_owned(),
        shape: v.shape.to_vec(),
    })?;
    Ok(Value {
        name: Name::new(v.name),
        dtype,
        shape,
        role,
        bytes,
    })
}

/// The converted elements, or the first error in element order (so the message does not
/// depend on scheduling).
fn first_error_in_order<I: EntityId, T, Err>(
    converted: Vec<Result<T, Err>>,
) -> Result<IdVec<I, T>, Err> {
    converted
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map(IdVec::from_vec)
}

fn convert_shape(value: &str, shape: &[i64]) -> Result<Shape, E> {
    shape
        .iter()
        .enumerate()
        .map(|(dim, &size)| {
            u64::try_from(size).map_err(|_| E::NegativeDim {
                value: value.to_owned(),
                dim,
                size,
            })
        })
        .collect()
}

/// `numel × element size`, or `None` when it does not fit in 64 bits.
fn byte_size(shape: &[u64], dtype: DType) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
}

fn convert_dtype(value: &str, code: i32) -> Result<DType, E> {
    use pb::Dtype as W;
    Ok(match W::try_from(code) {
        Ok(W::Float32) => DType::F32,
        Ok(W::Float16) => DType::F16,
        Ok(W::Bfloat16) => DType::BF16,
        Ok(W::Float64) => DType::F64,
        Ok(W::Int64) => DType::I64,
        Ok(W::Int32) => DType::I32,
        Ok(W::Int16) => DType::I16,
        Ok(W::Int8) => DType::I8,
        Ok(W::Uint8) => DType::U8,
        Ok(W::Bool) => DType::Bool,
        Ok(W::Float8E4m3fn) => DType::F8E4M3,
        Ok(W::Float8E5m2) => DType::F8E5M2,
        Ok(W::Complex64) => DType::C64,
        Ok(W::Unspecified) => {
            return Err(E::UnspecifiedDtype {
                value: value.to_owned(),
            })
        }
        Err(_) => {
            return Err(E::UnknownDtype {
                value: value.to_owned(),
                code,
            })
        }
    })
}

fn convert_role(value: &str, code: i32) -> Result<Role, E> {
    use pb::Role as W;
    Ok(match W::try_from(code) {
        Ok(W::Parameter) => Role::Parameter,
        Ok(W::Buffer) => Role::Buffer,
        Ok(W::Input) => Role::Input,
        Ok(W::Tangent) => Role::Tangent,
        Ok(W::Activation) => Role::Activation,
        Ok(W::Gradient) => Role::Gradient,
        Ok(W::Loss) => Role::Loss,
        Ok(W::Unspecified) => {
            return Err(E::UnspecifiedRole {
                value: value.to_owned(),
            })
        }
        Err(_) => {
            return Err(E::UnknownRole {
                value: value.to_owned(),
                code,
            })
        }
    })
}

fn convert_phase(node: &str, code: i32) -> Result<Phase, E> {
    match pb::Phase::try_from(code) {
        Ok(pb::Phase::Forward) => Ok(Phase::Forward),
        Ok(pb::Phase::Backward) => Ok(Phase::Backward),
        Ok(pb::Phase::Unspecified) => Err(E::UnspecifiedPhase {
            node: node.to_owned(),
        }),
        Err(_) => Err(E::UnknownPhase {
            node: node.to_owned(),
            code,
        }),
    }
}

fn convert_collective(node: &str, code: i32) -> Result<Option<CollectiveKind>, E> {
    match pb::CollectiveKind::try_from(code) {
        Ok(pb::CollectiveKind::None) => Ok(None),
        Ok(pb::CollectiveKind::Functional) => Ok(Some(CollectiveKind::Functional)),
        Ok(pb::CollectiveKind::Mutating) => Ok(Some(CollectiveKind::Mutating)),
        Err(_) => Err(E::UnknownCollective {
            node: node.to_owned(),
            code,
        }),
    }
}

/// Converts every node, in parallel; the first error in node order wins.
fn convert_nodes<'w, N: Sync, Err: From<E> + Send>(
    wire: &'w [N],
    decode: impl Fn(usize, &'w N) -> Result<RawNode<'w>, Err> + Sync,
    value_ids: &NameIndex<ValueId, Value>,
    model_ids: &NameIndex<ModelId, Model>,
    models: &IdVec<ModelId, Model>,
) -> Result<IdVec<NodeId, Node>, Err> {
    first_error_in_order(
        wire.par_iter()
            .enumerate()
            .map_init(
                || RecentFirst::new(value_ids),
                |resolver, (index, n)| {
                    Ok(convert_node(
                        index,
                        decode(index, n)?,
                        resolver,
                        model_ids,
                        models,
                    )?)
                },
            )
            .collect(),
    )
}

fn convert_node(
    index: usize,
    n: RawNode<'_>,
    value_ids: &mut RecentFirst<ValueId, Value>,
    model_ids: &NameIndex<ModelId, Model>,
    models: &IdVec<ModelId, Model>,
) -> Result<Node, E> {
    let name = n.name;
    if name.is_empty() {
        return Err(E::UnnamedNode { index });
    }
    if n.op.is_empty() {
        return Err(E::MissingOp {
            node: name.to_owned(),
        });
    }
    let inputs = resolve(
        name,
        &n.inputs,
        |v| value_ids.input(v),
        |node, value| E::UnknownInput { node, value },
    )?;
    let outputs = resolve(
        name,
        &n.outputs,
        |v| value_ids.output(v),
        |node, value| E::UnknownOutput { node, value },
    )?;
    let phase = convert_phase(name, n.phase)?;
    let model = model_ids.get(n.model).ok_or_else(|| E::UndeclaredModel {
        node: name.to_owned(),
        model: n.model.to_owned(),
    })?;
    if let Some(layer) = n.layer {
        let declared = &models[model];
        if layer >= declared.num_layers {
            return Err(E::LayerOutOfRange {
                node: name.to_owned(),
                layer,
                model: declared.name.clone(),
                num_layers: declared.num_layers,
            });
        }
    }
    let attributes = convert_attributes(name, n.attributes)?;
    let info = ops::lookup(n.op);
    let effects = effects(name, &n.schema, &info, inputs.len())?;
    let marker = marker_name(name, n.op, &attributes)?;
    Ok(Node {
        name: Name::new(name),
        op: Name::new(n.op),
        inputs,
        outputs,
        attributes,
        phase,
        model,
        layer: n.layer,
        module_path: Name::new(n.module_path),
        compiled_region: Some(n.compiled_region)
            .filter(|r| !r.is_empty())
            .map(Name::new),
        micro_batch: n.micro_batch,
        effects,
        info,
        marker,
        stack_trace: n.stack_trace.iter().map(|&f| f.to_owned()).collect(),
    })
}

/// The ids of a node's value names; `unknown(node, value)` for the first that is not declared.
fn resolve(
    node: &str,
    names: &[&str],
    mut find: impl FnMut(&str) -> Option<ValueId>,
    unknown: fn(String, String) -> E,
) -> Result<ValueIds, E> {
    names
        .iter()
        .map(|&v| find(v).ok_or_else(|| unknown(node.to_owned(), v.to_owned())))
        .collect()
}

fn convert_attributes<'w>(
    node: &str,
    wire: impl IntoIterator<Item = RawAttribute<'w>>,
) -> Result<Box<[Attribute]>, E> {
    wire.into_iter()
        .enumerate()
        .map(|(index, a)| {
            if a.name.is_empty() {
                return Err(E::UnnamedAttribute {
                    node: node.to_owned(),
                    index,
                });
            }
            let value = match a.value {
                Some(RawAttrValue::Int(v)) => AttrValue::Int(v),
                Some(RawAttrValue::Float(v)) => AttrValue::Float(v),
                Some(RawAttrValue::Str(v)) => AttrValue::Str(Name::new(v)),
                Some(RawAttrValue::Bool(v)) => AttrValue::Bool(v),
                Some(RawAttrValue::Ints(v)) => AttrValue::Ints(v),
                Some(RawAttrValue::Floats(v)) => AttrValue::Floats(v),
                Some(RawAttrValue::Strs(v)) => {
                    AttrValue::Strs(v.iter().map(|&s| s.to_owned()).collect())
                }
                None => {
                    return Err(E::EmptyAttribute {
                        node: node.to_owned(),
                        attribute: a.name.to_owned(),
                    })
                }
            };
            Ok(Attribute {
                name: Name::new(a.name),
                value,
            })
        })
        .collect()
}

/// The exporter's schema facts merged with the knowledge base's: either source is enough to
/// make an op mutable, a view, random or a collective.
fn effects(
    node: &str,
    schema: &RawSchema,
    info: &ops::OpInfo,
    inputs: usize,
) -> Result<Effects, E> {
    let position = |fact: &'static str, position: u32| -> Result<usize, E> {
        match usize::try_from(position) {
            Ok(p) if p < inputs => Ok(p),
            _ => Err(E::SchemaPosition {
                node: node.to_owned(),
                fact,
                position,
                inputs,
            }),
        }
    };
    let mut mutates = schema
        .mutates
        .iter()
        .map(|&p| position("mutates", p))
        .collect::<Result<Vec<_>, _>>()?;
    mutates.extend(info.mutates.iter().filter(|&&p| p < inputs));
    mutates.sort_unstable();
    mutates.dedup();
    let view_of = match schema.view_of {
        Some(p) => Some(position("view_of", p)?),
        None => info.view_of.map(usize::from).filter(|&p| p < inputs),
    };
    let collective = convert_collective(node, schema.collective)?;
    Ok(Effects {
        mutates,
        writes_out: info.writes_out,
        view_of,
        random: schema.random || info.random,
        collective: strongest_collective(collective, info.collective),
    })
}

/// Mutating beats functional beats none.
fn strongest_collective(
    a: Option<CollectiveKind>,
    b: Option<CollectiveKind>,
) -> Option<CollectiveKind> {
    a.max(b)
}

fn marker_name(node: &str, op: &str, attributes: &[Attribute]) -> Result<Option<Name>, E> {
    if op != MARKER_OP {
        return Ok(None);
    }
    match attributes.iter().find(|a| a.name == MARKER_NAME_ATTR) {
        Some(Attribute {
            value: AttrValue::Str(name),
            ..
        }) if !name.is_empty() => Ok(Some(name.clone())),
        _ => Err(E::UnnamedMarker {
            node: node.to_owned(),
        }),
    }
}

/// Each non-input value's single producer.
fn producers(
    nodes: &IdVec<NodeId, Node>,
    values: &IdVec<ValueId, Value>,
) -> Result<IdVec<ValueId, Option<NodeId>>, E> {
    let mut producers: IdVec<ValueId, Option<NodeId>> = IdVec::filled(values.len(), None);
    for (id, node) in nodes.iter() {
        for &v in &node.outputs {
            let value = &values[v];
            if value.role.is_graph_input() {
                return Err(E::ProducesGraphInput {
                    node: node.name.to_string(),
                    value: value.name.to_string(),
                    role: value.role.name(),
                });
            }
            if let Some(first) = producers[v] {
                return Err(E::ProducedTwice {
                    value: value.name.to_string(),
                    first: nodes[first].name.to_string(),
                    second: node.name.to_string(),
                });
            }
            producers[v] = Some(id);
        }
    }
    for (id, value) in values.iter() {
        if producers[id].is_none() && !value.role.is_graph_input() {
            return Err(E::NeverProduced {
                value: value.name.to_string(),
                role: value.role.name(),
            });
        }
    }
    Ok(producers)
}

/// Execution order must be a topological order: every input is produced by an earlier node.
fn check_execution_order(
    nodes: &IdVec<NodeId, Node>,
    values: &IdVec<ValueId, Value>,
    producers: &IdVec<ValueId, Option<NodeId>>,
) -> Result<(), E> {
    for (id, node) in nodes.iter() {
        for &v in &node.inputs {
            if let Some(producer) = producers[v].filter(|&p| p >= id) {
                return Err(E::UsedBeforeProduced {
                    node: node.name.to_string(),
                    value: values[v].name.to_string(),
                    producer: nodes[producer].name.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Per written value, the nodes that write it, in execution order.
/// Which storage each value lives in, and the nodes that write each storage in place.
fn storage(nodes: &IdVec<NodeId, Node>, num_values: usize) -> Storage {
    let mut roots: IdVec<ValueId, ValueId> =
        IdVec::from_vec((0..num_values).map(ValueId::from_index).collect());
    let mut writers: HashMap<ValueId, Vec<NodeId>> = HashMap::default();
    // In execution order an aliased input's root is final before its aliases are made.
    for (id, node) in nodes.iter() {
        for (k, &out) in node.outputs.iter().enumerate() {
            if let Some(p) = node.aliased_input(k) {
                roots[out] = roots[node.inputs[p]];
            }
        }
        for &p in &node.effects.mutates {
            let root = roots[node.inputs[p]];
            let list = writers.entry(root).or_default();
            if list.last() != Some(&id) {
                list.push(id);
            }
        }
    }
    Storage { roots, writers }
}

fn convert_metadata(m: pb::Metadata) -> Metadata {
    Metadata {
        exporter_version: m.exporter_version,
        torch_version: m.torch_version,
        world_size: m.world_size,
        rank: m.rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The enum in `graph.proto` is the one dtype table: the exporter reads torch dtypes off
    /// its names, so every code must convert to the dtype its name spells.
    #[test]
    fn every_proto_dtype_converts_to_the_dtype_its_name_spells() {
        for code in 1.. {
            let Ok(wire) = pb::Dtype::try_from(code) else {
                break;
            };
            let spelled = wire
                .as_str_name()
                .trim_start_matches("DTYPE_")
                .to_lowercase();
            let dtype = convert_dtype("v", code).expect("a named dtype converts");
            assert_eq!(dtype.name(), spelled, "code {code}");
        }
    }
}
