"""A budget's answer, planned with a profile calibrated on this machine, is measured no slower
than every other configuration that fits the same budget: every uniform keep, ten random
per-layer mixes and the answer planned with the H200 datasheet profile, each run under eager
SAC on this CPU and measured interleaved with the others (`_step_timing.rank_budget_answer`).

Three zoo models (`_step_timing.RANKING_CASES`) at widths where a layer's matmuls take
milliseconds on a CPU, each at the budget where the datasheet's answer is predicted slowest
against the calibrated one, so that a ranking by measured time tells the two profiles apart
where they differ: planned with the datasheet instead, the MoE's answer is measured 5% to 6%
slower than the calibrated one and this test fails (docs/cost-and-memory.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

import recompute_planner as rp
from recompute_planner import _step_timing as timing

pytestmark = pytest.mark.timed

# A configuration measured faster than the answer by less than this is a tie: two copies of
# the answer itself measured up to about 1% apart on a shared 2-core machine, and a
# configuration predicted 0.5% slower than the answer measured from 2.8% faster to no faster.
# The MoE's datasheet answer, the one a profile tells apart here, measured 5.5% to 5.9% slower.
TIE = 0.04


@pytest.fixture(scope="module")
def profile():
    return rp.calibrate("cpu", repeat=5)


def faster_than_the_answer(ranked: list[timing.Ranked]) -> set[str]:
    return {r.label for r in ranked if r.vs_answer < -TIE}


def table(ranked: list[timing.Ranked]) -> str:
    return "\n".join(
        f"  {r.label}: {r.vs_answer:+.1%} against the answer, step {r.times.step_s * 1e3:.1f} ms "
        f"(predicted {r.plan.cost.step_time_s * 1e3:.1f}), peak {r.plan.memory.peak_bytes:,} B"
        for r in ranked
    )


@pytest.mark.parametrize("case", sorted(timing.RANKING_CASES))
def test_the_calibrated_budget_answer_is_measured_no_slower_than_what_else_fits(case, profile):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        ready = timing.ranking_case(case, profile)
    assert len(ready.candidates) >= 4, f"only {list(ready.candidates)} fit {ready.budget} B"
    rounds, cpu = timing.RANKING_CASES[case][2], torch.device("cpu")
    # A configuration faster in one measurement may have met a burst of load: it must be
    # faster in a second measurement too (another order of the steps) before the test fails.
    tries: list[list[timing.Ranked]] = []
    for seed in (0, 1):
        tries.append(timing.rank_budget_answer(ready.cfg, ready.candidates, cpu, rounds, seed))
        faster = set.intersection(*(faster_than_the_answer(r) for r in tries))
        if not faster:
            break
    assert not faster, (
        f"budget {ready.budget:,} B: faster than the answer by more than {TIE:.1%} in each "
        f"measurement: {sorted(faster)}\n"
        + "\n\n".join(f"measurement {i + 1}:\n{table(r)}" for i, r in enumerate(tries))
    )
