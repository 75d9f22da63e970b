#!/usr/bin/env python3
"""First training step of ``torch.compile`` end to end: with the planning stage, without
checkpointing, and over torch's own checkpointing.

A user sees the first step, not the partition: Dynamo, AOTAutograd's trace of the joint graph,
the partition and code generation all happen there. This script compiles one training step of a
dense decoder (``--layers`` layers, annotated with ``recompute_planner.annotate``) three ways,
each in a fresh Python process (no Dynamo cache, no warm import shared between them):

- ``plain``: ``torch.compile`` without checkpointing, partitioned by torch's min-cut partitioner;
- ``torch-ckpt``: every layer under ``torch.utils.checkpoint`` (non-reentrant), partitioned by
  torch's min-cut partitioner;
- ``stage``: the planning stage installed (``recompute_planner.compile.planning``), partitioned
  from the plan (``--keep``, whole-layer recompute by default, as ``torch-ckpt`` does).

The backend is AOTAutograd with a compiler that returns the graph as it is (no code generation,
so the table is the tracing and partitioning a compile adds, not inductor's C++ compiler). Each
row gives the first step (forward + backward, from the first call to the gradients), split into
Dynamo (the forward's first call less the backend), AOTAutograd's trace (the backend less the
partition), the partition and the first backward, each with the garbage collector's share (a
full collection of a compile's heap takes tenths of a second and lands in whichever phase
triggers it); then the median of ``--steps`` later steps, and whether those later steps
recompiled; then the ratios, and which of the stage's targets (``TARGETS``) they meet. Every
figure is the median of ``--runs`` processes per variant, run interleaved (one
process's first step varies by 10% or more on a shared machine). Loss and gradients are compared
bitwise across the three variants (each process computes the same ones).

    source scripts/env.sh
    python scripts/compile_first_step.py [--layers 12 60 120] [--runs 3] [--keep none]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "torch-ckpt", "stage")
DEFAULT_LAYERS = [12, 60, 120]
DEFAULT_STEPS = 3
DEFAULT_RUNS = 3


# --------------------------------------------------------------------------------------------
# The model (built in the child process)


def build_model(layers: int, hidden: int, heads: int) -> Any:
    """A dense pre-norm decoder: RMSNorm, causal self-attention (SDPA), SwiGLU MLP."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.out = nn.Linear(hidden, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, heads, hidden // heads).unbind(2)
            y = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            return self.out(y.transpose(1, 2).reshape(b, s, hidden))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, 4 * hidden, bias=False)
            self.up = nn.Linear(hidden, 4 * hidden, bias=False)
            self.down = nn.Linear(4 * hidden, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = nn.RMSNorm(hidden)
            self.attn = Attention()
            self.mlp_norm = nn.RMSNorm(hidden)
            self.mlp = Mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.RMSNorm(hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.norm(x).square().mean()

    torch.manual_seed(0)
    return Decoder()


def checkpointed(model: Any) -> None:
    """Every layer of ``model`` under ``torch.utils.checkpoint`` (non-reentrant)."""
    import torch.utils.checkpoint as ckpt

    for layer in model.layers:
        inner = layer.forward
        layer.forward = lambda x, inner=inner: ckpt.checkpoint(inner, x, use_reentrant=False)


# --------------------------------------------------------------------------------------------
# One variant, in the child process


class GcClock:
    """Seconds Python's garbage collector has run since installed. A full collection of a
    compile's heap takes a few tenths of a second and lands in whichever phase triggers it,
    so the report gives each phase's share."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


@dataclass
class Clock:
    """Seconds spent inside the wrapped calls, and the garbage collector's share of them."""

    gc_clock: GcClock
    seconds: float = 0.0
    gc_seconds: float = 0.0
    calls: int = 0

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, gc_start = time.perf_counter(), self.gc_clock.seconds
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.gc_seconds += self.gc_clock.seconds - gc_start
                self.calls += 1

        return timed


def run_variant(variant: str, args: argparse.Namespace, out: Path) -> None:
    """Compiles and runs ``variant``; writes its timings, loss and gradients to ``out``."""
    import torch
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    import recompute_planner as rp

    torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.hidden, args.heads)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    if variant == "torch-ckpt":
        checkpointed(model)

    def as_is(graph_module: Any, _inputs: Any) -> Any:
        return make_boxed_func(graph_module.forward)

    gc_clock = GcClock()
    backend_clock, partition_clock = Clock(gc_clock), Clock(gc_clock)
    stage = None
    if variant == "stage":
        annotation = rp.annotate(
            model, layers="layers", units={"SAVE_ATTN": ["attn"], "SAVE_MLP": ["mlp"]}
        )
        stage = rp.compile.planning(annotation.models, keep=args.keep)
        partition_fn = stage.__enter__().partition_fn
    else:
        partition_fn = min_cut_rematerialization_partition
    backend = backend_clock.wrap(
        aot_autograd(
            fw_compiler=as_is, bw_compiler=as_is, partition_fn=partition_clock.wrap(partition_fn)
        )
    )
    compiled = torch.compile(model, backend=backend)

    gc.collect()
    start, gc_start = time.perf_counter(), gc_clock.seconds
    loss = compiled(x)
    forward_s, forward_gc_s = time.perf_counter() - start, gc_clock.seconds - gc_start
    forward_backend_s, forward_partition_s = backend_clock.seconds, partition_clock.seconds
    loss.backward()
    first_step_s, first_step_gc_s = time.perf_counter() - start, gc_clock.seconds - gc_start
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    first_loss = loss.detach().clone()

    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    steps = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        compiled(x).backward()
        steps.append(time.perf_counter() - start)
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before
    if stage is not None:
        stage.__exit__(None, None, None)

    torch.save({"loss": first_loss, "grads": grads}, out.with_suffix(".pt"))
    out.write_text(json.dumps({
        "variant": variant,
        "first_step_s": first_step_s,
        "first_step_gc_s": first_step_gc_s,
        "dynamo_s": forward_s - forward_backend_s,
        "dynamo_gc_s": forward_gc_s - backend_clock.gc_seconds,
        "aot_trace_s": forward_backend_s - forward_partition_s,
        "aot_trace_gc_s": backend_clock.gc_seconds - partition_clock.gc_seconds,
        "partition_s": forward_partition_s,
        "partition_gc_s": partition_clock.gc_seconds,
        "first_backward_s": first_step_s - forward_s,
        "first_backward_gc_s": first_step_gc_s - forward_gc_s,
        "step_s": statistics.median(steps) if steps else float("nan"),
        "recompiled_graphs": recompiled,
        "backend_calls": backend_clock.calls,
    }))


# --------------------------------------------------------------------------------------------
# The parent: one child per variant and depth, then the table


def measure(variant: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{variant}-{args.layers}.json"
    command = [sys.executable, __file__, "--child", variant, "--out", str(out),
               *child_options(args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at {args.layers} layers failed:\n{done.stderr}")
    return json.loads(out.read_text())


def child_options(args: argparse.Namespace) -> list[str]:
    return [
        "--layers", str(args.layers), "--keep", args.keep, "--steps", str(args.steps),
        "--hidden", str(args.hidden), "--heads", str(args.heads), "--batch", str(args.batch),
        "--seq", str(args.seq), "--threads", str(args.threads),
    ]


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (recompiles: the most any run had)."""
    row = {key: statistics.median(run[key] for run in runs) for key in runs[0]
           if isinstance(runs[0][key], float)}
    row["recompiled_graphs"] = max(run["recompiled_graphs"] for run in runs)
    row["backend_calls"] = max(run["backend_calls"] for run in runs)
    return row


def same_results(workdir: Path, layers: int) -> str:
    """Whether every variant's loss and gradients equal ``plain``'s, bit for bit."""
    import torch

    runs = {v: torch.load(workdir / f"{v}-{layers}.pt") for v in VARIANTS}
    reference = runs["plain"]
    differing = [
        variant for variant, run in runs.items()
        if not torch.equal(run["loss"], reference["loss"])
        or any(not torch.equal(run["grads"][k], g) for k, g in reference["grads"].items())
    ]
    return "bitwise equal" if not differing else f"DIFFER: {', '.join(differing)}"


def report(layers: int, rows: dict[str, dict[str, Any]], equal: str) -> str:
    lines = [
        f"\n{layers} layers (loss and gradients {equal}; in parentheses: garbage collection)",
        "| variant | first step | Dynamo | AOT trace | partition | first backward | later step "
        "| recompiles |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        row = rows[variant]
        phases = " | ".join(
            f"{row[f'{phase}_s']:.2f} s ({row[f'{phase}_gc_s']:.2f})"
            for phase in ("first_step", "dynamo", "aot_trace", "partition", "first_backward")
        )
        lines.append(
            f"| {variant} | {phases} | {row['step_s'] * 1e3:.1f} ms | "
            f"{row['recompiled_graphs']} |"
        )
    stage, plain, ckpt = (rows[v] for v in ("stage", "plain", "torch-ckpt"))
    lines.append(
        f"first step: stage / plain = {stage['first_step_s'] / plain['first_step_s']:.2f}, "
        f"torch-ckpt / stage = {ckpt['first_step_s'] / stage['first_step_s']:.2f}x; "
        f"Dynamo: stage / plain = {stage['dynamo_s'] / plain['dynamo_s']:.2f}; "
        f"partition: torch-ckpt / stage = {ckpt['partition_s'] / stage['partition_s']:.1f}x"
    )
    lines.append(targets(rows))
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """A ratio of two variants' times of one phase, and the bound the stage is meant to keep."""

    phase: str  # a row key: "first_step_s", ...
    over: str  # the variant divided
    under: str  # the variant it is divided by
    bound: float
    at_most: bool  # the ratio must be at most the bound (else at least)

    def verdict(self, rows: dict[str, dict[str, Any]]) -> str:
        ratio = rows[self.over][self.phase] / rows[self.under][self.phase]
        met = ratio <= self.bound if self.at_most else ratio >= self.bound
        return (
            f"{self.phase.removesuffix('_s')} {self.over} / {self.under} "
            f"{'<=' if self.at_most else '>='} {self.bound:g}: "
            f"{'met' if met else 'MISSED'} ({ratio:.2f})"
        )


# First step within 5% of plain torch.compile, Dynamo within 10%, at least 1.3x faster than
# torch.compile over torch's checkpointing (meant at 60 layers and more), partition at least
# 10x faster than min-cut.
TARGETS = (
    Target("first_step_s", "stage", "plain", 1.05, at_most=True),
    Target("dynamo_s", "stage", "plain", 1.10, at_most=True),
    Target("first_step_s", "torch-ckpt", "stage", 1.3, at_most=False),
    Target("partition_s", "torch-ckpt", "stage", 10.0, at_most=False),
)


def targets(rows: dict[str, dict[str, Any]]) -> str:
    """Each target, met or missed, at one depth."""
    return "targets: " + "; ".join(target.verdict(rows) for target in TARGETS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=DEFAULT_LAYERS)
    parser.add_argument("--keep", default="none", help="the stage's keep (default: none)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help="processes per variant and depth; the table gives medians")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="later steps timed (median)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per child (default 1: the children run one at a time)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@dataclass
class Depth:
    """Every variant's row at one depth, and whether their results agree bit for bit."""

    layers: int
    rows: dict[str, dict[str, Any]]
    equal: str


def main(argv: list[str] | None = None) -> list[Depth]:
    args = parse_args(argv)
    if args.child is not None:
        args.layers = args.layers[0]
        run_variant(args.child, args, args.out)
        return []
    import torch

    print(f"torch {torch.__version__}; load {os.getloadavg()[0]:.2f} at the start", flush=True)
    depths = []
    with tempfile.TemporaryDirectory(prefix="compile-first-step-") as workdir:
        for layers in args.layers:
            args_at = argparse.Namespace(**{**vars(args), "layers": layers})
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for _ in range(args.runs):  # interleaved, so drift in the machine's speed is shared
                for variant in VARIANTS:
                    runs[variant].append(measure(variant, args_at, Path(workdir)))
            rows = {variant: median_row(measured) for variant, measured in runs.items()}
            depths.append(Depth(layers, rows, same_results(Path(workdir), layers)))
            print(report(layers, rows, depths[-1].equal), flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    return depths


if __name__ == "__main__":
    main()
