"""Small models and helpers shared by the exporter tests (not a test module itself)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import python_fx_builder
from recompute_planner._exporter import ModelDecl
from recompute_planner.markers import checkpoint_record, compiled_region, layer_scope
from recompute_planner.proto import graph_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PHASE_FORWARD = graph_pb2.PHASE_FORWARD
PHASE_BACKWARD = graph_pb2.PHASE_BACKWARD

UNITS = {
    "SAVE_ATTN": [("attn.begin", "attn.end")],
    "SAVE_MLP": [("mlp.begin", "mlp.end")],
}


class Block(nn.Module):
    """A pre-norm decoder layer: RMSNorm, SDPA attention between markers, LayerNorm, an MLP
    in a compiled region, and an in-place op on an intermediate."""

    def __init__(self, dim: int, index: int):
        super().__init__()
        self.index = index
        self.norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.ln = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        with layer_scope("main", self.index):
            h = checkpoint_record("attn.begin", self.norm(x))
            q, k, v = self.qkv(h).view(batch, seq, 3, 2, dim // 2).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(batch, seq, dim))
            x = checkpoint_record("attn.end", x)
            h = checkpoint_record("mlp.begin", self.ln(x))
            with compiled_region("mlp"):
                h = self.down(F.silu(self.up(h)))
            h = h.clone()
            h.mul_(0.5)
            return checkpoint_record("mlp.end", x + h)


class TinyDecoder(nn.Module):
    """Embedding, two Blocks, a head and cross-entropy: returns the scalar loss."""

    def __init__(self, dim: int = 8, vocab: int = 16, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, i) for i in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def tiny_decoder() -> tuple[TinyDecoder, tuple[torch.Tensor, torch.Tensor], list[ModelDecl]]:
    """A seeded TinyDecoder, its inputs and its model declaration."""
    torch.manual_seed(0)
    model = TinyDecoder()
    tokens = torch.randint(0, 16, (2, 4))
    targets = torch.randint(0, 16, (2, 4))
    return model, (tokens, targets), [ModelDecl("main", 2, UNITS)]


class Lambda(nn.Module):
    """A one-linear module whose forward is ``fn(self, x)``: quick single-op probes."""

    def __init__(self, fn, dim: int = 4):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


MAIN = [ModelDecl("main", 1, {})]
# One checkpointed layer with an attention interval, for the phase patterns below.
ONE_LAYER = [ModelDecl("main", 1, {"SAVE_ATTN": [("attn.begin", "attn.end")]})]


def buffer_fill_step(self: Lambda, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's key expansion in miniature: a buffer from `new_empty` filled slice by
    slice with `copy_`, then read by a later forward op. What is copied in reaches the loss
    only through the writes."""
    with layer_scope("main", 0):
        h = checkpoint_record("attn.begin", self.lin(x))
        k = h.new_empty(h.shape[0], h.shape[1] + 2)
        k[:, : h.shape[1]] = h
        k[:, h.shape[1] :] = torch.tanh(h[:, :2])
        out = checkpoint_record("attn.end", k * 2)
    with layer_scope("main", None):
        return out.sum()


def one_hot_step(self: Lambda, x: torch.Tensor) -> torch.Tensor:
    """Routing through `F.one_hot` after range checks of the indices (`ge`, `lt`, `all`,
    `_assert_async`, as ATen's `one_hot` traces them on fake tensors), which have no path to
    the loss."""
    with layer_scope("main", 0):
        h = torch.tanh(self.lin(x))
        choice = h.argmax(dim=-1)
        torch._assert_async((choice >= 0).all(), "class values must be non-negative")
        torch._assert_async((choice < h.shape[-1]).all(), "class values must be in range")
        route = F.one_hot(choice, h.shape[-1]).to(h.dtype)
        out = h * route
    with layer_scope("main", None):
        return out.sum()


def nodes_with_op(graph, op: str) -> list:
    return [n for n in graph.nodes if n.op == op]


def only_node(graph, op: str):
    found = nodes_with_op(graph, op)
    assert len(found) == 1, f"expected one {op} node, found {[n.name for n in found]}"
    return found[0]


def consumers(graph, value: str) -> list:
    return [n for n in graph.nodes if value in n.inputs]


def values_by_name(graph) -> dict:
    return {v.name: v for v in graph.values}


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of the "fake" backend (no communication), torn down after.

    One another test left initialised is reused when its world size matches.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            pytest.skip("a default process group of another world size is initialised")
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@functools.cache
def planner_bin() -> Path:
    """The `planner` binary: $PLANNER_BIN, else built with cargo in the repository root."""
    if os.environ.get("PLANNER_BIN"):
        return Path(os.environ["PLANNER_BIN"])
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not on PATH and PLANNER_BIN is unset: cannot run the Rust loader")
    build = subprocess.run(
        ["cargo", "build", "-q", "-p", "planner-cli"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert build.returncode == 0, f"cargo build -p planner-cli failed:\n{build.stderr}"
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO_ROOT / "target"))
    return target / "debug" / "planner"


def run_planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(planner_bin()), *args], capture_output=True, text=True)


def planner_run(*args: str) -> subprocess.CompletedProcess:
    """`planner run ARGS`; skips the test when the planner was built without the runtime
    (the test command builds it with `--features run`)."""
    done = run_planner("run", *args)
    if "built without the runtime" in done.stderr:
        pytest.skip("this planner has no `run` (build it with --features run)")
    return done


def check_builders_agree(monkeypatch: pytest.MonkeyPatch) -> list:
    """From now on, the op nodes of every graph the exporter builds are converted by the
    native builder and again by the Python builder the tests keep as its reference
    (python_fx_builder.py): both must give the same bytes (and the native graph's own encoding,
    which its fingerprint hashes, too) and the same outputs. Returns the list of graphs built,
    which grows as they are."""
    from recompute_planner import _exporter, _native

    native, built = _native.build_fx_graph, []

    def checked(*, context, **arguments):
        wire, listed = native(context=context, **arguments)
        models = [_exporter.ModelDecl(name, num_layers=layers, units={})
                  for name, layers in context.models.items()]
        reference, outputs = python_fx_builder.build_fx_graph(**arguments, models=models)
        expected = reference.SerializeToString(deterministic=True)
        assert wire.pb() == expected
        assert listed == outputs
        built.append(wire)
        return wire, listed

    monkeypatch.setattr(_native, "build_fx_graph", checked)
    return built


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/NAME.py`` imported as the module ``NAME`` while the block runs."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
