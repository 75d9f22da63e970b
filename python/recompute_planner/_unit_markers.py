"""Unit markers placed in a joint graph after Dynamo traced the step.

``recompute_planner.annotate`` marks a unit's submodule by putting ``<path>.begin`` on its
first floating-point input and ``<path>.end`` on its floating-point outputs. Under
``torch.compile`` those markers would be Python Dynamo traces call by call, and graph nodes it
records, in every layer: a third more Dynamo time for a decoder. Dynamo already records which
module each op ran in (``node.meta["nn_module_stack"]``; a backward node carries its forward
op's as ``fwd_nn_module_stack``), so while Dynamo traces, an annotated unit's submodule runs
its forward alone (``annotate._traced_scope``) and this pass puts the markers into the joint
graph AOTAutograd built, where the traced ones would have been:

- a unit's region is a run of consecutive forward ops of one layer (``node.meta["custom"]``,
  the layer scope) whose module stack holds the unit's submodule of that layer;
- ``<path>.begin`` goes before the region's first op, on the first floating-point value the
  region reads that is made before it and is not a parameter or buffer (the module's data
  input: the first op of a module reads it in the models we know; another input makes the
  same interval, the marker being an identity); the region's ops, and the backward ops of
  those ops, read the marker's output;
- ``<path>.end`` goes after the region's last op, on each floating-point value made in the
  region that a forward op after it (or the step's output) reads; those readers, and the
  backward ops of ops outside the region, read the marker's output.

Nested units (``mlp`` and ``mlp.gate``) are placed inner first, so their markers nest as the
traced ones do. A unit whose markers the graph has already (traced without Dynamo, by
``aot_module`` inside ``compile.tracing()``) is left as it is, and so are method units and op
intervals, whose markers Dynamo still traces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import markers
from ._compiled_regions import plain_path
from ._exporter import BACKWARD_PASS, FORWARD_PASS, PASS_TAG, ModelDecl

# The name of a marker node (FX numbers the repeats).
_MARKER_NODE = "checkpoint_record"
_LAYER_KEYS = (markers.MODEL_KEY, markers.LAYER_KEY, markers.MICRO_BATCH_KEY)
# A Dynamo source's root (``L['self']``, ``G['model']``) and its item accesses.
_ROOT = re.compile(r"^[LG]\[(?:'[^']*'|\"[^\"]*\")\]")
_ITEM = re.compile(r"\[(?:'([^']*)'|\"([^\"]*)\"|(\d+))\]")


def module_path(source: str) -> str:
    """The dotted module path of a Dynamo module source: ``L['self'].layers[0].attn`` and
    ``L['self'].layers.0._modules['attn']`` are ``layers.0.attn``; ``_orig_mod`` parts dropped."""
    path = _ITEM.sub(
        lambda m: "." + (m.group(1) or m.group(2) or m.group(3)), _ROOT.sub("", source)
    )
    parts = [part for part in path.split(".") if part and part != "_modules"]
    return plain_path(".".join(parts))


def _tails_agree(a: str, b: str) -> bool:
    """Whether one dotted path ends with the other: a module's path from the compiled root and
    from the annotated root differ by the part above the shorter one."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


@dataclass
class _Region:
    """One call of a unit's submodule: its forward ops, in order."""

    model: str
    layer: int
    stem: str
    nodes: list[fx.Node] = field(default_factory=list)


@dataclass
class _Layouts:
    """Per model: each layer's path and the unit stems to place (from ``ModelDecl``)."""

    layer_paths: dict[str, tuple[str, ...]]
    stems: dict[str, tuple[str, ...]]
    # (model, layer, stack paths) -> the stems whose submodule the stack holds.
    cache: dict[tuple[str, int, tuple[str, ...]], tuple[str, ...]] = field(default_factory=dict)

    def stems_of(self, node: fx.Node, stack_key: str) -> tuple[Any, Any, Any, tuple[str, ...]]:
        """Model, micro-batch and layer of ``node``'s layer scope, and the unit stems its
        module stack is in (``stack_key``: the forward or the backward stack)."""
        custom = node.meta.get("custom") or {}
        model, layer = custom.get(markers.MODEL_KEY), custom.get(markers.LAYER_KEY)
        stack = node.meta.get(stack_key)
        if model not in self.stems or not isinstance(layer, int) or not stack:
            return None, None, None, ()
        sources = tuple(entry[0] for entry in stack.values())
        key = (model, layer, sources)
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = self._match(model, layer, sources)
        return model, custom.get(markers.MICRO_BATCH_KEY, 0), layer, found

    def _match(self, model: str, layer: int, sources: tuple[str, ...]) -> tuple[str, ...]:
        layer_paths = self.layer_paths[model]
        if layer >= len(layer_paths):
            return ()
        layer_path = layer_paths[layer]
        paths = [module_path(source) for source in sources]
        return tuple(
            stem for stem in self.stems[model]
            if any(_names_unit(path, layer_path, stem) for path in paths)
        )


def _names_unit(path: str, layer_path: str, stem: str) -> bool:
    """Whether the module at ``path`` (from the compiled root) is submodule ``stem`` of the
    layer at ``layer_path`` (from the annotated root)."""
    if not stem:
        return _tails_agree(path, layer_path)
    if path == stem:  # the compiled root is the layer
        return True
    prefix, dot, tail = path.rpartition("." + stem)
    return bool(dot) and not tail and _tails_agree(prefix, layer_path)


def place_unit_markers(
    graph: fx.Graph, models: Iterable[ModelDecl], parameters: Collection[str]
) -> int:
    """Puts the markers of the annotated unit submodules into ``graph`` (a joint graph traced
    by Dynamo, pass-tagged) where traced markers would be; returns how many it placed.
    ``parameters``: the placeholders that are parameters (Dynamo lifts them as inputs)."""
    layouts = _Layouts(
        {m.name: m.unit_modules.layer_paths for m in models if m.unit_modules},
        {m.name: m.unit_modules.stems for m in models if m.unit_modules and m.unit_modules.stems},
    )
    if not layouts.stems:
        return 0
    regions = _regions(graph, layouts)
    if not regions:
        return 0
    regions.sort(key=lambda r: (len(r.nodes), -len(r.stem)))  # inner before outer
    first_moved: dict[fx.Node, fx.Node] = {}
    last_moved: dict[fx.Node, fx.Node] = {}
    placed = 0
    for region in regions:
        placed += _place(graph, region, layouts, parameters, first_moved, last_moved)
    return placed


def _regions(graph: fx.Graph, layouts: _Layouts) -> list[_Region]:
    """Every call of a unit submodule that has no traced markers, as its forward ops."""
    traced = _traced_markers(graph)
    open_regions: dict[str, _Region] = {}
    regions: list[_Region] = []
    scope: tuple[Any, Any, Any] = (None, None, None)
    for node in graph.nodes:
        if node.op != "call_function" or _is_backward(node):
            continue
        model, micro_batch, layer, stems = layouts.stems_of(node, "nn_module_stack")
        if (model, micro_batch, layer) != scope:
            open_regions.clear()
            scope = (model, micro_batch, layer)
        for stem in list(open_regions):
            if stem not in stems:
                del open_regions[stem]
        for stem in stems:
            if (model, layer, f"{stem}.begin") in traced:
                continue
            region = open_regions.get(stem)
            if region is None:
                region = open_regions[stem] = _Region(model, layer, stem)
                regions.append(region)
            region.nodes.append(node)
    return regions


def _traced_markers(graph: fx.Graph) -> set[tuple[Any, Any, Any]]:
    """(model, layer, marker name) of the markers already in the graph."""
    found = set()
    for node in graph.find_nodes(op="call_function", target=markers.MARKER_OVERLOAD):
        custom = node.meta.get("custom") or {}
        found.add((custom.get(markers.MODEL_KEY), custom.get(markers.LAYER_KEY), node.args[1]))
    return found


def _place(
    graph: fx.Graph,
    region: _Region,
    layouts: _Layouts,
    parameters: Collection[str],
    first_moved: dict[fx.Node, fx.Node],
    last_moved: dict[fx.Node, fx.Node],
) -> int:
    """Places one region's markers; notes where they moved its boundaries, for the regions
    around it."""
    first, last = _follow(first_moved, region.nodes[0]), _follow(last_moved, region.nodes[-1])
    span = _span(first, last)
    members = set(span)
    inside_backward = _inside_backward(region, layouts)
    begin = _begin(graph, region, members, first, inside_backward, parameters)
    ends = _ends(graph, region, span, last, inside_backward)
    first_moved[first] = begin
    if ends:
        last_moved[last] = ends[-1]
    return 1 + len(ends)


def _follow(moved: dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    while node in moved:
        node = moved[node]
    return node


def _span(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """The nodes from ``first`` to ``last``, in graph order."""
    span, node = [first], first
    while node is not last:
        node = node.next
        span.append(node)
    return span


# Whether a backward node is the backward of an op of a region's submodule.
Inside = Callable[[fx.Node], bool]


def _inside_backward(region: _Region, layouts: _Layouts) -> Inside:
    def inside(node: fx.Node) -> bool:
        model, _, layer, stems = layouts.stems_of(node, "fwd_nn_module_stack")
        return model == region.model and layer == region.layer and region.stem in stems

    return inside


def _begin(
    graph: fx.Graph,
    region: _Region,
    members: set[fx.Node],
    first: fx.Node,
    inside_backward: Inside,
    parameters: Collection[str],
) -> fx.Node:
    data = _data_input(region, members, parameters)
    marker = _marker(graph, data, f"{region.stem}.begin", first, before=True)
    data.replace_all_uses_with(
        marker,
        delete_user_cb=lambda user: user in members
        or (_is_backward(user) and inside_backward(user)),
        propagate_meta=False,
    )
    return marker


def _data_input(region: _Region, members: set[fx.Node], parameters: Collection[str]) -> fx.Node:
    """The first floating-point value the region reads from before it that is no parameter
    (else, a module called on parameters alone, the first parameter)."""
    read = [
        value for node in region.nodes for value in node.all_input_nodes
        if value not in members and value.op != "get_attr" and _is_float_tensor(value)
    ]
    for value in read:
        if value.name not in parameters:
            return value
    if read:
        return read[0]
    raise ValueError(
        f"`{region.stem}` (layer {region.layer} of {region.model}) was called without a tensor "
        "input to put its marker on"
    )


def _is_float_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _ends(
    graph: fx.Graph, region: _Region, span: list[fx.Node], last: fx.Node, inside_backward: Inside
) -> list[fx.Node]:
    members = set(span)
    ends: list[fx.Node] = []
    anchor = last
    for value in span:
        readers = [u for u in value.users if u not in members and not _is_backward(u)]
        if not readers or not _is_float_tensor(value):
            continue
        marker = _marker(graph, value, f"{region.stem}.end", anchor, before=False)

        def read_after(user: fx.Node, marker: fx.Node = marker) -> bool:
            """A reader after the region, or the backward of an op outside it."""
            if user is marker or user in members:
                return False
            return not (_is_backward(user) and inside_backward(user))

        value.replace_all_uses_with(marker, delete_user_cb=read_after, propagate_meta=False)
        ends.append(marker)
        anchor = marker
    return ends


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get(PASS_TAG) == BACKWARD_PASS


def _marker(
    graph: fx.Graph, value: fx.Node, name: str, anchor: fx.Node, *, before: bool
) -> fx.Node:
    """A marker node on ``value`` next to ``anchor`` (an op of the region), with the metadata
    the IR reads from a traced marker: ``value``'s tensor, the region's layer scope (no
    compiled region: a marker placed here never counts as inside one), the forward pass tag,
    the anchor's stack trace."""
    insert = graph.inserting_before(anchor) if before else graph.inserting_after(anchor)
    with insert:
        marker = graph.create_node(
            "call_function", markers.MARKER_OVERLOAD, (value, name), name=_MARKER_NODE
        )
    marker.meta.update({
        key: value.meta[key] for key in ("val", "tensor_meta") if key in value.meta
    })
    custom = anchor.meta.get("custom") or {}
    marker.meta["custom"] = {key: custom[key] for key in _LAYER_KEYS if key in custom}
    marker.meta[PASS_TAG] = FORWARD_PASS
    if "stack_trace" in anchor.meta:
        marker.meta["stack_trace"] = anchor.meta["stack_trace"]
    return marker
