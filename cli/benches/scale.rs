//! Load + plan + memory model at depth (issue: DeepSeek-V3 scale). Repeats a golden layer into
//! graphs of 61 layers, ~100k and ~1M nodes, writes each as `.pb`, then times
//! `ir::io::load` + `plan::plan` (policy, partition, verifier, diagnostics, memory simulation
//! of the plan and both baselines, cost) and reports the median of several runs, and the first
//! run apart (it faults in fresh memory, as a one-shot `planner plan` process does).
//!
//!     cargo bench -p planner-cli --bench scale [-- GRAPH.pb [RUNS]]

use std::{path::PathBuf, time::Instant};

use ir::io;
use ir::plan::Keep;
use planner::{config::PlanConfig, cost::HwProfile, plan::plan};
use testkit::deepen;

/// The `planner` binary's allocator settings (the same file).
#[path = "../src/allocator.rs"]
mod allocator;

/// The same allocator as the `planner` binary.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    allocator::keep_freed_memory();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let source = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("tests/golden/moe_ep2.pb"));
    let runs: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(5);
    let wire = io::read_wire(&source).expect("the source graph reads");
    let base = ir::Graph::from_wire(wire.clone()).expect("the source graph is valid");
    let per_layer = base.nodes().values().filter(|n| n.layer == Some(0)).count();
    let other = base.nodes().len() - 2 * per_layer;
    let dir = std::env::temp_dir().join(format!("planner-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = PlanConfig {
        keep: Keep::All,
        ..PlanConfig::default()
    };
    let hw = HwProfile::default();
    println!(
        "source {} ({} nodes/layer), keep all, median of {runs} runs",
        source.display(),
        per_layer
    );
    println!(
        "{:>7} {:>9} {:>10} {:>10} {:>10} {:>9} {:>13}",
        "layers", "nodes", "load ms", "plan ms", "total ms", "ns/node", "first run ms"
    );
    for target in [61usize, 100_000, 1_000_000] {
        let layers = if target < 1000 {
            target
        } else {
            (target - other) / per_layer
        };
        let deep = deepen(&wire, "main", 0, layers as u32).expect("deepens");
        let path = dir.join(format!("deep_{layers}.pb"));
        io::write_wire(&deep, &path).expect("writes");
        let mut load_ms = Vec::new();
        let mut plan_ms = Vec::new();
        let mut nodes = 0;
        for _ in 0..runs {
            let t0 = Instant::now();
            let graph = io::load(&path).expect("loads");
            let t1 = Instant::now();
            let p = plan(&graph, &config, &hw).expect("plans");
            let t2 = Instant::now();
            assert!(p.memory.peak_bytes.is_some());
            nodes = graph.nodes().len();
            load_ms.push((t1 - t0).as_secs_f64() * 1e3);
            plan_ms.push((t2 - t1).as_secs_f64() * 1e3);
        }
        // The first run faults in fresh memory, as a one-shot `planner plan` process does.
        let first = load_ms[0] + plan_ms[0];
        let (l, p) = (median(&mut load_ms), median(&mut plan_ms));
        println!(
            "{layers:>7} {nodes:>9} {l:>10.1} {p:>10.1} {:>10.1} {:>9.0} {first:>13.1}",
            l + p,
            (l + p) * 1e6 / nodes as f64
        );
        let _ = std::fs::remove_file(&path);
    }
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
