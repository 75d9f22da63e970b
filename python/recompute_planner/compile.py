"""The torch.compile planning stage: the planner decides what the compiled step saves.

AOTAutograd builds the joint forward+backward graph of a compiled step and hands it to a
partitioner, which chooses the tensors the forward saves for backward. This stage runs on that
joint graph, last before the partitioner:

1. converts it to the planner's IR in memory (the exporter's FX -> IR mapping, so IR node
   names are the FX node names);
2. plans it with the Rust planner in-process, with the given options;
3. tags every forward node: ``node.meta["recompute"]`` is ``CheckpointPolicy.PREFER_RECOMPUTE``
   for the ops the plan replays and ``MUST_SAVE`` for every other (kept ops, ops outside
   checkpointed layers, and recomputed ops no replay needs: a recompute tag would make the
   partitioner re-run them, an all-to-all whose consumers are kept for one, and save their
   inputs); ``node.meta["ac_graph_id"]`` numbers the checkpointed layers in execution order,
   so the partitioner saves each layer's input; backward nodes stay in backward;
4. removes the ``checkpoint_record`` marker nodes (identities the plan needed to find the
   units; compiled code should not copy tensors for them).

torch's min-cut partitioner then saves exactly the values the plan saves (see
``python/tests/test_compile_stage.py`` for what "exactly" means: marker outputs stand for their
input, which the marker removal makes them). Diagnostics surface as ``PlannerWarning`` at compile
time, and a plan with an error diagnostic fails the compile with ``PlanRejected``.

Two ways in:

- inductor (``torch.compile(model)``): ``stage = install(models, keep=[...])`` sets
  ``torch._inductor.config.joint_custom_post_pass`` to the stage (and lets markers into compiled
  graphs); ``stage.uninstall()`` or ``with install(...):`` restores both. The post pass, not
  ``joint_custom_pre_pass``: inductor's joint-graph pattern passes run between the two and
  replace nodes (the loss's log-softmax, constant fills) by new, untagged ones; the post pass
  plans the graph the partitioner will cut;
- ``aot_autograd`` with your own compilers: pass ``partition_fn=stage.partition_fn``; it plans
  and tags, then calls ``min_cut_rematerialization_partition``. Trace it inside
  ``markers_in_compiled_graphs()`` (``install`` does that too) when Dynamo traces the model.

The stage declines inductor's FX graph cache (``uuid()`` is None): every compile plans again,
so its diagnostics are reported and ``stage.plans`` holds the plan of each compiled graph.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.descriptors import (
    GradAOTOutput,
    PlainAOTInput,
    TangentAOTInput,
)
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from . import markers
from .api import HwLike, check_plan, plan as plan_graph
from .export import (
    _BACKWARD_PASS,
    _FORWARD_PASS,
    EXPORTER_VERSION,
    ModelDecl,
    _build_graph,
    _FlatInput,
    _forward_nodes,
    _metadata,
)
from .plans import DECISION_NO_CHECKPOINT, Plan
from .proto import graph_pb2

# Key of node.meta the partitioner reads for the checkpointed layer a node belongs to.
AC_GRAPH_ID = "ac_graph_id"
RECOMPUTE = "recompute"
# Backward nodes stay in backward, as in eager autograd: the partitioner may otherwise move a
# backward op that reads only forward values (`exp` of the log-softmax) into forward and save
# its output instead of what the plan saves.
PARTITIONER_TAG = "partitioner_tag"
MUST_BE_IN_BACKWARD = "must_be_in_backward"


# --------------------------------------------------------------------------------------------
# Joint graph -> IR


def joint_graph_to_ir(
    graph_module: fx.GraphModule,
    models: list[ModelDecl],
    *,
    name: str = "compiled",
    num_fwd_outputs: int | None = None,
) -> graph_pb2.Graph:
    """The IR of a joint graph AOTAutograd built under ``torch.compile`` or ``aot_autograd``.

    Placeholders keep their names (``primals_3``); a primal with a gradient output is a
    parameter, any other an input. ``num_fwd_outputs`` defaults to the outputs that are not
    gradients. The step must return the scalar loss alone, as for ``export_joint``.
    """
    output_descs = _output_descs(graph_module)
    if num_fwd_outputs is None:
        num_fwd_outputs = sum(
            1 for desc in output_descs if desc is not None and not isinstance(desc, GradAOTOutput)
        )
    world_size, rank = _world()
    tag_untraced_nodes(graph_module.graph)
    built = _build_graph(
        graph_module,
        _forward_nodes(graph_module, num_fwd_outputs),
        _flat_inputs(graph_module, output_descs),
        name=name,
        models=models,
        metadata=_metadata(EXPORTER_VERSION, world_size, rank),
    )
    return built.graph


def tag_untraced_nodes(graph: fx.Graph) -> None:
    """Gives a pass tag to the nodes AOTAutograd did not trace: inductor's joint-graph passes
    create some (a device-fixed ``iota``, constant fills). Such a node ran in backward if it
    comes after the first backward node or reads a backward node or a tangent, else in
    forward; the exporter's phase rule then reads the tags as it does for traced nodes."""
    in_backward = False
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and _is_tangent(node.meta.get("desc")):
            backward.add(node)
        if node.op != "call_function":
            continue
        tag = node.meta.get(PARTITIONER_TAG)
        if tag is None:
            reads_backward = any(i in backward for i in node.all_input_nodes)
            tag = _BACKWARD_PASS if in_backward or reads_backward else _FORWARD_PASS
            node.meta[PARTITIONER_TAG] = tag
        if tag != _FORWARD_PASS:
            in_backward = True
            backward.add(node)


def _output_descs(graph_module: fx.GraphModule) -> list[Any]:
    descs = graph_module.graph.output_node().meta.get("desc")
    if descs is None:
        raise RuntimeError(
            "the joint graph carries no AOTAutograd output descriptors: the planning stage "
            "needs the joint graph of torch.compile or aot_autograd (torch >= 2.9)"
        )
    return list(descs)


def _flat_inputs(graph_module: fx.GraphModule, output_descs: list[Any]) -> list[Any]:
    """AOTAutograd's flat inputs as the exporter names them: one entry per ``PlainAOTInput``
    index, named after its placeholder, a parameter when a gradient is returned for it."""
    with_grad = {
        d.grad_of.idx for d in output_descs if isinstance(d, GradAOTOutput)
        and isinstance(d.grad_of, PlainAOTInput)
    }
    by_index: dict[int, Any] = {}
    for node in graph_module.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, PlainAOTInput):
            role = graph_pb2.ROLE_PARAMETER if desc.idx in with_grad else graph_pb2.ROLE_INPUT
            by_index[desc.idx] = _FlatInput(node.name, role, node.meta.get("val"))
        elif not _is_tangent(desc):
            raise ValueError(
                f"placeholder `{node.name}` is {desc!r}: the planning stage handles plain tensor "
                "inputs only (no tensor subclasses or opaque inputs)"
            )
    return [by_index.get(i) for i in range(max(by_index, default=-1) + 1)]


def _is_tangent(desc: Any) -> bool:
    return isinstance(desc, TangentAOTInput)


def _world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


# --------------------------------------------------------------------------------------------
# Tags


@dataclass(frozen=True)
class Tag:
    """What the partitioner reads for one node."""

    policy: CheckpointPolicy
    ac_graph_id: int | None  # the checkpointed layer, numbered from 1; None outside them


def plan_tags(plan: Plan) -> dict[str, Tag]:
    """Per forward node the plan decides, its partitioner tag (see the module docstring)."""
    layer_ids = {layer: index + 1 for index, layer in enumerate(plan.layers())}
    replayed = {name for replay in plan.replay for name in replay.nodes}
    tags = {}
    for node in plan.nodes:
        if node.decision == DECISION_NO_CHECKPOINT:
            tags[node.name] = Tag(CheckpointPolicy.MUST_SAVE, None)
            continue
        policy = (
            CheckpointPolicy.PREFER_RECOMPUTE
            if node.name in replayed
            else CheckpointPolicy.MUST_SAVE
        )
        tags[node.name] = Tag(policy, layer_ids[(node.model, node.layer)])
    return tags


def tag_joint_graph(graph: fx.Graph, ir: graph_pb2.Graph, plan: Plan) -> None:
    """Sets ``recompute`` and ``ac_graph_id`` on every forward node the plan decides (``ir``
    is the graph's IR, which the plan was made for) and on the ``getitem`` nodes reading a
    tagged node's outputs; keeps backward nodes in backward."""
    tags = plan_tags(plan)
    backward = {n.name for n in ir.nodes if n.phase == graph_pb2.PHASE_BACKWARD}
    for node in graph.nodes:
        source = node.args[0] if _is_getitem(node) else node
        while _is_getitem(source):
            source = source.args[0]
        tag = tags.get(source.name) if isinstance(source, fx.Node) else None
        if tag is None:
            if node.name in backward:
                node.meta[PARTITIONER_TAG] = MUST_BE_IN_BACKWARD
            continue
        node.meta[RECOMPUTE] = tag.policy
        if tag.ac_graph_id is None:
            node.meta.pop(AC_GRAPH_ID, None)
        else:
            node.meta[AC_GRAPH_ID] = tag.ac_graph_id


def eliminate_common_subexpressions(graph_module: fx.GraphModule) -> None:
    """The partitioner's own CSE, run first (when torch runs it at all) so the plan is made for
    the graph the partitioner cuts: CSE merges a backward op into an identical forward one (a
    constant ``full``), which then becomes a forward value backward reads. Running it again in
    the partitioner changes nothing."""
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse

    if functorch_config.cse:
        graph_module.graph = fx_graph_cse(graph_module.graph)
        graph_module.recompile()


def remove_markers(graph: fx.Graph) -> int:
    """Replaces every ``checkpoint_record`` node by its input; returns how many it removed."""
    removed = 0
    for node in list(graph.find_nodes(op="call_function", target=markers.MARKER_OVERLOAD)):
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        removed += 1
    return removed


def _is_getitem(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target is operator.getitem
    )


# --------------------------------------------------------------------------------------------
# The stage


class PlanningStage(CustomGraphPass):
    """Plans each joint graph it sees and tags it for the partitioner.

    ``models`` declares the graph's models, layers and units (``ModelDecl``, as for
    ``export``; ``recompute_planner.annotate`` returns them for a module it annotated); the
    other options are those of ``recompute_planner.plan``. ``plans`` collects the plan of every
    graph the stage planned, in order.
    """

    def __init__(
        self,
        models: list[ModelDecl],
        keep: str | Iterable[str] | None = None,
        *,
        recompute_ratio: float = 1.0,
        collectives: str = "recompute",
        random_ops: str = "save",
        budget: int | str | None = None,
        granularity: str = "unit",
        hw: HwLike = None,
        name: str = "compiled",
    ):
        self.models = list(models)
        self.options = dict(
            keep=keep,
            recompute_ratio=recompute_ratio,
            collectives=collectives,
            random_ops=random_ops,
            budget=budget,
            granularity=granularity,
            hw=hw,
        )
        self.name = name
        self.plans: list[Plan] = []

    def apply(self, graph_module: fx.GraphModule, num_fwd_outputs: int | None = None) -> Plan:
        """Converts, plans and tags ``graph_module``'s joint graph, then drops its markers."""
        eliminate_common_subexpressions(graph_module)
        ir = joint_graph_to_ir(
            graph_module, self.models, name=self.name, num_fwd_outputs=num_fwd_outputs
        )
        planned = plan_graph(ir, check=False, **self.options)
        self.plans.append(planned)
        check_plan(planned, stacklevel=2)
        tag_joint_graph(graph_module.graph, ir, planned)
        if remove_markers(graph_module.graph):
            graph_module.recompile()
        return planned

    # The inductor joint-graph pass ----------------------------------------------------------

    def __call__(self, graph: fx.Graph) -> None:
        self.apply(graph.owning_module)

    def uuid(self) -> None:
        """No FX graph caching: a cached compile would skip planning and its diagnostics."""
        return None

    def __deepcopy__(self, memo: dict) -> "PlanningStage":
        """Inductor copies its config per compile: the copy must be this stage, which collects
        the plans."""
        return self

    # The aot_autograd partition_fn ----------------------------------------------------------

    def partition_fn(
        self,
        joint_module: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        **kwargs: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """A ``partition_fn`` for ``aot_autograd``: plans and tags, then runs torch's min-cut
        partitioner, which honours the tags."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.apply(joint_module, num_fwd_outputs)
        return min_cut_rematerialization_partition(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
        )

    # Installation ---------------------------------------------------------------------------

    def install(self) -> "PlanningStage":
        """Makes this stage inductor's joint-graph pass and lets markers into compiled graphs,
        until ``uninstall()``."""
        import torch._inductor.config as inductor_config

        if getattr(self, "_installed", None) is not None:
            raise RuntimeError("this planning stage is installed already")
        stack = contextlib.ExitStack()
        stack.enter_context(inductor_config.patch(joint_custom_post_pass=self))
        stack.enter_context(markers.markers_in_compiled_graphs())
        self._installed = stack
        return self

    def uninstall(self) -> None:
        """Restores inductor's joint-graph pass and the marker setting ``install`` changed."""
        stack, self._installed = getattr(self, "_installed", None), None
        if stack is not None:
            stack.close()

    def __enter__(self) -> "PlanningStage":
        return self if getattr(self, "_installed", None) is not None else self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(
    models: list[ModelDecl], keep: str | Iterable[str] | None = None, **options: Any
) -> PlanningStage:
    """The one line: ``stage = recompute_planner.compile.install(models, keep=[...])``; every
    ``torch.compile`` training step compiled after it saves what the plan saves."""
    return PlanningStage(models, keep, **options).install()


@contextlib.contextmanager
def planning(models: list[ModelDecl], keep: str | Iterable[str] | None = None,
             **options: Any) -> Iterator[PlanningStage]:
    """``with planning(models, keep=[...]) as stage:`` installs a stage for the block."""
    with PlanningStage(models, keep, **options) as stage:
        yield stage
