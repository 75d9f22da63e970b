"""Submodules compiled as users compile them (`module.compile()`, `torch.compile(module)`).

The zoo marks its compiled regions with the stand-in `markers.compiled_region`; here the same
models have their submodules really compiled, with no stand-in: the MoE routers (`gate`) and
the DSA indexer's projection (moved into a submodule `indexer`, as a user would compile it).

- `rp.export` traces a compiled submodule's contents and records them as the compiled region
  named after its module path: the graph equals the stand-in export of the same model, byte for
  byte, and the planner keeps nothing in it;
- eager SAC from the plan runs the compiled code as one call per region inside the checkpoint
  (`sac.checkpoint_layers` follows the calls): loss and gradients equal the same compiled model
  without checkpointing, to the bit, what SAC holds is the eager plan's saved set, and the
  matmuls and top-k re-run in recompute are the eager plan's replay (the kept indexer top-k
  never);
- what cannot work says so first: a compiled model, a compiled function, a layer compiled as a
  whole, a checkpoint that does not follow the compiled calls.

Compiling costs seconds per model on two cores: `aot_eager` everywhere, inductor (whose code
dispatches `mm.out` and no pointwise op) in one test. Dynamo is reset before each test, so the
recompile limit never silently falls back to eager.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import recompute_planner as rp
from export_support import planner_run
from recompute_planner import sac
from recompute_planner._zoo.catalog import make_inputs, model_decls
from recompute_planner._zoo.config import ZooConfig
from recompute_planner._zoo.layers import apply_rope
from recompute_planner._zoo.model import CausalLM
from recompute_planner.markers import compiled_region
from recompute_planner.proto import graph_pb2

MOE = ZooConfig(num_experts=4, world_size=1)
DSA = ZooConfig(index_topk=4)
# The exporter's module paths start at the model's own attribute in the step it traces.
MODEL_PATH = "model"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class IndexerProjection(nn.Module):
    """The zoo DSA indexer's projection and RoPE (`DSAAttention._index_projection`, without its
    stand-in region) as a submodule of its own, the piece a user compiles."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.index_proj = attention.index_proj
        self.heads, self.dim = attention.cfg.index_heads, attention.cfg.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        batch, seq, _ = x.shape
        index_q, index_k, weights = self.index_proj(x).split(
            [self.heads * self.dim, self.dim, self.heads], dim=-1
        )
        index_q = apply_rope(index_q.view(batch, seq, self.heads, self.dim), cos, sin)
        return index_q, apply_rope(index_k, cos, sin), weights * self.heads**-0.5


def with_indexer_submodule(model: CausalLM) -> CausalLM:
    """Every DSA attention of `model` computes its indexer projection in submodule
    `self_attn.indexer` (the weight moves there)."""
    for layer in model.layers:
        attention = layer.self_attn
        attention.indexer = IndexerProjection(attention)
        del attention.index_proj
        attention._index_projection = lambda x, ctx, a=attention: a.indexer(x, ctx.cos, ctx.sin)
    return model


@dataclasses.dataclass(frozen=True)
class Case:
    """A zoo model with one submodule per layer compiled: `path` relative to a layer."""

    name: str
    cfg: ZooConfig
    path: str
    keep: tuple[str, ...]
    # The regions the zoo model marks itself with the stand-in.
    zoo_regions: tuple[str, ...] = ()

    def build(self) -> CausalLM:
        model = CausalLM(self.cfg)
        return with_indexer_submodule(model) if self.cfg.uses_dsa else model

    def regions(self) -> list[str]:
        return [f"{MODEL_PATH}.layers.{i}.{self.path}" for i in range(self.cfg.num_layers)]


MOE_ROUTERS = Case("moe-routers", MOE, "gate", ("SAVE_ATTN", "SAVE_MOE_GATE", "SAVE_MOE_DISPATCH"))
DSA_INDEXER = Case(
    "dsa-indexer",
    DSA,
    "self_attn.indexer",
    ("SAVE_DSA_INDEXER",),
    zoo_regions=("layers.0.self_attn.sparse_attention", "layers.1.self_attn.sparse_attention"),
)


def compile_module(module: nn.Module, form: str, backend: str = "aot_eager") -> nn.Module:
    """`module` compiled as users do: `form` "wrap" is `torch.compile(module)` (returned, to
    put in its place), "method" is `module.compile()` (`module` itself)."""
    if form == "wrap":
        return torch.compile(module, backend=backend)
    module.compile(backend=backend)
    return module


def compiled(model: CausalLM, path: str, form: str, backend: str = "aot_eager") -> CausalLM:
    """`model` with submodule `path` of every layer compiled (`compile_module`)."""
    for layer in model.layers:
        owner_path, _, name = path.rpartition(".")
        owner = layer.get_submodule(owner_path)
        setattr(owner, name, compile_module(getattr(owner, name), form, backend))
    return model


def stand_in(model: CausalLM, path: str) -> CausalLM:
    """`model` with submodule `path` of every layer marked compiled by the stand-in annotation:
    its forward inside `compiled_region(<its module path>)`."""
    for index, layer in enumerate(model.layers):
        submodule = layer.get_submodule(path)
        forward = submodule.forward
        region = f"{MODEL_PATH}.layers.{index}.{path}"

        def marked(*args, forward=forward, region=region):
            with compiled_region(region):
                return forward(*args)

        submodule.forward = marked
    return model


def exported(model: CausalLM, case: Case) -> rp.ExportResult:
    return rp.export(model, make_inputs(case.cfg), models=model_decls(case.cfg))


def planned(graph, keep) -> rp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, executor="eager")


@pytest.mark.parametrize(
    "case, form",
    [(MOE_ROUTERS, "wrap"), (MOE_ROUTERS, "method"), (DSA_INDEXER, "wrap")],
    ids=["moe-routers-torch.compile", "moe-routers-.compile()", "dsa-indexer-torch.compile"],
)
def test_a_compiled_submodule_exports_as_the_stand_in_region_of_its_path(case, form, tmp_path):
    result = exported(compiled(case.build(), case.path, form), case)
    graph = result.graph
    assert graph == exported(stand_in(case.build(), case.path), case).graph
    regions = {n.compiled_region: n.module_path for n in graph.nodes}
    assert set(regions) == {"", *case.regions(), *case.zoo_regions}
    assert all(regions[region].startswith(region) for region in case.regions())
    # Parameters are named as in the model without torch.compile, in the graph and in the
    # reference `planner run` checks the graph against.
    assert not [v.name for v in graph.values if "_orig_mod" in v.name]
    done = planner_run(str(result.write(tmp_path / "step.pb")[0]), "--check")
    assert done.returncode == 0, done.stderr


def test_a_fake_export_traces_compiled_submodules_as_the_stand_in_regions_too():
    """`fake=True` traces on fake tensors (`device_export`), the state passed by attribute
    path (with `_orig_mod`) and named without it."""
    case = MOE_ROUTERS

    def fake_graph(model: CausalLM) -> graph_pb2.Graph:
        inputs = make_inputs(case.cfg)
        return rp.export(model, inputs, models=model_decls(case.cfg), fake=True).graph

    graph = fake_graph(compiled(case.build(), case.path, "wrap"))
    assert graph == fake_graph(stand_in(case.build(), case.path))
    assert {n.compiled_region for n in graph.nodes} == {"", *case.regions()}


def test_the_plan_keeps_nothing_in_a_compiled_submodule():
    """SAVE_MOE_GATE encloses exactly the compiled router: its ops are the region's, and the
    plan keeps none of them (the eager-contents rule), where it keeps them when eager."""
    case = MOE_ROUTERS
    graph = exported(compiled(case.build(), case.path, "wrap"), case).graph
    plan = planned(graph, ["SAVE_MOE_GATE"])
    in_region = {n.name for n in graph.nodes if n.compiled_region}
    decided = [n for n in plan.nodes if n.name in in_region]
    assert decided and all(n.decision == "recompute" for n in decided)
    assert {n.reason for n in decided if n.op != rp.markers.MARKER_OP} == {"compiled"}
    eager = planned(exported(case.build(), case).graph, ["SAVE_MOE_GATE"])
    assert not any(n.decision == "save" for n in plan.nodes)
    assert any(n.decision == "save" for n in eager.nodes)


def held_by_plan(graph: graph_pb2.Graph, plan: rp.Plan) -> dict[int, int]:
    """Per checkpointed layer, the bytes of the eager plan's saved values of kind `kept`."""
    held = {layer: 0 for _, layer in plan.layers()}
    for saved in plan.saved:
        if saved.kind == "kept":
            held[saved.layer] += saved.bytes
    return held


def replayed(plan: rp.Plan, op: str) -> dict[int, int]:
    """Per checkpointed layer, how many `op` (any overload) the eager plan's replay re-runs."""
    return {
        r.layer: sum(1 for n in r.nodes if plan.decision(n).op.startswith(op + "."))
        for r in plan.replay
    }


def train_step(model: CausalLM, cfg: ZooConfig, plan: rp.Plan | None):
    """Loss, gradients and (with a plan) the layers' policies of one step of `model`, its
    layers checkpointed from `plan` (`sac.checkpoint_layers`), then put back."""
    policies = sac.checkpoint_layers(model.layers, plan) if plan is not None else {}
    try:
        loss = model(*make_inputs(cfg))
        grads = torch.autograd.grad(loss, list(model.parameters()))
    finally:
        if plan is not None:
            policies.remove()
    return loss.detach(), grads, policies


def assert_sac_runs_as_the_eager_plan_predicts(case: Case, form: str, backend: str):
    model = compiled(case.build(), case.path, form, backend)
    graph = exported(model, case).graph
    plan = planned(graph, list(case.keep))
    loss, grads, policies = train_step(model, case.cfg, plan)
    plain_loss, plain_grads, _ = train_step(model, case.cfg, None)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    held = {layer: policy.held_bytes() for layer, policy in policies.items()}
    assert held == held_by_plan(graph, plan) and all(held.values())
    for op in ("aten.mm", "aten.bmm", "aten.topk"):
        counts = {layer: policy.recomputed.count(op) for layer, policy in policies.items()}
        assert counts == replayed(plan, op), op
    return model, plan, policies


@pytest.mark.parametrize(
    "case, form",
    [(MOE_ROUTERS, "wrap"), (MOE_ROUTERS, "method"), (DSA_INDEXER, "method")],
    ids=["moe-routers-torch.compile", "moe-routers-.compile()", "dsa-indexer-.compile()"],
)
def test_sac_runs_compiled_submodules_bit_identically_as_the_eager_plan_predicts(case, form):
    assert_sac_runs_as_the_eager_plan_predicts(case, form, "aot_eager")


def test_sac_runs_an_inductor_compiled_indexer_and_names_the_fix_when_not_following_it():
    """Inductor's code dispatches `mm.out` and none of the projection's other ops: followed,
    the plan's kept top-k is matched and saved; a checkpoint that does not follow the compiled
    call (`context_fn` under a checkpoint of one's own) fails naming the fix."""
    model, plan, policies = assert_sac_runs_as_the_eager_plan_predicts(
        DSA_INDEXER, "wrap", "inductor"
    )
    # The indexer ran as inductor's code (after the export too): its one matmul as `mm.out`.
    assert {layer: p.recomputed.count("aten.mm.out") for layer, p in policies.items()} == {
        0: 1,
        1: 1,
    }
    inputs = make_inputs(DSA_INDEXER.cfg)
    policy = sac.context_fn(plan, "main", 0)
    layer = model.layers[0]
    forward = layer.forward
    layer.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False, context_fn=policy)
    try:
        with pytest.raises(rp.SacMismatchError) as raised:
            model(*inputs)
    finally:
        del layer.forward
    message = str(raised.value)
    assert message.startswith("layer 0 of model `main`: the plan keeps `bmm`")
    assert "if they run compiled here, checkpoint the layer with sac.checkpoint_module" in message


def test_a_plan_without_the_compiled_regions_names_the_submodules_compiled_in_eager():
    """The plan of the uncompiled model keeps the routers, which run compiled in eager: the
    mismatch names the compiled submodules and says to export the model as it runs."""
    case = MOE_ROUTERS
    plan = planned(exported(case.build(), case).graph, ["SAVE_MOE_GATE"])
    model = compiled(case.build(), case.path, "wrap")
    with pytest.raises(rp.SacMismatchError) as raised:
        train_step(model, case.cfg, plan)
    message = str(raised.value)
    assert message.startswith("layer 0 of model `main`: the plan keeps")
    assert "compiled submodules the graph has no region for there (`gate`)" in message


def test_checkpoint_layers_follows_compiled_calls_until_removed():
    model = compiled(CausalLM(MOE), "gate", "wrap")
    calls = [layer.gate.forward for layer in model.layers]
    plan = planned(exported(model, MOE_ROUTERS).graph, None)
    policies = sac.checkpoint_layers(model.layers, plan)
    assert all(isinstance(layer.gate.forward, sac._CompiledCall) for layer in model.layers)
    policies.remove()
    assert [layer.gate.forward for layer in model.layers] == calls


def test_regions_called_back_to_back_pass_over_their_one_run_and_not_the_next():
    """Two compiled submodules called back to back are one run of compiled ops in the graph:
    the first call passes over it, the second passes over nothing, and a later region a few
    ops on is left to its own call (a kept op before it is matched and saved)."""
    layer = sac.LayerOps(
        "main", 0,
        names=("q", "k", "add", "mul", "o", "sum"),
        ops=("aten.mm.default", "aten.mm.default", "aten.add.Tensor", "aten.mul.Tensor",
             "aten.mm.default", "aten.sum.default"),
        keep=(False, False, False, True, False, False),
        compiled=(True, True, False, False, True, False),
    )
    matcher = sac._Matcher(layer)
    matcher.enter_compiled("q_proj")
    matcher.enter_compiled("k_proj")
    assert not matcher.decide("aten.add.Tensor")
    assert matcher.decide("aten.mul.Tensor")
    matcher.enter_compiled("o_proj")
    assert not matcher.decide("aten.sum.default")
    assert matcher.matched == ["add", "mul", "sum"] and not matcher.unplanned_regions


def test_a_submodule_followed_by_two_checkpointed_modules_is_restored_in_any_undo_order():
    """A layer and the model that holds it both checkpointed: the layer's compiled router stays
    with its first follower, and undoing the two in either order leaves its compiled call."""
    for first, second in (("model", "layer"), ("layer", "model")):
        model = compiled(CausalLM(MOE), "gate", "wrap")
        layer = model.layers[0]
        call = layer.gate.forward
        modules = {"model": model, "layer": layer}
        sac.checkpoint_module(modules[first])
        followed = layer.gate.forward
        sac.checkpoint_module(modules[second])
        assert isinstance(followed, sac._CompiledCall) and layer.gate.forward is followed
        sac.uncheckpoint_module(modules["model"])
        sac.uncheckpoint_module(modules["layer"])
        assert layer.gate.forward is call, (first, second)


@pytest.mark.parametrize("form", ["wrap", "method"])
def test_a_compiled_model_is_refused_with_its_cause_and_fix(form):
    model = compile_module(CausalLM(MOE), form)
    with pytest.raises(rp.ExportError) as raised:
        rp.export(model, make_inputs(MOE), models=model_decls(MOE))
    assert str(raised.value).startswith("the model itself is compiled")
    assert "Fix: export the model as it is before compiling it" in str(raised.value)


class CompiledFunctionModel(nn.Module):
    def __init__(self, square: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))
        self.square = square

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.square(x @ self.weight).sum()


def test_a_compiled_function_in_the_step_is_explained_first():
    model = CompiledFunctionModel(torch.compile(torch.square, backend="aot_eager"))
    with pytest.raises(rp.ExportError) as raised:
        rp.export(model, (torch.ones(2, 4),))
    assert str(raised.value).startswith(
        "the step calls code compiled with torch.compile that is not a compiled submodule"
    )


def test_checkpointing_a_layer_compiled_as_a_whole_is_refused_with_the_fix():
    model = CausalLM(MOE)
    compile_module(model.layers[0], "method")
    with pytest.raises(ValueError, match="compiled as a whole .* Fix: compile the layer's"):
        sac.checkpoint_module(model.layers[0])


def test_a_stock_moe_with_compiled_routers_runs_its_plan_bit_identically():
    """Qwen3-MoE as HuggingFace writes it, its routers under `torch.compile`: the recipe of
    docs/huggingface.md (annotate, export, plan) gives the routers' regions, SAVE_MOE_GATE
    keeps nothing in them while SAVE_ATTN keeps attention, and eager SAC matches the plain step
    exactly."""
    pytest.importorskip("transformers")
    from test_model_export import MOE_UNITS, qwen3_moe, tokens

    model = qwen3_moe()
    for layer in model.model.layers:
        layer.mlp.gate = torch.compile(layer.mlp.gate, backend="aot_eager")
    rp.annotate(model, units=MOE_UNITS)
    batch = tokens(torch.bfloat16)
    graph = rp.export(model, batch).graph
    regions = {n.compiled_region for n in graph.nodes} - {""}
    assert regions == {f"{MODEL_PATH}.model.layers.{i}.mlp.gate" for i in (0, 1)}
    plan = planned(graph, list(MOE_UNITS))
    assert {(n.layer, n.unit) for n in plan.nodes if n.decision == "save"} == {
        (0, "SAVE_ATTN"),
        (1, "SAVE_ATTN"),
    }

    def step():
        loss = model(**batch).loss
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    policies = sac.checkpoint_layers(model.model.layers, plan)
    loss, grads = step()
    policies.remove()
    plain_loss, plain_grads = step()
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    held = {layer: policy.held_bytes() for layer, policy in policies.items()}
    assert held == held_by_plan(graph, plan)
