"""The zoo's named models: configs, declared recompute units, seeded per-rank inputs.

Each entry mirrors a production configuration (dense, MoE with expert parallelism, DSA, compiled
regions); `python/export_goldens.py` exports rank 0 of
each as a golden graph under `tests/golden/`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .._exporter import ModelDecl
from .config import ZooConfig
from .model import MAIN_MODEL, MTP_MODEL, CausalLM

# Unit -> marker intervals, explicit `.begin` / `.end` pairs.
SAVE_ATTN = ("SAVE_ATTN", [("attn.begin", "attn.end")])
SAVE_MOE_GATE = ("SAVE_MOE_GATE", [("moe.gate.begin", "moe.gate.end")])
SAVE_MOE_DISPATCH = (
    "SAVE_MOE_DISPATCH",
    [("moe.dispatch.begin", "moe.dispatch.end"), ("moe.combine.begin", "moe.combine.end")],
)
SAVE_MLP = ("SAVE_MLP", [("mlp.begin", "mlp.end")])
SAVE_DSA_INDEXER = ("SAVE_DSA_INDEXER", [("dsa.indexer.begin", "dsa.indexer.end")])


@dataclass(frozen=True)
class ZooEntry:
    """A named zoo model: its config (rank 0) and what it demonstrates."""

    name: str
    config: ZooConfig
    summary: str

    def build(self, world_size: int | None = None, rank: int = 0) -> CausalLM:
        """The model as `rank` of `world_size` (default: the entry's world) would hold it."""
        return CausalLM(self.config.for_rank(world_size or self.config.world_size, rank))


def declared_units(cfg: ZooConfig) -> dict[str, list[tuple[str, str]]]:
    """The units a model with `cfg` declares: those whose markers its layers record."""
    units = [SAVE_ATTN]
    if cfg.num_experts:
        units += [SAVE_MOE_GATE, SAVE_MOE_DISPATCH]
    units.append(SAVE_MLP)
    if cfg.uses_dsa:
        units.append(SAVE_DSA_INDEXER)
    return {name: list(intervals) for name, intervals in units}


def model_decls(cfg: ZooConfig) -> list[ModelDecl]:
    """The models of one graph: "main", plus the nested "mtp" when the config has MTP."""
    models = [ModelDecl(MAIN_MODEL, cfg.num_layers, declared_units(cfg))]
    if cfg.mtp:
        models.append(ModelDecl(MTP_MODEL, 1, declared_units(cfg), parent=MAIN_MODEL))
    return models


def make_inputs(cfg: ZooConfig) -> tuple[torch.Tensor, ...]:
    """Seeded inputs of this rank: tokens, next-token labels and, for MTP, the two after.

    One token stream of `global_seq + 2` per sequence; a sequence-parallel (DSA) model shares
    the stream across ranks and takes its shard, any other model draws its own per rank.
    """
    stream_seed = 1_000 + cfg.seed * 97 + (0 if cfg.uses_dsa else cfg.rank)
    gen = torch.Generator().manual_seed(stream_seed)
    stream = torch.randint(cfg.vocab, (cfg.batch, cfg.global_seq + 2), generator=gen)
    first = cfg.rank * cfg.seq if cfg.uses_dsa else 0

    def shifted(offset: int) -> torch.Tensor:
        return stream[:, first + offset : first + offset + cfg.seq].contiguous()

    inputs = (shifted(0), shifted(1))
    return inputs + (shifted(1), shifted(2)) if cfg.mtp else inputs


_MOE = ZooConfig(num_experts=4, world_size=2)
_GLM = ZooConfig(num_experts=4, world_size=2, first_dense_layers=1, index_topk=4, mtp=True)

ENTRIES: tuple[ZooEntry, ...] = (
    ZooEntry("dense", ZooConfig(), "Llama-like dense decoder, eager"),
    ZooEntry("moe_ep2", _MOE, "MoE, expert parallel over 2 ranks, eager"),
    ZooEntry(
        "moe_ep2_compiled",
        dataclasses.replace(_MOE, compile="ep"),
        "MoE EP2 with the expert-parallel compile config",
    ),
    ZooEntry("moe_ep4", _MOE.for_rank(4, 0), "MoE, expert parallel over 4 ranks, eager"),
    ZooEntry(
        "moe_layer_compiled",
        dataclasses.replace(_MOE, world_size=1, compile="layer"),
        "MoE without EP, the whole decoder layer compiled as one region",
    ),
    ZooEntry(
        "moe_domino",
        dataclasses.replace(_MOE, micro_batches=2),
        "MoE EP2, two intra-layer micro-batches (domino path)",
    ),
    ZooEntry(
        "moe_ep2_inplace",
        dataclasses.replace(_MOE, inplace_dispatch=True),
        "MoE EP2, read-modify-write index_add_ inside the dispatch interval",
    ),
    ZooEntry(
        "moe_ep2_unbalanced",
        dataclasses.replace(
            _MOE,
            omitted_markers=frozenset({(0, "moe.dispatch.end"), (1, "moe.combine.begin")}),
        ),
        "MoE EP2, layer 0 lacks moe.dispatch.end, layer 1 lacks moe.combine.begin",
    ),
    ZooEntry("glm_dsa_ep2", _GLM, "GLM-5.2/DeepSeek-V3.2-like: DSA, MoE, MTP; EP2 and SP2"),
    ZooEntry(
        "glm_dsa_ep2_compiled",
        dataclasses.replace(_GLM, compile="ep"),
        "glm_dsa_ep2 with the EP compile config",
    ),
    ZooEntry(
        "moe_hf_router",
        dataclasses.replace(_MOE, world_size=1, hf_moe=True),
        "MoE in HuggingFace idioms: in-place router normalisation, one_hot routing, dispatch "
        "buffers made and filled in place inside the interval",
    ),
    ZooEntry(
        "dsv3_kv_expand",
        ZooConfig(mla=True),
        "DeepSeek-V3 MLA attention: queries and keys filled slice by slice into new_empty "
        "buffers",
    ),
    ZooEntry(
        "dense_dropout",
        ZooConfig(dropout=0.1),
        "dense decoder, training dropout inside SAVE_ATTN and outside every interval",
    ),
)


def entry(name: str) -> ZooEntry:
    """The zoo entry called `name`; the error lists the valid names."""
    for candidate in ENTRIES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no zoo model {name!r}; known: {', '.join(e.name for e in ENTRIES)}")
