#!/usr/bin/env python3
"""Real configurations at full width, exported with fake tensors and planned.

For each configuration of ``recompute_planner._zoo.real_size`` (stock HuggingFace models built
on ``meta``: nothing allocated, nothing downloaded) this exports one training step for a GPU
(``rp.export(..., hw=HW)``: fake CUDA tensors, the profile's device facts and fused attention)
and plans it, printing one row per model:

- export: wall seconds of ``rp.export`` (trace, FX -> IR), one run;
- nodes: IR nodes of the joint graph;
- plan: wall seconds of ``planner plan GRAPH.pb --hw HW --keep none`` (one process: load,
  validate, plan, the text output), median of ``--runs`` runs, with the release binary given
  by ``--planner`` (``cargo build --release -p planner-cli``);
- the plan's totals: no-checkpoint and whole-layer activation peaks, parameters.

DeepSeek-V3 gets its multi-token prediction module (``real_size.with_mtp``). Usage:

    python scripts/bench_real_size.py --models llama-3-8b,deepseek-v3 --layers full \\
        --seq 4096 --planner target/release/planner --out /tmp/real_size

``--layers N`` exports N decoder layers of each model instead of all of them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import recompute_planner as rp
from recompute_planner._exporter import write_graph
from recompute_planner._zoo import real_size

GIB = 2**30


def export_step(name: str, layers: int | None, seq: int, hw: str):
    """The exported step of `name` and the seconds `rp.export` took."""
    model = real_size.build(name, layers=layers)
    step = real_size.with_mtp(model) if name == "deepseek-v3" else model
    started = time.perf_counter()
    result = rp.export(
        step, real_size.inputs(seq), models=real_size.declared_models(step), hw=hw
    )
    return result.graph, time.perf_counter() - started


def plan_seconds(planner: str, graph_path: Path, hw: str, runs: int) -> float:
    """Median wall seconds of one `planner plan` process."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(
            [planner, "plan", str(graph_path), "--hw", hw, "--keep", "none"],
            check=True, stdout=subprocess.DEVNULL,
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(real_size.CONFIGS))
    parser.add_argument("--layers", default="full", help="a number, or `full`")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hw", default="h100")
    parser.add_argument("--planner", default="target/release/planner")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/real_size"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    layers = None if args.layers == "full" else int(args.layers)
    print(
        f"{'model':<20} {'layers':>6} {'export s':>9} {'nodes':>8} {'plan s':>7} "
        f"{'no-ckpt GiB':>11} {'whole-layer GiB':>15} {'params GiB':>10}",
        flush=True,
    )
    for name in args.models.split(","):
        graph, export_s = export_step(name, layers, args.seq, args.hw)
        path = args.out / f"{name}.pb"
        write_graph(graph, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rp.PlannerWarning)
            memory = rp.plan(path, hw=args.hw).memory
        count = real_size.CONFIGS[name].num_layers if layers is None else layers
        print(
            f"{name:<20} {count:>6} {export_s:>9.1f} {len(graph.nodes):>8} "
            f"{plan_seconds(args.planner, path, args.hw, args.runs):>7.2f} "
            f"{memory.no_checkpoint_peak_bytes / GIB:>11.1f} "
            f"{memory.full_recompute_peak_bytes / GIB:>15.1f} "
            f"{memory.parameter_bytes / GIB:>10.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
