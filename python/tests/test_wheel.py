"""The package as users get it: the wheel maturin builds, installed (not editable) into a fresh
venv with `pip install --no-index`, runs the README's three recipes from another folder.

The fresh venv sees the test venv's site-packages (torch, protobuf, pip, ...) through a
`.pth` line instead of installing a 5 GB torch again; a path added that way is not a site folder, so
the test venv's editable install of this package (its own `.pth`) does not reach the fresh
one. pip still resolves the wheel's declared requirements against those packages, offline.
The wheel is built with the dev profile, which reuses the build the editable install made.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from export_support import REPO_ROOT, planner_bin
from recompute_planner import _native
from test_readme import blocks


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    maturin = Path(sys.executable).parent / "maturin"
    build = subprocess.run(
        [str(maturin), "build", "--profile", "dev", "--locked", "--out", str(out)],
        cwd=REPO_ROOT / "python",
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (built,) = out.glob("recompute_planner-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_python(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed by pip, offline."""
    venv = tmp_path_factory.mktemp("venv")
    # Without pip of its own: an older pip and setuptools would shadow the test venv's
    # (torch requires a recent setuptools); pip is the test venv's, run in the fresh one.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    (Path(site) / "test_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return python


def test_the_wheel_is_abi3_and_carries_the_cargo_version(wheel):
    name, version, python_tag, abi_tag, _ = wheel.stem.split("-")
    assert name == "recompute_planner"
    assert version == _native.PLANNER_VERSION
    assert (python_tag, abi_tag) == ("cp310", "abi3")


def test_the_wheel_is_typed(wheel):
    """The PEP 561 marker ships, so a type checker reads the package's own annotations."""
    with zipfile.ZipFile(wheel) as archive:
        assert "recompute_planner/py.typed" in archive.namelist()


def test_the_installed_wheel_runs_the_readme_recipes_from_another_folder(
    fresh_python, tmp_path
):
    script = tmp_path / "recipes.py"
    script.write_text(_recipes_script())
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [str(fresh_python), "-W", "ignore", str(script), str(planner_bin())],
        cwd=work, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    location, cli, compiled, eager, rest = done.stdout.split("\0")
    assert Path(location).is_relative_to(fresh_python.parent.parent), location
    assert rest == ""
    assert "SAVE_MLP" in cli
    assert compiled.startswith("Memory(peak_bytes=")
    assert eager.startswith("{0: ")


def _recipes_script() -> str:
    """The README's blocks as one script: the package's location first, then each recipe's
    output, each followed by NUL; the shell block runs the `planner` binary given as argv[1]."""
    parts = [
        "import subprocess, sys",
        "import recompute_planner",
        "print(recompute_planner.__file__, end='\\0')",
    ]
    for index, (language, code) in enumerate(blocks()):
        if language == "python":
            parts.append(code)
        else:
            argv = shlex.split(code.strip())
            parts.append(
                f"print(subprocess.run([sys.argv[1], *{argv[1:]!r}], check=True,"
                " capture_output=True, text=True).stdout, end='')"
            )
        if index > 0:
            parts.append("print(end='\\0')")
    return "\n".join(parts) + "\n"
