#!/usr/bin/env python3
"""Regenerates the golden graphs of the model zoo (`tests/golden/`).

    python python/export_goldens.py [--out tests/golden] [NAME ...]

writes, for every zoo golden (or only the NAMEs given), rank 0's exported graph `NAME.pb` and
`NAME.safetensors` with its weights, inputs, tangents and PyTorch's reference loss and
gradients. Expert-parallel models run their reference step on real gloo ranks (one process per
rank), so regenerating everything takes about a minute on two cores. The output is
deterministic: running it twice gives identical bytes. Run from the repository root with the
project venv (`source scripts/env.sh`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recompute_planner._zoo.goldens import GOLDENS, export_goldens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "tests" / "golden",
        help="output folder (default: tests/golden of this repository)",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"goldens to export (default: all): {', '.join(g.name for g in GOLDENS)}",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    known = {g.name for g in GOLDENS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"error: unknown golden(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    names = args.names or [g.name for g in GOLDENS]
    export_goldens(names, args.out)
    summaries = {g.name: g.summary for g in GOLDENS}
    for name in names:
        print(f"wrote {args.out / name}.{{pb,safetensors}}: {summaries[name]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
