"""The planner in-process: `recompute_planner.plan` / `load_plan` against the `planner` CLI.

Every check compares with what the CLI prints for the same graph and options, so the native
extension is proved to be the same planner with the same error texts.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from google.protobuf import json_format

import background
import recompute_planner as rp
from export_support import REPO_ROOT, run_planner, script_module
from graph_walk import GOLDEN_DIR, load_graph
from recompute_planner import _native
from recompute_planner._exporter import ModelDecl, export_joint, write_graph
from recompute_planner.markers import checkpoint_record, layer_scope
from recompute_planner.proto import plan_pb2

GLM = GOLDEN_DIR / "glm_dsa_ep2.pb"


def cli_json(*args: str) -> str:
    done = run_planner("plan", *args, "--format", "json")
    assert done.returncode == 0, done.stderr
    return done.stdout


def cli_error(*args: str) -> str:
    """The first `error:` line the CLI prints, without the prefix."""
    done = run_planner("plan", *args)
    assert done.returncode == 1, done.stdout
    first = done.stderr.splitlines()[0]
    assert first.startswith("error: "), done.stderr
    return first.removeprefix("error: ")


@pytest.mark.parametrize(
    "options, flags",
    [
        ({}, []),
        ({"keep": ["SAVE_DSA_INDEXER"]}, ["--keep", "save_dsa_indexer"]),
        (
            {"keep": "all", "recompute_ratio": 0.5, "collectives": "save"},
            ["--keep", "all", "--recompute-ratio", "0.5", "--collectives", "save"],
        ),
        ({"keep": "all", "executor": "eager"}, ["--keep", "all", "--executor", "eager"]),
        ({"random_ops": "replay"}, ["--random-ops", "replay"]),
        ({"budget": "90KB"}, ["--budget", "90KB"]),
        ({"budget": 90_000, "granularity": "op"}, ["--budget", "90000", "--granularity", "op"]),
    ],
)
def test_plan_in_process_equals_the_cli_plan(options, flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(GLM, **options)
    assert plan.to_json() == cli_json(str(GLM), *flags)


def test_choices_plan_what_the_cli_plans_from_a_choices_file(tmp_path):
    """`choices=` (a mapping as `--choices` reads it) gives the CLI's plan of that file."""
    choices = {
        "layer_keep": [{"model": "main", "layer": 1, "keep": ["save_dsa_indexer"]}],
        "layer_offload": [{"model": "main", "layer": 1, "offload": ["SAVE_DSA_INDEXER"]}],
    }
    path = tmp_path / "choices.json"
    path.write_text(json.dumps(choices))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        planned = rp.plan(GLM, choices=choices)
    assert planned.to_json() == cli_json(str(GLM), "--choices", str(path))
    assert planned.memory.host_peak_bytes > 0


def test_a_budget_answer_planned_again_with_another_profile_keeps_what_it_kept():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        answer = rp.plan(GLM, budget=73_000)
        again = rp.plan(GLM, choices=answer, hw="h100")
    assert answer.config.layer_keep and again.config.layer_keep == answer.config.layer_keep
    assert again.memory.peak_bytes == answer.memory.peak_bytes
    assert (again.cost.hw, answer.cost.hw) == ("H100", "H200")
    with pytest.raises(rp.PlannerError, match="give `budget` or `choices`, not both") as raised:
        rp.plan(GLM, budget=73_000, choices=answer)
    assert raised.value.code == "invalid-option"
    with pytest.raises(TypeError, match="choices must be a Plan or a mapping, not str"):
        rp.plan(GLM, choices="answer.json")
    uniform = rp.plan(GLM, keep="SAVE_DSA_INDEXER", check=False)
    with pytest.raises(ValueError, match=r"plan it again with keep=\['SAVE_DSA_INDEXER'\]"):
        rp.plan(GLM, choices=uniform)


def test_a_plan_offloading_only_layer_inputs_is_planned_again_from_its_choices():
    """A plan whose only per-layer choice moves a layer's inputs to host memory (no
    `layer_keep`) is choices enough: planned again, it offloads the same layer inputs."""
    choices = {
        "layer_keep": [],
        "layer_offload": [{"model": "main", "layer": 0, "offload": [], "layer_input": True}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        first = rp.plan(GLM, choices=choices)
        again = rp.plan(GLM, choices=first, hw="h100")
    assert first.config.layer_offload[0].layer_input
    assert again.config.layer_offload == first.config.layer_offload
    assert again.memory.offloaded_bytes == first.memory.offloaded_bytes > 0


def test_choices_naming_what_the_graph_lacks_raise_the_planners_error():
    with pytest.raises(rp.PlannerError, match="NOTHING") as raised:
        rp.plan(GLM, choices={"layer_keep": [{"model": "main", "layer": 0, "keep": ["NOTHING"]}]})
    assert raised.value.code == "invalid-choices"
    with pytest.raises(rp.PlannerError, match="no `layer_keep`"):
        rp.plan(GLM, choices={"layer_offload": []})


def test_every_graph_form_plans_alike():
    """A path, the `.pb` bytes, the `.json` bytes and the exported message give one plan."""
    graph = load_graph(GLM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        by_path = rp.plan(GLM, keep="all").to_json()
        assert rp.plan(GLM.read_bytes(), keep="all").to_json() == by_path
        assert rp.plan(graph, keep="all").to_json() == by_path
        as_json = json_format.MessageToJson(graph, preserving_proto_field_name=True)
        assert rp.plan(as_json.encode(), keep="all", format="json").to_json() == by_path


def test_plan_objects_carry_every_section():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(GLM, keep=["SAVE_DSA_INDEXER"])
    doc = json.loads(plan.to_json())
    assert [n.name for n in plan.nodes] == [n["name"] for n in doc["nodes"]]
    topk = [n for n in plan.nodes if n.op == "aten.topk.default" and n.unit == "SAVE_DSA_INDEXER"]
    assert topk and all(n.decision == "save" and n.reason == "kept-interval" for n in topk)
    assert plan.decision(topk[0].name) == topk[0]
    assert plan.saved_values() == {s["value"] for s in doc["saved"]}
    assert [r.nodes for r in plan.replay] == [tuple(r["nodes"]) for r in doc["replay"]]
    assert plan.memory.peak_bytes == doc["memory"]["peak_bytes"]
    assert plan.cost.replay_flops == doc["cost"]["replay_flops"]
    assert [d.code for d in plan.diagnostics] == [d["code"] for d in doc["diagnostics"]]
    assert plan.config.keep == ("SAVE_DSA_INDEXER",)


def test_warning_diagnostics_are_python_warnings():
    with pytest.warns(rp.PlannerWarning, match="nondeterministic-replay: replay re-runs"):
        plan = rp.plan(GLM, keep=["SAVE_DSA_INDEXER"])
    assert any(d.code == "nondeterministic-replay" for d in plan.warnings())


def test_an_unknown_unit_raises_the_cli_error_text_and_code():
    with pytest.raises(rp.PlannerError) as raised:
        rp.plan(GLM, keep=["SAVE_NOTHING"])
    assert raised.value.code == "unknown-unit"
    assert str(raised.value) == cli_error(str(GLM), "--keep", "save_nothing")


def test_an_empty_unit_name_raises_the_cli_error_text_and_code():
    for keep in ([""], "", ["save_dsa_indexer", " "]):
        with pytest.raises(rp.PlannerError) as raised:
            rp.plan(GLM, keep=keep)
        assert raised.value.code == "invalid-keep"
        assert "not an empty name" in str(raised.value)
    with pytest.raises(rp.PlannerError) as raised:
        rp.plan(GLM, keep=[""])
    assert str(raised.value) == cli_error(str(GLM), "--keep", "")


@pytest.mark.parametrize("keep", [b"SAVE_DSA_INDEXER", bytearray(b"SAVE"), [b"SAVE_DSA_INDEXER"]])
def test_unit_names_as_bytes_are_a_type_error(keep):
    with pytest.raises(TypeError, match="keep takes unit names as str"):
        rp.plan(GLM, keep=keep)


def test_an_invalid_graph_raises_the_cli_error_text(tmp_path):
    broken = tmp_path / "broken.pb"
    broken.write_bytes(b"\x0a\x05hello\xff\xff")
    with pytest.raises(rp.PlannerError) as raised:
        rp.plan(broken)
    assert raised.value.code == "invalid-graph"
    assert str(raised.value) == cli_error(str(broken))


class CorruptingWrite(torch.nn.Module):
    """A kept op's output written in place together with a buffer (resident): keeping it is
    an error (inplace-in-kept-interval)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("stats", torch.zeros(4))

    def forward(self, x):
        with layer_scope("main", 0):
            h = checkpoint_record("attn.begin", x * self.w)
            kept = torch.sin(h)
            torch._foreach_add_([kept, self.stats], 1.0)
            out = checkpoint_record("attn.end", kept * self.w)
        return out.sum()


def test_an_error_diagnostic_rejects_the_plan_with_its_code(tmp_path):
    models = [ModelDecl("main", 1, {"SAVE_ATTN": [("attn.begin", "attn.end")]})]
    graph = export_joint(CorruptingWrite(), (torch.randn(4),), name="corrupting", models=models)
    path = tmp_path / "corrupting.pb"
    write_graph(graph.graph, path)
    with pytest.raises(rp.PlanRejected) as raised:
        rp.plan(graph, keep="all")
    assert raised.value.code == "inplace-in-kept-interval"
    assert str(raised.value) == cli_error(str(path), "--keep", "all")
    assert raised.value.hint and raised.value.plan.errors()


def test_an_infeasible_budget_raises_with_its_code():
    with pytest.raises(rp.PlannerError) as raised:
        rp.plan(GLM, budget="1KB")
    assert raised.value.code == "budget-infeasible"
    assert str(raised.value) == cli_error(str(GLM), "--budget", "1KB")


def test_a_hardware_profile_changes_the_times():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        default = rp.plan(GLM)
        slow = rp.plan(GLM, hw={"name": "slow", "link_bytes_per_s": 1e6})
    assert slow.cost.hw == "slow"
    assert slow.cost.replay_time_s > default.cost.replay_time_s
    with pytest.raises(rp.PlannerError, match="link_bytes_per_s` must be a positive number"):
        rp.plan(GLM, hw={"link_bytes_per_s": -1})


DEEP_GRAPH = background.Job(
    "deep_graph",
    lambda out: [
        "cargo", "run", "-q", "-p", "testkit", "--example", "deepen_file", "--",
        str(GOLDEN_DIR / "moe_ep2.pb"), str(out / "moe_ep2_deep.pb"), "1000",
    ],
)
BACKGROUND_JOBS = (DEEP_GRAPH,)


@pytest.fixture(scope="module")
def deep_graph() -> Path:
    """`moe_ep2` with its decoder layer repeated 1,000 times (testkit's `deepen_file`): a graph
    whose `budget` search takes about a second even with the optimised extension."""
    done, out = background.SESSION.finished(DEEP_GRAPH)
    assert done.returncode == 0, done.stderr
    return out / "moe_ep2_deep.pb"


@pytest.mark.timed
def test_ctrl_c_interrupts_a_budget_search_at_once(deep_graph):
    """SIGINT during `plan(..., budget=...)` raises KeyboardInterrupt from the search itself,
    long before the search would have finished (not when it returns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        baseline = rp.plan(deep_graph, check=False).memory
        budget = (baseline.no_checkpoint_peak_bytes + baseline.full_recompute_peak_bytes) // 2
        # The faster of two searches: a first one may pay for warm-up, and a timer set from it
        # could fire after the interrupted search had already returned.
        search = min(_timed(lambda: rp.plan(deep_graph, budget=budget, check=False)) for _ in "ab")

        stop = threading.Event()
        sender = threading.Thread(target=_interrupt_the_search, args=(stop,))
        # Python leaves SIGINT ignored when it started ignoring it (a job started in the
        # background by a non-interactive shell, as CI may be): Ctrl-C as a terminal sends it.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        started = time.monotonic()
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                rp.plan(deep_graph, budget=budget, check=False)
        finally:
            stop.set()
            sender.join()
            signal.signal(signal.SIGINT, previous)
    interrupted = time.monotonic() - started
    assert interrupted < search / 2, (interrupted, search)


def _interrupt_the_search(stop: threading.Event) -> None:
    """Sends this process SIGINT once the planner's own thread (named `planner`) runs, so the
    signal lands during the search however fast or loaded the machine is."""
    while not stop.is_set():
        if any(
            (task / "comm").read_text().strip() == "planner"
            for task in Path("/proc/self/task").iterdir()
        ):
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
            return
        time.sleep(0.005)


def _timed(call) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


# --------------------------------------------------------------------------------------------
# Plan files: one reader (the Rust one), one JSON dialect


def test_cli_plans_load_through_the_api_from_json_and_pb(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        planned = rp.plan(GLM, keep="all")
    files = {}
    for suffix in ("json", "pb"):
        files[suffix] = tmp_path / f"plan.{suffix}"
        done = run_planner(
            "plan", str(GLM), "--keep", "all", "--format", suffix, "-o", str(files[suffix])
        )
        assert done.returncode == 0, done.stderr
    for path in files.values():
        assert rp.load_plan(path).to_json() == planned.to_json()
    assert planned.to_bytes() == files["pb"].read_bytes()
    # Unread, the plan is written to protobuf by the planner directly, not through its JSON.
    unread = rp.plan(GLM, keep="all", check=False)
    assert unread.to_bytes() == files["pb"].read_bytes()
    assert "_json" not in vars(unread)


def test_the_proto_module_parses_the_cli_json(tmp_path):
    """The plan JSON is proto3 JSON: `json_format.Parse` into the shipped `plan_pb2` reads
    what the CLI writes, enum-like strings (`no-checkpoint`) included, and equals the `.pb`."""
    text = cli_json(str(GLM), "--keep", "save_dsa_indexer")
    parsed = json_format.Parse(text, plan_pb2.Plan())
    pb = tmp_path / "plan.pb"
    done = run_planner(
        "plan", str(GLM), "--keep", "save_dsa_indexer", "--format", "pb", "-o", str(pb)
    )
    assert done.returncode == 0, done.stderr
    assert parsed == plan_pb2.Plan.FromString(pb.read_bytes())
    assert {n.decision for n in parsed.nodes} == {"save", "recompute", "no-checkpoint"}
    assert rp.load_plan(text.encode(), format="json").to_proto() == parsed


def test_a_broken_plan_file_raises_the_readers_error(tmp_path):
    path = tmp_path / "plan.json"
    broken = cli_json(str(GLM)).replace('"decision": "recompute"', '"decision": "sometimes"')
    path.write_text(broken)
    with pytest.raises(rp.PlannerError) as raised:
        rp.load_plan(path)
    assert raised.value.code == "invalid-plan"
    assert "sometimes" in str(raised.value)


@pytest.mark.parametrize("kind", ["character device", "FIFO"])
def test_hw_and_plan_files_are_read_like_the_cli_reads_them(tmp_path, kind):
    """`hw=` files and `load_plan` paths go through the CLI's reader of input files: a device
    or a FIFO is refused at once with the CLI's text, never read until memory runs out or
    waited on for a writer."""
    if kind == "FIFO":
        special = tmp_path / "pipe.json"
        os.mkfifo(special)
    else:
        special = Path("/dev/zero")
    with pytest.raises(rp.PlannerError) as raised:
        rp.plan(GLM, hw=special)
    assert raised.value.code == "invalid-option"
    assert str(raised.value) == cli_error(str(GLM), "--hw", str(special))
    assert kind in str(raised.value)
    with pytest.raises(rp.PlannerError) as raised:
        rp.load_plan(special, format="json")
    assert raised.value.code == "invalid-plan"
    assert kind in str(raised.value) and str(special) in str(raised.value)


# --------------------------------------------------------------------------------------------
# The installed package


def test_the_documented_one_liner_runs_from_the_repository():
    code = (
        "import recompute_planner as rp; "
        "print(rp.plan('tests/golden/glm_dsa_ep2.pb', keep=['SAVE_DSA_INDEXER']).memory)"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Memory(peak_bytes=")


def test_importing_the_package_loads_neither_torch_nor_its_compiler():
    """`import recompute_planner` in a fresh process loads no torch (planning needs none); after
    `import torch` it leaves Dynamo, inductor and AOTAutograd's front end unloaded (seconds of
    import): an export, the compile stage or an op interval loads them on first use. Measured
    by the import-time benchmark's own child processes."""
    with script_module("import_time") as script:
        run = script.one_run()
        alone_s, torch_loaded = script.alone_run()
    assert run.compiler_modules == []
    assert run.package_s > 0
    assert not torch_loaded and alone_s > 0


def test_the_extension_is_part_of_the_package():

    assert Path(_native.__file__).parent == Path(rp.__file__).parent
    assert dict(_native.DESCRIPTORS).keys() == {"graph_pb2", "plan_pb2"}
    assert _native.PLANNER_VERSION == json.loads(cli_json(str(GLM)))["planner_version"]


# What a user imports from the package (`compile` and `sac` are submodules loaded on first
# use); everything else lives in its modules.
PUBLIC_NAMES = {
    "Annotation",
    "ExportError",
    "ExportResult",
    "ModelDecl",
    "OpInterval",
    "Plan",
    "PlanRejected",
    "PlannerError",
    "PlannerWarning",
    "SacMismatchError",
    "TensorSpec",
    "__version__",
    "annotate",
    "calibrate",
    "check_plan",
    "errors",
    "export",
    "load_plan",
    "markers",
    "plan",
    # the warnings, each a PlannerWarning
    "ArgumentsHeldWarning",
    "KvCacheOffWarning",
    "NoLayersWarning",
    "OwnCheckpointingWarning",
}


def test_the_package_exports_the_user_api_and_keeps_its_helpers_private():
    assert set(rp.__all__) == PUBLIC_NAMES
    for name in rp.__all__:
        assert getattr(rp, name) is not None
    # `rp.export` is the function that exports a model, not a module made callable.
    assert inspect.isfunction(rp.export)
    assert inspect.ismodule(rp.compile) and inspect.ismodule(rp.sac)
    for private in ("zoo", "measure", "export"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"recompute_planner.{private}")


def test_a_plan_decodes_each_field_on_first_access():
    """`rp.plan` returns a handle: nothing is written or parsed until read, and reading
    `memory` decodes neither the per-node decisions nor the saved set."""
    plan = rp.plan(GLM, "all", check=False)
    assert not {"_json", "_doc", "nodes", "saved", "memory"} & vars(plan).keys()
    assert plan.memory.peak_bytes > 0
    assert "memory" in vars(plan) and not {"nodes", "saved"} & vars(plan).keys()
    # Neither memory nor the diagnostics a check reads need the whole plan written.
    assert plan.diagnostics is not None and not {"_json", "_doc"} & vars(plan).keys()
    assert plan.nodes is plan.nodes  # decoded once
    assert plan.decision(plan.nodes[0].name) == plan.nodes[0]


def test_node_ops_are_each_nodes_name_and_op_read_without_decoding_the_nodes():
    plan = rp.plan(GLM, "all", check=False)
    node_ops = plan.node_ops
    assert "nodes" not in vars(plan)
    assert list(node_ops.items()) == [(n.name, n.op) for n in plan.nodes]


def test_the_sections_read_before_the_lists_equal_those_of_the_whole_plan():
    """Memory, cost, diagnostics and the other small sections of an unread plan are written
    without its lists; they equal the same sections of the whole plan's JSON."""
    diagnosed = 0
    for options in ({"keep": "all"}, {}, {"keep": "all", "executor": "eager"}, {"budget": "90KB"}):
        unread = rp.plan(GLM, check=False, **options)
        small = {
            field: getattr(unread, field)
            for field in ("planner_version", "graph", "config", "joint", "memory", "cost")
        }
        small["diagnostics"] = unread.diagnostics
        assert "_json" not in vars(unread)
        whole = rp.load_plan(rp.plan(GLM, check=False, **options).to_json().encode(), "json")
        assert small == {field: getattr(whole, field) for field in small}
        diagnosed += len(unread.diagnostics)
    assert diagnosed  # some plan has diagnostics: not only empty lists compared


def test_every_spelled_keyword_of_plan_has_the_planners_default_and_spellings():
    """The planner defines each option's spellings once (the command line's possible values
    read them too): `plan`'s default is the planner's, and its docstring names every
    spelling."""
    parameters = inspect.signature(rp.plan).parameters
    doc = rp.plan.__doc__ or ""
    assert len(_native.SPELLED_OPTIONS) == 7
    for keyword, default, spellings in _native.SPELLED_OPTIONS:
        assert parameters[keyword].default == default, keyword
        unnamed = [s for s in spellings if f'``"{s}"``' not in doc]
        assert not unnamed, f"plan's docstring does not name {keyword}={unnamed}"
    assert len(_native.SPELLED_LIST_OPTIONS) == 1
    for keyword, spellings in _native.SPELLED_LIST_OPTIONS:
        assert parameters[keyword].default is None, keyword
        unnamed = [s for s in spellings if f'``"{s}"``' not in doc]
        assert not unnamed, f"plan's docstring does not name {keyword}={unnamed}"
    assert parameters["offload_prefetch"].default == _native.DEFAULT_OFFLOAD_PREFETCH
