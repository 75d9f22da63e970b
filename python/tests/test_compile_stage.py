"""The torch.compile planning stage: the compiled step saves what the plan saves.

A training step of each zoo model is compiled with the stage (`recompute_planner.compile`): the
joint graph is planned in memory and tagged, torch's min-cut partitioner cuts it, and the
tensors the forward graph returns for backward are compared with the plan's saved set.

What "equal" means, value by value (anything else is a failure):

- a view stands for its base: the partitioner never bans recomputing a view, so it saves the
  base where the plan (outside checkpointed layers, as autograd would) names the view;
  a marker (`checkpoint_record`, an identity the stage removes after planning) stands for its
  input;
- tangents are not forward outputs: the plan lists them as graph inputs backward reads;
- RNG states the partitioner saves to replay a random op (`run_and_save_rng_state`: CPU SDPA
  is tagged `nondeterministic_seeded` for its dropout) are not values of the graph.

Most cases compile through `aot_module` with the stage's `partition_fn` and no code
generation (seconds per model); the inductor path (`torch.compile` with the stage as
`joint_custom_post_pass`) and Dynamo + `aot_autograd` run once each, with gradients checked
against eager.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings

import pytest
import torch
from functorch.compile import aot_module, make_boxed_func

import recompute_planner as rp
from graph_walk import golden_param
from recompute_planner import compile as stage_mod
from recompute_planner.markers import MARKER_OP, MARKER_OVERLOAD, markers_in_compiled_graphs
from recompute_planner.zoo.catalog import entry, make_inputs, model_decls
from recompute_planner.zoo.goldens import GOLDENS, traced_group
from recompute_planner.zoo.model import CausalLM

# Compiled and eager steps differ by fused kernels' rounding.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
JOINT = [g.name for g in GOLDENS if g.joint]


class Captured:
    """A partition_fn around the stage's: keeps the IR, the plan and both graphs."""

    def __init__(self, stage: stage_mod.PlanningStage):
        self.stage = stage
        self.irs: list = []

    def partition_fn(self, joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        to_ir = stage_mod.joint_graph_to_ir

        def keep_ir(*args, **kw):
            ir = to_ir(*args, **kw)
            self.irs.append(ir)
            return ir

        stage_mod.joint_graph_to_ir = keep_ir
        try:
            fw, bw = self.stage.partition_fn(
                joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
            )
        finally:
            stage_mod.joint_graph_to_ir = to_ir
        self.fw, self.bw, self.num_fwd_outputs = fw, bw, num_fwd_outputs
        return fw, bw

    @property
    def plan(self) -> rp.Plan:
        return self.stage.plans[-1]

    def saved(self) -> set[str]:
        """The tensors the forward graph returns for backward (RNG states excluded)."""
        outputs = self.fw.graph.output_node().args[0][self.num_fwd_outputs :]
        return {
            n.name
            for n in outputs
            if isinstance(n.meta.get("val"), torch.Tensor) and not _is_rng_state(n)
        }

    def backward_nodes(self) -> set[str]:
        return {n.name for n in self.bw.graph.nodes if n.op == "call_function"}


def _is_rng_state(node: torch.fx.Node) -> bool:
    source = node.args[0] if node.target is operator.getitem else node
    return getattr(source, "target", None) is torch.ops.higher_order.run_and_save_rng_state


def storage_bases(ir) -> callable:
    """value -> the value it aliases: through views and markers, to the base."""
    producers = {v: n for n in ir.nodes for v in n.outputs}

    def base(value: str) -> str:
        node = producers.get(value)
        while node is not None and (node.schema.HasField("view_of") or node.op == MARKER_OP):
            value = node.inputs[node.schema.view_of if node.op != MARKER_OP else 0]
            node = producers.get(value)
        return value

    return base


def assert_saves_the_plan(captured: Captured) -> None:
    ir = captured.irs[-1]
    base = storage_bases(ir)
    tangents = {v.name for v in ir.values if v.role == rp_role("ROLE_TANGENT")}
    planned = {base(v) for v in captured.plan.saved_values()} - tangents
    partitioned = {base(v) for v in captured.saved()}
    assert partitioned == planned, (
        f"saved by the partitioner only: {sorted(partitioned - planned)}; "
        f"by the plan only: {sorted(planned - partitioned)}"
    )


def rp_role(name: str) -> int:
    from recompute_planner.proto import graph_pb2

    return getattr(graph_pb2, name)


def nop_compiler(graph_module, _inputs):
    return make_boxed_func(graph_module.forward)


def aot_step(name: str, keep, *, warn: bool = False):
    """Compiles and runs one training step of zoo model `name` through `aot_module` with the
    stage; returns what was captured. Planner warnings are silenced unless `warn`."""
    cfg = entry(name).config
    captured = Captured(stage_mod.PlanningStage(model_decls(cfg), keep))
    with traced_group(cfg.world_size), warnings.catch_warnings():
        if not warn:
            warnings.simplefilter("ignore", rp.PlannerWarning)
        model = CausalLM(cfg)
        compiled = aot_module(
            model, fw_compiler=nop_compiler, bw_compiler=nop_compiler,
            partition_fn=captured.partition_fn,
        )
        compiled(*make_inputs(cfg)).backward()
    return captured


def aot_cases():
    for name in JOINT:
        yield golden_param(name, "all", id=f"{name}-all")
    yield pytest.param("dense", None, id="dense-none")
    yield pytest.param("moe_ep2", ["SAVE_MOE_DISPATCH"], id="moe_ep2-dispatch")


@pytest.mark.parametrize("name, keep", list(aot_cases()))
def test_compiled_step_saves_what_the_plan_saves(name, keep):
    captured = aot_step(name, keep)
    assert_saves_the_plan(captured)
    # The markers found the units, then left the graph.
    assert not [n for n in captured.fw.graph.nodes if n.target is MARKER_OVERLOAD]


def test_indexer_topk_is_not_recomputed_when_its_unit_is_kept():
    """With SAVE_DSA_INDEXER the indexer's top-k stays out of the backward graph (it re-runs
    there under whole-layer recompute); the plan's diagnostics are warnings at compile time."""
    with pytest.warns(rp.PlannerWarning, match="nondeterministic-replay"):
        kept = aot_step("glm_dsa_ep2", ["SAVE_DSA_INDEXER"], warn=True)
    assert_saves_the_plan(kept)
    whole = aot_step("glm_dsa_ep2", None)
    indexer_topk = {
        n.name
        for n in kept.plan.nodes
        if n.op == "aten.topk.default" and n.unit == "SAVE_DSA_INDEXER"
    }
    assert len(indexer_topk) == 3  # main layers 0, 1 and the MTP layer
    assert not indexer_topk & kept.backward_nodes()
    assert indexer_topk <= whole.backward_nodes()


def test_an_unknown_unit_fails_the_compile():
    cfg = entry("dense").config
    stage = stage_mod.PlanningStage(model_decls(cfg), ["SAVE_MOE_GATE"])
    compiled = aot_module(
        CausalLM(cfg), fw_compiler=nop_compiler, bw_compiler=nop_compiler,
        partition_fn=stage.partition_fn,
    )
    with pytest.raises(rp.PlannerError, match="unknown-unit"):
        compiled(*make_inputs(cfg))


# --------------------------------------------------------------------------------------------
# Gradients against eager, through the two real compile paths


def eager_step(model: torch.nn.Module, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(*inputs)
    params = [p for p in model.parameters()]
    return loss.detach(), list(torch.autograd.grad(loss, params))


def assert_same_step(compiled: tuple, eager: tuple) -> None:
    torch.testing.assert_close(compiled[0], eager[0], rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_inductor_step_saves_the_plan_and_matches_eager(monkeypatch):
    """`torch.compile` (inductor) with the stage installed: the post pass plans, the saved set
    is the plan's, and loss and gradients match eager."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config

    cfg = entry("dense").config
    inputs = make_inputs(cfg)
    stage = stage_mod.PlanningStage(model_decls(cfg), "all")
    captured = Captured(stage)
    min_cut = compile_fx.min_cut_rematerialization_partition

    def spy(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        fw, bw = min_cut(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        captured.fw, captured.bw, captured.num_fwd_outputs = fw, bw, num_fwd_outputs
        return fw, bw

    monkeypatch.setattr(compile_fx, "min_cut_rematerialization_partition", spy)
    to_ir = stage_mod.joint_graph_to_ir
    monkeypatch.setattr(
        stage_mod, "joint_graph_to_ir",
        lambda *a, **k: captured.irs.append(to_ir(*a, **k)) or captured.irs[-1],
    )
    model = CausalLM(cfg)
    with stage:
        assert inductor_config.joint_custom_post_pass is stage
        step = eager_step(torch.compile(model), inputs)
    assert inductor_config.joint_custom_post_pass is None
    assert len(stage.plans) == 1
    assert_saves_the_plan(captured)
    assert_same_step(step, eager_step(CausalLM(cfg), inputs))


def test_aot_autograd_backend_with_partition_fn_matches_eager():
    """Dynamo + `aot_autograd(partition_fn=stage.partition_fn)`, as a custom-compiler trainer
    does, on a single-rank GLM/DSA model (MoE, indexer, MTP) with the indexer kept."""
    from torch._dynamo.backends.common import aot_autograd

    cfg = dataclasses.replace(entry("glm_dsa_ep2").config, world_size=1)
    inputs = make_inputs(cfg)
    captured = Captured(stage_mod.PlanningStage(model_decls(cfg), ["SAVE_DSA_INDEXER"]))
    backend = aot_autograd(
        fw_compiler=nop_compiler, bw_compiler=nop_compiler, partition_fn=captured.partition_fn
    )
    with markers_in_compiled_graphs(), warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        step = eager_step(torch.compile(CausalLM(cfg), backend=backend), inputs)
    assert_saves_the_plan(captured)
    assert not {
        n.name for n in captured.plan.nodes if n.unit == "SAVE_DSA_INDEXER"
        and n.op == "aten.topk.default"
    } & captured.backward_nodes()
    assert_same_step(step, eager_step(CausalLM(cfg), inputs))
