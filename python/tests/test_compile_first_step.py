"""`scripts/compile_first_step.py` at its smallest: the first training step of torch.compile
with the planning stage, without checkpointing and over torch's checkpointing, each compiled in
a process of its own, with the same loss and gradients and no recompile in later steps."""

from __future__ import annotations

import contextlib
import io

from export_support import script_module

VARIANTS = ("plain", "torch-ckpt", "stage")


def test_script_compiles_each_variant_once_with_the_same_results():
    printed = io.StringIO()
    with script_module("compile_first_step") as script, contextlib.redirect_stdout(printed):
        depths = script.main(
            ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "8", "--steps", "2",
             "--runs", "1"]
        )
    (depth,) = depths
    assert depth.layers == 2 and depth.equal == "bitwise equal"
    assert tuple(depth.rows) == VARIANTS
    for row in depth.rows.values():
        assert row["recompiled_graphs"] == 0 and row["backend_calls"] == 1
        phases = ("dynamo_s", "aot_trace_s", "partition_s", "first_backward_s", "step_s")
        assert all(row[phase] > 0 for phase in phases)
    report = printed.getvalue()
    assert "first step: stage / plain = " in report and "torch-ckpt / stage = " in report
    assert report.count(": met (") + report.count(": MISSED (") == len(script.TARGETS)
