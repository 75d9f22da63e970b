//! The `run_inputs` target: `planner run`'s inputs on the CPU runtime. A small graph (an input,
//! an optional all-to-all with arbitrary split sizes, a `relu`) runs on 1 to 3 loopback ranks
//! from arbitrary safetensors files (raw bytes, or well-formed files of arbitrary keys, dtypes,
//! shapes and byte ranges, `rng/seed` among them), with or without `--seed`. The run succeeds
//! or fails with one clean line per rank; a panic, even one a rank thread caught and reported,
//! is a finding. Compiled into the fuzz crate with its `run` feature, and into the stable
//! replay test `cli/tests/run_fuzz_corpus.rs`.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use arbitrary::{Arbitrary, Unstructured};
use ir::{
    wire::graph::{self as pb, attribute::Value as AttrValue},
    Graph,
};
use planner::{config::PlanConfig, cost::HwProfile};
use runtime::{
    run::{self, RankJob, RunConfig},
    Device,
};

/// The longest line of an error accepted (names are shortened).
const MAX_LINE: usize = 4096;

/// The keys a tensors file may hold: the graph's, the reference's, and anything else.
#[derive(Arbitrary, Debug)]
enum Key {
    Input,
    RngSeed,
    RefLoss,
    Other(String),
}

impl Key {
    fn name(&self) -> String {
        match self {
            Key::Input => "input/x".to_owned(),
            Key::RngSeed => "rng/seed".to_owned(),
            Key::RefLoss => "ref/loss".to_owned(),
            Key::Other(name) => name.clone(),
        }
    }
}

/// One tensor of a well-formed file: `bytes_delta` moves the end of its byte range.
#[derive(Arbitrary, Debug)]
struct Entry {
    key: Key,
    dtype: u8,
    shape: Vec<u8>,
    bytes_delta: i8,
    fill: u8,
}

/// A rank's tensors file.
#[derive(Arbitrary, Debug)]
enum TensorsFile {
    Missing,
    Raw(Vec<u8>),
    Built(Vec<Entry>),
}

/// One run.
#[derive(Arbitrary, Debug)]
struct RunInput {
    ranks: u8,
    /// Output and input split sizes of an all-to-all, when the graph has one.
    splits: Option<(Vec<i64>, Vec<i64>)>,
    seed: Option<u64>,
    files: Vec<TensorsFile>,
}

const DTYPES: [&str; 14] = [
    "BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64",
    "F8_E4M3",
];

/// A safetensors file of `entries`, laid end to end (each range as its entry says).
fn built(entries: &[Entry]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for entry in entries.iter().take(8) {
        let shape: Vec<u64> = entry
            .shape
            .iter()
            .take(4)
            .map(|&d| u64::from(d % 9))
            .collect();
        let dtype = DTYPES[usize::from(entry.dtype) % DTYPES.len()];
        let width = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E4M3" => 1,
            "I16" | "U16" | "F16" | "BF16" => 2,
            "I32" | "U32" | "F32" => 4,
            _ => 8,
        };
        let len = (shape.iter().product::<u64>() * width) as i64 + i64::from(entry.bytes_delta);
        let start = data.len();
        data.resize(start + len.max(0) as usize, entry.fill);
        header.insert(
            entry.key.name(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&header).expect("JSON");
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(data);
    file
}

/// The graph: `x` [4, 4], an all-to-all of `x` when `splits` are given, then `relu`.
fn graph(ranks: u32, splits: Option<&(Vec<i64>, Vec<i64>)>) -> Option<Graph> {
    let value = |name: &str, role: pb::Role| pb::Value {
        name: name.to_owned(),
        dtype: pb::Dtype::Float32 as i32,
        shape: vec![4, 4],
        role: role as i32,
    };
    let node = |name: &str, op: &str, input: &str, output: &str| pb::Node {
        name: name.to_owned(),
        op: op.to_owned(),
        inputs: vec![input.to_owned()],
        outputs: vec![output.to_owned()],
        phase: pb::Phase::Forward as i32,
        model: "main".to_owned(),
        ..Default::default()
    };
    let mut wire = pb::Graph {
        name: "fuzzed".to_owned(),
        values: vec![value("x", pb::Role::Input)],
        models: vec![pb::Model {
            name: "main".to_owned(),
            ..Default::default()
        }],
        metadata: Some(pb::Metadata {
            world_size: ranks,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut last = "x".to_owned();
    if let Some((output, input)) = splits {
        let mut all_to_all = node(
            "a2a",
            "_c10d_functional.all_to_all_single.default",
            "x",
            "a2a.out",
        );
        for (name, sizes) in [("output_split_sizes", output), ("input_split_sizes", input)] {
            all_to_all.attributes.push(pb::Attribute {
                name: name.to_owned(),
                value: Some(AttrValue::Ints(pb::IntList {
                    values: sizes.iter().take(4).copied().collect(),
                })),
            });
        }
        wire.nodes.push(all_to_all);
        wire.values.push(value("a2a.out", pb::Role::Activation));
        last = "a2a.out".to_owned();
    }
    wire.nodes
        .push(node("relu", "aten.relu.default", &last, "y"));
    wire.values.push(value("y", pb::Role::Activation));
    wire.outputs.push("y".to_owned());
    Graph::from_wire(wire).ok()
}

/// Where this process writes the files of one run.
fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("run-inputs-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// Writes rank r's file as `STEM.rank<r>.safetensors` (rank 0: `path` itself).
fn write_files(path: &Path, files: &[TensorsFile], ranks: usize) {
    for rank in 0..ranks {
        let file = runtime::inputs::rank_path(path, rank);
        let _ = std::fs::remove_file(&file);
        match files.get(rank) {
            None | Some(TensorsFile::Missing) => {}
            Some(TensorsFile::Raw(bytes)) => std::fs::write(&file, bytes).expect("written"),
            Some(TensorsFile::Built(entries)) => {
                std::fs::write(&file, built(entries)).expect("written")
            }
        }
    }
}

/// Runs arbitrary inputs; an error must be clean lines, none of them a caught panic.
pub fn run_inputs(data: &[u8]) {
    let Ok(input) = RunInput::arbitrary(&mut Unstructured::new(data)) else {
        return;
    };
    let ranks = u32::from(input.ranks % 3) + 1;
    let Some(graph) = graph(ranks, input.splits.as_ref()) else {
        return;
    };
    let Ok(plan) = planner::plan::plan(&graph, &PlanConfig::default(), &HwProfile::default())
    else {
        return;
    };
    let path = scratch().join("inputs.safetensors");
    write_files(&path, &input.files, ranks as usize);
    let job = RankJob {
        graph: Arc::new(graph),
        plan: Arc::new(plan),
        whole_layer: None,
        inputs: path,
    };
    let config = RunConfig {
        device: Device::Cpu,
        seed: input.seed,
        check: false,
        timeout: Duration::from_secs(10),
        max_input_bytes: 64 << 20,
        fault: None,
        repeat: 1,
        // A fuzzing process runs many inputs: leave its allocator as it is.
        cpu_memory: run::CpuMemory::Release,
    };
    if let Err(e) = run::run_loopback(vec![job; ranks as usize], &config) {
        for line in e.to_string().lines() {
            assert!(!line.contains("panicked"), "a rank panicked: {line}");
            assert!(line.len() <= MAX_LINE, "a line of {} bytes", line.len());
            assert!(!line.chars().any(char::is_control), "{line:?}");
        }
    }
}
