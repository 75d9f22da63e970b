"""Graphs of GPU runs exported on this CPU-only machine with fake CUDA tensors
(`recompute_planner.device_export`): the replayed autograd engine traces torch's joint graphs
byte for byte, a device graph takes the tensors of the same step run on the CPU, the golden
`moe_ep2_cuda` carries the devices and the routing counts' device-to-host copy, and the
planner keeps that copy with `collectives="save"`."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import recompute_planner as rp
from graph_walk import GOLDEN_DIR, load_graph
from recompute_planner._exporter import ModelDecl, export_joint
from recompute_planner._zoo.catalog import entry, make_inputs, model_decls
from recompute_planner._zoo.goldens import GOLDENS, device_graph, traced_group
from recompute_planner.device_export import (
    _replayed_autograd,
    export_forward_on_device,
    export_joint_on_device,
    with_device_graph,
)
from recompute_planner.markers import checkpoint_record
from recompute_planner.proto import graph_pb2

CUDA_GOLDEN = "moe_ep2_cuda"
TO_COPY = "aten._to_copy.default"
WAIT = "_c10d_functional.wait_tensor.default"
CPU_JOINT = [g for g in GOLDENS if g.joint and g.device is None]


def device_of(node) -> str | None:
    found = [a.str for a in node.attributes if a.name == "device"]
    return found[0] if found else None


def copies_to(graph, device: str) -> list:
    """`_to_copy` nodes whose `device` argument is `device`."""
    return [n for n in graph.nodes if n.op == TO_COPY and device_of(n) == device]


# --------------------------------------------------------------------------------------------
# The replayed engine


@pytest.mark.parametrize("gold", CPU_JOINT, ids=lambda g: g.name)
def test_the_replayed_engine_traces_every_cpu_golden_byte_for_byte(gold):
    """Traced on the CPU through the device export (backward on the replayed engine), every
    joint golden equals its committed graph, traced with torch's engine: the same backward
    ops, in the same order, with the same names, annotations and stack traces. The golden also
    lists what its eager probe saw Python hold (`python_releases`), which a fake-tensor export
    runs no eager step to observe: left out of the comparison."""
    with traced_group(gold.world_size):
        graph = device_graph(gold, "cpu")
    golden = graph_pb2.Graph.FromString((GOLDEN_DIR / f"{gold.name}.pb").read_bytes())
    for node in golden.nodes:
        del node.python_releases[:]
    assert graph.SerializeToString(deterministic=True) == golden.SerializeToString(
        deterministic=True
    )


def test_the_replay_computes_torchs_gradients_bit_for_bit():
    """On real tensors: a tensor read twice (its gradients summed), a dtype round trip and a
    custom autograd Function (the marker)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=gen, requires_grad=True)
    w = torch.randn(3, 5, generator=gen, requires_grad=True)

    def gradients() -> tuple[torch.Tensor, ...]:
        h = x @ w
        y = checkpoint_record("marker", torch.tanh(h) * h)
        loss = (y.double().sum() + (x**2).mean()).float()
        return torch.autograd.grad(loss, [x, w])

    expected = gradients()
    with _replayed_autograd():
        replayed = gradients()
    assert all(torch.equal(a, b) for a, b in zip(replayed, expected, strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU gives fake CUDA tensors a context")
def test_torchs_engine_cannot_run_a_fake_cuda_backward_here_and_the_replay_can():
    """Why the replay exists: torch's engine asks the CUDA runtime for a context the fake
    tensors' device lacks."""
    with FakeTensorMode():
        x = torch.empty(2, 3, device="cuda", requires_grad=True)
        with pytest.raises(RuntimeError, match="hasPrimaryContext"):
            torch.autograd.grad((x * 2).sum(), [x])
        with _replayed_autograd():
            (grad,) = torch.autograd.grad((x * 2).sum(), [x])
    assert grad.device == torch.device("cuda:0") and grad.shape == x.shape


class HookedStep(nn.Module):
    """A step that registers a gradient hook on an activation."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        y.register_hook(lambda grad: grad * 2)
        return y.sum()


def test_a_hook_registered_in_the_step_is_refused():
    """The replay cannot run hooks, so a step registering one is refused, not traced wrong."""
    with pytest.raises(NotImplementedError, match="hook is registered on a tensor"):
        export_joint_on_device(
            HookedStep(), (torch.randn(2, 3),), name="hooked",
            models=[ModelDecl("main", 0, {})], device="cuda",
        )


# --------------------------------------------------------------------------------------------
# Tensors for a device graph


class TwoLayers(nn.Module):
    """A step whose parameters all have different shapes."""

    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(3, width)
        self.b = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).sum()


def joint_exports(width: int):
    """The CPU export (with its reference step) and the fake CUDA trace of one step."""
    torch.manual_seed(0)
    module, args = TwoLayers(width), (torch.randn(2, 3),)
    decls = [ModelDecl("main", 0, {})]
    cpu = export_joint(module, args, name="two", models=decls)
    return cpu, export_joint_on_device(module, args, name="two", models=decls, device="cuda")


def with_own_names(graph):
    """`graph` with every value produced by an op renamed, as a trace taking other ops on the
    way (a device's decompositions) names them: the gradients have other names than the CPU
    export gives them."""
    renamed = graph_pb2.Graph()
    renamed.CopyFrom(graph)
    produced = {value for node in graph.nodes for value in node.outputs}
    name = {v: f"dev_{v}" if v in produced else v for v in (v.name for v in graph.values)}
    for value in renamed.values:
        value.name = name[value.name]
    for node in renamed.nodes:
        node.inputs[:] = [name[v] for v in node.inputs]
        node.outputs[:] = [name[v] for v in node.outputs]
    renamed.outputs[:] = [name[v] for v in graph.outputs]
    return renamed


def test_a_device_graph_takes_the_cpu_steps_tensors_each_gradient_under_its_own_name():
    cpu, traced = joint_exports(4)
    graph = with_own_names(traced)
    result = with_device_graph(cpu, graph)
    assert result.graph is graph
    for field in ("params", "inputs", "tangents", "loss", "seed"):
        assert getattr(result, field) is getattr(cpu, field), field
    gradients = [v.name for v in graph.values if v.name in set(graph.outputs[1:])]
    assert sorted(result.grads) == sorted(gradients)
    # Every parameter has its own shape, so each gradient pairs with the right one.
    shapes = {v.name: list(v.shape) for v in graph.values}
    for name, tensor in result.grads.items():
        assert list(tensor.shape) == shapes[name], name
    assert sorted(map(id, result.grads.values())) == sorted(map(id, cpu.grads.values()))


def test_a_device_graph_of_another_step_is_refused():
    cpu, _ = joint_exports(4)
    _, other = joint_exports(5)
    with pytest.raises(ValueError, match="graph inputs differ"):
        with_device_graph(cpu, other)


# --------------------------------------------------------------------------------------------
# The golden of a GPU run


@pytest.fixture(scope="module")
def cuda_golden():
    return load_graph(GOLDEN_DIR / f"{CUDA_GOLDEN}.pb")


def value_devices(graph, inputs_on: str) -> dict[str, str]:
    """The device of every value: graph inputs (weights, data, tangents) on `inputs_on`; an
    op's outputs on its `device` argument, else where its inputs are (no op mixes devices)."""
    produced = {value for node in graph.nodes for value in node.outputs}
    devices = {v.name: inputs_on for v in graph.values if v.name not in produced}
    for node in graph.nodes:
        read = {devices[value] for value in node.inputs}
        assert device_of(node) is not None or len(read) == 1, (node.name, read)
        device = device_of(node) or read.pop()
        devices.update((value, device) for value in node.outputs)
    return devices


# What the host computes per MoE layer: the routing counts copied to it, the padding mask made
# from them (`_mask_padding`: clamp, view, arange, lt), and the mask copied back.
HOST_OPS = {
    TO_COPY,
    "aten.clamp.default",
    "aten.view.default",
    "aten.arange.default",
    "aten.lt.Tensor",
}


def test_the_cuda_golden_is_the_joint_graph_of_a_gpu_run(cuda_golden):
    """Forward and backward run on `cuda:0`; per MoE layer, in forward, the routing counts that
    all-to-all received are copied from `cuda:0` to the host, the padding mask is computed
    there and copied back. The CPU golden of the model runs everything on the CPU (its copy
    to the host is a CPU-to-CPU copy, made explicit) and copies nothing back."""
    phases = {n.phase for n in cuda_golden.nodes}
    assert phases == {graph_pb2.PHASE_FORWARD, graph_pb2.PHASE_BACKWARD}
    devices = value_devices(cuda_golden, "cuda:0")
    producers = {v: n for n in cuda_golden.nodes for v in n.outputs}
    to_host = copies_to(cuda_golden, "cpu")
    assert sorted(n.layer for n in to_host) == [0, 1]
    for copy in to_host:
        assert copy.phase == graph_pb2.PHASE_FORWARD
        assert producers[copy.inputs[0]].op == WAIT
        assert (devices[copy.inputs[0]], devices[copy.outputs[0]]) == ("cuda:0", "cpu")
    back = copies_to(cuda_golden, "cuda:0")
    assert sorted(n.layer for n in back) == [0, 1]
    assert {devices[n.inputs[0]] for n in back} == {"cpu"}
    on_host = [n for n in cuda_golden.nodes if devices[n.outputs[0]] == "cpu"]
    assert {n.op for n in on_host} == HOST_OPS
    assert {n.phase for n in on_host} == {graph_pb2.PHASE_FORWARD}
    cpu_golden = load_graph(GOLDEN_DIR / "moe_ep2.pb")
    assert set(value_devices(cpu_golden, "cpu").values()) == {"cpu"}
    assert len(copies_to(cpu_golden, "cpu")) == 2 and copies_to(cpu_golden, "cuda:0") == []


def test_collectives_save_keeps_the_host_copy_and_the_default_replays_it(cuda_golden):
    """With `collectives="save"` each routing-count copy to the host is saved (its output is
    in the saved set) and never replayed; by default it is recomputed and replays."""
    path = GOLDEN_DIR / f"{CUDA_GOLDEN}.pb"
    host_copies = {n.name: n.outputs[0] for n in copies_to(cuda_golden, "cpu")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        saving = rp.plan(path, collectives="save")
        default = rp.plan(path)
    assert {(saving.decision(n).decision, saving.decision(n).reason) for n in host_copies} == {
        ("save", "saved-collective")
    }
    assert set(host_copies.values()) <= saving.saved_values()
    assert {default.decision(n).decision for n in host_copies} == {"recompute"}
    replayed = {node for replay in default.replay for node in replay.nodes}
    assert set(host_copies) <= replayed
    assert not set(host_copies) & {node for r in saving.replay for node in r.nodes}


def test_the_forward_export_carries_the_same_copies_between_devices():
    """The forward-only export of the same step (traced without autograd) has the joint
    graph's copies to the host and back."""
    cfg = entry("moe_ep2").config
    with traced_group(cfg.world_size):
        forward = export_forward_on_device(
            entry("moe_ep2").build(), make_inputs(cfg), name=CUDA_GOLDEN,
            models=model_decls(cfg), world_size=cfg.world_size,
        )
    assert {n.phase for n in forward.nodes} == {graph_pb2.PHASE_FORWARD}
    joint = load_graph(GOLDEN_DIR / f"{CUDA_GOLDEN}.pb")
    for device in ("cpu", "cuda:0"):
        assert [n.layer for n in copies_to(forward, device)] == [
            n.layer for n in copies_to(joint, device)
        ]
