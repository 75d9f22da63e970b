"""The torch.compile planning stage: the planner decides what the compiled step saves.

AOTAutograd builds the joint forward+backward graph of a compiled step and hands it to a
partitioner, which chooses the tensors the forward saves for backward. This stage is that
partitioner (or, as an option, runs just before torch's):

1. converts the joint graph to the planner's IR in memory (the exporter's FX -> IR mapping, so
   IR node names are the FX node names) and plans it with the Rust planner in-process;
2. removes the ``checkpoint_record`` marker nodes (identities the plan needed to find the
   units; compiled code should not copy tensors for them; a marker's output stands for its
   input);
3. with ``partitioner="plan"`` (the default), builds the forward and backward graphs from the
   plan itself (``partition_from_plan``): the forward returns exactly the plan's saved set,
   the backward re-runs exactly the plan's replay, each replayed op placed before its first
   backward use; nothing is solved again. The graph is planned as AOTAutograd traced it,
   with no common-subexpression elimination first, so its plan is the plan of the same step
   exported with ``recompute_planner.export`` (test_compile_stage.py checks both). That
   holds where the step writes in place too: torch.compile functionalizes each write into a
   new tensor, and the IR gives the ops of those writes back the in-place form eager runs
   (``mark_functionalized_writes``), so a kept tensor the step later writes is replayed with
   its writers in both plans;
4. with ``partitioner="min-cut"``, runs torch's common-subexpression elimination first (the
   partitioner runs it, so the plan must be made for its result), tags every forward node
   (``node.meta["recompute"]`` is ``PREFER_RECOMPUTE`` for the ops the plan replays and
   ``MUST_SAVE`` for every other; ``node.meta["ac_graph_id"]`` numbers the checkpointed layers
   in execution order, so the partitioner saves each layer's input; backward nodes stay in
   backward) and calls ``min_cut_rematerialization_partition``, which honours the tags.

Diagnostics surface as ``PlannerWarning`` at compile time, and a plan with an error diagnostic
fails the compile with ``PlanRejected``.

Three ways in:

- ``torch.compile(model, backend=stage.backend)`` inside ``with planning(models, keep=[...])
  as stage:``: inductor, with no decompositions and no joint-graph passes before the
  partition, so the stage plans the graph ``recompute_planner.export`` exports;
- inductor (``torch.compile(model)``): ``stage = install(models, keep=[...])`` makes the stage
  inductor's partitioner (``custom_partitioner_fn``; with ``partitioner="min-cut"`` its
  ``joint_custom_post_pass``, which runs after inductor's joint-graph pattern passes, so the
  plan is made for the graph the partitioner cuts: the graph inductor decomposed, whose plan
  differs from the exported step's) and lets markers into compiled graphs;
  ``stage.uninstall()`` or ``with install(...):`` restores both. Stages may be installed and
  uninstalled in any order: the most recently installed stage still installed is the one
  inductor runs;
- ``aot_autograd`` with your own compilers: pass ``partition_fn=stage.partition_fn`` (as a
  ``torch.compile`` backend inside ``install`` or ``planning``; ``aot_module`` and
  ``aot_function``, which trace without Dynamo, inside ``tracing()`` too).

While a stage is installed, the step is traced as the program ``recompute_planner.export``
traces (``_exporter.compiled_as_exported``): markers enter the graph, and a dropout that
draws nothing (``p=0``, as HuggingFace eager attention calls it, or not training) returns its
input as eager ATen does, where torch's decomposition would copy it (a ``clone`` the plan would
save instead of its input). None of it adds to Dynamo's time: the annotation runs as part of
each module's forward, and nothing intercepts the model's ops while Dynamo traces them. A step
compiled for one stage configuration is traced again, once, when a stage that plans otherwise
is installed (Dynamo guards on the installed configuration's number), not on later calls.

The stage declines inductor's FX graph cache (``uuid()`` is None): every compile plans again,
so its diagnostics are reported and ``stage.plans`` holds the plan of each compiled graph.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.descriptors import (
    GradAOTOutput,
    PlainAOTInput,
    SavedForBackwardsAOTOutput,
    SavedForBackwardsNoVcCheckAOTOutput,
    TangentAOTInput,
)
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy

from . import _host_memory as host_memory
from . import markers
from ._exporter import (
    BACKWARD_PASS,
    EXPORTER_VERSION,
    FORWARD_PASS,
    PASS_TAG,
    BuiltGraph,
    FlatInput,
    ModelDecl,
    build_graph,
    compiled_as_exported,
    forward_nodes,
    graph_metadata,
    mark_functionalized_writes,
    require_tracing_torch,
    traced_as_exported,
)
from ._unit_markers import place_unit_markers
from .api import HwLike, check_plan
from .api import plan as plan_graph
from .plans import DECISION_NO_CHECKPOINT, Plan
from .proto import graph_pb2

# The executor the stage plans for: a graph executor whose graphs hold no unit marker (the
# stage removes them once the plan is made), as `planner plan --executor compiled` plans.
EXECUTOR = "compiled"
# Key of node.meta the partitioner reads for the checkpointed layer a node belongs to.
AC_GRAPH_ID = "ac_graph_id"
RECOMPUTE = "recompute"
# Backward nodes stay in backward (``PASS_TAG``), as in eager autograd: the partitioner may
# otherwise move a backward op that reads only forward values (`exp` of the log-softmax) into
# forward and save its output instead of what the plan saves.
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
    gradients. The step's loss is its one output or, of several (a model output compiled
    whole: an HF ``ModelOutput``'s loss and logits, a tuple, a dict), its first scalar
    floating-point output; the others are outputs the caller holds through backward.
    """
    return build_joint_graph(
        graph_module, models, name=name, num_fwd_outputs=num_fwd_outputs
    ).graph


def build_joint_graph(
    graph_module: fx.GraphModule,
    models: list[ModelDecl],
    *,
    name: str = "compiled",
    num_fwd_outputs: int | None = None,
) -> BuiltGraph:
    """``joint_graph_to_ir`` as built: what the planner plans without the message being
    written or parsed in Python."""
    output_descs = _output_descs(graph_module)
    if num_fwd_outputs is None:
        num_fwd_outputs = sum(
            1 for desc in output_descs if desc is not None and not isinstance(desc, GradAOTOutput)
        )
    world_size, rank = _world()
    flat_inputs = _flat_inputs(graph_module, output_descs)
    parameters = {i.name for i in flat_inputs if i and i.role == graph_pb2.ROLE_PARAMETER}
    tag_untraced_nodes(graph_module.graph)
    placed = place_unit_markers(graph_module.graph, models, parameters)
    if markers.resolve_tentative_markers(graph_module.graph) or placed:
        graph_module.recompile()
    forward = forward_nodes(graph_module, num_fwd_outputs)
    mark_functionalized_writes(graph_module.graph, forward)
    return build_graph(
        graph_module,
        forward,
        flat_inputs,
        name=name,
        models=models,
        metadata=graph_metadata(EXPORTER_VERSION, world_size, rank),
    )


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
        tag = node.meta.get(PASS_TAG)
        if tag is None:
            reads_backward = any(i in backward for i in node.all_input_nodes)
            tag = BACKWARD_PASS if in_backward or reads_backward else FORWARD_PASS
            node.meta[PASS_TAG] = tag
        if tag != FORWARD_PASS:
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
            by_index[desc.idx] = FlatInput(node.name, role, node.meta.get("val"))
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
    layer_ids: dict[tuple[str, int | None], int] = {
        layer: index + 1 for index, layer in enumerate(plan.layers())
    }
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
                node.meta[PASS_TAG] = MUST_BE_IN_BACKWARD
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
# The partition from the plan


class PartitionMismatch(RuntimeError):
    """The forward and backward graphs built from a plan do not save or replay what the plan
    says: a bug of the stage or the planner, never a property of the model."""


def partition_from_plan(
    joint_module: fx.GraphModule,
    plan: Plan,
    *,
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graphs of ``joint_module`` (the graph ``plan`` was made for, markers
    still in) that save exactly the plan's saved set and re-run exactly its replay.

    Markers are removed first, their outputs standing for their inputs. The forward returns the
    step's outputs and the saved values; the backward reads the saved values and the tangents
    and copies every forward op it needs and cannot read from them: the replay, each replayed
    op placed just before its first backward use, as the plan schedules replay, and each
    ``getitem`` just after its producer, so multi-output results are freed early.
    ``_split_in_one_pass`` copies the forward's nodes once and cuts the joint graph down to the
    backward in place; a joint graph with a feature it does not handle (symbolic shapes,
    random-seed or backward-state inputs, submodules, saved values backward does not read) goes
    through torch's ``_extract_fwd_bwd_modules`` and the same reordering in place
    (``_split_with_torch``). Each graph's Python code is generated once, at the end, or, where
    lazy graph modules are on (as ``torch.compile`` compiles), on first use, as torch's
    partitioners leave it. ``joint_module`` is consumed (its graph may become the backward's;
    its code is not regenerated). Raises ``PartitionMismatch`` if the result saves or replays
    anything else.
    """
    stand_ins = _marker_stand_ins(joint_module.graph)
    remove_markers(joint_module.graph)
    saved = _saved_nodes(joint_module.graph, plan, stand_ins)
    halves = _split_in_one_pass(joint_module, list(saved), num_fwd_outputs=num_fwd_outputs)
    if halves is None:
        halves = _split_with_torch(joint_module, list(saved), num_fwd_outputs=num_fwd_outputs)
    forward, backward = halves
    _check_partition(forward, backward, plan, saved, num_fwd_outputs=num_fwd_outputs)
    offloaded = {node.name for node, moves in saved.items() if moves}
    offload_saved(
        forward, backward, offloaded, num_fwd_outputs=num_fwd_outputs,
        prefetch=plan.config.offload_prefetch,
    )
    if not _lazy_graph_modules():
        for module in halves:
            _generate_code(module)
    return forward, backward


def _split_with_torch(
    joint_module: fx.GraphModule, saved: list[fx.Node], *, num_fwd_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's ``_extract_fwd_bwd_modules`` (three copies of the graph), then, in place, the
    order the one-pass split emits: the replay at first use, getitems after their producers;
    code not generated."""
    from torch._functorch.partitioners import (  # type: ignore[attr-defined]  # private
        _extract_fwd_bwd_modules,
        _is_tangent,
    )
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        forward, backward = _extract_fwd_bwd_modules(
            joint_module, saved, [], num_fwd_outputs=num_fwd_outputs
        )
    _reorder(forward.graph, _getitems_after_producers(_ops(forward.graph)))
    tangents = [node for node in backward.graph.find_nodes(op="placeholder") if _is_tangent(node)]
    outputs = list(backward.graph.output_node().args[0])  # type: ignore[arg-type]
    _reorder(
        backward.graph,
        _getitems_after_producers(_at_first_use(_ops(backward.graph), tangents, outputs)),
    )
    return forward, backward


# What a joint graph's values may be for the one-pass split: no symbolic scalars.
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _split_in_one_pass(
    joint_module: fx.GraphModule, saved: list[fx.Node], *, num_fwd_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """The forward and backward modules ``_extract_fwd_bwd_modules`` makes for ``saved``, built
    with one copy of each node the forward keeps, the backward cut out of the joint graph in
    place (after the forward is copied), the backward in replay-at-first-use order with
    getitems raised (code not generated); None for a graph it does not handle.

    As torch's: each half holds the ops computable from its inputs (the primals; the saved
    values then the tangents) that its outputs or a side effect need, ops that must stay in
    the other half excluded; placeholders share the joint graph's metadata; saved tensors
    without version-counter check come last; the forward returns its outputs then the saved
    values, described ``SavedForBackwards*AOTOutput``; backward ops are marked
    ``autograd_backward``.
    """
    from torch._functorch import partitioners as torch_partitioners
    from torch._functorch.partitioners import (  # type: ignore[attr-defined]  # private
        _is_primal,
        _is_tangent,
    )
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    graph = joint_module.graph
    placeholders = graph.find_nodes(op="placeholder")
    primals = [node for node in placeholders if _is_primal(node)]
    tangents = [node for node in placeholders if _is_tangent(node)]
    if len(primals) + len(tangents) != len(placeholders) or not _one_pass_handles(
        graph, [*placeholders, *saved]
    ):
        return None
    fwd_outputs, bwd_outputs, fwd_descs, bwd_descs = (
        torch_partitioners._extract_fwd_bwd_outputs(joint_module, num_fwd_outputs=num_fwd_outputs)
    )
    saved, no_vc_check_start = _by_version_counter_check(saved)
    impure_random = _impure_random()
    backward_nodes = _live_nodes(
        graph, [*saved, *tangents], bwd_outputs, torch_partitioners._must_be_in_forward,
        impure_random,
    )
    forward_nodes = _live_nodes(
        graph, primals, [*fwd_outputs, *saved], torch_partitioners._must_be_in_backward,
        impure_random,
    )
    if forward_nodes is None or backward_nodes is None:
        return None
    if _unread_saved(saved, backward_nodes, bwd_outputs):
        return None
    saved_descs = [
        (SavedForBackwardsNoVcCheckAOTOutput if i >= no_vc_check_start else
         SavedForBackwardsAOTOutput)(i)
        for i in range(len(saved))
    ]
    # The forward (the smaller half: the backward holds the replay too) is a copy; the backward
    # is the joint graph itself, cut down in place once the forward is copied out of it
    # (erasing a node costs a fraction of copying one).
    forward_graph = _emit_graph(
        primals, _getitems_after_producers(forward_nodes), [*fwd_outputs, *saved],
        [*fwd_descs, *saved_descs],
    )
    backward_order = _getitems_after_producers(_at_first_use(backward_nodes, tangents, bwd_outputs))
    _cut_to(graph, [*saved, *tangents], backward_order, bwd_outputs, bwd_descs)
    for node in backward_order:
        if node.op in ("call_function", "get_attr"):
            node.meta["autograd_backward"] = True
    with _use_lazy_graph_module(True):
        return (
            _make_graph_module(joint_module, forward_graph),
            _make_graph_module(joint_module, graph),
        )


def _one_pass_handles(graph: fx.Graph, inputs: list[fx.Node]) -> bool:
    """Whether the one-pass split handles ``graph``: no symbolic scalar anywhere, no symbolic
    shape or opaque object among the placeholders and saved values (``inputs``), and no
    activation quantization pass (torch saves symbols, opaque objects and quantized
    activations its own way)."""
    from torch._inductor import config as inductor_config
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.fx.experimental.symbolic_shapes import free_symbols

    if inductor_config.post_grad_fusion_options.get("activation_quantization_aten_pass"):
        return False
    if any(isinstance(node.meta.get("val"), _SYMBOLIC) for node in graph.nodes):
        return False
    return not any(
        isinstance(node.meta.get("val"), FakeScriptObject)
        or not _static_tensor(node.meta.get("val")) and free_symbols(node.meta.get("val"))
        for node in inputs
    )


def _static_tensor(value: Any) -> bool:
    """Whether ``value`` is a strided tensor whose sizes, strides and offset are all plain
    ints, so it has no free symbols: three reads, where ``free_symbols`` dispatches on the type
    of every size and stride (half the cost of the check, over a graph's saved values)."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and all(type(n) is int for n in (*value.shape, *value.stride(), value.storage_offset()))
    )


def _by_version_counter_check(saved: list[fx.Node]) -> tuple[list[fx.Node], int]:
    """``saved`` with the tensors saved without version-counter check last (in order), and
    where they start: the order AOTAutograd slices them in."""
    checked = [node for node in saved if not node.meta.get("saved_tensor_with_no_vc_check")]
    unchecked = [node for node in saved if node.meta.get("saved_tensor_with_no_vc_check")]
    return checked + unchecked, len(checked)


def _impure_random() -> bool:
    """Whether dead-code elimination keeps random ops, as ``Graph.eliminate_dead_code``
    decides."""
    from torch._guards import TracingContext
    from torch._inductor import config as inductor_config

    if TracingContext.try_get():
        return bool(inductor_config.fallback_random)
    return True


def _live_nodes(
    graph: fx.Graph,
    inputs: list[fx.Node],
    outputs: list[Any],
    stays_out: Callable[[fx.Node], bool],
    impure_random: bool,
) -> list[fx.Node] | None:
    """The ops, in graph order, of the subgraph that reads ``inputs`` and returns ``outputs``:
    each op computable from the inputs (not one ``stays_out`` of this half) that an output or
    a side effect needs, as torch's extraction then dead-code elimination keeps; None if an
    output is not computable or the graph holds other than functions and attributes."""
    available = set(inputs)
    computable: list[fx.Node] = []
    for node in graph.nodes:
        if node in available or node.op in ("placeholder", "output"):
            continue
        if node.op not in ("call_function", "get_attr"):
            return None
        # The inputs first: one set test (fx keeps a node's inputs as the keys of
        # `_input_nodes`), where `stays_out` reads the node's tags and schema.
        if available.issuperset(node._input_nodes) and not stays_out(node):
            available.add(node)
            computable.append(node)
    live = {node for node in outputs if isinstance(node, fx.Node)}
    if not live <= available:
        return None
    kept: list[fx.Node] = []
    for node in reversed(computable):
        if node in live or node.is_impure(impure_random):
            live.update(node._input_nodes)
            kept.append(node)
    kept.reverse()
    return kept


def _unread_saved(saved: list[fx.Node], backward_nodes: list[fx.Node], outputs: list[Any]) -> bool:
    """Whether backward leaves a saved value unread (or reads it only into a dead
    ``wait_tensor``): torch drops such values from the saved set."""
    backward = set(backward_nodes)
    returned = {node for node in outputs if isinstance(node, fx.Node)}

    def readers(node: fx.Node) -> list[fx.Node]:
        # A node's users in the joint graph, less those outside backward: from the few saved
        # values and their readers, where indexing every backward node's inputs visits all.
        return [user for user in node.users if user in backward]

    def dead_wait(node: fx.Node) -> bool:
        return (
            torch.distributed.is_available()
            and node.target is torch.ops._c10d_functional.wait_tensor.default
            and not readers(node)
            and node not in returned
        )

    return any(
        node not in returned and all(dead_wait(reader) for reader in readers(node))
        for node in saved
    )


def _at_first_use(
    nodes: list[fx.Node], tangents: list[fx.Node], outputs: list[Any]
) -> list[fx.Node]:
    """``nodes`` (a backward's ops in graph order) with the ops before the first that reads a
    tangent (the replay) each moved to just before the first op that needs it, in their
    original order, as the autograd engine would run them; in-place ``copy_`` writes stay
    first, ops nothing needs are dropped."""
    tangent_set = set(tangents)
    first = next(
        (k for k, node in enumerate(nodes) if not tangent_set.isdisjoint(node._input_nodes)),
        None,
    )
    if first is None:
        if not any(isinstance(node, fx.Node) and node in tangent_set for node in outputs):
            return nodes
        first = len(nodes)
    position = {node: k for k, node in enumerate(nodes)}
    unplaced = set(nodes[:first])
    ordered: list[fx.Node] = []

    def place(*roots: fx.Node) -> None:
        # The roots and the unplaced ops they need (set operations on fx's input dicts: the
        # order they are found in does not matter, they are sorted).
        pending: set[fx.Node] = set()
        stack = list(roots)
        while stack:
            current = stack.pop()
            if current not in pending:
                pending.add(current)
                stack.extend(unplaced.intersection(current._input_nodes))
        unplaced.difference_update(pending)
        ordered.extend(sorted(pending, key=position.__getitem__))

    for node in nodes[:first]:
        if node.target is torch.ops.aten.copy_.default and node in unplaced:
            place(node)
    for node in nodes[first:]:
        if unplaced.isdisjoint(node._input_nodes):
            ordered.append(node)  # what `place` does for an op reading no unplaced op (most)
        else:
            place(node)
    place(*(node for node in outputs if isinstance(node, fx.Node) and node in unplaced))
    return ordered


def _getitems_after_producers(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` with each ``getitem`` of one of them just after its producer (their relative
    order kept), so a multi-output result's parts are unpacked, and can be freed, at once."""
    present = set(nodes)
    producers = [_unpacked(node) for node in nodes]  # read once: both passes need them
    parts: dict[fx.Node, list[fx.Node]] = {}
    for node, producer in zip(nodes, producers, strict=True):
        if producer in present:
            parts.setdefault(producer, []).append(node)
    ordered: list[fx.Node] = []
    for node, producer in zip(nodes, producers, strict=True):
        if producer not in present:
            ordered.append(node)
            ordered.extend(parts.get(node, ()))
    return ordered


def _unpacked(node: fx.Node) -> fx.Node | None:
    """The result a ``getitem`` node unpacks; None for other nodes."""
    if _is_getitem(node) and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _emit_graph(
    inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[Any], output_descs: list[Any]
) -> fx.Graph:
    """A graph with a placeholder per input (named as it, sharing its metadata), a copy of each
    of ``nodes`` in order, returning ``outputs``: what ``_extract_graph_with_inputs_outputs``
    builds."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = node.meta
    for node in nodes:
        env[node] = _copy_node(graph, node, env.__getitem__)
    values = [env[node] if isinstance(node, fx.Node) else node for node in outputs]
    _set_output_meta(graph.output(tuple(values)), output_descs)
    return graph


def _copy_node(graph: fx.Graph, node: fx.Node, transform: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """What ``graph.node_copy(node, transform)`` makes, at about half its cost: the node is
    created without arguments, so ``create_node`` skips its walk through every argument (a
    warning for raw symbolic scalars, which the one-pass split never sees: it declines graphs
    with symbols), then given them; its metadata is copied into its own (empty) dict, where
    assigning a node attribute would also re-index the node in its graph."""
    copy = graph.create_node(node.op, node.target, name=node.name, type_expr=node.type)
    copy.args = fx.map_arg(node.args, transform)
    if node.kwargs:
        copy.kwargs = fx.map_arg(node.kwargs, transform)
    copy.meta.update(node.meta)
    return copy


def _cut_to(
    graph: fx.Graph,
    inputs: list[fx.Node],
    nodes: list[fx.Node],
    outputs: list[Any],
    output_descs: list[Any],
) -> None:
    """Makes ``graph`` the graph ``_emit_graph`` would copy out of it, in place: a placeholder
    per input in order (an op among them becomes one: the same node, name and metadata), then
    ``nodes`` in order, returning ``outputs``; everything else erased (``nodes`` read nothing
    else), its inputs passed flat, as the joint graph's are not."""
    output = graph.output_node()
    output.args = (tuple(outputs),)
    _set_output_meta(output, output_descs)
    for node in inputs:
        if node.op != "placeholder":
            _make_placeholder(node)
    for node in [*inputs, *nodes]:
        output.prepend(node)
    kept = {*inputs, *nodes, output}
    for node in list(reversed(graph.nodes)):
        if node not in kept:
            graph.erase_node(node)
    graph.set_codegen(fx.graph.CodeGen())


def _make_placeholder(node: fx.Node) -> None:
    """Turns op ``node`` into a placeholder of the same name, reading nothing."""
    node.args = ()
    node.kwargs = {}
    node.op = "placeholder"
    node.target = node.name


def _set_output_meta(output: fx.Node, output_descs: list[Any]) -> None:
    """The output descriptors and stack traces AOTAutograd reads off a partitioned graph."""
    output.meta["desc"] = output_descs
    output.meta["output_stack_traces"] = [
        value.meta.get("stack_trace") if isinstance(value, fx.Node) else None
        for value in output.args[0]  # type: ignore[union-attr]  # a tuple: set just before
    ]


def _ops(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of ``graph`` between its placeholders and its output, in order."""
    return [node for node in graph.nodes if node.op not in ("placeholder", "output")]


def _reorder(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Puts the ops of ``graph`` in ``order`` just before its output, in place, and erases the
    ops ``order`` leaves out (nothing it keeps reads them)."""
    output = graph.output_node()
    for node in order:
        output.prepend(node)
    kept = set(order)
    for node in reversed(_ops(graph)):
        if node not in kept:
            graph.erase_node(node)


def _lazy_graph_modules() -> bool:
    """Whether graph modules are made lazy here (their code generated on first use), as
    ``torch.compile`` makes them while it compiles."""
    from torch.fx._lazy_graph_module import _get_graph_module_cls, _LazyGraphModule

    return _get_graph_module_cls() is _LazyGraphModule


def _generate_code(module: fx.GraphModule) -> None:
    """Generates ``module``'s Python code from its graph now (a lazy module would do it on its
    first call)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(module, _LazyGraphModule):
        module.real_recompile()
    else:
        module.recompile()


def _marker_stand_ins(graph: fx.Graph) -> dict[str, fx.Node]:
    """Marker output name -> the node it stands for once markers are removed (its input,
    through chains of markers)."""
    stand_ins: dict[str, fx.Node] = {}
    for node in graph.find_nodes(op="call_function", target=markers.MARKER_OVERLOAD):
        source = node.args[0]
        stand_ins[node.name] = stand_ins.get(source.name, source)
    return stand_ins


def _saved_nodes(graph: fx.Graph, plan: Plan, stand_ins: dict[str, fx.Node]) -> dict[fx.Node, bool]:
    """The FX nodes of the plan's saved values (tangents excluded: backward receives them), in
    the plan's order without repeats, each with whether the plan offloads it."""
    by_name = {node.name: node for node in graph.nodes}
    saved: dict[fx.Node, bool] = {}
    for value in plan.saved:
        node = stand_ins.get(value.value) or by_name.get(value.value)
        if node is None:
            raise PartitionMismatch(f"the plan saves `{value.value}`, which the graph lacks")
        if not (node.op == "placeholder" and _is_tangent(node.meta.get("desc"))):
            saved[node] = saved.get(node, False) or value.offloaded
    return saved


def _check_partition(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    plan: Plan,
    saved: dict[fx.Node, bool],
    *,
    num_fwd_outputs: int,
) -> None:
    """The forward saves the plan's saved set and the backward re-runs its replay, by name."""
    returned = {node.name for node in saved_outputs(forward, num_fwd_outputs)}
    planned = {node.name for node in saved}
    replayed = replayed_ops(backward, plan)
    planned_replay = {name for replay in plan.replay for name in replay.nodes} - set(
        _marker_names(plan)
    )
    for what, got, want in (("saves", returned, planned), ("replays", replayed, planned_replay)):
        if got != want:
            raise PartitionMismatch(
                f"the compiled step {what} {sorted(got - want)} beyond the plan and not "
                f"{sorted(want - got)}"
            )


def saved_outputs(forward: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The tensors a forward graph returns for backward."""
    outputs = forward.graph.output_node().args[0]
    assert isinstance(outputs, (tuple, list)), outputs  # a graph returns a tuple of values
    return [node for node in outputs[num_fwd_outputs:] if isinstance(node, fx.Node)]


def replayed_ops(backward: fx.GraphModule, plan: Plan) -> set[str]:
    """Names of the forward ops a backward graph re-runs (``getitem`` excluded)."""
    forward_ops = plan.node_ops
    return {
        node.name
        for node in backward.graph.nodes
        if node.op == "call_function" and node.name in forward_ops
    }


# --------------------------------------------------------------------------------------------
# Offload: saved values in host memory between the halves


def offload_saved(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    offloaded: set[str],
    *,
    num_fwd_outputs: int,
    prefetch: int,
) -> None:
    """Moves the saved values named ``offloaded`` to host memory between the halves, in place.

    The forward copies each one to the host (``_host_memory.OFFLOAD``) once the op after its
    last forward read (through any view of its storage) has run, where the plan's memory model
    has it leave the device, and returns the copy in its place: nothing on the device holds the
    storage after that. The backward brings it back (``_host_memory.RELOAD``, in its layout)
    ``prefetch`` ops before the first op that reads it, as the plan schedules reloads, and its
    readers read the reloaded tensor. Raises ``PartitionMismatch`` if a name is not among the
    forward's saved values."""
    if not offloaded:
        return
    output = forward.graph.output_node()
    outputs = list(output.args[0])  # type: ignore[arg-type]  # a graph returns a tuple
    last_reads = _last_storage_reads(forward.graph)
    placeholders = {node.name: node for node in backward.graph.find_nodes(op="placeholder")}
    moved = set()
    for index in range(num_fwd_outputs, len(outputs)):
        node = outputs[index]
        if isinstance(node, fx.Node) and node.name in offloaded and node.name not in moved:
            if node.name not in placeholders:
                raise PartitionMismatch(
                    f"the backward does not read the offloaded saved value `{node.name}`"
                )
            outputs[index] = _copy_to_host(forward.graph, node, last_reads)
            _reload_before_first_read(backward.graph, placeholders[node.name], prefetch)
            moved.add(node.name)
    output.args = (tuple(outputs),)
    if moved != offloaded:
        raise PartitionMismatch(
            f"the plan offloads {sorted(offloaded - moved)}, which the compiled forward does "
            "not save"
        )


def _last_storage_reads(graph: fx.Graph) -> Callable[[fx.Node], fx.Node]:
    """For a node of ``graph``, the op after which the device may free its storage: the op
    after the last op that reads it through any node sharing the storage (the node itself when
    nothing reads it), as the planner's memory model counts a storage's reads; the last op
    before the output where that is the output."""
    from torch.multiprocessing.reductions import StorageWeakRef

    ops = _ops(graph)
    position = {node: k for k, node in enumerate(ops)}
    sharing: dict[Any, list[fx.Node]] = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            sharing.setdefault(StorageWeakRef(value.untyped_storage()), []).append(node)

    def after_last_read(node: fx.Node) -> fx.Node:
        value = node.meta.get("val")
        aliases = (
            sharing[StorageWeakRef(value.untyped_storage())]
            if isinstance(value, torch.Tensor) else [node]
        )
        reads = [position[user] for alias in aliases for user in alias.users if user in position]
        last = max([*reads, *(position[a] for a in aliases if a in position)], default=-1)
        return ops[min(last + 1, len(ops) - 1)]

    return after_last_read


def _fake_result(op: torch._ops.OpOverload, node: fx.Node, *args: Any) -> Any:
    """What ``op`` returns for the fake tensor of ``node`` (None where it has none), the
    metadata a node of ``op`` reading it carries."""
    from torch._guards import detect_fake_mode

    value = node.meta.get("val")
    mode = detect_fake_mode((value,)) if isinstance(value, torch.Tensor) else None
    if mode is None:
        return None
    with mode:
        return op(value, *args)


def _copy_to_host(
    graph: fx.Graph, node: fx.Node, after_last_read: Callable[[fx.Node], fx.Node]
) -> fx.Node:
    """A node copying ``node`` to host memory, placed after its storage's last forward read."""
    anchor = after_last_read(node)
    with graph.inserting_after(anchor):
        copy = graph.call_function(host_memory.OFFLOAD, (node,))
    copy.meta["val"] = _fake_result(host_memory.OFFLOAD, node)
    return copy


def _reload_before_first_read(graph: fx.Graph, placeholder: fx.Node, prefetch: int) -> None:
    """Makes the backward read ``placeholder`` (now a host copy) through a reload placed
    ``prefetch`` ops before its first reader (at the start at the earliest)."""
    ops = _ops(graph)
    readers = set(placeholder.users)
    first = next((k for k, node in enumerate(ops) if node in readers), len(ops))
    at = max(first - prefetch, 0)
    before = ops[at] if at < len(ops) else graph.output_node()
    on_device = placeholder.meta.get("val")
    if not isinstance(on_device, torch.Tensor) or not host_memory.movable(on_device):
        raise PartitionMismatch(
            f"the offloaded saved value `{placeholder.name}` is not a tensor the host copy holds"
        )
    stride = list(on_device.stride())
    if not all(type(size) is int for size in stride):
        raise NotImplementedError(
            f"the offloaded saved value `{placeholder.name}` has symbolic strides {stride}: "
            "the stage offloads tensors of static shapes only (compile with dynamic=False, or "
            "plan without offload)"
        )
    with graph.inserting_before(before):
        reload = graph.call_function(host_memory.RELOAD, (placeholder, on_device.device, stride))
    placeholder.replace_all_uses_with(reload, delete_user_cb=lambda user: user is not reload)
    reload.meta["val"] = on_device
    # A new dict: the placeholder's may be shared with the joint graph's node.
    placeholder.meta = {**placeholder.meta, "val": _fake_result(host_memory.OFFLOAD, placeholder)}


def _marker_names(plan: Plan) -> list[str]:
    return [name for name, op in plan.node_ops.items() if op == markers.MARKER_OP]


# --------------------------------------------------------------------------------------------
# The stage

PARTITIONERS = ("plan", "min-cut")


class PlanningStage(CustomGraphPass):
    """Plans each joint graph it sees and partitions it from the plan (or tags it for torch's
    min-cut partitioner).

    ``models`` declares the graph's models, layers and units (``ModelDecl``, as for
    ``export``; ``recompute_planner.annotate`` returns them for a module it annotated);
    ``partitioner`` is ``"plan"`` or ``"min-cut"`` (see the module docstring); the other
    options are those of ``recompute_planner.plan``. ``plans`` collects the plan of every
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
        budget_offload: bool = False,
        offload: str | Iterable[str] | None = None,
        offload_kinds: str | Iterable[str] | None = None,
        offload_prefetch: int = 4,
        hw: HwLike = None,
        name: str = "compiled",
        partitioner: str = "plan",
    ):
        if partitioner not in PARTITIONERS:
            raise ValueError(
                f"partitioner {partitioner!r}: use one of {', '.join(map(repr, PARTITIONERS))}"
            )
        if partitioner == "min-cut" and (offload or offload_kinds or budget_offload):
            raise ValueError(
                "offload (offload=, offload_kinds=, budget_offload=) needs the plan "
                'partitioner, which places the copies to host memory and back: torch\'s '
                'min-cut partitioner keeps every saved value on the device; use partitioner="plan"'
            )
        if partitioner == "plan" and random_ops == "replay":
            raise ValueError(
                'random_ops="replay" needs an executor that restores the generator state of '
                'each replayed random op; the plan partitioner does not: use random_ops="save" '
                'or partitioner="min-cut"'
            )
        self.models = list(models)
        # `recompute_planner.plan` with the stage's options.
        self.plan_graph = functools.partial(
            plan_graph,
            keep=keep,
            executor=EXECUTOR,
            recompute_ratio=recompute_ratio,
            collectives=collectives,
            random_ops=random_ops,
            budget=budget,
            granularity=granularity,
            budget_offload=budget_offload,
            offload=offload,
            offload_kinds=offload_kinds,
            offload_prefetch=offload_prefetch,
            hw=hw,
        )
        self.name = name
        self.partitioner = partitioner
        self.plans: list[Plan] = []
        # What traces made for this stage record (``markers.STAGE_KEY``) and Dynamo guards on:
        # one number per distinct configuration, so installing a stage that plans otherwise
        # retraces a compiled step once, and one that plans alike does not.
        self.number = _STAGE_NUMBERS.setdefault(
            repr((self.models, keep, partitioner, name, recompute_ratio, collectives,
                  random_ops, budget, granularity, budget_offload, offload, offload_kinds,
                  offload_prefetch, hw)),
            len(_STAGE_NUMBERS) + 1,
        )

    def plan_joint(
        self, graph_module: fx.GraphModule, num_fwd_outputs: int | None = None
    ) -> tuple[BuiltGraph, Plan]:
        """Converts and plans ``graph_module``'s joint graph as it is; returns its IR as built
        (``.graph`` parses the message) and its plan (issuing the plan's diagnostics)."""
        ir = build_joint_graph(
            graph_module, self.models, name=self.name, num_fwd_outputs=num_fwd_outputs
        )
        planned = self.plan_graph(ir.plannable, check=False)
        self.plans.append(planned)
        check_plan(planned, stacklevel=3)
        return ir, planned

    def apply(self, graph_module: fx.GraphModule, num_fwd_outputs: int | None = None) -> Plan:
        """For torch's min-cut partitioner: eliminates common subexpressions as it will, then
        converts, plans and tags ``graph_module``'s joint graph, and drops its markers."""
        eliminate_common_subexpressions(graph_module)
        ir, planned = self.plan_joint(graph_module, num_fwd_outputs)
        tag_joint_graph(graph_module.graph, ir.graph, planned)
        if remove_markers(graph_module.graph):
            graph_module.recompile()
        return planned

    # The inductor joint-graph pass (partitioner="min-cut") ----------------------------------

    def __call__(self, graph: fx.Graph) -> None:
        if graph.owning_module is None:
            raise RuntimeError("the joint-graph pass got a graph without its GraphModule")
        self.apply(graph.owning_module)

    def uuid(self) -> None:
        """No FX graph caching: a cached compile would skip planning and its diagnostics."""
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanningStage:
        """Inductor copies its config per compile: the copy must be this stage, which collects
        the plans."""
        return self

    # The partition_fn -----------------------------------------------------------------------

    def partition_fn(
        self,
        joint_module: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        **kwargs: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """A ``partition_fn`` for ``aot_autograd`` (and inductor's partitioner): plans the joint
        graph and partitions it from the plan, or tags it and runs torch's min-cut
        partitioner."""
        if self.partitioner == "plan":
            _, planned = self.plan_joint(joint_module, num_fwd_outputs)
            return partition_from_plan(joint_module, planned, num_fwd_outputs=num_fwd_outputs)
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.apply(joint_module, num_fwd_outputs)
        return min_cut_rematerialization_partition(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
        )

    # The inductor backend that plans the exported graph -------------------------------------

    def backend(
        self, graph_module: fx.GraphModule, example_inputs: Any, **compile_fx_options: Any
    ) -> Any:
        """A ``torch.compile`` backend: inductor, partitioned by this stage, on the joint graph
        ``recompute_planner.export`` exports: AOTAutograd traces it without inductor's
        decompositions and inductor's joint-graph passes are off, so the plan is the CLI's
        plan of the exported step; inductor then lowers each half, running the ops it has no
        lowering for as ATen fallbacks. (Plain ``torch.compile`` with the stage installed
        plans the graph inductor decomposed: other ops, another plan.) Trace inside
        ``install`` or ``planning``, which let markers into compiled graphs.
        ``compile_fx_options`` go to inductor's ``compile_fx`` (``inner_compile``: the
        compiler of each half)."""
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        patches = {
            "use_joint_graph_passes": False,
            "custom_partitioner_fn": _InductorPartitioner(self),
            "fx_graph_cache": False,
        }
        inner = _without_ci_fallback_check(
            compile_fx_options.pop("inner_compile", compile_fx_inner)
        )
        with _ci_fallback_check_off():
            return compile_fx(
                graph_module, example_inputs, config_patches=patches, decompositions={},
                inner_compile=inner, **compile_fx_options,
            )

    # Installation ---------------------------------------------------------------------------

    def install(self) -> PlanningStage:
        """Makes this stage inductor's partitioner (or joint-graph pass) and lets markers into
        compiled graphs, until ``uninstall()``."""
        _INSTALLED.add(self)
        return self

    def uninstall(self) -> None:
        """Takes this stage out of inductor; the configuration returns to the most recently
        installed stage still installed, or to what it was before any."""
        _INSTALLED.remove(self)

    @property
    def installed(self) -> bool:
        return self in _INSTALLED.stages

    def __enter__(self) -> PlanningStage:
        return self if self.installed else self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


class _InductorPartitioner(CustomPartitionerFn):
    """A stage as inductor's ``custom_partitioner_fn`` (no uuid: the stage plans every
    compile)."""

    def __init__(self, stage: PlanningStage):
        self.stage = stage

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.stage.partition_fn(gm, joint_inputs, **kwargs)

    def uuid(self) -> None:
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> _InductorPartitioner:
        return self


class _Installed:
    """The installed stages, in install order, and inductor's settings before the first one.

    Inductor's configuration is set from this list alone, so stages can be installed and
    uninstalled in any order: the last stage of the list is the active one, and when the list
    empties the settings saved at the first install come back."""

    SETTINGS = ("custom_partitioner_fn", "joint_custom_post_pass", "fx_graph_cache")

    def __init__(self) -> None:
        self.stages: list[PlanningStage] = []
        self._before: dict[str, Any] = {}
        self._tracing: contextlib.ExitStack | None = None

    def add(self, stage: PlanningStage) -> None:
        if stage in self.stages:
            raise RuntimeError("this planning stage is installed already")
        if not self.stages:
            import torch._inductor.config as inductor_config

            self._before = {key: getattr(inductor_config, key) for key in self.SETTINGS}
            self._tracing = contextlib.ExitStack()
            self._tracing.enter_context(compiled_as_exported(stage.number))
        self.stages.append(stage)
        self._configure()

    def remove(self, stage: PlanningStage) -> None:
        if stage not in self.stages:
            return
        self.stages.remove(stage)
        self._configure()
        if not self.stages and self._tracing is not None:
            self._tracing.close()
            self._tracing = None

    def _configure(self) -> None:
        import torch._inductor.config as inductor_config

        settings = dict(self._before)
        if self.stages:
            active = self.stages[-1]
            # Steps compiled for another stage are traced again (once) for this one.
            markers.set_compiled_stage(active.number)
            # A cached compile would skip planning: inductor bypasses its caches for a joint
            # pass without a uuid, but not for a partitioner without one.
            settings["fx_graph_cache"] = False
            if active.partitioner == "plan":
                settings["custom_partitioner_fn"] = _InductorPartitioner(active)
            else:
                settings["joint_custom_post_pass"] = active
        for key, value in settings.items():
            setattr(inductor_config, key, value)


_INSTALLED = _Installed()
# Each stage configuration's number (``PlanningStage.number``).
_STAGE_NUMBERS: dict[str, int] = {}


def install(
    models: list[ModelDecl], keep: str | Iterable[str] | None = None, **options: Any
) -> PlanningStage:
    """The one line: ``stage = recompute_planner.compile.install(models, keep=[...])``; every
    ``torch.compile`` training step compiled after it saves what the plan saves."""
    return PlanningStage(models, keep, **options).install()


def active_stage() -> PlanningStage | None:
    """The installed stage inductor runs, or None."""
    return _INSTALLED.stages[-1] if _INSTALLED.stages else None


def tracing() -> contextlib.AbstractContextManager[None]:
    """``with tracing():`` around the first call of a step traced without Dynamo
    (``aot_module``, ``aot_function`` with ``partition_fn=stage.partition_fn``) makes the
    traced program the one ``recompute_planner.export`` traces: markers enter the graph, a
    dropout that draws nothing returns its input (eager ATen allocates nothing for it;
    torch's decomposition would ``clone`` it), ``one_hot`` is traced as eager runs it and the
    ops of in-place calls are annotated as such (a torch-function mode, thread-local: trace in
    the thread that entered it). ``install`` and ``planning`` make ``torch.compile`` trace the
    same program without that mode (Dynamo would trace the mode around every op), until the
    stage is uninstalled; under ``torch.compile`` this block is not needed."""
    return traced_as_exported()


@contextlib.contextmanager
def planning(models: list[ModelDecl], keep: str | Iterable[str] | None = None,
             **options: Any) -> Iterator[PlanningStage]:
    """``with planning(models, keep=[...]) as stage:`` installs a stage for the block."""
    require_tracing_torch("the torch.compile planning stage")
    with PlanningStage(models, keep, **options) as stage:
        yield stage


@contextlib.contextmanager
def _ci_fallback_check_off() -> Iterator[None]:
    """Inductor refuses, when the environment variable ``CI`` is set (as on GitHub Actions and
    in this project's CI), to fall back to ATen for an op that has a decomposition: a check
    for PyTorch's own CI that its lowerings decompose what they can. The stage's backend
    traces without decompositions on purpose (so the plan is the exported graph's), so that
    check does not apply while inductor compiles its halves; ``CI`` is hidden meanwhile."""
    hidden = os.environ.pop("CI", None)
    try:
        yield
    finally:
        if hidden is not None:
            os.environ["CI"] = hidden


def _without_ci_fallback_check(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` (inductor's compiler of one half, the backward's called at the first
    backward) run with ``_ci_fallback_check_off``."""

    @functools.wraps(inner)
    def compile_half(*args: Any, **kwargs: Any) -> Any:
        with _ci_fallback_check_off():
            return inner(*args, **kwargs)

    return compile_half


__all__ = [
    "PARTITIONERS",
    "PartitionMismatch",
    "PlanningStage",
    "active_stage",
    "build_joint_graph",
    "install",
    "joint_graph_to_ir",
    "partition_from_plan",
    "planning",
    "remove_markers",
    "tag_joint_graph",
    "tracing",
]
