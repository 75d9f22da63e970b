"""What the model's Python code keeps referenced in an eager forward, past the graph's last use.

A function's locals live until it returns, and an object may hold an intermediate tensor: in
eager PyTorch such a tensor's memory is freed when Python drops its last reference, not after
the last op that reads it. The exported graph cannot show this, so the export observes it: a
probe runs the module's forward eagerly (real tensors, autograd on) under a dispatch mode that
numbers the ops and puts a finalizer on every output, while ``saved_tensors_hooks`` hand
autograd a detached copy of each tensor it saves, so autograd holds no original and an original
dies exactly when Python drops it. Each op output gets the index of the last op dispatched
before Python released it (the end of forward when it is still referenced then).

The probe's op stream is aligned with the graph's forward nodes by op name (the longest
matching runs, ``difflib``: the trace decomposes some composites differently from eager, such
as CPU dropout, and eager dispatches ops the trace lacks); ops that do not align are skipped. A
value Python releases after a later forward node than its last forward read is listed in that
node's ``python_releases`` (docs/ir.md), which the planner's eager memory model holds.

The tensors a collective returns or writes in place, and the bases they are views of, are left
out: functional collectives keep them in a work registry until they are waited on or cleaned up
by a later call, so when they are released depends on what ran before, not on the model's code
(two exports would differ). The tensors a functional collective reads are Python's: the probe
hands the collective a copy of each (as it hands autograd copies), so what the group's work
keeps (a real group's, as long as the group decides: gloo's past the wait; the fake group's,
nothing) never delays an original, and a caller's local that holds the base of an all-to-all's
input view, say, is listed like any other.

What the probe sees is this process's CPython: after a ``torch.compile`` whose compilation
raised, Dynamo leaves frame evaluation to its own hook for the rest of the process, and every
call then keeps its arguments alive until it returns (a callee that rebinds an argument no
longer frees it). The probe checks for that and warns (``ArgumentsHeldWarning``): the releases
it records there are later than in a fresh process, where the model trains.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import gc
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from .errors import ArgumentsHeldWarning
from .proto import graph_pb2


@dataclass
class ProbeOp:
    """One op the probed forward dispatched: its name and, per tensor output, the index of the
    last op dispatched before Python released it (None: still referenced when forward ended)."""

    op: str
    released_after: list[int | None] = field(default_factory=list)


class _ReleaseProbe(TorchDispatchMode):
    """Numbers the ops dispatched under it and records when each output is released."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.ops: list[ProbeOp] = []
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops dispatched meanwhile (the probe's own copies) are neither numbered nor watched."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if not self._paused and _reads_into_work(func):
            with self.paused():
                args = tree_map_only(torch.Tensor, torch.Tensor.clone, tuple(args))
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        probed = ProbeOp(str(func), [None] * len(tensors))
        index = len(self.ops)
        self.ops.append(probed)
        for k, tensor in enumerate(tensors):
            weakref.finalize(tensor, self._released, probed, k, index)
        return out

    def _released(self, probed: ProbeOp, k: int, made: int) -> None:
        # Released before the next op dispatched: held through the last one dispatched.
        probed.released_after[k] = max(made, len(self.ops) - 1)


def _reads_into_work(func: torch._ops.OpOverload) -> bool:
    """A functional collective that hands its inputs to a group's work: it names the group
    (``wait_tensor`` and ``_wrap_tensor_autograd``, which find the work of a tensor, do not)."""
    return (
        func.namespace == "_c10d_functional"
        and not func._schema.is_mutable
        and any(a.name == "group_name" for a in func._schema.arguments)
    )


class _Token:
    """An object only a weak reference watches."""


def _dropped_argument_lives(token: _Token) -> bool:
    watch = weakref.ref(token)
    del token
    return watch() is not None


def arguments_outlive_calls() -> bool:
    """Whether a call's argument outlives the callee dropping it: CPython moves a Python
    call's arguments into the callee's frame, unless a frame-evaluation hook is installed
    (Dynamo's, left behind by a compile that raised), where the caller holds them to the end
    of the call."""
    return _dropped_argument_lives(_Token())


def probe_releases(module: torch.nn.Module, args: tuple[Any, ...], seed: int) -> list[ProbeOp]:
    """Runs ``module(*args)`` once under the probe (RNG forked and seeded with ``seed``) and
    returns its ops in dispatch order. The caller restores the module's tensors."""
    if arguments_outlive_calls():
        warnings.warn(
            ArgumentsHeldWarning(
                "this process keeps every call's arguments alive until the call returns (a "
                "torch.compile whose compilation raised leaves Dynamo's frame hook installed), "
                "so the export records tensors Python frees later than in a fresh process; the "
                "eager plan's holds follow it. Export in a process without a failed compile "
                "for the eager memory model to match training"
            ),
            stacklevel=4,
        )
    probe = _ReleaseProbe()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        with probe.paused():
            return tensor.detach().clone()

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    # Reference cycles are freed when the cycle collector runs, which depends on what ran
    # before: collected first, then not during the forward, a tensor in a cycle counts as
    # held to the end of forward, the same on every run.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), probe:
                loss = module(*args)
                end = len(probe.ops) - 1
            del loss
    finally:
        if was_enabled:
            gc.enable()
    for probed in probe.ops:
        probed.released_after = [end if r is None else r for r in probed.released_after]
    return probe.ops


def add_python_releases(graph: graph_pb2.Graph, ops: list[ProbeOp]) -> None:
    """Lists, on the graph's forward nodes, the values Python released after them later than
    their last forward read (``Node.python_releases``)."""
    forward = [i for i, n in enumerate(graph.nodes) if n.phase == graph_pb2.PHASE_FORWARD]
    graph_ops = [graph.nodes[i].op for i in forward]
    matcher = difflib.SequenceMatcher(None, [p.op for p in ops], graph_ops, autojunk=False)
    aligned: list[tuple[int, int]] = []  # (probe op, index into `forward`), in order
    for block in matcher.get_matching_blocks():
        aligned.extend((block.a + k, block.b + k) for k in range(block.size))
    if not aligned:
        return
    probe_indices = [a for a, _ in aligned]
    by_collectives = _held_by_collectives(graph)
    last_read: dict[str, int] = {}
    for position, i in enumerate(forward):
        for value in graph.nodes[i].inputs:
            last_read[value] = position
    releases: dict[int, list[str]] = {}
    for a, b in aligned:
        node = graph.nodes[forward[b]]
        probed = ops[a]
        if len(probed.released_after) != len(node.outputs):
            continue
        for value, released in zip(node.outputs, probed.released_after, strict=True):
            if released is None or value in by_collectives:
                continue
            # The last aligned graph node at or before the release.
            k = _last_at_or_before(probe_indices, released)
            if k is None:
                continue
            at = aligned[k][1]
            if at > max(b, last_read.get(value, b)):
                releases.setdefault(at, []).append(value)
    for at, values in releases.items():
        graph.nodes[forward[at]].python_releases.extend(values)


def _held_by_collectives(graph: graph_pb2.Graph) -> set[str]:
    """The tensors a collective's work keeps registered: its outputs and the inputs it writes
    in place, and the base each of them is a view of (a view references its base tensor;
    views are followed to their root, as torch keeps the root). Other views of that memory,
    and the inputs it only reads (the probe gives the work copies of those), are Python's."""
    base = _bases(graph)
    held: set[str] = set()
    for node in graph.nodes:
        if node.schema.collective:
            written = [node.inputs[p] for p in node.schema.mutates]
            for value in (*written, *node.outputs):
                held.update((value, base.get(value, value)))
    return held


def _bases(graph: graph_pb2.Graph) -> dict[str, str]:
    """Per view (or in-place result): the root tensor whose memory it shares."""
    base: dict[str, str] = {}
    for node in graph.nodes:
        schema = node.schema
        if schema.HasField("view_of"):
            shared = node.inputs[schema.view_of]
            base.update((v, base.get(shared, shared)) for v in node.outputs)
        elif schema.mutates and node.outputs:
            written = node.inputs[schema.mutates[0]]
            base[node.outputs[0]] = base.get(written, written)
    return base


def _last_at_or_before(sorted_indices: list[int], index: int) -> int | None:
    """The position of the last of ``sorted_indices`` at or before ``index``."""
    k = bisect.bisect_right(sorted_indices, index) - 1
    return k if k >= 0 else None
