"""IR node order is eager execution order (SPEC §3: marker semantics depend on it).

The same step runs eagerly under a TorchDispatchMode that records every aten op dispatched in
forward and backward; the exported joint graph must list the same ops in the same order.

One normalisation, both sides: ``aten.detach.default`` is dropped. It computes nothing (an
alias for autograd's bookkeeping): eager dispatches it when autograd saves an op's output for
backward and when AccumulateGrad stores ``.grad``; the joint graph has no ``.grad`` (gradients
are outputs) and keeps only the saved-output detaches. Everything else, the marker, the
in-place ``mul_``, SDPA and its backward, normalisation layers and the loss, must match one for
one. The backward seed is created before recording (``loss.backward(seed)``), since in the
joint graph it is the tangent input rather than an op.

Functional collectives need one more mapping (second test): eager returns an
AsyncCollectiveTensor and dispatches ``_c10d_functional._wrap_tensor_autograd`` right after the
collective, waiting later inside the subclass where no dispatch mode sees it; the trace waits
explicitly with ``_c10d_functional.wait_tensor`` at that same position.

Known divergences kept out of these models on purpose (real ones): CPU eager ``F.dropout`` runs
``empty_like/bernoulli_/div_/mul`` where the trace has ``native_dropout`` (the Python
dispatcher's decomposition); eager ``BatchNorm`` dispatches ``native_batch_norm`` where the
trace has ``_native_batch_norm_legit``; an op eager runs whose result nobody reads (in the zoo
MoE, a backward ``slice`` of the dispatch buffer) is absent, AOTAutograd having removed it as
dead code; and eager ``all_gather_into_tensor`` dispatches an extra ``view`` the trace lacks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from export_support import (
    MAIN,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    Lambda,
    fake_process_group,
    tiny_decoder,
)
from torch.utils._python_dispatch import TorchDispatchMode

from recompute_planner.export import export_joint

BOOKKEEPING = {"aten.detach.default"}
EAGER_TO_TRACED = {
    "_c10d_functional._wrap_tensor_autograd.default": "_c10d_functional.wait_tensor.default"
}


class _RecordOps(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _without_bookkeeping(ops: list[str]) -> list[str]:
    return [op for op in ops if op not in BOOKKEEPING]


def test_exported_order_is_eager_dispatch_order():
    model, args, models = tiny_decoder()
    graph = export_joint(model, args, name="order", models=models).graph

    seed = torch.ones(())
    with _RecordOps() as recorder:
        loss = model(*args)
        forward_count = len(recorder.ops)
        loss.backward(seed)

    eager = _without_bookkeeping(recorder.ops)
    exported = _without_bookkeeping([n.op for n in graph.nodes])
    assert exported == eager
    # The forward-phase nodes are exactly the ops eager ran before backward started.
    eager_forward = _without_bookkeeping(recorder.ops[:forward_count])
    phases = [n.phase for n in graph.nodes if n.op not in BOOKKEEPING]
    assert phases == [PHASE_FORWARD] * len(eager_forward) + [PHASE_BACKWARD] * (
        len(exported) - len(eager_forward)
    )


def test_functional_collectives_run_where_eager_runs_them():
    def step(self, x):
        h = funcol.all_to_all_single(self.lin(x), [2, 2], [2, 2], dist.group.WORLD)
        return (torch.relu(h) * h).sum()

    torch.manual_seed(0)
    module, x = Lambda(step), torch.randn(4, 4)
    with fake_process_group(world_size=2):
        graph = export_joint(module, (x,), name="a2a", models=MAIN).graph
        seed = torch.ones(())
        with _RecordOps() as recorder:
            module(x).backward(seed)

    eager = [EAGER_TO_TRACED.get(op, op) for op in _without_bookkeeping(recorder.ops)]
    exported = _without_bookkeeping([n.op for n in graph.nodes])
    assert exported == eager
    assert exported.count("_c10d_functional.all_to_all_single.default") == 2  # fwd and bwd
