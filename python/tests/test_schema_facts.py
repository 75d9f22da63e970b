"""Schema facts (mutation, view, randomness, collective kind) the exporter records (docs/ir.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from export_support import (
    MAIN,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    Lambda,
    fake_process_group,
    nodes_with_op,
    only_node,
)
from recompute_planner._exporter import collective_kind, export_joint, schema_facts
from recompute_planner.proto import graph_pb2

FUNCTIONAL = graph_pb2.COLLECTIVE_KIND_FUNCTIONAL
MUTATING = graph_pb2.COLLECTIVE_KIND_MUTATING
NONE = graph_pb2.COLLECTIVE_KIND_NONE


def _export(fn, x=None):
    torch.manual_seed(0)
    x = torch.randn(4, 4) if x is None else x
    return export_joint(Lambda(fn), (x,), name="facts", models=MAIN).graph


def test_in_place_ops_on_intermediates_mutate_their_first_input():
    def step(self, x):
        h = self.lin(x).clone()
        h.add_(1)  # read-modify-write on an intermediate: stays in-place in the IR
        acc = torch.zeros(2, 4)
        acc.index_add_(0, torch.tensor([0, 1, 1, 0]), h)
        return (h * acc.sum()).sum()

    graph = _export(step)
    add = only_node(graph, "aten.add_.Tensor")
    assert list(add.schema.mutates) == [0] and not add.schema.HasField("view_of")
    index_add = only_node(graph, "aten.index_add_.default")
    assert list(index_add.schema.mutates) == [0]
    assert len(index_add.inputs) == 3  # self, index, source
    # Readers after the write read the in-place op's output, so the order is explicit.
    assert any(add.outputs[0] in n.inputs for n in graph.nodes if n.op == "aten.index_add_.default")
    assert list(only_node(graph, "aten.clone.default").schema.mutates) == []


def test_views_record_their_base_input():
    def step(self, x):
        h = self.lin(x).view(2, 8).transpose(0, 1)
        first, _ = h.unbind(1)
        return first.sum()

    graph = _export(step)
    for op in ("aten.view.default", "aten.transpose.int", "aten.unbind.int", "aten.t.default"):
        for node in nodes_with_op(graph, op):
            assert node.schema.HasField("view_of") and node.schema.view_of == 0, node.name
    assert not only_node(graph, "aten.addmm.default").schema.HasField("view_of")


def test_random_ops_are_marked_random():
    graph = _export(lambda self, x: F.dropout(self.lin(x), 0.5).sum())
    assert only_node(graph, "aten.native_dropout.default").schema.random
    assert not only_node(graph, "aten.addmm.default").schema.random
    assert not only_node(graph, "aten.native_dropout_backward.default").schema.random


def test_functional_all_to_all_and_wait_are_functional_collectives_in_both_phases():
    def step(self, x):
        h = funcol.all_to_all_single(self.lin(x), [2, 2], [2, 2], dist.group.WORLD)
        return (h * h).sum()

    with fake_process_group(world_size=2):
        graph = _export(step)
        group_name = dist.group.WORLD.group_name
    for op in (
        "_c10d_functional.all_to_all_single.default",
        "_c10d_functional.wait_tensor.default",
    ):
        nodes = nodes_with_op(graph, op)
        assert {n.phase for n in nodes} == {PHASE_FORWARD, PHASE_BACKWARD}, op
        assert all(n.schema.collective == FUNCTIONAL and not n.schema.mutates for n in nodes)
    a2a = nodes_with_op(graph, "_c10d_functional.all_to_all_single.default")[0]
    attributes = {a.name: a for a in a2a.attributes}
    assert list(attributes["output_split_sizes"].ints.values) == [2, 2]
    assert attributes["group_name"].str == group_name


def test_mutating_c10d_all_reduce_traces_as_a_mutating_collective(builders_agree):
    def step(self, x):
        h = self.lin(x)
        with torch.no_grad():  # c10d ops have no autograd formula: keep them off the tape
            stats = h.detach().clone()
            dist.all_reduce(stats)
        return (h * stats).sum()

    with fake_process_group(world_size=2):
        graph = _export(step)
    all_reduce = only_node(graph, "c10d.allreduce_.default")
    assert all_reduce.phase == PHASE_FORWARD
    assert all_reduce.schema.collective == MUTATING
    # The c10d schema carries no `(a!)`: the collective kind, not `mutates`, says it writes.
    assert list(all_reduce.schema.mutates) == []
    assert [a.str for a in all_reduce.attributes if a.name == "process_group"] == [
        "__torch__.torch.classes.c10d.ProcessGroup"
    ]


def test_collective_classifier_by_namespace_and_name():
    assert collective_kind("_c10d_functional.all_to_all_single.default") == FUNCTIONAL
    assert collective_kind("_c10d_functional.all_reduce_.default") == MUTATING
    assert collective_kind("_c10d_functional_autograd.all_reduce.default") == FUNCTIONAL
    assert collective_kind("c10d.alltoall_base_.default") == MUTATING
    assert collective_kind("aten.add_.Tensor") == NONE
    facts = schema_facts(torch.ops.c10d.allreduce_.default, {"tensors": [0]})
    assert facts.collective == MUTATING


def test_schema_facts_positions_follow_the_ir_input_list():
    # index_put_(self, indices: Tensor?[], values): with indices [None, i] the IR inputs are
    # [self, i, values], so `values` sits at 2 and the write at 0.
    positions = {"self": [0], "indices": [1], "values": [2]}
    facts = schema_facts(torch.ops.aten.index_put_.default, positions)
    assert list(facts.mutates) == [0] and not facts.HasField("view_of")
    legit = schema_facts(
        torch.ops.aten._native_batch_norm_legit.default,
        {"input": [0], "weight": [], "bias": [], "running_mean": [1], "running_var": [2]},
    )
    assert list(legit.mutates) == [1, 2]
