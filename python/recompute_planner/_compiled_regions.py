"""Submodules that run under ``torch.compile``, in the two forms users write: ``module.compile()``
(the compiled call set on the instance, ``_compiled_call_impl``) and ``torch.compile(module)``
(an ``OptimizedModule`` in the module's place, holding it as ``_orig_mod``).

Such a submodule is a compiled region: its ops run as compiled code, out of a per-op policy's
reach. The exporter traces its contents as eager ops under ``markers.compiled_region`` named
after the module's path (``traced_as_regions``), exactly what the hand-placed stand-in records,
and eager selective checkpointing follows its calls (``recompute_planner.sac``). Both swap the
module's compiled call on the instance, for the block or until removed, and leave the module,
its hooks and its parameters as they are.

Paths leave out the ``_orig_mod`` parts an ``OptimizedModule`` adds (``plain_path``): a
parameter, a module path or a region is named as in the model without ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from . import markers
from .errors import ExportError

# The attribute an OptimizedModule holds the compiled module in.
ORIG_MOD = "_orig_mod"
# Where a `module.compile()`d module keeps its compiled call, and where an OptimizedModule does.
_COMPILED_CALL = "_compiled_call_impl"
_FORWARD = "forward"

COMPILED_MODEL = (
    "the model itself is compiled (torch.compile(model) or model.compile()), so the whole step "
    "would be one compiled region where nothing can be kept. Fix: export the model as it is "
    "before compiling it and plan the compiled step with the torch.compile stage "
    "(recompute_planner.compile), or compile its submodules (a layer's parts) instead"
)


def plain_path(path: str) -> str:
    """``path`` without the ``_orig_mod`` parts ``torch.compile(module)`` adds."""
    return ".".join(part for part in path.split(".") if part != ORIG_MOD)


def is_compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs compiled code (``module.compile()`` or an
    ``OptimizedModule``)."""
    return _is_optimized_module(module) or module.__dict__.get(_COMPILED_CALL) is not None


def _is_optimized_module(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper. Its class lives in Dynamo, which the
    package does not import (seconds): while Dynamo is not loaded, no module is one."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


Call = Callable[..., Any]


@dataclass(frozen=True)
class CompiledSubmodule:
    """A compiled submodule: its plain path and whether it is the outermost compiled module on
    its path (an inner one runs inside the outer one's compiled code)."""

    path: str
    module: nn.Module
    outermost: bool

    @property
    def _slot(self) -> str:
        return _FORWARD if _is_optimized_module(self.module) else _COMPILED_CALL

    def compiled_call(self) -> Call:
        """What calling the module runs now (its compiled code, or what replaced it)."""
        call: Call = self.module.__dict__[self._slot]
        return call

    def plain_call(self) -> Call:
        """The module's own code: for ``module.compile()`` its ``_call_impl`` (hooks included,
        as the compiled code runs them), for an OptimizedModule the module it wraps."""
        if _is_optimized_module(self.module):
            inner: Call = getattr(self.module, ORIG_MOD)
            return inner
        own: Call = self.module._call_impl
        return own

    def replace(self, call: Call) -> Callable[[], None]:
        """Makes the module run ``call`` instead; returns what puts the call it replaced back,
        unless something replaced ``call`` since (that replacement is left to its own undo)."""
        slot, saved = self._slot, self.compiled_call()
        self.module.__dict__[slot] = call

        def restore() -> None:
            if self.module.__dict__.get(slot) is call:
                self.module.__dict__[slot] = saved

        return restore


def replaced_while(replacements: Iterable[Callable[[], Callable[[], None]]]) -> Callable[[], None]:
    """Makes each replacement (a ``replace`` call to make); returns what undoes them all, in
    reverse order. If one fails, those made are undone before the error propagates."""
    restores: list[Callable[[], None]] = []

    def undo() -> None:
        for restore in reversed(restores):
            restore()

    try:
        for replacement in replacements:
            restores.append(replacement())
    except BaseException:
        undo()
        raise
    return undo


def compiled_submodules(root: nn.Module) -> list[CompiledSubmodule]:
    """Every compiled module under ``root`` (``root`` included, path ``""``), each once, in
    module order."""
    found: list[CompiledSubmodule] = []
    seen: set[int] = set()

    def walk(module: nn.Module, path: str, inside: bool) -> None:
        compiled = is_compiled(module)
        if compiled and id(module) not in seen:
            seen.add(id(module))
            found.append(CompiledSubmodule(plain_path(path), module, outermost=not inside))
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name, inside or compiled)

    walk(root, "", False)
    return found


class _InRegion:
    """A module's own code run inside ``markers.compiled_region(name)``."""

    def __init__(self, call: Call, name: str):
        self.call, self.name = call, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with markers.compiled_region(self.name):
            return self.call(*args, **kwargs)


@contextlib.contextmanager
def traced_as_regions(root: nn.Module) -> Iterator[None]:
    """Inside the block every compiled submodule of ``root`` runs its own code, which a tracer
    then traces op by op (called while tracing, compiled code would run Dynamo on the tracer's
    tensors); the outermost ones inside ``markers.compiled_region(<their path>)``, as the
    stand-in annotation records a region. A compiled ``root`` is an ``ExportError``."""
    compiled = compiled_submodules(root)
    if any(c.path == "" for c in compiled):
        raise ExportError(COMPILED_MODEL)
    undo = replaced_while(
        functools.partial(
            c.replace, _InRegion(c.plain_call(), c.path) if c.outermost else c.plain_call()
        )
        for c in compiled
    )
    try:
        yield
    finally:
        undo()
