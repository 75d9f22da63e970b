//! Times the stages of `planner plan --budget` and `planner pareto` on one graph, single
//! process, each stage as the search reports it:
//!
//!     cargo run --release -p planner-cli --example profile_search -- GRAPH.pb [BUDGET]
//!
//! Without BUDGET, the budget is halfway between the smallest and the largest frontier peak.

use std::{path::Path, sync::Mutex, time::Instant};

use planner::{budget::Search, config::PlanConfig, cost::HwProfile, pareto, progress::Progress};

/// The `planner` binary's allocator settings (the same file).
#[path = "../src/allocator.rs"]
mod allocator;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Prints the wall and CPU time each stage took, and how many runs or plans it reported.
struct Stages(Mutex<(Instant, f64, String, u64)>);

impl Stages {
    fn lap(&self, next: &str) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let cpu = cpu_ms();
        if !s.2.is_empty() {
            println!(
                "{:>9.1} ms wall {:>9.1} ms cpu  {:>5} plans  {}",
                s.0.elapsed().as_secs_f64() * 1e3,
                cpu - s.1,
                s.3,
                s.2
            );
        }
        *s = (Instant::now(), cpu, next.to_owned(), 0);
    }
}

/// CPU time of the process so far (user and system), from `/proc/self/stat` (Linux; 0
/// elsewhere).
fn cpu_ms() -> f64 {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let fields: Vec<&str> = s.rsplit(')').next()?.split_whitespace().collect();
            let user: f64 = fields.get(11)?.parse().ok()?;
            let system: f64 = fields.get(12)?.parse().ok()?;
            Some(user + system)
        });
    // Clock ticks are 100 per second on Linux.
    ticks.unwrap_or(0.0) * 10.0
}

impl Progress for Stages {
    fn stage(&self, what: &str, _: Option<u64>) {
        self.lap(what);
    }

    fn advance(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).3 += 1;
    }
}

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: profile_search GRAPH.pb [BUDGET]");
        std::process::exit(2);
    };
    allocator::keep_freed_memory();
    let budget: Option<u64> = std::env::args().nth(2).and_then(|b| b.parse().ok());
    let stages = Stages(Mutex::new((Instant::now(), 0.0, String::new(), 0)));
    stages.lap("load");
    let graph = ir::io::load(Path::new(&path)).unwrap_or_else(|e| panic!("{e}"));
    let hw = HwProfile::default();
    let search = Search::with_progress(&graph, &PlanConfig::default(), &hw, &stages)
        .unwrap_or_else(|e| panic!("{e}"));
    let front = pareto::frontier(&search, 32).unwrap_or_else(|e| panic!("{e}"));
    let budget = budget.unwrap_or_else(|| {
        let (lo, hi) = (front[0].peak_bytes, front[front.len() - 1].peak_bytes);
        lo + (hi - lo) / 2
    });
    let plan = search.within(budget).unwrap_or_else(|e| panic!("{e}"));
    stages.lap("");
    println!(
        "{} nodes, {} frontier points, budget {budget} B: peak {} B, replay {:.4e} s",
        graph.nodes().len(),
        front.len(),
        plan.memory.peak_bytes.unwrap_or(0),
        plan.cost.replay_time_s
    );
}
