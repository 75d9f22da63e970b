"""Predicted against measured time of eager selective checkpointing from a plan, on the
device at hand (a GPU, or this CPU): step, forward, backward and replay time of zoo models
at shapes where compute is not all overhead, for every uniform keep, no checkpointing and the
`budget` answers; with CUDA also the step's peak memory (the caching allocator's).

Each configuration is planned twice: with the shipped datasheet profile (`h200`) and with a
profile `recompute_planner.calibrate` measures on the same device first. Measured
(`recompute_planner._step_timing`): the model with every layer under `torch.utils.checkpoint`
and the plan's SAC policies, one step of every configuration per round in a shuffled order,
the median of `--repeat` rounds after a warm-up, so that a machine's drift in speed slows
every configuration alike; the device synchronised before and after each step: forward is
`loss = model(*inputs)`, backward `torch.autograd.grad(loss, params)`, split by a device event
(the host clock on a CPU); replay is the time inside the layers' recomputes during backward
(device events around each recompute on CUDA: the device's time between the recompute's first
and last work, which leaves out host time hidden behind earlier backward work).

Exporting needs torch 2.13 (the exporter's tracing release), measuring runs under any torch
the eager side supports (2.9 to 2.13), so the two halves can run on different machines:

    python scripts/time_check.py export DIR --device cuda     # traces each case (fake CUDA)
    python scripts/time_check.py measure DIR --device cuda    # on the GPU machine
    python scripts/time_check.py all DIR --device cpu         # both, on this machine
    python scripts/time_check.py rank                         # budget answers, this CPU

`rank` measures the budget ranking cases (`recompute_planner._step_timing.RANKING_CASES`,
what tests/test_budget_ranking.py checks): each budget answer against every uniform keep, ten
random per-layer mixes and the datasheet's answer that fit its budget, interleaved.

`measure` prints one table per case and writes every row as JSON (`--json`). A GPU machine
without this package's build needs only the native extension beside the sources
(`scripts/gpu_time.sh` carries it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import recompute_planner as rp
from recompute_planner._step_timing import (
    DATASHEET,
    RANKING_CASES,
    ZooStep,
    interleaved,
    kept,
    median,
    rank_budget_answer,
    ranking_case,
)
from recompute_planner._zoo.catalog import declared_units, entry, make_inputs, model_decls
from recompute_planner._zoo.config import ZooConfig
from recompute_planner._zoo.model import CausalLM
from recompute_planner.api import hw_profile

# Widths at which a layer's matmuls are milliseconds of work on a GPU (fp32, as the zoo runs).
WIDE = dict(hidden=1024, heads=16, head_dim=64, ffn=4096, vocab=8192, num_layers=4)
WIDE_MOE = dict(WIDE, moe_ffn=2048, shared_ffn=1024)

# (case, zoo entry, changes to its config). `dense_small` is the predictions table's shape
# (every op a few microseconds: overhead-bound); the others are compute-bound on a GPU.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense_small": ("dense", dict(batch=8, seq=64)),
    "dense_wide": ("dense", dict(WIDE, batch=4, seq=1024)),
    "moe_wide": ("moe_hf_router", dict(WIDE_MOE, batch=4, seq=1024)),
}
# CPU runs take smaller shapes: a 2-core machine runs the wide ones at seconds a step.
CPU_CHANGES: dict[str, dict[str, Any]] = {
    "dense_wide": dict(hidden=256, heads=4, ffn=1024, vocab=2048, batch=2, seq=256),
    "moe_wide": dict(
        hidden=256, heads=4, moe_ffn=512, shared_ffn=256, vocab=2048, batch=2, seq=256
    ),
}


def case_config(case: str, device: str) -> ZooConfig:
    """The zoo config of ``case`` on ``device``; MoE capacity scaled with the tokens, as the
    predictions table scales it."""
    name, changes = CASES[case]
    base = entry(name).config
    if device != "cuda":
        changes = dict(changes, **CPU_CHANGES.get(case, {}))
    return base.resized(**changes)


# --------------------------------------------------------------------------------------------
# Export


def export(directory: Path, device: str, cases: list[str]) -> None:
    """Traces each case's training step as it runs on ``device`` (fake tensors for CUDA) and
    writes ``CASE.pb`` and ``cases.json`` (the configs) to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    configs = {}
    for case in cases:
        cfg = case_config(case, device)
        hw = DATASHEET if device == "cuda" else None
        result = rp.export(
            CausalLM(cfg),
            make_inputs(cfg),
            models=model_decls(cfg),
            name=case,
            fake=True,
            device=device,
            hw=hw,
        )
        (directory / f"{case}.pb").write_bytes(result.graph.SerializeToString(deterministic=True))
        configs[case] = dataclasses.asdict(cfg)
        print(f"exported {case} ({device}): {len(result.graph.nodes)} nodes", file=sys.stderr)
    (directory / "cases.json").write_text(
        json.dumps({"device": device, "cases": configs}, indent=1, default=list) + "\n"
    )


# --------------------------------------------------------------------------------------------
# Measure


def built(cfg: ZooConfig, device: torch.device, plan: rp.Plan | None, label: str) -> ZooStep | None:
    """``plan``'s step, built and run once (a warm-up), or None (reported) where either fails:
    the other configurations are still measured."""
    try:
        step = ZooStep(cfg, device, plan)
        step.run()
    except Exception as error:
        print(f"  {label}: failed: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return step


def cuda_peak(step: ZooStep) -> int | None:
    """The caching allocator's peak during one step, less what was allocated before it, plus
    the inputs (CUDA only: the CPU has no allocator peak to read)."""
    if not step.clock.cuda:
        return None
    step.clock.sync()
    torch.cuda.reset_peak_memory_stats(step.device)
    before = torch.cuda.memory_allocated(step.device)
    step.run()
    return torch.cuda.max_memory_allocated(step.device) - before + step.input_bytes


def quiet_plan(graph: bytes, keep: Any, **options: Any) -> rp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, executor="eager", **options)


Planned = tuple[str, "rp.Plan | None", "rp.Plan | None", "rp.Plan | None"]


def configurations(graph: bytes, units: list[str], profile: dict[str, Any]) -> Iterator[Planned]:
    """(label, plan with the calibrated profile, with the datasheet, with the calibrated
    profile run in order) of every configuration measured: no checkpointing, every uniform
    keep, and the answers to a budget halfway between the peaks of keeping nothing and
    keeping everything, one per profile (each answer's per-layer mix planned with every
    profile through ``choices``)."""
    in_order = dict(profile, asynchronous=False)
    yield "no checkpoint", None, None, None
    for keep in ["none", *units, "all"]:
        yield (
            keep,
            quiet_plan(graph, keep, hw=profile),
            quiet_plan(graph, keep, hw=DATASHEET),
            quiet_plan(graph, keep, hw=in_order),
        )
    low = quiet_plan(graph, "none", hw=profile).memory.peak_bytes
    high = quiet_plan(graph, "all", hw=profile).memory.peak_bytes
    budget = (low + high) // 2
    calibrated = quiet_plan(graph, None, hw=profile, budget=budget)
    datasheet = quiet_plan(graph, None, hw=DATASHEET, budget=budget)
    same = kept(calibrated) == kept(datasheet)
    label = f"budget {mib(budget)} MiB ({budget} B)"
    answers = [("calibrated = datasheet" if same else "calibrated", calibrated)]
    answers += [] if same else [("datasheet", datasheet)]
    for name, answer in answers:
        yield (
            f"{label}, {name}",
            quiet_plan(graph, None, hw=profile, choices=answer),
            quiet_plan(graph, None, hw=DATASHEET, choices=answer),
            quiet_plan(graph, None, hw=in_order, choices=answer),
        )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def predicted(plan: rp.Plan | None) -> dict[str, float | None]:
    if plan is None:
        return {
            "step_s": None,
            "forward_s": None,
            "backward_s": None,
            "replay_s": None,
            "peak_bytes": None,
        }
    cost = plan.cost
    return {
        "step_s": cost.step_time_s,
        "forward_s": cost.forward_time_s,
        "backward_s": cost.backward_time_s + cost.replay_time_s,
        "replay_s": cost.replay_time_s,
        "peak_bytes": plan.memory.peak_bytes,
    }


def no_checkpoint_prediction(plan: rp.Plan) -> dict[str, float | None]:
    """A step without checkpointing (``plan`` checkpoints no layer): its forward and
    backward, and the no-checkpoint peak."""
    cost = plan.cost
    return {
        "step_s": cost.forward_time_s + cost.backward_time_s,
        "forward_s": cost.forward_time_s,
        "backward_s": cost.backward_time_s,
        "replay_s": 0.0,
        "peak_bytes": plan.memory.no_checkpoint_peak_bytes,
    }


def measure_case(
    case: str,
    cfg: ZooConfig,
    graph: bytes,
    device: torch.device,
    profile: dict[str, Any],
    repeat: int,
) -> list[dict[str, Any]]:
    """Every configuration of ``case`` predicted and measured: the steps interleaved, round
    by round (``_step_timing.interleaved``), the median of ``repeat`` rounds."""
    units = list(declared_units(cfg))
    # No layer checkpointed: the step without eager SAC's cost per op.
    reference = quiet_plan(graph, "none", hw=profile, recompute_ratio=0.0)
    reference_ds = quiet_plan(graph, "none", hw=DATASHEET, recompute_ratio=0.0)
    planned = {label: plans for label, *plans in configurations(graph, units, profile)}
    steps = {
        label: step
        for label, (calibrated, datasheet, _) in planned.items()
        if (step := built(cfg, device, calibrated or datasheet, f"{case} {label}")) is not None
    }
    peaks = {label: cuda_peak(step) for label, step in steps.items()}
    rows = []
    for label, runs in interleaved(steps, repeat, warmup=1).items():
        measured = median(runs)
        calibrated, datasheet, in_order = planned[label]
        run = calibrated or datasheet
        if run is None:
            cal, ds = no_checkpoint_prediction(reference), no_checkpoint_prediction(reference_ds)
            serial = no_checkpoint_prediction(
                quiet_plan(graph, "none", hw=dict(profile, asynchronous=False), recompute_ratio=0.0)
            )
        else:
            cal, ds, serial = predicted(calibrated), predicted(datasheet), predicted(in_order)
        rows.append(
            {
                "case": case,
                "config": label,
                "measured": dict(dataclasses.asdict(measured), peak_bytes=peaks[label]),
                "calibrated": cal,
                "datasheet": ds,
                "serial": serial,
                "kept": [list(k) for k in kept(run)] if run is not None else None,
            }
        )
        print(f"  {case} {label}: measured step {measured.step_s * 1e3:.2f} ms", file=sys.stderr)
    return rows


def gap(predicted_value: float | None, measured_value: float | None) -> str:
    if predicted_value is None or not measured_value:
        return "-"
    return f"{(predicted_value - measured_value) / measured_value * 100:+.0f}%"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | step (ms) | predicted | gap | in order | gap | datasheet | gap | forward | "
        "predicted | backward | predicted | replay | predicted | gap | peak (MiB) | predicted "
        "| gap |"
    )
    lines = [head, "|" + "---|" * 18]
    for r in rows:
        m, c, d, o = r["measured"], r["calibrated"], r["datasheet"], r["serial"]
        peak = m["peak_bytes"]
        lines.append(
            f"| {r['config']} | {ms(m['step_s'])} | {ms(c['step_s'])} | "
            f"{gap(c['step_s'], m['step_s'])} | {ms(o['step_s'])} | "
            f"{gap(o['step_s'], m['step_s'])} | {ms(d['step_s'])} | "
            f"{gap(d['step_s'], m['step_s'])} | {ms(m['forward_s'])} | {ms(c['forward_s'])} | "
            f"{ms(m['backward_s'])} | {ms(c['backward_s'])} | {ms(m['replay_s'])} | "
            f"{ms(c['replay_s'])} | {gap(c['replay_s'], m['replay_s'])} | "
            f"{'-' if peak is None else mib(peak)} | "
            f"{'-' if c['peak_bytes'] is None else mib(c['peak_bytes'])} | "
            f"{gap(c['peak_bytes'], peak)} |"
        )
    return "\n".join(lines)


def ranking(rows: list[dict[str, Any]]) -> str:
    """The configurations ordered by measured step time, with their order by predicted time
    (calibrated, datasheet), and where the calibrated budget answer stands among the
    configurations whose predicted peak fits its budget."""
    planned = [r for r in rows if r["calibrated"]["step_s"] is not None]
    by_measured = sorted(planned, key=lambda r: r["measured"]["step_s"])
    order = {
        id(r): i for i, r in enumerate(sorted(planned, key=lambda r: r["calibrated"]["step_s"]))
    }
    lines = [
        "measured order (calibrated predicted rank): "
        + ", ".join(f"{r['config']} ({order[id(r)] + 1})" for r in by_measured)
    ]
    answer = next(
        (
            r
            for r in rows
            if r["config"].startswith("budget") and r["calibrated"]["step_s"] is not None
        ),
        None,
    )
    if answer is not None:
        budget = int(answer["config"].split("(")[1].split()[0])
        fits = [
            r
            for r in planned
            if r["calibrated"]["peak_bytes"] is not None
            and r["calibrated"]["peak_bytes"] <= budget
            and r is not answer
        ]
        faster = [r for r in fits if r["measured"]["step_s"] < answer["measured"]["step_s"]]
        lines.append(
            f"budget answer: {answer['measured']['step_s'] * 1e3:.2f} ms measured; "
            f"{len(fits)} other configurations fit, measured faster: "
            + (
                ", ".join(f"{r['config']} {ms(r['measured']['step_s'])} ms" for r in faster)
                or "no configuration"
            )
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


def calibrated_profile(device: torch.device, repeat: int, out: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    profile = rp.calibrate(device, repeat=repeat, out=out)
    fields = (
        "op_overhead_s",
        "view_overhead_s",
        "matmul_overhead_s",
        "attention_overhead_s",
        "reduction_overhead_s",
        "matmul_f32_flops_per_s",
        "matmul_flops_per_s",
        "selection_ops_per_s",
        "attention_16bit_efficiency",
        "hbm_bytes_per_s",
        "host_bytes_per_s",
        "host_sync_s",
        "checkpoint_op_overhead_s",
    )
    print(
        f"calibrated {device} in {time.perf_counter() - started:.1f} s: "
        + ", ".join(f"{f}={profile.get(f):.3g}" for f in fields if f in profile)
        + f", asynchronous={profile.get('asynchronous')}",
        file=sys.stderr,
    )
    return profile


def run_measure(
    directory: Path, device: torch.device, repeat: int, cases: list[str] | None, out: Path | None
) -> None:
    spec = json.loads((directory / "cases.json").read_text())
    profile = calibrated_profile(device, 5, directory / f"profile_{device.type}.json")
    if device.type == "cuda":
        print(
            f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}",
            file=sys.stderr,
        )
    rows: list[dict[str, Any]] = []
    for case, fields in spec["cases"].items():
        if cases and case not in cases:
            continue
        fields["omitted_markers"] = frozenset(tuple(m) for m in fields["omitted_markers"])
        cfg = ZooConfig(**fields)
        graph = (directory / f"{case}.pb").read_bytes()
        case_rows = measure_case(case, cfg, graph, device, profile, repeat)
        rows += case_rows
        print(f"\n### {case} ({device.type}, traced on {spec['device']}; median of {repeat})\n")
        print(table(case_rows))
        print()
        print(ranking(case_rows))
        sys.stdout.flush()
        if out is not None:
            out.write_text(json.dumps({"profile": profile, "rows": rows}, indent=1) + "\n")


def run_compare(directory: Path, rows_path: Path, hw: Any) -> None:
    """Plans every configuration of measured rows (``measure --json``) again with ``hw``
    (default: the profile the rows were measured with) and prints them against the
    measurements: a change of the cost model checked against times measured before it. A
    budget row is compared only where the new plan keeps what the measured one kept."""
    measured = json.loads(rows_path.read_text())
    profile = json.loads(hw_profile(hw)) if hw is not None else measured["profile"]
    by_case: dict[str, list[dict[str, Any]]] = {}
    for row in measured["rows"]:
        by_case.setdefault(row["case"], []).append(row)
    for case, rows in by_case.items():
        graph = (directory / f"{case}.pb").read_bytes()
        spec = json.loads((directory / "cases.json").read_text())["cases"][case]
        units = list(spec_units(spec))
        planned = {label: plans for label, *plans in configurations(graph, units, profile)}
        again = []
        for row in rows:
            label = row["config"]
            if label == "no checkpoint":
                reference = quiet_plan(graph, "none", hw=profile, recompute_ratio=0.0)
                reference_ds = quiet_plan(graph, "none", hw=DATASHEET, recompute_ratio=0.0)
                serial = quiet_plan(
                    graph, "none", hw=dict(profile, asynchronous=False), recompute_ratio=0.0
                )
                plans = [no_checkpoint_prediction(p) for p in (reference, reference_ds, serial)]
            elif label in planned:
                calibrated, datasheet, in_order = planned[label]
                if calibrated is not None and row["kept"] != [list(k) for k in kept(calibrated)]:
                    continue
                plans = [predicted(calibrated), predicted(datasheet), predicted(in_order)]
            else:
                continue
            again.append(dict(row, calibrated=plans[0], datasheet=plans[1], serial=plans[2]))
        print(f"\n### {case} (measured: {rows_path}; predicted: {profile_name(profile)})\n")
        print(table(again))
        print()
        print(ranking(again))


def run_rank(device: torch.device, cases: list[str] | None) -> None:
    """Each ranking case's budget answer (calibrated here) against what else fits, measured
    interleaved (what tests/test_budget_ranking.py checks), as a table."""
    profile = calibrated_profile(device, 5, None)
    for case in cases or list(RANKING_CASES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rp.PlannerWarning)
            ready = ranking_case(case, profile)
        name, _, rounds = RANKING_CASES[case]
        ranked = rank_budget_answer(ready.cfg, ready.candidates, device, rounds)
        datasheet = (
            f"the datasheet's answer predicted {ready.datasheet_gap:+.1%}"
            if ready.datasheet_gap
            else "the datasheet answers alike at every budget tried"
        )
        print(
            f"\n### {case} (`{name}`), budget {ready.budget:,} B ({datasheet}), median of "
            f"{rounds} rounds\n"
        )
        print("| configuration | keeps | peak (B) | step, predicted (ms) | measured (ms) | "
              "against the answer |")
        print("|---|---|--:|--:|--:|--:|")
        for r in ranked:
            print(
                f"| {r.label} | {compact(r.plan)} | {r.plan.memory.peak_bytes:,} | "
                f"{ms(r.plan.cost.step_time_s)} | {ms(r.times.step_s)} | {r.vs_answer:+.1%} |"
            )
        sys.stdout.flush()


def compact(plan: rp.Plan) -> str:
    """What a plan keeps, per unit: ``SAVE_MLP 0,1,3``."""
    layers: dict[str, list[int]] = {}
    for _, unit, layer in kept(plan):
        layers.setdefault(unit, []).append(layer)
    return "; ".join(f"{u} {','.join(map(str, ls))}" for u, ls in sorted(layers.items())) or "-"


def spec_units(spec: dict[str, Any]) -> dict[str, Any]:
    fields = dict(spec, omitted_markers=frozenset(tuple(m) for m in spec["omitted_markers"]))
    return declared_units(ZooConfig(**fields))


def profile_name(profile: dict[str, Any]) -> str:
    return str(profile.get("name", "profile"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("export", "measure", "all", "compare", "rank"))
    parser.add_argument("directory", type=Path, nargs="?", help="not with rank")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument(
        "--ranking-case",
        action="append",
        help="rank: a case of recompute_planner._step_timing.RANKING_CASES (default: all)",
    )
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument(
        "--rows", type=Path, help="compare: the rows `measure --json` wrote (and its profile)"
    )
    parser.add_argument("--hw", help="compare: plan with this profile (a name or a JSON file)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.action == "rank":
        if device.type != "cpu":
            parser.error("rank runs on the CPU (its cases are CPU widths, traced for the CPU)")
        run_rank(device, args.ranking_case)
        return 0
    if args.directory is None:
        parser.error(f"{args.action} needs a directory")
    if args.action in ("export", "all"):
        export(args.directory, device.type, args.case or list(CASES))
    if args.action in ("measure", "all"):
        run_measure(args.directory, device, args.repeat, args.case, args.json)
    if args.action == "compare":
        if args.rows is None:
            parser.error("compare needs --rows")
        run_compare(args.directory, args.rows, args.hw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
