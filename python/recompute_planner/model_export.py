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

- ``example_inputs``: a tuple of positional inputs or a dict of keyword inputs; tensors become
  graph inputs, a ``TensorSpec`` (shape and dtype) is a ``meta`` tensor, anything else is
  passed as it is on every call;
- ``loss_fn(output) -> scalar``: how the output becomes the loss; without it the output must
  be the loss or carry it as ``.loss`` (HuggingFace models given ``labels``);
- ``units`` / ``layers``: annotate the model first (``recompute_planner.annotate``), or pass
  ``models`` declared yourself; an annotated model needs neither.

The known tracing failures are raised as ``ExportError`` naming the cause and the fix. A
model that enables its own gradient checkpointing gets a warning: the export turns it off
while tracing (the graph is the step the plan is for), and left on in training it would
recompute whole layers on top of the plan.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from . import device_export
from .annotate import annotate, annotation_of
from .errors import ExportError
from .export import ExportResult, ModelDecl, export_forward, export_joint


def causal_mask(
    batch: int, seq: int, dtype: torch.dtype = torch.float32, device: str | None = None
) -> torch.Tensor:
    """The 4D additive causal attention mask ``[batch, 1, seq, seq]``: 0 where a query may
    attend a key, the dtype's minimum where it may not. HuggingFace models take it as
    ``attention_mask`` without inspecting it, which keeps their mask code traceable.
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
    traces positional tensors; the rest is bound here)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        positional: tuple,
        keywords: dict[str, Any],
    ):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.positional = positional
        self.keywords = keywords

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor inputs, in the order ``forward`` takes them."""
        values = list(self.positional) + list(self.keywords.values())
        return tuple(v for v in values if isinstance(v, torch.Tensor))

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        supply = iter(tensors)
        args = [next(supply) if isinstance(v, torch.Tensor) else v for v in self.positional]
        kwargs = {
            k: next(supply) if isinstance(v, torch.Tensor) else v for k, v in self.keywords.items()
        }
        return _loss_of(self.model(*args, **kwargs), self.loss_fn)


def _loss_of(output: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise ExportError(
        f"the model returned {type(output).__name__} without a `.loss`: pass "
        "loss_fn=lambda output: ... returning the scalar loss (or labels the model turns "
        "into one)"
    )


def export(
    model: nn.Module,
    example_inputs: tuple | list | dict,
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
) -> ExportResult:
    """Exports one training step of ``model`` (see the module docstring).

    ``world_size`` / ``rank`` default to the current process group's. ``joint=False`` exports
    the forward graph only. ``fake``, ``device`` and ``hw``: a fake export (the module
    docstring); ``device`` defaults to ``"cuda"`` when ``hw`` is given, else ``"cpu"``.
    """
    models = _models(model, units, layers, models)
    if isinstance(example_inputs, dict):
        step = _Step(model, loss_fn, (), {k: _materialized(v) for k, v in example_inputs.items()})
    else:
        step = _Step(model, loss_fn, tuple(_materialized(v) for v in example_inputs), {})
    world, own_rank = _world()
    target = device or ("cuda" if hw is not None else "cpu")
    fake = _is_fake(step, fake, target, hw)
    traced = dict(
        name=name or type(model).__name__,
        models=models,
        world_size=world if world_size is None else world_size,
        rank=own_rank if rank is None else rank,
    )
    try:
        with _own_checkpointing_off(model):
            if fake:
                # A GPU trace always has a profile: no fields are the default profile's.
                gpu = ({} if hw is None else hw) if torch.device(target).type == "cuda" else None
                graph = device_export.export_on_device(
                    step, step.tensors(), joint=joint, device=target, hw=gpu, **traced
                )
                return ExportResult(graph=graph, params={}, inputs={})
            exporter = export_joint if joint else export_forward
            return exporter(step, step.tensors(), **traced)
    except ExportError:
        raise
    except Exception as error:  # the known tracing failures get their cause and fix
        explained = explain_tracing_failure(error)
        if explained is None:
            raise
        raise ExportError(explained) from error


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
    return [ModelDecl("main", 0, {})]


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class OwnCheckpointingWarning(UserWarning):
    """The model checkpoints its layers itself; the export does not see it."""


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


# The known tracing failures: (pattern on the error chain's text, cause and fix).
_KNOWN_FAILURES: tuple[tuple[str, str], ...] = (
    (
        r"_local_scalar_dense|DataDependentOutput",
        "data-dependent Python control flow ran while tracing with fake tensors "
        "(`aten._local_scalar_dense`: a `.item()`, `bool(tensor)` or `if tensor:`); in "
        "HuggingFace models this is the mask code: its packed-sequence check on "
        "`position_ids` (no `attention_mask`, no cache: training) or its padding check on a 2D "
        "`attention_mask`. Fix: pass the 4D additive causal mask as `attention_mask` "
        "(`recompute_planner.model_export.causal_mask(batch, seq)`), which the mask code uses "
        "as it is; in your own code, make the branch static",
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


def explain_tracing_failure(error: BaseException) -> str | None:
    """The cause and fix of a known tracing failure, from ``error`` and its causes."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    text = "\n".join(chain)
    for pattern, explanation in _KNOWN_FAILURES:
        if re.search(pattern, text):
            first = chain[-1].splitlines()[0] if chain else ""
            return f"{explanation}. (torch: {first})"
    return None
