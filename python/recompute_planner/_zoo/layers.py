"""Building blocks shared by the zoo models: seeded parameters, RMSNorm, RoPE, attention, MLP.

Parameters are drawn from one `torch.Generator` threaded through the constructors in a fixed
order, so every rank (and every run) builds bit-identical weights from the config's seed without
touching the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..markers import checkpoint_record

# A marker function bound to one layer: `mark(name, x)` returns `x`'s identity.
Mark = Callable[[str, torch.Tensor], torch.Tensor]


def seeded_tensor(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    """A normal(0, std) tensor drawn from `gen`."""
    return torch.randn(*shape, generator=gen) * std


def seeded_param(gen: torch.Generator, *shape: int, std: float) -> nn.Parameter:
    """A normal(0, std) parameter drawn from `gen`."""
    return nn.Parameter(seeded_tensor(gen, *shape, std=std))


def layer_marker(omitted: frozenset[str], record: bool = True) -> Mark:
    """The marker function of one layer: records every marker except the `omitted` ones, or
    none at all without `record`.

    Omitting markers builds the unbalanced variant (a begin without its end, an end without
    its begin) from the same layer code; recording none builds the unmarked model.
    """

    def mark(name: str, x: torch.Tensor) -> torch.Tensor:
        return x if not record or name in omitted else checkpoint_record(name, x)

    return mark


class Linear(nn.Module):
    """A bias-free linear layer with seeded weights (`nn.Linear` draws from the global RNG)."""

    def __init__(self, gen: torch.Generator, in_features: int, out_features: int):
        super().__init__()
        self.weight = seeded_param(gen, out_features, in_features, std=in_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, gen: torch.Generator, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim, generator=gen))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


@dataclass(frozen=True)
class SequenceContext:
    """Per-step tensors every layer reads, computed once outside the layers.

    `cos`/`sin`: rotary tables of this rank's positions [S, head_dim]; `causal_bias`:
    [S, world * S], 0 where a local query may attend a key of the gathered sequence and -1e9
    where it may not (DSA models only; finite so that masked entries vanish from softmax
    without producing NaN).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    causal_bias: torch.Tensor | None = None


def rope_tables(
    positions: torch.Tensor, dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings for float `positions`: [len(positions), dim]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `x` ([B, S, ..., dim]) by the tables of its sequence positions ([S, dim])."""
    while cos.dim() < x.dim() - 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """The gated MLP of Llama, gate and up projections fused: down(silu(gate(x)) * up(x))."""

    def __init__(self, gen: torch.Generator, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = Linear(gen, dim, 2 * hidden)
        self.down_proj = Linear(gen, hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class Attention(nn.Module):
    """Causal multi-head attention with RoPE through `scaled_dot_product_attention`."""

    def __init__(self, gen: torch.Generator, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = Linear(gen, dim, 3 * heads * head_dim)
        self.o_proj = Linear(gen, heads * head_dim, dim)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, mark: Mark
    ) -> tuple[torch.Tensor, None]:
        """-> (output, no auxiliary loss); `mark` is unused: dense attention has no inner unit."""
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        q = apply_rope(q, ctx.cos, ctx.sin).transpose(1, 2)
        k = apply_rope(k, ctx.cos, ctx.sin).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), None
