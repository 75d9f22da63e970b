"""The documentation's Python recipes run as written. The README's "Use it from PyTorch": the
Python blocks in order in one namespace (later examples use the first one's model), the shell
block with the `planner` binary, in a scratch folder, and the plan the first block exported
executed with `planner run --check` as the section shows. docs/real-size.md: its one block, a
meta-device Llama at Llama-3-8B width exported with fake tensors and planned.
docs/huggingface.md: its blocks in order in one namespace, on a stock Llama as configured."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import warnings

import pytest

import recompute_planner as rp
from export_support import REPO_ROOT, planner_bin, planner_run

README = "README.md"
SECTION = "## Use it from PyTorch"
REAL_SIZE = "docs/real-size.md"
STOCK_HF = "docs/huggingface.md"


def section(title: str | None = SECTION, path: str = README) -> str:
    """The text of the section ``title`` (a level-2 heading, up to the next one) of the
    Markdown file ``path`` (from the repository root); the whole file when ``title`` is None."""
    text = (REPO_ROOT / path).read_text()
    if title is None:
        return text
    start = text.index(f"\n{title}\n") + 1
    end = text.find("\n## ", start + len(title))
    return text[start:end if end != -1 else len(text)]


def blocks(title: str | None = SECTION, path: str = README) -> list[tuple[str, str]]:
    """(language, code) of every fenced ```python / ```sh block of the section ``title`` of
    ``path`` (the whole file when ``title`` is None), in order."""
    return re.findall(r"```(python|sh)\n(.*?)```", section(title, path), flags=re.S)


def test_the_readme_plans_a_real_size_model_without_allocating_it(capsys):
    """The recipe's printed totals are those of Llama-3-8B width at 4096 tokens: gigabytes of
    parameters (2 layers, the embeddings and the head: 2.77 GiB in bf16) that were never
    allocated (the model stays on `meta`), and a device total that fits an H100."""
    ((language, code),) = blocks(None, REAL_SIZE)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        exec(compile(code, REAL_SIZE, "exec"), namespace)
    printed = capsys.readouterr().out
    assert re.fullmatch(
        r"peak \d+\.\d GiB \+ parameters 2\.8 GiB\ndevice total \d+\.\d GiB, fits: True\n",
        printed,
    ), printed
    assert all(p.device.type == "meta" for p in namespace["llama"].parameters())
    assert namespace["step"].params == {}


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
                exec(compile(code, README, "exec"), namespace)
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


def test_the_readme_runs_the_plan_it_exported(tmp_path, monkeypatch):
    """The section's `planner run` command (indented, not fenced: it needs the planner built
    with the runtime, and is skipped without it) on the graph and tensors the first block
    wrote: the plan's step is bit-identical to the step without checkpointing and with
    whole-layer recompute, and matches PyTorch's reference."""
    monkeypatch.chdir(tmp_path)
    (command,) = re.findall(r"^    (planner run .*)$", section(), flags=re.M)
    language, export = blocks()[0]
    assert language == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        exec(compile(export, README, "exec"), {})
    argv = shlex.split(command)
    done = planner_run(*argv[2:])
    assert done.returncode == 0, done.stderr
    assert "bit-identical to no-checkpoint and whole-layer" in done.stdout


def run_blocks(path: str, capsys) -> tuple[dict, list[str | None]]:
    """Runs the blocks of the Markdown file ``path`` in order, the Python ones in one
    namespace, the shell ones with the `planner` binary; returns the namespace and what each
    block printed (None for a `planner run` where the planner was built without the
    runtime)."""
    namespace: dict = {}
    printed: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        for language, code in blocks(None, path):
            if language == "python":
                exec(compile(code, path, "exec"), namespace)
                printed.append(capsys.readouterr().out)
                continue
            argv = shlex.split(code.strip())
            assert argv[0] == "planner"
            done = subprocess.run([str(planner_bin()), *argv[1:]], capture_output=True, text=True)
            if argv[1] == "run" and "built without the runtime" in done.stderr:
                printed.append(None)
                continue
            assert done.returncode == 0, done.stderr
            printed.append(done.stdout)
    return namespace, printed


def test_the_readme_runs_a_stock_hf_model(tmp_path, monkeypatch, capsys):
    """The stock Llama as configured (KV cache on): exported without a mask and planned, the
    compile recipe (its step returns a `ModelOutput`: one plan, every parameter with its
    gradient), eager SAC from the plan (the layers hold the kept MLP outputs; `.remove()`
    restores the layers and the cache), and both data-parallel ranks exported in one call and
    run with `--check`."""
    monkeypatch.chdir(tmp_path)
    namespace, printed = run_blocks(STOCK_HF, capsys)
    assert printed[0].startswith("Memory(peak_bytes=")
    stage = namespace["stage"]
    assert len(stage.plans) == 1 and stage.plans[0].saved
    assert printed[1].startswith("Memory(peak_bytes=")
    assert all(p.grad is not None for p in namespace["llama"].parameters())
    held = namespace["policies"]
    assert sorted(held) == [0, 1] and all(p.held_bytes() > 0 for p in held.values())
    assert printed[2].strip().startswith("{0: ")
    llama = namespace["llama"]
    assert llama.config.use_cache is True
    assert not any("forward" in layer.__dict__ for layer in llama.model.layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "llama.pb", "llama.rank1.safetensors", "llama.safetensors"
    ]
    if printed[4] is None:
        pytest.skip("this planner has no `run` (build it with --features run); the rest passed")
    assert "2 rank(s)" in printed[4] and "\nrank 1\n" in printed[4]


def test_the_readmes_save_recompute_offload_table_is_what_the_planner_prints():
    """Each row of the README's table of the three fates on the DSA golden (and a budget's
    answer without and with offload): the options given to `planner plan`, and the device
    peak, host bytes, transfer and replay time it predicts."""
    rows = re.findall(
        r"^\| (\(none[^|]*\)|`[^`]+`) \| ([\d,]+) B \| ([\d,]+) B \| ([\d.]+) (s|µs) \| "
        r"([\d.]+) ms \|$",
        section(),
        flags=re.M,
    )
    assert len(rows) == 5, rows
    for options, peak, host, transfer, unit, replay in rows:
        args = [] if options.startswith("(") else shlex.split(options.strip("`"))
        done = subprocess.run(
            [planner_bin(), "plan", "tests/golden/glm_dsa_ep2.pb", *args, "--format", "json"],
            cwd=REPO_ROOT, capture_output=True, text=True,
        )
        assert done.returncode == 0, done.stderr
        plan = json.loads(done.stdout)
        scale = 1e6 if unit == "µs" else 1.0
        assert plan["memory"]["peak_bytes"] == int(peak.replace(",", "")), options
        assert plan["memory"].get("offloaded_bytes", 0) == int(host.replace(",", "")), options
        decimals = len(transfer.partition(".")[2])
        printed = round(plan["cost"].get("transfer_time_s", 0.0) * scale, decimals)
        assert printed == float(transfer), options
        assert f"{plan['cost']['replay_time_s'] * 1e3:.3f}" == replay, options
