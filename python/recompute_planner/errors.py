"""The exceptions and warnings of the planner in Python.

Errors of the Rust side (an invalid graph, an unknown unit, an infeasible budget, a plan made
for another graph) raise ``PlannerError``: its message is the text the ``planner`` CLI prints
after ``error:``, and ``code`` names the kind of failure. A plan with an error-level
diagnostic (``inplace-in-kept-interval``) is rejected with ``PlanRejected``, a
``PlannerError`` whose code is the diagnostic's. Warning-level diagnostics are issued as
``PlannerWarning`` warnings; the package's other warnings derive from it (an export without
layers, a model's own checkpointing turned off, arguments held by this process, a KV cache
turned off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plans import Diagnostic, Plan


class PlannerError(Exception):
    """A failure of the planner: ``str(error)`` is the CLI's ``error:`` text.

    ``code``: ``invalid-graph``, ``unknown-unit``, ``invalid-keep``, ``invalid-ratio``,
    ``invalid-option``, ``budget-infeasible``, ``budget-needs-joint-graph``,
    ``too-many-units``, ``invalid-plan``, ``graph-mismatch``, ``internal-error``, or the code
    of an error diagnostic. ``hint`` says what to do, when the planner knows.
    """

    def __init__(self, message: str, code: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.hint = hint


class PlanRejected(PlannerError):
    """The plan has error-level diagnostics: the configuration does not do what was asked.

    The message and code are the first error's, as the CLI prints them
    (``<code>: <message>``); ``diagnostics`` lists every error and ``plan`` is the plan.
    """

    def __init__(self, plan: Plan, errors: list[Diagnostic]):
        first = errors[0]
        super().__init__(f"{first.code}: {first.message}", first.code, first.hint)
        self.plan = plan
        self.diagnostics = errors


class PlannerWarning(UserWarning):
    """Every warning of the package derives from it (``warnings.simplefilter("error",
    PlannerWarning)`` turns them all into errors). Issued as itself, it is a warning-level
    diagnostic of a plan: ``<code>: <message> (hint: <hint>)``."""


class NoLayersWarning(PlannerWarning):
    """The export declares no decoder layers: a plan of it can only be no checkpointing."""


class OwnCheckpointingWarning(PlannerWarning):
    """The model checkpoints its layers itself; the export turns it off to trace the step
    the planner plans."""


class ArgumentsHeldWarning(PlannerWarning):
    """This process keeps every call's arguments alive until the call returns (after a
    ``torch.compile`` that raised): the export's eager releases are later than in training."""


class KvCacheOffWarning(PlannerWarning):
    """The model's KV cache is turned off while its layers are checkpointed."""


class SacMismatchError(RuntimeError):
    """The model's eager op stream does not match the graph a plan was made for."""


class ExportError(RuntimeError):
    """A model could not be exported. The message's first line names the cause and the fix;
    for a tracing failure, what torch logged while tracing follows it."""


__all__ = [
    "ArgumentsHeldWarning",
    "ExportError",
    "KvCacheOffWarning",
    "NoLayersWarning",
    "OwnCheckpointingWarning",
    "PlanRejected",
    "PlannerError",
    "PlannerWarning",
    "SacMismatchError",
]
