"""Model-side annotations the exporter reads (docs/ir.md, "Marking a model").

- ``checkpoint_record(name, x)``: a point marker. An identity custom op
  (``recompute::checkpoint_record``, exported as ``recompute.checkpoint_record.default`` with the
  marker name in attribute ``name``) that survives AOTAutograd tracing as a node; the gradient
  passes straight through; run eagerly it returns ``x`` itself (the op runs only in traces,
  where it records the point); under ``torch.compile`` it returns ``x`` untouched (Dynamo
  constant-folds the check, so it never enters a compiled graph), as selective-checkpointing
  markers in MoE training frameworks do, except inside ``markers_in_compiled_graphs()``: the
  torch.compile planning stage
  (``recompute_planner.compile``) needs the markers in the joint graph and removes them after
  planning. Its output must be used: the caller continues with the returned tensor.
- ``compiled_region(name)``: every op traced inside runs in the named compiled region (recorded
  on each node as ``compiled_region``; empty means eager).
- ``layer_scope(model, layer, micro_batch=0)``: ops traced inside belong to ``model`` (a name
  the export declares), decoder layer ``layer`` (``None`` outside layers, also inside an
  enclosing layer scope) and intra-layer micro-batch ``micro_batch``.
- ``tentative_marker(name, occurrence, leaf)``: the name of a marker that may be the real
  ``name`` or not, which only the rest of the run tells (an op interval's end on "the last op
  matching": ``recompute_planner.annotate``). ``resolve_tentative_markers(graph)`` settles them
  in a traced graph: of each run of tentative markers, those of the highest occurrence become
  ``name`` and the others are removed (their users read their input, as if never marked).

The scopes are ``torch.fx.traceback.annotate`` contexts: the keys land in ``node.meta["custom"]``
of forward and backward nodes alike, and nested scopes merge (innermost wins per key). On torch
without it (before 2.10) the scopes do nothing: a model that uses them trains and runs under
eager SAC there, and the exporter refuses such a torch (``export.TRACING_TORCH``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import _native

# The marker op as the IR names it and its marker-name attribute: the planner's own constants,
# so the exporter and the planner cannot disagree. The custom op below is registered under
# that name (`recompute::checkpoint_record`); its `name` argument becomes the attribute.
MARKER_OP: str = _native.MARKER_OP
MARKER_NAME_ATTR: str = _native.MARKER_NAME_ATTR
_MARKER_NAMESPACE, _MARKER_NAME, _ = MARKER_OP.split(".")

# Keys of node.meta["custom"] the exporter reads.
MODEL_KEY = "recompute.model"
LAYER_KEY = "recompute.layer"
MICRO_BATCH_KEY = "recompute.micro_batch"
COMPILED_REGION_KEY = "recompute.compiled_region"
# Set by the exporter itself (module forward hooks), not by model code.
MODULE_PATH_KEY = "recompute.module_path"


@torch.library.custom_op(f"{_MARKER_NAMESPACE}::{_MARKER_NAME}", mutates_args=())
def _checkpoint_record(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@_checkpoint_record.register_fake
def _fake_checkpoint_record(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_checkpoint_record.register_autograd(_backward)

# The registered op overload, as it appears as the target of graph nodes.
MARKER_OVERLOAD: torch._ops.OpOverload = getattr(
    getattr(torch.ops, _MARKER_NAMESPACE), _MARKER_NAME
).default


# The planning stage traces are made for: 0 for none (markers stay out of graphs Dynamo
# compiles), else the installed stage's number (``recompute_planner.compile``). Dynamo guards
# on it wherever a traced scope or marker reads it, so a step compiled while one stage was
# installed is traced again, once, when another is.
_in_compiled_graphs = 0
# The key of node.meta["custom"] that records it.
STAGE_KEY = "recompute.stage"


def checkpoint_record(name: str, x: torch.Tensor) -> torch.Tensor:
    """Records the point marker ``name`` on the data path of ``x``; returns ``x``'s identity.

    The marker op runs only where a graph is recorded: a trace (the exporter's, AOTAutograd's:
    a proxy mode is on) or, inside ``markers_in_compiled_graphs()``, a Dynamo compile. Run
    eagerly, on real or fake tensors (training, eager selective checkpointing, the exporter's
    eager probe, a memory measurement under ``FakeTensorMode``), it returns ``x`` itself: the
    op would copy ``x``, a tensor no model code asked for, which a caller holding the result
    (a discarded attention-weights output kept until the layer returns) keeps alive beside
    ``x``.
    """
    if not name:
        raise ValueError("a checkpoint_record marker needs a non-empty name")
    if torch.compiler.is_compiling():
        if not _in_compiled_graphs:
            return x
    elif get_proxy_mode() is None:
        return x
    # The op itself, not the custom-op object: Dynamo records an op call as it is, where it
    # would trace the object's Python call path for every marker.
    marked: torch.Tensor = MARKER_OVERLOAD(x, name)
    return marked


@contextlib.contextmanager
def markers_in_compiled_graphs(stage: int = -1) -> Iterator[None]:
    """Markers traced by ``torch.compile`` inside the block enter the compiled graph, traced
    for planning stage number ``stage`` (-1: not a stage's)."""
    global _in_compiled_graphs
    if not stage:
        raise ValueError("stage 0 means markers stay out of compiled graphs")
    previous, _in_compiled_graphs = _in_compiled_graphs, stage
    try:
        yield
    finally:
        _in_compiled_graphs = previous


def set_compiled_stage(stage: int) -> None:
    """Traces from now on are made for planning stage number ``stage`` (0: none)."""
    global _in_compiled_graphs
    _in_compiled_graphs = stage


def tag_scope(tags: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """``torch.fx.traceback.annotate(tags)``, or nothing on a torch without it. In a trace for
    a planning stage the ops also record its number (``STAGE_KEY``): reading it makes it a
    guard of the code Dynamo compiles, in every model (one without markers too)."""
    return annotated(staged_tags(tags, _in_compiled_graphs))


def staged_tags(tags: dict[str, Any], stage: int) -> dict[str, Any]:
    """``tags``, plus planning stage number ``stage`` in a trace for one (``stage > 0``)."""
    return {**tags, STAGE_KEY: stage} if stage > 0 else tags


def annotated(tags: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """``torch.fx.traceback.annotate(tags)``, or nothing on a torch without it."""
    if hasattr(fx_traceback, "annotate"):
        return fx_traceback.annotate(tags)
    return contextlib.nullcontext()


# The scopes below return ``torch.fx.traceback.annotate``'s context itself, not a generator
# around it: Dynamo knows that context and enters it at no cost, where it would trace a
# generator-based context manager wrapping it step by step (tens of milliseconds a layer).


def compiled_region(name: str) -> contextlib.AbstractContextManager[None]:
    """Marks every op traced inside as running in compiled region ``name``."""
    if not name:
        raise ValueError("a compiled region needs a non-empty name")
    return tag_scope({COMPILED_REGION_KEY: name})


def layer_scope(
    model: str, layer: int | None, micro_batch: int = 0
) -> contextlib.AbstractContextManager[None]:
    """Attributes every op traced inside to ``model``, ``layer`` and ``micro_batch``."""
    return tag_scope(layer_tags(model, layer, micro_batch))


def layer_tags(model: str, layer: int | None, micro_batch: int = 0) -> dict[str, Any]:
    """The annotation ``layer_scope`` puts on the ops traced inside."""
    # The layer is always set, None included: annotations merge, so leaving the key out would
    # let an enclosing scope's layer leak into a nested model's non-layer ops.
    return {MODEL_KEY: model, LAYER_KEY: layer, MICRO_BATCH_KEY: micro_batch}


# A tentative marker's name: the real name, this separator, then "<occurrence>.<leaf>".
_TENTATIVE = "#"


def tentative_marker(name: str, occurrence: int, leaf: int) -> str:
    """The name of a marker that is ``name`` if ``occurrence`` turns out to be the last one
    (``leaf``: which tensor of the op's output it is on)."""
    return f"{name}{_TENTATIVE}{occurrence}.{leaf}"


def _tentative_parts(marker: str) -> tuple[str, tuple[int, int]] | None:
    """``(name, (occurrence, leaf))`` of a tentative marker's name, else None."""
    name, separator, position = marker.rpartition(_TENTATIVE)
    occurrence, _, leaf = position.partition(".")
    if not separator or not occurrence.isdigit() or not leaf.isdigit():
        return None
    return name, (int(occurrence), int(leaf))


def resolve_tentative_markers(graph: fx.Graph) -> int:
    """Settles the tentative markers of a traced graph; returns how many it removed.

    The tentative markers of one name form one run per call that placed them: a run ends at
    the matching ``.begin`` marker (``X.end`` pairs with ``X.begin``), in another layer or
    micro-batch, or where the (occurrence, leaf) positions stop increasing (a new call counts
    from zero). In each run the markers of the highest occurrence present take the real name;
    the others are replaced by their input, which is exact: a marker is an identity whose
    gradient passes straight through, so no backward node belongs to it. (A marker whose
    output nothing read is gone already, as dead code.)
    """
    runs: dict[str, list[list[tuple[tuple[int, int], fx.Node]]]] = {}
    last_scope: dict[str, object] = {}
    for node in graph.find_nodes(op="call_function", target=MARKER_OVERLOAD):
        marker = _marker_name(node)
        if marker.endswith(".begin"):
            runs.get(marker.removesuffix(".begin") + ".end", [[]]).append([])
            continue
        parts = _tentative_parts(marker)
        if parts is None:
            continue
        name, position = parts
        scope = _scope_of(node)
        named = runs.setdefault(name, [[]])
        current = named[-1]
        if current and (position <= current[-1][0] or last_scope.get(name) != scope):
            named.append(current := [])
        current.append((position, node))
        last_scope[name] = scope
    removed = 0
    for name, name_runs in runs.items():
        for run in name_runs:
            if not run:
                continue
            last = max(occurrence for (occurrence, _), _ in run)
            for (occurrence, _), node in run:
                if occurrence == last:
                    _rename_marker(node, name)
                else:
                    source = node.args[0]
                    assert isinstance(source, fx.Node)
                    node.replace_all_uses_with(source)
                    graph.erase_node(node)
                    removed += 1
    return removed


def _marker_name(node: fx.Node) -> str:
    name = node.kwargs["name"] if "name" in node.kwargs else node.args[1]
    assert isinstance(name, str)
    return name


def _rename_marker(node: fx.Node, name: str) -> None:
    if "name" in node.kwargs:
        node.kwargs = {**node.kwargs, "name": name}
    else:
        node.args = (node.args[0], name, *node.args[2:])


def _scope_of(node: fx.Node) -> tuple[Any, ...]:
    custom = node.meta.get("custom") or {}
    return tuple(custom.get(key) for key in (MODEL_KEY, LAYER_KEY, MICRO_BATCH_KEY))


__all__ = [
    "COMPILED_REGION_KEY",
    "LAYER_KEY",
    "MARKER_NAME_ATTR",
    "MARKER_OP",
    "MARKER_OVERLOAD",
    "MICRO_BATCH_KEY",
    "MODEL_KEY",
    "MODULE_PATH_KEY",
    "STAGE_KEY",
    "checkpoint_record",
    "compiled_region",
    "layer_scope",
    "layer_tags",
    "markers_in_compiled_graphs",
    "resolve_tentative_markers",
    "set_compiled_stage",
    "tag_scope",
    "tentative_marker",
]
