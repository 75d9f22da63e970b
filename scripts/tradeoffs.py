"""Two trade-offs production MoE runs weigh, in three pairs of configurations, predicted and
measured: what keeping a unit (or the collectives) costs in peak memory and saves in step
time.

- `moe_ep2` (expert-parallel MoE, torchtitan-like): `--collectives recompute` against `save`
  (replaying the dispatch all-to-all and the device-to-host copy of its split sizes, or
  keeping their outputs);
- `glm_dsa_ep2` (DSA indexer, MoE, MTP): `--keep none` against `--keep SAVE_DSA_INDEXER`, at
  the golden's 2 x 16 tokens (the indexer's replay is below this machine's noise there) and at
  1,024 tokens (`DSA_WIDE`: the model traced here, its weights filled from a seed), where the
  indexer's replay is about a seventh of the step.

For each pair: the planner's Δpeak, Δstep and Δreplay time with a calibrated profile, beside
the step and replay times `planner run` measures on gloo ranks launched by torchrun (rank 0's
median of `--repeat` steps; every rank is a process of this machine).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recompute_planner._zoo.catalog import entry
from recompute_planner._zoo.config import ZooConfig
from recompute_planner._zoo.goldens import trace_for_timing

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN = REPO_ROOT / "tests" / "golden"

# The DSA golden's model at 1,024 tokens (512 a rank): its indexer scores 4 heads over the
# whole sequence and selects 32 keys a query, so replaying it (two bmms and a top-k of 1,024,
# in each of three layers) is about a seventh of the step, and the sparse attention over the
# 32 selected keys stays small.
DSA_WIDE = dict(
    hidden=64, heads=2, head_dim=32, index_heads=4, index_topk=32, seq=512, batch=1, vocab=512,
    ffn=128, moe_ffn=64, shared_ffn=64,
)


@dataclass(frozen=True)
class Pair:
    """Two configurations of one model. `resized`: the golden's model at other dimensions,
    traced here (`trace_for_timing`) and run with weights from a seed; else the golden."""

    golden: str
    label: str
    first: list[str]
    second: list[str]
    resized: dict[str, Any] | None = None

    @property
    def config(self) -> ZooConfig:
        return entry(self.golden).config.resized(**(self.resized or {}))

    def graph(self, scratch: Path) -> Path:
        if self.resized is None:
            return GOLDEN / f"{self.golden}.pb"
        return trace_for_timing(f"{self.golden}_wide", self.config, scratch / "traced")

    @property
    def run_options(self) -> list[str]:
        return [] if self.resized is None else ["--seed", "0"]

    @property
    def name(self) -> str:
        if self.resized is None:
            return self.golden
        return f"{self.golden} at {self.config.batch * self.config.global_seq:,} tokens"


PAIRS = [
    Pair("moe_ep2", "collectives recompute -> save", ["--collectives", "recompute"],
         ["--collectives", "save"]),
    Pair("glm_dsa_ep2", "keep none -> SAVE_DSA_INDEXER", ["--keep", "none"],
         ["--keep", "SAVE_DSA_INDEXER"]),
    Pair("glm_dsa_ep2", "keep none -> SAVE_DSA_INDEXER", ["--keep", "none"],
         ["--keep", "SAVE_DSA_INDEXER"], resized=DSA_WIDE),
]


def planner_bin() -> str:
    return os.environ.get("PLANNER_BIN") or str(REPO_ROOT / "target" / "debug" / "planner")


def predicted(graph: Path, options: list[str], hw: str) -> tuple[int, float, float]:
    """(peak bytes, step seconds, replay seconds) of the plan."""
    done = subprocess.run(
        [planner_bin(), "plan", str(graph), *options, "--hw", hw, "--format", "json"],
        capture_output=True, text=True, check=True,
    )
    plan = json.loads(done.stdout)
    cost = plan["cost"]
    return plan["memory"]["peak_bytes"], cost["step_time_s"], cost["replay_time_s"]


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


def measured(graph: Path, options: list[str], hw: str, repeat: int) -> tuple[float, float]:
    """Rank 0's median step and replay seconds under torchrun (gloo), one process per
    rank."""
    stdout = torchrun(["run", str(graph), *options, "--hw", hw, "--repeat", str(repeat),
                       "--format", "json"])
    run = json.loads(stdout)["ranks"][0]["runs"][0]
    times = run["measured"]
    return float(times["step_time_s"]), float(times["replay_time_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hw", help="a calibrated profile (default: calibrate now, under "
                        "torchrun, so the collectives are gloo's)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=7,
                        help="launches of each configuration, alternating within a pair")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        hw = args.hw
        if hw is None:
            hw = str(Path(scratch) / "profile.json")
            torchrun(["calibrate", "-o", hw])
        table(hw, args.repeat, args.rounds, Path(scratch))
    return 0


def table(hw: str, repeat: int, rounds: int, scratch: Path) -> None:
    """The trade-offs' table, a row per pair, printed as it is measured. Each round launches
    the pair's two configurations in turn, so a drift of the machine's speed reaches both;
    a measured difference is the median of the rounds' differences (the range over rounds
    beside it), a measured step the median of the launches' medians."""
    print("| model | change | predicted Δpeak | predicted Δstep | measured Δstep (range) "
          "| Δreplay (predicted, measured) | steps (predicted, measured) |")
    print("|---|---|---:|---:|---:|---|---|")
    for pair in PAIRS:
        graph = pair.graph(scratch)
        (peak_a, step_a, replay_a), (peak_b, step_b, replay_b) = (
            predicted(graph, options, hw) for options in (pair.first, pair.second)
        )
        rows = [
            [measured(graph, [*options, *pair.run_options], hw, repeat)
             for options in (pair.first, pair.second)]
            for _ in range(rounds)
        ]
        steps = [b[0] - a[0] for a, b in rows]
        replays = [b[1] - a[1] for a, b in rows]
        meas_a, meas_b = (statistics.median(row[i][0] for row in rows) for i in (0, 1))
        ms = 1e3
        print(
            f"| {pair.name} | {pair.label} | {peak_b - peak_a:+,} B "
            f"| {ms * (step_b - step_a):+.2f} ms | {ms * statistics.median(steps):+.2f} ms "
            f"({ms * min(steps):+.2f} .. {ms * max(steps):+.2f}) "
            f"| {ms * (replay_b - replay_a):+.2f}, {ms * statistics.median(replays):+.2f} ms "
            f"| {ms * step_a:.2f} -> {ms * step_b:.2f}, "
            f"{ms * meas_a:.2f} -> {ms * meas_b:.2f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
