"""`recompute_planner.calibrate`: a hardware profile measured in eager PyTorch, from the same
benchmarks as `planner calibrate`, that `plan(hw=...)` takes and that times what it measured."""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path

import pytest
import torch

import recompute_planner as rp
from recompute_planner import _native

GLM = Path(__file__).resolve().parents[2] / "tests" / "golden" / "glm_dsa_ep2.pb"


# Calibrations and timings: run last (conftest.py), after pytest's background jobs (the
# Rust tests scripts/test.sh runs beside pytest end minutes before).
pytestmark = pytest.mark.timed


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("calibration") / "eager.json"
    profile = rp.calibrate("cpu", repeat=3, out=out)
    assert json.loads(out.read_text()) == profile
    return profile


def test_every_benchmark_of_the_command_runs_but_collectives_without_a_group(profile):
    timings = profile["calibration"]["timings"]
    benchmarks = json.loads(_native.calibration_benchmarks(False))
    single_rank = [b for b in benchmarks if b["world"] == 1]
    assert [(t["class"], t["op"], t["shape"]) for t in timings] == [
        (b["class"], b["op"], b["inputs"][0]) for b in single_rank
    ]
    not_measured = profile["calibration"]["not_measured"]
    assert "collective_latency_s" in not_measured
    assert "collectives" not in profile["calibration"]
    for field in (
        "op_overhead_s", "matmul_f32_flops_per_s", "hbm_bytes_per_s", "memory_bytes",
        "selection_ops_per_s", "attention_16bit_efficiency", "thin_matmuls",
    ):
        assert field not in not_measured
    # Thin matmuls have their shares of their operands' full rate, one per operands, dimension
    # and size timed (a timing within twice the matmul's fixed cost is left out), and some thin
    # product runs far below the full rate (one summing over a single element writes a whole
    # matrix per multiply-add).
    thin = profile["thin_matmuls"]
    shares = {(t["operands"], t["dim"], t["size"]): t["efficiency"] for t in thin}
    timed = sum(1 for b in single_rank if b["class"].startswith("thin_matmul"))
    assert 0 < len(shares) == len(thin) <= timed
    assert min(shares.values()) < 0.5
    assert profile["name"] == "calibrated cpu (eager)"
    assert 0 < profile["op_overhead_s"] < 1e-3


def test_a_group_times_the_collectives_and_the_profile_names_it():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        profile = rp.calibrate("cpu", repeat=3, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    calibration = profile["calibration"]
    assert calibration["collectives"] == "gloo, 1 rank (torch.distributed)"
    timed = {t["op"].split(".")[1] for t in calibration["timings"] if t["class"] == "collective"}
    assert timed == {"all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"}


def test_a_plan_with_the_profile_states_its_step_time(profile):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(GLM, keep="all", hw=profile)
    cost = plan.cost
    assert cost.hw == profile["name"]
    assert cost.step_time_s == pytest.approx(
        cost.forward_time_s + cost.replay_time_s + cost.backward_time_s
    )
    # Every forward op pays its class's overhead once: doubling them all adds one of each.
    overheads = {
        k: v
        for k, v in profile.items()
        if k.endswith("overhead_s") and k != "checkpoint_op_overhead_s"
    }
    assert len(overheads) == 5
    doubled = {**profile, **{k: 2 * v for k, v in overheads.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        slower = rp.plan(GLM, keep="all", hw=doubled).cost
    added = slower.forward_time_s - cost.forward_time_s
    nodes = len(plan.nodes)
    assert nodes * min(overheads.values()) <= added <= nodes * max(overheads.values())


def test_eager_checkpointings_cost_per_op_is_measured_and_paid_by_checkpointed_layers(profile):
    assert "checkpoint_op_overhead_s" not in profile["calibration"]["not_measured"]
    assert 0 < profile["checkpoint_op_overhead_s"] < 1e-3
    assert profile["asynchronous"] is False  # a CPU runs each op before the next
    doubled = {**profile, "checkpoint_op_overhead_s": 2 * profile["checkpoint_op_overhead_s"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        eager = [
            rp.plan(GLM, keep="all", executor="eager", hw=hw).cost for hw in (profile, doubled)
        ]
        graph = [rp.plan(GLM, keep="all", hw=hw).cost for hw in (profile, doubled)]
        unchecked = [
            rp.plan(GLM, keep="all", executor="eager", hw=hw, recompute_ratio=0.0).cost
            for hw in (profile, doubled)
        ]
    plan = rp.plan(GLM, keep="all", executor="eager", hw=profile, check=False)
    layer_ops = sum(
        1 for n in plan.nodes if n.layer is not None and "checkpoint_record" not in n.op
    )
    # Each forward op of a checkpointed layer pays it once more; the graph executor and a
    # step that checkpoints no layer never.
    added = eager[1].forward_time_s - eager[0].forward_time_s
    assert 0 < added <= layer_ops * profile["checkpoint_op_overhead_s"] * 1.000001
    assert added > layer_ops * profile["checkpoint_op_overhead_s"] / 2
    assert graph[1].step_time_s == graph[0].step_time_s
    assert unchecked[1].step_time_s == unchecked[0].step_time_s


def test_the_fitted_matmul_rate_times_a_size_it_did_not_measure(profile):
    """An fp32 matmul of 384 (the benchmarks time 128, 256, 512 and 768), timed in eager:
    overhead plus FLOPs at the fitted rate, within a factor of 2. The machine's load may
    differ from the calibration's (other tests, other processes): the calibrated sizes 256,
    512 and 768, timed interleaved with the 384 one, scale the prediction by how much slower or
    faster the machine runs now than when it was calibrated (the median of the three ratios, so
    that a spike in one calibrated timing does not skew it)."""
    calibrated = (256, 512, 768)
    recorded = {
        timing["shape"][0]: timing["median_s"]
        for timing in profile["calibration"]["timings"]
        if timing["op"] == "aten.mm.default" and timing["dtype"] == "float32"
        and timing["shape"][0] == timing["shape"][1] and timing["shape"][0] in calibrated
    }
    assert sorted(recorded) == list(calibrated)
    mm = {n: [torch.randn(n, n, requires_grad=True) for _ in range(2)] for n in (384, *calibrated)}
    times: dict[int, list[float]] = {n: [] for n in mm}
    for _ in range(21):
        for n, (a, b) in mm.items():
            started = time.perf_counter()
            torch.mm(a, b)
            times[n].append(time.perf_counter() - started)
    now = {n: statistics.median(times[n][1:]) for n in mm}
    scale = statistics.median(now[n] / recorded[n] for n in calibrated)
    predicted = profile["matmul_overhead_s"] + 2 * 384**3 / profile["matmul_f32_flops_per_s"]
    assert 0.5 < predicted * scale / now[384] < 2.0, (predicted, scale, now, recorded)


def test_too_few_runs_are_refused():
    with pytest.raises(ValueError, match="repeat must be at least 3"):
        rp.calibrate("cpu", repeat=2)
