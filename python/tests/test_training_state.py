"""The device total (`plan.memory.device_total_bytes`: parameters, gradients, optimizer state
and the activation peak, docs/cost-and-memory.md M4) against PyTorch's own memory tracker.

`torch.distributed._tools.mem_tracker.MemTracker` measures one eager training step under fake
tensors, a real `torch.optim.AdamW` step included (multi-tensor, PyTorch's default on GPUs).
The optimizer's state exists from the first `optimizer.step()` on, so the measured step is the
second: one step runs untracked first, as in training, where every step after the first holds
the state throughout. The planner's figure is for the same model exported with fake tensors,
its gradients in `.grad` as the traced graph outputs them.

Under FSDP, `FSDPMemTracker` measures the same step with `fully_shard` over a fake process
group: the shards are compared exactly, the device total within a few percent but for the
layer a GPU prefetches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import recompute_planner as rp
from graph_walk import GOLDEN_DIR
from recompute_planner._zoo import real_size
from recompute_planner.expert_parallel import fake_process_group
from recompute_planner.model_export import causal_mask

transformers = pytest.importorskip("transformers")
MemTracker = pytest.importorskip("torch.distributed._tools.mem_tracker").MemTracker

SEQ = 256
# Llama-3's shape at a small real width: the parameters, their gradients and AdamW's moments
# are of the order of the activations, so the test sees each.
SMALL_LLAMA = dict(
    layers=2, vocab_size=4096, hidden_size=256, intermediate_size=896,
    num_attention_heads=4, num_key_value_heads=2,
)


def build(dtype: torch.dtype, **overrides) -> torch.nn.Module:
    return real_size.build("llama-3-8b", dtype=dtype, **{**SMALL_LLAMA, **overrides})


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, foreach=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
}


def measured_step(
    dtype: torch.dtype, optimizer: str, checkpoint: bool
) -> tuple[dict[str, int], dict[str, int]]:
    """MemTracker's figures of the second training step: the peak by category, and what is
    live after it (parameters and optimizer state)."""
    model = build(dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if checkpoint:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        mask = causal_mask(1, SEQ, dtype)
        optim = OPTIMIZERS[optimizer](model.parameters())

        def step():
            loss = model(input_ids=ids, labels=ids, attention_mask=mask).loss
            loss.backward()
            del loss
            optim.step()
            optim.zero_grad(set_to_none=True)

        step()
        tracker = MemTracker()
        tracker.track_external(model, optim)
        with tracker:
            step()
    device = torch.device("cpu")
    return tracker.get_tracker_snapshot("peak")[device], tracker.get_tracker_snapshot()[device]


def planned(
    dtype: torch.dtype, optimizer: str, checkpoint: bool, fsdp: int = 1
) -> rp.plans.Memory:
    step = rp.export(build(dtype), real_size.inputs(SEQ, dtype=dtype), fake=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(
            step, recompute_ratio=1.0 if checkpoint else 0.0, optimizer=optimizer,
            optimizer_state_dtype="param", fsdp=fsdp,
        ).memory


# AdamW's step, with its scratch, outweighs whole-layer checkpointed activations here; SGD's
# never outweighs forward and backward.
CASES = [("adamw", True, "optimizer-step"), ("sgd", False, "forward-backward")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("optimizer, checkpoint, phase", CASES, ids=[c[0] for c in CASES])
def test_the_device_total_is_within_3_percent_of_memtracker(dtype, optimizer, checkpoint, phase):
    memory = planned(dtype, optimizer, checkpoint)
    peak, after = measured_step(dtype, optimizer, checkpoint)
    assert memory.device_parameter_bytes == after["Parameter"]
    # The state's step counters (one scalar tensor per parameter) are not counted.
    assert abs(memory.optimizer_state_bytes - after["Optstate"]) < 1024
    assert memory.device_peak_phase == phase
    total = memory.device_total_bytes
    assert abs(total / peak["Total"] - 1) < 0.03, (
        f"planned {total} B ({memory.device_peak_phase}), MemTracker {peak}"
    )


# --------------------------------------------------------------------------------------------
# FSDP

FSDP = 4


def measured_fsdp_step(dtype: torch.dtype, checkpoint: bool) -> dict[str, int]:
    """`FSDPMemTracker`'s peak of the second AdamW step of the model under `fully_shard` (every
    decoder layer, then the root) over a fake process group of `FSDP` ranks, whole-layer
    checkpointed: what rank 0 holds, by FSDP's categories."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with fake_process_group(FSDP, 0):
        # The mesh is made outside fake mode: its construction reads a real tensor.
        mesh = init_device_mesh("cpu", (FSDP,))
        model = build(dtype)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            if checkpoint:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.train()
            ids = torch.zeros(1, SEQ, dtype=torch.long)
            mask = causal_mask(1, SEQ, dtype)
            optim = OPTIMIZERS["adamw"](model.parameters())

            def step():
                loss = model(input_ids=ids, labels=ids, attention_mask=mask).loss
                loss.backward()
                del loss
                optim.step()
                optim.zero_grad(set_to_none=True)

            step()
            tracker = FSDPMemTracker(model, optim)
            with tracker:
                step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {getattr(k, "value", k): v for k, v in peak.items()}


@pytest.mark.parametrize(
    "dtype, checkpoint",
    [(torch.float32, True), (torch.bfloat16, False)],
    ids=["fp32-whole-layer", "bf16-no-checkpoint"],
)
def test_under_fsdp_the_device_total_is_within_3_percent_of_fsdp_mem_tracker(dtype, checkpoint):
    """The parameter shard and the optimizer state are FSDP's to the byte (its step counters
    aside), and the device total is within 3% of what `FSDPMemTracker` measures, but for the
    layer FSDP2 prefetches: on a GPU the next layer's all-gather overlaps the current layer's
    compute, so two layers are gathered at once, which the device total counts; a fake-tensor
    step on the CPU runs nothing ahead and gathers one."""
    memory = planned(dtype, "adamw", checkpoint, fsdp=FSDP)
    measured = measured_fsdp_step(dtype, checkpoint)
    assert measured["Sharded Param"] == -(-memory.parameter_bytes // FSDP)
    assert abs(measured["OptState"] - memory.optimizer_state_bytes) < 1024
    layer = build(dtype).model.layers[0]
    prefetched = sum(p.numel() * p.element_size() for p in layer.parameters())
    total = memory.device_total_bytes - prefetched
    assert abs(total / measured["Total"] - 1) < 0.03, (
        f"planned {total} B without the prefetched layer ({memory.device_peak_phase}), "
        f"FSDPMemTracker {measured}"
    )


# --------------------------------------------------------------------------------------------
# The Python API


def test_rp_plan_takes_the_training_state_and_a_budget_on_the_device_total():
    graph = GOLDEN_DIR / "moe_ep2.pb"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        whole = rp.plan(graph, keep="all", fsdp=2, master_weights=True)
        assert (whole.config.fsdp, whole.config.master_weights) == (2, True)
        budget = whole.memory.device_total_bytes + whole.memory.gradient_bytes
        answer = rp.plan(
            graph, budget=budget, budget_includes="training-state", fsdp=2, master_weights=True
        )
    assert answer.memory.device_total_bytes <= budget
    assert answer.memory.fits() and not rp.plan(graph, hw={"memory_bytes": 1024}).memory.fits()
    with pytest.raises(rp.PlannerError, match="budget 1.0 KiB .* is not above") as error:
        rp.plan(graph, budget="1KiB", budget_includes="training-state")
    assert error.value.code == "budget-infeasible"
    for option, value in [("optimizer", "lion"), ("optimizer_state_dtype", "fp8"),
                          ("budget_includes", "everything"), ("fsdp", 0)]:
        with pytest.raises(rp.PlannerError, match=option) as error:
            rp.plan(graph, budget="1GiB", **{option: value})
        assert error.value.code == "invalid-option"
