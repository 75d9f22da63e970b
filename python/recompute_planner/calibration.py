"""``recompute_planner.calibrate``: a hardware profile measured in eager PyTorch.

It times the benchmarks ``planner calibrate`` times (the same ops, dtypes, shapes and
repeats: ``_native.calibration_benchmarks``; the smallest op of each class interleaved, as a
model's ops follow one another), each op called through ``torch.ops`` as eager code calls it,
with autograd recording (float inputs require grad, as a training forward's do), and fits the
profile the planner fits to the command's timings. So the profile's op overhead is what eager
PyTorch pays per op in Python, where the command's is what its runtime pays; plan an eager
step (``executor="eager"``, ``recompute_planner.sac``) with this one.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import _native
from .api import HwLike, hw_profile


def calibrate(
    device: str | torch.device = "cpu",
    *,
    repeat: int = 5,
    group: Any = None,
    base: HwLike = None,
    name: str | None = None,
    out: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Measures ``device`` and returns its hardware profile (a dict ``plan(hw=...)`` takes).

    - ``repeat``: runs of each benchmark (at least 3); each timing is their median;
    - ``group``: a ``torch.distributed`` process group whose all-to-all, all-gather and
      reduce-scatter are timed on a CPU (latency and bandwidth of collectives, a line per op);
      without one, and on a GPU, they keep ``base``'s figures;
    - ``base``: the profile whose figures stand for what is not measured (default: the H200);
    - ``name``: the profile's name (default ``calibrated <device>``);
    - ``out``: also write the profile there as JSON (what ``planner plan --hw FILE`` reads).

    The profile lists every timing under ``calibration.timings`` and the fields it did not
    measure under ``calibration.not_measured``.
    """
    if repeat < 3:
        raise ValueError(f"repeat must be at least 3, got {repeat}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    world = _world(group)
    benchmarks = json.loads(_native.calibration_benchmarks(cuda, world))
    mixed = [bench for bench in benchmarks if bench["mixed"]]
    medians: list[float | None] = list(_time_mixed(mixed, device, repeat))
    # A collective's timing includes the wait after it: the fit takes that off.
    medians += [
        _time_checkpointed(bench, device, repeat)
        if bench["checkpointed"]
        else _time(bench, device, repeat, group)
        for bench in benchmarks[len(mixed) :]
    ]
    timed_collectives = any(
        median is not None and bench["op"].startswith("_c10d_functional.")
        for bench, median in zip(benchmarks, medians, strict=True)
    )
    profile_json = _native.fit_calibration(
        cuda=cuda,
        world=world,
        medians=medians,
        runs=repeat,
        device=str(device),
        description=torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        threads=torch.get_num_threads(),
        memory_bytes=_memory_bytes(device),
        base_json=hw_profile(base),
        name=name or f"calibrated {device} (eager)",
        collectives=_group_description(group) if timed_collectives else None,
    )
    profile: dict[str, Any] = json.loads(profile_json)
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=2)
            f.write("\n")
    return profile


def _time_mixed(mixed: list[dict[str, Any]], device: torch.device, repeat: int) -> list[float]:
    """Median seconds of one call of each of ``mixed``'s ops, called in turn (as a model's ops
    follow one another), each call timed on its own."""
    calls = [_call(bench, device, None) for bench in mixed]
    repeats = int(mixed[0]["repeats"]) if mixed else 0
    runs: list[list[float]] = []
    for _ in range(repeat + 1):  # the first run warms caches and kernels: not kept
        totals = [0.0] * len(calls)
        for _ in range(repeats):
            for i, call in enumerate(calls):
                assert call is not None, "the mixed benchmarks hold no collective"
                started = time.perf_counter()
                call()
                totals[i] += time.perf_counter() - started
        _sync(device)
        runs.append([t / repeats for t in totals])
    return [statistics.median(run[i] for run in runs[1:]) for i in range(len(calls))]


def _time(bench: dict[str, Any], device: torch.device, repeat: int, group: Any) -> float | None:
    """Median seconds of one call of the benchmark's op; ``None`` when it cannot run here (a
    collective without a group)."""
    call = _call(bench, device, group)
    if call is None:
        return None
    repeats = int(bench["repeats"])
    times = []
    for _ in range(repeat + 1):  # the first run warms caches and kernels: not kept
        _sync(device)
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        _sync(device)
        times.append((time.perf_counter() - started) / repeats)
    return statistics.median(times[1:])


def _time_checkpointed(bench: dict[str, Any], device: torch.device, repeat: int) -> float | None:
    """Median seconds of one call of the benchmark's op in the forward of a checkpointed
    layer: ``repeats`` calls in a chain, under eager selective checkpointing whose policy
    (``sac.PlanPolicy``) keeps every other op, as a plan's does. ``None`` (the field is then
    listed as not measured) where this torch's checkpointing refuses the chain."""
    from .sac import LayerOps, PlanPolicy, checkpoint_call

    namespace, name, overload = bench["op"].split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    repeats = int(bench["repeats"])
    layer = LayerOps(
        model="calibration",
        layer=0,
        names=tuple(f"op{i}" for i in range(repeats)),
        ops=(bench["op"],) * repeats,
        keep=tuple(i % 2 == 0 for i in range(repeats)),
    )
    dtype = getattr(torch, bench["dtype"])
    x, w = (
        torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
        for shape in bench["inputs"]
    )

    def chain(y: torch.Tensor) -> torch.Tensor:
        for _ in range(repeats):
            y = op(y, w)
        return y

    times = []
    for _ in range(repeat + 1):  # the first run warms caches: not kept
        _sync(device)
        started = time.perf_counter()
        try:
            checkpoint_call(chain, (x,), {}, PlanPolicy(layer))
        except Exception as error:  # the profile keeps the base's figure and says so
            warnings.warn(f"eager checkpointing's cost per op not measured: {error}", stacklevel=3)
            return None
        _sync(device)
        times.append((time.perf_counter() - started) / repeats)
    return statistics.median(times[1:])


def _call(bench: dict[str, Any], device: torch.device, group: Any) -> Callable[[], Any] | None:
    """The op of ``bench`` bound to fresh inputs, as eager code calls it."""
    dtype = getattr(torch, bench["dtype"])
    inputs = [
        torch.randn(shape, dtype=dtype, device=device, requires_grad=dtype.is_floating_point)
        for shape in bench["inputs"]
    ]
    namespace, name, overload = bench["op"].split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    kwargs = dict(bench["attributes"])
    kwargs.pop("absent_tensor_args", None)  # left out: their default is None
    if "device" in kwargs:
        kwargs["device"] = torch.device(kwargs["device"])
    if namespace == "_c10d_functional":
        if group is None:
            return None
        return _collective(op, inputs[0].detach(), group)
    return lambda: op(*inputs, **kwargs)


def _collective(op: Any, x: torch.Tensor, group: Any) -> Callable[[], Any]:
    """``op`` (an all-to-all split evenly, an all-gather or a sum reduce-scatter) of ``x``
    over ``group``, and its wait."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rows = x.shape[0]
    wait = torch.ops._c10d_functional.wait_tensor.default
    name = group.group_name
    if op is torch.ops._c10d_functional.all_to_all_single.default:
        splits = [rows // world] * world
        return lambda: wait(op(x, splits, splits, name))
    if op is torch.ops._c10d_functional.reduce_scatter_tensor.default:
        return lambda: wait(op(x, "sum", world, name))
    if op is torch.ops._c10d_functional.all_gather_into_tensor.default:
        return lambda: wait(op(x, world, name))
    raise ValueError(f"no calibration call for the collective {op}")


def _world(group: Any) -> int:
    """The ranks of ``group``; 2 without one (the benchmarks' collectives are then not run)."""
    if group is None:
        return 2
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _group_description(group: Any) -> str | None:
    """Which process group the collectives were timed through, as the profile records it."""
    if group is None:
        return None
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ranks = "rank" if world == 1 else "ranks"
    return f"{dist.get_backend(group)}, {world} {ranks} (torch.distributed)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_bytes(device: torch.device) -> float | None:
    """The device's memory: a GPU's total, or this machine's."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


__all__ = [
    "calibrate",
]
