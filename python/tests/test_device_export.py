"""Graphs of GPU runs exported on this CPU-only machine with fake CUDA tensors
(`recompute_planner.device_export`): the MoE model's routing counts cross to the host, and the
planner keeps that copy with `collectives="save"`."""

from __future__ import annotations

import warnings

import pytest

import recompute_planner as rp
from recompute_planner.device_export import export_forward_on_device
from recompute_planner.zoo.catalog import entry, make_inputs, model_decls
from recompute_planner.zoo.goldens import traced_group


@pytest.fixture(scope="module")
def cuda_graph():
    cfg = entry("moe_ep2").config
    with traced_group(cfg.world_size):
        return export_forward_on_device(
            entry("moe_ep2").build(), make_inputs(cfg), name="moe_ep2_cuda",
            models=model_decls(cfg), world_size=cfg.world_size,
        )


def device_of(node) -> str | None:
    found = [a.str for a in node.attributes if a.name == "device"]
    return found[0] if found else None


def host_copies(graph) -> list:
    """Copies to the host: `_to_copy` to the CPU (of CUDA values: everything else is)."""
    return [
        n for n in graph.nodes if n.op == "aten._to_copy.default" and device_of(n) == "cpu"
    ]


def test_the_graph_carries_the_devices_and_the_copies_between_them(cuda_graph):
    devices = {device_of(n) for n in cuda_graph.nodes} - {None}
    assert "cuda:0" in devices and "cpu" in devices
    # One routing-count copy to the host per MoE layer, and the host mask copied back.
    assert len(host_copies(cuda_graph)) == 2
    assert any(
        n.op == "aten._to_copy.default" and device_of(n) == "cuda:0" for n in cuda_graph.nodes
    )


def test_collectives_save_keeps_the_host_copy(cuda_graph):
    names = {n.name for n in host_copies(cuda_graph)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        saving = rp.plan(cuda_graph, collectives="save")
        default = rp.plan(cuda_graph)
    assert {(n.decision, n.reason) for n in saving.nodes if n.name in names} == {
        ("save", "saved-collective")
    }
    assert {n.decision for n in default.nodes if n.name in names} == {"recompute"}
