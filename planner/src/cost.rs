//! Recompute cost (docs/cost-and-memory.md): FLOPs, bytes and bytes re-communicated by replay, and an estimated time
//! from a hardware profile.
//!
//! Each op is timed with a roofline, `max(flops / rate, bytes / hbm)`, where the rate is the
//! matmul rate of the operands' dtype for compute-intensive ops (matmuls, attention) and the
//! vector rate otherwise; its communication adds `comm_bytes / link`. Ops are summed: replay
//! runs them in sequence. The shipped profiles (`--hw h100`, ...) hold vendor datasheet
//! figures.

use std::path::Path;

use ir::{
    display,
    io::{read_input_file, InputKind},
    ops::Cost,
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
    fn h100() -> Self {
        HwProfile {
            name: "H100".to_owned(),
            matmul_flops_per_s: 989.5e12,
            matmul_f32_flops_per_s: 67e12,
            matmul_f64_flops_per_s: 67e12,
            matmul_f8_flops_per_s: 1979e12,
            vector_flops_per_s: 67e12,
            hbm_bytes_per_s: 3.35e12,
            link_bytes_per_s: 450e9,
            memory_bytes: GIB * 80.0,
            compute_capability: [9, 0],
            multiprocessors: 132,
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
            hbm_bytes_per_s: 8e12,
            link_bytes_per_s: 900e9,
            memory_bytes: GIB * 180.0,
            compute_capability: [10, 0],
            multiprocessors: 148,
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
            hbm_bytes_per_s: 5.3e12,
            link_bytes_per_s: 448e9,
            memory_bytes: GIB * 192.0,
            compute_capability: [9, 4],
            multiprocessors: 304,
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
    /// bytes came from). Fields it leaves out keep the H200's; every rate must be a finite
    /// positive number.
    pub fn from_json(bytes: &[u8], origin: &str) -> Result<HwProfile, String> {
        let origin = display::name(origin);
        let profile: HwProfile = serde_json::from_slice(bytes).map_err(|e| {
            let reason = e.to_string();
            format!(
                "{origin}: not a valid hardware profile: {}",
                display::message(&reason)
            )
        })?;
        for (field, value) in [
            ("matmul_flops_per_s", profile.matmul_flops_per_s),
            ("matmul_f32_flops_per_s", profile.matmul_f32_flops_per_s),
            ("matmul_f64_flops_per_s", profile.matmul_f64_flops_per_s),
            ("matmul_f8_flops_per_s", profile.matmul_f8_flops_per_s),
            ("vector_flops_per_s", profile.vector_flops_per_s),
            ("hbm_bytes_per_s", profile.hbm_bytes_per_s),
            ("link_bytes_per_s", profile.link_bytes_per_s),
            ("memory_bytes", profile.memory_bytes),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "{origin}: `{field}` must be a positive number, got {value}"
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
    /// matmul rate of its first operand's dtype, anything else at the vector rate.
    fn rate_of(&self, graph: &Graph, node: NodeId) -> f64 {
        let node = graph.node(node);
        if !node.info.compute_intensive {
            return self.vector_flops_per_s;
        }
        node.inputs
            .first()
            .map_or(self.matmul_flops_per_s, |&operand| {
                self.matmul_rate(graph.value(operand).dtype)
            })
    }

    /// Roofline seconds of `cost` at compute `rate`: compute or memory, whichever is slower,
    /// plus communication.
    fn seconds(&self, cost: &Cost, rate: f64) -> f64 {
        let compute = cost.flops as f64 / rate;
        let memory = cost.bytes as f64 / self.hbm_bytes_per_s;
        compute.max(memory) + cost.comm_bytes as f64 / self.link_bytes_per_s
    }
}

/// What re-executing some nodes costs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Work {
    pub flops: u64,
    pub bytes: u64,
    pub comm_bytes: u64,
    pub seconds: f64,
}

impl Work {
    /// One execution of `node`.
    pub fn of_node(graph: &Graph, hw: &HwProfile, node: NodeId) -> Work {
        let cost = graph.node_cost(node);
        Work {
            flops: cost.flops,
            bytes: cost.bytes,
            comm_bytes: cost.comm_bytes,
            seconds: hw.seconds(&cost, hw.rate_of(graph, node)),
        }
    }

    fn plus(self, other: Work) -> Work {
        Work {
            flops: self.flops.saturating_add(other.flops),
            bytes: self.bytes.saturating_add(other.bytes),
            comm_bytes: self.comm_bytes.saturating_add(other.comm_bytes),
            seconds: self.seconds + other.seconds,
        }
    }
}

/// The work of every forward node (what replay can re-run), computed once and in parallel for
/// a plan document that sums it several ways; backward nodes count as nothing.
pub struct ForwardWork(Vec<Work>);

impl ForwardWork {
    pub fn of(graph: &Graph, hw: &HwProfile) -> ForwardWork {
        let nodes = graph.nodes().values().as_slice();
        ForwardWork(
            nodes
                .par_iter()
                .enumerate()
                .map(|(i, node)| match node.phase {
                    Phase::Forward => Work::of_node(graph, hw, NodeId::from_index(i)),
                    Phase::Backward => Work::default(),
                })
                .collect(),
        )
    }

    pub fn node(&self, node: NodeId) -> Work {
        self.0[node.index()]
    }

    /// The summed work of `nodes`, in their order.
    pub fn sum(&self, nodes: impl IntoIterator<Item = NodeId>) -> Work {
        nodes
            .into_iter()
            .fold(Work::default(), |acc, id| acc.plus(self.node(id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::wire::graph as pb;
    use testkit::Builder;

    /// A graph of one `[n, n] @ [n, n]` matmul in `dtype`.
    fn matmul(n: i64, dtype: pb::Dtype) -> Graph {
        let mut b = Builder::new(1, &[]);
        let (x, w) = (b.input("x"), b.param("w"));
        let (_, y) = b.node("aten.mm.default", &[&x, &w]);
        b.output(&y);
        let mut wire = b.wire();
        for value in &mut wire.values {
            value.dtype = dtype as i32;
            value.shape = vec![n, n];
        }
        Graph::from_wire(wire).unwrap()
    }

    #[test]
    fn a_matmul_runs_at_the_rate_of_its_dtype() {
        let hw = HwProfile::shipped("h100").unwrap();
        let seconds = |dtype| Work::of_node(&matmul(8192, dtype), &hw, NodeId::from_index(0));
        let (f32, bf16) = (seconds(pb::Dtype::Float32), seconds(pb::Dtype::Bfloat16));
        let flops = 2.0 * 8192f64.powi(3);
        assert_eq!(f32.flops as f64, flops);
        assert!(
            (f32.seconds - flops / 67e12).abs() < 1e-9,
            "{}",
            f32.seconds
        );
        assert!(
            (bf16.seconds - flops / 989.5e12).abs() < 1e-9,
            "{}",
            bf16.seconds
        );
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
