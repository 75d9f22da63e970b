"""`scripts/predictions.py --time --time-hf`: every executor's step (and the replay of those
that measure it apart) against its plan's, at the width of the budget ranking's dense model and
of a HuggingFace family at the time rows' shape, written into the Markdown page as a section of
its own."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from export_support import script_module

pytestmark = pytest.mark.timed


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("time_predictions")
    rows, page = folder / "rows.json", folder / "predictions.md"
    with script_module("predictions") as script, contextlib.redirect_stdout(io.StringIO()):
        script.main(
            ["--zoo", "--hf", "--time", "dense", "--time-hf", "qwen3", "--time-rounds", "3",
             "--json", str(rows), "--markdown", str(page)]
        )
    return json.loads(rows.read_text())["time_rows"], page.read_text()


def test_every_executor_measures_each_keep_against_its_plan(timed):
    rows, _ = timed
    assert sorted((r["case"], r["executor"], r["keep"]) for r in rows) == sorted(
        (c, e, k)
        for c in ("dense", "qwen3")
        for e in ("graph", "eager", "compile")
        for k in ("none", "all")
    )
    for r in rows:
        # Within a factor of 3: what a calibrated profile predicts of a step on this machine
        # (the ranges measured: docs/predictions.md, "Time").
        assert abs(math.log(r["predicted_step_s"] / r["measured_step_s"])) < math.log(3), r
        assert r["hw"].startswith("calibrated cpu"), r
        replay = r["measured_replay_s"]
        assert (replay is None) == (r["executor"] == "compile"), r
        if replay is not None and r["keep"] == "none":
            assert abs(math.log(r["predicted_replay_s"] / replay)) < math.log(3), r


def test_the_page_has_a_time_section_with_a_row_per_measurement(timed):
    rows, page = timed
    section = page.split("\n## Time\n", 1)[1]
    assert "| executor | step gap | step within target |" in section
    assert section.count("| dense | ") + section.count("| qwen3 | ") == len(rows)
