"""export_joint / export_forward: roles, outputs, phases, reference tensors, files.

The IR (docs/ir.md) and export with weights, inputs and PyTorch's reference.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import python_fx_builder
from export_support import (
    MAIN,
    ONE_LAYER,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    UNITS,
    Lambda,
    buffer_fill_step,
    consumers,
    nodes_with_op,
    one_hot_step,
    only_node,
    run_planner,
    tiny_decoder,
    values_by_name,
)
from graph_walk import forward_then_backward, loss_ancestors
from recompute_planner import __version__, _exporter
from recompute_planner._exporter import (
    ABSENT_TENSOR_ARGS,
    export_forward,
    export_joint,
    trim_stack_trace,
    write_graph,
    write_reference,
)
from recompute_planner.proto import graph_pb2


@pytest.fixture(scope="module")
def decoder():
    model, args, models = tiny_decoder()
    result = export_joint(model, args, name="tiny", models=models, world_size=4, rank=1)
    return model, args, models, result


def test_values_carry_roles_and_names(decoder):
    model, _, _, result = decoder
    values = values_by_name(result.graph)
    for name, param in model.named_parameters():
        assert values[name].role == graph_pb2.ROLE_PARAMETER
        assert list(values[name].shape) == list(param.shape)
        assert values[name].dtype == graph_pb2.DTYPE_FLOAT32
    assert values["input.0"].role == values["input.1"].role == graph_pb2.ROLE_INPUT
    assert values["input.0"].dtype == graph_pb2.DTYPE_INT64
    assert values["tangents_1"].role == graph_pb2.ROLE_TANGENT
    produced = {o: n.phase for n in result.graph.nodes for o in n.outputs}
    for name, phase in produced.items():
        expected = graph_pb2.ROLE_ACTIVATION if phase == PHASE_FORWARD else graph_pb2.ROLE_GRADIENT
        if name != result.graph.outputs[0]:
            assert values[name].role == expected, name
    loss = values[result.graph.outputs[0]]
    assert loss.role == graph_pb2.ROLE_LOSS and list(loss.shape) == []


def test_buffers_are_buffer_values_named_by_fqn():
    torch.manual_seed(0)
    module = Lambda(lambda self, x: self.norm(self.lin(x)).sum())
    module.norm = nn.BatchNorm1d(4)
    result = export_joint(module, (torch.randn(3, 4),), name="bn", models=MAIN)
    values = values_by_name(result.graph)
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        assert values[name].role == graph_pb2.ROLE_BUFFER
        assert torch.equal(result.params[name], module.get_buffer(name))
    # The running statistics are updated in place during forward.
    legit = only_node(result.graph, "aten._native_batch_norm_legit.default")
    mutated = [legit.inputs[i] for i in legit.schema.mutates]
    assert mutated == ["norm.running_mean", "norm.running_var"]


def test_outputs_are_the_loss_then_gradients_matching_eager(decoder):
    model, args, _, result = decoder
    graph = result.graph
    assert list(graph.outputs[1:]) == list(result.grads)
    values = values_by_name(graph)
    assert all(values[g].role == graph_pb2.ROLE_GRADIENT for g in result.grads)
    eager_loss = model(*args)
    params = [p for _, p in model.named_parameters()]
    eager = torch.autograd.grad(eager_loss, params)
    assert torch.equal(result.loss, eager_loss.detach())
    # One gradient per parameter, in parameter order, equal to eager autograd's.
    assert len(result.grads) == len(params)
    for (value, grad), param, expected in zip(result.grads.items(), params, eager, strict=True):
        assert list(values[value].shape) == list(param.shape)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert list(result.tangents) == ["tangents_1"] and result.tangents["tangents_1"].item() == 1.0


def test_metadata_and_models(decoder):
    _, _, _, result = decoder
    meta = result.graph.metadata
    assert (meta.exporter_version, meta.world_size, meta.rank) == (__version__, 4, 1)
    assert meta.torch_version == torch.__version__.split("+")[0]
    (model,) = result.graph.models
    assert (model.name, model.num_layers, model.parent) == ("main", 2, "")
    assert [(u.unit, [(i.begin, i.end) for i in u.intervals]) for u in model.units] == [
        (unit, intervals) for unit, intervals in UNITS.items()
    ]


def test_phase_is_the_pass_that_ran_the_op(decoder):
    """Forward nodes come first and hold every ancestor of the loss and the `detach` autograd
    records when it saves an op's output (read by backward only); backward holds ops that read
    no tangent, even transitively, too (`t` of the forward's transposed weights, `pow` of a
    saved input for the RMSNorm gradient). Neither loss ancestry nor tangent dependence alone
    gives these phases."""
    graph = decoder[3].graph
    assert forward_then_backward(graph)
    feeds_loss = loss_ancestors(graph)
    phase = {n.name: n.phase for n in graph.nodes}
    assert all(phase[name] == PHASE_FORWARD for name in feeds_loss)
    saving = [n for n in graph.nodes if n.phase == PHASE_FORWARD and n.name not in feeds_loss]
    assert saving and {n.op for n in saving} == {"aten.detach.default"}
    readers = [c for n in saving for c in consumers(graph, n.outputs[0])]
    assert readers and all(c.phase == PHASE_BACKWARD for c in readers)
    from_tangent = {"tangents_1"}
    no_tangent = set()
    for node in graph.nodes:
        if from_tangent & set(node.inputs):
            from_tangent.update(node.outputs)
        elif node.phase == PHASE_BACKWARD:
            no_tangent.add(node.op)
    assert {"aten.t.default", "aten.pow.Tensor_Scalar", "aten.detach.default"} <= no_tangent


def export_pattern(step) -> graph_pb2.Graph:
    torch.manual_seed(0)
    return export_joint(Lambda(step), (torch.randn(4, 4),), name="p", models=ONE_LAYER).graph


def test_ops_filling_a_fresh_buffer_in_place_are_forward(tmp_path):
    """`new_empty` + slice `copy_`: the copies and what they copy reach the loss only through
    the writes, yet run in forward. Labelled backward, they made the planner's partition
    unclosed (an internal error) even with no layer checkpointed."""
    graph = export_pattern(buffer_fill_step)
    assert forward_then_backward(graph)
    (buffer,) = nodes_with_op(graph, "aten.new_empty.default")
    slices = consumers(graph, buffer.outputs[0])
    views = {n.outputs[0] for n in slices if n.schema.HasField("view_of")}
    fills = [n for n in nodes_with_op(graph, "aten.copy_.default") if n.inputs[0] in views]
    assert len(fills) == 2
    producer = {o: n for n in graph.nodes for o in n.outputs}
    assert all(n.phase == PHASE_FORWARD for n in [buffer, *fills])
    assert producer[fills[1].inputs[1]].op == "aten.tanh.default"
    assert producer[fills[1].inputs[1]].phase == PHASE_FORWARD
    write_graph(graph, tmp_path / "fill.pb")
    for flags in (["--keep", "none"], ["--recompute-ratio", "0"]):
        done = run_planner("plan", str(tmp_path / "fill.pb"), *flags)
        assert done.returncode == 0, (flags, done.stderr)


def test_one_hot_range_checks_are_forward_and_replay_waits_for_backward(tmp_path):
    """`F.one_hot`'s checks have no path to the loss but run in forward. Labelled backward at
    forward positions, they were the first backward nodes reading the layer's values, so the
    replay ran before them, at the very start of backward."""
    graph = export_pattern(one_hot_step)
    assert forward_then_backward(graph)
    check_ops = ("aten.ge.Scalar", "aten.lt.Scalar", "aten.all.default", "aten._assert_async.msg")
    checks = [n for n in graph.nodes if n.op in check_ops]
    assert len(checks) == 6 and all(n.phase == PHASE_FORWARD for n in checks)
    write_graph(graph, tmp_path / "one_hot.pb")
    done = run_planner("plan", str(tmp_path / "one_hot.pb"), "--format", "json")
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)["replay"]
    assert steps
    nodes = {n.name: n for n in graph.nodes}
    for step in steps:  # each step of the replay runs just before a backward node reading it
        replayed = {o for name in step["nodes"] for o in nodes[name].outputs}
        before = nodes[step["before"]]
        assert before.phase == PHASE_BACKWARD and replayed & set(before.inputs), before.name


def tamper_first(op: str, tag: str | None):
    """Sets (None: removes) the pass tag of the first node calling `op`."""

    def tamper(graph_module):
        node = next(n for n in graph_module.graph.nodes if str(n.target) == op)
        if tag is None:
            del node.meta["partitioner_tag"]
        else:
            node.meta["partitioner_tag"] = tag

    return tamper


@pytest.mark.parametrize(
    "tamper, message",
    [
        (tamper_first("aten.addmm.default", None), "`addmm` .* has no pass tag"),
        (tamper_first("aten.sum.default", "is_backward"), "node `sum_1` .* forward output"),
        (tamper_first("aten.expand.default", "is_forward"), "forward node `expand` .* tangent"),
        (
            tamper_first("aten.mm.default", "is_forward"),
            "`mm` .* forward pass after backward node `expand`",
        ),
    ],
)
def test_pass_tags_contradicting_eager_execution_are_refused(tamper, message):
    """The exporter checks AOTAutograd's pass tags against what eager execution implies."""
    torch.manual_seed(0)
    module = Lambda(lambda self, x: torch.relu(self.lin(x)).sum())
    graph_module, num_forward_outputs = _exporter.capture(module, (torch.randn(2, 4),), joint=True)
    forward = _exporter.forward_nodes(graph_module, num_forward_outputs)
    assert sorted(n.name for n in forward) == ["addmm", "detach", "relu", "sum_1", "t"]
    tamper(graph_module)
    with pytest.raises(RuntimeError, match=message):
        _exporter.forward_nodes(graph_module, num_forward_outputs)


def test_no_dead_nodes(decoder):
    graph = decoder[3].graph
    read = {v for n in graph.nodes for v in n.inputs} | set(graph.outputs)
    for node in graph.nodes:
        assert any(o in read for o in node.outputs) or node.schema.mutates, node.name


def test_dead_computation_is_dropped():
    def step(self, x):
        _unused = torch.exp(self.lin(x))
        return self.lin(x).sum()

    graph = export_joint(Lambda(step), (torch.randn(2, 4),), name="dce", models=MAIN).graph
    assert not [n for n in graph.nodes if n.op == "aten.exp.default"]


def test_module_state_and_grads_are_untouched_by_export():
    torch.manual_seed(0)
    module = Lambda(lambda self, x: self.norm(self.lin(x)).sum())
    module.norm = nn.BatchNorm1d(4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    export_joint(module, (torch.randn(3, 4),), name="pure", models=MAIN)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in module.parameters())


def test_absent_tensor_arguments_and_constants():
    def step(self, x):
        h = self.norm(self.lin(x))
        return h[:, torch.tensor([0, 2])].sum()  # index.Tensor with indices [None, constant]

    module = Lambda(step)
    module.norm = nn.LayerNorm(4, bias=False)
    result = export_joint(module, (torch.randn(3, 4),), name="absent", models=MAIN)
    graph = result.graph

    def absent(node):
        return [list(a.strs.values) for a in node.attributes if a.name == ABSENT_TENSOR_ARGS]

    layer_norm = only_node(graph, "aten.native_layer_norm.default")
    assert len(layer_norm.inputs) == 2 and absent(layer_norm) == [["bias"]]
    index = only_node(graph, "aten.index.Tensor")
    assert len(index.inputs) == 2 and absent(index) == [["indices.0"]]
    assert absent(only_node(graph, "aten.addmm.default")) == []
    constant = values_by_name(graph)["_tensor_constant0"]
    assert constant.role == graph_pb2.ROLE_BUFFER
    assert torch.equal(result.params["_tensor_constant0"], torch.tensor([0, 2]))


def test_export_forward_has_only_forward_nodes_matching_the_joint_forward(decoder):
    model, args, models, joint = decoder
    result = export_forward(model, args, name="tiny-fwd", models=models)
    graph = result.graph
    assert graph.nodes and all(n.phase == PHASE_FORWARD for n in graph.nodes)
    roles = {v.role for v in graph.values}
    assert graph_pb2.ROLE_TANGENT not in roles and graph_pb2.ROLE_GRADIENT not in roles
    assert list(graph.outputs) == [joint.graph.outputs[0]]
    assert values_by_name(graph)[graph.outputs[0]].role == graph_pb2.ROLE_LOSS
    assert (result.tangents, result.grads, result.loss) == ({}, {}, None)
    assert set(result.params) == set(joint.params) and set(result.inputs) == set(joint.inputs)
    # Same ops, annotations (scopes reach the nodes without autograd too) and attributes.
    def summary(node):
        layer = node.layer if node.HasField("layer") else None
        scope = (node.model, layer, node.micro_batch, node.compiled_region, node.module_path)
        return node.op, scope, [a.SerializeToString() for a in node.attributes]

    # The joint forward also holds the `detach` autograd records when it saves an op's output.
    joint_forward = [
        summary(n)
        for n in joint.graph.nodes
        if n.phase == PHASE_FORWARD and n.op != "aten.detach.default"
    ]
    assert [summary(n) for n in graph.nodes] == joint_forward
    assert {n.layer for n in graph.nodes if n.HasField("layer")} == {0, 1}


def test_planner_loads_the_exported_graph(decoder, tmp_path):
    graph = decoder[3].graph
    write_graph(graph, tmp_path / "tiny.pb")
    inspect = run_planner("inspect", "--format", "json", str(tmp_path / "tiny.pb"))
    assert inspect.returncode == 0, inspect.stderr
    summary = json.loads(inspect.stdout)
    forward = sum(n.phase == PHASE_FORWARD for n in graph.nodes)
    assert (summary["nodes"], summary["forward_nodes"]) == (len(graph.nodes), forward)
    # The JSON form is the same message: the Rust converter turns it into identical bytes.
    write_graph(graph, tmp_path / "tiny.json")
    convert = run_planner("convert", str(tmp_path / "tiny.json"), str(tmp_path / "converted.pb"))
    assert convert.returncode == 0, convert.stderr
    assert (tmp_path / "converted.pb").read_bytes() == (tmp_path / "tiny.pb").read_bytes()


def test_export_is_deterministic(tmp_path):
    """Same step, same bytes: graph files and reference tensors, random ops included (the
    eager reference runs under a fixed seed in a forked RNG state)."""
    torch.manual_seed(0)
    dropout = Lambda(lambda self, x: nn.functional.dropout(self.lin(x), 0.5).sum())
    dropout_args = (torch.randn(8, 4),)
    files = []
    for attempt in range(2):
        out = tmp_path / str(attempt)
        out.mkdir()
        model, args, models = tiny_decoder()
        torch.manual_seed(attempt + 1)  # the caller's RNG state must not matter
        steps = {"tiny": (model, args), "drop": (dropout, dropout_args)}
        for stem, (module, inputs) in steps.items():
            result = export_joint(module, inputs, name=stem, models=models)
            write_graph(result.graph, out / f"{stem}.pb")
            write_graph(result.graph, out / f"{stem}.json")
            write_reference(result, out / f"{stem}.safetensors")
        files.append({p.name: p.read_bytes() for p in out.iterdir()})
    kinds = ("pb", "json", "safetensors")
    assert sorted(files[0]) == sorted(f"{s}.{e}" for s in ("tiny", "drop") for e in kinds)
    assert files[0] == files[1]


def test_reference_dropout_masks_are_drawn_the_same_on_every_cpu():
    """The reference step draws a dropout mask as PyTorch's own CPU kernel does, one double
    per element from the seeded generator, kept where below 1 - p, even where MKL would draw
    it (Intel CPUs): no `bernoulli_` reaches a kernel."""
    torch.manual_seed(0)
    p, x = 0.5, torch.randn(8, 4)
    module = Lambda(lambda self, x: nn.functional.dropout(self.lin(x), p).sum())
    result = export_joint(module, (x,), name="drop", models=MAIN, seed=3)
    keep = torch.rand(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    noise = (keep < 1 - p).to(torch.float32).div_(1 - p)
    assert torch.equal(result.loss, (module.lin(x) * noise).sum().detach())

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record() as kernels, _exporter._PortableBernoulli():
        torch.empty(16).bernoulli_(0.3)
    assert kernels.ops and "aten.bernoulli_.float" not in kernels.ops


def test_reference_file_layout(decoder, tmp_path):
    result = decoder[3]
    write_reference(result, tmp_path / "ref.safetensors")
    tensors = load_file(str(tmp_path / "ref.safetensors"))
    expected = {f"param/{k}" for k in result.params} | {f"input/{k}" for k in result.inputs}
    expected |= {f"ref/grad/{k}" for k in result.grads} | {"tangent/tangents_1", "ref/loss"}
    expected |= {"rng/seed"}
    assert set(tensors) == expected
    assert torch.equal(tensors["ref/loss"], result.loss)
    assert tensors["rng/seed"].item() == result.seed == 0
    assert torch.equal(tensors["input/input.0"], result.inputs["input.0"])


def test_write_graph_rejects_unknown_extensions(decoder, tmp_path):
    with pytest.raises(ValueError, match=r"\.pb or \.json"):
        write_graph(decoder[3].graph, tmp_path / "graph.txt")


def test_errors_name_the_culprit():
    with pytest.raises(ValueError, match="scalar loss"):
        not_scalar = Lambda(lambda self, x: self.lin(x))
        export_joint(not_scalar, (torch.randn(2, 4),), name="e", models=MAIN)
    with pytest.raises(ValueError, match="nothing in the step requires grad"):
        frozen = Lambda(lambda self, x: self.lin(x).sum()).requires_grad_(False)
        export_joint(frozen, (torch.randn(2, 4),), name="e", models=MAIN)
    with pytest.raises(ValueError, match=r"node `_to_copy` .*complex128"):
        to_complex = Lambda(lambda self, x: self.lin(x).to(torch.complex128).abs().sum())
        export_forward(to_complex, (torch.randn(2, 4),), name="e", models=MAIN)
    with pytest.raises(ValueError, match="declare at least one model"):
        no_models = Lambda(lambda self, x: self.lin(x).sum())
        export_joint(no_models, (torch.randn(2, 4),), name="e", models=[])


def test_a_tied_weight_is_one_parameter_whose_gradient_sums_its_uses():
    # Tied input/output embeddings: one tensor registered under two names.
    tied = Lambda(lambda self, x: self.other(torch.tanh(self.lin(x))).square().sum())
    tied.other = nn.Linear(4, 4)
    tied.other.weight = tied.lin.weight
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    result = export_joint(tied, (x,), name="e", models=MAIN)
    params = [v.name for v in result.graph.values if v.role == graph_pb2.ROLE_PARAMETER]
    assert params == ["lin.weight", "lin.bias", "other.bias"]
    assert set(result.params) == set(params)
    tied.zero_grad()
    loss = tied(x)
    loss.backward()
    torch.testing.assert_close(result.loss, loss.detach())
    gradients = {tuple(g.shape): g for g in result.grads.values()}
    assert len(result.grads) == 3
    # Both uses of the weight flow into its one gradient, as eager autograd sums them.
    torch.testing.assert_close(gradients[(4, 4)], tied.lin.weight.grad)


def test_stack_traces_keep_the_innermost_three_frames():
    trace = "\n".join(
        f'  File "m.py", line {i}, in f{i}\n    call_{i}()' for i in range(5)
    )
    assert trim_stack_trace(trace) == [
        'File "m.py", line 2, in f2', "call_2()",
        'File "m.py", line 3, in f3', "call_3()",
        'File "m.py", line 4, in f4', "call_4()",
    ]
    assert trim_stack_trace("") == []


def mapped_nodes(calls):
    """The IR node fields of ``calls`` ((target, args, kwargs, written_as) each) on two float
    inputs ``x`` (4 x 6) and ``src`` (2 x 6), mapped in order by the exporter's node mapping
    (the Python builder's, which the native one is held to)."""
    graph = torch.fx.Graph()
    inputs = {name: graph.placeholder(name) for name in ("x", "src")}
    inputs["x"].meta["val"], inputs["src"].meta["val"] = torch.zeros(4, 6), torch.zeros(2, 6)
    names = python_fx_builder.ValueNames({node: node.name for node in inputs.values()})
    model = _exporter.ModelDecl("m", num_layers=1, units={})
    mapped = []

    def input_node(arg):
        return inputs[arg] if isinstance(arg, str) else arg

    for target, args, kwargs, written_as in calls:
        node = graph.call_function(target, tuple(map(input_node, args)), kwargs)
        node.meta["val"] = target(*(torch.fx.map_arg(a, lambda n: n.meta["val"])
                                    for a in map(input_node, args)), **kwargs)
        if written_as is not None:
            node.meta[_exporter.WRITTEN_AS_KEY] = written_as
        names.add_op(node)
        mapped.append(
            python_fx_builder.node_fields(node, names, True, {"m": model}, default_model="m")
        )
    return mapped


@pytest.mark.parametrize("write_back_first", [True, False])
def test_a_write_back_is_a_view_of_its_base_whichever_call_of_its_op_comes_first(
    write_back_first, monkeypatch
):
    """Calls of one op map with their own schema facts: a scatter that writes a view back
    into its base is a view of the base, a plain call of the same op is not, in either
    order (argument bindings are cached across calls, from an empty cache here, and the
    facts they read differ)."""
    monkeypatch.setattr(_exporter, "_BINDINGS", {})
    scatter = torch.ops.aten.slice_scatter.default
    write_back = (scatter, ("x", "src", 0, 0, 2), {}, _exporter.WRITE_BACK_VIEW)
    plain = (scatter, ("x", "src", 0, 0, 2), {}, None)
    calls = [write_back, plain] if write_back_first else [plain, write_back]
    by_kind = dict(zip(["write back", "plain"] if write_back_first else ["plain", "write back"],
                       mapped_nodes(calls), strict=True))
    assert by_kind["write back"]["schema"].get("view_of") == 0
    assert "view_of" not in by_kind["plain"]["schema"]


def test_calls_of_an_op_with_other_argument_layouts_bind_their_own_arguments():
    """Positional, keyword and defaulted arguments of one op map by schema name whatever
    mix of them a call passes."""
    total = torch.ops.aten.sum.dim_IntList
    mapped = mapped_nodes([
        (total, ("x", [0]), {}, None),
        (total, ("x", [0], True), {}, None),
        (total, ("x", [1]), {"keepdim": True, "dtype": torch.float64}, None),
    ])
    assert [node["inputs"] for node in mapped] == [["x"]] * 3
    assert [node["attributes"] for node in mapped] == [
        [{"name": "dim", "ints": {"values": [0]}}],
        [{"name": "dim", "ints": {"values": [0]}}, {"name": "keepdim", "bool": True}],
        [
            {"name": "dim", "ints": {"values": [1]}},
            {"name": "keepdim", "bool": True},
            {"name": "dtype", "str": "torch.float64"},
        ],
    ]


def test_exporting_on_a_torch_older_than_the_tracers_need_is_an_export_error(monkeypatch):
    """Torch before `TRACING_TORCH` fails deep inside AOTAutograd (or traces without the
    layer scopes); the exporter says so first, naming both versions."""
    from torch.torch_version import TorchVersion

    from recompute_planner import ExportError

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1+cpu"))
    model, args, models = tiny_decoder()
    message = r"exporting a graph needs torch >= 2\.13; this is torch 2\.9\.1"
    with pytest.raises(ExportError, match=message):
        export_joint(model, args, name="tiny", models=models)
