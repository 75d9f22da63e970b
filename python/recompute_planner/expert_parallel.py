"""Expert parallelism for HuggingFace MoE models: rank ``r``'s step of an ``N``-way
expert-parallel run, traced in one process (``rp.export(model, inputs, ep=N, ep_rank=r)``).

Every experts module of HuggingFace's fused kind (``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``, called with the tokens, their top-k expert ids and weights:
Qwen3-MoE, Mixtral, DeepSeek-V3 and the other families built on HuggingFace's experts
integration) is replaced for the trace by rank ``r``'s shard: experts ``r E/N`` to
``(r+1) E/N - 1``, which the tokens reach as in expert-parallel training (torchtitan, Megatron):

1. **dispatch**: the (token, choice) pairs, sorted by expert, go to the ranks that hold their
   experts in one all-to-all;
2. the local experts run HuggingFace's grouped matmuls on the rows received, grouped by expert
   (a fixed permutation of the rows, which arrive grouped by source rank);
3. **combine**: the reverse all-to-all, then the routing weights and the sum over choices.

The split sizes are those of a routing fixed in advance, as a graph with static shapes needs
(and as a capacity-bounded dispatch fixes them): ``routing`` gives ``counts[s][e]``, the pairs
rank ``s`` sends expert ``e``; by default the routing is balanced (every rank sends every
expert ``T k / E`` pairs, the remainder to the first experts). The router still runs; its
choice orders the pairs, the routing sets the shapes. The functional all-to-alls are traced
under torch's fake process group as rank ``r`` of ``N`` (nothing is exchanged), and appear in
forward and, reversed, in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from .errors import ExportError

if TYPE_CHECKING:

    class FusedExperts(nn.Module):
        """HuggingFace's fused experts module, as ``is_fused_experts`` finds it."""

        num_experts: int
        gate_up_proj: nn.Parameter
        down_proj: nn.Parameter

        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor: ...


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """Initializes torch's fake process group as `rank` of `world_size` for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def is_fused_experts(module: nn.Module) -> TypeGuard[FusedExperts]:
    """HuggingFace's fused experts: 3D ``gate_up_proj`` / ``down_proj`` over ``num_experts``."""
    gate_up_proj = getattr(module, "gate_up_proj", None)
    return (
        isinstance(getattr(module, "num_experts", None), int)
        and isinstance(gate_up_proj, nn.Parameter)
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)
        and gate_up_proj.dim() == 3
    )


def balanced_routing(pairs: int, experts: int, ranks: int) -> list[list[int]]:
    """``counts[s][e]``: every rank sends every expert ``pairs / experts`` (token, choice)
    pairs, the remainder one each to the first experts."""
    share, extra = divmod(pairs, experts)
    row = [share + int(e < extra) for e in range(experts)]
    return [list(row) for _ in range(ranks)]


@dataclass(frozen=True)
class Exchange:
    """The static shapes of one MoE layer's exchange on rank ``rank``."""

    send: list[int]  # rows this rank sends each rank
    recv: list[int]  # rows each rank sends this one
    by_expert: list[int]  # received rows, reordered: grouped by local expert
    offsets: list[int]  # the grouped matmul's cumulative rows per local expert

    @staticmethod
    def of(counts: Sequence[Sequence[int]], ranks: int, rank: int) -> Exchange:
        local = len(counts[0]) // ranks

        def owned(r: int) -> range:
            return range(r * local, (r + 1) * local)

        send = [sum(counts[rank][e] for e in owned(d)) for d in range(ranks)]
        recv = [sum(counts[s][e] for e in owned(rank)) for s in range(ranks)]
        # Received rows come by source rank, each source's rows by expert.
        start = 0
        first: dict[tuple[int, int], int] = {}  # (source rank, expert) -> first row
        for s in range(ranks):
            for e in owned(rank):
                first[s, e] = start
                start += counts[s][e]
        by_expert: list[int] = []
        offsets: list[int] = []
        for e in owned(rank):
            for s in range(ranks):
                by_expert.extend(range(first[s, e], first[s, e] + counts[s][e]))
            offsets.append(len(by_expert))
        return Exchange(send, recv, by_expert, offsets)


class ExpertShard(nn.Module):
    """Rank ``rank``'s experts of ``experts`` and the all-to-all around them (module
    docstring). Its parameters keep the replaced module's names."""

    def __init__(
        self,
        experts: FusedExperts,
        ranks: int,
        rank: int,
        routing: Sequence[Sequence[int]] | None,
    ):
        super().__init__()
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
            raise ExportError(
                f"expert parallelism takes HuggingFace's fused experts without bias or "
                f"transposed weights; {type(experts).__name__} has them"
            )
        total = experts.num_experts
        if total % ranks:
            raise ExportError(f"ep={ranks} does not divide the {total} experts")
        self.local = total // ranks
        self.total, self.ranks, self.rank, self.routing = total, ranks, rank, routing
        owned = slice(rank * self.local, (rank + 1) * self.local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[owned].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[owned].clone())
        self.gate = experts._apply_gate  # HuggingFace's activation of the gate times up

    def counts(self, pairs: int) -> Sequence[Sequence[int]]:
        """The routing: given, or balanced over ``pairs`` (token, choice) pairs per rank."""
        if self.routing is None:
            return balanced_routing(pairs, self.total, self.ranks)
        shape_ok = len(self.routing) == self.ranks and all(
            len(row) == self.total and sum(row) == pairs and min(row) >= 0 for row in self.routing
        )
        if not shape_ok:
            raise ExportError(
                f"routing must give, for each of the {self.ranks} ranks, the pairs it sends each "
                f"of the {self.total} experts, {pairs} in all per rank (tokens x top-k)"
            )
        return self.routing

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        from transformers.integrations.moe import _grouped_linear

        tokens, top_k = top_k_index.shape
        exchange = Exchange.of(self.counts(tokens * top_k), self.ranks, self.rank)
        device = hidden.device
        # Dispatch: the pairs sorted by expert, to the ranks holding their experts.
        _, order = torch.sort(top_k_index.reshape(-1))
        sent = hidden[order // top_k]
        received = funcol.all_to_all_single(sent, exchange.recv, exchange.send, _world())
        by_expert = torch.tensor(exchange.by_expert, dtype=torch.long, device=device)
        rows = received[by_expert]
        offsets = torch.tensor(exchange.offsets, dtype=torch.int32, device=device)
        out = _grouped_linear(rows, self.gate_up_proj, offsets)
        out = _grouped_linear(self.gate(out), self.down_proj, offsets)
        # Combine: back to the received order, to the source ranks, to the pairs' order.
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        returned = funcol.all_to_all_single(back, exchange.send, exchange.recv, _world())
        weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        pairs = torch.empty_like(weighted).index_copy(0, order, weighted)
        return pairs.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("expert parallelism exchanges under a process group: none is set up")
    return group


@contextlib.contextmanager
def sharded(
    model: nn.Module, ranks: int, rank: int, routing: Sequence[Sequence[int]] | None = None
) -> Iterator[int]:
    """``model`` with each fused experts module replaced by rank ``rank``'s ``ExpertShard``
    of ``ranks``, under the fake process group, for the block; yields the number replaced. The
    model is restored after."""
    if not 0 <= rank < ranks:
        raise ExportError(f"ep_rank must be from 0 to {ranks - 1}, not {rank}")
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if is_fused_experts(child)
    ]
    if not found:
        raise ExportError(
            "ep= found no HuggingFace fused experts module (gate_up_proj and down_proj over "
            "num_experts) in the model"
        )
    try:
        for parent, name, child in found:
            setattr(parent, name, ExpertShard(child, ranks, rank, routing))
        with fake_process_group(ranks, rank):
            yield len(found)
    finally:
        for parent, name, child in found:
            setattr(parent, name, child)


__all__ = [
    "Exchange",
    "ExpertShard",
    "balanced_routing",
    "fake_process_group",
    "is_fused_experts",
    "sharded",
]
