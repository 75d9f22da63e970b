"""MLA: DeepSeek-V3's multi-head latent attention, written the way its HuggingFace code is.

Keys and values come from a low-rank latent of the hidden states. Each head's query and key join
a part without rotary embedding (`nope`) and a rotary part (`pe`; the key's is one head shared
by all). The join is what this module exists for: like the HuggingFace modeling code, it fills
a `new_empty` buffer slice by slice,

    key = k_pe.new_empty(...); key[..., :nope] = k_nope; key[..., nope:] = k_pe

so the exported graph holds `new_empty` + `slice` + `copy_` inside the attention interval, and
what is copied in reaches the loss only through those in-place writes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ZooConfig
from .layers import Linear, Mark, RMSNorm, SequenceContext, apply_rope


def joined_heads(nope: torch.Tensor, pe: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, heads, n + p] from `nope` [B, S, heads, n] and `pe` [B, S, heads or 1, p], by
    filling a fresh buffer slice by slice (DeepSeek-V3's HuggingFace code)."""
    batch, seq, _, width = nope.shape
    joined = pe.new_empty(batch, seq, heads, width + pe.shape[-1])
    joined[..., :width] = nope
    joined[..., width:] = pe
    return joined


class MLAAttention(nn.Module):
    """Causal multi-head latent attention. The no-RoPE and RoPE parts are `head_dim` wide each;
    values are as wide as queries and keys (DeepSeek-V3's are narrower), so that sdpa runs its
    fused CPU kernel as the zoo's other attention does."""

    def __init__(self, gen: torch.Generator, cfg: ZooConfig):
        super().__init__()
        self.heads, self.head_dim, self.rank = cfg.heads, cfg.head_dim, cfg.kv_lora_rank
        dim, heads, head_dim = cfg.hidden, cfg.heads, cfg.head_dim
        self.q_proj = Linear(gen, dim, heads * 2 * head_dim)
        self.kv_a_proj_with_mqa = Linear(gen, dim, cfg.kv_lora_rank + head_dim)
        self.kv_a_layernorm = RMSNorm(gen, cfg.kv_lora_rank, cfg.rms_eps)
        self.kv_b_proj = Linear(gen, cfg.kv_lora_rank, heads * 3 * head_dim)
        self.o_proj = Linear(gen, heads * 2 * head_dim, dim)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, mark: Mark
    ) -> tuple[torch.Tensor, None]:
        """-> (output, no auxiliary loss); `mark` is unused: MLA has no inner unit."""
        batch, seq, _ = x.shape
        heads, width = self.heads, self.head_dim
        q_nope, q_pe = self.q_proj(x).view(batch, seq, heads, 2 * width).split(width, dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, width], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, heads, 3 * width)
        k_nope, value = kv.split([width, 2 * width], dim=-1)
        q_pe = apply_rope(q_pe, ctx.cos, ctx.sin)
        k_pe = apply_rope(k_pe.unsqueeze(2), ctx.cos, ctx.sin)  # one head, shared
        query = joined_heads(q_nope, q_pe, heads).transpose(1, 2)
        key = joined_heads(k_nope, k_pe, heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value.transpose(1, 2), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), None
