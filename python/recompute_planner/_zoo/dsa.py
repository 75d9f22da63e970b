"""DSA: DeepSeek-V3.2 / GLM-5.2-style sparse attention with the lightning indexer.

Each local query attends only to the `index_topk` keys the indexer selects from the whole
(sequence-parallel gathered) sequence. The compile layout keeps the top-k out of compiled code:

    compiled index projection + RoPE -> compiled SP gather -> dsa.indexer.begin
    -> eager, mutation-free top-k selection -> dsa.indexer.end -> compiled sparse attention

The indexer gets its gradient from the indexer loss of DeepSeek-V3.2: the KL divergence from the
(detached) sparse-attention distribution over the selected keys to the indexer's own
distribution over them, with the indexer's input detached from the main model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..markers import compiled_region
from .config import ZooConfig
from .distributed import all_gather
from .layers import Linear, Mark, SequenceContext, apply_rope


class DSAAttention(nn.Module):
    """Sparse multi-head attention over the keys the lightning indexer selects.

    The indexer's head dimension equals the attention's, so both share the rotary tables.
    """

    def __init__(self, gen: torch.Generator, cfg: ZooConfig, region_prefix: str):
        super().__init__()
        self.cfg = cfg
        self.region_prefix = region_prefix
        dim, heads, head_dim = cfg.hidden, cfg.heads, cfg.head_dim
        self.qkv_proj = Linear(gen, dim, 3 * heads * head_dim)
        self.o_proj = Linear(gen, heads * head_dim, dim)
        # Indexer queries (index_heads x head_dim), its one key head and per-head weights, fused.
        self.index_proj = Linear(gen, dim, (cfg.index_heads + 1) * head_dim + cfg.index_heads)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, mark: Mark
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` [B, S, D] (this rank's sequence shard) -> (output [B, S, D], indexer loss)."""
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.cfg.heads, self.cfg.head_dim)
        q, k, v = qkv.unbind(dim=2)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        index_q, index_k, index_weights = self._index_projection(x.detach(), ctx)
        with compiled_region(f"{self.region_prefix}.sp_gather"):
            index_k = self._gather_sequence(index_k)
        index_q = mark("dsa.indexer.begin", index_q)
        scores, selected = self._select_topk(index_q, index_k, index_weights, ctx)
        selected = mark("dsa.indexer.end", selected)
        with compiled_region(f"{self.region_prefix}.sparse_attention"):
            out, probs = self._sparse_attention(q, torch.stack([k, v], dim=2), selected, ctx)
        loss = self._indexer_loss(scores, selected, probs)
        return self.o_proj(out.flatten(2)), loss

    def _index_projection(
        self, x: torch.Tensor, ctx: SequenceContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indexer queries [B, S, Hi, hd], keys [B, S, hd] and head weights [B, S, Hi]."""
        batch, seq, _ = x.shape
        heads, dim = self.cfg.index_heads, self.cfg.head_dim
        with compiled_region(f"{self.region_prefix}.indexer"):
            index_q, index_k, index_weights = self.index_proj(x).split(
                [heads * dim, dim, heads], dim=-1
            )
            index_q = apply_rope(index_q.view(batch, seq, heads, dim), ctx.cos, ctx.sin)
            index_k = apply_rope(index_k, ctx.cos, ctx.sin)
            return index_q, index_k, index_weights * heads**-0.5

    def _gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence from every rank's shard ([B, S, ...] -> [B, world * S, ...])."""
        return all_gather(x, dim=1) if self.cfg.world_size > 1 else x

    def _select_topk(
        self,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
        index_weights: torch.Tensor,
        ctx: SequenceContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index scores [B, S, world * S] and the top-k key positions [B, S, k] per query.

        I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]), causally masked. Mutation-free, so a
        selective checkpoint may keep it (SAVE_DSA_INDEXER).
        """
        batch, seq, heads, _ = index_q.shape
        logits = torch.bmm(index_q.flatten(1, 2), index_k.transpose(1, 2)).relu()
        weights = index_weights.view(batch * seq, 1, heads)
        scores = torch.bmm(weights, logits.view(batch * seq, heads, -1)).view(batch, seq, -1)
        scores = scores + _causal_bias(ctx)
        return scores, scores.topk(self.cfg.index_topk, dim=-1).indices

    def _sparse_attention(
        self, q: torch.Tensor, kv: torch.Tensor, selected: torch.Tensor, ctx: SequenceContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of each query over its selected keys -> (output [B, S, H, hd], probs).

        `kv` [B, S, 2, H, hd] is gathered from every rank's shard first; a selected position the
        query may not see (fewer visible keys than k) is masked by the causal bias.
        """
        kv = self._gather_sequence(kv)
        batch, keys = kv.shape[:2]
        rows = selected + (torch.arange(batch) * keys).view(batch, 1, 1)
        picked = kv.flatten(0, 1).index_select(0, rows.flatten())
        k_sel, v_sel = picked.view(*rows.shape, *kv.shape[2:]).unbind(dim=3)  # [B, S, k, H, hd]
        bias = _causal_bias(ctx).expand(batch, -1, -1).gather(-1, selected)
        scores = (q.unsqueeze(2) * k_sel).sum(dim=-1) * self.cfg.head_dim**-0.5  # [B, S, k, H]
        probs = (scores + bias.unsqueeze(-1)).softmax(dim=2)
        return (probs.unsqueeze(-1) * v_sel).sum(dim=2), probs

    @staticmethod
    def _indexer_loss(
        scores: torch.Tensor, selected: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        """KL(head-averaged attention over the selected keys || the indexer's softmax)."""
        target = probs.detach().mean(dim=-1)
        log_index = scores.gather(-1, selected).log_softmax(dim=-1)
        return F.kl_div(log_index.flatten(0, 1), target.flatten(0, 1), reduction="batchmean")


def _causal_bias(ctx: SequenceContext) -> torch.Tensor:
    """The causal bias DSA masks its scores with (the sequence context of a DSA model has it)."""
    if ctx.causal_bias is None:
        raise ValueError("DSA attention needs the sequence context's causal bias")
    return ctx.causal_bias
