"""The marker op and the scope annotations survive export (docs/ir.md, "Marking a model")."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from export_support import MAIN, PHASE_BACKWARD, PHASE_FORWARD, Lambda, consumers, only_node
from recompute_planner._exporter import ModelDecl, export_joint
from recompute_planner.markers import (
    MARKER_NAME_ATTR,
    MARKER_OP,
    checkpoint_record,
    compiled_region,
    layer_scope,
)


def _marked(self, x):
    return torch.relu(checkpoint_record("probe.begin", self.lin(x))).sum()


def _unmarked(self, x):
    return torch.relu(self.lin(x)).sum()


def test_marker_is_a_forward_node_on_the_data_path_with_its_name():
    torch.manual_seed(0)
    graph = export_joint(Lambda(_marked), (torch.randn(3, 4),), name="m", models=MAIN).graph
    marker = only_node(graph, MARKER_OP)
    # The planner's own constants name the op and the attribute it reads the marker name from.
    assert [(a.name, a.str) for a in marker.attributes] == [(MARKER_NAME_ATTR, "probe.begin")]
    assert marker.phase == PHASE_FORWARD
    producer = next(n for n in graph.nodes if marker.inputs[0] in n.outputs)
    assert producer.op == "aten.addmm.default"
    assert [n.op for n in consumers(graph, marker.outputs[0]) if n.phase == PHASE_FORWARD] == [
        "aten.relu.default"
    ]


def test_gradient_passes_straight_through_the_marker():
    torch.manual_seed(0)
    marked = Lambda(_marked)
    unmarked = Lambda(_unmarked)
    unmarked.load_state_dict(marked.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    (grad_marked,) = torch.autograd.grad(marked(x), x)
    (grad_unmarked,) = torch.autograd.grad(unmarked(x), x)
    assert torch.equal(grad_marked, grad_unmarked)
    # The marker adds no backward op: both joint graphs run the same backward.
    backward = [
        [n.op for n in export_joint(m, (x.detach(),), name="g", models=MAIN).graph.nodes
         if n.phase == PHASE_BACKWARD]
        for m in (marked, unmarked)
    ]
    assert backward[0] == backward[1]


def test_marker_compiles_without_graph_break_and_leaves_no_node():
    graphs = []

    def record(graph_module, _inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    fn = torch.compile(
        lambda x: torch.relu(checkpoint_record("c.begin", x * 2)) + 1,
        backend=aot_autograd(fw_compiler=record, bw_compiler=record),
        fullgraph=True,  # a graph break would raise
    )
    x = torch.randn(5, requires_grad=True)
    out = fn(x)
    out.sum().backward()
    assert torch.equal(out, torch.relu(x * 2) + 1)
    assert len(graphs) == 2  # one forward and one backward graph, nothing else
    targets = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert not [t for t in targets if "checkpoint_record" in t], targets


def test_eager_marker_returns_its_tensor_and_only_a_trace_records_the_op():
    x = torch.randn(3, requires_grad=True)
    # Eagerly, on real or fake tensors, the marker is no op: no copy for a caller to hold.
    assert checkpoint_record("e.end", x) is x
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert checkpoint_record("e.end", fake) is fake
    traced = make_fx(lambda t: checkpoint_record("e.end", t) * 2)(torch.randn(3))
    assert [str(n.target) for n in traced.graph.nodes if n.op == "call_function"] == [
        MARKER_OP,
        "aten.mul.Tensor",
    ]


def test_marker_needs_a_name():
    with pytest.raises(ValueError, match="non-empty name"):
        checkpoint_record("", torch.ones(1))


def test_scopes_tag_layer_model_micro_batch_region_and_module_path_in_both_phases():
    def step(self, x):
        with layer_scope("main", 1, micro_batch=1):
            h = self.lin(x)
            with compiled_region("fused"):
                h = checkpoint_record("in.region", h) * 2
            # A nested model outside layers: the enclosing layer must not leak into it.
            with layer_scope("mtp", None):
                h = h + 1
        return h.sum()

    models = [ModelDecl("main", 2, {}), ModelDecl("mtp", 1, {}, parent="main")]
    graph = export_joint(Lambda(step), (torch.randn(3, 4),), name="s", models=models).graph
    addmm = only_node(graph, "aten.addmm.default")
    assert (addmm.model, addmm.layer, addmm.micro_batch, addmm.module_path) == ("main", 1, 1, "lin")
    assert addmm.compiled_region == ""
    marker = only_node(graph, MARKER_OP)
    assert marker.compiled_region == "fused"  # kept as a node; the planner ignores it (R6)
    mul = next(n for n in graph.nodes if n.op == "aten.mul.Tensor" and n.phase == PHASE_FORWARD)
    assert mul.compiled_region == "fused"
    add = next(n for n in graph.nodes if n.op == "aten.add.Tensor")
    assert add.model == "mtp" and not add.HasField("layer")
    weight_grad = next(n for n in graph.nodes if n.op == "aten.mm.default")
    assert weight_grad.phase == PHASE_BACKWARD
    assert (weight_grad.model, weight_grad.layer, weight_grad.module_path) == ("main", 1, "lin")
    summed = only_node(graph, "aten.sum.default")
    assert (summed.model, summed.HasField("layer"), summed.module_path) == ("main", False, "")


def test_undeclared_model_and_layer_out_of_range_are_errors_naming_the_node():
    def step(self, x):
        with layer_scope("main", 3):
            return self.lin(x).sum()

    with pytest.raises(ValueError, match=r"node `t` .* layer 3 of model `main`"):
        export_joint(Lambda(step), (torch.randn(2, 4),), name="e", models=MAIN)
    with pytest.raises(ValueError, match=r"undeclared model `main`"):
        export_joint(Lambda(step), (torch.randn(2, 4),), name="e", models=[ModelDecl("x", 4, {})])
