"""The native FX -> IR builder (``_native.build_fx_graph``) against the Python builder the
tests keep as its reference (python_fx_builder.py): the same graph built both ways gives the
same bytes, and a broken graph the same error.

Whole exports are compared in the golden, compile-stage and HF tests that use the
``builders_agree`` fixture (conftest.py); here, call shapes and node metadata one graph at a
time, what has no IR form, and planning a built graph.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.fx as fx

import python_fx_builder
import recompute_planner as rp
from export_support import MAIN, Lambda
from recompute_planner import _exporter, _native, markers
from recompute_planner.proto import graph_pb2

aten = torch.ops.aten
MODELS = [
    _exporter.ModelDecl("m", num_layers=2, units={}),
    _exporter.ModelDecl("draft", num_layers=1, units={}),
]


class Calls:
    """A hand-made FX graph of op calls on float inputs ``x`` (4 x 6) and ``src`` (2 x 6),
    and a long ``idx`` (2), each call's ``meta["val"]`` computed by running it."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.inputs = {}
        for name, tensor in [("x", torch.zeros(4, 6)), ("src", torch.zeros(2, 6)),
                             ("idx", torch.tensor([0, 1]))]:
            node = self.graph.placeholder(name)
            node.meta["val"] = tensor
            self.inputs[name] = node
        self.ops: list[fx.Node] = []

    def call(self, target, *args, meta=None, **kwargs) -> fx.Node:
        args = tuple(self._node_of(a) for a in args)
        kwargs = {name: self._node_of(a) for name, a in kwargs.items()}
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = target(*map(_value_of, args), **{
            k: _value_of(v) for k, v in kwargs.items()})
        node.meta.update(meta or {})
        if target is not operator.getitem:
            self.ops.append(node)
        return node

    def _node_of(self, arg):
        """An input's node for its name, in lists too."""
        if isinstance(arg, list):
            return [self._node_of(a) for a in arg]
        return self.inputs[arg] if isinstance(arg, str) and arg in self.inputs else arg

    def header(self) -> graph_pb2.Graph:
        graph = graph_pb2.Graph(name="calls")
        graph.models.extend(_exporter._model_proto(m) for m in MODELS)
        for name, node in self.inputs.items():
            graph.values.add(**_exporter._value_fields(name, node.meta["val"],
                                                        graph_pb2.ROLE_INPUT, node))
        return graph

    def both_ways(self, forward: set[fx.Node] | None = None) -> tuple[bytes, bytes]:
        """The graph's bytes from the native builder and from the Python builder."""
        return self.natively(forward), self.in_python(forward)

    def natively(self, forward: set[fx.Node] | None = None) -> bytes:
        loss = self.ops[-1]
        wire, _ = _native.build_fx_graph(
            header=self.header().SerializeToString(deterministic=True),
            inputs=self._input_names(), ops=self.ops, forward=self._forward(forward),
            loss_and_outputs=lambda: (loss, [(loss, None)]),
            context=_exporter._native_context(MODELS),
        )
        return wire.pb()

    def in_python(self, forward: set[fx.Node] | None = None) -> bytes:
        loss = self.ops[-1]
        graph, _ = python_fx_builder.build_fx_graph(
            header=self.header().SerializeToString(deterministic=True),
            inputs=self._input_names(), ops=self.ops, forward=self._forward(forward),
            loss_and_outputs=lambda: (loss, [(loss, None)]), models=MODELS,
        )
        return graph.SerializeToString(deterministic=True)

    def _input_names(self) -> dict[fx.Node, str]:
        return {node: name for name, node in self.inputs.items()}

    def _forward(self, forward: set[fx.Node] | None) -> set[fx.Node]:
        return set(self.ops) if forward is None else forward


def _value_of(arg):
    """What a call runs on: each node's value, in plain lists."""
    if isinstance(arg, (list, tuple)):
        return [_value_of(a) for a in arg]
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def assert_same_bytes(calls: Calls, forward: set[fx.Node] | None = None) -> None:
    native, python = calls.both_ways(forward)
    assert graph_pb2.Graph.FromString(native) == graph_pb2.Graph.FromString(python)
    assert native == python


def test_argument_layouts_attributes_and_tensor_lists_map_alike():
    calls = Calls()
    total = aten.sum.dim_IntList
    calls.call(total, "x", [0])
    calls.call(total, "x", [0], True)
    calls.call(total, "x", [1], keepdim=True, dtype=torch.float64)
    calls.call(total, "x", [])  # an empty list is ints
    calls.call(aten.add.Tensor, "x", 1)  # a wrapped scalar is an attribute
    calls.call(aten.add.Tensor, "x", 0.5, alpha=2)
    calls.call(aten.div.Tensor_mode, "x", "x", rounding_mode="floor")
    calls.call(aten.cat.default, ["x", "src"])
    calls.call(aten.index.Tensor, "x", [None, "idx"])  # an absent tensor in a list
    calls.call(aten.full.default, [2, 3], 1.5, dtype=torch.float32, layout=torch.strided,
               device=torch.device("cpu"), pin_memory=False)
    image = calls.call(aten.view.default, "x", [1, 1, 4, 6])
    calls.call(aten.upsample_bilinear2d.vec, image, None, False, [2, 1.5])  # ints and floats
    calls.call(aten.clamp.Tensor, "x", max="x")  # a tensor argument left out: `min`
    calls.call(aten._foreach_add_.Scalar, ["x", "src"], 1.0)  # writes two inputs, no result
    calls.call(aten.mul.Tensor, "x", "x")
    assert_same_bytes(calls)


@pytest.mark.parametrize("write_back_first", [True, False])
def test_a_write_back_and_a_plain_call_of_one_op_keep_their_own_facts(write_back_first):
    """The native builder asks for an op's facts once per call shape, and what the exporter
    marked a call as written as is part of the shape."""
    calls = Calls()
    write_back = {_exporter.WRITTEN_AS_KEY: _exporter.WRITE_BACK_VIEW}
    for meta in [write_back, None] if write_back_first else [None, write_back]:
        calls.call(aten.slice_scatter.default, "x", "src", 0, 0, 2, meta=meta)
    calls.call(aten.add_.Tensor, "x", "x")  # a write: its schema facts name what it mutates
    assert_same_bytes(calls)


def test_multiple_outputs_are_named_by_their_getitems_or_numbered():
    calls = Calls()
    parts = calls.call(aten.split.Tensor, "x", 2)
    second = calls.call(operator.getitem, parts, 1)  # slot 0 is read by nothing
    stats = calls.call(aten.var_mean.correction, "x", [1])
    calls.call(operator.getitem, stats, 0)
    calls.call(aten.add.Tensor, second, second)
    assert_same_bytes(calls)


def test_annotations_and_phases_map_alike():
    calls = Calls()
    first = calls.call(aten.relu.default, "x", meta={"custom": {
        markers.MODEL_KEY: "m", markers.LAYER_KEY: 1, markers.MICRO_BATCH_KEY: 2,
        markers.COMPILED_REGION_KEY: "attn", markers.MODULE_PATH_KEY: "layers.1.attn"}})
    calls.call(aten.relu.default, first, meta={"custom": {markers.MODEL_KEY: "draft"}})
    calls.call(aten.relu.default, first, meta={"custom": {}})
    last = calls.call(aten.sum.default, first)
    assert_same_bytes(calls, forward={first, last})


@pytest.mark.parametrize("trace", [
    "\n".join(f'  File "m.py", line {i}, in f{i}\n    call_{i}()' for i in range(5)),
    "before\n" + "\n".join(f'  File "m.py", line {i}\n    f{i}()' for i in range(3)),
    '  File "a.py", line 1\r\n\tx()\x0b  File "b.py", line 2\x1c y() \x1f\x0cz()\n',
    'no frames\r at all \x1d\x1e',
    '  File "é.py", line 1\n    x = "naïve"\u2028  File "b.py", line 2\n    y()\x85z()',
])
def test_stack_traces_are_trimmed_alike(trace):
    calls = Calls()
    calls.call(aten.relu.default, "x", meta={"stack_trace": trace})
    assert_same_bytes(calls)


def _error(build) -> tuple[type, str]:
    with pytest.raises(Exception) as raised:
        build()
    return raised.type, str(raised.value)


def _relu_with(custom=None, **meta) -> Calls:
    calls = Calls()
    calls.call(aten.relu.default, "x", meta={"custom": custom, **meta})
    return calls


def _with_args(target, args, *call_args) -> Calls:
    """A call of `target` on `call_args`, then given `args` instead (no op runs on those)."""
    calls = Calls()
    node = calls.call(target, *call_args)
    node.args = tuple(calls._node_of(a) for a in args)
    return calls


def _read_before_produced() -> Calls:
    calls = Calls()
    first = calls.call(aten.relu.default, "x")
    calls.call(aten.neg.default, first)
    calls.ops.remove(first)
    return calls


def _named_as_an_input() -> Calls:
    calls = Calls()
    calls.call(aten.relu.default, "x").name = "src"
    return calls


# Graphs with something of no IR form; both builders raise the same error.
BROKEN_ALIKE = {
    "undeclared model": (
        lambda: _relu_with({markers.MODEL_KEY: "undeclared"}),
        ValueError,
        r"node `relu_default` \(aten.relu.default\) belongs to undeclared model `undeclared`",
    ),
    "model set to None": (
        lambda: _relu_with({markers.MODEL_KEY: None}),
        ValueError, r"node `relu_default` .* belongs to undeclared model `None`",
    ),
    "layer past the model's": (
        lambda: _relu_with({markers.MODEL_KEY: "draft", markers.LAYER_KEY: 1}),
        ValueError,
        r"node `relu_default` .* is in layer 1 of model `draft`, which declares 1 layers",
    ),
    "negative layer": (
        lambda: _relu_with({markers.LAYER_KEY: -1}),
        ValueError, r"is in layer -1 of model `m`, which declares 2 layers",
    ),
    "dtype of no IR dtype": (
        lambda: _with_args(aten.neg.default, ["x"], torch.zeros(2, dtype=torch.complex128)),
        ValueError,
        r"node `neg_default` .*: dtype torch.complex128 of `neg_default` has no IR dtype",
    ),
    "tensor argument holding a constant": (
        lambda: _with_args(aten.cat.default, [["x", "s"]], ["x", "src"]),
        TypeError,
        r"node `cat_default` \(aten.cat.default\): tensor argument `tensors` holds a constant str",
    ),
    "tensor argument that is a constant": (
        lambda: _with_args(aten.neg.default, ["s"], "x"),
        TypeError, r"node `neg_default` .*: tensor argument `self` holds a constant str",
    ),
    "argument of no IR attribute form": (
        lambda: _with_args(aten.sum.dim_IntList, ["x", {"a": 1}], "x", [0]),
        TypeError, r"argument `dim` = \{'a': 1\} \(immutable_dict\) has no IR attribute form",
    ),
    "list of no IR attribute form": (
        lambda: _with_args(aten.sum.dim_IntList, ["x", [0, "a"]], "x", [0]),
        TypeError, r"list argument `dim` = \[0, 'a'\] has no IR attribute form",
    ),
    "two values of one name": (
        _named_as_an_input,
        ValueError, r"two IR values are named `src` \(a parameter or buffer name clashes",
    ),
    "node read before it is produced": (
        _read_before_produced,
        ValueError,
        r"`relu_default` \(call_function aten.relu.default\) is read before it is produced",
    ),
}


@pytest.mark.parametrize("case", BROKEN_ALIKE)
def test_what_has_no_ir_form_is_the_same_error_from_both_builders(case):
    make, kind, message = BROKEN_ALIKE[case]
    native, python = _error(make().natively), _error(make().in_python)
    assert native == python
    assert native[0] is kind
    assert re.search(message, native[1]), native[1]


# Graphs both builders refuse, the Python one in protobuf's or Python's words (or, for a bool
# layer, taken as 0 or 1): the native builder's error names the node.
BROKEN_NATIVELY = {
    "bad micro-batch": (
        lambda: _relu_with({markers.MICRO_BATCH_KEY: -1}),
        ValueError, r"node `relu_default` .*: micro-batch -1 is not an int from 0 to 4294967295",
    ),
    "bool layer": (
        lambda: _relu_with({markers.LAYER_KEY: True}),
        TypeError, r"node `relu_default` .*: layer True is not an int",
    ),
    "annotation of no str": (
        lambda: _relu_with({markers.MODULE_PATH_KEY: 5}),
        TypeError, r"node `relu_default` .*: annotation `.*` = 5 is not a str",
    ),
    "annotations of no dict": (
        lambda: _relu_with(["a"]),
        TypeError, r"node `relu_default` .*: its annotations \(meta\[\"custom\"\]\) are a list",
    ),
    "stack trace of no str": (
        lambda: _relu_with(None, stack_trace=b"trace"),
        TypeError, r"node `relu_default` .*: its stack trace .* is a bytes, not a str",
    ),
    "int past 64 bits": (
        lambda: _with_args(aten.add.Tensor, ["x", 2**70], "x", 1),
        ValueError, r"node `add_tensor` .*: argument `other` = 1180591620717411303424 does not fit",
    ),
}


@pytest.mark.parametrize("case", BROKEN_NATIVELY)
def test_what_has_no_ir_form_is_an_error_naming_the_node(case):
    make, kind, message = BROKEN_NATIVELY[case]
    native = _error(make().natively)
    assert native[0] is kind
    assert re.search(message, native[1]), native[1]


def test_an_error_of_a_node_comes_before_an_error_of_the_outputs():
    """A step whose output is no scalar loss and whose op belongs to an undeclared model."""
    def step(self, x):
        with markers.layer_scope(model="undeclared", layer=0):
            return self.lin(x)

    with pytest.raises(ValueError, match="undeclared model `undeclared`"):
        _exporter.export_forward(Lambda(step), (torch.randn(2, 4),), name="e", models=MAIN)


def test_an_error_of_the_outputs_is_raised_as_it_is():
    with pytest.raises(ValueError, match="must return the scalar loss, `addmm` is not 0-dim"):
        _exporter.export_forward(
            Lambda(lambda self, x: self.lin(x)), (torch.randn(2, 4),), name="e", models=MAIN
        )


def test_annotations_set_to_none_are_as_if_absent():
    calls = _relu_with({markers.MICRO_BATCH_KEY: None, markers.MODULE_PATH_KEY: None,
                        markers.COMPILED_REGION_KEY: None, markers.LAYER_KEY: None})
    assert_same_bytes(calls)
    plain = _relu_with({})
    assert calls.natively() == plain.natively()


def captured_step():
    """A captured joint step of a linear layer, with its forward nodes and flat inputs."""
    module = Lambda(lambda self, x: torch.tanh(self.lin(x)).square().sum())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    graph_module, num_forward_outputs = _exporter.capture(module, (x,), joint=True)
    forward = _exporter.forward_nodes(graph_module, num_forward_outputs)
    return graph_module, forward, _exporter.flat_inputs(module, (x,))


def build(graph_module, forward, flat) -> _exporter.BuiltGraph:
    return _exporter.build_graph(graph_module, forward, flat, name="e", models=MAIN,
                                 metadata=_exporter.graph_metadata("test", 1, 0))


def test_a_built_graph_is_planned_as_its_bytes_are():
    built = build(*captured_step())
    assert isinstance(built.plannable, _native.WireGraph)
    data = built.graph.SerializeToString(deterministic=True)
    assert built.plannable.pb() == data
    from_wire = rp.plan(built.plannable, "all", check=False)
    from_bytes = rp.plan(data, "all", check=False)
    assert from_wire.to_json() == from_bytes.to_json()  # the graph's fingerprint included
    with pytest.raises(ValueError, match="a built graph has none"):
        rp.plan(built.plannable, format="pb")
