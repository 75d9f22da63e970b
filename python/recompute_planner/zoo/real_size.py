"""Production configurations at their real width, as stock HuggingFace models built on the
``meta`` device: nothing is allocated and nothing is downloaded (the configurations are
written out here from the published model cards).

``build(name, layers=..., attention=...)`` gives the annotated bf16 model with ``layers`` of
its decoder layers (the full count when ``None``); ``inputs(seq)`` the step's inputs as shapes
(token ids, labels and the 4D causal mask that keeps HuggingFace's mask code static). Used by
the MemTracker cross-check (``python/tests/test_fake_export.py``) and the real-size benchmark
(``scripts/bench_real_size.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..annotate import annotate
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
        model = getattr(transformers, real.model_class)(config).to(dtype)
    annotate(model, layers="model.layers", units=real.units)
    return model


def inputs(seq: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The step's inputs as shapes: token ids, labels and the 4D causal mask (``meta``)."""
    tokens = TensorSpec((batch, seq), torch.long)
    mask = causal_mask(batch, seq, dtype, device="meta")
    return {"input_ids": tokens, "labels": tokens, "attention_mask": mask}
