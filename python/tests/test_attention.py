"""Scaled dot-product attention under whole-layer recompute: the kernels CPU training picks
(flash for CPU, the math decomposition), causal or not, with a mask or not, with and without
dropout. The fused kernels are random by their schema (they draw a mask when ``dropout_p > 0``)
and the exporter leaves ``dropout_p`` out when the call leaves it at 0: an omitted argument
must mean its default, or every default attention call is planned as a random op and saved.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import recompute_planner as rp

HEADS, SEQ, HEAD_DIM = 2, 8, 4
DIM = HEADS * HEAD_DIM


class Attention(nn.Module):
    def __init__(self, causal: bool, masked: bool, dropout_p: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.causal, self.masked, self.dropout_p = causal, masked, dropout_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self.qkv(x).view(batch, SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril() if self.masked else None
        # Keyword arguments left at their default stay out of the call, as HuggingFace's
        # attention functions leave `dropout_p` and `is_causal` when they do not use them.
        kwargs = {"attn_mask": mask} if self.masked else {}
        if self.causal:
            kwargs["is_causal"] = True
        if self.dropout_p:
            kwargs["dropout_p"] = self.dropout_p
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return x + self.out(out.transpose(1, 2).reshape(batch, SEQ, DIM))


class Model(nn.Module):
    def __init__(self, **attention) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attention(**attention) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def whole_layer_plan(backend: SDPBackend, **attention) -> rp.Plan:
    torch.manual_seed(0)
    model = Model(**attention)
    annotation = rp.annotate(model, layers="layers")
    with sdpa_kernel(backend):
        graph = rp.export(model, (torch.randn(2, SEQ, DIM),)).graph
    annotation.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, ["none"])


def saved_in_layers(plan: rp.Plan) -> list[str]:
    """Values saved from inside a layer (anything but its input)."""
    return [s.value for s in plan.saved if s.layer is not None and s.kind != "layer-input"]


BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
SHAPES = [
    dict(causal=True, masked=False),
    dict(causal=False, masked=False),
    dict(causal=False, masked=True),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
@pytest.mark.parametrize("shape", SHAPES, ids=["causal", "full", "masked"])
def test_whole_layer_recompute_saves_nothing_inside_a_layer_of_deterministic_attention(
    backend, shape
):
    plan = whole_layer_plan(backend, dropout_p=0.0, **shape)
    assert saved_in_layers(plan) == []
    assert not [d for d in plan.diagnostics if d.code == "random-op-saved"]
    attention = [n for n in plan.nodes if "scaled_dot_product" in n.op]
    assert all(n.decision == "recompute" for n in attention)
    if backend == SDPBackend.FLASH_ATTENTION:
        assert len(attention) == 2, "the flash kernel for CPU runs once per layer"


def test_attention_with_dropout_is_still_a_random_op_and_saved():
    # The CPU's flash kernel has no dropout: PyTorch runs the math decomposition. (The fused
    # kernels called with `dropout_p > 0` are covered by the planner's rule tests.)
    plan = whole_layer_plan(SDPBackend.MATH, dropout_p=0.25, causal=True, masked=False)
    random = [n for n in plan.nodes if n.reason == "random"]
    assert {n.layer for n in random} == {0, 1}
    assert all(n.decision == "save" for n in random)
    assert [d.code for d in plan.diagnostics if d.code == "random-op-saved"]


def test_whole_layer_recompute_of_a_stock_llama_on_sdpa_saves_nothing_inside_a_layer():
    transformers = pytest.importorskip("transformers")
    from recompute_planner.model_export import causal_mask

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": causal_mask(2, SEQ)}
    annotation = rp.annotate(model, layers="model.layers")
    graph = rp.export(model, inputs).graph
    annotation.remove()
    assert any("scaled_dot_product" in n.op for n in graph.nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(graph, ["none"])
    assert saved_in_layers(plan) == []
    assert not [d for d in plan.diagnostics if d.code == "random-op-saved"]
