"""Annotating a model you did not write: layer scopes and unit markers from module hooks.

``annotate(model, layers="model.layers", units={"SAVE_ATTN": ["self_attn"], ...})`` installs
forward hooks, no source edit:

- on each module of the ``layers`` list (a dotted attribute path to an ``nn.ModuleList``),
  a pre-hook entering ``layer_scope(name, i)`` and a hook leaving it, so every op of layer
  ``i`` belongs to it;
- on each unit's submodules (paths relative to a layer: ``"self_attn"``, ``"mlp.gate"``), a
  pre-hook putting the marker ``<path>.begin`` on the module's (first) tensor input and a hook
  putting ``<path>.end`` on its tensor outputs, so the unit's interval encloses exactly that
  module's ops.

It returns an ``Annotation``: the ``ModelDecl`` list the exporter and the compile stage need
(``.models``) and ``.remove()`` to take the hooks off again. ``recompute_planner.export``
finds the annotation of an annotated model by itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .export import ModelDecl
from .markers import checkpoint_record, layer_scope

# The attribute an annotated model carries its annotation in.
ANNOTATION_ATTR = "_recompute_planner_annotation"


@dataclass
class Annotation:
    """What ``annotate`` installed: the declared models and the hooks."""

    models: list[ModelDecl]
    handles: list[RemovableHandle] = field(default_factory=list, repr=False)
    root: nn.Module | None = field(default=None, repr=False)

    def remove(self) -> None:
        """Removes every hook ``annotate`` installed."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.root is not None and getattr(self.root, ANNOTATION_ATTR, None) is self:
            delattr(self.root, ANNOTATION_ATTR)


def annotate(
    model: nn.Module,
    layers: str = "model.layers",
    units: dict[str, list[str]] | None = None,
    *,
    name: str = "main",
) -> Annotation:
    """Installs layer scopes and unit markers on ``model`` (see the module docstring)."""
    existing = getattr(model, ANNOTATION_ATTR, None)
    if existing is not None:
        raise ValueError("the model is annotated already: call .remove() on its annotation first")
    layer_list = _layer_list(model, layers)
    units = {unit.upper(): list(paths) for unit, paths in (units or {}).items()}
    annotation = Annotation(
        models=[ModelDecl(name, len(layer_list), _unit_intervals(units))], root=model
    )
    for index, layer in enumerate(layer_list):
        annotation.handles += _scope_hooks(layer, name, index)
        for unit, paths in units.items():
            for path in paths:
                annotation.handles += _marker_hooks(_submodule(layer, path, unit, index), path)
    setattr(model, ANNOTATION_ATTR, annotation)
    return annotation


def annotation_of(model: nn.Module) -> Annotation | None:
    """The annotation ``annotate`` installed on ``model``, if any."""
    return getattr(model, ANNOTATION_ATTR, None)


def _unit_intervals(units: dict[str, list[str]]) -> dict[str, list[tuple[str, str]]]:
    return {unit: [(f"{p}.begin", f"{p}.end") for p in paths] for unit, paths in units.items()}


def _layer_list(model: nn.Module, path: str) -> nn.ModuleList:
    found: Any = model
    for part in path.split("."):
        if not hasattr(found, part):
            children = ", ".join(n for n, _ in found.named_children()) or "none"
            raise ValueError(
                f"layers={path!r}: `{type(found).__name__}` has no `{part}` (its children: "
                f"{children})"
            )
        found = getattr(found, part)
    if not isinstance(found, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"layers={path!r} is a {type(found).__name__}, not a list of layers")
    return found


def _submodule(layer: nn.Module, path: str, unit: str, index: int) -> nn.Module:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        children = ", ".join(n for n, _ in layer.named_children())
        raise ValueError(
            f"unit {unit}: layer {index} ({type(layer).__name__}) has no submodule `{path}` "
            f"(its children: {children})"
        ) from None


def _scope_hooks(layer: nn.Module, name: str, index: int) -> list[RemovableHandle]:
    """Enter ``layer_scope(name, index)`` before the layer runs, leave it after (also when it
    raises)."""
    open_scopes: list[contextlib.ExitStack] = []

    def enter(_module, _args):
        stack = contextlib.ExitStack()
        stack.enter_context(layer_scope(name, index))
        open_scopes.append(stack)

    def leave(_module, _args, _output):
        if open_scopes:
            open_scopes.pop().close()

    return [
        layer.register_forward_pre_hook(enter),
        layer.register_forward_hook(leave, always_call=True),
    ]


def _marker_hooks(module: nn.Module, path: str) -> list[RemovableHandle]:
    """``<path>.begin`` on the first floating-point tensor input (the data: positional, else
    keyword), ``<path>.end`` on every floating-point tensor output (top level of a tuple or
    list).

    Every output, not the first: which of them the rest of the layer reads is not known here
    (a router returns logits, weights and indices, and only the weights flow on), and a marker
    whose output nothing reads leaves the graph. The planner closes the interval at the first
    end and ignores the repeats.
    """

    def begin(_module, args, kwargs):
        args, marked = _mark_all(list(args), f"{path}.begin", first_only=True)
        if not marked:
            kwargs, marked = _mark_all(dict(kwargs), f"{path}.begin", first_only=True)
        if not marked:
            raise ValueError(f"`{path}` was called without a tensor input to put its marker on")
        return tuple(args), kwargs

    def end(_module, _args, _kwargs, output):
        if isinstance(output, torch.Tensor):
            return checkpoint_record(f"{path}.end", output)
        if isinstance(output, (tuple, list)):
            items, marked = _mark_all(list(output), f"{path}.end")
            if marked:
                return type(output)(items)
        raise ValueError(
            f"`{path}` returned {type(output).__name__}, which holds no tensor to put its end "
            "marker on"
        )

    return [
        module.register_forward_pre_hook(begin, with_kwargs=True),
        module.register_forward_hook(end, with_kwargs=True),
    ]


def _mark_all(
    items: list | dict, marker: str, *, first_only: bool = False
) -> tuple[list | dict, bool]:
    """Puts ``marker`` on every (or the first) floating-point tensor of ``items`` (a list or
    a dict)."""
    keys = range(len(items)) if isinstance(items, list) else list(items)
    marked = False
    for key in keys:
        item = items[key]
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            items[key] = checkpoint_record(marker, item)
            marked = True
            if first_only:
                break
    return items, marked
