"""Per-rank graphs of expert parallelism (`rp.export(..., ep=N, ep_rank=r)`) on HuggingFace MoE
models at tiny widths: rank r holds E/N experts, dispatch and combine are all-to-alls with the
split sizes of the routing, and the planner plans the graph without errors, seeing the rank's
share of the parameters."""

from __future__ import annotations

import subprocess

import pytest
import torch

import recompute_planner as rp
from recompute_planner._exporter import write_graph
from recompute_planner._zoo import real_size
from recompute_planner.errors import ExportError
from recompute_planner.expert_parallel import ExpertShard

pytest.importorskip("transformers")

EP = 4
SEQ = 32
TOP_K = 2
EXPERTS = 8
ATTENTION = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4)
TINY = {
    "qwen3-moe-30b-a3b": dict(
        moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
    ),
    "mixtral-8x7b": dict(num_key_value_heads=2, num_local_experts=EXPERTS),
    # The first layer dense, the second MoE, as DeepSeek-V3's first three are dense.
    "deepseek-v3": dict(
        moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=EXPERTS, n_group=2,
        topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=1,
    ),
}
ALL_TO_ALL = "_c10d_functional.all_to_all_single.default"
FORWARD, BACKWARD = 1, 2  # graph.proto's Phase


def build(family: str) -> torch.nn.Module:
    return real_size.build(
        family, layers=2, **ATTENTION, num_experts_per_tok=TOP_K, **TINY[family]
    )


def expert_and_other_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the routed experts' weights and of every other parameter, unsharded."""
    experts = other = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts += size
        else:
            other += size
    return experts, other


def moe_layers(model: torch.nn.Module) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith("mlp.experts"))


@pytest.mark.parametrize("family", list(TINY))
def test_a_rank_holds_its_share_of_the_experts_behind_two_all_to_alls_and_plans(family):
    model = build(family)
    experts, other = expert_and_other_bytes(model)
    step = rp.export(model, real_size.inputs(SEQ), ep=EP, ep_rank=1)
    plan = rp.plan(step, check=True)  # raises on an error diagnostic
    assert plan.memory.parameter_bytes == other + experts // EP
    exchanges = [n for n in step.graph.nodes if n.op == ALL_TO_ALL]
    # Dispatch and combine in forward, both reversed in backward, per MoE layer.
    layers = moe_layers(model)
    assert layers >= 1
    assert sum(n.phase == FORWARD for n in exchanges) == 2 * layers
    assert sum(n.phase == BACKWARD for n in exchanges) == 2 * layers
    # Balanced: each rank sends each expert SEQ * TOP_K / EXPERTS pairs; a rank holds
    # EXPERTS / EP of them.
    balanced = [SEQ * TOP_K // EP] * EP
    for node in exchanges:
        splits = {a.name: list(a.ints.values) for a in node.attributes if a.ints.values}
        assert splits == {"output_split_sizes": balanced, "input_split_sizes": balanced}
    assert (step.graph.metadata.world_size, step.graph.metadata.rank) == (EP, 1)
    # The model is the user's again: its experts are whole.
    assert not any(isinstance(m, ExpertShard) for m in model.modules())
    assert expert_and_other_bytes(model) == (experts, other)


def test_a_given_routing_sets_the_split_sizes_of_each_rank():
    # Every rank sends all its pairs to experts 0 and 1 (rank 0's), half each.
    pairs = SEQ * TOP_K
    routing = [[pairs // 2, pairs // 2] + [0] * (EXPERTS - 2) for _ in range(EP)]
    model = build("qwen3-moe-30b-a3b")
    for rank, (sent, received) in {0: ([pairs, 0, 0, 0], [pairs] * EP),
                                   2: ([pairs, 0, 0, 0], [0] * EP)}.items():
        step = rp.export(model, real_size.inputs(SEQ), ep=EP, ep_rank=rank, routing=routing)
        dispatch = next(n for n in step.graph.nodes if n.op == ALL_TO_ALL)
        splits = {a.name: list(a.ints.values) for a in dispatch.attributes if a.ints.values}
        assert splits == {"input_split_sizes": sent, "output_split_sizes": received}
        rp.plan(step, check=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ep=3), "ep=3 does not divide the 8 experts"),
        (dict(ep=EP, ep_rank=EP), "ep_rank must be from 0 to 3"),
        (dict(ep=EP, routing=[[1] * EXPERTS] * EP), "routing must give"),
        (dict(ep=EP, fake=False), "fake=False"),
    ],
    ids=["indivisible", "rank", "routing", "real"],
)
def test_an_expert_parallel_export_it_cannot_make_is_an_export_error(kwargs, message):
    model = build("qwen3-moe-30b-a3b")
    with pytest.raises(ExportError, match=message):
        rp.export(model, real_size.inputs(SEQ), **kwargs)
    assert not any(isinstance(m, ExpertShard) for m in model.modules())


def test_a_model_without_fused_experts_is_refused():
    dense = real_size.build(
        "llama-3-8b", layers=1, **ATTENTION, num_key_value_heads=2
    )
    with pytest.raises(ExportError, match="found no HuggingFace fused experts"):
        rp.export(dense, real_size.inputs(SEQ), ep=EP)


def test_planner_plan_takes_a_ranks_graph_without_errors(tmp_path, planner_bin):
    step = rp.export(build("mixtral-8x7b"), real_size.inputs(SEQ), ep=EP, ep_rank=3)
    path = tmp_path / "mixtral_ep4_rank3.pb"
    write_graph(step.graph, path)
    done = subprocess.run([planner_bin, "plan", str(path), "--keep", "all"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "\nerror" not in done.stdout and "  fits in 141 GiB" in done.stdout
