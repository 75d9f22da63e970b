#!/usr/bin/env python3
"""How long ``import recompute_planner`` takes, alone and beyond ``import torch``.

Each run is two fresh Python processes: one imports the package alone (what the ``planner``
command and a script that only plans pay: torch is not loaded), the other imports torch, then
the package. The script prints the medians of ``--runs`` runs and which of torch's compiler
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

_ALONE = """
import json, sys, time
start = time.perf_counter()
import recompute_planner
done = time.perf_counter()
print(json.dumps({"package_s": done - start, "torch_loaded": "torch" in sys.modules}))
"""

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


def alone_run() -> tuple[float, bool]:
    """One fresh process importing the package alone: seconds, and whether torch got loaded."""
    done = subprocess.run(
        [sys.executable, "-c", _ALONE], capture_output=True, text=True, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["package_s"], report["torch_loaded"]


def main(argv: list[str] | None = None) -> tuple[float, float, list[str]]:
    """Prints and returns the medians (torch, the package beyond it) and the compiler modules
    any run loaded; prints the package's import alone too."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes (default 7)")
    args = parser.parse_args(argv)
    alone = [alone_run() for _ in range(args.runs)]
    alone_s = statistics.median(seconds for seconds, _ in alone)
    print(
        f"import recompute_planner alone: {alone_s:.2f} s (median of {args.runs} processes); "
        f"torch loaded: {'yes' if any(loaded for _, loaded in alone) else 'no'}"
    )
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
