"""Stock HuggingFace families through every path, as docs/huggingface.md's recipe exports
them: the model as configured (KV cache on, its own masks: no `attention_mask` given),
annotated with layer scopes and units.

For each family (`hf_families.STOCK_FAMILIES`: Llama, Mistral with a sliding window, Qwen2,
Qwen3 mixing full and sliding layers, Gemma 2 with tied embeddings and sliding layers, Phi-3
with fused projections and a sliding window, Qwen3-MoE, Mixtral, DeepSeek-V3):

- the export's loss is the model's own;
- every unit alone plans without an error diagnostic;
- eager selective checkpointing from the eager plan keeping every unit: loss and gradients
  bit-identical to the plain step;
- the torch.compile stage (`torch.compile` with the stage's backend, as the README and
  docs/huggingface.md compile, stopped after the partition) saves and replays exactly its plan;
- `planner run --check` runs the exported step keeping every unit: the plan's loss and
  gradients bit-identical to no checkpointing and whole-layer recompute, and PyTorch's within
  float32 tolerance.

Kernels that sum in no fixed order (the expert-weight gradients of batched-matmul experts) run
under PyTorch's deterministic algorithms, so that bit-identity compares the plans, not thread
schedules.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import recompute_planner as rp
from export_support import planner_run
from hf_families import STOCK_FAMILIES
from recompute_planner import sac
from recompute_planner.model_export import _Step
from test_compile_stage import (
    Recording,
    assert_saves_and_replays_the_plan,
    run_inductor_partition,
)

pytest.importorskip("transformers")


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def step_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list]:
    loss = model(**batch).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return loss.detach(), list(grads)


def assert_bit_identical(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("family", STOCK_FAMILIES, ids=lambda f: f.name)
def test_stock_family_exports_plans_checkpoints_compiles_and_runs(
    family, deterministic, tmp_path, builders_agree
):
    model = family.model()
    annotation = rp.annotate(model, layers="model.layers", units=family.units)
    batch = family.batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        step = rp.export(model, batch)
        assert torch.equal(step.loss, family.model()(**batch).loss.detach())
        for unit in family.units:
            rp.plan(step, keep=[unit])

        plan = rp.plan(step, keep=list(family.units), executor="eager")
        with pytest.warns(rp.KvCacheOffWarning):
            policies = sac.checkpoint_layers(model.model.layers, plan)
        assert_bit_identical(step_grads(model, batch), step_grads(family.model(), batch))
        assert any(policy.held_bytes() > 0 for policy in policies.values())
        policies.remove()

        stage = Recording(annotation.models, list(family.units))
        compiled = _Step(model, None, (), batch)
        run_inductor_partition(stage, compiled, compiled.tensors())
    assert_saves_and_replays_the_plan(stage)

    # Last: skipped where the planner was built without the runtime.
    step.write(tmp_path / "step.pb")
    done = planner_run(str(tmp_path / "step.pb"), "--keep", ",".join(family.units), "--check")
    assert done.returncode == 0, done.stderr
