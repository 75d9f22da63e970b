"""CPU dropout under eager selective checkpointing: eager runs it as an in-place `bernoulli_`
the checkpoint cannot cache, so an eager plan of a CPU-traced graph replays it (with the
generator state restored), and what the step holds when forward ends is the plan's saved set
plus the generator state each layer stashes."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompute_planner as rp
from recompute_planner import _measure as measure
from recompute_planner import sac
from recompute_planner._exporter import ModelDecl, export_joint
from recompute_planner.markers import checkpoint_record, layer_scope

REPO_ROOT = Path(__file__).resolve().parents[2]
# The CPU generator state `torch.utils.checkpoint` stashes per layer (`torch.get_rng_state()`).
RNG_STATE_BYTES = 5056


@pytest.fixture(scope="module")
def case():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import predictions as table
    finally:
        sys.path.pop(0)
    return table.zoo_case("dense_dropout", 8, 64)


def plan_of(graph, keep, executor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, executor=executor)


def dropout_reasons(plan) -> set[str]:
    return {n.reason for n in plan.nodes if n.op.startswith("aten.native_dropout")}


@pytest.mark.parametrize("keep", [None, "all"], ids=["none", "all"])
def test_eager_plan_of_a_cpu_graph_replays_dropout(case, keep):
    """The graph executor saves dropout (`--random-ops save`); the eager plan of the same
    CPU-traced graph replays it."""
    assert dropout_reasons(plan_of(case.graph, keep, "graph")) == {"random"}
    assert dropout_reasons(plan_of(case.graph, keep, "eager")) == {"random-replayed"}


@pytest.mark.parametrize("keep", [None, "all"], ids=["none", "all"])
def test_eager_step_holds_the_saved_set_and_each_layers_generator_state(case, keep):
    """Measured when forward ends: the eager plan's saved bytes and one generator state per
    checkpointed layer with dropout (the CPU allocator counts the stash)."""
    plan = plan_of(case.graph, keep, "eager")
    loss, params = case.step(plan)
    step = measure.measure_step(loss, params, case.input_bytes)
    layers = {(n.model, n.layer) for n in plan.nodes if n.reason == "random-replayed"}
    assert len(layers) == 2
    assert step.saved_bytes == plan.memory.saved_bytes + RNG_STATE_BYTES * len(layers)


def test_the_generator_state_is_the_stash_the_planner_counts():
    """The CPU generator state `torch.get_rng_state()` returns: the bytes the eager model
    counts per stash (planner/src/partition/eager.rs, `CPU_GENERATOR_STATE_BYTES`)."""
    state = torch.get_rng_state()
    assert state.device.type == "cpu"
    assert state.numel() * state.element_size() == RNG_STATE_BYTES


class TinyDropoutLayer(nn.Module):
    """A layer whose activations (a few hundred bytes) are far smaller than the generator
    state its checkpoint stashes."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.proj = nn.Linear(TINY_WIDTH, TINY_WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with layer_scope("main", self.index):
            h = checkpoint_record("mlp.begin", x)
            out = F.dropout(torch.relu(self.proj(h)), p=0.5, training=True)
            return checkpoint_record("mlp.end", out + x)


class TinyDropoutModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(TinyDropoutLayer(i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A factory op naming the device: how the planner tells a graph traced on the CPU.
        x = x + torch.zeros(TINY_WIDTH, device=x.device)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


TINY_TOKENS, TINY_WIDTH = 4, 8


@pytest.mark.parametrize("keep", [None, "all"], ids=["none", "all"])
def test_eager_plan_counts_each_layers_generator_state_stash(keep):
    """With activations of a few hundred bytes, the step's peak is the checkpoints' stashes
    of the CPU generator state (one per layer until its backward ends, one more while a
    recompute runs): the eager plan of the CPU-traced graph predicts the measured peak within
    3%, and without the stashes it would miss most of it."""
    inputs = (torch.randn(TINY_TOKENS, TINY_WIDTH, generator=torch.Generator().manual_seed(1)),)
    models = [ModelDecl("main", 2, {"SAVE_MLP": [("mlp.begin", "mlp.end")]})]
    graph = export_joint(TinyDropoutModel(), inputs, name="tiny_dropout", models=models).graph
    plan = plan_of(graph, keep, "eager")
    model = TinyDropoutModel()
    sac.checkpoint_layers(model.layers, plan)
    params = [p for p in model.parameters() if p.requires_grad]
    step = measure.measure_step(lambda: model(*inputs), params, measure.tensor_bytes(inputs[0]))
    predicted = plan.memory.peak_bytes
    assert abs(predicted - step.peak_bytes) <= 0.03 * step.peak_bytes, (predicted, step.peak_bytes)
    assert step.peak_bytes > 2 * RNG_STATE_BYTES


@pytest.mark.parametrize("keep", [None, ["SAVE_MLP"]], ids=["none", "SAVE_MLP"])
def test_eager_plan_predicts_the_measured_peak_with_cpu_dropouts_noise(case, keep):
    """Eager CPU dropout keeps a float noise tensor (4 bytes an element) where the traced
    `native_dropout` returns a bool mask: the eager plan counts it, and predicts the measured
    peak within 3% (with the traced mask's bytes it misses by more)."""
    plan = plan_of(case.graph, keep, "eager")
    loss, params = case.step(plan)
    measured = measure.measure_step(loss, params, case.input_bytes).peak_bytes
    predicted = plan.memory.peak_bytes
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
