"""Op intervals (`recompute_planner.OpInterval`): a unit from the first op matching one pattern
to the last matching another inside a submodule, declared by `annotate` without a source edit.

The markers sit where `x = checkpoint_record(...)` written by hand would put them; the last
match's end is tentative until the run ends, and the exporter (and the torch.compile stage)
keep only the last one; eager selective checkpointing ignores markers on both sides.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

import recompute_planner as rp
from recompute_planner import sac
from recompute_planner._exporter import export_joint
from recompute_planner.markers import MARKER_NAME_ATTR, MARKER_OP, checkpoint_record
from test_annotate_zoo import canonical

UNIT = "SAVE_U"


class Inner(nn.Module):
    """linear, relu, linear times the input again, relu; `marked`: the hand-placed markers of
    the interval from the first linear to the last relu; `tanh`: a tanh where the first relu
    is (a layer without that op)."""

    def __init__(self, marked: bool = False, tanh: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.marked, self.tanh = marked, tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.marked:
            x = checkpoint_record("u.begin", x)
        h = (torch.tanh if self.tanh else torch.relu)(self.a(x))
        out = torch.relu(self.b(h) * x)
        return checkpoint_record("u.end", out) if self.marked else out


class Layer(nn.Module):
    def __init__(self, **inner):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.inner = Inner(**inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.norm(x))


class Model(nn.Module):
    def __init__(self, *layers: dict):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(**inner) for inner in layers or ({}, {}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def inputs() -> tuple[torch.Tensor]:
    return (torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),)


def interval(last: str = "relu", first: str = "linear") -> rp.OpInterval:
    return rp.OpInterval("inner", first=first, last=last, name="u")


def annotated(*layers: dict, **spec) -> tuple[Model, rp.Annotation]:
    model = Model(*layers)
    return model, rp.annotate(model, layers="layers", units={UNIT: [interval(**spec)]})


def exported(model: nn.Module, annotation) -> rp.proto.graph_pb2.Graph:  # noqa: F821
    return export_joint(model, inputs(), name="m", models=annotation.models).graph


def markers(graph) -> list[tuple[str, int]]:
    """(marker name, layer) of the graph's markers, in order."""
    return [
        (next(a.str for a in n.attributes if a.name == MARKER_NAME_ATTR), n.layer)
        for n in graph.nodes
        if n.op == MARKER_OP
    ]


def producer_op(graph, value: str) -> str:
    return next(n.op for n in graph.nodes if value in n.outputs)


def planned(graph, keep):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, check=False)


class PlacedMarkers:
    """Counts the markers ``rp.annotate`` places in an eager run (eagerly a marker is its
    tensor: no op is dispatched to count)."""

    def __init__(self, monkeypatch):
        self.count = 0

        def counted(name, x):
            self.count += 1
            return checkpoint_record(name, x)

        # The module (the package's `annotate` is its function).
        module = importlib.import_module("recompute_planner.annotate")
        monkeypatch.setattr(module, "checkpoint_record", counted)


def test_op_interval_markers_sit_where_hand_placed_ones_do():
    model, annotation = annotated()
    hand = Model({"marked": True}, {"marked": True})
    rp.annotate(hand, layers="layers")  # layer scopes only: the markers are in its code
    mine = exported(model, annotation)
    want = export_joint(hand, inputs(), name="m", models=annotation.models).graph
    assert canonical(mine) == canonical(want)
    assert markers(mine) == [("u.begin", 0), ("u.end", 0), ("u.begin", 1), ("u.end", 1)]


def test_the_last_match_ends_the_interval_and_earlier_tentative_ends_leave_the_graph(
    monkeypatch,
):
    model, annotation = annotated()
    graph = exported(model, annotation)
    ends = [n for n in graph.nodes if n.op == MARKER_OP and n.layer == 0][1:]
    assert len(ends) == 1 and producer_op(graph, ends[0].inputs[0]) == "aten.relu.default"
    relus = [n for n in graph.nodes if n.op == "aten.relu.default" and n.layer == 0]
    assert [n.outputs[0] for n in relus][-1] == ends[0].inputs[0]  # the second relu's
    # In eager each relu got an end until the module returned: begin + 2 ends per layer.
    counted = PlacedMarkers(monkeypatch)
    model(*inputs())
    assert counted.count == 2 * 3


def test_an_indexed_pattern_ends_the_interval_at_that_match(monkeypatch):
    model, annotation = annotated(last="relu[0]")
    graph = exported(model, annotation)
    begin, end = [n for n in graph.nodes if n.op == MARKER_OP and n.layer == 0]
    first_relu = next(n for n in graph.nodes if n.op == "aten.relu.default" and n.layer == 0)
    assert end.inputs[0] == first_relu.outputs[0]
    counted = PlacedMarkers(monkeypatch)
    model(*inputs())
    assert counted.count == 2 * 2  # exact ends: no tentative one


def test_later_reads_of_the_marked_input_read_the_marker_as_after_a_hand_placed_one():
    # `self.b(h) * x` reads the interval's input again: the marker's output, not `x`.
    model, annotation = annotated()
    graph = exported(model, annotation)
    begin = next(n for n in graph.nodes if n.op == MARKER_OP)
    readers = [n.op for n in graph.nodes if begin.outputs[0] in n.inputs and n.phase == 1]
    assert "aten.mul.Tensor" in readers


def test_a_pattern_matching_in_no_layer_is_an_error_naming_unit_module_and_ops():
    model, _ = annotated(first="softmax")
    with pytest.raises(ValueError, match=r"SAVE_U.*'u' matched in no layer.*`inner`.*`softmax`"
                       r".*layer 0's ran: linear, relu, mul\)$"):
        model(*inputs())


def test_a_pattern_absent_in_some_layers_applies_where_it_matches():
    model, annotation = annotated({"tanh": True}, {}, first="tanh", last="relu")
    assert annotation.absent == {}  # known once the model ran
    graph = exported(model, annotation)
    assert annotation.absent == {UNIT: {"u": [1]}}
    assert markers(graph) == [("u.begin", 0), ("u.end", 0)]
    kept = {(n.layer, n.unit) for n in planned(graph, [UNIT]).nodes if n.decision == "save"}
    assert kept == {(0, UNIT)}


def test_an_interval_that_begins_and_never_ends_is_an_error():
    model, _ = annotated(last="softmax")
    with pytest.raises(ValueError, match=r"began at `linear` but no op matching `softmax`"):
        model(*inputs())


def test_an_in_place_op_cannot_end_an_interval():
    model, _ = annotated(last="add_")

    def forward(x):
        return torch.relu(x).add_(1)

    model.layers[0].inner.b.forward = forward
    with pytest.raises(ValueError, match=r"`add_`, which writes its input in place"):
        model(*inputs())


def test_a_malformed_pattern_is_an_error_when_declared():
    with pytest.raises(ValueError, match=r"op pattern 'relu\[x\]'"):
        rp.OpInterval("inner", first="linear", last="relu[x]")


def test_sac_from_the_plan_keeps_gradients_bit_identical_with_tentative_ends_in_eager():
    """Eager runs a tentative end after the first relu that the graph lacks: the policy must
    not match it to the graph's real end a few ops later (it would skip the kept ops
    between, and raise SacMismatchError)."""
    model, annotation = annotated()
    plan = planned(exported(model, annotation), [UNIT])
    checkpointed, _ = annotated()
    policies = sac.checkpoint_layers(checkpointed.layers, plan)

    def step(m):
        loss = m(*inputs())
        return loss, torch.autograd.grad(loss, list(m.parameters()))

    (loss, grads), (plain_loss, plain_grads) = step(checkpointed), step(Model())
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    assert all(policy.held_bytes() > 0 for policy in policies.values())


def test_op_interval_markers_settle_in_a_torch_compile_graph():
    """Dynamo traces the mode; the stage's plan is the exported graph's."""
    model, annotation = annotated()
    want = planned(exported(model, annotation), [UNIT])
    torch._dynamo.reset()
    with warnings.catch_warnings(), rp.compile.planning(annotation.models, [UNIT]) as stage:
        warnings.simplefilter("ignore", rp.PlannerWarning)
        torch.compile(model, backend=stage.backend)(*inputs()).backward()
    torch._dynamo.reset()
    (got,) = stage.plans

    def kept(plan):  # the compiled graph names its inputs `primals_<i>`: compare by op
        return sorted((n.layer, n.unit, n.op) for n in plan.nodes if n.decision == "save")

    assert kept(got) == kept(want) and {layer for layer, _, _ in kept(got)} == {0, 1}
    assert got.memory.saved_bytes == want.memory.saved_bytes
    assert [len(r.nodes) for r in got.replay] == [len(r.nodes) for r in want.replay]
