"""Two trade-offs production MoE runs weigh, predicted and measured: what keeping a unit (or
the collectives) costs in peak memory and saves in step time.

- `moe_ep2` (expert-parallel MoE, torchtitan-like): `--collectives recompute` against `save`
  (replaying the dispatch all-to-all and the device-to-host copy of its split sizes, or
  keeping their outputs);
- `glm_dsa_ep2` (DSA indexer, MoE, MTP): `--keep none` against `--keep SAVE_DSA_INDEXER`.

For each pair: the planner's Δpeak and Δstep time with a calibrated profile, beside the step
time `planner run` measures on gloo ranks launched by torchrun (rank 0's median of `--repeat`
steps; every rank is a process of this machine).

    python scripts/tradeoffs.py --hw PROFILE.json      # a profile from `planner calibrate`
    python scripts/tradeoffs.py                         # calibrates first, under torchrun

`planner` is `$PLANNER_BIN`, else `target/debug/planner` (built with `--features run`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN = REPO_ROOT / "tests" / "golden"

# (golden, label, planner options of the first configuration, of the second)
PAIRS = [
    ("moe_ep2", "collectives recompute -> save", ["--collectives", "recompute"],
     ["--collectives", "save"]),
    ("glm_dsa_ep2", "keep none -> SAVE_DSA_INDEXER", ["--keep", "none"],
     ["--keep", "SAVE_DSA_INDEXER"]),
]


def planner_bin() -> str:
    return os.environ.get("PLANNER_BIN") or str(REPO_ROOT / "target" / "debug" / "planner")


def predicted(graph: Path, options: list[str], hw: str) -> tuple[int, float]:
    """(peak bytes, step seconds) of the plan."""
    done = subprocess.run(
        [planner_bin(), "plan", str(graph), *options, "--hw", hw, "--format", "json"],
        capture_output=True, text=True, check=True,
    )
    plan = json.loads(done.stdout)
    return plan["memory"]["peak_bytes"], plan["cost"]["step_time_s"]


def torchrun(arguments: list[str]) -> str:
    """``planner ARGUMENTS`` on two gloo ranks launched by torchrun, one process each: rank 0's
    stdout."""
    launcher = shutil.which("torchrun")
    if launcher is None:
        raise SystemExit("torchrun is not on PATH: source scripts/env.sh first")
    with tempfile.TemporaryDirectory() as logs:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        subprocess.run(
            [launcher, "--standalone", "--no-python", "--nproc-per-node", "2", "--log-dir",
             logs, "--redirects", "3", planner_bin(), *arguments],
            capture_output=True, text=True, check=True, env=env,
        )
        return next(Path(logs).rglob("0/stdout.log")).read_text()


def measured(graph: Path, options: list[str], hw: str, repeat: int) -> float:
    """Rank 0's median step seconds under torchrun (gloo), one process per rank."""
    stdout = torchrun(["run", str(graph), *options, "--hw", hw, "--repeat", str(repeat),
                       "--format", "json"])
    run = json.loads(stdout)["ranks"][0]["runs"][0]
    return float(run["measured"]["step_time_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hw", help="a calibrated profile (default: calibrate now, under "
                        "torchrun, so the collectives are gloo's)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3,
                        help="launches of each configuration, alternating within a pair")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        hw = args.hw
        if hw is None:
            hw = str(Path(scratch) / "profile.json")
            torchrun(["calibrate", "-o", hw])
        table(hw, args.repeat, args.rounds)
    return 0


def table(hw: str, repeat: int, rounds: int) -> None:
    """The trade-offs' table, a row per pair, printed as it is measured. The two
    configurations of a pair are launched in turn, `rounds` times each, so a drift of the
    machine's speed reaches both: the measured step is the median of the launches' medians."""
    print("| golden | change | predicted Δpeak | predicted Δstep | measured Δstep | steps "
          "(predicted, measured) |")
    print("|---|---|---:|---:|---:|---|")
    for name, label, first, second in PAIRS:
        graph = GOLDEN / f"{name}.pb"
        (peak_a, step_a), (peak_b, step_b) = (predicted(graph, o, hw) for o in (first, second))
        launches: tuple[list[float], list[float]] = ([], [])
        for _ in range(rounds):
            for options, times in zip((first, second), launches, strict=True):
                times.append(measured(graph, options, hw, repeat))
        meas_a, meas_b = (statistics.median(times) for times in launches)
        print(
            f"| {name} | {label} | {peak_b - peak_a:+,} B | {1e3 * (step_b - step_a):+.3f} ms "
            f"| {1e3 * (meas_b - meas_a):+.3f} ms | {1e3 * step_a:.2f} -> {1e3 * step_b:.2f}, "
            f"{1e3 * meas_a:.2f} -> {1e3 * meas_b:.2f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
