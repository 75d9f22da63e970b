"""Tiny model configurations of the zoo.

Every zoo model is built from one frozen `ZooConfig`; the dimensions are tiny on purpose, so a
model exports in seconds on CPU and its golden graph stays far below 300 KB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

# How much of each decoder layer runs under torch.compile:
# - "none": everything eager (DSA layers still compile their indexer and sparse attention);
# - "ep":   the expert-parallel config: `_pre_moe_forward`, the MoE block (routed experts),
#           `_shared_experts_forward` and `_post_moe_forward` are compiled, the dispatcher and
#           the layer body that places the markers stay eager;
# - "layer": the non-EP config: the whole decoder layer body is one compiled region.
CompileConfig = Literal["none", "ep", "layer"]


@dataclass(frozen=True)
class ZooConfig:
    """Dimensions and switches of one zoo model.

    `omitted_markers` lists `(layer, marker)` pairs a layer does not record (the unbalanced
    variant); `hand_markers=False` records no marker at all (the model as a model you did not
    write is: `recompute_planner.annotate` declares its units); `inplace_dispatch` fills the
    dispatch buffer with a read-modify-write `index_add_` instead of the out-of-place
    `index_add` (the in-place variant). The variants written the
    way stock HuggingFace model code is: `hf_moe` (the router normalises its weights in place,
    dispatch routes with `F.one_hot` and fills fresh buffers in place, `moe.HFDispatcher`),
    `mla` (DeepSeek-V3 attention, which builds its queries and keys by filling `new_empty`
    buffers slice by slice, `mla.MLAAttention`) and `dropout` (the probability of a training
    dropout on the attention output, inside the attention interval, and on the MLP output,
    outside every interval; dense layers only).
    """

    vocab: int = 32
    hidden: int = 16
    heads: int = 2
    head_dim: int = 8
    ffn: int = 32
    num_layers: int = 2
    batch: int = 2
    seq: int = 8  # tokens per sequence held by one rank
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    # MoE (num_experts == 0: dense MLP layers)
    num_experts: int = 0
    top_k: int = 2
    capacity: int = 6  # static tokens per expert and source rank; the overflow is dropped
    moe_ffn: int = 16
    shared_ffn: int = 16
    first_dense_layers: int = 0  # layers [0, first_dense_layers) use the dense MLP
    # Parallelism: expert parallel (and, for DSA, sequence parallel) over the whole world
    world_size: int = 1
    rank: int = 0
    micro_batches: int = 1  # > 1: the domino path inside every MoE layer
    compile: CompileConfig = "none"
    # DSA (DeepSeek-V3.2 sparse attention; index_topk == 0: dense sdpa attention)
    index_heads: int = 2  # the indexer's head dimension is head_dim
    index_topk: int = 0
    mtp: bool = False  # one multi-token-prediction layer as the nested model "mtp"
    mtp_loss_weight: float = 0.3
    kv_lora_rank: int = 8  # MLA: width of the compressed key-value latent
    # Variants
    inplace_dispatch: bool = False
    omitted_markers: frozenset[tuple[int, str]] = frozenset()
    hand_markers: bool = True
    hf_moe: bool = False
    mla: bool = False
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        """Rejects combinations the models cannot build, with the reason."""
        if self.num_experts and self.num_experts % self.world_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by world_size={self.world_size}"
            )
        if self.batch % self.micro_batches:
            raise ValueError(
                f"batch={self.batch} does not split into {self.micro_batches} micro-batches"
            )
        if self.micro_batches > 1 and not self.num_experts:
            raise ValueError("the domino micro-batch path exists only in MoE layers")
        if self.index_topk and self.compile == "layer":
            raise ValueError(
                "compile='layer' would compile the DSA top-k, which must run in eager between "
                "dsa.indexer.begin and dsa.indexer.end"
            )
        if self.mla and self.index_topk:
            raise ValueError("attention is either MLA (mla=True) or DSA (index_topk > 0)")
        if self.hf_moe and not self.num_experts:
            raise ValueError("hf_moe changes the MoE router and dispatcher: set num_experts")
        if self.hf_moe and self.inplace_dispatch:
            raise ValueError("hf_moe has its own dispatcher: inplace_dispatch does not apply")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} is not a probability in [0, 1)")
        if self.dropout and self.num_experts:
            raise ValueError("dropout exists only in dense models (num_experts=0)")
        if self.index_topk > self.seq * self.world_size:
            raise ValueError(f"index_topk={self.index_topk} exceeds the sequence length")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")

    @property
    def local_experts(self) -> int:
        """Routed experts held by one rank."""
        return self.num_experts // self.world_size

    @property
    def uses_dsa(self) -> bool:
        """True when attention is DSA sparse attention with the lightning indexer."""
        return self.index_topk > 0

    @property
    def global_seq(self) -> int:
        """Sequence length before sequence-parallel sharding (DSA models shard it over ranks)."""
        return self.seq * self.world_size if self.uses_dsa else self.seq

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer `layer` uses the routed-expert MoE block."""
        return self.num_experts > 0 and layer >= self.first_dense_layers

    def for_rank(self, world_size: int, rank: int) -> ZooConfig:
        """The same model on another rank (or world size)."""
        return dataclasses.replace(self, world_size=world_size, rank=rank)

    def resized(self, **changes: Any) -> ZooConfig:
        """This config with ``changes``. Unless they set ``capacity``, the MoE capacity scales
        with the tokens per rank (batch x seq), never below this config's: at a larger size
        the experts drop about the share of tokens they drop at this one."""
        cfg = dataclasses.replace(self, **changes)
        if "capacity" in changes:
            return cfg
        scale = cfg.batch * cfg.seq / (self.batch * self.seq)
        return dataclasses.replace(cfg, capacity=max(self.capacity, round(self.capacity * scale)))
