"""The exporter's FX -> IR mapping in Python, node by node: the reference the native builder
(``_native.build_fx_graph``, python/native/src/fx.rs) is held to. On every graph the tests
export, both builders give the same bytes (``export_support.check_builders_agree``, the
``builders_agree`` fixture), and on every broken graph test_native_export.py makes, the same
error. The package builds graphs with the native builder alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from recompute_planner import markers
from recompute_planner._exporter import (
    _KEYWORD,
    ABSENT_TENSOR_ARGS,
    ModelDecl,
    _binding,
    _is_getitem,
    _node_op_facts,
    _OpFacts,
    _script_object_type,
    _value_fields,
    trim_stack_trace,
)
from recompute_planner.proto import graph_pb2


class ValueNames:
    """Maps FX nodes to IR value names; folds ``getitem`` chains into their op's outputs."""

    def __init__(self, inputs: dict[fx.Node, str]):
        self._names: dict[fx.Node, list[str]] = {node: [name] for node, name in inputs.items()}

    def add_op(self, node: fx.Node) -> list[tuple[str, torch.Tensor]]:
        """Names ``node``'s output slots; returns (name, fake tensor) per slot, in order.

        A ``getitem`` reading a list inside the result (``c10d`` ops return ``(Tensor[],
        Work)``) stands for the slots under its index path.
        """
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):  # one output, read by name (most ops)
            self._names[node] = [node.name]
            return [(node.name, val)]
        readers = _getitem_paths(node)
        slots = []  # (index path into the result, value name, fake tensor)
        for index, (path, leaf) in enumerate(_tensor_leaves(val)):
            reader = readers.get(path)
            name = reader.name if reader is not None else _unread_output_name(node, path, index)
            slots.append((path, name, leaf))
        self._names[node] = [name for _, name, _ in slots]
        for reader, prefix in _all_getitems(node):
            self._names[reader] = [n for p, n, _ in slots if p[: len(prefix)] == prefix]
        return [(name, val) for _, name, val in slots]

    def of(self, node: fx.Node) -> list[str]:
        """The value names an argument node stands for (several for a list of tensors)."""
        if node not in self._names:
            raise ValueError(
                f"`{node.name}` ({node.op} {node.target}) is read before it is produced"
            )
        return self._names[node]


def _unread_output_name(node: fx.Node, path: tuple[int, ...], index: int) -> str:
    return node.name if path == () else f"{node.name}.out{index}"


def _tensor_leaves(
    val: object, path: tuple[int, ...] = ()
) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """Tensor leaves of an op result with their index paths; None and non-tensors skipped."""
    if isinstance(val, torch.Tensor):
        yield path, val
    elif isinstance(val, (tuple, list)):
        for i, item in enumerate(val):
            yield from _tensor_leaves(item, path + (i,))


def _all_getitems(node: fx.Node) -> Iterator[tuple[fx.Node, tuple[int, ...]]]:
    """Every ``getitem`` node reading (transitively) from ``node``, with its index path."""
    for user in node.users:
        if _is_getitem(user):
            index = user.args[1]
            assert isinstance(index, int), index  # an op's results are a tuple or a list
            yield user, (index,)
            for inner, path in _all_getitems(user):
                yield inner, (index,) + path


def _getitem_paths(node: fx.Node) -> dict[tuple[int, ...], fx.Node]:
    """For each index path read by a ``getitem`` chain, the first node reading it."""
    readers: dict[tuple[int, ...], fx.Node] = {}
    for reader, path in _all_getitems(node):
        readers.setdefault(path, reader)
    return readers


def build_fx_graph(
    *,
    header: bytes,
    inputs: dict[fx.Node, str],
    ops: list[fx.Node],
    forward: set[fx.Node],
    loss_and_outputs: Callable[[], tuple[fx.Node, list[tuple[fx.Node, int | None]]]],
    models: list[ModelDecl],
) -> tuple[graph_pb2.Graph, list[tuple[str, int | None]]]:
    """``_native.build_fx_graph`` in Python, node by node (its arguments, with the declared
    models for its context): the graph and each output's value name with the flat input
    index its gradient belongs to."""
    graph = graph_pb2.Graph.FromString(header)
    names = ValueNames(inputs)
    add_ops_in_python(graph, ops, forward, names, models)
    loss, output_nodes = loss_and_outputs()
    mark_loss(graph, names.of(loss))
    outputs = [(value, index) for node, index in output_nodes for value in names.of(node)]
    graph.outputs.extend(value for value, _ in outputs)
    _check_unique_value_names(graph)
    return graph, outputs


def add_ops_in_python(
    graph: graph_pb2.Graph,
    ops: list[fx.Node],
    forward: set[fx.Node],
    names: ValueNames,
    models: list[ModelDecl],
) -> None:
    """Adds the IR node of each op in ``ops`` and the values it produces to ``graph``."""
    models_by_name = {m.name: m for m in models}
    # AOTAutograd has already removed dead nodes (FX dead-code elimination, which keeps
    # mutating ops), so every op node is emitted, in the graph's (execution) order. Each
    # message is made in place (``add``) from its fields: building it apart and appending it
    # would copy it. The loop runs once per op: what it reads each time is read before it.
    add_node, add_value = graph.nodes.add, graph.values.add
    default_model = models[0].name
    for node in ops:
        is_forward = node in forward
        produced = names.add_op(node)
        add_node(
            **node_fields(node, names, is_forward, models_by_name, default_model=default_model)
        )
        role = _ROLE_ACTIVATION if is_forward else _ROLE_GRADIENT
        for value, val in produced:
            add_value(**_value_fields(value, val, role, node))


_ROLE_ACTIVATION = graph_pb2.ROLE_ACTIVATION


_ROLE_GRADIENT = graph_pb2.ROLE_GRADIENT


def mark_loss(graph: graph_pb2.Graph, loss_names: list[str]) -> None:
    """Gives the loss value its role (it was declared as an activation when produced)."""
    for value in graph.values:
        if value.name in loss_names:
            value.role = graph_pb2.ROLE_LOSS


def _check_unique_value_names(graph: graph_pb2.Graph) -> None:
    seen: set[str] = set()
    for value in graph.values:
        if value.name in seen:
            raise ValueError(
                f"two IR values are named `{value.name}` "
                "(a parameter or buffer name clashes with a graph node name)"
            )
        seen.add(value.name)


def node_fields(
    node: fx.Node,
    names: ValueNames,
    is_forward: bool,
    models: dict[str, ModelDecl],
    *,
    default_model: str,
) -> dict[str, Any]:
    """The fields of the IR node of ``node`` (its attributes and schema facts as field
    dicts, which the message constructor reads as it reads messages)."""
    facts = _node_op_facts(node)
    inputs, positions, attributes = _inputs_and_attributes(node, facts, names)
    fields = {
        "name": node.name,
        "op": facts.name,
        "inputs": inputs,
        "outputs": names.of(node),
        "attributes": attributes,
        "phase": graph_pb2.PHASE_FORWARD if is_forward else graph_pb2.PHASE_BACKWARD,
        "schema": facts.schema_fields(positions),
        **_annotation_fields(node, models, default_model),
    }
    # Only Dynamo-traced graphs (torch.compile's) carry stack traces; ``aot_module`` in torch
    # 2.13 (the exporter's) records none.
    trace = node.meta.get("stack_trace")
    if trace:
        fields["stack_trace"] = trim_stack_trace(trace)
    return fields


def _inputs_and_attributes(
    node: fx.Node, facts: _OpFacts, names: ValueNames
) -> tuple[list[str], dict[str, list[int]], list[dict[str, Any]]]:
    """Splits the arguments into IR inputs (tensors) and attributes (the rest, as
    ``Attribute`` fields).

    A Python number passed for a tensor argument (``add.Tensor(x, 1)``: a wrapped scalar) is
    an attribute. Also returns the positions in the input list of the tensor arguments the
    schema facts read (``_OpFacts.positioned``).
    """
    inputs: list[str] = []
    positions: dict[str, list[int]] = {}
    attributes: list[dict[str, Any]] = []
    absent: list[str] = []
    args, kwargs = node.args, node.kwargs
    for name, source, is_tensor, positioned in _binding(node, facts):
        if source >= 0:
            value = args[source]
        else:
            value = kwargs[name] if source == _KEYWORD else None
        if not is_tensor or isinstance(value, (bool, int, float)):
            if value is not None:
                attributes.append(_attribute(node, name, value))
            continue
        start = len(inputs)
        if isinstance(value, fx.Node):  # one tensor (most arguments)
            inputs.extend(names.of(value))
        else:
            for slot, item in _tensor_argument_items(node, name, value):
                if item is None:
                    absent.append(name if slot is None else f"{name}.{slot}")
                else:
                    inputs.extend(names.of(item))
        if positioned:
            positions[name] = list(range(start, len(inputs)))
    if absent:
        attributes.append({"name": ABSENT_TENSOR_ARGS, "strs": {"values": absent}})
    return inputs, positions, attributes


def _tensor_argument_items(
    node: fx.Node, arg_name: str, value: Any
) -> Iterator[tuple[int | None, fx.Node | None]]:
    """(list slot or None for a single tensor, FX node or None) for a tensor argument."""
    items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
    for slot, item in items:
        if item is not None and not isinstance(item, fx.Node):
            raise TypeError(
                f"node `{node.name}` ({node.target}): tensor argument `{arg_name}` holds a "
                f"constant {type(item).__name__}"
            )
        yield slot, item


def _attribute(node: fx.Node, name: str, value: Any) -> dict[str, Any]:
    """A non-tensor argument as the fields of an IR attribute; unsupported kinds are errors
    naming the node."""
    if isinstance(value, bool):
        return {"name": name, "bool": value}
    if isinstance(value, int):
        return {"name": name, "int": value}
    if isinstance(value, float):
        return {"name": name, "float": value}
    if isinstance(value, str):
        return {"name": name, "str": value}
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return {"name": name, "str": str(value)}
    if isinstance(value, fx.Node) and value.op == "get_attr":
        return {"name": name, "str": _script_object_type(node, value)}
    if isinstance(value, (list, tuple)):
        return {"name": name, **_list_attribute(node, name, value)}
    raise TypeError(
        f"node `{node.name}` ({node.target}): argument `{name}` = {value!r} "
        f"({type(value).__name__}) has no IR attribute form"
    )


def _list_attribute(
    node: fx.Node, name: str, values: list[Any] | tuple[Any, ...]
) -> dict[str, Any]:
    """Ints (bools as 0/1), floats (ints widened when mixed) or strings; empty lists are ints
    (set even when empty: the field dict makes the list present)."""
    kinds = {type(v) for v in values}
    if kinds <= {bool, int}:
        return {"ints": {"values": [int(v) for v in values]}}
    if kinds <= {int, float}:
        return {"floats": {"values": [float(v) for v in values]}}
    if kinds == {str}:
        return {"strs": {"values": list(values)}}
    raise TypeError(
        f"node `{node.name}` ({node.target}): list argument `{name}` = {list(values)!r} "
        "has no IR attribute form (symbolic sizes are not supported)"
    )


def _annotation_fields(
    node: fx.Node, models: dict[str, ModelDecl], default_model: str
) -> dict[str, Any]:
    """Model, layer, micro-batch, compiled region and module path from ``meta["custom"]``, as
    node fields."""
    custom = node.meta.get("custom") or {}
    model = custom.get(markers.MODEL_KEY, default_model)
    if model not in models:
        raise ValueError(
            f"node `{node.name}` ({node.target}) belongs to undeclared model `{model}`"
        )
    fields = {
        "model": model,
        "micro_batch": custom.get(markers.MICRO_BATCH_KEY, 0),
        "compiled_region": custom.get(markers.COMPILED_REGION_KEY, ""),
        "module_path": custom.get(markers.MODULE_PATH_KEY, ""),
    }
    layer = custom.get(markers.LAYER_KEY)
    if layer is not None:
        if not 0 <= layer < models[model].num_layers:
            raise ValueError(
                f"node `{node.name}` ({node.target}) is in layer {layer} of model `{model}`, "
                f"which declares {models[model].num_layers} layers"
            )
        fields["layer"] = layer
    return fields

