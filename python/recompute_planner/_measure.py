"""Measured activation memory of one eager training step on CPU, to check the planner's
memory prediction.

The planner predicts the peak of live bytes during one training step, parameters excluded
(docs/cost-and-memory.md, `planner/src/memory.rs`). This module runs the same step eagerly on
CPU and measures that quantity from the allocator: ``torch.profiler`` with ``profile_memory=True``
reports every CPU allocation and free with its pointer and size. The CPU allocator does not
cache, so the events are real ``malloc``/``free`` of tensor storages, and their running sum from
the start of the step is exactly the bytes the step allocated and still holds. Parameters are
allocated before the step, so they never enter the sum, nor does anything else the caller
already held; the step's inputs are added back because the planner counts them (graph inputs
that are not parameters are live from the first step).

``measure_step`` measures any step given as a loss callable and its parameters (a stock
HuggingFace model's ``model(**inputs).loss``; ``scripts/predictions.py``), and also reports
what the step holds when forward ends (``StepMemory.saved_bytes``).

The step is the exporter's (``_exporter._eager_reference``): ``loss = module(*inputs)``, then
``torch.autograd.grad(loss, params)``, which returns fresh gradients and leaves ``.grad``
alone (no accumulation into existing buffers). The loss and the gradients are held to the end,
as the planner keeps graph outputs alive to the end; the backward seed (``ones_like(loss)``,
the graph's tangent) is allocated inside the step.

Three of the plan's numbers have an eager counterpart (``measure_golden``):

- ``NO_CHECKPOINT`` (plan key ``no_checkpoint_peak_bytes``): the plain step;
- ``WHOLE_LAYER`` (``full_recompute_peak_bytes``): every layer (what each ``layer_scope``
  encloses: a decoder layer, the MTP layer) under non-reentrant ``torch.utils.checkpoint``;
- ``SELECTIVE`` (``peak_bytes`` of a plan): the same checkpoints with a selective-checkpoint
  policy that saves the ops whose outputs the plan saves (``plan_contexts``, through
  ``recompute_planner.sac``; saving every op the plan keeps would also hold outputs nothing
  after forward reads).

Checkpoints stash the CPU generator state (``preserve_rng_state``, 5056 bytes a layer on the
CPU allocator) where eager selective checkpointing does: in the layers with random ops, as each
layer's policy asks (``recompute_planner.sac``); a whole-layer checkpoint of the zoo's layers
has random ops exactly when the model has dropout. The planner counts the stash on a graph
traced on the CPU (docs/cost-and-memory.md, "Generator state").

Measurement details that keep the numbers those of the step's tensors: oneDNN off while
measuring (``no_onednn``: its bfloat16 matmul allocates a scratchpad through the CPU allocator
inside every ``mm``, sized by its CPU kernel's blocking, not by the step's tensors), one
intra-op thread (some kernels size their scratch buffers by thread count), one warm-up step
first (lazy initialisation allocates once), the global RNG seeded inside a fork around the
steps, and frees of blocks allocated before the step ignored (an earlier step's leftovers,
such as the output of a functional collective nobody waited on, may be released during this
one). A step whose every op is a node of the planned graph (a compiled step) can also be
measured without its kernels' other scratch (``measure_step(op_scratch=False)``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from . import _host_memory as host_memory

if TYPE_CHECKING:
    from ._zoo.model import CausalLM
    from .plans import Plan
    from .sac import ContextFn

# The planner baselines measured here, with the plan's `memory` key each one predicts.
NO_CHECKPOINT = "no_checkpoint"
WHOLE_LAYER = "whole_layer"
BASELINE_KEYS = {
    NO_CHECKPOINT: "no_checkpoint_peak_bytes",
    WHOLE_LAYER: "full_recompute_peak_bytes",
}
# A plan's own keep policy (plan key `peak_bytes`), run as eager selective checkpointing.
SELECTIVE = "selective"

# Stages of the step, as `record_function` ranges around the two halves.
FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class Allocation:
    """One allocator event: ``nbytes`` > 0 allocates the block at ``ptr``, < 0 frees it."""

    ptr: int
    nbytes: int
    op: str  # outermost aten op running (else the innermost range, e.g. an autograd node)
    inner_op: str  # innermost op running ("" outside every op)
    stage: str  # FORWARD or BACKWARD ("" outside both)
    call: int = -1  # which call of the outermost aten op (numbered in time order; -1 outside)


@dataclass
class MemoryTrace:
    """The CPU allocator events of one step, in time order."""

    events: list[Allocation]

    def running(self) -> list[int]:
        """Bytes held after each event, relative to the start of the trace."""
        out, live = [], 0
        for event in self.events:
            live += event.nbytes
            out.append(live)
        return out

    def peak(self) -> tuple[int, int]:
        """(largest running sum, index of the first event reaching it); (0, -1) if empty."""
        best, at = 0, -1
        for index, live in enumerate(self.running()):
            if live > best:
                best, at = live, index
        return best, at

    def held_after(self, stage: str) -> int:
        """Bytes held after the last event of ``stage`` (relative to the start)."""
        held = 0
        for event, live in zip(self.events, self.running(), strict=True):
            if event.stage == stage:
                held = live
        return held

    def without_op_scratch(self) -> MemoryTrace:
        """The trace without the blocks an op allocates and frees within one call: a kernel's
        scratch, no op's output (the events of the other blocks, in order)."""
        made: dict[int, int] = {}
        scratch: set[int] = set()  # indices of the scratch blocks' events
        for index, event in enumerate(self.events):
            if event.nbytes > 0:
                made[event.ptr] = index
                continue
            start = made.pop(event.ptr, None)
            if start is not None and event.call >= 0 and self.events[start].call == event.call:
                scratch.update((start, index))
        return MemoryTrace([e for i, e in enumerate(self.events) if i not in scratch])

    def live_at(self, index: int) -> list[Allocation]:
        """The allocations made up to event ``index`` (inclusive) and not yet freed."""
        live: dict[int, Allocation] = {}
        for event in self.events[: index + 1]:
            if event.nbytes > 0:
                live[event.ptr] = event
            else:
                live.pop(event.ptr, None)
        return list(live.values())


@dataclass
class StepMemory:
    """One measured step: its peak and where it happened."""

    peak_bytes: int  # largest running sum of the step's allocations, plus the inputs
    peak_with_op_scratch_bytes: int  # the same, ops' scratch counted (measure_step)
    input_bytes: int  # the step's inputs, held by the caller throughout
    output_bytes: int  # the loss and the gradients, alive at the end
    saved_bytes: int  # what the step holds when forward ends, the loss aside
    peak_stage: str
    peak_op: str
    trace: MemoryTrace = field(repr=False)
    # Bytes the step copied to host memory (offload), outside the allocator the peak reads.
    moved_to_host_bytes: int = 0

    def peak_breakdown(self, top: int = 12) -> list[tuple[str, str, int, int]]:
        """The largest groups of live allocations at the peak: (stage, op, bytes, count)."""
        _, at = self.trace.peak()
        groups: Counter[tuple[str, str]] = Counter()
        counts: Counter[tuple[str, str]] = Counter()
        for a in self.trace.live_at(at):
            groups[(a.stage, a.op)] += a.nbytes
            counts[(a.stage, a.op)] += 1
        return [(s, o, b, counts[(s, o)]) for (s, o), b in groups.most_common(top)]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.element_size() * t.numel()


def trace_allocations(fn: Callable[[], Any]) -> tuple[MemoryTrace, Any]:
    """Runs ``fn`` under the CPU memory profiler; returns its allocator events and result.

    Events are attributed to the ops running when they happen (the profiler's event tree) and
    to the ``FORWARD`` / ``BACKWARD`` ranges ``fn`` may open.
    """
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    timed: list[tuple[int, Allocation]] = []

    calls = itertools.count()  # numbers the outermost aten op calls

    def walk(node: Any, ops: tuple[str, ...], stage: str, call: int) -> None:
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                outer = next((o for o in ops if o.startswith("aten::")), ops[-1] if ops else "")
                event = Allocation(
                    fields.ptr, fields.alloc_size, outer, ops[-1] if ops else "", stage, call
                )
                timed.append((node.start_time_ns, event))
            return
        if node.name in (FORWARD, BACKWARD):
            stage = node.name
        else:
            if call < 0 and node.name.startswith("aten::"):
                call = next(calls)
            ops = ops + (node.name,)
        for child in node.children:
            walk(child, ops, stage, call)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, (), "", -1)
    # A stable sort: events of one thread come out of the tree in order already.
    timed.sort(key=lambda item: item[0])
    return MemoryTrace(_own_events(event for _, event in timed)), result


def _own_events(events: Iterable[Allocation]) -> list[Allocation]:
    """Drops frees of blocks allocated before the trace: they are not the step's bytes.

    A previous step can leave tensors behind that this one releases (an unwaited functional
    collective's output, held by funcol's work registry until a later call cleans it up);
    counting their frees would lower the running sum below what the step holds.
    """
    live: set[int] = set()
    own = []
    for event in events:
        if event.nbytes > 0:
            live.add(event.ptr)
        elif event.ptr in live:
            live.discard(event.ptr)
        else:
            continue
        own.append(event)
    return own


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread for the block (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def no_onednn() -> Iterator[None]:
    """oneDNN (MKL-DNN) off for the block (restored after).

    On CPU, a bfloat16 ``mm`` runs oneDNN's matmul, which allocates its scratchpad through the
    CPU allocator for the length of the call: the Mixtral experts' weight gradients (grouped
    mm of 4 experts, bf16, batch 2 x seq 8) measured 87,168 B above their tensors at the
    step's peak. Its size comes from the CPU kernel's blocking (ISA, thread count), not from
    the step's tensors, and a GPU step has no such allocation (cuBLAS's workspace is
    allocated once per handle). Without oneDNN, a bf16 ``mm`` allocates nothing but its
    output through the allocator (as a float32 ``mm`` does either way).
    """
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def training_step(
    module: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> Callable[[], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """The exporter's eager step: the loss, then every parameter's gradient (autograd.grad)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return loss_and_gradients(lambda: module(*inputs), params)


def loss_and_gradients(
    loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]
) -> Callable[[], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """``loss_fn()`` in the ``FORWARD`` range, then the gradients of ``params`` in
    ``BACKWARD``."""

    def step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with record_function(FORWARD):
            loss = loss_fn()
        with record_function(BACKWARD):
            grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        return loss, grads

    return step


def measure_training_step(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int = 0
) -> StepMemory:
    """Peak bytes (parameters excluded, inputs included) of one eager training step."""
    params = [p for p in module.parameters() if p.requires_grad]
    input_bytes = sum(tensor_bytes(t) for t in inputs)
    return measure_step(lambda: module(*inputs), params, input_bytes, seed)


def measure_step(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    input_bytes: int,
    seed: int = 0,
    op_scratch: bool = True,
) -> StepMemory:
    """Peak bytes (parameters excluded, the ``input_bytes`` the caller holds included) of one
    eager step: ``loss_fn()``, then the gradients of ``params``.

    ``op_scratch=False`` leaves out the blocks an op allocates and frees within one call
    (``MemoryTrace.without_op_scratch``): for a step whose every op is a node of the planned
    graph (a compiled step's aten graphs), those are its kernels' scratch, which the graph
    does not show and the planner does not model (on CPU, ``TensorIterator`` copies an input
    to the common dtype before a mixed-dtype elementwise op; a CUDA kernel casts as it loads).
    An eager step calls composite ops (``linear``, ``cross_entropy``) whose intermediates are
    nodes of the traced graph, so its measurement keeps them.

    The global RNG is seeded with ``seed`` inside a fork, as the exporter does; the fork's
    state copies are made outside the measured step.
    """
    step = loss_and_gradients(loss_fn, params)
    with single_thread(), no_onednn(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        step()  # warm-up
        torch.manual_seed(seed)
        with host_memory.counting() as moved:
            full, (loss, grads) = trace_allocations(step)
    trace = full if op_scratch else full.without_op_scratch()
    peak, at = trace.peak()
    event = trace.events[at] if at >= 0 else None
    return StepMemory(
        peak_bytes=peak + input_bytes,
        peak_with_op_scratch_bytes=full.peak()[0] + input_bytes,
        input_bytes=input_bytes,
        output_bytes=tensor_bytes(loss) + sum(tensor_bytes(g) for g in grads),
        saved_bytes=trace.held_after(FORWARD) - tensor_bytes(loss),
        peak_stage=event.stage if event else "",
        peak_op=event.op if event else "",
        trace=trace,
        moved_to_host_bytes=moved.bytes,
    )


# A checkpointed layer: (model, layer), as the planner names it.
LayerKey = tuple[str, int]


def checkpoint_zoo_layers(
    model: CausalLM,
    context_fns: dict[LayerKey, ContextFn] | None = None,
    preserve_rng_state: bool | None = None,
) -> CausalLM:
    """Puts every layer of a zoo ``CausalLM`` under a checkpoint: exactly what each
    ``layer_scope(model, i)`` encloses, the planner's layers.

    ``("main", i)`` is ``model.layers[i]``; ``("mtp", 0)`` is ``MTPLayer.layer_forward`` (its
    norms, projection and block). ``context_fns`` gives a layer its selective-checkpoint
    contexts; the parameter order (hence the gradients' order) does not change.
    ``preserve_rng_state``: see ``sac.checkpoint_call`` (None: what the context asks for).
    """
    from ._zoo.model import MAIN_MODEL, MTP_MODEL
    from .sac import checkpoint_call, checkpoint_module

    context_fns = context_fns or {}
    for index, layer in enumerate(model.layers):
        checkpoint_module(layer, context_fns.get((MAIN_MODEL, index)), preserve_rng_state)
    mtp = model.mtp
    if mtp is not None:
        inner, context_fn = mtp.layer_forward, context_fns.get((MTP_MODEL, 0))
        # Replaced on the instance, as sac.checkpoint_module replaces a forward.
        mtp.layer_forward = lambda *args: checkpoint_call(  # type: ignore[method-assign]
            inner, args, {}, context_fn, preserve_rng_state
        )
    return model


# --------------------------------------------------------------------------------------------
# Selective checkpointing from a plan


def plan_contexts(plan: Plan, graph: Any) -> dict[LayerKey, ContextFn]:
    """Selective-checkpoint contexts per checkpointed layer that save what ``plan`` saves:
    the public policy (``recompute_planner.sac``) restricted to the kept ops whose outputs
    the plan's saved set holds. Saving every kept op instead makes eager SAC hold outputs that
    nothing after forward reads until the layer is recomputed (dense, ``--keep all``: +12160
    B, +26%), which the plan's ``peak_bytes`` does not count."""
    from .sac import context_fn

    return {key: context_fn(plan, *key, graph=graph) for key in plan.layers()}


def measure_golden(
    name: str, baseline: str, plan: Plan | None = None, graph: Any = None
) -> StepMemory:
    """Measures rank 0's step of golden ``name`` under a planner baseline or a plan.

    ``baseline``: ``NO_CHECKPOINT``, ``WHOLE_LAYER`` or ``SELECTIVE``; the last runs every
    layer under a selective checkpoint whose policy saves what ``plan`` (the ``Plan`` of
    ``graph``, the golden's ``graph_pb2.Graph``) saves, op by op (``plan_contexts``).

    Model, seeded weights and inputs come from the zoo catalogue, as for the export. A
    multi-rank golden runs in this process as rank 0 of the fake process group it was traced
    with: every shape in the zoo is static, so allocations do not depend on the values the
    collectives would have exchanged.
    """
    from ._zoo.catalog import make_inputs
    from ._zoo.goldens import golden, traced_group

    if baseline not in (NO_CHECKPOINT, WHOLE_LAYER, SELECTIVE):
        raise ValueError(f"unknown baseline {baseline!r}")
    if (baseline == SELECTIVE) != (plan is not None and graph is not None):
        raise ValueError("a plan and its graph are needed for, and only for, SELECTIVE")
    gold = golden(name)
    if not gold.joint:
        raise ValueError(f"{name} is a forward-only graph: it has no training step to measure")
    inputs = make_inputs(gold.entry.config)
    with traced_group(gold.world_size):
        context_fns = None
        if baseline == SELECTIVE and plan is not None:
            context_fns = plan_contexts(plan, graph)
        model = gold.entry.build()
        if baseline != NO_CHECKPOINT:
            # The generator state is stashed where eager SAC stashes it (the module docstring).
            preserve = None if context_fns else gold.entry.config.dropout > 0
            checkpoint_zoo_layers(model, context_fns, preserve_rng_state=preserve)
        return measure_training_step(model, inputs)
