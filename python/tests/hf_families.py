"""Stock HuggingFace model families in tiny configurations (random weights, nothing downloaded),
annotated with layer scopes and units, with the inputs that keep their mask code static."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recompute_planner.model_export import causal_mask

# Training configurations with the KV cache off in the config (the export and eager SAC turn
# a cache on in the config off themselves: tests of that turn it on).
SHAPE = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_cache=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
BATCH, SEQ = 2, 8


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], torch.nn.Module]
    units: dict[str, list[str]]
    dtype: torch.dtype = torch.float32

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.build().to(self.dtype)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Token ids, labels and the 4D causal mask."""
        return {**self.batch(), "attention_mask": causal_mask(BATCH, SEQ, self.dtype)}

    def batch(self) -> dict[str, torch.Tensor]:
        """Token ids and labels, as a training batch holds them (the model makes its masks)."""
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        return {"input_ids": ids, "labels": ids}


def _causal_lm(
    config_name: str, model_name: str, experts: str | None = None, **extra
) -> Callable[[], torch.nn.Module]:
    """A builder of the model from its config: ``SHAPE`` with ``extra`` over it, and the
    experts implementation ``experts`` (HF's ``experts_implementation``) where given."""

    def build() -> torch.nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**{**SHAPE, **extra})
        if experts is not None:
            config._experts_implementation = experts
        return getattr(transformers, model_name)(config)

    return build


DENSE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
MOE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MOE_GATE": ["mlp.gate"]}

FAMILIES: tuple[Family, ...] = (
    Family("llama", _causal_lm("LlamaConfig", "LlamaForCausalLM"), DENSE_UNITS),
    Family(
        "llama_eager_attn",
        _causal_lm("LlamaConfig", "LlamaForCausalLM", attn_implementation="eager"),
        DENSE_UNITS,
    ),
    Family("mistral", _causal_lm("MistralConfig", "MistralForCausalLM"), DENSE_UNITS),
    Family("qwen2", _causal_lm("Qwen2Config", "Qwen2ForCausalLM"), DENSE_UNITS),
    Family("qwen3", _causal_lm("Qwen3Config", "Qwen3ForCausalLM"), DENSE_UNITS),
    Family(
        "qwen3_moe", _causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **MOE), MOE_UNITS,
        torch.bfloat16,
    ),
    Family(
        "qwen2_moe",
        _causal_lm(
            "Qwen2MoeConfig", "Qwen2MoeForCausalLM", shared_expert_intermediate_size=16, **MOE
        ),
        MOE_UNITS,
        torch.bfloat16,
    ),
    Family(
        "mixtral",
        _causal_lm(
            "MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2
        ),
        MOE_UNITS,
        torch.bfloat16,
    ),
)


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


# The stock families as docs/huggingface.md exports them: the configs' own defaults (KV cache
# on, tied embeddings where the family ties them), a sliding window where the family has one,
# float32, and MoE experts as batched matmuls (HF's default grouped matmul runs in bfloat16
# only, whose rounding `planner run --check`'s float32 tolerance does not cover).
STOCK = dict(use_cache=True)
STOCK_FAMILIES: tuple[Family, ...] = (
    Family("llama", _causal_lm("LlamaConfig", "LlamaForCausalLM", **STOCK), DENSE_UNITS),
    Family(
        "mistral",
        _causal_lm("MistralConfig", "MistralForCausalLM", sliding_window=4, **STOCK),
        DENSE_UNITS,
    ),
    Family("qwen2", _causal_lm("Qwen2Config", "Qwen2ForCausalLM", **STOCK), DENSE_UNITS),
    Family(
        "qwen3",
        _causal_lm(
            "Qwen3Config", "Qwen3ForCausalLM", use_sliding_window=True, sliding_window=4,
            layer_types=["full_attention", "sliding_attention"], **STOCK,
        ),
        DENSE_UNITS,
    ),
    # Gemma 2: tied input and output embeddings, full and sliding layers alternating, logits
    # and attention scores soft-capped.
    Family(
        "gemma2",
        _causal_lm("Gemma2Config", "Gemma2ForCausalLM", sliding_window=4, **STOCK),
        DENSE_UNITS,
    ),
    # Phi-3: fused query/key/value and gate/up projections, a sliding window (its default
    # padding token id lies outside the tiny vocabulary).
    Family(
        "phi3",
        _causal_lm("Phi3Config", "Phi3ForCausalLM", sliding_window=4, pad_token_id=0, **STOCK),
        DENSE_UNITS,
    ),
    Family(
        "qwen3_moe",
        _causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "batched_mm", **MOE, **STOCK),
        MOE_UNITS,
    ),
    Family(
        "mixtral",
        _causal_lm(
            "MixtralConfig", "MixtralForCausalLM", "batched_mm", num_local_experts=4,
            num_experts_per_tok=2, **STOCK,
        ),
        MOE_UNITS,
    ),
    Family(
        "deepseek_v3",
        _causal_lm(
            "DeepseekV3Config", "DeepseekV3ForCausalLM", "batched_mm", n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, head_dim=4, **STOCK,
        ),
        MOE_UNITS,
    ),
)
