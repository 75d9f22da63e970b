"""Reading exported graphs in tests: the goldens, markers, per-layer node sequences, unit
intervals."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from recompute_planner import _native
from recompute_planner._zoo.goldens import golden
from recompute_planner.markers import MARKER_NAME_ATTR, MARKER_OP
from recompute_planner.proto import graph_pb2

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "tests" / "golden"


def golden_param(name: str, *values: object, **kwargs: object):
    """A test parameter for golden `name` (`values` after it), skipped with the reason when the
    model's step on this CPU is not the golden's graph (a device golden)."""
    reason = golden(name).cpu_step_differs
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(name, *values, marks=marks, **kwargs)


# (model, layer, micro-batch): one run of a decoder layer's forward on one micro-batch.
LayerRun = tuple[str, int, int]


def load_graph(path: Path) -> graph_pb2.Graph:
    """A graph from a binary `.pb` file."""
    graph = graph_pb2.Graph()
    graph.ParseFromString(path.read_bytes())
    return graph


def forward_then_backward(graph: graph_pb2.Graph) -> bool:
    """True when the forward nodes form a prefix of the node list (eager finishes the forward
    before backward starts)."""
    phases = [n.phase for n in graph.nodes]
    forward = phases.count(graph_pb2.PHASE_FORWARD)
    backward = len(phases) - forward
    return phases == [graph_pb2.PHASE_FORWARD] * forward + [graph_pb2.PHASE_BACKWARD] * backward


def loss_ancestors(graph: graph_pb2.Graph) -> set[str]:
    """Names of the nodes the loss (the graph's first output) depends on through data."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    stack, found = [graph.outputs[0]], set()
    while stack:
        node = producer.get(stack.pop())
        if node is not None and node.name not in found:
            found.add(node.name)
            stack.extend(node.inputs)
    return found


def marker_name(node: graph_pb2.Node) -> str | None:
    """The marker name of a `checkpoint_record` node, None for any other node."""
    if node.op != MARKER_OP:
        return None
    names = [a.str for a in node.attributes if a.name == MARKER_NAME_ATTR]
    assert len(names) == 1, f"marker node {node.name} has no single `name` attribute"
    return names[0]


def layer_runs(graph: graph_pb2.Graph) -> dict[LayerRun, list[graph_pb2.Node]]:
    """Forward nodes inside decoder layers, in execution order, per (model, layer, mb)."""
    runs: dict[LayerRun, list[graph_pb2.Node]] = {}
    for node in graph.nodes:
        if node.phase == graph_pb2.PHASE_FORWARD and node.HasField("layer"):
            runs.setdefault((node.model, node.layer, node.micro_batch), []).append(node)
    return runs


def markers_by_run(graph: graph_pb2.Graph) -> dict[LayerRun, list[str]]:
    """The marker names each layer run records, in order."""
    return {
        run: [m for m in map(marker_name, nodes) if m is not None]
        for run, nodes in layer_runs(graph).items()
    }


def declared_intervals(graph: graph_pb2.Graph, model: str) -> dict[str, str]:
    """begin marker -> end marker for every interval `model` declares."""
    (decl,) = [m for m in graph.models if m.name == model]
    return {i.begin: i.end for unit in decl.units for i in unit.intervals}


def interval_contents(graph: graph_pb2.Graph) -> dict[tuple[LayerRun, str], list[graph_pb2.Node]]:
    """The nodes each interval encloses, per layer run, keyed by its begin marker: the
    planner's own marker walk (an interval opens at its begin marker and closes at its end
    marker; every op while it is open belongs to it)."""
    by_name = {n.name: n for n in graph.nodes}
    rows = _native.interval_contents(
        data=graph.SerializeToString(), format="pb", origin=f"graph {graph.name}"
    )
    return {
        ((model, layer, micro_batch), begin): [by_name[name] for name in names]
        for model, layer, micro_batch, begin, _end, names in rows
    }


def interval_ops(graph: graph_pb2.Graph) -> dict[tuple[LayerRun, str], Counter]:
    """The multiset of ops each interval encloses, per layer run, keyed by its begin marker."""
    return {key: Counter(n.op for n in nodes) for key, nodes in interval_contents(graph).items()}


def micro_batch_mismatches(single: graph_pb2.Graph, domino: graph_pb2.Graph) -> list[str]:
    """Where the domino graph's intervals enclose other ops than the single-batch graph's.

    Every micro-batch of every layer must enclose, per interval, exactly the multiset of ops
    the same layer's interval encloses in the single-batch path (each micro-batch replays the
    same ops).
    """
    reference = {(run[0], run[1], begin): ops for (run, begin), ops in interval_ops(single).items()}
    seen = set()
    problems = []
    for (run, begin), ops in sorted(interval_ops(domino).items()):
        key = (run[0], run[1], begin)
        seen.add(key)
        expected = reference.get(key, Counter())
        if ops != expected:
            diff = {op: ops[op] - expected[op] for op in sorted(ops | expected)}
            changed = {op: n for op, n in diff.items() if n}
            problems.append(f"{run} {begin}: domino minus single-batch ops = {changed}")
    problems += [f"{key}: absent from the domino path" for key in sorted(reference.keys() - seen)]
    return problems
