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

from . import errors
from ._native import PLANNER_VERSION as __version__  # the workspace's Cargo version
from .api import check_plan, plan
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
from .plans import Plan, load_plan

if TYPE_CHECKING:
    from . import compile as compile  # explicit re-exports: public, outside __all__
    from . import markers as markers
    from . import sac as sac
    from ._exporter import ExportResult as ExportResult
    from ._exporter import ModelDecl as ModelDecl
    from .annotate import Annotation as Annotation
    from .annotate import OpInterval as OpInterval
    from .annotate import annotate as annotate
    from .calibration import calibrate as calibrate
    from .model_export import TensorSpec as TensorSpec
    from .model_export import export as export
else:
    # Imported on first use: everything that needs torch. Planning, plans and the errors
    # import without it, so the `planner` command (`_cli`) and a script that only plans start
    # at once. A type checker sees the imports above, and no module __getattr__ that would hide
    # a misspelt name.
    _LAZY_SUBMODULES = ("compile", "markers", "sac")
    _LAZY_NAMES = {
        "ExportResult": "_exporter",
        "ModelDecl": "_exporter",
        "Annotation": "annotate",
        "OpInterval": "annotate",
        "annotate": "annotate",
        "calibrate": "calibration",
        "TensorSpec": "model_export",
        "export": "model_export",
    }

    def __getattr__(name: str) -> object:
        import importlib

        if name in _LAZY_SUBMODULES:
            return importlib.import_module(f".{name}", __name__)
        if name in _LAZY_NAMES:
            value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    import sys as _sys
    import types as _types

    class _Package(_types.ModuleType):
        """This package: importing its submodule ``annotate`` (which the import system then
        sets as the package's attribute) leaves ``recompute_planner.annotate`` the function,
        as an eager ``from .annotate import annotate`` would."""

        def __setattr__(self, name: str, value: object) -> None:
            if name in _LAZY_NAMES and isinstance(value, _types.ModuleType):
                return
            super().__setattr__(name, value)

    _sys.modules[__name__].__class__ = _Package


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
