"""Types of the native extension ``recompute_planner._native`` (PyO3, python/native/src/lib.rs).
``stubtest`` in scripts/test.sh checks them against the built module."""

from collections.abc import Callable
from typing import Any, final

__all__ = [
    "plan",
    "PlannedGraph",
    "WireGraph",
    "build_fx_graph",
    "convert_plan",
    "read_plan_file",
    "collective_kind",
    "interval_contents",
    "hw_profile",
    "calibration_benchmarks",
    "fit_calibration",
    "planner_main",
    "SPELLED_OPTIONS",
    "SPELLED_LIST_OPTIONS",
    "DEFAULT_OFFLOAD_PREFETCH",
    "MARKER_OP",
    "MARKER_NAME_ATTR",
    "PLANNER_VERSION",
    "OPTIMIZED",
    "DESCRIPTORS",
]

SPELLED_OPTIONS: list[tuple[str, str, list[str]]]
SPELLED_LIST_OPTIONS: list[tuple[str, list[str]]]
DEFAULT_OFFLOAD_PREFETCH: int
MARKER_OP: str
MARKER_NAME_ATTR: str
PLANNER_VERSION: str
OPTIMIZED: bool
# (module name, serialized FileDescriptorProto) of graph.proto and plan.proto.
DESCRIPTORS: list[tuple[str, bytes]]

def plan(
    *,
    path: str,
    data: bytes | None = None,
    format: str | None = None,
    graph: WireGraph | None = None,
    keep: list[str],
    recompute_ratio: float,
    collectives_name: str,
    random_ops_name: str,
    executor_name: str,
    budget_size: str | None = None,
    budget_includes: str = "activations",
    granularity: str,
    budget_offload: bool = False,
    fsdp: int = 1,
    optimizer_name: str = "adamw",
    optimizer_state_dtype_name: str = "fp32",
    master_weights: bool = False,
    offload: list[str] = ...,
    offload_kinds: list[str] = ...,
    offload_prefetch: int = ...,
    choices: str | None = None,
    hw_name: str | None = None,
    hw_json: str | None = None,
    hw_path: str | None = None,
) -> PlannedGraph: ...

@final
class PlannedGraph:
    """A plan made in-process with the graph it names; encoded only when asked."""

    def json(self) -> str: ...
    def summary_json(self) -> str: ...
    def pb(self) -> bytes: ...

@final
class WireGraph:
    """An exported graph the FX builder made, held decoded; planned without decoding."""

    @property
    def name(self) -> str: ...
    def pb(self) -> bytes: ...

def build_fx_graph(
    *,
    header: bytes,
    inputs: dict[Any, str],
    ops: list[Any],
    forward: set[Any],
    loss_and_outputs: Callable[[], tuple[Any, list[tuple[Any, int | None]]]],
    context: Any,
) -> tuple[WireGraph, list[tuple[str, int | None]]]: ...
def read_plan_file(path: str, from_format: str, to_format: str) -> bytes: ...
def hw_profile(
    *, name: str | None = None, json: str | None = None, path: str | None = None
) -> str: ...
def calibration_benchmarks(cuda: bool, world: int = 2) -> str: ...
def fit_calibration(
    *,
    cuda: bool,
    medians: list[float | None],
    runs: int,
    device: str,
    description: str,
    threads: int,
    memory_bytes: float | None,
    base_json: str,
    name: str,
    world: int = 2,
    collectives: str | None = None,
) -> str: ...
def planner_main(argv: list[bytes]) -> int: ...
def convert_plan(data: bytes, from_format: str, to_format: str) -> bytes: ...
def collective_kind(op: str) -> str | None: ...
def interval_contents(
    *, data: bytes, format: str, origin: str
) -> list[tuple[str, int, int, str, str, list[str]]]: ...
