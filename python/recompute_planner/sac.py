"""Eager selective activation checkpointing (SAC) from a plan.

``context_fn(plan, model, layer)`` is the ``context_fn`` of
``torch.utils.checkpoint.checkpoint(layer_fn, ..., use_reentrant=False, context_fn=...)``
for one checkpointed layer: its policy saves (``CheckpointPolicy.MUST_SAVE``) every op the
plan keeps in that layer (decision ``save``: the kept units' ops and, with
``collectives="save"``, the saved collectives and device-to-host copies) and recomputes every
other op. ``checkpoint_layers(layers, plan)`` applies it to every layer of a module list,
with the model's KV cache off meanwhile (as HuggingFace's gradient checkpointing turns it off;
``.remove()`` on its result undoes both).

Matching. The plan lists the layer's forward ops in execution order, which is eager dispatch
order (the exporter guarantees it). The policy sees the eager ops as they dispatch and matches
each to the next graph op of the same op (the overload ignored: ``mm.out`` is ``mm``).
Markers take no part on either side: the plan never keeps one (they are identities, always
recomputed), and eagerly ``checkpoint_record`` returns its tensor without dispatching the
marker op (a marker op that does dispatch, under a mode that traces, is recomputed unmatched),
so the graph's markers are left out of the matching. Other ops that appear in one stream only
are tolerated:

- eager-only ops (functional collectives' ``wait_tensor`` after ``_wrap_tensor_autograd``,
  views eager adds, ...) are recomputed; an eager ``_unsafe_view`` (what eager ``matmul``
  returns its ``bmm`` through) matches a traced ``view`` that comes next
  (``EAGER_ALTERNATIVES``);
- composites that trace differently (``F.one_hot``: range checks, ``arange`` / ``eq`` /
  ``_to_copy`` in the graph, ``aminmax`` / ``_local_scalar_dense`` / ``zeros`` / ``scatter_``
  in eager; CPU dropout: ``native_dropout`` in the graph, ``bernoulli_`` in eager) are matched
  as a group when eager finishes them and recomputed in eager, kept or not
  (``DIVERGENT_COMPOSITES``; ``PlanPolicy.tolerated`` lists them); a layer with random ops
  is checkpointed with its RNG state preserved, so recompute draws what forward drew;
- graph-only ops (the traced ``arange`` / ``eq`` / ``_to_copy`` of ``one_hot``, ``detach``,
  which SAC never sees) are skipped when the next eager op matches a later graph op within a
  few positions; an eager view matches only the next graph op (eager adds views of its own);

but a kept graph op may never be skipped: when the eager stream does not reach it, the
forward raises ``SacMismatchError`` naming the kept op and the first eager op that did not
match, instead of saving the wrong tensors.

Compiled submodules (``module.compile()``, ``torch.compile(module)``) run compiled inside the
checkpoint, one call per region; the plan keeps nothing in them (the graph has their region,
``recompute_planner.export``), and their compiled code re-runs in recompute. Their code
dispatches other ops than the graph has (inductor's: ``mm.out``, fallbacks such as ``topk``,
no pointwise op), so ``checkpoint_module`` follows their calls (``_CompiledCall``): while one
runs, the ops it dispatches are recomputed unmatched, and when it begins, the graph's run of
compiled-region ops that comes next is passed over (``_Matcher.enter_compiled``). A checkpoint
that does not follow them (``context_fn`` under a checkpoint of one's own) matches their ops
one by one, which holds for ``aot_eager``'s but not for inductor's; its mismatch says so.

Forward and recompute. The policy matches in forward only: the decisions a forward made are
replayed, op by op, when torch asks again in recompute (``ctx.is_recompute``: torch before
2.13, 2.9 and 2.11 at least, calls the policy in recompute too and serves an op from the
cache if it answers "save"; 2.13 calls it in forward only), so matching never advances in
recompute, and a recompute that dispatches another op than forward did raises
``SacMismatchError``.

What SAC holds is observed, not read from torch's cache (whose layout changes between
releases): a dispatch mode entered above SAC's caching mode in forward records the output
bytes of every op the policy saved. ``RecomputeCounter`` counts the ops a layer really
re-runs: a dispatch mode entered under SAC's cached mode in recompute, so ops served from
SAC's cache never reach it. Both declare ``ignore_compile_internals``, as SAC's modes do, so
whole-layer checkpoints of compiled regions work.

``checkpoint_layers`` checkpoints a layer by replacing its ``forward`` on the instance
(``checkpoint_module``), not by wrapping it: the module tree, ``state_dict`` keys, parameter
names and attributes stay those of the plain model, so checkpoints load either way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from . import _host_memory as host_memory
from ._compiled_regions import compiled_submodules, is_compiled, replaced_while
from .errors import KvCacheOffWarning, SacMismatchError
from .markers import MARKER_OP
from .model_export import kv_cache_configs
from .plans import DECISION_SAVE, REASON_COMPILED, Plan

# A checkpoint's ``context_fn``: the forward and the recompute context of one call.
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

# How far ahead of the next expected graph op an eager op may match (graph-only ops skipped).
LOOKAHEAD = 8

# Eager ops that stand for a graph op of another name: an eager functional collective returns
# through `_wrap_tensor_autograd` where the trace waits with `wait_tensor`.
EAGER_EQUIVALENTS = {
    "_c10d_functional._wrap_tensor_autograd": "_c10d_functional.wait_tensor",
}
# Eager ops that may stand for the next graph op of another name: eager `matmul` of 4D tensors
# returns its `bmm` through `_unsafe_view` where the trace has a `view`.
EAGER_ALTERNATIVES = {
    "aten._unsafe_view": "aten.view",
}


@dataclass(frozen=True)
class Composite:
    """Graph ops a composite traces into where eager dispatches others: ``required`` in this
    order, ``optional`` anywhere before the last of them."""

    required: tuple[str, ...]
    optional: frozenset[str] = frozenset()
    # Eager ops that follow the key op and belong to the composite (recomputed, unmatched).
    eager_tail: tuple[str, ...] = ()


# Composites that trace into other ops than eager dispatches, by the eager op that finishes
# them: when eager dispatches it, the graph ops of the composite are matched as a group and
# recomputed in eager even when the plan keeps them (eager has no such ops to cache).
DIVERGENT_COMPOSITES = {
    # F.one_hot: the trace checks the range (ge / lt / all / _assert_async) and compares with
    # an arange (eq, _to_copy); eager runs aminmax, _local_scalar_dense, zeros and scatter_.
    # The result is the `zeros` tensor scatter_ writes in place, so nothing of it may be
    # cached (a cached scatter_ would leave the recomputed tensor zero).
    "aten.scatter_": Composite(
        ("aten.arange", "aten.eq", "aten._to_copy"),
        frozenset({"aten.ge", "aten.lt", "aten.all", "aten._assert_async", "aten.unsqueeze"}),
    ),
    # Dropout on CPU: the trace has native_dropout, eager fills a mask with bernoulli_ in
    # place. Recompute draws the same mask because the checkpoint restores the RNG state
    # (``PlanPolicy.preserve_rng_state``).
    "aten.bernoulli_": Composite(("aten.native_dropout",), eager_tail=("aten.div_", "aten.mul")),
}
# How far a composite's graph ops may spread.
COMPOSITE_WINDOW = 16


def op_packet(op: str) -> str:
    """``aten.mm.out`` -> ``aten.mm``: ops are matched without their overload."""
    packet = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
    return EAGER_EQUIVALENTS.get(packet, packet)


@dataclass(frozen=True)
class LayerOps:
    """One checkpointed layer's forward ops, as the plan lists them."""

    model: str
    layer: int
    names: tuple[str, ...]
    ops: tuple[str, ...]
    keep: tuple[bool, ...]
    random: bool = False  # the layer has random ops (dropout)
    # Per op, whether it runs in a compiled region (none when empty).
    compiled: tuple[bool, ...] = ()
    # Per kept op, whether the plan offloads its outputs to host memory (none when empty).
    offload: tuple[bool, ...] = ()
    # The (name, bytes) of the values the layer makes that later layers (or code outside the
    # checkpointed layers) read and the plan offloads: its outputs, which the checkpoints
    # after it save as their inputs (saved kind "layer-input").
    offloaded_outputs: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, plan: Plan, model: str, layer: int, graph: Any = None) -> LayerOps:
        """The layer's ops; each kept op is to be saved, or with ``graph`` (the plan's
        ``graph_pb2.Graph``) only the kept ops an output of which the plan's saved set holds
        (what a graph executor holds: backward or replay reads it)."""
        nodes = [n for n in plan.nodes if n.model == model and n.layer == layer]
        if not nodes:
            layers = ", ".join(f"{m}/{i}" for m, i in plan.layers()) or "none"
            raise KeyError(
                f"the plan has no layer {layer} of model `{model}`; it checkpoints: {layers}"
            )
        keep = [n.decision == DECISION_SAVE for n in nodes]
        if graph is not None:
            saved = plan.saved_values()
            outputs = {n.name: n.outputs for n in graph.nodes}
            keep = [
                k and any(v in saved for v in outputs[n.name])
                for k, n in zip(keep, nodes, strict=True)
            ]
        return cls(
            model,
            layer,
            tuple(n.name for n in nodes),
            tuple(n.op for n in nodes),
            tuple(keep),
            random=any(n.reason.startswith("random") for n in nodes),
            compiled=tuple(n.reason == REASON_COMPILED for n in nodes),
            offload=tuple(k and n.offloaded for k, n in zip(keep, nodes, strict=True)),
            offloaded_outputs=tuple(
                (s.value, s.bytes) for s in plan.saved
                if s.offloaded and s.kind == "layer-input" and (s.model, s.layer) == (model, layer)
            ),
        )

    def kept(self) -> list[str]:
        return [name for name, keep in zip(self.names, self.keep, strict=True) if keep]


# The marker op without its overload: left out of the matching (the module docstring).
MARKER_PACKET = op_packet(MARKER_OP)


class _Matcher:
    """Matches one forward's eager ops to the layer's graph ops (see the module docstring).

    Indices are positions among the layer's graph ops other than markers (``self.ops``: their
    positions in ``layer``)."""

    def __init__(self, layer: LayerOps):
        self.layer = layer
        self.ops = [i for i, op in enumerate(layer.ops) if op_packet(op) != MARKER_PACKET]
        self.packets = [op_packet(layer.ops[i]) for i in self.ops]
        self.keep = [layer.keep[i] for i in self.ops]
        self.offload = [bool(layer.offload) and layer.offload[i] for i in self.ops]
        self.offload_last = False  # whether the last op matched is kept and offloaded
        self.names = [layer.names[i] for i in self.ops]
        self.compiled = [bool(layer.compiled) and layer.compiled[i] for i in self.ops]
        self.next = 0  # the next graph op to match
        # A compiled call passed over a run of compiled ops and eager has matched nothing since:
        # a compiled call now is the next region of that run (regions called back to back are
        # one run in the graph, which has nothing between them either).
        self.in_compiled_run = False
        # Compiled regions eager entered where the graph has no compiled ops, in order.
        self.unplanned_regions: list[str] = []
        self.matched: list[str] = []  # graph node names matched, in order
        self.first_unmatched: str | None = None  # the first eager op with no graph op
        self.tolerated: list[str] = []  # graph ops eager computes otherwise (composites)
        self.eager_tail: list[str] = []  # eager ops still to come of the last composite

    def decide(self, eager_op: str, is_view: bool = False) -> bool:
        """Whether to save the output of ``eager_op``, the next op the layer dispatches.

        A view matches only the next graph op: eager adds views of its own (a functional
        collective's result, a reshape), which must not pull the matching ahead.
        """
        packet = op_packet(eager_op)
        if packet == MARKER_PACKET:
            return False
        self.in_compiled_run = False
        if self.eager_tail and self.eager_tail[0] == packet:
            self.eager_tail.pop(0)
            return False
        self.eager_tail.clear()
        if packet in DIVERGENT_COMPOSITES and self._match_composite(
            DIVERGENT_COMPOSITES[packet], eager_op
        ):
            return False
        end = min(self.next + (1 if is_view else LOOKAHEAD), len(self.packets))
        alternative = EAGER_ALTERNATIVES.get(packet)
        if alternative is not None and self.packets[self.next : self.next + 1] == [alternative]:
            end = self.next + 1
            packet = alternative
        for index in range(self.next, end):
            if self.packets[index] != packet:
                continue
            skipped_kept = [i for i in range(self.next, index) if self.keep[i]]
            if skipped_kept:
                self._raise(skipped_kept[0], eager_op)
            self.next = index + 1
            self.matched.append(self.names[index])
            self.offload_last = self.offload[index]
            return self.keep[index]
        if self.first_unmatched is None:
            self.first_unmatched = eager_op
        return False

    def enter_compiled(self, region: str) -> None:
        """Eager enters compiled region ``region``: its ops run as compiled code, which
        dispatches other ops than the graph has (inductor: ``mm.out`` and no pointwise op), so
        the graph's run of compiled ops that comes next (at most ``LOOKAHEAD`` ops on) is
        passed over, never kept; the ops before it must not be kept either. A graph without
        compiled ops there passes over nothing (the ops eager runs inside are recomputed). A
        region entered right after another, with no eager op between, was passed over with it
        (one run in the graph)."""
        if self.in_compiled_run:
            return
        end = min(self.next + LOOKAHEAD, len(self.packets))
        start = next((i for i in range(self.next, end) if self.compiled[i]), None)
        if start is None:
            self.unplanned_regions.append(region)
            return
        skipped_kept = [i for i in range(self.next, start) if self.keep[i]]
        if skipped_kept:
            self._raise(skipped_kept[0], f"compiled region `{region}`")
        stop = start
        while stop < len(self.compiled) and self.compiled[stop]:
            stop += 1
        self.next = stop
        self.in_compiled_run = True

    def _match_composite(self, composite: Composite, eager_op: str) -> bool:
        """Consumes the composite's graph ops as a group, if they come next (other ops among
        them must not be kept)."""
        wanted = list(composite.required)
        index, group = self.next, []
        end = min(self.next + COMPOSITE_WINDOW, len(self.packets))
        while wanted and index < end:
            packet = self.packets[index]
            if packet == wanted[0]:
                wanted.pop(0)
                group.append(index)
            elif packet in composite.optional:
                group.append(index)
            index += 1
        if wanted:
            return False
        for skipped in range(self.next, index):
            if self.keep[skipped] and skipped not in group:
                self._raise(skipped, eager_op)
        self.tolerated.extend(self.names[i] for i in group)
        self.next = index
        self.eager_tail = list(composite.eager_tail)
        return True

    def finish(self) -> None:
        """Raises if a kept graph op was never matched."""
        for index in range(self.next, len(self.packets)):
            if self.keep[index]:
                self._raise(index, self.first_unmatched or "the end of the layer's forward")

    def _raise(self, index: int, eager_op: str) -> None:
        layer, position = self.layer, self.ops[index]
        raise SacMismatchError(
            f"layer {layer.layer} of model `{layer.model}`: the plan keeps "
            f"`{layer.names[position]}` ({layer.ops[position]}, op #{position} of the layer), "
            "but the eager layer reached "
            f"{eager_op} without running it; the model's eager op stream does not match the "
            "graph the plan was made for (re-export the model, or plan the graph it runs)"
            + self._compiled_note(index)
        )

    def _compiled_note(self, index: int) -> str:
        """What compiled regions may have to do with a mismatch before graph op ``index``."""
        if self.unplanned_regions:
            regions = ", ".join(f"`{r}`" for r in dict.fromkeys(self.unplanned_regions))
            return (
                f"; the layer ran compiled submodules the graph has no region for there "
                f"({regions}): export the model with its submodules compiled as they run here"
            )
        if any(self.compiled[self.next : index]):
            return (
                "; the graph runs compiled-region ops before it that no compiled submodule's "
                "call passed over: if they run compiled here, checkpoint the layer with "
                "sac.checkpoint_module or sac.checkpoint_layers, which follow the calls of its "
                "compiled submodules (module.compile(), torch.compile(module); a function "
                "compiled on its own cannot be followed: compile a submodule instead)"
            )
        return ""


class RecomputeCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is active (by op, overload included)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.counts: Counter[str] = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def count(self, op: str) -> int:
        """Ops run whose name is ``op`` or starts with ``op + "."`` (any overload)."""
        return sum(n for name, n in self.counts.items() if name == op or name.startswith(op + "."))


class LayerRun:
    """One forward of a checkpointed layer and its recompute: ``policy`` is their SAC policy.

    In forward the policy matches each op (``_Matcher``) and records its decision; in
    recompute (``ctx.is_recompute``: torch before 2.13 asks there too, and serves an op from
    the cache when told to save it) it answers, op by op, the decision forward made, so the
    matching never advances twice for one op.
    """

    def __init__(self, layer: LayerOps):
        self.layer = layer
        self.matcher = _Matcher(layer)
        self.decisions: list[tuple[str, bool]] = []  # forward's (op, save), in dispatch order
        self.offloads: list[bool] = []  # per decision, whether the saved output is offloaded
        self.replayed = 0  # decisions answered in the current recompute
        self.compiled_depth = 0  # compiled calls open in forward (``_CompiledCall``)

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:
            save = self._replay(str(op))
        else:
            # An op compiled code dispatches is recomputed with its region, unmatched.
            self.matcher.offload_last = False
            save = not self.compiled_depth and self.matcher.decide(str(op), op.is_view)
            self.decisions.append((str(op), save))
            self.offloads.append(save and self.matcher.offload_last)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    def enter_compiled(self, region: str) -> None:
        """A compiled submodule's call begins (in forward)."""
        if not self.compiled_depth:
            self.matcher.enter_compiled(region)
        self.compiled_depth += 1

    def leave_compiled(self) -> None:
        self.compiled_depth -= 1

    def start_recompute(self) -> None:
        self.replayed = 0

    def _replay(self, op: str) -> bool:
        index = self.replayed
        forward_op = self.decisions[index][0] if index < len(self.decisions) else None
        if forward_op != op:
            layer = self.layer
            raise SacMismatchError(
                f"layer {layer.layer} of model `{layer.model}`: recompute dispatched {op} as "
                f"op #{index} of the layer, where forward dispatched "
                f"{forward_op or 'nothing more'}; the layer's ops depend on state that changed "
                "between forward and backward, so the cache cannot serve them"
            )
        self.replayed += 1
        return self.decisions[index][1]


def _tensor_bytes(out: Any) -> int:
    tensors = (t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    return sum(t.numel() * t.element_size() for t in tensors)


class _HostCopy:
    """A tensor moved to host memory (``_host_memory.to_host``) and brought back to its
    device, in its layout (shape and strides): a kept output SAC's cache holds, copied as
    forward makes it and brought back when the recompute asks the cache for it (the cache
    calls ``get_val``), or a layer input an ``offloading()`` block saves, brought back where a
    reader unpacks it (``reloaded``). The planner offloads no storage written in place, so the
    copy is the tensor backward needs. A view is copied alone (its base, if also offloaded, is
    copied apart)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device, self.stride = tensor.device, tensor.stride()
        # Written in place after the copy, while still alive, the copy is stale: SAC's own
        # check, kept (the planner offloads no storage the graph writes in place).
        self.source, self.version = weakref.ref(tensor), tensor._version
        self.host = host_memory.to_host(tensor)
        self.back: weakref.ref[torch.Tensor] | None = None  # the last reload (``reloaded``)

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        source = self.source()
        if source is not None and source._version != self.version:
            raise RuntimeError(
                "a tensor offloaded to host memory was written in place after its copy: the "
                "copy is stale"
            )
        # Under no dispatch mode: the reload is none of the layer's ops (the recompute's
        # counter must not see it).
        with _disable_current_modes():
            return host_memory.to_device(self.host, self.device, self.stride)

    def reloaded(self) -> torch.Tensor:
        """The tensor back on its device: one reload for every reader while any holds it."""
        back = self.back() if self.back is not None else None
        if back is None:
            back = self.get_val(False)
            self.back = weakref.ref(back)
        return back


def _to_host(entry: Any) -> Any:
    """A cache entry with each of its tensors moved to host memory. The entry's tensors are in
    torch's private ``_VersionWrapper``: offload is the one place this module reads SAC's
    cache."""
    wrapper = torch_checkpoint._VersionWrapper

    def move(leaf: Any) -> Any:
        if isinstance(leaf, wrapper) and isinstance(leaf.val, torch.Tensor):
            if host_memory.movable(leaf.val):
                return _HostCopy(leaf.val)
        return leaf

    return tree_map(move, entry)


class _SavedOutputs(TorchDispatchMode):
    """Records the (op, output bytes) of every op a forward's policy saves, and moves the
    cache entry of each op the plan offloads to host memory. Entered above SAC's caching mode,
    it sees each op before the policy decides it and the output after, once cached."""

    def __init__(self, run: LayerRun, caching: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.run = run
        self.caching = caching
        self.held: list[tuple[str, int]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        decided = len(self.run.decisions)
        out = func(*args, **(kwargs or {}))
        decisions = self.run.decisions
        if len(decisions) > decided and decisions[-1][1]:
            self.held.append((str(func), _tensor_bytes(out)))
            if self.run.offloads[-1]:
                self._offload(func, args)
        return out

    def _offload(self, func: Any, args: Sequence[Any]) -> None:
        """Moves the entry SAC's caching mode just stored for ``func`` to host memory."""
        # torch 2.13 keys compiled regions apart; earlier releases key the op alone.
        storage_key = getattr(torch_checkpoint, "_sac_storage_key", None)
        key = func if storage_key is None else storage_key(func, args)
        entries = self.caching.storage[key]
        index = self.caching.func_counter[key] - 1
        # Under no dispatch mode: the copy's ops are none of the layer's (the policy would
        # match them against the plan's next ops).
        with _disable_current_modes():
            entries[index] = _to_host(entries[index])


@dataclass
class PlanPolicy:
    """The ``context_fn`` of one layer (``context_fn(plan, model, layer)`` builds it).

    ``recomputed`` counts the ops each recompute really re-runs; ``held`` lists, after a
    forward, the (op, bytes of its outputs) of every op SAC's cache holds for backward, to
    check it against the plan (sizes only: holding the tensors would keep them alive past
    backward).
    """

    layer: LayerOps
    recomputed: RecomputeCounter = field(default_factory=RecomputeCounter)
    held: list[tuple[str, int]] = field(default_factory=list)
    # Graph ops the last forward matched as a divergent composite (recomputed in eager).
    tolerated: list[str] = field(default_factory=list)

    def __call__(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        if self.layer.offloaded_outputs and not any(p is self for p in _CALLS.policies):
            names = ", ".join(f"`{name}`" for name, _ in self.layer.offloaded_outputs)
            raise NotImplementedError(
                f"the plan offloads {names}, the output of layer {self.layer.layer} of model "
                f"`{self.layer.model}`, which only a checkpoint of this module moves: "
                "checkpoint the layer with checkpoint_layers, checkpoint_module or "
                "checkpoint_call (forward inside `with offloading():`), not with this "
                "context_fn in a checkpoint of your own"
            )
        run = LayerRun(self.layer)
        caching, cached = create_selective_checkpoint_contexts(run.policy)
        return self._forward(caching, run), self._recompute(cached, run)

    @contextlib.contextmanager
    def _forward(self, caching: Any, run: LayerRun) -> Iterator[None]:
        saved = _SavedOutputs(run, caching)
        _MATCHING.append(run)
        try:
            with caching, saved:
                yield
        finally:
            _MATCHING.remove(run)
        run.matcher.finish()
        self.tolerated = list(run.matcher.tolerated)
        self.held = saved.held

    @contextlib.contextmanager
    def _recompute(self, cached: Any, run: LayerRun) -> Iterator[None]:
        run.start_recompute()
        # The counter is entered first, under SAC's mode: ops served from the cache never
        # reach it.
        with self.recomputed, cached:
            yield

    @property
    def preserve_rng_state(self) -> bool:
        """Whether the checkpoint must restore the RNG state for recompute: the layer has
        random ops, which recompute must draw as forward did."""
        return self.layer.random

    def held_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.held)


def context_fn(plan: Plan, model: str, layer: int, graph: Any = None) -> PlanPolicy:
    """The ``context_fn`` whose policy saves exactly the ops ``plan`` keeps in ``layer`` of
    ``model`` (see the module docstring). With ``graph`` (the plan's graph message) it saves
    only the kept ops whose outputs the plan's saved set holds. A plan that offloads what
    eager SAC does not move (anything but kept outputs and layer inputs) is a
    ``NotImplementedError``: its predictions would not hold; one that offloads the layer's
    output (a layer input of the layers after it) builds its contexts only under this
    module's checkpoints (``checkpoint_call``), which move it (``offloading()``)."""
    _check_offload_runs(plan)
    return PlanPolicy(LayerOps.of(plan, model, layer, graph))


# The saved kinds eager selective checkpointing offloads: kept outputs (SAC's cache holds their
# host copies) and layer inputs (``offloading()``).
EAGER_OFFLOADED_KINDS = ("kept", "layer-input")


def _check_offload_runs(plan: Plan) -> None:
    """Raises unless every value ``plan`` offloads is of a kind this module moves
    (``EAGER_OFFLOADED_KINDS``); values outside checkpointed layers stay on the device under
    eager SAC."""
    others = [s for s in plan.saved if s.offloaded and s.kind not in EAGER_OFFLOADED_KINDS]
    if others:
        kinds = ", ".join(sorted({s.kind for s in others}))
        raise NotImplementedError(
            f"the plan offloads {len(others)} values of kinds {kinds} "
            f"({sum(s.bytes for s in others)} B, `{others[0].value}` first), which eager "
            "selective checkpointing does not move to host memory (it moves kept outputs and "
            "layer inputs): plan with offload= units or offload_kinds=['kept', 'layer-input']"
        )


# --------------------------------------------------------------------------------------------
# Layer inputs in host memory


class _Offloading:
    """The saved-tensor hooks of one ``offloading()`` block: a layer output the plan offloads
    (``register``ed when its checkpoint returns it) is saved as one host copy, made when it is
    first saved, by every reader that saves it (the next layer's checkpoint, code outside the
    checkpointed layers); each reader's unpack brings it back (``_HostCopy.reloaded``). Every
    other tensor is saved as itself (detached: a saved output holding its own ``grad_fn``
    would be a reference cycle)."""

    def __init__(self) -> None:
        # id of a registered tensor -> (its value name, the tensor, its host copy once made),
        # the last two weakly: the saved tensors hold the copy, which lives as long as one
        # of them.
        self.registered: dict[int, tuple[str, weakref.ref[torch.Tensor], Any]] = {}
        self.packed: set[str] = set()  # the registered values saved as host copies

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.registered[id(tensor)] = (name, weakref.ref(tensor), None)

    def pack(self, tensor: torch.Tensor) -> Any:
        entry = self.registered.get(id(tensor))
        if entry is None or entry[1]() is not tensor:
            return tensor.detach()
        name, source, held = entry
        copy = held() if held is not None else None
        if copy is None:
            with _disable_current_modes():
                copy = _HostCopy(tensor)
            self.registered[id(tensor)] = (name, source, weakref.ref(copy))
        self.packed.add(name)
        return copy

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.reloaded() if isinstance(packed, _HostCopy) else packed

    def warn_unsaved(self) -> None:
        """Warns of the registered values nothing saved for backward inside the block: they
        stay on the device, against the plan."""
        unsaved = sorted({name for name, _, _ in self.registered.values()} - self.packed)
        if unsaved:
            warnings.warn(
                f"offloading(): {', '.join(f'`{v}`' for v in unsaved)}, which the plan "
                "offloads, was not saved for backward inside the block as the tensor its layer "
                "returned (a view of it, or a keyword argument of the next checkpointed layer, "
                "which the checkpoint keeps on the device): it stays on the device",
                RuntimeWarning,
                stacklevel=4,
            )


class _Blocks(threading.local):
    """The ``offloading()`` blocks this thread entered, innermost last (saved-tensor hooks
    are per thread, too)."""

    def __init__(self) -> None:
        self.entered: list[_Offloading] = []


_OFFLOADING = _Blocks()


@contextlib.contextmanager
def offloading() -> Iterator[None]:
    """``with offloading():`` around a step's forward moves the layer inputs a plan offloads
    (saved kind ``layer-input``: what a checkpointed layer returns and the checkpoint after it,
    or code outside the checkpointed layers, saves) to host memory: each is copied once where
    it is first saved for backward, the device tensor is freed with the forward's last
    reference to it, and backward brings it back where a reader unpacks it (a checkpoint's
    recompute, a backward op). Plan it with ``offload_prefetch=0`` for the exact schedule.

    Layers checkpointed by this module (``checkpoint_layers``, ``checkpoint_module``,
    ``checkpoint_call``) register the outputs their plan offloads as they return them; such a
    layer raises outside a block, rather than keep on the device what the plan predicts in
    host memory, and a registered output nothing saved inside the block (passed on as a view,
    or as a keyword argument, which a checkpoint keeps on the device) is warned of
    (``RuntimeWarning``) when the block ends. The next layer must take it as a positional
    argument. Only forward needs to be inside; saved tensor hooks of its own inside it (a
    checkpoint's) take precedence. On CUDA the copies are pinned and asynchronous on the
    current stream (not a side stream: they are ordered with the step's kernels)."""
    block = _Offloading()
    _OFFLOADING.entered.append(block)
    try:
        with torch.autograd.graph.saved_tensors_hooks(block.pack, _Offloading.unpack):
            yield
    finally:
        _OFFLOADING.entered.remove(block)
    block.warn_unsaved()


def _offload_outputs(out: Any, policy: PlanPolicy) -> None:
    """Registers, with the innermost ``offloading()`` block, the tensors of ``out`` (a
    checkpointed layer's return value) that are the layer outputs ``policy``'s plan offloads,
    told apart by size; raises where there is no block or the sizes do not tell them apart."""
    offloaded = policy.layer.offloaded_outputs
    if not offloaded or not torch.is_grad_enabled():
        return
    where = f"layer {policy.layer.layer} of model `{policy.layer.model}`"
    names = ", ".join(f"`{name}`" for name, _ in offloaded)
    if not _OFFLOADING.entered:
        raise RuntimeError(
            f"the plan offloads {names}, the output of {where} that later layers read, to "
            "host memory: run the step's forward inside `with recompute_planner.sac."
            "offloading():`, which moves it, or plan without offloading layer inputs"
        )
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    for nbytes in {size for _, size in offloaded}:
        values = [name for name, size in offloaded if size == nbytes]
        matches = [t for t in tensors if _tensor_bytes(t) == nbytes]
        if len(matches) != len(values) or not all(map(host_memory.movable, matches)):
            raise NotImplementedError(
                f"the plan offloads {', '.join(f'`{v}`' for v in values)} ({nbytes} B each), "
                f"made in {where}, but the layer returns {len(matches)} tensors of that size "
                "(or of a dtype the host copy does not hold): which of them the plan offloads "
                "cannot be told (a value that leaves the layer other than by its return value "
                "is not moved)"
            )
        for name, tensor in zip(values, matches, strict=True):
            _OFFLOADING.entered[-1].register(name, tensor)


# The layer forwards whose policy is matching ops now, innermost last (``PlanPolicy``).
_MATCHING: list[LayerRun] = []


class _CompiledCall:
    """A compiled submodule's call, announced to the layer forward being matched (if any) while
    it runs: the ops its compiled code dispatches are recomputed unmatched, and the graph's ops
    of its region are passed over (``_Matcher.enter_compiled``)."""

    def __init__(self, call: Callable[..., Any], region: str):
        self.call, self.region = call, region

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = _MATCHING[-1] if _MATCHING else None
        if run is None:
            return self.call(*args, **kwargs)
        run.enter_compiled(self.region)
        try:
            return self.call(*args, **kwargs)
        finally:
            run.leave_compiled()


def follow_compiled_submodules(module: nn.Module) -> Callable[[], None]:
    """Announces every call of ``module``'s compiled submodules (``module.compile()``,
    ``torch.compile(submodule)``; the outermost of nested ones) to the selective checkpoint
    matching the layer they run in; returns what undoes it. ``checkpoint_module`` does it for
    the module it checkpoints. A submodule followed already (a module that holds it is
    checkpointed too) stays with its follower: calls are announced to the innermost layer
    forward being matched whoever follows them. Regions are named by their path from
    ``module`` (the export names them from the model's root)."""
    return replaced_while(
        functools.partial(compiled.replace, _CompiledCall(compiled.compiled_call(), compiled.path))
        for compiled in compiled_submodules(module)
        if compiled.outermost and not isinstance(compiled.compiled_call(), _CompiledCall)
    )


class _CheckpointedForward:
    """A module's ``forward`` run under ``checkpoint_call``, set on the instance by
    ``checkpoint_module``, with its compiled submodules followed (``unfollow`` undoes it)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        context: ContextFn | None,
        preserve_rng_state: bool | None,
        unfollow: Callable[[], None],
    ):
        self.forward = forward
        self.context = context
        self.preserve_rng_state = preserve_rng_state
        self.unfollow = unfollow

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_call(self.forward, args, kwargs, self.context, self.preserve_rng_state)


def checkpoint_module(
    module: nn.Module, context: ContextFn | None = None, preserve_rng_state: bool | None = None
) -> nn.Module:
    """Runs ``module``'s forward under non-reentrant ``torch.utils.checkpoint`` from now on
    (selective with ``context``; ``preserve_rng_state``: see ``checkpoint_call``), and returns
    it.

    The forward is replaced on the instance, the module is not wrapped: it keeps its place in
    the model, its attributes, parameter names and ``state_dict`` keys, so a state dict saved
    with or without checkpointing loads into either. Its hooks run outside the checkpoint.
    Checkpointing a module again replaces its checkpoint (they do not nest).

    The module's compiled submodules run compiled, as one call each inside the checkpoint
    (``follow_compiled_submodules``): the plan keeps nothing in them, and their compiled code
    re-runs in recompute. A module compiled as a whole is refused (``ValueError``).
    """
    if is_compiled(module):
        raise ValueError(
            f"the {type(module).__name__} to checkpoint is compiled as a whole "
            "(module.compile() or torch.compile(module)), so the checkpoint would run inside "
            "its compiled code, out of eager selective checkpointing's reach (and the plan "
            "keeps nothing in a layer compiled as one region). Fix: compile the layer's "
            "submodules instead of the layer, or plan the compiled step with the torch.compile "
            "stage (recompute_planner.compile)"
        )
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        current.unfollow()
        forward = current.forward
    else:
        forward = module.forward
    unfollow = follow_compiled_submodules(module)
    module.forward = _CheckpointedForward(forward, context, preserve_rng_state, unfollow)
    return module


def uncheckpoint_module(module: nn.Module) -> nn.Module:
    """Undoes ``checkpoint_module``: ``module`` runs its own forward again; returns it."""
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        current.unfollow()
        del module.__dict__["forward"]
        if module.forward != current.forward:  # the instance had a forward of its own
            module.forward = current.forward
    return module


def checkpoint_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: ContextFn | None,
    preserve_rng_state: bool | None = None,
) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpointing (selective with ``context``).

    By default the RNG state is stashed only for a plan's layer with random ops
    (``PlanPolicy``): the stash is host memory per layer that a layer without random ops does
    not need.
    """
    preserve = preserve_rng_state
    if preserve is None:
        preserve = bool(getattr(context, "preserve_rng_state", False))
    if not isinstance(context, PlanPolicy):
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=noop_context_fn if context is None else context,
            preserve_rng_state=preserve,
            **kwargs,
        )
    _CALLS.policies.append(context)
    try:
        out = checkpoint(
            fn, *args, use_reentrant=False, context_fn=context, preserve_rng_state=preserve,
            **kwargs,
        )
    finally:
        _CALLS.policies.pop()
    _offload_outputs(out, context)
    return out


class _Calls(threading.local):
    """The policies ``checkpoint_call`` is checkpointing a layer with on this thread,
    innermost last: a policy whose plan offloads the layer's output builds its contexts only
    there, where the output is registered with ``offloading()``."""

    def __init__(self) -> None:
        self.policies: list[PlanPolicy] = []


_CALLS = _Calls()


class CheckpointedLayers(dict[int, PlanPolicy]):
    """What ``checkpoint_layers`` returns: the policies by layer index, and ``remove()``, which
    puts the layers back and the KV cache settings it turned off."""

    def __init__(
        self, layers: nn.ModuleList, policies: dict[int, PlanPolicy], cache_off: list[Any]
    ):
        super().__init__(policies)
        self._layers = layers
        self._cache_off = cache_off

    def remove(self) -> None:
        """Runs the checkpointed layers' own forward again and turns the KV cache back on
        where it was on."""
        for index in self:
            uncheckpoint_module(self._layers[index])
        for config in self._cache_off:
            config.use_cache = True
        self._cache_off.clear()


def checkpoint_layers(
    layers: nn.ModuleList, plan: Plan, model: str = "main"
) -> CheckpointedLayers:
    """Checkpoints every layer of ``layers`` that ``plan`` checkpoints (layer ``i`` of
    ``model``) with a selective checkpoint saving what the plan keeps (``checkpoint_module``:
    the layers stay in place, state dict keys unchanged); returns the policies by layer index
    (``.remove()`` undoes it). A ``model`` the plan does not have is a ``KeyError`` (not a
    model left unwrapped).

    As HuggingFace's own gradient checkpointing does, the KV cache is off while layers are
    checkpointed (``config.use_cache = False`` on the configs the layers read, with a
    ``KvCacheOffWarning``): a layer that updates the cache would update it again in its
    recompute, which then runs other ops than forward did.
    """
    models = {n.model for n in plan.nodes}
    if model not in models:
        raise KeyError(
            f"the plan has no model `{model}`; its models: {', '.join(sorted(models)) or 'none'}"
        )
    checkpointed = {i for m, i in plan.layers() if m == model}
    policies = {}
    for index in range(len(layers)):
        if index in checkpointed:
            policies[index] = context_fn(plan, model, index)
            checkpoint_module(layers[index], policies[index])
    return CheckpointedLayers(layers, policies, _kv_cache_off(layers) if policies else [])


def _kv_cache_off(layers: nn.ModuleList) -> list[Any]:
    """Turns off ``use_cache`` on every config the layers' modules hold, with a warning;
    returns the configs it changed."""
    configs = kv_cache_configs(layers)
    if configs:
        warnings.warn(
            KvCacheOffWarning(
                "the model's KV cache is on (config.use_cache=True): a checkpointed layer's "
                "recompute would update it a second time, so it is off (config.use_cache="
                "False) while the layers are checkpointed, as HuggingFace's gradient "
                "checkpointing does; .remove() on what checkpoint_layers returned turns it "
                "back on"
            ),
            stacklevel=3,
        )
    for config in configs:
        config.use_cache = False
    return configs


__all__ = [
    "CheckpointedLayers",
    "ContextFn",
    "DIVERGENT_COMPOSITES",
    "EAGER_ALTERNATIVES",
    "EAGER_OFFLOADED_KINDS",
    "PlanPolicy",
    "RecomputeCounter",
    "checkpoint_call",
    "checkpoint_layers",
    "checkpoint_module",
    "context_fn",
    "offloading",
    "follow_compiled_submodules",
    "uncheckpoint_module",
]
