"""Stock HuggingFace model families in tiny configurations (random weights, nothing downloaded),
annotated with layer scopes and units, with the inputs that keep their mask code static."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from recompute_planner.model_export import causal_mask

# Training configurations: no KV cache (a cache the layers update would differ between a
# checkpointed layer's forward and its recompute).
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
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        mask = causal_mask(BATCH, SEQ, self.dtype)
        return {"input_ids": ids, "labels": ids, "attention_mask": mask}


def _causal_lm(config_name: str, model_name: str, **extra) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**SHAPE, **extra)
        return getattr(transformers, model_name)(config)

    return build


DENSE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
MOE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MOE_GATE": ["mlp.gate"]}

FAMILIES: tuple[Family, ...] = (
    Family("llama", _causal_lm("LlamaConfig", "LlamaForCausalLM"), DENSE_UNITS),
    Family("mistral", _causal_lm("MistralConfig", "MistralForCausalLM"), DENSE_UNITS),
    Family("qwen2", _causal_lm("Qwen2Config", "Qwen2ForCausalLM"), DENSE_UNITS),
    Family("qwen3", _causal_lm("Qwen3Config", "Qwen3ForCausalLM"), DENSE_UNITS),
    Family(
        "qwen3_moe", _causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **MOE), MOE_UNITS,
        torch.bfloat16,
    ),
)


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)
