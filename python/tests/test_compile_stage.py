"""The torch.compile planning stage: one graph for the stage and the CLI, and a compiled step
that saves and replays exactly what the plan says.

Each zoo golden and each HuggingFace family is compiled with the stage
(`recompute_planner.compile`) and exported with the exporter (`rp.export` / `export_joint`);
the stage's plan of the traced joint graph must be the plan of the exported graph:

- same saved set by storage (a view stands for its base, a marker for its input), parameters
  and inputs compared by kind and size (the stage sees them as AOTAutograd's placeholders,
  the exporter by their module names), activations by name;
- same replay, layer by layer, op for op and by name; an in-place op of the exported graph
  matches its functional form in the compiled one (torch.compile functionalizes);
- same saved bytes and predicted peak.

And the compiled step itself: the forward graph returns exactly the plan's saved set, the
backward graph re-runs exactly its replay (`partition_from_plan`, no min-cut).

Most cases compile through `aot_module` with the stage's `partition_fn` and no code generation
(seconds per model); the inductor path (`torch.compile` with `backend=stage.backend`) is
traced and partitioned for every golden and family, and compiled to code and run against
eager once. Torch's min-cut partitioner stays an option (`partitioner="min-cut"`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import Counter

import pytest
import torch
import torch._inductor.config as inductor_config
from functorch.compile import aot_module, make_boxed_func

import recompute_planner as rp
from graph_walk import golden_param
from hf_families import FAMILIES, family
from recompute_planner import compile as stage_mod
from recompute_planner._zoo.catalog import entry, make_inputs, model_decls
from recompute_planner._zoo.goldens import GOLDENS, traced_group
from recompute_planner._zoo.model import CausalLM
from recompute_planner.markers import MARKER_OP, MARKER_OVERLOAD, markers_in_compiled_graphs
from recompute_planner.model_export import _Step
from recompute_planner.proto import graph_pb2

# Compiled and eager steps differ by fused kernels' rounding.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
JOINT = [g.name for g in GOLDENS if g.joint]
INPUT_ROLES = {graph_pb2.ROLE_PARAMETER, graph_pb2.ROLE_BUFFER, graph_pb2.ROLE_INPUT}
# Goldens whose step writes into fresh buffers in place (slice copies, `index_put_` on a
# `new_empty`) where the plan keeps their producer: in the exported graph the plan replays the
# buffer with its writers; torch.compile functionalizes the writes into new tensors, which the
# plan of the compiled graph keeps. Two programs, two plans.
FUNCTIONALIZED_DIFFERS = {
    "moe_hf_router": "functionalization: the router's in-place `div_` and the dispatch "
    "buffers' `index_put_` become new tensors the plan keeps",
    "dsv3_kv_expand": "functionalization: keys and queries written slice by slice into "
    "`new_empty` buffers become `slice_scatter` ops the plan keeps",
}


class Recording(stage_mod.PlanningStage):
    """The stage, keeping the IR of each graph it planned and the graphs it partitioned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.irs: list[graph_pb2.Graph] = []

    def plan_joint(self, graph_module, num_fwd_outputs=None):
        ir, planned = super().plan_joint(graph_module, num_fwd_outputs)
        self.irs.append(ir)
        return ir, planned

    def partition_fn(self, joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        self.fw, self.bw = super().partition_fn(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
        )
        self.num_fwd_outputs = num_fwd_outputs
        return self.fw, self.bw

    @property
    def plan(self) -> rp.Plan:
        return self.plans[-1]


# --------------------------------------------------------------------------------------------
# Ways to compile a step


def nop_compiler(graph_module, _inputs):
    return make_boxed_func(graph_module.forward)


class _Partitioned(Exception):
    """Raised by the inner compiler: the partition is all these tests need from inductor."""


def stop_after_partition(graph_module, _inputs, **_kwargs):
    raise _Partitioned()


def run_aot(stage: stage_mod.PlanningStage, module: torch.nn.Module, inputs: tuple) -> None:
    """One training step through `aot_module` with the stage's partition_fn, no codegen."""
    compiled = aot_module(
        module, fw_compiler=nop_compiler, bw_compiler=nop_compiler,
        partition_fn=stage.partition_fn,
    )
    compiled(*inputs).backward()


def run_inductor_partition(stage, module: torch.nn.Module, inputs: tuple) -> None:
    """`torch.compile(module, backend=stage.backend)` traced and partitioned, no codegen."""
    backend = functools.partial(stage.backend, inner_compile=stop_after_partition)
    torch._dynamo.reset()
    with stage:
        try:
            torch.compile(module, backend=backend)(*inputs)
        except Exception as error:  # Dynamo wraps what a backend raises
            if not _caused_by(error, _Partitioned):
                raise
    torch._dynamo.reset()


def _caused_by(error: BaseException, kind: type) -> bool:
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


# --------------------------------------------------------------------------------------------
# Subjects: zoo goldens and HuggingFace families


@dataclasses.dataclass
class Subject:
    """A step to compile and export: the module, its positional tensor inputs, its models."""

    module: torch.nn.Module
    inputs: tuple
    models: list
    world_size: int = 1

    def exported_plan(self, keep) -> tuple[graph_pb2.Graph, rp.Plan]:
        from recompute_planner._exporter import export_joint

        with traced_group(self.world_size):
            graph = export_joint(
                self.module, self.inputs, name="exported", models=self.models,
                world_size=self.world_size,
            ).graph
        return graph, quiet_plan(graph, keep)

    def staged(self, keep, run, **options) -> Recording:
        stage = Recording(self.models, keep, **options)
        with traced_group(self.world_size), warnings.catch_warnings():
            warnings.simplefilter("ignore", rp.PlannerWarning)
            run(stage, self.module, self.inputs)
        return stage


def golden_subject(name: str) -> Subject:
    cfg = entry(name).config
    return Subject(CausalLM(cfg), make_inputs(cfg), model_decls(cfg), cfg.world_size)


def family_subject(name: str) -> Subject:
    fam = family(name)
    model = fam.model()
    models = rp.annotate(model, layers="model.layers", units=fam.units).models
    step = _Step(model, None, (), fam.inputs())
    return Subject(step, step.tensors(), models)


def quiet_plan(graph, keep) -> rp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, check=False)


def golden_cases():
    for name in JOINT:
        marks = []
        if name in FUNCTIONALIZED_DIFFERS:
            marks = [pytest.mark.xfail(reason=FUNCTIONALIZED_DIFFERS[name], strict=True)]
        param = golden_param(name, id=name)
        yield pytest.param(*param.values, marks=[*param.marks, *marks], id=name)


# --------------------------------------------------------------------------------------------
# What "the same plan" is


def storage_bases(ir: graph_pb2.Graph):
    """value -> the value whose storage it is: through views and markers, to the base."""
    producers = {v: n for n in ir.nodes for v in n.outputs}

    def base(value: str) -> str:
        node = producers.get(value)
        while node is not None and (node.schema.HasField("view_of") or node.op == MARKER_OP):
            value = node.inputs[node.schema.view_of if node.op != MARKER_OP else 0]
            node = producers.get(value)
        return value

    return base


def saved_by_storage(ir: graph_pb2.Graph, plan: rp.Plan) -> tuple[set[str], Counter]:
    """The plan's saved activations by storage base, and its saved inputs (parameters,
    buffers, data) as a count of (kind, bytes)."""
    base = storage_bases(ir)
    inputs = {v.name for v in ir.values if v.role in INPUT_ROLES}
    activations, by_size = set(), Counter()
    for saved in plan.saved:
        root = base(saved.value)
        if root in inputs:
            by_size[(saved.kind, saved.bytes)] += 1
        else:
            activations.add(root)
    return activations, by_size


def functional_op(op: str) -> str:
    """An in-place op's functional form (`aten.index_put_.default` -> `aten.index_put...`)."""
    namespace, name, overload = op.split(".")
    return f"{namespace}.{name.removesuffix('_')}.{overload}"


def replay_by_layer(plan: rp.Plan) -> dict[tuple[str, int], list[str]]:
    """Each layer's replayed nodes in forward order, over the steps its replay comes in."""
    position = {node.name: k for k, node in enumerate(plan.nodes)}
    layers: dict[tuple[str, int], list[str]] = {}
    for r in plan.replay:
        layers.setdefault((r.model, r.layer), []).extend(r.nodes)
    return {layer: sorted(nodes, key=position.__getitem__) for layer, nodes in layers.items()}


def replay_ops(plan: rp.Plan) -> dict[tuple[str, int], list[str]]:
    return {
        layer: [functional_op(plan.decision(n).op) for n in nodes]
        for layer, nodes in replay_by_layer(plan).items()
    }


def replay_names(plan: rp.Plan, written_in_place: set[str]) -> dict[tuple[str, int], set[str]]:
    """Each layer's replayed nodes by name, but for the ops ``written_in_place`` names in their
    functional form (functionalization renames ``index_put_`` nodes ``index_put``)."""
    return {
        layer: {n for n in nodes if functional_op(plan.decision(n).op) not in written_in_place}
        for layer, nodes in replay_by_layer(plan).items()
    }


def assert_same_plan(staged: Recording, exported_ir, exported: rp.Plan) -> None:
    stage_ir, planned = staged.irs[-1], staged.plan
    assert saved_by_storage(stage_ir, planned) == saved_by_storage(exported_ir, exported)
    assert replay_ops(planned) == replay_ops(exported)
    in_place = {functional_op(n.op) for n in exported_ir.nodes if n.schema.mutates}
    assert replay_names(planned, in_place) == replay_names(exported, in_place)
    assert planned.memory.saved_bytes == exported.memory.saved_bytes
    assert planned.memory.peak_bytes == exported.memory.peak_bytes


def assert_saves_and_replays_the_plan(staged: Recording) -> None:
    """The forward graph returns the plan's saved set, the backward re-runs its replay."""
    base = storage_bases(staged.irs[-1])
    tangents = {v.name for v in staged.irs[-1].values if v.role == graph_pb2.ROLE_TANGENT}
    planned = {base(v) for v in staged.plan.saved_values()} - tangents
    outputs = staged.fw.graph.output_node().args[0][staged.num_fwd_outputs :]
    assert {base(n.name) for n in outputs} == planned
    forward_ops = {n.name for n in staged.plan.nodes if n.op != MARKER_OP}
    replayed = {
        n.name for n in staged.bw.graph.nodes
        if n.op == "call_function" and n.name in forward_ops
    }
    assert replayed == {n for r in staged.plan.replay for n in r.nodes} & forward_ops
    assert not [n for n in staged.fw.graph.nodes if n.target is MARKER_OVERLOAD]


# --------------------------------------------------------------------------------------------
# One graph, exact partition: aot_autograd


@pytest.mark.parametrize("name", list(golden_cases()))
def test_aot_stage_plans_the_exported_step_and_the_step_follows_the_plan(name):
    subject = golden_subject(name)
    staged = subject.staged("all", run_aot)
    assert_saves_and_replays_the_plan(staged)
    assert_same_plan(staged, *subject.exported_plan("all"))


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_aot_stage_plans_the_exported_hf_step_and_the_step_follows_the_plan(name):
    subject = family_subject(name)
    keep = list(family(name).units)[:1]
    staged = subject.staged(keep, run_aot)
    assert_saves_and_replays_the_plan(staged)
    assert_same_plan(staged, *subject.exported_plan(keep))


def test_whole_layer_recompute_follows_the_plan():
    subject = golden_subject("moe_ep2")
    for keep in (None, ["SAVE_MOE_DISPATCH"]):
        staged = subject.staged(keep, run_aot)
        assert_saves_and_replays_the_plan(staged)
        assert_same_plan(staged, *subject.exported_plan(keep))


# --------------------------------------------------------------------------------------------
# One graph, exact partition: inductor


@pytest.mark.parametrize("name", list(golden_cases()))
def test_inductor_stage_plans_the_exported_step_and_the_step_follows_the_plan(name):
    subject = golden_subject(name)
    staged = subject.staged("all", run_inductor_partition)
    assert_saves_and_replays_the_plan(staged)
    assert_same_plan(staged, *subject.exported_plan("all"))


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_inductor_stage_plans_the_exported_hf_step(name):
    subject = family_subject(name)
    staged = subject.staged("all", run_inductor_partition)
    assert_saves_and_replays_the_plan(staged)
    assert_same_plan(staged, *subject.exported_plan("all"))


def eager_step(model: torch.nn.Module, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(*inputs)
    return loss.detach(), list(torch.autograd.grad(loss, list(model.parameters())))


def assert_same_step(compiled: tuple, eager: tuple) -> None:
    torch.testing.assert_close(compiled[0], eager[0], rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_inductor_step_from_the_plan_matches_eager():
    """`torch.compile(model, backend=stage.backend)` compiled to code and run: the plan's
    saved set and replay, and loss and gradients as eager's."""
    cfg = entry("dense").config
    inputs = make_inputs(cfg)
    stage = Recording(model_decls(cfg), "all")
    torch._dynamo.reset()
    with stage:
        step = eager_step(torch.compile(CausalLM(cfg), backend=stage.backend), inputs)
    assert len(stage.plans) == 1
    assert_saves_and_replays_the_plan(stage)
    assert_same_step(step, eager_step(CausalLM(cfg), inputs))


class DictOutput(torch.nn.Module):
    """A model whose step returns a dict, the loss not first."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs)
        return {"logits": out.logits, "loss": out.loss}


def hf_output_subject(form: str) -> tuple[torch.nn.Module, dict, list]:
    """A stock HF Llama whose step returns its loss in ``form``: a ``ModelOutput``
    (``.loss``), a tuple (loss first: ``return_dict=False``) or a dict with ``"loss"``."""
    fam = family("llama")
    model = fam.model()
    models = rp.annotate(model, layers="model.layers", units=fam.units).models
    inputs = fam.inputs()
    if form == "tuple":
        inputs["return_dict"] = False
    return (DictOutput(model) if form == "dict" else model), inputs, models


def loss_of(output):
    if isinstance(output, tuple):
        return output[0]
    return output["loss"] if isinstance(output, dict) else output.loss


@pytest.mark.parametrize("form", ["model_output", "tuple", "dict"])
def test_inductor_stage_takes_the_loss_out_of_a_model_output(form):
    """A stock HF model compiled whole returns its logits beside the loss: the stage plans the
    scalar loss as the step's loss and the logits as an output the caller holds."""
    module, inputs, models = hf_output_subject(form)
    stage = Recording(models, ["SAVE_MLP"])
    backend = functools.partial(stage.backend, inner_compile=stop_after_partition)
    torch._dynamo.reset()
    with stage, warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        try:
            torch.compile(module, backend=backend)(**inputs)
        except Exception as error:
            if not _caused_by(error, _Partitioned):
                raise
    torch._dynamo.reset()
    ir = stage.irs[-1]
    values = {v.name: v for v in ir.values}
    (loss,) = [v for v in ir.values if v.role == graph_pb2.ROLE_LOSS]
    assert list(loss.shape) == [] and ir.outputs[0] == loss.name
    logits = [
        values[name] for name in ir.outputs[1:]
        if values[name].role == graph_pb2.ROLE_ACTIVATION
    ]
    assert [list(v.shape) for v in logits] == [[2, 8, 64]]
    assert_saves_and_replays_the_plan(stage)


def test_compiled_hf_step_returning_a_model_output_matches_eager():
    """`torch.compile(model, backend=stage.backend)(**inputs).loss.backward()` on a stock HF
    Llama, compiled to code: loss, logits and gradients as eager's."""
    module, inputs, models = hf_output_subject("model_output")
    params = list(module.parameters())
    torch._dynamo.reset()
    with rp.compile.planning(models, ["SAVE_MLP"]) as stage, warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        compiled = torch.compile(module, backend=stage.backend)(**inputs)
        grads = torch.autograd.grad(compiled.loss, params)
    torch._dynamo.reset()
    eager = module(**inputs)
    assert len(stage.plans) == 1
    assert_same_step(
        (compiled.loss.detach(), list(grads)),
        (eager.loss.detach(), list(torch.autograd.grad(eager.loss, params))),
    )
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# --------------------------------------------------------------------------------------------
# Torch's min-cut partitioner, as an option


def test_min_cut_option_saves_what_the_plan_saves():
    cfg = entry("moe_ep2").config
    stage = Recording(model_decls(cfg), ["SAVE_MOE_DISPATCH"], partitioner="min-cut")
    with traced_group(cfg.world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        run_aot(stage, CausalLM(cfg), make_inputs(cfg))
    base = storage_bases(stage.irs[-1])
    tangents = {v.name for v in stage.irs[-1].values if v.role == graph_pb2.ROLE_TANGENT}
    outputs = stage.fw.graph.output_node().args[0][stage.num_fwd_outputs :]
    saved = {
        base(n.name) for n in outputs
        if isinstance(n.meta.get("val"), torch.Tensor) and not _is_rng_state(n)
    }
    assert saved == {base(v) for v in stage.plan.saved_values()} - tangents


def _is_rng_state(node: torch.fx.Node) -> bool:
    import operator

    source = node.args[0] if node.target is operator.getitem else node
    return getattr(source, "target", None) is torch.ops.higher_order.run_and_save_rng_state


def test_the_plan_partitioner_refuses_replayed_random_ops():
    with pytest.raises(ValueError, match='random_ops="replay"'):
        stage_mod.PlanningStage(model_decls(entry("dense").config), random_ops="replay")


# --------------------------------------------------------------------------------------------
# Diagnostics and errors at compile time


def test_indexer_topk_is_not_recomputed_when_its_unit_is_kept():
    """With SAVE_DSA_INDEXER the indexer's top-k stays out of the backward graph (it re-runs
    there under whole-layer recompute); the plan's diagnostics are warnings at compile time."""
    subject = golden_subject("glm_dsa_ep2")
    stage = Recording(subject.models, ["SAVE_DSA_INDEXER"])
    with traced_group(subject.world_size):
        with pytest.warns(rp.PlannerWarning, match="nondeterministic-replay"):
            run_aot(stage, subject.module, subject.inputs)
    whole = subject.staged(None, run_aot)
    indexer_topk = {
        n.name
        for n in stage.plan.nodes
        if n.op == "aten.topk.default" and n.unit == "SAVE_DSA_INDEXER"
    }
    assert len(indexer_topk) == 3  # main layers 0, 1 and the MTP layer
    assert not indexer_topk & {n.name for n in stage.bw.graph.nodes}
    assert indexer_topk <= {n.name for n in whole.bw.graph.nodes}


def test_an_unknown_unit_fails_the_compile():
    cfg = entry("dense").config
    stage = stage_mod.PlanningStage(model_decls(cfg), ["SAVE_MOE_GATE"])
    with pytest.raises(rp.PlannerError, match="unknown-unit"):
        run_aot(stage, CausalLM(cfg), make_inputs(cfg))


def test_aot_autograd_backend_with_partition_fn_matches_eager():
    """Dynamo + `aot_autograd(partition_fn=stage.partition_fn)`, as a custom-compiler trainer
    does, on a single-rank GLM/DSA model (MoE, indexer, MTP) with the indexer kept."""
    from torch._dynamo.backends.common import aot_autograd

    cfg = dataclasses.replace(entry("glm_dsa_ep2").config, world_size=1)
    inputs = make_inputs(cfg)
    stage = Recording(model_decls(cfg), ["SAVE_DSA_INDEXER"])
    backend = aot_autograd(
        fw_compiler=nop_compiler, bw_compiler=nop_compiler, partition_fn=stage.partition_fn
    )
    torch._dynamo.reset()
    with markers_in_compiled_graphs(), warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        step = eager_step(torch.compile(CausalLM(cfg), backend=backend), inputs)
    assert_saves_and_replays_the_plan(stage)
    assert_same_step(step, eager_step(CausalLM(cfg), inputs))


# --------------------------------------------------------------------------------------------
# Installation


def test_stages_install_and_uninstall_in_any_order():
    """Two stages installed, then uninstalled in install order: inductor runs the later one
    while it is installed, and nothing once both are gone."""
    models = model_decls(entry("dense").config)
    before = inductor_config.custom_partitioner_fn, inductor_config.joint_custom_post_pass
    first = stage_mod.install(models, "all")
    second = stage_mod.install(models, "all", partitioner="min-cut")
    assert stage_mod.active_stage() is second
    assert inductor_config.joint_custom_post_pass is second
    first.uninstall()
    assert stage_mod.active_stage() is second
    assert inductor_config.joint_custom_post_pass is second
    assert inductor_config.custom_partitioner_fn is before[0]
    second.uninstall()
    assert stage_mod.active_stage() is None
    assert (inductor_config.custom_partitioner_fn, inductor_config.joint_custom_post_pass) == before
    # And in reverse order, with the plan partitioner active in between.
    first, second = stage_mod.install(models, "all"), stage_mod.install(models, "all")
    second.uninstall()
    assert inductor_config.custom_partitioner_fn.stage is first
    first.uninstall()
    assert (inductor_config.custom_partitioner_fn, inductor_config.joint_custom_post_pass) == before
