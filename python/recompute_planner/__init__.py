"""The recompute planner for PyTorch.

- ``plan(graph, keep=...)``: the Rust planner in-process (``recompute_planner.api``);
  ``load_plan(path)`` reads a ``.json`` / ``.pb`` plan file (``recompute_planner.plans``);
- ``export(model, example_inputs, ...)`` and ``annotate(model, ...)``: a training step of
  your own module as the planner's graph (``recompute_planner.user_export``,
  ``recompute_planner.annotate``);
- ``compile``: the torch.compile planning stage (joint-graph pass, ``partition_fn``);
- ``sac``: eager selective-checkpointing policies from a plan;
- ``markers``, ``export``, ``zoo``: markers, the low-level exporter, the model zoo.
"""

__version__ = "0.1.0"

from .api import check_plan, plan  # noqa: E402
from .errors import PlannerError, PlannerWarning, PlanRejected, SacMismatchError  # noqa: E402
from .plans import Plan, load_plan  # noqa: E402

__all__ = [
    "Plan",
    "PlanRejected",
    "PlannerError",
    "PlannerWarning",
    "SacMismatchError",
    "check_plan",
    "load_plan",
    "plan",
]
