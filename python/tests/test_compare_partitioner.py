"""`scripts/compare_partitioner.py` at a tiny depth: the partitioner and the planner get the
same graph, the partitioner gets it tagged as the plan of that graph says (or untagged under
the requested budget), and the table prints what was measured. Timings are not asserted."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass

import pytest
from torch._functorch import config as functorch_config
from torch.utils.checkpoint import CheckpointPolicy

import recompute_planner as rp
from export_support import script_module
from recompute_planner import _native
from recompute_planner import compile as stage_mod
from recompute_planner.markers import MARKER_OP

RUNS = 2
LAYERS = 1
FRACTION = 0.25


@pytest.fixture(scope="module")
def script():
    with script_module("compare_partitioner") as module:
        yield module


@dataclass(frozen=True)
class PartitionCall:
    """What one partitioner call received."""

    budget: float
    tags: dict[str, tuple]  # op name -> (recompute tag, ac_graph_id), None where untagged


@dataclass(frozen=True)
class Run:
    result: object  # the script's Comparison
    stdout: str
    calls: list[PartitionCall]


@pytest.fixture(scope="module")
def run(script, planner_bin):
    """The script's command line at one layer, with a spy recording every partitioner call."""
    calls = []
    real = script.min_cut_rematerialization_partition

    def spy(module, inputs, **kwargs):
        tags = {
            node.name: (node.meta.get("recompute"), node.meta.get("ac_graph_id"))
            for node in script.op_nodes(module)
        }
        calls.append(PartitionCall(functorch_config.activation_memory_budget, tags))
        return real(module, inputs, **kwargs)

    stdout = io.StringIO()
    argv = [
        "--layers", str(LAYERS), "--runs", str(RUNS), "--planner", planner_bin,
        "--budget-fraction", str(FRACTION),
    ]
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(script, "min_cut_rematerialization_partition", spy)
        (result,) = script.main(argv)
    return Run(result, stdout.getvalue(), calls)


def op_names(graph) -> set[str]:
    """The IR's nodes other than markers: the ops the partitioner's graph holds."""
    return {node.name for node in graph.nodes if node.op != MARKER_OP}


def test_partitioner_and_planner_get_the_same_graph_at_the_chosen_depth(run):
    graph = run.result.ir
    assert {n.layer for n in graph.nodes if n.HasField("layer")} == set(range(LAYERS))
    assert run.result.markers > 0
    assert len(run.calls) == 2 * RUNS
    for call in run.calls:
        assert set(call.tags) == op_names(graph)
    assert run.result.fx_ops == len(graph.nodes) - run.result.markers


def test_the_partitioner_cuts_the_graph_tagged_with_the_plan_of_that_graph(run):
    tagged = [call for call in run.calls if call.budget == 1.0]
    assert len(tagged) == RUNS
    expected = {
        name: (tag.policy, tag.ac_graph_id)
        for name, tag in stage_mod.plan_tags(rp.plan(run.result.ir, "all", check=False)).items()
        if name in op_names(run.result.ir)
    }
    recomputed = [n for n, (policy, _) in expected.items()
                  if policy == CheckpointPolicy.PREFER_RECOMPUTE]
    assert recomputed, "the --keep all plan of a dense layer recomputes the ops between units"
    for call in tagged:
        assert {name: call.tags[name] for name in expected} == expected


def test_the_untagged_graph_is_cut_under_the_requested_budget(run):
    under_budget = [call for call in run.calls if call.budget == FRACTION]
    assert len(under_budget) == RUNS
    for call in under_budget:
        assert set(call.tags.values()) == {(None, None)}


def test_the_planner_budget_is_the_fraction_of_its_baselines(run):
    memory = rp.plan(run.result.ir, "all", check=False).memory
    low, high = memory.full_recompute_peak_bytes, memory.no_checkpoint_peak_bytes
    assert low < run.result.budget_bytes < high
    assert run.result.budget_bytes == int(low + FRACTION * (high - low))
    assert f"planner plan --budget {run.result.budget_bytes} " in run.stdout


def test_the_table_gives_node_counts_and_each_ratio_of_medians(run):
    result, out = run.result, run.stdout
    assert f"joint FX graph {result.fx_nodes:,} nodes, {result.fx_ops:,} ops" in out
    assert f"IR {len(result.ir.nodes):,} nodes ({result.markers} markers)" in out
    contenders = [
        (
            result.partitioner_tags,
            result.planner_keep + [result.compile_stage, result.plan_partition],
        ),
        (result.partitioner_budget, result.planner_budget),
    ]
    for partitioner, planners in contenders:
        assert len(partitioner.runs) == RUNS
        for planner in planners:
            assert len(planner.runs) == RUNS
            line = next(line for line in out.splitlines() if planner.label in line)
            printed = float(re.search(r"([\d.]+)x$", line).group(1))
            assert printed == pytest.approx(partitioner.median / planner.median, abs=0.05)
    assert out.count("load average") == 2
    build = "optimised build" if _native.OPTIMIZED else "unoptimised build"
    assert f"native extension: {build}" in out


def test_a_missing_planner_binary_is_a_usage_error(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--planner", str(tmp_path / "planner")])
    assert exit_info.value.code == 2
    assert "cargo build --release -p planner-cli" in capsys.readouterr().err


def test_an_unknown_model_is_a_usage_error_naming_the_zoo(script, planner_bin, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--model", "gpt5", "--planner", planner_bin])
    assert exit_info.value.code == 2
    assert "moe_ep2" in capsys.readouterr().err
