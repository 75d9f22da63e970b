"""Decoder layers: dense (attention + SwiGLU MLP) and MoE (attention + router + experts).

Markers are explicit `.begin` / `.end` pairs around attention
(`attn`), the router (`moe.gate`), the dispatch and combine permutation work (`moe.dispatch`,
`moe.combine`) and the MLP or shared experts (`mlp`); DSA attention adds `dsa.indexer` inside.

The MoE layer runs as a fixed sequence of stages. With one micro-batch that is the plain layer;
with several (the "domino" path) every stage runs for each micro-batch in turn, inside
`layer_scope(model, layer, micro_batch)`, so each micro-batch records its own markers around
exactly the operations the single-batch path encloses (policy rule R10, docs/policy.md).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..markers import compiled_region, layer_scope
from .config import ZooConfig
from .dsa import DSAAttention
from .layers import Attention, Mark, RMSNorm, SequenceContext, SwiGLU
from .mla import MLAAttention
from .moe import Experts, PermutedSlots, Router, build_dispatcher


def build_attention(
    gen: torch.Generator, cfg: ZooConfig, region_prefix: str
) -> Attention | DSAAttention | MLAAttention:
    """DSA sparse attention when the config has an indexer, MLA when it asks for it, dense
    sdpa attention otherwise."""
    if cfg.uses_dsa:
        return DSAAttention(gen, cfg, f"{region_prefix}.self_attn")
    if cfg.mla:
        return MLAAttention(gen, cfg)
    return Attention(gen, cfg.hidden, cfg.heads, cfg.head_dim)


def whole_layer_region(cfg: ZooConfig, region_prefix: str) -> AbstractContextManager[None]:
    """The non-EP compile config compiles the whole layer body as one region."""
    return compiled_region(region_prefix) if cfg.compile == "layer" else contextlib.nullcontext()


class DenseDecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention and a SwiGLU MLP, each with a residual.

    With `cfg.dropout`, training dropout on the attention output (before `attn.end`, so inside
    SAVE_ATTN) and on the MLP output (after `mlp.end`, outside every interval).
    """

    def __init__(self, gen: torch.Generator, cfg: ZooConfig, region_prefix: str):
        super().__init__()
        self.cfg, self.region_prefix = cfg, region_prefix
        self.input_layernorm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.self_attn = build_attention(gen, cfg, region_prefix)
        self.post_attention_layernorm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.mlp = SwiGLU(gen, cfg.hidden, cfg.ffn)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, mark: Mark
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (hidden states, the attention's auxiliary loss or None)."""
        with whole_layer_region(self.cfg, self.region_prefix):
            h = mark("attn.begin", self.input_layernorm(x))
            h, aux = self.self_attn(h, ctx, mark)
            x = x + mark("attn.end", self._dropout(h))
            h = mark("mlp.begin", self.post_attention_layernorm(x))
            x = x + self._dropout(mark("mlp.end", self.mlp(h)))
        return x, aux

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Training dropout with `cfg.dropout`; nothing at all (no op in the graph) at 0."""
        if not self.cfg.dropout:
            return x
        return F.dropout(x, self.cfg.dropout, training=self.training)


@dataclass
class _MicroBatch:
    """One micro-batch's activations as they move through the MoE layer's stages.

    Each stage drops what it used for the last time, as local variables would be dropped:
    a tensor held here past its last use would outlive what the traced graph (and so the
    memory model) says, in forward and in a checkpoint's recompute.
    """

    hidden: torch.Tensor  # [b, S, D]: layer input, then layer output
    residual: torch.Tensor | None = None
    normed: torch.Tensor | None = None  # [b * S, D]: post-attention norm, the MoE input
    aux: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    experts: torch.Tensor | None = None
    slots: torch.Tensor | PermutedSlots | None = None  # where dispatch put each choice
    routed: torch.Tensor | None = None
    combined: torch.Tensor | None = None
    shared: torch.Tensor | None = None


_Slot = TypeVar("_Slot")


def _filled(slot: _Slot | None) -> _Slot:
    """A micro-batch slot an earlier stage filled."""
    if slot is None:
        raise RuntimeError("an MoE layer stage ran before the stage that fills its input")
    return slot


class MoEDecoderLayer(nn.Module):
    """Decoder layer with a routed-expert MoE block and shared experts, optionally domino."""

    def __init__(
        self, gen: torch.Generator, cfg: ZooConfig, model: str, layer: int, region_prefix: str
    ):
        super().__init__()
        self.cfg, self.model, self.layer, self.region_prefix = cfg, model, layer, region_prefix
        self.input_layernorm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.self_attn = build_attention(gen, cfg, region_prefix)
        self.post_attention_layernorm = RMSNorm(gen, cfg.hidden, cfg.rms_eps)
        self.gate = Router(gen, cfg)
        self.experts = Experts(gen, cfg)
        self.shared_experts = SwiGLU(gen, cfg.hidden, cfg.shared_ffn)
        self.dispatcher = build_dispatcher(cfg)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, mark: Mark
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (hidden states, the attention's auxiliary loss averaged over micro-batches)."""
        stages = (
            self._pre_moe_stage,
            self._dispatch_stage,
            self._experts_stage,
            self._combine_stage,
            self._shared_experts_stage,
            self._post_moe_stage,
        )
        with whole_layer_region(self.cfg, self.region_prefix):
            chunks = x.chunk(self.cfg.micro_batches) if self.cfg.micro_batches > 1 else [x]
            micro_batches = [_MicroBatch(hidden=chunk) for chunk in chunks]
            for stage in stages:
                for index, mb in enumerate(micro_batches):
                    with layer_scope(self.model, self.layer, micro_batch=index):
                        stage(mb, ctx, mark)
            return self._join(micro_batches)

    def _join(self, micro_batches: list[_MicroBatch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Concatenates the micro-batches' outputs and averages their auxiliary losses."""
        if len(micro_batches) == 1:
            return micro_batches[0].hidden, micro_batches[0].aux
        hidden = torch.cat([mb.hidden for mb in micro_batches])
        if micro_batches[0].aux is None:
            return hidden, None
        return hidden, torch.stack([_filled(mb.aux) for mb in micro_batches]).mean()

    def _ep_region(self, method: str) -> AbstractContextManager[None]:
        """The EP compile config compiles the layer's pre-MoE, expert, shared-expert and
        post-MoE methods."""
        if self.cfg.compile != "ep":
            return contextlib.nullcontext()
        return compiled_region(f"{self.region_prefix}.{method}")

    def _pre_moe_stage(self, mb: _MicroBatch, ctx: SequenceContext, mark: Mark) -> None:
        """`_pre_moe_forward`: attention, residual, post-attention norm and the router.

        DSA attention stays outside the compiled region: its top-k must run in eager, and it
        compiles its own indexer and sparse-attention pieces.
        """
        attention_region = (
            contextlib.nullcontext() if self.cfg.uses_dsa else self._ep_region("_pre_moe_forward")
        )
        with attention_region:
            h = mark("attn.begin", self.input_layernorm(mb.hidden))
            h, mb.aux = self.self_attn(h, ctx, mark)
            h = mark("attn.end", h)
        with self._ep_region("_pre_moe_forward"):
            mb.residual = mb.hidden + h
            mb.normed = self.post_attention_layernorm(mb.residual).flatten(0, 1)
            weights, mb.experts = self.gate(mark("moe.gate.begin", mb.normed))
            mb.weights = mark("moe.gate.end", weights)

    def _dispatch_stage(self, mb: _MicroBatch, ctx: SequenceContext, mark: Mark) -> None:
        """The dispatcher's permutation, padding and all-to-all: eager in every config."""
        normed, experts = _filled(mb.normed), _filled(mb.experts)
        mb.routed, mb.slots = self.dispatcher.dispatch(normed, experts, mark)
        mb.experts = None

    def _experts_stage(self, mb: _MicroBatch, ctx: SequenceContext, mark: Mark) -> None:
        """The MoE block: this rank's routed experts over the rows it received."""
        with self._ep_region("experts"):
            mb.routed = self.experts(mb.routed)

    def _combine_stage(self, mb: _MicroBatch, ctx: SequenceContext, mark: Mark) -> None:
        """The reverse all-to-all and the router-weighted sum: eager in every config."""
        mb.combined = self.dispatcher.combine(
            _filled(mb.routed), _filled(mb.slots), _filled(mb.weights), mark
        )
        mb.routed = mb.slots = mb.weights = None

    def _shared_experts_stage(self, mb: _MicroBatch, ctx: SequenceContext, mark: Mark) -> None:
        """Shared experts between `mlp` markers that sit in the (uncompiled) layer body.

        Under the EP config the markers fire but everything between them is compiled, so
        SAVE_MLP keeps nothing there (a region counts only if its contents, not just its
        endpoints, run in eager).
        """
        h = mark("mlp.begin", _filled(mb.normed))
        mb.normed = None
        with self._ep_region("_shared_experts_forward"):
            h = self.shared_experts(h)
        mb.shared = mark("mlp.end", h)

    def _post_moe_stage(self, mb: _MicroBatch, ctx: SequenceContext, mark: Mark) -> None:
        """`_post_moe_forward`: routed plus shared output back onto the residual stream."""
        with self._ep_region("_post_moe_forward"):
            residual = _filled(mb.residual)
            moe_out = (_filled(mb.combined) + _filled(mb.shared)).view_as(residual)
            mb.combined = mb.shared = None
            mb.hidden = residual + moe_out
            mb.residual = None
