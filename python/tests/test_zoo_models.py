"""The zoo models in eager: they train, shard their experts, validate configs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from graph_walk import GOLDEN_DIR
from recompute_planner._zoo import ENTRIES, ZooConfig, entry, make_inputs
from recompute_planner._zoo.distributed import fake_process_group, run_on_ranks
from recompute_planner._zoo.goldens import traced_group
from recompute_planner._zoo.model import CausalLM
from tolerance import assert_tensor_close


@pytest.mark.parametrize("zoo_entry", ENTRIES, ids=lambda e: e.name)
def test_forward_backward_is_finite(zoo_entry):
    """Every model runs a training step in eager (rank 0, fake group if expert parallel)."""
    with traced_group(zoo_entry.config.world_size):
        model = zoo_entry.build()
        loss = model(*make_inputs(zoo_entry.config))
        loss.backward()
    assert loss.dim() == 0 and math.isfinite(loss.item())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{zoo_entry.name}: {name} gets no gradient"
        assert torch.isfinite(param.grad).all(), f"{zoo_entry.name}: {name} grad not finite"


def test_ranks_hold_slices_of_the_same_experts():
    """Rank r of a world holds experts [r * E/W, (r+1) * E/W) of the one global set."""
    moe = entry("moe_ep2")
    whole = moe.build(world_size=1)
    for world_size in (2, 4):
        for rank in range(world_size):
            part = moe.build(world_size=world_size, rank=rank)
            local = part.cfg.local_experts
            rows = slice(rank * local, (rank + 1) * local)
            for layer, whole_layer in zip(part.layers, whole.layers, strict=True):
                assert torch.equal(layer.experts.up_proj, whole_layer.experts.up_proj[rows])
                assert torch.equal(layer.gate.weight, whole_layer.gate.weight)


def test_inputs_are_seeded_per_rank():
    """Data-parallel ranks draw their own tokens; sequence-parallel ranks share one stream."""
    moe = entry("moe_ep2").config
    assert not torch.equal(make_inputs(moe)[0], make_inputs(moe.for_rank(2, 1))[0])
    assert torch.equal(make_inputs(moe)[0], make_inputs(moe)[0])
    glm = entry("glm_dsa_ep2").config
    rank0, rank1 = make_inputs(glm), make_inputs(glm.for_rank(2, 1))
    # The MTP inputs are the labels shifted once more, across the shard boundary too.
    assert torch.equal(rank0[2], rank0[1])
    assert torch.equal(rank0[3][:, -1], rank1[1][:, 0])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_experts=3, world_size=2), "not divisible"),
        (dict(num_experts=4, index_topk=4, compile="layer"), "must run in eager"),
        (dict(micro_batches=2), "only in MoE layers"),
        (dict(num_experts=4, batch=3, micro_batches=2), "does not split"),
        (dict(num_experts=4, world_size=2, rank=2), "outside world_size"),
        (dict(mla=True, index_topk=4), "either MLA"),
        (dict(hf_moe=True), "set num_experts"),
        (dict(num_experts=4, hf_moe=True, inplace_dispatch=True), "does not apply"),
        (dict(dropout=1.0), "not a probability"),
        (dict(num_experts=4, dropout=0.1), "only in dense models"),
    ],
)
def test_config_rejects_impossible_models(changes, message):
    with pytest.raises(ValueError, match=message):
        ZooConfig(**changes)


def _eager_loss(world_size: int, rank: int, name: str) -> torch.Tensor:
    """One eager step of zoo model `name` as `rank` of a real gloo world; its loss."""
    cfg = entry(name).config.for_rank(world_size, rank)
    return entry(name).build(world_size, rank)(*make_inputs(cfg)).detach()


def test_reference_comes_from_real_ranks():
    """The EP goldens' reference loss is real data, not the fake group's echo.

    Rank 0's loss depends only on its own tokens, so with correct all-to-all exchanges it
    equals the single-rank loss of the same tokens (within the cross-machine tolerance: the
    files and this run may come from different CPUs); the fake group's echo gives another one.
    """
    single = load_file(GOLDEN_DIR / "moe_layer_compiled.safetensors")["ref/loss"]
    for name in ("moe_ep2", "moe_ep4", "moe_ep2_inplace"):
        loss = load_file(GOLDEN_DIR / f"{name}.safetensors")["ref/loss"]
        assert_tensor_close(f"{name} ref/loss", loss, single)
    real = run_on_ranks(2, _eager_loss, "moe_ep2")[0]
    assert_tensor_close("moe_ep2 loss on real ranks", real, single)
    with fake_process_group(2, 0):
        echoed = _eager_loss(2, 0, "moe_ep2")
    with pytest.raises(AssertionError, match="max abs error"):
        assert_tensor_close("moe_ep2 loss on the fake group", echoed, single)


def test_domino_splits_the_batch_not_the_model():
    """The domino path computes the single-batch path's function (given room for every token).

    With a capacity no token overflows, routing does not depend on how the batch is split.
    """
    roomy = dataclasses.replace(entry("moe_ep2").config.for_rank(1, 0), capacity=32)
    domino = dataclasses.replace(roomy, micro_batches=2)
    inputs = make_inputs(roomy)
    torch.testing.assert_close(CausalLM(domino)(*inputs), CausalLM(roomy)(*inputs))


def test_hf_idioms_compute_the_plain_moe_function():
    """moe_hf_router's in-place router and permuting dispatcher are a rewrite of the plain MoE
    layer: same loss and gradients, up to the order its combine sums each token's choices."""
    hf = entry("moe_hf_router").config
    plain = dataclasses.replace(hf, hf_moe=False)
    inputs = make_inputs(hf)
    results = []
    for cfg in (hf, plain):
        model = CausalLM(cfg)
        loss = model(*inputs)
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (hf_loss, hf_grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(hf_loss, plain_loss)
    torch.testing.assert_close(hf_grads, plain_grads)


def test_dropout_changes_the_training_step_only():
    """dense_dropout is dense plus dropout: the same loss in eval mode, another in training."""
    dense, dropout = entry("dense"), entry("dense_dropout")
    inputs = make_inputs(dense.config)
    reference = dense.build()(*inputs)
    model = dropout.build()
    torch.manual_seed(0)
    assert not torch.equal(model(*inputs), reference)
    assert torch.equal(model.eval()(*inputs), reference)
