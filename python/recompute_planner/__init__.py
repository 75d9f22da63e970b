"""The recompute planner for PyTorch.

- ``plan(graph, keep=...)``: the Rust planner in-process, ``check_plan`` its diagnostics;
  ``load_plan(path)`` reads a ``.json`` / ``.pb`` plan file; both give a ``Plan``;
- ``export(model, example_inputs, ...)``: one training step of your own module as the
  planner's graph (an ``ExportResult``: ``.graph``, ``.write(path)``); ``annotate(model, ...)``
  places its layer scopes and unit markers (an ``Annotation``; units by submodule, method or
  ``OpInterval``), or ``markers`` in the source with ``models=[ModelDecl(...)]``;
  ``TensorSpec`` is an input by shape and dtype;
- ``calibrate(device)``: a hardware profile measured in eager PyTorch, for ``plan(hw=...)``;
- ``compile``: the torch.compile planning stage (joint-graph pass, ``partition_fn``);
- ``sac``: eager selective-checkpointing policies from a plan (``sac.checkpoint_layers``);
- ``errors``: ``PlannerError``, ``PlanRejected``, ``ExportError``, ``SacMismatchError``, and
  ``PlannerWarning``, which every warning of the package derives from (also importable from
  here).

Every public module lists its names in ``__all__``.

Modules whose names start with ``_`` (the low-level exporter, the test model zoo, the
allocator measurements) are the package's own and may change without notice.
"""

from typing import TYPE_CHECKING

from . import errors, markers
from ._exporter import ExportResult, ModelDecl
from ._native import PLANNER_VERSION as __version__  # the workspace's Cargo version
from .annotate import Annotation, OpInterval, annotate
from .api import check_plan, plan
from .calibration import calibrate
from .errors import (
    ArgumentsHeldWarning,
    ExportError,
    KvCacheOffWarning,
    NoLayersWarning,
    OwnCheckpointingWarning,
    PlannerError,
    PlannerWarning,
    PlanRejected,
    SacMismatchError,
)
from .model_export import TensorSpec, export
from .plans import Plan, load_plan

if TYPE_CHECKING:
    from . import compile as compile  # explicit re-exports: public, outside __all__
    from . import sac as sac
else:
    # Imported on first use: they pull in torch's compiler and checkpoint machinery. Not in
    # __all__, so `import *` neither loads them nor shadows the builtin `compile`. (A type
    # checker sees the imports above, and no module __getattr__ that would hide a misspelt
    # name.)
    _LAZY_SUBMODULES = ("compile", "sac")

    def __getattr__(name: str) -> object:
        if name in _LAZY_SUBMODULES:
            import importlib

            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Annotation",
    "ArgumentsHeldWarning",
    "ExportError",
    "ExportResult",
    "KvCacheOffWarning",
    "ModelDecl",
    "NoLayersWarning",
    "OpInterval",
    "OwnCheckpointingWarning",
    "Plan",
    "PlanRejected",
    "PlannerError",
    "PlannerWarning",
    "SacMismatchError",
    "TensorSpec",
    "__version__",
    "annotate",
    "calibrate",
    "check_plan",
    "errors",
    "export",
    "load_plan",
    "markers",
    "plan",
]
