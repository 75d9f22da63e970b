#!/usr/bin/env python3
"""Same-graph comparison: PyTorch's min-cut partitioner against the planner.

Traces one training step of a zoo model at a chosen depth through AOTAutograd and, where
AOTAutograd calls its partitioner (inside its tracing context: the step's fake tensor mode),
times every contender on that one joint FX graph and its IR:

- torch's ``min_cut_rematerialization_partition`` on the graph tagged with the ``--keep all``
  plan, as the torch.compile planning stage hands it over (``recompute`` / ``ac_graph_id``
  tags, markers removed), at torch's default ``activation_memory_budget`` (1.0);
- the same partitioner on the untagged graph with ``activation_memory_budget`` set (torch's
  budget solver: the saved bytes go that fraction of the way from the graph's inputs alone to
  what its default min cut saves);
- ``planner plan GRAPH.pb --keep all`` as one process, ``recompute_planner.plan`` in-process,
  and the whole compile stage (FX -> IR, plan, tags) in-process;
- ``planner plan --budget`` and ``recompute_planner.plan(budget=...)`` at the planner's analogue
  of torch's budget fraction: that fraction of the way from its whole-layer-recompute peak to
  its no-checkpoint peak.

Each contender runs ``--runs`` times; the table gives the median, min and max, and each
partitioner median divided by each planner median. What each timing includes:

- partitioner: the call alone, on a fresh copy of the tagged (or untagged) graph; tracing,
  CSE, tagging and the copy are outside it. The partitioner's CSE pass runs again inside it
  (and finds nothing left to merge);
- one process: ``planner plan GRAPH.pb ... > /dev/null`` from spawn to exit: start-up, reading
  and validating the ``.pb``, the plan (policy, partition, verifier, diagnostics, memory
  simulation of the plan and both baselines, cost), the text output. The most conservative
  figure, and the one a user reproduces with ``time planner plan``;
- in-process ``rp.plan``: the ``.pb`` bytes in memory are decoded and planned, the plan comes
  back as a handle (written to JSON and parsed into Python objects only when read, which
  this row does not);
- in-process ``rp.plan`` of the graph as built: the graph the exporter's native builder made
  from the joint FX graph, planned as the compile stage plans it, with nothing to decode;
- compile stage: ``PlanningStage.apply`` on a fresh copy: CSE, FX -> IR conversion (the
  exporter's native builder), ``rp.plan``, tagging every node, removing the markers (what the
  stage adds to a compile before torch's partitioner);
- compile stage with the plan partitioner: ``PlanningStage.partition_fn`` on a fresh copy of
  the graph as traced: FX -> IR, ``rp.plan``, the forward and backward graphs built from the
  plan. This is the whole partition step of a compile with the stage, against the
  partitioner row.

    source scripts/env.sh
    python scripts/compare_partitioner.py [--model dense] [--layers 12 60 ...] [--runs 5]
        [--planner target/release/planner] [--budget-fraction 0.5] [--lazy]

A full garbage collection runs before every timed call. ``--lazy`` runs everything with lazy
graph modules, as ``torch.compile`` does: the partitioners then leave the Python code of the
graphs they build to the graphs' first call.

The in-process figures depend on how the native extension was built: ``scripts/setup.sh``
builds it optimised unless ``PLANNER_NATIVE_PROFILE=dev``; the script says which.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import operator
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from functorch.compile import aot_module
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx._lazy_graph_module import _use_lazy_graph_module

import recompute_planner as rp
from recompute_planner import _native
from recompute_planner import compile as stage_mod
from recompute_planner._exporter import BuiltGraph, write_graph
from recompute_planner._zoo.catalog import ENTRIES, entry, make_inputs, model_decls
from recompute_planner._zoo.config import ZooConfig
from recompute_planner._zoo.goldens import traced_group
from recompute_planner._zoo.model import CausalLM
from recompute_planner.markers import MARKER_OP
from recompute_planner.proto import graph_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLANNER = REPO_ROOT / "target" / "release" / "planner"
DEFAULT_MODEL = "dense"
DEFAULT_LAYERS = [12, 60]
DEFAULT_RUNS = 5
DEFAULT_BUDGET_FRACTION = 0.5
KEEP = "all"


# --------------------------------------------------------------------------------------------
# The graph


@dataclass
class JointGraph:
    """The joint graph AOTAutograd hands its partitioner, and what it calls it with."""

    module: fx.GraphModule
    inputs: Any
    num_fwd_outputs: int
    partition_kwargs: dict[str, Any]

    def partition(self, module: fx.GraphModule) -> None:
        """torch's min-cut partitioner on ``module`` (this graph or a copy of it)."""
        min_cut_rematerialization_partition(
            module, self.inputs, num_fwd_outputs=self.num_fwd_outputs, **self.partition_kwargs
        )


class _Finished(Exception):
    """Raised from the partition hook with what ran there, to stop compiling."""

    def __init__(self, result: Any):
        super().__init__("measured at the partitioner")
        self.result = result


def at_partitioner(
    model: torch.nn.Module, inputs: tuple, body: Callable[[JointGraph], Any]
) -> Any:
    """Traces one training step ``model(*inputs)`` with AOTAutograd (functionalized, as
    torch.compile traces) and returns ``body(joint graph)``, called where AOTAutograd calls
    its partitioner: the partitioner needs the tracing context (its fake tensor mode) that is
    active there. Compiling stops after ``body``."""

    def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        raise _Finished(body(JointGraph(joint_module, joint_inputs, num_fwd_outputs, kwargs)))

    def never(_graph_module, _inputs):
        raise AssertionError("the partition hook stops compiling before any compiler runs")

    compiled = aot_module(model, fw_compiler=never, bw_compiler=never, partition_fn=partition)
    try:
        compiled(*inputs)
    except _Finished as finished:
        return finished.result
    raise RuntimeError("AOTAutograd finished without calling its partitioner")


def node_counts(module: fx.GraphModule) -> tuple[int, int]:
    """The graph's nodes (placeholders and output included) and its ops: ``call_function``
    nodes other than the ``getitem`` nodes reading a multi-output op, one IR node each."""
    ops = sum(1 for node in op_nodes(module))
    return len(module.graph.nodes), ops


def op_nodes(module: fx.GraphModule) -> Iterator[fx.Node]:
    """The graph's ``call_function`` nodes other than ``getitem``: the IR's nodes."""
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            yield node


# --------------------------------------------------------------------------------------------
# Timing


@dataclass(frozen=True)
class Timing:
    """Seconds of each run of one contender."""

    label: str
    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)


def time_runs(runs: int, prepare: Callable[[], Any], body: Callable[[Any], Any]) -> list[float]:
    """Times ``body(prepare())`` ``runs`` times; ``prepare`` (a fresh copy) is not timed. A full
    garbage collection runs before each timed call: on a heap of this size one costs most of a
    second, and it would land in whichever contender happened to trigger it."""
    seconds = []
    for _ in range(runs):
        arg = prepare()
        gc.collect()
        start = time.perf_counter()
        body(arg)
        seconds.append(time.perf_counter() - start)
    return seconds


def run_planner_cli(planner: Path, graph: Path, options: list[str]) -> None:
    """``planner plan GRAPH OPTIONS > /dev/null``; fails on a non-zero exit."""
    command = [str(planner), "plan", str(graph), *options]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` exited {done.returncode}: {done.stderr}")


def no_setup() -> None:
    return None


# --------------------------------------------------------------------------------------------
# One depth


@dataclass
class Subject:
    """One traced graph in every form the contenders take."""

    joint: JointGraph  # CSE applied, markers in: what the min-cut planning stage converts
    traced: fx.GraphModule  # the joint graph as traced: what the plan partitioner converts
    built: BuiltGraph  # the IR as the stage builds it, for rp.plan with nothing to decode
    ir: graph_pb2.Graph
    graph_path: Path  # the IR as a `.pb`, for the planner process
    graph_bytes: bytes  # the same bytes, for rp.plan
    tagged: fx.GraphModule  # as the planning stage leaves it for the partitioner
    plain: fx.GraphModule  # the same graph untagged
    stage: stage_mod.PlanningStage  # the --keep all planning stage
    keep_plan: rp.Plan  # the plan the tags come from


@dataclass
class Comparison:
    """Everything measured at one depth."""

    model: str
    layers: int
    ir: graph_pb2.Graph  # the graph the planner plans
    fx_nodes: int  # nodes of the joint graph the partitioner cuts
    fx_ops: int  # its ops (no getitem): the IR nodes less the markers
    trace_s: float
    keep_plan: rp.Plan
    budget_fraction: float
    budget_bytes: int
    partitioner_tags: Timing
    partitioner_budget: Timing
    planner_keep: list[Timing]
    planner_budget: list[Timing]
    compile_stage: Timing
    plan_partition: Timing

    @property
    def markers(self) -> int:
        return sum(1 for node in self.ir.nodes if node.op == MARKER_OP)


def depth_config(model: str, layers: int) -> ZooConfig:
    """The zoo model ``model`` with ``layers`` decoder layers."""
    return dataclasses.replace(entry(model).config, num_layers=layers)


def planner_budget(plan: rp.Plan, fraction: float) -> int:
    """The planner's analogue of torch's budget fraction: that fraction of the way from the
    whole-layer-recompute peak to the no-checkpoint peak (activations)."""
    low = plan.memory.full_recompute_peak_bytes
    high = plan.memory.no_checkpoint_peak_bytes
    return int(low + fraction * (high - low))


def prepare(joint: JointGraph, models: list, name: str, graph_path: Path) -> Subject:
    """Applies the stage's CSE to the joint graph, writes its IR to ``graph_path`` and tags a
    copy with the ``--keep all`` plan, as the min-cut planning stage does; keeps the graph as
    traced for the plan partitioner."""
    traced = copy.deepcopy(joint.module)
    stage_mod.eliminate_common_subexpressions(joint.module)
    built = stage_mod.build_joint_graph(
        copy.deepcopy(joint.module), models, name=name, num_fwd_outputs=joint.num_fwd_outputs
    )
    ir = built.graph
    write_graph(ir, graph_path)
    tagged = copy.deepcopy(joint.module)
    stage = stage_mod.PlanningStage(models, KEEP, name=name, partitioner="min-cut")
    keep_plan = stage.apply(tagged, joint.num_fwd_outputs)
    plain = copy.deepcopy(joint.module)
    stage_mod.remove_markers(plain.graph)
    plain.recompile()
    return Subject(
        joint=joint,
        traced=traced,
        built=built,
        ir=ir,
        graph_path=graph_path,
        graph_bytes=graph_path.read_bytes(),
        tagged=tagged,
        plain=plain,
        stage=stage,
        keep_plan=keep_plan,
    )


def partitioner_timing(subject: Subject, runs: int, tagged: bool, fraction: float) -> Timing:
    """The min-cut partitioner on fresh copies of the tagged graph (torch's default budget),
    or of the untagged graph with ``activation_memory_budget=fraction``."""
    if tagged:
        label, graph, budget = "torch min-cut partitioner, the plan's tags", subject.tagged, 1.0
    else:
        label = f"torch min-cut partitioner, activation_memory_budget={fraction}"
        graph, budget = subject.plain, fraction
    with functorch_config.patch(activation_memory_budget=budget):
        seconds = time_runs(runs, lambda: copy.deepcopy(graph), subject.joint.partition)
    return Timing(label, seconds)


def planner_timings(
    subject: Subject, runs: int, planner: Path, options: list[str], **plan_kwargs: Any
) -> list[Timing]:
    """``planner plan GRAPH OPTIONS`` as one process, then ``rp.plan(**plan_kwargs)`` of the
    graph's bytes and of the graph as built."""
    in_process = ", ".join(f"{k}={v!r}" for k, v in plan_kwargs.items())
    return [
        Timing(
            f"planner plan {' '.join(options)}, one process",
            time_runs(runs, no_setup, lambda _: run_planner_cli(
                planner, subject.graph_path, options)),
        ),
        Timing(
            f"rp.plan({in_process}), in-process",
            time_runs(runs, no_setup, lambda _: rp.plan(
                subject.graph_bytes, check=False, **plan_kwargs)),
        ),
        Timing(
            f"rp.plan({in_process}) of the graph as built, in-process",
            time_runs(runs, no_setup, lambda _: rp.plan(
                subject.built.plannable, check=False, **plan_kwargs)),
        ),
    ]


def compile_stage_timing(subject: Subject, runs: int) -> Timing:
    """``PlanningStage.apply`` (``--keep all``) on fresh copies of the traced graph."""
    return Timing(
        f"compile stage (CSE, FX -> IR, rp.plan --keep {KEEP}, tags), in-process",
        time_runs(
            runs,
            lambda: copy.deepcopy(subject.joint.module),
            lambda module: subject.stage.apply(module, subject.joint.num_fwd_outputs),
        ),
    )


def plan_partition_timing(subject: Subject, models: list, name: str, runs: int) -> Timing:
    """The whole compile phase with the plan partitioner (``--keep all``) on fresh copies of
    the traced graph: FX -> IR, ``rp.plan``, the forward and backward graphs built from the
    plan. Against the partitioner row, whose call alone cuts the graph the stage tagged."""
    stage = stage_mod.PlanningStage(models, KEEP, name=name)
    return Timing(
        f"compile stage + partition from the plan (FX -> IR, rp.plan --keep {KEEP}), in-process",
        time_runs(
            runs,
            lambda: copy.deepcopy(subject.traced),
            lambda module: stage.partition_fn(
                module, subject.joint.inputs, num_fwd_outputs=subject.joint.num_fwd_outputs
            ),
        ),
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silences the plan's diagnostics (this script times plans, it does not judge them) and
    torch's deprecation notice raised when a GraphModule's pytree spec is copied."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
        yield


def compare(
    model: str,
    layers: int,
    *,
    runs: int,
    planner: Path,
    budget_fraction: float,
    workdir: Path,
) -> Comparison:
    """Traces ``model`` at ``layers`` layers once and times every contender on that graph."""
    cfg = depth_config(model, layers)
    models = model_decls(cfg)
    start = time.perf_counter()

    def measure(joint: JointGraph) -> Comparison:
        trace_s = time.perf_counter() - start
        subject = prepare(joint, models, model, workdir / f"{model}_{layers}.pb")
        budget = planner_budget(subject.keep_plan, budget_fraction)
        fx_nodes, fx_ops = node_counts(subject.plain)
        return Comparison(
            model=model,
            layers=layers,
            ir=subject.ir,
            fx_nodes=fx_nodes,
            fx_ops=fx_ops,
            trace_s=trace_s,
            keep_plan=subject.keep_plan,
            budget_fraction=budget_fraction,
            budget_bytes=budget,
            partitioner_tags=partitioner_timing(subject, runs, True, budget_fraction),
            partitioner_budget=partitioner_timing(subject, runs, False, budget_fraction),
            planner_keep=planner_timings(subject, runs, planner, ["--keep", KEEP], keep=KEEP),
            planner_budget=planner_timings(
                subject, runs, planner, ["--budget", str(budget), "--quiet"], budget=budget
            ),
            compile_stage=compile_stage_timing(subject, runs),
            plan_partition=plan_partition_timing(subject, models, model, runs),
        )

    with traced_group(cfg.world_size), quiet():
        return at_partitioner(CausalLM(cfg), make_inputs(cfg), measure)


# --------------------------------------------------------------------------------------------
# Report


def format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def timing_row(timing: Timing, against: Timing | None) -> str:
    ratio = f"{against.median / timing.median:8.1f}x" if against else " " * 9
    spread = f"({format_ms(min(timing.runs))} .. {format_ms(max(timing.runs))})"
    return f"  {timing.label:<66} {format_ms(timing.median):>12} {spread:<28} {ratio}"


def report(result: Comparison) -> str:
    """The table of one depth: medians, spreads, and the partitioner's median over each
    planner median."""
    r = result
    replayed = sum(len(replay.nodes) for replay in r.keep_plan.replay)
    lines = [
        f"{r.model}, {r.layers} layers: joint FX graph {r.fx_nodes:,} nodes, {r.fx_ops:,} ops "
        f"(after CSE, markers removed: what the partitioner cuts); IR {len(r.ir.nodes):,} "
        f"nodes ({r.markers} markers); traced in {r.trace_s:.1f} s (not timed below)",
        f"  the --keep {KEEP} plan tags {replayed:,} ops to recompute in "
        f"{len(r.keep_plan.layers())} layers",
        f"  {'runs: ' + str(len(r.partitioner_tags.runs)):<66} "
        f"{'median':>12} {'(min .. max)':<28} {'partitioner / this':>9}",
        timing_row(r.partitioner_tags, None),
    ]
    lines += [timing_row(t, r.partitioner_tags) for t in r.planner_keep]
    lines.append(timing_row(r.compile_stage, r.partitioner_tags))
    lines.append(timing_row(r.plan_partition, r.partitioner_tags))
    lines.append(timing_row(r.partitioner_budget, None))
    lines += [timing_row(t, r.partitioner_budget) for t in r.planner_budget]
    lines.append(
        f"  planner budget {r.budget_bytes:,} B: {r.budget_fraction} of the way from the plan's "
        "whole-layer-recompute peak to its no-checkpoint peak"
    )
    return "\n".join(lines)


def native_build_line() -> str:
    """How the in-process planner was built: unoptimised, it plans several times slower."""
    if _native.OPTIMIZED:
        return "native extension: optimised build"
    return (
        "native extension: unoptimised build (the rp.plan and compile stage rows are slower "
        "than with the optimised build `bash scripts/setup.sh` makes by default)"
    )


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time torch's min-cut partitioner and the planner on the same joint graph."
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, choices=[e.name for e in ENTRIES],
        help=f"zoo model (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--layers", type=int, nargs="+", default=DEFAULT_LAYERS,
        help="decoder layers, one comparison per value (default: 12 60)",
    )
    parser.add_argument(
        "--runs", type=int, default=DEFAULT_RUNS,
        help=f"runs per contender (default: {DEFAULT_RUNS})",
    )
    parser.add_argument(
        "--planner", type=Path, default=Path(os.environ.get("PLANNER_BIN", DEFAULT_PLANNER)),
        help="the planner binary (default: $PLANNER_BIN, else target/release/planner)",
    )
    parser.add_argument(
        "--budget-fraction", type=float, default=DEFAULT_BUDGET_FRACTION,
        help="torch's activation_memory_budget, and the planner's analogue (default: 0.5)",
    )
    parser.add_argument(
        "--lazy", action="store_true",
        help="lazy graph modules, as torch.compile makes them: every contender leaves the "
        "Python code of the graphs it builds to their first call",
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or min(args.layers) < 1:
        parser.error("--runs and --layers must be positive")
    if not 0.0 < args.budget_fraction < 1.0:
        parser.error("--budget-fraction must be strictly between 0 and 1")
    if not args.planner.is_file():
        parser.error(
            f"no planner binary at {args.planner}: `cargo build --release -p planner-cli`"
        )
    return args


def main(argv: list[str] | None = None) -> list[Comparison]:
    args = parse_args(argv)
    print(f"torch {torch.__version__}; {load_line()} at the start", flush=True)
    print(native_build_line(), flush=True)
    start = time.perf_counter()
    results = []
    lazy = _use_lazy_graph_module(True) if args.lazy else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="compare-partitioner-") as workdir, lazy:
        if args.lazy:
            print("lazy graph modules (as under torch.compile): code generated on first use")
        for layers in args.layers:
            result = compare(
                args.model, layers, runs=args.runs, planner=args.planner,
                budget_fraction=args.budget_fraction, workdir=Path(workdir),
            )
            print(report(result), flush=True)
            results.append(result)
    print(f"{load_line()} at the end; {time.perf_counter() - start:.0f} s in all")
    return results


if __name__ == "__main__":
    main()
