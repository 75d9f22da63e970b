"""Planning a model at its real size without allocating it (`rp.export` with fake tensors),
checked against PyTorch's own memory tracker.

`torch.distributed._tools.mem_tracker.MemTracker` measures one eager training step under fake
tensors (its peak of live storages, parameters included); the planner's totals for the same
step, exported with fake tensors, are its activation peak plus the parameters it keeps apart.
They count the same things when the measured step keeps only what the traced graph keeps: the
loss (not the model's output object, whose logits would stay alive through backward) and the
gradients `torch.autograd.grad` returns (not `.grad`). Three families at real width (2 of their
layers, 4096 tokens, bf16), HuggingFace's eager and SDPA attention, no checkpointing and
whole-layer checkpointing (`gradient_checkpointing_enable`, non-reentrant), each traced for the
CPU and for a GPU.

The GPU step is measured on fake CPU tensors running the GPU's kernels: torch's autograd engine
cannot run a backward over fake CUDA tensors without a GPU, and MemTracker needs torch's engine
(its hooks). The kernel that differs is attention, so the measured step's SDPA calls go
through the device export's own choice for the profile's device (`_DeviceAttention`), which
the fake CUDA trace makes too.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import recompute_planner as rp
from recompute_planner._zoo import real_size
from recompute_planner.device_export import _DeviceAttention
from recompute_planner.errors import ExportError
from recompute_planner.model_export import causal_mask

transformers = pytest.importorskip("transformers")
MemTracker = pytest.importorskip("torch.distributed._tools.mem_tracker").MemTracker

SEQ = 4096
LAYERS = 2
FAMILIES = ["llama-3-8b", "qwen3-moe-30b-a3b", "deepseek-v3"]
# DeepSeek-V3's second layer is a MoE layer (the model's first three are dense).
OVERRIDES = {"deepseek-v3": dict(first_k_dense_replace=1)}
H100_CAPABILITY = (9, 0)
GIB = 2**30


def _device_sdpa(*args, **kwargs):
    """HuggingFace's SDPA attention with the fused kernel an H100 runs, on any device."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with _DeviceAttention(H100_CAPABILITY, device_type="cpu"):
        return sdpa_attention_forward(*args, **kwargs)


transformers.AttentionInterface.register("h100_sdpa", _device_sdpa)


def build(family: str, attention: str) -> torch.nn.Module:
    return real_size.build(
        family, layers=LAYERS, attention=attention, **OVERRIDES.get(family, {})
    )


@functools.cache
def measured_peak(family: str, attention: str, *, checkpoint: bool) -> int:
    """MemTracker's peak bytes of one training step of `family`, on fake CPU tensors."""
    model = build(family, attention)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if checkpoint:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        mask = causal_mask(1, SEQ, torch.bfloat16)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss = model(input_ids=ids, labels=ids, attention_mask=mask).loss
            grads = torch.autograd.grad(loss, list(model.parameters()))
            del loss, grads
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def planned_totals(family: str, attention: str, device: str) -> tuple[int, int]:
    """The planner's no-checkpoint and whole-layer totals (peak + parameters) of the step
    exported with fake tensors for `device` (an H100 for `cuda`)."""
    model = build(family, attention)
    hw = "h100" if device == "cuda" else None
    step = rp.export(model, real_size.inputs(SEQ), device=device, hw=hw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        memory = rp.plan(step, hw=hw).memory
    params = memory.parameter_bytes
    return memory.no_checkpoint_peak_bytes + params, memory.full_recompute_peak_bytes + params


# Eager attention runs the same kernels on every device: its GPU trace is checked on the dense
# family only (the MoE families' GPU traces, grouped matmuls included, are checked with SDPA).
CASES = [
    (family, attention, device)
    for family in FAMILIES
    for attention in ("eager", "sdpa")
    for device in ("cpu", "cuda")
    if (attention, device) != ("eager", "cuda") or family == "llama-3-8b"
]


@pytest.mark.parametrize("family, attention, device", CASES, ids=["-".join(c) for c in CASES])
def test_planned_totals_are_within_5_percent_of_memtracker(family, attention, device):
    measured_attention = "h100_sdpa" if (device, attention) == ("cuda", "sdpa") else attention
    planned = planned_totals(family, attention, device)
    measured = (
        measured_peak(family, measured_attention, checkpoint=False),
        measured_peak(family, measured_attention, checkpoint=True),
    )
    labels = ("no checkpoint", "whole-layer")
    for what, plan_bytes, tracked in zip(labels, planned, measured, strict=True):
        assert abs(plan_bytes / tracked - 1) < 0.05, (
            f"{what}: planned {plan_bytes / GIB:.2f} GiB, MemTracker {tracked / GIB:.2f} GiB"
        )


# --------------------------------------------------------------------------------------------
# The public path


def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    rp.annotate(model, layers="model.layers", units={"SAVE_MLP": ["mlp"]})
    return model


def tiny_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids, "attention_mask": causal_mask(2, 8, dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fake_export_of_a_cpu_model_is_the_graph_of_the_real_export(dtype):
    """`fake=True` traces the same step as the export that runs it, byte for byte, and runs
    nothing: no reference tensors, the weights untouched. What the real export's eager probe
    saw Python hold (`python_releases`) a fake export runs no step to observe: left out."""
    model = tiny_llama(dtype)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    real = rp.export(model, tiny_inputs(dtype))
    fake = rp.export(model, tiny_inputs(dtype), fake=True)
    assert any(node.python_releases for node in real.graph.nodes)
    for node in real.graph.nodes:
        del node.python_releases[:]
    assert fake.graph.SerializeToString(deterministic=True) == real.graph.SerializeToString(
        deterministic=True
    )
    assert (fake.params, fake.inputs, fake.loss) == ({}, {}, None)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_a_meta_model_with_inputs_given_as_shapes_is_exported_without_asking():
    """Parameters on `meta` imply the fake export; shapes stand for tensors; the graph is the
    one of the same model on the CPU."""
    with torch.device("meta"):
        meta = tiny_llama(torch.float32)
    tokens = rp.TensorSpec((2, 8), torch.long)
    shaped = {"input_ids": tokens, "labels": tokens,
              "attention_mask": causal_mask(2, 8, device="meta")}
    graph = rp.export(meta, shaped).graph
    cpu = rp.export(tiny_llama(torch.float32), tiny_inputs(torch.float32), fake=True).graph
    assert graph.SerializeToString(deterministic=True) == cpu.SerializeToString(
        deterministic=True
    )
    with pytest.raises(ExportError, match="is on the meta device: pass fake=True"):
        rp.export(meta, shaped, fake=False)


class Attention(torch.nn.Module):
    """One SDPA call over projections of `x`; records the device capability it saw."""

    def __init__(self, heads: int, head_dim: int, kv_heads: int):
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
        self.q = torch.nn.Linear(heads * head_dim, heads * head_dim)
        self.kv = torch.nn.Linear(heads * head_dim, 2 * kv_heads * head_dim)
        self.capability = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.capability = torch.cuda.get_device_capability()
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None,
            enable_gqa=self.kv_heads != self.heads,
        )
        return out.float().square().mean()


def attention_ops(graph) -> set[str]:
    return {n.op for n in graph.nodes if "attention" in n.op or "softmax" in n.op}


FLASH = "aten._scaled_dot_product_flash_attention.default"
EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
MATH_SOFTMAX = "aten._safe_softmax.default"


@pytest.mark.parametrize(
    "dtype, kv_heads, masked, hw, kernel",
    [
        (torch.bfloat16, 2, False, "h100", FLASH),  # grouped-query heads natively
        (torch.bfloat16, 4, True, "h100", EFFICIENT),  # a mask: no flash
        (torch.float32, 4, False, "mi300x", EFFICIENT),  # fp32: no flash
        (torch.float32, 2, False, "h100", MATH_SOFTMAX),  # fp32 grouped-query: math
        (torch.bfloat16, 4, False, {"compute_capability": [7, 5]}, EFFICIENT),  # pre-sm80
    ],
    ids=["flash", "masked", "fp32", "fp32-gqa", "sm75"],
)
def test_a_gpu_trace_runs_the_attention_kernel_the_device_picks(
    dtype, kv_heads, masked, hw, kernel
):
    with torch.device("meta"):
        model = Attention(heads=4, head_dim=64, kv_heads=kv_heads).to(dtype)
    inputs = [rp.TensorSpec((1, 128, 256), dtype)]
    if masked:
        inputs.append(torch.zeros(1, 1, 128, 128, dtype=dtype, device="meta"))
    graph = rp.export(model, inputs, hw=hw).graph
    assert kernel in attention_ops(graph)
    assert not {FLASH, EFFICIENT, MATH_SOFTMAX} - {kernel} & attention_ops(graph)


@pytest.mark.parametrize(
    "hw, capability", [("b200", (10, 0)), ("mi300x", (9, 4)), (None, (9, 0))],
    ids=["b200", "mi300x", "default-h200"],
)
def test_device_queries_in_a_gpu_trace_answer_with_the_profile(hw, capability):
    with torch.device("meta"):
        model = Attention(heads=4, head_dim=64, kv_heads=4).to(torch.bfloat16)
    rp.export(model, [rp.TensorSpec((1, 16, 256), torch.bfloat16)], device="cuda", hw=hw)
    assert model.capability == capability
