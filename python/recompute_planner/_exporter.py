"""Exporter: one training step of a PyTorch module as the project's IR (docs/ir.md). Private to
the package (users call ``recompute_planner.export``); its names without a leading underscore
are shared with ``model_export``, ``device_export`` and ``compile``.

``export_joint`` captures the joint forward+backward graph AOTAutograd builds
(``functorch.compile.aot_function`` over the module's ``functional_call``, each tensor lifted
once; the ``partition_fn`` hook receives the joint graph, which is all we need, so it stops
compilation there). ``export_forward`` captures the forward graph of the
same step traced without autograd. Both map the FX graph to ``recompute.ir.v1.Graph`` and return
the step's weights, inputs and, for the joint graph, the eager PyTorch reference loss and
gradients from the same process. The reference step draws dropout masks with PyTorch's own
Bernoulli kernel on every CPU (not MKL's on Intel), so its random ops give the same masks
whatever the CPU's vendor.

Capture runs with functionalization disabled, so in-place ops (``add_``, ``index_add_``, buffer
updates, ``c10d.*_`` collectives) stay in the graph as eager runs them: the planner must see them
to refuse keeping mutable ops (R5). The IR is not fully SSA: an in-place op's output is a new
value (the mutated tensor after the write), but later readers may read the tensor under its old
name (a slice assignment writes a view, and readers read its base), so what a reader sees
depends on the writes before it in execution order.

The native builder (``_native.build_fx_graph``, in ``python/native/src/fx.rs``) applies the
mapping below. It reads each op node through the C API and builds its IR node and values in
Rust, which the planner plans as they are (``BuiltGraph.plannable``): no Python code of this
package runs per node (fx's own ``args``/``kwargs`` getters and a fake tensor's
``shape``/``dtype`` do) and nothing is encoded or decoded between the builder and the planner
(the few values declared before the nodes, one per input, come as a message). What it knows of
an operator (name, binding of a call shape, written and viewed arguments, randomness,
collective kind) it asks of this module once per call shape, so torch's schemas are read in
one place. What has no IR form (an argument or dtype of no IR form, a symbolic shape, an
undeclared model or layer) is a ``ValueError`` or ``TypeError`` naming the node. The tests keep
a Python builder of the same mapping as its reference (``python/tests/python_fx_builder.py``):
on every graph the tests export, both give the same bytes, or the same error.

IR mapping (the contract the Rust loader and planner rely on):

- one IR node per ``call_function`` node except ``operator.getitem``: a multi-output op's IR
  outputs are the tensor leaves of its result in order (nested lists flattened), named after the
  ``getitem`` node that reads them, else ``<node>.out<i>``; undefined (``None``) results, e.g.
  the gradients an ``output_mask`` turns off, and non-tensor results (a ``c10d`` ``Work``) get no
  output slot;
- inputs are the tensor arguments in schema order (tensor lists flattened, ``None`` skipped);
  when a tensor argument (passed or defaulted) or tensor-list slot is ``None`` the node carries
  the string-list attribute ``absent_tensor_args`` naming them (``weight``, ``indices.0``), so
  a consumer can rebind inputs to schema arguments; every non-tensor argument the node passes
  is an attribute by schema name (defaults are left to the schema: the op knowledge base
  records the defaults of the arguments the planner reads, such as attention's ``dropout_p``;
  bool lists as 0/1 ints;
  dtypes, devices, layouts, memory formats and TorchBind objects as strings; ``None``
  omitted);
- phase: the pass that ran the op. AOTAutograd records the joint graph by running the forward,
  then ``torch.autograd.grad``, under one tracer, and tags each node with the pass it was
  recording (``meta["partitioner_tag"]``: ``is_forward`` before the backward call,
  ``is_backward`` inside it). A node is forward iff it was recorded in the forward pass; nodes
  keep the joint graph's order, which is eager execution order. So forward holds ops that reach
  the loss only through an in-place write (a buffer from ``new_empty`` filled slice by slice
  with ``copy_`` and read by later forward ops), ops that never reach the loss (the checks
  ``F.one_hot`` runs: ``ge``, ``lt``, ``all``, ``_assert_async``) and the ``detach`` autograd
  records when it saves an op's output; backward holds ops that read no tangent (the zeros a
  gradient is scattered into). No structural rule gets all of these right: loss ancestry (the
  partitioner's notion: what a compiled forward must compute) calls the first three backward,
  dependence on a tangent calls the fresh zeros forward. The tags are checked against what
  eager execution implies, and export fails naming the node where they disagree: the forward
  nodes form a prefix of the node list (eager finishes the forward before backward starts),
  every node reading a tangent is backward (with the prefix, so is every node depending on a
  tangent through data or in-place writes), and every ancestor of a forward output is forward.
  A forward-only graph (``export_forward``) is all forward, dead-end checks included;
- markers: the tentative end markers an op interval (``recompute_planner.annotate``) placed
  are settled in the captured graph before it is mapped (``markers.resolve_tentative_markers``:
  the last match keeps the end, the others are removed), so the IR has the markers a hand-marked
  model would have;
- ``node.meta["custom"]`` (``markers.layer_scope`` / ``compiled_region``) gives model, layer,
  micro-batch and compiled region; module forward hooks installed during capture record each
  op's innermost module path the same way (``aot_module`` records no ``nn_module_stack``);
- compiled submodules (``module.compile()``, ``torch.compile(module)``) run their own code while
  the step is captured and its reference runs, inside ``compiled_region(<module path>)``
  (``_compiled_regions.traced_as_regions``); paths and value names leave out ``_orig_mod``.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple, NoReturn

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from google.protobuf import json_format
from torch._functorch._aot_autograd.descriptors import (
    GradAOTOutput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _native, markers
from ._compiled_regions import plain_path, traced_as_regions
from ._python_holds import add_python_releases, probe_releases
from .errors import ExportError
from .proto import graph_pb2

EXPORTER_VERSION = _native.PLANNER_VERSION  # the workspace's Cargo version

# Name of the string-list attribute listing tensor arguments that were None.
ABSENT_TENSOR_ARGS = "absent_tensor_args"
# Frames of a node's stack trace kept in the IR (innermost last).
STACK_TRACE_FRAMES = 3


# The oldest torch the exporter and the torch.compile stage trace with (the one they are tested
# on). Eager SAC and the planner run from the older floor python/pyproject.toml declares
# (scripts/sac_torch_compat.sh tests it).
TRACING_TORCH = "2.13"


def require_tracing_torch(what: str) -> None:
    """Raises ``ExportError`` when this torch is older than ``TRACING_TORCH``: its tracers
    lack what ``what`` needs, and would fail deep inside AOTAutograd or lose the scopes."""
    if torch.__version__ < TRACING_TORCH:
        raise ExportError(
            f"{what} needs torch >= {TRACING_TORCH}; this is torch {torch.__version__} "
            "(eager SAC from a plan runs on it: export the graph with a newer torch)"
        )


def _dtype_table() -> dict[torch.dtype, int]:
    """torch dtype -> IR dtype, read off the IR's own enum: ``DTYPE_FLOAT8_E4M3FN`` is
    ``torch.float8_e4m3fn``, so the enum in ``graph.proto`` is the one table of dtypes.

    ``torch.uint64`` is the IR's ``int64``: the IR has no unsigned 64-bit dtype, and its only
    tensors in a training step are the random-generator seed and offset CUDA flash attention
    returns (a few bytes, same size)."""
    table = {
        torch_dtype(code): code
        for code in graph_pb2.Dtype.values()
        if code != graph_pb2.DTYPE_UNSPECIFIED
    }
    return {**table, torch.uint64: graph_pb2.DTYPE_INT64}


def torch_dtype(code: int) -> torch.dtype:
    """The torch dtype of an IR dtype code: the IR's enum names torch's (``DTYPE_BFLOAT16`` is
    ``torch.bfloat16``)."""
    dtype: torch.dtype = getattr(torch, graph_pb2.Dtype.Name(code).removeprefix("DTYPE_").lower())
    return dtype


_DTYPES = _dtype_table()
_COLLECTIVE_KINDS: dict[str | None, int] = {
    None: graph_pb2.COLLECTIVE_KIND_NONE,
    "functional": graph_pb2.COLLECTIVE_KIND_FUNCTIONAL,
    "mutating": graph_pb2.COLLECTIVE_KIND_MUTATING,
}


@dataclass(frozen=True)
class UnitModules:
    """Where an annotated model's unit submodules are (``recompute_planner.annotate`` fills it):
    what the torch.compile planning stage needs to put their markers into the joint graph
    after Dynamo traced the step without them."""

    layer_paths: tuple[str, ...]  # each layer's module path from the annotated root
    stems: tuple[str, ...]  # unit paths naming a submodule of a layer (``<stem>.begin``/``.end``)


@dataclass(frozen=True)
class ModelDecl:
    """A model the graph holds: its layer count and recompute units (the graph's model metadata)."""

    name: str  # model name used in layer_scope(...)
    num_layers: int
    units: dict[str, list[tuple[str, str]]]  # unit -> [(begin_marker, end_marker)], in order
    parent: str | None = None  # enclosing model for a nested one (MTP)
    unit_modules: UnitModules | None = None  # set by annotate: unit submodules' places


@dataclass
class ExportResult:
    """The IR of one step plus the tensors a runtime needs to replay and check it."""

    graph: graph_pb2.Graph
    params: dict[str, torch.Tensor]  # IR value name -> tensor (parameters and buffers)
    inputs: dict[str, torch.Tensor]  # IR value name -> tensor (data inputs)
    tangents: dict[str, torch.Tensor] = field(default_factory=dict)  # joint only
    loss: torch.Tensor | None = None  # eager reference loss (joint only)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # gradient value -> tensor
    seed: int | None = None  # the CPU generator's seed for the reference step (joint only)
    # Ranks 1.. of a step exported for several ranks in one call (this result is rank 0's).
    other_ranks: list[ExportResult] = field(default_factory=list)

    def write(self, path: str | Path) -> list[Path]:
        """Writes the step as ``planner run`` reads it and returns the files written: the graph
        at ``path`` (``.pb`` or ``.json``) and its tensors (``write_reference``) at
        ``STEM.safetensors``, under rank r's names (``STEM.rank<r>.EXT``, ``rank_path``) for
        a rank r > 0. With ``other_ranks``, every rank's tensors, and a rank's graph only where
        it differs from rank 0's in more than its rank number (``planner run`` runs rank 0's
        graph on the others). A fake export has no tensors: its graph alone is written."""
        path = Path(path)
        written = []
        for result in (self, *self.other_ranks):
            rank = result.graph.metadata.rank
            if result is self or not same_but_rank(result.graph, self.graph):
                written.append(rank_path(path, rank))
                write_graph(result.graph, written[-1])
            if result.params or result.inputs:
                written.append(rank_path(path.with_suffix(".safetensors"), rank))
                write_reference(result, written[-1])
        return written


@dataclass(frozen=True)
class FlatInput:
    """One entry of AOTAutograd's flat input list (parameters, buffers, then arguments)."""

    name: str  # the IR value's name
    role: int
    tensor: torch.Tensor
    # Where ``functional_call`` finds it (``name`` but for the parts torch.compile adds).
    path: str = ""


# --------------------------------------------------------------------------------------------
# Public API


def export_joint(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    *,
    name: str,
    models: list[ModelDecl],
    world_size: int = 1,
    rank: int = 0,
    exporter_version: str = EXPORTER_VERSION,
    seed: int = 0,
) -> ExportResult:
    """Exports the joint forward+backward graph of ``module(*args)`` (the scalar loss).

    The eager reference step runs with the CPU generator seeded with ``seed`` inside a forked
    RNG state, and the module's tensors are restored afterwards, so exporting is free of side
    effects and exporting twice gives the same files. A probe of the eager forward then
    observes which values the model's Python code keeps referenced past their last forward
    read (``_python_holds``: each forward node's ``python_releases``). Compiled submodules
    run their own code in eager in both, as the graph has it (``traced_as_regions``): the
    export never runs ``torch.compile``, which under the reference's dispatch mode would also
    leave them running eagerly afterwards.
    """
    flat = flat_inputs(module, args)
    with traced_as_regions(module):  # the reference step and the probe run no compiled code
        joint, num_forward_outputs = capture(module, args, joint=True)
        snapshot = [f.tensor.detach().clone() for f in flat]
        loss, grads_by_input = _eager_reference(module, args, flat, seed=seed)
        _restore(flat, snapshot)
        released = probe_releases(module, args, seed)
    _restore(flat, snapshot)
    built = build_graph(
        joint,
        forward_nodes(joint, num_forward_outputs),
        flat,
        name=name,
        models=models,
        metadata=graph_metadata(exporter_version, world_size, rank),
    )
    add_python_releases(built.graph, released)
    return ExportResult(
        graph=built.graph,
        params=_params(flat, snapshot, built),
        inputs=_tensors_by_role(flat, snapshot, graph_pb2.ROLE_INPUT),
        tangents={_tangent_name(joint): torch.ones_like(loss)},
        loss=loss,
        grads={value: grads_by_input[index] for value, index in built.grad_sources.items()},
        seed=seed,
    )


def export_forward(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    *,
    name: str,
    models: list[ModelDecl],
    world_size: int = 1,
    rank: int = 0,
    exporter_version: str = EXPORTER_VERSION,
) -> ExportResult:
    """Exports the forward graph of ``module(*args)`` traced without autograd.

    Every node is forward; the graph's only output is the loss; no tangents or gradients.
    """
    flat = flat_inputs(module, args)
    forward, _ = capture(module, args, joint=False)
    built = build_graph(
        forward,
        set(op_nodes(forward)),
        flat,
        name=name,
        models=models,
        metadata=graph_metadata(exporter_version, world_size, rank),
    )
    snapshot = [f.tensor.detach().clone() for f in flat]
    return ExportResult(
        graph=built.graph,
        params=_params(flat, snapshot, built),
        inputs=_tensors_by_role(flat, snapshot, graph_pb2.ROLE_INPUT),
    )


def write_graph(graph: graph_pb2.Graph, path: str | Path) -> None:
    """Writes ``graph`` as binary protobuf (``.pb``) or canonical proto3 JSON (``.json``)."""
    path = Path(path)
    if path.suffix == ".pb":
        path.write_bytes(graph.SerializeToString(deterministic=True))
    elif path.suffix == ".json":
        path.write_text(json_format.MessageToJson(graph, indent=2) + "\n")
    else:
        raise ValueError(f"cannot tell the graph format of {path}: use .pb or .json")


def write_reference(result: ExportResult, path: str | Path) -> None:
    """Writes weights, inputs, tangents and the reference loss and gradients as safetensors.

    Keys: ``param/<name>``, ``input/<name>``, ``tangent/<name>``, ``ref/loss``,
    ``ref/grad/<gradient value name>``, ``rng/seed`` (see ``_generator_tensors``); every tensor
    is a contiguous CPU copy.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for prefix, table in (
        ("param", result.params),
        ("input", result.inputs),
        ("tangent", result.tangents),
        ("ref/grad", result.grads),
    ):
        for key, tensor in table.items():
            tensors[f"{prefix}/{key}"] = tensor
    if result.loss is not None:
        tensors["ref/loss"] = result.loss
    tensors.update(_generator_tensors(result))
    # Clones: safetensors refuses tensors that share storage (views, tied storage).
    contiguous = {
        key: t.detach().cpu().clone(memory_format=torch.contiguous_format)
        for key, t in tensors.items()
    }
    save_file(contiguous, str(path))


def rank_path(path: str | Path, rank: int) -> Path:
    """Rank ``rank``'s version of a file, where ``planner run`` looks for it: ``path`` itself
    for rank 0, ``STEM.rank<r>.EXT`` beside it for the others."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def same_but_rank(graph: graph_pb2.Graph, other: graph_pb2.Graph) -> bool:
    """Whether two ranks' graphs differ in their metadata's rank alone."""
    return _without_rank(graph) == _without_rank(other)


def _without_rank(graph: graph_pb2.Graph) -> bytes:
    copy = graph_pb2.Graph()
    copy.CopyFrom(graph)
    copy.metadata.rank = 0
    data: bytes = copy.SerializeToString(deterministic=True)
    return data


def _generator_tensors(result: ExportResult) -> dict[str, torch.Tensor]:
    """``rng/seed``: the seed of the CPU generator the reference step started from, so an
    executor draws the same random numbers (dropout masks) as the reference did."""
    if result.seed is None:
        return {}
    return {"rng/seed": torch.tensor(result.seed, dtype=torch.int64)}


# --------------------------------------------------------------------------------------------
# Capture


class _GraphCaptured(Exception):
    """Raised from an AOTAutograd hook to hand the traced graph over and stop compiling."""

    def __init__(self, graph_module: fx.GraphModule, num_forward_outputs: int, joint: bool):
        super().__init__("graph captured")
        self.graph_module = graph_module
        self.num_forward_outputs = num_forward_outputs
        self.joint = joint


def capture(
    module: torch.nn.Module, args: tuple[Any, ...], *, joint: bool
) -> tuple[fx.GraphModule, int]:
    """Traces ``module(*args)`` with AOTAutograd (fake tensors, CPU) and returns its graph.

    ``joint`` traces with autograd enabled and returns the joint graph handed to the partitioner
    with its number of forward outputs; otherwise the step is traced under ``no_grad`` and the
    inference graph (all of whose outputs are forward outputs) is returned.
    """
    require_tracing_torch("exporting a graph")

    def partition(
        joint_module: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int, **_: Any
    ) -> NoReturn:
        raise _GraphCaptured(joint_module, num_fwd_outputs, joint=True)

    def forward_compiler(graph_module: fx.GraphModule, _inputs: Any) -> NoReturn:
        raise _GraphCaptured(graph_module, len(_output_args(graph_module)), joint=False)

    compiled = _aot_module(
        module,
        fw_compiler=forward_compiler,
        partition_fn=partition,
        disable_functionalization=True,
    )
    grad_mode = torch.enable_grad() if joint else torch.no_grad()
    try:
        # AOTAutograd keeps node meta for joint traces only; the inference trace needs it on
        # for the scope annotations to reach the nodes.
        with (
            grad_mode,
            fx_traceback.preserve_node_meta(),
            module_path_scopes(module),
            traced_as_regions(module),
            _traced_as_compiled(),
        ):
            compiled(*args)
    except _GraphCaptured as captured:
        if joint and not captured.joint:
            raise ValueError(
                "export_joint: nothing in the step requires grad, so there is no backward; "
                "use export_forward"
            ) from None
        if markers.resolve_tentative_markers(captured.graph_module.graph):
            captured.graph_module.recompile()
        return captured.graph_module, captured.num_forward_outputs
    raise RuntimeError("AOTAutograd finished without handing over a graph")


@contextlib.contextmanager
def _traced_as_compiled() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while the step is traced, as it is under
    ``torch.compile`` and while ``torch.export`` traces (which sets the same flag): library
    code then takes its traceable path instead of branching on data. HuggingFace's mask code
    builds the model's own masks (causal, sliding-window, per layer type) from the positions
    as tensor ops, where eagerly it would test the positions for packed sequences. The rest
    is ``traced_as_exported``: markers stay in the graph, dropout off is no op."""
    compiling = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        with traced_as_exported():
            yield
    finally:
        torch.compiler._is_compiling_flag = compiling


@contextlib.contextmanager
def traced_as_exported() -> Iterator[None]:
    """What the exporter traces a step under, and the torch.compile planning stage's
    ``tracing()`` for traces without Dynamo (``compiled_as_exported`` traces the same program
    under Dynamo), so all trace one program: markers enter the traced graph
    (``markers_in_compiled_graphs``), a dropout that draws nothing returns its input instead
    of the ``clone`` torch's decomposition makes, ``one_hot`` is traced as eager runs it, and
    the ops of every in-place call are annotated with it (``_TracedAsEager``)."""
    with markers.markers_in_compiled_graphs(), _TracedAsEager():
        yield


@contextlib.contextmanager
def compiled_as_exported(stage: int = -1) -> Iterator[None]:
    """What the torch.compile planning stage traces under: the program ``traced_as_exported``
    traces, with nothing Dynamo has to trace op by op. Markers enter compiled graphs; dropout
    and ``one_hot`` are replaced where model code looks them up (``torch.nn.functional``,
    ``torch``) by functions that, in a trace, return what eager returns (``_EAGER_ENTRY_POINTS``;
    outside a trace they call torch's); the in-place calls Dynamo records on each node
    (``source_fn_stack``) stand for ``_TracedAsEager``'s annotation (``in_place_call``).

    A torch-function mode such as ``_TracedAsEager`` makes Dynamo trace its
    ``__torch_function__`` around every op of the model: half again the Dynamo time of a
    decoder. A trace without Dynamo (``aot_module``) records no call names: enter
    ``traced_as_exported`` for it. ``stage``: the planning stage's number the traces are for
    (``markers.markers_in_compiled_graphs``)."""
    with markers.markers_in_compiled_graphs(stage), _eager_entry_points():
        yield


@contextlib.contextmanager
def _eager_entry_points() -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _EAGER_ENTRY_POINTS]
    for owner, name, replacement in _EAGER_ENTRY_POINTS:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _in_a_trace() -> bool:
    """Whether ops are being recorded (Dynamo, or a proxy mode: AOTAutograd, the exporter)."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


_TORCH_F_DROPOUT = torch.nn.functional.dropout
_TORCH_DROPOUT = torch.dropout
_TORCH_ONE_HOT = torch.nn.functional.one_hot


def _dropout_traced_as_eager(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    if _in_a_trace() and _functional_dropout_off(input, p, training) is not None:
        return input
    return _TORCH_F_DROPOUT(input, p, training, inplace)


def _aten_dropout_traced_as_eager(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if _in_a_trace() and _aten_dropout_off(input, p, train) is not None:
        return input
    return _TORCH_DROPOUT(input, p, train)


def _one_hot_traced_as_eager(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    made = _one_hot_as_eager(tensor, num_classes) if _in_a_trace() else None
    return made if made is not None else _TORCH_ONE_HOT(tensor, num_classes)


# (module, attribute, replacement) for ``compiled_as_exported``.
_EAGER_ENTRY_POINTS: list[tuple[Any, str, Callable[..., torch.Tensor]]] = [
    (torch.nn.functional, "dropout", _dropout_traced_as_eager),
    (torch, "dropout", _aten_dropout_traced_as_eager),
    (torch.nn.functional, "one_hot", _one_hot_traced_as_eager),
]


class _TracedAsEager(torch.overrides.TorchFunctionMode):
    """Keeps in a trace what eager PyTorch runs.

    - A dropout that draws nothing (``p=0`` or not training) returns its input, as eager ATen
      does (no op runs, nothing is allocated); traced as it is, it would decompose into a
      ``clone`` eager never makes (an attention-probabilities copy in HuggingFace eager
      attention) and that selective checkpointing could not match.
    - The ops a call of an in-place tensor method (``div_``, ``copy_``, item assignment)
      traces carry the method's name (``IN_PLACE_CALL_KEY``): functionalization, as
      ``torch.compile`` traces, rewrites the write into an out-of-place op and the write into
      a view into a scatter back into its base, and the annotation is what lets the IR give
      those ops back the storage eager writes (``mark_functionalized_writes``).
    - ``one_hot`` with a class count is ``zeros`` filled in place by ``scatter_``, as ATen runs
      it on every device; on fake tensors ATen takes another path (``arange``, ``eq``, a copy
      to int64) whose tensors eager never makes, and a plan that keeps them would count bytes
      eager selective checkpointing never holds. Eager's range check reads the data (it
      cannot be traced, and its result is a pair of scalars).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS and args:
            bound = _DROPOUTS[func](*args, **kwargs)
            if bound is not None:
                return bound
        if func is torch.nn.functional.one_hot and args:
            made = _one_hot_as_eager(*args, **kwargs)
            if made is not None:
                return made
        if func in _IN_PLACE_METHODS:
            with markers.tag_scope({IN_PLACE_CALL_KEY: _IN_PLACE_METHODS[func]}):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _functional_dropout_off(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor | None:
    return input if (p == 0 or not training) else None


def _aten_dropout_off(input: torch.Tensor, p: float, train: bool) -> torch.Tensor | None:
    return input if (p == 0 or not train) else None


def _one_hot_as_eager(input: torch.Tensor, num_classes: int = -1) -> torch.Tensor | None:
    """ATen's ``one_hot`` on real tensors; None where the trace keeps torch's own (a class
    count read from the data, an empty or non-int64 input: ATen's checks then decide)."""
    if num_classes < 0 or input.dtype != torch.int64 or input.numel() == 0:
        return None
    out = torch.zeros((*input.shape, num_classes), dtype=input.dtype, device=input.device)
    with markers.tag_scope({IN_PLACE_CALL_KEY: "scatter_"}):
        return out.scatter_(-1, input.unsqueeze(-1), 1)


# The annotation on the ops an in-place tensor method call traces: the method's name.
IN_PLACE_CALL_KEY = "recompute.in_place_call"

# Tensor methods that write their tensor (``div_``, ``copy_``, ``index_put_``, ...) and item
# assignment (``x[i] = v``), by the function a torch-function mode is handed -> name.
_IN_PLACE_METHODS: dict[Callable[..., Any], str] = {
    **{
        getattr(torch.Tensor, name): name
        for name in dir(torch.Tensor)
        if name.endswith("_") and not name.startswith("_")
    },
    torch.Tensor.__setitem__: "__setitem__",
}

_IN_PLACE_METHOD_NAMES = frozenset(_IN_PLACE_METHODS.values())
# Item assignment and augmented assignments (``x /= s``), as Dynamo records their calls.
_IN_PLACE_OPERATORS: dict[Callable[..., Any], str] = {
    operator.setitem: "__setitem__",
    **{
        getattr(operator, name): f"__{name}__"
        for name in (
            "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow",
            "iand", "ior", "ixor", "ilshift", "irshift",
        )
    },
}

# Dropout entry points -> their input when the call draws nothing, else None.
_DROPOUTS: dict[Callable[..., Any], Callable[..., torch.Tensor | None]] = {
    torch.nn.functional.dropout: _functional_dropout_off,
    torch.dropout: _aten_dropout_off,
}


@contextlib.contextmanager
def module_path_scopes(module: torch.nn.Module) -> Iterator[None]:
    """Annotates ops traced inside each submodule's forward with its path (``layers.0.attn``).

    Forward pre-hooks enter a ``fx.traceback.annotate`` scope and forward hooks leave it; as the
    annotations merge, the innermost module wins, and backward nodes inherit their forward
    node's annotation like the layer tags do. The leaving hooks run before the module's other
    forward hooks (``prepend``): a scope entered after another module hook's is left before
    it, so each hook restores what it saw and no tag outlives its module (the layer scopes of
    ``recompute_planner.annotate`` run inside the forward, within these).

    Paths leave out the ``_orig_mod`` of ``torch.compile(module)``: a compiled submodule's ops
    are in its own path, as in the model without ``torch.compile``.
    """
    scopes: list[contextlib.ExitStack] = []

    def enter(path: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: tuple[Any, ...]) -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(markers.tag_scope({markers.MODULE_PATH_KEY: path}))
            scopes.append(stack)

        return hook

    def leave(_module: torch.nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        scopes.pop().close()

    handles = []
    for path, submodule in module.named_modules(remove_duplicate=False):
        if path:
            handles.append(submodule.register_forward_pre_hook(enter(plain_path(path))))
            handles.append(
                submodule.register_forward_hook(leave, always_call=True, prepend=True)
            )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while scopes:
            scopes.pop().close()


def flat_inputs(module: torch.nn.Module, args: tuple[Any, ...]) -> list[FlatInput]:
    """AOTAutograd's flat inputs of ``_aot_module(module)(*args)``, named as IR values.

    Parameters and buffers keep their fully qualified names (without the ``_orig_mod`` of
    ``torch.compile(module)``: the names of the model without it); a tensor registered under
    several names (tied input and output embeddings) is one input, named by its first name, as
    ``named_parameters()`` lists it; data arguments are ``input.<i>``.
    """
    if not isinstance(args, tuple) or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("args must be a tuple of tensors (the module's positional inputs)")
    state: list[tuple[int, str, torch.Tensor]] = [
        (graph_pb2.ROLE_PARAMETER, n, t) for n, t in module.named_parameters()
    ]
    state += [(graph_pb2.ROLE_BUFFER, n, t) for n, t in module.named_buffers()]
    flat = [FlatInput(plain_path(n), role, t, path=n) for role, n, t in state]
    flat += [FlatInput(f"input.{i}", graph_pb2.ROLE_INPUT, t) for i, t in enumerate(args)]
    return flat


def _aot_module(module: torch.nn.Module, **aot_kwargs: Any) -> Callable[..., Any]:
    """``aot_module`` lifting each parameter and buffer once, however many names it has.

    torch's ``aot_module`` lifts every name as its own input, so a tied weight would become two
    inputs with two gradients (and AOTAutograd deduplicates the pair behind the graph's back).
    Here the flat inputs are ``named_parameters()`` / ``named_buffers()`` without duplicates,
    and ``functional_call`` (which ties weights by default) hands the one tensor to every name
    it is registered under, so the graph has one input and one gradient per tensor, the sum of
    its uses, as eager autograd computes it.
    """
    # Loads Dynamo (seconds): here, on the first export, not when the package is imported.
    from functorch.compile import aot_function  # type: ignore[import-untyped]  # no py.typed

    torch._dynamo.utils.assert_no_fake_params_or_buffers(module)
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())

    def functional_call(
        named_params: dict[str, torch.Tensor], named_buffers: dict[str, torch.Tensor], *args: Any
    ) -> Any:
        return torch.func.functional_call(module, {**named_params, **named_buffers}, args)

    compiled = aot_function(
        functional_call, num_params_buffers=len(params) + len(buffers), **aot_kwargs
    )
    return lambda *args: compiled(params, buffers, *args)


def _eager_reference(
    module: torch.nn.Module, args: tuple[Any, ...], flat: list[FlatInput], *, seed: int
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Runs the step eagerly: the loss and, per flat input that requires grad, its gradient.

    ``torch.autograd.grad`` leaves ``.grad`` of the module's parameters untouched; unused
    inputs get zero gradients, as the joint graph would compute them. Bernoulli samples
    (dropout masks) are drawn by ``_PortableBernoulli``.
    """
    # torch leaves TorchDispatchMode.__init__ unannotated.
    with torch.random.fork_rng(devices=[]), _PortableBernoulli():  # type: ignore[no-untyped-call]
        torch.manual_seed(seed)
        loss = module(*args)
    _check_loss(loss)
    wanted = [i for i, f in enumerate(flat) if f.tensor.requires_grad]
    grads = torch.autograd.grad(
        loss, [flat[i].tensor for i in wanted], allow_unused=True, materialize_grads=True
    )
    return loss.detach(), {i: g.detach() for i, g in zip(wanted, grads, strict=True)}


class _PortableBernoulli(TorchDispatchMode):
    """Draws ``bernoulli_(p)`` (the mask of CPU dropout) as PyTorch's own CPU kernel does, on
    every CPU.

    PyTorch builds with MKL draw it from MKL's generator on Intel CPUs only (seeded from the
    CPU generator), so the same seed gives other masks, and another reference loss and
    gradients, on Intel than on any other CPU. PyTorch's own kernel takes one double from the
    generator per element, in order, and compares it with ``p``: exactly ``torch.rand(...,
    dtype=torch.float64) < p``, which has no vendor path and leaves the generator in the same
    state.
    """

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten.bernoulli_.float:
            return func(*args, **kwargs)
        out, p = args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        if not out.is_contiguous():
            raise NotImplementedError(
                "the reference step draws a Bernoulli sample into a non-contiguous tensor"
            )
        draw = torch.rand(out.shape, dtype=torch.float64, generator=kwargs.get("generator"))
        return out.copy_(draw < p)


def _check_loss(loss: object) -> None:
    """The eager step's result must be the scalar loss (backward seeds it with 1)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("the module must return the scalar loss (a 0-dim tensor)")


def _restore(flat: list[FlatInput], snapshot: list[torch.Tensor]) -> None:
    """Undoes in-place updates the eager step made (buffer statistics, mutated inputs); a
    tensor the step left as it was is not written (an expanded input cannot be)."""
    with torch.no_grad():
        for f, saved in zip(flat, snapshot, strict=True):
            if not torch.equal(f.tensor, saved):
                f.tensor.copy_(saved)


def _params(
    flat: list[FlatInput], snapshot: list[torch.Tensor], built: BuiltGraph
) -> dict[str, torch.Tensor]:
    """Parameters, buffers and the graph's tensor constants, by IR value name."""
    params = _tensors_by_role(flat, snapshot, graph_pb2.ROLE_PARAMETER, graph_pb2.ROLE_BUFFER)
    params.update((node.name, tensor.detach().clone()) for node, tensor in built.constants.items())
    return params


def _tensors_by_role(
    flat: list[FlatInput], tensors: list[torch.Tensor], *roles: int
) -> dict[str, torch.Tensor]:
    return {f.name: t for f, t in zip(flat, tensors, strict=True) if f.role in roles}


# --------------------------------------------------------------------------------------------
# Graph structure


def _output_args(graph_module: fx.GraphModule) -> list[Any]:
    """The flat list of the graph's outputs (FX nodes, or None for absent gradients)."""
    outputs = graph_module.graph.output_node().args[0]
    assert isinstance(outputs, (tuple, list)), outputs  # a graph returns a tuple of values
    return list(outputs)


def _output_descs(graph_module: fx.GraphModule) -> list[Any]:
    """AOTAutograd's descriptor per output: mutated input, user output or gradient of input."""
    descs = graph_module.graph.output_node().meta.get("desc")
    if descs is None:
        raise RuntimeError("AOTAutograd recorded no output descriptors on the graph")
    return list(descs)


def _user_outputs(graph_module: fx.GraphModule) -> list[fx.Node]:
    """The step's own outputs (``PlainAOTOutput``), in order; mutated inputs come before them."""
    return [
        out
        for out, desc in zip(_output_args(graph_module), _output_descs(graph_module), strict=True)
        if isinstance(desc, PlainAOTOutput)
    ]


def _loss_node(graph_module: fx.GraphModule) -> fx.Node:
    """The loss among the step's outputs: its one output, or of several (a model output
    ``torch.compile`` traced whole: an HF ``ModelOutput``'s loss and logits, a tuple, a dict)
    the first scalar floating-point one, as a model output puts its loss first."""
    outputs = _user_outputs(graph_module)
    if len(outputs) == 1:
        loss = outputs[0]
        if not _is_scalar_loss(loss):
            raise ValueError(
                f"the module must return the scalar loss, `{loss.name}` is not 0-dim"
            )
        return loss
    for out in outputs:
        if _is_scalar_loss(out):
            return out
    raise ValueError(
        f"the step returned {len(outputs)} outputs and none is a scalar loss: return the loss "
        "(HuggingFace models: pass `labels`)"
    )


def _is_scalar_loss(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()


def _plain_input_index(desc: object) -> int:
    """The flat-input index a ``PlainAOTInput`` descriptor names."""
    if not isinstance(desc, PlainAOTInput):
        raise RuntimeError(f"unexpected AOTAutograd input descriptor {desc!r}")
    return desc.idx


def _tangents(graph_module: fx.GraphModule) -> list[fx.Node]:
    """The joint graph's tangent placeholders (incoming gradients of its outputs)."""
    return [
        n
        for n in graph_module.graph.find_nodes(op="placeholder")
        if isinstance(n.meta.get("desc"), TangentAOTInput)
    ]


def _tangent_name(graph_module: fx.GraphModule) -> str:
    """The joint graph's one tangent placeholder: the incoming gradient of the loss."""
    tangents = [n.name for n in _tangents(graph_module)]
    if len(tangents) != 1:
        raise RuntimeError(f"expected one tangent (of the loss), found {tangents}")
    return tangents[0]


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node they transitively read."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def op_nodes(graph_module: fx.GraphModule) -> list[fx.Node]:
    """The nodes that become IR nodes: op calls other than ``getitem``, in graph order."""
    return [
        n for n in graph_module.graph.nodes if n.op == "call_function" and not _is_getitem(n)
    ]


# Node meta key under which AOTAutograd records the pass that traced a joint-graph node.
PASS_TAG = "partitioner_tag"
FORWARD_PASS = "is_forward"
BACKWARD_PASS = "is_backward"


def forward_nodes(graph_module: fx.GraphModule, num_forward_outputs: int) -> set[fx.Node]:
    """The op nodes of a joint graph that the forward pass ran (the module docstring's phase
    rule), after checking the pass tags against eager execution; errors name the node."""
    ops = op_nodes(graph_module)
    forward = _forward_prefix(ops)
    for node in (user for tangent in _tangents(graph_module) for user in tangent.users):
        if node in forward:
            raise RuntimeError(f"forward node `{node.name}` ({node.target}) reads a tangent")
    outputs = [a for a in _output_args(graph_module)[:num_forward_outputs] if a is not None]
    needed = _ancestors(outputs)
    for node in ops:
        if node in needed and node not in forward:
            raise RuntimeError(
                f"backward node `{node.name}` ({node.target}) computes a forward output"
            )
    return forward


def _forward_prefix(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes tagged as traced in the forward pass, which must all come before the first
    node traced in the backward pass (eager finishes the forward before backward starts)."""
    forward: set[fx.Node] = set()
    first_backward: fx.Node | None = None
    for node in nodes:
        tag = node.meta.get(PASS_TAG)
        if tag == BACKWARD_PASS:
            first_backward = first_backward or node
        elif tag != FORWARD_PASS:
            raise RuntimeError(
                f"node `{node.name}` ({node.target}) has no pass tag ({PASS_TAG}={tag!r}): "
                "cannot tell whether the forward or the backward pass ran it"
            )
        elif first_backward is not None:
            raise RuntimeError(
                f"node `{node.name}` ({node.target}) was traced in the forward pass after "
                f"backward node `{first_backward.name}`: the graph is not in eager order"
            )
        else:
            forward.add(node)
    return forward


# --------------------------------------------------------------------------------------------
# Value names


# --------------------------------------------------------------------------------------------
# Graph building


def build_graph(
    graph_module: fx.GraphModule,
    forward: set[fx.Node],
    flat: list[FlatInput],
    *,
    name: str,
    models: list[ModelDecl],
    metadata: graph_pb2.Metadata,
) -> BuiltGraph:
    """Maps the captured FX graph to the IR (see the module docstring).

    The exporter declares the graph's inputs, constants and models; the native builder
    (``_native.build_fx_graph``) converts the op nodes, without Python's cost per node, and
    raises a ``ValueError`` or ``TypeError`` naming the node for what has no IR form (an
    argument of no IR form, a symbolic shape, an undeclared model, a layer past the model's).
    """
    _check_models(models)
    header, inputs, constants = _header(
        graph_module, flat, name=name, models=models, metadata=metadata
    )
    wire, listed = _native.build_fx_graph(
        header=header.SerializeToString(deterministic=True),
        inputs=inputs,
        ops=op_nodes(graph_module),
        forward=forward if isinstance(forward, set) else set(forward),
        # Read after the op nodes, so that a node's error comes before one of the outputs.
        loss_and_outputs=lambda: (_loss_node(graph_module), _output_nodes(graph_module)),
        context=_native_context(models),
    )
    return BuiltGraph(
        wire,
        grad_sources={value: index for value, index in listed if index is not None},
        constants=constants,
    )


def _header(
    graph_module: fx.GraphModule,
    flat: list[FlatInput],
    *,
    name: str,
    models: list[ModelDecl],
    metadata: graph_pb2.Metadata,
) -> tuple[graph_pb2.Graph, dict[fx.Node, str], dict[fx.Node, torch.Tensor]]:
    """The graph before its op nodes: name, metadata, models, inputs and constants; returns
    it with the value name of each input and the constants."""
    graph = graph_pb2.Graph(name=name, metadata=metadata)
    graph.models.extend(_model_proto(m) for m in models)
    inputs = _declare_inputs(graph, graph_module, flat)
    constants = _declare_constants(graph, graph_module)
    return graph, {**inputs, **{node: node.name for node in constants}}, constants


def _native_context(models: list[ModelDecl]) -> Any:
    """What ``_native.build_fx_graph`` reads of the exporter: its callbacks, keys and types."""
    return SimpleNamespace(
        dtypes=_DTYPES,
        tensor_type=torch.Tensor,
        node_type=fx.Node,
        named_types=(torch.dtype, torch.device, torch.layout, torch.memory_format),
        getitem=operator.getitem,
        binding_of=_call_binding,
        script_object_type=_script_object_type,
        trim_stack_trace=trim_stack_trace,
        stack_trace_frames=STACK_TRACE_FRAMES,
        written_as_key=WRITTEN_AS_KEY,
        model_key=markers.MODEL_KEY,
        micro_batch_key=markers.MICRO_BATCH_KEY,
        compiled_region_key=markers.COMPILED_REGION_KEY,
        module_path_key=markers.MODULE_PATH_KEY,
        layer_key=markers.LAYER_KEY,
        absent_tensor_args=ABSENT_TENSOR_ARGS,
        models={m.name: m.num_layers for m in models},
        default_model=models[0].name,
    )


def _call_binding(
    node: fx.Node,
) -> tuple[str, bool, int, tuple[str, ...], str | None, tuple[_BoundArgument, ...]]:
    """What the native builder reads of the op ``node`` calls and of its call shape: op name,
    randomness, collective kind, written arguments, viewed argument and binding."""
    facts = _node_op_facts(node)
    binding = _binding(node, facts)
    return facts.name, facts.random, facts.collective, facts.written, facts.view_of, binding


class BuiltGraph:
    """A built graph and what the export result needs besides it.

    The native builder's graph is planned as it is (``plannable``); ``graph``, its
    ``graph_pb2`` message, is parsed from its bytes once, when first read. What is added to
    ``graph`` afterwards (the forward nodes' ``python_releases``) is in ``graph`` alone.
    """

    def __init__(
        self,
        graph: _native.WireGraph,
        *,
        grad_sources: dict[str, int],
        constants: dict[fx.Node, torch.Tensor],
    ):
        self.plannable = graph
        self.grad_sources = grad_sources  # gradient output value -> index of its flat input
        self.constants = constants  # tensor constants, declared as buffers

    @functools.cached_property
    def graph(self) -> graph_pb2.Graph:
        return graph_pb2.Graph.FromString(self.plannable.pb())


def _check_models(models: list[ModelDecl]) -> None:
    if not models:
        raise ValueError("declare at least one model (ModelDecl); unannotated ops belong to it")
    seen = set()
    for m in models:
        if m.name in seen:
            raise ValueError(f"model `{m.name}` is declared twice")
        seen.add(m.name)


def _model_proto(model: ModelDecl) -> graph_pb2.Model:
    proto = graph_pb2.Model(name=model.name, parent=model.parent or "", num_layers=model.num_layers)
    for unit, intervals in model.units.items():
        proto.units.append(
            graph_pb2.UnitIntervals(
                unit=unit,
                intervals=[graph_pb2.MarkerInterval(begin=b, end=e) for b, e in intervals],
            )
        )
    return proto


def graph_metadata(exporter_version: str, world_size: int, rank: int) -> graph_pb2.Metadata:
    return graph_pb2.Metadata(
        exporter_version=exporter_version,
        torch_version=torch.__version__.split("+")[0],
        world_size=world_size,
        rank=rank,
    )


def _declare_inputs(
    graph: graph_pb2.Graph, graph_module: fx.GraphModule, flat: list[FlatInput]
) -> dict[fx.Node, str]:
    """Declares a value per placeholder (parameter, buffer, input or tangent)."""
    inputs: dict[fx.Node, str] = {}
    for node in graph_module.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, TangentAOTInput):
            name, role = node.name, graph_pb2.ROLE_TANGENT
        else:
            entry = flat[_plain_input_index(desc)]
            name, role = entry.name, entry.role
        inputs[node] = name
        graph.values.add(**_value_fields(name, node.meta.get("val"), role, node))
    return inputs


def _declare_constants(
    graph: graph_pb2.Graph, graph_module: fx.GraphModule
) -> dict[fx.Node, torch.Tensor]:
    """Declares tensor constants the trace lifted (``torch.tensor([...])`` in forward).

    They are buffers named after their attribute (``_tensor_constant0``): read-only inputs
    whose values travel with the parameters.
    """
    constants: dict[fx.Node, torch.Tensor] = {}
    for node in graph_module.graph.find_nodes(op="get_attr"):
        tensor = getattr(graph_module, node.target)
        if isinstance(tensor, torch.Tensor):
            constants[node] = tensor
            graph.values.add(**_value_fields(node.name, tensor, graph_pb2.ROLE_BUFFER, node))
    return constants


def _output_nodes(graph_module: fx.GraphModule) -> list[tuple[fx.Node, int | None]]:
    """The loss, the step's other outputs (a model output's logits: the caller holds them
    through backward), then every gradient in the joint graph's output order (absent ones
    skipped).

    Each comes with the index of the flat input a gradient belongs to (None for the others).
    """
    loss = _loss_node(graph_module)
    others = [out for out in _user_outputs(graph_module) if out is not loss]
    outputs: list[tuple[fx.Node, int | None]] = [(out, None) for out in (loss, *others)]
    for out, desc in zip(_output_args(graph_module), _output_descs(graph_module), strict=True):
        if out is not None and isinstance(desc, GradAOTOutput):
            outputs.append((out, _plain_input_index(desc.grad_of)))
    return outputs


def _value_fields(name: str, val: object, role: int, node: fx.Node) -> dict[str, Any]:
    """The fields of a value with dtype and static shape from the fake tensor ``val`` of
    ``node``."""
    if not isinstance(val, torch.Tensor):
        raise TypeError(
            f"node `{node.name}` ({node.target}): value `{name}` is not a tensor "
            f"({type(val).__name__})"
        )
    dtype = _DTYPES.get(val.dtype)  # read once: a fake tensor's attributes cost a call each
    if dtype is None:
        raise ValueError(
            f"node `{node.name}` ({node.target}): dtype {val.dtype} of `{name}` has no IR dtype"
        )
    shape = val.shape
    if not {*map(type, shape)} <= {int}:  # a SymInt is symbolic
        raise ValueError(
            f"node `{node.name}` ({node.target}): `{name}` has symbolic shape "
            f"{tuple(shape)}; export with static shapes"
        )
    return {"name": name, "dtype": dtype, "shape": shape, "role": role}


# --------------------------------------------------------------------------------------------
# Nodes


def _op_overload(node: fx.Node) -> torch._ops.OpOverload:
    if not isinstance(node.target, torch._ops.OpOverload):
        raise TypeError(
            f"node `{node.name}` calls {node.target!r}, which is not an operator overload "
            "(higher-order ops and Python callables have no IR form)"
        )
    return node.target


def _node_op_facts(node: fx.Node) -> _OpFacts:
    """The facts of the op ``node`` calls, or of the write eager runs in its place where
    ``mark_functionalized_writes`` found one (``WRITTEN_AS_KEY``)."""
    op = _op_overload(node)
    written_as = node.meta.get(WRITTEN_AS_KEY)
    if written_as is None:
        return _op_facts(op)
    if written_as == WRITE_BACK_VIEW:
        return _write_back_facts(op)
    return _op_facts(written_as)


# Where ``mark_functionalized_writes`` puts what eager runs for an op functionalization
# rewrote: the in-place overload, or ``WRITE_BACK_VIEW`` for a write-back scatter.
WRITTEN_AS_KEY = "recompute.written_as"
WRITE_BACK_VIEW = "view of its base"


def mark_functionalized_writes(graph: fx.Graph, forward: set[fx.Node]) -> None:
    """Marks the ops of a functionalized joint graph (``torch.compile``'s) that eager runs as
    writes, so its IR is the in-place program eager runs and the exporter exports:

    - in forward, the ops an in-place call traced (``IN_PLACE_CALL_KEY``): an out-of-place op
      whose in-place form writes its first argument (``div`` for ``div_``, ``copy`` for
      ``copy_``, ``index_put`` for ``index_put_``) and whose result has that argument's shape
      and dtype is that in-place form; a scatter of a view back into its base
      (``slice_scatter``, ...) is a view of the base, which eager wrote through the view. The
      call's other ops (the views it takes, the copy autograd keeps of what it overwrites)
      are what they are;
    - in backward, where autograd's own formulas write in place (a write into a view makes an
      empty buffer and copies into it): such an out-of-place op whose first argument is a
      buffer of undefined contents nothing else reads.

    Without this, a plan of the functionalized graph counts a new tensor for every write, and
    may save a kept tensor that eager writes in place where the exported step's plan replays it
    with its writers.
    """
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        written_as = (
            _written_by_in_place_call(node) if node in forward else _written_into_new_buffer(node)
        )
        if written_as is not None:
            node.meta[WRITTEN_AS_KEY] = written_as


def _written_by_in_place_call(node: fx.Node) -> torch._ops.OpOverload | str | None:
    if in_place_call(node) is None:
        return None
    if _op_overload(node).overloadpacket.__name__ in _WRITE_BACKS:
        return WRITE_BACK_VIEW
    return _in_place_write(node)


def in_place_call(node: fx.Node) -> str | None:
    """The in-place tensor method whose call traced ``node`` (``div_``, ``__setitem__``), or
    None: ``_TracedAsEager``'s annotation, else the call Dynamo recorded the node under."""
    custom = node.meta.get("custom")
    if custom and IN_PLACE_CALL_KEY in custom:
        return str(custom[IN_PLACE_CALL_KEY])
    calls = node.meta.get("source_fn_stack")
    if not calls:
        return None
    target = calls[-1][1]
    if isinstance(target, str):  # a method call
        return target if target in _IN_PLACE_METHOD_NAMES else None
    return _IN_PLACE_OPERATORS.get(target)


def _written_into_new_buffer(node: fx.Node) -> torch._ops.OpOverload | None:
    first = node.args[0] if node.args else None
    if not (
        isinstance(first, fx.Node)
        and isinstance(first.target, torch._ops.OpOverload)
        and first.target.overloadpacket.__name__ in _NEW_BUFFERS
        and len(first.users) == 1
    ):
        return None
    return _in_place_write(node)


def _in_place_write(node: fx.Node) -> torch._ops.OpOverload | None:
    """The in-place form of the node's op, if the node can be it: its result has its first
    argument's shape and dtype, as the result of writing that argument in place has."""
    in_place = _in_place_form(_op_overload(node))
    return in_place if in_place is not None and _result_is_first_argument_sized(node) else None


# Functionalization's write of an updated view back into its base.
_WRITE_BACKS = frozenset(
    {"slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter"}
)
# Ops that make a buffer whose contents are undefined: an op reading one that nothing else
# reads can only be what overwrites it, in place in eager (autograd's write into a view copies
# the gradient into a `new_empty_strided` buffer). A zeroed buffer proves nothing: autograd
# formulas also add into one out of place (`new_zeros(...).index_add(...)`).
_NEW_BUFFERS = frozenset({"new_empty_strided", "new_empty", "empty_like", "empty_strided"})


@functools.cache
def _write_back_facts(op: torch._ops.OpOverload) -> _OpFacts:
    """A write-back's facts as a view of its base (``self``)."""
    return replace(_op_facts(op), view_of="self")


@functools.cache
def _in_place_form(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op``'s in-place overload (``aten.div_.Tensor`` for ``aten.div.Tensor``) when it
    writes the first argument; None for an op that writes already or has no such form."""
    if _op_facts(op).written:
        return None
    packet = getattr(getattr(torch.ops, op.namespace), f"{op.overloadpacket.__name__}_", None)
    in_place = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(in_place, torch._ops.OpOverload):
        return None
    first = in_place._schema.arguments[0].name if in_place._schema.arguments else None
    return in_place if first is not None and _op_facts(in_place).written == (first,) else None


def _result_is_first_argument_sized(node: fx.Node) -> bool:
    """Whether the node's result has its first argument's shape and dtype, as the result of
    writing that argument in place has."""
    first = node.args[0] if node.args else None
    result = node.meta.get("val")
    argument = first.meta.get("val") if isinstance(first, fx.Node) else None
    return (
        isinstance(result, torch.Tensor)
        and isinstance(argument, torch.Tensor)
        and result.shape == argument.shape
        and result.dtype == argument.dtype
    )


@dataclass(frozen=True)
class _ArgumentFacts:
    """What the exporter reads of one schema argument, read from the schema once per op."""

    name: str
    kwarg_only: bool
    is_tensor: bool  # Tensor, Tensor?, Tensor[] or Tensor?[]
    has_default: bool


@dataclass(frozen=True, eq=False)
class _OpFacts:
    """An operator's name, arguments and schema facts, computed once per operator overload:
    a graph calls the same few dozen overloads thousands of times, and reading a schema from
    Python costs more than building the node's IR. Compared and hashed by identity (each is
    made once and cached), so it is a cheap key."""

    name: str  # namespace.name.overload
    arguments: tuple[_ArgumentFacts, ...]
    written: tuple[str, ...]  # the arguments the op writes, ``(a!)``
    view_of: str | None  # the argument its first output is a view of
    random: bool
    collective: int

    @functools.cached_property
    def positioned(self) -> frozenset[str]:
        """The tensor arguments whose input positions the schema facts read."""
        names = set(self.written)
        if self.view_of is not None:
            names.add(self.view_of)
        return frozenset(names)

    def schema_fields(self, positions: dict[str, list[int]]) -> dict[str, Any]:
        """The fields of the node's schema facts; ``positions`` maps each tensor argument
        name in ``positioned`` to its positions in the node's IR inputs."""
        fields: dict[str, Any] = {"random": self.random, "collective": self.collective}
        if self.written:
            fields["mutates"] = sorted(
                p for name in self.written for p in positions.get(name, ())
            )
        if self.view_of is not None and positions.get(self.view_of):
            fields["view_of"] = positions[self.view_of][0]
        return fields


@functools.cache
def _op_facts(op: torch._ops.OpOverload) -> _OpFacts:
    arguments = op._schema.arguments
    return _OpFacts(
        name=str(op),
        arguments=tuple(
            _ArgumentFacts(
                name=arg.name,
                kwarg_only=arg.kwarg_only,
                is_tensor=_is_tensor_type(arg.type),
                has_default=arg.has_default_value(),
            )
            for arg in arguments
        ),
        written=tuple(
            arg.name for arg in arguments if arg.alias_info is not None and arg.alias_info.is_write
        ),
        view_of=_view_base(op),
        random=is_random(op),
        collective=_collective_kind(op),
    )


# Where a bound argument's value is (``_binding``): its index in ``node.args`` when >= 0.
_KEYWORD = -1  # node.kwargs[name]
_ABSENT_TENSOR = -2  # a tensor argument left out: None


class _BoundArgument(NamedTuple):
    """A schema argument a call passes, and where its value is."""

    name: str
    source: int  # its index in ``node.args``, ``_KEYWORD`` or ``_ABSENT_TENSOR``
    is_tensor: bool
    positioned: bool  # the schema facts read its input positions (``_OpFacts.positioned``)


# Bindings by (op facts, positional count, keyword names): a graph makes the same few calls
# thousands of times.
_BINDINGS: dict[tuple[_OpFacts, int, tuple[str, ...]], tuple[_BoundArgument, ...]] = {}


def _binding(node: fx.Node, facts: _OpFacts) -> tuple[_BoundArgument, ...]:
    """The schema arguments the node passes, in schema order; the same for every call of the
    op with as many positional arguments and the same keywords.

    Arguments left at their default are skipped (None for tensors): FX records only what the
    caller passed, and Python sees enum defaults (``ScalarType dtype=long``) as bare ints.
    """
    key = (facts, len(node.args), tuple(node.kwargs))
    binding = _BINDINGS.get(key)
    if binding is None:
        binding = _BINDINGS[key] = tuple(_bind(node, facts))
    return binding


def _bind(node: fx.Node, facts: _OpFacts) -> Iterator[_BoundArgument]:
    positional, kwargs = len(node.args), node.kwargs
    for index, arg in enumerate(facts.arguments):
        if index < positional and not arg.kwarg_only:
            source = index
        elif arg.name in kwargs:
            source = _KEYWORD
        elif arg.is_tensor:
            source = _ABSENT_TENSOR
        elif not arg.has_default:
            raise ValueError(f"node `{node.name}` ({facts.name}): argument `{arg.name}` is missing")
        else:  # left at its default
            continue
        yield _BoundArgument(arg.name, source, arg.is_tensor, arg.name in facts.positioned)


def _is_tensor_type(schema_type: Any) -> bool:
    """``Tensor``, ``Tensor?``, ``Tensor[]`` or ``Tensor?[]``."""
    if isinstance(schema_type, torch.OptionalType):
        return _is_tensor_type(schema_type.getElementType())
    if isinstance(schema_type, torch.ListType):
        return _is_tensor_type(schema_type.getElementType())
    return isinstance(schema_type, torch.TensorType)


def _script_object_type(node: fx.Node, attr: fx.Node) -> str:
    """A TorchBind argument (process group, reduce op) as its qualified type name."""
    obj = getattr(attr.graph.owning_module, str(attr.target))
    if not isinstance(obj, torch.ScriptObject):
        raise TypeError(
            f"node `{node.name}` ({node.target}) reads graph attribute `{attr.target}`, "
            "which is not a TorchBind object"
        )
    return obj._type().qualified_name()


# --------------------------------------------------------------------------------------------
# Schema facts


def schema_facts(
    op: torch._ops.OpOverload, positions: dict[str, list[int]]
) -> graph_pb2.SchemaFacts:
    """Mutation, view, randomness and collective kind of ``op`` (the IR's schema facts).

    ``positions`` maps each tensor argument name to its positions in the node's IR inputs.
    """
    return graph_pb2.SchemaFacts(**_op_facts(op).schema_fields(positions))


def _view_base(op: torch._ops.OpOverload) -> str | None:
    """The argument the first output is a (non-writing) alias of, if any.

    ``Tensor(a)`` returns share an alias set with their base argument. List returns
    (``Tensor(a)[]``: ``unbind``, ``split``) expose empty alias sets to Python; their base is
    the argument annotated ``(a -> *)``.
    """
    returns = op._schema.returns
    if not returns or returns[0].alias_info is None or returns[0].alias_info.is_write:
        return None
    out = returns[0].alias_info
    for arg in op._schema.arguments:
        info = arg.alias_info
        if info is None or info.is_write:
            continue
        if out.before_set & info.before_set or (not out.before_set and "*" in info.after_set):
            return arg.name
    return None


def is_random(op: torch._ops.OpOverload) -> bool:
    """Random ops: every aten sampler carries the ``nondeterministic_seeded`` tag."""
    return torch.Tag.nondeterministic_seeded in op.tags


def _collective_kind(op: torch._ops.OpOverload) -> int:
    return collective_kind(str(op))


def collective_kind(op: str) -> int:
    """The collective kind of ``op`` (``namespace.name.overload``) by the planner's own op
    knowledge: FUNCTIONAL for ``_c10d_functional`` ops (MUTATING if the name ends in ``_``),
    MUTATING for the ``c10d`` namespace, whose in-place ops do not always carry ``(a!)``."""
    return _COLLECTIVE_KINDS[_native.collective_kind(op)]


# --------------------------------------------------------------------------------------------
# Annotations


def trim_stack_trace(trace: str, frames: int = STACK_TRACE_FRAMES) -> list[str]:
    """Keeps the lines of the innermost ``frames`` frames (a frame starts at ``File "...``)."""
    lines = [line.strip() for line in trace.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith('File "')]
    if len(starts) <= frames:
        return lines[starts[0]:] if starts else lines
    return lines[starts[-frames]:]
