//! Time (docs/cost-and-memory.md): FLOPs, bytes and bytes communicated per op, and an
//! estimated time from a hardware profile, for replay and for the whole step.
//!
//! Each op run costs a fixed overhead (dispatch and launch) plus a roofline,
//! `max(flops / rate, bytes / hbm)`, where the rate is the matmul rate of the operands' dtype
//! for compute-intensive ops (matmuls, attention; attention at the profile's attention share of
//! it, its own for 16-bit operands where calibrated), the selection rate for top-k and sorts,
//! and the vector rate otherwise. A collective adds its latency and `comm_bytes / link`; a
//! copy to the host moves its bytes over the host link and synchronises (`host_sync_s`), as
//! does reading a scalar on the host (`.item()`). The overhead is host time, the rest device
//! time: on an asynchronous device (a GPU) the host runs ahead of the device, launching ops
//! while earlier ones run, so a sequence takes whichever clock ends later, and a host
//! synchronisation makes the host wait for the device; on a CPU the ops' times add up. Eager
//! selective checkpointing adds host time to each forward op of a checkpointed layer. The
//! shipped profiles (`--hw h100`, ...) hold vendor datasheet figures; `planner calibrate`
//! measures a profile on the device at hand.

use std::path::Path;

use ir::{
    display,
    io::{read_input_file, InputKind},
    ops::{Cost, CostModel, MatmulDims},
    plan::Executor,
    DType, EntityId, Graph, NodeId, Phase,
};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Throughputs of one accelerator, and the device facts a trace for it reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HwProfile {
    pub name: String,
    /// Dense 16-bit (bf16, fp16) matmul on the tensor cores, FLOP/s.
    pub matmul_flops_per_s: f64,
    /// Dense fp32 matmul as PyTorch runs it by default (no TF32), FLOP/s.
    pub matmul_f32_flops_per_s: f64,
    /// Dense fp64 matmul, FLOP/s.
    pub matmul_f64_flops_per_s: f64,
    /// Dense 8-bit float matmul, FLOP/s.
    pub matmul_f8_flops_per_s: f64,
    /// Everything else (elementwise, reductions, softmax), FLOP/s.
    pub vector_flops_per_s: f64,
    /// Comparisons per second of a top-k or a sort (the knowledge base counts `numel ×
    /// log2 k` for a top-k, `numel × log2 n` for a sort): a CPU's top-k runs them an order of
    /// magnitude below its vector rate. A calibration times top-k only: sorts take its rate
    /// unchecked. The datasheet profiles take their vector rate.
    pub selection_ops_per_s: f64,
    /// Device memory bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Interconnect bandwidth per direction (NVLink, Infinity Fabric), bytes/s.
    pub link_bytes_per_s: f64,
    /// Device memory, bytes.
    pub memory_bytes: f64,
    /// What `torch.cuda.get_device_capability` answers in a trace for this device.
    pub compute_capability: [u32; 2],
    /// Streaming multiprocessors (compute units).
    pub multiprocessors: u32,
    /// Fixed seconds every op run costs beyond its roofline (dispatch and kernel launch),
    /// unless its class has its own below.
    pub op_overhead_s: f64,
    /// ... of a view or another metadata-only op (no kernel).
    pub view_overhead_s: f64,
    /// ... of a matmul (and the other compute-intensive ops but attention).
    pub matmul_overhead_s: f64,
    /// ... of a fused attention kernel, forward or backward.
    pub attention_overhead_s: f64,
    /// ... of a reduction (sums, softmax, norms, top-k, sorts).
    pub reduction_overhead_s: f64,
    /// The share of its dtype's matmul rate an attention kernel reaches (fused attention runs
    /// softmax and masking between its two matmuls).
    pub attention_efficiency: f64,
    /// ... for 16-bit operands (bf16, fp16), of the 16-bit matmul rate, where a calibration
    /// timed it apart: a CPU's 16-bit attention kernel runs about as fast as its fp32 one,
    /// far below its 16-bit matmuls. Absent: `attention_efficiency`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_16bit_efficiency: Option<f64>,
    /// Matmuls with a thin dimension, where a calibration timed them: the share of their
    /// operands' matmul rate a product reaches with one dimension of a few elements (a
    /// router's experts, an indexer's heads), which a CPU's BLAS runs up to 27x below its rate.
    /// A matmul runs at the lowest share of its three dimensions (`thin_matmul_share`).
    /// Empty (the datasheet profiles): every matmul at its dtype's rate.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub thin_matmuls: Vec<ThinMatmul>,
    /// Host <-> device copy bandwidth per direction (PCIe, C2C), bytes/s.
    pub host_bytes_per_s: f64,
    /// Host memory one device's offloaded activations may take (pinned; the node's memory
    /// over its devices), bytes: what the plan's host peak is compared with.
    pub host_memory_bytes: f64,
    /// Seconds a host synchronisation costs beyond the op that asks for it (a copy to the
    /// host, a scalar read on the host): the device queue drains and the host waits.
    pub host_sync_s: f64,
    /// Fixed seconds of one collective call, whatever its size.
    pub collective_latency_s: f64,
    /// Host seconds eager selective checkpointing adds to each op it dispatches in a
    /// checkpointed layer, in forward and in the layer's recompute: its dispatch modes (the
    /// plan's policy, SAC's cache) and the checkpoint's saved-tensor hooks. Counted for the
    /// eager executor only.
    pub checkpoint_op_overhead_s: f64,
    /// Whether the host queues work for the device and runs ahead of it (a GPU): an op's
    /// overhead then overlaps the device's work on earlier ops, and a host synchronisation
    /// waits for the queue to drain. Without it (a CPU) every op finishes before the next.
    pub asynchronous: bool,
    /// Latency and bandwidth of the collective ops a calibration timed apart (a ring
    /// all-gather and an all-to-all differ); any other collective takes
    /// `collective_latency_s` and `link_bytes_per_s`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub collectives: Vec<CollectiveRates>,
    /// What `planner calibrate` measured to make this profile; absent in datasheet profiles.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

/// The share of its operands' matmul rate a matmul reaches with one thin dimension.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThinMatmul {
    pub operands: MatmulOperands,
    pub dim: MatmulDim,
    /// The thin dimension's elements.
    pub size: u64,
    /// Above 0, at most 1.
    pub efficiency: f64,
}

/// The operands whose matmul rate a [`ThinMatmul`] is a share of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MatmulOperands {
    /// fp32 (`matmul_f32_flops_per_s`).
    #[serde(rename = "fp32")]
    F32,
    /// bf16 and fp16 (`matmul_flops_per_s`).
    #[serde(rename = "16bit")]
    Bits16,
}

impl MatmulOperands {
    /// The operands of `dtype`, where a calibration times them (complex64 multiplies fp32s).
    pub fn of(dtype: DType) -> Option<MatmulOperands> {
        match dtype {
            DType::F32 | DType::C64 => Some(MatmulOperands::F32),
            DType::BF16 | DType::F16 => Some(MatmulOperands::Bits16),
            _ => None,
        }
    }
}

/// A dimension of `[m, k] × [k, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulDim {
    M,
    N,
    K,
}

impl MatmulDim {
    /// Each dimension of a product and its size.
    pub fn sizes(dims: MatmulDims) -> [(MatmulDim, u64); 3] {
        [
            (MatmulDim::M, dims.m),
            (MatmulDim::N, dims.n),
            (MatmulDim::K, dims.k),
        ]
    }
}

/// One collective op's fitted cost: `latency_s + comm_bytes / link_bytes_per_s` a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveRates {
    /// The op as the knowledge base names it (`_c10d_functional.all_gather_into_tensor.default`).
    pub op: String,
    pub latency_s: f64,
    pub link_bytes_per_s: f64,
}

/// How a calibrated profile was measured: the device, and every timing its rates were fitted
/// to, so a reader can check a rate against the runs behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// The device measured (`cpu`, `cuda:0`) and what it is.
    pub device: String,
    pub description: String,
    /// Threads the CPU kernels ran on.
    pub threads: u32,
    /// Each benchmark: median seconds of one run at one size.
    pub timings: Vec<Timing>,
    /// The profile's fields no benchmark measured: they keep the base profile's figures.
    #[serde(default)]
    pub not_measured: Vec<String>,
    /// The process group the `collective` timings went through and its ranks (`gloo, 2
    /// ranks launched as processes`); absent where none was timed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collectives: Option<String>,
}

/// One benchmark of one op class at one size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timing {
    /// The op class (`overhead`, `matmul_f32`, `memory`, ...: `calibration::CLASSES`). A
    /// collective's time includes the `wait_tensor` that follows it.
    pub class: String,
    /// The op as the knowledge base names it, and its operands.
    pub op: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// The op's work by the knowledge base's formulas.
    pub flops: u64,
    pub bytes: u64,
    pub comm_bytes: u64,
    /// Median seconds of one run, and how many runs it is the median of.
    pub median_s: f64,
    pub runs: u32,
}

/// Vendors state HBM capacities in binary units: an "80 GB" H100 has five 16 GiB stacks.
const GIB: f64 = (1u64 << 30) as f64;

/// Makes one shipped profile.
type Shipped = fn() -> HwProfile;

/// The shipped profiles, by `--hw` name: vendor datasheet figures, dense (not sparsity),
/// per GPU (docs/cost-and-memory.md lists them and their sources).
const SHIPPED: [(&str, Shipped); 4] = [
    ("h100", HwProfile::h100),
    ("h200", HwProfile::h200),
    ("b200", HwProfile::b200),
    ("mi300x", HwProfile::mi300x),
];

impl Default for HwProfile {
    fn default() -> Self {
        HwProfile::h200()
    }
}

impl HwProfile {
    /// NVIDIA H100 SXM5: 989.5 TFLOP/s bf16, 67 TFLOP/s fp32 and fp64 (tensor core), 1,979
    /// TFLOP/s fp8, 3.35 TB/s HBM3 (80 GiB), NVLink 4 at 900 GB/s (450 per direction).
    ///
    /// What no datasheet states is set at typical values for a current GPU on PCIe Gen5 x16,
    /// and every shipped profile shares them: 5 us per op (PyTorch's dispatch and a kernel
    /// launch; 2 us for a view, which launches nothing), attention at 60% of the matmul rate
    /// (fused attention on H100 reaches about 35% of the bf16 peak with FlashAttention-2, 75%
    /// with FlashAttention-3), 64 GB/s host <-> device per direction, 256 GiB of host memory
    /// per device (a DGX H100's 2 TiB over its 8 GPUs), 20 us per host
    /// synchronisation, 15 us per collective call (NCCL within a node), and 40 us of host time
    /// per op eager selective checkpointing dispatches in a checkpointed layer (measured on an
    /// H200 machine's host: 39 to 47 us, docs/measurements/h200-eager-time.md). `planner
    /// calibrate` and `recompute_planner.calibrate` measure them on the device at hand.
    fn h100() -> Self {
        HwProfile {
            name: "H100".to_owned(),
            matmul_flops_per_s: 989.5e12,
            matmul_f32_flops_per_s: 67e12,
            matmul_f64_flops_per_s: 67e12,
            matmul_f8_flops_per_s: 1979e12,
            vector_flops_per_s: 67e12,
            selection_ops_per_s: 67e12,
            hbm_bytes_per_s: 3.35e12,
            link_bytes_per_s: 450e9,
            memory_bytes: GIB * 80.0,
            compute_capability: [9, 0],
            multiprocessors: 132,
            op_overhead_s: 5e-6,
            view_overhead_s: 2e-6,
            matmul_overhead_s: 5e-6,
            attention_overhead_s: 5e-6,
            reduction_overhead_s: 5e-6,
            attention_efficiency: 0.6,
            attention_16bit_efficiency: None,
            thin_matmuls: Vec::new(),
            host_bytes_per_s: 64e9,
            host_memory_bytes: GIB * 256.0,
            host_sync_s: 20e-6,
            collective_latency_s: 15e-6,
            checkpoint_op_overhead_s: 40e-6,
            asynchronous: true,
            collectives: Vec::new(),
            calibration: None,
        }
    }

    /// NVIDIA H200 SXM: the H100's compute with 4.8 TB/s HBM3e (141 GiB).
    fn h200() -> Self {
        HwProfile {
            name: "H200".to_owned(),
            hbm_bytes_per_s: 4.8e12,
            memory_bytes: GIB * 141.0,
            ..HwProfile::h100()
        }
    }

    /// NVIDIA B200 (HGX B200, per GPU): 2,250 TFLOP/s bf16, 75 TFLOP/s fp32, 37 TFLOP/s fp64,
    /// 4,500 TFLOP/s fp8, 8 TB/s HBM3e (180 GiB), NVLink 5 at 1.8 TB/s (900 GB/s per
    /// direction).
    fn b200() -> Self {
        HwProfile {
            name: "B200".to_owned(),
            matmul_flops_per_s: 2250e12,
            matmul_f32_flops_per_s: 75e12,
            matmul_f64_flops_per_s: 37e12,
            matmul_f8_flops_per_s: 4500e12,
            vector_flops_per_s: 75e12,
            selection_ops_per_s: 75e12,
            hbm_bytes_per_s: 8e12,
            link_bytes_per_s: 900e9,
            memory_bytes: GIB * 180.0,
            compute_capability: [10, 0],
            multiprocessors: 148,
            ..HwProfile::h100()
        }
    }

    /// AMD Instinct MI300X: 1,307.4 TFLOP/s bf16, 163.4 TFLOP/s fp32 and fp64 (matrix),
    /// 2,614.9 TFLOP/s fp8, 5.3 TB/s HBM3 (192 GiB), Infinity Fabric 7 x 128 GB/s (448 GB/s
    /// per direction); ROCm reports gfx942 as capability 9.4.
    fn mi300x() -> Self {
        HwProfile {
            name: "MI300X".to_owned(),
            matmul_flops_per_s: 1307.4e12,
            matmul_f32_flops_per_s: 163.4e12,
            matmul_f64_flops_per_s: 163.4e12,
            matmul_f8_flops_per_s: 2614.9e12,
            vector_flops_per_s: 163.4e12,
            selection_ops_per_s: 163.4e12,
            hbm_bytes_per_s: 5.3e12,
            link_bytes_per_s: 448e9,
            memory_bytes: GIB * 192.0,
            compute_capability: [9, 4],
            multiprocessors: 304,
            ..HwProfile::h100()
        }
    }

    /// The shipped profile called `name` (case-insensitive: `h100`, `h200`, `b200`,
    /// `mi300x`).
    pub fn shipped(name: &str) -> Option<HwProfile> {
        SHIPPED
            .iter()
            .find(|(known, _)| known.eq_ignore_ascii_case(name))
            .map(|(_, profile)| profile())
    }

    /// The shipped profiles' names, for messages.
    pub fn shipped_names() -> String {
        SHIPPED.map(|(name, _)| name).join(", ")
    }

    /// `--hw`: a shipped profile's name, else a JSON file.
    pub fn resolve(arg: &Path) -> Result<HwProfile, String> {
        match arg.to_str().and_then(HwProfile::shipped) {
            Some(profile) => Ok(profile),
            None => HwProfile::from_file(arg),
        }
    }

    /// Reads a JSON profile; fields it leaves out keep the H200's. Only a regular file of at
    /// most [`InputKind::HardwareProfile`]'s size is read.
    pub fn from_file(path: &Path) -> Result<HwProfile, String> {
        let bytes = read_input_file(path, InputKind::HardwareProfile).map_err(|e| e.to_string())?;
        HwProfile::from_json(&bytes, &path.to_string_lossy())
    }

    /// Parses the bytes of a JSON profile; `origin` names it in errors (a path, or what the
    /// bytes came from). Fields it leaves out keep the H200's, but for `asynchronous` in a
    /// profile calibrated on a CPU (written before the field existed): a CPU runs ops in
    /// order; and `selection_ops_per_s`, which takes the profile's own vector rate. Every rate must be a finite positive number.
    pub fn from_json(bytes: &[u8], origin: &str) -> Result<HwProfile, String> {
        let origin = display::name(origin);
        let mut profile: HwProfile = serde_json::from_slice(bytes).map_err(|e| {
            let reason = e.to_string();
            format!(
                "{origin}: not a valid hardware profile: {}",
                display::message(&reason)
            )
        })?;
        let calibrated_on_cpu = profile
            .calibration
            .as_ref()
            .is_some_and(|c| c.device == "cpu");
        if calibrated_on_cpu && !names_field(bytes, "asynchronous") {
            profile.asynchronous = false;
        }
        // Top-k and sorts ran at the vector rate before they had a rate of their own.
        if !names_field(bytes, "selection_ops_per_s") {
            profile.selection_ops_per_s = profile.vector_flops_per_s;
        }
        for (field, value) in [
            ("matmul_flops_per_s", profile.matmul_flops_per_s),
            ("matmul_f32_flops_per_s", profile.matmul_f32_flops_per_s),
            ("matmul_f64_flops_per_s", profile.matmul_f64_flops_per_s),
            ("matmul_f8_flops_per_s", profile.matmul_f8_flops_per_s),
            ("vector_flops_per_s", profile.vector_flops_per_s),
            ("selection_ops_per_s", profile.selection_ops_per_s),
            ("hbm_bytes_per_s", profile.hbm_bytes_per_s),
            ("link_bytes_per_s", profile.link_bytes_per_s),
            ("memory_bytes", profile.memory_bytes),
            ("host_bytes_per_s", profile.host_bytes_per_s),
            ("host_memory_bytes", profile.host_memory_bytes),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "{origin}: `{field}` must be a positive number, got {value}"
                ));
            }
        }
        for (field, value) in [
            ("op_overhead_s", profile.op_overhead_s),
            ("view_overhead_s", profile.view_overhead_s),
            ("matmul_overhead_s", profile.matmul_overhead_s),
            ("attention_overhead_s", profile.attention_overhead_s),
            ("reduction_overhead_s", profile.reduction_overhead_s),
            ("host_sync_s", profile.host_sync_s),
            ("collective_latency_s", profile.collective_latency_s),
            ("checkpoint_op_overhead_s", profile.checkpoint_op_overhead_s),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(format!(
                    "{origin}: `{field}` must be a number of seconds from 0 to 1, got {value}"
                ));
            }
        }
        for (i, c) in profile.collectives.iter().enumerate() {
            let op = display::name(&c.op);
            if profile.collectives[..i].iter().any(|d| d.op == c.op) {
                return Err(format!(
                    "{origin}: `collectives` names `{op}` twice: give each op one line"
                ));
            }
            if !(0.0..=1.0).contains(&c.latency_s) {
                return Err(format!(
                    "{origin}: `collectives` `{op}`: `latency_s` must be a number of seconds \
                     from 0 to 1, got {}",
                    c.latency_s
                ));
            }
            if !(c.link_bytes_per_s.is_finite() && c.link_bytes_per_s > 0.0) {
                return Err(format!(
                    "{origin}: `collectives` `{op}`: `link_bytes_per_s` must be a positive \
                     number, got {}",
                    c.link_bytes_per_s
                ));
            }
        }
        let attention = [
            ("attention_efficiency", Some(profile.attention_efficiency)),
            (
                "attention_16bit_efficiency",
                profile.attention_16bit_efficiency,
            ),
        ];
        for (field, efficiency) in attention {
            if let Some(e) = efficiency {
                check_share(e).map_err(|why| format!("{origin}: `{field}` {why}"))?;
            }
        }
        for (i, t) in profile.thin_matmuls.iter().enumerate() {
            let entry = format!("{origin}: `thin_matmuls[{i}]`");
            check_share(t.efficiency).map_err(|why| format!("{entry}: `efficiency` {why}"))?;
            if t.size == 0 {
                return Err(format!("{entry}: `size` must be at least 1"));
            }
            let same = |u: &ThinMatmul| (u.operands, u.dim, u.size) == (t.operands, t.dim, t.size);
            if profile.thin_matmuls[..i].iter().any(same) {
                return Err(format!(
                    "{entry}: an earlier entry has the same operands, dimension and size"
                ));
            }
        }
        Ok(profile)
    }

    /// The profile as JSON (every field), as `from_json` reads it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a profile of finite numbers serializes")
    }

    /// The matmul rate for operands of `dtype`.
    fn matmul_rate(&self, dtype: DType) -> f64 {
        match dtype {
            DType::F32 | DType::C64 => self.matmul_f32_flops_per_s,
            DType::F64 => self.matmul_f64_flops_per_s,
            DType::F8E4M3 | DType::F8E5M2 => self.matmul_f8_flops_per_s,
            _ => self.matmul_flops_per_s,
        }
    }

    /// Estimated seconds for one execution of `node`.
    pub fn node_seconds(&self, graph: &Graph, node: NodeId) -> f64 {
        Work::of_node(graph, self, node).seconds
    }

    /// The compute rate of `node`: a compute-intensive op (matmul, attention) runs at the
    /// matmul rate of its first operand's dtype (attention at the profile's share of it), a
    /// top-k or a sort at the selection rate, anything else at the vector rate.
    fn rate_of(&self, graph: &Graph, id: NodeId) -> f64 {
        let node = graph.node(id);
        if matches!(node.info.cost_model, CostModel::TopK | CostModel::Sort) {
            return self.selection_ops_per_s;
        }
        if !node.info.compute_intensive {
            return self.vector_flops_per_s;
        }
        let dtype = node
            .inputs
            .first()
            .map(|&operand| graph.value(operand).dtype);
        let matmul = dtype.map_or(self.matmul_flops_per_s, |d| self.matmul_rate(d));
        if is_attention(node) {
            return matmul * self.attention_efficiency_of(dtype);
        }
        let operands = dtype.and_then(MatmulOperands::of);
        match (operands, self.thin_matmuls.is_empty()) {
            (Some(operands), false) => graph.node_matmul_dims(id).map_or(matmul, |dims| {
                matmul * self.thin_matmul_share(operands, dims)
            }),
            _ => matmul,
        }
    }

    /// The share of the matmul rate of `operands` a product of `dims` reaches: the lowest of
    /// its three dimensions' (`thin_matmul_share_of`).
    fn thin_matmul_share(&self, operands: MatmulOperands, dims: MatmulDims) -> f64 {
        MatmulDim::sizes(dims)
            .into_iter()
            .map(|(dim, size)| self.thin_matmul_share_of(operands, dim, size))
            .fold(1.0, f64::min)
    }

    /// The share at one dimension of `size` elements, between the sizes a calibration timed
    /// (linear in log2 of the size): a size below the smallest timed takes the smallest's
    /// share; above the largest the share rises to 1 at twice its size (the full rate comes
    /// from square matmuls a few hundred wide). 1 where none was timed.
    fn thin_matmul_share_of(&self, operands: MatmulOperands, dim: MatmulDim, size: u64) -> f64 {
        let timed = || {
            self.thin_matmuls
                .iter()
                .filter(move |t| t.operands == operands && t.dim == dim)
        };
        let below = timed().filter(|t| t.size <= size).max_by_key(|t| t.size);
        let above = timed().filter(|t| t.size > size).min_by_key(|t| t.size);
        let log2 = |n: u64| (n.max(1) as f64).log2();
        let between = |(x0, y0): (f64, f64), (x1, y1): (f64, f64)| {
            let x = log2(size).clamp(x0, x1);
            y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        };
        match (below, above) {
            (None, None) => 1.0,
            (None, Some(first)) => first.efficiency,
            (Some(last), None) => between(
                (log2(last.size), last.efficiency),
                (log2(last.size) + 1.0, 1.0),
            ),
            (Some(lo), Some(hi)) => between(
                (log2(lo.size), lo.efficiency),
                (log2(hi.size), hi.efficiency),
            ),
        }
    }

    /// The share of the matmul rate an attention kernel on operands of `dtype` reaches.
    fn attention_efficiency_of(&self, dtype: Option<DType>) -> f64 {
        match dtype.and_then(MatmulOperands::of) {
            Some(MatmulOperands::Bits16) => self
                .attention_16bit_efficiency
                .unwrap_or(self.attention_efficiency),
            _ => self.attention_efficiency,
        }
    }

    /// One run of `node`: the op's overhead on the host, then compute or memory on the
    /// device, whichever is slower; a collective adds its latency and its bytes over the link;
    /// a copy to the host moves its output over the host link and waits for the device, as a
    /// scalar read does.
    fn op_time(&self, graph: &Graph, node: NodeId, cost: &Cost) -> OpTime {
        let n = graph.node(node);
        // A view costs its overhead alone; so does a collective's `wait_tensor`, a metadata op
        // too, which pays no collective latency of its own.
        if n.info.cost_model == CostModel::Free {
            return OpTime::host(self.view_overhead_s);
        }
        let compute = cost.flops as f64 / self.rate_of(graph, node);
        let memory = cost.bytes as f64 / self.hbm_bytes_per_s;
        let mut time = OpTime {
            host_s: self.overhead_of(n),
            device_s: compute.max(memory),
            sync_s: None,
        };
        if n.effects.collective.is_some() {
            let (latency, link) = self.collective_rates(&n.op);
            time.device_s += latency + cost.comm_bytes as f64 / link;
        }
        if n.is_device_to_host_copy() {
            let moved: u64 = n.outputs.iter().map(|&v| graph.value(v).bytes).sum();
            time.device_s += moved as f64 / self.host_bytes_per_s;
            time.sync_s = Some(self.host_sync_s);
        } else if is_host_scalar_read(&n.op) {
            time.sync_s = Some(self.host_sync_s);
        }
        time
    }

    /// Latency and link bandwidth of the collective `op`: its own where calibrated apart.
    fn collective_rates(&self, op: &str) -> (f64, f64) {
        self.collectives
            .iter()
            .find(|c| c.op == op)
            .map_or((self.collective_latency_s, self.link_bytes_per_s), |c| {
                (c.latency_s, c.link_bytes_per_s)
            })
    }

    /// The fixed seconds of one run of `node`, by its class.
    pub fn overhead_of(&self, node: &ir::Node) -> f64 {
        match node.info.cost_model {
            CostModel::Free => self.view_overhead_s,
            CostModel::Reduction
            | CostModel::Softmax
            | CostModel::Norm
            | CostModel::NormBackward
            | CostModel::TopK
            | CostModel::Sort => self.reduction_overhead_s,
            _ if is_attention(node) => self.attention_overhead_s,
            _ if node.info.compute_intensive => self.matmul_overhead_s,
            _ => self.op_overhead_s,
        }
    }
}

/// A share of a rate must be above 0 and at most 1.
fn check_share(share: f64) -> Result<(), String> {
    match share > 0.0 && share <= 1.0 {
        true => Ok(()),
        false => Err(format!("must be above 0 and at most 1, got {share}")),
    }
}

/// Whether the JSON object in `bytes` has the key `field` (at its top level).
fn names_field(bytes: &[u8], field: &str) -> bool {
    serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(bytes)
        .is_ok_and(|object| object.contains_key(field))
}

/// Whether `node` is a fused attention kernel (SDPA's flash, memory-efficient or cuDNN forms,
/// and their backward), which runs below the matmul rate.
fn is_attention(node: &ir::Node) -> bool {
    matches!(
        node.info.cost_model,
        CostModel::Attention | CostModel::AttentionBackward
    )
}

/// `.item()` and every other read of a tensor's value on the host.
fn is_host_scalar_read(op: &str) -> bool {
    op == "aten._local_scalar_dense.default"
}

/// Whether `node` synchronises the host with the device: a copy to the host, a scalar read.
pub fn is_host_sync(node: &ir::Node) -> bool {
    node.is_device_to_host_copy() || is_host_scalar_read(&node.op)
}

/// One run of one op, as a clock on the host and one on the device see it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct OpTime {
    /// Host seconds before the device can start it: dispatch and launch.
    host_s: f64,
    /// Device seconds: the roofline, a collective's latency and link time, a host copy's
    /// transfer.
    device_s: f64,
    /// A host synchronisation: the host waits for the device, then pays these seconds.
    sync_s: Option<f64>,
}

impl OpTime {
    /// An op that only the host runs (a view).
    fn host(seconds: f64) -> OpTime {
        OpTime {
            host_s: seconds,
            ..OpTime::default()
        }
    }

    /// Its seconds run alone: host, device, then the synchronisation.
    fn alone(self) -> f64 {
        self.host_s + self.device_s + self.sync_s.unwrap_or(0.0)
    }
}

/// What re-executing some nodes costs. `seconds` is the time the sequence takes from an idle
/// device: on an asynchronous device the host's clock and the device's run apart (an op starts
/// on the device once the host has launched it and the device has finished the one before),
/// and the sequence ends when both have; elsewhere the ops' times add up.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Work {
    pub flops: u64,
    pub bytes: u64,
    pub comm_bytes: u64,
    pub seconds: f64,
    /// The host's and the device's clocks when the sequence's last op has been launched and
    /// run (on a synchronous device both equal `seconds`).
    host_s: f64,
    device_s: f64,
}

impl Work {
    /// One execution of `node`, run alone.
    pub fn of_node(graph: &Graph, hw: &HwProfile, node: NodeId) -> Work {
        let cost = graph.node_cost(node);
        Work::new(&cost, hw.op_time(graph, node, &cost))
    }

    fn new(cost: &Cost, time: OpTime) -> Work {
        Work::default().then(&NodeTime::of(cost, time), false)
    }

    /// This sequence, then `next` once the device has drained (each replay of a plan starts
    /// anew: the times add up).
    pub fn after(self, next: Work) -> Work {
        let seconds = self.seconds + next.seconds;
        Work {
            flops: self.flops.saturating_add(next.flops),
            bytes: self.bytes.saturating_add(next.bytes),
            comm_bytes: self.comm_bytes.saturating_add(next.comm_bytes),
            seconds,
            host_s: seconds,
            device_s: seconds,
        }
    }

    /// This sequence, then `op`.
    fn then(self, op: &NodeTime, asynchronous: bool) -> Work {
        let time = op.time;
        let (host, device) = if asynchronous {
            let host = self.host_s + time.host_s;
            let device = host.max(self.device_s) + time.device_s;
            match time.sync_s {
                Some(sync) => (host.max(device) + sync, device),
                None => (host, device),
            }
        } else {
            let end = self.seconds + time.alone();
            (end, end)
        };
        Work {
            flops: self.flops.saturating_add(op.flops),
            bytes: self.bytes.saturating_add(op.bytes),
            comm_bytes: self.comm_bytes.saturating_add(op.comm_bytes),
            seconds: host.max(device),
            host_s: host,
            device_s: device,
        }
    }
}

/// One node's work and time, as [`NodeWork`] holds it.
#[derive(Debug, Clone, Copy, Default)]
struct NodeTime {
    flops: u64,
    bytes: u64,
    comm_bytes: u64,
    time: OpTime,
}

impl NodeTime {
    fn of(cost: &Cost, time: OpTime) -> NodeTime {
        NodeTime {
            flops: cost.flops,
            bytes: cost.bytes,
            comm_bytes: cost.comm_bytes,
            time,
        }
    }
}

/// The work of every node as an executor runs it, computed once and in parallel for a plan
/// document that sums it several ways (replay, each pass of the step).
pub struct NodeWork {
    nodes: Vec<NodeTime>,
    asynchronous: bool,
}

impl NodeWork {
    /// An eager executor runs no marker op (the marker returns its input, dispatching
    /// nothing): its markers cost nothing. A graph executor runs each as a copy. Eager
    /// selective checkpointing adds `checkpoint_op_overhead_s` to every forward op it
    /// dispatches itself in a layer `checkpointed` says it checkpoints, which a replay
    /// re-runs at the same cost (not to backward ops, which run outside the checkpoint, nor
    /// to the ops of a compiled region, which run as one call).
    pub fn of(
        graph: &Graph,
        hw: &HwProfile,
        executor: Executor,
        checkpointed: impl Fn(&ir::Node) -> bool + Sync,
    ) -> NodeWork {
        let nodes = graph.nodes().values().as_slice();
        let nodes = nodes
            .par_iter()
            .enumerate()
            .map(|(i, node)| {
                if executor != Executor::Graph && node.marker().is_some() {
                    return NodeTime::default();
                }
                let id = NodeId::from_index(i);
                let cost = graph.node_cost(id);
                let mut time = hw.op_time(graph, id, &cost);
                if executor == Executor::Eager
                    && node.phase == Phase::Forward
                    && node.compiled_region.is_none()
                    && checkpointed(node)
                {
                    time.host_s += hw.checkpoint_op_overhead_s;
                }
                NodeTime::of(&cost, time)
            })
            .collect();
        NodeWork {
            nodes,
            asynchronous: hw.asynchronous,
        }
    }

    /// The work of `node` run alone.
    pub fn node(&self, node: NodeId) -> Work {
        Work::default().then(&self.nodes[node.index()], false)
    }

    /// The work of `nodes` run in their order.
    pub fn sum(&self, nodes: impl IntoIterator<Item = NodeId>) -> Work {
        nodes.into_iter().fold(Work::default(), |acc, id| {
            acc.then(&self.nodes[id.index()], self.asynchronous)
        })
    }

    /// The work of several replays, each run from a drained device in turn (each re-runs a
    /// layer's forward ops just before the backward op that needs them).
    /// Their seconds are added in exact ticks, so replays of equal times give one total in
    /// any order (as the budget search compares them).
    pub fn replays<'r>(&self, replays: impl IntoIterator<Item = &'r [NodeId]>) -> Work {
        let (work, total) = replays.into_iter().fold(
            (Work::default(), 0 as crate::compose::Ticks),
            |(acc, total), nodes| {
                let replay = self.sum(nodes.iter().copied());
                (
                    acc.after(replay),
                    total + crate::compose::ticks(replay.seconds),
                )
            },
        );
        let seconds = total as f64 / 1e30;
        Work {
            seconds,
            host_s: seconds,
            device_s: seconds,
            ..work
        }
    }

    /// The work of every node of `phase` run in order: one pass of the step, replay aside.
    pub fn pass(&self, graph: &Graph, phase: Phase) -> Work {
        self.sum(
            graph
                .nodes()
                .iter()
                .filter(|(_, node)| node.phase == phase)
                .map(|(id, _)| id),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::wire::graph as pb;
    use testkit::Builder;

    /// A graph of one `[n, n] @ [n, n]` matmul in `dtype`.
    fn matmul(n: i64, dtype: pb::Dtype) -> Graph {
        mm(n, n, n, dtype)
    }

    /// `x [m, k] @ w [k, n]`.
    fn mm(m: i64, k: i64, n: i64, dtype: pb::Dtype) -> Graph {
        let mut b = Builder::new(1, &[]);
        let (x, w) = (b.input("x"), b.param("w"));
        let (_, y) = b.node("aten.mm.default", &[&x, &w]);
        b.output(&y);
        let mut wire = b.wire();
        for (value, shape) in wire.values.iter_mut().zip([[m, k], [k, n], [m, n]]) {
            value.dtype = dtype as i32;
            value.shape = shape.to_vec();
        }
        Graph::from_wire(wire).unwrap()
    }

    #[test]
    fn a_matmul_with_a_thin_dimension_runs_at_the_share_timed_for_its_size() {
        let thin = |dim, size, efficiency| ThinMatmul {
            operands: MatmulOperands::F32,
            dim,
            size,
            efficiency,
        };
        let hw = HwProfile {
            matmul_f32_flops_per_s: 1e11,
            hbm_bytes_per_s: 1e18,
            matmul_overhead_s: 0.0,
            thin_matmuls: vec![
                thin(MatmulDim::K, 16, 0.5),
                thin(MatmulDim::K, 4, 0.1),
                thin(MatmulDim::M, 8, 0.2),
            ],
            ..HwProfile::shipped("h100").unwrap()
        };
        let share = |m, k, n, dtype| {
            let graph = mm(m, k, n, dtype);
            let flops = 2.0 * (m * k * n) as f64;
            flops / hw.matmul_rate(DType::F32) / seconds(&graph, &hw, 0)
        };
        let f32 = pb::Dtype::Float32;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // At a size timed, between two (log2 scale), below the smallest, rising above the
        // largest to the full rate at twice its size.
        assert!(close(share(1024, 4, 1024, f32), 0.1));
        assert!(close(share(1024, 8, 1024, f32), 0.3));
        assert!(close(share(1024, 2, 1024, f32), 0.1));
        assert!(close(
            share(1024, 24, 1024, f32),
            0.5 + 0.5 * (1.5f64.log2())
        ));
        assert!(close(share(1024, 32, 1024, f32), 1.0));
        assert!(close(share(1024, 1024, 1024, f32), 1.0));
        // Thin in two dimensions: the lower share.
        assert!(close(share(8, 16, 1024, f32), 0.2));
        // A dimension not timed runs at the full rate.
        assert!(close(share(1024, 1024, 4, f32), 1.0));
        // 16-bit operands (bf16 and fp16) take the 16-bit lines only.
        let hw16 = HwProfile {
            matmul_flops_per_s: 1e12,
            thin_matmuls: vec![ThinMatmul {
                operands: MatmulOperands::Bits16,
                ..thin(MatmulDim::N, 4, 0.25)
            }],
            ..hw.clone()
        };
        let sixteen = |m: i64, k: i64, n: i64, dtype| {
            let flops = 2.0 * (m * k * n) as f64;
            flops / hw16.matmul_rate(DType::BF16) / seconds(&mm(m, k, n, dtype), &hw16, 0)
        };
        for dtype in [pb::Dtype::Bfloat16, pb::Dtype::Float16] {
            assert!(close(sixteen(1024, 1024, 4, dtype), 0.25));
            assert!(close(sixteen(1024, 4, 1024, dtype), 1.0));
        }
    }

    #[test]
    fn a_matmul_runs_at_the_rate_of_its_dtype() {
        let hw = HwProfile::shipped("h100").unwrap();
        let seconds = |dtype| Work::of_node(&matmul(8192, dtype), &hw, NodeId::from_index(0));
        let (f32, bf16) = (seconds(pb::Dtype::Float32), seconds(pb::Dtype::Bfloat16));
        let flops = 2.0 * 8192f64.powi(3);
        assert_eq!(f32.flops as f64, flops);
        assert!(
            (f32.seconds - hw.matmul_overhead_s - flops / 67e12).abs() < 1e-9,
            "{}",
            f32.seconds
        );
        assert!(
            (bf16.seconds - hw.matmul_overhead_s - flops / 989.5e12).abs() < 1e-9,
            "{}",
            bf16.seconds
        );
    }

    /// A graph of `x -> view -> op(attributes)`, float32 `[1024, 1024]` (4 MiB).
    fn one_op(op: &str, attributes: Vec<pb::Attribute>) -> Graph {
        let mut b = Builder::new(1, &[]);
        let x = b.input("x");
        let (_, v) = b.node("aten.view.default", &[&x]);
        let (_, y) = b.node(op, &[&v]);
        b.output(&y);
        let mut wire = b.wire();
        wire.nodes[1].attributes = attributes;
        for value in &mut wire.values {
            value.shape = vec![1024, 1024];
        }
        Graph::from_wire(wire).unwrap()
    }

    fn seconds(graph: &Graph, hw: &HwProfile, node: usize) -> f64 {
        Work::of_node(graph, hw, NodeId::from_index(node)).seconds
    }

    #[test]
    fn every_op_pays_the_overhead_of_its_class_and_a_view_only_that() {
        let hw = HwProfile {
            view_overhead_s: 1e-6,
            op_overhead_s: 2e-6,
            reduction_overhead_s: 3e-6,
            ..HwProfile::shipped("h100").unwrap()
        };
        let graph = one_op("aten.exp.default", Vec::new());
        assert_eq!(seconds(&graph, &hw, 0), hw.view_overhead_s);
        let sum = one_op("aten.sum.default", Vec::new());
        let reduced = (8u64 << 20) as f64 / hw.hbm_bytes_per_s;
        assert!((seconds(&sum, &hw, 1) - hw.reduction_overhead_s - reduced).abs() < 1e-12);
        let roofline = (8u64 << 20) as f64 / hw.hbm_bytes_per_s;
        assert!((seconds(&graph, &hw, 1) - hw.op_overhead_s - roofline).abs() < 1e-12);
    }

    /// A top-k's comparisons run at the selection rate: a CPU's top-k runs them an order of
    /// magnitude below its vector rate, which times every other non-matmul op.
    #[test]
    fn a_top_k_runs_at_the_selection_rate_and_an_elementwise_op_at_the_vector_rate() {
        let hw = HwProfile {
            vector_flops_per_s: 1e10,
            selection_ops_per_s: 1e9,
            hbm_bytes_per_s: 1e15,
            ..HwProfile::shipped("h100").unwrap()
        };
        let k = 64;
        let topk = {
            let mut b = Builder::new(1, &[]);
            let x = b.input("x");
            let (_, v) = b.node("aten.view.default", &[&x]);
            let (_, y) = b.node("aten.topk.default", &[&v]);
            b.output(&y);
            let mut wire = b.wire();
            let selected = wire.nodes[1].outputs[0].clone();
            for value in &mut wire.values {
                value.shape = if value.name == selected {
                    vec![1024, k]
                } else {
                    vec![1024, 1024]
                };
            }
            Graph::from_wire(wire).unwrap()
        };
        let comparisons = (1024 * 1024 * 6) as f64; // numel x log2(64)
        let expected = hw.reduction_overhead_s + comparisons / hw.selection_ops_per_s;
        assert!(
            (seconds(&topk, &hw, 1) - expected).abs() < 1e-12,
            "{}",
            seconds(&topk, &hw, 1)
        );
        let exp = one_op("aten.exp.default", Vec::new());
        let flops = (1024 * 1024 * u64::from(ir::ops::TRANSCENDENTAL_FLOPS)) as f64;
        let expected = hw.op_overhead_s + flops / hw.vector_flops_per_s;
        assert!((seconds(&exp, &hw, 1) - expected).abs() < 1e-12);
    }

    #[test]
    fn a_copy_to_the_host_waits_for_the_device_and_crosses_the_host_link() {
        let hw = HwProfile::shipped("h100").unwrap();
        let to_host = pb::Attribute {
            name: "device".to_owned(),
            value: Some(pb::attribute::Value::Str("cpu".to_owned())),
        };
        let copy = one_op("aten._to_copy.default", vec![to_host]);
        let same_device = one_op("aten._to_copy.default", Vec::new());
        let extra = seconds(&copy, &hw, 1) - seconds(&same_device, &hw, 1);
        let expected = hw.host_sync_s + (4u64 << 20) as f64 / hw.host_bytes_per_s;
        assert!(
            (extra - expected).abs() < 1e-12,
            "{extra} against {expected}"
        );
        assert!(is_host_sync(copy.node(NodeId::from_index(1))));
        assert!(!is_host_sync(same_device.node(NodeId::from_index(1))));
    }

    /// `x -> mm -> neg x 40`, then a copy of the last to the host when `to_host`: float32
    /// `[4096, 4096]` for the matmul, one element for the rest (launch-bound ops).
    fn matmul_then_small_ops(to_host: bool) -> Graph {
        let mut b = Builder::new(1, &[]);
        let (x, w) = (b.input("x"), b.param("w"));
        let (_, mut y) = b.node("aten.mm.default", &[&x, &w]);
        for _ in 0..40 {
            y = b.node("aten.neg.default", &[&y]).1;
        }
        if to_host {
            y = b.node("aten._to_copy.default", &[&y]).1;
        }
        b.output(&y);
        let mut wire = b.wire();
        for value in &mut wire.values {
            value.shape = vec![1];
        }
        for value in &mut wire.values[..3] {
            value.shape = vec![4096, 4096];
        }
        if to_host {
            let last = wire.nodes.len() - 1;
            wire.nodes[last].attributes = vec![pb::Attribute {
                name: "device".to_owned(),
                value: Some(pb::attribute::Value::Str("cpu".to_owned())),
            }];
        }
        Graph::from_wire(wire).unwrap()
    }

    fn all_nodes(graph: &Graph, hw: &HwProfile) -> Work {
        NodeWork::of(graph, hw, Executor::Graph, |_| false).sum(graph.nodes().ids())
    }

    #[test]
    fn on_an_asynchronous_device_the_host_launches_ops_while_earlier_ones_run() {
        let gpu = HwProfile::shipped("h100").unwrap();
        let graph = matmul_then_small_ops(false);
        let matmul = Work::of_node(&graph, &gpu, NodeId::from_index(0));
        let launches = 40.0 * gpu.op_overhead_s;
        let device_matmul = matmul.seconds - gpu.matmul_overhead_s;
        assert!(device_matmul > launches, "the matmul hides the launches");
        // The neg ops' launches overlap the matmul; each then runs on the device in the
        // time its one element takes.
        let overlapped = all_nodes(&graph, &gpu).seconds;
        let tail: f64 = (1..41)
            .map(|i| seconds(&graph, &gpu, i) - gpu.op_overhead_s)
            .sum();
        assert!(
            (overlapped - (matmul.seconds + tail)).abs() < 1e-12,
            "{overlapped} against {}",
            matmul.seconds + tail
        );
        // A CPU runs each op before the next: the times add up.
        let cpu = HwProfile {
            asynchronous: false,
            ..gpu
        };
        let serial: f64 = (0..41).map(|i| seconds(&graph, &cpu, i)).sum();
        assert!((all_nodes(&graph, &cpu).seconds - serial).abs() < 1e-12);
        assert!(serial - overlapped > launches * 0.99);
    }

    #[test]
    fn a_host_synchronisation_waits_for_every_op_queued_before_it() {
        let hw = HwProfile::shipped("h100").unwrap();
        let queued = all_nodes(&matmul_then_small_ops(false), &hw).seconds;
        let graph = matmul_then_small_ops(true);
        let copy = NodeId::from_index(41);
        let alone = Work::of_node(&graph, &hw, copy).seconds;
        // The copy is launched long before the matmul ends: the host waits for the queue,
        // then the copy's transfer and the synchronisation follow.
        let synced = all_nodes(&graph, &hw).seconds;
        let expected = queued + (alone - hw.op_overhead_s);
        assert!(
            (synced - expected).abs() < 1e-12,
            "{synced} against {expected}"
        );
    }

    #[test]
    fn eager_checkpointing_adds_its_overhead_to_the_forward_ops_of_checkpointed_layers() {
        let hw = HwProfile::shipped("h100").unwrap();
        let mut b = Builder::new(1, &[]);
        let x = b.input("x");
        b.layer(Some(0));
        let (_, y) = b.node("aten.neg.default", &[&x]);
        b.region("layers.0.mlp");
        let (_, z) = b.node("aten.neg.default", &[&y]);
        b.layer(None).region("");
        let (_, loss) = b.node("aten.sum.default", &[&z]);
        let t = b.tangent("t");
        b.backward().layer(Some(0));
        let (_, g) = b.node("aten.neg.default", &[&t]);
        b.output(&loss);
        b.output(&g);
        let graph = b.build();
        let in_layer = |node: &ir::Node| node.layer == Some(0);
        let eager = NodeWork::of(&graph, &hw, Executor::Eager, in_layer);
        let graph_executor = NodeWork::of(&graph, &hw, Executor::Graph, in_layer);
        let added = |i: usize| {
            let id = NodeId::from_index(i);
            eager.node(id).seconds - graph_executor.node(id).seconds
        };
        assert!(
            (added(0) - hw.checkpoint_op_overhead_s).abs() < 1e-15,
            "{}",
            added(0)
        );
        // A compiled region's op, an op outside every layer, a backward op: nothing added.
        assert_eq!([added(1), added(2), added(3)], [0.0; 3]);
        // Nor where the layer is not checkpointed.
        let unchecked = NodeWork::of(&graph, &hw, Executor::Eager, |_| false);
        let id = NodeId::from_index(0);
        assert_eq!(unchecked.node(id), graph_executor.node(id));
    }

    #[test]
    fn a_collective_pays_its_latency_and_its_bytes_over_the_link() {
        let hw = HwProfile::shipped("h100").unwrap();
        let all_reduce = one_op("_c10d_functional.all_reduce.default", Vec::new());
        let add = one_op("aten.neg.default", Vec::new());
        let extra = seconds(&all_reduce, &hw, 1) - seconds(&add, &hw, 1);
        // A ring all-reduce sends its input twice (reduce-scatter, then all-gather).
        let expected = hw.collective_latency_s + (8u64 << 20) as f64 / hw.link_bytes_per_s;
        assert!(
            (extra - expected).abs() < 1e-9,
            "{extra} against {expected}"
        );
    }

    #[test]
    fn a_cpu_profile_written_before_the_device_queue_existed_runs_ops_in_order() {
        let calibration = r#""calibration": {"device": "cpu", "description": "c", "threads": 2,
            "timings": []}"#;
        let old = HwProfile::from_json(format!("{{{calibration}}}").as_bytes(), "old").unwrap();
        assert!(!old.asynchronous);
        let said = format!(r#"{{"asynchronous": true, {calibration}}}"#);
        assert!(
            HwProfile::from_json(said.as_bytes(), "new")
                .unwrap()
                .asynchronous
        );
        assert!(HwProfile::from_json(b"{}", "empty").unwrap().asynchronous);
    }

    #[test]
    fn shipped_profiles_are_found_by_name_in_any_case_and_read_back_as_json() {
        for name in ["h100", "H200", "b200", "Mi300x"] {
            let profile = HwProfile::shipped(name).unwrap();
            assert!(profile.name.eq_ignore_ascii_case(name));
            assert_eq!(
                HwProfile::from_json(profile.to_json().as_bytes(), name),
                Ok(profile)
            );
        }
        assert_eq!(HwProfile::shipped("h300"), None);
        assert_eq!(HwProfile::default(), HwProfile::shipped("h200").unwrap());
    }

    fn parse(json: &str) -> Result<HwProfile, String> {
        HwProfile::from_json(json.as_bytes(), "hw.json")
    }

    #[test]
    fn rates_read_back_to_the_same_bits() {
        // Seventeen significant digits: a parser that is not exact is a bit off here.
        for text in [
            "3.4028234663852886e+38",
            "7.900000000000001e14",
            "4.8e12",
            "1.7976931348623157e308",
            "5e-324",
        ] {
            let profile = parse(&format!(r#"{{"hbm_bytes_per_s": {text}}}"#)).unwrap();
            let exact: f64 = text.parse().unwrap();
            assert_eq!(profile.hbm_bytes_per_s.to_bits(), exact.to_bits(), "{text}");
        }
    }

    #[test]
    fn rates_must_be_finite_and_positive() {
        for value in ["0", "-1", "-0.0"] {
            let error = parse(&format!(r#"{{"link_bytes_per_s": {value}}}"#)).unwrap_err();
            assert!(error.contains("link_bytes_per_s"), "{value}: {error}");
        }
        let error = parse(r#"{"link_bytes_per_s": 1e400}"#).unwrap_err();
        assert!(error.contains("number out of range"), "{error}");
    }

    #[test]
    fn latencies_are_seconds_from_0_to_1_and_attention_a_share() {
        for ok in [
            r#"{"op_overhead_s": 0}"#,
            r#"{"host_sync_s": 1}"#,
            r#"{"attention_efficiency": 1}"#,
            r#"{"attention_16bit_efficiency": 0.2}"#,
        ] {
            assert!(parse(ok).is_ok(), "{ok}");
        }
        for (bad, field) in [
            (r#"{"view_overhead_s": -1e-6}"#, "view_overhead_s"),
            (r#"{"collective_latency_s": 2}"#, "collective_latency_s"),
            (r#"{"attention_efficiency": 1.5}"#, "attention_efficiency"),
            (r#"{"attention_efficiency": 0}"#, "attention_efficiency"),
            (
                r#"{"attention_16bit_efficiency": 2}"#,
                "attention_16bit_efficiency",
            ),
            (r#"{"selection_ops_per_s": 0}"#, "selection_ops_per_s"),
        ] {
            let error = parse(bad).unwrap_err();
            assert!(error.contains(field), "{bad}: {error}");
        }
    }

    #[test]
    fn a_thin_matmul_share_is_above_0_and_at_most_1_at_a_size_given_once() {
        let thin = |lines: &[(&str, u64, f64)]| {
            let lines: Vec<String> = lines
                .iter()
                .map(|(dim, size, e)| {
                    format!(
                        r#"{{"operands": "16bit", "dim": "{dim}", "size": {size}, "efficiency": {e}}}"#
                    )
                })
                .collect();
            parse(&format!(r#"{{"thin_matmuls": [{}]}}"#, lines.join(", ")))
        };
        let profile = thin(&[("k", 4, 0.2), ("m", 4, 1.0)]).unwrap();
        assert_eq!(profile.thin_matmuls[0].operands, MatmulOperands::Bits16);
        assert_eq!(profile.thin_matmuls[1].dim, MatmulDim::M);
        for (bad, says) in [
            (&[("k", 4, 0.0)][..], "`efficiency` must be above 0"),
            (&[("k", 4, 1.5)], "`efficiency` must be above 0"),
            (&[("n", 0, 0.5)], "`size` must be at least 1"),
            (
                &[("n", 8, 0.5), ("n", 8, 0.6)],
                "`thin_matmuls[1]`: an earlier entry",
            ),
        ] {
            let error = thin(bad).unwrap_err();
            assert!(error.contains(says), "{bad:?}: {error}");
        }
        let error = parse(
            r#"{"thin_matmuls": [{"operands": "fp8", "dim": "k", "size": 4, "efficiency": 0.5}]}"#,
        )
        .unwrap_err();
        assert!(error.contains("fp8"), "{error}");
    }

    #[test]
    fn a_profile_written_before_the_latencies_existed_keeps_the_h200s() {
        let old = parse(r#"{"name": "old", "matmul_flops_per_s": 1e14, "hbm_bytes_per_s": 1e12}"#)
            .unwrap();
        let h200 = HwProfile::default();
        assert_eq!(old.op_overhead_s, h200.op_overhead_s);
        assert_eq!(old.host_sync_s, h200.host_sync_s);
        assert_eq!(old.calibration, None);
        assert_eq!(old.matmul_flops_per_s, 1e14);
    }

    #[test]
    fn a_profile_without_a_selection_rate_selects_at_its_own_vector_rate() {
        let old = parse(r#"{"vector_flops_per_s": 6e9}"#).unwrap();
        assert_eq!(old.selection_ops_per_s, 6e9);
        let new = parse(r#"{"vector_flops_per_s": 6e9, "selection_ops_per_s": 5e8}"#).unwrap();
        assert_eq!(new.selection_ops_per_s, 5e8);
    }

    #[test]
    fn a_device_is_not_read_as_a_profile() {
        let error = HwProfile::from_file(Path::new("/dev/zero")).unwrap_err();
        assert!(
            error.starts_with("cannot read hardware profile /dev/zero: it is a character device"),
            "{error}"
        );
    }

    #[test]
    fn a_bad_profile_quotes_the_input_on_one_short_line() {
        let key = format!("bad\nkey{}", "x".repeat(100_000));
        let error = parse(&format!(r#"{{"{}": 1}}"#, key.replace('\n', "\\n"))).unwrap_err();
        assert!(!error.contains('\n'), "{error}");
        assert!(error.len() < 1_000, "{} bytes", error.len());
        assert!(error.contains("unknown field `bad\\nkey"), "{error}");
    }
}
