"""``recompute_planner.export``: one training step of your own ``nn.Module`` as the IR.

``export(model, example_inputs, loss_fn=...)`` traces the joint forward+backward graph of
``loss = loss_fn(model(**inputs))`` with AOTAutograd on CPU (fake tensors; the weights stay
as they are) and returns the exporter's ``ExportResult`` (``.graph`` for
``recompute_planner.plan``, ``write_graph`` to save it), with the eager reference step run on
the CPU.

``fake=True`` plans a model at its real size without allocating it: the step is only traced,
with fake tensors on ``device`` (``"cpu"``, or ``"cuda"`` for a GPU, described by the
hardware profile ``hw``: ``"h100"``, ``"h200"``, ``"b200"``, ``"mi300x"``, default H200), and
nothing runs (the result holds the graph and no tensors). It is the default when a parameter,
buffer or input is on the ``meta`` device (a model built under ``torch.device("meta")``) or
``hw`` is given. The model may also be a real one, in any dtype.

- ``example_inputs``: a tuple of positional inputs or a dict of keyword inputs; tensors (also
  inside lists, tuples and dicts: HuggingFace's per-layer-type mask dict) become graph
  inputs, a ``TensorSpec`` (shape and dtype) is a ``meta`` tensor, anything else is passed as
  it is on every call;
- ``loss_fn(output) -> scalar``: how the output becomes the loss; without it the output must
  be the loss or carry it as ``.loss`` (HuggingFace models given ``labels``), ``"loss"`` (a
  dict) or its first element (a tuple);
- ``units`` / ``layers``: annotate the model first (``recompute_planner.annotate``), or pass
  ``models`` declared yourself; an annotated model needs neither;
- ``ep`` / ``ep_rank`` / ``routing``: the step of rank ``ep_rank`` of an ``ep``-way
  expert-parallel run of a HuggingFace MoE model (``recompute_planner.expert_parallel``): its
  share of the experts, dispatch and combine as all-to-alls of a balanced (or the given)
  routing's split sizes, traced under a fake process group; implies ``fake=True``.

Masks are the model's own. The step is traced as ``torch.compile`` traces it
(``torch.compiler.is_compiling()`` is true), so HuggingFace's mask code builds its masks
(causal, sliding-window, per layer type, padding) with tensor ops instead of branching on
data. The decoder layers (the annotated ones, else ``model.layers``) go further: each
receives, as an input of the graph, the mask it received in an eager forward of the same
inputs (no mask where eager attends plainly causally), and is traced as eager runs it
(``is_compiling()`` false inside), so the graph runs the ops eager runs and eager selective
checkpointing matches it.

Compiled submodules (``module.compile()``, ``torch.compile(module)``) need no annotation: the
export traces their contents, op by op, as the compiled region named after the module's path
(``markers.compiled_region``, where the planner keeps nothing), and parameters are named as in
the model without ``torch.compile`` (no ``_orig_mod``). They run their own code, not compiled
code, throughout the export (the masks' forward and the reference step included). A model
compiled as a whole, or a function compiled on its own that the step calls, is an
``ExportError`` saying what to compile instead.

The known tracing failures are raised as ``ExportError``: its first line names the cause and
the fix, and what torch logged while tracing (held back meanwhile) follows it. A
model that enables its own gradient checkpointing gets a warning: the export turns it off
while tracing (the graph is the step the plan is for), and left on in training it would
recompute whole layers on top of the plan. The KV cache is off while the step is traced
(``config.use_cache = False``, then restored): the graph is the training step, as
checkpointing runs it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import device_export, expert_parallel
from ._compiled_regions import COMPILED_MODEL, is_compiled, traced_as_regions
from ._exporter import ExportResult, ModelDecl, export_forward, export_joint
from .annotate import LayerList, annotate, annotation_of
from .errors import ExportError, NoLayersWarning, OwnCheckpointingWarning


def causal_mask(
    batch: int, seq: int, dtype: torch.dtype = torch.float32, device: str | None = None
) -> torch.Tensor:
    """The 4D additive causal attention mask ``[batch, 1, seq, seq]``: 0 where a query may
    attend a key, the dtype's minimum where it may not. A HuggingFace model takes it as
    ``attention_mask`` for every layer as it is: it replaces the model's own masks, sliding
    windows included, so it is the mask of a model whose layers all attend causally over the
    whole sequence. The export does not need it (the model's own masks are traced).
    ``device="meta"`` gives its shape only, for a fake export."""
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(seq, seq, dtype=dtype, device=device)
    mask = mask.masked_fill(blocked, torch.finfo(dtype).min)
    return mask.expand(batch, 1, seq, seq).contiguous()


@dataclass(frozen=True)
class TensorSpec:
    """An input given by its shape and dtype only, for a fake export (a ``meta`` tensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def _materialized(value: Any) -> Any:
    return value.meta() if isinstance(value, TensorSpec) else value


class _Step(nn.Module):
    """``loss_fn(model(*args, **kwargs))`` with every tensor input positional (AOTAutograd
    traces positional tensors; the rest is bound here). Tensors inside lists, tuples and
    dicts are inputs too (a per-layer-type mask dict). With ``eager_layers``, the decoder
    layers run as eager runs them, each with the attention mask eager gave it (a mask that is
    not one of the inputs is one more input)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        positional: tuple[Any, ...],
        keywords: dict[str, Any],
    ):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.leaves, self.spec = tree_flatten((tuple(positional), dict(keywords)))
        self.eager_layers: _EagerLayers | None = None

    def own_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors of the step's own inputs, in order."""
        return tuple(v for v in self.leaves if isinstance(v, torch.Tensor))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor inputs, in the order ``forward`` takes them."""
        extra = self.eager_layers.extra if self.eager_layers is not None else ()
        return self.own_tensors() + extra

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        supply = iter(tensors)
        leaves = [next(supply) if isinstance(v, torch.Tensor) else v for v in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        layers = self.eager_layers
        with layers.running(tensors) if layers is not None else contextlib.nullcontext():
            return _loss_of(self.model(*args, **kwargs), self.loss_fn)


# The keyword argument HuggingFace models pass each decoder layer its attention mask in.
MASK_ARGUMENT = "attention_mask"


@dataclass
class _EagerLayers:
    """The decoder layers traced as eager runs them.

    Inside them ``torch.compiler.is_compiling()`` is false, as in eager (the step is traced
    with it true, so that the model's own mask code traces): the layers' compile-time paths
    (HuggingFace's grouped-experts fallback) are not traced. And each layer in ``masks``
    receives the attention mask it received in an eager forward of the step: the model's own
    masks, built by its own code with the branches eager takes on these inputs (HuggingFace:
    no mask where attention may be plainly causal, a sliding-window mask for sliding layers,
    per layer type). Traced, that code takes its traceable branches (a materialized causal
    mask, repeated key/value heads): the same loss, but other ops than eager (and eager
    selective checkpointing) runs. The mask code left unread drops out of the graph."""

    layers: LayerList
    # Layer -> the index of its mask among the step's tensor inputs, or None (no mask).
    masks: dict[int, int | None]
    # The masks that are none of the step's own inputs, inputs after them.
    extra: tuple[torch.Tensor, ...]

    @contextlib.contextmanager
    def running(self, inputs: tuple[torch.Tensor, ...]) -> Iterator[None]:
        """The layers run as eager runs them, their masks taken from ``inputs`` (the step's
        tensor inputs, traced or real)."""
        compiling: list[bool] = []

        def enter(index: int) -> Callable[..., Any]:
            def pre_hook(
                _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
                compiling.append(torch.compiler._is_compiling_flag)
                torch.compiler._is_compiling_flag = False
                if index not in self.masks:
                    return None
                slot = self.masks[index]
                return args, {**kwargs, MASK_ARGUMENT: None if slot is None else inputs[slot]}

            return pre_hook

        def leave(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
            torch.compiler._is_compiling_flag = compiling.pop()

        handles = [
            hook
            for index, layer in enumerate(self.layers)
            for hook in (
                layer.register_forward_pre_hook(enter(index), with_kwargs=True),
                layer.register_forward_hook(leave, always_call=True),
            )
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _decoder_layers(model: nn.Module) -> LayerList | None:
    """The model's decoder layers: the annotated ones, else ``model.layers`` (where a
    HuggingFace causal LM holds them, ``annotate``'s default), else None."""
    annotation = annotation_of(model)
    if annotation is not None and annotation.layers is not None:
        return annotation.layers
    inner = getattr(model, "model", None)
    found = getattr(inner, "layers", None) if isinstance(inner, nn.Module) else None
    return found if isinstance(found, nn.ModuleList) else None


def _eager_layers(step: _Step, layers: LayerList, *, fake: bool) -> _EagerLayers:
    """The step's layers as eager runs them; unless ``fake`` (nothing may run), with the
    masks they receive in an eager forward (no grad, RNG and buffers restored)."""
    if fake:
        return _EagerLayers(layers, {}, ())
    received: dict[int, Any] = {}

    def record(index: int) -> Callable[..., None]:
        def pre_hook(_module: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if MASK_ARGUMENT in kwargs:
                received[index] = kwargs[MASK_ARGUMENT]

        return pre_hook

    handles = [
        layer.register_forward_pre_hook(record(index), with_kwargs=True)
        for index, layer in enumerate(layers)
    ]
    buffers = [(b, b.detach().clone()) for b in step.model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            step(*step.tensors())
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return _received_masks(layers, received, step.own_tensors())


def _received_masks(
    layers: LayerList, received: dict[int, Any], own: tuple[torch.Tensor, ...]
) -> _EagerLayers:
    """Where each layer's mask comes from: a step input when it is one (the model passed it
    through), else an extra input (its own copy: the model may hand out an expanded view,
    which the export writes back into); layers that received no tensor or None are left as
    the model calls them."""
    slots = {id(tensor): index for index, tensor in enumerate(own)}
    extra: list[torch.Tensor] = []
    masks: dict[int, int | None] = {}
    for index, mask in received.items():
        if mask is None:
            masks[index] = None
        elif isinstance(mask, torch.Tensor):
            if id(mask) not in slots:
                slots[id(mask)] = len(own) + len(extra)
                extra.append(mask.clone(memory_format=torch.contiguous_format))
            masks[index] = slots[id(mask)]
    return _EagerLayers(layers, masks, tuple(extra))


def _loss_of(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """The loss of a step's output: ``loss_fn(output)``, else the output itself, its ``.loss``
    (an HF ``ModelOutput`` given labels), its ``"loss"`` (a dict) or its first element (a
    tuple, as HF models return it with ``return_dict=False``)."""
    if loss_fn is not None:
        return loss_fn(output)
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise ExportError(
        f"the model returned {type(output).__name__} without a loss (`.loss`, a dict's "
        '"loss" or a tuple\'s first element): pass loss_fn=lambda output: ... returning the '
        "scalar loss (or labels the model turns into one)"
    )


def export(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | list[Any] | dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    units: dict[str, list[str]] | None = None,
    layers: str | None = None,
    models: list[ModelDecl] | None = None,
    name: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    joint: bool = True,
    fake: bool | None = None,
    device: str | None = None,
    hw: Any = None,
    ep: int | None = None,
    ep_rank: int = 0,
    routing: list[list[int]] | None = None,
) -> ExportResult:
    """Exports one training step of ``model`` (see the module docstring).

    ``world_size`` / ``rank`` default to the current process group's (with ``ep``: ``ep`` and
    ``ep_rank``). Without one, a ``world_size`` above 1 and no ``rank`` export every rank in
    this one call, as data-parallel ranks: rank r's step takes the r-th of ``world_size`` equal
    parts of every input's batch (first dimension); the result is rank 0's, the others' in
    ``.other_ranks``, and ``.write(path)`` writes every rank's files as ``planner run --ranks
    N`` reads them (a fake export traces rank 0 alone: the ranks' graphs differ in their rank
    only). ``joint=False`` exports the forward graph only. ``fake``, ``device`` and ``hw``: a
    fake export (the module docstring); ``device`` defaults to ``"cuda"`` when ``hw`` is given,
    else ``"cpu"``. ``ep``, ``ep_rank``, ``routing``: expert parallelism (the module
    docstring).
    """
    if ep is None:
        return _export(
            model, example_inputs, loss_fn, units=units, layers=layers, models=models,
            name=name, world_size=world_size, rank=rank, joint=joint, fake=fake,
            device=device, hw=hw,
        )
    if fake is False:
        raise ExportError(
            "fake=False runs the step on this CPU, but expert parallelism is traced under a "
            "fake process group that exchanges nothing: pass fake=True (or leave it out)"
        )
    with expert_parallel.sharded(model, ep, ep_rank, routing):
        return _export(
            model, example_inputs, loss_fn, units=units, layers=layers, models=models,
            name=name, world_size=ep, rank=ep_rank, joint=joint, fake=True, device=device,
            hw=hw,
        )


def _export(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | list[Any] | dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    units: dict[str, list[str]] | None,
    layers: str | None,
    models: list[ModelDecl] | None,
    name: str | None,
    world_size: int | None,
    rank: int | None,
    joint: bool,
    fake: bool | None,
    device: str | None,
    hw: Any,
) -> ExportResult:
    """``export`` of one rank's model as it is."""
    if is_compiled(model):
        raise ExportError(COMPILED_MODEL)
    models = _models(model, units, layers, models)
    step = _step(model, loss_fn, example_inputs)
    world, own_rank = _world()
    world = world if world_size is None else world_size
    target = device or ("cuda" if hw is not None else "cpu")
    fake = _is_fake(step, fake, target, hw)
    traced = dict(name=name or type(model).__name__, models=models, world_size=world)
    if rank is None and own_rank is None and world > 1 and not fake:
        results = [
            _export_step(
                _step(model, loss_fn, _shard(example_inputs, world, r)),
                joint=joint, fake=False, target=target, hw=hw, rank=r, **traced,
            )
            for r in range(world)
        ]
        results[0].other_ranks = results[1:]
        return results[0]
    rank = (own_rank or 0) if rank is None else rank
    return _export_step(step, joint=joint, fake=fake, target=target, hw=hw, rank=rank, **traced)


def _step(
    model: nn.Module, loss_fn: Callable[[Any], torch.Tensor] | None, example_inputs: Any
) -> _Step:
    if isinstance(example_inputs, dict):
        return _Step(model, loss_fn, (), {k: _materialized(v) for k, v in example_inputs.items()})
    return _Step(model, loss_fn, tuple(_materialized(v) for v in example_inputs), {})


def _shard(example_inputs: Any, world: int, rank: int) -> Any:
    """Rank ``rank``'s share of the inputs: every tensor's rows (its first dimension, the
    batch) split into ``world`` equal parts, as data-parallel ranks split a batch."""

    def share(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0 or value.shape[0] % world:
            raise ExportError(
                f"world_size={world} splits every input's batch (first dimension) among the "
                f"ranks, but an input of shape {list(value.shape)} does not split into {world} "
                "equal parts: give a batch of a multiple of the world size, or export each rank "
                "in its own process (a process group gives world size and rank)"
            )
        return value.chunk(world)[rank]

    return tree_map(share, example_inputs)


def _export_step(
    step: _Step, *, joint: bool, fake: bool, target: str, hw: Any, **traced: Any
) -> ExportResult:
    """Traces (and, unless ``fake``, runs) one rank's step; the known tracing failures become
    ``ExportError``s that start with their cause and fix."""
    model = step.model
    torch_log = _HeldTorchLog()
    try:
        # Compiled submodules run their own code throughout (``traced_as_regions``): the
        # masks' forward and the reference step compute what the graph does, and no compiled
        # code runs (Dynamo would skip it for good under the reference's dispatch mode).
        with torch_log, _own_checkpointing_off(model), _kv_cache_off(model), traced_as_regions(
            step
        ):
            layers = _decoder_layers(model)
            if layers is not None:
                step.eager_layers = _eager_layers(step, layers, fake=fake)
            if fake:
                # A GPU trace always has a profile: no fields are the default profile's.
                gpu = ({} if hw is None else hw) if torch.device(target).type == "cuda" else None
                graph = device_export.export_on_device(
                    step, step.tensors(), joint=joint, device=target, hw=gpu, **traced
                )
                result = ExportResult(graph=graph, params={}, inputs={})
            else:
                exporter = export_joint if joint else export_forward
                result = exporter(step, step.tensors(), **traced)
    except Exception as error:  # the known tracing failures get their cause and fix
        explained = None if isinstance(error, ExportError) else explain_tracing_failure(error)
        if explained is None:
            torch_log.release()
            raise
        raise ExportError(explained + torch_log.appendix()) from error
    torch_log.release()
    return result


class _HeldTorchLog:
    """What torch logs to its streams (stderr) while the step is traced, held back
    (``with``) so that a known failure's ``ExportError`` starts with its cause and fix and
    carries torch's log after it (torch logs a failed fake kernel as a traceback before
    raising); ``release()`` passes the log on to the handlers as it would have gone. Other
    handlers (torch's structured trace) are left as they are."""

    def __init__(self) -> None:
        self.records: list[tuple[logging.Handler, logging.LogRecord]] = []
        self._handlers: dict[logging.Logger, list[logging.Handler]] = {}

    def __enter__(self) -> _HeldTorchLog:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if (
                isinstance(logger, logging.Logger)
                and logger.handlers
                and (name == "torch" or name.startswith("torch."))
            ):
                self._handlers[logger] = logger.handlers
                logger.handlers = [
                    _Holding(self.records, h) if type(h) is logging.StreamHandler else h
                    for h in logger.handlers
                ]
        return self

    def __exit__(self, *exc: object) -> None:
        for logger, handlers in self._handlers.items():
            logger.handlers = handlers
        self._handlers.clear()

    def release(self) -> None:
        for handler, record in self.records:
            handler.handle(record)
        self.records.clear()

    def appendix(self) -> str:
        """Torch's log as the end of an error message (nothing if it logged nothing)."""
        if not self.records:
            return ""
        lines = "\n".join(handler.format(record) for handler, record in self.records)
        return f"\n\ntorch's log while tracing:\n{lines}"


class _Holding(logging.Handler):
    """Stands in for ``target`` and keeps what it would emit (its level and filters pass)."""

    def __init__(
        self, records: list[tuple[logging.Handler, logging.LogRecord]], target: logging.Handler
    ):
        super().__init__(target.level)
        self.records, self.target = records, target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.filter(record):
            self.records.append((self.target, record))


def _is_fake(step: _Step, fake: bool | None, device: str, hw: Any) -> bool:
    """Whether the export only traces: asked for, or implied by ``meta`` tensors, another
    device than the CPU or a hardware profile; a real export of them is refused."""
    on_meta = [
        name
        for name, tensor in itertools.chain(
            step.model.named_parameters(), step.model.named_buffers(),
            (("an input", t) for t in step.tensors()),
        )
        if tensor.device.type == "meta"
    ]
    implied = [
        reason
        for reason, holds in (
            (f"`{on_meta[0]}` is on the meta device" if on_meta else "", bool(on_meta)),
            (f"the step is for `{device}`", torch.device(device).type != "cpu"),
            ("a hardware profile is given", hw is not None),
        )
        if holds
    ]
    if fake is False and implied:
        raise ExportError(
            f"fake=False runs the step on this CPU, but {implied[0]}: pass fake=True (or "
            "leave it out) to trace the step without running it"
        )
    return bool(fake) or bool(implied)


def _models(
    model: nn.Module,
    units: dict[str, list[str]] | None,
    layers: str | None,
    models: list[ModelDecl] | None,
) -> list[ModelDecl]:
    if models is not None:
        return models
    existing = annotation_of(model)
    if units is not None or layers is not None:
        if existing is not None:
            raise ExportError("the model is annotated already: pass neither `units` nor `layers`")
        return annotate(model, layers or "model.layers", units).models
    if existing is not None:
        return existing.models
    warnings.warn(
        NoLayersWarning(
            "the model is exported without declared layers (no rp.annotate, no `layers=` or "
            "`models=`): every plan of its graph checkpoints nothing (no-layers-annotated; "
            "`planner plan --deny-warnings` exits 3 on it). Fix: rp.annotate(model, "
            'layers="model.layers", units={...}) before exporting, or pass `layers=`'
        ),
        stacklevel=4,
    )
    return [ModelDecl("main", 0, {})]


def _world() -> tuple[int, int | None]:
    """The process group's world size and this process's rank; (1, None) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, None


@contextlib.contextmanager
def _own_checkpointing_off(model: nn.Module) -> Iterator[None]:
    """Turns a model's own gradient checkpointing (modules with ``gradient_checkpointing =
    True``, as HuggingFace sets it) off for the export, with a warning, and back on after.

    The graph is the step without it: what the planner plans. Left on in training, it would
    recompute whole layers on top of the plan.
    """
    owners = [
        (path, module)
        for path, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
    ]
    if owners:
        names = ", ".join(path or type(model).__name__ for path, _ in owners[:3])
        warnings.warn(
            OwnCheckpointingWarning(
                f"the model enables its own gradient checkpointing ({names}"
                f"{', ...' if len(owners) > 3 else ''}): the export ignores it (the graph is "
                "the step without it), and in training it would recompute whole layers on top "
                "of the plan; disable it (HuggingFace: model.gradient_checkpointing_disable()) "
                "and let the plan decide"
            ),
            stacklevel=4,
        )
    for _, module in owners:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for _, module in owners:
            module.gradient_checkpointing = True


def kv_cache_configs(module: nn.Module) -> list[Any]:
    """The configs with the KV cache on (``use_cache=True``) that ``module``'s modules hold
    (HuggingFace modules share their model's), each once."""
    configs = {
        id(config): config
        for sub in module.modules()
        if getattr(config := getattr(sub, "config", None), "use_cache", False) is True
    }
    return list(configs.values())


@contextlib.contextmanager
def _kv_cache_off(model: nn.Module) -> Iterator[None]:
    """The KV cache off (``config.use_cache = False``) while the step is traced, and back on
    after: a training step has no cache, and checkpointing turns it off
    (``recompute_planner.sac.checkpoint_layers``, HuggingFace's gradient checkpointing), so
    the graph is the step checkpointing runs."""
    configs = kv_cache_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


# The known tracing failures: (pattern on the error chain's text, cause and fix).
_KNOWN_FAILURES: tuple[tuple[str, str], ...] = (
    (
        r"_local_scalar_dense|DataDependentOutput",
        "data-dependent Python control flow ran while tracing with fake tensors "
        "(`aten._local_scalar_dense`: a `.item()`, `bool(tensor)` or `if tensor:`), in code "
        "that takes no traceable path under `torch.compiler.is_compiling()`. Fix: make the "
        "branch static (decide it from shapes, or before the step and pass the result in)",
    ),
    (
        r"Expected inputs of BF16 type",
        "`torch._grouped_mm` (the grouped expert matmul of MoE layers) accepts only bfloat16 "
        "inputs, also under fake tensors. Fix: export the model in bfloat16 "
        "(`model.to(torch.bfloat16)`), or choose a non-grouped experts implementation",
    ),
    (
        r"aten\.nonzero|DynamicOutputShape",
        "an op whose output shape depends on the data (`aten.nonzero`: boolean-mask indexing, "
        "`torch.where(mask)`, the per-expert token loops of eager MoE implementations) "
        "cannot be traced with static shapes. Fix: use a static-shape experts implementation "
        "(HuggingFace: `config._experts_implementation = \"grouped_mm\"` in bfloat16, or "
        "\"batched_mm\"), or fixed-capacity dispatch with index arithmetic",
    ),
    (
        r"Please convert all Tensors to FakeTensors",
        "the step reads a real tensor that is not one of its inputs (a tensor captured in a "
        "closure or a global, not a parameter or buffer). Fix: pass it in `example_inputs` or "
        "register it as a buffer",
    ),
)


# A function compiled with torch.compile ran while the step was traced (Dynamo's wrapper of a
# compiled callable is on the failure's stack). It fails in other ways than the known failures
# (a FunctionalTensor used on its own, a real tensor among fake ones), so it is told first.
_COMPILED_CALL_FAILURE = (
    "the step calls code compiled with torch.compile that is not a compiled submodule (a "
    "compiled function or method), which cannot be traced. Fix: compile the submodule that "
    "calls it instead (`module.compile()` or `torch.compile(module)`): the export traces a "
    "compiled submodule's contents as a compiled region named after its path"
)
_DYNAMO_ENTRY = ("_dynamo/eval_frame.py", "compile_wrapper")


def explain_tracing_failure(error: BaseException | None) -> str | None:
    """The cause and fix of a known tracing failure, from ``error`` and its causes."""
    chain: list[str] = []
    seen: set[int] = set()
    compiled_call = False
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(f"{type(error).__name__}: {error}")
        compiled_call = compiled_call or _ran_compiled_code(error)
        error = error.__cause__ or error.__context__
    text = "\n".join(chain)
    first = chain[-1].splitlines()[0] if chain else ""
    if compiled_call:
        return f"{_COMPILED_CALL_FAILURE}. (torch: {first})"
    for pattern, explanation in _KNOWN_FAILURES:
        if re.search(pattern, text):
            return f"{explanation}. (torch: {first})"
    return None


def _ran_compiled_code(error: BaseException) -> bool:
    """Whether ``error`` was raised inside a call of a ``torch.compile``d callable."""
    file, function = _DYNAMO_ENTRY
    return any(
        frame.filename.replace("\\", "/").endswith(file) and frame.name == function
        for frame in traceback.extract_tb(error.__traceback__)
    )


__all__ = [
    "MASK_ARGUMENT",
    "TensorSpec",
    "causal_mask",
    "explain_tracing_failure",
    "export",
    "kv_cache_configs",
]
