"""Host copies of saved tensors, for the executors that offload what a plan offloads (eager
selective checkpointing, ``recompute_planner.sac``; the torch.compile stage,
``recompute_planner.compile``).

``to_host`` copies a tensor to host memory; ``to_device`` brings it back in a layout (shape and
strides) of the caller's choosing. On a CUDA device the host copy is pinned and both transfers
are asynchronous on the current stream. On the CPU the copy is a NumPy buffer, outside
PyTorch's allocator, so the allocator (and a measurement of it) sees the device free of the
tensor between the copy and its reload, as it would be on an accelerator.

The torch.compile stage runs the two as graph ops, ``OFFLOAD`` and ``RELOAD``
(``recompute::offload_to_host`` and ``recompute::reload_from_host``), which the planner never
sees: they are placed after the plan is made, around the saved values it offloads.

``counting()`` counts the bytes copied to host memory while it is entered (what a measurement
compares with the plan's offloaded bytes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

# Integer dtypes by element size: a tensor of any dtype viewed as one of them reads as NumPy.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def movable(tensor: torch.Tensor) -> bool:
    """Whether ``to_host`` copies ``tensor`` (a dtype NumPy can hold bit for bit)."""
    return tensor.element_size() in _BITS and not tensor.is_complex()


@dataclass
class Moved:
    """Bytes copied to host memory while a ``counting()`` block was entered."""

    bytes: int = 0


_COUNTERS: list[Moved] = []


@contextlib.contextmanager
def counting() -> Iterator[Moved]:
    """Counts, for the block, the bytes ``to_host`` copies (on any thread)."""
    moved = Moved()
    _COUNTERS.append(moved)
    try:
        yield moved
    finally:
        _COUNTERS.remove(moved)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory: same shape and dtype, contiguous, not tracking
    gradients. ``tensor`` must be ``movable``."""
    source = tensor.detach()
    if source.device.type == "cpu":
        bits = source.view(_BITS[source.element_size()]).numpy().copy()
        host = torch.from_numpy(bits).view(source.dtype)
    else:
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
    for moved in _COUNTERS:
        moved.bytes += host.numel() * host.element_size()
    return host


def to_device(host: torch.Tensor, device: torch.device, stride: Sequence[int]) -> torch.Tensor:
    """``host`` (a ``to_host`` copy) back on ``device`` with ``stride``."""
    out = torch.empty_strided(host.shape, tuple(stride), dtype=host.dtype, device=device)
    return out.copy_(host, non_blocking=host.is_pinned())


@torch.library.custom_op("recompute::offload_to_host", mutates_args=())
def _offload_to_host(x: torch.Tensor) -> torch.Tensor:
    return to_host(x)


@_offload_to_host.register_fake
def _fake_offload_to_host(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("recompute::reload_from_host", mutates_args=())
def _reload_from_host(host: torch.Tensor, device: torch.device, stride: list[int]) -> torch.Tensor:
    return to_device(host, device, stride)


@_reload_from_host.register_fake
def _fake_reload_from_host(
    host: torch.Tensor, device: torch.device, stride: list[int]
) -> torch.Tensor:
    return torch.empty_strided(host.shape, tuple(stride), dtype=host.dtype, device=device)


# The registered op overloads, as they appear as the targets of graph nodes.
OFFLOAD: torch._ops.OpOverload = torch.ops.recompute.offload_to_host.default
RELOAD: torch._ops.OpOverload = torch.ops.recompute.reload_from_host.default
