"""Measured activation memory of one eager training step on CPU (checks the planner's M1).

The planner predicts the peak of live bytes during one step, parameters excluded (SPEC §5 M1).
This module runs the same step in eager PyTorch on CPU and measures that quantity from the
allocator itself: ``torch.profiler`` with ``profile_memory=True`` reports every CPU allocation
and free with its pointer and size (the CPU allocator does not cache, so they are real), and the
running sum of those events from the start of the step is exactly "bytes allocated by the step
and still alive". Parameters (and the caller's inputs) are allocated before the step and are
therefore not in the sum; the inputs are added back because the planner counts them.

The step is the exporter's (``export._eager_reference``): ``loss = module(*inputs)`` then
``torch.autograd.grad(loss, params)``, which returns fresh gradients (no ``.grad``
accumulation). The loss and the gradients stay referenced to the end, as the planner keeps
graph outputs alive to the end.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class Allocation:
    """One allocator event: ``nbytes`` > 0 allocates, < 0 frees the block at ``ptr``."""

    time_ns: int
    ptr: int
    nbytes: int
    op: str  # outermost aten op (or autograd node) running when it happened; "" if none
    inner_op: str  # innermost op
    stage: str  # FORWARD or BACKWARD ("" outside both)


@dataclass
class MemoryTrace:
    """The allocator events of one step, in time order."""

    events: list[Allocation]

    def running(self) -> list[int]:
        out, live = [], 0
        for e in self.events:
            live += e.nbytes
            out.append(live)
        return out

    def peak(self) -> tuple[int, int]:
        """(largest running sum, index of the event reaching it first); (0, -1) if empty."""
        best, at = 0, -1
        for i, live in enumerate(self.running()):
            if live > best:
                best, at = live, i
        return best, at

    def live_at(self, index: int) -> list[Allocation]:
        """The allocations made up to event ``index`` (inclusive) and not freed by then."""
        live: dict[int, Allocation] = {}
        for e in self.events[: index + 1]:
            if e.nbytes > 0:
                live[e.ptr] = e
            else:
                live.pop(e.ptr, None)
        return list(live.values())


@dataclass
class StepMemory:
    """What one measured step held at its peak."""

    peak_bytes: int  # running peak of the step's allocations + the inputs
    input_bytes: int
    result_bytes: int  # loss + gradients alive at the end
    trace: MemoryTrace = field(repr=False)
    peak_stage: str = ""
    peak_op: str = ""


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.element_size() * t.numel()


def trace_allocations(fn: Callable[[], Any]) -> tuple[MemoryTrace, Any]:
    """Runs ``fn`` under the CPU memory profiler; returns its allocator events and result."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events: list[Allocation] = []
    from torch._C._profiler import _EventType

    def walk(node, ops: tuple[str, ...], stage: str) -> None:
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                outer = next((o for o in ops if o.startswith("aten::")), ops[0] if ops else "")
                events.append(
                    Allocation(
                        node.start_time_ns,
                        f.ptr,
                        f.alloc_size,
                        outer,
                        ops[-1] if ops else "",
                        stage,
                    )
                )
            return
        name = node.name
        if name in (FORWARD, BACKWARD):
            stage = name
        elif node.tag in (_EventType.TorchOp,):
            ops = ops + (name,)
        for child in node.children:
            walk(child, ops, stage)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, (), "")
    events.sort(key=lambda e: e.time_ns)
    return MemoryTrace(events), result


def training_step(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int = 0
) -> Callable[[], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """The exporter's eager step: loss, then gradients of every parameter via autograd.grad."""
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        with record_function(FORWARD):
            loss = module(*inputs)
        with record_function(BACKWARD):
            grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        return loss, grads

    return step


def measure_step(module: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int = 0) -> StepMemory:
    step = training_step(module, inputs)
    torch.manual_seed(seed)
    step()  # warm-up: lazily initialised kernels and globals allocate on the first call only
    torch.manual_seed(seed)
    trace, (loss, grads) = trace_allocations(step)
    peak, at = trace.peak()
    input_bytes = sum(_tensor_bytes(t) for t in inputs)
    ev = trace.events[at] if at >= 0 else None
    return StepMemory(
        peak_bytes=peak + input_bytes,
        input_bytes=input_bytes,
        result_bytes=_tensor_bytes(loss) + sum(_tensor_bytes(g) for g in grads),
        trace=trace,
        peak_stage=ev.stage if ev else "",
        peak_op=ev.op if ev else "",
    )


class CheckpointedLayer(nn.Module):
    """Runs a decoder layer under non-reentrant ``torch.utils.checkpoint`` (whole-layer recompute)."""

    def __init__(self, inner: nn.Module, context_fn: Callable | None = None):
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, *args):
        kwargs = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(
            self.inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs
        )


def checkpoint_layers(model: nn.Module, context_fn: Callable | None = None) -> nn.Module:
    """Wraps every decoder layer of a zoo ``CausalLM`` (and its MTP block) in a checkpoint."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = CheckpointedLayer(layer, context_fn)
    if getattr(model, "mtp", None) is not None:
        model.mtp.block = CheckpointedLayer(model.mtp.block, context_fn)
    return model
