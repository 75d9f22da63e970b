//! Wire graph -> validated core [`Graph`]. The only way a `Graph` comes to be.

use std::collections::hash_map::Entry;

use rayon::prelude::*;
use rustc_hash::FxHashMap as HashMap;

use prost::Message;
use xxhash_rust::xxh3::xxh3_128;

use crate::{
    dag::Dag,
    error::ValidationError as E,
    graph::{
        AttrValue, Attribute, Consumers, DType, Effects, Graph, MarkerInterval, Metadata, Model,
        Node, Phase, Role, Unit, Value, MARKER_NAME_ATTR, MARKER_OP,
    },
    id::{EntityId, IdVec, ModelId, NodeId, ValueId},
    ops::{self, CollectiveKind},
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
    pub fn from_wire_encoded(wire: pb::Graph, fingerprint: String) -> Result<Graph, E> {
        check_counts(&wire)?;
        let models = convert_models(wire.models)?;
        let values = convert_values(wire.values)?;
        let value_ids = index_by_name(&values, |v| &v.name, |name| E::DuplicateValue { name })?;
        let model_ids = index_by_name(&models, |m| &m.name, |name| E::DuplicateModel { name })?;
        let nodes = convert_nodes(wire.nodes, &value_ids, &model_ids, &models)?;
        let outputs = wire
            .outputs
            .into_iter()
            .map(|name| match value_ids.get(name.as_str()) {
                Some(&id) => Ok(id),
                None => Err(E::UnknownGraphOutput { value: name }),
            })
            .collect::<Result<Vec<_>, _>>();
        // The node-name check runs beside the structure; its error still comes first.
        let (names, structure) = rayon::join(
            || index_by_name(&nodes, |n| &n.name, |name| E::DuplicateNode { name }).map(drop),
            || Structure::build(&nodes, &values),
        );
        names?;
        let outputs = outputs?;
        let Structure {
            producers,
            consumers,
            mutators,
        } = structure?;
        Ok(Graph {
            name: wire.name,
            fingerprint,
            nodes,
            values,
            models,
            outputs,
            metadata: convert_metadata(wire.metadata.unwrap_or_default()),
            producers,
            consumers,
            mutators,
            dag: std::sync::OnceLock::new(),
        })
    }
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
    mutators: HashMap<ValueId, Vec<NodeId>>,
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
                    node: nodes[node].name.clone(),
                },
                None => misordered,
            });
        }
        let (consumers, mutators) =
            rayon::join(|| Consumers::build(values.len(), nodes), || mutators(nodes));
        Ok(Structure {
            producers,
            consumers,
            mutators,
        })
    }
}

fn check_counts(wire: &pb::Graph) -> Result<(), E> {
    if wire.nodes.is_empty() {
        return Err(E::NoNodes);
    }
    for (what, count) in [
        ("nodes", wire.nodes.len()),
        ("values", wire.values.len()),
        ("models", wire.models.len()),
    ] {
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

/// Maps each entity's name to its id; the first repeated name is an error.
fn index_by_name<'a, I: EntityId, T>(
    table: &'a IdVec<I, T>,
    name: impl Fn(&'a T) -> &'a String,
    duplicate: impl Fn(String) -> E,
) -> Result<HashMap<&'a str, I>, E> {
    let mut ids = HashMap::with_capacity_and_hasher(table.len(), Default::default());
    for (id, item) in table.iter() {
        match ids.entry(name(item).as_str()) {
            Entry::Occupied(_) => return Err(duplicate(name(item).clone())),
            Entry::Vacant(slot) => {
                slot.insert(id);
            }
        }
    }
    Ok(ids)
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

fn convert_units(model: &str, wire: Vec<pb::UnitIntervals>) -> Result<Vec<Unit>, E> {
    let mut units: Vec<Unit> = Vec::with_capacity(wire.len());
    for (index, u) in wire.into_iter().enumerate() {
        if u.unit.is_empty() {
            return Err(E::UnnamedUnit {
                model: model.to_owned(),
                index,
            });
        }
        if units.iter().any(|seen| seen.name == u.unit) {
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

fn convert_values(wire: Vec<pb::Value>) -> Result<IdVec<ValueId, Value>, E> {
    let mut values = IdVec::new();
    for (index, v) in wire.into_iter().enumerate() {
        if v.name.is_empty() {
            return Err(E::UnnamedValue { index });
        }
        let dtype = convert_dtype(&v.name, v.dtype)?;
        let role = convert_role(&v.name, v.role)?;
        let shape = convert_shape(&v.name, &v.shape)?;
        let bytes = byte_size(&shape, dtype).ok_or_else(|| E::ShapeOverflow {
            value: v.name.clone(),
            shape: v.shape.clone(),
        })?;
        values.push(Value {
            name: v.name,
            dtype,
            shape,
            role,
            bytes,
        });
    }
    Ok(values)
}

fn convert_shape(value: &str, shape: &[i64]) -> Result<Vec<u64>, E> {
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

/// Converts every node, in parallel; the first error in node order wins, so the message does
/// not depend on scheduling.
fn convert_nodes(
    wire: Vec<pb::Node>,
    value_ids: &HashMap<&str, ValueId>,
    model_ids: &HashMap<&str, ModelId>,
    models: &IdVec<ModelId, Model>,
) -> Result<IdVec<NodeId, Node>, E> {
    let converted: Vec<Result<Node, E>> = wire
        .into_par_iter()
        .enumerate()
        .map(|(index, n)| convert_node(index, n, value_ids, model_ids, models))
        .collect();
    converted
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map(IdVec::from_vec)
}

fn convert_node(
    index: usize,
    n: pb::Node,
    value_ids: &HashMap<&str, ValueId>,
    model_ids: &HashMap<&str, ModelId>,
    models: &IdVec<ModelId, Model>,
) -> Result<Node, E> {
    if n.name.is_empty() {
        return Err(E::UnnamedNode { index });
    }
    let name = n.name;
    if n.op.is_empty() {
        return Err(E::MissingOp { node: name });
    }
    let resolve = |names: Vec<String>, unknown: fn(String, String) -> E| {
        names
            .into_iter()
            .map(|v| match value_ids.get(v.as_str()) {
                Some(&id) => Ok(id),
                None => Err(unknown(name.clone(), v)),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let inputs = resolve(n.inputs, |node, value| E::UnknownInput { node, value })?;
    let outputs = resolve(n.outputs, |node, value| E::UnknownOutput { node, value })?;
    let phase = convert_phase(&name, n.phase)?;
    let model = *model_ids
        .get(n.model.as_str())
        .ok_or_else(|| E::UndeclaredModel {
            node: name.clone(),
            model: n.model.clone(),
        })?;
    if let Some(layer) = n.layer {
        let declared = &models[model];
        if layer >= declared.num_layers {
            return Err(E::LayerOutOfRange {
                node: name,
                layer,
                model: declared.name.clone(),
                num_layers: declared.num_layers,
            });
        }
    }
    let attributes = convert_attributes(&name, n.attributes)?;
    let info = ops::lookup(&n.op);
    let effects = effects(&name, n.schema.unwrap_or_default(), &info, inputs.len())?;
    let marker = marker_name(&name, &n.op, &attributes)?;
    Ok(Node {
        name,
        op: n.op,
        inputs,
        outputs,
        attributes,
        phase,
        model,
        layer: n.layer,
        module_path: n.module_path,
        compiled_region: Some(n.compiled_region).filter(|r| !r.is_empty()),
        micro_batch: n.micro_batch,
        effects,
        info,
        marker,
        stack_trace: n.stack_trace,
    })
}

fn convert_attributes(node: &str, wire: Vec<pb::Attribute>) -> Result<Vec<Attribute>, E> {
    use pb::attribute::Value as W;
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
                Some(W::Int(v)) => AttrValue::Int(v),
                Some(W::Float(v)) => AttrValue::Float(v),
                Some(W::Str(v)) => AttrValue::Str(v),
                Some(W::Bool(v)) => AttrValue::Bool(v),
                Some(W::Ints(v)) => AttrValue::Ints(v.values),
                Some(W::Floats(v)) => AttrValue::Floats(v.values),
                Some(W::Strs(v)) => AttrValue::Strs(v.values),
                None => {
                    return Err(E::EmptyAttribute {
                        node: node.to_owned(),
                        attribute: a.name,
                    })
                }
            };
            Ok(Attribute {
                name: a.name,
                value,
            })
        })
        .collect()
}

/// The exporter's schema facts merged with the knowledge base's: either source is enough to
/// make an op mutable, a view, random or a collective.
fn effects(
    node: &str,
    schema: pb::SchemaFacts,
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
        None => info.view_of.filter(|&p| p < inputs),
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

fn marker_name(node: &str, op: &str, attributes: &[Attribute]) -> Result<Option<String>, E> {
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
                    node: node.name.clone(),
                    value: value.name.clone(),
                    role: value.role.name(),
                });
            }
            if let Some(first) = producers[v] {
                return Err(E::ProducedTwice {
                    value: value.name.clone(),
                    first: nodes[first].name.clone(),
                    second: node.name.clone(),
                });
            }
            producers[v] = Some(id);
        }
    }
    for (id, value) in values.iter() {
        if producers[id].is_none() && !value.role.is_graph_input() {
            return Err(E::NeverProduced {
                value: value.name.clone(),
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
                    node: node.name.clone(),
                    value: values[v].name.clone(),
                    producer: nodes[producer].name.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Per written value, the nodes that write it, in execution order.
fn mutators(nodes: &IdVec<NodeId, Node>) -> HashMap<ValueId, Vec<NodeId>> {
    let mut mutators: HashMap<ValueId, Vec<NodeId>> = HashMap::default();
    for (id, node) in nodes.iter() {
        for &p in &node.effects.mutates {
            mutators.entry(node.inputs[p]).or_default().push(id);
        }
    }
    mutators
}

fn convert_metadata(m: pb::Metadata) -> Metadata {
    Metadata {
        exporter_version: m.exporter_version,
        torch_version: m.torch_version,
        world_size: m.world_size,
        rank: m.rank,
    }
}
