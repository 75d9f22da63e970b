"""Production configurations at their real width, as stock HuggingFace models built on the
``meta`` device: nothing is allocated and nothing is downloaded (the configurations are
written out here from the published model cards).

``build(name, layers=..., attention=...)`` gives the annotated bf16 model with ``layers`` of
its decoder layers (the full count when ``None``); ``inputs(seq)`` the step's inputs as shapes
(token ids, labels and the 4D causal mask that keeps HuggingFace's mask code static).
``with_mtp(model)`` adds DeepSeek-V3's multi-token prediction module, which HuggingFace's
model leaves out (``MultiTokenPrediction``); ``declared_models(step)`` the models to export. Used by
the MemTracker cross-check (``python/tests/test_fake_export.py``) and the real-size benchmark
(``scripts/bench_real_size.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._exporter import ModelDecl
from ..annotate import Annotation, annotate, annotation_of
from ..model_export import TensorSpec, causal_mask


@dataclass(frozen=True)
class RealConfig:
    """One published configuration: its HuggingFace model class, config class and fields,
    its full layer count and the units declared on each layer."""

    model_class: str
    config_class: str
    fields: dict[str, Any]
    num_layers: int
    units: dict[str, list[str]]


_TRAINING = dict(use_cache=False, tie_word_embeddings=False)
# MoE experts as one grouped matmul (static shapes; what training on a GPU runs).
_GROUPED = dict(experts_implementation="grouped_mm")
_ATTN_MLP = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
_ATTN_ROUTER = {"SAVE_ATTN": ["self_attn"], "SAVE_ROUTER": ["mlp.gate"]}

CONFIGS: dict[str, RealConfig] = {
    "llama-3-8b": RealConfig(
        "LlamaForCausalLM", "LlamaConfig",
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
        32, _ATTN_MLP,
    ),
    "llama-3-70b": RealConfig(
        "LlamaForCausalLM", "LlamaConfig",
        dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
             num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),
        80, _ATTN_MLP,
    ),
    "qwen3-moe-30b-a3b": RealConfig(
        "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
             moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, **_GROUPED),
        48, _ATTN_ROUTER,
    ),
    "mixtral-8x7b": RealConfig(
        "MixtralForCausalLM", "MixtralConfig",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
             num_experts_per_tok=2, rope_theta=1e6, **_GROUPED),
        32, _ATTN_ROUTER,
    ),
    "deepseek-v3": RealConfig(
        "DeepseekV3ForCausalLM", "DeepseekV3Config",
        dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
             moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
             n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
             topk_group=4, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
             first_k_dense_replace=3, **_GROUPED),
        61, _ATTN_MLP,
    ),
}


def build(
    name: str,
    *,
    layers: int | None = None,
    attention: str = "sdpa",
    dtype: torch.dtype = torch.bfloat16,
    **overrides: Any,
) -> torch.nn.Module:
    """The model ``name`` with ``layers`` decoder layers (default: all), built on ``meta``,
    annotated (layer scopes on ``model.layers``, the configuration's units); MoE experts run
    the grouped matmul. ``overrides`` replace configuration fields."""
    import transformers

    real = CONFIGS[name]
    config_class: Callable[..., Any] = getattr(transformers, real.config_class)
    config = config_class(
        **{**real.fields, **overrides}, **_TRAINING,
        num_hidden_layers=real.num_layers if layers is None else layers,
        attn_implementation=attention,
    )
    with torch.device("meta"):
        model: nn.Module = getattr(transformers, real.model_class)(config).to(dtype)
    annotate(model, layers="model.layers", units=real.units)
    return model


def inputs(seq: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The step's inputs as shapes: token ids, labels and the 4D causal mask (``meta``)."""
    tokens = TensorSpec((batch, seq), torch.long)
    mask = causal_mask(batch, seq, dtype, device="meta")
    return {"input_ids": tokens, "labels": tokens, "attention_mask": mask}


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's training step with its multi-token prediction module of depth 1 (the
    DeepSeek-V3 report, section 2.2): the main model's loss plus ``weight`` times the loss of
    predicting token ``i + 2`` from the main model's hidden state at ``i`` and the embedding of
    token ``i + 1``, through RMSNorms of both, a ``2h -> h`` projection and one decoder layer
    of the model's own kind (MoE), sharing the embedding and the output head.

    The hidden state it reads is the main model's output after its final norm (HuggingFace's
    model returns no other without keeping every layer's); the module's own layer is declared
    as the model ``mtp`` nested in ``main``."""

    def __init__(self, model: Any, weight: float = 0.3):  # a HuggingFace DeepSeek-V3
        super().__init__()
        config = model.config
        layer_class = type(model.model.layers[-1])
        norm_class = type(model.model.norm)
        self.model = model
        self.weight = weight
        self.hidden_norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.embed_norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.projection = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([layer_class(config, config.num_hidden_layers)])
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        inner, vocab = self.model.model, self.model.config.vocab_size
        hidden = inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        loss = self.model.loss_function(self.model.lm_head(hidden), labels, vocab)
        following = inner.embed_tokens(input_ids.roll(-1, dims=1))
        h = self.projection(
            torch.cat([self.hidden_norm(hidden), self.embed_norm(following)], dim=-1)
        )
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        h = self.layers[0](
            h, attention_mask=attention_mask, position_ids=positions,
            position_embeddings=inner.rotary_emb(h, positions),
        )
        logits = self.model.lm_head(self.norm(h))
        mtp_loss = self.model.loss_function(logits, labels.roll(-1, dims=1), vocab)
        total: torch.Tensor = loss + self.weight * mtp_loss
        return total


def with_mtp(model: nn.Module) -> MultiTokenPrediction:
    """``model`` (a DeepSeek-V3 from ``build``) with its multi-token prediction module, built
    on ``meta`` in the model's dtype and annotated as the model ``mtp``."""
    with torch.device("meta"):
        step = MultiTokenPrediction(model).to(next(model.parameters()).dtype)
    annotate(step, layers="layers", units=CONFIGS["deepseek-v3"].units, name="mtp")
    return step


def declared_models(step: nn.Module) -> list[ModelDecl]:
    """The models of an annotated model, or of a ``MultiTokenPrediction`` step: ``main`` and
    ``mtp`` nested in it."""
    if not isinstance(step, MultiTokenPrediction):
        return _annotated(step).models
    (main,) = _annotated(step.model).models
    (mtp,) = _annotated(step).models
    return [main, ModelDecl(mtp.name, mtp.num_layers, mtp.units, parent=main.name)]


def _annotated(module: nn.Module) -> Annotation:
    annotation = annotation_of(module)
    if annotation is None:
        raise ValueError(f"{type(module).__name__} is not annotated (recompute_planner.annotate)")
    return annotation
