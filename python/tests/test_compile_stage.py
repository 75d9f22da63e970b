"""The torch.compile planning stage: one graph for the stage and the CLI, and a compiled step
that saves and replays exactly what the plan says.

Each joint zoo golden and each HuggingFace family is compiled with the stage
(`recompute_planner.compile`, traced inside its `tracing()`), once with aot_autograd and once
with inductor, and exported once with the exporter (`rp.export` / `export_joint`); for
`--keep none`, `all` and each unit alone, the stage's plan of the traced joint graph must be
the CLI's plan of the exported graph:

- same saved set by storage (a view stands for its base, a marker for its input), parameters
  and inputs compared by kind and size (the stage sees them as AOTAutograd's placeholders,
  the exporter by their module names), activations by name;
- same replay, layer by layer, op for op and by name; an in-place op of the exported graph
  matches its functional form in the compiled one (torch.compile functionalizes);
- same saved bytes and predicted peak.

Steps whose in-place writes torch functionalizes into other ops (`FUNCTIONALIZED`) are
compared by saved set, saved bytes, peak and each layer's replayed ops in functional form,
whatever their names and order. The stage's IR gives a functionalized write back the storage
eager writes (the exporter annotates the ops of each in-place call as it traces), so where a
kept unit makes a tensor the step later writes in place, both plans replay it with its writers.

And the compiled step itself: the forward graph returns exactly the plan's saved set, the
backward graph re-runs exactly its replay (`partition_from_plan`, no min-cut).

Most cases compile through `aot_module` with the stage's `partition_fn` and no code generation
(seconds per model); the inductor path (`torch.compile` with `backend=stage.backend`) is
traced and partitioned for every golden and family, and compiled to code and run against
eager once. Torch's min-cut partitioner stays an option (`partitioner="min-cut"`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from collections import Counter

import pytest
import torch
import torch._inductor.config as inductor_config
from functorch.compile import aot_module, make_boxed_func
from torch._inductor.output_code import MockFXGraphCacheOutput

import recompute_planner as rp
from export_support import check_builders_agree
from graph_walk import golden_param
from hf_families import FAMILIES, family
from recompute_planner import _host_memory as host_memory
from recompute_planner import compile as stage_mod
from recompute_planner._exporter import ModelDecl
from recompute_planner._zoo.catalog import declared_units, entry, make_inputs, model_decls
from recompute_planner._zoo.goldens import GOLDENS, golden, traced_group
from recompute_planner._zoo.model import CausalLM
from recompute_planner.markers import (
    LAYER_KEY,
    MARKER_NAME_ATTR,
    MARKER_OP,
    MARKER_OVERLOAD,
    MODEL_KEY,
    checkpoint_record,
    layer_scope,
)
from recompute_planner.model_export import _Step
from recompute_planner.proto import graph_pb2

# Compiled and eager steps differ by fused kernels' rounding.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
JOINT = [g.name for g in GOLDENS if g.joint]
INPUT_ROLES = {graph_pb2.ROLE_PARAMETER, graph_pb2.ROLE_BUFFER, graph_pb2.ROLE_INPUT}
# Steps that write tensors they made in place (slice copies into `new_empty` buffers,
# `index_put_` / `index_add_` / `scatter_` into dispatch buffers, the router's `div_` of its
# top-k weights): torch.compile functionalizes the writes, so the stage's graph runs their
# functional forms (`copy_` into a slice becomes `copy` + `slice_scatter`, with its own slices)
# under other node names and in another order. The same values are saved, the same peak
# holds, and each layer replays the same ops in functional form (compared as a multiset, the
# write-backs functionalization adds aside).
FUNCTIONALIZED = {"moe_ep2_inplace", "moe_hf_router", "dsv3_kv_expand", "mixtral"}
# What functionalization adds for a write into a view: `copy_` into a slice becomes `copy` of
# the slice and this op, which writes the copy back into the base.
WRITE_BACK = "aten.slice_scatter.default"


class Recording(stage_mod.PlanningStage):
    """The stage, keeping the IR of each graph it planned and the graphs it partitioned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.irs: list[graph_pb2.Graph] = []

    def plan_joint(self, graph_module, num_fwd_outputs=None):
        ir, planned = super().plan_joint(graph_module, num_fwd_outputs)
        self.irs.append(ir.graph)
        return ir, planned

    def partition_fn(self, joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        self.fw, self.bw = super().partition_fn(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
        )
        self.num_fwd_outputs = num_fwd_outputs
        return self.fw, self.bw

    @property
    def plan(self) -> rp.Plan:
        return self.plans[-1]


# --------------------------------------------------------------------------------------------
# Ways to compile a step


def nop_compiler(graph_module, _inputs):
    return make_boxed_func(graph_module.forward)


def stop_after_partition(graph_module, _inputs, **_kwargs):
    """Inductor's inner compiler without code generation: the partition is all these tests
    need from inductor, and the step runs its partitioned forward graph as it is. Raising here
    instead would leave every later frame of the process called through Dynamo's frame hook
    (Dynamo gives up on a thread whose compile raised): an argument then lives until the
    callee returns, and an export's eager probe in the same process observes it."""
    return MockFXGraphCacheOutput(gm=make_boxed_func(graph_module.forward))


def run_aot(stage: stage_mod.PlanningStage, module: torch.nn.Module, inputs: tuple) -> None:
    """One training step through `aot_module` with the stage's partition_fn, no codegen."""
    compiled = aot_module(
        module, fw_compiler=nop_compiler, bw_compiler=nop_compiler,
        partition_fn=stage.partition_fn,
    )
    compiled(*inputs).backward()


def run_inductor_partition(stage, module: torch.nn.Module, inputs: tuple) -> None:
    """`torch.compile(module, backend=stage.backend)` traced and partitioned, no codegen."""
    backend = functools.partial(stage.backend, inner_compile=stop_after_partition)
    torch._dynamo.reset()
    with stage:
        torch.compile(module, backend=backend)(*inputs)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# Subjects: zoo goldens and HuggingFace families


@dataclasses.dataclass
class Subject:
    """A step to compile and export: the module, its positional tensor inputs, its models."""

    module: torch.nn.Module
    inputs: tuple
    models: list
    world_size: int = 1

    def exported_graph(self) -> graph_pb2.Graph:
        from recompute_planner._exporter import export_joint

        with traced_group(self.world_size):
            return export_joint(
                self.module, self.inputs, name="exported", models=self.models,
                world_size=self.world_size,
            ).graph

    def staged(self, keep, run, **options) -> Recording:
        """The step compiled by ``run`` with the stage. ``aot_module`` traces without Dynamo,
        inside ``tracing()``; ``torch.compile`` traces as the installed stage makes it (no
        torch-function mode)."""
        stage = Recording(self.models, keep, **options)
        as_exported = stage_mod.tracing() if run is run_aot else contextlib.nullcontext()
        with traced_group(self.world_size), warnings.catch_warnings(), as_exported:
            warnings.simplefilter("ignore", rp.PlannerWarning)
            run(stage, self.module, self.inputs)
        return stage


def golden_subject(name: str) -> Subject:
    cfg = entry(name).config
    return Subject(CausalLM(cfg), make_inputs(cfg), model_decls(cfg), cfg.world_size)


def family_subject(name: str) -> Subject:
    fam = family(name)
    model = fam.model()
    models = rp.annotate(model, layers="model.layers", units=fam.units).models
    step = _Step(model, None, (), fam.inputs())
    return Subject(step, step.tensors(), models)


def quiet_plan(graph, keep) -> rp.Plan:
    """The plan of ``graph`` for the executor the stage plans for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, executor=stage_mod.EXECUTOR, check=False)


SUBJECTS = {"golden": golden_subject, "family": family_subject}


# --------------------------------------------------------------------------------------------
# What "the same plan" is


def storage_bases(ir: graph_pb2.Graph):
    """value -> the value whose storage it is: through views and markers, to the base."""
    producers = {v: n for n in ir.nodes for v in n.outputs}

    def base(value: str) -> str:
        node = producers.get(value)
        while node is not None and (node.schema.HasField("view_of") or node.op == MARKER_OP):
            value = node.inputs[node.schema.view_of if node.op != MARKER_OP else 0]
            node = producers.get(value)
        return value

    return base


def saved_by_storage(ir: graph_pb2.Graph, plan: rp.Plan) -> tuple[set[str], Counter]:
    """The plan's saved activations by storage base, and its saved inputs (parameters,
    buffers, data) as a count of (kind, bytes)."""
    base = storage_bases(ir)
    inputs = {v.name for v in ir.values if v.role in INPUT_ROLES}
    activations, by_size = set(), Counter()
    for saved in plan.saved:
        root = base(saved.value)
        if root in inputs:
            by_size[(saved.kind, saved.bytes)] += 1
        else:
            activations.add(root)
    return activations, by_size


def functional_op(op: str) -> str:
    """An in-place op's functional form (`aten.index_put_.default` -> `aten.index_put...`)."""
    namespace, name, overload = op.split(".")
    return f"{namespace}.{name.removesuffix('_')}.{overload}"


def replay_by_layer(plan: rp.Plan) -> dict[tuple[str, int], list[str]]:
    """Each layer's replayed nodes in forward order, over the steps its replay comes in."""
    position = {node.name: k for k, node in enumerate(plan.nodes)}
    layers: dict[tuple[str, int], list[str]] = {}
    for r in plan.replay:
        layers.setdefault((r.model, r.layer), []).extend(r.nodes)
    return {layer: sorted(nodes, key=position.__getitem__) for layer, nodes in layers.items()}


def replay_ops(plan: rp.Plan) -> dict[tuple[str, int], list[str]]:
    return {
        layer: [functional_op(plan.decision(n).op) for n in nodes]
        for layer, nodes in replay_by_layer(plan).items()
    }


def replay_names(
    ir: graph_pb2.Graph, plan: rp.Plan, written_in_place: set[str]
) -> dict[tuple[str, int], set[str]]:
    """Each layer's replayed nodes by name, but for the ops ``written_in_place`` names in their
    functional form (functionalization renames ``index_put_`` nodes ``index_put``), and a
    marker by its marker name and occurrence in the layer: the stage places the markers of
    annotated submodules after Dynamo traced the step, so FX numbers their nodes otherwise
    (a trace also counts the markers on outputs nothing reads, which it drops)."""
    labels = marker_labels(ir)
    return {
        layer: {
            labels.get(n, n) for n in nodes
            if functional_op(plan.decision(n).op) not in written_in_place
        }
        for layer, nodes in replay_by_layer(plan).items()
    }


def marker_labels(ir: graph_pb2.Graph) -> dict[str, str]:
    """Marker node -> ``<marker name>#<occurrence in its layer>``."""
    seen: Counter = Counter()
    labels = {}
    for node in ir.nodes:
        if node.op == MARKER_OP:
            name = next(a.str for a in node.attributes if a.name == MARKER_NAME_ATTR)
            key = (node.model, node.layer, name)
            labels[node.name] = f"{name}#{seen[key]}"
            seen[key] += 1
    return labels


def assert_same_plan(stage_ir, planned: rp.Plan, exported_ir, exported: rp.Plan) -> None:
    assert_same_memory(stage_ir, planned, exported_ir, exported)
    assert replay_ops(planned) == replay_ops(exported)
    in_place = {functional_op(n.op) for n in exported_ir.nodes if n.schema.mutates}
    assert replay_names(stage_ir, planned, in_place) == replay_names(
        exported_ir, exported, in_place
    )


def assert_same_functional_plan(
    stage_ir, planned: rp.Plan, exported_ir, exported: rp.Plan
) -> None:
    """The plan of a functionalized step: same memory, and each layer replays the same ops in
    functional form (write-backs aside), whatever their names and order."""
    assert_same_memory(stage_ir, planned, exported_ir, exported)
    assert replay_op_counts(planned) == replay_op_counts(exported)


def replay_op_counts(plan: rp.Plan) -> dict[tuple[str, int], Counter]:
    """Each layer's replayed ops in functional form, counted, ``WRITE_BACK`` left out."""
    return {
        layer: Counter(op for op in ops if op != WRITE_BACK)
        for layer, ops in replay_ops(plan).items()
    }


def assert_same_memory(stage_ir, planned: rp.Plan, exported_ir, exported: rp.Plan) -> None:
    """Same saved set by storage, same saved bytes, same predicted peak."""
    assert saved_by_storage(stage_ir, planned) == saved_by_storage(exported_ir, exported)
    assert planned.memory.saved_bytes == exported.memory.saved_bytes
    assert planned.memory.peak_bytes == exported.memory.peak_bytes


def assert_saves_and_replays_the_plan(staged: Recording) -> None:
    """The forward graph returns the plan's saved set, the backward re-runs its replay."""
    base = storage_bases(staged.irs[-1])
    tangents = {v.name for v in staged.irs[-1].values if v.role == graph_pb2.ROLE_TANGENT}
    planned = {base(v) for v in staged.plan.saved_values()} - tangents
    outputs = staged.fw.graph.output_node().args[0][staged.num_fwd_outputs :]
    assert {base(n.name) for n in outputs} == planned
    forward_ops = {n.name for n in staged.plan.nodes if n.op != MARKER_OP}
    replayed = {
        n.name for n in staged.bw.graph.nodes
        if n.op == "call_function" and n.name in forward_ops
    }
    assert replayed == {n for r in staged.plan.replay for n in r.nodes} & forward_ops
    assert not [n for n in staged.fw.graph.nodes if n.target is MARKER_OVERLOAD]


# --------------------------------------------------------------------------------------------
# One graph: the stage's plan is the CLI's plan of the exported step, for every keep


# Ways to compile a step: aot_autograd (aot_module, boxed no-op compilers) and inductor
# (torch.compile with the stage's backend, stopped after the partition).
RUNS = {"aot": run_aot, "inductor": run_inductor_partition}


def keeps(units) -> list:
    """``--keep none``, ``all`` and each unit alone."""
    return [None, "all", *([u] for u in units)]


def keep_label(keep) -> str:
    return "none" if keep is None else keep if isinstance(keep, str) else ",".join(keep)


@functools.cache
def exported_graph(kind: str, name: str) -> graph_pb2.Graph:
    """The exported step of a golden or a family, exported once for every test."""
    return SUBJECTS[kind](name).exported_graph()


@functools.cache
def staged_step(kind: str, name: str, backend: str) -> Recording:
    """A golden or family compiled once per backend with the stage (``--keep all``); the
    traced joint graph's IR does not depend on the keep, so each keep's stage plan is the plan
    of ``irs[-1]``. The graph the stage plans is built by the native builder and the Python
    one alike (``check_builders_agree``)."""
    with pytest.MonkeyPatch.context() as patch:
        built = check_builders_agree(patch)
        staged = SUBJECTS[kind](name).staged("all", RUNS[backend])
    assert built, "the stage built no graph"
    return staged


def assert_stage_plans_the_exported_step(kind: str, name: str, backend: str, keep) -> None:
    """The stage's plan of the traced step (the plan it made, for ``all``) is the CLI's plan
    of the exported step: same saved set by storage, same replay, same saved bytes and peak."""
    staged = staged_step(kind, name, backend)
    stage_ir, exported_ir = staged.irs[-1], exported_graph(kind, name)
    planned = staged.plan if keep == "all" else quiet_plan(stage_ir, keep)
    same = assert_same_functional_plan if name in FUNCTIONALIZED else assert_same_plan
    same(stage_ir, planned, exported_ir, quiet_plan(exported_ir, keep))


def golden_keep_cases():
    """(golden, backend, keep) for every joint golden, both backends, every keep."""
    for name in JOINT:
        for backend in RUNS:
            for keep in keeps(golden_keep_units(name)):
                yield golden_param(name, backend, keep, id=f"{backend}-{name}-{keep_label(keep)}")


def golden_keep_units(name: str) -> list[str]:
    return list(declared_units(golden(name).entry.config))


def family_keep_cases():
    """(family, backend, keep) for every HF family, both backends, every keep."""
    for fam in FAMILIES:
        for backend in RUNS:
            for keep in keeps(fam.units):
                label = keep_label(keep)
                yield pytest.param(fam.name, backend, keep, id=f"{backend}-{fam.name}-{label}")


@pytest.mark.parametrize(("name", "backend", "keep"), list(golden_keep_cases()))
def test_stage_plan_of_a_golden_step_is_the_cli_plan_of_its_export(name, backend, keep):
    assert_stage_plans_the_exported_step("golden", name, backend, keep)


@pytest.mark.parametrize(("name", "backend", "keep"), list(family_keep_cases()))
def test_stage_plan_of_a_hf_step_is_the_cli_plan_of_its_export(name, backend, keep):
    assert_stage_plans_the_exported_step("family", name, backend, keep)


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize("name", [golden_param(name, id=name) for name in JOINT])
def test_compiled_golden_step_saves_and_replays_the_stage_plan(name, backend):
    assert_saves_and_replays_the_plan(staged_step("golden", name, backend))


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_compiled_hf_step_saves_and_replays_the_stage_plan(name, backend):
    assert_saves_and_replays_the_plan(staged_step("family", name, backend))


@pytest.mark.parametrize("backend", list(RUNS))
def test_dropout_that_draws_nothing_is_traced_as_its_input(backend):
    """HF eager attention calls dropout with p=0: traced inside the stage's ``tracing()``, the
    step makes no copy of the attention probabilities (torch's decomposition would clone
    them), so the stage traces the exporter's program, op for op."""
    staged = staged_step("family", "llama_eager_attn", backend)
    exported = exported_graph("family", "llama_eager_attn")
    assert [n.op for n in staged.irs[-1].nodes] == [n.op for n in exported.nodes]


def forward_writes(ir: graph_pb2.Graph) -> Counter:
    """The forward's in-place writes and views, counted by op (in-place ops by their
    functional form, write-backs aside)."""
    return Counter(
        (functional_op(n.op), "writes") if n.schema.mutates else (n.op, "view")
        for n in ir.nodes
        if n.phase == graph_pb2.PHASE_FORWARD
        and (n.schema.mutates or n.schema.HasField("view_of"))
        and n.op != WRITE_BACK
    )


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize(
    ("kind", "name"),
    [("golden", name) for name in sorted(FUNCTIONALIZED & set(JOINT))]
    + [("family", f.name) for f in FAMILIES if f.name in FUNCTIONALIZED],
)
def test_stage_ir_writes_in_place_what_the_exported_step_writes_in_place(kind, name, backend):
    """Functionalization turns a step's in-place writes into new tensors (``div_`` into
    ``div``, ``copy_`` into a slice into ``copy`` and ``slice_scatter``); the stage's IR gives
    each write back the storage eager writes, so its forward writes and views are the
    exported step's, op for op, and its write-backs are views of their bases."""
    stage_ir = staged_step(kind, name, backend).irs[-1]
    assert forward_writes(stage_ir) == forward_writes(exported_graph(kind, name))
    write_backs = [n for n in stage_ir.nodes if n.op == WRITE_BACK]
    assert all(n.schema.view_of == 0 for n in write_backs)


class WritingLayer(torch.nn.Module):
    """A layer that writes in place as user code does: its gate's kept output with
    ``masked_fill_`` and ``mul_`` (outside the unit; ``abs``, whose backward reads its input,
    not the output written over), a slice of a fresh buffer by item assignment (whose backward
    autograd computes by writing into a new buffer)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.gate, self.proj = torch.nn.Linear(16, 8), torch.nn.Linear(8, 16)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        with layer_scope("main", self.index):
            gate_in = checkpoint_record("gate.begin", x)
            weights = checkpoint_record("gate.end", self.gate(gate_in).abs())
            weights.masked_fill_(weights < 0.1, 0.0)
            weights.mul_(2.0)
            x = x + self.proj(weights)
            up = self.up(checkpoint_record("mlp.begin", x)).relu()
            buffer = torch.zeros_like(up)
            buffer[:, :, :16] = up[:, :, :16]
            return x + checkpoint_record("mlp.end", self.down(buffer))


class WritingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([WritingLayer(i) for i in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("backend", list(RUNS))
def test_stage_plans_in_place_writes_of_a_model_outside_the_zoo_as_the_cli(backend):
    torch.manual_seed(0)
    units = {"SAVE_GATE": [("gate.begin", "gate.end")], "SAVE_MLP": [("mlp.begin", "mlp.end")]}
    subject = Subject(WritingModel(), (torch.randn(4, 8, 16),), [ModelDecl("main", 2, units)])
    staged = subject.staged("all", RUNS[backend])
    stage_ir, exported_ir = staged.irs[-1], subject.exported_graph()
    assert forward_writes(stage_ir) == forward_writes(exported_ir)
    for keep in keeps(units):
        planned = staged.plan if keep == "all" else quiet_plan(stage_ir, keep)
        assert_same_functional_plan(stage_ir, planned, exported_ir, quiet_plan(exported_ir, keep))
    assert_saves_and_replays_the_plan(staged)


def compiled_under_stages(model, models, x):
    """``model`` compiled afresh (Dynamo reset, counters cleared) with a backend that
    partitions by the active stage; returns ``keep -> (graphs Dynamo traced so far, plans)``
    after two steps under a stage planning ``models`` with ``keep``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    def active_stage_backend(graph_module, example_inputs):
        partition = stage_mod.active_stage().partition_fn
        compile_with = aot_autograd(
            fw_compiler=nop_compiler, bw_compiler=nop_compiler, partition_fn=partition
        )
        return compile_with(graph_module, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=active_stage_backend)

    def traced_graphs_after_two_steps(keep):
        with stage_mod.planning(models, keep) as stage, warnings.catch_warnings():
            warnings.simplefilter("ignore", rp.PlannerWarning)
            for _ in range(2):
                compiled(x).backward()
        return counters["stats"]["unique_graphs"], stage.plans

    return traced_graphs_after_two_steps


def test_a_compiled_step_is_traced_again_once_for_a_stage_that_plans_otherwise():
    """A step compiled while one stage was installed is traced again, exactly once, when a
    stage with other options is installed (its plan differs: the old compiled code would
    silently keep the old plan), and not again for later calls with the same shapes, nor for
    a stage that plans alike."""
    torch.manual_seed(0)
    units = {"SAVE_GATE": [("gate.begin", "gate.end")], "SAVE_MLP": [("mlp.begin", "mlp.end")]}
    models, x = [ModelDecl("main", 2, units)], torch.randn(4, 8, 16)
    traced_graphs_after_two_steps = compiled_under_stages(WritingModel(), models, x)
    try:
        assert traced_graphs_after_two_steps(None)[0] == 1
        graphs, mlp_plans = traced_graphs_after_two_steps(["SAVE_MLP"])
        assert graphs == 2 and len(mlp_plans) == 1
        assert [(u.unit, u.kept_ops > 0) for u in mlp_plans[0].units] == [("SAVE_MLP", True)]
        assert traced_graphs_after_two_steps(None) == (2, [])
        with stage_mod.planning(models, None):  # a stage installed over another one
            graphs, gate_plans = traced_graphs_after_two_steps(["SAVE_GATE"])
        assert graphs == 3 and [u.unit for u in gate_plans[0].units] == ["SAVE_GATE"]
    finally:
        torch._dynamo.reset()


class AnnotatedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)
        )

    def forward(self, x):
        return x + self.mlp(x.tanh())


class AnnotatedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([AnnotatedLayer() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def test_an_annotated_step_is_traced_again_once_per_stage_and_its_units_are_marked():
    """An ``rp.annotate``d model, whose unit markers the stage places after Dynamo: a second
    call does not trace again, a stage that plans otherwise traces once more, and the unit
    the stage keeps is found in the compiled step (its ops are kept)."""
    torch.manual_seed(0)
    model, x = AnnotatedModel(), torch.randn(4, 8, 16)
    models = rp.annotate(model, layers="layers", units={"SAVE_MLP": ["mlp"]}).models
    traced_graphs_after_two_steps = compiled_under_stages(model, models, x)
    try:
        assert traced_graphs_after_two_steps(None)[0] == 1
        graphs, plans = traced_graphs_after_two_steps(["SAVE_MLP"])
        assert graphs == 2 and len(plans) == 1
        assert [(u.unit, u.kept_ops > 0) for u in plans[0].units] == [("SAVE_MLP", True)]
        assert traced_graphs_after_two_steps(None) == (2, [])
    finally:
        torch._dynamo.reset()


def traced_forward(model: torch.nn.Module, x: torch.Tensor):
    """``model`` compiled afresh with a backend that records each graph Dynamo traced; returns
    (the compiled model, the graphs), after one call with ``x``."""
    graphs: list[torch.fx.GraphModule] = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording)
    compiled(x)
    return compiled, graphs


def traced_scopes_then_removed(model: torch.nn.Module, annotation) -> set[tuple[str, int]]:
    """The (model, layer) scopes in the graph Dynamo traces of annotated ``model``'s forward;
    the annotation is removed afterwards."""
    try:
        _, graphs = traced_forward(model, torch.randn(4, 8, 16))
        return scopes_in(graphs[0])
    finally:
        annotation.remove()
        torch._dynamo.reset()


def scopes_in(graph: torch.fx.GraphModule) -> set[tuple[str, int]]:
    return {
        (node.meta["custom"][MODEL_KEY], node.meta["custom"][LAYER_KEY])
        for node in graph.graph.nodes
        if MODEL_KEY in node.meta.get("custom", {})
    }


def test_compiled_code_of_an_annotated_model_guards_on_no_layer_scope_value():
    """Dynamo runs the read of each layer's scope instead of tracing it: the compiled code
    guards on no annotation state and no key of a scope (per-layer guards made compiling an
    annotated model about 15% slower), and the traced ops still carry every layer's scope."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = AnnotatedModel()
    annotation = rp.annotate(model, layers="layers", units={"SAVE_MLP": ["mlp"]})
    try:
        _, graphs = traced_forward(model, torch.randn(4, 8, 16))
        [entry] = _debug_get_cache_entry_list(AnnotatedModel.forward.__code__)
        guards = str(entry.guard_manager).splitlines()
        assert [line for line in guards if "_scope_epoch" in line]  # what it guards on instead
        assert not [line for line in guards if "_recompute_planner_annotated" in line]
        assert not [line for line in guards if LAYER_KEY in line or MODEL_KEY in line]
        assert scopes_in(graphs[0]) == {("main", 0), ("main", 1)}
    finally:
        annotation.remove()
        torch._dynamo.reset()


def test_code_compiled_before_a_layer_scope_changed_is_traced_again():
    """A module that keeps its annotated class while its scope changes (a unit of one
    annotation, the layer of another, re-annotated under another name) has its compiled code
    traced again, with the new scope: the guard on the scopes' epoch catches what the
    unguarded scope read cannot."""
    model, x = AnnotatedModel(), torch.randn(4, 8, 16)
    outer = rp.annotate(model, layers="layers", units={"SAVE_MLP": ["mlp"]})
    inner = rp.annotate(model.layers[0], layers="mlp", name="inner")
    try:
        compiled, graphs = traced_forward(model, x)
        assert ("inner", 0) in scopes_in(graphs[0])
        inner.remove()
        inner = rp.annotate(model.layers[0], layers="mlp", name="renamed")
        compiled(x)
        assert len(graphs) == 2
        assert ("renamed", 0) in scopes_in(graphs[1]) and ("inner", 0) not in scopes_in(graphs[1])
    finally:
        inner.remove()
        outer.remove()
        torch._dynamo.reset()


def test_a_layer_whose_forward_a_framework_replaced_keeps_its_scope_under_dynamo():
    """A layer whose forward is replaced on the instance (accelerate's hooks) is annotated
    around that forward, and its ops carry its scope in the graph Dynamo traces too."""
    model = AnnotatedModel()
    for layer in model.layers:
        layer.forward = functools.partial(AnnotatedLayer.forward, layer)
    annotation = rp.annotate(model, layers="layers", units={"SAVE_MLP": ["mlp"]})
    assert traced_scopes_then_removed(model, annotation) == {("main", 0), ("main", 1)}


def test_a_layer_subclassed_by_a_framework_is_annotated_again_after_remove():
    """A layer whose class a framework replaced by a subclass after the annotation (as FSDP2's
    ``fully_shard`` does) keeps its annotated forward after ``remove``; annotating its model
    again works, and the traced ops carry the new scope."""
    model = AnnotatedModel()
    rp.annotate(model, layers="layers").remove()
    first = rp.annotate(model, layers="layers")
    for layer in model.layers:
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    first.remove()
    again = rp.annotate(model, layers="layers", name="again")
    assert traced_scopes_then_removed(model, again) == {("again", 0), ("again", 1)}


def test_a_strict_export_of_an_annotated_model_carries_each_layers_scope():
    """``torch.export`` traces the scope's read (it cannot run it as Dynamo does)."""
    model = AnnotatedModel()
    annotation = rp.annotate(model, layers="layers", units={"SAVE_MLP": ["mlp"]})
    try:
        exported = torch.export.export(model, (torch.randn(4, 8, 16),), strict=True)
        assert scopes_in(exported.graph_module) == {("main", 0), ("main", 1)}
    finally:
        annotation.remove()


def test_whole_layer_recompute_follows_the_plan():
    subject = golden_subject("moe_ep2")
    for keep in (None, ["SAVE_MOE_DISPATCH"]):
        staged = subject.staged(keep, run_aot)
        assert_saves_and_replays_the_plan(staged)
        exported_ir = exported_graph("golden", "moe_ep2")
        assert_same_plan(staged.irs[-1], staged.plan, exported_ir, quiet_plan(exported_ir, keep))


def eager_step(model: torch.nn.Module, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(*inputs)
    return loss.detach(), list(torch.autograd.grad(loss, list(model.parameters())))


def assert_same_step(compiled: tuple, eager: tuple) -> None:
    torch.testing.assert_close(compiled[0], eager[0], rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_inductor_step_from_the_plan_matches_eager():
    """`torch.compile(model, backend=stage.backend)` compiled to code and run: the plan's
    saved set and replay, and loss and gradients as eager's."""
    cfg = entry("dense").config
    inputs = make_inputs(cfg)
    stage = Recording(model_decls(cfg), "all")
    torch._dynamo.reset()
    with stage:
        step = eager_step(torch.compile(CausalLM(cfg), backend=stage.backend), inputs)
    assert len(stage.plans) == 1
    assert_saves_and_replays_the_plan(stage)
    assert_same_step(step, eager_step(CausalLM(cfg), inputs))


class DictOutput(torch.nn.Module):
    """A model whose step returns a dict, the loss not first."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs)
        return {"logits": out.logits, "loss": out.loss}


def hf_output_subject(form: str) -> tuple[torch.nn.Module, dict, list]:
    """A stock HF Llama whose step returns its loss in ``form``: a ``ModelOutput``
    (``.loss``), a tuple (loss first: ``return_dict=False``) or a dict with ``"loss"``."""
    fam = family("llama")
    model = fam.model()
    models = rp.annotate(model, layers="model.layers", units=fam.units).models
    inputs = fam.inputs()
    if form == "tuple":
        inputs["return_dict"] = False
    return (DictOutput(model) if form == "dict" else model), inputs, models


def loss_of(output):
    if isinstance(output, tuple):
        return output[0]
    return output["loss"] if isinstance(output, dict) else output.loss


@pytest.mark.parametrize("form", ["model_output", "tuple", "dict"])
def test_inductor_stage_takes_the_loss_out_of_a_model_output(form):
    """A stock HF model compiled whole returns its logits beside the loss: the stage plans the
    scalar loss as the step's loss and the logits as an output the caller holds."""
    module, inputs, models = hf_output_subject(form)
    stage = Recording(models, ["SAVE_MLP"])
    backend = functools.partial(stage.backend, inner_compile=stop_after_partition)
    torch._dynamo.reset()
    with stage, warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        torch.compile(module, backend=backend)(**inputs)
    torch._dynamo.reset()
    ir = stage.irs[-1]
    values = {v.name: v for v in ir.values}
    (loss,) = [v for v in ir.values if v.role == graph_pb2.ROLE_LOSS]
    assert list(loss.shape) == [] and ir.outputs[0] == loss.name
    logits = [
        values[name] for name in ir.outputs[1:]
        if values[name].role == graph_pb2.ROLE_ACTIVATION
    ]
    assert [list(v.shape) for v in logits] == [[2, 8, 64]]
    assert_saves_and_replays_the_plan(stage)


def test_compiled_hf_step_returning_a_model_output_matches_eager():
    """`torch.compile(model, backend=stage.backend)(**inputs).loss.backward()` on a stock HF
    Llama, compiled to code: loss, logits and gradients as eager's."""
    module, inputs, models = hf_output_subject("model_output")
    params = list(module.parameters())
    torch._dynamo.reset()
    with rp.compile.planning(models, ["SAVE_MLP"]) as stage, warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        compiled = torch.compile(module, backend=stage.backend)(**inputs)
        grads = torch.autograd.grad(compiled.loss, params)
    torch._dynamo.reset()
    eager = module(**inputs)
    assert len(stage.plans) == 1
    assert_same_step(
        (compiled.loss.detach(), list(grads)),
        (eager.loss.detach(), list(torch.autograd.grad(eager.loss, params))),
    )
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# --------------------------------------------------------------------------------------------
# Torch's min-cut partitioner, as an option


def test_min_cut_option_saves_what_the_plan_saves():
    cfg = entry("moe_ep2").config
    stage = Recording(model_decls(cfg), ["SAVE_MOE_DISPATCH"], partitioner="min-cut")
    with traced_group(cfg.world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        run_aot(stage, CausalLM(cfg), make_inputs(cfg))
    base = storage_bases(stage.irs[-1])
    tangents = {v.name for v in stage.irs[-1].values if v.role == graph_pb2.ROLE_TANGENT}
    outputs = stage.fw.graph.output_node().args[0][stage.num_fwd_outputs :]
    saved = {
        base(n.name) for n in outputs
        if isinstance(n.meta.get("val"), torch.Tensor) and not _is_rng_state(n)
    }
    assert saved == {base(v) for v in stage.plan.saved_values()} - tangents


def _is_rng_state(node: torch.fx.Node) -> bool:
    import operator

    source = node.args[0] if node.target is operator.getitem else node
    return getattr(source, "target", None) is torch.ops.higher_order.run_and_save_rng_state


def test_the_plan_partitioner_refuses_replayed_random_ops():
    with pytest.raises(ValueError, match='random_ops="replay"'):
        stage_mod.PlanningStage(model_decls(entry("dense").config), random_ops="replay")


# --------------------------------------------------------------------------------------------
# The one-pass split and torch's


def halves_signature(module: torch.fx.GraphModule) -> tuple:
    """What AOTAutograd reads of a partitioned half: its code, its placeholders' names and
    descriptions, its outputs' descriptions, which ops are marked backward."""
    graph = module.graph
    return (
        module.code,
        [(node.name, node.meta.get("desc")) for node in graph.find_nodes(op="placeholder")],
        graph.output_node().meta.get("desc"),
        [node.name for node in graph.nodes if node.meta.get("autograd_backward")],
    )


@pytest.mark.parametrize("name", ["dense", "moe_ep2", "glm_dsa_ep2", "dense_dropout"])
def test_one_pass_split_builds_the_graphs_torch_extraction_builds(name, monkeypatch):
    """The one-pass split and torch's `_extract_fwd_bwd_modules` with the in-place replay
    order, on copies of the same joint graph and saved set: the same forward and backward."""
    built = []
    one_pass = stage_mod._split_in_one_pass

    def both_splits(joint_module, saved, *, num_fwd_outputs):
        twin = copy.deepcopy(joint_module)
        twin_nodes = {node.name: node for node in twin.graph.nodes}
        ours = one_pass(joint_module, saved, num_fwd_outputs=num_fwd_outputs)
        torch_halves = stage_mod._split_with_torch(
            twin, [twin_nodes[node.name] for node in saved], num_fwd_outputs=num_fwd_outputs
        )
        built.append((ours, torch_halves))
        return ours

    monkeypatch.setattr(stage_mod, "_split_in_one_pass", both_splits)
    golden_subject(name).staged("all", run_aot)
    assert built
    for ours, theirs in built:
        assert ours is not None
        for our_half, their_half in zip(ours, theirs, strict=True):
            stage_mod._generate_code(their_half)
            assert halves_signature(our_half) == halves_signature(their_half)


def test_partition_takes_torch_split_when_the_one_pass_split_declines(monkeypatch):
    """A joint graph the one-pass split does not handle is split by torch's extraction, and
    the step still saves and replays the plan."""
    torch_split = stage_mod._split_with_torch
    calls = []

    def recorded_torch_split(*args, **kwargs):
        calls.append(args)
        return torch_split(*args, **kwargs)

    monkeypatch.setattr(stage_mod, "_split_in_one_pass", lambda *args, **kwargs: None)
    monkeypatch.setattr(stage_mod, "_split_with_torch", recorded_torch_split)
    staged = golden_subject("dense").staged("all", run_aot)
    assert calls
    assert_saves_and_replays_the_plan(staged)


def _joint_graph_split(fn, inputs, also_saved=(), **aot_options):
    """The one-pass split of ``fn``'s joint graph as AOTAutograd traces it with
    ``aot_options``, saving what torch's default partition saves and the ops ``also_saved``
    names."""
    from functorch.compile import aot_function, default_partition

    splits = []

    def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        fwd, bwd = default_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs)
        saved_names = {node.name for node in fwd.graph.output_node().args[0][num_fwd_outputs:]}
        twin = copy.deepcopy(joint_module)
        saved = [node for node in twin.graph.nodes if node.name in {*saved_names, *also_saved}]
        splits.append(
            stage_mod._split_in_one_pass(twin, saved, num_fwd_outputs=num_fwd_outputs)
        )
        return fwd, bwd

    aot_function(fn, nop_compiler, nop_compiler, partition_fn=partition, **aot_options)(
        *inputs
    ).sum().backward()
    return splits[0]


def _matmul_relu(x, w):
    return (x @ w).relu() * 2


def _matmul_relu_inputs():
    return torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def test_one_pass_split_handles_a_static_joint_graph():
    assert _joint_graph_split(_matmul_relu, _matmul_relu_inputs()) is not None


@pytest.mark.parametrize(
    "also_saved, options",
    [
        pytest.param((), {"dynamic": True}, id="symbolic-shapes"),
        pytest.param(("mul",), {}, id="saved-value-backward-does-not-read"),
    ],
)
def test_one_pass_split_declines_symbolic_shapes_and_unread_saved_values(also_saved, options):
    """Symbolic sizes to save are torch's to handle, and a saved value backward does not read
    torch drops from the saved set: the one-pass split declines such graphs (the stage then
    takes torch's)."""
    split = _joint_graph_split(_matmul_relu, _matmul_relu_inputs(), also_saved, **options)
    assert split is None


# --------------------------------------------------------------------------------------------
# Diagnostics and errors at compile time


def test_indexer_topk_is_not_recomputed_when_its_unit_is_kept():
    """With SAVE_DSA_INDEXER the indexer's top-k stays out of the backward graph (it re-runs
    there under whole-layer recompute); the plan's diagnostics are warnings at compile time."""
    subject = golden_subject("glm_dsa_ep2")
    stage = Recording(subject.models, ["SAVE_DSA_INDEXER"])
    with traced_group(subject.world_size):
        with pytest.warns(rp.PlannerWarning, match="nondeterministic-replay"):
            run_aot(stage, subject.module, subject.inputs)
    whole = subject.staged(None, run_aot)
    indexer_topk = {
        n.name
        for n in stage.plan.nodes
        if n.op == "aten.topk.default" and n.unit == "SAVE_DSA_INDEXER"
    }
    assert len(indexer_topk) == 3  # main layers 0, 1 and the MTP layer
    assert not indexer_topk & {n.name for n in stage.bw.graph.nodes}
    assert indexer_topk <= {n.name for n in whole.bw.graph.nodes}


def test_an_unknown_unit_fails_the_compile():
    cfg = entry("dense").config
    stage = stage_mod.PlanningStage(model_decls(cfg), ["SAVE_MOE_GATE"])
    with pytest.raises(rp.PlannerError, match="unknown-unit"):
        run_aot(stage, CausalLM(cfg), make_inputs(cfg))


def test_aot_autograd_backend_with_partition_fn_matches_eager():
    """Dynamo + `aot_autograd(partition_fn=stage.partition_fn)`, as a custom-compiler trainer
    does, on a single-rank GLM/DSA model (MoE, indexer, MTP) with the indexer kept."""
    from torch._dynamo.backends.common import aot_autograd

    cfg = dataclasses.replace(entry("glm_dsa_ep2").config, world_size=1)
    inputs = make_inputs(cfg)
    stage = Recording(model_decls(cfg), ["SAVE_DSA_INDEXER"])
    backend = aot_autograd(
        fw_compiler=nop_compiler, bw_compiler=nop_compiler, partition_fn=stage.partition_fn
    )
    torch._dynamo.reset()
    with stage_mod.tracing(), warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        step = eager_step(torch.compile(CausalLM(cfg), backend=backend), inputs)
    assert_saves_and_replays_the_plan(stage)
    assert_same_step(step, eager_step(CausalLM(cfg), inputs))


# --------------------------------------------------------------------------------------------
# Offload: what the plan offloads is copied to host memory in forward and reloaded in backward


def offloaded_names(staged: Recording) -> tuple[list[str], list[str]]:
    """The saved values the compiled forward copies to host memory (by the name of the value
    each copy reads) and those the plan offloads, both by storage base, sorted."""
    base = storage_bases(staged.irs[-1])
    outputs = staged.fw.graph.output_node().args[0][staged.num_fwd_outputs :]
    copied = [base(n.args[0].name) for n in outputs if n.target is host_memory.OFFLOAD]
    planned = {base(s.value) for s in staged.plan.saved if s.offloaded}
    return sorted(copied), sorted(planned)


def aot_step(subject: Subject, keep, **options) -> tuple[Recording, tuple]:
    """``subject``'s step through `aot_module` with a stage planning ``keep`` and
    ``options`` (boxed FX interpreter: the same kernels whatever the partition): the stage,
    and the loss and gradients."""
    stage = Recording(subject.models, keep, **options)
    compiled = aot_module(
        subject.module, fw_compiler=nop_compiler, bw_compiler=nop_compiler,
        partition_fn=stage.partition_fn,
    )
    with traced_group(subject.world_size), stage_mod.tracing(), warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        step = eager_step(compiled, subject.inputs)
    return stage, step


def assert_bit_identical(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))


def test_compiled_step_offloads_the_indexer_top_k_neither_kept_on_the_device_nor_replayed():
    """`offload=["SAVE_DSA_INDEXER"]`: the compiled forward copies exactly the values the plan
    offloads (the indexer's top-k among them) to host memory and returns the copies, the
    backward reloads each one before its first read and replays no top-k; loss and gradients
    are bit-identical to the step without checkpointing."""
    subject = golden_subject("glm_dsa_ep2")
    keep = ["SAVE_DSA_INDEXER"]
    stage, step = aot_step(subject, keep, offload=keep)
    copied, planned = offloaded_names(stage)
    assert copied == planned and planned
    topk = {
        n.name for n in stage.plan.nodes
        if n.op == "aten.topk.default" and n.unit == "SAVE_DSA_INDEXER"
    }
    topk_outputs = {v for n in stage.irs[-1].nodes if n.name in topk for v in n.outputs}
    assert len(topk_outputs & set(planned)) == len(topk)  # the indices of each top-k
    reloads = [n for n in stage.bw.graph.nodes if n.target is host_memory.RELOAD]
    assert len(reloads) == len(copied)
    assert not topk & {n.name for n in stage.bw.graph.nodes}
    _, plain = aot_step(golden_subject("glm_dsa_ep2"), None, recompute_ratio=0.0)
    assert_bit_identical(step, plain)


def test_compiled_step_offloads_layer_inputs_and_reloads_them_prefetch_ops_ahead():
    """`offload_kinds=["layer-input"]` under whole-layer recompute: every checkpointed layer's
    input is copied to host memory once the op after its last forward read ran, and each
    reload sits `offload_prefetch` ops before the first backward op reading it (at the start
    at the earliest); gradients bit-identical to the step without offload."""
    subject = golden_subject("moe_ep2")
    prefetch = 2
    stage, step = aot_step(
        subject, None, offload_kinds=["layer-input"], offload_prefetch=prefetch
    )
    copied, planned = offloaded_names(stage)
    assert copied == planned
    assert {s.kind for s in stage.plan.saved if s.offloaded} == {"layer-input"}
    forward_ops = [n for n in stage.fw.graph.nodes if n.op == "call_function"]
    for copy_node in (n for n in forward_ops if n.target is host_memory.OFFLOAD):
        source = copy_node.args[0]
        reads = [k for k, n in enumerate(forward_ops) if source in n.all_input_nodes]
        assert forward_ops.index(copy_node) == reads[-2] + 2  # after the op after the last read
    backward_ops = [n for n in stage.bw.graph.nodes if n.op == "call_function"]
    for reload in (n for n in backward_ops if n.target is host_memory.RELOAD):
        first = min(backward_ops.index(user) for user in reload.users)
        assert backward_ops.index(reload) == max(first - prefetch - 1, 0)
    _, plain = aot_step(golden_subject("moe_ep2"), None)
    assert_bit_identical(step, plain)


def test_inductor_step_with_offload_matches_the_step_without():
    """`torch.compile(model, backend=stage.backend)` compiled to code, keeping every unit and
    offloading what they keep and every layer input: the copies run as inductor fallbacks and
    loss and gradients are those of the same step without offload."""
    cfg = entry("dense").config
    inputs = make_inputs(cfg)
    steps = []
    for options in ({}, {"offload_kinds": ["kept", "layer-input"]}):
        stage = Recording(model_decls(cfg), "all", **options)
        torch._dynamo.reset()
        with stage:
            steps.append(eager_step(torch.compile(CausalLM(cfg), backend=stage.backend), inputs))
    copied, planned = offloaded_names(stage)
    assert copied == planned and planned
    assert_bit_identical(steps[1], steps[0])


def test_the_min_cut_partitioner_refuses_offload():
    """Torch's min-cut partitioner keeps every saved value on the device: a stage asked to
    offload with it would not do what its plan predicts."""
    with pytest.raises(ValueError, match='partitioner="plan"'):
        stage_mod.PlanningStage(
            model_decls(entry("dense").config), "all", offload_kinds=["kept"],
            partitioner="min-cut",
        )


# --------------------------------------------------------------------------------------------
# Installation


def test_stages_install_and_uninstall_in_any_order():
    """Two stages installed, then uninstalled in install order: inductor runs the later one
    while it is installed, and nothing once both are gone."""
    models = model_decls(entry("dense").config)
    before = inductor_config.custom_partitioner_fn, inductor_config.joint_custom_post_pass
    first = stage_mod.install(models, "all")
    second = stage_mod.install(models, "all", partitioner="min-cut")
    assert stage_mod.active_stage() is second
    assert inductor_config.joint_custom_post_pass is second
    first.uninstall()
    assert stage_mod.active_stage() is second
    assert inductor_config.joint_custom_post_pass is second
    assert inductor_config.custom_partitioner_fn is before[0]
    second.uninstall()
    assert stage_mod.active_stage() is None
    assert (inductor_config.custom_partitioner_fn, inductor_config.joint_custom_post_pass) == before
    # And in reverse order, with the plan partitioner active in between.
    first, second = stage_mod.install(models, "all"), stage_mod.install(models, "all")
    second.uninstall()
    assert inductor_config.custom_partitioner_fn.stage is first
    first.uninstall()
    assert (inductor_config.custom_partitioner_fn, inductor_config.joint_custom_post_pass) == before
