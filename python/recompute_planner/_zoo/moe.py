"""Mixture of experts: softmax top-k router, routed experts, expert-parallel dispatcher.

Dispatch uses a FIXED capacity per (expert, source rank), so every shape is static and traces:
each (token, choice) gets a slot `expert * capacity + position`, choices past the capacity go to
one extra "dropped" row, and the buffer is filled with `index_add` (boolean-mask indexing would
need `nonzero`, whose output shape depends on data). The all-to-all then moves equal splits.
`HFDispatcher` computes the same slots, and moves tokens with the in-place idioms of stock
HuggingFace MoE code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ZooConfig
from .distributed import all_to_all, to_host
from .layers import Mark, seeded_param, seeded_tensor


class Router(nn.Module):
    """Softmax gate choosing `top_k` experts per token; returns normalized weights and ids.

    With `cfg.hf_moe` it normalises the weights in place (`weights /= weights.sum(...)`), as
    HuggingFace's Mixtral and Qwen-MoE code does.
    """

    def __init__(self, gen: torch.Generator, cfg: ZooConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.normalise_in_place = cfg.hf_moe
        self.weight = seeded_param(gen, cfg.num_experts, cfg.hidden, std=cfg.hidden**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalise_in_place:
            weights /= weights.sum(dim=-1, keepdim=True)
            return weights, experts
        return weights / weights.sum(dim=-1, keepdim=True), experts


class Experts(nn.Module):
    """The routed experts this rank holds, as one grouped SwiGLU GEMM (batched matmuls).

    Weights are drawn for all experts and sliced to the local ones, so every rank agrees on
    every expert's weights whatever the world size.
    """

    def __init__(self, gen: torch.Generator, cfg: ZooConfig):
        super().__init__()
        first = cfg.rank * cfg.local_experts
        local = slice(first, first + cfg.local_experts)
        dim, ffn, experts = cfg.hidden, cfg.moe_ffn, cfg.num_experts

        def local_param(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(seeded_tensor(gen, experts, *shape, std=std)[local].clone())

        self.gate_proj = local_param(dim, ffn, std=dim**-0.5)
        self.up_proj = local_param(dim, ffn, std=dim**-0.5)
        self.down_proj = local_param(ffn, dim, std=ffn**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x`: [local experts, rows, hidden] -> same shape."""
        hidden = F.silu(torch.bmm(x, self.gate_proj)) * torch.bmm(x, self.up_proj)
        return torch.bmm(hidden, self.down_proj)


class Dispatcher:
    """Moves routed tokens to the ranks holding their experts and back (expert parallelism).

    `dispatch` and `combine` are the permutation and padding work around the all-to-all; they
    record the two intervals of SAVE_MOE_DISPATCH and always run in eager.
    """

    def __init__(self, cfg: ZooConfig):
        self.cfg = cfg
        self.num_slots = cfg.num_experts * cfg.capacity

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor, mark: Mark
    ) -> tuple[torch.Tensor, Any]:
        """Tokens `x` [T, D] routed to `experts` [T, k] -> (expert input, slots); `slots` is
        what `combine` takes back (a tensor here, `PermutedSlots` in `HFDispatcher`).

        The expert input is [local experts, world * capacity, D]: for each local expert, the
        rows every source rank sent it, padding zeroed. `slots` [T * k] says where each
        (token, choice) went, the last row (`E * capacity`) meaning dropped.
        """
        cfg = self.cfg
        x = mark("moe.dispatch.begin", x)
        flat = experts.reshape(-1)
        hits = flat.unsqueeze(-1) == torch.arange(cfg.num_experts)
        slots = self._slots(flat, hits)
        tokens = x.repeat_interleave(cfg.top_k, dim=0)
        buffer = x.new_zeros(self.num_slots + 1, x.shape[-1])
        if cfg.inplace_dispatch:
            buffer.index_add_(0, slots, tokens)
        else:
            buffer = buffer.index_add(0, slots, tokens)
        received = self._exchange(buffer, hits.sum(dim=0))
        return mark("moe.dispatch.end", received), slots

    def _slots(self, flat: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
        """The buffer row of each (token, choice) [T * k], from its expert ids `flat` and their
        one-hot `hits` [T * k, E]: `expert * capacity + position`, or the last row
        (`E * capacity`, dropped) past the capacity."""
        cfg = self.cfg
        position = (hits.cumsum(dim=0) * hits).sum(dim=-1) - 1
        return torch.where(position < cfg.capacity, flat * cfg.capacity + position, self.num_slots)

    def _exchange(self, buffer: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The filled buffer [E * capacity + 1, D] and routing counts [E] -> the expert input
        [local experts, world * capacity, D], through the all-to-alls."""
        cfg = self.cfg
        send = buffer[: self.num_slots]
        if cfg.world_size > 1:
            counts = all_to_all(counts, cfg.world_size)
        host_counts = to_host(counts)
        if cfg.world_size > 1:
            send = all_to_all(send, cfg.world_size)
        received = self._mask_padding(send, host_counts)
        return received.transpose(0, 1).reshape(cfg.local_experts, -1, buffer.shape[-1])

    def _mask_padding(self, received: torch.Tensor, host_counts: torch.Tensor) -> torch.Tensor:
        """Zeroes the rows past each (source rank, local expert)'s routed count.

        `host_counts` is the host copy of the routing counts; using it keeps the device-to-host
        `_to_copy` in the graph the way count-derived all-to-all splits do in expert-parallel
        training.
        """
        cfg = self.cfg
        rows = received.view(cfg.world_size, cfg.local_experts, cfg.capacity, -1)
        filled = host_counts.clamp(max=cfg.capacity).view(cfg.world_size, cfg.local_experts, 1)
        # The mask is computed on the host, from the host counts, and used on the device (a
        # no-op on CPU; on GPU, as a graph traced with fake CUDA tensors shows, a copy).
        valid = torch.arange(cfg.capacity, device=host_counts.device) < filled
        return rows * valid.to(rows.device).unsqueeze(-1)

    def combine(
        self, y: torch.Tensor, slots: Any, weights: torch.Tensor, mark: Mark
    ) -> torch.Tensor:
        """Expert outputs `y` back to their tokens, weighted by the router: -> [T, D]."""
        cfg = self.cfg
        y = mark("moe.combine.begin", y)
        rows = self._rows_by_slot(y)
        picked = rows.index_select(0, slots).view(-1, cfg.top_k, rows.shape[-1])
        out = (picked * weights.unsqueeze(-1)).sum(dim=1)
        return mark("moe.combine.end", out)

    def _rows_by_slot(self, y: torch.Tensor) -> torch.Tensor:
        """Expert outputs [local experts, world * capacity, D] -> this rank's tokens' rows by
        slot [E * capacity + 1, D], through the reverse all-to-all; the last row is zero (what
        a dropped choice contributes)."""
        cfg = self.cfg
        y = y.view(cfg.local_experts, cfg.world_size, cfg.capacity, -1).transpose(0, 1)
        y = y.reshape(self.num_slots, -1)
        if cfg.world_size > 1:
            y = all_to_all(y, cfg.world_size)
        return torch.cat([y, y.new_zeros(1, y.shape[-1])])


class PermutedSlots(NamedTuple):
    """Where `HFDispatcher` put each (token, choice): the slots in slot order and the inverse
    of that sorting permutation."""

    sorted_slots: torch.Tensor  # [T * k]
    inverse: torch.Tensor  # [T * k]: position of each (token, choice) in slot order


class HFDispatcher(Dispatcher):
    """The same dispatch written the way stock HuggingFace (and Megatron) MoE code is.

    Inside SAVE_MOE_DISPATCH, fresh buffers are filled in place and read only after the
    writes: the routing mask comes from `F.one_hot` (whose range checks have no path to the
    loss), the sorting permutation's inverse is `torch.empty_like(perm)` filled by
    `inv[perm] = torch.arange(...)` (`index_put_`), the per-expert counts are a `new_zeros`
    map filled by `scatter_` (DeepSeek-V3's `cnts.scatter_(1, topk_ids, 1)`), the expert
    buffer is `new_zeros` filled by `index_put_` in slot order, and combine sums each token's
    choices into a `zeros_like` buffer with `index_put_(..., accumulate=True)`.
    """

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor, mark: Mark
    ) -> tuple[torch.Tensor, PermutedSlots]:
        cfg = self.cfg
        x = mark("moe.dispatch.begin", x)
        flat = experts.reshape(-1)
        slots = self._slots(flat, F.one_hot(flat, cfg.num_experts))
        order = slots.argsort(stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        sorted_slots = slots[order]
        buffer = x.new_zeros(self.num_slots + 1, x.shape[-1])
        buffer.index_put_((sorted_slots,), x.repeat_interleave(cfg.top_k, dim=0)[order])
        routing_map = experts.new_zeros(experts.shape[0], cfg.num_experts)
        routing_map.scatter_(1, experts, 1)
        received = self._exchange(buffer, routing_map.sum(dim=0))
        return mark("moe.dispatch.end", received), PermutedSlots(sorted_slots, inverse)

    def combine(
        self, y: torch.Tensor, slots: PermutedSlots, weights: torch.Tensor, mark: Mark
    ) -> torch.Tensor:
        cfg = self.cfg
        y = mark("moe.combine.begin", y)
        rows = self._rows_by_slot(y)
        picked = rows[slots.sorted_slots][slots.inverse]  # back to (token, choice) order
        weighted = picked.view(-1, cfg.top_k, rows.shape[-1]) * weights.unsqueeze(-1)
        out = torch.zeros_like(weighted[:, 0])
        token_of_choice = torch.arange(weighted.shape[0]).repeat_interleave(cfg.top_k)
        out.index_put_((token_of_choice,), weighted.flatten(0, 1), accumulate=True)
        return mark("moe.combine.end", out)


def build_dispatcher(cfg: ZooConfig) -> Dispatcher:
    """`HFDispatcher` for `cfg.hf_moe`, else the plain `Dispatcher`."""
    return HFDispatcher(cfg) if cfg.hf_moe else Dispatcher(cfg)
