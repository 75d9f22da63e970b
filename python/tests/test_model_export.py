"""Exporting a model you did not write: `recompute_planner.annotate` + `recompute_planner.export`
on stock HuggingFace models (tiny configurations built from a config with random weights,
nothing downloaded): Llama (dense) and Qwen3-MoE (routed experts).

No wrapper module, no replacement `forward`, no monkeypatch: module hooks place the layer
scopes and the unit markers, and the known tracing failures say what to do.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import recompute_planner as rp
from recompute_planner import sac
from recompute_planner.model_export import OwnCheckpointingWarning, causal_mask

transformers = pytest.importorskip("transformers")

DENSE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
MOE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MOE_GATE": ["mlp.gate"]}
# Training configurations: no KV cache (a cache the layers update would differ between a
# checkpointed layer's forward and its recompute).
SHAPE = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_cache=False,
)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))


def qwen3_moe(dtype=torch.bfloat16):
    config = transformers.Qwen3MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(dtype)


def tokens(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Token ids, labels and the 4D causal mask that keeps HuggingFace's mask code static."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids, "attention_mask": causal_mask(2, 8, dtype)}


def planned(graph, keep):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        return rp.plan(graph, keep)


def kept_units_by_layer(plan: rp.Plan) -> set[tuple[int, str]]:
    return {(n.layer, n.unit) for n in plan.nodes if n.decision == "save"}


@pytest.mark.parametrize(
    "build, units",
    [(llama, DENSE_UNITS), (qwen3_moe, MOE_UNITS)],
    ids=["llama-dense", "qwen3-moe"],
)
def test_hooks_place_layers_and_units_on_a_stock_model(build, units):
    model = build()
    annotation = rp.annotate(model, layers="model.layers", units=units)
    inputs = tokens(next(model.parameters()).dtype)
    result = rp.export(model, inputs)
    # The export's eager reference is the model's own loss: the causal mask is the default.
    unmasked = {k: v for k, v in inputs.items() if k != "attention_mask"}
    torch.testing.assert_close(result.loss, model(**unmasked).loss.detach())
    layers = {n.layer for n in result.graph.nodes if n.HasField("layer")}
    assert layers == {0, 1}
    plan = planned(result.graph, list(units))
    assert kept_units_by_layer(plan) == {(layer, unit) for layer in (0, 1) for unit in units}
    assert not [d for d in plan.diagnostics if d.code.startswith("interval")]
    # Without the hooks the same export has no layers and no markers.
    annotation.remove()
    bare = rp.export(model, inputs)
    assert not any(n.HasField("layer") for n in bare.graph.nodes)


def test_the_grouped_experts_buffer_written_in_place_is_recomputed():
    """Qwen3-MoE's grouped-matmul experts fill a fresh buffer with `index_put_`: keeping the
    unit saves its ops but not that buffer, which replays with its writer (and says so)."""
    model = qwen3_moe()
    rp.annotate(model, units={**MOE_UNITS, "SAVE_EXPERTS": ["mlp.experts"]})
    plan = planned(rp.export(model, tokens(torch.bfloat16)).graph, ["SAVE_EXPERTS"])
    assert "kept-output-written-in-place" in {d.code for d in plan.diagnostics}
    buffers = [n for n in plan.nodes if n.op == "aten.empty_like.default" and n.layer is not None]
    assert buffers and all(n.reason == "written-in-place" for n in buffers)
    by_units = {(layer, unit) for layer, unit in kept_units_by_layer(plan) if unit}
    assert by_units == {(0, "SAVE_EXPERTS"), (1, "SAVE_EXPERTS")}


def test_sac_from_the_plan_of_a_stock_model_keeps_its_gradients_bit_identical():
    model = llama()
    rp.annotate(model, units=DENSE_UNITS)
    plan = planned(rp.export(model, tokens()).graph, ["SAVE_MLP"])
    plain = llama()
    checkpointed = llama()
    rp.annotate(checkpointed, units=DENSE_UNITS)
    policies = sac.checkpoint_layers(checkpointed.model.layers, plan)

    def step(m):
        loss = m(**tokens()).loss
        return loss, torch.autograd.grad(loss, list(m.parameters()))

    (loss, grads), (plain_loss, plain_grads) = step(checkpointed), step(plain)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    for policy in policies.values():
        assert policy.held_bytes() > 0
        assert policy.recomputed.count("aten.silu") == 0  # kept by SAVE_MLP


@pytest.mark.parametrize("mask", ["none", "padding"])
def test_hf_mask_code_failures_name_the_causal_mask_fix(mask):
    """Without a mask, the packed-sequence check on position_ids; with a 2D padding mask, the
    padding check: both branch on data while tracing."""
    inputs = tokens()
    if mask == "none":
        del inputs["attention_mask"]
    else:
        inputs["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
        inputs["attention_mask"][1, :2] = 0
    with pytest.raises(rp.ExportError, match=r"_local_scalar_dense.*causal_mask\(batch, seq\)"):
        rp.export(llama(), inputs)


def test_float32_grouped_experts_name_bfloat16():
    with pytest.raises(rp.ExportError, match=r"accepts only bfloat16.*model\.to\(torch\.bfloat16\)"):
        rp.export(qwen3_moe(torch.float32), tokens())


def test_eager_expert_loops_name_nonzero():
    model = qwen3_moe()
    model.config._experts_implementation = "eager"
    with pytest.raises(rp.ExportError, match=r"aten\.nonzero.*static-shape experts"):
        rp.export(model, tokens(torch.bfloat16))


def test_a_model_checkpointing_itself_gets_a_warning():
    model = llama()
    model.gradient_checkpointing_enable()
    model.train()
    with pytest.warns(OwnCheckpointingWarning, match="gradient_checkpointing_disable"):
        result = rp.export(model, tokens())
    assert model.model.layers[0].gradient_checkpointing  # restored after the export
    assert result.graph.nodes


def test_loss_fn_turns_the_output_into_the_loss():
    model = llama()
    ids, mask = tokens()["input_ids"], tokens()["attention_mask"]
    result = rp.export(
        model, (ids, mask), loss_fn=lambda out: out.logits.float().square().mean()
    )
    assert result.loss is not None and result.loss.dim() == 0
    with pytest.raises(rp.ExportError, match="pass loss_fn"):
        rp.export(model, (ids, mask))


def test_annotation_errors_name_what_exists():
    model = llama()
    with pytest.raises(ValueError, match=r"has no `blocks` \(its children: .*layers"):
        rp.annotate(model, layers="model.blocks")
    with pytest.raises(ValueError, match=r"no layer has a submodule or method `moe`.*self_attn"):
        rp.annotate(model, units={"SAVE_MOE": ["moe"]})


def test_a_model_exported_without_annotate_plans_with_a_no_layers_warning():
    # Forgetting `rp.annotate` declares no layer: the plan can only be "no checkpointing",
    # and it says so instead of a silent "keep nothing (whole-layer recompute)".
    model, inputs = llama(), tokens()
    graph = rp.export(model, inputs).graph
    with pytest.warns(rp.PlannerWarning, match="no-layers-annotated.*declares no decoder layers"):
        plan = rp.plan(graph, ["none"])
    assert plan.nodes and all(n.decision == "no-checkpoint" for n in plan.nodes)


def test_tied_input_and_output_embeddings_export_as_one_weight_with_the_models_loss():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True)
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rp.annotate(model, layers="model.layers", units=DENSE_UNITS)
    inputs = tokens()
    result = rp.export(model, inputs)
    unmasked = {k: v for k, v in inputs.items() if k != "attention_mask"}
    loss = model(**unmasked).loss
    torch.testing.assert_close(result.loss, loss.detach())
    names = {v.name for v in result.graph.values}
    assert any(n.endswith("embed_tokens.weight") for n in names)
    assert not any(n.endswith("lm_head.weight") for n in names)
    # The one weight's gradient sums the embedding's and the output projection's.
    model.zero_grad()
    loss.backward()
    embedding = model.model.embed_tokens.weight.grad
    matching = [g for g in result.grads.values() if g.shape == embedding.shape]
    assert len(matching) == 1
    torch.testing.assert_close(matching[0], embedding)
    plan = planned(result.graph, list(DENSE_UNITS))
    assert kept_units_by_layer(plan) == {(layer, unit) for layer in (0, 1) for unit in DENSE_UNITS}


def deepseek_v3():
    """DeepSeek-V3's shape in miniature: MLA attention, a dense first layer, then MoE."""
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in SHAPE.items() if k not in ("head_dim", "num_key_value_heads")},
        num_key_value_heads=2,
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
    )
    torch.manual_seed(0)
    # bfloat16: the default grouped-matmul experts accept nothing else.
    return transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)


def test_units_by_method_and_units_absent_from_dense_layers_need_no_source_edit():
    model = deepseek_v3()
    units = {"SAVE_MOE_GATE": ["mlp.gate"], "SAVE_KV_EXPAND": ["self_attn.expand_kv"]}
    annotation = rp.annotate(model, layers="model.layers", units=units)
    # Layer 0 is dense: the gate applies where it exists, and the annotation says where not.
    assert annotation.absent == {"SAVE_MOE_GATE": {"mlp.gate": [0]}}
    inputs = tokens(torch.bfloat16)
    result = rp.export(model, inputs)
    unmasked = {k: v for k, v in inputs.items() if k != "attention_mask"}
    torch.testing.assert_close(result.loss, model(**unmasked).loss.detach())
    plan = planned(result.graph, list(units))
    assert kept_units_by_layer(plan) == {
        (1, "SAVE_MOE_GATE"), (0, "SAVE_KV_EXPAND"), (1, "SAVE_KV_EXPAND")
    }
    assert not [d for d in plan.diagnostics if d.code.startswith(("interval", "marker"))]
    # The method wrapper lives on the instance and goes with the annotation.
    attention = model.model.layers[0].self_attn
    assert "expand_kv" in vars(attention)
    annotation.remove()
    assert "expand_kv" not in vars(attention)
