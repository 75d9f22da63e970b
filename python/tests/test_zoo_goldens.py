"""The committed golden graphs (tests/golden/NAME.pb + NAME.safetensors): fresh, small, loadable,
and shaped the way production configurations are (markers, compiled regions, collectives).

Regenerate them with `python python/export_goldens.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export_support import planner_run
from graph_walk import (
    GOLDEN_DIR,
    declared_intervals,
    forward_then_backward,
    interval_contents,
    layer_runs,
    load_graph,
    loss_ancestors,
    marker_name,
    markers_by_run,
    micro_batch_mismatches,
)
from recompute_planner._exporter import write_graph, write_reference
from recompute_planner._zoo import make_inputs
from recompute_planner._zoo.goldens import (
    GOLDENS,
    export_rank,
    golden,
    rank_path,
    reference_path,
    trace_for_timing,
    trace_graph_bytes,
)
from recompute_planner.markers import MARKER_NAME_ATTR
from recompute_planner.proto import graph_pb2
from tolerance import assert_tensor_close, assert_tensors_close

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_GOLDEN_BYTES = 300_000
UNBALANCED = "moe_ep2_unbalanced"
A2A = "_c10d_functional.all_to_all_single.default"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"


def graph_of(name: str) -> graph_pb2.Graph:
    return load_graph(GOLDEN_DIR / f"{name}.pb")


def by_name(names):
    return pytest.mark.parametrize("name", names)


ALL = [g.name for g in GOLDENS]
JOINT = [g.name for g in GOLDENS if g.joint]
MOE = [g.name for g in GOLDENS if g.entry.config.num_experts]


# --------------------------------------------------------------------------------------------
# Files


@by_name(ALL)
def test_golden_files_exist_and_are_small(name):
    pb, reference = GOLDEN_DIR / f"{name}.pb", GOLDEN_DIR / f"{name}.safetensors"
    assert pb.is_file() and reference.is_file(), "run python python/export_goldens.py"
    assert pb.stat().st_size < MAX_GOLDEN_BYTES


@by_name(ALL)
def test_golden_graph_is_up_to_date(name, builders_agree):
    """A fresh trace of rank 0 gives the committed bytes (and proves export is deterministic),
    built by the native builder and the Python one alike."""
    fresh = trace_graph_bytes(golden(name))
    assert fresh == (GOLDEN_DIR / f"{name}.pb").read_bytes(), (
        f"{name}.pb is stale: run python python/export_goldens.py {name}"
    )


def committed_reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(GOLDEN_DIR / f"{name}.safetensors")


@by_name([g.name for g in GOLDENS if g.world_size == 1])
def test_single_rank_reference_is_up_to_date(name, tmp_path):
    """Single-rank goldens re-export with the committed graph bytes, and reference tensors equal
    to the committed ones within the tolerance of `tolerance.py` (floats computed by PyTorch
    differ in the last bits between CPU models)."""
    result = export_rank(golden(name))
    write_graph(result.graph, tmp_path / "graph.pb")
    write_reference(result, tmp_path / "reference.safetensors")
    assert (tmp_path / "graph.pb").read_bytes() == (GOLDEN_DIR / f"{name}.pb").read_bytes()
    assert_tensors_close(load_file(tmp_path / "reference.safetensors"), committed_reference(name))


def test_reference_exported_with_other_cpu_kernels_is_within_tolerance(tmp_path):
    """The export on another CPU, simulated with PyTorch's scalar kernels
    (`ATEN_CPU_CAPABILITY=default`, runnable on any x86-64): the same graph bytes, other
    reference bits (the seeded weights included), all within tolerance."""
    done = subprocess.run(
        [sys.executable, "python/export_goldens.py", "--out", str(tmp_path), "dense"],
        cwd=REPO_ROOT,
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dense.pb").read_bytes() == (GOLDEN_DIR / "dense.pb").read_bytes()
    fresh = load_file(tmp_path / "dense.safetensors")
    committed = committed_reference("dense")
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # this machine's own kernels differ
        differ = [key for key in committed if not torch.equal(fresh[key], committed[key])]
        assert "param/embed_tokens" in differ, differ
        assert any(key.startswith("ref/grad/") for key in differ), differ
    assert_tensors_close(fresh, committed)


MULTI_RANK = [g.name for g in GOLDENS if g.world_size > 1]


@by_name(MULTI_RANK)
def test_every_rank_has_its_own_small_reference(name):
    """The runtime runs each rank on its own tensors: `NAME.rank<r>.safetensors` beside rank 0's,
    with the same keys."""
    keys = set(committed_reference(name))
    for rank in range(1, golden(name).world_size):
        path = reference_path(GOLDEN_DIR, name, rank)
        assert path.is_file(), "run python python/export_goldens.py"
        assert path.stat().st_size < MAX_GOLDEN_BYTES
        assert set(load_file(path)) == keys, path.name


@by_name(MULTI_RANK)
def test_other_ranks_hold_their_own_weights_and_inputs(name):
    """Rank r's weights (within tolerance) and inputs (exactly) are those rank r's model and
    data make; its gradients need real ranks to recompute."""
    gold = golden(name)
    for rank in range(1, gold.world_size):
        reference = load_file(reference_path(GOLDEN_DIR, name, rank))
        model = gold.entry.build(rank=rank)
        for param_name, param in model.named_parameters():
            assert_tensor_close(param_name, param.detach(), reference[f"param/{param_name}"])
        cfg = gold.entry.config.for_rank(gold.world_size, rank)
        for index, tensor in enumerate(make_inputs(cfg)):
            assert_tensor_close(f"input.{index}", tensor, reference[f"input/input.{index}"])


@by_name(MULTI_RANK)
def test_a_rank_has_its_own_graph_exactly_when_its_graph_differs_from_rank0(name):
    """Sequence-parallel (DSA) ranks bake their own sequence positions into their graphs, so
    each has `NAME.rank<r>.pb`; other models' ranks run rank 0's graph."""
    gold = golden(name)
    for rank in range(1, gold.world_size):
        path = rank_path(GOLDEN_DIR, name, rank, "pb")
        assert path.is_file() == gold.entry.config.uses_dsa, path.name
        if path.is_file():
            own = load_graph(path)
            assert own.metadata.rank == rank
            own.metadata.rank = 0
            assert own.SerializeToString(deterministic=True) != graph_of(name).SerializeToString(
                deterministic=True
            )


@by_name(JOINT)
def test_the_reference_records_the_generator_seed(name):
    """`rng/seed` lets an executor draw the reference step's random numbers (dropout masks)."""
    seed = committed_reference(name)["rng/seed"]
    assert seed.dtype == torch.int64 and seed.dim() == 0


@by_name(MULTI_RANK)
def test_multi_rank_reference_holds_rank0_weights_and_inputs(name):
    """Weights (within tolerance) and inputs (exactly) of rank 0 are current; the gradients
    need real ranks to recompute."""
    gold = golden(name)
    reference = committed_reference(name)
    model = gold.entry.build()
    for param_name, param in model.named_parameters():
        assert_tensor_close(param_name, param.detach(), reference[f"param/{param_name}"])
    for index, tensor in enumerate(make_inputs(gold.entry.config)):
        assert_tensor_close(f"input.{index}", tensor, reference[f"input/input.{index}"])
    grads = [key for key in reference if key.startswith("ref/grad/")]
    assert len(grads) == len(list(model.parameters()))
    assert all(torch.isfinite(reference[key]).all() for key in grads)


@by_name(ALL)
def test_golden_loads_with_the_rust_cli(name, planner_bin):
    done = subprocess.run(
        [planner_bin, "inspect", f"tests/golden/{name}.pb"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"graph {name}" in done.stdout


# --------------------------------------------------------------------------------------------
# Markers and layers


def expected_markers(graph: graph_pb2.Graph, run: tuple[str, int, int]) -> list[str]:
    """The declared markers a layer run records: both ends of every interval it opens."""
    recorded = set(markers_by_run(graph)[run])
    return sorted(
        marker
        for begin, end in declared_intervals(graph, run[0]).items()
        if begin in recorded or end in recorded
        for marker in (begin, end)
    )


@by_name([n for n in ALL if n != UNBALANCED])
def test_markers_come_in_balanced_pairs_per_layer(name):
    """Every layer run records each of its intervals' begin once, then its end once."""
    graph = graph_of(name)
    for run, markers in markers_by_run(graph).items():
        assert sorted(markers) == expected_markers(graph, run), run
        intervals = declared_intervals(graph, run[0])
        for begin, end in intervals.items():
            if begin in markers:
                assert markers.index(begin) < markers.index(end), (run, begin)


@by_name(ALL)
def test_every_declared_marker_is_recorded_somewhere(name):
    """No `marker-missing`: each model's intervals are recorded by at least one of its layers."""
    graph = graph_of(name)
    for model in graph.models:
        recorded = {
            m for run, ms in markers_by_run(graph).items() if run[0] == model.name for m in ms
        }
        for begin, end in declared_intervals(graph, model.name).items():
            assert {begin, end} & recorded, f"{model.name}: {begin} never recorded"


def test_unbalanced_variant_misses_exactly_two_markers():
    """Layer 0 opens `moe.dispatch` without closing it, layer 1 closes `moe.combine` unopened."""
    graph = graph_of(UNBALANCED)
    balanced = graph_of("moe_ep2")
    for layer, missing in ((0, "moe.dispatch.end"), (1, "moe.combine.begin")):
        run = ("main", layer, 0)
        expected = [m for m in markers_by_run(balanced)[run] if m != missing]
        assert markers_by_run(graph)[run] == expected


@by_name(ALL)
def test_phases_follow_execution(name):
    """Forward nodes come first (eager finishes the forward before backward starts), every
    ancestor of the loss is forward, and the first node reading a tangent is backward (so,
    with the prefix, is everything depending on a tangent); a forward-only graph is all
    forward."""
    graph = graph_of(name)
    forward = graph_pb2.PHASE_FORWARD
    assert forward_then_backward(graph)
    feeds_loss = loss_ancestors(graph)
    assert all(n.phase == forward for n in graph.nodes if n.name in feeds_loss)
    tangents = {v.name for v in graph.values if v.role == graph_pb2.ROLE_TANGENT}
    readers = [n for n in graph.nodes if tangents & set(n.inputs)]
    if readers:
        assert readers[0].phase == graph_pb2.PHASE_BACKWARD
    else:
        assert all(n.phase == forward for n in graph.nodes)


@by_name(JOINT)
def test_every_layer_has_forward_and_backward_nodes(name):
    graph = graph_of(name)
    for model in graph.models:
        for layer in range(model.num_layers):
            phases = {
                n.phase for n in graph.nodes if n.model == model.name and n.layer == layer
                and n.HasField("layer")
            }
            assert phases == {graph_pb2.PHASE_FORWARD, graph_pb2.PHASE_BACKWARD}, (model, layer)


# --------------------------------------------------------------------------------------------
# MoE: dispatch, combine, routing counts


def d2h_copies(nodes) -> list[graph_pb2.Node]:
    """`aten._to_copy` nodes carrying a `device` attribute of "cpu"."""
    return [
        n
        for n in nodes
        if n.op == "aten._to_copy.default"
        and any(a.name == "device" and a.str == "cpu" for a in n.attributes)
    ]


@by_name([n for n in MOE if n != UNBALANCED])
def test_dispatch_holds_the_all_to_all_and_the_routing_count_copy(name):
    """Each MoE layer run's dispatch interval exchanges counts and tokens and copies the counts
    to host; combine sends the tokens back."""
    graph = graph_of(name)
    contents = interval_contents(graph)
    world = graph.metadata.world_size
    moe_runs = [key for key in contents if key[1] == "moe.gate.begin"]
    assert moe_runs
    for run, _ in moe_runs:
        dispatch = contents[(run, "moe.dispatch.begin")]
        ops = Counter(n.op for n in dispatch)
        assert len(d2h_copies(dispatch)) == 1, run
        assert ops[A2A] == (2 if world > 1 else 0), run
    combine = [ops for (run, begin), ops in contents.items() if begin == "moe.combine.begin"]
    assert all(Counter(n.op for n in ops)[A2A] == (1 if world > 1 else 0) for ops in combine)


def test_inplace_variant_writes_a_tensor_made_in_the_same_interval():
    graph = graph_of("moe_ep2_inplace")
    for (run, begin), nodes in interval_contents(graph).items():
        if begin != "moe.dispatch.begin":
            continue
        produced = {out for n in nodes for out in n.outputs}
        writes = [n for n in nodes if n.schema.mutates]
        assert [n.op for n in writes] == ["aten.index_add_.default"], run
        assert writes[0].inputs[writes[0].schema.mutates[0]] in produced, run
    assert not any(n.schema.mutates for n in graph_of("moe_ep2").nodes)


# --------------------------------------------------------------------------------------------
# Compile configs


def regions_of(nodes) -> set[str]:
    return {n.compiled_region for n in nodes}


EAGER = ["dense", "moe_ep2", "moe_ep4", "moe_domino", "moe_ep2_inplace", UNBALANCED]
EAGER += ["moe_hf_router", "dsv3_kv_expand", "dense_dropout", "moe_ep2_cuda"]


@by_name(EAGER)
def test_uncompiled_configs_run_everything_in_eager(name):
    assert regions_of(graph_of(name).nodes) == {""}


def test_ep_compile_config_compiles_the_seeds_methods():
    """`_pre_moe_forward`, the experts, `_shared_experts_forward` and `_post_moe_forward` are
    compiled; the dispatcher and the layer body that places the markers are not."""
    graph = graph_of("moe_ep2_compiled")
    methods = ("_pre_moe_forward", "experts", "_shared_experts_forward", "_post_moe_forward")
    expected = {""} | {f"layers.{i}.{m}" for i in range(2) for m in methods}
    assert regions_of(graph.nodes) == expected
    contents = interval_contents(graph)
    markers = [n for nodes in layer_runs(graph).values() for n in nodes if marker_name(n)]
    for marker in markers:
        inside = marker_name(marker).startswith(("attn.", "moe.gate."))
        assert (marker.compiled_region != "") == inside, marker_name(marker)
    for (run, begin), nodes in contents.items():
        if begin in ("moe.dispatch.begin", "moe.combine.begin"):
            assert regions_of(nodes) == {""}, (run, begin)
        if begin == "mlp.begin":  # markers fire in eager, everything between them is compiled
            assert regions_of(nodes) == {f"layers.{run[1]}._shared_experts_forward"}, run


def test_layer_compile_config_compiles_each_layer_as_one_region():
    graph = graph_of("moe_layer_compiled")
    for (_, layer, _), nodes in layer_runs(graph).items():
        assert regions_of(nodes) == {f"layers.{layer}"}, layer
    outside = [n for n in graph.nodes if not n.HasField("layer")]
    assert regions_of(outside) == {""}


@by_name(["glm_dsa_ep2", "glm_dsa_ep2_compiled"])
def test_dsa_topk_runs_eager_between_compiled_indexer_and_sparse_attention(name):
    """The DSA layout (top-k eager between compiled projection and sparse attention), in every
    layer of both models (main and the nested MTP)."""
    graph = graph_of(name)
    contents = interval_contents(graph)
    indexer_runs = [run for run, begin in contents if begin == "dsa.indexer.begin"]
    assert sorted(indexer_runs) == [("main", 0, 0), ("main", 1, 0), ("mtp", 0, 0)]
    for run in indexer_runs:
        selection = contents[(run, "dsa.indexer.begin")]
        assert regions_of(selection) == {""}, run
        assert Counter(n.op for n in selection)["aten.topk.default"] == 1, run
        prefix = "layers" if run[0] == "main" else "mtp.layers"
        attn = f"{prefix}.{run[1]}.self_attn"
        by_region: dict[str, Counter] = {}
        for node in layer_runs(graph)[run]:
            by_region.setdefault(node.compiled_region, Counter())[node.op] += 1
        assert by_region[f"{attn}.indexer"]["aten.mm.default"] == 1, run
        assert by_region[f"{attn}.sp_gather"][ALL_GATHER] == 1, run
        assert by_region[f"{attn}.sparse_attention"][ALL_GATHER] == 1, run
        assert by_region[f"{attn}.sparse_attention"]["aten._softmax.default"] == 1, run


def test_glm_declares_mtp_as_a_nested_model():
    graph = graph_of("glm_dsa_ep2")
    models = {m.name: (m.parent, m.num_layers) for m in graph.models}
    assert models == {"main": ("", 2), "mtp": ("main", 1)}
    units = [u.unit for u in graph.models[1].units]
    assert "SAVE_DSA_INDEXER" in units and "SAVE_MOE_DISPATCH" in units


# --------------------------------------------------------------------------------------------
# Domino: each micro-batch encloses what the single batch does (policy rule R10)


def test_domino_runs_two_micro_batches_per_layer():
    runs = markers_by_run(graph_of("moe_domino"))
    assert sorted(runs) == [("main", layer, mb) for layer in range(2) for mb in range(2)]


def test_domino_units_enclose_the_single_batch_operations():
    """R10: per layer and micro-batch, each interval encloses exactly the single-batch ops."""
    assert micro_batch_mismatches(graph_of("moe_ep2"), graph_of("moe_domino")) == []


def test_domino_check_catches_a_lost_marker():
    """The micro-batch check verified by mutation: without `moe.dispatch.end` in one
    micro-batch (renamed to a marker no unit declares), its dispatch interval stays open over
    the routed experts' GEMMs and the comparison fails for that micro-batch only."""
    mutated = graph_pb2.Graph()
    mutated.CopyFrom(graph_of("moe_domino"))
    run = [n for n in mutated.nodes if n.HasField("layer") and (n.layer, n.micro_batch) == (1, 1)
           and n.phase == graph_pb2.PHASE_FORWARD]
    (end,) = [n for n in run if marker_name(n) == "moe.dispatch.end"]
    (attribute,) = [a for a in end.attributes if a.name == MARKER_NAME_ATTR]
    attribute.str = "moe.dispatch.lost"
    problems = micro_batch_mismatches(graph_of("moe_ep2"), mutated)
    assert problems and all("('main', 1, 1)" in p for p in problems), problems
    assert any("aten.bmm.default" in p for p in problems), problems


# --------------------------------------------------------------------------------------------
# Patterns of stock HuggingFace-style model code


class InPlaceWrites:
    """The tensors an interval's nodes make and then write in place (through views too)."""

    def __init__(self, nodes: list[graph_pb2.Node]):
        self.nodes = nodes
        self.producer = {o: n for n in nodes for o in n.outputs}
        writers: dict[str, list[graph_pb2.Node]] = {}
        for node in nodes:
            for slot in node.schema.mutates:
                writers.setdefault(self.root(node.inputs[slot]), []).append(node)
        self.made = [(self.producer[v], w) for v, w in writers.items() if v in self.producer]

    def root(self, value: str) -> str:
        """The tensor `value` is a view of (itself if it is none)."""
        node = self.producer.get(value)
        while node is not None and node.schema.HasField("view_of"):
            value = node.inputs[node.schema.view_of]
            node = self.producer.get(value)
        return value

    def ops(self) -> list[tuple[str, list[str]]]:
        """(op making the tensor, ops writing it), sorted."""
        return sorted((maker.op, [w.op for w in written]) for maker, written in self.made)

    def read_before_last_write(self) -> list[str]:
        """Nodes other than the writers (and the views they write through) that read a written
        tensor, or a view of it, before its last write."""
        early = []
        for maker, written in self.made:
            last = max(self.nodes.index(w) for w in written)
            targets = {w.inputs[slot] for w in written for slot in w.schema.mutates}
            early += [
                n.name
                for n in self.nodes[:last]
                if n not in written
                and not set(n.outputs) & targets
                and any(self.root(v) == maker.outputs[0] for v in n.inputs)
            ]
        return early


def fresh_fills(nodes: list[graph_pb2.Node]) -> list[tuple[str, list[str]]]:
    """`InPlaceWrites.ops` of buffers read only after their writes (asserted)."""
    writes = InPlaceWrites(nodes)
    assert writes.read_before_last_write() == []
    return writes.ops()


def moe_runs(name: str) -> dict:
    contents = interval_contents(graph_of(name))
    return {run: contents for run, begin in contents if begin == "moe.gate.begin"}


def test_hf_router_normalises_its_top_k_weights_in_place_inside_the_gate():
    for run, contents in moe_runs("moe_hf_router").items():
        writes = InPlaceWrites(contents[(run, "moe.gate.begin")])
        assert writes.ops() == [("aten.topk.default", ["aten.div_.Tensor"])], run
        assert writes.read_before_last_write(), "a read-modify-write reads what it writes"


def test_hf_dispatch_fills_buffers_it_makes_in_the_interval_and_reads_them_after():
    """`one_hot`'s `zeros` filled by `scatter_`, `inverse[perm] = arange` into `empty_like`,
    the expert buffer and routing map filled in `new_zeros` (`index_put_`, `scatter_`), the
    combine's sum in `zeros_like` (`index_put_`)."""
    put, runs = "aten.index_put_.default", moe_runs("moe_hf_router")
    assert sorted(run[1] for run in runs) == [0, 1]
    for run, contents in runs.items():
        assert fresh_fills(contents[(run, "moe.dispatch.begin")]) == [
            ("aten.empty_like.default", [put]),
            ("aten.new_zeros.default", [put]),
            ("aten.new_zeros.default", ["aten.scatter_.value"]),
            ("aten.zeros.default", ["aten.scatter_.value"]),
        ], run
        assert fresh_fills(contents[(run, "moe.combine.begin")]) == [
            ("aten.zeros_like.default", [put])
        ], run


def test_hf_dispatch_routes_with_one_hot_as_eager_runs_it():
    """`F.one_hot` is `zeros` filled by `scatter_` in eager; the fake-tensor path ATen takes
    in a trace (`arange`, `eq`, a copy to int64, range checks) is not in the graph."""
    for run, contents in moe_runs("moe_hf_router").items():
        dispatch = Counter(n.op for n in contents[(run, "moe.dispatch.begin")])
        assert dispatch["aten.zeros.default"] == 1, run
        assert not dispatch["aten.eq.Tensor"] and not dispatch["aten._assert_async.msg"], run


def test_dsv3_attention_fills_queries_and_keys_into_new_empty_buffers():
    copy = "aten.copy_.default"
    contents = interval_contents(graph_of("dsv3_kv_expand"))
    runs = [run for run, begin in contents if begin == "attn.begin"]
    assert sorted(run[1] for run in runs) == [0, 1]
    for run in runs:
        assert fresh_fills(contents[(run, "attn.begin")]) == [
            ("aten.new_empty.default", [copy, copy]),
            ("aten.new_empty.default", [copy, copy]),
        ], run


def test_dropout_runs_inside_the_attention_interval_and_outside_every_interval():
    graph = graph_of("dense_dropout")
    dropouts = [n for n in graph.nodes if n.op == "aten.native_dropout.default"]
    assert len(dropouts) == 4 and all(n.schema.random for n in dropouts)
    assert all(n.phase == graph_pb2.PHASE_FORWARD for n in dropouts)
    contents = interval_contents(graph)
    for run, nodes in layer_runs(graph).items():
        enclosed = {
            n.name: begin for (key, begin), inside in contents.items() if key == run for n in inside
        }
        where = sorted(enclosed.get(n.name, "") for n in nodes if n in dropouts)
        assert where == ["", "attn.begin"], run


def test_a_model_traced_for_timing_runs_on_its_ranks_from_its_tokens_and_a_seed(tmp_path):
    """`trace_for_timing` (the trade-offs script's traced DSA model): each rank's graph where
    it differs from rank 0's (sequence-parallel positions), each rank's own tokens and a unit
    loss tangent beside it, and `planner run --seed` fills the weights and runs every rank
    with outputs bit-identical to no checkpointing."""
    cfg = golden("glm_dsa_ep2").entry.config.resized(seq=16, index_topk=8)
    graph = trace_for_timing("dsa_traced", cfg, tmp_path)
    assert graph == tmp_path / "dsa_traced.pb"
    assert (tmp_path / "dsa_traced.rank1.pb").exists()
    for rank in range(cfg.world_size):
        data = load_file(reference_path(tmp_path, "dsa_traced", rank))
        tokens = make_inputs(cfg.for_rank(cfg.world_size, rank))
        for i, expected in enumerate(tokens):
            assert torch.equal(data[f"input/input.{i}"], expected)
        assert [k for k in data if k.startswith("tangent/")] == ["tangent/tangents_1"]
    done = planner_run(str(graph), "--seed", "0", "--keep", "SAVE_DSA_INDEXER", "--check")
    assert done.returncode == 0, done.stderr
    assert "bit-identical" in done.stdout
