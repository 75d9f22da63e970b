"""Plans as Python objects: the typed form of the plan the planner writes.

A ``Plan`` holds, per forward node, the decision (``save``, ``recompute``,
``no-checkpoint``), its reason and unit; the saved set; the replay of each checkpointed layer;
per-unit summaries; memory; cost; diagnostics. It is parsed from the plan's JSON (the proto3
JSON of ``proto/plan.proto``, which the CLI writes too); ``.json`` and ``.pb`` plan files are
read by the Rust reader (``ir::plan``) and converted to that JSON, so there is one reader and
one dialect. A plan made in-process is written to JSON by the planner only when first read.
Strings spell enumerations exactly as the JSON and the text output do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from . import _native

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DECISION_SAVE = "save"
DECISION_RECOMPUTE = "recompute"
DECISION_NO_CHECKPOINT = "no-checkpoint"
# The reason of an op the plan leaves to a compiled region (nothing is kept there).
REASON_COMPILED = "compiled"


@dataclass(frozen=True)
class NodeDecision:
    """The policy's verdict on one forward node."""

    name: str
    op: str
    model: str
    layer: int | None
    decision: str  # "save", "recompute" or "no-checkpoint"
    reason: str  # "kept-interval", "compiled", "view", ... (docs in proto/plan.proto)
    unit: str | None  # the unit that kept it (decision "save" by a unit)
    offloaded: bool = False  # an output of it is offloaded to host memory (M5)


@dataclass(frozen=True)
class SavedValue:
    """A value resident for backward."""

    value: str
    bytes: int
    layer: int | None
    kind: str  # "kept", "layer-input", "not-checkpointed", "writes-resident", ...
    model: str | None
    alias_of: str | None = None  # the saved value whose storage this one shares
    # In host memory between its last forward read and its reload, not on the device
    # (docs/cost-and-memory.md, M5).
    offloaded: bool = False


@dataclass(frozen=True)
class Replay:
    """The forward nodes one checkpointed layer re-executes in backward."""

    model: str
    layer: int
    nodes: tuple[str, ...]  # in execution order
    before: str  # the backward node it runs just before
    seconds: float


@dataclass(frozen=True)
class UnitLayer:
    layer: int
    kept_ops: int
    saved_bytes: int


@dataclass(frozen=True)
class UnitSummary:
    """What one kept unit of one model keeps."""

    model: str
    unit: str
    kept_ops: int
    saved_bytes: int
    replay_time_avoided_s: float
    layers: tuple[UnitLayer, ...]


@dataclass(frozen=True)
class Memory:
    """Predicted peak memory of the step (peaks are None for a forward-only graph)."""

    peak_bytes: int | None
    saved_bytes: int
    no_checkpoint_peak_bytes: int | None
    full_recompute_peak_bytes: int | None
    peak_stage: str | None
    peak_node: str | None
    parameter_bytes: int
    gradient_bytes: int
    # The whole training state on one device (docs/cost-and-memory.md, M4); None for a
    # forward-only graph. device_total_bytes is the larger of the forward/backward total
    # (the four device_*/optimizer_state/master_weight parts) and optimizer_step_bytes.
    device_total_bytes: int | None = None
    device_peak_phase: str | None = None  # "forward-backward" or "optimizer-step"
    device_parameter_bytes: int | None = None
    device_activation_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    master_weight_bytes: int | None = None
    optimizer_step_bytes: int | None = None
    device_memory_bytes: int | None = None  # the hardware profile's memory
    # Offloaded storages (M5): their bytes in all, and the most of them on the host at once.
    offloaded_bytes: int = 0
    host_peak_bytes: int = 0
    host_memory_bytes: int = 0  # the hardware profile's host memory
    # Saved activation bytes on the device when forward ends: saved_bytes less the offloaded
    # storages that have left it by then (None only in a plan written before the field).
    saved_on_device_bytes: int | None = None

    def fits(self) -> bool | None:
        """Whether the device total fits in the hardware profile's memory (None without it)."""
        if self.device_total_bytes is None or self.device_memory_bytes is None:
            return None
        return self.device_total_bytes <= self.device_memory_bytes


@dataclass(frozen=True)
class Cost:
    """What replay costs on the hardware profile ``hw``."""

    replay_flops: int
    replay_bytes: int
    replay_comm_bytes: int
    replay_time_s: float
    full_recompute_replay_time_s: float
    forward_time_s: float
    backward_time_s: float
    step_time_s: float  # forward + replay + backward + exposed_transfer_time_s
    replay_host_syncs: int
    hw: str
    # Copies of offloaded values to the host and back (M5), and the part compute does not hide.
    transfer_time_s: float = 0.0
    exposed_transfer_time_s: float = 0.0


@dataclass(frozen=True)
class Diagnostic:
    """One way the configuration fails to do what was asked."""

    level: str  # "error", "warning" or "info"
    code: str
    model: str
    unit: str | None
    message: str
    hint: str


@dataclass(frozen=True)
class LayerKeep:
    """The units one layer keeps (a ``budget`` answer's, or ``--choices``)."""

    model: str
    layer: int
    keep: tuple[str, ...]


@dataclass(frozen=True)
class LayerOffload:
    """What one layer moves to host memory (a ``budget_offload`` answer's, or ``--choices``):
    the saved values of its kept units ``offload``, and, with ``layer_input``, the layer inputs
    it makes (its output, which the next checkpointed layer saves as its input)."""

    model: str
    layer: int
    offload: tuple[str, ...]
    layer_input: bool = False


@dataclass(frozen=True)
class Config:
    """The options the plan was made with."""

    keep: tuple[str, ...]  # () for none, ("ALL",) for all
    recompute_ratio: float
    collectives: str
    budget_bytes: int | None
    layer_keep: tuple[LayerKeep, ...]
    random_ops: str = "save"
    executor: str = "graph"
    fsdp: int = 1  # FSDP shard degree the device total assumes
    optimizer: str = "adamw"  # "adamw", "sgd" or "none"
    optimizer_state_dtype: str = "fp32"  # "fp32" or "param"
    master_weights: bool = False
    offload: tuple[str, ...] = ()  # kept units whose saved values go to the host (M5)
    offload_kinds: tuple[str, ...] = ()  # saved kinds offloaded wherever they are
    offload_prefetch: int = 4  # backward steps a reload starts before the first read
    layer_offload: tuple[LayerOffload, ...] = ()  # per-layer choices replacing ``offload``


@dataclass(frozen=True)
class GraphRef:
    name: str
    fingerprint: str


class Plan:
    """A recompute plan for one graph (see the module docstring).

    A handle on the plan's JSON: nothing is parsed until a field is read, and each field is
    decoded once, on first access (a million-node plan's per-node decisions cost nothing to a
    caller that reads only ``memory``). Made from the planner's in-process result
    (``_native.PlannedGraph``), it writes nothing until read: the sections of a size
    independent of the graph's (memory, cost, diagnostics, ...) are written alone when first
    read, the whole JSON text when a list or an encoding is, and the graph the result holds
    is released then."""

    def __init__(self, source: str | _native.PlannedGraph):
        """``source``: the plan's JSON text, or the planner's in-process result."""
        self._source = source

    @functools.cached_property
    def _json(self) -> str:
        if isinstance(self._source, str):
            return self._source
        text = self._source.json()
        self._source = text  # the planned graph is no longer needed
        return text

    @functools.cached_property
    def _doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self._json)
        return doc

    @functools.cached_property
    def _summary(self) -> dict[str, Any]:
        """The sections other than the per-node, per-value, per-replay and per-unit lists: for
        an in-process plan not yet written, written alone by the planner (checking a plan's
        diagnostics then costs neither writing nor parsing the lists)."""
        if isinstance(self._source, str):
            return self._doc
        summary: dict[str, Any] = json.loads(self._source.summary_json())
        return summary

    @functools.cached_property
    def planner_version(self) -> str:
        return str(self._summary["planner_version"])

    @functools.cached_property
    def graph(self) -> GraphRef:
        return _make(GraphRef, self._summary["graph"])

    @functools.cached_property
    def config(self) -> Config:
        return _config(self._summary["config"])

    @functools.cached_property
    def joint(self) -> bool:
        return bool(self._summary["joint"])

    @functools.cached_property
    def nodes(self) -> tuple[NodeDecision, ...]:
        return tuple(_make(NodeDecision, n) for n in self._doc["nodes"])

    @functools.cached_property
    def node_ops(self) -> dict[str, str]:
        """Forward node name -> op, in the order of ``nodes``, read without decoding the nodes
        (checking a compiled partition reads only these, of a plan of thousands of nodes)."""
        return {node["name"]: node["op"] for node in self._doc["nodes"]}

    @functools.cached_property
    def saved(self) -> tuple[SavedValue, ...]:
        return tuple(_make(SavedValue, s) for s in self._doc["saved"])

    @functools.cached_property
    def replay(self) -> tuple[Replay, ...]:
        return tuple(_make(Replay, {**r, "nodes": tuple(r["nodes"])}) for r in self._doc["replay"])

    @functools.cached_property
    def units(self) -> tuple[UnitSummary, ...]:
        return tuple(_unit(u) for u in self._doc["units"])

    @functools.cached_property
    def memory(self) -> Memory:
        return _make(Memory, self._summary["memory"])

    @functools.cached_property
    def cost(self) -> Cost:
        return _make(Cost, self._summary["cost"])

    @functools.cached_property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        return tuple(_make(Diagnostic, d) for d in self._summary["diagnostics"])

    @functools.cached_property
    def _by_name(self) -> dict[str, NodeDecision]:
        return {n.name: n for n in self.nodes}

    # Queries --------------------------------------------------------------------------------

    def decision(self, node: str) -> NodeDecision:
        """The decision on forward node ``node`` (KeyError for a node the plan does not
        decide: a backward node or one of another graph)."""
        return self._by_name[node]

    @property
    def decisions(self) -> dict[str, str]:
        """Forward node name -> ``save`` / ``recompute`` / ``no-checkpoint``."""
        return {n.name: n.decision for n in self.nodes}

    def saved_values(self, kinds: Iterable[str] | None = None) -> set[str]:
        """Names of the saved values, optionally only those of the given kinds."""
        wanted = None if kinds is None else set(kinds)
        return {s.value for s in self.saved if wanted is None or s.kind in wanted}

    def layers(self) -> list[tuple[str, int]]:
        """The (model, layer) pairs the plan checkpoints, in execution order."""
        seen: dict[tuple[str, int], None] = {}
        for n in self.nodes:
            if n.layer is not None and n.decision != DECISION_NO_CHECKPOINT:
                seen.setdefault((n.model, n.layer), None)
        return list(seen)

    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.level == "error"]

    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.level == "warning"]

    # Encodings ------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The plan's JSON text, as ``planner plan --format json`` writes it."""
        return self._json

    def to_bytes(self) -> bytes:
        """The binary ``plan.proto`` encoding, as ``planner plan --format pb`` writes it."""
        if isinstance(self._source, _native.PlannedGraph):
            return self._source.pb()
        return _native.convert_plan(self._json.encode(), "json", "pb")

    def to_proto(self) -> Any:
        """The plan as a ``recompute.plan.v1.Plan`` protobuf message."""
        from .proto import plan_pb2

        return plan_pb2.Plan.FromString(self.to_bytes())

    def __repr__(self) -> str:
        saved = sum(1 for n in self.nodes if n.decision == DECISION_SAVE)
        return (
            f"<Plan of {self.graph.name!r}: {len(self.nodes)} forward nodes, {saved} saved ops, "
            f"peak {self.memory.peak_bytes} B, {len(self.diagnostics)} diagnostics>"
        )


_Record = TypeVar("_Record", bound="DataclassInstance")


def _make(cls: type[_Record], doc: dict[str, Any]) -> _Record:
    """``cls`` from the JSON object ``doc``: its fields by name, keys it does not know ignored
    (a newer planner's), fields the JSON leaves out at their defaults (an older planner's)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in doc.items() if k in known})


def _config(doc: dict[str, Any]) -> Config:
    layer_keep = tuple(
        LayerKeep(k["model"], k["layer"], tuple(k["keep"])) for k in doc.get("layer_keep", [])
    )
    lists: dict[str, Any] = {
        key: tuple(doc[key]) for key in ("keep", "offload", "offload_kinds") if key in doc
    }
    layer_offload = tuple(
        LayerOffload(k["model"], k["layer"], tuple(k["offload"]), bool(k.get("layer_input")))
        for k in doc.get("layer_offload", [])
    )
    return _make(
        Config, {**doc, **lists, "layer_keep": layer_keep, "layer_offload": layer_offload}
    )


def _unit(doc: dict[str, Any]) -> UnitSummary:
    return _make(UnitSummary, {**doc, "layers": tuple(_make(UnitLayer, u) for u in doc["layers"])})


def load_plan(source: str | os.PathLike[str] | bytes, format: str | None = None) -> Plan:
    """A plan from a ``.json`` or ``.pb`` file (or its bytes, with ``format`` ``"json"`` or
    ``"pb"``), read by the planner's own reader: a file is read as the CLI reads one (a
    regular file under the plan size limit; a device or a FIFO is an error, not a hang)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if format is None:
            raise ValueError('plan bytes need their format: format="json" or format="pb"')
        return Plan(_native.convert_plan(bytes(source), format, "json").decode())
    path = Path(source)
    format = format or path.suffix.removeprefix(".")
    return Plan(_native.read_plan_file(os.fspath(path), format, "json").decode())


__all__ = [
    "Config",
    "Cost",
    "DECISION_NO_CHECKPOINT",
    "DECISION_RECOMPUTE",
    "DECISION_SAVE",
    "Diagnostic",
    "GraphRef",
    "LayerKeep",
    "LayerOffload",
    "Memory",
    "NodeDecision",
    "Plan",
    "REASON_COMPILED",
    "Replay",
    "SavedValue",
    "UnitLayer",
    "UnitSummary",
    "load_plan",
]
