"""Graphs of GPU runs exported on a CPU-only machine, with fake CUDA tensors.

A step traced on CPU lacks what only a GPU run has: the device-to-host ``_to_copy`` of routing
counts that feeds all-to-all split sizes, and the host-to-device copies back. Under
``FakeTensorMode`` CUDA tensors exist without a GPU (no memory, no kernels; shapes, dtypes and
devices propagate), so ``export_joint_on_device`` and ``export_forward_on_device`` trace the
step with every parameter, buffer and input a fake tensor on ``device`` (``cuda`` means
``cuda:0``) and factory calls defaulting to it: the graph's ops carry the real devices
(``device`` attributes ``cuda:0`` / ``cpu``), the copies between them, and the decompositions
torch picks for CUDA tensors. Values keep the exporter's names, and the IR follows the
exporter's rules (``recompute_planner._exporter``): node order, phases, annotations.

The backward pass. Torch's autograd engine cannot run a backward over CUDA tensors without a
GPU, fake ones included: when a node of the backward graph takes a CUDA gradient, the engine
records every CUDA device's current stream before it starts
(``GraphTask::stash_current_streams``), asking the CUDA hooks whether each device the CUDA
device guard counts has a primary context. Under ``FakeTensorMode`` that guard is torch's fake
one (8 devices) while the hooks count the real devices (none), so the first query fails:
"hasPrimaryContext expects a valid device index". (Tracing on the ``meta`` device instead
runs the engine but names no CUDA device and loses backward nodes: in AOTAutograd's trace
``nll_loss`` has no autograd kernel there, so the loss's backward is dropped.) So the joint
export replays the engine in Python for the one call AOTAutograd makes,
``torch.autograd.grad(outputs, inputs, grad_outputs)`` (``_ReplayEngine``, installed as
``Variable._execution_engine`` for the capture only):

- the same nodes run: those on a path from the outputs to an input (``init_to_execute``); an
  input's gradient is what reaches its edge;
- in the same order: of the nodes whose incoming gradients are complete, the one with the
  highest sequence number (the latest created in forward) first;
- with the same bookkeeping: a node's outputs are checked against the consumer's metadata
  (``sum_to_size`` to its shape, ``to`` its dtype, as ``validate_outputs``), gradients reaching
  one slot are summed with ``+`` in arrival order, a node runs with grad mode as
  ``create_graph``;
- AOTAutograd's stack-trace hooks, which give each backward op its forward node's stack and
  sequence number (and through it the forward node's annotations), run before and after each
  node: AOTAutograd registers them with the replay instead of the nodes.

The replay is checked against torch's engine: every CPU golden exported through it is
byte-identical to its committed graph (``python/tests/test_device_export.py``).

Limits:

- hooks registered on tensors or autograd nodes during the step cannot be replayed and are
  refused (``NotImplementedError``), as are a custom ``autograd.Function`` receiving an undefined
  gradient (whether it materializes zeros is not visible from Python) and one whose tensor
  inputs cannot be told from its other inputs;
- one ready queue: a GPU run schedules backward nodes taking CPU gradients on the CPU's queue,
  concurrently with the device's; here every node runs in the one priority order (the same as
  a run whose backward runs on one device);
- kernel choices made from the GPU's properties cannot be made without it: given a hardware
  profile (``hw``), the device queries (``torch.cuda.get_device_capability``,
  ``get_device_properties``, ``get_device_name``) answer with its device, and
  ``scaled_dot_product_attention`` runs the fused kernel that device picks by torch's rules
  (``_DeviceAttention``); other kernel choices, and all of them without a profile, take the
  fallback torch takes on a CPU-only machine;
- nothing runs on the device, so the export has no reference tensors of its own:
  ``with_device_graph`` gives the graph those of the same step exported and run on this CPU
  (weights, inputs, tangents, PyTorch's loss and gradients). A runtime runs such a graph on
  the CPU by running its device arguments on its own device, and the results then match that
  reference within float tolerance (other kernels, the same step).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.function import BackwardCFunction, _HookMixin
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

from . import _exporter as low
from . import api
from ._compiled_regions import traced_as_regions
from ._exporter import ModelDecl
from .proto import graph_pb2

# Gradient edge: (autograd node, input slot of that node).
Edge = tuple[Any, int]
# The gradients a node takes in or hands on, one per slot (None: undefined).
Grads = list[torch.Tensor | None]


class _Functional(nn.Module):
    """``module`` called with its parameters and buffers passed in (``functional_call``), so
    AOTAutograd lifts fake tensors as inputs; ``module`` is held unregistered."""

    inner: nn.Module

    def __init__(self, module: nn.Module, state_names: list[str]):
        super().__init__()
        object.__setattr__(self, "inner", module)
        self.state_names = state_names

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        count = len(self.state_names)
        state = dict(zip(self.state_names, flat[:count], strict=True))
        loss: torch.Tensor = torch.func.functional_call(self.inner, state, flat[count:])
        return loss


def export_joint_on_device(
    module: nn.Module,
    args: tuple[Any, ...],
    *,
    name: str,
    models: list[ModelDecl],
    device: str = "cuda",
    world_size: int = 1,
    rank: int = 0,
) -> graph_pb2.Graph:
    """The joint forward+backward graph of ``module(*args)`` (the scalar loss) as it runs on
    ``device`` (see the module docstring)."""
    return export_on_device(
        module, args, joint=True, name=name, models=models, device=device,
        world_size=world_size, rank=rank,
    )


def export_forward_on_device(
    module: nn.Module,
    args: tuple[Any, ...],
    *,
    name: str,
    models: list[ModelDecl],
    device: str = "cuda",
    world_size: int = 1,
    rank: int = 0,
) -> graph_pb2.Graph:
    """The forward graph of ``module(*args)`` as it runs on ``device``, traced without
    autograd (see the module docstring)."""
    return export_on_device(
        module, args, joint=False, name=name, models=models, device=device,
        world_size=world_size, rank=rank,
    )


def with_device_graph(result: low.ExportResult, graph: graph_pb2.Graph) -> low.ExportResult:
    """``result``, the step exported and run on this CPU, for ``graph``, the same step traced
    on another device: the same weights, inputs, tangents and reference loss, and each
    reference gradient named after ``graph``'s gradient of the same input.

    Both exports list the loss, then the gradients in the order of the inputs they belong to,
    so the gradients pair up by position; a pair of another dtype or shape, or graph inputs
    that differ, mean the two graphs are not one step, and raise ``ValueError``.
    """
    values = {v.name: v for v in graph.values}
    cpu_values = {v.name: v for v in result.graph.values}
    if _graph_inputs(graph) != _graph_inputs(result.graph):
        raise ValueError(f"{graph.name}: the graph inputs differ from the CPU export's")
    if len(graph.outputs) != len(result.graph.outputs):
        raise ValueError(f"{graph.name}: another number of outputs than the CPU export's")
    grads = {}
    for cpu, own in zip(result.graph.outputs, graph.outputs, strict=True):
        if _tensor_type(cpu_values[cpu]) != _tensor_type(values[own]):
            raise ValueError(f"{graph.name}: output `{own}` does not pair with `{cpu}`")
        if cpu in result.grads:
            grads[own] = result.grads[cpu]
        elif values[own].role != graph_pb2.ROLE_LOSS:
            raise ValueError(f"{graph.name}: output `{own}` is not the loss")
    return replace(result, graph=graph, grads=grads)


def _tensor_type(value: graph_pb2.Value) -> tuple[int, int, tuple[int, ...]]:
    return value.role, value.dtype, tuple(value.shape)


def _graph_inputs(graph: graph_pb2.Graph) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """The values no node produces (weights, inputs, tangents): name -> role, dtype, shape."""
    produced = {name for node in graph.nodes for name in node.outputs}
    return {v.name: _tensor_type(v) for v in graph.values if v.name not in produced}


def export_on_device(
    module: nn.Module,
    args: tuple[Any, ...],
    *,
    joint: bool,
    name: str,
    models: list[ModelDecl],
    device: str,
    world_size: int = 1,
    rank: int = 0,
    hw: api.HwLike = None,
) -> graph_pb2.Graph:
    """The joint (or, ``joint=False``, forward) graph of ``module(*args)`` as it runs on
    ``device``, traced with fake tensors: nothing is allocated, and parameters, buffers and
    inputs may be real or ``meta`` tensors. A GPU trace for the hardware profile ``hw`` (a
    shipped name such as ``"h100"``, fields or a file, as ``plan`` takes it) reports that
    device's facts and runs the fused attention kernel it picks (``_DeviceAttention``);
    without ``hw`` it takes torch's fallbacks on a CPU-only machine (math attention, which
    the runtime can run on the CPU: the device goldens)."""
    target = _indexed(torch.device(device))
    flat = low.flat_inputs(module, args)
    state = [f.path for f in flat[: len(flat) - len(args)]]
    backward = _replayed_autograd() if joint else contextlib.nullcontext()
    gpu = (
        _device_facts(hw) if target.type == "cuda" and hw is not None else contextlib.nullcontext()
    )
    with (
        torch.device(target),
        low.module_path_scopes(module),
        traced_as_regions(module),
        backward,
        gpu,
    ):
        graph_module, num_forward_outputs = low.capture(
            _Functional(module, state), _fake_inputs(flat, target), joint=joint
        )
    forward = (
        low.forward_nodes(graph_module, num_forward_outputs)
        if joint
        else set(low.op_nodes(graph_module))
    )
    built = low.build_graph(
        graph_module,
        forward,
        flat,
        name=name,
        models=models,
        metadata=low.graph_metadata(low.EXPORTER_VERSION, world_size, rank),
    )
    return built.graph


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:0``: fake tensors live on an indexed device, and factory calls
    defaulting to ``device`` then name the same one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


def _fake_inputs(flat: list[low.FlatInput], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each flat input as a fake tensor on ``device``, requiring grad as the real one does."""
    mode = FakeTensorMode()
    with mode:
        return tuple(
            mode.from_tensor(f.tensor).to(device).requires_grad_(f.tensor.requires_grad)
            for f in flat
        )


# --------------------------------------------------------------------------------------------
# The GPU a trace is for


@contextlib.contextmanager
def _device_facts(hw: api.HwLike) -> Iterator[None]:
    """Within the block, ``torch.cuda``'s device queries answer with ``hw``'s device (there is
    none to ask: HuggingFace's grouped-matmul experts read the compute capability), and
    ``scaled_dot_product_attention`` runs the fused kernel that device picks."""
    profile = json.loads(api.hw_profile(hw))
    major, minor = profile["compute_capability"]
    properties = SimpleNamespace(
        name=profile["name"],
        major=major,
        minor=minor,
        total_memory=int(profile["memory_bytes"]),
        multi_processor_count=profile["multiprocessors"],
    )
    with contextlib.ExitStack() as stack:
        for query, answer in (
            ("get_device_capability", (major, minor)),
            ("get_device_properties", properties),
            ("get_device_name", profile["name"]),
        ):
            stack.enter_context(_patched(torch.cuda, query, lambda *_a, _v=answer, **_k: _v))
        stack.enter_context(_DeviceAttention((major, minor)))
        yield


class _DeviceAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` on a CUDA tensor as a GPU of ``capability`` runs it.

    Without a GPU torch cannot ask the device which kernel fits and takes the math
    decomposition, which holds the S x S scores. A GPU runs a fused kernel when the inputs
    allow it; this picks it by torch's rules (``sdp_utils``), in torch's order:

    - flash attention (sm80+): fp16 / bf16, no mask, the same head size <= 256 (a multiple of
      8) for query, key and value; grouped-query heads natively;
    - memory-efficient attention (sm50+): fp16 / bf16 / fp32, an additive or boolean mask,
      query and key of the same head size (a multiple of 8, 4 for fp32), no grouped-query
      heads;
    - else the math decomposition, as on the GPU.

    It acts on tensors of ``device_type``: another type runs the same kernels on fake tensors
    of another device (a measurement on the CPU of the step the GPU runs).
    """

    def __init__(self, capability: tuple[int, int], device_type: str = "cuda"):
        super().__init__()
        self.capability = capability
        self.device_type = device_type

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = self._fused(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)

    def _fused(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor | None:
        if query.device.type != self.device_type or query.dim() != 4:
            return None
        head, value_head = query.size(-1), value.size(-1)
        grouped = enable_gqa and key.size(1) != query.size(1)
        if key.size(-1) != head:
            return None
        if (
            self.capability >= (8, 0)
            and query.dtype in (torch.float16, torch.bfloat16)
            and attn_mask is None
            and value_head == head <= 256
            and head % 8 == 0
        ):
            flash: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
            return flash
        alignment = 4 if query.dtype == torch.float32 else 8
        if (
            self.capability >= (5, 0)
            and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and not grouped
            and head % alignment == 0
            and value_head % alignment == 0
        ):
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                    attn_mask.logical_not(), float("-inf")
                )
            needs_grad = any(t.requires_grad for t in (query, key, value))
            efficient: torch.Tensor = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
            return efficient
        return None


# --------------------------------------------------------------------------------------------
# The autograd engine, replayed


@contextlib.contextmanager
def _replayed_autograd() -> Iterator[None]:
    """Within the block, ``torch.autograd.grad`` runs on ``_ReplayEngine``, AOTAutograd's
    stack-trace hooks are registered with it, and hooks registered on tensors or autograd
    nodes are refused."""
    from torch._functorch._aot_autograd import graph_capture_wrappers  # a third of a second

    engine = _ReplayEngine()
    # Imported there from its own module, which torch's typing does not re-export.
    original_setup: Callable[[list[Any]], None] = (
        graph_capture_wrappers.setup_stacktrace_preservation_hooks  # type: ignore[attr-defined]
    )

    def setup_hooks(roots: list[Any]) -> None:
        original_setup([_HookRecorder(root, engine) for root in roots])

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(Variable, "_execution_engine", engine))
        stack.enter_context(
            _patched(graph_capture_wrappers, "setup_stacktrace_preservation_hooks", setup_hooks)
        )
        stack.enter_context(
            _patched(_HookMixin, "_register_hook", staticmethod(_refuse("an autograd node")))
        )
        stack.enter_context(_patched(torch.Tensor, "register_hook", _refuse("a tensor")))
        yield


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` within the block; restored (or removed, when ``owner`` only
    inherited it) after."""
    own = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _refuse(target: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"a hook is registered on {target} during the step: the device export replays the "
            "autograd engine and cannot run hooks; export the model without it"
        )

    return refuse


@dataclass
class _Hooks:
    """A node's pre-hooks (called with its incoming gradients) and post-hooks (called with its
    outgoing and incoming gradients), in registration order."""

    pre: list[Callable[..., Any]] = field(default_factory=list)
    post: list[Callable[..., Any]] = field(default_factory=list)


class _HookRecorder:
    """Stands for an autograd node while AOTAutograd walks the graph to register its
    stack-trace hooks: the walk reads the node, the hooks go to the replay engine."""

    def __init__(self, node: Any, engine: _ReplayEngine):
        self.node = node
        self._engine = engine

    def __hash__(self) -> int:
        return hash(self.node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HookRecorder) and other.node is self.node

    @property
    def next_functions(self) -> tuple[tuple[_HookRecorder | None, int], ...]:
        return tuple(
            (None if child is None else _HookRecorder(child, self._engine), slot)
            for child, slot in self.node.next_functions
        )

    @property
    def metadata(self) -> dict[str, Any]:
        metadata: dict[str, Any] = self.node.metadata
        return metadata

    def _sequence_nr(self) -> int:
        return int(self.node._sequence_nr())

    def register_prehook(self, hook: Callable[..., Any]) -> None:
        self._engine.hooks(self.node).pre.append(hook)

    def register_hook(self, hook: Callable[..., Any]) -> None:
        self._engine.hooks(self.node).post.append(hook)


class _GraphRoot:
    """The node a backward from several outputs starts at: it hands each output its gradient
    (torch's ``GraphRoot``)."""

    def __init__(self, edges: list[Edge], grads: Grads):
        self.next_functions = tuple(edges)
        self.grads = grads


class _ReplayEngine:
    """Torch's autograd engine for ``torch.autograd.grad(outputs, inputs)``, replayed in Python
    (see the module docstring); ``Variable._execution_engine``'s interface."""

    def __init__(self) -> None:
        self._hooks: dict[Any, _Hooks] = {}
        self._callbacks: list[Callable[[], None]] = []

    def hooks(self, node: Any) -> _Hooks:
        return self._hooks.setdefault(node, _Hooks())

    def queue_callback(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` when the current backward pass finishes."""
        self._callbacks.append(callback)

    def run_backward(
        self,
        outputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor | None],
        keep_graph: bool,
        create_graph: bool,
        inputs: Sequence[torch.Tensor] = (),
        allow_unreachable: bool = False,
        accumulate_grad: bool = True,
    ) -> tuple[torch.Tensor | None, ...]:
        if accumulate_grad or not inputs:
            raise NotImplementedError(
                "the device export replays torch.autograd.grad(outputs, inputs) only"
            )
        roots = [_root_edge(t) for t in outputs]
        grads = _validate_outputs(roots, list(grad_outputs))
        task = _GraphTask(self, roots, grads, inputs)
        with torch.set_grad_enabled(create_graph):
            task.run()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        if not allow_unreachable and any(g is None for g in task.captured):
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
        return tuple(task.captured)

    def call(self, node: Any, grads: Grads) -> Grads:
        """Runs ``node`` on its incoming gradients, between its hooks; its outgoing gradients,
        checked against their consumers."""
        hooks = self._hooks.get(node, _Hooks())
        for hook in hooks.pre:
            replaced = hook(tuple(grads))
            if replaced is not None:
                grads = list(replaced)
        outputs = list(node.grads) if isinstance(node, _GraphRoot) else _apply(node, grads)
        outputs = _validate_outputs(list(node.next_functions), outputs)
        for hook in hooks.post:
            replaced = hook(tuple(outputs), tuple(grads))
            if replaced is not None:
                outputs = list(replaced)
        return outputs


def _root_edge(output: torch.Tensor) -> Edge:
    if output.grad_fn is None:
        raise NotImplementedError("the device export replays no backward from a leaf tensor")
    return output.grad_fn, output.output_nr


@dataclass
class _ExecInfo:
    """Whether a node runs (it has a path to an input) and the input gradients read from its
    incoming slots: (slot, index of the input)."""

    needed: bool = False
    captures: list[tuple[int, int]] = field(default_factory=list)

    def should_execute(self) -> bool:
        return self.needed or bool(self.captures)


class _GraphTask:
    """One backward pass: the dependency counts, which nodes run, the ready queue and the
    input buffers of nodes still waiting for gradients."""

    def __init__(
        self,
        engine: _ReplayEngine,
        roots: list[Edge],
        grads: Grads,
        inputs: Sequence[torch.Tensor],
    ):
        self.engine = engine
        self.root = roots[0][0] if len(roots) == 1 else _GraphRoot(roots, grads)
        nodes = _reachable(self.root)
        self.dependencies = _dependencies(nodes)
        self.exec_info = _exec_info(self.root, _input_edges(nodes, inputs))
        self.captured: Grads = [None] * len(inputs)
        self.not_ready: dict[Any, Grads] = {}
        self.ready: list[tuple[int, int, Any, Grads]] = []
        self.order = itertools.count()
        if isinstance(self.root, _GraphRoot):
            self.push(self.root, [])
        else:
            buffer: Grads = [None] * len(self.root._input_metadata)
            _accumulate(buffer, roots[0][1], grads[0])
            self.push(self.root, buffer)

    def push(self, node: Any, buffer: Grads) -> None:
        """Queues ``node`` with its complete incoming gradients."""
        heapq.heappush(self.ready, (-_priority(node), next(self.order), node, buffer))

    def run(self) -> None:
        while self.ready:
            *_, node, buffer = heapq.heappop(self.ready)
            self._evaluate(node, buffer)

    def _evaluate(self, node: Any, buffer: Grads) -> None:
        info = self.exec_info.get(node)
        if info is not None:
            for slot, index in info.captures:
                self.captured[index] = buffer[slot]
            if not info.needed:
                return
        outputs = self.engine.call(node, buffer)
        for (child, slot), grad in zip(node.next_functions, outputs, strict=True):
            if child is not None:
                self._deliver(child, slot, grad)

    def _deliver(self, child: Any, slot: int, grad: torch.Tensor | None) -> None:
        """Adds ``grad`` to ``child``'s input buffer; queues ``child`` once all its producers
        have run, if it is to run."""
        self.dependencies[child] -= 1
        is_ready = self.dependencies[child] == 0
        if is_ready:
            del self.dependencies[child]
        buffer = self.not_ready.pop(child, None)
        if buffer is None:
            info = self.exec_info.get(child)
            if info is None or not info.should_execute():
                return
            buffer = [None] * len(child._input_metadata)
        _accumulate(buffer, slot, grad)
        if is_ready:
            self.push(child, buffer)
        else:
            self.not_ready[child] = buffer


def _priority(node: Any) -> int:
    """The engine's ready-queue order: the highest sequence number first; the root precedes
    every node."""
    return 2**64 if isinstance(node, _GraphRoot) else node._sequence_nr()


def _children(node: Any) -> Iterator[Any]:
    return (child for child, _ in node.next_functions if child is not None)


def _reachable(root: Any) -> list[Any]:
    """``root`` and every node reachable from it."""
    seen = {root}
    stack = [root]
    while stack:
        for child in _children(stack.pop()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return list(seen)


def _dependencies(nodes: list[Any]) -> dict[Any, int]:
    """Per node, how many edges from ``nodes`` lead to it (``compute_dependencies``)."""
    counts: dict[Any, int] = {}
    for node in nodes:
        for child in _children(node):
            counts[child] = counts.get(child, 0) + 1
    return counts


def _input_edges(nodes: list[Any], inputs: Sequence[torch.Tensor]) -> list[Edge | None]:
    """Each input's gradient edge: its ``grad_fn`` output, or a leaf's accumulator among
    ``nodes`` (None when the backward never reaches it)."""
    accumulators = {
        id(node.variable): node
        for node in nodes
        if isinstance(node, torch._C._functions.AccumulateGrad)  # type: ignore[attr-defined]
    }
    edges: list[Edge | None] = []
    for tensor in inputs:
        if tensor.grad_fn is not None:
            edges.append((tensor.grad_fn, tensor.output_nr))
        elif id(tensor) in accumulators:
            edges.append((accumulators[id(tensor)], 0))
        else:
            edges.append(None)
    return edges


def _exec_info(root: Any, targets: list[Edge | None]) -> dict[Any, _ExecInfo]:
    """Which nodes run: those with a path to an input's edge, found by a post-order walk from
    the root (``GraphTask::init_to_execute``); the input edges capture their gradients."""
    info: dict[Any, _ExecInfo] = {}
    for index, edge in enumerate(targets):
        if edge is not None:
            node, slot = edge
            info.setdefault(node, _ExecInfo()).captures.append((slot, index))
    info.setdefault(root, _ExecInfo())

    def executes(node: Any) -> bool:
        return node in info and info[node].should_execute()

    seen: set[Any] = set()
    stack = [(root, _children(root))]
    while stack:
        node, children = stack[-1]
        for child in children:
            if child not in seen:
                seen.add(child)
                stack.append((child, _children(child)))
                break
            if executes(child):
                info.setdefault(node, _ExecInfo()).needed = True
        else:
            stack.pop()
            if stack and executes(node):
                info.setdefault(stack[-1][0], _ExecInfo()).needed = True
    return info


def _accumulate(buffer: Grads, slot: int, grad: torch.Tensor | None) -> None:
    """Adds ``grad`` into ``buffer[slot]`` (``InputBuffer::add``; fake tensors are never summed
    in place)."""
    if grad is None:
        return
    held = buffer[slot]
    buffer[slot] = grad if held is None else held + grad


def _validate_outputs(edges: list[Edge], grads: Grads) -> Grads:
    """Each gradient as its consumer takes it: summed to its shape, cast to its dtype."""
    if len(edges) != len(grads):
        raise RuntimeError(
            f"invalid number of gradients - expected {len(edges)}, but got {len(grads)}"
        )
    for index, ((node, slot), grad) in enumerate(zip(edges, grads, strict=True)):
        if node is None or grad is None:
            continue
        metadata = node._input_metadata[slot]
        if tuple(grad.shape) != tuple(metadata.shape):
            grad = grad.sum_to_size(metadata.shape)
        if grad.dtype != metadata.dtype:
            grad = grad.to(metadata.dtype)
        grads[index] = grad
    return grads


def _apply(node: Any, grads: Grads) -> Grads:
    """Calls ``node``; its outgoing gradients, one per next edge (None when undefined)."""
    if isinstance(node, BackwardCFunction):
        return _apply_python_function(node, grads)
    result = node(*grads)
    return list(result) if isinstance(result, tuple) else [result]


def _apply_python_function(node: BackwardCFunction, grads: Grads) -> Grads:
    """A custom ``autograd.Function``'s backward (``PyNode::apply``): the gradients it returns
    for its tensor inputs."""
    if any(g is None for g in grads):
        raise NotImplementedError(
            f"{_function_name(node)} receives an undefined gradient: the device export cannot tell "
            "whether it materializes zeros"
        )
    result = node.apply(*grads)
    result = result if isinstance(result, tuple) else (result,)
    return [result[i] if i < len(result) else None for i in _tensor_inputs(node)]


def _function_name(node: BackwardCFunction) -> str:
    """The backward node's name (``MyFunctionBackward``), which torch's typing leaves out."""
    return str(node.name())  # type: ignore[attr-defined]


def _tensor_inputs(node: BackwardCFunction) -> list[int]:
    """Positions of a custom Function's tensor inputs among its forward inputs: all of them
    when there are as many edges as inputs, else those requiring grad."""
    needs = node.needs_input_grad
    edges = len(node.next_functions)
    if len(needs) == edges:
        return list(range(edges))
    requiring = [i for i, need in enumerate(needs) if need]
    if len(requiring) != edges:
        raise NotImplementedError(
            f"{_function_name(node)}: cannot tell its tensor inputs from its other inputs"
        )
    return requiring


__all__ = [
    "export_forward_on_device",
    "export_joint_on_device",
    "export_on_device",
    "with_device_graph",
]
