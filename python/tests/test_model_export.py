"""Exporting a model you did not write: `recompute_planner.annotate` + `recompute_planner.export`
on stock HuggingFace models (tiny configurations built from a config with random weights,
nothing downloaded): Llama (dense) and Qwen3-MoE (routed experts).

No wrapper module, no source edit: `annotate` places the layer scopes and the unit markers
(in a forward on each annotated module's class), and the known tracing failures say what to
do.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import warnings

import pytest
import torch
from safetensors.torch import load_file

import recompute_planner as rp
from export_support import fake_process_group, planner_run, run_planner
from recompute_planner import sac
from recompute_planner._exporter import write_graph, write_reference
from recompute_planner.errors import NoLayersWarning, OwnCheckpointingWarning
from recompute_planner.model_export import causal_mask
from recompute_planner.proto import graph_pb2

transformers = pytest.importorskip("transformers")

DENSE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MLP": ["mlp"]}
MOE_UNITS = {"SAVE_ATTN": ["self_attn"], "SAVE_MOE_GATE": ["mlp.gate"]}
# Training configurations with the KV cache off in the config (the export and eager SAC turn
# a cache on in the config off themselves: tests of that turn it on).
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


def test_annotation_leaves_the_models_classes_names_and_weights_and_remove_restores_them():
    """The annotation runs in a forward on each annotated module's class (a subclass named as
    the class): types, ``repr``, state dict keys are the model's; a deep copy runs its own
    weights, annotated too; ``remove`` gives every module its class back."""
    model = llama()
    classes = {name: type(m) for name, m in model.named_modules()}
    described, keys = repr(model), list(model.state_dict())
    annotation = rp.annotate(model, layers="model.layers", units=DENSE_UNITS)
    annotated = {name: type(m) for name, m in model.named_modules()}
    assert {n for n, cls in annotated.items() if cls is not classes[n]} == {
        f"model.layers.{i}{part}" for i in (0, 1) for part in ("", ".self_attn", ".mlp")
    }
    assert all(issubclass(annotated[n], cls) and annotated[n].__name__ == cls.__name__
               for n, cls in classes.items())
    assert repr(model) == described and list(model.state_dict()) == keys

    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.model.layers[1].mlp.down_proj.weight.zero_()
    inputs = tokens()
    assert not torch.equal(copied(**inputs).logits, model(**inputs).logits)
    plan = planned(rp.export(copied, inputs).graph, list(DENSE_UNITS))
    assert kept_units_by_layer(plan) == {(i, unit) for i in (0, 1) for unit in DENSE_UNITS}

    annotation.remove()
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert not any("_recompute_planner_annotated" in m.__dict__ for m in model.modules())


def test_a_forward_replaced_on_the_instance_is_annotated_around_and_given_back():
    """A framework that replaced a module's forward on the instance (accelerate's hooks do)
    shadows any forward on the class: the annotation then goes around that forward."""
    model = llama()
    wrappers = {}
    for layer in model.model.layers:
        wrappers[layer.mlp] = functools.partial(type(layer.mlp).forward, layer.mlp)
        layer.mlp.forward = wrappers[layer.mlp]
    annotation = rp.annotate(model, layers="model.layers", units=DENSE_UNITS)
    plan = planned(rp.export(model, tokens()).graph, list(DENSE_UNITS))
    assert kept_units_by_layer(plan) == {(i, unit) for i in (0, 1) for unit in DENSE_UNITS}
    annotation.remove()
    assert all(mlp.__dict__["forward"] is wrapper for mlp, wrapper in wrappers.items())


def test_a_units_module_subclassed_since_cannot_become_a_layer_of_another_annotation():
    """A unit's submodule whose class a framework replaced by a subclass after the annotation
    (as FSDP2's ``fully_shard`` does) keeps the unit's forward, which leaves a layer scope out
    of compiled graphs: making it a layer of a second annotation is refused, by name."""
    model = llama()
    outer = rp.annotate(model, layers="model.layers", units=DENSE_UNITS)
    try:
        mlp = model.model.layers[0].mlp
        mlp.__class__ = type(f"Wrapped{type(mlp).__name__}", (type(mlp),), {})
        with pytest.raises(ValueError, match="WrappedLlamaMLP.*annotate the model it is a layer"):
            rp.annotate(model.model.layers[0], layers="mlp", name="inner")
        assert mlp.__dict__["_recompute_planner_annotated"].scope is None
    finally:
        outer.remove()


def test_an_annotation_that_fails_half_way_takes_off_what_it_installed():
    """An error while installing (here, a layer that is a layer of another annotation) leaves
    no scope or marker behind: the model can be annotated once the cause is gone."""
    model = llama()
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([model.model.layers[1]])
    blocker = rp.annotate(holder, layers="layers", name="blocker")
    with pytest.raises(ValueError, match="layer of two annotations"):
        rp.annotate(model, layers="model.layers", units={"SAVE_ATTN": ["self_attn"]})
    assert "_recompute_planner_annotated" not in model.model.layers[0].__dict__
    blocker.remove()
    rp.annotate(model, layers="model.layers", units={"SAVE_ATTN": ["self_attn"]}).remove()


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


def test_sac_matches_eager_attentions_matmul_views_to_the_traced_ones():
    """HF's eager attention multiplies 4D tensors with `matmul`, which eager returns through
    `_unsafe_view` where the trace has a `view`: eager SAC keeping the attention still finds
    every kept op, and the step's gradients are the plain step's."""
    def eager_attention_llama():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**SHAPE, attn_implementation="eager")
        )

    model = eager_attention_llama()
    rp.annotate(model, units=DENSE_UNITS)
    batch = {k: v for k, v in tokens().items() if k != "attention_mask"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.PlannerWarning)
        plan = rp.plan(rp.export(model, batch), list(DENSE_UNITS), executor="eager")
    policies = sac.checkpoint_layers(model.model.layers, plan)

    def step(m):
        loss = m(**batch).loss
        return loss, torch.autograd.grad(loss, list(m.parameters()))

    (loss, grads), (plain_loss, plain_grads) = step(model), step(eager_attention_llama())
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    assert all(policy.held_bytes() > 0 for policy in policies.values())


def test_sac_turns_the_kv_cache_off_while_checkpointing_and_back_on_after():
    """A config with `use_cache=True` (the default of most): the layers would update the cache
    again in their recompute. `checkpoint_layers` turns it off, says so, and `remove()` puts
    the layers and the cache back; the step's gradients are the plain step's."""
    def cached_llama():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**{**SHAPE, "use_cache": True})
        )

    model = cached_llama()
    rp.annotate(model, units=DENSE_UNITS)
    plan = planned(rp.export(model, tokens()).graph, ["SAVE_MLP"])
    assert model.config.use_cache is True
    layers = list(model.model.layers)
    with pytest.warns(rp.KvCacheOffWarning, match=r"config\.use_cache=False"):
        checkpointed = sac.checkpoint_layers(model.model.layers, plan)
    assert model.config.use_cache is False

    def step(m):
        loss = m(**tokens()).loss
        return loss, torch.autograd.grad(loss, list(m.parameters()))

    (loss, grads), (plain_loss, plain_grads) = step(model), step(cached_llama())
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))
    assert all(policy.held_bytes() > 0 for policy in checkpointed.values())
    checkpointed.remove()
    assert list(model.model.layers) == layers and model.config.use_cache is True


def test_export_takes_the_loss_out_of_a_tuple():
    """`return_dict=False`: the model returns a tuple, the loss first."""
    model = llama()
    as_tuple = rp.export(model, {**tokens(), "return_dict": False})
    assert torch.equal(as_tuple.loss, rp.export(model, tokens()).loss)


# --------------------------------------------------------------------------------------------
# Masks: the model's own


def _sliding(name: str):
    """Models whose layers do not all attend causally over the whole sequence (windows of 3
    tokens in a sequence of 8), and a Llama with tied input and output embeddings."""
    window = dict(sliding_window=3)
    mixed = dict(layer_types=["full_attention", "sliding_attention"], **window)
    configs = {
        "mistral": ("MistralConfig", "MistralForCausalLM", window),
        "qwen2_mixed": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, **mixed)),
        "qwen3_mixed": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, **mixed)),
        "gemma3_tied": (
            "Gemma3TextConfig", "Gemma3ForCausalLM",
            dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
        ),
        "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    }
    config_name, model_name, extra = configs[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**SHAPE, "use_cache": True, **extra})
    return getattr(transformers, model_name)(config)


def run_checked(result, tmp_path) -> subprocess.CompletedProcess:
    """`planner run --check` on the exported graph and its reference: the graph's loss and
    gradients are PyTorch's within tolerance."""
    write_graph(result.graph, tmp_path / "step.pb")
    write_reference(result, tmp_path / "step.safetensors")
    return planner_run(str(tmp_path / "step.pb"), "--check")


@pytest.mark.parametrize(
    "name", ["mistral", "qwen2_mixed", "qwen3_mixed", "gemma3_tied", "llama_tied"]
)
def test_export_keeps_the_models_own_masks(name, tmp_path):
    """No mask given: the model builds its own (sliding windows, a mask per layer type), and
    the exported step's loss is the model's own loss, computed by the graph itself."""
    model = _sliding(name)
    units = {"SAVE_ATTN": ["self_attn"]}
    rp.annotate(model, units=units)
    inputs = {k: v for k, v in tokens().items() if k != "attention_mask"}
    result = rp.export(model, inputs)
    assert torch.equal(result.loss, model(**inputs).loss.detach())
    done = run_checked(result, tmp_path)
    assert done.returncode == 0, done.stderr
    # The model's own masks reach the layers: a sliding window is a mask tensor input.
    mask_inputs = [
        v for v in result.graph.values
        if v.role == graph_pb2.ROLE_INPUT and v.dtype == graph_pb2.DTYPE_BOOL
    ]
    assert bool(mask_inputs) == (name != "llama_tied")


def test_a_per_layer_type_mask_dict_is_an_input(tmp_path):
    """HF's `{"full_attention": ..., "sliding_attention": ...}`: its masks are inputs, and
    masks built right give the model's own loss, in the graph too."""
    model = _sliding("qwen2_mixed")
    inputs = {k: v for k, v in tokens().items() if k != "attention_mask"}
    query, key = torch.arange(8)[:, None], torch.arange(8)[None, :]
    full = (key <= query).expand(2, 1, 8, 8)
    sliding = full & (query - key < 3)
    masks = {"full_attention": full, "sliding_attention": sliding}
    result = rp.export(model, {**inputs, "attention_mask": masks})
    assert torch.equal(result.loss, model(**inputs).loss.detach())
    done = run_checked(result, tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_padding_mask_exports_with_the_models_own_padding(tmp_path):
    """A 2D padding mask: the model's padding code branches on its data, eagerly; the layers
    receive the mask it built, and the graph computes the model's own loss."""
    model = llama()
    rp.annotate(model, units=DENSE_UNITS)
    inputs = tokens()
    inputs["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    inputs["attention_mask"][1, :2] = 0
    result = rp.export(model, inputs)
    assert torch.equal(result.loss, model(**inputs).loss.detach())
    done = run_checked(result, tmp_path)
    assert done.returncode == 0, done.stderr


def test_export_for_several_ranks_writes_what_planner_run_reads(tmp_path):
    """`world_size=2` without a process group: one call exports both data-parallel ranks
    (each its half of the batch), `.write` puts rank 0's graph and every rank's tensors where
    `planner run --ranks 2` reads them, and the run checks every rank against PyTorch."""
    model = llama()
    rp.annotate(model, units=DENSE_UNITS)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    result = rp.export(model, {"input_ids": ids, "labels": ids}, world_size=2)
    written = result.write(tmp_path / "step.pb")
    assert [p.name for p in written] == ["step.pb", "step.safetensors", "step.rank1.safetensors"]
    rank1 = load_file(str(tmp_path / "step.rank1.safetensors"))
    assert torch.equal(rank1["input/input.0"], ids[2:])
    assert torch.equal(rank1["ref/loss"], model(input_ids=ids[2:], labels=ids[2:]).loss.detach())
    done = planner_run(str(tmp_path / "step.pb"), "--ranks", "2", "--keep", "save_mlp", "--check")
    assert done.returncode == 0, done.stderr
    with pytest.raises(rp.ExportError, match=r"shape \[3, 8\] does not split into 2"):
        rp.export(model, {"input_ids": ids[:3], "labels": ids[:3]}, world_size=2)


def test_in_a_process_group_each_process_writes_its_own_rank(tmp_path):
    """Rank 1 of a process group exports its own step with the batch it is given, and writes
    its graph and tensors under rank 1's names."""
    model = llama()
    rp.annotate(model, units=DENSE_UNITS)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    with fake_process_group(2, rank=1):
        result = rp.export(model, {"input_ids": ids, "labels": ids})
    assert (result.graph.metadata.world_size, result.graph.metadata.rank) == (2, 1)
    written = result.write(tmp_path / "step.pb")
    assert [p.name for p in written] == ["step.rank1.pb", "step.rank1.safetensors"]
    assert torch.equal(load_file(str(written[1]))["input/input.0"], ids)


def test_float32_grouped_experts_name_bfloat16_first_and_torchs_log_after(capfd):
    """HF's default grouped experts in float32: torch logs the failed fake kernel as a
    traceback before it raises. The error starts with the cause and fix on one line, torch's
    log follows it, and nothing reaches stderr before."""
    with pytest.raises(rp.ExportError) as raised:
        rp.export(qwen3_moe(torch.float32), tokens())
    first, _, rest = str(raised.value).partition("\n")
    assert re.match(
        r"`torch\._grouped_mm`.*accepts only bfloat16.*model\.to\(torch\.bfloat16\)", first
    )
    assert "failed while attempting to run meta for aten._grouped_mm" in rest
    assert "_grouped_mm" not in capfd.readouterr().err


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


def test_a_model_exported_without_annotate_warns_and_plans_with_a_no_layers_warning(tmp_path):
    # Forgetting `rp.annotate` declares no layer: the plan can only be "no checkpointing",
    # and it says so instead of a silent "keep nothing (whole-layer recompute)".
    model, inputs = llama(), tokens()
    with pytest.warns(NoLayersWarning, match="without declared layers.*Fix: rp.annotate"):
        graph = rp.export(model, inputs).graph
    with pytest.warns(rp.PlannerWarning, match="no-layers-annotated.*declares no decoder layers"):
        plan = rp.plan(graph, ["none"])
    assert plan.nodes and all(n.decision == "no-checkpoint" for n in plan.nodes)
    # The CLI says the same, and `--deny-warnings` turns it into exit code 3.
    write_graph(graph, tmp_path / "step.pb")
    denied = run_planner("plan", str(tmp_path / "step.pb"), "--deny-warnings")
    assert denied.returncode == 3, denied.stderr
    assert "no-layers-annotated" in denied.stdout + denied.stderr


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
