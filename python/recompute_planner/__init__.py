"""The recompute planner for PyTorch.

- ``plan(graph, keep=...)``: the Rust planner in-process (``recompute_planner.api``);
  ``load_plan(path)`` reads a ``.json`` / ``.pb`` plan file (``recompute_planner.plans``);
- ``export(model, example_inputs, ...)`` and ``annotate(model, ...)``: a training step of
  your own module as the planner's graph (``recompute_planner.model_export``,
  ``recompute_planner.annotate``);
- ``compile``: the torch.compile planning stage (joint-graph pass, ``partition_fn``);
- ``sac``: eager selective-checkpointing policies from a plan;
- ``markers``, ``zoo``: markers and the model zoo; the low-level exporter is the module
  ``recompute_planner.export`` (``from recompute_planner.export import export_joint``: the
  package attribute ``export`` is the function above).
"""

__version__ = "0.1.0"

from .api import check_plan, plan  # noqa: E402
from .errors import (  # noqa: E402
    ExportError,
    PlannerError,
    PlannerWarning,
    PlanRejected,
    SacMismatchError,
)
from .plans import Plan, load_plan  # noqa: E402
from .annotate import Annotation, annotate  # noqa: E402

# Bound last: importing the submodule `recompute_planner.export` (above, through annotate)
# set the package attribute `export` to it; the public name is the function.
from .model_export import export  # noqa: E402

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
    "Plan",
    "PlanRejected",
    "PlannerError",
    "PlannerWarning",
    "SacMismatchError",
    "annotate",
    "check_plan",
    "export",
    "load_plan",
    "plan",
]
