//! Times the phases of `planner plan` on one graph, each once, single process:
//!
//!     cargo run --release -p planner-cli --example profile_plan -- GRAPH.pb
//!
//! For finding where time goes; the benchmark of record is `cargo bench -p planner-cli --bench scale`.

use std::{path::Path, time::Instant};

use ir::plan::{Format, Keep};
use planner::{
    config::{self, PlanConfig},
    cost::HwProfile,
    diagnostics, memory, partition, plan, policy, render,
};

/// The `planner` binary's allocator settings (the same file).
#[path = "../src/allocator.rs"]
mod allocator;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: profile_plan GRAPH.pb");
        std::process::exit(2);
    };
    allocator::keep_freed_memory();
    let mut clock = Clock(Instant::now());
    let graph = ir::io::load(Path::new(&path)).unwrap_or_else(|e| panic!("{e}"));
    clock.lap(&format!("load ({} nodes)", graph.nodes().len()));
    let config = PlanConfig {
        keep: Keep::All,
        ..PlanConfig::default()
    };
    let hw = HwProfile::default();
    let resolved = config::resolve(&graph, &config).unwrap_or_else(|e| panic!("{e}"));
    clock.lap("resolve");
    let policy = policy::apply(&graph, &config, &resolved);
    clock.lap("policy");
    let part = partition::partition(&graph, &policy, config.executor);
    clock.lap("partition");
    partition::verify(&graph, &policy, &part).unwrap_or_else(|e| panic!("{e}"));
    clock.lap("verify");
    let sim = memory::simulate(&graph, &part.order, &part.replays);
    clock.lap("simulate");
    let diags = diagnostics::diagnose(&graph, &config, &resolved, &policy, Some(&part));
    clock.lap(&format!("diagnose ({})", diags.len()));
    let p = plan::plan(&graph, &config, &hw).unwrap_or_else(|e| panic!("{e}"));
    clock.lap(&format!("plan::plan (peak {})", sim.peak_bytes));
    let text = render::text(&p, &graph);
    clock.lap(&format!("render text ({} B)", text.len()));
    let json = p.encode(&graph, Format::Json);
    clock.lap(&format!("render json ({} B)", json.len()));
    drop((p, part, policy));
    clock.lap("drop plan");
    drop(graph);
    clock.lap("drop graph");
}

struct Clock(Instant);

impl Clock {
    fn lap(&mut self, what: &str) {
        println!(
            "{:>8.1} ms  {:>6} MB resident  {what}",
            self.0.elapsed().as_secs_f64() * 1e3,
            resident_mb()
        );
        self.0 = Instant::now();
    }
}

/// Resident set size from `/proc/self/statm` (Linux), `?` elsewhere.
fn resident_mb() -> String {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok());
    pages.map_or_else(|| "?".to_owned(), |p| (p * 4096 / 1_000_000).to_string())
}
