"""Eager selective checkpointing from a plan (`recompute_planner.sac`).

Each zoo model runs every checkpointed layer under `torch.utils.checkpoint` with the
`context_fn` the plan gives that layer. Checked against the plan:

- what SAC's cache holds after forward is, byte for byte, the eager-executor plan's saved set
  of that layer (`--executor eager`: every kept op's whole output tuple), but for the ops of
  composites eager runs as other ops (one_hot, CPU dropout: see `recompute_planner.sac`),
  which eager recomputes;
- loss and gradients are bit-identical to the plain step (CPU, single-rank models, same
  process and kernels);
- kept ops never re-run in recompute (counted by `RecomputeCounter`, a dispatch mode under
  SAC's cache): the DSA indexer's top-k under SAVE_DSA_INDEXER, the all-to-alls under
  `collectives="save"`;
- an eager op stream that does not match the plan's graph raises, naming the kept op.

Multi-rank goldens run as rank 0 of the fake process group they were traced with (as the
memory test does); their collectives exchange nothing, so only bytes and counts are compared
there, never values.

The file also runs on torch older than the exporter's (`scripts/sac_torch_compat.sh`): there
the tests that export a graph and the zoo's multi-rank models (functional collectives and the
fake process group of the current torch) are skipped; the single-rank goldens run.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

import recompute_planner as rp
from graph_walk import GOLDEN_DIR, golden_param, load_graph
from recompute_planner import _host_memory as host_memory
from recompute_planner import _measure as measure
from recompute_planner import sac
from recompute_planner._exporter import TRACING_TORCH, ModelDecl, export_joint
from recompute_planner._zoo.catalog import make_inputs
from recompute_planner._zoo.goldens import GOLDENS, golden, traced_group
from recompute_planner.markers import checkpoint_record, layer_scope

JOINT = [g.name for g in GOLDENS if g.joint]
SINGLE_RANK_JOINT = [g.name for g in GOLDENS if g.joint and g.world_size == 1]
# Torch older than the exporter's: see the module docstring.
OLDER_TORCH = torch.__version__ < TRACING_TORCH
needs_tracing_torch = pytest.mark.skipif(
    OLDER_TORCH, reason=f"exports a graph or runs the zoo's ranks: needs torch >= {TRACING_TORCH}"
)
# Keeping the in-place dispatch is refused (inplace-in-kept-interval).
KEEP_ALL = {"moe_ep2_inplace": ["SAVE_ATTN", "SAVE_MOE_GATE", "SAVE_MLP"]}


def planned(name: str, keep, **options) -> rp.Plan:
    """The plan of golden `name` (graph executor unless `executor="eager"` is given)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(GOLDEN_DIR / f"{name}.pb", keep, **options)


def planned_graph(graph, keep, **options) -> rp.Plan:
    """The plan of an exported `graph` (warnings, such as the eager cache's cost, ignored)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, **options)


def run_step(name: str, plan: rp.Plan | None, offloading: bool = False):
    """One training step of golden `name` (rank 0), every checkpointed layer under the plan's
    SAC policy (no checkpointing without a plan), its forward inside `sac.offloading()` with
    `offloading`; returns (loss, grads, policies)."""
    gold = golden(name)
    if gold.world_size > 1 and OLDER_TORCH:
        pytest.skip(f"the zoo's multi-rank models need torch >= {TRACING_TORCH}")
    inputs = make_inputs(gold.entry.config)
    with traced_group(gold.world_size):
        model = gold.entry.build()
        policies = {}
        if plan is not None:
            policies = {key: sac.context_fn(plan, *key) for key in plan.layers()}
            measure.checkpoint_zoo_layers(model, policies)
        params = [p for p in model.parameters()]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # dropout draws the same masks in every run
            with sac.offloading() if offloading else contextlib.nullcontext():
                loss = model(*inputs)
            held = {key: policy.held_bytes() for key, policy in policies.items()}
            grads = torch.autograd.grad(loss, params)
    return loss.detach(), grads, policies, held


def kept_output_bytes(
    name: str, plan: rp.Plan, tolerated: set[str]
) -> dict[tuple[str, int], int]:
    """Per checkpointed layer, the bytes of every output of every op the plan keeps there,
    but for the ops of composites eager computes otherwise (`tolerated`: one_hot, dropout)."""
    graph = load_graph(GOLDEN_DIR / f"{name}.pb")
    sizes = {v.name: _bytes(v) for v in graph.values}
    outputs = {n.name: n.outputs for n in graph.nodes}
    held = {key: 0 for key in plan.layers()}
    for node in plan.nodes:
        if node.decision == "save" and node.layer is not None and node.name not in tolerated:
            held[(node.model, node.layer)] += sum(sizes[v] for v in outputs[node.name])
    return held


def _bytes(value) -> int:
    from recompute_planner.proto import graph_pb2

    width = {
        graph_pb2.DTYPE_FLOAT32: 4, graph_pb2.DTYPE_INT64: 8, graph_pb2.DTYPE_BOOL: 1,
        graph_pb2.DTYPE_INT32: 4, graph_pb2.DTYPE_BFLOAT16: 2, graph_pb2.DTYPE_FLOAT16: 2,
    }[value.dtype]
    count = 1
    for size in value.shape:
        count *= size
    return width * count


def held_cases():
    for name in JOINT:
        yield golden_param(name, KEEP_ALL.get(name, "all"), "recompute", id=f"{name}-all")
    yield pytest.param("glm_dsa_ep2", ["SAVE_DSA_INDEXER"], "recompute", id="glm-indexer")
    yield pytest.param("moe_ep2", None, "save", id="moe_ep2-collectives-save")


@pytest.mark.parametrize("name, keep, collectives", list(held_cases()))
def test_sac_holds_the_eager_plans_saved_set_byte_for_byte(name, keep, collectives):
    plan = planned(name, keep, collectives=collectives, executor="eager")
    _, _, policies, held = run_step(name, plan)
    tolerated = {n for policy in policies.values() for n in policy.tolerated}
    expected = eager_saved_bytes(name, plan, tolerated)
    assert held == expected
    # The eager plan's saved set is every output of every kept op.
    assert expected == kept_output_bytes(name, plan, tolerated)
    assert (sum(held.values()) > 0) == any(n.decision == "save" for n in plan.nodes)


def eager_saved_bytes(
    name: str, plan: rp.Plan, tolerated: set[str]
) -> dict[tuple[str, int], int]:
    """Per checkpointed layer, the bytes of the eager plan's saved values of kind `kept`, but
    for the outputs of composites eager computes otherwise (`tolerated`)."""
    graph = load_graph(GOLDEN_DIR / f"{name}.pb")
    skipped = {v for n in graph.nodes if n.name in tolerated for v in n.outputs}
    held = {key: 0 for key in plan.layers()}
    for saved in plan.saved:
        if saved.kind == "kept" and saved.value not in skipped:
            held[(saved.model, saved.layer)] += saved.bytes
    return held


@pytest.mark.parametrize(
    "name, keep",
    [("dense", "all"), ("dense", None), ("moe_layer_compiled", "all"), ("dense_dropout", "all")],
)
def test_sac_gradients_are_bit_identical_to_the_plain_step(name, keep):
    loss, grads, _, _ = run_step(name, planned(name, keep))
    plain_loss, plain_grads, _, _ = run_step(name, None)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))


def _step_on_rank(world_size: int, rank: int, name: str, keep, collectives: str):
    """One rank's plain and SAC steps of golden `name` on real gloo ranks (the plan is rank
    0's: every rank runs the same ops)."""
    gold = golden(name)
    cfg = gold.entry.config.for_rank(world_size, rank)
    plan = planned(name, keep, collectives=collectives)
    results = []
    for with_plan in (False, True):
        model = gold.entry.build(rank=rank)
        if with_plan:
            policies = {k: sac.context_fn(plan, *k) for k in plan.layers()}
            measure.checkpoint_zoo_layers(model, policies)
        loss = model(*make_inputs(cfg))
        results.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    return results


@needs_tracing_torch
def test_sac_on_real_ranks_is_bit_identical_to_the_plain_step():
    """GLM/DSA on two gloo ranks (all-gather, all-to-all, MTP), the indexer and the
    collectives kept: each rank's loss and gradients equal its plain step's exactly."""
    from recompute_planner._zoo.distributed import run_on_ranks

    ranks = run_on_ranks(2, _step_on_rank, "glm_dsa_ep2", ["SAVE_DSA_INDEXER"], "save")
    for (plain_loss, plain_grads), (loss, grads) in ranks:
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))


def recomputed(policies, op: str) -> dict[tuple[str, int], int]:
    return {key: policy.recomputed.count(op) for key, policy in policies.items()}


def replayed(plan: rp.Plan, op: str) -> dict[tuple[str, int], int]:
    """Per checkpointed layer, how many `op` the (eager) plan's replay re-runs."""
    return {
        (r.model, r.layer): sum(1 for n in r.nodes if plan.decision(n).op.startswith(op + "."))
        for r in plan.replay
    }


def test_kept_indexer_topk_is_not_rerun_in_recompute():
    """Per layer, the top-k re-runs are the layer's top-k ops the plan does not keep (the MoE
    router's, never the indexer's), as many as the eager plan's replay predicts."""
    kept_plan = planned("glm_dsa_ep2", ["SAVE_DSA_INDEXER"], executor="eager")
    *_, kept_policies, _ = run_step("glm_dsa_ep2", kept_plan)
    whole_plan = planned("glm_dsa_ep2", None, executor="eager")
    *_, whole_policies, _ = run_step("glm_dsa_ep2", whole_plan)
    topk = "aten.topk"
    indexer = {key: 0 for key in kept_plan.layers()}
    for node in kept_plan.nodes:
        if node.op.startswith(topk) and node.unit == "SAVE_DSA_INDEXER":
            indexer[(node.model, node.layer)] += 1
    assert all(count == 1 for count in indexer.values())
    whole = recomputed(whole_policies, topk)
    kept = recomputed(kept_policies, topk)
    assert kept == {k: whole[k] - indexer[k] for k in whole}
    assert all(whole[k] >= 1 for k in whole)
    assert kept == replayed(kept_plan, topk) and whole == replayed(whole_plan, topk)


def test_saved_collectives_are_not_rerun_in_recompute():
    """With collectives="save" no all-to-all re-runs; without, as many as the eager plan's
    replay predicts (3 per MoE layer: counts, tokens, combine)."""
    all_to_all = "_c10d_functional.all_to_all_single"
    saving_plan = planned("moe_ep2", None, collectives="save", executor="eager")
    *_, saving, _ = run_step("moe_ep2", saving_plan)
    rerunning_plan = planned("moe_ep2", None, executor="eager")
    *_, rerunning, _ = run_step("moe_ep2", rerunning_plan)
    assert set(recomputed(saving, all_to_all).values()) == {0}
    assert recomputed(saving, all_to_all) == replayed(saving_plan, all_to_all)
    assert set(recomputed(rerunning, all_to_all).values()) == {3}
    assert recomputed(rerunning, all_to_all) == replayed(rerunning_plan, all_to_all)


@pytest.mark.parametrize("keep", ["all", None])
@pytest.mark.parametrize("name", [golden_param(name) for name in SINGLE_RANK_JOINT])
def test_recompute_reruns_exactly_the_matmuls_the_eager_plans_replay_reruns(name, keep):
    """The policy answers in recompute what it decided in forward (torch before 2.13 asks
    again there): a kept matmul is served from the cache, never re-run."""
    plan = planned(name, keep, executor="eager")
    *_, policies, _ = run_step(name, plan)
    for op in ("aten.mm", "aten.bmm"):
        assert recomputed(policies, op) == replayed(plan, op)


def _ctx(is_recompute: bool):
    return SelectiveCheckpointContext(is_recompute=is_recompute)


def test_recompute_answers_forwards_decisions_without_matching_again():
    """Asked in recompute (as torch before 2.13 asks), the policy answers forward's decision
    for each op in turn and the matching stays where forward left it; an op forward did not
    dispatch at that position raises."""
    mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    layer = sac.LayerOps("main", 0, ("mm", "relu"), (str(mm), str(relu)), (True, False))
    run = sac.LayerRun(layer)
    forward = [run.policy(_ctx(False), op) for op in (mm, relu)]
    assert forward == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE]
    for _ in range(2):  # every recompute starts again from forward's first op
        run.start_recompute()
        assert [run.policy(_ctx(True), op) for op in (mm, relu)] == forward
    assert run.matcher.next == 2 and run.matcher.matched == ["mm", "relu"]
    run.start_recompute()
    with pytest.raises(rp.SacMismatchError, match=r"recompute dispatched aten\.relu\.default"):
        run.policy(_ctx(True), relu)


def test_a_checkpointed_models_state_dict_loads_into_the_plain_model_and_back():
    """Checkpointing replaces each layer's forward, not the layer: the keys are the plain
    model's, so a state dict saved with or without SAC loads into either (strictly), and the
    checkpointed model runs the loaded weights."""
    gold = golden("dense")
    plan = planned("dense", "all", executor="eager")
    plain = gold.entry.build()
    checkpointed = gold.entry.build()
    with torch.no_grad():
        for p in checkpointed.parameters():
            p.add_(1.0)  # other weights than the plain model's
    policies = sac.checkpoint_layers(checkpointed.layers, plan)
    assert sorted(policies) == [0, 1]
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in checkpointed.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]

    saved_checkpointed = {k: v.clone() for k, v in checkpointed.state_dict().items()}
    checkpointed.load_state_dict(plain.state_dict())  # plain -> checkpointed
    inputs = make_inputs(gold.entry.config)
    assert torch.equal(checkpointed(*inputs), plain(*inputs))
    assert all(p.held_bytes() > 0 for p in policies.values())  # still under SAC

    restored = gold.entry.build()
    restored.load_state_dict(saved_checkpointed)  # checkpointed -> plain
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in saved_checkpointed.items())


def test_checkpointing_a_layer_again_replaces_its_checkpoint():
    layer = nn.Linear(2, 2)
    forward = layer.forward
    sac.checkpoint_module(layer)
    first = layer.forward
    sac.checkpoint_module(layer)
    assert layer.forward is not first and layer.forward.forward == forward


def test_a_plan_for_another_graph_raises_naming_the_kept_op():
    """The GLM plan's layer 0 applied to the dense model's layer 0: the first kept op the
    dense layer never runs is named."""
    glm = planned("glm_dsa_ep2", ["SAVE_DSA_INDEXER"])
    gold = golden("dense")
    model = gold.entry.build()
    measure.checkpoint_zoo_layers(model, {("main", 0): sac.context_fn(glm, "main", 0)})
    with pytest.raises(rp.SacMismatchError, match=r"the plan keeps `bmm` \(aten\.bmm\.default"):
        model(*make_inputs(gold.entry.config))


# --------------------------------------------------------------------------------------------
# Eager and traced op streams that differ


class OneHotLayer(nn.Module):
    """A layer whose kept unit holds `F.one_hot`: eager dispatches `aminmax`,
    `_local_scalar_dense`, `zeros`, `scatter_`; traced on fake tensors, ATen's `one_hot` is
    `arange`, `eq` and `_to_copy` instead."""

    def __init__(self, index: int, dim: int = 8):
        super().__init__()
        self.index = index
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mix = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with layer_scope("main", self.index):
            h = checkpoint_record("route.begin", torch.tanh(self.proj(x)))
            chosen = F.one_hot(h.argmax(-1), h.shape[-1]).to(h.dtype)
            mixed = self.mix(h * chosen)
            return x + checkpoint_record("route.end", torch.sigmoid(mixed))


class OneHotModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(OneHotLayer(i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def assert_sac_holds_what_the_eager_plan_keeps(make_model, graph, inputs) -> None:
    """A training step of a fresh `make_model()` under the eager `--keep all` plan's policies:
    each checkpointed layer's cache holds exactly the bytes the plan keeps in it."""
    plan = planned_graph(graph, "all", executor="eager")
    model = make_model()
    policies = sac.checkpoint_layers(model.layers, plan)
    torch.autograd.grad(model(*inputs), list(model.parameters()))
    for layer, policy in policies.items():
        kept = [s for s in plan.saved if s.kind == "kept" and s.layer == layer]
        assert policy.held_bytes() == sum(s.bytes for s in kept) > 0


@needs_tracing_torch
def test_one_hot_exports_as_eager_runs_it_and_sac_holds_what_the_eager_plan_keeps():
    """Eager `one_hot` fills `zeros` in place with `scatter_`; on fake tensors ATen builds the
    mask another way (`arange`, `eq`, a copy to int64), tensors eager never makes and a plan
    keeping them would count bytes SAC never holds. Exported as eager runs it, the step under
    the plan's policies computes what the plain model does, and the kept routing holds under
    SAC byte for byte what the eager plan says."""
    inputs = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),)
    models = [ModelDecl("main", 2, {"SAVE_ROUTE": [("route.begin", "route.end")]})]
    graph = export_joint(OneHotModel(), inputs, name="one_hot", models=models).graph
    forward_ops = [n.op for n in graph.nodes if n.phase == graph.nodes[0].phase]
    assert forward_ops.count("aten.scatter_.value") == 2
    assert not {"aten.eq.Tensor", "aten.arange.default"} & set(forward_ops)
    plan = rp.plan(graph, "all")

    model = OneHotModel()
    policies = sac.checkpoint_layers(model.layers, plan)
    loss = model(*inputs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    plain = OneHotModel()
    plain_loss = plain(*inputs)
    plain_grads = torch.autograd.grad(plain_loss, list(plain.parameters()))

    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    kept = {n.op for n in plan.nodes if n.decision == "save"}
    assert {"aten._to_copy.default", "aten.mm.default"} <= kept
    for policy in policies.values():
        # proj (before the interval) re-runs, the kept mix does not; sigmoid is kept; the
        # mask's buffer, written in place, re-runs with its write.
        assert policy.recomputed.count("aten.mm") == 1
        assert policy.recomputed.count("aten.sigmoid") == 0
        assert policy.recomputed.count("aten.scatter_") == 1

    assert_sac_holds_what_the_eager_plan_keeps(OneHotModel, graph, inputs)


def test_checkpoint_layers_of_a_model_the_plan_does_not_have_is_an_error():
    """A misspelt model (`Main` for `main`) would otherwise wrap no layer and checkpoint
    nothing without a word."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(GOLDEN_DIR / "glm_dsa_ep2.pb")
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    unwrapped = list(layers)
    with pytest.raises(KeyError, match="no model `Main`; its models: main"):
        sac.checkpoint_layers(layers, plan, model="Main")
    assert list(layers) == unwrapped
    assert sac.checkpoint_layers(layers, plan, model="main")


class AttentionProbs(nn.Module):
    """HuggingFace eager attention's `dropout(softmax(scores), p=0.0, training=True)`."""

    def __init__(self, index: int, dim: int = 8):
        super().__init__()
        self.index = index
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with layer_scope("main", self.index):
            h = checkpoint_record("attn.begin", self.proj(x))
            probs = F.dropout(torch.softmax(h @ h.transpose(-1, -2), -1), p=0.0, training=True)
            return x + checkpoint_record("attn.end", probs @ h)


class AttentionModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(AttentionProbs(i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@needs_tracing_torch
def test_a_dropout_that_draws_nothing_exports_as_eager_runs_it():
    """Eager `dropout(p=0)` returns its input; the trace would decompose it into a `clone`
    eager never makes (an attention-probabilities copy), that the plan would count and keep
    and SAC could never match. Exported, it is nothing; the kept attention saves under SAC
    byte for byte what the eager plan says."""
    inputs = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),)
    models = [ModelDecl("main", 2, {"SAVE_ATTN": [("attn.begin", "attn.end")]})]
    graph = export_joint(AttentionModel(), inputs, name="probs", models=models).graph
    forward_ops = [n.op for n in graph.nodes if n.phase == graph.nodes[0].phase]
    assert "aten.clone.default" not in forward_ops
    assert not [op for op in forward_ops if "dropout" in op]
    assert_sac_holds_what_the_eager_plan_keeps(AttentionModel, graph, inputs)


@pytest.mark.parametrize("name", ["glm_dsa_ep2", "dense"])
def test_offloaded_kept_outputs_come_back_bit_identical(name):
    """A plan that offloads what its kept units save: SAC's cache holds host copies, the
    recompute brings them back, and the step's loss and gradients are those of the plain
    step, bit for bit. The copies and reloads are none of the layer's ops: each recompute
    re-runs exactly the ops it re-runs without offload."""
    keep = ["SAVE_DSA_INDEXER"] if name == "glm_dsa_ep2" else "all"
    plan = planned(name, keep, executor="eager", offload_kinds=["kept"])
    assert any(s.offloaded for s in plan.saved)
    loss, grads, policies, _ = run_step(name, plan)
    plain_loss, plain_grads, _, _ = run_step(name, None)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    _, _, on_device, _ = run_step(name, planned(name, keep, executor="eager"))
    for key, policy in policies.items():
        assert policy.recomputed.counts == on_device[key].recomputed.counts, key


@pytest.mark.parametrize("name", ["glm_dsa_ep2", "dense"])
def test_offloaded_layer_inputs_come_back_bit_identical(name):
    """A plan that offloads the checkpoints' inputs (each layer's output) and what the kept
    units save, the forward inside `sac.offloading()`: the bytes copied to host memory are the
    plan's, and loss and gradients are those of the plain step, bit for bit."""
    keep = ["SAVE_DSA_INDEXER"] if name == "glm_dsa_ep2" else "all"
    plan = planned(
        name, keep, executor="eager", offload_kinds=["kept", "layer-input"], offload_prefetch=0
    )
    assert any(s.offloaded and s.kind == "layer-input" for s in plan.saved)
    with host_memory.counting() as moved:
        loss, grads, _, _ = run_step(name, plan, offloading=True)
    assert moved.bytes == plan.memory.offloaded_bytes
    plain_loss, plain_grads, _, _ = run_step(name, None)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))


def test_a_plan_offloading_layer_inputs_needs_the_offloading_block():
    """Outside `sac.offloading()` nothing would move a layer's output, so the first
    checkpointed layer whose output the plan offloads raises, naming it and the block."""
    plan = planned("dense", None, executor="eager", offload_kinds=["layer-input"])
    with pytest.raises(RuntimeError, match=r"add_5.*offloading\(\)"):
        run_step("dense", plan)


def test_a_layer_output_offload_is_refused_in_a_checkpoint_of_ones_own():
    """Only this module's checkpoints register a layer's output with `offloading()`: the policy
    of a layer whose output the plan offloads refuses to build its contexts for any other
    checkpoint (torch calls it there), rather than leave the output on the device."""
    plan = planned("dense", None, executor="eager", offload_kinds=["layer-input"])
    policy = sac.context_fn(plan, *plan.layers()[0])
    with pytest.raises(NotImplementedError, match="checkpoint_layers"):
        policy()


def test_a_plan_offloading_what_eager_sac_does_not_move_is_refused():
    """Eager SAC moves kept outputs and layer inputs: a plan that also offloads values made
    outside the checkpointed layers would predict a device saving the step does not make, so
    checkpointing under it raises, naming the kinds."""
    plan = planned("dense", "all", executor="eager", offload_kinds=["not-checkpointed"])
    assert any(s.offloaded and s.kind == "not-checkpointed" for s in plan.saved)
    with pytest.raises(NotImplementedError, match="not-checkpointed"):
        sac.context_fn(plan, *plan.layers()[0])


def test_an_offloaded_cache_entry_written_in_place_after_its_copy_is_refused():
    """SAC refuses a cached tensor written in place; its host copy keeps that check while the
    tensor is alive, and otherwise brings back what was copied, in the tensor's layout."""
    tensor = torch.arange(12.0).reshape(3, 4).t()
    copy = sac._HostCopy(tensor)
    back = copy.get_val(False)
    assert torch.equal(back, tensor) and back.stride() == tensor.stride()
    tensor.add_(1)
    with pytest.raises(RuntimeError, match="stale"):
        copy.get_val(False)
