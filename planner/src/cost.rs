//! Recompute cost (docs/cost-and-memory.md): FLOPs, bytes and bytes re-communicated by replay, and an estimated time
//! from a hardware profile.
//!
//! Each op is timed with a roofline, `max(flops / rate, bytes / hbm)`, where the rate is the
//! matmul rate for compute-intensive ops (matmuls, attention) and the vector rate otherwise;
//! its communication adds `comm_bytes / link`. Ops are summed: replay runs them in sequence.

use std::path::Path;

use ir::{
    display,
    io::{read_input_file, InputKind},
    ops::Cost,
    EntityId, Graph, NodeId, Phase,
};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Throughputs of one accelerator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HwProfile {
    pub name: String,
    /// Dense bf16 matmul, FLOP/s (measured, not the datasheet peak).
    pub matmul_flops_per_s: f64,
    /// Everything else (elementwise, reductions, softmax), FLOP/s.
    pub vector_flops_per_s: f64,
    /// Device memory bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Interconnect bandwidth per direction (NVLink), bytes/s.
    pub link_bytes_per_s: f64,
}

impl Default for HwProfile {
    /// H200: about 790 TFLOP/s measured bf16 matmul, 67 TFLOP/s FP32 vector, 4.8 TB/s HBM3e,
    /// NVLink 4 at 450 GB/s per direction.
    fn default() -> Self {
        HwProfile {
            name: "H200".to_owned(),
            matmul_flops_per_s: 790e12,
            vector_flops_per_s: 67e12,
            hbm_bytes_per_s: 4.8e12,
            link_bytes_per_s: 450e9,
        }
    }
}

impl HwProfile {
    /// Reads a JSON profile; fields it leaves out keep the H200 defaults. Only a regular file
    /// of at most [`InputKind::HardwareProfile`]'s size is read.
    pub fn from_file(path: &Path) -> Result<HwProfile, String> {
        let bytes = read_input_file(path, InputKind::HardwareProfile).map_err(|e| e.to_string())?;
        HwProfile::from_json(&bytes, &path.to_string_lossy())
    }

    /// Parses the bytes of a JSON profile; `origin` names it in errors (a path, or what the
    /// bytes came from). Fields it leaves out keep the H200 defaults; every rate must be a
    /// finite positive number.
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
            ("vector_flops_per_s", profile.vector_flops_per_s),
            ("hbm_bytes_per_s", profile.hbm_bytes_per_s),
            ("link_bytes_per_s", profile.link_bytes_per_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "{origin}: `{field}` must be a positive number, got {value}"
                ));
            }
        }
        Ok(profile)
    }

    /// Estimated seconds for one execution of `node`.
    pub fn node_seconds(&self, graph: &Graph, node: NodeId) -> f64 {
        Work::of_node(graph, self, node).seconds
    }

    /// Roofline seconds of `cost`: compute or memory, whichever is slower, plus communication.
    fn seconds(&self, cost: &Cost, compute_intensive: bool) -> f64 {
        let rate = if compute_intensive {
            self.matmul_flops_per_s
        } else {
            self.vector_flops_per_s
        };
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
            seconds: hw.seconds(&cost, graph.node(node).info.compute_intensive),
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
