//! A hardware profile fitted to measured timings (`planner calibrate`): each rate of the cost
//! model (docs/cost-and-memory.md, M2) from the benchmarks of its op class, so the profile
//! times ops the way the device at hand runs them.
//!
//! Every timing is one op's median seconds at one size, with the op's FLOPs and bytes by the
//! knowledge base's formulas, the same ones the cost model applies to a graph. The fixed
//! overhead of each op class comes from its small `overhead*` benchmark, run interleaved with
//! the other classes'; each rate is the median over its class's sizes of
//! `work / (seconds - the class's overhead)`, so one noisy size moves nothing. A figure the
//! calibration did not measure keeps the base profile's, and the profile lists it in
//! `calibration.not_measured`.

use std::collections::BTreeMap;

use ir::{
    ops::MatmulDims,
    wire::graph::{self as pb, attribute::Value as AttrValue},
    EntityId, Graph, NodeId,
};

use crate::cost::{
    Calibration, CollectiveRates, HwProfile, MatmulDim, MatmulOperands, ThinMatmul, Timing,
};

/// The classes of benchmark a calibration may hold (docs/cost-and-memory.md says which field
/// each one sets).
pub const CLASSES: [&str; 19] = [
    "overhead",
    "overhead_view",
    "overhead_matmul",
    "overhead_attention",
    "overhead_reduction",
    "matmul_f32",
    "matmul_bf16",
    "thin_matmul_f32",
    "thin_matmul_bf16",
    "attention",
    "attention_bf16",
    "memory",
    "transcendental",
    "reduction",
    "selection",
    "host_copy",
    "host_sync",
    "collective",
    "checkpoint",
];

/// One benchmark: `repeats` copies of one op on the same inputs, timed together.
pub struct Benchmark {
    pub class: &'static str,
    pub op: &'static str,
    pub dtype: pb::Dtype,
    pub inputs: Vec<Vec<i64>>,
    pub outputs: Vec<(pb::Dtype, Vec<i64>)>,
    pub attributes: Vec<pb::Attribute>,
    pub repeats: usize,
    /// Ranks the graph runs on (a collective's group).
    pub world: u32,
    /// Run interleaved with the other mixed benchmarks in one graph (`graph_of`), as a
    /// model's ops follow one another, rather than alone: the fixed costs of op classes.
    pub mixed: bool,
    /// Timed in eager PyTorch inside a checkpointed layer under selective checkpointing (its
    /// policy keeping every other op): what eager SAC adds per op. `planner run` has no such
    /// checkpoint and leaves these out.
    pub checkpointed: bool,
}

impl Benchmark {
    fn new(class: &'static str, op: &'static str, dtype: pb::Dtype, inputs: &[&[i64]]) -> Self {
        let first = inputs.first().map_or_else(Vec::new, |s| s.to_vec());
        Benchmark {
            class,
            op,
            dtype,
            inputs: inputs.iter().map(|s| s.to_vec()).collect(),
            outputs: vec![(dtype, first)],
            attributes: Vec::new(),
            repeats: 1,
            world: 1,
            mixed: false,
            checkpointed: false,
        }
    }

    fn output(mut self, outputs: Vec<(pb::Dtype, Vec<i64>)>) -> Self {
        self.outputs = outputs;
        self
    }

    fn attribute(mut self, name: &str, value: AttrValue) -> Self {
        self.attributes.push(pb::Attribute {
            name: name.to_owned(),
            value: Some(value),
        });
        self
    }

    /// Repeats the op until the graph holds about `work` FLOPs or bytes (at most 400 ops, at
    /// least 3), so each benchmark runs for milliseconds whatever its size.
    fn repeated_for(mut self, per_op: f64, work: f64) -> Self {
        self.repeats = ((work / per_op.max(1.0)) as usize).clamp(3, 400);
        self
    }

    /// The graph: the inputs, then `repeats` nodes of the op reading them (a collective's each
    /// followed by its wait); the last node's outputs are the graph's.
    pub fn graph(&self) -> pb::Graph {
        graph_of(std::slice::from_ref(self))
    }

    /// The work of one op of this benchmark, by the knowledge base.
    fn cost(&self) -> Result<ir::ops::Cost, String> {
        let graph = Graph::from_wire(self.graph())
            .map_err(|e| format!("calibration graph `{}`: {e}", self.op))?;
        Ok(graph.node_cost(NodeId::from_index(0)))
    }

    /// The timing of one op of this benchmark, `median_s` seconds over `runs` runs, with the
    /// op's work by the knowledge base.
    pub fn timing(&self, median_s: f64, runs: u32) -> Result<Timing, String> {
        let cost = self.cost()?;
        Ok(Timing {
            class: self.class.to_owned(),
            op: self.op.to_owned(),
            dtype: dtype_name(self.dtype),
            shape: self.inputs.first().map_or_else(Vec::new, |s| {
                s.iter().map(|&d| u64::try_from(d).unwrap_or(0)).collect()
            }),
            flops: cost.flops,
            bytes: cost.bytes,
            comm_bytes: cost.comm_bytes,
            median_s,
            runs,
        })
    }

    /// The benchmark for an executor other than the runtime (eager PyTorch): the op, its
    /// tensors' dtypes and shapes, its attributes as plain JSON values, the repeats.
    pub fn describe(&self) -> serde_json::Value {
        let attributes: serde_json::Map<String, serde_json::Value> = self
            .attributes
            .iter()
            .filter_map(|a| Some((a.name.clone(), attribute_json(a.value.as_ref()?))))
            .collect();
        serde_json::json!({
            "class": self.class,
            "op": self.op,
            "dtype": dtype_name(self.dtype),
            "inputs": self.inputs,
            "outputs": self.outputs.iter().map(|(d, s)| serde_json::json!([dtype_name(*d), s])).collect::<Vec<_>>(),
            "attributes": attributes,
            "repeats": self.repeats,
            "world": self.world,
            "mixed": self.mixed,
            "checkpointed": self.checkpointed,
        })
    }
}

/// The graph of `benchmarks` interleaved: their inputs, then `repeats` (the first's) rounds of
/// one node of each, in order, reading its inputs (a collective's followed by its wait); the
/// last node's outputs are the graph's. Node `round * benchmarks.len() + i` is benchmark
/// `i`'s when none is a collective.
pub fn graph_of(benchmarks: &[Benchmark]) -> pb::Graph {
    let value = |name: String, dtype: pb::Dtype, shape: &[i64], role: pb::Role| pb::Value {
        name,
        dtype: dtype as i32,
        shape: shape.to_vec(),
        role: role as i32,
    };
    let mut values = Vec::new();
    let mut inputs: Vec<Vec<String>> = Vec::new();
    for (b, bench) in benchmarks.iter().enumerate() {
        let names: Vec<String> = (0..bench.inputs.len())
            .map(|i| format!("x{b}_{i}"))
            .collect();
        for (name, shape) in names.iter().zip(&bench.inputs) {
            values.push(value(name.clone(), bench.dtype, shape, pb::Role::Input));
        }
        inputs.push(names);
    }
    let mut nodes = Vec::new();
    let repeats = benchmarks.first().map_or(0, |b| b.repeats);
    for r in 0..repeats {
        for (b, bench) in benchmarks.iter().enumerate() {
            let collective = bench.op.starts_with("_c10d_functional.");
            let outputs: Vec<String> = (0..bench.outputs.len())
                .map(|o| format!("y{b}_{r}_{o}"))
                .collect();
            for (name, (dtype, shape)) in outputs.iter().zip(&bench.outputs) {
                values.push(value(name.clone(), *dtype, shape, pb::Role::Activation));
            }
            nodes.push(node(
                format!("n{b}_{r}"),
                bench.op,
                inputs[b].clone(),
                outputs.clone(),
                &bench.attributes,
                collective,
            ));
            if collective {
                let waited = format!("w{b}_{r}");
                let (dtype, shape) = &bench.outputs[0];
                values.push(value(waited.clone(), *dtype, shape, pb::Role::Activation));
                nodes.push(node(
                    format!("wait{b}_{r}"),
                    "_c10d_functional.wait_tensor.default",
                    outputs[..1].to_vec(),
                    vec![waited],
                    &[],
                    true,
                ));
            }
        }
    }
    let outputs = nodes
        .last()
        .map_or_else(Vec::new, |n: &pb::Node| n.outputs.clone());
    let ops: Vec<&str> = benchmarks.iter().map(|b| b.op).collect();
    pb::Graph {
        name: format!("calibrate {}", ops.join(", ")),
        values,
        nodes,
        outputs,
        models: vec![pb::Model {
            name: "main".to_owned(),
            ..Default::default()
        }],
        metadata: Some(pb::Metadata {
            world_size: benchmarks.iter().map(|b| b.world).max().unwrap_or(1),
            ..Default::default()
        }),
    }
}

/// torch's name of a dtype (`float32`, `bfloat16`), as the IR's enumeration spells it.
fn dtype_name(dtype: pb::Dtype) -> String {
    dtype
        .as_str_name()
        .trim_start_matches("DTYPE_")
        .to_ascii_lowercase()
}

fn attribute_json(value: &AttrValue) -> serde_json::Value {
    match value {
        AttrValue::Int(i) => (*i).into(),
        AttrValue::Float(f) => (*f).into(),
        AttrValue::Str(s) => s.clone().into(),
        AttrValue::Bool(b) => (*b).into(),
        AttrValue::Ints(l) => l.values.clone().into(),
        AttrValue::Floats(l) => l.values.clone().into(),
        AttrValue::Strs(l) => l.values.clone().into(),
    }
}

fn node(
    name: String,
    op: &str,
    inputs: Vec<String>,
    outputs: Vec<String>,
    attributes: &[pb::Attribute],
    collective: bool,
) -> pb::Node {
    pb::Node {
        name,
        op: op.to_owned(),
        inputs,
        outputs,
        attributes: attributes.to_vec(),
        phase: pb::Phase::Forward as i32,
        model: "main".to_owned(),
        schema: collective.then(|| pb::SchemaFacts {
            collective: pb::CollectiveKind::Functional as i32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Sizes for this device: a GPU needs larger ops than a CPU to leave its overhead behind. On
/// a GPU, attention (its kernels take arguments a one-op graph does not express yet) and
/// collectives of ranks run as threads (two ranks need two GPUs) keep the base profile's
/// figures; ranks launched apart, each with its GPU, time theirs.
struct Sizes {
    matmul: &'static [i64],
    matmul_bf16: &'static [i64],
    elements: &'static [i64],
    transcendental: &'static [i64],
    attention_seq: &'static [i64],
    /// Thin matmuls: the two wide dimensions (rows of the result, then the other), and the
    /// sizes of the thin one, timed as each of `m`, `n` and `k` in turn.
    thin_matmul: (i64, i64),
    thin_sizes: &'static [i64],
    /// Top-k benchmarks: rows, row length, k.
    selection: &'static [(i64, i64, i64)],
    /// All-to-all rows of two ranks that are threads of one process (loopback).
    collective_rows: &'static [i64],
    /// ... of ranks launched as processes (`torchrun`), through their real process group.
    launched_collective_rows: &'static [i64],
    /// FLOPs or bytes each benchmark graph holds.
    work: f64,
    /// Bytes (read and written) each host copy's graph counts: a copy to the host crosses
    /// the host link, hundreds to thousands of times slower than a GPU's memory, into freshly
    /// allocated host memory.
    host_copy_work: f64,
}

const CPU: Sizes = Sizes {
    matmul: &[128, 256, 512, 768],
    // bf16 at the fp32 sizes' upper half: below 256 wide a CPU's bf16 kernels run at a
    // fraction of what a model's matmuls reach (41 GF/s at 64 wide, 237 at 128, 870 from 512 on
    // the test VM).
    matmul_bf16: &[256, 512, 768],
    elements: &[1 << 16, 1 << 20, 1 << 22],
    transcendental: &[1 << 14, 1 << 16, 1 << 18],
    attention_seq: &[128, 256, 512],
    // A model's tokens by its width (each thin size below both, so the thinnest dimension is
    // the one timed), wide enough that a 1-wide product takes far longer than an op's fixed
    // cost; MKL ran fp32 products with 2 to 8 in one dimension at 8 to 52 GFLOP/s on the test
    // VM's two threads, against 213 for square ones.
    thin_matmul: (2048, 1024),
    thin_sizes: &[1, 2, 4, 8, 16, 32, 64, 128],
    // A router's and a sparse-attention indexer's selections: the test VM's single thread ran
    // these at 0.3 to 0.6 G comparisons/s on one thread, against 6.6 GFLOP/s for `exp`.
    selection: &[(1024, 512, 16), (512, 1024, 64), (256, 2048, 128)],
    collective_rows: &[16, 1024, 16384],
    launched_collective_rows: &[16, 1024, 16384],
    work: 1.5e9,
    host_copy_work: 1.5e8,
};

const CUDA: Sizes = Sizes {
    matmul: &[1024, 2048, 4096],
    matmul_bf16: &[2048, 4096, 8192],
    elements: &[1 << 22, 1 << 24, 1 << 26],
    transcendental: &[1 << 22, 1 << 24],
    attention_seq: &[],
    // Sizes below both wide dimensions, as on the CPU.
    thin_matmul: (8192, 4096),
    thin_sizes: &[1, 2, 4, 8, 16, 32, 64, 128],
    selection: &[(1 << 16, 1024, 64), (1 << 14, 4096, 128)],
    collective_rows: &[],
    launched_collective_rows: &[1 << 12, 1 << 16, 1 << 20],
    work: 2e12,
    host_copy_work: 2e9,
};

/// The CPU's fused attention over `q`, `k`, `v` of `[batch, heads, seq, head dim]` in
/// `dtype`, without a mask, in the class `overhead_attention` (set another). Its log-sum-exp
/// is fp32 whatever the operands'.
fn cpu_attention(qkv: &[&[i64]; 3], dtype: pb::Dtype) -> Benchmark {
    let q = qkv[0];
    Benchmark::new(
        "overhead_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        dtype,
        qkv,
    )
    .output(vec![
        (dtype, q.to_vec()),
        (pb::Dtype::Float32, q[..3].to_vec()),
    ])
    .attribute("is_causal", AttrValue::Bool(false))
    .attribute(
        "absent_tensor_args",
        AttrValue::Strs(pb::StringList {
            values: vec!["attn_mask".to_owned()],
        }),
    )
}

/// The benchmarks for a device (`cuda` or not), collectives over `world` ranks: the
/// interleaved ones (`mixed`) first, as one group, then those that run alone.
pub fn benchmarks(cuda: bool, world: u32) -> Vec<Benchmark> {
    use pb::Dtype::{Bfloat16 as BF16, Float32 as F32};
    let sizes = if cuda { &CUDA } else { &CPU };
    let work = sizes.work;
    // The fixed cost of each op class: its op at a small size, where the roofline is at most a
    // fraction of a microsecond (a matmul, a reduction and attention at 32 wide, not 1: a
    // 1 x 1 matmul skips the BLAS library's setup and threads a model's smallest matmuls
    // pay), interleaved with the other classes' as a model's ops are (one op repeated alone
    // runs from warm caches, and measured below what the same op costs in a model).
    let tiny = |b: Benchmark| Benchmark {
        repeats: 100,
        mixed: true,
        ..b
    };
    let mut all = vec![
        tiny(Benchmark::new(
            "overhead",
            "aten.add.Tensor",
            F32,
            &[&[1], &[1]],
        )),
        tiny(Benchmark::new(
            "overhead",
            "aten.mul.Tensor",
            F32,
            &[&[1], &[1]],
        )),
        tiny(Benchmark::new("overhead", "aten.neg.default", F32, &[&[1]])),
        tiny(Benchmark::new(
            "overhead_view",
            "aten.detach.default",
            F32,
            &[&[1, 1]],
        )),
        tiny(
            Benchmark::new("host_sync", "aten._to_copy.default", F32, &[&[1]])
                .attribute("device", AttrValue::Str("cpu".to_owned())),
        ),
        tiny(Benchmark::new(
            "overhead_view",
            "aten.t.default",
            F32,
            &[&[1, 1]],
        )),
        tiny(Benchmark::new(
            "overhead_matmul",
            "aten.mm.default",
            F32,
            &[&[32, 32], &[32, 32]],
        )),
        tiny(
            Benchmark::new(
                "overhead_reduction",
                "aten.sum.dim_IntList",
                F32,
                &[&[32, 32]],
            )
            .output(vec![(F32, vec![32])])
            .attribute("dim", AttrValue::Ints(pb::IntList { values: vec![-1] })),
        ),
    ];
    if !cuda {
        let qkv: [&[i64]; 3] = [&[1, 2, 16, 16], &[1, 2, 16, 16], &[1, 2, 16, 16]];
        all.push(tiny(cpu_attention(&qkv, F32)));
    }
    // The same elementwise ops in a checkpointed layer: what eager selective checkpointing
    // adds to each (timed by `recompute_planner.calibrate` only).
    for op in ["aten.add.Tensor", "aten.mul.Tensor"] {
        all.push(Benchmark {
            repeats: 100,
            checkpointed: true,
            ..Benchmark::new("checkpoint", op, F32, &[&[1], &[1]])
        });
    }
    for (class, dtype, ns) in [
        ("matmul_f32", F32, sizes.matmul),
        ("matmul_bf16", BF16, sizes.matmul_bf16),
    ] {
        for &n in ns {
            let flops = 2.0 * (n as f64).powi(3);
            all.push(
                Benchmark::new(class, "aten.mm.default", dtype, &[&[n, n], &[n, n]])
                    .repeated_for(flops, work),
            );
        }
    }
    all.extend(thin_matmuls(sizes, work / 20.0));
    // Fused attention on the CPU, fp32 and bf16 (a GPU's kernels take arguments a one-op graph
    // does not express yet: attention stays at the base profile's share there).
    for &s in sizes.attention_seq {
        let (b, h, d) = (1, 8, 64);
        let flops = 4.0 * (b * h) as f64 * (s * s * d) as f64;
        let qkv: [&[i64]; 3] = [&[b, h, s, d], &[b, h, s, d], &[b, h, s, d]];
        for (class, dtype) in [("attention", F32), ("attention_bf16", BF16)] {
            all.push(
                Benchmark {
                    class,
                    ..cpu_attention(&qkv, dtype)
                }
                .repeated_for(flops, work),
            );
        }
    }
    for &n in sizes.elements {
        let bytes = 12.0 * n as f64;
        all.push(
            Benchmark::new("memory", "aten.add.Tensor", F32, &[&[n], &[n]])
                .repeated_for(bytes, work / 10.0),
        );
        all.push(
            Benchmark::new("memory", "aten.clone.default", F32, &[&[n]])
                .repeated_for(bytes, work / 10.0),
        );
        all.push(
            Benchmark::new("reduction", "aten.sum.default", F32, &[&[n]])
                .output(vec![(F32, vec![])])
                .repeated_for(bytes, work / 10.0),
        );
        all.push(
            Benchmark::new("host_copy", "aten._to_copy.default", F32, &[&[n]])
                .attribute("device", AttrValue::Str("cpu".to_owned()))
                .repeated_for(bytes, sizes.host_copy_work),
        );
    }
    // A top-k's comparisons run an order of magnitude below the vector rate: a hundredth of
    // the work keeps each benchmark to tens of milliseconds.
    for &(rows, n, k) in sizes.selection {
        let topk = Benchmark::new("selection", "aten.topk.default", F32, &[&[rows, n]])
            .output(vec![
                (F32, vec![rows, k]),
                (pb::Dtype::Int64, vec![rows, k]),
            ])
            .attribute("k", AttrValue::Int(k));
        let comparisons = topk.cost().map_or(1.0, |c| c.flops as f64);
        all.push(topk.repeated_for(comparisons, work / 100.0));
    }
    for &n in sizes.transcendental {
        all.push(
            Benchmark::new("transcendental", "aten.exp.default", F32, &[&[n]])
                .repeated_for(8.0 * n as f64, work / 20.0),
        );
    }

    all.extend(collectives(sizes.collective_rows, world, work));
    all
}

/// Matmuls with one thin dimension, fp32 and bf16: each of `m`, `n` and `k` at each thin
/// size, the other two wide, each graph holding about `work` FLOPs.
fn thin_matmuls(sizes: &Sizes, work: f64) -> Vec<Benchmark> {
    use pb::Dtype::{Bfloat16 as BF16, Float32 as F32};
    let (rows, width) = sizes.thin_matmul;
    let mut all = Vec::new();
    for (class, dtype) in [("thin_matmul_f32", F32), ("thin_matmul_bf16", BF16)] {
        for &d in sizes.thin_sizes {
            // `[m, k] x [k, n]` with `d` as `m`, `n`, then `k`.
            for (m, k, n) in [(d, width, rows), (rows, width, d), (rows, d, width)] {
                let flops = 2.0 * (m * k * n) as f64;
                all.push(
                    Benchmark::new(class, "aten.mm.default", dtype, &[&[m, k], &[k, n]])
                        .output(vec![(dtype, vec![m, n])])
                        .repeated_for(flops, work),
                );
            }
        }
    }
    all
}

/// The collective benchmarks of a process group of `world` ranks launched apart (`torchrun`:
/// gloo on the CPU, NCCL on CUDA), at the device's sizes, all with the same repeats so that
/// [`graph_of`] can interleave them in one graph: a launched job rendezvouses once.
pub fn launched_collectives(cuda: bool, world: u32) -> Vec<Benchmark> {
    let sizes = if cuda { &CUDA } else { &CPU };
    let mut all = collectives(sizes.launched_collective_rows, world, sizes.work);
    let repeats = all.iter().map(|b| b.repeats).min().unwrap_or(3);
    for bench in &mut all {
        bench.repeats = repeats;
    }
    all
}

/// The functional collectives a model's graph holds, over `world` ranks, for each of `rows`
/// (rounded up to a multiple of the ranks) in fp32 rows of 64: `all_to_all_single` of
/// `[rows, 64]` split evenly, `all_gather_into_tensor` of each rank's `[rows / world, 64]`
/// into `[rows, 64]`, and `reduce_scatter_tensor` (a sum) of `[rows, 64]` into
/// `[rows / world, 64]`; each repeated for a tenth of `work` bytes sent, so that no size
/// grows with the world.
fn collectives(rows: &[i64], world: u32, work: f64) -> Vec<Benchmark> {
    use pb::Dtype::Float32 as F32;
    let ranks = i64::from(world.max(1));
    let ints = |values: Vec<i64>| AttrValue::Ints(pb::IntList { values });
    let group = || AttrValue::Str("0".to_owned());
    let mut all = Vec::new();
    for &rows in rows {
        let rows = (rows.max(ranks) + ranks - 1) / ranks * ranks;
        let (whole, share): (&[i64], &[i64]) = (&[rows, 64], &[rows / ranks, 64]);
        let collective = |op: &'static str, input: &[i64]| Benchmark {
            world,
            ..Benchmark::new("collective", op, F32, &[input])
        };
        let splits = vec![rows / ranks; ranks as usize];
        all.push(
            collective("_c10d_functional.all_to_all_single.default", whole)
                .attribute("output_split_sizes", ints(splits.clone()))
                .attribute("input_split_sizes", ints(splits))
                .attribute("group_name", group()),
        );
        all.push(
            collective("_c10d_functional.all_gather_into_tensor.default", share)
                .output(vec![(F32, whole.to_vec())])
                .attribute("group_size", AttrValue::Int(ranks))
                .attribute("group_name", group()),
        );
        all.push(
            collective("_c10d_functional.reduce_scatter_tensor.default", whole)
                .output(vec![(F32, share.to_vec())])
                .attribute("reduce_op", AttrValue::Str("sum".to_owned()))
                .attribute("group_size", AttrValue::Int(ranks))
                .attribute("group_name", group()),
        );
    }
    all.into_iter()
        .map(|b| {
            let sent = bytes_sent(&b);
            b.repeated_for(sent, work / 10.0)
        })
        .collect()
}

/// The bytes a collective benchmark's op sends, by the knowledge base (0 for another op).
fn bytes_sent(bench: &Benchmark) -> f64 {
    Graph::from_wire(bench.graph()).map_or(0.0, |g| {
        g.node_cost(NodeId::from_index(0)).comm_bytes as f64
    })
}

/// The timings of an executor that ran [`benchmarks`]`(cuda, world)` elsewhere (eager
/// PyTorch): `medians[i]` is the median seconds of one op of benchmark `i`, `None` where it did
/// not run (a collective without a process group).
pub fn timings_of(
    cuda: bool,
    world: u32,
    medians: &[Option<f64>],
    runs: u32,
) -> Result<Vec<Timing>, String> {
    let all = benchmarks(cuda, world);
    if medians.len() != all.len() {
        return Err(format!(
            "{} medians for the {} benchmarks of this device",
            medians.len(),
            all.len()
        ));
    }
    all.iter()
        .zip(medians)
        .filter_map(|(bench, median)| median.map(|m| bench.timing(m, runs)))
        .collect()
}

/// Why a calibration cannot make a profile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    #[error("the calibration has no `overhead` timing: every other rate is measured above it")]
    NoOverhead,
    #[error("timing {index} (`{class}` {op}): {reason}")]
    Timing {
        index: usize,
        class: String,
        op: String,
        reason: String,
    },
}

/// The profile `calibration` measures, named `name`, on top of `base` for what it did not
/// measure (fp64 and fp8 matmuls, a device's capability), with the device's memory where
/// known.
pub fn fit(
    base: &HwProfile,
    name: &str,
    memory_bytes: Option<f64>,
    calibration: Calibration,
) -> Result<HwProfile, FitError> {
    check(&calibration.timings)?;
    let timings = &calibration.timings;
    let overhead =
        median(class(timings, "overhead").map(|t| t.median_s)).ok_or(FitError::NoOverhead)?;
    let mut not_measured = Vec::new();
    // A class's own overhead, from its smallest op: the general one where it was not timed.
    let mut class_overhead = |name: &str, field: &str| {
        median(class(timings, name).map(|t| t.median_s)).unwrap_or_else(|| {
            not_measured.push(field.to_owned());
            overhead
        })
    };
    let view = class_overhead("overhead_view", "view_overhead_s");
    let matmul = class_overhead("overhead_matmul", "matmul_overhead_s");
    let attention_overhead = class_overhead("overhead_attention", "attention_overhead_s");
    let reduction = class_overhead("overhead_reduction", "reduction_overhead_s");
    // A GPU runs what the host queues while the host goes on; a CPU runs each op as it is
    // called.
    let asynchronous = calibration.device != "cpu";
    // Work per second, the median over the class's sizes. In order (a CPU), an op's time is
    // its overhead plus its work: the overhead is taken off. On an asynchronous device a
    // benchmark's repeated ops launch while earlier ones run, so an op takes the longer of
    // the two: only sizes whose time is well above the overhead (the device's work) count,
    // whole.
    let per_second = move |t: &Timing, work: u64, fixed: f64| {
        if asynchronous {
            (t.median_s > 1.5 * fixed).then(|| work as f64 / t.median_s)
        } else {
            Some(work as f64 / (t.median_s - fixed).max(f64::MIN_POSITIVE))
        }
    };
    let rate = |name: &str, work: fn(&Timing) -> u64, fixed: f64| {
        median(class(timings, name).filter_map(|t| per_second(t, work(t), fixed)))
    };
    let above = |t: &Timing| (t.median_s - overhead).max(f64::MIN_POSITIVE);
    let mut profile = HwProfile {
        name: name.to_owned(),
        op_overhead_s: overhead,
        view_overhead_s: view,
        matmul_overhead_s: matmul,
        attention_overhead_s: attention_overhead,
        reduction_overhead_s: reduction,
        calibration: None,
        ..base.clone()
    };
    // A fitted figure (true), or the base's with the field listed as not measured.
    fn set(field: &mut f64, value: Option<f64>, what: &str, missing: &mut Vec<String>) -> bool {
        match value {
            Some(v) if v.is_finite() && v > 0.0 => {
                *field = v;
                true
            }
            _ => {
                missing.push(what.to_owned());
                false
            }
        }
    }
    let f32_measured = set(
        &mut profile.matmul_f32_flops_per_s,
        rate("matmul_f32", |t| t.flops, matmul),
        "matmul_f32_flops_per_s",
        &mut not_measured,
    );
    let bf16_measured = set(
        &mut profile.matmul_flops_per_s,
        rate("matmul_bf16", |t| t.flops, matmul),
        "matmul_flops_per_s",
        &mut not_measured,
    );
    set(
        &mut profile.hbm_bytes_per_s,
        rate("memory", |t| t.bytes, overhead),
        "hbm_bytes_per_s",
        &mut not_measured,
    );
    // A transcendental op sets the vector rate only where it is compute-bound: on a GPU `exp`
    // runs at memory speed, which says nothing of the rate.
    let hbm = profile.hbm_bytes_per_s;
    let compute_bound = |t: &&Timing| t.median_s - overhead > 1.5 * t.bytes as f64 / hbm;
    set(
        &mut profile.vector_flops_per_s,
        median(
            class(timings, "transcendental")
                .filter(compute_bound)
                .map(|t| t.flops as f64 / above(t)),
        ),
        "vector_flops_per_s",
        &mut not_measured,
    );
    // Top-k and sorts not timed select at the vector rate, as a profile without the field
    // does.
    if !set(
        &mut profile.selection_ops_per_s,
        rate("selection", |t| t.flops, reduction),
        "selection_ops_per_s",
        &mut not_measured,
    ) {
        profile.selection_ops_per_s = profile.vector_flops_per_s;
    }
    // An attention kernel's share of its dtype's matmul rate, where that rate was measured.
    let share = |class: &str, matmul: Option<f64>| {
        share_of(rate(class, |t| t.flops, attention_overhead)?, matmul?)
    };
    set(
        &mut profile.attention_efficiency,
        share(
            "attention",
            f32_measured.then_some(profile.matmul_f32_flops_per_s),
        ),
        "attention_efficiency",
        &mut not_measured,
    );
    // Not timed (a GPU), 16-bit kernels take `attention_efficiency`.
    profile.attention_16bit_efficiency = share(
        "attention_bf16",
        bf16_measured.then_some(profile.matmul_flops_per_s),
    );
    if profile.attention_16bit_efficiency.is_none() {
        not_measured.push("attention_16bit_efficiency".to_owned());
    }
    // Each thin matmul's share of its operands' rate, where that rate was measured.
    let full_rates = [
        (
            "thin_matmul_f32",
            MatmulOperands::F32,
            f32_measured.then_some(profile.matmul_f32_flops_per_s),
        ),
        (
            "thin_matmul_bf16",
            MatmulOperands::Bits16,
            bf16_measured.then_some(profile.matmul_flops_per_s),
        ),
    ];
    // One line per operands, dimension and size: the median of its timings' shares.
    let mut shares: BTreeMap<(MatmulOperands, MatmulDim, u64), Vec<f64>> = BTreeMap::new();
    for (name, operands, full) in full_rates {
        let Some(full) = full else { continue };
        // A timing within twice the matmul's fixed cost says little of its rate.
        for t in class(timings, name).filter(|t| t.median_s > 2.0 * matmul) {
            let rate = per_second(t, t.flops, matmul);
            let (Some((dim, size)), Some(share)) =
                (thin_dimension(t), rate.and_then(|r| share_of(r, full)))
            else {
                continue;
            };
            shares.entry((operands, dim, size)).or_default().push(share);
        }
    }
    let thin: Vec<ThinMatmul> = shares
        .into_iter()
        .filter_map(|((operands, dim, size), values)| {
            Some(ThinMatmul {
                operands,
                dim,
                size,
                efficiency: median(values)?,
            })
        })
        .collect();
    // None timed: the base's stand.
    match thin.is_empty() {
        true => not_measured.push("thin_matmuls".to_owned()),
        false => profile.thin_matmuls = thin,
    }
    set(
        &mut profile.memory_bytes,
        memory_bytes,
        "memory_bytes",
        &mut not_measured,
    );
    // How much host memory offload may take is the user's to say, not a benchmark's.
    not_measured.push("host_memory_bytes".to_owned());
    // Latencies may be measured as 0 (a host sync on a device that is the host).
    match median(class(timings, "host_sync").map(above)) {
        Some(sync) => profile.host_sync_s = if sync <= f64::MIN_POSITIVE { 0.0 } else { sync },
        None => not_measured.push("host_sync_s".to_owned()),
    }
    // A copy to the host costs, as the model times it, the overhead, its bytes through memory,
    // the synchronisation, and its output (half its bytes) over the host link.
    let host_rate = median(class(timings, "host_copy").filter_map(|t| {
        let link = t.median_s - overhead - t.bytes as f64 / hbm - profile.host_sync_s;
        (link > 0.0).then(|| t.bytes as f64 / 2.0 / link)
    }));
    match host_rate {
        Some(rate) if rate.is_finite() => profile.host_bytes_per_s = rate,
        _ => not_measured.push("host_bytes_per_s".to_owned()),
    }
    match median(class(timings, "checkpoint").map(above)) {
        Some(added) => profile.checkpoint_op_overhead_s = added,
        None => not_measured.push("checkpoint_op_overhead_s".to_owned()),
    }
    profile.asynchronous = asynchronous;
    let collective = |t: &&Timing| t.class == "collective";
    match collective_fit(timings.iter().filter(collective), &profile) {
        Some((latency, link)) => {
            profile.collective_latency_s = latency;
            profile.link_bytes_per_s = link;
        }
        None => not_measured.extend([
            "collective_latency_s".to_owned(),
            "link_bytes_per_s".to_owned(),
        ]),
    }
    // Each collective op timed at two sizes or more gets its own line too: gloo's all-gather
    // and reduce-scatter cost about twice its all-to-all of the same bytes.
    let mut ops: Vec<&str> = timings
        .iter()
        .filter(collective)
        .map(|t| t.op.as_str())
        .collect();
    ops.sort_unstable();
    ops.dedup();
    profile.collectives = ops
        .iter()
        .filter(|_| ops.len() > 1)
        .filter_map(|&op| {
            let (latency_s, link_bytes_per_s) =
                collective_fit(timings.iter().filter(|t| t.op == op), &profile)?;
            Some(CollectiveRates {
                op: op.to_owned(),
                latency_s,
                link_bytes_per_s,
            })
        })
        .collect();
    not_measured.extend(["matmul_f64_flops_per_s", "matmul_f8_flops_per_s"].map(str::to_owned));
    profile.calibration = Some(Calibration {
        not_measured,
        ..calibration
    });
    Ok(profile)
}

/// `rate` as a share of `full`, at most 1; `None` unless `rate` is a positive number.
fn share_of(rate: f64, full: f64) -> Option<f64> {
    (rate.is_finite() && rate > 0.0).then(|| (rate / full).min(1.0))
}

/// The thinnest dimension of a timed `mm` of `[m, k] x [k, n]` and its size: `m` and `k`
/// are its first operand's shape, `n` its FLOPs over `2·m·k`.
fn thin_dimension(t: &Timing) -> Option<(MatmulDim, u64)> {
    let &[m, k] = t.shape.as_slice() else {
        return None;
    };
    let n = t.flops.checked_div(m.checked_mul(k)?.checked_mul(2)?)?;
    MatmulDim::sizes(MatmulDims { m, n, k })
        .into_iter()
        .min_by_key(|&(_, size)| size)
}

/// Latency and bandwidth of collectives: the least-squares line through (bytes sent, seconds)
/// of `timings`, each less what the model times apart from latency and link
/// (the op's overhead and its bytes through memory, and the `wait_tensor` after it, a view);
/// `None` without two sizes that tell a slope.
fn collective_fit<'t>(
    timings: impl Iterator<Item = &'t Timing>,
    profile: &HwProfile,
) -> Option<(f64, f64)> {
    let points: Vec<(f64, f64)> = timings
        .map(|t| {
            let apart = profile.op_overhead_s
                + t.bytes as f64 / profile.hbm_bytes_per_s
                + profile.view_overhead_s;
            (t.comm_bytes as f64, t.median_s - apart)
        })
        .collect();
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = sxy / sxx;
    (sxx > 0.0 && slope > 0.0).then(|| ((my - slope * mx).max(0.0), 1.0 / slope))
}

/// Every timing must be a positive, finite number of seconds of a known class.
fn check(timings: &[Timing]) -> Result<(), FitError> {
    for (index, t) in timings.iter().enumerate() {
        let reason = if !CLASSES.contains(&t.class.as_str()) {
            Some(format!(
                "unknown class; the classes are {}",
                CLASSES.join(", ")
            ))
        } else if !(t.median_s.is_finite() && t.median_s > 0.0) {
            Some(format!(
                "median_s must be a positive number of seconds, got {}",
                t.median_s
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(FitError::Timing {
                index,
                class: t.class.clone(),
                op: t.op.clone(),
                reason,
            });
        }
    }
    Ok(())
}

fn class<'t>(timings: &'t [Timing], name: &'t str) -> impl Iterator<Item = &'t Timing> + 't {
    timings.iter().filter(move |t| t.class == name)
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.into_iter().collect();
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn timing(class: &str, flops: u64, bytes: u64, comm_bytes: u64, median_s: f64) -> Timing {
        Timing {
            class: class.to_owned(),
            op: "aten.op.default".to_owned(),
            dtype: "float32".to_owned(),
            shape: vec![1],
            flops,
            bytes,
            comm_bytes,
            median_s,
            runs: 5,
        }
    }

    /// A launched job's collectives (an all-to-all, an all-gather and a reduce-scatter at each
    /// size) hold a whole number of rows per rank, at least one, send the same bytes at one
    /// size whatever the world (no gathered output grows with it), and share one repeat count,
    /// so one graph interleaves them.
    #[test]
    fn launched_collectives_split_over_the_world_with_one_repeat_count() {
        for (cuda, world) in [(false, 2), (false, 3), (false, 64), (true, 8)] {
            let all = launched_collectives(cuda, world);
            assert_eq!(all.len(), 9);
            let graph = Graph::from_wire(graph_of(&all)).expect("a valid graph");
            assert_eq!(graph.nodes().len(), 2 * all.len() * all[0].repeats);
            for sizes in all.chunks(3) {
                // One size: the same bytes cross the wire whatever the op and the world.
                let rows = sizes[0].inputs[0][0];
                assert!(rows >= i64::from(world) && rows % i64::from(world) == 0);
                for bench in sizes {
                    assert_eq!((bench.world, bench.repeats), (world, all[0].repeats));
                    let timing = bench.timing(1e-3, 3).expect("a timing");
                    assert_eq!(timing.comm_bytes, rows as u64 * 64 * 4, "{}", bench.op);
                }
            }
            let ops: HashSet<&str> = all.iter().map(|b| b.op).collect();
            assert_eq!(ops.len(), 3);
        }
    }

    fn calibration(timings: Vec<Timing>) -> Calibration {
        Calibration {
            device: "cpu".to_owned(),
            description: "test".to_owned(),
            threads: 2,
            timings,
            not_measured: Vec::new(),
            collectives: None,
        }
    }

    /// A device with 10 us per op, 1e11 FLOP/s fp32 matmuls and 1e10 B/s memory, timed
    /// exactly: the fit reads those figures back.
    #[test]
    fn a_fit_reads_back_the_rates_of_exact_timings() {
        let overhead = 10e-6;
        let mut timings = vec![timing("overhead", 1, 12, 0, overhead)];
        for n in [1e6, 1e8, 1e9] {
            timings.push(timing("matmul_f32", n as u64, 0, 0, overhead + n / 1e11));
            timings.push(timing("memory", 0, n as u64, 0, overhead + n / 1e10));
            timings.push(timing("attention", n as u64, 0, 0, overhead + n / 5e10));
            timings.push(timing("selection", n as u64, 0, 0, overhead + n / 1e9));
        }
        // A collective and its wait (a view, whose overhead is the general one here).
        for bytes in [1e3, 1e6] {
            let seconds = 2.0 * overhead + 20e-6 + bytes / 1e9;
            timings.push(timing("collective", 0, 0, bytes as u64, seconds));
        }
        let base = HwProfile::shipped("h100").unwrap();
        let profile = fit(&base, "test", None, calibration(timings)).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs();
        assert!(
            close(profile.op_overhead_s, overhead),
            "{}",
            profile.op_overhead_s
        );
        assert!(close(profile.matmul_f32_flops_per_s, 1e11));
        assert!(close(profile.hbm_bytes_per_s, 1e10));
        assert!(close(profile.attention_efficiency, 0.5));
        assert!(close(profile.selection_ops_per_s, 1e9));
        assert!(
            close(profile.collective_latency_s, 20e-6),
            "{}",
            profile.collective_latency_s
        );
        assert!(close(profile.link_bytes_per_s, 1e9));
        // What was not measured keeps the base's figure and is listed.
        assert_eq!(profile.matmul_flops_per_s, base.matmul_flops_per_s);
        let listed = &profile.calibration.as_ref().unwrap().not_measured;
        for field in ["matmul_flops_per_s", "vector_flops_per_s", "host_sync_s"] {
            assert!(listed.iter().any(|f| f == field), "{field}: {listed:?}");
        }
        assert!(!listed.iter().any(|f| f == "hbm_bytes_per_s"));
    }

    /// Timings of a device with 10 us per op whose FLOP classes run exactly at their rates,
    /// each at two sizes.
    fn exact_flops(rates: &[(&str, f64)]) -> Vec<Timing> {
        let overhead = 10e-6;
        let mut timings = vec![timing("overhead", 1, 12, 0, overhead)];
        for n in [1e6, 1e8] {
            for &(class, rate) in rates {
                timings.push(timing(class, n as u64, 0, 0, overhead + n / rate));
            }
        }
        timings
    }

    /// A calibration without top-k timings selects at the vector rate it fitted (as a profile
    /// without the field does), not at the base's, and says so; without a bf16 attention
    /// timing the 16-bit share is absent (`attention_efficiency` applies); without thin
    /// matmul timings the base's shares stand.
    #[test]
    fn untimed_top_k_selects_at_the_fitted_vector_rate() {
        let timings = exact_flops(&[("transcendental", 7e9)]);
        // A base calibrated before, whose thin-matmul lines stand where none is timed.
        let base = HwProfile {
            thin_matmuls: vec![ThinMatmul {
                operands: MatmulOperands::F32,
                dim: MatmulDim::K,
                size: 4,
                efficiency: 0.1,
            }],
            ..HwProfile::shipped("h100").unwrap()
        };
        let profile = fit(&base, "test", None, calibration(timings)).unwrap();
        assert!((profile.vector_flops_per_s - 7e9).abs() < 1.0);
        assert_eq!(profile.selection_ops_per_s, profile.vector_flops_per_s);
        assert_eq!(profile.attention_16bit_efficiency, None);
        let listed = &profile.calibration.as_ref().unwrap().not_measured;
        for field in [
            "selection_ops_per_s",
            "attention_16bit_efficiency",
            "thin_matmuls",
        ] {
            assert!(listed.iter().any(|f| f == field), "{field}: {listed:?}");
        }
        assert_eq!(profile.thin_matmuls, base.thin_matmuls);
    }

    /// Each thin matmul benchmark gives its dimension and size the share of its operands'
    /// fitted rate it ran at; 16-bit ones give none where the 16-bit rate was not measured.
    #[test]
    fn a_thin_matmul_is_fitted_to_its_share_of_its_operands_rate() {
        // Matmuls pay 20 us of their own above the general 10 us.
        let matmul_overhead = 20e-6;
        let mut timings = vec![
            timing("overhead", 1, 12, 0, 10e-6),
            timing("overhead_matmul", 1, 0, 0, matmul_overhead),
        ];
        for n in [1e6, 1e8] {
            timings.push(timing(
                "matmul_f32",
                n as u64,
                0,
                0,
                matmul_overhead + n / 1e11,
            ));
        }
        // A share falling with the thin size, lowest when `k` is thin; `n` at 128 ran faster
        // than the square matmuls (capped at the full rate).
        let share = |dim: MatmulDim, size: u64| match (dim, size) {
            (MatmulDim::N, 128) => 1.5,
            (MatmulDim::K, _) => 0.5 * (size as f64 / 64.0).min(1.0),
            _ => (size as f64 / 64.0).min(1.0),
        };
        let mut expected = Vec::new();
        for bench in benchmarks(false, 1) {
            let class = bench.class;
            if !class.starts_with("thin_matmul") {
                continue;
            }
            let flops = bench.timing(1.0, 3).unwrap().flops as f64;
            let [m, k] = bench.inputs[0][..] else {
                panic!("a matrix")
            };
            let n = bench.inputs[1][1];
            let [m, n, k] = [m, n, k].map(|d| d as u64);
            let (dim, size) = MatmulDim::sizes(MatmulDims { m, n, k })
                .into_iter()
                .min_by_key(|&(_, size)| size)
                .unwrap();
            let seconds = |share: f64| matmul_overhead + flops / (1e11 * share);
            if (class, dim, size) == ("thin_matmul_f32", MatmulDim::K, 1) {
                // Within twice the matmul's fixed cost: no line.
                timings.push(bench.timing(1.5 * matmul_overhead, 3).unwrap());
                continue;
            }
            timings.push(bench.timing(seconds(share(dim, size)), 3).unwrap());
            if class == "thin_matmul_f32" {
                let mut fitted = share(dim, size).min(1.0);
                if (dim, size) == (MatmulDim::M, 4) {
                    // Timed twice: the line takes the median of the two shares.
                    timings.push(bench.timing(seconds(0.25), 3).unwrap());
                    fitted = (fitted + 0.25) / 2.0;
                }
                expected.push((dim, size, fitted));
            }
        }
        assert_eq!(expected.len(), 3 * CPU.thin_sizes.len() - 1);
        let base = HwProfile::shipped("h100").unwrap();
        let profile = fit(&base, "test", None, calibration(timings)).unwrap();
        assert_eq!(profile.thin_matmuls.len(), expected.len());
        for (dim, size, share) in expected {
            let fitted = profile
                .thin_matmuls
                .iter()
                .find(|t| (t.operands, t.dim, t.size) == (MatmulOperands::F32, dim, size))
                .unwrap_or_else(|| panic!("{dim:?} at {size}"));
            assert!((fitted.efficiency - share).abs() < 1e-9, "{fitted:?}");
        }
        // The profile reads back, its shares with it.
        let json = profile.to_json();
        assert_eq!(
            HwProfile::from_json(json.as_bytes(), "fitted").unwrap(),
            profile
        );
    }

    /// Every benchmark of either device is a graph the planner reads, with the work its
    /// class's rate is fitted from.
    #[test]
    fn every_benchmark_of_either_device_is_a_valid_graph_with_work() {
        for cuda in [false, true] {
            for bench in benchmarks(cuda, 2) {
                let timing = bench.timing(1e-3, 3).expect("a valid benchmark graph");
                let work = match bench.class {
                    "selection" | "attention" | "attention_bf16" | "matmul_f32" | "matmul_bf16"
                    | "thin_matmul_f32" | "thin_matmul_bf16" | "transcendental" => timing.flops,
                    "collective" => timing.comm_bytes,
                    _ => timing.bytes.max(timing.flops).max(1),
                };
                assert!(work > 0, "{} {} on cuda={cuda}", bench.class, bench.op);
            }
        }
    }

    /// A CPU's bf16 attention runs about as fast as its fp32 one, far below its bf16 matmuls:
    /// it gets its own share of the 16-bit matmul rate, and the planner times a bf16
    /// attention node by it (an fp32 one by the fp32 share).
    #[test]
    fn a_16bit_attention_is_timed_by_its_own_share_of_the_16bit_matmul_rate() {
        let timings = exact_flops(&[
            ("matmul_f32", 1e11),
            ("matmul_bf16", 1e12),
            ("attention", 5e10),
            ("attention_bf16", 5e10),
        ]);
        let base = HwProfile::shipped("h100").unwrap();
        let profile = fit(&base, "test", None, calibration(timings)).unwrap();
        let share = profile.attention_16bit_efficiency.unwrap();
        assert!((share - 0.05).abs() < 1e-9, "{share}");
        assert!((profile.attention_efficiency - 0.5).abs() < 1e-9);
        let attention = |dtype: pb::Dtype| {
            let mut b = testkit::Builder::new(1, &[]);
            let (q, k, v) = (b.input("q"), b.input("k"), b.input("v"));
            let op = "aten._scaled_dot_product_flash_attention_for_cpu.default";
            let (_, out) = b.node(op, &[&q, &k, &v]);
            b.output(&out);
            let mut wire = b.wire();
            for value in &mut wire.values {
                value.dtype = dtype as i32;
                value.shape = vec![1, 8, 512, 64];
            }
            let graph = Graph::from_wire(wire).unwrap();
            let node = NodeId::from_index(0);
            let flops = graph.node_cost(node).flops as f64;
            (profile.node_seconds(&graph, node) - profile.attention_overhead_s) / flops
        };
        // Seconds per FLOP: both kernels at 5e10 FLOP/s.
        for dtype in [pb::Dtype::Float32, pb::Dtype::Bfloat16] {
            let per_flop = attention(dtype);
            assert!(
                (per_flop * 5e10 - 1.0).abs() < 1e-6,
                "{dtype:?}: {per_flop}"
            );
        }
    }

    /// Collective ops timed apart get a line each (the general one runs through all of them),
    /// and the cost model times each op by its own.
    #[test]
    fn each_collective_op_timed_apart_is_fitted_and_timed_by_its_own_line() {
        let overhead = 10e-6;
        let mut timings = vec![timing("overhead", 1, 12, 0, overhead)];
        let gather = "_c10d_functional.all_gather_into_tensor.default";
        let all_to_all = "_c10d_functional.all_to_all_single.default";
        for (op, latency, link) in [(all_to_all, 20e-6, 1e9), (gather, 80e-6, 5e8)] {
            for bytes in [1e3, 1e6] {
                let seconds = 2.0 * overhead + latency + bytes / link;
                timings.push(Timing {
                    op: op.to_owned(),
                    ..timing("collective", 0, 0, bytes as u64, seconds)
                });
            }
        }
        let base = HwProfile::shipped("h100").unwrap();
        let profile = fit(&base, "test", None, calibration(timings)).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs();
        let rates = |op: &str| {
            let c = profile.collectives.iter().find(|c| c.op == op).unwrap();
            (c.latency_s, c.link_bytes_per_s)
        };
        let (latency, link) = rates(gather);
        assert!(
            close(latency, 80e-6) && close(link, 5e8),
            "{latency} {link}"
        );
        let (latency, link) = rates(all_to_all);
        assert!(
            close(latency, 20e-6) && close(link, 1e9),
            "{latency} {link}"
        );

        // An all-gather of 4 x 64 fp32 on 2 ranks, timed by the gather's line, not the
        // general one.
        let bench = &collectives(&[4], 2, 1.0)[1];
        assert_eq!(bench.op, gather);
        let graph = Graph::from_wire(bench.graph()).unwrap();
        let node = NodeId::from_index(0);
        let comm = graph.node_cost(node).comm_bytes as f64;
        let general = HwProfile {
            collectives: Vec::new(),
            ..profile.clone()
        };
        let own = profile.node_seconds(&graph, node) - general.node_seconds(&graph, node);
        let expected =
            80e-6 + comm / 5e8 - profile.collective_latency_s - comm / profile.link_bytes_per_s;
        assert!((own - expected).abs() < 1e-9, "{own} vs {expected}");
    }

    #[test]
    fn eager_checkpointings_cost_is_what_an_op_takes_above_the_overhead_and_a_gpu_queues() {
        let base = HwProfile::shipped("h100").unwrap();
        let overhead = vec![timing("overhead", 1, 12, 0, 10e-6)];
        let cpu = fit(&base, "cpu", None, calibration(overhead.clone())).unwrap();
        assert!(!cpu.asynchronous);
        let listed = &cpu.calibration.as_ref().unwrap().not_measured;
        assert!(listed.iter().any(|f| f == "checkpoint_op_overhead_s"));
        assert_eq!(cpu.checkpoint_op_overhead_s, base.checkpoint_op_overhead_s);

        let mut timings = overhead;
        timings.push(timing("checkpoint", 1, 12, 0, 45e-6));
        timings.push(timing("checkpoint", 1, 12, 0, 55e-6));
        let gpu = fit(
            &base,
            "gpu",
            None,
            Calibration {
                device: "cuda:0".to_owned(),
                ..calibration(timings)
            },
        )
        .unwrap();
        assert!(gpu.asynchronous);
        assert!((gpu.checkpoint_op_overhead_s - 40e-6).abs() < 1e-12);
    }

    /// A GPU launches a benchmark's repeated ops while earlier ones run: an op takes the
    /// longer of its overhead and its work, so a rate comes from the sizes the device's work
    /// bounds, whole; the small sizes, where the launches show, do not count.
    #[test]
    fn on_a_gpu_a_rate_comes_whole_from_the_sizes_the_devices_work_bounds() {
        let overhead = 10e-6;
        let mut timings = vec![timing("overhead", 1, 12, 0, overhead)];
        for bytes in [1e4, 1e5, 1e8, 1e9] {
            let seconds = f64::max(overhead, bytes / 1e10);
            timings.push(timing("memory", 0, bytes as u64, 0, seconds));
        }
        let gpu = Calibration {
            device: "cuda:0".to_owned(),
            ..calibration(timings.clone())
        };
        let base = HwProfile::shipped("h100").unwrap();
        let fitted = fit(&base, "gpu", None, gpu).unwrap();
        assert!(
            (fitted.hbm_bytes_per_s - 1e10).abs() < 1e-3,
            "{}",
            fitted.hbm_bytes_per_s
        );
        // The same timings read in order would take the overhead off the launch-bound sizes.
        let in_order = fit(&base, "cpu", None, calibration(timings)).unwrap();
        assert!(
            in_order.hbm_bytes_per_s > 1e12,
            "{}",
            in_order.hbm_bytes_per_s
        );
    }

    #[test]
    fn the_interleaved_benchmarks_come_first_and_hold_no_collective() {
        for cuda in [false, true] {
            let all = benchmarks(cuda, 2);
            let mixed = all.iter().take_while(|b| b.mixed).count();
            assert!(mixed >= 5, "{mixed}");
            assert!(all[mixed..].iter().all(|b| !b.mixed));
            assert!(all[..mixed]
                .iter()
                .all(|b| b.world == 1 && b.repeats == all[0].repeats));
            for class in [
                "overhead",
                "overhead_view",
                "overhead_matmul",
                "overhead_reduction",
            ] {
                assert!(all[..mixed].iter().any(|b| b.class == class), "{class}");
            }
            // Each interleaved op is the node its position says, in the validated graph the
            // runtime runs in node order.
            let graph = Graph::from_wire(graph_of(&all[..mixed])).unwrap();
            for (id, node) in graph.nodes().iter() {
                assert_eq!(node.op.as_str(), all[id.index() % mixed].op);
            }
        }
    }

    #[test]
    fn one_noisy_size_does_not_move_a_rate() {
        let mut timings = vec![timing("overhead", 1, 12, 0, 1e-6)];
        for (n, noise) in [(1e8, 1.0), (2e8, 1.0), (4e8, 30.0)] {
            timings.push(timing(
                "matmul_f32",
                n as u64,
                0,
                0,
                1e-6 + noise * n / 1e11,
            ));
        }
        let profile = fit(&HwProfile::default(), "t", None, calibration(timings)).unwrap();
        assert!((profile.matmul_f32_flops_per_s - 1e11).abs() < 1.0);
    }

    #[test]
    fn a_calibration_without_the_overhead_or_with_a_bad_timing_is_refused() {
        let base = HwProfile::default();
        assert_eq!(
            fit(
                &base,
                "t",
                None,
                calibration(vec![timing("memory", 0, 8, 0, 1e-3)])
            ),
            Err(FitError::NoOverhead)
        );
        for bad in [
            timing("memory", 0, 8, 0, f64::NAN),
            timing("warp", 0, 8, 0, 1e-3),
        ] {
            let error = fit(
                &base,
                "t",
                None,
                calibration(vec![timing("overhead", 1, 1, 0, 1e-6), bad]),
            )
            .unwrap_err()
            .to_string();
            assert!(error.starts_with("timing 1 "), "{error}");
        }
    }

    #[test]
    fn a_fitted_profile_reads_back_from_its_json() {
        let timings = vec![
            timing("overhead", 1, 12, 0, 3e-6),
            timing("host_sync", 0, 4, 0, 3e-6),
        ];
        let profile = fit(
            &HwProfile::default(),
            "cpu",
            Some(1e9),
            calibration(timings),
        )
        .unwrap();
        assert_eq!(profile.host_sync_s, 0.0);
        assert_eq!(profile.memory_bytes, 1e9);
        let json = profile.to_json();
        assert_eq!(HwProfile::from_json(json.as_bytes(), "p.json"), Ok(profile));
    }
}
