//! Wire graph -> validated core [`Graph`]. The only way a `Graph` comes to be.
//!
//! Elements are converted in batches, each batch in parallel, and conversion stops at the
//! first invalid element: a file of millions of broken elements costs one batch of work and
//! memory, not a conversion of all of them.

use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

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
    layout::{
        decode_model, decode_node, decode_output, decode_value, elements, first_protobuf_error,
        pick_model, pick_node, pick_output, pick_value, Layout,
    },
    name_index::{NameIndex, RecentFirst},
    ops::{self, CollectiveKind},
    view::{
        RawAttrValue, RawAttribute, RawAttributes, RawModel, RawNode, RawSchema, RawUnits, RawValue,
    },
    wire::graph as pb,
};

/// Entity counts must fit the `u32` ids.
const MAX_ENTITIES: usize = u32::MAX as usize;

/// Elements converted per parallel batch: past the first invalid element, at most one batch is
/// converted and held.
pub(crate) const BATCH: usize = 8192;

impl Graph {
    /// Validates a decoded wire graph and converts it into the core model.
    pub fn from_wire(wire: pb::Graph) -> Result<Graph, E> {
        let fingerprint = fingerprint(&wire.encode_to_vec());
        Graph::from_wire_encoded(&wire, fingerprint)
    }

    /// [`Graph::from_wire`] for a graph whose canonical encoding was already hashed with
    /// [`fingerprint`] (a `.pb` file as written by prost or by Python's deterministic
    /// serialiser, which are canonical).
    pub fn from_wire_encoded(wire: &pb::Graph, fingerprint: String) -> Result<Graph, E> {
        build(&Decoded(wire), fingerprint)
    }

    /// [`Graph::from_wire_encoded`] for the bytes of a graph, already walked into `layout`:
    /// each element is decoded, borrowing its strings, just before it is converted, so the
    /// decoded graph never exists. As with decoding first, bad protobuf anywhere is reported
    /// before any broken rule.
    pub(crate) fn from_encoded(
        bytes: &[u8],
        layout: &Layout,
        fingerprint: String,
    ) -> Result<Graph, BuildError> {
        build(&Encoded { bytes, layout }, fingerprint).map_err(|error| match error {
            // Conversion stops at the first broken rule, maybe before reaching bad protobuf.
            BuildError::Invalid(invalid) => first_protobuf_error(bytes)
                .map_or(BuildError::Invalid(invalid), BuildError::Protobuf),
            error => error,
        })
    }
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

/// How many elements of each kind a graph holds.
struct Counts {
    values: usize,
    nodes: usize,
    models: usize,
    /// How many bytes the tables of values and nodes may reserve up front, each.
    reserve: usize,
}

/// An encoded graph's tables reserve at most this many times its size up front: every real
/// graph fits (a node is 304 bytes in memory and more than 100 in a file), while a file of
/// millions of empty elements grows its tables only as far as they really fill.
const RESERVE_TIMES_FILE: usize = 4;

/// Where [`build`] takes a graph's parts from: a decoded wire message, or the bytes of one.
/// Each part is handed out one element at a time, in order.
trait Source<'w>: Sync {
    /// A value or node as handed out, before it is viewed.
    type Value: Copy + Send + Sync;
    type Node: Copy + Send + Sync;
    type Err: From<E> + Send;

    fn counts(&self) -> Counts;
    fn name(&self) -> String;
    fn metadata(&self) -> Metadata;
    fn models(&self) -> impl Iterator<Item = Result<RawModel<'w>, Self::Err>>;
    fn values(&self) -> impl Iterator<Item = Result<Self::Value, Self::Err>>;
    fn nodes(&self) -> impl Iterator<Item = Result<Self::Node, Self::Err>>;
    fn outputs(&self) -> impl Iterator<Item = Result<&'w str, Self::Err>>;
    /// Views value `index`.
    fn value(index: usize, value: Self::Value) -> Result<RawValue<'w>, Self::Err>;
    /// Views node `index`.
    fn node(index: usize, node: Self::Node) -> Result<RawNode<'w>, Self::Err>;
}

/// A graph decoded by prost.
struct Decoded<'w>(&'w pb::Graph);

impl<'w> Source<'w> for Decoded<'w> {
    type Value = &'w pb::Value;
    type Node = &'w pb::Node;
    type Err = E;

    fn counts(&self) -> Counts {
        Counts {
            values: self.0.values.len(),
            nodes: self.0.nodes.len(),
            models: self.0.models.len(),
            // The decoded message is already in memory.
            reserve: usize::MAX,
        }
    }

    fn name(&self) -> String {
        self.0.name.clone()
    }

    fn metadata(&self) -> Metadata {
        convert_metadata(self.0.metadata.clone().unwrap_or_default())
    }

    fn models(&self) -> impl Iterator<Item = Result<RawModel<'w>, E>> {
        self.0.models.iter().map(|m| Ok(RawModel::of(m)))
    }

    fn values(&self) -> impl Iterator<Item = Result<&'w pb::Value, E>> {
        self.0.values.iter().map(Ok)
    }

    fn nodes(&self) -> impl Iterator<Item = Result<&'w pb::Node, E>> {
        self.0.nodes.iter().map(Ok)
    }

    fn outputs(&self) -> impl Iterator<Item = Result<&'w str, E>> {
        self.0.outputs.iter().map(|o| Ok(o.as_str()))
    }

    fn value(_: usize, value: &'w pb::Value) -> Result<RawValue<'w>, E> {
        Ok(RawValue::of(value))
    }

    fn node(_: usize, node: &'w pb::Node) -> Result<RawNode<'w>, E> {
        Ok(RawNode::of(node))
    }
}

/// The bytes of a graph, walked once into its layout.
struct Encoded<'w> {
    bytes: &'w [u8],
    layout: &'w Layout,
}

impl<'w> Encoded<'w> {
    /// The part of the file holding one kind of element.
    fn span(&self, span: &std::ops::Range<usize>) -> &'w [u8] {
        self.bytes.get(span.clone()).unwrap_or_default()
    }
}

/// Decoding errors of an encoded graph's elements, as protobuf errors.
fn protobuf_errors<T>(
    elements: impl Iterator<Item = Result<T, String>>,
) -> impl Iterator<Item = Result<T, BuildError>> {
    elements.map(|element| element.map_err(BuildError::Protobuf))
}

impl<'w> Source<'w> for Encoded<'w> {
    type Value = &'w [u8];
    type Node = &'w [u8];
    type Err = BuildError;

    fn counts(&self) -> Counts {
        Counts {
            values: self.layout.values,
            nodes: self.layout.nodes,
            models: self.layout.models,
            reserve: self.bytes.len().saturating_mul(RESERVE_TIMES_FILE),
        }
    }

    fn name(&self) -> String {
        self.layout.header.name.clone()
    }

    fn metadata(&self) -> Metadata {
        convert_metadata(self.layout.header.metadata.clone().unwrap_or_default())
    }

    fn models(&self) -> impl Iterator<Item = Result<RawModel<'w>, BuildError>> {
        protobuf_errors(elements(
            self.span(&self.layout.model_span),
            pick_model,
            decode_model,
        ))
    }

    fn values(&self) -> impl Iterator<Item = Result<&'w [u8], BuildError>> {
        protobuf_errors(elements(
            self.span(&self.layout.value_span),
            pick_value,
            |_, b| Ok(b),
        ))
    }

    fn nodes(&self) -> impl Iterator<Item = Result<&'w [u8], BuildError>> {
        protobuf_errors(elements(
            self.span(&self.layout.node_span),
            pick_node,
            |_, b| Ok(b),
        ))
    }

    fn outputs(&self) -> impl Iterator<Item = Result<&'w str, BuildError>> {
        protobuf_errors(elements(
            self.span(&self.layout.output_span),
            pick_output,
            decode_output,
        ))
    }

    fn value(index: usize, value: &'w [u8]) -> Result<RawValue<'w>, BuildError> {
        decode_value(index, value).map_err(BuildError::Protobuf)
    }

    fn node(index: usize, node: &'w [u8]) -> Result<RawNode<'w>, BuildError> {
        decode_node(index, node).map_err(BuildError::Protobuf)
    }
}

/// Converts the parts of `source` into a graph; checks run in a fixed order and the first
/// error in element order wins.
fn build<'w, S: Source<'w>>(source: &S, fingerprint: String) -> Result<Graph, S::Err> {
    let counts = source.counts();
    check_counts(&counts)?;
    let models = convert_models(source.models())?;
    let values = convert_in_batches(
        source.values(),
        counts.values.min(counts.reserve / size_of::<Value>()),
        || (),
        |(), index, v| Ok(convert_value(index, S::value(index, v)?)?),
        unconverted_value,
    )?;
    let value_ids =
        NameIndex::build(&values, |v| &v.name).map_err(|name| E::DuplicateValue { name })?;
    let model_ids =
        NameIndex::build(&models, |m| &m.name).map_err(|name| E::DuplicateModel { name })?;
    let nodes = convert_in_batches(
        source.nodes(),
        counts.nodes.min(counts.reserve / size_of::<Node>()),
        || NodeWorker {
            values: RecentFirst::new(&value_ids),
            ops: ops::LookupCache::new(),
            last_model: None,
        },
        |worker, index, n| {
            Ok(convert_node(
                index,
                S::node(index, n)?,
                worker,
                &model_ids,
                &models,
            )?)
        },
        unconverted_node,
    )?;
    let outputs = source
        .outputs()
        .map(|name| {
            let name = name?;
            value_ids.get(name).ok_or_else(|| {
                E::UnknownGraphOutput {
                    value: name.to_owned(),
                }
                .into()
            })
        })
        .collect::<Result<Vec<_>, S::Err>>();
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
        name: source.name(),
        fingerprint,
        nodes,
        values,
        models,
        outputs,
        metadata: source.metadata(),
        producers,
        consumers,
        storage,
        backward_order: std::sync::OnceLock::new(),
    })
}

/// Converts `elements` batch by batch, each batch in parallel (`init` makes one worker's
/// state), into a table reserved for `reserve` entries. Stops at the first error in element
/// order: after an invalid element, at most one batch more is converted.
///
/// Workers write the converted elements straight into the table, so its fresh memory is
/// faulted in by both cores and nothing is copied again; an element that fails leaves
/// `unconverted()` in its place, and the table is dropped with the batch's first error.
fn convert_in_batches<I: EntityId, S: Copy + Send + Sync, T: Send, W, Err: Send>(
    elements: impl Iterator<Item = Result<S, Err>>,
    reserve: usize,
    init: impl Fn() -> W + Sync + Send,
    convert: impl Fn(&mut W, usize, S) -> Result<T, Err> + Sync + Send,
    unconverted: fn() -> T,
) -> Result<IdVec<I, T>, Err> {
    let mut table = Vec::new();
    // One allocation for a valid graph; when even that fails, the table grows as it fills.
    let _ = table.try_reserve_exact(reserve);
    let mut elements = elements.peekable();
    let mut batch = Vec::with_capacity(BATCH.min(reserve));
    while elements.peek().is_some() {
        batch.clear();
        for element in elements.by_ref().take(BATCH) {
            batch.push(element?);
        }
        let start = table.len();
        let first_error = FirstError::default();
        table.par_extend(
            batch
                .par_iter()
                .enumerate()
                .map_init(&init, |state, (i, &element)| {
                    convert(state, start + i, element).unwrap_or_else(|error| {
                        first_error.record(i, error);
                        unconverted()
                    })
                }),
        );
        if let Some(error) = first_error.take() {
            return Err(error);
        }
    }
    Ok(IdVec::from_vec(table))
}

/// The error of the first element, by position, that failed among those converted in
/// parallel: the same whichever worker fails first.
struct FirstError<Err>(Mutex<Option<(usize, Err)>>);

impl<Err> Default for FirstError<Err> {
    fn default() -> Self {
        FirstError(Mutex::new(None))
    }
}

impl<Err> FirstError<Err> {
    fn record(&self, position: usize, error: Err) {
        let mut first = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if first
            .as_ref()
            .is_none_or(|&(earlier, _)| position < earlier)
        {
            *first = Some((position, error));
        }
    }

    fn take(self) -> Option<Err> {
        let first = self.0.into_inner().unwrap_or_else(PoisonError::into_inner);
        first.map(|(_, error)| error)
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
        check_phases(nodes, values, &producers)?;
        check_python_releases(nodes, values, &producers)?;
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

fn check_counts(counts: &Counts) -> Result<(), E> {
    if counts.nodes == 0 {
        return Err(E::NoNodes);
    }
    for (what, count) in [
        ("nodes", counts.nodes),
        ("values", counts.values),
        ("models", counts.models),
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

/// Converts the models one at a time, then resolves their parents by name (a parent may be
/// declared after its child) and checks that no model is nested inside itself.
fn convert_models<'w, Err: From<E>>(
    wire: impl Iterator<Item = Result<RawModel<'w>, Err>>,
) -> Result<IdVec<ModelId, Model>, Err> {
    let mut models = IdVec::new();
    let mut parents = Vec::new();
    for (index, m) in wire.enumerate() {
        let m = m?;
        if m.name.is_empty() {
            return Err(E::UnnamedModel { index }.into());
        }
        let units = convert_units(m.name, m.units)?;
        models.push(Model {
            name: m.name.to_owned(),
            parent: None,
            num_layers: m.num_layers,
            units,
        });
        parents.push(m.parent);
    }
    resolve_parents(&mut models, &parents)?;
    check_nesting(&models)?;
    Ok(models)
}

/// Sets each model's parent to the first model of that name.
fn resolve_parents(models: &mut IdVec<ModelId, Model>, parents: &[&str]) -> Result<(), E> {
    let mut first_of: HashMap<&str, ModelId> = HashMap::default();
    for (id, model) in models.iter() {
        first_of.entry(model.name.as_str()).or_insert(id);
    }
    let resolved = parents
        .iter()
        .enumerate()
        .map(|(index, &parent)| match parent {
            "" => Ok(None),
            parent => match first_of.get(parent) {
                Some(&id) => Ok(Some(id)),
                None => Err(E::UndeclaredParent {
                    model: models[ModelId::from_index(index)].name.clone(),
                    parent: parent.to_owned(),
                }),
            },
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (index, parent) in resolved.into_iter().enumerate() {
        models[ModelId::from_index(index)].parent = parent;
    }
    Ok(())
}

/// The first model, in declaration order, that is its own ancestor. Each parent chain is
/// walked once: linear in the number of models however they nest.
fn check_nesting(models: &IdVec<ModelId, Model>) -> Result<(), E> {
    #[derive(Clone, Copy, PartialEq)]
    enum Walk {
        Unseen,
        /// On the chain being walked now.
        OnPath,
        Done,
    }
    let mut state = vec![Walk::Unseen; models.len()];
    let mut on_cycle = vec![false; models.len()];
    let mut path = Vec::new();
    for start in models.ids() {
        let mut current = Some(start);
        while let Some(id) = current.filter(|id| state[id.index()] == Walk::Unseen) {
            state[id.index()] = Walk::OnPath;
            path.push(id);
            current = models[id].parent;
        }
        // Back at a model of this walk: the chain from it on is a cycle.
        if let Some(id) = current.filter(|id| state[id.index()] == Walk::OnPath) {
            let from = path.iter().position(|&p| p == id).unwrap_or(path.len());
            for &member in &path[from..] {
                on_cycle[member.index()] = true;
            }
        }
        for id in path.drain(..) {
            state[id.index()] = Walk::Done;
        }
    }
    match on_cycle.iter().position(|&c| c) {
        Some(index) => Err(E::ParentCycle {
            model: models[ModelId::from_index(index)].name.clone(),
        }),
        None => Ok(()),
    }
}

/// A model's units, one at a time; a repeated unit name is found with a set.
fn convert_units(model: &str, wire: RawUnits<'_>) -> Result<IdVec<UnitId, Unit>, E> {
    let mut units: IdVec<UnitId, Unit> = IdVec::new();
    let mut seen: HashSet<&str> = HashSet::default();
    for (index, u) in wire.into_iter().enumerate() {
        if u.name.is_empty() {
            return Err(E::UnnamedUnit {
                model: model.to_owned(),
                index,
            });
        }
        if !seen.insert(u.name) {
            return Err(E::DuplicateUnit {
                model: model.to_owned(),
                unit: u.name.to_owned(),
            });
        }
        let intervals = u
            .intervals
            .into_iter()
            .map(|(begin, end)| {
                let empty = |side| E::EmptyIntervalMarker {
                    model: model.to_owned(),
                    unit: u.name.to_owned(),
                    side,
                };
                match (begin.is_empty(), end.is_empty()) {
                    (true, _) => Err(empty("begin")),
                    (_, true) => Err(empty("end")),
                    _ => Ok(MarkerInterval {
                        begin: begin.to_owned(),
                        end: end.to_owned(),
                    }),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        units.push(Unit {
            name: u.name.to_owned(),
            intervals,
        });
    }
    Ok(units)
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

/// What the table holds in place of a value that failed to convert, until the error drops it.
fn unconverted_value() -> Value {
    Value {
        name: Name::default(),
        dtype: DType::F32,
        shape: Shape::new(),
        role: Role::Input,
        bytes: 0,
    }
}

fn convert_shape(value: &str, shape: &[i64]) -> Result<Shape, E> {
    let mut sizes = Shape::with_capacity(shape.len());
    for (dim, &size) in shape.iter().enumerate() {
        let size = u64::try_from(size).map_err(|_| E::NegativeDim {
            value: value.to_owned(),
            dim,
            size,
        })?;
        sizes.push(size);
    }
    Ok(sizes)
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

/// What one worker converting nodes keeps from node to node: the value ids it resolved last,
/// and the ops it looked up.
struct NodeWorker<'i, 't, 'w> {
    values: RecentFirst<'i, 't, ValueId, Value>,
    ops: ops::LookupCache<'w>,
    /// The model the last node named, and its id: nodes of one model come in runs.
    last_model: Option<(&'w str, ModelId)>,
}

impl<'w> NodeWorker<'_, '_, 'w> {
    fn model(&mut self, name: &'w str, ids: &NameIndex<ModelId, Model>) -> Option<ModelId> {
        match self.last_model {
            Some((last, id)) if last == name => Some(id),
            _ => {
                let id = ids.get(name)?;
                self.last_model = Some((name, id));
                Some(id)
            }
        }
    }
}

fn convert_node<'w>(
    index: usize,
    n: RawNode<'w>,
    worker: &mut NodeWorker<'_, '_, 'w>,
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
        |v| worker.values.input(v),
        |node, value| E::UnknownInput { node, value },
    )?;
    let outputs = resolve(
        name,
        &n.outputs,
        |v| worker.values.output(v),
        |node, value| E::UnknownOutput { node, value },
    )?;
    let phase = convert_phase(name, n.phase)?;
    let model = worker
        .model(n.model, model_ids)
        .ok_or_else(|| E::UndeclaredModel {
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
    let info = worker.ops.lookup(n.op);
    let effects = effects(name, &n.schema, &info, inputs.len())?;
    check_marker_name(name, n.op, &attributes)?;
    let python_releases = resolve(
        name,
        &n.python_releases,
        |v| worker.values.input(v),
        |node, value| E::UnknownPythonRelease { node, value },
    )?;
    Ok(Node {
        name: Name::new(name),
        op: Name::new(n.op),
        inputs,
        outputs,
        attributes,
        phase,
        model,
        layer: n.layer,
        compiled_region: Some(n.compiled_region)
            .filter(|r| !r.is_empty())
            .map(Name::new),
        micro_batch: n.micro_batch,
        effects,
        info,
        python_releases: (!python_releases.is_empty()).then(|| Box::new(python_releases)),
    })
}

/// What the table holds in place of a node that failed to convert, until the error drops it.
fn unconverted_node() -> Node {
    Node {
        name: Name::default(),
        op: Name::default(),
        inputs: ValueIds::new(),
        outputs: ValueIds::new(),
        attributes: Box::default(),
        phase: Phase::Forward,
        model: ModelId::from_index(0),
        layer: None,
        compiled_region: None,
        micro_batch: 0,
        effects: Effects::default(),
        info: ops::OpInfo::UNKNOWN,
        python_releases: None,
    }
}

/// The ids of a node's value names; `unknown(node, value)` for the first that is not declared.
fn resolve(
    node: &str,
    names: &[&str],
    mut find: impl FnMut(&str) -> Option<ValueId>,
    unknown: fn(String, String) -> E,
) -> Result<ValueIds, E> {
    let mut ids = ValueIds::with_capacity(names.len());
    for &name in names {
        let id = find(name).ok_or_else(|| unknown(node.to_owned(), name.to_owned()))?;
        ids.push(id);
    }
    Ok(ids)
}

fn convert_attributes(node: &str, attributes: RawAttributes<'_>) -> Result<Box<[Attribute]>, E> {
    match attributes {
        RawAttributes::Decoded(list) => convert_each_attribute(node, list),
        RawAttributes::Encoded(bytes) => {
            convert_each_attribute(node, RawAttributes::encoded(bytes))
        }
    }
}

/// The attributes in a box of their exact size, allocated once when their number is known
/// (a collected `Result` would grow a vector, then shrink it into the box).
fn convert_each_attribute<'w>(
    node: &str,
    wire: impl IntoIterator<Item = RawAttribute<'w>>,
) -> Result<Box<[Attribute]>, E> {
    let wire = wire.into_iter();
    let mut attributes = Vec::with_capacity(wire.size_hint().0);
    for (index, a) in wire.enumerate() {
        attributes.push(convert_attribute(node, index, a)?);
    }
    Ok(attributes.into_boxed_slice())
}

fn convert_attribute(node: &str, index: usize, a: RawAttribute<'_>) -> Result<Attribute, E> {
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
        Some(RawAttrValue::Strs(v)) => AttrValue::Strs(v.iter().map(|&s| s.to_owned()).collect()),
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

/// A marker node must name its marker in a non-empty string attribute.
fn check_marker_name(node: &str, op: &str, attributes: &[Attribute]) -> Result<(), E> {
    if op != MARKER_OP {
        return Ok(());
    }
    match attributes.iter().find(|a| a.name == MARKER_NAME_ATTR) {
        Some(Attribute {
            value: AttrValue::Str(name),
            ..
        }) if !name.is_empty() => Ok(()),
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

/// Forward computes the loss, backward its gradients: no forward node reads what a backward
/// node produced (it could not be saved for, or replayed in, a pass that runs before it).
fn check_phases(
    nodes: &IdVec<NodeId, Node>,
    values: &IdVec<ValueId, Value>,
    producers: &IdVec<ValueId, Option<NodeId>>,
) -> Result<(), E> {
    for node in nodes.values().filter(|n| n.phase == Phase::Forward) {
        for &v in &node.inputs {
            if let Some(producer) = producers[v].filter(|&p| nodes[p].phase == Phase::Backward) {
                return Err(E::ForwardReadsBackward {
                    node: node.name.to_string(),
                    value: values[v].name.to_string(),
                    producer: nodes[producer].name.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Python releases in forward what forward made: only a forward node lists `python_releases`,
/// and a value it lists was made by a forward node at or before it (or is a graph input).
fn check_python_releases(
    nodes: &IdVec<NodeId, Node>,
    values: &IdVec<ValueId, Value>,
    producers: &IdVec<ValueId, Option<NodeId>>,
) -> Result<(), E> {
    for (id, node) in nodes.iter() {
        for &v in node.python_releases() {
            let made_later =
                producers[v].is_some_and(|p| p > id || nodes[p].phase != Phase::Forward);
            if node.phase != Phase::Forward || made_later {
                return Err(E::PythonReleaseOutsideForward {
                    node: node.name.to_string(),
                    value: values[v].name.to_string(),
                });
            }
        }
    }
    Ok(())
}

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
