"""Causal language models of the zoo: embedding, decoder layers, head, loss, optional MTP.

`module(*inputs)` returns the scalar training loss of this rank, which is what the exporter
traces. Every decoder layer runs inside `layer_scope(model, i)`; everything else inside
`layer_scope(model, None)`. The MTP layer is a nested model ("mtp", parent "main") with its own
scopes, as a compose or MTP block would be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..markers import layer_scope
from .config import ZooConfig
from .decoder import DenseDecoderLayer, MoEDecoderLayer
from .layers import Linear, RMSNorm, SequenceContext, layer_marker, rope_tables, seeded_param

MAIN_MODEL = "main"
MTP_MODEL = "mtp"
# Weight of the DSA indexer losses in the training loss.
INDEXER_LOSS_WEIGHT = 0.1


def build_layer(
    gen: torch.Generator, cfg: ZooConfig, model: str, layer: int, moe: bool
) -> DenseDecoderLayer | MoEDecoderLayer:
    """One decoder layer of `model`; compiled-region names are prefixed like parameter paths."""
    prefix = f"layers.{layer}" if model == MAIN_MODEL else f"{model}.layers.{layer}"
    if moe:
        return MoEDecoderLayer(gen, cfg, model, layer, prefix)
    return DenseDecoderLayer(gen, cfg, prefix)


def sequence_context(cfg: ZooConfig) -> SequenceContext:
    """Rotary tables of this rank's positions and, for DSA, the causal bias over all ranks."""
    first = cfg.rank * cfg.seq if cfg.uses_dsa else 0
    positions = torch.arange(first, first + cfg.seq, dtype=torch.float32)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    if not cfg.uses_dsa:
        return SequenceContext(cos=cos, sin=sin)
    keys = torch.arange(cfg.global_seq, dtype=torch.float32)
    causal_bias = torch.where(keys[None, :] > positions[:, None], -1e9, 0.0)
    return SequenceContext(cos, sin, causal_bias)


def sum_losses(losses: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Sum of the auxiliary losses layers returned; None when no layer returned one."""
    present = [loss for loss in losses if loss is not None]
    return torch.stack(present).sum() if present else None


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token prediction: predicts the token after next from the main
    model's last hidden states combined with the embedding of the next token."""

    def __init__(self, gen: torch.Generator, cfg: ZooConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.embed_norm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.eh_proj = Linear(gen, 2 * cfg.hidden, cfg.hidden)
        self.block = build_layer(gen, cfg, MTP_MODEL, 0, moe=cfg.num_experts > 0)
        self.norm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.mark = layer_marker(frozenset(), cfg.hand_markers)

    def forward(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, ctx: SequenceContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (normalized MTP hidden states, the block's auxiliary loss)."""
        with layer_scope(MTP_MODEL, 0):
            h, aux = self.layer_forward(hidden, next_embeds, ctx)
        with layer_scope(MTP_MODEL, None):
            return self.norm(h), aux

    def layer_forward(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, ctx: SequenceContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer 0 of the "mtp" model: everything inside its layer scope (a whole-layer
        checkpoint wraps this, `recompute_planner._measure`)."""
        h = torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embeds)], dim=-1)
        out: tuple[torch.Tensor, torch.Tensor | None] = self.block(self.eh_proj(h), ctx, self.mark)
        return out


class CausalLM(nn.Module):
    """Decoder-only LM; with `cfg.mtp` it also takes the MTP inputs and adds the MTP loss."""

    def __init__(self, cfg: ZooConfig):
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed_tokens = nn.Parameter(seeded_param(gen, cfg.vocab, cfg.hidden, std=1.0))
        self.layers = nn.ModuleList(
            build_layer(gen, cfg, MAIN_MODEL, i, moe=cfg.is_moe_layer(i))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.lm_head = Linear(gen, cfg.hidden, cfg.vocab)
        self.mtp = MTPLayer(gen, cfg) if cfg.mtp else None
        self.marks = [
            layer_marker(
                frozenset(name for layer, name in cfg.omitted_markers if layer == i),
                cfg.hand_markers,
            )
            for i in range(cfg.num_layers)
        ]

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor, *mtp_inputs: torch.Tensor
    ) -> torch.Tensor:
        """Mean cross-entropy of this rank's tokens (+ weighted indexer and MTP losses).

        `mtp_inputs` (MTP only) are the next tokens and the labels after them, per position.
        """
        with layer_scope(MAIN_MODEL, None):
            ctx = sequence_context(self.cfg)
            h = F.embedding(tokens, self.embed_tokens)
        aux_losses = []
        for i, layer in enumerate(self.layers):
            with layer_scope(MAIN_MODEL, i):
                h, aux = layer(h, ctx, self.marks[i])
            aux_losses.append(aux)
        with layer_scope(MAIN_MODEL, None):
            loss = self._lm_loss(self.norm(h), labels)
        if self.mtp is not None:
            mtp_loss, aux = self._mtp_loss(h, ctx, *mtp_inputs)
            aux_losses.append(aux)
        with layer_scope(MAIN_MODEL, None):
            if self.mtp is not None:
                loss = loss + mtp_loss
            aux = sum_losses(aux_losses)
            return loss if aux is None else loss + INDEXER_LOSS_WEIGHT * aux

    def _lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy through the (shared) output head."""
        logits = self.lm_head(hidden)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def _mtp_loss(
        self,
        hidden: torch.Tensor,
        ctx: SequenceContext,
        next_tokens: torch.Tensor,
        next_labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the weighted MTP loss, the MTP block's auxiliary loss)."""
        with layer_scope(MTP_MODEL, None):
            next_embeds = F.embedding(next_tokens, self.embed_tokens)
        if self.mtp is None:
            raise ValueError("the model has no MTP layer (cfg.mtp)")
        mtp_hidden, aux = self.mtp(hidden, next_embeds, ctx)
        with layer_scope(MTP_MODEL, None):
            return self.cfg.mtp_loss_weight * self._lm_loss(mtp_hidden, next_labels), aux
