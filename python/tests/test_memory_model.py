"""The planner's predicted activation peak (docs/cost-and-memory.md) against measurement.

For every joint golden, the step the golden was exported from (same zoo config, seeded weights
and inputs, rank 0) runs in eager PyTorch on CPU, and the peak of the bytes it holds,
parameters excluded, is measured from the allocator (`recompute_planner._measure`). Three
numbers of the golden's eager plan (`--executor eager`: what eager autograd and
`torch.utils.checkpoint` hold) have an eager counterpart and are compared:

- `no_checkpoint_peak_bytes`: the plain step;
- `full_recompute_peak_bytes`: every layer (each decoder layer, the MTP layer) under
  non-reentrant `torch.utils.checkpoint`;
- `peak_bytes` of `--keep all`: the same checkpoints with a selective-checkpoint policy saving
  the ops whose outputs the plan saves.

Which goldens run: all thirteen joint ones. The multi-rank (EP / SP) goldens run in this process as
rank 0 of the fake process group their graph was traced with; every zoo shape is static, so
the allocations are those of a real rank 0. On real gloo ranks, rank 0 measured the same peak
(moe_ep2: 71160 B) in one run and 6240 B more in another (gloo `Work` objects holding the
all-to-all buffers past `wait`), so real ranks would make the test nondeterministic as well as
slow (~20 s of process spawning). `dense_forward` is skipped: a forward-only graph has no
training step, and the planner reports no peak for it.

Tolerance: 6% of the measured peak for the baselines (measured -0.7% .. +3.2%, the largest
`moe_domino` whole-layer), 8% for the plans (-0.2% .. +2.6% run alone;
`glm_dsa_ep2_compiled` measured 2 KiB more, -7.6%, in the whole suite: the GLM/DSA goldens'
kept indexer outputs, whose cached tuples eager releases later than modelled, and a measurement
that depends on what ran before it in the process). The eager model's itemised causes:
docs/cost-and-memory.md, "Eager checkpointing".

Then every executor at a shape where activations dominate, through
`scripts/predictions.py`: eager SAC, the step compiled from the compile stage's plan, and
`planner run`.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import background
import export_support
import recompute_planner as rp
from graph_walk import GOLDEN_DIR, load_graph
from recompute_planner import _measure as measure
from recompute_planner._measure import BASELINE_KEYS, NO_CHECKPOINT, WHOLE_LAYER
from recompute_planner._zoo.goldens import GOLDENS, golden
from recompute_planner.plans import Plan
from recompute_planner.sac import LayerOps

REPO_ROOT = Path(__file__).resolve().parents[2]
# The plans compared with eager PyTorch model eager PyTorch.
EAGER = ("--executor", "eager")
TOLERANCE = 0.06
SELECTIVE_TOLERANCE = 0.08
# Goldens whose plan is measured with other options than `--keep all`: (flags, why).
SELECTIVE_FLAGS = {
    "dense_dropout": (
        ("--keep", "all", "--random-ops", "replay"),
        "eager CPU dropout dispatches `bernoulli_`, `div_` and `mul` where the graph has "
        "`native_dropout`, so no policy can save a dropout by its op: the plan replays them",
    ),
}

MEASURED = [g.name for g in GOLDENS if g.joint and not g.cpu_step_differs]
SKIPPED = {g.name: "forward-only graph: no training step" for g in GOLDENS if not g.joint}
SKIPPED |= {g.name: g.cpu_step_differs for g in GOLDENS if g.cpu_step_differs}



def cases():
    for name in MEASURED:
        for baseline in BASELINE_KEYS:
            yield pytest.param(name, baseline, id=f"{name}-{baseline}")


@functools.cache
def planned(planner: str, name: str, flags: tuple[str, ...] = ("--keep", "none")) -> dict:
    """The JSON plan of golden `name` with planning `flags`."""
    done = subprocess.run(
        [planner, "plan", str(GOLDEN_DIR / f"{name}.pb"), "--format", "json", *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def planned_memory(planner: str, name: str) -> dict:
    """The `memory` section of golden `name`'s default eager plan (it carries the
    baselines)."""
    return planned(planner, name, ("--keep", "none", *EAGER))["memory"]


def gap(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def check_gap(name: str, label: str, predicted: int, step, tolerance: float, record_property):
    relative = gap(predicted, step.peak_bytes)
    line = (
        f"{name} {label}: predicted {predicted} B, measured {step.peak_bytes} B "
        f"({relative:+.1%}); measured peak in {step.peak_stage} at {step.peak_op}"
    )
    print(line)
    record_property("predicted_bytes", predicted)
    record_property("measured_bytes", step.peak_bytes)
    record_property("gap", round(relative, 4))
    breakdown = "\n".join(
        f"  {stage:8s} {op:50s} {nbytes:8d} B in {count}"
        for stage, op, nbytes, count in step.peak_breakdown()
    )
    assert abs(relative) <= tolerance, f"{line}\nlive at the measured peak:\n{breakdown}"


@pytest.mark.parametrize("name, baseline", list(cases()))
def test_baseline_peak_matches_eager(name, baseline, planner_bin, record_property):
    predicted = planned_memory(planner_bin, name)[BASELINE_KEYS[baseline]]
    step = measure.measure_golden(name, baseline)
    check_gap(name, baseline, predicted, step, TOLERANCE, record_property)


@pytest.mark.parametrize("name", MEASURED)
def test_plan_peak_matches_eager_selective_checkpointing(name, planner_bin, record_property):
    """The plan's own `peak_bytes` for `--keep all` (the units of `SELECTIVE_KEEP`, with the
    reason, for the goldens listed there), run as eager selective checkpointing."""
    flags, _reason = SELECTIVE_FLAGS.get(name, (("--keep", "all"), ""))
    plan = planned(planner_bin, name, (*flags, *EAGER))
    step = measure.measure_golden(
        name, measure.SELECTIVE, Plan(json.dumps(plan)), load_graph(GOLDEN_DIR / f"{name}.pb")
    )
    check_gap(
        name, " ".join(flags), plan["memory"]["peak_bytes"], step, SELECTIVE_TOLERANCE,
        record_property,
    )


def test_selective_policy_saves_what_backward_or_replay_reads(planner_bin):
    """`--keep all` keeps every op of dense's attention and MLP, but the policy saves only
    those whose outputs the plan saves: not the RoPE intermediates or the MLP's down
    projection, which nothing after forward reads (saving them too: +12160 B, +26%)."""
    plan = planned(planner_bin, "dense", ("--keep", "all"))
    layer = LayerOps.of(Plan(json.dumps(plan)), "main", 0, load_graph(GOLDEN_DIR / "dense.pb"))
    saved = [op for op, save in zip(layer.ops, layer.keep, strict=True) if save]
    assert saved == [
        "aten.mm.default",  # qkv
        "aten.add.Tensor",  # q after RoPE
        "aten.add.Tensor",  # k after RoPE
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten.mm.default",  # o_proj: replay recomputes the `attn.end` marker and residual
        "aten.mm.default",  # gate_up
        "aten.silu.default",
        "aten.mul.Tensor",  # silu(gate) * up
    ]
    kept = {n["name"] for n in plan["nodes"] if n["layer"] == 0 and n["decision"] == "save"}
    assert len(kept) > len(saved)


def test_skipped_goldens_are_accounted_for():
    """Every golden is either measured or skipped with a reason."""
    assert sorted(MEASURED + list(SKIPPED)) == sorted(g.name for g in GOLDENS)
    assert SKIPPED == {
        "dense_forward": "forward-only graph: no training step",
        "moe_ep2_cuda": golden("moe_ep2_cuda").cpu_step_differs,
    }


# --------------------------------------------------------------------------------------------
# The measurement itself


def test_trace_follows_allocations_and_frees():
    def step():
        a, b = torch.empty(1000), torch.empty(500)  # 4000 B, 2000 B
        del a
        return b, torch.empty(250)  # 1000 B

    trace, _ = measure.trace_allocations(step)
    assert [e.nbytes for e in trace.events] == [4000, 2000, -4000, 1000]
    assert trace.peak() == (6000, 1)
    assert sorted(a.nbytes for a in trace.live_at(len(trace.events) - 1)) == [1000, 2000]


def test_op_scratch_is_what_an_op_frees_within_its_call():
    """A float32 x bfloat16 `mul` on CPU copies the bf16 input to float32 (1024 B) and frees
    the copy before it returns: scratch. Its output is not, nor the 40 B block `resize_`
    frees: another call (`empty`) allocated it."""
    a, b = torch.ones(256), torch.ones(256, dtype=torch.bfloat16)

    def step():
        out = a * b
        buf = torch.empty(10)
        buf.resize_(256)
        return out, buf

    trace, _ = measure.trace_allocations(step)
    assert [e.nbytes for e in trace.events] == [1024, 1024, -1024, 40, 1024, -40]
    tensors = trace.without_op_scratch()
    assert [e.nbytes for e in tensors.events] == [1024, 40, 1024, -40]
    assert tensors.peak() == (2088, 2)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum()


def test_step_excludes_parameters_and_counts_inputs_and_gradients():
    """`(x * w).sum()`: backward holds the loss, the seed and dL/dw (1024 B), plus x (1024 B).

    The 1024 B weight is allocated before the step and never counted.
    """
    step = measure.measure_training_step(_Scale(), (torch.ones(256),))
    assert step.input_bytes == 1024
    assert step.output_bytes == 4 + 1024
    assert step.peak_bytes == 1024 + 4 + 4 + 1024
    assert step.peak_stage == measure.BACKWARD


class _Projection(nn.Module):
    """A bias-free projection summed to a loss: every tensor of its step is floating point."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(64, 256, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).sum()


def test_bfloat16_matmul_step_measures_half_the_float32_step():
    """The step's tensors only: in bfloat16 every one of them is half its float32 size, and so
    is the measured peak. oneDNN's bf16 matmul would add its scratchpad, allocated inside `mm`,
    to the bf16 peak alone (the weight gradient's, 25,728 B on an AVX-512 CPU: 2 x 78,980 B
    against 106,504 B)."""

    def peak(dtype: torch.dtype) -> int:
        x = torch.ones(32, 64, dtype=dtype)
        return measure.measure_training_step(_Projection(dtype), (x,)).peak_bytes

    assert 2 * peak(torch.bfloat16) == peak(torch.float32)


def test_measurement_is_deterministic():
    first = measure.measure_golden("moe_ep2", NO_CHECKPOINT)
    second = measure.measure_golden("moe_ep2", NO_CHECKPOINT)
    assert [e.nbytes for e in first.trace.events] == [e.nbytes for e in second.trace.events]
    assert first.peak_bytes == second.peak_bytes


def test_whole_layer_checkpoint_recomputes_in_backward():
    """Checkpointed layers hold less at the peak and allocate their forward again in backward."""
    plain = measure.measure_golden("dense", NO_CHECKPOINT)
    layered = measure.measure_golden("dense", WHOLE_LAYER)
    assert layered.peak_bytes < plain.peak_bytes
    assert layered.output_bytes == plain.output_bytes

    def recomputed(step: measure.StepMemory) -> int:
        return sum(
            e.nbytes
            for e in step.trace.events
            if e.stage == measure.BACKWARD and e.op == "aten::scaled_dot_product_attention"
        )

    assert recomputed(plain) == 0 and recomputed(layered) > 0


# --------------------------------------------------------------------------------------------
# Every executor: `scripts/predictions.py` plans each case and measures the step it plans

PREDICTIONS_SCRIPT = REPO_ROOT / "scripts" / "predictions.py"
# Small shapes (docs/predictions.md is batch 8 x seq 64), where activations still dominate.
SMALL_SHAPE = ("--batch", "4", "--seq", "32")
EAGER_TOLERANCE = 0.03
# HuggingFace Llama: eager holds two hidden-size tensors of the final norm more than the traced
# graph when forward ends, which `--keep all` (-4.2% at this shape) does not absorb.
HF_TOLERANCE = 0.05
# HuggingFace Mixtral (bf16): its experts' float32 x bf16 `mul` copies the bf16 input to
# float32 on CPU (65,536 B at this shape, -3.5%), scratch the eager measurement counts.
EAGER_CASE_TOLERANCE = {"llama": HF_TOLERANCE, "mixtral": 0.04}
HF_CASES = ("llama", "mixtral")
# The step compiled from the stage's plan, its kernels' scratch apart: torch orders backward
# and replay as the plan does, but for ties (measured -0.5% .. +1.3%). With the scratch,
# Mixtral measured 3.1% .. 3.5% above its plan (a bf16 input copied to float32 for a
# mixed-dtype `mul`), dsv3_kv_expand `SAVE_MLP` 3.3% (the CPU flash-attention backward's
# buffers, 8,320 B).
COMPILE_TOLERANCE = 0.02
# The keep label of the rows that offload the layer inputs (scripts/predictions.py).
LAYER_INPUTS = "layer inputs offloaded"
# torch.compile functionalizes the step's in-place writes into fresh buffers: where a kept unit
# makes a written tensor, the stage plans another program than the exported one
# (tests/test_compile_stage.py, FUNCTIONALIZED: Mixtral's router `div_`).
FUNCTIONALIZED = {"dsv3_kv_expand", "mixtral"}


PREDICTIONS = background.Job(
    "prediction_rows",
    lambda out: [
        sys.executable, str(PREDICTIONS_SCRIPT), *SMALL_SHAPE, "--zoo", "dense", "dsv3_kv_expand",
        "moe_ep2", "--hf", *HF_CASES, "--json", str(out / "rows.json"),
    ],
    env=lambda: {"PLANNER_BIN": str(export_support.planner_bin())},
)
BACKGROUND_JOBS = (PREDICTIONS,)


@pytest.fixture(scope="module")
def prediction_rows() -> list[dict]:
    """The script's rows for three zoo goldens, HuggingFace Llama and Mixtral (bf16) at the
    small shape, every executor."""
    done, out = background.SESSION.finished(PREDICTIONS)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| dense | all | eager |" in done.stdout  # the Markdown table the docs show
    return json.loads((out / "rows.json").read_text())["rows"]


def rows_of(rows: list[dict], executor: str) -> list[dict]:
    chosen = [r for r in rows if r["executor"] == executor]
    assert {r["case"] for r in chosen} == {"dense", "dsv3_kv_expand", "moe_ep2", *HF_CASES}
    return chosen


@pytest.fixture(scope="module")
def eager_rows(prediction_rows) -> list[dict]:
    return rows_of(prediction_rows, "eager")


def test_eager_plan_predicts_the_measured_peak_and_saved_set(eager_rows):
    """`--keep none`, `all` and each unit alone under eager SAC: the eager plan's peak within
    3% of the allocator's (`EAGER_CASE_TOLERANCE`: HuggingFace Llama and Mixtral; the zoo MoE's
    Python locals that outlive their last use are observed at export and held), and on the zoo
    goldens its saved bytes are what the step holds when forward ends, to the byte; where a
    unit's kept outputs are offloaded, the bytes SAC's cache copies to host memory are the
    plan's, to the byte."""
    for r in eager_rows:
        tolerance = EAGER_CASE_TOLERANCE.get(r["case"], EAGER_TOLERANCE)
        relative = gap(r["predicted_peak"], r["measured_peak"])
        assert abs(relative) <= tolerance, f"{r}: {relative:+.1%}"
        if r["case"] not in HF_CASES:
            assert r["predicted_saved"] == r["measured_saved"], r
        assert r.get("measured_offloaded") == r.get("predicted_offloaded"), r
    assert_every_case_moves(eager_rows)


def test_compiled_step_holds_what_the_stage_plan_predicts(prediction_rows):
    """The step compiled from the compile stage's plan (torch's boxed interpreter, which frees
    each value after its last use), its kernels' scratch apart: its peak within 2% of the
    plan's, its saved bytes those of the plan to the byte, and the stage's plan that of the
    exported step (but where torch functionalizes); where a unit's kept outputs are offloaded,
    the bytes the compiled forward copies to host memory are the plan's, to the byte, and its
    saved bytes on the device the plan's less those."""
    rows = rows_of(prediction_rows, "compile")
    for r in rows:
        relative = gap(r["predicted_peak"], r["measured_peak"])
        assert abs(relative) <= COMPILE_TOLERANCE, f"{r}: {relative:+.1%}"
        assert r["predicted_saved"] == r["measured_saved"], r
        assert r["same_plan"] or r["case"] in FUNCTIONALIZED, r
        assert r.get("measured_offloaded") == r.get("predicted_offloaded"), r
    assert_every_case_moves(rows)


def test_planner_run_measures_the_predicted_peak_and_saved_bytes(prediction_rows):
    """`planner run` on each exported step: peak and saved bytes as predicted, to the byte;
    where a unit's kept outputs are offloaded, the bytes moved to host memory too."""
    rows = rows_of(prediction_rows, "graph")
    for r in rows:
        assert (r["measured_peak"], r["measured_saved"]) == (
            r["predicted_peak"], r["predicted_saved"]
        ), r
        assert r.get("measured_offloaded") == r.get("predicted_offloaded"), r
    assert_every_case_moves(rows)


def assert_every_case_moves(rows: list[dict]) -> None:
    """Every case has a row offloading a unit's kept outputs and one offloading the layer
    inputs, each moving bytes."""
    cases = {r["case"] for r in rows}
    moving = [r for r in rows if r["keep"].endswith(" offloaded") and r["predicted_offloaded"]]
    units = {r["case"] for r in moving if r["keep"] != LAYER_INPUTS}
    layer_inputs = {r["case"] for r in moving if r["keep"] == LAYER_INPUTS}
    assert units == cases, "every case moves a unit's kept outputs"
    assert layer_inputs == cases, "every case moves its layer inputs"


def test_eager_keep_all_worse_than_no_checkpointing_is_flagged(eager_rows):
    """The cache holds every kept output: `--keep all` peaks above the step without
    checkpointing, and the plan says so; keeping nothing never does. Mixtral's units
    (attention, router) leave its experts, most of a layer's activations, to recompute."""
    for r in eager_rows:
        worse = r["predicted_peak"] > r["no_checkpoint_peak"]
        assert r["worse_than_no_checkpoint"] == worse, r
        assert not (r["keep"] == "none" and worse), r
    keep_all = [r for r in eager_rows if r["keep"] == "all" and r["case"] != "mixtral"]
    assert all(r["worse_than_no_checkpoint"] for r in keep_all)


def test_eager_budget_answer_fits_its_budget_when_measured():
    """An eager `--budget` answer, applied under eager SAC, holds no more than the budget on
    the allocator: budgets between whole-layer recompute and keeping everything."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    case = table.zoo_case("dense", 4, 32)
    low = table.measure_case(case, "none", None)["predicted_peak"]
    high = table.measure_case(case, "all", "all")["predicted_peak"]
    answers = set()
    for fraction in (0.3, 0.6):
        budget = int(low + fraction * (high - low))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rp.PlannerWarning)
            plan = rp.plan(case.graph, budget=budget, executor="eager")
        assert plan.memory.peak_bytes <= budget
        loss, params = case.step(plan)
        measured = measure.measure_step(loss, params, case.input_bytes).peak_bytes
        assert measured <= budget, f"budget {budget} B, measured {measured} B"
        answers.add(plan.config.layer_keep)
    assert len(answers) == 2, answers  # two budgets, two different answers


def test_eager_budget_offload_answer_fits_its_budget_when_measured():
    """An eager ``budget_offload`` answer that offloads, applied under eager SAC with its
    offload, holds no more than the budget on the allocator (the host copies live outside
    it), and the answer is no slower than the one without offload. On a profile with a fast,
    overlapped host link, budgets just below keeping everything."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    case = table.zoo_case("dense", 4, 32)
    fast_link = {"name": "fast-host-link", "host_bytes_per_s": 1e15, "asynchronous": True}
    low = table.measure_case(case, "none", None)["predicted_peak"]
    high = table.measure_case(case, "all", "all")["predicted_peak"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        for fraction in (0.95, 0.85, 0.75, 0.6):
            budget = int(low + fraction * (high - low))
            options = {"budget": budget, "executor": "eager", "hw": fast_link}
            plan = rp.plan(case.graph, budget_offload=True, **options)
            if plan.config.layer_offload:
                break
        else:
            pytest.fail("no budget between keeping nothing and everything is met by offload")
        plain = rp.plan(case.graph, **options)
    assert plan.memory.peak_bytes <= budget and plan.memory.offloaded_bytes > 0
    cost = plan.cost.replay_time_s + plan.cost.exposed_transfer_time_s
    assert cost <= plain.cost.replay_time_s
    loss, params = case.step(plan)
    measured = measure.measure_step(loss, params, case.input_bytes).peak_bytes
    assert measured <= budget, f"budget {budget} B, measured {measured} B"


def test_budget_offload_meets_a_budget_below_whole_layer_recompute_when_measured():
    """Twelve narrow layers, whose inputs whole-layer recompute keeps on the device: a budget
    of 80% of that peak is refused without offload and met with ``budget_offload`` by moving
    layer inputs (and kept units) to host memory. The step compiled from that plan holds
    what it predicts within 0.5% (measured +0.14%), under the budget, and copies to host
    memory exactly the bytes it predicts."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    case = table.zoo_case(
        "dense", 8, 64, num_layers=12, hidden=64, heads=4, head_dim=16, ffn=64, vocab=32
    )
    fast_link = {"name": "fast-host-link", "host_bytes_per_s": 1e15, "asynchronous": True}
    executor = {"executor": table.stage_mod.EXECUTOR, "hw": fast_link}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        floor = rp.plan(case.graph, **executor).memory.peak_bytes
        budget = int(floor * 0.8)
        with pytest.raises(rp.PlannerError, match="below the smallest peak"):
            rp.plan(case.graph, budget=budget, **executor)
    options = {"budget": budget, "budget_offload": True, "hw": fast_link}
    r = table.measure_compiled(case, "budget", None, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(case.graph, **options, executor=table.stage_mod.EXECUTOR)
    assert any(layer.layer_input for layer in plan.config.layer_offload)
    assert r["predicted_peak"] == plan.memory.peak_bytes <= budget
    assert r["measured_peak"] <= budget
    assert abs(gap(r["predicted_peak"], r["measured_peak"])) <= 0.005, r
    assert r["measured_offloaded"] == r["predicted_offloaded"] == plan.memory.offloaded_bytes


@pytest.mark.parametrize(
    "case, keep",
    [
        # The dense layer's recompute stops before its MLP under SAVE_MLP (backward reads
        # nothing after it), so the policy's cache of the down projection is never consumed:
        # it is freed as the recompute returns, not at the layer's last backward read (held
        # to the frame, the plan was 2.4% above the allocator).
        pytest.param("dense", "SAVE_MLP", id="kept-op-the-recompute-never-reaches"),
        # Eager `pow_backward` makes `self.pow(1)` and keeps it, and `self`, until the
        # product with the gradient exists: a ReLU² MLP's intermediate-size tensor (Arcee,
        # -8.2% without), a post-block norm's input at the peak (OLMo 2, -3.5% without).
        pytest.param("arcee", None, id="pow-backward-temporaries-relu2"),
        pytest.param("olmo2", None, id="pow-backward-temporaries-post-norm"),
    ],
)
def test_eager_plan_within_half_a_percent_where_activations_dominate(case, keep):
    """At batch 4 x 128, where the activations these mechanisms hold are large, the eager plan
    is within 0.5% of the allocator."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    built = table.zoo_case(case, 4, 128) if case == "dense" else table.hf_case(case, 4, 128)
    r = table.measure_case(built, keep or "none", [keep] if keep else None)
    relative = gap(r["predicted_peak"], r["measured_peak"])
    assert abs(relative) <= 0.005, f"{r}: {relative:+.2%}"


def test_eager_offload_of_the_dsa_indexer_frees_the_device_as_the_plan_predicts():
    """Keeping the DSA indexer and offloading what it keeps (batch 8 x 64: its scores are
    4.8 MB of the layer's cache): SAC's cache holds host copies outside the allocator, so the
    measured peak falls from 6.09 MB to 2.55 MB, within 0.5% of the eager plan's, and what
    stays on the device when forward ends is the plan's saved set less the offloaded bytes."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    case = table.zoo_case("glm_dsa_ep2", 8, 64)
    keep = ["SAVE_DSA_INDEXER"]
    kept = table.quiet_plan(case.graph, keep, executor="eager")
    offloaded = table.quiet_plan(case.graph, keep, executor="eager", offload=keep)
    memory = offloaded.memory
    assert memory.offloaded_bytes > 0
    assert memory.peak_bytes < kept.memory.peak_bytes
    from recompute_planner._zoo.goldens import traced_group

    with traced_group(case.world_size):
        loss, params = case.step(offloaded)
        step = measure.measure_step(loss, params, case.input_bytes)
    relative = gap(memory.peak_bytes, step.peak_bytes)
    assert abs(relative) <= 0.005, f"{memory.peak_bytes} B vs {step.peak_bytes} B: {relative:+.2%}"
    on_device = memory.saved_on_device_bytes
    assert on_device is not None
    assert abs(step.saved_bytes - on_device) <= 0.001 * on_device, (step.saved_bytes, on_device)


def test_eager_offload_of_layer_inputs_lowers_the_measured_peak_as_the_plan_predicts(
    monkeypatch,
):
    """HuggingFace Llama with 4 layers keeping attention (batch 4 x 32): offloading the layer
    inputs (`offload_kinds=["layer-input"]`, the forward inside `sac.offloading()`) lowers the
    measured peak (the earlier layers' inputs wait in host memory while a later layer is
    recomputed) to within 0.5% of the eager plan's, the bytes copied to host memory are the
    plan's, and what stays on the device when forward ends is the plan's saved set on the
    device."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(table, "HF_SHAPE", {**table.HF_SHAPE, "num_hidden_layers": 4})
    case = table.hf_case("llama", 4, 32)
    keep = ["SAVE_ATTN"]
    offloaded = table.measure_case(
        case, "offloaded", keep, offload_kinds=["layer-input"], offload_prefetch=0
    )
    on_device = table.measure_case(case, "on device", keep)
    assert offloaded["measured_peak"] < on_device["measured_peak"]
    assert offloaded["predicted_peak"] < on_device["predicted_peak"]
    relative = gap(offloaded["predicted_peak"], offloaded["measured_peak"])
    assert abs(relative) <= 0.005, f"{offloaded}: {relative:+.2%}"
    assert offloaded["measured_offloaded"] == offloaded["predicted_offloaded"] > 0
    assert offloaded["measured_saved"] < on_device["measured_saved"]
    saved = gap(offloaded["predicted_saved"], offloaded["measured_saved"])
    assert abs(saved) <= 0.001, offloaded


def test_eager_offload_copies_are_none_of_the_layers_ops():
    """The host copy of a kept output is made under no dispatch mode: HuggingFace Llama with
    eager attention keeps a `clone` a few ops after an offloaded output, past graph `view`s
    that the copy's own view would otherwise have matched, and the step runs and holds what
    the plan predicts."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    case = table.hf_case("llama-eager-attn", 2, 16)
    r = table.measure_offloaded(case, "SAVE_ATTN", "eager")
    relative = gap(r["predicted_peak"], r["measured_peak"])
    assert abs(relative) <= EAGER_TOLERANCE, f"{r}: {relative:+.2%}"
