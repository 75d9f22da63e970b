"""Annotating a model you did not write: layer scopes and unit markers, no source edit.

``annotate(model, layers="model.layers", units={"SAVE_ATTN": ["self_attn"], ...})`` makes:

- each module of the ``layers`` list (a dotted attribute path to an ``nn.ModuleList``) run
  its forward inside ``layer_scope(name, i)``, so every op of layer ``i`` belongs to it;
- each unit's submodules (paths relative to a layer: ``"self_attn"``, ``"mlp.gate"``) put the
  marker ``<path>.begin`` on the module's (first) tensor input and ``<path>.end`` on its
  tensor outputs, so the unit's interval encloses exactly that module's ops.

Both run in a forward set on the module's class (a subclass of it named as it, one for layers
and one for units' submodules; see ``_AnnotatedModule``), which ``torch.compile`` traces as
cheaply as the plain model; module hooks would double Dynamo's time. Also:

- on each unit's methods (a path whose last part names a method of a submodule, or of an
  object a module holds: ``"mlp.route_tokens_to_experts"``, ``"dispatcher.dispatch"``), the
  same markers around that method's calls, by a wrapper set on the instance (the class is not
  touched), so a unit can be a region smaller than a module without editing the model's
  source;
- on each unit's op intervals (``OpInterval("self_attn", first="flatten", last="topk")``: from
  the first op matching ``first`` to the last op matching ``last`` inside a submodule's
  forward), markers exactly where a hand-placed ``checkpoint_record`` would put them: a
  ``__torch_function__`` mode active while the submodule runs puts ``<name>.begin`` on the
  input of the first matching op and ``<name>.end`` on the output of the last one (see
  ``OpInterval``).

A unit path absent from some layers (a MoE gate in a model whose first layers are dense) applies
in the layers that have it; ``Annotation.absent`` says where it is missing, and the plan lists
per layer what each unit keeps. A path found in no layer is an error. An op interval is absent
from a layer whose submodule lacks it or ran no op matching ``first``, which is known once the
model ran (``Annotation.absent`` is then updated); one that matched in no layer is an error
raised at the end of that forward, naming the unit, the module and the ops it ran.

It returns an ``Annotation``: the ``ModelDecl`` list the exporter and the compile stage need
(``.models``) and ``.remove()`` to take it all off again. ``recompute_planner.export``
finds the annotation of an annotated model by itself.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from . import markers as _markers
from ._exporter import ModelDecl, UnitModules
from .markers import (
    annotated,
    checkpoint_record,
    layer_tags,
    staged_tags,
    tag_scope,
    tentative_marker,
)

# A model's decoder layers, as ``layers=`` names them.
LayerList = nn.ModuleList | nn.Sequential

# The attribute an annotated model carries its annotation in.
ANNOTATION_ATTR = "_recompute_planner_annotation"


@dataclass(frozen=True)
class _OpPattern:
    """An op name and which of its matches (None: the last)."""

    name: str
    index: int | None

    @classmethod
    def parse(cls, text: str) -> _OpPattern:
        found = re.fullmatch(r"\s*([A-Za-z_][\w.]*)\s*(?:\[\s*(\d+)\s*\])?\s*", text)
        if found is None:
            raise ValueError(
                f"op pattern {text!r}: write an op name (`topk`, `Tensor.topk`, "
                "`aten._to_copy`), optionally with the match to take (`dropout[0]`)"
            )
        name, index = found.groups()
        return cls(name, None if index is None else int(index))

    def matches(self, names: tuple[str, ...]) -> bool:
        return any(n == self.name or n.endswith("." + self.name) for n in names)


@dataclass(frozen=True)
class OpInterval:
    """A unit region inside a submodule: from the first op matching ``first`` to the last op
    matching ``last`` (counted from that first one on), in every call of ``module`` (a path
    relative to a layer; ``""`` is the layer itself).

    A pattern names an op as the model's code calls it: a torch function, a tensor method or a
    ``torch.ops`` op, by its bare name (``"topk"``, ``"linear"``, ``"all_to_all_single"``) or a
    dotted tail of its qualified name (``"Tensor.topk"``, ``"aten._to_copy"``,
    ``"_c10d_functional.all_to_all_single"``). ``name[i]`` picks the i-th match instead
    (from 0): ``first="linear[1]"``, ``last="dropout[0]"`` (the first dropout at or after the
    begin).

    ``<name>.begin`` goes on the first tensor input of the first op, ``<name>.end`` on every
    tensor output of the last: where ``x = checkpoint_record(...)`` written by hand before and
    after them would put them (later ops of the module's call that read ``x`` read the marked
    tensor too), so the exported graph is that of the hand-marked model. ``name``
    defaults to ``module[first..last]``; name it after the hand-placed markers it replaces
    (``"dsa.indexer"``) to give the graph their names too. Which match is the last is known
    only when the module returns: until then every match gets a tentative end marker, and the
    exporter keeps the last one (``markers.resolve_tentative_markers``); in eager the others
    stay, identities the selective checkpoint ignores like every marker. An op that writes its
    input in place cannot be the first or the last op (a marker would take the write away from
    the tensor the model goes on with).
    """

    module: str
    first: str
    last: str
    name: str | None = None
    # The parsed patterns (parsed here, not while the model runs: Dynamo traces the mode).
    first_op: _OpPattern = field(init=False, repr=False, compare=False)
    last_op: _OpPattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = _OpPattern.parse(self.first)
        object.__setattr__(self, "first_op", _OpPattern(first.name, first.index or 0))
        object.__setattr__(self, "last_op", _OpPattern.parse(self.last))

    @property
    def label(self) -> str:
        """The interval's marker stem (``<label>.begin`` / ``<label>.end``)."""
        return self.name or f"{self.module}[{self.first}..{self.last}]"


# What a unit declares: a submodule or method path, or an op interval.
UnitPart = str | OpInterval


@dataclass
class Annotation:
    """What ``annotate`` installed: the declared models and the hooks."""

    models: list[ModelDecl]
    # Unit -> path -> the layers that lack it (only paths missing somewhere).
    absent: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    handles: list[RemovableHandle | _MethodWrapper | _Removal] = field(
        default_factory=list, repr=False
    )
    root: nn.Module | None = field(default=None, repr=False)
    layers: LayerList | None = field(default=None, repr=False)  # the annotated layers

    def remove(self) -> None:
        """Restores every module, method and hook ``annotate`` changed."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.root is not None and getattr(self.root, ANNOTATION_ATTR, None) is self:
            delattr(self.root, ANNOTATION_ATTR)


def annotate(
    model: nn.Module,
    layers: str = "model.layers",
    units: Mapping[str, Sequence[UnitPart]] | None = None,
    *,
    name: str = "main",
    parent: str | None = None,
) -> Annotation:
    """Installs layer scopes and unit markers on ``model`` (see the module docstring).

    ``layers`` names a list of layers, or one module, which is then the model's one layer (an
    MTP block). ``parent`` declares the model nested in another (an MTP block in its main
    model, annotated on the block's owner as a root of its own).
    """
    existing = getattr(model, ANNOTATION_ATTR, None)
    if existing is not None:
        raise ValueError("the model is annotated already: call .remove() on its annotation first")
    layer_list = _layer_list(model, layers)
    declared = {unit.upper(): list(parts) for unit, parts in (units or {}).items()}
    targets = {
        (unit, part): _unit_targets(layer_list, unit, part)
        for unit, parts in declared.items()
        for part in parts
    }
    modules = UnitModules(_layer_paths(model, layers, layer_list), _module_stems(targets))
    annotation = Annotation(
        models=[ModelDecl(name, len(layer_list), _unit_intervals(declared), parent, modules)],
        root=model,
        layers=layer_list,
    )
    for (unit, part), found in targets.items():
        missing = [i for i, target in enumerate(found) if target is None]
        if missing:
            annotation.absent.setdefault(unit, {})[_label(part)] = missing
    intervals = []
    for (unit, part), found in targets.items():
        if isinstance(part, OpInterval):
            intervals.append(_IntervalRecord(unit, part, annotation, found))
    try:
        _install(annotation, layer_list, name, targets)
        for record in intervals:
            annotation.handles += record.install()
    except BaseException:
        annotation.remove()  # what was installed before the error
        raise
    if intervals:
        annotation.handles.append(
            model.register_forward_hook(lambda *_: _check_intervals(intervals), always_call=True)
        )
    setattr(model, ANNOTATION_ATTR, annotation)
    return annotation


def _install(
    annotation: Annotation,
    layer_list: LayerList,
    name: str,
    targets: dict[tuple[str, UnitPart], list[_Target]],
) -> None:
    """Each layer's scope and its units' markers (op intervals aside), their handles added to
    ``annotation`` as they are installed."""
    for index, layer in enumerate(layer_list):
        annotation.handles += _enter_scope(layer, name, index)
        for (_unit, part), found in targets.items():
            target = found[index]
            if target is None or isinstance(part, OpInterval):
                continue
            if isinstance(target, nn.Module):
                annotation.handles += _put_markers(target, part)
            else:
                annotation.handles.append(_MethodWrapper(target[0], target[1], part))


def annotation_of(model: nn.Module) -> Annotation | None:
    """The annotation ``annotate`` installed on ``model``, if any."""
    return getattr(model, ANNOTATION_ATTR, None)


def _layer_paths(model: nn.Module, path: str, layer_list: LayerList) -> tuple[str, ...]:
    """Each layer's module path from ``model``: ``path.<child>`` in a list, ``path`` for one
    layer."""
    if _attribute(model, path) is layer_list:
        return tuple(f"{path}.{child}" for child, _ in layer_list.named_children())
    return (path,)


def _module_stems(targets: dict[tuple[str, UnitPart], list[_Target]]) -> tuple[str, ...]:
    """The unit paths that name a submodule in some layer, in declaration order."""
    stems = (
        part for (_, part), found in targets.items()
        if isinstance(part, str) and any(isinstance(t, nn.Module) for t in found)
    )
    return tuple(dict.fromkeys(stems))


def _label(part: UnitPart) -> str:
    """The marker stem of a unit part: its path, or an op interval's label."""
    return part.label if isinstance(part, OpInterval) else part


def _unit_intervals(units: dict[str, list[UnitPart]]) -> dict[str, list[tuple[str, str]]]:
    return {
        unit: [(f"{_label(p)}.begin", f"{_label(p)}.end") for p in parts]
        for unit, parts in units.items()
    }


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
    if isinstance(found, (nn.ModuleList, nn.Sequential)):
        return found
    if isinstance(found, nn.Module):
        return nn.ModuleList([found])  # one layer: a container of its own, not the model's
    raise ValueError(f"layers={path!r} is a {type(found).__name__}, not a list of layers")


# What a unit path names in one layer: a submodule, an (object, method name) pair, or
# nothing.
_Target = nn.Module | tuple[Any, str] | None


def _unit_targets(layer_list: LayerList, unit: str, part: UnitPart) -> list[_Target]:
    """What ``part`` names in each layer; an error if it names nothing in any layer."""
    found: list[_Target]
    if isinstance(part, OpInterval):
        found = [_submodule(layer, part.module) for layer in layer_list]
        what = "submodule"
        path = part.module
    else:
        found = [_target(layer, part) for layer in layer_list]
        what = "submodule or method"
        path = part
    if layer_list and all(target is None for target in found):
        layer = layer_list[0]
        children = ", ".join(n for n, _ in layer.named_children())
        raise ValueError(
            f"unit {unit}: no layer has a {what} `{path}` (layer 0, "
            f"{type(layer).__name__}, has children: {children})"
        )
    return found


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def _target(layer: nn.Module, path: str) -> _Target:
    module = _submodule(layer, path)
    if module is not None:
        return module
    owner_path, _, method = path.rpartition(".")
    owner = _attribute(layer, owner_path)
    if owner is None:
        return None
    attribute = getattr(type(owner), method, None)
    if callable(attribute) and not isinstance(attribute, nn.Module):
        return owner, method
    return None


def _attribute(layer: nn.Module, path: str) -> Any:
    """The submodule or other object at dotted attribute ``path`` of ``layer`` (a dispatcher a
    layer holds), or None."""
    found: Any = layer
    for part in filter(None, path.split(".")):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


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


class _AnnotatedModule:
    """What one module runs besides its own forward: the layer scope it enters (a layer of the
    annotation) and the unit markers it puts on its input and outputs (a unit's submodule).

    Both are run by a forward on the module's class: the module's class becomes a subclass of
    it, made once per class for layers and once for units' submodules (``_annotated_class``)
    and named as it (``type(m).__name__``, ``isinstance`` and the module's ``repr`` are
    unchanged), whose forward runs them around the class's own. Module
    hooks would run the same code, but Dynamo traces a module with hooks through the whole of
    ``nn.Module.__call__`` and the hooks' bodies op by op; a forward on the class is traced as
    a plain call, so ``torch.compile`` of an annotated model takes about as long as of the
    plain model. A module whose forward is already replaced on the instance (a framework's
    wrapper) gets an instance forward around that one instead, so nothing is skipped.
    ``remove()`` restores the module."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.scope: dict[str, Any] | None = None
        self.marks: list[str] = []
        instance_forward = module.__dict__.get("forward")
        self.instance_forward: _InstanceForward | None = None
        if instance_forward is not None:
            self.replaced: Any = instance_forward
            self.instance_forward = _InstanceForward(self, instance_forward)
            module.__dict__["forward"] = self.instance_forward
        else:
            # An instance made from an annotated class (``type(layer)(config)``) unwraps it.
            self.replaced = _base_class(type(module))
            module.__class__ = _annotated_class(self.replaced, scoped=False)
        module.__dict__[_STATE_ATTR] = self

    @classmethod
    def of(cls, module: nn.Module) -> _AnnotatedModule:
        """The module's annotation, made on first use."""
        found = module.__dict__.get(_STATE_ATTR)
        return found if isinstance(found, _AnnotatedModule) else cls(module)

    def set_scope(self, model: str, index: int) -> _Removal:
        if self.scope is not None:
            raise ValueError(
                f"`{type(self.module).__name__}` is a layer of two annotations: remove the "
                "first one before annotating its model again"
            )
        if not self._can_take_scope():
            raise ValueError(
                f"`{type(self.module).__name__}` is a unit's submodule whose class was "
                "replaced by a subclass after it was annotated; it cannot become a layer now: "
                "annotate the model it is a layer of before wrapping it"
            )
        self.scope = layer_tags(model, index)
        self._scope_changed()
        return _Removal(self, None)

    def add_marks(self, path: str) -> _Removal:
        self.marks.append(path)
        return _Removal(self, path)

    def forget(self, path: str | None) -> None:
        """Takes a scope (None) or a unit's markers off; restores the module once bare."""
        if path is None:
            self.scope = None
            self._scope_changed()
        elif path in self.marks:
            self.marks.remove(path)
        if self.scope is not None or self.marks:
            return
        module = self.module
        if isinstance(self.replaced, type):
            if self._has_annotated_class():  # else a subclass was made of it
                module.__class__ = self.replaced
                del module.__dict__[_STATE_ATTR]
        elif module.__dict__.get("forward") is self.instance_forward:
            module.__dict__["forward"] = self.replaced
            del module.__dict__[_STATE_ATTR]

    def _scope_changed(self) -> None:
        """Gives the module the annotated class for a layer or for a unit's submodule, as its
        scope now is (unless a subclass was made of it since), and makes code Dynamo compiled
        before trace again."""
        global _scope_epoch
        _scope_epoch += 1
        if self._has_annotated_class():
            self.module.__class__ = _annotated_class(self.replaced, self.scope is not None)

    def _has_annotated_class(self) -> bool:
        """The module's class is one ``_annotated_class`` made (not a subclass of one)."""
        return isinstance(self.replaced, type) and (
            type(self.module).__dict__.get(_BASE_ATTR) is self.replaced
        )

    def _can_take_scope(self) -> bool:
        """A scope would be entered under Dynamo: the module's class is ours, or a subclass a
        framework made of a layer's (as FSDP2's ``fully_shard`` does), not of a unit's, whose
        forward would leave the scope out of compiled graphs."""
        return (
            not isinstance(self.replaced, type)
            or self._has_annotated_class()
            or getattr(type(self.module), _SCOPED_ATTR, False)
        )

    def run(self, forward: Any, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``forward(owner, *args, **kwargs)`` inside the scope, with each unit's begin marker
        on its input and end marker on its outputs, in the order the units were declared (as
        hooks would run). Eager and under a tracer other than Dynamo; under Dynamo the
        forward runs in ``_traced_scope``'s tags alone."""
        scope = contextlib.nullcontext() if self.scope is None else tag_scope(self.scope)
        with scope:
            for path in self.marks:
                first = args[0] if args else None
                if isinstance(first, torch.Tensor) and first.is_floating_point():  # most calls
                    args = (checkpoint_record(f"{path}.begin", first), *args[1:])
                else:
                    args, kwargs = _mark_begin(path, args, kwargs)
            output = forward(owner, *args, **kwargs)
            for path in self.marks:
                if isinstance(output, torch.Tensor):
                    output = checkpoint_record(f"{path}.end", output)
                else:
                    output = _mark_end(path, output)
            return output


@dataclass(frozen=True)
class _Removal:
    """The handle ``Annotation.remove`` calls: takes one scope or unit off its module."""

    target: _AnnotatedModule
    path: str | None

    def remove(self) -> None:
        self.target.forget(self.path)


# Where an annotated module keeps its ``_AnnotatedModule``.
_STATE_ATTR = "_recompute_planner_annotated"
# Each annotated class's two subclasses (``_annotated_class``), made once, and the attributes
# each has: the class it was made of, and whether it is a layer's.
_BASE_ATTR = "_recompute_planner_base"
_SCOPED_ATTR = "_recompute_planner_scoped"
_ANNOTATED_CLASSES: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {}


def _annotated_class(cls: type[nn.Module], scoped: bool) -> type[nn.Module]:
    """``cls``'s subclass whose forward runs the module's ``_AnnotatedModule`` around
    ``cls.forward`` (eager and under tracers other than Dynamo): one for modules with a layer
    scope (``scoped``), one for those with unit markers alone.

    Two, so that while Dynamo traces, the forward of a unit's submodule is a bare call of
    ``cls.forward`` (the stage places unit markers after tracing; see ``_traced_scope``):
    Dynamo's cost per inlined call and per guard, at two or three annotated modules a layer,
    is a tenth of an annotated model's compile time."""
    key = (cls, scoped)
    if key not in _ANNOTATED_CLASSES:
        forward = _scoped_forward(cls) if scoped else _unit_forward(cls)
        metaclass: Any = type(cls)  # the class's own (``type`` for most modules)
        _ANNOTATED_CLASSES[key] = metaclass(
            cls.__name__,
            (cls,),
            {
                "forward": forward,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                _BASE_ATTR: cls,
                _SCOPED_ATTR: scoped,
            },
        )
    return _ANNOTATED_CLASSES[key]


def _base_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The model's own class behind ``cls``: ``cls`` itself unless ``_annotated_class`` made
    it."""
    base: type[nn.Module] = cls.__dict__.get(_BASE_ATTR, cls)
    return base


def _scoped_forward(cls: type[nn.Module]) -> Any:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # see _traced_scope
            # ``_traced_tags`` in line: Dynamo's cost per inlined call adds up.
            if torch.compiler.is_exporting():
                tags = _staged_scope(self, _markers._in_compiled_graphs)
            else:
                tags = _traced_scope(self, _scope_epoch, _markers._in_compiled_graphs)
            with contextlib.nullcontext() if tags is None else annotated(tags):
                return cls.forward(self, *args, **kwargs)
        return _annotated_state(self).run(cls.forward, self, args, kwargs)

    return forward


def _unit_forward(cls: type[nn.Module]) -> Any:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # see _traced_scope
            return cls.forward(self, *args, **kwargs)
        return _annotated_state(self).run(cls.forward, self, args, kwargs)

    return forward


class _InstanceForward:
    """An ``_AnnotatedModule`` around a forward already replaced on the instance."""

    def __init__(self, state: _AnnotatedModule, forward: Any):
        self.state, self.forward = state, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # as the annotated class's forward
            with _traced_tags(self.state.module):
                return self.forward(*args, **kwargs)
        return self.state.run(_call, self.forward, args, kwargs)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _traced_tags(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """What an annotated module runs its forward in while Dynamo traces it: its layer scope,
    if it has one, and nothing else (see ``_traced_scope``)."""
    if torch.compiler.is_exporting():
        tags = _staged_scope(module, _markers._in_compiled_graphs)
    else:
        tags = _traced_scope(module, _scope_epoch, _markers._in_compiled_graphs)
    return contextlib.nullcontext() if tags is None else annotated(tags)


def _traced_scope(module: nn.Module, epoch: int, stage: int) -> dict[str, Any] | None:
    """``_staged_scope(module, stage)``, evaluated by Dynamo rather than traced.

    While Dynamo traces, an annotated module runs its forward in its layer scope and nothing
    else. The unit markers are left out: they would be Python that Dynamo traces and nodes it
    records in every layer, and the torch.compile planning stage puts them into the joint
    graph after tracing, from the module each op ran in (``_unit_markers``); without a stage,
    compiled graphs have no use for them. And Dynamo runs this function instead of tracing
    it (``_evaluated_by_dynamo``), so the compiled code guards on the module's identity and
    on the two globals passed, ``_scope_epoch`` (unused here: code compiled before any scope
    changed is traced again) and the stage, not on each key and value of each layer's scope:
    those guards made compiling an annotated model about 15% slower than compiling the plain
    one. ``torch.export`` cannot pass a module to such a function and has no guards to save:
    it traces ``_staged_scope``."""
    del epoch
    return _staged_scope(module, stage)


def _staged_scope(module: nn.Module, stage: int) -> dict[str, Any] | None:
    """The tags of annotated ``module``'s layer scope in a trace for planning stage ``stage``
    (None for a unit's submodule)."""
    scope = _annotated_state(module).scope
    return None if scope is None else staged_tags(scope, stage)


def _annotated_state(module: nn.Module) -> _AnnotatedModule:
    """An annotated module's ``_AnnotatedModule``: always there while its class is annotated
    (``forget`` keeps it while it cannot restore the class)."""
    state: _AnnotatedModule = getattr(module, _STATE_ATTR)
    return state


def _evaluated_by_dynamo(fn: Any) -> None:
    """Has Dynamo call ``fn`` while tracing and record its result as a constant, with no guard
    on what ``fn`` read: ``torch.compiler.assume_constant_result(fn)``, without that
    function's import of ``torch._dynamo`` (a second, which users of ``annotate`` who never
    compile would pay). torch marks its own ``justknobs_check`` so; a test of the compiled
    code's guards fails if Dynamo stops honouring the mark."""
    fn._dynamo_marked_constant = True


_evaluated_by_dynamo(_traced_scope)

# Changed whenever a module's layer scope is set or taken off
# (``_AnnotatedModule._scope_changed``): code Dynamo compiled guards on it, since it does not
# guard on the scopes themselves. One for the process: annotating or removing any model
# makes every compiled annotated model trace once more on its next call.
_scope_epoch = 0


def _enter_scope(layer: nn.Module, name: str, index: int) -> list[_Removal]:
    """``layer_scope(name, index)`` around the layer's forward (also when it raises)."""
    return [_AnnotatedModule.of(layer).set_scope(name, index)]


def _put_markers(module: nn.Module, path: str) -> list[_Removal]:
    """``<path>.begin`` on the first floating-point tensor input (the data: positional, else
    keyword), ``<path>.end`` on every floating-point tensor output (top level of a tuple or
    list).

    Every output, not the first: which of them the rest of the layer reads is not known here
    (a router returns logits, weights and indices, and only the weights flow on), and a marker
    whose output nothing reads leaves the graph. The planner closes the interval at the first
    end and ignores the repeats.
    """
    return [_AnnotatedModule.of(module).add_marks(path)]


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


# --------------------------------------------------------------------------------------------
# Op intervals


@dataclass
class _Call:
    """What one call of an op interval's module ran."""

    begun: bool = False
    # (tensor, its begin marker's output): later ops of the call read the marked tensor, as
    # they would after `x = checkpoint_record(...)` written in the forward.
    marked: tuple[torch.Tensor, torch.Tensor] | None = None
    first_matches: int = 0  # ops matching `first` so far
    last_matches: int = 0  # ops matching `last` from the begin on
    ops: list[str] = field(default_factory=list)  # the ops it ran, for error messages


class _IntervalMode(TorchFunctionMode):
    """Active while one call of the module runs: marks the input of the interval's first op
    and the outputs of its (tentatively) last ones (``OpInterval``)."""

    def __init__(self, interval: OpInterval, where: str):
        super().__init__()
        self.interval, self.where = interval, where
        self.first, self.last = interval.first_op, interval.last_op
        self.call = _Call()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        names = _op_names(func)
        if names is None:
            return func(*args, **kwargs)
        call = self.call
        if call.marked is not None:
            args, kwargs = _substituted(args, kwargs, *call.marked)
        if not call.begun and self.first.matches(names):
            if call.first_matches == self.first.index:
                self._refuse_in_place(func, names, kwargs, "first")
                args, kwargs, call.marked = _mark_first_tensor(
                    args, kwargs, f"{self.interval.label}.begin", f"`{names[0]}` in {self.where}"
                )
                call.begun = True
            call.first_matches += 1
        out = func(*args, **kwargs)
        if any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(out)[0]):
            call.ops.append(names[0])
        if call.begun and self.last.matches(names):
            self._refuse_in_place(func, names, kwargs, "last")
            out = self._mark_end(out, call.last_matches)
            call.last_matches += 1
        return out

    def _mark_end(self, out: Any, occurrence: int) -> Any:
        """``<label>.end`` on every tensor of ``out`` if this is the last match asked for; a
        tentative end (``markers.tentative_marker``) if the last match is."""
        end = f"{self.interval.label}.end"
        if self.last.index is not None and occurrence != self.last.index:
            return out
        leaves, spec = tree_flatten(out)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for leaf, i in enumerate(tensors):
            name = end if self.last.index is not None else tentative_marker(end, occurrence, leaf)
            leaves[i] = checkpoint_record(name, leaves[i])
        return tree_unflatten(leaves, spec)

    def _refuse_in_place(
        self, func: Any, names: tuple[str, ...], kwargs: dict[str, Any], which: str
    ) -> None:
        if _writes_in_place(func, names, kwargs):
            raise ValueError(
                f"op interval {self.interval.label!r} in {self.where}: `{which}` matches "
                f"`{names[0]}`, which writes its input in place, so a marker on it would take "
                "the write away from the tensor the model goes on with; choose an op that "
                "returns a new tensor"
            )

    def finish(self) -> bool:
        """Whether the call had the interval; raises if it began and never ended."""
        call = self.call
        if not call.begun:
            return False
        wanted = self.last.index if self.last.index is not None else 0
        if call.last_matches <= wanted:
            raise ValueError(
                f"op interval {self.interval.label!r} in {self.where}: the interval began at "
                f"`{self.interval.first}` but no op matching `{self.interval.last}` ran after "
                f"it; the ops it ran: {_op_list(call.ops)}"
            )
        return True


def _op_names(func: Any) -> tuple[str, ...] | None:
    """The names a pattern may match a call by, the one to show first; None for what is no op
    (a property read, a constructor such as ``torch.device``)."""
    if isinstance(func, torch._ops.OpOverload):
        full = str(func)
        packet = full.rsplit(".", 1)[0]
        return packet, packet.rsplit(".", 1)[-1], full
    if isinstance(func, torch._ops.OpOverloadPacket):
        return str(func), str(func).rsplit(".", 1)[-1]
    bare = getattr(func, "__name__", None)
    if bare is None or isinstance(func, type) or bare in ("__get__", "__set__"):
        return None
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return bare, f"Tensor.{bare}", f"torch.Tensor.{bare}"
    module = getattr(func, "__module__", None)
    if module == "torch._C._nn":
        module = "torch.nn.functional"
    return (bare, f"{module}.{bare}") if module else (bare,)


# Dynamo cannot trace the introspection of a torch function.
_evaluated_by_dynamo(_op_names)


def _writes_in_place(func: Any, names: tuple[str, ...], kwargs: dict[str, Any]) -> bool:
    """An in-place call: ``add_``, ``x[i] = y``, ``x += y``, an ``out=`` call, or a
    ``torch.ops`` op whose schema writes an argument."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.is_mutable
    bare = names[0]
    dunder = bare.startswith("__") and bare.endswith("__")
    return (
        "out" in kwargs
        or (bare.endswith("_") and not dunder)
        or bare == "__setitem__"
        or (dunder and bare[2:3] == "i" and bare[2:-2] not in ("index", "int", "invert", "iter"))
    )


def _mark_first_tensor(
    args: tuple[Any, ...], kwargs: dict[str, Any], marker: str, where: str
) -> tuple[tuple[Any, ...], dict[str, Any], tuple[torch.Tensor, torch.Tensor]]:
    """``marker`` on the first tensor of the arguments; returns them and (tensor, marked)."""
    leaves, spec = tree_flatten((args, kwargs))
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[i] = checkpoint_record(marker, leaf)
            args, kwargs = tree_unflatten(leaves, spec)
            return args, kwargs, (leaf, leaves[i])
    raise ValueError(f"{where} has no tensor input to put `{marker}` on")


def _substituted(
    args: tuple[Any, ...], kwargs: dict[str, Any], tensor: torch.Tensor, marked: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with ``marked`` wherever they hold ``tensor`` itself."""
    leaves, spec = tree_flatten((args, kwargs))
    if not any(leaf is tensor for leaf in leaves):
        return args, kwargs
    substituted: tuple[tuple[Any, ...], dict[str, Any]] = tree_unflatten(
        [marked if leaf is tensor else leaf for leaf in leaves], spec
    )
    return substituted


def _op_list(ops: list[str], limit: int = 40) -> str:
    """The distinct ops, in the order first run, at most ``limit``."""
    distinct = list(dict.fromkeys(ops))
    shown = ", ".join(distinct[:limit])
    return shown + (", ..." if len(distinct) > limit else "") if shown else "none"


@dataclass
class _IntervalRecord:
    """One op interval of one unit: its hooks on every layer's module, and what the last
    forward found in each layer."""

    unit: str
    interval: OpInterval
    annotation: Annotation
    modules: list[_Target]
    found: dict[int, bool] = field(default_factory=dict)  # layer -> had the interval
    ops: dict[int, list[str]] = field(default_factory=dict)  # layer -> ops its module ran

    def install(self) -> list[RemovableHandle]:
        handles = []
        for index, module in enumerate(self.modules):
            if isinstance(module, nn.Module):
                handles += self._hooks(module, index)
        return handles

    def _hooks(self, module: nn.Module, index: int) -> list[RemovableHandle]:
        where = f"`{self.interval.module or '<the layer>'}` of layer {index}"
        active: list[_IntervalMode] = []

        def enter(_module: nn.Module, _args: Any) -> None:
            mode = _IntervalMode(self.interval, where)
            mode.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            active.append(mode)

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            mode = active.pop()
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # torch: untyped
            if sys.exc_info()[0] is not None:
                return
            had = mode.finish()
            self.found[index] = self.found.get(index, False) or had
            self.ops.setdefault(index, mode.call.ops)

        return [
            module.register_forward_pre_hook(enter),
            # Prepended: modes leave in the reverse order they entered.
            module.register_forward_hook(leave, always_call=True, prepend=True),
        ]

    def settle(self) -> None:
        """After a forward: where the interval was absent, and an error if it was nowhere."""
        if not self.found:
            return
        label = self.interval.label
        missing = [i for i in range(len(self.modules)) if not self.found.get(i, False)]
        absent = self.annotation.absent.setdefault(self.unit, {})
        if missing:
            absent[label] = missing
        else:
            absent.pop(label, None)
            if not absent:
                self.annotation.absent.pop(self.unit)
        if not any(self.found.values()):
            layer = min(self.ops)
            raise ValueError(
                f"unit {self.unit}: op interval {label!r} matched in no layer: no "
                f"`{self.interval.module or '<the layer>'}` ran an op matching "
                f"`{self.interval.first}` (layer {layer}'s ran: {_op_list(self.ops[layer])})"
            )


def _check_intervals(records: list[_IntervalRecord]) -> None:
    """After a forward of the model: each op interval settles what it found (unless the
    forward raised), then forgets it."""
    failed = sys.exc_info()[0] is not None
    for record in records:
        try:
            if not failed:
                record.settle()
        finally:
            record.found.clear()
            record.ops.clear()


__all__ = [
    "Annotation",
    "LayerList",
    "OpInterval",
    "UnitPart",
    "annotate",
    "annotation_of",
]
