//! FX -> IR without the exporter's Python per node: the op nodes of a captured graph become the
//! IR graph's nodes and values here, read through the C API (fx's `args`/`kwargs` getters and
//! a fake tensor's `shape`/`dtype` are the Python that still runs per node), and the planner
//! plans the message as it is, with nothing encoded or decoded between them.
//!
//! `recompute_planner._exporter.build_graph` declares the graph's inputs, constants and models
//! (a few per parameter) and hands the op nodes over; per op, this module names the op's
//! outputs (folding `getitem` chains into them), splits its arguments into tensor inputs and
//! attributes by the op's schema binding, writes its schema facts and annotations, and
//! declares the values it produces. What it reads of an operator's
//! schema (its name, binding, written and viewed arguments, randomness, collective kind) comes
//! from the exporter once per distinct call shape, so the one place that knows torch's schemas
//! stays in Python.
//!
//! What has no IR form (an argument of no IR form, a symbolic shape, an undeclared model, a
//! bad layer, ...) raises a `ValueError` or `TypeError` naming the node, as the exporter's
//! errors do; an error the exporter's callbacks raise goes through as it is. The Python builder
//! the tests keep (python/tests/python_fx_builder.py) gives the same bytes for every graph,
//! and the same error for every graph the tests break (python/tests test_native_export.py).

use std::{collections::hash_map::Entry, rc::Rc};

use ir::{
    wire::graph::{self as pb, attribute::Value as AttrValue},
    Graph,
};
use prost::Message;
use pyo3::{
    exceptions::{PyRuntimeError, PyTypeError, PyValueError},
    intern,
    prelude::*,
    types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PySet, PyString, PyTuple},
};
use rustc_hash::FxHashMap;

/// How an error names the node it is about: ``node `NAME` (TARGET)``, as the exporter's do.
fn culprit(node: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = node.py();
    Ok(format!(
        "node `{}` ({})",
        node.getattr(intern!(py, "name"))?.str()?,
        node.getattr(intern!(py, "target"))?.str()?
    ))
}

/// The name of `value`'s type, as an error states it.
fn type_name(value: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(value.get_type().name()?.to_string())
}

/// An exported graph built in-process: the `graph.proto` message, held decoded, with the
/// fingerprint of its canonical encoding (computed once, when it is built). The planner plans
/// it without decoding anything; `pb()` writes that encoding.
#[pyclass(frozen, module = "recompute_planner._native")]
pub struct WireGraph {
    wire: pb::Graph,
    fingerprint: String,
}

impl WireGraph {
    fn new(wire: pb::Graph) -> WireGraph {
        let fingerprint = ir::fingerprint(&wire.encode_to_vec());
        WireGraph { wire, fingerprint }
    }

    /// The graph, validated as a `.pb` file of it would be.
    pub fn load(&self) -> Result<Graph, ir::ValidationError> {
        Graph::from_wire_encoded(&self.wire, self.fingerprint.clone())
    }
}

#[pymethods]
impl WireGraph {
    /// The canonical `graph.proto` encoding (what `SerializeToString(deterministic=True)` of
    /// the Python message writes), encoded with the GIL released.
    fn pb<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let bytes = py.detach(|| self.wire.encode_to_vec());
        PyBytes::new(py, &bytes)
    }

    #[getter]
    fn name(&self) -> &str {
        &self.wire.name
    }
}

/// Where a bound argument's value is: its index in `node.args`, a keyword, or a tensor
/// argument left out (the exporter's `_KEYWORD` and `_ABSENT_TENSOR`).
#[derive(Clone, Copy)]
enum ArgSource {
    Positional(usize),
    Keyword,
    AbsentTensor,
}

/// One schema argument a call passes (the exporter's `_BoundArgument`).
struct BoundArgument {
    name: Py<PyString>,
    name_text: String,
    source: ArgSource,
    is_tensor: bool,
    positioned: bool,
}

/// What the exporter answers for a call shape (`_exporter._call_binding`): op name,
/// randomness, collective kind, written arguments, viewed argument, and per bound argument its
/// name, source, whether it is a tensor and whether the schema facts read its positions.
type BindingAnswer<'py> = (
    String,
    bool,
    i32,
    Vec<String>,
    Option<String>,
    Vec<(Bound<'py, PyString>, isize, bool, bool)>,
);

/// An op's facts and the binding of one call shape of it (the exporter's `_OpFacts` and
/// `_binding`).
struct Binding {
    op: String,
    random: bool,
    collective: i32,
    written: Vec<String>,
    view_of: Option<String>,
    arguments: Vec<BoundArgument>,
}

impl Binding {
    fn read(answer: &Bound<'_, PyAny>) -> PyResult<Binding> {
        let (op, random, collective, written, view_of, arguments): BindingAnswer<'_> =
            answer.extract()?;
        let arguments = arguments
            .into_iter()
            .map(|(name, source, is_tensor, positioned)| {
                let source = match source {
                    -1 => ArgSource::Keyword,
                    -2 => ArgSource::AbsentTensor,
                    index => ArgSource::Positional(usize::try_from(index).map_err(|_| {
                        PyRuntimeError::new_err(format!(
                            "the exporter's binding gave argument source {index}"
                        ))
                    })?),
                };
                Ok(BoundArgument {
                    name_text: name.to_str()?.to_owned(),
                    name: name.unbind(),
                    source,
                    is_tensor,
                    positioned,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Binding {
            op,
            random,
            collective,
            written,
            view_of,
            arguments,
        })
    }
}

/// The call shape a binding depends on: the target, what the exporter marked it written as,
/// the count of positional arguments and the keyword names (objects compared by identity:
/// they live as long as the graph, which outlives the build).
#[derive(PartialEq, Eq, Hash)]
struct CallShape {
    target: usize,
    written_as: usize,
    positional: usize,
    keywords: smallvec::SmallVec<[usize; 4]>,
}

/// What the exporter hands over once per build: its constants and callbacks.
struct Context<'py> {
    forward: Bound<'py, PySet>,
    dtypes: Bound<'py, PyDict>,
    tensor_type: Bound<'py, PyAny>,
    node_type: Bound<'py, PyAny>,
    /// torch.dtype, torch.device, torch.layout, torch.memory_format: attributes as `str()`.
    named_types: Bound<'py, PyAny>,
    getitem: Bound<'py, PyAny>,
    /// `fx.Node -> (op, random, collective, written, view_of, binding)`.
    binding_of: Bound<'py, PyAny>,
    /// `(node, get_attr node) -> qualified TorchBind type name`.
    script_object_type: Bound<'py, PyAny>,
    /// `str -> list[str]`: the exporter's stack-trace trimming, for traces that are not ASCII.
    trim_stack_trace: Bound<'py, PyAny>,
    stack_trace_frames: usize,
    written_as_key: Bound<'py, PyString>,
    model_key: Bound<'py, PyString>,
    micro_batch_key: Bound<'py, PyString>,
    compiled_region_key: Bound<'py, PyString>,
    module_path_key: Bound<'py, PyString>,
    layer_key: Bound<'py, PyString>,
    absent_tensor_args: String,
    /// Declared models: name -> layers.
    models: FxHashMap<String, u32>,
    default_model: String,
}

impl<'py> Context<'py> {
    fn read(context: &Bound<'py, PyAny>, forward: Bound<'py, PySet>) -> PyResult<Context<'py>> {
        let get = |name: &str| context.getattr(name);
        let key = |name: &str| -> PyResult<Bound<'py, PyString>> { Ok(get(name)?.cast_into()?) };
        Ok(Context {
            forward,
            dtypes: get("dtypes")?.cast_into()?,
            tensor_type: get("tensor_type")?,
            node_type: get("node_type")?,
            named_types: get("named_types")?,
            getitem: get("getitem")?,
            binding_of: get("binding_of")?,
            script_object_type: get("script_object_type")?,
            trim_stack_trace: get("trim_stack_trace")?,
            stack_trace_frames: get("stack_trace_frames")?.extract()?,
            written_as_key: key("written_as_key")?,
            model_key: key("model_key")?,
            micro_batch_key: key("micro_batch_key")?,
            compiled_region_key: key("compiled_region_key")?,
            module_path_key: key("module_path_key")?,
            layer_key: key("layer_key")?,
            absent_tensor_args: get("absent_tensor_args")?.extract()?,
            models: get("models")?.extract()?,
            default_model: get("default_model")?.extract()?,
        })
    }
}

/// The value names of the FX nodes converted so far (the test oracle's `ValueNames`), keyed by
/// node identity.
#[derive(Default)]
struct Names(FxHashMap<usize, Vec<String>>);

impl Names {
    /// The names of the graph's inputs and constants, by node.
    fn of_inputs(inputs: &Bound<'_, PyDict>) -> PyResult<Names> {
        let mut names = Names::default();
        for (node, name) in inputs.iter() {
            names
                .0
                .insert(node.as_ptr() as usize, vec![name.extract()?]);
        }
        Ok(names)
    }

    fn of(&self, node: &Bound<'_, PyAny>) -> PyResult<&[String]> {
        match self.0.get(&(node.as_ptr() as usize)) {
            Some(names) => Ok(names),
            None => Err(read_before_produced(node)?),
        }
    }
}

/// The error of a node read before a node produces it (or of an output that is no node).
fn read_before_produced(node: &Bound<'_, PyAny>) -> PyResult<PyErr> {
    let py = node.py();
    let (Ok(name), Ok(op), Ok(target)) = (
        node.getattr(intern!(py, "name")),
        node.getattr(intern!(py, "op")),
        node.getattr(intern!(py, "target")),
    ) else {
        return Ok(PyTypeError::new_err(format!(
            "the graph reads {} ({}), which is no node",
            node.repr()?,
            type_name(node)?
        )));
    };
    Ok(PyValueError::new_err(format!(
        "`{}` ({} {}) is read before it is produced",
        name.str()?,
        op.str()?,
        target.str()?
    )))
}

/// The builder: the graph so far and what it knows of the FX graph.
struct Builder<'py> {
    py: Python<'py>,
    cx: Context<'py>,
    names: Names,
    bindings: FxHashMap<CallShape, Rc<Binding>>,
    graph: pb::Graph,
}

impl<'py> Builder<'py> {
    /// The graph with its loss marked and its outputs listed (each output node's value names,
    /// with the flat input index its gradient belongs to); two values of one name are an
    /// error.
    fn finish(
        self,
        loss: &Bound<'py, PyAny>,
        outputs: OutputNodes<'py>,
    ) -> PyResult<(pb::Graph, ListedOutputs)> {
        let loss_names = self.names.of(loss)?;
        let mut listed = Vec::new();
        for (node, index) in outputs {
            let names = self.names.of(&node)?;
            listed.extend(names.iter().map(|n| (n.clone(), index)));
        }
        let mut graph = self.graph;
        for value in &mut graph.values {
            if loss_names.contains(&value.name) {
                value.role = pb::Role::Loss as i32;
            }
        }
        graph.outputs = listed.iter().map(|(n, _)| n.clone()).collect();
        let mut seen = rustc_hash::FxHashSet::default();
        if let Some(twice) = graph.values.iter().find(|v| !seen.insert(v.name.as_str())) {
            return Err(PyValueError::new_err(format!(
                "two IR values are named `{}` (a parameter or buffer name clashes with a graph \
                 node name)",
                twice.name
            )));
        }
        Ok((graph, listed))
    }

    /// Converts one op node: names its outputs, then adds its IR node and the values it
    /// produces (activations in forward, gradients in backward).
    fn add_op(&mut self, node: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = self.py;
        let name: String = node.getattr(intern!(py, "name"))?.extract()?;
        let meta: Bound<'py, PyDict> = node.getattr(intern!(py, "meta"))?.cast_into()?;
        let val = meta.get_item(intern!(py, "val"))?;
        let produced = self.name_outputs(node, &name, val.as_ref())?;
        let is_forward = self.cx.forward.contains(node)?;
        let ir_node = self.node(node, name, &meta, is_forward)?;
        self.graph.nodes.push(ir_node);
        let role = if is_forward {
            pb::Role::Activation
        } else {
            pb::Role::Gradient
        };
        for (value, tensor) in produced {
            let value = self.value(node, value, &tensor, role)?;
            self.graph.values.push(value);
        }
        Ok(())
    }

    /// Names the node's output slots; returns (name, fake tensor) per slot, in order. A
    /// `getitem` chain reading a slot (or a list of slots: `c10d` ops return `(Tensor[],
    /// Work)`) stands for it.
    fn name_outputs(
        &mut self,
        node: &Bound<'py, PyAny>,
        name: &str,
        val: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
        let key = node.as_ptr() as usize;
        let tensor = match val {
            Some(v) if v.is_instance(&self.cx.tensor_type)? => Some(v),
            _ => None,
        };
        if let Some(val) = tensor {
            self.names.0.insert(key, vec![name.to_owned()]);
            return Ok(vec![(name.to_owned(), val.clone())]);
        }
        let mut readers = Vec::new();
        self.getitems(node, &mut Vec::new(), &mut readers)?;
        let mut leaves = Vec::new();
        if let Some(val) = val {
            self.tensor_leaves(val, &mut Vec::new(), &mut leaves)?;
        }
        let slots: Vec<(Vec<i64>, String, Bound<'py, PyAny>)> = leaves
            .into_iter()
            .enumerate()
            .map(|(index, (path, leaf))| {
                let reader = readers.iter().find(|(_, p)| *p == path);
                let slot = match reader {
                    Some((reader, _)) => reader.getattr(intern!(self.py, "name"))?.extract()?,
                    None if path.is_empty() => name.to_owned(),
                    None => format!("{name}.out{index}"),
                };
                Ok((path, slot, leaf))
            })
            .collect::<PyResult<_>>()?;
        self.names
            .0
            .insert(key, slots.iter().map(|(_, n, _)| n.clone()).collect());
        for (reader, prefix) in &readers {
            let under = slots
                .iter()
                .filter(|(path, _, _)| path.starts_with(prefix))
                .map(|(_, n, _)| n.clone())
                .collect();
            self.names.0.insert(reader.as_ptr() as usize, under);
        }
        Ok(slots.into_iter().map(|(_, n, v)| (n, v)).collect())
    }

    /// Every `getitem` node reading (transitively) from `node`, with its index path, in the
    /// order of the users.
    fn getitems(
        &self,
        node: &Bound<'py, PyAny>,
        prefix: &mut Vec<i64>,
        out: &mut Vec<(Bound<'py, PyAny>, Vec<i64>)>,
    ) -> PyResult<()> {
        let users: Bound<'py, PyDict> = node.getattr(intern!(self.py, "users"))?.cast_into()?;
        for user in users.keys() {
            if !self.is_getitem(&user)? {
                continue;
            }
            let args: Bound<'py, PyTuple> = user.getattr(intern!(self.py, "args"))?.cast_into()?;
            let index = args.get_item(1)?;
            if !index.is_instance_of::<PyInt>() {
                return Err(PyTypeError::new_err(format!(
                    "{}: index {} is not an int",
                    culprit(&user)?,
                    index.repr()?
                )));
            }
            prefix.push(index.extract()?);
            out.push((user.clone(), prefix.clone()));
            self.getitems(&user, prefix, out)?;
            prefix.pop();
        }
        Ok(())
    }

    fn is_getitem(&self, node: &Bound<'py, PyAny>) -> PyResult<bool> {
        Ok(node.getattr(intern!(self.py, "op"))?.eq("call_function")?
            && node
                .getattr(intern!(self.py, "target"))?
                .is(&self.cx.getitem))
    }

    /// Tensor leaves of an op result with their index paths; None and non-tensors skipped.
    fn tensor_leaves(
        &self,
        val: &Bound<'py, PyAny>,
        path: &mut Vec<i64>,
        out: &mut Vec<(Vec<i64>, Bound<'py, PyAny>)>,
    ) -> PyResult<()> {
        if val.is_instance(&self.cx.tensor_type)? {
            out.push((path.clone(), val.clone()));
        } else if val.is_instance_of::<PyTuple>() || val.is_instance_of::<PyList>() {
            for (i, item) in val.try_iter()?.enumerate() {
                path.push(i as i64);
                self.tensor_leaves(&item?, path, out)?;
                path.pop();
            }
        }
        Ok(())
    }

    /// The IR node of `node` (the test oracle's `node_fields`).
    fn node(
        &mut self,
        node: &Bound<'py, PyAny>,
        name: String,
        meta: &Bound<'py, PyDict>,
        is_forward: bool,
    ) -> PyResult<pb::Node> {
        let py = self.py;
        let args: Bound<'py, PyTuple> = node.getattr(intern!(py, "args"))?.cast_into()?;
        let kwargs: Bound<'py, PyDict> = node.getattr(intern!(py, "kwargs"))?.cast_into()?;
        let b = binding(&self.cx, &mut self.bindings, node, meta, &args, &kwargs)?;
        let mut inputs = Vec::new();
        let mut positions: Vec<(&str, std::ops::Range<u32>)> = Vec::new();
        let mut attributes = Vec::new();
        let mut absent = Vec::new();
        for argument in &b.arguments {
            let arg_text = &argument.name_text;
            let value = match argument.source {
                ArgSource::Positional(i) => Some(args.get_item(i)?),
                ArgSource::Keyword => kwargs.get_item(argument.name.bind(py))?,
                ArgSource::AbsentTensor => None,
            };
            let value = value.filter(|v| !v.is_none());
            let scalar = value.as_ref().is_some_and(|v| {
                v.is_instance_of::<PyBool>()
                    || v.is_instance_of::<PyInt>()
                    || v.is_instance_of::<PyFloat>()
            });
            if !argument.is_tensor || scalar {
                if let Some(value) = value {
                    attributes.push(self.attribute(node, arg_text, &value)?);
                }
                continue;
            }
            let start = inputs.len() as u32;
            match value {
                Some(v) if v.is_instance(&self.cx.node_type)? => {
                    inputs.extend_from_slice(self.names.of(&v)?);
                }
                Some(v) if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() => {
                    for (slot, item) in v.try_iter()?.enumerate() {
                        let item = item?;
                        if item.is_none() {
                            absent.push(format!("{arg_text}.{slot}"));
                        } else if item.is_instance(&self.cx.node_type)? {
                            inputs.extend_from_slice(self.names.of(&item)?);
                        } else {
                            return Err(holds_a_constant(node, arg_text, &item)?);
                        }
                    }
                }
                Some(v) => return Err(holds_a_constant(node, arg_text, &v)?),
                None => absent.push(arg_text.clone()),
            }
            if argument.positioned {
                positions.push((arg_text.as_str(), start..inputs.len() as u32));
            }
        }
        if !absent.is_empty() {
            attributes.push(pb::Attribute {
                name: self.cx.absent_tensor_args.clone(),
                value: Some(AttrValue::Strs(pb::StringList { values: absent })),
            });
        }
        let at = |arg: &str| positions.iter().find(|(n, _)| *n == arg).map(|(_, r)| r);
        let written = b.written.iter().filter_map(|w| at(w));
        let mut mutates: Vec<u32> = written.flat_map(Clone::clone).collect();
        mutates.sort_unstable();
        let schema = pb::SchemaFacts {
            mutates,
            view_of: b
                .view_of
                .as_deref()
                .and_then(at)
                .and_then(|r| r.clone().next()),
            random: b.random,
            collective: b.collective,
        };
        let outputs = self.names.of(node)?.to_vec();
        let mut ir_node = pb::Node {
            name,
            op: b.op.clone(),
            inputs,
            outputs,
            attributes,
            phase: if is_forward {
                pb::Phase::Forward
            } else {
                pb::Phase::Backward
            } as i32,
            schema: Some(schema),
            ..pb::Node::default()
        };
        self.annotate(&mut ir_node, node, meta)?;
        ir_node.stack_trace = self.stack_trace(node, meta)?;
        Ok(ir_node)
    }

    /// Model, layer, micro-batch, compiled region and module path from `meta["custom"]` (a key
    /// set to None is as if absent, but for the model).
    fn annotate(
        &self,
        ir_node: &mut pb::Node,
        node: &Bound<'py, PyAny>,
        meta: &Bound<'py, PyDict>,
    ) -> PyResult<()> {
        let custom = meta
            .get_item(intern!(self.py, "custom"))?
            .map(|c| c.is_truthy().map(|truthy| truthy.then_some(c)))
            .transpose()?
            .flatten();
        let Some(custom) = custom else {
            ir_node.model = self.cx.default_model.clone();
            return Ok(());
        };
        let custom: Bound<'py, PyDict> = match custom.cast_into() {
            Ok(custom) => custom,
            Err(e) => {
                return Err(PyTypeError::new_err(format!(
                    "{}: its annotations (meta[\"custom\"]) are a {}, not a dict",
                    culprit(node)?,
                    type_name(&e.into_inner())?
                )))
            }
        };
        let field = |key: &Bound<'py, PyString>| -> PyResult<Option<Bound<'py, PyAny>>> {
            Ok(custom.get_item(key)?.filter(|v| !v.is_none()))
        };
        let text = |key: &Bound<'py, PyString>| -> PyResult<String> {
            let Some(value) = field(key)? else {
                return Ok(String::new());
            };
            value.extract().map_err(|_| {
                culprit(node).map_or_else(
                    |e| e,
                    |culprit| {
                        let value = value.repr().map_or_else(|_| "?".into(), |r| r.to_string());
                        PyTypeError::new_err(format!(
                            "{culprit}: annotation `{key}` = {value} is not a str"
                        ))
                    },
                )
            })
        };
        // A model set to None is an undeclared model, not the default one: a node must not
        // silently join another model's layers.
        let model_field = custom.get_item(&self.cx.model_key)?;
        let model = match &model_field {
            Some(m) => m.str()?.to_str()?.to_owned(),
            None => self.cx.default_model.clone(),
        };
        let declared = model_field.is_none_or(|m| m.is_instance_of::<PyString>());
        let Some(&layers) = self.cx.models.get(&model).filter(|_| declared) else {
            return Err(PyValueError::new_err(format!(
                "{} belongs to undeclared model `{model}`",
                culprit(node)?
            )));
        };
        ir_node.micro_batch = match field(&self.cx.micro_batch_key)? {
            Some(m) => index(&m).ok_or_else(|| -> PyErr {
                match (culprit(node), m.repr()) {
                    (Ok(culprit), Ok(m)) => PyValueError::new_err(format!(
                        "{culprit}: micro-batch {m} is not an int from 0 to {}",
                        u32::MAX
                    )),
                    (Err(e), _) | (_, Err(e)) => e,
                }
            })?,
            None => 0,
        };
        ir_node.compiled_region = text(&self.cx.compiled_region_key)?;
        ir_node.module_path = text(&self.cx.module_path_key)?;
        if let Some(layer) = field(&self.cx.layer_key)? {
            if !layer.is_instance_of::<PyInt>() || layer.is_instance_of::<PyBool>() {
                return Err(PyTypeError::new_err(format!(
                    "{}: layer {} is not an int",
                    culprit(node)?,
                    layer.repr()?
                )));
            }
            match index(&layer).filter(|&l| l < layers) {
                Some(layer) => ir_node.layer = Some(layer),
                None => {
                    return Err(PyValueError::new_err(format!(
                        "{} is in layer {layer} of model `{model}`, which declares {layers} layers",
                        culprit(node)?
                    )))
                }
            }
        }
        ir_node.model = model;
        Ok(())
    }

    /// The innermost frames of the node's stack trace (Dynamo-traced graphs carry one).
    fn stack_trace(
        &self,
        node: &Bound<'py, PyAny>,
        meta: &Bound<'py, PyDict>,
    ) -> PyResult<Vec<String>> {
        let trace = meta.get_item(intern!(self.py, "stack_trace"))?;
        let trace = trace.map(|t| t.is_truthy().map(|truthy| truthy.then_some(t)));
        let Some(trace) = trace.transpose()?.flatten() else {
            return Ok(Vec::new());
        };
        if !trace.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!(
                "{}: its stack trace (meta[\"stack_trace\"]) is a {}, not a str",
                culprit(node)?,
                type_name(&trace)?
            )));
        }
        let text = trace.str()?;
        let text = text.to_str()?;
        if text.is_ascii() {
            return Ok(trim_ascii_stack_trace(text, self.cx.stack_trace_frames));
        }
        self.cx.trim_stack_trace.call1((text,))?.extract()
    }

    /// A non-tensor argument as an IR attribute (the test oracle's `_attribute`).
    fn attribute(
        &self,
        node: &Bound<'py, PyAny>,
        name: &str,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<pb::Attribute> {
        let value = if value.is_instance_of::<PyBool>() {
            AttrValue::Bool(value.extract()?)
        } else if value.is_instance_of::<PyInt>() {
            AttrValue::Int(value.extract().map_err(|_| -> PyErr {
                match culprit(node) {
                    Ok(culprit) => PyValueError::new_err(format!(
                        "{culprit}: argument `{name}` = {value} does not fit a 64-bit int"
                    )),
                    Err(e) => e,
                }
            })?)
        } else if value.is_instance_of::<PyFloat>() {
            AttrValue::Float(value.extract()?)
        } else if value.is_instance_of::<PyString>() {
            AttrValue::Str(value.extract()?)
        } else if value.is_instance(&self.cx.named_types)? {
            AttrValue::Str(value.str()?.to_str()?.to_owned())
        } else if value.is_instance(&self.cx.node_type)?
            && value.getattr(intern!(self.py, "op"))?.eq("get_attr")?
        {
            AttrValue::Str(self.cx.script_object_type.call1((node, value))?.extract()?)
        } else if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
            match list_attribute(value) {
                Some(list) => list,
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "{}: list argument `{name}` = {} has no IR attribute form (symbolic \
                         sizes are not supported)",
                        culprit(node)?,
                        PyList::new(self.py, value.try_iter()?.collect::<PyResult<Vec<_>>>()?)?
                            .repr()?
                    )))
                }
            }
        } else {
            return Err(PyTypeError::new_err(format!(
                "{}: argument `{name}` = {} ({}) has no IR attribute form",
                culprit(node)?,
                value.repr()?,
                type_name(value)?
            )));
        };
        Ok(pb::Attribute {
            name: name.to_owned(),
            value: Some(value),
        })
    }

    /// A value `node` produces, with dtype and static shape from its fake tensor (a tensor
    /// leaf).
    fn value(
        &self,
        node: &Bound<'py, PyAny>,
        name: String,
        tensor: &Bound<'py, PyAny>,
        role: pb::Role,
    ) -> PyResult<pb::Value> {
        let py = self.py;
        let dtype = tensor.getattr(intern!(py, "dtype"))?;
        let dtype: i32 = match self.cx.dtypes.get_item(&dtype)? {
            Some(d) => d.extract()?,
            None => {
                return Err(PyValueError::new_err(format!(
                    "{}: dtype {} of `{name}` has no IR dtype",
                    culprit(node)?,
                    dtype.str()?
                )))
            }
        };
        let sizes = tensor.getattr(intern!(py, "shape"))?;
        let shape = sizes
            .try_iter()?
            .map(|size| {
                let size = size?;
                if !size.is_exact_instance_of::<PyInt>() {
                    return Ok(None);
                }
                size.extract::<i64>().map(Some)
            })
            .collect::<PyResult<Option<Vec<i64>>>>()?;
        let Some(shape) = shape else {
            return Err(PyValueError::new_err(format!(
                "{}: `{name}` has symbolic shape {}; export with static shapes",
                culprit(node)?,
                PyTuple::new(py, sizes.try_iter()?.collect::<PyResult<Vec<_>>>()?)?.str()?
            )));
        };
        Ok(pb::Value {
            name,
            dtype,
            shape,
            role: role as i32,
        })
    }
}

/// The binding of the node's call shape, asked of the exporter on first sight.
fn binding<'py>(
    cx: &Context<'py>,
    bindings: &mut FxHashMap<CallShape, Rc<Binding>>,
    node: &Bound<'py, PyAny>,
    meta: &Bound<'py, PyDict>,
    args: &Bound<'py, PyTuple>,
    kwargs: &Bound<'py, PyDict>,
) -> PyResult<Rc<Binding>> {
    let py = node.py();
    let target = node.getattr(intern!(py, "target"))?;
    let written_as = meta.get_item(&cx.written_as_key)?;
    let shape = CallShape {
        target: target.as_ptr() as usize,
        written_as: written_as.map_or(0, |w| w.as_ptr() as usize),
        positional: args.len(),
        keywords: kwargs.keys().iter().map(|k| k.as_ptr() as usize).collect(),
    };
    Ok(match bindings.entry(shape) {
        Entry::Occupied(known) => Rc::clone(known.get()),
        Entry::Vacant(new) => {
            let answer = cx.binding_of.call1((node,))?;
            Rc::clone(new.insert(Rc::new(Binding::read(&answer)?)))
        }
    })
}

/// The error of a tensor argument of `node` holding `item`, which is no node.
fn holds_a_constant(
    node: &Bound<'_, PyAny>,
    argument: &str,
    item: &Bound<'_, PyAny>,
) -> PyResult<PyErr> {
    Ok(PyTypeError::new_err(format!(
        "{}: tensor argument `{argument}` holds a constant {}",
        culprit(node)?,
        type_name(item)?
    )))
}

/// A micro-batch or layer index: an int (not a bool) that fits a `u32`.
fn index(value: &Bound<'_, PyAny>) -> Option<u32> {
    if value.is_instance_of::<PyBool>() {
        return None;
    }
    value.extract().ok()
}

/// Ints (bools as 0/1), floats (ints widened when mixed) or strings by the exact types of the
/// items; an empty list is ints. None for any other mix.
fn list_attribute(values: &Bound<'_, PyAny>) -> Option<AttrValue> {
    let items: Vec<Bound<'_, PyAny>> = values.try_iter().ok()?.collect::<PyResult<_>>().ok()?;
    let all = |f: &dyn Fn(&Bound<'_, PyAny>) -> bool| items.iter().all(f);
    let int = |v: &Bound<'_, PyAny>| v.is_exact_instance_of::<PyInt>();
    let int_like = |v: &Bound<'_, PyAny>| v.is_exact_instance_of::<PyBool>() || int(v);
    if all(&int_like) {
        let ints = items.iter().map(|v| v.extract::<i64>().ok());
        return Some(AttrValue::Ints(pb::IntList {
            values: ints.collect::<Option<_>>()?,
        }));
    }
    if all(&|v| int(v) || v.is_exact_instance_of::<PyFloat>()) {
        let floats = items.iter().map(|v| v.extract::<f64>().ok());
        return Some(AttrValue::Floats(pb::FloatList {
            values: floats.collect::<Option<_>>()?,
        }));
    }
    if all(&|v| v.is_exact_instance_of::<PyString>()) {
        let strs = items.iter().map(|v| v.extract::<String>().ok());
        return Some(AttrValue::Strs(pb::StringList {
            values: strs.collect::<Option<_>>()?,
        }));
    }
    None
}

/// The exporter's `trim_stack_trace` for an ASCII trace: its non-blank lines, stripped, from
/// the start of the innermost `frames` frames (a frame starts at `File "...`). Python's
/// `splitlines` and `strip` on ASCII text split at `\n`, `\r`, `\r\n`, `\v`, `\f` and
/// `\x1c`-`\x1e`, and strip those, `\t`, `\x1f` and spaces.
fn trim_ascii_stack_trace(trace: &str, frames: usize) -> Vec<String> {
    const SEPARATORS: &[char] = &['\n', '\r', '\x0b', '\x0c', '\x1c', '\x1d', '\x1e'];
    let blank = |c: char| {
        matches!(
            c,
            ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c' | '\x1c'..='\x1f'
        )
    };
    let lines: Vec<&str> = trace
        .split(SEPARATORS)
        .map(|line| line.trim_matches(blank))
        .filter(|line| !line.is_empty())
        .collect();
    let starts: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, line)| line.starts_with("File \""))
        .map(|(i, _)| i)
        .collect();
    let from = match starts.len() {
        0 => 0,
        n if n <= frames || frames == 0 => starts[0],
        n => starts[n - frames],
    };
    lines[from..].iter().map(|&l| l.to_owned()).collect()
}

/// Each output's value name, with the flat input index its gradient belongs to.
type ListedOutputs = Vec<(String, Option<i64>)>;

/// Each output node, with the flat input index its gradient belongs to.
type OutputNodes<'py> = Vec<(Bound<'py, PyAny>, Option<i64>)>;

/// Converts the op nodes of a captured graph (joint or forward) into the IR graph `header`
/// (its name, metadata, models, inputs and constants, encoded), then marks the loss and lists
/// the outputs.
///
/// `inputs` maps each placeholder and constant node to its value name; `forward` holds the
/// forward op nodes; `loss_and_outputs`, called once the op nodes are converted (so that a
/// node's error comes before an error of the graph's outputs), returns the loss node and the
/// output nodes, each with the flat input index its gradient belongs to (None for the loss and
/// the other outputs). Returns the graph and its outputs' value names with those indices.
/// What has no IR form is a `ValueError` or `TypeError` naming the node; what the exporter's
/// callbacks raise goes through.
#[pyfunction]
#[pyo3(signature = (*, header, inputs, ops, forward, loss_and_outputs, context))]
pub fn build_fx_graph<'py>(
    py: Python<'py>,
    header: &[u8],
    inputs: Bound<'py, PyDict>,
    ops: Bound<'py, PyList>,
    forward: Bound<'py, PySet>,
    loss_and_outputs: Bound<'py, PyAny>,
    context: Bound<'py, PyAny>,
) -> PyResult<(WireGraph, ListedOutputs)> {
    let graph = pb::Graph::decode(header)
        .map_err(|e| PyValueError::new_err(format!("the graph's header does not decode: {e}")))?;
    let mut builder = Builder {
        py,
        cx: Context::read(&context, forward)?,
        names: Names::of_inputs(&inputs)?,
        bindings: FxHashMap::default(),
        graph,
    };
    for node in ops.iter() {
        builder.add_op(&node)?;
    }
    let (loss, outputs): (Bound<'py, PyAny>, OutputNodes<'py>) =
        loss_and_outputs.call0()?.extract()?;
    let (graph, listed) = builder.finish(&loss, outputs)?;
    Ok((py.detach(|| WireGraph::new(graph)), listed))
}
