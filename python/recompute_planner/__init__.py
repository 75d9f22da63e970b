"""The recompute planner for PyTorch.

- ``plan(graph, keep=...)``: the Rust planner in-process (``recompute_planner.api``);
  ``load_plan(path)`` reads a ``.json`` / ``.pb`` plan file (``recompute_planner.plans``);
- ``export(model, example_inputs, ...)`` and ``annotate(model, ...)`` (units by submodule,
  method or ``OpInterval``): a training step of your own module as the planner's graph
  (``recompute_planner.model_export``, ``recompute_planner.annotate``);
- ``compile``: the torch.compile planning stage (joint-graph pass, ``partition_fn``);
- ``sac``: eager selective-checkpointing policies from a plan;
- ``markers``, ``zoo``: markers and the model zoo; ``recompute_planner.export`` is also the
  module of the low-level exporter (``export_joint``, ``write_graph``), callable as above.
"""

from ._native import PLANNER_VERSION as __version__  # the workspace's Cargo version
from .api import check_plan, plan  # noqa: E402
from .errors import (  # noqa: E402
    ExportError,
    PlannerError,
    PlannerWarning,
    PlanRejected,
    SacMismatchError,
)
from .plans import Plan, load_plan  # noqa: E402
from .annotate import Annotation, OpInterval, annotate  # noqa: E402

from . import export as _exporter  # noqa: E402
from .model_export import TensorSpec  # noqa: E402
from .model_export import export as _export_model  # noqa: E402


class _CallableModule(type(_exporter)):
    """The module ``recompute_planner.export`` (the low-level exporter), callable as
    ``recompute_planner.export(model, example_inputs, ...)`` (``model_export.export``): one
    name for both, so neither hides the other."""

    def __call__(self, *args, **kwargs):
        return _export_model(*args, **kwargs)


_exporter.__class__ = _CallableModule

# Imported on first use: they pull in torch's compiler and checkpoint machinery.
_LAZY_SUBMODULES = ("compile", "sac", "measure", "zoo")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Annotation",
    "ExportError",
    "OpInterval",
    "Plan",
    "PlanRejected",
    "PlannerError",
    "PlannerWarning",
    "SacMismatchError",
    "TensorSpec",
    "annotate",
    "check_plan",
    "export",
    "load_plan",
    "plan",
]
