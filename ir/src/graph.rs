//! The core graph model: what the rest of the project works on once a file has loaded.
//!
//! A [`Graph`] is immutable and valid by construction: it is only built by
//! [`Graph::from_wire`], which validates everything the IR promises (names resolve, each value
//! has one producer that runs before its consumers, no cycle, shapes fit in bytes, ...).

use std::fmt;

use crate::{
    id::{EntityId, IdVec, ModelId, NodeId, UnitId, ValueId},
    ops::{CollectiveKind, OpInfo, TensorRef, UnorderedSum},
};

/// The op of a `checkpoint_record` point marker; its `name` attribute names the marker.
pub const MARKER_OP: &str = "recompute.checkpoint_record.default";
/// The attribute of a marker node that carries its name.
pub const MARKER_NAME_ATTR: &str = "name";

/// A node, value or attribute name, or an op: stored inline up to 24 bytes (nearly every one in
/// an exported graph), so a million-node graph does not make millions of small allocations.
pub type Name = compact_str::CompactString;

/// The inputs or outputs of a node: inline up to four (nearly every op).
pub type ValueIds = smallvec::SmallVec<[ValueId; 4]>;

/// Static sizes of a tensor: inline up to four dimensions.
pub type Shape = smallvec::SmallVec<[u64; 4]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
    F8E4M3,
    F8E5M2,
    C64,
}

impl DType {
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 | DType::C64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// The torch spelling (`bfloat16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::Bool => "bool",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            DType::C64 => "complex64",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Parameter,
    Buffer,
    Input,
    Tangent,
    Activation,
    Gradient,
    Loss,
}

impl Role {
    /// Graph inputs are fed from outside; every other value has exactly one producer node.
    pub fn is_graph_input(self) -> bool {
        matches!(
            self,
            Role::Parameter | Role::Buffer | Role::Input | Role::Tangent
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Parameter => "parameter",
            Role::Buffer => "buffer",
            Role::Input => "input",
            Role::Tangent => "tangent",
            Role::Activation => "activation",
            Role::Gradient => "gradient",
            Role::Loss => "loss",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    Forward,
    Backward,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    pub name: Name,
    pub dtype: DType,
    pub shape: Shape,
    pub role: Role,
    /// `numel × dtype size`, checked at load.
    pub bytes: u64,
}

impl Value {
    pub fn tensor_ref(&self) -> TensorRef<'_> {
        TensorRef {
            shape: &self.shape,
            elem_bytes: self.dtype.size_bytes(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    Int(i64),
    Float(f64),
    Str(Name),
    Bool(bool),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Strs(Vec<String>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Attribute {
    pub name: Name,
    pub value: AttrValue,
}

/// What an op does to its arguments: the exporter's schema facts merged with the op knowledge
/// base (either source saying "mutates" or "random" is enough).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Effects {
    /// Positions into [`Node::inputs`] the op writes.
    pub mutates: Vec<usize>,
    /// An `out=` overload: writes a caller-provided buffer.
    pub writes_out: bool,
    /// Position of the input the first output is a view of.
    pub view_of: Option<usize>,
    pub random: bool,
    pub collective: Option<CollectiveKind>,
}

impl Effects {
    /// A mutable schema: writes an input, an out buffer, or is a mutating collective.
    pub fn is_mutable(&self) -> bool {
        !self.mutates.is_empty()
            || self.writes_out
            || self.collective == Some(CollectiveKind::Mutating)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: Name,
    /// `namespace.name.overload`.
    pub op: Name,
    pub inputs: ValueIds,
    pub outputs: ValueIds,
    pub attributes: Box<[Attribute]>,
    pub phase: Phase,
    pub model: ModelId,
    pub layer: Option<u32>,
    /// The compiled region the op runs in; `None` when it runs in eager.
    pub compiled_region: Option<Name>,
    pub micro_batch: u32,
    pub effects: Effects,
    /// What the op knowledge base knows of `op`.
    pub info: OpInfo,
    /// Forward values the model's Python code held through this forward node, past their last
    /// forward read, and released right after it (observed at export; docs/ir.md). Only an
    /// eager executor holds them. Boxed and absent when empty, as in most nodes of most
    /// graphs: 8 bytes a node ([`Node::python_releases`]).
    pub python_releases: Option<Box<ValueIds>>,
}

// Every node of a million-node graph is one of these: keep them small (the memory is most of
// what loading costs, and a one-shot run pays for every fresh page). What nothing reads stays
// in the file (a node's module path and stack trace), and what can be derived is (its marker
// name). Grow the bound only for a reason (248: the values Python releases after a node, which
// the eager memory model reads).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Node>() <= 248 && std::mem::size_of::<Value>() <= 80);

/// The op of a copy that may cross devices.
const TO_COPY_OP: &str = "aten._to_copy.default";

impl Node {
    /// Forward values the model's Python code held through this node past their last forward
    /// read, released right after it (empty when the export did not observe it).
    pub fn python_releases(&self) -> &[ValueId] {
        self.python_releases
            .as_deref()
            .map_or(&[], |v| v.as_slice())
    }

    /// A copy to the host (`_to_copy` with device `cpu`): on a GPU run it synchronises the
    /// stream, as the routing-count copy of expert-parallel dispatch does.
    pub fn is_device_to_host_copy(&self) -> bool {
        self.op == TO_COPY_OP
            && matches!(self.attribute("device"), Some(AttrValue::Str(d)) if d == "cpu" || d.starts_with("cpu:"))
    }

    /// The input whose storage output `output` shares: every output of a view aliases the
    /// view's base; the first output of an in-place op is the tensor it wrote.
    pub fn aliased_input(&self, output: usize) -> Option<usize> {
        match (self.effects.view_of, self.effects.mutates.first()) {
            (Some(base), _) => Some(base),
            (None, Some(&written)) if output == 0 => Some(written),
            _ => None,
        }
    }

    /// Whether running the node draws random numbers: its schema or the op knowledge base says
    /// it is random, unless it is a dropout switched off (probability 0, as attention kernels
    /// are called by default and outside training, or `train=False`).
    pub fn draws_random(&self) -> bool {
        self.effects.random && !self.is_dropout_off()
    }

    /// The op without its overload: `aten.bernoulli` for `aten.bernoulli.p`.
    pub fn packet(&self) -> &str {
        self.op
            .rsplit_once('.')
            .map_or(self.op.as_str(), |(p, _)| p)
    }

    /// Whether re-running the node may give another result than forward did, one that fixes
    /// shapes or indices downstream (a `topk` breaking ties, routing counts): what the op
    /// knowledge base says, unless the call asks for a stable sort, which breaks ties by
    /// position and so always the same way.
    pub fn replay_may_differ(&self) -> bool {
        self.info.replay_nondeterministic
            && !matches!(self.attribute("stable"), Some(AttrValue::Bool(true)))
    }

    /// Whether the node's kernel may add in no fixed order, so that the same inputs can give
    /// other last bits from run to run unless PyTorch's deterministic algorithms are on: what
    /// the op knowledge base says, `index_put` only when it accumulates.
    pub fn sums_in_no_fixed_order(&self) -> bool {
        match crate::ops::unordered_sum(&self.op) {
            Some(UnorderedSum::Always) => true,
            Some(UnorderedSum::When(flag)) => {
                matches!(self.attribute(flag), Some(AttrValue::Bool(true)))
            }
            None => false,
        }
    }

    fn is_dropout_off(&self) -> bool {
        let zero = |name: &str| match self.attribute(name) {
            Some(AttrValue::Float(p)) => *p == 0.0,
            Some(AttrValue::Int(p)) => *p == 0,
            _ => false,
        };
        zero("dropout_p")
            || (self.op.contains("dropout") && zero("p"))
            || matches!(self.attribute("train"), Some(AttrValue::Bool(false)))
    }

    /// The marker name when this node is a `checkpoint_record` point marker (loading checks
    /// that every marker has a non-empty one).
    pub fn marker(&self) -> Option<&Name> {
        if self.op != MARKER_OP {
            return None;
        }
        match self.attribute(MARKER_NAME_ATTR) {
            Some(AttrValue::Str(name)) => Some(name),
            _ => None,
        }
    }

    /// The value the call gives argument `name`: the node's attribute, else the schema default
    /// the op knowledge base records ([`crate::ops::attribute_default`]), since the exporter
    /// leaves out the arguments a call leaves at their default.
    pub fn attribute(&self, name: &str) -> Option<&AttrValue> {
        self.attributes
            .iter()
            .find(|a| a.name == name)
            .map(|a| &a.value)
            .or_else(|| crate::ops::attribute_default(&self.op, name))
    }
}

/// One recompute unit of a model and the half-open marker intervals it resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    pub name: String,
    pub intervals: Vec<MarkerInterval>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkerInterval {
    pub begin: String,
    pub end: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    pub name: String,
    /// The enclosing model of a nested one (an MTP block).
    pub parent: Option<ModelId>,
    pub num_layers: u32,
    /// In declaration order.
    pub units: IdVec<UnitId, Unit>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Metadata {
    pub exporter_version: String,
    pub torch_version: String,
    pub world_size: u32,
    pub rank: u32,
}

/// A validated training graph of one rank. Nodes are in execution order, which is also a
/// topological order of the data dependencies.
#[derive(Debug)]
pub struct Graph {
    pub(crate) name: String,
    pub(crate) fingerprint: String,
    pub(crate) nodes: IdVec<NodeId, Node>,
    pub(crate) values: IdVec<ValueId, Value>,
    pub(crate) models: IdVec<ModelId, Model>,
    pub(crate) outputs: Vec<ValueId>,
    pub(crate) metadata: Metadata,
    pub(crate) producers: IdVec<ValueId, Option<NodeId>>,
    pub(crate) consumers: Consumers,
    pub(crate) storage: Storage,
    /// [`Graph::backward_order`], computed on first use.
    pub(crate) backward_order: std::sync::OnceLock<Vec<NodeId>>,
}

impl Graph {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A stable hash of the graph's canonical encoding (32 hex digits): the same graph has the
    /// same fingerprint whether it was read from `.pb` or `.json`.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Nodes in execution order.
    pub fn nodes(&self) -> &IdVec<NodeId, Node> {
        &self.nodes
    }

    pub fn values(&self) -> &IdVec<ValueId, Value> {
        &self.values
    }

    pub fn models(&self) -> &IdVec<ModelId, Model> {
        &self.models
    }

    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id]
    }

    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id]
    }

    pub fn model(&self, id: ModelId) -> &Model {
        &self.models[id]
    }

    /// The node that produces `value`; `None` for graph inputs.
    pub fn producer(&self, value: ValueId) -> Option<NodeId> {
        self.producers[value]
    }

    /// The nodes that read `value`, in execution order.
    pub fn consumers(&self, value: ValueId) -> &[NodeId] {
        self.consumers.of(value)
    }

    /// Backward nodes in the order to run them: in graph order, except that backward nodes
    /// placed before the end of forward (AOTAutograd's `detach` of saved outputs) run just
    /// before the first later backward node that needs them, or first if none does.
    pub fn backward_order(&self) -> &[NodeId] {
        self.backward_order
            .get_or_init(|| self.compute_backward_order())
    }

    fn compute_backward_order(&self) -> Vec<NodeId> {
        let last_forward = self
            .nodes
            .iter()
            .rev()
            .find(|(_, n)| n.phase == Phase::Forward)
            .map(|(id, _)| id);
        let early = |id: NodeId| last_forward.is_some_and(|f| id < f);
        // For each early backward node, the first late backward node that needs it, directly
        // or through early ones; `None` runs first: needed by no late node, or by an early
        // node that runs first (`None` is the smallest `Option`, so it wins the minimum).
        let mut due: Vec<Option<NodeId>> = vec![None; self.nodes.len()];
        for (id, node) in self.nodes.iter().rev() {
            if node.phase != Phase::Backward || !early(id) {
                continue;
            }
            due[id.index()] = self
                .successors(id)
                .into_iter()
                .filter(|&c| self.nodes[c].phase == Phase::Backward)
                .map(|c| if early(c) { due[c.index()] } else { Some(c) })
                .min()
                .flatten();
        }
        let mut waiting: Vec<(NodeId, NodeId)> = self
            .nodes
            .iter()
            .filter(|(id, n)| n.phase == Phase::Backward && early(*id))
            .filter_map(|(id, _)| due[id.index()].map(|d| (d, id)))
            .collect();
        waiting.sort_unstable();
        let mut order: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(id, n)| n.phase == Phase::Backward && early(*id) && due[id.index()].is_none())
            .map(|(id, _)| id)
            .collect();
        let mut pending = waiting.into_iter().peekable();
        for (id, node) in self.nodes.iter() {
            if node.phase != Phase::Backward || early(id) {
                continue;
            }
            while let Some((_, e)) = pending.next_if(|&(d, _)| d == id) {
                order.push(e);
            }
            order.push(id);
        }
        order
    }

    /// The value whose storage `value` shares: itself unless it is a view, or the result of an
    /// in-place op, of another value (followed to the end of the chain).
    pub fn storage_root(&self, value: ValueId) -> ValueId {
        self.storage.roots[value]
    }

    /// The nodes that write `value`'s storage in place, through `value` or any view or alias
    /// of it, in execution order. Functionalization is off in the exporter, so a later node
    /// may read a written tensor under its old name (or through a view made before the
    /// write): data flow alone does not show that it depends on these writes.
    pub fn storage_writers(&self, value: ValueId) -> &[NodeId] {
        let root = self.storage.roots[value];
        self.storage.writers.get(&root).map_or(&[], Vec::as_slice)
    }

    /// Nodes that read an output of `node` (each once), in execution order.
    pub fn successors(&self, node: NodeId) -> Vec<NodeId> {
        let outputs = self.nodes[node].outputs.iter();
        sorted_unique(outputs.flat_map(|&v| self.consumers(v)).copied().collect())
    }

    pub fn model_by_name(&self, name: &str) -> Option<ModelId> {
        self.models
            .iter()
            .find(|(_, m)| m.name == name)
            .map(|(id, _)| id)
    }

    /// The cost of one execution of `node`, from the op knowledge base.
    pub fn node_cost(&self, node: NodeId) -> crate::ops::Cost {
        let node = &self.nodes[node];
        node.info.cost(
            &self.tensor_refs(&node.inputs),
            &self.tensor_refs(&node.outputs),
        )
    }

    /// The matrix product's sizes of `node`, a matmul op (`None` for any other op).
    pub fn node_matmul_dims(&self, node: NodeId) -> Option<crate::ops::MatmulDims> {
        let node = &self.nodes[node];
        node.info.matmul_dims(&self.tensor_refs(&node.inputs))
    }

    fn tensor_refs(&self, ids: &[ValueId]) -> smallvec::SmallVec<[TensorRef<'_>; 4]> {
        ids.iter().map(|&v| self.values[v].tensor_ref()).collect()
    }
}

fn sorted_unique(mut ids: Vec<NodeId>) -> Vec<NodeId> {
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Which storage each value lives in (its root value), and the nodes writing each storage in
/// place (sparse: few storages are written).
#[derive(Debug, Default)]
pub(crate) struct Storage {
    pub(crate) roots: IdVec<ValueId, ValueId>,
    pub(crate) writers: rustc_hash::FxHashMap<ValueId, Vec<NodeId>>,
}

/// Consumers of every value in one flat array (compressed rows), in execution order.
#[derive(Debug, Default)]
pub(crate) struct Consumers {
    offsets: Vec<usize>,
    flat: Vec<NodeId>,
}

impl Consumers {
    /// Counts each value's readers, lays the rows out by prefix sums and fills them in node
    /// order, then drops repeats in place: two tables the size of the result, nothing more.
    pub(crate) fn build(num_values: usize, nodes: &IdVec<NodeId, Node>) -> Self {
        let mut offsets = vec![0usize; num_values + 1];
        for node in nodes.values() {
            for v in &node.inputs {
                offsets[v.index() + 1] += 1;
            }
        }
        for i in 1..offsets.len() {
            offsets[i] += offsets[i - 1];
        }
        // `offsets[v]` is where v's next reader goes; filled, it is where v's row ends.
        let mut flat = vec![NodeId::from_index(0); offsets[num_values]];
        for (id, node) in nodes.iter() {
            for v in &node.inputs {
                let slot = &mut offsets[v.index()];
                flat[*slot] = id;
                *slot += 1;
            }
        }
        offsets.rotate_right(1);
        offsets[0] = 0;
        let mut consumers = Self { offsets, flat };
        consumers.dedup_rows();
        consumers
    }

    /// A node reading the same value twice (`mul(x, x)`) is listed once: rows are in node
    /// order, so a repeat is next to the first.
    fn dedup_rows(&mut self) {
        let mut kept = 0;
        let mut row_start = 0;
        for v in 0..self.offsets.len() - 1 {
            let row_end = self.offsets[v + 1];
            self.offsets[v] = kept;
            let mut last = None;
            for read in row_start..row_end {
                let node = self.flat[read];
                if last != Some(node) {
                    self.flat[kept] = node;
                    kept += 1;
                    last = Some(node);
                }
            }
            row_start = row_end;
        }
        if let Some(end) = self.offsets.last_mut() {
            *end = kept;
        }
        self.flat.truncate(kept);
    }

    fn of(&self, value: ValueId) -> &[NodeId] {
        let i = value.index();
        &self.flat[self.offsets[i]..self.offsets[i + 1]]
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
