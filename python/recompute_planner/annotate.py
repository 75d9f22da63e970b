"""Annotating a model you did not write: layer scopes and unit markers from module hooks.

``annotate(model, layers="model.layers", units={"SAVE_ATTN": ["self_attn"], ...})`` installs
forward hooks, no source edit:

- on each module of the ``layers`` list (a dotted attribute path to an ``nn.ModuleList``),
  a pre-hook entering ``layer_scope(name, i)`` and a hook leaving it, so every op of layer
  ``i`` belongs to it;
- on each unit's submodules (paths relative to a layer: ``"self_attn"``, ``"mlp.gate"``), a
  pre-hook putting the marker ``<path>.begin`` on the module's (first) tensor input and a hook
  putting ``<path>.end`` on its tensor outputs, so the unit's interval encloses exactly that
  module's ops;
- on each unit's methods (a path whose last part names a method of a submodule:
  ``"mlp.route_tokens_to_experts"``), the same markers around that method's calls, by a wrapper
  set on the submodule instance (the class is not touched), so a unit can be a region smaller
  than a module without editing the model's source.

A unit path absent from some layers (a MoE gate in a model whose first layers are dense) applies
in the layers that have it; ``Annotation.absent`` says where it is missing, and the plan lists
per layer what each unit keeps. A path found in no layer is an error.

It returns an ``Annotation``: the ``ModelDecl`` list the exporter and the compile stage need
(``.models``) and ``.remove()`` to take the hooks off again. ``recompute_planner.export``
finds the annotation of an annotated model by itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._exporter import ModelDecl
from .markers import checkpoint_record, layer_scope

# A model's decoder layers, as ``layers=`` names them.
LayerList = nn.ModuleList | nn.Sequential

# The attribute an annotated model carries its annotation in.
ANNOTATION_ATTR = "_recompute_planner_annotation"


@dataclass
class Annotation:
    """What ``annotate`` installed: the declared models and the hooks."""

    models: list[ModelDecl]
    # Unit -> path -> the layers that lack it (only paths missing somewhere).
    absent: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    handles: list[RemovableHandle | _MethodWrapper] = field(default_factory=list, repr=False)
    root: nn.Module | None = field(default=None, repr=False)
    layers: LayerList | None = field(default=None, repr=False)  # the annotated layers

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
        models=[ModelDecl(name, len(layer_list), _unit_intervals(units))],
        root=model,
        layers=layer_list,
    )
    targets = {
        (unit, path): _unit_targets(layer_list, unit, path)
        for unit, paths in units.items()
        for path in paths
    }
    for (unit, path), found in targets.items():
        missing = [i for i, target in enumerate(found) if target is None]
        if missing:
            annotation.absent.setdefault(unit, {})[path] = missing
    for index, layer in enumerate(layer_list):
        annotation.handles += _scope_hooks(layer, name, index)
        for (_unit, path), found in targets.items():
            target = found[index]
            if isinstance(target, nn.Module):
                annotation.handles += _marker_hooks(target, path)
            elif target is not None:
                annotation.handles.append(_MethodWrapper(target[0], target[1], path))
    setattr(model, ANNOTATION_ATTR, annotation)
    return annotation


def annotation_of(model: nn.Module) -> Annotation | None:
    """The annotation ``annotate`` installed on ``model``, if any."""
    return getattr(model, ANNOTATION_ATTR, None)


def _unit_intervals(units: dict[str, list[str]]) -> dict[str, list[tuple[str, str]]]:
    return {unit: [(f"{p}.begin", f"{p}.end") for p in paths] for unit, paths in units.items()}


def _layer_list(model: nn.Module, path: str) -> LayerList:
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


# What a unit path names in one layer: a submodule, a (submodule, method name) pair, or
# nothing.
_Target = nn.Module | tuple[nn.Module, str] | None


def _unit_targets(layer_list: LayerList, unit: str, path: str) -> list[_Target]:
    """What ``path`` names in each layer; an error if it names nothing in any layer."""
    found = [_target(layer, path) for layer in layer_list]
    if layer_list and all(target is None for target in found):
        layer = layer_list[0]
        children = ", ".join(n for n, _ in layer.named_children())
        raise ValueError(
            f"unit {unit}: no layer has a submodule or method `{path}` (layer 0, "
            f"{type(layer).__name__}, has children: {children})"
        )
    return found


def _target(layer: nn.Module, path: str) -> _Target:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        pass
    owner_path, _, method = path.rpartition(".")
    try:
        owner = layer.get_submodule(owner_path)
    except AttributeError:
        return None
    attribute = getattr(type(owner), method, None)
    if callable(attribute) and not isinstance(attribute, nn.Module):
        return owner, method
    return None


class _MethodWrapper:
    """Markers around every call of ``owner.<method>``: a wrapper set on the instance (which
    shadows the class's method), removed by ``remove()``."""

    def __init__(self, owner: nn.Module, method: str, path: str):
        self.owner, self.method = owner, method
        original = getattr(owner, method)

        def marked(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _mark_begin(path, args, kwargs)
            return _mark_end(path, original(*args, **kwargs))

        self.wrapper = marked
        owner.__dict__[method] = marked

    def remove(self) -> None:
        if self.owner.__dict__.get(self.method) is self.wrapper:
            del self.owner.__dict__[self.method]


def _scope_hooks(layer: nn.Module, name: str, index: int) -> list[RemovableHandle]:
    """Enter ``layer_scope(name, index)`` before the layer runs, leave it after (also when it
    raises)."""
    open_scopes: list[contextlib.ExitStack] = []

    def enter(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(layer_scope(name, index))
        open_scopes.append(stack)

    def leave(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
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

    def begin(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _mark_begin(path, args, kwargs)

    def end(
        _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any
    ) -> Any:
        return _mark_end(path, output)

    return [
        module.register_forward_pre_hook(begin, with_kwargs=True),
        module.register_forward_hook(end, with_kwargs=True),
    ]


def _mark_begin(
    path: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``<path>.begin`` on the first floating-point tensor argument, positional else keyword."""
    marked_args, marked = _mark_all(list(args), f"{path}.begin", first_only=True)
    if marked:
        return tuple(marked_args), kwargs
    marked_kwargs, marked = _mark_all(dict(kwargs), f"{path}.begin", first_only=True)
    if not marked:
        raise ValueError(f"`{path}` was called without a tensor input to put its marker on")
    return args, marked_kwargs


def _mark_end(path: str, output: Any) -> Any:
    """``<path>.end`` on the output, or on every floating-point tensor of a tuple or list."""
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


# A list or a dict of a call's arguments or results.
_Items = TypeVar("_Items", list[Any], dict[str, Any])


def _mark_all(
    items: _Items, marker: str, *, first_only: bool = False
) -> tuple[_Items, bool]:
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
