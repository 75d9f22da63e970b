"""The golden graphs: rank 0 of every zoo model as `NAME.pb` plus `NAME.safetensors`, and for
a multi-rank model every other rank's tensors as `NAME.rank<r>.safetensors` (and its graph as
`NAME.rank<r>.pb` where it differs from rank 0's in more than the rank number).

Graphs are traced in this process; an expert-parallel model is traced as rank 0 of a fake
process group, which exchanges no real data. The reference tensors (weights, inputs, tangents,
PyTorch's loss and gradients) must be real, so for a multi-rank model the whole export runs on
real gloo ranks, one process per rank, each exporting its own rank's step and tensors; rank 0's
graph must be byte-identical to the fake-group trace (checked).

A device golden (`device` set) is the graph of a GPU run, traced on this CPU-only machine with
fake tensors on that device (`recompute_planner.device_export`): it carries the devices and the
device-to-host copies a CPU trace cannot have. Its tensors are those of the same step exported
and run on this CPU (`with_device_graph`), so the runtime runs and checks it on the CPU like
any golden; tests that compare the graph with the model's own step on this CPU skip it
(`Golden.cpu_step_differs`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

from .._exporter import (
    ExportResult,
    export_forward,
    export_joint,
    same_but_rank,
    torch_dtype,
    write_graph,
    write_reference,
)
from .._exporter import rank_path as rank_file
from ..device_export import (
    export_forward_on_device,
    export_joint_on_device,
    with_device_graph,
)
from ..proto import graph_pb2
from .catalog import ENTRIES, ZooEntry, entry, make_inputs, model_decls
from .config import ZooConfig
from .distributed import fake_process_group, run_on_ranks
from .model import CausalLM


@dataclass(frozen=True)
class Golden:
    """One golden graph: a zoo model exported jointly (forward+backward) or forward-only, on
    this CPU with its reference step or, for a `device` golden, as it runs on that device."""

    name: str
    entry: ZooEntry
    joint: bool = True
    device: str | None = None

    @property
    def world_size(self) -> int:
        return self.entry.config.world_size

    @property
    def summary(self) -> str:
        summary = self.entry.summary if self.joint else f"{self.entry.summary}; forward graph only"
        if self.device is not None:
            summary += f"; as it runs on {self.device}, traced with fake tensors"
        return summary

    @property
    def cpu_step_differs(self) -> str | None:
        """Why the model's step run on this CPU is not this golden's graph, or None."""
        if self.device is None:
            return None
        return (
            f"{self.name} is the graph of a {self.device} run: the model's step on this CPU "
            "dispatches other ops (its own attention kernel, no copies between devices)"
        )


GOLDENS: tuple[Golden, ...] = tuple(Golden(e.name, e) for e in ENTRIES) + (
    Golden("dense_forward", entry("dense"), joint=False),
    Golden("moe_ep2_cuda", entry("moe_ep2"), device="cuda"),
)


def golden(name: str) -> Golden:
    """The golden called `name`; the error lists the valid names."""
    for candidate in GOLDENS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no golden {name!r}; known: {', '.join(g.name for g in GOLDENS)}")


def export_rank(gold: Golden, rank: int = 0) -> ExportResult:
    """Exports `rank`'s step of `gold` under whatever process group is current; a device
    golden's graph comes with the tensors of the same step run on this CPU."""
    cfg = gold.entry.config.for_rank(gold.world_size, rank)
    exporter = export_joint if gold.joint else export_forward
    result = exporter(
        gold.entry.build(rank=rank),
        make_inputs(cfg),
        name=gold.name,
        models=model_decls(cfg),
        world_size=cfg.world_size,
        rank=rank,
    )
    if gold.device is None:
        return result
    return with_device_graph(result, device_graph(gold, gold.device, rank))


def traced_group(world_size: int, rank: int = 0) -> AbstractContextManager[None]:
    """The process group to trace `rank` of a `world_size` model in this process."""
    return fake_process_group(world_size, rank) if world_size > 1 else contextlib.nullcontext()


def trace_graph_bytes(gold: Golden) -> bytes:
    """The `.pb` bytes of rank 0's graph, traced in this process (fake group if multi-rank)."""
    with traced_group(gold.world_size):
        graph = export_rank(gold).graph if gold.device is None else device_graph(gold, gold.device)
        data: bytes = graph.SerializeToString(deterministic=True)
        return data


def trace_for_timing(name: str, cfg: ZooConfig, out_dir: Path) -> Path:
    """A zoo model with ``cfg`` as ``planner run --seed S`` times it, with no reference data:
    every rank's training step traced in this process under a fake process group, written as
    ``NAME.pb`` (and ``NAME.rank<r>.pb`` where rank r's graph differs from rank 0's in more
    than its rank number), beside each rank's tokens and labels (``make_inputs``) and a unit
    loss tangent in ``NAME[.rank<r>].safetensors``; the run fills the weights from its seed.
    Returns rank 0's graph file."""
    from safetensors.torch import save_file

    from ..model_export import export

    out_dir.mkdir(parents=True, exist_ok=True)
    graphs: list[graph_pb2.Graph] = []
    for rank in range(cfg.world_size):
        ranked = cfg.for_rank(cfg.world_size, rank)
        inputs = make_inputs(ranked)
        with traced_group(cfg.world_size, rank):
            graph = export(
                CausalLM(ranked), inputs, models=model_decls(ranked), name=name, fake=True,
                world_size=ranked.world_size, rank=rank,
            ).graph
        if rank == 0 or not same_but_rank(graph, graphs[0]):
            write_graph(graph, rank_path(out_dir, name, rank, "pb"))
        graphs.append(graph)
        data = {f"input/input.{i}": tensor.clone() for i, tensor in enumerate(inputs)}
        data |= {
            f"tangent/{v.name}": torch.ones(list(v.shape), dtype=torch_dtype(v.dtype))
            for v in graph.values
            if v.role == graph_pb2.ROLE_TANGENT
        }
        save_file(data, str(reference_path(out_dir, name, rank)))
    return rank_path(out_dir, name, 0, "pb")


def device_graph(gold: Golden, device: str, rank: int = 0) -> graph_pb2.Graph:
    """Rank `rank`'s graph of `gold`'s model traced with fake tensors on `device`
    (`recompute_planner.device_export`), under whatever process group is current."""
    cfg = gold.entry.config.for_rank(gold.world_size, rank)
    exporter = export_joint_on_device if gold.joint else export_forward_on_device
    return exporter(
        gold.entry.build(rank=rank),
        make_inputs(cfg),
        name=gold.name,
        models=model_decls(cfg),
        device=device,
        world_size=cfg.world_size,
        rank=rank,
    )


def rank_path(out_dir: Path, name: str, rank: int, extension: str) -> Path:
    """Where rank `rank`'s file goes: `NAME.EXT` for rank 0, `NAME.rank<r>.EXT` beside it for
    the others (the runtime reads them from there)."""
    return rank_file(out_dir / f"{name}.{extension}", rank)


def reference_path(out_dir: Path, name: str, rank: int = 0) -> Path:
    """Rank `rank`'s tensors: weights, inputs, tangents and reference."""
    return rank_path(out_dir, name, rank, "safetensors")


def write_golden(result: ExportResult, out_dir: Path) -> None:
    """Writes `NAME.pb` and `NAME.safetensors` for an export result."""
    write_graph(result.graph, out_dir / f"{result.graph.name}.pb")
    write_reference(result, reference_path(out_dir, result.graph.name))


def _export_on_rank(world_size: int, rank: int, names: list[str], out_dir: str) -> None:
    """Body of one real rank: exports each golden's step; rank 0 writes the graph, every rank
    its own tensors (weights, inputs and reference), so each rank of a run computes its shard."""
    for name in names:
        result = export_rank(golden(name), rank)
        if rank == 0:
            write_golden(result, Path(out_dir))
        else:
            write_graph(result.graph, rank_path(Path(out_dir), name, rank, "pb"))
            write_reference(result, reference_path(Path(out_dir), name, rank))


def export_goldens(names: list[str], out_dir: Path) -> None:
    """Writes the named goldens into `out_dir`, multi-rank ones through real gloo ranks.

    Raises if a real rank 0's graph differs from the in-process fake-group trace, since the
    tests regenerate graphs that way.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[str]] = {}
    for name in names:
        by_world.setdefault(golden(name).world_size, []).append(name)
    for world_size, group in sorted(by_world.items()):
        if world_size == 1:
            for name in group:
                write_golden(export_rank(golden(name)), out_dir)
        else:
            run_on_ranks(world_size, _export_on_rank, group, str(out_dir))
            for name in group:
                _check_fake_trace_matches(golden(name), out_dir)
                _drop_rank_graphs_like_rank0(name, world_size, out_dir)


def _drop_rank_graphs_like_rank0(name: str, world_size: int, out_dir: Path) -> None:
    """Keeps `NAME.rank<r>.pb` only where rank r's graph differs from rank 0's in more than
    its rank number (sequence-parallel positions are baked into each rank's graph): the other
    ranks run rank 0's graph on their own tensors."""
    rank0 = graph_pb2.Graph.FromString(rank_path(out_dir, name, 0, "pb").read_bytes())
    for rank in range(1, world_size):
        path = rank_path(out_dir, name, rank, "pb")
        if same_but_rank(graph_pb2.Graph.FromString(path.read_bytes()), rank0):
            path.unlink()


def _check_fake_trace_matches(gold: Golden, out_dir: Path) -> None:
    """Fails when the fake-group trace of rank 0 differs from the real rank's graph."""
    if trace_graph_bytes(gold) != (out_dir / f"{gold.name}.pb").read_bytes():
        raise RuntimeError(
            f"{gold.name}: rank 0's graph traced on real gloo ranks differs from its trace "
            "under the fake process group"
        )
