"""Graphs of GPU runs exported on a CPU-only machine, with fake CUDA tensors.

A step traced on CPU lacks what only a GPU run has: the device-to-host ``_to_copy`` of routing
counts that feeds all-to-all split sizes, and the host-to-device copies back. Under
``FakeTensorMode`` CUDA tensors exist without a GPU (no memory, no kernels; shapes, dtypes and
devices propagate), so ``export_forward_on_device`` traces the step with every parameter,
buffer and input a fake tensor on ``device`` and factory calls defaulting to it: the graph's
ops carry the real devices (``device`` attributes ``cuda:0`` / ``cpu``) and the copies between
them.

Only the forward graph: tracing backward through fake CUDA tensors needs the CUDA runtime
(the autograd engine asks for the device's primary context), which a CPU-only machine lacks.
The planner decides every forward op of such a graph (``--collectives save`` keeps the
device-to-host copy, reason ``saved-collective``); the saved set and memory need a joint graph.
No reference tensors are produced: nothing runs for real.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from . import export as low
from .export import ModelDecl
from .proto import graph_pb2


class _Functional(nn.Module):
    """``module`` called with its parameters and buffers passed in (``functional_call``), so
    AOTAutograd lifts fake tensors as inputs; ``module`` is held unregistered."""

    def __init__(self, module: nn.Module, state_names: list[str]):
        super().__init__()
        object.__setattr__(self, "inner", module)
        self.state_names = state_names

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        count = len(self.state_names)
        state = dict(zip(self.state_names, flat[:count]))
        return torch.func.functional_call(self.inner, state, flat[count:])


def export_forward_on_device(
    module: nn.Module,
    args: tuple,
    *,
    name: str,
    models: list[ModelDecl],
    device: str = "cuda",
    world_size: int = 1,
    rank: int = 0,
) -> graph_pb2.Graph:
    """The forward graph of ``module(*args)`` as it runs on ``device`` (see the module
    docstring). Values keep the exporter's names (parameter paths, ``input.<i>``)."""
    flat = low._flat_inputs(module, args)
    mode = FakeTensorMode()
    with mode:
        fake = tuple(
            mode.from_tensor(f.tensor).to(device).requires_grad_(f.tensor.requires_grad)
            for f in flat
        )
    state = [f.name for f in flat[: len(flat) - len(args)]]
    with torch.device(device), low._module_path_scopes(module):
        forward, _ = low._capture(_Functional(module, state), fake, joint=False)
    built = low._build_graph(
        forward,
        set(low._op_nodes(forward)),
        flat,
        name=name,
        models=models,
        metadata=low._metadata(low.EXPORTER_VERSION, world_size, rank),
    )
    return built.graph
