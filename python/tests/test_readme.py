"""The README's "Use it from PyTorch" examples run as written: the Python blocks in order in
one namespace (later examples use the first one's model), the shell block with the `planner`
binary, in a scratch folder."""

from __future__ import annotations

import re
import shlex
import subprocess
import warnings


import recompute_planner as rp
from export_support import REPO_ROOT, planner_bin

SECTION = "## Use it from PyTorch"


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the section, in order."""
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end != -1 else len(text)]
    return re.findall(r"```(python|sh)\n(.*?)```", section, flags=re.S)


def test_the_readme_shows_the_three_ways():
    languages = [language for language, _ in blocks()]
    assert languages == ["python", "sh", "python", "python"]


def test_the_readme_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    outputs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        for language, code in blocks():
            if language == "python":
                exec(compile(code, "README.md", "exec"), namespace)
                outputs.append(capsys.readouterr().out)
                continue
            argv = shlex.split(code.strip())
            assert argv[0] == "planner"
            done = subprocess.run(
                [str(planner_bin()), *argv[1:]], capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout)
    cli, compiled, eager = outputs[1], outputs[2], outputs[3]
    assert "SAVE_MLP" in cli
    stage = namespace["stage"]
    assert len(stage.plans) == 1 and stage.plans[0].saved
    assert compiled.startswith("Memory(peak_bytes=")
    held = namespace["policies"]
    assert sorted(held) == [0, 1] and all(p.held_bytes() > 0 for p in held.values())
    assert eager.strip().startswith("{0: ")
