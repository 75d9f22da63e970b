"""``recompute_planner.plan``: the planner in-process.

The graph is planned by the Rust planner linked into this package (``_native``): no
subprocess, no temporary file. Options are those of ``planner plan``. Error-level diagnostics
reject the plan (``PlanRejected``); warning-level ones are issued as ``PlannerWarning``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from . import _native
from .errors import PlannerError, PlannerWarning, PlanRejected
from .plans import Plan

# What `plan` accepts as a graph: an exported graph message (`graph_pb2.Graph`), an
# `ExportResult`, the bytes of a `.pb` (or `.json`, with format="json"), a file path, or a graph
# the exporter's native builder made (`_native.WireGraph`: planned as it is, nothing decoded).
GraphLike = Any | bytes | str | os.PathLike[str]
# `hw`: a shipped profile's name ("h100", "h200", "b200", "mi300x"), a profile's fields
# (dict), or a JSON file of them.
HwLike = Mapping[str, Any] | str | os.PathLike[str] | None


def plan(
    graph: GraphLike,
    keep: str | Iterable[str] | None = None,
    *,
    recompute_ratio: float = 1.0,
    collectives: str = "recompute",
    random_ops: str = "save",
    executor: str = "graph",
    budget: int | str | None = None,
    budget_includes: str = "activations",
    granularity: str = "unit",
    budget_offload: bool = False,
    fsdp: int = 1,
    optimizer: str = "adamw",
    optimizer_state_dtype: str = "fp32",
    master_weights: bool = False,
    offload: str | Iterable[str] | None = None,
    offload_kinds: str | Iterable[str] | None = None,
    offload_prefetch: int = 4,
    choices: Plan | Mapping[str, Any] | None = None,
    hw: HwLike = None,
    format: str | None = None,
    check: bool = True,
) -> Plan:
    """Plans selective checkpointing of ``graph`` and returns the ``Plan``.

    - ``keep``: ``None`` / ``"none"`` (whole-layer recompute), ``"all"``, or unit names
      (``["SAVE_DSA_INDEXER"]`` or ``"save_attn,save_mlp"``; case-insensitive);
    - ``recompute_ratio``: layers with index < floor(ratio x layers) are checkpointed;
    - ``collectives``: ``"recompute"`` or ``"save"`` (functional collectives and
      device-to-host copies of routing counts kept in checkpointed layers);
    - ``random_ops``: ``"save"`` (random ops' outputs saved) or ``"replay"`` (replayed with
      the forward generator state restored: the executor must restore it);
    - ``executor``: ``"graph"`` (the runtime, ``planner run``: replay re-runs what backward
      needs, a unit marker runs as a copy), ``"compiled"`` (the torch.compile stage: a graph
      executor whose graphs hold no marker) or ``"eager"`` (``torch.utils.checkpoint`` with
      ``recompute_planner.sac``: a layer's recompute re-runs its forward prefix, SAC caches
      kept ops' whole outputs);
    - ``budget``: bytes (int) or a size (``"40GiB"``): choose the units per layer that
      minimise replay time within it (replaces ``keep``); ``granularity``: ``"unit"`` (whole
      units) or ``"op"`` (units, then single ops); ``budget_includes``: what it bounds,
      ``"activations"`` (the activation peak), ``"params"`` (with the parameters) or
      ``"training-state"`` (the device total); ``budget_offload``: also choose, per layer,
      which kept units' saved values and whether the layer's inputs go to host memory, where
      that fits the budget faster than recomputing or where nothing else fits it (with
      ``granularity="unit"``; docs/cost-and-memory.md, M5);
    - ``fsdp``, ``optimizer`` (``"adamw"``, ``"sgd"``, ``"none"``), ``optimizer_state_dtype``
      (``"fp32"`` or ``"param"``), ``master_weights``: the training state the device total
      (``plan.memory.device_total_bytes``) counts: FSDP shard degree (1: unsharded), the
      optimizer's state and fp32 master weights (docs/cost-and-memory.md, M4);
    - ``offload``: kept units (names as for ``keep``, each kept by ``keep``) whose saved values
      go to host memory after their last forward read and come back before backward reads
      them; ``offload_kinds``: saved kinds offloaded wherever they are (``"kept"``,
      ``"layer-input"``, ``"not-checkpointed"``, ``"writes-resident"``,
      ``"reads-overwritten"``, ``"written-unreplayably"``; ``"parameter"`` and
      ``"graph-input"`` are accepted and never move); ``offload_prefetch``: how many backward
      steps before its first backward read a value's reload starts (default 4); ``offload``
      and ``offload_kinds`` not with ``budget`` (docs/cost-and-memory.md, M5);
    - ``choices``: per-layer choices over ``keep``, as ``planner plan --choices`` reads them:
      a ``Plan`` (a budget's answer, planned again, e.g. with another ``hw``) or a mapping
      with ``layer_keep`` (``[{"model", "layer", "keep": [units]}]``) and optionally
      ``layer_offload`` (``[{"model", "layer", "offload": [units], "layer_input": bool}]``),
      such as a point of
      ``planner pareto --format json``; layers it does not list follow ``keep``; not with
      ``budget``;
    - ``hw``: a hardware profile for the cost estimates: a shipped one by name (``"h100"``,
      ``"h200"``, ``"b200"``, ``"mi300x"``: vendor datasheet figures), a dict or a JSON file
      (fields left out keep the H200's); default H200;
    - ``format``: ``"pb"`` or ``"json"`` for graph bytes (default ``"pb"``);
    - ``check``: raise ``PlanRejected`` on error diagnostics and warn on warning ones.

    Raises ``PlannerError`` with the CLI's ``error:`` text and a ``code`` for bad input.
    """
    if budget is not None and keep not in (None, "none", []):
        raise PlannerError(
            "a budget chooses the units per layer: give `budget` or `keep`, not both",
            "invalid-option",
        )
    hw_source = _hw_source(hw)
    planned = _native.plan(
        **_graph_source(graph, format),
        keep=_names("keep", keep),
        recompute_ratio=float(recompute_ratio),
        collectives_name=collectives,
        random_ops_name=random_ops,
        executor_name=executor,
        budget_size=None if budget is None else str(budget),
        budget_includes=budget_includes,
        granularity=granularity,
        budget_offload=bool(budget_offload),
        fsdp=fsdp,
        optimizer_name=optimizer,
        optimizer_state_dtype_name=optimizer_state_dtype,
        master_weights=bool(master_weights),
        offload=_names("offload", offload),
        offload_kinds=_names("offload_kinds", offload_kinds),
        offload_prefetch=offload_prefetch,
        choices=_choices_json(choices),
        **hw_source,
    )
    result = Plan(planned)
    if check:
        check_plan(result)
    return result


def _choices_json(choices: Plan | Mapping[str, Any] | None) -> str | None:
    """``choices`` as the JSON the planner reads: a plan's per-layer choices (a plan that
    keeps the same units in every layer has none: its ``keep`` says it), or the mapping."""
    if choices is None:
        return None
    if isinstance(choices, Plan):
        config = choices.config
        if not config.layer_keep and not config.layer_offload:
            raise ValueError(
                "this plan keeps the same units in every layer (no per-layer choices): plan it "
                f"again with keep={list(config.keep)!r}"
            )
        return json.dumps(
            {
                "layer_keep": [dataclasses.asdict(k) for k in config.layer_keep],
                "layer_offload": [dataclasses.asdict(o) for o in config.layer_offload],
            }
        )
    if isinstance(choices, Mapping):
        return json.dumps(dict(choices))
    raise TypeError(f"choices must be a Plan or a mapping, not {type(choices).__name__}")


def check_plan(result: Plan, *, stacklevel: int = 3) -> None:
    """Raises ``PlanRejected`` if the plan has errors; warns once per warning diagnostic."""
    errors = result.errors()
    if errors:
        raise PlanRejected(result, errors)
    for d in result.warnings():
        warnings.warn(
            PlannerWarning(f"{d.code}: {d.message} (hint: {d.hint})"), stacklevel=stacklevel
        )


def _names(option: str, names: str | Iterable[str] | None) -> list[str]:
    """The names an option (``keep``, ``offload``, ``offload_kinds``) lists, as strings. Bytes
    are refused: iterating them gives numbers (``b"SAVE"`` would read as units ``83``, ``65``,
    ...)."""
    if names is None:
        return []
    if isinstance(names, str):
        return [names]
    what = "kind names" if option == "offload_kinds" else "unit names"
    if isinstance(names, (bytes, bytearray, memoryview)):
        raise TypeError(f"{option} takes {what} as str, not {type(names).__name__}")
    listed = list(names)
    for name in listed:
        if not isinstance(name, str):
            raise TypeError(f"{option} takes {what} as str, not {type(name).__name__}: {name!r}")
    return listed


class _HwSource(TypedDict, total=False):
    """The ``_native.plan`` keywords naming a hardware profile (one at most)."""

    hw_name: str
    hw_json: str
    hw_path: str


def _hw_source(hw: HwLike) -> _HwSource:
    """The ``_native.plan`` arguments giving the hardware profile: a shipped profile's name, its
    JSON, or its file, which the planner reads as the CLI reads ``--hw`` (a regular file under
    the profile size limit)."""
    if hw is None:
        return {}
    if isinstance(hw, Mapping):
        return {"hw_json": json.dumps(dict(hw))}
    if isinstance(hw, str) and os.sep not in hw and not hw.endswith(".json"):
        return {"hw_name": hw}
    return {"hw_path": os.fspath(hw)}


def hw_profile(hw: HwLike) -> str:
    """Every field of the hardware profile ``hw`` names (see ``plan``) as JSON; ``None`` is
    the H200. A string without a path separator or ``.json`` suffix is a shipped name."""
    source = _hw_source(hw)
    return _native.hw_profile(
        name=source.get("hw_name"), json=source.get("hw_json"), path=source.get("hw_path")
    )


def _graph_source(graph: GraphLike, format: str | None) -> dict[str, Any]:
    """The ``_native.plan`` arguments naming the graph: a path, bytes and their format, or a
    built graph."""
    if isinstance(graph, (str, os.PathLike)):
        if format is not None:
            raise ValueError("`format` is for graph bytes; a path's extension gives its format")
        return {"path": os.fspath(graph)}
    if isinstance(graph, (bytes, bytearray, memoryview)):
        return {"path": "<graph bytes>", "data": bytes(graph), "format": format or "pb"}
    if isinstance(graph, _native.WireGraph):  # the exporter's native build, planned as is
        if format is not None:
            raise ValueError("`format` is for graph bytes; a built graph has none")
        return {"path": f"<graph {graph.name}>", "graph": graph}
    message: Any = getattr(graph, "graph", graph)  # an ExportResult holds the message
    serialize = getattr(message, "SerializeToString", None)
    if serialize is None:
        raise TypeError(
            "plan() takes an exported graph (graph_pb2.Graph or ExportResult), its bytes or "
            f"a path, not {type(graph).__name__}"
        )
    return {
        "path": f"<graph {message.name}>",
        "data": serialize(deterministic=True),
        "format": "pb",
    }


__all__ = [
    "GraphLike",
    "HwLike",
    "check_plan",
    "hw_profile",
    "plan",
]
