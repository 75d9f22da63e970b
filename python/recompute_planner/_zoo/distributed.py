"""Process groups for the zoo: a fake one for export, real gloo ranks for reference data.

The exported graph of an expert-parallel model is one rank's, traced in a single process with
torch's fake process group (functional collectives trace, but exchange no real data). The
reference loss and gradients the runtime checks against come from the same eager step run on
real ranks: one process per rank over gloo.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.multiprocessing.spawn import spawn

from ..expert_parallel import fake_process_group

__all__ = ["fake_process_group"]  # the library's, for the zoo's exports


def world_group() -> dist.ProcessGroup:
    """The group every zoo collective runs over: the whole world (EP and SP share it)."""
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("the zoo's collectives run under a process group: none is set up")
    return group


def all_to_all(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """Differentiable functional all-to-all of `chunks` equal slices of `x`'s dim 0.

    Traces as `_c10d_functional.all_to_all_single.default` + `wait_tensor.default`; backward
    runs the reverse all-to-all.
    """
    splits = [x.shape[0] // chunks] * chunks
    return funcol.all_to_all_single(x, splits, splits, world_group())


def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Differentiable functional all-gather along `dim` (backward: reduce-scatter)."""
    return funcol.all_gather_single(x, dim, world_group())


def to_host(x: torch.Tensor) -> torch.Tensor:
    """Device-to-host copy of routing counts, as the explicit `aten._to_copy` with a device.

    `x.to("cpu")` on a CPU tensor returns `x` itself and records nothing; the explicit op keeps
    the copy in the graph on CPU exactly as it appears on GPU.
    """
    host: torch.Tensor = torch.ops.aten._to_copy.default(x, device=torch.device("cpu"))
    return host


def _free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
) -> None:
    """Body of one spawned rank: joins the gloo group, runs `fn`, saves its result."""
    torch.set_num_threads(1)  # ranks share the machine's cores; one thread each is enough
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = fn(world_size, rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # No rank tears its group down while another is still exchanging with it: once, under
        # a loaded machine, a rank aborted in teardown ("terminate called without an active
        # exception", SIGABRT) while the other was finishing.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Runs `fn(world_size, rank, *args)` on `world_size` real gloo ranks; returns each result.

    `fn` must be a module-level function (it is pickled into spawned processes) and its result
    must be `torch.save`-able. A failing rank raises here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(
            _rank_main,
            args=(world_size, _free_port(), fn, args, out_dir),
            nprocs=world_size,
            join=True,
        )
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
