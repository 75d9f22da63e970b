"""The package as users get it: the wheel scripts/build_wheel.sh builds (manylinux_2_28, native
library stripped, the `planner` command inside), installed (not editable) into a fresh venv with
`pip install --no-index`, runs the README's recipes from another folder, the shell one with the
installed `planner`.

The fresh venv sees the test venv's site-packages (torch, protobuf, pip, ...) through a
`.pth` line instead of installing a 5 GB torch again; a path added that way is not a site folder, so
the test venv's editable install of this package (its own `.pth`) does not reach the fresh
one. pip still resolves the wheel's declared requirements against those packages, offline.
The wheel is built with the profile scripts/setup.sh built the package's extension with
(release unless ``PLANNER_NATIVE_PROFILE`` says otherwise), through the same zig linker, so
cargo reuses that build instead of compiling every crate again.
"""

from __future__ import annotations

import configparser
import email.parser
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import background
from recompute_planner import _native
from test_readme import blocks

WHEEL = background.Job(
    "wheel",
    lambda out: [
        "bash", "scripts/build_wheel.sh",
        "--profile", os.environ.get("PLANNER_NATIVE_PROFILE", "release"), "--out", str(out),
    ],
)
BACKGROUND_JOBS = (WHEEL,)


@pytest.fixture(scope="module")
def wheel() -> Path:
    build, out = background.SESSION.finished(WHEEL)
    assert build.returncode == 0, build.stderr
    (built,) = out.glob("recompute_planner-*.whl")
    assert build.stdout.strip() == str(built)
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


def test_the_wheel_is_abi3_manylinux_2_28_and_carries_the_cargo_version(wheel):
    name, version, python_tag, abi_tag, platform_tag = wheel.stem.split("-")
    assert name == "recompute_planner"
    assert version == _native.PLANNER_VERSION
    assert (python_tag, abi_tag) == ("cp310", "abi3")
    assert platform_tag == "manylinux_2_28_x86_64"


def test_the_wheels_native_library_needs_no_glibc_newer_than_its_tag(wheel, tmp_path):
    library = _extract_native_library(wheel, tmp_path)
    versions = _glibc_versions(library)
    assert versions, "objdump found no versioned glibc symbol: the check would prove nothing"
    assert max(versions) <= (2, 28), sorted(versions)


def test_the_wheels_native_library_is_stripped(wheel, tmp_path):
    library = _extract_native_library(wheel, tmp_path)
    sections = subprocess.run(
        ["readelf", "-S", "-W", str(library)], capture_output=True, text=True, check=True
    ).stdout
    assert ".dynsym" in sections  # the table read is the library's
    assert ".symtab" not in sections and ".debug_" not in sections


def test_the_wheel_declares_its_command_license_and_description(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (metadata_path,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        info = metadata_path.rsplit("/", 1)[0]
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(f"{info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["planner"] == "recompute_planner._cli:main"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Keywords"]
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert metadata["Description-Content-Type"].startswith("text/markdown")
    assert "planner plan graph.pb" in metadata.get_payload()


def _extract_native_library(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [
            n for n in archive.namelist() if re.fullmatch(r"recompute_planner/_native\..*so", n)
        ]
        return Path(archive.extract(name, into))


def _glibc_versions(library: Path) -> set[tuple[int, ...]]:
    """The glibc symbol versions the library's dynamic symbols require."""
    symbols = subprocess.run(
        ["objdump", "-T", str(library)], capture_output=True, text=True, check=True
    ).stdout
    return {
        tuple(int(part) for part in version.split("."))
        for version in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", symbols)
    }


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
    installed_planner = fresh_python.parent / "planner"
    assert installed_planner.is_file(), "the wheel installed no `planner` command"
    done = subprocess.run(
        [str(fresh_python), "-W", "ignore", str(script), str(installed_planner)],
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
    output, each followed by NUL; the shell block runs the `planner` command given as argv[1]."""
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
