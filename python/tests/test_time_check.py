"""`scripts/time_check.py` on this CPU at its smallest case: eager SAC's step, forward,
backward and replay measured against the plan, and measured rows planned again (`compare`)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from export_support import script_module


@pytest.fixture(scope="module")
def script():
    with script_module("time_check") as module:
        yield module


@pytest.fixture(scope="module")
def measured(script, tmp_path_factory):
    directory = tmp_path_factory.mktemp("time_check")
    rows = directory / "rows.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script.main(
            [
                "all",
                str(directory),
                "--device",
                "cpu",
                "--case",
                "dense_small",
                "--repeat",
                "3",
                "--json",
                str(rows),
            ]
        )
    return directory, rows, json.loads(rows.read_text()), printed.getvalue()


def test_every_configuration_is_measured_and_predicted(measured):
    _, _, result, printed = measured
    rows = result["rows"]
    configs = [r["config"] for r in rows]
    assert configs[:5] == ["no checkpoint", "none", "SAVE_ATTN", "SAVE_MLP", "all"]
    assert any(c.startswith("budget") for c in configs)
    for row in rows:
        m = row["measured"]
        assert min(m["step_s"], m["forward_s"], m["backward_s"]) > 0
        assert m["peak_bytes"] is None  # the CPU has no allocator peak to read
        assert row["calibrated"]["step_s"] > 0
    # Replay is timed inside the recomputes: none without checkpointing, some with it.
    assert rows[0]["measured"]["replay_s"] == 0
    assert all(r["measured"]["replay_s"] > 0 for r in rows[1:])
    assert result["profile"]["asynchronous"] is False
    assert "| config | step (ms) |" in printed and "measured order" in printed


def test_measured_rows_planned_again_with_their_profile_predict_the_same(script, measured):
    directory, rows_path, result, _ = measured
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script.main(["compare", str(directory), "--rows", str(rows_path)])
    again = printed.getvalue()
    for row in result["rows"]:
        if row["datasheet"]["step_s"] is not None:
            assert f"| {script.ms(row['calibrated']['step_s'])} |" in again, row["config"]
