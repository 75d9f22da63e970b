//! The op knowledge base: the one place that knows what an op does.
//!
//! Keyed by `namespace.name.overload` (`aten.mm.default`). A lookup tries the exact key, then
//! the overload packet `namespace.name` (any overload), then structural rules (in-place
//! `name_`, `.out` overloads, the `c10d` namespace). An op nobody knows still loads: it gets
//! [`OpInfo::UNKNOWN`], which the planner treats conservatively and `inspect` lists.
//!
//! The table is a sorted static slice with a hash index built at compile time: a lookup hashes
//! the op name once (the packet's hash falls out on the way), binary-searches integers and
//! compares one string. It never allocates; it runs once per node, on graphs of a million nodes
//! (tens of nanoseconds each).
//!
//! Costs are estimates from shapes alone (attributes such as `dim` or `k` are not available):
//! every formula below says what it approximates. All arithmetic is done in `u128` with
//! saturating operations and clamped to `u64`, so absurd shapes give `u64::MAX`, never a panic,
//! and a missing or malformed argument gives zero FLOPs (the op still moves its bytes).

use std::hash::BuildHasher;

use crate::graph::AttrValue;

/// How a collective treats its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CollectiveKind {
    /// Returns a fresh tensor and leaves its inputs alone (`_c10d_functional.*`).
    Functional,
    /// Writes into a caller-provided buffer (`c10d.*_`, out-parameter forms).
    Mutating,
}

/// The shape and element size of one tensor argument, all a cost formula may look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRef<'a> {
    pub shape: &'a [u64],
    pub elem_bytes: u64,
}

/// Work done by one execution of an op. Saturating: absurd shapes give `u64::MAX`, never a panic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Floating-point operations (a multiply-add counts 2).
    pub flops: u64,
    /// Bytes read and written in device memory.
    pub bytes: u64,
    /// Bytes sent to other ranks.
    pub comm_bytes: u64,
}

/// The sizes of one matrix product of a matmul op (one batch's, for a batched one): `[m, k] ×
/// [k, n]`. A dimension of a few elements (a router's experts, an indexer's heads) runs a
/// matmul far below its dtype's rate on some devices, whatever the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulDims {
    pub m: u64,
    pub n: u64,
    pub k: u64,
}

/// Which formula turns argument shapes into a [`Cost`].
///
/// Unless a variant says otherwise, `bytes` is every input and output read or written once
/// (sum of numel × element size over all of them) and `comm_bytes` is zero. Positions below
/// are positions among the node's tensor inputs and outputs; `numel` of a 0-d tensor is 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostModel {
    /// Metadata only (views, symbolic sizes, `wait_tensor`): no work, zero bytes.
    Free,
    /// Bytes only: reads its inputs, writes its outputs, no FLOPs (copies, factories, gathers).
    Memory,
    /// `flops_per_elem × numel(output 0)`. 1 for arithmetic, comparisons and selects;
    /// [`TRANSCENDENTAL_FLOPS`] for exp/log/sqrt/pow/sigmoid/silu/gelu/tanh/sin/cos and their
    /// backward forms (a polynomial or a few special-function instructions per element).
    Elementwise { flops_per_elem: u32 },
    /// `numel(input 0)`: one operation per element reduced (also scans and `nll_loss`).
    Reduction,
    /// `5 × numel(input 0)`: max, subtract, exp, sum, divide (or their backward counterparts).
    Softmax,
    /// `8 × numel(input 0)`: mean, variance, normalise, scale and shift (layer/RMS/group/batch).
    Norm,
    /// `12 × numel(input 0)`: the gradient of a norm, about 1.5× its forward.
    NormBackward,
    /// `numel(input 0) × max(1, ⌈log2 k⌉)`, `k` = last dim of output 0 (a heap of `k` per row;
    /// assumes the selection runs along the last dim).
    TopK,
    /// `numel(input 0) × max(1, ⌈log2 n⌉)`, `n` = last dim of input 0 (comparison sort along
    /// the last dim; the real `dim` is an attribute).
    Sort,
    /// Scatter-accumulate (`index_add`, `scatter_add`, `scatter_reduce`,
    /// `embedding_dense_backward`): bytes plus `numel(output 0)` FLOPs, an upper bound on the
    /// additions that also covers zero-filling the destination.
    Accumulate,
    /// `index_put`: bytes plus `numel(last input)` FLOPs. Whether it accumulates is an
    /// attribute, so the values (the last tensor argument, after the flattened indices) are
    /// counted as if it did.
    IndexPut,
    /// `mm(a [M,K], b [K,N])` (and `_scaled_mm`): `2·M·K·N`.
    Mm,
    /// `addmm(bias, a [M,K], b [K,N])`: `2·M·K·N + M·N`.
    Addmm,
    /// `bmm(a [B,M,K], b [B,K,N])`: `2·B·M·K·N`.
    Bmm,
    /// `baddbmm(self, a [B,M,K], b [B,K,N])`: `2·B·M·K·N + B·M·N`.
    Baddbmm,
    /// `linear(x [...,K], w [N,K], bias?)`: `2·numel(x)/K·K·N = 2·numel(x)·N`, plus
    /// `numel(output 0)` when a bias is present (a 1-D weight means `N = 1`).
    Linear,
    /// `matmul` with any broadcasting: `2·numel(output 0)·K`, `K` = last dim of input 0.
    Matmul,
    /// `_grouped_mm` / `_scaled_grouped_mm`: `2·numel(output 0)·K`, `K` = last dim of input 0,
    /// for the 2-D×3-D (MoE experts: each row of input 0 meets one group's matrix) and
    /// 3-D×3-D forms. The 2-D×2-D form with offsets along `K` (the experts' weight gradients:
    /// `[M, K] × [K, N]`, a `[G, M, N]` output, the offsets cutting `K` into the groups' rows)
    /// multiplies each group's slice of `K` alone: `2·M·N·K` over all groups together.
    GroupedMm,
    /// `convolution(x, w [O, C/groups, k...], bias?)`: `2·numel(output 0)·numel(w)/O`, one
    /// multiply-add per output element and weight of its group. Transposed convolutions (an
    /// attribute) are approximated by the same formula.
    Convolution,
    /// `convolution_backward(grad_out, x, w, ...)`: grad input plus grad weight, each as much
    /// as the forward, `2 × 2·numel(grad_out)·numel(w)/O` (an upper bound when `output_mask`
    /// skips one).
    ConvolutionBackward,
    /// Scaled dot-product attention, `q [B,H,Lq,E]`, `k [B,H,Lk,E]`, `v [B,H,Lk,Ev]` at inputs
    /// 0..3: `2·B·H·Lq·Lk·E` (QKᵀ) `+ 2·B·H·Lq·Lk·Ev` (PV) `+ 5·B·H·Lq·Lk` (softmax). A `q`
    /// with fewer than 4 dims counts all leading dims as batch; GQA is covered since the
    /// head count comes from `q`. Causal masking (an attribute) is not discounted.
    Attention,
    /// The backward of [`CostModel::Attention`], `(grad_out, q, k, v, ...)`:
    /// [`ATTENTION_BACKWARD_FACTOR`] (2.5) × the forward's two matmuls. Backward computes dV,
    /// dP, dQ and dK (twice the forward matmul work) and recomputes P (another half).
    AttentionBackward,
    /// `comm_bytes = bytes(input 0)`: every byte of the input crosses the wire. An upper bound
    /// for an all-to-all (the rank's own slice stays local; the world size is not known here),
    /// and the estimate for any `c10d` collective without an entry of its own.
    AllToAll,
    /// `comm_bytes = bytes(output 0)`, the gathered tensor.
    AllGather,
    /// `comm_bytes = bytes(input 0)`, `flops = numel(input 0)` (the reduction).
    ReduceScatter,
    /// `comm_bytes = 2 × bytes(input 0)` (ring reduce-scatter then all-gather),
    /// `flops = numel(input 0)`.
    AllReduce,
    /// `comm_bytes = bytes(input 0)`.
    Broadcast,
}

/// FLOPs per element of an exp/log/sqrt/pow/sigmoid/silu/gelu/tanh/sin/cos (or its backward):
/// the usual roofline estimate for a special-function evaluation.
pub const TRANSCENDENTAL_FLOPS: u32 = 4;

/// Attention backward over the forward's matmul FLOPs: dV, dP, dQ and dK are twice the forward
/// matmul work, recomputing P is another half. Stored as a ratio: 5/2.
pub const ATTENTION_BACKWARD_FACTOR: (u64, u64) = (5, 2);

/// What the knowledge base knows of one op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpInfo {
    /// True when the op is in the table or matched a structural rule.
    pub known: bool,
    /// Positions (into the node's tensor inputs) the op writes.
    pub mutates: &'static [usize],
    /// An out-parameter form (`.out`, `*_out` overloads, `all_gather_into_tensor_out`): the op
    /// writes a caller-provided `out` tensor whose input position is not knowable from the name
    /// alone, so it is flagged here rather than listed in `mutates`. Counts as a mutable schema.
    pub writes_out: bool,
    /// Position of the input the first output is a view of (positions are small: `u8` keeps
    /// the record, which every node carries, at 32 bytes).
    pub view_of: Option<u8>,
    /// Draws from the RNG (dropout, `rand*`, `normal`, `bernoulli`, ...): replay reproduces the
    /// forward only if the RNG state is restored.
    pub random: bool,
    /// Not random, but replay may not reproduce the forward result, and the result fixes shapes
    /// or indices downstream: `topk` and `sort`/`argsort` (ties), `kthvalue`, `histc`,
    /// `bincount`, `unique`, `nonzero`.
    pub replay_nondeterministic: bool,
    pub collective: Option<CollectiveKind>,
    /// Worth saving rather than recomputing (matmuls, attention, convolutions).
    pub compute_intensive: bool,
    pub cost_model: CostModel,
}

impl OpInfo {
    /// An op nobody knows: no facts beyond what the exporter recorded, memory-bound cost.
    pub const UNKNOWN: OpInfo = OpInfo {
        known: false,
        mutates: &[],
        writes_out: false,
        view_of: None,
        random: false,
        replay_nondeterministic: false,
        collective: None,
        compute_intensive: false,
        cost_model: CostModel::Memory,
    };

    /// Writes some argument in place: `mutates` is not empty, or it is an out-parameter form.
    pub fn has_mutable_schema(&self) -> bool {
        !self.mutates.is_empty() || self.writes_out
    }

    /// The cost of one execution with these tensor arguments.
    pub fn cost(&self, inputs: &[TensorRef<'_>], outputs: &[TensorRef<'_>]) -> Cost {
        let model = self.cost_model;
        let bytes = match model {
            CostModel::Free => 0,
            _ => total_bytes(inputs).saturating_add(total_bytes(outputs)),
        };
        Cost {
            flops: clamp(model.flops(inputs, outputs)),
            bytes: clamp(bytes),
            comm_bytes: clamp(model.comm_bytes(inputs, outputs)),
        }
    }

    /// The matrix product's sizes of a matmul op with these tensor inputs (`mm`, `addmm`,
    /// `bmm`, `baddbmm`, `linear`, `matmul`); `None` for any other op, and for `_grouped_mm`,
    /// whose groups' sizes are offsets, not shapes.
    pub fn matmul_dims(&self, inputs: &[TensorRef<'_>]) -> Option<MatmulDims> {
        let (m, k, n) = match self.cost_model {
            CostModel::Mm => matrix_dims(inputs.first(), inputs.get(1))?,
            CostModel::Addmm => matrix_dims(inputs.get(1), inputs.get(2))?,
            CostModel::Bmm => without_batch(batched_dims(inputs.first(), inputs.get(1))?),
            CostModel::Baddbmm => without_batch(batched_dims(inputs.get(1), inputs.get(2))?),
            CostModel::Linear => linear_dims(inputs)?,
            CostModel::Matmul => matmul_op_dims(inputs)?,
            _ => return None,
        };
        Some(MatmulDims { m, n, k })
    }
}

/// [`lookup`] for one worker converting many nodes: the last op looked up in each of a few
/// hundred slots, picked by a hash of its name. A graph has a few hundred distinct ops and may
/// have millions of nodes; a slot lookup costs a tenth of a table lookup.
pub(crate) struct LookupCache<'a> {
    slots: Box<[Option<(&'a str, OpInfo)>; CACHE_SLOTS]>,
}

const CACHE_SLOTS: usize = 256;

impl<'a> LookupCache<'a> {
    pub fn new() -> Self {
        LookupCache {
            slots: Box::new([None; CACHE_SLOTS]),
        }
    }

    /// What [`lookup`] says of `op`.
    pub fn lookup(&mut self, op: &'a str) -> OpInfo {
        let hash = rustc_hash::FxBuildHasher.hash_one(op);
        let slot = &mut self.slots[hash as usize % CACHE_SLOTS];
        match slot {
            Some((cached, info)) if *cached == op => *info,
            _ => {
                let info = lookup(op);
                *slot = Some((op, info));
                info
            }
        }
    }
}

/// Everything known about `op` (`namespace.name.overload`); [`OpInfo::UNKNOWN`] if nothing.
pub fn lookup(op: &str) -> OpInfo {
    let Some(name) = OpName::parse(op) else {
        return OpInfo::UNKNOWN;
    };
    let packet_hash = key_hash(name.packet);
    let op_hash = fnv1a(packet_hash, &op.as_bytes()[name.packet.len()..]);
    let info = find_hashed(op, op_hash)
        .or_else(|| find_hashed(name.packet, packet_hash))
        .or_else(|| name.in_place_base().and_then(find).map(in_place))
        .or_else(|| structural_collective(&name));
    match info {
        Some(info) => OpInfo {
            writes_out: info.writes_out || name.is_out_overload(),
            ..info
        },
        // An out form of an unknown op: the write is the one fact the name gives away.
        None => OpInfo {
            writes_out: name.is_out_overload(),
            ..OpInfo::UNKNOWN
        },
    }
}

/// The collective an op without an entry of its own is, by its namespace alone: `c10d` ops
/// write their buffers (their in-place forms do not always carry `(a!)`); `_c10d_functional`
/// and `_c10d_functional_autograd` ops return a fresh tensor unless the name ends in `_`.
fn structural_collective(name: &OpName<'_>) -> Option<OpInfo> {
    match name.namespace {
        "c10d" => Some(C10D_COLLECTIVE),
        ns if ns.starts_with("_c10d_functional") && name.name.ends_with('_') => {
            Some(C10D_COLLECTIVE)
        }
        ns if ns.starts_with("_c10d_functional") => Some(FUNCTIONAL_COLLECTIVE),
        _ => None,
    }
}

/// An op name split into its parts; every part is a slice of the name, nothing is copied.
struct OpName<'a> {
    namespace: &'a str,
    name: &'a str,
    overload: &'a str,
    /// `namespace.name`: the key shared by every overload.
    packet: &'a str,
}

impl<'a> OpName<'a> {
    /// `namespace.name[.overload]` with non-empty namespace and name.
    fn parse(op: &'a str) -> Option<Self> {
        let (namespace, rest) = op.split_once('.')?;
        let (name, overload) = rest.split_once('.').unwrap_or((rest, ""));
        if namespace.is_empty() || name.is_empty() {
            return None;
        }
        let packet = &op[..namespace.len() + 1 + name.len()];
        Some(OpName {
            namespace,
            name,
            overload,
            packet,
        })
    }

    /// For `aten.NAME_` (not a dunder such as `__and__`): the packet key `aten.NAME`.
    fn in_place_base(&self) -> Option<&'a str> {
        let dunder = self.name.starts_with("__") && self.name.ends_with("__");
        let in_place = self.namespace == "aten" && self.name.ends_with('_') && !dunder;
        in_place.then(|| &self.packet[..self.packet.len() - 1])
    }

    /// `out`, `out*` or `*_out` overloads (`aten.mm.out`, `aten.sum.IntList_out`).
    fn is_out_overload(&self) -> bool {
        self.overload.starts_with("out") || self.overload.ends_with("_out")
    }
}

/// The table entry for exactly this key.
fn find(key: &str) -> Option<OpInfo> {
    find_hashed(key, key_hash(key))
}

/// The table entry for `key`, whose [`key_hash`] is `hash`: a binary search over integers and
/// one string comparison (the index holds no two equal hashes, a test checks it).
fn find_hashed(key: &str, hash: u64) -> Option<OpInfo> {
    let slot = INDEX.binary_search_by_key(&hash, |&(h, _)| h).ok()?;
    let (candidate, info) = TABLE[INDEX[slot].1];
    (candidate == key).then_some(info)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a over `bytes`, continuing from `state`: a key's hash extends its packet's, so one pass
/// over an op name yields both. `const` so that [`INDEX`] is built at compile time.
const fn fnv1a(mut state: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i < bytes.len() {
        state ^= bytes[i] as u64;
        state = state.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    state
}

const fn key_hash(key: &str) -> u64 {
    fnv1a(FNV_OFFSET, key.as_bytes())
}

/// `(key_hash, position in TABLE)` for every entry, sorted by hash at compile time.
static INDEX: [(u64, usize); TABLE.len()] = hash_index();

/// Insertion sort in a `const fn` (a few hundred entries, evaluated once by the compiler).
const fn hash_index() -> [(u64, usize); TABLE.len()] {
    let mut index = [(0, 0); TABLE.len()];
    let mut i = 0;
    while i < TABLE.len() {
        let entry = (key_hash(TABLE[i].0), i);
        let mut j = i;
        while j > 0 && index[j - 1].0 > entry.0 {
            index[j] = index[j - 1];
            j -= 1;
        }
        index[j] = entry;
        i += 1;
    }
    index
}

/// An in-place variant: the functional op's facts, writing its first argument.
fn in_place(base: OpInfo) -> OpInfo {
    OpInfo {
        mutates: &[0],
        ..base
    }
}

// ---------------------------------------------------------------------------------------------
// Profiles: the facts shared by a family of ops. The table maps each key to one of these.

/// A known op with no effects and this cost model; the profiles below refine it.
const fn known(cost_model: CostModel) -> OpInfo {
    OpInfo {
        known: true,
        cost_model,
        ..OpInfo::UNKNOWN
    }
}

const fn compute_intensive(cost_model: CostModel) -> OpInfo {
    OpInfo {
        compute_intensive: true,
        ..known(cost_model)
    }
}

const fn replay_nondeterministic(cost_model: CostModel) -> OpInfo {
    OpInfo {
        replay_nondeterministic: true,
        ..known(cost_model)
    }
}

const fn functional(cost_model: CostModel) -> OpInfo {
    OpInfo {
        collective: Some(CollectiveKind::Functional),
        ..known(cost_model)
    }
}

/// A collective writing into its first argument (`c10d.*_`, `_c10d_functional.*_`).
const fn mutating(cost_model: CostModel) -> OpInfo {
    OpInfo {
        mutates: &[0],
        collective: Some(CollectiveKind::Mutating),
        ..known(cost_model)
    }
}

/// Aliases input 0, costs nothing.
const VIEW: OpInfo = OpInfo {
    view_of: Some(0),
    ..known(CostModel::Free)
};
const FREE: OpInfo = known(CostModel::Free);
/// Copies, factories, concatenations, reshapes that may copy, and the recompute marker.
const MEMORY: OpInfo = known(CostModel::Memory);
const GATHER: OpInfo = known(CostModel::Memory);
const ACCUMULATE: OpInfo = known(CostModel::Accumulate);
const INDEX_PUT: OpInfo = known(CostModel::IndexPut);
const ARITH: OpInfo = known(CostModel::Elementwise { flops_per_elem: 1 });
const TRANSCENDENTAL: OpInfo = known(CostModel::Elementwise {
    flops_per_elem: TRANSCENDENTAL_FLOPS,
});
const REDUCTION: OpInfo = known(CostModel::Reduction);
const SOFTMAX: OpInfo = known(CostModel::Softmax);
const NORM: OpInfo = known(CostModel::Norm);
const NORM_BACKWARD: OpInfo = known(CostModel::NormBackward);
const RANDOM: OpInfo = OpInfo {
    random: true,
    ..known(CostModel::Memory)
};
const MM: OpInfo = compute_intensive(CostModel::Mm);
const ADDMM: OpInfo = compute_intensive(CostModel::Addmm);
const BMM: OpInfo = compute_intensive(CostModel::Bmm);
const BADDBMM: OpInfo = compute_intensive(CostModel::Baddbmm);
const LINEAR: OpInfo = compute_intensive(CostModel::Linear);
const MATMUL: OpInfo = compute_intensive(CostModel::Matmul);
const GROUPED_MM: OpInfo = compute_intensive(CostModel::GroupedMm);
const CONVOLUTION: OpInfo = compute_intensive(CostModel::Convolution);
const CONVOLUTION_BACKWARD: OpInfo = compute_intensive(CostModel::ConvolutionBackward);
const ATTENTION: OpInfo = compute_intensive(CostModel::Attention);
/// The fused attention kernels: they draw a dropout mask when called with `dropout_p > 0`
/// (their schemas carry `nondeterministic_seeded`); [`attribute_default`] knows that an omitted
/// `dropout_p` is 0, so the default call draws nothing.
const DROPOUT_ATTENTION: OpInfo = OpInfo {
    random: true,
    ..ATTENTION
};
const ATTENTION_BACKWARD: OpInfo = compute_intensive(CostModel::AttentionBackward);
const TOPK: OpInfo = replay_nondeterministic(CostModel::TopK);
const SORT: OpInfo = replay_nondeterministic(CostModel::Sort);
/// `unique` sorts its input.
const UNIQUE: OpInfo = replay_nondeterministic(CostModel::Sort);
/// `kthvalue`, `histc`: one pass over the input.
const SELECTION: OpInfo = replay_nondeterministic(CostModel::Reduction);
/// `bincount`, `nonzero`: output shape depends on the data.
const DATA_DEPENDENT: OpInfo = replay_nondeterministic(CostModel::Memory);
const FUNCTIONAL_ALL_TO_ALL: OpInfo = functional(CostModel::AllToAll);
const FUNCTIONAL_ALL_GATHER: OpInfo = functional(CostModel::AllGather);
const FUNCTIONAL_REDUCE_SCATTER: OpInfo = functional(CostModel::ReduceScatter);
const FUNCTIONAL_ALL_REDUCE: OpInfo = functional(CostModel::AllReduce);
const FUNCTIONAL_BROADCAST: OpInfo = functional(CostModel::Broadcast);
/// `wait_tensor`: completes a functional collective; the transfer is charged to its issuer.
/// It returns its input (the collective's buffer), so its output aliases input 0.
const WAIT: OpInfo = OpInfo {
    view_of: Some(0),
    ..functional(CostModel::Free)
};
/// `all_gather_into_tensor_out`: an out-parameter collective.
const ALL_GATHER_INTO_OUT: OpInfo = OpInfo {
    writes_out: true,
    collective: Some(CollectiveKind::Mutating),
    ..known(CostModel::AllGather)
};
const MUTATING_ALL_TO_ALL: OpInfo = mutating(CostModel::AllToAll);
const MUTATING_ALL_GATHER: OpInfo = mutating(CostModel::AllGather);
const MUTATING_REDUCE_SCATTER: OpInfo = mutating(CostModel::ReduceScatter);
const MUTATING_ALL_REDUCE: OpInfo = mutating(CostModel::AllReduce);
const MUTATING_BROADCAST: OpInfo = mutating(CostModel::Broadcast);
/// Any other `c10d` op (structural rule): a mutating collective writing input 0.
const C10D_COLLECTIVE: OpInfo = mutating(CostModel::AllToAll);
/// Any other functional collective (`_c10d_functional*` namespaces): a fresh result, priced
/// as an all-to-all (every input byte crosses the wire).
const FUNCTIONAL_COLLECTIVE: OpInfo = functional(CostModel::AllToAll);

/// Every known key, sorted bytewise for the reader (a test checks it, which also rules out
/// duplicates): `namespace.name` matches every overload, `namespace.name.overload` only that one
/// and wins over its packet. Lookups go through [`INDEX`].
const TABLE: &[(&str, OpInfo)] = &[
    (
        "_c10d_functional.all_gather_into_tensor",
        FUNCTIONAL_ALL_GATHER,
    ),
    (
        "_c10d_functional.all_gather_into_tensor_coalesced",
        FUNCTIONAL_ALL_GATHER,
    ),
    (
        "_c10d_functional.all_gather_into_tensor_out",
        ALL_GATHER_INTO_OUT,
    ),
    ("_c10d_functional.all_reduce", FUNCTIONAL_ALL_REDUCE),
    ("_c10d_functional.all_reduce_", MUTATING_ALL_REDUCE),
    (
        "_c10d_functional.all_reduce_coalesced",
        FUNCTIONAL_ALL_REDUCE,
    ),
    (
        "_c10d_functional.all_reduce_coalesced_",
        MUTATING_ALL_REDUCE,
    ),
    ("_c10d_functional.all_to_all_single", FUNCTIONAL_ALL_TO_ALL),
    ("_c10d_functional.broadcast", FUNCTIONAL_BROADCAST),
    ("_c10d_functional.broadcast_", MUTATING_BROADCAST),
    (
        "_c10d_functional.reduce_scatter_tensor",
        FUNCTIONAL_REDUCE_SCATTER,
    ),
    (
        "_c10d_functional.reduce_scatter_tensor_coalesced",
        FUNCTIONAL_REDUCE_SCATTER,
    ),
    ("_c10d_functional.wait_tensor", WAIT),
    (
        "_c10d_functional_autograd.all_gather_into_tensor",
        FUNCTIONAL_ALL_GATHER,
    ),
    (
        "_c10d_functional_autograd.all_to_all_single",
        FUNCTIONAL_ALL_TO_ALL,
    ),
    (
        "_c10d_functional_autograd.reduce_scatter_tensor",
        FUNCTIONAL_REDUCE_SCATTER,
    ),
    ("aten.__and__", ARITH),
    ("aten.__lshift__", ARITH),
    ("aten.__or__", ARITH),
    ("aten.__rshift__", ARITH),
    ("aten.__xor__", ARITH),
    ("aten._addmm_activation", ADDMM),
    // A device-side check (`F.one_hot` bounds its indices): no output, reads one scalar.
    ("aten._assert_async", MEMORY),
    ("aten._convolution", CONVOLUTION),
    ("aten._fused_dropout", RANDOM),
    ("aten._fused_rms_norm", NORM),
    ("aten._fused_rms_norm_backward", NORM_BACKWARD),
    ("aten._grouped_mm", GROUPED_MM),
    ("aten._index_put_impl", INDEX_PUT),
    ("aten._local_scalar_dense", MEMORY),
    ("aten._log_softmax", SOFTMAX),
    ("aten._log_softmax_backward_data", SOFTMAX),
    ("aten._native_batch_norm_legit", NORM),
    ("aten._native_batch_norm_legit_functional", NORM),
    ("aten._native_batch_norm_legit_no_training", NORM),
    ("aten._reshape_alias", VIEW),
    ("aten._safe_softmax", SOFTMAX),
    ("aten._scaled_dot_product_attention_math", DROPOUT_ATTENTION),
    (
        "aten._scaled_dot_product_cudnn_attention",
        DROPOUT_ATTENTION,
    ),
    (
        "aten._scaled_dot_product_cudnn_attention_backward",
        ATTENTION_BACKWARD,
    ),
    (
        "aten._scaled_dot_product_efficient_attention",
        DROPOUT_ATTENTION,
    ),
    (
        "aten._scaled_dot_product_efficient_attention_backward",
        ATTENTION_BACKWARD,
    ),
    (
        "aten._scaled_dot_product_flash_attention",
        DROPOUT_ATTENTION,
    ),
    (
        "aten._scaled_dot_product_flash_attention_backward",
        ATTENTION_BACKWARD,
    ),
    (
        "aten._scaled_dot_product_flash_attention_for_cpu",
        DROPOUT_ATTENTION,
    ),
    (
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
        ATTENTION_BACKWARD,
    ),
    ("aten._scaled_grouped_mm", GROUPED_MM),
    ("aten._scaled_mm", MM),
    ("aten._softmax", SOFTMAX),
    ("aten._softmax_backward_data", SOFTMAX),
    ("aten._to_copy", MEMORY),
    ("aten._unique", UNIQUE),
    ("aten._unique2", UNIQUE),
    ("aten._unsafe_index", GATHER),
    ("aten._unsafe_index_put", INDEX_PUT),
    ("aten._unsafe_view", VIEW),
    ("aten.abs", ARITH),
    ("aten.add", ARITH),
    ("aten.addcdiv", ARITH),
    ("aten.addcmul", ARITH),
    ("aten.addmm", ADDMM),
    ("aten.alias", VIEW),
    ("aten.alias_copy", MEMORY),
    ("aten.all", REDUCTION),
    ("aten.alpha_dropout", RANDOM),
    ("aten.amax", REDUCTION),
    ("aten.amin", REDUCTION),
    ("aten.aminmax", REDUCTION),
    ("aten.any", REDUCTION),
    ("aten.arange", MEMORY),
    ("aten.argmax", REDUCTION),
    ("aten.argmin", REDUCTION),
    ("aten.argsort", SORT),
    ("aten.as_strided", VIEW),
    ("aten.as_strided_copy", MEMORY),
    ("aten.as_strided_scatter", MEMORY),
    ("aten.baddbmm", BADDBMM),
    ("aten.batch_norm", NORM),
    ("aten.batch_norm_backward", NORM_BACKWARD),
    ("aten.bernoulli", RANDOM),
    ("aten.bincount", DATA_DEPENDENT),
    ("aten.bitwise_and", ARITH),
    ("aten.bitwise_not", ARITH),
    ("aten.bitwise_or", ARITH),
    ("aten.bitwise_xor", ARITH),
    ("aten.bmm", BMM),
    ("aten.cat", MEMORY),
    ("aten.cauchy", RANDOM),
    ("aten.ceil", ARITH),
    ("aten.chunk", VIEW),
    ("aten.clamp", ARITH),
    ("aten.clamp_max", ARITH),
    ("aten.clamp_min", ARITH),
    ("aten.clone", MEMORY),
    ("aten.constant_pad_nd", MEMORY),
    ("aten.contiguous", MEMORY),
    ("aten.conv1d", CONVOLUTION),
    ("aten.conv2d", CONVOLUTION),
    ("aten.conv3d", CONVOLUTION),
    ("aten.convolution", CONVOLUTION),
    ("aten.convolution_backward", CONVOLUTION_BACKWARD),
    ("aten.copy", MEMORY),
    ("aten.cos", TRANSCENDENTAL),
    ("aten.cross_entropy_loss", SOFTMAX),
    ("aten.cudnn_batch_norm", NORM),
    ("aten.cudnn_batch_norm_backward", NORM_BACKWARD),
    ("aten.cudnn_convolution", CONVOLUTION),
    ("aten.cumprod", REDUCTION),
    ("aten.cumsum", REDUCTION),
    ("aten.detach", VIEW),
    ("aten.detach_copy", MEMORY),
    ("aten.diagonal", VIEW),
    ("aten.diagonal_scatter", MEMORY),
    ("aten.div", ARITH),
    ("aten.dropout", RANDOM),
    ("aten.elu", TRANSCENDENTAL),
    ("aten.embedding", GATHER),
    ("aten.embedding_dense_backward", ACCUMULATE),
    ("aten.empty", MEMORY),
    ("aten.empty_like", MEMORY),
    ("aten.empty_strided", MEMORY),
    ("aten.eq", ARITH),
    ("aten.erf", TRANSCENDENTAL),
    ("aten.exp", TRANSCENDENTAL),
    ("aten.exp2", TRANSCENDENTAL),
    ("aten.expand", VIEW),
    ("aten.expand_as", VIEW),
    ("aten.expand_copy", MEMORY),
    ("aten.expm1", TRANSCENDENTAL),
    ("aten.exponential", RANDOM),
    ("aten.feature_dropout", RANDOM),
    ("aten.fill", MEMORY),
    ("aten.flatten", MEMORY),
    ("aten.flip", MEMORY),
    ("aten.floor", ARITH),
    ("aten.floor_divide", ARITH),
    ("aten.fmod", ARITH),
    ("aten.full", MEMORY),
    ("aten.full_like", MEMORY),
    ("aten.gather", GATHER),
    ("aten.ge", ARITH),
    ("aten.gelu", TRANSCENDENTAL),
    ("aten.gelu_backward", TRANSCENDENTAL),
    ("aten.geometric", RANDOM),
    ("aten.group_norm", NORM),
    ("aten.gt", ARITH),
    ("aten.hardtanh", ARITH),
    ("aten.histc", SELECTION),
    ("aten.index", GATHER),
    ("aten.index_add", ACCUMULATE),
    ("aten.index_copy", MEMORY),
    ("aten.index_fill", MEMORY),
    ("aten.index_put", INDEX_PUT),
    ("aten.index_select", GATHER),
    ("aten.instance_norm", NORM),
    ("aten.isinf", ARITH),
    ("aten.isnan", ARITH),
    ("aten.kthvalue", SELECTION),
    ("aten.layer_norm", NORM),
    ("aten.le", ARITH),
    ("aten.leaky_relu", ARITH),
    ("aten.lerp", ARITH),
    ("aten.lift_fresh", VIEW),
    ("aten.lift_fresh_copy", MEMORY),
    ("aten.linalg_vector_norm", REDUCTION),
    ("aten.linear", LINEAR),
    ("aten.log", TRANSCENDENTAL),
    ("aten.log1p", TRANSCENDENTAL),
    ("aten.log2", TRANSCENDENTAL),
    ("aten.log_normal", RANDOM),
    ("aten.log_softmax", SOFTMAX),
    ("aten.logical_and", ARITH),
    ("aten.logical_not", ARITH),
    ("aten.logical_or", ARITH),
    ("aten.logical_xor", ARITH),
    ("aten.logsumexp", REDUCTION),
    ("aten.lt", ARITH),
    ("aten.masked_fill", ARITH),
    ("aten.masked_scatter", MEMORY),
    ("aten.masked_select", MEMORY),
    ("aten.matmul", MATMUL),
    ("aten.max", REDUCTION),
    ("aten.max.other", ARITH),
    ("aten.maximum", ARITH),
    ("aten.mean", REDUCTION),
    ("aten.min", REDUCTION),
    ("aten.min.other", ARITH),
    ("aten.minimum", ARITH),
    ("aten.mm", MM),
    ("aten.movedim", VIEW),
    ("aten.mse_loss", REDUCTION),
    ("aten.mul", ARITH),
    ("aten.multinomial", RANDOM),
    ("aten.nan_to_num", ARITH),
    ("aten.narrow", VIEW),
    ("aten.native_batch_norm", NORM),
    ("aten.native_batch_norm_backward", NORM_BACKWARD),
    ("aten.native_dropout", RANDOM),
    ("aten.native_dropout_backward", ARITH),
    ("aten.native_group_norm", NORM),
    ("aten.native_group_norm_backward", NORM_BACKWARD),
    ("aten.native_layer_norm", NORM),
    ("aten.native_layer_norm_backward", NORM_BACKWARD),
    ("aten.ne", ARITH),
    ("aten.neg", ARITH),
    ("aten.new_empty", MEMORY),
    ("aten.new_empty_strided", MEMORY),
    ("aten.new_full", MEMORY),
    ("aten.new_ones", MEMORY),
    ("aten.new_zeros", MEMORY),
    ("aten.nll_loss", REDUCTION),
    ("aten.nll_loss_backward", ARITH),
    ("aten.nll_loss_forward", REDUCTION),
    ("aten.nonzero", DATA_DEPENDENT),
    ("aten.norm", REDUCTION),
    ("aten.normal", RANDOM),
    ("aten.one_hot", MEMORY),
    ("aten.ones", MEMORY),
    ("aten.ones_like", MEMORY),
    ("aten.pad", MEMORY),
    ("aten.permute", VIEW),
    ("aten.permute_copy", MEMORY),
    ("aten.poisson", RANDOM),
    ("aten.pow", TRANSCENDENTAL),
    ("aten.prod", REDUCTION),
    ("aten.rand", RANDOM),
    ("aten.rand_like", RANDOM),
    ("aten.randint", RANDOM),
    ("aten.randint_like", RANDOM),
    ("aten.randn", RANDOM),
    ("aten.randn_like", RANDOM),
    ("aten.random", RANDOM),
    ("aten.randperm", RANDOM),
    ("aten.reciprocal", ARITH),
    ("aten.relu", ARITH),
    ("aten.remainder", ARITH),
    ("aten.repeat", MEMORY),
    ("aten.repeat_interleave", MEMORY),
    ("aten.reshape", MEMORY),
    ("aten.rms_norm", NORM),
    ("aten.roll", MEMORY),
    ("aten.round", ARITH),
    ("aten.rrelu_with_noise", RANDOM),
    ("aten.rsqrt", TRANSCENDENTAL),
    ("aten.rsub", ARITH),
    ("aten.scalar_tensor", MEMORY),
    ("aten.scaled_dot_product_attention", DROPOUT_ATTENTION),
    ("aten.scatter", GATHER),
    ("aten.scatter_add", ACCUMULATE),
    ("aten.scatter_reduce", ACCUMULATE),
    ("aten.select", VIEW),
    ("aten.select_copy", MEMORY),
    ("aten.select_scatter", MEMORY),
    ("aten.sigmoid", TRANSCENDENTAL),
    ("aten.sigmoid_backward", TRANSCENDENTAL),
    ("aten.sign", ARITH),
    ("aten.silu", TRANSCENDENTAL),
    ("aten.silu_backward", TRANSCENDENTAL),
    ("aten.sin", TRANSCENDENTAL),
    ("aten.slice", VIEW),
    ("aten.slice_backward", MEMORY),
    ("aten.slice_copy", MEMORY),
    ("aten.slice_scatter", MEMORY),
    ("aten.softmax", SOFTMAX),
    ("aten.softplus", TRANSCENDENTAL),
    ("aten.sort", SORT),
    ("aten.split", VIEW),
    ("aten.split_copy", MEMORY),
    ("aten.split_with_sizes", VIEW),
    ("aten.split_with_sizes_copy", MEMORY),
    ("aten.sqrt", TRANSCENDENTAL),
    ("aten.squeeze", VIEW),
    ("aten.squeeze_copy", MEMORY),
    ("aten.stack", MEMORY),
    ("aten.std", REDUCTION),
    ("aten.std_mean", REDUCTION),
    ("aten.sub", ARITH),
    ("aten.sum", REDUCTION),
    ("aten.swapaxes", VIEW),
    ("aten.swapdims", VIEW),
    ("aten.sym_numel", FREE),
    ("aten.sym_size", FREE),
    ("aten.sym_storage_offset", FREE),
    ("aten.sym_stride", FREE),
    ("aten.t", VIEW),
    ("aten.t_copy", MEMORY),
    ("aten.take_along_dim", GATHER),
    ("aten.tanh", TRANSCENDENTAL),
    ("aten.tanh_backward", TRANSCENDENTAL),
    ("aten.tensor_split", VIEW),
    ("aten.threshold_backward", ARITH),
    ("aten.to", MEMORY),
    ("aten.topk", TOPK),
    ("aten.transpose", VIEW),
    ("aten.transpose_copy", MEMORY),
    ("aten.tril", ARITH),
    ("aten.triu", ARITH),
    ("aten.trunc", ARITH),
    ("aten.unbind", VIEW),
    ("aten.unbind_copy", MEMORY),
    ("aten.unflatten", VIEW),
    ("aten.unfold", VIEW),
    ("aten.uniform", RANDOM),
    ("aten.unique", UNIQUE),
    ("aten.unique_consecutive", UNIQUE),
    ("aten.unique_dim", UNIQUE),
    ("aten.unique_dim_consecutive", UNIQUE),
    ("aten.unsqueeze", VIEW),
    ("aten.unsqueeze_copy", MEMORY),
    ("aten.var", REDUCTION),
    ("aten.var_mean", REDUCTION),
    ("aten.view", VIEW),
    ("aten.view_as", VIEW),
    ("aten.view_as_complex", VIEW),
    ("aten.view_as_real", VIEW),
    ("aten.view_copy", MEMORY),
    ("aten.where", ARITH),
    ("aten.zero", MEMORY),
    ("aten.zeros", MEMORY),
    ("aten.zeros_like", MEMORY),
    ("c10d._allgather_base_", MUTATING_ALL_GATHER),
    ("c10d._reduce_scatter_base_", MUTATING_REDUCE_SCATTER),
    ("c10d.allgather_", MUTATING_ALL_GATHER),
    ("c10d.allreduce_", MUTATING_ALL_REDUCE),
    ("c10d.alltoall_", MUTATING_ALL_TO_ALL),
    ("c10d.alltoall_base_", MUTATING_ALL_TO_ALL),
    ("c10d.broadcast_", MUTATING_BROADCAST),
    ("c10d.reduce_scatter_", MUTATING_REDUCE_SCATTER),
    ("recompute.checkpoint_record", MEMORY),
];

// ---------------------------------------------------------------------------------------------
// Schema defaults. The exporter records the arguments a call passes; one left at its default is
// not in the node. Whoever reads an attribute (through `Node::attribute`) gets the default from
// here, so that an omitted argument means what it means to PyTorch.

/// `dropout_p` and `is_causal` of the fused attention kernels: no dropout, no causal mask.
const ATTENTION_DEFAULTS: &[(&str, AttrValue)] = &[
    ("dropout_p", AttrValue::Float(0.0)),
    ("is_causal", AttrValue::Bool(false)),
];
/// `accumulate` of the `index_put` family: assign, do not add.
const INDEX_PUT_DEFAULTS: &[(&str, AttrValue)] = &[("accumulate", AttrValue::Bool(false))];

/// Per op packet (`namespace.name`, every overload; in-place forms share their base's), the
/// schema defaults of the non-tensor arguments anything reads, sorted bytewise (a test checks
/// it, and another that every key is an op of the table).
const DEFAULTS: &[(&str, &[(&str, AttrValue)])] = &[
    ("aten._index_put_impl", INDEX_PUT_DEFAULTS),
    (
        "aten._scaled_dot_product_attention_math",
        ATTENTION_DEFAULTS,
    ),
    (
        "aten._scaled_dot_product_cudnn_attention",
        ATTENTION_DEFAULTS,
    ),
    (
        "aten._scaled_dot_product_efficient_attention",
        ATTENTION_DEFAULTS,
    ),
    (
        "aten._scaled_dot_product_flash_attention",
        ATTENTION_DEFAULTS,
    ),
    (
        "aten._scaled_dot_product_flash_attention_for_cpu",
        ATTENTION_DEFAULTS,
    ),
    ("aten._unsafe_index_put", INDEX_PUT_DEFAULTS),
    ("aten.index_put", INDEX_PUT_DEFAULTS),
    ("aten.scaled_dot_product_attention", ATTENTION_DEFAULTS),
];

/// The value PyTorch gives argument `name` of `op` when a call leaves it out, for the arguments
/// the knowledge base records (those the planner and the runtime read); `None` otherwise.
pub fn attribute_default(op: &str, name: &str) -> Option<&'static AttrValue> {
    let op = OpName::parse(op)?;
    let packet = op.in_place_base().unwrap_or(op.packet);
    let slot = DEFAULTS
        .binary_search_by_key(&packet, |&(key, _)| key)
        .ok()?;
    DEFAULTS[slot]
        .1
        .iter()
        .find(|(arg, _)| *arg == name)
        .map(|(_, value)| value)
}

// ---------------------------------------------------------------------------------------------
// Kernels that add in no fixed order: float sums whose order depends on the thread split (the
// CPU's parallel `index_put_` with `accumulate=True`) or on atomics (CUDA's scatter-adds), so
// that the same inputs may give other last bits from one run to the next, unless PyTorch's
// deterministic algorithms are on (then these kernels sum in a fixed order).

/// When an op's kernel adds in no fixed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnorderedSum {
    /// Every call.
    Always,
    /// Only when this bool argument is true (`index_put`'s `accumulate`).
    When(&'static str),
}

/// Per op packet (in-place forms share their base's), sorted bytewise (a test checks it).
const UNORDERED_SUMS: &[(&str, UnorderedSum)] = &[
    ("aten._index_put_impl", UnorderedSum::When("accumulate")),
    ("aten._unsafe_index_put", UnorderedSum::When("accumulate")),
    ("aten.embedding_dense_backward", UnorderedSum::Always),
    ("aten.index_add", UnorderedSum::Always),
    ("aten.index_put", UnorderedSum::When("accumulate")),
    ("aten.scatter_add", UnorderedSum::Always),
    ("aten.scatter_reduce", UnorderedSum::Always),
];

/// When `op`'s kernel adds in no fixed order (`None`: its result does not depend on the order
/// it runs in).
pub fn unordered_sum(op: &str) -> Option<UnorderedSum> {
    let op = OpName::parse(op)?;
    let packet = op.in_place_base().unwrap_or(op.packet);
    let slot = UNORDERED_SUMS
        .binary_search_by_key(&packet, |&(key, _)| key)
        .ok()?;
    Some(UNORDERED_SUMS[slot].1)
}

// ---------------------------------------------------------------------------------------------
// Cost formulas. `u128` with saturating operations throughout; `clamp` narrows at the end.

/// Wide enough that one product of two `u64` dims is exact; saturates beyond.
type Wide = u128;

/// FLOPs per softmax element: max, subtract, exp, sum, divide.
const SOFTMAX_FLOPS: Wide = 5;
/// Norm forward per element: mean, variance, normalise, scale, shift (with their adds).
const NORM_FLOPS: Wide = 8;
/// Norm backward per element: about 1.5× the forward.
const NORM_BACKWARD_FLOPS: Wide = 12;

impl CostModel {
    fn flops(self, inputs: &[TensorRef<'_>], outputs: &[TensorRef<'_>]) -> Wide {
        let in0 = inputs.first();
        let out0 = outputs.first();
        let formula = match self {
            CostModel::Free
            | CostModel::Memory
            | CostModel::AllToAll
            | CostModel::AllGather
            | CostModel::Broadcast => Some(0),
            CostModel::Elementwise { flops_per_elem } => {
                out0.map(|t| product(&[flops_per_elem.into(), numel(t.shape)]))
            }
            CostModel::Reduction | CostModel::ReduceScatter | CostModel::AllReduce => {
                in0.map(|t| numel(t.shape))
            }
            CostModel::Softmax => in0.map(|t| product(&[SOFTMAX_FLOPS, numel(t.shape)])),
            CostModel::Norm => in0.map(|t| product(&[NORM_FLOPS, numel(t.shape)])),
            CostModel::NormBackward => in0.map(|t| product(&[NORM_BACKWARD_FLOPS, numel(t.shape)])),
            CostModel::TopK => topk_flops(in0, out0),
            CostModel::Sort => sort_flops(in0),
            CostModel::Accumulate => out0.map(|t| numel(t.shape)),
            CostModel::IndexPut => inputs.last().map(|t| numel(t.shape)),
            CostModel::Mm => mm_flops(inputs),
            CostModel::Addmm => addmm_flops(inputs),
            CostModel::Bmm => bmm_flops(inputs),
            CostModel::Baddbmm => baddbmm_flops(inputs),
            CostModel::Linear => linear_flops(inputs, out0),
            CostModel::Matmul => matmul_flops(in0, out0),
            CostModel::GroupedMm => grouped_mm_flops(inputs, out0),
            CostModel::Convolution => convolution_flops(out0, inputs.get(1)),
            CostModel::ConvolutionBackward => {
                convolution_flops(in0, inputs.get(2)).map(|f| product(&[2, f]))
            }
            CostModel::Attention => attention_flops(inputs.get(0..3)),
            CostModel::AttentionBackward => attention_backward_flops(inputs.get(1..4)),
        };
        formula.unwrap_or(0)
    }

    fn comm_bytes(self, inputs: &[TensorRef<'_>], outputs: &[TensorRef<'_>]) -> Wide {
        let in0 = inputs.first().map(tensor_bytes).unwrap_or(0);
        match self {
            CostModel::AllToAll | CostModel::ReduceScatter | CostModel::Broadcast => in0,
            CostModel::AllReduce => in0.saturating_mul(2),
            CostModel::AllGather => outputs.first().map(tensor_bytes).unwrap_or(0),
            _ => 0,
        }
    }
}

/// Elements of a tensor of this shape; a 0-d tensor holds one.
fn numel(shape: &[u64]) -> Wide {
    shape
        .iter()
        .map(|&d| Wide::from(d))
        .fold(1, Wide::saturating_mul)
}

fn tensor_bytes(t: &TensorRef<'_>) -> Wide {
    numel(t.shape).saturating_mul(t.elem_bytes.into())
}

fn total_bytes(tensors: &[TensorRef<'_>]) -> Wide {
    tensors
        .iter()
        .map(tensor_bytes)
        .fold(0, Wide::saturating_add)
}

/// Saturating product of factors.
fn product(factors: &[Wide]) -> Wide {
    factors.iter().copied().fold(1, Wide::saturating_mul)
}

fn clamp(x: Wide) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

fn last_dim(t: &TensorRef<'_>) -> Option<Wide> {
    t.shape.last().map(|&d| d.into())
}

/// `⌈log2 n⌉`, but at least 1: every element takes part in at least one comparison.
fn comparisons_per_elem(n: Wide) -> Wide {
    let log2 = match n {
        0 | 1 => 0,
        _ => Wide::from(Wide::BITS - (n - 1).leading_zeros()),
    };
    log2.max(1)
}

/// `(m, k, n)` of one product of a batch.
fn without_batch((_, m, k, n): (u64, u64, u64, u64)) -> (u64, u64, u64) {
    (m, k, n)
}

/// `(m, k, n)` of `[m, k] × [k, n]`.
fn matrix_dims(a: Option<&TensorRef<'_>>, b: Option<&TensorRef<'_>>) -> Option<(u64, u64, u64)> {
    match (a?.shape, b?.shape) {
        (&[m, k], &[_, n]) => Some((m, k, n)),
        _ => None,
    }
}

/// `(batch, m, k, n)` of `[batch, m, k] × [batch, k, n]`.
fn batched_dims(
    a: Option<&TensorRef<'_>>,
    b: Option<&TensorRef<'_>>,
) -> Option<(u64, u64, u64, u64)> {
    match (a?.shape, b?.shape) {
        (&[batch, m, k], &[_, _, n]) => Some((batch, m, k, n)),
        _ => None,
    }
}

/// The output features `n` of `linear`'s weight `[n, k]` (1 for a 1-D weight).
fn linear_out_features(weight: &TensorRef<'_>) -> u64 {
    match weight.shape {
        &[n, _] => n,
        _ => 1,
    }
}

/// The rows of `[..., k]`: the product of every dim but the last (`None` on overflow).
fn rows_of(shape: &[u64]) -> Option<u64> {
    let (_, leading) = shape.split_last()?;
    leading.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// `(m, k, n)` of `linear(x [..., k], w [n, k])`: every leading dim of `x` is a row.
fn linear_dims(inputs: &[TensorRef<'_>]) -> Option<(u64, u64, u64)> {
    let x = inputs.first()?.shape;
    Some((rows_of(x)?, *x.last()?, linear_out_features(inputs.get(1)?)))
}

/// `(m, k, n)` of one product of `matmul(a, b)`, as torch runs it: `a [..., k]` against a
/// matrix `b [k, n]` (or a vector: `n = 1`) folds every leading dim of `a` into its rows;
/// against a batch `b [..., k, n]` each product is `a`'s last two dims (a vector `a`: one row).
fn matmul_op_dims(inputs: &[TensorRef<'_>]) -> Option<(u64, u64, u64)> {
    let (a, b) = (inputs.first()?.shape, inputs.get(1)?.shape);
    let k = *a.last()?;
    let n = match b {
        [] => return None,
        [_] => 1,
        [.., n] => *n,
    };
    let m = match (a.len(), b.len()) {
        (1, _) => 1,
        (_, 1 | 2) => rows_of(a)?,
        _ => a[a.len() - 2],
    };
    Some((m, k, n))
}

/// `[M,K] × [K,N]`: `2·M·K·N`, and `M·N` for the output.
fn matrix_product(a: Option<&TensorRef<'_>>, b: Option<&TensorRef<'_>>) -> Option<(Wide, Wide)> {
    let (m, k, n) = matrix_dims(a, b)?;
    let (m, k, n) = (m.into(), k.into(), n.into());
    Some((product(&[2, m, k, n]), product(&[m, n])))
}

/// `[B,M,K] × [B,K,N]`: `2·B·M·K·N`, and `B·M·N` for the output.
fn batched_product(a: Option<&TensorRef<'_>>, b: Option<&TensorRef<'_>>) -> Option<(Wide, Wide)> {
    let (batch, m, k, n) = batched_dims(a, b)?;
    let (batch, m, k, n) = (batch.into(), m.into(), k.into(), n.into());
    Some((product(&[2, batch, m, k, n]), product(&[batch, m, n])))
}

/// `mm(a, b)`: `2·M·K·N`.
fn mm_flops(inputs: &[TensorRef<'_>]) -> Option<Wide> {
    matrix_product(inputs.first(), inputs.get(1)).map(|(matmul, _)| matmul)
}

/// `addmm(bias, a, b)`: `2·M·K·N + M·N`.
fn addmm_flops(inputs: &[TensorRef<'_>]) -> Option<Wide> {
    matrix_product(inputs.get(1), inputs.get(2)).map(|(matmul, out)| matmul.saturating_add(out))
}

/// `bmm(a, b)`: `2·B·M·K·N`.
fn bmm_flops(inputs: &[TensorRef<'_>]) -> Option<Wide> {
    batched_product(inputs.first(), inputs.get(1)).map(|(matmul, _)| matmul)
}

/// `baddbmm(self, a, b)`: `2·B·M·K·N + B·M·N`.
fn baddbmm_flops(inputs: &[TensorRef<'_>]) -> Option<Wide> {
    batched_product(inputs.get(1), inputs.get(2)).map(|(matmul, out)| matmul.saturating_add(out))
}

/// `linear(x [...,K], w [N,K], bias?)`: `2·numel(x)·N`, plus `numel(output 0)` with a bias.
fn linear_flops(inputs: &[TensorRef<'_>], out0: Option<&TensorRef<'_>>) -> Option<Wide> {
    let x = inputs.first()?;
    let n = linear_out_features(inputs.get(1)?).into();
    let matmul = product(&[2, numel(x.shape), n]);
    let bias = match (inputs.get(2), out0) {
        (Some(_), Some(out)) => numel(out.shape),
        _ => 0,
    };
    Some(matmul.saturating_add(bias))
}

/// `2·numel(output 0)·K`, `K` = last dim of input 0: one multiply-add per output element and
/// contracted index.
fn matmul_flops(in0: Option<&TensorRef<'_>>, out0: Option<&TensorRef<'_>>) -> Option<Wide> {
    Some(product(&[2, numel(out0?.shape), last_dim(in0?)?]))
}

/// [`CostModel::GroupedMm`]: `2·numel(output 0)·K`, but `2·M·N·K` for two matrices whose
/// `K` the offsets cut into the groups of a `[G, M, N]` output.
fn grouped_mm_flops(inputs: &[TensorRef<'_>], out0: Option<&TensorRef<'_>>) -> Option<Wide> {
    let out = out0?;
    match (inputs.first()?.shape, inputs.get(1)?.shape, out.shape) {
        (&[m, k], &[_, n], &[_, _, _]) => Some(product(&[2, m.into(), k.into(), n.into()])),
        _ => matmul_flops(inputs.first(), out0),
    }
}

/// `2·numel(out)·numel(w)/O`, `O` = dim 0 of the weight.
fn convolution_flops(out: Option<&TensorRef<'_>>, weight: Option<&TensorRef<'_>>) -> Option<Wide> {
    let weight = weight?;
    let out_channels = Wide::from(*weight.shape.first()?);
    let per_output = numel(weight.shape).checked_div(out_channels).unwrap_or(0);
    Some(product(&[2, numel(out?.shape), per_output]))
}

/// `numel(input) × max(1, ⌈log2 k⌉)`, `k` = last dim of output 0 (1 for a 0-d output).
fn topk_flops(in0: Option<&TensorRef<'_>>, out0: Option<&TensorRef<'_>>) -> Option<Wide> {
    let k = last_dim(out0?).unwrap_or(1);
    Some(product(&[numel(in0?.shape), comparisons_per_elem(k)]))
}

/// `numel(input) × max(1, ⌈log2 n⌉)`, `n` = last dim of input 0.
fn sort_flops(in0: Option<&TensorRef<'_>>) -> Option<Wide> {
    let input = in0?;
    let n = last_dim(input).unwrap_or(1);
    Some(product(&[numel(input.shape), comparisons_per_elem(n)]))
}

/// The sizes attention's FLOPs depend on, from `q [..., Lq, E]`, `k [..., Lk, E]`,
/// `v [..., Lk, Ev]`; every dim of `q` before the last two is batch.
struct AttentionShape {
    batch: Wide,
    lq: Wide,
    lk: Wide,
    e: Wide,
    ev: Wide,
}

impl AttentionShape {
    fn of(qkv: Option<&[TensorRef<'_>]>) -> Option<Self> {
        let [q, k, v] = qkv? else {
            return None;
        };
        let (batch, [lq, e]) = split_last_two(q.shape)?;
        let (_, [lk, _]) = split_last_two(k.shape)?;
        Some(AttentionShape {
            batch: numel(batch),
            lq: lq.into(),
            lk: lk.into(),
            e: e.into(),
            ev: last_dim(v)?,
        })
    }

    /// `2·B·Lq·Lk·E + 2·B·Lq·Lk·Ev`: QKᵀ and PV.
    fn matmul_flops(&self) -> Wide {
        let scores = product(&[self.batch, self.lq, self.lk]);
        product(&[2, scores, self.e]).saturating_add(product(&[2, scores, self.ev]))
    }

    /// `5·B·Lq·Lk`: the softmax over the scores.
    fn softmax_flops(&self) -> Wide {
        product(&[SOFTMAX_FLOPS, self.batch, self.lq, self.lk])
    }
}

/// The leading dims and the last two of a shape with at least two.
fn split_last_two(shape: &[u64]) -> Option<(&[u64], [u64; 2])> {
    match shape {
        [lead @ .., a, b] => Some((lead, [*a, *b])),
        _ => None,
    }
}

/// Forward attention: both matmuls plus the softmax.
fn attention_flops(qkv: Option<&[TensorRef<'_>]>) -> Option<Wide> {
    let shape = AttentionShape::of(qkv)?;
    Some(shape.matmul_flops().saturating_add(shape.softmax_flops()))
}

/// Backward attention: [`ATTENTION_BACKWARD_FACTOR`] × the forward matmul FLOPs.
fn attention_backward_flops(qkv: Option<&[TensorRef<'_>]>) -> Option<Wide> {
    let (num, den) = ATTENTION_BACKWARD_FACTOR;
    let matmul = AttentionShape::of(qkv)?.matmul_flops();
    Some(matmul.saturating_mul(num.into()) / Wide::from(den))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[u64]) -> TensorRef<'_> {
        TensorRef {
            shape,
            elem_bytes: 2,
        }
    }

    fn flops(op: &str, inputs: &[TensorRef<'_>], outputs: &[TensorRef<'_>]) -> u64 {
        lookup(op).cost(inputs, outputs).flops
    }

    #[test]
    fn table_is_sorted_without_duplicates() {
        for pair in TABLE.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{} !< {}", pair[0].0, pair[1].0);
        }
    }

    #[test]
    fn index_hashes_are_sorted_and_distinct() {
        for pair in INDEX.windows(2) {
            assert!(pair[0].0 < pair[1].0, "hash collision or unsorted index");
        }
        let hash = |key| {
            INDEX
                .iter()
                .find(|&&(_, i)| TABLE[i].0 == key)
                .map(|&(h, _)| h)
        };
        assert_eq!(hash("aten.mm"), Some(key_hash("aten.mm")));
        assert_eq!(fnv1a(key_hash("aten.mm"), b".out"), key_hash("aten.mm.out"));
    }

    #[test]
    fn every_entry_is_known_and_found_by_its_key() {
        for (key, info) in TABLE {
            assert!(info.known, "{key}");
            assert_eq!(lookup(key), *info, "{key}");
        }
    }

    #[test]
    fn defaults_are_sorted_and_every_key_is_a_known_op() {
        for pair in DEFAULTS.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{} !< {}", pair[0].0, pair[1].0);
        }
        for (key, _) in DEFAULTS {
            assert!(find(key).is_some(), "{key} has defaults but no table entry");
        }
    }

    #[test]
    fn an_omitted_argument_takes_its_schema_default_in_every_overload_and_in_place_form() {
        let default = |op, name| attribute_default(op, name).cloned();
        for op in [
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_flash_attention.quantized",
            "aten.scaled_dot_product_attention.default",
        ] {
            assert_eq!(
                default(op, "dropout_p"),
                Some(AttrValue::Float(0.0)),
                "{op}"
            );
            assert_eq!(
                default(op, "is_causal"),
                Some(AttrValue::Bool(false)),
                "{op}"
            );
        }
        for op in [
            "aten.index_put.default",
            "aten.index_put_.default",
            "aten._index_put_impl_.default",
            "aten._unsafe_index_put.hacked_twin",
        ] {
            assert_eq!(
                default(op, "accumulate"),
                Some(AttrValue::Bool(false)),
                "{op}"
            );
        }
        // Required arguments have no default; neither have ops or arguments nobody records.
        assert_eq!(default("aten.native_dropout.default", "p"), None);
        assert_eq!(default("aten.index_put.default", "dropout_p"), None);
        assert_eq!(default("mylib.fancy.default", "dropout_p"), None);
        assert_eq!(default("not an op", "dropout_p"), None);
    }

    #[test]
    fn unordered_sums_are_sorted_known_and_found_in_place_forms_too() {
        for pair in UNORDERED_SUMS.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{} !< {}", pair[0].0, pair[1].0);
        }
        for (key, _) in UNORDERED_SUMS {
            assert!(find(key).is_some(), "{key} has no table entry");
        }
        let accumulate = Some(UnorderedSum::When("accumulate"));
        assert_eq!(unordered_sum("aten.index_put_.default"), accumulate);
        assert_eq!(unordered_sum("aten._index_put_impl_.default"), accumulate);
        assert_eq!(
            unordered_sum("aten.index_add_.default"),
            Some(UnorderedSum::Always)
        );
        assert_eq!(unordered_sum("aten.mm.default"), None);
        assert_eq!(unordered_sum("aten.index_select.default"), None);
    }

    #[test]
    fn fused_attention_is_random_because_it_may_draw_a_dropout_mask() {
        for op in [
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_attention_math.default",
            "aten._scaled_dot_product_cudnn_attention.default",
        ] {
            assert!(lookup(op).random && lookup(op).compute_intensive, "{op}");
        }
        let backward = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default";
        assert!(!lookup(backward).random);
    }

    #[test]
    fn packet_matches_any_overload() {
        let info = lookup("aten.mm.default");
        assert!(info.known && info.compute_intensive);
        assert_eq!(info.cost_model, CostModel::Mm);
        assert!(!info.writes_out && info.mutates.is_empty());
        assert_eq!(
            lookup("aten.sum.dim_IntList").cost_model,
            CostModel::Reduction
        );
    }

    #[test]
    fn exact_key_wins_over_packet() {
        assert_eq!(lookup("aten.max.dim").cost_model, CostModel::Reduction);
        assert_eq!(
            lookup("aten.max.other").cost_model,
            CostModel::Elementwise { flops_per_elem: 1 }
        );
    }

    #[test]
    fn out_overloads_write_out_and_keep_the_packet_facts() {
        for op in ["aten.mm.out", "aten.sum.IntList_out", "aten.add.out_int"] {
            let info = lookup(op);
            assert!(
                info.known && info.writes_out && info.mutates.is_empty(),
                "{op}"
            );
            assert!(info.has_mutable_schema(), "{op}");
        }
        assert!(lookup("aten.mm.out").compute_intensive);
        let unknown = lookup("mylib.frob.out");
        assert!(!unknown.known && unknown.writes_out);
        assert!(!lookup("aten.add.Tensor").writes_out);
    }

    #[test]
    fn in_place_variant_mutates_its_first_argument() {
        let info = lookup("aten.add_.Tensor");
        assert!(info.known);
        assert_eq!(info.mutates, &[0]);
        assert_eq!(info.cost_model, lookup("aten.add.Tensor").cost_model);
        let uniform = lookup("aten.uniform_.default");
        assert!(uniform.random && uniform.mutates == [0]);
        assert_eq!(lookup("aten.transpose_.default").view_of, Some(0));
        assert_eq!(lookup("aten.frobnicate_.default"), OpInfo::UNKNOWN);
        assert_eq!(lookup("mylib.add_.Tensor"), OpInfo::UNKNOWN);
    }

    #[test]
    fn dunder_is_not_in_place() {
        let parsed = |op| OpName::parse(op).and_then(|n| n.in_place_base());
        assert_eq!(parsed("aten.__and__.Tensor"), None);
        assert_eq!(parsed("aten.__iand__.Tensor"), None);
        assert_eq!(parsed("aten.relu_.default"), Some("aten.relu"));
        assert!(lookup("aten.__and__.Tensor").mutates.is_empty());
        assert!(!lookup("aten.__ior__.Tensor").known);
    }

    #[test]
    fn c10d_namespace_is_a_mutating_collective() {
        for op in [
            "c10d.alltoall_base_.default",
            "c10d.allreduce_.default",
            "c10d.recv_.default",
        ] {
            let info = lookup(op);
            assert!(info.known, "{op}");
            assert_eq!(info.mutates, &[0], "{op}");
            assert_eq!(info.collective, Some(CollectiveKind::Mutating), "{op}");
            assert!(info.has_mutable_schema(), "{op}");
        }
        assert_eq!(
            lookup("c10d.allreduce_.default").cost_model,
            CostModel::AllReduce
        );
    }

    #[test]
    fn functional_collectives_do_not_mutate() {
        for op in [
            "_c10d_functional.all_to_all_single.default",
            "_c10d_functional.all_gather_into_tensor.default",
            "_c10d_functional.reduce_scatter_tensor.default",
            "_c10d_functional.all_reduce.default",
            "_c10d_functional.broadcast.default",
            "_c10d_functional.wait_tensor.default",
        ] {
            let info = lookup(op);
            assert_eq!(info.collective, Some(CollectiveKind::Functional), "{op}");
            assert!(!info.has_mutable_schema(), "{op}");
        }
        let all_reduce_ = lookup("_c10d_functional.all_reduce_.default");
        assert_eq!(all_reduce_.collective, Some(CollectiveKind::Mutating));
        assert_eq!(all_reduce_.mutates, &[0]);
        let out = lookup("_c10d_functional.all_gather_into_tensor_out.default");
        assert!(out.writes_out && out.collective == Some(CollectiveKind::Mutating));
    }

    #[test]
    fn functional_namespaces_without_an_entry_are_collectives_by_name() {
        for op in [
            "_c10d_functional.permute_tensor.default",
            "_c10d_functional_autograd.all_reduce.default",
        ] {
            let info = lookup(op);
            assert_eq!(info.collective, Some(CollectiveKind::Functional), "{op}");
            assert!(!info.has_mutable_schema(), "{op}");
        }
        let written = lookup("_c10d_functional_autograd.all_reduce_.default");
        assert_eq!(written.collective, Some(CollectiveKind::Mutating));
        assert_eq!(written.mutates, &[0]);
        assert_eq!(lookup("aten.mm.default").collective, None);
    }

    #[test]
    fn unknown_ops_are_unknown() {
        for op in [
            "mylib.fancy.default",
            "aten.nonexistent_op.default",
            "garbage",
            "",
            ".x",
            "a.",
        ] {
            assert_eq!(lookup(op), OpInfo::UNKNOWN, "{op:?}");
        }
        let unknown = lookup("mylib.fancy.default");
        assert!(!unknown.known && !unknown.compute_intensive);
        assert_eq!(unknown.cost_model, CostModel::Memory);
        assert_eq!(unknown.cost(&[t(&[8])], &[t(&[8])]).bytes, 32);
    }

    #[test]
    fn views_and_copies() {
        for op in [
            "aten.view.default",
            "aten.split.Tensor",
            "aten.t.default",
            "aten.expand.default",
        ] {
            let info = lookup(op);
            assert_eq!(info.view_of, Some(0), "{op}");
            assert_eq!(
                info.cost(&[t(&[4, 4])], &[t(&[16])]),
                Cost::default(),
                "{op}"
            );
        }
        let reshape = lookup("aten.reshape.default");
        assert_eq!(
            (reshape.view_of, reshape.cost_model),
            (None, CostModel::Memory)
        );
        let marker = lookup("recompute.checkpoint_record.default");
        assert!(marker.known && !marker.random && marker.view_of.is_none());
        assert_eq!(marker.cost_model, CostModel::Memory);
    }

    #[test]
    fn random_and_replay_nondeterministic_are_separate() {
        for op in [
            "aten.native_dropout.default",
            "aten.randn.default",
            "aten.bernoulli.p",
        ] {
            let info = lookup(op);
            assert!(info.random && !info.replay_nondeterministic, "{op}");
        }
        for op in [
            "aten.topk.default",
            "aten.sort.stable",
            "aten.argsort.default",
            "aten.histc.default",
            "aten.bincount.default",
            "aten._unique2.default",
            "aten.nonzero.default",
            "aten.kthvalue.default",
        ] {
            let info = lookup(op);
            assert!(info.replay_nondeterministic && !info.random, "{op}");
        }
        for op in [
            "aten._to_copy.default",
            "aten.max.dim",
            "aten.index_add.default",
        ] {
            assert!(!lookup(op).replay_nondeterministic, "{op}");
        }
    }

    #[test]
    fn mm_family_flops() {
        let (a, b, out) = (t(&[64, 128]), t(&[128, 32]), t(&[64, 32]));
        let mm = lookup("aten.mm.default").cost(&[a, b], &[out]);
        assert_eq!(mm.flops, 2 * 64 * 128 * 32);
        assert_eq!(mm.bytes, (64 * 128 + 128 * 32 + 64 * 32) * 2);
        assert_eq!(mm.comm_bytes, 0);
        let bias = t(&[32]);
        assert_eq!(
            flops("aten.addmm.default", &[bias, a, b], &[out]),
            2 * 64 * 128 * 32 + 64 * 32
        );
        let (ba, bb, bout) = (t(&[4, 8, 16]), t(&[4, 16, 2]), t(&[4, 8, 2]));
        assert_eq!(
            flops("aten.bmm.default", &[ba, bb], &[bout]),
            2 * 4 * 8 * 16 * 2
        );
        assert_eq!(
            flops("aten.baddbmm.default", &[bout, ba, bb], &[bout]),
            2048 + 64
        );
        assert_eq!(
            flops(
                "aten.matmul.default",
                &[t(&[2, 3, 16]), t(&[16, 8])],
                &[t(&[2, 3, 8])]
            ),
            1536
        );
        assert_eq!(
            flops("aten._scaled_mm.default", &[a, b, t(&[]), t(&[])], &[out]),
            2 * 64 * 128 * 32
        );
    }

    #[test]
    fn a_matmul_op_names_the_sizes_of_one_matrix_product_and_no_other_op_has_them() {
        let dims = |op: &str, inputs: &[TensorRef<'_>]| {
            lookup(op).matmul_dims(inputs).map(|d| (d.m, d.k, d.n))
        };
        let (a, b) = (t(&[64, 4]), t(&[4, 32]));
        assert_eq!(dims("aten.mm.default", &[a, b]), Some((64, 4, 32)));
        assert_eq!(
            dims("aten.addmm.default", &[t(&[32]), a, b]),
            Some((64, 4, 32))
        );
        let (ba, bb, bout) = (t(&[8, 2, 16]), t(&[8, 16, 1024]), t(&[8, 2, 1024]));
        assert_eq!(dims("aten.bmm.default", &[ba, bb]), Some((2, 16, 1024)));
        assert_eq!(
            dims("aten.baddbmm.default", &[bout, ba, bb]),
            Some((2, 16, 1024))
        );
        let x = t(&[2, 128, 256]);
        assert_eq!(
            dims("aten.linear.default", &[x, t(&[8, 256])]),
            Some((256, 256, 8))
        );
        // `matmul` folds the leading dims into rows against a matrix or a vector, as `linear`
        // does, and is a batch of products against a batch.
        assert_eq!(
            dims("aten.matmul.default", &[x, t(&[256, 8])]),
            Some((256, 256, 8))
        );
        let vector = t(&[256]);
        assert_eq!(
            dims("aten.matmul.default", &[x, vector]),
            Some((256, 256, 1))
        );
        let batch = t(&[2, 256, 64]);
        assert_eq!(
            dims("aten.matmul.default", &[x, batch]),
            Some((128, 256, 64))
        );
        assert_eq!(
            dims("aten.matmul.default", &[vector, batch]),
            Some((1, 256, 64))
        );
        // The experts' grouped product sizes its groups by offsets, not shapes.
        let (tokens, experts) = (t(&[64, 32]), t(&[4, 32, 16]));
        assert_eq!(dims("aten._grouped_mm.default", &[tokens, experts]), None);
        assert_eq!(dims("aten.add.Tensor", &[a, a]), None);
    }

    #[test]
    fn linear_flops_with_and_without_bias() {
        let (x, w, bias, out) = (t(&[2, 3, 16]), t(&[8, 16]), t(&[8]), t(&[2, 3, 8]));
        assert_eq!(
            flops("aten.linear.default", &[x, w], &[out]),
            2 * 6 * 16 * 8
        );
        assert_eq!(
            flops("aten.linear.default", &[x, w, bias], &[out]),
            2 * 6 * 16 * 8 + 48
        );
    }

    #[test]
    fn grouped_mm_and_convolution_flops() {
        let (x, w, out) = (t(&[100, 64]), t(&[4, 64, 32]), t(&[100, 32]));
        assert_eq!(
            flops("aten._grouped_mm.default", &[x, w, t(&[4])], &[out]),
            2 * 100 * 32 * 64
        );
        // The experts' weight gradients: each token's row of `K` meets its own group only.
        let (xt, dy, dw) = (t(&[64, 100]), t(&[100, 32]), t(&[4, 64, 32]));
        assert_eq!(
            flops("aten._grouped_mm.default", &[xt, dy, t(&[4])], &[dw]),
            2 * 64 * 100 * 32
        );
        let (img, kernel, map) = (t(&[1, 3, 32, 32]), t(&[16, 3, 3, 3]), t(&[1, 16, 30, 30]));
        assert_eq!(
            flops("aten.convolution.default", &[img, kernel], &[map]),
            2 * 14400 * 27
        );
        assert_eq!(
            flops(
                "aten.convolution_backward.default",
                &[map, img, kernel],
                &[img, kernel]
            ),
            4 * 14400 * 27
        );
    }

    #[test]
    fn attention_flops() {
        let (q, k, v) = (
            t(&[2, 4, 128, 64]),
            t(&[2, 4, 256, 64]),
            t(&[2, 4, 256, 32]),
        );
        let scores: u64 = 2 * 4 * 128 * 256;
        let matmul = 2 * scores * 64 + 2 * scores * 32;
        let forward = matmul + 5 * scores;
        for op in [
            "aten.scaled_dot_product_attention.default",
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default",
        ] {
            assert_eq!(flops(op, &[q, k, v], &[q]), forward, "{op}");
        }
        assert_eq!(forward, 51_642_368);
        let grad = t(&[2, 4, 128, 32]);
        let backward = "aten._scaled_dot_product_flash_attention_backward.default";
        assert_eq!(
            flops(backward, &[grad, q, k, v], &[q, k, v]),
            matmul * 5 / 2
        );
        assert_eq!(matmul * 5 / 2, 125_829_120);
        // A 3-D q treats its leading dim as batch: [8, L, E] is [2, 4, L, E].
        let (q3, k3, v3) = (t(&[8, 128, 64]), t(&[8, 256, 64]), t(&[8, 256, 32]));
        assert_eq!(
            flops(
                "aten.scaled_dot_product_attention.default",
                &[q3, k3, v3],
                &[q3]
            ),
            forward
        );
    }

    #[test]
    fn topk_and_sort_flops() {
        let input = t(&[4, 1024]);
        assert_eq!(
            flops("aten.topk.default", &[input], &[t(&[4, 8]), t(&[4, 8])]),
            4096 * 3
        );
        assert_eq!(
            flops("aten.topk.default", &[input], &[t(&[4, 5])]),
            4096 * 3
        );
        assert_eq!(flops("aten.topk.default", &[input], &[t(&[4, 1])]), 4096);
        assert_eq!(flops("aten.sort.default", &[input], &[input]), 4096 * 10);
    }

    #[test]
    fn elementwise_reduction_norm_and_gather_flops() {
        let x = t(&[10, 10]);
        assert_eq!(flops("aten.add.Tensor", &[x, x], &[x]), 100);
        assert_eq!(
            flops("aten.exp.default", &[x], &[x]),
            100 * u64::from(TRANSCENDENTAL_FLOPS)
        );
        assert_eq!(
            flops("aten.exp.default", &[t(&[])], &[t(&[])]),
            u64::from(TRANSCENDENTAL_FLOPS)
        );
        assert_eq!(flops("aten.sum.dim_IntList", &[x], &[t(&[10])]), 100);
        assert_eq!(flops("aten._softmax.default", &[x], &[x]), 500);
        assert_eq!(
            flops("aten.native_layer_norm.default", &[x, t(&[10])], &[x]),
            800
        );
        assert_eq!(
            flops("aten.native_layer_norm_backward.default", &[x, x], &[x]),
            1200
        );
        assert_eq!(flops("aten.gather.default", &[x, x], &[x]), 0);
        assert_eq!(
            flops("aten.index_add.default", &[x, t(&[3]), t(&[3, 10])], &[x]),
            100
        );
        assert_eq!(
            flops("aten.index_put.default", &[x, t(&[3]), t(&[3, 10])], &[x]),
            30
        );
        let clone = lookup("aten.clone.default").cost(&[x], &[x]);
        assert_eq!((clone.flops, clone.bytes), (0, 400));
    }

    #[test]
    fn collective_costs() {
        let x = t(&[1024]);
        let all_reduce = lookup("_c10d_functional.all_reduce.default").cost(&[x], &[x]);
        assert_eq!((all_reduce.flops, all_reduce.comm_bytes), (1024, 4096));
        let gathered = t(&[4096]);
        let gather = lookup("_c10d_functional.all_gather_into_tensor.default");
        assert_eq!(gather.cost(&[x], &[gathered]).comm_bytes, 8192);
        let a2a = lookup("_c10d_functional.all_to_all_single.default").cost(&[x], &[x]);
        assert_eq!((a2a.flops, a2a.comm_bytes), (0, 2048));
        let scatter = lookup("_c10d_functional.reduce_scatter_tensor.default");
        assert_eq!(scatter.cost(&[gathered], &[x]).comm_bytes, 8192);
        let wait = lookup("_c10d_functional.wait_tensor.default").cost(&[x], &[x]);
        assert_eq!(wait, Cost::default());
    }

    #[test]
    fn absurd_shapes_saturate() {
        const HUGE: u64 = u64::MAX / 2;
        let (a, b) = (t(&[HUGE, HUGE]), t(&[HUGE, HUGE]));
        let mm = lookup("aten.mm.default").cost(&[a, b], &[a]);
        assert_eq!((mm.flops, mm.bytes), (u64::MAX, u64::MAX));
        let big = t(&[HUGE, HUGE, HUGE, HUGE]);
        let sdpa = lookup("aten._scaled_dot_product_flash_attention_backward.default");
        assert_eq!(sdpa.cost(&[big, big, big, big], &[big]).flops, u64::MAX);
        let all_reduce = lookup("_c10d_functional.all_reduce.default").cost(&[big], &[big]);
        assert_eq!(all_reduce.comm_bytes, u64::MAX);
    }

    #[test]
    fn no_model_panics_on_missing_scalar_or_absurd_arguments() {
        let huge = [u64::MAX; 6];
        let zero = [0, 0, 0];
        let shapes: [&[u64]; 4] = [&[], &huge, &zero, &[3, 0, u64::MAX]];
        for (key, info) in TABLE {
            assert_eq!(info.cost(&[], &[]), Cost::default(), "{key}");
            for shape in shapes {
                let x = TensorRef {
                    shape,
                    elem_bytes: u64::MAX,
                };
                let cost = info.cost(&[x; 5], &[x; 3]);
                if info.cost_model == CostModel::Free {
                    assert_eq!(cost.bytes, 0, "{key}");
                }
                info.cost(&[x], &[]);
                info.cost(&[], &[x]);
            }
        }
    }

    #[test]
    fn missing_inputs_fall_back_to_bytes() {
        let a = t(&[64, 128]);
        let mm = lookup("aten.mm.default").cost(&[a], &[]);
        assert_eq!((mm.flops, mm.bytes), (0, 64 * 128 * 2));
        assert_eq!(flops("aten.addmm.default", &[a, a], &[a]), 0);
        assert_eq!(flops("aten.linear.default", &[a], &[a]), 0);
        assert_eq!(
            flops("aten.scaled_dot_product_attention.default", &[a, a], &[a]),
            0
        );
        assert_eq!(flops("aten.bmm.default", &[a, a], &[a]), 0);
        assert_eq!(flops("aten.topk.default", &[a], &[]), 0);
    }
}
