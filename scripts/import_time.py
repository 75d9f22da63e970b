#!/usr/bin/env python3
"""How long ``import recompute_planner`` takes beyond ``import torch``.

Each run is a fresh Python process that imports torch, then the package, and reports both
durations; the script prints the medians of ``--runs`` processes and which of torch's compiler
modules the package import loaded (none: Dynamo, AOTAutograd's front end and inductor load on
first use, by an export, the compile stage or an op interval).

    source scripts/env.sh
    python scripts/import_time.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass

# torch's compiler modules: seconds to import, needed only to export or compile.
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "functorch.compile")

_CHILD = f"""
import json, sys, time
start = time.perf_counter()
import torch
torch_done = time.perf_counter()
import recompute_planner
done = time.perf_counter()
loaded = sorted(m for m in sys.modules if m.startswith({COMPILER_MODULES!r}))
print(json.dumps({{"torch_s": torch_done - start, "package_s": done - torch_done,
                  "compiler_modules": loaded}}))
"""


@dataclass(frozen=True)
class Run:
    """One fresh process: seconds to import torch, then the package; the compiler modules the
    package import loaded."""

    torch_s: float
    package_s: float
    compiler_modules: list[str]


def one_run() -> Run:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True
    )
    return Run(**json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> tuple[float, float, list[str]]:
    """Prints and returns the medians (torch, the package beyond it) and the compiler modules
    any run loaded."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes (default 7)")
    args = parser.parse_args(argv)
    runs = [one_run() for _ in range(args.runs)]
    torch_s = statistics.median(run.torch_s for run in runs)
    package_s = statistics.median(run.package_s for run in runs)
    loaded = sorted({module for run in runs for module in run.compiler_modules})
    print(
        f"import torch: {torch_s:.2f} s; import recompute_planner beyond it: {package_s:.2f} s "
        f"(medians of {args.runs} processes); compiler modules loaded: {loaded or 'none'}"
    )
    return torch_s, package_s, loaded


if __name__ == "__main__":
    main()
