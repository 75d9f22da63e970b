"""The package's `planner` command (the console script `recompute_planner._cli:main`, installed
into the project venv by scripts/setup.sh): the same command line as the Rust binary, run by the
native extension, started without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from export_support import REPO_ROOT, planner_bin

GOLDEN = REPO_ROOT / "tests" / "golden"
SCRIPT = Path(sys.executable).parent / "planner"


def script(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"{SCRIPT} is missing: scripts/setup.sh installs the package"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd)


def binary(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(planner_bin()), *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize(
    "args",
    [
        ["plan", str(GOLDEN / "glm_dsa_ep2.pb"), "--keep", "save_dsa_indexer"],
        ["plan", str(GOLDEN / "moe_ep2.pb"), "--format", "json", "--budget", "30MB", "-q"],
        ["pareto", str(GOLDEN / "dense.pb"), "--format", "json", "-q"],
        ["inspect", str(GOLDEN / "moe_ep4.pb"), "--format", "json"],
        ["--help"],
        ["plan", "--help"],
    ],
    ids=["plan-text", "plan-budget-json", "pareto", "inspect", "help", "plan-help"],
)
def test_the_planner_command_prints_what_the_binary_prints(args):
    ours, theirs = script(*args), binary(*args)
    assert (ours.returncode, ours.stdout, ours.stderr) == (
        theirs.returncode,
        theirs.stdout,
        theirs.stderr,
    )
    assert ours.returncode == 0 and ours.stdout


@pytest.mark.parametrize(
    "args, status",
    [
        (["plan"], 2),
        (["plan", str(GOLDEN / "dense.pb"), "--keep", "no_such_unit"], 1),
        (["inspect", "/no/such/graph.pb"], 1),
        (["plan", str(GOLDEN / "dense.pb"), "--recompute-ratio", "7"], 2),
    ],
    ids=["no-graph", "unknown-unit", "missing-file", "out-of-range"],
)
def test_the_planner_command_fails_as_the_binary_fails(args, status):
    ours, theirs = script(*args), binary(*args)
    assert ours.returncode == theirs.returncode == status
    assert ours.stderr == theirs.stderr and ours.stderr


def test_the_planner_command_writes_files_where_it_is_run(tmp_path):
    converted = script("convert", str(GOLDEN / "dense.pb"), "dense.json", cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    for plan in ("plan.json", "plan.pb"):
        done = script("plan", "dense.json", "-o", plan, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    same = script("diff", "plan.json", "plan.pb", cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    other = script("plan", "dense.json", "--keep", "save_mlp", "-o", "mlp.json", cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    differs = script("diff", "plan.json", "mlp.json", cwd=tmp_path)
    assert differs.returncode == 1 and differs.stdout


def test_the_planner_command_names_the_build_that_runs_plans():
    done = script("run", str(GOLDEN / "dense.pb"))
    assert done.returncode == 1
    assert "has no runtime" in done.stderr and "--features run" in done.stderr


def test_the_planner_command_starts_without_torch():
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, recompute_planner._cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"


def test_a_name_imported_on_first_use_is_the_object_its_module_defines():
    """`rp.annotate` stays the function after its module `recompute_planner.annotate` is
    imported (which sets the package attribute of that name), as with an eager import."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import recompute_planner as rp, recompute_planner.annotate as module; "
            "from recompute_planner.annotate import annotate; "
            "import recompute_planner.model_export; "
            "print(rp.annotate is annotate, rp.export is recompute_planner.model_export.export,"
            " callable(module))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["True", "True", "True"]
