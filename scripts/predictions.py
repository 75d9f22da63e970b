"""Predictions against measurement, for the three executors of a plan: peak and saved bytes
of one training step, predicted by the planner and measured.

- ``eager``: eager selective checkpointing (`recompute_planner.sac`, every checkpointed layer
  under `torch.utils.checkpoint` with the plan's policy), planned with `--executor eager`,
  measured on the CPU allocator (`recompute_planner._measure`).
- ``compile``: the torch.compile planning stage (`recompute_planner.compile`) on the step's
  joint graph, the step compiled from the stage's plan (`aot_module` with the stage's
  `partition_fn`, graphs run by torch's boxed FX interpreter, which frees each value after its
  last use as generated code does), measured on the CPU allocator without its kernels' scratch
  (what an op allocates and frees within one call; `measured_peak_with_op_scratch` in the JSON
  rows counts it). The prediction is the
  stage's plan; `same plan` says whether it equals the CLI's plan of the exported step (peak
  and saved bytes).
- ``graph``: `planner run` (the runtime) on the exported step with seeded inputs, measured by
  the runtime's own count of the storages it holds.

Cases: every zoo golden whose model runs eagerly on this CPU, re-exported at the chosen shape
(multi-rank models as rank 0 of the fake process group they are traced with; `planner run`
runs every rank on rank 0's graph), and tiny stock HuggingFace models (random weights,
nothing downloaded). Per case, `--keep none`, `all` and each declared unit alone, then each
unit kept with what it keeps offloaded, and whole-layer recompute with the layer inputs
offloaded (`--offload-prefetch 0`). "Saved" is
what the step holds when forward ends, the loss aside: predicted, the plan's saved activation
bytes; measured, the allocator's (the runtime's) live bytes then.

    python scripts/predictions.py                       # batch 8, seq 64: docs/predictions.md
    python scripts/predictions.py --batch 2 --seq 8     # small
    python scripts/predictions.py --executor eager      # one executor
    python scripts/predictions.py --json out.json       # rows for tools and tests
    python scripts/predictions.py --markdown FILE       # the full table and the summary
    python scripts/predictions.py --time --markdown docs/predictions.md   # and time (below)

`--time` also measures each executor's step and replay time against its plan's, at widths
where compute is not all overhead (the budget ranking's models, and with `--time-hf` the
HuggingFace families at `TIME_HF_SHAPE`; `--time-rounds` steps each; `--time-only` skips the
memory rows and rewrites only the Markdown page's Time section):
`planner run --repeat` planned with a profile `planner calibrate` measures, eager SAC
(`recompute_planner._step_timing`, the keeps interleaved) and the compile stage's step (FX
interpreter) planned with one `rp.calibrate` measures.

`planner run` is `$PLANNER_BIN`, else `target/debug/planner` (built with `cargo build -p
planner-cli --features run`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import recompute_planner as rp
from recompute_planner import _measure as measure
from recompute_planner import _step_timing as timing
from recompute_planner import compile as stage_mod
from recompute_planner import sac
from recompute_planner._exporter import ModelDecl
from recompute_planner.annotate import annotation_of

# Zoo goldens measured (the CUDA-traced golden runs other ops on this CPU; dense_forward has no
# backward).
ZOO = (
    "dense",
    "dense_dropout",
    "dsv3_kv_expand",
    "moe_ep2",
    "moe_ep2_compiled",
    "moe_ep4",
    "moe_layer_compiled",
    "moe_domino",
    "moe_ep2_inplace",
    "moe_ep2_unbalanced",
    "moe_hf_router",
    "glm_dsa_ep2",
    "glm_dsa_ep2_compiled",
)
# Keeping the in-place dispatch is refused (inplace-in-kept-interval): `all` keeps the others.
KEEP_ALL = {"moe_ep2_inplace": ["SAVE_ATTN", "SAVE_MOE_GATE", "SAVE_MLP"]}
DENSE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
MOE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MOE_GATE": ["mlp.gate"]}
# Widths at which activations, not parameters and gradients, dominate a step of batch 8 x 64.
HF_SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
)
MOE_SHAPE = dict(moe_intermediate_size=64)
# The HuggingFace families' time rows: widths where a layer's matmuls take milliseconds on this
# CPU (as the budget ranking's models), at batch 2 x 256.
TIME_HF_SHAPE = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, use_cache=False,
)
TIME_MOE_SHAPE = dict(moe_intermediate_size=256)
TIME_HF_BATCH, TIME_HF_SEQ = 2, 256
# MoE families run in bfloat16: their default grouped-matmul experts take nothing else.
BF16 = {"qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3"}


EXECUTORS = ("eager", "compile", "graph")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    """One model at one shape: its exported graph, and how to run its step under a plan."""

    name: str
    units: list[str]
    graph: Any
    # A fresh model under the plan's SAC policies: the loss callable and the parameters; given
    # a wrapper, each checkpointed layer's forward wrapped with it first.
    step: Callable[..., tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]
    # A fresh module whose forward(*inputs) returns the loss, and those inputs.
    module: Callable[[], nn.Module]
    inputs: tuple[torch.Tensor, ...]
    # The models, layers and units of the graph, as the compile stage needs them declared.
    models: list[ModelDecl]
    input_bytes: int
    keep_all: Any = "all"
    # Multi-rank zoo models run as rank 0 of the fake process group they were traced in.
    world_size: int = 1


def zoo_config(name: str, batch: int, seq: int, **changes: Any):
    from recompute_planner._zoo.goldens import golden

    return golden(name).entry.config.resized(batch=batch, seq=seq, **changes)


def zoo_case(name: str, batch: int, seq: int, **changes: Any) -> Case:
    """The zoo golden `name` at `batch` x `seq`, its config with `changes` (`ZooConfig`
    fields)."""
    from recompute_planner._exporter import export_joint
    from recompute_planner._zoo.catalog import declared_units, make_inputs, model_decls
    from recompute_planner._zoo.goldens import traced_group
    from recompute_planner._zoo.model import CausalLM

    sized = zoo_config(name, batch, seq, **changes)
    cfg = sized.for_rank(sized.world_size, 0)
    inputs = make_inputs(cfg)
    with traced_group(cfg.world_size):
        graph = export_joint(
            CausalLM(cfg), inputs, name=name, models=model_decls(cfg),
            world_size=cfg.world_size, rank=0,
        ).graph

    def step(plan: rp.Plan, wrap: Callable[[Any], Any] | None = None):
        if wrap is not None:
            raise ValueError("the zoo's steps are timed by _step_timing.ZooStep")
        model = CausalLM(cfg)
        policies = {key: sac.context_fn(plan, *key) for key in plan.layers()}
        measure.checkpoint_zoo_layers(model, policies)
        params = [p for p in model.parameters() if p.requires_grad]
        return in_offloading(plan, lambda: model(*inputs)), params

    return Case(
        name, list(declared_units(cfg)), graph, step, lambda: CausalLM(cfg), tuple(inputs),
        model_decls(cfg), sum(measure.tensor_bytes(t) for t in inputs),
        KEEP_ALL.get(name, "all"), cfg.world_size,
    )


def hf_families(
    shape: dict[str, Any] | None = None, moe_shape: dict[str, Any] | None = None
) -> dict[str, tuple[Callable[[], Any], dict[str, list[str]]]]:
    """Stock HuggingFace families: (model builder, units), at ``shape`` (default `HF_SHAPE`),
    their MoE experts at ``moe_shape`` (default `MOE_SHAPE`)."""
    import transformers as T

    shape = HF_SHAPE if shape is None else shape
    experts = MOE_SHAPE if moe_shape is None else moe_shape

    def build(model_cls, config_cls, **extra):
        def make():
            torch.manual_seed(0)
            return model_cls(config_cls(**{**shape, **extra}))

        return make

    return {
        "llama": (build(T.LlamaForCausalLM, T.LlamaConfig), DENSE_UNITS),
        "llama-eager-attn": (
            build(T.LlamaForCausalLM, T.LlamaConfig, attn_implementation="eager"), DENSE_UNITS,
        ),
        "mistral": (build(T.MistralForCausalLM, T.MistralConfig), DENSE_UNITS),
        "qwen2": (build(T.Qwen2ForCausalLM, T.Qwen2Config), DENSE_UNITS),
        "qwen3": (build(T.Qwen3ForCausalLM, T.Qwen3Config), DENSE_UNITS),
        # Dense MLPs other than Llama's gated SiLU without bias: fused gate and up projections
        # (Phi-3), non-gated with bias (Starcoder2), gated with bias, non-gated ReLU² without
        # bias (Arcee), and norms after each block (OLMo 2).
        "phi3": (build(T.Phi3ForCausalLM, T.Phi3Config, pad_token_id=0), DENSE_UNITS),
        # Untied, as every other family here: aot_module's functional call takes no tied
        # parameters.
        "starcoder2": (
            build(T.Starcoder2ForCausalLM, T.Starcoder2Config, tie_word_embeddings=False),
            DENSE_UNITS,
        ),
        "llama-mlp-bias": (build(T.LlamaForCausalLM, T.LlamaConfig, mlp_bias=True), DENSE_UNITS),
        "arcee": (build(T.ArceeForCausalLM, T.ArceeConfig), DENSE_UNITS),
        "olmo2": (build(T.Olmo2ForCausalLM, T.Olmo2Config), DENSE_UNITS),
        "qwen3-moe": (
            build(
                T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2,
                **experts,
            ),
            MOE_UNITS,
        ),
        "qwen2-moe": (
            build(
                T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2,
                shared_expert_intermediate_size=64, **experts,
            ),
            MOE_UNITS,
        ),
        "mixtral": (
            build(
                T.MixtralForCausalLM, T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2
            ),
            MOE_UNITS,
        ),
        # Multi-head latent attention (as many key-value heads as heads); its first layer
        # dense, the second MoE.
        "deepseek-v3": (
            build(
                T.DeepseekV3ForCausalLM, T.DeepseekV3Config, num_key_value_heads=4,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                first_k_dense_replace=1,
                kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16,
                # Its rotary embedding is `head_dim` wide: the rope part of each head.
                v_head_dim=16, **experts, head_dim=16,
            ),
            MOE_UNITS,
        ),
    }


class _Loss(nn.Module):
    """A HuggingFace causal LM whose forward takes its inputs positionally and returns the
    loss alone, as `aot_module` needs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, attention_mask):
        return self.model(input_ids=input_ids, labels=labels, attention_mask=attention_mask).loss


def hf_case(
    family: str, batch: int, seq: int,
    shape: dict[str, Any] | None = None, moe_shape: dict[str, Any] | None = None,
) -> Case:
    from recompute_planner.model_export import causal_mask

    build, units = hf_families(shape, moe_shape)[family]
    vocab = (HF_SHAPE if shape is None else shape)["vocab_size"]
    dtype = torch.bfloat16 if family in BF16 else torch.float32

    def make():
        model = build().to(dtype)
        rp.annotate(model, layers="model.layers", units=units)
        return model

    ids = torch.randint(0, vocab, (batch, seq),
                        generator=torch.Generator().manual_seed(3))
    mask = causal_mask(batch, seq, dtype)
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    model = make()
    graph = rp.export(model, inputs, name=family).graph

    def step(plan: rp.Plan, wrap: Callable[[Any], Any] | None = None):
        model = make()
        if wrap is not None:
            # Replaced on the instances, as sac.checkpoint_module replaces a forward.
            for layer in model.model.layers:
                layer.forward = wrap(layer.forward)
        sac.checkpoint_layers(model.model.layers, plan)
        params = [p for p in model.parameters() if p.requires_grad]
        return in_offloading(plan, lambda: model(**inputs).loss), params

    return Case(
        family, list(units), graph, step, lambda: _Loss(make()), (ids, ids, mask),
        annotation_of(model).models, sum(measure.tensor_bytes(t) for t in inputs.values()),
    )


def in_offloading(plan: rp.Plan, forward: Callable[[], Any]) -> Callable[[], Any]:
    """``forward`` run inside ``sac.offloading()`` where ``plan`` offloads layer inputs (eager
    SAC moves them there)."""
    if not any(s.offloaded and s.kind == "layer-input" for s in plan.saved):
        return forward

    def offloaded() -> Any:
        with sac.offloading():
            return forward()

    return offloaded


def keeps(case: Case) -> list[tuple[str, Any]]:
    return [("none", None), ("all", case.keep_all)] + [(u, [u]) for u in case.units]


OFFLOADING = ("eager", "compile", "graph")


# The keep under which the layer inputs are offloaded (`layer inputs offloaded` rows):
# whole-layer recompute, where they are all the checkpoints save.
LAYER_INPUTS = "layer inputs offloaded"


def measure_offloaded(case: Case, unit: str | None, executor: str) -> dict[str, Any]:
    """The row of keeping `unit` and offloading what it keeps (None: recomputing every layer
    and offloading the layer inputs), reloaded as backward asks for it (prefetch 0: when eager
    SAC brings it back), under `executor`."""
    if unit is None:
        options = {"offload_kinds": ["layer-input"], "offload_prefetch": 0}
        return MEASURES[executor](case, LAYER_INPUTS, None, **options)
    options = {"offload": [unit], "offload_prefetch": 0}
    return MEASURES[executor](case, f"{unit} offloaded", [unit], **options)


def quiet_plan(graph: Any, keep: Any, **options: Any) -> rp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep, **options)


def row(case: Case, label: str, executor: str, plan: rp.Plan, peak: int, saved: int,
        **extra: Any) -> dict[str, Any]:
    memory = plan.memory
    # Eager and compile rows measure what is on the device when forward ends; the runtime
    # counts offloaded bytes wherever they wait, as the plan's saved bytes do.
    predicted_saved = (
        memory.saved_bytes if executor == "graph" else memory.saved_on_device_bytes
    )
    return {
        "case": case.name,
        "keep": label,
        "executor": executor,
        "predicted_peak": memory.peak_bytes,
        "measured_peak": peak,
        "predicted_saved": predicted_saved,
        "measured_saved": saved,
        "no_checkpoint_peak": memory.no_checkpoint_peak_bytes,
        **extra,
    }


def measure_case(case: Case, label: str, keep: Any, **options: Any) -> dict[str, Any]:
    """The eager row: the eager plan's predictions (`options` for `rp.plan`) and the measured
    step under its SAC policies."""
    from recompute_planner._zoo.goldens import traced_group

    plan = quiet_plan(case.graph, keep, executor="eager", **options)
    with traced_group(case.world_size):
        loss, params = case.step(plan)
        step = measure.measure_step(loss, params, case.input_bytes)
    return row(
        case, label, "eager", plan, step.peak_bytes, step.saved_bytes,
        worse_than_no_checkpoint=any(
            d.code == "eager-checkpoint-costs-memory" for d in plan.diagnostics
        ),
        **moved_to_host(plan, step.moved_to_host_bytes),
    )


def moved_to_host(plan: rp.Plan, measured: int) -> dict[str, int]:
    """The row's host-memory columns where the plan offloads: bytes it predicts to move, bytes
    the step copied."""
    if not plan.memory.offloaded_bytes and not measured:
        return {}
    return {"predicted_offloaded": plan.memory.offloaded_bytes, "measured_offloaded": measured}


def measure_compiled(case: Case, label: str, keep: Any, **options: Any) -> dict[str, Any]:
    """The compile row: the stage's plan of the traced step (`options` for the stage, as
    `rp.plan` takes them), and the step compiled from it, measured; with offload, the bytes
    the step copies to host memory too."""
    from functorch.compile import aot_module
    from torch._dynamo.backends.debugging import boxed_nop

    from recompute_planner._zoo.goldens import traced_group

    stage = stage_mod.PlanningStage(case.models, keep, **options)
    with warnings.catch_warnings(), traced_group(case.world_size), stage_mod.tracing():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        module = case.module()
        compiled = aot_module(
            module, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=stage.partition_fn
        )
        params = [p for p in module.parameters() if p.requires_grad]
        # Every op the compiled step runs is a node of the stage's graph: what an op allocates
        # and frees within its call is kernel scratch, reported apart.
        step = measure.measure_step(
            lambda: compiled(*case.inputs), params, case.input_bytes, op_scratch=False
        )
    staged = stage.plans[-1]
    cli = quiet_plan(case.graph, keep, executor=stage_mod.EXECUTOR, **options)
    same = (staged.memory.peak_bytes, staged.memory.saved_bytes) == (
        cli.memory.peak_bytes, cli.memory.saved_bytes
    )
    return row(
        case, label, "compile", staged, step.peak_bytes, step.saved_bytes, same_plan=same,
        measured_peak_with_op_scratch=step.peak_with_op_scratch_bytes,
        **moved_to_host(staged, step.moved_to_host_bytes),
    )


def planner_bin() -> str:
    return os.environ.get("PLANNER_BIN") or str(REPO_ROOT / "target" / "debug" / "planner")


def measure_run(case: Case, label: str, keep: Any, **options: Any) -> dict[str, Any]:
    """The graph-executor row: `planner run` on the exported step, rank 0's figures; with
    `offload`, `offload_kinds` and `offload_prefetch` (as `rp.plan` takes them) the bytes it
    moves to host memory too."""
    plan = quiet_plan(case.graph, keep, **options)
    keep_list = [keep] if isinstance(keep, str) else keep
    args = [] if keep_list is None else ["--keep", ",".join(keep_list)]
    for option in ("offload", "offload_kinds"):
        if options.get(option):
            args += [f"--{option.replace('_', '-')}", ",".join(options[option])]
    if "offload_prefetch" in options:
        args += ["--offload-prefetch", str(options["offload_prefetch"])]
    with tempfile.TemporaryDirectory() as folder:
        graph = Path(folder) / f"{case.name}.pb"
        graph.write_bytes(case.graph.SerializeToString())
        done = subprocess.run(
            [planner_bin(), "run", str(graph), *args, "--seed", "0", "--format", "json"],
            capture_output=True, text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(f"planner run on {case.name} --keep {label} failed:\n{done.stderr}")
    run = json.loads(done.stdout)["ranks"][0]["runs"][0]
    if run["predicted_peak_bytes"] != plan.memory.peak_bytes:
        raise RuntimeError(f"{case.name} --keep {label}: planner run planned another peak")
    return row(
        case, label, "graph", plan, run["measured_peak_bytes"], run["measured_saved_bytes"],
        predicted_offloaded=plan.memory.offloaded_bytes,
        measured_offloaded=run["measured"]["offloaded_bytes"],
    )


MEASURES = {"eager": measure_case, "compile": measure_compiled, "graph": measure_run}


def gap(predicted: int, measured: int) -> float:
    return (predicted - measured) / max(measured, 1)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| case | keep | executor | peak predicted | peak measured | gap | saved predicted "
        "| saved measured | gap | note |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['keep']} | {r['executor']} | {r['predicted_peak']:,} "
            f"| {r['measured_peak']:,} | {gap(r['predicted_peak'], r['measured_peak']):+.1%} "
            f"| {r['predicted_saved']:,} | {r['measured_saved']:,} "
            f"| {gap(r['predicted_saved'], r['measured_saved']):+.1%} | {note(r)} |"
        )
    return "\n".join(lines)


def note(r: dict[str, Any]) -> str:
    if r.get("worse_than_no_checkpoint"):
        return "warned: worse than no checkpointing"
    if r.get("same_plan") is False:
        return "stage plan differs from the CLI's"
    if r.get("predicted_offloaded"):
        moved, predicted = r["measured_offloaded"], r["predicted_offloaded"]
        differs = "" if moved == predicted else f", {predicted:,} B predicted"
        return f"host: {moved:,} B moved{differs}"
    return ""


def summary(rows: list[dict[str, Any]]) -> str:
    """Per case and executor: the range of the peak gap and how many rows are within 3%."""
    lines = [
        "| case | eager peak gap | eager within 3% | compile peak gap | compile within 3% "
        "| graph peak gap | graph within 1% |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = [case]
        for executor, tolerance in (("eager", 0.03), ("compile", 0.03), ("graph", 0.01)):
            gaps = [gap(r["predicted_peak"], r["measured_peak"])
                    for r in rows if r["case"] == case and r["executor"] == executor]
            if not gaps:
                cells += ["", ""]
                continue
            within = sum(abs(g) <= tolerance for g in gaps)
            spread = f"{min(gaps):+.1%}" if min(gaps) == max(gaps) else (
                f"{min(gaps):+.1%} .. {max(gaps):+.1%}")
            cells += [spread, f"{within}/{len(gaps)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Time: step and replay measured against the plan's, at widths where a layer's matmuls take
# milliseconds on this CPU (the budget ranking's models: four layers of 256, 4 heads of 64,
# batch 2 x 256; the HuggingFace families at `TIME_HF_SHAPE`). Each case's runtime rows plan
# with a profile `planner calibrate` measures through the same binary just before them, its
# eager SAC and compile-stage rows with one `rp.calibrate` measures in this process.

TIME_KEEPS = ("none", "all")
# Targets: the runtime's step within 10% and replay within 15%; eager SAC and the compile
# stage within 25%.
TIME_TARGETS = {"graph": (0.10, 0.15), "eager": (0.25, 0.25), "compile": (0.25, 0.25)}


@dataclass
class TimeCase:
    """A model whose step time each executor measures: its traced step, and how eager SAC
    and the compile stage run it."""

    name: str
    graph: bytes
    # The eager step under a plan's SAC policies, each layer's recompute timed.
    eager_step: Callable[[rp.Plan], timing.TimedStep]
    # The models, layers and units as the compile stage needs them declared; a fresh module
    # whose forward(*inputs) returns the loss, and those inputs.
    models: list[ModelDecl]
    module: Callable[[], nn.Module]
    inputs: tuple[torch.Tensor, ...]


class CaseStep(timing.TimedStep):
    """``case``'s step under ``plan``'s SAC policies on the CPU, each layer's recompute
    timed."""

    def __init__(self, case: Case, plan: rp.Plan):
        super().__init__(torch.device("cpu"))
        self.forward, self.params = case.step(plan, self.timer.wrap)

    def loss(self) -> torch.Tensor:
        return self.forward()


def ranking_time_case(name: str) -> TimeCase:
    """A budget ranking's model (`_step_timing.RANKING_CASES`)."""
    from recompute_planner._zoo.catalog import make_inputs, model_decls
    from recompute_planner._zoo.model import CausalLM

    cfg, graph = timing.traced_case(name)
    return TimeCase(
        name, graph, lambda plan: timing.ZooStep(cfg, torch.device("cpu"), plan),
        model_decls(cfg), lambda: CausalLM(cfg), tuple(make_inputs(cfg)),
    )


def hf_time_case(family: str) -> TimeCase:
    """A HuggingFace family at `TIME_HF_SHAPE`, batch `TIME_HF_BATCH` x `TIME_HF_SEQ`."""
    case = hf_case(family, TIME_HF_BATCH, TIME_HF_SEQ, TIME_HF_SHAPE, TIME_MOE_SHAPE)
    return TimeCase(
        family, case.graph.SerializeToString(), lambda plan: CaseStep(case, plan),
        case.models, case.module, case.inputs,
    )


def time_rows(
    cases: list[str], rounds: int, families: list[str] | tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Every executor's step (and replay, where it is measured apart) of ``cases``
    (`_step_timing.RANKING_CASES`) and the HuggingFace ``families``, each keep of
    ``TIME_KEEPS``, against its plan."""
    makers: list[Callable[[], TimeCase]] = [lambda c=c: ranking_time_case(c) for c in cases]
    makers += [lambda f=f: hf_time_case(f) for f in families]
    with tempfile.TemporaryDirectory() as folder:
        runtime_profile = Path(folder) / "runtime.json"
        rows = []
        for make in makers:
            case = make()
            # Profiles measured just before the case's rows: this VM's speed drifts within
            # minutes.
            eager_profile = rp.calibrate("cpu", repeat=5)
            done = subprocess.run(
                [planner_bin(), "calibrate", "-o", str(runtime_profile)],
                capture_output=True, text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"planner calibrate failed:\n{done.stderr}")
            path = Path(folder) / f"{case.name}.pb"
            path.write_bytes(case.graph)
            rows += [
                timed_run(case.name, path, keep, runtime_profile, rounds) for keep in TIME_KEEPS
            ]
            rows += timed_eager(case, eager_profile, rounds)
            rows += [timed_compiled(case, keep, eager_profile, rounds) for keep in TIME_KEEPS]
            for r in rows[-3 * len(TIME_KEEPS):]:
                print(time_table([r]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def time_row(
    case: str, keep: str, executor: str, plan: rp.Plan, step_s: float, replay_s: float | None
) -> dict[str, Any]:
    return {
        "case": case, "keep": keep, "executor": executor, "hw": plan.cost.hw,
        "predicted_step_s": plan.cost.step_time_s, "measured_step_s": step_s,
        "predicted_replay_s": plan.cost.replay_time_s, "measured_replay_s": replay_s,
    }


def timed_run(case: str, graph: Path, keep: str, profile: Path, rounds: int) -> dict[str, Any]:
    """`planner run`: the median of ``rounds`` steps, and the plan it made with ``profile``."""
    done = subprocess.run(
        [planner_bin(), "run", str(graph), "--keep", keep, "--seed", "0", "--repeat",
         str(rounds), "--hw", str(profile), "--format", "json"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"planner run {case} --keep {keep} failed:\n{done.stderr}")
    measured = json.loads(done.stdout)["ranks"][0]["runs"][0]["measured"]
    plan = quiet_plan(str(graph), keep, hw=str(profile))
    return time_row(
        case, keep, "graph", plan, measured["step_time_s"], measured["replay_time_s"]
    )


def timed_eager(case: TimeCase, profile: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """Eager SAC: every keep's step measured interleaved with the others'."""
    plans = {
        keep: quiet_plan(case.graph, keep, executor="eager", hw=profile) for keep in TIME_KEEPS
    }
    steps = {keep: case.eager_step(plan) for keep, plan in plans.items()}
    runs = timing.interleaved(steps, rounds)
    return [
        time_row(case.name, keep, "eager", plans[keep], m.step_s, m.replay_s)
        for keep, m in ((k, timing.median(r)) for k, r in runs.items())
    ]


def timed_compiled(
    case: TimeCase, keep: str, profile: dict[str, Any], rounds: int
) -> dict[str, Any]:
    """The compile stage: the step compiled from its plan (as the memory rows run it, torch's
    FX interpreter running the partitioned graphs), the median of ``rounds`` steps after two;
    its replay runs inside the backward graph, not measured apart."""
    from functorch.compile import aot_module
    from torch._dynamo.backends.debugging import boxed_nop

    stage = stage_mod.PlanningStage(case.models, keep, hw=profile)
    inputs = case.inputs
    with warnings.catch_warnings(), stage_mod.tracing():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        module = case.module()
        compiled = aot_module(
            module, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=stage.partition_fn
        )
        params = [p for p in module.parameters() if p.requires_grad]

        def step() -> float:
            started = time.perf_counter()
            torch.autograd.grad(compiled(*inputs), params, allow_unused=True)
            return time.perf_counter() - started

        times = [step() for _ in range(rounds + 2)][2:]
    return time_row(
        case.name, keep, "compile", stage.plans[-1], statistics.median(times), None
    )


def time_gap(predicted: float, measured: float | None) -> str:
    return "-" if measured is None else f"{(predicted - measured) / measured:+.0%}"


def time_table(rows: list[dict[str, Any]]) -> str:
    """The time rows as a Markdown table (milliseconds)."""
    lines = [
        "| case | keep | executor | step predicted | step measured | gap | replay predicted "
        "| replay measured | gap |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        replay = r["measured_replay_s"]
        lines.append(
            f"| {r['case']} | {r['keep']} | {r['executor']} | {r['predicted_step_s'] * 1e3:.1f} "
            f"| {r['measured_step_s'] * 1e3:.1f} "
            f"| {time_gap(r['predicted_step_s'], r['measured_step_s'])} "
            f"| {r['predicted_replay_s'] * 1e3:.1f} "
            f"| {'-' if replay is None else f'{replay * 1e3:.1f}'} "
            f"| {time_gap(r['predicted_replay_s'], replay)} |"
        )
    return "\n".join(lines)


def time_summary(rows: list[dict[str, Any]]) -> str:
    """Per executor: the range of the step and replay gaps and how many are within target."""
    lines = [
        "| executor | step gap | step within target | replay gap | replay within target |",
        "|---|--:|--:|--:|--:|",
    ]
    for executor, (step_target, replay_target) in TIME_TARGETS.items():
        mine = [r for r in rows if r["executor"] == executor]
        if not mine:
            continue
        cells = [executor]
        for figure, target in (("step", step_target), ("replay", replay_target)):
            gaps = [
                (r[f"predicted_{figure}_s"] - r[f"measured_{figure}_s"]) / r[f"measured_{figure}_s"]
                for r in mine if r[f"measured_{figure}_s"]
            ]
            if not gaps:
                cells += ["not measured apart", ""]
                continue
            within = sum(abs(g) <= target for g in gaps)
            spread = f"{min(gaps):+.0%} .. {max(gaps):+.0%}"
            cells += [spread, f"{within}/{len(gaps)} ({target:.0%})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--zoo", nargs="*", default=list(ZOO), help="zoo goldens to measure")
    parser.add_argument(
        "--hf", nargs="*", default=None, help="HuggingFace families (default: all)"
    )
    parser.add_argument("--executor", nargs="*", choices=EXECUTORS, default=list(EXECUTORS))
    parser.add_argument(
        "--no-offload", dest="offload", action="store_false",
        help="leave out the rows that offload what each unit keeps",
    )
    parser.add_argument(
        "--time", nargs="*", default=None, metavar="CASE",
        help="also measure time: these budget-ranking cases (none given: all of them)",
    )
    parser.add_argument(
        "--time-hf", nargs="*", default=None, metavar="FAMILY",
        help="also measure time: these HuggingFace families at TIME_HF_SHAPE (none given: all)",
    )
    parser.add_argument("--time-rounds", type=int, default=7, help="steps per time figure")
    parser.add_argument(
        "--time-only", action="store_true",
        help="measure time alone; with --markdown, rewrite only that file's Time section",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--markdown", help="also write the summary and the full table here")
    args = parser.parse_args(argv)
    families = list(hf_families()) if args.hf is None else args.hf
    cases = [lambda n=n: zoo_case(n, args.batch, args.seq) for n in args.zoo]
    cases += [lambda f=f: hf_case(f, args.batch, args.seq) for f in families]
    if args.time_only:
        if args.time is None and args.time_hf is None:
            parser.error("--time-only measures time: give --time or --time-hf too")
        cases = []
    rows = []
    for make in cases:
        case = make()
        for label, keep in keeps(case):
            for executor in args.executor:
                measured = MEASURES[executor](case, label, keep)
                rows.append(measured)
                print(table([measured]).splitlines()[-1], file=sys.stderr, flush=True)
        offloading = [e for e in args.executor if e in OFFLOADING] if args.offload else []
        for unit in [*case.units, None] if offloading else []:
            for executor in offloading:
                rows.append(measure_offloaded(case, unit, executor))
                print(table([rows[-1]]).splitlines()[-1], file=sys.stderr, flush=True)
    times = []
    if args.time is not None or args.time_hf is not None:
        ranking = [] if args.time is None else args.time or list(timing.RANKING_CASES)
        hf = [] if args.time_hf is None else args.time_hf or list(hf_families())
        unknown = sorted(set(hf) - set(hf_families()) | set(ranking) - set(timing.RANKING_CASES))
        if unknown:
            parser.error(f"no such time case: {', '.join(unknown)}")
        times = time_rows(ranking, args.time_rounds, hf)
    shape = (f"batch {args.batch}, seq {args.seq}; fp32 (HF MoE families bf16); CPU allocator "
             "(eager, compile), the runtime's storage count (graph)")
    print(f"{shape}\n\n{summary(rows)}\n\n{table(rows)}")
    if times:
        print(f"\n{time_summary(times)}\n\n{time_table(times)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"batch": args.batch, "seq": args.seq, "rows": rows, "time_rows": times},
                out, indent=1,
            )
    if args.markdown and args.time_only:
        replace_time_section(Path(args.markdown), times)
    elif args.markdown:
        Path(args.markdown).write_text(markdown(shape, rows, times))
    return 0


def markdown(shape: str, rows: list[dict[str, Any]], times: list[dict[str, Any]]) -> str:
    text = (
        "# Predictions against measurement\n\n"
        "Written by `python scripts/predictions.py --time --markdown docs/predictions.md` (what "
        "each executor is and how it is measured: the script's docstring; why the gaps are what "
        "they are: docs/accuracy.md, \"How good the predictions are\").\n\n"
        f"{shape}.\n\n## Summary\n\n{summary(rows)}\n\n## Every case\n\n{table(rows)}\n"
    )
    if times:
        text += time_section(times)
    return text


TIME_HEADING = "\n## Time\n"


def time_section(times: list[dict[str, Any]]) -> str:
    return (
        f"{TIME_HEADING}\n"
        "Step and replay, predicted against measured (ms; medians), at widths where a "
        "layer's matmuls take milliseconds on this CPU: the budget ranking's models "
        "(four layers of 256, 4 heads of 64, batch 2 x 256; `_step_timing.RANKING_CASES`) "
        "and the HuggingFace families at the same widths (`TIME_HF_SHAPE`: FFN 1024, "
        "vocabulary 4096, 2 key-value heads; the MoE families in bfloat16, their "
        "`moe_intermediate_size` 256, Mixtral's experts the FFN's width, qwen2-moe's shared "
        "expert and DeepSeek-V3's latent attention as in the memory rows). "
        "Each case's rows plan with profiles measured just before them: the runtime "
        "(`graph`) with one `planner calibrate` measures through the same binary, eager SAC "
        "and the compile stage with one `rp.calibrate` measures. The runtime keeps the CPU "
        "memory it obtains, as a GPU's caching allocator does (docs/runtime.md, \"Time\"). "
        "The compile stage's step runs its partitioned graphs in torch's FX interpreter, "
        "as the memory rows do, and its replay is not measured apart. Targets: the "
        "runtime's step within 10% and replay within 15%, the others within 25%. Only this "
        "section: `python scripts/predictions.py --time --time-hf --time-only --markdown "
        "docs/predictions.md`.\n\n"
        f"{time_summary(times)}\n\n{time_table(times)}\n"
    )


def replace_time_section(path: Path, times: list[dict[str, Any]]) -> None:
    """Rewrites the Time section of the table at `path`, leaving the memory rows as they are."""
    text = path.read_text()
    if TIME_HEADING in text:
        text = text[: text.index(TIME_HEADING)]
    path.write_text(text.rstrip("\n") + "\n" + time_section(times))


if __name__ == "__main__":
    sys.exit(main())
