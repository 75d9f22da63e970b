"""The budget ranking's planning half (`recompute_planner._step_timing`), on a golden, without
measuring anything: what fits a budget, the random mixes, the budget that tells two profiles
apart; and `ZooConfig.resized`, which sizes the ranking's models."""

from __future__ import annotations

import warnings

import pytest

import recompute_planner as rp
from graph_walk import GOLDEN_DIR
from recompute_planner import _step_timing as timing
from recompute_planner._zoo.catalog import entry

DENSE = (GOLDEN_DIR / "dense.pb").read_bytes()
UNITS = ["SAVE_ATTN", "SAVE_MLP"]
# Two profiles that disagree on this graph: one whose fp32 matmuls are slow, one whose vector
# ops and memory are slow and whose ops cost nothing to launch.
SLOW_MATMUL = {"name": "slow matmul", "matmul_f32_flops_per_s": 1e9}
SLOW_VECTOR = {
    "name": "slow vector", "vector_flops_per_s": 1e6, "hbm_bytes_per_s": 1e6,
    **{f"{op}_overhead_s": 0 for op in ("op", "view", "matmul", "attention", "reduction")},
}


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        yield


def eager(**options) -> rp.Plan:
    return rp.plan(DENSE, executor="eager", check=False, **options)


def test_resized_scales_moe_capacity_with_the_tokens_never_below_its_own():
    base = entry("moe_hf_router").config  # 2 x 8 tokens, capacity 6
    assert base.resized(batch=2, seq=256).capacity == 192
    assert base.resized(batch=1, seq=4).capacity == 6
    assert base.resized(hidden=32).capacity == 6
    assert base.resized(batch=2, seq=256, capacity=10).capacity == 10


def test_candidates_start_with_the_answer_fit_the_budget_and_keep_distinct_things():
    low, high = timing.peak(eager(keep="none")), timing.peak(eager(keep="all"))
    budget = (low + high) // 2
    fitting = timing.budget_candidates(
        DENSE, UNITS, budget, SLOW_MATMUL, {"datasheet": "h200"}, mixes=10, seed=0
    )
    assert next(iter(fitting)) == "answer"
    assert timing.kept(fitting["answer"]) == timing.kept(eager(budget=budget, hw=SLOW_MATMUL))
    assert all(timing.peak(plan) <= budget for plan in fitting.values())
    keeps = [timing.kept(plan) for plan in fitting.values()]
    assert len(set(keeps)) == len(keeps)
    assert {plan.cost.hw for plan in fitting.values()} == {"slow matmul"}
    assert "none" in fitting and "all" not in fitting


def test_random_mixes_choose_per_checkpointed_layer_and_repeat_with_their_seed():
    plan = eager()
    mixes = timing.random_mixes(plan, UNITS, 10, seed=0)
    assert len(mixes) == 10
    for mix in mixes:
        assert [(k["model"], k["layer"]) for k in mix["layer_keep"]] == plan.layers()
        assert all(set(k["keep"]) <= set(UNITS) for k in mix["layer_keep"])
    assert mixes == timing.random_mixes(plan, UNITS, 10, seed=0)
    assert mixes != timing.random_mixes(plan, UNITS, 10, seed=1)


def test_the_distinguishing_budget_is_where_the_rivals_answer_is_predicted_slower():
    budget, gap = timing.distinguishing_budget(DENSE, SLOW_MATMUL, SLOW_VECTOR, points=12)
    low, high = timing.peak(eager(keep="none")), timing.peak(eager(keep="all"))
    assert low < budget < high and gap > 0
    own = eager(budget=budget, hw=SLOW_MATMUL)
    theirs = eager(choices=eager(budget=budget, hw=SLOW_VECTOR), hw=SLOW_MATMUL)
    assert theirs.cost.step_time_s / own.cost.step_time_s - 1 == pytest.approx(gap)
    # A profile against itself answers alike everywhere: the midpoint, no gap.
    assert timing.distinguishing_budget(DENSE, "h200", "h200", points=12) == ((low + high) // 2, 0)
