"""Offload on a CUDA device (or this CPU, to try the script): eager selective checkpointing
and the torch.compile stage running what a plan offloads, against the same step without
offload, on the zoo's dense model at a width where activations are megabytes.

The plan keeps every unit and offloads what they keep and every layer input
(`--offload-kinds kept,layer-input`), made from the step exported on the CPU at the same shape.
Per executor it prints the device peak (CUDA: the caching allocator's peak above what was
allocated before the step; CPU: the allocator trace of `recompute_planner._measure`), the
bytes copied to host memory (pinned and asynchronous on CUDA) and whether loss and gradients
are bit-identical to the step without offload:

- eager: every layer under `recompute_planner.sac` with the eager plan (`--offload-prefetch
  0`), the forward inside `sac.offloading()`;
- compile: `torch.compile(model, backend=stage.backend)` with the planning stage, once with
  offload and once without (inductor compiles both, so their kernels are the same).

    python scripts/gpu_offload.py --device cuda

Exits 1 when a step's loss or gradients differ, or its bytes copied differ from the plan's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

import recompute_planner as rp
from recompute_planner import _host_memory as host_memory
from recompute_planner import _measure as measure
from recompute_planner import compile as stage_mod
from recompute_planner import sac
from recompute_planner._exporter import export_joint
from recompute_planner._zoo.catalog import entry, make_inputs, model_decls
from recompute_planner._zoo.model import CausalLM

SHAPE = dict(hidden=512, heads=8, head_dim=64, ffn=2048, vocab=4096, num_layers=4, batch=4,
             seq=256)
OFFLOAD = {"keep": "all", "offload_kinds": ["kept", "layer-input"]}

Step = tuple[torch.Tensor, list[torch.Tensor]]


def peak_of(device: str, step: Callable[[], Step]) -> tuple[int, Step]:
    """The device peak of ``step()`` above what was allocated before it, and its result."""
    if device == "cpu":
        trace, out = measure.trace_allocations(step)
        return trace.peak()[0], out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, out


def loss_and_grads(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> Step:
    loss = forward()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), list(grads)


def identical(a: Step, b: Step) -> bool:
    return torch.equal(a[0], b[0]) and all(
        torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)
    )


def eager_step(cfg: Any, inputs: tuple, plan: rp.Plan | None, device: str) -> Callable[[], Step]:
    model = CausalLM(cfg).to(device)
    if plan is not None:
        policies = {key: sac.context_fn(plan, *key) for key in plan.layers()}
        measure.checkpoint_zoo_layers(model, policies)

    def step() -> Step:
        with sac.offloading():
            return loss_and_grads(model, lambda: model(*inputs))

    return step


def compiled_step(cfg: Any, inputs: tuple, options: dict[str, Any], device: str
                  ) -> Callable[[], Step]:
    """The step compiled by inductor with a planning stage of ``options`` (its plan is the
    CLI's plan of the exported step: the stage's backend plans the graph the export
    exports)."""
    stage = stage_mod.PlanningStage(model_decls(cfg), **options)
    model = CausalLM(cfg).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=stage.backend)

    def step() -> Step:
        with stage:
            return loss_and_grads(model, lambda: compiled(*inputs))

    return step


def measured(label: str, device: str, step: Callable[[], Step], plan: rp.Plan | None
             ) -> tuple[Step, list[str]]:
    """Runs ``step`` twice (a warm-up, then measured) and prints its row; returns its result
    and what failed."""
    step()  # warm-up: lazy initialisation, compilation
    with host_memory.counting() as moved:
        peak, out = peak_of(device, step)
    predicted = plan.memory.peak_bytes if plan is not None else None
    planned_moved = plan.memory.offloaded_bytes if plan is not None else 0
    gap = "" if not predicted else f"{(predicted - peak) / peak:+.1%}"
    print(f"{label:<34} {peak:>14,} {predicted or 0:>14,} {gap:>7} {moved.bytes:>12,} "
          f"{planned_moved:>12,}")
    failures = []
    if moved.bytes != planned_moved:
        failures.append(
            f"{label}: copied {moved.bytes} B to host memory, the plan {planned_moved} B"
        )
    return out, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = args.device
    cfg = dataclasses.replace(entry("dense").config, **SHAPE)
    cpu_inputs = make_inputs(cfg)
    graph = export_joint(CausalLM(cfg), cpu_inputs, name="dense", models=model_decls(cfg)).graph
    inputs = tuple(t.to(device) for t in cpu_inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        kept = rp.plan(graph, "all", executor="eager", offload_prefetch=0)
        offloaded = rp.plan(graph, executor="eager", offload_prefetch=0, **OFFLOAD)
        compiled_plan = rp.plan(graph, executor=stage_mod.EXECUTOR, **OFFLOAD)
    print(f"{'step (' + device + ')':<34} {'peak':>14} {'predicted':>14} {'gap':>7} "
          f"{'host bytes':>12} {'predicted':>12}")
    torch.manual_seed(0)
    failures: list[str] = []
    plain, _ = measured("no checkpointing", device, eager_step(cfg, inputs, None, device), None)
    eager_kept, f1 = measured("eager, keep all", device, eager_step(cfg, inputs, kept, device),
                              kept)
    eager_off, f2 = measured("eager, keep all, offloaded", device,
                             eager_step(cfg, inputs, offloaded, device), offloaded)
    failures += f1 + f2
    if not identical(eager_off, plain) or not identical(eager_kept, plain):
        failures.append("eager: loss or gradients differ from the step without checkpointing")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        compiled_kept, _ = measured(
            "compiled, keep all", device, compiled_step(cfg, inputs, {"keep": "all"}, device),
            None,
        )
        compiled_off, f3 = measured(
            "compiled, keep all, offloaded", device, compiled_step(cfg, inputs, OFFLOAD, device),
            compiled_plan,
        )
    failures += f3
    if not identical(compiled_off, compiled_kept):
        failures.append("compiled: loss or gradients differ from the step without offload")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
