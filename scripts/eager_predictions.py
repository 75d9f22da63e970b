"""The eager executor's predictions against measurement: peak and saved bytes of one training
step under eager selective checkpointing (`recompute_planner.sac`), predicted by the planner
(`--executor eager`) and measured from the CPU allocator (`recompute_planner.measure`).

Cases: every zoo golden whose model runs eagerly on this CPU, re-exported at the chosen shape
(multi-rank models as rank 0 of the fake process group they are traced with), and tiny stock
HuggingFace models (random weights, nothing downloaded). Per case, `--keep none`, `all` and
each declared unit alone. "Saved" is what the step holds when forward ends, the loss aside:
predicted, the plan's saved activation bytes; measured, the allocator's live bytes then.

    python scripts/eager_predictions.py                     # batch 8, seq 64: the README table
    python scripts/eager_predictions.py --batch 2 --seq 8   # small: what the test runs
    python scripts/eager_predictions.py --json out.json     # rows for tools and tests
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

import recompute_planner as rp
from recompute_planner import measure, sac

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
# The zoo's golden shape, which MoE capacities (static tokens per expert) are scaled from.
ZOO_TOKENS = 2 * 8

DENSE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
MOE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MOE_GATE": ["mlp.gate"]}
# Widths at which activations, not parameters and gradients, dominate a step of batch 8 x 64.
HF_SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
)
MOE_SHAPE = dict(moe_intermediate_size=64)
# MoE families run in bfloat16: their default grouped-matmul experts take nothing else.
BF16 = {"qwen3-moe", "qwen2-moe", "mixtral"}


@dataclass
class Case:
    """One model at one shape: its exported graph, and how to run its step under a plan."""

    name: str
    units: list[str]
    graph: Any
    # A fresh model under the plan's SAC policies: the loss callable and the parameters.
    step: Callable[[rp.Plan], tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]
    input_bytes: int
    keep_all: Any = "all"
    # Multi-rank zoo models run as rank 0 of the fake process group they were traced in.
    world_size: int = 1


def zoo_config(name: str, batch: int, seq: int):
    from recompute_planner.zoo.goldens import golden

    cfg = golden(name).entry.config
    scale = batch * seq / ZOO_TOKENS
    return dataclasses.replace(
        cfg, batch=batch, seq=seq, capacity=max(cfg.capacity, round(cfg.capacity * scale))
    )


def zoo_case(name: str, batch: int, seq: int) -> Case:
    from recompute_planner.export import export_joint
    from recompute_planner.zoo.catalog import declared_units, make_inputs, model_decls
    from recompute_planner.zoo.goldens import traced_group
    from recompute_planner.zoo.model import CausalLM

    cfg = zoo_config(name, batch, seq).for_rank(zoo_config(name, batch, seq).world_size, 0)
    inputs = make_inputs(cfg)
    with traced_group(cfg.world_size):
        graph = export_joint(
            CausalLM(cfg), inputs, name=name, models=model_decls(cfg),
            world_size=cfg.world_size, rank=0,
        ).graph

    def step(plan: rp.Plan):
        model = CausalLM(cfg)
        measure.checkpoint_layers(model, {key: sac.context_fn(plan, *key) for key in plan.layers()})
        params = [p for p in model.parameters() if p.requires_grad]
        return (lambda: model(*inputs)), params

    return Case(
        name, list(declared_units(cfg)), graph, step,
        sum(measure.tensor_bytes(t) for t in inputs), KEEP_ALL.get(name, "all"), cfg.world_size,
    )


def hf_families() -> dict[str, tuple[Callable[[], Any], dict[str, list[str]]]]:
    """Stock HuggingFace families: (model builder, units)."""
    import transformers as T

    def build(model_cls, config_cls, **extra):
        def make():
            torch.manual_seed(0)
            return model_cls(config_cls(**HF_SHAPE, **extra))

        return make

    return {
        "llama": (build(T.LlamaForCausalLM, T.LlamaConfig), DENSE_UNITS),
        "llama-eager-attn": (
            build(T.LlamaForCausalLM, T.LlamaConfig, attn_implementation="eager"), DENSE_UNITS,
        ),
        "mistral": (build(T.MistralForCausalLM, T.MistralConfig), DENSE_UNITS),
        "qwen2": (build(T.Qwen2ForCausalLM, T.Qwen2Config), DENSE_UNITS),
        "qwen3": (build(T.Qwen3ForCausalLM, T.Qwen3Config), DENSE_UNITS),
        "qwen3-moe": (
            build(
                T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2,
                **MOE_SHAPE,
            ),
            MOE_UNITS,
        ),
        "qwen2-moe": (
            build(
                T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2,
                shared_expert_intermediate_size=64, **MOE_SHAPE,
            ),
            MOE_UNITS,
        ),
        "mixtral": (
            build(T.MixtralForCausalLM, T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
            MOE_UNITS,
        ),
    }


def hf_case(family: str, batch: int, seq: int) -> Case:
    from recompute_planner.model_export import causal_mask

    build, units = hf_families()[family]
    dtype = torch.bfloat16 if family in BF16 else torch.float32

    def make():
        return build().to(dtype)

    ids = torch.randint(0, HF_SHAPE["vocab_size"], (batch, seq),
                        generator=torch.Generator().manual_seed(3))
    mask = causal_mask(batch, seq, dtype)
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    model = make()
    rp.annotate(model, layers="model.layers", units=units)
    graph = rp.export(model, inputs, name=family).graph

    def step(plan: rp.Plan):
        model = make()
        rp.annotate(model, layers="model.layers", units=units)
        sac.checkpoint_layers(model.model.layers, plan)
        params = [p for p in model.parameters() if p.requires_grad]
        return (lambda: model(**inputs).loss), params

    return Case(
        family, list(units), graph, step, sum(measure.tensor_bytes(t) for t in inputs.values())
    )


def keeps(case: Case) -> list[tuple[str, Any]]:
    return [("none", None), ("all", case.keep_all)] + [(u, [u]) for u in case.units]


def measure_case(case: Case, label: str, keep: Any) -> dict[str, Any]:
    """One row: the eager plan's predictions and the measured step under its SAC policies."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(case.graph, keep, executor="eager")
    from recompute_planner.zoo.goldens import traced_group

    with traced_group(case.world_size):
        loss, params = case.step(plan)
        step = measure.measure_step(loss, params, case.input_bytes)
    memory = plan.memory
    return {
        "case": case.name,
        "keep": label,
        "predicted_peak": memory.peak_bytes,
        "measured_peak": step.peak_bytes,
        "predicted_saved": memory.saved_bytes,
        "measured_saved": step.saved_bytes,
        "no_checkpoint_peak": memory.no_checkpoint_peak_bytes,
        "worse_than_no_checkpoint": any(
            d.code == "eager-checkpoint-costs-memory" for d in plan.diagnostics
        ),
    }


def gap(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| case | keep | peak predicted | peak measured | gap | saved predicted | saved measured"
        " | gap | warned |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['keep']} | {r['predicted_peak']:,} | {r['measured_peak']:,} "
            f"| {gap(r['predicted_peak'], r['measured_peak']):+.1%} "
            f"| {r['predicted_saved']:,} | {r['measured_saved']:,} "
            f"| {gap(r['predicted_saved'], max(r['measured_saved'], 1)):+.1%} "
            f"| {'yes' if r['worse_than_no_checkpoint'] else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--zoo", nargs="*", default=list(ZOO), help="zoo goldens to measure")
    parser.add_argument(
        "--hf", nargs="*", default=None, help="HuggingFace families (default: all)"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    families = list(hf_families()) if args.hf is None else args.hf
    cases = [lambda n=n: zoo_case(n, args.batch, args.seq) for n in args.zoo]
    cases += [lambda f=f: hf_case(f, args.batch, args.seq) for f in families]
    rows = []
    for make in cases:
        case = make()
        for label, keep in keeps(case):
            row = measure_case(case, label, keep)
            rows.append(row)
            print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
    print(
        f"batch {args.batch}, seq {args.seq}; fp32 (HF MoE families bf16); CPU allocator\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"batch": args.batch, "seq": args.seq, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
