"""`recompute_planner.annotate` reaches every hand-placed marker of the zoo without a source edit.

Each zoo model is built a second time with `hand_markers=False` (its layers record no marker:
a model you did not write), and `annotate` declares the same units on it: submodules
(`self_attn`, `gate`, `mlp`, `shared_experts`), methods of an object a layer holds
(`dispatcher.dispatch`, `dispatcher.combine`) and op intervals (DSA attention, the DSA indexer,
attention closed by the dropout after it). Both are exported; the graphs are the same op for
op, and the plans of every unit, of all of them and of none save, replay and peak the same.

What legitimately differs, and is mapped before comparing: the markers' names (annotate names
a submodule's markers after its path, `self_attn.begin` where the hand wrote `attn.begin`; they
are compared by the unit and end they belong to), the FX names of the marker nodes and their
outputs (an op interval's tentative ends and dead markers took names from FX's counter before
the exporter removed them: `checkpoint_record_6` where the hand-marked graph has
`checkpoint_record_3`; they are compared by their order), and the module path of a marker
(a hook's marker is traced in the submodule's scope, a hand-placed one in the layer's).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import recompute_planner as rp
from recompute_planner._exporter import ModelDecl, export_joint
from recompute_planner._zoo.catalog import ENTRIES, ZooConfig, entry, make_inputs, model_decls
from recompute_planner._zoo.goldens import traced_group
from recompute_planner._zoo.model import MAIN_MODEL, MTP_MODEL, CausalLM
from recompute_planner.markers import MARKER_NAME_ATTR, MARKER_OP
from recompute_planner.proto import graph_pb2

# The EP compile config compiles the shared experts in a region the layer body opens around
# the call, between `mlp.begin` and `mlp.end` it places in eager: a hook (or an op interval) of
# the module runs inside that region, so SAVE_MLP's markers land in it. The plans agree all
# the same (markers inside a compiled region never fire, and SAVE_MLP keeps nothing there
# either way): `test_..._compiled_shared_experts_...` checks that this is the only difference.
MARKERS_IN_REGION = ("moe_ep2_compiled", "glm_dsa_ep2_compiled")
# Zoo models whose hand-placed markers no annotation can reproduce, and why.
UNREACHABLE = {
    **{
        name: "SAVE_MLP's markers sit outside the region that compiles the shared experts"
        for name in MARKERS_IN_REGION
    },
    "moe_ep2_unbalanced": (
        "its layers omit single markers on purpose (a begin without its end): a malformed "
        "model, not a unit declaration"
    ),
}
REACHABLE = [e.name for e in ENTRIES if e.name not in UNREACHABLE]


def declared_units(cfg: ZooConfig, *, dense: bool, moe: bool) -> dict[str, list]:
    """The zoo's units (catalog.declared_units) as `annotate` declares them on the unmarked
    model, for layers that are dense and/or MoE."""
    if cfg.uses_dsa:
        # The whole DSA attention, by its first and last projections: a submodule unit would
        # also mark the indexer loss it returns, which the hand-placed `attn.end` does not.
        attention = rp.OpInterval("self_attn", first="linear", last="linear", name="attn")
    elif cfg.dropout:
        # Attention and the dropout on its output, which the layer runs after `self_attn`.
        attention = rp.OpInterval("", first="linear", last="dropout[0]", name="attn")
    else:
        attention = "self_attn"
    units = {"SAVE_ATTN": [attention]}
    if moe:
        units["SAVE_MOE_GATE"] = ["gate"]
        units["SAVE_MOE_DISPATCH"] = ["dispatcher.dispatch", "dispatcher.combine"]
    units["SAVE_MLP"] = ["mlp"] * dense + ["shared_experts"] * moe
    if cfg.uses_dsa:
        units["SAVE_DSA_INDEXER"] = [
            rp.OpInterval("self_attn", first="flatten", last="topk", name="dsa.indexer")
        ]
    return units


def annotated(cfg: ZooConfig) -> tuple[CausalLM, list[ModelDecl]]:
    """The unmarked model with the zoo's units annotated, and its models."""
    model = CausalLM(dataclasses.replace(cfg, hand_markers=False))
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    units = declared_units(cfg, dense=not all(moe), moe=any(moe))
    models = rp.annotate(model, layers="layers", units=units).models
    if cfg.mtp:
        block = declared_units(cfg, dense=not cfg.num_experts, moe=bool(cfg.num_experts))
        models += rp.annotate(
            model.mtp, layers="block", units=block, name=MTP_MODEL, parent=MAIN_MODEL
        ).models
    return model, models


def export(model, cfg: ZooConfig, models: list[ModelDecl]) -> graph_pb2.Graph:
    with traced_group(cfg.world_size):
        return export_joint(
            model, make_inputs(cfg), name="zoo", models=models, world_size=cfg.world_size
        ).graph


def exported_pair(name: str) -> tuple[str, graph_pb2.Graph, graph_pb2.Graph]:
    """(name, hand-marked graph, annotated graph) of one zoo model."""
    cfg = entry(name).config
    hand = export(CausalLM(cfg), cfg, model_decls(cfg))
    model, models = annotated(cfg)
    return name, hand, export(model, cfg, models)


@pytest.fixture(scope="module", params=REACHABLE)
def pair(request):
    return exported_pair(request.param)


# --------------------------------------------------------------------------------------------
# What "the same" is


def marker_roles(graph: graph_pb2.Graph) -> dict[str, str]:
    """Marker name -> `UNIT.begin` / `UNIT.end`, from the units the graph's models declare."""
    roles = {}
    for model in graph.models:
        for unit in model.units:
            for interval in unit.intervals:
                roles.setdefault(interval.begin, f"{unit.unit}.begin")
                roles.setdefault(interval.end, f"{unit.unit}.end")
    return roles


def marker_name(node: graph_pb2.Node) -> str:
    return next(a.str for a in node.attributes if a.name == MARKER_NAME_ATTR)


def canonical_names(graph: graph_pb2.Graph) -> dict[str, str]:
    """Marker nodes and their outputs -> `marker<k>.node` / `marker<k>` by order; every other
    name maps to itself."""
    names = {}
    markers = [n for n in graph.nodes if n.op == MARKER_OP]
    for k, node in enumerate(markers):
        names[node.name] = f"marker{k}.node"
        names.update((out, f"marker{k}") for out in node.outputs)
    return names


def canonical(graph: graph_pb2.Graph) -> graph_pb2.Graph:
    """The graph with markers named by order and role, module paths of markers cleared, the
    models' unit declarations left out (they name the markers), and what the export saw Python
    hold (`python_releases`): the annotation's hooks and op-interval mode are Python code of
    their own, which holds references the hand-marked model does not (the graph executor's
    plans, compared below, do not read it)."""
    names, roles = canonical_names(graph), marker_roles(graph)
    copy = graph_pb2.Graph()
    copy.CopyFrom(graph)
    for model in copy.models:
        del model.units[:]
    rename = lambda values: [names.get(v, v) for v in values]  # noqa: E731
    for node in copy.nodes:
        if node.op == MARKER_OP:
            for attribute in node.attributes:
                if attribute.name == MARKER_NAME_ATTR:
                    attribute.str = roles.get(attribute.str, attribute.str)
            node.module_path = ""
        node.name = names.get(node.name, node.name)
        del node.python_releases[:]
        node.inputs[:] = rename(node.inputs)
        node.outputs[:] = rename(node.outputs)
    for value in copy.values:
        value.name = names.get(value.name, value.name)
    copy.outputs[:] = rename(copy.outputs)
    return copy


def plan_facts(graph: graph_pb2.Graph, keep: list[str]) -> dict:
    """What a plan decides, with marker names mapped by order: every node's decision, the
    saved set, the replay, the per-unit summaries and the predicted memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(graph, keep, check=False)
    names = canonical_names(graph)
    name = lambda n: names.get(n, n)  # noqa: E731
    return {
        "decisions": [
            (name(n.name), n.op, n.layer, n.decision, n.reason, n.unit) for n in plan.nodes
        ],
        "saved": sorted(
            (name(s.value), s.bytes, s.layer, s.kind, s.model, s.alias_of and name(s.alias_of))
            for s in plan.saved
        ),
        "replay": [
            (r.model, r.layer, [name(n) for n in r.nodes], name(r.before)) for r in plan.replay
        ],
        "units": [dataclasses.astuple(u) for u in plan.units],
        "memory": dataclasses.replace(plan.memory, peak_node=name(plan.memory.peak_node or "")),
        "diagnostics": sorted((d.code, d.unit, d.level) for d in plan.diagnostics),
    }


# --------------------------------------------------------------------------------------------
# Tests


def test_every_zoo_model_is_either_reachable_or_says_why_not():
    assert set(REACHABLE) | set(UNREACHABLE) == {e.name for e in ENTRIES}
    assert not set(REACHABLE) & set(UNREACHABLE)


def test_the_annotated_model_exports_the_hand_marked_graph(pair):
    _name, hand, mine = pair
    ours, theirs = canonical(mine), canonical(hand)
    assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
    for got, want in zip(ours.nodes, theirs.nodes, strict=True):
        assert got == want, f"node {want.name} differs"
    assert ours == theirs


def keep_lists(name: str) -> list[list[str]]:
    """Every unit of the model alone, all of them, none."""
    units = list(model_decls(entry(name).config)[0].units)
    return [[unit] for unit in units] + [["all"], []]


def test_the_annotated_model_plans_as_the_hand_marked_one_for_every_unit(pair):
    name, hand, mine = pair
    for keep in keep_lists(name):
        got, want = plan_facts(mine, keep), plan_facts(hand, keep)
        for fact in want:
            assert got[fact] == want[fact], f"keep={keep}: {fact} differs"


@pytest.mark.parametrize("name", MARKERS_IN_REGION)
def test_under_the_ep_compile_config_only_the_shared_experts_markers_differ(name):
    """The markers of SAVE_MLP land in the shared experts' compiled region, and nothing else
    differs: the plans save, replay and peak the same; only those markers' reason differs."""
    _, hand, mine = exported_pair(name)
    ours, theirs = canonical(mine), canonical(hand)
    differing = [
        (got.attributes[0].str, got.compiled_region, want.compiled_region)
        for got, want in zip(ours.nodes, theirs.nodes, strict=True)
        if got != want
    ]
    assert differing and all(
        role.startswith("SAVE_MLP.") and region.endswith("._shared_experts_forward") and not eager
        for role, region, eager in differing
    ), differing
    for node in ours.nodes:
        node.compiled_region = "" if node.op == MARKER_OP else node.compiled_region
    for node in theirs.nodes:
        node.compiled_region = "" if node.op == MARKER_OP else node.compiled_region
    assert ours == theirs
    for keep in keep_lists(name):
        got, want = plan_facts(mine, keep), plan_facts(hand, keep)
        for fact in ("saved", "replay", "units", "memory", "diagnostics"):
            assert got[fact] == want[fact], f"keep={keep}: {fact} differs"

