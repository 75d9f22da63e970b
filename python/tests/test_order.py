"""IR node order is eager execution order, and a node's phase is the pass that ran it (docs/ir.md:
marker semantics depend on the order; replay scheduling depends on the phases).

The same step runs eagerly under a TorchDispatchMode that records every aten op dispatched in
forward and in backward; the exported joint graph must list the same ops in the same order, and
its forward-phase nodes must be exactly the ops eager ran before backward started. The step is
the exporter's eager reference: ``torch.autograd.grad(loss, params, seed)``, with the seed made
before recording (in the joint graph it is the tangent input rather than an op). That includes
the ``detach`` autograd dispatches when it saves an op's output for backward (forward) and when
backward unpacks it (backward); ``loss.backward()`` would add one more per parameter, where
AccumulateGrad stores ``.grad``, which the joint graph has no counterpart of.

Mappings and known divergences, real ones kept out of these models on purpose:

- markers: eagerly ``checkpoint_record`` returns its tensor and dispatches nothing; the graph's
  marker nodes are left out of the comparison;
- functional collectives: eager returns an AsyncCollectiveTensor and dispatches
  ``_c10d_functional._wrap_tensor_autograd`` right after the collective, waiting later inside
  the subclass where no dispatch mode sees it; the trace waits explicitly with
  ``_c10d_functional.wait_tensor`` at that same position;
- a slice assignment's backward: eager's CopySlices dispatches ``as_strided`` where the trace
  has ``slice`` (the buffer-filling model is compared in forward only);
- CPU eager ``F.dropout`` runs ``empty_like/bernoulli_/div_/mul`` where the trace has
  ``native_dropout`` (the Python dispatcher's decomposition); eager ``F.one_hot`` checks its
  input with ``aminmax`` and ``_local_scalar_dense``, which the trace leaves out (it traces the
  ``zeros`` and ``scatter_`` that follow); eager ``BatchNorm`` dispatches
  ``native_batch_norm`` where the trace has ``_native_batch_norm_legit``; an op eager runs
  whose result nobody reads (in the zoo MoE, a backward ``slice`` of the dispatch buffer) is
  absent, AOTAutograd having removed it as dead code; and eager ``all_gather_into_tensor``
  dispatches an extra ``view`` the trace lacks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

from export_support import (
    MAIN,
    ONE_LAYER,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    Lambda,
    buffer_fill_step,
    fake_process_group,
    tiny_decoder,
)
from recompute_planner._exporter import export_joint
from recompute_planner.markers import MARKER_OP

EAGER_TO_TRACED = {
    "_c10d_functional._wrap_tensor_autograd.default": "_c10d_functional.wait_tensor.default"
}


class _RecordOps(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(EAGER_TO_TRACED.get(str(func), str(func)))
        return func(*args, **(kwargs or {}))


def eager_step(module: torch.nn.Module, args: tuple) -> tuple[list[str], list[str]]:
    """The ops one eager training step dispatches: (forward, backward)."""
    seed = torch.ones(())
    with _RecordOps() as recorder:
        loss = module(*args)
        forward = len(recorder.ops)
        torch.autograd.grad(loss, list(module.parameters()), seed)
    return recorder.ops[:forward], recorder.ops[forward:]


def unmarked(graph) -> list:
    """The graph's nodes but its markers, which eager does not dispatch."""
    return [n for n in graph.nodes if n.op != MARKER_OP]


def phases_of(nodes) -> list[int]:
    return [n.phase for n in nodes]


def split(forward: int, total: int) -> list[int]:
    return [PHASE_FORWARD] * forward + [PHASE_BACKWARD] * (total - forward)


def test_exported_order_and_phases_are_eager_dispatch_order_and_passes():
    model, args, models = tiny_decoder()
    nodes = unmarked(export_joint(model, args, name="order", models=models).graph)
    forward, backward = eager_step(model, args)
    assert [n.op for n in nodes] == forward + backward
    assert phases_of(nodes) == split(len(forward), len(nodes))
    assert "aten.detach.default" in forward


def test_ops_filling_a_buffer_in_place_run_where_eager_runs_them():
    """The `new_empty` + slice `copy_` pattern: same forward ops, all forward-phase."""
    torch.manual_seed(0)
    module, args = Lambda(buffer_fill_step), (torch.randn(4, 4),)
    nodes = unmarked(export_joint(module, args, name="fill", models=ONE_LAYER).graph)
    forward, _ = eager_step(module, args)
    assert [n.op for n in nodes][: len(forward)] == forward
    assert forward.count("aten.copy_.default") == 2
    assert phases_of(nodes) == split(len(forward), len(nodes))


def test_functional_collectives_run_where_eager_runs_them():
    def step(self, x):
        h = funcol.all_to_all_single(self.lin(x), [2, 2], [2, 2], dist.group.WORLD)
        return (torch.relu(h) * h).sum()

    torch.manual_seed(0)
    module, x = Lambda(step), torch.randn(4, 4)
    with fake_process_group(world_size=2):
        graph = export_joint(module, (x,), name="a2a", models=MAIN).graph
        forward, backward = eager_step(module, (x,))

    nodes = unmarked(graph)
    exported = [n.op for n in nodes]
    assert exported == forward + backward
    assert phases_of(nodes) == split(len(forward), len(nodes))
    assert exported.count("_c10d_functional.all_to_all_single.default") == 2  # fwd and bwd
