"""CPU dropout under eager selective checkpointing: eager runs it as an in-place `bernoulli_`
the checkpoint cannot cache, so an eager plan of a CPU-traced graph replays it (with the
generator state restored), and what the step holds when forward ends is the plan's saved set
plus the generator state each layer stashes."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import recompute_planner as rp
from recompute_planner import _measure as measure

REPO_ROOT = Path(__file__).resolve().parents[2]
# The CPU generator state `torch.utils.checkpoint` stashes per layer (`torch.get_rng_state()`).
RNG_STATE_BYTES = 5056


@pytest.fixture(scope="module")
def case():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    return table.zoo_case("dense_dropout", 8, 64)


def plan_of(graph, keep, executor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, executor=executor)


def dropout_reasons(plan) -> set[str]:
    return {n.reason for n in plan.nodes if n.op.startswith("aten.native_dropout")}


@pytest.mark.parametrize("keep", [None, "all"], ids=["none", "all"])
def test_eager_plan_of_a_cpu_graph_replays_dropout(case, keep):
    """The graph executor saves dropout (`--random-ops save`); the eager plan of the same
    CPU-traced graph replays it."""
    assert dropout_reasons(plan_of(case.graph, keep, "graph")) == {"random"}
    assert dropout_reasons(plan_of(case.graph, keep, "eager")) == {"random-replayed"}


@pytest.mark.parametrize("keep", [None, "all"], ids=["none", "all"])
def test_eager_step_holds_the_saved_set_and_each_layers_generator_state(case, keep):
    """Measured when forward ends: the eager plan's saved bytes and one generator state per
    checkpointed layer with dropout (the CPU allocator counts the stash)."""
    plan = plan_of(case.graph, keep, "eager")
    loss, params = case.step(plan)
    step = measure.measure_step(loss, params, case.input_bytes)
    layers = {(n.model, n.layer) for n in plan.nodes if n.reason == "random-replayed"}
    assert len(layers) == 2
    assert step.saved_bytes == plan.memory.saved_bytes + RNG_STATE_BYTES * len(layers)
