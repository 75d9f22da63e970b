//! Load, plan and the searches at depth (issue: DeepSeek-V3 scale). Repeats a golden layer into
//! graphs of 61 layers, ~100k and ~1M nodes, writes each as `.pb`, then times, in one process:
//! `ir::io::load`; `plan::plan` (policy, partition, verifier, diagnostics, memory simulation of
//! the plan and both baselines, cost); the plan's JSON; `--budget` (the search and the answer's
//! full plan, for a budget halfway along the frontier); and `pareto` (the search and the
//! frontier's JSON). It reports the median of several runs, the first run of load + plan apart
//! (it faults in fresh memory, as a one-shot `planner plan` process does), and each search as a
//! ratio to a plain plan of the same graph, load included in both (what the commands cost).
//!
//!     cargo bench -p planner-cli --bench scale [-- GRAPH.pb [RUNS [SEARCH_RUNS]]]

use std::{path::PathBuf, time::Instant};

use ir::io;
use ir::plan::{Format, Keep};
use planner::{
    budget::{Search, DEFAULT_STEPS},
    config::PlanConfig,
    cost::HwProfile,
    pareto,
    plan::plan,
};
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
    let search_runs: usize = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(3);
    let wire = io::read_wire(&source).expect("the source graph reads");
    let base = ir::Graph::from_wire(wire.clone()).expect("the source graph is valid");
    let per_layer = base.nodes().values().filter(|n| n.layer == Some(0)).count();
    let other = base.nodes().len() - 2 * per_layer;
    let dir = std::env::temp_dir().join(format!("planner-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    println!(
        "source {} ({per_layer} nodes/layer), keep all; median of {runs} runs ({search_runs} for \
         the searches); ms",
        source.display(),
    );
    println!(
        "{:>7} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "layers",
        "nodes",
        "load",
        "plan",
        "ns/node",
        "json",
        "first",
        "budget",
        "pareto",
        "budget×",
        "pareto×"
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
        drop(deep);
        let row = measure(&path, runs, search_runs);
        let (load, plan) = (row.load, row.plan);
        println!(
            "{layers:>7} {:>9} {load:>8.1} {plan:>8.1} {:>8.0} {:>8.1} {:>9.1} {:>9.1} {:>9.1} \
             {:>7.2} {:>7.2}",
            row.nodes,
            (load + plan) * 1e6 / row.nodes as f64,
            row.json,
            row.first,
            row.budget,
            row.pareto,
            (load + row.budget) / (load + plan),
            (load + row.pareto) / (load + plan),
        );
        let _ = std::fs::remove_file(&path);
    }
}

/// Medians, in milliseconds, and the node count.
struct Row {
    nodes: usize,
    load: f64,
    plan: f64,
    json: f64,
    first: f64,
    budget: f64,
    pareto: f64,
}

fn measure(path: &std::path::Path, runs: usize, search_runs: usize) -> Row {
    let config = PlanConfig {
        keep: Keep::All,
        ..PlanConfig::default()
    };
    let hw = HwProfile::default();
    let (mut load, mut planned, mut json) = (Vec::new(), Vec::new(), Vec::new());
    let mut nodes = 0;
    for _ in 0..runs {
        let t0 = Instant::now();
        let graph = io::load(path).expect("loads");
        let t1 = Instant::now();
        let p = plan(&graph, &config, &hw).expect("plans");
        let t2 = Instant::now();
        let text = p.encode(&graph, Format::Json);
        let t3 = Instant::now();
        assert!(p.memory.peak_bytes.is_some() && !text.is_empty());
        nodes = graph.nodes().len();
        load.push(ms(t1 - t0));
        planned.push(ms(t2 - t1));
        json.push(ms(t3 - t2));
    }
    let first = load[0] + planned[0];
    let graph = io::load(path).expect("loads");
    let (mut budget, mut pareto) = (Vec::new(), Vec::new());
    for _ in 0..search_runs {
        let default = PlanConfig::default();
        let t0 = Instant::now();
        let search = Search::new(&graph, &default, &hw).expect("searches");
        let front = pareto::frontier(&search, DEFAULT_STEPS).expect("a frontier");
        let text = pareto::json(&graph, &front);
        let t1 = Instant::now();
        let search = Search::new(&graph, &default, &hw).expect("searches");
        let (lo, hi) = (front[0].peak_bytes, front[front.len() - 1].peak_bytes);
        let answer = search.within(lo + (hi - lo) / 2).expect("an answer");
        let t2 = Instant::now();
        assert!(!text.is_empty() && !answer.has_errors());
        pareto.push(ms(t1 - t0));
        budget.push(ms(t2 - t1));
    }
    Row {
        nodes,
        load: median(&mut load),
        plan: median(&mut planned),
        json: median(&mut json),
        first,
        budget: median(&mut budget),
        pareto: median(&mut pareto),
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
